"""A pod's bound volumes narrow where it can run, as the kube-scheduler's VolumeBinding and
VolumeZone filters decide: before, a pod whose volume is a zonal cloud disk or a local disk had
its slice carved on nodes the scheduler refuses it, one node after another as each reservation
lapsed."""

from __future__ import annotations

from typing import Any

from dynpart.catalog import default_catalog
from dynpart.planner.cluster_view import build_snapshot, pod_for_planning
from dynpart.planner.core import plan
from dynpart.planner.volume_topology import (
    BIND_COMPLETED,
    ZONE_LABELS,
    VolumeTopology,
    claim_class,
    claim_for_planning,
    claim_names,
    class_for_planning,
    volume_for_planning,
    volume_terms,
)
from tests.controller.test_cluster_view import pod
from tests.controller.test_pod_conflicts import ZONE, nodes4

CAT = default_catalog()
MIG_1G = {"nvidia.com/mig-1g.10gb": "1"}


def claim(name: str, volume: str | None, phase: str = "Bound", storage_class: str | None = "x",
          **annotations: str) -> dict[str, Any]:
    """A claim as the API server serves it: one the PersistentVolume controller bound carries its
    bind-completed annotation (the scheduler's test of a bound claim)."""
    if phase in ("Bound", "Lost") and volume:
        annotations = {BIND_COMPLETED: "yes", **annotations}
    return claim_for_planning({"metadata": {"name": name, "namespace": "ml", "uid": "u", "annotations": annotations},
                               "spec": {"volumeName": volume, **({"storageClassName": storage_class}
                                                                  if storage_class is not None else {})},
                               "status": {"phase": phase}})


def storage_class(name: str, mode: str | None) -> dict[str, Any]:
    return class_for_planning({"metadata": {"name": name, "uid": "x", "annotations": {"a": "b"}}, "provisioner": "p",
                               "volumeBindingMode": mode})


def owned(c: dict[str, Any], by: dict[str, Any]) -> dict[str, Any]:
    """The claim as the ephemeral volume controller makes it: controlled by its pod."""
    return claim_for_planning({**c, "metadata": {**c["metadata"], "ownerReferences": [
        {"kind": "Pod", "name": by["metadata"]["name"], "uid": by["metadata"]["uid"], "controller": True}]}})


def with_uid(p: dict[str, Any]) -> dict[str, Any]:
    p["metadata"]["uid"] = f"uid-{p['metadata']['name']}"
    return p


def volume(name: str, labels: dict[str, str] | None = None, hosts: list[str] | None = None) -> dict[str, Any]:
    affinity = {"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}]}]}} if hosts else None
    return volume_for_planning({"metadata": {"name": name, "labels": {**(labels or {}), "other": "x"}},
                                "spec": {"capacity": {"storage": "1Ti"}, "nodeAffinity": affinity}})


def using(name: str, claim_name: str, **spec: Any) -> dict[str, Any]:
    return pod_for_planning(pod(name, MIG_1G, volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}},
                                                       {"name": "tmp", "emptyDir": {}}], **spec))


def topology(*objects: dict[str, Any], classes: list[dict[str, Any]] | None = None) -> VolumeTopology:
    claims = {f"ml/{o['metadata']['name']}": o for o in objects if "volumeName" in o["spec"]}
    volumes = {o["metadata"]["name"]: o for o in objects if "nodeAffinity" in o["spec"]}
    return VolumeTopology(claims, volumes, None if classes is None else {c["metadata"]["name"]: c for c in classes})


def placed_on(nodes, pods, volumes) -> set[str]:
    view = build_snapshot(nodes, pods, CAT, volumes=volumes)
    return {pl.node for pl in plan(view.snapshot, CAT).placements}


def test_a_zonal_volume_keeps_its_pod_in_the_zone():
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    vols = topology(claim("c", "pv-1"), volume("pv-1", {ZONE: "z2"}))
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=vols)
    assert view.hosts["ml/a"] == {"n3", "n4"}
    assert placed_on(nodes, [using("a", "c")], vols) <= {"n3", "n4"}
    several = topology(claim("c", "pv-1"), volume("pv-1", {ZONE: "z1__z2"}))
    assert build_snapshot(nodes, [using("a", "c")], CAT, volumes=several).hosts["ml/a"] == {"n1", "n2", "n3", "n4"}


