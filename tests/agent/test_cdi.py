"""The CDI device-list strategies of the built-in plugin (`cdi-cri`, `cdi-annotations`): the spec
the agent writes (its devices, the management spec's common edits, atomic writes, removal), the
order "spec first, then the list", and the Allocate answer through the kubelet double."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import yaml

from dynpart.agent.deviceplugin.cdi import (
    CdiSpecWriter,
    build_spec,
    cdi_annotations,
    common_edits,
    qualified_names,
    spec_file_name,
)
from dynpart.agent.deviceplugin.devices import GpuView, MigDeviceView, advertise, container_allocation
from dynpart.agent.deviceplugin.server import AllocateSettings, DevicePluginManager, PluginServer
from dynpart.settings import AgentSettings
from tests.agent.kubelet_double import KubeletDouble

from .conftest import Rig

GPUS = [GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True, minor=0,
                mig=(MigDeviceView("1g.10gb", "MIG-a", caps=(12, 13)), MigDeviceView("1g.10gb", "MIG-b", caps=(21, 22)))),
        GpuView(index=1, uuid="GPU-1", memory_gb=80, mps=(10, 10), minor=1),
        GpuView(index=2, uuid="GPU-2", memory_gb=80, minor=5)]

HOOK = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
# as nvidia-ctk-installer writes it (cdi.GenerateNameForSpec, YAML): the driver's files at the top
# level, every device node under `all`, with the folder-permission hook
MANAGEMENT = {
    "cdiVersion": "0.5.0",
    "kind": "management.nvidia.com/gpu",
    "devices": [{"name": "all", "containerEdits": {
        "deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}, {"path": "/dev/nvidiactl"},
                        {"path": "/dev/nvidia-caps/nvidia-cap1"}],
        "hooks": [{"hookName": "createContainer", "path": HOOK,
                   "args": ["nvidia-cdi-hook", "chmod", "--mode", "755", "--path", "/dev/nvidia-caps"]}]}}],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "hooks": [{"hookName": "createContainer", "path": HOOK,
                   "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]}],
        "mounts": [{"hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                    "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]},
                   {"hostPath": "/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}]},
}


@pytest.fixture
def root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dp-cdi-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _management(spec_dir: str, name: str = "management.nvidia.com-gpu.yaml") -> str:
    os.makedirs(spec_dir, exist_ok=True)
    path = os.path.join(spec_dir, name)
    with open(path, "w") as f:
        yaml.safe_dump(MANAGEMENT, f)
    return path


def _exists(*paths: str):
    return lambda p: p in paths


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# --- the spec ----------------------------------------------------------------------------------------


def test_spec_names_each_gpu_and_mig_device_with_its_nodes(root):
    _management(root)
    spec = build_spec([d for ds in advertise(GPUS).values() for d in ds], "dynpart.io/gpu",
                      common_edits([os.path.join(root, "management.nvidia.com-gpu.yaml")]),
                      node_exists=_exists("/dev/nvidiactl", "/dev/nvidia-uvm"))
    assert spec["kind"] == "dynpart.io/gpu" and spec["cdiVersion"] == "0.5.0"
    devices = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    # a MIG device: its parent's node and its GI's and CI's capability nodes; MPS slices: their GPU once
    assert devices == {"MIG-a": ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"],
                       "MIG-b": ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"],
                       "GPU-1": ["/dev/nvidia1"], "GPU-2": ["/dev/nvidia5"]}
    top = spec["containerEdits"]
    # the control nodes that exist, never the management spec's `all` device nodes
    assert top["deviceNodes"] == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]
    assert top["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert top["mounts"] == MANAGEMENT["containerEdits"]["mounts"]
    # its own hooks, then the `all` device's folder-permission hook
    assert [h["args"][1] for h in top["hooks"]] == ["update-ldcache", "chmod"]


def test_spec_host_paths_under_the_dev_root():
    spec = build_spec(advertise(GPUS[2:])["nvidia.com/gpu"], dev_root="/run/nvidia/driver",
                      node_exists=_exists("/dev/nvidiactl"))
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia5", "hostPath": "/run/nvidia/driver/dev/nvidia5"}]
    assert spec["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidiactl",
                                                       "hostPath": "/run/nvidia/driver/dev/nvidiactl"}]}


def test_management_spec_of_a_later_version_raises_the_version(root):
    path = _management(root, "management.nvidia.com-gpu.json")
    with open(path, "w") as f:
        json.dump({**MANAGEMENT, "cdiVersion": "0.7.0"}, f)
    common = common_edits([os.path.join(root, "management.nvidia.com-gpu.yaml"), path])
    assert common.source == path and common.error is None
    assert build_spec(advertise(GPUS[2:])["nvidia.com/gpu"], common=common)["cdiVersion"] == "0.7.0"


def test_unreadable_management_spec_is_said(root):
    path = os.path.join(root, "management.nvidia.com-gpu.yaml")
    with open(path, "w") as f:
        f.write("cdiVersion: [unclosed\n")
    assert "cannot be read" in (common_edits([path]).error or "")
    with open(path, "w") as f:
        f.write("- a list\n")
    assert "is not a CDI spec" in (common_edits([path]).error or "")
    assert "no management CDI spec" in (common_edits([os.path.join(root, "nope.yaml")]).error or "")


def test_writer_writes_atomically_once_and_removes(root):
    spec_dir = os.path.join(root, "cdi")
    _management(spec_dir)
    w = CdiSpecWriter(spec_dir, "dynpart.io/gpu", node_exists=_exists("/dev/nvidiactl"))
    devices = [d for ds in advertise(GPUS).values() for d in ds]
    assert w.write(devices) and w.problem is None
    assert w.path == os.path.join(spec_dir, "dynpart.io-gpu.json") == os.path.join(spec_dir, spec_file_name(w.kind))
    assert sorted(os.listdir(spec_dir)) == ["dynpart.io-gpu.json", "management.nvidia.com-gpu.yaml"]  # no temp file
    assert w.names == {"MIG-a", "MIG-b", "GPU-1", "GPU-2"}
    assert oct(os.stat(w.path).st_mode & 0o777) == "0o644"
    inode = os.stat(w.path).st_ino
    assert w.write(list(reversed(devices))[::-1])  # unchanged: not written again
    assert os.stat(w.path).st_ino == inode
    w.write([d for d in devices if d.id != "MIG-b"])  # a new file renamed over the old one
    assert os.stat(w.path).st_ino != inode and "MIG-b" not in {d["name"] for d in _read(w.path)["devices"]}
    assert w.write([]) and not os.path.exists(w.path) and w.names == frozenset()  # CDI refuses a spec without devices
    w.write(devices)
    w.remove()
    assert not os.path.exists(w.path)


def test_writer_without_management_spec_says_so_once(root, caplog):
    w = CdiSpecWriter(os.path.join(root, "cdi"), node_exists=_exists("/dev/nvidiactl"))
    devices = advertise(GPUS[2:])["nvidia.com/gpu"]
    with caplog.at_level(logging.INFO, logger="dynpart.agent.deviceplugin.cdi"):
        assert w.write(devices) and w.write(devices)
        assert w.problem and "no management CDI spec" in w.problem and "driver's libraries" in w.problem
        assert len([r for r in caplog.records if "no management CDI spec" in r.getMessage()]) == 1
        # the spec is still written: device nodes and control nodes
        assert _read(w.path)["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidiactl"}]}
        _management(w.spec_dir)  # the toolkit wrote it meanwhile: taken up at the next write
        assert w.write(devices) and w.problem is None
        assert _read(w.path)["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
        assert any("complete again" in r.getMessage() for r in caplog.records)


def test_writer_failure_keeps_the_names_on_disk(root):
    blocker = os.path.join(root, "not-a-dir")
    open(blocker, "w").close()
    w = CdiSpecWriter(blocker)
    assert not w.write(advertise(GPUS[2:])["nvidia.com/gpu"])
    assert w.names == frozenset() and w.problem and "writing" in w.problem


def test_invalid_kind_refused():
    with pytest.raises(ValueError):
        CdiSpecWriter("/tmp", "dynpart.io")
    with pytest.raises(ValueError):
        AgentSettings(node_name="n", cdi_kind="dynpart.io/g.pu")
    assert AgentSettings(node_name="n", device_list_strategy="cdi-cri").cdi_spec_dir == "/var/run/cdi"


# --- what Allocate names -----------------------------------------------------------------------------


def test_annotation_as_the_cdi_helper_writes_it():
    a = cdi_annotations("8c1f0a4e-1b2c-4d5e-8f90-123456789abc", ["dynpart.io/gpu=MIG-a", "dynpart.io/gpu=MIG-b"])
    assert a == {"cdi.k8s.io/dynpart-device-plugin_8c1f0a4e-1b2c-4d5e-8f90-123456789abc":
                 "dynpart.io/gpu=MIG-a,dynpart.io/gpu=MIG-b"}
    with pytest.raises(ValueError):
        cdi_annotations("x" * 60, [])


def test_container_allocation_names_no_device_in_the_variable():
    lists = advertise(GPUS)
    for strategy in ("cdi-cri", "cdi-annotations"):
        a = container_allocation(lists["nvidia.com/mig-1g.10gb"], device_list=strategy)
        assert a.envs == {"NVIDIA_VISIBLE_DEVICES": "void"} and a.mounts == ()
    mps = container_allocation(lists["nvidia.com/gpu-10gb"], device_list="cdi-cri")
    assert mps.envs["NVIDIA_VISIBLE_DEVICES"] == "void" and mps.envs["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert mps.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20G" and len(mps.mounts) == 1
    assert qualified_names("dynpart.io/gpu", lists["nvidia.com/gpu-10gb"]) == ["dynpart.io/gpu=GPU-1"]


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations"])
async def test_allocate_answers_cdi_names_through_the_kubelet(root, strategy):
    plugin_dir, spec_dir = os.path.join(root, "dp"), os.path.join(root, "cdi")
    _management(spec_dir)
    dev = os.path.join(root, "hostdev")
    os.makedirs(dev)
    open(os.path.join(dev, "nvidiactl"), "w").close()
    allocate = AllocateSettings(device_list=strategy, dev_dir=dev)
    cdi = CdiSpecWriter(spec_dir, node_exists=allocate.node_exists)
    async with KubeletDouble(plugin_dir) as k, DevicePluginManager(plugin_dir, poll_s=0.05, allocate=allocate,
                                                                   cdi=cdi) as m:
        await m.update(advertise(GPUS))
        on_disk = {d["name"] for d in _read(cdi.path)["devices"]}
        for resource, ids, names in [("nvidia.com/mig-1g.10gb", ["MIG-a", "MIG-b"], ["MIG-a", "MIG-b"]),
                                     ("nvidia.com/gpu-10gb", ["GPU-1::0", "GPU-1::1"], ["GPU-1"]),
                                     ("nvidia.com/gpu", ["GPU-2"], ["GPU-2"])]:
            await k.wait_registered(resource)
            c = (await k.allocate(resource, ids)).container_responses[0]
            qualified = [f"dynpart.io/gpu={n}" for n in names]
            assert set(names) <= on_disk
            if strategy == "cdi-cri":
                assert [d.name for d in c.cdi_devices] == qualified and dict(c.annotations) == {}
            else:
                assert list(c.cdi_devices) == []
                [(key, value)] = dict(c.annotations).items()
                assert re.fullmatch(r"cdi\.k8s\.io/dynpart-device-plugin_[0-9a-f-]{36}", key)
                assert value == ",".join(qualified)
            assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
            assert [d.container_path for d in c.devices][:1] == ["/dev/nvidiactl"]  # DeviceSpecs kept
            if resource == "nvidia.com/gpu-10gb":
                assert c.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
                assert [mt.container_path for mt in c.mounts] == ["/tmp/nvidia-mps"]


@pytest.mark.asyncio
async def test_spec_written_before_a_device_is_listed_and_rewritten_after_changes(root, monkeypatch):
    spec_dir = os.path.join(root, "cdi")
    cdi = CdiSpecWriter(spec_dir)
    checked: list[str] = []

    def on_disk() -> set[str]:
        return {d["name"] for d in _read(cdi.path)["devices"]} if os.path.exists(cdi.path) else set()

    def check(devices) -> None:  # type: ignore[no-untyped-def]
        for d in devices:  # every device a server lists is named by the spec on disk already
            assert (d.id if d.kind == "mig" else d.gpu_uuid) in on_disk(), d.id
            checked.append(d.id)

    set_devices, start = PluginServer.set_devices, PluginServer.start

    async def checked_set_devices(self, devices):  # type: ignore[no-untyped-def]
        devices = list(devices)
        check(devices)
        return await set_devices(self, devices)

    async def checked_start(self):  # type: ignore[no-untyped-def]
        check(self.devices)
        return await start(self)

    monkeypatch.setattr(PluginServer, "set_devices", checked_set_devices)
    monkeypatch.setattr(PluginServer, "start", checked_start)
    async with DevicePluginManager(os.path.join(root, "dp"), serve=False, cdi=cdi) as m:
        await m.update(advertise(GPUS))
        assert cdi.names == on_disk() == {"MIG-a", "MIG-b", "GPU-1", "GPU-2"}
        # MIG-b destroyed: withdrawn (still named: Allocate serves it until sealed), then forgotten
        assert await m.withdraw("MIG-b") == set()
        assert "MIG-b" in on_disk()
        m.seal("MIG-b")
        await m.forget("MIG-b")
        assert "MIG-b" not in on_disk()
        # a new MIG device: named in the spec on disk before it is listed
        gpus = [GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True, minor=0,
                        mig=(MigDeviceView("1g.10gb", "MIG-a", caps=(12, 13)),
                             MigDeviceView("1g.10gb", "MIG-c", caps=(30, 31)))), *GPUS[1:]]
        await m.update(advertise(gpus))
        assert "MIG-c" in {d.id for d in m.advertised()["nvidia.com/mig-1g.10gb"]} and "MIG-c" in checked
        await m.update({})  # nothing served: no spec (CDI refuses one without devices)
        assert not os.path.exists(cdi.path)


@pytest.mark.asyncio
async def test_failed_write_holds_the_devices_back(root):
    spec_dir = os.path.join(root, "cdi")
    open(spec_dir, "w").close()  # a file where the directory should be: every write fails
    cdi = CdiSpecWriter(spec_dir)
    async with DevicePluginManager(os.path.join(root, "dp"), serve=False, cdi=cdi) as m:
        await m.update(advertise(GPUS[2:]))
        assert m.advertised().get("nvidia.com/gpu", []) == [] and m.pending == {"nvidia.com/gpu": ["GPU-2"]}
        assert cdi.problem and "writing" in cdi.problem
        os.unlink(spec_dir)
        await m.check()  # (the watch's next look)
        assert [d.id for d in m.advertised()["nvidia.com/gpu"]] == ["GPU-2"] and m.pending == {}
        assert cdi.names == {"GPU-2"}


@pytest.mark.asyncio
async def test_device_with_an_invalid_cdi_name_is_not_advertised(root, caplog):
    """An old driver's MIG UUID (`MIG-GPU-<uuid>/<gi>/<ci>`) is no CDI device name: left out of the
    spec, hence never listed (a pod would get a name no spec resolves); said once."""
    gpus = [GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True, minor=0,
                    mig=(MigDeviceView("1g.10gb", "MIG-GPU-0/1/0", caps=(12, 13)),
                         MigDeviceView("1g.10gb", "MIG-b", caps=(21, 22))))]
    cdi = CdiSpecWriter(os.path.join(root, "cdi"))
    with caplog.at_level(logging.WARNING, logger="dynpart.agent.deviceplugin.cdi"):
        async with DevicePluginManager(os.path.join(root, "dp"), serve=False, cdi=cdi) as m:
            await m.update(advertise(gpus))
            await m.update(advertise(gpus))
            assert [d.id for d in m.advertised()["nvidia.com/mig-1g.10gb"]] == ["MIG-b"]
            assert m.pending == {}  # (nothing to wait for: the watch does not retry it)
    assert len([r for r in caplog.records if "no valid CDI device name" in r.getMessage()]) == 1


# --- helper-162's review: each of these failed before its fix -------------------------------------

@pytest.fixture
def spec_root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="cdi-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_device_whose_nodes_are_unknown_is_left_out_not_written_empty(spec_root):
    """CDI refuses a device with empty edits, and with it the whole spec (cdi.ReadSpec: 'invalid
    device, empty device edits'): one GPU whose minor is unread (lost when the agent restarted)
    failed every container of the node."""
    gpus = [GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True, minor=0,
                    mig=(MigDeviceView("1g.10gb", "MIG-a", caps=(12, 13)),)),
            GpuView(index=2, uuid="GPU-2", memory_gb=80, healthy=False)]  # minor unknown
    cdi = CdiSpecWriter(os.path.join(spec_root, "cdi"))
    assert cdi.write([d for ds in advertise(gpus).values() for d in ds])
    with open(cdi.path) as f:
        spec = json.load(f)
    assert [d["name"] for d in spec["devices"]] == ["MIG-a"] and cdi.names == {"MIG-a"}
    assert all(d["containerEdits"]["deviceNodes"] for d in spec["devices"])


@pytest.mark.parametrize("kind", ["9vendor.io/gpu", "dynpart.io/1gpu"])
def test_a_kind_cdi_refuses_is_refused_here(kind):
    """CDI's vendor and class start with a letter (validateVendorOrClassName)."""
    with pytest.raises(ValueError):
        AgentSettings(device_list_strategy="cdi-cri", cdi_kind=kind)
    with pytest.raises(ValueError):
        CdiSpecWriter("/nonexistent", kind=kind)


@pytest.mark.parametrize("content", [
    b"cdiVersion: 0.5.0\nkind: management.nvidia.com/gpu\n# \xff\xfe not UTF-8\n",
    b"cdiVersion: 0.5.0\nkind: management.nvidia.com/gpu\ncontainerEdits:\n  env: [2026-11-29]\n",  # a YAML date
], ids=["not-utf8", "yaml-date"])
async def test_a_bad_management_spec_is_a_problem_not_an_exception(spec_root, content):
    spec_dir = os.path.join(spec_root, "cdi")
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "management.nvidia.com-gpu.yaml"), "wb") as f:
        f.write(content)
    cdi = CdiSpecWriter(spec_dir)
    cdi.write(advertise([GpuView(index=0, uuid="GPU-0", memory_gb=80, minor=0)])["nvidia.com/gpu"])
    assert cdi.problem and "management" in cdi.problem
    async with DevicePluginManager(os.path.join(spec_root, "dp"), serve=False, cdi=CdiSpecWriter(spec_dir)) as m:
        await m.update(advertise([GpuView(index=0, uuid="GPU-0", memory_gb=80, minor=0)]))  # raised before


