"""The informer: lists (page by page), watches from the list's resourceVersion, watches again from
the last resourceVersion when a watch ends, lists again on 410 Gone or a failed watch, backs off
exponentially while failures follow one another (a Retry-After included), and outlives a failing
callback."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from dynpart.kube.watching import Informer
from dynpart.settings import KubeSettings

from .fakes import FakeResponse, status

FAST = KubeSettings(backoff_initial_s=0.001, backoff_max_s=0.002)


def node(name: str, rv: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv}}


def bookmark(rv: str) -> dict:
    return {"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": rv}}}


class FakeNodes:
    """`list_node`: answers each list from `lists` (a status and items; the last one repeats) and
    each watch from `watches` (a FakeResponse, or events and then the server closes the watch);
    once `watches` runs out, a watch stays open and silent."""

    def __init__(self, lists, watches=()):
        self.lists, self.watches, self.calls = list(lists), list(watches), []

    async def list_node(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            answer = self.watches.pop(0) if self.watches else FakeResponse(200, hang=True)
            return answer if isinstance(answer, FakeResponse) else FakeResponse(200, events=answer)
        code, items = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        return FakeResponse(code, {"metadata": {"resourceVersion": "10"}, "items": items}, reason="Why")

    def listed(self) -> list[dict]:
        return [c for c in self.calls if not c.get("watch")]

    def watched(self) -> list[dict]:
        return [c for c in self.calls if c.get("watch")]


async def run_until(informer: Informer, predicate, timeout: float = 4.0) -> None:
    task = asyncio.create_task(informer.run())
    try:
        for _ in range(int(timeout / 0.01)):
            if predicate():
                return
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")
    finally:
        task.cancel()
        await asyncio.wait([task])


def recording_sleeps(informer: Informer) -> list[float]:
    """The informer's back-off waits, recorded and not waited."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    informer.sleep = sleep
    return waits


async def test_a_watch_that_ends_is_started_again_from_the_last_resource_version():
    """The server ends each watch (its timeout): the informer watches again from the last
    resourceVersion seen, of an event or a bookmark, without listing; bookmarks are not reported;
    each watch asks for bookmarks and for a timeout drawn between watch_timeout_s and twice that."""
    api = FakeNodes([(200, [node("a", "1")])], [
        [{"type": "MODIFIED", "object": node("a", "11")}, {"type": "ADDED", "object": node("b", "12")}],
        [bookmark("20")],
        [{"type": "DELETED", "object": node("b", "21")}, bookmark("30")],
    ])
    seen = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", field_selector="metadata.name=a", settings=FAST, rng=random.Random(7))
    await run_until(informer, lambda: len(api.watched()) >= 4)
    assert len(api.listed()) == 1
    assert [w["resource_version"] for w in api.watched()] == ["10", "12", "20", "30"]
    assert seen == [("MODIFIED", "a"), ("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "b")]
    assert set(informer.cache) == {"a"} and informer.synced.is_set()
    watch = api.watched()[0]
    assert watch["field_selector"] == "metadata.name=a" and watch["allow_watch_bookmarks"] is True
    timeouts = [w["timeout_seconds"] for w in api.watched()]
    assert all(300 <= t < 600 for t in timeouts) and len(set(timeouts)) > 1, timeouts


async def test_410_gone_lists_again_and_reports_what_vanished():
    api = FakeNodes([(200, [node("a", "1"), node("b", "2")]), (200, [node("a", "3")])],
                    [[{"type": "ERROR", "object": status(410, "Expired", "too old resource version: 10 (40)")}]])
    seen = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", settings=FAST)
    await run_until(informer, lambda: len(api.watched()) >= 2)
    assert len(api.listed()) == 2
    assert sorted(seen[2:]) == [("DELETED", "b"), ("MODIFIED", "a")]
    assert set(informer.cache) == {"a"} and informer.cache["a"]["metadata"]["resourceVersion"] == "3"


async def test_an_object_made_again_under_its_name_while_no_watch_ran_is_reported_gone_first():
    """Deleted and made again under its name during a watch gap (410 Gone): the relist holds the new
    object only. The old one is reported DELETED (as the watch would have), then the new MODIFIED:
    a consumer keyed by name does not take the new object for the old one."""
    old, new = node("a", "1"), node("a", "3")
    old["metadata"]["uid"], new["metadata"]["uid"] = "uid-1", "uid-2"
    same = node("b", "2") | {"metadata": {"name": "b", "resourceVersion": "2", "uid": "uid-b"}}
    api = FakeNodes([(200, [old, same]), (200, [new, same])],
                    [[{"type": "ERROR", "object": status(410, "Expired", "too old resource version: 10 (40)")}]])
    seen = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"],
                                                                      obj["metadata"]["uid"])),
                        name="nodes", settings=FAST)
    await run_until(informer, lambda: len(api.watched()) >= 2)
    assert seen[2:] == [("DELETED", "a", "uid-1"), ("MODIFIED", "a", "uid-2")]
    assert informer.cache["a"]["metadata"]["uid"] == "uid-2"


