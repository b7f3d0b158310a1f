"""A node made again under its name (helper-111: the controller's shell against what a real API server does)."""

from __future__ import annotations

import copy

from dynpart.planner.loop import InFlight
from tests.controller.test_cluster_view import pod
from tests.controller.test_controller_checks import MIG_1G, make  # noqa: F401  # (the fixture)
from tests.controller.test_in_flight import reported
from tests.kube.fakes import FakeResponse

SPEC_PLAN = "dynpart.io/spec-plan"


async def test_a_node_made_again_under_its_name_seen_by_a_relist_is_a_new_node(make):  # noqa: F811
    """After a watch gap (410 Gone: the informer lists again) a node deleted and made again under
    its name (a cloud instance replaced: GKE and EKS reuse node names) arrives as MODIFIED with
    another uid, never as DELETED (client-go's Replace does the same). The plan in flight on the
    old node can no longer be applied (the new Node has no spec), so, as for a deletion the watch
    delivers, its pods are planned again at once (PlanNotApplied), not held for ack_timeout_s;
    its reservations end too."""
    old = reported("n1", {SPEC_PLAN: "p1"}, status_plan="p0")
    old["metadata"]["uid"] = "uid-1"
    c = make([old])
    c._on_node("ADDED", old)
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.pods.cache["ml/b"] = pod("b", {MIG_1G: "1"})
    c._waiting |= {"ml/a", "ml/b"}
    c.loop.in_flight["n1"] = InFlight("p1", 0.0, {"ml/a"})
    c.loop.reserve("ml/b", "n1", 0.0)
    new = copy.deepcopy(old)
    new["metadata"].update(uid="uid-2", resourceVersion="99", annotations={})  # its agent has not reported yet

    async def list_nodes(**_: object) -> FakeResponse:
        return FakeResponse(200, {"kind": "NodeList", "metadata": {"resourceVersion": "100"}, "items": [new]})
    c.nodes.list_fn = list_nodes
    await c.nodes._relist()
    await c._expire_acks(now=1.0)  # the next step, long before ack_timeout_s
    assert "n1" not in c.in_flight, "the plan on the node that was deleted is still waited for"
    assert "ml/a" in c.window.members and "ml/b" not in c.reserved
    assert [m for m, _, _ in c.api.of("PlanNotApplied")], "its pod is not told"


async def test_a_pod_made_again_under_its_name_seen_by_a_relist_gets_its_own_events(make):  # noqa: F811
    """A pod deleted and made again under its name during a watch gap (a StatefulSet replica, a
    Job's pod named by hand) is seen by the relist only: the old one is gone first, so the Events
    posted about it are forgotten and the new pod is told why it waits at once, not an hour later
    (the recorder remembers Events by kind, namespace and name; `kubectl describe` shows those of
    the pod's own uid)."""
    c = make([])
    old = pod("a", {MIG_1G: "1"})
    old["metadata"].update(uid="uid-1", resourceVersion="5")
    c.pods.cache["ml/a"] = old
    c._on_pod("ADDED", old)
    assert await c.events.record(old, "Unplaceable", "no room for nvidia.com/mig-1g.10gb", warning=True)
    new = copy.deepcopy(old)
    new["metadata"].update(uid="uid-2", resourceVersion="9")

    async def list_pods(**_: object) -> FakeResponse:
        return FakeResponse(200, {"kind": "PodList", "metadata": {"resourceVersion": "100"}, "items": [new]})
    c.pods.list_fn = list_pods
    await c.pods._relist()
    assert "ml/a" in c._waiting
    assert await c.events.record(c.pods.cache["ml/a"], "Unplaceable", "no room for nvidia.com/mig-1g.10gb",
                                 warning=True), "the new pod's Event is held back as the old pod's repeat"
