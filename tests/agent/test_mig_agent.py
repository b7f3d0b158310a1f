"""The MIG agent on FakeNvml: never touches a used instance, converges after a crash, enables MIG
mode only when asked and idle."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.agent.driver.fake import FakeNvml, SimulatedCrash
from dynpart.agent.mig_agent import MigAgent
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import STATUS_ERROR, STATUS_PLAN, decode_status
from dynpart.capability import decode_capability
from dynpart.mig import MigRules, feasible_geometries, slot_mask

from .conftest import A100, H100, Rig, make_rig, mig_spec, placements

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
    # the plan is acknowledged (the agent did what it safely could) and the status says why it differs
    ann = rig.node_api.annotations
    assert ann[STATUS_PLAN] == "p1" and "cannot create 7g.80gb@0" in ann[STATUS_ERROR]
    status = decode_status(ann, H100, node="node-1")
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[0].mig] == [("3g.40gb", 0, True)]
    assert [(m.profile, m.start, m.used) for m in status.layout.gpus[1].mig] == [
        ("1g.10gb", 2, True), ("1g.10gb", 5, True)]

    # the pods finish: the next pass completes the plan
    rig.stop_pod("ns/a", 1001)
    rig.stop_pod("ns/b")
    rig.stop_pod("ns/c", pid_c)
    report = await rig.agent().reconcile_once()
    assert report.errors == []
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
    report = await rig.agent().reconcile_once()
    assert any("pending until the GPU is reset" in e for e in report.errors)
    # the node cannot hold the plan: not acknowledged, and the capability report says why
    assert report.plan_id is None and "dynpart.io/status-plan" not in rig.node_api.annotations
    assert decode_capability(rig.node_api.annotations["dynpart.io/status-capability"]).gpus[0].mig == "on-pending"
    report = await rig.agent().reconcile_once()  # no second attempt, the same advice
    assert [o.op for o in rig.driver.ops] == ["set_mig_mode"]
    rig.driver.reset(0)
    report = await rig.agent().reconcile_once()
    assert report.errors == [] and rig.driver.layout(0) == [("7g.40gb", 0)] and report.plan_id == "p1"


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
