"""`KubeNodeApi`'s reads from its watch (the API-server side is `test_kube_e2e.py`): which copy a
read may use, against an informer stand-in whose state the test sets."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kubernetes_asyncio import client

from dynpart.agent.kube import FRESH_S, QUORUM_S, KubeNodeApi
from dynpart.kube.errors import APIServerError


def node(version: str, plan: str = "p1") -> dict:
    return {"metadata": {"name": "n", "resourceVersion": version, "annotations": {"dynpart.io/spec-plan": plan}}}


def watched(version: str) -> tuple[KubeNodeApi, SimpleNamespace]:
    api = KubeNodeApi(client.ApiClient(), "n")
    informer = SimpleNamespace(watching=True, cache={"n": node(version)}, lists=1)
    api._informer = informer  # type: ignore[assignment]
    api._heard = time.monotonic()
    api._delivered(version)
    return api, informer


async def test_a_get_newer_than_the_watch_keeps_reads_off_the_copy_until_the_watch_has_it():
    """A read never goes back in time: after a GET answered version 7, the copy at 5 is not read
    until the watch delivers 7 (or later: what it delivers holds what was learnt before it)."""
    api, informer = watched("5")
    assert api._watched() is not None
    api._learnt(node("7", "p2"), read=True)
    assert api._watched() is None
    api._learnt(node("8"))  # the agent's own write after it
    informer.cache["n"] = node("7", "p2")
    api._delivered("7")
    assert api._watched() is None  # its own write still to come
    informer.cache["n"] = node("9", "p2")
    api._delivered("9")  # a later version, its write's own event folded into a relist: still not 8...
    assert api._watched() is None
    informer.lists = 2  # ... until a list started after it
    view = api._watched()
    assert view is not None and view.resource_version == "9"


async def test_a_get_that_answers_the_watchs_version_frees_the_copy():
    """A write whose own event never came (a relist answered a later version) would keep every
    read on GET until the next relist: a GET that answers what the watch holds ends that."""
    api, informer = watched("5")
    api._learnt(node("6"))
    assert api._watched() is None
    informer.cache["n"] = node("7")
    api._delivered("6")
    api._delivered("7")
    assert api._watched() is not None
    api._learnt(node("10"))
    informer.cache["n"] = node("11")
    api._seen.append("11")
    assert api._watched() is None  # 10 not delivered (11 was, outside `_delivered`)
    api._learnt(node("11"), read=True)
    assert api._watched() is not None and not api._unseen


async def test_a_silent_watch_is_confirmed_by_a_get_before_its_copy_is_read():
    """A watch whose connection went silent without closing stays `watching` until its idle
    time-out (120 s): the copy is read only while the watch said something, or a GET answered
    the same version, in the last FRESH_S."""
    api, _ = watched("5")
    api._heard -= FRESH_S + 1
    assert api._watched() is None
    api._learnt(node("5"), read=True)
    assert api._watched() is not None
    api._confirmed -= FRESH_S + 1
    assert api._watched() is None


async def test_a_silent_watch_is_confirmed_from_the_servers_cache_and_else_from_etcd(monkeypatch):
    """The quiet watch's confirmation is a read of any version (the API server's watch cache):
    its version confirms the copy; another version, an error, or no quorum read for QUORUM_S
    sends the read to etcd."""
    calls: list[bool] = []
    answers: dict[bool, object] = {}

    async def read_node(core, name, any_version=False):
        calls.append(any_version)
        answer = answers[any_version]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr("dynpart.agent.kube.read_node", read_node)
    api, informer = watched("5")
    api._quorum_at = time.monotonic()
    answers.update({True: node("5"), False: node("5")})
    api._heard -= FRESH_S + 1
    assert (await api.get()).resource_version == "5" and calls == [True] and api.quorum_reads == 0
    assert api._watched() is not None  # confirmed
    for answer in (node("6", "p2"), APIServerError("read node n (any version): 503", status=503)):
        answers.update({True: answer, False: node("6", "p2")})
        api._confirmed = api._heard = -float("inf")
        calls.clear()
        assert (await api.get()).resource_version == "6" and calls == [True, False]
        informer.cache["n"] = node("6", "p2")
        api._delivered("6")
    api._confirmed = api._heard = -float("inf")
    api._quorum_at = time.monotonic() - QUORUM_S - 1
    calls.clear()
    answers.update({True: node("6", "p2"), False: node("6", "p2")})
    await api.get()
    assert calls == [False] and api.quorum_reads == 3
