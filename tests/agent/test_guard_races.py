"""The last-moment checks against what a real node does between two reads of the agent: a pod
bound while a device is being withdrawn, a whole GPU that an MPS plan slices, a pass that stops
after a withdrawal, and a node switched from MPS to MIG with slices still there. The kubelet is the
double (real gRPC on unix sockets) where admission matters, else the unserved plugin."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.guard import SliceGuard
from dynpart.agent.kube import FakePluginPods
from dynpart.agent.loop import Agent
from dynpart.agent.mig_agent import MigAgent
from dynpart.agent.podresources import FakePodResources, PodResourcesError

from .conftest import ROUND_80GIB, Rig, make_rig, mig_spec, mps_spec
from .test_agent_plugin import PluginRig, _rig, replay_exclusive

MIG_1G = "nvidia.com/mig-1g.10gb"
WHOLE = "nvidia.com/gpu"


@pytest.fixture
async def mig() -> AsyncIterator[PluginRig]:
    async for r in _rig(count=1):
        yield r


@pytest.fixture
async def mps() -> AsyncIterator[PluginRig]:
    async for r in _rig(mig_enabled=False, count=1):
        yield r


@pytest.fixture
async def mps2() -> AsyncIterator[PluginRig]:
    async for r in _rig(mig_enabled=False, count=2):
        yield r


def record_withdrawals(plugins: DevicePluginManager) -> list[tuple[str, ...]]:
    """The ids of each withdrawal the plugin manager is asked for, from now on."""
    withdraw = plugins.withdraw
    seen: list[tuple[str, ...]] = []

    async def recording(*ids: str) -> set[str]:
        seen.append(ids)
        return await withdraw(*ids)

    plugins.withdraw = recording  # type: ignore[method-assign]
    return seen


def bind_during_withdrawal(rig: PluginRig, pod: str, requests: dict[str, int]) -> list[tuple[str, ...]]:
    """The scheduler binds `pod` to the node while the agent withdraws devices (the node's
    allocatable still counted them); returns the withdrawals seen."""
    withdraw = rig.plugins.withdraw
    seen: list[tuple[str, ...]] = []

    async def binding(*ids: str) -> set[str]:
        seen.append(ids)
        if len(seen) == 1:
            rig.node_pods.bind(pod, requests)
        return await withdraw(*ids)

    rig.plugins.withdraw = binding  # type: ignore[method-assign]
    return seen


async def test_a_pod_bound_while_its_slice_is_withdrawn_keeps_it(mig: PluginRig):
    agent = mig.agent()
    mig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await mig.settle(agent, "p1")
    seen = bind_during_withdrawal(mig, "ns/late", {MIG_1G: 1})
    mig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert len(seen) == 1 and len(seen[0]) == 2  # both were on their way out when it was bound
    assert any("kept for pod(s) ns/late bound to this node and not yet admitted" in e for e in report.errors), \
        report.errors
    assert report.plan_id == "p1"
    assert len(mig.driver.layout(0)) == 1  # one 1g.10gb destroyed, the one ns/late needs kept
    kept = mig.uuid_at(0, mig.driver.layout(0)[0][1])
    assert kept not in mig.plugins.sealed and kept not in mig.plugins.withdrawn
    await mig.kubelet.wait_devices(MIG_1G, [kept])
    await mig.kubelet.admit("ns/late", MIG_1G)
    assert mig.kubelet.admission_errors == []


async def test_mps_keeps_a_whole_gpu_a_bound_pod_needs(mps: PluginRig):
    agent = mps.agent()
    await agent.reconcile_once()
    await mps.kubelet.wait_devices(WHOLE, ["GPU-fake-0000"])
    mps.node_pods.bind("ns/whole", {WHOLE: 1})  # the default scheduler saw nvidia.com/gpu: 1
    mps.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))  # and the planner sliced it
    for _ in range(3):
        report = await agent.reconcile_once()
        await asyncio.sleep(0.05)
    assert any("GPU 0 (whole) kept for pod(s) ns/whole" in e for e in report.errors), report.errors
    assert report.plan_id is None and "nvidia.com/gpu-40gb" not in mps.kubelet.held()
    await mps.kubelet.admit("ns/whole", WHOLE)
    assert mps.kubelet.admission_errors == []
    # once it runs, the GPU is held whole: still no slice on it
    mps.node_pods.remove("ns/whole")
    report = await agent.reconcile_once()
    assert any("GPU 0 is held whole by ns/whole" in e for e in report.errors), report.errors
    assert not mps.kubelet.held().get("nvidia.com/gpu-40gb")
    replay_exclusive(mps.kubelet)


async def test_mps_withdraws_a_whole_gpu_before_slicing_it(mps: PluginRig):
    agent = mps.agent()
    await agent.reconcile_once()
    await mps.kubelet.wait_devices(WHOLE, ["GPU-fake-0000"])
    seen = bind_during_withdrawal(mps, "ns/whole", {WHOLE: 1})
    mps.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    report = await agent.reconcile_once()
    # bound while the whole GPU was being withdrawn: it stays whole for the pod
    assert seen == [("GPU-fake-0000",)]
    assert any("GPU 0 (whole) kept for pod(s) ns/whole" in e for e in report.errors), report.errors
    await mps.kubelet.wait_devices(WHOLE, ["GPU-fake-0000"])
    await mps.kubelet.admit("ns/whole", WHOLE)
    assert mps.kubelet.admission_errors == [] and not mps.kubelet.held().get("nvidia.com/gpu-40gb")


async def test_mps_slices_a_free_whole_gpu_after_withdrawing_it(mps: PluginRig):
    agent = mps.agent()
    await agent.reconcile_once()
    await mps.kubelet.wait_devices(WHOLE, ["GPU-fake-0000"])
    seen = record_withdrawals(mps.plugins)
    mps.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await mps.settle(agent, "m1")
    assert seen == [("GPU-fake-0000",)]
    held = mps.kubelet.held()
    assert not held.get(WHOLE) and sorted(held["nvidia.com/gpu-40gb"]) == ["GPU-fake-0000::0", "GPU-fake-0000::1"]
    replay_exclusive(mps.kubelet)


async def test_a_whole_gpu_taken_during_its_withdrawal_is_not_sliced():
    rig = make_rig(count=1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent(withdraw_settle_s=0)
    await agent.reconcile_once()
    uuid = rig.driver.devices()[0].uuid
    assert rig.plugins is not None
    withdraw = rig.plugins.withdraw

    async def taken(*ids: str) -> set[str]:
        unconfirmed = await withdraw(*ids)
        rig.pods.assign("ns/whole", WHOLE, uuid)  # admitted with the device the kubelet chose before
        return unconfirmed

    rig.plugins.withdraw = taken  # type: ignore[method-assign]
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    report = await agent.reconcile_once()
    assert any("GPU 0 (whole) was taken (pod ns/whole)" in e for e in report.errors), report.errors
    assert report.plan_id is None
    advertised = {r: [d.id for d in ds] for r, ds in rig.plugins.advertised().items()}
    assert advertised.get(WHOLE) == [uuid] and not advertised.get("nvidia.com/gpu-40gb")
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()


async def two_slices(rig: Rig) -> tuple[Agent, str]:
    """An agent that applied 1g.10gb@0 and 1g.10gb@1 (plan p1); returns it and the second's id."""
    agent = rig.agent(withdraw_settle_s=0)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    for _ in range(3):
        report = await agent.reconcile_once()
    assert report.plan_id == "p1", report.errors
    return agent, next(g.uuid for g in rig.driver.gpu_instances(0) if g.start == 1 and g.uuid)


