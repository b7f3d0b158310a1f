"""The agent with its built-in device plugin, against the kubelet double (real gRPC on real unix
sockets: registration, ListAndWatch, Allocate at admission, PodResources read by the agent's real
client) and FakeNvml: what it advertises, withdraw before destroy, bound pods' slices kept,
acknowledgements that wait for the kubelet, early publication of the node's allocatable, MPS
served by the plugin with its control daemon, and NVIDIA's plugin path."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from dynpart.agent.deviceplugin.devices import PluginDevice, check_exclusive
from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml, FakeOp
from dynpart.agent.kube import FakeNodeApi, FakePluginPods
from dynpart.agent.loop import Agent
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import FakePodResources, KubeletPodResources
from dynpart.annotations import STATUS_ERROR, STATUS_PLAN
from tests.agent.kubelet_double import KubeletDouble

from .conftest import CATALOG, H100, NOW, ROUND_80GIB, mig_spec, mps_spec

MIG_1G = "nvidia.com/mig-1g.10gb"


class CheckedNodeApi(FakeNodeApi):
    """Fails the test if a published count is ever above what the kubelet holds at that moment."""

    def __init__(self, kubelet: KubeletDouble):
        super().__init__("node-1")
        self.kubelet = kubelet

    async def patch_status(self, counts: dict[str, int]) -> None:
        held = self.kubelet.held()
        for r, n in counts.items():
            assert n <= len(held.get(r, [])), f"published {r}={n}, the kubelet holds {held.get(r)}"
        await super().patch_status(counts)


@dataclass
class PluginRig:
    driver: FakeNvml
    kubelet: KubeletDouble
    plugins: DevicePluginManager
    node_api: CheckedNodeApi
    node_pods: FakeNodePods
    daemon: FakeMpsDaemon

    def agent(self, **kw: Any) -> Agent:
        return Agent("node-1", node_api=self.node_api, driver=self.driver,
                     pods=KubeletPodResources(self.kubelet.pod_resources_socket, timeout_s=2), catalog=CATALOG,
                     now=lambda: NOW, plugins=self.plugins, node_pods=self.node_pods,
                     mps_daemon=self.daemon, withdraw_settle_s=0.05, **kw)

    def uuid_at(self, gpu: int, start: int) -> str:
        return next(g.uuid for g in self.driver.gpu_instances(gpu) if g.start == start and g.uuid)

    async def settle(self, agent: Agent, plan: str, passes: int = 40) -> None:
        """Passes until the plan is acknowledged (the kubelet reads the lists asynchronously)."""
        for _ in range(passes):
            report = await agent.reconcile_once()
            if report.plan_id == plan:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"plan {plan} not acknowledged: {self.node_api.annotations.get(STATUS_ERROR)}")


async def _rig(mig_enabled: bool = True, count: int = 2) -> AsyncIterator[PluginRig]:
    d = tempfile.mkdtemp(prefix="ap-", dir="/tmp")
    kubelet = KubeletDouble(d)
    await kubelet.start()
    try:
        async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:
            yield PluginRig(FakeNvml(H100, count, mig_enabled=mig_enabled, **ROUND_80GIB), kubelet, plugins, CheckedNodeApi(kubelet),
                            FakeNodePods(), FakeMpsDaemon())
    finally:
        await kubelet.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def rig() -> AsyncIterator[PluginRig]:
    async for r in _rig():
        yield r


@pytest.fixture
async def mps() -> AsyncIterator[PluginRig]:
    async for r in _rig(mig_enabled=False):
        yield r


def replay_exclusive(kubelet: KubeletDouble) -> None:
    """At no moment of what the kubelet received is a GPU both whole and sliced."""
    current: dict[str, list[str]] = {}
    for _, resource, ids in kubelet.events:
        current[resource] = ids
        whole = set(current.get("nvidia.com/gpu", []))
        parts = {i.split("::")[0] for r, v in current.items() if r.startswith("nvidia.com/gpu-") for i in v}
        assert not whole & parts, f"after {resource} -> {ids}: {sorted(whole & parts)} whole and sliced"


# --- 1, 3, 4: advertise, truthful ack, early publication -----------------------------------------


async def test_advertises_what_the_driver_holds_and_acks_once_the_kubelet_has_it(mps: PluginRig):
    rig = mps  # MIG mode off: both GPUs whole
    agent = rig.agent()
    await agent.reconcile_once()
    await rig.kubelet.wait_devices("nvidia.com/gpu", ["GPU-fake-0000", "GPU-fake-0001"])
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1", "3g.40gb@4"]}, plan="p1"))
    await rig.settle(agent, "p1")
    mig = sorted([rig.uuid_at(0, 0), rig.uuid_at(0, 1)])
    assert sorted(rig.kubelet.plugins[MIG_1G].ids) == mig
    assert rig.kubelet.plugins["nvidia.com/mig-3g.40gb"].ids == [rig.uuid_at(0, 4)]
    # GPU 0 was withdrawn from nvidia.com/gpu before MIG mode was enabled; GPU 1 stays whole
    assert rig.kubelet.plugins["nvidia.com/gpu"].lists == [[("GPU-fake-0000", "Healthy"), ("GPU-fake-0001", "Healthy")],
                                                          [("GPU-fake-0001", "Healthy")]]
    assert rig.node_api.allocatable == {MIG_1G: "2", "nvidia.com/mig-3g.40gb": "1", "nvidia.com/gpu": "1"}
    # health from the driver: GPU 1 lost -> Unhealthy, and published at once as 0
    rig.driver.unhealthy[1] = "memory rows wait for remapping: the GPU needs a reset"
    await agent.reconcile_once()
    await rig.kubelet.wait_for_devices("nvidia.com/gpu", [("GPU-fake-0001", "Unhealthy")])
    report = await agent.reconcile_once()
    assert rig.node_api.allocatable["nvidia.com/gpu"] == "0"
    # said in the status and in an Event, once
    assert any(e.startswith("GPU 1 is unhealthy (memory rows wait") for e in report.errors)
    assert [e[0] for k, e in rig.node_api.events if k == "event" and e[0] == "GpuUnhealthy"] == ["GpuUnhealthy"]
    # and to the planner, which plans nothing there until it recovers
    assert rig.node_api.annotations["dynpart.io/status-unhealthy"] == "1"
    del rig.driver.unhealthy[1]
    await agent.reconcile_once()
    assert "dynpart.io/status-unhealthy" not in rig.node_api.annotations
    replay_exclusive(rig.kubelet)


async def test_no_ack_until_the_kubelet_reports_the_devices(rig: PluginRig):
    rig.kubelet.refuse_registration = True  # the plugin serves but cannot register
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    for _ in range(2):
        report = await agent.reconcile_once()
        assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
        assert rig.driver.layout(0) == [("7g.80gb", 0)]  # applied, not acknowledged
    error = rig.node_api.annotations[STATUS_ERROR]
    assert "plan p1 is not acknowledged yet: the kubelet does not report these devices yet: nvidia.com/mig-7g.80gb" in error
    assert report.waiting and rig.node_api.allocatable == {}  # nothing published the kubelet does not hold
    rig.kubelet.refuse_registration = False  # the plugin manager registers again on its own
    await rig.settle(agent, "p1")
    assert rig.node_api.allocatable == {"nvidia.com/mig-7g.80gb": "1"}
    assert STATUS_ERROR not in rig.node_api.annotations


async def test_a_plan_the_gpus_do_not_hold_is_not_acknowledged(rig: PluginRig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    await rig.kubelet.admit("ns/a", MIG_1G)
    # the planner wants the slice gone (it read the status before the pod got it): kept, not acked
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and rig.node_api.annotations[STATUS_PLAN] == "p1"
    assert ("plan p2 is not acknowledged yet: the GPUs do not hold it: GPU 0 has 1g.10gb@0, the plan 7g.80gb@0"
            in rig.node_api.annotations[STATUS_ERROR])


# --- 2: withdraw before destroy, bound pods -------------------------------------------------------


async def test_withdrawn_and_published_before_destroyed(rig: PluginRig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await rig.settle(agent, "p1")
    doomed = {rig.uuid_at(0, 0), rig.uuid_at(0, 1)}
    checked: list[str] = []

    def before(op: FakeOp) -> None:
        if op.op in ("destroy_ci", "destroy_gi"):
            listed = set(rig.kubelet.plugins[MIG_1G].ids)
            assert not listed & doomed, f"{op.op} while the kubelet still lists {listed & doomed}"
            assert rig.node_api.allocatable[MIG_1G] == "0", "destroyed before the lower count was published"
            checked.append(op.op)

    rig.driver.before_op = before
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    await rig.settle(agent, "p2")
    assert checked.count("destroy_gi") == 2 and rig.driver.layout(0) == [("7g.80gb", 0)]
    assert rig.node_api.allocatable[MIG_1G] == "0" and rig.node_api.allocatable["nvidia.com/mig-7g.80gb"] == "1"
    assert rig.kubelet.admission_errors == []


async def test_a_bound_pod_gets_the_slice_it_was_bound_for(rig: PluginRig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await rig.settle(agent, "p1")
    used_destroyed: list[str] = []

    def before(op: FakeOp) -> None:  # the fake driver's log, checked against the kubelet's assignments
        if op.op == "destroy_gi":
            gi = {g.gi_id: g for g in rig.driver.gpu_instances(op.device)}[op.gi_id]
            if any(gi.uuid in a.ids for a in rig.kubelet.assignments):
                used_destroyed.append(str(gi.uuid))

    rig.driver.before_op = before
    # the scheduler bound ns/w to the node for a 1g.10gb; the planner re-carves GPU 0 meanwhile
    rig.node_pods.bind("ns/w", {MIG_1G: 1})
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "p1"  # not p2: the GPU does not hold it
    kept = [e for e in report.errors if "kept for pod(s) ns/w bound to this node and not yet admitted" in e]
    assert len(kept) == 1 and "the plan's change of that GPU waits" in kept[0]
    assert [p for p, _ in rig.driver.layout(0)] == ["1g.10gb"]  # one destroyed, one kept
    await rig.kubelet.admit("ns/w", MIG_1G)  # the kubelet admits it: the kept slice is free for it
    rig.node_pods.remove("ns/w")
    report = await agent.reconcile_once()
    assert any("in use (pod ns/w)" in e for e in report.errors) and report.plan_id == "p1"
    rig.kubelet.release("ns/w")
    await rig.settle(agent, "p2")
    assert rig.driver.layout(0) == [("7g.80gb", 0)]
    assert rig.kubelet.admission_errors == [] and used_destroyed == []


async def test_an_allocate_during_the_withdrawal_keeps_the_slice(rig: PluginRig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    target = rig.uuid_at(0, 0)
    chosen = await rig.kubelet.choose(MIG_1G)  # the kubelet picked it before it read the withdrawal
    assert chosen == [target]
    publish = agent.guard.on_withdrawn

    async def late_allocate() -> None:
        # its Allocate reaches the plugin only now: served (not sealed yet), and recorded
        response = await rig.kubelet.allocate(MIG_1G, chosen)
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": target}
        if publish is not None:
            await publish()

    agent.guard.on_withdrawn = late_allocate
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert any("1g.10gb@0 was taken (a kubelet Allocate call) just before it was to be destroyed; kept" in e
               for e in report.errors), report.errors
    assert rig.driver.layout(0) == [("1g.10gb", 0)] and not any(o.op == "destroy_gi" for o in rig.driver.ops)
    await rig.kubelet.wait_devices(MIG_1G, [target])  # readmitted
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()


# --- 5: MPS through the plugin --------------------------------------------------------------------


async def test_mps_slices_are_served_by_the_plugin(mps: PluginRig):
    agent = mps.agent()
    mps.node_api.set_annotations(mps_spec({0: [10, 10, 20], 1: [40, 40]}, plan="m1"))
    await mps.settle(agent, "m1")
    assert "nvidia.com/device-plugin.config" not in mps.node_api.labels
    assert mps.daemon.running and mps.daemon.gpus == ("GPU-fake-0000", "GPU-fake-0001")
    assert mps.daemon.dirs == (mps.plugins.allocate.pipe_dir_host, "/var/log/nvidia-mps")
    assert sorted(mps.kubelet.plugins["nvidia.com/gpu-10gb"].ids) == ["GPU-fake-0000::1", "GPU-fake-0000::2"]
    assert mps.kubelet.plugins["nvidia.com/gpu-20gb"].ids == ["GPU-fake-0000::0"]
    assert mps.kubelet.plugins["nvidia.com/gpu-40gb"].ids == ["GPU-fake-0001::0", "GPU-fake-0001::1"]
    assert "nvidia.com/gpu" not in mps.kubelet.held()
    assert mps.node_api.allocatable == {"nvidia.com/gpu-10gb": "2", "nvidia.com/gpu-20gb": "1", "nvidia.com/gpu-40gb": "2"}
    response = await mps.kubelet.admit("ns/a", "nvidia.com/gpu-10gb")
    envs = dict(response.container_responses[0].envs)
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G" and envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-fake-0000"
    held = mps.kubelet.assignments[0].ids[0]
    # re-planned while one 10 GB slice is used: it keeps its id, the rest of GPU 0 is re-cut
    mps.node_api.set_annotations({**mps_spec({0: [40, 20, 10]}, plan="m2")})
    await mps.settle(agent, "m2")
    ids = {r: p.ids for r, p in mps.kubelet.plugins.items() if p.ids}
    assert held in ids["nvidia.com/gpu-10gb"] and len(ids["nvidia.com/gpu-10gb"]) == 1
    assert ids["nvidia.com/gpu-20gb"] == ["GPU-fake-0000::0"]  # its number kept: same size
    assert [i for i in ids["nvidia.com/gpu-40gb"] if i.startswith("GPU-fake-0000")] == ["GPU-fake-0000::3"]
    # back to whole: the used slice stays until its pod ends, then GPU 0 is a whole nvidia.com/gpu
    mps.node_api.set_annotations({"dynpart.io/spec-plan": "m3", "dynpart.io/spec-gpu-0-40gb": None,
                                  "dynpart.io/spec-gpu-0-20gb": None, "dynpart.io/spec-gpu-0-10gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "m2" and mps.kubelet.plugins["nvidia.com/gpu-10gb"].ids == [held]
    mps.kubelet.release("ns/a")
    await mps.settle(agent, "m3")
    await mps.kubelet.wait_devices("nvidia.com/gpu", ["GPU-fake-0000"])
    replay_exclusive(mps.kubelet)
    assert mps.kubelet.admission_errors == []


async def test_mps_bound_pod_keeps_a_slice(mps: PluginRig):
    agent = mps.agent()
    mps.node_api.set_annotations(mps_spec({0: [20, 20]}, plan="m1"))
    await mps.settle(agent, "m1")
    mps.node_pods.bind("ns/w", {"nvidia.com/gpu-20gb": 1})
    mps.node_api.set_annotations({**mps_spec({0: [40, 40]}, plan="m2"), "dynpart.io/spec-gpu-0-20gb": None})
    report = await agent.reconcile_once()
    assert any("MPS slice GPU-fake-0000::1 kept for pod(s) ns/w" in e for e in report.errors), report.errors
    assert report.plan_id == "m1"
    await mps.kubelet.wait_devices("nvidia.com/gpu-20gb", ["GPU-fake-0000::1"])
    await mps.kubelet.admit("ns/w", "nvidia.com/gpu-20gb")
    assert mps.kubelet.admission_errors == []


async def test_mps_daemon_supervised(mps: PluginRig):
    agent = mps.agent()
    mps.daemon.fail_with = "nvidia-cuda-mps-control: not found"
    mps.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    for _ in range(3):
        report = await agent.reconcile_once()
        await asyncio.sleep(0.05)
    assert report.plan_id is None
    assert any("MPS control daemon: nvidia-cuda-mps-control: not found" in e for e in report.errors)
    assert any(e[0] == "MpsDaemonFailed" for k, e in mps.node_api.events if k == "event")
    await mps.kubelet.wait_devices("nvidia.com/gpu-40gb", ["GPU-fake-0000::0", "GPU-fake-0000::1"])
    assert {h for _, h in mps.kubelet.plugins["nvidia.com/gpu-40gb"].devices} == {"Unhealthy"}
    assert mps.kubelet.held().get("nvidia.com/gpu-40gb") == [] and mps.node_api.allocatable.get("nvidia.com/gpu-40gb") in (None, "0")
    mps.daemon.fail_with = None
    await mps.settle(agent, "m1")
    assert mps.daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")]
    mps.daemon.die()  # it died: the next pass starts it again
    await agent.reconcile_once()
    assert mps.daemon.running and len(mps.daemon.starts) == 2


# --- 7: NVIDIA's plugin path ----------------------------------------------------------------------


async def test_nvidia_plugin_restarted_and_ack_waits_for_allocatable():
    driver = FakeNvml(H100, 1)
    node_api = FakeNodeApi("node-1")
    plugin_pods = FakePluginPods()
    node_pods = FakeNodePods()
    pods = FakePodResources()
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=pods, catalog=CATALOG, now=lambda: NOW,
                  plugin_pods=plugin_pods, node_pods=node_pods)
    node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1", "3g.40gb@4"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert plugin_pods.restarts == 1 and report.plan_id is None
    assert "NVIDIA's device plugin has not published the MIG devices yet" in node_api.annotations[STATUS_ERROR]
    await agent.reconcile_once()
    assert plugin_pods.restarts == 1  # nothing changed: not restarted again
    node_api.set_allocatable({MIG_1G: 2, "nvidia.com/mig-3g.40gb": 1})  # the new plugin, then the kubelet
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and report.errors == []
    # a bound pod's slice is kept (nothing can be withdrawn from NVIDIA's plugin)
    node_pods.bind("ns/w", {MIG_1G: 2})
    node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None,
                              "dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert [p for p, _ in driver.layout(0)] == ["1g.10gb", "1g.10gb"] and report.plan_id == "p1"
    assert plugin_pods.restarts == 2  # the 3g went: the plugin must forget it


async def test_nvidia_mode_serves_mps_nodes_with_the_agents_own_plugin(rig: PluginRig):
    """device_plugin: nvidia. On a MIG node the agent's own plugin advertises nothing and publishes
    nothing (NVIDIA's plugin serves the MIG devices; the pod restart path as above); once the node
    is an MPS node, the agent's own plugin serves its slices (NVIDIA's cannot), withdraws before
    removing, and publishes them; back to MIG, it withdraws everything."""
    plugin_pods = FakePluginPods()
    agent = rig.agent(plugin_pods=plugin_pods)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "3g.40gb@4"]}, plan="p1"))
    await agent.reconcile_once()
    assert plugin_pods.restarts == 1 and rig.plugins.servers == {} and rig.kubelet.plugins == {}
    assert rig.node_api.allocatable == {} and agent.guard.plugins is None
    for gpu in range(2):  # the node becomes an MPS node (GPUs out of MIG mode)
        for gi in rig.driver.gpu_instances(gpu):
            for ci in list(gi.compute_instances):
                rig.driver.destroy_compute_instance(gpu, gi.gi_id, ci)
            rig.driver.destroy_gpu_instance(gpu, gi.gi_id)
        rig.driver.set_mig_mode(gpu, False)
    rig.node_api.set_annotations({**mps_spec({0: [40, 40], 1: [20, 20]}, plan="m1"),
                                  "dynpart.io/spec-gpu-0-1g.10gb": None, "dynpart.io/spec-gpu-0-3g.40gb": None})
    await rig.settle(agent, "m1")
    assert rig.kubelet.plugins["nvidia.com/gpu-40gb"].ids == ["GPU-fake-0000::0", "GPU-fake-0000::1"]
    assert rig.node_api.allocatable == {"nvidia.com/gpu-20gb": "2", "nvidia.com/gpu-40gb": "2"}
    assert plugin_pods.restarts == 1 and agent.guard.plugins is rig.plugins
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-40gb": None,
                                  "dynpart.io/spec-gpu-1-20gb": None})
    await agent.reconcile_once()
    assert rig.plugins.advertised() == {}
    replay_exclusive(rig.kubelet)


async def test_without_a_manager_nothing_changes(rig: PluginRig):
    """Agent(plugins=None): today's behaviour (the ack needs no kubelet)."""
    pods = FakePodResources()
    agent = Agent("node-1", node_api=rig.node_api, driver=rig.driver, pods=pods, catalog=CATALOG, now=lambda: NOW)
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and rig.kubelet.plugins == {} and rig.node_api.allocatable == {}


