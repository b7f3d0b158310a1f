"""What the planner sees (`Snapshot`) and what it decides (`Plan`): pydantic models, no I/O.

Units: CPU in millicores, memory in MiB. MPS slice sizes and GPU capacities are integers in
one unit per GPU: GB on a real cluster (the default capacity is the model's memory), or any
unit a simulation picks (e.g. thousandths of a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError, ResourceNameError, SnapshotError, field_path
from dynpart.mig import MigRules
from dynpart.resources import MigResource, parse_resource
from dynpart.scheduling import NodeSelectorTerm, Taint, Toleration

# the largest CPU (millicores), memory (MiB) and slice count a snapshot holds: the planner keeps them
# in 64-bit integer arrays, and a larger number (far beyond any machine) made it fail with OverflowError
MAX_AMOUNT = 2**53

Mode = Literal["mig", "mps"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MigInstance(_Model):
    """A MIG GPU instance (with its one compute instance) at a placement."""

    profile: str
    start: int = Field(ge=0)
    used: bool = False
    pod: str | None = None  # the pod using it, when known (in a plan: the pod planned onto it)


class MpsSlice(_Model):
    size: int = Field(gt=0)
    used: bool = False
    pod: str | None = None


class Gpu(_Model):
    index: int = Field(ge=0)
    mig: list[MigInstance] = []
    mps: list[MpsSlice] = []
    # A GPU given whole to one pod (`nvidia.com/gpu`); only on an unpartitioned GPU.
    whole_pod: str | None = None
    # MPS capacity in slice units; default: the model's memory in GB.
    capacity: int | None = Field(default=None, gt=0)


class Node(_Model):
    name: str = Field(min_length=1)
    mode: Mode
    gpu_model: str  # catalog name or `nvidia.com/gpu.product` label value
    cpu_milli_free: int = Field(default=1_000_000, ge=0, le=MAX_AMOUNT)
    memory_mib_free: int = Field(default=1 << 30, ge=0, le=MAX_AMOUNT)
    labels: dict[str, str] = {}
    gpus: list[Gpu] = []
    unschedulable: bool = False  # cordoned (node.spec.unschedulable)
    taints: list[Taint] = []


class PendingPod(_Model):
    name: str = Field(min_length=1)  # namespace/name
    resource: str  # nvidia.com/mig-1g.10gb, nvidia.com/gpu-10gb or nvidia.com/gpu
    count: int = Field(default=1, ge=1, le=MAX_AMOUNT)
    cpu_milli: int = Field(default=0, ge=0, le=MAX_AMOUNT)
    memory_mib: int = Field(default=0, ge=0, le=MAX_AMOUNT)
    priority: int = 0
    node_selector: dict[str, str] = {}
    gpu_models: list[str] = []  # accepted models (names or product labels); empty = any
    tolerations: list[Toleration] = []
    # required node affinity: the node must match one of these terms (none: any node)
    node_affinity: list[NodeSelectorTerm] = []
    # other pending pods of the snapshot that this one must not share a node with (the names,
    # both ways: b in a's list and a in b's): required pod anti-affinity on a key whose every
    # domain is one node, and host ports that clash (the controller's cluster view)
    apart: list[str] = []


class RequestShare(_Model):
    """One kind of request the cluster is expected to see, and how often (relative `weight`).
    The planner's third objective keeps free capacity usable by this distribution
    (docs/planner.md, "Objective")."""

    resource: str  # as PendingPod.resource
    count: int = Field(default=1, ge=1, le=MAX_AMOUNT)
    cpu_milli: int = Field(default=0, ge=0, le=MAX_AMOUNT)
    memory_mib: int = Field(default=0, ge=0, le=MAX_AMOUNT)
    # the nodes its pods may use, as PendingPod's fields (a pool, a GPU model, tolerated taints)
    gpu_models: list[str] = []
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    node_affinity: list[NodeSelectorTerm] = []
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)


class Snapshot(_Model):
    nodes: list[Node] = []
    pending: list[PendingPod] = []
    # the requests to keep free capacity usable for; empty: the pending pods, one share each
    workload: list[RequestShare] = []


# --- the plan -------------------------------------------------------------------------------


class GpuLayout(_Model):
    """The desired layout of one GPU: used instances/slices kept in place, free ones kept or
    created; `pod` names the pod the plan expects on a slice."""

    index: int
    mig: list[MigInstance] = []
    mps: list[MpsSlice] = []
    whole_pod: str | None = None
    changed: bool = False
    created: int = 0
    destroyed: int = 0
    # kept for a pod that waits for whole GPUs: the node agent destroys each of its slices as soon
    # as nothing uses it (nothing new is bound there), until the GPU is empty
    drain: bool = False


class NodeLayout(_Model):
    node: str
    mode: Mode
    gpus: list[GpuLayout]

    @property
    def changed(self) -> bool:
        return any(g.changed for g in self.gpus)


class PlacedSlice(_Model):
    """One slice a placement gives a pod, on the GPU with index `gpu` of its node: a MIG
    instance (`profile` at `start`), an MPS slice of `size` capacity units, or the whole GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: int
    kind: Literal["mig", "mps", "whole"]
    profile: str | None = None
    start: int | None = None
    size: int | None = None

    @classmethod
    def mig(cls, gpu: int, profile: str, start: int) -> PlacedSlice:
        return cls.model_construct(gpu=gpu, kind="mig", profile=profile, start=start, size=None)

    @classmethod
    def mps(cls, gpu: int, size: int) -> PlacedSlice:
        return cls.model_construct(gpu=gpu, kind="mps", profile=None, start=None, size=size)

    @classmethod
    def whole(cls, gpu: int) -> PlacedSlice:
        return cls.model_construct(gpu=gpu, kind="whole", profile=None, start=None, size=None)

    def __str__(self) -> str:
        """As people read it: `1g.10gb@0`, `20` (MPS size) or `whole`."""
        if self.kind == "mig":
            return f"{self.profile}@{self.start}"
        return "whole" if self.kind == "whole" else str(self.size)

    def sort_key(self) -> tuple[int, str]:
        return (self.gpu, str(self))


