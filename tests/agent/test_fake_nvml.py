"""FakeNvml enforces the driver's MIG rules (facts file section 1), so tests built on it mean something."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.agent.driver.fake import FakeNvml, SimulatedCrash
from dynpart.agent.driver.interface import (
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    RESET_REQUIRED,
    GpuDriverError,
    MigModePending,
)
from dynpart.mig import feasible_geometries, maximal_geometries
from tests.gpus import CAPPED_1G, RTX_PRO_6000, SHORT_COMPUTE
from tests.test_mig import _brute_force_valid

from .conftest import A100, CATALOG, H100


def create(d: FakeNvml, gpu: int, profile: str, start: int) -> int:
    p = d.model.profile(profile)
    gi = d.create_gpu_instance(gpu, p.gi_profile_id, start, p.memory)
    d.create_compute_instance(gpu, gi, p.compute)
    return gi


def code_of(fn, *args) -> str:
    with pytest.raises(GpuDriverError) as e:
        fn(*args)
    return e.value.code


def test_placement_rules():
    d = FakeNvml(H100)
    p3 = H100.profile("3g.40gb")
    assert code_of(d.create_gpu_instance, 0, p3.gi_profile_id, 2, 4) == INVALID_ARGUMENT  # start not legal
    assert code_of(d.create_gpu_instance, 0, p3.gi_profile_id, 0, 2) == INVALID_ARGUMENT  # wrong size
    assert code_of(d.create_gpu_instance, 0, 77, 0, 1) == INVALID_ARGUMENT  # no such profile
    create(d, 0, "3g.40gb", 4)
    p1 = H100.profile("1g.20gb")
    assert code_of(d.create_gpu_instance, 0, p1.gi_profile_id, 6, 2) == INSUFFICIENT_RESOURCES  # overlap
    create(d, 0, "1g.10gb+me", 0)
    me = H100.profile("1g.10gb+me")
    assert code_of(d.create_gpu_instance, 0, me.gi_profile_id, 1, 1) == INSUFFICIENT_RESOURCES  # one +me
    assert d.layout(0) == [("1g.10gb+me", 0), ("3g.40gb", 4)]
    assert [o.result for o in d.ops if o.op == "create_gi"] == [
        INVALID_ARGUMENT, INVALID_ARGUMENT, INVALID_ARGUMENT, "ok", INSUFFICIENT_RESOURCES, "ok", INSUFFICIENT_RESOURCES]


def test_max_count():
    d = FakeNvml(A100)
    for s in (0, 2, 4, 6):
        create(d, 0, "1g.10gb", s)
    assert d.layout(0) == [("1g.10gb", s) for s in (0, 2, 4, 6)]
    d2 = FakeNvml(A100)
    create(d2, 0, "3g.20gb", 0)
    create(d2, 0, "3g.20gb", 4)
    assert len(d2.layout(0)) == 2


def test_a_profile_past_its_max_count_is_refused_though_its_slices_are_free():
    """On every real GPU a profile's max count is as many as fit side by side, so the test above
    cannot tell the rule from the overlap rule; CAPPED_1G (tests/gpus.py) allows two 1g.6gb of the
    four that fit."""
    d = FakeNvml(CAPPED_1G)
    create(d, 0, "1g.6gb", 0)
    create(d, 0, "1g.6gb", 1)
    p = CAPPED_1G.profile("1g.6gb")
    assert code_of(d.create_gpu_instance, 0, p.gi_profile_id, 2, 1) == INSUFFICIENT_RESOURCES
    assert code_of(d.create_gpu_instance, 0, p.gi_profile_id, 3, 1) == INSUFFICIENT_RESOURCES
    create(d, 0, "2g.12gb", 2)  # the free slices themselves are fine
    assert d.layout(0) == [("1g.6gb", 0), ("1g.6gb", 1), ("2g.12gb", 2)]
    assert [o.result for o in d.ops if o.op == "create_gi"] == [
        "ok", "ok", INSUFFICIENT_RESOURCES, INSUFFICIENT_RESOURCES, "ok"]


def test_instances_past_the_compute_slices_are_refused_though_memory_is_free():
    """On every real GPU the compute slices of non-overlapping instances never add up to more than
    it has; SHORT_COMPUTE (tests/gpus.py) has 8 memory slices and 6 compute slices."""
    d = FakeNvml(SHORT_COMPUTE)
    create(d, 0, "4g.40gb", 0)
    create(d, 0, "2g.20gb", 4)  # 6 of 6 compute slices
    p = SHORT_COMPUTE.profile("2g.20gb")
    assert code_of(d.create_gpu_instance, 0, p.gi_profile_id, 6, 2) == INSUFFICIENT_RESOURCES
    one = SHORT_COMPUTE.profile("1g.10gb")
    assert code_of(d.create_gpu_instance, 0, one.gi_profile_id, 7, 1) == INSUFFICIENT_RESOURCES
    assert d.layout(0) == [("4g.40gb", 0), ("2g.20gb", 4)]
    d.destroy_compute_instance(0, d.gi_at(0, 4), 0)
    d.destroy_gpu_instance(0, d.gi_at(0, 4))
    create(d, 0, "1g.10gb", 6)
    create(d, 0, "1g.10gb", 7)  # 4 + 1 + 1: back within the 6
    assert d.layout(0) == [("4g.40gb", 0), ("1g.10gb", 6), ("1g.10gb", 7)]


def test_compute_instance_rules():
    d = FakeNvml(H100)
    p = H100.profile("2g.20gb")
    gi = d.create_gpu_instance(0, p.gi_profile_id, 2, 2)
    assert d.gpu_instances(0)[0].uuid is None and d.gpu_instances(0)[0].compute_instances == ()
    assert code_of(d.create_compute_instance, 0, gi, 1) == INVALID_ARGUMENT  # not the full GI
    d.create_compute_instance(0, gi, 2)
    assert code_of(d.create_compute_instance, 0, gi, 2) == INSUFFICIENT_RESOURCES
    assert d.gpu_instances(0)[0].uuid.startswith("MIG-")
    assert code_of(d.destroy_gpu_instance, 0, gi) == IN_USE  # CI first
    d.attach(0, 42, gi)
    assert d.processes(0, gi) == [42] and d.processes(0) == [42]
    assert code_of(d.destroy_compute_instance, 0, gi, 0) == IN_USE
    d.detach(0, 42)
    d.destroy_compute_instance(0, gi, 0)
    d.destroy_gpu_instance(0, gi)
    assert d.gpu_instances(0) == []
    assert code_of(d.destroy_gpu_instance, 0, gi) == NOT_FOUND
    assert d.processes(0, gi) == []  # as RealNvml: a GI that is gone has no MIG device, so no process


def test_mig_mode_rules():
    d = FakeNvml(H100, mig_enabled=False)
    assert code_of(d.create_gpu_instance, 0, 0, 0, 8) == NOT_SUPPORTED
    d.attach(0, 7)
    assert code_of(d.set_mig_mode, 0, True) == IN_USE  # activation status: left pending (below)
    d.detach(0, 7)
    d.set_mig_mode(0, True)
    assert d.devices()[0].mig_current
    create(d, 0, "7g.80gb", 0)
    assert code_of(d.set_mig_mode, 0, False) == IN_USE  # instances exist
    assert d.devices()[0].mig_current and d.devices()[0].mig_pending  # refused: nothing changed


def test_mig_mode_on_a_gpu_held_open_stays_pending_as_nvml_leaves_it():
    """nvmlDeviceSetMigMode on a GPU that is not idle returns SUCCESS with activation status
    IN_USE and leaves the mode pending; a client such as DCGM holds a GPU without a compute
    process, so processes() lists nothing. Asking again once it lets go activates the mode."""
    d = FakeNvml(A100, 2, mig_enabled=False)
    d.hold(0, "dcgm-exporter")
    assert d.processes(0) == []
    with pytest.raises(MigModePending) as e:
        d.set_mig_mode(0, True)
    assert e.value.code == IN_USE and e.value.retryable
    assert "DCGM" in str(e.value) and "dcgm-exporter" in str(e.value) and "reset the GPU" in str(e.value)
    gpu0 = d.devices()[0]
    assert (gpu0.mig_current, gpu0.mig_pending) == (False, True)  # pending, not refused
    assert [(o.op, o.result) for o in d.ops] == [("set_mig_mode", "pending:IN_USE")]
    assert code_of(d.create_gpu_instance, 0, A100.profile("7g.40gb").gi_profile_id, 0, 8) == NOT_SUPPORTED
    d.set_mig_mode(1, True)  # the other GPU is idle: at once
    assert d.devices()[1].mig_current
    d.release(0, "dcgm-exporter")
    d.set_mig_mode(0, True)
    assert (d.devices()[0].mig_current, d.devices()[0].mig_pending) == (True, True)
    # a compute process makes it busy too: pending again, IN_USE
    h = FakeNvml(H100, mig_enabled=False)
    h.attach(0, 9)
    assert code_of(h.set_mig_mode, 0, True) == IN_USE and h.devices()[0].mig_pending


def test_reboot_and_reset():
    h = FakeNvml(H100)
    create(h, 0, "7g.80gb", 0)
    h.reboot()
    assert not h.devices()[0].mig_current  # Hopper: MIG mode lost
    with pytest.raises(GpuDriverError) as lost:  # nvmlDeviceGetGpuInstances without MIG mode (nvml.h)
        h.gpu_instances(0)
    assert lost.value.code == NOT_SUPPORTED
    a = FakeNvml(A100)
    create(a, 0, "7g.40gb", 0)
    a.reboot()
    assert a.gpu_instances(0) == [] and a.devices()[0].mig_current  # Ampere: MIG mode kept
    r = FakeNvml(H100, mig_enabled=False, mode_needs_reset=True)
    with pytest.raises(MigModePending) as e:  # SUCCESS, activation status RESET_REQUIRED
        r.set_mig_mode(0, True)
    assert e.value.code == RESET_REQUIRED and not e.value.retryable and "pending until the GPU is reset" in str(e.value)
    assert (r.devices()[0].mig_current, r.devices()[0].mig_pending) == (False, True)
    r.reset(0)
    assert r.devices()[0].mig_current


def test_crash_after():
    d = FakeNvml(H100)
    d.crash_after(1)
    p = H100.profile("7g.80gb")
    gi = d.create_gpu_instance(0, p.gi_profile_id, 0, 8)
    with pytest.raises(SimulatedCrash):
        d.create_compute_instance(0, gi, 7)
    assert d.gpu_instances(0)[0].compute_instances == ()  # the crash came before the call
    d.create_compute_instance(0, gi, 7)  # one crash only


MADE_UP = [CAPPED_1G, SHORT_COMPUTE]  # where the max-count and compute-total rules bind (tests/gpus.py)
MIG_MODELS = [*(m for m in CATALOG.models.values() if m.supports_mig), RTX_PRO_6000, *MADE_UP]


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_every_maximal_geometry_can_be_created_and_then_takes_no_more_instances(model):
    """The fake accepts one placement of every maximal geometry (the search's answer, `MigRules.
    can_add`) and then refuses every profile at every legal start, as the driver would (maximal:
    no profile fits in any placement), in agreement with the brute-force reading of the rules.
    (The fake checks the whole set on each create, so the order of creation cannot matter to it.)"""
    for counts in maximal_geometries(model):
        wanted = sorted(n for n, c in counts for _ in range(c))
        geometry = next(sorted(g, key=lambda x: x.start) for g in feasible_geometries(model, [n for n, _ in counts])
                        if sorted(n for n, _ in g) == wanted)
        d = FakeNvml(model)
        for placement in geometry:
            create(d, 0, placement.profile, placement.start)
        assert d.layout(0) == [(p.profile, p.start) for p in geometry]
        assert _brute_force_valid(model, geometry), counts
        for p in model.mig_profiles:
            for start in p.starts:
                assert not _brute_force_valid(model, [*geometry, (p.name, start)]), (counts, p.name, start)
                assert code_of(d.create_gpu_instance, 0, p.gi_profile_id, start, p.memory) == INSUFFICIENT_RESOURCES
        assert d.layout(0) == [(p.profile, p.start) for p in geometry]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fake_accepts_exactly_what_a_brute_force_reading_of_the_rules_accepts(data):
    """Creates in a drawn order, legal starts or not, each checked against `_brute_force_valid`
    (tests/test_mig.py: the rules written out without MigRules, which the fake itself calls):
    accepted exactly when the instances so far plus the new one are valid; refused with
    INVALID_ARGUMENT for a start the profile does not have, else INSUFFICIENT_RESOURCES."""
    model = data.draw(st.sampled_from(MIG_MODELS) | st.sampled_from(MADE_UP), label="model")  # made-up ones: half
    legal = [(p.name, s) for p in model.mig_profiles for s in p.starts]
    anywhere = [(p.name, s) for p in model.mig_profiles for s in range(model.memory_slices - p.memory + 1)]
    tries = data.draw(st.lists(st.one_of(st.sampled_from(legal), st.sampled_from(anywhere)), max_size=16), label="tries")
    d = FakeNvml(model)
    held: list[tuple[str, int]] = []
    for name, start in tries:
        p = model.profile(name)
        valid = _brute_force_valid(model, [*held, (name, start)])
        try:
            gi = d.create_gpu_instance(0, p.gi_profile_id, start, p.memory)
        except GpuDriverError as e:
            assert not valid, (held, name, start, e)
            assert e.code == (INSUFFICIENT_RESOURCES if start in p.starts else INVALID_ARGUMENT), (held, name, start)
            continue
        assert valid, (held, name, start)
        d.create_compute_instance(0, gi, p.compute)
        held.append((name, start))
    assert d.layout(0) == sorted(held, key=lambda x: (x[1], x[0]))


def test_processes_in_other_pid_namespaces_are_not_listed():
    d = FakeNvml(H100)
    create(d, 0, "7g.80gb", 0)
    gi = d.gpu_instances(0)[0]
    d.attach(0, 4242, gi.gi_id)
    assert d.processes(0, gi.gi_id) == [4242]
    d.own_pid_namespace = True  # the caller without hostPID: the driver omits pids it cannot see
    assert d.processes(0, gi.gi_id) == [] and d.processes(0) == []
    with pytest.raises(GpuDriverError) as e:  # ... which still use the instance
        d.destroy_compute_instance(0, gi.gi_id, gi.compute_instances[0])
    assert e.value.code == "IN_USE"


def test_mig_changes_need_root_and_mig_mode():
    d = FakeNvml(H100, root=False)
    p = H100.profile("7g.80gb")
    for call in (lambda: d.set_mig_mode(0, False), lambda: d.create_gpu_instance(0, p.gi_profile_id, 0, 8)):
        with pytest.raises(GpuDriverError) as e:
            call()
        assert e.value.code == "NO_PERMISSION"
    off = FakeNvml(H100, mig_enabled=False)
    for call in (lambda: off.create_compute_instance(0, 0, 7), lambda: off.destroy_gpu_instance(0, 0),
                 lambda: off.gpu_instances(0)):  # nvmlDeviceGetGpuInstance(s|ById): NOT_SUPPORTED without MIG mode
        with pytest.raises(GpuDriverError) as e:
            call()
        assert e.value.code == NOT_SUPPORTED
    assert FakeNvml(H100, mig_enabled=False, profiles_need_mig=True).gpu_instances(0) == []
