"""A write the API server throttles (429 Too Many Requests, with a Retry-After: API Priority and
Fairness turned it away, so it was not applied) is sent again after that long, a few times, as
client-go's REST client does; reads and Events are not (the informer waits out a Retry-After
itself; an Event is advice)."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from dynpart.kube.client import THROTTLED_WRITE_RETRIES, api_client
from dynpart.kube.errors import APIClientError
from dynpart.kube.events import post_event
from dynpart.kube.patching import patch_node_annotations

from .fakes import FakeAPIServer, status


def throttling(server: FakeAPIServer, method: str, path: str, times: int, retry_after: str | None = "1") -> list[str]:
    """`method path` answered 429 (with `retry_after`) `times` times, then 200; the bodies sent."""
    bodies: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.text())
        if len(bodies) <= times:
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            return web.json_response(status(429, "TooManyRequests"), status=429, headers=headers)
        if method == "POST":  # an Event: created as sent
            return web.json_response(await request.json(), status=201)
        return web.json_response({"kind": "Node", "metadata": {"name": "n", "annotations": {"a": "1"}}})

    server.handlers[(method, path)] = handler
    return bodies


async def connect(server: FakeAPIServer, tmp_path) -> tuple[client.ApiClient, list[float]]:
    api = await api_client(server.kubeconfig(tmp_path))
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    api.rest_client.sleep = sleep
    return api, waits


async def test_a_throttled_patch_is_sent_again_after_its_retry_after(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dynpart.kube.client")
    async with FakeAPIServer() as server:
        bodies = throttling(server, "PATCH", "/api/v1/nodes/n", times=2, retry_after="2")
        api, waits = await connect(server, tmp_path)
        try:
            node = await patch_node_annotations(client.CoreV1Api(api), "n", {"a": "1"}, "7")
        finally:
            await api.close()
    assert node["metadata"]["annotations"] == {"a": "1"}
    assert len(bodies) == 3 and len(set(bodies)) == 1 and '"resourceVersion": "7"' in bodies[0]  # the same patch
    assert len(waits) == 2 and all(2 <= w <= 2 * 4 / 3 for w in waits), waits  # no sooner than asked, jittered
    assert sum("throttled (429)" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO) == 2


async def test_a_write_throttled_again_and_again_fails_with_its_429(tmp_path):
    async with FakeAPIServer() as server:
        bodies = throttling(server, "PATCH", "/api/v1/nodes/n", times=100)
        api, waits = await connect(server, tmp_path)
        try:
            with pytest.raises(APIClientError) as raised:
                await patch_node_annotations(client.CoreV1Api(api), "n", {"a": "1"})
            with pytest.raises(client.ApiException) as preloaded:  # a call that reads the answer itself
                await client.CoreV1Api(api).patch_node("n", {"metadata": {"labels": {"x": "y"}}})
        finally:
            await api.close()
    assert raised.value.status == 429 and preloaded.value.status == 429
    assert len(bodies) == 2 * (1 + THROTTLED_WRITE_RETRIES) and len(waits) == 2 * THROTTLED_WRITE_RETRIES == 6


@pytest.mark.parametrize("retry_after", [None, "soon", "3600"])
async def test_a_429_without_a_short_retry_after_is_the_callers(tmp_path, retry_after):
    """No Retry-After (or an unreadable one): nothing says when; a long one is not waited for inside
    a call (a planner round, a lease renewal): the caller's loop comes back later."""
    async with FakeAPIServer() as server:
        bodies = throttling(server, "PATCH", "/api/v1/nodes/n", times=1, retry_after=retry_after)
        api, waits = await connect(server, tmp_path)
        try:
            with pytest.raises(APIClientError):
                await patch_node_annotations(client.CoreV1Api(api), "n", {"a": "1"})
        finally:
            await api.close()
    assert len(bodies) == 1 and waits == []


async def test_reads_and_events_are_not_sent_again(tmp_path, caplog, monkeypatch):
    from dynpart.kube import events as events_module
    monkeypatch.setattr(events_module, "_failed", events_module._FailureLog())  # (no failure of another test's)
    async with FakeAPIServer() as server:
        reads = throttling(server, "GET", "/api/v1/nodes/n", times=1)
        events = throttling(server, "POST", "/api/v1/namespaces/default/events", times=1)
        api, waits = await connect(server, tmp_path)
        try:
            core = client.CoreV1Api(api)
            with pytest.raises(client.ApiException):
                await core.read_node("n")
            await post_event(core, {"kind": "Node", "metadata": {"name": "n"}}, "R", "m", "dynpart-test")
            await post_event(core, {"kind": "Node", "metadata": {"name": "n"}}, "R", "m", "dynpart-test")
        finally:
            await api.close()
    assert len(reads) == 1 and len(events) == 2 and waits == []  # the second Event: posted, not a retry
    assert sum("could not post event R" in r.getMessage() for r in caplog.records) == 1


def test_failed_event_posts_warn_once_a_minute_with_the_count_since(caplog):
    """An API server down: every Event fails; one warning a minute says so, the rest at DEBUG."""
    import logging

    from dynpart.kube.events import _FailureLog
    now = [0.0]
    failures = _FailureLog(every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="dynpart.kube.events"):
        for t in (0, 1, 2, 59, 60, 61, 130):
            now[0] = float(t)
            failures.note(f"could not post event R at {t}")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["could not post event R at 0", "could not post event R at 60 (3 more Event(s) not posted "
                      "since the last such warning)", "could not post event R at 130 (1 more Event(s) not posted "
                      "since the last such warning)"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4
