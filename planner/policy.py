"""The policy interface: what `plan()` asks of a planning policy (dynpart's own, and the nos and
static baselines it is compared with), and the options that choose and tune one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState
from dynpart.planner.types import Placements

PolicyName = Literal["dynpart", "nos", "static"]


class PlanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PolicyName = "dynpart"
    # Budget of the exact search, in CP-SAT deterministic seconds (about wall seconds on one core).
    time_limit_s: float = Field(default=0.5, ge=0)
    # Solve the whole instance exactly when it has at most this many GPUs and pods...
    exact_max_gpus: int = Field(default=64, ge=0)
    exact_max_pods: int = Field(default=120, ge=0)
    # ...else improve the greedy plan window by window (large-neighbourhood search).
    # A window: the nodes, in the search's order, until they hold this many GPUs (three 8-GPU
    # nodes); counted in GPUs, not nodes, so that a pod left out on 1-GPU nodes finds as much
    # room to move others as on 8-GPU ones (three 1-GPU nodes rarely hold the GPU it needs
    # emptied: `dynpart bench planner --gpus-per-node 1`, helper-142)
    window_gpus: int = Field(default=24, ge=1)
    window_pods: int = Field(default=40, ge=1)
    # False: creating and destroying free slices costs nothing, so the objective goes from the
    # most pods placed straight to the workload-aware tier (a cluster that shares GPUs without
    # reconfiguring them, as in the FGD paper's packing protocol)
    minimise_changes: bool = True
    # static policy: the fixed geometry, by GPU model name, as "profile@start,..." or profile counts
    static_layout: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class PolicyResult:
    states: list[GpuState]  # every GPU's planned layout, by GPU id
    placements: Placements
    solver: str  # how the plan was found, for the plan's stats
    # the GPUs whose state object may differ from the problem's cached states (None: any)
    moved: set[int] | None = None


class PlanningPolicy(Protocol):
    """A way to plan: built from `PlanOptions`, it places pending pods on a compiled problem."""

    @property
    def name(self) -> PolicyName: ...

    def place(self, problem: Problem) -> PolicyResult:
        """Lay out the GPUs and place the pending pods (pure: no I/O, deterministic)."""
        ...

    def unplaced_reason(self, problem: Problem, req: Request) -> str:
        """Why this policy left out `req`, which has candidate nodes (the reason for a pod
        without any is the problem's, not the policy's)."""
        ...
