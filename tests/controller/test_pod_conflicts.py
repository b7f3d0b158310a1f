"""Required pod anti-affinity and host ports, as the kube-scheduler's InterPodAffinity and
NodePorts filters decide them: a pending pod is kept off the nodes (topology domains) where placed
pods conflict with it, and of two pending pods that conflict only the older is planned in a round,
unless they conflict on one node only (host ports, hostname anti-affinity): both are then planned,
kept apart.
Without it, the objective packed a Deployment's replicas onto one node's GPUs, where the scheduler
binds one: the others stayed pending with their slices free (a reviewer's scenario, below)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner.cluster_view import build_snapshot, pod_for_planning
from dynpart.planner.core import plan
from dynpart.planner.pod_conflicts import PlacedPods, PodFacts, pod_facts
from tests.controller.test_cluster_view import node, pod

CAT = default_catalog()
MIG_1G = {"nvidia.com/mig-1g.10gb": "1"}
HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"


def labelled(n: dict[str, Any], **labels: str) -> dict[str, Any]:
    n["metadata"]["labels"].update({HOST: n["metadata"]["name"], **labels})
    return n


def replica(name: str, app: str = "web", key: str = HOST, bound: str | None = None, **extra: Any) -> dict[str, Any]:
    p = pod(name, MIG_1G, phase="Running" if bound else "Pending", node=bound, unschedulable=not bound,
            affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": key, "labelSelector": {"matchLabels": {"app": app}}}]}}, **extra)
    p["metadata"]["labels"] = {"app": app}
    return pod_for_planning(p)  # as the controller's cache keeps it


def with_port(p: dict[str, Any], port: int, protocol: str = "TCP", ip: str | None = None) -> dict[str, Any]:
    p["spec"]["containers"][0]["ports"] = [{"containerPort": 80, "hostPort": port, "protocol": protocol,
                                            **({"hostIP": ip} if ip else {})}]
    return pod_for_planning(p)


def kept_off(view, name: str) -> set[str]:
    [p] = [p for p in view.snapshot.pending if p.name == name]
    return {v for t in p.node_affinity for r in t.match_fields if r.operator == "NotIn" for v in r.values}


def nodes4(**zones: str) -> list[dict[str, Any]]:
    return [labelled(node(f"n{i}", count=1), **({ZONE: zones[f"n{i}"]} if zones else {})) for i in range(1, 5)]


def planned_in_rounds(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], rounds: int) -> dict[str, str]:
    """Pod -> node over `rounds` rounds, each round's placements in flight for the next; a pod left
    for an older one the last round did not place is not left again (as the controller decides)."""
    in_flight: dict[str, str] = {}
    deferred: dict[str, str] = {}
    for _ in range(rounds):
        no_defer = {p: older for p, older in deferred.items() if older not in in_flight}
        view = build_snapshot(nodes, pods, CAT, exclude_pods=set(in_flight), in_flight=in_flight, no_defer=no_defer)
        deferred = view.deferred
        in_flight.update({pl.pod: pl.node for pl in plan(view.snapshot, CAT).placements})
    return in_flight


def apart(view) -> dict[str, list[str]]:
    return {p.name: p.apart for p in view.snapshot.pending if p.apart}


def test_a_replica_is_kept_off_the_node_of_a_bound_one_and_pending_ones_are_planned_together_kept_apart():
    """Anti-affinity on the hostname (every node its own domain) or host ports conflict on one node
    only: the pending pods are planned in one round, each listing the others (`PendingPod.apart`)."""
    nodes = nodes4()
    pods = [replica("web-0", bound="n1"), replica("web-1"), replica("web-2"), pod_for_planning(pod("other", MIG_1G))]
    view = build_snapshot(nodes, pods, CAT)
    assert {p.name for p in view.snapshot.pending} == {"ml/web-1", "ml/web-2", "ml/other"} and view.deferred == {}
    assert kept_off(view, "ml/web-1") == {"n1"} and kept_off(view, "ml/other") == set()
    assert apart(view) == {"ml/web-1": ["ml/web-2"], "ml/web-2": ["ml/web-1"]}
    result = plan(view.snapshot, CAT)
    where = {pl.pod: pl.node for pl in result.placements}
    assert len(where) == 3 and where["ml/web-1"] != where["ml/web-2"] and "n1" not in (where["ml/web-1"], where["ml/web-2"])


def test_the_younger_of_two_pods_conflicting_over_a_wider_domain_waits_a_round():
    """Zones of two nodes: of two pending replicas the younger is planned by the next round, where
    the older counts as placed; not left twice for an older pod rounds could not place."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    pods = [replica("web-0", key=ZONE, bound="n1"), replica("web-1", key=ZONE), replica("web-2", key=ZONE),
            pod_for_planning(pod("other", MIG_1G))]
    view = build_snapshot(nodes, pods, CAT)
    assert {p.name for p in view.snapshot.pending} == {"ml/web-1", "ml/other"} and apart(view) == {}
    assert kept_off(view, "ml/web-1") == {"n1", "n2"} and kept_off(view, "ml/other") == set()
    assert view.deferred == {"ml/web-2": "ml/web-1"}, "it conflicts with web-1, planned this round"
    again = build_snapshot(nodes, pods, CAT, no_defer={"ml/web-2": "ml/web-1"})  # web-1 could not be placed
    assert {p.name for p in again.snapshot.pending} == {"ml/web-1", "ml/web-2", "ml/other"}
    three = build_snapshot(nodes, [*pods, replica("web-3", key=ZONE)], CAT,
                           no_defer={"ml/web-2": "ml/web-1", "ml/web-3": "ml/web-1"})
    assert three.deferred == {"ml/web-3": "ml/web-2"}, "not left for web-1 again, but still for web-2"


