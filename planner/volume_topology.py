"""Where a pod's volumes let it run, as the kube-scheduler's VolumeBinding and VolumeZone filters
decide for claims already bound: a PersistentVolume's `spec.nodeAffinity` (a local disk, a zonal
cloud disk) and its zone and region labels. Pure code over the claims and volumes as the planner's
caches keep them.

Without it a pod whose bound volume lives in one zone (or on one node) had its slice carved on
nodes the scheduler refuses it ("volume node affinity conflict"), one node after another as each
reservation lapsed. Now the volume's terms narrow the pod's required node affinity.

A pod whose claim does not exist or is being deleted is not planned: the scheduler binds it on no
node (its `Unplaceable` Event says which claim); one whose ephemeral volume's claim is not made yet
waits a round without an Event. Nor is one whose claim is not bound yet and binds immediately
(VolumeBinding's PreFilter: "pod has unbound immediate PersistentVolumeClaims"): a claim that names
a volume the binding of which is not complete, one that names no StorageClass, one whose class does
not exist or has `volumeBindingMode: Immediate`; the PersistentVolume controller binds those, not
the scheduler. Whether a named class binds immediately is known only while the planner's optional
StorageClass watch is listed (without it such a claim is planned as before).

Not mirrored (the pod then falls to the loop's back-off, `planner/loop.py`): claims not bound yet
whose class is `WaitForFirstConsumer` (the scheduler picks or provisions a volume per node;
StorageClass `allowedTopologies`, CSI storage capacity), and volume limits per node
(NodeVolumeLimits)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynpart.planner.pod_conflicts import as_dict, as_list
from dynpart.scheduling import NodeSelectorRequirement, NodeSelectorTerm
from dynpart.snapshot import PendingPod

# The labels a PersistentVolume's zone and region are written in (VolumeZone); a value may name
# several, separated by "__"
ZONE_LABELS = ("topology.kubernetes.io/zone", "topology.kubernetes.io/region",
               "failure-domain.beta.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/region")
GA_LABEL = {"failure-domain.beta.kubernetes.io/zone": "topology.kubernetes.io/zone",
            "failure-domain.beta.kubernetes.io/region": "topology.kubernetes.io/region"}
MAX_TERMS = 64  # a pod whose terms would multiply beyond this is left to the back-off
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"  # the PersistentVolume controller bound the claim
BETA_CLASS = "volume.beta.kubernetes.io/storage-class"  # read before spec.storageClassName
DELAYED = "WaitForFirstConsumer"  # a StorageClass's volumeBindingMode that leaves binding to the scheduler


def _claims(pod: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """The claims (namespace/name) of the pod's volumes, each with whether it is an `ephemeral`
    volume's (named `<pod>-<volume>`, made by the ephemeral volume controller) or a
    `persistentVolumeClaim`'s."""
    md, spec = as_dict(pod.get("metadata")), as_dict(pod.get("spec"))
    out = []
    for v in map(as_dict, as_list(spec.get("volumes"))):
        claim = as_dict(v.get("persistentVolumeClaim")).get("claimName")
        if isinstance(claim, str) and claim:
            out.append((f"{md.get('namespace')}/{claim}", False))
        elif "ephemeral" in v:
            out.append((f"{md.get('namespace')}/{md.get('name')}-{v.get('name')}", True))
    return out


