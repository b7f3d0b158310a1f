"""The e2e kubelet model and the NVIDIA plugin model on their own (no API server, a few seconds):
the agent's device plugin (`DevicePluginManager`) and the agent's PodResources client
(`KubeletPodResources`) against the model, over real unix sockets."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from typing import Any

import grpc
import pytest

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import GpuView, MigDeviceView, PluginDevice, advertise
from dynpart.agent.deviceplugin.server import DevicePluginManager, PluginServer
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import GpuDriverError
from dynpart.agent.guard import SliceGuard
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import KubeletPodResources
from dynpart.catalog import default_catalog
from tests.e2e.kubelet_model import KubeletModel, podresources_messages
from tests.e2e.nvidia_plugin_model import NvidiaPluginModel, enumerate_devices

H100 = default_catalog().resolve("H100-80GB")
MIG1 = "nvidia.com/mig-1g.10gb"
MPS10 = "nvidia.com/gpu-10gb"


def carve(driver: FakeNvml, gpu: int, *profiles: tuple[str, int]) -> list[str]:
    by_name = {p.name: p for p in driver.model.mig_profiles}
    for name, start in profiles:
        p = by_name[name]
        gi = driver.create_gpu_instance(gpu, p.gi_profile_id, start, p.memory)
        driver.create_compute_instance(gpu, gi, p.compute)
    return [g.uuid for g in driver.gpu_instances(gpu) if g.uuid]


def views(driver: FakeNvml, mps: dict[int, tuple[int, ...]] | None = None) -> list[GpuView]:
    """What the agent would hand its plugin: the driver's GPUs, MPS slices where given."""
    by_id = {p.gi_profile_id: p.name for p in driver.model.mig_profiles}
    out = []
    for d in driver.devices():
        mig = tuple(MigDeviceView(by_id[g.profile_id], g.uuid) for g in driver.gpu_instances(d.index)) \
            if d.mig_current else ()
        out.append(GpuView(d.index, d.uuid, 80, mig_enabled=d.mig_current, mig=mig, mps=(mps or {}).get(d.index, ())))
    return out


def pod(name: str, resource: str, count: int = 1, uid: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid or name},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {resource: str(count)}}}]}}


@pytest.fixture
def root():
    d = tempfile.mkdtemp(prefix="km-", dir="/tmp")  # short: unix socket paths fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def driver():
    d = FakeNvml(H100, 2, mig_enabled=True)
    d.set_mig_mode(1, False)
    return d


@pytest.fixture
async def kubelet(root, driver):
    k = KubeletModel("node-a", root, driver=driver, container_start_s=0)
    await k.start()
    yield k
    await k.close()


async def test_admission_through_the_agents_plugin(kubelet: KubeletModel, driver: FakeNvml):
    carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver, {1: (10, 20, 10)})))
        for r in (MIG1, "nvidia.com/mig-3g.40gb", "nvidia.com/gpu-10gb", "nvidia.com/gpu-20gb"):
            await kubelet.wait_registered(r)
        assert kubelet.capacity()[1] == {MIG1: 2, "nvidia.com/mig-3g.40gb": 1, "nvidia.com/gpu-10gb": 2,
                                         "nvidia.com/gpu-20gb": 1}

        assert await kubelet.admit_pod(pod("a", MIG1)) and await kubelet.admit_pod(pod("b", MIG1))
        assert not await kubelet.admit_pod(pod("c", MIG1))  # no healthy free device
        key, reason, message = kubelet.admission_failures[0]
        assert (key, reason) == ("ns/c", "UnexpectedAdmissionError")
        assert "requested number of devices unavailable for nvidia.com/mig-1g.10gb. Requested: 1, Available: 0" in message
        assert await kubelet.admit_pod(pod("d", "nvidia.com/mig-7g.80gb"))  # not a plugin resource: admitted
        assert kubelet.admitted_without_devices == ["ns/d: asked for 1 nvidia.com/mig-7g.80gb, got 0 (not a "
                                                    "device-plugin resource of this kubelet)"]
        await asyncio.sleep(0.05)  # the containers start

        # a MIG pod runs a process on its instance: the fake driver refuses to destroy it
        held = kubelet.holdings["ns/a"][0]
        assert held.pid in driver.processes(0, held.gi_id)
        with pytest.raises(GpuDriverError):
            driver.destroy_compute_instance(0, held.gi_id, 0)
        # GetPreferredAllocation was asked (the plugin registered with it), then Allocate
        assert all(a.preferred is not None for a in kubelet.allocations)

        # MPS: the slice's memory limit in the Allocate response
        assert await kubelet.admit_pod(pod("m", "nvidia.com/gpu-20gb"))
        mps = kubelet.allocations[-1]
        assert mps.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20G", mps.envs
        assert mps.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-fake-0001", mps.envs
        assert mps.device_ids == ["GPU-fake-0001::1"]

        # the agent's real PodResources client
        pr = KubeletPodResources(kubelet.podresources_socket)
        assigned = {(a.pod, a.resource, a.device_id) for a in await pr.list()}
        assert {(p, r) for p, r, _ in assigned} == {("ns/a", MIG1), ("ns/b", MIG1), ("ns/m", "nvidia.com/gpu-20gb")}
        allocatable = await pr.allocatable()
        assert sorted(allocatable[MIG1]) == sorted(kubelet.resources[MIG1].healthy)
        assert len(allocatable["nvidia.com/gpu-10gb"]) == 2

        # deleting a pod frees its device and its process
        kubelet._forget("ns/a", "a")
        assert driver.processes(0, held.gi_id) == []
        assert await kubelet.admit_pod(pod("c2", MIG1))
        assert kubelet.exclusive_violations == []
        assert all(m.node_lists for m in kubelet.messages)


