"""From Kubernetes objects (plain dicts, as the API serves them) to the planner's snapshot.

Pure functions: the controller feeds them what its watches cached; tests feed them literals.
Every problem with one object (a malformed annotation, a pod asking for two slice kinds, a node
without a GPU product label) is returned as a message for a log line and an Event, and that
object is left out; one bad object never stops the planning of the others.
"""

from __future__ import annotations

import copy
import math
import posixpath
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from dynpart.annotations import DecodedStatus, annotation_patch, decode_status, encode_spec, is_pod_key, keeping_spec
from dynpart.capability import MAX_GPUS, CapabilityError, decode_capability, model_catalog, node_model
from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.kube.conventions import (
    DEFAULT_SCHEDULER,
    DEV_SHM,
    GPU_COUNT_LABEL,
    GPU_PRODUCT_LABEL,
    PARTITIONING_LABEL,
    SPEC_MODE,
    SPEC_PLAN,
    SPEC_REVOKES,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_MODE,
    STATUS_PLAN,
    STATUS_PREFIX,
    STATUS_UNHEALTHY,
)
from dynpart.planner.loop import avoiding, node_writes
from dynpart.planner.pod_conflicts import PlacedPods, as_list, pod_facts
from dynpart.planner.volume_topology import VolumeTopology, volumes_for_planning
from dynpart.quantity import parse_quantity
from dynpart.resources import (
    MigResource,
    MpsResource,
    WholeGpuResource,
    is_slice_resource,
    known_resource,
    mig_resource_name,
    mps_resource_name,
    parse_resource,
    pod_requests,
)
from dynpart.scheduling import Taint, affinity_admits
from dynpart.snapshot import (
    Gpu,
    MigInstance,
    MpsSlice,
    Node,
    NodeLayout,
    PendingPod,
    Plan,
    Snapshot,
    full_layout,
    prune_apart,
    split_invalid,
)

TERMINAL_PHASES = {"Succeeded", "Failed"}
PODS = "pods"  # allocatable's pod count: every pod takes one
RESIZE_PENDING = "PodResizePending"  # a pod condition: the kubelet has not applied a resize yet
# An agent's status for 8 GPUs of any layout is a few KiB; beyond this the node is left out with
# an Event instead of being decoded on the planner's event loop (a hostile or broken writer).
MAX_STATUS_BYTES = 64 * 1024
# The most older pending pods of a round a pod is planned with, kept apart from them on one node
# each (`PendingPod.apart`); past it, it waits for the next round as a pod conflicting over wider
# domains does. The pairs a round plans grow with its square: 256 replicas of one Deployment are
# 32,640 pairs, planned in a round; 2,000 are planned in 8.
MAX_APART = 256


def pod_key(pod: dict[str, Any]) -> str:
    return f"{_field(pod, 'metadata', 'namespace') or 'default'}/{_field(pod, 'metadata', 'name') or ''}"


def _spec_requests(c: Mapping[str, Any]) -> dict[str, float]:
    """One container's requests as its spec says (a resource its limits name and its requests
    omit counts at its limit, as the API server defaults it)."""
    res = c.get("resources") or {}
    return _spec_requests_of({**(res.get("limits") or {}), **(res.get("requests") or {})})


def _spec_requests_of(written: Mapping[str, Any]) -> dict[str, float]:
    return {name: parse_quantity(q) for name, q in written.items()}


def _quantities(raw: object, where: str) -> dict[str, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DynpartError(f"{where} {raw!r} is not a mapping of quantities")
    return {str(name): parse_quantity(q) for name, q in raw.items()}


def _resize_infeasible(pod: Mapping[str, Any]) -> bool:
    """The pod's first PodResizePending condition says Infeasible (IsPodResizeInfeasible)."""
    for c in as_list(_field(pod, "status", "conditions")):
        if isinstance(c, dict) and c.get("type") == RESIZE_PENDING:
            return c.get("reason") == "Infeasible"
    return False


def _statuses(pod: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's container statuses by name, the init containers' read last (AggregateContainerRequests)."""
    out: dict[str, dict[str, Any]] = {}
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in as_list(_field(pod, "status", key)):
            if isinstance(cs, dict):
                out[str(cs.get("name"))] = cs
    return out


def _effective_requests(spec: Mapping[str, float], cs: Mapping[str, Any] | None, infeasible: bool) -> Mapping[str, float]:
    """A running container's (or sidecar's) requests as the scheduler counts them on its node
    during an in-place resize (determineEffectiveRequests): once its status reports resources,
    the larger of the spec's, the ones applied (`resources.requests`) and the ones the kubelet
    admitted (`allocatedResources`), resource by resource; of the last two only, when the
    resize is Infeasible (the spec's then never applies)."""
    if cs is None or cs.get("resources") is None:
        return spec
    name = cs.get("name")
    actuated = _quantities(_field(cs, "resources", "requests"), f"container {name} status resources.requests")
    allocated = _quantities(cs.get("allocatedResources"), f"container {name} status allocatedResources")
    out: dict[str, float] = {}
    for part in ([] if infeasible else [spec]) + [actuated, allocated]:
        for res, q in part.items():
            out[res] = max(out.get(res, q), q)
    return out


def _running_requests(pod: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Mapping[str, float]]:
    """The requests of each of the pod's containers and sidecars as the scheduler counts them on
    its node (`_effective_requests`)."""
    statuses, infeasible = _statuses(pod), _resize_infeasible(pod)
    return lambda c: _effective_requests(_spec_requests(c), statuses.get(str(c.get("name"))), infeasible)


def _container_requests(pod: dict[str, Any], bound: bool = False) -> dict[str, float]:
    """Effective requests, as the scheduler counts them (`pod_requests`), plus the pod's
    overhead. Extended resources count from limits when requests omit them. `bound`: as it
    counts a pod assigned to a node (NodeInfo, UseStatusResources: in-place resize is GA in
    Kubernetes 1.35), its containers' and sidecars' statuses read (`_effective_requests`);
    else as it counts the pod it places (from the spec only)."""
    spec = pod.get("spec", {})
    total = pod_requests(spec, _spec_requests, _running_requests(pod) if bound else None)
    # pod-level resources (PodLevelResources, on by default from Kubernetes 1.34): the pod's CPU,
    # memory and huge pages replace the containers' sum, as in the scheduler's PodRequests; no
    # extended resource may be set there (their status is not read: resizing them in place is
    # alpha in 1.35, InPlacePodLevelResourcesVerticalScaling, off by default)
    pod_level = _field(spec, "resources", "requests") or {}
    if not isinstance(pod_level, dict):
        raise DynpartError(f"spec.resources.requests {pod_level!r} is not a mapping of quantities")
    for name, q in pod_level.items():
        if name in ("cpu", "memory") or name.startswith("hugepages-"):
            total[name] = parse_quantity(q)
    for name, q in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + parse_quantity(q)
    return total


def slice_requests(pod: dict[str, Any]) -> dict[str, int]:
    """Slice resources the pod asks for, by count (a fraction counts up: the API server admits
    only whole counts of extended resources; `pending_pod` refuses one that is not)."""
    return _slices(_container_requests(pod))


def _slices(requests: Mapping[str, float]) -> dict[str, int]:
    """`slice_requests` of a pod's requests (`_container_requests`)."""
    return {k: math.ceil(v) for k, v in requests.items() if is_slice_resource(k) and v > 0}


def _past_pending(pod: object) -> bool:
    """The API says the pod is past Pending: `is_batch_candidate` is False, and reading it would
    find nothing wrong with it either."""
    status = pod.get("status") if isinstance(pod, dict) else None
    return isinstance(status, dict) and isinstance(status.get("phase"), str) and status["phase"] != "Pending"


def is_batch_candidate(pod: dict[str, Any]) -> bool:
    """Pending, marked Unschedulable by the scheduler, not bound or nominated, asking for a
    MIG/MPS slice resource: the pods dynpart plans for (as nos does)."""
    spec, status = pod.get("spec", {}), pod.get("status", {})
    if status.get("phase") != "Pending" or spec.get("nodeName") or status.get("nominatedNodeName"):
        return False
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    unschedulable = any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                        and c.get("reason") == "Unschedulable" for c in status.get("conditions") or [])
    return unschedulable and bool(slice_requests(pod))


def _required_terms(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's required node-affinity terms (`nodeSelectorTerms`), as the API gives them."""
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {})
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms: list[dict[str, Any]] = required.get("nodeSelectorTerms") or []
    return terms


def pending_pod(pod: dict[str, Any]) -> PendingPod:
    """The planner's view of one pod; DynpartError when dynpart cannot plan it."""
    name = pod_key(pod)
    if not is_pod_key(name):
        md = pod.get("metadata") or {}
        raise DynpartError(f"pod {name}: metadata.namespace = {md.get('namespace')!r}, metadata.name = "
                           f"{md.get('name')!r}: not a Kubernetes namespace and name")
    wanted = slice_requests(pod)
    if len(wanted) != 1:
        raise DynpartError(f"pod {name} asks for {len(wanted)} GPU slice resources ({', '.join(sorted(wanted))}); "
                           "dynpart plans pods that ask for exactly one")
    resource, count = next(iter(wanted.items()))
    parse_resource(resource)
    req = _container_requests(pod)
    if req[resource] != count:
        raise DynpartError(f"pod {name}: {resource} = {req[resource]:g}: a slice count must be a whole number")
    spec = pod.get("spec", {})
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, dict):
        raise DynpartError(f"pod {name}: spec.nodeSelector = {selector!r}: not a mapping")
    selector = dict(selector)
    # the scheduler matches the label exactly (a catalog family spans several products); the
    # model it names also tells the workload objective which GPUs the pod can use
    models = [selector[GPU_PRODUCT_LABEL]] if GPU_PRODUCT_LABEL in selector else []
    try:
        return PendingPod(
            name=name, resource=resource, count=count,
            cpu_milli=int(round(req.get("cpu", 0) * 1000)), memory_mib=int(req.get("memory", 0) // 2**20),
            priority=spec.get("priority") or 0, node_selector=selector, gpu_models=models,
            tolerations=[{k: t[k] for k in ("key", "operator", "value", "effect") if t.get(k) is not None}
                         for t in spec.get("tolerations") or []],
            node_affinity=[{"match_expressions": term.get("matchExpressions") or [],
                            "match_fields": term.get("matchFields") or []} for term in _required_terms(spec)],
        )
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise DynpartError(f"pod {name}: {field} = {err.get('input')!r}: {err['msg']}") from None


@dataclass
class NodeView:
    node: Node | None
    status_plan: str | None
    problems: list[str] = field(default_factory=list)
    model: GpuModel | None = None  # the model the node is planned with
    disagreements: tuple[str, ...] = ()  # between its agent's capability report and the catalog
    skew: list[str] = field(default_factory=list)  # annotations of another dynpart version, ignored
    kept: dict[str, str] = field(default_factory=dict)  # spec keys keeping GPUs not planned as they are
    # what is left of the resources beside CPU, memory and GPU slices (`_is_other`), as allocatable lists them
    room: dict[str, float] = field(default_factory=dict)
    # (resource, why): free slices its agent reports beyond what allocatable lists of their
    # resource, counted as used (`_unallocatable_as_used`); for a while after the agent made them
    # this is the kubelet's status lagging, not a problem (the caller decides when to tell)
    unallocatable: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ClusterView:
    """What one planning round sees: the snapshot; the plan id each node's agent acknowledged;
    the objects left out, each with its problem; the catalog plan() must resolve the nodes'
    models in (the given one, plus models built from agents' capability reports); and per node,
    how its agent's report differs from the catalog."""

    snapshot: Snapshot
    acks: dict[str, str | None]
    problems: list[tuple[dict[str, Any], str]]
    catalog: Catalog
    disagreements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # nodes left out while their agent runs them in another mode than their label's, whose
    # acknowledged spec keeps the agent there: node -> the labelled mode, for a switching spec
    switching: dict[str, str] = field(default_factory=dict)
    # objects planned all the same, with advice for their owner (an MPS pod that will not reach its server)
    warnings: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # nodes carrying annotations of another dynpart version (ignored): what an operator should know
    skew: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # node -> spec keys that keep GPUs this planner cannot read as they are (every spec carries them)
    kept: dict[str, dict[str, str]] = field(default_factory=dict)
    # pending pods asking for GPU resources that no dynpart node can ever take (its mode, the
    # pod's nodeSelector or required node affinity): meant for other nodes (a static MIG pool, a
    # plain GPU pool), left out of planning and of the learnt request distribution without an
    # Event; (pod, why) for the log
    elsewhere: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # pending pod -> the dynpart nodes that could take it (mode, nodeSelector, required node
    # affinity; not those its conflicts or missing resources exclude), those left out of this
    # round too
    hosts: dict[str, frozenset[str]] = field(default_factory=dict)
    # pending pods left to the next round -> the older pod this round plans that they conflict
    # with (pod_conflicts: anti-affinity, host ports), which the next round counts as placed
    deferred: dict[str, str] = field(default_factory=dict)
    # pending pods every node that could take them excludes (pod_conflicts), with why
    blocked: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # pending pod -> the pod as it asks, without the nodes this round keeps it off (conflicts,
    # other resources short: `avoiding`, a passing fact): what the learnt workload counts
    asked: dict[str, PendingPod] = field(default_factory=dict)
    # claim (namespace/name) -> the pods not planned for it (missing, being deleted, Lost, another
    # pod's): a change of that claim plans them again at once (the claims' watch wakes the loop)
    awaiting_claims: dict[str, list[str]] = field(default_factory=dict)
    # (node, resource, why) per resource of a node with free slices its agent reports beyond
    # what allocatable lists (NodeView.unallocatable): counted as used; a problem only once it
    # lasts (the kubelet writes a new device count into allocatable at its next status write)
    unallocatable: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)


