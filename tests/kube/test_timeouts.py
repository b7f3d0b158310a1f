"""Every API call has a time bound (kubernetes-asyncio's default is to wait for ever)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from dynpart.kube.client import api_client, request_timeout
from dynpart.kube.watching import Informer
from dynpart.settings import KubeSettings

from .fakes import FakeAPIServer


def test_a_call_is_bounded_as_a_whole_and_a_watch_by_silence():
    """A watch is dropped after watch_idle_timeout_s of silence, however long its timeout: a healthy
    one of a kind that changes receives a bookmark about every minute."""
    s = KubeSettings(request_timeout_s=7, watch_timeout_s=300, watch_idle_timeout_s=60)
    call = request_timeout([("labelSelector", "x")], s)
    assert call.total == 7
    watch = request_timeout([("watch", True), ("timeoutSeconds", 300)], s)
    assert watch.total is None and watch.sock_read == 60 and watch.sock_connect == 7
    assert request_timeout([("watch", True)], KubeSettings(watch_timeout_s=3000)).sock_read == 120


def is_watch(request: web.Request) -> bool:
    return request.query.get("watch", "").lower() == "true"


async def two_watches(server: FakeAPIServer, tmp_path, backoff_initial_s: float) -> list:
    """Run a node informer against `server` (watches dropped after 0.3 s of silence) until it has
    sent two watches, or 3 s; the query of each watch it sent."""
    settings = KubeSettings(watch_timeout_s=300, watch_idle_timeout_s=0.3, backoff_initial_s=backoff_initial_s)
    api = await api_client(server.kubeconfig(tmp_path), settings)
    informer = Informer(client.CoreV1Api(api).list_node, lambda kind, obj: None, name="nodes", settings=settings)
    task = asyncio.create_task(informer.run())
    try:
        for _ in range(300):
            if sum(map(is_watch, server.requests)) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.wait([task])
        await api.close()
    return [r.query for r in server.requests if is_watch(r)]


async def test_a_silent_watch_is_dropped_and_started_again_from_where_it_was(tmp_path, caplog):
    """A watch that the API server holds open and never writes to (half-open, or quiet) is dropped
    after watch_idle_timeout_s, not after its timeout, and watched again from the list's
    resourceVersion without listing again: as a watch the server ended (no warning, no back-off)."""
    async with FakeAPIServer() as server:
        async def nodes(request: web.Request) -> web.StreamResponse:
            if not is_watch(request):
                return web.json_response({"kind": "NodeList", "metadata": {"resourceVersion": "10"},
                                          "items": [{"metadata": {"name": "a", "resourceVersion": "1"}}]})
            resp = web.StreamResponse()
            await resp.prepare(request)
            await server.closing.wait()  # silent
            return resp

        server.handlers[("GET", "/api/v1/nodes")] = nodes
        with caplog.at_level(logging.DEBUG, logger="dynpart.kube.watching"):
            watches = await two_watches(server, tmp_path, backoff_initial_s=5)
        assert len(watches) >= 2, "the silent watch was not dropped in 3 s"
        assert len(server.requests) - len(watches) == 1  # one list
        assert [w["resourceVersion"] for w in watches[:2]] == ["10", "10"]  # no 5 s back-off in between
        assert all(w["allowWatchBookmarks"].lower() == "true" and 300 <= int(w["timeoutSeconds"]) < 600 for w in watches)
        # silent from the start, as a watch of a quiet kind is where the server sends no bookmark
        # (its resourceVersion did not move): not a failure; said once at INFO, then at DEBUG
        said = [r.levelname for r in caplog.records if r.name == "dynpart.kube.watching" and "nothing for" in r.message]
        assert said[:1] == ["INFO"] and set(said[1:]) <= {"DEBUG"}
        assert not [r for r in caplog.records if r.name == "dynpart.kube.watching" and r.levelno >= logging.WARNING]


async def test_a_watch_silent_after_events_is_watched_again_at_once(tmp_path, caplog):
    """A watch that delivered an event and then went silent for watch_idle_timeout_s (a server
    that sends no bookmarks) ends like one the server ended: watched again from the event's
    resourceVersion, no warning."""
    async with FakeAPIServer() as server:
        async def nodes(request: web.Request) -> web.StreamResponse:
            if not is_watch(request):
                return web.json_response({"kind": "NodeList", "metadata": {"resourceVersion": "10"}, "items": []})
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b'{"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "11"}}}\n')
            await server.closing.wait()  # then silent
            return resp

        server.handlers[("GET", "/api/v1/nodes")] = nodes
        watches = await two_watches(server, tmp_path, backoff_initial_s=5)
        assert [w["resourceVersion"] for w in watches[:2]] == ["10", "11"]  # no 5 s back-off in between
        assert not [r for r in caplog.records if r.name == "dynpart.kube.watching" and r.levelname == "WARNING"]


async def test_a_server_that_never_answers_fails_the_call_in_time(tmp_path):
    """A listening socket that accepts and never answers: the call fails after request_timeout_s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    api = await api_client(str(kubeconfig), KubeSettings(request_timeout_s=0.5))
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):  # aiohttp's ServerTimeoutError is one
            await client.CoreV1Api(api).read_node("n")
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < 5, f"the call took {elapsed:.1f} s"
    finally:
        await api.close()
        server.close()
