"""The pods bound to this node, from the API server: what closes the bound-but-not-admitted race.

The scheduler binds a pod to the node (spec.nodeName) before the kubelet admits it; until then the
pod holds no device in PodResources, so a slice that looks free may be the one it is about to get.
Before destroying a slice the agent keeps, for each resource R, as many free advertised R devices
as the pods bound here and not yet admitted for R need (HAMi's device plugin reads the node's pods
the same way). Pure parts: `requests_of` (what a pod spec asks for), `waiting_for` (what the
unadmitted pods need), `to_keep` (which destroy candidates stay).

- `NodePods`: `bound()`, the node's non-terminal pods with the GPU resources they request;
- `KubeNodePods`: a list with `fieldSelector=spec.nodeName=<node>` (needs RBAC `list pods`);
- `FakeNodePods`: set by the test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes_asyncio import client

from dynpart.agent.podresources import AssignedDevice
from dynpart.errors import DynpartError
from dynpart.kube.client import read_json
from dynpart.kube.errors import api_errors
from dynpart.quantity import parse_quantity
from dynpart.resources import is_slice_resource, pod_requests
from dynpart.settings import KubeSettings

TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class BoundPod:
    key: str  # namespace/name
    requests: dict[str, int]  # GPU resource name -> devices the pod needs at admission
    phase: str = "Pending"
    # resources a plain init container asks for: PodResources lists no plain init container's
    # devices, so what it uses cannot be seen while it runs
    init_only: frozenset[str] = frozenset()
    # the kubelet admitted it (`status.startTime`: set when the kubelet acknowledges the pod, before
    # it pulls the images; a rejected pod goes Failed): a Pending pod that pulls its images holds its
    # devices in the kubelet's checkpoint, which a restarted kubelet lists only once it admitted it
    # again
    admitted: bool = False


class NodePods(Protocol):
    async def bound(self) -> list[BoundPod]:
        """The pods bound to this node that are not finished, with the GPU resources they request."""
        ...


def _quantity(value: Any, where: str) -> int:
    """An extended resource's quantity as devices: a whole number in any form the API server
    admits and may write back ("2", "1k", "1e3", "2000m")."""
    try:
        number = parse_quantity(value)
        if number.is_integer():
            return int(number)
    except DynpartError:
        pass
    # extended resources are whole numbers (the API server refuses others): this is not one
    raise ValueError(f"{where}: {value!r} is not a whole number of devices")


def _container_requests(c: Mapping[str, Any], where: str) -> dict[str, int]:
    res = c.get("resources") or {}
    # an extended resource's request equals its limit; a pod may give either
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    return {r: _quantity(v, f"{where} {r}") for r, v in merged.items() if is_slice_resource(r)}


def requests_of(pod: Mapping[str, Any]) -> dict[str, int]:
    """The GPU devices a pod needs at admission, as the kubelet counts them (`pod_requests`:
    containers and sidecars summed, or, if more, a plain init container beside the sidecars
    started before it)."""
    meta = pod.get("metadata") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    out = pod_requests(pod.get("spec") or {}, lambda c: _container_requests(c, where))
    return {r: int(n) for r, n in out.items() if n > 0}


def init_only(pod: Mapping[str, Any]) -> frozenset[str]:
    """The GPU resources a plain init container asks for: the kubelet's PodResources List never
    shows its devices, so while it may run (the pod is Pending) which device it holds is unknown."""
    meta = pod.get("metadata") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    spec = pod.get("spec") or {}
    return frozenset(r for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"
                     for r, n in _container_requests(c, where).items() if n > 0)


@dataclass(frozen=True)
class Need:
    count: int
    pods: tuple[str, ...]
    # a pod not yet running whose plain init container may hold a device no PodResources List
    # shows: which one is unknown, so every device of the resource stays
    unseen: tuple[str, ...] = ()
    # admitted pods whose plain init container got more devices of the resource than their app
    # containers reuse: the rest stay allocated to the pod, unlisted, until it ends (kubelet
    # devicemanager: UpdateAllocatedDevices frees a pod's devices once it is no longer active),
    # and a kubelet restart re-admits the pod only if they still exist ("previously allocated
    # devices are no longer healthy"): which ones is unknown, so every device of the resource stays
    init_held: tuple[str, ...] = ()
    # pods the API server says run here with fewer devices listed by PodResources than they asked:
    # a kubelet that restarted lists a pod only once its first pod list admitted it again, and
    # until then every device looks free; which are theirs is unknown, so every device stays
    unlisted: tuple[str, ...] = ()


def waiting_for(bound: Iterable[BoundPod], assigned: Iterable[AssignedDevice]) -> dict[str, Need]:
    """Resource -> devices that pods bound here need and the kubelet has not given them yet (a pod
    holding no device of that resource in PodResources has not been admitted for it)."""
    listed: dict[tuple[str, str], set[str]] = {}
    for a in assigned:
        listed.setdefault((a.pod, a.resource), set()).add(a.device_id)
    count: dict[str, int] = {}
    pods: dict[str, list[str]] = {}
    unseen: dict[str, list[str]] = {}
    init_held: dict[str, list[str]] = {}
    unlisted: dict[str, list[str]] = {}
    for p in bound:
        if p.phase in TERMINAL_PHASES:
            continue
        for resource, n in sorted(p.requests.items()):
            if p.phase == "Pending" and resource in p.init_only:
                unseen.setdefault(resource, []).append(p.key)
                count.setdefault(resource, 0)
            held = len(listed.get((p.key, resource), ()))
            if held or p.phase == "Running" or p.admitted:  # admitted: the kubelet gave it all n devices then
                if n > held:
                    # more than its app containers list: an init container's devices kept for it,
                    # or a kubelet that has not admitted it again since it restarted
                    (init_held if resource in p.init_only else unlisted).setdefault(resource, []).append(p.key)
                    count.setdefault(resource, 0)
                continue
            count[resource] = count.get(resource, 0) + n
            pods.setdefault(resource, []).append(p.key)
    return {r: Need(count[r], tuple(pods.get(r, ())), tuple(unseen.get(r, ())), tuple(init_held.get(r, ())),
                    tuple(unlisted.get(r, ()))) for r in sorted(count)}


def _unknown_holders(need: Need, resource: str) -> str | None:
    """Why every device of the resource stays, if some pod may hold one no list shows."""
    if need.unseen:
        return (f"kept while pod(s) {', '.join(need.unseen)} start: an init container may use a {resource} device, "
                "and the kubelet does not list init containers' devices")
    if need.unlisted:
        return (f"kept while pod(s) {', '.join(need.unlisted)} run with fewer {resource} devices than they asked for "
                "listed by the kubelet (a restarted kubelet lists a pod once it has admitted it again): which devices "
                "are theirs is unknown")
    if need.init_held:
        return (f"kept while pod(s) {', '.join(need.init_held)} run: an init container of theirs got a {resource} "
                "device the kubelet keeps for them, unlisted, until they end (and a kubelet restart admits them again "
                "only if it still exists)")
    return None


def to_keep(candidates: Mapping[str, str], free: Mapping[str, Iterable[str]], needs: Mapping[str, Need]) -> dict[str, str]:
    """Which of the `candidates` (device id -> resource, free devices the agent wants gone, in the
    order it would remove them) must stay: for each resource, the pods waiting for it must still
    find that many free advertised devices (`free`: resource -> free advertised ids, candidates
    included). Returns device id -> why it is kept."""
    kept: dict[str, str] = {}
    for resource, need in needs.items():
        mine = [i for i, r in candidates.items() if r == resource]
        if not mine:
            continue
        # pods whose devices cannot be told apart from free ones: every device of the resource stays
        unknown = _unknown_holders(need, resource)
        if unknown:
            kept.update(dict.fromkeys(mine, unknown))
            continue
        others = len(set(free.get(resource, ())) - set(mine))
        n = max(0, min(len(mine), need.count - others))
        pods = ", ".join(need.pods)
        for device in mine[len(mine) - n:]:  # the last ones: the earlier destroys go ahead
            kept[device] = (f"kept for pod(s) {pods} bound to this node and not yet admitted (they need "
                            f"{need.count} {resource}, {others} other free)")
    return kept


class FakeNodePods:
    """Bound pods set by the test; `calls` counts the reads."""

    def __init__(self) -> None:
        self.pods: dict[str, BoundPod] = {}
        self.calls = 0

    def bind(self, key: str, requests: dict[str, int], phase: str = "Pending", init_only: frozenset[str] = frozenset(),
             admitted: bool = False) -> None:
        self.pods[key] = BoundPod(key, dict(requests), phase, init_only, admitted)

    def remove(self, key: str) -> None:
        self.pods.pop(key, None)

    async def bound(self) -> list[BoundPod]:
        self.calls += 1
        return [p for p in self.pods.values() if p.phase not in TERMINAL_PHASES]


@dataclass
class KubeNodePods:
    """The node's pods from the API server: one list per call with `fieldSelector=spec.nodeName=<node>`
    and the terminal phases left out (RBAC: list pods; the client's request timeout applies)."""

    api: client.ApiClient
    node: str
    settings: KubeSettings = field(default_factory=KubeSettings)

    async def bound(self) -> list[BoundPod]:
        v1 = client.CoreV1Api(self.api)
        selector = f"spec.nodeName={self.node}," + ",".join(f"status.phase!={p}" for p in TERMINAL_PHASES)
        with api_errors(f"list pods on node {self.node}"):
            resp = await v1.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False,
                                                        _request_timeout=self.settings.request_timeout_s)
            body = await read_json(resp, f"pods on node {self.node}")
        out = []
        for pod in body.get("items") or []:
            meta = pod.get("metadata") or {}
            status = pod.get("status") or {}
            phase = status.get("phase") or "Pending"
            try:
                requests = requests_of(pod)
                init = init_only(pod)
            except ValueError:
                continue  # the API server validates quantities; a pod it let through is not ours to judge
            if requests and phase not in TERMINAL_PHASES:
                out.append(BoundPod(f"{meta.get('namespace')}/{meta.get('name')}", requests, phase, init,
                                    bool(status.get("startTime"))))
        return out
