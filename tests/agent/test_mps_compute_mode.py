"""Compute modes of MPS GPUs: a GPU with MPS slices runs in EXCLUSIVE_PROCESS (its MPS server is
its one CUDA process, as NVIDIA's MPS control daemon sets it), a GPU without slices in DEFAULT
before it is listed whole; an administrator's PROHIBITED is left alone. The driver's calls
(`compute_mode`, `set_compute_mode`) on FakeNvml and on RealNvml at its C boundary."""

from __future__ import annotations

import pytest

from dynpart.agent.driver.fake import ContextRefused, FakeNvml
from dynpart.agent.driver.interface import (
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    NO_PERMISSION,
    PROHIBITED,
    GpuDriverError,
)
from dynpart.agent.driver.nvml import RealNvml
from dynpart.agent.driver.nvml_recording import ReadOnlyViolation, fresh_pynvml, record_nvml
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.mps_plugin import MpsPluginAgent
from dynpart.agent.podresources import FakePodResources

from .conftest import H100, ROUND_80GIB, make_rig, mps_spec
from .nvml_c_double import SimulatedNvmlLibrary

TEN = "nvidia.com/gpu-10gb"


def modes(driver: FakeNvml) -> list[str]:
    return [driver.compute_mode(i) for i in range(len(driver.devices()))]


def mode_changes(driver: FakeNvml) -> list[tuple[int, str | None, str]]:
    return [(op.device, op.profile, op.result) for op in driver.ops if op.op == "set_compute_mode"]


def direct(count: int = 2, *, exclusive_process: bool = True) -> tuple[FakeNvml, FakePodResources, MpsPluginAgent]:
    driver = FakeNvml(H100, count, mig_enabled=False, **ROUND_80GIB)
    pods = FakePodResources()
    return driver, pods, MpsPluginAgent(driver, pods, 80, daemon=FakeMpsDaemon(),
                                        exclusive_process=exclusive_process)


# --- the fake driver ----------------------------------------------------------------------------


def test_the_fake_sets_compute_modes_as_root_only_and_forgets_them_at_a_reset_or_reboot():
    driver = FakeNvml(H100, 2, mig_enabled=False)
    assert modes(driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE]
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]
    with pytest.raises(GpuDriverError) as bad:
        driver.set_compute_mode(0, "EXCLUSIVE_THREAD")
    assert bad.value.code == "INVALID_ARGUMENT"
    driver.root = False
    with pytest.raises(GpuDriverError) as refused:
        driver.set_compute_mode(1, DEFAULT_COMPUTE)
    assert refused.value.code == NO_PERMISSION and driver.compute_mode(1) == EXCLUSIVE_PROCESS
    assert mode_changes(driver) == [(1, EXCLUSIVE_PROCESS, "ok"), (0, "EXCLUSIVE_THREAD", "INVALID_ARGUMENT"),
                                    (1, DEFAULT_COMPUTE, NO_PERMISSION)]
    driver.reset(1)
    assert driver.compute_mode(1) == DEFAULT_COMPUTE
    driver.root = True
    driver.set_compute_mode(0, PROHIBITED)
    driver.reboot()
    assert modes(driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE]


def test_the_fakes_compute_modes_decide_which_processes_get_a_context():
    driver = FakeNvml(H100, 1, mig_enabled=False)
    driver.attach(0, 10)
    driver.attach(0, 11)  # DEFAULT: any number
    driver.detach(0, 11)
    driver.set_compute_mode(0, EXCLUSIVE_PROCESS)
    driver.attach(0, 10)  # (the one it has)
    with pytest.raises(ContextRefused, match="EXCLUSIVE_PROCESS.*process 10"):
        driver.attach(0, 12)
    driver.attach(0, 13, through_mps=True)  # an MPS client shares its server's context
    assert driver.processes(0) == [10, 13]
    driver.detach(0, 10)
    driver.detach(0, 13)
    driver.attach(0, 12)  # the GPU is free again
    driver.set_compute_mode(0, PROHIBITED)
    with pytest.raises(ContextRefused, match="PROHIBITED"):
        driver.attach(0, 14, through_mps=True)


