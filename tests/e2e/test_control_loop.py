"""The whole control loop on the local control plane: pods that ask for GPU slices go Unschedulable
in the real kube-scheduler, the planner (a real subprocess) plans, the node agents (in-process, on
fake GPUs) carve, the simulated device plugins publish the new slices, the scheduler binds, the
simulated kubelets run the pods. See tests/e2e/harness.py."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
import urllib.request

import pytest

from dynpart.agent.deviceplugin.devices import GpuView, advertise
from dynpart.agent.driver.fake import SimulatedCrash
from dynpart.agent.driver.interface import GpuDriverError
from dynpart.kube.conventions import SPEC_PLAN, STATUS_PLAN
from dynpart.kube.errors import APIConflictError
from dynpart.kube.patching import patch_node_annotations
from tests.e2e.harness import (
    REPO_ROOT,
    Harness,
    PlannerProcess,
    PodRecord,
    ShortcutPlugins,
    SimNode,
    agent_metrics_port,
    module_planner,
    scrape,
    wait_until,
)

pytestmark = pytest.mark.e2e

A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"
REACTION_FILE = REPO_ROOT / ".cache" / "e2e" / "reaction-shortcut.json"  # test_reaction.py writes reaction.json


@pytest.fixture(scope="module")
def planner(e2e_cluster, tmp_path_factory):
    """One planner for the module (default settings, leader election on)."""
    yield from module_planner(e2e_cluster, tmp_path_factory, "planner-a")


@pytest.fixture
async def harness(e2e_cluster, planner):
    await planner.wait_log(r"acquired leadership", timeout=60)
    await planner.wait_log(r"caches synced", timeout=60)
    h = Harness(e2e_cluster.kubeconfig, planners=[planner])
    await h.start()
    try:
        yield h
    finally:
        await h.close()
        print(f"--- planner log tail ({planner.log_path}) ---\n{planner.log_tail(150)}")  # shown on failure


def _workload() -> list[tuple[str, str]]:
    """60 pods that fit: 40 MIG (2 nodes x 8 GPUs), 20 MPS (4 x 80 GB)."""
    mix = ([("mig-7g", "nvidia.com/mig-7g.80gb")] * 2 + [("mig-3g", "nvidia.com/mig-3g.40gb")] * 8
           + [("mig-2g", "nvidia.com/mig-2g.20gb")] * 12 + [("mig-1g", "nvidia.com/mig-1g.10gb")] * 14
           + [("mig-1gme", "nvidia.com/mig-1g.10gb.me")] * 4
           + [("mps-10", "nvidia.com/gpu-10gb")] * 12 + [("mps-20", "nvidia.com/gpu-20gb")] * 8)
    random.Random(2025).shuffle(mix)
    return [(f"{prefix}-{i}", res) for i, (prefix, res) in enumerate(mix)]


async def test_sixty_pods_reach_running(harness: Harness, planner: PlannerProcess):
    h = harness
    await h.add_node("a100", A100, "mig", 8)
    await h.add_node("h100", H100, "mig", 8)
    await h.add_node("mps", H100, "mps", 4)
    for node in h.nodes.values():
        await h.start_agent(node)

    pods = _workload()
    bursts = [pods[0:20], pods[20:40], pods[40:60]]
    recs = await h.create_pods(bursts[0])
    await h.wait_running(recs, timeout=90)

    # A pod that can never fit: an Event says why, and the loop goes on.
    too_big = await h.create_pod("too-big", "nvidia.com/gpu-200gb")
    for burst in bursts[1:]:
        batch = await h.create_pods(burst)
        await h.wait_running(batch, timeout=90)
        recs += batch

    async def unplaceable():
        return [e for e in await h.events_of(too_big) if e.reason == "Unplaceable"]
    events = await wait_until(unplaceable, 30, "an Unplaceable event on the 200 GB pod", interval=0.2)
    assert "dynpart cannot place this pod" in events[0].message and "200" in events[0].message, events[0].message
    assert events[0].type == "Warning" and events[0].source.component == "dynpart-planner"
    assert too_big.running_at is None and too_big.node is None

    assert len(recs) == 60 and all(r.running_at is not None for r in recs)
    assert {r.node for r in recs} == set(h.nodes), "every node should host pods"
    summary = h.write_reaction(REACTION_FILE, recs)
    slowest = max(recs, key=lambda r: r.reaction_s or 0)
    print(f"\nslowest: {slowest.key} {slowest.resource} on {slowest.node}: marked Unschedulable after "
          f"{_after(slowest, slowest.unschedulable_at)}, bound after {_after(slowest, slowest.bound_at)}, Running after "
          f"{_after(slowest, slowest.running_at)}")
    print(f"\nreaction time over {summary['running']} pods (create -> Running): median {summary['median_s']} s, "
          f"p95 {summary['p95_s']} s, max {summary['max_s']} s; by resource {summary['by_resource']}; "
          f"{sum(r.waited_for_devices for r in recs)} bound before their devices were free")

    # Jobs finish; whole-GPU jobs arrive, one per MIG GPU that nothing runs on any more: every one of
    # them needs that GPU re-carved (its free instances destroyed) around the GPUs still in use.
    mig = [n for n in h.nodes.values() if n.mode == "mig"]
    done = [r for r in recs[:20] if r.node in {n.name for n in mig}]
    for r in done:
        await h.delete_pod(r)
    idle = [(n.name, i) for n in mig for i in range(n.count)
            if not any(hd.gpu == i for hs in n.holdings.values() for hd in hs)]
    with_instances = [(n.name, i) for n in mig for i in range(n.count) if (n.name, i) in idle and n.driver.layout(i)]
    whole = await h.create_pods([(f"whole-{k}", "nvidia.com/mig-7g.80gb") for k in range(len(idle))])
    await h.wait_running(whole, timeout=90)
    destroyed = [(n.name, r.op.device, r.op.profile, r.op.start) for n in mig for r in n.destroys
                 if r.op.op == "destroy_gi"]
    print(f"after {len(done)} jobs finished: {len(whole)} 7g.80gb pods on the {len(idle)} idle MIG GPUs "
          f"({len(with_instances)} of them carved), median {statistics.median(r.reaction_s for r in whole):.2f} s; "
          f"{len(destroyed)} MIG instances destroyed ({sum(len(n.destroys) for n in mig)} destroy calls)")
    assert len(with_instances) > 0 and len(destroyed) >= len(with_instances)
    assert {(n, g) for n, g, _, _ in destroyed} <= set(idle), "only GPUs nothing ran on were re-carved"

    # Used slices were never disrupted, and the handshake was kept.
    assert h.destroy_violations() == []
    assert h.handshake_violations() == []

    # Metrics over HTTP: the planner's and the agents'.
    p = await asyncio.to_thread(scrape, planner.metrics_port)
    for name in ("dynpart_plan_seconds_count", "dynpart_pods_placed_total", "dynpart_pods_unplaceable_total",
                 "dynpart_slices_created_total", 'dynpart_slices_created_total{mode="mig"}',
                 'dynpart_slices_created_total{mode="mps"}', "dynpart_plan_acks_total", "dynpart_node_plans_total",
                 "dynpart_leader", "dynpart_plan_ack_seconds_count", "dynpart_plans_total",
                 'dynpart_slices_destroyed_total{mode="mig"}'):
        assert p.get(name, 0) > 0, f"planner metric {name} = {p.get(name)}"
    # liveness: the real planner's planning loop and both watches are beating
    healthz = await asyncio.to_thread(lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{planner.metrics_port}/healthz", timeout=5).read())
    assert healthz == b"ok\n"
    a = await asyncio.to_thread(scrape, agent_metrics_port())
    for name in ('dynpart_agent_passes_total{result="ok"}', "dynpart_agent_pass_seconds_count",
                 "dynpart_agent_plan_acks_total", "dynpart_agent_mig_instances_created_total",
                 "dynpart_agent_mig_instances_destroyed_total"):
        assert a.get(name, 0) > 0, f"agent metric {name} = {a.get(name)}"
    assert a["dynpart_agent_mig_instances_created_total"] >= 40
    assert a["dynpart_agent_mig_instances_destroyed_total"] >= len(destroyed)


def _after(rec, at: float | None) -> str:
    return "-" if at is None else f"{at - rec.created_at:.2f} s"


async def test_used_slices_survive_recarving(harness: Harness):
    """One H100: a pod keeps running on 1g.10gb@6 while the GPU is re-carved three times around it."""
    h = harness
    node = await _precarved_h100(h)
    await h.start_agent(node)

    a = await h.create_pod("keep-1g", "nvidia.com/mig-1g.10gb")
    await h.wait_running([a])
    kept = node.holdings[a.key][0]
    assert node.driver.gpu_instances(0)[[g.gi_id for g in node.driver.gpu_instances(0)].index(kept.gi_id)].start == 6

    assert node.destroys == [], "the pod took the free 1g.10gb: nothing to re-carve yet"

    def destroyed() -> list[tuple[str, int]]:
        return [(r.op.profile, r.op.start) for r in node.destroys if r.op.op == "destroy_gi"]

    b = await h.create_pod("new-3g", "nvidia.com/mig-3g.40gb")  # needs 2g@0 and 2g@2 gone
    await h.wait_running([b])
    assert sorted(destroyed()) == [("2g.20gb", 0), ("2g.20gb", 2)]
    c = await h.create_pod("new-2g", "nvidia.com/mig-2g.20gb")  # needs 1g.20gb@4 gone
    await h.wait_running([c])
    assert destroyed()[2:] == [("1g.20gb", 4)]
    await h.delete_pod(b)
    d = await h.create_pod("new-4g", "nvidia.com/mig-4g.40gb")  # needs the (now free) 3g@0 gone
    await h.wait_running([d])

    layout = node.driver.layout(0)
    assert layout == [("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)], layout
    assert node.holdings[a.key][0].device == kept.device and kept.pid in node.driver.processes(0, kept.gi_id)
    print(f"\nre-carving: {len(node.destroys)} destroy calls, GPU instances destroyed: {destroyed()}; "
          f"reaction times {[round(r.reaction_s, 2) for r in (a, b, c, d)]} s")
    assert destroyed()[3:] == [("3g.40gb", 0)]
    assert h.destroy_violations() == []
    assert h.handshake_violations() == []


async def _precarved_h100(h: Harness):
    """A 1-GPU H100 node left by an earlier layout: 2g.20gb@0, 2g.20gb@2, 1g.20gb@4, 1g.10gb@6, all free."""
    def carve(node) -> None:
        by_name = {p.name: p for p in node.model.mig_profiles}
        for profile, start in (("2g.20gb", 0), ("2g.20gb", 2), ("1g.20gb", 4), ("1g.10gb", 6)):
            p = by_name[profile]
            gi = node.driver.create_gpu_instance(0, p.gi_profile_id, start, p.memory)
            node.driver.create_compute_instance(0, gi, p.compute)
        node.driver.ops.clear()
    return await h.add_node("recarve", H100, "mig", 1, prepare=carve)


async def test_agent_restarted_mid_plan_converges(harness: Harness):
    h = harness
    node = await h.add_node("crash", A100, "mig", 2)
    first = await h.start_agent(node)
    node.driver.crash_after(3)  # the pass applying the first plan dies before its 4th driver call

    pods = await h.create_pods([("c-3g", "nvidia.com/mig-3g.40gb"), ("c-2g", "nvidia.com/mig-2g.20gb"),
                                ("c-1g-a", "nvidia.com/mig-1g.10gb"), ("c-1g-b", "nvidia.com/mig-1g.10gb"),
                                ("c-7g", "nvidia.com/mig-7g.80gb")])
    await wait_until(lambda: first.task.done(), 60, "the agent to crash", describe=h.describe)
    assert isinstance(first.task.exception(), SimulatedCrash)
    assert len(node.driver.ops) == 3
    ann = (await h.core.read_node(node.name)).metadata.annotations
    assert ann[SPEC_PLAN] and ann.get(STATUS_PLAN) != ann[SPEC_PLAN], "a crashed pass must not acknowledge"
    await first.shutdown()

    await h.start_agent(node)  # a new agent process on the same GPUs
    await h.wait_running(pods, timeout=90)

    async def acknowledged():
        a = (await h.core.read_node(node.name)).metadata.annotations
        return a.get(STATUS_PLAN) == a.get(SPEC_PLAN)
    await wait_until(acknowledged, 30, "status-plan == spec-plan")
    assert h.destroy_violations() == []
    assert h.handshake_violations() == []


async def test_a_stale_plan_write_is_refused(harness: Harness):
    """The precondition the planner's writes rely on, against the real API server: a merge patch
    carrying an old resourceVersion is a Conflict, not a silent success."""
    h = harness
    node = await h.add_node("stale", H100, "mig", 1)
    rv = (await h.core.read_node(node.name)).metadata.resource_version
    await patch_node_annotations(h.core, node.name, {"dynpart.io/spec-plan": "p1"}, rv)
    with pytest.raises(APIConflictError):
        await patch_node_annotations(h.core, node.name, {"dynpart.io/spec-plan": "p2"}, rv)
    assert (await h.core.read_node(node.name)).metadata.annotations[SPEC_PLAN] == "p1"


async def test_the_checks_can_fail():
    """The harness's two safety checks catch what they are meant to (no cluster needed)."""
    h = Harness(REPO_ROOT / "unused.kubeconfig")
    h.history["n"] = [{}, {SPEC_PLAN: "p1"}, {SPEC_PLAN: "p2"},  # p1 overwritten before its acknowledgement
                      {SPEC_PLAN: "p2", STATUS_PLAN: "p2"}, {SPEC_PLAN: "p1", STATUS_PLAN: "p2"}]  # p1 again
    assert len(h.handshake_violations()) == 2
    h.history["n"] = [{}, {SPEC_PLAN: "p1"}, {SPEC_PLAN: "p1", STATUS_PLAN: "p1"}, {SPEC_PLAN: "p2", STATUS_PLAN: "p1"}]
    assert h.handshake_violations() == []

    node = SimNode("n", H100, "mig", 1)
    p = next(p for p in node.model.mig_profiles if p.name == "1g.10gb")
    gi = node.driver.create_gpu_instance(0, p.gi_profile_id, 0, p.memory)
    node.driver.create_compute_instance(0, gi, p.compute)
    assert node.assign("ns/pod", "nvidia.com/mig-1g.10gb", 1) is not None
    with pytest.raises(GpuDriverError):
        node.driver.destroy_compute_instance(0, gi, 0)  # the fake driver refuses: IN_USE
    assert len(node.destroy_violations()) == 1 and "held by ns/pod" in node.destroy_violations()[0]
    node.release("ns/pod")
    node.driver.destroy_compute_instance(0, gi, 0)
    node.driver.destroy_gpu_instance(0, gi)
    assert len(node.destroy_violations()) == 1 and len(node.destroys) == 3

    mps = SimNode("m", H100, "mps", 1)
    mps.plugins = ShortcutPlugins(mps.pod_resources)
    uuid = mps.driver.devices()[0].uuid

    def gpu(sizes: tuple[int, ...], ids: tuple[int, ...]) -> list[GpuView]:
        return [GpuView(index=0, uuid=uuid, memory_gb=80, mps=sizes, mps_ids=ids)]
    await mps.plugins.update(advertise(gpu((20, 10), (0, 1))))
    assert mps.assign("ns/pod", "nvidia.com/gpu-10gb", 1) is not None
    assert mps.holdings["ns/pod"][0].device == f"{uuid}::1"
    await mps.plugins.withdraw(f"{uuid}::0")  # a free slice withdrawn: fine
    mps.check_mps_held()
    assert mps.destroy_violations() == []
    await mps.plugins.update(advertise(gpu((20, 20, 20), (0, 2, 3))))  # the 10 GB slice the pod holds is gone
    mps.check_mps_held()
    assert len(mps.destroy_violations()) == 1 and f"{uuid}::1 of pod ns/pod" in mps.destroy_violations()[0]


