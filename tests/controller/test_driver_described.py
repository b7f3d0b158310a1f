"""The node is planned from what its driver says, through the real parts end to end without an API
server: a fake NVML -> the agent (capability report in its status) -> the planner's cluster view
-> plan() -> the spec patch -> the agent applies it on that same fake NVML.

For every catalog model with MIG, the fake driver's placements and counts differ from the
catalog's (seeded perturbations): the planner never plans a placement the driver refuses."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.kube import FakeNodeApi
from dynpart.agent.loop import Agent
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import STATUS_CAPABILITY, STATUS_PLAN
from dynpart.capability import decode_capability
from dynpart.catalog import GpuModel, MigProfile, default_catalog
from dynpart.mig import MigRules
from dynpart.planner.cluster_view import build_snapshot, planned_patches
from dynpart.planner.core import plan
from dynpart.resources import mig_resource_name
from tests.agent.conftest import unserved_plugins
from tests.controller.test_cluster_view import node, pod
from tests.gpus import RTX_PRO_6000, RTX_PRO_6000_MEMORY_MIB, RTX_PRO_6000_NVML_NAME

CAT = default_catalog()
MIG_MODELS = [m for m in CAT.models.values() if m.supports_mig]


def perturbed(model: GpuModel, seed: int) -> GpuModel:
    """The model as a driver that disagrees with the catalog describes it: each profile with more
    than one legal start loses one (chosen by the seed), and one profile's max count drops by one."""
    rng = random.Random(seed)
    shrink = rng.choice([p.name for p in model.mig_profiles if p.max > 1] or [""])
    profiles: list[MigProfile] = []
    for p in model.mig_profiles:
        starts = list(p.starts)
        if len(starts) > 1:
            starts.remove(rng.choice(starts))
        profiles.append(p.model_copy(update={"starts": tuple(starts), "max": p.max - (p.name == shrink)}))
    return model.model_copy(update={"mig_profiles": tuple(profiles)})


class NodeRig:
    """One node: a fake driver, the real agent on a fake node API, and the node object the planner sees."""

    def __init__(self, driver: FakeNvml, product: str, mode: str = "mig", gpus: int = 2):
        self.driver = driver
        self.api = FakeNodeApi("node-1", labels={"dynpart.io/gpu-partitioning": mode})
        pods = FakePodResources()
        # an MPS node needs the agent's own device plugin (here unserved: no kubelet)
        self.agent = Agent("node-1", node_api=self.api, driver=driver, pods=pods, catalog=CAT,
                           plugins=unserved_plugins(pods) if mode == "mps" else None)
        self.product, self.mode, self.gpus = product, mode, gpus

    def node_object(self) -> dict[str, Any]:
        obj = node("node-1", mode=self.mode, product=self.product, count=self.gpus, cpu="512", memory="4Ti")
        obj["metadata"]["annotations"] = dict(self.api.annotations)
        return obj

    async def plan_and_apply(self, pods: list[dict[str, Any]], plan_id: str = "p1"):
        """One planning round on what the agent reported, the patch applied, one agent pass."""
        view = build_snapshot([self.node_object()], pods, CAT)
        result = plan(view.snapshot, view.catalog)
        patches = planned_patches(view.snapshot, result, {"node-1": self.node_object()}, plan_id)
        for _, patch in patches:
            self.api.set_annotations(patch)
        report = await self.agent.reconcile_once()
        return view, result, report


def mig_pods(model: GpuModel, gpus: int) -> list[dict[str, Any]]:
    """More pods of every profile than the node could hold, smallest first (a mixed queue)."""
    out = []
    for p in sorted(model.mig_profiles, key=lambda p: p.memory):
        for k in range(p.max * gpus):
            out.append(pod(f"{p.name.replace('+', 'x')}-{k}", {mig_resource_name(p.name): "1"}))
    return out


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("seed", [1, 2])
async def test_never_plans_a_placement_the_driver_refuses(model: GpuModel, seed: int):
    truth = perturbed(model, seed)
    rig = NodeRig(FakeNvml(truth, 2, name=f"NVIDIA {model.name}"), f"NVIDIA-{model.name}")
    await rig.agent.reconcile_once()  # the first pass reports the capability
    reported = decode_capability(rig.api.annotations[STATUS_CAPABILITY])
    assert {p.name: p.starts for p in reported.kinds[0].profiles} == {p.name: p.starts for p in truth.mig_profiles}
    view, result, report = await rig.plan_and_apply(mig_pods(model, 2))
    assert view.disagreements["node-1"], "the perturbation must show as a disagreement"
    assert result.stats.placed > 0
    rules = MigRules.of(truth)
    for layout in result.layouts:
        for g in layout.gpus:
            assert rules.violations([(m.profile, m.start) for m in g.mig]) == [], (model.name, g)
    refused = [op for op in rig.driver.ops if op.result != "ok"]
    assert refused == [] and report.errors == [], (refused, report.errors)
    assert rig.api.annotations[STATUS_PLAN] == "p1.0"
    assert sum(len(rig.driver.layout(i)) for i in range(2)) >= result.stats.placed


