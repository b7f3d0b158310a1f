"""Draining GPUs for a pod waiting for whole GPUs (planner/drain.py, PlanningLoop): it starts only
after `drain_after_s`, drains the GPUs with the least in use, marks them in the spec, plans
nothing else there, and plans the pod there once they are empty."""

from __future__ import annotations

import pytest

from dynpart.annotations import decode_spec, encode_spec
from dynpart.catalog import default_catalog
from dynpart.planner.drain import drain_target
from dynpart.planner.loop import PlanningLoop, node_writes
from dynpart.scheduling import Taint
from dynpart.settings import default_planner_settings
from dynpart.snapshot import Gpu, MigInstance, Node, PendingPod, Snapshot, full_layout

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")
WHOLE = PendingPod(name="ml/big", resource="nvidia.com/mig-7g.80gb", cpu_milli=1000)
SMALL = PendingPod(name="ml/small", resource="nvidia.com/mig-3g.40gb", cpu_milli=1000)


def gpu(index: int, *instances: tuple[str, int, bool]) -> Gpu:
    return Gpu(index=index, mig=[MigInstance(profile=p, start=s, used=u, pod="ml/x" if u else None)
                                 for p, s, u in instances])


def node(*gpus: Gpu) -> Node:
    return Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=list(gpus))


BUSY = node(gpu(0, ("4g.40gb", 0, True), ("3g.40gb", 4, False)),   # 4 of 8 memory slices in use
            gpu(1, ("3g.40gb", 0, False), ("1g.10gb", 4, True)))   # 1 of 8 in use: the one to drain


def loop(drain_after_s: float = 100.0, drain_max_gpus: int = 1) -> PlanningLoop:
    return PlanningLoop(default_planner_settings().model_copy(update={"drain_after_s": drain_after_s,
                                                                       "drain_max_gpus": drain_max_gpus}))


def round_at(lp: PlanningLoop, snap: Snapshot, now: float):
    return lp.decide(lp.prepare(snap, now), CAT)


def test_the_target_is_the_gpu_with_least_in_use():
    target = drain_target(Snapshot(nodes=[BUSY], pending=[WHOLE]), WHOLE, CAT)
    assert target is not None and (target.node, target.gpus) == ("n0", (1,))
    assert drain_target(Snapshot(nodes=[BUSY], pending=[SMALL]), SMALL, CAT) is None  # not a whole GPU
    assert drain_target(Snapshot(nodes=[BUSY], pending=[WHOLE]), WHOLE, CAT, taken={("n0", 1)}).gpus == (0,)


def test_a_drain_starts_after_drain_after_s_and_marks_the_spec():
    lp = loop()
    snap = Snapshot(nodes=[BUSY], pending=[WHOLE])
    first = round_at(lp, snap, 0.0)
    assert [u.pod for u in first.unplaced] == ["ml/big"] and not node_writes(first) and not lp.drains
    assert not node_writes(round_at(lp, snap, 99.0))  # not yet
    result = round_at(lp, snap, 100.0)
    [write] = node_writes(result)
    [drained] = write.layout.gpus
    assert drained.index == 1 and drained.drain and [(m.profile, m.used) for m in drained.mig] == [("1g.10gb", True)]
    spec = encode_spec(full_layout(BUSY, write.layout), "p1")
    assert spec["dynpart.io/spec-drain"] == "1"
    assert decode_spec(spec, H100).drain == (1,)
    # its agent destroyed the free 3g: a round with nothing new writes nothing, and plans nothing there
    draining = node(BUSY.gpus[0], gpu(1, ("1g.10gb", 4, True)))
    again = round_at(lp, Snapshot(nodes=[draining], pending=[WHOLE, SMALL]), 110.0)
    assert not [p for p in again.placements if p.slices[0].gpu == 1]
    assert [p.pod for p in again.placements] == ["ml/small"]  # on GPU 0's free 3g
    # the GPU empties: the pod waiting for it is planned there, and the flag goes
    empty = node(BUSY.gpus[0], gpu(1))
    done = round_at(lp, Snapshot(nodes=[empty], pending=[WHOLE]), 500.0)
    assert [(p.pod, p.slices[0].gpu) for p in done.placements] == [("ml/big", 1)]
    [write] = node_writes(done)
    assert not any(g.drain for g in write.layout.gpus)
    assert "dynpart.io/spec-drain" not in encode_spec(full_layout(empty, write.layout), "p2")
    round_at(lp, Snapshot(nodes=[empty], pending=[]), 510.0)
    assert not lp.drains and not lp.drain_flagged