def test_replay_helper_catches_double_advertising():
    k = KubeletDouble("/tmp/unused")
    k.events = [(0.0, "nvidia.com/gpu", ["GPU-1"]), (0.1, "nvidia.com/gpu-10gb", ["GPU-1::0"])]
    with pytest.raises(AssertionError, match="whole and sliced"):
        replay_exclusive(k)
    check_exclusive({"nvidia.com/gpu": [PluginDevice(id="GPU-1", kind="gpu", gpu_uuid="GPU-1", gpu_index=0)]})


async def test_run_wakes_when_the_node_publishes_the_devices():
    """NVIDIA's path in the loop: the agent waits for the node's allocatable, and the node watch
    wakes it when the allocatable changes (not the interval, not the retry)."""
    driver = FakeNvml(H100, 1)
    node_api = FakeNodeApi("node-1")
    agent = Agent("node-1", node_api=node_api, driver=driver, pods=FakePodResources(), catalog=CATALOG,
                  now=lambda: NOW, plugin_pods=FakePluginPods(), interval_s=60, retry_s=30)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="w1"))
        for _ in range(200):
            if "NVIDIA's device plugin has not published" in node_api.annotations.get(STATUS_ERROR, ""):
                break
            await asyncio.sleep(0.01)
        node_api.set_allocatable({"nvidia.com/mig-7g.80gb": 1})
        for _ in range(200):
            if node_api.annotations.get(STATUS_PLAN) == "w1":
                break
            await asyncio.sleep(0.01)
        assert node_api.annotations.get(STATUS_PLAN) == "w1"
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)


