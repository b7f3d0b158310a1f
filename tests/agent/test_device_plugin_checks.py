"""The agent's own device plugin, one rule at a time, where mutation testing found it unpinned:
what Allocate hands out (never a destroyed device), what GetPreferredAllocation answers (only
available ids, each once), what ListAndWatch lists (health, NUMA node) and when a list counts as
written (every open stream, a closed one not waited for), and serving and registering again.

Most tests read the plugin in-process, as the kubelet's gRPC client would: a ListAndWatch stream is
the handler's generator, a message counts as written once the next one is asked for (as gRPC
resumes the handler once it sent the message); the rest use the kubelet double (real gRPC on unix
sockets, tests/agent/kubelet_double.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import PluginDevice
from dynpart.agent.deviceplugin.server import DevicePluginManager, PluginServer, socket_name
from tests.agent.kubelet_double import KubeletDouble

M = "nvidia.com/mig-1g.10gb"
WHOLE = "nvidia.com/gpu"
S40 = "nvidia.com/gpu-40gb"


def mig(*ids: str, gpu: str = "GPU-0", index: int = 0, **kw: Any) -> list[PluginDevice]:
    return [PluginDevice(i, "mig", gpu, index, **kw) for i in ids]


def whole(uuid: str, index: int, **kw: Any) -> PluginDevice:
    return PluginDevice(uuid, "gpu", uuid, index, gpu_memory_gb=80, **kw)


def slices(uuid: str, index: int, n: int = 2) -> list[PluginDevice]:
    return [PluginDevice(f"{uuid}::{k}", "mps", uuid, index, size_gb=40, gpu_memory_gb=80) for k in range(n)]


class Aborted(Exception):
    def __init__(self, code: Any, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code


class Context:
    """A gRPC servicer context: abort raises, as grpc.aio's does."""

    async def abort(self, code: Any, details: str) -> None:
        raise Aborted(code, details)


async def allocate(plugins: DevicePluginManager, resource: str, *containers: list[str]) -> list[dict[str, str]]:
    """The kubelet's Allocate (one request, these containers): each container's env."""
    msgs = protocol.messages()
    request = msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=ids) for ids in containers])
    response = await plugins.servers[resource].Allocate(request, Context())
    return [dict(c.envs) for c in response.container_responses]


