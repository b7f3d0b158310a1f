"""The planner's gauges say what is true now, on the leader only: they are set from the caches at
every step (not only in a round, which runs only while pods wait), a standby exports none of their
series (two replicas must not both count the cluster's pods), a node that went loses its series,
and a pod can never add a label value of its own choosing. Events about pods that went are
forgotten, and Events not posted are counted."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client import Counter, Gauge

from dynpart.annotations import STATUS_CAPABILITY, encode_status
from dynpart.capability import encode_capability
from dynpart.catalog import default_catalog
from dynpart.planner import controller as controller_module
from dynpart.planner import metrics
from dynpart.planner.controller import PlannerController
from dynpart.settings import KubeSettings, PlannerSettings
from dynpart.snapshot import GpuLayout, NodeLayout
from tests.controller.test_cluster_view import node, pod
from tests.test_capability import kind_of, node_of

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")
MIG_1G = "nvidia.com/mig-1g.10gb"


class Lead:
    term = 1

    def can_write(self) -> bool:
        return True

    def write_time_left_s(self) -> float:
        return float("inf")


def series(gauge: Gauge | Counter) -> dict[str, float]:
    """The gauge's series: its one label's value -> the value."""
    return {next(iter(s.labels.values())): round(s.value, 3) for m in gauge.collect() for s in m.samples
            if not s.name.endswith("_created")}


def reported(name: str, capability: str | None = None) -> dict[str, Any]:
    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0), GpuLayout(index=1)]), "p0")
    if capability is not None:
        status[STATUS_CAPABILITY] = capability
    return node(name, annotations={**status, "dynpart.io/spec-plan": "p0"})


def disagreeing_capability() -> str:
    """An H100 whose driver offers one 1g.10gb instance fewer than the catalog says."""
    model = H100.model_copy(update={"mig_profiles": tuple(p.model_copy(update={"max": p.max - 1}) if p.name == "1g.10gb"
                                                          else p for p in H100.mig_profiles)})
    return encode_capability(node_of(kind_of(model, "NVIDIA H100 80GB HBM3"), gpus=2))


@pytest.fixture
def make(monkeypatch):
    async def fake_patch(core, name, patch, resource_version=None):
        return {}

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    metrics.clear_cluster_gauges()  # the gauges are the process's: another test may have set them
    made: list[PlannerController] = []

    def build(nodes: list[dict[str, Any]], **settings: Any) -> PlannerController:
        c = PlannerController(client.ApiClient(), PlannerSettings(resync_s=0.01, batch_idle_s=0.01, batch_timeout_s=0.02,
                                                                  **settings), CAT, leadership=Lead())
        c.nodes.cache.update({n["metadata"]["name"]: n for n in nodes})
        t = [1000.0]
        c.clock = lambda: t[0]  # type: ignore[method-assign]  # the test moves time
        c.time = t  # type: ignore[attr-defined]
        c.leading.set()
        made.append(c)
        return c
    yield build
    metrics.clear_cluster_gauges()


def add(c: PlannerController, p: dict[str, Any], kind: str = "ADDED") -> None:
    key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
    if kind == "DELETED":
        c.pods.cache.pop(key, None)
    else:
        c.pods.cache[key] = {"kind": "Pod", **p}
    c._on_pod(kind, {"kind": "Pod", **p})


async def test_the_gauges_follow_the_cluster_after_the_pods_are_placed(make):
    """The reviewer's case: 3 pods planned and bound, then 5 hours of steps without a round."""
    c = make([reported("n1")])
    for i in range(3):
        add(c, pod(f"p{i}", {MIG_1G: "1"}))
    c.time[0] += 1
    await c._step()
    assert series(metrics.PENDING_PODS) == {MIG_1G: 3.0} and series(metrics.WORKLOAD_WEIGHT) == {MIG_1G: 3.0}
    for i in range(3):  # the scheduler binds them
        add(c, pod(f"p{i}", {MIG_1G: "1"}, phase="Running", node="n1", unschedulable=False), "MODIFIED")
    c.time[0] += 1
    await c._step()
    assert series(metrics.PENDING_PODS) == {}, "nothing waits any more"
    for _ in range(5):
        c.time[0] += 3600
        await c._step()
    assert series(metrics.PENDING_PODS) == {}
    assert series(metrics.WORKLOAD_WEIGHT) == {MIG_1G: round(3 * 0.5 ** ((5 * 3600 + 1) / 3600), 3)}, "decayed"
    c.time[0] += 20 * 3600
    await c._step()
    assert series(metrics.WORKLOAD_WEIGHT) == {}, "decayed below the floor: forgotten"


async def test_a_replica_that_loses_the_lease_exports_none_of_the_gauges(make):
    c = make([reported("n1", disagreeing_capability())])
    add(c, pod("p0", {MIG_1G: "1"}))
    c.time[0] += 1
    await c._step()
    assert series(metrics.PENDING_PODS) and series(metrics.WORKLOAD_WEIGHT)
    assert series(metrics.CATALOG_DISAGREEMENTS)["n1"] > 0
    c.set_leading(False)
    assert (series(metrics.PENDING_PODS), series(metrics.WORKLOAD_WEIGHT), series(metrics.CATALOG_DISAGREEMENTS)) \
        == ({}, {}, {})
    metrics.PENDING_PODS.labels(MIG_1G).set(7)  # whatever set them meanwhile: a standby's step clears them
    await c._step()
    assert series(metrics.PENDING_PODS) == {}
    c.set_leading(True)  # the lease again: the gauges are the cluster's as this replica sees it
    await c._step()
    assert series(metrics.PENDING_PODS) == {MIG_1G: 1.0} and series(metrics.CATALOG_DISAGREEMENTS)["n1"] > 0


