"""Pods asking for several slices of one kind (`count` > 1) on nodes with fewer GPUs than
`count` (helper-142). A GPU may host several of them (a MIG GPU two 3g.40gb, an MPS GPU several
slices), and the planner places them so: the objective counts room for such a kind where the
node's GPUs can take `count` slices in all (`Objective.slot_table`), not only where `count` GPUs
can each take one (on 1-GPU nodes it kept no room for them: the greedy alone filled the empty GPU
the pair needed). And the exact search's windows hold as many GPUs on 1-GPU nodes as on 8-GPU
ones (`PlanOptions.window_gpus`; three 1-GPU nodes improved nothing: `dynpart bench planner --gpu
A100-80GB --gpus-per-node 1 --nodes 400 --mode mig --seed 7` placed 191 pods against nos's 195,
the upper bound)."""

from __future__ import annotations

from dynpart.catalog import load_catalog
from dynpart.planner import PlanOptions, plan
from dynpart.planner.workload import random_snapshot
from dynpart.snapshot import Gpu, MigInstance, Node, PendingPod, RequestShare, Snapshot


def test_room_for_two_slices_on_one_gpu_is_kept():
    # a: an empty A100-80GB; b: one whose slots 4-7 hold a used 3g.40gb. The older pod asks one
    # 3g.40gb, the younger two. The greedy alone (no exact search) must leave a empty for the pair:
    # both fit (p1 on b, p2 on a), and the workload asks for the pair
    nodes = [Node(name="a", mode="mig", gpu_model="A100-80GB", gpus=[Gpu(index=0)]),
             Node(name="b", mode="mig", gpu_model="A100-80GB",
                  gpus=[Gpu(index=0, mig=[MigInstance(profile="3g.40gb", start=4, used=True, pod="x")])])]
    pending = [PendingPod(name="p1", resource="nvidia.com/mig-3g.40gb"),
               PendingPod(name="p2", resource="nvidia.com/mig-3g.40gb", count=2)]
    workload = [RequestShare(resource="nvidia.com/mig-3g.40gb"), RequestShare(resource="nvidia.com/mig-3g.40gb", count=2)]
    result = plan(Snapshot(nodes=nodes, pending=pending, workload=workload), options=PlanOptions(time_limit_s=0.0))
    assert {p.pod: p.node for p in result.placements} == {"p1": "b", "p2": "a"}


def test_dynpart_places_as_many_pods_as_nos_on_one_gpu_nodes():
    catalog = load_catalog()
    snap = random_snapshot(7, 400, 1, "A100-80GB", 200, "mig", 0.9, catalog)
    ours = plan(snap, catalog, PlanOptions())
    nos = plan(snap, catalog, PlanOptions(policy="nos"))
    assert ours.stats.placed >= nos.stats.placed  # 191 against 195 (upper bound 195) before