async def preferred(plugins: DevicePluginManager, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
    msgs = protocol.messages()
    request = msgs["PreferredAllocationRequest"](container_requests=[msgs["ContainerPreferredAllocationRequest"](
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])
    response = await plugins.servers[resource].GetPreferredAllocation(request, Context())
    return list(response.container_responses[0].deviceIDs)


class Stream:
    """One ListAndWatch stream read in-process: `next()` asks for the next message (and so lets
    the plugin count the one before as written)."""

    def __init__(self, server: PluginServer):
        self.gen = server.ListAndWatch(protocol.messages()["Empty"](), None)

    async def next_message(self, timeout_s: float = 2.0) -> Any:
        return await asyncio.wait_for(anext(self.gen), timeout_s)

    async def next(self, timeout_s: float = 2.0) -> list[tuple[str, str]]:
        return [(d.ID, d.health) for d in (await self.next_message(timeout_s)).devices]

    async def close(self) -> None:
        await self.gen.aclose()


@pytest.fixture
async def plugins() -> AsyncIterator[DevicePluginManager]:
    """Unserved (no socket, no kubelet), no `held` hook: a list written to its streams counts as read."""
    m = DevicePluginManager("/nonexistent/device-plugins", serve=False)
    yield m
    await m.close()


@pytest.fixture
def plugin_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dp-", dir="/tmp")  # a unix socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --- Allocate -----------------------------------------------------------------------------------


async def test_allocate_refuses_a_destroyed_device_at_once(plugins: DevicePluginManager):
    """Once the agent destroyed a withdrawn device (`forget`, no longer sealed), the kubelet may
    still ask for it (a list read before): the plugin must refuse it, not hand out a dead UUID."""
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    assert await plugins.withdraw("MIG-b") == set()
    plugins.seal("MIG-b")
    await plugins.forget("MIG-b")
    with pytest.raises(Aborted) as e:
        await allocate(plugins, M, ["MIG-b"])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert plugins.last_allocated("MIG-b") is None
    assert await allocate(plugins, M, ["MIG-a"]) == [{"NVIDIA_VISIBLE_DEVICES": "MIG-a"}]
    with pytest.raises(Aborted) as e:  # a container asking for none of this resource: refused, not an empty answer
        await allocate(plugins, M, ["MIG-a"], [])
    assert e.value.code == grpc.StatusCode.NOT_FOUND


# --- GetPreferredAllocation -----------------------------------------------------------------------


async def test_preferred_allocation_names_only_available_ids_each_once(plugins: DevicePluginManager):
    """The kubelet hands a container what the plugin prefers: an id it did not offer (a hint gone
    stale) or one named twice would make it fall back or fail the admission."""
    hints: list[str] = []
    plugins.preferred = lambda r, available, must, size: hints
    await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-c", "MIG-d")})
    # no hint: the must-include ids first, then the others in advertised order, the must-include
    # ids (which the kubelet also lists as available) not again
    assert await preferred(plugins, M, ["MIG-d", "MIG-c", "MIG-b"], ["MIG-c"], 2) == ["MIG-c", "MIG-b"]
    assert await preferred(plugins, M, ["MIG-d", "MIG-c", "MIG-b"], [], 3) == ["MIG-b", "MIG-c", "MIG-d"]
    # a hint naming a destroyed device, one the kubelet did not offer, and one twice
    hints[:] = ["MIG-gone", "MIG-a", "MIG-d", "MIG-d", "MIG-b"]
    assert await preferred(plugins, M, ["MIG-b", "MIG-c", "MIG-d"], [], 2) == ["MIG-d", "MIG-b"]
    assert await preferred(plugins, M, ["MIG-b", "MIG-c", "MIG-d"], ["MIG-b"], 2) == ["MIG-b", "MIG-d"]


async def test_preferred_allocation_without_a_hook_prefers_the_advertised_order():
    """A manager built without a `preferred` hook still answers (it says it offers
    GetPreferredAllocation at registration)."""
    async with DevicePluginManager("/nonexistent/device-plugins", serve=False) as plugins:
        await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-c")})
        assert plugins.preferred is None
        assert await preferred(plugins, M, ["MIG-c", "MIG-b"], [], 1) == ["MIG-b"]


# --- ListAndWatch ---------------------------------------------------------------------------------


async def test_list_and_watch_gives_each_device_its_health_and_numa_node(plugins: DevicePluginManager):
    """The kubelet gives no pod an Unhealthy device, and its topology manager aligns a pod's
    devices by the NUMA node each one reports (none reported: no NUMA affinity)."""
    await plugins.update({WHOLE: [whole("GPU-0", 0, numa_node=1), whole("GPU-1", 1, healthy=False, numa_node=0),
                                  whole("GPU-2", 2)]})
    message = await Stream(plugins.servers[WHOLE]).next_message()
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in message.devices] == [
        ("GPU-0", "Healthy", [1]), ("GPU-1", "Unhealthy", [0]), ("GPU-2", "Healthy", [])]
    assert not message.devices[2].HasField("topology")


async def test_every_open_stream_gets_the_full_list_and_each_change(plugins: DevicePluginManager):
    """The kubelet may hold two streams of one plugin for a while (its old connection and a new
    one after a re-registration): each gets the full list, each change, and `written` waits for
    the one left open when the other closes."""
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    server = plugins.servers[M]
    old, new = Stream(server), Stream(server)
    assert await old.next() == [("MIG-a", "Healthy"), ("MIG-b", "Healthy")]
    assert await new.next() == [("MIG-a", "Healthy"), ("MIG-b", "Healthy")]
    await old.close()
    await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-c")})
    assert not await plugins.written(timeout_s=0.1)  # the open stream has not sent it yet
    assert [i for i, _ in await new.next()] == ["MIG-a", "MIG-b", "MIG-c"]
    pulling = asyncio.create_task(new.next())  # asks for the next: the last one was sent
    assert await plugins.written(timeout_s=1.0)
    pulling.cancel()


async def test_a_closed_stream_does_not_hold_up_written(plugins: DevicePluginManager):
    """A stream the kubelet closed (it restarted) must not count as one that has not written the
    current list: the agent would never see its lists written and never acknowledge a plan."""
    await plugins.update({M: mig("MIG-a")})
    stream = Stream(plugins.servers[M])
    await stream.next()
    await stream.close()
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    assert await plugins.written(timeout_s=0.5)


async def test_written_is_false_until_every_stream_sent_the_current_list(plugins: DevicePluginManager):
    """The agent acknowledges a plan only once its lists were written to the kubelet's streams."""
    await plugins.update({M: mig("MIG-a")})
    stream = Stream(plugins.servers[M])
    await stream.next()
    pulling = asyncio.create_task(stream.next())
    assert await plugins.written(timeout_s=1.0)
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    assert [i for i, _ in await pulling] == ["MIG-a", "MIG-b"]
    assert await plugins.written(timeout_s=0.1) is False  # handed over, not sent
    pulling = asyncio.create_task(stream.next())
    assert await plugins.written(timeout_s=1.0) is True
    # the agent's call (its default timeout) waits for a stream a moment behind
    await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-c")})
    assert [i for i, _ in await pulling] == ["MIG-a", "MIG-b", "MIG-c"]

    async def resuming() -> None:
        await asyncio.sleep(0.05)
        await stream.next()
    reader = asyncio.create_task(resuming())
    assert await plugins.written() is True
    reader.cancel()


async def test_without_held_a_shrink_is_written_before_a_gpu_is_added_elsewhere(plugins: DevicePluginManager):
    """Without the kubelet's PodResources to ask, the only order the plugin can keep is its own
    writes: a whole GPU leaves nvidia.com/gpu on its stream before its slices are listed under
    another resource, so the kubelet never holds it both whole and sliced."""
    await plugins.update({WHOLE: [whole("GPU-0", 0)]})
    stream = Stream(plugins.servers[WHOLE])
    assert await stream.next() == [("GPU-0", "Healthy")]
    updating = asyncio.create_task(plugins.update({S40: slices("GPU-0", 0)}))
    await asyncio.sleep(0.1)  # the manager waits (up to 1 s) for the stream to send the shrunk list
    assert not updating.done()
    assert plugins.advertised() == {WHOLE: []}
    assert await stream.next() == []
    with pytest.raises(StopAsyncIteration):  # sent; then the resource, now empty, stops
        await stream.next()
    await asyncio.wait_for(updating, 0.5)
    assert [d.id for d in plugins.advertised()[S40]] == ["GPU-0::0", "GPU-0::1"]
    assert WHOLE not in plugins.servers


# --- serving --------------------------------------------------------------------------------------


async def test_an_unserved_manager_binds_no_socket_and_registers_nothing(plugin_dir: str):
    """`serve=False` (no kubelet of its own): nothing is bound in the plugin dir and nothing is
    registered even where a kubelet listens (it would dial a socket that is not there), yet the
    lists, Allocate and an in-process stream work as served."""
    async with KubeletDouble(plugin_dir) as kubelet, DevicePluginManager(plugin_dir, serve=False, poll_s=0.01) as plugins:
        await plugins.update({M: mig("MIG-a")})
        await plugins.check()
        await asyncio.sleep(0.05)  # a few looks of the watch
        assert os.listdir(plugin_dir) == ["kubelet.sock"] and plugins.servers[M].running
        assert kubelet.register_requests == [] and not plugins.registrations
        assert await Stream(plugins.servers[M]).next() == [("MIG-a", "Healthy")]
        assert await allocate(plugins, M, ["MIG-a"]) == [{"NVIDIA_VISIBLE_DEVICES": "MIG-a"}]


async def test_served_in_a_plugin_dir_the_kubelet_has_not_made_yet(plugin_dir: str):
    """An agent that starts before the kubelet made its device-plugins dir serves there anyway,
    and registers once the kubelet comes up."""
    d = os.path.join(plugin_dir, "device-plugins")
    async with DevicePluginManager(d, poll_s=0.05, register_timeout_s=2) as plugins:
        await plugins.update({M: mig("MIG-a")})
        assert os.path.exists(os.path.join(d, socket_name(M)))
        async with KubeletDouble(d) as kubelet:
            assert (await kubelet.wait_registered(M, timeout_s=2)).ids == ["MIG-a"]


async def test_a_socket_left_by_a_crashed_agent_is_replaced(plugin_dir: str):
    """A socket file left behind (the agent was killed) would make the bind fail: the plugin
    removes it and serves."""
    path = os.path.join(plugin_dir, socket_name(M))
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)
    left.close()
    async with KubeletDouble(plugin_dir) as kubelet, DevicePluginManager(plugin_dir, poll_s=0.05, register_timeout_s=2) as plugins:
        await plugins.update({M: mig("MIG-a")})
        assert plugins.servers[M].running
        assert (await kubelet.wait_registered(M, timeout_s=2)).ids == ["MIG-a"]


