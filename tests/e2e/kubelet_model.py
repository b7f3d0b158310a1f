"""A kubelet model for one simulated GPU node, speaking the real protocols on real unix sockets in a
per-node directory (`<root>/device-plugins/`, `<root>/pod-resources/`):

- the device manager (kubelet 1.35 `pkg/kubelet/cm/devicemanager`, followed closely): it serves
  `v1beta1.Registration` on `<root>/device-plugins/kubelet.sock`, connects to each plugin that
  registers and consumes its `ListAndWatch` (tests/agent/kubelet_double.py, imported, does the
  Registration, the connections and the restart; this model replaces what it does with each
  message). Each message replaces the resource's healthy and unhealthy sets; a stream that ends
  marks the resource's devices unhealthy (capacity kept for `endpoint_grace_s`, 5 min as in the
  kubelet; allocatable 0). Every message is kept with its time, and the node's lists of that
  moment are checked at once for a GPU advertised both whole and sliced (`exclusive_violations`).
- admission of the pods bound to the node (a watch of the real API server with
  `fieldSelector=spec.nodeName=<node>`, pods admitted one at a time as the kubelet's sync loop
  does): per container and device-plugin resource, init containers first (the devices a plain
  one got are reused by the containers after it, first; they stay allocated to the pod, unlisted
  by PodResources, until it is gone, and count for `used_withdrawn`; a sidecar's are listed and
  not reused), the devices are taken
  from the healthy ones no active pod holds, `GetPreferredAllocation` asked first when the plugin registered with
  `GetPreferredAllocationAvailable`, then `Allocate`; no healthy free device (or an Allocate
  error) fails the pod with `reason: UnexpectedAdmissionError`, as the kubelet's
  `Allocate failed due to ..., which is unexpected`. Then the kubelet's predicate check against
  the Node object (extended resources the node does not list are dropped from the request, as
  `removeMissingExtendedResources` does; a pod that asked for a GPU resource and got no device is
  recorded in `admitted_without_devices`; too little allocatable fails it with `OutOf<resource>`).
  After `container_start_s` the pod is Running; a MIG device (or a whole GPU) gets a fake process
  in the node's FakeNvml, so the fake driver itself refuses to destroy a used instance. A device
  that no longer exists when the container starts is what the NVIDIA runtime would fail on: the
  pod stays Pending and `start_errors` says why. Deleting a pod frees its devices (a graceful
  delete is completed by the model, as the kubelet does once the containers stopped).
- the PodResources v1 API (`List`, `GetAllocatableResources`, `Get`) over gRPC on
  `<root>/pod-resources/kubelet.sock`, its messages built from a descriptor written here from
  `k8s.io/kubelet/pkg/apis/podresources/v1/api.proto` (independently of the agent's client, so
  that a wrong field number on either side shows). `GetAllocatableResources` lists the healthy
  devices, one `ContainerDevices` per device, as the kubelet does.
- node status: every `status_period_s` (nodeStatusUpdateFrequency, 10 s by default, with the
  kubelet's 4 % jitter; the first at start), the Node's `status.capacity/allocatable` for
  extended resources as the kubelet's MachineInfo setter computes them from the device manager
  (removed resources at capacity 0), patched only when they differ from what the API server has.
- `restart()`: a kubelet restart: Registration socket gone, every socket in the plugin dir
  deleted, kubelet.sock back; the device manager starts from its checkpoint (assignments kept,
  every known resource registered with no device until its plugin registers again), the
  PodResources socket is re-created, and the node status is written at once. Then
  (`readmit_after_s` later; 0: before any plugin can register again) the sync loop's first pod
  list admits every pod of the checkpoint again, oldest first, sources not ready (PodResources
  lists none of them until then): a container running keeps its checkpointed devices unchecked;
  one not running (a plain init container, a container not started yet) needs them registered
  and healthy, else the pod fails with `UnexpectedAdmissionError`; no Allocate is made again.

What differs from a real kubelet is listed in tests/e2e/README.md ("The kubelet model").
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import grpc
import grpc.aio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import DeviceListError, PluginDevice, check_exclusive
from dynpart.agent.driver.fake import FakeNvml
from dynpart.kube.watching import Informer
from dynpart.resources import is_slice_resource, parse_resource
from dynpart.settings import KubeSettings
from tests.agent.kubelet_double import KubeletDouble, PluginSeen

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
ENDPOINT_GRACE_S = 300.0  # devicemanager endpointStopGracePeriod
STATUS_JITTER = 0.04  # wait.JitterUntil(kl.syncNodeStatus, nodeStatusUpdateFrequency, 0.04, ...)
WATCH = KubeSettings(backoff_initial_s=0.2, backoff_max_s=0.2)
_pids = itertools.count(40_000)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_extended(resource: str) -> bool:
    """v1helper.IsExtendedResourceName: a domain-prefixed name outside kubernetes.io."""
    return "/" in resource and not resource.startswith(("kubernetes.io/", "requests.")) and \
        ".kubernetes.io/" not in resource


# --- PodResources v1 (server side) ---------------------------------------------------------------

POD_RESOURCES_SERVICE = "v1.PodResourcesLister"


@lru_cache(maxsize=1)
def podresources_messages() -> dict[str, Any]:
    """The PodResources v1 messages (api.proto of k8s.io/kubelet v0.35, DynamicResource left out)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="e2e/kubelet_model/podresources/v1/api.proto", package="v1",
                                             syntax="proto3")
    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    S, I64, U64, M = F.TYPE_STRING, F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_MESSAGE

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    message("NUMANode", ("ID", 1, I64, opt, ""))
    message("TopologyInfo", ("nodes", 1, M, rep, ".v1.NUMANode"))
    message("ContainerDevices", ("resource_name", 1, S, opt, ""), ("device_ids", 2, S, rep, ""),
            ("topology", 3, M, opt, ".v1.TopologyInfo"))
    message("ContainerMemory", ("memory_type", 1, S, opt, ""), ("size", 2, U64, opt, ""),
            ("topology", 3, M, opt, ".v1.TopologyInfo"))
    message("ContainerResources", ("name", 1, S, opt, ""), ("devices", 2, M, rep, ".v1.ContainerDevices"),
            ("cpu_ids", 3, I64, rep, ""), ("memory", 4, M, rep, ".v1.ContainerMemory"))
    message("PodResources", ("name", 1, S, opt, ""), ("namespace", 2, S, opt, ""),
            ("containers", 3, M, rep, ".v1.ContainerResources"))
    message("ListPodResourcesRequest")
    message("ListPodResourcesResponse", ("pod_resources", 1, M, rep, ".v1.PodResources"))
    message("AllocatableResourcesRequest")
    message("AllocatableResourcesResponse", ("devices", 1, M, rep, ".v1.ContainerDevices"),
            ("cpu_ids", 2, I64, rep, ""), ("memory", 3, M, rep, ".v1.ContainerMemory"))
    message("GetPodResourcesRequest", ("pod_name", 1, S, opt, ""), ("pod_namespace", 2, S, opt, ""))
    message("GetPodResourcesResponse", ("pod_resources", 1, M, opt, ".v1.PodResources"))
    pool = descriptor_pool.DescriptorPool()
    classes = message_factory.GetMessages([fdp], pool=pool)
    return {full.split(".", 1)[1]: cls for full, cls in classes.items()}


