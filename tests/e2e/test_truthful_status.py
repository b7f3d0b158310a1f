"""A plan the node cannot hold is not acknowledged, on the real API server and scheduler: the only
GPU of a MIG node has its MIG mode pending until a GPU reset (as under some hypervisors). The
agent does not acknowledge the plan; the planner revokes it after its ack time-out, tells the pod
why, leaves the GPU out while its agent reports the reset pending, and writes that node at most
once per back-off period (here the ack time-out, 4 s)."""

from __future__ import annotations

import asyncio

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.kube.conventions import SPEC_PLAN, STATUS_PLAN
from tests.e2e.harness import Harness, PlannerProcess, SimNode, module_planner, wait_until

pytestmark = pytest.mark.e2e
ACK_TIMEOUT_S = 4.0


def needs_reset(node: SimNode) -> None:
    node.driver = FakeNvml(node.model, node.count, mig_enabled=False, mode_needs_reset=True)
    node.driver.before_op = node._before_op


@pytest.fixture(scope="module")
def planner(e2e_cluster, tmp_path_factory):
    yield from module_planner(e2e_cluster, tmp_path_factory, "planner-truthful",
                              env={"DYNPART_PLANNER_ACK_TIMEOUT_S": str(ACK_TIMEOUT_S)})


async def test_a_plan_that_needs_a_gpu_reset_is_not_acknowledged(e2e_cluster, planner: PlannerProcess):
    await planner.wait_log(r"acquired leadership", timeout=60)
    h = Harness(e2e_cluster.kubeconfig, planners=[planner])
    await h.start()
    try:
        stuck = await h.add_node("reset", "H100-80GB", "mig", 1, prepare=needs_reset)
        await h.start_agent(stuck)
        rec = await h.create_pod("waits-for-reset", "nvidia.com/mig-3g.40gb", node=stuck)

        async def not_applied():
            return [e for e in await h.events_of(rec) if e.reason == "PlanNotApplied"]
        events = await wait_until(not_applied, 30 + ACK_TIMEOUT_S, "a PlanNotApplied Event on the pod", interval=0.3)
        assert "pending until the GPU is reset" in events[0].message, events[0].message
        await asyncio.sleep(4 * ACK_TIMEOUT_S)  # the planner keeps its hands off the node
        specs = [a.get(SPEC_PLAN) for a in h.history[stuck.name]]
        written = [p for i, p in enumerate(specs) if p and p != (specs[i - 1] if i else None)]
        acked = {a.get(STATUS_PLAN) for a in h.history[stuck.name]}
        # the first plan (never acknowledged) and its revocation (acknowledged): nothing more
        assert len(written) == 2 and written[0] not in acked and written[1] in acked, (written, acked)
        assert rec.running_at is None and stuck.driver.layout(0) == []

        async def unplaceable():
            return [e for e in await h.events_of(rec) if e.reason == "Unplaceable"]
        await wait_until(unplaceable, 20, "an Unplaceable Event once the GPU is left out", interval=0.3)
        assert h.destroy_violations() == []
    finally:
        await h.close()
