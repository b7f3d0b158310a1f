"""What tests/agent/test_mps_compute_mode.py leaves open about ComputeModes and its call sites in
the agent's pass (found by mutation testing agent/compute_modes.py and the lines of agent/loop.py
that use it): the driver's refusals other than NO_PERMISSION leave a GPU not dynpart's, in the file
too; the file is stamped with this boot, lists its UUIDs sorted and only strings; only a GPU still
in EXCLUSIVE_PROCESS is set back; `_mps_sliced` on a node in MIG mode asks the pods only while a
GPU is dynpart's, counts MPS slices only and skips those of GPUs not listed; the problems `sync`
reports reach the pass's report in both branches; a blocked GPU is unhealthy where NVIDIA's plugin
serves the node (`_health`), and is said once in MIG's users across passes without a spec."""

from __future__ import annotations

import json

import pytest

from dynpart.agent.compute_modes import ComputeModes
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import (
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    PROHIBITED,
    GpuDriverError,
)
from dynpart.agent.kube import FakePluginPods
from dynpart.annotations import decode_status

from .conftest import H100, ROUND_80GIB, make_rig, mig_spec, mps_spec
from .test_mps_compute_mode import RefusingDefault, mode_changes, modes, modes_rig

PROHIBITED_SAID = "GPU 0 is unhealthy (in PROHIBITED compute mode, not set by dynpart"


# --- ComputeModes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [INVALID_ARGUMENT, NOT_SUPPORTED])
async def test_a_refusal_other_than_permission_leaves_the_gpu_not_dynparts_in_the_file_too(tmp_path, code):
    """The driver said the change was not made: the GPU is not dynpart's (a restarted agent must not
    set back a mode someone else sets later), and later GPUs are still tried (not `denied`)."""
    path = tmp_path / "compute-modes.json"
    driver, cm = modes_rig(2, path)
    real = driver.set_compute_mode

    def refusing(index: int, mode: str) -> None:
        if index == 0:
            raise GpuDriverError(code, f"nvmlDeviceSetComputeMode: {code}")
        real(index, mode)

    driver.set_compute_mode = refusing  # type: ignore[method-assign]
    errors = await cm.sync(driver.devices(), {0})
    assert len(errors) == 1 and errors[0].startswith("GPU 0: EXCLUSIVE_PROCESS compute mode could not be set")
    assert not cm.denied and cm.ours == set()
    assert json.loads(path.read_text())["exclusive_process"] == []  # (saved before the change, then again)
    await cm.sync(driver.devices(), {0, 1})
    assert modes(driver) == [DEFAULT_COMPUTE, EXCLUSIVE_PROCESS] and cm.ours == {"GPU-fake-0001"}


async def test_it_is_enabled_unless_told_otherwise():
    driver = FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB)
    cm = ComputeModes(driver)
    assert await cm.sync(driver.devices(), {0}) == []
    assert modes(driver) == [EXCLUSIVE_PROCESS] and cm.ours == {"GPU-fake-0000"}


async def test_the_file_is_stamped_with_this_boot_and_lists_the_uuids_sorted(tmp_path, monkeypatch):
    path = tmp_path / "compute-modes.json"
    monkeypatch.setattr("dynpart.agent.compute_modes.boot_id", lambda: "boot-a")
    driver, cm = modes_rig(8, path)
    await cm.sync(driver.devices(), set(range(8)))
    assert json.loads(path.read_text()) == {"boot": "boot-a",
                                            "exclusive_process": [f"GPU-fake-{i:04d}" for i in range(8)]}
    assert ComputeModes(driver, str(path)).ours == {f"GPU-fake-{i:04d}" for i in range(8)}
    monkeypatch.setattr("dynpart.agent.compute_modes.boot_id", lambda: "boot-b")  # rebooted: all DEFAULT again
    assert ComputeModes(driver, str(path)).ours == set()


async def test_a_file_whose_list_holds_anything_but_uuids_says_nothing(tmp_path, monkeypatch):
    path = tmp_path / "compute-modes.json"
    monkeypatch.setattr("dynpart.agent.compute_modes.boot_id", lambda: "this-boot")
    path.write_text(json.dumps({"exclusive_process": ["GPU-fake-0000", 7], "boot": "this-boot"}))
    driver = FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB)
    cm = ComputeModes(driver, str(path))
    assert cm.ours == set()
    await cm.sync(driver.devices(), {0})  # (a set of str and int could not be saved sorted)
    assert json.loads(path.read_text())["exclusive_process"] == ["GPU-fake-0000"]


async def test_only_a_gpu_still_in_exclusive_process_is_set_back():
    """Its mode changed since (a GPU reset's DEFAULT, an administrator's PROHIBITED): no longer
    dynpart's to undo, and not changed."""
    driver, cm = modes_rig(2)
    await cm.sync(driver.devices(), {0, 1})
    driver.reset(0)
    driver.set_compute_mode(1, PROHIBITED)
    driver.ops.clear()
    assert await cm.sync(driver.devices(), set()) == []
    assert modes(driver) == [DEFAULT_COMPUTE, PROHIBITED] and cm.ours == set() and cm.blocked == {}
    assert mode_changes(driver) == []


