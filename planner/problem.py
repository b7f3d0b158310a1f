"""The snapshot compiled into plain indexed structures the algorithms work on.

Built once per `plan()` call; everything after this step works with integers and lists, not
pydantic models, because the planner must stay fast on thousands of GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynpart.catalog import Catalog, GpuModel
from dynpart.mig import MigRules
from dynpart.planner.types import WHOLE_GPU, MigSliceRef, MpsSliceRef, SliceRef
from dynpart.resources import MigResource, MpsResource, WholeGpuResource, parse_resource
from dynpart.snapshot import Mode, Node, PendingPod, RequestShare, Snapshot, gpu_capacity, validate_snapshot

KIND_MIG, KIND_MPS, KIND_GPU = "mig", "mps", "gpu"


@dataclass
class GpuInfo:
    gid: int
    node: int
    index: int
    model: GpuModel
    rules: MigRules | None
    capacity: int  # MPS capacity (unused on MIG nodes)
    # MIG: existing instances as (profile index, start, pod or None); used ones are fixed
    used_mig: list[tuple[int, int, str | None]] = field(default_factory=list)
    free_mig: list[tuple[int, int]] = field(default_factory=list)
    # MPS: existing slices (size, pod)
    used_mps: list[tuple[int, str | None]] = field(default_factory=list)
    free_mps: list[int] = field(default_factory=list)
    whole_pod: str | None = None

    @property
    def has_used(self) -> bool:
        return bool(self.used_mig or self.used_mps or self.whole_pod)


@dataclass
class NodeInfo:
    idx: int
    name: str
    mode: Mode
    model: GpuModel
    cpu_free: int
    mem_free: int
    labels: dict[str, str]
    gpus: list[int]  # gids


@dataclass
class Request:
    """One pending pod: `count` slices of one resource, all on one node."""

    idx: int
    name: str
    resource: str
    kind: str  # mig | mps | gpu
    slice_ref: SliceRef  # what it asks of each GPU it lands on
    profile: str | None
    size: int  # MPS size; MIG: memory slices of the profile on the first candidate model
    count: int
    cpu: int
    mem: int
    priority: int
    weight: int = 1
    candidates: list[int] = field(default_factory=list)  # node indices
    no_candidate_reason: str | None = None
    min_memory: int = 0  # MIG: the profile's fewest memory and compute slices among the candidates' models
    min_compute: int = 0
    _cand: np.ndarray | None = None

    def candidate_array(self) -> np.ndarray:
        if self._cand is None:
            self._cand = np.array(self.candidates, dtype=np.int64)
        return self._cand


@dataclass(frozen=True, slots=True)
class DemandKind:
    """One kind of request of the distribution the objective keeps capacity usable for
    (`dynpart.snapshot.RequestShare`, compiled)."""

    ref: SliceRef
    count: int
    cpu: int
    mem: int
    weight: float


@dataclass
class Problem:
    nodes: list[NodeInfo]
    gpus: list[GpuInfo]
    requests: list[Request]
    # the request distribution of the objective (the snapshot's workload, else the pending pods)
    workload: list[DemandKind] = field(default_factory=list)
    # what a `PlanningSession` keeps between plans (planner/index.py, `PlanCache`); None: build it
    cache: Any = None


# Weights stay far below CP-SAT's int64 objective range (they are multiplied by 0/1 per pod).
_MAX_WEIGHT = 1 << 40


def priority_weights(priorities: list[int]) -> dict[int, int]:
    """Weight per priority level such that one pod of a level outweighs all pods of lower
    levels together: placing the most pods is weighted by priority, strictly. With so many
    levels and pods that strict weights would overflow, the highest levels only weigh more
    (one more than the level below) instead of dominating."""
    levels = sorted(set(priorities))
    counts = {lvl: priorities.count(lvl) for lvl in levels}
    weights: dict[int, int] = {}
    below = 0
    previous = 0
    for lvl in levels:
        weights[lvl] = below + 1 if below + 1 <= _MAX_WEIGHT else previous + 1
        previous = weights[lvl]
        below += weights[lvl] * counts[lvl]
    return weights


def compile_problem(snapshot: Snapshot, catalog: Catalog) -> Problem:
    models = validate_snapshot(snapshot, catalog)
    nodes, gpus = compile_cluster(snapshot.nodes, models)
    problem = Problem(nodes, gpus, [])
    problem.requests = compile_requests(problem, snapshot.pending, catalog, {})
    problem.workload = compile_workload(snapshot.workload, snapshot.pending)
    return problem


def compile_cluster(snapshot_nodes: Sequence[Node], models: dict[str, GpuModel]) -> tuple[list[NodeInfo], list[GpuInfo]]:
    """The nodes and their GPUs as they are (validated already; `models`: each node's model)."""
    nodes: list[NodeInfo] = []
    gpus: list[GpuInfo] = []
    for ni, node in enumerate(snapshot_nodes):
        model = models[node.name]
        rules = MigRules.of(model) if node.mode == "mig" else None
        gids = []
        for gpu in sorted(node.gpus, key=lambda g: g.index):
            info = GpuInfo(
                gid=len(gpus), node=ni, index=gpu.index, model=model, rules=rules,
                capacity=gpu_capacity(gpu, model), whole_pod=gpu.whole_pod,
            )
            if rules is not None:
                for inst in sorted(gpu.mig, key=lambda m: m.start):
                    p = rules.index[inst.profile]
                    if inst.used or inst.pod:
                        info.used_mig.append((p, inst.start, inst.pod))
                    else:
                        info.free_mig.append((p, inst.start))
            else:
                for s in gpu.mps:
                    if s.used or s.pod:
                        info.used_mps.append((s.size, s.pod))
                    else:
                        info.free_mps.append(s.size)
                info.free_mps.sort(reverse=True)
            gids.append(info.gid)
            gpus.append(info)
        nodes.append(NodeInfo(ni, node.name, node.mode, model, node.cpu_milli_free,
                              node.memory_mib_free, dict(node.labels), gids))
    return nodes, gpus


# per request signature (kind, profile, size, count, selector, accepted models): the nodes that may
# host it whatever the layout and CPU/memory, and why the others may not
StaticFilter = dict[tuple[object, ...], tuple[np.ndarray, list[tuple[int, str]]]]


def compile_requests(problem: Problem, pending: Sequence[PendingPod], catalog: Catalog,
                     static: StaticFilter, cpu_free: np.ndarray | None = None,
                     mem_free: np.ndarray | None = None) -> list[Request]:
    """The pending pods as requests with their candidate nodes. `static` caches the filters that
    do not depend on CPU/memory (valid as long as the nodes' modes, labels and models are)."""
    nodes, gpus = problem.nodes, problem.gpus
    weights = priority_weights([p.priority for p in pending])
    if cpu_free is None or mem_free is None:
        cpu_free = np.array([n.cpu_free for n in nodes], dtype=np.int64)
        mem_free = np.array([n.mem_free for n in nodes], dtype=np.int64)
    requests: list[Request] = []
    mig_shapes: dict[tuple[object, ...], tuple[int, int]] = {}
    for pi, pod in enumerate(pending):
        res = parse_resource(pod.resource)
        ref: SliceRef
        if isinstance(res, MigResource):
            kind, ref, profile, size = KIND_MIG, MigSliceRef(res.profile), res.profile, 0
        elif isinstance(res, MpsResource):
            kind, ref, profile, size = KIND_MPS, MpsSliceRef(res.size), None, res.size
        else:
            assert isinstance(res, WholeGpuResource)
            kind, ref, profile, size = KIND_GPU, WHOLE_GPU, None, 0
        req = Request(pi, pod.name, pod.resource, kind, ref, profile, size, pod.count, pod.cpu_milli,
                      pod.memory_mib, pod.priority, weights[pod.priority])
        accepted = frozenset(catalog.resolve(m).family_name for m in pod.gpu_models)
        sig = (kind, profile, size, pod.count, tuple(sorted(pod.node_selector.items())), accepted)
        hit = static.get(sig)
        if hit is None:
            ok, reasons = [], []
            for candidate in nodes:
                why = _node_rejects(candidate, gpus, req, pod.node_selector, accepted)
                if why is None:
                    ok.append(candidate.idx)
                else:
                    reasons.append(why)
            hit = static[sig] = (np.array(ok, dtype=np.int64), reasons)
        ok_nodes, reasons = hit
        fits = ok_nodes[(cpu_free[ok_nodes] >= req.cpu) & (mem_free[ok_nodes] >= req.mem)] if len(ok_nodes) else ok_nodes
        req._cand = fits
        req.candidates = fits.tolist()
        if isinstance(ref, MigSliceRef) and req.candidates:
            req.size = nodes[req.candidates[0]].model.profiles_by_name[ref.profile].memory
            # one profile name can have different shapes on different models (A100-40GB's
            # 1g.10gb takes two memory slices, A100-80GB's one): the smallest, for the bound
            shapes = mig_shapes.get(sig)
            if shapes is None:
                profs = {nodes[n].model.profiles_by_name[ref.profile] for n in ok_nodes.tolist()}
                shapes = mig_shapes[sig] = (min(p.memory for p in profs), min(p.compute for p in profs))
            req.min_memory, req.min_compute = shapes
        if not req.candidates:
            if len(ok_nodes):
                req.no_candidate_reason = (f"not enough free CPU/memory on any matching node "
                                           f"(asks {req.cpu}m CPU, {req.mem} MiB)")
            else:
                req.no_candidate_reason = _summarise(reasons, len(nodes))
        requests.append(req)
    return requests


def compile_workload(workload: Sequence[RequestShare], pending: Sequence[PendingPod]) -> list[DemandKind]:
    """The objective's request distribution: the snapshot's, else one share per pending pod.
    Equal kinds are merged, in a canonical order (the plan does not depend on the list's order)."""
    items = ([(w.resource, w.count, w.cpu_milli, w.memory_mib, w.weight) for w in workload] if workload else
             [(p.resource, p.count, p.cpu_milli, p.memory_mib, 1.0) for p in pending])
    acc: dict[tuple[SliceRef, int, int, int], float] = {}
    for resource, count, cpu, mem, weight in items:
        key = (slice_ref_of(resource), count, cpu, mem)
        acc[key] = acc.get(key, 0.0) + weight
    return [DemandKind(r, c, cpu, mem, w) for (r, c, cpu, mem), w in sorted(acc.items(), key=lambda kv: (ref_order(kv[0][0]),) + kv[0][1:])]


def slice_ref_of(resource: str) -> SliceRef:
    res = parse_resource(resource)
    if isinstance(res, MigResource):
        return MigSliceRef(res.profile)
    if isinstance(res, MpsResource):
        return MpsSliceRef(res.size)
    return WHOLE_GPU


def ref_order(ref: SliceRef) -> tuple[int, str, int]:
    """A canonical order of slice kinds: MIG profiles by name, MPS sizes, whole GPUs."""
    if isinstance(ref, MigSliceRef):
        return (0, ref.profile, 0)
    if isinstance(ref, MpsSliceRef):
        return (1, "", ref.size)
    return (2, "", 0)


def _node_rejects(node: NodeInfo, gpus: list[GpuInfo], req: Request, selector: dict[str, str],
                  accepted: Set[str]) -> tuple[int, str] | None:
    """Why this node can never host the pod (whatever the layout), or None if it may.
    The number is how far the node got through the filters (for the summary)."""
    wanted_mode = "mig" if req.kind == KIND_MIG else "mps"
    if node.mode != wanted_mode:
        return 0, f"no node in {wanted_mode} mode"
    for k, v in selector.items():
        if node.labels.get(k) != v:
            return 1, f"no {wanted_mode} node matches nodeSelector {k}={v}"
    if accepted and node.model.family_name not in accepted:
        return 2, f"no {wanted_mode} node has an accepted GPU model ({', '.join(sorted(accepted))})"
    if req.kind == KIND_MIG and req.profile not in node.model.profiles_by_name:
        return 3, f"MIG profile {req.profile} is not offered by the GPU models of the mig nodes"
    if req.kind == KIND_MPS:
        caps = [gpus[g].capacity for g in node.gpus]
        if not caps or max(caps) < req.size:
            return 3, f"a {req.size} slice is bigger than every MPS GPU (largest {max(caps, default=0)})"
    if req.kind == KIND_MIG and req.count > len(node.gpus) * node.model.memory_slices:
        return 4, f"{req.count} slices do not fit on one node"
    if req.kind == KIND_GPU and req.count > len(node.gpus):
        return 4, f"{req.count} whole GPUs asked; nodes have at most {len(node.gpus)}"
    return None


def _summarise(reasons: list[tuple[int, str]], n_nodes: int) -> str:
    """The reason of the node that got furthest through the filters is the most telling."""
    if not n_nodes:
        return "no GPU nodes in the cluster"
    return max(reasons, key=lambda r: r[0])[1]
