"""The controller's memory of what it wrote lives in the cluster: a new leader recovers the pods
planned onto unacknowledged nodes from the spec annotations; a spec from a deposed leader (an
older term) is not waited for; an unacknowledged plan is revoked before its pods go elsewhere;
a leader that cannot prove it leads writes nothing."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynpart.annotations import SPEC_PODS, SPEC_TERM, STATUS_HEARTBEAT, STATUS_PLAN, decode_spec, encode_status
from dynpart.catalog import default_catalog
from dynpart.kube.errors import APITransportError
from dynpart.planner import controller as controller_module
from dynpart.planner.cluster_view import build_snapshot, planned_patches
from dynpart.planner.controller import InFlight, PlannerController
from dynpart.planner.core import plan
from dynpart.settings import PlannerSettings
from dynpart.snapshot import GpuLayout, MigInstance, NodeLayout
from tests.controller.test_cluster_view import node, pod

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")


class Lead:
    def __init__(self, term: int, writes: bool = True):
        self.term, self.writes = term, writes

    def can_write(self) -> bool:
        return self.writes

    def write_time_left_s(self) -> float:
        return math.inf if self.writes else 0.0


def reported(name: str, spec: dict[str, str] | None = None, status_plan: str | None = "p0") -> dict[str, Any]:
    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0, used=True)])]), status_plan)
    return node(name, annotations={**status, **(spec or {})})


@pytest.fixture
def make(monkeypatch):
    written: list[tuple[str, dict[str, str | None]]] = []
    events: list[tuple[str, str]] = []

    async def fake_patch(core, name, patch, resource_version=None):
        written.append((name, patch))
        return {}

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    server: dict[str, dict[str, Any]] = {}  # what a GET answers (default: the cache)

    def build(nodes: list[dict[str, Any]], lead: Lead, ack_timeout_s: float = 60.0) -> PlannerController:
        c = PlannerController(client.ApiClient(), PlannerSettings(ack_timeout_s=ack_timeout_s), CAT, leadership=lead)
        c.nodes.cache.update({n["metadata"]["name"]: n for n in nodes})

        async def event(obj, reason, message, warning=False):
            events.append((reason, message))
        c._event = event  # type: ignore[method-assign]  # records instead of posting
        c.written, c.posted = written, events  # type: ignore[attr-defined]  # the test reads them
        c.server = server  # type: ignore[attr-defined]  # the test sets it

        async def fake_read(core, name):
            return server.get(name) or c.nodes.cache[name]
        monkeypatch.setattr(controller_module, "read_node", fake_read)
        return c
    return build


# p1 puts ml/a on a second 1g.10gb beside the used one the agent reports; not acknowledged yet
UNACKED = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
           SPEC_TERM: "3", SPEC_PODS: "ml/a"}


def test_the_spec_carries_the_term_and_the_planned_pods():
    view = build_snapshot([reported("n1")], [pod("a", {"nvidia.com/mig-3g.40gb": "1"})], CAT)
    result = plan(view.snapshot, view.catalog)
    [(_, patch)] = planned_patches(view.snapshot, result, {"n1": reported("n1")}, "p1", term=4)
    spec = decode_spec({k: v for k, v in patch.items() if v is not None}, H100)
    assert (spec.term, spec.pods, spec.problems) == (4, ("ml/a",), [])


async def test_a_new_leader_holds_the_pods_of_unacknowledged_plans(make):
    spec = {"dynpart.io/spec-plan": "p1", SPEC_TERM: "3", SPEC_PODS: "ml/a,ml/b"}
    c = make([reported("n1", spec), reported("n2")], Lead(term=3))
    assert c._awaiting_from_annotations() == {"n1"}
    assert c.in_flight["n1"].pods == {"ml/a", "ml/b"}
    held = set().union(*(f.pods for f in c.in_flight.values()))
    view = build_snapshot(list(c.nodes.cache.values()),
                          [pod("a", {"nvidia.com/mig-1g.10gb": "1"}), pod("c", {"nvidia.com/mig-1g.10gb": "1"})],
                          CAT, {"n1"}, held)
    assert [p.name for p in view.snapshot.pending] == ["ml/c"], "ml/a is never planned a second time"


async def test_an_earlier_leaders_unacknowledged_spec_is_adopted(make):
    """Agents refuse a spec of an older term (fencing): the new leader rewrites its term, nothing
    else, so that the plan is applied and its pods stay held where they were planned."""
    spec = {"dynpart.io/spec-plan": "late", SPEC_TERM: "2", SPEC_PODS: "ml/a"}
    c = make([reported("n1", spec)], Lead(term=3))
    assert c._awaiting_from_annotations() == {"n1"} and c.in_flight["n1"].pods == {"ml/a"}
    await c._adopt()
    assert c.written == [("n1", {SPEC_TERM: "3"})]
    c.nodes.cache["n1"] = reported("n1", {**spec, SPEC_TERM: "3"})
    c._awaiting_from_annotations()
    await c._adopt()
    assert len(c.written) == 1, "adopted once"


async def test_an_unacknowledged_plan_is_revoked_before_its_pods_are_planned_again(make):
    spec = UNACKED
    c = make([reported("n1", spec)], Lead(term=3), ack_timeout_s=1.0)
    c.in_flight["n1"] = InFlight("p1", 0.0, {"ml/a"})
    await c._expire_acks(now=10.0)
    [(name, patch)] = c.written
    new = decode_spec({**spec, **{k: v for k, v in patch.items() if v is not None}}
                      | {k: None for k, v in patch.items() if v is None}, H100)  # type: ignore[dict-item]  # None removes
    assert name == "n1" and patch[SPEC_PODS] is None and patch["dynpart.io/spec-gpu-0-1g.10gb"] == "1@0"
    assert new.pods == () and new.term == 3 and patch["dynpart.io/spec-revokes"] == "p1"
    assert c.in_flight["n1"].revoking and c.in_flight["n1"].pods == set()
    assert "ml/a" in c.window.members and [r for r, _ in c.posted] == ["PlanNotApplied", "PlanRevoked"]
    assert "did not apply that plan within 1 s" in c.posted[0][1]
    await c._expire_acks(now=100.0)  # the revocation is not acknowledged either: nothing more is written
    assert len(c.written) == 1


def _applied(node_obj: dict[str, Any], patch: dict[str, str | None]) -> dict[str, str]:
    ann = dict(node_obj["metadata"]["annotations"])
    for k, v in patch.items():
        if v is None:
            ann.pop(k, None)
        else:
            ann[k] = v
    return ann


async def test_a_revocation_its_agent_can_never_hold_is_written_again_from_its_report(make):
    """helper-157: the agent carved p1's 1g@1 and went down before reporting it; the revocation
    (its last report: 1g@0) was written, and the scheduler bound a pod to 1g@1 meanwhile. Back, the
    agent reports both used: it never destroys a used slice, so it could never hold the revocation,
    and the node stayed out of every round while that pod ran. Now the revocation is written again
    from the report as it is, once; an agent silent since gets nothing new."""
    spec = UNACKED
    c = make([reported("n1", spec)], Lead(term=3), ack_timeout_s=60.0)
    c.in_flight["n1"] = InFlight("p1", 0.0, {"ml/a"})
    await c._expire_acks(now=61.0)
    [(_, revocation)] = c.written
    assert revocation["dynpart.io/spec-gpu-0-1g.10gb"] == "1@0"
    revoked = node("n1", annotations=_applied(c.nodes.cache["n1"], revocation))
    c.nodes.cache["n1"] = revoked
    await c._expire_acks(now=200.0)  # the agent is silent: its report is what the revocation asks
    assert len(c.written) == 1 and c.in_flight["n1"].revoking
    both = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0, used=True), MigInstance(profile="1g.10gb", start=1, used=True)])]),
        "p0", ["plan is not acknowledged yet: the GPUs do not hold it"])
    back = node("n1", annotations={**revoked["metadata"]["annotations"], **both})
    c.nodes.cache["n1"] = back
    c._on_node("MODIFIED", back)
    await c._expire_acks(now=230.0)  # not yet ack_timeout_s since it was last compared (200 s)
    assert len(c.written) == 1
    await c._expire_acks(now=261.0)
    assert len(c.written) == 2
    again = c.written[1][1]
    assert again["dynpart.io/spec-gpu-0-1g.10gb"] == "2@0,1" and again["dynpart.io/spec-revokes"] == revocation[
        "dynpart.io/spec-plan"]
    assert c.in_flight["n1"].revoking and c.in_flight["n1"].plan_id == again["dynpart.io/spec-plan"]
    assert [r for r, _ in c.posted][-1] == "PlanRevoked"
    held = node("n1", annotations={**_applied(back, again), STATUS_PLAN: again["dynpart.io/spec-plan"]})
    c.nodes.cache["n1"] = held
    c._on_node("MODIFIED", held)
    assert "n1" not in c.in_flight and "n1" not in c._awaiting_from_annotations()
    await c._expire_acks(now=1000.0)
    assert len(c.written) == 2


async def test_a_leader_that_cannot_prove_it_leads_writes_nothing(make):
    c = make([reported("n1")], Lead(term=3, writes=False))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert c.written == [] and c.in_flight == {}
    c.leadership = Lead(term=3)
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1"] and c.written[0][1][SPEC_TERM] == "3"


def test_a_reserved_pod_keeps_the_slice_made_for_it_until_it_is_bound():
    """After its node acknowledged the plan, a pod waits for the scheduler: the free slice made for
    it is counted as its (not destroyed, not given away) and the pod is not planned again."""
    free = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="3g.40gb", start=0)])]), "p1")
    n1 = node("n1", annotations=free)
    waiting = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    other = pod("b", {"nvidia.com/mig-7g.80gb": "1"}, nodeSelector={"kubernetes.io/hostname": "n1"})
    n1["metadata"]["labels"]["kubernetes.io/hostname"] = "n1"
    view = build_snapshot([n1], [waiting, other], CAT, reserved={"ml/a": "n1"})
    assert [p.name for p in view.snapshot.pending] == ["ml/b"]
    assert view.snapshot.nodes[0].gpus[0].mig[0].used, "the slice made for ml/a is protected"
    result = plan(view.snapshot, view.catalog)
    assert all(g.destroyed == 0 for layout in result.layouts for g in layout.gpus if g.index == 0)
    # without the reservation, ml/a would be planned again and the 7g pod would take GPU 0 or 1
    again = build_snapshot([n1], [waiting, other], CAT)
    assert sorted(p.name for p in again.snapshot.pending) == ["ml/a", "ml/b"]


async def test_a_new_leader_reserves_the_pods_of_acknowledged_plans_not_yet_bound(make):
    """It never saw the acknowledgement: the spec's pods tell it which pods the slices are for."""
    spec = {"dynpart.io/spec-plan": "p0", SPEC_PODS: "ml/a,ml/gone,ml/bound"}
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[  # ml/bound's, ml/a's
        MigInstance(profile="1g.10gb", start=0, used=True), MigInstance(profile="1g.10gb", start=1)])]), "p0")
    c = make([node("n1", annotations={**status, **spec})], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    c.pods.cache["ml/bound"] = pod("bound", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Running")
    assert c._reservations() == {"ml/a": "n1"}
    c.reserved["ml/a"] = ("n1", 0.0)  # expired
    assert c._reservations() == {}, "once per plan: an expired reservation is not renewed"


async def test_a_reservation_whose_slice_another_pod_took_ends_at_once(make):
    """n1's agent reports one 1g.10gb (the acknowledged plan's). When the scheduler bound ml/x there,
    nothing is left for ml/a, reserved on n1: its reservation ends now and it joins the batch, rather
    than waiting reservation_s. While the slice is free the reservation holds."""
    import time as _time

    c = make([reported("n1")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    until = _time.monotonic() + c.settings.reservation_s
    c.reserved["ml/a"] = ("n1", until)
    assert c._reservations() == {"ml/a": "n1"}, "the slice is free: the reservation holds"
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Pending")
    assert c._reservations() == {} and "ml/a" in c.window.members
    # a pod bound for another resource, or one that finished, takes nothing
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Succeeded")
    c.pods.cache["ml/y"] = pod("y", {"nvidia.com/mig-2g.20gb": "1"}, node="n1", phase="Running")
    c.reserved["ml/a"] = ("n1", until)
    assert c._reservations() == {"ml/a": "n1"}


async def test_only_the_reservations_beyond_the_free_slices_end(make):
    """Two 1g.10gb reported on n1, two pods reserved there, one other pod bound there: one
    reservation stays (the first by name), the other ends."""
    import time as _time

    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0), MigInstance(profile="1g.10gb", start=1)])]), "p0")
    c = make([node("n1", annotations=status)], Lead(term=3))
    until = _time.monotonic() + c.settings.reservation_s
    for name in ("a", "b"):
        c.pods.cache[f"ml/{name}"] = pod(name, {"nvidia.com/mig-1g.10gb": "1"})
        c.reserved[f"ml/{name}"] = ("n1", until)
    assert c._reservations() == {"ml/a": "n1", "ml/b": "n1"}
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Running")
    assert c._reservations() == {"ml/a": "n1"} and "ml/b" in c.window.members


