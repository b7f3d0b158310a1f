"""The controller's memory of what it wrote lives in the cluster: a new leader recovers the pods
planned onto unacknowledged nodes from the spec annotations; a spec from a deposed leader (an
older term) is not waited for; an unacknowledged plan is revoked before its pods go elsewhere;
a leader that cannot prove it leads writes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from dynpart.annotations import SPEC_PODS, SPEC_TERM, decode_spec, encode_status
from dynpart.catalog import default_catalog
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

    def build(nodes: list[dict[str, Any]], lead: Lead, ack_timeout_s: float = 60.0) -> PlannerController:
        c = PlannerController(client.ApiClient(), PlannerSettings(ack_timeout_s=ack_timeout_s), CAT, leadership=lead)
        c.nodes.cache.update({n["metadata"]["name"]: n for n in nodes})

        async def event(obj, reason, message, warning=False):
            events.append((reason, message))
        c._event = event  # type: ignore[method-assign]  # records instead of posting
        c.written, c.posted = written, events  # type: ignore[attr-defined]  # the test reads them
        return c
    return build


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
    spec = {"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
            SPEC_TERM: "3", SPEC_PODS: "ml/a"}
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