async def test_a_plugin_whose_socket_was_removed_is_served_and_registered_again(plugin_dir: str):
    """Its own socket gone (removed from the plugin dir), kubelet.sock unchanged: the watch serves
    again and registers, and the kubelet's new stream gets the full list."""
    async with KubeletDouble(plugin_dir) as kubelet, DevicePluginManager(plugin_dir, poll_s=0.02, register_timeout_s=2) as plugins:
        await plugins.update({M: mig("MIG-a", "MIG-b")})
        await kubelet.wait_registered(M, timeout_s=2)
        os.unlink(os.path.join(plugin_dir, socket_name(M)))
        seen = await kubelet.wait_registered(M, times=2, timeout_s=2)
        await kubelet.wait_for(lambda: len(seen.lists) >= 2)  # the new stream's full list
        assert seen.ids == ["MIG-a", "MIG-b"] and os.path.exists(os.path.join(plugin_dir, socket_name(M)))
        assert (await kubelet.allocate(M, ["MIG-b"])).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-b"


async def test_a_plugin_the_kubelet_disconnects_after_it_registered_again_registers_once_more(plugin_dir: str):
    """kubernetes#121994 (the kubelet's device manager up to 1.35): the plugin's socket removed, the
    agent serves again and registers; the kubelet handles the old stream's end only after that
    Register, and disconnects the client registered under the name then, the new one. The agent
    sees the kubelet close its stream while it runs and registers again: the kubelet ends with a
    live stream and the full list (review 79)."""
    async with KubeletDouble(plugin_dir) as kubelet, DevicePluginManager(plugin_dir, poll_s=0.02, register_timeout_s=2) as plugins:
        kubelet.old_stream_end_handled_after_s = 0.3
        await plugins.update({M: mig("MIG-a", "MIG-b")})
        seen = await kubelet.wait_registered(M, timeout_s=2)
        os.unlink(os.path.join(plugin_dir, socket_name(M)))
        await kubelet.wait_registered(M, times=2, timeout_s=2)
        await asyncio.sleep(0.5)  # the old stream's end handled: the new client disconnected
        await kubelet.wait_for(lambda: len(seen.registered_at) >= 3 and kubelet.allocatable().get(M) == 2, timeout_s=4)
        assert seen.ids == ["MIG-a", "MIG-b"]
        assert (await kubelet.allocate(M, ["MIG-b"])).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-b"


