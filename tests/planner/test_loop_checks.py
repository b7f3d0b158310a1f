"""Checks of the planning loop's decisions (planner/loop.py, planner/batching.py) that the
controller and the simulator both run: when a batch closes, which pods a round plans, how long a
plan in flight, a reservation, a back-off or a drain holds, driven through the loop's public
methods with the clock passed in."""

from __future__ import annotations

import pytest

from dynpart.catalog import default_catalog
from dynpart.planner.drain import Drain
from dynpart.planner.loop import PlanningLoop, node_writes
from dynpart.scheduling import NodeSelectorRequirement, NodeSelectorTerm
from dynpart.settings import PlannerSettings
from dynpart.snapshot import Gpu, MigInstance, Node, PendingPod, RequestShare, Snapshot

CAT = default_catalog()
SMALL = "nvidia.com/mig-1g.10gb"


def empty_node(name: str, **labels: str) -> Node:
    return Node(name=name, mode="mig", gpu_model="H100-80GB", gpus=[Gpu(index=0)], labels=labels)


def test_a_pod_kept_off_a_node_keeps_its_own_node_affinity():
    """A pod that may run only in the `train` pool (required node affinity) whose slice on node a
    was not taken is kept off a, and still only planned in its pool: on c, never on b, the node of
    another team the back-off's NotIn term alone would admit."""
    pool = NodeSelectorTerm(match_expressions=(NodeSelectorRequirement(key="pool", operator="In", values=("train",)),))
    pod = PendingPod(name="ml/p", resource=SMALL, node_affinity=[pool])
    nodes = [empty_node("a", pool="train"), empty_node("b", pool="infer"), empty_node("c", pool="train")]
    lp = PlanningLoop(PlannerSettings(reservation_s=15.0))
    lp.pod_waiting("ml/p", 0.0)
    lp.reserve("ml/p", "a", 0.0)
    assert lp.reservations(16.0, lambda key: False) == {}  # lapsed unbound
    [prepared] = lp.prepare(Snapshot(nodes=nodes, pending=[pod]), 16.0).pending
    [term] = prepared.node_affinity
    assert term.match_expressions == pool.match_expressions
    assert [(r.key, r.operator, r.values) for r in term.match_fields] == [("metadata.name", "NotIn", ("a",))]
    result = lp.decide(lp.prepare(Snapshot(nodes=nodes, pending=[pod]), 16.0), CAT)
    assert [pl.node for pl in result.placements] == ["c"]


def test_the_controllers_loop_keeps_free_slices_rather_than_destroy_them():
    """The loop as the controller builds it (its settings only) counts reconfiguring as a cost:
    a 1g pod is given a slice made on an empty GPU, not one cut out of a free 7g instance that a
    whole-GPU pod may still take. (Only the packing simulation, whose GPUs are shared without
    reconfiguring them, lets creating and destroying free slices cost nothing.)"""
    free_7g = Gpu(index=0, mig=[MigInstance(profile="7g.80gb", start=0)])
    nodes = [Node(name="a", mode="mig", gpu_model="H100-80GB", gpus=[free_7g]), empty_node("b")]
    snap = Snapshot(nodes=nodes, pending=[PendingPod(name="ml/p", resource=SMALL)])
    lp = PlanningLoop(PlannerSettings())
    assert [w.node for w in node_writes(lp.decide(lp.prepare(snap, 0.0), CAT))] == ["b"]
    packing = PlanningLoop(PlannerSettings(), minimise_changes=False)
    assert [w.node for w in node_writes(packing.decide(packing.prepare(snap, 0.0), CAT))] == ["a"]


def test_the_static_baseline_plans_with_the_geometry_it_is_given():
    """The simulator's static baseline (mig-manager with one configured geometry) lays every
    unpartitioned GPU out as given: with one 7g instance per H100, a 1g pod finds no slice and a
    whole-GPU MIG pod is placed, not the other way round as with the all-balanced default."""
    lp = PlanningLoop(PlannerSettings(), "static", {"H100-80GB": "7g.80gb:1"})
    snap = Snapshot(nodes=[empty_node("a")], pending=[PendingPod(name="ml/small", resource=SMALL),
                                                      PendingPod(name="ml/big", resource="nvidia.com/mig-7g.80gb")])
    result = lp.decide(lp.prepare(snap, 0.0), CAT)
    assert [pl.pod for pl in result.placements] == ["ml/big"]
    assert [u.pod for u in result.unplaced] == ["ml/small"]


