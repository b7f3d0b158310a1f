"""A `PlanningSession` kept between plans gives the plans `plan()` gives on the same snapshot:
what it caches (bucket costs, capacity classes, each node's best GPU per slice kind, the
objective's node terms) is invalidated exactly where the cluster changed."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.planner.session import PlanningSession
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, Plan, Snapshot, full_layout
from tests.planner.instances import small_instance


def _applied(snap: Snapshot, result: Plan, pods: list[PendingPod]) -> Snapshot:
    """The snapshot once the plan is carried out: planned slices used, CPU/memory taken."""
    by_pod = {p.name: p for p in pods}
    taken: dict[str, tuple[int, int]] = {}
    for pl in result.placements:
        c, m = taken.get(pl.node, (0, 0))
        taken[pl.node] = (c + by_pod[pl.pod].cpu_milli, m + by_pod[pl.pod].memory_mib)
    nodes = []
    for node in snap.nodes:
        lay = full_layout(node, result.layout_of(node.name))
        gpus = [Gpu(index=g.index, capacity=next(x.capacity for x in node.gpus if x.index == g.index),
                    whole_pod=g.whole_pod,
                    mig=[MigInstance(profile=i.profile, start=i.start, used=i.used or i.pod is not None, pod=i.pod)
                         for i in g.mig],
                    mps=[MpsSlice(size=s.size, used=s.used or s.pod is not None, pod=s.pod) for s in g.mps])
                for g in lay.gpus]
        c, m = taken.get(node.name, (0, 0))
        nodes.append(node.model_copy(update={"gpus": gpus, "cpu_milli_free": node.cpu_milli_free - c,
                                             "memory_mib_free": node.memory_mib_free - m}))
    return Snapshot(nodes=nodes, workload=snap.workload)


def _same(a: Plan, b: Plan) -> None:
    assert a.model_dump(exclude={"stats": {"solve_s"}}) == b.model_dump(exclude={"stats": {"solve_s"}})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9), mps_share=st.sampled_from([0.0, 0.5, 1.0]),
       fixed_workload=st.booleans())
def test_a_session_plans_as_plan_does_round_after_round(seed, mps_share, fixed_workload):
    rng = random.Random(seed)
    snap = small_instance(seed, max_nodes=4, max_gpus=4, max_pods=30, mps_share=mps_share)
    pods = list(snap.pending)
    if fixed_workload:
        from dynpart.snapshot import RequestShare
        snap = snap.model_copy(update={"workload": [
            RequestShare(resource=p.resource, count=p.count, cpu_milli=p.cpu_milli, memory_mib=p.memory_mib)
            for p in pods]})
    cluster = Snapshot(nodes=snap.nodes, workload=snap.workload)
    session = PlanningSession(cluster.nodes, default_catalog())
    opts = PlanOptions(time_limit_s=0.05)
    k = 0
    while k < len(pods):
        batch = pods[k: k + rng.choice([1, 1, 3])]
        k += len(batch)
        fresh = plan(cluster.model_copy(update={"pending": batch}), options=opts)
        kept = session.plan(batch, cluster.workload, opts)
        _same(fresh, kept)
        session.commit(kept)
        cluster = _applied(cluster, kept, batch)


def test_cpu_only_pods_go_to_nodes_without_gpus_first_then_where_they_strand_least():
    catalog = default_catalog()
    nodes = [Node(name="gpu-a", mode="mps", gpu_model="H100-80GB", cpu_milli_free=16_000,
                  gpus=[Gpu(index=0)]),
             Node(name="gpu-b", mode="mps", gpu_model="H100-80GB", cpu_milli_free=64_000,
                  gpus=[Gpu(index=0)]),
             Node(name="cpu", mode="mps", gpu_model="H100-80GB", cpu_milli_free=8_000)]
    from dynpart.snapshot import RequestShare
    workload = [RequestShare(resource="nvidia.com/gpu", cpu_milli=12_000)]
    session = PlanningSession(nodes, catalog)
    assert session.place_cpu_pod(4000, 0, workload) == "cpu"
    assert session.place_cpu_pod(4000, 0, workload) == "cpu"
    # the node without GPUs is full: gpu-a would keep 8 cores, too few for the whole-GPU kind
    # (12 cores) that gpu-b can still serve after it
    assert session.place_cpu_pod(8000, 0, workload) == "gpu-b"
    assert session.place_cpu_pod(10**9, 0, workload) is None


def test_cpu_only_pods_leave_the_cpu_that_gpus_will_need():
    """The stranding term: a 32-core pod fits both empty nodes and leaves every kind fitting on
    each (FGD's usable capacity moves on neither), but on the 8-GPU, 96-core node it takes CPU
    its GPUs will need at 11 cores per GPU; the 2-GPU, 104-core node has CPU to spare."""
    from dynpart.snapshot import RequestShare
    nodes = [Node(name="g2", mode="mps", gpu_model="H100-80GB", cpu_milli_free=96_000,
                  gpus=[Gpu(index=g) for g in range(8)]),
             Node(name="t4", mode="mps", gpu_model="H100-80GB", cpu_milli_free=104_000,
                  gpus=[Gpu(index=g) for g in range(2)])]
    workload = [RequestShare(resource="nvidia.com/gpu", cpu_milli=11_000)]
    session = PlanningSession(nodes, default_catalog())
    assert session.place_cpu_pod(32_000, 0, workload) == "t4"


def test_a_session_refuses_bad_pods_like_plan():
    import pytest

    from dynpart.errors import SnapshotError
    session = PlanningSession([Node(name="n", mode="mig", gpu_model="H100-80GB", gpus=[Gpu(index=0)])])
    with pytest.raises(SnapshotError, match=r"pending\[0\] \(a\)\.resource"):
        session.plan([PendingPod(name="a", resource="nvidia.com/mig-5g.20gb")])


def test_a_sessions_rooms_follow_the_nodes_cpu_and_memory():
    """The rooms of each node's CPU and memory in the objective's kinds' steps, which a session keeps
    and updates where a plan or a CPU-only pod takes CPU and memory, are those computed afresh."""
    import numpy as np

    from dynpart.planner.objective import rooms
    from dynpart.snapshot import RequestShare
    rng = random.Random(7)
    nodes = [Node(name=f"n{i}", mode="mps", gpu_model="H100-80GB", cpu_milli_free=rng.choice([6000, 16000, 64000]),
                  memory_mib_free=rng.choice([32768, 262144]), gpus=[Gpu(index=g) for g in range(rng.choice([0, 2, 4]))])
             for i in range(12)]
    pods = [PendingPod(name=f"p{k}", resource=rng.choice(["nvidia.com/gpu-10gb", "nvidia.com/gpu-40gb", "nvidia.com/gpu"]),
                       cpu_milli=rng.choice([1000, 3000, 5000]), memory_mib=rng.choice([4096, 16384]))
            for k in range(40)]
    workload = [RequestShare(resource=p.resource, cpu_milli=p.cpu_milli, memory_mib=p.memory_mib) for p in pods]
    session = PlanningSession(nodes, default_catalog())
    placed = 0
    for k, pod in enumerate(pods):
        result = session.plan([pod], workload, PlanOptions(time_limit_s=0))
        session.commit(result)
        placed += len(result.placements)
        if k % 3 == 0:
            session.place_cpu_pod(2000, 8192, workload)
        assert session._objective is not None
        obj, kept = session._objective[1], session._objective[4]
        assert kept is not None
        assert np.array_equal(kept.cpu, rooms(session.cpu, obj.kind_cpu_steps))
        assert np.array_equal(kept.mem, rooms(session.mem, obj.kind_mem_steps))
        assert np.array_equal(kept.grid, rooms(session.cpu, obj.cpu_steps))
    assert placed > 10