async def test_a_kubelet_gone_leaving_its_socket_is_tried_once_a_second_and_said_once(plugin_dir, caplog, monkeypatch):
    """A kubelet that died leaving kubelet.sock (a killed process does not remove it) closed the
    plugin's stream: the agent tries to register again once a second, not at every look of the
    watch, and says so once (review 82)."""
    import logging

    from dynpart.agent.deviceplugin import server as server_module
    real, last = server_module.file_stamp, {}

    def stamp_as_left(path):
        got = real(path)
        if got is not None:
            last[path] = got
        return last.get(path)
    monkeypatch.setattr(server_module, "file_stamp", stamp_as_left)
    kubelet = KubeletDouble(plugin_dir)
    await kubelet.start()
    async with DevicePluginManager(plugin_dir, poll_s=0.05, register_timeout_s=0.5) as plugins:
        await plugins.update({M: mig("MIG-a")})
        await kubelet.wait_devices(M, ["MIG-a"], timeout_s=3)
        for p in kubelet.plugins.values():  # the kubelet process dies: streams end, kubelet.sock stays
            await kubelet._disconnect(p)
        await kubelet._server.stop(0)
        await kubelet._pr_server.stop(0)
        caplog.set_level(logging.DEBUG, logger="dynpart")
        caplog.clear()
        tries = plugins.servers[M].registered_at
        await asyncio.sleep(2.5)
        said = [r for r in caplog.records if "registering again" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert plugins.servers[M].registered_at > tries  # it looked again (once a second)


async def test_a_kubelet_slow_to_open_its_stream_is_registered_with_once(plugin_dir: str):
    """A busy kubelet answers Register and dials ListAndWatch 1.5 s later: no second Register (on
    kubelets up to 1.35 it is the race the re-registration is for; review 83)."""
    class SlowDial(KubeletDouble):
        async def _connect(self, p: Any) -> None:
            await asyncio.sleep(1.5)
            await super()._connect(p)

    async with SlowDial(plugin_dir) as kubelet, DevicePluginManager(plugin_dir, poll_s=0.05, register_timeout_s=2) as plugins:
        await plugins.update({M: mig("MIG-a")})
        await asyncio.sleep(2.5)
        assert len(kubelet.plugins[M].registered_at) == 1 and kubelet.allocatable().get(M) == 1


async def test_a_kubelet_starting_after_the_plugin_and_wiping_the_dir_still_reaches_it(plugin_dir: str):
    """The plugin serves before the kubelet is up (not registered yet); the kubelet, starting,
    removes every socket in the dir: the plugin must serve again before it registers, or the
    kubelet dials a socket that is gone."""
    async with DevicePluginManager(plugin_dir, poll_s=0.02, register_timeout_s=2) as plugins:
        await plugins.update({M: mig("MIG-a")})
        await asyncio.sleep(0.05)
        for name in os.listdir(plugin_dir):
            os.unlink(os.path.join(plugin_dir, name))
        async with KubeletDouble(plugin_dir) as kubelet:
            seen = await kubelet.wait_registered(M, timeout_s=2)
            await kubelet.wait_devices(M, ["MIG-a"])
            # served again first: the one Register reaches it (no failed dial and a second Register)
            assert seen.stream_error is None and len(seen.registered_at) == 1
            assert (await kubelet.allocate(M, ["MIG-a"])).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-a"


async def test_stopping_a_stopped_server_is_harmless(plugin_dir: str):
    """The watch restarts (stop, start) a server whose earlier start may have failed."""
    server = PluginServer(M, plugin_dir, mig("MIG-a"))
    await server.start()
    await server.stop()
    await server.stop()
    assert not server.running and not server.socket_exists()


async def test_the_allocate_settings_given_are_what_allocate_hands_out():
    """The agent's configured MPS pipe directory and NVIDIA device-list strategy reach every
    container (a pod must not get the default pipe path the daemon does not listen on)."""
    from dynpart.agent.deviceplugin.server import AllocateSettings

    settings = AllocateSettings(pipe_dir_host="/run/dynpart/mps", pipe_dir_container="/mps", device_list="volume-mounts")
    async with DevicePluginManager("/nonexistent/device-plugins", serve=False, allocate=settings) as plugins:
        await plugins.update({S40: slices("GPU-0", 0)})
        msgs = protocol.messages()
        request = msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=["GPU-0::1"])])
        response = (await plugins.servers[S40].Allocate(request, Context())).container_responses[0]
        assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps"
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
        assert [(m.host_path, m.container_path) for m in response.mounts] == [
            ("/dev/null", "/var/run/nvidia-container-devices/GPU-0"), ("/run/dynpart/mps", "/mps")]