def test_a_standby_remembers_no_deleted_node():
    """Nodes deleted while no round's copy of the drains is out (a standby replica, or a leader
    with nothing pending, sees every node deletion of the cluster) are not recorded for a commit:
    the set stays empty instead of growing with every node the cluster ever deleted."""
    lp = PlanningLoop(PlannerSettings())
    for i in range(3):
        assert lp.node_gone(f"n{i}", float(i)) is None
    assert lp.gone_since == set()
    state = lp.drain_state()
    lp.node_gone("n9", 5.0)
    assert lp.gone_since == {"n9"}
    assert lp.commit(state) and lp.gone_since == set()
    lp.node_gone("n10", 6.0)
    assert lp.gone_since == set()


def settings(**update) -> PlannerSettings:
    return PlannerSettings(**{"batch_idle_s": 0.5, "batch_timeout_s": 3.0, "reservation_s": 15.0,
                              "resync_s": 30.0, **update})


def test_a_pod_the_scheduler_finds_no_room_for_closes_a_batch_after_the_idle_wait():
    """A pod the scheduler reports unschedulable joins the batch once (True wakes the planner;
    its later status updates, False, do not), and the batch closes `batch_idle_s` after it, not
    before: the round is not run for pods that arrive together one by one."""
    lp = PlanningLoop(settings())
    assert not lp.due(0.0, waiting=False), "nothing waits"
    assert lp.pod_waiting("ml/a", 10.0) is True
    assert lp.pod_waiting("ml/a", 10.2) is False, "already in the batch: no wake-up"
    assert lp.window.members == {"ml/a"}
    assert not lp.due(10.4, waiting=False)
    assert lp.due(10.5, waiting=False)


def test_a_pod_whose_slice_is_on_its_way_does_not_start_a_round():
    """A pod planned onto a node whose agent has not acknowledged the plan (in flight), or whose
    slice is kept for it while the scheduler binds it (reserved), is reported unschedulable again
    meanwhile (the scheduler retries before the device plugin advertises the slice): it waits
    for its slice, it does not join the batch or wake the planner, and new facts about the
    nodes do not put it in a batch either."""
    lp = PlanningLoop(settings())
    lp.written("n1", "p1", ["ml/held"], 0.0)
    lp.reserve("ml/kept", "n2", 0.0)
    for now in (1.0, 2.0):
        assert lp.pod_waiting("ml/held", now, "v1") is False
        assert lp.pod_waiting("ml/kept", now, "v1") is False
    lp.facts_changed(["ml/held", "ml/kept"], 3.0)
    lp.facts_changed(["ml/held", "ml/kept"], 3.0, at_once=True)
    assert lp.window.members == set() and lp.window.deadline() is None
    assert not lp.due(10.0, waiting=False)
    # the plan acknowledged: the pod's slice is reserved for it, it still waits for no plan
    lp.acknowledged("n1", "p1", 5.0)
    assert lp.pod_waiting("ml/held", 6.0) is False and lp.window.members == set()
    # its reservation lapsed: it waits for a plan again
    assert lp.reservations(21.0, lambda key: False) == {}
    assert lp.pod_waiting("ml/held", 21.0) is True and lp.pod_waiting("ml/kept", 21.0) is True


def test_a_pod_bound_leaves_the_batch_and_forgets_what_was_kept_for_it():
    """A pod bound (or deleted) leaves the batch: a batch it alone was in closes no round; its
    back-offs and version end with it, and the other pods' stay (a pod kept off node n1 still is
    when another pod binds)."""
    lp = PlanningLoop(settings())
    lp.pod_waiting("ml/a", 0.0, "v1")
    lp.pod_waiting("ml/b", 0.0, "v1")
    for key in ("ml/a", "ml/b"):
        lp.reserve(key, "n1", 0.0)
    lp.reservations(16.0, lambda key: False)
    assert lp.avoided(16.0) == {"ml/a": {"n1"}, "ml/b": {"n1"}}
    lp.pod_done("ml/a")
    assert lp.avoided(16.0) == {"ml/b": {"n1"}}
    assert set(lp.versions) == {"ml/b"} and set(lp.lapsed) == {"ml/b"}
    lp.window.close()
    lp.pod_waiting("ml/c", 20.0)
    lp.pod_done("ml/c")
    assert lp.window.deadline() is None and not lp.due(25.0, waiting=False)


def one_busy_gpu_for_a_whole_gpu_pod() -> tuple[PlanningLoop, Node, Snapshot]:
    """A loop draining after 100 s (one GPU at a time), n0 with one GPU a pod uses, and the
    snapshot of ml/big waiting for a whole GPU there."""
    lp = PlanningLoop(settings(drain_after_s=100.0, drain_max_gpus=1))
    busy = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[
        Gpu(index=0, mig=[MigInstance(profile="1g.10gb", start=0, used=True, pod="ml/x")])])
    return lp, busy, Snapshot(nodes=[busy], pending=[PendingPod(name="ml/big", resource="nvidia.com/mig-7g.80gb")])