async def test_a_restart_that_cannot_read_the_gpus_keeps_the_last_agents_spec(spec_root):
    """`set_unhealthy` at the first pass (NVML failing) wrote an empty spec, i.e. removed the file
    running pods resolve their CDI names from."""
    spec_dir = os.path.join(spec_root, "cdi")
    previous = CdiSpecWriter(spec_dir)
    assert previous.write(advertise([GpuView(index=0, uuid="GPU-0", memory_gb=80, minor=0)])["nvidia.com/gpu"])
    async with DevicePluginManager(os.path.join(spec_root, "dp"), serve=False, cdi=CdiSpecWriter(spec_dir)) as m:
        await m.set_unhealthy()
    assert os.path.exists(previous.path)


async def test_leaving_dynpart_keeps_the_spec_a_running_pod_resolves_from(rig: Rig, spec_root):
    rig.with_plugins()
    assert rig.plugins is not None
    rig.plugins.cdi = CdiSpecWriter(os.path.join(spec_root, "cdi"))
    rig.plugins.cdi.write(advertise([GpuView(index=2, uuid="GPU-2", memory_gb=80, minor=5)])["nvidia.com/gpu"])
    rig.pods.assign("running-pod", "nvidia.com/gpu", "GPU-2")
    agent = rig.agent()
    rig.node_api.labels.pop("dynpart.io/gpu-partitioning", None)
    await agent._hand_back()
    assert os.path.exists(rig.plugins.cdi.path)
