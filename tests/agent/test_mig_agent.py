"""The MIG agent on FakeNvml: never touches a used instance, converges after a crash, enables MIG
mode only when asked and idle."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.agent import mig_agent as mig_agent_module
from dynpart.agent.driver.fake import FakeNvml, SimulatedCrash
from dynpart.agent.driver.interface import MigModePending
from dynpart.agent.driver.nvml import RealNvml
from dynpart.agent.driver.nvml_recording import fresh_pynvml
from dynpart.agent.mig_agent import MigAgent
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import STATUS_ERROR, STATUS_PLAN, annotation_patch, decode_status
from dynpart.capability import decode_capability
from dynpart.mig import MigRules, feasible_geometries, slot_mask

from .conftest import A100, H100, Rig, make_rig, mig_spec, placements
from .nvml_c_double import SimulatedNvmlLibrary

DESTROYS = ("destroy_ci", "destroy_gi")


def touched(driver: FakeNvml, gpu: int, gi_ids: set[int]) -> list:
    return [o for o in driver.ops if o.op in DESTROYS and o.device == gpu and o.gi_id in gi_ids]


async def test_never_touches_a_used_instance(rig: Rig):
    g0 = rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    g1 = rig.carve(1, *(f"1g.10gb@{s}" for s in range(7)))
    rig.run_pod("ns/a", 0, g0["3g.40gb@0"])                              # process + assignment
    rig.run_pod("ns/b", 1, g1["1g.10gb@2"], process=False)               # assigned, not started yet
    pid_c = rig.run_pod("ns/c", 1, g1["1g.10gb@5"], assigned=False)      # a process only
    used = {0: {g0["3g.40gb@0"]}, 1: {g1["1g.10gb@2"], g1["1g.10gb@5"]}}
    # the new spec re-carves both GPUs
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"], 1: ["4g.40gb@0", "3g.40gb@4"]}, plan="p1"))

    report = await rig.agent().reconcile_once()

    for gpu, ids in used.items():
        assert touched(rig.driver, gpu, ids) == [], "a used instance was destroyed or tried"
    assert rig.driver.layout(0) == [("3g.40gb", 0)]  # the free 3g@4 went; 7g cannot be made
    assert rig.driver.layout(1) == [("1g.10gb", 2), ("1g.10gb", 5)]
    assert not [o for o in rig.driver.ops if o.op == "create_gi"]  # every wanted instance overlaps a used one
    text = "\n".join(report.errors)
    assert "cannot create 7g.80gb@0: 3g.40gb@0 (pid 1001, pod ns/a) in use there" in text
    assert "cannot create 4g.40gb@0: 1g.10gb@2 (pod ns/b) in use there" in text
    assert "cannot create 3g.40gb@4: 1g.10gb@5 (pid 1003) in use there" in text
    assert "3g.40gb@0 is in use (pid 1001, pod ns/a) but the spec does not have it" in text
    # the agent did what it safely could; the plan is not acknowledged (the GPUs do not hold it:
    # the planner revokes it after its time-out) and the status says why
    ann = rig.node_api.annotations
    assert STATUS_PLAN not in ann and "cannot create 7g.80gb@0" in ann[STATUS_ERROR]
    assert "plan p1 is not acknowledged yet: the GPUs do not hold it" in ann[STATUS_ERROR]
    status = decode_status(ann, H100, node="node-1")
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[0].mig] == [("3g.40gb", 0, True)]
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[1].mig] == [
        ("1g.10gb", 2, True), ("1g.10gb", 5, True)]

    # the pods finish: the next pass completes the plan
    rig.stop_pod("ns/a", 1001)
    rig.stop_pod("ns/b")
    rig.stop_pod("ns/c", pid_c)
    report = await rig.agent().reconcile_once()
    assert report.errors == [] and report.plan_id == "p1"
    assert rig.driver.layout(0) == [("7g.80gb", 0)]
    assert rig.driver.layout(1) == [("4g.40gb", 0), ("3g.40gb", 4)]
    assert STATUS_ERROR not in rig.node_api.annotations


async def test_last_moment_recheck_of_pods(rig: Rig):
    """A pod gets the instance between the agent's first look and the destroy: it is kept."""
    g = rig.carve(0, "1g.10gb@0", "1g.10gb@1")
    uuid = rig.uuid(0, g["1g.10gb@1"])

    def late_assignment(call: int) -> None:
        if call == 2:  # the first list() is the observation; the second the re-check
            rig.pods.assign("ns/late", "nvidia.com/mig-1g.10gb", uuid)

    rig.pods.on_list = late_assignment
    agent = MigAgent(rig.driver, rig.pods, H100)
    result = await agent.apply({0: placements("2g.20gb@0")})
    assert touched(rig.driver, 0, {g["1g.10gb@1"]}) == []
    assert ("1g.10gb", 1) in rig.driver.layout(0)
    assert any("was taken (pod ns/late) just before" in e for e in result.errors)
    assert any("2g.20gb@0 not created: 1g.10gb@1 is still there" in e for e in result.errors)


