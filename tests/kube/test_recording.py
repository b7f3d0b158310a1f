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


def recorder(repeat_s: float = 60.0, memory: int = 100, on_drop=None,
             on_spam=None) -> tuple[EventRecorder, list[tuple], Clock]:
    posted: list[tuple] = []
    clock = Clock()

    async def post(obj, reason, message, warning):
        posted.append((obj["metadata"]["name"], reason, message, warning))

    settings = KubeSettings(event_repeat_s=repeat_s, event_memory=memory)
    return EventRecorder(post, settings, clock, on_drop, on_spam=on_spam), posted, clock


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


async def test_more_objects_than_the_memory_never_post_a_repeat_within_the_period():
    """Each round records the same pods in the same order: with more pods than `event_memory`,
    forgetting the least recently recorded would forget every pair before it comes round again,
    and every Event would be posted every round (4097 pods over 4 rounds: 16,388 Events)."""
    dropped: list[int] = []
    rec, posted, clock = recorder(repeat_s=60, memory=3, on_drop=lambda: dropped.append(1))
    for rnd in range(4):
        clock.now = rnd * 10
        for name in "abcd":
            await rec.record(pod(name), "Unplaceable", "no room", True)
    assert [p[0] for p in posted] == ["a", "b", "c"]  # d: dropped while the memory is full, never a repeat
    assert rec.dropped == len(dropped) == 4 and len(rec) == 3
    clock.now = 60  # a period later: forgotten by age, posted again
    for name in "abcd":
        await rec.record(pod(name), "Unplaceable", "no room", True)
    assert [p[0] for p in posted] == ["a", "b", "c"] * 2 and rec.dropped == 5


async def test_a_backlog_above_the_default_memory_is_posted_once_per_period():
    """The reviewer's case: 4097 pods waiting (kube.event_memory is 4096), four rounds a resync apart."""
    rec, posted, clock = recorder(repeat_s=KubeSettings().event_repeat_s, memory=KubeSettings().event_memory)
    pods = [pod(f"p{i}") for i in range(4097)]
    for rnd in range(4):
        clock.now = rnd * 15.0
        for p in pods:
            await rec.record(p, "Unplaceable", "dynpart cannot place this pod: no room", True)
    assert len(posted) == 4096 and len({p[0] for p in posted}) == 4096 and rec.dropped == 4


async def test_pairs_are_forgotten_by_age_or_when_the_object_goes():
    rec, posted, clock = recorder(repeat_s=60, memory=3)
    for name in "abc":
        await rec.record(pod(name), "R", "m", True)
        clock.now += 10  # a at 0, b at 10, c at 20
    clock.now = 65  # a's period is over: forgotten, room for d
    await rec.record(pod("d"), "R", "m", True)
    assert [p[0] for p in posted] == ["a", "b", "c", "d"] and len(rec) == 3 and rec.dropped == 0
    await rec.record(pod("b"), "R", "m", True)  # b still within its period: not posted
    await rec.record(pod("e"), "R", "m", True)  # full: dropped
    assert len(posted) == 4 and rec.dropped == 1
    rec.forget(pod("b"))  # the pod went: its pairs go
    await rec.record(pod("e"), "R", "m", True)
    assert [p[0] for p in posted] == ["a", "b", "c", "d", "e"] and len(rec) == 3
    await rec.record(pod("c"), "R", "new message", True)  # a new message of a remembered pair: posted, full or not
    assert posted[-1] == ("c", "R", "new message", True) and len(rec) == 3
    clock.now = 10_000
    for i in range(1000):  # however many objects come and go, the memory stays bounded
        await rec.record(pod(f"p{i}"), "R", "m", True)
    assert len(rec) == 3 and len(rec._reasons) == 3


async def test_with_the_memory_full_of_waiting_pods_what_a_plan_did_and_node_events_are_posted():
    rec, posted, _ = recorder(repeat_s=60, memory=2)
    for name in "abc":
        await rec.record(pod(name), "Unplaceable", "no room", True)
    assert [p[0] for p in posted] == ["a", "b"] and rec.dropped == 1
    await rec.record(pod("c"), "SlicePlanned", "on node n1")
    await rec.record({"kind": "Node", "metadata": {"name": "n1"}}, "LayoutPlanned", "plan p1")
    await rec.record({"kind": "Node", "metadata": {"name": "n1"}}, "PlanRevoked", "plan p1", True)
    assert [p[:2] for p in posted[2:]] == [("c", "SlicePlanned"), ("n1", "LayoutPlanned"), ("n1", "PlanRevoked")]
    assert not await rec.record({"kind": "Node", "metadata": {"name": "n1"}}, "LayoutPlanned", "plan p1")  # a repeat