async def test_an_init_containers_devices_are_reused_then_kept_unlisted_until_the_pod_ends(kubelet: KubeletModel,
                                                                                          driver: FakeNvml):
    """devicemanager: a plain init container is allocated first and the app container reuses its
    devices; the one the app container did not reuse stays allocated to the pod, unlisted by
    PodResources, until the pod is gone. The agent's guard, reading this kubelet through its real
    PodResources client, keeps the device a pod bound and not yet admitted will get, and the one
    the init container keeps (which one that is it cannot tell: every device of the resource
    stays while the pod runs)."""
    devices = carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver)))
        await kubelet.wait_registered(MIG1)
        starting = pod("r", MIG1)
        starting["spec"]["initContainers"] = [{"name": "fetch", "resources": {"limits": {MIG1: "2"}}}]
        assert await kubelet.admit_pod(starting)
        given = {a.container: a.device_ids for a in kubelet.allocations if a.pod == "ns/r"}
        assert len(given["fetch"]) == 2 and set(given["main"]) < set(given["fetch"])  # reused
        await asyncio.sleep(0.05)  # the containers start
        pr = KubeletPodResources(kubelet.podresources_socket)
        assert [a.device_id for a in await pr.list()] == given["main"]
        assert kubelet.allocated(MIG1) == set(given["fetch"])
        (hidden,) = set(given["fetch"]) - set(given["main"])
        (spare,) = set(devices) - set(given["fetch"])

        # the agent wants the spare gone while ns/w, bound for one device, is not admitted yet
        node_pods = FakeNodePods()
        node_pods.bind("ns/r", {MIG1: 2}, "Running", frozenset({MIG1}))
        node_pods.bind("ns/w", {MIG1: 1})
        looks_free = [d for d in devices if d not in given["main"]]
        assert sorted(looks_free) == sorted([hidden, spare])
        kept = await SliceGuard(pr, node_pods).keep({spare: MIG1}, {MIG1: looks_free})
        assert list(kept) == [spare], kept
        node_pods.remove("ns/w")
        kept = await SliceGuard(pr, node_pods).keep({hidden: MIG1, spare: MIG1}, {MIG1: looks_free})
        assert sorted(kept) == sorted([hidden, spare]) and "ns/r run" in kept[hidden], kept
        node_pods.bind("ns/w", {MIG1: 1})
        # and that is the one the kubelet gives it
        assert await kubelet.admit_pod(pod("w", MIG1))
        assert kubelet.allocations[-1].device_ids == [spare]

        # the pod ends: what its init container held is free again
        kubelet._forget("ns/r", "r")
        assert kubelet.allocated(MIG1) == {spare}
        assert kubelet.used_withdrawn == [] and kubelet.exclusive_violations == []


