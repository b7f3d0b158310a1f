"""The mode interface: what every planning algorithm may ask of one GPU's layout while it plans.

`MigState` (planner/mig_state.py) and `MpsState` (planner/mps_state.py) implement it; the greedy,
the exact solver's decoding, the baselines and the output call these methods and never look
at which mode a GPU is in. Only code that is specific to a mode by nature (the exact solver's
per-mode model, a baseline's per-mode layout rule) dispatches on the concrete class.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from dynpart.planner.mig_state import MigState
from dynpart.planner.mps_state import MpsState
from dynpart.planner.problem import GpuInfo
from dynpart.planner.types import Option, SliceRef
from dynpart.snapshot import GpuLayout, PlacedSlice


class GpuState(Protocol):
    """One GPU's layout as planned so far: its slices (used, planned for a pending pod, or
    free), and how much the plan has changed it."""

    @property
    def info(self) -> GpuInfo: ...
    @property
    def changed(self) -> bool: ...  # the plan reconfigures this GPU
    @property
    def created(self) -> int: ...  # slices the plan creates
    @property
    def destroyed(self) -> int: ...  # free slices the plan destroys

    def key(self) -> Hashable:
        """Equal keys: the GPUs cost the same for any request (the greedy buckets them)."""
        ...

    def clone(self) -> GpuState: ...

    def has_pod(self) -> bool:
        """A pod uses, or is planned onto, part of this GPU."""
        ...

    def option(self, ask: SliceRef) -> Option | None:
        """The cheapest way to host one slice of `ask` here, or None (wrong mode or no room)."""
        ...

    def apply(self, ask: SliceRef, option: Option, pod: str) -> None:
        """Carry out `option` (from `self.option(ask)`), the new slice going to `pod`."""
        ...

    def free_slots(self, ask: SliceRef) -> list[int]:
        """The free slices that match `ask` as they are, as a scheduler sees them."""
        ...

    def bind(self, slot: int, ask: SliceRef, pod: str) -> None:
        """Give the free slice `slot` (from `free_slots(ask)`) to `pod`."""
        ...

    def unbind(self, pod: str) -> None:
        """The slices planned for the pending pod `pod` left free (made, if the plan makes them)."""
        ...

    def layout(self) -> GpuLayout:
        """The planned layout, as the `Plan` model states it."""
        ...

    def slices_held_by(self, pod: str) -> list[PlacedSlice]:
        """The slices planned for or used by `pod`, as `Plan` placements name them."""
        ...


def new_state(info: GpuInfo) -> GpuState:
    """The GPU's layout as it is now, in its mode."""
    return MigState(info) if info.rules is not None else MpsState(info)