async def test_with_its_default_settings_the_plugin_registers_and_waits_for_the_kubelet(plugin_dir: str):
    """The agent builds the manager with its defaults: it must register (within the default
    Register timeout) and a withdrawal must wait (up to the default 2 s) until the kubelet's
    PodResources no longer lists the device, so the guard can destroy it."""
    from dynpart.agent.podresources import KubeletPodResources

    async with KubeletDouble(plugin_dir) as kubelet:
        pr = KubeletPodResources(kubelet.pod_resources_socket, timeout_s=2)
        async with DevicePluginManager(plugin_dir, held=pr.allocatable) as plugins:
            await plugins.update({M: mig("MIG-a", "MIG-b")})
            await kubelet.wait_registered(M, timeout_s=2)
            await kubelet.wait_devices(M, ["MIG-a", "MIG-b"])
            kubelet.receive_delay_s[M] = 0.3  # the kubelet takes its time to read the shorter list
            assert await plugins.withdraw("MIG-b") == set()
            assert kubelet.held()[M] == ["MIG-a"]


async def test_a_closed_manager_serves_nothing_again():
    """After close (the agent stops) its watch must be gone: an addition held back until the
    kubelet catches up must not bring a server back that the kubelet would read as the agent's."""
    kubelet = LaggingKubelet()
    plugins = DevicePluginManager("/nonexistent/device-plugins", serve=False, poll_s=0.01, held=kubelet.held,
                                  confirm_timeout_s=0.05)
    kubelet.plugins = plugins
    await plugins.start()
    await plugins.update({WHOLE: [whole("GPU-0", 0)]})
    kubelet.freeze()
    await plugins.update({S40: slices("GPU-0", 0)})
    assert plugins.pending == {S40: ["GPU-0::0", "GPU-0::1"]}
    await plugins.close()
    assert plugins.servers == {}
    kubelet.catch_up()
    await asyncio.sleep(0.1)  # ten looks of a watch left running
    assert plugins.servers == {}


