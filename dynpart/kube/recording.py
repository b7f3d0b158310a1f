"""Which Events to post (kopf's posting engine, without the queue): a component repeats the
same finding every round, and an Event for each would bury the ones that matter.

`EventRecorder` posts an Event about an object once per reason and message: the same message
again only after `event_repeat_s` (the API server forgets Events after an hour by default, and
a lasting condition should stay visible), a new message at once. What it remembers is forgotten
by age (`event_repeat_s` after it was posted: the next one is posted anyway), or when the caller
says the object is gone (`forget`), never to make room: evicting a pair still within its period
would post it again, and with more objects than the bound, recorded in the same order each round,
every pair would be evicted before it comes round again (every Event posted every round). When
`event_memory` (object, reason) pairs are remembered, a warning about a further pod is dropped
(counted in `dropped`) until some are forgotten: the Events that pile up with a backlog of waiting
pods stay bounded however many come and go, while what a plan did and Events about nodes (as many
as the cluster has) are always posted.

What the de-duplication would post then passes a spam filter, as client-go's recorder does
(EventSourceObjectSpamFilter): a token bucket per object, `SPAM_BURST` Events at once and then one
per `SPAM_REFILL_S`. A message that changes every round (say it names other pods) would otherwise
be a new Event every round for every object it is about. A repeat the de-duplication withholds
costs no token (client-go's repeats are PATCHes, and pay): the filter limits only the posts; an
Event it drops is not remembered, so the next round's (the latest message) is posted once a token
is back. Its drops count in `spam_dropped` (and `on_spam`, e.g. a metric's inc)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kubernetes_asyncio import client

from dynpart.kube.client import Obj
from dynpart.kube.events import object_reference, post_event
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)

# post(obj, reason, message, warning): the bare posting, e.g. `posting_to(core, component)`.
PostEvent = Callable[[Obj, str, str, bool], Awaitable[None]]


def posting_to(core: client.CoreV1Api, component: str) -> PostEvent:
    """Posting through the API server as `component` (the Event's source)."""
    async def post(obj: Obj, reason: str, message: str, warning: bool) -> None:
        await post_event(core, obj, reason, message, component, warning)
    return post


class QueuedPoster:
    """Posts Events from a bounded queue with a few concurrent workers (client-go's recorder
    does the same): a controller never waits for the API server to take an Event, so a round
    that places hundreds of pods does not stall planning. When the queue is full the Event is
    dropped (counted in `dropped`, and `on_drop` called, e.g. a metric's inc): Events are advice,
    the plan is what matters. `may_post` is asked before each post: an Event queued by a leader
    that has lost the lease since is not posted (a standby writes nothing; `withheld` counts them)."""

    def __init__(self, post: PostEvent, workers: int = 4, maxsize: int = 10_000,
                 on_drop: Callable[[], None] | None = None, may_post: Callable[[], bool] | None = None):
        self._post = post
        self._may_post = may_post
        self.withheld = 0
        self._workers = workers
        self._queue: asyncio.Queue[tuple[Obj, str, str, bool]] = asyncio.Queue(maxsize)
        self._tasks: list[asyncio.Task[None]] = []
        self._on_drop = on_drop
        self.dropped = 0

    async def __call__(self, obj: Obj, reason: str, message: str, warning: bool) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._work(), name=f"events-{i}") for i in range(self._workers)]
        try:
            self._queue.put_nowait((obj, reason, message, warning))
        except asyncio.QueueFull:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("event queue full: %d Events dropped so far", self.dropped)

    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if self._may_post is not None and not self._may_post():
                    self.withheld += 1
                    continue
                await self._post(*item)
            except Exception as e:  # an Event that cannot be posted is logged, never fatal
                log.warning("could not post Event %s: %s", item[1], e)
            finally:
                self._queue.task_done()

    async def drain(self) -> None:
        """Wait until every queued Event is posted (tests, shutdown)."""
        await self._queue.join()


@dataclass(frozen=True)
class _Posted:
    message: str
    at: float


Key = tuple[str, str, str]  # the object: kind, namespace, name

# client-go's defaults (tools/record/events_cache.go: defaultSpamBurst, defaultSpamQPS): 25 Events
# about an object at once, then one every 5 minutes, "to control the long-tail of events for things
# that are always unhealthy"
SPAM_BURST = 25
SPAM_REFILL_S = 300.0


@dataclass
class _Bucket:
    tokens: float
    at: float  # when `tokens` was counted


class _SpamFilter:
    """A token bucket per object (`SPAM_BURST`, one more every `SPAM_REFILL_S`). A bucket not used
    for `SPAM_BURST * SPAM_REFILL_S` is full again, the same as none: it is forgotten, so that the
    buckets are only those of objects with Events in the last two hours or so."""

    def __init__(self) -> None:
        self._buckets: OrderedDict[Key, _Bucket] = OrderedDict()  # the least recently used first

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, who: Key, now: float) -> bool:
        """Whether one more Event about `who` may be posted now (a token taken if so)."""
        while self._buckets:
            first = next(iter(self._buckets.values()))
            if now - first.at < SPAM_BURST * SPAM_REFILL_S:
                break
            self._buckets.popitem(last=False)
        bucket = self._buckets.pop(who, None) or _Bucket(SPAM_BURST, now)
        bucket.tokens = min(SPAM_BURST, bucket.tokens + (now - bucket.at) / SPAM_REFILL_S)
        bucket.at = now
        self._buckets[who] = bucket  # the most recently used: the last to be forgotten
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    def forget(self, who: Key) -> None:
        self._buckets.pop(who, None)


