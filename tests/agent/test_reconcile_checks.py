"""The agent's pure decisions (agent/reconcile.py), checks that the agent-level tests leave open:
instances of a GI profile the catalog does not know (made outside dynpart, or a profile left out
of the node's list) are never destroyed, never built over, and keep a plan that needs their slices
from being acknowledged; what is created never breaks a MIG rule with what stays; drained GPUs keep
the spec's slices in use; the MPS slices in use raise no error while the spec has them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import IN_USE, RESET_REQUIRED
from dynpart.agent.mig_agent import MigAgent
from dynpart.agent.podresources import FakePodResources
from dynpart.agent.reconcile import (
    Complete,
    Create,
    Instance,
    MigGpuState,
    drained_mig,
    drained_mps,
    reconcile_mig,
    reconcile_mps,
    unknown_blocks,
)
from dynpart.catalog import GpuModel
from dynpart.mig import MigRules, feasible_geometries, slot_mask
from tests.gpus import CAPPED_1G, SHORT_COMPUTE

from .conftest import CATALOG, H100, placements

UNKNOWN_ID = 77  # a GI profile id no catalog model has


def known(gi_id: int, item: str, model: GpuModel = H100, *, users: tuple[str, ...] = (),
          complete: bool = True) -> Instance:
    profile, start = placements(item)[0]
    p = model.profile(profile)
    return Instance(gi_id, profile, p.gi_profile_id, start, p.memory, complete, users)


def unknown(gi_id: int, start: int, size: int, *, users: tuple[str, ...] = (), profile_id: int = UNKNOWN_ID) -> Instance:
    return Instance(gi_id, None, profile_id, start, size, True, users)


def mig_gpu(index: int, *instances: Instance) -> MigGpuState:
    return MigGpuState(index, True, False, tuple(instances))


def described(inst: Instance) -> str:
    return f"GPU instance {inst.gi_id} (GI profile id {inst.profile_id}, placement start {inst.start} size {inst.size})"


# --- instances of a GI profile the catalog does not know -----------------------------------------


@pytest.mark.parametrize("users", [(), ("pid 4242",), ("pod ns/a",)])
def test_an_unknown_instance_is_never_destroyed_nor_built_over_and_is_reported(users):
    """dynpart cannot tell what an unknown instance is for (someone else's, a crashed run's): it
    is left alone, used or not, its slices are not free to create into, and the status says so."""
    other = unknown(3, 0, 2, users=users)
    gpu = mig_gpu(0, other, known(5, "3g.40gb@4"))
    actions = reconcile_mig({0: placements("2g.20gb@0", "3g.40gb@4")}, [gpu], H100)
    assert actions.destroy == [] and actions.create == [] and actions.complete == [] and actions.enable == []
    text = "\n".join(actions.errors)
    assert f"GPU 0: {described(other)} has a GI profile the catalog does not know" in text
    assert f"cannot create 2g.20gb@0: it overlaps {described(other)}" in text
    # after the pass the plan's 2g.20gb@0 is missing: not acknowledged, naming the instance
    assert unknown_blocks({0: placements("2g.20gb@0", "3g.40gb@4")}, [gpu], H100) == [
        f"GPU 0: 2g.20gb@0 could not be created next to {described(other)}, of a GI profile the catalog does not know"]


def test_a_gpu_without_unknown_instances_blocks_no_plan():
    """A wanted instance missing for another reason (a create that failed, a GPU whose MIG mode is
    pending) is not blamed on unknown instances: naming a known instance as one to destroy would
    point the operator at an instance dynpart manages, perhaps one in use."""
    want = {0: placements("3g.40gb@0", "3g.40gb@4"), 1: placements("7g.80gb@0")}
    gpus = [mig_gpu(0, known(1, "3g.40gb@4", users=("pid 7",))),  # 3g.40gb@0 failed to be created
            MigGpuState(1, False, True, (), (), IN_USE)]  # MIG mode pending: no instance yet
    assert unknown_blocks(want, gpus, H100) == []


def test_a_wanted_instance_a_known_used_one_blocks_is_not_blamed_on_an_unknown_one():
    """Blocked by a known instance in use (which the status shows, and which the pass reports as
    waiting for it to be free), a wanted instance is not an unknown instance's block, even when
    the GPU has one elsewhere."""
    elsewhere = unknown(9, 6, 1)
    gpu = mig_gpu(0, known(1, "1g.10gb@1", users=("pid 7",)), elsewhere)
    want = {0: placements("2g.20gb@0", "1g.10gb@4")}
    actions = reconcile_mig(want, [gpu], H100)
    assert actions.create == [Create(0, "1g.10gb", 4)]
    assert any("cannot create 2g.20gb@0: 1g.10gb@1 (pid 7) in use there" in e for e in actions.errors)
    after = mig_gpu(0, known(1, "1g.10gb@1", users=("pid 7",)), elsewhere, known(2, "1g.10gb@4"))
    assert unknown_blocks(want, [after], H100) == []


def test_a_blocked_instance_names_the_unknown_instances_it_overlaps_and_only_those():
    """The operator must destroy the instance in the way (or add its profile): naming one that is
    not in the way sends them to the wrong one."""
    a, b = unknown(3, 0, 1), unknown(4, 6, 1, profile_id=78)
    gpu = mig_gpu(0, a, b)
    assert unknown_blocks({0: placements("4g.40gb@0")}, [gpu], H100) == [
        f"GPU 0: 4g.40gb@0 could not be created next to {described(a)}, of a GI profile the catalog does not know"]
    assert unknown_blocks({0: placements("3g.40gb@4")}, [gpu], H100) == [
        f"GPU 0: 3g.40gb@4 could not be created next to {described(b)}, of a GI profile the catalog does not know"]


def test_a_blocked_instance_that_overlaps_no_unknown_instance_names_them_all():
    """The driver refused a wanted instance that overlaps nothing: another of its rules counts the
    unknown instances (here the compute-slice total), so each of them is a suspect."""
    narrow = SHORT_COMPUTE.model_copy(update={"mig_profiles": tuple(
        p for p in SHORT_COMPUTE.mig_profiles if p.name not in ("1g.10gb", "2g.20gb"))})
    two = unknown(8, 0, 2, profile_id=SHORT_COMPUTE.profile("2g.20gb").gi_profile_id)  # 2 compute slices
    one = unknown(9, 2, 1, profile_id=SHORT_COMPUTE.profile("1g.10gb").gi_profile_id)  # 1 compute slice
    # 4g.40gb@4 needs 4 of the GPU's 6 compute slices; those two take 3
    after = mig_gpu(0, two, one)
    assert unknown_blocks({0: placements("4g.40gb@4")}, [after], narrow) == [
        f"GPU 0: 4g.40gb@4 could not be created next to {described(two)}, {described(one)}, of a GI profile the "
        "catalog does not know"]


def test_a_create_blocked_by_known_used_instances_names_each_one_in_use_there():
    """A wanted instance that breaks a rule with instances in use waits for exactly those: every
    instance in use in its slices is named, an unknown one too, and a free one is not."""
    used_unknown = unknown(3, 0, 1, users=("pid 8",))
    gpu = mig_gpu(0, used_unknown, known(1, "1g.10gb@1", users=("pid 7",)))
    errors = reconcile_mig({0: placements("2g.20gb@0")}, [gpu], H100).errors
    assert ("GPU 0: cannot create 2g.20gb@0: profile id 77@0 (pid 8), 1g.10gb@1 (pid 7) in use there; "
            "it will be created once that is free") in errors
    assert not any("it overlaps" in e for e in errors)  # the known conflict is what it waits for

    gpu = mig_gpu(0, unknown(3, 0, 1), known(1, "1g.10gb@1", users=("pid 7",)))
    errors = reconcile_mig({0: placements("2g.20gb@0")}, [gpu], H100).errors
    assert ("GPU 0: cannot create 2g.20gb@0: 1g.10gb@1 (pid 7) in use there; it will be created once that is free"
            in errors)


async def test_the_agent_never_destroys_a_used_unknown_instance_nor_reports_its_slices():
    """Through the agent and its fake driver: an instance of a profile the planning model lacks, a
    process on it, under a spec that wants the whole GPU: untouched, not in the status (neither
    used nor free), nothing created over it, the plan not acknowledged."""
    narrow = H100.model_copy(update={"mig_profiles": tuple(p for p in H100.mig_profiles if p.name != "1g.20gb")})
    driver = FakeNvml(H100, 1)
    p = H100.profile("1g.20gb")
    gi = driver.create_gpu_instance(0, p.gi_profile_id, 2, p.memory)
    driver.create_compute_instance(0, gi, p.compute)
    driver.attach(0, 4242, gi)
    agent = MigAgent(driver, FakePodResources(), narrow)
    before = len(driver.ops)
    result = await agent.apply({0: placements("7g.80gb@0")})
    assert not [o for o in driver.ops[before:] if o.op in ("destroy_ci", "destroy_gi", "create_gi")]
    assert driver.layout(0) == [("1g.20gb", 2)]
    assert result.gpus[0].mig == [] and not result.applied
    where = f"GPU instance {gi} (GI profile id {p.gi_profile_id}, placement start 2 size 2)"
    assert f"plan not applied: GPU 0: 7g.80gb@0 could not be created next to {where}" in "\n".join(result.errors)


# --- what is created and completed -----------------------------------------------------------------


def test_a_create_never_breaks_a_rule_with_the_instances_kept_or_created_before_it():
    """Creates are checked against every instance that stays (wanted or in use) and every create
    before them: the driver would refuse one that breaks the max count, and the plan must wait."""
    # 1g.6gb: max 2 on this GPU. In use and unwanted: 1g.6gb@0; wanted: 1g.6gb@1 and 1g.6gb@2
    gpu = mig_gpu(0, known(1, "1g.6gb@0", CAPPED_1G, users=("pid 7",)))
    actions = reconcile_mig({0: placements("1g.6gb@1", "1g.6gb@2")}, [gpu], CAPPED_1G)
    assert actions.create == [Create(0, "1g.6gb", 1)]  # (taken in start order: the lower start goes first)
    assert ("GPU 0: cannot create 1g.6gb@2: 3 x 1g.6gb exceeds its max count 2; it will be created once that is free"
            in actions.errors)
    # the same with a wanted instance kept: 1g.6gb@0 wanted (kept), 1g.6gb@2 in use and unwanted
    gpu = mig_gpu(0, known(1, "1g.6gb@0", CAPPED_1G), known(2, "1g.6gb@2", CAPPED_1G, users=("pid 7",)))
    actions = reconcile_mig({0: placements("1g.6gb@0", "1g.6gb@1")}, [gpu], CAPPED_1G)
    assert actions.create == [] and actions.destroy == []
    assert any("cannot create 1g.6gb@1: 3 x 1g.6gb exceeds its max count 2" in e for e in actions.errors)


def test_a_create_refused_by_a_rule_with_no_instance_in_its_way_is_reported_with_that_rule():
    """One media-extension instance per GPU: a used +me elsewhere keeps the wanted one from being
    created though nothing is in its slices; the pass reports the rule it breaks."""
    gpu = mig_gpu(0, known(1, "1g.10gb+me@3", users=("pod ns/a",)))
    actions = reconcile_mig({0: placements("1g.10gb+me@0")}, [gpu], H100)
    assert actions.create == [] and actions.destroy == []
    assert ("GPU 0: cannot create 1g.10gb+me@0: 2 x 1g.10gb+me exceeds its max count 1; "
            "it will be created once that is free") in actions.errors


def test_a_wanted_instance_left_without_its_compute_instance_is_completed_where_it_is():
    """A crash between the GPU instance and its compute instance leaves an incomplete instance:
    the pass completes that one (its GI id, profile and placement), not a new one."""
    gpu = mig_gpu(0, known(6, "3g.40gb@4", complete=False), known(2, "3g.40gb@0"))
    actions = reconcile_mig({0: placements("3g.40gb@0", "3g.40gb@4")}, [gpu], H100)
    assert actions.complete == [Complete(0, 6, "3g.40gb", 4)]
    assert actions.create == [] and actions.destroy == [] and actions.errors == []


# --- GPUs that are not (or not yet) in MIG mode ------------------------------------------------------


def test_a_model_without_mig_is_never_put_in_mig_mode():
    """A spec with MIG instances for a GPU that has no MIG is reported and ignored: enabling MIG
    mode there is not an option, and nothing is blocked by unknown instances."""
    plain = H100.model_copy(update={"mig_profiles": ()})
    gpus = [MigGpuState(0, False), MigGpuState(1, False)]
    actions = reconcile_mig({0: placements("3g.40gb@0")}, gpus, plain)
    assert actions.enable == [] and actions.create == [] and actions.destroy == []
    assert actions.errors == [f"GPU 0: {plain.name} does not support MIG; the spec's instances are ignored"]
    assert reconcile_mig({}, gpus, plain).errors == []
    assert unknown_blocks({0: placements("3g.40gb@0")}, gpus, plain) == []


@pytest.mark.parametrize("want", [True, False])
def test_a_pending_enable_that_waits_for_a_reset_is_not_asked_again(want):
    """Only a GPU reset applies it: the pass does nothing there and, when the spec wants the GPU
    carved, says that its instances wait for it (nothing is said for a GPU the spec leaves empty)."""
    gpu = MigGpuState(0, False, True, (), (), RESET_REQUIRED)
    actions = reconcile_mig({0: placements("7g.80gb@0")} if want else {}, [gpu], H100)
    assert actions.enable == [] and actions.create == []
    if want:
        assert actions.errors == ["GPU 0: MIG mode enable is pending until the GPU is reset; the spec's instances "
                                  "there are created once it is active"]
    else:
        assert actions.errors == []


def test_a_spec_gpu_the_node_lacks_is_reported_and_ignored():
    """A spec for another node's shape: the GPUs the node has are reconciled, the others named."""
    actions = reconcile_mig({0: placements("7g.80gb@0"), 3: placements("7g.80gb@0")}, [mig_gpu(0)], H100)
    assert actions.create == [Create(0, "7g.80gb", 0)]
    assert actions.errors == ["the spec has GPU 3 but this node has GPUs 0; ignored"]
    sizes, errors = reconcile_mps({0: [40], 2: [40]}, {}, [0, 1], 80)
    assert sizes == {0: [40], 1: []}
    assert errors == ["the spec has GPU 2 but this node has GPUs 0, 1; ignored"]


