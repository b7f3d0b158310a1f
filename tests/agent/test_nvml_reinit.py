"""RealNvml starts NVML again after a driver error that leaves it useless, instead of failing
every call until the agent restarts. A stand-in `pynvml` module plays the driver (no GPU in CI)."""

from __future__ import annotations

import sys
import types

import pytest

from dynpart.agent.driver.interface import GpuDriverError


class _NVMLError(Exception):
    def __init__(self, value: int):
        self.value = value
        super().__init__(f"NVML error {value}")


def fake_pynvml() -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVMLError = _NVMLError  # type: ignore[attr-defined]  # module attributes set by hand
    nv.NVML_ERROR_UNINITIALIZED = 1  # type: ignore[attr-defined]  # as in nvml.h
    nv.NVML_ERROR_GPU_IS_LOST = 15  # type: ignore[attr-defined]  # as in nvml.h
    state = {"inits": 0, "shutdowns": 0, "lost": False}
    nv.state = state  # type: ignore[attr-defined]  # the test reads it

    def init() -> None:
        state["inits"] += 1
        state["lost"] = False

    def shutdown() -> None:
        state["shutdowns"] += 1

    def count() -> int:
        if state["lost"]:
            raise _NVMLError(15)
        return 2

    nv.nvmlInit, nv.nvmlShutdown, nv.nvmlDeviceGetCount = init, shutdown, count  # type: ignore[attr-defined]  # see above
    return nv


def test_nvml_is_started_again_after_the_gpu_is_lost(monkeypatch: pytest.MonkeyPatch):
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    from dynpart.agent.driver.nvml import RealNvml

    driver = RealNvml()
    assert driver._call(nv.nvmlDeviceGetCount) == 2 and nv.state["inits"] == 1
    nv.state["lost"] = True  # the driver loses the GPU (or is reloaded)
    with pytest.raises(GpuDriverError) as e:
        driver._call(nv.nvmlDeviceGetCount)
    assert e.value.code == "GPU_IS_LOST"
    assert driver._call(nv.nvmlDeviceGetCount) == 2, "the next call starts NVML again"
    assert (nv.state["inits"], nv.state["shutdowns"]) == (2, 1)


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