async def test_driver_in_use_refusal_is_reported(rig: Rig):
    """A process starts after the re-check: NVML refuses with IN_USE; the pass goes on."""
    g = rig.carve(0, "1g.10gb@0", "1g.10gb@6")

    def start_process(op) -> None:
        if op.op == "destroy_ci" and op.gi_id == g["1g.10gb@0"] and not rig.driver.processes(0, op.gi_id):
            rig.driver.attach(0, 99, op.gi_id)

    rig.driver.before_op = start_process
    result = await MigAgent(rig.driver, rig.pods, H100).apply({0: placements("3g.40gb@4")})
    assert any("destroying 1g.10gb@0 failed" in e and "processes [99]" in e for e in result.errors)
    assert rig.driver.layout(0) == [("1g.10gb", 0), ("3g.40gb", 4)]


async def test_noop_when_converged(rig: Rig):
    rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}))
    await rig.agent().reconcile_once()
    assert rig.driver.ops == []


async def test_no_spec_changes_nothing(rig: Rig):
    rig.carve(0, "3g.40gb@0")
    report = await rig.agent().reconcile_once()
    assert rig.driver.ops == [] and report.plan_id is None
    assert rig.node_api.annotations["dynpart.io/status-gpu-0-3g.40gb-free"] == "1@0"
    assert STATUS_PLAN not in rig.node_api.annotations


async def test_half_created_instance_is_completed(rig: Rig):
    p = H100.profile("4g.40gb")
    rig.driver.create_gpu_instance(0, p.gi_profile_id, 0, 4)  # a GI without its compute instance
    rig.node_api.set_annotations(mig_spec({0: ["4g.40gb@0"]}))
    await rig.agent().reconcile_once()
    assert rig.driver.layout(0) == [("4g.40gb", 0)]
    assert [o.op for o in rig.driver.ops if o.result == "ok"] == ["create_gi", "create_ci"]


async def test_enables_mig_mode_only_when_asked_and_idle():
    rig = make_rig(H100, 2, mig_enabled=False)
    rig.driver.attach(1, 555)  # GPU 1 runs something
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["7g.80gb@0"]}))
    report = await rig.agent().reconcile_once()
    devices = rig.driver.devices()
    assert devices[0].mig_current and not devices[1].mig_current
    assert rig.driver.layout(0) == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert any("GPU 1: MIG mode is disabled and the GPU is in use (pid 555)" in e for e in report.errors)
    # a GPU the spec leaves empty is not switched
    rig2 = make_rig(H100, 2, mig_enabled=False)
    rig2.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    await rig2.agent().reconcile_once()
    assert [d.mig_current for d in rig2.driver.devices()] == [True, False]


async def test_mig_mode_pending_reset():
    rig = make_rig(A100, 1, mig_enabled=False, mode_needs_reset=True)
    rig.node_api.set_annotations(mig_spec({0: ["7g.40gb@0"]}))
    agent = rig.agent()
    report = await agent.reconcile_once()
    assert any("pending until the GPU is reset (activation status RESET_REQUIRED)" in e for e in report.errors)
    # the node cannot hold the plan: not acknowledged, and the capability report says why
    assert report.plan_id is None and "dynpart.io/status-plan" not in rig.node_api.annotations
    assert decode_capability(rig.node_api.annotations["dynpart.io/status-capability"]).gpus[0].mig == "on-pending"
    for _ in range(3):  # the driver said only a reset applies it: not asked again, the same advice
        report = await agent.reconcile_once()
        assert any("pending until the GPU is reset" in e for e in report.errors) and report.plan_id is None
    assert [o.op for o in rig.driver.ops] == ["set_mig_mode"]
    # a new agent process does not know why it is pending: it asks once, then no more
    agent = rig.agent()
    await agent.reconcile_once()
    await agent.reconcile_once()
    assert [o.op for o in rig.driver.ops] == ["set_mig_mode"] * 2
    rig.driver.reset(0)
    report = await agent.reconcile_once()
    assert report.errors == [] and rig.driver.layout(0) == [("7g.40gb", 0)] and report.plan_id == "p1"


