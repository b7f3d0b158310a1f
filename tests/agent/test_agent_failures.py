"""What a real GPU node does to the agent over months, played on FakeNvml and the kubelet double:
a GPU that falls off the bus, a driver replaced under the agent, an instance a monitoring client
holds open, a re-carve whose new instance gets the destroyed one's UUID, and NVIDIA's plugin
(re-carves that keep the counts, an unhealthy MIG device, ids by index)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import GpuDriverError
from dynpart.agent.kube import FakeNodeApi, FakePluginPods
from dynpart.agent.loop import DRIVER_REPLACED_PASSES, Agent, DriverReplaced
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import MAX_ERROR_CHARS, STATUS_ERROR, decode_status

from .conftest import CATALOG, H100, NOW, mig_spec, mps_spec
from .kubelet_double import Assignment
from .test_agent_plugin import PluginRig, _rig

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
MIG_4G = "nvidia.com/mig-4g.40gb"


@pytest.fixture
async def rig() -> AsyncIterator[PluginRig]:
    async for r in _rig():
        yield r


@pytest.fixture
async def mps() -> AsyncIterator[PluginRig]:  # GPUs out of MIG mode
    async for r in _rig(mig_enabled=False):
        yield r


def _layout(node_api: FakeNodeApi, index: int) -> list[tuple[str, int, bool]] | list[tuple[int, bool]]:
    status = decode_status(node_api.annotations, H100, node="node-1", capacity=80)  # (the rigs' GPUs: 80 GiB)
    assert status.layout is not None
    g = next((g for g in status.layout.gpus if g.index == index), None)
    if g is None:
        return []
    return [(m.profile, m.start, m.used) for m in g.mig] or [(x.size, x.used) for x in g.mps]


async def test_a_lost_gpu_takes_only_itself_out_of_service(rig: PluginRig):
    """NVML answers GPU_IS_LOST for a GPU fallen off the bus, for its own handle only (NVIDIA's
    plugin marks only that device unhealthy): its devices are listed Unhealthy, the planner is
    told it alone is unhealthy, with its instances as last known and used, and the other GPU goes
    on: a plan that leaves the lost GPU as it is is applied and acknowledged. No call is made on
    the lost GPU. Once it is back (a reset), it is read and served again."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    rig.driver.lose(1)
    report = await agent.reconcile_once()
    assert not report.failed and report.plan_id == "p1"
    assert rig.node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    assert any(e.startswith("GPU 1 is unhealthy (fallen off the bus") for e in report.errors)
    assert _layout(rig.node_api, 1) == [("7g.80gb", 0, True)]  # as last known, used: never planned over
    assert _layout(rig.node_api, 0) == [("3g.40gb", 0, False), ("3g.40gb", 4, False)]
    await rig.kubelet.wait_for(lambda: [h for _, h in rig.kubelet.plugins["nvidia.com/mig-7g.80gb"].devices]
                               == ["Unhealthy"])
    await agent.reconcile_once()
    assert [h for _, h in rig.kubelet.plugins[MIG_3G].devices] == ["Healthy", "Healthy"]
    assert rig.node_api.allocatable[MIG_3G] == "2" and rig.node_api.allocatable["nvidia.com/mig-7g.80gb"] == "0"
    # the planner re-carves GPU 0 and keeps GPU 1 as it is: applied and acknowledged
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p2"))
    await rig.settle(agent, "p2")
    assert rig.driver.layout(0) == [("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)]
    assert rig.node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    # a plan that changes the lost GPU is not acknowledged, and nothing is tried there
    rig.node_api.set_annotations(mig_spec({1: ["4g.40gb@0"]}, plan="p3") | {"dynpart.io/spec-gpu-1-7g.80gb": None})
    for _ in range(3):
        report = await agent.reconcile_once()
    assert report.plan_id == "p2" and any("GPU 1 has 7g.80gb@0, the plan 4g.40gb@0" in e for e in report.errors)
    assert rig.driver.lost_calls == 0  # no call was made on the lost GPU
    rig.driver.reset(1)  # back, its instance gone: the plan is carried out there now
    await rig.settle(agent, "p3")
    assert rig.driver.layout(1) == [("4g.40gb", 0)]
    assert "dynpart.io/status-unhealthy" not in rig.node_api.annotations
    await rig.kubelet.wait_for(lambda: [h for _, h in rig.kubelet.plugins[MIG_4G].devices] == ["Healthy"])


async def test_every_gpu_unhealthy_when_the_driver_cannot_list_them(rig: PluginRig):
    """NVML failing as a whole (not one GPU's handle): every device is listed Unhealthy and every
    GPU reported unhealthy, until the GPUs can be read again."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    devices = rig.driver.devices

    def failing() -> list:
        raise GpuDriverError("UNKNOWN", "nvmlDeviceGetCount: Unknown Error")
    rig.driver.devices = failing  # type: ignore[method-assign]
    report = await agent.reconcile_once()
    assert report.failed
    assert rig.node_api.annotations["dynpart.io/status-unhealthy"] == "0,1"
    await rig.kubelet.wait_for(lambda: all(h == "Unhealthy" for p in rig.kubelet.plugins.values()
                                           for _, h in p.devices))
    rig.driver.devices = devices  # type: ignore[method-assign]
    for _ in range(20):
        await agent.reconcile_once()
        if all(h == "Healthy" for _, h in rig.kubelet.plugins[MIG_3G].devices):
            break
        await asyncio.sleep(0.05)
    assert [h for _, h in rig.kubelet.plugins[MIG_3G].devices] == ["Healthy", "Healthy"]
    assert "dynpart.io/status-unhealthy" not in rig.node_api.annotations


async def test_a_lost_gpu_in_mps_mode_keeps_its_slices_and_the_daemon(mps: PluginRig):
    """MPS: the lost GPU's slices stay, listed Unhealthy and reported used; the daemon is not
    restarted for the GPUs left (its clients on them would lose their contexts); the other GPU's
    slices are re-cut by a plan that leaves the lost one as it is. A reset brings it back."""
    agent = mps.agent()
    mps.node_api.set_annotations(mps_spec({0: [40, 40], 1: [20, 20, 40]}, plan="m1"))
    await mps.settle(agent, "m1")
    daemon_gpus, daemon_starts = mps.daemon.gpus, len(mps.daemon.starts)
    await mps.kubelet.admit("ns/a", "nvidia.com/gpu-20gb")  # a pod on GPU 1
    await agent.reconcile_once()
    mps.driver.lose(1)
    ops = len(mps.driver.ops)
    report = await agent.reconcile_once()
    assert not report.failed
    assert mps.node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    assert sorted(_layout(mps.node_api, 1)) == [(20, True), (20, True), (40, True)]
    assert _layout(mps.node_api, 0) == [(40, False), (40, False)]
    await mps.kubelet.wait_for(lambda: [h for _, h in mps.kubelet.plugins["nvidia.com/gpu-20gb"].devices]
                               == ["Unhealthy", "Unhealthy"])
    mps.node_api.set_annotations(mps_spec({0: [20, 20, 20, 20], 1: [20, 20, 40]}, plan="m2")
                                 | {"dynpart.io/spec-gpu-0-40gb": None})
    await mps.settle(agent, "m2")
    assert sorted(_layout(mps.node_api, 0)) == [(20, False)] * 4
    assert sorted(_layout(mps.node_api, 1)) == [(20, True), (20, True), (40, True)]
    assert mps.daemon.running and mps.daemon.gpus == daemon_gpus
    assert len(mps.daemon.starts) == daemon_starts
    assert not any(op.device == 1 for op in mps.driver.ops[ops:])
    assert mps.driver.lost_calls == 0
    mps.kubelet.release("ns/a")
    mps.driver.reset(1)  # back (compute mode DEFAULT again): served again, EXCLUSIVE_PROCESS again
    for _ in range(20):
        await agent.reconcile_once()
        if all(h == "Healthy" for p in mps.kubelet.plugins.values() for _, h in p.devices):
            break
        await asyncio.sleep(0.05)
    assert all(h == "Healthy" for p in mps.kubelet.plugins.values() for _, h in p.devices)
    assert "dynpart.io/status-unhealthy" not in mps.node_api.annotations
    assert mps.driver.compute_mode(1) == "EXCLUSIVE_PROCESS"


async def test_an_agent_restarted_while_a_gpu_is_lost_reports_it_as_the_last_status(mps: PluginRig):
    """MPS: the restarted agent finds the lost GPU's slices in the node's last status: reported
    used, listed Unhealthy under their ids, and nothing is called on it."""
    agent = mps.agent()
    mps.node_api.set_annotations(mps_spec({0: [40, 40], 1: [20, 20, 40]}, plan="m1"))
    await mps.settle(agent, "m1")
    mps.driver.lose(1)
    await agent.reconcile_once()
    restarted = mps.agent()
    report = await restarted.reconcile_once()
    assert not report.failed and report.plan_id == "m1"
    assert mps.node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    assert sorted(_layout(mps.node_api, 1)) == [(20, True), (20, True), (40, True)]
    await mps.kubelet.wait_for(lambda: sorted(mps.kubelet.plugins["nvidia.com/gpu-20gb"].devices)
                               == [("GPU-fake-0001::1", "Unhealthy"), ("GPU-fake-0001::2", "Unhealthy")])
    assert mps.driver.lost_calls == 0


async def test_a_gpu_lost_during_a_pass_is_listed_lost_at_the_next_pass_soon(rig: PluginRig):
    """A GPU falls off the bus between the pass's list of GPUs and a read on it: that pass fails
    (every GPU reported unhealthy) and the next one comes soon (`retry_s`), listing only it lost."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    processes = rig.driver.processes

    def lost_now(index: int, gi_id: int | None = None) -> list[int]:
        rig.driver.lose(1)
        rig.driver.processes = processes  # type: ignore[method-assign]
        return processes(index, gi_id)
    rig.driver.processes = lost_now  # type: ignore[method-assign]
    report = await agent.reconcile_once()
    assert report.failed and agent._waiting and agent._retry_delay == agent.retry_s
    assert rig.node_api.annotations["dynpart.io/status-unhealthy"] == "0,1"
    report = await agent.reconcile_once()
    assert not report.failed and rig.node_api.annotations["dynpart.io/status-unhealthy"] == "1"


async def test_one_lost_gpu_leaves_the_other_gpus_in_service():
    """(without the built-in plugin) A 2-GPU node, GPU 1 lost: only it is reported unhealthy, with
    its instance used; an agent restarted meanwhile reports it as the node's last status does."""
    driver = FakeNvml(H100, 2)
    api = FakeNodeApi("node-1", labels={"dynpart.io/gpu-partitioning": "mig"})
    agent = Agent("node-1", node_api=api, driver=driver, pods=FakePodResources(), catalog=CATALOG, now=lambda: NOW)
    api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    for _ in range(3):
        await agent.reconcile_once()
    assert api.annotations.get("dynpart.io/status-plan") == "p1"
    driver.lose(1)
    await agent.reconcile_once()
    assert api.annotations.get("dynpart.io/status-unhealthy") == "1"
    assert _layout(api, 1) == [("7g.80gb", 0, True)] and _layout(api, 0) == [("3g.40gb", 0, False), ("3g.40gb", 4, False)]
    restarted = Agent("node-1", node_api=api, driver=driver, pods=FakePodResources(), catalog=CATALOG, now=lambda: NOW)
    report = await restarted.reconcile_once()
    assert report.plan_id == "p1" and api.annotations.get("dynpart.io/status-unhealthy") == "1"
    assert _layout(api, 1) == [("7g.80gb", 0, True)]
    assert driver.lost_calls == 0
    driver.reboot()
    for _ in range(3):
        await restarted.reconcile_once()
    assert "dynpart.io/status-unhealthy" not in api.annotations
    assert driver.layout(1) == [("7g.80gb", 0)] and api.annotations.get("dynpart.io/status-plan") == "p1"


async def test_a_recarve_that_reuses_the_destroyed_instances_uuid_is_advertised(rig: PluginRig):
    """A new GPU instance takes the id of the one just destroyed, and with it its MIG UUID: the new
    device must not inherit the old one's withdrawal, nor the plan be acknowledged without it."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    await rig.settle(agent, "p1")
    old = rig.uuid_at(0, 0)
    rig.node_api.set_annotations(mig_spec({0: ["4g.40gb@0", "3g.40gb@4"]}, plan="p2"))
    await rig.settle(agent, "p2")
    assert rig.uuid_at(0, 0) == old  # the fake reuses it, as name-based UUIDs would
    assert not rig.plugins.withdrawn and not rig.plugins.sealed
    assert rig.kubelet.plugins[MIG_4G].ids == [old]
    assert rig.node_api.allocatable[MIG_4G] == "1"
    await rig.kubelet.admit("ns/a", MIG_4G)  # and a pod gets it


async def test_an_instance_held_open_is_reported_used_and_not_tried_again(rig: PluginRig):
    """The driver refuses to destroy an instance that no process and no pod uses (DCGM holds it):
    it is reported used, so that the planner stops counting on it, and the plan is not acknowledged."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    await rig.settle(agent, "p1")
    rig.driver.hold(0, "dcgm", gi_id=rig.driver.gi_at(0, 0))
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and any("destroying 3g.40gb@0 failed" in e for e in report.errors)
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    held = [m for g in status.layout.gpus for m in g.mig if m.start == 0]
    assert held and held[0].used
    destroys = sum(op.op == "destroy_ci" for op in rig.driver.ops)
    await agent.reconcile_once()
    assert sum(op.op == "destroy_ci" for op in rig.driver.ops) == destroys  # not tried again at every pass
    assert rig.kubelet.plugins[MIG_3G].ids  # still served: a pod may use it


async def test_the_agent_exits_when_the_driver_is_replaced_under_it():
    """After a driver upgrade nvmlInit keeps failing with the old library: only a new container
    mounts the new one, so the agent exits instead of failing for ever with a live probe."""
    driver = FakeNvml(H100, 1)
    node_api = FakeNodeApi("node-1")
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=FakePodResources(), catalog=CATALOG,
                  now=lambda: NOW, interval_s=0.01)

    def replaced() -> list:
        raise GpuDriverError("LIB_RM_VERSION_MISMATCH", "nvmlInit: RM has detected an NVML/RM version mismatch")
    await agent.reconcile_once()
    driver.devices = replaced  # type: ignore[method-assign]
    with pytest.raises(DriverReplaced, match="starts the agent again"):
        await asyncio.wait_for(agent.run(), timeout=10)
    assert agent._driver_replaced == DRIVER_REPLACED_PASSES
    assert "version mismatch" in node_api.annotations[STATUS_ERROR]


async def test_another_nvml_failure_does_not_end_the_agent():
    driver = FakeNvml(H100, 1)
    agent = Agent("node-1", node_api=FakeNodeApi("node-1"), driver=driver, pods=FakePodResources(), catalog=CATALOG,
                  now=lambda: NOW, interval_s=0.01)
    driver.lose(0)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(0.3)
    assert not task.done()
    stop.set()
    await task


def _nvidia_agent(driver: FakeNvml, pods: FakePodResources) -> tuple[Agent, FakeNodeApi, FakePluginPods]:
    node_api = FakeNodeApi("node-1")
    plugin_pods = FakePluginPods()
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=pods, catalog=CATALOG, now=lambda: NOW,
                  plugin_pods=plugin_pods, node_pods=FakeNodePods())
    return agent, node_api, plugin_pods


