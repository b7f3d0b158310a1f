"""`dynpart explain`: why a pod is not placed, or which slice on which node and GPU the planner
would create for it. Works on a snapshot file (no cluster needed) or on the live cluster."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dynpart import yaml_text
from dynpart.catalog import Catalog, load_catalog
from dynpart.errors import DynpartError, SnapshotError, read_problem, yaml_problem
from dynpart.planner.core import POLICIES, PlanOptions, plan
from dynpart.snapshot import Plan, Snapshot, parse_snapshot

if TYPE_CHECKING:  # the Kubernetes client is imported only for a live cluster
    from collections.abc import Mapping

    from dynpart.kube.client import Obj
    from dynpart.planner.cluster_view import ClusterView


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("explain", help="why a pod waits, or where the planner would put it",
                       description="Plan once and explain the decision for one pod (or all pending pods). "
                       "Give --snapshot FILE (YAML/JSON snapshot, see docs/planner.md) or use the live cluster "
                       "(--kubeconfig or $KUBECONFIG).")
    p.add_argument("pod", nargs="?", help="namespace/name of a pending pod (default: every pending pod)")
    p.add_argument("--snapshot", help="snapshot file instead of the live cluster")
    p.add_argument("--kubeconfig")
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
    try:
        return parse_snapshot(data)
    except SnapshotError as e:
        raise DynpartError(f"snapshot file {path}: " + "; ".join(e.problems)) from None


async def _live_snapshot(kubeconfig: str | None, catalog: Catalog
                         ) -> tuple[Snapshot, Catalog, list[tuple[Obj, str]], dict[str, Obj], list[tuple[Obj, str]]]:
    """The snapshot a planning round would see now, its catalog, the problems it found, the pods
    by key, and the pods it would not plan (with why): meant for other nodes, excluded by every
    node (anti-affinity, host ports, spread, resources), or left to the next round."""
    from kubernetes_asyncio import client

    from dynpart.kube.client import api_client, read_json
    from dynpart.planner.cluster_view import build_snapshot

    api = await api_client(kubeconfig)
    try:
        core = client.CoreV1Api(api)
        # every node: those not labelled for dynpart are topology domains for spread and anti-affinity
        nodes = await read_json(await core.list_node(_preload_content=False))
        pods = await read_json(await core.list_pod_for_all_namespaces(_preload_content=False))
    finally:
        await api.close()
    view = build_snapshot(nodes["items"], pods["items"], catalog)
    by_key = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in pods["items"]}
    return view.snapshot, view.catalog, view.problems, by_key, not_planned(view, by_key)


def not_planned(view: ClusterView, by_key: Mapping[str, Obj]) -> list[tuple[Obj, str]]:
    """The pending pods a round would not plan, with why: meant for other nodes, excluded by every
    node (anti-affinity, host ports, spread, resources), or left to the next round."""
    later = [(by_key[k], f"pod {k} is planned by the round after the one that plans {older}: their required pod "
                         "anti-affinity, host ports or spread constraints conflict, and the older goes first")
             for k, older in view.deferred.items() if k in by_key]
    blocked = [(obj, f"pod {obj['metadata']['namespace']}/{obj['metadata']['name']} cannot be placed: {why}")
               for obj, why in view.blocked]
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
        snapshot, catalog, problems, live, elsewhere = asyncio.run(_live_snapshot(args.kubeconfig, catalog))
        if args.pod and args.pod not in {p.name for p in snapshot.pending}:
            pod = live.get(args.pod)
            if pod is None:
                raise DynpartError(f"pod {args.pod} not found")
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
