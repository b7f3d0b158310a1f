"""What mutation testing found unpinned in the agent's pass (agent/loop.py): when a plan is
acknowledged (the GPUs hold it, the kubelet reports the devices, NVIDIA's plugin lists them),
what is published to the node, when NVIDIA's plugin is restarted, the status it writes, and the
module's helpers those decisions are made of."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpart.agent.deviceplugin.devices import DeviceListError, PluginDevice
from dynpart.agent.kube import FakePluginPods, NodeView
from dynpart.agent.loop import (
    Agent,
    _count,
    _fmt,
    _mig_ids,
    _node_mig_counts,
    _not_allocatable,
    _not_held,
    _publishable,
    _status_gpus,
)
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import PodResourcesError
from dynpart.annotations import STATUS_ERROR, STATUS_MODE, STATUS_PLAN
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout

from .conftest import ROUND_80GIB, Rig, make_rig, mig_spec, mps_spec

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"


def _mig(gpus: dict[int, list[str]]) -> list[GpuLayout]:
    return [GpuLayout(index=i, mig=[MigInstance(profile=x.split("@")[0], start=int(x.split("@")[1])) for x in items])
            for i, items in gpus.items()]


def _mps(gpus: dict[int, list[int]]) -> list[GpuLayout]:
    return [GpuLayout(index=i, mps=[MpsSlice(size=s) for s in sizes]) for i, sizes in gpus.items()]


def _plan(mode: str, gpus: list[GpuLayout]) -> NodeLayout:
    return NodeLayout(node="node-1", mode=mode, gpus=gpus)  # type: ignore[arg-type]


def _dev(device_id: str, healthy: bool = True) -> PluginDevice:
    return PluginDevice(id=device_id, kind="mig", gpu_uuid="GPU-0", gpu_index=0, healthy=healthy)


# --- _not_held: whether the GPUs hold the plan (nothing is acknowledged otherwise) ----------------


def test_not_held_compares_mig_placements_whatever_their_order():
    """A plan is held when every GPU has exactly the plan's profile@start set; a slot off is not."""
    plan = _plan("mig", _mig({0: ["1g.10gb@0", "3g.40gb@4"]}))
    assert _not_held("mig", plan, _mig({0: ["3g.40gb@4", "1g.10gb@0"]})) == []
    assert _not_held("mig", plan, _mig({0: ["1g.10gb@1", "3g.40gb@4"]})) == [
        "GPU 0 has 1g.10gb@1 3g.40gb@4, the plan 1g.10gb@0 3g.40gb@4"]
    assert _not_held("mig", plan, _mig({0: []})) == ["GPU 0 has nothing, the plan 1g.10gb@0 3g.40gb@4"]


def test_not_held_a_gpu_the_plan_does_not_name_must_be_empty():
    """A GPU absent from the plan is planned empty: an instance left there means the plan is not held."""
    plan = _plan("mig", _mig({0: ["7g.80gb@0"]}))
    assert _not_held("mig", plan, _mig({0: ["7g.80gb@0"], 1: []})) == []
    assert _not_held("mig", plan, _mig({0: ["7g.80gb@0"], 1: ["1g.10gb@0"]})) == [
        "GPU 1 has 1g.10gb@0, the plan nothing"]


def test_not_held_a_planned_gpu_missing_from_the_node_is_named():
    """A plan for a GPU the driver does not list cannot be held (a GPU fallen off the bus)."""
    plan = _plan("mig", _mig({0: ["7g.80gb@0"], 3: ["7g.80gb@0"]}))
    assert _not_held("mig", plan, _mig({0: ["7g.80gb@0"]})) == ["GPU 3 is not on this node"]


def test_not_held_compares_mps_sizes_as_a_multiset():
    """MPS: the plan's sizes in any order are held (slice numbers are the agent's); other sizes are not."""
    plan = _plan("mps", _mps({0: [10, 20, 10]}))
    assert _not_held("mps", plan, _mps({0: [20, 10, 10]})) == []
    assert _not_held("mps", plan, _mps({0: [10, 10, 20]})) == []
    assert _not_held("mps", plan, _mps({0: [20, 20]})) == ["GPU 0 has 20gb 20gb, the plan 20gb 10gb 10gb"]
    assert _not_held("mps", _plan("mps", _mps({0: [40]})), _mps({0: [10, 30]})) == [
        "GPU 0 has 30gb 10gb, the plan 40gb"]