async def test_a_node_that_goes_or_agrees_again_loses_its_disagreement_series(make):
    c = make([reported("n1", disagreeing_capability()), reported("n2", disagreeing_capability())])
    await c._step()  # no pod waits: no round, and still the gauge is set
    assert set(series(metrics.CATALOG_DISAGREEMENTS)) == {"n1", "n2"}
    del c.nodes.cache["n2"]
    c.nodes.cache["n1"] = reported("n1", encode_capability(node_of(kind_of(H100, "NVIDIA H100 80GB HBM3"), gpus=2)))
    await c._step()  # within GAUGES_EVERY_S of the last refresh: not read again (it reads every pod)
    assert set(series(metrics.CATALOG_DISAGREEMENTS)) == {"n1", "n2"}
    c.time[0] += controller_module.GAUGES_EVERY_S
    await c._step()
    assert series(metrics.CATALOG_DISAGREEMENTS) == {}


async def test_a_pod_cannot_add_a_label_value_of_its_own(make):
    """Resources no GPU of the catalog offers, names dynpart refuses, two resources in one pod:
    one `invalid` series, however many such names the pods ask for."""
    mps = node("m1", mode="mps", count=1, annotations=encode_status(NodeLayout(node="m1", mode="mps", gpus=[
        GpuLayout(index=0)]), "p0"))
    c = make([reported("n1"), mps])
    for i in range(50):
        add(c, pod(f"big{i}", {f"nvidia.com/gpu-{1000 + i}gb": "1"}))  # bigger than any GPU
    add(c, pod("zero", {"nvidia.com/gpu-0010gb": "1"}))  # leading zeros: refused
    add(c, pod("nine", {"nvidia.com/mig-9g.99gb": "1"}))  # a profile no GPU offers
    add(c, pod("two", {MIG_1G: "1", "nvidia.com/gpu-10gb": "1"}))
    add(c, pod("ok", {MIG_1G: "1"}))
    c.time[0] += 1
    await c._step()
    assert series(metrics.PENDING_PODS) == {"invalid": 53.0, MIG_1G: 1.0}
    weights = series(metrics.WORKLOAD_WEIGHT)
    assert set(weights) <= {"invalid", MIG_1G} and weights.get(MIG_1G) == 1.0, weights


async def test_the_configured_workload_is_exported_without_a_round(make):
    c = make([reported("n1")], workload=[{"resource": MIG_1G, "weight": 2.0}, {"resource": MIG_1G, "weight": 1.0,
                                                                             "gpu_models": ["H100-80GB"]}])
    await c._step()
    assert series(metrics.WORKLOAD_WEIGHT) == {MIG_1G: 3.0}


async def test_events_about_pods_that_went_are_forgotten_and_drops_are_counted(make):
    c = make([reported("n1")], kube=KubeSettings(event_memory=2))
    posted: list[str] = []

    async def post(obj, reason, message, warning):
        posted.append(obj["metadata"]["name"])
    c.events._post = post  # the recorder's posting, without an API server
    before = series(metrics.EVENTS_DROPPED).get("memory_full", 0.0)
    pods = [pod(f"p{i}", {MIG_1G: "1"}) for i in range(3)]
    for p in pods:
        add(c, p)
        await c._event(c.pods.cache[f"ml/{p['metadata']['name']}"], "Unplaceable", "no room", warning=True)
    assert posted == ["p0", "p1"] and len(c.events) == 2
    assert series(metrics.EVENTS_DROPPED)["memory_full"] == before + 1
    add(c, pods[0], "DELETED")
    add(c, pod("p1", {MIG_1G: "1"}, phase="Running", node="n1", unschedulable=False), "MODIFIED")  # bound
    assert len(c.events) == 0
    await c._event(c.pods.cache["ml/p2"], "Unplaceable", "no room", warning=True)
    assert posted == ["p0", "p1", "p2"]


async def test_events_the_spam_filter_holds_back_are_counted(make):
    c = make([reported("n1")])
    posted: list[str] = []

    async def post(obj, reason, message, warning):
        posted.append(message)
    c.events._post = post
    before = series(metrics.EVENTS_DROPPED).get("spam", 0.0)
    add(c, pod("p", {MIG_1G: "1"}))
    for i in range(30):  # a message that changes every round, about one pod
        await c._event(c.pods.cache["ml/p"], "Unplaceable", f"reason {i}", warning=True)
    assert len(posted) == 25 and series(metrics.EVENTS_DROPPED)["spam"] == before + 5


async def test_pods_meant_for_other_pools_are_not_counted_as_waiting_for_dynpart(make):
    c = make([reported("n1")])
    add(c, pod("mine", {MIG_1G: "1"}))
    add(c, pod("theirs", {MIG_1G: "1"}, nodeSelector={"pool": "static-mig"}))
    c.time[0] += 1
    await c._step()
    assert series(metrics.PENDING_PODS) == {MIG_1G: 1.0}