def test_a_pod_recreated_under_a_bound_pods_name_waits_drain_after_s_before_draining():
    """A whole-GPU pod bound after waiting is done; a new pod of that name (a Job's next run,
    say) waits `drain_after_s` from when a round first sees it before GPUs are drained for it,
    not from when its predecessor was first seen."""
    lp, busy, snap = one_busy_gpu_for_a_whole_gpu_pod()
    lp.decide(lp.prepare(snap, 0.0), CAT)
    lp.pod_done("ml/big")  # bound elsewhere at 50 s
    lp.decide(lp.prepare(Snapshot(nodes=[busy], pending=[]), 50.0), CAT)
    lp.decide(lp.prepare(snap, 150.0), CAT)  # the new pod, first seen now
    assert lp.drains == {}
    lp.decide(lp.prepare(snap, 249.0), CAT)
    assert lp.drains == {}
    lp.decide(lp.prepare(snap, 250.0), CAT)
    assert list(lp.drains) == ["ml/big"]


def test_a_deleted_node_gives_back_only_what_it_held():
    """A node deleted: the pods reserved there and those its unacknowledged plan held wait for a
    plan again at once; reservations, drains, drain flags and back-offs on other nodes stand,
    and a node made later under its name is not avoided (it is a new node)."""
    lp = PlanningLoop(settings())
    lp.written("gone", "p1", ["ml/flying"], 0.0)
    lp.reserve("ml/there", "gone", 0.0)
    lp.reserve("ml/elsewhere", "stays", 0.0)
    for key, node in (("ml/x", "gone"), ("ml/x", "stays"), ("ml/y", "stays")):
        lp.avoid[(key, node)] = (100.0, 15.0)
    lp.drains = {"ml/big": Drain("ml/big", "gone", (0,)), "ml/huge": Drain("ml/huge", "stays", (1,))}
    lp.drain_flagged = {"gone": {0}, "stays": {1}}
    flight = lp.node_gone("gone", 5.0)
    assert flight is not None and flight.pods == {"ml/flying"}
    assert lp.window.members == {"ml/flying", "ml/there"}
    assert lp.reservations(5.0, lambda key: False) == {"ml/elsewhere": "stays"}
    assert lp.avoided(5.0) == {"ml/x": {"stays"}, "ml/y": {"stays"}}
    assert list(lp.drains) == ["ml/huge"] and lp.drain_flagged == {"stays": {1}}
    assert lp.held_nodes() == set()


def test_a_lost_lease_drops_the_drains_decided_as_leader():
    """Leadership lost: the drains this replica decided may be undone by the next leader's
    plans, so if it leads again it starts without them (no GPU kept out of its plans for a
    drain nobody flags) and decides drains afresh."""
    lp, busy, snap = one_busy_gpu_for_a_whole_gpu_pod()
    lp.decide(lp.prepare(snap, 0.0), CAT)
    lp.decide(lp.prepare(snap, 100.0), CAT)
    assert list(lp.drains) == ["ml/big"] and lp.drain_flagged == {"n0": {0}}
    lp.forget_leader_state()
    assert lp.drains == {} and lp.drain_flagged == {} and lp.reserved == {} and lp.in_flight == {}


def test_a_resync_round_runs_only_while_pods_wait():
    """`resync_s` after the last round a round runs again if pods still wait (in the batch or
    not), not before, and not at all on an idle cluster: no snapshot of every node is built
    every `resync_s` for nothing."""
    lp = PlanningLoop(settings())
    lp.begin_round(100.0)
    assert lp.next_due() == 130.0
    assert not lp.due(129.9, waiting=True)
    assert lp.due(130.0, waiting=True)
    assert not lp.due(130.0, waiting=False) and not lp.due(1000.0, waiting=False)
    lp.pod_waiting("ml/a", 110.0)
    assert lp.next_due() == 110.5, "the batch closes before the resync"
    lp.begin_round(110.5)
    assert lp.window.members == set() and lp.next_due() == 140.5
    for k in range(10):  # a batch that keeps growing closes batch_timeout_s after its first pod
        lp.pod_waiting(f"ml/b{k}", 120.0 + 0.4 * k)
    assert lp.next_due() == 123.0 and lp.due(123.0, waiting=False) and not lp.due(122.9, waiting=False)


