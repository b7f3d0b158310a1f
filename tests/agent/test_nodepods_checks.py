"""Bound pods against what a real kubelet does with them: a plain init container's devices (given
at admission with the app containers', reused by them, never listed by PodResources), pods as the
API server lists them (empty fields left out), and requests of zero devices."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from dynpart.agent import nodepods
from dynpart.agent.guard import SliceGuard
from dynpart.agent.nodepods import BoundPod, FakeNodePods, KubeNodePods, Need, init_only, requests_of, to_keep, waiting_for
from dynpart.agent.podresources import AssignedDevice, FakePodResources

M = "nvidia.com/mig-1g.10gb"


# --- a plain init container's devices ----------------------------------------------------------


async def test_an_admitted_pods_init_container_device_is_kept_while_it_starts():
    """The kubelet allocates every container at admission: the init container (2 devices) gets
    MIG-1 and one more, the app container (1) reuses MIG-1 (devicemanager: reusable devices
    first). PodResources lists MIG-1 (the app container's) only; the init container runs on MIG-1
    and on MIG-2 or MIG-3, which one is unknown. The pod holds M, so it waits for no device, yet no
    free-looking M device may go while it starts."""
    bound = [BoundPod("ns/p", {M: 2}, "Pending", frozenset({M}))]
    assigned = [AssignedDevice("ns/p", "main", M, "MIG-1")]
    needs = waiting_for(bound, assigned)
    assert needs == {M: Need(0, (), ("ns/p",), ("ns/p",))}
    kept = to_keep({"MIG-2": M, "MIG-3": M}, {M: ["MIG-2", "MIG-3"]}, needs)
    assert list(kept) == ["MIG-2", "MIG-3"] and all("init container" in why for why in kept.values())
    # the same through the guard, as the agent asks it before a destroy
    pods, node_pods = FakePodResources(), FakeNodePods()
    pods.assign("ns/p", M, "MIG-1")
    node_pods.bind("ns/p", {M: 2}, init_only=frozenset({M}))
    assert list(await SliceGuard(pods, node_pods).keep({"MIG-2": M}, {M: ["MIG-2", "MIG-3"]})) == ["MIG-2"]
    # once it runs, the init container is done, but its other device stays the pod's (unlisted)
    # until it ends, and a kubelet restart admits the pod again only if that device still exists
    node_pods.bind("ns/p", {M: 2}, phase="Running", init_only=frozenset({M}))
    kept = await SliceGuard(pods, node_pods).keep({"MIG-2": M}, {M: ["MIG-2", "MIG-3"]})
    assert list(kept) == ["MIG-2"] and "ns/p run" in kept["MIG-2"], kept
    # it ends: nothing is kept for it
    node_pods.remove("ns/p")
    assert await SliceGuard(pods, node_pods).keep({"MIG-2": M}, {M: ["MIG-2", "MIG-3"]}) == {}


def test_every_device_kept_for_a_starting_init_container_says_so():
    """A pod not yet admitted whose init container asks for M: every M candidate stays, and each
    says why (the init container), also the ones its count alone would keep."""
    needs = waiting_for([BoundPod("ns/p", {M: 1}, "Pending", frozenset({M}))], [])
    assert needs == {M: Need(1, ("ns/p",), ("ns/p",))}
    kept = to_keep({"MIG-1": M, "MIG-2": M}, {M: ["MIG-1", "MIG-2"]}, needs)
    assert list(kept) == ["MIG-1", "MIG-2"]
    assert all("init container" in why and "ns/p" in why for why in kept.values()), kept


# one pod: (its init container's M devices, its app container's, where it is)
POD_KINDS = [(i, a, where) for i in range(3) for a in range(3) for where in ("bound", "starting", "running")
             if max(i, a) > 0]


def kubelet_node(pods: tuple[tuple[int, int, str], ...], spare: int) -> dict[str, Any]:
    """The node as the kubelet makes it: an admitted pod's init container gets its devices, the
    app container reuses them first and takes more if it needs more (devicemanager); PodResources
    lists the app container's only."""
    devices = [f"MIG-{n}" for n in range(sum(max(i, a) for i, a, _ in pods) + spare)]
    unallocated = list(devices)
    bound, assigned = [], []
    allocated: set[str] = set()  # the kubelet's: every admitted container's devices, init ones included
    init_may_use: set[str] = set()  # devices a starting pod's init container may be running on
    init_kept: set[str] = set()  # an admitted pod's init container's devices its app containers did not reuse
    waiting = 0
    for n, (i, a, where) in enumerate(pods):
        key = f"ns/p{n}"
        bound.append(BoundPod(key, {M: max(i, a)}, "Running" if where == "running" else "Pending",
                              frozenset({M}) if i else frozenset()))
        if where == "bound":
            waiting += max(i, a)
            continue
        init = [unallocated.pop() for _ in range(i)]
        app = init[:a] + [unallocated.pop() for _ in range(a - min(a, i))]
        allocated |= set(init) | set(app)
        assigned += [AssignedDevice(key, "main", M, d) for d in app]
        if where == "starting":
            init_may_use |= set(init)
        init_kept |= set(init) - set(app)  # the pod's, unlisted, until it ends
    listed = {x.device_id for x in assigned}
    return {"devices": devices, "bound": bound, "assigned": assigned, "allocated": allocated,
            "init_may_use": init_may_use, "init_kept": init_kept, "waiting": waiting, "free": [d for d in devices if d not in listed]}


def test_what_a_kubelet_still_needs_is_never_destroyed():
    """Every node of up to two pods (each kind above) and one spare device, every set of
    free-looking devices the agent may want gone, in both orders: what `to_keep` lets go never
    holds a starting pod's init container nor what an admitted pod's init container got beyond
    its app containers (the kubelet keeps it for the pod), and every pod not yet admitted still
    finds its devices among those the kubelet has not given out. (Exhaustive: the space is small,
    the cases rare.)"""
    cases = 0
    for size in range(3):
        for pods in itertools.product(POD_KINDS, repeat=size):
            for spare in range(2):
                node = kubelet_node(pods, spare)
                needs = waiting_for(node["bound"], node["assigned"])
                free = node["free"]
                for mask in range(1 << len(free)):
                    chosen = [d for k, d in enumerate(free) if mask >> k & 1]
                    for candidates in (chosen, chosen[::-1]):
                        kept = to_keep({d: M for d in candidates}, {M: free}, needs)
                        destroyed = set(candidates) - set(kept)
                        where = f"pods {pods}, spare {spare}, candidates {candidates}: kept {kept}"
                        assert not destroyed & node["init_may_use"], f"a running init container's device went: {where}"
                        assert not destroyed & node["init_kept"], f"a device the kubelet keeps for a pod went: {where}"
                        assert len(set(node["devices"]) - node["allocated"] - destroyed) >= node["waiting"], \
                            f"a bound pod can no longer be admitted: {where}"
                        cases += 1
    assert cases > 10_000


def test_a_running_pods_leftover_init_devices_are_never_destroyed():
    """A pod whose init container asked for 2 devices and its app container for 1 keeps both
    allocated until it ends (kubelet devicemanager: UpdateAllocatedDevices frees only pods no
    longer active); PodResources lists only the app container's (MIG-1). MIG-2 looks free and is
    not: the kubelet gives it to no other pod (destroying MIG-3 would leave ns/w nothing), and
    after a kubelet restart it admits ns/r again only if MIG-2 still exists ("previously allocated
    devices are no longer healthy"). Which device the init container kept cannot be seen, so
    every M device stays while ns/r runs, whether a pod waits or not."""
    bound = [BoundPod("ns/r", {M: 2}, "Running", frozenset({M})), BoundPod("ns/w", {M: 1})]
    assigned = [AssignedDevice("ns/r", "main", M, "MIG-1")]
    kept = to_keep({"MIG-3": M}, {M: ["MIG-2", "MIG-3"]}, waiting_for(bound, assigned))
    assert list(kept) == ["MIG-3"]
    needs = waiting_for(bound[:1], assigned)
    assert needs == {M: Need(0, (), (), ("ns/r",))}
    assert list(to_keep({"MIG-2": M, "MIG-3": M}, {M: ["MIG-2", "MIG-3"]}, needs)) == ["MIG-2", "MIG-3"]
    # an app container that asks for as many as the init container reuses them all: nothing unlisted
    assert waiting_for([BoundPod("ns/r", {M: 1}, "Running", frozenset({M}))], assigned) == {}


# --- pods as the API server lists them ---------------------------------------------------------


def api_pod(name: str, containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None,
            phase: str = "Pending") -> dict[str, Any]:
    """A pod as the API server writes it: empty lists and maps left out (no `initContainers` when
    there are none, no `limits`/`requests` in a container that sets none)."""
    spec: dict[str, Any] = {"nodeName": "node-1", "containers": containers}
    if init is not None:
        spec["initContainers"] = init
    return {"metadata": {"namespace": "ns", "name": name}, "spec": spec, "status": {"phase": phase}}


def gpu(n: str, name: str = "main") -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {M: n}, "requests": {M: n}}}


