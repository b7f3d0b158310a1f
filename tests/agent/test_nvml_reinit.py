"""RealNvml starts NVML again after a driver error that leaves it useless, instead of failing
every call until the agent restarts. A stand-in `pynvml` module plays the driver (no GPU in CI)."""

from __future__ import annotations

import sys
import types

import pytest

from dynpart.agent.driver.interface import GpuDriverError

_MESSAGES = {1: "Uninitialized", 3: "Not Supported", 15: "GPU is lost"}  # pynvml's texts


class _NVMLError(Exception):
    def __init__(self, value: int):
        self.value = value
        super().__init__(_MESSAGES.get(value, f"NVML error {value}"))


def fake_pynvml() -> types.ModuleType:
    """Two GPUs. One put in `state["lost"]` has fallen off the bus (Xid 79): every call on it
    fails with GPU_IS_LOST, and it stays lost across nvmlShutdown/nvmlInit, as a real one does
    until a GPU reset or a reboot; the other GPU answers throughout."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = _NVMLError  # type: ignore[attr-defined]  # module attributes set by hand
    nv.NVMLError_NotSupported = type("NotSupported", (_NVMLError,), {})  # type: ignore[attr-defined]
    nv.NVML_ERROR_UNINITIALIZED = 1  # type: ignore[attr-defined]  # as in nvml.h
    nv.NVML_ERROR_NOT_SUPPORTED = 3  # type: ignore[attr-defined]  # as in nvml.h
    nv.NVML_ERROR_GPU_IS_LOST = 15  # type: ignore[attr-defined]  # as in nvml.h
    nv.NVML_DEVICE_MIG_DISABLE, nv.NVML_DEVICE_MIG_ENABLE = 0, 1  # type: ignore[attr-defined]  # as in nvml.h
    lost: set[int] = set()
    state = {"inits": 0, "shutdowns": 0, "lost": lost}
    nv.state = state  # type: ignore[attr-defined]  # the test reads it

    def init() -> None:
        state["inits"] += 1  # (a lost GPU stays lost: a re-init does not bring it back)

    def shutdown() -> None:
        state["shutdowns"] += 1

    def count() -> int:
        return 2

    def handle(index: int) -> str:
        if index in lost:
            raise _NVMLError(15)
        return f"gpu{index}"

    def on_gpu(value: object) -> object:
        def call(h: str, *args: object) -> object:
            if int(h.removeprefix("gpu")) in lost:
                raise _NVMLError(15)
            return value
        return call

    def not_supported(h: str) -> object:
        raise nv.NVMLError_NotSupported(3)

    nv.nvmlInit, nv.nvmlShutdown, nv.nvmlDeviceGetCount = init, shutdown, count  # type: ignore[attr-defined]  # see above
    nv.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = on_gpu("NVIDIA H100 80GB HBM3")  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = on_gpu("GPU-f270ccfa")  # type: ignore[attr-defined]
    nv.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = on_gpu(types.SimpleNamespace(total=81559 << 20, reserved=480 << 20))  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMigMode = on_gpu((0, 0))  # type: ignore[attr-defined]
    nv.nvmlDeviceGetRemappedRows = on_gpu((0, 0, 0, 0))  # type: ignore[attr-defined]
    nv.nvmlDeviceGetRetiredPagesPendingStatus = not_supported  # type: ignore[attr-defined]  # as on an H100
    return nv


def test_nvml_is_started_again_after_the_gpu_is_lost(monkeypatch: pytest.MonkeyPatch):
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    from dynpart.agent.driver.nvml import RealNvml

    driver = RealNvml()
    assert driver._call(nv.nvmlDeviceGetCount) == 2 and nv.state["inits"] == 1
    assert [d.index for d in driver.devices()] == [0, 1] and driver.health(1) is None
    nv.state["lost"].add(1)  # GPU 1 falls off the bus
    with pytest.raises(GpuDriverError) as e:
        driver._call(nv.nvmlDeviceGetHandleByIndex, 1)
    assert e.value.code == "GPU_IS_LOST"
    assert driver._call(nv.nvmlDeviceGetHandleByIndex, 0) == "gpu0", "the next call starts NVML again"
    assert (nv.state["inits"], nv.state["shutdowns"]) == (2, 1)
    assert driver.health(1) == "NVML cannot read it: GPU is lost"
    assert driver.health(0) is None  # the other GPU is fine


def test_a_lost_gpu_is_listed_lost_and_the_others_as_they_are(monkeypatch: pytest.MonkeyPatch):
    """GPU_IS_LOST comes from the lost GPU's own handle: devices() lists the other GPU as it is
    and the lost one `lost`, as last read. NVML is started again when the GPU is first found
    lost, not at every pass after (seconds per GPU without persistence mode), but again after
    `lost_reinit_s`, in case a reset brought it back; once its handle answers it is read again."""
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    from dynpart.agent.driver.nvml import RealNvml

    driver = RealNvml()
    before = driver.devices()
    assert not any(d.lost for d in before)
    nv.state["lost"].add(1)
    devices = driver.devices()
    assert [(d.index, d.lost) for d in devices] == [(0, False), (1, True)]
    assert devices[1].uuid == before[1].uuid and devices[1].name == before[1].name  # as last read
    driver.devices()  # the re-init the first GPU_IS_LOST asked for
    inits = nv.state["inits"]
    assert inits == 2
    for _ in range(5):  # pass after pass: not started again
        assert [d.lost for d in driver.devices()] == [False, True]
    assert nv.state["inits"] == inits
    with pytest.raises(GpuDriverError) as e:  # a call on it fails, without a re-init either
        driver.gpu_instances(1)
    assert e.value.code == "GPU_IS_LOST"
    assert [d.lost for d in driver.devices()] == [False, True] and nv.state["inits"] == inits
    driver.lost_reinit_s = 0.0  # a while later: started again once, in case a reset brought it back
    driver.devices()
    driver.lost_reinit_s = 300.0
    assert [d.lost for d in driver.devices()] == [False, True] and nv.state["inits"] == inits + 1
    nv.state["lost"].discard(1)  # reset: back
    assert [d.lost for d in driver.devices()] == [False, False] and nv.state["inits"] == inits + 1
    nv.state["lost"].add(1)  # lost again later: found lost anew, started again once
    assert [d.lost for d in driver.devices()] == [False, True]
    driver.devices()
    assert nv.state["inits"] == inits + 2


def test_a_gpu_lost_before_the_agent_started_is_listed_with_its_index_only(monkeypatch: pytest.MonkeyPatch):
    nv = fake_pynvml()
    nv.state["lost"].add(0)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    from dynpart.agent.driver.nvml import RealNvml

    devices = RealNvml().devices()
    assert devices[0].lost and devices[0].index == 0 and devices[0].uuid == "" and not devices[0].mig_current
    assert not devices[1].lost and devices[1].name == "NVIDIA H100 80GB HBM3"


def test_processes_of_a_gpu_instance_are_read_on_every_compute_instance():
    """A GI split into two compute instances (by another tool) has two MIG devices: a process on
    the second one uses the GI too, so it must not be seen as idle."""
    from dynpart.agent.driver.nvml import RealNvml

    nv = fake_pynvml()
    nv.NVMLError_NotFound = type("NotFound", (_NVMLError,), {})  # type: ignore[attr-defined]  # see above
    nv.NVMLError_InvalidArgument = type("InvalidArgument", (_NVMLError,), {})  # type: ignore[attr-defined]
    # GPU 0: GI 1 with MIG devices "m0" (no process) and "m1" (pid 42); GI 2 with "m2" (none)
    gi_of = {"m0": 1, "m1": 1, "m2": 2}
    pids = {"m0": [], "m1": [types.SimpleNamespace(pid=42)], "m2": [], "gpu0": []}
    nv.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda handle: 4  # type: ignore[attr-defined]

    def mig_handle(handle: str, i: int) -> str:
        if i >= 3:
            raise nv.NVMLError_NotFound(6)
        return f"m{i}"

    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle  # type: ignore[attr-defined]
    nv.nvmlDeviceGetGpuInstanceId = lambda mig: gi_of[mig]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda handle: pids[handle]  # type: ignore[attr-defined]
    driver = RealNvml(nvml_module=nv)
    assert driver.processes(0, 1) == [42]
    assert driver.processes(0, 2) == [] and driver.processes(0, 3) == [] and driver.processes(0) == []
