"""Replay invariants: no used slice disrupted, a slice held by one pod at a time (reused only
after its pod left), slices within the GPU, reconfiguration delays, and the metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.mig import MigRules
from dynpart.settings import default_planner_settings
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.synthetic import synthetic_mig_cluster, synthetic_trace
from dynpart.simulations.replay.engine import ReplayOptions, run_replay
from dynpart.simulations.replay.mapping import mig_profile_for, request_for, static_layout
from dynpart.simulations.replay.summary import arrival_window, mean_allocation, percentile, summary

from .conftest import cluster, pod


def _holds(result):
    """(node, gpu) -> [(from, to, slice, pod)] for every pod that held slices."""
    out = defaultdict(list)
    for r in result.runs:
        if r.start is None or not r.slices:
            continue
        for placed in r.slices:
            out[(r.node, placed.gpu)].append((r.assigned, r.start + r.duration, str(placed), r.pod.name))
    return out


def _check_invariants(result, catalog, model="H100-80GB"):
    assert result.used_slices_disrupted == 0 and result.plans_rejected == 0
    rules = MigRules.of(catalog.resolve(model))
    cap = catalog.resolve(model).mps_capacity_gb
    for (node, gpu), holds in _holds(result).items():
        for i, (a0, a1, what_a, pa) in enumerate(holds):
            for b0, b1, what_b, pb in holds[i + 1:]:
                if a0 < b1 and b0 < a1:  # held at the same time on the same GPU
                    assert what_a != what_b or what_a != "whole", (pa, pb)
                    if result.mode == "mig":
                        pa_, sa = what_a.split("@")
                        pb_, sb = what_b.split("@")
                        ma = rules.mask(rules.index[pa_], int(sa))
                        mb = rules.mask(rules.index[pb_], int(sb))
                        assert not ma & mb, f"{pa} and {pb} share memory slices of {node}/{gpu}"
                    else:
                        assert "whole" not in (what_a, what_b), (pa, pb)
        if result.mode == "mps":
            times = sorted({t for h in holds for t in h[:2]})
            for t in times:
                used = sum(int(w) for a, b, w, _ in holds if a <= t < b and w != "whole")
                assert used <= cap
    for r in result.runs:
        if r.start is not None:
            assert r.arrival <= r.assigned <= r.start


@pytest.mark.parametrize("policy", ["dynpart", "nos", "static"])
def test_mig_replay_invariants(policy, catalog):
    trace = synthetic_trace(150, seed=2)
    opts = ReplayOptions(policy=policy, mig_op_delay_s=20.0,
                         static_layout=tuple(static_layout("all-balanced", catalog.resolve("H100-80GB"), "mig").items()))
    result = run_replay(trace.pods, synthetic_mig_cluster(1), catalog, opts)
    _check_invariants(result, catalog)
    s = summary(result)
    assert s["placed"] + s["never_placed"] + s["failed"] == s["gpu_pods"]
    if policy == "static":
        assert result.reconfigurations == 0 and s["never_placed"] > 0  # all-balanced has no 7g slice
    else:
        assert s["never_placed"] == 0 and result.reconfigurations > 0 and result.gpus_touched <= 8


@pytest.mark.parametrize("policy", ["dynpart", "nos"])
def test_mps_replay_invariants(policy, catalog):
    trace = synthetic_trace(120, seed=4)
    spec = cluster(("n0", 224_000, 4, "H100-80GB"), ("n1", 224_000, 4, "H100-80GB"), mode="mps")
    result = run_replay(trace.pods, spec, catalog, ReplayOptions(policy=policy))
    assert result.mode == "mps"
    _check_invariants(result, catalog)
    assert summary(result)["never_placed"] == 0


def test_reconfiguration_delay_and_slice_reuse(catalog):
    # a (3g.40gb) finds no slice: the controller's loop plans it at once (the first round is a
    # resync) and its instance is ready 7 s later; b arrives at 10 and is planned when its batch
    # closes (batch_idle_s later), on a second instance created on the acknowledged node; c arrives
    # after both left and the scheduler binds it to a free instance: no plan, no reconfiguration
    pods = [pod("a", milli=400, t0=0, t1=100), pod("b", milli=400, t0=10, t1=300),
            pod("c", milli=400, t0=500, t1=600)]
    spec = cluster(("n0", 64_000, 1, "H100-80GB"), mode="mig")
    opts = ReplayOptions(policy="dynpart", mig_op_delay_s=7)
    r = run_replay(pods, spec, catalog, opts)
    a, b, c = r.runs
    idle = opts.planner.batch_idle_s
    assert (a.assigned, a.start, a.planned) == (0, 7, True)
    assert (b.assigned, b.start, b.planned) == (10 + idle, 10 + idle + 7, True)
    assert (c.assigned, c.start, c.planned) == (500, 500, False)
    assert r.reconfigurations == 2 and r.mig_ops == 2 and r.gpus_touched == 1 and r.plan_calls == 2
    # what the loop decided, as the controller writes it: one layout per node and round, with its pods
    assert [(w.time, w.node, w.pods) for w in r.writes] == [(0, "n0", ("a",)), (10 + idle, "n0", ("b",))]
    _check_invariants(r, catalog)


def test_a_node_is_not_planned_again_before_it_acknowledged(catalog):
    # b arrives while n0 reconfigures for a (20 s per MIG operation): the loop leaves n0 out of
    # the round and plans b on n1, as the controller leaves out nodes whose plan is in flight
    pods = [pod("a", milli=400, t0=0, t1=1000), pod("b", milli=400, t0=5, t1=1000)]
    spec = cluster(("n0", 64_000, 1, "H100-80GB"), ("n1", 64_000, 1, "H100-80GB"), mode="mig")
    r = run_replay(pods, spec, catalog, ReplayOptions(policy="dynpart", mig_op_delay_s=20))
    a, b = r.runs
    assert (a.node, b.node) == (0, 1) and b.start < a.start + 20
    _check_invariants(r, catalog)


def test_pods_that_never_fit_fail_and_cpu_pods_are_placed(catalog):
    pods = [pod("huge", cpu=500_000, milli=100), pod("cpu", gpus=0, cpu=4000), pod("ok", milli=100)]
    r = run_replay(pods, cluster(("n0", 64_000, 2, "H100-80GB"), mode="mig"), catalog, ReplayOptions())
    runs = {x.pod.name: x for x in r.runs}
    huge, cpu, ok = runs["huge"], runs["cpu"], runs["ok"]
    assert huge.failed and huge.start is None
    assert cpu.start is not None and ok.start is not None
    s = summary(r)
    assert s["failed"] == 1 and s["cpu_only_pods"]["placed"] == 1


def test_gpu_spec_is_not_applied_in_replay(catalog):
    # the trace's models (T4) are not the replay cluster's: pods run on its H100s, and the GPU
    # pods whose gpu_spec was left aside are counted under notes
    pods = [pod("a", milli=100, spec=("T4",)), pod("b", milli=500, spec=("T4", "A10")), pod("c", milli=100),
            pod("cpu", gpus=0, spec=("T4",))]
    for policy in ("dynpart", "nos"):
        r = run_replay(pods, cluster(("n0", 64_000, 1, "H100-80GB"), mode="mig"), catalog, ReplayOptions(policy=policy))
        assert all(x.start is not None for x in r.runs), policy
        assert summary(r)["notes"] == {"gpu_spec_not_applied": 2}


def test_replay_needs_times_and_one_model(catalog):
    with pytest.raises(SimulationError, match="no creation/deletion time"):
        run_replay([pod("a", t0=None, t1=None)], synthetic_mig_cluster(1), catalog, ReplayOptions())
    two = cluster(("a", 1000, 1, "H100-80GB"), ("b", 1000, 1, "A100-80GB"), mode="mig")
    with pytest.raises(SimulationError, match="one model"):
        run_replay([pod("a")], two, catalog, ReplayOptions())
    with pytest.raises(SimulationError, match="--policy"):
        run_replay([pod("a")], synthetic_mig_cluster(1), catalog, replace(ReplayOptions(), policy="magic"))


def test_mapping_rules(catalog):
    h100 = catalog.resolve("H100-80GB")
    assert mig_profile_for(h100, 100) == "1g.10gb"
    assert mig_profile_for(h100, 470) == "4g.40gb"  # 3/7 < 0.47 <= 4/7
    assert mig_profile_for(h100, 810) == "7g.80gb"
    assert mig_profile_for(h100, 200, "memory") == "1g.20gb"  # 2/8 memory slices, 1 compute
    assert request_for(pod("w", gpus=2), h100, "mig") == ("nvidia.com/mig-7g.80gb", 2)
    assert request_for(pod("s", milli=470), h100, "mps") == ("nvidia.com/gpu-37gb", 1)  # floor(0.47 x 79)
    # two half-GPU pods fit one GPU, as on the traced cluster (rounded up: 40 + 40 > 79)
    assert request_for(pod("s", milli=500), h100, "mps") == ("nvidia.com/gpu-39gb", 1)
    assert request_for(pod("s", milli=5), h100, "mps") == ("nvidia.com/gpu-1gb", 1)
    assert request_for(pod("w", gpus=4), h100, "mps") == ("nvidia.com/gpu", 4)
    assert static_layout("all-7g", h100, "mig") == {"H100-80GB": "7g.80gb:1"}
    assert static_layout("mps-2", h100, "mps") == {"mps": "2"}
    with pytest.raises(SimulationError):
        static_layout("all-9g", h100, "mig")
    # a +me profile H100 has: not "no profile '1g.10gb+me'" (the catalog lists it), but why
    with pytest.raises(SimulationError, match=r"'all-1g.10gb\+me': 1g.10gb\+me is at most 1 a GPU, so no all-<profile> "
                                              r"layout; write a geometry with it, e.g. 1g.10gb\+me:1,1g.10gb:1"):
        static_layout("all-1g.10gb+me", h100, "mig")
    assert static_layout("1g.10gb+me:1,1g.10gb:1", h100, "mig") == {"H100-80GB": "1g.10gb+me:1,1g.10gb:1"}


def test_static_slices_of_one_size_fill_what_an_h100_holds(catalog):
    """mps-10gb on an H100 (79 GiB, what its driver reports): 7 slices of 10 GB, so 7 of 8 pods
    that run together are placed; 8 equal slices (mps-8) are 9 GB each and serve none of them."""
    h100 = catalog.resolve("H100-80GB")
    pods = [pod(f"p{i}", t0=0, t1=1000) for i in range(8)]
    pods = [replace(p, slice_name="10gb") for p in pods]
    spec = cluster(("n1", 64_000, 1, "H100-80GB"))
    for name, placed in (("mps-10gb", 7), ("mps-8", 0)):
        opts = ReplayOptions(policy="static", static_layout=tuple(static_layout(name, h100, "mps").items()))
        result = run_replay(pods, spec, catalog, opts)
        assert sum(1 for r in result.runs if r.start is not None and r.start < 1000) == placed, name


def test_percentile():
    assert percentile([], 95) is None
    assert percentile([5.0], 50) == 5.0
    assert percentile(list(range(1, 101)), 95) == 95


def test_mean_allocation_is_time_weighted_over_the_window():
    timeline = [(0.0, 1, 0, 0.0), (10.0, 0, 1, 50.0), (30.0, 0, 2, 100.0), (40.0, 0, 0, 0.0)]
    assert mean_allocation(timeline, 0.0, 40.0) == pytest.approx((20 * 50 + 10 * 100) / 40)
    assert mean_allocation(timeline, 20.0, 35.0) == pytest.approx((10 * 50 + 5 * 100) / 15)
    assert mean_allocation(timeline, 40.0, 50.0) == 0.0  # after the last point: its value, 0
    assert mean_allocation(timeline, 5.0, 5.0) == 0.0


def test_the_mean_allocation_ignores_the_tail_after_the_last_arrival(catalog):
    # the same work, held from the first arrival to the last, whatever runs after: two policies
    # that place every pod show what they held while the load was offered
    trace = synthetic_trace(150, seed=2)
    result = run_replay(trace.pods, synthetic_mig_cluster(1), catalog, ReplayOptions(policy="dynpart"))
    first, last = arrival_window(result)
    assert first == min(r.arrival for r in result.runs) and last == max(r.arrival for r in result.runs)
    assert result.end_time > last  # pods still ran after the last arrival
    s = summary(result)
    assert s["allocation_window_s"] == [round(first, 1), round(last, 1)]
    assert s["allocation_mean_pct"] == round(mean_allocation(result.timeline, first, last), 2)
    whole_run = mean_allocation(result.timeline, result.timeline[0][0], result.end_time)
    assert s["allocation_mean_pct"] > whole_run


def test_the_allocation_window_counts_gpu_pods_and_all_at_once_ends_where_the_runs_compared_end(catalog):
    spec = cluster(("n0", 64_000, 2, "H100-80GB"), mode="mps")
    # a CPU-only pod arriving late does not stretch the window (helper-174)
    late_cpu = [pod("a", t0=0, t1=500), pod("b", t0=10, t1=900), pod("c", gpus=0, t0=50_000, t1=50_100)]
    r = run_replay(late_cpu, spec, catalog, ReplayOptions(policy="dynpart"))
    assert arrival_window(r) == (0.0, 10.0)
    # every GPU pod at once: until the horizon the compared runs share, not each run's own end
    at_once = [pod("a", t0=0, t1=500), pod("b", t0=0, t1=900)]
    r = run_replay(at_once, spec, catalog, ReplayOptions(policy="dynpart"))
    assert arrival_window(r) == (0.0, r.end_time)
    assert arrival_window(r, horizon=2_000.0) == (0.0, 2_000.0)
    assert summary(r, 2_000.0)["allocation_window_s"] == [0.0, 2_000.0]


def test_a_drained_gpu_empties_for_a_whole_gpu_pod(catalog):
    # s1 and s2 hold a 4g.40gb each on the two GPUs; w (7g.80gb) waits. After drain_after_s the
    # loop drains GPU 0 (least in use, first): its free room is not used again (k, a 3g.40gb pod
    # arriving later, goes to GPU 1), and w runs there once s1 left, not when s2 leaves
    pods = [pod("s1", milli=500, t0=0, t1=1000), pod("s2", milli=500, t0=0, t1=9000),
            pod("w", milli=1000, t0=10, t1=20_000), pod("k", milli=400, t0=200, t1=20_000),
            pod("k2", milli=400, t0=300, t1=20_000)]
    spec = cluster(("n0", 64_000, 2, "H100-80GB"), mode="mig")
    settings = default_planner_settings().model_copy(update={"drain_after_s": 50})
    r = run_replay(pods, spec, catalog, ReplayOptions(policy="dynpart", mig_op_delay_s=5, planner=settings))
    by = {x.pod.name: x for x in r.runs}
    gpu_of = {n: {s.gpu for s in by[n].slices} for n in by}
    assert gpu_of["s1"] == {0} and gpu_of["s2"] == {1} and gpu_of["w"] == {0}
    assert 1000 < by["w"].start <= 1000 + 30
    assert gpu_of["k"] == {1} and by["k2"].start >= by["w"].start  # nothing new on the drained GPU
    assert [g["index"] for w in r.writes for g in w.layout["gpus"] if g["drain"]] == [0]  # one drain, written once
    _check_invariants(r, catalog)

    off = run_replay(pods, spec, catalog, ReplayOptions(policy="dynpart", mig_op_delay_s=5))
    assert {x.pod.name: x for x in off.runs}["w"].start >= 9000  # without a drain, w waits for s2 too


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1_000), case=st.sampled_from([("dynpart", "mig"), ("nos", "mig"), ("static", "mig"),
                                                          ("dynpart", "mps"), ("nos", "mps")]),
       compress=st.sampled_from([1.0, 3.0, 8.0]), delay=st.sampled_from([0.0, 20.0, 60.0]))
def test_what_the_replay_keeps_per_node_is_what_reading_the_node_again_gives(seed, case, compress, delay, catalog):
    """The scheduler's free slices and the allocation are kept per node until the node changes or
    a slice of it becomes ready (`ReplayCluster.versions`, `scheduler.free_by_resource`): the same
    replay reading every node afresh at every step gives the same pods, times and timeline."""
    from dynpart.simulations.replay import cluster as cluster_module
    from dynpart.simulations.replay import scheduler

    policy, mode = case
    trace = synthetic_trace(100, seed=seed)
    spec = (synthetic_mig_cluster(2) if mode == "mig"
            else cluster(("n0", 224_000, 4, "H100-80GB"), ("n1", 224_000, 4, "H100-80GB"), mode="mps"))
    geometry = "all-balanced" if mode == "mig" else "mps-4"
    opts = ReplayOptions(policy=policy, mig_op_delay_s=delay, mps_switch_delay_s=delay, compress=compress,
                         static_layout=tuple(static_layout(geometry, catalog.resolve("H100-80GB"), mode).items()))

    def outcome(result):
        return ([(r.pod.name, r.node, r.assigned, r.start, r.failed, [str(s) for s in r.slices]) for r in result.runs],
                result.timeline, result.reconfigurations, result.mig_ops, result.gpus_touched, result.end_time)

    kept = outcome(run_replay(trace.pods, spec, catalog, opts))
    fresh_free, fresh_held = scheduler.free_by_resource, cluster_module.ReplayCluster._held_shares

    def free_afresh(cl, node, now):
        cl.free_cache[node] = None
        return fresh_free(cl, node, now)

    def held_afresh(self, i):
        self._held_cache[i] = None
        return fresh_held(self, i)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "free_by_resource", free_afresh)
        mp.setattr(cluster_module.ReplayCluster, "_held_shares", held_afresh)
        assert outcome(run_replay(trace.pods, spec, catalog, opts)) == kept
