"""The packing protocol, its baselines and the dynpart policy, on small synthetic data."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dynpart.simulations import bridge
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec, NodeSpec
from dynpart.simulations.inputs.synthetic import synthetic_cluster, synthetic_trace
from dynpart.simulations.packing.dynpart_packing import NO_GPU_SHARE, DynpartPacking, fgd_typical_pods, trace_workload
from dynpart.simulations.packing.experiment import (
    PAPER_CLUSTERS,
    PackingJob,
    published_elsewhere,
    published_figures,
    run_job,
    summarise,
)
from dynpart.simulations.packing.occupancy import PackingState
from dynpart.simulations.packing.protocol import run_packing
from dynpart.simulations.packing.reference_schedulers import BestFit, Random, best_fit_scores
from dynpart.simulations.packing.tuning import packing_workload, tuned

from .conftest import cluster, pod


def test_tuned_workload_stays_under_the_target_and_keeps_every_pod():
    pods = list(synthetic_trace(120, seed=3).pods)
    cap = 200 * 1000
    out = tuned(pods, cap, 1.3, np.random.default_rng(1))
    assert [p.name for p in out[: len(pods)]] == [p.name for p in pods]
    total = sum(p.gpu_demand for p in out)
    assert total <= 1.3 * cap
    assert len({p.name for p in out}) == len(out)
    shuffled = packing_workload(pods, cap, 1.3, seed=42)
    assert shuffled == packing_workload(pods, cap, 1.3, seed=42)
    assert Counter(p.name for p in shuffled) != Counter(p.name for p in packing_workload(pods, cap, 1.3, seed=43))


def test_a_list_above_the_target_is_tuned_down_and_copies_never_take_a_traces_own_name():
    """The authors' simulator removes random pods from a list whose demand is above the target
    (multigpu40/50 are); a copy's `<name>#<k>` must not collide with a pod the trace names so."""
    pods = [pod(f"p{i}", gpus=2) for i in range(100)]  # 200,000 milli of demand
    down = tuned(pods, 100 * 1000, 1.3, np.random.default_rng(1))
    assert sum(p.gpu_demand for p in down) <= 130_000 and len(down) == 65
    assert {p.name for p in down} <= {p.name for p in pods}  # a subset, no copies
    named = [pod("x", milli=500), pod("x#1", milli=500)]
    up = tuned(named, 10 * 1000, 1.3, np.random.default_rng(1))
    assert len({p.name for p in up}) == len(up) and sum(p.gpu_demand for p in up) <= 13_000
    with pytest.raises(SimulationError, match="asks for no GPU"):
        tuned([pod("c", gpus=0)], 10 * 1000, 1.3, np.random.default_rng(1))


def test_packing_matches_gpu_models_by_their_exact_name_and_bounds_no_mps_clients():
    """The protocol takes a pod's gpu_spec as node-list names, exactly: `H100-80GB` is not `H100`,
    though the catalog resolves both to one model (it used to crash). And it shares a GPU by milli
    alone: 100 pods of 10 milli fit one GPU, whatever an MPS server's client limit is."""
    spec = cluster(("n1", 1 << 30, 1, "H100"))
    state = PackingState(spec)
    policy = DynpartPacking(trace_workload([pod("a", milli=10)]))
    pods = [pod("other-name", milli=500, spec=("H100-80GB",)), pod("lower", milli=500, spec=("h100",)),
            pod("exact", milli=500, spec=("H100", "T4"))]
    assert policy.place_batch(state, pods) == [False, False, True]
    tiny = [pod(f"t{i}", milli=5, cpu=1, mem=1) for i in range(100)]
    assert all(policy.place_batch(state, tiny))