def replaced_by_another_leader(term: int = 5) -> dict[str, Any]:
    """n1 after another leader revoked this replica's p1 (acknowledged as r5) and wrote p2 for
    ml/b, not yet applied."""
    return reported("n1", {"dynpart.io/spec-plan": "p2", "dynpart.io/spec-mode": "mig", SPEC_TERM: str(term),
                           SPEC_PODS: "ml/b"}, status_plan="r5")


async def test_a_replica_that_leads_again_starts_from_the_annotations(make):
    """What it wrote and reserved in its earlier term is forgotten when it loses the lease: it
    neither revokes the other leader's plan nor posts PlanNotApplied, it adopts that plan."""
    lead = Lead(term=4)
    c = make([reported("n1")], lead)
    c.set_leading(True)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.reserved["ml/x"], c._reserved_for["ml/x"] = ("n1", float("inf")), "p0"
    c.set_leading(False)
    assert c.in_flight == {} and c.reserved == {} and c._reserved_for == {}
    c.nodes.cache["n1"] = replaced_by_another_leader()
    lead.term = 6
    c.set_leading(True)
    await c._expire_acks(now=1000.0)
    assert c.written == [] and c.posted == []
    assert c._awaiting_from_annotations() == {"n1"} and c.in_flight["n1"].pods == {"ml/b"}
    await c._adopt()
    assert c.written == [("n1", {SPEC_TERM: "6"})]


async def test_a_new_term_unseen_as_a_loss_drops_the_old_state_too(make):
    """The event loop stalled past the lease, which was taken over and handed back: the elector
    never reported a loss, but the term changed."""
    lead = Lead(term=4)
    c = make([reported("n1")], lead)
    await c._expire_acks(now=0.0)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.nodes.cache["n1"] = replaced_by_another_leader()
    lead.term = 6
    await c._expire_acks(now=1000.0)
    assert c.written == [] and c.posted == [] and "n1" not in c.in_flight


async def test_a_plan_in_flight_that_another_writer_replaced_is_not_revoked(make):
    c = make([reported("n1")], Lead(term=5))
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.nodes.cache["n1"] = replaced_by_another_leader()
    await c._expire_acks(now=1000.0)
    assert c.written == [] and "n1" not in c.in_flight and "ml/a" in c.window.members
    assert c._awaiting_from_annotations() == {"n1"} and c.in_flight["n1"].plan_id == "p2"


async def test_a_plan_replaced_only_in_a_stale_cache_is_neither_released_nor_revoked(make):
    """The node watch lags: the cache shows another spec, the API server still has ours. Released
    on the cache's word, its pods would be planned elsewhere while the agent may still apply our
    plan: it is revoked as any overdue plan is, from the node as the API server has it."""
    c = make([reported("n1")], Lead(term=5))
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.server["n1"] = reported("n1", {"dynpart.io/spec-plan": "p1", SPEC_TERM: "5", SPEC_PODS: "ml/a"})
    c.nodes.cache["n1"] = replaced_by_another_leader()
    await c._expire_acks(now=1000.0)
    ((name, patch),) = c.written
    assert name == "n1" and patch["dynpart.io/spec-revokes"] == "p1" and c.in_flight["n1"].revoking


async def test_an_acknowledgement_seen_before_the_write_returned_counts(make, monkeypatch):
    """The node watch delivers the agent's acknowledgement while plan_round still awaits the
    patch's response: the plan is acknowledged once recorded, not held and then revoked."""
    c = make([reported("n1")], Lead(term=3))

    async def acked_at_once(core, name, patch, resource_version=None):
        c.written.append((name, patch))
        old = c.nodes.cache[name]
        ann = {**old["metadata"]["annotations"], **{k: v for k, v in patch.items() if v is not None},
               "dynpart.io/status-plan": patch["dynpart.io/spec-plan"]}
        acked = {**old, "metadata": {**old["metadata"], "annotations": ann}}
        c.nodes.cache[name] = acked
        c._on_node("MODIFIED", acked)  # handled before the response is read: nothing in flight yet
        return {}
    monkeypatch.setattr(controller_module, "patch_node_annotations", acked_at_once)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1"]
    assert c.in_flight == {} and c.reserved["ml/a"][0] == "n1"
    await c._expire_acks(now=c.clock() + 1000.0)
    assert len(c.written) == 1 and "PlanNotApplied" not in [r for r, _ in c.posted]


def unreadable(spec: dict[str, str]) -> dict[str, Any]:
    """n1 taken out of dynpart (label off) with a plan its agent never acknowledged."""
    n1 = reported("n1", spec)
    n1["metadata"]["labels"]["dynpart.io/gpu-partitioning"] = "off"
    return n1


async def test_the_pods_of_a_plan_on_a_node_that_cannot_be_read_are_not_held(make):
    spec = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mig", SPEC_TERM: "3", SPEC_PODS: "ml/a"}
    c = make([unreadable(spec), reported("n2")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    assert "n1" in c._awaiting_from_annotations() and "ml/a" not in c.loop.held_pods()
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n2"] and c.written[0][1][SPEC_PODS] == "ml/a"


async def test_a_plan_in_flight_on_a_node_that_became_unreadable_is_given_up(make):
    """Nothing can revoke it (the node's layout cannot be read): after ack_timeout_s its pods are
    planned again, with PlanNotApplied, and not held again from the spec."""
    spec = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mig", SPEC_TERM: "3", SPEC_PODS: "ml/a"}
    c = make([unreadable(spec), reported("n2")], Lead(term=3), ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    await c._expire_acks(now=10.0)
    assert c.written == [] and "n1" not in c.in_flight and "ml/a" in c.window.members
    assert [r for r, _ in c.posted] == ["PlanNotApplied"] and "can no longer be planned" in c.posted[0][1]
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n2"]


async def test_a_relabelled_node_is_switched_before_it_is_planned(make):
    """n1 relabelled mig -> mps while its acknowledged spec is MIG (which its agent follows): a
    spec of the new mode, with no slices and no pods, moves its agent; pods are planned there
    only once it reports MPS mode."""
    spec = {"dynpart.io/spec-plan": "p0", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0"}
    n1 = reported("n1", spec)
    n1["metadata"]["labels"]["dynpart.io/gpu-partitioning"] = "mps"
    c = make([n1], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/gpu-10gb": "1"}, hostIPC=True)
    await c.plan_round()
    [(name, patch)] = c.written
    assert name == "n1" and patch["dynpart.io/spec-mode"] == "mps" and SPEC_PODS not in patch
    assert patch["dynpart.io/spec-gpu-0-1g.10gb"] is None and c.in_flight["n1"].pods == set()
    assert [r for r, _ in c.posted][:2] == ["DynpartInvalid", "ModeSwitch"]
    await c.plan_round()
    assert len(c.written) == 1, "in flight: written once"
    # its agent applied it: MPS mode, its GPUs out of MIG mode
    status = encode_status(NodeLayout(node="n1", mode="mps", gpus=[GpuLayout(index=0)]), patch["dynpart.io/spec-plan"])
    switched = node("n1", mode="mps", annotations={**{k: v for k, v in patch.items() if v is not None}, **status})
    c.nodes.cache["n1"] = switched
    c._on_node("MODIFIED", switched)
    assert c.in_flight == {}
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1", "n1"] and c.written[1][1][SPEC_PODS] == "ml/a"


async def test_a_pod_not_bound_on_the_free_slice_kept_for_it_is_planned_elsewhere(make):
    """n1's agent reports a free 1g.10gb that the scheduler does not give the pod (a constraint
    dynpart does not model): once its reservation ends unbound, the next plans leave n1 out for
    that pod for a while (reservation_s, then doubling), and n2, with an empty GPU, gets it."""
    t = [1000.0]
    free = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0), MigInstance(profile="3g.40gb", start=4, used=True)])]), "p0")
    n2 = node("n2", count=1, annotations=encode_status(NodeLayout(node="n2", mode="mig", gpus=[GpuLayout(index=0)]), "q0"))
    c = make([node("n1", count=1, annotations=free), n2], Lead(term=3))
    c.clock = lambda: t[0]
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    await c.plan_round()
    assert c.reserved["ml/a"][0] == "n1" and c.written == []
    t[0] += c.settings.reservation_s + c.settings.resync_s  # never bound
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n2"] and c.written[0][1][SPEC_PODS] == "ml/a"
    assert c.loop.avoided(t[0]) == {"ml/a": {"n1"}}
    assert c.loop.avoided(t[0] + c.settings.reservation_s + 1) == {}, "for a while only"


