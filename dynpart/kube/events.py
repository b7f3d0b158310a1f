"""Posting Kubernetes Events (core/v1, so `kubectl describe` shows them on the object). The bare
POST; `dynpart.kube.recording.EventRecorder` decides which Events are worth posting."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable

from kubernetes_asyncio import client

from dynpart.kube.client import Obj, raw_api, throttled_writes_not_retried
from dynpart.kube.errors import APIError, api_errors

log = logging.getLogger(__name__)


class _FailureLog:
    """Failed posts at WARNING at most every `every_s` (with how many failed since), else DEBUG:
    during an API server outage every Event fails, and each would be a warning line."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last: float | None = None
        self.since = 0  # failures not logged at WARNING since the last line that was

    def note(self, message: str) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            self.since += 1
            log.debug("%s", message)
            return
        more = f" ({self.since} more Event(s) not posted since the last such warning)" if self.since else ""
        log.warning("%s%s", message, more)
        self.last, self.since = now, 0


_failed = _FailureLog()


def object_reference(obj: Obj) -> Obj:
    """The involvedObject of an Event about `obj` (a listed object has no `kind`: told by its spec)."""
    md = obj.get("metadata", {})
    kind = obj.get("kind") or ("Pod" if "containers" in (obj.get("spec") or {}) else "Node")
    uid = md.get("uid")
    if not uid and kind == "Node":
        # the kubelet's convention for a node it does not read (uid = the node's name): `kubectl
        # describe node` finds events by the node's uid or by its name in the uid; by none, never
        uid = md.get("name")
    ref = {"kind": kind, "apiVersion": "v1", "name": md.get("name"), "uid": uid}
    if md.get("namespace"):
        ref["namespace"] = md["namespace"]
    return ref


async def post_event(core: client.CoreV1Api, obj: Obj, reason: str, message: str,
                     component: str, warning: bool = False) -> None:
    """Best effort: a failure to post an event is logged, never raised; a 429 is not sent again
    (an API server shedding load gets fewer Events, not the same ones again)."""
    ref = object_reference(obj)
    namespace = ref.get("namespace", "default")
    now = dt.datetime.now(dt.UTC)
    body = {
        "metadata": {"name": f"{ref['name']}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
        "involvedObject": ref, "reason": reason, "message": message[:1024],
        "type": "Warning" if warning else "Normal", "source": {"component": component},
        "firstTimestamp": now.isoformat(), "lastTimestamp": now.isoformat(), "count": 1,
        "reportingComponent": component,
    }
    try:
        with api_errors(f"post event {reason} on {ref['name']}"), throttled_writes_not_retried():
            await raw_api(core).create_namespaced_event(namespace, body)
    except APIError as e:
        _failed.note(f"could not post event {reason} on {ref['name']}: {e}")
