"""The agent loop: the plan-id handshake, malformed specs reported, failures that change nothing,
waking up on a spec change."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import timedelta

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.podresources import PodResourcesError
from dynpart.annotations import (
    SPEC_MODE,
    SPEC_PLAN,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_MODE,
    STATUS_PLAN,
    annotation_patch,
)
from dynpart.capability import decode_capability
from dynpart.kube.errors import APIError

from .conftest import NOW, Rig, make_rig, mig_spec


async def test_handshake(rig: Rig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    await agent.reconcile_once()
    ann = rig.node_api.annotations
    assert ann[STATUS_PLAN] == "p1" and ann[STATUS_MODE] == "mig"
    assert ann["dynpart.io/status-gpu-0-7g.80gb-free"] == "1@0"
    assert ann[STATUS_HEARTBEAT] == "2025-03-01T09:00:00Z"
    # the planner writes the next plan as one merge patch, removing its stale keys
    new = mig_spec({0: ["3g.40gb@0"], 1: ["1g.10gb@3"]}, plan="p2")
    old_spec = {k: v for k, v in ann.items() if k.startswith("dynpart.io/spec-")}
    rig.node_api.set_annotations(annotation_patch(old_spec, new))
    await agent.reconcile_once()
    ann = rig.node_api.annotations
    assert ann[STATUS_PLAN] == "p2"
    assert "dynpart.io/spec-gpu-0-7g.80gb" not in ann and "dynpart.io/status-gpu-0-7g.80gb-free" not in ann
    assert ann["dynpart.io/status-gpu-0-3g.40gb-free"] == "1@0"
    assert ann["dynpart.io/status-gpu-1-1g.10gb-free"] == "1@3"
    assert rig.driver.layout(0) == [("3g.40gb", 0)] and rig.driver.layout(1) == [("1g.10gb", 3)]


async def test_malformed_spec_is_reported_not_raised(rig: Rig):
    rig.node_api.set_annotations({
        **mig_spec({0: ["3g.40gb@4"]}, plan="p1"),
        "dynpart.io/spec-gpu-0-1g.20gb": "1@5",         # illegal start
        "dynpart.io/spec-gpu-x-1g.10gb": "1@0",          # bad index
        "dynpart.io/spec-gpu-1-1g.10gb": "two@0",        # bad count
        "dynpart.io/spec-gpu-9-7g.80gb": "1@0",          # no such GPU on the node
        "dynpart.io/spec-gpu-1-9g.99gb": "1@0",          # unknown profile
    })
    rig.carve(0, "1g.10gb@0")  # a free instance the malformed spec does not mention
    report = await rig.agent().reconcile_once()
    # refused whole: applying the rest would have destroyed GPU 0's free 1g.10gb and carved 3g.40gb
    assert rig.driver.ops == [] and rig.driver.layout(0) == [("1g.10gb", 0)]
    errors = rig.node_api.annotations[STATUS_ERROR].split("\n")
    assert len(errors) == 5 and errors == report.errors
    for needle in ("'dynpart.io/spec-gpu-0-1g.20gb' = '1@5'", "GPU index 'x'", "count 'two'",
                   "no MIG profile '9g.99gb'", "spec p1 refused: nothing applied until it is well-formed"):
        assert any(needle in e for e in errors), needle
    assert STATUS_PLAN not in rig.node_api.annotations


async def test_unsafe_observation_changes_nothing(rig: Rig):
    rig.carve(0, "1g.10gb@0")
    agent = rig.agent()
    await agent.reconcile_once()
    before = dict(rig.node_api.annotations)

    async def broken_list():
        raise PodResourcesError("kubelet PodResources API at /x: UNAVAILABLE: connection refused")

    rig.pods.list = broken_list  # type: ignore[method-assign]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p5"))
    report = await agent.reconcile_once()
    assert rig.driver.ops == []
    assert report.errors == ["kubelet PodResources API at /x: UNAVAILABLE: connection refused"]
    ann = rig.node_api.annotations
    assert ann["dynpart.io/status-gpu-0-1g.10gb-free"] == before["dynpart.io/status-gpu-0-1g.10gb-free"]
    assert STATUS_PLAN not in ann and "UNAVAILABLE" in ann[STATUS_ERROR]


async def test_a_gpu_the_catalog_lacks_is_described_by_the_driver(rig: Rig):
    """The catalog does not know the product: the agent plans with, and reports, what NVML says."""
    rig.driver.name = "NVIDIA Mystery 9000"
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@4"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.errors == [] and rig.driver.layout(0) == [("3g.40gb", 4)]
    model = await agent.model()
    assert model.family_name == "Mystery-9000" and model.name.startswith("Mystery-9000~")
    cap = decode_capability(rig.node_api.annotations[STATUS_CAPABILITY])
    assert cap.kinds[0].product == "NVIDIA Mystery 9000" and len(cap.gpus) == 2
    assert {p.name for p in cap.kinds[0].profiles} == set(model.profiles_by_name)


async def test_mixed_gpus_on_one_node_are_reported_and_nothing_changes(rig: Rig):
    real = rig.driver.devices
    rig.driver.devices = lambda: [d if d.index == 0 else dataclasses.replace(d, name="NVIDIA Other")  # type: ignore[method-assign]  # one GPU of another product
                                  for d in real()]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    report = await rig.agent().reconcile_once()
    assert "GPUs are of 2 kinds" in report.errors[0] and rig.driver.ops == []


async def test_status_not_rewritten_when_unchanged(rig: Rig):
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}))
    await agent.reconcile_once()
    n = len(rig.events)
    await agent.reconcile_once()  # same clock, same state: nothing to patch
    assert len(rig.events) == n


async def test_run_wakes_on_spec_change(rig: Rig):
    agent = rig.agent(interval_s=60)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))

    async def until(predicate):
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    await until(lambda: STATUS_MODE in rig.node_api.annotations)  # the first pass
    rig.node_api.set_annotations(mig_spec({0: ["4g.40gb@0"]}, plan="w1"))
    await until(lambda: rig.node_api.annotations.get(STATUS_PLAN) == "w1")
    assert rig.driver.layout(0) == [("4g.40gb", 0)]
    rig.node_api.set_annotations({SPEC_PLAN: "w2", SPEC_MODE: "mig", "dynpart.io/spec-gpu-0-4g.40gb": None})
    await until(lambda: rig.node_api.annotations.get(STATUS_PLAN) == "w2")
    assert rig.driver.layout(0) == []
    stop.set()
    await asyncio.wait_for(task, 2)


async def test_run_survives_a_failing_pass():
    rig = make_rig()
    agent = rig.agent(interval_s=0.01)
    calls = 0
    real = agent.reconcile_once

    async def flaky():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return await real()

    agent.reconcile_once = flaky  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    for _ in range(200):
        if STATUS_MODE in rig.node_api.annotations:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 2)
    assert calls >= 2 and STATUS_MODE in rig.node_api.annotations


async def test_events_on_the_node_once_per_message(rig: Rig):
    agent = rig.agent()
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p1"), "dynpart.io/spec-gpu-0-1g.20gb": "1@5"})
    await agent.reconcile_once()
    await agent.reconcile_once()  # the next pass says nothing new
    events = [e for kind, e in rig.node_api.events if kind == "event"]
    reasons = [r for r, _, _ in events]
    assert reasons.count("DynpartInvalidSpec") == 1 and reasons.count("LayoutApplied") == 0
    invalid = next(e for e in events if e[0] == "DynpartInvalidSpec")
    assert "'dynpart.io/spec-gpu-0-1g.20gb' = '1@5'" in invalid[1] and invalid[2] is True


async def test_a_spec_from_a_deposed_planner_is_ignored(rig: Rig):
    """Fencing: the planner's lease is at term 2; a plan written under term 1 arrives late."""
    lease_term = 2

    async def current_term() -> int:
        return lease_term

    agent = rig.agent(leader_term=current_term)
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="old"), "dynpart.io/spec-term": "1"})
    report = await agent.reconcile_once()
    assert rig.driver.ops == [] and STATUS_PLAN not in rig.node_api.annotations
    assert "written by a deposed planner (term 1; the planner's lease is at term 2)" in report.errors[0]
    old = {k: v for k, v in rig.node_api.annotations.items() if k.startswith("dynpart.io/spec-")}
    rig.node_api.set_annotations(annotation_patch(old, {**mig_spec({0: ["3g.40gb@4"]}, plan="new"),
                                                        "dynpart.io/spec-term": "2"}))
    report = await agent.reconcile_once()
    assert report.errors == [] and rig.node_api.annotations[STATUS_PLAN] == "new"
    assert rig.driver.layout(0) == [("3g.40gb", 4)]


