"""A differential test of `planner/pod_conflicts.py` against a brute-force reference written
straight from the kube-scheduler's filters (v1.35: `pkg/scheduler/framework/plugins/`
interpodaffinity/filtering.go, nodeports/node_ports.go with `HostPortInfo.CheckConflict`,
podtopologyspread/filtering.go and common.go). The reference caches nothing: for one pod, the
placed pods (with their nodes) and every node's labels, it tells the nodes each filter refuses.

Generated: small clusters (3-8 nodes, hostname/zone/pool labels, some missing; nodes dynpart plans
and others, some of those tainted), placed pods (bound or in flight, some terminating) and a
sequence of pending pods, drawn from a few shapes (anti-affinity, affinity, spread, host ports)
varied in labels, namespace, a StatefulSet-like index label and nodeSelector, so that the caches
of a `PlacedPods` (per question, term, set of terms, spread constraint, conflicts per question)
see pods asking similar questions. For each pending pod in order, as `build_snapshot` asks:

* `excluded_nodes` equals the nodes the reference refuses, where the planner mirrors the scheduler
  exactly; where it deliberately does not, only the safe direction (it keeps the pod off no node the
  scheduler lets it on) is asserted: a namespaceSelector on labels other than the namespace's name
  (the planner does not watch namespaces: anti-affinity counts only the names listed, pod
  affinity is left to the back-off), and a spread constraint with `nodeTaintsPolicy: Honor` while
  nodes dynpart does not plan exist (their taints are not read: they count for no domain);
* the answer of the `PlacedPods` that has answered every pod before (caches warm) equals a fresh
  one's (a cache key missing an input shows here whatever the reference says);
* of the pods `conflicts_with_planned` lets through in a round, none can break another: for no two
  nodes each may go to (by the reference) does one's placement make the scheduler refuse the other
  on its node (deferring more than needed is only slower, and not checked);
* of the pods `planned_conflicts` lets through (those conflicting on one node only planned
  together, kept apart), one's placement makes the scheduler refuse the other on that node at most,
  and only where the other names it apart (`check_joint`)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from dynpart.planner.cluster_view import pod_for_planning
from dynpart.planner.pod_conflicts import PlacedPods, pod_facts
from tests.controller.test_cluster_view import pod

HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
NAME = "kubernetes.io/metadata.name"
POD_NAME = "statefulset.kubernetes.io/pod-name"
NAMESPACES = {"ml": {NAME: "ml", "team": "x"}, "web": {NAME: "web", "team": "y"}}
MIG_1G = {"nvidia.com/mig-1g.10gb": "1"}


# ---------------------------------------------------------------- the reference (the scheduler's code)

class Selector:
    """metav1.LabelSelectorAsSelector: nil -> Nothing, {} -> Everything (empty), else its requirements."""

    def __init__(self, raw: dict[str, Any] | None, extra: list[tuple[str, str, list[str]]] = ()):
        self.nothing = raw is None
        reqs = [] if raw is None else [(k, "In", [v]) for k, v in (raw.get("matchLabels") or {}).items()]
        reqs += [] if raw is None else [(e["key"], e["operator"], e.get("values") or [])
                                        for e in raw.get("matchExpressions") or []]
        if not self.nothing:
            reqs += extra
        self.reqs = reqs

    def empty(self) -> bool:
        return not self.nothing and not self.reqs

    def matches(self, labels: dict[str, str]) -> bool:
        if self.nothing:
            return False
        for key, op, values in self.reqs:
            if op == "In":
                ok = labels.get(key) in values
            elif op == "NotIn":
                ok = key not in labels or labels[key] not in values
            else:
                ok = (key in labels) == (op == "Exists")
            if not ok:
                return False
        return True


def ref_terms(p: dict[str, Any], kind: str) -> list[tuple[str, Selector, set[str], Selector]]:
    """framework.AffinityTerm of a pod (matchLabelKeys/mismatchLabelKeys merged into the labelSelector
    as the API server does, KEP-3633): (topologyKey, selector, namespaces, namespaceSelector)."""
    labels = p["metadata"].get("labels") or {}
    out = []
    for t in (((p["spec"].get("affinity") or {}).get(kind) or {})
              .get("requiredDuringSchedulingIgnoredDuringExecution") or []):
        raw = t.get("labelSelector")
        extra = [(k, "In", [labels[k]]) for k in t.get("matchLabelKeys") or [] if k in labels]
        extra += [(k, "NotIn", [labels[k]]) for k in t.get("mismatchLabelKeys") or [] if k in labels]
        names = set(t.get("namespaces") or [])
        ns_sel = t.get("namespaceSelector")
        if not names and ns_sel is None:
            names = {p["metadata"]["namespace"]}
        out.append((t["topologyKey"], Selector(raw, extra), names, Selector(ns_sel)))
    return out


def term_matches(term, target: dict[str, Any]) -> bool:
    _, sel, names, ns_sel = term
    ns = target["metadata"]["namespace"]
    return (ns in names or ns_sel.matches(NAMESPACES[ns])) and sel.matches(target["metadata"].get("labels") or {})


def host_ports(p: dict[str, Any]) -> list[tuple[str, str, int]]:
    """schedutil.GetHostPorts: sidecars (restartPolicy Always) and containers, hostPort > 0."""
    out = []
    for c in [*(c for c in p["spec"].get("initContainers") or [] if c.get("restartPolicy") == "Always"),
              *(p["spec"].get("containers") or [])]:
        for port in c.get("ports") or []:
            if (port.get("hostPort") or 0) > 0:
                out.append((port.get("hostIP") or "0.0.0.0", port.get("protocol") or "TCP", port["hostPort"]))
    return out


def ports_conflict(want: tuple[str, str, int], used: list[tuple[str, str, int]]) -> bool:
    """HostPortInfo.CheckConflict."""
    ip, proto, port = want
    if ip == "0.0.0.0":
        return any((pr, po) == (proto, port) for _, pr, po in used)
    return any((pr, po) == (proto, port) and i in ("0.0.0.0", ip) for i, pr, po in used)


def node_selector_admits(p: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (p["spec"].get("nodeSelector") or {}).items())


def ref_refused(p: dict[str, Any], placed: list[tuple[dict[str, Any], str]], nodes: dict[str, dict[str, str]],
                tainted: set[str]) -> set[str]:
    """The nodes InterPodAffinity, NodePorts or PodTopologySpread refuse the pod on."""
    refused = set()
    anti, aff = ref_terms(p, "podAntiAffinity"), ref_terms(p, "podAffinity")
    existing_anti: Counter = Counter()
    anti_counts: Counter = Counter()
    aff_counts: Counter = Counter()
    for q, qn in placed:
        ql = nodes[qn]
        for t in ref_terms(q, "podAntiAffinity"):  # getExistingAntiAffinityCounts
            if term_matches(t, p) and t[0] in ql:
                existing_anti[(t[0], ql[t[0]])] += 1
        for t in anti:  # getIncomingAffinityAntiAffinityCounts
            if term_matches(t, q) and t[0] in ql:
                anti_counts[(t[0], ql[t[0]])] += 1
        if aff and all(term_matches(t, q) for t in aff):  # podMatchesAllAffinityTerms
            for t in aff:
                if t[0] in ql:
                    aff_counts[(t[0], ql[t[0]])] += 1
    self_match = bool(aff) and all(term_matches(t, p) for t in aff)
    for n, labels in nodes.items():
        if any(existing_anti[(k, v)] > 0 for k, v in labels.items()):  # satisfyExistingPodsAntiAffinity
            refused.add(n)
        if any(t[0] in labels and anti_counts[(t[0], labels[t[0]])] > 0 for t in anti):  # satisfyPodAntiAffinity
            refused.add(n)
        if aff:  # satisfyPodAffinity
            if any(t[0] not in labels for t in aff):
                refused.add(n)
            elif not all(aff_counts[(t[0], labels[t[0]])] > 0 for t in aff):
                if not (not aff_counts and self_match):
                    refused.add(n)
    want = host_ports(p)  # NodePorts
    for n in nodes:
        used = [hp for q, qn in placed if qn == n for hp in host_ports(q)]
        if any(ports_conflict(w, used) for w in want):
            refused.add(n)
    # PodTopologySpread
    labels_p = p["metadata"].get("labels") or {}
    constraints = []
    for c in p["spec"].get("topologySpreadConstraints") or []:
        if c["whenUnsatisfiable"] != "DoNotSchedule":
            continue
        extra = [(k, "In", [labels_p[k]]) for k in c.get("matchLabelKeys") or [] if k in labels_p]
        constraints.append((c, Selector(c.get("labelSelector"), extra)))
    if constraints:
        match_num: list[Counter] = [Counter() for _ in constraints]
        domains: list[set[str]] = [set() for _ in constraints]
        for n, labels in nodes.items():
            if not all(c["topologyKey"] in labels for c, _ in constraints):  # nodeLabelsMatchSpreadConstraints
                continue
            for i, (c, sel) in enumerate(constraints):
                if c.get("nodeAffinityPolicy", "Honor") == "Honor" and not node_selector_admits(p, labels):
                    continue
                if c.get("nodeTaintsPolicy", "Ignore") == "Honor" and n in tainted:
                    continue
                value = labels[c["topologyKey"]]
                domains[i].add(value)
                # countPodsMatchSelector: an empty selector counts none; not terminating; own namespace
                if not sel.empty():
                    match_num[i][value] += sum(1 for q, qn in placed if qn == n and not q["metadata"].get("deletionTimestamp")
                                               and q["metadata"]["namespace"] == p["metadata"]["namespace"]
                                               and sel.matches(q["metadata"].get("labels") or {}))
        for n, labels in nodes.items():
            for i, (c, sel) in enumerate(constraints):
                if c["topologyKey"] not in labels:
                    refused.add(n)
                    continue
                least = min((match_num[i][v] for v in domains[i]), default=0)  # criticalPaths[0]
                if len(domains[i]) < c.get("minDomains", 1):
                    least = 0
                if match_num[i][labels[c["topologyKey"]]] + sel.matches(labels_p) - least > c["maxSkew"]:
                    refused.add(n)
    return refused


# ---------------------------------------------------------------- what is generated

def unknown_namespaces(p: dict[str, Any]) -> bool:
    """A term with a namespaceSelector on labels other than the namespace's name."""
    for kind in ("podAffinity", "podAntiAffinity"):
        for t in (((p["spec"].get("affinity") or {}).get(kind) or {})
                  .get("requiredDuringSchedulingIgnoredDuringExecution") or []):
            sel = t.get("namespaceSelector")
            if sel and (any(k != NAME for k in sel.get("matchLabels") or {})
                        or any(e["key"] != NAME or e["operator"] != "In" for e in sel.get("matchExpressions") or [])):
                return True
    return False


