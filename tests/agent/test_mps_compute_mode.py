"""Compute modes of MPS GPUs: a GPU with MPS slices runs in EXCLUSIVE_PROCESS (its MPS server is
its one CUDA process, as NVIDIA's MPS control daemon sets it), a GPU without slices in DEFAULT
before it is listed whole; an administrator's PROHIBITED is left alone. The driver's calls
(`compute_mode`, `set_compute_mode`) on FakeNvml and on RealNvml at its C boundary."""

from __future__ import annotations

import json

import pytest

from dynpart.agent.compute_modes import ComputeModes
from dynpart.agent.driver.fake import ContextRefused, FakeNvml
from dynpart.agent.driver.interface import (
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    NO_PERMISSION,
    PROHIBITED,
    DriverNotResponding,
    GpuDriverError,
)
from dynpart.agent.driver.nvml import RealNvml
from dynpart.agent.driver.nvml_recording import ReadOnlyViolation, fresh_pynvml, record_nvml
from dynpart.agent.loop import COMPUTE_MODE_IN_USE

from .conftest import H100, ROUND_80GIB, make_rig, mig_spec, mps_spec
from .nvml_c_double import SimulatedNvmlLibrary

TEN = "nvidia.com/gpu-10gb"


def modes(driver: FakeNvml) -> list[str]:
    return [driver.compute_mode(i) for i in range(len(driver.devices()))]


def mode_changes(driver: FakeNvml) -> list[tuple[int, str | None, str]]:
    return [(op.device, op.profile, op.result) for op in driver.ops if op.op == "set_compute_mode"]


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


# --- ComputeModes ------------------------------------------------------------------------------------


def modes_rig(count: int = 3, path=None, enabled: bool = True) -> tuple[FakeNvml, ComputeModes]:
    driver = FakeNvml(H100, count, mig_enabled=False, **ROUND_80GIB)
    return driver, ComputeModes(driver, str(path) if path else None, enabled=enabled)


async def test_a_gpu_with_slices_is_exclusive_and_set_back_to_default_once_it_has_none():
    driver, cm = modes_rig(2)
    assert await cm.sync(driver.devices(), {0}) == []
    assert modes(driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE] and cm.ours == {"GPU-fake-0000"}
    await cm.sync(driver.devices(), {0})
    assert mode_changes(driver) == [(0, EXCLUSIVE_PROCESS, "ok")]  # nothing to change: nothing set again
    await cm.sync(driver.devices(), {1})
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS] and cm.ours == {"GPU-fake-0001"}
    driver.reset(1)  # (a GPU reset forgets it): set again
    await cm.sync(driver.devices(), {1})
    assert driver.compute_mode(1) == EXCLUSIVE_PROCESS and cm.blocked == {}


async def test_modes_set_by_others_are_left_as_they_are():
    driver, cm = modes_rig(3)
    driver.set_compute_mode(1, EXCLUSIVE_PROCESS)  # an administrator's, before the GPU got slices
    driver.set_compute_mode(2, PROHIBITED)
    errors = await cm.sync(driver.devices(), {0, 1, 2})
    assert modes(driver) == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS, PROHIBITED] and cm.ours == {"GPU-fake-0000"}
    # a sliced GPU kept in PROHIBITED is listed Unhealthy (reported with the GPU's health)
    assert errors == [] and list(cm.blocked) == [2] and "PROHIBITED" in cm.blocked[2]
    assert await cm.sync(driver.devices(), set()) == [] and cm.blocked == {}
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS, PROHIBITED]  # only its own set back


@pytest.mark.parametrize("enabled", [True, False])
async def test_a_sliced_gpu_kept_in_prohibited_is_blocked_until_it_leaves_that_mode(enabled):
    """Whether the agent sets compute modes or not (`mps_exclusive_process`): no CUDA context, the
    MPS server's included, can be made on a PROHIBITED GPU, so its slices must not be admitted."""
    driver, cm = modes_rig(1, enabled=enabled)
    driver.set_compute_mode(0, PROHIBITED)  # an administrator's
    assert await cm.sync(driver.devices(), {0}) == [] and list(cm.blocked) == [0]
    assert driver.compute_mode(0) == PROHIBITED  # left as it is
    driver.set_compute_mode(0, DEFAULT_COMPUTE)  # changed back
    await cm.sync(driver.devices(), {0})
    assert cm.blocked == {} and driver.compute_mode(0) == (EXCLUSIVE_PROCESS if enabled else DEFAULT_COMPUTE)