class PagedNodes:
    """`list_node` whose lists come in pages of two: the continue token names the next page;
    each page in `expire` answers 410 once (the continue token expired), as often as it is there."""

    def __init__(self, names, expire=()):
        self.names, self.expire, self.calls = names, list(expire), []

    async def list_node(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            return FakeResponse(200, hang=True)
        start = int(kwargs.get("_continue") or 0)
        if start in self.expire:
            self.expire.remove(start)
            return FakeResponse(410, status(410, "Expired", "continue token expired"), reason="Gone")
        limit = kwargs.get("limit") or len(self.names)
        end = start + limit
        metadata = {"resourceVersion": "50"} | ({"continue": str(end)} if end < len(self.names) else {})
        return FakeResponse(200, {"metadata": metadata, "items": [node(n, "1") for n in self.names[start:end]]})


async def listed_in_pages(api: PagedNodes) -> tuple[Informer, list[tuple[str, str]], list[dict]]:
    """An informer listing `api` two objects a page, run until it watches: it, what it reported,
    the list calls."""
    seen: list[tuple[str, str]] = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", settings=FAST)
    informer.page_size = 2
    await run_until(informer, lambda: any(c.get("watch") for c in api.calls))
    return informer, seen, [c for c in api.calls if not c.get("watch")]


async def test_a_list_is_read_page_by_page(caplog):
    api = PagedNodes(["a", "b", "c", "d", "e"])
    informer, seen, lists = await listed_in_pages(api)
    assert [(c.get("limit"), c.get("_continue")) for c in lists] == [(2, None), (2, "2"), (2, "4")]
    assert set(informer.cache) == {"a", "b", "c", "d", "e"} and len(seen) == 5
    assert api.calls[-1]["resource_version"] == "50"
    assert Informer.page_size == 500


async def test_a_list_whose_continue_token_expired_starts_over_page_by_page(caplog):
    """A list that outlived its continue token (etcd compacts every 5 minutes) starts again from its
    first page, a page at a time: never in one page (client-go's pager's fallback), which for 50,000
    pods is hundreds of MB read at once, past the planner's memory limit."""
    api = PagedNodes(["a", "b", "c", "d", "e"], expire=[4])
    informer, seen, lists = await listed_in_pages(api)
    assert [(c.get("limit"), c.get("_continue")) for c in lists] == [(2, None), (2, "2"), (2, "4"),
                                                                     (2, None), (2, "2"), (2, "4")]
    assert set(informer.cache) == {"a", "b", "c", "d", "e"}
    assert sorted(seen) == [("MODIFIED", n) for n in "abcde"]  # nothing reported twice, nothing DELETED
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_list_whose_continue_token_keeps_expiring_fails_and_backs_off(caplog):
    """After `list_restarts` restarts in a row, one more expiry fails the list: the informer backs off
    and lists again from scratch (a fresh count of restarts), and never lists in one page."""
    api = PagedNodes(["a", "b", "c", "d", "e"], expire=[2] * 5)
    seen: list[tuple[str, str]] = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", settings=FAST)
    informer.page_size, informer.list_restarts = 2, 3
    waits = recording_sleeps(informer)
    await run_until(informer, lambda: any(c.get("watch") for c in api.calls))
    lists = [(c.get("limit"), c.get("_continue")) for c in api.calls if not c.get("watch")]
    # four tries that expire on the second page (the list fails), then one more after the back-off, and
    # its restart reads every page
    assert lists == [(2, None), (2, "2")] * 5 + [(2, None), (2, "2"), (2, "4")]
    assert len(waits) == 1 and sorted(seen) == [("MODIFIED", n) for n in "abcde"]
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failed) == 1 and "list nodes failed" in failed[0] and "expired 4 times in a row" in failed[0], failed


async def test_failed_watches_back_off_exponentially_and_list_again():
    """A watch refused (403) or failing in its stream (an ERROR event) backs off as a failed list
    does: each wait doubles, drawn between half and all of it, up to backoff_max_s."""
    forbidden = FakeResponse(403, status(403, "Forbidden", "cannot watch nodes"), reason="Forbidden")
    error = [{"type": "ERROR", "object": status(500, "InternalError", "etcd")}]
    api = FakeNodes([(200, [node("a", "1")])], [forbidden, error] * 4)
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes",
                        settings=KubeSettings(backoff_initial_s=1, backoff_multiplier=2, backoff_max_s=8))
    waits = recording_sleeps(informer)
    await run_until(informer, lambda: len(waits) >= 6)
    for wait, nominal in zip(waits, [1, 2, 4, 8, 8, 8], strict=False):
        assert nominal / 2 <= wait <= nominal, waits
    assert len(set(waits)) == len(waits)  # jitter: no two informers (agents) come back in step
    assert len(api.listed()) >= 6  # after a failed watch, the informer lists again