def test_the_back_off_doubles_up_to_a_cap_and_ends_when_the_pod_is_bound():
    from dynpart.planner.loop import AVOID_MAX_S, PlanningLoop

    loop = PlanningLoop(PlannerSettings(reservation_s=15.0))
    now, delays = 0.0, []
    for _ in range(8):
        loop.reserve("ml/a", "n1", now)
        now += 16.0
        loop.reservations(now, lambda key: False)
        until, delay = loop.avoid[("ml/a", "n1")]
        delays.append(delay)
        now = until
    assert delays == [15.0, 30.0, 60.0, 120.0, 240.0, 480.0, AVOID_MAX_S, AVOID_MAX_S]
    loop.pod_done("ml/a")
    assert loop.avoid == {}
    loop.reserve("ml/b", "n1", 0.0)
    loop.reservations(1.0, lambda key: True)
    assert loop.avoid == {}, "bound in time: nothing to avoid"


async def test_an_unexpected_error_in_a_step_is_logged_and_the_loop_goes_on(make, monkeypatch, caplog):
    """A bug that some cluster object triggers (any exception, not a DynpartError) must not end
    the planner: a crash loop would not plan the other pods either."""
    import asyncio

    c = make([], Lead(1))
    for informer in (c.nodes, c.pods, c.claims, c.volumes):
        informer.synced.set()
        monkeypatch.setattr(informer, "run", asyncio.Event().wait)
    steps = []

    async def step() -> None:
        steps.append(1)
        if len(steps) == 1:
            raise KeyError("a field some object lacks")
        if len(steps) == 3:
            raise asyncio.CancelledError

    c._step = step  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await c.run()
    assert len(steps) == 3
    assert "planning step failed" in caplog.text and "a field some object lacks" in caplog.text


async def test_claims_and_volumes_that_cannot_be_listed_hold_nothing_back(make, monkeypatch):
    """An RBAC of the cluster's own that leaves claims, volumes and storage classes out: the
    planner plans all the same (without narrowing by volume), and their watches do not fail the
    liveness probe."""
    import asyncio

    c = make([], Lead(1))
    for informer in (c.nodes, c.pods):
        informer.synced.set()
        monkeypatch.setattr(informer, "run", asyncio.Event().wait)
    for informer in (c.claims, c.volumes, c.classes):  # listing them fails for ever (never synced)
        monkeypatch.setattr(informer, "run", asyncio.Event().wait)
    steps = []

    async def step() -> None:
        steps.append(1)
        if len(steps) == 2:
            raise asyncio.CancelledError

    c._step = step  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await c.run()
    assert len(steps) == 2, "planning started without them"
    assert not c.liveness.stale() and "watch claims" not in c.liveness._max_age
    assert "watch storage classes" not in c.liveness._max_age


async def test_a_whole_gpu_pod_keeps_its_reservation_after_the_acknowledgement(monkeypatch):
    """A node's report counts its slices, not its whole GPUs: a pod planned onto a whole GPU must
    not lose its reservation (and be backed off the node, and planned onto another) as soon as
    the node acknowledges, while the scheduler has not bound it yet."""
    from dynpart.annotations import SPEC_PLAN
    from dynpart.snapshot import MpsSlice

    written: list[tuple[str, dict[str, str | None]]] = []
    t = [1000.0]

    def mps_node(name: str) -> dict[str, Any]:
        status = encode_status(NodeLayout(node=name, mode="mps", gpus=[GpuLayout(index=0, mps=[MpsSlice(size=10)])]),
                               "p0")
        return node(name, mode="mps", count=1, annotations={**status, SPEC_PLAN: "p0"})

    c = PlannerController(client.ApiClient(), PlannerSettings(), CAT, leadership=Lead(1))

    async def fake_patch(core, name, patch, resource_version=None):
        written.append((name, dict(patch)))
        ann = c.nodes.cache[name]["metadata"]["annotations"]
        for k, v in patch.items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v
        return {}

    async def event(obj, reason, message, warning=False):
        pass

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    c._event = event  # type: ignore[method-assign]
    c.nodes.cache.update({"n1": mps_node("n1"), "n2": mps_node("n2")})
    c.pods.cache["ml/w"] = pod("w", {"nvidia.com/gpu": "1"})
    await c.plan_round()
    ((target, patch),) = written
    ann = c.nodes.cache[target]["metadata"]["annotations"]
    for k in [k for k in ann if k.startswith("dynpart.io/status")]:
        del ann[k]
    ann.update(encode_status(NodeLayout(node=target, mode="mps", gpus=[GpuLayout(index=0)]), patch[SPEC_PLAN]))
    t[0] += 2
    c._on_node("MODIFIED", c.nodes.cache[target])  # acknowledged: the GPU is whole, the pod reserved there
    assert c.loop.reserved.get("ml/w", ("",))[0] == target
    written.clear()
    t[0] += 1  # the scheduler has not bound it yet
    await c.plan_round()
    assert written == [] and c.loop.reserved["ml/w"][0] == target and not c.loop.avoid


async def test_a_pod_kept_off_its_only_node_is_told_why(make):
    """One node: when the back-off keeps the pod off it, the Unplaceable Event names dynpart's
    back-off, not only an affinity the pod never had."""
    t = [1000.0]
    free = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0), MigInstance(profile="3g.40gb", start=4, used=True)])]), "p0")
    c = make([node("n1", count=1, annotations=free)], Lead(term=3))
    c.clock = lambda: t[0]
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    await c.plan_round()
    t[0] += c.settings.reservation_s + c.settings.resync_s  # never bound
    await c.plan_round()
    (message,) = [m for r, m in c.posted if r == "Unplaceable"]
    assert "dynpart keeps it off node(s) n1 for a while" in message, message


async def test_a_spec_write_that_would_land_after_the_leadership_proof_is_abandoned(make, monkeypatch):
    """A write answered after the time this replica can still prove it leads is abandoned (and
    fails as a transport error, which every write site handles): landing later, it could land
    after a standby took over and adopted it as an earlier leader's spec."""
    c = make([reported("n1")], Lead(term=3))

    class Expiring(Lead):
        def write_time_left_s(self) -> float:
            return 0.2

    c.leadership = Expiring(term=3)
    landed: list[str] = []

    async def slow_patch(core, name, patch, resource_version=None):
        await asyncio.sleep(2)
        landed.append(name)
        return {}

    monkeypatch.setattr(controller_module, "patch_node_annotations", slow_patch)
    started = asyncio.get_running_loop().time()
    with pytest.raises(APITransportError, match="no answer within the 0.2 s this replica can still prove it leads"):
        await c._patch_as_leader("n1", {"dynpart.io/spec-term": "3"}, None)
    assert asyncio.get_running_loop().time() - started < 1.0 and landed == []
    c._to_adopt.add("n1")
    await c._adopt()
    assert c._to_adopt == {"n1"}  # not adopted: tried again while it leads
    c.leadership = Lead(term=3, writes=False)
    with pytest.raises(APITransportError, match="cannot prove it still leads"):
        await c._patch_as_leader("n1", {"dynpart.io/spec-term": "3"}, None)


async def test_losing_the_lease_forgets_the_events_posted_as_leader(make):
    """An Event queued while leading may be withheld once the lease is lost (QueuedPoster): leading
    again, the replica must post it anew, not take it for posted an hour long."""
    c = make([reported("n1")], Lead(term=3))
    c.events = controller_module.EventRecorder(lambda *a: asyncio.sleep(0))
    await c.events.record({"kind": "Node", "metadata": {"name": "n1"}}, "LayoutPlanned", "plan p1")
    assert len(c.events) == 1
    c.set_leading(False)
    assert len(c.events) == 0


# --- reviews: ping-pong, deleted nodes, late specs, the planning thread, ended pods ----------------


def acked(name: str, plan_id: str, pods: str = "ml/x", term: int | None = None) -> dict[str, Any]:
    """A node whose agent acknowledged `plan_id`, which put `pods` on its free 1g.10gb."""
    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0)])]), plan_id)
    spec = {"dynpart.io/spec-plan": plan_id, "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0",
            SPEC_PODS: pods, **({SPEC_TERM: str(term)} if term is not None else {})}
    return node(name, annotations={**status, **spec})


async def test_a_pod_two_acknowledged_specs_name_is_reserved_once_on_the_newer(make):
    """x is named by a's older spec and b's newer one (its reservation on a lapsed, it was planned
    on b): reserved once, on b, never again on a then b then a... after each lapse."""
    t = [0.0]
    c = make([acked("a", "19e807aec00-1.0"), acked("b", "19ebc15b600-4.0")], Lead(term=3))
    c.clock = lambda: t[0]
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"})
    seen = []
    for _ in range(6):
        seen.append(c._reservations().get("ml/x"))
        t[0] += c.settings.reservation_s + 1
    assert seen == ["b", None, None, None, None, None]
    assert c._reserved_for["ml/x"] == {"19ebc15b600-4.0"}
    # a higher term is newer whatever the clocks of the replicas that wrote the ids
    c = make([acked("a", "19faa80de00-1.0", term=5), acked("b", "19ebc15b600-4.0", term=4)], Lead(term=5))
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"})
    assert c._reservations() == {"ml/x": "a"}


