"""Pods that may not share a node, or a topology domain, with others, as three of the
kube-scheduler's filters decide: InterPodAffinity for required pod anti-affinity (both ways: the
pod's terms against the pods placed, and their terms against the pod) and required pod affinity
(the pod only in the domains of the placed pods it selects), NodePorts (host ports) and
PodTopologySpread (constraints with `whenUnsatisfiable: DoNotSchedule`). Pure code over the pods
as the planner's cache keeps them (`cluster_view.pod_for_planning`).

Without it the objective packs the replicas of a Deployment whose pods must not share a node (or
must spread over nodes or zones) onto one node's GPUs: the scheduler binds one there and refuses the others, whose slices stay free.
So a pending pod is kept off the nodes where placed pods (bound, nominated, reserved, or planned
by a plan in flight) conflict with it, and of two pending pods that conflict, only the older is
planned in a round: the younger is planned by the next one, where the older counts as placed;
unless they conflict on one node only (host ports, anti-affinity on a key whose every domain is one
node, `kubernetes.io/hostname`): both are then planned in the round, kept apart
(`PendingPod.apart`, `planned_conflicts`).

Not mirrored (the pod then falls to the loop's back-off, `planner/loop.py`, which tries the other
nodes): a spread constraint's `nodeTaintsPolicy: Honor` (the taints of the nodes dynpart plans
are ignored; those of the nodes it does not plan are not read: a node is kept off only where the
scheduler refuses it whether it counts them or not; `Ignore` is the default), a
namespaceSelector on labels other than the namespace's name (the planner does not watch namespaces:
such a term counts only its `namespaces`). The nodes dynpart does not plan count by their labels
(`node_labels`: every node's, those the controller's "other nodes" watch lists too): as topology
domains for spread (a CPU-only node holding no replica makes the least 0), and the pods bound
there in their domains; until that watch has listed, they are unknown."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # every namespace carries its name as this label
ANY_IP = "0.0.0.0"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        return False  # an operator the API server would have refused


@dataclass(frozen=True)
class AntiAffinityTerm:
    """One required pod anti-affinity term, resolved against its own pod (namespaces,
    matchLabelKeys and mismatchLabelKeys)."""
    topology_key: str
    requirements: tuple[Requirement, ...] | None  # None: a null labelSelector, which matches no pod
    namespaces: frozenset[str] | None  # None: every namespace

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return (self.requirements is not None and (self.namespaces is None or namespace in self.namespaces)
                and all(r.matches(labels) for r in self.requirements))


@dataclass(frozen=True)
class HostPort:
    ip: str
    protocol: str
    port: int

    def clashes(self, other: HostPort) -> bool:
        return (self.port == other.port and self.protocol == other.protocol
                and (self.ip == other.ip or ANY_IP in (self.ip, other.ip)))


@dataclass(frozen=True)
class SpreadConstraint:
    """A topology spread constraint with `whenUnsatisfiable: DoNotSchedule` (the others only rank
    nodes), resolved against its own pod (matchLabelKeys). It counts the pods of the pod's own
    namespace that its selector selects, on the nodes its node affinity admits
    (`nodeAffinityPolicy: Honor`, the default; `Ignore` counts every node)."""
    topology_key: str
    max_skew: int
    min_domains: int
    requirements: tuple[Requirement, ...] | None
    honour_affinity: bool = True
    # nodeTaintsPolicy: Honor: the nodes whose taints the pod does not tolerate are no domains. The
    # planner reads no taints of the nodes it does not plan (CPU nodes, control planes): a node is
    # kept off only where the scheduler refuses it whether it counts those or not (`_spread_off`)
    honour_taints: bool = False

    def selects(self, labels: Mapping[str, str]) -> bool:
        """The selector matches the labels (the pod's own, for the self-match: `{}` matches every pod)."""
        return self.requirements is not None and all(r.matches(labels) for r in self.requirements)

    def counts(self, labels: Mapping[str, str]) -> bool:
        """A placed pod with these labels counts in its domain: an empty selector (`labelSelector: {}`
        and no matchLabelKeys the pod carries) counts none, as the scheduler's `countPodsMatchSelector`
        (`selector.Empty()`), though it matches the pod itself (its domain's skew is then 1 at most)."""
        return bool(self.requirements) and self.selects(labels)


@dataclass(frozen=True)
class PodFacts:
    key: str
    namespace: str
    labels: Mapping[str, str]
    terms: tuple[AntiAffinityTerm, ...]
    ports: tuple[HostPort, ...]
    spread: tuple[SpreadConstraint, ...] = ()
    affinity: tuple[AntiAffinityTerm, ...] = ()  # required pod affinity terms (the same shape as anti-affinity's)

    def excludes(self, other: PodFacts) -> bool:
        """Either pod's terms select the other (the scheduler checks both ways)."""
        return (any(t.selects(other.namespace, other.labels) for t in self.terms)
                or any(t.selects(self.namespace, self.labels) for t in other.terms))

    def attracts(self, other: PodFacts) -> bool:
        """The pod's required pod affinity selects the other (every term of it, as the scheduler
        counts a pod for affinity): where the other goes decides where this one may."""
        return bool(self.affinity) and all(t.selects(other.namespace, other.labels) for t in self.affinity)

    def spreads_with(self, other: PodFacts) -> bool:
        """The pod's spread constraints count the other, or the other's count it: where one goes
        changes where the other may."""
        return self.namespace == other.namespace and (any(c.counts(other.labels) for c in self.spread)
                                                      or any(c.counts(self.labels) for c in other.spread))


def as_dict(value: object) -> dict[str, Any]:
    """A field of an API object read as a mapping: empty when missing or of another type."""
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[Any]:
    """A field of an API object read as a list: empty when missing or of another type."""
    return value if isinstance(value, list) else []




def _labels(metadata: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in as_dict(metadata.get("labels")).items()}


def _selector(raw: object, labels: Mapping[str, str], match_keys: Iterable[str],
              mismatch_keys: Iterable[str]) -> tuple[Requirement, ...] | None:
    if not isinstance(raw, dict):
        return None
    reqs = [Requirement(str(k), "In", frozenset({str(v)})) for k, v in as_dict(raw.get("matchLabels")).items()]
    for e in as_list(raw.get("matchExpressions")):
        e = as_dict(e)
        reqs.append(Requirement(str(e.get("key")), str(e.get("operator")),
                                frozenset(str(v) for v in as_list(e.get("values")))))
    # the pod's own values of these keys join the selector (KEP-3633)
    reqs += [Requirement(k, "In", frozenset({labels[k]})) for k in match_keys if k in labels]
    reqs += [Requirement(k, "NotIn", frozenset({labels[k]})) for k in mismatch_keys if k in labels]
    return tuple(reqs)


def _namespaces(term: Mapping[str, Any], own: str) -> frozenset[str] | None:
    names = {str(n) for n in as_list(term.get("namespaces"))}
    selector = term.get("namespaceSelector")
    if selector is None:
        return frozenset(names) if names else frozenset({own})
    selector = as_dict(selector)
    match_labels, exprs = as_dict(selector.get("matchLabels")), [as_dict(e) for e in as_list(selector.get("matchExpressions"))]
    if not match_labels and not exprs:
        return None  # {}: every namespace
    if (all(k == NAMESPACE_NAME_LABEL for k in match_labels)
            and all(e.get("key") == NAMESPACE_NAME_LABEL and e.get("operator") == "In" for e in exprs)):
        # on the namespace's name only: the names every requirement admits
        admitted = [{str(v)} for v in match_labels.values()] + [{str(v) for v in as_list(e.get("values"))} for e in exprs]
        return frozenset(names | set.intersection(*admitted))
    return frozenset(names)  # labels of namespaces the planner does not watch: only the names listed


def _namespaces_known(term: Mapping[str, Any]) -> bool:
    """The namespaces a term selects are known exactly (`_namespaces`): no namespaceSelector, an
    empty one, or one on the namespace's name only."""
    selector = term.get("namespaceSelector")
    if selector is None:
        return True
    selector = as_dict(selector)
    match_labels, exprs = as_dict(selector.get("matchLabels")), [as_dict(e) for e in as_list(selector.get("matchExpressions"))]
    return (all(k == NAMESPACE_NAME_LABEL for k in match_labels)
            and all(e.get("key") == NAMESPACE_NAME_LABEL and e.get("operator") == "In" for e in exprs))


def pod_facts(pod: Mapping[str, Any]) -> PodFacts:
    md, spec = as_dict(pod.get("metadata")), as_dict(pod.get("spec"))
    namespace = str(md.get("namespace") or "")
    labels = _labels(md)
    def required(kind: str) -> tuple[AntiAffinityTerm, ...]:
        out = []
        raw = [as_dict(t) for t in as_list(as_dict(as_dict(spec.get("affinity")).get(kind))
                                           .get("requiredDuringSchedulingIgnoredDuringExecution"))]
        if kind == "podAffinity" and not all(map(_namespaces_known, raw)):
            # a namespaceSelector on labels other than the name: the pods it selects in namespaces
            # the planner cannot tell would be missed, and the pod kept off every node the scheduler
            # lets it on (anti-affinity only under-counts): its affinity is left to the back-off
            return ()
        for t in raw:
            key = t.get("topologyKey")
            if isinstance(key, str) and key:
                out.append(AntiAffinityTerm(key, _selector(t.get("labelSelector"), labels,
                                                           map(str, as_list(t.get("matchLabelKeys"))),
                                                           map(str, as_list(t.get("mismatchLabelKeys")))),
                                            _namespaces(t, namespace)))
        return tuple(out)
    terms = required("podAntiAffinity")
    ports = []
    sidecars = [c for c in as_list(spec.get("initContainers")) if as_dict(c).get("restartPolicy") == "Always"]
    for c in [*as_list(spec.get("containers")), *sidecars]:
        for p in map(as_dict, as_list(as_dict(c).get("ports"))):
            host_port = p.get("hostPort")
            if isinstance(host_port, int) and host_port > 0:
                ports.append(HostPort(str(p.get("hostIP") or ANY_IP), str(p.get("protocol") or "TCP"), host_port))
    spread = []
    for c in map(as_dict, as_list(spec.get("topologySpreadConstraints"))):
        key, skew = c.get("topologyKey"), c.get("maxSkew")
        if c.get("whenUnsatisfiable") == "DoNotSchedule" and isinstance(key, str) and key and isinstance(skew, int):
            min_domains = c.get("minDomains")
            spread.append(SpreadConstraint(key, skew, min_domains if isinstance(min_domains, int) else 1,
                                           _selector(c.get("labelSelector"), labels,
                                                     map(str, as_list(c.get("matchLabelKeys"))), ()),
                                           c.get("nodeAffinityPolicy") != "Ignore", c.get("nodeTaintsPolicy") == "Honor"))
    return PodFacts(f"{namespace}/{md.get('name')}", namespace, labels, terms, tuple(ports), tuple(spread),
                    required("podAffinity"))


def _may_conflict(pod: Mapping[str, Any]) -> bool:
    """The pod has anti-affinity terms or host ports (a cheap look before `pod_facts`)."""
    spec = as_dict(pod.get("spec"))
    if as_dict(spec.get("affinity")).get("podAntiAffinity") or spec.get("topologySpreadConstraints"):
        return True
    return any(as_dict(p).get("hostPort") for c in [*as_list(spec.get("containers")), *as_list(spec.get("initContainers"))]
               for p in as_list(as_dict(c).get("ports")))


class PlacedPods:
    """The pods placed (or about to be) and the nodes they are on, indexed for the questions a
    round asks of every pending pod: which nodes it must stay off, and whether it conflicts with
    an older pending pod planned in the same round. A round asks for thousands of pending pods,
    mostly replicas that ask the same: answers are kept per question (`excluded_nodes`), nodes per
    topology domain, and the placed pods' terms per distinct term."""

    def __init__(self, placed: Iterable[tuple[Mapping[str, Any], str]], node_labels: Mapping[str, Mapping[str, str]],
                 planned_nodes: AbstractSet[str] | None = None):
        self.node_labels = node_labels
        self.planned_nodes = planned_nodes  # the nodes dynpart plans (their taints known); None: all
        self.placed = list(placed)
        self._by_namespace: dict[str, list[tuple[Mapping[str, str], str, bool]]] | None = None  # when a term asks
        self._domains: dict[str, dict[str, frozenset[str]]] = {}  # topology key -> value -> nodes
        # the placed pods' anti-affinity terms, each distinct term once (a Deployment's replicas
        # share theirs) -> the nodes of the pods that carry it
        self.term_nodes: dict[AntiAffinityTerm, set[str]] = {}
        self.by_port: dict[tuple[str, int], list[tuple[HostPort, str]]] = {}
        for pod, node in self.placed:
            if _may_conflict(pod):  # most pods have neither: their labels are read only if a term asks
                facts = pod_facts(pod)
                for term in facts.terms:
                    self.term_nodes.setdefault(term, set()).add(node)
                for p in facts.ports:
                    self.by_port.setdefault((p.protocol, p.port), []).append((p, node))
        self._answers: dict[tuple[object, ...], frozenset[str]] = {}
        self._selected: dict[AntiAffinityTerm, frozenset[str]] = {}  # term -> nodes of the placed pods it selects
        # required pod affinity terms -> (the nodes they keep a pod off when a placed pod matches them,
        # or None when none does: the self-match rule decides; or None when one sits on a node whose
        # labels are unknown: not mirrored), the nodes carrying every key
        self._affinity: dict[tuple[AntiAffinityTerm, ...], tuple[frozenset[str] | None, frozenset[str] | None, bool]] = {}
        # the parts of an answer, each kept per the narrower question it depends on: pods whose
        # labels differ (a StatefulSet's or an indexed Job's, each with its own index label) ask
        # `excluded_nodes` distinct questions, and each part reads every node or every placed pod
        self._term_off: dict[AntiAffinityTerm, set[str]] = {}  # the pod's term -> the domains of the pods it selects
        self._carried_off: dict[AntiAffinityTerm, set[str]] = {}  # a placed pod's term -> the domains of its pods
        self._terms_in: dict[str, list[AntiAffinityTerm]] = {}  # namespace -> the placed terms that may select its pods
        self._spread_answers: dict[tuple[object, ...], frozenset[str]] = {}
        self.planned: list[PodFacts] = []  # pending pods planned in this round (`take`)
        self._planned_with_terms: list[PodFacts] = []
        # planned pods whose affinity no placed pod matched (the first of a self-attracting group,
        # placed anywhere): a younger pod their terms select, placed elsewhere first, would pin them
        self._planned_first: list[PodFacts] = []
        # question (`conflicts_with_planned`) -> how many pods of its list were looked at, and the
        # keys of those it conflicts with, in order: the replicas of a Deployment ask the same
        self._conflicts: dict[tuple[object, ...], tuple[int, list[str]]] = {}
        # the same for `planned_conflicts`: how many looked at, those it waits for (a conflict over a
        # domain wider than a node), those it only must not share a node with
        self._joint: dict[tuple[object, ...], tuple[int, list[str], list[str]]] = {}
        # the label keys the planned pods' terms, spread and affinity selectors read: a pending pod's
        # other labels (a StatefulSet's pod-name, an indexed Job's completion index) change no answer of
        # `planned_conflicts`, so its question leaves them out (each such pod asked a question of its
        # own, compared with every pod planned: 2,000 StatefulSet replicas took 8.5 s of a round)
        self._read_keys: set[str] = set()
        self._node_level: dict[str, bool] = {}  # topology key -> its every domain is one node

    def by_namespace(self) -> dict[str, list[tuple[Mapping[str, str], str, bool]]]:
        """Namespace -> its placed pods' labels, nodes and whether they are terminating."""
        if self._by_namespace is None:
            self._by_namespace = {}
            for pod, node in self.placed:
                md = as_dict(pod.get("metadata"))
                self._by_namespace.setdefault(str(md.get("namespace") or ""), []).append(
                    (_labels(md), node, bool(md.get("deletionTimestamp"))))
        return self._by_namespace

    def _domain_of(self, key: str) -> dict[str, frozenset[str]]:
        """Topology value -> the planned nodes carrying it."""
        found = self._domains.get(key)
        if found is None:
            by_value: dict[str, set[str]] = {}
            for n, labels in self.node_labels.items():
                if key in labels:
                    by_value.setdefault(labels[key], set()).add(n)
            found = self._domains[key] = {v: frozenset(ns) for v, ns in by_value.items()}
        return found

    def _domains_of(self, nodes: Iterable[str], key: str) -> set[str]:
        """The planned nodes sharing a domain of `key` with any of these nodes."""
        index = self._domain_of(key)
        values = {self.node_labels.get(n, {}).get(key) for n in nodes} - {None}
        return set().union(*(index.get(v, frozenset()) for v in values if v is not None))

    def _selected_nodes(self, term: AntiAffinityTerm) -> frozenset[str]:
        """The nodes of the placed pods the term selects (terminating ones too, as the scheduler)."""
        found = self._selected.get(term)
        if found is None:
            by_namespace = self.by_namespace()
            spaces = by_namespace if term.namespaces is None else {ns: by_namespace.get(ns, []) for ns in term.namespaces}
            found = self._selected[term] = frozenset(node for ns, pods in spaces.items() for labels, node, _ in pods
                                                     if term.selects(ns, labels))
        return found

    def excluded_nodes(self, facts: PodFacts, admits: Callable[[str], bool] = lambda node: True,
                       admits_key: object = None) -> frozenset[str]:
        """The nodes the pod must stay off: a placed pod there (or in the same topology domain)
        that its terms select, or whose terms select it, or that holds one of its host ports; and
        where its spread constraints would be broken. `admits`: the nodes its node affinity admits
        (`admits_key` tells one pod's from another's: answers are kept per question)."""
        question = (facts.namespace, frozenset(facts.labels.items()), facts.terms, facts.ports, facts.spread,
                    facts.affinity, admits_key if facts.spread else None)
        found = self._answers.get(question)
        if found is not None:
            return found
        out: set[str] = set()
        for constraint in facts.spread:
            out |= self._spread_off(facts, constraint, admits, admits_key)
        for term in facts.terms:
            if term not in self._term_off:
                self._term_off[term] = self._domains_of(self._selected_nodes(term), term.topology_key)
            out |= self._term_off[term]
        for term in self._terms_selecting(facts.namespace):
            if term.selects(facts.namespace, facts.labels):
                if term not in self._carried_off:
                    self._carried_off[term] = self._domains_of(self.term_nodes[term], term.topology_key)
                out |= self._carried_off[term]
        for p in facts.ports:
            out |= {node for q, node in self.by_port.get((p.protocol, p.port), []) if p.clashes(q)}
        if facts.affinity:
            out |= self._affinity_off(facts)
        found = self._answers[question] = frozenset(out)
        return found

    def _terms_selecting(self, namespace: str) -> list[AntiAffinityTerm]:
        """The placed pods' terms that may select a pod of the namespace (every namespace's, or its)."""
        found = self._terms_in.get(namespace)
        if found is None:
            found = self._terms_in[namespace] = [t for t in self.term_nodes
                                                 if t.namespaces is None or namespace in t.namespaces]
        return found

    def _affinity_off(self, facts: PodFacts) -> set[str]:
        """The nodes the pod's required pod affinity keeps it off, as the InterPodAffinity filter
        decides: a node must carry every term's key, and each term's domain there must hold a placed
        pod that every term selects (terminating ones too); while no such pod sits on a node carrying
        any of the keys, a pod that its own terms select may go to any node carrying them all (the
        first of a group that attracts itself). A matching pod on a node whose labels are unknown
        (the other nodes' watch has not listed it): its domain is unknown, nothing is kept off (the
        back-off's). Computed once per distinct set of terms (StatefulSet pods differ in labels)."""
        off, with_keys, _ = self._affinity_of(facts.affinity)
        if off is not None:
            return set(off)
        if with_keys is None:
            return set()
        return set(self.node_labels) - (with_keys if facts.attracts(facts) else set())

    def _affinity_of(self, terms: tuple[AntiAffinityTerm, ...]
                     ) -> tuple[frozenset[str] | None, frozenset[str] | None, bool]:
        """(the nodes kept off, when a placed pod matches every term; the nodes carrying every key,
        None when a matching pod's node is unknown; whether no placed pod matches: the self-match
        rule decides), once per set of terms."""
        cached = self._affinity.get(terms)
        if cached is not None:
            return cached
        known: tuple[frozenset[str] | None, frozenset[str] | None, bool]
        keys = {t.topology_key for t in terms}
        spaces = self.by_namespace()
        names: set[str] | None = None
        for t in terms:  # only the namespaces every term selects
            if t.namespaces is not None:
                names = set(t.namespaces) if names is None else names & t.namespaces
        candidates = spaces.items() if names is None else ((ns, spaces.get(ns, [])) for ns in names)
        matched = {node for ns, pods in candidates for labels, node, _ in pods
                   if all(t.selects(ns, labels) for t in terms)}  # the nodes of the placed pods every term selects
        found = [n for n in matched if n not in self.node_labels or keys & self.node_labels[n].keys()]
        with_keys = frozenset(n for n, labels in self.node_labels.items() if keys <= labels.keys())
        if any(n not in self.node_labels for n in found):
            known = (None, None, False)
        elif not found:
            known = (None, with_keys, True)
        else:
            allowed = set(with_keys)
            for t in terms:
                allowed &= self._domains_of(found, t.topology_key)
            known = (frozenset(set(self.node_labels) - allowed), with_keys, False)
        self._affinity[terms] = known
        return known

    def _spread_off(self, facts: PodFacts, c: SpreadConstraint, admits: Callable[[str], bool],
                    admits_key: object = None) -> frozenset[str]:
        """The nodes where the pod would break the constraint, as the PodTopologySpread filter
        decides: those without the topology key, and those whose domain would hold more than
        `max_skew` matching pods beyond the least held domain (0 while fewer than `min_domains`),
        counting the nodes that carry every constraint's key. Kept per what it depends on (the
        namespace, the constraint, the keys of all the pod's constraints, the nodes its affinity
        admits, whether the constraint selects the pod itself): it reads every node."""
        # a node lacking any of the pod's constraints' keys counts for none of them, as the
        # scheduler's `nodeLabelsMatchSpreadConstraints`: its empty domain is never the least
        keys = {k.topology_key for k in facts.spread}
        mine = 1 if c.selects(facts.labels) else 0
        question = (facts.namespace, c, frozenset(keys), admits_key if c.honour_affinity else None, mine)
        known = self._spread_answers.get(question)
        if known is not None:
            return known
        counted = [n for n, labels in self.node_labels.items()
                   if keys <= labels.keys() and (not c.honour_affinity or admits(n))]
        # nodeTaintsPolicy: Honor: the nodes dynpart does not plan, whose taints are not read, count
        # in the scheduler only where the pod tolerates them. Either way is possible: a node is kept
        # off only where the scheduler refuses it whichever of them it counts (their pods are left
        # out of the node's own domain; the least is the greatest it can be, every one of them
        # counted, and their domains counted towards `min_domains`). Counted as no domains, a
        # domain mixing them with planned nodes held fewer pods than the scheduler counts and was
        # the least, or too few domains made it 0: pods kept off nodes the scheduler allows
        unread = (frozenset() if not c.honour_taints or self.planned_nodes is None
                  else frozenset(n for n in counted if n not in self.planned_nodes))
        domains = {n: self.node_labels[n][c.topology_key] for n in counted}
        count = dict.fromkeys(domains.values(), 0)  # every counted node's pods
        read = dict.fromkeys((v for n, v in domains.items() if n not in unread), 0)  # the read nodes' only
        for labels, node, terminating in self.by_namespace().get(facts.namespace, []):
            if node in domains and not terminating and c.counts(labels):  # (countPodsMatchSelector skips terminating pods)
                count[domains[node]] += 1
                if node not in unread:
                    read[domains[node]] += 1
        if len(count) < c.min_domains:
            least = 0
        elif not unread:
            least = min(count.values())
        else:  # (no read domain: no planned node the pod may go to carries the keys; none kept off)
            least = min((count[v] for v in read), default=max(count.values()))
        found = self._spread_answers[question] = frozenset(
            n for n, labels in self.node_labels.items()
            if c.topology_key not in labels or read.get(labels[c.topology_key], 0) + mine - least > c.max_skew)
        return found

    def conflicts_with_planned(self, facts: PodFacts, ignoring: AbstractSet[str] = frozenset()) -> str | None:
        """The older pending pod of this round the pod conflicts with, if any (those in `ignoring` aside)."""
        # a pod with neither terms, host ports nor spread constraints conflicts only with a pod whose
        # terms or constraints select it
        pool = self.planned if facts.terms or facts.ports or facts.spread or facts.affinity else self._planned_with_terms
        # (whether two pods conflict does not depend on their names: the pods of a question are
        # looked at once, those planned since it was last asked only)
        question = (facts.namespace, frozenset(facts.labels.items()), facts.terms, facts.ports, facts.spread,
                    facts.affinity)
        looked, found = self._conflicts.get(question, (0, []))
        for i in range(looked, len(pool)):
            other = pool[i]
            if (facts.excludes(other) or facts.spreads_with(other) or facts.attracts(other)
                    or any(p.clashes(q) for p in facts.ports for q in other.ports)):
                found.append(other.key)
        self._conflicts[question] = (len(pool), found)
        key = next((key for key in found if key not in ignoring), None)
        if key is not None:
            return key
        for other in self._planned_first:
            if other.key not in ignoring and other.key != facts.key and other.attracts(facts):
                return other.key
        return None

    def node_level(self, key: str) -> bool:
        """Every node dynpart plans carries the topology key, with a value no other of them carries
        (`kubernetes.io/hostname`): two pending pods whose anti-affinity is on it conflict only
        on one node. Read from the round's labels, not assumed of the key's name."""
        found = self._node_level.get(key)
        if found is None:
            nodes = self.node_labels.keys() if self.planned_nodes is None else self.planned_nodes
            seen: set[str] = set()
            found = True
            for n in nodes:
                value = self.node_labels.get(n, {}).get(key)
                if value is None or value in seen:
                    found = False
                    break
                seen.add(value)
            self._node_level[key] = found
        return found

    def _apart_only(self, facts: PodFacts, other: PodFacts) -> bool | None:
        """How two pods conflict: None, not at all; True, on a node only (host ports, anti-affinity
        on `node_level` keys only); False, over wider domains (other keys, spread, affinity)."""
        if facts.spreads_with(other) or facts.attracts(other):
            return False
        keys = {t.topology_key for t in facts.terms if t.selects(other.namespace, other.labels)}
        keys.update(t.topology_key for t in other.terms if t.selects(facts.namespace, facts.labels))
        if keys and not all(self.node_level(k) for k in keys):
            return False
        if keys or any(p.clashes(q) for p in facts.ports for q in other.ports):
            return True
        return None

    def planned_conflicts(self, facts: PodFacts, ignoring: AbstractSet[str] = frozenset()
                          ) -> tuple[str | None, list[str]]:
        """`conflicts_with_planned`, where the pods of this round that conflict with it only on one
        node (`_apart_only`) are planned with it, kept apart: (the older pending pod of this round it
        waits for, if any, those in `ignoring` aside; the older ones it must not share a node
        with, those in `ignoring` too: the list is the question's own, the caller copies it)."""
        pool = self.planned if facts.terms or facts.ports or facts.spread or facts.affinity else self._planned_with_terms
        # (the pods of the pool read only these keys of its labels: `take`; its own terms, ports,
        # spread and affinity read the others' labels, each looked at below)
        question = (facts.namespace, frozenset((k, v) for k, v in facts.labels.items() if k in self._read_keys),
                    facts.terms, facts.ports, facts.spread, facts.affinity)
        looked, wide, apart = self._joint.get(question, (0, [], []))
        for i in range(looked, len(pool)):
            other = pool[i]
            how = self._apart_only(facts, other)
            if how is not None:
                (apart if how else wide).append(other.key)
        self._joint[question] = (len(pool), wide, apart)
        key = next((key for key in wide if key not in ignoring), None)
        if key is None:
            key = next((other.key for other in self._planned_first
                        if other.key not in ignoring and other.key != facts.key and other.attracts(facts)), None)
        return key, apart

    def take(self, facts: PodFacts) -> None:
        self.planned.append(facts)
        for reqs in [*(t.requirements for t in (*facts.terms, *facts.affinity)), *(c.requirements for c in facts.spread)]:
            self._read_keys.update(r.key for r in reqs or ())
        if facts.terms or facts.spread:
            self._planned_with_terms.append(facts)
        if facts.affinity and self._affinity_of(facts.affinity)[2]:
            self._planned_first.append(facts)
