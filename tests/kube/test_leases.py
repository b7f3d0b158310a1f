"""Leader election time bounds: a leader whose renewal hangs stops being able to write before a
standby may take the lease over; its term is the lease's leaseTransitions."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from dynpart.kube.errors import APIServerError
from dynpart.kube.leases import LeaderElector
from tests.kube.fakes import FakeResponse


class FakeLeases:
    """One Lease in memory, with optimistic concurrency; `hang` makes every call wait for ever."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.hang = False

    async def _maybe_hang(self) -> None:
        while self.hang:
            await asyncio.sleep(0.01)

    async def read_namespaced_lease(self, name: str, namespace: str, _preload_content: bool = True) -> FakeResponse:
        await self._maybe_hang()
        if self.lease is None:
            return FakeResponse(404, {"kind": "Status", "code": 404}, reason="Not Found")
        return FakeResponse(200, copy.deepcopy(self.lease))

    async def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        await self._maybe_hang()
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}

    async def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        await self._maybe_hang()
        from dynpart.kube.errors import APIConflictError
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise APIConflictError("conflict")
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}


def elector(api: FakeLeases, identity: str) -> LeaderElector:
    return LeaderElector(api, "dynpart-planner", "dynpart-system", identity,  # type: ignore[arg-type]  # a fake API
                         lease_s=3, renew_s=0.2, retry_s=0.1)


async def until_it_writes(a: LeaderElector) -> None:
    for _ in range(100):
        if a.can_write():
            return
        await asyncio.sleep(0.02)


async def test_a_hung_renewal_stops_writes_before_the_lease_may_be_taken_over():
    api = FakeLeases()
    a = elector(api, "a")
    task = asyncio.create_task(a.run())
    try:
        await until_it_writes(a)
        assert a.can_write() and a.term == 0
        api.hang = True  # the API server stops answering this replica
        hung_at = time.monotonic()
        while a.can_write():
            await asyncio.sleep(0.01)
        stopped_after = time.monotonic() - hung_at
        # it stops writing within two thirds of the lease, before anyone may take over (3 s)
        assert stopped_after <= a.margin_s + 0.1, stopped_after
        for _ in range(100):
            if not a.is_leader:
                break
            await asyncio.sleep(0.01)
        assert not a.is_leader, "a leader that cannot renew steps down"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_new_leader_has_a_higher_term():
    api = FakeLeases()
    a, b = elector(api, "a"), elector(api, "b")
    ta = asyncio.create_task(a.run())
    for _ in range(100):
        if a.can_write():
            break
        await asyncio.sleep(0.02)
    tb = asyncio.create_task(b.run())
    try:
        api_lease_before = copy.deepcopy(api.lease)
        ta.cancel()  # a stops and releases the lease
        await asyncio.gather(ta, return_exceptions=True)
        for _ in range(200):
            if b.can_write():
                break
            await asyncio.sleep(0.02)
        assert b.can_write() and not a.can_write()
        assert b.term == a.term + 1 == api_lease_before["spec"]["leaseTransitions"] + 1
    finally:
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)


def held_by_other(api: FakeLeases, renew_time: str) -> None:
    api.version += 1
    api.lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "dynpart-planner", "namespace": "dynpart-system", "resourceVersion": str(api.version)},
                 "spec": {"holderIdentity": "other", "leaseDurationSeconds": 3, "renewTime": renew_time,
                          "acquireTime": renew_time, "leaseTransitions": 4}}


async def test_expiry_is_measured_on_the_standbys_clock_not_the_holders_renew_time():
    """The holder's clock runs an hour behind: its renewTime looks stale, yet it renews. A standby
    takes over only once the record has not changed for the lease's duration on its own
    monotonic clock; a renewTime in the future (a clock ahead) does not keep a dead holder's lease."""
    api, t = FakeLeases(), [100.0]
    b = LeaderElector(api, "dynpart-planner", "dynpart-system", "b", lease_s=3,  # type: ignore[arg-type]  # a fake API
                      clock=lambda: t[0])
    held_by_other(api, "2000-01-01T00:00:00.000000Z")
    assert not await b._try(), "first sight of the record: not expired, however old its renewTime"
    t[0] += 2.0
    held_by_other(api, "2000-01-01T00:00:02.000000Z")  # renewed (by its clock)
    t[0] += 2.0
    assert not await b._try(), "renewed 2 s ago on this clock"
    t[0] += 3.5
    assert await b._try() and api.lease["spec"]["holderIdentity"] == "b"
    assert api.lease["spec"]["leaseTransitions"] == 5
    c = LeaderElector(api, "dynpart-planner", "dynpart-system", "c", lease_s=3,  # type: ignore[arg-type]  # a fake API
                      clock=lambda: t[0])
    held_by_other(api, "2999-01-01T00:00:00.000000Z")  # the holder's clock far ahead, then it died
    assert not await c._try()
    t[0] += 3.5
    assert await c._try() and api.lease["spec"]["holderIdentity"] == "c"


