"""The MIG mode of a GPU while planning: its instances (profile, start) and what each way to add
one costs, with the driver's placement rules as bitmasks.

Options are ranked by `Cost` (see planner/types.py) and, among equal changes, by how many
placements the remaining free memory slices still allow (placement-aware packing)."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from functools import cache

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


MigKey = tuple[str, tuple[tuple[int, int, bool], ...], bool]


class MigState:
    """One MIG GPU; implements `GpuState` (planner/state.py)."""

    __slots__ = ("info", "rules", "insts", "changed", "destroyed", "created")

    def __init__(self, info: GpuInfo):
        assert info.rules is not None
        self.info = info
        self.rules: MigRules = info.rules
        self.insts = [MigInst(p, s, True, pod, True) for p, s, pod in info.used_mig]
        self.insts += [MigInst(p, s, False, None, True) for p, s in info.free_mig]
        self.insts.sort(key=lambda i: i.start)
        self.changed = False
        self.destroyed = 0
        self.created = 0

    def clone(self) -> MigState:
        c = MigState.__new__(MigState)
        c.info, c.rules, c.changed, c.destroyed, c.created = self.info, self.rules, self.changed, self.destroyed, self.created
        c.insts = [MigInst(i.p, i.start, i.used, i.pod, i.existing) for i in self.insts]
        return c

    def key(self) -> MigKey:
        return (self.rules.model.name, tuple((i.start, i.p, i.hard) for i in self.insts), self.changed)

    def has_pod(self) -> bool:
        return any(i.hard for i in self.insts)

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
        full = rules.full_mask
        flex = _flex_table(rules)
        memory = rules.memory
        hard = occ = compute = media = 0
        counts = [0] * len(memory)
        for i in self.insts:
            m = ((1 << memory[i.p]) - 1) << i.start
            occ |= m
            if i.hard:
                hard |= m
            counts[i.p] += 1
            compute += rules.compute[i.p]
            media += rules.media[i.p]
        empty = 0 if hard else 1
        best: Cost | None = None
        best_at = 0
        for k, inst in enumerate(self.insts):
            if inst.p == p and not inst.hard:
                after = hard | (((1 << memory[p]) - 1) << inst.start)
                cost = (0, empty, (full & ~after).bit_count(), -flex[after])
                if best is None or cost < best:
                    best, best_at = cost, k
        if best is not None:
            return ReuseSlice(best, best_at)
        touch = 0 if self.changed else 1
        if rules.can_add(p, 0, 0, counts, compute, media):
            for start, m in rules.placements[p]:
                if not occ & m:
                    after = hard | m
                    cost = (touch, empty, (full & ~after).bit_count(), -flex[after])
                    if best is None or cost < best:
                        best, best_at = cost, start
            if best is not None:
                return CreateSlice(best, best_at, ())
        best_destroy: tuple[int, ...] = ()
        for start, m in rules.placements[p]:
            if hard & m:
                continue
            destroy = tuple(k for k, i in enumerate(self.insts) if (((1 << memory[i.p]) - 1) << i.start) & m)
            left = list(counts)
            c, me = compute, media
            for k in destroy:
                q = self.insts[k].p
                left[q] -= 1
                c -= rules.compute[q]
                me -= rules.media[q]
            if not rules.can_add(p, start, 0, left, c, me):
                continue
            after = hard | m
            cost = (len(destroy) + touch, empty, (full & ~after).bit_count(), -flex[after])
            if best is None or cost < best:
                best, best_at, best_destroy = cost, start, destroy
        return None if best is None else CreateSlice(best, best_at, best_destroy)

    def apply(self, ask: SliceRef, option: Option, pod: str) -> None:
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
        self.insts[slot].pod = pod

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

    # --- the result -------------------------------------------------------------------------

    def layout(self) -> GpuLayout:
        names = self.rules.names
        return GpuLayout.model_construct(
            index=self.info.index, mps=[], whole_pod=None,
            mig=[MigInstance.model_construct(profile=names[i.p], start=i.start, used=i.used, pod=i.pod) for i in self.insts],
            changed=self.changed, created=self.created, destroyed=self.destroyed,
        )

    def slices_held_by(self, pod: str) -> list[PlacedSlice]:
        names, gpu = self.rules.names, self.info.index
        return [PlacedSlice.mig(gpu, names[i.p], i.start) for i in self.insts if i.pod == pod]