async def test_pods_dynpart_cannot_read_do_not_stop_the_others(harness: Harness, planner: PlannerProcess):
    """Issue 11: a pod asking for a MIG profile no GPU offers, one selecting a GPU product the
    catalog lacks, and a whole-GPU pod running on an uncarved GPU of a MIG node used to make plan()
    raise and both planner replicas crash-loop. Each now gets a DynpartInvalid Event naming what is
    wrong (the product no dynpart node carries marks another pool's pod: none), and the pods next to
    them run."""
    h = harness
    await h.add_node("h100-bad-input", H100, "mig", 2)
    await h.add_node("mps-bad-input", H100, "mps", 1)
    # the third: a MIG node whose GPU 1 is not in MIG mode and serves a whole-GPU pod
    whole_node = await h.add_node("h100-whole", H100, "mig", 2, prepare=lambda n: n.driver.set_mig_mode(1, False))
    for node in h.nodes.values():
        await h.start_agent(node)
    whole = await h.create_pod("whole-gpu", "nvidia.com/gpu", node=whole_node)
    await h.wait_running([whole], timeout=60)
    unknown_profile = await h.create_pod("unknown-profile", "nvidia.com/mig-5g.20gb")
    body = h.pod_body("unknown-product", "nvidia.com/mig-1g.10gb")
    body["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-Nope-99GB"}
    unknown_product = h.pods[f"{h.namespace}/unknown-product"] = type(unknown_profile)(
        f"{h.namespace}/unknown-product", "nvidia.com/mig-1g.10gb", unknown_profile.created_at)
    await h.core.create_namespaced_pod(h.namespace, body)
    normal = await h.create_pods([("ok-1g", "nvidia.com/mig-1g.10gb"), ("ok-3g", "nvidia.com/mig-3g.40gb"),
                                  ("ok-2g", "nvidia.com/mig-2g.20gb"), ("ok-mps", "nvidia.com/gpu-20gb")])
    beside_whole = await h.create_pod("ok-beside-whole", "nvidia.com/mig-7g.80gb", node=whole_node)
    await h.wait_running([*normal, beside_whole], timeout=90)
    assert whole_node.driver.layout(0) == [("7g.80gb", 0)] and whole_node.driver.layout(1) == []
    assert whole.running_at is not None and whole.node == whole_node.name

    async def node_events():
        events = await h.core.list_event_for_all_namespaces(field_selector=f"involvedObject.name={whole_node.name}")
        return [e for e in events.items if e.reason == "DynpartInvalid" and "serve a pod whole" in e.message]
    await wait_until(node_events, 30, "an Event on the node whose GPU serves a pod whole", interval=0.2)

    async def invalid(rec):
        return [e for e in await h.events_of(rec) if e.reason == "DynpartInvalid"]
    profile_events = await wait_until(lambda: invalid(unknown_profile), 30, "a DynpartInvalid event", interval=0.2)
    assert "'nvidia.com/mig-5g.20gb'" in profile_events[0].message, profile_events[0].message
    # a product no dynpart node carries: another pool's pod, left alone without an Event (the
    # rounds that posted the profile's Event saw it too)
    assert [e.reason for e in await h.events_of(unknown_product)
            if e.reason in ("DynpartInvalid", "Unplaceable", "SlicePlanned")] == []
    assert planner.alive and unknown_profile.running_at is None and unknown_product.running_at is None
    assert h.destroy_violations() == []