async def test_what_it_set_is_remembered_across_a_restart_and_undone_even_turned_off(tmp_path):
    path = tmp_path / "state" / "compute-modes.json"
    driver, cm = modes_rig(2, path)
    await cm.sync(driver.devices(), {0, 1})
    assert json.loads(path.read_text())["exclusive_process"] == ["GPU-fake-0000", "GPU-fake-0001"]
    again = ComputeModes(driver, str(path), enabled=False)  # a restarted agent, the setting now off
    assert again.ours == {"GPU-fake-0000", "GPU-fake-0001"}
    await again.sync(driver.devices(), {1})
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]  # GPU 1 keeps slices: left until they go
    await again.sync(driver.devices(), set())
    assert modes(driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE] and json.loads(path.read_text())["exclusive_process"] == []
    driver.set_compute_mode(0, EXCLUSIVE_PROCESS)  # someone else's now
    await ComputeModes(driver, str(path)).sync(driver.devices(), set())
    assert driver.compute_mode(0) == EXCLUSIVE_PROCESS


async def test_a_file_from_before_the_last_boot_or_broken_says_nothing(tmp_path, monkeypatch):
    path = tmp_path / "compute-modes.json"
    path.write_text(json.dumps({"exclusive_process": ["GPU-fake-0000"], "boot": "an-earlier-boot"}))
    monkeypatch.setattr("dynpart.agent.compute_modes.boot_id", lambda: "this-boot")
    driver, cm = modes_rig(1, path)
    assert cm.ours == set()
    path.write_text("{not json")
    assert ComputeModes(driver, str(path)).ours == set()
    path.write_text(json.dumps({"exclusive_process": ["GPU-fake-0000"], "boot": "this-boot"}))
    assert ComputeModes(driver, str(path)).ours == {"GPU-fake-0000"}


async def test_refused_for_want_of_permission_it_says_so_once_and_tries_no_more():
    driver, cm = modes_rig(2)
    driver.root = False
    errors = await cm.sync(driver.devices(), {0, 1})
    assert len(errors) == 1 and errors[0].startswith("GPU 0: EXCLUSIVE_PROCESS compute mode cannot be set")
    assert "CAP_SYS_ADMIN" in errors[0] and cm.denied and cm.ours == set()
    assert await cm.sync(driver.devices(), {0, 1}) == []
    assert [c[0] for c in mode_changes(driver)] == [0]  # one try


async def test_one_it_cannot_set_back_is_blocked_until_it_can():
    driver, cm = modes_rig(2)
    await cm.sync(driver.devices(), {1})
    driver.root = False
    assert await cm.sync(driver.devices(), set()) == []  # (reported as the GPU's health)
    assert set(cm.blocked) == {1} and "EXCLUSIVE_PROCESS" in cm.blocked[1] and "needs root" in cm.blocked[1]
    assert cm.ours == {"GPU-fake-0001"}
    driver.root = True
    await cm.sync(driver.devices(), set())
    assert cm.blocked == {} and modes(driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE] and cm.ours == set()


async def test_gpus_in_mig_mode_are_not_touched_and_set_back_once_out_of_it():
    driver, cm = modes_rig(2)
    await cm.sync(driver.devices(), {0, 1})
    driver.set_mig_mode(1, True)
    await cm.sync(driver.devices(), set())
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS] and cm.ours == {"GPU-fake-0001"}
    driver.set_mig_mode(1, False)
    await cm.sync(driver.devices(), set())
    assert modes(driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE]


async def test_a_read_that_fails_is_reported_and_changes_nothing():
    driver, cm = modes_rig(1)

    def failing(index: int) -> str:
        raise GpuDriverError("UNKNOWN", "nvmlDeviceGetComputeMode: Unknown Error")

    real = driver.compute_mode
    driver.compute_mode = failing  # type: ignore[method-assign]
    assert await cm.sync(driver.devices(), {0}) == [
        "GPU 0: its compute mode cannot be read (nvmlDeviceGetComputeMode: Unknown Error)"]
    driver.compute_mode = real  # type: ignore[method-assign]
    await cm.sync(driver.devices(), {0})
    driver.compute_mode = failing  # type: ignore[method-assign]
    await cm.sync(driver.devices(), set())  # dynpart's, no slice left, its mode unknown: not offered whole
    assert set(cm.blocked) == {0} and cm.ours == {"GPU-fake-0000"}
    assert mode_changes(driver) == [(0, EXCLUSIVE_PROCESS, "ok")]