class FakeResponse:
    status, reason = 200, "OK"

    def __init__(self, body: dict[str, Any]):
        self.body = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self.body


async def test_node_pods_as_the_api_server_lists_them(monkeypatch: pytest.MonkeyPatch):
    """Most pods have no init container and some containers set no resources: the API server
    then leaves those fields out, and every such pod must still be read (one that could not be
    read would fail the whole list, and with it every guarded destroy on the node). A request of
    zero devices is no request: such a pod waits for nothing, and a zero-device init container
    hides no device."""
    items = [
        api_pod("train", [gpu("1"), {"name": "log", "resources": {}}]),
        api_pod("setup", [gpu("1")], init=[gpu("2", "fetch")]),
        api_pod("web", [{"name": "web", "resources": {"requests": {"cpu": "1"}}}]),
        api_pod("zero", [gpu("0")]),
        api_pod("zero-init", [gpu("1")], init=[gpu("0", "fetch")]),
        # an object whose serializer dropped the empty struct altogether (the API server writes {})
        api_pod("bare", [{"name": "side"}, gpu("1")], phase="Running"),
    ]
    selectors: list[str] = []

    class Core:
        def __init__(self, api: Any):
            pass

        async def list_pod_for_all_namespaces(self, field_selector: str, **kw: Any) -> FakeResponse:
            selectors.append(field_selector)
            return FakeResponse({"items": items})

    monkeypatch.setattr(nodepods.client, "CoreV1Api", Core)
    assert await KubeNodePods(None, "node-1").bound() == [  # type: ignore[arg-type]
        BoundPod("ns/train", {M: 1}),
        BoundPod("ns/setup", {M: 2}, "Pending", frozenset({M})),
        BoundPod("ns/zero-init", {M: 1}),
        BoundPod("ns/bare", {M: 1}, "Running"),
    ]
    assert selectors == ["spec.nodeName=node-1,status.phase!=Succeeded,status.phase!=Failed"]