async def test_mig_mode_left_pending_by_a_gpu_held_open_is_asked_again_after_a_growing_wait(monkeypatch):
    """A monitoring client (DCGM, dcgm-exporter, GFD) holds the GPU without a compute process:
    nvmlDeviceSetMigMode succeeds but the mode stays pending (activation status IN_USE). The
    agent asks again after 30 s, then after twice as long each time up to 10 minutes (each ask
    takes the idle GPU from the kubelet's list a moment: asked at every pass, every 10 s, for as
    long as dcgm-exporter runs, it was; helper-145), and the plan is applied once the client
    lets go."""
    clock = [1000.0]
    monkeypatch.setattr(mig_agent_module, "_now", lambda: clock[0])
    rig = make_rig(A100, 1, mig_enabled=False)
    rig.driver.hold(0, "dcgm-exporter")
    rig.node_api.set_annotations(mig_spec({0: ["3g.20gb@0", "3g.20gb@4"]}))
    agent = rig.agent()

    def asks() -> list[str]:
        return [o.result for o in rig.driver.ops if o.op == "set_mig_mode"]

    waits = [0.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0]
    for n, wait in enumerate(waits, start=1):
        if wait:
            clock[0] += wait - 1
            await agent.reconcile_once()  # a pass before the wait is over: not asked
            assert len(asks()) == n - 1
            clock[0] += 1
        report = await agent.reconcile_once()
        assert asks() == ["pending:IN_USE"] * n
        assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
        status_error = rig.node_api.annotations[STATUS_ERROR]
        assert "plan not applied: GPU 0: MIG mode enable is pending" in status_error
        assert "activation status IN_USE" in status_error and "DCGM" in status_error
        assert "pending until the GPU is reset" not in status_error
    assert decode_capability(rig.node_api.annotations["dynpart.io/status-capability"]).gpus[0].mig == "on-pending"
    rig.driver.release(0, "dcgm-exporter")
    clock[0] += 600  # (at most 10 minutes later)
    report = await agent.reconcile_once()
    assert asks()[-1] == "ok" and rig.driver.devices()[0].mig_current
    assert report.errors == [] and report.plan_id == "p1"
    assert rig.driver.layout(0) == [("3g.20gb", 0), ("3g.20gb", 4)]


@pytest.mark.usefixtures("ask_enable_at_once")
async def test_a_pending_gpu_with_a_process_or_pod_is_not_asked_again():
    rig = make_rig(A100, 1, mig_enabled=False)
    rig.driver.hold(0)
    rig.node_api.set_annotations(mig_spec({0: ["7g.40gb@0"]}))
    agent = rig.agent()
    await agent.reconcile_once()
    assert len(rig.driver.ops) == 1 and rig.driver.devices()[0].mig_pending
    rig.driver.release(0)
    rig.driver.attach(0, 4242)  # a process, then also a pod holding the whole GPU
    rig.pods.assign("ns/whole", "nvidia.com/gpu", rig.driver.devices()[0].uuid)
    for _ in range(2):
        report = await agent.reconcile_once()
        assert len(rig.driver.ops) == 1, "a GPU in use was asked to change its MIG mode"
        assert any("MIG mode enable is pending and the GPU is in use (pid 4242, pod ns/whole)" in e
                   for e in report.errors), report.errors
        assert report.plan_id is None
    rig.driver.detach(0, 4242)
    rig.pods.release("ns/whole")
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and rig.driver.layout(0) == [("7g.40gb", 0)]


