"""The kubelet device plugin inside the agent: one gRPC server per resource name (`PluginServer`)
and the manager the agent drives (`DevicePluginManager`).

- `PluginServer` serves `v1beta1.DevicePlugin` on `<plugin dir>/dynpart-<resource>.sock`
  (grpc.aio): GetDevicePluginOptions, ListAndWatch (the full list at start and on every change),
  GetPreferredAllocation, Allocate, PreStartContainer (no-op), and registers itself with the
  kubelet's `Registration.Register` on `<plugin dir>/kubelet.sock`.
- `DevicePluginManager.update(devices_by_resource)` after each agent pass: a resource that
  appears gets a server, one that disappears is emptied then stopped, a changed list is pushed
  on ListAndWatch. What leaves a list is pushed first (each list shrunk, nothing added), and a
  device is added only once the kubelet no longer holds what left another resource's list on
  the same GPU: the kubelet reads each plugin's stream on its own, so a list written on one
  stream can be processed after a list written later on another; only the kubelet's own
  answer (PodResources `GetAllocatableResources`, the `held` hook) says it dropped a device.
  Until then the addition is held back (`pending`), so a GPU that goes from whole to sliced
  (or from one slice size to another) is never advertised both ways at once. A resource that
  disappears is stopped once the kubelet dropped its devices. `withdraw(ids)` stops
  advertising devices (a slice about to be destroyed), returns once the kubelet dropped them,
  and Allocate refuses them once sealed.
- The manager watches the plugin dir: when `kubelet.sock` is re-created (kubelet restart) or a
  plugin's own socket disappears (the kubelet wipes the dir), the server is restarted and
  registers again (polling every `poll_s`, 0.1 s by default).
- `serve=False`: the same lists, withdrawals and Allocate (called in-process), but no socket and
  no registration: for an agent without a kubelet (unit tests, the e2e harness's shortcut nodes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.cdi import (
    DEFAULT_KIND,
    CdiSpecWriter,
    cdi_annotations,
    device_name,
    qualified_names,
    valid_name,
)
from dynpart.agent.deviceplugin.devices import (
    MPS_PIPE_DIRECTORY,
    DeviceList,
    PluginDevice,
    check_exclusive,
    container_allocation,
    device_specs,
)

log = logging.getLogger("dynpart.agent.deviceplugin")

# (resource, available ids, ids that must be included, allocation size) -> ids to prefer (or None)
PreferredHook = Callable[[str, list[str], list[str], int], Sequence[str] | None]
# what the kubelet's device manager holds: resource -> device ids (PodResources GetAllocatableResources)
HeldHook = Callable[[], Awaitable[Mapping[str, Iterable[str]]]]


REGISTRATIONS_KEPT = 256  # `DevicePluginManager.registrations`


def socket_name(resource: str) -> str:
    """`nvidia.com/mig-1g.10gb` -> `dynpart-nvidia.com_mig-1g.10gb.sock`."""
    return "dynpart-" + re.sub(r"[^A-Za-z0-9.-]", "_", resource) + ".sock"


def file_stamp(path: str) -> tuple[int, int] | None:
    """What tells one incarnation of a file from the next (inode numbers alone can be reused)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


class _NotServed:
    """In place of the gRPC server of a plugin that serves no socket (`serve=False`)."""

    async def stop(self, grace: float | None) -> None:
        return None


@dataclass(frozen=True)
class AllocateSettings:
    """What Allocate hands a container besides its devices: the MPS pipe directory, the MPS
    daemon's shared memory (`mps_shm_host`: asked at each Allocate, the host directory that is the
    running daemon's /dev/shm, or None), how the devices are named to the NVIDIA container
    runtime (`devices.DeviceList`), and whether their device nodes are given as DeviceSpecs
    (`device_specs`: host paths under `dev_root`, given only where they exist in `dev_dir`, the
    agent's view of the host's `<dev_root>/dev`, looked at on each Allocate). With a CDI
    strategy (`cdi-cri`, `cdi-annotations`) the devices are named `<cdi_kind>=<UUID>`
    (deviceplugin/cdi.py)."""

    pipe_dir_host: str = MPS_PIPE_DIRECTORY
    pipe_dir_container: str = MPS_PIPE_DIRECTORY
    device_list: DeviceList = "envvar"
    mps_shm_host: Callable[[], str | None] = lambda: None
    device_specs: bool = True
    dev_root: str = "/"
    dev_dir: str = "/dev"
    cdi_kind: str = DEFAULT_KIND

    def node_exists(self, path: str) -> bool:
        """Whether device node `path` (/dev/...) is on the host, seen in `dev_dir`."""
        return os.path.exists(os.path.join(self.dev_dir, os.path.relpath(path, "/dev")))