async def test_taints_and_required_affinity_are_followed_as_the_scheduler_follows_them(harness: Harness):
    """The planner plans a pod only onto nodes the kube-scheduler would bind it to: the first node
    by name is tainted, so a pod that does not tolerate the taint gets its whole GPU carved on the
    second (planned on the first, it would wait there for ever); a pod that tolerates it then runs
    on the first. Both pods keep to these two nodes by a required node affinity on their names."""
    h = harness
    tainted = await h.add_node("a-tainted", H100, "mig", 1)
    plain = await h.add_node("b-plain", H100, "mig", 1)
    await h.core.patch_node(tainted.name, {"spec": {"taints": [{"key": "dynpart-e2e/team", "value": "a",
                                                                  "effect": "NoSchedule"}]}})
    for node in (tainted, plain):
        await h.start_agent(node)
    only_these = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [tainted.name, plain.name]}]}]}}}

    async def create(name: str, tolerate: bool) -> PodRecord:
        body = h.pod_body(name, "nvidia.com/mig-7g.80gb")
        body["spec"]["affinity"] = only_these
        if tolerate:
            body["spec"]["tolerations"] = [{"key": "dynpart-e2e/team", "operator": "Equal", "value": "a",
                                            "effect": "NoSchedule"}]
        rec = h.pods[f"{h.namespace}/{name}"] = PodRecord(f"{h.namespace}/{name}", "nvidia.com/mig-7g.80gb",
                                                          time.monotonic())
        await h.core.create_namespaced_pod(h.namespace, body)
        return rec

    first = await create("intolerant", tolerate=False)
    await h.wait_running([first], timeout=90)
    assert first.node == plain.name and plain.driver.layout(0) == [("7g.80gb", 0)] and tainted.driver.layout(0) == []
    second = await create("tolerant", tolerate=True)
    await h.wait_running([second], timeout=90)
    assert second.node == tainted.name and tainted.driver.layout(0) == [("7g.80gb", 0)]
    assert h.destroy_violations() == []


