"""The greedy's two ways of finding a one-slice pod's best node (planner/greedy.py): the heap per
slice kind and the numpy scan over every candidate find the same option, so plans do not depend
on which one ran, on mixed clusters with node selectors, nodes short of CPU and (`models`) two
GPU models that some pods name (the objective's access groups)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.planner import greedy as greedy_module
from dynpart.planner.workload import random_snapshot
from dynpart.snapshot import Snapshot


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
    calls = {"heap": 0, "scan": 0}
    heap, scan = greedy_module.Greedy._best_single_heap, greedy_module.Greedy._best_single_scan

    def counted_heap(self, *args):  # type: ignore[no-untyped-def]
        calls["heap"] += 1
        return heap(self, *args)

    def counted_scan(self, *args):  # type: ignore[no-untyped-def]
        calls["scan"] += 1
        return scan(self, *args)

    with monkeypatch.context() as m:
        m.setattr(greedy_module, "_HEAP_AFTER", heap_after)
        m.setattr(greedy_module, "_HEAP_POPS", heap_pops)
        m.setattr(greedy_module.Greedy, "_best_single_heap", counted_heap)
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
        if any(p.count == 1 for p in snap.pending):
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

    monkeypatch.setattr(greedy_module, "heappop", counted_pop)
    monkeypatch.setattr(greedy_module.Greedy, "_best_single_heap", counted_heap)
    plan(snap, default_catalog(), PlanOptions(time_limit_s=0))
    assert popped["pods"] > 400
    assert popped["entries"] / popped["pods"] < 30  # against 300 candidates each