def test_a_plan_is_given_up_only_after_ack_timeout_s_and_a_revocation_never():
    """A plan whose agent has not acknowledged it within `ack_timeout_s` is given up (its pods
    are planned again); one acknowledged in time is not; a revocation waits for its agent for
    ever. A reservation stands `reservation_s` after the acknowledgement, then lapses."""
    lp = PlanningLoop(settings(ack_timeout_s=60.0))
    lp.written("b", "p2", ["ml/b"], 10.0)
    lp.written("a", "p1", ["ml/a"], 0.0)
    lp.written("r", "p3", [], 0.0, revoking=True)
    assert lp.overdue(60.0) == []
    assert [(n, f.plan_id) for n, f in lp.overdue(60.1)] == [("a", "p1")]
    assert [n for n, _ in lp.overdue(70.1)] == ["a", "b"]
    assert lp.overdue(1e9) and "r" not in [n for n, _ in lp.overdue(1e9)]
    assert lp.acknowledged("b", "other", 20.0) is None and "b" in lp.held_nodes()
    flight = lp.acknowledged("b", "p2", 20.0)
    assert flight is not None and flight.pods == {"ml/b"} and lp.held_nodes() == {"a", "r"}
    assert lp.acknowledged("b", "p2", 21.0) is None, "acknowledged once"
    assert lp.reservations(35.0, lambda key: False) == {"ml/b": "b"}, "15 s after the acknowledgement"
    assert lp.avoided(35.0) == {}
    assert lp.reservations(35.1, lambda key: False) == {}
    assert lp.avoided(35.1) == {"ml/b": {"b"}}


def test_a_pod_is_kept_off_a_node_where_its_slice_was_not_taken_for_a_while_and_no_longer():
    """The node where a pod's reservation lapsed unbound is left out of its plans `reservation_s`
    (then twice as long each time), and planned again right after; with `reservation_s` 0 (no
    slice is kept for a pod) it is still left out for a second, not planned there again at once
    by the very next round. The back-off of one pod keeps no other pod off its node."""
    lp = PlanningLoop(settings())
    lp.reserve("ml/a", "n1", 0.0)
    lp.reserve("ml/b", "n2", 0.0)
    lp.reservations(16.0, lambda key: False)
    assert lp.avoided(30.9) == {"ml/a": {"n1"}, "ml/b": {"n2"}}
    assert lp.avoided(31.0) == {}
    lp.reserve("ml/a", "n3", 31.0)  # kept off n1 and n3 together: ml/b's n2 is untouched
    lp.reservations(47.0, lambda key: False)
    assert lp.avoided(61.9) == {"ml/a": {"n1", "n3"}}
    assert lp.avoid[("ml/b", "n2")][0] == 31.0
    no_keep = PlanningLoop(settings(reservation_s=0.0))
    no_keep.reserve("ml/a", "n1", 0.0)
    no_keep.reservations(0.5, lambda key: False)
    assert no_keep.avoided(0.5) == {"ml/a": {"n1"}} and no_keep.avoided(1.4) == {"ml/a": {"n1"}}
    assert no_keep.avoided(1.5) == {}


def test_a_pod_wide_back_off_names_each_node_once_and_keeps_them_off_past_it():
    """The pod-wide back-off (after POD_LAPSES lapses) is told with the nodes where the pod's
    reservations lapsed, each named once, and the nodes tried stay off the pod's plans until
    `reservation_s` past its end (the next plan tries a node not tried yet, then these again);
    with `reservation_s` 0 a second past it."""
    from dynpart.planner.loop import POD_BACKOFF_MIN_S

    for reservation_s, past in ((15.0, 15.0), (0.0, 1.0)):
        lp = PlanningLoop(settings(reservation_s=reservation_s))
        now = 0.0
        for node in ("n1", "n1", "n2"):
            lp.reserve("ml/a", node, now)
            now += reservation_s + 1.0
            lp.reservations(now, lambda key: False)
        [(key, b)] = lp.take_backoffs_started()
        assert key == "ml/a" and b.nodes == ["n1", "n2"] and b.lapses == 3 and b.delay == POD_BACKOFF_MIN_S
        assert b.until == now + POD_BACKOFF_MIN_S
        end = b.until + past
        assert lp.avoided(end - 0.01) == {"ml/a": {"n1", "n2"}}
        assert lp.avoided(end) == {}


def test_a_back_off_started_for_a_pod_bound_meanwhile_is_not_told():
    """A pod's pod-wide back-off starts, and the pod is bound (or deleted) before the controller
    posts its Event: nothing is told about it (and nothing fails)."""
    lp = PlanningLoop(settings())
    for k in range(3):
        lp.reserve("ml/a", f"n{k}", 16.0 * k)
        lp.reservations(16.0 * k + 16.0, lambda key: False)
    assert lp.backoffs_started == ["ml/a"]
    lp.pod_done("ml/a")
    assert lp.take_backoffs_started() == []
    assert lp.take_backoffs_started() == []


