"""The greedy's two ways of finding a one-slice pod's best node (planner/greedy.py): the heap per
slice kind and the numpy scan over every candidate find the same option, so plans do not depend
on which one ran, on mixed clusters with node selectors, nodes short of CPU and (`models`) two
GPU models that some pods name (the objective's access groups)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.planner import greedy as greedy_module
from dynpart.planner.session import PlanningSession
from dynpart.planner.workload import random_snapshot
from dynpart.snapshot import Gpu, Node, PendingPod, RequestShare, Snapshot


def _snapshot(seed: int, mode: str, models: bool = False) -> Snapshot:
    rng = random.Random(seed)
    snap = random_snapshot(seed, rng.randint(4, 40), 8, "H100-80GB", rng.randint(20, 160), mode,
                           rng.choice([0.3, 0.7, 0.95]), default_catalog())
    for i, node in enumerate(snap.nodes):
        node.labels["pool"] = "a" if i % 3 else "b"  # two thirds of the nodes: the heap's candidate mask
        if rng.random() < 0.3:
            node.cpu_milli_free = rng.choice([0, 500, 2000])  # nodes the heap pops but the pod does not fit
        if models and rng.random() < 0.4:
            node.gpu_model = "A100-80GB"  # the same MIG profiles and placements as the H100's
    for pod in snap.pending:
        if rng.random() < 0.2:
            pod.node_selector = {"pool": "a"}
        if models and rng.random() < 0.3:
            pod.gpu_models = rng.choice([["A100-80GB"], ["H100-80GB"], ["A100-80GB", "H100-80GB"]])
    return snap


def _plan(snap: Snapshot, monkeypatch: pytest.MonkeyPatch, heap_after: int, heap_pops: int) -> tuple[str, dict[str, int]]:
    calls = {"heap": 0, "scan": 0, "wide": 0}
    heap, scan = greedy_module.Greedy._best_single_heap, greedy_module.Greedy._best_single_scan
    bucket = greedy_module.Greedy._best_single_bucket

    def counted_heap(self, *args):  # type: ignore[no-untyped-def]
        calls["heap"] += 1
        return heap(self, *args)

    def counted_bucket(self, *args):  # type: ignore[no-untyped-def]
        calls["heap"] += 1
        return bucket(self, *args)

    def counted_scan(self, *args):  # type: ignore[no-untyped-def]
        calls["scan"] += 1
        # a pod the heap would take once its kind has one (candidates on a quarter of the nodes
        # or more)
        calls["wide"] += greedy_module._FEW_CANDIDATES * len(args[0].candidates) >= len(self.problem.nodes)
        return scan(self, *args)

    with monkeypatch.context() as m:
        m.setattr(greedy_module, "_HEAP_AFTER", heap_after)
        m.setattr(greedy_module, "_HEAP_POPS", heap_pops)
        m.setattr(greedy_module.Greedy, "_best_single_heap", counted_heap)
        m.setattr(greedy_module.Greedy, "_best_single_bucket", counted_bucket)
        m.setattr(greedy_module.Greedy, "_best_single_scan", counted_scan)
        result = plan(snap, default_catalog(), PlanOptions(time_limit_s=0))
    out = result.model_dump(mode="json")
    out["stats"].pop("solve_s")
    return str(out), calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=10**9), mode=st.sampled_from(["mig", "mps"]), models=st.booleans())
def test_heap_and_scan_find_the_same_options(seed: int, mode: str, models: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snapshot(seed, mode, models)
    by_scan, scan_calls = _plan(snap, monkeypatch, heap_after=10**9, heap_pops=48)
    assert scan_calls["heap"] == 0
    for pops in (48, 2):  # 2: many pods given up to the scan midway, the heap kept in step
        by_heap, heap_calls = _plan(snap, monkeypatch, heap_after=0, heap_pops=pops)
        assert by_heap == by_scan
        if scan_calls["wide"]:  # (not where a full cluster leaves every pod few candidates)
            assert heap_calls["heap"] > 0


def test_the_heap_pops_few_entries_on_a_large_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """With whole-point scores most nodes tie: the heap settles a pod in a few pops where the
    scan reads every candidate."""
    snap = random_snapshot(3, 300, 8, "H100-80GB", 600, "mig", 0.9, default_catalog())
    popped = {"pods": 0, "entries": 0}
    heappop = greedy_module.heappop

    def counted_pop(entries):  # type: ignore[no-untyped-def]
        popped["entries"] += 1
        return heappop(entries)

    heap = greedy_module.Greedy._best_single_heap

    def counted_heap(self, *args):  # type: ignore[no-untyped-def]
        popped["pods"] += 1
        return heap(self, *args)

    bucket = greedy_module.Greedy._best_single_bucket

    def counted_bucket(self, *args):  # type: ignore[no-untyped-def]
        popped["pods"] += 1
        return bucket(self, *args)

    monkeypatch.setattr(greedy_module, "heappop", counted_pop)
    monkeypatch.setattr(greedy_module.Greedy, "_best_single_heap", counted_heap)
    monkeypatch.setattr(greedy_module.Greedy, "_best_single_bucket", counted_bucket)
    plan(snap, default_catalog(), PlanOptions(time_limit_s=0))
    assert popped["pods"] > 400
    assert popped["entries"] / popped["pods"] < 30  # against 300 candidates each


def _packing_like(seed: int) -> tuple[list[Node], list[PendingPod], list[RequestShare]]:
    """MPS nodes of varied free CPU and memory, one-GPU pods of varied CPU and memory asking for
    shares, and their distribution as the workload: most pods move some nodes to other steps of
    the objective's CPU and memory tables; several pods of one kind and size in a row."""
    rng = random.Random(seed)
    nodes = [Node(name=f"n{i:03d}", mode="mps", gpu_model="H100-80GB",
                  cpu_milli_free=rng.choice([4000, 8000, 16000, 32000, 64000]),
                  memory_mib_free=rng.choice([16384, 65536, 262144]),
                  gpus=[Gpu(index=g) for g in range(rng.choice([1, 2, 4, 8]))])
             for i in range(rng.randint(20, 60))]
    pods = []
    for k in range(rng.randint(40, 160)):
        if pods and rng.random() < 0.3:  # the same request again (the backlog's case)
            pods.append(pods[-1].model_copy(update={"name": f"p{k}"}))
            continue
        size = rng.choice([10, 20, 40, 80])
        pods.append(PendingPod(name=f"p{k}", resource="nvidia.com/gpu" if size == 80 else f"nvidia.com/gpu-{size}gb",
                               count=rng.choice([1, 1, 1, 2]) if size == 80 else 1,
                               cpu_milli=rng.choice([1000, 2000, 4000, 6000, 12000]),
                               memory_mib=rng.choice([2048, 8192, 16384, 32768])))
    workload = [RequestShare(resource=p.resource, count=p.count, cpu_milli=p.cpu_milli, memory_mib=p.memory_mib)
                for p in pods]
    return nodes, pods, workload