async def test_a_429_is_waited_out_as_the_server_asks_then_watched_again():
    throttled = FakeResponse(429, status(429, "TooManyRequests"), reason="Too Many Requests",
                             headers={"Retry-After": "7"})
    api = FakeNodes([(200, [node("a", "1")])], [throttled])
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes", settings=FAST)
    waits = recording_sleeps(informer)
    await run_until(informer, lambda: len(api.watched()) >= 2)
    assert waits == [7.0]
    assert len(api.listed()) == 1 and [w["resource_version"] for w in api.watched()] == ["10", "10"]


async def test_a_throttled_list_waits_as_the_server_asks(caplog):
    class Throttled(FakeNodes):
        async def list_node(self, **kwargs):
            if not kwargs.get("watch") and len(self.listed()) == 0:
                self.calls.append(kwargs)
                return FakeResponse(429, status(429, "TooManyRequests"), reason="Too Many Requests",
                                    headers={"Retry-After": "3"})
            return await super().list_node(**kwargs)

    api = Throttled([(200, [node("a", "1")])])
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes", settings=FAST)
    waits = recording_sleeps(informer)
    await run_until(informer, lambda: "a" in informer.cache)
    assert waits == [3.0]
    assert any("list nodes failed" in r.message and "429" in r.message for r in caplog.records)


async def test_failed_lists_back_off_and_the_cache_survives(caplog):
    api = FakeNodes([(200, [node("a", "1")]), (500, []), (503, []), (200, [node("a", "1"), node("b", "2")])],
                    [[]])  # the first watch ends at once, with nothing: it failed
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes", settings=FAST)
    await run_until(informer, lambda: "b" in informer.cache)
    assert set(informer.cache) == {"a", "b"}
    assert sum("list nodes failed" in r.message for r in caplog.records) == 2
    assert sum("ended the watch at once" in r.message for r in caplog.records) == 1


async def test_a_failing_callback_does_not_stop_the_informer():
    api = FakeNodes([(200, [node("a", "1")]), (200, [node("a", "2")])], [])
    calls = []

    def on_change(kind, obj):
        calls.append(obj["metadata"]["resourceVersion"])
        if len(calls) == 1:
            raise RuntimeError("bug in a callback")

    informer = Informer(api.list_node, on_change, name="nodes", settings=FAST)
    await run_until(informer, lambda: "2" in calls)


async def test_a_paged_list_is_applied_whole_after_its_last_page():
    """A reader between two pages sees the cache as it was, never a mix of two moments: the
    changes of a relist are applied (and reported) once its last page is in."""
    api = PagedNodes(["a", "b", "c"])
    seen: list[tuple[str, str]] = []
    informer = Informer(api.list_node, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                        name="nodes", settings=FAST)
    informer.page_size = 2
    informer.cache = {"a": node("a", "0"), "z": node("z", "0")}  # before the relist: z is gone since
    pages = 0
    inner = api.list_node

    async def list_node(**kwargs):
        nonlocal pages
        if not kwargs.get("watch"):
            pages += 1
            if pages == 2:  # between the pages: nothing of the first applied yet
                assert informer.cache["a"]["metadata"]["resourceVersion"] == "0" and seen == []
        return await inner(**kwargs)

    informer.list_fn = list_node
    assert await informer._relist() == "50"
    assert pages == 2 and set(informer.cache) == {"a", "b", "c"}
    assert sorted(seen) == [("DELETED", "z"), ("MODIFIED", "a"), ("MODIFIED", "b"), ("MODIFIED", "c")]


async def test_watching_is_true_only_while_a_watch_is_open_and_lists_count_every_list_started():
    """What a reader of the cache relies on (the agent's node reads): `watching` while a watch
    stream is open, false while the informer lists or backs off; `lists` counts each list."""
    api = FakeNodes([(200, [node("a", "1")])], [
        [{"type": "ERROR", "object": status(410, "Expired", "too old")}],  # lists again
    ])
    informer = Informer(api.list_node, lambda kind, obj: None, name="nodes", settings=FAST)
    assert not informer.watching and informer.lists == 0
    states: list[tuple[bool, int]] = []
    recording_sleeps(informer)
    original = api.list_node

    async def list_node(**kwargs):
        states.append((informer.watching, informer.lists))
        return await original(**kwargs)

    informer.list_fn = list_node
    await run_until(informer, lambda: len(api.watched()) >= 2 and informer.watching and informer.lists == 2)
    assert not informer.watching  # stopped: the watch is closed
    # (watching, lists) as each call went out: list 1, watch (410: not watching after it), list 2, watch
    assert states == [(False, 1), (False, 1), (False, 2), (False, 2)]


