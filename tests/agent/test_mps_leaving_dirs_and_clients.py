"""The MPS daemon kept on its directories under running clients, stopped when a node leaves MPS mode
without slices, and the MPS server's clients per GPU bounding the slices kept beside a spec's
(helper-115's review)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .conftest import mig_spec, mps_spec
from .test_agent_plugin import PluginRig, _rig


@pytest.fixture
async def mps() -> AsyncIterator[PluginRig]:
    async for r in _rig(mig_enabled=False, count=1):
        yield r


async def test_leaving_mps_mode_stops_the_daemon_when_the_slices_went_before_the_switch(mps: PluginRig):
    """docs/agent.md, Leaving MPS mode: "Once no slice is left, the daemon is stopped". The
    slices went in MPS mode (a plan with none: the GPU whole again); the node is then switched to
    MIG: nothing needs the daemon (nor the MPS server it would start), yet it ran on."""
    rig = mps
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.settle(agent, "m1")
    assert rig.daemon.running
    rig.node_api.set_annotations({**mps_spec({0: []}, plan="m2"), "dynpart.io/spec-gpu-0-40gb": None})
    await rig.settle(agent, "m2")
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p3")})
    await rig.settle(agent, "p3")
    assert rig.driver.devices()[0].mig_current
    assert not rig.daemon.running  # no slice left on a MIG node: stopped


async def test_slices_kept_for_pods_beside_the_specs_do_not_exceed_the_mps_client_bound():
    """An MPS server serves at most 48 clients a GPU (docs/agent.md; catalog mps_max_clients).
    The planner's spec keeps that bound (48 x 1gb), but was made while the 3gb slices of the last
    plan looked free; pods took ten of them meanwhile. The agent keeps the held slices (right) and
    adds the spec's 48 beside them (78 GB fits in 80): 58 slices, of which the 49th pod to start
    CUDA finds no room at the server."""
    from .test_mps_plugin_checks import direct

    _, pods, mps = direct()
    mps.max_slices = 48  # as the agent sets it from its model (H100: mps_max_clients 48)
    await mps.apply({0: [3] * 10})
    for n in range(10):
        pods.assign(f"ns/p{n}", "nvidia.com/gpu-3gb", f"GPU-fake-0000::{n}")
    result = await mps.apply({0: [1] * 48})
    slices = [s for g in result.gpus if g.index == 0 for s in g.mps]
    assert len(slices) <= 48, f"{len(slices)} slices on one GPU"


async def test_an_agent_restarted_with_another_log_directory_does_not_restart_the_daemon_under_its_clients(tmp_path):
    """The daemon outlives the agent (mps-control) so that an upgraded or restarted agent leaves
    the MPS pods' CUDA contexts as they are. A new agent whose MPS log directory differs (another
    default in a new version, a changed setting) asks for the same GPUs with another log_dir:
    the supervisor quits the daemon and starts it again, while a pod holds a slice."""
    from dynpart.agent.driver.fake import FakeNvml
    from dynpart.agent.mps_daemon import ProcessMpsDaemon, SupervisedMpsDaemon
    from dynpart.agent.mps_plugin import MpsPluginAgent
    from dynpart.agent.mps_supervisor import Supervisor
    from dynpart.agent.podresources import FakePodResources

    from .conftest import H100, ROUND_80GIB
    from .test_mps_daemon_busy import FAKE_CONTROL
    from .test_mps_supervisor import Dirs, running
    from .test_nodepods import installed_control

    control = installed_control(tmp_path, FAKE_CONTROL)
    dirs = Dirs(tmp_path)
    try:
        sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=60)
        driver = FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB)
        pods = FakePodResources()
        async with running(sup):
            first = MpsPluginAgent(driver, pods, 80, daemon=SupervisedMpsDaemon(str(dirs.ctl), wait_s=10),
                                   pipe_dir=str(dirs.pipe), log_dir=str(dirs.logs))
            await first.apply({0: [40, 40]})
            assert first.healthy and dirs.daemon_lives()
            pid = dirs.daemon_pid()
            pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")  # its CUDA context is the daemon's
            # the agent is replaced by one whose log directory is another
            second = MpsPluginAgent(driver, pods, 80, daemon=SupervisedMpsDaemon(str(dirs.ctl), wait_s=10),
                                    pipe_dir=str(dirs.pipe), log_dir=str(tmp_path / "log2"))
            await second.apply({0: [40, 40]})
            assert dirs.daemon_pid() == pid, "the daemon was restarted under ns/a"
            assert second.serves("GPU-fake-0000")  # same pipe directory: its slices stay allocatable
            pods.release("ns/a")  # once no pod holds a slice, it moves to the new log directory
            await second.apply({0: [40, 40]})
            assert dirs.daemon_pid() != pid and second.healthy
    finally:
        dirs.kill_daemon()