def _nvidia_lists(driver: FakeNvml, pods: FakePodResources, node_api: FakeNodeApi) -> None:
    """What NVIDIA's plugin lists after a restart: the driver's MIG devices now."""
    by_id = {p.gi_profile_id: p.name for p in driver.model.mig_profiles}
    lists: dict[str, list[str]] = {}
    for gi in driver.gpu_instances(0):
        if gi.uuid:
            lists.setdefault(f"nvidia.com/mig-{by_id[gi.profile_id]}", []).append(gi.uuid)
    pods.devices = lists
    node_api.set_allocatable({r: len(ids) for r, ids in lists.items()})


async def test_nvidias_plugin_is_restarted_after_a_recarve_that_keeps_the_counts():
    driver, pods = FakeNvml(H100, 1), FakePodResources()
    agent, node_api, plugin_pods = _nvidia_agent(driver, pods)
    node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "3g.40gb@4"]}, plan="p1"))
    await agent.reconcile_once()
    _nvidia_lists(driver, pods, node_api)
    assert (await agent.reconcile_once()).plan_id == "p1" and plugin_pods.restarts == 1
    # the 1g moves from slot 0 to slot 6: same counts, another MIG device
    node_api.set_annotations(mig_spec({0: ["1g.10gb@6", "3g.40gb@0"]}, plan="p2"))
    report = await agent.reconcile_once()
    assert plugin_pods.restarts == 2 and report.plan_id == "p1"
    assert any("still lists MIG devices that are gone" in w for w in report.waiting)
    # an agent that starts now (the last one crashed before its restart took effect): the counts
    # match the layout, the ids the kubelet holds do not
    restarter = FakePluginPods()
    again = Agent("node-1", node_api=node_api, driver=driver, pods=pods, catalog=CATALOG, now=lambda: NOW,
                  plugin_pods=restarter, node_pods=FakeNodePods())
    await again.reconcile_once()
    assert restarter.restarts == 1
    _nvidia_lists(driver, pods, node_api)
    assert (await agent.reconcile_once()).plan_id == "p2" and plugin_pods.restarts == 2