label_selectors = st.one_of(
    st.sampled_from(["a", "b"]).map(lambda app: {"matchLabels": {"app": app}}),
    st.tuples(st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]), st.sampled_from([["a"], ["a", "b"], ["b"]])).map(
        lambda o: {"matchExpressions": [{"key": "app", "operator": o[0], **({"values": o[1]} if o[0] in ("In", "NotIn") else {})}]}),
    st.just({}), st.just(None))
namespace_selectors = st.sampled_from([
    None, None, None, {}, {"matchLabels": {NAME: "web"}},
    {"matchExpressions": [{"key": NAME, "operator": "In", "values": ["ml", "web"]}]},
    {"matchLabels": {"team": "y"}}])  # the last: on labels, not mirrored


@st.composite
def affinity_terms(draw) -> dict[str, Any]:
    term: dict[str, Any] = {"topologyKey": draw(st.sampled_from([HOST, ZONE]))}
    sel = draw(label_selectors)
    if sel is not None:
        term["labelSelector"] = sel
        if draw(st.booleans()):
            term["matchLabelKeys"] = ["tier"]
        elif draw(st.integers(0, 3)) == 0:
            term["mismatchLabelKeys"] = [POD_NAME]
    names = draw(st.sampled_from([None, None, ["web"], ["ml", "web"]]))
    if names:
        term["namespaces"] = names
    ns_sel = draw(namespace_selectors)
    if ns_sel is not None:
        term["namespaceSelector"] = ns_sel
    return term