async def test_allocatable_published_again_at_once_after_a_kubelet_restart(mps: PluginRig):
    """A restarted kubelet writes the node's status at once with no device (its plugins have not
    registered again); the agent's plugins register again within a poll, and the agent publishes
    the counts again as soon as the kubelet holds the devices: not at the kubelet's next status
    write, not at the agent's next pass (interval 60 s). Never above what the kubelet holds
    (CheckedNodeApi)."""
    rig = mps
    agent = rig.agent(interval_s=60, retry_s=30)
    for _ in range(40):  # passes until the kubelet holds both GPUs and the agent published them
        await agent.reconcile_once()
        if rig.node_api.allocatable.get("nvidia.com/gpu") == "2":
            break
        await asyncio.sleep(0.05)
    assert rig.node_api.allocatable["nvidia.com/gpu"] == "2"
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.sleep(0.1)  # its first pass
        rig.kubelet.refuse_registration = True  # its device manager not ready at first
        await rig.kubelet.restart()
        rig.node_api.set_allocatable({"nvidia.com/gpu": 0})  # the kubelet's status write at its start
        await asyncio.sleep(0.3)
        assert rig.node_api.allocatable["nvidia.com/gpu"] == "0"  # it holds nothing yet: nothing published
        rig.kubelet.refuse_registration = False
        back = asyncio.get_running_loop().time()
        for _ in range(300):
            if rig.node_api.allocatable.get("nvidia.com/gpu") == "2":
                break
            await asyncio.sleep(0.01)
        took = asyncio.get_running_loop().time() - back
        assert rig.node_api.allocatable["nvidia.com/gpu"] == "2" and rig.node_api.capacity["nvidia.com/gpu"] == "2"
        assert took < 1.5, took
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_stopping_agent_publishes_zero_for_what_its_plugin_served(mps: PluginRig):
    """The plugin stops serving with the agent: the node's counts drop at once, not at the
    kubelet's next status write (up to 10 s), in which the scheduler would bind pods the kubelet
    cannot admit."""
    rig = mps
    agent = rig.agent(interval_s=60, retry_s=30)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.settle(agent, "m1")
    assert rig.node_api.allocatable == {"nvidia.com/gpu-40gb": "2", "nvidia.com/gpu": "1"}
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert rig.node_api.allocatable == {"nvidia.com/gpu-40gb": "0", "nvidia.com/gpu": "0"}