@pytest.mark.usefixtures("ask_enable_at_once")
async def test_a_pending_enable_is_asked_again_after_the_planner_gave_the_gpu_up():
    """The planner revokes a plan its agent did not acknowledge and leaves a GPU whose MIG mode
    is pending out of its plans: the spec no longer wants it carved, yet the enable the agent
    asked for is completed once the GPU is idle, and the revoking plan is acknowledged."""
    rig = make_rig(A100, 2, mig_enabled=False)
    rig.driver.hold(1, "nv-hostengine")
    rig.node_api.set_annotations(mig_spec({0: ["7g.40gb@0"], 1: ["7g.40gb@0"]}, plan="p1"))
    agent = rig.agent()
    report = await agent.reconcile_once()
    assert report.plan_id is None and rig.driver.layout(0) == [("7g.40gb", 0)]
    revocation = mig_spec({0: ["7g.40gb@0"]}, plan="p2")  # GPU 1 left empty
    rig.node_api.set_annotations(annotation_patch(rig.node_api.annotations, revocation))
    report = await agent.reconcile_once()
    assert report.plan_id == "p2"  # GPU 1 is not wanted carved: the plan holds
    assert any(e.startswith("GPU 1: MIG mode enable is pending: ") and "activation status IN_USE" in e
               for e in report.errors), report.errors
    assert [o.result for o in rig.driver.ops if o.op == "set_mig_mode" and o.device == 1] == ["pending:IN_USE"] * 2
    rig.driver.release(1, "nv-hostengine")
    report = await agent.reconcile_once()
    assert rig.driver.devices()[1].mig_current and report.errors == [] and report.plan_id == "p2"
    assert rig.driver.layout(1) == []


def test_real_nvml_reports_the_activation_status_of_set_mig_mode():
    """RealNvml down to nvidia-ml-py's ctypes call: nvmlDeviceSetMigMode answers SUCCESS and
    writes the activation status; anything but SUCCESS is MigModePending with its name."""

    class SetMigModeLibrary(SimulatedNvmlLibrary):
        activation = 0

        def c_nvmlDeviceSetMigMode(self, handle, mode, activation_status) -> int:
            activation_status._obj.value = self.activation
            return 0

    lib = SetMigModeLibrary(A100, "NVIDIA A100-SXM4-40GB", 40960, mig=False)
    nv = fresh_pynvml()
    nv.nvmlLib = lib
    driver = RealNvml(nv)
    driver.set_mig_mode(0, True)  # activated
    for status, code in ((nv.NVML_ERROR_IN_USE, "IN_USE"), (nv.NVML_ERROR_RESET_REQUIRED, "RESET_REQUIRED")):
        lib.activation = status
        with pytest.raises(MigModePending) as e:
            driver.set_mig_mode(0, True)
        assert e.value.code == code and e.value.retryable == (code == "IN_USE")
    assert "pending until the GPU is reset" in str(e.value)
    assert lib.calls.count("nvmlDeviceSetMigMode") == 3
    driver.close()


async def test_catalog_mismatch_suspends_changes(rig: Rig):
    rig.carve(0, "1g.10gb@0")
    real_info = rig.driver.profile_info

    def lying(index, nvml_name):
        info = real_info(index, nvml_name)
        if nvml_name.endswith("_3_SLICE"):
            return type(info)(info.profile_id + 100, info.slices, info.instance_count, info.memory_mib)
        return info

    rig.driver.profile_info = lying  # type: ignore[method-assign]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    report = await rig.agent().reconcile_once()
    assert rig.driver.ops == []
    assert any("the driver says 109" in e for e in report.errors)
    assert any("suspended" in e for e in report.errors)


# --- restart convergence ----------------------------------------------------------------------------

START = {0: [f"1g.10gb@{s}" for s in range(7)], 1: ["7g.80gb@0"]}
TARGET = {0: ["3g.40gb@0", "3g.40gb@4"], 1: ["2g.20gb@0", "2g.20gb@2", "2g.20gb@4", "1g.10gb@6"]}


def _total_ops() -> int:
    rig = make_rig()
    for gpu, items in START.items():
        rig.carve(gpu, *items)
    rig.node_api.set_annotations(mig_spec(TARGET))
    asyncio.run(rig.agent().reconcile_once())
    return len(rig.driver.ops)


TOTAL_OPS = _total_ops()


@pytest.mark.parametrize("crash_after", range(TOTAL_OPS))
async def test_restart_converges(crash_after: int):
    rig = make_rig()
    for gpu, items in START.items():
        rig.carve(gpu, *items)
    rig.node_api.set_annotations(mig_spec(TARGET, plan="p9"))
    rig.driver.crash_after(crash_after)
    with pytest.raises(SimulatedCrash):
        await rig.agent().reconcile_once()
    assert rig.node_api.annotations.get(STATUS_PLAN) != "p9"  # not acknowledged
    report = await rig.agent().reconcile_once()  # a new agent process, same GPUs
    assert report.errors == [] and report.plan_id == "p9"
    for gpu, items in TARGET.items():
        assert rig.driver.layout(gpu) == sorted(placements(*items), key=lambda x: x[1])
        assert all(g.compute_instances for g in rig.driver.gpu_instances(gpu))
    ops_before = len(rig.driver.ops)
    await rig.agent().reconcile_once()
    assert len(rig.driver.ops) == ops_before  # converged: nothing more to do


