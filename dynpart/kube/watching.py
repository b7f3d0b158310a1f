"""Watching: a small informer that lists, then watches from the list's resourceVersion, keeps
a cache of objects by key, relists after errors (410 Gone included), and calls back on change."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.kube.client import read_json

log = logging.getLogger(__name__)

Obj = dict[str, Any]


def object_key(obj: Obj) -> str:
    md = obj.get("metadata", {})
    ns = md.get("namespace")
    return f"{ns}/{md.get('name')}" if ns else str(md.get("name"))


class Informer:
    """Cache of one resource kind. `list_fn` is e.g. CoreV1Api.list_node or
    CoreV1Api.list_pod_for_all_namespaces; `on_change(type, obj)` runs after each change."""

    def __init__(self, list_fn: Callable[..., Awaitable[Any]], on_change: Callable[[str, Obj], None],
                 *, name: str, label_selector: str | None = None, timeout_s: int = 300):
        self.list_fn = list_fn
        self.on_change = on_change
        self.name = name
        self.kwargs = {"label_selector": label_selector} if label_selector else {}
        self.timeout_s = timeout_s
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()

    async def _relist(self) -> str:
        resp = await self.list_fn(_preload_content=False, **self.kwargs)
        body = await read_json(resp)
        fresh = {object_key(o): o for o in body.get("items", [])}
        for key in set(self.cache) - set(fresh):
            self.on_change("DELETED", self.cache.pop(key))
        for key, obj in fresh.items():
            if self.cache.get(key, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self.cache[key] = obj
                self.on_change("MODIFIED", obj)
        self.synced.set()
        return body.get("metadata", {}).get("resourceVersion", "")

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                rv = await self._relist()
                backoff = 0.2
                async with watch.Watch() as w:
                    async for event in w.stream(self.list_fn, resource_version=rv, timeout_seconds=self.timeout_s,
                                                allow_watch_bookmarks=True, **self.kwargs):
                        kind, obj = event["type"], event["raw_object"]
                        if kind == "BOOKMARK":
                            continue
                        key = object_key(obj)
                        if kind == "DELETED":
                            self.cache.pop(key, None)
                        else:
                            self.cache[key] = obj
                        self.on_change(kind, obj)
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status != 410:
                    log.warning("watch %s: %s; relisting in %.1fs", self.name, e.reason, backoff)
            except Exception as e:  # network errors: the informer must outlive them
                log.warning("watch %s failed: %s; relisting in %.1fs", self.name, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