# --- withdrawals and additions while the kubelet lags -------------------------------------------------


class LaggingKubelet:
    """PodResources GetAllocatableResources of a kubelet that stopped reading the plugin's streams
    at `freeze()`: it answers what the plugin listed then, until `catch_up()`."""

    def __init__(self) -> None:
        self.plugins: DevicePluginManager | None = None
        self.frozen: dict[str, list[str]] | None = None

    def now(self) -> dict[str, list[str]]:
        assert self.plugins is not None
        return {r: [d.id for d in ds] for r, ds in self.plugins.advertised().items()}

    async def held(self) -> dict[str, list[str]]:
        return self.frozen if self.frozen is not None else self.now()

    def freeze(self) -> None:
        self.frozen = self.now()

    def catch_up(self) -> None:
        self.frozen = None


@pytest.fixture
async def lagging() -> AsyncIterator[tuple[DevicePluginManager, LaggingKubelet]]:
    kubelet = LaggingKubelet()
    plugins = DevicePluginManager("/nonexistent/device-plugins", serve=False, held=kubelet.held, confirm_timeout_s=0.05)
    kubelet.plugins = plugins
    yield plugins, kubelet
    await plugins.close()


async def test_withdraw_returns_the_ids_the_kubelet_still_holds(lagging):
    """The guard destroys only what the kubelet was seen to drop: the ids it still holds are
    returned, the others not."""
    plugins, kubelet = lagging
    await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-c")})
    kubelet.frozen = {M: ["MIG-a", "MIG-c"]}  # it read that MIG-b went (an earlier list), not yet MIG-c
    assert await plugins.withdraw("MIG-b", "MIG-c") == {"MIG-c"}
    assert [d.id for d in plugins.advertised()[M]] == ["MIG-a"]
    kubelet.catch_up()
    assert await plugins.withdraw("MIG-c") == set()


async def test_a_destroyed_device_never_comes_back_from_the_lists_wanted_before(lagging):
    """After `forget`, no later list the manager rebuilds from the last update (marking
    everything Unhealthy, another withdrawal, a readmission) may list the destroyed device."""
    plugins, _ = lagging
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    await plugins.withdraw("MIG-b")
    plugins.seal("MIG-b")
    await plugins.forget("MIG-b")
    await plugins.set_unhealthy()
    assert [(d.id, d.healthy) for d in plugins.advertised()[M]] == [("MIG-a", False)]
    await plugins.withdraw("MIG-a")
    await plugins.readmit("MIG-a", "MIG-b")
    assert [d.id for d in plugins.advertised()[M]] == ["MIG-a"]