# --- RealNvml at the C boundary ---------------------------------------------------------------


def real_on(lib: SimulatedNvmlLibrary) -> RealNvml:
    nv = fresh_pynvml()
    nv.nvmlLib = lib
    return RealNvml(nv)


def test_real_nvml_reads_and_sets_the_compute_mode_with_nvmls_values():
    lib = SimulatedNvmlLibrary(H100, "NVIDIA H100 80GB HBM3", 81559, mig=False)
    driver = real_on(lib)
    try:
        assert driver.compute_mode(0) == DEFAULT_COMPUTE
        driver.set_compute_mode(0, EXCLUSIVE_PROCESS)
        assert lib.compute_mode == 3 and driver.compute_mode(0) == EXCLUSIVE_PROCESS
        driver.set_compute_mode(0, PROHIBITED)
        assert lib.compute_mode == 2 and driver.compute_mode(0) == PROHIBITED
        driver.set_compute_mode(0, DEFAULT_COMPUTE)
        assert lib.compute_mode == 0
        with pytest.raises(GpuDriverError, match="not one of"):
            driver.set_compute_mode(0, "exclusive")
        lib.compute_mode = 1  # EXCLUSIVE_THREAD: no driver sets it any more
        with pytest.raises(GpuDriverError, match="compute mode 1"):
            driver.compute_mode(0)
        lib.root = False
        with pytest.raises(GpuDriverError) as refused:
            driver.set_compute_mode(0, EXCLUSIVE_PROCESS)
        assert refused.value.code == NO_PERMISSION and lib.compute_mode == 1
    finally:
        driver.close()


def test_a_recording_session_reads_the_compute_mode_and_refuses_to_set_it():
    lib = SimulatedNvmlLibrary(H100, "NVIDIA H100 80GB HBM3", 81559, mig=False)
    lib.compute_mode = 3
    with record_nvml(lib) as (driver, recording):
        assert driver.compute_mode(0) == EXCLUSIVE_PROCESS
        with pytest.raises(ReadOnlyViolation, match="not a read"):
            driver.set_compute_mode(0, DEFAULT_COMPUTE)
    assert lib.compute_mode == 3 and "nvmlDeviceSetComputeMode" not in lib.calls
    assert any(c["fn"] == "nvmlDeviceGetComputeMode" for c in recording.calls)


# --- the MPS pass ---------------------------------------------------------------------------------


async def test_a_gpu_with_slices_is_exclusive_and_one_without_back_in_default():
    driver, _, mps = direct(2)
    result = await mps.apply({0: [40, 40]})
    assert not result.errors, result.errors
    assert modes(driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    assert mode_changes(driver) == [(0, EXCLUSIVE_PROCESS, "ok")]
    await mps.apply({0: [40, 40]})
    assert len(mode_changes(driver)) == 1  # nothing to change: nothing set again
    await mps.apply({1: [10]})  # GPU 0's slices go, GPU 1 gets one
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]
    assert all(mps.serves_whole(f"GPU-fake-{i:04d}") for i in (0, 1))


async def test_what_something_else_changed_is_put_right_and_prohibited_is_left_alone():
    driver, _, mps = direct(3)
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)  # left by an earlier MPS time, or another tool
    driver.set_compute_mode(2, PROHIBITED)  # an administrator's
    result = await mps.apply({0: [40], 2: [40]})
    assert modes(driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE, PROHIBITED]
    assert [e for e in result.errors if "compute mode" in e] == [
        "GPU 2 is in PROHIBITED compute mode (not set by dynpart): no MPS server can run on it, its slices "
        "serve no pod"]
    driver.reset(0)  # (a GPU reset forgets it)
    await mps.apply(None)
    assert driver.compute_mode(0) == EXCLUSIVE_PROCESS
    result = await mps.apply({0: [40]})
    assert driver.compute_mode(2) == PROHIBITED and not any("compute mode" in e for e in result.errors)