def _serialize(m: Any) -> bytes:
    return bytes(m.SerializeToString())


# --- records --------------------------------------------------------------------------------------


@dataclass
class Holding:
    """A device a pod holds on the node (what the e2e harness checks destroy calls against)."""

    resource: str
    device: str
    gpu: int
    gi_id: int | None = None
    pid: int | None = None


@dataclass
class ResourceState:
    """The device manager's view of one resource (healthyDevices, unhealthyDevices, allDevices,
    the endpoint's stop time and the options it registered with)."""

    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    devices: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # id -> (health, NUMA nodes)
    stopped_at: float | None = None
    preferred_available: bool = False


@dataclass
class ListMessage:
    """One ListAndWatch message the kubelet received, and the node's healthy lists right after it."""

    at: float
    resource: str
    devices: list[tuple[str, str]]  # (id, health)
    node_lists: dict[str, tuple[str, ...]]  # resource -> healthy ids, every resource of the node


@dataclass
class AllocationRecord:
    at: float
    pod: str
    container: str
    resource: str
    device_ids: list[str]
    envs: dict[str, str]
    mounts: list[tuple[str, str]]  # (host, container)
    preferred: list[str] | None  # what GetPreferredAllocation answered (None: not asked)


@dataclass
class PodState:
    key: str
    uid: str
    devices: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # container -> resource -> ids
    requests: dict[str, int] = field(default_factory=dict)  # extended resources the pod asks for
    phase: str = "Pending"
    deleted: bool = False
    containers: list[str] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)  # what a re-admission after a restart reads
    created: str = ""  # metadata.creationTimestamp: HandlePodAdditions admits the oldest first
    admitted: bool = False  # its admission ended (one in flight at a restart ends with the old kubelet)
    generation: int = 0  # the kubelet process (restarts so far) that admits it
    # known to the kubelet's pod manager: False from a restart until the pod's re-admission (the
    # new kubelet's PodResources does not list it, its predicate check does not count it)
    in_pod_manager: bool = True


PodCallback = Callable[[str, str, str, str, float], None]  # (pod key, phase, reason, message, time)


def container_limits(container: dict[str, Any]) -> dict[str, int]:
    res = container.get("resources") or {}
    merged = {**(res.get("requests") or {}), **(res.get("limits") or {})}
    out = {}
    for name, value in merged.items():
        if is_extended(name):
            out[name] = int(str(value))
    return out


def effective_requests(init: list[dict[str, Any]], containers: list[dict[str, Any]]) -> dict[str, int]:
    """The pod's extended-resource requests as the kubelet's admission counts them (resourcehelper
    PodRequests): the app containers and sidecars summed, or, if more, a plain init container
    with the sidecars started before it."""
    sidecars: dict[str, int] = {}
    peak: dict[str, int] = {}
    for c in init:
        for r, n in container_limits(c).items():
            if c.get("restartPolicy") == "Always":
                sidecars[r] = sidecars.get(r, 0) + n
            else:
                peak[r] = max(peak.get(r, 0), n + sidecars.get(r, 0))
    out = dict(sidecars)
    for c in containers:
        for r, n in container_limits(c).items():
            out[r] = out.get(r, 0) + n
    return {r: max(out.get(r, 0), peak.get(r, 0)) for r in {*out, *peak}}


