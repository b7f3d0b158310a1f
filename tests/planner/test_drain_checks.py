"""Checks of where a drain goes (`planner/drain.py`) that mutation testing found unasserted: MPS
nodes and the GPUs' own capacity, pods asking for several GPUs, the node chosen among several,
and the nodes a pod's selectors keep it off."""

from __future__ import annotations

from dynpart.planner.drain import drain_target
from dynpart.scheduling import NodeSelectorRequirement, NodeSelectorTerm
from dynpart.snapshot import Gpu, MpsSlice, Node, PendingPod, Snapshot
from tests.planner.test_drain import CAT, WHOLE, gpu

WHOLE_GPU = PendingPod(name="ml/whole", resource="nvidia.com/gpu")


def mps_node(name: str, *gpus: Gpu, **extra) -> Node:
    return Node(name=name, mode="mps", gpu_model="H100-80GB", gpus=list(gpus), **extra)


def mig_node(name: str, *gpus: Gpu, **extra) -> Node:
    return Node(name=name, mode="mig", gpu_model="H100-80GB", gpus=list(gpus), **extra)


def mps_gpu(index: int, *slices: tuple[int, bool], capacity: int | None = None, whole_pod: str | None = None) -> Gpu:
    return Gpu(index=index, mps=[MpsSlice(size=s, used=u, pod="ml/x" if u else None) for s, u in slices],
               capacity=capacity, whole_pod=whole_pod)


def target(nodes: list[Node], pod: PendingPod = WHOLE, taken=()) -> tuple[str, tuple[int, ...]] | None:
    t = drain_target(Snapshot(nodes=nodes, pending=[pod]), pod, CAT, taken)
    return None if t is None else (t.node, t.gpus)


def test_on_mps_nodes_the_share_in_use_is_of_each_gpus_own_capacity_and_a_whole_pod_fills_it():
    """g0: a whole-GPU pod (all in use); g1: 30 of the model's 79 GiB used (free slices aside);
    g2: 20 of its own 40 GiB: g1 is the emptiest."""
    n = mps_node("n0", mps_gpu(0, whole_pod="ml/w"), mps_gpu(1, (30, True), (40, False)),
                 mps_gpu(2, (20, True), capacity=40))
    assert target([n], WHOLE_GPU) == ("n0", (1,))


def test_an_mps_slice_as_big_as_the_gpu_is_a_whole_gpu_and_a_smaller_one_is_not():
    n = mps_node("n0", mps_gpu(0, (10, True)))
    capacity = CAT.resolve("H100-80GB").mps_capacity_gb
    for size, drains in [(capacity, True), (capacity - 1, False)]:
        pod = PendingPod(name="ml/p", resource=f"nvidia.com/gpu-{size}gb")
        assert (target([n], pod) is not None) == drains, size
    assert target([mig_node("m0", gpu(0))], WHOLE_GPU) is None, "a whole GPU is modelled on MPS nodes only"
    assert target([n], WHOLE) is None, "a MIG profile: never on an MPS node"


def test_a_pod_asking_for_several_gpus_drains_its_count_of_the_emptiest_on_one_node():
    busy = [gpu(0, ("4g.40gb", 0, True)), gpu(1, ("1g.10gb", 0, True)), gpu(2), gpu(3, ("7g.80gb", 0, True))]
    two = WHOLE.model_copy(update={"count": 2})
    assert target([mig_node("n0", *busy)], two) == ("n0", (1, 2))
    assert target([mig_node("n0", *busy[:1]), mig_node("n1", *busy)], two) == ("n1", (1, 2)), \
        "n0 has one GPU: never enough"
    assert target([mig_node("n0", *busy)], two, taken={("n0", 1), ("n0", 2), ("n0", 3)}) is None, \
        "one GPU left that no other drain holds"
    assert target([mig_node("n0", *busy[:2])], two) == ("n0", (0, 1)), "as many GPUs as it asks: all of them"


def test_the_node_with_the_least_in_use_wins_and_a_tie_goes_to_the_first():
    half = mig_node("a", gpu(0, ("4g.40gb", 0, True)))
    little = mig_node("b", gpu(0, ("1g.10gb", 0, True)))
    assert target([half, little]) == ("b", (0,)) and target([little, half]) == ("b", (0,))
    same = mig_node("c", gpu(0, ("1g.10gb", 0, True)))
    assert target([little, same]) == ("b", (0,)) and target([same, little]) == ("c", (0,))


def test_a_drain_goes_only_where_the_pods_selectors_admit_it():
    plain = mig_node("n0", gpu(0), labels={"pool": "a"})
    assert target([plain], WHOLE.model_copy(update={"node_selector": {"pool": "b"}})) is None
    assert target([plain], WHOLE.model_copy(update={"node_selector": {"pool": "a"}})) == ("n0", (0,))
    zone = NodeSelectorTerm(match_expressions=(NodeSelectorRequirement(key="zone", operator="In", values=("z9",)),))
    assert target([plain], WHOLE.model_copy(update={"node_affinity": [zone]})) is None
    assert target([plain], WHOLE.model_copy(update={"gpu_models": ["A100-80GB"]})) is None
    assert target([plain], WHOLE.model_copy(update={"gpu_models": ["no-such-gpu", "H100-80GB"]})) == ("n0", (0,)), \
        "a model the catalog lacks is no node's: the others still count"


def test_a_drained_gpu_is_empty_only_with_no_slice_and_no_whole_pod_on_it():
    """The loop gives a drained GPU back to the plans once empty: a slice left on it, used or
    free (the agent destroys the free ones), or a pod holding it whole, keeps it out."""
    from dynpart.planner.drain import is_empty

    assert is_empty(Gpu(index=0))
    assert not is_empty(gpu(0, ("1g.10gb", 0, False)))
    assert not is_empty(mps_gpu(0, (10, False)))
    assert not is_empty(mps_gpu(0, whole_pod="ml/w"))


def test_free_slices_do_not_count_as_in_use_and_a_profile_the_model_lacks_drains_nothing():
    """The agent destroys a drained GPU's free slices at once: only the used ones keep it busy.
    A MIG profile the node's model does not offer is no whole GPU of it."""
    n = mig_node("n0", gpu(0, ("1g.10gb", 0, True)), gpu(1, ("7g.80gb", 0, False)))
    assert target([n]) == ("n0", (1,))
    assert target([n], PendingPod(name="ml/p", resource="nvidia.com/mig-7g.79gb")) is None


def test_draining_touches_only_the_named_node_and_destroys_only_its_free_slices():
    """The GPUs of the drain's node leave the plans (the other nodes keep theirs), and its spec
    keeps the used slices, flags the GPU and destroys the free ones; a node gone changes nothing."""
    from dynpart.planner.core import plan
    from dynpart.planner.drain import with_drain_flags, without_gpus

    def busy(name: str) -> Node:
        return mig_node(name, gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False)), gpu(1))

    snap = Snapshot(nodes=[busy("a"), busy("b")], pending=[])
    assert [[g.index for g in n.gpus] for n in without_gpus(snap, "b", (0,)).nodes] == [[0, 1], [1]]
    empty = plan(snap, CAT)
    [lay] = with_drain_flags(empty, snap, "b", {0}, set()).layouts
    [g] = lay.gpus
    assert (lay.node, g.index, g.drain, g.changed, g.destroyed) == ("b", 0, True, True, 1)
    assert [(m.start, m.used) for m in g.mig] == [(0, True)]
    assert with_drain_flags(empty, snap, "gone", {0}, set()) == empty
