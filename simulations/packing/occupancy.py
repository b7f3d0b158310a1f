"""The packing simulator's cluster state, kept incrementally in numpy arrays.

One row per node: CPU and memory free, GPU milli free per GPU (-1 where a node has fewer GPUs
than the widest node), the GPU model as an index, and what the policies filter and score on
(total GPU milli free, fully free GPUs, the largest free share of one GPU). Placing a pod
updates its node's row only, so the policies can test all 1,500 nodes of the openb cluster in
a few vector operations per pod.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import MILLI, TracePod


@dataclass
class Placement:
    pod: TracePod
    node: int
    gpus: tuple[int, ...]  # GPU indices on the node (empty for CPU-only pods)


class PackingState:
    def __init__(self, spec: ClusterSpec, capacity: int = MILLI):
        if not spec.nodes:
            raise SimulationError(f"{spec.source}: the cluster has no nodes")
        self.spec = spec
        self.capacity = capacity
        nodes = spec.nodes
        self.names = [n.name for n in nodes]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.models = sorted({n.model for n in nodes if n.gpus})
        model_idx = {m: i for i, m in enumerate(self.models)}
        n_nodes = len(nodes)
        width = max((n.gpus for n in nodes), default=0) or 1
        self.ngpu = np.array([n.gpus for n in nodes], dtype=np.int64)
        self.model_id = np.array([model_idx[n.model] if n.gpus else -1 for n in nodes], dtype=np.int64)
        self.cpu_cap = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        self.mem_cap = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        self.cpu = self.cpu_cap.copy()
        self.mem = self.mem_cap.copy()
        self.gpu_free = np.full((n_nodes, width), -1, dtype=np.int64)
        for i, n in enumerate(nodes):
            self.gpu_free[i, : n.gpus] = capacity
        self.total_free = self.ngpu * capacity
        self.full_free = self.ngpu.copy()
        self.max_free = np.where(self.ngpu > 0, capacity, -1).astype(np.int64)
        self.total_gpu = int(self.ngpu.sum()) * capacity
        self.allocated = 0  # GPU milli held by pods
        # per node, per GPU: {pod name: milli}; whole-GPU pods hold `capacity`
        self.holders: list[list[dict[str, int]]] = [[{} for _ in range(n.gpus)] for n in nodes]
        self.placements: dict[str, Placement] = {}
        self._spec_masks: dict[tuple[str, ...], np.ndarray] = {}

    # --- filters ---------------------------------------------------------------------------

    def model_mask(self, spec: tuple[str, ...]) -> np.ndarray:
        """Nodes whose GPU model the pod accepts (all GPU nodes when spec is empty)."""
        mask = self._spec_masks.get(spec)
        if mask is None:
            if spec:
                ids = [i for i, m in enumerate(self.models) if m in spec]
                mask = np.isin(self.model_id, ids) if ids else np.zeros(len(self.names), dtype=bool)
            else:
                mask = self.ngpu > 0
            self._spec_masks[spec] = mask
        return mask

    def feasible(self, pod: TracePod) -> np.ndarray:
        """Boolean mask of the nodes where the pod fits now (the protocol's fit rule)."""
        ok = (self.cpu >= pod.cpu_milli) & (self.mem >= pod.memory_mib)
        if pod.num_gpu == 0:
            return ok
        ok &= self.model_mask(pod.gpu_spec)
        if pod.is_share:
            return ok & (self.max_free >= pod.gpu_milli)
        return ok & (self.full_free >= pod.num_gpu)

    def fits_on(self, pod: TracePod, node: int) -> bool:
        return bool(self.feasible(pod)[node])

    # --- GPU choice inside a node ---------------------------------------------------------

    def best_fit_gpus(self, pod: TracePod, node: int) -> tuple[int, ...]:
        """Share pod: the GPU with the least free milli that still fits (lowest index on ties).
        Whole-GPU pods: the first fully free GPUs in index order."""
        if pod.num_gpu == 0:
            return ()
        free = self.gpu_free[node, : self.ngpu[node]]
        if pod.is_share:
            fits = np.flatnonzero(free >= pod.gpu_milli)
            return (int(fits[np.argmin(free[fits])]),)
        return tuple(int(g) for g in np.flatnonzero(free == self.capacity)[: pod.num_gpu])

    # --- changes ---------------------------------------------------------------------------

    def place(self, pod: TracePod, node: int, gpus: tuple[int, ...]) -> None:
        if pod.name in self.placements:
            raise ValueError(f"pod {pod.name} is already placed")
        if self.cpu[node] < pod.cpu_milli or self.mem[node] < pod.memory_mib:
            raise ValueError(f"pod {pod.name} does not fit node {self.names[node]} by CPU/memory")
        if pod.num_gpu:
            if pod.gpu_spec and self.models[self.model_id[node]] not in pod.gpu_spec:
                raise ValueError(f"pod {pod.name} does not accept model {self.models[self.model_id[node]]}")
            if len(set(gpus)) != pod.num_gpu:
                raise ValueError(f"pod {pod.name} needs {pod.num_gpu} GPU(s), got {gpus}")
            share = pod.gpu_milli if pod.is_share else self.capacity
            for g in gpus:
                free = self.gpu_free[node, g] if g < self.ngpu[node] else -1
                if free < share or (not pod.is_share and free != self.capacity):
                    raise ValueError(f"pod {pod.name}: GPU {g} of {self.names[node]} has {free} free, needs {share}")
            for g in gpus:
                self.gpu_free[node, g] -= share
                self.holders[node][g][pod.name] = share
            self.allocated += share * len(gpus)
            self._refresh(node)
        elif gpus:
            raise ValueError(f"CPU-only pod {pod.name} given GPUs {gpus}")
        self.cpu[node] -= pod.cpu_milli
        self.mem[node] -= pod.memory_mib
        self.placements[pod.name] = Placement(pod, node, tuple(gpus))

    def remove(self, name: str) -> Placement:
        p = self.placements.pop(name)
        self.cpu[p.node] += p.pod.cpu_milli
        self.mem[p.node] += p.pod.memory_mib
        for g in p.gpus:
            share = self.holders[p.node][g].pop(name)
            self.gpu_free[p.node, g] += share
            self.allocated -= share
        if p.gpus:
            self._refresh(p.node)
        return p

    def _refresh(self, node: int) -> None:
        free = self.gpu_free[node, : self.ngpu[node]]
        self.total_free[node] = int(free.sum())
        self.full_free[node] = int((free == self.capacity).sum())
        self.max_free[node] = int(free.max())

    @property
    def allocation_ratio(self) -> float:
        return self.allocated / self.total_gpu if self.total_gpu else 0.0

