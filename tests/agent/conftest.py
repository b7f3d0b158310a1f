"""A node with fake GPUs, a fake kubelet and a fake API server, and an agent on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from dynpart.agent import mig_agent as mig_agent_module
from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.kube import FakeNodeApi
from dynpart.agent.loop import Agent
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import encode_spec
from dynpart.catalog import GpuModel, default_catalog
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout

CATALOG = default_catalog()
H100 = CATALOG.resolve("H100-80GB")
# The nominal 80 GiB for MPS tests about serving and keeping slices, in round numbers (2 x 40gb);
# a real H100 80GB HBM3 reports 81,559 MiB, 79 GiB of slices (tests/controller/test_driver_described.py,
# tests/agent/test_recorded_nvml.py)
ROUND_80GIB = {"memory_mib": 80 * 1024}
A100 = CATALOG.resolve("A100-40GB")
NOW = datetime(2025, 3, 1, 9, 0, 0, tzinfo=UTC)


def placements(*items: str) -> list[tuple[str, int]]:
    """"1g.10gb@0" -> ("1g.10gb", 0)"""
    out = []
    for item in items:
        profile, start = item.split("@")
        out.append((profile, int(start)))
    return out


def mig_spec(gpus: dict[int, list[str]], plan: str = "p1") -> dict[str, str]:
    layout = NodeLayout(node="node-1", mode="mig", gpus=[
        GpuLayout(index=i, mig=[MigInstance(profile=p, start=s) for p, s in placements(*items)])
        for i, items in gpus.items()])
    return encode_spec(layout, plan)


def mps_spec(gpus: dict[int, list[int]], plan: str = "p1", term: int | None = None) -> dict[str, str]:
    layout = NodeLayout(node="node-1", mode="mps", gpus=[
        GpuLayout(index=i, mps=[MpsSlice(size=s) for s in sizes]) for i, sizes in gpus.items()])
    return encode_spec(layout, plan, term=term)


@dataclass
class Rig:
    driver: FakeNvml
    pods: FakePodResources
    node_api: FakeNodeApi
    events: list[tuple[str, Any]] = field(default_factory=list)
    pid: int = 1000
    plugins: DevicePluginManager | None = None  # `with_plugins()`: the agent's own device plugin, unserved

    def agent(self, **kw: Any) -> Agent:
        """A new agent process on this node (same GPUs, same API server, same device plugin)."""
        if self.plugins is not None:
            kw.setdefault("plugins", self.plugins)
        return Agent("node-1", node_api=self.node_api, driver=self.driver, pods=self.pods, catalog=CATALOG,
                     now=lambda: NOW, **kw)

    def with_plugins(self) -> Rig:
        """Agents with their own device plugin, as on an MPS node (which needs it), unserved (no
        kubelet): the kubelet "holds" whatever it advertises (PodResources GetAllocatableResources)."""
        self.plugins = unserved_plugins(self.pods)
        return self

    def carve(self, gpu: int, *items: str) -> dict[str, int]:
        """Create instances directly (as a previous plan did); returns "profile@start" -> GI id."""
        out = {}
        for profile, start in placements(*items):
            p = self.driver.model.profile(profile)
            gi = self.driver.create_gpu_instance(gpu, p.gi_profile_id, start, p.memory)
            self.driver.create_compute_instance(gpu, gi, p.compute)
            out[f"{profile}@{start}"] = gi
        self.driver.ops.clear()
        return out

    def uuid(self, gpu: int, gi: int) -> str:
        info = {g.gi_id: g for g in self.driver.gpu_instances(gpu)}[gi]
        assert info.uuid is not None
        return info.uuid

    def run_pod(self, pod: str, gpu: int, gi: int, *, process: bool = True, assigned: bool = True) -> int:
        """A pod on a MIG device: assigned by the kubelet and/or with a process on it."""
        self.pid += 1
        if process:
            self.driver.attach(gpu, self.pid, gi)
        if assigned:
            profile = {g.gi_id: g for g in self.driver.gpu_instances(gpu)}[gi].profile_id
            name = next(p.name for p in self.driver.model.mig_profiles if p.gi_profile_id == profile)
            self.pods.assign(pod, "nvidia.com/mig-" + name.replace("+", "."), self.uuid(gpu, gi))
        return self.pid

    def stop_pod(self, pod: str, pid: int | None = None) -> None:
        self.pods.release(pod)
        if pid is not None:
            for d in self.driver.devices():
                self.driver.detach(d.index, pid)


def unserved_plugins(pods: FakePodResources) -> DevicePluginManager:
    """The agent's own device plugin without a kubelet (no socket, no registration); `pods`
    answers GetAllocatableResources with what it advertises."""
    plugins = DevicePluginManager("/nonexistent/device-plugins", serve=False)
    pods.on_allocatable = lambda: {r: [d.id for d in ds] for r, ds in plugins.advertised().items()}
    return plugins


def make_rig(model: GpuModel = H100, count: int = 2, **driver_kw: Any) -> Rig:
    events: list[tuple[str, Any]] = []
    return Rig(FakeNvml(model, count, **driver_kw), FakePodResources(), FakeNodeApi("node-1", events=events), events)


@pytest.fixture
def rig() -> Rig:
    return make_rig()


@pytest.fixture
def ask_enable_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pending MIG mode enable (IN_USE) asked again at the next pass, not after the agent's
    growing wait (`mig_agent.ENABLE_RETRY_FIRST_S`): for tests of what the re-ask does."""
    monkeypatch.setattr(mig_agent_module, "ENABLE_RETRY_FIRST_S", 0.0)