async def test_a_node_deleted_with_a_revocation_in_flight_can_be_planned_when_it_comes_back(make):
    """The revocation waits for an agent that will never answer; the node is deleted and made again
    under its name: the new node is planned (it was left out for as long as the replica led)."""
    t = [0.0]
    old = reported("n1", {"dynpart.io/spec-plan": "rev1"})
    c = make([old], Lead(term=3))
    c.clock = lambda: t[0]
    c.in_flight["n1"] = InFlight("rev1", 0.0, set(), revoking=True)
    del c.nodes.cache["n1"]
    c._on_node("DELETED", old)
    t[0] = 3600.0
    await c._expire_acks(t[0])
    fresh = node("n1", count=1, annotations=encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), None))
    c.nodes.cache["n1"] = fresh
    c._on_node("ADDED", fresh)
    assert c.in_flight == {} and c._awaiting_from_annotations() == set()
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1"]


async def test_a_node_deleted_with_a_plan_in_flight_gives_its_pods_back_at_once(make):
    """Nothing will apply the plan: its pods join the batch now, each told why (PlanNotApplied),
    the reservations on the node end without a back-off, and nothing is revoked or waited for."""
    n1, n2 = reported("n1", {"dynpart.io/spec-plan": "p1", SPEC_PODS: "ml/a"}), reported("n2")
    c = make([n1, n2], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    c.pods.cache["ml/b"] = pod("b", {"nvidia.com/mig-1g.10gb": "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.loop.reserve("ml/b", "n1", 0.0)
    del c.nodes.cache["n1"]
    c._on_node("DELETED", n1)
    assert c.in_flight == {} and c.reserved == {} and {"ml/a", "ml/b"} <= c.window.members
    await c._expire_acks(now=1.0)
    assert c.written == [] and [r for r, _ in c.posted] == ["PlanNotApplied"]
    assert "node n1 (plan p1)" in c.posted[0][1] and "the node was deleted" in c.posted[0][1]
    assert c.loop.avoid == {} and c.loop.lapsed == {}


async def test_a_late_spec_of_an_earlier_leader_for_pods_planned_elsewhere_is_revoked_not_adopted(make):
    """This leader (term 3) has x in flight on b. A deposed leader's (term 2) spec for x lands late
    on a: adopting it would have a's agent apply it too, x planned on two nodes. It is revoked."""
    late = reported("a", {"dynpart.io/spec-plan": "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})
    mine = reported("b", {"dynpart.io/spec-plan": "l2.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    c = make([late, mine], Lead(term=3))
    assert c._awaiting_from_annotations() == {"a", "b"}
    await c._adopt()
    [(name, patch)] = c.written
    assert name == "a" and patch["dynpart.io/spec-revokes"] == "l1.0" and patch[SPEC_TERM] == "3"
    assert patch[SPEC_PODS] is None
    assert c.in_flight["a"].revoking and c.in_flight["a"].pods == set() and c.in_flight["b"].pods == {"ml/x"}
    assert [r for r, _ in c.posted] == ["PlanRevoked"] and "already planned elsewhere (ml/x)" in c.posted[0][1]
    # a pod reserved elsewhere counts as held too; a late spec whose pods nobody holds is adopted
    c = make([reported("a", {"dynpart.io/spec-plan": "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x,ml/y"})], Lead(term=3))
    c.loop.reserve("ml/y", "b", 0.0)
    c._awaiting_from_annotations()
    assert c._to_revoke == {"a"} and c._to_adopt == set() and "a" not in c.in_flight
    c = make([reported("a", {"dynpart.io/spec-plan": "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/y"})], Lead(term=3))
    c._awaiting_from_annotations()
    assert c._to_adopt == {"a"} and c.in_flight["a"].pods == {"ml/y"}


async def test_an_unacknowledged_revocation_found_after_a_failover_is_not_revoked_again(make):
    """A new leader finds a revocation its agent has not acknowledged (spec-revokes): it is in
    flight as a revocation, left waiting for its agent, never revoked in turn after ack_timeout_s."""
    spec = {"dynpart.io/spec-plan": "r1", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0",
            SPEC_TERM: "3", "dynpart.io/spec-revokes": "p1"}
    c = make([reported("n1", spec)], Lead(term=3), ack_timeout_s=1.0)
    assert c._awaiting_from_annotations() == {"n1"} and c.in_flight["n1"].revoking
    await c._expire_acks(now=c.clock() + 1000.0)
    assert c.written == [] and c.posted == []


async def test_drains_decided_while_the_lease_was_lost_are_kept_by_no_one(make, monkeypatch):
    """The plan runs in a thread; meanwhile the event loop learns the lease is lost and clears the
    loop's leader state. The round neither writes nor brings its drain decisions back (the thread
    planned with copies, not with the dictionaries the event loop cleared)."""
    from dynpart.planner.drain import Drain

    c = make([reported("n1")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.loop.drain_flagged["n9"] = {0}
    seen = []
    decide_with = c.loop.decide_with

    def planning_thread(snapshot, catalog, state):
        c.set_leading(False)  # as the event loop would, while the thread plans
        seen.append(dict(state.flagged))
        state.drains["ml/z"] = Drain("ml/z", "n1", (1,))
        return decide_with(snapshot, catalog, state)

    monkeypatch.setattr(c.loop, "decide_with", planning_thread)
    await c.plan_round()
    assert seen == [{"n9": {0}}], "the thread's copy is not cleared under it"
    assert c.written == [] and c.loop.drains == {} and c.loop.drain_flagged == {}


async def test_pods_that_ended_are_not_watched_and_one_that_ends_is_let_go(make):
    """The pod watch leaves out Succeeded and Failed pods (they hold nothing, and were cached for
    ever); a pod that ends then arrives as DELETED: its reservation ends, with no back-off."""
    from dynpart.planner.controller import LIVE_PODS

    c = make([reported("n1")], Lead(term=3))
    assert c.pods.kwargs["field_selector"] == LIVE_PODS == "status.phase!=Succeeded,status.phase!=Failed"
    a = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    c.pods.cache["ml/a"] = a
    c.loop.reserve("ml/a", "n1", c.clock())
    assert c._reservations() == {"ml/a": "n1"}
    del c.pods.cache["ml/a"]
    c._on_pod("DELETED", {**a, "status": {"phase": "Failed"}})
    assert c._reservations() == {} and c.loop.avoid == {} and c.loop.lapsed == {}


def test_a_pod_whose_reservations_keep_lapsing_is_left_out_pod_wide_for_a_while():
    """Something the planner does not model (a volume in another zone...) keeps the pod from
    binding wherever its slices are made: after POD_LAPSES lapses, on any nodes, it is left out of
    the plans for POD_BACKOFF_MIN_S, twice as long after each further lapse, at most an hour; said
    once per back-off; a change of the pod, or its binding, starts it again from nothing."""
    from dynpart.planner.loop import POD_BACKOFF_MAX_S, POD_BACKOFF_MIN_S, POD_LAPSES, PlanningLoop
    from dynpart.snapshot import PendingPod, Snapshot

    loop = PlanningLoop(PlannerSettings(reservation_s=15.0))
    snap = Snapshot(nodes=[], pending=[PendingPod(name="ml/a", resource="nvidia.com/mig-1g.10gb")])
    loop.pod_waiting("ml/a", 0.0, version="v1")
    now, delays = 0.0, []
    for i in range(12):
        assert [p.name for p in loop.prepare(snap, now).pending] == ["ml/a"]
        loop.reserve("ml/a", f"n{i % 4}", now)
        now += 16.0
        loop.reservations(now, lambda key: False)
        started = loop.take_backoffs_started()
        if i + 1 < POD_LAPSES:
            assert not started and not loop.backing_off(now)
            continue
        [(key, b)] = started
        assert key == "ml/a" and b.lapses == i + 1 and b.nodes[:3] == ["n0", "n1", "n2"]
        delays.append(b.delay)
        assert loop.prepare(snap, now).pending == [] and loop.prepare(snap, b.until - 0.1).pending == []
        now = b.until
    assert delays[:4] == [POD_BACKOFF_MIN_S, 2 * POD_BACKOFF_MIN_S, 4 * POD_BACKOFF_MIN_S, 8 * POD_BACKOFF_MIN_S]
    assert max(delays) == delays[-1] == POD_BACKOFF_MAX_S == 3600.0
    assert loop.take_backoffs_started() == []
    loop.pod_waiting("ml/a", now, version="v1")
    assert loop.lapsed["ml/a"].lapses == 12, "the same pod: its lapses stay"
    loop.pod_waiting("ml/a", now, version="v2")
    assert "ml/a" not in loop.lapsed, "changed: from nothing again"
    loop.reserve("ml/a", "n0", now)
    loop.reservations(now + 16.0, lambda key: False)
    loop.pod_done("ml/a")
    assert "ml/a" not in loop.lapsed


@pytest.mark.parametrize("admits", ["b", "c", "d"])
def test_a_pod_only_one_node_admits_is_tried_on_every_node_until_it_binds(admits):
    """The scheduler binds the pod only on one of four empty nodes (a zonal volume, say: nothing
    the planner models). Each node where its slice was kept and not taken is kept off while the
    others are tried, and past the pod's back-off: every node is tried once, and the pod binds.
    (The nodes were kept off one at a time before, each for less than the back-off: the plans went
    back to the first nodes' free slices, a, b, a, a, ..., and never reached d in a day.)"""
    from dynpart.planner.loop import PlanningLoop
    from dynpart.snapshot import Gpu, MigInstance, Node, PendingPod, Snapshot

    settings = PlannerSettings()
    loop = PlanningLoop(settings)
    nodes = {n: Node(name=n, mode="mig", gpu_model="H100-80GB", gpus=[Gpu(index=0)]) for n in "abcd"}
    pod = PendingPod(name="ml/p", resource="nvidia.com/mig-1g.10gb")
    loop.pod_waiting("ml/p", 0.0, "v1")
    now, tried = 0.0, []
    while now < 24 * 3600 and (not tried or tried[-1] != admits):
        loop.reservations(now, lambda key: False)
        snap = loop.prepare(Snapshot(nodes=list(nodes.values()), pending=[pod]), now)
        result = loop.decide(snap, CAT) if snap.pending else None
        if result is None or not result.placements:
            now += settings.resync_s
            continue
        [pl] = result.placements
        layout = result.layout_of(pl.node)
        if layout is not None and layout.changed:  # the agent applies it at once
            nodes[pl.node] = nodes[pl.node].model_copy(update={"gpus": [Gpu(index=g.index, mig=[
                MigInstance(profile=m.profile, start=m.start) for m in g.mig]) for g in layout.gpus]})
        tried.append(pl.node)
        loop.reserve("ml/p", pl.node, now)  # the scheduler binds it on `admits` only
        now += settings.reservation_s + 0.1
    assert tried == list("abcd"[:"abcd".index(admits) + 1]), tried
    assert now < 600, "within minutes, not hours"


async def test_a_pod_that_never_binds_where_its_slices_are_made_is_told_and_left_alone(make):
    """The controller posts one SlicesNotTaken Warning when the pod-wide back-off starts, saying
    that something else keeps the pod pending and when it is planned again; meanwhile no plan
    reconfigures a GPU for it."""
    from dynpart.planner.loop import POD_BACKOFF_MIN_S

    t = [1000.0]
    free = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0)]), "p0")
    c = make([node(f"n{i}", count=1, annotations={**free, "dynpart.io/spec-plan": "p0"}) for i in range(4)], Lead(term=3))
    c.clock = lambda: t[0]
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    said = "0/4 nodes are available: 4 node(s) had volume node affinity conflict."
    c.pods.cache["ml/a"]["status"]["conditions"][0]["message"] = said
    for _ in range(3):  # planned, acknowledged at once, never bound
        await c.plan_round()
        name, patch = c.written[-1]
        c.in_flight.clear()
        c.loop.reserve("ml/a", name, t[0])
        t[0] += c.settings.reservation_s + 1
    written = len(c.written)
    await c.plan_round()
    [message] = [m for r, m in c.posted if r == "SlicesNotTaken"]
    assert "kept GPU slices for this pod 3 times" in message and "something other than GPU slices" in message
    assert f"the scheduler said: {said!r}" in message, "its own reason, not only a list of causes"
    assert f"plans it again after {POD_BACKOFF_MIN_S:g} s, at " in message
    t[0] += POD_BACKOFF_MIN_S / 2
    await c.plan_round()
    assert len(c.written) == written and [r for r, _ in c.posted].count("SlicesNotTaken") == 1
    t[0] += POD_BACKOFF_MIN_S
    await c.plan_round()
    assert len(c.written) == written + 1, "planned again once the back-off is over"


async def test_a_plan_keeps_the_gpus_it_cannot_read_as_they_are(make):
    """GPU 0 holds an instance under a name the planner's model lacks (a newer agent's report it
    cannot read): the plan written for GPU 1 asks for GPU 0's instances as they are, not for
    GPU 0 empty."""
    status = {**encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0"), "dynpart.io/spec-plan": "p0",
              "dynpart.io/status-gpu-0-7g.79gb-used": "1@0", "dynpart.io/status-capability": '{"v": 2}'}
    c = make([node("n1", count=2, annotations=status)], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    [(name, patch)] = c.written
    assert patch["dynpart.io/spec-gpu-0-7g.79gb"] == "1@0" and patch["dynpart.io/spec-gpu-1-3g.40gb"]


@pytest.mark.parametrize("outcome", ["landed", "lost", "unreadable"])
async def test_a_spec_write_without_an_answer_is_looked_up_before_its_pods_are_planned_again(make, monkeypatch,
                                                                                            outcome):
    """A connection cut while the patch is on its way: it may have been applied. The cache can lag
    for seconds (a watch relisting after 410 Gone), and a round planning from it would put the
    pod on a second node while the first plan could still be applied. The node is read from the
    API server: a plan that landed is in flight like any other, one that did not is forgotten, and
    one that cannot be looked up is taken as landed (in flight until acknowledged or timed out)."""
    from dynpart.kube.errors import APIServerError

    c = make([reported("n1"), reported("n2")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    tries: list[str] = []

    async def cut_patch(core, name, patch, resource_version=None):
        tries.append(name)
        if outcome != "lost" and len(tries) == 1:  # applied, then the answer lost
            ann = {**c.nodes.cache[name]["metadata"]["annotations"], **{k: v for k, v in patch.items() if v}}
            c.server[name] = {**c.nodes.cache[name], "metadata": {**c.nodes.cache[name]["metadata"], "annotations": ann}}
        raise APITransportError(f"patch node {name}: connection reset")

    async def unreadable(core, name):
        raise APIServerError(f"read node {name}: 503")

    monkeypatch.setattr(controller_module, "patch_node_annotations", cut_patch)
    if outcome == "unreadable":
        monkeypatch.setattr(controller_module, "read_node", unreadable)
    await c.plan_round()
    first = tries[0]
    if outcome == "lost":
        assert c.in_flight == {} and c.posted == []
    else:
        assert set(c.in_flight) == {first} and c.in_flight[first].pods == {"ml/a"}
        assert [r for r, _ in c.posted] == ["LayoutPlanned", "SlicePlanned"]
    await c.plan_round()  # the cache still shows neither node with the spec
    assert tries == ([first, first] if outcome == "lost" else [first])  # planned again only when it did not land


async def test_a_pod_whose_only_nodes_apply_a_plan_waits_without_a_misleading_event(make):
    """The only MPS node is applying a plan: the round has no MPS node, and the pod's reason would
    read "no node in mps mode". It waits for the node without an Event; once the node is back the
    real reason is posted (a slice too big for its GPUs)."""
    spec = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mps", "dynpart.io/spec-gpu-0-10gb": "1"}
    status = encode_status(NodeLayout(node="m1", mode="mps", gpus=[GpuLayout(index=0)]), "p0")
    m1 = node("m1", mode="mps", count=1, annotations={**status, **spec})
    c = make([m1], Lead(term=3))
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/gpu-200gb": "1"})
    await c.plan_round()
    assert [r for r, _ in c.posted if r == "Unplaceable"] == []
    m1["metadata"]["annotations"]["dynpart.io/status-plan"] = "p1"  # acknowledged: planned again
    c._acknowledged("m1", m1["metadata"]["annotations"], c.clock())  # what the node watch does
    await c.plan_round()
    (message,) = [m for r, m in c.posted if r == "Unplaceable"]
    assert "a 200 GB slice is bigger than every MPS GPU" in message, message


async def test_a_plan_acknowledged_while_the_round_runs_still_explains_the_wait(make, monkeypatch):
    """The node's agent acknowledges its plan while the round that left the node out is running
    (the round awaits its writes and Events): the pod still only waits for it, without an Event
    blaming the agent (a race the end-to-end test hit: the nodes left out are those of the round's
    start, the plans in flight are read at its end)."""
    spec = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mps", "dynpart.io/spec-gpu-0-10gb": "1"}
    status = encode_status(NodeLayout(node="m1", mode="mps", gpus=[GpuLayout(index=0)]), "p0")
    m1 = node("m1", mode="mps", count=1, annotations={**status, **spec})
    c = make([m1], Lead(term=3))
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/gpu-200gb": "1"})
    told = c._tell_backoffs

    async def acknowledged_meanwhile() -> None:
        assert "m1" in c.in_flight
        m1["metadata"]["annotations"]["dynpart.io/status-plan"] = "p1"
        c._acknowledged("m1", m1["metadata"]["annotations"], c.clock())  # what the node watch does
        await told()
    monkeypatch.setattr(c, "_tell_backoffs", acknowledged_meanwhile)
    await c.plan_round()
    assert "m1" not in c.in_flight and [r for r, _ in c.posted if r == "Unplaceable"] == []
    monkeypatch.setattr(c, "_tell_backoffs", told)
    await c.plan_round()
    (message,) = [m for r, m in c.posted if r == "Unplaceable"]
    assert "a 200 GB slice is bigger than every MPS GPU" in message, message


async def test_a_node_back_in_dynpart_with_a_plan_for_pods_planned_elsewhere_has_it_revoked(make):
    """A node leaves dynpart (its label removed) with a plan in flight; its pod is planned onto
    another node; the label comes back and the node with its old, same-term spec: that spec would
    be applied by its agent beside the new plan. It is revoked, not waited for."""
    spec = {"dynpart.io/spec-plan": "pA", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
            SPEC_TERM: "3", SPEC_PODS: "ml/a"}
    n_a = reported("nA", spec)
    c = make([n_a, reported("nB")], Lead(term=3))
    c.in_flight["nA"] = InFlight("pA", 0.0, {"ml/a"})
    del c.nodes.cache["nA"]
    c._on_node("DELETED", n_a)  # out of the label selector
    assert "nA" not in c.in_flight
    c.loop.written("nB", "pB", {"ml/a"}, 1.0)  # planned again, elsewhere
    c.nodes.cache["nA"] = n_a
    c._on_node("ADDED", n_a)
    awaiting = c._awaiting_from_annotations()
    assert "nA" in awaiting and "nA" not in c.in_flight and c._to_revoke == {"nA"}
    await c._adopt()
    [(name, patch)] = c.written
    assert name == "nA" and patch[SPEC_PODS] is None and patch["dynpart.io/spec-revokes"] == "pA"
    assert c.in_flight["nA"].revoking and c.in_flight["nB"].pods == {"ml/a"}
    assert [r for r, _ in c.posted] == ["PlanRevoked"]


async def test_a_pod_whose_only_node_has_no_agent_is_told_so(make):
    """A node labelled mps whose agent never ran (a missing toleration, an image pull failure):
    the pod is not silent, its Event names the node that waits for its agent."""
    c = make([node("m1", mode="mps", count=1, annotations={})], Lead(term=3))
    c.pods.cache["ml/p"] = pod("p", {"nvidia.com/gpu-10gb": "1"})
    await c.plan_round()
    (message,) = [m for r, m in c.posted if r == "Unplaceable"]
    assert "node(s) that could take it (m1) wait for their agent: it has not reported yet" in message, message


async def test_a_node_status_change_does_not_read_every_cached_pod(make, monkeypatch):
    """At 1,000 GPU nodes the agents change their status about 15 times a second, and scanning
    50,000 cached pods for the waiting ones took 0.2 s each time: the planner's event loop
    saturated. The waiting pods are kept by the pod watch; a status change reads only them."""
    c = make([reported("n1")], Lead(term=1))
    for i in range(200):  # bound pods: not waiting
        c._on_pod("ADDED", pod(f"run{i}", {"nvidia.com/mig-1g.10gb": "1"}, phase="Running", node="n1",
                               unschedulable=False))
    c._on_pod("ADDED", pod("w", {"nvidia.com/mig-1g.10gb": "1"}))
    c._on_pod("ADDED", pod("gone", {"nvidia.com/mig-1g.10gb": "1"}))
    c._on_pod("DELETED", pod("gone", {"nvidia.com/mig-1g.10gb": "1"}))
    c.window.close()
    scanned = []
    real = controller_module.is_batch_candidate
    monkeypatch.setattr(controller_module, "is_batch_candidate", lambda p: scanned.append(p) or real(p))
    changed = reported("n1", status_plan="p1")
    c.nodes.cache["n1"] = changed
    c._on_node("MODIFIED", changed)
    assert scanned == [] and set(c.window.members) == {"ml/w"}, "the waiting pod joins the batch, no pod is read"


def test_a_slice_taken_by_a_pod_wakes_no_waiting_pod_and_a_slice_freed_does():
    """Half the status changes of a busy cluster are free slices taken: no pod can fit where it
    did not before, so they do not put every waiting pod back in the batch (a round each time);
    a slice freed, made or destroyed, or any other status change, does."""
    from dynpart.planner.controller import _room_may_have_grown

    def status(free: str | None, used: str | None, plan: str = "p1", mps: dict[str, str] | None = None):
        out = {"dynpart.io/status-plan": plan, **(mps or {})}
        if free:
            out["dynpart.io/status-gpu-0-1g.10gb-free"] = free
        if used:
            out["dynpart.io/status-gpu-0-1g.10gb-used"] = used
        return out

    assert not _room_may_have_grown(status("2@0,1", None), status("1@1", "1@0")), "a pod took one"
    assert _room_may_have_grown(status("1@1", "1@0"), status("2@0,1", None)), "a pod ended"
    assert _room_may_have_grown(status("1@1", "1@0"), status(None, "1@0")), "a free slice destroyed (a drain)"
    assert _room_may_have_grown(status("1@1", None), status("1@1", None, plan="p2")), "a plan applied"
    assert _room_may_have_grown(status("1@1", None), status("1@2", None)), "moved"
    mps = "dynpart.io/status-gpu-0-10gb"
    assert not _room_may_have_grown(status(None, None, mps={f"{mps}-free": "2"}),
                                    status(None, None, mps={f"{mps}-free": "1", f"{mps}-used": "1"}))
    assert _room_may_have_grown(status(None, None, mps={f"{mps}-free": "1", f"{mps}-used": "1"}),
                                status(None, None, mps={f"{mps}-used": "1"})), "an MPS slice destroyed: memory freed"
    assert _room_may_have_grown(status("1@1", None), status("x", None)), "malformed: the round says"


async def test_the_controller_plans_a_deferred_replica_at_the_next_round_on_another_node(make):
    from dynpart.annotations import encode_status
    from dynpart.snapshot import GpuLayout, NodeLayout
    from tests.controller.test_pod_conflicts import ZONE, labelled, replica

    def empty(name: str) -> dict[str, str]:
        return {**encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0)]), "p0"),
                "dynpart.io/spec-plan": "p0"}

    # anti-affinity on zones of more than one node (replicas that conflict on one node only are
    # planned in one round, kept apart: tests/controller/test_pod_conflicts.py)
    zones = {1: "z1", 2: "z2", 3: "z2"}
    c = make([labelled(node(f"n{i}", count=1, annotations=empty(f"n{i}")), **{ZONE: z}) for i, z in zones.items()],
             Lead(term=1))
    for i in range(2):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1"] and c.written[0][1]["dynpart.io/spec-pods"] == "ml/web-0"
    assert "ml/web-1" in c.window.members, "back in the batch at once"
    assert c.window.ready(c.clock()), "and planned at once: it waited in a batch already"
    await c.plan_round()
    assert [n for n, _ in c.written] == ["n1", "n2"] and c.written[1][1]["dynpart.io/spec-pods"] == "ml/web-1"


async def test_a_pod_left_for_an_older_one_that_was_not_placed_is_not_left_again(make):
    from tests.controller.test_pod_conflicts import replica

    c = make([], Lead(term=1))
    for i in range(3):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}")
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    c._deferred = {"ml/web-1": "ml/web-0", "ml/web-2": "ml/gone"}
    assert c._not_to_defer() == {}, "the plan placed web-0 (or never ran): web-1 is left for it again"
    c._left_for_unplaced = {"ml/web-1": "ml/web-0", "ml/web-2": "ml/gone"}  # the plan did not place them
    assert c._not_to_defer() == {"ml/web-1": {"ml/web-0"}}, "web-0 still waits: web-1 is not left for it again"
    c.loop.reserve("ml/web-0", "n1", 0.0)
    assert c._not_to_defer() == {}, "web-0 placed: web-1 is planned against it"


async def test_replicas_left_for_older_ones_that_cannot_be_placed_are_all_planned_within_a_few_rounds(make):
    """Three replicas that must not share a zone, and no room: round 1 plans web-0 (not placed)
    and leaves web-1 and web-2 for it; round 2 plans web-0 and web-1 and leaves web-2 for web-1;
    round 3 plans all three. A pod is never left twice for an older one a round could not place,
    so a cycle of deferrals cannot starve the youngest; and since the older ones were not placed,
    the batch waits as usual (no rounds back to back)."""
    from dynpart.annotations import encode_status
    from dynpart.snapshot import GpuLayout, NodeLayout
    from tests.controller.test_pod_conflicts import ZONE, labelled, replica

    def full(name: str) -> dict[str, str]:
        return {**encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=[
            MigInstance(profile="7g.80gb", start=0, used=True)])]), "p0"), "dynpart.io/spec-plan": "p0"}

    c = make([labelled(node(f"n{i}", count=1, annotations=full(f"n{i}")), **{ZONE: "z1"}) for i in (1, 2)], Lead(term=1))
    for i in range(3):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    deferred = []
    for _ in range(4):
        await c.plan_round()
        deferred.append(dict(c._deferred))
        assert not c.window.ready(c.clock()), "no older pod was placed: the batch waits as usual"
    assert deferred == [{"ml/web-1": "ml/web-0", "ml/web-2": "ml/web-0"}, {"ml/web-2": "ml/web-1"}, {}, {}]
    assert c.written == []


