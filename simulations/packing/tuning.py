"""The packing protocol's pod list: the trace's pods, tuned to a ratio of the GPU capacity with
seeded draws (appended below it, removed above it), then shuffled with the same seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.traces import TracePod


def tuned(pods: Sequence[TracePod], capacity_milli: int, ratio: float, rng: np.random.Generator) -> list[TracePod]:
    """The pod list brought to `ratio` x capacity of GPU demand, as the authors' simulator does
    (`TunePodsByNodeTotalResource`): below it, pods drawn uniformly with replacement from the list
    are appended while the total stays <= the target (the first draw that would exceed it ends
    the list); above it, pods drawn uniformly are removed until the total is <= the target.
    Copies get names `<name>#<k>` unique in the list."""
    total = sum(p.gpu_demand for p in pods)
    if total <= 0:
        raise SimulationError("the pod list asks for no GPU: the protocol brings its GPU demand to a share of the "
                              "cluster's GPU capacity, which it never reaches")
    limit = ratio * capacity_milli
    out = list(pods)
    if total > limit:
        while total > limit:
            total -= out.pop(int(rng.integers(len(out)))).gpu_demand
        return out
    names = {p.name for p in pods}
    k = 0
    while True:
        p = pods[int(rng.integers(len(pods)))]
        if total + p.gpu_demand > limit:
            break
        k += 1
        name = f"{p.name}#{k}"
        while name in names:  # (a trace's own name of that form)
            name += "#"
        names.add(name)
        out.append(dataclasses.replace(p, name=name))
        total += p.gpu_demand
    return out


def packing_workload(pods: Sequence[TracePod], capacity_milli: int, ratio: float, seed: int) -> list[TracePod]:
    """The paper's protocol: tune to `ratio` of the GPU capacity, then shuffle, both seeded."""
    rng = np.random.default_rng(seed)
    out = tuned(pods, capacity_milli, ratio, rng)
    order = rng.permutation(len(out))
    return [out[i] for i in order]
