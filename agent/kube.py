"""The agent's Kubernetes I/O behind two small interfaces, with in-memory fakes:

- `NodeApi`: read, watch and merge-patch the agent's own Node (its status annotations), and
  the GPU resource counts of its status (`patch_status`, publishing new slices early);
- `PluginPods`: NVIDIA's device-plugin pod on this node, deleted so that its DaemonSet starts it
  again and it lists the new MIG devices (it enumerates them only when it starts).

`KubeNodeApi` / `KubePluginPods` use kubernetes-asyncio through `dynpart.kube` (the client,
merge patches, the informer that watches the node, Events); API failures are the classes of
`dynpart.kube.errors`. `connect()` builds the client from a kubeconfig or in-cluster.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes_asyncio import client

from dynpart.kube.client import Obj, api_client, raw_api, read_json
from dynpart.kube.conventions import AGENT_COMPONENT
from dynpart.kube.errors import APIError, APINotFoundError, api_errors
from dynpart.kube.events import post_event
from dynpart.kube.patching import MERGE_PATCH, patch_node_annotations, read_node
from dynpart.kube.watching import Informer
from dynpart.settings import KubeSettings

log = logging.getLogger("dynpart.agent")


@dataclass(frozen=True)
class NodeView:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    resource_version: str = ""
    allocatable: dict[str, str] = field(default_factory=dict)  # status.allocatable
    capacity: dict[str, str] = field(default_factory=dict)  # status.capacity

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> NodeView:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        return cls(meta.get("name", ""), dict(meta.get("labels") or {}), dict(meta.get("annotations") or {}),
                   str(meta.get("resourceVersion") or meta.get("resource_version") or ""),
                   {k: str(v) for k, v in (status.get("allocatable") or {}).items()},
                   {k: str(v) for k, v in (status.get("capacity") or {}).items()})


class NodeApi(Protocol):
    async def get(self) -> NodeView: ...

    async def patch(self, *, annotations: dict[str, str | None] | None = None) -> NodeView:
        """JSON merge patch of the node's annotations (a None value removes the key). The agent
        changes no label."""
        ...

    def watch(self) -> AsyncIterator[NodeView]:
        """The node each time it changes (reconnecting as needed); runs until cancelled."""
        ...

    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        """A Kubernetes Event on the node (best effort: never raises)."""
        ...

    async def patch_status(self, counts: dict[str, int]) -> None:
        """Merge-patch these resources' counts into status.capacity and status.allocatable
        (nodes/status). Only GPU resources the agent's own device plugin serves."""
        ...


# --- fakes ----------------------------------------------------------------------------------------


class FakeNodeApi:
    """One Node in memory. `events` records every write in order: ("annotations", patch),
    ("status", counts), ("event", (reason, message, warning))."""

    def __init__(self, name: str, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, events: list[tuple[str, Any]] | None = None):
        self.name = name
        self.labels = dict(labels or {})
        self.annotations = dict(annotations or {})
        self.allocatable: dict[str, str] = {}
        self.capacity: dict[str, str] = {}
        self.events: list[tuple[str, Any]] = events if events is not None else []
        self._version = 1
        self._watchers: list[asyncio.Queue[NodeView]] = []

    def view(self) -> NodeView:
        return NodeView(self.name, dict(self.labels), dict(self.annotations), str(self._version), dict(self.allocatable),
                        dict(self.capacity))

    def set_allocatable(self, counts: dict[str, int], unhealthy: dict[str, int] | None = None) -> None:
        """What the kubelet (its node-status write) does: allocatable the healthy devices, capacity
        the unhealthy ones too."""
        for r, n in counts.items():
            self.allocatable[r] = str(n)
            self.capacity[r] = str(n + (unhealthy or {}).get(r, 0))
        for r, n in (unhealthy or {}).items():
            if r not in counts:
                self.allocatable[r], self.capacity[r] = "0", str(n)
        self._changed()

    def set_annotations(self, patch: dict[str, str | None]) -> None:
        """What another writer (the planner) does."""
        _merge(self.annotations, patch)
        self._changed()

    async def get(self) -> NodeView:
        return self.view()

    async def patch(self, *, annotations: dict[str, str | None] | None = None) -> NodeView:
        if annotations:
            self.events.append(("annotations", dict(annotations)))
            _merge(self.annotations, annotations)
        self._changed()
        return self.view()

    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(("event", (reason, message, warning)))

    async def patch_status(self, counts: dict[str, int]) -> None:
        self.events.append(("status", dict(counts)))
        for r, n in counts.items():
            self.allocatable[r] = self.capacity[r] = str(n)
        self._changed()

    async def watch(self) -> AsyncIterator[NodeView]:
        queue: asyncio.Queue[NodeView] = asyncio.Queue()
        self._watchers.append(queue)
        try:
            yield self.view()
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(queue)

    def _changed(self) -> None:
        self._version += 1
        for q in self._watchers:
            q.put_nowait(self.view())


def _merge(target: dict[str, str], patch: dict[str, str | None]) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v


# --- kubernetes-asyncio ---------------------------------------------------------------------------


