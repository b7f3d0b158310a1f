"""What the simulator measures is what the controller runs: one sequence of events (pods
arriving, nodes acknowledging their plans after the reconfiguration delay) fed to the replay and
to the planner controller (its watch handlers and its planning round, API writes recorded, the
clock injected) gives the same node layouts, with the same pods, written at the same times."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from dynpart.annotations import decode_spec, encode_status
from dynpart.catalog import default_catalog
from dynpart.planner import controller as controller_module
from dynpart.planner.controller import PlannerController
from dynpart.planner.loop import PlanningLoop
from dynpart.resources import mig_resource_name
from dynpart.settings import default_planner_settings
from dynpart.simulations.replay.engine import ReplayOptions, run_replay
from dynpart.snapshot import GpuLayout, MigInstance, NodeLayout

from .conftest import cluster, pod

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")
DELAY = 6.0  # seconds per MIG instance created or destroyed
MILLI = {"1g.10gb": 100, "2g.20gb": 250, "3g.40gb": 400, "4g.40gb": 500, "7g.80gb": 1000}

# (name, profile, arrival s): bursts that close batches by idleness and by timeout, a node in
# flight while pods keep arriving, and a whole-GPU pod that needs a fresh GPU
ARRIVALS = [("a", "3g.40gb", 0), ("b", "1g.10gb", 0), ("c", "2g.20gb", 1), ("d", "1g.10gb", 2),
            ("e", "4g.40gb", 4), ("f", "7g.80gb", 5), ("g", "1g.10gb", 9), ("h", "3g.40gb", 30),
            ("i", "2g.20gb", 31), ("j", "1g.10gb", 33)]
NODES = ["n0", "n1"]
GPUS = 2


def _trace():
    return [pod(f"ml/{name}", cpu=1000, mem=1024, milli=MILLI[profile], t0=t, t1=t + 100_000)
            for name, profile, t in ARRIVALS]


def _k8s_pod(name: str, profile: str, t: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": f"2026-01-01T00:{t // 60:02d}:{t % 60:02d}Z"},
            "spec": {"containers": [{"name": "c", "resources": {
                "limits": {mig_resource_name(profile): "1"}, "requests": {"cpu": "1000m", "memory": "1024Mi"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                           "reason": "Unschedulable"}]}}


def _k8s_node(name: str, layout: NodeLayout, plan_id: str | None) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": "1",
                         "labels": {"dynpart.io/gpu-partitioning": "mig", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                    "nvidia.com/gpu.count": str(GPUS)},
                         "annotations": encode_status(layout, plan_id)},
            "status": {"allocatable": {"cpu": "64", "memory": "1048576Mi"}}}


def _shape(layout: dict) -> tuple:
    """A written node layout, for comparing: each GPU's instances (profile, start)."""
    return tuple((g["index"], tuple(sorted((m["profile"], m["start"]) for m in g["mig"])))
                 for g in layout["gpus"] if g["mig"])