async def test_the_kubelet_is_answered_while_the_driver_creates_instances(rig: PluginRig):
    """Creating a MIG instance takes a real driver up to seconds; the plugin shares the agent's
    event loop, so the driver calls run in a thread: an Allocate meanwhile is answered at once."""
    import threading
    import time

    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    existing = rig.uuid_at(0, 0)
    slow = rig.driver.create_gpu_instance

    creating = threading.Event()
    since: list[float] = []

    def create(*args: Any) -> int:
        since.append(time.monotonic())
        creating.set()
        time.sleep(1.2)
        return slow(*args)

    rig.driver.create_gpu_instance = create  # type: ignore[method-assign]
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1", "1g.10gb@2"]}, plan="p2"))
    applying = asyncio.create_task(agent.reconcile_once())
    while not creating.is_set():
        await asyncio.sleep(0.01)
    await rig.kubelet.allocate(MIG_1G, [existing])
    waited = time.monotonic() - since[0]  # from the moment the driver started creating
    await applying
    # (blocked, it waits for both creates: 2.4 s; the margin is for a loaded machine)
    assert waited < 1.0, f"Allocate answered {waited:.2f} s after the driver started creating"
    await rig.settle(agent, "p2")


async def test_a_slow_daemon_is_not_told_to_quit_while_pods_use_slices():
    """The GPUs change (one leaves MIG mode) while pods use MPS slices, and the daemon is slow to
    answer (its control command timed out): the daemon is kept for its GPUs, never stopped for the
    new set, which would end the pods' CUDA contexts; and its GPUs go in NVML index order."""
    from dynpart.agent.mps_daemon import FakeMpsDaemon
    from dynpart.agent.mps_plugin import MpsPluginAgent

    class Slow(FakeMpsDaemon):
        stops = 0

        async def alive(self) -> bool:
            return False  # no answer in time

        async def stop(self) -> None:
            self.stops += 1
            await super().stop()

    daemon = Slow()
    agent = MpsPluginAgent(None, None, 79, daemon=daemon)  # type: ignore[arg-type]  # only the daemon is used
    agent.live = {0: {0: 10}, 1: {0: 10}}
    assert await agent._daemon({"GPU-z": 0, "GPU-a": 1}, in_use=True) == []
    assert daemon.starts == [("GPU-z", "GPU-a")]  # index order, not the UUIDs' alphabetical one
    agent.live[2] = {0: 10}
    await agent._daemon({"GPU-z": 0, "GPU-a": 1, "GPU-m": 2}, in_use=True)
    assert daemon.stops == 0 and daemon.gpus == ("GPU-z", "GPU-a")
    assert agent.uncovered == {"GPU-m"}