def test_a_hostname_key_is_planned_together_only_where_every_node_has_a_value_of_its_own():
    """Whether a key's domains are single nodes is read from the round's labels: two nodes sharing
    a hostname value, or a node without one, and the younger replica waits a round as before."""
    for broken in ("shared", "missing"):
        nodes = nodes4()
        if broken == "shared":
            nodes[1]["metadata"]["labels"][HOST] = "n1"
        else:
            del nodes[1]["metadata"]["labels"][HOST]
        view = build_snapshot(nodes, [replica("web-1"), replica("web-2")], CAT)
        assert [p.name for p in view.snapshot.pending] == ["ml/web-1"], broken
        assert view.deferred == {"ml/web-2": "ml/web-1"} and apart(view) == {}, broken
    # a zone key whose every value is one node's is one node's domain too
    view = build_snapshot(nodes4(n1="a", n2="b", n3="c", n4="d"), [replica("web-1", key=ZONE), replica("web-2", key=ZONE)], CAT)
    assert view.deferred == {} and apart(view) == {"ml/web-1": ["ml/web-2"], "ml/web-2": ["ml/web-1"]}


def test_apart_names_are_the_snapshots_names_of_the_pods():
    """Pods without a namespace (a file `dynpart explain` reads): `pod_conflicts` knows them as
    `/name`, the snapshot as `default/name`; the lists name the snapshot's pods (else the plan
    refused the snapshot: no pending pod of that name)."""
    pods = [replica(f"web-{i}") for i in range(2)]
    for p in pods:
        p["metadata"].pop("namespace")
    view = build_snapshot(nodes4(), pods, CAT)
    assert apart(view) == {"default/web-0": ["default/web-1"], "default/web-1": ["default/web-0"]}
    assert len({pl.node for pl in plan(view.snapshot, CAT).placements}) == 2


def test_a_pod_is_planned_with_no_more_partners_than_nodes_it_may_use():
    """Five replicas, four nodes: the fifth could not be placed beside four partners on their four
    nodes; it waits for the next round (left for the last of them), where they count as placed."""
    view = build_snapshot(nodes4(), [replica(f"web-{i}") for i in range(5)], CAT)
    assert len(view.snapshot.pending) == 4 and view.deferred == {"ml/web-4": "ml/web-3"}
    assert all(len(p.apart) == 3 for p in view.snapshot.pending)


