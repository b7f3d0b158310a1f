"""The planner's working vocabulary: what a pod asks of one GPU, the ways a GPU can host it and
what they cost, and where each placed pod goes.

Small slotted classes, because the greedy handles hundreds of thousands of them on large
clusters; treat them as immutable values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

# --- what a pod asks of one GPU ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigSliceRef:
    """A MIG instance of this profile (e.g. "1g.10gb")."""

    profile: str


@dataclass(frozen=True, slots=True)
class MpsSliceRef:
    """An MPS slice of this size (GB of GPU memory)."""

    size: int


@dataclass(frozen=True, slots=True)
class WholeGpuRef:
    """A whole GPU of an MPS node, not shared (`nvidia.com/gpu`)."""


WHOLE_GPU = WholeGpuRef()

SliceRef = MigSliceRef | MpsSliceRef | WholeGpuRef


# --- the ways one GPU can host one slice -------------------------------------------------------

# Compared as a tuple, lexicographically (lower is better):
#   (changes: free slices destroyed + 1 if the GPU was not changed yet,
#    empty: 1 if the GPU hosts no pod yet,
#    leftover: capacity left over (best fit),
#    -flex: MIG only, minus the memory of the placements the free slices still allow)
Cost = tuple[int, int, int, int]


@dataclass(slots=True)
class ReuseSlice:
    """Hand the free slice at `index` of the GPU's slice list to the pod."""

    cost: Cost
    index: int


@dataclass(slots=True)
class CreateSlice:
    """Create a slice (MIG: at memory slice `start`; MPS: 0, slices have no position) after
    destroying the free slices at `destroy` (indices into the GPU's slice list)."""

    cost: Cost
    start: int
    destroy: tuple[int, ...]


@dataclass(slots=True)
class TakeWholeGpu:
    """Give the whole GPU to the pod after destroying the free slices at `destroy`."""

    cost: Cost
    destroy: tuple[int, ...]


# Not frozen: a frozen dataclass costs three times as much to build, and the greedy builds one
# per GPU state and request kind it looks at.
Option = ReuseSlice | CreateSlice | TakeWholeGpu


# --- where placed pods go ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assignment:
    """A placed pod: its node and the GPUs (global ids) its slices are on."""

    node: int
    gpus: tuple[int, ...]


# request index -> where it is placed; pods left out are absent
Placements = dict[int, Assignment]


# --- slices on one GPU ---------------------------------------------------------------------------


class Slice(Protocol):
    """A MIG instance or an MPS slice while planning: `existing` now (else created by the plan),
    `hard` when a pod holds it or is planned onto it."""

    existing: bool

    @property
    def hard(self) -> bool: ...


S = TypeVar("S", bound=Slice)


def drop_free(slices: list[S], indices: Iterable[int]) -> tuple[int, int]:
    """Remove the free slices at `indices`: (slices that existed, now destroyed; slices the plan
    had created, now not created after all)."""
    destroyed = undone = 0
    for k in sorted(indices, reverse=True):
        assert not slices[k].hard, "never destroy a used slice"
        if slices[k].existing:
            destroyed += 1
        else:
            undone += 1
        del slices[k]
    return destroyed, undone