async def test_a_pass_stopped_after_a_withdrawal_leaves_nothing_hidden():
    rig = make_rig(count=1).with_plugins()
    agent, target = await two_slices(rig)
    first = rig.pods.calls + 1

    def kubelet_restarts(n: int) -> None:
        # the re-check after the withdrawal answers; the read right before the destroy does not
        if n == first + 2:
            raise PodResourcesError("kubelet PodResources API: UNAVAILABLE (kubelet restarting)")

    rig.pods.on_list = kubelet_restarts
    rig.node_api.set_annotations({**mig_spec({0: ["1g.10gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": "1@0"})
    report = await agent.reconcile_once()
    assert report.failed and target in rig.plugins.sealed  # stopped between the seal and the destroy
    assert len(rig.driver.layout(0)) == 2
    # the planner revokes p2 and plans both slices again: the slice is advertised again, not sealed
    rig.pods.on_list = None
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p3"))
    report = await agent.reconcile_once()
    assert report.plan_id == "p3", report.errors
    assert target in [d.id for d in rig.plugins.advertised()[MIG_1G]]
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()


async def test_a_stopped_pass_whose_destroy_happened_does_not_advertise_it_again():
    rig = make_rig(count=1).with_plugins()
    agent, target = await two_slices(rig)
    destroy = rig.driver.destroy_gpu_instance

    def destroyed_then_lost(gpu: int, gi: int) -> None:
        destroy(gpu, gi)
        raise PodResourcesError("kubelet PodResources API: UNAVAILABLE (after the destroy)")

    rig.driver.destroy_gpu_instance = destroyed_then_lost  # type: ignore[method-assign]
    rig.node_api.set_annotations({**mig_spec({0: ["1g.10gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": "1@0"})
    report = await agent.reconcile_once()
    assert report.failed and rig.driver.layout(0) == [("1g.10gb", 0)]
    rig.driver.destroy_gpu_instance = destroy  # type: ignore[method-assign]
    report = await agent.reconcile_once()
    assert report.plan_id == "p2", report.errors
    assert target not in [d.id for ds in rig.plugins.advertised().values() for d in ds]
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()


async def test_the_guard_seals_before_it_readmits():
    rig = make_rig(count=1).with_plugins()
    assert rig.plugins is not None
    pods = FakePodResources()
    order: list[str] = []
    seal, readmit = rig.plugins.seal, rig.plugins.readmit

    def sealing(*ids: str) -> None:
        order.append("seal")
        seal(*ids)

    async def readmitting(*ids: str) -> None:
        order.append("readmit")
        await readmit(*ids)

    rig.plugins.seal = sealing  # type: ignore[method-assign]
    rig.plugins.readmit = readmitting  # type: ignore[method-assign]
    pods.assign("ns/a", MIG_1G, "MIG-a")
    guard = SliceGuard(pods, None, rig.plugins, settle_s=0)
    out = await guard.release({"MIG-a": MIG_1G, "MIG-b": MIG_1G})
    assert out.in_use == {"MIG-a": ["pod ns/a"]} and out.destroyable == ["MIG-b"]
    assert order == ["seal", "readmit"]


async def test_leaving_mps_mode_keeps_used_slices_and_their_daemon(mps: PluginRig):
    rig = mps
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.settle(agent, "m1")
    await rig.kubelet.admit("ns/a", "nvidia.com/gpu-40gb")
    starts = list(rig.daemon.starts)
    # the node is switched to MIG while ns/a runs on one slice, and ns/w is bound for the other
    rig.node_pods.bind("ns/w", {"nvidia.com/gpu-40gb": 1})
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-40gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "m1"
    assert any("MPS slice GPU-fake-0000::" in e and "kept for pod(s) ns/w" in e for e in report.errors), report.errors
    assert any("MIG mode is disabled and the GPU is in use (" in e and "MPS slice 40gb" in e for e in report.errors), \
        report.errors
    assert not rig.driver.devices()[0].mig_current and rig.driver.layout(0) == []
    assert rig.daemon.running and rig.daemon.starts == starts  # not restarted under ns/a
    await rig.kubelet.admit("ns/w", "nvidia.com/gpu-40gb")
    assert rig.kubelet.admission_errors == []
    # both pods end: the slices go, MIG mode is enabled, the plan is applied
    rig.node_pods.remove("ns/w")
    rig.kubelet.release("ns/a")
    rig.kubelet.release("ns/w")
    await rig.settle(agent, "p2")
    assert rig.driver.devices()[0].mig_current and rig.driver.layout(0) == [("7g.80gb", 0)]
    assert not rig.kubelet.held().get("nvidia.com/gpu-40gb")
    replay_exclusive(rig.kubelet)


async def test_a_gpu_entering_mig_mode_does_not_restart_the_daemon_under_running_pods(mps2: PluginRig):
    rig = mps2
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40]}, plan="m1"))
    await rig.settle(agent, "m1")
    response = await rig.kubelet.admit("ns/a", "nvidia.com/gpu-40gb")
    gpu = dict(response.container_responses[0].envs)["NVIDIA_VISIBLE_DEVICES"]
    other = 1 - int(gpu[-1])  # GPU-fake-000N
    starts = list(rig.daemon.starts)
    rig.node_api.set_annotations({**mig_spec({other: ["7g.80gb@0"]}, plan="p2"),
                                  f"dynpart.io/spec-gpu-{other}-40gb": None, f"dynpart.io/spec-gpu-{1 - other}-40gb": None})
    await rig.settle(agent, "p2")
    assert rig.driver.devices()[other].mig_current and rig.driver.layout(other) == [("7g.80gb", 0)]
    # the daemon still runs for both GPUs: restarting it for the one left would end ns/a's context
    assert rig.daemon.running and rig.daemon.starts == starts
    rig.kubelet.release("ns/a")
    for _ in range(3):
        await agent.reconcile_once()
    assert not rig.kubelet.held().get("nvidia.com/gpu-40gb")
    assert not rig.daemon.running  # no slice left on a MIG node: stopped


async def test_with_nvidias_plugin_leaving_mps_mode_still_withdraws_and_rechecks():
    """device_plugin: nvidia serves MIG nodes, the agent's own plugin MPS nodes: a node switched
    to MIG still has MPS slices the agent's plugin lists; they go through the same guard, and
    only their counts are published (NVIDIA's plugin publishes its own resources)."""
    rig = make_rig(count=1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(withdraw_settle_s=0.05, plugin_pods=FakePluginPods())
    rig.node_api.set_annotations(mps_spec({0: [10, 10]}, plan="m1"))
    report = await agent.reconcile_once()
    assert report.plan_id == "m1", report.errors
    ids = sorted(d.id for ds in rig.plugins.advertised().values() for d in ds)
    seen = record_withdrawals(rig.plugins)
    rig.plugins.allocated[ids[0]] = time.monotonic()  # the kubelet has just admitted a pod onto it
    rig.node_api.allocatable["nvidia.com/mig-1g.10gb"] = "3"  # what NVIDIA's plugin publishes
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-10gb": None})
    report = await agent.reconcile_once()
    assert seen == [tuple(ids)]
    assert any(f"MPS slice {ids[0]} was taken (a kubelet Allocate call)" in e for e in report.errors), report.errors
    assert rig.driver.layout(0) == [] and not rig.driver.devices()[0].mig_current
    assert [d.id for d in rig.plugins.advertised()["nvidia.com/gpu-10gb"]] == [ids[0]]  # still served
    assert rig.node_api.allocatable["nvidia.com/mig-1g.10gb"] == "3"  # NVIDIA's count left alone
    assert rig.node_api.allocatable["nvidia.com/gpu-10gb"] == "1"


async def test_leftovers_of_a_stopped_switch_pass_are_not_advertised_again(monkeypatch):
    """NVIDIA's plugin serves MIG nodes: a node switched from MPS removes its free MPS slices
    (guarded), then the MIG part of the pass stops (PodResources unavailable). The next pass must
    not advertise those slices again: they are gone from the node's MPS configuration."""
    rig = make_rig(count=1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(withdraw_settle_s=0, plugin_pods=FakePluginPods())
    rig.node_api.set_annotations(mps_spec({0: [10, 10]}, plan="m1"))
    assert (await agent.reconcile_once()).plan_id == "m1"
    apply = MigAgent.apply
    failing = [True]

    async def flaky(self: MigAgent, *args: Any, **kw: Any) -> Any:
        if failing[0]:
            raise PodResourcesError("kubelet PodResources API: UNAVAILABLE (kubelet restarting)")
        return await apply(self, *args, **kw)

    monkeypatch.setattr(MigAgent, "apply", flaky)
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-10gb": None})
    assert (await agent.reconcile_once()).failed
    assert (await agent.reconcile_once()).failed
    assert not any(rig.plugins.advertised().values()) and rig.plugins.withdrawn == set()
    failing[0] = False
    await agent.reconcile_once()
    assert not any(rig.plugins.advertised().values())


async def _gpu_joining_under_a_pod(rig: PluginRig) -> Any:
    """An agent whose plan m1 put two 40gb slices on GPU 0 (GPU 1 in MIG mode), one used by ns/a;
    then GPU 1 leaves MIG mode and plan m2 asks for two 40gb slices there too."""
    rig.driver.set_mig_mode(1, True)
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.settle(agent, "m1")
    await rig.kubelet.admit("ns/a", "nvidia.com/gpu-40gb")
    rig.driver.set_mig_mode(1, False)
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40]}, plan="m2"))
    return agent