@dataclass
class NodeGpus:
    """What a node's GPUs are: the model it is planned with, how the driver and the catalog differ,
    what could not be read, and (from the capability report) the GPUs not in MIG mode: the only
    ones that can serve a whole-GPU pod on a MIG node (None: not reported)."""

    model: GpuModel | None
    disagreements: tuple[str, ...] = ()
    problems: list[str] = field(default_factory=list)
    not_mig: frozenset[int] | None = None
    reset_pending: frozenset[int] = frozenset()  # GPUs whose MIG mode waits for a GPU reset
    in_mig: frozenset[int] = frozenset()  # GPUs in MIG mode or about to be: no MPS there
    count: int | None = None  # the GPUs the driver reports (None: no report)


def node_gpu_model(name: str, labels: Mapping[str, Any], annotations: Mapping[str, Any],
                   catalog: Catalog) -> NodeGpus:
    """A node's GPUs: from its agent's capability report when there is one (the driver's profiles,
    placements and memory, narrowed by the catalog), else from the catalog by the
    `nvidia.com/gpu.product` label (until the agent reports)."""
    problems: list[str] = []
    report = annotations.get(STATUS_CAPABILITY)
    if report is not None:
        try:
            if not isinstance(report, str):
                raise CapabilityError("the value is not a string")
            cap = decode_capability(report)
            choice = node_model(cap, catalog)
            not_mig = frozenset(i for i, g in enumerate(cap.gpus) if g.mig in ("off", "on-pending", "unsupported"))
            pending = frozenset(i for i, g in enumerate(cap.gpus) if g.mig in ("on-pending", "off-pending"))
            in_mig = frozenset(i for i, g in enumerate(cap.gpus) if g.mig in ("on", "on-pending", "off-pending"))
            return NodeGpus(choice.model, choice.disagreements, problems, not_mig, pending, in_mig, len(cap.gpus))
        except CapabilityError as e:
            problems.append(f"node {name}: annotation {STATUS_CAPABILITY}: {e}; the node is planned from the catalog")
    product = labels.get(GPU_PRODUCT_LABEL)
    if not product:
        return NodeGpus(None, (), [*problems, f"node {name}: no {GPU_PRODUCT_LABEL} label (GPU feature discovery "
                                              "sets it) and no capability report from its agent"])
    try:
        return NodeGpus(catalog.resolve(product, where=f"node {name} label {GPU_PRODUCT_LABEL}"), (), problems)
    except DynpartError as e:
        return NodeGpus(None, (), [*problems, str(e)])


@dataclass(frozen=True, slots=True)
class _ReportedGpu:
    """What an agent reports on one GPU, as `node_view` reads it."""

    mig: tuple[tuple[str, int, bool], ...]  # (profile, start, used) of each instance
    mps: tuple[tuple[int, bool], ...]  # (size, used) of each slice
    whole_pod: str | None


@dataclass(frozen=True, slots=True)
class _Status:
    """What `node_view` reads of `decode_status`, in plain tuples: `NodeDecodes` keeps one for
    every node, and the decoded layout's models took about 20 KB a node. Never changed (shared)."""

    plan_id: str | None
    problems: tuple[str, ...]
    unknown: tuple[str, ...]
    layout_incomplete: bool
    foreign: dict[int, tuple[str, ...]]
    kept_spec: dict[str, str]
    unhealthy: tuple[int, ...]
    reported: dict[int, _ReportedGpu]  # GPU index -> what the agent reports there
    layout: NodeLayout | None  # the layout decoded, only where GPUs are unhealthy (`keeping_spec`)


def _status(status: DecodedStatus) -> _Status:
    gpus = status.layout.gpus if status.layout is not None else []
    return _Status(status.plan_id, tuple(status.problems), tuple(status.unknown), status.layout_incomplete,
                   status.foreign, status.kept_spec, status.unhealthy,
                   {g.index: _ReportedGpu(tuple((m.profile, m.start, m.used) for m in g.mig),
                                          tuple((x.size, x.used) for x in g.mps), g.whole_pod) for g in gpus},
                   status.layout if status.unhealthy else None)


@dataclass(frozen=True, slots=True)
class _Decoded:
    """What a node's labels and annotations alone say (`_decode`). Never changed (shared)."""

    too_big: str | None  # why its agent's annotations are not read, or None
    gpus: NodeGpus | None = None  # its GPUs (None when too big)
    status: _Status | None = None  # its agent's status (None when too big or without a model)


def _decode(name: str, labels: Mapping[str, Any], annotations: Mapping[str, Any], catalog: Catalog) -> _Decoded:
    """The part of `node_view` read from the node's labels and annotations alone: its GPUs
    (`node_gpu_model`) and its agent's status (`decode_status`)."""
    size = sum(len(k) + len(str(v)) for k, v in annotations.items() if str(k).startswith(STATUS_PREFIX))
    if size > MAX_STATUS_BYTES:
        return _Decoded(f"node {name}: its {STATUS_PREFIX}* annotations take {size} bytes, more than the "
                        f"{MAX_STATUS_BYTES} an agent writes; the node is left out until they shrink")
    described = node_gpu_model(name, labels, annotations, catalog)
    if described.model is None:
        return _Decoded(None, described)
    return _Decoded(None, described, _status(decode_status(annotations, described.model, node=name)))


_Made = TypeVar("_Made")