async def test_a_list_that_keeps_failing_the_same_way_is_said_at_warning_every_few_minutes(caplog):
    """A kind the cluster's RBAC leaves out (403 at every list) or an API server down for hours:
    each retry is logged, at WARNING only when that failure was not said so in the last
    `repeat_warning_s`; another failure is said at once."""
    api = FakeNodes([(403, [])] * 6 + [(500, []), (200, [node("a", "1")])])
    informer = Informer(api.list_node, lambda kind, obj: None, name="claims", settings=FAST)
    recording_sleeps(informer)
    with caplog.at_level(logging.DEBUG, logger="dynpart.kube.watching"):
        await run_until(informer, lambda: "a" in informer.cache)
    failed = [(r.levelno, "403" in r.getMessage()) for r in caplog.records if "list claims failed" in r.getMessage()]
    assert failed == [(logging.WARNING, True)] + [(logging.DEBUG, True)] * 5 + [(logging.WARNING, False)]
    caplog.clear()
    informer.repeat_warning_s = 0.0  # (as if the minutes had passed)
    api.lists = [(403, []), (200, [node("a", "1")])]
    informer.cache.clear()
    await run_until(informer, lambda: "a" in informer.cache)
    assert [r.levelno for r in caplog.records if "list claims failed" in r.getMessage()] == [logging.WARNING]


def test_a_watch_line_whose_object_is_not_an_object_is_an_api_error_not_a_crash():
    """An ERROR event (or any) whose `object` is not a JSON object (a proxy's, a broken server's)
    ends the watch as an APIError, which lists again after a back-off, not an AttributeError
    logged with a stack trace (review 93)."""
    import json

    import pytest

    from dynpart.kube.errors import APIError

    informer = Informer(lambda **kw: None, lambda kind, obj: None, name="nodes")
    for event in ({"type": "ERROR", "object": "boom"}, {"type": "ADDED", "object": ["n"]},
                  {"type": "MODIFIED", "object": None}):
        with pytest.raises(APIError, match="not a watch event"):
            informer._apply(json.dumps(event).encode(), "watch nodes")
    assert informer.cache == {}


async def test_a_metadata_only_informer_asks_the_api_server_for_metadata_in_lists_and_watches():
    """`metadata_only`: the list asks for PartialObjectMetadataList and the watch for
    PartialObjectMetadata (the generated client would set its own Accept header), with the
    informer's selectors and paging as the API server's query parameters; the objects it answers
    are cached as any others (the e2e spread test runs it against the real kube-apiserver)."""
    from dynpart.kube.watching import METADATA_LIST, METADATA_WATCH, metadata_only

    calls = []

    class FakeApiClient:
        async def call_api(self, path, method, path_params, query, headers, **kw):
            calls.append((path, method, dict(query), headers["Accept"], kw["_preload_content"]))
            if dict(query).get("watch"):
                return FakeResponse(200, hang=True)
            meta = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}
            return FakeResponse(200, {"kind": "PartialObjectMetadataList", "metadata": {"resourceVersion": "10"},
                                      "items": [meta | {"metadata": {"name": "cpu1", "resourceVersion": "3",
                                                                     "labels": {"zone": "z1"}}}]})

    informer = Informer(metadata_only(FakeApiClient(), "/api/v1/nodes"), lambda kind, obj: None, name="other nodes",
                        label_selector="!dynpart.io/gpu-partitioning", settings=FAST)
    await run_until(informer, lambda: len(calls) >= 2)
    (path, method, listed, accept, preload), (_, _, watched, watch_accept, _) = calls[:2]
    assert (path, method, preload) == ("/api/v1/nodes", "GET", False)
    assert accept == METADATA_LIST and watch_accept == METADATA_WATCH
    assert listed["labelSelector"] == "!dynpart.io/gpu-partitioning" and "watch" not in listed
    assert watched["watch"] is True and watched["resourceVersion"] == "10" and watched["allowWatchBookmarks"] is True
    assert informer.cache["cpu1"]["metadata"]["labels"] == {"zone": "z1"}
    with pytest.raises(TypeError, match="pretty"):
        await metadata_only(FakeApiClient(), "/api/v1/nodes")(pretty="true")
