"""A GPU instance split into several compute instances by another tool (mig-parted, `nvidia-smi
mig -cci` before the node joined dynpart): each compute instance is a MIG device of its own, with
its own UUID (NVIDIA's plugin lists them as `mig-<c>c.<profile>`). The agent makes one full
compute instance per GPU instance, so it leaves such an instance alone: reported used, never
destroyed, not advertised by its own plugin as the whole profile (helper-145's review: only the
first compute instance's UUID was read, and a pod holding the second was not seen before a
destroy)."""

from __future__ import annotations

import ctypes
import types

from dynpart.agent.driver.nvml import RealNvml
from dynpart.agent.kube import FakePluginPods
from dynpart.annotations import STATUS_ERROR, STATUS_PLAN, decode_status

from .conftest import H100, Rig, make_rig, mig_spec

SPLIT_RESOURCE = "nvidia.com/mig-1c.3g.40gb"


def _pynvml_with_a_split_instance() -> types.SimpleNamespace:
    """pynvml's calls as RealNvml makes them, for one GPU whose GPU instance 1 (profile id 9,
    3g.40gb at 0) holds two compute instances, MIG devices MIG-aaaa and MIG-bbbb."""

    class NVMLError(Exception):
        def __init__(self, value: int):
            super().__init__(value)
            self.value = value

    nv = types.SimpleNamespace(NVMLError=NVMLError)
    nv.NVMLError_NotSupported = type("NotSupported", (NVMLError,), {})
    nv.NVMLError_InvalidArgument = type("InvalidArgument", (NVMLError,), {})
    nv.NVMLError_NotFound = type("NotFound", (NVMLError,), {})
    nv.NVMLError_FunctionNotFound = type("FunctionNotFound", (NVMLError,), {})
    nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_FOUND = 3, 2, 6
    nv.NVML_ERROR_FUNCTION_NOT_FOUND = 13
    nv.nvmlInit = lambda: None
    nv.NVML_GPU_INSTANCE_PROFILE_COUNT = nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 1
    nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
    nv.c_nvmlGpuInstance_t = nv.c_nvmlComputeInstance_t = ctypes.c_void_p
    nv.nvmlDeviceGetHandleByIndex = lambda i: "gpu0"
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    migs = ["mig-a", "mig-b"]

    def mig_by_index(h: str, i: int) -> str:
        if i < len(migs):
            return migs[i]
        raise nv.NVMLError_NotFound(6)

    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_by_index
    nv.nvmlDeviceGetGpuInstanceId = lambda m: 1
    nv.nvmlDeviceGetUUID = {"mig-a": "MIG-aaaa", "mig-b": "MIG-bbbb"}.__getitem__
    nv.nvmlDeviceGetGpuInstanceProfileInfo = lambda h, e: types.SimpleNamespace(id=9, instanceCount=2)

    def gpu_instances(h: str, profile: int, arr: ctypes.Array, count: ctypes.c_uint) -> None:
        arr[0] = 0x10
        count._obj.value = 1  # type: ignore[attr-defined]

    def compute_instances(gi: int, profile: int, arr: ctypes.Array, count: ctypes.c_uint) -> None:
        arr[0], arr[1] = 0x20, 0x21
        count._obj.value = 2  # type: ignore[attr-defined]

    nv.nvmlDeviceGetGpuInstances = gpu_instances
    nv.nvmlGpuInstanceGetInfo = lambda gi: types.SimpleNamespace(
        id=1, profileId=9, placement=types.SimpleNamespace(start=0, size=4))
    nv.nvmlGpuInstanceGetComputeInstanceProfileInfo = lambda gi, e, s: types.SimpleNamespace(id=0, instanceCount=3)
    nv.nvmlGpuInstanceGetComputeInstances = compute_instances
    nv.nvmlComputeInstanceGetInfo = lambda ci: types.SimpleNamespace(id={0x20: 0, 0x21: 1}[ci])
    return nv


def test_real_nvml_reads_every_mig_device_of_a_split_instance():
    [gi] = RealNvml(_pynvml_with_a_split_instance()).gpu_instances(0)
    assert (gi.compute_instances, gi.uuid, gi.more_uuids, gi.split) == ((0, 1), "MIG-aaaa", ("MIG-bbbb",), True)


def _split_rig() -> tuple[Rig, int, list[str]]:
    rig = make_rig(H100, 1)
    gi = rig.carve(0, "3g.40gb@0")["3g.40gb@0"]
    uuids = rig.driver.split(0, gi, 3)
    assert len(set(uuids)) == 3 and rig.driver.gpu_instances(0)[0].more_uuids == tuple(uuids[1:])
    return rig, gi, uuids