async def test_a_lease_that_cannot_be_read_now_stops_the_pass_not_the_fencing(rig: Rig):
    """A time-out or a 5xx on the Lease: the agent cannot tell whether the spec's writer still
    leads, so it applies nothing this pass (it used to apply it, unfenced). No Lease (404) or no
    right to read it (403) still means no fencing."""
    answers: list[int | None] = [503, None]

    async def current_term() -> int:
        status = answers.pop(0)
        if status is not None:
            raise APIError("read lease dynpart-system/dynpart-planner: 503 Service Unavailable", status=status)
        return 1

    agent = rig.agent(leader_term=current_term)
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p1"), "dynpart.io/spec-term": "1"})
    report = await agent.reconcile_once()
    assert report.failed and rig.driver.ops == [] and STATUS_PLAN not in rig.node_api.annotations
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and rig.driver.layout(0) == [("7g.80gb", 0)]
    await agent.reconcile_once()
    assert answers == []  # a plan let through is not checked again while it waits or once applied


async def test_the_lease_reader_fences_nothing_only_without_a_lease_or_the_right_to_read_it(monkeypatch):
    from dynpart.agent import kube

    class Coordination:
        status = 404

        def __init__(self, api: object):
            pass

        async def read_namespaced_lease(self, name: str, namespace: str, **kw: object) -> object:
            raise ApiException(status=Coordination.status, reason="x")

    monkeypatch.setattr(kube.client, "CoordinationV1Api", Coordination)
    read = kube.lease_term_reader(object(), "dynpart-planner", "dynpart-system")  # type: ignore[arg-type]
    for status in (404, 403):
        Coordination.status = status
        assert await read() is None
    for status in (500, 503, 429):
        Coordination.status = status
        with pytest.raises(APIError):
            await read()



