"""The kubelet device-plugin API v1beta1 (`k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto`):
its messages, built at run time from a descriptor (as `agent/podresources.py` does: no generated
code to keep in step with a protobuf version), its method paths, and thin client stubs over
`grpc.aio` channels (the agent registers with them; tests/agent/kubelet_double.py plays the kubelet
with them).

Field numbers and names follow api.proto; fields dynpart does not declare are kept as unknown
fields on decode, so a newer kubelet's extra fields do no harm.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

VERSION = "v1beta1"
KUBELET_SOCKET_NAME = "kubelet.sock"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

REGISTRATION_SERVICE = "v1beta1.Registration"
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"
REGISTER = f"/{REGISTRATION_SERVICE}/Register"
GET_OPTIONS = f"/{DEVICE_PLUGIN_SERVICE}/GetDevicePluginOptions"
LIST_AND_WATCH = f"/{DEVICE_PLUGIN_SERVICE}/ListAndWatch"
GET_PREFERRED_ALLOCATION = f"/{DEVICE_PLUGIN_SERVICE}/GetPreferredAllocation"
ALLOCATE = f"/{DEVICE_PLUGIN_SERVICE}/Allocate"
PRE_START_CONTAINER = f"/{DEVICE_PLUGIN_SERVICE}/PreStartContainer"

# method name -> (request message, response message, server streaming)
DEVICE_PLUGIN_METHODS = {
    "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
    "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
    "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
    "Allocate": ("AllocateRequest", "AllocateResponse", False),
    "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
}


@lru_cache(maxsize=1)
def messages() -> dict[str, Any]:
    """The message classes by short name (Empty, RegisterRequest, DevicePluginOptions, Device, ...)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="dynpart/deviceplugin/v1beta1/api.proto", package="v1beta1",
                                             syntax="proto3")
    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    S, B, I32, I64, M = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_MESSAGE

    def message(name: str, *fields: tuple[str, int, int, int, str], maps: tuple[tuple[str, int], ...] = ()) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        for fname, number in maps:  # map<string, string>: a repeated nested *Entry message
            entry = "".join(p.capitalize() for p in fname.split("_")) + "Entry"
            e = m.nested_type.add(name=entry)
            e.options.map_entry = True
            e.field.add(name="key", number=1, type=S, label=opt)
            e.field.add(name="value", number=2, type=S, label=opt)
            m.field.add(name=fname, number=number, type=M, label=rep, type_name=f".v1beta1.{name}.{entry}")

    message("Empty")
    message("DevicePluginOptions", ("pre_start_required", 1, B, opt, ""),
            ("get_preferred_allocation_available", 2, B, opt, ""))
    message("RegisterRequest", ("version", 1, S, opt, ""), ("endpoint", 2, S, opt, ""),
            ("resource_name", 3, S, opt, ""), ("options", 4, M, opt, ".v1beta1.DevicePluginOptions"))
    message("NUMANode", ("ID", 1, I64, opt, ""))
    message("TopologyInfo", ("nodes", 1, M, rep, ".v1beta1.NUMANode"))
    message("Device", ("ID", 1, S, opt, ""), ("health", 2, S, opt, ""), ("topology", 3, M, opt, ".v1beta1.TopologyInfo"))
    message("ListAndWatchResponse", ("devices", 1, M, rep, ".v1beta1.Device"))
    message("ContainerPreferredAllocationRequest", ("available_deviceIDs", 1, S, rep, ""),
            ("must_include_deviceIDs", 2, S, rep, ""), ("allocation_size", 3, I32, opt, ""))
    message("PreferredAllocationRequest", ("container_requests", 1, M, rep, ".v1beta1.ContainerPreferredAllocationRequest"))
    message("ContainerPreferredAllocationResponse", ("deviceIDs", 1, S, rep, ""))
    message("PreferredAllocationResponse",
            ("container_responses", 1, M, rep, ".v1beta1.ContainerPreferredAllocationResponse"))
    message("ContainerAllocateRequest", ("devices_ids", 1, S, rep, ""))
    message("AllocateRequest", ("container_requests", 1, M, rep, ".v1beta1.ContainerAllocateRequest"))
    message("Mount", ("container_path", 1, S, opt, ""), ("host_path", 2, S, opt, ""), ("read_only", 3, B, opt, ""))
    message("DeviceSpec", ("container_path", 1, S, opt, ""), ("host_path", 2, S, opt, ""), ("permissions", 3, S, opt, ""))
    message("CDIDevice", ("name", 1, S, opt, ""))
    message("ContainerAllocateResponse", ("mounts", 2, M, rep, ".v1beta1.Mount"), ("devices", 3, M, rep, ".v1beta1.DeviceSpec"),
            ("cdi_devices", 5, M, rep, ".v1beta1.CDIDevice"), maps=(("envs", 1), ("annotations", 4)))
    message("AllocateResponse", ("container_responses", 1, M, rep, ".v1beta1.ContainerAllocateResponse"))
    message("PreStartContainerRequest", ("devices_ids", 1, S, rep, ""))
    message("PreStartContainerResponse")

    pool = descriptor_pool.DescriptorPool()  # private: no clash with another registration of v1beta1.*
    classes = message_factory.GetMessages([fdp], pool=pool)
    return {full.split(".", 1)[1]: cls for full, cls in classes.items() if full.count(".") == 1}


def _serialize(m: Any) -> bytes:
    return bytes(m.SerializeToString())


def device_plugin_handler(impl: Any) -> Any:
    """A grpc generic handler for the DevicePlugin service; `impl` has one coroutine (or, for
    ListAndWatch, async generator) per method, named as in DEVICE_PLUGIN_METHODS."""
    import grpc

    msgs = messages()
    handlers = {}
    for method, (req, _resp, streaming) in DEVICE_PLUGIN_METHODS.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[method] = make(getattr(impl, method), request_deserializer=msgs[req].FromString,
                                response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(DEVICE_PLUGIN_SERVICE, handlers)


def registration_handler(register: Any) -> Any:
    """A grpc generic handler for the kubelet's Registration service (`register(request, context)`)."""
    import grpc

    return grpc.method_handlers_generic_handler(REGISTRATION_SERVICE, {
        "Register": grpc.unary_unary_rpc_method_handler(register, request_deserializer=messages()["RegisterRequest"].FromString,
                                                        response_serializer=_serialize)})


class RegistrationStub:
    """Client of the kubelet's Registration service on a grpc.aio channel."""

    def __init__(self, channel: Any):
        self.Register = channel.unary_unary(REGISTER, request_serializer=_serialize,
                                            response_deserializer=messages()["Empty"].FromString)


class DevicePluginStub:
    """Client of a plugin's DevicePlugin service on a grpc.aio channel (what the kubelet calls)."""

    def __init__(self, channel: Any):
        msgs = messages()
        for method, (_req, resp, streaming) in DEVICE_PLUGIN_METHODS.items():
            make = channel.unary_stream if streaming else channel.unary_unary
            setattr(self, method, make(f"/{DEVICE_PLUGIN_SERVICE}/{method}", request_serializer=_serialize,
                                       response_deserializer=msgs[resp].FromString))