@st.composite
def spread_constraints(draw) -> list[dict[str, Any]]:
    out, seen = [], set()
    for _ in range(draw(st.integers(1, 2))):
        key, when = draw(st.sampled_from([HOST, ZONE, ZONE])), draw(st.sampled_from(["DoNotSchedule"] * 4 + ["ScheduleAnyway"]))
        if (key, when) in seen:  # the API server refuses a duplicate pair
            continue
        seen.add((key, when))
        c: dict[str, Any] = {"maxSkew": draw(st.integers(1, 2)), "topologyKey": key, "whenUnsatisfiable": when}
        sel = draw(label_selectors)
        if sel is not None:
            c["labelSelector"] = sel
            if draw(st.booleans()):
                c["matchLabelKeys"] = ["tier"]
        if when == "DoNotSchedule" and draw(st.integers(0, 2)) == 0:
            c["minDomains"] = draw(st.integers(2, 4))
        for field, values in (("nodeAffinityPolicy", [None, None, "Honor", "Ignore"]),
                              ("nodeTaintsPolicy", [None, "Honor", "Honor", "Ignore"])):
            value = draw(st.sampled_from(values))
            if value:
                c[field] = value
        out.append(c)
    return out


@st.composite
def ports(draw) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, 2))):
        p: dict[str, Any] = {"containerPort": 80, "hostPort": draw(st.sampled_from([7000, 7001]))}
        protocol = draw(st.sampled_from([None, "TCP", "UDP"]))
        if protocol:
            p["protocol"] = protocol
        ip = draw(st.sampled_from([None, None, "10.0.0.1", "10.0.0.2", "0.0.0.0"]))
        if ip:
            p["hostIP"] = ip
        out.append(p)
    return out


