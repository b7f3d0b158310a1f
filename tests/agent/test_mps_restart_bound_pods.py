"""An agent restarted while a pod bound to the node (not yet admitted) counts on a free MPS slice of
the layout it served, the spec changed meanwhile: the restarted agent must not drop that slice
without the bound-pod check a pass of the agent that served it makes
(test_agent_plugin.test_mps_bound_pod_keeps_a_slice), whether its first pass applies an MPS spec,
only observes (a deposed planner's spec), or leaves MPS for MIG (helper-140, helper-143)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable

from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.loop import Agent, PassReport
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.nodepods import FakeNodePods
from tests.agent.kubelet_double import AdmissionError, KubeletDouble

from .conftest import H100, ROUND_80GIB, mig_spec, mps_spec
from .test_agent_plugin import CheckedNodeApi, PluginRig

TWENTY = "nvidia.com/gpu-20gb"
GONE_20GB = {"dynpart.io/spec-gpu-0-20gb": None}


async def _bound_pod_admitted(second_spec: dict[str, str | None], restart: bool = True,
                              leader_term: Callable[[], Awaitable[int]] | None = None,
                              then: Callable[[], None] = lambda: None) -> tuple[list, PassReport]:
    """GPU 0 serves two 20gb slices (plan m1), the scheduler binds ns/w for one, `second_spec` is
    written and `then` called (while the agent is down, with `restart`), one pass runs, then the
    kubelet admits ns/w against what the plugin lists (its checkpoint holds no device of ns/w). The
    kubelet's admission errors and the pass's report."""
    d = tempfile.mkdtemp(prefix="ap-", dir="/tmp")
    kubelet = KubeletDouble(d)
    await kubelet.start()
    extra = {} if leader_term is None else {"leader_term": leader_term}
    driver = FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB)
    node_api, node_pods, daemon = CheckedNodeApi(kubelet), FakeNodePods(), FakeMpsDaemon()

    async def admitted_after_pass(plugins: DevicePluginManager, agent: Agent) -> tuple[list, PassReport]:
        report = await agent.reconcile_once()
        assert await plugins.written()  # the kubelet has read the plugin's lists
        try:
            await kubelet.admit("ns/w", TWENTY)
        except AdmissionError:
            pass
        return kubelet.admission_errors, report

    try:
        async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:  # the first agent process
            rig = PluginRig(driver, kubelet, plugins, node_api, node_pods, daemon)
            agent = rig.agent(**extra)
            node_api.set_annotations(mps_spec({0: [20, 20]}, plan="m1", term=None if leader_term is None else 1))
            await rig.settle(agent, "m1")
            node_pods.bind("ns/w", {TWENTY: 1})  # allocatable 2; not admitted yet
            if not restart:
                node_api.set_annotations(second_spec)
                then()
                return await admitted_after_pass(plugins, agent)
        node_api.set_annotations(second_spec)  # the agent process ended (its plugin with it)
        then()
        async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:  # the restarted agent
            rig = PluginRig(driver, kubelet, plugins, node_api, node_pods, daemon)
            return await admitted_after_pass(plugins, rig.agent(**extra))
    finally:
        await kubelet.stop()
        shutil.rmtree(d, ignore_errors=True)


async def test_a_restarted_agent_keeps_the_free_slice_a_bound_pod_needs():
    # the planner re-planned GPU 0 while no agent ran
    errors, report = await _bound_pod_admitted({**mps_spec({0: [40, 40]}, plan="m2"), **GONE_20GB})
    assert errors == [], (errors, report.errors)
    assert any("kept for pod(s) ns/w" in e for e in report.errors), report.errors
    assert report.plan_id == "m1"  # not m2: the GPU does not hold it while ns/w waits


async def test_a_restarted_agent_observing_only_keeps_listing_the_free_slices_it_served():
    # m2 was written by the leader of term 1, deposed since; the new leader has not adopted it
    term = {"now": 1}

    async def leader_term() -> int:
        return term["now"]

    errors, report = await _bound_pod_admitted({**mps_spec({0: [40, 40]}, plan="m2", term=1), **GONE_20GB},
                                               leader_term=leader_term, then=lambda: term.update(now=2))
    assert any("deposed planner" in e for e in report.errors), report.errors  # observe only
    assert errors == [], (errors, report.errors)


async def test_an_agent_leaving_mps_keeps_the_slice_a_bound_pod_needs_restarted_or_not():
    # the node was relabelled mig: the planner's switching spec (mode mig, no slices)
    for restart in (False, True):
        errors, report = await _bound_pod_admitted({**mig_spec({}, plan="s1"), **GONE_20GB}, restart=restart)
        assert errors == [], (restart, errors, report.errors)
