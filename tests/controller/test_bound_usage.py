"""The bound pods' requests and the nodes' views kept from round to round (`BoundUsage`,
`NodeViews`) never change a round's view: a round with them gives exactly what a round without
them gives, whatever happened in between to the pods as the API server does it (a pod replaced by
a newer object, under a new resourceVersion; deleted; made again under its name; bound, resized,
ended) or as a fake one may (the same object changed under a new resourceVersion), and to the
nodes (changed in place too, under the same resourceVersion, as tests' fakes do); an unchanged pod
is not read again, an unchanged node not built again. Pods are told apart by uid and
resourceVersion (the API server changes an object only as a new one with a new resourceVersion),
nodes by content."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client

from dynpart.planner.cluster_view import BoundUsage, NodeDecodes, NodeViews, build_snapshot
from tests.controller.test_cluster_view import pod
from tests.controller.test_node_decodes import CAT, MIG_1G, OPERATIONS, apply, comparable, quiet_controller, variant

NODES = [variant(name, 1, 0, 0, 0) for name in ("n1", "n2")]
_versions = itertools.count(100)

# what a pod can ask for and be: each a form a real cluster (or a broken writer) may give
REQUESTS: list[dict[str, str]] = [
    {MIG_1G: "1", "cpu": "2", "memory": "1Gi"},
    {MIG_1G: "2", "cpu": "500m"},
    {"cpu": "3", "ephemeral-storage": "1Gi"},
    {MIG_1G: "1", "cpu": "lots"},  # unreadable: its node is left out
    {"nvidia.com/mig-3g.40gb": "1", "memory": "8Gi"},
]
STATES = ["running", "bound", "nominated", "pending", "succeeded", "resized", "init"]


def version() -> str:
    return str(next(_versions))


def make(name: str, req: int, state: str, node: str) -> dict[str, Any]:
    resources = copy.deepcopy(REQUESTS[req])
    if state in ("pending", "nominated"):
        p = pod(name, resources)
        if state == "nominated":
            p["status"]["nominatedNodeName"] = node
    else:
        p = pod(name, resources, phase={"succeeded": "Succeeded", "bound": "Pending"}.get(state, "Running"),
                node=node, unschedulable=False)
    if state == "resized":  # an in-place resize the kubelet admitted: the larger CPU counts
        p["status"]["containerStatuses"] = [{"name": "c", "resources": {"requests": {"cpu": "6"}},
                                             "allocatedResources": {"cpu": "6"}}]
    if state == "init":  # an init container asking for more slices than the containers
        p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {MIG_1G: "3"}}}]
    p["metadata"].update(uid=f"uid-{name}-{version()}", resourceVersion=version())
    return p


POD_CHANGES = st.one_of(
    st.tuples(st.just("keep")),
    st.tuples(st.just("delete")),
    # a newer object of the pod (an update: its uid kept), or a pod made again under its name (a new uid)
    st.tuples(st.just("update"), st.integers(0, len(REQUESTS) - 1), st.sampled_from(STATES),
              st.sampled_from(["n1", "n2"])),
    st.tuples(st.just("again"), st.integers(0, len(REQUESTS) - 1), st.sampled_from(STATES),
              st.sampled_from(["n1", "n2"])),
    st.tuples(st.just("no version")),  # an object without a resourceVersion: read every round
    # the same object changed under a new resourceVersion (as a fake API server may)
    st.tuples(st.just("in place"), st.integers(0, len(REQUESTS) - 1), st.sampled_from(STATES),
              st.sampled_from(["n1", "n2"])),
)


def change(pods: dict[str, dict[str, Any]], name: str, op: tuple[Any, ...]) -> None:
    if op[0] == "delete":
        pods.pop(name, None)
    elif op[0] == "update" and name in pods:
        new = make(name, *op[1:])
        new["metadata"]["uid"] = pods[name]["metadata"]["uid"]
        pods[name] = new
    elif op[0] in ("update", "again"):
        pods[name] = make(name, *op[1:])
    elif op[0] == "in place" and name in pods:
        new, old = make(name, *op[1:]), pods[name]
        old.clear()
        old.update(new)
    elif op[0] == "no version" and name in pods:
        new = copy.deepcopy(pods[name])
        new["metadata"].pop("resourceVersion", None)
        pods[name] = new


def assert_same_round(pods: list[dict[str, Any]], usage: BoundUsage) -> Any:
    """A round with `usage` and one without see the same; the one with it is returned."""
    fresh = build_snapshot(copy.deepcopy(NODES), copy.deepcopy(pods), CAT)
    kept = build_snapshot(NODES, pods, CAT, decodes=NodeDecodes(), usage=usage)
    assert comparable(kept) == comparable(fresh)
    return kept


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(POD_CHANGES, POD_CHANGES, POD_CHANGES, POD_CHANGES), min_size=1, max_size=6))
def test_a_round_with_the_kept_usage_sees_what_a_round_without_sees(rounds):
    names = ("a", "b", "c", "d")
    pods = {name: make(name, 0, "running", "n1") for name in names}
    usage = BoundUsage()
    assert_same_round(list(pods.values()), usage)
    for ops in rounds:
        for name, op in zip(names, ops, strict=True):
            change(pods, name, op)
        assert_same_round(list(pods.values()), usage)
        assert len(usage) <= len(pods)  # the pods gone or replaced are forgotten


def test_an_unchanged_pod_is_read_once_and_a_newer_object_again():
    pods = [make("a", 0, "running", "n1"), make("b", 0, "running", "n2"), make("c", 2, "running", "n2")]
    usage = BoundUsage()
    first = assert_same_round(pods, usage)
    assert usage.read == 3
    assert_same_round(pods, usage)
    assert usage.read == 3
    # b resized: the API server's newer object, which the watch cache puts in place of the old one
    resized = make("b", 0, "resized", "n2")
    pods[1] = resized
    second = assert_same_round(pods, usage)
    assert usage.read == 4 and len(usage) == 3
    cpu = {n.name: n.cpu_milli_free for n in first.snapshot.nodes}
    assert {n.name: n.cpu_milli_free for n in second.snapshot.nodes} == {"n1": cpu["n1"], "n2": cpu["n2"] - 4000}
    # a relist's copy (the same uid and resourceVersion: the same version of the pod) is served
    pods[0] = copy.deepcopy(pods[0])
    assert_same_round(pods, usage)
    assert usage.read == 4
    # a pod made again under its name (a new uid) is read again, and the old one forgotten
    pods[0] = make("a", 2, "running", "n1")
    assert_same_round(pods, usage)
    assert usage.read == 5 and len(usage) == 3
    # a pod without a resourceVersion is read every round, and not kept
    del pods[2]["metadata"]["resourceVersion"]
    assert_same_round(pods, usage)
    assert_same_round(pods, usage)
    assert usage.read == 7 and len(usage) == 2


async def test_the_controllers_rounds_keep_the_bound_pods_usage(monkeypatch):
    """The controller's rounds read an unchanged bound pod once."""
    api = client.ApiClient()
    c = quiet_controller(monkeypatch, api)
    c.nodes.cache.update({n["metadata"]["name"]: copy.deepcopy(n) for n in NODES})
    c.pods.cache.update({f"ml/{p['metadata']['name']}": p for p in (make("a", 0, "running", "n1"),
                                                                    make("b", 2, "running", "n2"))})
    # no node has the CPU: no plan, and every round reads the nodes and their pods
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1", "cpu": "100"})
    try:
        for _ in range(3):
            await c.plan_round()
    finally:
        await api.close()
    assert c._usage.read == 2 and c._node_views.built == 2


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(OPERATIONS, OPERATIONS, POD_CHANGES, POD_CHANGES, POD_CHANGES), min_size=1, max_size=6))
def test_a_round_with_the_kept_views_sees_what_a_round_without_sees(rounds):
    """Nodes changed (in place too, as tests' fakes do) and pods changed between rounds: a round
    with the kept decodes, usage and views sees exactly what a round without them sees."""
    cluster = {name: variant(name, 1, 0, 0, 0) for name in ("n1", "n2")}
    names = ("a", "b", "c")
    pods = {name: make(name, 0, "running", "n1" if name == "a" else "n2") for name in names}
    kept = (NodeDecodes(), BoundUsage(), NodeViews())

    def same() -> None:
        fresh = build_snapshot(copy.deepcopy(list(cluster.values())), copy.deepcopy(list(pods.values())), CAT)
        view = build_snapshot(list(cluster.values()), list(pods.values()), CAT, decodes=kept[0], usage=kept[1],
                              node_views=kept[2])
        assert comparable(view) == comparable(fresh)
        assert len(kept[2]) <= len(cluster)

    same()
    for ops in rounds:
        for name, op in zip(("n1", "n2"), ops[:2], strict=True):
            apply(cluster, name, op)
        for name, op in zip(names, ops[2:], strict=True):
            change(pods, name, op)
        same()


