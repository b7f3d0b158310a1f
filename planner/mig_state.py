"""The MIG mode of a GPU while planning: its instances (profile, start) and what each way to add
one costs, with the driver's placement rules as bitmasks.

Options are ranked by `Cost` (see planner/types.py) and, among equal changes, by how many
placements the remaining free memory slices still allow (placement-aware packing)."""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from functools import cache
from itertools import chain
from operator import attrgetter

import numpy as np

from dynpart.mig import MigRules
from dynpart.planner.problem import GpuInfo
from dynpart.planner.types import Cost, CreateSlice, MigSliceRef, Option, ReuseSlice, SliceRef, drop_free
from dynpart.snapshot import GpuLayout, MigInstance, PlacedSlice


@cache
def _flex_table(rules: MigRules) -> tuple[int, ...]:
    """For each mask of occupied memory slices: the memory of all placements that still fit."""
    table = []
    for occupied in range(rules.full_mask + 1):
        table.append(sum(rules.memory[p] for p, pl in enumerate(rules.placements)
                         for _, m in pl if not occupied & m))
    return tuple(table)


@cache
def _left_table(rules: MigRules) -> tuple[int, ...]:
    """For each mask of occupied memory slices: how many memory slices are left free."""
    return tuple((rules.full_mask & ~occupied).bit_count() for occupied in range(rules.full_mask + 1))


@cache
def _best_free_placement(rules: MigRules, p: int, occupied: int, hard: int) -> tuple[int, int, int] | None:
    """(start, memory slices left, -flexibility) of the placement of profile p clear of the
    `occupied` memory slices that leaves the fewest slices free, then the most placements, then
    the lowest start; None if there is none. Many GPUs share their masks: computed once."""
    left, flex = _left_table(rules), _flex_table(rules)
    best: tuple[int, int, int] | None = None
    for start, m in rules.placements[p]:
        if not occupied & m:
            after = hard | m
            if best is None or (left[after], -flex[after]) < best[1:]:
                best = (start, left[after], -flex[after])
    return best


def placement_code(rules: MigRules, p: int, start: int) -> int:
    """Instances that share no memory slice (those in use on a GPU) as one integer: the sum of
    their codes, the digit p + 1 at the place `start` in base (profiles + 1)."""
    return int((p + 1) * (len(rules.memory) + 1) ** start)


def code_placements(rules: MigRules, code: int) -> list[tuple[int, int]]:
    """The (profile, start) pairs of a sum of `placement_code`s, by start."""
    base = len(rules.memory) + 1
    out = []
    for start in range(rules.model.memory_slices):
        code, digit = divmod(code, base)
        if digit:
            out.append((digit - 1, start))
    return out


@dataclass(slots=True)
class MigInst:
    p: int  # profile index in MigRules
    start: int
    used: bool  # in use now (never moved or destroyed)
    pod: str | None  # using pod, or the pending pod planned onto it
    existing: bool  # exists now (else created by the plan)

    @property
    def hard(self) -> bool:
        return self.used or self.pod is not None


class _Shape:
    """What the options of a GPU depend on, gathered in one pass over its instances in start
    order, given as (profile, start, hard): memory masks (all instances, hard ones), per-profile
    counts, compute and media in use, the code of the hard instances (`placement_code`), and
    each instance's profile, start, mask and hardness. Kept by the state until it changes."""

    __slots__ = ("occupied", "hard", "counts", "compute", "media", "profiles", "starts", "masks", "hards", "free",
                 "code")

    def __init__(self, rules: MigRules, insts: Sequence[tuple[int, int, bool]]):
        mask_of, code_of = _instance_tables(rules)
        compute, media = rules.compute, rules.media
        occupied = hard = used_compute = used_media = code = 0
        counts = [0] * len(rules.memory)
        masks, free = [], []
        for k, (q, start, is_hard) in enumerate(insts):
            m = mask_of[q][start]
            masks.append(m)
            occupied |= m
            if is_hard:
                hard |= m
                code += code_of[q][start]
            else:
                free.append(k)
            counts[q] += 1
            used_compute += compute[q]
            used_media += media[q]
        self.occupied, self.hard, self.compute, self.media, self.code = occupied, hard, used_compute, used_media, code
        self.counts = tuple(counts)
        profiles: tuple[int, ...] = ()
        starts: tuple[int, ...] = ()
        hards: tuple[bool, ...] = ()
        if insts:
            profiles, starts, hards = zip(*insts)
        self.profiles, self.starts, self.hards = profiles, starts, hards
        self.masks = tuple(masks)
        self.free = tuple(free)