def test_not_held_a_drained_gpu_holds_any_part_of_the_plan_and_nothing_else():
    """A drained GPU's slices go as they free: a part of the plan is held, a slice outside it is not."""
    plan = _plan("mig", _mig({0: ["1g.10gb@0", "1g.10gb@1"], 1: ["1g.10gb@0"]}))
    for part in ([], ["1g.10gb@0"], ["1g.10gb@1"], ["1g.10gb@0", "1g.10gb@1"]):
        assert _not_held("mig", plan, _mig({0: part, 1: ["1g.10gb@0"]}), drain=(0,)) == [], part
    assert _not_held("mig", plan, _mig({0: ["1g.10gb@0", "3g.40gb@4"], 1: ["1g.10gb@0"]}), drain=(0,)) == [
        "GPU 0 has 1g.10gb@0 3g.40gb@4, the plan 1g.10gb@0 1g.10gb@1"]
    # not drained: a part of the plan is not the plan
    assert _not_held("mig", plan, _mig({0: ["1g.10gb@0"], 1: ["1g.10gb@0"]})) == [
        "GPU 0 has 1g.10gb@0, the plan 1g.10gb@0 1g.10gb@1"]
    # the drain of one GPU says nothing of another
    assert _not_held("mig", plan, _mig({0: ["1g.10gb@0", "1g.10gb@1"], 1: []}), drain=(0,)) == [
        "GPU 1 has nothing, the plan 1g.10gb@0"]


_SIZES = st.lists(st.sampled_from([5, 10, 20, 40]), max_size=5)


@settings(max_examples=60, deadline=None)
@given(plan=st.dictionaries(st.integers(0, 3), _SIZES, max_size=4), data=st.data())
def test_not_held_mps_property_held_iff_same_sizes_or_a_drained_part(plan: dict[int, list[int]], data: st.DataObject):
    """Over any plan and any GPU state: held exactly when each GPU has the plan's sizes (any
    order), or, drained, a sub-multiset of them; every planned GPU must be on the node."""
    indices = sorted(set(plan) | set(data.draw(st.sets(st.integers(0, 3)), label="more GPUs")))
    have = {i: data.draw(_SIZES, label=f"GPU {i}") for i in indices}
    drain = tuple(data.draw(st.sets(st.sampled_from(indices)) if indices else st.just(set()), label="drain"))
    missing = _not_held("mps", _plan("mps", _mps(plan)), _mps(have), drain)
    for i in indices:
        h, w = Counter(have[i]), Counter(plan.get(i, []))
        held = h == w or (i in drain and not h - w)
        assert any(m.startswith(f"GPU {i} has") for m in missing) is not held, (i, have[i], plan.get(i))
    assert len(missing) == sum(1 for i in indices if not (Counter(have[i]) == Counter(plan.get(i, []))
                                                          or i in drain and not Counter(have[i]) - Counter(plan.get(i, []))))
    # and a permutation of the plan itself is always held
    assert _not_held("mps", _plan("mps", _mps(plan)), _mps({i: sorted(s) for i, s in plan.items()})) == []


# --- what the kubelet holds, what is published ------------------------------------------------------


def test_not_allocatable_names_healthy_devices_the_kubelet_does_not_hold():
    """The plan waits for healthy advertised devices the kubelet lacks; an unhealthy one never counts."""
    advertised = {MIG_1G: [_dev("MIG-a"), _dev("MIG-b"), _dev("MIG-c", healthy=False)], MIG_3G: [_dev("MIG-d")]}
    assert _not_allocatable(advertised, {MIG_1G: ["MIG-a"], MIG_3G: ["MIG-d"]}) == [f"{MIG_1G} MIG-b"]
    assert _not_allocatable(advertised, {MIG_1G: ["MIG-a", "MIG-b"], MIG_3G: ["MIG-d"]}) == []
    assert _not_allocatable(advertised, {}) == [f"{MIG_1G} MIG-a, MIG-b", f"{MIG_3G} MIG-d"]


def test_publishable_counts_healthy_held_devices_and_zeroes_slices_no_longer_served():
    """Published counts are never above what the kubelet holds healthy; a slice resource the node
    still lists and the plugin no longer serves goes to 0; other resources are not touched."""
    advertised = {"nvidia.com/gpu-10gb": [_dev("G::0"), _dev("G::1", healthy=False), _dev("G::2")]}
    held = {"nvidia.com/gpu-10gb": ["G::0", "G::1"]}
    node = {"nvidia.com/gpu-20gb": "2", "cpu": "8", "nvidia.com/gpu-10gb": "5", "example.com/fpga": "1"}
    assert _publishable(advertised, held, node) == {"nvidia.com/gpu-10gb": 1, "nvidia.com/gpu-20gb": 0}


def test_count_reads_a_quantity_or_zero():
    """A node count that is absent or not an integer counts 0 (published counts are compared to it)."""
    assert [_count("4"), _count(None), _count(""), _count("x")] == [4, 0, 0, 0]