class PodPlacement(_Model):
    pod: str
    node: str
    slices: list[PlacedSlice]  # one entry per slice, by GPU index


class UnplacedPod(_Model):
    pod: str
    reason: str


class PlanStats(_Model):
    pending: int
    placed: int
    placed_weight: int
    free_slices_destroyed: int
    slices_created: int
    gpus_touched: int
    gpus_occupied: int
    placed_upper_bound: int
    solver: str  # "greedy", "cp-sat optimal", "cp-sat feasible", "cp-sat lns", ...
    solve_s: float


class Plan(_Model):
    policy: str
    # the desired layout of every GPU that changes or receives pods, by node in snapshot order;
    # a GPU not listed keeps its current layout (see `full_layout`)
    layouts: list[NodeLayout]
    placements: list[PodPlacement]
    unplaced: list[UnplacedPod]
    stats: PlanStats

    def changed_nodes(self) -> list[NodeLayout]:
        return [n for n in self.layouts if n.changed]

    def layout_of(self, node: str) -> NodeLayout | None:
        return next((n for n in self.layouts if n.node == node), None)


def full_layout(node: Node, planned: NodeLayout | None) -> NodeLayout:
    """Every GPU of the node: the plan's layout where it has one, the current one elsewhere."""
    by_index = {g.index: g for g in planned.gpus} if planned is not None else {}
    gpus = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        gpus.append(by_index.get(gpu.index) or GpuLayout(
            index=gpu.index, mig=[m.model_copy() for m in gpu.mig], mps=[s.model_copy() for s in gpu.mps],
            whole_pod=gpu.whole_pod))
    return NodeLayout(node=node.name, mode=node.mode, gpus=gpus)


# --- validation -----------------------------------------------------------------------------


def parse_snapshot(data: object) -> Snapshot:
    """Validate raw data (e.g. parsed JSON/YAML) into a Snapshot; errors name field and value."""
    if data is None:  # an empty or blank file
        raise SnapshotError(["empty: no snapshot document (expected a mapping with nodes and pending)"])
    if not isinstance(data, dict):  # a list, a string: there is no field to name
        raise SnapshotError([f"the document is a {type(data).__name__}, not a mapping with nodes and pending"])
    try:
        return Snapshot.model_validate(data)
    except ValidationError as e:
        raise SnapshotError(
            # (a missing field's "input" is the object around it: no value to show)
            [f"{field_path(err['loc'])}: {err['msg']}" if err["type"] == "missing"
             else f"{field_path(err['loc'])} = {err.get('input')!r}: {err['msg']}" for err in e.errors()]
        ) from None


def gpu_capacity(gpu: Gpu, model: GpuModel) -> int:
    return gpu.capacity if gpu.capacity is not None else model.mps_capacity_gb


