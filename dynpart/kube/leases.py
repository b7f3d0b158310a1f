"""Holding a coordination.k8s.io Lease: leader election for the planner's replicas.

The holder renews the lease every `renew_s`; another replica takes it over once
`leaseDurationSeconds` have passed, on its own monotonic clock, since it last saw the lease
record change (as client-go does): the holder's `renewTime` is another machine's wall clock,
and a skew between the two must neither let a standby take over a live leader's lease nor keep
a dead one's for long. Every write carries the
resourceVersion it read, so two replicas can never both win (the loser gets 409 Conflict).
A standby tries every `retry_s` rather than backing off: it must notice an expired lease in time.
A leader that cannot renew within its lease steps down before anyone else may take over:
every attempt has a deadline, and `can_write()` says whether the leader can still prove it leads
(its last successful renewal *started* less than two thirds of the lease ago); writers check it
before each write. `term` is the lease's `leaseTransitions` when this replica took it: a number
that grows with every change of leader, written with each plan so that agents can ignore a plan
from a deposed leader (fencing). On a clean stop the lease is released so that a standby takes
over at once.

The term must stay above every term already written, also when the Lease is deleted and made
again (its namespace deleted and the chart installed again, `kubectl delete lease`): its
`leaseTransitions` would restart at 0, below the terms on the nodes, and a deposed leader's late
write could no longer be told from the new leader's. So a replica that creates or takes over the
lease asks `term_floor` for the highest term written on the nodes and takes the next one at
least; until that is known (the node cache not yet synced) it neither creates nor takes over the
lease. A lease made again also takes the term after the last one seen on it (`_deleted_term`)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable

from kubernetes_asyncio import client

from dynpart.annotations import MAX_TERM
from dynpart.kube.client import Obj, raw_api, read_json
from dynpart.kube.errors import APIConflictError, APIError, APINotFoundError, api_errors

log = logging.getLogger(__name__)
_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime(_FMT)


class LeaderElector:
    def __init__(self, api: client.CoordinationV1Api, name: str, namespace: str, identity: str,
                 lease_s: int = 15, renew_s: float = 5.0, retry_s: float = 1.0,
                 on_change: Callable[[bool], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 term_floor: Callable[[], int | None] | None = None):
        self.api, self.name, self.namespace, self.identity = api, name, namespace, identity
        # the highest term written where agents read it (-1: none), None while unknown
        self.term_floor = term_floor
        self.lease_s, self.renew_s, self.retry_s = lease_s, renew_s, retry_s
        self.on_change = on_change
        self.is_leader = False
        self.term = 0
        self._valid_until = 0.0  # monotonic time until which this replica can prove it leads
        self._term_read = 0
        self._duration_read = lease_s  # leaseDurationSeconds of the record the last attempt read
        self.clock = clock
        self._observed: tuple[object, ...] | None = None  # the lease record last read
        self._observed_at = 0.0  # when (this replica's monotonic clock) it last changed

    @property
    def margin_s(self) -> float:
        """How long a renewal proves leadership: well within the lease, so that a leader stops
        writing before another replica may take over (clock rates and request latency aside)."""
        return self.lease_s * 2 / 3

    def _proven_s(self) -> float:
        """How long the last won attempt proves leadership: within the shorter of this replica's
        lease and the one the record it replaced had (standbys time the lease by the record)."""
        return min(self.lease_s, self._duration_read) * 2 / 3

    def can_write(self) -> bool:
        return self.write_time_left_s() > 0

    def write_time_left_s(self) -> float:
        """How long a write started now may take and still land while this replica can prove it
        leads (0 when it cannot): a write that would land later must be abandoned, or it could
        land after a standby took over."""
        return max(0.0, self._valid_until - self.clock()) if self.is_leader else 0.0

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            log.info("%s leadership of lease %s/%s", "acquired" if leader else "lost", self.namespace, self.name)
            if self.on_change:
                self.on_change(leader)

    async def _read(self) -> Obj:
        what = f"read lease {self.namespace}/{self.name}"
        with api_errors(what):
            resp = await self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
        return await read_json(resp, what)

    def _next_term(self, term: int) -> int | None:
        """The term a replica creating or taking over the lease writes: `term`, or above the highest
        term already written; None while that is unknown. At most MAX_TERM, the largest an agent
        reads (a larger one, from a node's hand-edited spec-term, would stop every plan)."""
        if self.term_floor is not None:
            floor = self.term_floor()
            if floor is None:
                return None
            term = max(term, floor + 1)
        if term > MAX_TERM:
            log.error("lease %s/%s: the next leader term would be %d, above the largest an agent reads (%d; a "
                      "node's dynpart.io/spec-term is that high): taking %d", self.namespace, self.name, term,
                      MAX_TERM, MAX_TERM)
            term = MAX_TERM
        return term

    def _deleted_term(self) -> int:
        """The term of a lease made again after it was deleted: after the last one this replica
        saw. Its holder (this replica, or a leader that may write until its renewal fails) may not
        have written its term on any node yet: the same term again would let both lead under it,
        and agents could fence neither."""
        seen = self._observed[3] if self._observed is not None else None
        return seen + 1 if isinstance(seen, int) and not isinstance(seen, bool) and seen >= 0 else 0

    async def _try(self) -> bool:
        try:
            lease = await self._read()
        except APINotFoundError:
            term = self._next_term(self._deleted_term())
            if term is None:
                return False
            spec: Obj = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_s,
                         "acquireTime": _now(), "renewTime": _now(), "leaseTransitions": term}
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            try:
                with api_errors(f"create lease {self.namespace}/{self.name}"):
                    await raw_api(self.api).create_namespaced_lease(self.namespace, body)
                self._term_read, self._duration_read = term, self.lease_s
                self._observe(spec)  # its term is the last one seen, should it be deleted again
                return True
            except APIConflictError:
                return False
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        duration = spec.get("leaseDurationSeconds") or self.lease_s
        unchanged_s = self._observe(spec)
        if holder == self.identity:
            # the whole record, as client-go writes it: a replica back with another lease duration
            # (same identity) must not go on leading by its own while standbys time the record's
            spec.update(renewTime=_now(), leaseDurationSeconds=self.lease_s)
        elif not holder or unchanged_s > duration:
            term = self._next_term((spec.get("leaseTransitions") or 0) + 1)
            if term is None:
                return False
            spec.update(holderIdentity=self.identity, acquireTime=_now(), renewTime=_now(),
                        leaseDurationSeconds=self.lease_s, leaseTransitions=term)
        else:
            return False
        lease["spec"] = spec
        try:
            await self._replace(lease)
            self._term_read = int(spec.get("leaseTransitions") or 0)
            self._duration_read = int(duration)
            return True
        except APIConflictError:
            return False

    def _observe(self, spec: Obj) -> float:
        """How long the lease record has been as it is now, on this replica's monotonic clock
        (0 when it changed since the last read, or on the first read)."""
        record = tuple(spec.get(k) for k in ("holderIdentity", "renewTime", "acquireTime", "leaseTransitions",
                                             "leaseDurationSeconds"))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        return now - self._observed_at

    async def _replace(self, lease: Obj) -> None:
        with api_errors(f"update lease {self.namespace}/{self.name}"):
            await raw_api(self.api).replace_namespaced_lease(self.name, self.namespace, lease)

    async def run(self) -> None:
        try:
            while True:
                started = self.clock()
                # a leader's attempt must end while it can still prove it leads; a hung request
                # must not keep it leading past the point where a standby may take over
                deadline = max(0.05, self._valid_until - started) if self.is_leader else self.margin_s
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for drops a stop that arrives as
                    # the attempt ends, and this loop would go on electing for good
                    async with asyncio.timeout(deadline):
                        won = await self._try()
                except TimeoutError:
                    log.warning("lease %s/%s: no answer within %.1f s", self.namespace, self.name, deadline)
                    won = False
                except APIError as e:
                    log.warning("lease %s/%s: %s", self.namespace, self.name, e)
                    won = False
                except Exception:  # keep electing (a malformed Lease, say): this replica must go on stepping down
                    log.exception("lease %s/%s", self.namespace, self.name)
                    won = False
                if won:
                    # the server may have applied the renewal at any time after the request left
                    self._valid_until = started + self._proven_s()
                    self.term = self._term_read
                    self._set(True)
                elif not self.can_write():
                    # step down well before another replica may take the lease over
                    self._set(False)
                # a leader whose renewal failed tries again as a standby does, every retry_s, while
                # it can still write (client-go: RetryPeriod until RenewDeadline): after renew_s, two
                # failures in a row (an API server restart) left it too little time to renew
                await asyncio.sleep(self.renew_s if self.is_leader and won else self.retry_s)
        finally:
            if self.is_leader:
                self._set(False)
                await asyncio.shield(self._release())

    async def _release(self) -> None:
        try:
            lease = await self._read()
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") == self.identity:
                spec.update(holderIdentity=None, renewTime=None)
                lease["spec"] = spec
                await self._replace(lease)
        except APIError as e:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, e)