async def test_withdrawn_and_stopped_resources(kubelet: KubeletModel, driver: FakeNvml):
    uuids = carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver)))
        await kubelet.wait_devices(MIG1, uuids)  # (in GPU-instance order, as advertised)
        await plugins.withdraw(uuids[0])  # written to the kubelet's stream before withdraw returns,
        # read by the kubelet a moment later (its stream is its own task, as in the real kubelet)
        await kubelet.wait_for(lambda: kubelet.resources[MIG1].healthy == {uuids[1]})
        assert await kubelet.admit_pod(pod("a", MIG1)) and kubelet.allocations[-1].device_ids == [uuids[1]]
        assert not await kubelet.admit_pod(pod("b", MIG1))
        await plugins.update({})  # the resource goes away: its list emptied, its server stopped
        await kubelet.wait_for(lambda: kubelet.plugins[MIG1].stream_task.done())
        cap, alloc, removed = kubelet.capacity()
        assert alloc[MIG1] == 0 and removed == []
        kubelet.endpoint_grace_s = 0
        await asyncio.sleep(0.01)
        assert sorted(kubelet.capacity()[2]) == ["nvidia.com/gpu", MIG1]  # after the grace period: capacity 0


async def test_restart_re_registration_and_checkpoint(kubelet: KubeletModel, driver: FakeNvml):
    carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver)))
        await kubelet.wait_registered(MIG1)
        assert await kubelet.admit_pod(pod("a", MIG1))
        before = kubelet.capacity()[1]
        back = await kubelet.restart()
        assert kubelet.capacity()[1] == {MIG1: 0, "nvidia.com/gpu": 0}  # from the checkpoint, no device yet
        await kubelet.wait_for(lambda: kubelet.capacity()[1] == before, timeout_s=2)
        again = [t for r, t in plugins.registrations if r == MIG1 and t >= back]
        assert again and again[0] - back < 2.0, (back, plugins.registrations)
        assert [a.pod for a in await KubeletPodResources(kubelet.podresources_socket).list()] == ["ns/a"]
        assert await kubelet.admit_pod(pod("b", MIG1))  # the other device
        assert not await kubelet.admit_pod(pod("c", MIG1))  # the checkpointed pod kept its device


def held(kubelet: KubeletModel) -> dict[str, list[tuple[str, int | None]]]:
    """Pod -> (device, pid of its fake process) for each device it holds."""
    return {k: [(h.device, h.pid) for h in hs] for k, hs in kubelet.holdings.items()}


async def listed(pr: KubeletPodResources) -> list[tuple[str, str, str]]:
    return sorted((a.pod, a.resource, a.device_id) for a in await pr.list())


async def run_init_and_late(kubelet: KubeletModel, driver: FakeNvml, plugins: DevicePluginManager,
                            late_start_s: float) -> None:
    """Three pods on MIG1: ns/run running, ns/init running after its plain init container (which
    held a device) ended, ns/late admitted with its container starting `late_start_s` later."""
    await plugins.update(advertise(views(driver)))
    await kubelet.wait_registered(MIG1)
    starting = pod("init", MIG1)
    starting["spec"]["initContainers"] = [{"name": "fetch", "resources": {"limits": {MIG1: "1"}}}]
    assert await kubelet.admit_pod(pod("run", MIG1)) and await kubelet.admit_pod(starting)
    await asyncio.sleep(0.05)  # the containers start
    kubelet.container_start_s = late_start_s
    assert await kubelet.admit_pod(pod("late", MIG1))