async def test_an_unhealthy_mig_device_does_not_freeze_the_node_with_nvidias_plugin():
    """NVIDIA's plugin marks a MIG device Unhealthy after an Xid: the kubelet keeps it in the node's
    capacity, not in allocatable. The plan is still acknowledged."""
    driver, pods = FakeNvml(H100, 1), FakePodResources()
    agent, node_api, _ = _nvidia_agent(driver, pods)
    node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await agent.reconcile_once()
    _nvidia_lists(driver, pods, node_api)
    node_api.allocatable[MIG_1G] = "1"  # one of the two is unhealthy
    pods.devices[MIG_1G] = pods.devices[MIG_1G][:1]
    assert (await agent.reconcile_once()).plan_id == "p1"
    assert "dynpart.io/status-unhealthy" not in node_api.annotations


async def test_with_nvidias_plugin_the_agent_still_tells_the_planner_which_gpus_are_unhealthy():
    """NVIDIA's plugin reads health for the kubelet; the planner learns it from the agent's status."""
    driver, pods = FakeNvml(H100, 2), FakePodResources()
    agent, node_api, _ = _nvidia_agent(driver, pods)
    driver.unhealthy[1] = "the driver asks for a recovery action (RESET) after an error on it (an Xid)"
    report = await agent.reconcile_once()
    assert node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    assert any(e.startswith("GPU 1 is unhealthy (the driver asks") for e in report.errors)


