"""The planner's named types and interfaces: each mode answers a slice reference with an explicit
option, and every policy that `PlanOptions.policy` can name is registered and names itself."""

from typing import get_args

from dynpart.catalog import default_catalog
from dynpart.planner.core import POLICIES, PlanOptions
from dynpart.planner.policy import PolicyName
from dynpart.planner.problem import compile_problem
from dynpart.planner.state import new_state
from dynpart.planner.types import WHOLE_GPU, CreateSlice, MigSliceRef, MpsSliceRef, ReuseSlice, TakeWholeGpu
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, Snapshot


def _states(*nodes: Node):
    problem = compile_problem(Snapshot(nodes=list(nodes)), default_catalog())
    return [new_state(g) for g in problem.gpus]


def test_every_policy_name_is_registered_and_names_itself():
    assert set(POLICIES) == set(get_args(PolicyName))
    for name, make in POLICIES.items():
        assert make(PlanOptions(policy=name)).name == name


def test_mig_options_reuse_a_free_instance_else_create_one():
    free, empty = _states(Node(name="n", mode="mig", gpu_model="H100-80GB", gpus=[
        Gpu(index=0, mig=[MigInstance(profile="1g.10gb", start=3)]), Gpu(index=1)]))
    reuse = free.option(MigSliceRef("1g.10gb"))
    assert isinstance(reuse, ReuseSlice) and reuse.index == 0 and reuse.cost[0] == 0
    create = empty.option(MigSliceRef("3g.40gb"))
    assert isinstance(create, CreateSlice) and create.destroy == () and create.cost[0] == 1
    empty.apply(MigSliceRef("3g.40gb"), create, "ns/a")
    assert [str(s) for s in empty.slices_held_by("ns/a")] == [f"3g.40gb@{create.start}"]
    assert empty.changed and empty.has_pod()
    # a MIG GPU offers nothing to MPS or whole-GPU requests
    assert empty.option(MpsSliceRef(10)) is None and empty.option(WHOLE_GPU) is None


def test_mps_options_and_the_whole_gpu():
    (gpu,) = _states(Node(name="n", mode="mps", gpu_model="H100-80GB", gpus=[
        Gpu(index=0, mps=[MpsSlice(size=20), MpsSlice(size=40)])]))
    assert isinstance(gpu.option(MpsSliceRef(20)), ReuseSlice)
    whole = gpu.option(WHOLE_GPU)
    assert isinstance(whole, TakeWholeGpu) and whole.destroy == (0, 1)
    gpu.apply(WHOLE_GPU, whole, "ns/w")
    assert [str(s) for s in gpu.slices_held_by("ns/w")] == ["whole"] and gpu.destroyed == 2
    assert gpu.option(MpsSliceRef(10)) is None  # taken whole
    assert gpu.option(MigSliceRef("1g.10gb")) is None