def test_reservations_whose_slices_went_to_other_pods_end_at_once():
    """The scheduler gave the slices made for reserved pods to other pods: on n1 (two 1g slices
    reported, one pod bound there) one reservation stands, the first by name, and the others end
    now and join the batch, with no back-off (n1 had the slices: another pod took them). On n2,
    which reports none of the slices its plan made and where no pod took one, the reservation
    ends and the pod is kept off n2 (the node lacks what it was planned). A node with no report,
    and whole GPUs (which a report of slices does not count), keep their reservations."""
    lp = PlanningLoop(settings())
    reserved = {"ml/c": "n1", "ml/b": "n1", "ml/a": "n1", "ml/d": "n2", "ml/e": "n3", "ml/w": "n2"}
    for key, node in reserved.items():
        lp.reserve(key, node, 0.0)
    requests = {**{k: {SMALL: 1} for k in ("ml/a", "ml/b", "ml/c", "ml/d", "ml/e")}, "ml/w": {"nvidia.com/gpu": 1}}
    bound = {("n1", SMALL): 1}
    slices = {"n1": {SMALL: 2}, "n2": {"nvidia.com/mig-2g.20gb": 1}}
    ended = lp.release_taken(reserved, requests, bound, slices, 5.0)
    assert ended == [("ml/b", "n1", SMALL), ("ml/c", "n1", SMALL), ("ml/d", "n2", SMALL)]
    assert reserved == {"ml/a": "n1", "ml/e": "n3", "ml/w": "n2"}
    assert lp.reservations(5.0, lambda key: False) == reserved
    assert lp.window.members == {"ml/b", "ml/c", "ml/d"} and lp.due(5.5, waiting=False)
    assert lp.avoided(5.0) == {"ml/d": {"n2"}}
    # nothing bound on n1 and its two slices reported: both reserved pods keep theirs
    lp2 = PlanningLoop(settings())
    two = {"ml/a": "n1", "ml/b": "n1"}
    for key in two:
        lp2.reserve(key, "n1", 0.0)
    assert lp2.release_taken(two, {k: {SMALL: 1} for k in two}, {}, {"n1": {SMALL: 2}}, 5.0) == []
    assert two == {"ml/a": "n1", "ml/b": "n1"}


def test_a_configured_workload_is_the_one_planned_for():
    """With `workload` set, the objective keeps room for that distribution whatever the pending
    pods ask (they are not learnt); without it, for the requests seen lately."""
    share = RequestShare(resource="nvidia.com/mig-3g.40gb", weight=2.0)
    pods = [PendingPod(name="ml/a", resource=SMALL)]
    lp = PlanningLoop(settings(workload=[share]))
    assert lp.prepare(Snapshot(nodes=[empty_node("a")], pending=pods), 0.0).workload == [share]
    learnt = PlanningLoop(settings())
    assert [s.resource for s in learnt.prepare(Snapshot(nodes=[empty_node("a")], pending=pods), 0.0).workload] == [SMALL]


def test_a_shorter_back_off_on_another_node_does_not_cut_a_longer_one_short():
    """The pod's reservation lapsed twice on n1 (kept off it 30 s); then n2, planned for it,
    turns out to lack the slice (ended at once, kept off 15 s): the nodes are kept off together
    at least as long as the latest, and n1 still for its own 30 s, not only until n2's ends."""
    lp = PlanningLoop(settings())
    lp.reserve("ml/a", "n1", 0.0)
    lp.reservations(16.0, lambda key: False)
    lp.reserve("ml/a", "n1", 31.0)
    lp.reservations(47.0, lambda key: False)
    assert lp.avoided(76.9) == {"ml/a": {"n1"}}
    reserved = {"ml/a": "n2"}
    lp.reserve("ml/a", "n2", 48.0)
    assert lp.release_taken(reserved, {"ml/a": {SMALL: 1}}, {}, {"n2": {}}, 49.0) == [("ml/a", "n2", SMALL)]
    assert lp.avoided(63.9) == {"ml/a": {"n1", "n2"}}
    assert lp.avoided(70.0) == {"ml/a": {"n1"}}
    assert lp.avoided(77.0) == {}


WHOLE = PendingPod(name="ml/big", resource="nvidia.com/mig-7g.80gb")


def mig_gpu(index: int, *used: tuple[str, int]) -> Gpu:
    return Gpu(index=index, mig=[MigInstance(profile=p, start=s, used=True, pod="ml/x") for p, s in used])


def draining_loop(drain_max_gpus: int = 1) -> PlanningLoop:
    return PlanningLoop(settings(drain_after_s=100.0, drain_max_gpus=drain_max_gpus))


