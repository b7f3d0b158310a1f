"""A model of NVIDIA's k8s-device-plugin (MIG strategy `mixed`) on one simulated node, speaking the
device-plugin API v1beta1 on real unix sockets (tests/e2e/kubelet_model.py is its kubelet):

- at its start it enumerates the node's FakeNvml once: each MIG device (a GPU instance with its
  compute instance) as `nvidia.com/mig-<profile>` (`+` written `.`), device id = the MIG UUID; a
  GPU with MIG mode off as `nvidia.com/gpu` (its UUID); a MIG-enabled GPU without MIG devices
  gives nothing. It serves one socket per resource (`nvidia-<resource suffix>.sock`), registers
  each with `GetPreferredAllocationAvailable`, and sends each list once: it never reads the GPUs
  again (facts file section 3), so an instance created later is not advertised and a destroyed
  one stays advertised (a pod given it fails to start: the kubelet model records it).
- `Allocate` answers `NVIDIA_VISIBLE_DEVICES=<ids>` (the default `envvar` strategy) for any id it
  enumerated, and refuses others. `GetPreferredAllocation`: the ids that must be included, then
  the available ones in enumeration order.
- its pod: with an API server, a pod `nvidia-device-plugin-daemonset-<x>` in `gpu-operator`,
  labelled `app=nvidia-device-plugin-daemonset`, bound to the node (the kubelet model runs it).
  Deleting it (what dynpart's agent does after a MIG change, as nos does) stops the plugin at
  once (its sockets removed, the kubelet's streams end); the model then plays the DaemonSet
  controller: once the old pod is gone, a new one is created, and after `restart_delay_s` (the
  new container's start, NVML initialisation) the plugin enumerates again and registers.
- when kubelet.sock is re-created (a kubelet restart) the plugin restarts itself and enumerates
  again, as the real one does on its fsnotify event (after `kubelet_restart_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.server import file_stamp
from dynpart.agent.driver.fake import FakeNvml
from dynpart.kube.watching import Informer
from dynpart.resources import WHOLE_GPU, mig_resource_name
from dynpart.settings import KubeSettings

NAMESPACE = "gpu-operator"
APP_LABEL = "app"
APP = "nvidia-device-plugin-daemonset"
WATCH = KubeSettings(backoff_initial_s=0.2, backoff_max_s=0.2)


def enumerate_devices(driver: FakeNvml) -> dict[str, list[tuple[str, int]]]:
    """resource -> [(device id, GPU index)], as the plugin's resource managers build them at start."""
    by_id = {p.gi_profile_id: p for p in driver.model.mig_profiles}
    out: dict[str, list[tuple[str, int]]] = {}
    for d in driver.devices():
        if not d.mig_current:
            out.setdefault(WHOLE_GPU, []).append((d.uuid, d.index))
            continue
        for gi in driver.gpu_instances(d.index):
            profile = by_id.get(gi.profile_id)
            if profile is not None and gi.compute_instances and gi.uuid:
                out.setdefault(mig_resource_name(profile.name), []).append((gi.uuid, d.index))
    return out