async def test_without_root_the_slices_are_listed_and_a_gpu_left_exclusive_is_not_offered_whole():
    driver, _, mps = direct(2)
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)
    driver.root = False
    result = await mps.apply({0: [40, 40]})
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]
    assert any(e.startswith("GPU 0: EXCLUSIVE_PROCESS compute mode could not be set") for e in result.errors)
    assert any(e.startswith("GPU 1 could not be set back to DEFAULT compute mode from EXCLUSIVE_PROCESS")
               for e in result.errors), result.errors
    assert mps.view(0) == ((40, 40), (0, 1)) and mps.serves("GPU-fake-0000")  # MPS as before, less guarded
    assert not mps.serves_whole("GPU-fake-0001") and mps.serves_whole("GPU-fake-0000")
    driver.root = True
    result = await mps.apply({0: [40, 40]})
    assert not result.errors and modes(driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    assert mps.serves_whole("GPU-fake-0001")


async def test_turned_off_no_compute_mode_is_read_or_changed():
    driver, _, mps = direct(2, exclusive_process=False)
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)
    driver.ops.clear()
    reads: list[int] = []
    real = driver.compute_mode
    driver.compute_mode = lambda index: reads.append(index) or real(index)  # type: ignore[method-assign]
    result = await mps.apply({0: [40]})
    assert not result.errors and modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]
    assert driver.ops == [] and reads == [0, 1]  # (only this test's own reads, by `modes`)
    assert mps.serves_whole("GPU-fake-0001")


async def test_gpus_in_mig_mode_are_left_as_they_are():
    driver = FakeNvml(H100, 2, mig_enabled=False, **ROUND_80GIB)
    driver.set_mig_mode(1, True)
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)
    driver.ops.clear()
    mps = MpsPluginAgent(driver, FakePodResources(), 80, daemon=FakeMpsDaemon())
    await mps.apply({0: [40]})
    assert modes(driver) == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS] and mode_changes(driver) == [
        (0, EXCLUSIVE_PROCESS, "ok")]


async def test_a_read_that_fails_is_reported_and_changes_nothing():
    driver, _, mps = direct(1)
    real = driver.compute_mode

    def failing(index: int) -> str:
        raise GpuDriverError("UNKNOWN", "nvmlDeviceGetComputeMode: Unknown Error")

    driver.compute_mode = failing  # type: ignore[method-assign]
    result = await mps.apply({0: [40]})
    assert "GPU 0: its compute mode cannot be read (nvmlDeviceGetComputeMode: Unknown Error)" in result.errors
    assert mode_changes(driver) == [] and mps.serves_whole("GPU-fake-0000")
    driver.compute_mode = real  # type: ignore[method-assign]


# --- the agent: what it advertises ------------------------------------------------------------------


async def test_the_agent_lists_a_gpu_it_cannot_set_back_to_default_unhealthy_until_it_can():
    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10, 10]}, plan="m1"))
    agent = rig.agent()
    await agent.reconcile_once()
    assert [rig.driver.compute_mode(i) for i in (0, 1)] == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    rig.driver.set_compute_mode(1, EXCLUSIVE_PROCESS)
    rig.driver.root = False
    report = await agent.reconcile_once()
    assert any("GPU 1 could not be set back to DEFAULT" in e for e in report.errors), report.errors
    assert rig.plugins is not None
    whole = {d.id: d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu"]}
    assert whole == {"GPU-fake-0001": False}
    assert all(d.healthy for d in rig.plugins.advertised()[TEN])
    rig.driver.root = True
    report = await agent.reconcile_once()
    assert not any("compute mode" in e for e in report.errors), report.errors
    assert {d.id: d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu"]} == {"GPU-fake-0001": True}
    assert rig.driver.compute_mode(1) == DEFAULT_COMPUTE
