"""The nodes' decoded annotations kept from round to round (`NodeDecodes`) never change a round's
view: a round with them gives exactly what a round without them gives, whatever changed in
between (an annotation, a label, allocatable, a taint; in place or in a new object, with or without
a new resourceVersion; a node deleted and made again under its name), and an unchanged node is not
decoded again."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client

from dynpart.annotations import encode_status
from dynpart.capability import encode_capability
from dynpart.catalog import Catalog, default_catalog
from dynpart.kube.conventions import STATUS_CAPABILITY, STATUS_HEARTBEAT
from dynpart.kube.recording import EventRecorder
from dynpart.planner import controller as controller_module
from dynpart.planner.cluster_view import ClusterView, NodeDecodes, build_snapshot
from dynpart.planner.controller import PlannerController
from dynpart.settings import PlannerSettings
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout
from tests.controller.test_cluster_view import node, pod
from tests.test_capability import kind_of, node_of

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")
MIG_1G = "nvidia.com/mig-1g.10gb"


def mig_status(*used: bool, plan: str = "p1") -> dict[str, str]:
    """GPU 0 carved in 1g.10gb instances, used as given; GPU 1 empty."""
    return encode_status(NodeLayout(node="n", mode="mig", gpus=[
        GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=s, used=u) for s, u in enumerate(used)]),
        GpuLayout(index=1)]), plan)


def mps_status(*used: bool) -> dict[str, str]:
    return encode_status(NodeLayout(node="n", mode="mps", gpus=[
        GpuLayout(index=0, mps=[MpsSlice(size=10, used=u) for u in used])]), "p1")


H100_REPORT = encode_capability(node_of(kind_of(H100, "NVIDIA H100 80GB HBM3"), gpus=2))

# what each part of a node can be: each a well-formed or an ill-formed form a real cluster (or a
# broken writer) may give
ANNOTATIONS: list[dict[str, Any]] = [
    {},
    mig_status(True, False, False),
    mig_status(True, True, False),
    mig_status(False, False, False, plan="p2"),
    {**mig_status(True, False), STATUS_CAPABILITY: H100_REPORT},
    {**mig_status(True, False), STATUS_CAPABILITY: "not json"},  # planned from the label, with a problem
    {**mig_status(True), STATUS_HEARTBEAT: "2026-01-01T00:00:00Z"},
    {**mig_status(True), STATUS_HEARTBEAT: "yesterday"},
    {**mig_status(False), "dynpart.io/status-gpu-0-1g.10gb-used": "garbage"},  # unreadable: layout incomplete
    {**mig_status(False), "dynpart.io/status-from-the-future": "x"},  # another version's key (skew)
    {**mig_status(False), "dynpart.io/status-gpu-1-1g.24gb-free": "1@0"},  # a profile H100 lacks (foreign)
    {**mig_status(False), "dynpart.io/status-error": "x" * (64 * 1024)},  # beyond what an agent writes
    {**mig_status(True), "dynpart.io/status-unhealthy": "0"},  # its instances kept as they are (kept)
    {**mig_status(True), "other.io/note": 5},  # not a string: never kept
    mps_status(True, False),
    {"dynpart.io/status-mode": "mps", "dynpart.io/status-plan": "p1"},
]
LABELS: list[dict[str, Any]] = [
    {},
    {"nvidia.com/gpu.count": "1"},
    {"nvidia.com/gpu.count": "many"},
    {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
    {"nvidia.com/gpu.product": "NVIDIA-Quantum"},
    {"dynpart.io/gpu-partitioning": "mps"},
    {"dynpart.io/gpu-partitioning": "both"},
    {"topology.kubernetes.io/zone": "a"},
    {"nvidia.com/gpu.count": 2},  # not a string: never kept
]
ALLOCATABLE: list[dict[str, Any]] = [
    {},
    {"cpu": "8"},
    {"cpu": "lots"},
    {MIG_1G: "1"},
    {"nvidia.com/gpu-10gb": "0"},
    {"ephemeral-storage": "10Gi"},
]
TAINTS: list[Any] = [
    None,
    [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
    [{"key": "dedicated", "effect": "NoExecute"}],
    [{"key": "k", "effect": "Sometimes"}],  # not an effect
]


def variant(name: str, a: int, lab: int, alloc: int, taint: int, rv: str = "7") -> dict[str, Any]:
    n = node(name, annotations=copy.deepcopy(ANNOTATIONS[a]))
    n["metadata"]["labels"].update(LABELS[lab])
    n["metadata"]["resourceVersion"] = rv
    n["status"]["allocatable"].update(ALLOCATABLE[alloc])
    if TAINTS[taint] is not None:
        n["spec"] = {"taints": copy.deepcopy(TAINTS[taint])}
    return n


PODS = [
    pod("on-n1", {MIG_1G: "1", "cpu": "2"}, phase="Running", node="n1", unschedulable=False),
    pod("to-n2", {MIG_1G: "1", "memory": "1Gi"}, node="n2", unschedulable=False),
    pod("mps-on-n3", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="n3", unschedulable=False),
    pod("wants", {MIG_1G: "1", "cpu": "1"}),
    pod("wants-mps", {"nvidia.com/gpu-10gb": "1"}),
]


def comparable(view: ClusterView) -> dict[str, Any]:
    """Every field of a view; its catalog by its models (a catalog compares by identity)."""
    out = {k: v for k, v in vars(view).items() if k not in ("snapshot", "catalog")}
    out["snapshot"] = view.snapshot.model_dump_json()
    out["models"] = view.catalog.models
    return out


def assert_same_round(nodes: list[dict[str, Any]], decodes: NodeDecodes, pods: list[dict[str, Any]] = PODS,
                      catalog: Catalog = CAT) -> ClusterView:
    """A round with `decodes` and one without see the same; the one with it is returned."""
    fresh = build_snapshot(copy.deepcopy(nodes), copy.deepcopy(pods), catalog)
    kept = build_snapshot(nodes, pods, catalog, decodes=decodes)
    assert comparable(kept) == comparable(fresh)
    return kept


# --- an operation on one node between two rounds ---------------------------------------------------

VARIANTS = st.tuples(st.integers(0, len(ANNOTATIONS) - 1), st.integers(0, len(LABELS) - 1),
                     st.integers(0, len(ALLOCATABLE) - 1), st.integers(0, len(TAINTS) - 1))
OPERATIONS = st.one_of(
    st.tuples(st.just("keep")),
    st.tuples(st.just("delete")),
    st.tuples(st.just("replace"), VARIANTS, st.sampled_from(["7", "8"])),  # a new object (rv 7: as the old one's)
    st.tuples(st.just("in place"), VARIANTS),  # the same object changed, its resourceVersion kept
)


def apply(cluster: dict[str, dict[str, Any]], name: str, op: tuple[Any, ...]) -> None:
    if op[0] == "delete":
        cluster.pop(name, None)
    elif op[0] == "replace":
        cluster[name] = variant(name, *op[1], rv=op[2])
    elif op[0] == "in place":
        new = variant(name, *op[1], rv=cluster[name]["metadata"]["resourceVersion"] if name in cluster else "7")
        if name not in cluster:
            cluster[name] = new
            return
        old = cluster[name]
        for part in ("labels", "annotations"):
            old["metadata"][part].clear()
            old["metadata"][part].update(new["metadata"][part])
        old["status"]["allocatable"].clear()
        old["status"]["allocatable"].update(new["status"]["allocatable"])
        old["spec"] = new.get("spec", {})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(OPERATIONS, OPERATIONS, OPERATIONS), min_size=1, max_size=6))
def test_a_round_with_the_kept_decodes_sees_what_a_round_without_sees(rounds):
    """Rounds after any changes, in place or not, see exactly what they would without `NodeDecodes`."""
    cluster = {name: variant(name, 1, 0, 0, 0) for name in ("n1", "n2", "n3")}
    decodes = NodeDecodes()
    assert_same_round(list(cluster.values()), decodes)
    for ops in rounds:
        for name, op in zip(("n1", "n2", "n3"), ops, strict=True):
            apply(cluster, name, op)
        assert_same_round(list(cluster.values()), decodes)
        assert len(decodes) <= len(cluster)  # the nodes gone are forgotten


def test_a_status_changed_in_place_is_read_again_not_served_stale():
    """Its agent reports a slice used, written into the same object under the same
    resourceVersion (as a test's fake API server does): the next round sees it used. A cache keyed
    on the object or its resourceVersion would still plan that slice as free."""
    n1 = variant("n1", 1, 0, 0, 0)
    decodes = NodeDecodes()
    first = assert_same_round([n1], decodes, pods=[])
    assert [m.used for m in first.snapshot.nodes[0].gpus[0].mig] == [True, False, False]
    annotations = n1["metadata"]["annotations"]
    annotations.clear()
    annotations.update(mig_status(True, True, False))
    second = assert_same_round([n1], decodes, pods=[])
    assert [m.used for m in second.snapshot.nodes[0].gpus[0].mig] == [True, True, False]
    # and a node deleted and made again, with another layout under the same resourceVersion
    again = variant("n1", 3, 0, 0, 0)
    assert again["metadata"]["resourceVersion"] == n1["metadata"]["resourceVersion"]
    third = assert_same_round([again], decodes, pods=[])
    assert [m.used for m in third.snapshot.nodes[0].gpus[0].mig] == [False, False, False] and third.acks == {"n1": "p2"}


def test_the_labels_allocatable_and_taints_of_a_node_are_read_each_round():
    """Only the decode of the agent's annotations is kept: a label, allocatable and taints changed
    in place are seen by the next round."""
    n1 = variant("n1", 1, 0, 0, 0)
    decodes = NodeDecodes()
    assert_same_round([n1], decodes)
    n1["metadata"]["labels"]["topology.kubernetes.io/zone"] = "b"
    n1["status"]["allocatable"]["cpu"] = "3"
    n1["spec"] = {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]}
    view = assert_same_round([n1], decodes)
    [planned] = view.snapshot.nodes
    assert planned.labels["topology.kubernetes.io/zone"] == "b" and planned.cpu_milli_free == 1000
    assert [t.key for t in planned.taints] == ["nvidia.com/gpu"]


def test_a_nodes_problems_are_the_same_every_round():
    """The decoded problems are shared between rounds: a round adding its own to them would make the
    next round's longer."""
    n1 = variant("n1", 5, 2, 0, 0)  # an unreadable capability report, a GPU count label that is not one
    decodes = NodeDecodes()
    views = [assert_same_round([n1], decodes) for _ in range(3)]
    assert len(views[0].problems) == 2 and all(v.problems == views[0].problems for v in views)


def test_an_unchanged_node_is_not_decoded_again_and_a_gone_one_is_forgotten():
    nodes = [variant(name, 1, 0, 0, 0) for name in ("n1", "n2", "n3")]
    decodes = NodeDecodes()
    assert_same_round(nodes, decodes)
    assert decodes.decoded == 3
    assert_same_round([copy.deepcopy(n) for n in nodes], decodes)  # new objects of the same content
    assert decodes.decoded == 3
    nodes[1]["metadata"]["annotations"][STATUS_HEARTBEAT] = "2026-01-01T00:00:00Z"
    assert_same_round(nodes, decodes)
    assert decodes.decoded == 4
    assert_same_round(nodes[:2], decodes)
    assert len(decodes) == 2
    # a node whose annotations hold anything but strings is decoded every round
    nodes[0]["metadata"]["annotations"]["other.io/note"] = 5
    assert_same_round(nodes[:2], decodes)
    assert_same_round(nodes[:2], decodes)
    assert decodes.decoded == 6


def test_another_catalog_decodes_every_node_again():
    """A node's model comes from the catalog: entries of another catalog never serve."""
    n1 = variant("n1", 1, 0, 0, 0)
    decodes = NodeDecodes()
    assert_same_round([n1], decodes)
    without_h100 = Catalog([m for m in CAT.models.values() if m.name != H100.name])
    view = assert_same_round([n1], decodes, catalog=without_h100)
    assert not view.snapshot.nodes and decodes.decoded == 2


def quiet_controller(monkeypatch: Any, api: client.ApiClient) -> PlannerController:
    """A controller whose node writes and Events go nowhere, for rounds on its caches."""
    async def fake_patch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    async def post(obj: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        pass

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    c = PlannerController(api, PlannerSettings(), CAT)
    c.events = EventRecorder(post, c.settings.kube)
    return c


async def test_the_controllers_rounds_keep_their_decodes(monkeypatch):
    """The controller's rounds decode an unchanged node once."""
    c = quiet_controller(monkeypatch, client.ApiClient())
    c.nodes.cache.update({n["metadata"]["name"]: n for n in (variant("n1", 2, 0, 0, 0), variant("n2", 2, 0, 0, 0))})
    # no node has the CPU: no plan, and every round reads both nodes
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1", "cpu": "100"})
    for _ in range(3):
        await c.plan_round()
    assert c._decodes.decoded == 2
