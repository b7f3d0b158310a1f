"""The MPS pass with the agent's own device plugin (unserved: no kubelet, PodResources "holds"
what it advertises): slices advertised as the spec says, used slices kept, a GPU held whole or in
MIG mode not shared, an empty spec gives every GPU back whole. (MPS slices are always served by the
agent's own plugin: the nebuly-fork ConfigMap path is gone, docs/agent.md "MPS".)"""

from __future__ import annotations

from dynpart.annotations import SPEC_MODE, SPEC_PLAN, decode_status

from .conftest import CATALOG, H100, ROUND_80GIB, Rig, make_rig, mps_spec


def mps_rig(count: int = 2, **kw) -> Rig:
    return make_rig(H100, count, mig_enabled=False, **{**ROUND_80GIB, **kw}).with_plugins()


def advertised(rig: Rig) -> dict[str, list[str]]:
    assert rig.plugins is not None
    return {r: sorted(d.id for d in ds) for r, ds in rig.plugins.advertised().items() if ds}


async def test_slices_are_advertised_and_the_node_label_is_left_alone():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [10, 10, 20], 1: [40, 40]}, plan="m1"))
    report = await rig.agent().reconcile_once()
    assert report.plan_id == "m1" and report.errors == []
    assert advertised(rig) == {"nvidia.com/gpu-10gb": ["GPU-fake-0000::1", "GPU-fake-0000::2"],
                               "nvidia.com/gpu-20gb": ["GPU-fake-0000::0"],
                               "nvidia.com/gpu-40gb": ["GPU-fake-0001::0", "GPU-fake-0001::1"]}
    # the slice counts (nodes/status) and the status annotations: no label, no ConfigMap
    assert [e[0] for e in rig.events if e[0] != "event"] == ["status", "annotations"]
    assert rig.node_api.labels == {}


async def test_used_slices_are_kept():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [10, 10, 20, 40]}, plan="m1"))
    await rig.agent().reconcile_once()
    ten = advertised(rig)["nvidia.com/gpu-10gb"]
    rig.pods.assign("ns/a", "nvidia.com/gpu-10gb", ten[0])
    rig.pods.assign("ns/b", "nvidia.com/gpu-10gb", ten[1])
    # the planner re-carves GPU 0 into 40+20+20 while two 10gb slices are in use
    rig.node_api.set_annotations({**mps_spec({0: [40, 20, 20]}, plan="m2"), "dynpart.io/spec-gpu-0-10gb": None})
    report = await rig.agent().reconcile_once()  # a new agent process: the used slices come from PodResources
    assert advertised(rig)["nvidia.com/gpu-10gb"] == ten
    assert len(advertised(rig)["nvidia.com/gpu-20gb"]) == 1 and len(advertised(rig)["nvidia.com/gpu-40gb"]) == 1
    assert any("2 x 10gb slice(s) are in use by pods but the spec has 0" in e for e in report.errors)
    assert any("a 20gb slice does not fit" in e for e in report.errors)
    status = decode_status(rig.node_api.annotations, H100, capacity=80)
    assert [(s.size, s.used) for s in status.layout.gpus[0].mps] == [(40, False), (20, False), (10, True), (10, True)]


async def test_whole_gpu_and_mig_gpus_are_not_shared():
    rig = mps_rig(3)
    rig.driver.set_mig_mode(2, True)
    rig.pods.assign("ns/whole", "nvidia.com/gpu", "GPU-fake-0001")
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40], 2: [80]}))
    report = await rig.agent().reconcile_once()
    assert advertised(rig) == {"nvidia.com/gpu-40gb": ["GPU-fake-0000::0", "GPU-fake-0000::1"],
                               "nvidia.com/gpu": ["GPU-fake-0001"]}
    assert any("GPU 1 is held whole by ns/whole" in e for e in report.errors)
    assert any("GPU 2 is in MIG mode" in e for e in report.errors)


