"""The guard's last-moment checks, one at a time, on the agent's own device plugin (unserved: the
test plays the kubelet's Allocate calls and PodResources answers): the settle wait after a
withdrawal, which devices count as free for pods bound and not yet admitted (advertised, not
taken), and a device the driver would not destroy advertised again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.deviceplugin.devices import PluginDevice
from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.guard import SliceGuard
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import FakePodResources

from .conftest import ROUND_80GIB, make_rig, mig_spec, mps_spec, unserved_plugins

M = "nvidia.com/mig-1g.10gb"


def mig_devices(*ids: str) -> list[PluginDevice]:
    return [PluginDevice(i, "mig", "GPU-0", 0) for i in ids]


@dataclass
class Node:
    pods: FakePodResources  # what the kubelet's PodResources List answers
    node_pods: FakeNodePods  # the pods the API server has bound to the node
    plugins: DevicePluginManager

    def guard(self, settle_s: float = 0.0, **kw: Any) -> SliceGuard:
        return SliceGuard(self.pods, self.node_pods, self.plugins, settle_s=settle_s, **kw)

    def listed(self) -> set[str]:
        return {d.id for ds in self.plugins.advertised().values() for d in ds}

    async def allocate(self, *ids: str) -> dict[str, str]:
        """The kubelet's Allocate for one container (it chose `ids` from a list it read before):
        the env the plugin answers; raises if the plugin refuses."""
        msgs = protocol.messages()
        request = msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=list(ids))])
        response = await self.plugins.servers[M].Allocate(request, Refusing())
        return dict(response.container_responses[0].envs)


class Refusing:
    """A gRPC context: Allocate's abort is the plugin's refusal."""

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    pods = FakePodResources()
    plugins = unserved_plugins(pods)
    await plugins.update({M: mig_devices("MIG-a", "MIG-b", "MIG-c")})
    yield Node(pods, FakeNodePods(), plugins)
    await plugins.close()


def during_withdrawal(node: Node, then: Any) -> None:
    """Runs `then()` right after the plugin has withdrawn the devices (what the node does while the
    guard waits)."""
    withdraw = node.plugins.withdraw

    async def withdrawing(*ids: str) -> set[str]:
        unconfirmed = await withdraw(*ids)
        then()
        return unconfirmed

    node.plugins.withdraw = withdrawing  # type: ignore[method-assign]


# --- the settle wait ------------------------------------------------------------------------------


async def test_an_allocate_during_the_settle_wait_keeps_the_device(node: Node):
    """The kubelet may have chosen the device just before it read the list without it: its
    Allocate lands a moment after the withdrawal, still served. The re-check comes only after the
    settle wait, so that call is seen and the device is kept (never sealed, never destroyed)."""
    served: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()

    async def kubelet_allocates() -> None:
        try:
            served.set_result(await node.allocate("MIG-a"))
        except RuntimeError as e:
            served.set_exception(e)

    def allocate_20ms_later() -> None:
        # on the loop's timer heap ahead of the guard's own wait: it fires first, whatever the load
        asyncio.get_running_loop().call_later(0.02, lambda: asyncio.ensure_future(kubelet_allocates()))

    during_withdrawal(node, allocate_20ms_later)
    out = await node.guard(settle_s=0.1).release({"MIG-a": M}, {M: ["MIG-a", "MIG-b", "MIG-c"]})
    envs = await asyncio.wait_for(served, 1)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-a"  # the pod was admitted with it
    assert out.in_use == {"MIG-a": ["a kubelet Allocate call"]} and out.destroyable == []
    assert "MIG-a" not in node.plugins.sealed and "MIG-a" in node.listed()  # advertised again


# --- what counts as free for pods bound and not yet admitted ------------------------------------


async def test_a_free_device_the_plugin_does_not_list_does_not_count_for_bound_pods(node: Node):
    """The kubelet gives a bound pod only what the plugin lists: a free instance the plugin does
    not list (held back, or not listed yet) is no device for it. With MIG-a and MIG-b listed and
    MIG-d free but unlisted, a pod needing 2 keeps MIG-a."""
    node.node_pods.bind("ns/w", {M: 2})
    kept = await node.guard().keep({"MIG-a": M}, {M: ["MIG-a", "MIG-b", "MIG-d"]})
    assert list(kept) == ["MIG-a"] and "ns/w" in kept["MIG-a"] and "1 other free" in kept["MIG-a"]
    # listed, it would count: MIG-a may go
    await node.plugins.update({M: mig_devices("MIG-a", "MIG-b", "MIG-c", "MIG-d")})
    assert await node.guard().keep({"MIG-a": M}, {M: ["MIG-a", "MIG-b", "MIG-d"]}) == {}


async def test_a_device_taken_during_the_withdrawal_is_not_free_for_a_pod_bound_meanwhile(node: Node):
    """While MIG-a is withdrawn, the kubelet admits ns/x onto MIG-b (still listed) and the scheduler
    binds ns/late for one more: MIG-b is no longer free, so MIG-a is readmitted for ns/late."""

    def node_moves() -> None:
        node.pods.assign("ns/x", M, "MIG-b")
        node.node_pods.bind("ns/x", {M: 1}, phase="Running")
        node.node_pods.bind("ns/late", {M: 1})

    during_withdrawal(node, node_moves)
    out = await node.guard().release({"MIG-a": M}, {M: ["MIG-a", "MIG-b"]})
    assert list(out.needed) == ["MIG-a"] and "ns/late" in out.needed["MIG-a"] and out.destroyable == []
    assert "MIG-a" in node.listed() and "MIG-a" not in node.plugins.sealed
    assert (await node.allocate("MIG-a"))["NVIDIA_VISIBLE_DEVICES"] == "MIG-a"  # ns/late admitted


async def test_an_unlisted_device_is_not_free_at_the_recheck(node: Node):
    """At the re-check too, only what the plugin still lists counts: MIG-d is free on the GPU but
    not listed, so the pod bound during the withdrawal keeps MIG-a."""
    during_withdrawal(node, lambda: node.node_pods.bind("ns/late", {M: 1}))
    out = await node.guard().release({"MIG-a": M}, {M: ["MIG-a", "MIG-d"]})
    assert list(out.needed) == ["MIG-a"] and out.destroyable == []
    assert "MIG-a" in node.listed()


async def test_release_without_free_devices_keeps_what_a_late_pod_needs(node: Node):
    """`free` is optional: without it no other device counts as free, and a pod bound during the
    withdrawal keeps the device (no failure of the pass)."""
    during_withdrawal(node, lambda: node.node_pods.bind("ns/late", {M: 1}))
    out = await node.guard().release({"MIG-a": M})
    assert list(out.needed) == ["MIG-a"] and out.destroyable == []


# --- a device that could not be destroyed after all -----------------------------------------------


async def test_restore_advertises_a_sealed_device_again(node: Node):
    """The driver refused the destroy (IN_USE): the device was withdrawn and sealed; restore lists
    it again and Allocate serves it again."""
    guard = node.guard()
    out = await guard.release({"MIG-a": M}, {M: ["MIG-a", "MIG-b", "MIG-c"]})
    assert out.destroyable == ["MIG-a"] and "MIG-a" in node.plugins.sealed and "MIG-a" not in node.listed()
    await guard.restore(["MIG-a"])
    assert "MIG-a" in node.listed() and not node.plugins.withdrawn and not node.plugins.sealed
    assert (await node.allocate("MIG-a"))["NVIDIA_VISIBLE_DEVICES"] == "MIG-a"


async def test_restore_without_the_builtin_plugin_does_nothing():
    """NVIDIA's plugin serves the devices: nothing was withdrawn, nothing to advertise again."""
    guard = SliceGuard(FakePodResources(), FakeNodePods(), None)
    await guard.restore(["MIG-a"])
    await guard.destroyed(["MIG-a"])