async def test_turned_off_no_gpu_is_put_in_exclusive_process():
    driver, cm = modes_rig(2, enabled=False)
    assert await cm.sync(driver.devices(), {0, 1}) == [] and driver.ops == []


class RefusingDefault:
    """`driver.set_compute_mode` fails for DEFAULT while `refuse` is true (a driver error that is
    no refusal for want of permission: the GPU stays dynpart's)."""

    def __init__(self, driver: FakeNvml):
        self.refuse = True
        self.real = driver.set_compute_mode
        driver.set_compute_mode = self  # type: ignore[method-assign]

    def __call__(self, index: int, mode: str) -> None:
        if self.refuse and mode == DEFAULT_COMPUTE:
            raise GpuDriverError("UNKNOWN", "nvmlDeviceSetComputeMode: Unknown Error")
        self.real(index, mode)


# --- the agent --------------------------------------------------------------------------------------


def advertised_health(rig) -> dict[str, dict[str, bool]]:
    return {r: {d.id: d.healthy for d in ds} for r, ds in rig.plugins.advertised().items() if ds}


async def test_the_agent_sets_the_mode_before_listing_and_reports_a_gpu_it_cannot_set_back():
    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    seen: list[tuple[str, list[str]]] = []
    real_update = rig.plugins.update

    async def update(devices_by_resource):
        seen.append((str(sorted(r for r, ds in devices_by_resource.items() if ds)), modes(rig.driver)))
        await real_update(devices_by_resource)

    rig.plugins.update = update  # type: ignore[method-assign]
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10, 10]}, plan="m1"))
    agent = rig.agent()
    await agent.reconcile_once()
    assert seen and all(m[0] == EXCLUSIVE_PROCESS for _, m in seen)  # never listed in DEFAULT
    refusing = RefusingDefault(rig.driver)
    rig.node_api.set_annotations({**mps_spec({1: [40, 40]}, plan="m2"), "dynpart.io/spec-gpu-0-20gb": None,
                                  "dynpart.io/spec-gpu-0-10gb": None, "dynpart.io/spec-gpu-0-40gb": None})
    for _ in range(3):
        report = await agent.reconcile_once()
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS]
    assert any("GPU 0 is unhealthy (left in EXCLUSIVE_PROCESS compute mode" in e for e in report.errors), report.errors
    assert advertised_health(rig)["nvidia.com/gpu"] == {"GPU-fake-0000": False}
    assert seen[-1][1] == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS]  # GPU 1's slices listed once it was exclusive
    refusing.refuse = False
    report = await agent.reconcile_once()
    assert not any("compute mode" in e for e in report.errors), report.errors
    assert advertised_health(rig)["nvidia.com/gpu"] == {"GPU-fake-0000": True}
    assert modes(rig.driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS]


async def test_a_node_switched_to_mig_sets_its_gpus_back_before_they_enter_mig_mode(tmp_path):
    """Each pass by a new agent process (restarted): what it set is known from the file only."""
    rig = make_rig(H100, 1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    file = str(tmp_path / "compute-modes.json")
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.agent(compute_modes_file=file).reconcile_once()
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS]
    order: list[tuple[str, str | None]] = []
    rig.driver.before_op = lambda op: order.append((op.op, op.profile))
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    for _ in range(3):
        await rig.agent(compute_modes_file=file).reconcile_once()
    assert order[0] == ("set_compute_mode", DEFAULT_COMPUTE) and ("set_mig_mode", "enable") in order
    assert rig.driver.layout(0) == [("7g.80gb", 0)]


async def test_a_change_whose_outcome_is_unknown_stays_dynparts_to_undo():
    """No answer in time: the mode may have been set. Forgotten, the GPU would be listed whole
    in EXCLUSIVE_PROCESS once its slices go."""
    driver, cm = modes_rig(1)
    real = driver.set_compute_mode

    def lands_then_times_out(index: int, mode: str) -> None:
        real(index, mode)
        raise DriverNotResponding("set_compute_mode(0, EXCLUSIVE_PROCESS): no answer in 120 s")

    driver.set_compute_mode = lands_then_times_out  # type: ignore[method-assign]
    errors = await cm.sync(driver.devices(), {0})
    assert len(errors) == 1 and "could not be set" in errors[0] and not cm.denied
    driver.set_compute_mode = real  # type: ignore[method-assign]
    assert driver.compute_mode(0) == EXCLUSIVE_PROCESS and cm.ours == {"GPU-fake-0000"}
    await cm.sync(driver.devices(), set())
    assert driver.compute_mode(0) == DEFAULT_COMPUTE and cm.ours == set()