def _weigh_every_moved_node(self, costs, ask, req, cand, low, top, moved_pos):  # type: ignore[no-untyped-def]
    tops, slots = self._weigh_moved(costs, ask, cand[moved_pos].tolist(), req.cpu, req.mem)
    top[moved_pos] = tops
    return dict(zip(moved_pos.tolist(), slots))


def _session_plans(seed: int, batch: int, monkeypatch: pytest.MonkeyPatch, shortcuts: bool) -> tuple[list[str], int]:
    nodes, pods, workload = _packing_like(seed)
    lazily = {"calls": 0}
    weigh = greedy_module.Greedy._weigh_moved_lazily

    def counted(self, *args):  # type: ignore[no-untyped-def]
        lazily["calls"] += 1
        return weigh(self, *args)

    with monkeypatch.context() as m:
        if shortcuts:
            m.setattr(greedy_module.Greedy, "_weigh_moved_lazily", counted)
        else:
            m.setattr(greedy_module.Greedy, "_weigh_moved_lazily", _weigh_every_moved_node)
            m.setattr(greedy_module.Greedy, "place", greedy_module.Greedy._place)
            m.setattr(greedy_module.Greedy, "fits_alone", greedy_module.Greedy._fits_alone)
        session = PlanningSession(nodes, default_catalog())
        opts = PlanOptions(time_limit_s=0)
        out = []
        for k in range(0, len(pods), batch):
            result = session.plan(pods[k: k + batch], workload, opts)
            dump = result.model_dump(mode="json")
            dump["stats"].pop("solve_s")
            out.append(str(dump))
            session.commit(result)
    return out, lazily["calls"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=10**9), batch=st.sampled_from([1, 1, 5, 40]))