async def test_a_readmitted_device_does_not_hold_back_its_gpus_other_devices(lagging):
    """A device withdrawn (the kubelet not confirming) and then readmitted is listed again, not
    leaving: a new device on its GPU under another resource is added at once."""
    plugins, kubelet = lagging
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    kubelet.freeze()
    assert await plugins.withdraw("MIG-b") == {"MIG-b"}
    await plugins.readmit("MIG-b")
    assert plugins.leaving == {}
    await plugins.update({M: mig("MIG-a", "MIG-b"), "nvidia.com/mig-3g.40gb": mig("MIG-c")})
    assert plugins.pending == {} and [d.id for d in plugins.advertised()["nvidia.com/mig-3g.40gb"]] == ["MIG-c"]


async def test_an_unconfirmed_withdrawal_holds_back_only_additions_under_another_resource(lagging):
    """While the kubelet may still hold a withdrawn device, only a device added on its GPU under
    another resource waits (the GPU must not be under two resources at the kubelet): what is
    listed already stays listed, and an addition under the same resource is made at once."""
    plugins, kubelet = lagging
    m3 = "nvidia.com/mig-3g.40gb"
    await plugins.update({M: mig("MIG-a", "MIG-b"), m3: mig("MIG-c"), WHOLE: [whole("GPU-1", 1)]})
    kubelet.freeze()
    assert await plugins.withdraw("MIG-a") == {"MIG-a"}
    assert [d.id for d in plugins.advertised()[m3]] == ["MIG-c"]
    await plugins.update({M: mig("MIG-a", "MIG-b", "MIG-d"), m3: mig("MIG-c", "MIG-e"),
                          WHOLE: [whole("GPU-1", 1)], S40: slices("GPU-2", 2)})
    advertised = {r: [d.id for d in ds] for r, ds in plugins.advertised().items()}
    assert advertised == {M: ["MIG-b", "MIG-d"], m3: ["MIG-c"], WHOLE: ["GPU-1"], S40: ["GPU-2::0", "GPU-2::1"]}
    assert plugins.pending == {m3: ["MIG-e"]}
    kubelet.catch_up()
    await plugins.check()  # the watch's next look
    assert plugins.pending == {} and [d.id for d in plugins.advertised()[m3]] == ["MIG-c", "MIG-e"]


async def test_an_addition_blocked_by_an_earlier_withdrawal_waits_for_the_kubelet_in_the_same_update(lagging):
    """A slice re-made on a GPU whose old device the kubelet has not yet been seen to drop: the
    update waits (up to confirm_timeout_s) for the kubelet rather than leave it to a later pass."""
    plugins, kubelet = lagging
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    kubelet.freeze()
    assert await plugins.withdraw("MIG-b") == {"MIG-b"}
    plugins.confirm_timeout_s = 2.0
    asyncio.get_running_loop().call_later(0.1, kubelet.catch_up)
    await plugins.update({M: mig("MIG-a"), "nvidia.com/mig-2g.20gb": mig("MIG-x")})  # MIG-b destroyed, MIG-x made
    assert plugins.pending == {} and [d.id for d in plugins.advertised()["nvidia.com/mig-2g.20gb"]] == ["MIG-x"]


async def test_a_resource_left_is_served_empty_until_the_kubelet_dropped_it(lagging):
    """A whole GPU sliced: nvidia.com/gpu keeps serving its empty list until the kubelet has read
    it (a stream that ends first leaves the kubelet holding the GPU), then stops."""
    plugins, kubelet = lagging
    await plugins.update({WHOLE: [whole("GPU-0", 0)]})
    kubelet.freeze()
    await plugins.update({S40: slices("GPU-0", 0)})
    assert plugins.servers[WHOLE].running and plugins.advertised() == {WHOLE: []}
    assert plugins.pending == {S40: ["GPU-0::0", "GPU-0::1"]}
    kubelet.catch_up()
    await plugins.check()
    assert WHOLE not in plugins.servers and [d.id for d in plugins.advertised()[S40]] == ["GPU-0::0", "GPU-0::1"]