# --- the agent's pass ---------------------------------------------------------------------------------


async def test_a_mode_that_keeps_slices_from_working_is_reported_by_an_mps_pass():
    rig = make_rig(H100, 1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.driver.set_compute_mode(0, PROHIBITED)  # an administrator's
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    agent = rig.agent()
    report = await agent.reconcile_once()
    assert any(e.startswith(PROHIBITED_SAID) for e in report.errors), report.errors
    # its slices listed Unhealthy: the kubelet admits no pod to them
    listed = rig.plugins.advertised()["nvidia.com/gpu-40gb"]
    assert len(listed) == 2 and not any(d.healthy for d in listed)
    assert decode_status(rig.node_api.annotations, H100, node="node-1").unhealthy == (0,)
    rig.driver.set_compute_mode(0, DEFAULT_COMPUTE)  # changed back: healthy again, and made exclusive
    report = await agent.reconcile_once()
    assert all(d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"]), report.errors
    assert rig.driver.compute_mode(0) == EXCLUSIVE_PROCESS


async def test_a_mode_that_keeps_slices_left_from_working_is_reported_by_a_mig_pass():
    """Leaving MPS mode, a slice a pod holds stays: its GPU's mode is still checked and reported."""
    rig = make_rig(H100, 1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await agent.reconcile_once()
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    rig.driver.set_compute_mode(0, PROHIBITED)  # an administrator's, over dynpart's
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    report = await agent.reconcile_once()
    assert any(e.startswith(PROHIBITED_SAID) for e in report.errors), report.errors
    assert not rig.driver.devices()[0].mig_current


async def restarted_on_mig(tmp_path, *assignments: tuple[str, str, str]):
    """GPU 0 put in EXCLUSIVE_PROCESS by an agent (its MPS slices then gone), the node now in MIG
    mode (GPU 1 in it), pods holding `assignments`; a restarted agent's first pass."""
    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    file = str(tmp_path / "compute-modes.json")
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.agent(compute_modes_file=file).reconcile_once()
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    for pod, resource, device in assignments:
        rig.pods.assign(pod, resource, device)
    rig.node_api.set_annotations({**mig_spec({1: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    agent = rig.agent(compute_modes_file=file)
    report = await agent.reconcile_once()
    return rig, agent, report


async def test_a_time_sliced_whole_gpu_is_no_mps_slice(tmp_path):
    """NVIDIA's plugin names a time-sliced GPU's replicas `<uuid>::<n>`, as dynpart's MPS slices: a
    pod holding one holds no MPS slice, and the GPU is set back."""
    rig, _, _ = await restarted_on_mig(tmp_path, ("ns/t", "nvidia.com/gpu", "GPU-fake-0000::1"))
    assert modes(rig.driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE]


async def test_a_slice_of_a_gpu_not_listed_is_skipped(tmp_path):
    rig, _, _ = await restarted_on_mig(tmp_path, ("ns/x", "nvidia.com/gpu-40gb", "GPU-gone::0"))
    assert modes(rig.driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE]


async def test_with_no_gpu_of_dynparts_a_mig_pass_sets_no_mode(tmp_path):
    """An agent that put no GPU in EXCLUSIVE_PROCESS (none in its file), on a node in MIG mode with
    a GPU left whole and a pod holding an MPS slice of it: that GPU is not put in EXCLUSIVE_PROCESS
    (only MPS mode does) and its pods are not asked."""
    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    rig.node_api.set_annotations(mig_spec({1: ["7g.80gb@0"]}, plan="g1"))
    agent = rig.agent(compute_modes_file=str(tmp_path / "compute-modes.json"))
    for _ in range(3):
        await agent.reconcile_once()
    assert rig.driver.devices()[1].mig_current and not rig.driver.devices()[0].mig_current
    assert modes(rig.driver) == [DEFAULT_COMPUTE, DEFAULT_COMPUTE] and mode_changes(rig.driver) == []


async def test_where_nvidias_plugin_serves_the_node_a_gpu_not_set_back_is_unhealthy_beside_the_drivers():
    """Leaving MPS mode for MIG with NVIDIA's plugin: the agent's plugin serves nothing, its health
    is read for the planner (`_health`): the driver's problems and the GPUs not set back."""
    rig = make_rig(H100, 2, mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent(plugin_pods=FakePluginPods())
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await agent.reconcile_once()
    assert modes(rig.driver) == [EXCLUSIVE_PROCESS, DEFAULT_COMPUTE]
    RefusingDefault(rig.driver)
    rig.driver.unhealthy[1] = "XID 48 (double-bit ECC error)"
    rig.node_api.set_annotations({**mig_spec({1: ["7g.80gb@0"]}, plan="g1"), "dynpart.io/spec-gpu-0-40gb": None})
    for _ in range(3):
        report = await agent.reconcile_once()
    assert not agent._serving()
    assert set(agent.unhealthy) == {0, 1} and agent.unhealthy[1] == "XID 48 (double-bit ECC error)"
    assert agent.unhealthy[0].startswith("left in EXCLUSIVE_PROCESS compute mode")
    assert any(e.startswith("GPU 0 is unhealthy (left in EXCLUSIVE_PROCESS") for e in report.errors), report.errors