def test_a_pod_is_planned_with_at_most_max_apart_partners(monkeypatch):
    """The pairs of a round grow with its square: past MAX_APART partners a pod waits a round."""
    from dynpart.planner import cluster_view

    monkeypatch.setattr(cluster_view, "MAX_APART", 2)
    nodes = [labelled(node(f"n{i}", count=1)) for i in range(8)]
    view = build_snapshot(nodes, [replica(f"web-{i}") for i in range(5)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/web-0", "ml/web-1", "ml/web-2"]
    assert view.deferred == {"ml/web-3": "ml/web-2", "ml/web-4": "ml/web-2"}


def test_a_topology_domain_wider_than_a_node_and_plans_in_flight_count():
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    pods = [replica("web-0", key=ZONE), replica("web-1", key=ZONE)]
    view = build_snapshot(nodes, pods, CAT, in_flight={"ml/web-0": "n1"}, exclude_pods={"ml/web-0"})
    assert kept_off(view, "ml/web-1") == {"n1", "n2"}, "web-0, on its way to n1, holds zone z1"


def test_the_placed_pods_terms_count_too_and_a_pod_every_node_excludes_is_blocked():
    loner = pod_for_planning({**pod("batch-0", MIG_1G, phase="Running", node="n1", unschedulable=False),
                              "metadata": {"name": "batch-0", "namespace": "ml", "labels": {"app": "batch"}}})
    loner["spec"]["affinity"] = replica("x", app="web")["spec"]["affinity"]  # keeps web pods off its node
    web = replica("web-1")
    view = build_snapshot(nodes4(), [loner, web], CAT)
    assert kept_off(view, "ml/web-1") == {"n1"}
    only_n1 = [labelled(node("n1", count=1))]
    blocked = build_snapshot(only_n1, [loner, web], CAT)
    assert not blocked.snapshot.pending
    [(obj, why)] = blocked.blocked
    assert obj["metadata"]["name"] == "web-1"
    assert "no node that could take it has room: node(s) n1 hold a pod that its required pod anti-affinity" in why


def test_host_ports_clash_by_protocol_port_and_address():
    nodes = nodes4()
    bound = with_port(pod("srv-0", MIG_1G, phase="Running", node="n1", unschedulable=False), 8080)
    on_ip = with_port(pod("srv-ip", MIG_1G, phase="Running", node="n2", unschedulable=False), 9000, ip="10.0.0.2")
    cases = {"same": (8080, "TCP", None, {"n1"}), "udp": (8080, "UDP", None, set()), "other": (8081, "TCP", None, set()),
             "any-ip": (9000, "TCP", None, {"n2"}), "other-ip": (9000, "TCP", "10.0.0.3", set()),
             "same-ip": (9000, "TCP", "10.0.0.2", {"n2"})}
    for name, (port, protocol, ip, off) in cases.items():
        wants = with_port(pod(name, MIG_1G), port, protocol, ip)
        view = build_snapshot(nodes, [bound, on_ip, wants], CAT)
        assert kept_off(view, f"ml/{name}") == off, name
    two = build_snapshot(nodes, [with_port(pod("a", MIG_1G), 7000), with_port(pod("bb", MIG_1G), 7000)], CAT)
    assert two.deferred == {} and apart(two) == {"ml/a": ["ml/bb"], "ml/bb": ["ml/a"]}, "one node only: kept apart"
    where = {pl.pod: pl.node for pl in plan(two.snapshot, CAT).placements}
    assert len(where) == 2 and where["ml/a"] != where["ml/bb"]


def test_namespaces_match_label_keys_and_null_selectors():
    def facts(ns: str, labels: dict[str, str], **term: Any):
        return pod_facts({"metadata": {"name": "p", "namespace": ns, "labels": labels}, "spec": {"affinity": {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": HOST, **term}]}}}})

    sel = {"labelSelector": {"matchLabels": {"app": "web"}}}
    [t] = facts("ml", {}, **sel).terms
    assert t.selects("ml", {"app": "web"}) and not t.selects("other", {"app": "web"}), "its own namespace by default"
    [t] = facts("ml", {}, **sel, namespaceSelector={}).terms
    assert t.selects("other", {"app": "web"}), "{}: every namespace"
    [t] = facts("ml", {}, **sel, namespaces=["a"], namespaceSelector={"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["b", "c"]}]}).terms
    assert t.namespaces == frozenset({"a", "b", "c"})
    [t] = facts("ml", {}, **sel, namespaceSelector={"matchLabels": {"team": "x"}}).terms
    assert t.namespaces == frozenset(), "labels of namespaces the planner does not watch: none known"
    [t] = facts("ml", {"pod-template-hash": "abc"}, **sel, matchLabelKeys=["pod-template-hash"]).terms
    assert t.selects("ml", {"app": "web", "pod-template-hash": "abc"})
    assert not t.selects("ml", {"app": "web", "pod-template-hash": "old"}), "another revision's pods do not count"
    [t] = facts("ml", {}).terms
    assert not t.selects("ml", {}), "a null labelSelector selects no pod"
    [t] = facts("ml", {}, labelSelector={"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}).terms
    assert t.selects("ml", {}) and t.selects("ml", {"app": "y"}) and not t.selects("ml", {"app": "x"})


async def test_the_controller_plans_32_anti_affine_replicas_on_40_nodes_in_one_round(monkeypatch):
    """A training job's 32 workers, one per node (hostname anti-affinity), on 40 one-GPU MIG nodes
    whose agents report: one round plans them all, each on a node of its own. Before, one a round:
    32 rounds (each a snapshot and a plan: minutes at 2,000 nodes)."""
    from kubernetes_asyncio import client

    from dynpart.annotations import encode_status
    from dynpart.planner import controller as controller_module
    from dynpart.planner.controller import PlannerController
    from dynpart.settings import PlannerSettings
    from dynpart.snapshot import GpuLayout, NodeLayout

    async def fake_patch(*args, **kwargs):
        return {}

    async def no_event(obj, reason, message, warning=False):
        pass
    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    c = PlannerController(client.ApiClient(), PlannerSettings(), CAT)
    c._event = no_event  # type: ignore[method-assign]
    for i in range(40):
        status = encode_status(NodeLayout(node=f"n{i:02d}", mode="mig", gpus=[GpuLayout(index=0, mig=[])]), "p0")
        c.nodes.cache[f"n{i:02d}"] = labelled(node(f"n{i:02d}", count=1, annotations={**status, "dynpart.io/spec-plan": "p0"}))
    for i in range(32):
        c.pods.cache[f"ml/worker-{i:02d}"] = replica(f"worker-{i:02d}", app="train")
    await c.plan_round()
    planned = {k: n for n, f in c.loop.in_flight.items() for k in f.pods}
    assert len(planned) == 32 and len(set(planned.values())) == 32, planned
    assert c._deferred == {}


def test_the_reviewers_four_replicas_land_on_four_nodes_in_one_round():
    """4 replicas with hostname anti-affinity, 4 empty nodes: before, the first round planned all
    four on one node; then one a round (each round's placements in flight for the next); now the
    first round plans the four, kept apart."""
    nodes = nodes4()
    pods = [replica(f"web-{i}") for i in range(4)]
    in_flight = planned_in_rounds(nodes, pods, 1)
    assert sorted(in_flight) == [f"ml/web-{i}" for i in range(4)]
    assert sorted(in_flight.values()) == ["n1", "n2", "n3", "n4"], in_flight


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["web", "db", "x"]), st.booleans(), st.sampled_from([None, 1, 2, 3, 4])),
                min_size=1, max_size=8),
       st.booleans())
def test_a_round_never_plans_a_pod_where_a_placed_or_planned_pod_excludes_it(spec, zones):
    """Random pods (app label, with or without anti-affinity on that app, bound to a node or
    pending): whatever a round plans, no node (zone) ends up with two pods one of which excludes
    the other, counting the bound pods."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2") if zones else nodes4()
    key = ZONE if zones else HOST
    pods = []
    for i, (app, anti, bound) in enumerate(spec):
        p = replica(f"p{i}", app=app, key=key, bound=f"n{bound}" if bound else None)
        if not anti:
            p["spec"].pop("affinity")
        pods.append(p)
    # only consistent clusters: the bound pods do not exclude one another already
    facts = {f"ml/p{i}": pod_facts(p) for i, p in enumerate(pods)}
    domain = {f"n{i}": (f"n{i}" if not zones else ("z1" if i <= 2 else "z2")) for i in range(1, 5)}
    where = {f"ml/p{i}": domain[f"n{b}"] for i, (_, _, b) in enumerate(spec) if b}
    bound_keys = sorted(where)
    if any(facts[a].excludes(facts[b]) and where[a] == where[b] for a in bound_keys for b in bound_keys if a < b):
        return
    view = build_snapshot(nodes, pods, CAT)
    result = plan(view.snapshot, CAT)
    where.update({pl.pod: domain[pl.node] for pl in result.placements})
    keys = sorted(where)
    for a in keys:
        for b in keys:
            if a < b and where[a] == where[b]:
                assert not facts[a].excludes(facts[b]), (a, b, where)
    assert PlacedPods([], {}).excluded_nodes(facts["ml/p0"]) == set()



def spread(name: str, key: str = HOST, skew: int = 1, bound: str | None = None, **constraint: Any) -> dict[str, Any]:
    p = pod(name, MIG_1G, phase="Running" if bound else "Pending", node=bound, unschedulable=not bound,
            topologySpreadConstraints=[{"maxSkew": skew, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule",
                                        "labelSelector": {"matchLabels": {"app": "web"}}, **constraint}])
    p["metadata"]["labels"] = {"app": "web"}
    return pod_for_planning(p)


def test_topology_spread_constraints_keep_a_pod_off_the_domains_it_would_overfill():
    zoned = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    view = build_snapshot(zoned, [spread("w0", bound="n1"), spread("w1", bound="n2"), spread("w2", key=ZONE)], CAT)
    assert kept_off(view, "ml/w2") == {"n1", "n2"}, "z1 holds 2, z2 none: only z2 keeps the skew at 1"
    view = build_snapshot(nodes4(), [spread("w0", bound="n1"), spread("w1")], CAT)
    assert kept_off(view, "ml/w1") == {"n1"}
    loose = build_snapshot(nodes4(), [spread("w0", bound="n1"), spread("w1", skew=2)], CAT)
    assert kept_off(loose, "ml/w1") == set()
    unlabelled = nodes4()
    unlabelled[3]["metadata"]["labels"].pop(HOST)
    view = build_snapshot(unlabelled, [spread("w1")], CAT)
    assert kept_off(view, "ml/w1") == {"n4"}, "a node without the topology key is never admitted"
    view = build_snapshot(zoned, [spread("w0", key=ZONE, bound="n3"), spread("w1", key=ZONE, minDomains=3)], CAT)
    assert kept_off(view, "ml/w1") == {"n3", "n4"}, "fewer domains than minDomains: the least counts 0"
    soft = pod_for_planning(pod("s", MIG_1G, topologySpreadConstraints=[{
        "maxSkew": 1, "topologyKey": HOST, "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {}}]))
    assert kept_off(build_snapshot(nodes4(), [spread("w0", bound="n1"), soft], CAT), "ml/s") == set()


def test_spread_counts_only_the_nodes_the_pods_affinity_admits_unless_told_to_ignore_it():
    nodes = nodes4()
    for n, pool in zip(nodes, "aabb"):
        n["metadata"]["labels"]["pool"] = pool
    bound = [spread("w0", bound="n1"), spread("w1", bound="n2")]  # one on each node of pool a
    honour = spread("w2")
    honour["spec"]["nodeSelector"] = {"pool": "a"}
    view = build_snapshot(nodes, [*bound, honour], CAT)
    assert kept_off(view, "ml/w2") == set(), "n1 and n2 hold one each: the least is 1 (n3, n4 not counted)"
    ignore = spread("w2", nodeAffinityPolicy="Ignore")
    ignore["spec"]["nodeSelector"] = {"pool": "a"}
    view = build_snapshot(nodes, [*bound, ignore], CAT)
    assert not view.snapshot.pending and view.blocked, "n3, n4 count with none: pool a is full at skew 1"


def test_replicas_spread_over_nodes_land_on_four_nodes_in_four_rounds():
    nodes = nodes4()
    pods = [spread(f"w{i}") for i in range(4)]
    in_flight = planned_in_rounds(nodes, pods, 4)
    assert sorted(in_flight.values()) == ["n1", "n2", "n3", "n4"], in_flight


def test_resources_beside_cpu_memory_and_gpus_and_the_pod_count_keep_a_pod_off_a_full_node():
    """The scheduler's NodeResourcesFit checks every resource the pod asks for: a node out of
    ephemeral storage, huge pages, another device or pod slots is no place for its slice."""
    nodes = nodes4()
    for n in nodes:
        n["status"]["allocatable"].update({"ephemeral-storage": "100Gi", "pods": "110", "rdma/ib": "1"})
    nodes[0]["status"]["allocatable"]["pods"] = "1"
    nodes[1]["status"]["allocatable"]["ephemeral-storage"] = "10Gi"
    del nodes[2]["status"]["allocatable"]["rdma/ib"]
    running = pod_for_planning(pod("run", {"cpu": "1"}, phase="Running", node="n1", unschedulable=False))
    wants = pod_for_planning(pod("w", {**MIG_1G, "ephemeral-storage": "20Gi", "rdma/ib": "1"}))
    view = build_snapshot(nodes, [running, wants], CAT)
    assert kept_off(view, "ml/w") == {"n1", "n2", "n3"}, "n1 full of pods, n2 of storage, n3 without the device"
    plain = pod_for_planning(pod("p", {**MIG_1G, "example.com/ignored": "1"}))
    assert kept_off(build_snapshot(nodes, [running, plain], CAT), "ml/p") == {"n1"}, \
        "a resource no node lists is another component's (an extender's): only the pod count"
    only = build_snapshot(nodes[1:2], [wants], CAT)
    [(_, why)] = only.blocked
    assert "node(s) n2 lack ephemeral-storage for it" in why


def test_spread_does_not_count_a_terminating_pod_but_anti_affinity_does():
    """As the scheduler: PodTopologySpread skips terminating pods (a rolling update's old
    replicas), InterPodAffinity does not."""
    leaving = spread("w0", bound="n1")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kept_off(build_snapshot(nodes4(), [leaving, spread("w1")], CAT), "ml/w1") == set()
    going = replica("web-0", bound="n1")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kept_off(build_snapshot(nodes4(), [going, replica("web-1")], CAT), "ml/web-1") == {"n1"}


def test_a_round_of_replicas_at_scale_reads_each_question_once(monkeypatch):
    """2,000 pending replicas of two Deployments with anti-affinity, on 200 nodes holding 5,000
    pods: each distinct question (a Deployment's replicas all ask the same) is answered once; a
    round took minutes at 1,000 nodes before (`dynpart bench` figures in the closing note)."""
    from dynpart.planner.pod_conflicts import PlacedPods

    nodes = [labelled(node(f"n{i:03d}", count=8)) for i in range(200)]
    pods = [replica(f"web-{i}", app=f"app{i % 2}", bound=f"n{i % 200:03d}") for i in range(5000)]
    pods += [replica(f"new-{i}", app=f"app{i % 2}") for i in range(2000)]
    domains = []
    real = PlacedPods._domains_of
    monkeypatch.setattr(PlacedPods, "_domains_of", lambda self, nodes, key: domains.append(key) or real(self, nodes, key))
    view = build_snapshot(nodes, pods, CAT)
    # each Deployment's replicas may use the 100 nodes where the other's run: 100 of each are
    # planned, kept apart (as many as their nodes), the others wait for the next round
    assert [p.name for p in view.snapshot.pending] == [f"ml/new-{i}" for i in range(200)] and len(view.deferred) == 1800
    assert {len(p.apart) for p in view.snapshot.pending} == {99}
    assert kept_off(view, "ml/new-0") == {f"n{i:03d}" for i in range(0, 200, 2)}, "where app0 runs"
    assert len(domains) == 4, "two questions, each its own term and the placed pods' one"


def test_pods_whose_labels_differ_do_not_each_read_every_node_and_placed_pod(monkeypatch):
    """The workers of an indexed Job each carry their own index label, so each asks `excluded_nodes`
    a question of its own: the parts of an answer that read every node or every placed pod (spread
    counts, the domains of the pods a term selects or that carry a term, pod affinity) are kept per
    what they depend on. Read again for each worker, 250 of them on 5,000 nodes took 3 s of a
    round. And a Deployment's replicas, which ask the same, look once at each pod planned before
    them for a conflict (they were each compared with every pod planned: pending x planned)."""
    from dynpart.planner import cluster_view

    nodes = [labelled(node(f"n{i:03d}", count=1), **{ZONE: f"z{i % 3}"}) for i in range(100)]
    placed = [replica(f"cache-{i}", app="cache", key=ZONE, bound=f"n{i:03d}") for i in range(0, 100, 7)]

    def worker(i: int) -> dict[str, Any]:
        p = pod(f"train-{i:03d}", MIG_1G, topologySpreadConstraints=[{
                    "maxSkew": 1, "topologyKey": ZONE, "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"job-name": "train"}}}],
                affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": HOST, "labelSelector": {"matchLabels": {"job-name": "train"}}}]},
                    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"topologyKey": ZONE, "labelSelector": {"matchLabels": {"app": "cache"}}}]}})
        p["metadata"]["labels"] = {"job-name": "train", "batch.kubernetes.io/job-completion-index": str(i)}
        return pod_for_planning(p)

    workers = [worker(i) for i in range(300)]
    admitted, domains = [], []
    real_admits, real_domains = cluster_view._DynpartNodes.admits, PlacedPods._domains_of

    def admits(self, p):
        f = real_admits(self, p)
        return lambda name: admitted.append(name) or f(name)
    monkeypatch.setattr(cluster_view._DynpartNodes, "admits", admits)
    monkeypatch.setattr(PlacedPods, "_domains_of", lambda self, nodes, key: domains.append(key) or real_domains(self, nodes, key))
    view = build_snapshot(nodes, [*placed, *workers], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/train-000"] and len(view.deferred) == 299
    assert len(admitted) <= len(nodes), "the spread counted once, not once per worker"
    assert len(domains) <= 4, "each term's domains once (and pod affinity's once), not per worker"

    # replicas (the same labels) after 200 pods without terms: each pod planned looked at once
    jobs = [pod_for_planning(pod(f"job-{i:03d}", MIG_1G)) for i in range(200)]
    for j in jobs:
        j["metadata"]["creationTimestamp"] = "2025-12-31T00:00:00Z"  # older than the replicas
    replicas = [replica(f"web-{i:03d}", key=ZONE) for i in range(300)]
    compared = []
    real_excludes = PodFacts.excludes
    monkeypatch.setattr(PodFacts, "excludes", lambda self, other: compared.append(other.key) or real_excludes(self, other))
    view = build_snapshot(nodes, [*jobs, *replicas], CAT)
    assert len(view.snapshot.pending) == 201 and len(view.deferred) == 299
    assert len(compared) <= 2 * 201, "each replica compared with the pods planned since the last one asked"


def test_spread_counts_the_nodes_dynpart_does_not_plan_as_domains_as_the_scheduler_does():
    """The scheduler's PodTopologySpread counts every node that carries the constraint's key (and
    that the pod's node affinity admits) as a domain, GPU or not: a CPU-only node in the cluster
    holds none of the replicas, so the least is 0 and each GPU node takes at most `maxSkew` of them.
    Counting only the dynpart nodes, the planner saw a least of 1 and carved a slice for a third
    replica on a node the scheduler refuses it ("didn't match pod topology spread constraints")."""
    nodes = nodes4()[:2]
    cpu_only = {"metadata": {"name": "cpu1", "labels": {HOST: "cpu1", ZONE: "z3"}}}
    pods = [spread("w0", bound="n1"), spread("w1", bound="n2"), spread("w2")]
    view = build_snapshot(nodes, pods, CAT, other_nodes={"cpu1": cpu_only["metadata"]["labels"]})
    assert not view.snapshot.pending and view.blocked, "cpu1 is a domain with none: n1 and n2 are full at skew 1"
    # the same with the node listed among the nodes (`dynpart explain` lists them all)
    view = build_snapshot([*nodes, cpu_only], pods, CAT)
    assert not view.snapshot.pending and view.blocked
    # a node the pod's node affinity does not admit is no domain (nodeAffinityPolicy: Honor)
    pinned = spread("w2")
    pinned["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    view = build_snapshot(nodes, [*pods[:2], pinned], CAT, other_nodes={"cpu1": cpu_only["metadata"]["labels"]})
    assert [p.name for p in view.snapshot.pending] == ["ml/w2"] and kept_off(view, "ml/w2") == set()
    # nor one without the key; and a zone of CPU nodes only is a domain of its own for zone spread
    view = build_snapshot(nodes, pods, CAT, other_nodes={"cpu1": {ZONE: "z3"}})
    assert kept_off(view, "ml/w2") == set()
    zoned = nodes4(n1="z1", n2="z2", n3="z1", n4="z2")[:2]
    pods = [spread("w0", key=ZONE, bound="n1"), spread("w1", key=ZONE, bound="n2"), spread("w2", key=ZONE)]
    assert build_snapshot(zoned, pods, CAT).snapshot.pending, "z1 and z2 hold one each"
    view = build_snapshot(zoned, pods, CAT, other_nodes={"cpu1": cpu_only["metadata"]["labels"]})
    assert not view.snapshot.pending and view.blocked, "z3 (a CPU node) holds none"


def test_pods_on_nodes_dynpart_does_not_plan_count_in_their_domain():
    """A replica bound to a node dynpart does not plan, in a zone it does plan, keeps the pods whose
    required anti-affinity selects it out of that zone (and its own anti-affinity too): its
    domain is known from the node's labels."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    pods = [replica("r0", key=ZONE, bound="plain1"), replica("r1", key=ZONE)]
    assert kept_off(build_snapshot(nodes, pods, CAT), "ml/r1") == set(), "plain1's zone unknown"
    view = build_snapshot(nodes, pods, CAT, other_nodes={"plain1": {HOST: "plain1", ZONE: "z1"}})
    assert kept_off(view, "ml/r1") == {"n1", "n2"}


def follower(name: str, app: str = "cache", key: str = ZONE, bound: str | None = None, own: str = "gpu",
             **extra: Any) -> dict[str, Any]:
    """A pod whose required pod affinity wants it in the `key` domain of a pod labelled app=`app`."""
    p = pod(name, MIG_1G if own == "gpu" else {"cpu": "1"}, phase="Running" if bound else "Pending", node=bound,
            unschedulable=not bound, affinity={"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": key, "labelSelector": {"matchLabels": {"app": app}}}]}}, **extra)
    p["metadata"]["labels"] = {"app": own}
    return pod_for_planning(p)


def test_required_pod_affinity_keeps_a_pod_in_the_domains_of_the_pods_it_selects():
    """The InterPodAffinity filter: a pod whose required pod affinity selects a placed pod goes only
    to a node in that pod's topology domain (carrying the key); one that selects no placed pod goes
    nowhere, unless its own labels match its terms (the first of a group that attracts itself: any
    node carrying the keys). Unmirrored, the planner carved its slice in any zone, where the
    scheduler refuses it ("didn't match pod affinity rules")."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    cache = pod("cache0", {"cpu": "1"}, phase="Running", node="plain1", unschedulable=False)
    cache["metadata"]["labels"] = {"app": "cache"}
    cache = pod_for_planning(cache)
    view = build_snapshot(nodes, [cache, follower("f0")], CAT, other_nodes={"plain1": {HOST: "plain1", ZONE: "z2"}})
    assert kept_off(view, "ml/f0") == {"n1", "n2"}, "the cache runs in z2"
    view = build_snapshot(nodes, [follower("f0")], CAT)
    assert not view.snapshot.pending and view.blocked, "no cache pod anywhere: no node passes"
    # a group that attracts itself: the first may go anywhere, the next joins it
    group = [follower("g0", app="gpu"), follower("g1", app="gpu")]
    view = build_snapshot(nodes, group, CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/g0"] and kept_off(view, "ml/g0") == set()
    assert view.deferred == {"ml/g1": "ml/g0"}, "g1 waits for g0's zone"
    view = build_snapshot(nodes, group, CAT, exclude_pods={"ml/g0"}, in_flight={"ml/g0": "n3"})
    assert kept_off(view, "ml/g1") == {"n1", "n2"}
    # a node without the key never passes; nor a node whose domain holds the pod only on a node lacking it
    unkeyed = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    unkeyed[3]["metadata"]["labels"].pop(ZONE)
    view = build_snapshot(unkeyed, [cache, follower("f0")], CAT, other_nodes={"plain1": {HOST: "plain1", ZONE: "z2"}})
    assert kept_off(view, "ml/f0") == {"n1", "n2", "n4"}
    # anti-affinity of the pod itself still applies beside its affinity (a term per kind)
    both = follower("b0", key=ZONE)
    both["spec"]["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": HOST, "labelSelector": {"matchLabels": {"app": "gpu"}}}]}
    other = pod_for_planning({**pod("x", MIG_1G, phase="Running", node="n3", unschedulable=False),
                              "metadata": {"name": "x", "namespace": "ml", "labels": {"app": "gpu"}}})
    view = build_snapshot(nodes, [cache, other, both], CAT, other_nodes={"plain1": {HOST: "plain1", ZONE: "z2"}})
    assert kept_off(view, "ml/b0") == {"n1", "n2", "n3"}


def test_pod_affinity_the_planner_cannot_judge_keeps_the_pod_off_no_node():
    """Where the planner cannot tell the pods a required pod affinity term selects, or their
    domain, it leaves the pod to the back-off rather than keep it off every node (blocked with an
    Unplaceable Event, never planned, where the scheduler binds it): a namespaceSelector on labels
    other than the namespace's name (the planner does not watch namespaces), and a selected pod on
    a node whose labels are unknown (the other nodes' watch not listed yet, or failing)."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    cache = pod("cache0", {"cpu": "1"}, phase="Running", node="n3", unschedulable=False)
    cache["metadata"].update(labels={"app": "cache"}, namespace="infra")
    f = follower("f0")
    f["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["namespaceSelector"] = {
        "matchLabels": {"team": "infra"}}
    view = build_snapshot(nodes, [pod_for_planning(cache), pod_for_planning(f)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/f0"] and not view.blocked
    # on the namespace's name: known, followed
    f["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["namespaceSelector"] = {
        "matchLabels": {"kubernetes.io/metadata.name": "infra"}}
    assert kept_off(build_snapshot(nodes, [pod_for_planning(cache), pod_for_planning(f)], CAT), "ml/f0") == {"n1", "n2"}
    elsewhere = pod("cache0", {"cpu": "1"}, phase="Running", node="plain1", unschedulable=False)
    elsewhere["metadata"]["labels"] = {"app": "cache"}
    view = build_snapshot(nodes, [pod_for_planning(elsewhere), follower("f0")], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/f0"] and not view.blocked, "plain1's zone unknown"
    view = build_snapshot(nodes, [pod_for_planning(elsewhere), follower("f0")], CAT, other_nodes={"plain1": {ZONE: "z1"}})
    assert kept_off(view, "ml/f0") == {"n3", "n4"}


def test_a_pod_the_first_of_a_self_attracting_group_selects_waits_for_its_zone():
    """The first of a group that attracts itself goes to any zone (no pod its terms select is
    placed); a younger pod its terms select but with no terms of its own, planned in the same round
    in another zone and bound first, would have the scheduler refuse the first in its planned zone
    (affinityCounts no longer empty): that pod waits a round, as the group's own members do."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    first = follower("g0", app="gpu")
    plain = pod("p1", MIG_1G, phase="Pending", unschedulable=True)
    plain["metadata"].update(labels={"app": "gpu"}, creationTimestamp="2026-01-01T00:00:02Z")
    view = build_snapshot(nodes, [first, pod_for_planning(plain)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/g0"] and view.deferred == {"ml/p1": "ml/g0"}
    # placed beside a pod it selects, the first's zone is fixed: the other pod is not held back
    anchor = pod("a0", {"cpu": "1"}, phase="Running", node="n3", unschedulable=False)
    anchor["metadata"]["labels"] = {"app": "gpu"}
    view = build_snapshot(nodes, [pod_for_planning(anchor), first, pod_for_planning(plain)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/g0", "ml/p1"] and not view.deferred


def test_pods_with_affinity_and_labels_of_their_own_read_the_placed_pods_once(monkeypatch):
    """A StatefulSet's pods each carry labels of their own (pod-name, pod-index): each asks its own
    question, but what the affinity terms select among the placed pods is read once per set of
    terms (a round of 500 such pods beside 30,000 placed pods took 15 s, most of it there)."""
    from dynpart.planner.pod_conflicts import AntiAffinityTerm

    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    placed = []
    for i in range(200):
        p = pod(f"b{i}", {"cpu": "1"}, phase="Running", node=f"n{1 + i % 4}", unschedulable=False)
        p["metadata"]["labels"] = {"app": "cache" if i == 7 else f"a{i % 9}"}
        placed.append(pod_for_planning(p))
    members = []
    for i in range(50):
        f = follower(f"s-{i}")
        f["metadata"]["labels"] = {"app": "gpu", "statefulset.kubernetes.io/pod-name": f"s-{i}"}
        members.append(f)
    reads = []
    real = AntiAffinityTerm.selects
    monkeypatch.setattr(AntiAffinityTerm, "selects", lambda self, ns, labels: reads.append(1) or real(self, ns, labels))
    view = build_snapshot(nodes, [*placed, *members], CAT)
    assert len(view.snapshot.pending) == 50 and kept_off(view, "ml/s-49") == {"n1", "n2"}, "cache b7 is on n4 (z2)"
    # the placed pods once (200), and each member against the older ones planned (1,225): not 50 x 200
    assert len(reads) < len(placed) + len(members) ** 2, len(reads)


def test_spread_honouring_taints_does_not_count_the_nodes_whose_taints_are_not_read():
    """With `nodeTaintsPolicy: Honor` the scheduler counts no node whose taints the pod does not
    tolerate (a control plane's NoSchedule): counted as an empty domain, such a node kept the pod
    off the GPU nodes the scheduler allows (blocked, never planned). The planner reads no taints of
    the nodes it does not plan: they count for no domain of such a constraint (the default,
    `Ignore`, counts them, as the scheduler does)."""
    nodes = nodes4()[:2]
    control = {"cp1": {HOST: "cp1"}}
    honour = [spread("w0", bound="n1", nodeTaintsPolicy="Honor"), spread("w1", bound="n2", nodeTaintsPolicy="Honor"),
              spread("w2", nodeTaintsPolicy="Honor")]
    view = build_snapshot(nodes, honour, CAT, other_nodes=control)
    assert [p.name for p in view.snapshot.pending] == ["ml/w2"] and not view.blocked
    ignore = [spread("w0", bound="n1"), spread("w1", bound="n2"), spread("w2")]
    assert build_snapshot(nodes, ignore, CAT, other_nodes=control).blocked


def test_spread_with_an_empty_selector_counts_no_placed_pod():
    """`labelSelector: {}` (and no matchLabelKeys the pod carries): the scheduler's
    `countPodsMatchSelector` counts no pod for an empty selector, though the pod matches it itself
    (every domain's skew is then 1): the planner counted every pod of the namespace and kept the
    pod off the nodes holding them (helper-128's reference test)."""
    zoned = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    pods = [spread("w0", key=ZONE, bound="n1", labelSelector={}), spread("w1", key=ZONE, bound="n2", labelSelector={}),
            spread("w2", key=ZONE, labelSelector={})]
    view = build_snapshot(zoned, pods, CAT)
    assert kept_off(view, "ml/w2") == set()
    keyed = spread("w2", key=ZONE, labelSelector={}, matchLabelKeys=["app"])  # app=web joins it: counted
    assert kept_off(build_snapshot(zoned, [*pods[:2], keyed], CAT), "ml/w2") == {"n1", "n2"}
    # nor do two such pending pods wait for each other
    two = build_snapshot(zoned, [spread("a", key=ZONE, labelSelector={}), spread("bb", key=ZONE, labelSelector={})], CAT)
    assert not two.deferred and len(two.snapshot.pending) == 2


def test_spread_honouring_taints_keeps_a_pod_off_only_where_the_unread_nodes_cannot_change_it():
    """`nodeTaintsPolicy: Honor` and nodes dynpart does not plan, whose taints are not read: where
    the scheduler counts such a node (the pod tolerates its taints), its pods raise the least, and
    its domain counts towards `minDomains`. Counted as no domain, a zone mixing it with a planned
    node looked emptier than the scheduler sees it (the pod kept off the other zone), and too few
    domains made the least 0 (the pod blocked, an Unplaceable Event, where the scheduler binds it).
    Now a node is kept off only where the scheduler refuses it whichever of them it counts."""
    mixed = nodes4(n1="z1", n2="z2", n3="z1", n4="z2")[:2]
    cpu = {"cpu1": {HOST: "cpu1", ZONE: "z1"}}
    pods = [spread("w0", key=ZONE, bound="cpu1", nodeTaintsPolicy="Honor"),
            spread("w1", key=ZONE, bound="n2", nodeTaintsPolicy="Honor"), spread("w2", key=ZONE, nodeTaintsPolicy="Honor")]
    assert kept_off(build_snapshot(mixed, pods, CAT, other_nodes=cpu), "ml/w2") == set(), \
        "cpu1 untainted: z1 and z2 hold one each"
    nodes = nodes4()[:2]
    honour = [spread(f"w{i}", bound=n, nodeTaintsPolicy="Honor", minDomains=3) for i, n in enumerate(["n1", "n2", "cpu1"])]
    honour.append(spread("w3", nodeTaintsPolicy="Honor", minDomains=3))
    view = build_snapshot(nodes, honour, CAT, other_nodes={"cpu1": {HOST: "cpu1"}})
    assert [p.name for p in view.snapshot.pending] == ["ml/w3"] and not view.blocked, \
        "cpu1 untainted: three domains holding one each"
    assert kept_off(view, "ml/w3") == set()
    # where no unread node can change the answer, the pod is still kept off
    ignore = [spread("w0", bound="n1"), spread("w1", bound="n1", nodeTaintsPolicy="Honor"), spread("w2", nodeTaintsPolicy="Honor")]
    assert kept_off(build_snapshot(nodes4()[:2], ignore, CAT, other_nodes={"cpu1": {HOST: "cpu1"}}), "ml/w2") == {"n1"}


def test_replicas_whose_labels_differ_look_once_at_each_pod_planned_before_them(monkeypatch):
    """A StatefulSet's replicas (or an indexed Job's workers) each carry a label of their own
    (`statefulset.kubernetes.io/pod-name`) that no term reads: planned together, kept apart, they
    ask one question of `planned_conflicts`, each planned pod looked at once. Asked per pod, each
    was compared with every pod planned before it: 2,000 of them (10 StatefulSets on 2,000 nodes)
    took 8.5 s of a round's snapshot (0.6 s when one a StatefulSet was planned per round)."""
    calls = []
    real = PlacedPods._apart_only
    monkeypatch.setattr(PlacedPods, "_apart_only", lambda self, f, o: calls.append(1) or real(self, f, o))
    nodes = [labelled(node(f"n{i:02d}", count=1)) for i in range(64)]
    pods = []
    for i in range(60):
        p = replica(f"sts-{i:02d}", app="sts")
        p["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] = f"sts-{i}"
        pods.append(p)
    view = build_snapshot(nodes, pods, CAT)
    assert len(view.snapshot.pending) == 60 and {len(p.apart) for p in view.snapshot.pending} == {59}
    assert len(calls) < 2 * 60, len(calls)


def _facts(i: int, labels: dict[str, str], term_key: str | None, term_on: str | None, port: int | None) -> PodFacts:
    from dynpart.planner.pod_conflicts import AntiAffinityTerm, HostPort, Requirement
    terms = (() if term_key is None else
             (AntiAffinityTerm(HOST if term_on is None else term_on,
                               (Requirement(term_key, "In", frozenset({"a"})),), frozenset({"ml"})),))
    ports = () if port is None else (HostPort("0.0.0.0", "TCP", port),)
    return PodFacts(f"ml/p{i}", "ml", labels, terms, ports)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.dictionaries(st.sampled_from(["x", "y", "z"]), st.sampled_from(["a", "b"]), max_size=3),
                          st.one_of(st.none(), st.sampled_from(["x", "y", "z"])),
                          st.sampled_from([None, None, ZONE]),
                          st.sampled_from([None, None, 80])), min_size=1, max_size=14))
def test_planned_conflicts_answers_each_pod_as_if_asked_alone(pods):
    """The answers kept per question (labels the planned pods' terms read only) are those of the
    pod compared with every pod planned before it: whichever keys the terms read, and when."""
    node_labels = {f"n{i}": {HOST: f"n{i}", ZONE: f"z{i % 2}"} for i in range(4)}
    placed = PlacedPods([], node_labels)
    for i, (labels, term_key, term_on, port) in enumerate(pods):
        facts = _facts(i, labels, term_key, term_on, port)
        pool = placed.planned if facts.terms or facts.ports else placed._planned_with_terms
        how = [(o.key, placed._apart_only(facts, o)) for o in pool]
        wide = [k for k, h in how if h is False]
        assert placed.planned_conflicts(facts) == (wide[0] if wide else None, [k for k, h in how if h is True])
        placed.take(facts)


def test_a_pod_joins_no_more_partners_than_nodes_of_this_round_it_may_use():
    """The nodes left out of a round (their agents applying a plan: `exclude_nodes`) take no pod of
    it: counted as nodes to go to, four replicas were planned together on the one node left, three
    left unplaced with a Warning Event (`dynpart cannot place this pod`) where one a round waited
    silently (left for the older one, planned at once once it was placed)."""
    view = build_snapshot(nodes4(), [replica(f"web-{i}") for i in range(4)], CAT, exclude_nodes={"n1", "n2", "n3"})
    assert [p.name for p in view.snapshot.pending] == ["ml/web-0"] and apart(view) == {}
    assert view.deferred == {"ml/web-1": "ml/web-0", "ml/web-2": "ml/web-0", "ml/web-3": "ml/web-0"}
    # two nodes in the round: two replicas planned together
    view = build_snapshot(nodes4(), [replica(f"web-{i}") for i in range(4)], CAT, exclude_nodes={"n1", "n2"})
    assert apart(view) == {"ml/web-0": ["ml/web-1"], "ml/web-1": ["ml/web-0"]}
    assert view.deferred == {"ml/web-2": "ml/web-1", "ml/web-3": "ml/web-1"}
    assert len(plan(view.snapshot, CAT).placements) == 2
    # no node of the round to go to, its only partner one it is not left for again: planned (it
    # waits for the agents), not left for a pod that no round could place
    view = build_snapshot(nodes4(), [replica("web-0"), replica("web-1")], CAT, exclude_nodes={"n1", "n2", "n3", "n4"},
                          no_defer={"ml/web-1": frozenset({"ml/web-0"})})
    assert [p.name for p in view.snapshot.pending] == ["ml/web-0", "ml/web-1"] and view.deferred == {}