async def test_spread_over_nodes_counts_the_nodes_dynpart_does_not_plan(harness: Harness):
    """The kube-scheduler's topology spread counts every node the pod's node affinity admits as a
    domain, GPU or not: with a CPU-only node among them (holding no replica), each GPU node takes
    one replica at maxSkew 1 and a third replica is refused everywhere. The planner must not carve
    a slice for that third one on a GPU node (counting only its own nodes, it saw a least of 1 and
    planned it where the scheduler never binds it): it says Unplaceable instead."""
    h = harness
    a = await h.add_node("spread-a", H100, "mig", 1)
    b = await h.add_node("spread-b", H100, "mig", 1)
    cpu = f"spread-cpu-{h.run_id}"
    await h.core.create_node({"apiVersion": "v1", "kind": "Node",
                              "metadata": {"name": cpu, "labels": {"kubernetes.io/hostname": cpu}}})
    try:
        for node in (a, b):
            await h.start_agent(node)
        recs = []
        for i in range(3):
            name = f"spread-{i}"
            body = h.pod_body(name, "nvidia.com/mig-1g.10gb")
            body["metadata"]["labels"]["app"] = f"spread-{h.run_id}"
            body["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                             "values": [a.name, b.name, cpu]}]}]}}}
            body["spec"]["topologySpreadConstraints"] = [{
                "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": f"spread-{h.run_id}"}}}]
            rec = h.pods[f"{h.namespace}/{name}"] = PodRecord(f"{h.namespace}/{name}", "nvidia.com/mig-1g.10gb",
                                                              time.monotonic())
            await h.core.create_namespaced_pod(h.namespace, body)
            recs.append(rec)
            if i < 2:  # one at a time: the third comes once the first two run on a and b
                await h.wait_running([rec], timeout=90)
        assert sorted(r.node or "" for r in recs[:2]) == sorted([a.name, b.name])

        async def told() -> list[str]:
            return [e.reason for e in await h.events_of(recs[2])]
        deadline = time.monotonic() + 30
        while "Unplaceable" not in (reasons := await told()) and "SlicePlanned" not in reasons \
                and time.monotonic() < deadline:
            await asyncio.sleep(1)
        assert "SlicePlanned" not in reasons and "Unplaceable" in reasons, reasons
        assert recs[2].node is None
        assert h.destroy_violations() == []
    finally:
        await h.core.delete_node(cpu)