async def test_running_pods_keep_their_devices_through_a_kubelet_restart(kubelet: KubeletModel, driver: FakeNvml):
    """A restart admits every pod again (kubelet 1.35 HandlePodAdditions). A container the runtime
    reports running keeps the devices its checkpoint gives it, unchecked: the MIG pod and the MPS
    pod survive though the agent's plugin registers again only after that, and no Allocate is made
    again. Until the sync loop handled its first pod list, the new kubelet's PodResources lists no
    pod (its pod manager is empty)."""
    uuids = carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver, {1: (10, 10)})))
        await kubelet.wait_registered(MIG1)
        await kubelet.wait_registered(MPS10)
        assert await kubelet.admit_pod(pod("m", MIG1)) and await kubelet.admit_pod(pod("s", MPS10))
        await asyncio.sleep(0.05)  # the containers start
        pr = KubeletPodResources(kubelet.podresources_socket)
        before, pids, calls = await listed(pr), held(kubelet), len(kubelet.allocations)
        assert [p for p, _, _ in before] == ["ns/m", "ns/s"] and pids["ns/m"][0][1] is not None  # (MPS: no process)
        kubelet.readmit_after_s = 0.5  # the sync loop's first pod list, 0.5 s after the new kubelet.sock
        kubelet.refuse_registration = True  # the plugins register again only after it
        await kubelet.restart()
        assert await pr.list() == []  # no pod known yet
        await kubelet.wait_for(lambda: bool(kubelet.readmissions), timeout_s=2)
        assert kubelet.admission_failures == [] and not any(kubelet.capacity()[1].values())  # no device yet
        assert await listed(pr) == before and await pr.allocatable() == {}
        kubelet.refuse_registration = False
        await kubelet.wait_for(lambda: kubelet.capacity()[1] == {MIG1: 2, MPS10: 2}, timeout_s=2)
        assert await listed(pr) == before and held(kubelet) == pids and len(kubelet.allocations) == calls
        (m_gi,) = [h.gi_id for h in kubelet.holdings["ns/m"]]
        assert driver.processes(0, m_gi) == [pids["ns/m"][0][1]]  # its container was not stopped
        assert await kubelet.admit_pod(pod("n", MIG1))  # the other instance
        assert kubelet.allocations[-1].device_ids == [u for u in uuids if u != before[0][2]]
        assert not await kubelet.admit_pod(pod("o", MIG1))  # ns/m kept its instance
        assert kubelet.exclusive_violations == []


async def test_a_kubelet_restart_fails_the_pods_whose_containers_were_not_running(kubelet: KubeletModel,
                                                                                  driver: FakeNvml):
    """A container not running when the kubelet starts (a plain init container that ended, one not
    started yet) must find the devices its checkpoint gives it healthy. Before its plugin
    registered again there is none: the pod fails with UnexpectedAdmissionError (kubelet 1.35
    devicesToAllocate; kubernetes#118559), its containers are stopped and its devices are free
    again. The running pod keeps its own."""
    uuids = carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await run_init_and_late(kubelet, driver, plugins, late_start_s=0.3)  # late: not started at the restart
        pr = KubeletPodResources(kubelet.podresources_socket)
        before = await listed(pr)
        (init_gi,) = [h.gi_id for h in kubelet.holdings["ns/init"]]
        assert driver.processes(0, init_gi)
        kubelet.refuse_registration = True
        await kubelet.restart()
        why = f"Allocate failed due to no healthy devices present; cannot allocate unhealthy devices {MIG1}, which is unexpected"
        assert kubelet.admission_failures == [("ns/init", "UnexpectedAdmissionError", why),
                                              ("ns/late", "UnexpectedAdmissionError", why)]
        assert await listed(pr) == [a for a in before if a[0] == "ns/run"]
        assert driver.processes(0, init_gi) == [] and list(kubelet.holdings) == ["ns/run"]
        await asyncio.sleep(0.35)
        assert list(kubelet.holdings) == ["ns/run"] and kubelet.pods["ns/run"].phase == "Running"  # late never starts
        kubelet.refuse_registration = False
        await kubelet.wait_for(lambda: kubelet.resources[MIG1].healthy == set(uuids), timeout_s=2)
        assert await kubelet.admit_pod(pod("a", MIG1)) and await kubelet.admit_pod(pod("b", MIG1))  # freed
        assert not await kubelet.admit_pod(pod("c", MIG1))


async def test_a_restart_after_the_plugin_registered_again_checks_containers_not_running(kubelet: KubeletModel,
                                                                                           driver: FakeNvml):
    """The other order: the plugin registered again before the first pod list. A container not
    running needs its checkpointed devices listed healthy: the pod whose ended init container's
    device is still advertised is admitted again, the one not started whose device left the list
    fails; a running container is not checked (its device left the list too: kept)."""
    carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await run_init_and_late(kubelet, driver, plugins, late_start_s=5)
        pr = KubeletPodResources(kubelet.podresources_socket)
        before = await listed(pr)
        by_pod = {p: d for p, _, d in before}
        await plugins.withdraw(by_pod["ns/run"], by_pod["ns/late"])
        kubelet.readmit_after_s = 1.0
        back = await kubelet.restart()
        await kubelet.wait_for(lambda: kubelet.resources[MIG1].healthy == {by_pod["ns/init"]}, timeout_s=2)
        registered_at = time.monotonic()  # registered again first
        await kubelet.wait_for(lambda: bool(kubelet.admission_failures), timeout_s=2)
        assert kubelet.readmissions[0] - back >= 1.0 and kubelet.readmissions[0] > registered_at
        why = (f"Allocate failed due to previously allocated devices are no longer healthy; cannot allocate unhealthy "
               f"devices {MIG1}, which is unexpected")
        assert kubelet.admission_failures == [("ns/late", "UnexpectedAdmissionError", why)]
        assert await listed(pr) == [a for a in before if a[0] != "ns/late"]