def _no_plan(name: str) -> dict[str, str]:
    return {**encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0)]), "p0"),
            "dynpart.io/spec-plan": "p0"}


def _planned_on(writes: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    return {k: name for name, p in writes for k in (p.get(SPEC_PODS) or "").split(",") if k}


async def test_a_pod_left_for_an_older_one_whose_write_conflicted_is_left_for_it_again(make, monkeypatch):
    """web-0 is placed but its node's write gets a 409 (the node changed meanwhile): web-0 was not
    unplaceable, so the next round leaves web-1 for it again instead of planning both together,
    where the objective puts them on one node and the scheduler refuses one (review 78)."""
    from dynpart.kube.errors import APIConflictError
    from tests.controller.test_pod_conflicts import ZONE, labelled, replica
    zones = {1: "z1", 2: "z2", 3: "z2"}  # (zone anti-affinity: conflicting beyond one node)
    c = make([labelled(node(f"n{i}", count=1, annotations=_no_plan(f"n{i}")), **{ZONE: z}) for i, z in zones.items()],
             Lead(term=1))
    writes: list[tuple[str, dict[str, Any]]] = []

    async def patch(core, name, p, resource_version=None):
        if not writes and not getattr(patch, "conflicted", False):
            patch.conflicted = True  # type: ignore[attr-defined]
            # a change the plan read (a label): the write is not made again at the new version
            changed = copy.deepcopy(c.nodes.cache[name])
            changed["metadata"]["labels"]["team"] = "b"
            changed["metadata"]["resourceVersion"] = "8"
            c.server[name] = changed  # type: ignore[attr-defined]
            raise APIConflictError("the object has been modified", status=409)
        writes.append((name, p))
        return {}
    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    for i in range(2):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    await c.plan_round()
    assert c._deferred == {"ml/web-1": "ml/web-0"} and writes == []
    c.server.clear()  # type: ignore[attr-defined]
    await c.plan_round()
    assert _planned_on(writes) == {"ml/web-0": writes[0][0]}, "web-1 is left for web-0 again"
    await c.plan_round()  # web-0 in flight: web-1 planned against it, on the other node
    on = _planned_on(writes)
    assert set(on) == {"ml/web-0", "ml/web-1"} and on["ml/web-0"] != on["ml/web-1"]


async def test_a_round_that_could_not_plan_leaves_the_deferrals_as_they_were(make, monkeypatch):
    """A round skipped (an error between objects) placed nothing and left nothing unplaced: the
    younger replica is still left for the older one by the next round."""
    from dynpart.errors import DynpartError
    from tests.controller.test_pod_conflicts import ZONE, labelled, replica
    c = make([labelled(node(f"n{i}", count=1, annotations=_no_plan(f"n{i}")), **{ZONE: "z1"}) for i in (1, 2)],
             Lead(term=1))
    for i in range(2):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    real = c.loop.decide_with
    calls = []

    def failing_once(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise DynpartError("two nodes of one name")
        return real(*a, **k)
    monkeypatch.setattr(c.loop, "decide_with", failing_once)
    await c.plan_round()
    assert c._deferred == {"ml/web-1": "ml/web-0"} and c.written == []
    await c.plan_round()
    assert [p[SPEC_PODS] for _, p in c.written] == ["ml/web-0"]


async def test_losing_the_lease_forgets_the_deferrals(make):
    c = make([], Lead(term=1))
    c._deferred, c._left_for_unplaced = {"ml/b": "ml/a"}, {"ml/b": "ml/a"}
    c._not_left_for = {"ml/b": frozenset({"ml/a"})}
    c._forget_leader_state()
    assert c._deferred == {} and c._left_for_unplaced == {} and c._not_left_for == {}


async def test_an_acknowledgement_arriving_while_plans_expire_is_not_revoked(make, monkeypatch):
    """Two plans overdue: while the first node's revocation is written, the second node's agent
    acknowledges its plan. That plan stands: its pod is reserved, nothing is written to the node
    and no PlanRevoked is posted (review 78)."""
    def spec(p: str, pod_key: str) -> dict[str, str]:
        return {"dynpart.io/spec-plan": p, "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0",
                SPEC_TERM: "3", SPEC_PODS: pod_key}
    c = make([reported("n1", spec("p1", "ml/a")), reported("n2", spec("p2", "ml/b"))], Lead(term=3), ack_timeout_s=1.0)
    c.in_flight["n1"] = InFlight("p1", 0.0, {"ml/a"})
    c.in_flight["n2"] = InFlight("p2", 0.0, {"ml/b"})
    written: list[str] = []

    async def patch(core, name, p, resource_version=None):
        written.append(name)
        if name == "n1":
            acked_node = reported("n2", spec("p2", "ml/b"), status_plan="p2")
            c.nodes.cache["n2"] = acked_node
            c._on_node("MODIFIED", acked_node)
        return {}
    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    await c._expire_acks(now=10.0)
    assert written == ["n1"] and "ml/b" in c.reserved
    assert not [e for e in c.posted if "p2" in str(e)]


def _recreated(created: str) -> dict[str, Any]:
    p = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    p["metadata"]["uid"], p["metadata"]["creationTimestamp"] = "uid-2", created
    return p


async def test_a_pod_recreated_under_the_same_name_is_not_reserved_by_its_predecessors_plan(make):
    """An acknowledged spec names ml/a, whose pod ran and ended; a pod created again under that
    name (a StatefulSet replica, a bare pod applied again) is not the one the plan was for: it is
    not reserved there (review 78). This replica saw the plan; and after a restart, the plan's id
    says when it was written."""
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0, used=True)])]), "p0")
    c = make([node("n1", annotations={**status, "dynpart.io/spec-plan": "p0", SPEC_PODS: "ml/a"})], Lead(term=1))
    old = pod("a", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Running", unschedulable=False)
    c.pods.cache["ml/a"] = old
    c._reserved_for["ml/a"] = {"p0"}  # this replica saw p0 acknowledged
    assert c._reservations() == {}
    del c.pods.cache["ml/a"]
    c._on_pod("DELETED", old)
    assert c._reservations() == {}
    c.pods.cache["ml/a"] = _recreated("2026-11-27T03:00:00Z")
    c._on_pod("ADDED", c.pods.cache["ml/a"])
    assert c._reservations() == {}
    # a new replica (nothing remembered): the plan id's time decides
    written_ms = int(controller_module.dt.datetime(2026, 11, 27, 2, 0, tzinfo=controller_module.dt.UTC).timestamp() * 1000)
    for created, reserved in (("2026-11-27T03:00:00Z", False), ("2026-11-27T01:59:00Z", True),
                              ("2026-11-27T02:00:30Z", True)):  # within the clock skew allowed: the same pod
        plan_id = f"{written_ms:x}-1"
        c = make([node("n1", annotations={**encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
            MigInstance(profile="1g.10gb", start=0, used=False)])]), plan_id), "dynpart.io/spec-plan": plan_id,
            SPEC_PODS: "ml/a"})], Lead(term=1))
        c.pods.cache["ml/a"] = _recreated(created)
        c._on_pod("ADDED", c.pods.cache["ml/a"])
        assert (c._reservations() == {"ml/a": "n1"}) is reserved, created