async def test_an_instance_held_open_is_advertised_again_in_the_same_pass():
    """The agent's own plugin: the driver refuses to destroy an instance no pod and no process uses
    (DCGM holds it). The pass that tried ends with it listed, neither withdrawn nor sealed: a pod
    may get it at once, not only after the next pass cleans up."""
    rig = make_rig(count=1).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(withdraw_settle_s=0)
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    for _ in range(3):
        report = await agent.reconcile_once()
    assert report.plan_id == "p1", report.errors
    held = rig.uuid(0, rig.driver.gi_at(0, 0))
    rig.driver.hold(0, "dcgm", gi_id=rig.driver.gi_at(0, 0))
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert any("destroying 3g.40gb@0 failed" in e for e in report.errors), report.errors
    assert held in [d.id for d in rig.plugins.advertised()["nvidia.com/mig-3g.40gb"]]
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()


async def test_an_instance_held_open_with_nvidias_plugin_is_reported_not_a_failed_pass():
    """NVIDIA's plugin (no built-in one): the same refusal is reported and the pass goes on."""
    rig = make_rig(count=1)
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    assert (await agent.reconcile_once()).plan_id == "p1"
    rig.driver.hold(0, "dcgm", gi_id=rig.driver.gi_at(0, 0))
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p2") | {"dynpart.io/spec-gpu-0-3g.40gb": None})
    report = await agent.reconcile_once()
    assert not report.failed and any("destroying 3g.40gb@0 failed" in e for e in report.errors), report.errors
    assert rig.driver.layout(0) == [("3g.40gb", 0)]  # the free 3g@4 went


# --- what the guard reads -------------------------------------------------------------------------


async def test_a_settled_mps_node_does_not_list_its_pods_each_pass():
    """The bound pods come from the API server (one list of the node's pods): an MPS pass with no
    slice to remove must not ask for them, or every node would list its pods every 10 s."""
    rig = make_rig(count=1, mig_enabled=False, **ROUND_80GIB).with_plugins()
    node_pods = FakeNodePods()
    agent = rig.agent(withdraw_settle_s=0, node_pods=node_pods)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    for _ in range(3):
        report = await agent.reconcile_once()
    assert report.plan_id == "m1", report.errors
    node_pods.bind("ns/a", {"nvidia.com/gpu-40gb": 1})  # a pod bound here: there is something to read
    before = node_pods.calls
    for _ in range(3):
        assert (await agent.reconcile_once()).plan_id == "m1"
    assert node_pods.calls == before