@st.composite
def shapes(draw) -> dict[str, Any]:
    """What a workload's pods share: terms, spread constraints, host ports (where they sit)."""
    shape: dict[str, Any] = {}
    affinity = {}
    for kind in ("podAntiAffinity", "podAffinity"):
        if draw(st.integers(0, 2)) == 0:
            affinity[kind] = {"requiredDuringSchedulingIgnoredDuringExecution":
                              draw(st.lists(affinity_terms(), min_size=1, max_size=2))}
    if affinity:
        shape["affinity"] = affinity
    if draw(st.integers(0, 2)) == 0:
        shape["topologySpreadConstraints"] = draw(spread_constraints())
    if draw(st.integers(0, 3)) == 0:
        shape["ports"] = (draw(ports()), draw(st.sampled_from(["containers", "sidecar", "init"])))
    return shape


def make_pod(name: str, shape: dict[str, Any], labels: dict[str, str], namespace: str, node: str | None,
             node_selector: dict[str, str] | None, terminating: bool) -> dict[str, Any]:
    spec = {k: copy.deepcopy(v) for k, v in shape.items() if k in ("affinity", "topologySpreadConstraints")}
    p = pod(name, MIG_1G, phase="Running" if node else "Pending", node=node, unschedulable=not node, **spec)
    p["metadata"].update(namespace=namespace, labels=dict(labels))
    if terminating:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if node_selector:
        p["spec"]["nodeSelector"] = dict(node_selector)
    if "ports" in shape:
        taken, where = shape["ports"]
        if where == "containers":
            p["spec"]["containers"][0]["ports"] = copy.deepcopy(taken)
        else:
            p["spec"]["initContainers"] = [{"name": "side", "ports": copy.deepcopy(taken),
                                            **({"restartPolicy": "Always"} if where == "sidecar" else {})}]
    return p