async def test_empty_spec_unshares_everything():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="a"))
    agent = rig.agent()
    await agent.reconcile_once()
    assert advertised(rig) == {"nvidia.com/gpu-40gb": ["GPU-fake-0000::0", "GPU-fake-0000::1"],
                               "nvidia.com/gpu": ["GPU-fake-0001"]}
    rig.node_api.set_annotations({SPEC_PLAN: "b", SPEC_MODE: "mps", "dynpart.io/spec-gpu-0-40gb": None})
    report = await agent.reconcile_once()
    assert report.plan_id == "b"
    assert advertised(rig) == {"nvidia.com/gpu": ["GPU-fake-0000", "GPU-fake-0001"]}


async def test_an_mps_node_without_the_agents_plugin_is_refused():
    rig = make_rig(H100, 1, mig_enabled=False)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="a"))
    report = await rig.agent().reconcile_once()
    assert report.failed and "only the agent's own device plugin serves" in report.errors[0]


async def test_a_drained_gpu_loses_each_slice_as_it_frees():
    rig = mps_rig()
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 20], 1: [40, 40]}, plan="m1"))
    await rig.agent().reconcile_once()
    forty = advertised(rig)["nvidia.com/gpu-40gb"]
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", forty[0])  # on GPU 0
    rig.node_api.set_annotations({**mps_spec({0: [40, 20, 20], 1: [40, 40]}, plan="m2"), "dynpart.io/spec-drain": "0"})
    report = await rig.agent().reconcile_once()
    assert report.plan_id == "m2"
    status = decode_status(rig.node_api.annotations, H100, capacity=80)
    by_gpu = {g.index: [(s.size, s.used) for s in g.mps] for g in status.layout.gpus}
    assert by_gpu[0] == [(40, True)] and by_gpu[1] == [(40, False), (40, False)]
    rig.pods.release("ns/a")
    await rig.agent().reconcile_once()
    status = decode_status(rig.node_api.annotations, H100, capacity=80)
    assert [g.index for g in status.layout.gpus] == [1]


async def test_a_lower_mps_capacity_is_what_the_planner_plans_with():
    """DYNPART_AGENT_MPS_CAPACITY_GB=40: the capability report offers 40 GiB for slices, so the
    planner, which reads the same report, plans no slice the agent would refuse."""
    from dynpart.planner.cluster_view import build_snapshot
    from dynpart.planner.core import plan

    rig = mps_rig(1)
    await rig.agent(capacity_gb=40).reconcile_once()
    node = {"metadata": {"name": "node-1", "labels": {"dynpart.io/gpu-partitioning": "mps"},
                         "annotations": dict(rig.node_api.annotations)},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}}}
    pods = [{"metadata": {"name": f"w{i}", "namespace": "ml"},
             "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu-20gb": "1"}}}]},
             "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                             "reason": "Unschedulable"}]}} for i in range(3)]
    view = build_snapshot([node], pods, CATALOG)
    result = plan(view.snapshot, view.catalog)
    assert len(result.placements) == 2 and len(result.unplaced) == 1
    rig.node_api.set_annotations(mps_spec({0: [20, 20]}, plan="m1"))
    report = await rig.agent(capacity_gb=40).reconcile_once()
    assert report.plan_id == "m1" and report.errors == []


async def test_an_mps_capacity_above_the_gpus_memory_is_said_once_and_the_reported_memory_used(caplog):
    """DYNPART_AGENT_MPS_CAPACITY_GB only lowers the capacity: one above what the driver reports
    (100 GB on the fake H100's 80 GiB) is said, once, and the report keeps the driver's memory."""
    import logging

    from dynpart.annotations import STATUS_CAPABILITY
    from dynpart.capability import decode_capability

    rig = mps_rig(1)
    agent = rig.agent(capacity_gb=100)
    with caplog.at_level(logging.WARNING, logger="dynpart"):
        await agent.reconcile_once()
        agent._model = None  # the model read again (a MIG mode change does that): not said again
        await agent.reconcile_once()
    said = [r.getMessage() for r in caplog.records if "mps_capacity_gb 100 is above" in r.getMessage()]
    assert said == ["node node-1: mps_capacity_gb 100 is above the memory the driver reports (80 GiB): it only "
                    "lowers the MPS capacity, so the reported memory is used"]
    capability = decode_capability(rig.node_api.annotations[STATUS_CAPABILITY])
    assert {k.memory_mib for k in capability.kinds} == {80 * 1024}