def round_at(lp: PlanningLoop, nodes: list[Node], pending: list[PendingPod], now: float):
    return lp.decide(lp.prepare(Snapshot(nodes=nodes, pending=pending), now), CAT)


def test_a_drain_keeps_its_gpu_while_the_others_empty_faster():
    """GPUs drained for a whole-GPU pod stay drained while it waits: when pods end on another GPU
    so that it has less in use than the drained one, the drain does not move there (it would
    start again from nothing, and the first GPU, its flag cleared, fill up again)."""
    lp = draining_loop()
    before = [Node(name="n0", mode="mig", gpu_model="H100-80GB",
                   gpus=[mig_gpu(0, ("4g.40gb", 0)), mig_gpu(1, ("2g.20gb", 0))])]
    round_at(lp, before, [WHOLE], 0.0)
    round_at(lp, before, [WHOLE], 100.0)
    assert {k: (d.node, d.gpus) for k, d in lp.drains.items()} == {"ml/big": ("n0", (1,))}
    after = [Node(name="n0", mode="mig", gpu_model="H100-80GB",
                  gpus=[mig_gpu(0, ("1g.10gb", 0)), mig_gpu(1, ("2g.20gb", 0))])]
    result = round_at(lp, after, [WHOLE], 200.0)
    assert {k: (d.node, d.gpus) for k, d in lp.drains.items()} == {"ml/big": ("n0", (1,))}
    assert lp.drain_flagged == {"n0": {1}}
    assert not [g for lay in result.layouts for g in lay.gpus if g.index == 0 and g.drain]


def test_a_drain_on_a_node_no_longer_planned_gives_way_to_one_elsewhere():
    """The node GPUs were drained on is gone from the rounds' snapshots (nor applying a plan):
    its drain ends, and with the cap of one drained GPU free again the waiting pod drains on a
    node that is there. A node that is applying a plan (in flight) keeps its drain."""
    lp = draining_loop()
    n0 = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("1g.10gb", 0))])
    n1 = Node(name="n1", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("2g.20gb", 0))])
    round_at(lp, [n0, n1], [WHOLE], 0.0)
    round_at(lp, [n0, n1], [WHOLE], 100.0)
    assert [d.node for d in lp.drains.values()] == ["n0"]
    lp.written("n0", "p1", [], 150.0)  # n0 applies a plan: not in the snapshot, its drain stays
    round_at(lp, [n1], [WHOLE], 150.0)
    assert [d.node for d in lp.drains.values()] == ["n0"]
    lp.forget_node("n0")  # gone from the rounds without a deletion seen (left out of the snapshot)
    round_at(lp, [n1], [WHOLE], 200.0)
    assert [d.node for d in lp.drains.values()] == ["n1"]


def test_a_round_after_one_that_died_keeps_the_drains_of_a_node_back_under_its_name():
    """A planning thread died with an unexpected error (the controller logs it and goes on,
    neither committing nor abandoning its copy); a node deleted meanwhile comes back under its
    name. The next round's drains there are kept: only nodes deleted while that round's own copy
    is out are dropped at its commit."""
    lp = draining_loop()
    n0 = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("1g.10gb", 0))])
    round_at(lp, [n0], [WHOLE], 0.0)
    lp.drain_state()  # the round that dies
    lp.node_gone("n0", 50.0)
    round_at(lp, [n0], [WHOLE], 100.0)  # n0 is back
    assert [(d.node, d.gpus) for d in lp.drains.values()] == [("n0", (0,))]
    assert lp.drain_flagged == {"n0": {0}}


def test_a_round_planned_on_a_session_plans_the_sessions_cluster():
    """The packing simulation keeps one PlanningSession of its cluster and passes snapshots
    without nodes: the plan is made on the session's nodes."""
    from dynpart.planner.session import PlanningSession

    session = PlanningSession([empty_node("a")], CAT)
    lp = PlanningLoop(settings(), "dynpart", minimise_changes=False)
    pods = [PendingPod(name="ml/p", resource=SMALL)]
    result = lp.decide(lp.prepare(Snapshot(nodes=[], pending=pods), 0.0), CAT, session)
    assert [(pl.pod, pl.node) for pl in result.placements] == [("ml/p", "a")]


