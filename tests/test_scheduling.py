"""Kubernetes' node constraints as the kube-scheduler's filters apply them (dynpart/scheduling.py),
and `plan()` placing pods only where they hold: a slice made for a pod must be one the scheduler
can bind it to."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dynpart.catalog import Catalog, GpuModel
from dynpart.planner import plan
from dynpart.planner.drain import drain_target
from dynpart.scheduling import (
    UNSCHEDULABLE_KEY,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    Taint,
    Toleration,
    affinity_admits,
    tolerates,
    untolerated_taint,
)
from dynpart.snapshot import Gpu, MpsSlice, Node, PendingPod, Snapshot

T = Taint(key="team", value="a", effect="NoSchedule")


def test_toleration_matching():
    assert tolerates(Toleration(key="team", value="a", effect="NoSchedule"), T)
    assert tolerates(Toleration(key="team", value="a"), T)  # empty effect: every effect
    assert not tolerates(Toleration(key="team", value="b"), T)
    assert not tolerates(Toleration(key="team", value="a", effect="NoExecute"), T)
    assert tolerates(Toleration(key="team", operator="Exists"), T)
    assert tolerates(Toleration(operator="Exists"), T)  # empty key with Exists: every taint
    assert not tolerates(Toleration(key="other", operator="Exists"), T)
    with pytest.raises(ValidationError, match="empty key must use operator Exists"):
        Toleration(value="a")
    with pytest.raises(ValidationError, match="Exists takes no value"):
        Toleration(key="team", operator="Exists", value="a")


def test_which_taints_keep_a_pod_off():
    soft = Taint(key="busy", effect="PreferNoSchedule")
    assert untolerated_taint([soft], False, []) is None  # only ranks nodes
    assert untolerated_taint([soft, T], False, []) == T
    assert untolerated_taint([T], False, [Toleration(key="team", value="a")]) is None
    # a cordon keeps off every pod but those tolerating node.kubernetes.io/unschedulable
    assert untolerated_taint([], True, []) == Taint(key=UNSCHEDULABLE_KEY, effect="NoSchedule")
    assert untolerated_taint([], True, [Toleration(key=UNSCHEDULABLE_KEY, operator="Exists")]) is None


def _req(key: str, op: str, *values: str) -> NodeSelectorRequirement:
    return NodeSelectorRequirement(key=key, operator=op, values=values)  # type: ignore[arg-type]  # op is checked by pydantic


def test_required_node_affinity():
    labels = {"zone": "z1", "gen": "4"}
    assert affinity_admits([], labels, "n")  # no terms: any node
    assert not affinity_admits([NodeSelectorTerm()], labels, "n")  # an empty term matches nothing
    one = NodeSelectorTerm(match_expressions=(_req("zone", "In", "z1", "z2"), _req("gen", "Gt", "3")))
    assert affinity_admits([one], labels, "n") and not affinity_admits([one], {"zone": "z1", "gen": "3"}, "n")
    assert affinity_admits([NodeSelectorTerm(match_expressions=(_req("pool", "NotIn", "x"),))], labels, "n")
    assert affinity_admits([NodeSelectorTerm(match_expressions=(_req("pool", "DoesNotExist"),))], labels, "n")
    assert not affinity_admits([NodeSelectorTerm(match_expressions=(_req("gen", "Lt", "4"),))], labels, "n")
    assert not affinity_admits([NodeSelectorTerm(match_expressions=(_req("zone", "Gt", "1"),))], labels, "n")
    # Gt/Lt read labels as Go's strconv.ParseInt does: no `_`, no spaces, within int64
    gt = NodeSelectorTerm(match_expressions=(_req("gen", "Gt", "3"),))
    for label, admits in (("1_000", False), (" 5", False), ("+5", True), ("٥", False), (str(1 << 63), False),
                          (str((1 << 63) - 1), True)):
        assert affinity_admits([gt], {"gen": label}, "n") is admits, label
    with pytest.raises(ValidationError, match="needs an integer"):
        _req("gen", "Gt", "1_0")
    by_name = NodeSelectorTerm(match_fields=(_req("metadata.name", "In", "m"),))
    assert not affinity_admits([by_name], labels, "n") and affinity_admits([one, by_name], {}, "m")  # any term
    for bad, why in (({"key": "k", "operator": "In"}, "at least one value"),
                     ({"key": "k", "operator": "Exists", "values": ["x"]}, "takes no values"),
                     ({"key": "k", "operator": "Lt", "values": ["1", "2"]}, "exactly one value")):
        with pytest.raises(ValidationError, match=why):
            NodeSelectorRequirement(**bad)
    with pytest.raises(ValidationError, match="only metadata.name"):
        NodeSelectorTerm(match_fields=(_req("spec.unschedulable", "In", "true"),))


# --- plan() -----------------------------------------------------------------------------------

CAT = Catalog([GpuModel(name="G", memory_gb=16)])


def _node(name: str, zone: str = "z1", **extra) -> Node:  # type: ignore[no-untyped-def]
    return Node(name=name, mode="mps", gpu_model="G", labels={"zone": zone},
                gpus=[Gpu(index=0, mps=[MpsSlice(size=8, used=True)])], **extra)


def _node_of(result, pod: str) -> str | None:  # type: ignore[no-untyped-def]
    return next((p.node for p in result.placements if p.pod == pod), None)


def test_a_pod_goes_only_where_the_scheduler_would_bind_it():
    # n0 (first in order, otherwise the best) is cordoned, n1 tainted, n2 in another zone
    nodes = [_node("n0", unschedulable=True), _node("n1", taints=[T]), _node("n2", zone="z2"), _node("n3")]
    p = PendingPod(name="ml/p", resource="nvidia.com/gpu-8gb")
    assert _node_of(plan(Snapshot(nodes=nodes, pending=[p]), CAT), "ml/p") == "n2"
    away = p.model_copy(update={"node_affinity": [NodeSelectorTerm(match_expressions=(_req("zone", "NotIn", "z2"),))]})
    assert _node_of(plan(Snapshot(nodes=nodes, pending=[away]), CAT), "ml/p") == "n3"
    team = away.model_copy(update={"tolerations": [Toleration(key="team", operator="Exists")]})
    assert _node_of(plan(Snapshot(nodes=nodes, pending=[team]), CAT), "ml/p") == "n1"
    named = p.model_copy(update={"node_affinity": [NodeSelectorTerm(match_fields=(_req("metadata.name", "In", "n3"),))]})
    assert _node_of(plan(Snapshot(nodes=nodes, pending=[named]), CAT), "ml/p") == "n3"


def test_the_reason_names_the_taint_when_it_is_what_keeps_a_pod_off():
    result = plan(Snapshot(nodes=[_node("n0", unschedulable=True), _node("n1", taints=[T])],
                           pending=[PendingPod(name="ml/p", resource="nvidia.com/gpu-8gb")]), CAT)
    (unplaced,) = result.unplaced
    assert "cordoned or tainted" in unplaced.reason and UNSCHEDULABLE_KEY in unplaced.reason
    result = plan(Snapshot(nodes=[_node("n0")], pending=[PendingPod(name="ml/p", resource="nvidia.com/gpu-8gb",
                  node_affinity=[NodeSelectorTerm(match_expressions=(_req("zone", "In", "z9"),))])]), CAT)
    assert "required node affinity" in result.unplaced[0].reason


def test_a_drain_is_never_started_where_the_pod_could_not_run():
    whole = PendingPod(name="ml/big", resource="nvidia.com/gpu")
    snap = Snapshot(nodes=[_node("n0", taints=[T]), _node("n1", unschedulable=True)], pending=[whole])
    assert drain_target(snap, whole, CAT) is None
    assert drain_target(snap, whole.model_copy(update={"tolerations": [Toleration(key="team", value="a")]}), CAT).node == "n0"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_plans_respect_taints_cordons_and_affinity(seed):
    import random
    rng = random.Random(seed)
    taints = [Taint(key="team", value=v, effect=e) for v in ("a", "b") for e in ("NoSchedule", "NoExecute", "PreferNoSchedule")]
    nodes = [Node(name=f"n{i}", mode="mps", gpu_model="G", labels={"zone": rng.choice(["z1", "z2"]), "gen": str(rng.randint(1, 4))},
                  unschedulable=rng.random() < 0.2, taints=rng.sample(taints, k=rng.choice([0, 0, 1, 2])),
                  gpus=[Gpu(index=g, mps=[MpsSlice(size=rng.choice([4, 8]), used=True)] if rng.random() < 0.5 else [])
                        for g in range(rng.randint(1, 3))]) for i in range(rng.randint(1, 6))]
    tolerations = [Toleration(key="team", value="a"), Toleration(key="team", operator="Exists", effect="NoSchedule"),
                   Toleration(operator="Exists"), Toleration(key=UNSCHEDULABLE_KEY, operator="Exists")]
    terms = [NodeSelectorTerm(match_expressions=(_req("zone", "In", "z1"),)),
             NodeSelectorTerm(match_expressions=(_req("gen", "Gt", "2"), _req("zone", "NotIn", "z1"))),
             NodeSelectorTerm(match_fields=(_req("metadata.name", "NotIn", "n0", "n1"),))]
    pods = [PendingPod(name=f"ml/p{i}", resource=f"nvidia.com/gpu-{rng.choice([2, 4, 8])}gb",
                       tolerations=rng.sample(tolerations, k=rng.choice([0, 1, 2])),
                       node_affinity=rng.sample(terms, k=rng.choice([0, 0, 1, 2]))) for i in range(rng.randint(1, 12))]
    result = plan(Snapshot(nodes=nodes, pending=pods), CAT)
    by_name = {n.name: n for n in nodes}
    for placement in result.placements:
        n, p = by_name[placement.node], next(q for q in pods if q.name == placement.pod)
        assert untolerated_taint(n.taints, n.unschedulable, p.tolerations) is None
        assert affinity_admits(p.node_affinity, n.labels, n.name)
    # a pod left out while an admitting node had room for it would be a wrong filter: with one pod
    # alone, it is placed exactly when some node admits it and has the room
    for p in pods[:3]:
        alone = plan(Snapshot(nodes=nodes, pending=[p]), CAT)
        size = int(p.resource.split("-")[-1][:-2])
        fits = [n for n in nodes if untolerated_taint(n.taints, n.unschedulable, p.tolerations) is None
                and affinity_admits(p.node_affinity, n.labels, n.name)
                and any(16 - sum(s.size for s in g.mps if s.used) >= size for g in n.gpus)]
        assert bool(alone.placements) == bool(fits)