def held_by(nodes: Iterable[Node]) -> dict[str, str]:
    """Pod -> where it holds a slice or a whole GPU (its first), as the nodes name them."""
    out: dict[str, str] = {}
    for node in nodes:  # (plain loops: a plan on 8,000 GPUs reads them all, in about 7 ms)
        for gpu in node.gpus:
            if gpu.whole_pod:
                out.setdefault(gpu.whole_pod, f"node {node.name} GPU {gpu.index}")
            for m in gpu.mig:
                if m.pod:
                    out.setdefault(m.pod, f"node {node.name} GPU {gpu.index}")
            for s in gpu.mps:
                if s.pod:
                    out.setdefault(s.pod, f"node {node.name} GPU {gpu.index}")
    return out


def held_problems(held: Mapping[str, str], pending: Sequence[PendingPod]) -> list[str]:
    """A pending pod that a node says holds a slice: it would be planned a second one (a pod on
    a slice is bound, not pending)."""
    return [f"pending[{i}] ({pod.name}).name = {pod.name!r}: already holds a slice ({held[pod.name]}); a pod on a "
            "slice is not pending" for i, pod in enumerate(pending) if pod.name in held]


def validate_snapshot(snapshot: Snapshot, catalog: Catalog) -> dict[str, GpuModel]:
    """Check the snapshot against the catalog and the MIG/MPS rules. Returns each node's model.

    Raises SnapshotError listing every problem, each naming the field and the value."""
    problems: list[str] = []
    models: dict[str, GpuModel] = {}
    seen_nodes: set[str] = set()
    for i, node in enumerate(snapshot.nodes):
        if node.name in seen_nodes:
            problems.append(f"nodes[{i}] ({node.name}).name = {node.name!r}: duplicate node name")
        seen_nodes.add(node.name)
        model, found = node_problems(f"nodes[{i}] ({node.name}).", node, catalog)
        problems.extend(found)
        if model is not None:
            models[node.name] = model
    known_profiles = catalog.mig_profile_names()
    seen_pods: set[str] = set()
    for i, pod in enumerate(snapshot.pending):
        if pod.name in seen_pods:
            problems.append(f"pending[{i}] ({pod.name}).name = {pod.name!r}: duplicate pod name")
        seen_pods.add(pod.name)
        problems.extend(pod_problems(f"pending[{i}] ({pod.name}).", pod, catalog, known_profiles))
    problems.extend(apart_problems(snapshot.pending))
    if snapshot.pending:  # (nodes validated alone, as a planning session does, hold no pending pod)
        problems.extend(held_problems(held_by(snapshot.nodes), snapshot.pending))
    for i, share in enumerate(snapshot.workload):
        # a MIG profile no model offers is no error here: a share learnt for a node that left (or
        # named as a driver names it) only counts for no node
        try:
            parse_resource(share.resource)
        except ResourceNameError as e:
            problems.append(f"workload[{i}].resource: {e}")
        for m in share.gpu_models:
            try:
                catalog.resolve(m, where=f"workload[{i}].gpu_models")
            except DynpartError as e:
                problems.append(str(e))
    if problems:
        raise SnapshotError(problems)
    return models


def node_problems(where: str, node: Node, catalog: Catalog) -> tuple[GpuModel | None, list[str]]:
    """What is wrong with one node on its own, and its model if known. Each problem names the
    field after `where`, the node's place in what is being checked ("nodes[3] (n1)." or "")."""
    problems: list[str] = []
    try:
        model = catalog.resolve(node.gpu_model, where=f"{where}gpu_model")
    except DynpartError as e:
        return None, [str(e)]
    if node.mode == "mig" and not model.supports_mig:
        problems.append(f"{where}mode = 'mig': GPU model {model.name} does not support MIG")
    rules = MigRules.of(model) if node.mode == "mig" and model.supports_mig else None
    indices: set[int] = set()
    for j, gpu in enumerate(node.gpus):
        if gpu.index in indices:
            problems.append(f"{where}gpus[{j}].index = {gpu.index}: duplicate GPU index")
        indices.add(gpu.index)
        if node.mode == "mig":
            # (the fields named only where there is a problem: a plan checks 8,000 GPUs)
            if gpu.mps:
                problems.append(f"{where}gpus[{j}].mps: MPS slices on a node in mig mode")
            if rules is not None:
                bad = rules.violations(tuple(map(_placement, gpu.mig)))
                if bad:
                    problems.extend(f"{where}gpus[{j}].mig: {b}" for b in bad)
            if gpu.whole_pod:
                problems.append(f"{where}gpus[{j}].whole_pod: whole GPUs are only modelled on mps nodes "
                                "(use a 7g profile)")
        else:
            gwhere = f"{where}gpus[{j}]"
            if gpu.mig:
                problems.append(f"{gwhere}.mig: MIG instances on a node in mps mode")
            cap = gpu_capacity(gpu, model)
            for k, s in enumerate(gpu.mps):
                if s.size > cap:
                    problems.append(
                        f"{gwhere}.mps[{k}].size = {s.size}: slice bigger than the GPU (capacity {cap})"
                    )
            total = sum(s.size for s in gpu.mps)
            if total > cap:
                problems.append(f"{gwhere}.mps: slices add up to {total}, more than the GPU's capacity {cap}")
            if gpu.whole_pod and gpu.mps:
                problems.append(f"{gwhere}.whole_pod = {gpu.whole_pod!r}: a whole GPU cannot also hold MPS slices")
    return model, problems