def test_an_unchanged_node_is_built_once():
    nodes = [variant(name, 1, 0, 0, 0) for name in ("n1", "n2")]
    pods = [make("a", 0, "running", "n1"), make("b", 0, "running", "n2")]
    kept = (NodeDecodes(), BoundUsage(), NodeViews())
    for _ in range(3):
        build_snapshot(nodes, pods, CAT, decodes=kept[0], usage=kept[1], node_views=kept[2])
    assert kept[2].built == 2
    pods[1] = make("b", 1, "running", "n2")  # a newer object of b: its node only
    build_snapshot(nodes, pods, CAT, decodes=kept[0], usage=kept[1], node_views=kept[2])
    assert kept[2].built == 3
    nodes[0]["status"]["allocatable"]["cpu"] = "3"  # in place, under the same resourceVersion
    view = build_snapshot(nodes, pods, CAT, decodes=kept[0], usage=kept[1], node_views=kept[2])
    assert kept[2].built == 4 and {n.name: n.cpu_milli_free for n in view.snapshot.nodes}["n1"] == 1000


def test_a_node_whose_parts_are_not_strings_is_built_each_round():
    """Parts the API server gives as strings, given otherwise (a fake's): equal values may read
    differently (1 == True, and a quantity True is refused), and a status that is not a mapping
    fails the node: such a node is built each round, never served from an entry."""
    n1 = variant("n1", 1, 0, 0, 0)
    n1["status"]["allocatable"]["cpu"] = 1
    kept = (NodeDecodes(), BoundUsage(), NodeViews())

    def same() -> None:
        fresh = build_snapshot(copy.deepcopy([n1]), [], CAT)
        view = build_snapshot([n1], [], CAT, decodes=kept[0], usage=kept[1], node_views=kept[2])
        assert comparable(view) == comparable(fresh)

    same()
    n1["status"]["allocatable"]["cpu"] = True  # in place: equal to 1
    same()
    n1["status"] = "x"
    same()
    assert kept[2].built == 3 and not len(kept[2])