def _a_pod_waiting(make: Any, n: dict[str, Any]) -> Any:
    """A controller that knows node `n` and a pod waiting for a slice, its batch emptied."""
    c = make([n], Lead(term=1))
    c._on_node("ADDED", n)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    c._on_pod("ADDED", c.pods.cache["ml/a"])
    c.window.members.clear()
    c.wake.clear()
    return c


async def test_a_node_uncordoned_or_untainted_wakes_the_waiting_pods_at_once(make):
    """A waiting pod is planned when a node it may use is uncordoned, not at the next resync; a
    change of the node's slice counts alone (the agent's early publishing) does not wake them: its
    status does, when room grew."""
    cordoned = reported("n1")
    cordoned["spec"] = {"unschedulable": True}
    c = _a_pod_waiting(make, cordoned)
    counted = json.loads(json.dumps(cordoned))
    counted["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "3"
    c._on_node("MODIFIED", counted)
    assert not c.window.members and not c.wake.is_set()
    uncordoned = json.loads(json.dumps(counted))
    uncordoned["spec"] = {}
    c._on_node("MODIFIED", uncordoned)
    assert "ml/a" in c.window.members and c.wake.is_set()
    c.window.members.clear()
    c._on_node("MODIFIED", uncordoned)  # the same again: nothing new
    assert not c.window.members


async def test_a_label_that_changes_by_itself_does_not_wake_the_waiting_pods(make):
    """GPU feature discovery rewrites nvidia.com/gfd.timestamp every minute on every GPU node: that
    would re-plan every waiting pod once a minute per node (review 82)."""
    n1 = reported("n1")
    n1["metadata"]["labels"]["nvidia.com/gfd.timestamp"] = "1764200000"
    c = _a_pod_waiting(make, n1)
    later = json.loads(json.dumps(n1))
    later["metadata"]["labels"]["nvidia.com/gfd.timestamp"] = "1764200060"
    c._on_node("MODIFIED", later)
    assert not c.window.members and not c.wake.is_set()


async def _round_with_a_conflict(make, monkeypatch, change, every_try: bool = False):
    """One round planning pod ml/a onto n1 (resourceVersion 100 in the cache), where `change`
    (the server's node -> None) lands between the snapshot and the write (before every write with
    `every_try`): writes carrying another version than the server's are refused 409, as the API
    server does. The controller, and the resourceVersion each write carried."""
    from dynpart.kube.errors import APIConflictError

    c = make([reported("n1")], Lead(term=1))
    server = copy.deepcopy(reported("n1"))
    server["metadata"].update(resourceVersion="100", uid="u1")
    c.nodes.cache["n1"] = copy.deepcopy(server)
    attempts: list[str | None] = []

    async def patch(core, name, p, resource_version=None):
        attempts.append(resource_version)
        if len(attempts) == 1 or every_try:
            server["metadata"]["resourceVersion"] = str(int(server["metadata"]["resourceVersion"]) + 1)
            change(server)
        if resource_version != server["metadata"]["resourceVersion"]:
            raise APIConflictError("the object has been modified", status=409)
        server["metadata"]["annotations"].update({k: v for k, v in p.items() if v is not None})
        return copy.deepcopy(server)

    async def read(core, name):
        return copy.deepcopy(server)
    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    monkeypatch.setattr(controller_module, "read_node", read)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    return c, attempts, server


async def test_a_write_refused_for_a_status_change_the_plan_did_not_read_is_made_again_at_the_new_version(
        make, monkeypatch):
    """The kubelet rewrites the Node's status (conditions, images, volumes in use) and the agent its
    heartbeat while a round plans: the spec write's resourceVersion is stale though nothing the plan
    read changed. The API server answers 409; the write is made again at the node's new version
    (client-go's RetryOnConflict), not dropped until the next round, whose cache the kubelet may
    have moved on from again: on a node whose status changes faster than a round, its pods were
    never placed (review 93; fails before). GPU feature discovery's timestamp label, rewritten every
    minute, is nothing a plan reads either (review 95)."""
    def kubelet_writes_status(node):
        node["status"].setdefault("conditions", []).append({"type": "Ready", "status": "True"})
        node["metadata"]["annotations"][STATUS_HEARTBEAT] = "2026-11-27T12:00:00Z"
        node["metadata"]["labels"]["nvidia.com/gfd.timestamp"] = "1764244800"

    c, attempts, server = await _round_with_a_conflict(make, monkeypatch, kubelet_writes_status)
    assert attempts == ["100", "101"] and "n1" in c.in_flight
    assert server["metadata"]["annotations"][SPEC_PODS] == "ml/a"


async def test_a_write_refused_for_a_change_the_plan_read_or_for_ever_is_left_to_the_next_round(make, monkeypatch):
    """A 409 for a change of what the plan read (labels, the dynpart annotations, the spec,
    allocatable; the node's uid: one made again under its name is another node) is not written
    again: the next round plans the node as it is now. A node that changes at every try is given
    up after CONFLICT_RETRIES more."""
    from dynpart.planner.controller import CONFLICT_RETRIES

    changes = {
        "label": lambda n: n["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}),
        "annotation": lambda n: n["metadata"]["annotations"].update({STATUS_PLAN: "p9"}),
        "taint": lambda n: n.update(spec={"taints": [{"key": "gpu", "effect": "NoSchedule"}]}),
        "allocatable": lambda n: n["status"]["allocatable"].update(cpu="8"),
        "uid": lambda n: n["metadata"].update(uid="u2"),
        "always": lambda n: n["status"].update(conditions=[]),
    }
    for name, change in changes.items():
        c, attempts, _ = await _round_with_a_conflict(make, monkeypatch, change, every_try=name == "always")
        assert "n1" not in c.in_flight, name
        assert len(attempts) == (CONFLICT_RETRIES + 1 if name == "always" else 1), (name, attempts)


async def test_a_write_refused_409_is_never_taken_as_landed_when_the_re_read_fails(make, monkeypatch):
    """The spec write was refused (409: it did not land). _write_plan re-reads the node; that GET
    fails (an API server restart). The read's APITransportError escapes _write_plan and plan_round
    hands it to _landed, which reads once more, fails again, and returns None: 'taken as written'.
    The node is then in flight with a plan that is not on it, its pods held until the ack time-out,
    a LayoutPlanned Event and dynpart_node_plans_total counted for a write the server refused
    (review 95; fails before)."""
    from dynpart.kube.errors import APIConflictError, APITransportError

    c = make([reported("n1")], Lead(term=1))
    server = copy.deepcopy(reported("n1"))
    server["metadata"]["resourceVersion"] = "100"
    c.nodes.cache["n1"] = copy.deepcopy(server)

    async def patch(core, name, p, resource_version=None):
        raise APIConflictError("the object has been modified", status=409)

    async def read(core, name):
        raise APITransportError(f"read node {name}: connection refused")
    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    monkeypatch.setattr(controller_module, "read_node", read)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert "n1" not in c.in_flight, "a write refused 409 is held in flight as if it had landed"
    assert "LayoutPlanned" not in [r for r, _ in c.posted]


async def test_a_node_deleted_while_the_round_plans_keeps_no_reservation(make, monkeypatch):
    """n1 is deleted while the plan putting ml/a on its free slice runs in its thread: ml/a is not
    reserved on a node that is gone (held reservation_s for nothing, then a lapse counted)."""
    free = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0), MigInstance(profile="3g.40gb", start=4, used=True)])]), "p0")
    n1 = node("n1", count=1, annotations=free)
    n2 = node("n2", count=1, annotations=encode_status(NodeLayout(node="n2", mode="mig", gpus=[GpuLayout(index=0)]), "q0"))
    c = make([n1, n2], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    decide_with = c.loop.decide_with

    def planning_thread(snapshot, catalog, state):
        result = decide_with(snapshot, catalog, state)
        assert [(p.pod, p.node) for p in result.placements] == [("ml/a", "n1")]
        del c.nodes.cache["n1"]  # as the event loop would, while the thread plans
        c._on_node("DELETED", n1)
        return result

    monkeypatch.setattr(c.loop, "decide_with", planning_thread)
    await c.plan_round()
    assert "ml/a" not in c.reserved, f"reserved on a deleted node: {c.reserved}"


async def test_a_drain_survives_its_nodes_acknowledgement_while_the_round_runs(make, monkeypatch):
    """n1's GPU is drained for ml/big (a plan in flight); its agent acknowledges while the next round
    builds its snapshot (n1 left out): the drain stays on n1, no second node is drained for ml/big."""
    t = [1000.0]

    def busy(name: str, plan: str) -> dict[str, Any]:
        return node(name, count=1, annotations=encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(
            index=0, mig=[MigInstance(profile="1g.10gb", start=0, used=True)])]), plan))

    c = make([busy("n1", "p0"), busy("n2", "q0")], Lead(term=3))
    c.settings = c.loop.settings = c.settings.model_copy(update={"drain_after_s": 100.0, "drain_max_gpus": 1})
    c.clock = lambda: t[0]
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1"})
    await c.plan_round()
    t[0] += 100.0
    await c.plan_round()
    [(name, patch)] = c.written
    assert name == "n1" and patch["dynpart.io/spec-drain"] == "0" and "n1" in c.in_flight
    n1 = c.nodes.cache["n1"]  # the spec lands on the cached node
    written = {**n1["metadata"]["annotations"], **{k: v for k, v in patch.items() if v is not None}}
    c.nodes.cache["n1"] = {**n1, "metadata": {**n1["metadata"], "annotations": written, "resourceVersion": "8"}}
    snapshot = controller_module._snapshot_without_collector

    def acknowledged_meanwhile(*args, **kwargs):
        view = snapshot(*args, **kwargs)
        acked = dict(c.nodes.cache["n1"])
        acked["metadata"] = {**acked["metadata"], "resourceVersion": "9", "annotations": {
            **acked["metadata"]["annotations"], STATUS_PLAN: patch["dynpart.io/spec-plan"]}}
        c.nodes.cache["n1"] = acked
        c._on_node("MODIFIED", acked)  # the node watch, while the thread builds the snapshot
        return view

    monkeypatch.setattr(controller_module, "_snapshot_without_collector", acknowledged_meanwhile)
    t[0] += 1.0
    await c.plan_round()
    assert "n1" not in c.in_flight
    assert [n for n, _ in c.written] == ["n1"], f"a second node drained for the same pod: {c.written[1:]}"
    assert {k: d.node for k, d in c.loop.drains.items()} == {"ml/big": "n1"}