async def test_an_idle_node_moves_its_heartbeat_once_per_heartbeat_interval():
    """Passes every interval on an idle node write nothing but the heartbeat, and that at most once
    per heartbeat_s: at 1,000 nodes a write per pass would be 100 Node writes a second."""
    rig = make_rig()
    clock = [NOW]
    agent = rig.agent(interval_s=0.01, heartbeat_s=300)
    agent.now = lambda: clock[0]
    await agent.reconcile_once()
    writes = len([e for kind, e in rig.node_api.events if kind == "annotations"])
    for _ in range(5):
        clock[0] += timedelta(seconds=30)
        await agent.reconcile_once()
    assert len([e for kind, e in rig.node_api.events if kind == "annotations"]) == writes
    agent._heartbeat_at -= 300  # (as if 300 s had passed)
    await agent.reconcile_once()
    assert len([e for kind, e in rig.node_api.events if kind == "annotations"]) == writes + 1


async def test_a_waiting_plan_reads_the_lease_once_and_rewrites_its_heartbeat_once_per_interval():
    """A plan that waits (here for a pod to leave the instance in its way) is looked at every
    retry_s: the Lease is read once for it, and a Node write that would only move the heartbeat
    happens once per interval, not every pass (each write reaches every Node watcher)."""
    reads = []

    async def current_term() -> int:
        reads.append(1)
        return 1

    rig = make_rig().with_plugins()  # acknowledges only what the GPUs hold
    gi = rig.carve(0, "1g.10gb@0")["1g.10gb@0"]
    rig.run_pod("ns/a", 0, gi)
    clock = [NOW]
    agent = rig.agent(leader_term=current_term, interval_s=3600)
    agent.now = lambda: clock[0]
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p1"), "dynpart.io/spec-term": "1"})
    await agent.reconcile_once()
    writes = [e for kind, e in rig.node_api.events if kind == "annotations"]
    for _ in range(5):
        clock[0] += timedelta(seconds=1)
        report = await agent.reconcile_once()
    assert report.plan_id is None and any("1g.10gb@0" in e for e in report.errors), report.errors
    assert len(reads) == 1
    assert [e for kind, e in rig.node_api.events if kind == "annotations"] == writes