async def test_explain_reads_the_cluster_as_a_planning_round_does(harness: Harness):
    """`dynpart explain` on the live cluster sees what a planning round sees: a pod whose volume
    claim does not exist is refused by the scheduler on every node, the planner says Unplaceable,
    and explain says why (it read no claims before, and put the pod on the MIG node)."""
    h = harness
    node = await h.add_node("explain", H100, "mig", 1)
    await h.start_agent(node)
    body = h.pod_body("no-claim", "nvidia.com/mig-1g.10gb")
    body["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "nowhere"}}]
    rec = h.pods[f"{h.namespace}/no-claim"] = PodRecord(f"{h.namespace}/no-claim", "nvidia.com/mig-1g.10gb",
                                                         time.monotonic())
    await h.core.create_namespaced_pod(h.namespace, body)
    deadline = time.monotonic() + 30
    while "Unplaceable" not in (reasons := [e.reason for e in await h.events_of(rec)]) and time.monotonic() < deadline:
        await asyncio.sleep(1)
    assert "Unplaceable" in reasons, reasons
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynpart.cli", "explain", rec.key, "--kubeconfig", str(h.kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DYNPART_") and k != "KUBECONFIG"},
             "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    said = (out + err).decode()
    assert proc.returncode == 2, said
    assert f"PersistentVolumeClaim {h.namespace}/nowhere does not exist" in said, said
    assert node.driver.layout(0) == []


