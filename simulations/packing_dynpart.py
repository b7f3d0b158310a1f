"""The `dynpart` policy in the packing protocol: arrivals planned by `planner.plan()`.

For each batch of arrivals the simulator shell
1. finds, for each GPU pod, the nodes where it fits now (the protocol's fit rule, vectorised
   over the whole cluster) and ranks them by how much the placement would raise the node's
   expected GPU fragmentation (`simulations.fragmentation`, after the FGD paper's measure);
2. builds a snapshot of the `candidates` best nodes of each pod only, in ranking order (which
   also breaks the planner's ties), as MPS nodes whose GPUs have a capacity of 1000 (GPU
   milli) and whose pods hold one used slice each (GPUs with nothing free are left out:
   nothing can be planned on them);
3. calls `plan()` with the batch as pending pods (larger requests get a higher priority, so a
   batch is packed largest first), checks that the plan keeps every used slice in place, and
   applies the placements to the simulator state. Pods the plan leaves out that still fit
   somewhere (their candidates went to batch mates) are planned again, with fresh candidates.
CPU-only pods are not modelled by the planner (it plans GPU resources): the shell places them
itself, on the CPU-only node with the least CPU left over if one fits, else on the GPU node
whose expected fragmentation rises least.
"""

from __future__ import annotations

import time

import numpy as np

from dynpart.catalog import Catalog, default_catalog
from dynpart.snapshot import Node
from planner.core import PlanOptions, plan
from simulations import bridge
from simulations.fragmentation import FragmentationModel
from simulations.state import PackingState
from simulations.traces import MILLI, TracePod

MAX_BATCH = 32
DEFAULT_CANDIDATES = 4


def priority_of(pod: TracePod) -> int:
    """Coarse size classes: the planner places higher priorities first (and its exact search
    weighs them strictly), so a batch is packed largest first."""
    if pod.num_gpu > 1:
        return 3
    if not pod.is_share:
        return 2
    return 1 if pod.gpu_milli >= 500 else 0


