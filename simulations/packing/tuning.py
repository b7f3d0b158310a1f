"""The packing protocol's pod list: every trace pod, tuned to a ratio of the GPU capacity with
seeded draws, then shuffled with the same seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dynpart.simulations.inputs.traces import TracePod


def tuned(pods: Sequence[TracePod], capacity_milli: int, ratio: float, rng: np.random.Generator) -> list[TracePod]:
    """All pods, then pods drawn uniformly with replacement from the same list and appended
    while the total requested GPU milli stays <= ratio x capacity (the first draw that would
    exceed it ends the list). Copies get unique names `<name>#<k>`."""
    out = list(pods)
    total = sum(p.gpu_demand for p in pods)
    limit = ratio * capacity_milli
    k = 0
    while True:
        p = pods[int(rng.integers(len(pods)))]
        if total + p.gpu_demand > limit:
            break
        k += 1
        out.append(dataclasses.replace(p, name=f"{p.name}#{k}"))
        total += p.gpu_demand
        if k > 50 * len(pods) + 1000 and not p.gpu_demand:
            break  # a list of CPU-only pods never reaches a GPU demand target
    return out


def packing_workload(pods: Sequence[TracePod], capacity_milli: int, ratio: float, seed: int) -> list[TracePod]:
    """The paper's protocol: tune to `ratio` of the GPU capacity, then shuffle, both seeded."""
    rng = np.random.default_rng(seed)
    out = tuned(pods, capacity_milli, ratio, rng)
    order = rng.permutation(len(out))
    return [out[i] for i in order]