_placement = attrgetter("profile", "start")  # of a `MigInstance`


def pod_problems(where: str, pod: PendingPod, catalog: Catalog, known_profiles: AbstractSet[str]) -> list[str]:
    """What is wrong with one pending pod on its own; `where` as for `node_problems`."""
    problems: list[str] = []
    try:
        res = parse_resource(pod.resource)
    except ResourceNameError as e:
        return [f"{where}resource: {e}"]
    if isinstance(res, MigResource) and res.profile not in known_profiles:
        problems.append(
            f"{where}resource = {pod.resource!r}: MIG profile {res.profile!r} is not offered by any GPU "
            "model in the catalog"
        )
    for m in pod.gpu_models:
        try:
            catalog.resolve(m, where=f"{where}gpu_models")
        except DynpartError as e:
            problems.append(str(e))
    return problems


def apart_problems(pending: list[PendingPod]) -> list[str]:
    """What is wrong with the pods' `apart` lists: a name that is no other pending pod's, or a
    pod that does not list back a pod listing it."""
    if not any(p.apart for p in pending):
        return []
    listed = {p.name: set(p.apart) for p in pending}
    problems: list[str] = []
    for i, pod in enumerate(pending):
        for other in pod.apart:
            where = f"pending[{i}] ({pod.name}).apart: {other!r}"
            if other == pod.name:
                problems.append(f"{where}: a pod cannot be kept apart from itself")
            elif other not in listed:
                problems.append(f"{where}: no pending pod of that name")
            elif pod.name not in listed[other]:
                problems.append(f"{where}: that pod does not list {pod.name!r} back (apart goes both ways)")
    return problems


def prune_apart(pending: list[PendingPod]) -> list[PendingPod]:
    """The pods, their `apart` lists without the names of pods not among them (a pod left out of
    a round, or of a snapshot as invalid, keeps no other apart from it)."""
    if not any(p.apart for p in pending):
        return pending
    names = {p.name for p in pending}
    return [p if all(a in names for a in p.apart) else p.model_copy(update={"apart": [a for a in p.apart if a in names]})
            for p in pending]


def split_invalid(snapshot: Snapshot, catalog: Catalog) -> tuple[Snapshot, list[tuple[str, str]]]:
    """The snapshot without the nodes and pods that cannot be planned, and for each one left out
    (its name, what is wrong): one bad object never stops the planning of the others. Duplicate
    names are left to `validate_snapshot` (objects read from the API have unique names)."""
    problems: list[tuple[str, str]] = []
    nodes: list[Node] = []
    for node in snapshot.nodes:
        _, found = node_problems("", node, catalog)
        if found:
            problems.append((node.name, "; ".join(found)))
        else:
            nodes.append(node)
    known_profiles = catalog.mig_profile_names()
    pending: list[PendingPod] = []
    for pod in snapshot.pending:
        found = pod_problems("", pod, catalog, known_profiles)
        if found:
            problems.append((pod.name, "; ".join(found)))
        else:
            pending.append(pod)
    if not problems:
        return snapshot, []
    return Snapshot(nodes=nodes, pending=prune_apart(pending)), problems


__all__ = [
    "apart_problems", "Gpu", "GpuLayout", "MigInstance", "MpsSlice", "Node", "NodeLayout", "PendingPod",
    "Plan", "PlanStats", "PodPlacement", "Snapshot", "UnplacedPod", "full_layout", "gpu_capacity", "node_problems",
    "parse_snapshot", "PlacedSlice", "pod_problems", "prune_apart", "split_invalid", "validate_snapshot",
]
