"""An upper bound on how many pending pods any plan can place (a counting bound).

Per mode, the pods that have a candidate node are sorted smallest first and counted while
their total size fits in the capacity not held by used slices (memory slices and, separately,
compute slices for MIG; capacity units for MPS; whole idle GPUs for `nvidia.com/gpu`). Every
plan places at most that many, because the k smallest pods are the cheapest k to place.
"""

from __future__ import annotations

from dynpart.planner.problem import GpuInfo, Problem
from dynpart.planner.types import MigSliceRef, MpsSliceRef


def _count_fitting(sizes: list[int], capacity: int) -> int:
    n = total = 0
    for s in sorted(sizes):
        if total + s > capacity:
            break
        total += s
        n += 1
    return n


Capacity = tuple[int, int, int, int]  # MIG memory slices, MIG compute slices, MPS capacity, idle MPS GPUs


def capacity_left(g: GpuInfo) -> Capacity:
    """What one GPU has that used slices do not hold."""
    if g.rules is not None:
        memory, compute = g.rules.memory, g.rules.compute
        used_mem = used_compute = 0
        for p, _, _ in g.used_mig:  # one pass (every GPU of the cluster, every session)
            used_mem += memory[p]
            used_compute += compute[p]
        return (g.model.memory_slices - used_mem, g.model.compute_slices - used_compute, 0, 0)
    mps = g.capacity - sum(s for s, _ in g.used_mps) if not g.whole_pod else 0
    return (0, 0, mps, 0 if (g.used_mps or g.whole_pod) else 1)


def placed_upper_bound(problem: Problem, totals: Capacity | None = None) -> int:
    """`totals`: the sum of `capacity_left` over the GPUs, when the caller keeps it."""
    if totals is None:
        caps = [capacity_left(g) for g in problem.gpus]
        totals = (sum(c[0] for c in caps), sum(c[1] for c in caps), sum(c[2] for c in caps), sum(c[3] for c in caps))
    mig_mem, mig_compute, mps_cap, idle_gpus = totals
    mem_sizes, compute_sizes, mps_sizes, gpu_sizes = [], [], [], []
    for r in problem.requests:
        if not r.candidates:
            continue
        ref = r.slice_ref
        if isinstance(ref, MigSliceRef):
            mem_sizes.append(r.count * r.min_memory)
            compute_sizes.append(r.count * r.min_compute)
        elif isinstance(ref, MpsSliceRef):
            mps_sizes.append(r.count * ref.size)
        else:
            gpu_sizes.append(r.count)
    mig = min(_count_fitting(mem_sizes, mig_mem), _count_fitting(compute_sizes, mig_compute))
    mps = _count_fitting(mps_sizes, mps_cap)
    whole = _count_fitting(gpu_sizes, idle_gpus)
    # MPS slices and whole GPUs compete for the same GPUs; bound each separately, then the pair
    return mig + min(len(mps_sizes) + len(gpu_sizes), mps + whole)