async def test_a_split_instance_a_pod_holds_by_another_compute_instance_is_not_destroyed():
    rig, gi, uuids = _split_rig()
    # the kubelet gave the second compute instance to a pod that has no process yet
    rig.pods.assign("ns/train", SPLIT_RESOURCE, uuids[1])
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    report = await rig.agent().reconcile_once()
    assert not [o for o in rig.driver.ops if o.op in ("destroy_ci", "destroy_gi")]
    assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
    error = rig.node_api.annotations[STATUS_ERROR]
    assert "pod ns/train" in error and "3 compute instances made outside dynpart" in error
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[0].mig] == [("3g.40gb", 0, True)]


async def test_an_idle_split_instance_is_left_alone_until_someone_removes_it():
    rig, gi, _ = _split_rig()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    await rig.agent().reconcile_once()
    assert not [o for o in rig.driver.ops if o.op in ("destroy_ci", "destroy_gi")]
    assert rig.driver.layout(0) == [("3g.40gb", 0)]
    # handed back: its compute instances destroyed by hand, the next pass applies the plan
    for ci in (2, 1, 0):
        rig.driver.destroy_compute_instance(0, gi, ci)
    report = await rig.agent().reconcile_once()
    assert rig.driver.layout(0) == [("7g.80gb", 0)] and report.plan_id == "p1"


async def test_the_agents_own_plugin_does_not_advertise_a_split_instance_as_its_profile():
    rig = make_rig(H100, 1).with_plugins()
    gis = rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    rig.driver.split(0, gis["3g.40gb@0"], 2)
    await rig.agent().reconcile_once()
    assert rig.plugins is not None
    advertised = {r: [d.id for d in ds] for r, ds in rig.plugins.advertised().items() if ds}
    assert advertised == {"nvidia.com/mig-3g.40gb": [rig.uuid(0, gis["3g.40gb@4"])]}


async def test_with_nvidia_plugin_a_plan_beside_instances_no_profile_of_the_model_names_is_acknowledged():
    """NVIDIA's plugin lists a split instance's compute instances (and an instance of a GI profile
    the node's model lacks) under names of their own: the agent compares the node's capacity for
    its model's profiles only, or a plan beside them would never be acknowledged."""
    rig, gi, uuids = _split_rig()
    plugin_pods = FakePluginPods()
    agent = rig.agent(plugin_pods=plugin_pods)
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "2g.20gb@4"]}))
    await agent.reconcile_once()
    made = [g for g in rig.driver.gpu_instances(0) if g.gi_id != gi]
    assert [(g.start, g.split) for g in made] == [(4, False)] and plugin_pods.restarts == 1
    # the restarted plugin lists every MIG device, by the driver's names; the kubelet holds them
    rig.node_api.set_allocatable({SPLIT_RESOURCE: 3, "nvidia.com/mig-2g.20gb": 1, "nvidia.com/mig-1g.12gb": 1})
    rig.pods.set_allocatable(SPLIT_RESOURCE, *uuids)
    rig.pods.set_allocatable("nvidia.com/mig-2g.20gb", made[0].uuid or "")
    report = await agent.reconcile_once()
    assert report.plan_id == "p1", rig.node_api.annotations.get(STATUS_ERROR)
    assert plugin_pods.restarts == 1


async def test_an_instance_with_one_compute_instance_smaller_than_itself_is_left_alone_too():
    """One compute instance of fewer slices than the GPU instance (helper-149): a pod asking for the
    profile would get a part of it."""
    rig = make_rig(H100, 1).with_plugins()
    gi = rig.carve(0, "3g.40gb@0")["3g.40gb@0"]
    rig.driver.split(0, gi, 1)
    [info] = rig.driver.gpu_instances(0)
    assert info.split and info.compute_instances == (0,) and info.more_uuids == ()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    await rig.agent().reconcile_once()
    assert not [o for o in rig.driver.ops if o.op in ("destroy_ci", "destroy_gi")]
    assert "a compute instance smaller than the instance made outside dynpart" in rig.node_api.annotations[STATUS_ERROR]
    assert rig.plugins is not None and not any(rig.plugins.advertised().values())


def test_real_nvml_tells_a_compute_instance_smaller_than_its_gpu_instance():
    nv = _pynvml_with_a_split_instance()
    nv.nvmlDeviceGetGpuInstanceProfileInfo = lambda h, e: types.SimpleNamespace(id=9, instanceCount=2, sliceCount=3)
    for ci_slices, smaller in ((1, True), (3, False)):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo = lambda gi, e, s, n=ci_slices: types.SimpleNamespace(
            id=0, instanceCount=3, sliceCount=n)
        [gi] = RealNvml(nv).gpu_instances(0)
        assert gi.ci_smaller == smaller and gi.split  # (two compute instances: split either way)