@st.composite
def clusters(draw) -> dict[str, Any]:
    nodes: dict[str, dict[str, str]] = {}
    planned, tainted = set(), set()
    for i in range(draw(st.integers(3, 8))):
        name = f"n{i}"
        labels = {"pool": draw(st.sampled_from(["a", "b"]))}
        if draw(st.integers(0, 6)):
            labels[HOST] = name
        if draw(st.integers(0, 4)):
            labels[ZONE] = draw(st.sampled_from(["z1", "z1", "z2", "z2", "z3"]))
        nodes[name] = labels
        if i < 2 or draw(st.booleans()):
            planned.add(name)
        elif draw(st.integers(0, 2)) == 0:
            tainted.add(name)  # a node dynpart does not plan, with a taint the pods do not tolerate
    kinds = draw(st.lists(shapes(), min_size=1, max_size=3))
    names = iter(range(1000))

    def pods(placed: bool, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            i = next(names)
            labels = {}
            app = draw(st.sampled_from(["a", "b", None]))
            if app:
                labels["app"] = app
            tier = draw(st.sampled_from(["x", "y", None]))
            if tier:
                labels["tier"] = tier
            if draw(st.booleans()):
                labels[POD_NAME] = f"set-{i}"  # a StatefulSet's pods each carry their own
            out.append(make_pod(f"p{i:03d}", draw(st.sampled_from(kinds)), labels, draw(st.sampled_from(["ml", "ml", "web"])),
                                draw(st.sampled_from(sorted(nodes))) if placed else None,
                                draw(st.sampled_from([None, None, {"pool": "a"}])),
                                placed and draw(st.integers(0, 4)) == 0))
        return out

    return {"nodes": nodes, "planned": planned, "tainted": tainted,
            "placed": pods(True, draw(st.integers(0, 12))), "pending": pods(False, draw(st.integers(1, 7)))}


# ---------------------------------------------------------------- the comparison

def exact_for(p: dict[str, Any], cluster: dict[str, Any]) -> bool:
    """The planner claims to mirror the scheduler exactly for this pod."""
    if unknown_namespaces(p) or any(unknown_namespaces(q) for q in cluster["placed"]):
        return False
    honour_taints = any(c.get("nodeTaintsPolicy") == "Honor" and c["whenUnsatisfiable"] == "DoNotSchedule"
                        for c in p["spec"].get("topologySpreadConstraints") or [])
    return not (honour_taints and set(cluster["nodes"]) - cluster["planned"])


def admits_of(p: dict[str, Any], nodes: dict[str, dict[str, str]]):
    return (lambda n: node_selector_admits(p, nodes.get(n, {}))), tuple(sorted((p["spec"].get("nodeSelector") or {}).items()))


def check(cluster: dict[str, Any]) -> None:
    nodes, placed_pods = cluster["nodes"], cluster["placed"]
    placed = [(q, q["spec"]["nodeName"]) for q in placed_pods]
    planning = [(pod_for_planning(q), n) for q, n in placed]
    shared = PlacedPods(planning, nodes, frozenset(cluster["planned"]))
    taken: list[tuple[dict[str, Any], set[str]]] = []  # pods let through, the planned nodes each may go to
    for p in cluster["pending"]:
        facts = pod_facts(pod_for_planning(p))
        admits, key = admits_of(p, nodes)
        got = shared.excluded_nodes(facts, admits, key if facts.spread else None)
        fresh = PlacedPods(planning, nodes, frozenset(cluster["planned"])).excluded_nodes(facts, admits, key)
        assert got == fresh, f"cached answer {sorted(got)} != fresh {sorted(fresh)} for {p['metadata']}"
        want = ref_refused(p, placed, nodes, cluster["tainted"])
        if exact_for(p, cluster):
            assert got == want, f"planner {sorted(got)} != scheduler {sorted(want)} for {p['metadata']['name']}"
        else:
            assert got <= want, f"planner keeps it off {sorted(got - want)}, which the scheduler allows"
        may = {n for n in cluster["planned"] if n not in got and node_selector_admits(p, nodes[n])}
        if not may:
            continue  # blocked: never planned
        if shared.conflicts_with_planned(facts) is not None:
            continue  # deferred (perhaps more than needed: only slower)
        shared.take(facts)
        allowed = may - want
        for older, older_allowed in taken:
            if unknown_namespaces(p) or unknown_namespaces(older):
                continue  # the namespaces a term selects by their labels: not known to the planner
            for n_old in older_allowed:
                # the older pod's placement must not make the scheduler refuse this one where it may go,
                assert not allowed & ref_refused(p, [*placed, (older, n_old)], nodes, cluster["tainted"]), \
                    f"{p['metadata']['name']} let through beside {older['metadata']['name']} on {n_old}"
            for n_new in allowed:
                # nor this one's placement the older one, bound later
                assert not older_allowed & ref_refused(older, [*placed, (p, n_new)], nodes, cluster["tainted"]), \
                    f"{older['metadata']['name']} broken by {p['metadata']['name']} on {n_new}"
        taken.append((p, allowed))
    check_joint(cluster)


def check_joint(cluster: dict[str, Any]) -> None:
    """The pods `planned_conflicts` lets through in a round, each kept apart from the partners it
    names (`PendingPod.apart`): a partner placed anywhere it may go makes the scheduler refuse the
    pod on the partner's own node at most (so different nodes are enough), and a pod it does not
    name, on no node; both ways."""
    nodes, placed_pods = cluster["nodes"], cluster["placed"]
    placed = [(q, q["spec"]["nodeName"]) for q in placed_pods]
    joint = PlacedPods([(pod_for_planning(q), n) for q, n in placed], nodes, frozenset(cluster["planned"]))
    taken: list[tuple[dict[str, Any], set[str], str]] = []
    for p in cluster["pending"]:
        facts = pod_facts(pod_for_planning(p))
        admits, key = admits_of(p, nodes)
        got = joint.excluded_nodes(facts, admits, key if facts.spread else None)
        may = {n for n in cluster["planned"] if n not in got and node_selector_admits(p, nodes[n])}
        if not may:
            continue
        older, partners = joint.planned_conflicts(facts)
        if older is not None:
            continue  # deferred
        partners = list(partners)
        joint.take(facts)
        allowed = may - ref_refused(p, placed, nodes, cluster["tainted"])
        for q, q_allowed, q_key in taken:
            if unknown_namespaces(p) or unknown_namespaces(q):
                continue
            apart = q_key in partners
            for n_old in q_allowed:
                refused = allowed & ref_refused(p, [*placed, (q, n_old)], nodes, cluster["tainted"])
                assert refused <= ({n_old} if apart else set()), \
                    f"{p['metadata']['name']} beside {q['metadata']['name']} on {n_old} (apart: {apart}): {refused}"
            for n_new in allowed:
                refused = q_allowed & ref_refused(q, [*placed, (p, n_new)], nodes, cluster["tainted"])
                assert refused <= ({n_new} if apart else set()), \
                    f"{q['metadata']['name']} broken by {p['metadata']['name']} on {n_new} (apart: {apart}): {refused}"
        taken.append((p, allowed, facts.key))


def _honour(key: str, **c: Any) -> dict[str, Any]:
    return {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule",
                                           "labelSelector": {"matchLabels": {"app": "a"}}, "nodeTaintsPolicy": "Honor", **c}]}