def test_a_local_volume_keeps_its_pod_on_its_node_and_joins_the_pods_own_terms():
    nodes = nodes4()
    for n in nodes:
        n["metadata"]["labels"]["kubernetes.io/hostname"] = n["metadata"]["name"]
    vols = topology(claim("c", "local-3"), volume("local-3", hosts=["n3"]))
    assert placed_on(nodes, [using("a", "c")], vols) == {"n3"}
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1", "n3"]}]},
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2"]}]}]}}}
    view = build_snapshot(nodes, [using("b", "c", affinity=own)], CAT, volumes=vols)
    assert view.hosts["ml/b"] == {"n3"}, "(n1 or n3) and n3, or n2 and n3"
    elsewhere = topology(claim("c", "local-9"), volume("local-9", hosts=["n9"]))
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=elsewhere)
    assert not view.snapshot.pending and "bound volumes' node affinity" in view.elsewhere[0][1]


def test_claims_not_bound_or_volumes_without_affinity_narrow_nothing():
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    everywhere = {"n1", "n2", "n3", "n4"}
    for vols in (topology(claim("c", None, phase="Pending")), topology(claim("c", "pv-1"), volume("pv-1"))):
        assert build_snapshot(nodes, [using("a", "c")], CAT, volumes=vols).hosts["ml/a"] == everywhere


def test_a_pod_whose_claim_is_missing_or_being_deleted_is_not_planned():
    """The scheduler's VolumeBinding PreFilter refuses such a pod on every node (persistentvolumeclaim
    "c" not found; ... is being deleted): a slice carved for it would idle. It is told why; a pod
    whose ephemeral volume's claim its controller has not made yet waits a round, untold."""
    nodes = nodes4()
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology())
    assert not view.snapshot.pending
    [(obj, why)] = view.blocked
    assert obj["metadata"]["name"] == "a" and "PersistentVolumeClaim ml/c does not exist" in why
    deleting = claim("c", "pv-1")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert claim_for_planning(deleting)["metadata"]["deletionTimestamp"], "the claim cache keeps it"
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(deleting, volume("pv-1")))
    assert not view.snapshot.pending and "ml/c is being deleted" in view.blocked[0][1]
    scratch = pod_for_planning(with_uid(pod("b", MIG_1G, volumes=[{"name": "s", "ephemeral": {"volumeClaimTemplate": {}}}])))
    view = build_snapshot(nodes, [scratch], CAT, volumes=topology())
    assert not view.snapshot.pending and not view.blocked
    view = build_snapshot(nodes, [scratch], CAT, volumes=topology(owned(claim("b-s", "pv-1"), scratch), volume("pv-1")))
    assert [p.name for p in view.snapshot.pending] == ["ml/b"]
    # the caches not listed yet (volumes None): nothing is known, the pod is planned
    assert [p.name for p in build_snapshot(nodes, [using("a", "c")], CAT).snapshot.pending] == ["ml/a"]


def test_the_claims_of_a_pod_and_what_the_caches_keep():
    p = pod("a", MIG_1G, volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}},
                                  {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                                  {"name": "cfg", "configMap": {"name": "x"}}])
    assert claim_names(p) == ["ml/c", "ml/a-scratch"]
    assert claim_names(pod_for_planning(p)) == ["ml/c", "ml/a-scratch"], "the pod cache keeps what it needs"
    v = volume("pv", {ZONE: "z1"}, hosts=["n1"])
    assert v["metadata"]["labels"] == {ZONE: "z1"}
    terms = volume_terms(v)
    assert [[(r.key, r.operator, r.values) for r in t.match_expressions] for t in terms] == [
        [("kubernetes.io/hostname", "In", ("n1",)), (ZONE, "In", ("z1",))],
        [("kubernetes.io/hostname", "In", ("n1",)), *((k, "DoesNotExist", ()) for k in ZONE_LABELS)]]
    assert volume_terms(volume("pv")) is None