async def switched_to_mig_while_set_back_fails(tmp_path):
    """A GPU with MPS slices, its node switched to MIG, and DEFAULT refused: (rig, agent, refusing)."""
    rig = make_rig(H100, 1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent(compute_modes_file=str(tmp_path / "compute-modes.json"))
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await agent.reconcile_once()
    refusing = RefusingDefault(rig.driver)
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    return rig, agent, refusing


async def test_a_gpu_that_cannot_be_set_back_does_not_enter_mig_mode_until_it_is(tmp_path):
    rig, agent, refusing = await switched_to_mig_while_set_back_fails(tmp_path)
    for _ in range(3):
        report = await agent.reconcile_once()
    assert not rig.driver.devices()[0].mig_current and modes(rig.driver) == [EXCLUSIVE_PROCESS]
    assert any(COMPUTE_MODE_IN_USE in e for e in report.errors), report.errors
    assert sum(COMPUTE_MODE_IN_USE in e for e in report.errors) == 1  # (said once, not once per pass)
    refusing.refuse = False
    for _ in range(3):
        await agent.reconcile_once()
    assert rig.driver.devices()[0].mig_current and rig.driver.layout(0) == [("7g.80gb", 0)]
    assert agent.compute_modes.ours == set()


async def test_a_restarted_agent_on_a_node_now_in_mig_mode_keeps_the_mode_while_a_pod_holds_a_slice(tmp_path):
    rig = make_rig(H100, 1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    file = str(tmp_path / "compute-modes.json")
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.agent(compute_modes_file=file).reconcile_once()
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    await rig.agent(compute_modes_file=file).reconcile_once()
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS]  # its MPS clients still run
    rig.pods.release("ns/a")
    await rig.agent(compute_modes_file=file).reconcile_once()
    assert modes(rig.driver) == [DEFAULT_COMPUTE]


async def test_the_in_use_mark_goes_once_the_gpu_is_set_back_also_without_a_spec(tmp_path):
    rig, agent, refusing = await switched_to_mig_while_set_back_fails(tmp_path)
    for _ in range(2):
        await agent.reconcile_once()
    assert agent._mig is not None and COMPUTE_MODE_IN_USE in agent._mig.mps_left.get(0, [])
    rig.node_api.labels["dynpart.io/gpu-partitioning"] = "mig"
    rig.node_api.set_annotations({"dynpart.io/spec-plan": None})  # no spec: observe only, as a MIG node
    refusing.refuse = False
    await agent.reconcile_once()
    assert modes(rig.driver) == [DEFAULT_COMPUTE] and 0 not in agent._mig.mps_left


@pytest.mark.parametrize("label", ["mps", None, "off"])
async def test_an_agent_leaving_a_node_that_left_dynpart_sets_its_gpus_back(tmp_path, label, caplog):
    """The DaemonSet takes the agent away with the node's partitioning label: on its way out the
    agent sets the GPUs it put in EXCLUSIVE_PROCESS back to DEFAULT, for NVIDIA's plugin to serve
    them whole. A stop with the label in place (a restart, an upgrade) changes nothing: the next
    agent finds them in its file."""
    import asyncio

    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.node_api.labels["dynpart.io/gpu-partitioning"] = "mps"
    file = str(tmp_path / "compute-modes.json")
    rig.node_api.set_annotations(mps_spec({0: [40, 20]}, plan="m1"))
    agent = rig.agent(compute_modes_file=file)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    for _ in range(300):
        if modes(rig.driver)[0] == EXCLUSIVE_PROCESS:
            break
        await asyncio.sleep(0.01)
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    if label is None:
        del rig.node_api.labels["dynpart.io/gpu-partitioning"]
    else:
        rig.node_api.labels["dynpart.io/gpu-partitioning"] = label
    stop.set()
    await asyncio.wait_for(task, 10)
    left = label == "mps"
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS if left else DEFAULT_COMPUTE, DEFAULT_COMPUTE]
    assert json.loads(open(file).read())["exclusive_process"] == (["GPU-fake-0000"] if left else [])