# --- drained GPUs, MPS ---------------------------------------------------------------------------


def test_a_drained_gpu_keeps_only_the_spec_instances_in_use():
    """Draining empties a GPU as its pods end: the spec's instances in use stay (their pods run
    on), the idle ones go; a drained GPU the node lacks keeps nothing; other GPUs are untouched."""
    gpus = [mig_gpu(0, known(1, "3g.40gb@0", users=("pod ns/a",)), known(2, "3g.40gb@4")),
            mig_gpu(1, known(3, "7g.80gb@0"))]
    desired = {0: placements("3g.40gb@0", "3g.40gb@4"), 1: placements("7g.80gb@0"), 5: placements("7g.80gb@0")}
    assert drained_mig(desired, gpus, [0, 5]) == {0: [("3g.40gb", 0)], 1: [("7g.80gb", 0)], 5: []}
    # the MPS counterpart: the slices pods hold, up to the spec's count of each size
    assert drained_mps({0: [40, 20, 20], 1: [40]}, {0: Counter({20: 1, 10: 1})}, [0]) == {0: [20], 1: [40]}


def test_mps_slices_in_use_raise_no_error_while_the_spec_has_them():
    """The steady state of a busy node (pods on the spec's slices) is not an error in the status;
    slices in use beyond the spec's count are (kept until free)."""
    sizes, errors = reconcile_mps({0: [40, 20, 20]}, {0: Counter({20: 2})}, [0], 80)
    assert sorted(sizes[0]) == [20, 20, 40] and errors == []
    sizes, errors = reconcile_mps({0: [40, 20]}, {0: Counter({20: 2})}, [0], 80)
    assert sorted(sizes[0]) == [20, 20, 40]
    assert errors == ["GPU 0: 2 x 20gb slice(s) are in use by pods but the spec has 1; kept until they are free"]


