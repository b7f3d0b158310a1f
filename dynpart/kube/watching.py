"""Watching: a small informer, as client-go's Reflector: lists (page by page), then watches from
the list's resourceVersion, keeps a cache of objects by key, and calls back on change. When the
server ends a watch (its timeout) or the connection drops, it watches again from the last
resourceVersion seen (of an event or a BOOKMARK); it lists again only when that is too old (410
Gone) or the watch failed. Failures back off exponentially, with jitter, as long as they follow
one another. The one watch of dynpart: the planner's nodes and pods, and each agent's own node
(with a field selector) go through it."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp

from dynpart.kube.client import Obj, read_json
from dynpart.kube.errors import APIError, APIGoneError, APITransportError, api_errors, status_error
from dynpart.kube.retrying import Backoff, retry_after
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)

__all__ = ["Informer", "Obj", "object_key"]


def object_key(obj: Obj) -> str:
    md = obj.get("metadata", {})
    ns = md.get("namespace")
    return f"{ns}/{md.get('name')}" if ns else str(md.get("name"))


class _ListFailed(Exception):
    """The list failed (its cause attached): the informer lists again after the back-off."""


class Informer:
    """Cache of one resource kind. `list_fn` is e.g. CoreV1Api.list_node or
    CoreV1Api.list_pod_for_all_namespaces; `on_change(type, obj)` runs after each change (a list
    reports each object that changed as MODIFIED and each that vanished as DELETED, an object made
    again under its name, with another uid, as DELETED and then MODIFIED; BOOKMARKs are not
    reported). Selectors narrow what is listed and watched; `settings` gives the watch
    timeout, the back-off between failures; `rng` draws the watch timeouts and the jitter."""

    page_size = 500  # objects a list asks for at once (client-go's pager)
    list_restarts = 3  # a list whose continue token expires starts again this many times in a row, then fails
    healthy_after_s = 120.0  # a failure this long after the last one backs off from the start again
    repeat_warning_s = 300.0  # the same failure is logged at WARNING at most this often (else DEBUG)
    short_watch_s = 1.0  # a watch that ends sooner with nothing in it failed (client-go: "very short watch")

    def __init__(self, list_fn: Callable[..., Awaitable[Any]], on_change: Callable[[str, Obj], None],
                 *, name: str, label_selector: str | None = None, field_selector: str | None = None,
                 settings: KubeSettings | None = None, transform: Callable[[Obj], Obj] | None = None,
                 on_beat: Callable[[], None] | None = None, rng: random.Random | None = None):
        self.list_fn = list_fn
        # called on every list page, watch start and watch event, bookmarks included: liveness of
        # the watch (a silent watch is dropped after watch_idle_timeout_s and started again)
        self.on_beat = on_beat or (lambda: None)
        # what the cache keeps of each object (the planner keeps only what planning reads)
        self.transform = transform or (lambda obj: obj)
        self.on_change = on_change
        self.name = name
        self.kwargs = {k: v for k, v in (("label_selector", label_selector), ("field_selector", field_selector)) if v}
        self.settings = settings or KubeSettings()
        self.rng = rng or random.Random()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the back-off's (tests record it)
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.resource_version = ""  # the last one seen: of the list, of an event or of a bookmark
        # while True, a watch is open and the cache follows the server, lagging by the events in
        # flight (and, on a connection cut without a close, until watch_idle_timeout_s ends it)
        self.watching = False
        self.lists = 0  # lists started: a list started after a write returned includes that write
        self._retry_after: float | None = None  # the last failed call's Retry-After
        self._warned: dict[str, float] = {}  # failure -> when it was last logged at WARNING
        self._silence_said = False  # a watch that went silent was logged at INFO once

    async def _read(self, resp: object, what: str) -> Obj:
        """`read_json`, keeping the Retry-After of a 429 or 503."""
        raw = cast(aiohttp.ClientResponse, resp)
        if raw.status in (429, 503):
            self._retry_after = retry_after(raw.headers.get("Retry-After"))
        return await read_json(resp, what)

    async def list_once(self) -> None:
        """Fill the cache with one list, as the informer's first (a one-shot reader's: no watch)."""
        await self._relist()

    async def _relist(self) -> str:
        """List every object, `page_size` at a time, then apply the whole list to the cache at once
        (a reader between two pages must not see a mix of two moments): objects that changed are
        reported MODIFIED, those that vanished DELETED. Returns the list's resourceVersion. A list
        whose continue token expired (410: it took longer than the API server keeps one, about 5
        minutes of etcd compaction) starts again from its first page, at most `list_restarts` times
        in a row; one more expiry fails the list (the informer backs off). Never in one page, as
        client-go's pager falls back to: 50,000 pods are hundreds of MB of JSON read at once, more
        than the planner's memory limit (killed, restarted, listing again)."""
        what = f"list {self.name}"
        self.lists += 1
        fresh: dict[str, Obj] = {}
        token = ""
        restarts = 0
        while True:
            page: dict[str, Any] = {"limit": self.page_size, **({"_continue": token} if token else {})}
            with api_errors(what):
                resp = await self.list_fn(_preload_content=False, **self.kwargs, **page)
            try:
                body = await self._read(resp, what)
            except APIGoneError as e:
                if not token:
                    raise
                if restarts >= self.list_restarts:
                    raise APIGoneError(f"{what}: its continue token expired {restarts + 1} times in a row",
                                       status=e.status, reason=e.reason) from e
                restarts += 1
                log.info("list %s: its continue token expired; listing again from the first page", self.name)
                fresh.clear()  # the pages read so far are of an older moment than the new list's
                token = ""
                continue
            self.on_beat()
            for item in body.get("items") or []:
                obj = self.transform(item)
                fresh[object_key(obj)] = obj
            metadata = body.get("metadata") or {}
            token = str(metadata.get("continue") or "")
            if not token:
                break
        for key, obj in fresh.items():
            was = self.cache.get(key)
            if was is not None and _uid(was) != _uid(obj):
                # deleted and made again under its name while no watch ran: the watch would have
                # said DELETED, then ADDED; the list shows the new object only, so the old one is
                # reported gone first (its reservations, Events and plans are not the new one's)
                self.on_change("DELETED", self.cache.pop(key))
        for key, obj in fresh.items():
            if self.cache.get(key, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self.cache[key] = obj
                self.on_change("MODIFIED", obj)
        for key in set(self.cache) - set(fresh):
            self.on_change("DELETED", self.cache.pop(key))
        self.synced.set()
        return str(metadata.get("resourceVersion", ""))

    async def _watch(self, resource_version: str) -> None:
        """Apply the watch's events until the server ends it (after its timeoutSeconds, drawn
        between watch_timeout_s and twice that, as client-go does, so that watches do not all end
        together). Raises APIGoneError when `resource_version` is too old to watch from."""
        what = f"watch {self.name}"
        timeout = int(self.settings.watch_timeout_s * (1 + self.rng.random()))
        started, lines = time.monotonic(), 0
        with api_errors(what):
            resp = await self.list_fn(watch=True, resource_version=resource_version, timeout_seconds=timeout,
                                      allow_watch_bookmarks=True, _preload_content=False, **self.kwargs)
            raw = cast(aiohttp.ClientResponse, resp)
            try:
                if not 200 <= raw.status <= 299:
                    await self._read(resp, what)  # raises the class of the status
                self.on_beat()
                self.watching = True
                while line := await raw.content.readline():
                    lines += 1
                    self.on_beat()
                    self._apply(line, what)
            except TimeoutError:
                # silent for watch_idle_timeout_s: a half-open connection, or a quiet one: the API
                # server sends a bookmark a minute only when the kind's resourceVersion moved (a
                # small cluster's nodes can stay unchanged for minutes; kube-apiserver 1.35 sent
                # nothing in 150 s to a watch of one quiet node). Either way an end like the
                # server's: watched again from where it was, said once (a failure would warn
                # every few minutes on every quiet node)
                raw.close()
                log.log(logging.DEBUG if self._silence_said else logging.INFO,
                        "watch %s: nothing for %gs (%s); watching again", self.name,
                        self.settings.watch_idle_timeout_s, f"after {lines} line(s)" if lines else "from its start")
                self._silence_said = True
                return
            except BaseException:
                raw.close()  # not read to its end: the connection cannot be used again
                raise
            finally:
                self.watching = False
            raw.release()
        if not lines and time.monotonic() - started < self.short_watch_s:
            raise APIError(f"{what}: the API server ended the watch at once")

    def _apply(self, line: bytes, what: str) -> None:
        """One line of a watch: an event, a bookmark, or an error (a Status)."""
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
            if not isinstance(obj, dict):
                raise TypeError("its object is not a JSON object")
        except (ValueError, KeyError, TypeError) as e:
            raise APIError(f"{what}: not a watch event ({e}): {line[:200]!r}") from None
        if kind == "ERROR":  # a Status: 410 Expired when the resourceVersion is too old
            raise status_error(int(obj.get("code") or 500), f"{obj.get('reason')}: {obj.get('message')}", what)
        resource_version = obj.get("metadata", {}).get("resourceVersion")
        if kind != "BOOKMARK":
            obj = self.transform(obj)
            key = object_key(obj)
            if kind == "DELETED":
                self.cache.pop(key, None)
            else:
                self.cache[key] = obj
        if resource_version:
            self.resource_version = str(resource_version)
        if kind != "BOOKMARK":
            self.on_change(kind, obj)

    def _level(self, failure: str) -> int:
        """WARNING for a failure not logged so in the last `repeat_warning_s`, else DEBUG: a list
        that keeps failing the same way (RBAC that leaves a kind out, an API server down for hours)
        is said every few minutes, not at every retry."""
        now = time.monotonic()
        if now - self._warned.get(failure, -float("inf")) < self.repeat_warning_s:
            return logging.DEBUG
        self._warned = {f: t for f, t in self._warned.items() if now - t < self.repeat_warning_s}
        self._warned[failure] = now
        return logging.WARNING

    async def run(self) -> None:
        """List and watch until cancelled. After a watch ends, watch again from the last
        resourceVersion; after a failure, back off (`Backoff`), then list again, or watch again
        when the watch failed only for want of an answer or a 429 (Too Many Requests)."""
        backoff = Backoff(self.settings, reset_after_s=self.healthy_after_s, rng=self.rng)
        listed = False
        while True:
            self._retry_after = None
            try:
                if not listed:
                    try:
                        self.resource_version = await self._relist()
                    except Exception as e:
                        raise _ListFailed() from e
                    listed = True
                await self._watch(self.resource_version)
                continue  # the server ended the watch: watch again from where it was
            except _ListFailed as failed:
                cause = failed.__cause__ or failed
                wait = backoff.next(self._retry_after)
                if isinstance(cause, APIError):
                    log.log(self._level(str(cause)), "list %s failed (%s); listing again in %.1fs", self.name, cause,
                            wait)
                else:
                    log.error("list %s failed; listing again in %.1fs", self.name, wait, exc_info=cause)
            except APIGoneError as e:  # too old to watch from: list again
                listed = False
                wait = backoff.next(self._retry_after)
                log.info("watch %s: %s; listing again in %.1fs", self.name, e, wait)
            except APIError as e:
                # no answer (the connection dropped or went silent) or 429: the resourceVersion
                # still holds; any other failure lists again
                listed = isinstance(e, APITransportError) or e.status == 429
                wait = backoff.next(self._retry_after)
                log.log(self._level(str(e)), "watch %s failed (%s); %s again in %.1fs", self.name, e,
                        "watching" if listed else "listing", wait)
            except Exception:  # keep the informer alive: a dead one would leave its cache silently stale
                listed = False
                wait = backoff.next(self._retry_after)
                log.exception("watch %s failed; listing again in %.1fs", self.name, wait)
            await self.sleep(wait)


def _uid(obj: Obj) -> object:
    return (obj.get("metadata") or {}).get("uid")


# The API server's metadata-only form of a list and a watch (client-go's metadata informers): each
# object as a PartialObjectMetadata, its `metadata` whole (labels, annotations, owners), no spec or
# status. JSON is the fallback of a server that cannot (it then sends the objects whole).
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
_QUERY = {"label_selector": "labelSelector", "field_selector": "fieldSelector", "limit": "limit",
          "_continue": "continue", "watch": "watch", "resource_version": "resourceVersion",
          "timeout_seconds": "timeoutSeconds", "allow_watch_bookmarks": "allowWatchBookmarks"}


def metadata_only(api_client: Any, path: str) -> Callable[..., Awaitable[Any]]:
    """A `list_fn` for `Informer` that lists and watches the objects at `path` (e.g. /api/v1/nodes)
    as metadata only: a node's status (images, conditions, addresses) is most of its size, and a
    watch of thousands of them that reads only labels need not carry it. The generated client sets
    its own Accept header, so this calls the API client directly."""
    async def list_fn(**kwargs: Any) -> Any:
        unknown = set(kwargs) - set(_QUERY) - {"_preload_content", "_request_timeout"}
        if unknown:
            raise TypeError(f"metadata_only({path}): unexpected argument(s) {sorted(unknown)}")
        query = [(_QUERY[k], v) for k, v in kwargs.items() if k in _QUERY and v is not None]
        accept = METADATA_WATCH if kwargs.get("watch") else METADATA_LIST
        return await api_client.call_api(path, "GET", {}, query, {"Accept": accept},
                                         response_types_map={200: "object", 401: None},
                                         auth_settings=["BearerToken"], _return_http_data_only=True,
                                         _preload_content=kwargs.get("_preload_content", True),
                                         _request_timeout=kwargs.get("_request_timeout"))
    return list_fn