def test_a_whole_gpu_pod_placed_when_its_wait_is_over_drains_nothing():
    """A whole-GPU pod has waited `drain_after_s` when a GPU empties by itself: the round places
    it there and drains nothing for it (no GPU is drained for a pod the plan places, which would
    take that very GPU away from it), although a younger whole-GPU pod is left out."""
    lp = draining_loop(drain_max_gpus=2)
    busy = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("1g.10gb", 0)), mig_gpu(1, ("1g.10gb", 0))])
    round_at(lp, [busy], [WHOLE], 0.0)
    freed = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("1g.10gb", 0)), Gpu(index=1)])
    late = WHOLE.model_copy(update={"name": "ml/late"})
    result = round_at(lp, [freed], [WHOLE, late], 100.0)
    assert [(pl.pod, pl.slices[0].gpu) for pl in result.placements] == [("ml/big", 1)]
    assert [u.pod for u in result.unplaced] == ["ml/late"]
    assert lp.drains == {} and lp.drain_flagged == {}


def test_a_pod_drains_once_however_many_gpus_the_cap_allows():
    """A whole-GPU pod drains one GPU (its count) and keeps it while it empties: the rounds
    meanwhile drain no second GPU for it although `drain_max_gpus` would allow one."""
    lp = draining_loop(drain_max_gpus=2)
    busy = Node(name="n0", mode="mig", gpu_model="H100-80GB",
                gpus=[mig_gpu(0, ("1g.10gb", 0)), mig_gpu(1, ("2g.20gb", 0))])
    round_at(lp, [busy], [WHOLE], 0.0)
    for now in (100.0, 200.0, 300.0):
        round_at(lp, [busy], [WHOLE], now)
        assert {k: (d.node, d.gpus) for k, d in lp.drains.items()} == {"ml/big": ("n0", (0,))}, now
        assert lp.drain_flagged == {"n0": {0}}, now


def test_drains_wait_as_configured_and_only_for_dynparts_own_policy():
    """`drain_after_s` is any positive time (half a second drains after half a second); the
    simulator's baselines (nos, a static layout) never drain, however long a pod waits."""
    busy = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("1g.10gb", 0))])
    quick = PlanningLoop(settings(drain_after_s=0.5))
    round_at(quick, [busy], [WHOLE], 0.0)
    round_at(quick, [busy], [WHOLE], 0.5)
    assert list(quick.drains) == ["ml/big"]
    for policy in ("nos", "static"):
        lp = PlanningLoop(settings(drain_after_s=100.0), policy)
        round_at(lp, [busy], [WHOLE], 0.0)
        round_at(lp, [busy], [WHOLE], 1000.0)
        assert lp.drains == {} and lp.drain_flagged == {}, policy


def test_the_round_that_starts_a_drain_places_nothing_on_its_gpu():
    """The round in which a drain starts plans again without the drained GPU: the pod that would
    have taken its last free slice is not put there (the drain would wait for that pod to end
    too), and the GPU is flagged in the spec at once, its free slice destroyed."""
    lp = draining_loop()
    full = Gpu(index=0, mig=[MigInstance(profile="7g.80gb", start=0, used=True, pod="ml/x")])
    node = Node(name="n0", mode="mig", gpu_model="H100-80GB",
                gpus=[full, Gpu(index=1, mig=[MigInstance(profile="1g.10gb", start=4, used=True, pod="ml/y"),
                                              MigInstance(profile="3g.40gb", start=0)])])
    third = PendingPod(name="ml/small", resource="nvidia.com/mig-3g.40gb")
    round_at(lp, [node], [WHOLE], 0.0)
    result = round_at(lp, [node], [WHOLE, third], 100.0)
    assert [(k, d.gpus) for k, d in lp.drains.items()] == [("ml/big", (1,))]
    assert result.placements == [] and sorted(u.pod for u in result.unplaced) == ["ml/big", "ml/small"]
    [layout] = result.layouts
    [gpu] = [g for g in layout.gpus if g.index == 1]
    assert gpu.drain and [m.profile for m in gpu.mig] == ["1g.10gb"]
    assert lp.drain_flagged == {"n0": {1}}


def drained_then_sick(lp: PlanningLoop, others: list[Node]) -> Node:
    """GPU 1 of n0 drained for ml/big at 100 s; returns n0 as the rounds see it once its agent
    reports GPU 1 unhealthy (an Xid, a GPU lost: the snapshot leaves it out)."""
    free_3g = MigInstance(profile="3g.40gb", start=4)
    n0 = Node(name="n0", mode="mig", gpu_model="H100-80GB",
              gpus=[Gpu(index=0, mig=[MigInstance(profile="4g.40gb", start=0, used=True, pod="ml/x"), free_3g]),
                    mig_gpu(1, ("1g.10gb", 0))])
    round_at(lp, [n0, *others], [WHOLE], 0.0)
    round_at(lp, [n0, *others], [WHOLE], 100.0)
    assert [(d.node, d.gpus) for d in lp.drains.values()] == [("n0", (1,))] and lp.drain_flagged == {"n0": {1}}
    return n0.model_copy(update={"gpus": n0.gpus[:1]})