class Recording:
    """Wraps a policy: records, for each pod it fails, whether some node could take it."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.wrongly_failed: list[str] = []

    def place_batch(self, state, pods):
        could = {p.name: bool(state.feasible(p).any()) for p in pods}
        out = self.inner.place_batch(state, pods)
        if len(pods) == 1:
            self.wrongly_failed += [p.name for p, ok in zip(pods, out) if not ok and could[p.name]]
        return out


@pytest.mark.parametrize("make", [BestFit, Random,
                                  lambda s: DynpartPacking(trace_workload(synthetic_trace(300).pods))])
def test_protocol_invariants(make):
    trace = synthetic_trace(300)
    spec = synthetic_cluster()
    holder = {}

    def factory(seed):
        holder["p"] = Recording(make(seed))
        return holder["p"]

    r = run_packing(trace.pods, spec, factory, seed=7)
    arrived = [a for a, _ in r.curve]
    alloc = [b for _, b in r.curve]
    assert arrived == sorted(arrived) and alloc == sorted(alloc)  # one-way: nothing leaves
    biggest = 100 * max(p.gpu_demand for p in trace.pods) / r.capacity_milli
    # never more allocated than arrived (a point is recorded when a pod's arrival crosses it)
    assert all(b <= a + biggest + 1e-9 for a, b in r.curve) and alloc[-1] <= arrived[-1]
    assert arrived[-1] <= 130.0 + 1e-9
    assert r.counts.placed + r.counts.failed == r.pods
    assert not holder["p"].wrongly_failed  # a pod fails only when no node can take it
    assert r.alloc_at(100) <= r.alloc_at(130)
    assert r.extra.get("disrupted", 0) == 0


def _state():
    return PackingState(cluster(("a", 16_000, 2, "T4"), ("b", 64_000, 2, "T4"), ("c", 64_000, 4, "V100"),
                                ("cpu", 32_000, 0, "")))


def test_state_fit_rule_and_gpu_choice():
    st = _state()
    st.place(pod("x", milli=700), 1, (0,))
    st.place(pod("y", milli=300), 1, (1,))
    assert st.gpu_free[1, :2].tolist() == [300, 700]
    share = pod("s", milli=250)
    assert st.best_fit_gpus(share, 1) == (0,)  # the tightest GPU that fits
    assert st.feasible(pod("w", gpus=2)).tolist() == [True, False, True, False]  # two whole GPUs
    assert st.feasible(pod("big", cpu=20_000, milli=100)).tolist() == [False, True, True, False]
    assert st.feasible(pod("spec", milli=100, spec=("V100",))).tolist() == [False, False, True, False]
    assert st.feasible(pod("cpu-only", gpus=0)).tolist() == [True, True, True, True]
    assert st.best_fit_gpus(pod("w3", gpus=3), 2) == (0, 1, 2)
    with pytest.raises(ValueError):
        st.place(pod("z", milli=800), 1, (0,))
    st.remove("x")
    assert st.gpu_free[1, 0] == 1000 and st.allocated == 300


def test_best_fit_score_and_choice():
    st = _state()
    st.place(pod("x", milli=900), 2, (3,))
    p = pod("s", cpu=4000, milli=100)
    scores = best_fit_scores(st, p)
    # s = 0.5 (cpu_free - cpu) / 128000 + 0.5 (gpu_free - gpu) / 8000; score = trunc((1 - s) 100)
    expect_c = int((1 - (0.5 * (63_000 - 4000) / 128_000 + 0.5 * (3100 - 100) / 8000)) * 100)
    assert scores[2] == expect_c
    node, gpus = BestFit(seed=0).choose(st, p)
    assert node == 0  # the least resources left over: the 16-core T4 node
    st.place(p, node, gpus)
    assert BestFit(seed=0).choose(st, pod("t", cpu=1000, milli=100)) == (0, (0,))  # same GPU, tightest
    # ties are broken at random among the best score (seeded)
    twins = PackingState(cluster(("a", 8000, 1, "T4"), ("b", 8000, 1, "T4")))
    picks = {BestFit(seed=s).choose(twins, pod("p", milli=500))[0] for s in range(20)}
    assert picks == {0, 1}


def test_random_places_on_feasible_nodes_only():
    st = _state()
    rnd = Random(seed=1)
    for i in range(30):
        p = pod(f"p{i}", cpu=1000, milli=200)
        pick = rnd.choose(st, p)
        if pick is None:
            assert not st.feasible(p).any()
            continue
        assert st.feasible(p)[pick[0]] and st.gpu_free[pick[0], pick[1][0]] >= 200
        st.place(p, *pick)


def test_dynpart_batches_plan_through_plan_and_keep_used_slices():
    trace = synthetic_trace(200, seed=5)
    for batch in (1, 8):
        r = run_job(PackingJob("dynpart", seed=3, batch=batch), trace.pods, synthetic_cluster(), None)
        assert r.plan_calls > 0 and r.extra["disrupted"] == 0
        assert r.counts.placed > 0.6 * r.pods
    s = summarise("dynpart", 8, [r], 1.0, {"fgd": (95.23, 95.39)})
    assert {"policy", "batch", "seeds", "alloc_at_100", "alloc_at_130", "per_seed", "wall_s"} <= set(s)
    assert s["published"]["fgd"]["alloc_at_130"] == 95.39
    assert "published" not in summarise("dynpart", 8, [r], 1.0, {})


def _paper_shaped(nodes: int, gpus: int) -> ClusterSpec:
    """A cluster of `nodes` nodes and `gpus` GPUs (8 a node, the rest on the last GPU node)."""
    full, rest = divmod(gpus, 8)
    specs = [NodeSpec(f"n{i}", 96_000, 1 << 19, 8 if i < full else rest if i == full else 0, "G2")
             for i in range(nodes)]
    return ClusterSpec("test", tuple(specs))


def test_published_figures_are_shown_only_for_the_papers_cluster_and_tune():
    # every node of the openb list (the protocol's) and its GPU nodes (the authors' tables')
    for shape in ((1523, 6212), (1213, 6212)):
        assert shape in PAPER_CLUSTERS
        paper = _paper_shaped(*shape)
        assert paper.gpu_count == shape[1]
        assert published_figures("openb_pod_list_default.csv", paper, 1.3)["fgd"] == (95.23, 95.39)
        assert published_elsewhere("openb_pod_list_default.csv", paper, 1.3) is None
        assert published_figures("mine.csv", paper, 1.3) == {} and published_elsewhere("mine.csv", paper, 1.3) is None
    # a cut-down list, the same GPUs on fewer nodes, another --tune: none
    for other, tune in ((_paper_shaped(100, 800), 1.3), (_paper_shaped(1000, 6212), 1.3), (paper, 1.0)):
        assert published_figures("openb_pod_list_default.csv", other, tune) == {}
        line = published_elsewhere("openb_pod_list_default.csv", other, tune)
        assert line is not None and f"{len(other.nodes):,} nodes" in line and f"--tune {tune:g}" in line


def test_the_planner_session_holds_the_whole_cluster_and_matches_the_state(catalog):
    st = _state()
    pol = DynpartPacking(trace_workload([pod("k", milli=500), pod("w", gpus=1)]), catalog)
    assert pol.place_batch(st, [pod("x", milli=700), pod("c", gpus=0, cpu=4000)]) == [True, True]
    session = pol.session
    assert session is not None
    # every node, CPU-only ones too, as the planner sees it (GPU milli as MPS capacity)
    assert [n.name for n in session.problem.nodes] == st.names
    assert session.cpu.tolist() == st.cpu.tolist() and session.mem.tolist() == st.mem.tolist()
    assert st.placements["c"].node == st.index["cpu"]  # the node without GPUs takes the CPU-only pod
    held = {(n, g): 1000 - int(st.gpu_free[n, g]) for n in range(len(st.names)) for g in range(int(st.ngpu[n]))}
    for g in session.problem.gpus:
        assert g.capacity == 1000 and sum(s for s, _ in g.used_mps) == held[(g.node, g.index)]
    assert bridge.packing_request(pod("m", gpus=4)) == ("nvidia.com/gpu", 4)
    assert bridge.packing_request(pod("s", milli=470)) == ("nvidia.com/gpu-470gb", 1)


def test_the_trace_is_the_planners_request_distribution():
    shares = trace_workload([pod("a", milli=500), pod("b", milli=500), pod("c", gpus=2), pod("d", gpus=0)])
    assert [(s.resource, s.count, s.weight) for s in shares] == [("nvidia.com/gpu", 2, 1.0),
                                                                 ("nvidia.com/gpu-500gb", 1, 2.0)]


def test_fgd_typical_pods_are_the_authors_popular_groups_cpu_pods_included():
    # 20 pods: 10 share pods of 500 milli at 2 CPUs, 6 CPU-only pods, 3 whole GPUs, and one rare
    # share pod; memory is no part of a group (two memory sizes, one group)
    pods = ([pod(f"s{i}", cpu=2000, milli=500, mem=1024 * (1 + i % 2)) for i in range(10)]
            + [pod(f"c{i}", cpu=4000, gpus=0) for i in range(6)]
            + [pod(f"w{i}", cpu=8000, gpus=1) for i in range(3)] + [pod("rare", cpu=1000, milli=130)])
    typical = fgd_typical_pods(pods)
    # 19 of 20 pods (95 %) are covered by the three popular groups; the rare one is left out
    assert [(s.resource, s.count, s.cpu_milli, s.memory_mib, s.weight) for s in typical] == [
        ("nvidia.com/gpu", 1, 8000, 0, 3.0), (NO_GPU_SHARE, 1, 4000, 0, 6.0),
        ("nvidia.com/gpu-500gb", 1, 2000, 0, 10.0)]
    assert [s.resource for s in fgd_typical_pods(pods, popularity_pct=100)][-1] == "nvidia.com/gpu-500gb"
    assert len(fgd_typical_pods(pods, popularity_pct=100)) == 4
    assert len(fgd_typical_pods(pods, popularity_pct=50)) == 1  # the 10 share pods cover half


def test_fgd_packing_runs_the_planner_with_its_typical_pods():
    trace = synthetic_trace(150, seed=4)
    r = run_job(PackingJob("fgd", seed=3), trace.pods, synthetic_cluster(), None)
    assert r.policy == "fgd" and r.plan_calls > 0 and r.extra["disrupted"] == 0
    assert r.counts.placed > 0.6 * r.pods
    # CPU-only pods in the distribution make every free GPU count as partly unusable: the plans
    # see another objective than dynpart's, on the same protocol
    assert any(s.resource == NO_GPU_SHARE for s in fgd_typical_pods(trace.pods)) == any(not p.num_gpu for p in trace.pods)


def test_equal_options_fill_the_cluster_in_node_order_and_consolidate():
    # four empty identical nodes: the planner takes the first; then a second 500 goes to the
    # GPU already half used (no new fragmentation) rather than to a fresh one
    st = PackingState(cluster(*[(f"n{i}", 64_000, 2, "T4") for i in range(4)]))
    pol = DynpartPacking(trace_workload([pod("k", milli=500), pod("w", gpus=1)]))
    assert pol.place_batch(st, [pod("p1", milli=500)]) == [True]
    assert st.placements["p1"].node == 0
    assert pol.place_batch(st, [pod("p2", milli=500)]) == [True]
    assert (st.placements["p2"].node, st.placements["p2"].gpus) == (0, st.placements["p1"].gpus)


def test_a_batch_is_placed_in_one_plan():
    st = PackingState(cluster(*[(f"n{i}", 64_000, 1, "T4") for i in range(4)]))
    pol = DynpartPacking(trace_workload([pod("w", gpus=1)]), batch=4)
    mates = [pod(f"w{i}", gpus=1) for i in range(4)]
    assert pol.place_batch(st, mates) == [True] * 4
    assert pol.plan_calls == 1
    assert sorted(st.placements[p.name].node for p in mates) == [0, 1, 2, 3]


def test_free_at_end_accounts_for_all_unallocated_capacity():
    from dynpart.simulations.packing.protocol import free_at_end
    st = _state()
    st.place(pod("x", milli=810), 1, (0,))
    st.place(pod("y", milli=100), 1, (0,))
    st.place(pod("z", milli=470), 2, (3,))
    st.place(pod("w", gpus=1), 2, (0,))
    got = free_at_end(st)
    cap = st.total_gpu
    assert got == {"whole_gpus": round(100 * 5000 / cap, 3), "470": round(100 * 530 / cap, 3),
                   "810": round(100 * 90 / cap, 3)}
    assert abs(sum(got.values()) - 100 * (1 - st.allocation_ratio)) < 0.01


def test_a_pod_asking_only_for_models_the_cluster_lacks_fails_in_any_batch(catalog):
    # the catalog the planner gets knows every model of the workload, not only the first batch's:
    # a later pod asking for A10 on a T4-only cluster is not placed (FGD counts it failed)
    st = PackingState(cluster(*[(f"n{i}", 64_000, 2, "T4") for i in range(2)]))
    a10 = pod("a10", milli=500, spec=("A10",))
    pol = DynpartPacking(trace_workload([pod("k", milli=500), a10]), catalog)
    assert pol.place_batch(st, [pod("p1", milli=500)]) == [True]
    assert pol.place_batch(st, [a10]) == [False]
    assert pol.place_batch(st, [pod("t4", milli=500, spec=("T4",))]) == [True]
