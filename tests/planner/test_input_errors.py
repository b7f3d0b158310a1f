"""Bad input gets a clear error naming the field and the value."""

import pytest

from dynpart.errors import SnapshotError
from dynpart.planner import plan
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Node, PendingPod, Snapshot, parse_snapshot


def _node(**kw):
    base = dict(name="n1", mode="mig", gpu_model="H100-80GB", gpus=[Gpu(index=0)])
    base.update(kw)
    return Node(**base)


def test_unknown_gpu_model():
    snap = Snapshot(nodes=[_node(gpu_model="NVIDIA-Quantum-9000")])
    with pytest.raises(SnapshotError, match=r"nodes\[0\] \(n1\)\.gpu_model: unknown GPU model 'NVIDIA-Quantum-9000'"):
        plan(snap)


def test_unknown_profile():
    snap = Snapshot(nodes=[_node()], pending=[PendingPod(name="ns/a", resource="nvidia.com/mig-5g.20gb")])
    with pytest.raises(SnapshotError, match=r"pending\[0\] \(ns/a\)\.resource = 'nvidia.com/mig-5g.20gb'.*5g.20gb"):
        plan(snap)


def test_resource_that_is_not_a_slice():
    snap = Snapshot(nodes=[_node()], pending=[PendingPod(name="ns/a", resource="nvidia.com/mig-huge")])
    with pytest.raises(SnapshotError, match=r"pending\[0\] \(ns/a\)\.resource.*'nvidia.com/mig-huge'"):
        plan(snap)


def test_slice_bigger_than_the_gpu():
    snap = Snapshot(nodes=[_node(mode="mps", gpus=[Gpu(index=0, mps=[MpsSlice(size=100, used=True)])])])
    with pytest.raises(SnapshotError, match=r"gpus\[0\]\.mps\[0\]\.size = 100: slice bigger than the GPU \(capacity 79\)"):
        plan(snap)


def test_slices_adding_up_past_capacity():
    snap = Snapshot(nodes=[_node(mode="mps", gpus=[Gpu(index=0, mps=[MpsSlice(size=50), MpsSlice(size=40)])])])
    with pytest.raises(SnapshotError, match="add up to 90, more than the GPU's capacity 79"):
        plan(snap)


def test_pod_asking_for_more_than_any_gpu_is_unplaced_with_a_reason_not_an_error():
    snap = Snapshot(nodes=[_node(mode="mps")], pending=[PendingPod(name="ns/a", resource="nvidia.com/gpu-200gb")])
    p = plan(snap)
    assert p.unplaced[0].reason == "a 200 GB slice is bigger than every MPS GPU (largest 79 GB)"


@pytest.mark.parametrize("field,value,message", [
    ("count", -1, r"pending\[0\]\.count = -1: Input should be greater than or equal to 1"),
    ("cpu_milli", -5, r"pending\[0\]\.cpu_milli = -5"),
    ("memory_mib", -1, r"pending\[0\]\.memory_mib = -1"),
])
def test_negative_counts(field, value, message):
    data = {"nodes": [], "pending": [{"name": "ns/a", "resource": "nvidia.com/gpu", field: value}]}
    with pytest.raises(SnapshotError, match=message):
        parse_snapshot(data)


def test_negative_node_capacity_and_gpu_index():
    with pytest.raises(SnapshotError, match=r"nodes\[0\]\.gpus\[0\]\.index = -1"):
        parse_snapshot({"nodes": [{"name": "n", "mode": "mig", "gpu_model": "H100-80GB", "gpus": [{"index": -1}]}]})
    with pytest.raises(SnapshotError, match=r"nodes\[0\]\.cpu_milli_free = -1"):
        parse_snapshot({"nodes": [{"name": "n", "mode": "mig", "gpu_model": "H100-80GB", "cpu_milli_free": -1}]})


def test_invalid_existing_geometry():
    snap = Snapshot(nodes=[_node(gpus=[Gpu(index=0, mig=[MigInstance(profile="4g.40gb", start=0),
                                                          MigInstance(profile="2g.20gb", start=2, used=True)])])])
    with pytest.raises(SnapshotError, match=r"gpus\[0\]\.mig: 2g.20gb@2 overlaps"):
        plan(snap)


def test_unknown_mode_and_extra_fields():
    with pytest.raises(SnapshotError, match=r"nodes\[0\]\.mode = 'timeslice'"):
        parse_snapshot({"nodes": [{"name": "n", "mode": "timeslice", "gpu_model": "H100-80GB"}]})
    with pytest.raises(SnapshotError, match=r"pending\[0\]\.replicas"):
        parse_snapshot({"pending": [{"name": "a", "resource": "nvidia.com/gpu", "replicas": 2}]})
    # a missing field is named without the object around it shown as its value (review 172)
    with pytest.raises(SnapshotError) as e:
        parse_snapshot({"pending": [{"resource": "nvidia.com/gpu-10gb"}]})
    assert e.value.problems == ["pending[0].name: Field required"]


def test_every_problem_is_listed():
    snap = Snapshot(nodes=[_node(gpu_model="X1"), _node(name="n2", gpu_model="X2")])
    with pytest.raises(SnapshotError) as e:
        plan(snap)
    assert len(e.value.problems) == 2


def test_priority_weights_are_strict_and_bounded():
    from dynpart.planner.problem import priority_weights
    w = priority_weights([0, 0, 5, 9])
    assert w[5] > 2 * w[0] and w[9] > w[5] + 2 * w[0]
    many = priority_weights(list(range(30)) * 2000)  # 30 levels of 2,000 pods: strict weights would overflow
    assert all(v < 2**62 // 60_000 for v in many.values())
    assert [many[i] for i in range(30)] == sorted(many.values())


@pytest.mark.parametrize("gpu", [
    Gpu(index=0, mig=[MigInstance(profile="1g.10gb", start=0, pod="ns/a")]),
    Gpu(index=0, whole_pod="ns/a"),
], ids=["mig", "whole"])
def test_a_pending_pod_a_node_says_holds_a_slice_is_refused(gpu):
    """It was planned a second slice beside the one it held (helper-152): a pod on a slice is not
    pending. The planning session checks it too."""
    from dynpart.catalog import default_catalog
    from dynpart.planner.session import PlanningSession

    node = _node(gpus=[gpu]) if gpu.mig else _node(mode="mps", gpus=[gpu])
    pending = [PendingPod(name="ns/a", resource="nvidia.com/mig-1g.10gb" if gpu.mig else "nvidia.com/gpu")]
    message = r"pending\[0\] \(ns/a\)\.name = 'ns/a': already holds a slice \(node n1 GPU 0\); a pod on a slice is not"
    with pytest.raises(SnapshotError, match=message):
        plan(Snapshot(nodes=[node], pending=pending))
    with pytest.raises(SnapshotError, match=message):
        PlanningSession([node], default_catalog()).plan(pending)
