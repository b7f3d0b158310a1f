"""The MPS mode of a GPU while planning: slices of any size within the GPU's memory, or the
whole GPU for one pod, and what each way to add one costs (see `Cost` in planner/types.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dynpart.planner.problem import GpuInfo
from dynpart.planner.types import CreateSlice, MpsSliceRef, Option, ReuseSlice, SliceRef, TakeWholeGpu, WholeGpuRef, drop_free
from dynpart.snapshot import GpuLayout, MpsSlice, PlacedSlice


@dataclass(slots=True)
class MpsPiece:
    size: int
    used: bool
    pod: str | None
    existing: bool

    @property
    def hard(self) -> bool:
        return self.used or self.pod is not None


MpsKey = tuple[int, tuple[tuple[int, bool], ...], bool, bool, int | None]


class MpsState:
    """One MPS GPU; implements `GpuState` (planner/state.py)."""

    __slots__ = ("info", "cap", "max_slices", "slices", "whole_pod", "changed", "destroyed", "created")

    def __init__(self, info: GpuInfo):
        self.info = info
        self.cap = info.capacity
        # the most clients an MPS server serves on one GPU (catalog `mps_max_clients`; None: no bound)
        self.max_slices = info.model.mps_max_clients
        self.slices = [MpsPiece(s, True, pod, True) for s, pod in info.used_mps]
        self.slices += [MpsPiece(s, False, None, True) for s in info.free_mps]
        self.whole_pod = info.whole_pod
        self.changed = False
        self.destroyed = 0
        self.created = 0

    def clone(self) -> MpsState:
        c = MpsState.__new__(MpsState)
        c.info, c.cap, c.max_slices, c.whole_pod = self.info, self.cap, self.max_slices, self.whole_pod
        c.changed, c.destroyed, c.created = self.changed, self.destroyed, self.created
        c.slices = [MpsPiece(s.size, s.used, s.pod, s.existing) for s in self.slices]
        return c

    def key(self) -> MpsKey:
        return (self.cap, tuple(sorted((s.size, s.hard) for s in self.slices)), self.changed,
                self.whole_pod is not None, self.max_slices)

    def has_pod(self) -> bool:
        return self.whole_pod is not None or any(s.hard for s in self.slices)

    # --- hosting a pending pod's slice ------------------------------------------------------

    def option(self, ask: SliceRef) -> Option | None:
        """Cheapest way to host one slice of the asked size, or the whole GPU."""
        if self.whole_pod is not None or not isinstance(ask, (MpsSliceRef, WholeGpuRef)):
            return None
        hard_total = sum(s.size for s in self.slices if s.hard)
        empty = 0 if hard_total or any(s.hard for s in self.slices) else 1
        touch = 0 if self.changed else 1
        if isinstance(ask, WholeGpuRef):
            if any(s.hard for s in self.slices):
                return None
            k = len(self.slices)
            return TakeWholeGpu((k + (touch if k else 0), empty, 0, 0), tuple(range(k)))
        size = ask.size
        if self.clients_left() == 0:
            return None
        for k, s in enumerate(self.slices):
            if not s.hard and s.size == size:
                return ReuseSlice((0, empty, self.cap - hard_total - size, 0), k)
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
        if self.max_slices is not None:
            # one more client than the MPS server serves: room by count too, from the smallest free
            # slices (or none, when the slices pods hold are that many already)
            over = len(self.slices) - len(destroy) + 1 - self.max_slices
            if over > 0:
                spare = sorted((k for k, s in enumerate(self.slices) if not s.hard and k not in destroy),
                               key=lambda k: (self.slices[k].size, k))
                if len(spare) < over:
                    return None
                destroy += spare[:over]
        return CreateSlice((len(destroy) + touch, empty, leftover, 0), 0, tuple(sorted(destroy)))

    def apply(self, ask: SliceRef, option: Option, pod: str) -> None:
        if isinstance(option, ReuseSlice):
            self.slices[option.index].pod = pod
            return
        destroyed, undone = drop_free(self.slices, option.destroy)
        self.destroyed += destroyed
        self.created -= undone
        if option.destroy:
            self.changed = True
        if isinstance(option, TakeWholeGpu):
            self.whole_pod = pod
            return
        assert isinstance(ask, MpsSliceRef), "not an MPS option"
        self.slices.append(MpsPiece(ask.size, False, pod, False))
        self.created += 1
        self.changed = True

    def free_slots(self, ask: SliceRef) -> list[int]:
        if isinstance(ask, WholeGpuRef):
            return [0] if not self.slices and self.whole_pod is None else []
        if isinstance(ask, MpsSliceRef):
            free = [k for k, s in enumerate(self.slices) if s.size == ask.size and not s.hard]
            left = self.clients_left()  # a GPU laid out past the bound: up to it only
            return free if left is None else free[:left]
        return []

    def clients_left(self) -> int | None:
        """How many more pods its MPS server serves (`max_slices` less the slices pods hold: one
        more cannot start CUDA); None: no bound."""
        if self.max_slices is None:
            return None
        return max(0, self.max_slices - sum(1 for s in self.slices if s.hard))

    def bind(self, slot: int, ask: SliceRef, pod: str) -> None:
        if isinstance(ask, WholeGpuRef):
            self.whole_pod = pod
        else:
            self.slices[slot].pod = pod

    def unbind(self, pod: str) -> None:
        if self.whole_pod == pod and self.info.whole_pod != pod:
            self.whole_pod = None
        for s in self.slices:
            if s.pod == pod and not s.used:
                s.pod = None

    # --- rewriting the layout ---------------------------------------------------------------

    def replace_free_slices(self, sizes: Sequence[int], keep: Collection[int] = ()) -> None:
        """Drop every free slice except those at the indices `keep`, then create free slices of
        the given sizes (used and planned slices stay)."""
        kept: list[MpsPiece] = []
        dropped: list[MpsPiece] = []
        for k, s in enumerate(self.slices):
            (kept if s.hard or k in keep else dropped).append(s)
        self.destroyed += sum(1 for s in dropped if s.existing)
        self.created -= sum(1 for s in dropped if not s.existing)
        self.slices = kept + [MpsPiece(size, False, None, False) for size in sizes]
        self.created += len(sizes)
        self.changed = self.changed or bool(dropped or sizes)

    # --- the result -------------------------------------------------------------------------

    def layout(self) -> GpuLayout:
        return GpuLayout.model_construct(
            index=self.info.index, mig=[],
            mps=[MpsSlice.model_construct(size=s.size, used=s.used, pod=s.pod) for s in self.slices],
            whole_pod=self.whole_pod, changed=self.changed, created=self.created, destroyed=self.destroyed,
        )

    def slices_held_by(self, pod: str) -> list[PlacedSlice]:
        gpu = self.info.index
        if self.whole_pod == pod:
            return [PlacedSlice.whole(gpu)]
        return [PlacedSlice.mps(gpu, s.size) for s in self.slices if s.pod == pod]