async def test_required_pod_affinity_is_followed_as_the_scheduler_follows_it(harness: Harness):
    """A pod whose required pod affinity wants the zone of a pod bound to a CPU-only node gets its
    slice carved on the GPU node of that zone, where the scheduler binds it; a pod whose affinity
    selects no pod anywhere (and not itself) gets none carved (Unplaceable), as the scheduler binds
    it nowhere."""
    h = harness
    zone = "topology.kubernetes.io/zone"
    a = await h.add_node("aff-a", H100, "mig", 1)
    b = await h.add_node("aff-b", H100, "mig", 1)
    await h.core.patch_node(a.name, {"metadata": {"labels": {zone: f"z1-{h.run_id}"}}})
    await h.core.patch_node(b.name, {"metadata": {"labels": {zone: f"z2-{h.run_id}"}}})
    cpu = f"aff-cpu-{h.run_id}"
    await h.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": cpu, "labels": {"kubernetes.io/hostname": cpu, zone: f"z2-{h.run_id}"}}})
    try:
        for node in (a, b):
            await h.start_agent(node)
        await h.core.create_namespaced_pod(h.namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "aff-cache", "namespace": h.namespace, "labels": {"app": f"cache-{h.run_id}"}}, "spec": {
            "nodeName": cpu, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})

        async def create(name: str, app: str) -> PodRecord:
            body = h.pod_body(name, "nvidia.com/mig-1g.10gb")
            body["spec"]["affinity"] = {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                           "values": [a.name, b.name, cpu]}]}]}},
                "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": zone, "labelSelector": {"matchLabels": {"app": app}}}]}}
            rec = h.pods[f"{h.namespace}/{name}"] = PodRecord(f"{h.namespace}/{name}", "nvidia.com/mig-1g.10gb",
                                                              time.monotonic())
            await h.core.create_namespaced_pod(h.namespace, body)
            return rec

        near = await create("aff-near", f"cache-{h.run_id}")
        await h.wait_running([near], timeout=90)
        assert near.node == b.name and a.driver.layout(0) == []
        lost = await create("aff-lost", f"nothing-{h.run_id}")
        deadline = time.monotonic() + 30
        while not {"Unplaceable", "SlicePlanned"} & (reasons := {e.reason for e in await h.events_of(lost)}) \
                and time.monotonic() < deadline:
            await asyncio.sleep(1)
        assert "SlicePlanned" not in reasons and "Unplaceable" in reasons, reasons
        assert h.destroy_violations() == []
    finally:
        await h.core.delete_namespaced_pod("aff-cache", h.namespace, grace_period_seconds=0)
        await h.core.delete_node(cpu)


