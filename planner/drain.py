"""Draining GPUs for a pod that waits for whole GPUs, pure.

A pod asking for a whole GPU (a full MIG profile such as 7g.80gb, `nvidia.com/gpu`, or an MPS
slice of a whole GPU) needs a GPU with nothing on it. While small pods keep arriving, one is
bound to every slice that frees, so on a busy cluster a GPU empties only by chance and the pod
may wait for ever. The classic answer, which the planning loop (`planner/loop.py`) applies after
`drain_after_s`: pick GPUs for it, stop new pods landing there, and wait for the pods on them to
end. The planner alone cannot stop new pods: a slice that frees is advertised at once and the
kube-scheduler binds it before any plan could destroy it. So the spec marks the GPUs drained
(`GpuLayout.drain`, annotation `dynpart.io/spec-drain`) and the node agent destroys each of their
slices as soon as nothing uses it (agent/reconcile.py `drained_mig`, `drained_mps`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from dynpart.catalog import Catalog
from dynpart.errors import DynpartError
from dynpart.resources import MigResource, MpsResource, WholeGpuResource, parse_resource
from dynpart.scheduling import affinity_admits, untolerated_taint
from dynpart.snapshot import Gpu, GpuLayout, Node, NodeLayout, PendingPod, Plan, Snapshot


@dataclass(frozen=True)
class Drain:
    """GPUs drained for one pod; it ends when the pod is planned, bound or gone."""

    pod: str
    node: str
    gpus: tuple[int, ...]


def is_empty(gpu: Gpu) -> bool:
    return not gpu.mig and not gpu.mps and gpu.whole_pod is None


def _families(names: list[str], catalog: Catalog) -> set[str]:
    """The models a pod's GPU-model selector accepts, as `plan()` matches them (`family_name`)."""
    out = set()
    for name in names:
        try:
            out.add(catalog.resolve(name).family_name)
        except DynpartError:
            continue  # a model the catalog lacks: no node of it is planned
    return out


def _used_shares(node: Node, pod: PendingPod, catalog: Catalog) -> dict[int, float] | None:
    """Per GPU of the node, the share of it in use, when the pod asks for whole GPUs of the
    node's kind and may run there; else None."""
    try:
        model = catalog.resolve(node.gpu_model)
        request = parse_resource(pod.resource)
    except (DynpartError, ValueError):
        return None
    if len(node.gpus) < pod.count or any(node.labels.get(k) != v for k, v in pod.node_selector.items()):
        return None
    if (not affinity_admits(pod.node_affinity, node.labels, node.name)
            or untolerated_taint(node.taints, node.unschedulable, pod.tolerations) is not None):
        return None
    if pod.gpu_models and model.family_name not in _families(pod.gpu_models, catalog):
        return None
    if isinstance(request, MigResource) and node.mode == "mig":
        profile = model.profiles_by_name.get(request.profile)
        if profile is None or profile.memory < model.memory_slices:
            return None
        return {g.index: sum(model.profiles_by_name[m.profile].memory for m in g.mig if m.used
                             and m.profile in model.profiles_by_name) / model.memory_slices for g in node.gpus}
    if node.mode == "mps" and (isinstance(request, WholeGpuResource)
                               or (isinstance(request, MpsResource) and request.size >= model.mps_capacity_gb)):
        return {g.index: 1.0 if g.whole_pod else sum(s.size for s in g.mps if s.used) / (g.capacity or model.mps_capacity_gb)
                for g in node.gpus}
    return None


def may_hold(node: Node, pod: PendingPod, catalog: Catalog) -> bool:
    """Whether the node may still take the pod as `drain_target` chose it: of its kind, in its
    mode, admitted (no cordon or taint it does not tolerate, its selector and affinity)."""
    return _used_shares(node, pod, catalog) is not None


def drain_target(snapshot: Snapshot, pod: PendingPod, catalog: Catalog,
                 taken: Collection[tuple[str, int]] = (), avoid: Collection[str] = ()) -> Drain | None:
    """Where to drain for a pod asking for whole GPUs: on a node of its kind where it may run,
    its `count` GPUs with the least in use (the soonest empty, not knowing run times), on the
    node where they have the least in use in all, GPUs another drain holds (`taken`, (node,
    GPU index)) and the nodes in `avoid` (where a pod it must be kept apart from is planned or
    drains) left out; ties to the first node in the snapshot. None
    for a pod that does not ask for whole GPUs, or when no node could ever hold it."""
    best: tuple[float, Drain] | None = None
    for node in snapshot.nodes:
        if node.name in avoid:
            continue
        share = _used_shares(node, pod, catalog)
        if share is None:
            continue
        share = {i: v for i, v in share.items() if (node.name, i) not in taken}  # drained for another pod
        if len(share) < pod.count:
            continue
        chosen = tuple(sorted(sorted(share, key=lambda i: (share[i], i))[: pod.count]))
        used = sum(share[i] for i in chosen)
        if best is None or used < best[0]:
            best = (used, Drain(pod.name, node.name, chosen))
    return None if best is None else best[1]


def without_gpus(snapshot: Snapshot, node_name: str, gpus: tuple[int, ...]) -> Snapshot:
    """The snapshot without those GPUs of the node: no plan puts anything there."""
    nodes = [n.model_copy(update={"gpus": [g for g in n.gpus if g.index not in gpus]}) if n.name == node_name else n
             for n in snapshot.nodes]
    return snapshot.model_copy(update={"nodes": nodes})


def with_drain_flags(result: Plan, snapshot: Snapshot, node_name: str, drained: set[int], flagged: set[int]) -> Plan:
    """The plan with the node's GPUs marked as the drain wants them: `drained` (the GPUs to drain
    now) get their used slices only and the flag, the free ones destroyed; `flagged` (the GPUs
    the node's spec drains already) that are no longer drained lose the flag. A GPU the plan
    itself lays out is left as planned. The node is written when a flag or a slice changes."""
    node = next((n for n in snapshot.nodes if n.name == node_name), None)
    mine = result.layout_of(node_name)
    planned = {g.index for g in mine.gpus} if mine is not None else set()
    if node is None:
        return result
    extra = []
    for g in node.gpus:
        if g.index in planned:
            continue
        free = [m for m in g.mig if not m.used] + [s for s in g.mps if not s.used]
        if g.index in drained:
            extra.append(GpuLayout(index=g.index, mig=[m for m in g.mig if m.used], mps=[s for s in g.mps if s.used],
                                   whole_pod=g.whole_pod, drain=True,
                                   changed=bool(free) or g.index not in flagged, destroyed=len(free)))
        elif g.index in flagged:
            extra.append(GpuLayout(index=g.index, mig=list(g.mig), mps=list(g.mps), whole_pod=g.whole_pod,
                                   changed=True))
    if not extra:
        return result
    gpus = sorted([*(mine.gpus if mine is not None else []), *extra], key=lambda g: g.index)
    rank = {n.name: i for i, n in enumerate(snapshot.nodes)}
    layouts = [lay for lay in result.layouts if lay.node != node_name]
    layouts.append(NodeLayout(node=node_name, mode=node.mode, gpus=gpus))
    layouts.sort(key=lambda lay: rank.get(lay.node, len(rank)))
    return result.model_copy(update={"layouts": layouts})
