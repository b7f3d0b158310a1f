"""Checks that every plan must pass, whatever the policy: used by the property tests."""

from __future__ import annotations

from collections import Counter

from dynpart.catalog import default_catalog
from dynpart.mig import geometry_violations
from dynpart.resources import MigResource, MpsResource, parse_resource
from dynpart.scheduling import affinity_admits, untolerated_taint
from dynpart.snapshot import MpsSlice, Plan, Snapshot, full_layout, gpu_capacity


def check_plan(snap: Snapshot, plan: Plan) -> None:
    catalog = default_catalog()
    pods = {p.name: p for p in snap.pending}
    nodes = {n.name: n for n in snap.nodes}
    layouts = {n.name: full_layout(n, plan.layout_of(n.name)) for n in snap.nodes}
    taken: Counter[str] = Counter()
    for node in snap.nodes:
        model = catalog.resolve(node.gpu_model)
        current = {g.index: g for g in node.gpus}
        for gl in layouts[node.name].gpus:
            cur = current[gl.index]
            if node.mode == "mig":
                # valid for the driver
                assert not geometry_violations(model, [(i.profile, i.start) for i in gl.mig]), (node.name, gl)
                # every used instance stays where it is, still used
                kept = {(i.profile, i.start) for i in gl.mig if i.used}
                for inst in cur.mig:
                    if inst.used:
                        assert (inst.profile, inst.start) in kept, f"used {inst} on {node.name}/{gl.index} moved"
            else:
                assert sum(s.size for s in gl.mps) <= gpu_capacity(cur, model)
                check_mps_clients(model.mps_max_clients, cur.mps, gl.mps, f"{node.name}/{gl.index}")
                # held: used, or reserved for a pod bound already (the plan keeps it, as used)
                used_before = Counter(s.size for s in cur.mps if s.used or (s.pod and s.pod not in pods))
                used_after = Counter(s.size for s in gl.mps if s.used or (s.pod and s.pod not in pods))
                assert used_before == used_after, f"used MPS slices changed on {node.name}/{gl.index}"
                if gl.whole_pod:
                    assert not gl.mps
                if cur.whole_pod:
                    assert gl.whole_pod == cur.whole_pod
            for i in [*gl.mig, *gl.mps]:
                if i.pod and not i.used and i.pod in pods:  # not a slice reserved for a pod bound already
                    taken[i.pod] += 1
            if gl.whole_pod and gl.whole_pod != cur.whole_pod:
                taken[gl.whole_pod] += 1
    cpu = Counter()
    mem = Counter()
    placed = set()
    for pl in plan.placements:
        pod = pods[pl.pod]
        assert pl.pod not in placed
        placed.add(pl.pod)
        node = nodes[pl.node]
        assert all(node.labels.get(k) == v for k, v in pod.node_selector.items())
        assert untolerated_taint(node.taints, node.unschedulable, pod.tolerations) is None
        assert affinity_admits(pod.node_affinity, node.labels, node.name)
        res = parse_resource(pod.resource)
        assert node.mode == ("mig" if isinstance(res, MigResource) else "mps")
        assert taken[pl.pod] == pod.count, f"{pl.pod} got {taken[pl.pod]} slices, asked {pod.count}"
        # the placement names each of them (a replay binds what it names; two MPS slices of one size are two)
        assert len(pl.slices) == pod.count, f"{pl.pod}: placement names {len(pl.slices)} slices, asked {pod.count}"
        layout = layouts[pl.node]
        mine = [i for g in layout.gpus for i in [*g.mig, *g.mps] if i.pod == pl.pod]
        if isinstance(res, MigResource):
            assert all(i.profile == res.profile for i in mine)
        elif isinstance(res, MpsResource):
            assert all(i.size == res.size for i in mine)
        cpu[pl.node] += pod.cpu_milli
        mem[pl.node] += pod.memory_mib
    for name, node in nodes.items():
        assert cpu[name] <= node.cpu_milli_free and mem[name] <= node.memory_mib_free
    # every slice handed to a pod belongs to a placed pod
    assert set(taken) <= placed
    assert {u.pod for u in plan.unplaced} | placed == set(pods)
    assert plan.stats.placed == len(placed) <= plan.stats.placed_upper_bound


def check_mps_clients(limit: int | None, before: list[MpsSlice], after: list[MpsSlice], where: str) -> None:
    """An MPS server serves at most `limit` clients (catalog `mps_max_clients`; None: no bound):
    a GPU holds at most that many slices, and at most that many held by pods (in use, or planned
    for one). A GPU already past it (laid out before the bound, or by hand) may keep what it has
    but gets no new slice, and no pod beyond what it serves already."""
    if limit is None:
        return
    held_before = sum(1 for s in before if s.used or s.pod)
    held_after = sum(1 for s in after if s.used or s.pod)
    assert held_after <= max(limit, held_before), (
        f"{where}: {held_after} slices held by pods, its MPS server serves {limit} (it held {held_before})")
    kept_only = Counter(s.size for s in after) <= Counter(s.size for s in before)
    assert len(after) <= limit or kept_only, (
        f"{where}: {len(after)} slices (from {len(before)}), its MPS server serves {limit}: new slices past the bound")
