"""An agent restarted in MPS mode while a pod bound to the node (not yet admitted) counts on a free
slice of the layout it served, the spec changed meanwhile: the restarted agent must not drop that
slice without the bound-pod check a pass of the agent that served it makes
(test_agent_plugin.test_mps_bound_pod_keeps_a_slice)."""

from __future__ import annotations

import shutil
import tempfile

from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.nodepods import FakeNodePods
from tests.agent.kubelet_double import AdmissionError, KubeletDouble

from .conftest import H100, ROUND_80GIB, mps_spec
from .test_agent_plugin import CheckedNodeApi, PluginRig

TWENTY = "nvidia.com/gpu-20gb"


async def test_a_restarted_agent_keeps_the_free_slice_a_bound_pod_needs():
    d = tempfile.mkdtemp(prefix="ap-", dir="/tmp")
    kubelet = KubeletDouble(d)
    await kubelet.start()
    try:
        driver = FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB)
        node_api, node_pods, daemon = CheckedNodeApi(kubelet), FakeNodePods(), FakeMpsDaemon()
        async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:  # the first agent process
            rig = PluginRig(driver, kubelet, plugins, node_api, node_pods, daemon)
            node_api.set_annotations(mps_spec({0: [20, 20]}, plan="m1"))
            await rig.settle(rig.agent(), "m1")
            # the scheduler bound ns/w for a 20gb slice (allocatable 2); the kubelet has not admitted it yet
            node_pods.bind("ns/w", {TWENTY: 1})
        # the agent process ends (its plugin with it); the planner re-plans GPU 0 meanwhile
        node_api.set_annotations({**mps_spec({0: [40, 40]}, plan="m2"), "dynpart.io/spec-gpu-0-20gb": None})
        async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:  # the restarted agent
            rig = PluginRig(driver, kubelet, plugins, node_api, node_pods, daemon)
            report = await rig.agent().reconcile_once()
            assert await plugins.written()  # the kubelet has read the restarted plugin's lists
            # the kubelet now admits ns/w against what the plugin lists (its checkpoint holds no
            # device of ns/w): it needs a free 20gb slice
            try:
                await kubelet.admit("ns/w", TWENTY)
            except AdmissionError:
                pass
            assert kubelet.admission_errors == [], (kubelet.admission_errors, report.errors)
            assert any("kept for pod(s) ns/w" in e for e in report.errors), report.errors
            assert report.plan_id == "m1"  # not m2: the GPU does not hold it while ns/w waits
    finally:
        await kubelet.stop()
        shutil.rmtree(d, ignore_errors=True)