async def test_an_acknowledgement_crossing_the_revocation_leaves_no_pod_reserved(make, monkeypatch):
    """The agent, still applying overdue p1, writes status-plan p1 over the revocation (no
    precondition on its status writes); the watch delivers it before the revocation's answer. The
    pods told PlanNotApplied ("planned again") are not kept reserved on n1, whose slices the
    revocation destroys."""
    spec = UNACKED
    c = make([reported("n1", spec)], Lead(term=3), ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    c.in_flight["n1"] = InFlight("p1", 0.0, {"ml/a"})
    patch_node = controller_module.patch_node_annotations

    async def revoked_then_acknowledged(core, name, patch, resource_version=None):
        await patch_node(core, name, patch, resource_version)
        n1 = c.nodes.cache[name]
        ann = {k: v for k, v in {**n1["metadata"]["annotations"], **patch}.items() if v is not None}
        ann[STATUS_PLAN] = "p1"  # the agent's late acknowledgement of p1, on top of the revocation
        c.nodes.cache[name] = {**n1, "metadata": {**n1["metadata"], "annotations": ann, "resourceVersion": "9"}}
        c._on_node("MODIFIED", c.nodes.cache[name])  # the watch, before the patch's answer
        return {}

    monkeypatch.setattr(controller_module, "patch_node_annotations", revoked_then_acknowledged)
    await c._expire_acks(now=10.0)
    assert c.in_flight["n1"].revoking and [r for r, _ in c.posted] == ["PlanNotApplied", "PlanRevoked"]
    assert "ml/a" not in c.reserved, f"told it is planned again, but held: {c.reserved}"


async def test_a_mode_switch_is_not_written_for_a_label_changed_back_while_the_round_runs(make, monkeypatch):
    """m1 relabelled mps (agent and acknowledged spec in mig) is switching; its label goes back to mig
    while the snapshot is built: no switch to mps lands (the API server refuses stale versions)."""
    from dynpart.kube.errors import APIConflictError

    status = encode_status(NodeLayout(node="m1", mode="mig", gpus=[GpuLayout(index=0)]), "p0")
    m1 = node("m1", mode="mps", count=1, annotations={**status, "dynpart.io/spec-plan": "p0",
                                                      "dynpart.io/spec-mode": "mig"})
    c = make([m1], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/gpu-10gb": "1"})
    snapshot = controller_module._snapshot_without_collector

    def relabelled_meanwhile(*args, **kwargs):
        view = snapshot(*args, **kwargs)
        back = {**m1, "metadata": {**m1["metadata"], "resourceVersion": "8", "labels": {
            **m1["metadata"]["labels"], "dynpart.io/gpu-partitioning": "mig"}}}
        c.nodes.cache["m1"] = back
        c._on_node("MODIFIED", back)
        return view

    async def api_server(core, name, patch, resource_version=None):
        if resource_version != c.nodes.cache[name]["metadata"]["resourceVersion"]:
            raise APIConflictError("the object has been modified", status=409)
        c.written.append((name, patch))
        return {}

    monkeypatch.setattr(controller_module, "_snapshot_without_collector", relabelled_meanwhile)
    monkeypatch.setattr(controller_module, "patch_node_annotations", api_server)
    await c.plan_round()
    assert [(n, p.get("dynpart.io/spec-mode")) for n, p in c.written] == [], "switched to a mode no longer labelled"


async def test_a_pod_deleted_while_the_round_adopts_is_not_planned(make, monkeypatch):
    """helper-147's review: the round read its pods before the adoption's writes (a new leader may
    make hundreds) and planned a slice for a pod deleted meanwhile."""
    old = {"dynpart.io/spec-plan": "late", SPEC_TERM: "2", SPEC_PODS: "ml/x"}
    c = make([reported("n0", old), reported("n1")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.pods.cache["ml/x"] = pod("x", {"nvidia.com/mig-1g.10gb": "1"}, unschedulable=False)
    recorded = controller_module.patch_node_annotations

    async def patch(core, name, p, resource_version=None):
        if p == {SPEC_TERM: "3"}:  # the adoption's write; the watch meanwhile: ml/a deleted
            gone = c.pods.cache.pop("ml/a")
            c._on_pod("DELETED", gone)
        return await recorded(core, name, p, resource_version)

    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    await c.plan_round()
    assert ("n0", {SPEC_TERM: "3"}) in c.written
    assert not any("ml/a" in (p.get(SPEC_PODS) or "") for _, p in c.written)


@pytest.mark.parametrize("how", ["deleted", "bound"])
async def test_a_node_whose_planned_pods_went_while_planning_is_not_reconfigured(make, monkeypatch, how):
    """The plan runs from the objects read at the round's start: a pod deleted or bound by then
    gets no slice made for it (nobody would use it); a node that also hosts a pod still waiting
    is written."""
    c = make([reported("n1"), reported("n2")], Lead(term=3))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-7g.80gb": "1"})
    c.pods.cache["ml/b"] = pod("b", {"nvidia.com/mig-7g.80gb": "1"})
    decide = c.loop.decide_with

    def decide_while_a_goes(*args, **kwargs):
        result = decide(*args, **kwargs)
        if how == "deleted":
            del c.pods.cache["ml/a"]
        else:
            c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-7g.80gb": "1"}, node="elsewhere", unschedulable=False)
        return result

    monkeypatch.setattr(c.loop, "decide_with", decide_while_a_goes)
    await c.plan_round()
    where = {p.get(SPEC_PODS): n for n, p in c.written if p.get(SPEC_PODS)}
    assert list(where) == ["ml/b"], c.written  # (one free GPU per node: a and b on two nodes)
    assert "ml/a" not in c.loop.reserved and c.wake.is_set()


def _busy(name: str, plan: str) -> dict[str, Any]:
    # two GPUs, each with one used 1g.10gb: a 7g.80gb fits nowhere; a 1g.10gb fits beside either
    return node(name, count=2, annotations=encode_status(NodeLayout(node=name, mode="mig", gpus=[
        GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0, used=True)]),
        GpuLayout(index=1, mig=[MigInstance(profile="1g.10gb", start=0, used=True)])]), plan))


async def test_a_node_whose_planned_pod_went_is_still_written_when_its_drain_flags_change(make, monkeypatch):
    """helper-149: a drain started in the round that planned a pod deleted meanwhile on the same
    node: the node was skipped, yet the loop counted the drain flag written; no later round wrote it."""
    t = [1000.0]
    c = make([_busy("n1", "p0")], Lead(term=3))
    c.settings = c.loop.settings = c.settings.model_copy(update={"drain_after_s": 100.0, "drain_max_gpus": 1})
    c.clock = lambda: t[0]
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1"})
    await c.plan_round()  # big first seen, unplaced, no drain yet
    assert c.written == []
    t[0] += 100.0
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-1g.10gb": "1"})
    decide = c.loop.decide_with

    def decide_while_a_goes(*args, **kwargs):
        result = decide(*args, **kwargs)
        del c.pods.cache["ml/a"]  # deleted while the round planned
        return result

    monkeypatch.setattr(c.loop, "decide_with", decide_while_a_goes)
    await c.plan_round()
    monkeypatch.setattr(c.loop, "decide_with", decide)
    for _ in range(3):  # later rounds, nothing else changes (the drained GPU's slice still used)
        t[0] += 10.0
        await c.plan_round()
    assert c.loop.drains, "a drain is held for ml/big"
    assert any(p.get("dynpart.io/spec-drain") for _, p in c.written), \
        "the drain the loop holds (and counts as flagged) was never written to n1"