async def test_a_resource_gone_stops_once_the_kubelet_dropped_it_without_another_update(lagging):
    """A resource whose every device went (nothing replaces them) keeps serving its empty list
    while the kubelet holds them, and the watch stops it once the kubelet dropped them."""
    plugins, kubelet = lagging
    await plugins.update({M: mig("MIG-a"), WHOLE: [whole("GPU-1", 1)]})
    kubelet.freeze()
    await plugins.update({WHOLE: [whole("GPU-1", 1)]})
    assert plugins.servers[M].running and plugins.advertised()[M] == [] and plugins.pending == {}
    kubelet.catch_up()
    await plugins.check()
    assert M not in plugins.servers and [d.id for d in plugins.advertised()[WHOLE]] == ["GPU-1"]


async def test_a_new_resource_is_served_with_what_is_not_held_back(lagging):
    """Slices of a new resource on two GPUs, one of them still whole at the kubelet: the other
    GPU's slices are served at once."""
    plugins, kubelet = lagging
    await plugins.update({WHOLE: [whole("GPU-0", 0)]})
    kubelet.freeze()
    await plugins.update({S40: slices("GPU-0", 0) + slices("GPU-1", 1)})
    assert [d.id for d in plugins.advertised()[S40]] == ["GPU-1::0", "GPU-1::1"]
    assert plugins.pending == {S40: ["GPU-0::0", "GPU-0::1"]}


async def test_a_kubelet_that_never_confirms_costs_no_wait_where_nothing_waits_for_it(lagging):
    """A withdrawal the kubelet never confirms must not make every pass wait confirm_timeout_s:
    an update that adds nothing blocked, the watch's look and marking the lists Unhealthy (the
    GPUs cannot be read) each take one look."""
    plugins, kubelet = lagging
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    kubelet.freeze()
    assert await plugins.withdraw("MIG-a") == {"MIG-a"}
    plugins.confirm_timeout_s = 30.0
    await asyncio.wait_for(plugins.update({M: mig("MIG-a", "MIG-b")}), 2.0)
    plugins.confirm_timeout_s = 0.05
    await plugins.update({M: mig("MIG-a", "MIG-b"), "nvidia.com/mig-2g.20gb": mig("MIG-x")})
    assert plugins.pending == {"nvidia.com/mig-2g.20gb": ["MIG-x"]}
    plugins.confirm_timeout_s = 30.0
    await asyncio.wait_for(plugins.check(), 2.0)
    await asyncio.wait_for(plugins.set_unhealthy(), 2.0)
    assert [(d.id, d.healthy) for d in plugins.advertised()[M]] == [("MIG-b", False)]


async def test_a_kubelet_that_cannot_be_asked_confirms_nothing(lagging):
    """PodResources unreadable (the kubelet restarting): the withdrawal does not fail, and every
    id counts as still held (the guard must not destroy it)."""
    plugins, kubelet = lagging

    async def unreadable() -> dict[str, list[str]]:
        raise ConnectionError("PodResources: UNAVAILABLE")
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    plugins.held = unreadable
    assert await plugins.withdraw("MIG-b") == {"MIG-b"}
    assert [d.id for d in plugins.advertised()[M]] == ["MIG-a"]
    plugins.held = kubelet.held
    assert await plugins.withdraw("MIG-b") == set()


async def test_the_kubelet_is_asked_again_with_a_growing_delay(lagging):
    """While a withdrawal waits for the kubelet, PodResources is polled from 5 ms doubling to 100 ms,
    not in a hot loop (the kubelet rate-limits that API, and the agent's loop would spin)."""
    plugins, kubelet = lagging
    calls: list[float] = []

    async def counted() -> dict[str, list[str]]:
        calls.append(asyncio.get_running_loop().time())
        return await kubelet.held()
    plugins.held = counted
    await plugins.update({M: mig("MIG-a", "MIG-b")})
    kubelet.freeze()
    plugins.confirm_timeout_s = 0.5
    calls.clear()
    assert await plugins.withdraw("MIG-b") == {"MIG-b"}
    # 0, 5, 15, 35, 75, 155, 255, 355, 455 ms (then the deadline): about nine looks
    assert 3 <= len(calls) <= 12, len(calls)
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert max(gaps) >= 0.09