@cache
def _instance_tables(rules: MigRules) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per profile and start: the instance's memory mask and its `placement_code` (a `_Shape`
    is built for most GPUs of a cluster: looked up, not computed, each time)."""
    starts = range(rules.model.memory_slices)
    masks = tuple(tuple(((1 << mem) - 1) << start for start in starts) for mem in rules.memory)
    codes = tuple(tuple(placement_code(rules, p, start) for start in starts) for p in range(len(rules.memory)))
    return masks, codes


@cache
def _instance_arrays(rules: MigRules) -> tuple[np.ndarray, np.ndarray]:
    """`_instance_tables` as arrays indexed [profile, start]."""
    masks, codes = _instance_tables(rules)
    return np.array(masks, dtype=np.int64), np.array(codes, dtype=np.int64)


def _layout_of(info: GpuInfo) -> list[tuple[int, int, bool]]:
    """A GPU's instances as they are, (profile, start, hard) in start order (the order of a
    `MigState`'s instances: the used ones and the free ones, each in start order, merged)."""
    used = [(p, start, True) for p, start, _ in info.used_mig]
    if not info.free_mig:
        return used
    return sorted(used + [(p, start, False) for p, start in info.free_mig], key=_start_of)


def _start_of(inst: tuple[int, int, bool]) -> int:
    return inst[1]


# the model's name, whether the plan changed the GPU, and its instances (profile, start, hard)
# in start order (a tuple: hashed in C, faster than packing them into one integer)
MigKey = tuple[str, bool, tuple[tuple[int, int, bool], ...]]

_by_start = attrgetter("start")


