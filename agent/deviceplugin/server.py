"""The kubelet device plugin inside the agent: one gRPC server per resource name (`PluginServer`)
and the manager the agent drives (`DevicePluginManager`).

- `PluginServer` serves `v1beta1.DevicePlugin` on `<plugin dir>/dynpart-<resource>.sock`
  (grpc.aio): GetDevicePluginOptions, ListAndWatch (the full list at start and on every change),
  GetPreferredAllocation, Allocate, PreStartContainer (no-op), and registers itself with the
  kubelet's `Registration.Register` on `<plugin dir>/kubelet.sock`.
- `DevicePluginManager.update(devices_by_resource)` after each agent pass: a resource that
  appears gets a server, one that disappears is emptied then stopped, a changed list is pushed
  on ListAndWatch. Lists that shrink are pushed (and written to the kubelet's streams) before
  lists that grow, so a GPU that goes from whole to sliced is not advertised both ways at once.
  `withdraw(ids)` stops advertising devices (a slice about to be destroyed) and refuses Allocate
  for them.
- The manager watches the plugin dir: when `kubelet.sock` is re-created (kubelet restart) or a
  plugin's own socket disappears (the kubelet wipes the dir), the server is restarted and
  registers again (polling every `poll_s`, 0.1 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import (
    MPS_PIPE_DIRECTORY,
    PluginDevice,
    check_exclusive,
    container_allocation,
)

log = logging.getLogger("dynpart.agent.deviceplugin")

# (resource, available ids, ids that must be included, allocation size) -> ids to prefer (or None)
PreferredHook = Callable[[str, list[str], list[str], int], Sequence[str] | None]


def socket_name(resource: str) -> str:
    """`nvidia.com/mig-1g.10gb` -> `dynpart-nvidia.com_mig-1g.10gb.sock`."""
    return "dynpart-" + re.sub(r"[^A-Za-z0-9.-]", "_", resource) + ".sock"


def _stamp(path: str) -> tuple[int, int] | None:
    """What tells one incarnation of a file from the next (inode numbers alone can be reused)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


@dataclass(frozen=True)
class MpsSettings:
    pipe_dir_host: str = MPS_PIPE_DIRECTORY
    pipe_dir_container: str = MPS_PIPE_DIRECTORY