async def test_replicas_that_must_not_share_a_node_are_planned_together_onto_their_own_nodes(harness: Harness):
    """Four replicas with required anti-affinity on the hostname, created together, on four
    one-GPU nodes: the planner plans them in one round, kept apart (one a round before), each
    gets its slice carved on a node of its own, and the kube-scheduler binds each there."""
    h = harness
    nodes = [await h.add_node(f"apart-{i}", H100, "mig", 1) for i in range(4)]
    for node in nodes:
        await h.start_agent(node)
    app = f"apart-{h.run_id}"
    recs = []
    for i in range(4):
        name = f"apart-{i}"
        body = h.pod_body(name, "nvidia.com/mig-1g.10gb")
        body["metadata"]["labels"]["app"] = app
        body["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                       "values": [n.name for n in nodes]}]}]}},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": app}}}]}}
        rec = h.pods[f"{h.namespace}/{name}"] = PodRecord(f"{h.namespace}/{name}", "nvidia.com/mig-1g.10gb",
                                                          time.monotonic())
        await h.core.create_namespaced_pod(h.namespace, body)
        recs.append(rec)
    await h.wait_running(recs, timeout=120)
    assert sorted(r.node or "" for r in recs) == sorted(n.name for n in nodes)
    assert all([p for p, _ in n.driver.layout(0)] == ["1g.10gb"] for n in nodes), "one slice carved on each"
    assert h.destroy_violations() == []
