"""PodResources: the fake, device-id helpers, and the real gRPC client against a local server."""

from __future__ import annotations

import pytest

from dynpart.agent.podresources import (
    LIST_METHOD,
    AssignedDevice,
    FakePodResources,
    KubeletPodResources,
    PodResourcesError,
    base_device_id,
    messages,
    pods_by_device,
)


async def test_fake_and_helpers():
    pods = FakePodResources()
    pods.assign("ns/a", "nvidia.com/gpu-10gb", "GPU-1::0", "GPU-1::1")
    pods.assign("ns/b", "nvidia.com/mig-1g.10gb", "MIG-2")
    assert base_device_id("GPU-1::3") == "GPU-1" and base_device_id("MIG-2") == "MIG-2"
    assert pods_by_device(await pods.list()) == {"GPU-1": ["ns/a"], "MIG-2": ["ns/b"]}
    pods.release("ns/a")
    assert await pods.list() == [AssignedDevice("ns/b", "main", "nvidia.com/mig-1g.10gb", "MIG-2")]
    assert pods.calls == 2


def test_messages_decode_newer_kubelets():
    """Fields dynpart does not declare (topology, cpu_ids, memory, ...) are skipped."""
    m = messages()
    devices = m["ContainerDevices"](resource_name="nvidia.com/mig-3g.40gb", device_ids=["MIG-a"])
    wire = m["ListPodResourcesResponse"](pod_resources=[m["PodResources"](
        name="p", namespace="ns", containers=[m["ContainerResources"](name="c", devices=[devices])])]).SerializeToString()
    # a field this descriptor does not know (number 9, varint), as a newer kubelet may send
    decoded = m["ListPodResourcesResponse"].FromString(wire + b"\x48\x01")
    assert decoded.pod_resources[0].containers[0].devices[0].device_ids == ["MIG-a"]


async def test_real_client_over_a_unix_socket(tmp_path):
    pytest.importorskip("grpc")
    import grpc.aio

    m = messages()
    response = m["ListPodResourcesResponse"](pod_resources=[
        m["PodResources"](name="train", namespace="ml", containers=[
            m["ContainerResources"](name="main", devices=[
                m["ContainerDevices"](resource_name="nvidia.com/mig-1g.10gb", device_ids=["MIG-x", "MIG-y"]),
                m["ContainerDevices"](resource_name="example.com/other", device_ids=["o1"]),
            ])]),
    ])

    async def list_handler(request, context):
        return response

    server = grpc.aio.server()
    service, method = LIST_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
        method: grpc.unary_unary_rpc_method_handler(
            list_handler, request_deserializer=m["ListPodResourcesRequest"].FromString,
            response_serializer=lambda r: r.SerializeToString()),
    }),))
    socket = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    try:
        got = await KubeletPodResources(str(socket)).list()
    finally:
        await server.stop(None)
    assert got == [
        AssignedDevice("ml/train", "main", "nvidia.com/mig-1g.10gb", "MIG-x"),
        AssignedDevice("ml/train", "main", "nvidia.com/mig-1g.10gb", "MIG-y"),
        AssignedDevice("ml/train", "main", "example.com/other", "o1"),
    ]


async def test_real_client_reports_a_missing_socket(tmp_path):
    pytest.importorskip("grpc")
    with pytest.raises(PodResourcesError, match="kubelet PodResources API at .*UNAVAILABLE"):
        await KubeletPodResources(str(tmp_path / "none.sock"), timeout_s=1).list()


async def test_without_grpcio(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_grpc(name, *args, **kwargs):
        if name == "grpc" or name.startswith("grpc."):
            raise ImportError("No module named 'grpc'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_grpc)
    with pytest.raises(PodResourcesError, match="grpcio package is needed"):
        await KubeletPodResources("/nonexistent").list()
