"""What the controller's demand learns from a round's pending pods: the pod as it asks (not the nodes a
round keeps it off), a pod made again under a name counted before, more pods pending than the
memory holds, workload weights too large to sum (helper-120's review)."""

from __future__ import annotations

from dynpart.catalog import default_catalog
from dynpart.planner.cluster_view import build_snapshot
from dynpart.planner.loop import PlanningLoop
from dynpart.settings import PlannerSettings
from tests.controller.test_cluster_view import node
from tests.controller.test_pod_conflicts import labelled, replica

CAT = default_catalog()


def test_the_nodes_a_round_keeps_a_pod_off_are_not_learnt_as_the_kinds_nodes():
    """docs/planner.md: each pending pod counts once with "the nodes it may use: GPU models, node
    selector, tolerations, required affinity" (the pod's). A Deployment's replicas with required
    anti-affinity are one kind; the nodes a round keeps each off (a sibling there now, a transient
    fact, PlanningLoop.avoiding's metadata.name NotIn) are dynpart's, not the pod's."""
    nodes = [labelled(node(f"n{i}", count=1)) for i in range(1, 5)]
    pods = [replica("web-0", bound="n1"), replica("web-1"), replica("web-2")]
    view = build_snapshot(nodes, pods, CAT)
    loop = PlanningLoop(PlannerSettings(leader_election=False))
    planned = loop.prepare(view.snapshot, 0.0, view.asked)  # as the controller calls it
    assert any(t.match_fields for p in planned.pending for t in p.node_affinity)  # the round still keeps it off n1
    learnt = loop.demand.workload()
    assert not any(r.operator == "NotIn" and r.key == "metadata.name"
                   for s in learnt for t in s.node_affinity for r in t.match_fields), learnt


def test_a_pod_recreated_under_the_name_of_one_counted_counts_again():
    """A StatefulSet's pod (or one deleted and made again by its owner) comes back under its name
    with a new uid: a new pending pod, which "counts once" (docs/planner.md) like any other. It
    was never counted again while its name stayed among the last 100,000 remembered (weeks of
    pods on a small cluster), so a workload of such pods decays away while pending Jobs' count."""
    from dynpart.snapshot import PendingPod, Snapshot
    loop = PlanningLoop(PlannerSettings(leader_election=False))
    pod = PendingPod(name="ns/worker-0", resource="nvidia.com/mig-1g.10gb")
    loop.pod_waiting(pod.name, 0.0, "uid-1/1/aaaa")
    loop.prepare(Snapshot(pending=[pod]), 0.0)
    loop.prepare(Snapshot(pending=[pod]), 10.0)  # the same pod, still pending: counted once
    loop.pod_done(pod.name)  # bound, then deleted; its owner makes it again
    loop.pod_waiting(pod.name, 20.0, "uid-2/1/aaaa")
    loop.prepare(Snapshot(pending=[pod]), 20.0)
    [share] = loop.demand.workload()
    assert share.weight > 1.5, share.weight


def test_a_workload_of_huge_weights_is_planned_for_as_its_proportions():
    """The `workload` setting's weights are relative (any finite value > 0 is accepted): two
    shares of 1e308 are the same distribution as two of 1. Their sum overflowed to inf, every
    normalised weight became 0, and the objective planned for no workload at all."""
    import numpy as np

    from dynpart.planner.objective import Objective
    from dynpart.planner.problem import compile_workload
    from dynpart.snapshot import RequestShare
    def tables(w: float):
        shares = [RequestShare(resource="nvidia.com/mig-1g.10gb", weight=w),
                  RequestShare(resource="nvidia.com/mig-1g.10gb", weight=w),  # merged: 2w (inf, then NaN)
                  RequestShare(resource="nvidia.com/mig-3g.40gb", weight=w)]
        return Objective(compile_workload(shares, [], CAT)).w1
    assert np.allclose(tables(1e308), tables(1.0)), (tables(1e308).max(), tables(1.0).max())
    assert np.allclose(tables(1e308), tables(1.0))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.25, 1.0]), st.just(0.0))
def test_first_come_first_served_never_places_less_than_smallest_first(seed, mps_share, limit):
    """docs/planner.md: fairness is the greedy's order "among plans that place as many pods",
    never trading placed pods for older ones. (The greedy only: with the exact search's time
    budget either order may end on the better feasible plan, e.g. small_instance(0, mps_share=1)
    at 0.5 s: 165 vs 166, both "cp-sat feasible", equal at 2 s.)"""
    from unittest import mock

    from dynpart.planner import dynpart_policy
    from dynpart.planner.core import PlanOptions, plan
    from dynpart.planner.greedy import request_order
    from tests.planner.instances import small_instance
    snap = small_instance(seed, mps_share=mps_share)
    opts = PlanOptions(time_limit_s=limit)
    fair = plan(snap, CAT, opts).stats.placed_weight
    with mock.patch.object(dynpart_policy, "arrival_order", request_order):
        small_first = plan(snap, CAT, opts).stats.placed_weight
    assert fair >= small_first


def test_pods_pending_together_beyond_the_memory_are_each_counted_once():
    """More pods pending at once than `remember` (100,000 by default: a burst): each round's
    later pods pushed its earlier ones out of the memory, and every round counted every pending
    pod again, so the pods pending weighed rounds x pods, not once each."""
    from dynpart.planner.demand import DemandTracker
    from dynpart.snapshot import PendingPod
    t = DemandTracker(half_life_s=1e9, remember=3)
    pods = [PendingPod(name=f"p{i}", resource="nvidia.com/mig-1g.10gb") for i in range(4)]
    for _ in range(5):
        t.observe(pods, now=0)
    [share] = t.workload()
    assert share.weight == 4.0