async def test_a_message_that_changes_every_round_is_rate_limited_per_object(caplog):
    """client-go's spam filter: 25 Events about one object at once, then one per 5 minutes, however
    its messages change; other objects have their own budget; what is dropped is counted, and the
    latest message is posted once a token is back."""
    import logging

    from dynpart.kube.recording import SPAM_BURST, SPAM_REFILL_S

    caplog.set_level(logging.DEBUG, logger="dynpart.kube.recording")
    spam: list[int] = []
    rec, posted, clock = recorder(repeat_s=3600, on_spam=lambda: spam.append(1))
    assert (SPAM_BURST, SPAM_REFILL_S) == (25, 300)
    for rnd in range(40):  # a round every 2 s whose message names something that changes
        clock.now = rnd * 2.0
        assert await rec.record(pod("a"), "Unplaceable", f"round {rnd}", True) == (rnd < 25)
    assert [p[2] for p in posted] == [f"round {r}" for r in range(25)]
    assert rec.spam_dropped == len(spam) == 15 and rec.dropped == 0
    assert await rec.record(pod("b"), "Unplaceable", "round 39", True)  # its own bucket
    assert await rec.record({"kind": "Node", "metadata": {"name": "a"}}, "LayoutPlanned", "plan 1")
    clock.now = SPAM_REFILL_S - 1  # the bucket refills from the first Event on, one token per 5 minutes
    assert not await rec.record(pod("a"), "Unplaceable", "round 40", True)
    clock.now = SPAM_REFILL_S + 1  # one token back
    assert await rec.record(pod("a"), "Unplaceable", "round 41", True)
    assert not await rec.record(pod("a"), "Unplaceable", "round 42", True)
    assert not await rec.record(pod("a"), "Unplaceable", "round 41", True)  # a repeat: de-duplicated, costs nothing
    assert rec.spam_dropped == 17
    infos = [r for r in caplog.records if "spam filter" in r.getMessage()]
    assert [r.levelname for r in infos[:2]] == ["INFO", "DEBUG"] and "Pod ml/a" in infos[0].getMessage()


async def test_a_repeat_withheld_by_the_de_duplication_costs_no_token():
    """The same Event every round is posted once (the de-duplication) and never drains the bucket:
    a new message after a hundred rounds is posted at once."""
    rec, posted, clock = recorder(repeat_s=3600)
    for rnd in range(100):
        clock.now = rnd * 1.0
        await rec.record(pod("a"), "Unplaceable", "no room", True)
    assert await rec.record(pod("a"), "Unplaceable", "another reason", True)
    assert len(posted) == 2 and rec.spam_dropped == 0


async def test_the_spam_filter_forgets_full_buckets_and_gone_objects():
    from dynpart.kube.recording import SPAM_BURST, SPAM_REFILL_S

    rec, posted, clock = recorder(repeat_s=60)
    for i in range(SPAM_BURST + 1):
        await rec.record(pod("a"), "R", f"m{i}")
    assert rec.spam_dropped == 1
    rec.forget(pod("a"))  # a pod of that name made later is another pod: a budget of its own
    assert await rec.record(pod("a"), "R", "new pod")
    for i in range(1000):
        clock.now = i * 10.0
        await rec.record(pod(f"p{i}"), "R", "m")
    # a bucket unused for SPAM_BURST * SPAM_REFILL_S (about 2 hours) is full: forgotten
    assert len(rec._spam) == SPAM_BURST * SPAM_REFILL_S / 10


async def test_queued_posting_never_makes_the_caller_wait():
    import asyncio

    from dynpart.kube.recording import QueuedPoster

    gate = asyncio.Event()
    posted: list[str] = []

    async def slow_post(obj, reason, message, warning):
        await gate.wait()  # the API server is slow
        posted.append(message)

    drops: list[int] = []
    poster = QueuedPoster(slow_post, workers=2, maxsize=3, on_drop=lambda: drops.append(1))
    for i in range(5):
        await asyncio.wait_for(poster({"kind": "Pod", "metadata": {"name": f"p{i}"}}, "R", f"m{i}", False), 0.1)
    await asyncio.sleep(0)  # the workers take the first two; three wait in the queue
    assert posted == [] and poster.dropped == 0
    await poster({"kind": "Pod", "metadata": {"name": "p5"}}, "R", "m5", False)
    assert poster.dropped == len(drops) == 1  # the queue was full: dropped (and counted), not waited for
    gate.set()
    await poster.drain()
    assert sorted(posted) == ["m0", "m1", "m2", "m3", "m4"]


async def test_events_queued_by_a_deposed_leader_are_not_posted():
    """An Event queued while leading and taken from the queue after the lease was lost is not
    posted: a standby writes nothing (docs/protocol.md)."""
    import asyncio

    from dynpart.kube.recording import QueuedPoster

    posted: list[str] = []
    leading = True

    async def post(obj, reason, message, warning):
        posted.append(message)

    poster = QueuedPoster(post, workers=1, may_post=lambda: leading)
    await poster({"kind": "Pod", "metadata": {"name": "a"}}, "SlicePlanned", "while leading", False)
    await poster.drain()
    leading = False
    await poster({"kind": "Pod", "metadata": {"name": "b"}}, "SlicePlanned", "queued, then the lease went", False)
    await asyncio.wait_for(poster.drain(), 1)
    assert posted == ["while leading"] and poster.withheld == 1


def test_a_node_event_names_the_node_as_kubectl_describe_node_finds_it():
    """`kubectl describe node` finds Events by the node's uid, or by the node's name as the uid
    (the kubelet's convention): an Event about a node known only by name carries its name there."""
    from dynpart.kube.events import object_reference

    assert object_reference({"kind": "Node", "metadata": {"name": "gpu-1"}})["uid"] == "gpu-1"
    assert object_reference({"kind": "Node", "metadata": {"name": "gpu-1", "uid": "u-1"}})["uid"] == "u-1"
    assert object_reference({"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": []}})["uid"] is None
