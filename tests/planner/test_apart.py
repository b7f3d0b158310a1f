"""Pending pods kept apart (`PendingPod.apart`: required pod anti-affinity on the hostname, host
ports, as the cluster view finds them): no plan of any policy puts two of them on one node, every
policy honours it itself (the greedy, the exact search whole and by windows, the baselines' first
fit), and `plan()` checks every policy's plan (`output.keep_apart`); apart pods that fit are all
placed when the nodes are enough; the lists are validated."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.errors import SnapshotError
from dynpart.planner import PlanOptions, plan
from dynpart.planner.baselines.nos import NosPolicy
from dynpart.planner.dynpart_policy import DynpartPolicy
from dynpart.planner.session import PlanningSession
from dynpart.snapshot import Gpu, Node, PendingPod, Plan, Snapshot, prune_apart
from tests.planner.check import check_plan
from tests.planner.instances import small_instance

CAT = default_catalog()
FINAL_CHECK = "which it must not share a node with"


def with_apart(snap: Snapshot, seed: int, density: float) -> Snapshot:
    """The snapshot's pods with a random symmetric `apart` graph: cliques (a Deployment's replicas)
    and single pairs."""
    rng = random.Random(seed)
    names = [p.name for p in snap.pending]
    pairs: set[tuple[str, str]] = set()
    for _ in range(rng.randint(0, 3)):  # cliques
        group = rng.sample(names, min(len(names), rng.randint(2, 6)))
        pairs.update((a, b) for a in group for b in group if a < b)
    pairs.update((a, b) for a in names for b in names if a < b and rng.random() < density)
    apart: dict[str, list[str]] = {}
    for a, b in sorted(pairs):
        apart.setdefault(a, []).append(b)
        apart.setdefault(b, []).append(a)
    return snap.model_copy(update={"pending": [p.model_copy(update={"apart": apart.get(p.name, [])})
                                               for p in snap.pending]})


def violations(snap: Snapshot, result: Plan) -> list[tuple[str, str, str]]:
    where = {pl.pod: pl.node for pl in result.placements}
    return [(p.name, other, where[p.name]) for p in snap.pending for other in p.apart
            if p.name in where and where.get(other) == where[p.name]]


OPTIONS = {"dynpart": PlanOptions(time_limit_s=0.2),
           "dynpart-windows": PlanOptions(time_limit_s=0.2, exact_max_gpus=0, exact_max_pods=0),
           "nos": PlanOptions(policy="nos"), "static": PlanOptions(policy="static")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), density=st.sampled_from([0.0, 0.1, 0.4]), options=st.sampled_from(sorted(OPTIONS)))
def test_no_plan_of_any_policy_puts_two_apart_pods_on_one_node(seed, density, options):
    snap = with_apart(small_instance(seed, max_nodes=4, max_gpus=3, max_pods=16, mps_share=0.3), seed, density)
    result = plan(snap, CAT, OPTIONS[options])
    check_plan(snap, result)
    assert not violations(snap, result)
    # every policy honours it itself: `plan()`'s final check never had to leave a pod out
    assert not [u for u in result.unplaced if FINAL_CHECK in u.reason], result.unplaced


def empty_nodes(n: int) -> list[Node]:
    return [Node(name=f"n{i:02d}", mode="mig", gpu_model="H100-80GB", gpus=[Gpu(index=0)]) for i in range(n)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), pods=st.integers(1, 24), spare=st.integers(0, 4), density=st.sampled_from([0.2, 1.0]),
       policy=st.sampled_from(["dynpart", "nos"]))
def test_apart_pods_that_fit_are_all_placed_when_the_nodes_are_enough(seed, pods, spare, density, policy):
    """Pods of one MIG slice each, as many nodes as pods or more: each pod's partners and the pods
    filling a node are fewer than the nodes, so one is left for it (density 1: one Deployment)."""
    pending = [PendingPod(name=f"ml/p{i:02d}", resource="nvidia.com/mig-1g.10gb") for i in range(pods)]
    snap = with_apart(Snapshot(nodes=empty_nodes(pods + spare), pending=pending), seed, density)
    result = plan(snap, CAT, PlanOptions(policy=policy, time_limit_s=0.2))
    assert not violations(snap, result)
    assert len(result.placements) == pods, result.unplaced


def test_a_deployments_replicas_go_one_a_node_and_the_exact_search_keeps_them_apart():
    """Five replicas on three one-GPU nodes: the greedy places three; the others fit alone, so the
    exact search runs (the whole instance) and finds no plan placing more (it keeps them apart)."""
    names = [f"ml/web-{i}" for i in range(5)]
    pending = [PendingPod(name=n, resource="nvidia.com/mig-1g.10gb", apart=[o for o in names if o != n]) for n in names]
    snap = Snapshot(nodes=empty_nodes(3), pending=pending)
    result = plan(snap, CAT)
    assert result.stats.solver.startswith("cp-sat")
    assert sorted(pl.node for pl in result.placements) == ["n00", "n01", "n02"]
    assert not [u for u in result.unplaced if FINAL_CHECK in u.reason]
    no_apart = Snapshot(nodes=empty_nodes(3), pending=[p.model_copy(update={"apart": []}) for p in pending])
    assert len(plan(no_apart, CAT).placements) == 5, "without apart all five share nodes"


@pytest.mark.parametrize("policy", [DynpartPolicy, NosPolicy])
def test_plan_leaves_out_the_younger_of_two_apart_pods_a_policy_put_on_one_node(monkeypatch, policy):
    """A policy that ignores `apart` (here: shown requests without it) put both pods on the one
    node: `plan()` leaves the younger out, its slice made but free, with a reason naming the older."""
    real = policy.place

    def careless(self, problem):
        kept = [r.apart for r in problem.requests]
        for r in problem.requests:
            r.apart = ()
        try:
            return real(self, problem)
        finally:
            for r, a in zip(problem.requests, kept):
                r.apart = a
    monkeypatch.setattr(policy, "place", careless)
    pending = [PendingPod(name="ml/a", resource="nvidia.com/mig-1g.10gb", apart=["ml/b"]),
               PendingPod(name="ml/b", resource="nvidia.com/mig-1g.10gb", apart=["ml/a"]),
               PendingPod(name="ml/c", resource="nvidia.com/mig-1g.10gb")]
    snap = Snapshot(nodes=empty_nodes(1), pending=pending)
    result = plan(snap, CAT, PlanOptions(policy=policy(PlanOptions()).name))
    assert sorted(pl.pod for pl in result.placements) == ["ml/a", "ml/c"]
    [left] = result.unplaced
    assert left.pod == "ml/b" and "pending pod ml/a" in left.reason and "node n00" in left.reason
    check_plan(snap, result)
    [layout] = result.layouts
    pods = sorted(str(m.pod) for g in layout.gpus for m in g.mig)
    assert "ml/b" not in pods and "None" in pods and result.stats.placed == 2, "its slice made, left free"


def test_apart_lists_are_validated_and_pruned():
    nodes = empty_nodes(2)

    def snap(*aparts: list[str]) -> Snapshot:
        return Snapshot(nodes=nodes, pending=[PendingPod(name=f"ml/p{i}", resource="nvidia.com/mig-1g.10gb", apart=a)
                                              for i, a in enumerate(aparts)])
    with pytest.raises(SnapshotError, match="no pending pod of that name"):
        plan(snap(["ml/x"], []), CAT)
    with pytest.raises(SnapshotError, match="does not list 'ml/p0' back"):
        plan(snap(["ml/p1"], []), CAT)
    with pytest.raises(SnapshotError, match="apart from itself"):
        plan(snap(["ml/p0"]), CAT)
    with pytest.raises(SnapshotError, match="does not list"):
        PlanningSession(nodes, CAT).plan(snap(["ml/p1"], []).pending)
    # a pod left out of a round drops out of its partners' lists
    pruned = prune_apart(snap(["ml/p1", "ml/p2"], ["ml/p0"], ["ml/p0"]).pending[:2])
    assert [p.apart for p in pruned] == [["ml/p1"], ["ml/p0"]]
    # planned without validation, a list given one way is kept both ways
    one_way = snap(["ml/p1"], [])
    result = PlanningSession(nodes, CAT).plan(one_way.pending, validate=False)
    assert len({pl.node for pl in result.placements}) == 2


def test_the_baselines_first_fit_reads_a_pods_partners_once_not_per_node():
    """The first fit looked up every partner's node at every node it tried: a Deployment's
    replicas kept apart (k of them) cost k^3 / 6 look-ups; 2,000 replicas on 2,000 nodes took
    the static baseline 21 s instead of 4 (nos 102 s instead of 39)."""
    from dynpart.planner.baselines.common import schedule
    from dynpart.planner.problem import compile_requests
    from dynpart.planner.state import new_state
    from dynpart.snapshot import MigInstance

    class Counted(dict):
        gets = 0

        def get(self, *args):
            Counted.gets += 1
            return super().get(*args)

    k = 60
    names = [f"ml/web-{i:02d}" for i in range(k)]
    pending = [PendingPod(name=n, resource="nvidia.com/mig-1g.10gb", apart=[o for o in names if o != n]) for n in names]
    nodes = [Node(name=f"n{i:02d}", mode="mig", gpu_model="H100-80GB",
                  gpus=[Gpu(index=0, mig=[MigInstance(profile="1g.10gb", start=s) for s in range(7)])]) for i in range(k)]
    session = PlanningSession(nodes, CAT)
    problem = session.problem
    problem.requests = compile_requests(problem, pending, CAT, session._static, session.cpu, session.mem)
    placed = Counted()
    schedule(problem, [new_state(g) for g in problem.gpus], [n.cpu_free for n in problem.nodes],
             [n.mem_free for n in problem.nodes], placed)
    assert len({a.node for a in placed.values()}) == k
    assert Counted.gets <= 2 * k * k, Counted.gets