class PluginServer:
    """The DevicePlugin service for one resource name."""

    def __init__(self, resource: str, plugin_dir: str, devices: Iterable[PluginDevice] = (), *,
                 preferred: PreferredHook | None = None, allocate: AllocateSettings | None = None,
                 withdrawn: set[str] | None = None, sealed: set[str] | None = None,
                 allocated: dict[str, float] | None = None, serve: bool = True):
        self.resource = resource
        self.serve = serve
        self.plugin_dir = plugin_dir
        self.endpoint = socket_name(resource)
        self.socket_path = os.path.join(plugin_dir, self.endpoint)
        self.preferred = preferred
        self.allocate = allocate or AllocateSettings()
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
        self.registered_at = 0.0  # time.monotonic() of the last Register, or of the last try after a drop
        # the kubelet closed the last open ListAndWatch stream while this server ran (not at a stop)
        self.stream_closed_by_kubelet = False
        self.drop_said = False  # the drop was logged (once per drop)

    # --- state --------------------------------------------------------------------------------

    @property
    def devices(self) -> list[PluginDevice]:
        return list(self._devices)

    @property
    def running(self) -> bool:
        return self._server is not None

    def socket_exists(self) -> bool:
        return os.path.exists(self.socket_path)

    def known(self) -> list[PluginDevice]:
        """The devices Allocate serves: listed, or withdrawn and not yet destroyed."""
        return list(self._known.values())

    def forget(self, gone: set[str]) -> None:
        """Destroyed devices: Allocate no longer knows them (they are listed no more already)."""
        for i in gone:
            self._known.pop(i, None)

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
                async with asyncio.timeout(timeout_s):
                    await self._cond.wait_for(
                        lambda: self._stopping or all(v >= self._version for v in self._streams.values()))
            except TimeoutError:
                return False
        return True

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        import grpc.aio

        if self._server is not None:
            return
        if not self.serve:
            self._stopping = False
            self._server = _NotServed()
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
        stamp = file_stamp(kubelet_socket)
        async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
            await protocol.RegistrationStub(channel).Register(request, timeout=timeout_s)
        self.registered_stamp = stamp
        self.registrations += 1
        self.registered_at = time.monotonic()
        log.info("device plugin for %s registered with the kubelet (%s)", self.resource, self.endpoint)

    def dropped_by_kubelet(self, settle_s: float = 1.0, never_opened_s: float = 30.0) -> bool:
        """No stream of the kubelet's open on this running server: the kubelet closed ours, and
        `settle_s` passed since the last Register (answered before the kubelet dials) or the last
        try after a drop; or it opened none for `never_opened_s` (it dropped the client before
        opening one; a busy kubelet may take seconds to dial, and a Register too many is the race
        it would answer)."""
        since = time.monotonic() - self.registered_at
        return not self._streams and since >= (settle_s if self.stream_closed_by_kubelet else never_opened_s)

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
        self.stream_closed_by_kubelet = self.drop_said = False
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._stopping or self._streams.get(stream, -1) < self._version)
                    if self._stopping:
                        return
                    version, devices = self._version, list(self._devices)
                yield self._list_response(devices)
                async with self._cond:  # resumed: gRPC sent the message (the kubelet may not have read it yet)
                    if stream in self._streams:  # not a stream of a server stopped meanwhile
                        self._streams[stream] = version
                    self._cond.notify_all()
        finally:
            self._streams.pop(stream, None)
            if not self._stopping and not self._streams:
                self.stream_closed_by_kubelet = True

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
            devices = [by_id[i] for i in ids]
            a = container_allocation(devices, self.allocate.pipe_dir_host,
                                     self.allocate.pipe_dir_container, self.allocate.device_list,
                                     self.allocate.mps_shm_host())
            specs = (device_specs(devices, self.allocate.dev_root, self.allocate.node_exists)
                     if self.allocate.device_specs else ())
            strategy = self.allocate.device_list
            names = qualified_names(self.allocate.cdi_kind, devices) if strategy.startswith("cdi-") else []
            responses.append(msgs["ContainerAllocateResponse"](
                envs=a.envs, mounts=[msgs["Mount"](host_path=m.host_path, container_path=m.container_path,
                                                   read_only=m.read_only) for m in a.mounts],
                devices=[msgs["DeviceSpec"](container_path=d.container_path, host_path=d.host_path,
                                            permissions=d.permissions) for d in specs],
                cdi_devices=[msgs["CDIDevice"](name=n) for n in names] if strategy == "cdi-cri" else [],
                annotations=cdi_annotations(str(uuid.uuid4()), names) if strategy == "cdi-annotations" else {}))
        return msgs["AllocateResponse"](container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return protocol.messages()["PreStartContainerResponse"]()


class DevicePluginManager:
    """The plugins of one node: `update()` after each pass, `withdraw()` before destroying."""

    def __init__(self, plugin_dir: str = protocol.DEVICE_PLUGIN_DIR, *, preferred: PreferredHook | None = None,
                 allocate: AllocateSettings | None = None, poll_s: float = 0.1, register_timeout_s: float = 5.0,
                 held: HeldHook | None = None, confirm_timeout_s: float = 2.0, serve: bool = True,
                 cdi: CdiSpecWriter | None = None):
        self.plugin_dir = plugin_dir
        # the CDI spec naming what Allocate may serve (a CDI device-list strategy), or None: written
        # before a device is added to a list, after every change; a device the spec on disk does not
        # name (its write failed) is held back
        self.cdi = cdi
        # no spec is written before the first `update`: a restarted agent whose first pass cannot
        # read the GPUs (`set_unhealthy`) keeps the last agent's, which running pods resolve from
        self._updated = False
        self.kubelet_socket = os.path.join(plugin_dir, protocol.KUBELET_SOCKET_NAME)
        self.preferred = preferred
        self.allocate = allocate or AllocateSettings()
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.serve = serve  # False: no socket, no registration (see the module doc)
        self.servers: dict[str, PluginServer] = {}
        self.withdrawn: set[str] = set()
        self.sealed: set[str] = set()  # withdrawn and about to be destroyed: Allocate refuses them
        self.allocated: dict[str, float] = {}  # device id -> time.monotonic() of its last Allocate (any resource)
        self._wanted: dict[str, list[PluginDevice]] = {}
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._failing: set[str] = set()
        # (resource, time.monotonic()) of the last successful Registers (only recent ones are read;
        # a long-lived agent registers again at every kubelet restart and every new resource)
        self.registrations: deque[tuple[str, float]] = deque(maxlen=REGISTRATIONS_KEPT)
        # what the kubelet holds (the agent sets its PodResources client's `allocatable`); None: the
        # lists' order across streams is not checked (a shrink written to its stream counts as done)
        self.held = held
        self.confirm_timeout_s = confirm_timeout_s
        # resource -> {device id -> its GPU's UUID}: left that resource's list, the kubelet not yet seen
        # to drop it
        self.leaving: dict[str, dict[str, str]] = {}
        # resource -> device ids wanted but held back: their GPU still has a device the kubelet holds
        # under another resource
        self.pending: dict[str, list[str]] = {}
        self.on_registered: Callable[[str], None] | None = None  # called after each successful Register
        # servers `_apply` started under the lock, registered once it is released (`_register_new`),
        # each with its count of Registers then
        self._unregistered: list[tuple[PluginServer, int]] = []
        self._registering: set[str] = set()  # resources whose Register is under way

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
            self._drop_allocated(set(self.allocated) - present)  # (Allocate refuses an id it does not list)
            self._wanted = wanted
            self._updated = True
            await self._apply()
        await self._register_new()

    async def withdraw(self, *device_ids: str) -> set[str]:
        """Stop advertising these devices; returns once the kubelet dropped them (its PodResources
        no longer lists them; without `held`: once the new lists are written to its streams), or
        after `confirm_timeout_s`. Returns those the kubelet still held then: it may still give
        them to a pod, so they must not be sealed nor destroyed."""
        async with self._lock:
            self.withdrawn |= set(device_ids)
            await self._apply()
            still = {i for ids in self.leaving.values() for i in ids}
        await self._register_new()
        return {i for i in device_ids if i in still}

    async def readmit(self, *device_ids: str) -> None:
        """Advertise withdrawn devices again (they were not destroyed after all)."""
        async with self._lock:
            self.withdrawn -= set(device_ids)
            self.sealed -= set(device_ids)
            await self._apply()
        await self._register_new()

    async def forget(self, *device_ids: str) -> None:
        """These withdrawn devices were destroyed: drop them from every record at once, not at the
        next `update`. A driver may give a new device the id of one just destroyed (a MIG instance
        re-created at the same GPU-instance id), which must not inherit its withdrawal or seal;
        and no later list may bring back a destroyed one from the lists wanted before."""
        gone = set(device_ids)
        async with self._lock:
            self.withdrawn -= gone
            self.sealed -= gone
            self._drop_allocated(gone)  # nor its last Allocate, which would make a new one look taken
            self._wanted = {r: [d for d in ds if d.id not in gone] for r, ds in self._wanted.items()}
            for s in self.servers.values():
                s.forget(gone)
            self._write_cdi()

    async def set_unhealthy(self) -> None:
        """Every device listed Unhealthy (the GPUs cannot be read); the next `update` says again
        which are healthy."""
        async with self._lock:
            self._wanted = {r: [replace(d, healthy=False) for d in ds] for r, ds in self._wanted.items()}
            await self._apply(wait=False)
        await self._register_new()

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

    def _drop_allocated(self, ids: Iterable[str]) -> None:
        # in place: the servers share this dict (they record each Allocate in it)
        for i in ids:
            self.allocated.pop(i, None)

    async def _apply(self, wait: bool = True) -> None:
        """Make the servers advertise `_wanted` less the withdrawn ids: first every list shrunk
        (nothing added), then, once the kubelet dropped what left (waiting up to
        `confirm_timeout_s` when something to add or a withdrawal waits for it; `wait` False: one
        look), the additions that cannot put a GPU under two resources at the kubelet. The others
        stay in `pending` until a later call finds the kubelet caught up."""
        target = {r: [d for d in ds if d.id not in self.withdrawn] for r, ds in self._wanted.items()}
        wanted_ids = {r: {d.id for d in ds} for r, ds in target.items()}
        # 1. what leaves a list, alone: each server's list shrunk to what stays
        shrinking = []
        for r, s in self.servers.items():
            stay = [d for d in s.devices if d.id in wanted_ids.get(r, set())]
            gone = {d.id: d.gpu_uuid for d in s.devices if d.id not in wanted_ids.get(r, set())}
            if gone:
                self.leaving.setdefault(r, {}).update(gone)
                await s.set_devices(stay)
                shrinking.append(s)
        for r in list(self.leaving):  # advertised again under the same resource (readmitted): not leaving
            self.leaving[r] = {i: g for i, g in self.leaving[r].items() if i not in wanted_ids.get(r, set())}
            if not self.leaving[r]:
                del self.leaving[r]
        for s in shrinking:
            await s.wait_written()
        # 2. until the kubelet dropped what left (PodResources), when an addition or a withdrawal waits
        additions = {r: [d for d in ds if d.id not in self._listed(r)] for r, ds in target.items()}
        if self.leaving:
            await self._confirm(wait and (bool(shrinking) or bool(self._blocked(additions))))
        # 3. resources gone for good: stopped once the kubelet dropped their devices
        for resource in [r for r in self.servers if r not in target and r not in self.leaving]:
            await self.servers.pop(resource).stop()
        # 4. the rest, less what could still put a GPU under two resources at the kubelet, and (CDI)
        # less what the spec on disk does not name
        self._write_cdi()
        blocked_ids = self._blocked(additions)
        refused: set[str] = set()  # no valid CDI name: never listed, nor waited for
        if self.cdi is not None:
            for r, ds in additions.items():
                unnamed = [d.id for d in ds if device_name(d) not in self.cdi.names and d.id not in blocked_ids.get(r, [])]
                refused |= {d.id for d in ds if not valid_name(device_name(d))}
                if unnamed:
                    blocked_ids[r] = [*blocked_ids.get(r, []), *unnamed]
        before, self.pending = self.pending, {r: kept for r, ids in blocked_ids.items()
                                              if (kept := [i for i in ids if i not in refused])}
        if self.pending and self.pending != before:  # (the watch looks again every poll_s: said once)
            leaving = "; ".join(f"{r} {', '.join(sorted(ids))}" for r, ids in sorted(self.leaving.items()))
            why = [f"the kubelet drops {leaving}"] if self.leaving else []
            if self.cdi is not None and self.cdi.problem:
                why.append(f"the CDI spec names them ({self.cdi.problem})")
            log.info("device plugin: holding back %s until %s",
                     "; ".join(f"{r} {', '.join(ids)}" for r, ids in sorted(self.pending.items())), " and ".join(why))
        for resource, devices in target.items():
            held_back = set(blocked_ids.get(resource, ()))
            devices = [d for d in devices if d.id not in held_back]
            server = self.servers.get(resource)
            if server is None:
                if not devices and held_back:
                    continue  # nothing to serve yet
                server = PluginServer(resource, self.plugin_dir, devices, preferred=self.preferred, allocate=self.allocate,
                                      withdrawn=self.withdrawn, sealed=self.sealed, allocated=self.allocated,
                                      serve=self.serve)
                self.servers[resource] = server
                await server.start()
                self._unregistered.append((server, server.registrations))  # registered by the caller, lock released
            else:
                await server.set_devices(devices)

    def _write_cdi(self) -> None:
        """Write the CDI spec of every device Allocate may serve or is about to: those wanted
        (withdrawn included: served until sealed) and those a server still knows."""
        if self.cdi is None or not self._updated:
            return
        devices = [d for ds in self._wanted.values() for d in ds]
        devices += [d for s in self.servers.values() for d in s.known()]
        self.cdi.write(devices)

    def _listed(self, resource: str) -> set[str]:
        server = self.servers.get(resource)
        return {d.id for d in server.devices} if server is not None else set()

    def _blocked(self, additions: Mapping[str, list[PluginDevice]]) -> dict[str, list[str]]:
        """Resource -> ids to add whose GPU has a device leaving another resource's list."""
        out: dict[str, list[str]] = {}
        for resource, devices in additions.items():
            busy = {g for r, ids in self.leaving.items() if r != resource for g in ids.values()}
            ids = [d.id for d in devices if d.gpu_uuid in busy]
            if ids:
                out[resource] = ids
        return out

    async def _confirm(self, wait: bool) -> None:
        """Forget the leaving devices the kubelet no longer holds; with `wait`, look again (5 ms,
        doubling to 100 ms) until none is left or `confirm_timeout_s` passed."""
        if self.held is None:  # nothing to ask: a list written to its stream counts as read
            self.leaving.clear()
            return
        deadline = time.monotonic() + self.confirm_timeout_s
        delay = 0.005
        while self.leaving:
            try:
                held = {r: set(ids) for r, ids in (await self.held()).items()}
            except Exception as e:  # unknown: nothing confirmed
                log.debug("device plugin: what the kubelet holds cannot be read: %s", e)
                held = None
            if held is not None:
                for r in list(self.leaving):
                    self.leaving[r] = {i: g for i, g in self.leaving[r].items() if i in held.get(r, set())}
                    if not self.leaving[r]:
                        del self.leaving[r]
            if not self.leaving or not wait or time.monotonic() >= deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        if self.leaving and wait:
            log.warning("device plugin: the kubelet still holds %s %.1f s after they left the lists",
                        "; ".join(f"{r} {', '.join(sorted(ids))}" for r, ids in sorted(self.leaving.items())),
                        self.confirm_timeout_s)

    async def _register_new(self) -> None:
        """Register the servers `_apply` started, outside the lock (as `check` does, same reasons:
        a kubelet that accepts the connection and hangs would hold up withdraw/update for
        register_timeout_s per resource). One an update stopped meanwhile is skipped; one the watch
        found unregistered first is left to it (`_registering`, `seen`); one left out here (a
        caller cancelled) is registered by the watch's next look."""
        servers, self._unregistered = self._unregistered, []
        for server, seen in servers:
            if self.servers.get(server.resource) is server and server.running:
                await self._register(server, seen)

    async def _register(self, server: PluginServer, seen: int) -> None:
        """Register `server`, unless a Register of it is under way or one succeeded since the
        caller saw it unregistered (its count was `seen`): a second Register of the same plugin
        makes the kubelet drop the first one's stream (kubernetes#121994), and a list written
        meanwhile may never reach it."""
        import grpc.aio

        if (not self.serve or not os.path.exists(self.kubelet_socket) or server.resource in self._registering
                or server.registrations != seen):
            return
        self._registering.add(server.resource)
        try:
            await server.register(self.kubelet_socket, self.register_timeout_s)
        except grpc.aio.AioRpcError as e:
            level = logging.DEBUG if server.resource in self._failing else logging.WARNING
            log.log(level, "device plugin for %s: Register at %s failed: %s: %s (retrying)", server.resource,
                    self.kubelet_socket, e.code().name, e.details())
            self._failing.add(server.resource)
            return
        finally:
            self._registering.discard(server.resource)
        self._failing.discard(server.resource)
        self.registrations.append((server.resource, time.monotonic()))
        if self.on_registered is not None:
            self.on_registered(server.resource)

    async def check(self) -> None:
        """One look at the plugin dir: restart and re-register what the kubelet lost. Devices held
        back (`pending`) are added as soon as the kubelet caught up."""
        if self.leaving or self.pending:
            async with self._lock:
                await self._apply(wait=False)
            await self._register_new()
        stamp = file_stamp(self.kubelet_socket) if self.serve else None
        if stamp is None:
            return
        unregistered: list[tuple[PluginServer, int]] = []
        async with self._lock:
            for server in list(self.servers.values()):
                lost = not server.socket_exists()
                if not lost and server.registered_stamp == stamp:
                    if server.running and server.dropped_by_kubelet():
                        # the same kubelet has no stream open with us: it disconnected this resource
                        # (kubernetes#121994: a plugin that registered again can be disconnected when
                        # its old stream's end is handled after the new Register), whose devices then
                        # count unhealthy: registered again, once a second at most (a kubelet that
                        # died leaving its socket refuses every try until it is back)
                        if not server.drop_said:
                            log.warning("device plugin for %s: the kubelet %s; registering again", server.resource,
                                        "closed its ListAndWatch stream" if server.stream_closed_by_kubelet
                                        else "opened no ListAndWatch stream after the Register")
                            server.drop_said = True
                        server.registered_at = time.monotonic()
                        unregistered.append((server, server.registrations))
                    continue
                if lost or server.registered_stamp is not None:  # kubelet restarted: fresh server, fresh streams
                    log.info("device plugin for %s: %s; serving again", server.resource,
                             "its socket is gone" if lost else "kubelet.sock was re-created")
                    await server.restart()
                unregistered.append((server, server.registrations))
        # Register outside the lock: a kubelet that accepts the connection and hangs would hold up
        # the pass's withdraw/update (register_timeout_s per resource). A server an update stopped
        # meanwhile is skipped; one stopped during its Register has the kubelet dial a socket that
        # is gone, or the same resource's new server (registered by that update): harmless.
        for server, seen in unregistered:
            if self.servers.get(server.resource) is server and server.running:
                await self._register(server, seen)

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching: the next look may succeed
                log.exception("device plugin watch")
            await asyncio.sleep(self.poll_s)
