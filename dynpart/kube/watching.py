"""Watching: a small informer that lists, then watches from the list's resourceVersion, keeps
a cache of objects by key, lists again whenever the watch ends (its timeout, 410 Gone, an
error), and calls back on change. The one watch of dynpart: the planner's nodes and pods, and
each agent's own node (with a field selector) go through it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import watch

from dynpart.kube.client import Obj, read_json
from dynpart.kube.errors import APIError, APIGoneError, api_errors
from dynpart.kube.retrying import retrying
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)

__all__ = ["Informer", "Obj", "object_key"]


def object_key(obj: Obj) -> str:
    md = obj.get("metadata", {})
    ns = md.get("namespace")
    return f"{ns}/{md.get('name')}" if ns else str(md.get("name"))


class _RawWatch(watch.Watch):
    """A watch whose events keep the object as the API server sent it: the client would build a
    model object for each event (parsing every field and timestamp) that the informer throws
    away for `raw_object` (a fifth of a planner's CPU under a burst of pods)."""

    def unmarshal_event(self, data: str | bytes, response_type: str | None) -> Any:
        return super().unmarshal_event(data, None)


class Informer:
    """Cache of one resource kind. `list_fn` is e.g. CoreV1Api.list_node or
    CoreV1Api.list_pod_for_all_namespaces; `on_change(type, obj)` runs after each change.
    Selectors narrow what is listed and watched; `settings` gives the watch timeout and the
    back-off between failed lists."""

    def __init__(self, list_fn: Callable[..., Awaitable[Any]], on_change: Callable[[str, Obj], None],
                 *, name: str, label_selector: str | None = None, field_selector: str | None = None,
                 settings: KubeSettings | None = None, transform: Callable[[Obj], Obj] | None = None,
                 on_beat: Callable[[], None] | None = None):
        self.list_fn = list_fn
        # called on every list and watch event, bookmarks included: liveness of the watch
        self.on_beat = on_beat or (lambda: None)
        # what the cache keeps of each object (the planner keeps only what planning reads)
        self.transform = transform or (lambda obj: obj)
        self.on_change = on_change
        self.name = name
        self.kwargs = {k: v for k, v in (("label_selector", label_selector), ("field_selector", field_selector)) if v}
        self.settings = settings or KubeSettings()
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()

    async def _relist(self) -> str:
        what = f"list {self.name}"
        with api_errors(what):
            resp = await self.list_fn(_preload_content=False, **self.kwargs)
        body = await read_json(resp, what)
        self.on_beat()
        fresh = {object_key(o): self.transform(o) for o in body.get("items", [])}
        for key in set(self.cache) - set(fresh):
            self.on_change("DELETED", self.cache.pop(key))
        for key, obj in fresh.items():
            if self.cache.get(key, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self.cache[key] = obj
                self.on_change("MODIFIED", obj)
        self.synced.set()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, resource_version: str) -> None:
        """Apply the watch's events until it ends (the server closes it after the timeout)."""
        with api_errors(f"watch {self.name}"):
            async with _RawWatch() as w:
                async for event in w.stream(self.list_fn, resource_version=resource_version,
                                            timeout_seconds=self.settings.watch_timeout_s,
                                            allow_watch_bookmarks=True, **self.kwargs):
                    kind, obj = event["type"], event["raw_object"]
                    self.on_beat()
                    if kind == "BOOKMARK":
                        continue
                    obj = self.transform(obj)
                    key = object_key(obj)
                    if kind == "DELETED":
                        self.cache.pop(key, None)
                    else:
                        self.cache[key] = obj
                    self.on_change(kind, obj)

    async def run(self) -> None:
        """List and watch until cancelled. A failed list is retried with back-off; after a watch
        ends, the informer lists again after the initial back-off."""
        while True:
            try:
                async for attempt in retrying(self.settings, f"list {self.name}", logger=log):
                    with attempt:
                        resource_version = await self._relist()
                await self._watch(resource_version)
            except APIGoneError:
                pass  # the list's resourceVersion is too old to watch from: list again
            except APIError as e:
                log.warning("watch %s: %s; relisting in %.1fs", self.name, e, self.settings.backoff_initial_s)
            except Exception:  # keep the informer alive: a dead one would leave its cache silently stale
                log.exception("watch %s failed; relisting in %.1fs", self.name, self.settings.backoff_initial_s)
            await asyncio.sleep(self.settings.backoff_initial_s)