def _controlled_by(claim_md: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """The claim's controlling owner is the pod (metav1.IsControlledBy: by uid)."""
    uid = as_dict(pod.get("metadata")).get("uid")
    return uid is not None and any(r.get("controller") and str(r.get("uid")) == str(uid)
                                   for r in map(as_dict, as_list(claim_md.get("ownerReferences"))))


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The claims (namespace/name) of the pod's volumes: `persistentVolumeClaim`, and the one an
    `ephemeral` volume gets (`<pod>-<volume>`)."""
    return [key for key, _ in _claims(pod)]


def volumes_for_planning(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The part of a pod's volumes the planner reads (`claim_names`), as its cache keeps it."""
    out = []
    for v in map(as_dict, as_list(as_dict(pod.get("spec")).get("volumes"))):
        if "persistentVolumeClaim" in v:
            out.append({"name": v.get("name"), "persistentVolumeClaim": v["persistentVolumeClaim"]})
        elif "ephemeral" in v:
            out.append({"name": v.get("name"), "ephemeral": {}})
    return out


def claim_for_planning(claim: Mapping[str, Any]) -> dict[str, Any]:
    md, spec = as_dict(claim.get("metadata")), as_dict(claim.get("spec"))
    # the controller's uid: an ephemeral volume's claim serves only the pod that controls it
    owner = next((str(r.get("uid")) for r in map(as_dict, as_list(md.get("ownerReferences"))) if r.get("controller")), None)
    annotations = {k: v for k, v in as_dict(md.get("annotations")).items() if k in (BIND_COMPLETED, BETA_CLASS)}
    return {"metadata": {**{k: md[k] for k in ("name", "namespace", "resourceVersion", "deletionTimestamp") if k in md},
                         **({"annotations": annotations} if annotations else {}),
                         **({"ownerReferences": [{"uid": owner, "controller": True}]} if owner else {})},
            "spec": {"volumeName": spec.get("volumeName"),
                     **({"storageClassName": spec["storageClassName"]} if "storageClassName" in spec else {})},
            "status": {"phase": as_dict(claim.get("status")).get("phase")}}


def class_for_planning(storage_class: Mapping[str, Any]) -> dict[str, Any]:
    """What the StorageClass watch keeps: the name and how the class binds its claims."""
    md = as_dict(storage_class.get("metadata"))
    return {"metadata": {k: md[k] for k in ("name", "resourceVersion") if k in md},
            "volumeBindingMode": storage_class.get("volumeBindingMode")}


def claim_class(claim: Mapping[str, Any]) -> str:
    """The StorageClass a claim names ("": none), as the scheduler reads it (the beta annotation
    first, then spec.storageClassName: GetPersistentVolumeClaimClass)."""
    annotations = as_dict(as_dict(claim.get("metadata")).get("annotations"))
    if BETA_CLASS in annotations:
        return str(annotations[BETA_CLASS])
    return str(as_dict(claim.get("spec")).get("storageClassName") or "")


def fully_bound(claim: Mapping[str, Any]) -> bool:
    """The claim is bound as the scheduler reads it (isPVCFullyBound): it names its volume and
    the PersistentVolume controller completed the binding (its `bind-completed` annotation)."""
    return bool(as_dict(claim.get("spec")).get("volumeName")) and \
        BIND_COMPLETED in as_dict(as_dict(claim.get("metadata")).get("annotations"))


def volume_for_planning(volume: Mapping[str, Any]) -> dict[str, Any]:
    md = as_dict(volume.get("metadata"))
    labels = {k: v for k, v in as_dict(md.get("labels")).items() if k in ZONE_LABELS}
    return {"metadata": {**{k: md[k] for k in ("name", "resourceVersion") if k in md}, "labels": labels},
            "spec": {"nodeAffinity": as_dict(volume.get("spec")).get("nodeAffinity")}}


def _requirement(raw: Mapping[str, Any]) -> NodeSelectorRequirement:
    return NodeSelectorRequirement.model_validate({"key": str(raw.get("key")), "operator": raw.get("operator"),
                                                   "values": tuple(str(v) for v in as_list(raw.get("values")))})


def volume_terms(volume: Mapping[str, Any]) -> list[NodeSelectorTerm] | None:
    """The nodes a volume can be used from, as terms of which one must hold; None: any node."""
    terms: list[NodeSelectorTerm] | None = None
    required = as_dict(as_dict(as_dict(volume.get("spec")).get("nodeAffinity")).get("required"))
    if "nodeSelectorTerms" in required:
        terms = [NodeSelectorTerm(match_expressions=tuple(_requirement(r) for r in map(as_dict, as_list(t.get("matchExpressions")))),
                                  match_fields=tuple(_requirement(r) for r in map(as_dict, as_list(t.get("matchFields")))))
                 for t in map(as_dict, as_list(required.get("nodeSelectorTerms")))]
    labels = sorted((k, tuple(str(v).split("__"))) for k, v in as_dict(as_dict(volume.get("metadata")).get("labels")).items()
                    if k in ZONE_LABELS)
    if labels:
        # VolumeZone: a node with none of the zone and region labels passes; any other must carry
        # each of the volume's values, under its key, or under the GA key when it lacks a beta one
        ways: list[tuple[NodeSelectorRequirement, ...]] = [()]
        for key, values in labels:
            these: list[tuple[NodeSelectorRequirement, ...]] = [
                (NodeSelectorRequirement(key=key, operator="In", values=values),)]
            if key in GA_LABEL:
                these.append((NodeSelectorRequirement(key=key, operator="DoesNotExist"),
                               NodeSelectorRequirement(key=GA_LABEL[key], operator="In", values=values)))
            ways = [(*w, *t) for w in ways for t in these]
        ways.append(tuple(NodeSelectorRequirement(key=k, operator="DoesNotExist") for k in ZONE_LABELS))
        terms = [t.model_copy(update={"match_expressions": (*t.match_expressions, *w)})
                 for t in terms or [NodeSelectorTerm()] for w in ways]
    return terms


class VolumeTopology:
    """The claims and volumes the planner caches, to narrow pending pods (`narrow`), and the
    StorageClasses (name -> class; None: not known, the watch not listed) that say whether a
    claim not bound yet binds immediately (`missing`)."""

    def __init__(self, claims: Mapping[str, Mapping[str, Any]], volumes: Mapping[str, Mapping[str, Any]],
                 classes: Mapping[str, Mapping[str, Any]] | None = None):
        self.claims, self.volumes, self.classes = claims, volumes, classes

    def _unbound_immediate(self, key: str, claim: Mapping[str, Any]) -> str | None:
        """Why the claim, not bound yet, keeps its pod unscheduled (GetPodVolumeClaims puts it
        with the unbound immediate claims), or None: bound, or left to the scheduler to bind
        (WaitForFirstConsumer), or its class not known."""
        if fully_bound(claim):
            return None
        tail = ("the scheduler binds the pod nowhere until the PersistentVolume controller binds the claim (\"pod has "
                "unbound immediate PersistentVolumeClaims\")")
        volume = as_dict(claim.get("spec")).get("volumeName")
        if volume:
            return f"its PersistentVolumeClaim {key} names PersistentVolume {volume} but is not bound to it yet: {tail}"
        name = claim_class(claim)
        if not name:
            return f"its PersistentVolumeClaim {key} is not bound yet and names no StorageClass (so it binds immediately): {tail}"
        if self.classes is None:
            return None
        storage_class = self.classes.get(name)
        if storage_class is None:
            return (f"its PersistentVolumeClaim {key} is not bound yet and its StorageClass {name} does not exist "
                    f"(so it binds immediately): {tail}")
        if storage_class.get("volumeBindingMode") == DELAYED:
            return None
        return (f"its PersistentVolumeClaim {key} is not bound yet and its StorageClass {name} binds immediately "
                f"(volumeBindingMode {storage_class.get('volumeBindingMode')}, not {DELAYED}): {tail}")

    def missing(self, pod: Mapping[str, Any]) -> tuple[str | None, bool, str | None]:
        """Why the scheduler binds the pod on no node for its claims (VolumeBinding's PreFilter,
        UnschedulableAndUnresolvable): a `persistentVolumeClaim` that does not exist or is being
        deleted, and whether that lasts until someone acts (False: an ephemeral volume's claim
        that its controller has not made yet, a moment's wait), and the claim (namespace/name).
        (None, False, None) when none is. Once every claim passes those checks, one not bound
        yet that binds immediately (`_unbound_immediate`; lasting: it waits for the
        PersistentVolume controller, which may never find or make a volume), and one bound to a
        volume the volume watch has not seen (not lasting: a volume just made can reach the claim
        watch's binding first, and one that does not exist turns its claim Lost, the PersistentVolume
        controller's syncBoundClaim, which lasts)."""
        for key, ephemeral in _claims(pod):
            claim = self.claims.get(key)
            if claim is None:
                if ephemeral:
                    return f"its ephemeral volume's PersistentVolumeClaim {key} is not made yet", False, key
                return (f"its PersistentVolumeClaim {key} does not exist (the scheduler binds it nowhere until it "
                        "does)"), True, key
            md = as_dict(claim.get("metadata"))
            if as_dict(claim.get("status")).get("phase") == "Lost":
                return (f"its PersistentVolumeClaim {key} is Lost: its PersistentVolume {as_dict(claim.get('spec')).get('volumeName')} "
                        "does not exist (the scheduler binds it nowhere while it is)"), True, key
            if ephemeral and not _controlled_by(md, pod):
                # VolumeIsForPod: a claim of that name left by another pod (a StatefulSet pod made
                # again under its name): the garbage collector deletes it, then the ephemeral volume
                # controller makes the pod's own; one that nothing deletes lasts
                if md.get("deletionTimestamp"):
                    return f"its ephemeral volume's PersistentVolumeClaim {key} is another pod's, being deleted", False, key
                return (f"its ephemeral volume's PersistentVolumeClaim {key} was not made for it (another owner: the "
                        "scheduler binds it nowhere until that claim is deleted)"), True, key
            if md.get("deletionTimestamp"):
                return (f"its PersistentVolumeClaim {key} is being deleted (the scheduler binds it nowhere while it "
                        "is)"), True, key
        for key, _ in _claims(pod):
            claim = self.claims[key]
            why = self._unbound_immediate(key, claim)
            if why is not None:
                return why, True, key
            name = str(as_dict(claim.get("spec")).get("volumeName"))
            if fully_bound(claim) and name not in self.volumes:
                # checkBoundClaims: "node(s) unavailable due to one or more pvc(s) bound to
                # non-existent pv(s)", on every node, for the scheduler's cache as for this one
                return (f"its PersistentVolumeClaim {key} is bound to PersistentVolume {name}, which is not listed "
                        "yet (the scheduler binds it nowhere until it is; a volume that does not exist turns the "
                        "claim Lost)"), False, key
        return None, False, None

    def narrow(self, pending: PendingPod, pod: Mapping[str, Any]) -> PendingPod:
        """The pod with the terms of its bound claims' volumes joined to its node affinity: each
        of its terms and each of a volume's must hold together (their cross product)."""
        terms = list(pending.node_affinity)
        narrowed = False
        for key in claim_names(pod):
            claim = self.claims.get(key)
            if claim is None or not fully_bound(claim):
                continue  # not bound yet: the scheduler chooses per node (not mirrored)
            volume = self.volumes.get(str(as_dict(claim.get("spec")).get("volumeName")))
            if volume is None:
                continue
            allowed = volume_terms(volume)
            if allowed is None:
                continue
            joined = [NodeSelectorTerm(match_expressions=(*t.match_expressions, *v.match_expressions),
                                       match_fields=(*t.match_fields, *v.match_fields))
                      for t in (terms or [NodeSelectorTerm()]) for v in allowed]
            if len(joined) > MAX_TERMS:
                return pending
            terms, narrowed = joined, True
        return pending.model_copy(update={"node_affinity": terms}) if narrowed else pending
