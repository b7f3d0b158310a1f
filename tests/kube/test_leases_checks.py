"""Leader election checks a real cluster depends on: who may write when, takeover timing, release
on stop, terms. The Lease API here is faithful where it matters: a Lease is found by its name,
a create of one that exists answers 409 (AlreadyExists), and a write carrying a stale
resourceVersion answers 409 (Conflict)."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from dynpart.kube.errors import APIConflictError
from dynpart.kube.leases import LeaderElector
from tests.kube.fakes import FakeResponse
from tests.kube.test_leases import FakeLeases, FlakyLeases, until_it_writes

NAME, NAMESPACE = "dynpart-planner", "dynpart-system"


class Leases:
    """Leases by name, every call answered after `latency_s` (so that two replicas' calls interleave)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.latency_s = latency_s

    @property
    def lease(self) -> dict[str, Any] | None:
        return self.leases.get(NAME)

    async def read_namespaced_lease(self, name: str, namespace: str, _preload_content: bool = True) -> FakeResponse:
        await asyncio.sleep(self.latency_s)
        if name not in self.leases:
            return FakeResponse(404, {"kind": "Status", "code": 404}, reason="Not Found")
        return FakeResponse(200, copy.deepcopy(self.leases[name]))

    async def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        await asyncio.sleep(self.latency_s)
        name = body["metadata"].get("name")
        assert name, "422: metadata.name: Required value"
        if name in self.leases:
            raise APIConflictError(f'leases "{name}" already exists')
        self.version += 1
        self.leases[name] = {**copy.deepcopy(body),
                             "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}

    async def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        await asyncio.sleep(self.latency_s)
        if body["metadata"].get("resourceVersion") != self.leases[name]["metadata"]["resourceVersion"]:
            raise APIConflictError("the object has been modified")
        self.version += 1
        self.leases[name] = {**copy.deepcopy(body),
                             "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}


def held_by_other(api: Leases, **spec: Any) -> None:
    """The lease as a replica "other" holds it at term 4 with a 3 s lease; `spec` changes that."""
    api.version += 1
    lease_spec = {"holderIdentity": "other", "leaseDurationSeconds": 3, "renewTime": "2026-01-01T00:00:00.000000Z",
                  "acquireTime": "2026-01-01T00:00:00.000000Z", "leaseTransitions": 4, **spec}
    api.leases[NAME] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": NAME, "namespace": NAMESPACE, "resourceVersion": str(api.version)},
                        "spec": {k: v for k, v in lease_spec.items() if v is not ...}}


def replica(api: object, identity: str, t: list[float] | None = None, lease_s: int = 3, **kw: Any) -> LeaderElector:
    if t is not None:
        kw["clock"] = lambda: t[0]
    return LeaderElector(api, NAME, NAMESPACE, identity, lease_s=lease_s, **kw)  # type: ignore[arg-type]  # a fake API


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_standby_does_not_take_a_lease_its_holder_renews():
    """The holder's renewals change the record (its renewTime): a standby timing the record on its
    own clock never sees it unchanged for the lease's duration while they go on; once they stop,
    it takes over after the duration, under the next term."""
    api, t = Leases(), [100.0]
    a, b = replica(api, "a", t), replica(api, "b", t)
    assert await a._try() and a._term_read == 0
    assert not await b._try()
    for _ in range(4):  # 8 s of renewals every 2 s, more than twice the 3 s lease
        t[0] += 2.0
        assert await a._try()
        t[0] += 0.001
        assert not await b._try(), "b took over a lease its holder renews"
    t[0] += 3.5  # a died
    assert await b._try() and api.lease["spec"]["holderIdentity"] == "b" and b._term_read == 1


async def test_a_stopped_leader_releases_the_lease_and_a_standby_takes_it_at_once():
    """A clean stop (a rolling update) releases the lease: a standby takes it over at its next
    attempt, without waiting out the lease, under the next term."""
    api, t = Leases(), [100.0]
    changes: list[bool] = []
    a = replica(api, "a", renew_s=0.05, retry_s=0.05, on_change=changes.append)
    task = asyncio.create_task(a.run())
    await until_it_writes(a)
    assert a.can_write()
    b = replica(api, "b", t)
    assert not await b._try()  # a standby that saw a's record
    await stop(task)
    assert changes == [True, False] and not a.can_write() and not a.is_leader
    assert not api.lease["spec"].get("holderIdentity"), "the lease is released on a clean stop"
    # the standby's clock has not moved: the lease is free, not expired
    assert await b._try() and api.lease["spec"]["holderIdentity"] == "b"
    assert b._term_read == a.term + 1


async def test_of_two_replicas_making_the_lease_at_once_one_leads():
    """Both read 404 and create the lease: the later create answers 409 (AlreadyExists), and that
    replica is a standby."""
    api = Leases(latency_s=0.01)
    a, b = replica(api, "a", term_floor=lambda: -1), replica(api, "b", term_floor=lambda: -1)
    won = await asyncio.gather(a._try(), b._try())
    assert [bool(w) for w in won].count(True) == 1, won
    winner = "a" if won[0] else "b"
    assert api.lease["spec"]["holderIdentity"] == winner
    loser = b if won[0] else a
    assert not await loser._try(), "the loser sees the winner's fresh lease"


async def test_of_two_standbys_taking_a_released_lease_at_once_one_leads():
    """Both read the released lease and write it: the later write carries a stale resourceVersion,
    answers 409, and that replica is a standby."""
    api, t = Leases(latency_s=0.01), [100.0]
    held_by_other(api, holderIdentity=None, renewTime=None)  # released
    a, b = replica(api, "a", t), replica(api, "b", t)
    won = await asyncio.gather(a._try(), b._try())
    assert [bool(w) for w in won].count(True) == 1, won
    assert api.lease["spec"]["holderIdentity"] == ("a" if won[0] else "b")
    assert api.lease["spec"]["leaseTransitions"] == 5


async def test_a_created_lease_carries_its_makers_duration_and_standbys_time_that():
    """The holder's lease (6 s) is in the record it makes: a standby configured with 3 s times the
    holder's 6 s, else it would take over while the holder can still write (4 s, 2/3 of 6)."""
    api, t = Leases(), [100.0]
    a, b = replica(api, "a", t, lease_s=6), replica(api, "b", t, lease_s=3)
    assert await a._try() and api.lease["spec"]["leaseDurationSeconds"] == 6
    assert not await b._try()
    t[0] += 4.5
    assert not await b._try(), "taken over after 4.5 s of a 6 s lease"
    t[0] += 2.0
    assert await b._try() and api.lease["spec"]["holderIdentity"] == "b"


async def test_a_lease_record_without_a_duration_is_timed_by_the_standbys_own():
    """leaseDurationSeconds is optional in the Lease API (a Lease made by hand): a standby times
    such a record by its own lease and takes it over once its holder is gone."""
    api, t = Leases(), [100.0]
    held_by_other(api, leaseDurationSeconds=...)  # no duration
    b = replica(api, "b", t)
    assert not await b._try()
    t[0] += 2.0
    assert not await b._try()
    t[0] += 1.5
    assert await b._try() and api.lease["spec"]["holderIdentity"] == "b" and b._term_read == 5
    assert api.lease["spec"]["leaseDurationSeconds"] == 3
    assert await b._try() and b._term_read == 5, "its renewal"


async def test_a_leader_of_term_0_keeps_term_0_when_it_renews():
    """The first lease ever made has term 0; its holder's renewals keep that term (the one the
    lease says, and the next leader's is 1): a renewal must not move it."""
    api = Leases()
    a = replica(api, "a", renew_s=0.02, retry_s=0.02, term_floor=lambda: -1)
    task = asyncio.create_task(a.run())
    try:
        for _ in range(300):
            if api.version >= 4:  # made, then renewed at least twice
                break
            await asyncio.sleep(0.01)
        assert api.version >= 4
        await asyncio.sleep(0.05)
        assert a.can_write() and a.term == 0 == api.lease["spec"]["leaseTransitions"]
    finally:
        await stop(task)


async def test_a_standby_on_a_slow_api_server_takes_the_free_lease():
    """Every API call takes 0.1 s (a loaded API server): a standby's attempt may take up to 2/3 of
    the lease, so it still makes the lease and leads."""
    api = FlakyLeases(latency_s=0.1)
    a = LeaderElector(api, NAME, NAMESPACE, "a", lease_s=3, renew_s=0.5, retry_s=0.1)  # type: ignore[arg-type]
    task = asyncio.create_task(a.run())
    try:
        for _ in range(150):
            if a.can_write():
                break
            await asyncio.sleep(0.01)
        assert a.can_write() and a.is_leader, "never led on an API server answering in 0.1 s"
    finally:
        await stop(task)


async def test_a_leader_whose_renewal_hangs_steps_down_before_a_standby_may_take_over():
    """Renewals every 1.5 s of a 3 s lease: the one after a success hangs. The leader can prove it
    leads for 2 s after that success started, and its attempt is abandoned then: it steps down
    (the controller stops planning) at 2 s, not at the attempt's own 2 s from when it started,
    3.5 s, when a standby may already have taken over (3 s)."""
    api = FakeLeases()
    stepped_down: list[float] = []
    a = LeaderElector(api, NAME, NAMESPACE, "a", lease_s=3, renew_s=1.5, retry_s=0.1,  # type: ignore[arg-type]
                      on_change=lambda leader: None if leader else stepped_down.append(time.monotonic()))
    task = asyncio.create_task(a.run())
    try:
        await until_it_writes(a)
        version = api.version
        while api.version == version:  # its first renewal
            await asyncio.sleep(0.002)
        renewed = time.monotonic()
        api.hang = True
        for _ in range(400):
            if stepped_down:
                break
            await asyncio.sleep(0.01)
        assert stepped_down, "a leader that cannot renew steps down"
        # before the 3 s after which a standby may take over (it steps down at 2 s; the mutant at 3.5 s)
        assert stepped_down[0] - renewed < 3.0, f"stepped down {stepped_down[0] - renewed:.2f} s after it renewed"
    finally:
        api.hang = False
        await stop(task)


async def test_a_leader_late_past_its_proof_renews_at_once_and_keeps_leading():
    """The leader's loop stalled past the 2 s its last renewal proves, but within the lease (a
    standby takes over only after 3 s): its next attempt still gets a short deadline, renews, and
    it goes on leading rather than stepping down (which drops every plan in flight)."""
    api, t = Leases(), [100.0]
    changes: list[bool] = []
    a = replica(api, "a", t, renew_s=0.05, retry_s=0.05, on_change=changes.append)
    task = asyncio.create_task(a.run())
    try:
        await until_it_writes(a)
        assert a.can_write()
        version = api.version
        t[0] += 2.5
        for _ in range(200):
            if api.version > version and a.can_write():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert changes == [True] and a.can_write(), changes
    finally:
        await stop(task)


async def until(cond: Any, tries: int = 200) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)


async def test_a_won_attempt_proves_leadership_for_two_thirds_of_the_lease_from_its_start():
    """The controller writes while `write_time_left_s()` lasts: 2/3 of the lease from the start of
    the winning attempt (2 s of 3), and not after, whoever's clock says otherwise."""
    api, t = Leases(), [100.0]
    a = replica(api, "a", t, renew_s=60, retry_s=60)  # no second attempt during the test
    task = asyncio.create_task(a.run())
    try:
        await until(a.can_write)
        assert a.is_leader and a.write_time_left_s() == 2.0
        t[0] += 1.9
        assert a.can_write() and abs(a.write_time_left_s() - 0.1) < 1e-9
        t[0] += 0.2
        assert not a.can_write() and a.write_time_left_s() == 0.0
    finally:
        await stop(task)


async def test_a_leader_whose_renewals_answer_errors_stops_writing_and_steps_down():
    """Every renewal answers 500 (an API server that cannot write to etcd): an error is no
    renewal; the leader stops writing 2 s after its last success started and steps down."""
    api, t = FlakyLeases(), [100.0]
    changes: list[bool] = []
    a = replica(api, "a", t, renew_s=0.02, retry_s=0.02, on_change=changes.append)
    task = asyncio.create_task(a.run())
    try:
        await until(a.can_write)
        api.fail = 10 ** 6
        updates = api.updates
        await until(lambda: api.updates >= updates + 3)  # failed renewals
        t[0] += 2.1
        await until(lambda: not a.is_leader)
        assert not a.can_write() and changes == [True, False], changes
        await asyncio.sleep(0.1)
        assert not a.can_write() and changes == [True, False], "an error answer counted as a renewal"
    finally:
        await stop(task)


async def test_a_malformed_lease_is_never_taken_over_by_guess():
    """A Lease whose leaseTransitions is not a number (edited by hand) held by a dead replica: a
    standby cannot know the next term, so it does not lead (it keeps electing)."""
    api, t = Leases(), [100.0]
    held_by_other(api, leaseTransitions="seven")
    changes: list[bool] = []
    b = replica(api, "b", t, renew_s=0.02, retry_s=0.02, on_change=changes.append)
    task = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(0.05)
        t[0] += 10.0  # long expired
        await asyncio.sleep(0.2)
        assert changes == [] and not b.can_write() and api.lease["spec"]["holderIdentity"] == "other"
    finally:
        await stop(task)


async def test_a_stopping_leader_does_not_release_a_lease_another_replica_took():
    """The lease was taken over while this replica still counted itself leader (its loop stalled):
    its stop releases only a lease it holds, never the new leader's."""
    api, t = Leases(), [100.0]
    a = replica(api, "a", t, renew_s=60, retry_s=60)
    task = asyncio.create_task(a.run())
    try:
        await until(a.can_write)
    finally:
        held_by_other(api, holderIdentity="b", leaseTransitions=1)  # b took it over meanwhile
        await stop(task)
    assert not a.is_leader
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1


class StoppedAsItAnswers(Leases):
    """Stops the replica's task (as SIGTERM does) right after answering a read, before the replica
    has taken the answer: the attempt has ended when the stop arrives (CI hung on this for 90 min)."""

    def __init__(self) -> None:
        super().__init__()
        self.task: asyncio.Task[None] | None = None
        self.stops = 0

    async def read_namespaced_lease(self, name: str, namespace: str, _preload_content: bool = True) -> FakeResponse:
        resp = await super().read_namespaced_lease(name, namespace, _preload_content)
        if self.task is not None and self.stops == 0:
            self.stops += 1
            asyncio.get_running_loop().call_soon(self.task.cancel)
        return resp


async def test_a_stop_that_arrives_as_an_attempt_ends_stops_the_replica():
    """asyncio.wait_for on Python 3.11 returns the inner result when the cancellation and the
    result arrive together, dropping the cancellation: the replica's loop went on electing for good
    and its stop never returned. The attempt's deadline must not eat a stop."""
    api = StoppedAsItAnswers()
    held_by_other(api)  # a live holder: the attempt ends at the read, without another call
    b = replica(api, "b", [100.0], renew_s=0.02, retry_s=0.02)
    task = asyncio.create_task(b.run())
    api.task = task
    try:
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert api.stops == 1
        assert task in done, "the replica's loop swallowed its stop and kept electing"
        assert task.cancelled()
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