def test_volume_zone_as_the_scheduler_reads_it_unlabelled_nodes_and_beta_labels():
    """VolumeZone passes a node with none of the zone and region labels (on-premises GPU nodes,
    a volume restored from a cloud), and reads a beta label of the volume under the GA key on a
    node that lacks the beta one."""
    beta = "failure-domain.beta.kubernetes.io/zone"
    nodes = nodes4(n1="z1", n2="z2", n3="-", n4="-")
    for n in nodes[2:]:
        n["metadata"]["labels"].pop(ZONE)
    nodes[3]["metadata"]["labels"]["topology.kubernetes.io/region"] = "r1"  # a label of the four: it must match
    vols = topology(claim("c", "pv-1"), volume("pv-1", {beta: "z2"}))
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=vols)
    assert view.hosts["ml/a"] == {"n2", "n3"}, "n2 by its GA zone, n3 carrying none of the labels"


def test_a_lost_claim_or_an_ephemeral_claim_of_another_pod_is_not_planned():
    """VolumeBinding's PreFilter also refuses a pod whose claim is Lost (bound to a volume that no
    longer exists) and one whose ephemeral volume's claim another pod controls (VolumeIsForPod: "PVC
    was not created for pod", a StatefulSet pod made again under its name before the garbage
    collector removed its predecessor's claim). Planned, a slice was carved that the pod never took."""
    nodes = nodes4()
    lost = claim("c", "pv-gone", phase="Lost")
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(lost))
    assert not view.snapshot.pending and "ml/c is Lost" in view.blocked[0][1]
    scratch = pod_for_planning(with_uid(pod("b", MIG_1G, volumes=[{"name": "s", "ephemeral": {"volumeClaimTemplate": {}}}])))
    predecessor = {"metadata": {"name": "b", "uid": "an-older-pod"}}
    kept = claim_for_planning(owned(claim("b-s", "pv-1"), predecessor))
    assert kept["metadata"]["ownerReferences"] == [{"uid": "an-older-pod", "controller": True}], "the cache keeps it"
    view = build_snapshot(nodes, [scratch], CAT, volumes=topology(kept, volume("pv-1")))
    assert not view.snapshot.pending and "was not made for it" in view.blocked[0][1]
    going = claim_for_planning({**kept, "metadata": {**kept["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}})
    view = build_snapshot(nodes, [scratch], CAT, volumes=topology(going, volume("pv-1")))
    assert not view.snapshot.pending and not view.blocked, "the garbage collector is removing it: a round's wait"
    view = build_snapshot(nodes, [scratch], CAT, volumes=topology(owned(claim("b-s", "pv-1"), scratch), volume("pv-1")))
    assert [p.name for p in view.snapshot.pending] == ["ml/b"]


def test_a_pod_whose_claim_is_bound_to_a_volume_not_listed_is_not_planned_nor_reported():
    """The scheduler's checkBoundClaims makes every node unavailable to a pod whose bound claim's
    PersistentVolume it has not seen ("pvc(s) bound to non-existent pv(s)"): a volume just made
    whose claim's binding the claim watch gave first, or one gone, whose claim the PersistentVolume
    controller turns Lost (reported then). A round's wait, without an Event; a bound claim whose
    volume is listed is planned."""
    nodes = nodes4()
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(claim("c", "pv-new")))
    assert not view.snapshot.pending and not view.blocked
    assert view.awaiting_claims == {"ml/c": ["ml/a"]}
    lost = claim("c", "pv-gone", phase="Lost")
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(lost))
    assert "ml/c is Lost" in view.blocked[0][1]
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(claim("c", "pv-1"), volume("pv-1")))
    assert [p.name for p in view.snapshot.pending] == ["ml/a"]


IMMEDIATE, DELAYED = "Immediate", "WaitForFirstConsumer"
CLASSES = [storage_class("fast", IMMEDIATE), storage_class("local", DELAYED)]


def test_a_pod_whose_claim_is_not_bound_and_binds_immediately_is_not_planned():
    """The scheduler's VolumeBinding PreFilter refuses, on every node, a pod with a claim not bound
    yet that the PersistentVolume controller binds, not the scheduler ("pod has unbound immediate
    PersistentVolumeClaims", UnschedulableAndUnresolvable): its StorageClass binds Immediate, or
    does not exist, or it names none (volume.IsDelayBindingMode), or it names its volume but the
    binding is not complete (a claim bound by hand before the controller's turn). Planned, a
    slice was carved that the pod never took."""
    nodes = nodes4()

    def blocked(*claims: dict[str, Any], classes: list[dict[str, Any]] | None = CLASSES, pod: str = "c") -> str | None:
        view = build_snapshot(nodes, [using("a", pod)], CAT, volumes=topology(*claims, classes=classes))
        if view.snapshot.pending:
            return None
        [(obj, why)] = view.blocked
        assert obj["metadata"]["name"] == "a" and view.awaiting_claims == {"ml/c": ["ml/a"]}
        return why

    why = blocked(claim("c", None, "Pending", "fast"))
    assert why is not None and "StorageClass fast binds immediately" in why and "unbound immediate" in why
    assert blocked(claim("c", None, "Pending", "local")) is None, "WaitForFirstConsumer: the scheduler binds it"
    assert "StorageClass gone does not exist" in (blocked(claim("c", None, "Pending", "gone")) or "")
    # no class: immediate whatever classes exist (a default class is written into the claim when it
    # is made, or later by the PersistentVolume controller: a change the claims' watch sees)
    for none in (None, ""):
        assert "names no StorageClass" in (blocked(claim("c", None, "Pending", none), classes=None) or "")
    # the beta annotation is read first
    assert blocked(claim("c", None, "Pending", "fast", **{"volume.beta.kubernetes.io/storage-class": "local"})) is None
    assert claim_class(claim("c", None, "Pending", "", **{"volume.beta.kubernetes.io/storage-class": "fast"})) == "fast"
    # bound by hand (spec.volumeName) but not by the controller yet: immediate, whatever its class
    why = blocked(claim("c", "pv-1", "Pending", "local"))
    assert why is not None and "names PersistentVolume pv-1 but is not bound to it yet" in why
    assert blocked(claim("c", "pv-1", "Pending", "local", **{BIND_COMPLETED: "yes"}), volume("pv-1")) is None
    # the classes not listed (the planner's RBAC leaves them out): a named class is not known,
    # the pod is planned as before
    assert blocked(claim("c", None, "Pending", "fast"), classes=None) is None


def test_an_unbound_immediate_claim_is_told_only_once_every_claim_of_the_pod_exists():
    """The scheduler checks every claim exists (podHasPVCs) before it sorts them (GetPodVolumeClaims):
    of a pod with an unbound immediate claim and a missing one, the missing one is said."""
    p = pod_for_planning(pod("a", MIG_1G, volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}},
                                                   {"name": "e", "persistentVolumeClaim": {"claimName": "e"}}]))
    view = build_snapshot(nodes4(), [p], CAT, volumes=topology(claim("c", None, "Pending", "fast"), classes=CLASSES))
    assert "ml/e does not exist" in view.blocked[0][1] and view.awaiting_claims == {"ml/e": ["ml/a"]}


