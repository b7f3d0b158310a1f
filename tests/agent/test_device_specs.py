"""The device nodes the built-in plugin's Allocate lists as DeviceSpecs (as NVIDIA's plugin with
PASS_DEVICE_SPECS=true): the driver's MIG capability numbering, the pure path computation, the
views the agent builds from the driver, and the Allocate answer through the kubelet double."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from dynpart.agent.deviceplugin.devices import (
    CONTROL_NODES,
    DeviceSpec,
    GpuView,
    MigDeviceView,
    advertise,
    device_nodes,
    device_specs,
)
from dynpart.agent.deviceplugin.server import AllocateSettings, DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import GpuDriverError
from dynpart.agent.driver.nvcaps import (
    ci_cap,
    driver_mig_minors,
    gi_cap,
    mig_cap_minors,
    parse_mig_minors,
)
from dynpart.agent.driver.nvml import RealNvml
from dynpart.agent.loop import device_numbers
from tests.agent.kubelet_double import KubeletDouble

from .conftest import H100, Rig, mig_spec

# --- the driver's numbering (open-gpu-kernel-modules nv-caps.c) -------------------------------------


def test_driver_numbering_as_nv_caps_c():
    t = driver_mig_minors()
    assert t["config"] == 1 and t["monitor"] == 2  # (0: nvlink fabric-mgmt, in nvlink-minors)
    assert t[gi_cap(0, 0)] == 3 and t[ci_cap(0, 0, 0)] == 4 and t[ci_cap(0, 0, 7)] == 11
    assert t[gi_cap(0, 1)] == 12 and t[ci_cap(0, 1, 0)] == 13
    assert t[gi_cap(0, 14)] == 129 and t[ci_cap(0, 14, 7)] == 137
    assert t[gi_cap(1, 0)] == 138  # 15 GPU instances of 1 + 8 capabilities per GPU
    assert t[ci_cap(31, 14, 7)] == 3 + 32 * 135 - 1
    assert len(t) == 2 + 32 * 135 and len(set(t.values())) == len(t)


def test_mig_minors_file_parsed_as_nvidia_reads_it():
    text = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\nnonsense 9\n\ngpu1/gi2/ci3/access 160\n"
    t = parse_mig_minors(text)
    assert t == {"config": 1, "monitor": 2, "gpu0/gi0/access": 3, "gpu0/gi0/ci0/access": 4,
                 "gpu1/gi2/ci3/access": 160}
    whole = "".join(f"{k} {v}\n" for k, v in driver_mig_minors().items())
    assert parse_mig_minors(whole) == driver_mig_minors()
    assert mig_cap_minors(driver_mig_minors(), 1, 2, 0) == (3 + 135 + 18, 3 + 135 + 19)
    assert mig_cap_minors(t, 0, 0, 1) is None  # the CI's line is not there


def test_real_driver_reads_the_minors_file(tmp_path):
    nvml = RealNvml.__new__(RealNvml)  # (no NVML here: only the procfs read)
    nvml.mig_minors_file = str(tmp_path / "mig-minors")
    assert nvml.mig_cap_minors() == {}  # no file: no MIG-capable driver, or not visible
    (tmp_path / "mig-minors").write_text("config 1\ngpu0/gi1/access 12\n")
    assert nvml.mig_cap_minors() == {"config": 1, "gpu0/gi1/access": 12}


def test_fake_driver_numbers_as_the_real_one():
    d = FakeNvml(H100, 2)
    assert [d.minor_number(i) for i in range(2)] == [0, 1]
    d.minors = [3, 1]  # the driver's probe order is not NVML's index order
    assert d.minor_number(0) == 3
    assert d.mig_cap_minors() == driver_mig_minors()
    d.mig_minors_visible = False
    assert d.mig_cap_minors() == {}
    d.lose(1)
    with pytest.raises(GpuDriverError):
        d.minor_number(1)


# --- the paths (pure) ----------------------------------------------------------------------------

def test_device_nodes_of_each_kind():
    assert device_nodes(2) == ("/dev/nvidia2",)
    assert device_nodes(0, (12, 13)) == ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12",
                                         "/dev/nvidia-caps/nvidia-cap13")
    assert device_nodes(None, (12, 13)) == ("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")
    assert device_nodes(None) == ()


GPUS = [GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True, minor=0,
                mig=(MigDeviceView("1g.10gb", "MIG-a", caps=(12, 13)), MigDeviceView("1g.10gb", "MIG-b", caps=(21, 22)))),
        GpuView(index=1, uuid="GPU-1", memory_gb=80, mps=(10, 10), minor=1),
        GpuView(index=2, uuid="GPU-2", memory_gb=80, minor=5)]


def test_advertised_devices_carry_their_nodes():
    lists = advertise(GPUS)
    nodes = {d.id: d.nodes for ds in lists.values() for d in ds}
    assert nodes == {"MIG-a": ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"),
                     "MIG-b": ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"),
                     "GPU-1::0": ("/dev/nvidia1",), "GPU-1::1": ("/dev/nvidia1",), "GPU-2": ("/dev/nvidia5",)}


def test_specs_control_nodes_then_devices_once_each_under_the_dev_root():
    mig = advertise(GPUS)["nvidia.com/mig-1g.10gb"]
    specs = device_specs(mig, "/run/nvidia/driver")
    assert [s.container_path for s in specs] == [*CONTROL_NODES, "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12",
                                                 "/dev/nvidia-caps/nvidia-cap13", "/dev/nvidia-caps/nvidia-cap21",
                                                 "/dev/nvidia-caps/nvidia-cap22"]
    assert specs[4] == DeviceSpec("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0", "rw")
    assert device_specs(mig)[0] == DeviceSpec("/dev/nvidiactl", "/dev/nvidiactl", "rw")


def test_specs_leave_out_what_does_not_exist():
    slices = advertise(GPUS)["nvidia.com/gpu-10gb"]
    there = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"}
    assert [s.container_path for s in device_specs(slices, exists=there.__contains__)] == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"]


# --- what the agent's views carry, from the driver ------------------------------------------------

def test_device_numbers_read_from_the_driver():
    d = FakeNvml(H100, 2)
    d.minors = [4, 7]
    devices = d.devices()
    minors, caps = device_numbers(d, devices, True)
    assert minors == {0: 4, 1: 7} and caps == driver_mig_minors()
    assert device_numbers(d, devices, False)[1] == {}
    d.lose(1)
    assert device_numbers(d, devices, False)[0] == {0: 4}  # best effort: a lost GPU has no nodes given


@pytest.mark.asyncio
async def test_agent_advertises_mig_devices_with_their_nodes(rig: Rig):
    rig.with_plugins()
    rig.driver.minors = [1, 0]
    gis = rig.carve(0, "1g.10gb@0", "3g.40gb@4")
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "3g.40gb@4"], 1: []}))
    await rig.agent().reconcile_once()
    assert rig.plugins is not None
    nodes = {d.id: d.nodes for ds in rig.plugins.advertised().values() for d in ds}
    table = driver_mig_minors()
    for name, gi in gis.items():
        info = {g.gi_id: g for g in rig.driver.gpu_instances(0)}[gi]
        assert nodes[rig.uuid(0, gi)] == ("/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{table[gi_cap(1, gi)]}",
                                          f"/dev/nvidia-caps/nvidia-cap{table[ci_cap(1, gi, info.compute_instances[0])]}"), name


# --- the Allocate answer, through the kubelet double -------------------------------------------------

@pytest.fixture
def plugin_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dp-specs-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _dev_dir(root: str, *paths: str) -> str:
    dev = os.path.join(root, "hostdev")
    for p in paths:
        f = os.path.join(dev, os.path.relpath(p, "/dev"))
        os.makedirs(os.path.dirname(f), exist_ok=True)
        open(f, "w").close()
    return dev


CASES = [("nvidia.com/mig-1g.10gb", "MIG-a", ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12",
                                               "/dev/nvidia-caps/nvidia-cap13"]),
         ("nvidia.com/gpu-10gb", "GPU-1::0", ["/dev/nvidia1"]), ("nvidia.com/gpu", "GPU-2", ["/dev/nvidia5"])]


@pytest.mark.asyncio
@pytest.mark.parametrize("device_list", ["envvar", "volume-mounts"])
async def test_allocate_passes_device_specs(plugin_dir, device_list):
    dev = _dev_dir(plugin_dir, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
                   "/dev/nvidia1", "/dev/nvidia5", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")
    allocate = AllocateSettings(device_list=device_list, dev_root="/run/nvidia/driver", dev_dir=dev)
    async with KubeletDouble(plugin_dir) as k, DevicePluginManager(plugin_dir, poll_s=0.05, allocate=allocate) as m:
        await m.update(advertise(GPUS))
        for resource, device, nodes in CASES:
            await k.wait_registered(resource)
            c = (await k.allocate(resource, [device])).container_responses[0]
            # no /dev/nvidia-modeset on this host: left out (its DeviceSpec would fail the container)
            assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
                (p, "/run/nvidia/driver" + p, "rw")
                for p in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", *nodes]], resource
            assert c.envs["NVIDIA_VISIBLE_DEVICES"]  # the runtime is still told the devices


@pytest.mark.asyncio
async def test_allocate_without_device_specs(plugin_dir):
    dev = _dev_dir(plugin_dir, "/dev/nvidiactl", "/dev/nvidia5")
    allocate = AllocateSettings(device_specs=False, dev_dir=dev)
    async with KubeletDouble(plugin_dir) as k, DevicePluginManager(plugin_dir, poll_s=0.05, allocate=allocate) as m:
        await m.update(advertise(GPUS))
        await k.wait_registered("nvidia.com/gpu")
        c = (await k.allocate("nvidia.com/gpu", ["GPU-2"])).container_responses[0]
        assert list(c.devices) == []


@pytest.mark.asyncio
async def test_allocate_looks_at_the_nodes_each_time(plugin_dir):
    """A node made after the agent started (a MIG instance's capability nodes) is given once it exists."""
    dev = _dev_dir(plugin_dir, "/dev/nvidiactl", "/dev/nvidia0")
    async with KubeletDouble(plugin_dir) as k, DevicePluginManager(
            plugin_dir, poll_s=0.05, allocate=AllocateSettings(dev_dir=dev)) as m:
        await m.update(advertise(GPUS))
        await k.wait_registered("nvidia.com/mig-1g.10gb")
        first = (await k.allocate("nvidia.com/mig-1g.10gb", ["MIG-b"])).container_responses[0]
        assert [d.container_path for d in first.devices] == ["/dev/nvidiactl", "/dev/nvidia0"]
        _dev_dir(plugin_dir, "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22")
        again = (await k.allocate("nvidia.com/mig-1g.10gb", ["MIG-b"])).container_responses[0]
        assert [d.container_path for d in again.devices] == ["/dev/nvidiactl", "/dev/nvidia0",
                                                              "/dev/nvidia-caps/nvidia-cap21",
                                                              "/dev/nvidia-caps/nvidia-cap22"]