async def test_the_agents_guard_keeps_a_running_pods_device_the_restarted_kubelet_does_not_list_yet(
        kubelet: KubeletModel, driver: FakeNvml):
    """Between a kubelet restart and its first pod list, PodResources lists no pod: a running
    pod's MIG instance looks free. The agent's guard, asked before a destroy, keeps every device of
    the resource while the API server says a pod that asked for it runs here unlisted; once the
    pod is listed again, only its own device stays."""
    carve(driver, 0, ("1g.10gb", 0), ("1g.10gb", 1))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver)))
        await kubelet.wait_registered(MIG1)
        assert await kubelet.admit_pod(pod("m", MIG1))
        await asyncio.sleep(0.05)  # its container starts
        pr = KubeletPodResources(kubelet.podresources_socket)
        (mine,) = [a.device_id for a in await pr.list()]
        (other,) = [u for u in (d.id for d in plugins.advertised()[MIG1]) if u != mine]
        node_pods = FakeNodePods()
        node_pods.bind("ns/m", {MIG1: 1}, phase="Running")  # what the API server says
        guard = SliceGuard(pr, node_pods)
        free = {MIG1: [mine, other]}
        assert list(await guard.keep({mine: MIG1, other: MIG1}, free)) == []  # listed: neither is kept for it
        kubelet.readmit_after_s = 1.0
        await kubelet.restart()
        assert await pr.list() == []  # the window: the pod looks gone
        kept = await guard.keep({mine: MIG1, other: MIG1}, free)
        assert sorted(kept) == sorted([mine, other]) and "ns/m" in kept[mine]
        await kubelet.wait_for(lambda: bool(kubelet.readmissions), timeout_s=3)
        assert [a.device_id for a in await pr.list()] == [mine]
        assert await guard.keep({other: MIG1}, free) == {}


async def test_an_admission_in_flight_at_a_restart_ends_with_the_old_kubelet(kubelet: KubeletModel,
                                                                             driver: FakeNvml):
    """v1.35: a restart ends the old kubelet's admission; the new kubelet's pod manager is empty
    until the first pod list (PodResources lists no pod), which admits that pod again like any
    other: its container is not running, so with its plugin not registered again it fails with
    UnexpectedAdmissionError (what the old Allocate returned is in no checkpoint)."""
    carve(driver, 0, ("1g.10gb", 0))
    async with DevicePluginManager(kubelet.plugin_dir, poll_s=0.05) as plugins:
        await plugins.update(advertise(views(driver)))
        await kubelet.wait_registered(MIG1)
        msgs = protocol.messages()

        async def slow_allocate(resource, *containers):  # an Allocate RPC that takes 0.3 s
            await asyncio.sleep(0.3)
            return msgs["AllocateResponse"](container_responses=[msgs["ContainerAllocateResponse"]()])

        kubelet.allocate = slow_allocate
        admission = asyncio.create_task(kubelet.admit_pod(pod("f", MIG1)))
        await asyncio.sleep(0.1)  # inside Allocate
        kubelet.readmit_after_s = 1.0
        kubelet.refuse_registration = True
        await kubelet.restart()
        assert await admission is False  # ended with the old kubelet
        await asyncio.sleep(0.1)
        pr = KubeletPodResources(kubelet.podresources_socket)
        assert await pr.list() == []  # before the first pod list: no pod known
        await kubelet.wait_for(lambda: bool(kubelet.readmissions), timeout_s=3)
        assert [k for k, _, _ in kubelet.admission_failures] == ["ns/f"]
        assert not kubelet.holdings.get("ns/f") and "ns/f" not in kubelet.pods  # its devices free again