class MigState:
    """One MIG GPU; implements `GpuState` (planner/state.py). Its instances are built from the
    `GpuInfo` when first read: on a large cluster most GPUs are only bucketed and costed, which
    their `_Shape` is enough for."""

    __slots__ = ("info", "rules", "_insts", "changed", "destroyed", "created", "_shape", "_as_is")

    def __init__(self, info: GpuInfo):
        assert info.rules is not None
        self.info = info
        self.rules: MigRules = info.rules
        self._insts: list[MigInst] | None = None
        self.changed = False
        self.destroyed = 0
        self.created = 0
        self._shape: _Shape | None = None
        # its instances as (profile, start, hard), read from `info` (for its key, then its row of
        # `MigRows`: read once; `compile_cluster` reads them with the snapshot's)
        self._as_is: Sequence[tuple[int, int, bool]] | None = info.mig_layout

    @property
    def insts(self) -> list[MigInst]:
        insts = self._insts
        if insts is None:
            info = self.info
            insts = [MigInst(p, s, True, pod, True) for p, s, pod in info.used_mig]
            if info.free_mig:
                insts += [MigInst(p, s, False, None, True) for p, s in info.free_mig]
                insts.sort(key=_by_start)
            self._insts = insts
        return insts

    @insts.setter
    def insts(self, insts: list[MigInst]) -> None:
        self._insts = insts

    def clone(self) -> MigState:
        c = MigState.__new__(MigState)
        c.info, c.rules, c.changed, c.destroyed, c.created = self.info, self.rules, self.changed, self.destroyed, self.created
        c._insts = None if self._insts is None else [MigInst(i.p, i.start, i.used, i.pod, i.existing) for i in self._insts]
        c._shape, c._as_is = self._shape, self._as_is
        return c

    def instances(self) -> Sequence[tuple[int, int, bool]]:
        """Its instances as (profile, start, hard) in start order (read only)."""
        if self._shape is not None:
            return list(zip(self._shape.profiles, self._shape.starts, self._shape.hards))
        if self._insts is None:
            if self._as_is is None:
                self._as_is = _layout_of(self.info)
            return self._as_is
        return [(i.p, i.start, i.used or i.pod is not None) for i in self._insts]

    def key(self) -> MigKey:
        return (self.rules.model.name, self.changed, tuple(self.instances()))

    def has_pod(self) -> bool:
        if self._insts is None:
            return bool(self.info.used_mig)  # as it is: the used instances are the hard ones
        return any(i.hard for i in self._insts)

    def _layout(self) -> _Shape:
        shape = self._shape
        if shape is None:
            shape = self._shape = _Shape(self.rules, self.instances())
        return shape

    def hard_code(self) -> int:
        """The instances in use or planned, as `placement_code`s summed."""
        if self._shape is None and self._insts is None:
            code_of = _instance_tables(self.rules)[1]
            return sum([code_of[p][start] for p, start, _ in self.info.used_mig])
        return self._layout().code

    def start_of(self, option: Option) -> int:
        """The start of the instance that `option` (from `option()`) gives the pod."""
        if isinstance(option, ReuseSlice):
            return self._layout().starts[option.index]
        assert isinstance(option, CreateSlice)
        return option.start

    # --- hosting a pending pod's slice ------------------------------------------------------

    def option(self, ask: SliceRef) -> Option | None:
        if not isinstance(ask, MigSliceRef):
            return None
        p = self.rules.index.get(ask.profile)
        return None if p is None else self._option(p)

    def _option(self, p: int) -> Option | None:
        """Cheapest way to host one instance of profile p: reuse a free one, else create one
        without destroying anything (always cheaper than destroying), else destroy the fewest."""
        rules = self.rules
        shape = self._layout()
        left, flex = _left_table(rules), _flex_table(rules)
        hard = shape.hard
        empty = 0 if hard else 1
        best: Cost | None = None
        best_at = 0
        for k in shape.free:
            if shape.profiles[k] == p:
                after = hard | shape.masks[k]
                cost = (0, empty, left[after], -flex[after])
                if best is None or cost < best:
                    best, best_at = cost, k
        if best is not None:
            return ReuseSlice(best, best_at)
        touch = 0 if self.changed else 1
        compute, media, max_compute = rules.compute, rules.media, rules.model.compute_slices
        if shape.counts[p] < rules.max_count[p] and shape.compute + compute[p] <= max_compute \
                and not (media[p] and shape.media):
            fit = _best_free_placement(rules, p, shape.occupied, hard)
            if fit is not None:
                return CreateSlice((touch, empty, fit[1], fit[2]), fit[0], ())
        best_destroy: tuple[int, ...] = ()
        for start, m in rules.placements[p]:
            if hard & m:
                continue
            destroy = tuple(k for k, mk in enumerate(shape.masks) if mk & m)
            count, c, me = shape.counts[p], shape.compute, shape.media
            for k in destroy:
                q = shape.profiles[k]
                count -= q == p
                c -= compute[q]
                me -= media[q]
            # `MigRules.can_add` once the overlapping free instances are gone
            if not (count < rules.max_count[p] and c + compute[p] <= max_compute and not (media[p] and me)):
                continue
            after = hard | m
            cost = (len(destroy) + touch, empty, left[after], -flex[after])
            if best is None or cost < best:
                best, best_at, best_destroy = cost, start, destroy
        return None if best is None else CreateSlice(best, best_at, best_destroy)

    def apply(self, ask: SliceRef, option: Option, pod: str) -> None:
        self._shape = None
        if isinstance(option, ReuseSlice):
            self.insts[option.index].pod = pod
            return
        assert isinstance(option, CreateSlice) and isinstance(ask, MigSliceRef), "not a MIG option"
        destroyed, undone = drop_free(self.insts, option.destroy)
        self.destroyed += destroyed
        self.created -= undone
        self.insts.append(MigInst(self.rules.index[ask.profile], option.start, False, pod, False))
        self.insts.sort(key=lambda i: i.start)
        self.created += 1
        self.changed = True

    def free_slots(self, ask: SliceRef) -> list[int]:
        p = self.rules.index.get(ask.profile) if isinstance(ask, MigSliceRef) else None
        return [k for k, i in enumerate(self.insts) if p is not None and i.p == p and not i.hard]

    def bind(self, slot: int, ask: SliceRef, pod: str) -> None:
        self._shape = None
        self.insts[slot].pod = pod

    def unbind(self, pod: str) -> None:
        self._shape = None
        for inst in self.insts:
            if inst.pod == pod and not inst.used:
                inst.pod = None

    # --- rewriting the layout ---------------------------------------------------------------

    def set_geometry(self, geometry: Set[tuple[str, int]]) -> None:
        """Rewrite the GPU to `geometry` (profile, start) pairs, which must keep every instance
        that is used or planned in place; counts what is created and destroyed."""
        names = self.rules.names
        existing = {(names[i.p], i.start): i for i in self.insts}
        assert all((names[i.p], i.start) in geometry for i in self.insts if i.hard), "never touch a used slice"
        insts = []
        created = 0
        for name, start in sorted(geometry, key=lambda pl: pl[1]):
            inst = existing.get((name, start))
            if inst is None:
                inst = MigInst(self.rules.index[name], start, False, None, False)
                created += 1
            insts.append(inst)
        destroyed = sum(1 for key, i in existing.items() if i.existing and key not in geometry)
        self.created += created
        self.destroyed += destroyed
        self.changed = self.changed or bool(created or destroyed)
        self.insts = insts
        self._shape = None

    # --- the result -------------------------------------------------------------------------

    # (pydantic validates these few plain fields faster than `model_construct` assigns them)

    def layout(self) -> GpuLayout:
        names = self.rules.names
        return GpuLayout(
            index=self.info.index, mps=[], whole_pod=None,
            mig=[MigInstance(profile=names[i.p], start=i.start, used=i.used, pod=i.pod) for i in self.insts],
            changed=self.changed, created=self.created, destroyed=self.destroyed,
        )

    def slices_held_by(self, pod: str) -> list[PlacedSlice]:
        names, gpu = self.rules.names, self.info.index
        return [PlacedSlice(gpu=gpu, kind="mig", profile=names[i.p], start=i.start, size=None)
                for i in self.insts if i.pod == pod]


