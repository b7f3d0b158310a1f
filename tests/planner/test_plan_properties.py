"""Property tests: on random snapshots, every plan of every policy is valid for the driver's
rules, keeps every used slice where it is, and respects CPU/memory; plans are deterministic."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.planner import PlanOptions, plan
from tests.planner.check import check_plan
from tests.planner.instances import small_instance


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), mps_share=st.sampled_from([0.0, 0.3, 1.0]))
def test_dynpart_plans_are_valid(seed, mps_share):
    snap = small_instance(seed, max_nodes=3, max_gpus=4, max_pods=20, mps_share=mps_share)
    check_plan(snap, plan(snap, options=PlanOptions(time_limit_s=0.2)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), policy=st.sampled_from(["nos", "static"]))
def test_baseline_plans_are_valid(seed, policy):
    snap = small_instance(seed, max_nodes=3, max_gpus=4, max_pods=20, mps_share=0.3)
    check_plan(snap, plan(snap, options=PlanOptions(policy=policy)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9))
def test_large_instances_use_windows_and_stay_valid(seed):
    # over the exact-size limits: greedy + CP-SAT windows
    snap = small_instance(seed, max_nodes=6, max_gpus=8, max_pods=60, mps_share=0.3)
    result = plan(snap, options=PlanOptions(time_limit_s=0.2, exact_max_gpus=4, exact_max_pods=4))
    check_plan(snap, result)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10**9))
def test_same_snapshot_same_plan(seed):
    snap = small_instance(seed, max_nodes=3, max_gpus=4, max_pods=25)
    assert plan(snap).model_dump(exclude={"stats": {"solve_s"}}) == plan(snap).model_dump(exclude={"stats": {"solve_s"}})


def test_used_slices_are_never_touched_even_when_that_leaves_pods_out():
    from dynpart.snapshot import Gpu, MigInstance, Node, PendingPod, Snapshot
    # one GPU: a used 1g at slot 3 blocks every 4g/7g placement
    snap = Snapshot(nodes=[Node(name="n", mode="mig", gpu_model="A100-40GB",
                                gpus=[Gpu(index=0, mig=[MigInstance(profile="1g.5gb", start=3, used=True)])])],
                    pending=[PendingPod(name="a", resource="nvidia.com/mig-4g.20gb"),
                             PendingPod(name="b", resource="nvidia.com/mig-7g.40gb"),
                             PendingPod(name="c", resource="nvidia.com/mig-3g.20gb")])
    result = plan(snap)
    check_plan(snap, result)
    assert [p.pod for p in result.placements] == ["c"]
    assert "without moving or destroying slices in use" in {u.pod: u.reason for u in result.unplaced}["a"]