async def test_every_message_is_checked_for_a_gpu_advertised_twice(kubelet: KubeletModel, driver: FakeNvml):
    uuid = driver.devices()[1].uuid
    whole = PluginServer("nvidia.com/gpu", kubelet.plugin_dir, [PluginDevice(uuid, "gpu", uuid, 1)])
    sliced = PluginServer("nvidia.com/gpu-10gb", kubelet.plugin_dir, [PluginDevice(f"{uuid}::0", "mps", uuid, 1, 10)])
    for s in (whole, sliced):
        await s.start()
        await s.register(kubelet.socket)
    try:
        await kubelet.wait_registered("nvidia.com/gpu-10gb")
        await kubelet.wait_registered("nvidia.com/gpu")
        assert len(kubelet.exclusive_violations) == 1 and "both whole and sliced" in kubelet.exclusive_violations[0]
    finally:
        for s in (whole, sliced):
            await s.stop()


async def test_podresources_wire_format_matches_the_agents_client(kubelet: KubeletModel):
    """Field numbers: the model's descriptor (from api.proto) and the agent's client agree."""
    from dynpart.agent import podresources

    msgs = podresources_messages()
    m = msgs["AllocatableResourcesResponse"](devices=[msgs["ContainerDevices"](resource_name="r", device_ids=["x"])])
    back = podresources.messages()["AllocatableResourcesResponse"].FromString(m.SerializeToString())
    assert back.devices[0].resource_name == "r" and list(back.devices[0].device_ids) == ["x"]


async def test_nvidia_plugin_enumerates_only_at_start(kubelet: KubeletModel, driver: FakeNvml):
    first = carve(driver, 0, ("1g.10gb", 0))
    nvidia = NvidiaPluginModel("node-a", kubelet.plugin_dir, driver, kubelet_restart_s=0, poll_s=0.05)
    await nvidia.start()
    try:
        await kubelet.wait_devices(MIG1, first)
        assert enumerate_devices(driver)["nvidia.com/gpu"] == [(driver.devices()[1].uuid, 1)]
        second = [u for u in carve(driver, 0, ("1g.10gb", 1)) if u not in first]
        await asyncio.sleep(0.3)
        assert kubelet.plugins[MIG1].ids == first  # never read again
        # a destroyed instance stays advertised: Allocate hands it out, the container cannot start
        gi = driver.gpu_instances(0)[0]
        driver.destroy_compute_instance(0, gi.gi_id, gi.compute_instances[0])
        driver.destroy_gpu_instance(0, gi.gi_id)
        assert await kubelet.admit_pod(pod("a", MIG1))
        assert kubelet.allocations[-1].envs == {"NVIDIA_VISIBLE_DEVICES": first[0]}
        await asyncio.sleep(0.05)
        assert kubelet.start_errors and first[0] in kubelet.start_errors[0]
        kubelet._forget("ns/a", "a")
        # a kubelet restart makes it start again: it enumerates again
        t = await kubelet.restart()
        await kubelet.wait_devices(MIG1, second, timeout_s=2)
        assert [e.why for e in nvidia.enumerations] == ["start", "kubelet restart"]
        assert min(at for r, at in nvidia.registrations if r == MIG1 and at > t) - t < 2.0
        with pytest.raises(grpc.aio.AioRpcError):
            await kubelet.allocate(MIG1, [first[0]])
    finally:
        await nvidia.close()


async def test_status_period_and_a_stream_that_ends(root, driver):
    """capacity()/allocatable as GetCapacity computes them: a plugin that goes away leaves its
    devices unhealthy (capacity kept, allocatable 0)."""
    k = KubeletModel("node-b", root, driver=driver)
    await k.start()
    try:
        carve(driver, 0, ("1g.10gb", 0))
        nvidia = NvidiaPluginModel("node-b", k.plugin_dir, driver)
        await nvidia.start()
        await k.wait_registered(MIG1)
        await nvidia.close()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and k.capacity()[1].get(MIG1):
            await asyncio.sleep(0.02)
        cap, alloc, _ = k.capacity()
        assert cap[MIG1] == 1 and alloc[MIG1] == 0
        assert protocol.KUBELET_SOCKET_NAME in k.socket
    finally:
        await k.close()
