"""The informer: lists, watches from the list's resourceVersion, lists again when the watch ends,
backs off while listing fails, and outlives a failing callback."""

from __future__ import annotations

import asyncio

from dynpart.kube.watching import Informer
from dynpart.settings import KubeSettings

from .fakes import FakeResponse

FAST = KubeSettings(backoff_initial_s=0.001, backoff_max_s=0.002)


def node(name: str, rv: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv}}


class FakeNodes:
    """`list_node`: answers each list from `lists` (a status and items) and each watch from
    `watches` (events; then the server closes the watch)."""

    def __init__(self, lists, watches):
        self.lists, self.watches, self.calls = list(lists), list(watches), []

    async def list_node(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            return FakeResponse(200, events=self.watches.pop(0) if self.watches else [])
        status, items = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        return FakeResponse(status, {"metadata": {"resourceVersion": "10"}, "items": items}, reason="Why")


async def run_until(informer: Informer, predicate, timeout: float = 5.0) -> None:
    task = asyncio.create_task(informer.run())
    try:
        for _ in range(int(timeout / 0.01)):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_list_then_watch_then_list_again():
    api = FakeNodes([(200, [node("a", "1")])], [[{"type": "MODIFIED", "object": node("a", "11")},
                                                 {"type": "ADDED", "object": node("b", "12")}]])
    seen = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", field_selector="metadata.name=a", settings=FAST)
    await run_until(informer, lambda: len([c for c in api.calls if not c.get("watch")]) >= 2)
    assert seen[:3] == [("MODIFIED", "a"), ("MODIFIED", "a"), ("ADDED", "b")]
    watch = next(c for c in api.calls if c.get("watch"))
    assert watch["resource_version"] == "10" and watch["field_selector"] == "metadata.name=a"
    assert watch["timeout_seconds"] == 300
    assert informer.synced.is_set()


async def test_failed_lists_back_off_and_the_cache_survives(caplog):
    api = FakeNodes([(200, [node("a", "1")]), (500, []), (503, []), (200, [node("a", "1"), node("b", "2")])], [])
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes", settings=FAST)
    await run_until(informer, lambda: "b" in informer.cache)
    assert set(informer.cache) == {"a", "b"}
    assert sum("list nodes failed" in r.message for r in caplog.records) == 2


async def test_a_failing_callback_does_not_stop_the_informer():
    api = FakeNodes([(200, [node("a", "1")]), (200, [node("a", "2")])], [])
    calls = []

    def on_change(kind, obj):
        calls.append(obj["metadata"]["resourceVersion"])
        if len(calls) == 1:
            raise RuntimeError("bug in a callback")

    informer = Informer(api.list_node, on_change, name="nodes", settings=FAST)
    await run_until(informer, lambda: "2" in calls)
