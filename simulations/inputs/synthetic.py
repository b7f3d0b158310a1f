"""The synthetic openb-like trace: a seeded pod list and the clusters it runs on when no trace or
cluster is given to `dynpart bench packing` (and small clusters for the replay tests).
`dynpart simulate` without --trace replays the built-in workload of `workloads` instead."""

from __future__ import annotations

import numpy as np

from dynpart.simulations.inputs.cluster_spec import ClusterSpec, NodeSpec
from dynpart.simulations.inputs.traces import MILLI, PodTrace, TracePod

# (gpus per node, model, cpu cores, memory GiB, node count) -- a small cluster shaped like openb
_SYNTH_NODES = [(8, "G2", 96, 384, 24), (2, "T4", 104, 512, 16), (2, "P100", 16, 120, 8),
                (4, "V100M16", 32, 128, 4), (0, "", 32, 256, 12)]
# share sizes seen in openb with their weights
_SHARES = [(1000, 39), (810, 11), (470, 8), (320, 3), (650, 3), (230, 2), (460, 1), (160, 1), (110, 1)]


def synthetic_cluster() -> ClusterSpec:
    nodes: list[NodeSpec] = []
    for gpus, model, cores, gib, count in _SYNTH_NODES:
        for _ in range(count):
            prefix = model.lower() if model else "cpu"
            nodes.append(NodeSpec(f"synth-{prefix}-{len(nodes):03d}", cores * 1000, gib * 1024, gpus, model, "mps"))
    return ClusterSpec("<synthetic cluster>", tuple(nodes))


def synthetic_trace(n_pods: int = 900, seed: int = 0, span_s: int = 6 * 3600) -> PodTrace:
    """A seeded pod list with the openb mix: 13% CPU-only, single-GPU pods sharing a GPU or
    taking it whole, a few 2/4/8-GPU pods; creation times over `span_s`, durations log-normal."""
    rng = np.random.default_rng(seed)
    sizes = np.array([s for s, _ in _SHARES])
    weights = np.array([w for _, w in _SHARES], dtype=float)
    weights /= weights.sum()
    pods = []
    t = 0.0
    for i in range(n_pods):
        t += rng.exponential(span_s / n_pods)
        duration = int(min(span_s, rng.lognormal(6.3, 1.6))) + 1
        u = rng.random()
        if u < 0.13:
            num_gpu, milli = 0, 0
            cpu = int(rng.choice([8, 12, 16, 32])) * 1000
        elif u < 0.985:
            num_gpu, milli = 1, int(rng.choice(sizes, p=weights))
            cpu = int(rng.choice([3, 4, 8, 11, 12, 16])) * 1000
        else:
            num_gpu, milli = int(rng.choice([2, 4, 8], p=[0.2, 0.2, 0.6])), MILLI
            cpu = num_gpu * 8000
        mem = cpu // 1000 * int(rng.choice([2, 4])) * 1024
        pods.append(TracePod(f"synth-pod-{i:04d}", cpu, mem, num_gpu, milli, (), int(t), int(t) + duration, i + 2))
    return PodTrace("<synthetic trace>", tuple(pods), True, len(pods))


def synthetic_mig_cluster(nodes: int = 2) -> ClusterSpec:
    """A small replay cluster: `nodes` x 8 H100-80GB in MIG mode, 224 CPUs and 2 TiB each."""
    return ClusterSpec("<synthetic MIG cluster>", tuple(
        NodeSpec(f"synth-h100-{i:02d}", 224_000, 2 << 20, 8, "H100-80GB", "mig") for i in range(nodes)))
