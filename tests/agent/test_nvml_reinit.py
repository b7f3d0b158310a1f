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
