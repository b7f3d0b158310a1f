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


def free_by_resource(cl: ReplayCluster, node: int, now: float) -> dict[str, list[PlacedSlice]]:
    """The node's free, advertised slices of each resource, those on the fullest GPUs first (then
    by GPU, then in layout order). Kept while the node does not change (`ReplayCluster.versions`)
    and no slice of it becomes ready: the clock only moves forward."""
    cached = cl.free_cache[node]
    if cached is not None and cached[0] == cl.versions[node] and cached[1] <= now < cached[2]:
        return cached[3]
    found: dict[str, list[tuple[int, int, PlacedSlice]]] = {}
    upcoming = float("inf")  # the first time a slice not ready yet is: the answer changes then
    for g in cl.nodes[node].gpus:
        clock = cl.clocks[node][g.index]
        if not g.mig and not g.mps:
            if g.whole_pod is None:
                if clock.busy_until <= now:
                    found.setdefault(WHOLE_GPU, []).append((0, g.index, PlacedSlice.whole(g.index)))
                else:
                    upcoming = min(upcoming, clock.busy_until)
            continue
        held = sum(1 for m in g.mig if m.used) + sum(1 for s in g.mps if s.used)
        for m in g.mig:
            if not m.used:
                at = clock.ready_at(m)
                if at <= now:
                    found.setdefault(mig_resource_name(m.profile), []).append(
                        (-held, g.index, PlacedSlice.mig(g.index, m.profile, m.start)))
                else:
                    upcoming = min(upcoming, at)
        for sl in g.mps:
            if not sl.used:
                at = clock.ready_at(sl)
                if at <= now:
                    found.setdefault(mps_resource_name(sl.size), []).append(
                        (-held, g.index, PlacedSlice.mps(g.index, sl.size)))
                else:
                    upcoming = min(upcoming, at)
    out = {}
    for resource, entries in found.items():
        entries.sort(key=lambda f: (f[0], f[1]))  # (stable: layout order among equals)
        out[resource] = [f[2] for f in entries]
    cl.free_cache[node] = (cl.versions[node], now, upcoming, out)
    return out


def free_slices(cl: ReplayCluster, node: int, resource: str, now: float) -> list[PlacedSlice]:
    """The node's free, advertised slices of `resource`, those on the fullest GPUs first."""
    return free_by_resource(cl, node, now).get(resource, [])


def free_counts(cl: ReplayCluster, now: float) -> Counter[str]:
    """Free, advertised slices of each resource over the cluster."""
    out: Counter[str] = Counter()
    for i, n in enumerate(cl.nodes):
        if n.gpus:
            for resource, slices in free_by_resource(cl, i, now).items():
                out[resource] += len(slices)
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
