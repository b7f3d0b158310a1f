"""The snapshot compiled into plain indexed structures the algorithms work on.

Built once per `plan()` call; everything after this step works with integers and lists, not
pydantic models, because the planner must stay fast on thousands of GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from dynpart.catalog import Catalog, GpuModel
from dynpart.mig import MigRules
from dynpart.planner.types import WHOLE_GPU, MigSliceRef, MpsSliceRef, SliceRef
from dynpart.resources import MigResource, MpsResource, WholeGpuResource, parse_resource
from dynpart.scheduling import NodeSelectorTerm, Taint, Toleration, affinity_admits, untolerated_taint
from dynpart.snapshot import Gpu, Mode, Node, PendingPod, RequestShare, Snapshot, gpu_capacity, validate_snapshot

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
    # MIG: every instance as (profile index, start, used) in start order, as `compile_cluster`
    # reads them (a `MigState` keys its bucket by it); None: derived from used_mig and free_mig
    # (`init=False`: a `replace`d copy, with other instances, does not keep it)
    mig_layout: tuple[tuple[int, int, bool], ...] | None = field(default=None, init=False, repr=False, compare=False)

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
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()


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
    # the requests (indices) it must not share a node with (`PendingPod.apart`), ascending
    apart: tuple[int, ...] = ()
    _cand: np.ndarray | None = None

    def candidate_array(self) -> np.ndarray:
        if self._cand is None:
            self._cand = np.array(self.candidates, dtype=np.int64)
        return self._cand


@dataclass(frozen=True)
class NodeConstraints:
    """What of a pod the kube-scheduler's node filters read besides its selector and resources
    (dynpart/scheduling.py)."""

    tolerations: tuple[Toleration, ...] = ()
    affinity: tuple[NodeSelectorTerm, ...] = ()  # required terms, any of them

    @property
    def by_name(self) -> bool:
        """Whether the affinity names nodes (`matchFields` on metadata.name): then nodes with the
        same labels may differ."""
        return any(term.match_fields for term in self.affinity)


@dataclass(frozen=True, slots=True)
class DemandKind:
    """One kind of request of the distribution the objective keeps capacity usable for
    (`dynpart.snapshot.RequestShare`, compiled), with what restricts the nodes it may use."""

    ref: SliceRef
    count: int
    cpu: int
    mem: int
    weight: float
    models: frozenset[str] = frozenset()  # GPU model families it accepts; empty: any
    selector: tuple[tuple[str, str], ...] = ()  # nodeSelector, sorted
    constraints: NodeConstraints = NodeConstraints()

    @property
    def restricted(self) -> bool:
        """Whether it asks for more of a node than its resources (a model, labels, affinity)."""
        return bool(self.models or self.selector or self.constraints.affinity)

    def admits(self, node: NodeInfo) -> bool:
        """Whether its pods may run on the node at all (as `plan()` filters pods' nodes)."""
        return _access_rejects(node, dict(self.selector), self.models, self.constraints, node.mode) is None


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
    problem.workload = compile_workload(snapshot.workload, snapshot.pending, catalog)
    return problem


def compile_cluster(snapshot_nodes: Sequence[Node], models: dict[str, GpuModel]) -> tuple[list[NodeInfo], list[GpuInfo]]:
    """The nodes and their GPUs as they are (validated already; `models`: each node's model)."""
    nodes: list[NodeInfo] = []
    gpus: list[GpuInfo] = []
    rules_of: dict[int, MigRules] = {}  # per model (by id): its rules, looked up once
    for ni, node in enumerate(snapshot_nodes):
        model = models[node.name]
        rules: MigRules | None = None
        if node.mode == "mig":
            rules = rules_of.get(id(model))
            if rules is None:
                rules = rules_of[id(model)] = MigRules.of(model)
        gids = []
        node_gpus = node.gpus
        if not _ascending(node_gpus):
            node_gpus = sorted(node_gpus, key=_by_index)
        for gpu in node_gpus:
            used_mig: list[tuple[int, int, str | None]] = []
            free_mig: list[tuple[int, int]] = []
            used_mps: list[tuple[int, str | None]] = []
            free_mps: list[int] = []
            layout: list[tuple[int, int, bool]] | None = None
            if rules is not None:
                index = rules.index
                layout = []
                # by start: a snapshot mostly lists them so (else sorted below, stably)
                last, ordered = -1, True
                for inst in gpu.mig:
                    p, start, pod = index[inst.profile], inst.start, inst.pod
                    if start <= last:
                        ordered = False
                    last = start
                    if inst.used or pod:
                        used_mig.append((p, start, pod))
                        layout.append((p, start, True))
                    else:
                        free_mig.append((p, start))
                        layout.append((p, start, False))
                if not ordered:
                    used_mig.sort(key=_second)
                    free_mig.sort(key=_second)
                    layout = None  # (`MigState` orders them as it always has)
            else:
                for s in gpu.mps:
                    if s.used or s.pod:
                        used_mps.append((s.size, s.pod))
                    else:
                        free_mps.append(s.size)
                free_mps.sort(reverse=True)
            info = GpuInfo(len(gpus), ni, gpu.index, model, rules, gpu_capacity(gpu, model), used_mig, free_mig,
                           used_mps, free_mps, gpu.whole_pod)
            if layout is not None:
                info.mig_layout = tuple(layout)
            gids.append(len(gpus))
            gpus.append(info)
        nodes.append(NodeInfo(ni, node.name, node.mode, model, node.cpu_milli_free,
                              node.memory_mib_free, dict(node.labels), gids, node.unschedulable, tuple(node.taints)))
    return nodes, gpus


def _ascending(gpus: Sequence[Gpu]) -> bool:
    """Whether the GPUs are listed by index (as a snapshot mostly lists them)."""
    last = -1
    for gpu in gpus:
        if gpu.index < last:
            return False
        last = gpu.index
    return True


_second = itemgetter(1)
_by_index = attrgetter("index")


# per request signature (kind, profile, size, count, selector, accepted models, node constraints):
# the nodes that may host it whatever the layout and CPU/memory, and why no node may when none may
StaticFilter = dict[tuple[object, ...], tuple[np.ndarray, str | None]]


def compile_requests(problem: Problem, pending: Sequence[PendingPod], catalog: Catalog,
                     static: StaticFilter, cpu_free: np.ndarray | None = None,
                     mem_free: np.ndarray | None = None) -> list[Request]:
    """The pending pods as requests with their candidate nodes. `static` caches the filters that
    do not depend on CPU/memory (valid as long as the nodes' modes, labels and models are).
    Requests of one signature asking the same CPU and memory share their candidate lists."""
    nodes, gpus = problem.nodes, problem.gpus
    weights = priority_weights([p.priority for p in pending])
    if cpu_free is None or mem_free is None:
        cpu_free = np.array([n.cpu_free for n in nodes], dtype=np.int64)
        mem_free = np.array([n.mem_free for n in nodes], dtype=np.int64)
    requests: list[Request] = []
    kinds: dict[str, tuple[str, SliceRef, str | None, int]] = {}
    groups: _NodeGroups | None = None
    # per pod's own fields (resource, count, models, selector, tolerations, affinity), the pods'
    # kinds and signatures: worked out once per distinct value (most pods share theirs), each
    # signature numbered; per signature number, its static filter and MIG shapes
    own_sigs: dict[tuple[object, ...], tuple[tuple[str, SliceRef, str | None, int], tuple[object, ...], int,
                                             frozenset[str], NodeConstraints]] = {}
    sig_ids: dict[tuple[object, ...], int] = {}
    hits: dict[int, tuple[np.ndarray, str | None]] = {}
    # per (signature number, CPU, memory): the candidates, as an array and a list, and the
    # profile's memory slices on the first's model (MIG)
    fitting: dict[tuple[int, int, int], tuple[np.ndarray, list[int], int]] = {}
    mig_shapes: dict[int, tuple[int, int]] = {}
    model_of: np.ndarray | None = None
    apart = False
    for pi, pod in enumerate(pending):
        if pod.apart:
            apart = True
        selector = pod.node_selector
        own = (pod.resource, pod.count, tuple(pod.gpu_models), tuple(sorted(selector.items())) if selector else (),
               tuple(pod.tolerations), tuple(pod.node_affinity))
        known = own_sigs.get(own)
        if known is None:
            kind_of = kinds.get(pod.resource)
            if kind_of is None:
                kind_of = kinds[pod.resource] = _kind_of(pod.resource)
            accepted = frozenset(catalog.resolve(m).family_name for m in pod.gpu_models)
            constraints = NodeConstraints(tuple(pod.tolerations), tuple(pod.node_affinity))
            signature: tuple[object, ...] = (kind_of[0], kind_of[2], kind_of[3], pod.count, own[3], accepted,
                                              constraints)
            known = own_sigs[own] = (kind_of, signature, sig_ids.setdefault(signature, len(sig_ids)), accepted,
                                     constraints)
        (kind, ref, profile, size), sig, sid, accepted, constraints = known
        req = Request(pi, pod.name, pod.resource, kind, ref, profile, size, pod.count, pod.cpu_milli,
                      pod.memory_mib, pod.priority, weights[pod.priority])
        hit = hits.get(sid)
        if hit is None:
            hit = static.get(sig)
            if hit is None:
                if groups is None:
                    groups = _NodeGroups(nodes, gpus)
                hit = static[sig] = groups.filter(req, selector, accepted, constraints)
            hits[sid] = hit
        ok_nodes, summary = hit
        fit = fitting.get((sid, req.cpu, req.mem))
        if fit is None:
            fits = ok_nodes[(cpu_free[ok_nodes] >= req.cpu) & (mem_free[ok_nodes] >= req.mem)] if len(ok_nodes) else ok_nodes
            cands = fits.tolist()
            mig_size = (nodes[cands[0]].model.profiles_by_name[ref.profile].memory
                        if isinstance(ref, MigSliceRef) and cands else 0)
            fit = fitting[(sid, req.cpu, req.mem)] = (fits, cands, mig_size)
        req._cand, req.candidates, mig_size = fit
        if isinstance(ref, MigSliceRef) and req.candidates:
            req.size = mig_size
            # one profile name can have different shapes on different models (A100-40GB's
            # 1g.10gb takes two memory slices, A100-80GB's one): the smallest, for the bound
            shapes = mig_shapes.get(sid)
            if shapes is None:
                if model_of is None:
                    model_of = _model_ids(nodes)
                profs = [nodes[n].model.profiles_by_name[ref.profile] for n in _one_per_value(model_of, ok_nodes)]
                shapes = mig_shapes[sid] = (min(p.memory for p in profs), min(p.compute for p in profs))
            req.min_memory, req.min_compute = shapes
        if not req.candidates:
            if len(ok_nodes):
                req.no_candidate_reason = (f"not enough free CPU/memory on any matching node "
                                           f"(asks {req.cpu}m CPU, {req.mem} MiB)")
            else:
                req.no_candidate_reason = summary
        requests.append(req)
    if apart:
        _keep_apart(requests, pending)
    return requests


def _keep_apart(requests: list[Request], pending: Sequence[PendingPod]) -> None:
    """Each request's `apart`, both ways (a snapshot planned without validation may list a pair
    once), names of pods not pending left out."""
    index = {pod.name: pi for pi, pod in enumerate(pending)}
    pairs: dict[int, set[int]] = {}
    for pi, pod in enumerate(pending):
        for name in pod.apart:
            other = index.get(name)
            if other is not None and other != pi:
                pairs.setdefault(pi, set()).add(other)
                pairs.setdefault(other, set()).add(pi)
    for pi, others in pairs.items():
        requests[pi].apart = tuple(sorted(others))


def _kind_of(resource: str) -> tuple[str, SliceRef, str | None, int]:
    """(kind, slice ref, MIG profile, MPS size) of a pod's resource."""
    res = parse_resource(resource)
    if isinstance(res, MigResource):
        return KIND_MIG, MigSliceRef(res.profile), res.profile, 0
    if isinstance(res, MpsResource):
        return KIND_MPS, MpsSliceRef(res.size), None, res.size
    assert isinstance(res, WholeGpuResource)
    return KIND_GPU, WHOLE_GPU, None, 0


def _model_ids(nodes: list[NodeInfo]) -> np.ndarray:
    """Per node, an id of its GPU model (equal models, equal ids)."""
    ids: dict[int, int] = {}
    return np.array([ids.setdefault(id(n.model), len(ids)) for n in nodes], dtype=np.int64)


def _one_per_value(values: np.ndarray, among: np.ndarray) -> list[int]:
    """One index of `among` per distinct value of `values` there (the first in order)."""
    _, first = np.unique(values[among], return_index=True)
    return [int(among[i]) for i in np.sort(first)]


class _NodeGroups:
    """The nodes grouped by what `_node_rejects` reads of them (mode, labels, taints, cordon, GPU
    model, GPU capacities): a request's static filter is decided once per group, not once per
    node (once per node when its affinity names nodes)."""

    def __init__(self, nodes: list[NodeInfo], gpus: list[GpuInfo]):
        self.nodes, self.gpus = nodes, gpus
        index: dict[tuple[object, ...], int] = {}
        of_node = []
        self.first: list[int] = []  # per group, its first node
        for node in nodes:
            key = (node.mode, tuple(sorted(node.labels.items())), node.unschedulable, node.taints, id(node.model),
                   tuple(gpus[g].capacity for g in node.gpus))
            g = index.get(key)
            if g is None:
                g = index[key] = len(self.first)
                self.first.append(node.idx)
            of_node.append(g)
        self.of_node = np.array(of_node, dtype=np.int64)

    def filter(self, req: Request, selector: dict[str, str], accepted: Set[str],
               constraints: NodeConstraints) -> tuple[np.ndarray, str | None]:
        """The nodes that may host the request, and (when none may) why not: the reason of the
        node that got furthest through the filters, the first such node in node order."""
        # groups are in the order of their first nodes; each node its own group when names matter
        reps = [n.idx for n in self.nodes] if constraints.by_name else self.first
        ok = np.zeros(len(reps), dtype=bool)
        furthest: tuple[int, str] | None = None
        for g, n in enumerate(reps):
            why = _node_rejects(self.nodes[n], self.gpus, req, selector, accepted, constraints)
            if why is None:
                ok[g] = True
            elif furthest is None or why[0] > furthest[0]:
                furthest = why
        summary = None if ok.any() else ("no GPU nodes in the cluster" if not self.nodes else
                                         furthest[1] if furthest is not None else None)
        admitted = ok if constraints.by_name else ok[self.of_node]
        return np.flatnonzero(admitted).astype(np.int64), summary


# a kind of the distribution: (slice, count, CPU, memory, GPU model families, selector, constraints)
_KindKey = tuple[SliceRef, int, int, int, tuple[str, ...], tuple[tuple[str, str], ...], NodeConstraints]


def compile_workload(workload: Sequence[RequestShare], pending: Sequence[PendingPod],
                     catalog: Catalog | None = None) -> list[DemandKind]:
    """The objective's request distribution: the snapshot's, else one share per pending pod.
    Equal kinds are merged, in a canonical order (the plan does not depend on the list's order).
    GPU models are resolved to their families with `catalog` (needed when a share names models)."""
    keys: list[_KindKey] = []
    totals: list[float] = []  # per key, its weight (added up in the items' order, as ever)
    slot: dict[_KindKey, int] = {}
    # per item's own fields, its key's slot: worked out once per distinct value (2,000 pending
    # pods of `dynpart bench planner` have a few hundred)
    slot_of: dict[tuple[object, ...], int] = {}
    # the weights are relative: scaled down where their sum would overflow (to inf, and the
    # objective's normalised weights to 0 or NaN), left as they are otherwise (the same plans)
    big = max((s.weight for s in workload), default=1.0)
    scale = big if big * len(workload) > 1e300 else 1.0
    for item in (workload or pending):
        selector = item.node_selector
        own = (item.resource, item.count, item.cpu_milli, item.memory_mib, tuple(item.gpu_models),
               tuple(sorted(selector.items())) if selector else (), tuple(item.tolerations), tuple(item.node_affinity))
        j = slot_of.get(own)
        if j is None:
            families: tuple[str, ...] = ()
            if item.gpu_models:
                if catalog is None:
                    raise ValueError("a request share names GPU models: compiling it needs the catalog")
                families = tuple(sorted({catalog.resolve(m).family_name for m in item.gpu_models}))
            constraints = NodeConstraints(tuple(item.tolerations), tuple(item.node_affinity))
            key = (slice_ref_of(item.resource), item.count, item.cpu_milli, item.memory_mib, families,
                   tuple(sorted(item.node_selector.items())), constraints)
            j = slot_of[own] = slot.setdefault(key, len(keys))
            if j == len(keys):
                keys.append(key)
                totals.append(0.0)
        totals[j] += item.weight / scale if isinstance(item, RequestShare) else 1.0
    kinds = [DemandKind(r, c, cpu, mem, w, frozenset(f), sel, con)
             for (r, c, cpu, mem, f, sel, con), w in zip(keys, totals)]
    return sorted(kinds, key=_kind_order)


def _kind_order(k: DemandKind) -> tuple[object, ...]:
    return (ref_order(k.ref), k.count, k.cpu, k.mem, sorted(k.models), k.selector, repr(k.constraints))


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


def _access_rejects(node: NodeInfo, selector: Mapping[str, str], accepted: Set[str], constraints: NodeConstraints,
                    mode: str) -> tuple[int, str] | None:
    """Why a pod with these node constraints may never run on the node, whatever its resources
    (as `_node_rejects`), or None."""
    for k, v in selector.items():
        if node.labels.get(k) != v:
            return 1, f"no {mode} node matches nodeSelector {k}={v}"
    if not affinity_admits(constraints.affinity, node.labels, node.name):
        return 1, f"no {mode} node matches the pod's required node affinity"
    taint = untolerated_taint(node.taints, node.unschedulable, constraints.tolerations)
    if taint is not None:
        return 2, (f"the {mode} nodes that match are cordoned or tainted, and the pod does not "
                   f"tolerate it (e.g. node {node.name}: {taint})")
    if accepted and node.model.family_name not in accepted:
        return 3, f"no {mode} node has an accepted GPU model ({', '.join(sorted(accepted))})"
    return None


def _node_rejects(node: NodeInfo, gpus: list[GpuInfo], req: Request, selector: dict[str, str],
                  accepted: Set[str], constraints: NodeConstraints) -> tuple[int, str] | None:
    """Why this node can never host the pod (whatever the layout), or None if it may.
    The number is how far the node got through the filters (for the summary)."""
    wanted_mode = "mig" if req.kind == KIND_MIG else "mps"
    if node.mode != wanted_mode:
        return 0, f"no node in {wanted_mode} mode"
    why = _access_rejects(node, selector, accepted, constraints, wanted_mode)
    if why is not None:
        return why
    if req.kind == KIND_MIG and req.profile not in node.model.profiles_by_name:
        return 4, f"MIG profile {req.profile} is not offered by the GPU models of the mig nodes"
    if req.kind == KIND_MPS:
        caps = [gpus[g].capacity for g in node.gpus]
        if not caps or max(caps) < req.size:
            return 4, f"a {req.size} GB slice is bigger than every MPS GPU (largest {max(caps, default=0)} GB)"
    # the most of the pod's slices one node could ever hold, every GPU of it carved for them
    if req.kind == KIND_MIG:
        most = len(node.gpus) * node.model.profiles_by_name[str(req.profile)].max
    elif req.kind == KIND_MPS:
        most = sum(gpus[g].capacity // req.size for g in node.gpus)
    else:
        most = len(node.gpus)
    if req.count > most:
        return 5, (f"{req.count} x {req.resource} asked, more than one node can ever hold "
                   f"(e.g. node {node.name}: at most {most}, every GPU carved for them)")
    return None