def test_total_ops_covers_every_kind():
    assert TOTAL_OPS == 7 * 2 + 2 + 2 * 2 + 4 * 2  # 7 CI+GI destroys on GPU 0, 1 on GPU 1, 6 creates x 2


# --- property: random used instances, random new spec ---------------------------------------------


@st.composite
def scenarios(draw):
    model = draw(st.sampled_from([H100, A100]))
    geometries = feasible_geometries(model)
    before = sorted(draw(st.sampled_from(geometries)), key=lambda p: p.start)
    used = [p for p in before if draw(st.booleans())]
    after = sorted(draw(st.sampled_from(geometries)), key=lambda p: p.start)
    return model, before, used, after


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_respecs_are_safe_and_maximal(scenario):
    model, before, used, after = scenario
    driver = FakeNvml(model, 1)
    pods = FakePodResources()
    ids = {}
    for p in before:
        prof = model.profile(p.profile)
        gi = driver.create_gpu_instance(0, prof.gi_profile_id, p.start, prof.memory)
        driver.create_compute_instance(0, gi, prof.compute)
        ids[p] = gi
    for i, p in enumerate(used):
        driver.attach(0, 100 + i, ids[p])
    driver.ops.clear()
    result = asyncio.run(MigAgent(driver, pods, model).apply({0: [(p.profile, p.start) for p in after]}))
    # 1. no used instance was touched
    assert not touched(driver, 0, {ids[p] for p in used})
    # 2. the result: used instances, plus every wanted instance that does not collide with them
    rules = MigRules.of(model)
    used_mask = 0
    for p in used:
        used_mask |= slot_mask(p.start, rules.memory[rules.index[p.profile]])
    final = set(driver.layout(0))
    assert {(p.profile, p.start) for p in used} <= final
    for p in after:
        collides = used_mask & slot_mask(p.start, rules.memory[rules.index[p.profile]])
        if not collides and (p.profile, p.start) not in {(u.profile, u.start) for u in used}:
            blocked = rules.violations([*((u.profile, u.start) for u in used), (p.profile, p.start)])
            if not blocked:
                assert (p.profile, p.start) in final, (p, final, result.errors)
    assert final <= {(p.profile, p.start) for p in [*after, *used]}
    assert not rules.violations(list(final))
    # 3. idempotent
    n = len(driver.ops)
    asyncio.run(MigAgent(driver, pods, model).apply({0: [(p.profile, p.start) for p in after]}))
    assert len(driver.ops) == n


async def test_a_drained_gpu_loses_each_instance_as_it_frees(rig: Rig):
    g0 = rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    g1 = rig.carve(1, "3g.40gb@0", "3g.40gb@4")
    rig.run_pod("ns/a", 0, g0["3g.40gb@0"], process=False)
    rig.run_pod("ns/b", 1, g1["3g.40gb@0"], process=False)
    spec = mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["3g.40gb@0", "3g.40gb@4"]}, plan="d1")
    rig.node_api.set_annotations({**spec, "dynpart.io/spec-drain": "0"})
    report = await rig.agent().reconcile_once()
    # GPU 0 drains: its free instance goes, the used one stays; GPU 1 keeps its free instance
    assert rig.driver.layout(0) == [("3g.40gb", 0)] and touched(rig.driver, 0, {g0["3g.40gb@0"]}) == []
    assert rig.driver.layout(1) == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert report.plan_id == "d1" and not [e for e in report.errors if "do not hold" in e]
    rig.stop_pod("ns/a")  # the pod ends: the next pass destroys its instance, nothing new is made
    rig.stop_pod("ns/b")
    await rig.agent().reconcile_once()
    assert rig.driver.layout(0) == [] and rig.driver.layout(1) == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert not [o for o in rig.driver.ops if o.op == "create_gi"]


# --- instances of a GI profile the catalog does not know ----------------------------------------