def test_a_drained_gpu_left_out_of_the_rounds_gives_way_to_one_on_its_node():
    """A drained GPU that its agent reports unhealthy is left out of the snapshot: the drain gives
    way to the node's GPU that can be planned, the spec written flags that one (and no longer the
    one left out), and once the pod is gone and the GPU back, the flag is cleared (else its agent
    would destroy every slice that frees there for ever)."""
    lp = draining_loop()
    sick = drained_then_sick(lp, [])
    result = round_at(lp, [sick], [WHOLE], 150.0)
    # the drain gives way to the node's GPU that can be planned (the test below); the spec written
    # names the snapshot's GPUs only (full_layout), so GPU 1 loses its flag
    [layout] = result.changed_nodes()
    assert [(g.index, g.drain) for g in layout.gpus] == [(0, True)]
    assert lp.drain_flagged == {"n0": {0}}
    back = sick.model_copy(update={"gpus": [sick.gpus[0], mig_gpu(1, ("1g.10gb", 0))]})
    result = round_at(lp, [back], [], 300.0)  # ml/big was bound elsewhere meanwhile
    [layout] = result.changed_nodes()
    assert [(g.index, g.drain) for g in layout.gpus] == [(0, False)]
    assert lp.drains == {} and lp.drain_flagged == {}


def test_a_drain_whose_gpu_turned_unhealthy_gives_way_to_one_elsewhere():
    """The GPU drained for a whole-GPU pod turns unhealthy and is left out of the rounds: the
    drain holds nothing any more, so it should end and the pod, which waited `drain_after_s`
    already, should drain a GPU that can be planned (n1's) rather than wait for ever for one
    that cannot. (It stayed: `_still_draining` found none of its GPUs and took it for an empty
    one, the pod was never planned there, `_start_drains` skipped a pod that had a drain, and its
    GPU counted under the cap.)"""
    lp = draining_loop()
    n1 = Node(name="n1", mode="mig", gpu_model="H100-80GB", gpus=[mig_gpu(0, ("2g.20gb", 0))])
    sick = drained_then_sick(lp, [n1])
    for now in (200.0, 300.0, 400.0):
        round_at(lp, [sick, n1], [WHOLE], now)
    assert [(d.node, d.gpus) for d in lp.drains.values()] == [("n1", (0,))]


def test_new_facts_about_a_waiting_pod_do_not_hold_its_batch_back():
    """A pod already in the batch that new facts (a slice freed, a plan applied) bring up again
    does not restart the idle wait: on a busy cluster facts arrive every few hundred ms, and the
    batch would close only at `batch_timeout_s`. The controller sleeps until the batch closes
    (`wait_s`), not a moment less or more."""
    lp = PlanningLoop(settings())
    lp.pod_waiting("ml/a", 0.0)
    lp.facts_changed(["ml/a"], 0.4)
    assert lp.window.deadline() == 0.5 and lp.due(0.5, waiting=False)
    assert lp.window.wait_s(0.2) == pytest.approx(0.3) and lp.window.wait_s(0.7) == 0.0


def test_pods_left_to_the_next_round_close_the_batch_at_the_first_of_them():
    """Pods a round left to the next (a conflict with an older pod it planned) close the batch
    at once when they join it; a later one does not put that off."""
    lp = PlanningLoop(settings(batch_idle_s=5.0, batch_timeout_s=30.0))
    lp.pod_waiting("ml/new", 0.0)
    lp.facts_changed(["ml/left1"], 1.0, at_once=True)
    lp.facts_changed(["ml/left2"], 2.0, at_once=True)
    assert lp.window.deadline() == 1.0 and lp.due(1.0, waiting=False)
    lp.begin_round(1.0)
    lp.pod_waiting("ml/next", 3.0)
    assert lp.window.deadline() == 8.0, "a new batch waits its idle time again"


def test_a_batch_closes_on_time_while_its_pods_come_and_go():
    """Pods bound or deleted while the batch waits leave it; the others' batch closes when it
    would have (its idle time from the last pod that joined, at most its timeout from the first);
    once the last is gone, a batch started later waits from its own first pod."""
    lp = PlanningLoop(settings())
    lp.pod_waiting("ml/a", 0.0)
    lp.pod_waiting("ml/b", 0.2)
    lp.pod_done("ml/a")
    assert lp.window.deadline() == pytest.approx(0.7) and lp.due(0.7, waiting=False)
    lp.pod_done("ml/b")
    assert lp.window.deadline() is None and lp.window.wait_s(1.0) is None
    lp.pod_waiting("ml/c", 10.0)
    assert lp.window.deadline() == 10.5 and not lp.due(10.4, waiting=False)