class KubeletModel(KubeletDouble):
    """See the module docstring. `core` None: no API server (no pod watch, no status writes;
    `admit_pod(pod)` is called by the test). It is a `KubeletDouble` (tests/agent) for Registration,
    the plugin connections and the restart; the double's own PodResources socket and admission
    helpers (`admit`, `assignments`) are not used: the model serves PodResources from its device
    manager on `podresources_socket`."""

    def __init__(self, node_name: str, root_dir: str, *, core: client.CoreV1Api | None = None,
                 driver: FakeNvml | None = None, status_period_s: float = 10.0, container_start_s: float = 0.5,
                 holdings: dict[str, list[Holding]] | None = None, on_pod: PodCallback | None = None,
                 endpoint_grace_s: float = ENDPOINT_GRACE_S, readmit_after_s: float = 0.0):
        self.node_name = node_name
        self.root_dir = root_dir
        super().__init__(os.path.join(root_dir, "device-plugins"))
        self.podresources_socket = os.path.join(root_dir, "pod-resources", "kubelet.sock")
        self.core = core
        self.driver = driver
        self.status_period_s = status_period_s
        self.container_start_s = container_start_s
        self.holdings = holdings if holdings is not None else {}
        self.on_pod = on_pod
        self.endpoint_grace_s = endpoint_grace_s
        # after a restart, seconds from the new kubelet.sock to the sync loop's first pod list (the
        # re-admission); 0: at once, before any plugin can register again
        self.readmit_after_s = readmit_after_s
        # the device manager
        self.resources: dict[str, ResourceState] = {}
        self.pods: dict[str, PodState] = {}  # admitted (and being admitted) pods: the checkpoint
        self._reserved: dict[str, set[str]] = {}  # resource -> ids taken by an admission in flight
        self._gpu_of: dict[str, tuple[str, int, int | None]] = {}  # device id -> (GPU UUID, GPU index, GI id)
        # what tests read
        self.messages: list[ListMessage] = []
        self.exclusive_violations: list[str] = []
        # a device an active pod holds left its plugin's list (for a while: see used_missing())
        self.used_withdrawn: list[str] = []
        self.allocations: list[AllocationRecord] = []
        self.admission_failures: list[tuple[str, str, str]] = []  # (pod, reason, message)
        self.admitted_without_devices: list[str] = []
        self.start_errors: list[str] = []
        # every status sync: (time, the node's extended allocatable after it), whether it patched or
        # found the node as it would write it (the kubelet patches only what changed)
        self.status_writes: list[tuple[float, dict[str, int]]] = []
        self.status_patches = 0
        self.restarts: list[float] = []  # time.monotonic() when kubelet.sock was back
        self.readmissions: list[float] = []  # time.monotonic() when a restart's re-admission ended
        self.generation = 0  # kubelet processes started since the first, by restarts
        self.errors: list[str] = []
        self._holds: dict[str, asyncio.Event] = {}
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._seen: set[str] = set()  # pod uids queued once
        self._gone: set[str] = set()  # pod uids deleted
        self._terminating: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._podres_server: Any = None
        self._status_task: asyncio.Task[None] | None = None
        self._informer: Informer | None = None
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._status_lock = asyncio.Lock()

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        if not self._tasks:  # first start: the pod watch and the admission worker
            self._spawn(self._admission_worker(), "admission")
            if self.core is not None:
                self._informer = Informer(self.core.list_pod_for_all_namespaces, self._on_pod,
                                          name=f"kubelet {self.node_name} pods",
                                          field_selector=f"spec.nodeName={self.node_name}", settings=WATCH)
                self._spawn(self._informer.run(), "pod watch")
        if self._podres_server is None:
            await self._start_podresources()
        if self.core is not None and self._status_task is None:
            self._status_task = self._spawn(self._status_loop(), "node status")

    async def close(self) -> None:
        """Stop everything (the test's end; not a restart)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._status_task = None
        await self._stop_podresources()
        await self.stop()

    async def restart(self) -> float:
        """A kubelet restart; returns time.monotonic() when the new kubelet.sock exists (with
        `readmit_after_s` 0, once the pods were admitted again)."""
        self._admitting.clear()
        self.generation += 1  # an admission in flight ends with the old process
        try:
            if self._status_task is not None:
                self._status_task.cancel()
                await asyncio.gather(self._status_task, return_exceptions=True)
                self._status_task = None
            await self._stop_podresources()
            stopped = time.monotonic()
            # readCheckpoint: pod devices kept; every resource registered, no device, endpoint stopped
            for state in self.resources.values():
                state.healthy, state.unhealthy, state.devices = set(), set(), {}
                state.stopped_at = stopped
            for pod in self.pods.values():
                # the new kubelet knows no pod until its first list, one being admitted by the old
                # one included (its first list admits it again, its containers not running)
                pod.in_pod_manager = False
            # kubelet.sock gone, *.sock wiped, then start(): kubelet.sock, PodResources, status loop
            back = await super().restart()
            self.restarts.append(back)
        except BaseException:
            self._admitting.set()
            raise
        first = self._spawn(self._first_list(), "first pod list")
        if not self.readmit_after_s:
            await first
        return back

    async def _first_list(self) -> None:
        """The sync loop's first ADD after a restart (HandlePodAdditions): every pod the checkpoint
        has is admitted again, oldest first, before the pods bound since (the admission queue)."""
        try:
            if self.readmit_after_s:
                await asyncio.sleep(self.readmit_after_s)
            for state in sorted(self.pods.values(), key=lambda p: p.created):
                if not state.in_pod_manager:
                    await self._readmit(state)
            self.readmissions.append(time.monotonic())
        finally:
            self._admitting.set()
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"kubelet {self.node_name}: {name}")  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(f"{task.get_name()} failed: {task.exception()!r}")

    # --- device plugins (Registration is the double's; each message is the device manager's) ---

    async def _register(self, request: Any, context: Any) -> Any:
        response = await super()._register(request, context)
        state = self.resources.setdefault(request.resource_name, ResourceState())
        state.stopped_at = None  # a new endpoint
        state.preferred_available = bool(request.options.get_preferred_allocation_available)
        return response

    async def _connect(self, p: PluginSeen) -> None:
        msgs = protocol.messages()
        p.channel = grpc.aio.insecure_channel(f"unix://{os.path.join(self.plugin_dir, p.endpoint)}")
        p.stub = protocol.DevicePluginStub(p.channel)
        p.stream_error = None
        try:
            p.options = await p.stub.GetDevicePluginOptions(msgs["Empty"](), timeout=5)
            async for response in p.stub.ListAndWatch(msgs["Empty"]()):
                if self.receive_delay_s.get(p.resource):
                    await asyncio.sleep(self.receive_delay_s[p.resource])
                devices = [(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices]
                async with self._changed:
                    self._on_list(p.resource, devices)
                    p.lists.append([(i, h) for i, h, _ in devices])
                    self.events.append((time.monotonic(), p.resource, [i for i, h, _ in devices if h == protocol.HEALTHY]))
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as e:
            p.stream_error = f"{e.code().name}: {e.details()}"
        # the stream ended (not cancelled: a re-registration or a restart cancels it): PluginDisconnected
        state = self.resources.get(p.resource)
        if state is not None and state.stopped_at is None:
            state.unhealthy |= state.healthy
            state.healthy = set()
            state.stopped_at = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    def _on_list(self, resource: str, devices: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """genericDeviceUpdateCallback: the list replaces what the kubelet knew of the resource."""
        state = self.resources.setdefault(resource, ResourceState())
        listed = {i for i, _, _ in devices}
        for pod in self.pods.values():
            # (a plain init container's devices too, for the pod's life: a kubelet restart admits
            # it again only if they still exist)
            for by_res in pod.devices.values():
                for i in by_res.get(resource, []):
                    if i not in listed and not pod.deleted:
                        self.used_withdrawn.append(f"{self.node_name}: {resource} {i} of pod {pod.key} left the "
                                                   "plugin's list while the pod holds it")
        state.devices = {i: (h, numa) for i, h, numa in devices}
        state.healthy = {i for i, h, _ in devices if h == protocol.HEALTHY}
        state.unhealthy = {i for i, h, _ in devices if h != protocol.HEALTHY}
        now = time.monotonic()
        node_lists = {r: tuple(sorted(s.healthy)) for r, s in self.resources.items() if s.healthy}
        self.messages.append(ListMessage(now, resource, [(i, h) for i, h, _ in devices], node_lists))
        problem = self.exclusive_problem(node_lists)
        if problem:
            last = {r: round(now - max((m.at for m in self.messages[:-1] if m.resource == r), default=now), 3)
                    for r in node_lists}
            self.exclusive_violations.append(f"{self.node_name} at a {resource} message {[i for i, _, _ in devices]}: "
                                             f"{problem}; the node's lists {node_lists}, seconds since each one's "
                                             f"last message {last}")

    def locate(self, device_id: str) -> tuple[str, int, int | None] | None:
        """Device id -> (GPU UUID, GPU index, GI id) from the node's fake driver (cached: the fake
        derives a MIG UUID from its GPU's UUID and its GI and CI ids, so one made again under a
        destroyed one's UUID sits on the same GPU with the same GI id)."""
        if device_id in self._gpu_of:
            return self._gpu_of[device_id]
        if self.driver is None:
            return None
        base = device_id.split("::", 1)[0]
        for d in self.driver.devices():
            if d.uuid == base:
                self._gpu_of[device_id] = (d.uuid, d.index, None)
                return self._gpu_of[device_id]
            if d.mig_current and device_id.startswith("MIG-"):
                for gi in self.driver.gpu_instances(d.index):
                    if gi.uuid == device_id:
                        self._gpu_of[device_id] = (d.uuid, d.index, gi.gi_id)
                        return self._gpu_of[device_id]
        return None

    def exclusive_problem(self, node_lists: dict[str, tuple[str, ...]]) -> str | None:
        """`check_exclusive` over the node's lists: a GPU both whole and sliced, an id twice, a
        device under a resource of another kind."""
        by_resource: dict[str, list[PluginDevice]] = {}
        for resource, ids in node_lists.items():
            if not is_slice_resource(resource):
                continue
            kind = parse_resource(resource).kind
            for i in ids:
                where = self.locate(i)
                gpu = where[0] if where else ("?" + i)
                by_resource.setdefault(resource, []).append(PluginDevice(id=i, kind=kind, gpu_uuid=gpu, gpu_index=-1))
        try:
            check_exclusive(by_resource)
        except DeviceListError as e:
            return str(e)
        return None

    def used_missing(self) -> list[str]:
        """Devices active pods hold that their plugin (registered, stream open) no longer lists: a
        used slice the node gave up."""
        out = []
        for pod in self.pods.values():
            for by_res in pod.devices.values():
                for resource, ids in by_res.items():
                    s = self.resources.get(resource)
                    if pod.deleted or s is None or s.stopped_at is not None:
                        continue
                    out += [f"{self.node_name}: {resource} {i} of pod {pod.key} is no longer advertised"
                            for i in ids if i not in s.devices]
        return out

    def registered(self, resource: str) -> bool:
        return resource in self.resources

    def healthy(self) -> dict[str, set[str]]:
        return {r: set(s.healthy) for r, s in self.resources.items()}

    def allocated(self, resource: str) -> set[str]:
        """Devices of `resource` active pods hold or an admission in flight has taken."""
        out = set(self._reserved.get(resource, set()))
        for pod in self.pods.values():
            if not pod.deleted:
                for by_res in pod.devices.values():
                    out |= set(by_res.get(resource, []))
        return out

    def capacity(self) -> tuple[dict[str, int], dict[str, int], list[str]]:
        """GetCapacity: (capacity, allocatable, removed resources); a resource whose endpoint
        stopped longer than the grace period ago is removed."""
        cap: dict[str, int] = {}
        alloc: dict[str, int] = {}
        removed = []
        now = time.monotonic()
        for resource, s in list(self.resources.items()):
            if s.stopped_at is not None and now - s.stopped_at > self.endpoint_grace_s:
                removed.append(resource)
                del self.resources[resource]
                continue
            cap[resource] = len(s.healthy) + len(s.unhealthy)
            alloc[resource] = len(s.healthy)
        return cap, alloc, removed

    # --- node status --------------------------------------------------------------------------

    async def _status_loop(self) -> None:
        while True:
            try:
                await self.write_status()
            except ApiException as e:
                self.errors.append(f"node status write: {e.status} {e.reason}")
            await asyncio.sleep(self.status_period_s * (1 + STATUS_JITTER * random.random()))

    async def write_status(self) -> bool:
        """One syncNodeStatus (capacity/allocatable of extended resources); True if it patched."""
        assert self.core is not None
        async with self._status_lock:
            node = await self.core.read_node(self.node_name)
            old_cap = {k: str(v) for k, v in (node.status.capacity or {}).items()}
            old_alloc = {k: str(v) for k, v in (node.status.allocatable or {}).items()}
            dp_cap, dp_alloc, removed = self.capacity()
            cap = dict(old_cap)
            cap.update({k: str(v) for k, v in dp_cap.items()})
            cap.update({k: "0" for k in removed})
            alloc = {k: v for k, v in old_alloc.items() if k in cap or not is_extended(k)}
            alloc.update({k: v for k, v in cap.items() if is_extended(k)})
            alloc.update({k: str(v) for k, v in dp_alloc.items()})
            patch: dict[str, dict[str, str | None]] = {"capacity": {}, "allocatable": {}}
            for name, old, new in (("capacity", old_cap, cap), ("allocatable", old_alloc, alloc)):
                for k in set(old) | set(new):
                    if not is_extended(k) or _same(old.get(k), new.get(k)):
                        continue
                    patch[name][k] = new.get(k)
            written = {k: int(v) for k, v in alloc.items() if is_extended(k)}
            if not patch["capacity"] and not patch["allocatable"]:
                self.status_writes.append((time.monotonic(), written))
                return False
            await self.core.patch_node_status(self.node_name, {"status": {k: v for k, v in patch.items() if v}},
                                              _content_type=MERGE)
            self.status_writes.append((time.monotonic(), written))
            self.status_patches += 1
            return True

    # --- PodResources ---------------------------------------------------------------------------

    async def _start_podresources(self) -> None:
        os.makedirs(os.path.dirname(self.podresources_socket), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.podresources_socket)
        msgs = podresources_messages()
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(self._pr_list, msgs["ListPodResourcesRequest"].FromString,
                                                        _serialize),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                self._pr_allocatable, msgs["AllocatableResourcesRequest"].FromString, _serialize),
            "Get": grpc.unary_unary_rpc_method_handler(self._pr_get, msgs["GetPodResourcesRequest"].FromString,
                                                       _serialize),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(POD_RESOURCES_SERVICE, handlers),))
        server.add_insecure_port(f"unix://{self.podresources_socket}")
        await server.start()
        self._podres_server = server

    async def _stop_podresources(self) -> None:
        if self._podres_server is not None:
            await self._podres_server.stop(0)
            self._podres_server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.podresources_socket)

    def _pod_message(self, pod: PodState) -> Any:
        msgs = podresources_messages()
        ns, name = pod.key.split("/", 1)
        containers = []
        for cname, by_res in pod.devices.items():
            if cname not in pod.containers:
                continue  # a plain init container's devices are never listed
            devices = [msgs["ContainerDevices"](resource_name=r, device_ids=ids) for r, ids in sorted(by_res.items())]
            containers.append(msgs["ContainerResources"](name=cname, devices=devices))
        return msgs["PodResources"](name=name, namespace=ns, containers=containers)

    async def _pr_list(self, request: Any, context: Any) -> Any:
        pods = [self._pod_message(p) for p in self.pods.values()
                if not p.deleted and p.phase != "Failed" and p.in_pod_manager]
        return podresources_messages()["ListPodResourcesResponse"](pod_resources=pods)

    async def _pr_get(self, request: Any, context: Any) -> Any:
        pod = self.pods.get(f"{request.pod_namespace}/{request.pod_name}")
        if pod is None or pod.deleted or not pod.in_pod_manager:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        return podresources_messages()["GetPodResourcesResponse"](pod_resources=self._pod_message(pod))  # type: ignore[arg-type]

    async def _pr_allocatable(self, request: Any, context: Any) -> Any:
        msgs = podresources_messages()
        out = []
        for resource, s in sorted(self.resources.items()):
            for i in sorted(s.healthy):
                numa = s.devices.get(i, ("", ()))[1]
                topo = msgs["TopologyInfo"](nodes=[msgs["NUMANode"](ID=n) for n in numa]) if numa else None
                for _ in (numa or (None,)):  # one entry per NUMA node, as the kubelet writes them
                    out.append(msgs["ContainerDevices"](resource_name=resource, device_ids=[i], topology=topo))
        return msgs["AllocatableResourcesResponse"](devices=out)

    # --- pods -----------------------------------------------------------------------------------

    def hold(self, pod_name: str) -> asyncio.Event:
        """Delay the admission of the pod `pod_name` (any namespace) until the event is set."""
        return self._holds.setdefault(pod_name, asyncio.Event())

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        md = pod["metadata"]
        key, uid = f"{md['namespace']}/{md['name']}", md.get("uid", "")
        if kind == "DELETED":
            self._gone.add(uid)
            self._forget(key, uid)
            return
        if md.get("deletionTimestamp"):
            if uid not in self._terminating and self.core is not None:
                self._terminating.add(uid)
                self._spawn(self._terminate(key, uid), f"terminate {key}")
            return
        phase = (pod.get("status") or {}).get("phase")
        if uid in self._seen or phase in ("Succeeded", "Failed"):
            return
        self._seen.add(uid)
        self._queue.put_nowait(pod)

    def _forget(self, key: str, uid: str) -> None:
        """The pod is gone: its devices are free (UpdateAllocatedDevices drops inactive pods)."""
        state = self.pods.get(key)
        if state is None or (uid and state.uid != uid):
            return
        state.deleted = True
        del self.pods[key]
        self._release(key)

    def _release(self, key: str) -> None:
        for h in self.holdings.pop(key, []):
            if h.pid is not None and self.driver is not None:
                self.driver.detach(h.gpu, h.pid)

    async def _terminate(self, key: str, uid: str) -> None:
        """A graceful delete: the containers stop (at once here), then the kubelet deletes the pod."""
        self._gone.add(uid)
        self._forget(key, uid)
        assert self.core is not None
        ns, name = key.split("/", 1)
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0,
                                                  body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                              preconditions=client.V1Preconditions(uid=uid)))

    async def _admission_worker(self) -> None:
        while True:
            pod = await self._queue.get()
            await self._admitting.wait()
            name = pod["metadata"]["name"]
            if name in self._holds and not self._holds[name].is_set():
                self._spawn(self._held(pod), f"held {name}")  # the others go on
                continue
            await self.admit_pod(pod)

    async def _held(self, pod: dict[str, Any]) -> None:
        await self._holds[pod["metadata"]["name"]].wait()
        await self._admitting.wait()
        await self.admit_pod(pod)

    async def admit_pod(self, pod: dict[str, Any]) -> bool:
        """canAdmitPod then the pod's start: True if admitted."""
        md = pod["metadata"]
        key, uid = f"{md['namespace']}/{md['name']}", md.get("uid", "")
        if uid and uid in self._gone:
            return False
        spec = pod.get("spec") or {}
        init = spec.get("initContainers") or []
        containers = spec.get("containers") or []
        # PodResources lists the app containers and the sidecars (restartable init containers)
        listed = [c for c in init if c.get("restartPolicy") == "Always"] + containers
        state = PodState(key, uid, containers=[c.get("name", "") for c in listed], spec=spec,
                         created=md.get("creationTimestamp") or "", generation=self.generation)
        state.requests = effective_requests(init, containers)
        self.pods[key] = state
        try:
            await self._allocate_pod(state)
        except _EndedByRestart:
            return False  # the new kubelet's first list admits it again
        except _AdmissionError as e:
            return await self._reject(state, "UnexpectedAdmissionError", f"Allocate failed due to {e}, which is unexpected")
        if self.core is not None:
            reason = await self._predicate(state)
            if state.generation != self.generation:
                return False
            if reason is not None:
                return await self._reject(state, *reason)
        for resource, n in state.requests.items():
            got = len({i for by_res in state.devices.values() for i in by_res.get(resource, [])})  # (reused once)
            if got < n and is_slice_resource(resource):
                self.admitted_without_devices.append(f"{key}: asked for {n} {resource}, got {got} (not a device-plugin "
                                                     "resource of this kubelet)")
        if uid and uid in self._gone:  # deleted while it was admitted
            state.deleted = True
            self.pods.pop(key, None)
            self._release(key)
            return False
        state.admitted = True
        self._spawn(self._run(state), f"start {key}")
        return True

    async def _readmit(self, state: PodState) -> None:
        """canAdmitPod again after a restart, for a pod of the checkpoint: its containers find their
        devices there (no RPC); a container not running needs them healthy (`_allocate_container`)."""
        state.in_pod_manager = True  # podManager.AddPod, then the admission
        state.generation = self.generation
        try:
            await self._allocate_pod(state, first_list=True)
        except _EndedByRestart:
            return
        except _AdmissionError as e:
            await self._reject(state, "UnexpectedAdmissionError", f"Allocate failed due to {e}, which is unexpected")
            return
        if self.core is not None:
            reason = await self._predicate(state)
            if reason is not None:
                await self._reject(state, *reason)

    async def _allocate_pod(self, state: PodState, first_list: bool = False) -> None:
        """devicemanager Allocate for each container: init containers first, in order; what a plain
        one got is reused by the containers after it (the app containers take from it first), a
        sidecar's is not. Raises _AdmissionError."""
        init = state.spec.get("initContainers") or []
        reusable: dict[str, set[str]] = {}
        for c in [*init, *(state.spec.get("containers") or [])]:
            got = await self._allocate_container(state, c, reusable, first_list)
            for r, ids in got.items():
                if c in init and c.get("restartPolicy") != "Always":
                    reusable.setdefault(r, set()).update(ids)
                else:
                    reusable.setdefault(r, set()).difference_update(ids)

    async def _allocate_container(self, state: PodState, container: dict[str, Any],
                                  reusable: dict[str, set[str]], first_list: bool = False) -> dict[str, list[str]]:
        """One container's devices (devicesToAllocate): those the checkpoint gives it (after a
        restart), else the pod's `reusable` ones first (what its plain init containers got), then
        free healthy ones. `first_list`: the first pod list after a restart (sources not all
        ready). Returns resource -> the ids given."""
        cname = container.get("name", "")
        given: dict[str, list[str]] = {}
        for resource, required in sorted(container_limits(container).items()):
            if not self.registered(resource) and not self.allocated(resource):
                continue  # not a device-plugin resource (isDevicePluginResource)
            kept = state.devices.get(cname, {}).get(resource)
            if first_list and state.phase == "Running" and cname in state.containers:
                # reported running by the runtime at the kubelet's start: it has its devices, nothing
                # is checked (a plugin not registered again yet is no reason to fail it)
                given[resource] = list(kept or [])
                continue
            s = self.resources.get(resource)
            if s is None:
                raise _AdmissionError(f"cannot allocate unregistered device {resource}")
            if not s.healthy:
                raise _AdmissionError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            if kept is not None:  # a container not running (a plain init container, one not started)
                if not s.healthy >= set(kept):
                    raise _AdmissionError("previously allocated devices are no longer healthy; cannot allocate "
                                          f"unhealthy devices {resource}")
                given[resource] = list(kept)
                continue  # nothing needed: no Allocate, the checkpointed response serves the container
            reused = sorted(reusable.get(resource, set()))[:required]
            needed = required - len(reused)
            available = s.healthy - self.allocated(resource)
            if len(available) < needed:
                raise _AdmissionError(f"requested number of devices unavailable for {resource}. "
                                      f"Requested: {needed}, Available: {len(available)}")
            chosen: list[str] = list(reused)
            preferred: list[str] | None = None
            plugin = self.plugins.get(resource)
            if needed and s.preferred_available and plugin is not None and plugin.stub is not None:
                try:
                    preferred = await self.preferred(resource, sorted(available | set(reused)), reused, required)
                except grpc.aio.AioRpcError as e:
                    raise _AdmissionError(f"rpc error: code = {e.code().name} desc = {e.details()}") from None
                if state.generation != self.generation:
                    raise _EndedByRestart
                # the devices healthy before the call, as the kubelet's devicesToAllocate keeps them:
                # one withdrawn during the call may still be chosen (Allocate then decides); less
                # what other admissions of this model took meanwhile (the kubelet admits one at a time)
                available -= self.allocated(resource)
                chosen += [i for i in preferred if i in available][:needed]
            chosen += sorted(available - set(chosen))[:required - len(chosen)]
            if len(chosen) < required:
                raise _AdmissionError(f"unexpectedly allocated less resources than required. Requested: {required}, "
                                      f"Got: {len(chosen)}")
            self._reserved.setdefault(resource, set()).update(chosen)
            try:
                if plugin is None or plugin.stub is None:
                    raise _AdmissionError(f"unknown Device Plugin {resource}")
                try:
                    response = await self.allocate(resource, chosen)
                except grpc.aio.AioRpcError as e:
                    raise _AdmissionError(f"rpc error: code = {e.code().name} desc = {e.details()}") from None
                if state.generation != self.generation:
                    raise _EndedByRestart
                if not response.container_responses:
                    raise _AdmissionError(f"no containers return in allocation response {response}")
                state.devices.setdefault(cname, {})[resource] = list(chosen)
            finally:
                self._reserved[resource] -= set(chosen)
            cr = response.container_responses[0]
            self.allocations.append(AllocationRecord(time.monotonic(), state.key, cname, resource, list(chosen),
                                                     dict(cr.envs), [(m.host_path, m.container_path) for m in cr.mounts],
                                                     preferred))
            given[resource] = list(chosen)
            if cname not in state.containers:
                continue  # a plain init container: it has run and ended when the app containers start
            for device in chosen:
                where = self.locate(device)
                self.holdings.setdefault(state.key, []).append(
                    Holding(resource, device, where[1] if where else -1, where[2] if where else None))
        return given

    async def _predicate(self, state: PodState) -> tuple[str, str] | None:
        """The predicate admit handler's resource fit for extended resources, against the Node."""
        assert self.core is not None
        node = await self.core.read_node(self.node_name)
        allocatable = {k: int(str(v)) for k, v in (node.status.allocatable or {}).items() if is_extended(k)}
        for resource in self._allocated_resources():  # sanitizeNodeAllocatable
            allocatable[resource] = max(allocatable.get(resource, 0), len(self.allocated(resource)))
        for resource, n in sorted(state.requests.items()):
            if resource not in allocatable:
                continue  # removeMissingExtendedResources
            used = sum(p.requests.get(resource, 0) for p in self.pods.values()
                       if not p.deleted and p.phase != "Failed" and p.in_pod_manager and p is not state)
            if used + n > allocatable[resource]:
                return (f"OutOf{resource}", f"Node didn't have enough resource: {resource}, requested: {n}, "
                        f"used: {used}, capacity: {allocatable[resource]}")
        return None

    def _allocated_resources(self) -> set[str]:
        return {r for p in self.pods.values() if not p.deleted for by_res in p.devices.values() for r in by_res}

    async def _reject(self, state: PodState, reason: str, message: str) -> bool:
        state.phase = "Failed"
        self.admission_failures.append((state.key, reason, message))
        self.pods.pop(state.key, None)
        self._release(state.key)
        await self._set_phase(state, "Failed", reason, message)
        return False

    async def _run(self, state: PodState) -> None:
        """The containers start: a process on each MIG device (or whole GPU) the pod got."""
        if self.container_start_s:
            await asyncio.sleep(self.container_start_s)
        if state.deleted or state.phase == "Failed":  # (rejected again by a restart meanwhile)
            return
        for h in self.holdings.get(state.key, []):
            if self.driver is None or h.gpu < 0:
                continue
            kind = parse_resource(h.resource).kind if is_slice_resource(h.resource) else None
            if kind not in ("mig", "gpu"):
                continue
            try:
                gi = h.gi_id
                if kind == "mig":
                    found = next((g.gi_id for d in self.driver.devices() if d.index == h.gpu
                                  for g in self.driver.gpu_instances(d.index) if g.uuid == h.device), None)
                    if found is None:
                        raise LookupError(f"MIG device {h.device} does not exist on GPU {h.gpu} any more")
                    gi = h.gi_id = found
                pid = next(_pids)
                self.driver.attach(h.gpu, pid, gi)
                h.pid = pid
            except Exception as e:  # the NVIDIA container runtime would fail to create the container
                self.start_errors.append(f"{state.key}: {h.resource} {h.device}: {e}")
                return  # stays Pending (CreateContainerError), as with a real runtime
        state.phase = "Running"
        await self._set_phase(state, "Running")

    async def _set_phase(self, state: PodState, phase: str, reason: str = "", message: str = "") -> None:
        now = now_rfc3339()
        if self.core is not None:
            ns, name = state.key.split("/", 1)
            ok = "True" if phase == "Running" else "False"
            status: dict[str, Any] = {
                "phase": phase, "startTime": now, "hostIP": "127.0.0.1", "podIP": "10.244.0.1",
                "conditions": [{"type": t, "status": ok, "lastTransitionTime": now}
                               for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")]}
            if phase == "Running":
                status["containerStatuses"] = [{"name": c, "image": "registry.k8s.io/pause:3.10", "imageID": "",
                                                "ready": True, "restartCount": 0, "started": True,
                                                "state": {"running": {"startedAt": now}}} for c in state.containers]
            if reason:
                status["reason"], status["message"] = reason, message
            try:
                await self.core.patch_namespaced_pod_status(name, ns, {"status": status}, _content_type=STRATEGIC)
            except ApiException as e:
                if e.status != 404:
                    raise
        if self.on_pod is not None:
            self.on_pod(state.key, phase, reason, message, time.monotonic())


class _AdmissionError(Exception):
    pass


class _EndedByRestart(Exception):
    """The kubelet restarted while this admission was in flight: the old process's admission ends
    with it (what its Allocate returned afterwards is in no checkpoint)."""


def _same(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return int(a) == int(b)
    except ValueError:
        return a == b