def test_mig_counts_ids_and_node_counts():
    """What NVIDIA's plugin path compares: MIG ids the kubelet holds, and the node's MIG capacity
    (zero and unreadable counts left out)."""
    assert _mig_ids({MIG_1G: ["MIG-a", "MIG-b"], "nvidia.com/gpu": ["GPU-x"], MIG_3G: []}) == {
        (MIG_1G, "MIG-a"), (MIG_1G, "MIG-b")}
    for capacity in ({"nvidia.com/mig-2g.20gb": "many", MIG_1G: "2", MIG_3G: "0", "nvidia.com/gpu": "1"},
                     {MIG_1G: "2", "nvidia.com/mig-2g.20gb": "many", MIG_3G: "0", "nvidia.com/gpu": "1"}):
        assert _node_mig_counts(NodeView("node-1", capacity=capacity)) == {MIG_1G: 2}


def test_fmt_names_counts_in_order_or_none():
    """The counts as the status's waiting message says them."""
    assert _fmt({MIG_3G: 1, MIG_1G: 2}) == f"{MIG_1G}=2, {MIG_3G}=1"
    assert _fmt({}) == "none"


@settings(max_examples=80, deadline=None)
@given(keys=st.lists(st.one_of(
    st.builds(lambda i, rest: f"dynpart.io/status-gpu-{i}-{rest}", st.integers(0, 999),
              st.sampled_from(["1g.10gb-free", "10gb-used", "x"])),
    st.builds(lambda s: f"dynpart.io/status-gpu-{s}-1g.10gb-free", st.text("0123456789x١", min_size=1, max_size=5)),
    st.sampled_from(["dynpart.io/status-plan", "dynpart.io/status-mode", "example.com/abcdefghij7-x",
                     "dynpart.io/spec-gpu-3-1g.10gb", "dynpart.io/status-gpux-4-1g.10gb-free"])), max_size=6))
def test_status_gpus_are_the_indices_named_by_status_gpu_keys_only(keys: list[str]):
    """The GPUs a status names (each reported unhealthy when NVML cannot be read): the ASCII index
    of up to three digits after `status-gpu-`, and no other key's characters (`example.com/abcdefghij7-x`
    has a digit where a status key has its index)."""
    import re

    want = {int(m[1]) for k in keys if (m := re.fullmatch(r"dynpart\.io/status-gpu-([0-9]{1,3})(-.*)?", k, re.S))}
    assert _status_gpus(dict.fromkeys(keys, "1@0")) == want


# --- the status a pass writes -----------------------------------------------------------------------


async def test_a_status_plan_that_is_no_plan_id_is_not_echoed(rig: Rig):
    """The pass keeps the last acknowledged plan id in the status only if it is a valid one: a
    damaged `status-plan` (edited by hand) is dropped, not written back (nor does it fail the pass)."""
    rig.node_api.set_annotations({STATUS_PLAN: "not a plan id"})
    report = await rig.agent().reconcile_once()
    assert not report.failed and report.plan_id is None
    assert STATUS_PLAN not in rig.node_api.annotations and rig.node_api.annotations[STATUS_MODE] == "mig"


# --- early publishing -------------------------------------------------------------------------------


