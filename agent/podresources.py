"""Which devices the kubelet has assigned to pods, and which it holds: the kubelet PodResources API
(`List`, `GetAllocatableResources`).

`KubeletPodResources` calls `/v1.PodResourcesLister/List` and `.../GetAllocatableResources` over
gRPC on the kubelet's unix socket
(grpcio, imported lazily). The protobuf messages are built at run time from a descriptor
(the fields dynpart reads of `k8s.io/kubelet/pkg/apis/podresources/v1/api.proto`; newer fields
are skipped as unknown), so there is no generated code to keep in step with a protobuf version.
`FakePodResources` is the in-memory double the tests use.

Device ids are what the device plugin advertises: a MIG device's UUID (`MIG-...`) for
`nvidia.com/mig-*` (deviceIDStrategy uuid, the default), a GPU UUID for `nvidia.com/gpu`, and
`<GPU UUID>::<replica>` for shared (MPS) replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from dynpart.errors import DynpartError

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
ALLOCATABLE_METHOD = "/v1.PodResourcesLister/GetAllocatableResources"


class PodResourcesError(DynpartError):
    """The kubelet PodResources API could not be read."""


DeviceIds = list[str]  # (named: `list` is a method of the classes below)


@dataclass(frozen=True)
class AssignedDevice:
    pod: str  # namespace/name
    container: str
    resource: str  # e.g. nvidia.com/mig-1g.10gb
    device_id: str


class PodResources(Protocol):
    async def list(self) -> list[AssignedDevice]: ...

    async def allocatable(self) -> dict[str, DeviceIds]:
        """Resource name -> the device ids the kubelet's device manager holds for it (recent
        kubelets list the healthy ones only, older ones every device a plugin sent)."""
        ...


def base_device_id(device_id: str) -> str:
    """A replica id `<uuid>::<n>` (shared GPUs) without its replica suffix."""
    return device_id.split("::", 1)[0]


def pods_by_device(assigned: list[AssignedDevice]) -> dict[str, list[str]]:
    """Device id (replica suffix dropped) -> the pods holding it."""
    out: dict[str, list[str]] = {}
    for a in assigned:
        pods = out.setdefault(base_device_id(a.device_id), [])
        if a.pod not in pods:
            pods.append(a.pod)
    return out


class FakePodResources:
    """Assignments set by the test. `on_list(n)` is called before the n-th `list()` answers
    (1-based), so a test can change the assignments between two reads of the agent."""

    def __init__(self) -> None:
        self._assigned: list[AssignedDevice] = []
        self.calls = 0
        self.on_list: Callable[[int], None] | None = None
        # what GetAllocatableResources answers: set by the test (or `on_allocatable`, asked each call)
        self.devices: dict[str, DeviceIds] = {}
        self.on_allocatable: Callable[[], dict[str, DeviceIds]] | None = None

    def assign(self, pod: str, resource: str, *device_ids: str, container: str = "main") -> None:
        self._assigned.extend(AssignedDevice(pod, container, resource, d) for d in device_ids)

    def release(self, pod: str) -> None:
        self._assigned = [a for a in self._assigned if a.pod != pod]

    async def list(self) -> list[AssignedDevice]:
        self.calls += 1
        if self.on_list is not None:
            self.on_list(self.calls)
        return list(self._assigned)

    def set_allocatable(self, resource: str, *device_ids: str) -> None:
        self.devices[resource] = list(device_ids)

    async def allocatable(self) -> dict[str, DeviceIds]:
        if self.on_allocatable is not None:
            return {r: list(ids) for r, ids in self.on_allocatable().items()}
        return {r: list(ids) for r, ids in self.devices.items()}


# --- the real client ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def messages() -> dict[str, Any]:
    """The message classes by short name: ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources, ContainerResources, ContainerDevices, AllocatableResourcesRequest,
    AllocatableResourcesResponse."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="dynpart/podresources/v1/api.proto", package="v1",
                                             syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("ListPodResourcesRequest")
    message("ListPodResourcesResponse", ("pod_resources", 1, F.TYPE_MESSAGE, rep, ".v1.PodResources"))
    message("PodResources", ("name", 1, F.TYPE_STRING, opt, ""), ("namespace", 2, F.TYPE_STRING, opt, ""),
            ("containers", 3, F.TYPE_MESSAGE, rep, ".v1.ContainerResources"))
    message("ContainerResources", ("name", 1, F.TYPE_STRING, opt, ""),
            ("devices", 2, F.TYPE_MESSAGE, rep, ".v1.ContainerDevices"))
    message("ContainerDevices", ("resource_name", 1, F.TYPE_STRING, opt, ""),
            ("device_ids", 2, F.TYPE_STRING, rep, ""))
    message("AllocatableResourcesRequest")
    message("AllocatableResourcesResponse", ("devices", 1, F.TYPE_MESSAGE, rep, ".v1.ContainerDevices"))
    pool = descriptor_pool.DescriptorPool()  # private: no clash with another registration of v1.*
    classes = message_factory.GetMessages([fdp], pool=pool)
    return {full.split(".", 1)[1]: cls for full, cls in classes.items()}


def flatten(response: Any) -> list[AssignedDevice]:
    out = []
    for pod in response.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                for device_id in d.device_ids:
                    out.append(AssignedDevice(f"{pod.namespace}/{pod.name}", c.name, d.resource_name, device_id))
    return out


class KubeletPodResources:
    """PodResources over gRPC on the kubelet socket (the agent mounts /var/lib/kubelet/pod-resources)."""

    def __init__(self, socket: str = POD_RESOURCES_SOCKET, timeout_s: float = 5.0):
        self.socket = socket
        self.timeout_s = timeout_s

    async def list(self) -> list[AssignedDevice]:
        return flatten(await self._call(LIST_METHOD, "ListPodResourcesRequest", "ListPodResourcesResponse"))

    async def allocatable(self) -> dict[str, DeviceIds]:
        response = await self._call(ALLOCATABLE_METHOD, "AllocatableResourcesRequest", "AllocatableResourcesResponse")
        out: dict[str, DeviceIds] = {}
        for d in response.devices:
            out.setdefault(d.resource_name, []).extend(d.device_ids)
        return out

    async def _call(self, method: str, request: str, response: str) -> Any:
        try:
            import grpc
            import grpc.aio
        except ImportError as e:
            raise PodResourcesError(f"the grpcio package is needed to read the kubelet PodResources API ({e})") from None
        msgs = messages()
        request_cls, response_cls = msgs[request], msgs[response]
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
                call = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=response_cls.FromString)
                return await call(request_cls(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PodResourcesError(
                f"kubelet PodResources API at {self.socket} ({method.rsplit('/', 1)[1]}): {e.code().name}: "
                f"{e.details()}") from None