async def connect(kubeconfig: str | None = None, settings: KubeSettings | None = None) -> client.ApiClient:
    """An ApiClient: from `kubeconfig` or $KUBECONFIG, else in-cluster (dynpart.kube.client)."""
    return await api_client(kubeconfig, settings)


# the agent's watched copy of its Node is read only while the watch said something (or a GET
# confirmed the copy) this recently: a connection cut without a close is noticed by the watch only
# after watch_idle_timeout_s (120 s), longer than the planner waits for an acknowledgement (60 s)
FRESH_S = 30.0
# a quiet watch is confirmed from the API server's watch cache (resourceVersion=0), which lags etcd
# when the watch does (one stuck API server): a quorum read at least this often
QUORUM_S = 300.0


def _version(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class KubeNodeApi:
    """NodeApi on the real API server. Needs RBAC: get, list, watch, patch on nodes."""

    def __init__(self, api: client.ApiClient, name: str, settings: KubeSettings | None = None):
        self.name = name
        self._client = api
        self._v1 = client.CoreV1Api(api)
        self.settings = settings or KubeSettings()
        self._informer: Informer | None = None  # the watch's, while `watch()` runs
        # versions of the Node the reads must not go behind, until the watch delivers them: the
        # agent's own writes' and the GETs' answers (version -> lists the informer had started
        # then; in the order they were learnt)
        self._unseen: dict[str, int] = {}
        # the resourceVersions the watch delivered last: its event of a write can arrive before
        # the write's answer, and a write that changes nothing answers the version already seen
        self._seen: collections.deque[str] = collections.deque(maxlen=64)
        # (time.monotonic) the watch's last line (an event, a bookmark: the API server sends one a
        # minute), and the last GET that answered the version the watch holds
        self._heard = self._confirmed = -float("inf")
        self.reads = 0  # GETs sent (the watch serves the others)
        self.quorum_reads = 0  # of those, the reads from etcd (not from the API server's watch cache)
        self._quorum_at = -float("inf")  # (time.monotonic) the last quorum read

    async def get(self) -> NodeView:
        """The node as the watch last delivered it, while the watch is open, said something or was
        confirmed by a GET in the last `FRESH_S`, and has delivered every version a read or a write
        of the agent's has seen: a pass every 10 s on every GPU node must not be a quorum read of
        the Node each time (up to two per pass: 200 a second at 1,000 nodes). Else a GET. The watch's
        copy lags by the events in flight, as any read does by the time it is used (a spec or
        allocatable change it has not delivered yet wakes the agent when it arrives), and by
        `FRESH_S` at most when its connection went silent without closing."""
        cached = self._watched()
        if cached is not None:
            return cached
        informer = self._informer
        held = informer.cache.get(self.name) if informer is not None and informer.watching else None
        if informer is not None and held is not None and not self._unseen and time.monotonic() - self._quorum_at < QUORUM_S:
            # only the watch's silence is in doubt (a quiet node: no event for FRESH_S): the API
            # server's watch cache answering the version the watch holds confirms it without a
            # quorum read (at 1,000 quiet nodes, one etcd read a second less); any other answer
            # (newer: the watch is cut), or none, is settled by a quorum read. The watch and that
            # cache can lag etcd together: a quorum read at least every QUORUM_S catches it
            self.reads += 1
            try:
                fresh: Obj | None = await read_node(self._v1, self.name, any_version=True)
            except APIError as e:
                log.debug("node %s: reading it from the API server's cache: %s; reading it from etcd", self.name, e)
                fresh = None
            if fresh is not None and _version(fresh) and _version(fresh) == _version(held):
                self._confirmed = time.monotonic()
                return NodeView.from_dict(informer.cache.get(self.name) or held)  # (or newer, delivered since)
        self.reads += 1
        self.quorum_reads += 1
        self._quorum_at = time.monotonic()
        obj = await read_node(self._v1, self.name)
        self._learnt(obj, read=True)
        return NodeView.from_dict(obj)

    def _watched(self) -> NodeView | None:
        informer = self._informer
        if informer is None or not informer.watching:
            return None
        obj = informer.cache.get(self.name)
        if obj is None or time.monotonic() - max(self._heard, self._confirmed) > FRESH_S:
            return None
        # listed again since: the list holds them
        self._unseen = {version: lists for version, lists in self._unseen.items() if lists >= informer.lists}
        return None if self._unseen else NodeView.from_dict(obj)

    def _learnt(self, obj: Obj, read: bool = False) -> Obj:
        """`obj` came from a write's answer or a GET: the reads must not go behind it."""
        version = _version(obj)
        informer = self._informer
        if informer is None or not version:
            return obj
        cached = informer.cache.get(self.name)
        if read and cached is not None and _version(cached) == version:
            self._unseen.clear()  # the watch holds what the API server has now
            self._confirmed = time.monotonic()
        elif version not in self._seen:
            self._unseen[version] = informer.lists
        return obj

    def _delivered(self, version: str) -> None:
        """The watch delivered `version`: it holds every version learnt before it too."""
        self._seen.append(version)
        if version in self._unseen:
            learnt = list(self._unseen)
            for v in learnt[:learnt.index(version) + 1]:
                del self._unseen[v]

    async def patch(self, *, annotations: dict[str, str | None] | None = None) -> NodeView:
        if annotations:
            return NodeView.from_dict(self._learnt(await patch_node_annotations(self._v1, self.name, annotations)))
        return await self.get()

    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        await post_event(self._v1, {"kind": "Node", "metadata": {"name": self.name}}, reason, message,
                         AGENT_COMPONENT, warning)

    async def patch_status(self, counts: dict[str, int]) -> None:
        """RBAC: patch nodes/status; the node-write policy allows only these resource keys, and only
        on the agent's own node."""
        values = {r: str(n) for r, n in counts.items()}
        body = {"status": {"capacity": values, "allocatable": values}}
        with api_errors(f"patch node {self.name} status"):
            resp = await raw_api(self._v1).patch_node_status(self.name, body, _content_type=MERGE_PATCH,
                                                             _preload_content=False)
        self._learnt(await read_json(resp, f"patch node {self.name} status"))

    async def watch(self) -> AsyncIterator[NodeView]:
        """The node as listed, then at each change: dynpart.kube's informer with a field selector
        (it watches again from the last resourceVersion when the watch ends, and lists again,
        backing off, when the watch fails or its resourceVersion is too old)."""
        changes: asyncio.Queue[NodeView] = asyncio.Queue()

        def on_change(kind: str, obj: Obj) -> None:
            if kind != "DELETED":
                view = NodeView.from_dict(obj)
                self._delivered(view.resource_version)
                changes.put_nowait(view)

        def heard() -> None:
            self._heard = time.monotonic()

        informer = Informer(self._v1.list_node, on_change, name=f"node {self.name}",
                            field_selector=f"metadata.name={self.name}", settings=self.settings, on_beat=heard)
        self._informer = informer
        running = asyncio.create_task(informer.run(), name=f"informer of node {self.name}")
        try:
            while True:  # the informer ends only when cancelled (below)
                yield await changes.get()
        finally:
            if self._informer is informer:
                self._informer = None
            running.cancel()
            await asyncio.wait([running])


class PluginPods(Protocol):
    async def restart(self) -> list[str]:
        """Delete NVIDIA's device-plugin pod(s) on this node (its DaemonSet starts a new one);
        returns their names (none found: empty)."""
        ...


class FakePluginPods:
    """Counts restarts; `on_restart` is what the new plugin does (e.g. publish the node's MIG devices)."""

    def __init__(self, on_restart: Callable[[], None] | None = None):
        self.restarts = 0
        self.on_restart = on_restart

    async def restart(self) -> list[str]:
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart()
        return [f"nvidia-device-plugin-{self.restarts}"]


class KubePluginPods:
    """NVIDIA's device-plugin pods on one node: namespace, label selector and
    `fieldSelector=spec.nodeName=<node>`. RBAC: list and delete pods in that namespace (the
    node-write policy narrows delete to pods on the agent's own node carrying the label)."""

    def __init__(self, api: client.ApiClient, node: str, namespace: str, selector: str):
        self._v1 = client.CoreV1Api(api)
        self.node, self.namespace, self.selector = node, namespace, selector

    async def restart(self) -> list[str]:
        with api_errors(f"list pods {self.selector} in {self.namespace} on node {self.node}"):
            resp = await self._v1.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                                      field_selector=f"spec.nodeName={self.node}", _preload_content=False)
            pods = await read_json(resp, f"device-plugin pods on node {self.node}")
        names = [str((p.get("metadata") or {}).get("name")) for p in pods.get("items") or []]
        for name in names:
            what = f"delete pod {self.namespace}/{name}"
            try:
                with api_errors(what):
                    deleted = await self._v1.delete_namespaced_pod(name, self.namespace, _preload_content=False)
                # the client raises for an error status only when it reads the body itself: a 403
                # or a 500 must not read as a restart (the caller would never ask again)
                await read_json(deleted, what)
            except APINotFoundError:
                pass  # already going
        return names


def lease_term_reader(api: client.ApiClient, name: str, namespace: str) -> Callable[[], Awaitable[int | None]]:
    """Reads the planner's Lease for its current leader term (`leaseTransitions`): the agent
    ignores a spec written under an older term (a deposed leader's late write). None when there is
    no Lease to read (404: no leader election) or no right to read it (403): then nothing is
    fenced. Any other failure (a time-out, a 5xx) raises: the pass then applies nothing, as it
    cannot tell whether the spec's writer still leads."""
    coordination = client.CoordinationV1Api(api)
    warned = False

    async def read() -> int | None:
        nonlocal warned
        try:
            with api_errors(f"read lease {namespace}/{name}"):
                resp = await coordination.read_namespaced_lease(name, namespace, _preload_content=False)
            lease = await read_json(resp, f"lease {namespace}/{name}")
        except APIError as e:
            if e.status not in (403, 404):
                raise
            if not warned:
                log.warning("cannot read the planner's lease, specs are not fenced by leader term: %s", e)
                warned = True
            return None
        term = (lease.get("spec") or {}).get("leaseTransitions")
        return term if isinstance(term, int) else 0
    return read
