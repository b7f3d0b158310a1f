"""Between the simulator and the planner: the catalog entries for trace GPU models, pending pods
and snapshots built from simulator state, and the checks applied to every returned plan.

The simulator calls the planner's one entry point, `planner.plan()`, with these snapshots; no
planning logic lives here. Models are built with `model_construct` where the simulator already
guarantees what validation would check (indices unique, slices within capacity); `plan()`
still validates every snapshot against the catalog.
"""

from __future__ import annotations

from collections.abc import Iterable

from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.resources import WHOLE_GPU, mps_resource_name
from dynpart.simulations.inputs.traces import TracePod
from dynpart.snapshot import Gpu, Mode, MpsSlice, Node, PendingPod, Plan, Snapshot

# Memory of the openb GPU models (GB). G1/G2/G3 are undisclosed; their value only matters as
# the default MPS capacity, which packing snapshots override (capacity 1000 = GPU milli).
TRACE_GPU_MEMORY_GB = {"T4": 16, "P100": 16, "V100M16": 16, "V100M32": 32, "A10": 24, "A100": 80,
                       "G1": 16, "G2": 32, "G3": 32}


def catalog_for(models: Iterable[str], base: Catalog) -> Catalog:
    """The packing protocol's catalog: the base catalog plus a plain (MPS-only) entry for each
    model it does not know, every model without a bound on the pods sharing one GPU (the
    protocol shares a GPU by milli alone, whatever its model: no MPS server's client limit)."""
    extra = []
    for m in sorted(set(models)):
        if not m:
            continue
        try:
            base.resolve(m)
        except DynpartError:
            extra.append(GpuModel(name=m, memory_gb=TRACE_GPU_MEMORY_GB.get(m, 16)))
    return Catalog([m.model_copy(update={"mps_max_clients": None}) for m in [*base.models.values(), *extra]])


def packing_request(pod: TracePod) -> tuple[str, int]:
    """(resource, count) of a GPU pod in MPS mode, capacity unit = GPU milli."""
    if pod.is_share:
        return mps_resource_name(pod.gpu_milli), 1
    return WHOLE_GPU, pod.num_gpu


def pending_pod(pod: TracePod, resource: str, count: int, priority: int = 0,
                node_selector: dict[str, str] | None = None, gpu_spec: bool = True) -> PendingPod:
    """The pod as the planner's `PendingPod`; `gpu_spec=False` leaves out the trace's GPU models
    (the replay: its cluster has its own model, not the trace's)."""
    return PendingPod.model_construct(
        name=pod.name, resource=resource, count=count, cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib,
        priority=priority, node_selector=node_selector or {}, gpu_models=list(pod.gpu_spec) if gpu_spec else [])


def mps_gpu(index: int, capacity: int, holders: dict[str, int], whole: bool) -> Gpu:
    """An MPS GPU whose pods hold one used slice each (or the whole GPU)."""
    if whole:
        (pod,) = holders
        return Gpu.model_construct(index=index, mig=[], mps=[], whole_pod=pod, capacity=capacity)
    return Gpu.model_construct(index=index, mig=[], whole_pod=None, capacity=capacity,
                               mps=[MpsSlice.model_construct(size=m, used=True, pod=p) for p, m in holders.items()])


def node(name: str, mode: Mode, model: str, cpu_free: int, mem_free: int, gpus: list[Gpu],
         labels: dict[str, str] | None = None) -> Node:
    return Node.model_construct(name=name, mode=mode, gpu_model=model, cpu_milli_free=int(cpu_free),
                                memory_mib_free=int(mem_free), labels=labels or {}, gpus=gpus)


def snapshot(nodes: list[Node], pending: list[PendingPod]) -> Snapshot:
    return Snapshot.model_construct(nodes=nodes, pending=pending)


# --- checks on plans ----------------------------------------------------------------------------


def disrupted_slices(snap: Snapshot, plan: Plan) -> list[str]:
    """Used slices of the snapshot that the plan's layouts do not keep in place (must be none).
    A GPU the plan does not list keeps its layout."""
    planned = {lay.node: {g.index: g for g in lay.gpus} for lay in plan.layouts}
    out: list[str] = []
    for n in snap.nodes:
        gpus = planned.get(n.name)
        if not gpus:
            continue
        for gpu in n.gpus:
            lay = gpus.get(gpu.index)
            if lay is None:
                continue
            where = f"{n.name}/gpu{gpu.index}"
            kept_mig = {(m.profile, m.start): m for m in lay.mig}
            for m in gpu.mig:
                if not (m.used or m.pod):
                    continue
                got = kept_mig.get((m.profile, m.start))
                if got is None or not (got.used or got.pod) or (m.pod and got.pod != m.pod):
                    out.append(f"{where}: MIG {m.profile}@{m.start} (pod {m.pod})")
            left = [(s.size, s.pod) for s in lay.mps if s.used or s.pod]
            for s in gpu.mps:
                if not (s.used or s.pod):
                    continue
                if (s.size, s.pod) in left:
                    left.remove((s.size, s.pod))
                else:
                    out.append(f"{where}: MPS slice {s.size} (pod {s.pod})")
            if gpu.whole_pod and lay.whole_pod != gpu.whole_pod:
                out.append(f"{where}: whole GPU (pod {gpu.whole_pod})")
    return out
