"""The packing protocol of the FGD paper (../shared/traces/README.md, "The packing protocol").

Same cluster for every run; the pod list tuned to `ratio` (1.3) of the GPU capacity and
shuffled with the seed; pods arrive in that order and never leave; a pod the policy cannot
place fails for good. The GPU allocation ratio (allocated GPU milli / capacity) is recorded
each time the arrived demand crosses a whole percent of the capacity, and at the end.

With a batch size B > 1, B consecutive arrivals are planned together and the curve is
recorded after each batch (a crossing inside a batch is recorded when the batch is done).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.packing.occupancy import PackingState
from dynpart.simulations.packing.tuning import packing_workload


@dataclass
class Counts:
    placed: int = 0
    failed: int = 0
    failed_gpu_milli: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [placed, failed]

    def add(self, pod: TracePod, ok: bool) -> None:
        kind = "cpu" if pod.num_gpu == 0 else ("share" if pod.is_share else f"{pod.num_gpu}gpu")
        row = self.by_kind.setdefault(kind, [0, 0])
        if ok:
            self.placed += 1
            row[0] += 1
        else:
            self.failed += 1
            self.failed_gpu_milli += pod.gpu_demand
            row[1] += 1


class PackingPolicy(Protocol):
    name: str

    def place_batch(self, state: PackingState, pods: list[TracePod]) -> list[bool]:
        """Place what it can of the pods (in the state) and say which were placed."""


@dataclass
class PackingResult:
    policy: str
    batch: int
    seed: int
    pods: int  # arrivals (tuned workload size)
    capacity_milli: int
    curve: list[tuple[float, float]]  # (arrived % of capacity, allocation %) at each 1 % and at the end
    counts: Counts
    wall_s: float
    plan_calls: int = 0
    extra: dict = field(default_factory=dict)

    def alloc_at(self, pct: float) -> float:
        """Allocation when the arrived demand first reached pct % of the capacity; the final
        allocation when it never did (the tuned list ends within one pod of the target)."""
        for arrived, alloc in self.curve:
            if arrived >= pct - 1e-9:
                return alloc
        return self.curve[-1][1]

    @property
    def final_alloc(self) -> float:
        return self.curve[-1][1]


def run_packing(pods: Sequence[TracePod], cluster: ClusterSpec, make_policy: Callable[[int], PackingPolicy],
                seed: int, ratio: float = 1.3, batch: int = 1,
                progress: Callable[[int, int], None] | None = None) -> PackingResult:
    t0 = time.perf_counter()
    state = PackingState(cluster)
    if state.total_gpu == 0:
        raise SimulationError(f"{cluster.source}: the cluster has no GPUs")
    workload = packing_workload(pods, state.total_gpu, ratio, seed)
    policy = make_policy(seed)
    counts = Counts()
    curve: list[tuple[float, float]] = [(0.0, 0.0)]
    arrived = 0
    next_pct = 1
    cap = state.total_gpu
    for i in range(0, len(workload), batch):
        chunk = workload[i: i + batch]
        placed = policy.place_batch(state, chunk)
        for pod, ok in zip(chunk, placed):
            counts.add(pod, ok)
            arrived += pod.gpu_demand
        alloc = 100.0 * state.allocated / cap
        while arrived * 100 >= next_pct * cap:
            curve.append((float(next_pct), alloc))
            next_pct += 1
        if progress is not None:
            progress(min(i + batch, len(workload)), len(workload))
    curve.append((100.0 * arrived / cap, 100.0 * state.allocated / cap))
    extra = dict(getattr(policy, "stats", {}))
    extra["free_at_end"] = free_at_end(state)
    return PackingResult(policy.name, batch, seed, len(workload), cap, curve, counts,
                         time.perf_counter() - t0, getattr(policy, "plan_calls", 0), extra)


def free_at_end(state: PackingState) -> dict[str, float]:
    """Where the unallocated capacity is at the end, in % of the capacity: on fully free GPUs,
    and on partly used GPUs grouped by the largest share a pod holds there (e.g. "810": the free
    milli of GPUs that hold an 810-milli pod, which only pods of 190 milli or less can use)."""
    out: dict[str, float] = {}
    whole = 0
    for n, gpus in enumerate(state.holders):
        for g, holders in enumerate(gpus):
            free = int(state.gpu_free[n, g])
            if not holders:
                whole += free
            elif free > 0:
                key = str(max(holders.values()))
                out[key] = out.get(key, 0) + free
    cap = state.total_gpu
    res = {"whole_gpus": round(100.0 * whole / cap, 3)}
    res.update({k: round(100.0 * v / cap, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])})
    return res
