"""DevicePluginManager over a long life: its records of Allocate calls and registrations stay
bounded, and a kubelet that hangs in Register does not hold up the pass's withdraw and update."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from typing import Any

import grpc.aio
import pytest

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import GpuView, MigDeviceView, advertise
from dynpart.agent.deviceplugin.server import REGISTRATIONS_KEPT, DevicePluginManager

GPU = GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True,
              mig=(MigDeviceView("1g.10gb", "MIG-a"), MigDeviceView("1g.10gb", "MIG-b"),
                   MigDeviceView("3g.40gb", "MIG-c")))


@pytest.fixture
def plugin_dir():
    d = tempfile.mkdtemp(prefix="dp-", dir="/tmp")  # a unix socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_allocate_records_go_with_their_devices():
    plugins = DevicePluginManager("/nonexistent/device-plugins", serve=False)
    async with plugins:
        await plugins.update(advertise([GPU]))
        now = time.monotonic()
        for i in ("MIG-a", "MIG-b", "MIG-c"):
            plugins.allocated[i] = now  # what Allocate records
        # destroyed after a withdrawal: forgotten at once (a re-made device of the same id must not
        # look just taken)
        await plugins.withdraw("MIG-b")
        plugins.seal("MIG-b")
        await plugins.forget("MIG-b")
        assert plugins.last_allocated("MIG-b") is None and set(plugins.allocated) == {"MIG-a", "MIG-c"}
        # gone from the driver's lists (destroyed by another way): dropped at the next update
        await plugins.update(advertise([GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True,
                                                mig=(MigDeviceView("1g.10gb", "MIG-a"),))]))
        assert set(plugins.allocated) == {"MIG-a"}
        # the servers record into the same dict
        assert all(s.allocated is plugins.allocated for s in plugins.servers.values())


async def test_registrations_are_bounded(plugin_dir, monkeypatch):
    plugins = DevicePluginManager(plugin_dir)
    await plugins.update(advertise([GPU]))  # no kubelet.sock: served, not registered
    open(plugins.kubelet_socket, "w").close()
    server = next(iter(plugins.servers.values()))

    async def register(kubelet_socket: str, timeout_s: float = 5.0) -> None:
        return None
    monkeypatch.setattr(server, "register", register)
    for _ in range(REGISTRATIONS_KEPT + 10):
        await plugins._register(server, server.registrations)
    assert len(plugins.registrations) == REGISTRATIONS_KEPT
    assert all(r == server.resource for r, _ in plugins.registrations)
    await plugins.close()


async def hanging_kubelet(plugin_dir: str) -> tuple[DevicePluginManager, grpc.aio.Server, asyncio.Event, list[str]]:
    """A plugin serving GPU (not registered yet) and a kubelet that accepts Register and never
    answers it (`entered` set when it is called; the resources asked for, in order)."""
    plugins = DevicePluginManager(plugin_dir, register_timeout_s=1.5)
    await plugins.update(advertise([GPU]))  # before the kubelet: served, not registered
    entered = asyncio.Event()
    asked: list[str] = []

    async def hang(request: Any, context: Any) -> Any:
        asked.append(request.resource_name)
        entered.set()
        await asyncio.sleep(10)
        return protocol.messages()["Empty"]()
    kubelet = grpc.aio.server()
    kubelet.add_generic_rpc_handlers((protocol.registration_handler(hang),))
    kubelet.add_insecure_port(f"unix://{plugins.kubelet_socket}")
    await kubelet.start()
    return plugins, kubelet, entered, asked


async def test_a_kubelet_hanging_in_register_does_not_hold_up_a_withdrawal(plugin_dir):
    """check() registers outside the manager's lock: the pass's withdraw and update do not wait
    for a Register the kubelet accepted and does not answer."""
    plugins, kubelet, entered, _ = await hanging_kubelet(plugin_dir)
    try:
        checking = asyncio.create_task(plugins.check())  # what the watch does every poll_s
        await asyncio.wait_for(entered.wait(), 5)
        started = time.monotonic()
        await plugins.withdraw("MIG-a")
        await plugins.update(advertise([GPU]))
        took = time.monotonic() - started
        assert took < 1.0, took
        assert [d.id for d in plugins.advertised()["nvidia.com/mig-1g.10gb"]] == ["MIG-b"]
        await checking  # the Register times out (register_timeout_s): retried at the next look
        assert not plugins.registrations
    finally:
        await kubelet.stop(0)
        await plugins.close()


async def test_a_kubelet_hanging_in_register_of_a_new_resource_does_not_hold_up_a_withdrawal(plugin_dir):
    """An update that adds a resource registers its new server outside the lock too: a withdrawal
    made meanwhile does not wait for a Register the kubelet accepted and does not answer."""
    plugins, kubelet, entered, asked = await hanging_kubelet(plugin_dir)
    try:
        more = GpuView(index=0, uuid="GPU-0", memory_gb=80, mig_enabled=True,
                       mig=(*GPU.mig, MigDeviceView("2g.20gb", "MIG-d")))
        adding = asyncio.create_task(plugins.update(advertise([more])))  # a new resource: its Register hangs
        await asyncio.wait_for(entered.wait(), 5)
        started = time.monotonic()
        await plugins.withdraw("MIG-a")
        took = time.monotonic() - started
        assert took < 1.0, took
        assert [d.id for d in plugins.advertised()["nvidia.com/mig-1g.10gb"]] == ["MIG-b"]
        # the watch's look meanwhile (here: for that resource alone) makes no second Register
        # beside the one under way
        server = plugins.servers["nvidia.com/mig-2g.20gb"]
        await plugins._register(server, server.registrations)
        assert asked == ["nvidia.com/mig-2g.20gb"], asked
        await adding  # its Register times out: retried at the watch's next look
        assert "nvidia.com/mig-2g.20gb" in plugins.servers and not plugins.registrations
    finally:
        await kubelet.stop(0)
        await plugins.close()
