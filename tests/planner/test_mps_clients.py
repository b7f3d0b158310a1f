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