async def test_a_plan_that_keeps_waiting_for_the_same_thing_is_looked_at_less_often_and_said_once(caplog):
    """While a plan waits for the same things pass after pass (here a pod holding the instance in
    its way), the wait before the next pass doubles from retry_s up to retry_max_s (2 s: the
    planner gives up on an acknowledgement after 60 s), and after long_wait_s of the same wait up
    to the interval; the problem is logged once at WARNING (then at DEBUG); what it waits for
    changing starts again."""
    rig = make_rig().with_plugins()
    gi = rig.carve(0, "1g.10gb@0")["1g.10gb@0"]
    pid = rig.run_pod("ns/a", 0, gi)
    agent = rig.agent(interval_s=4.0, retry_s=0.5)
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    delays = []
    with caplog.at_level(logging.DEBUG, logger="dynpart.agent"):
        for _ in range(6):
            report = await agent.reconcile_once()
            delays.append(agent._retry_delay)
    assert report.waiting
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    agent._waiting_since -= agent.long_wait_s  # (as if two minutes had passed)
    await agent.reconcile_once()
    assert agent._retry_delay == 4.0
    # a new plan waiting for the same reasons is a new wait
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2"))
    await agent.reconcile_once()
    assert agent._retry_delay == 0.5
    said = [r for r in caplog.records if "1g.10gb@0" in r.getMessage() and "not acknowledged" in r.getMessage()]
    assert [r.levelno for r in said][:6] == [logging.WARNING] + [logging.DEBUG] * 5
    # the pod leaves: the plan is applied; a new wait starts from retry_s again
    rig.stop_pod("ns/a", pid)
    report = await agent.reconcile_once()
    assert not report.failed and agent._retry_delay == 0.5


async def test_run_waits_the_doubled_delay_between_passes_of_a_waiting_plan():
    """`run` itself waits what `_retry_delay` says (not retry_s every time) while a plan waits."""
    rig = make_rig().with_plugins()
    gi = rig.carve(0, "1g.10gb@0")["1g.10gb@0"]
    rig.run_pod("ns/a", 0, gi)
    agent = rig.agent(interval_s=30.0, retry_s=0.05)
    agent.retry_max_s = 0.2
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    passes = []
    once = agent.reconcile_once

    async def counted():
        passes.append(1)
        return await once()

    agent.reconcile_once = counted  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.wait_for(task, 10)
    # 0.05, 0.1, then 0.2 s: about 9 passes in 1.5 s (every 0.05 s: about 30)
    assert 4 <= len(passes) <= 14, len(passes)


async def test_devices_that_cannot_be_served_are_said_once_at_error(caplog):
    """A failure to serve the devices (here the kubelet's PodResources unreachable) is logged once,
    at ERROR, when it appears (not also at WARNING with the pass's other problems), then at DEBUG
    while it lasts; the status names it every pass."""
    rig = make_rig().with_plugins()

    def unreachable() -> dict[str, list[str]]:
        raise PodResourcesError("the kubelet's PodResources socket is not there")

    rig.pods.on_allocatable = unreachable
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    with caplog.at_level(logging.DEBUG, logger="dynpart.agent"):
        for _ in range(3):
            report = await agent.reconcile_once()
            assert any("serving the devices" in e and "PodResources" in e for e in report.errors), report.errors
    said = [r.levelno for r in caplog.records if "serving the devices" in r.getMessage()]
    assert said == [logging.ERROR, logging.DEBUG, logging.DEBUG]
