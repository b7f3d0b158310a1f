"""`dynpart explain`: why a pod is not placed, or which slice on which node and GPU the planner
would create for it. Works on a snapshot file (no cluster needed) or on the live cluster."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dynpart import yaml_text
from dynpart.arguments import given, pod_name
from dynpart.catalog import Catalog, load_catalog
from dynpart.errors import DynpartError, SnapshotError, read_problem, yaml_problem
from dynpart.planner.core import POLICIES, PlanOptions, plan
from dynpart.snapshot import Plan, Snapshot, parse_snapshot

if TYPE_CHECKING:  # the Kubernetes client is imported only for a live cluster
    from collections.abc import Awaitable, Callable, Mapping
    from typing import Any

    from dynpart.kube.client import Obj
    from dynpart.planner.cluster_view import ClusterView


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("explain", help="why a pod waits, or where the planner would put it",
                       description="Plan once and explain the decision for one pod (or all pending pods). "
                       "Give --snapshot FILE (YAML/JSON snapshot, see docs/planner.md) or use the live cluster "
                       "(--kubeconfig or $KUBECONFIG).")
    p.add_argument("pod", nargs="?", type=given, help="namespace/name of a pending pod (default: every pending pod)")
    p.add_argument("--snapshot", type=given, help="snapshot file instead of the live cluster")
    p.add_argument("--kubeconfig", type=given)
    p.add_argument("--policy", choices=list(POLICIES), default="dynpart")
    p.add_argument("--json", action="store_true", help="print the plan's decision as JSON")
    p.set_defaults(func=run)


def _load_snapshot_file(path: str) -> Snapshot:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DynpartError(f"snapshot file {path}: {read_problem(e)}") from None
    try:
        data: object = yaml_text.load(text)
    except yaml.YAMLError as e:
        raise DynpartError(f"snapshot file {yaml_problem(path, e)}") from None
    if data is None:
        raise DynpartError(f"snapshot file {path}: the file is empty (expected a YAML/JSON snapshot, see docs/planner.md)")
    if isinstance(data, dict) and "apiVersion" in data and "kind" in data and "nodes" not in data:
        # (a pod's manifest, examples/pod-mig.yaml, given as the snapshot: every field was an
        # "Extra inputs are not permitted", none said what a snapshot is)
        raise DynpartError(f"snapshot file {path}: a Kubernetes {data['kind']} manifest, not a snapshot (a mapping with "
                           "nodes and pending: docs/planner.md, examples/snapshot.yaml); for a pod of a cluster, "
                           "run dynpart explain NAMESPACE/NAME with $KUBECONFIG set")
    try:
        return parse_snapshot(data)
    except SnapshotError as e:
        raise DynpartError(f"snapshot file {path}: " + "; ".join(e.problems)) from None


async def _live_snapshot(kubeconfig: str | None, catalog: Catalog
                         ) -> tuple[Snapshot, Catalog, list[tuple[Obj, str]], dict[str, Obj], list[tuple[Obj, str]]]:
    """The snapshot a planning round would see now, its catalog, the problems it found, the pods
    by key, and the pods it would not plan (with why): meant for other nodes, excluded by every
    node (anti-affinity, host ports, spread, resources, volumes), or left to the next round.
    Read as the planner's caches read the cluster: the same selectors and the same parts of each
    object, a page at a time (at 5,000 nodes and 60,000 pods one unpaged list is hundreds of MB)."""
    from kubernetes_asyncio import client

    from dynpart.kube.client import api_client
    from dynpart.kube.conventions import PARTITIONING_LABEL
    from dynpart.kube.errors import APIForbiddenError, APINotFoundError
    from dynpart.kube.watching import metadata_only, object_key
    from dynpart.planner.cluster_view import build_snapshot, node_for_planning, node_labels_for_planning, pod_for_planning
    from dynpart.planner.controller import LIVE_PODS
    from dynpart.planner.volume_topology import VolumeTopology, claim_for_planning, class_for_planning, volume_for_planning

    api = await api_client(kubeconfig)
    notes: list[tuple[Obj, str]] = []
    try:
        core = client.CoreV1Api(api)
        nodes = await listed(core.list_node, "nodes", node_for_planning, label_selector=PARTITIONING_LABEL)
        pods = await listed(core.list_pod_for_all_namespaces, "pods", pod_for_planning, field_selector=LIVE_PODS)
        optional: dict[str, list[Obj] | None] = {}
        # as the planner, it plans without these where the cluster's RBAC does not let it read them
        for name, list_fn, transform, selector in (
                ("other nodes", metadata_only(api, "/api/v1/nodes"), node_labels_for_planning, f"!{PARTITIONING_LABEL}"),
                ("claims", core.list_persistent_volume_claim_for_all_namespaces, claim_for_planning, None),
                ("volumes", core.list_persistent_volume, volume_for_planning, None),
                ("storage classes", client.StorageV1Api(api).list_storage_class, class_for_planning, None)):
            try:
                optional[name] = await listed(list_fn, name, transform, label_selector=selector)
            except (APIForbiddenError, APINotFoundError) as e:
                optional[name] = None
                notes.append(({"kind": "List", "metadata": {"name": name}},
                              f"the {name} are not read ({e}): planned without them"))
    finally:
        await api.close()
    claims, volumes, classes = optional["claims"], optional["volumes"], optional["storage classes"]
    view = build_snapshot(nodes, pods, catalog,
                          other_nodes={o["metadata"]["name"]: o["metadata"]["labels"] for o in optional["other nodes"] or []},
                          volumes=VolumeTopology({object_key(c): c for c in claims}, {object_key(v): v for v in volumes},
                                                 None if classes is None else {object_key(c): c for c in classes})
                          if claims is not None and volumes is not None else None)
    by_key = {object_key(p): p for p in pods}
    # (a one-shot look: slices not allocatable yet are said at once, the kubelet's lag or not)
    unallocatable = [(node, why) for node, _, why in view.unallocatable]
    return view.snapshot, view.catalog, [*notes, *view.problems, *unallocatable], by_key, not_planned(view, by_key)


async def listed(list_fn: Callable[..., Awaitable[Any]], name: str, transform: Callable[[Obj], Obj],
                 label_selector: str | None = None, field_selector: str | None = None) -> list[Obj]:
    """Every object `list_fn` lists, a page at a time (the informers' pager), each as `transform`
    keeps it."""
    from dynpart.kube.watching import Informer
    informer = Informer(list_fn, lambda kind, obj: None, name=name, transform=transform,
                        label_selector=label_selector, field_selector=field_selector)
    await informer.list_once()
    return list(informer.cache.values())


def not_planned(view: ClusterView, by_key: Mapping[str, Obj]) -> list[tuple[Obj, str]]:
    """The pending pods a round would not plan, with why: meant for other nodes, excluded by every
    node (anti-affinity, host ports, spread, resources), or left to the next round."""
    later = [(by_key[k], f"pod {k} is planned by the round after the one that plans {older}: their required pod "
                         "anti-affinity, host ports or spread constraints conflict, and the older goes first")
             for k, older in view.deferred.items() if k in by_key]
    from dynpart.planner.cluster_view import pod_key
    blocked = [(obj, f"pod {pod_key(obj)} cannot be placed: {why}") for obj, why in view.blocked]
    return [*view.elsewhere, *blocked, *later]


def describe(result: Plan, pod: str) -> str:
    for pl in result.placements:
        if pl.pod == pod:
            where = ", ".join(f"GPU {s.gpu}: {s}" for s in pl.slices)
            layout = result.layout_of(pl.node)
            mine = {s.gpu for s in pl.slices}
            changes = [g for g in (layout.gpus if layout else []) if g.changed and g.index in mine]
            how = (f"creating {sum(g.created for g in changes)} and destroying {sum(g.destroyed for g in changes)} "
                   f"free slice(s) on GPU(s) {', '.join(str(g.index) for g in changes)}" if changes
                   else "using slices that are already free")
            return f"{pod}: placed on node {pl.node} ({where}), {how}"
    for u in result.unplaced:
        if u.pod == pod:
            return f"{pod}: not placed: {u.reason}"
    raise DynpartError(f"pod {pod} is not among the pending pods planned (it must be Pending and Unschedulable "
                       "and ask for a nvidia.com/mig-*, nvidia.com/gpu-*gb or nvidia.com/gpu resource)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    catalog = load_catalog(args.catalog)
    problems: list[tuple[Obj, str]]
    live: dict[str, Obj]  # the live cluster's pods by namespace/name
    if args.snapshot:
        snapshot, problems, live = _load_snapshot_file(args.snapshot), [], {}
    else:
        if args.pod:  # (a snapshot file may name its pods otherwise)
            pod_name(args.pod)
        snapshot, catalog, problems, live, elsewhere = asyncio.run(_live_snapshot(args.kubeconfig, catalog))
        if args.pod and args.pod not in {p.name for p in snapshot.pending}:
            pod = live.get(args.pod)
            if pod is None:
                # (the planner's pods: those that ended are not listed)
                raise DynpartError(f"pod {args.pod} not found among the pods that have not ended (one Succeeded or "
                                   "Failed is not read: dynpart plans none)")
            own = [m for obj, m in [*problems, *elsewhere] if obj is pod]
            if own:  # a pod dynpart cannot plan: why
                raise DynpartError("; ".join(own))
            phase = pod.get("status", {}).get("phase")
            node = pod.get("spec", {}).get("nodeName")
            raise DynpartError(f"pod {args.pod} is {phase}{' on node ' + node if node else ''}: dynpart only plans "
                               "pods that the scheduler marked Unschedulable and that ask for a GPU slice resource")
    for _, message in problems:
        print(f"note: {message}")
    result = plan(snapshot, catalog, PlanOptions(policy=args.policy))
    pods = [args.pod] if args.pod else [p.name for p in snapshot.pending]
    if args.pod and args.pod not in {p.name for p in snapshot.pending}:
        describe(result, args.pod)  # raises: not a pending pod of the snapshot
    if args.json:
        print(json.dumps({"stats": result.stats.model_dump(),
                          "placements": [p.model_dump() for p in result.placements if p.pod in pods],
                          "unplaced": [u.model_dump() for u in result.unplaced if u.pod in pods]}, indent=2))
        return 0
    if not pods:
        print("no pending pods ask for a GPU slice")
    for name in pods:
        print(describe(result, name))
    return 0