async def test_a_gpu_the_catalog_lacks_is_planned_from_its_report():
    """RTX PRO 6000 Blackwell with its -me, +me.all and +gfx profiles: not in the catalog."""
    driver = FakeNvml(RTX_PRO_6000, 2, name=RTX_PRO_6000_NVML_NAME, memory_mib=RTX_PRO_6000_MEMORY_MIB)
    rig = NodeRig(driver, "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition")
    await rig.agent.reconcile_once()
    wanted = {"1g.24gb-me": 1, "1g.24gb+me.all": 1, "1g.24gb+gfx": 2, "4g.96gb": 1}  # 8 memory slices
    pods = [pod(f"p-{name.replace('+', 'x')}-{k}", {mig_resource_name(name): "1"},
                nodeSelector={"nvidia.com/gpu.product": "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"})
            for name, n in wanted.items() for k in range(n)]
    view, result, report = await rig.plan_and_apply(pods)
    assert view.problems == [] and result.unplaced == [] and report.errors == []
    carved = sorted(name for i in range(2) for name, _ in driver.layout(i))
    assert carved == sorted(name for name, n in wanted.items() for _ in range(n))


async def test_mps_slices_never_add_up_to_more_than_nvml_memory():
    """An H100 reports 81,559 MiB: 79 GiB of MPS slices per GPU, not the nominal 80."""
    h100 = CAT.resolve("H100-80GB")
    rig = NodeRig(FakeNvml(h100, 1, mig_enabled=False, memory_mib=81_559), "NVIDIA-H100-80GB-HBM3", mode="mps",
                  gpus=1)
    await rig.agent.reconcile_once()
    pods = [pod(f"m-{k}", {"nvidia.com/gpu-10gb": "1"}) for k in range(8)]
    view, result, report = await rig.plan_and_apply(pods)
    assert view.catalog.resolve(view.snapshot.nodes[0].gpu_model).mps_capacity_gb == 79
    assert result.stats.placed == 7 and len(result.unplaced) == 1
    sizes = [s.size for layout in result.layouts for g in layout.gpus for s in g.mps]
    assert sum(sizes) * 1024 <= 81_559 and report.errors == []


async def test_an_mps_node_whose_gpu_is_in_mig_mode_is_not_planned():
    """Labelled mps, its GPU still in MIG mode (relabelled from mig, or left there by mig-manager):
    its agent refuses MPS slices there, so the pod goes to the MPS node with room."""
    from dynpart.annotations import encode_status
    from dynpart.snapshot import GpuLayout, MpsSlice, NodeLayout

    rig = NodeRig(FakeNvml(CAT.resolve("H100-80GB"), 1, mig_enabled=True), "NVIDIA-H100-80GB-HBM3", mode="mps", gpus=1)
    await rig.agent.reconcile_once()
    other = node("node-2", mode="mps", count=1, annotations=encode_status(NodeLayout(node="node-2", mode="mps", gpus=[
        GpuLayout(index=0, mps=[MpsSlice(size=40, used=True)])]), "q0"))
    view = build_snapshot([rig.node_object(), other], [pod("a", {"nvidia.com/gpu-10gb": "1"})], CAT)
    result = plan(view.snapshot, view.catalog)
    assert [(p.pod, p.node) for p in result.placements] == [("ml/a", "node-2")]
    assert any("GPU(s) 0 are in MIG mode" in m for _, m in view.problems)


async def test_a_mig_node_whose_gpu_serves_mps_pods_out_of_mig_mode_is_not_carved():
    """Labelled mig, its GPU out of MIG mode and busy with an MPS pod (a node switched while its
    pods run): its agent would acknowledge a plan there without making anything, for ever."""
    drv = FakeNvml(CAT.resolve("H100-80GB"), 1, mig_enabled=False)
    drv.attach(0, 4242)
    rig = NodeRig(drv, "NVIDIA-H100-80GB-HBM3", mode="mig", gpus=1)
    await rig.agent.reconcile_once()
    running = pod("old", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="node-1", unschedulable=False)
    view, result, _ = await rig.plan_and_apply([pod("a", {"nvidia.com/mig-1g.10gb": "1"}), running])
    assert view.snapshot.nodes[0].gpus == [] and result.placements == []
    drv.detach(0, 4242)  # the MPS pod ended
    view, result, report = await rig.plan_and_apply([pod("a", {"nvidia.com/mig-1g.10gb": "1"})], "p2")
    assert [(p.pod, p.node) for p in result.placements] == [("ml/a", "node-1")] and report.errors == []
    assert [name for name, _ in drv.layout(0)] == ["1g.10gb"]