async def test_a_gpu_joining_under_running_mps_pods_is_listed_unhealthy_until_the_daemon_restarts(mps2: PluginRig):
    """GPU 1 of an MPS node leaves MIG mode (an operator's reset) while a pod uses a slice of GPU 0:
    the daemon is not restarted under that pod, so GPU 1's new slices, which it does not serve,
    are listed Unhealthy (no pod gets one) until the pod ends and the daemon runs for both."""
    rig = mps2
    agent = await _gpu_joining_under_a_pod(rig)
    report = await agent.reconcile_once()
    assert any("the slices of GPU-fake-0001 are listed Unhealthy" in e for e in report.errors), report.errors
    assert rig.daemon.gpus == ("GPU-fake-0000",)
    health = {d.id: d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"]}
    assert health == {"GPU-fake-0000::0": True, "GPU-fake-0000::1": True,
                      "GPU-fake-0001::0": False, "GPU-fake-0001::1": False}
    rig.kubelet.release("ns/a")
    await rig.settle(agent, "m2")
    assert rig.daemon.gpus == ("GPU-fake-0000", "GPU-fake-0001")
    assert all(d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"])


async def test_a_slice_the_kubelet_still_lists_after_the_wait_is_kept(mig: PluginRig):
    """A loaded kubelet reads the shorter list later than the plugin waits for it: until it did,
    it can still give the device to a pod, so the device is neither sealed nor destroyed."""
    agent = mig.agent()
    mig.plugins.confirm_timeout_s = 0.3
    mig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await mig.settle(agent, "p1")
    both = {mig.uuid_at(0, 0), mig.uuid_at(0, 1)}
    mig.kubelet.receive_delay_s[MIG_1G] = 1.5  # it processes this plugin's next list late
    mig.node_api.set_annotations({**mig_spec({0: ["1g.10gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert any("the kubelet still listed it when the wait ran out" in e for e in report.errors), report.errors
    assert report.plan_id == "p1"
    assert len(mig.driver.layout(0)) == 2 and not mig.plugins.sealed
    # what it still held is still served: the pod it gives it to is admitted
    await mig.kubelet.admit("ns/a", MIG_1G)
    await mig.kubelet.admit("ns/b", MIG_1G)
    assert mig.kubelet.admission_errors == [] and set(mig.kubelet.held()[MIG_1G]) == both


async def test_a_slice_a_starting_pods_init_container_holds_is_kept(mig: PluginRig):
    """PodResources List leaves out plain init containers: the device one holds looks free. While
    the pod starts, no device of that resource goes."""
    agent = mig.agent()
    mig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await mig.settle(agent, "p1")
    await mig.kubelet.admit("ns/init", MIG_1G, container="setup", plain_init=True)
    held = mig.kubelet.assignments[0].ids[0]
    mig.node_pods.bind("ns/init", {MIG_1G: 1}, init_only=frozenset({MIG_1G}))
    mig.node_api.set_annotations({**mig_spec({0: ["2g.20gb@2"]}, plan="p2"), "dynpart.io/spec-gpu-0-1g.10gb": None})
    report = await agent.reconcile_once()
    assert any("an init container may use" in e for e in report.errors), report.errors
    assert held in {mig.uuid_at(0, start) for _, start in mig.driver.layout(0) if start in (0, 1)}
    # started: its containers run, the init container is done; the plan goes ahead
    mig.kubelet.release("ns/init")
    mig.node_pods.remove("ns/init")
    await mig.settle(agent, "p2")


async def test_a_plan_whose_slices_the_daemon_does_not_serve_is_not_acknowledged_as_free(mps2: PluginRig):
    """GPU 1 leaves MIG mode while a pod uses a slice of GPU 0: the daemon is kept for GPU 0 only,
    so GPU 1's new slices are listed Unhealthy (the kubelet gives them to no pod). A plan made of
    them is then not held by the node as the planner sees it: it must not be acknowledged with
    those slices reported free and GPU 1 healthy (the planner would put pods on slices no pod can
    get, for as long as the pod on GPU 0 runs)."""
    from dynpart.annotations import STATUS_PLAN, STATUS_UNHEALTHY

    rig = mps2
    agent = await _gpu_joining_under_a_pod(rig)
    for _ in range(5):
        report = await agent.reconcile_once()
        await asyncio.sleep(0.05)
    health = {d.id: d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"]}
    assert health["GPU-fake-0001::0"] is False and health["GPU-fake-0001::1"] is False  # as designed
    status = rig.node_api.annotations
    acked_as_free = (status.get(STATUS_PLAN) == "m2" and status.get("dynpart.io/status-gpu-1-40gb-free") == "2"
                     and "1" not in (status.get(STATUS_UNHEALTHY) or "").split(","))
    assert not acked_as_free, (f"plan m2 acknowledged, GPU 1's two 40gb slices reported free and GPU 1 healthy, "
                               f"while the plugin lists them Unhealthy: {report.status}")