class _ResourcePlugin:
    """The DevicePlugin service of one resource (NvidiaDevicePlugin)."""

    def __init__(self, resource: str, plugin_dir: str, devices: list[tuple[str, int]]):
        self.resource = resource
        self.ids = [i for i, _ in devices]
        self.endpoint = "nvidia-" + resource.split("/", 1)[1] + ".sock"
        self.socket = os.path.join(plugin_dir, self.endpoint)
        self.plugin_dir = plugin_dir
        self._server: Any = None
        self._stop = asyncio.Event()
        self.allocations: list[tuple[float, list[str]]] = []

    def options(self) -> Any:
        return protocol.messages()["DevicePluginOptions"](get_preferred_allocation_available=True)

    async def serve(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((protocol.device_plugin_handler(self),))
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def register(self) -> None:
        msgs = protocol.messages()
        request = msgs["RegisterRequest"](version=protocol.VERSION, endpoint=self.endpoint, resource_name=self.resource,
                                          options=self.options())
        async with grpc.aio.insecure_channel(f"unix://{os.path.join(self.plugin_dir, protocol.KUBELET_SOCKET_NAME)}") as ch:
            await protocol.RegistrationStub(ch).Register(request, timeout=5)

    async def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options()

    async def ListAndWatch(self, request: Any, context: Any) -> Any:
        msgs = protocol.messages()
        yield msgs["ListAndWatchResponse"](devices=[msgs["Device"](ID=i, health=protocol.HEALTHY) for i in self.ids])
        await self._stop.wait()  # health events are not modelled: nothing more is sent

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        msgs = protocol.messages()
        out = []
        for r in request.container_requests:
            chosen = list(dict.fromkeys(r.must_include_deviceIDs))
            available = set(r.available_deviceIDs)
            for i in self.ids:
                if len(chosen) >= r.allocation_size:
                    break
                if i in available and i not in chosen:
                    chosen.append(i)
            out.append(msgs["ContainerPreferredAllocationResponse"](deviceIDs=chosen))
        return msgs["PreferredAllocationResponse"](container_responses=out)

    async def Allocate(self, request: Any, context: Any) -> Any:
        msgs = protocol.messages()
        out = []
        for r in request.container_requests:
            unknown = [i for i in r.devices_ids if i not in self.ids]
            if unknown:
                await context.abort(grpc.StatusCode.UNKNOWN,
                                    f"invalid allocation request for '{self.resource}': unknown device: {unknown[0]}")
            self.allocations.append((time.monotonic(), list(r.devices_ids)))
            out.append(msgs["ContainerAllocateResponse"](envs={"NVIDIA_VISIBLE_DEVICES": ",".join(r.devices_ids)}))
        return msgs["AllocateResponse"](container_responses=out)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return protocol.messages()["PreStartContainerResponse"]()


@dataclass
class Enumeration:
    at: float
    devices: dict[str, list[str]]  # resource -> ids
    why: str  # "start", "pod deleted", "kubelet restart"


@dataclass
class NvidiaPluginModel:
    node_name: str
    plugin_dir: str
    driver: FakeNvml
    core: client.CoreV1Api | None = None
    restart_delay_s: float = 1.5
    kubelet_restart_s: float = 0.3
    poll_s: float = 0.1
    enumerations: list[Enumeration] = field(default_factory=list)
    registrations: list[tuple[str, float]] = field(default_factory=list)
    pod_deletions: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.plugins: dict[str, _ResourcePlugin] = {}
        self.pod_uid: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._kubelet_stamp: tuple[int, int] | None = None
        self._lock = asyncio.Lock()
        self._pod_gone = asyncio.Event()
        self._recreating = False

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.plugin_dir, protocol.KUBELET_SOCKET_NAME)

    def advertised(self) -> dict[str, list[str]]:
        return {r: list(p.ids) for r, p in self.plugins.items()}

    async def start(self) -> None:
        if self.core is not None:
            await self._ensure_namespace()
            await self._create_pod()
            informer = Informer(lambda **kw: self.core.list_namespaced_pod(NAMESPACE, **kw),  # type: ignore[union-attr]
                                self._on_pod, name=f"nvidia plugin pods of {self.node_name}",
                                label_selector=f"{APP_LABEL}={APP}", field_selector=f"spec.nodeName={self.node_name}",
                                settings=WATCH)
            self._spawn(informer.run())
            await informer.synced.wait()
        await self.run_plugins("start")
        self._spawn(self._watch_kubelet())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_plugins()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(f"nvidia plugin model {self.node_name}: {task.exception()!r}")

    # --- the plugin process ---------------------------------------------------------------------

    async def run_plugins(self, why: str) -> None:
        async with self._lock:
            await self._stop_plugins()
            devices = enumerate_devices(self.driver)
            self.enumerations.append(Enumeration(time.monotonic(), {r: [i for i, _ in ds] for r, ds in devices.items()}, why))
            for resource, ds in sorted(devices.items()):
                plugin = _ResourcePlugin(resource, self.plugin_dir, ds)
                await plugin.serve()
                self.plugins[resource] = plugin
            self._kubelet_stamp = file_stamp(self.kubelet_socket)
            for plugin in self.plugins.values():
                try:
                    await plugin.register()
                except grpc.aio.AioRpcError as e:  # the real plugin exits and is restarted; here: retried below
                    self.errors.append(f"register {plugin.resource}: {e.code().name}")
                    self._kubelet_stamp = None
                    continue
                self.registrations.append((plugin.resource, time.monotonic()))

    async def stop_plugins(self) -> None:
        async with self._lock:
            await self._stop_plugins()

    async def _stop_plugins(self) -> None:
        for plugin in self.plugins.values():
            await plugin.stop()
        self.plugins.clear()

    async def _watch_kubelet(self) -> None:
        """fsnotify on the plugin dir: kubelet.sock created again -> restart (and enumerate again)."""
        while True:
            await asyncio.sleep(self.poll_s)
            stamp = file_stamp(self.kubelet_socket)
            if stamp is None or stamp == self._kubelet_stamp or self._recreating or self.pod_uid is None and self.core:
                continue
            await asyncio.sleep(self.kubelet_restart_s)
            await self.run_plugins("kubelet restart")

    # --- its pod and the DaemonSet --------------------------------------------------------------

    async def _ensure_namespace(self) -> None:
        assert self.core is not None
        try:
            await self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        except ApiException as e:
            if e.status != 409:
                raise

    async def _create_pod(self) -> None:
        assert self.core is not None
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "generateName": f"{APP}-", "namespace": NAMESPACE, "labels": {APP_LABEL: APP}},
            "spec": {"nodeName": self.node_name, "terminationGracePeriodSeconds": 30,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "nvidia-device-plugin-ctr",
                                     "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"}]}}
        pod = await self.core.create_namespaced_pod(NAMESPACE, body)
        self.pod_uid = pod.metadata.uid
        self._pod_gone.clear()

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        md = pod["metadata"]
        if md.get("uid") != self.pod_uid:
            return
        if kind == "DELETED":
            self._pod_gone.set()
        if (kind == "DELETED" or md.get("deletionTimestamp")) and not self._recreating:
            self._recreating = True
            self.pod_deletions.append(time.monotonic())
            self._spawn(self._recreate())

    async def _recreate(self) -> None:
        try:
            await self.stop_plugins()  # its container is killed: sockets gone, the kubelet's streams end
            await self._pod_gone.wait()
            await self._create_pod()  # the DaemonSet controller
            await asyncio.sleep(self.restart_delay_s)
            await self.run_plugins("pod deleted")
        finally:
            self._recreating = False