def test_a_drain_ends_when_its_pod_goes_elsewhere_and_the_flag_is_cleared():
    lp = loop()
    snap = Snapshot(nodes=[BUSY], pending=[WHOLE])
    round_at(lp, snap, 0.0)
    round_at(lp, snap, 100.0)
    assert lp.drains
    draining = node(BUSY.gpus[0], gpu(1, ("1g.10gb", 4, True)))
    result = round_at(lp, Snapshot(nodes=[draining], pending=[]), 120.0)  # the pod was bound elsewhere
    [write] = node_writes(result)
    assert not lp.drains and not any(g.drain for g in write.layout.gpus)
    assert "dynpart.io/spec-drain" not in encode_spec(full_layout(draining, write.layout), "p2")


@pytest.mark.parametrize("barred", [
    {"unschedulable": True},  # kubectl cordon / drain
    {"taints": [Taint(key="ToBeDeletedByClusterAutoscaler", value="1", effect="NoSchedule")]},
    {"taints": [Taint(key="node.kubernetes.io/unreachable", effect="NoSchedule")]},
], ids=["cordoned", "autoscaler", "unreachable"])
def test_a_drain_gives_way_when_its_node_no_longer_admits_the_pod(barred):
    """helper-157: a drain on a node cordoned or tainted since it started was kept while its pod
    waited: the pod can never run there, and the drain held the drain_max_gpus cap, so no GPU
    was drained for it anywhere else."""
    def one(name: str, **kw) -> Node:
        return Node(name=name, mode="mig", gpu_model="H100-80GB", gpus=[gpu(0, ("1g.10gb", 0, True))], **kw)

    lp = loop()
    snap = Snapshot(nodes=[one("n0"), one("n1")], pending=[WHOLE])
    round_at(lp, snap, 0.0)
    round_at(lp, snap, 100.0)
    assert lp.drains["ml/big"].node == "n0"
    result = round_at(lp, Snapshot(nodes=[one("n0", **barred), one("n1")], pending=[WHOLE]), 200.0)
    assert lp.drains["ml/big"].node == "n1"  # drained where the pod may run
    writes = {w.layout.node: w.layout for w in node_writes(result)}
    assert [g.drain for g in writes["n1"].gpus] == [True]
    assert not any(g.drain for g in writes["n0"].gpus)  # the flag written away


def test_no_drain_when_disabled_or_for_small_pods():
    for lp, pods in ((loop(0.0), [WHOLE]), (loop(), [SMALL.model_copy(update={"count": 3})])):
        snap = Snapshot(nodes=[node(gpu(0, ("7g.80gb", 0, True)))], pending=pods)
        round_at(lp, snap, 0.0)
        assert not node_writes(round_at(lp, snap, 1000.0)) and not lp.drains


FOUR_BUSY = node(*(gpu(i, ("1g.10gb", 0, True)) for i in range(4)))  # no GPU empty: every whole-GPU pod waits


def whole(name: str, count: int = 1) -> PendingPod:
    return WHOLE.model_copy(update={"name": name, "count": count})


def drained_after_wait(lp: PlanningLoop, pending: list[PendingPod]) -> dict[str, tuple[int, ...]]:
    snap = Snapshot(nodes=[FOUR_BUSY], pending=pending)
    round_at(lp, snap, 0.0)
    round_at(lp, snap, 100.0)
    return {pod: d.gpus for pod, d in lp.drains.items()}


def test_drains_hold_at_most_drain_max_gpus_oldest_pod_first():
    pods = [whole("ml/a"), whole("ml/b"), whole("ml/c")]
    assert list(drained_after_wait(loop(drain_max_gpus=1), pods)) == ["ml/a"]
    two = drained_after_wait(loop(drain_max_gpus=2), pods)
    assert list(two) == ["ml/a", "ml/b"] and not set(two["ml/a"]) & set(two["ml/b"])
    assert len(drained_after_wait(loop(drain_max_gpus=4), pods)) == 3


def test_a_pod_asking_for_more_gpus_than_the_cap_drains_alone_and_none_overtakes_it():
    # no other drain: the 2-GPU pod gets its two GPUs although the cap is 1
    assert {k: len(v) for k, v in drained_after_wait(loop(drain_max_gpus=1), [whole("ml/pair", 2), whole("ml/one")]).items()} \
        == {"ml/pair": 2}
    # a drain holds a GPU: the older 2-GPU pod would pass the cap of 2, so the younger 1-GPU pod
    # (which would fit under it) waits behind it
    lp = loop(drain_max_gpus=2)
    assert list(drained_after_wait(lp, [whole("ml/first")])) == ["ml/first"]
    later = Snapshot(nodes=[FOUR_BUSY], pending=[whole("ml/first"), whole("ml/pair", 2), whole("ml/one")])
    round_at(lp, later, 150.0)
    round_at(lp, later, 300.0)
    assert list(lp.drains) == ["ml/first"]


