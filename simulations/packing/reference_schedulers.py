"""The FGD paper's `best-fit` and `random` baselines, re-implemented from the authors' simulator
(hkust-adsl/kubernetes-scheduler-simulator, plugins `BestFitScore`, `RandomScore` and the
Open-Gpu-Share GPU selection), for the packing protocol.

BestFit scores each feasible node by the resources it would have left,
    s = 0.5 (cpu_free - cpu_req) / 128,000 + 0.5 (gpu_free - gpu_req) / 8,000
(cpu in millicores, gpu_free the node's total free GPU milli; 128 cores and 8 GPUs are the
normalising maxima), turns it into the scheduler's integer score trunc((1 - s) x 100), and
the scheduler takes a highest-scoring node, ties broken uniformly at random (kube-scheduler's
selectHost). On the node, a sharing pod takes the GPU with the least free milli that fits;
whole-GPU pods take the first fully free GPUs. Random takes a feasible node uniformly at random
and, for a sharing pod, a fitting GPU uniformly at random. CPU-only pods go through the same
policy (their GPU request is 0).
"""

from __future__ import annotations

import numpy as np

from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.packing.occupancy import PackingState

MAX_SPEC_CPU = 128_000.0
MAX_SPEC_GPU = 8_000.0


def best_fit_scores(state: PackingState, pod: TracePod) -> np.ndarray:
    """The scheduler's integer BestFit score of every node (higher is better)."""
    s = (0.5 * (state.cpu - pod.cpu_milli) / MAX_SPEC_CPU
         + 0.5 * (np.maximum(state.total_free, 0) - pod.gpu_demand) / MAX_SPEC_GPU)
    return np.trunc((1.0 - s) * 100.0)


class BestFit:
    name = "best-fit"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def choose(self, state: PackingState, pod: TracePod) -> tuple[int, tuple[int, ...]] | None:
        mask = state.feasible(pod)
        feasible = np.flatnonzero(mask)
        if not len(feasible):
            return None
        scores = best_fit_scores(state, pod)[feasible]
        top = feasible[scores == scores.max()]
        node = int(top[self.rng.integers(len(top))]) if len(top) > 1 else int(top[0])
        return node, state.best_fit_gpus(pod, node)

    def place_batch(self, state: PackingState, pods: list[TracePod]) -> list[bool]:
        out = []
        for pod in pods:
            pick = self.choose(state, pod)
            if pick is not None:
                state.place(pod, *pick)
            out.append(pick is not None)
        return out


class Random:
    name = "random"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def choose(self, state: PackingState, pod: TracePod) -> tuple[int, tuple[int, ...]] | None:
        feasible = np.flatnonzero(state.feasible(pod))
        if not len(feasible):
            return None
        node = int(feasible[self.rng.integers(len(feasible))])
        if pod.is_share:
            free = state.gpu_free[node, : state.ngpu[node]]
            fits = np.flatnonzero(free >= pod.gpu_milli)
            return node, (int(fits[self.rng.integers(len(fits))]),)
        return node, state.best_fit_gpus(pod, node)

    place_batch = BestFit.place_batch