# --- the cheapest options of many GPUs at once --------------------------------------------------

# packing of (memory slices left, -flexibility) into one integer, lower is better
_LEFT_SHIFT = 20
_FLEX_OFFSET = 1 << 16


@cache
def _cost_tables(rules: MigRules) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per mask of occupied memory slices: slices left free, -flexibility, and both packed
    (`_LEFT_SHIFT`); per profile index, with one more (0) for none: compute and media slices."""
    left = np.array(_left_table(rules), dtype=np.int64)
    neg_flex = -np.array(_flex_table(rules), dtype=np.int64)
    assert int(-neg_flex.min()) < _FLEX_OFFSET
    compute = np.array(rules.compute + (0,), dtype=np.int64)
    media = np.array(rules.media + (False,), dtype=np.int64)
    return left, neg_flex, (left << _LEFT_SHIFT) + neg_flex + _FLEX_OFFSET, compute, media


class MigRows:
    """MIG GPU states of one model as arrays, one row per state: what `MigState.option` reads
    of them, so that the cheapest option of many states is found with numpy at once (`costs`),
    the same option `MigState.option` finds for each."""

    def __init__(self, rules: MigRules):
        self.rules = rules
        self.width = rules.model.memory_slices  # the most instances a GPU can have
        # per field, the rows so far and room for more (the filled part: `count` rows)
        self._arrays: dict[str, np.ndarray] = {}
        self.count = 0

    def add(self, states: Sequence[MigState]) -> int:
        """Add a row for each of `states` (not modified afterwards); returns the first's index.
        All at once with numpy, from the states' instances (a cluster's buckets: thousands of
        states, whose `_Shape`s are not built for this)."""
        first, n = self.count, len(states)
        if not n:
            return first
        rules, width = self.rules, self.width
        none = len(rules.memory)  # the profile of a pad instance
        layouts = [s.instances() for s in states]
        sizes = np.fromiter(map(len, layouts), dtype=np.int64, count=n)
        total = int(sizes.sum())
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(layouts)), dtype=np.int64,
                           count=3 * total).reshape(total, 3)
        p, start, is_hard = flat[:, 0], flat[:, 1], flat[:, 2].astype(bool)
        row = np.repeat(np.arange(n), sizes)
        col = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # place in its row
        mask_of, code_of = _instance_arrays(rules)
        _, _, _, compute_of, media_of = _cost_tables(rules)
        mask = mask_of[p, start]
        profiles = np.full((n, width), none, dtype=np.int64)
        starts, masks, free, hard_masks = (np.zeros((n, width), dtype=np.int64) for _ in range(4))
        profiles[row, col], starts[row, col], masks[row, col] = p, start, mask
        free[row, col], hard_masks[row, col] = ~is_hard, np.where(is_hard, mask, 0)
        codes = np.zeros(n, dtype=np.int64)
        np.add.at(codes, row[is_hard], code_of[p, start][is_hard])
        new = {
            "profiles": profiles, "starts": starts, "masks": masks, "free": free,
            "hard": np.bitwise_or.reduce(hard_masks, axis=1), "occupied": np.bitwise_or.reduce(masks, axis=1),
            "counts": np.bincount(row * (none + 1) + p, minlength=n * (none + 1)).reshape(n, none + 1)[:, :none],
            "compute": compute_of[profiles].sum(axis=1), "media": media_of[profiles].sum(axis=1),
            "changed": np.fromiter((s.changed for s in states), dtype=np.int64, count=n), "codes": codes,
        }
        end = first + n
        for name, values in new.items():
            old = self._arrays.get(name)
            if old is None or len(old) < end:  # room for twice as many rows
                grown = np.zeros((2 * end,) + values.shape[1:], dtype=np.int64)
                if old is not None:
                    grown[:first] = old[:first]
                old = self._arrays[name] = grown
            old[first:end] = values
        self.count = end
        return first

    def _field(self, name: str) -> np.ndarray:
        return self._arrays[name][: self.count]

    def costs(self, rows: np.ndarray, p: int) -> tuple[np.ndarray, ...]:
        """For each row, the cheapest way to host one instance of profile p, as `MigState._option`
        chooses it: (found, changes, empty, slices left, -flexibility, start of the instance),
        all 0 where there is none."""
        rules = self.rules
        left_of, neg_flex_of, packed_of, compute_of, media_of = _cost_tables(rules)
        field = self._field
        profiles, starts, masks = field("profiles")[rows], field("starts")[rows], field("masks")[rows]
        free = field("free")[rows].astype(bool)
        hard, occupied, count = field("hard")[rows], field("occupied")[rows], field("counts")[rows, p]
        compute, media, touch = field("compute")[rows], field("media")[rows], 1 - field("changed")[rows]
        n = len(rows)
        chg = np.full(n, NO_OPTION_CHANGES, dtype=np.int64)
        after = np.zeros(n, dtype=np.int64)  # the occupied memory slices the option leaves
        start = np.zeros(n, dtype=np.int64)
        ids = np.arange(n)
        # reuse a free instance of p: the one leaving the fewest slices, then the most placements
        reusable = free & (profiles == p)
        key = np.where(reusable, packed_of[hard[:, None] | masks], _NOTHING)
        k = key.argmin(axis=1)
        todo = reusable.any(axis=1)
        chg[todo], after[todo], start[todo] = 0, (hard | masks[ids, k])[todo], starts[ids, k][todo]
        # create one clear of every instance
        allowed = ~todo & (count < rules.max_count[p]) & (compute + rules.compute[p] <= rules.model.compute_slices)
        if rules.media[p]:
            allowed &= media == 0
        places = rules.placements[p]
        key = np.stack([np.where(allowed & (occupied & m == 0), packed_of[hard | m], _NOTHING) for _, m in places], axis=1)
        i = key.argmin(axis=1)
        todo = key[ids, i] < _NOTHING
        place_mask = np.array([m for _, m in places], dtype=np.int64)
        place_start = np.array([st for st, _ in places], dtype=np.int64)
        chg[todo], after[todo], start[todo] = touch[todo], (hard | place_mask[i])[todo], place_start[i][todo]
        # destroy the fewest free instances (rows without a cheaper way)
        rest = np.flatnonzero(chg == NO_OPTION_CHANGES)
        if len(rest):
            masks_r, hard_r, touch_r = masks[rest], hard[rest], touch[rest]
            of_p = profiles[rest] == p
            inst_compute, inst_media = compute_of[profiles[rest]], media_of[profiles[rest]]
            count_r, compute_r, media_r = count[rest], compute[rest], media[rest]
            keys = []
            for _, m in places:
                gone = (masks_r & m) != 0
                ok = (hard_r & m == 0) & (count_r - (gone & of_p).sum(axis=1) < rules.max_count[p]) \
                    & (compute_r - (gone * inst_compute).sum(axis=1) + rules.compute[p] <= rules.model.compute_slices)
                if rules.media[p]:
                    ok &= media_r - (gone * inst_media).sum(axis=1) == 0
                keys.append(np.where(ok, ((gone.sum(axis=1) + touch_r) << _CHANGES_SHIFT) + packed_of[hard_r | m], _NOTHING))
            key = np.stack(keys, axis=1)
            i = key.argmin(axis=1)
            best = key[np.arange(len(rest)), i]
            found = best < _NOTHING
            at = rest[found]
            chg[at] = best[found] >> _CHANGES_SHIFT
            after[at], start[at] = (hard_r | place_mask[i])[found], place_start[i][found]
        found = chg < NO_OPTION_CHANGES
        return (found, np.where(found, chg, 0), np.where(found, (hard == 0).astype(np.int64), 0),
                np.where(found, left_of[after], 0), np.where(found, neg_flex_of[after], 0), np.where(found, start, 0))

    def codes(self, rows: np.ndarray) -> np.ndarray:
        """Per row, the code of its instances in use or planned (`MigState.hard_code`)."""
        codes: np.ndarray = self._field("codes")[rows]
        return codes


# changes of a row without an option (while they are sought); keys of what cannot be chosen
NO_OPTION_CHANGES = np.iinfo(np.int64).max // 4
_NOTHING = np.iinfo(np.int64).max
_CHANGES_SHIFT = 40
