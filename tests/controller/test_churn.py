"""What the planner says about a lasting state is said once: an Event that does not change while the
state lasts (nothing in it that other pods' plans change), and a log line when the state appears or
changes, not one every round."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes_asyncio import client

from dynpart.annotations import encode_status
from dynpart.catalog import default_catalog
from dynpart.kube.recording import EventRecorder
from dynpart.planner import controller as controller_module
from dynpart.planner.controller import PlannerController
from dynpart.planner.loop import InFlight
from dynpart.settings import PlannerSettings
from dynpart.snapshot import GpuLayout, MigInstance, NodeLayout
from tests.controller.test_cluster_view import node, pod

CAT = default_catalog()


def full(name: str) -> dict[str, Any]:
    """A node whose only GPU a 7g.80gb in use fills."""
    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="7g.80gb", start=0, used=True)])]), "p0")
    return node(name, count=1, annotations={**status, "dynpart.io/spec-plan": "p0"})


def controller(monkeypatch, nodes: list[dict[str, Any]]) -> tuple[PlannerController, list[tuple[str, str, str]]]:
    posted: list[tuple[str, str, str]] = []

    async def post(obj, reason, message, warning):
        posted.append((obj["metadata"]["name"], reason, message))

    async def fake_patch(*args, **kwargs):
        return {}

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    c = PlannerController(client.ApiClient(), PlannerSettings(), CAT)
    c.events = EventRecorder(post, c.settings.kube)
    c.nodes.cache.update({n["metadata"]["name"]: n for n in nodes})
    return c, posted


async def test_an_unplaceable_pods_event_does_not_change_with_other_pods_plans(monkeypatch, caplog):
    """Another pod's plan in flight on n3 every other round takes n3 out of those rounds: the pod's
    Unplaceable Event is posted once (no count of nodes, no note on nodes left out that comes and
    goes), and its `pod not placed` line is logged at INFO once."""
    c, posted = controller(monkeypatch, [full("n1"), full("n2"), full("n3")])
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1"})
    caplog.set_level(logging.DEBUG, logger="dynpart.planner")
    for r in range(6):
        c.loop.in_flight.clear()
        if r % 2:
            c.loop.in_flight["n3"] = InFlight("px", 0.0, {"ml/other"})
        await c.plan_round()
    assert [(name, reason) for name, reason, _ in posted] == [("big", "Unplaceable")], posted
    assert "on the nodes it may use" in posted[0][2] and "candidate node" not in posted[0][2]
    lines = [r for r in caplog.records if r.getMessage() == "pod not placed"]
    assert len(lines) == 6 and [r.levelno for r in lines] == [logging.INFO] + [logging.DEBUG] * 5


async def test_a_nodes_lasting_problems_are_one_event_and_logged_once(monkeypatch, caplog):
    """Two problems on one node: one DynpartInvalid Event with both (two Events of one reason on one
    object would replace each other in the recorder and be posted again every round), each problem
    logged at WARNING when it first appears, then at DEBUG."""
    n1 = full("n1")
    n1["metadata"]["labels"]["nvidia.com/gpu.count"] = "many"
    n1["metadata"]["annotations"]["dynpart.io/status-capability"] = "not json"
    c, posted = controller(monkeypatch, [n1])
    caplog.set_level(logging.DEBUG, logger="dynpart.planner")
    for _ in range(3):
        await c.plan_round()
    [(name, reason, message)] = posted
    assert (name, reason) == ("n1", "DynpartInvalid")
    assert "status-capability" in message and "nvidia.com/gpu.count='many'" in message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("node n1")]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
