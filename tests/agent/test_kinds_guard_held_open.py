"""A node's GPU kinds with per-GPU reserved memory, the guard's choice among unhealthy candidates, and
held-open GPU instances known by GI id (helper-114's review)."""

from __future__ import annotations

from dataclasses import replace

from dynpart.agent.capability_reader import read_capability
from dynpart.agent.driver.fake import FakeNvml
from dynpart.capability import node_model
from dynpart.catalog import default_catalog


def test_gpus_of_one_product_whose_driver_reserves_differently_stay_one_kind():
    """The reserved memory is a driver figure read per GPU (nvmlMemory_v2), not the hardware's:
    two H100s of one node whose drivers reserve 480 and 512 MiB (a GPU in MIG mode next to one
    out of it, a firmware difference) must not become two kinds: a node of two kinds is not
    planned at all. The kind takes the least MPS memory of its GPUs (same product, same total)."""
    cat = default_catalog()
    drv = FakeNvml(cat.resolve("H100-80GB"), 2)
    read = drv.devices

    def devices():  # type: ignore[no-untyped-def]
        ds = read()
        return [replace(ds[0], reserved_mib=480), replace(ds[1], reserved_mib=512)]

    drv.devices = devices  # type: ignore[method-assign]
    cap, _ = read_capability(drv, cat)
    assert len(cap.kinds) == 1, cap.kinds
    assert cap.kinds[0].memory_mib == 81559 - 512
    assert node_model(cap, cat).model.mps_capacity_gb == 79


async def test_an_unhealthy_candidate_is_not_the_one_kept_for_a_bound_pod():
    """Two free devices of one resource are to be destroyed; MIG-b is listed Unhealthy. A pod
    bound here needs one: the kubelet can give it only MIG-a, so MIG-a is the one to keep (not
    MIG-b, the last candidate, while MIG-a is destroyed)."""
    from .test_mig_apply_races import MIG_1G as M
    from .test_mig_apply_races import guard_over_a_healthy_and_an_unhealthy_device

    guard, plugins = await guard_over_a_healthy_and_an_unhealthy_device()
    try:
        assert list(await guard.keep({"MIG-a": M, "MIG-b": M}, {M: ["MIG-a", "MIG-b"]})) == ["MIG-a"]
    finally:
        await plugins.close()


async def test_a_gi_id_held_open_is_forgotten_once_its_gpu_instance_is_gone():
    """A GPU instance left without its compute instance and held open is known by (GPU, GI id)
    for HELD_OPEN_S. An admin then destroys it (nvidia-smi mig -dgi): the key stays. GI ids are
    reused: a later instance at the same place gets the same id, and while it has no compute
    instance (its creation failed once) it is reported used and not destroyed when the spec
    drops it, though nothing holds it."""
    from typing import Any

    from dynpart.agent.driver.interface import GpuDriverError

    from .conftest import mig_spec
    from .test_mig_apply_races import two_3g_the_first_held_once_its_ci_goes

    rig, agent, gi = await two_3g_the_first_held_once_its_ci_goes()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@4"]}, plan="p2"))
    await agent.reconcile_once()
    assert [g.start for g in rig.driver.gpu_instances(0)] == [0, 4]  # held, without its CI
    # the admin frees and destroys it by hand
    rig.driver.before_op = None
    rig.driver.release(0, "leaked-handle", gi_id=gi)
    rig.driver.destroy_gpu_instance(0, gi)
    # the planner wants 3g.40gb@0 again: same place, same GI id; its compute instance fails once

    def ci_fails(op: Any) -> None:
        if op.op == "create_ci":
            rig.driver.before_op = None
            raise GpuDriverError("UNKNOWN", "transient")

    rig.driver.before_op = ci_fails
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p3"))
    await agent.reconcile_once()
    assert rig.driver.gi_at(0, 0) == gi
    # the planner changes its mind: 3g.40gb@0 goes. Nothing holds it
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@4"]}, plan="p4"))
    report = await agent.reconcile_once()
    assert [g.start for g in rig.driver.gpu_instances(0)] == [4], report.errors


def test_an_older_agents_h200_report_gives_the_same_capacity_to_both_sides():
    """Mixed versions during a rollout: an agent from before the reserved memory was read reports
    memory_mib 143771 (NVML's total) for an H200. The planner and that agent derive its MPS
    capacity from the same report (140 GiB), so they agree; the model is then named
    `H200-141GB~<digest>` (the catalog's gives 139), of the H200-141GB family that pods select."""
    from dynpart.capability import GpuReport, NodeCapability
    cat = default_catalog()
    cap, _ = read_capability(FakeNvml(cat.resolve("H200-141GB"), 1), cat)
    assert cap.kinds[0].memory_mib == 143771 - 616
    assert node_model(cap, cat).model is cat.models["H200-141GB"]
    old = NodeCapability(kinds=(cap.kinds[0].model_copy(update={"memory_mib": 143771}),),
                         gpus=(GpuReport(kind=0, mig=cap.gpus[0].mig),))
    model = node_model(old, cat).model
    assert (model.mps_capacity_gb, model.family_name) == (140, "H200-141GB") and model.name != "H200-141GB"
