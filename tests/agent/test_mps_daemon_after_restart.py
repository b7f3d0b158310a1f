"""An agent restarted after its MPS slices went stops the daemon left running when the node leaves MPS
mode (helper-121's review)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynpart.agent.mps_daemon import FakeMpsDaemon

from .conftest import mig_spec, mps_spec
from .test_agent_plugin import PluginRig, _rig


class OutlivingDaemon(FakeMpsDaemon):
    """As the mps-control supervisor's daemon: it outlives the agent, and a restarted agent reads
    what it runs for (SupervisedMpsDaemon.running_for / running_dirs)."""

    def running_for(self) -> list[str] | None:
        return list(self.gpus) if self.running else None

    def running_dirs(self) -> tuple[str, str] | None:
        return self.dirs if self.running else None


@pytest.fixture
async def mps() -> AsyncIterator[PluginRig]:
    async for r in _rig(mig_enabled=False, count=1):
        r.daemon = OutlivingDaemon()
        yield r


async def test_an_agent_restarted_after_the_slices_went_stops_the_daemon_when_the_node_leaves_mps(mps: PluginRig):
    """The slices go in MPS mode (the daemon is kept running for the node's GPUs), the agent is
    restarted (the daemon runs on in mps-control), then the node is switched to MIG: no pod holds
    a slice, nothing needs the daemon, as in the test without the restart (docs/agent.md)."""
    rig = mps
    first = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await rig.settle(first, "m1")
    rig.node_api.set_annotations({**mps_spec({0: []}, plan="m2"), "dynpart.io/spec-gpu-0-40gb": None})
    await rig.settle(first, "m2")
    assert rig.daemon.running  # kept in MPS mode
    second = rig.agent()  # restarted: the daemon outlives it
    await second.reconcile_once()
    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p3")})
    await rig.settle(second, "p3")
    assert rig.driver.devices()[0].mig_current
    assert not rig.daemon.running, "the MPS daemon runs on on a MIG node with no slice"
