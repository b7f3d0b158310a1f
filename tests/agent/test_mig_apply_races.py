"""Races and crashes in the MIG apply path (helper-112): what the kubelet or the driver does
between two steps of the agent, and what a restarted agent then does."""

from __future__ import annotations

import time
from typing import Any

from dynpart.agent import mig_agent
from dynpart.agent.deviceplugin import protocol
from dynpart.agent.nodepods import BoundPod, FakeNodePods
from dynpart.annotations import decode_status

from .conftest import H100, make_rig, mig_spec

WHOLE = "nvidia.com/gpu"
MIG_1G = "nvidia.com/mig-1g.10gb"


class Refusing:
    """A gRPC context: Allocate's abort is the plugin's refusal."""

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


async def test_a_whole_gpu_allocated_while_the_guard_lists_the_bound_pods_gets_no_mig_mode():
    """The guard's re-check reads the plugin's Allocate record, then lists the pods bound to the
    node (an API-server call: an await). A kubelet admission slower than the settle wait that
    lands during that list is still served (the device is withdrawn, not sealed yet), so the
    device must not be sealed and changed as if nobody took it: MIG mode must not be enabled
    under the pod that was just given the whole GPU."""
    rig = make_rig(count=1, mig_enabled=False).with_plugins()
    assert rig.plugins is not None
    node_pods = FakeNodePods()
    agent = rig.agent(withdraw_settle_s=0, node_pods=node_pods)
    await agent.reconcile_once()
    uuid = rig.driver.devices()[0].uuid
    assert [d.id for d in rig.plugins.advertised()[WHOLE]] == [uuid]
    plugins = rig.plugins
    bound = node_pods.bound

    async def listing() -> list[BoundPod]:
        if not served and uuid in plugins.withdrawn and uuid not in plugins.sealed:
            # the release's re-check: the kubelet's Allocate (it chose the GPU before it read the
            # shorter list) lands while the API server answers
            msgs = protocol.messages()
            request = msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=[uuid])])
            response = await plugins.servers[WHOLE].Allocate(request, Refusing())
            assert dict(response.container_responses[0].envs)["NVIDIA_VISIBLE_DEVICES"] == uuid
            served.append(uuid)
            rig.pods.assign("ns/whole", WHOLE, uuid)  # the kubelet records the admission
        return await bound()

    served: list[str] = []
    node_pods.bound = listing  # type: ignore[method-assign]
    node_pods.bind("ns/other", {"nvidia.com/mig-1g.10gb": 1}, phase="Running")  # (the guard lists the pods)
    rig.pods.assign("ns/other", "nvidia.com/mig-1g.10gb", "MIG-elsewhere")
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert served == [uuid], "the test's Allocate did not land in the window"
    assert not rig.driver.devices()[0].mig_current, (
        "MIG mode enabled on a GPU the kubelet had just allocated to a pod", report.errors)


async def two_3g_the_first_held_once_its_ci_goes() -> tuple[Any, Any, int]:
    """An H100 with 3g.40gb@0 and @4 applied; from now on, destroying the first's GPU instance
    finds it held open by a client (its compute instance destroyed first, as the agent does)."""
    rig = make_rig(count=1)
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    assert (await agent.reconcile_once()).plan_id == "p1"
    gi = rig.driver.gi_at(0, 0)

    def hold_after_the_ci(op: Any) -> None:
        if op.op == "destroy_gi" and op.gi_id == gi:
            rig.driver.hold(0, "leaked-handle", gi_id=gi)

    rig.driver.before_op = hold_after_the_ci
    return rig, agent, gi


async def test_a_gpu_instance_held_open_after_its_compute_instance_went_is_not_reported_free(monkeypatch):
    """The driver destroys the compute instance, then refuses the GPU instance (IN_USE: a client
    holds it, which docs/agent.md says may happen for either). The GPU instance stays, without
    a compute instance; it still takes its memory slices. Reported nowhere, the planner sees those
    slices free and plans an instance over them, which the agent cannot create: the plan is never
    acknowledged and the next plan is the same. As for a complete instance held open, the status
    must not show those slices free (the planner must see them taken)."""
    rig, agent, gi = await two_3g_the_first_held_once_its_ci_goes()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert any("destroying 3g.40gb@0 failed" in e for e in report.errors), report.errors
    assert [g.start for g in rig.driver.gpu_instances(0)] == [0]  # the GI is still there, no CI
    report = await agent.reconcile_once()
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    taken = [m for g in status.layout.gpus for m in g.mig if m.start == 0]
    assert taken and taken[0].used, (
        "GPU instance at start 0 still exists but the status shows its slices free", report.errors)
    assert [g.start for g in rig.driver.gpu_instances(0)] == [0]  # not destroyed again while held
    # the client lets go; once HELD_OPEN_S has passed the instance goes and the plan is applied
    rig.driver.before_op = None
    rig.driver.release(0, "leaked-handle", gi_id=gi)
    later = time.monotonic() + mig_agent.HELD_OPEN_S + 1
    monkeypatch.setattr(mig_agent.time, "monotonic", lambda: later)
    await agent.reconcile_once()
    assert [(g.profile_id, g.start) for g in rig.driver.gpu_instances(0)] == [(0, 0)]  # 7g.80gb@0