def test_the_greedys_shortcuts_find_the_same_plans(seed: int, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weighing the nodes a pod moves to other steps only while they can win, skipping a request
    equal to one that found no option since the last commit, and `fits_alone` once per equal
    request: plan after plan on a session (its caches kept between plans), the same plans as
    weighing every node and every request."""
    plain, _ = _session_plans(seed, batch, monkeypatch, shortcuts=False)
    fast, lazily = _session_plans(seed, batch, monkeypatch, shortcuts=True)
    assert fast == plain
    assert lazily > 0


def test_a_request_left_out_is_weighed_again_after_a_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests that found no option are forgotten at each commit (a commit changes what the
    cluster offers): an 8-GPU pod fails on an 8-GPU node one of whose GPUs is in use, a 1-GPU
    pod is placed, and the next 8-GPU pod is weighed again; with no commit in between it is not."""
    nodes = [Node(name="a", mode="mps", gpu_model="H100-80GB",
                  gpus=[Gpu(index=0, whole_pod="running")] + [Gpu(index=g) for g in range(1, 8)])]
    pods = [PendingPod(name="big1", resource="nvidia.com/gpu", count=8),
            PendingPod(name="one", resource="nvidia.com/gpu", count=1),
            PendingPod(name="big2", resource="nvidia.com/gpu", count=8)]
    weighed: list[str] = []
    place = greedy_module.Greedy._place

    def counted(self, req):  # type: ignore[no-untyped-def]
        weighed.append(req.name)
        return place(self, req)

    monkeypatch.setattr(greedy_module.Greedy, "_place", counted)
    result = plan(Snapshot(nodes=nodes, pending=pods), default_catalog(), PlanOptions(time_limit_s=0))
    assert [p.pod for p in result.placements] == ["one"]
    # arrival order, then smallest first (the 8-GPU pods fitted alone: `fits_alone`)
    assert weighed == ["big1", "one", "big2", "one", "big1"]
    weighed.clear()
    plan(Snapshot(nodes=nodes, pending=[pods[0], pods[2]]), default_catalog(), PlanOptions(time_limit_s=0))
    assert weighed == ["big1", "big1"]


def test_a_slow_machine_gets_the_same_plan():
    """Same snapshot, same plan: the large-neighbourhood search is budgeted in CP-SAT's
    deterministic time, and the wall clock stops only a runaway. With a clock that runs 11 s per
    reading (a machine far slower than any the planner runs on), every window is still tried; the
    stop at 10 s of wall time it had before skipped them all (helper-105 saw it hit at 10.9 s on
    the shared machine)."""
    import dynpart.planner.dynpart_policy as policy

    cat = default_catalog()
    snap = random_snapshot(2, 3, 8, "H100-80GB", 40, "mig", 0.9, cat)
    opts = PlanOptions(exact_max_gpus=0)  # the windows, not the whole-cluster solve, on 3 nodes
    quick = plan(snap, cat, opts)
    assert "windows (1 improved)" in quick.stats.solver
    ticks = itertools.count()

    class SlowClock:
        @staticmethod
        def perf_counter() -> float:
            return 11.0 * next(ticks)

    real = policy.time
    policy.time = SlowClock  # type: ignore[assignment]
    try:
        slow = plan(snap, cat, opts)
    finally:
        policy.time = real
    assert next(ticks) > 2  # the policy read the clock
    assert slow.model_dump(exclude={"stats": {"solve_s"}}) == quick.model_dump(exclude={"stats": {"solve_s"}})


def test_windows_whose_solves_run_to_their_wall_clock_nets_are_all_tried():
    """The large-neighbourhood search's wall-clock stop is past the sum of its windows' solves' own
    nets: on a machine where the greedy takes 10 s and every solve runs to its wall-clock net
    (exact._solver), every window is still tried. The default budget tries 11 windows (the float
    residue of `budget -= per_window`); the stop at 110 s it had came after the 10th (10 + 10 x 10.5 s)."""
    import dynpart.planner.dynpart_policy as policy

    cat = default_catalog()
    snap = random_snapshot(0, 3, 8, "H100-80GB", 60, "mig", 0.9, cat)
    opts = PlanOptions(exact_max_gpus=0)
    real_solve, real_time = policy.solve_exact, policy.time
    calls: list[float] = []
    now = [0.0]

    def solve_on_a_slow_machine(*args, **kwargs):  # type: ignore[no-untyped-def]
        per_window = args[5]
        calls.append(per_window)
        now[0] += (10 * per_window * 0.6 + 5) + (10 * per_window * 0.4 + 5)  # both solves' nets
        return real_solve(*args, **kwargs)

    class SlowClock:
        readings = 0

        @classmethod
        def perf_counter(cls) -> float:
            cls.readings += 1
            if cls.readings == 1:
                return 0.0  # t0, before the greedy
            return 10.0 + now[0]  # the greedy took 10 s

    policy.solve_exact = solve_on_a_slow_machine  # type: ignore[assignment]
    try:
        quick = plan(snap, cat, opts)
        expected, calls[:], now[0] = len(calls), [], 0.0
        policy.time = SlowClock  # type: ignore[assignment]
        slow = plan(snap, cat, opts)
    finally:
        policy.solve_exact, policy.time = real_solve, real_time  # type: ignore[assignment]
    assert expected == 11 and len(calls) == expected
    assert slow.model_dump(exclude={"stats": {"solve_s"}}) == quick.model_dump(exclude={"stats": {"solve_s"}})


def _tops_as_pods_take_more(seed: int, mode: str) -> int:
    """Check that each node's top for the first requests' slice kinds, at the steps a pod's CPU
    and memory move it to, is the same in plain Python and with numpy and never falls as the
    pod takes more; return how many times it rose."""
    from dynpart.planner.objective import Objective, node_caps
    from dynpart.planner.problem import compile_problem

    snap = _snapshot(seed, mode)
    problem = compile_problem(snap, default_catalog())
    obj = Objective(problem.workload, problem.nodes, node_caps(problem.nodes, problem.gpus))
    assert obj.feeds  # the pods ask for CPU: the term is on
    greedy = greedy_module.Greedy(problem, objective=obj)
    rng = random.Random(seed)
    cpus = sorted(rng.sample(range(0, 64_001, 250), 6))
    rose = 0
    for req in problem.requests[:6]:
        costs = greedy.index.costs(req.slice_ref)
        nodes = [n for n in range(len(problem.nodes)) if greedy.cpu[n] >= cpus[-1] and greedy.mem[n] >= 4096]
        if not nodes:
            continue
        for mem in (0, 4096):
            tops = []
            for c in cpus:
                steps = [obj.step_one(n, int(greedy.cpu[n]) - c, int(greedy.mem[n]) - mem) for n in nodes]
                scalar = greedy._node_best_scalar(costs, nodes, steps)[0]
                vector = greedy._node_best(costs.arrays(), np.array(nodes), c, mem)[0].tolist()
                assert scalar == vector
                tops.append(scalar)
            for lower, higher in zip(tops, tops[1:]):
                assert all(a <= b for a, b in zip(lower, higher))
                rose += sum(a < b for a, b in zip(lower, higher))
    return rose


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), mode=st.sampled_from(["mig", "mps"]))
def test_a_pod_that_takes_more_cpu_never_gets_a_lower_top(seed: int, mode: str) -> None:
    """What the CPU buckets' heaps rely on (`Greedy._best_single_bucket`): a node's top for a pod
    of a slice kind, computed at the steps its CPU and memory move the node to (the stranding
    term and the kinds' tables), never falls as the pod takes more CPU or memory, on clusters
    where many nodes are short of CPU for their free GPUs."""
    _tops_as_pods_take_more(seed, mode)