async def _controller_writes(monkeypatch) -> list[tuple[float, str, tuple, tuple[str, ...]]]:
    """Drive the controller as its `_step` would, on a simulated clock: the next event or the
    loop's next deadline, whichever comes first. The agent acknowledges a plan DELAY s per
    instance created or destroyed after it was written (the slowest GPU), marking the planned
    pods' instances used; the scheduler binds the planned pods then."""
    now = [0.0]
    patches: list[tuple[str, dict]] = []
    layouts: list[NodeLayout] = []

    async def fake_patch(core, name, patch, resource_version=None):
        patches.append((name, patch))
        return {}

    real = controller_module.planned_patches

    def recording(snapshot, result, nodes, plan_id, term=None):
        out = real(snapshot, result, nodes, plan_id, term)
        layouts.extend(lay for lay, _ in out)
        return out

    monkeypatch.setattr(controller_module, "patch_node_annotations", fake_patch)
    monkeypatch.setattr(controller_module, "planned_patches", recording)
    settings = default_planner_settings()
    c = PlannerController(client.ApiClient(), settings, CAT, clock=lambda: now[0])

    async def event(obj, reason, message, warning=False):
        return None
    c._event = event  # type: ignore[method-assign]  # no Events in this test

    status = {n: NodeLayout(node=n, mode="mig", gpus=[GpuLayout(index=g) for g in range(GPUS)]) for n in NODES}
    for n in NODES:
        c.nodes.cache[n] = _k8s_node(n, status[n], None)
    events: list[tuple[float, int, str, Any]] = [(float(t), k, "arrive", (name, profile, t))
                                                 for k, (name, profile, t) in enumerate(ARRIVALS)]
    writes = []
    seq = len(events)
    while True:
        events.sort(key=lambda e: (e[0], e[1]))
        nxt = events[0][0] if events else float("inf")
        due = max(now[0], c.loop.next_due()) if (c.window.members or c._candidates()) else float("inf")
        if nxt == float("inf") and due == float("inf"):
            break
        if due < nxt:
            now[0] = due
            if c.loop.due(now[0], True):
                c.loop.begin_round(now[0])
                before = len(patches)
                await c.plan_round()
                for (name, patch), lay in zip(patches[before:], layouts[before:]):
                    spec = decode_spec({k: v for k, v in patch.items() if v is not None}, H100)
                    assert spec.layout is not None and spec.plan_id is not None
                    writes.append((now[0], name, _shape(spec.layout.model_dump()), tuple(sorted(spec.pods))))
                    ops = max((g.created + g.destroyed for g in lay.gpus), default=0)
                    seq += 1
                    events.append((now[0] + DELAY * ops, seq, "ack", (name, spec, lay)))
            continue
        now[0], _, kind, what = events.pop(0)
        if kind == "arrive":
            name, profile, t = what
            obj = _k8s_pod(name, profile, t)
            c.pods.cache[f"ml/{name}"] = obj
            c._on_pod("ADDED", obj)
        else:
            name, spec, lay = what
            planned = {(g.index, m.profile, m.start) for g in lay.gpus for m in g.mig if m.pod}
            used = {(g.index, m.profile, m.start) for g in status[name].gpus for m in g.mig if m.used}
            status[name] = NodeLayout(node=name, mode="mig", gpus=[
                GpuLayout(index=g.index, mig=[MigInstance(profile=m.profile, start=m.start,
                                                          used=(g.index, m.profile, m.start) in planned | used)
                                              for m in g.mig]) for g in spec.layout.gpus])
            for key in spec.pods:  # the scheduler binds the planned pods to the new instances
                obj = c.pods.cache[key]
                obj["spec"]["nodeName"] = name
                obj["status"] = {"phase": "Running"}
                c._on_pod("MODIFIED", obj)
            node = _k8s_node(name, status[name], spec.plan_id)
            c.nodes.cache[name] = node
            c._on_node("MODIFIED", node)
    return writes


@pytest.mark.asyncio
async def test_the_replay_and_the_controller_write_the_same_layouts(monkeypatch):
    spec = cluster(*[(n, 64_000, GPUS, "H100-80GB", 1 << 20) for n in NODES], mode="mig")
    result = run_replay(_trace(), spec, CAT, ReplayOptions(policy="dynpart", mig_op_delay_s=DELAY))
    assert all(r.planned for r in result.runs)  # every pod went through the loop (none found a free slice)
    replayed = [(w.time, w.node, _shape(w.layout), tuple(sorted(w.pods))) for w in result.writes]
    controlled = await _controller_writes(monkeypatch)
    assert len(replayed) >= 4  # several rounds, several nodes
    assert controlled == replayed


def test_the_replay_runs_the_controllers_loop():
    # the replay's dynpart is the controller's PlanningLoop with the planner's settings, nothing else
    loop = ReplayOptions(policy="dynpart").loop()
    assert type(loop) is PlanningLoop and loop.options.policy == "dynpart"
    assert loop.settings == default_planner_settings()
