"""Which Events to post (kopf's posting engine, without the queue): a component repeats the
same finding every round, and an Event for each would bury the ones that matter.

`EventRecorder` posts an Event about an object once per reason and message: the same message
again only after `event_repeat_s` (the API server forgets Events after an hour by default, and
a lasting condition should stay visible), a new message at once. It remembers at most
`event_memory` (object, reason) pairs; the least recently recorded are forgotten first, so its
memory is bounded however many objects come and go."""

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
    dropped (counted in `dropped`): Events are advice, the plan is what matters."""

    def __init__(self, post: PostEvent, workers: int = 4, maxsize: int = 10_000):
        self._post = post
        self._workers = workers
        self._queue: asyncio.Queue[tuple[Obj, str, str, bool]] = asyncio.Queue(maxsize)
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped = 0

    async def __call__(self, obj: Obj, reason: str, message: str, warning: bool) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._work(), name=f"events-{i}") for i in range(self._workers)]
        try:
            self._queue.put_nowait((obj, reason, message, warning))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("event queue full: %d Events dropped so far", self.dropped)

    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            try:
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


class EventRecorder:
    def __init__(self, post: PostEvent, settings: KubeSettings | None = None,
                 clock: Callable[[], float] = time.monotonic):
        settings = settings or KubeSettings()
        self._post = post
        self.repeat_s = settings.event_repeat_s
        self.memory = settings.event_memory
        self._clock = clock
        self._posted: OrderedDict[tuple[str, str, str, str], _Posted] = OrderedDict()

    def __len__(self) -> int:
        return len(self._posted)

    async def record(self, obj: Obj, reason: str, message: str, warning: bool = False) -> bool:
        """Post this Event unless it was posted less than `repeat_s` ago; whether it was posted."""
        ref = object_reference(obj)
        key = (str(ref["kind"]), str(ref.get("namespace", "")), str(ref["name"]), reason)
        now = self._clock()
        last = self._posted.get(key)
        if last is not None:
            self._posted.move_to_end(key)  # recorded again: the last to be forgotten
            if last.message == message and now - last.at < self.repeat_s:
                return False
        self._posted[key] = _Posted(message, now)
        while len(self._posted) > self.memory:
            self._posted.popitem(last=False)
        await self._post(obj, reason, message, warning)
        return True