def test_a_zero_device_init_container_does_not_hold_back_the_node():
    """A chart that asks for `nvidia.com/...: 0` (a CPU-only variant) gets no device from the
    kubelet: a pod starting with such an init container must not keep every device of the
    resource (for as long as it stays Pending: an image that never pulls, for ever)."""
    starting = {"metadata": {"namespace": "ns", "name": "p"},
                "spec": {"initContainers": [gpu("0", "fetch")], "containers": [gpu("1")]}}
    assert requests_of(starting) == {M: 1} and init_only(starting) == frozenset()
    assert requests_of({"spec": {"containers": [gpu("0")]}}) == {}
    bound = [BoundPod("ns/p", requests_of(starting), "Pending", init_only(starting))]
    needs = waiting_for(bound, [AssignedDevice("ns/p", "main", M, "MIG-1")])  # admitted
    assert to_keep({"MIG-2": M}, {M: ["MIG-2"]}, needs) == {}


# --- running pods a restarted kubelet does not list yet -----------------------------------------


async def test_a_running_pod_whose_devices_the_kubelet_does_not_list_keeps_every_device():
    """After a kubelet restart, PodResources lists a pod only once the sync loop's first pod list
    admitted it again (v1.35: List serves the pod manager's active pods): until then a running
    pod's MIG instance looks free. Which device is its own is unknown, so every device of the
    resource stays; a pod waiting for admission is counted as before."""
    bound = [BoundPod("ns/run", {M: 1}, "Running"), BoundPod("ns/wait", {M: 1})]
    needs = waiting_for(bound, [])
    assert needs == {M: Need(1, ("ns/wait",), (), (), ("ns/run",))}
    kept = to_keep({"MIG-1": M, "MIG-2": M}, {M: ["MIG-1", "MIG-2", "MIG-3"]}, needs)
    assert list(kept) == ["MIG-1", "MIG-2"] and all("ns/run" in why and "restarted kubelet" in why
                                                    for why in kept.values())
    # some of its devices listed, not all (and no init container to explain it): the same
    assert waiting_for([BoundPod("ns/run", {M: 2}, "Running")], [AssignedDevice("ns/run", "c", M, "MIG-1")]) == \
        {M: Need(0, (), (), (), ("ns/run",))}
    # once listed again, nothing stays for it
    assert waiting_for([BoundPod("ns/run", {M: 1}, "Running")], [AssignedDevice("ns/run", "c", M, "MIG-1")]) == {}
    # an init container explains a shortfall: that case keeps its own reason
    assert waiting_for([BoundPod("ns/i", {M: 2}, "Running", frozenset({M}))], []) == {M: Need(0, (), (), ("ns/i",))}
    # through the guard, as a destroy asks it
    pods, node_pods = FakePodResources(), FakeNodePods()
    node_pods.bind("ns/run", {M: 1}, phase="Running")
    assert list(await SliceGuard(pods, node_pods).keep({"MIG-1": M}, {M: ["MIG-1", "MIG-2"]})) == ["MIG-1"]


async def test_mps_slices_are_held_while_a_running_pod_has_them_unlisted():
    """The MPS daemon is not restarted for another set of GPUs (which would end its clients' CUDA
    contexts) while the API server says a pod with an MPS slice runs here, listed or not."""
    S = "nvidia.com/gpu-10gb"
    pods, node_pods = FakePodResources(), FakeNodePods()
    guard = SliceGuard(pods, node_pods)
    assert not await guard.mps_held()
    node_pods.bind("ns/m", {S: 1}, phase="Running")
    assert await guard.mps_held()  # running, not listed (a kubelet that restarted)
    pods.assign("ns/m", S, "GPU-0::1")
    assert await guard.mps_held()
    node_pods.remove("ns/m")
    pods.release("ns/m")
    node_pods.bind("ns/g", {M: 1}, phase="Running")  # another resource's pod: not an MPS client
    assert not await guard.mps_held()
    assert not await SliceGuard(pods).mps_held()  # without the API server's pods: PodResources alone
