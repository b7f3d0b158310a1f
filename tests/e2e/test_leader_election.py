"""Two planner replicas on the local control plane: one holds the Lease and plans; killed (kill -9)
in the middle of a handshake, the other takes over within the lease duration, never writes a node
whose plan is still unacknowledged, and the pods submitted after the kill run."""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes_asyncio import client

from dynpart.kube.conventions import SPEC_PLAN, STATUS_PLAN
from tests.e2e import harness as _h

pytestmark = pytest.mark.e2e

LEASE_S = 6  # DYNPART_PLANNER_LEASE_DURATION_S (default 15)
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"



@pytest.fixture
async def two_planners(e2e_cluster, tmp_path):
    env = {"DYNPART_PLANNER_LEASE_DURATION_S": str(LEASE_S), "DYNPART_PLANNER_LEASE_RENEW_S": "2"}
    h = _h.Harness(e2e_cluster.kubeconfig)
    await h.start()  # creates dynpart-system, where the Lease lives
    h.planners = [_h.PlannerProcess(e2e_cluster.kubeconfig, tmp_path / f"planner-{x}.log", f"planner-{x}", env).start()
                  for x in ("a", "b")]
    try:
        yield h
    finally:
        for p in h.planners:
            p.stop()
        await h.close()
        for p in h.planners:  # shown on failure
            print(f"--- planner {p.identity} log ---\n{p.log_tail(80)}")


async def test_one_leader_plans_and_a_standby_takes_over(two_planners):
    h = two_planners
    leases = client.CoordinationV1Api(h.api)

    async def holder() -> str | None:
        try:
            lease = await leases.read_namespaced_lease("dynpart-planner", _h.SYSTEM_NAMESPACE)
        except client.ApiException:
            return None
        return lease.spec.holder_identity

    n1 = await h.add_node("le-h100", H100, "mig", 2)
    n2 = await h.add_node("le-a100", A100, "mig", 2)
    agent1 = await h.start_agent(n1)
    await h.start_agent(n2)
    by_id = {p.identity: p for p in h.planners}
    first = await _h.wait_until(holder, 60, "a planner to hold the lease")
    leader = by_id[first]
    standby = next(p for p in h.planners if p is not leader)
    await leader.wait_log(r"acquired leadership")
    await standby.wait_log(r"caches synced")

    p1 = await h.create_pod("le-1", "nvidia.com/mig-1g.10gb", node=n1)
    await h.wait_running([p1])
    assert leader.plans() >= 1 and standby.plans() == 0, "only the lease holder plans"
    assert standby.count("acquired leadership") == 0 and await holder() == leader.identity
    leading = [(await asyncio.to_thread(_h.scrape, p.metrics_port))["dynpart_leader"] for p in (leader, standby)]
    assert leading == [1.0, 0.0]

    # Leave a plan unacknowledged on n1 (its agent is down), then kill the leader.
    await agent1.shutdown()
    del h.agents[n1.name]
    p2 = await h.create_pod("le-2", "nvidia.com/mig-2g.20gb", node=n1)

    def unacknowledged():
        ann = h.history[n1.name][-1]
        return ann.get(SPEC_PLAN) != ann.get(STATUS_PLAN) and ann.get(SPEC_PLAN)
    pending_plan = await _h.wait_until(unacknowledged, 30, "a plan written to n1", describe=h.describe)
    killed_at = time.monotonic()
    leader.kill()
    p3 = await h.create_pod("le-3", "nvidia.com/mig-3g.40gb", node=n1)  # must wait for n1's acknowledgement
    p4 = await h.create_pod("le-4", "nvidia.com/mig-3g.40gb", node=n2)  # runs through the new leader

    await _h.wait_until(lambda: _is(holder(), standby.identity), LEASE_S + 20, "the standby to take the lease")
    took_over_s = time.monotonic() - killed_at
    await standby.wait_log(r"dynpart\.planner: planned ", timeout=30)
    first_plan_s = time.monotonic() - killed_at
    await h.wait_running([p4], timeout=60)
    p4_s = time.monotonic() - killed_at
    print(f"\nhandover: lease taken {took_over_s:.2f} s after kill -9 (lease {LEASE_S} s), first plan after "
          f"{first_plan_s:.2f} s, pod submitted after the kill Running after {p4_s:.2f} s")
    assert took_over_s <= LEASE_S + 3
    assert (await asyncio.to_thread(_h.scrape, standby.metrics_port))["dynpart_leader"] == 1.0
    assert h.history[n1.name][-1].get(SPEC_PLAN) == pending_plan, "n1's unacknowledged plan was overwritten"
    assert p2.running_at is None and p3.running_at is None

    # n1's agent comes back: it acknowledges the old plan, then the new leader plans n1 again.
    await h.start_agent(n1)
    await h.wait_running([p2, p3], timeout=60)
    specs_n1 = [a.get(SPEC_PLAN) for a in h.history[n1.name] if a.get(SPEC_PLAN)]
    assert specs_n1[-1] != pending_plan, "the new leader planned n1 after its acknowledgement"
    assert h.handshake_violations() == []
    assert h.destroy_violations() == []


async def _is(coro, value) -> bool:
    return await coro == value
