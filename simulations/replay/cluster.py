"""The replayed cluster, kept in the planner's own models.

Every node is a `dynpart.snapshot.Node`: CPU and memory free, and GPUs whose MIG instances or
MPS slices are the current layout, `used` with the holding pod's name (a whole GPU: `whole_pod`).
What `plan()` is given is this state as it is (the GPU nodes, with the waiting pods); a plan's
layouts and placements are applied to it in place. The planner's models say nothing of time:
`GpuClock` keeps, beside each GPU, until when it is busy reconfiguring and when each of its
slices is (or was) ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.resources import WHOLE_GPU, mig_resource_name, mps_resource_name
from dynpart.simulations import bridge
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.replay.mapping import held_share
from dynpart.snapshot import Gpu, GpuLayout, MigInstance, Mode, MpsSlice, Node, PendingPod, PlacedSlice, Snapshot

Slice = MigInstance | MpsSlice


@dataclass
class GpuClock:
    """The times of one GPU: busy until a reconfiguration is done; when each slice is ready."""

    busy_until: float = 0.0
    # by the identity of the GPU's current slice objects (the models are mutable, so unhashable;
    # the map is rebuilt whenever the layout changes, so no stale identity is ever looked up)
    _ready: dict[int, float] = field(default_factory=dict)

    def ready_at(self, s: Slice) -> float:
        return self._ready[id(s)]

    def reset(self, ready: list[tuple[Slice, float]]) -> None:
        self._ready = {id(s): t for s, t in ready}


class ReplayCluster:
    """Nodes in one GPU model and one mode (MIG or MPS); CPU-only nodes too."""

    def __init__(self, spec: ClusterSpec, catalog: Catalog, mode: str | None):
        gpu_specs = [n for n in spec.nodes if n.gpus]
        models = {n.model for n in gpu_specs}
        if len(models) != 1:
            raise SimulationError(f"{spec.source}: replay needs GPU nodes of one model; found "
                                  f"{', '.join(sorted(models)) or 'none'}")
        try:
            self.model: GpuModel = catalog.resolve(models.pop(), where=f"{spec.source}: gpu_model")
        except DynpartError as e:
            raise SimulationError(str(e)) from None
        modes = {n.mode for n in gpu_specs}
        if mode is None and len(modes) > 1:
            raise SimulationError(f"{spec.source}: replay needs GPU nodes of one mode; found {', '.join(sorted(modes))} "
                                  "(or give --mode to replay them all in one)")
        # modes are checked where they are read (cluster files, --mode): "mig" or "mps"
        self.mode: Mode = "mig" if (mode or gpu_specs[0].mode) == "mig" else "mps"
        if self.mode == "mig" and not self.model.supports_mig:
            raise SimulationError(f"{spec.source}: {self.model.name} does not support MIG; use --mode mps")
        self.spec = spec
        self.nodes: list[Node] = [
            bridge.node(n.name, self.mode, self.model.name, n.cpu_milli, n.memory_mib,
                        [Gpu.model_construct(index=g, mig=[], mps=[], whole_pod=None, capacity=None)
                         for g in range(n.gpus)])
            for n in spec.nodes]
        self.gpu_nodes = [n for n in self.nodes if n.gpus]  # the planner only needs GPU nodes
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.clocks = [[GpuClock() for _ in n.gpus] for n in self.nodes]
        self.capacity = self.model.mps_capacity_gb  # MPS capacity unit: GiB, what a node's agent reports
        self.gpu_count = sum(len(n.gpus) for n in self.nodes)
        self.draining: set[tuple[int, int]] = set()  # (node, GPU) whose spec drains it (GpuLayout.drain)
        # per node, bumped by every change of its GPUs (layouts, holders, busy times): what is read
        # of a node's slices is kept until it changes (`scheduler.free_by_resource`, `allocation`),
        # so a replay costs per event what changed, not the whole cluster
        self.versions = [0] * len(self.nodes)
        self.free_cache: list[tuple[int, float, float, dict[str, list[PlacedSlice]]] | None] = [None] * len(self.nodes)
        self._held_cache: list[tuple[int, list[float]] | None] = [None] * len(self.nodes)

    # --- what the planner and the metrics see --------------------------------------------------

    def snapshot(self, pending: list[PendingPod]) -> Snapshot:
        return bridge.snapshot(list(self.gpu_nodes), pending)

    def offered_resources(self) -> set[str]:
        """Resource names the current layouts offer (a whole GPU: on a GPU without slices)."""
        out: set[str] = set()
        for node in self.nodes:
            for g in node.gpus:
                if self.mode == "mig":
                    out.update(mig_resource_name(m.profile) for m in g.mig)
                elif g.mps:
                    out.update(mps_resource_name(s.size) for s in g.mps)
                else:
                    out.add(WHOLE_GPU)
        return out

    def allocation(self) -> float:
        """% of the GPUs held by pods (MIG: by memory slices; MPS: by slice size)."""
        held = 0.0
        for i in range(len(self.nodes)):
            for share in self._held_shares(i):  # (summed GPU by GPU in one order: the same float each run)
                held += share
        return 100.0 * held / self.gpu_count if self.gpu_count else 0.0

    def _held_shares(self, i: int) -> list[float]:
        """Per GPU of node i, the share of it pods hold; kept until the node changes."""
        cached = self._held_cache[i]
        if cached is not None and cached[0] == self.versions[i]:
            return cached[1]
        shares: list[float] = []
        for g in self.nodes[i].gpus:
            if self.mode == "mig":
                shares.append(sum(held_share(self.model, "mig", m.profile, 0) for m in g.mig if m.used))
            elif g.whole_pod is not None:
                shares.append(1.0)
            else:
                shares.append(sum(s.size for s in g.mps if s.used) / self.capacity)
        self._held_cache[i] = (self.versions[i], shares)
        return shares

    def busy(self, node: int, gpu: int, until: float) -> None:
        """The GPU reconfigures until then (its slices and, bare, the GPU itself are not advertised)."""
        self.clocks[node][gpu].busy_until = until
        self.versions[node] += 1

    def never_fits(self, pod: TracePod) -> str | None:
        """Why the pod could not run even on the empty cluster, or None."""
        hosts = [n for n in self.spec.nodes if n.cpu_milli >= pod.cpu_milli and n.memory_mib >= pod.memory_mib
                 and (pod.num_gpu == 0 or n.gpus >= pod.num_gpu)]
        if not hosts:
            return (f"no node has {pod.cpu_milli}m CPU, {pod.memory_mib} MiB"
                    + (f" and {pod.num_gpu} GPUs" if pod.num_gpu else ""))
        return None

    # --- layouts ---------------------------------------------------------------------------

    def changes(self, node: int, layout: GpuLayout) -> tuple[int, int]:
        """(slices created, slices destroyed) to go from the GPU's layout to the planned one."""
        g = self.nodes[node].gpus[layout.index]
        if self.mode == "mig":
            old = {(m.profile, m.start) for m in g.mig}
            new = [(m.profile, m.start) for m in layout.mig]
            return sum(1 for k in new if k not in old), len(old - set(new))
        new_sizes = [s.size for s in layout.mps]
        kept = _multiset_common([s.size for s in g.mps], new_sizes)
        return len(new_sizes) - kept, len(g.mps) - kept

    def set_layout(self, node: int, layout: GpuLayout, ready: float) -> None:
        """Make the planned layout the GPU's: slices it keeps keep their holder and ready time,
        new ones are free and ready at `ready`."""
        g = self.nodes[node].gpus[layout.index]
        clock = self.clocks[node][layout.index]
        self.versions[node] += 1
        times: list[tuple[Slice, float]] = []
        if self.mode == "mig":
            old = {(m.profile, m.start): m for m in g.mig}
            mig: list[MigInstance] = []
            for profile, start in sorted(((m.profile, m.start) for m in layout.mig), key=lambda k: k[1]):
                inst = old.get((profile, start))
                if inst is None:
                    inst = MigInstance.model_construct(profile=profile, start=start, used=False, pod=None)
                    times.append((inst, ready))
                else:
                    times.append((inst, clock.ready_at(inst)))
                mig.append(inst)
            g.mig = mig
        else:
            held = [s for s in g.mps if s.used]
            free = [s for s in g.mps if not s.used]
            times.extend((s, clock.ready_at(s)) for s in held)
            new_free: list[MpsSlice] = []
            for size in (s.size for s in layout.mps if not s.used):  # free or planned slices of the new layout
                k = next((i for i, s in enumerate(free) if s.size == size), None)
                if k is not None:
                    same = free.pop(k)
                    times.append((same, clock.ready_at(same)))
                else:
                    same = MpsSlice.model_construct(size=size, used=False, pod=None)
                    times.append((same, ready))
                new_free.append(same)
            g.mps = held + new_free
        clock.reset(times)

    # --- pods ------------------------------------------------------------------------------

    def take(self, node: int, placed: PlacedSlice, pod: str, now: float) -> float:
        """Give a free slice to the pod; returns when it is ready. Never a slice a pod holds."""
        gpu, what = placed.gpu, str(placed)
        g = self.nodes[node].gpus[gpu]
        clock = self.clocks[node][gpu]
        self.versions[node] += 1
        if placed.kind == "whole":
            if g.whole_pod is not None or g.mps:
                raise AssertionError(f"GPU {gpu} is not free for {pod} (whole GPU)")
            g.whole_pod = pod
            clock.busy_until = max(clock.busy_until, now)
            return clock.busy_until
        if placed.kind == "mig":
            for inst in g.mig:
                if inst.profile == placed.profile and inst.start == placed.start:
                    if inst.used:
                        raise AssertionError(f"{pod} planned on {what} of GPU {gpu}, held by {inst.pod}")
                    inst.used, inst.pod = True, pod
                    return clock.ready_at(inst)
            raise AssertionError(f"{pod} planned on {what} of GPU {gpu}, which the layout lacks")
        size = placed.size
        for sl in g.mps:
            if sl.size == size and not sl.used:
                sl.used, sl.pod = True, pod
                return clock.ready_at(sl)
        raise AssertionError(f"{pod} planned on a free {size} GB slice of GPU {gpu}, which the layout lacks")

    def release(self, node: int, slices: list[PlacedSlice], pod: str) -> None:
        """The pod left: the slices it held are free (they stay in the layout)."""
        self.versions[node] += 1
        for placed in slices:
            g = self.nodes[node].gpus[placed.gpu]
            if placed.kind == "whole":
                g.whole_pod = None
            elif placed.kind == "mig":
                for inst in g.mig:
                    if inst.pod == pod:
                        inst.used, inst.pod = False, None
            else:
                for sl in g.mps:
                    if sl.pod == pod:
                        sl.used, sl.pod = False, None

    def drop_free(self, node: int, gpu: int) -> int:
        """A drained GPU's agent destroys its slices as they free: they leave the layout at once
        (never advertised again). Returns how many went."""
        g = self.nodes[node].gpus[gpu]
        self.versions[node] += 1
        gone = sum(1 for m in g.mig if not m.used) + sum(1 for s in g.mps if not s.used)
        if gone:
            g.mig = [m for m in g.mig if m.used]
            g.mps = [s for s in g.mps if s.used]
        return gone

    def reserve(self, node: int, pod: TracePod) -> None:
        n = self.nodes[node]
        n.cpu_milli_free -= pod.cpu_milli
        n.memory_mib_free -= pod.memory_mib

    def unreserve(self, node: int, pod: TracePod) -> None:
        n = self.nodes[node]
        n.cpu_milli_free += pod.cpu_milli
        n.memory_mib_free += pod.memory_mib


def _multiset_common(a: list[int], b: list[int]) -> int:
    left = list(b)
    n = 0
    for x in a:
        if x in left:
            left.remove(x)
            n += 1
    return n