# --- property: any GPU, any spec -----------------------------------------------------------------

# the two made-up GPUs twice: on them alone the max-count and compute-total rules bind
MODELS = [H100, CATALOG.resolve("A30-24GB"), CAPPED_1G, SHORT_COMPUTE, CAPPED_1G, SHORT_COMPUTE]


def _driver_accepts(rules: MigRules, placed: list[tuple[str, int]], new: tuple[str, int]) -> bool:
    return not rules.violations([*placed, new])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_pass_leaves_unknown_and_used_instances_alone_and_never_acks_over_an_unknown_one(data):
    """For any instances on a GPU (some in use, some incomplete, some of a GI profile the catalog
    does not know) and any valid spec: only the free known instances the spec lacks are destroyed;
    what is created overlaps nothing that stays and breaks no rule with the known instances; a
    wanted instance not created is reported; and after the pass (the driver refusing what its
    rules refuse, unknown instances counted), every wanted instance still missing is either in a
    known instance's way (which the status shows) or named by `unknown_blocks`."""
    model = data.draw(st.sampled_from(MODELS), label="model")
    rules = MigRules.of(model)
    every = feasible_geometries(model)
    present = sorted(data.draw(st.sampled_from(every), label="present"), key=lambda x: x.start)
    # a plan often keeps some of what is there (and re-carves the rest)
    keep = data.draw(st.lists(st.sampled_from(present), unique=True) if present else st.just([]), label="keep")
    want = sorted(data.draw(st.sampled_from(feasible_geometries(model, fixed=keep)), label="want"), key=lambda x: x.start)
    instances = []
    real: dict[int, str] = {}  # gi id -> the profile the driver knows it by
    for gi_id, (profile, start) in enumerate(present, start=1):
        flags = data.draw(st.tuples(st.booleans(), st.booleans(), st.booleans()), label=f"{profile}@{start}")
        is_unknown, used, complete = flags
        users = ("pid 1",) if used and complete else ()
        if is_unknown:
            instances.append(unknown(gi_id, start, model.profile(profile).memory, users=users))
        else:
            instances.append(known(gi_id, f"{profile}@{start}", model, users=users, complete=complete))
        real[gi_id] = profile
    desired = {0: [(p.profile, p.start) for p in want]}
    wanted = set(desired[0])
    actions = reconcile_mig(desired, [mig_gpu(0, *instances)], model)

    free_unwanted = {i.gi_id for i in instances if i.profile is not None and not i.used
                     and (i.profile, i.start) not in wanted}
    assert {d.gi_id for d in actions.destroy} == free_unwanted
    staying = [i for i in instances if i.gi_id not in free_unwanted]
    assert sorted(c.gi_id for c in actions.complete) == sorted(
        i.gi_id for i in staying if i.profile is not None and not i.complete)
    taken = 0
    for i in staying:
        taken |= slot_mask(i.start, i.size)
    created = [(c.profile, c.start) for c in actions.create]
    for profile, start in created:
        assert (profile, start) in wanted and not taken & rules.mask(rules.index[profile], start)
    known_after = [(i.profile, i.start) for i in staying if i.profile is not None]
    assert not rules.violations([*known_after, *created])
    have = {(i.profile, i.start) for i in staying if i.profile is not None}
    for profile, start in wanted - have - set(created):
        assert any(f"cannot create {profile}@{start}:" in e for e in actions.errors), (profile, start)

    # the pass as the driver carries it out: it knows every instance's profile
    placed = [(real[i.gi_id], i.start) for i in staying]
    after = [i if i.complete else Instance(i.gi_id, i.profile, i.profile_id, i.start, i.size, True, i.users)
             for i in staying]
    for n, (profile, start) in enumerate(created, start=100):
        if _driver_accepts(rules, placed, (profile, start)):
            placed.append((profile, start))
            after.append(known(n, f"{profile}@{start}", model))
    blocks = unknown_blocks(desired, [mig_gpu(0, *after)], model)
    unknowns = [i for i in after if i.profile is None]
    known_now = [(i.profile, i.start) for i in after if i.profile is not None]
    expected = []
    for profile, start in sorted(wanted - set(known_now), key=lambda x: (x[1], x[0])):
        if not unknowns or rules.violations([*known_now, (profile, start)]):
            continue  # (held by no unknown instance: the known one in its way is in the status)
        mask = rules.mask(rules.index[profile], start)
        hit = [i for i in unknowns if slot_mask(i.start, i.size) & mask] or unknowns
        expected.append(f"GPU 0: {profile}@{start} could not be created next to "
                        f"{', '.join(described(i) for i in hit)}, of a GI profile the catalog does not know")
    assert blocks == expected
    if not unknowns:
        assert blocks == []