def test_a_claim_the_controller_bound_narrows_its_pod_even_before_its_phase_says_bound():
    """The scheduler reads a claim as bound by its volume name and bind-completed annotation, which
    the PersistentVolume controller writes before it sets the phase."""
    nodes = nodes4(n1="z1", n2="z1", n3="z2", n4="z2")
    early = claim("c", "pv-1", "Pending", "fast", **{BIND_COMPLETED: "yes"})
    view = build_snapshot(nodes, [using("a", "c")], CAT, volumes=topology(early, volume("pv-1", {ZONE: "z2"}), classes=CLASSES))
    assert view.hosts["ml/a"] == {"n3", "n4"}


def test_what_the_claim_and_class_caches_keep():
    full = {"metadata": {"name": "c", "namespace": "ml", "uid": "u", "resourceVersion": "5",
                         "annotations": {BIND_COMPLETED: "yes", "volume.beta.kubernetes.io/storage-class": "b",
                                         "pv.kubernetes.io/bound-by-controller": "yes", "other": "x"},
                         "managedFields": [{}]},
            "spec": {"volumeName": "pv", "storageClassName": "fast", "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"phase": "Bound", "capacity": {"storage": "1Gi"}}}
    assert claim_for_planning(full) == {
        "metadata": {"name": "c", "namespace": "ml", "resourceVersion": "5",
                     "annotations": {BIND_COMPLETED: "yes", "volume.beta.kubernetes.io/storage-class": "b"}},
        "spec": {"volumeName": "pv", "storageClassName": "fast"}, "status": {"phase": "Bound"}}
    assert storage_class("fast", IMMEDIATE) == {"metadata": {"name": "fast"}, "volumeBindingMode": IMMEDIATE}
