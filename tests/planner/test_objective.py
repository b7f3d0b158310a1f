"""The workload-aware objective (planner/objective.py): its measure matches its definition, it
counts MIG start slots and CPU/memory, and `plan()` takes the obviously less fragmenting choice
on small hand-built clusters without ever placing fewer pods for it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.catalog import Catalog, GpuModel, default_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.planner.objective import Objective, capacity_class
from dynpart.planner.problem import DemandKind, compile_problem
from dynpart.planner.state import new_state
from dynpart.planner.types import WHOLE_GPU, MigSliceRef, MpsSliceRef
from dynpart.scheduling import Taint, Toleration, untolerated_taint
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, RequestShare, Snapshot
from tests.planner.check import check_plan
from tests.planner.instances import small_instance

# MPS GPUs with capacity 1000 (GPU milli), of two models
MILLI = Catalog([GpuModel(name="G", memory_gb=16), GpuModel(name="H", memory_gb=16)])


def _mps_node(name: str, used: list[list[int]], cpu: int = 64_000, mem: int = 256 << 10, model: str = "G") -> Node:
    return Node(name=name, mode="mps", gpu_model=model, cpu_milli_free=cpu, memory_mib_free=mem,
                gpus=[Gpu(index=i, capacity=1000, mps=[MpsSlice(size=s, used=True) for s in sizes])
                      for i, sizes in enumerate(used)])


def _may_use(k: DemandKind, node: Node) -> bool:
    return not ((k.models and node.gpu_model not in k.models) or any(node.labels.get(a) != b for a, b in k.selector)
                or untolerated_taint(node.taints, node.unschedulable, k.constraints.tolerations))


def _scarcity(kinds: list[DemandKind], nodes: list[Node]) -> list[float]:
    """Per kind, the GPUs the broadest kind may use over the GPUs it may use, at most 4."""
    reach = [sum(len(n.gpus) for n in nodes if _may_use(k, n)) for k in kinds]
    return [min(4.0, max(reach) / r) if r else 1.0 for r in reach]


def _brute(kinds: list[DemandKind], cpu: int, mem: int, free: list[int], node: Node | None = None,
           scarce: list[float] | None = None) -> float:
    """The definition: free GPUs' share minus, for each kind by weight (times the scarcity of the
    capacity it may use), what it could use (nothing on a node it may not use: another model, a
    pool it does not select, a taint it does not tolerate)."""
    total = sum(k.weight for k in kinds)
    out = sum(free) / 1000
    for i, k in enumerate(kinds):
        if cpu < k.cpu or mem < k.mem:
            continue
        if node is not None and not _may_use(k, node):
            continue
        if k.ref is WHOLE_GPU:
            hosts = [f for f in free if f == 1000]
        else:
            assert isinstance(k.ref, MpsSliceRef)
            hosts = [f for f in free if f >= k.ref.size]
        if len(hosts) >= k.count:
            out -= k.weight / total * (scarce[i] if scarce else 1.0) * sum(hosts) / 1000
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10**9), restricted=st.booleans())
def test_unusable_capacity_matches_its_definition(seed, restricted):
    rng = random.Random(seed)
    team = Taint(key="team", value="a", effect="NoSchedule")

    def access() -> dict:  # type: ignore[type-arg]  # (`restricted`: some kinds may use only some nodes)
        if not restricted:
            return {}
        return {"gpu_models": rng.choice([[], ["G"], ["H"], ["G", "H"]]), "node_selector": rng.choice([{}, {"pool": "x"}]),
                "tolerations": rng.choice([[], [Toleration(key="team", operator="Exists")]])}

    shares = [RequestShare(resource=f"nvidia.com/gpu-{rng.choice([100, 250, 470, 810])}gb", cpu_milli=rng.choice([0, 4000, 12_000]),
                           memory_mib=rng.choice([0, 8192]), weight=rng.choice([1.0, 3.0]), **access())
              for _ in range(4)]
    shares += [RequestShare(resource="nvidia.com/gpu", count=rng.choice([1, 2, 4]), cpu_milli=rng.choice([0, 8000, 30_000]),
                            weight=2.0, **access()) for _ in range(2)]
    from dynpart.planner.problem import compile_workload
    merged = compile_workload(shares, [], MILLI)
    nodes, cpus, mems = [], [], []
    for n in range(20):
        used = [[s] if s else [] for s in (rng.choice([0, 0, 190, 530, 1000]) for _ in range(rng.randint(1, 4)))]
        cpus.append(rng.choice([0, 4000, 12_000, 64_000]))
        mems.append(rng.choice([0, 8192, 1 << 20]))
        node = _mps_node(f"n{n:02d}", used, cpu=cpus[-1], mem=mems[-1], model=rng.choice(["G", "H"]))
        if restricted:
            node.labels = rng.choice([{}, {"pool": "x"}])
            node.taints = rng.choice([[], [], [team]])
            node.unschedulable = rng.random() < 0.1
        nodes.append(node)
    problem = compile_problem(Snapshot(nodes=nodes), MILLI)
    obj = Objective(merged, problem.nodes)
    states = [new_state(g) for g in problem.gpus]
    rows = [[obj.class_id(capacity_class(states[g])) for g in info.gpus] + [0] * (4 - len(info.gpus)) for info in problem.nodes]
    scarce = _scarcity(merged, nodes)
    assert restricted or scarce == [1.0] * len(merged)
    want = [_brute(merged, c, m, [1000 - sum(s.size for s in g.mps) for g in nd.gpus], nd, scarce)
            for nd, c, m in zip(nodes, cpus, mems)]
    got = obj.unusable(np.array(rows), np.array(cpus), np.array(mems), np.arange(len(nodes)))
    assert np.allclose(got, want)


def test_access_groups_gather_the_nodes_the_same_kinds_may_use():
    from dynpart.planner.objective import access_groups
    kinds = [DemandKind(WHOLE_GPU, 1, 0, 0, 1.0), DemandKind(WHOLE_GPU, 1, 0, 0, 1.0, frozenset({"G"})),
             DemandKind(MpsSliceRef(100), 1, 0, 0, 1.0, selector=(("pool", "x"),))]
    team = Taint(key="team", value="a", effect="NoSchedule")
    snap = Snapshot(nodes=[_mps_node("a", [[]], model="H"), _mps_node("b", [[]], model="G"), _mps_node("c", [[]], model="H"),
                           _mps_node("d", [[]], model="G"), _mps_node("e", [[]], model="G")])
    snap.nodes[3].labels = {"pool": "x"}
    snap.nodes[4].taints = [team]
    of_node, members = access_groups(kinds, compile_problem(snap, MILLI).nodes)
    # a, c: only kind 0; b: kinds 0 and 1; d: every kind; e: tainted, none
    assert of_node == [0, 1, 0, 2, 3]
    assert members == [[0], [0, 1], [0, 1, 2], []]


def test_the_rows_of_a_model_naming_objective_need_the_nodes():
    snap = Snapshot(nodes=[_mps_node("a", [[]]), _mps_node("b", [[]], model="H")])
    obj = Objective([DemandKind(WHOLE_GPU, 1, 0, 0, 1.0, frozenset({"G"}))], compile_problem(snap, MILLI).nodes)
    with pytest.raises(ValueError, match="may not use every node"):
        obj.unusable(np.array([[0]]), np.array([0]), np.array([0]))


def test_a_share_naming_models_needs_the_catalog_and_known_models():
    from dynpart.errors import SnapshotError
    from dynpart.planner.problem import compile_workload
    share = RequestShare(resource="nvidia.com/gpu", gpu_models=["G"])
    with pytest.raises(ValueError, match="needs the catalog"):
        compile_workload([share], [])
    (kind,) = compile_workload([share], [], MILLI)
    assert kind.models == frozenset({"G"})
    snap = Snapshot(nodes=[_mps_node("n", [[]])], workload=[RequestShare(resource="nvidia.com/gpu", gpu_models=["Z"])])
    with pytest.raises(SnapshotError, match=r"workload\[0\]\.gpu_models"):
        plan(snap, MILLI)


def test_a_pod_any_node_can_host_leaves_the_pool_others_are_bound_to():
    # the same with a labelled pool (first by name) that whole-GPU pods select: the share goes to
    # the other node. And a pod that tolerates a taint most pods do not goes to the tainted node
    # (second by name), keeping the open one for the pods that may go nowhere else
    pool = _mps_node("a", [[]])
    pool.labels = {"pool": "x"}
    snap = Snapshot(nodes=[pool, _mps_node("b", [[]])], pending=[PendingPod(name="p", resource="nvidia.com/gpu-500gb")],
                    workload=[RequestShare(resource="nvidia.com/gpu-500gb"),
                              RequestShare(resource="nvidia.com/gpu", node_selector={"pool": "x"})])
    assert _where(plan(snap, MILLI), "p")[0] == "b"
    tainted = _mps_node("b", [[]])
    tainted.taints = [Taint(key="team", value="x", effect="NoSchedule")]
    team = Toleration(key="team", operator="Exists")
    snap = Snapshot(nodes=[_mps_node("a", [[]]), tainted],
                    pending=[PendingPod(name="p", resource="nvidia.com/gpu-500gb", tolerations=[team])],
                    workload=[RequestShare(resource="nvidia.com/gpu-500gb", tolerations=[team]),
                              RequestShare(resource="nvidia.com/gpu-500gb", weight=3.0)])
    assert _where(plan(snap, MILLI), "p")[0] == "b"


def test_a_pod_any_model_can_host_leaves_the_model_others_ask_for():
    # two idle GPUs, on nodes of models G (first by name) and H; whole GPUs are asked for on G
    # only: a share any model can host goes to H, where fewer kinds could use the GPU
    snap = Snapshot(nodes=[_mps_node("a", [[]], model="G"), _mps_node("b", [[]], model="H")],
                    pending=[PendingPod(name="p", resource="nvidia.com/gpu-500gb")],
                    workload=[RequestShare(resource="nvidia.com/gpu-500gb"),
                              RequestShare(resource="nvidia.com/gpu", gpu_models=["G"])])
    assert _where(plan(snap, MILLI), "p")[0] == "b"
    # the same shares without models: the first node by name (equal options)
    anywhere = snap.model_copy(update={"workload": [RequestShare(resource="nvidia.com/gpu-500gb"),
                                                    RequestShare(resource="nvidia.com/gpu")]})
    assert _where(plan(anywhere, MILLI), "p")[0] == "a"


def test_mig_coverage_counts_start_slots():
    # H100: a used 1g.20gb at slots 0-1 leaves 6 free memory slices; a 3g.40gb can start at 4
    # only (its starts are 0 and 4), so it can use 4 of them; a 1g.10gb can use 5 (slots 2-6:
    # slot 7 is no 1g.10gb start)
    snap = Snapshot(nodes=[Node(name="n", mode="mig", gpu_model="H100-80GB", gpus=[
        Gpu(index=0, mig=[MigInstance(profile="1g.20gb", start=0, used=True)])])])
    (state,) = [new_state(g) for g in compile_problem(snap, default_catalog()).gpus]
    obj = Objective([DemandKind(MigSliceRef("3g.40gb"), 1, 0, 0, 1.0)])
    f = obj.unusable(np.array([[obj.class_id(capacity_class(state))]]), np.array([0]), np.array([0]))
    assert np.allclose(f, [6 / 8 - 4 / 8])
    obj = Objective([DemandKind(MigSliceRef("1g.10gb"), 1, 0, 0, 1.0)])
    f = obj.unusable(np.array([[obj.class_id(capacity_class(state))]]), np.array([0]), np.array([0]))
    assert np.allclose(f, [6 / 8 - 5 / 8])


def test_score_is_the_fgd_plugins_whole_point_score_negated():
    d = np.array([0.0, 0.010, 0.039, 0.041, -0.5, 0.19, 1e6, -1e6])
    assert (-Objective.score(d)).tolist() == [50, 49, 49, 48, 62, 45, 0, 100]


def _where(result, pod: str) -> tuple[str, list[int]]:
    pl = next(p for p in result.placements if p.pod == pod)
    return pl.node, [s.gpu for s in pl.slices]


def test_a_share_fills_the_half_used_gpu_and_keeps_whole_gpus_whole():
    # n0 has an idle GPU, n1 a GPU with 500 milli used: a 500-milli pod goes to n1, whatever
    # the node order, when whole GPUs are asked for too
    snap = Snapshot(nodes=[_mps_node("n0", [[]]), _mps_node("n1", [[500]])],
                    pending=[PendingPod(name="p", resource="nvidia.com/gpu-500gb")],
                    workload=[RequestShare(resource="nvidia.com/gpu-500gb"), RequestShare(resource="nvidia.com/gpu")])
    assert _where(plan(snap, MILLI), "p") == ("n1", [0])


def test_a_multi_gpu_pod_keeps_its_room_single_pods_consolidate():
    # two nodes of 4 idle GPUs; 4-GPU pods are part of the workload: one-GPU pods go to the
    # node already in use, so that the other keeps its 4 GPUs
    snap = Snapshot(nodes=[_mps_node("a", [[], [], [], []]), _mps_node("b", [[1000], [], [], []])],
                    pending=[PendingPod(name="one", resource="nvidia.com/gpu")],
                    workload=[RequestShare(resource="nvidia.com/gpu", count=4), RequestShare(resource="nvidia.com/gpu")])
    assert _where(plan(snap, MILLI), "one")[0] == "b"


def test_cpu_that_strands_gpus_is_counted():
    # same GPUs, but on n0 the pod's CPU would leave 2 cores next to 3 idle GPUs that need 8
    # cores each: it goes to n1, which has CPU to spare
    snap = Snapshot(nodes=[_mps_node("n0", [[500], [], [], []], cpu=10_000), _mps_node("n1", [[500], [], [], []], cpu=64_000)],
                    pending=[PendingPod(name="p", resource="nvidia.com/gpu-400gb", cpu_milli=8000)],
                    workload=[RequestShare(resource="nvidia.com/gpu", cpu_milli=8000),
                              RequestShare(resource="nvidia.com/gpu-400gb", cpu_milli=8000)])
    assert _where(plan(snap, MILLI), "p")[0] == "n1"


@pytest.mark.xfail(strict=True, reason="the stranding grid is c_bar / 2 (the fluid term was measured and not kept)")
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10**9))
def test_the_stranding_term_is_the_fluid_one_within_a_fraction_of_a_score_point(seed):
    """F's stranding term is max(0, free - cpu / c_bar) on the node's free CPU as it is: its grid
    of CPU steps floors that CPU by less than one step, which should be a fraction of the score's
    finest point (0.04 GPU). The grid of c_bar / 2 floors it by up to half a GPU's CPU (passes
    with FEED_STEPS_PER_GPU = 256; tests/planner/test_stranding_grid.py)."""
    from dynpart.planner.objective import node_caps
    from dynpart.planner.problem import compile_workload
    rng = random.Random(seed)
    shares = [RequestShare(resource=f"nvidia.com/gpu-{rng.choice([100, 250, 470])}gb", cpu_milli=rng.randrange(1000, 16_001, 50),
                           weight=rng.choice([1.0, 3.0])) for _ in range(3)]
    shares.append(RequestShare(resource="nvidia.com/gpu", cpu_milli=rng.randrange(4000, 40_001, 50)))
    kinds = compile_workload(shares, [], MILLI)
    nodes, cpus, free = [], [], []
    for n in range(12):
        used = [[s] if s else [] for s in (rng.choice([0, 0, 190, 530, 1000]) for _ in range(4))]
        cpus.append(rng.randrange(0, 96_001, 7))
        free.append(sum(1000 - sum(g) for g in used) / 1000)
        nodes.append(_mps_node(f"n{n:02d}", used, cpu=cpus[-1]))
    problem = compile_problem(Snapshot(nodes=nodes), MILLI)
    states = [new_state(g) for g in problem.gpus]
    at, mem = np.arange(len(nodes)), np.zeros(len(nodes), dtype=np.int64)

    def unusable(obj: Objective) -> np.ndarray:
        rows = [[obj.class_id(capacity_class(states[g])) for g in info.gpus] for info in problem.nodes]
        return obj.unusable(np.array(rows), np.array(cpus), mem, at)

    term = unusable(Objective(kinds, problem.nodes, node_caps(problem.nodes, problem.gpus))) - unusable(Objective(kinds, problem.nodes))
    gpus = sum(k.weight * k.count * (k.ref.size / 1000 if isinstance(k.ref, MpsSliceRef) else 1.0) for k in kinds)
    c_bar = sum(k.weight * k.cpu for k in kinds) / gpus
    fluid = np.maximum(0.0, np.array(free) - np.array(cpus) / c_bar)
    assert np.all(term >= fluid - 1e-9)  # the CPU floored to its step: never less
    assert np.all(term - fluid <= 0.01)


def test_mig_placement_keeps_large_profiles_placeable():
    # an H100 with a used 3g.40gb at 4: a 1g.10gb should not go where it blocks the 3g/4g at 0
    # when a second GPU already has a used 4g.40gb at 0 and free small slots
    snap = Snapshot(nodes=[Node(name="n", mode="mig", gpu_model="H100-80GB", gpus=[
        Gpu(index=0),
        Gpu(index=1, mig=[MigInstance(profile="4g.40gb", start=0, used=True)])])],
        pending=[PendingPod(name="s", resource="nvidia.com/mig-1g.10gb")],
        workload=[RequestShare(resource="nvidia.com/mig-1g.10gb"), RequestShare(resource="nvidia.com/mig-7g.80gb")])
    node, gpus = _where(plan(snap), "s")
    assert gpus == [1]  # the idle GPU stays whole for a 7g


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), mps_share=st.sampled_from([0.0, 0.5, 1.0]))
def test_the_workload_never_costs_placed_pods_and_plans_stay_deterministic(seed, mps_share):
    snap = small_instance(seed, max_nodes=3, max_gpus=4, max_pods=20, mps_share=mps_share)
    rng = random.Random(seed)
    # a workload unrelated to the pending pods (some shares bound to GPU models): it may only
    # reorder equally good plans
    models = sorted({n.gpu_model for n in snap.nodes})
    other = [RequestShare(resource=p.resource, count=p.count, cpu_milli=rng.choice([0, 30_000]),
                          gpu_models=rng.sample(models, k=rng.randint(1, len(models))) if rng.random() < 0.3 else [],
                          weight=rng.choice([1.0, 10.0])) for p in rng.sample(snap.pending, k=max(1, len(snap.pending) // 2))]
    opts = PlanOptions(time_limit_s=0.5)
    base = plan(snap, options=opts)
    aware = plan(snap.model_copy(update={"workload": other}), options=opts)
    check_plan(snap, aware)
    proved = ("optimal" in base.stats.solver or base.stats.placed == base.stats.placed_upper_bound)
    if proved and ("optimal" in aware.stats.solver or aware.stats.placed == aware.stats.placed_upper_bound):
        assert aware.stats.placed_weight == base.stats.placed_weight
    again = plan(snap.model_copy(update={"workload": list(reversed(other))}), options=opts)
    assert again.model_dump(exclude={"stats": {"solve_s"}}) == aware.model_dump(exclude={"stats": {"solve_s"}})


def test_the_controller_learns_the_distribution_from_the_pods_it_sees():
    from dynpart.planner.demand import DemandTracker
    t = DemandTracker(half_life_s=100)
    a = PendingPod(name="a", resource="nvidia.com/mig-1g.10gb", cpu_milli=1000)
    b = PendingPod(name="b", resource="nvidia.com/mig-7g.80gb")
    t.observe([a, b], now=0)
    t.observe([a], now=100)  # still pending: counted once; everything seen decays by half
    c = PendingPod(name="c", resource="nvidia.com/mig-1g.10gb", cpu_milli=1000)
    t.observe([c], now=100)
    got = {(s.resource, s.cpu_milli): s.weight for s in t.workload()}
    assert got == {("nvidia.com/mig-1g.10gb", 1000): 1.5, ("nvidia.com/mig-7g.80gb", 0): 0.5}
    # the GPU models a pod accepts are part of its kind
    t.observe([PendingPod(name="d", resource="nvidia.com/mig-7g.80gb", gpu_models=["H100-80GB", "A100-80GB"])], now=100)
    t.observe([PendingPod(name="e", resource="nvidia.com/mig-7g.80gb", node_selector={"pool": "x"},
                          tolerations=[Toleration(key="team", operator="Exists")])], now=100)
    (pooled,) = [s for s in t.workload() if s.node_selector]
    assert pooled.node_selector == {"pool": "x"} and pooled.tolerations == [Toleration(key="team", operator="Exists")]
    got_models = {(s.resource, tuple(s.gpu_models)): s.weight for s in t.workload() if not s.node_selector}
    assert got_models[("nvidia.com/mig-7g.80gb", ("A100-80GB", "H100-80GB"))] == 1.0
    assert got_models[("nvidia.com/mig-7g.80gb", ())] == 0.5


def test_the_learned_distribution_keeps_its_heaviest_kinds_and_one_kind_per_set_of_nodes():
    from dynpart.planner.demand import DemandTracker
    t = DemandTracker(half_life_s=100, max_kinds=3)
    one, two = Toleration(key="a", operator="Exists"), Toleration(key="b", operator="Exists")
    t.observe([PendingPod(name=f"x{i}", resource="nvidia.com/mig-1g.10gb", tolerations=[one, two]) for i in range(3)]
              + [PendingPod(name="y", resource="nvidia.com/mig-1g.10gb", tolerations=[two, one])], now=0)
    assert [s.weight for s in t.workload()] == [4.0]  # the same tolerations in another order: one kind
    # pods that differ only in CPU: each a kind; the workload keeps the 3 heaviest
    t.observe([PendingPod(name=f"c{i}-{j}", resource="nvidia.com/mig-2g.20gb", cpu_milli=100 * i)
               for i in range(1, 40) for j in range(i % 4)], now=0)
    kept = t.workload()
    assert len(kept) == 3 and sorted(s.weight for s in kept) == [3.0, 3.0, 4.0]
    assert len(t._weights) <= 4 * 3


def test_a_learned_share_whose_models_left_the_cluster_does_not_stop_the_planning():
    # a round learns a pod accepting G or H; later the round's catalog knows only G (the H nodes
    # left): the share keeps G, and a share naming only H is dropped instead of failing the plan
    # (or becoming "any model")
    from dynpart.planner.demand import known_to
    from dynpart.planner.loop import PlanningLoop
    from dynpart.settings import default_planner_settings

    only_g = Catalog([GpuModel(name="G", memory_gb=16)])
    both = [RequestShare(resource="nvidia.com/gpu", gpu_models=["G", "H"]),
            RequestShare(resource="nvidia.com/gpu-500gb", gpu_models=["H"]),
            RequestShare(resource="nvidia.com/gpu-250gb")]
    assert [(s.resource, s.gpu_models) for s in known_to(both, only_g)] == [
        ("nvidia.com/gpu", ["G"]), ("nvidia.com/gpu-250gb", [])]
    unchanged = both[2:]
    assert known_to(unchanged, only_g) is unchanged
    lp = PlanningLoop(default_planner_settings())
    first = Snapshot(nodes=[_mps_node("a", [[]], model="G"), _mps_node("b", [[]], model="H")],
                     pending=[PendingPod(name="ml/h", resource="nvidia.com/gpu-500gb", gpu_models=["H"])])
    assert _where(lp.decide(lp.prepare(first, 0.0), MILLI), "ml/h")[0] == "b"
    later = Snapshot(nodes=[_mps_node("a", [[]], model="G")],
                     pending=[PendingPod(name="ml/g", resource="nvidia.com/gpu-500gb")])
    prepared = lp.prepare(later, 10.0)
    assert any(s.gpu_models == ["H"] for s in prepared.workload)  # still remembered
    assert _where(lp.decide(prepared, only_g), "ml/g")[0] == "a"


@settings(max_examples=200, deadline=None)
@given(delta=st.one_of(st.floats(min_value=-60.0, max_value=60.0), st.floats(min_value=-0.3, max_value=0.3),
                       st.sampled_from([0.0, -0.0, 50.0, -50.0, 1e300, -1e300, float("inf"), float("-inf")])))
def test_a_score_in_plain_python_is_numpys(delta):
    """`Objective.scores` scores a ΔF it has not met in plain Python: the same whole point as
    `Objective.score` (numpy) gives, or none, where numpy decides."""
    from dynpart.planner.objective import _score_one

    want = int(Objective.score(np.array([delta]))[0])
    got = _score_one(delta)
    assert got is None or got == want
    assert Objective([DemandKind(MigSliceRef("1g.10gb"), 1, 0, 0, 1.0)]).scores([delta]) == [want]


def test_a_score_on_a_whole_point_is_left_to_numpy():
    from dynpart.planner.objective import _score_one

    assert _score_one(-50.0) is None  # 100 sigmoid(50) is 100.0
    assert _score_one(0.0) is None  # 50.0
    assert _score_one(0.02) == -49


def test_numpy_sum_is_numpys_sum_bit_for_bit():
    """The greedy's plain-Python sums (`numpy_sum`) against numpy's over a contiguous row, at
    every length the pairwise blocks of 8 and 128 make differ."""
    from dynpart.planner.objective import numpy_sum

    rng = np.random.default_rng(7)
    for n in list(range(0, 40)) + [127, 128, 129, 255, 256, 300]:
        for _ in range(20):
            row = rng.random(n) * rng.choice([1e-3, 1.0, 1e3], size=n)
            assert numpy_sum(row.tolist()) == float(np.add.reduce(row))


def test_a_pod_any_model_can_host_leaves_the_scarce_models_gpus_to_the_pods_bound_to_them(monkeypatch):
    # A CPU-hungry pod strands half a GPU on the abundant model's nodes (12 of 24 cores left for
    # 2 GPUs, 8 cores asked per GPU) and nothing on the scarce model's node, rich in CPU. By
    # weight alone (FGD's F) it goes there: the model-bound kind's weight is a quarter; but that
    # kind may use 2 of the cluster's 14 GPUs, so its weight counts 4 times (SCARCITY_MAX) and
    # the pod leaves them free. With the scaling off (SCARCITY_MAX 1) it takes the scarce GPU.
    import dynpart.planner.objective as objective
    from dynpart.planner.objective import scarcity
    nodes = [_mps_node(f"h{i}", [[], [], []], cpu=24_000, model="H") for i in range(4)]
    nodes.append(_mps_node("g0", [[], []], cpu=64_000, model="G"))
    workload = [RequestShare(resource="nvidia.com/gpu", cpu_milli=8000, weight=3.0),
                RequestShare(resource="nvidia.com/gpu", cpu_milli=8000, weight=1.0, gpu_models=["G"])]
    snap = Snapshot(nodes=nodes, pending=[PendingPod(name="p", resource="nvidia.com/gpu", cpu_milli=12_000)],
                    workload=workload)
    problem = compile_problem(snap, MILLI)
    from dynpart.planner.objective import access_groups
    assert scarcity(problem.workload, problem.nodes, *access_groups(problem.workload, problem.nodes)) == [1.0, 4.0]
    assert [p.node for p in plan(snap, MILLI).placements] == ["h0"]
    monkeypatch.setattr(objective, "SCARCITY_MAX", 1.0)
    assert [p.node for p in plan(snap, MILLI).placements] == ["g0"]
    # every kind may use every node: no scaling
    assert scarcity(problem.workload[:1], problem.nodes, *access_groups(problem.workload[:1], problem.nodes)) == [1.0]


def test_the_scarcity_of_a_kind_counts_only_the_gpus_that_can_host_its_slices():
    # 1g.5gb exists only on the A100-40GB (2 of the 10 MIG GPUs: 5 times scarcer, at most 4);
    # 7g.80gb only on the H100s (8 of 10); 1g.10gb on both; the MPS kind is of another mode
    from dynpart.planner.objective import node_caps, scarcity

    def mig(name: str, model: str, n: int) -> Node:
        return Node(name=name, mode="mig", gpu_model=model, cpu_milli_free=64_000, memory_mib_free=1 << 20,
                    gpus=[Gpu(index=i) for i in range(n)])

    snap = Snapshot(nodes=[mig("a", "A100-40GB", 2), mig("h", "H100-80GB", 8),
                           Node(name="m", mode="mps", gpu_model="H100-80GB", cpu_milli_free=0, memory_mib_free=0,
                                gpus=[Gpu(index=0)])],
                    workload=[RequestShare(resource=r) for r in ("nvidia.com/mig-1g.5gb", "nvidia.com/mig-1g.10gb",
                                                                 "nvidia.com/mig-7g.80gb", "nvidia.com/gpu-10gb")])
    problem = compile_problem(snap, default_catalog())
    names = [k.ref.profile if isinstance(k.ref, MigSliceRef) else f"mps-{k.ref.size}" for k in problem.workload
             if isinstance(k.ref, (MigSliceRef, MpsSliceRef))]
    got = dict(zip(names,
                   scarcity(problem.workload, problem.nodes, caps=node_caps(problem.nodes, problem.gpus))))
    assert got == {"1g.5gb": 4.0, "1g.10gb": 1.0, "7g.80gb": 1.25, "mps-10": 1.0}