class EventRecorder:
    """`on_drop` is called for each Event dropped because `event_memory` pairs are remembered
    (e.g. a metric's inc); the first such drop in each `event_repeat_s` is logged. `on_spam` is
    called for each Event the spam filter drops; the first in each `SPAM_REFILL_S` is logged at
    INFO, every one at DEBUG."""

    def __init__(self, post: PostEvent, settings: KubeSettings | None = None,
                 clock: Callable[[], float] = time.monotonic, on_drop: Callable[[], None] | None = None,
                 on_spam: Callable[[], None] | None = None):
        settings = settings or KubeSettings()
        self._post = post
        self.repeat_s = settings.event_repeat_s
        self.memory = settings.event_memory
        self._clock = clock
        self._on_drop = on_drop
        # (object, reason) -> the last Event posted, the oldest first: forgotten from the front
        self._posted: OrderedDict[tuple[Key, str], _Posted] = OrderedDict()
        self._reasons: dict[Key, set[str]] = {}  # the reasons remembered per object (for `forget`)
        self.dropped = 0
        self._logged_at: float | None = None
        # per object, in front of the posting: what the de-duplication lets through (not cleared
        # with it: it bounds what this process posts, leading or not)
        self._spam = _SpamFilter()
        self._on_spam = on_spam
        self.spam_dropped = 0
        self._spam_logged_at: float | None = None

    def __len__(self) -> int:
        return len(self._posted)

    def clear(self) -> None:
        """Forget every Event posted (a replica that stopped leading: what it queued may not have
        been posted, and as leader again it must post anew)."""
        self._posted.clear()
        self._reasons.clear()

    @staticmethod
    def _object(obj: Obj) -> Key:
        ref = object_reference(obj)
        return str(ref["kind"]), str(ref.get("namespace", "")), str(ref["name"])

    async def record(self, obj: Obj, reason: str, message: str, warning: bool = False) -> bool:
        """Post this Event unless it was posted less than `repeat_s` ago, or it is about a new
        (object, reason) pair while `memory` pairs are remembered; whether it was posted."""
        who = self._object(obj)
        key = (who, reason)
        now = self._clock()
        self._expire(now)
        last = self._posted.get(key)
        if last is not None and last.message == message:
            return False  # posted less than repeat_s ago (else it expired above)
        if last is None and len(self._posted) >= self.memory and warning and who[0] == "Pod":
            # only what piles up is dropped: a warning about one more waiting pod; what a plan did
            # (SlicePlanned) and every node's Event are posted (and remembered) all the same
            self._drop(now)
            return False
        if not self._spam.allow(who, now):
            self._spam_drop(who, reason, now)
            return False  # not remembered: the latest message is posted once a token is back
        self._posted[key] = _Posted(message, now)
        self._posted.move_to_end(key)  # the most recently posted: the last to expire
        self._reasons.setdefault(who, set()).add(reason)
        await self._post(obj, reason, message, warning)
        return True

    def forget(self, obj: Obj) -> None:
        """Forget the Events posted about `obj` (it is gone, or will never be recorded again: a pod
        bound to its node): room for others, and an object of that name made later is new."""
        who = self._object(obj)
        for reason in self._reasons.pop(who, ()):
            self._posted.pop((who, reason), None)
        self._spam.forget(who)

    def _expire(self, now: float) -> None:
        """Forget the pairs posted `repeat_s` ago or longer: their next Event is posted anyway."""
        while self._posted:
            (who, reason), first = next(iter(self._posted.items()))
            if now - first.at < self.repeat_s:
                return
            del self._posted[(who, reason)]
            reasons = self._reasons.get(who)
            if reasons is not None:
                reasons.discard(reason)
                if not reasons:
                    del self._reasons[who]

    def _drop(self, now: float) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop()
        if self._logged_at is None or now - self._logged_at >= self.repeat_s:
            self._logged_at = now
            log.warning("Event de-duplication remembers %d (object, reason) pairs (kube.event_memory): Events about "
                        "further pairs are dropped until some are forgotten (%d dropped so far)", self.memory, self.dropped)

    def _spam_drop(self, who: Key, reason: str, now: float) -> None:
        self.spam_dropped += 1
        if self._on_spam is not None:
            self._on_spam()
        kind, namespace, name = who
        about = f"{kind} {namespace + '/' if namespace else ''}{name}"
        if self._spam_logged_at is None or now - self._spam_logged_at >= SPAM_REFILL_S:
            self._spam_logged_at = now
            log.info("Event %s about %s not posted: more than %d Events about one object, then one per %gs (the "
                     "spam filter; %d dropped so far)", reason, about, SPAM_BURST, SPAM_REFILL_S, self.spam_dropped)
        else:
            log.debug("Event %s about %s not posted: the spam filter (%d dropped so far)", reason, about,
                      self.spam_dropped)