async def test_mig_devices_named_by_index_suspend_mig_changes():
    """deviceIDStrategy=index: PodResources names MIG devices `0:1`, which the agent cannot map to
    an instance, so a bound pod's instance could look free: nothing is changed."""
    driver, pods = FakeNvml(H100, 1), FakePodResources()
    agent, node_api, _ = _nvidia_agent(driver, pods)
    node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    await agent.reconcile_once()
    pods.devices = {MIG_3G: ["0:0", "0:1"]}
    node_api.set_allocatable({MIG_3G: 2})
    node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert [p for p, _ in driver.layout(0)] == ["3g.40gb", "3g.40gb"] and report.plan_id != "p2"
    assert any("deviceIDStrategy" in e for e in report.errors)


async def test_gpu_operator_components_left_on_are_warned_about(rig: PluginRig):
    """mig-manager re-applies its own layout at each start, NVIDIA's plugin replaces the agent's at
    the kubelet: a node label that leaves them on gets one Warning Event each."""
    rig.node_api.labels.update({"nvidia.com/gpu.deploy.mig-manager": "true",
                                "nvidia.com/gpu.deploy.device-plugin": "true"})
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    await agent.reconcile_once()
    warned = [(reason, m) for kind, (reason, m, warning) in ((k, e) for k, e in rig.node_api.events if k == "event")
              if reason.endswith("NotOff") and warning]
    assert [r for r, _ in warned] == ["MigManagerNotOff", "NvidiaDevicePluginNotOff"]
    assert "mig-manager" in warned[0][1] and "device plugin" in warned[1][1]
    rig.node_api.labels.update({"nvidia.com/gpu.deploy.mig-manager": "false",
                                "nvidia.com/gpu.deploy.device-plugin": "false"})
    await agent.reconcile_once()
    assert len([e for k, e in rig.node_api.events if k == "event" and e[0].endswith("NotOff")]) == 2


