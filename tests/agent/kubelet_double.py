"""A small kubelet double for device plugins, speaking the real v1beta1 gRPC protocol on real unix
sockets: it serves `Registration` on `<dir>/kubelet.sock`; on `Register` it connects to the
plugin's socket, calls GetDevicePluginOptions and consumes ListAndWatch (every list received is
kept, with its time); tests call `allocate()` and `preferred()` as the kubelet would.
`restart()` does what a kubelet restart does to the plugin dir: the Registration socket goes
away, every socket in the dir is removed, and kubelet.sock comes back; PodResources List then
shows no pod until `pods_listed_again()` (the sync loop's first pod list), while the devices the
checkpoint holds stay taken.

Admission as the kubelet does it: `admit(pod, resource, n)` picks n free healthy devices
(GetPreferredAllocation when the plugin offers it), calls Allocate, and records the assignment;
no free healthy device: `AdmissionError` (the kubelet's UnexpectedAdmissionError). The
assignments and the devices it holds are served by the PodResources API (`List`,
`GetAllocatableResources`) on `pod_resources_socket`, so the agent's real client reads them.

Reusable by an e2e kubelet model: `allocatable()` is what the kubelet would put in
`status.allocatable` (healthy devices per resource).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from dynpart.agent import podresources
from dynpart.agent.deviceplugin import protocol

_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_extended_resource_name(name: str) -> bool:
    """v1helper.IsExtendedResourceName, which the kubelet's Register checks: not a native
    resource (a domain prefix outside kubernetes.io), and `requests.<name>` a qualified name (DNS
    subdomain prefix, a name part of at most 63 characters of [-A-Za-z0-9_.] starting and ending
    alphanumeric)."""
    if "/" not in name or name.startswith("requests.") or "kubernetes.io/" in name:
        return False
    prefix, _, part = ("requests." + name).partition("/")
    return (len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(prefix)) and "/" not in part
            and 0 < len(part) <= 63 and bool(_QUALIFIED_NAME.fullmatch(part)))


class AdmissionError(Exception):
    """What the kubelet reports as UnexpectedAdmissionError: no free healthy device."""


@dataclass
class Assignment:
    pod: str
    container: str
    resource: str
    ids: list[str]
    plain_init: bool = False  # a plain init container's: the real List leaves it out


@dataclass
class PluginSeen:
    """What the kubelet knows of one registered resource."""

    resource: str
    endpoint: str
    registered_at: list[float] = field(default_factory=list)  # time.monotonic() of each Register
    options: Any = None
    lists: list[list[tuple[str, str]]] = field(default_factory=list)  # every ListAndWatch message: (id, health)
    channel: Any = None
    stub: Any = None
    stream_task: asyncio.Task[None] | None = None
    stream_error: str | None = None

    @property
    def devices(self) -> list[tuple[str, str]]:
        return self.lists[-1] if self.lists else []

    @property
    def ids(self) -> list[str]:
        return [i for i, _ in self.devices]


class KubeletDouble:
    def __init__(self, plugin_dir: str, pod_resources_socket: str | None = None):
        self.plugin_dir = plugin_dir
        self.socket = os.path.join(plugin_dir, protocol.KUBELET_SOCKET_NAME)
        # outside the plugin dir (a kubelet restart wipes that dir's sockets)
        self.pod_resources_socket = pod_resources_socket or plugin_dir.rstrip("/") + "-podresources.sock"
        self.assignments: list[Assignment] = []  # the kubelet's checkpoint: kept across restarts
        # PodResources List serves the pod manager's pods: after a restart none until the sync
        # loop's first pod list admitted them again (`pods_listed_again`), as kubelet 1.35 does
        self.pods_listed = True
        self.admission_errors: list[str] = []
        self.refuse_registration = False  # Register answers UNAVAILABLE (a kubelet not ready yet)
        self.plugins: dict[str, PluginSeen] = {}
        self.events: list[tuple[float, str, list[str]]] = []  # (time, resource, healthy ids) per message, in order
        self.register_requests: list[Any] = []
        # resource -> seconds the kubelet takes to process each message of that plugin's stream (the
        # kubelet reads each stream on its own: a list sent later on another stream can win)
        self.receive_delay_s: dict[str, float] = {}
        # None: a Register of a resource whose stream is open closes that stream first. A number:
        # as the kubelet's device manager up to 1.35 (handler.go, kubernetes#121994): the new client
        # replaces the old one under the resource's name, the old stream is left open, and when it
        # ends, this many seconds later (its goroutine's turn) the client registered under the name
        # *then* is disconnected: the new one, if it registered meanwhile
        self.old_stream_end_handled_after_s: float | None = None
        self._server: Any = None
        self._pr_server: Any = None
        self._changed = asyncio.Condition()

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((protocol.registration_handler(self._register),))
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        if os.path.exists(self.pod_resources_socket):
            os.unlink(self.pod_resources_socket)
        pr = grpc.aio.server()
        pr.add_generic_rpc_handlers((self._pod_resources_handler(),))
        pr.add_insecure_port(f"unix://{self.pod_resources_socket}")
        await pr.start()
        self._pr_server = pr

    async def stop(self) -> None:
        for p in self.plugins.values():
            await self._disconnect(p)
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        if self._pr_server is not None:
            await self._pr_server.stop(0)
            self._pr_server = None
        for path in (self.socket, self.pod_resources_socket):
            if os.path.exists(path):
                os.unlink(path)

    async def restart(self) -> float:
        """Stop, wipe the sockets in the plugin dir, start again; returns when kubelet.sock is back
        (time.monotonic())."""
        await self.stop()
        for name in os.listdir(self.plugin_dir):
            if name.endswith(".sock"):
                os.unlink(os.path.join(self.plugin_dir, name))
        self.pods_listed = False
        await self.start()
        return time.monotonic()

    def pods_listed_again(self) -> None:
        """The restarted kubelet's first pod list admitted its pods again: List shows them."""
        self.pods_listed = True

    async def __aenter__(self) -> KubeletDouble:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- Registration -------------------------------------------------------------------------

    async def _register(self, request: Any, context: Any) -> Any:
        self.register_requests.append(request)
        if self.refuse_registration:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet's device manager is not ready")
        if request.version != protocol.VERSION:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        if not is_extended_resource_name(request.resource_name):
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid name of device plugin socket: {request.resource_name!r}")
        # the kubelet (1.26+, plugin/v1beta1 server.go Register -> connectClient -> client.Connect):
        # it dials the plugin's socket (blocking, 10 s at most) and asks GetDevicePluginOptions
        # before it answers; either failing fails the Register. ListAndWatch starts afterwards.
        try:
            async with grpc.aio.insecure_channel(f"unix://{os.path.join(self.plugin_dir, request.endpoint)}") as ch:
                await protocol.DevicePluginStub(ch).GetDevicePluginOptions(protocol.messages()["Empty"](), timeout=10)
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {e.code().name}: {e.details()}")
        p = self.plugins.get(request.resource_name)
        if p is None:
            p = self.plugins[request.resource_name] = PluginSeen(request.resource_name, request.endpoint)
        else:
            if self.old_stream_end_handled_after_s is None:
                await self._disconnect(p)
            p.endpoint = request.endpoint
        p.registered_at.append(time.monotonic())
        p.stream_task = asyncio.create_task(self._connect(p))  # as the kubelet: after answering
        async with self._changed:
            self._changed.notify_all()
        return protocol.messages()["Empty"]()

    async def _disconnect(self, p: PluginSeen) -> None:
        if p.stream_task is not None:
            p.stream_task.cancel()
            try:
                await p.stream_task
            except (asyncio.CancelledError, Exception):
                pass
            p.stream_task = None
        if p.channel is not None:
            await p.channel.close()
            p.channel = None

    async def _connect(self, p: PluginSeen) -> None:
        me = asyncio.current_task()
        channel = p.channel = grpc.aio.insecure_channel(f"unix://{os.path.join(self.plugin_dir, p.endpoint)}")
        stub = p.stub = protocol.DevicePluginStub(p.channel)
        p.stream_error = None
        try:
            p.options = await stub.GetDevicePluginOptions(protocol.messages()["Empty"](), timeout=5)
            async for response in stub.ListAndWatch(protocol.messages()["Empty"]()):
                if self.receive_delay_s.get(p.resource):
                    await asyncio.sleep(self.receive_delay_s[p.resource])
                devices = [(d.ID, d.health) for d in response.devices]
                async with self._changed:
                    p.lists.append(devices)
                    self.events.append((time.monotonic(), p.resource, [i for i, h in devices if h == protocol.HEALTHY]))
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as e:
            p.stream_error = f"{e.code().name}: {e.details()}"
        if self.old_stream_end_handled_after_s is not None:
            # runClient: the stream ended; the client under the name now is disconnected
            await channel.close()
            await asyncio.sleep(self.old_stream_end_handled_after_s)
            current = p.stream_task
            if current is not None and current is not me:
                p.stream_task = None
                current.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await current
                if p.channel is not None:
                    await p.channel.close()
                    p.channel = None
        async with self._changed:
            self._changed.notify_all()

    # --- what tests ask -----------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async with self._changed:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait_for(predicate)

    async def wait_registered(self, resource: str, times: int = 1, timeout_s: float = 5.0) -> PluginSeen:
        await self.wait_for(lambda: resource in self.plugins and len(self.plugins[resource].registered_at) >= times
                            and bool(self.plugins[resource].lists), timeout_s)
        return self.plugins[resource]

    async def wait_devices(self, resource: str, ids: list[str], timeout_s: float = 5.0) -> PluginSeen:
        await self.wait_for(lambda: resource in self.plugins and self.plugins[resource].ids == ids, timeout_s)
        return self.plugins[resource]

    async def wait_for_devices(self, resource: str, devices: list[tuple[str, str]], timeout_s: float = 5.0) -> PluginSeen:
        """Until the plugin's last list is exactly these (id, health) pairs."""
        await self.wait_for(lambda: resource in self.plugins and self.plugins[resource].devices == devices, timeout_s)
        return self.plugins[resource]

    def allocatable(self) -> dict[str, int]:
        """Healthy devices per resource on open streams (what status.allocatable would show)."""
        return {r: sum(1 for _, h in p.devices if h == protocol.HEALTHY) for r, p in self.plugins.items()
                if p.stream_task is not None and not p.stream_task.done()}

    async def allocate(self, resource: str, *containers: list[str]) -> Any:
        msgs = protocol.messages()
        request = msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=ids)
                                                              for ids in containers])
        return await self.plugins[resource].stub.Allocate(request, timeout=5)

    async def preferred(self, resource: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        msgs = protocol.messages()
        request = msgs["PreferredAllocationRequest"](container_requests=[msgs["ContainerPreferredAllocationRequest"](
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        response = await self.plugins[resource].stub.GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)

    # --- admission and PodResources ---------------------------------------------------------------

    def held(self) -> dict[str, list[str]]:
        """What GetAllocatableResources answers: the healthy devices of each resource whose plugin
        stream is open (a recent kubelet's answer)."""
        return {r: [i for i, h in p.devices if h == protocol.HEALTHY] for r, p in self.plugins.items()
                if p.stream_task is not None and not p.stream_task.done()}

    def free(self, resource: str) -> list[str]:
        taken = {i for a in self.assignments if a.resource == resource for i in a.ids}
        return [i for i in self.held().get(resource, []) if i not in taken]

    async def choose(self, resource: str, n: int = 1) -> list[str]:
        """The device-manager's pick for a container (GetPreferredAllocation if offered)."""
        free = self.free(resource)
        if len(free) < n:
            message = (f"UnexpectedAdmissionError: requested {n} {resource}, {len(free)} free healthy "
                       f"({', '.join(free) or 'none'})")
            self.admission_errors.append(message)
            raise AdmissionError(message)
        # as devicesToAllocate (devicemanager/manager.go): the plugin's preference counts only for
        # the devices available (any other id it names is ignored), the rest is filled in sorted
        # order (sets.List), as it is without a preference
        available = sorted(free)
        chosen: list[str] = []
        p = self.plugins[resource]
        if p.options is not None and p.options.get_preferred_allocation_available:
            preferred = await self.preferred(resource, available, [], n)
            chosen = [i for i in dict.fromkeys(preferred) if i in free][:n]
        return chosen + [i for i in available if i not in chosen][:n - len(chosen)]

    async def admit(self, pod: str, resource: str, n: int = 1, container: str = "main", plain_init: bool = False) -> Any:
        """Admit a pod's container: choose, Allocate, record (the Allocate response is returned).
        A refused Allocate is an admission error too. `plain_init`: a plain init container's
        (not restartable), whose devices PodResources List never shows."""
        ids = await self.choose(resource, n)
        return await self.complete_admission(pod, resource, ids, container, plain_init)

    async def complete_admission(self, pod: str, resource: str, ids: list[str], container: str = "main",
                                 plain_init: bool = False) -> Any:
        """The second half of `admit` (a test can do something between the pick and Allocate)."""
        try:
            response = await self.allocate(resource, ids)
        except grpc.aio.AioRpcError as e:
            message = f"UnexpectedAdmissionError: Allocate {resource} {ids}: {e.code().name}: {e.details()}"
            self.admission_errors.append(message)
            raise AdmissionError(message) from None
        self.assignments.append(Assignment(pod, container, resource, list(ids), plain_init))
        return response

    def release(self, pod: str) -> None:
        self.assignments = [a for a in self.assignments if a.pod != pod]

    def _pod_resources_handler(self) -> Any:
        msgs = podresources.messages()

        async def list_pods(request: Any, context: Any) -> Any:
            by_pod: dict[str, dict[str, list[Assignment]]] = {}
            for a in self.assignments if self.pods_listed else []:
                if a.plain_init:  # the kubelet lists only containers and restartable init containers
                    continue
                by_pod.setdefault(a.pod, {}).setdefault(a.container, []).append(a)
            pods = []
            for pod, containers in by_pod.items():
                namespace, name = pod.split("/", 1)
                pods.append(msgs["PodResources"](name=name, namespace=namespace, containers=[
                    msgs["ContainerResources"](name=c, devices=[msgs["ContainerDevices"](resource_name=a.resource,
                                                                                         device_ids=a.ids) for a in assigned])
                    for c, assigned in containers.items()]))
            return msgs["ListPodResourcesResponse"](pod_resources=pods)

        async def allocatable(request: Any, context: Any) -> Any:
            return msgs["AllocatableResourcesResponse"](devices=[
                msgs["ContainerDevices"](resource_name=r, device_ids=ids) for r, ids in self.held().items()])

        def method(fn: Any, request: str) -> Any:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=msgs[request].FromString,
                                                       response_serializer=lambda m: m.SerializeToString())

        return grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": method(list_pods, "ListPodResourcesRequest"),
            "GetAllocatableResources": method(allocatable, "AllocatableResourcesRequest")})
