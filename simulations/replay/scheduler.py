"""The replay's model of the kube-scheduler and the kubelet's device manager: what binds a pod
without any plan, because a free slice of its kind is already advertised.

A pod binds to a node with enough free CPU and memory and `count` free, ready slices of its
resource (a slice is advertised once its GPU finished creating it; a whole GPU, once it carries
no slice). Among such nodes it takes the least allocated one (the kube-scheduler's default
`NodeResourcesFit` scoring, LeastAllocated over CPU and memory; ties to the first node), and on
the node the slices of the GPUs with the most slices in use (the agent's device plugin's
GetPreferredAllocation). CPU-only pods bind the same way, on CPU and memory alone.
A pod that binds nowhere is unschedulable: the scheduler marks it so, which is when the planner
controller takes it into a batch."""

from __future__ import annotations

from collections import Counter

from dynpart.resources import WHOLE_GPU, mig_resource_name, mps_resource_name
from dynpart.simulations.replay.cluster import ReplayCluster
from dynpart.snapshot import PlacedSlice


def free_slices(cl: ReplayCluster, node: int, resource: str, now: float) -> list[PlacedSlice]:
    """The node's free, advertised slices of `resource`, those on the fullest GPUs first."""
    found: list[tuple[int, int, PlacedSlice]] = []
    for g in cl.nodes[node].gpus:
        clock = cl.clocks[node][g.index]
        if resource == WHOLE_GPU:
            if not g.mig and not g.mps and g.whole_pod is None and clock.busy_until <= now:
                found.append((0, g.index, PlacedSlice.whole(g.index)))
            continue
        held = sum(1 for m in g.mig if m.used) + sum(1 for s in g.mps if s.used)
        for m in g.mig:
            if not m.used and mig_resource_name(m.profile) == resource and clock.ready_at(m) <= now:
                found.append((-held, g.index, PlacedSlice.mig(g.index, m.profile, m.start)))
        for s in g.mps:
            if not s.used and mps_resource_name(s.size) == resource and clock.ready_at(s) <= now:
                found.append((-held, g.index, PlacedSlice.mps(g.index, s.size)))
    found.sort(key=lambda f: (f[0], f[1]))
    return [f[2] for f in found]


def free_counts(cl: ReplayCluster, now: float) -> Counter[str]:
    """Free, advertised slices of each resource over the cluster."""
    out: Counter[str] = Counter()
    for i, n in enumerate(cl.nodes):
        for g in n.gpus:
            clock = cl.clocks[i][g.index]
            if not g.mig and not g.mps:
                if g.whole_pod is None and clock.busy_until <= now:
                    out[WHOLE_GPU] += 1
                continue
            out.update(mig_resource_name(m.profile) for m in g.mig if not m.used and clock.ready_at(m) <= now)
            out.update(mps_resource_name(s.size) for s in g.mps if not s.used and clock.ready_at(s) <= now)
    return out


def bind(cl: ReplayCluster, resource: str | None, count: int, cpu_milli: int, memory_mib: int,
         now: float) -> tuple[int, list[PlacedSlice]] | None:
    """Where the scheduler binds a pod now (node index, its slices), or None: unschedulable."""
    best: tuple[float, int, list[PlacedSlice]] | None = None
    for i, n in enumerate(cl.nodes):
        if n.cpu_milli_free < cpu_milli or n.memory_mib_free < memory_mib:
            continue
        slices: list[PlacedSlice] = []
        if resource is not None:
            slices = free_slices(cl, i, resource, now)[:count]
            if len(slices) < count:
                continue
        spec = cl.spec.nodes[i]
        # LeastAllocated: the mean of the CPU and memory shares left after the pod
        score = ((n.cpu_milli_free - cpu_milli) / max(1, spec.cpu_milli)
                 + (n.memory_mib_free - memory_mib) / max(1, spec.memory_mib)) / 2
        if best is None or score > best[0]:
            best = (score, i, slices)
    return None if best is None else (best[1], best[2])