async def test_a_plan_an_unknown_instance_blocks_is_not_acknowledged():
    """An instance whose GI profile the planning model lacks (made outside dynpart, or a profile
    left out of the node's list) is left alone and cannot be shown in the status, so the planner
    sees its slices free: a plan wanting an instance there is not acknowledged, and the status
    names the instance, its GI profile id and placement."""
    narrow = H100.model_copy(update={"mig_profiles": tuple(p for p in H100.mig_profiles if p.name != "1g.10gb+me")})
    driver = FakeNvml(H100, 1)  # the driver offers every profile
    me = H100.profile("1g.10gb+me")
    gi = driver.create_gpu_instance(0, me.gi_profile_id, 0, me.memory)  # e.g. nvidia-smi mig -cgi
    driver.create_compute_instance(0, gi, me.compute)
    agent = MigAgent(driver, FakePodResources(), narrow)
    result = await agent.apply(None)
    assert result.gpus[0].mig == []  # what the status format can carry: nothing of it

    result = await agent.apply({0: placements("2g.20gb@0", "2g.20gb@2", "3g.40gb@4")})
    assert not result.applied
    assert driver.layout(0) == [("1g.10gb+me", 0), ("2g.20gb", 2), ("3g.40gb", 4)]  # the rest is done
    assert touched(driver, 0, {gi}) == []
    where = f"GPU instance {gi} (GI profile id {me.gi_profile_id}, placement start 0 size 1)"
    assert f"plan not applied: GPU 0: 2g.20gb@0 could not be created next to {where}" in "\n".join(result.errors)
    assert any(f"cannot create 2g.20gb@0: it overlaps {where}" in e for e in result.errors)

    # a plan around it is acknowledged (the instance is still reported, not blocking anything)
    result = await agent.apply({0: placements("2g.20gb@2", "3g.40gb@4")})
    assert result.applied and not any(e.startswith("plan not applied") for e in result.errors)
    # once it is gone, the first plan is carried out
    driver.destroy_compute_instance(0, gi, 0)
    driver.destroy_gpu_instance(0, gi)
    result = await agent.apply({0: placements("2g.20gb@0", "2g.20gb@2", "3g.40gb@4")})
    assert result.applied and result.errors == []
    assert driver.layout(0) == [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)]


async def test_an_unknown_instance_is_named_in_the_status_and_the_plan_not_acknowledged(rig: Rig):
    """The same through the agent's loop and the node's annotations (a GI profile id the
    catalog does not have at all)."""
    g = rig.carve(1, "3g.40gb@4")
    unknown = next(gi for gi in rig.driver.gpu_instances(1) if gi.gi_id == g["3g.40gb@4"])
    rig.driver.gpu_instances = lambda i, real=rig.driver.gpu_instances: [  # type: ignore[method-assign]
        replace(gi, profile_id=77) if (i, gi.gi_id) == (1, unknown.gi_id) else gi for gi in real(i)]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"], 1: ["4g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    report = await rig.agent().reconcile_once()
    assert rig.driver.layout(0) == [("7g.80gb", 0)] and ("4g.40gb", 0) in rig.driver.layout(1)
    assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
    error = rig.node_api.annotations[STATUS_ERROR]
    assert (f"plan not applied: GPU 1: 3g.40gb@4 could not be created next to GPU instance {unknown.gi_id} "
            "(GI profile id 77, placement start 4 size 4)") in error
    status = decode_status(rig.node_api.annotations, H100, node="node-1")
    assert [(m.profile, m.start) for m in status.layout.gpus[1].mig] == [("4g.40gb", 0)]


async def test_a_process_the_agent_cannot_see_is_kept_by_the_drivers_refusal_only(rig: Rig):
    # the agent in a PID namespace of its own (the chart's agent pod has no hostPID): the driver
    # leaves other namespaces' processes out of its answers, so the process check before a destroy
    # sees nothing and only the driver's IN_USE keeps the instance (it is tried, and reported used)
    rig.driver.own_pid_namespace = True
    g = rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    rig.run_pod("ns/c", 0, g["3g.40gb@0"], assigned=False)  # a process only (no pod lists it)
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))

    report = await rig.agent().reconcile_once()

    tried = touched(rig.driver, 0, {g["3g.40gb@0"]})
    assert [(o.op, o.result) for o in tried] == [("destroy_ci", "IN_USE")]  # tried: a pid the agent cannot see
    assert ("3g.40gb", 0) in rig.driver.layout(0)
    assert "destroying 3g.40gb@0 failed" in "\n".join(report.errors)