async def test_a_device_another_plugin_gave_out_under_another_name_is_not_given_again(rig: PluginRig):
    """Installed on a node whose running pod got its MIG device from NVIDIA's plugin with
    migStrategy `single` (as nvidia.com/gpu, id = the MIG UUID): the kubelet counts allocations
    per resource and id, so listed Healthy as nvidia.com/mig-1g.10gb it would go to a second
    pod. It is listed Unhealthy, and the status says why, until that pod ends."""
    from tests.agent.kubelet_double import AdmissionError

    p = H100.profile("1g.10gb")
    gi = rig.driver.create_gpu_instance(0, p.gi_profile_id, 0, p.memory)  # carved before (mig-parted)
    rig.driver.create_compute_instance(0, gi, p.compute)
    uuid = rig.uuid_at(0, 0)
    rig.kubelet.assignments.append(Assignment("ml/old", "main", "nvidia.com/gpu", [uuid]))
    agent = rig.agent()
    report = await agent.reconcile_once()
    await rig.kubelet.wait_for_devices(MIG_1G, [(uuid, "Unhealthy")])
    with pytest.raises(AdmissionError):
        await rig.kubelet.admit("ml/new", MIG_1G)
    assert any(e.startswith(f"device {uuid} is held by pod ml/old as nvidia.com/gpu {uuid}") for e in report.errors)
    assert decode_status(rig.node_api.annotations, H100, node="node-1").layout.gpus[0].mig[0].used
    rig.kubelet.assignments.clear()  # the old pod ended
    await agent.reconcile_once()
    await rig.kubelet.wait_for_devices(MIG_1G, [(uuid, "Healthy")])
    await rig.kubelet.admit("ml/new", MIG_1G)