# (seldom generated) a node dynpart does not plan, untainted, sharing a zone with a planned node;
# one making the third of minDomains 3
MIXED_ZONE = {"nodes": {"n0": {ZONE: "z1"}, "n1": {ZONE: "z2"}, "o2": {ZONE: "z1"}}, "planned": {"n0", "n1"}, "tainted": set(),
              "placed": [make_pod(f"p{i}", _honour(ZONE), {"app": "a"}, "ml", n, None, False) for i, n in enumerate(["o2", "n1"])],
              "pending": [make_pod("p9", _honour(ZONE), {"app": "a"}, "ml", None, None, False)]}
MIN_DOMAINS = {"nodes": {n: {HOST: n} for n in ("n0", "n1", "o2")}, "planned": {"n0", "n1"}, "tainted": set(),
               "placed": [make_pod(f"p{i}", _honour(HOST, minDomains=3), {"app": "a"}, "ml", n, None, False)
                          for i, n in enumerate(["n0", "n1", "o2"])],
               "pending": [make_pod("p9", _honour(HOST, minDomains=3), {"app": "a"}, "ml", None, None, False)]}


def _anti(key: str) -> dict[str, Any]:
    return {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": key, "labelSelector": {"matchLabels": {"app": "a"}}}]}}}


# replicas kept apart on the hostname, and on a zone key whose values two planned nodes share
# (planned together only where every planned node's value is its own)
APART = {key: {"nodes": {f"n{i}": {HOST: f"n{i}", ZONE: z} for i, z in enumerate(["z1", "z1", "z2"])},
               "planned": {"n0", "n1", "n2"}, "tainted": set(), "placed": [],
               "pending": [make_pod(f"p{i}", _anti(key), {"app": "a"}, "ml", None, None, False) for i in range(3)]}
         for key in (HOST, ZONE)}


@example(APART[HOST])
@example(APART[ZONE])
@example(MIXED_ZONE)
@example(MIN_DOMAINS)
@seed(20260101)
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_excluded_nodes_and_conflicts_agree_with_the_schedulers_filters(cluster):
    check(cluster)
