"""Mutable per-GPU layouts used while planning, with the cost of each way to add a slice.

An option to host one slice on one GPU costs, in the planner's objective order:
  change  = free slices destroyed + 1 if the GPU was not changed yet (each change drains and
            reconfigures a device),
  empty   = 1 if the GPU hosts no pod yet (keep whole GPUs empty where possible),
and is then ranked by best fit (least capacity left over) and, for MIG, by how many placements
the remaining free memory slices still allow (placement-aware packing).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from dynpart.mig import MigRules
from dynpart.planner.problem import KIND_GPU, KIND_MIG, GpuInfo

# (change, empty, leftover, -flex)
Cost = tuple[int, int, int, int]


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
    p: int
    start: int
    used: bool  # in use now (never moved or destroyed)
    pod: str | None  # using pod, or the pending pod planned onto it
    existing: bool  # exists now (else created by the plan)

    @property
    def hard(self) -> bool:
        return self.used or self.pod is not None


class MigState:
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

    def key(self) -> tuple:
        return (self.rules.model.name, tuple((i.start, i.p, i.hard) for i in self.insts), self.changed)

    def hard_mask(self) -> int:
        m = 0
        for i in self.insts:
            if i.hard:
                m |= self.rules.mask(i.p, i.start)
        return m

    def has_pod(self) -> bool:
        return any(i.hard for i in self.insts)

    def option(self, p: int) -> tuple[Cost, int, tuple[int, ...]] | None:
        """Cheapest way to host one instance of profile p: (cost, start, indices to destroy).
        start = -1 - k means: reuse the existing free instance insts[k]."""
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
        best: tuple[Cost, int, tuple[int, ...]] | None = None
        for k, inst in enumerate(self.insts):
            if inst.p == p and not inst.hard:
                after = hard | (((1 << memory[p]) - 1) << inst.start)
                cost = (0, empty, (full & ~after).bit_count(), -flex[after])
                if best is None or cost < best[0]:
                    best = (cost, -1 - k, ())
        if best is not None:
            return best
        touch = 0 if self.changed else 1
        # Without destroying anything: always cheaper than any option that destroys.
        if rules.can_add(p, 0, 0, counts, compute, media):
            for start, m in rules.placements[p]:
                if not occ & m:
                    after = hard | m
                    cost = (touch, empty, (full & ~after).bit_count(), -flex[after])
                    if best is None or cost < best[0]:
                        best = (cost, start, ())
            if best is not None:
                return best
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
            if best is None or cost < best[0]:
                best = (cost, start, destroy)
        return best

    def set_geometry(self, geometry: frozenset) -> None:
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

    def apply(self, p: int, start: int, destroy: tuple[int, ...], pod: str) -> None:
        if start < 0:
            self.insts[-1 - start].pod = pod
            return
        for k in sorted(destroy, reverse=True):
            assert not self.insts[k].hard, "never destroy a used slice"
            if self.insts[k].existing:
                self.destroyed += 1
            else:
                self.created -= 1
            del self.insts[k]
        self.insts.append(MigInst(p, start, False, pod, False))
        self.insts.sort(key=lambda i: i.start)
        self.created += 1
        self.changed = True


@dataclass(slots=True)
class MpsPiece:
    size: int
    used: bool
    pod: str | None
    existing: bool

    @property
    def hard(self) -> bool:
        return self.used or self.pod is not None


class MpsState:
    __slots__ = ("info", "cap", "slices", "whole_pod", "whole_existing", "changed", "destroyed", "created")

    def __init__(self, info: GpuInfo):
        self.info = info
        self.cap = info.capacity
        self.slices = [MpsPiece(s, True, pod, True) for s, pod in info.used_mps]
        self.slices += [MpsPiece(s, False, None, True) for s in info.free_mps]
        self.whole_pod = info.whole_pod
        self.whole_existing = info.whole_pod is not None
        self.changed = False
        self.destroyed = 0
        self.created = 0

    def clone(self) -> MpsState:
        c = MpsState.__new__(MpsState)
        c.info, c.cap, c.whole_pod, c.whole_existing = self.info, self.cap, self.whole_pod, self.whole_existing
        c.changed, c.destroyed, c.created = self.changed, self.destroyed, self.created
        c.slices = [MpsPiece(s.size, s.used, s.pod, s.existing) for s in self.slices]
        return c

    def key(self) -> tuple:
        return (self.cap, tuple(sorted((s.size, s.hard) for s in self.slices)), self.changed,
                self.whole_pod is not None)

    def has_pod(self) -> bool:
        return self.whole_pod is not None or any(s.hard for s in self.slices)

    def option(self, size: int) -> tuple[Cost, int, tuple[int, ...]] | None:
        """Cheapest way to host one slice of `size` (size 0 = the whole GPU)."""
        if self.whole_pod is not None:
            return None
        hard_total = sum(s.size for s in self.slices if s.hard)
        empty = 0 if hard_total or any(s.hard for s in self.slices) else 1
        touch = 0 if self.changed else 1
        if size == 0:
            if any(s.hard for s in self.slices):
                return None
            k = len(self.slices)
            return ((k + (touch if k else 0), empty, 0, 0), -1, tuple(range(k)))
        for k, s in enumerate(self.slices):
            if not s.hard and s.size == size:
                return ((0, empty, self.cap - hard_total - size, 0), -1 - k, ())
        unallocated = self.cap - sum(s.size for s in self.slices)
        leftover = self.cap - hard_total - size
        if leftover < 0:
            return None
        destroy: list[int] = []
        if unallocated < size:
            free = sorted((k for k, s in enumerate(self.slices) if not s.hard),
                          key=lambda k: (-self.slices[k].size, k))
            for k in free:
                destroy.append(k)
                unallocated += self.slices[k].size
                if unallocated >= size:
                    break
        return ((len(destroy) + touch, empty, leftover, 0), 0, tuple(sorted(destroy)))

    def replace_free_slices(self, sizes: list[int]) -> None:
        """Drop every free slice and create new ones of the given sizes (used slices stay)."""
        kept = [s for s in self.slices if s.hard]
        self.destroyed += sum(1 for s in self.slices if not s.hard and s.existing)
        self.slices = kept + [MpsPiece(size, False, None, False) for size in sizes]
        self.created += len(sizes)
        self.changed = True

    def apply(self, size: int, start: int, destroy: tuple[int, ...], pod: str) -> None:
        if size and start < 0:  # reuse an existing free slice
            self.slices[-1 - start].pod = pod
            return
        for k in sorted(destroy, reverse=True):
            assert not self.slices[k].hard, "never destroy a used slice"
            if self.slices[k].existing:
                self.destroyed += 1
            else:
                self.created -= 1
            del self.slices[k]
        if destroy:
            self.changed = True
        if size == 0:
            self.whole_pod = pod
            return
        self.slices.append(MpsPiece(size, False, pod, False))
        self.created += 1
        self.changed = True


GpuState = MigState | MpsState


def new_state(info: GpuInfo) -> GpuState:
    return MigState(info) if info.rules is not None else MpsState(info)


def option_for(state: GpuState, kind: str, what: object) -> tuple[Cost, int, tuple[int, ...]] | None:
    if isinstance(state, MigState):
        if kind != KIND_MIG:
            return None
        p = state.rules.index.get(what)  # type: ignore[arg-type]
        return None if p is None else state.option(p)
    if kind == KIND_MIG:
        return None
    return state.option(0 if kind == KIND_GPU else what)  # type: ignore[arg-type]


def apply_option(state: GpuState, kind: str, what: object, start: int, destroy: tuple[int, ...], pod: str) -> None:
    if isinstance(state, MigState):
        state.apply(state.rules.index[what], start, destroy, pod)  # type: ignore[index]
    else:
        state.apply(0 if kind == KIND_GPU else what, start, destroy, pod)  # type: ignore[arg-type]