async def test_devices_held_elsewhere_are_found_again_at_each_pass_and_only_among_those_listed(mps: PluginRig):
    """A time-sliced whole GPU held by an old pod; the node then goes MIG with NVIDIA's plugin (the
    agent lists nothing): the finding is not kept from the last lists, and ends with the pod."""
    rig = mps
    agent = rig.agent(plugin_pods=FakePluginPods())
    rig.kubelet.assignments.append(Assignment("ml/old", "main", "nvidia.com/gpu", ["GPU-fake-0001::0"]))
    report = await agent.reconcile_once()
    assert any("device GPU-fake-0001 is held by pod ml/old" in e for e in report.errors)
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2"))
    for _ in range(3):
        await agent.reconcile_once()
    rig.kubelet.assignments.clear()  # the old pod ended
    report = await agent.reconcile_once()
    assert not agent._serving() and not [e for e in report.errors if "held by" in e]


async def test_gpus_that_cannot_be_read_while_serving_are_all_reported_unhealthy(mps: PluginRig):
    rig = mps
    agent = rig.agent()
    await agent.reconcile_once()

    async def lost(devices: list) -> list:
        raise GpuDriverError("GPU_IS_LOST", "lost")
    agent.views = lost  # type: ignore[method-assign]  # NVML fails while the devices are listed
    await agent.reconcile_once()
    assert rig.node_api.annotations.get("dynpart.io/status-unhealthy") == "0,1"


async def test_a_pass_that_fails_unexpectedly_says_so_in_the_nodes_status():
    """An error the agent does not expect (a bug, a library's own exception) still ends the pass
    with the node's status naming it, as a driver error does; the next good pass clears it."""
    driver = FakeNvml(H100, 1)
    node_api = FakeNodeApi("node-1")
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=FakePodResources(), catalog=CATALOG,
                  now=lambda: NOW, interval_s=0.01)
    await agent.reconcile_once()
    assert STATUS_ERROR not in node_api.annotations
    listed = driver.devices

    def broken() -> list:
        raise KeyError("gpu-uuid")
    driver.devices = broken  # type: ignore[method-assign]
    with pytest.raises(KeyError):
        await agent.reconcile_once()
    assert "failed unexpectedly (KeyError: 'gpu-uuid')" in node_api.annotations[STATUS_ERROR]
    driver.devices = listed  # type: ignore[method-assign]
    await agent.reconcile_once()
    assert STATUS_ERROR not in node_api.annotations

    def verbose() -> list:  # a library's message: any length, over lines
        raise ValueError("line\n" * 20_000)
    driver.devices = verbose  # type: ignore[method-assign]
    with pytest.raises(ValueError):
        await agent.reconcile_once()
    said = node_api.annotations[STATUS_ERROR]
    assert said.startswith("the pass failed unexpectedly (ValueError: line line") and "\n" not in said
    assert len(said) <= MAX_ERROR_CHARS