def test_a_round_planned_from_a_copy_keeps_nothing_of_a_lost_lease_or_a_deleted_node():
    """The controller plans in a thread with a copy of the drains (`drain_state`, `decide_with`)
    and keeps what it decided (`commit`) only if the lease was not lost meanwhile, and without the
    drains of a node deleted meanwhile: the event loop may clear them while the thread plans."""
    lp = loop()
    snap = Snapshot(nodes=[BUSY], pending=[WHOLE])
    round_at(lp, snap, 0.0)
    prepared = lp.prepare(snap, 100.0)
    state = lp.drain_state()
    lp.forget_leader_state()  # the lease lost while the thread plans
    lp.decide_with(prepared, CAT, state)
    assert state.drains and not lp.commit(state) and not lp.drains and not lp.drain_flagged
    state = lp.drain_state()
    lp.decide_with(prepared, CAT, state)
    lp.node_gone("n0", 100.0)  # deleted while the thread plans
    assert lp.commit(state) and not lp.drains and not lp.drain_flagged
    state = lp.drain_state()
    lp.decide_with(prepared, CAT, state)
    assert lp.commit(state) and list(lp.drains) == ["ml/big"] and lp.drain_flagged == {"n0": {1}}
    # nodes deleted while no round's copy is out are not kept (a standby replica, a leader with
    # nothing pending: every node deleted in weeks would be)
    for k in range(100):
        lp.node_gone(f"spot-{k}", 200.0)
    assert not lp.gone_since
    state = lp.drain_state()
    lp.node_gone("n0", 300.0)
    assert lp.gone_since == {"n0"} and lp.commit(state) and not lp.gone_since
    # a round whose planning failed, or a lost lease, drops the copy: nothing is recorded after
    lp.drain_state()
    lp.abandon()
    lp.node_gone("n1", 400.0)
    lp.drain_state()
    lp.forget_leader_state()
    lp.node_gone("n2", 400.0)
    assert not lp.gone_since


def test_pods_kept_apart_never_drain_on_one_node():
    """Two whole-GPU pods that must not share a node (`apart`: anti-affinity on the hostname)
    could never both run where they drain: the second drains on another node, and none drains
    on a node where its partner is planned."""
    light = Node(name="n0", mode="mig", gpu_model="H100-80GB", gpus=[gpu(i, ("1g.10gb", 0, True)) for i in range(2)])
    heavy = Node(name="n1", mode="mig", gpu_model="H100-80GB", gpus=[gpu(i, ("4g.40gb", 0, True)) for i in range(2)])
    a = whole("ml/a").model_copy(update={"apart": ["ml/b"]})
    b = whole("ml/b").model_copy(update={"apart": ["ml/a"]})
    lp = loop(drain_max_gpus=2)
    snap = Snapshot(nodes=[light, heavy], pending=[a, b])
    round_at(lp, snap, 0.0)
    round_at(lp, snap, 100.0)
    assert {p: d.node for p, d in lp.drains.items()} == {"ml/a": "n0", "ml/b": "n1"}
    # without `apart`, both drain the lighter node (the GPUs with the least in use)
    lp = loop(drain_max_gpus=2)
    free = Snapshot(nodes=[light, heavy], pending=[whole("ml/a"), whole("ml/b")])
    round_at(lp, free, 0.0)
    round_at(lp, free, 100.0)
    assert {p: d.node for p, d in lp.drains.items()} == {"ml/a": "n0", "ml/b": "n0"}
    # a partner planned on a node this round: the other pod drains elsewhere
    empty = Node(name="n2", mode="mig", gpu_model="H100-80GB", gpus=[gpu(0), gpu(1, ("1g.10gb", 0, True))])
    lp = loop(drain_max_gpus=2)
    snap = Snapshot(nodes=[empty, heavy], pending=[b, a])
    round_at(lp, snap, 0.0)
    result = round_at(lp, snap, 100.0)
    assert [(p.pod, p.node) for p in result.placements] == [("ml/b", "n2")]
    assert {p: d.node for p, d in lp.drains.items()} == {"ml/a": "n1"}