async def test_published_counts_are_written_only_when_the_node_shows_others():
    """The counts the kubelet holds are published once; a pass that finds the node showing them
    writes no Node status (every write reaches every Node watcher); a capacity below the count
    (written by someone else) is raised with it."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()  # two whole GPUs
    agent = rig.agent()
    await agent.reconcile_once()
    assert rig.node_api.allocatable == {"nvidia.com/gpu": "2"} and rig.node_api.capacity == {"nvidia.com/gpu": "2"}
    writes = [e for kind, e in rig.node_api.events if kind == "status"]
    for _ in range(2):
        await agent.reconcile_once()
    assert [e for kind, e in rig.node_api.events if kind == "status"] == writes
    rig.node_api.capacity["nvidia.com/gpu"] = "1"
    await agent.reconcile_once()
    assert rig.node_api.capacity == {"nvidia.com/gpu": "2"}
    assert [e for kind, e in rig.node_api.events if kind == "status"] == [*writes, {"nvidia.com/gpu": 2}]


async def _mps_slice_left_on_a_node_nvidias_plugin_serves(publish: bool = True) -> tuple[Rig, Agent]:
    """device_plugin: nvidia. An MPS node (2 x 40gb on GPU 0, GPU 1 whole) whose slice GPU-fake-0000::0
    a pod uses when the planner turns GPU 1 into a MIG GPU: the used slice stays, served by the
    agent's own plugin (NVIDIA's cannot serve it) until its pod ends."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent(plugin_pods=FakePluginPods(), publish_allocatable=publish, withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    assert (await agent.reconcile_once()).plan_id == "m1"
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    rig.driver.set_mig_mode(1, True)
    rig.node_api.set_annotations({**mig_spec({1: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-40gb": None})
    report = await agent.reconcile_once()
    assert any("leaving MPS mode" in e for e in report.errors), report.errors
    assert [d.id for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"]] == ["GPU-fake-0000::0"]
    return rig, agent


async def test_an_mps_slice_left_on_an_nvidia_plugin_node_is_published_unhealthy_at_once():
    """The MPS slices the agent's plugin still serves on a node NVIDIA's plugin serves are
    published as on an MPS node: a GPU gone unhealthy takes its slice out of the node's
    allocatable at once, not at the kubelet's next status write; the MIG devices NVIDIA's plugin
    serves are not the agent's to publish (it would publish 0 for them)."""
    rig, agent = await _mps_slice_left_on_a_node_nvidias_plugin_serves()
    assert rig.node_api.allocatable["nvidia.com/gpu-40gb"] == "1"
    rig.node_api.set_allocatable({"nvidia.com/mig-7g.80gb": 1})  # NVIDIA's plugin's, through the kubelet
    rig.driver.unhealthy[0] = "the driver asks for a reset (an Xid)"
    await agent.reconcile_once()
    assert [d.healthy for d in rig.plugins.advertised()["nvidia.com/gpu-40gb"]] == [False]
    assert rig.node_api.allocatable["nvidia.com/gpu-40gb"] == "0"
    assert rig.node_api.allocatable["nvidia.com/mig-7g.80gb"] == "1"  # NVIDIA's counts are left alone


async def test_without_publish_allocatable_the_node_status_is_never_written():
    """publish_allocatable off: the kubelet alone writes the node's counts, also for the MPS
    slices left on a node NVIDIA's plugin serves."""
    rig, agent = await _mps_slice_left_on_a_node_nvidias_plugin_serves(publish=False)
    rig.driver.unhealthy[0] = "the driver asks for a reset (an Xid)"
    await agent.reconcile_once()
    assert [e for kind, e in rig.node_api.events if kind == "status"] == [] and rig.node_api.allocatable == {}
    # nor on a node the agent's own plugin serves
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    assert (await rig.agent(publish_allocatable=False).reconcile_once()).plan_id == "m1"
    assert [e for kind, e in rig.node_api.events if kind == "status"] == [] and rig.node_api.allocatable == {}


# --- the acknowledgement ------------------------------------------------------------------------------


async def test_a_plan_is_not_acknowledged_while_the_device_plugin_refuses_the_lists():
    """Lists the plugin refuses (DeviceListError) never reach the kubelet: a failure to serve the
    devices; the plan applied waits, and is acknowledged once the lists are taken."""
    rig = make_rig().with_plugins()
    gi = rig.carve(0, "1g.10gb@0")["1g.10gb@0"]
    pid = rig.run_pod("ns/a", 0, gi)  # in the way of the plan on GPU 0
    agent = rig.agent(withdraw_settle_s=0)
    update = rig.plugins.update
    refused = "serving the devices: the device plugin refused the device lists: GPU(s) advertised both whole and sliced"

    async def refuse(lists: object) -> None:
        raise DeviceListError("GPU(s) advertised both whole and sliced: GPU-fake-0001")

    rig.plugins.update = refuse  # type: ignore[method-assign]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"], 1: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
    assert any(e.startswith(refused) for e in report.errors), report.errors
    rig.stop_pod("ns/a", pid)
    report = await agent.reconcile_once()
    assert rig.driver.layout(0) == rig.driver.layout(1) == [("7g.80gb", 0)]
    assert report.plan_id is None and report.waiting == ["the devices could not be served (see the error above)"]
    assert any(e.startswith(refused) for e in report.errors), report.errors
    assert ("plan p1 is not acknowledged yet: the devices could not be served (see the error above)"
            in rig.node_api.annotations[STATUS_ERROR])
    rig.plugins.update = update  # type: ignore[method-assign]
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and report.waiting == [] and rig.node_api.annotations[STATUS_PLAN] == "p1"


async def test_a_plan_waits_for_the_lists_to_be_written_and_for_devices_held_back():
    """The kubelet learns of new devices only from the lists written to its ListAndWatch streams,
    and devices the plugin holds back (their GPU still has a device the kubelet holds under
    another resource) are not advertised at all: either way the plan waits (the kubelet could not
    give the slices), and is acknowledged once both are done."""
    rig = make_rig().with_plugins()
    agent = rig.agent()
    written = [False]
    held_back: dict[str, list[str]] = {}
    update = rig.plugins.update

    async def lists_written(timeout_s: float = 1.0) -> bool:
        return written[0]

    async def update_holding_back(lists: dict[str, list[PluginDevice]]) -> None:
        await update(lists)
        rig.plugins.pending = dict(held_back)

    rig.plugins.written = lists_written  # type: ignore[method-assign]
    rig.plugins.update = update_holding_back  # type: ignore[method-assign]
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.plan_id is None and report.waiting == ["the device plugin's lists are not written to the kubelet yet"]
    written[0] = True
    held_back[MIG_1G] = ["MIG-x", "MIG-y"]
    report = await agent.reconcile_once()
    assert report.plan_id is None and report.waiting == [
        f"the device plugin holds back {MIG_1G} MIG-x, MIG-y until the kubelet drops what left the other lists on "
        "their GPUs"]
    held_back.clear()
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and report.waiting == []


async def test_a_failing_mps_daemon_holds_back_only_mps_plans():
    """The MPS control daemon serves MPS slices only: on a node gone MIG, a daemon failing for the
    MPS slice a pod still uses is reported, and the MIG plan is acknowledged all the same."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    daemon = FakeMpsDaemon()
    agent = rig.agent(mps_daemon=daemon, withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    assert (await agent.reconcile_once()).plan_id == "m1"
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    daemon.fail_with = "nvidia-cuda-mps-control: not found"
    daemon.die()
    rig.node_api.set_annotations({**mig_spec({1: ["7g.80gb@0"]}, plan="p2"), "dynpart.io/spec-gpu-0-40gb": None})
    report = await agent.reconcile_once()
    assert any("MPS control daemon: nvidia-cuda-mps-control: not found" in e for e in report.errors), report.errors
    assert report.plan_id == "p2" and report.waiting == []


# --- NVIDIA's device plugin -------------------------------------------------------------------------


def _nvidia_agent(rig: Rig) -> tuple[Agent, FakePluginPods]:
    plugin_pods = FakePluginPods()
    return rig.agent(plugin_pods=plugin_pods, node_pods=FakeNodePods()), plugin_pods


async def test_nvidias_plugin_listing_mig_devices_by_index_is_not_restarted_for_them():
    """deviceIDStrategy=index: the ids `0:0` name no instance; they are not MIG devices that are
    gone, and an agent (re)started on a node whose capacity matches the driver leaves the plugin
    alone (MIG changes are suspended there: nothing changes that NVIDIA's plugin must re-read)."""
    rig = make_rig(count=1)
    rig.carve(0, "3g.40gb@0", "3g.40gb@4")
    rig.pods.devices = {MIG_3G: ["0:0", "0:1"]}
    rig.node_api.set_allocatable({MIG_3G: 2})
    agent, plugin_pods = _nvidia_agent(rig)
    rig.node_api.set_annotations(mig_spec({0: ["3g.40gb@0", "3g.40gb@4"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert plugin_pods.restarts == 0 and report.waiting == []
    assert any("deviceIDStrategy" in e for e in report.errors)


async def test_nvidias_plugin_is_left_alone_when_it_lists_the_layout_and_restarted_on_any_change_after():
    """An agent (re)started on a node whose NVIDIA plugin lists what the GPUs hold does not
    restart it (its pods' devices stay as they are); from then on any change of the MIG devices
    restarts it, even one the kubelet's lists do not show (the destroyed instance was Unhealthy,
    so not among the kubelet's allocatable ids, and the counts stay the same)."""
    rig = make_rig(count=1)
    gis = rig.carve(0, "1g.10gb@0", "3g.40gb@4")
    rig.pods.devices = {MIG_3G: [rig.uuid(0, gis["3g.40gb@4"])], MIG_1G: []}  # the 1g is Unhealthy (an Xid)
    rig.node_api.set_allocatable({MIG_1G: 1, MIG_3G: 1})
    rig.node_api.allocatable[MIG_1G] = "0"
    agent, plugin_pods = _nvidia_agent(rig)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "3g.40gb@4"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.plan_id == "p1" and plugin_pods.restarts == 0
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@1", "3g.40gb@4"]}, plan="p2"))
    await agent.reconcile_once()
    assert rig.driver.layout(0) == [("1g.10gb", 1), ("3g.40gb", 4)]
    assert plugin_pods.restarts == 1


@pytest.mark.usefixtures("ask_enable_at_once")
async def test_nvidias_plugin_is_restarted_when_a_whole_gpu_turns_mig_with_no_instance_made():
    """NVIDIA's plugin lists every GPU out of MIG mode as a whole `nvidia.com/gpu`, read once at
    its start. A GPU whose MIG mode becomes active while no MIG device changes (the enable was
    left pending while DCGM held the GPU, the planner revoked the plan and left the GPU empty, and
    the agent asked again once it was idle) is no whole GPU any more: a pod the kubelet gives it to
    finds no device CUDA can use. The plugin is restarted for it, as for a change of MIG devices;
    an agent started while the kubelet still holds such a GPU as `nvidia.com/gpu` restarts it too."""
    whole = "nvidia.com/gpu"
    rig = make_rig(mig_enabled=False)
    uuids = [d.uuid for d in rig.driver.devices()]
    rig.pods.devices = {whole: list(uuids)}  # NVIDIA's plugin, started before: both GPUs whole
    rig.node_api.set_allocatable({whole: 2})

    def relist() -> None:  # what the new NVIDIA plugin lists: the GPUs out of MIG mode (no instance here)
        rig.pods.devices = {whole: [d.uuid for d in rig.driver.devices() if not d.mig_current]}
        rig.node_api.set_allocatable({whole: len(rig.pods.devices[whole])})

    plugin_pods = FakePluginPods()
    agent = rig.agent(plugin_pods=plugin_pods, node_pods=FakeNodePods())
    rig.driver.hold(1, "dcgm")
    rig.node_api.set_annotations(mig_spec({1: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert report.plan_id is None and rig.driver.devices()[1].mig_pending and not rig.driver.devices()[1].mig_current
    assert plugin_pods.restarts == 0  # nothing NVIDIA's plugin lists changed
    # the planner revokes p1 (GPU 1 left empty); DCGM is stopped; the agent asks again, and MIG mode is on
    rig.driver.release(1, "dcgm")
    rig.node_api.set_annotations({**mig_spec({}, plan="p2"), "dynpart.io/spec-gpu-1-7g.80gb": None})
    await agent.reconcile_once()
    assert rig.driver.devices()[1].mig_current and rig.driver.layout(1) == []
    assert plugin_pods.restarts == 1, "NVIDIA's plugin still lists GPU 1, now in MIG mode, as a whole nvidia.com/gpu"
    relist()
    assert (await agent.reconcile_once()).plan_id == "p2" and plugin_pods.restarts == 1
    # an agent (re)started while NVIDIA's plugin (not restarted: the last agent stopped first) lists it whole
    rig.pods.devices = {whole: list(uuids)}
    rig.node_api.set_allocatable({whole: 2})
    restarter = FakePluginPods()
    await rig.agent(plugin_pods=restarter, node_pods=FakeNodePods()).reconcile_once()
    assert restarter.restarts == 1
    # one that finds the plugin listing what the GPUs are leaves it alone
    relist()
    untouched = FakePluginPods()
    await rig.agent(plugin_pods=untouched, node_pods=FakeNodePods()).reconcile_once()
    assert untouched.restarts == 0


async def test_without_a_plan_nothing_is_waited_for():
    """Devices the kubelet does not report yet (here it never registered the plugin) are no
    reason to look again every retry_s when there is no plan to acknowledge: the pass waits for
    nothing, and the next comes at the interval."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    rig.pods.on_allocatable = dict  # the kubelet holds nothing
    agent = rig.agent()
    for _ in range(2):
        report = await agent.reconcile_once()
        assert report.plan_id is None and report.waiting == [] and not report.failed
    assert rig.plugins.advertised()["nvidia.com/gpu"] and not agent._waiting


async def test_a_plan_the_driver_cannot_apply_yet_waits_for_nothing_else():
    """A plan not applied (its GPU's MIG mode pending a reset) is reported as such; what the
    kubelet does not report is no reason to look again every retry_s: the reset is not coming
    within seconds, and the planner revokes the plan."""
    rig = make_rig(mig_enabled=False, mode_needs_reset=True, **ROUND_80GIB).with_plugins()
    rig.pods.on_allocatable = dict  # the kubelet holds nothing
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    for _ in range(2):
        report = await agent.reconcile_once()
        assert report.plan_id is None and report.waiting == [] and not agent._waiting
        assert any(e.startswith("plan not applied: GPU 0: MIG mode enable is pending") for e in report.errors)

    def unreachable() -> dict[str, list[str]]:
        raise PodResourcesError("the kubelet's PodResources socket is not there")

    rig.pods.on_allocatable = unreachable  # nor is it told that it is not acknowledged (it is not applied)
    report = await agent.reconcile_once()
    assert any(e.startswith("serving the devices: ") for e in report.errors), report.errors
    assert report.plan_id is None and not any("not acknowledged yet" in e for e in report.errors), report.errors


async def test_a_plan_is_not_acknowledged_while_its_devices_cannot_be_served():
    """The kubelet's PodResources unreachable after the GPUs were changed: the plan is applied, not
    acknowledged (the kubelet may not have the devices); without a plan nothing is waited for."""
    rig = make_rig().with_plugins()
    held = rig.pods.on_allocatable

    def unreachable() -> dict[str, list[str]]:
        raise PodResourcesError("the kubelet's PodResources socket is not there")

    rig.pods.on_allocatable = unreachable
    agent = rig.agent()
    report = await agent.reconcile_once()
    assert report.plan_id is None and report.waiting == [] and not agent._waiting
    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    report = await agent.reconcile_once()
    assert rig.driver.layout(0) == [("7g.80gb", 0)]
    assert report.plan_id is None and STATUS_PLAN not in rig.node_api.annotations
    assert report.waiting == ["the devices could not be served (see the error above)"]
    rig.pods.on_allocatable = held
    assert (await agent.reconcile_once()).plan_id == "p1"


async def test_the_preferred_allocation_packs_mps_slices_onto_the_gpu_in_use():
    """GetPreferredAllocation prefers the slices of the GPU with the most slices in use (MPS
    slices count as MIG instances do): a new pod joins the GPU others run on, and the other GPU's
    free slices stay together for the planner's next re-carving."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    agent = rig.agent()
    rig.node_api.set_annotations(mps_spec({0: [20, 20], 1: [20, 20]}, plan="m1"))
    assert (await agent.reconcile_once()).plan_id == "m1"
    rig.pods.assign("ns/a", "nvidia.com/gpu-20gb", "GPU-fake-0001::0")
    await agent.reconcile_once()
    assert rig.plugins is not None and rig.plugins.preferred is not None
    free = ["GPU-fake-0000::0", "GPU-fake-0000::1", "GPU-fake-0001::1"]
    assert rig.plugins.preferred("nvidia.com/gpu-20gb", free, [], 1)[0] == "GPU-fake-0001::1"


# --- a pass that stopped between a withdrawal and the destroy -----------------------------------------


async def test_devices_a_stopped_pass_left_withdrawn_are_advertised_again_unless_destroyed():
    """A pass that stopped after withdrawing two instances and destroying one of them (a driver
    call failing): the next pass advertises the one left again (else it stays hidden for good
    while the status reports it free) and never the destroyed one."""
    rig = make_rig(count=1).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(withdraw_settle_s=0)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    assert (await agent.reconcile_once()).plan_id == "p1"
    gis = {gi.start: gi for gi in rig.driver.gpu_instances(0)}
    left, gone = gis[0].uuid, gis[1].uuid
    assert left and gone
    await rig.plugins.withdraw(left, gone)
    for ci in list(gis[1].compute_instances):
        rig.driver.destroy_compute_instance(0, gis[1].gi_id, ci)
    rig.driver.destroy_gpu_instance(0, gis[1].gi_id)
    readmitted: list[tuple[str, ...]] = []
    readmit = rig.plugins.readmit

    async def recorded(*ids: str) -> None:
        readmitted.append(ids)
        await readmit(*ids)

    rig.plugins.readmit = recorded  # type: ignore[method-assign]
    rig.node_api.set_annotations({**mig_spec({0: ["1g.10gb@0"]}, plan="p2")})
    report = await agent.reconcile_once()
    assert readmitted == [(left,)]
    assert [d.id for d in rig.plugins.advertised()[MIG_1G]] == [left] and rig.plugins.withdrawn == set()
    assert report.plan_id == "p2"


# --- fencing a deposed planner's specs ------------------------------------------------------------------


async def test_an_acknowledged_plan_is_not_fenced_after_the_lease_moved_on():
    """A plan acknowledged under term 1 stays the node's plan when a new leader (term 2) has not
    re-planned it yet: a restarted agent neither reads the Lease for it nor reports it deposed
    (it would stop changing the node for a plan the planner counts on)."""
    rig = make_rig().with_plugins()
    reads: list[int] = []

    async def term(value: int) -> int:
        reads.append(value)
        return value

    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p1"), "dynpart.io/spec-term": "1"})
    assert (await rig.agent(leader_term=lambda: term(1)).reconcile_once()).plan_id == "p1"
    reads.clear()
    report = await rig.agent(leader_term=lambda: term(2)).reconcile_once()
    assert reads == [] and report.plan_id == "p1" and report.errors == []


async def test_specs_without_a_term_or_agents_without_a_lease_reader_are_not_fenced():
    """A spec with no term (a planner before fencing) is applied whatever the Lease says; an agent
    with no Lease reader, or whose reader finds no Lease, applies a spec with a term."""
    rig = make_rig()

    async def term() -> int:
        return 5

    rig.node_api.set_annotations(mig_spec({0: ["7g.80gb@0"]}, plan="p1"))
    assert (await rig.agent(leader_term=term).reconcile_once()).plan_id == "p1"
    rig.node_api.set_annotations({**mig_spec({0: ["3g.40gb@4"]}, plan="p2"), "dynpart.io/spec-gpu-0-7g.80gb": None,
                                  "dynpart.io/spec-term": "1"})
    report = await rig.agent().reconcile_once()
    assert report.plan_id == "p2" and rig.driver.layout(0) == [("3g.40gb", 4)]

    async def no_lease() -> None:  # no Lease, or no right to read it (kube.lease_term_reader)
        return None

    rig.node_api.set_annotations({**mig_spec({0: ["7g.80gb@0"]}, plan="p3"), "dynpart.io/spec-gpu-0-3g.40gb": None,
                                  "dynpart.io/spec-term": "1"})
    report = await rig.agent(leader_term=no_lease).reconcile_once()
    assert report.plan_id == "p3" and rig.driver.layout(0) == [("7g.80gb", 0)]


async def test_the_publisher_republishes_at_once_when_the_node_shows_other_counts():
    """The kubelet's own status write (at its restart, before its device manager caught up) can set
    the node's counts below what it holds: the node watch sees counts other than those published
    and the publisher writes them again at once, not at the next pass (interval 60 s); the
    publisher looks again until the kubelet holds every advertised device."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(interval_s=60, retry_s=30)
    holds = rig.pods.on_allocatable
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        assert await _until(lambda: rig.node_api.allocatable.get("nvidia.com/gpu") == "2")
        rig.node_api.set_allocatable({"nvidia.com/gpu": 0})
        assert await _until(lambda: rig.node_api.allocatable.get("nvidia.com/gpu") == "2")
        # the kubelet holds one GPU only (its device manager is catching up): one is published, and
        # the second as soon as it holds it, within the publisher's republish_s
        rig.pods.on_allocatable = lambda: {"nvidia.com/gpu": ["GPU-fake-0000"]}
        rig.node_api.set_allocatable({"nvidia.com/gpu": 0})
        assert await _until(lambda: rig.node_api.allocatable.get("nvidia.com/gpu") == "1")
        rig.pods.on_allocatable = holds
        assert await _until(lambda: rig.node_api.allocatable.get("nvidia.com/gpu") == "2")
        # the allocatable alone lower, or the capacity alone (each a Node update the watch sees)
        for field in (rig.node_api.allocatable, rig.node_api.capacity):
            field["nvidia.com/gpu"] = "1"
            rig.node_api.set_annotations({})  # (a no-op patch: the node's watchers get the node as it is)
            assert await _until(lambda: rig.node_api.allocatable == rig.node_api.capacity == {"nvidia.com/gpu": "2"})
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def _until(condition: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_device_lists_refused_without_a_plan_are_reported_and_not_retried_at_once():
    """Lists the plugin refuses leave the kubelet with the last ones (a destroyed device still
    listed, a new one missing): a serving failure, reported in the status and logged, with a plan
    or without one; with no plan to acknowledge, the pass waits for nothing (no pass every retry_s).
    BUG found by mutation testing (agent/loop.py `_serve`): without a plan the refusal was in no
    error and set the agent waiting (passes every retry_s); fixed there (raised as a serving failure)."""
    rig = make_rig(mig_enabled=False, **ROUND_80GIB).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent()

    async def refuse(lists: object) -> None:
        raise DeviceListError("GPU(s) advertised both whole and sliced: GPU-fake-0001")

    rig.plugins.update = refuse  # type: ignore[method-assign]
    report = await agent.reconcile_once()
    assert report.waiting == [] and not agent._waiting
    assert report.errors == ["serving the devices: the device plugin refused the device lists: GPU(s) advertised both "
                             "whole and sliced: GPU-fake-0001"]
    assert rig.node_api.annotations[STATUS_ERROR] == report.errors[0]


async def test_an_agent_started_on_a_mig_node_stops_the_mps_daemon_left_running_once_no_pod_needs_it(tmp_path):
    """The MPS daemon runs in the mps-control pod and outlives the agent's restarts: an agent
    started on a node now in MIG mode stops it, but only once no pod holds an MPS slice."""
    import json
    import time

    from dynpart.agent.mps_daemon import SupervisedMpsDaemon

    control = tmp_path / "mps-control"
    control.mkdir()
    was = {"gpus": ["GPU-fake-0000"], "pipe_dir": "/p", "log_dir": "/l"}
    (control / "desired.json").write_text(json.dumps({"seq": 1, **was}))

    def supervisor_says_running() -> None:
        (control / "state.json").write_text(json.dumps({"seq": 1, **was, "running": True, "busy": False,
                                                        "error": None, "at": time.time()}))
    supervisor_says_running()
    rig = make_rig(**ROUND_80GIB).with_plugins()
    agent = rig.agent(mps_daemon=SupervisedMpsDaemon(str(control), wait_s=0.2), withdraw_settle_s=0)
    rig.pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")  # an MPS pod still runs
    rig.node_api.set_annotations(mig_spec({1: ["7g.80gb@0"]}, plan="p1"))
    await agent.reconcile_once()
    assert json.loads((control / "desired.json").read_text())["gpus"] == ["GPU-fake-0000"], "kept for its client"
    rig.pods.release("ns/a")
    supervisor_says_running()
    await agent.reconcile_once()
    desired = json.loads((control / "desired.json").read_text())
    assert desired["gpus"] == [] and desired["seq"] == 2, "asked to stop"


def test_the_fake_kubelets_status_write_counts_unhealthy_devices_in_capacity_only():
    """As the kubelet's GetCapacity: allocatable the healthy devices, capacity all (helper-151)."""
    from dynpart.agent.kube import FakeNodeApi

    api = FakeNodeApi("node-1")
    api.set_allocatable({"nvidia.com/gpu": 2}, unhealthy={"nvidia.com/gpu": 1, MIG_1G: 1})
    assert api.allocatable == {"nvidia.com/gpu": "2", MIG_1G: "0"}
    assert api.capacity == {"nvidia.com/gpu": "3", MIG_1G: "1"}
