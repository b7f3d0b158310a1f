"""Checks of `planner/pod_conflicts.py` against the kube-scheduler's semantics, where mutation
testing found them unasserted: label selector operators, host ports between pending pods, the
symmetry of required anti-affinity and of spread constraints within a round, null and narrow
spread selectors, and the nodes a spread constraint counts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.planner.cluster_view import build_snapshot, pod_for_planning
from dynpart.planner.pod_conflicts import PlacedPods, pod_facts
from tests.controller.test_cluster_view import pod
from tests.controller.test_pod_conflicts import CAT, HOST, MIG_1G, ZONE, kept_off, nodes4, replica, spread, with_port

KEYS = ["app", "tier"]
VALUES = ["a", "b", "c"]


def with_labels(p: dict[str, Any], **labels: str) -> dict[str, Any]:
    p["metadata"]["labels"] = dict(labels)
    return pod_for_planning(p)


def anti(selector: dict[str, Any] | None, key: str = HOST) -> dict[str, Any]:
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": key, **({"labelSelector": selector} if selector is not None else {})}]}}


def zoned_but_n4(**zones: str) -> list[dict[str, Any]]:
    nodes = nodes4()
    for n in nodes[:3]:
        n["metadata"]["labels"][ZONE] = zones[n["metadata"]["name"]]
    return nodes


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(KEYS), st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
       st.sets(st.sampled_from(VALUES), min_size=1), st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES)))
def test_a_match_expression_selects_as_the_api_servers_label_selector(key, operator, values, labels):
    """In: the key is there with one of the values; NotIn: the key is missing or has another
    value; Exists / DoesNotExist: the key is there / missing, whatever its value."""
    expr = {"key": key, "operator": operator, **({"values": sorted(values)} if operator in ("In", "NotIn") else {})}
    facts = pod_facts({"metadata": {"name": "p", "namespace": "ml"},
                       "spec": {"affinity": anti({"matchExpressions": [expr]})}})
    [term] = facts.terms
    expected = {"In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
    assert term.selects("ml", labels) == expected


def test_an_unknown_operator_selects_no_pod():
    """One the API server would refuse (an object read from elsewhere): no pod is kept away for it."""
    facts = pod_facts({"metadata": {"name": "p", "namespace": "ml"},
                       "spec": {"affinity": anti({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]})}})
    [term] = facts.terms
    assert not term.selects("ml", {"app": "2"}) and not term.selects("ml", {})


def test_two_pending_pods_clash_on_a_host_port_only_with_the_same_port_and_protocol():
    """NodePorts: a host port is taken per (IP, protocol, port); two pending pods with different
    ports or protocols may share a node, so neither is kept apart from the other (a clash is on one
    node only: both are planned, kept apart, and neither waits)."""
    nodes = nodes4()
    for name, (port, protocol), clash in [("same", (7000, "TCP"), True), ("port", (7001, "TCP"), False),
                                          ("udp", (7000, "UDP"), False)]:
        pods = [with_port(pod("a", MIG_1G), 7000), with_port(pod(f"b-{name}", MIG_1G), port, protocol)]
        view = build_snapshot(nodes, pods, CAT)
        assert view.deferred == {} and len(view.snapshot.pending) == 2, name
        assert {p.name: p.apart for p in view.snapshot.pending} == (
            {"ml/a": [f"ml/b-{name}"], f"ml/b-{name}": ["ml/a"]} if clash else {"ml/a": [], f"ml/b-{name}": []}), name


def test_anti_affinity_between_two_pending_pods_defers_the_younger_whichever_carries_the_term():
    """The scheduler checks both ways: the younger pod's terms against the older, and the older's
    terms against the younger; either defers the younger to the next round (on a key of wider
    domains) or keeps the two apart (on the hostname)."""
    for key, nodes in ((ZONE, nodes4(n1="z1", n2="z1", n3="z2", n4="z2")), (HOST, nodes4())):
        def conflict(pods: list[dict[str, Any]], key: str = key, nodes: list[dict[str, Any]] = nodes) -> object:
            view = build_snapshot(nodes, pods, CAT)
            if key == HOST:
                assert view.deferred == {} and len(view.snapshot.pending) == 2
                return {p.name: p.apart for p in view.snapshot.pending if p.apart}
            return view.deferred
        both = {"ml/bb": "ml/a"} if key == ZONE else {"ml/a": ["ml/bb"], "ml/bb": ["ml/a"]}
        guard = with_labels(pod("a", MIG_1G, affinity=anti({"matchLabels": {"app": "web"}}, key)), app="guard")
        web = with_labels(pod("bb", MIG_1G), app="web")  # younger (creationTimestamp from the name's length)
        assert conflict([guard, web]) == both, ("the older's terms select it", key)
        plain = with_labels(pod("a", MIG_1G), app="web")
        picky = with_labels(pod("bb", MIG_1G, affinity=anti({"matchLabels": {"app": "web"}}, key)), app="guard")
        assert conflict([plain, picky]) == both, ("its own terms select the older", key)
        other = with_labels(pod("a", MIG_1G), app="db")
        view = build_snapshot(nodes, [other, picky], CAT)
        assert view.deferred == {} and len(view.snapshot.pending) == 2, "neither selects the other"
        assert not any(p.apart for p in view.snapshot.pending)


def test_spread_constraints_between_pending_pods_count_only_their_own_namespace():
    """A spread constraint counts the pods of its pod's namespace: a pod of another namespace
    with the same labels does not wait for it; one of the same namespace does, whichever of the
    two carries the constraint."""
    nodes = nodes4()
    older = spread("a")
    other_ns = spread("bb")
    other_ns["metadata"]["namespace"] = "other"
    view = build_snapshot(nodes, [older, other_ns], CAT)
    assert view.deferred == {} and len(view.snapshot.pending) == 2
    plain = with_labels(pod("bb", MIG_1G), app="web")
    assert build_snapshot(nodes, [older, plain], CAT).deferred == {"ml/bb": "ml/a"}, "the older's constraint counts it"
    older_plain = with_labels(pod("a", MIG_1G), app="web")
    assert build_snapshot(nodes, [older_plain, spread("bb")], CAT).deferred == {"ml/bb": "ml/a"}, \
        "its own constraint counts the older"


def test_a_spread_constraint_counts_only_the_pods_its_selector_selects():
    """Pods of another app, and every pod for a null labelSelector (which selects none), are not
    counted: only the nodes without the topology key are kept off."""
    db = [with_labels(pod(f"db{i}", MIG_1G, phase="Running", node="n1", unschedulable=False), app="db") for i in range(3)]
    assert kept_off(build_snapshot(nodes4(), [*db, spread("w")], CAT), "ml/w") == set()
    webs = [spread(f"w{i}", bound="n1") for i in range(3)]
    null = pod_for_planning(pod("s", MIG_1G, topologySpreadConstraints=[
        {"maxSkew": 1, "topologyKey": ZONE, "whenUnsatisfiable": "DoNotSchedule"}]))
    zoned = zoned_but_n4(n1="z1", n2="z2", n3="z3")
    assert kept_off(build_snapshot(zoned, [*webs, null], CAT), "ml/s") == {"n4"}


def two_constraints(name: str, bound: str | None = None) -> dict[str, Any]:
    p = pod(name, MIG_1G, phase="Running" if bound else "Pending", node=bound, unschedulable=not bound,
            topologySpreadConstraints=[
                {"maxSkew": 5, "topologyKey": ZONE, "whenUnsatisfiable": "DoNotSchedule",
                 "labelSelector": {"matchLabels": {"app": "web"}}},
                {"maxSkew": 1, "topologyKey": HOST, "whenUnsatisfiable": "DoNotSchedule",
                 "labelSelector": {"matchLabels": {"app": "web"}}}])
    return with_labels(p, app="web")


def test_a_node_without_every_constraints_topology_key_counts_for_none_of_them():
    """PodTopologySpread counts a node's pods only where the node carries the topology keys of
    all the pod's DoNotSchedule constraints (`nodeLabelsMatchSpreadConstraints`). n4 has no zone:
    its empty hostname domain is not the least of the hostname constraint, so n1..n3, one pod
    each, still admit a second (1 + 1 - 1 <= 1); before, n4 counted 0 and the pod was blocked."""
    zoned = zoned_but_n4(n1="z1", n2="z1", n3="z2")
    pods = [two_constraints(f"w{i}", bound=f"n{i}") for i in range(1, 4)] + [two_constraints("new")]
    view = build_snapshot(zoned, pods, CAT)
    assert not view.blocked
    assert kept_off(view, "ml/new") == {"n4"}, "n4 lacks the zone key: never admitted"


def term_of(namespace: str, labels: dict[str, str], **term: Any):
    facts = pod_facts({"metadata": {"name": "p", "namespace": namespace, "labels": labels}, "spec": {"affinity": {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": HOST, **term}]}}}})
    [t] = facts.terms
    return t


def test_match_and_mismatch_label_keys_take_the_pods_own_values_and_skip_keys_it_lacks():
    """KEP-3633: matchLabelKeys adds `key in (own value)`, mismatchLabelKeys `key notin (own
    value)`; a key the pod does not carry is ignored (no requirement, no failure)."""
    sel = {"labelSelector": {"matchLabels": {"app": "web"}}}
    t = term_of("ml", {"app": "web"}, **sel, matchLabelKeys=["pod-template-hash"])
    assert t.selects("ml", {"app": "web", "pod-template-hash": "any"}), "no such label on the pod: the selector alone"
    t = term_of("ml", {"tenant": "a"}, **sel, mismatchLabelKeys=["tenant"])
    assert t.selects("ml", {"app": "web", "tenant": "b"}) and t.selects("ml", {"app": "web"})
    assert not t.selects("ml", {"app": "web", "tenant": "a"}), "its own tenant's pods may share its node"
    t = term_of("ml", {}, **sel, mismatchLabelKeys=["tenant"])
    assert t.selects("ml", {"app": "web", "tenant": "a"}), "no such label on the pod: the selector alone"


def test_a_term_counts_the_namespaces_it_lists_not_its_own():
    sel = {"labelSelector": {"matchLabels": {"app": "web"}}}
    t = term_of("ml", {}, **sel, namespaces=["a", "b"])
    assert t.selects("a", {"app": "web"}) and t.selects("b", {"app": "web"}) and not t.selects("ml", {"app": "web"})


def test_a_namespace_selector_is_read_as_names_only_where_every_requirement_is_an_in_on_the_name():
    """Any other requirement (another label, or NotIn on the name) asks for labels the planner does
    not watch: then only the names listed count, never the values it names."""
    sel = {"labelSelector": {"matchLabels": {"app": "web"}}}
    name = "kubernetes.io/metadata.name"
    cases = {
        "other label": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]},
        "NotIn on the name": {"matchExpressions": [{"key": name, "operator": "NotIn", "values": ["a"]}]},
        "name and another label": {"matchLabels": {name: "a"},
                                   "matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]},
    }
    for what, selector in cases.items():
        t = term_of("ml", {}, **sel, namespaces=["x"], namespaceSelector=selector)
        assert t.namespaces == frozenset({"x"}), what
    t = term_of("ml", {}, **sel, namespaceSelector={"matchLabels": {name: "a"}, "matchExpressions": [
        {"key": name, "operator": "In", "values": ["a", "b"]}]})
    assert t.namespaces == frozenset({"a"}), "the names every requirement admits"


def test_host_ports_of_sidecars_count_and_those_of_plain_init_containers_do_not():
    """NodePorts counts the ports of the containers and of the restartable init containers
    (sidecars, which run beside them: kubernetes#132040); a plain init container has ended
    before the pod runs."""
    def bound(name: str, node: str, restart: str | None) -> dict[str, Any]:
        p = pod(name, MIG_1G, phase="Running", node=node, unschedulable=False)
        p["spec"]["initContainers"] = [{"name": "init", **({"restartPolicy": restart} if restart else {}),
                                        "ports": [{"containerPort": 80, "hostPort": 8080}]}]
        return pod_for_planning(p)

    placed = [bound("sidecar", "n1", "Always"), bound("init", "n2", None)]
    view = build_snapshot(nodes4(), [*placed, with_port(pod("w", MIG_1G), 8080)], CAT)
    assert kept_off(view, "ml/w") == {"n1"}


def test_a_host_port_is_one_from_1_up_and_zero_means_none():
    def ports(*host_ports: int) -> set[int]:
        facts = pod_facts({"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": [
            {"name": "c", "ports": [{"containerPort": 80 + i, "hostPort": hp} for i, hp in enumerate(host_ports)]}]}})
        return {p.port for p in facts.ports}

    assert ports(0, 1, 65535) == {1, 65535}, "hostPort 0: the container port is not published on the host"


def test_min_domains_makes_the_least_count_zero_while_fewer_domains_hold_nodes():
    """Two zones holding one pod each: with minDomains 1 the least is 1 and either zone admits a
    second pod (1 + 1 - 1 <= 1); with minDomains 3 the least counts 0 and neither does."""
    zoned = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    bound = [spread("w0", key=ZONE, bound="n1"), spread("w1", key=ZONE, bound="n3")]
    assert kept_off(build_snapshot(zoned, [*bound, spread("w2", key=ZONE)], CAT), "ml/w2") == set()
    assert kept_off(build_snapshot(zoned, [*bound, spread("w2", key=ZONE, minDomains=2)], CAT), "ml/w2") == set(), \
        "as many domains as minDomains: the least counts"
    view = build_snapshot(zoned, [*bound, spread("w2", key=ZONE, minDomains=3)], CAT)
    assert not view.snapshot.pending and [p["metadata"]["name"] for p, _ in view.blocked] == ["w2"]


def test_a_spread_over_a_key_no_node_carries_blocks_the_pod_with_a_reason():
    """No node has the topology key: none is admitted (and no domain is counted: no failure)."""
    view = build_snapshot(nodes4(), [spread("w", key="example.com/rack")], CAT)
    assert not view.problems and [p["metadata"]["name"] for p, _ in view.blocked] == ["w"]


def test_anti_affinity_over_a_key_some_nodes_lack():
    """A node without the term's topology key is in no domain: a pod there keeps no one away, and
    the pod may go there."""
    nodes = zoned_but_n4(n1="z1", n2="z1", n3="z2")
    pods = [replica("web-0", key=ZONE, bound="n1"), replica("web-1", key=ZONE)]
    view = build_snapshot(nodes, pods, CAT)
    assert not view.problems and kept_off(view, "ml/web-1") == {"n1", "n2"}
    pods = [replica("web-0", key=ZONE, bound="n4"), replica("web-1", key=ZONE)]
    assert kept_off(build_snapshot(nodes, pods, CAT), "ml/web-1") == set()


def test_a_term_over_every_namespace_keeps_a_pod_off_the_nodes_of_another_namespaces_pods():
    nodes = nodes4()
    other = with_labels(pod("o", MIG_1G, phase="Running", node="n2", unschedulable=False), app="web")
    other["metadata"]["namespace"] = "other"
    wide = replica("web-1")
    wide["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
        "namespaceSelector"] = {}
    assert kept_off(build_snapshot(nodes, [other, wide], CAT), "ml/web-1") == {"n2"}
    assert kept_off(build_snapshot(nodes, [other, replica("web-1")], CAT), "ml/web-1") == set(), "its own only"


def test_placed_pods_count_every_node_for_a_spread_unless_told_what_the_pod_admits():
    placed = PlacedPods([(spread("w0", bound="n1"), "n1")], {n: {HOST: n} for n in ("n1", "n2")})
    assert placed.excluded_nodes(pod_facts(spread("w1"))) == {"n1"}
    assert placed.excluded_nodes(pod_facts(spread("w1")), lambda n: n == "n1", "n1 only") == set(), \
        "n1 alone counted: it is the least held domain"


def test_pods_asking_the_same_with_different_node_affinity_get_their_own_answers():
    """The spread counts the nodes each pod's nodeSelector admits: a pod admitting only n1 may
    join w0 there (n1 is the only, so least, domain); a pod admitting all four may not."""
    narrow = spread("a")
    narrow["spec"]["nodeSelector"] = {HOST: "n1"}
    view = build_snapshot(nodes4(), [spread("w0", bound="n1"), narrow, spread("bb")], CAT,
                          no_defer={"ml/bb": frozenset({"ml/a"})})
    assert kept_off(view, "ml/a") == set() and kept_off(view, "ml/bb") == {"n1"}


def test_a_pod_its_own_spread_selector_does_not_select_does_not_count_itself():
    """skew = matching pods in the domain + 1 only if the pod matches its own selector - least:
    a pod labelled otherwise may join a domain already at maxSkew."""
    other = spread("x")
    other["metadata"]["labels"] = {"app": "other"}
    view = build_snapshot(nodes4(), [spread("w0", bound="n1"), other], CAT)
    assert kept_off(view, "ml/x") == set()


def test_pods_on_nodes_the_pods_affinity_does_not_admit_are_not_counted():
    """nodeAffinityPolicy Honor: matching pods on the other nodes count for no domain."""
    nodes = nodes4()
    for n, pool in zip(nodes, "aabb"):
        n["metadata"]["labels"]["pool"] = pool
    elsewhere = [spread(f"w{i}", bound="n3") for i in range(3)]
    honour = spread("new")
    honour["spec"]["nodeSelector"] = {"pool": "a"}
    view = build_snapshot(nodes, [*elsewhere, spread("w9", bound="n1"), honour], CAT)
    assert not view.problems and kept_off(view, "ml/new") == {"n1"}
