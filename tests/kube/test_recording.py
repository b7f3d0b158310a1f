"""The Event recorder: once per object, reason and message; again after the repeat period or on
a new message; a bounded memory."""

from __future__ import annotations

from dynpart.kube.recording import EventRecorder
from dynpart.settings import KubeSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, namespace: str = "ml") -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"containers": []}}


def recorder(repeat_s: float = 60.0, memory: int = 100) -> tuple[EventRecorder, list[tuple], Clock]:
    posted: list[tuple] = []
    clock = Clock()

    async def post(obj, reason, message, warning):
        posted.append((obj["metadata"]["name"], reason, message, warning))

    return EventRecorder(post, KubeSettings(event_repeat_s=repeat_s, event_memory=memory), clock), posted, clock


async def test_the_same_event_is_posted_once_per_period():
    rec, posted, clock = recorder(repeat_s=60)
    assert await rec.record(pod("a"), "Unplaceable", "too big", warning=True)
    clock.now = 59
    assert not await rec.record(pod("a"), "Unplaceable", "too big", warning=True)
    clock.now = 61
    assert await rec.record(pod("a"), "Unplaceable", "too big", warning=True)
    assert posted == [("a", "Unplaceable", "too big", True)] * 2


async def test_a_new_message_other_reason_or_object_is_posted_at_once():
    rec, posted, _ = recorder()
    await rec.record(pod("a"), "SlicePlanned", "on node n1")
    await rec.record(pod("a"), "SlicePlanned", "on node n2")  # new message
    await rec.record(pod("a"), "SlicePlanned", "on node n1")  # changed back: new again
    await rec.record(pod("a"), "Unplaceable", "on node n1")  # other reason
    await rec.record(pod("b"), "SlicePlanned", "on node n1")  # other object
    await rec.record(pod("a", "other"), "SlicePlanned", "on node n1")  # other namespace
    await rec.record({"kind": "Node", "metadata": {"name": "a"}}, "SlicePlanned", "on node n1")  # other kind
    assert len(posted) == 7


async def test_a_listed_and_a_watched_object_are_the_same_object():
    rec, posted, _ = recorder()
    await rec.record(pod("a"), "SlicePlanned", "m")  # as listed: no kind
    await rec.record({"kind": "Pod", **pod("a")}, "SlicePlanned", "m")  # as watched
    assert len(posted) == 1


async def test_memory_is_bounded_least_recently_recorded_forgotten_first():
    rec, posted, _ = recorder(memory=3)
    for name in "abcd":
        await rec.record(pod(name), "R", "m")
    assert len(rec) == 3 and len(posted) == 4
    await rec.record(pod("b"), "R", "m")  # remembered: not posted, and now the most recent
    assert len(posted) == 4
    await rec.record(pod("e"), "R", "m")  # forgets c, the least recently recorded
    await rec.record(pod("b"), "R", "m")
    assert len(posted) == 5
    await rec.record(pod("c"), "R", "m")  # forgotten: posted again
    assert len(posted) == 6 and len(rec) == 3
    for i in range(1000):
        await rec.record(pod(f"p{i}"), "R", "m")
    assert len(rec) == 3


async def test_queued_posting_never_makes_the_caller_wait():
    import asyncio

    from dynpart.kube.recording import QueuedPoster

    gate = asyncio.Event()
    posted: list[str] = []

    async def slow_post(obj, reason, message, warning):
        await gate.wait()  # the API server is slow
        posted.append(message)

    poster = QueuedPoster(slow_post, workers=2, maxsize=3)
    for i in range(5):
        await asyncio.wait_for(poster({"kind": "Pod", "metadata": {"name": f"p{i}"}}, "R", f"m{i}", False), 0.1)
    await asyncio.sleep(0)  # the workers take the first two; three wait in the queue
    assert posted == [] and poster.dropped == 0
    await poster({"kind": "Pod", "metadata": {"name": "p5"}}, "R", "m5", False)
    assert poster.dropped == 1  # the queue was full: dropped, not waited for
    gate.set()
    await poster.drain()
    assert sorted(posted) == ["m0", "m1", "m2", "m3", "m4"]