async def test_a_pending_pod_the_kubelet_admitted_before_it_restarted_keeps_its_device(monkeypatch):
    """A pod the kubelet admitted (its devices are in the kubelet's checkpoint) still pulls its
    image: phase Pending, `status.startTime` set by the kubelet at admission. The kubelet restarts
    and its PodResources List is empty until its first pod list admits the pod again. The agent
    counts the pod as bound and not yet admitted, which only keeps *some* free device: it may
    destroy the very instance the checkpoint gives the pod (the kubelet re-admits it with that
    device, and the pod fails). As for a Running pod whose devices are not listed, every device
    of the resource must stay."""
    from dynpart.agent import nodepods
    from dynpart.agent.nodepods import KubeNodePods, to_keep, waiting_for

    from .test_nodepods_checks import FakeResponse, api_pod, gpu

    M = "nvidia.com/mig-1g.10gb"
    admitted = api_pod("pulling", [gpu("1")])
    admitted["status"]["startTime"] = "2025-03-01T09:00:00Z"  # acknowledged by the kubelet

    class Core:
        def __init__(self, api: Any):
            pass

        async def list_pod_for_all_namespaces(self, field_selector: str, **kw: Any) -> FakeResponse:
            return FakeResponse({"items": [admitted]})

    monkeypatch.setattr(nodepods.client, "CoreV1Api", Core)
    bound = await KubeNodePods(None, "node-1").bound()  # type: ignore[arg-type]
    needs = waiting_for(bound, [])  # the restarted kubelet lists nothing yet
    # MIG-X is the pod's (checkpoint); MIG-Y is free: the plan removes MIG-X
    kept = to_keep({"MIG-X": M}, {M: ["MIG-X", "MIG-Y"]}, needs)
    assert list(kept) == ["MIG-X"], needs


async def guard_over_a_healthy_and_an_unhealthy_device() -> tuple[Any, Any]:
    """A guard over the built-in plugin listing MIG-a healthy and MIG-b Unhealthy (resource
    nvidia.com/mig-1g.10gb), with one pod bound to the node for one such device."""
    from dynpart.agent.deviceplugin.devices import PluginDevice
    from dynpart.agent.guard import SliceGuard
    from dynpart.agent.podresources import FakePodResources

    from .conftest import unserved_plugins

    pods, node_pods = FakePodResources(), FakeNodePods()
    plugins = unserved_plugins(pods)
    await plugins.update({MIG_1G: [PluginDevice("MIG-a", "mig", "GPU-0", 0),
                                   PluginDevice("MIG-b", "mig", "GPU-1", 1, healthy=False)]})
    node_pods.bind("ns/late", {MIG_1G: 1})
    return SliceGuard(pods, node_pods, plugins, settle_s=0), plugins


async def test_an_unhealthy_device_is_no_free_device_for_a_bound_pod():
    """The kubelet gives a pod only a healthy device (`UnexpectedAdmissionError` when none is
    free). MIG-b is listed, but Unhealthy (its GPU needs a reset after an Xid): a pod bound here
    for one device can only get MIG-a, so MIG-a must be kept, not destroyed because MIG-b looks
    like another free device."""
    M = MIG_1G
    guard, plugins = await guard_over_a_healthy_and_an_unhealthy_device()
    assert list(await guard.keep({"MIG-a": M}, {M: ["MIG-a", "MIG-b"]})) == ["MIG-a"]
    out = await guard.release({"MIG-a": M}, {M: ["MIG-a", "MIG-b"]})
    assert out.destroyable == [] and list(out.needed) == ["MIG-a"]
    await plugins.close()


async def test_a_process_that_beat_the_destroy_does_not_make_the_instance_held_open():
    """The last guard before a destroy is NVML's IN_USE: a compute process that starts between the
    agent's re-check and the call (a pod's CUDA context) makes the driver refuse. The instance is
    then in use by that process, not held open by a client that is not one (DCGM): it must not be
    reported used for HELD_OPEN_S (10 min) after the process ends, with the plan that wants it gone
    waiting as long, but be destroyed at the next pass once free."""
    rig = make_rig(count=1)
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    assert (await agent.reconcile_once()).plan_id == "p1"
    gi = rig.driver.gi_at(0, 0)

    def process_starts(op: Any) -> None:
        if op.op == "destroy_ci" and op.gi_id == gi:
            rig.driver.before_op = None
            rig.driver.attach(0, 4242, gi)  # after the re-check, before the call

    rig.driver.before_op = process_starts
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert any("destroying 3g.40gb@0 failed" in e for e in report.errors), report.errors
    assert rig.driver.layout(0) == [("3g.40gb", 0)]
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    assert [m.used for g in status.layout.gpus for m in g.mig if m.start == 0] == [True]  # by its process
    assert not any("not a compute process" in e for e in report.errors), report.errors
    rig.driver.detach(0, 4242)  # the pod ends
    report = await agent.reconcile_once()
    assert rig.driver.layout(0) == [("7g.80gb", 0)], report.errors
    assert report.plan_id == "p2"