class DynpartPacking:
    name = "dynpart"

    def __init__(self, frag: FragmentationModel, catalog: Catalog | None = None, batch: int = 1,
                 candidates: int = DEFAULT_CANDIDATES, time_limit_s: float = 0.05):
        self.frag = frag
        self.node_frag: np.ndarray | None = None
        self.base_catalog = catalog or default_catalog()
        self.catalog: Catalog | None = None
        self.batch = batch
        self.k = candidates
        self.options = PlanOptions(policy="dynpart", time_limit_s=time_limit_s)
        self.plan_calls = 0
        self.stats: dict[str, float] = {"plan_s": 0.0, "disrupted": 0, "cpu_only_by_shell": 0}

    # --- ranking ---------------------------------------------------------------------------

    def rank(self, state: PackingState, pod: TracePod, nodes: np.ndarray) -> np.ndarray:
        """Candidate nodes, best first (stable: equal nodes stay in cluster order)."""
        return nodes[np.argsort(self.frag_increase(state, pod, nodes), kind="stable")]

    def frag_increase(self, state: PackingState, pod: TracePod, nodes: np.ndarray) -> np.ndarray:
        """Increase of each node's expected fragmentation if the pod goes there (for a sharing
        pod, on the node's GPU that raises it least; GPUs with equal free milli are tried once)."""
        assert self.node_frag is not None
        free = state.gpu_free[nodes]
        cpu = state.cpu[nodes] - pod.cpu_milli
        mem = state.mem[nodes] - pod.memory_mib
        if pod.is_share:
            rows, gpus = np.nonzero(free >= pod.gpu_milli)
            _, first = np.unique(rows * (4 * MILLI) + free[rows, gpus], return_index=True)
            rows, gpus = rows[first], gpus[first]
            hyp = free[rows]
            hyp[np.arange(len(rows)), gpus] -= pod.gpu_milli
            after = np.full(len(nodes), np.inf)
            np.minimum.at(after, rows, self.frag.frag(cpu[rows], hyp, mem[rows]))
        else:
            hyp = free.copy()
            if pod.num_gpu:
                whole = hyp == state.capacity
                hyp[whole & (np.cumsum(whole, axis=1) <= pod.num_gpu)] = 0
            after = self.frag.frag(cpu, hyp, mem)
        return after - self.node_frag[nodes]

    def _refresh_frag(self, state: PackingState, nodes: list[int] | None = None) -> None:
        if self.node_frag is None or nodes is None:
            self.node_frag = self.frag.frag(state.cpu, state.gpu_free, state.mem)
        elif nodes:
            idx = np.array(sorted(set(nodes)))
            self.node_frag[idx] = self.frag.frag(state.cpu[idx], state.gpu_free[idx], state.mem[idx])

    # --- placing ---------------------------------------------------------------------------

    def place_batch(self, state: PackingState, pods: list[TracePod]) -> list[bool]:
        if self.catalog is None:
            models = set(state.models) | {m for p in pods for m in p.gpu_spec}
            self.catalog = bridge.catalog_for(models, self.base_catalog)
        if self.node_frag is None:
            self._refresh_frag(state)
        placed: dict[str, bool] = {}
        gpu_pods = [p for p in pods if p.num_gpu]
        if gpu_pods:
            placed.update(self._plan(state, gpu_pods))
        for p in pods:
            if not p.num_gpu:
                placed[p.name] = self._place_cpu_only(state, p)
        return [placed.get(p.name, False) for p in pods]

    def _plan(self, state: PackingState, pods: list[TracePod]) -> dict[str, bool]:
        """Plan the batch; pods the plan leaves out but that still fit somewhere are planned
        again with fresh candidates, until a round places nothing."""
        out: dict[str, bool] = {}
        remaining = sorted(pods, key=lambda p: -p.gpu_demand)
        while remaining:
            placed = self._plan_round(state, remaining)
            if not placed:
                break
            out.update(placed)
            remaining = [p for p in remaining if p.name not in out]
        return out

    def _plan_round(self, state: PackingState, pods: list[TracePod]) -> dict[str, bool]:
        ranked: list[np.ndarray] = []
        pending = []
        for pod in pods:
            nodes = np.flatnonzero(state.feasible(pod))
            if len(nodes):
                ranked.append(self.rank(state, pod, nodes)[: self.k])
                pending.append(pod)
        if not pending:
            return {}
        order: list[int] = []  # each pod's best node first, then the second best...
        seen: set[int] = set()
        for r in range(max(len(x) for x in ranked)):
            for top in ranked:
                if r < len(top) and int(top[r]) not in seen:
                    seen.add(int(top[r]))
                    order.append(int(top[r]))
        snap = bridge.snapshot(
            [self._node(state, n) for n in order],
            [bridge.pending_pod(p, *bridge.packing_request(p), priority=priority_of(p)) for p in pending])
        t0 = time.perf_counter()
        result = plan(snap, self.catalog, self.options)
        self.stats["plan_s"] += time.perf_counter() - t0
        self.plan_calls += 1
        bad = bridge.disrupted_slices(snap, result)
        if bad:
            self.stats["disrupted"] += len(bad)
            raise AssertionError(f"plan moved used slices: {bad[:3]}")
        by_name = {p.name: p for p in pending}
        out: dict[str, bool] = {}
        for pl in result.placements:
            pod = by_name[pl.pod]
            want = "whole" if not pod.is_share else str(pod.gpu_milli)
            if len(pl.slices) != pod.num_gpu or any(what != want for _, what in pl.slices):
                raise AssertionError(f"plan gave {pod.name} slices {pl.slices}, expected {pod.num_gpu} x {want}")
            state.place(pod, state.index[pl.node], tuple(sorted(g for g, _ in pl.slices)))
            out[pod.name] = True
        self._refresh_frag(state, [state.index[pl.node] for pl in result.placements])
        return out

    @staticmethod
    def _node(state: PackingState, n: int) -> Node:
        gpus = [bridge.mps_gpu(g, state.capacity, state.holders[n][g], whole=False)
                for g in range(int(state.ngpu[n])) if state.gpu_free[n, g] > 0]
        return bridge.node(state.names[n], "mps", state.models[state.model_id[n]], state.cpu[n], state.mem[n], gpus)

    def _place_cpu_only(self, state: PackingState, pod: TracePod) -> bool:
        nodes = np.flatnonzero(state.feasible(pod))
        if not len(nodes):
            return False
        self.stats["cpu_only_by_shell"] += 1
        no_gpu = nodes[state.ngpu[nodes] == 0]
        if len(no_gpu):
            best = int(no_gpu[np.argmin(state.cpu[no_gpu])])
        else:
            best = int(nodes[np.argmin(self.frag_increase(state, pod, nodes))])
        state.place(pod, best, ())
        self._refresh_frag(state, [best])
        return True