class _PerNode(Generic[_Made]):
    """Entries kept per node name from one round to the next (`NodeDecodes`, `NodeViews`)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Any, _Made]] = {}  # node name -> (what it was made from, what was made)

    def retain(self, names: AbstractSet[str]) -> None:
        """Forget the nodes not in `names` (gone, or no longer labelled)."""
        for name in self._entries.keys() - names:
            self._entries.pop(name, None)

    def __len__(self) -> int:
        return len(self._entries)


class NodeDecodes(_PerNode[_Decoded]):
    """`_decode` of each node, kept from one round to the next by the caller (the controller): at
    2,000 nodes decoding their agents' annotations took most of a round's `node_view`, and most
    nodes do not change between two rounds. An entry serves the node of its name while its
    labels and annotations are, item by item and in order, those it was decoded from, all of them
    strings, and the catalog is the same object. Content, not resourceVersion: tests change
    cached nodes in place, and a node deleted and made again may carry anything. A node whose
    labels or annotations hold anything else than strings (the API's never do) is decoded each
    time. Entries of nodes not given to a round are dropped (`retain`); an entry takes about 6 KB
    (`_Status`). One round at a time: not thread-safe, and what it returns is shared between
    rounds, so never changed."""

    def __init__(self) -> None:
        super().__init__()
        self._catalog: Catalog | None = None
        self.decoded = 0  # `_decode` calls made (not served from an entry), for tests and measurements

    def decode(self, name: Any, labels: Mapping[str, Any], annotations: Mapping[str, Any],
               catalog: Catalog) -> _Decoded:
        """`_decode(name, labels, annotations, catalog)`, from the node's entry when it holds."""
        if catalog is not self._catalog:
            self._entries.clear()
            self._catalog = catalog
        if not (type(name) is str and _strings(labels) and _strings(annotations)):
            self.decoded += 1
            return _decode(name, labels, annotations, catalog)
        # (keys and values apart: a tuple of pointers each, a third of the size of the items' pairs)
        key = (tuple(labels), tuple(labels.values()), tuple(annotations), tuple(annotations.values()))
        entry = self._entries.get(name)
        if entry is not None and entry[0] == key:
            return entry[1]
        self.decoded += 1
        decoded = _decode(name, labels, annotations, catalog)
        self._entries[name] = (key, decoded)
        return decoded


@dataclass(frozen=True, slots=True)
class _BoundUsage:
    """What a pod bound to a node takes of it, as `node_view` counts it. Never changed (shared)."""

    cpu: float
    mem: float
    other: dict[str, float]  # `_other_requests`
    slices: dict[str, int]  # `_slices`
    init_kept: frozenset[str]  # `_init_kept`


def _bound_usage(pod: dict[str, Any]) -> _BoundUsage:
    req = _container_requests(pod, bound=True)
    return _BoundUsage(req.get("cpu", 0), req.get("memory", 0), _other_requests(req), _slices(req),
                       frozenset(_init_kept(pod)))


class BoundUsage:
    """`_bound_usage` of each bound pod, kept from one round to the next by the caller (the
    controller): at 1,000 nodes of 28 bound pods each, parsing their requests again took a third
    of a round's `build_snapshot`. An entry serves the pod of its metadata.uid while its
    metadata.resourceVersion is the one read: the API server gives every change of a pod a new
    resourceVersion (a write of etcd, of that one object), and a pod made again under its name a
    new uid. A pod without both is read each time. The pods themselves are not held (a quiet
    leader or a standby would keep every pod of its last round alive). Entries of pods not given
    to a round are dropped (`retain`). One round at a time: not thread-safe, and what it returns
    is shared between rounds, so never changed."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, _BoundUsage]] = {}  # uid -> (resourceVersion, usage)
        self.read = 0  # `_bound_usage` calls made (not served from an entry), for tests and measurements

    def usage(self, pod: dict[str, Any]) -> _BoundUsage:
        uid, version = _version(pod)
        if uid is None:
            self.read += 1
            return _bound_usage(pod)
        entry = self._entries.get(uid)
        if entry is not None and entry[0] == version:
            return entry[1]
        self.read += 1
        usage = _bound_usage(pod)
        self._entries[uid] = (version, usage)
        return usage

    def retain(self, pods: Iterable[dict[str, Any]]) -> None:
        """Forget the pods not in `pods` (gone)."""
        keep = {uid for p in pods if (uid := _version(p)[0]) is not None}
        for key in self._entries.keys() - keep:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


def _version(pod: object) -> tuple[str | None, str]:
    """(metadata.uid, metadata.resourceVersion) of a pod that has both (non-empty strings), else (None, "")."""
    md = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(md, dict):
        return None, ""
    uid, version = md.get("uid"), md.get("resourceVersion")
    if type(uid) is not str or not uid or type(version) is not str or not version:
        return None, ""
    return uid, version


class NodeViews(_PerNode[NodeView]):
    """`node_view` of each node, kept from one round to the next by the caller (the controller),
    with `NodeDecodes` and `BoundUsage`: at 1,000 nodes most nodes and their pods do not change
    between two rounds, and building their views again (a model per GPU and per instance) took
    about half of a round once the bound pods' requests were kept. An entry serves the node of its name while everything `node_view`
    reads is what it was built from: the decode of its labels and annotations (the same
    `NodeDecodes` entry), its allocatable, taints and cordon (`_rest_read`, compared by content:
    tests change nodes in place), and the pods counted there, each by uid and resourceVersion
    (`BoundUsage`'s rule). A node with a pod lacking them, or with parts not typed as the API
    server gives them, is built each time. An entry takes up to 36 KB (8 GPUs of 7 instances).
    What it returns is shared between rounds, so never changed. One round at a time: not
    thread-safe."""

    def __init__(self) -> None:
        super().__init__()
        self.built = 0  # `node_view` calls made (not served from an entry), for tests and measurements

    def view(self, node: dict[str, Any], bound_pods: list[dict[str, Any]], catalog: Catalog,
             decodes: NodeDecodes, usage: BoundUsage | None) -> NodeView:
        md = node.get("metadata", {})
        name, labels, annotations = md.get("name", ""), md.get("labels") or {}, md.get("annotations") or {}
        pods = tuple(_version(p) for p in bound_pods)
        rest = _rest_read(node)
        if (type(name) is not str or rest is None or any(uid is None for uid, _ in pods)
                or not (_strings(labels) and _strings(annotations))):
            self.built += 1
            return node_view(node, bound_pods, catalog, decodes, usage)
        # (the decode is the one node_view makes: its entry, looked up once more)
        decoded = decodes.decode(name, labels, annotations, catalog)
        entry = self._entries.get(name)
        if entry is not None and entry[0][0] is decoded and entry[0][1:] == (pods, rest):
            return entry[1]
        self.built += 1
        view = node_view(node, bound_pods, catalog, decodes, usage)
        self._entries[name] = ((decoded, pods, copy.deepcopy(rest)), view)
        return view


def _rest_read(node: dict[str, Any]) -> tuple[Any, ...] | None:
    """What `node_view` reads of a node beside its name, labels and annotations: allocatable, the
    taints and the cordon; None where a part is not as the API server gives it (strings), so that
    equal parts read the same (1 == 1.0 == True)."""
    status, spec = node.get("status"), node.get("spec")
    if not (status is None or type(status) is dict) or not (spec is None or type(spec) is dict):
        return None
    alloc = (status or {}).get("allocatable")
    taints = (spec or {}).get("taints")
    unschedulable = (spec or {}).get("unschedulable")
    if not (alloc is None or _strings(alloc)) or not (unschedulable is None or type(unschedulable) is bool):
        return None
    if not (taints is None or (type(taints) is list and all(_strings(t) for t in taints))):
        return None
    return alloc, taints, unschedulable


def _strings(mapping: object) -> bool:
    """A dict of strings to strings: a key of them compares equal only to the same strings, which
    read the same (an equal int or float may not: 1 == 1.0 == True)."""
    return type(mapping) is dict and all(type(k) is str and type(v) is str for k, v in mapping.items())


def node_view(node: dict[str, Any], bound_pods: list[dict[str, Any]], catalog: Catalog,
              decodes: NodeDecodes | None = None, usage: BoundUsage | None = None) -> NodeView:
    """A labelled GPU node as the planner sees it: current layout from the agent's status
    annotations, CPU/memory left from allocatable minus the requests of the pods bound there.
    Slices that pods bound to the node will take, but that the agent has not yet reported as
    used, are counted as used: the planner never plans away a slice a pod is about to get.
    `decodes`: the node's decoded annotations kept from earlier rounds, `usage` its bound pods'
    requests (the same view, sooner)."""
    md = node.get("metadata", {})
    name = md.get("name", "")
    labels = md.get("labels") or {}
    mode = labels.get(PARTITIONING_LABEL)
    if mode not in ("mig", "mps"):
        return NodeView(None, None, [f"node {name}: label {PARTITIONING_LABEL}={mode!r}: expected mig or mps"])
    annotations = md.get("annotations") or {}
    decoded = (decodes.decode if decodes is not None else _decode)(name, labels, annotations, catalog)
    if decoded.gpus is None:
        return NodeView(None, None, [str(decoded.too_big)])
    described = decoded.gpus
    # (a copy: `described` may be shared with other rounds)
    model, disagreements, problems = described.model, described.disagreements, list(described.problems)
    if model is None or decoded.status is None:
        return NodeView(None, None, problems)
    status = decoded.status
    problems.extend(f"node {name}: {p}" for p in status.problems)
    skew = [f"node {name}: {u}" for u in status.unknown]
    if status.layout_incomplete:
        # a slice the planner cannot read may be in use: planning around it could plan over it
        return NodeView(None, status.plan_id, [*problems, f"node {name}: left out of planning until every "
                                               f"{STATUS_PREFIX}* annotation of its agent reads: a slice the planner "
                                               "cannot read may be in use"], skew=skew)
    reported = status.reported
    count = described.count if described.count is not None else _labelled_count(name, labels, problems)
    count = max([count, *(i + 1 for i in reported), *(i + 1 for i in status.foreign)])
    if status.foreign:
        # its agent plans with another model (a capability report this planner cannot read, or
        # another catalog): the shapes of those instances are unknown, so their GPUs are not
        # planned, and every spec keeps them as they are; the other GPUs are planned as usual
        names = sorted({p for profiles in status.foreign.values() for p in profiles})
        problems.append(f"node {name}: GPU(s) {', '.join(map(str, sorted(status.foreign)))} hold MIG instances "
                        f"this planner's {model.name} model cannot read ({', '.join(names)}; "
                        f"{_why_foreign(annotations)}): left out of planning and kept as they are")
    bound_slices: Counter[str] = Counter()
    placed_slices: Counter[str] = Counter()  # of pods bound to the node (not reserved or nominated)
    init_kept: set[str] = set()  # resources of which a pod bound here holds devices no one can name
    cpu_used = mem_used = 0.0
    other_used: Counter[str] = Counter({PODS: 0})  # resources beside CPU, memory and GPUs, and the pod count
    read = usage.usage if usage is not None else _bound_usage
    for pod in bound_pods:
        if pod.get("status", {}).get("phase") in TERMINAL_PHASES:
            continue
        used = read(pod)
        cpu_used += used.cpu
        mem_used += used.mem
        other_used.update(used.other)
        placed_here = (pod.get("spec") or {}).get("nodeName") == name
        for res, n in used.slices.items():
            bound_slices[res] += n
            if placed_here:
                placed_slices[res] += n
        if placed_here:
            init_kept |= used.init_kept
    gpus = []
    for i in range(count):
        if i in status.foreign:
            continue
        g = reported.get(i)
        if mode == "mig":
            gpus.append(Gpu(index=i, mig=[MigInstance(profile=profile, start=start, used=used)
                                          for profile, start, used in (g.mig if g else ())]))
        else:
            gpus.append(Gpu(index=i, mps=[MpsSlice(size=size, used=used) for size, used in (g.mps if g else ())],
                            whole_pod=g.whole_pod if g else None))
    kept = _protect_bound_slices(gpus, bound_slices, mode, described.not_mig, placed_slices, init_kept)
    held_whole = sorted({g.index for g in gpus} - {g.index for g in kept})
    if held_whole:
        problems.append(f"node {name}: GPU(s) {', '.join(map(str, held_whole))} serve a pod whole (nvidia.com/gpu, MIG "
                        "mode off); left out of MIG planning while the pod runs")
    gpus = _without_mode_conflicts(name, kept, mode, bound_slices, described, problems)
    kept_spec = dict(status.kept_spec)
    sick = sorted(set(status.unhealthy) & {g.index for g in gpus})
    if sick:
        # the driver reports them unhealthy (a lost GPU, an Xid that needs a reset): their devices
        # are Unhealthy at the kubelet, so a slice planned there would never serve its pod, and
        # their agent cannot change them; every spec keeps them as they are until they recover.
        # Left out after the bound pods were matched with the used slices, so that the pods on
        # them still account for their slices
        gpus = [g for g in gpus if g.index not in sick]
        kept_spec.update(keeping_spec(status.layout, sick))
        problems.append(f"node {name}: GPU(s) {', '.join(map(str, sick))} reported unhealthy by its agent "
                        f"({STATUS_UNHEALTHY}; why: its {STATUS_ERROR}): left out of planning and kept as they are")
    if mode == "mig" and described.reset_pending:
        # its agent could not hold a plan there (docs/protocol.md): not planned until a reset
        gpus = [g for g in gpus if g.index not in described.reset_pending]
        problems.append(f"node {name}: MIG mode of GPU(s) {', '.join(map(str, sorted(described.reset_pending)))} "
                        "changes only at the next GPU reset; left out of planning until then")
    alloc = (node.get("status") or {}).get("allocatable") or {}
    try:
        cpu_free = max(0, int(round((parse_quantity(alloc.get("cpu", 0)) - cpu_used) * 1000)))
        mem_free = max(0, int((parse_quantity(alloc.get("memory", 0)) - mem_used) // 2**20))
        room = {res: parse_quantity(q) - other_used[res] for res, q in alloc.items()
                if res in other_used or _is_other(res)}
        unallocatable = _unallocatable_as_used(name, gpus, alloc)
    except DynpartError as e:
        return NodeView(None, status.plan_id, [f"node {name}: allocatable: {e}"])
    node_spec = node.get("spec") or {}
    try:
        taints = [Taint(**{k: t[k] for k in ("key", "value", "effect") if t.get(k) is not None})
                  for t in node_spec.get("taints") or []]
    except ValidationError as e:
        return NodeView(None, status.plan_id, [f"node {name}: spec.taints: {e.errors()[0]['msg']}"])
    view = Node(name=name, mode=mode, gpu_model=model.name, cpu_milli_free=cpu_free, memory_mib_free=mem_free,
                labels=dict(labels), gpus=gpus, unschedulable=bool(node_spec.get("unschedulable")), taints=taints)
    return NodeView(view, status.plan_id, problems, model, disagreements, skew, kept_spec, room, unallocatable)


def _blocked_reason(conflicting: AbstractSet[str], short: Mapping[str, list[str]]) -> str:
    """Why no node that could take a pod does (`build_snapshot`)."""
    why = []
    if conflicting:
        why.append(f"node(s) {_some(conflicting)} hold a pod that its required pod anti-affinity or host ports "
                   "exclude, or whose anti-affinity excludes it, or would break its topology spread constraints, "
                   "or are outside the topology domains of the pods its required pod affinity selects")
    if short:
        lacking = sorted({r for lack in short.values() for r in lack})
        why.append(f"node(s) {_some(short)} lack {', '.join(lacking)} for it")
    return "no node that could take it has room: " + "; ".join(why) + " (it waits until pods end or move)"


def _is_other(resource: str) -> bool:
    """A resource the scheduler's NodeResourcesFit checks that the planner's model does not carry:
    not CPU, memory or a GPU slice (ephemeral storage, huge pages, other devices, the pod count)."""
    return resource not in ("cpu", "memory") and not is_slice_resource(resource)


def _other_requests(requests: Mapping[str, float]) -> dict[str, float]:
    """The pod's requests of the other resources (`_is_other`), its one pod included."""
    return {**{r: v for r, v in requests.items() if v > 0 and _is_other(r)}, PODS: 1.0}


def _short_of(requests: Mapping[str, float], room: Mapping[str, float], listed: AbstractSet[str]) -> list[str]:
    """The resources a node's room lacks for the requests: those it has too little of, and those
    it does not list while another planned node does (one that no node lists is another
    component's to check: a scheduler extender's, an ignored resource)."""
    return sorted(r for r, v in requests.items()
                  if (r in room and room[r] < v) or (r not in room and r in listed))


def _why_foreign(annotations: Mapping[str, Any]) -> str:
    """Why a node's agent may name profiles the planner's model lacks."""
    report = annotations.get(STATUS_CAPABILITY)
    if report is None:
        return "its agent has not reported what its GPUs can do"
    try:
        decode_capability(report if isinstance(report, str) else "")
    except CapabilityError:
        return ("its agent's capability report cannot be read here, e.g. a newer agent's version: the node is "
                "planned from the catalog")
    return "profiles this planner's catalog leaves out"


def _unallocatable_as_used(name: str, gpus: list[Gpu], alloc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Free slices beyond what the node's allocatable offers of their resource (a device its
    plugin reports unhealthy, or withdrew; or just made, until the kubelet's next status write)
    cannot be given to a pod: marked used, so they are neither planned for a pod nor counted as
    free. Only for resources allocatable lists. (resource, why) of each resource with such slices."""
    found: list[tuple[str, str]] = []
    slices: dict[str, list[MigInstance | MpsSlice]] = {}
    for g in gpus:
        for m in g.mig:
            slices.setdefault(mig_resource_name(m.profile), []).append(m)
        for x in g.mps:
            slices.setdefault(mps_resource_name(x.size), []).append(x)
    for res, items in sorted(slices.items()):
        if res not in alloc:
            continue
        unusable = len(items) - int(parse_quantity(alloc[res]))
        free = [it for it in items if not it.used]
        for it in free[len(free) - min(max(0, unusable), len(free)):]:
            it.used = True
        if unusable > 0 and free:
            found.append((res, f"node {name}: {len(items)} {res} slice(s) reported, {alloc[res]} allocatable: "
                               f"{min(unusable, len(free))} free one(s) not planned for pods"))
    return found


def _labelled_count(name: str, labels: Mapping[str, Any], problems: list[str]) -> int:
    """The GPU count of `nvidia.com/gpu.count`, used only until the agent's capability report
    lists the GPUs: with GPU Operator's MIG strategy `single`, GPU feature discovery sets it to 0
    on a MIG node with mixed profiles or to the number of MIG devices, not of GPUs."""
    try:
        count = int(labels.get(GPU_COUNT_LABEL, 0))
    except ValueError:
        count = -1
    if not 0 <= count <= MAX_GPUS:
        problems.append(f"node {name}: label {GPU_COUNT_LABEL}={labels.get(GPU_COUNT_LABEL)!r} is not a GPU count "
                        f"(0 to {MAX_GPUS}); no GPU planned until its agent reports them")
        return 0
    return count


def _without_mode_conflicts(name: str, gpus: list[Gpu], mode: str, bound: Counter[str], described: NodeGpus,
                            problems: list[str]) -> list[Gpu]:
    """The GPUs the node's mode can use now. MPS cannot run on a GPU in MIG mode (or with a MIG
    mode change pending), so an MPS node plans none of those (its agent would refuse the slices).
    A GPU out of MIG mode on a MIG node may be busy with MPS pods bound there (a node switched
    from MPS while they run): MIG mode is enabled only once it is idle, so while such pods are
    bound, its empty GPUs out of MIG mode (without a capability report: all empty GPUs) are not
    carved."""
    if mode == "mps":
        out = [g for g in gpus if g.index not in described.in_mig]
        why = "are in MIG mode (or switching it); MPS slices cannot be made there until MIG mode is off"
    else:
        mps_bound = any(isinstance(known_resource(res), MpsResource) for res in bound)
        if not mps_bound:
            return gpus
        out = [g for g in gpus if g.mig or (described.not_mig is not None and g.index not in described.not_mig)]
        why = ("are out of MIG mode while pods using MPS slices are bound to the node; MIG mode is enabled only "
               "once they are idle")
    dropped = sorted({g.index for g in gpus} - {g.index for g in out})
    if dropped:
        problems.append(f"node {name}: GPU(s) {', '.join(map(str, dropped))} {why}: left out of planning")
    return out


def mode_switch(node: dict[str, Any]) -> tuple[str, str] | None:
    """(reported mode, labelled mode) when the node's agent reports another mode than its label
    asks for (the node being switched): what it reports is read in the wrong terms until it
    reports the labelled mode, so the node is not planned until then. None otherwise."""
    md = node.get("metadata") or {}
    mode = (md.get("labels") or {}).get(PARTITIONING_LABEL)
    reported = (md.get("annotations") or {}).get(STATUS_MODE)
    if mode in ("mig", "mps") and reported in ("mig", "mps") and reported != mode:
        return str(reported), str(mode)
    return None


def reported_slices(node: dict[str, Any], catalog: Catalog) -> Counter[str] | None:
    """The slices a node's agent last reported, by resource name (used or free), or None when
    its status cannot be read. After a plan's acknowledgement they are the plan's layout."""
    md = node.get("metadata") or {}
    annotations = md.get("annotations") or {}
    model = node_gpu_model(md.get("name", ""), md.get("labels") or {}, annotations, catalog).model
    if model is None:
        return None
    status = decode_status(annotations, model, node=md.get("name", ""))
    if status.layout is None:
        return None
    out: Counter[str] = Counter()
    for g in status.layout.gpus:
        for m in g.mig:
            out[mig_resource_name(m.profile)] += 1
        for s in g.mps:
            out[mps_resource_name(s.size)] += 1
    return out


def _init_kept(pod: dict[str, Any]) -> set[str]:
    """The slice resources of which a plain init container of the pod asks for more than its
    containers and sidecars: the kubelet keeps the rest for the pod, unlisted, until it ends, and
    which devices they are cannot be told (the agent keeps every device of the resource on the
    node meanwhile: agent/nodepods.py `Need.init_held`)."""
    spec = pod.get("spec") or {}
    init = spec.get("initContainers") or []
    if not init:
        return set()
    listed: Counter[str] = Counter()
    for c in [*(spec.get("containers") or []), *(c for c in init if c.get("restartPolicy") == "Always")]:
        res = c.get("resources") or {}
        for r, q in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            if is_slice_resource(r):
                listed[r] += math.ceil(parse_quantity(q))
    return {r for r, n in slice_requests(pod).items() if n > listed[r]}


def _protect_bound_slices(gpus: list[Gpu], bound: Counter[str], mode: str,
                          not_mig: frozenset[int] | None = None, placed: Counter[str] | None = None,
                          init_kept: AbstractSet[str] = frozenset()) -> list[Gpu]:
    """Mark free slices as used until each resource has at least as many used as pods bound
    (`bound`: bound, reserved or nominated there). When pods bound to the node (`placed`) are
    more than the slices its agent reports used, the status has not caught up with the kubelet,
    which gave them devices the planner cannot name: every free slice of that resource there
    counts as used until the agent reports which (else a plan could carve away the one a pod
    just started on). Returns the GPUs left to plan: on a MIG node, a GPU that a whole-GPU pod
    holds (one the node serves uncarved) is not the planner's to carve, so it is left out of the
    node's GPUs. Which GPUs those are, on either mode: the ones the agent reports out of MIG mode
    (`not_mig`; the device plugin serves no other whole), else, without a report, the first ones
    without instances. For a resource in `init_kept` (a pod's init container holds devices of it that no
    one can name) every free one stays, as the agent keeps them."""
    for res, n in bound.items():
        try:
            kind = parse_resource(res)
        except DynpartError:
            continue  # pending_pod() reports such a pod; a bound one holds nothing dynpart carves
        if isinstance(kind, WholeGpuResource):
            missing = n - sum(1 for g in gpus if g.whole_pod)
            free = [g for g in gpus if not g.whole_pod and not g.mps and not g.mig]
            if not_mig is not None:
                # on either mode the agent serves whole only GPUs out of MIG mode: on an MPS node
                # one still in MIG mode (relabelled from mig) holds no such pod
                free = [g for g in free if g.index in not_mig]
            held = free if res in init_kept else free[: max(0, missing)]
            if mode == "mig":
                gpus = [g for g in gpus if all(g is not h for h in held)]
            else:
                for g in held:
                    g.whole_pod = "(bound)"
            continue
        matching: list[MigInstance] | list[MpsSlice]
        if isinstance(kind, MigResource):
            matching = [m for g in gpus for m in g.mig if m.profile == kind.profile]
        else:
            matching = [s for g in gpus for s in g.mps if s.size == kind.size]
        reported = sum(1 for it in matching if it.used)
        unseen = (placed or Counter())[res] > reported or res in init_kept
        unused = [it for it in matching if not it.used]
        for it in unused if unseen else unused[: max(0, n - reported)]:
            it.used = True
    return gpus


def build_snapshot(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], catalog: Catalog,
                   exclude_nodes: AbstractSet[str] = frozenset(), exclude_pods: AbstractSet[str] = frozenset(),
                   reserved: Mapping[str, str] | None = None, switching_too: bool = False,
                   scheduler_names: Collection[str] = (DEFAULT_SCHEDULER,), in_flight: Mapping[str, str] | None = None,
                   no_defer: Mapping[str, AbstractSet[str]] | None = None, volumes: VolumeTopology | None = None,
                   mps_host_ipc: bool = False, other_nodes: Mapping[str, Mapping[str, str]] | None = None,
                   decodes: NodeDecodes | None = None, usage: BoundUsage | None = None,
                   node_views: NodeViews | None = None) -> ClusterView:
    """The snapshot of the labelled nodes and the batch candidates (see ClusterView). Nodes in
    `exclude_nodes` (awaiting an acknowledgement) and pods in `exclude_pods` (planned onto such
    nodes) are left out of this round. A pod in `reserved` (pod -> node: planned there, the plan
    applied, not bound yet) is counted on its node as if bound, so the slice made for it is
    neither destroyed nor planned for another pod, and it is not planned again. A node whose agent
    reports another mode than its label is left out (`mode_switch`) unless `switching_too`. A pod
    that a scheduler not in `scheduler_names` places is not planned (`ClusterView.elsewhere`).
    Pods whose required pod anti-affinity or host ports conflict (`pod_conflicts`) are kept off
    the nodes where placed pods conflict with them (`in_flight`, pod -> node: those a plan in flight
    puts there count as placed), and of two pending pods that conflict, the younger is left to the
    next round (`ClusterView.deferred`), unless the older is one `no_defer` names for it (pod ->
    the pods earlier rounds left it for and could not place: not left again for those), or they
    conflict on one node only (host ports, anti-affinity on `kubernetes.io/hostname`): both are
    planned, each listing the other in `PendingPod.apart`. `volumes`: the claims and
    volumes cached, whose node affinity narrows the pods that use them (`volume_topology`). `mps_host_ipc`: MPS
    pods need hostIPC: true (the planner setting mps_clients_host_ipc); one without is warned. `other_nodes`: the
    labels of the cluster's other nodes (name -> labels; those in `nodes` without the partitioning label count
    too): the topology domains the scheduler's spread and anti-affinity count them in. `decodes`: the nodes'
    annotations as earlier rounds decoded them, `usage` the bound pods' requests as they read them, both
    kept by the caller (`NodeDecodes`, `BoundUsage`: the same view, sooner)."""
    problems: list[tuple[dict[str, Any], str]] = []
    by_node: dict[str, list[dict[str, Any]]] = {}
    reserved = reserved or {}
    for pod in pods:
        for n in _holding_nodes(pod, reserved):
            by_node.setdefault(n, []).append(pod)
    views: list[Node] = []
    rooms: dict[str, dict[str, float]] = {}  # node -> NodeView.room
    acks: dict[str, str | None] = {}
    models: list[GpuModel] = []
    disagreements: dict[str, tuple[str, ...]] = {}
    switching: dict[str, str] = {}
    skew: list[tuple[dict[str, Any], str]] = []
    unallocatable: list[tuple[dict[str, Any], str, str]] = []
    kept: dict[str, dict[str, str]] = {}
    if decodes is not None:
        decodes.retain({str(_field(n, "metadata", "name") or "") for n in nodes})
    if usage is not None:
        usage.retain(pods)
    if node_views is not None:
        node_views.retain({str(_field(n, "metadata", "name") or "") for n in nodes})
    for node in sorted(nodes, key=lambda n: str(_field(n, "metadata", "name") or "")):
        name = str(_field(node, "metadata", "name") or "")
        labels = _field(node, "metadata", "labels")
        if not isinstance(labels, dict) or PARTITIONING_LABEL not in labels or name in exclude_nodes:
            continue
        try:
            switch = None if switching_too else mode_switch(node)
            if switch is not None:
                problems.append((node, _switch_message(name, *switch)))
                target = switch_target(node)
                if target is not None:
                    switching[name] = target
                continue
            view = (node_views.view(node, by_node.get(name, []), catalog, decodes, usage)
                    if node_views is not None and decodes is not None
                    else node_view(node, by_node.get(name, []), catalog, decodes, usage))
        except DynpartError as e:
            problems.append((node, f"node {name} left out of planning: {e}"))
            continue
        except (AttributeError, TypeError, ValueError, KeyError) as e:  # a field of the wrong type
            problems.append((node, f"node {name} left out of planning: cannot read it ({type(e).__name__}: {e})"))
            continue
        problems.extend((node, p) for p in view.problems)
        skew.extend((node, p) for p in view.skew)
        unallocatable.extend((node, res, why) for res, why in view.unallocatable)
        acks[name] = view.status_plan
        if view.node is not None and view.model is not None:
            views.append(view.node)
            models.append(view.model)
            rooms[name] = view.room
            if view.kept:
                kept[name] = view.kept
            if view.disagreements:
                disagreements[name] = view.disagreements
    pending: list[PendingPod] = []
    candidates: dict[str, dict[str, Any]] = {}
    warnings: list[tuple[dict[str, Any], str]] = []
    elsewhere: list[tuple[dict[str, Any], str]] = []
    hosts = _DynpartNodes(nodes, other_nodes or {})
    host_names: dict[str, frozenset[str]] = {}
    asked: dict[str, PendingPod] = {}
    by_key = {pod_key(p): p for p in pods if not _ended(p)} if in_flight else {}
    placed = PlacedPods([*((p, n) for n, on in by_node.items() for p in on),
                         *((by_key[k], n) for k, n in (in_flight or {}).items() if k in by_key)],
                        hosts.all_labels, frozenset(hosts.labels))
    deferred: dict[str, str] = {}
    apart_of: dict[str, list[str]] = {}  # pod -> the pending pods planned with it that it must not share a node with
    planned_as: dict[str, str] = {}  # the key `pod_conflicts` knows a planned pod by -> its name in the snapshot
    blocked: list[tuple[dict[str, Any], str]] = []
    awaiting_claims: dict[str, list[str]] = {}
    no_defer = no_defer or {}
    listed = {r for room in rooms.values() for r in room}
    in_round = frozenset(v.name for v in views)  # the nodes this round plans (not those left out: `exclude_nodes`)
    admitted_in_round: dict[frozenset[str], int] = {}  # a pod's admitting nodes -> how many are in the round
    short_of: dict[tuple[tuple[str, float], ...], dict[str, list[str]]] = {}  # requests -> nodes short of them
    # (a round's pods are mostly running: only those that may be candidates are sorted)
    maybe = [p for p in pods if not _past_pending(p)]
    for pod in sorted(maybe, key=lambda p: (str(_field(p, "metadata", "creationTimestamp") or ""), pod_key(p))):
        try:
            if not is_batch_candidate(pod) or pod_key(pod) in exclude_pods or pod_key(pod) in reserved:
                continue
            scheduler = scheduler_of(pod)
            if scheduler not in scheduler_names:
                elsewhere.append((pod, f"pod {pod_key(pod)} is not planned: scheduler {scheduler!r} places it, and "
                                       f"dynpart plans for the pods of {', '.join(map(repr, scheduler_names))} "
                                       "(planner setting scheduler_names), whose filters it predicts"))
                continue
            own = wants = pending_pod(pod)
            if volumes is not None:
                why, lasting, claim = volumes.missing(pod)
                if why is not None:
                    awaiting_claims.setdefault(str(claim), []).append(pod_key(pod))
                    if lasting:
                        blocked.append((pod, why))
                    continue  # (an ephemeral volume's claim is made within moments: the next round)
                wants = volumes.narrow(wants, pod)
            admitting = hosts.admitting(wants)
            if not admitting:
                elsewhere.append((pod, f"pod {wants.name} is not planned: {hosts.why_none(wants)}"))
                continue
            facts = pod_facts(pod)
            # spread counts the nodes the pod's own affinity admits (nodeAffinityPolicy), not its volumes'
            conflicting = placed.excluded_nodes(facts, hosts.admits(own), _affinity_key(own) if facts.spread else None)
            conflicting &= admitting
            other = _other_requests(_container_requests(pod))
            signature = tuple(sorted(other.items()))
            if signature not in short_of:  # (a round asks it for every pending pod: mostly the same requests)
                short_of[signature] = {n: lack for n, room in rooms.items() if (lack := _short_of(other, room, listed))}
            short = {n: lack for n, lack in short_of[signature].items() if n in admitting}
            excluded = conflicting | set(short)
            if excluded == admitting:
                blocked.append((pod, _blocked_reason(conflicting, short)))
                continue
            ignoring = no_defer.get(wants.name, frozenset())
            older, partners = placed.planned_conflicts(facts, ignoring)
            if older is None and partners:
                # planned with the older pods it conflicts with on one node only, kept apart from them;
                # as many as it may use nodes of this round at most (more could not all be placed: the
                # rest wait a round, where those planned count as placed), and at most MAX_APART
                joined = len(partners) if not ignoring else sum(1 for k in partners if k not in ignoring)
                if (n_in := admitted_in_round.get(admitting)) is None:
                    n_in = admitted_in_round[admitting] = len(admitting & in_round)
                # (excluded: of admitting; none joined, those it is not left for again only: planned)
                if joined and (joined >= n_in - len(excluded & in_round) or joined > MAX_APART):
                    older = next(k for k in reversed(partners) if k not in ignoring)
            if older is not None:
                deferred[wants.name] = older  # planned by the next round, where the older one counts as placed
                continue
            if partners:
                apart_of[wants.name] = [planned_as[k] for k in partners]
                for k in partners:
                    apart_of.setdefault(planned_as[k], []).append(wants.name)
            planned_as[facts.key] = wants.name
            placed.take(facts)
            asked[wants.name] = wants
            if excluded:
                wants = avoiding(wants, set(excluded))
            # the nodes that could take it now: when this round leaves all of them out, the
            # planner's reason would name the avoiding term above as the pod's own affinity
            host_names[wants.name] = admitting - excluded
            pending.append(wants)
            candidates[pod_key(pod)] = pod
            if isinstance(known_resource(pending[-1].resource), MpsResource):
                warnings.extend((pod, w) for w in _mps_client_warnings(pod, pending[-1].resource, mps_host_ipc))
        except DynpartError as e:
            problems.append((pod, str(e)))
        except (AttributeError, TypeError, ValueError, KeyError) as e:  # a field of the wrong type
            problems.append((pod, f"pod {pod_key(pod)} left out of planning: cannot read it ({type(e).__name__}: {e})"))
    # each node and pod checked on its own against the catalog and the MIG/MPS rules: one that
    # cannot be planned (an unknown MIG profile, a GPU product the catalog lacks) is left out with
    # its problem, and the round goes on for the others
    catalog = model_catalog(catalog, models)
    if apart_of:
        pending = prune_apart([p.model_copy(update={"apart": apart_of[p.name]}) if p.name in apart_of else p
                               for p in pending])
    snapshot, invalid = split_invalid(Snapshot(nodes=views, pending=pending), catalog)
    node_objs = {n.get("metadata", {}).get("name", ""): n for n in nodes}
    for name, message in invalid:
        obj = candidates.get(name) or node_objs.get(name) or {"metadata": {"name": name}}
        problems.append((obj, f"{'pod' if name in candidates else 'node'} {name} left out of planning: {message}"))
    return ClusterView(snapshot, acks, problems, catalog, disagreements, switching,
                       [(pod, w) for pod, w in warnings if pod_key(pod) in {p.name for p in snapshot.pending}],
                       skew, kept, elsewhere, {p.name: host_names[p.name] for p in snapshot.pending}, deferred, blocked,
                       {p.name: asked[p.name] for p in snapshot.pending}, awaiting_claims, unallocatable)


class _DynpartNodes:
    """The nodes labelled for dynpart (all of them: those left out of this round too), to tell a
    pod meant for them from one meant for other nodes, as the scheduler's NodeAffinity filter
    (nodeSelector, required node affinity) and dynpart's modes decide. Answers are cached per
    constraint signature: a round asks for every pending pod."""

    def __init__(self, nodes: list[dict[str, Any]], others: Mapping[str, Mapping[str, str]]):
        self.by_mode: dict[str, list[tuple[str, dict[str, str]]]] = {"mig": [], "mps": []}
        self.labels: dict[str, dict[str, str]] = {}
        # every node's labels, the others' too: the scheduler's spread counts every node that
        # carries a constraint's key as a domain (a CPU-only node holding no replica makes the
        # least 0), and a pod bound anywhere counts in its node's domain
        self.all_labels: dict[str, dict[str, str]] = {
            str(name): {str(k): str(v) for k, v in labels.items()} for name, labels in others.items()}
        for node in nodes:
            labels = _field(node, "metadata", "labels")
            name = str(_field(node, "metadata", "name") or "")
            if isinstance(labels, dict) and labels.get(PARTITIONING_LABEL) in self.by_mode:
                self.labels[name] = {str(k): str(v) for k, v in labels.items()}
                self.by_mode[labels[PARTITIONING_LABEL]].append((name, self.labels[name]))
            elif isinstance(labels, dict) and name:
                self.all_labels[name] = {str(k): str(v) for k, v in labels.items()}
        self.all_labels.update(self.labels)
        self._seen: dict[tuple[object, ...], frozenset[str]] = {}

    @staticmethod
    def _mode(pod: PendingPod) -> str:
        return "mig" if isinstance(known_resource(pod.resource), MigResource) else "mps"

    def admitting(self, pod: PendingPod) -> frozenset[str]:
        """The dynpart nodes that could ever take the pod, whatever their GPUs hold."""
        mode = self._mode(pod)
        key = (mode, tuple(sorted(pod.node_selector.items())), tuple(t.model_dump_json() for t in pod.node_affinity))
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = frozenset(
                name for name, labels in self.by_mode[mode]
                if all(labels.get(k) == v for k, v in pod.node_selector.items())
                and affinity_admits(pod.node_affinity, labels, name))
        return found

    def admits(self, pod: PendingPod) -> Callable[[str], bool]:
        """Whether the pod's nodeSelector and required node affinity admit a node, of either mode
        or none."""
        def admitted(name: str) -> bool:
            labels = self.all_labels.get(name, {})
            return (all(labels.get(k) == v for k, v in pod.node_selector.items())
                    and affinity_admits(pod.node_affinity, labels, name))
        return admitted

    def why_none(self, pod: PendingPod) -> str:
        """Why no dynpart node can ever take the pod (`admitting` is empty)."""
        mode = self._mode(pod)
        if not self.by_mode[mode]:
            return (f"no node is labelled {PARTITIONING_LABEL}={mode}, the mode that serves {pod.resource}"
                    if any(self.by_mode.values()) else f"no node is labelled {PARTITIONING_LABEL}")
        return (f"no {PARTITIONING_LABEL}={mode} node matches its nodeSelector and required node affinity "
                "(with its bound volumes' node affinity: meant for other nodes)")


def _holding_nodes(pod: dict[str, Any], reserved: Mapping[str, str]) -> set[str]:
    """The nodes whose slices the pod counts against as if bound there: the node it is bound to;
    else the one a dynpart reservation keeps a slice on, and the one the scheduler nominated it to
    after preempting pods there for it (`status.nominatedNodeName`: the slice their end frees is
    the preemptor's, so no plan may carve it away or give it to another pod)."""
    if _ended(pod):
        # it ended: the kubelet freed what it held, and the scheduler no longer sees it (its pod
        # informer selects status.phase!=Succeeded,Failed), so its anti-affinity, host ports and
        # spread count no more (`dynpart explain` lists every pod, the controller's watch only live ones)
        return set()
    bound = _field(pod, "spec", "nodeName")
    if isinstance(bound, str) and bound:
        return {bound}
    out = set()
    mine = reserved.get(pod_key(pod))
    if mine:
        out.add(mine)
    nominated = _field(pod, "status", "nominatedNodeName")
    if (isinstance(nominated, str) and nominated and _field(pod, "status", "phase") == "Pending"
            and not _field(pod, "metadata", "deletionTimestamp")):
        out.add(nominated)
    return out


def _ended(pod: dict[str, Any]) -> bool:
    """The pod is Succeeded or Failed (an ill-typed phase is not: where it is read, it is reported)."""
    phase = _field(pod, "status", "phase")
    return isinstance(phase, str) and phase in TERMINAL_PHASES


def _switch_message(name: str, reported: str, labelled: str) -> str:
    return (f"node {name}: its agent runs it in {reported.upper()} mode but its label "
            f"{PARTITIONING_LABEL}={labelled} asks for {labelled.upper()}: left out of planning until its agent "
            f"reports {labelled.upper()} mode (GPUs still in the old mode cannot take the new mode's slices)")


def switch_target(node: dict[str, Any]) -> str | None:
    """The labelled mode a switching spec must move the node's agent to (`mode_switch`, and its
    acknowledged spec keeps it in the old mode), or None: no spec to write."""
    switch = mode_switch(node)
    return switch[1] if switch is not None and _spec_holds_mode(node, switch[0]) else None


def _spec_holds_mode(node: dict[str, Any], reported: str) -> bool:
    """The node's spec, acknowledged, is of the mode its agent reports: an agent takes the mode
    from its spec, so it stays there until a spec of the labelled mode is written."""
    ann = _field(node, "metadata", "annotations")
    if not isinstance(ann, dict):
        return False
    return ann.get(SPEC_MODE) == reported and bool(ann.get(SPEC_PLAN)) and ann.get(SPEC_PLAN) == ann.get(STATUS_PLAN)


def switching_patch(node: dict[str, Any], mode: str, plan_id: str,
                    term: int | None = None) -> dict[str, str | None]:
    """The spec that moves a node's agent to the labelled `mode`: no slices, no pods. The agent
    keeps what is in use (MPS slices leaving MPS mode stay served while their pods run) and
    reports the node in its new mode; the node is planned from that report."""
    name = str(_field(node, "metadata", "name") or "")
    spec = encode_spec(NodeLayout(node=name, mode=mode, gpus=[]), plan_id, term=term)
    current = _field(node, "metadata", "annotations")
    return annotation_patch(current if isinstance(current, dict) else None, spec)


def can_revoke(node: dict[str, Any], catalog: Catalog) -> bool:
    """Whether a revocation can be written for the node (`revoking_patch`): its status reads.
    The pods of a plan on a node that cannot be revoked are not held for it."""
    return bool(build_snapshot([node], [], catalog, switching_too=True).snapshot.nodes)


def planned_patches(snapshot: Snapshot, result: Plan, nodes: Mapping[str, dict[str, Any]],
                    plan_id: str, term: int | None = None) -> list[tuple[NodeLayout, dict[str, str | None]]]:
    """The annotation patch the controller writes on each node whose layout the plan changes:
    the node's whole desired layout (planned GPUs, the others as they are) under a plan id of its
    own (`<plan_id>.<k>` for the k-th node written: an id names one node's layout, never two) and
    the leader's `term`, with the pods the plan puts there, as a merge patch against the
    annotations the node has (`nodes`: the objects by name). GPUs left out as unreadable are
    added by `keeping_unread`."""
    snap_nodes = {n.name: n for n in snapshot.nodes}
    out = []
    for k, write in enumerate(node_writes(result)):
        layout = write.layout
        spec = encode_spec(full_layout(snap_nodes[layout.node], layout), f"{plan_id}.{k}", term=term, pods=write.pods)
        current = nodes[layout.node].get("metadata", {}).get("annotations")
        out.append((layout, annotation_patch(current, spec)))
    return out


def keeping_unread(patch: Mapping[str, str | None], node: dict[str, Any],
                   kept: Mapping[str, str]) -> dict[str, str | None]:
    """A spec patch for `node` that also keeps as they are the GPUs the planner left out as
    unreadable (`kept`: their spec keys, `ClusterView.kept`): a spec without them would want them
    empty."""
    current = _field(node, "metadata", "annotations")
    current = current if isinstance(current, dict) else {}
    out = dict(patch)
    for key, value in kept.items():
        if current.get(key) == value:
            out.pop(key, None)  # there already (the patch would have removed it)
        else:
            out[key] = value
    return out


def revoking_patch(node: dict[str, Any], catalog: Catalog, plan_id: str,
                   term: int | None = None) -> dict[str, str | None] | None:
    """The patch that replaces a node's unacknowledged plan with its layout as its agent last
    reported it (nothing to create or destroy, no pods): written when an agent does not
    acknowledge in time, so that the old plan can never be applied after its pods went elsewhere.
    None when the node cannot be read (its agent never reported: there is nothing to keep)."""
    view = build_snapshot([node], [], catalog, switching_too=True)
    if not view.snapshot.nodes:
        return None
    spec = encode_spec(full_layout(view.snapshot.nodes[0], None), plan_id, term=term)
    spec.update(view.kept.get(view.snapshot.nodes[0].name, {}))
    current = _field(node, "metadata", "annotations")
    old = current.get(SPEC_PLAN) if isinstance(current, dict) else None
    if isinstance(old, str):
        spec[SPEC_REVOKES] = old
    return annotation_patch(current, spec)  # type: ignore[arg-type]  # a mapping or None, as read


def scheduler_of(pod: dict[str, Any]) -> str:
    """The scheduler that places the pod (`spec.schedulerName`; the API's default when unset)."""
    return str(_field(pod, "spec", "schedulerName") or DEFAULT_SCHEDULER)


def _field(obj: object, *path: str) -> object:
    """obj[path[0]][path[1]]..., or None where a level is missing or not a mapping."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _affinity_key(pod: PendingPod) -> tuple[object, ...]:
    """What tells one pod's nodeSelector and required node affinity from another's."""
    return (tuple(sorted(pod.node_selector.items())), tuple(pod.node_affinity))


def _some(names: Iterable[str], most: int = 3) -> str:
    """A few names, sorted, and how many more."""
    ordered = sorted(names)
    return ", ".join(ordered[:most]) + (f" and {len(ordered) - most} more" if len(ordered) > most else "")


def _required_affinity(spec: dict[str, Any]) -> dict[str, Any]:
    """The required node affinity, pod affinity and pod anti-affinity of a pod spec (pod_conflicts:
    the scheduler keeps the pods the anti-affinity terms select out of the pod's topology domain, and
    the pod in the domains of those its affinity terms select)."""
    out = {}
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        required = _field(spec, "affinity", kind, "requiredDuringSchedulingIgnoredDuringExecution")
        if required is not None:
            out[kind] = {"requiredDuringSchedulingIgnoredDuringExecution": required}
    return out


def _mps_client_warnings(pod: dict[str, Any], resource: str, host_ipc: bool) -> list[str]:
    """Why an MPS pod's CUDA will not reach its MPS server, if the pod says it: no hostIPC where the
    daemon's shared memory is the host's, or a volume at /dev/shm in a container given the slice,
    which takes the place of the daemon's /dev/shm (the kubelet mounts a pod's volumes after the
    device plugin's mounts; with hostIPC it hides the host's /dev/shm alike)."""
    out = []
    if host_ipc and not _field(pod, "spec", "hostIPC"):
        out.append(f"pod {pod_key(pod)} asks for an MPS slice ({resource}) without hostIPC: true: the MPS control "
                   "daemon's shared memory is the host's, so its CUDA cannot reach the MPS server (planned all the same)")
    containers, init = _field(pod, "spec", "containers"), _field(pod, "spec", "initContainers")
    sidecars = [c for c in init if isinstance(c, dict) and c.get("restartPolicy") == "Always"] \
        if isinstance(init, list) else []
    for c in [*(containers if isinstance(containers, list) else []), *sidecars]:
        if not isinstance(c, dict) or not _dev_shm_mounts(c):
            continue
        limits, requests = _field(c, "resources", "limits"), _field(c, "resources", "requests")
        if any(isinstance(r, dict) and resource in r for r in (limits, requests)):
            out.append(f"pod {pod_key(pod)}: container {c.get('name')} mounts a volume at {DEV_SHM} and asks for an "
                       f"MPS slice ({resource}): the volume takes the place of the MPS control daemon's shared "
                       f"memory there, so its CUDA cannot reach the MPS server (planned all the same; remove the "
                       "volume: the container is given the daemon's /dev/shm, shared by the node's MPS pods)")
    return out


def _dev_shm_mounts(container: dict[str, Any]) -> list[Any]:
    mounts = container.get("volumeMounts")
    return [m for m in mounts if isinstance(m, dict) and posixpath.normpath(str(m.get("mountPath", ""))) == DEV_SHM] \
        if isinstance(mounts, list) else []


def _host_ports(container: dict[str, Any]) -> dict[str, Any]:
    """A container's ports that take a host port (the scheduler's NodePorts filter), as a part of it."""
    ports = container.get("ports")
    if not isinstance(ports, list):
        return {}
    taken = [p for p in ports if isinstance(p, dict) and p.get("hostPort")]
    return {"ports": taken} if taken else {}


def _run_as(obj: dict[str, Any]) -> dict[str, Any]:
    """The securityContext's runAsUser of a pod spec or container, as a part of it (MPS: one
    server per user id)."""
    uid = _field(obj, "securityContext", "runAsUser")
    return {"securityContext": {"runAsUser": uid}} if uid is not None else {}


def run_as_user(pod: dict[str, Any]) -> int | None:
    """The user id the pod's containers run as, when the spec says it and they share it (a
    container's runAsUser overrides the pod's); None when unknown (the image's USER) or mixed."""
    default = _field(pod, "spec", "securityContext", "runAsUser")
    containers = _field(pod, "spec", "containers")
    uids = set()
    for c in containers if isinstance(containers, list) else []:
        own = _field(c, "securityContext", "runAsUser")
        uids.add(own if own is not None else default)  # root (0) is an id like any other
    uid = next(iter(uids)) if len(uids) == 1 else None
    return uid if isinstance(uid, int) and not isinstance(uid, bool) else None


def mps_user_clashes(placements: Iterable[tuple[str, str]], pods: Mapping[str, dict[str, Any]]
                     ) -> list[tuple[dict[str, Any], str]]:
    """(pod, why) for each MPS pod planned (`placements`: pod key, node) onto a node whose MPS pods
    run as another user id: the node's MPS control daemon runs one server per user id at a time,
    so the pod would wait in CUDA initialisation until every client of the other id ended. Only
    where the ids are known on both sides (runAsUser)."""
    def mps_user(pod: dict[str, Any] | None) -> int | None:  # the user id of an MPS pod, when known
        if pod is None or not any(isinstance(known_resource(r), MpsResource) for r in slice_requests(pod)):
            return None
        return run_as_user(pod)

    planned = [(key, node, pods.get(key), mps_user(pods.get(key))) for key, node in placements]
    # the pods bound to the nodes of MPS pods planned, only: every pod of the cluster is passed
    # (tens of thousands, each one's requests parsed), and this runs on the controller's event loop
    mps_nodes = {node for _, node, _, uid in planned if uid is not None}
    by_node: dict[str, set[int]] = {}
    for pod in pods.values():
        node = _field(pod, "spec", "nodeName")
        if not node or str(node) not in mps_nodes:
            continue
        uid = mps_user(pod) if _field(pod, "status", "phase") not in TERMINAL_PHASES else None
        if uid is not None:
            by_node.setdefault(str(node), set()).add(uid)
    planned_ids: dict[str, dict[int, str]] = {}  # node -> uid -> the first pod of this plan running as it
    for key, node, _, uid in planned:
        if uid is not None:
            planned_ids.setdefault(node, {}).setdefault(uid, key)
    out = []
    for key, node, obj, uid in planned:
        if obj is None or uid is None:
            continue
        there = sorted(by_node.get(node, set()) - {uid})
        beside = sorted(f"{other} (user {u})" for u, other in planned_ids.get(node, {}).items() if u != uid)
        if there or beside:
            whom = ([f"MPS pods on node {node} run as user(s) {', '.join(map(str, there))}"] if there else []) + \
                   ([f"this plan puts {', '.join(beside)} on node {node} too"] if beside else [])
            out.append((obj, f"pod {key} runs as user {uid}, and {'; '.join(whom)}: the node's MPS daemon runs "
                             "one server per user id at a time, so pods of one id wait in CUDA initialisation until "
                             "those of the other end; give the MPS pods of a node one runAsUser"))
    return out


def node_for_planning(node: dict[str, Any]) -> dict[str, Any]:
    """The part of a Node the planner reads (this module, `planning_facts`, Events and the spec
    writes: metadata, spec, allocatable): what the controller's node cache keeps. Managed fields
    and the status the kubelet keeps rewriting (images, often tens of kilobytes on a GPU node,
    conditions, addresses, volumes, node info) are dropped; ill-typed parts are kept as they are,
    so that the round reports them as it would on the full object."""
    out = {k: v for k, v in node.items() if k not in ("metadata", "status")}
    md, status = node.get("metadata"), node.get("status")
    if "metadata" in node:
        out["metadata"] = {k: v for k, v in md.items() if k != "managedFields"} if isinstance(md, dict) else md
    if "status" in node:
        out["status"] = {k: status[k] for k in ("allocatable",) if k in status} if isinstance(status, dict) else status
    return out


def node_labels_for_planning(node: dict[str, Any]) -> dict[str, Any]:
    """The part of a node dynpart does not plan that the planner reads: its name and labels (the
    topology domains the scheduler's spread and anti-affinity count it in)."""
    md = node.get("metadata")
    md = md if isinstance(md, dict) else {}
    labels = md.get("labels")
    return {"metadata": {**{k: md[k] for k in ("name", "uid", "resourceVersion") if k in md},
                         "labels": {sys.intern(str(k)): sys.intern(str(v)) for k, v in labels.items()}
                         if isinstance(labels, dict) else {}}}


def pod_for_planning(pod: dict[str, Any]) -> dict[str, Any]:
    """The part of a pod the planner reads (this module, and Events: kind, name, namespace, uid):
    what the controller's pod cache keeps. Managed fields, env, volumes, images and the like are
    dropped; a cluster's pod cache then costs a small fraction of the objects' size."""
    def part(key: str) -> dict[str, Any]:
        value = pod.get(key)
        return value if isinstance(value, dict) else {}

    md, spec, status = part("metadata"), part("spec"), part("status")

    def containers(key: str) -> object:
        items = spec.get(key)
        if not isinstance(items, list):
            return items  # ill-typed: kept, so the round reports it as it would on the full object
        return [{**{k: c[k] for k in ("name", "resources", "restartPolicy") if k in c}, **_run_as(c), **_host_ports(c),
                 **({"volumeMounts": shm} if (shm := _dev_shm_mounts(c)) else {})}
                if isinstance(c, dict) else c for c in items]

    conditions = status.get("conditions")
    resizing = _resizing(pod)
    return {
        "kind": "Pod",
        "metadata": {**{k: md[k] for k in ("name", "namespace", "uid", "resourceVersion", "generation",
                                           "creationTimestamp", "deletionTimestamp") if k in md},
                     # (pod_conflicts; interned: a Deployment's replicas repeat the same keys and values)
                     **({"labels": {sys.intern(str(k)): sys.intern(str(v)) for k, v in labels.items()}}
                        if isinstance(labels := md.get("labels"), dict) else {})},
        "spec": {**{k: spec[k] for k in ("nodeName", "nodeSelector", "priority", "tolerations", "overhead", "hostIPC",
                                         "resources", "schedulerName", "topologySpreadConstraints") if k in spec},
                 **({"affinity": affinity} if (affinity := _required_affinity(spec)) else {}),
                 **({"volumes": volumes} if (volumes := volumes_for_planning(pod)) else {}),
                 **{k: containers(k) for k in ("containers", "initContainers") if k in spec}, **_run_as(spec)},
        "status": {**{k: status[k] for k in ("phase", "nominatedNodeName") if k in status},
                   "conditions": [c for c in conditions if isinstance(c, dict) and (
                       c.get("type") == "PodScheduled" or (resizing and c.get("type") == RESIZE_PENDING))]
                   if isinstance(conditions, list) else conditions, **resizing},
    }


def _resizing(pod: dict[str, Any]) -> dict[str, Any]:
    """The part of a pod's status that an in-place resize makes count (`_container_requests`,
    bound): the statuses of the containers and sidecars whose requests the scheduler counts
    otherwise than their spec says (name, `resources.requests`, `allocatedResources`), with the
    PodResizePending conditions kept then (`pod_for_planning`). A pod not being resized has none:
    its statuses repeat its spec, and a cache of every running pod's would cost about as much as
    the rest of the pod."""
    def trimmed(cs: dict[str, Any]) -> dict[str, Any]:
        res = cs.get("resources")
        return {"name": cs.get("name"), "resources": {"requests": res.get("requests")} if isinstance(res, dict) else res,
                **({"allocatedResources": cs["allocatedResources"]} if "allocatedResources" in cs else {})}

    spec, status = pod.get("spec"), pod.get("status")
    if not isinstance(spec, dict) or not isinstance(status, dict) or not (
            status.get("containerStatuses") or status.get("initContainerStatuses")):
        return {}  # (a pending pod: every event of it and every relist passes here)
    def repeats(written: object, of: Mapping[str, Any]) -> bool:  # each quantity as the spec writes it
        return written is None or written == of or (  # (the first two: a running pod's statuses, mostly)
            isinstance(written, dict) and all(of.get(k) == q for k, q in written.items()))

    kept: dict[str, list[dict[str, Any]]] = {}
    try:
        infeasible = _resize_infeasible(pod)
        running: dict[str, list[Mapping[str, Any]]] = {}
        for c in [*(spec.get("containers") or []), *(c for c in spec.get("initContainers") or []
                                                      if c.get("restartPolicy") == "Always")]:
            res = c.get("resources") or {}
            running.setdefault(str(c.get("name")), []).append({**(res.get("limits") or {}), **(res.get("requests") or {})})
        read = _statuses(pod)  # (of two statuses of one name, the one the scheduler reads)
        for key in ("containerStatuses", "initContainerStatuses"):
            for cs in status.get(key) or []:
                name, res = str(cs.get("name")), cs.get("resources")
                if read[name] is not cs or res is None:
                    continue
                specs = running.get(name, [])
                if not infeasible and all(repeats(res.get("requests") if isinstance(res, dict) else None, r)
                                          and repeats(cs.get("allocatedResources"), r) for r in specs):
                    continue  # (most pods: parsing every running pod's quantities would slow a relist)
                if any(_effective_requests(req, cs, infeasible) != req for req in map(_spec_requests_of, specs)):
                    kept.setdefault(key, []).append(trimmed(cs))
    except (DynpartError, AttributeError, TypeError, ValueError):
        # unreadable: kept whole, so the round says what is wrong with it as on the full object
        kept = {k: status[k] for k in ("containerStatuses", "initContainerStatuses") if k in status}
    return kept