def test_the_tops_do_rise_with_the_cpu_a_pod_takes() -> None:
    """(That the check above compares tops that move.)"""
    assert sum(_tops_as_pods_take_more(seed, mode) for seed in range(3) for mode in ("mig", "mps")) > 0


def _bucket_bounds(seed: int, mode: str) -> int:
    """Check each node's bound in each CPU bucket against its top there; return how many bounds
    are above the node's top at its own steps."""
    from dynpart.planner.objective import Objective, node_caps
    from dynpart.planner.problem import compile_problem

    problem = compile_problem(_snapshot(seed, mode), default_catalog())
    obj = Objective(problem.workload, problem.nodes, node_caps(problem.nodes, problem.gpus))
    greedy = greedy_module.Greedy(problem, objective=obj)
    raised = 0
    for req in problem.requests[:8]:
        costs = greedy.index.costs(req.slice_ref)
        for bucket in greedy._buckets:
            nodes = [n for n in range(len(problem.nodes)) if greedy.cpu[n] >= bucket]
            if not nodes:
                continue
            own = greedy._own_tops(costs, req.slice_ref, nodes)
            tops = greedy._weigh_bucket(costs, req.slice_ref, nodes, bucket)[0]
            for n, t0, top in zip(nodes, own, tops):
                bound = greedy._bucket_bound(req.slice_ref, n, bucket, t0)
                assert t0 <= bound <= top
                raised += bound > t0
    return raised


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), mode=st.sampled_from(["mig", "mps"]))
def test_a_bucket_heaps_bounds_never_pass_the_tops(seed: int, mode: str) -> None:
    """The bound a CPU bucket's heap gives a node that changed (`Greedy._bucket_bound`: its top at
    its own steps, raised by the least the stranding term rises) is never above its top for a
    pod taking the bucket's CPU (`_weigh_bucket`): else the heap would pass over the best node."""
    _bucket_bounds(seed, mode)


def test_a_bucket_heaps_bounds_are_above_the_tops_at_the_own_steps() -> None:
    """(That the bounds checked above are not merely the tops at the nodes' own steps.)"""
    assert sum(_bucket_bounds(seed, mode) for seed in range(3) for mode in ("mig", "mps")) > 0
