"""The MPS server serves at most `mps_max_clients` clients per GPU (48 from Volta on): no plan
puts more MPS slices than that on one GPU, and room by count is made like room by memory, from
free slices only."""

from __future__ import annotations

import pytest

from dynpart.catalog import default_catalog
from dynpart.planner.core import PlanOptions, plan
from dynpart.snapshot import Gpu, MpsSlice, Node, PendingPod, Snapshot

CAT = default_catalog()


def node(slices: list[MpsSlice]) -> Node:
    return Node(name="n", mode="mps", gpu_model="H100-80GB",
                gpus=[Gpu(index=0, mps=slices)])


def pods(n: int, resource: str) -> list[PendingPod]:
    return [PendingPod(name=f"ml/p{i:03}", resource=resource, count=1, cpu_milli=10, memory_mib=10) for i in range(n)]


@pytest.mark.parametrize("time_limit", [0.0, 0.5])  # the greedy alone, and with the exact search
def test_no_gpu_gets_more_slices_than_its_mps_server_serves(time_limit):
    assert CAT.resolve("H100-80GB").mps_max_clients == 48
    result = plan(Snapshot(nodes=[node([])], pending=pods(50, "nvidia.com/gpu-1gb")), CAT,
                  PlanOptions(time_limit_s=time_limit))
    assert len(result.placements) == 48 and len(result.unplaced) == 2  # 79 GiB would hold 79
    (layout,) = result.layouts
    assert len(layout.gpus[0].mps) == 48


def test_room_by_count_is_made_from_free_slices():
    """47 slices in use and one free 1gb slice: a 2gb pod fits by memory (31 GiB left) but not by
    count, so the free slice goes; with 48 in use, nothing can be made."""
    used = [MpsSlice(size=1, used=True) for _ in range(47)]
    result = plan(Snapshot(nodes=[node(used + [MpsSlice(size=1)])], pending=pods(1, "nvidia.com/gpu-2gb")), CAT,
                  PlanOptions(time_limit_s=0))
    assert len(result.placements) == 1
    sizes = sorted(s.size for s in result.layouts[0].gpus[0].mps)
    assert sizes == [1] * 47 + [2] and result.layouts[0].gpus[0].destroyed == 1
    full = used + [MpsSlice(size=1, used=True)]
    result = plan(Snapshot(nodes=[node(full)], pending=pods(1, "nvidia.com/gpu-2gb")), CAT, PlanOptions(time_limit_s=0))
    assert result.placements == [] and len(result.unplaced) == 1


def test_nos_too_puts_no_more_slices_on_a_gpu_than_its_server_serves():
    result = plan(Snapshot(nodes=[node([])], pending=pods(50, "nvidia.com/gpu-1gb")), CAT, PlanOptions(policy="nos"))
    assert len(result.placements) == 48 and len(result.layouts[0].gpus[0].mps) == 48


@pytest.mark.parametrize("options", [PlanOptions(time_limit_s=0), PlanOptions(time_limit_s=0.5), PlanOptions(policy="nos")])
def test_a_gpu_laid_out_past_the_bound_gets_pods_up_to_it_only(options):
    """A GPU already holding 60 free 1gb slices (laid out before the bound, or by hand): pods go
    on 48 of them at most."""
    result = plan(Snapshot(nodes=[node([MpsSlice(size=1) for _ in range(60)])], pending=pods(60, "nvidia.com/gpu-1gb")),
                  CAT, options)
    assert len(result.placements) == 48 and len(result.unplaced) == 12


def test_the_static_layouts_hold_no_more_slices_than_the_server_serves():
    result = plan(Snapshot(nodes=[node([])], pending=pods(60, "nvidia.com/gpu-1gb")), CAT,
                  PlanOptions(policy="static", static_layout={"mps_size": "1"}))
    assert len(result.layouts[0].gpus[0].mps) == 48 and len(result.placements) == 48


def test_a_gpu_past_the_bound_does_not_make_the_exact_search_infeasible():
    """49 slices in use on one GPU (past the bound): the exact search still solves the rest of the
    cluster (its count constraint for that GPU is what it holds), and places nothing more there."""
    from dynpart.planner.exact import solve_exact
    from dynpart.planner.problem import compile_problem
    from dynpart.planner.state import new_state

    full = Node(name="a", mode="mps", gpu_model="H100-80GB", gpus=[Gpu(index=0, mps=[MpsSlice(size=1, used=True)] * 49)])
    empty = Node(name="b", mode="mps", gpu_model="H100-80GB", gpus=[Gpu(index=0)])
    problem = compile_problem(Snapshot(nodes=[full, empty], pending=pods(5, "nvidia.com/gpu-10gb")), CAT)
    res = solve_exact(problem, [new_state(g) for g in problem.gpus], [0, 1], problem.requests, None, 0.5,
                      [n.cpu_free for n in problem.nodes], [n.mem_free for n in problem.nodes])
    assert res is not None and len(res.placed) == 5 and {a.node for a in res.placed.values()} == {1}
