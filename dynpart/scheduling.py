"""The node constraints the kube-scheduler applies besides resources, as its filters apply them:
taints and tolerations (TaintToleration), cordoned nodes (NodeUnschedulable) and required node
affinity (NodeAffinity; `nodeSelector` is `PendingPod.node_selector`). The planner plans a pod
only onto nodes these admit, so that a slice made for it is one the scheduler can bind it to.
Pure; semantics of k8s.io/component-helpers/scheduling/corev1 (`ToleratesTaint`,
`nodeaffinity.NodeSelector.Match`). Not modelled: preferred affinity, inter-pod affinity and
topology spread (they rank or spread nodes, and the planner's own objective chooses among them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# the taint a cordoned node carries (node.spec.unschedulable): the scheduler's NodeUnschedulable
# filter lets through only the pods that tolerate it
UNSCHEDULABLE_KEY = "node.kubernetes.io/unschedulable"

# the effects a pod must tolerate to be placed (PreferNoSchedule only ranks nodes)
_FILTERING = ("NoSchedule", "NoExecute")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Taint(_Model):
    key: str = Field(min_length=1)
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


class Toleration(_Model):
    key: str = ""  # empty, with operator Exists: every taint
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""  # empty: every effect

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(f"toleration {self.key!r}: operator Exists takes no value (got {self.value!r})")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration with an empty key must use operator Exists")
        return self


class NodeSelectorRequirement(_Model):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values_fit(self) -> NodeSelectorRequirement:
        op, n = self.operator, len(self.values)
        if op in ("In", "NotIn") and n == 0:
            raise ValueError(f"requirement on {self.key!r}: operator {op} needs at least one value")
        if op in ("Exists", "DoesNotExist") and n:
            raise ValueError(f"requirement on {self.key!r}: operator {op} takes no values")
        if op in ("Gt", "Lt"):
            if n != 1:
                raise ValueError(f"requirement on {self.key!r}: operator {op} needs exactly one value")
            if _go_int64(self.values[0]) is None:
                raise ValueError(f"requirement on {self.key!r}: operator {op} needs an integer, "
                                 f"got {self.values[0]!r}")
        return self

    def matches(self, value: str | None) -> bool:
        """Whether a label (or field) with this value (None: absent) meets the requirement."""
        op = self.operator
        if op == "In":
            return value is not None and value in self.values
        if op == "NotIn":
            return value is None or value not in self.values
        if op == "Exists":
            return value is not None
        if op == "DoesNotExist":
            return value is None
        if value is None:
            return False
        have, want = _go_int64(value), _go_int64(self.values[0])
        if have is None or want is None:
            return False  # a label that is not an integer meets neither Gt nor Lt
        return have > want if op == "Gt" else have < want


_GO_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)


def _go_int64(text: str) -> int | None:
    """`text` as Go's strconv.ParseInt(text, 10, 64) reads it (what the scheduler's Gt/Lt use):
    an optional sign and ASCII digits, within int64; None otherwise (Python's int() would also
    take `1_000`, spaces and other scripts' digits)."""
    if not _GO_INT.fullmatch(text):
        return None
    n = int(text)
    return n if -(1 << 63) <= n < (1 << 63) else None


class NodeSelectorTerm(_Model):
    """Requirements that must all hold; `match_fields` name node fields (only `metadata.name`,
    as in Kubernetes). A term without requirements matches no node."""

    match_expressions: tuple[NodeSelectorRequirement, ...] = ()
    match_fields: tuple[NodeSelectorRequirement, ...] = ()

    @model_validator(mode="after")
    def _fields_known(self) -> NodeSelectorTerm:
        for r in self.match_fields:
            if r.key != "metadata.name" or r.operator not in ("In", "NotIn"):
                raise ValueError(f"matchFields: only metadata.name with In or NotIn is supported "
                                 f"(got {r.key} {r.operator})")
        return self

    def matches(self, labels: Mapping[str, str], name: str) -> bool:
        if not self.match_expressions and not self.match_fields:
            return False
        return (all(r.matches(labels.get(r.key)) for r in self.match_expressions)
                and all(r.matches(name) for r in self.match_fields))


def tolerates(toleration: Toleration, taint: Taint) -> bool:
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    return toleration.operator == "Exists" or toleration.value == taint.value


def untolerated_taint(taints: Sequence[Taint], unschedulable: bool,
                      tolerations: Sequence[Toleration]) -> Taint | None:
    """The first taint (a cordon first) that keeps the pod off the node, or None."""
    if unschedulable:
        cordon = Taint(key=UNSCHEDULABLE_KEY, effect="NoSchedule")
        if not any(tolerates(t, cordon) for t in tolerations):
            return cordon
    for taint in taints:
        if taint.effect in _FILTERING and not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def affinity_admits(terms: Sequence[NodeSelectorTerm], labels: Mapping[str, str], name: str) -> bool:
    """Required node affinity: any of the terms (none: no constraint)."""
    return not terms or any(term.matches(labels, name) for term in terms)