async def test_a_holder_back_with_a_longer_lease_writes_it_and_leads_no_longer_than_the_record_said():
    """A replica that holds the lease under its identity and comes back with a longer lease
    duration (a fixed --identity, a StatefulSet) writes its duration into the record, as client-go
    does, and its first renewal proves leadership only within the duration standbys were timing
    (the record's): else it would write past the moment a standby may take over."""
    api = FakeLeases()
    api.lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "dynpart-planner", "namespace": "dynpart-system", "resourceVersion": "1"},
                 "spec": {"holderIdentity": "a", "leaseDurationSeconds": 3, "leaseTransitions": 4,
                          "renewTime": "2026-01-01T00:00:00.000000Z", "acquireTime": "2026-01-01T00:00:00.000000Z"}}
    a = LeaderElector(api, "dynpart-planner", "dynpart-system", "a",  # type: ignore[arg-type]  # a fake API
                      lease_s=6, renew_s=10, retry_s=0.1)
    before = a.clock()
    task = asyncio.create_task(a.run())
    try:
        await until_it_writes(a)
        assert a.can_write() and a.term == 4
        assert api.lease["spec"]["leaseDurationSeconds"] == 6  # standbys now time 6 s
        # proven for 2/3 of the 3 s the standbys were timing when it renewed, not of its own 6 s
        assert a._valid_until - before <= 3 * 2 / 3 + 0.05, a._valid_until - before
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class FlakyLeases(FakeLeases):
    """Every call takes `latency_s`; the next `fail` updates answer 500 (a transient API server failure)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        super().__init__()
        self.latency_s = latency_s
        self.fail = 0
        self.updates = 0

    async def read_namespaced_lease(self, *args, **kwargs):
        await asyncio.sleep(self.latency_s)
        return await super().read_namespaced_lease(*args, **kwargs)

    async def replace_namespaced_lease(self, name, namespace, body):
        await asyncio.sleep(self.latency_s)
        self.updates += 1
        if self.fail:
            self.fail -= 1
            raise APIServerError("update lease: 500 Internal Server Error", status=500)
        return await super().replace_namespaced_lease(name, namespace, body)


async def test_two_failed_renewals_in_a_row_cost_the_leader_its_writes_and_its_leadership():
    """The production ratios (lease 15 s, renew 4 s, retry 1 s), scaled by 1/5: lease 3 s, renew
    0.8 s, retry 0.2 s; every call takes 30 ms. Two renewals in a row fail (a 500 each, e.g. an
    API server restart behind the load balancer), then the API server answers again. client-go's
    leader retries a failed renewal every RetryPeriod until RenewDeadline, so it renews at the
    third try, 0.2 s later, and never stops leading. dynpart's waits renew_s after a failure too:
    its third try comes 2.4 s after the last success, past the 2 s it can prove it leads, with a
    0.05 s deadline for a GET and a PUT: it stops writing, then steps down (the controller drops
    every plan in flight, `_forget_leader_state`), though nobody else could have taken the lease.
    (Review 93; fails before the fix.)"""
    api = FlakyLeases(latency_s=0.03)
    a = LeaderElector(api, "dynpart-planner", "dynpart-system", "a",  # type: ignore[arg-type]  # a fake API
                      lease_s=3, renew_s=0.8, retry_s=0.2)
    changes: list[bool] = []
    a.on_change = changes.append
    task = asyncio.create_task(a.run())
    try:
        for _ in range(200):
            if a.can_write():
                break
            await asyncio.sleep(0.01)
        assert a.can_write()
        updates = api.updates
        while api.updates == updates:  # just renewed: the next two renewals fail
            await asyncio.sleep(0.005)
        api.fail = 2
        blocked = False
        for _ in range(400):  # 4 s: more than the lease
            blocked |= not a.can_write()
            await asyncio.sleep(0.01)
        assert changes == [True], f"leadership changed {changes} after two transient failures"
        assert not blocked, "writes stopped after two transient renewal failures"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_lease_made_again_keeps_the_term_above_every_term_written():
    """The Lease deleted (a reinstall into a new namespace, `kubectl delete lease`) would restart
    leaseTransitions at 0, below the terms the nodes' specs carry: a deposed leader's late write
    could then not be told from the new leader's. A replica that creates or takes over the lease
    takes the term after the highest one written, and does neither before that is known."""
    api, t = FakeLeases(), [100.0]
    floor: list[int | None] = [None]
    a = LeaderElector(api, "dynpart-planner", "dynpart-system", "a", lease_s=3,  # type: ignore[arg-type]  # a fake API
                      clock=lambda: t[0], term_floor=lambda: floor[0])
    assert not await a._try() and api.lease is None, "the node cache not synced: no lease made"
    floor[0] = 6  # a spec of term 6 on some node
    assert await a._try() and api.lease is not None and api.lease["spec"]["leaseTransitions"] == 7
    floor[0] = -1  # no spec carries a term
    api.lease = None
    assert await a._try() and api.lease["spec"]["leaseTransitions"] == 8  # after the 7 it made
    fresh = LeaderElector(api, "dynpart-planner", "dynpart-system", "f", lease_s=3,  # type: ignore[arg-type]
                          clock=lambda: t[0], term_floor=lambda: floor[0])
    api.lease = None
    assert await fresh._try() and api.lease["spec"]["leaseTransitions"] == 0  # it saw none: 0, as before
    # taken over from a dead holder whose record is at 4 while the nodes carry term 9
    b = LeaderElector(api, "dynpart-planner", "dynpart-system", "b", lease_s=3,  # type: ignore[arg-type]  # a fake API
                      clock=lambda: t[0], term_floor=lambda: floor[0])
    held_by_other(api, "2026-01-01T00:00:00.000000Z")
    floor[0] = 9
    assert not await b._try()
    t[0] += 3.5
    floor[0] = None
    assert not await b._try() and api.lease["spec"]["holderIdentity"] == "other", "floor unknown: not taken over"
    floor[0] = 9
    assert await b._try() and api.lease["spec"]["leaseTransitions"] == 10 and b._term_read == 10
    floor[0] = 2  # below the record: the record's next term, as before
    held_by_other(api, "2026-01-01T00:00:05.000000Z")
    assert not await b._try()
    t[0] += 3.5
    assert await b._try() and api.lease["spec"]["leaseTransitions"] == 5


async def test_a_lease_deleted_under_a_live_leader_is_made_again_above_its_term():
    """`kubectl delete lease` while the leader runs: its term (1) is on no node yet (it has written
    nothing since it took over), so the term after the highest written would be 1 again, and a
    standby making the lease again would lead beside it under the same term while it can still
    write: agents could fence neither. The lease is made again after the last term seen (helper-106's
    case); the leader finding its own lease gone does the same, and so changes term too."""
    api, t = FakeLeases(), [100.0]
    floor = [0]  # the nodes carry term 0 (an earlier leader's)

    def replica(identity: str) -> LeaderElector:
        return LeaderElector(api, "dynpart-planner", "dynpart-system", identity, lease_s=3,  # type: ignore[arg-type]
                             clock=lambda: t[0], term_floor=lambda: floor[0])

    b, a = replica("b"), replica("a")
    assert await b._try() and b._term_read == 1
    assert not await a._try()  # a standby: it saw term 1
    api.lease = None  # kubectl delete lease
    assert await a._try() and api.lease["spec"]["leaseTransitions"] == 2 and a._term_read == 2
    assert not await b._try()  # b's renewal: the lease is a's now (409 on its create, or held)
    api.lease = None
    assert await b._try() and api.lease["spec"]["leaseTransitions"] == 3  # after the 2 it saw
    assert await b._try() and b._term_read == 3  # its renewal keeps it
    api.lease = None
    assert await b._try() and b._term_read == 4, "its own lease gone: made again under a new term"


async def test_a_term_is_never_above_what_agents_read():
    from dynpart.annotations import MAX_TERM

    api = FakeLeases()
    a = LeaderElector(api, "dynpart-planner", "dynpart-system", "a", lease_s=3,  # type: ignore[arg-type]
                      term_floor=lambda: MAX_TERM)  # a hand-edited spec-term on some node
    assert await a._try() and api.lease["spec"]["leaseTransitions"] == MAX_TERM


async def test_a_lease_this_replica_made_counts_as_seen():
    """Made again, then deleted again before this replica read it back: the next one is made after
    the term it made, not after the one before (two replicas could lead under one term)."""
    api, t = FakeLeases(), [100.0]
    a = LeaderElector(api, "dynpart-planner", "dynpart-system", "a", lease_s=3,  # type: ignore[arg-type]
                      clock=lambda: t[0], term_floor=lambda: -1)
    assert await a._try() and a._term_read == 0
    api.lease = None
    assert await a._try() and a._term_read == 1
    api.lease = None
    assert await a._try() and a._term_read == 2