class PluginServer:
    """The DevicePlugin service for one resource name."""

    def __init__(self, resource: str, plugin_dir: str, devices: Iterable[PluginDevice] = (), *,
                 preferred: PreferredHook | None = None, mps: MpsSettings | None = None,
                 withdrawn: set[str] | None = None, sealed: set[str] | None = None,
                 allocated: dict[str, float] | None = None):
        self.resource = resource
        self.plugin_dir = plugin_dir
        self.endpoint = socket_name(resource)
        self.socket_path = os.path.join(plugin_dir, self.endpoint)
        self.preferred = preferred
        self.mps = mps or MpsSettings()
        # withdrawn: no longer listed, still served by Allocate (the kubelet may have picked it just
        # before it read the new list; the agent then keeps it). sealed: about to be destroyed, refused.
        self.withdrawn = withdrawn if withdrawn is not None else set()
        self.sealed = sealed if sealed is not None else set()
        self.allocated = allocated if allocated is not None else {}  # device id -> time.monotonic() of its last Allocate
        self._known: dict[str, PluginDevice] = {d.id: d for d in devices}  # listed or withdrawn, until destroyed
        self._devices: list[PluginDevice] = list(devices)
        self._version = 0
        self._streams: dict[int, int] = {}  # stream id -> version last written
        self._next_stream = 0
        self._cond = asyncio.Condition()
        self._server: Any = None
        self._stopping = False
        self.registered_stamp: tuple[int, int] | None = None  # kubelet.sock's stamp at the last Register
        self.registrations = 0

    # --- state --------------------------------------------------------------------------------

    @property
    def devices(self) -> list[PluginDevice]:
        return list(self._devices)

    @property
    def running(self) -> bool:
        return self._server is not None

    def socket_exists(self) -> bool:
        return os.path.exists(self.socket_path)

    async def set_devices(self, devices: Iterable[PluginDevice]) -> bool:
        """Replace the advertised list; True (and a ListAndWatch message) if it changed."""
        new = list(devices)
        self._known = {i: d for i, d in self._known.items() if i in self.withdrawn} | {d.id: d for d in new}
        if new == self._devices:
            return False
        async with self._cond:
            self._devices = new
            self._version += 1
            self._cond.notify_all()
        return True

    async def wait_written(self, timeout_s: float = 1.0) -> bool:
        """Wait until every open ListAndWatch stream has written the current list."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(
                    lambda: self._stopping or all(v >= self._version for v in self._streams.values())), timeout_s)
            except TimeoutError:
                return False
        return True

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        import grpc.aio

        if self._server is not None:
            return
        os.makedirs(self.plugin_dir, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._stopping = False
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((protocol.device_plugin_handler(self),))
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self, grace_s: float = 0.2) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        async with self._cond:
            self._stopping = True
            self._cond.notify_all()
        await server.stop(grace_s)
        self._streams.clear()
        if os.path.exists(self.socket_path):
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    async def restart(self) -> None:
        await self.stop(0)
        self.registered_stamp = None
        await self.start()

    async def register(self, kubelet_socket: str, timeout_s: float = 5.0) -> None:
        """Register with the kubelet (raises grpc.aio.AioRpcError if it refuses or is not there)."""
        import grpc.aio

        msgs = protocol.messages()
        request = msgs["RegisterRequest"](version=protocol.VERSION, endpoint=self.endpoint, resource_name=self.resource,
                                          options=self.options())
        stamp = _stamp(kubelet_socket)
        async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
            await protocol.RegistrationStub(channel).Register(request, timeout=timeout_s)
        self.registered_stamp = stamp
        self.registrations += 1
        log.info("device plugin for %s registered with the kubelet (%s)", self.resource, self.endpoint)

    def options(self) -> Any:
        return protocol.messages()["DevicePluginOptions"](pre_start_required=False, get_preferred_allocation_available=True)

    # --- the DevicePlugin service (names as in api.proto) -----------------------------------------

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options()

    def _list_response(self, devices: list[PluginDevice]) -> Any:
        msgs = protocol.messages()
        out = []
        for d in devices:
            m = msgs["Device"](ID=d.id, health=protocol.HEALTHY if d.healthy else protocol.UNHEALTHY)
            if d.numa_node is not None:
                m.topology.nodes.add(ID=d.numa_node)
            out.append(m)
        return msgs["ListAndWatchResponse"](devices=out)

    async def ListAndWatch(self, request: Any, context: Any) -> Any:
        stream = self._next_stream
        self._next_stream += 1
        self._streams[stream] = -1
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._stopping or self._streams.get(stream, -1) < self._version)
                    if self._stopping:
                        return
                    version, devices = self._version, list(self._devices)
                yield self._list_response(devices)
                async with self._cond:  # resumed: the message was written
                    self._streams[stream] = version
                    self._cond.notify_all()
        finally:
            self._streams.pop(stream, None)

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        msgs = protocol.messages()
        responses = []
        order = {d.id: i for i, d in enumerate(self._devices)}
        for r in request.container_requests:
            available = list(r.available_deviceIDs)
            must = list(r.must_include_deviceIDs)
            size = r.allocation_size
            hinted = list(self.preferred(self.resource, available, must, size) or ()) if self.preferred else []
            pool = set(available)
            chosen = list(dict.fromkeys(must))
            for d in hinted + sorted(available, key=lambda i: order.get(i, len(order))):
                if len(chosen) >= size:
                    break
                if d in pool and d not in chosen:
                    chosen.append(d)
            responses.append(msgs["ContainerPreferredAllocationResponse"](deviceIDs=chosen[:max(size, len(must))]))
        return msgs["PreferredAllocationResponse"](container_responses=responses)

    async def Allocate(self, request: Any, context: Any) -> Any:
        import grpc

        msgs = protocol.messages()
        # a withdrawn (not yet sealed) device is still served: the kubelet chose it before it read
        # the list without it, and refusing would fail the pod's admission (UnexpectedAdmissionError)
        by_id = {i: d for i, d in self._known.items() if i not in self.sealed}
        responses = []
        for r in request.container_requests:
            ids = list(r.devices_ids)
            sealed = [i for i in ids if i in self.sealed]
            if sealed:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{self.resource}: device(s) {', '.join(sealed)} withdrawn and being destroyed "
                                    "(re-partitioned)")
            unknown = [i for i in ids if i not in by_id]
            if unknown or not ids:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"{self.resource}: unknown device id(s) {', '.join(unknown) or '(none requested)'}; "
                                    f"this plugin advertises {', '.join(by_id) or 'nothing'}")
            now = time.monotonic()
            for i in ids:
                self.allocated[i] = now
            a = container_allocation([by_id[i] for i in ids], self.mps.pipe_dir_host, self.mps.pipe_dir_container)
            responses.append(msgs["ContainerAllocateResponse"](
                envs=a.envs, mounts=[msgs["Mount"](host_path=m.host_path, container_path=m.container_path,
                                                   read_only=m.read_only) for m in a.mounts]))
        return msgs["AllocateResponse"](container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return protocol.messages()["PreStartContainerResponse"]()


class DevicePluginManager:
    """The plugins of one node: `update()` after each pass, `withdraw()` before destroying."""

    def __init__(self, plugin_dir: str = protocol.DEVICE_PLUGIN_DIR, *, preferred: PreferredHook | None = None,
                 mps: MpsSettings | None = None, poll_s: float = 0.1, register_timeout_s: float = 5.0):
        self.plugin_dir = plugin_dir
        self.kubelet_socket = os.path.join(plugin_dir, protocol.KUBELET_SOCKET_NAME)
        self.preferred = preferred
        self.mps = mps or MpsSettings()
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.servers: dict[str, PluginServer] = {}
        self.withdrawn: set[str] = set()
        self.sealed: set[str] = set()  # withdrawn and about to be destroyed: Allocate refuses them
        self.allocated: dict[str, float] = {}  # device id -> time.monotonic() of its last Allocate (any resource)
        self._wanted: dict[str, list[PluginDevice]] = {}
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._failing: set[str] = set()
        self.registrations: list[tuple[str, float]] = []  # (resource, time.monotonic()) per successful Register

    async def start(self) -> None:
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_loop(), name="device-plugin-watch")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
            self._watch = None
        async with self._lock:
            for server in self.servers.values():
                await server.stop()
            self.servers.clear()

    async def __aenter__(self) -> DevicePluginManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def advertised(self) -> dict[str, list[PluginDevice]]:
        return {r: s.devices for r, s in self.servers.items()}

    async def update(self, devices_by_resource: Mapping[str, Iterable[PluginDevice]]) -> None:
        """Make the plugins advertise `devices_by_resource` (less the withdrawn ids). Raises
        DeviceListError (and changes nothing) if a GPU would be advertised whole and sliced."""
        wanted = {r: list(ds) for r, ds in devices_by_resource.items()}
        check_exclusive(wanted)
        present = {d.id for ds in wanted.values() for d in ds}
        async with self._lock:
            self.withdrawn &= present  # a withdrawn device that is gone has been destroyed
            self.sealed &= present
            self._wanted = wanted
            await self._apply()

    async def withdraw(self, *device_ids: str) -> None:
        """Stop advertising these devices (and refuse Allocate for them); returns once the new
        lists are written to the kubelet's ListAndWatch streams."""
        async with self._lock:
            self.withdrawn |= set(device_ids)
            await self._apply()

    async def readmit(self, *device_ids: str) -> None:
        """Advertise withdrawn devices again (they were not destroyed after all)."""
        async with self._lock:
            self.withdrawn -= set(device_ids)
            self.sealed -= set(device_ids)
            await self._apply()

    async def written(self, timeout_s: float = 1.0) -> bool:
        """Whether every open ListAndWatch stream has written its current list (waiting up to
        `timeout_s`)."""
        results = [await s.wait_written(timeout_s) for s in list(self.servers.values())]
        return all(results)

    def seal(self, *device_ids: str) -> None:
        """From now on Allocate refuses these (withdrawn) devices: the agent is destroying them.
        Until sealed, a withdrawn device is still served (the kubelet may have chosen it just
        before it read the list without it): the agent checks `last_allocated` before sealing."""
        missing = [i for i in device_ids if i not in self.withdrawn]
        if missing:
            raise ValueError(f"seal: device(s) {', '.join(missing)} were not withdrawn first")
        self.sealed |= set(device_ids)

    def last_allocated(self, device_id: str) -> float | None:
        """time.monotonic() of the last Allocate that named this device (None: never)."""
        return self.allocated.get(device_id)

    async def _apply(self) -> None:
        target = {r: [d for d in ds if d.id not in self.withdrawn] for r, ds in self._wanted.items()}
        # first what shrinks or goes away (written before anything grows), then the rest
        shrinking = [s for r, s in self.servers.items()
                     if r not in target or not {d.id for d in s.devices} <= {d.id for d in target[r]}]
        for s in shrinking:
            await s.set_devices(target.get(s.resource, []))
        for s in shrinking:
            await s.wait_written()
        for resource in [r for r in self.servers if r not in target]:
            await self.servers.pop(resource).stop()
        for resource, devices in target.items():
            server = self.servers.get(resource)
            if server is None:
                server = PluginServer(resource, self.plugin_dir, devices, preferred=self.preferred, mps=self.mps,
                                      withdrawn=self.withdrawn, sealed=self.sealed, allocated=self.allocated)
                self.servers[resource] = server
                await server.start()
                await self._register(server)
            else:
                await server.set_devices(devices)

    async def _register(self, server: PluginServer) -> None:
        import grpc.aio

        if not os.path.exists(self.kubelet_socket):
            return
        try:
            await server.register(self.kubelet_socket, self.register_timeout_s)
        except grpc.aio.AioRpcError as e:
            level = logging.DEBUG if server.resource in self._failing else logging.WARNING
            log.log(level, "device plugin for %s: Register at %s failed: %s: %s (retrying)", server.resource,
                    self.kubelet_socket, e.code().name, e.details())
            self._failing.add(server.resource)
            return
        self._failing.discard(server.resource)
        self.registrations.append((server.resource, time.monotonic()))

    async def check(self) -> None:
        """One look at the plugin dir: restart and re-register what the kubelet lost."""
        stamp = _stamp(self.kubelet_socket)
        if stamp is None:
            return
        async with self._lock:
            for server in list(self.servers.values()):
                lost = not server.socket_exists()
                if not lost and server.registered_stamp == stamp:
                    continue
                if lost or server.registered_stamp is not None:  # kubelet restarted: fresh server, fresh streams
                    log.info("device plugin for %s: %s; serving again", server.resource,
                             "its socket is gone" if lost else "kubelet.sock was re-created")
                    await server.restart()
                await self._register(server)

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching: the next look may succeed
                log.exception("device plugin watch")
            await asyncio.sleep(self.poll_s)