async def test_a_pass_that_fails_unexpectedly_raises_its_own_error_when_the_status_cannot_be_written():
    driver = FakeNvml(H100, 1)
    node_api = FakeNodeApi("node-1")
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=FakePodResources(), catalog=CATALOG,
                  now=lambda: NOW, interval_s=0.01)

    def broken() -> list:
        raise ValueError("a bug")

    async def refused(**_: object) -> None:
        raise ConnectionResetError("the API server went away")
    driver.devices = broken  # type: ignore[method-assign]
    node_api.patch = refused  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="a bug"):
        await agent.reconcile_once()


async def test_a_pass_that_fails_after_changing_instances_reports_them_as_the_driver_has_them():
    """The kubelet's PodResources stops answering (a kubelet restart) right after the pass
    destroyed an instance: the last status, kept, said the instance was there and free, under its
    plan, with a fresh heartbeat, for every pass until the kubelet answered (helper-145). The GPUs
    that changed are reported as the driver has them, every instance used (which pods use them
    cannot be read); the others, and the acknowledged plan, as they were."""
    from dynpart.agent.podresources import PodResourcesError
    from dynpart.annotations import STATUS_PLAN

    from .conftest import make_rig

    rig = make_rig(count=2)
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    assert (await agent.reconcile_once()).plan_id == "p1"

    def kubelet_gone(n: int) -> None:
        if any(o.op == "destroy_gi" for o in rig.driver.ops):
            raise PodResourcesError("kubelet PodResources API: UNAVAILABLE")

    rig.pods.on_list = kubelet_gone
    rig.driver.ops.clear()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"], 1: ["7g.80gb@0"]}, plan="p2")
                                 | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    for _ in range(2):  # the failed pass, and one more while the kubelet restarts
        report = await agent.reconcile_once()
        assert report.failed
        status = decode_status(rig.node_api.annotations, H100, node="node-1")
        assert rig.driver.layout(0) == [("3g.40gb", 4)]  # one destroyed, then the pass stopped
        assert [(m.profile, m.start, m.used) for m in status.layout.gpus[0].mig] == [("3g.40gb", 4, True)]
        assert [(m.profile, m.start, m.used) for m in status.layout.gpus[1].mig] == [("7g.80gb", 0, False)]
        assert rig.node_api.annotations[STATUS_PLAN] == "p1" and "UNAVAILABLE" in rig.node_api.annotations[STATUS_ERROR]
    rig.pods.on_list = None  # back: the next pass applies p2 and says what is used
    assert (await agent.reconcile_once()).plan_id == "p2"
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[0].mig] == [("7g.80gb", 0, False)]


async def test_a_lost_gpu_does_not_restart_nvidias_plugin():
    """With NVIDIA's plugin: a GPU lost is reported unhealthy alone, its MIG devices count as still
    there (NVIDIA's plugin marks them Unhealthy itself; a restart for them would gain nothing), and
    a plan for the other GPU is carried out and acknowledged."""
    driver, pods = FakeNvml(H100, 2), FakePodResources()
    agent, node_api, plugin_pods = _nvidia_agent(driver, pods)

    def lists() -> None:
        by_id = {p.gi_profile_id: p.name for p in driver.model.mig_profiles}
        found: dict[str, list[str]] = {}
        for gpu in range(2):
            for gi in ([] if gpu in driver.lost else driver.gpu_instances(gpu)):
                if gi.uuid:
                    found.setdefault(f"nvidia.com/mig-{by_id[gi.profile_id]}", []).append(gi.uuid)
        pods.devices = found
        # a lost GPU's MIG devices: Unhealthy, in the node's capacity, not allocatable
        node_api.set_allocatable({r: len(ids) for r, ids in found.items()},
                                 {"nvidia.com/mig-7g.80gb": 1} if driver.lost else None)
    node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p1"))
    await agent.reconcile_once()
    lists()
    assert (await agent.reconcile_once()).plan_id == "p1" and plugin_pods.restarts == 1
    driver.lose(1)
    report = await agent.reconcile_once()
    assert not report.failed and plugin_pods.restarts == 1
    assert node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    assert _layout(node_api, 1) == [("7g.80gb", 0, True)]
    node_api.set_annotations(mig_spec({0: ["4g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}, plan="p2"))
    await agent.reconcile_once()
    assert plugin_pods.restarts == 2
    lists()
    report = await agent.reconcile_once()
    assert driver.layout(0) == [("4g.40gb", 0), ("3g.40gb", 4)] and driver.lost_calls == 0
    assert report.plan_id == "p2", report.errors
