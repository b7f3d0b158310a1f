"""The MPS pass with the agent's own device plugin (`agent/mps_plugin.py`), pinned where mutation
testing found it unpinned: which PodResources entries are the agent's held slices, the held slices
made live again after a restart, what counts as "other free" for a bound pod, GPUs in MIG mode or
held whole, and the MPS daemon's restarts while slices are in use."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.threaded import as_async
from dynpart.agent.guard import Released
from dynpart.agent.mig_agent import PassResult
from dynpart.agent.mps_daemon import FakeMpsDaemon, MpsDaemonBusy
from dynpart.agent.mps_plugin import MpsPluginAgent
from dynpart.agent.nodepods import FakeNodePods
from dynpart.agent.podresources import FakePodResources, PodResourcesError
from dynpart.annotations import decode_status

from .conftest import H100, ROUND_80GIB, Rig, make_rig, mps_spec

TEN = "nvidia.com/gpu-10gb"
FORTY = "nvidia.com/gpu-40gb"


def mps_rig(count: int = 2) -> Rig:
    return make_rig(H100, count, mig_enabled=False, **ROUND_80GIB).with_plugins()


def advertised(rig: Rig) -> dict[str, list[str]]:
    assert rig.plugins is not None
    return {r: sorted(d.id for d in ds) for r, ds in rig.plugins.advertised().items() if ds}


def withdrawals(rig: Rig) -> list[str]:
    """Every device id the agent's plugin is asked to withdraw, in order."""
    assert rig.plugins is not None
    seen: list[str] = []
    real = rig.plugins.withdraw

    async def withdraw(*ids: str) -> set[str]:
        seen.extend(ids)
        return await real(*ids)

    rig.plugins.withdraw = withdraw  # type: ignore[method-assign]
    return seen


def direct(count: int = 1, daemon: FakeMpsDaemon | None = None) -> tuple[FakeNvml, FakePodResources, MpsPluginAgent]:
    """The MPS pass alone (no guard, no plugin): what it keeps, lists and runs the daemon for."""
    driver = FakeNvml(H100, count, mig_enabled=False, **ROUND_80GIB)
    pods = FakePodResources()
    return driver, pods, MpsPluginAgent(driver, pods, 80, daemon=daemon)


def listed(result: PassResult, gpu: int) -> list[tuple[int, bool]]:
    """GPU `gpu`'s slices as the pass reports them, (size, used), largest first (the order of the
    list is no behaviour: every reader sorts or counts)."""
    return sorted(((s.size, s.used) for g in result.gpus if g.index == gpu for s in g.mps), reverse=True)


# --- which PodResources entries are held slices ----------------------------------------------------


async def test_a_slice_held_on_a_gpu_the_driver_no_longer_lists_is_ignored():
    """A GPU that fell off the bus leaves its pods' assignments in PodResources: they are no slice
    of this node, so they neither list a slice nor keep the MPS daemon running."""
    daemon = FakeMpsDaemon()
    _, pods, mps = direct(daemon=daemon)
    pods.assign("ns/gone", TEN, "GPU-lost-9999::0")
    result = await mps.apply(None)
    assert listed(result, 0) == [] and not any(mps.live.values())
    assert daemon.starts == [] and mps.healthy


async def test_an_mps_resource_id_without_a_slice_number_is_not_a_slice_nor_a_whole_gpu():
    """The agent's slices are `<GPU UUID>::<n>`; an id of another shape under a `gpu-<N>gb` name
    (no plugin of the agent's gave it) must not fail every pass, nor hold the GPU whole (only
    `nvidia.com/gpu` does)."""
    _, pods, mps = direct()
    pods.assign("ns/odd", TEN, "GPU-fake-0000")
    result = await mps.apply({0: [40, 40]})
    assert listed(result, 0) == [(40, False), (40, False)]
    assert not any("held whole" in e for e in result.errors), result.errors


async def test_an_agent_restarted_without_an_applicable_spec_still_advertises_the_held_slices():
    """After a restart with a spec it may not apply (a deposed planner's, a malformed one), the pass
    only observes: the slices pods hold are still its slices (PodResources), listed used, and
    the GPU is not advertised whole meanwhile (the kubelet would give it to another pod)."""
    rig = mps_rig(1)
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10, 10]}, plan="m1"))
    await rig.agent().reconcile_once()
    held = advertised(rig)[TEN][1]
    rig.pods.assign("ns/a", TEN, held)
    rig.node_api.set_annotations({"dynpart.io/spec-plan": None})  # no plan id: refused, observe only
    rig.plugins = None
    rig.with_plugins()  # a new agent process: its plugin starts empty
    report = await rig.agent().reconcile_once()
    assert any("refused" in e for e in report.errors), report.errors
    # (helper-143: the free slices the last agent served stay listed too, renumbered around the held
    # one: a pod bound for one may be admitted before a pass may change them, through the guard)
    ads = advertised(rig)
    assert held in ads[TEN] and "nvidia.com/gpu" not in ads
    assert sorted(len(v) for v in ads.values()) == [1, 1, 2]
    status = decode_status(rig.node_api.annotations, H100, capacity=80)
    assert sorted((s.size, s.used) for s in status.layout.gpus[0].mps) == [(10, False), (10, True), (20, False),
                                                                            (40, False)]


# --- what counts as other free for a bound pod ------------------------------------------------------


async def test_a_slice_a_bound_pod_needs_is_not_withdrawn_when_the_other_one_is_held():
    """A bound pod waiting for a 10gb slice needs the free one: a held 10gb slice is no "other
    free" slice for it. The needed slice is kept before any withdrawal (withdrawn, the kubelet
    admitting that pod meanwhile finds none: UnexpectedAdmissionError)."""
    rig = mps_rig(1)
    node_pods = FakeNodePods()
    agent = rig.agent(node_pods=node_pods, withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10, 10]}, plan="m1"))
    await agent.reconcile_once()
    held, free = advertised(rig)[TEN]
    rig.pods.assign("ns/a", TEN, held)
    node_pods.bind("ns/w", {TEN: 1})
    gone = withdrawals(rig)
    rig.node_api.set_annotations({**mps_spec({0: [40, 40]}, plan="m2"), "dynpart.io/spec-gpu-0-10gb": None,
                                  "dynpart.io/spec-gpu-0-20gb": None})
    report = await agent.reconcile_once()
    assert any(f"MPS slice {free} kept for pod(s) ns/w" in e and "0 other free" in e for e in report.errors), report.errors
    assert free not in gone and held not in gone
    assert advertised(rig)[TEN] == sorted([held, free])


# --- GPUs in MIG mode, GPUs held whole -------------------------------------------------------------


async def test_a_gpu_now_in_mig_mode_lists_no_slice_when_none_is_held():
    """Slices of a GPU that entered MIG mode are gone (it has MIG devices now): an observe-only
    pass must not report them to the planner as free slices to plan pods on."""
    driver, _, mps = direct(2)
    await mps.apply({0: [40, 40], 1: [40]})
    driver.set_mig_mode(0, True)
    result = await mps.apply(None)
    assert listed(result, 0) == [] and mps.view(0) == ((), ())
    assert listed(result, 1) == [(40, False)]


async def test_a_slice_held_on_a_gpu_now_in_mig_mode_stays_listed_used():
    """A pod still holds a slice of a GPU that entered MIG mode: the slice stays listed, used,
    so no plan counts that GPU free until the pod ends."""
    driver, pods, mps = direct(2)
    await mps.apply({0: [40, 40], 1: [40]})
    pods.assign("ns/a", FORTY, "GPU-fake-0000::0")
    driver.set_mig_mode(0, True)
    result = await mps.apply({1: [40]})
    assert listed(result, 0) == [(40, True)] and mps.view(0) == ((40,), (0,))
    pods.release("ns/a")
    result = await mps.apply({1: [40]})
    assert listed(result, 0) == []


async def test_a_gpu_held_whole_or_in_mig_mode_is_never_withdrawn_for_slices():
    """The spec asks slices on a GPU a pod holds whole and on one in MIG mode: neither is sliced,
    and neither is even withdrawn (a whole GPU withdrawn while its pod runs leaves the node's
    count, and without the agent's plugin nothing would re-check it before slicing)."""
    rig = mps_rig(3)
    rig.driver.set_mig_mode(2, True)
    rig.pods.assign("ns/whole", "nvidia.com/gpu", "GPU-fake-0001")
    gone = withdrawals(rig)
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40], 2: [80]}))
    report = await rig.agent().reconcile_once()
    assert gone == ["GPU-fake-0000"]  # GPU 0 only: it becomes sliced
    assert not any("was taken" in e for e in report.errors), report.errors
    assert advertised(rig)["nvidia.com/gpu"] == ["GPU-fake-0001"]


async def test_a_gpu_in_mig_mode_or_held_whole_the_spec_leaves_alone_is_no_error():
    """Only a spec that asks slices on such a GPU is refused with an error: one that leaves it
    alone (as leaving MPS mode does, `apply({})`) reports nothing, or the status would carry a
    false error on every pass."""
    driver, pods, mps = direct(3)
    driver.set_mig_mode(2, True)
    pods.assign("ns/whole", "nvidia.com/gpu", "GPU-fake-0001")
    result = await mps.apply({0: [40, 40], 1: [], 2: []})
    assert result.errors == [] and listed(result, 0) == [(40, False), (40, False)]
    assert (await mps.apply({})).errors == []


# --- whole GPUs becoming sliced, what the guard withdraws ------------------------------------------


async def test_a_pass_that_changes_nothing_withdraws_nothing():
    """Slices that stay and a GPU that stays whole are not removed devices: withdrawing them each
    pass would hide them from the kubelet (pods it admits meanwhile fail) for nothing."""
    rig = mps_rig(2)
    agent = rig.agent(withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 20]}, plan="m1"))
    await agent.reconcile_once()
    before = advertised(rig)
    gone = withdrawals(rig)
    report = await agent.reconcile_once()
    assert report.plan_id == "m1" and report.errors == []
    assert gone == [] and advertised(rig) == before


async def test_a_gpu_a_bound_pod_needs_whole_is_kept_whole_and_never_withdrawn():
    """Both GPUs are to be sliced while a pod bound for one whole GPU waits: one GPU stays whole
    for it, and is never withdrawn (its admission during the withdrawal would fail); the other is
    sliced."""
    rig = mps_rig(2)
    node_pods = FakeNodePods()
    agent = rig.agent(node_pods=node_pods, withdraw_settle_s=0)
    await agent.reconcile_once()
    assert advertised(rig) == {"nvidia.com/gpu": ["GPU-fake-0000", "GPU-fake-0001"]}
    node_pods.bind("ns/w", {"nvidia.com/gpu": 1})
    gone = withdrawals(rig)
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40]}, plan="m1"))
    report = await agent.reconcile_once()
    assert gone == ["GPU-fake-0000"]
    assert any(e.startswith("GPU 1 (whole) kept for pod(s) ns/w") for e in report.errors), report.errors
    assert advertised(rig) == {"nvidia.com/gpu": ["GPU-fake-0001"], FORTY: ["GPU-fake-0000::0", "GPU-fake-0000::1"]}


async def test_a_whole_gpu_is_sliced_when_another_free_one_is_left_for_the_bound_pod():
    """A whole GPU that stays free counts as "other free" for a pod bound for `nvidia.com/gpu`:
    with one left for it, the GPU the spec slices is sliced (not kept whole for nothing)."""
    rig = mps_rig(3)
    node_pods = FakeNodePods()
    agent = rig.agent(node_pods=node_pods, withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 40]}, plan="m1"))
    await agent.reconcile_once()
    node_pods.bind("ns/w", {"nvidia.com/gpu": 1})
    rig.node_api.set_annotations(mps_spec({0: [40, 40], 1: [40, 40]}, plan="m2"))
    report = await agent.reconcile_once()
    assert report.errors == [] and report.plan_id == "m2"
    assert advertised(rig) == {"nvidia.com/gpu": ["GPU-fake-0002"],
                               FORTY: ["GPU-fake-0000::0", "GPU-fake-0000::1", "GPU-fake-0001::0", "GPU-fake-0001::1"]}


async def test_a_free_slice_is_dropped_when_another_free_one_is_left_for_the_bound_pod():
    """A pod bound for a 10gb slice needs one free 10gb slice: with two free, the one the spec
    drops goes (it is not kept for nothing)."""
    rig = mps_rig(1)
    node_pods = FakeNodePods()
    agent = rig.agent(node_pods=node_pods, withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10, 10]}, plan="m1"))
    await agent.reconcile_once()
    node_pods.bind("ns/w", {TEN: 1})
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 10]}, plan="m2"))
    report = await agent.reconcile_once()
    assert report.errors == [] and report.plan_id == "m2"
    assert advertised(rig)[TEN] == ["GPU-fake-0000::2"]


async def test_a_slice_taken_during_its_withdrawal_stays_and_the_plan_is_recomputed_around_it():
    """The kubelet gave a slice to a pod just before it read the withdrawal: that slice stays
    (advertised again, its number kept) and the rest of the GPU is planned around it; the other
    withdrawn slice goes, and nothing is cut beyond the GPU's memory."""
    rig = mps_rig(1)
    agent = rig.agent(withdraw_settle_s=0)
    rig.node_api.set_annotations(mps_spec({0: [40, 20, 20]}, plan="m1"))
    await agent.reconcile_once()
    assert advertised(rig)["nvidia.com/gpu-20gb"] == ["GPU-fake-0000::1", "GPU-fake-0000::2"]
    assert rig.plugins is not None
    withdraw = rig.plugins.withdraw

    async def taken(*ids: str) -> set[str]:
        unconfirmed = await withdraw(*ids)
        rig.pods.assign("ns/late", "nvidia.com/gpu-20gb", "GPU-fake-0000::2")
        return unconfirmed

    rig.plugins.withdraw = taken  # type: ignore[method-assign]
    rig.node_api.set_annotations({**mps_spec({0: [40, 40]}, plan="m2"), "dynpart.io/spec-gpu-0-20gb": None})
    report = await agent.reconcile_once()
    assert any("MPS slice GPU-fake-0000::2 was taken (pod ns/late) just before it was to be removed; kept" in e
               for e in report.errors), report.errors
    assert advertised(rig) == {FORTY: ["GPU-fake-0000::0"], "nvidia.com/gpu-20gb": ["GPU-fake-0000::2"]}
    assert rig.plugins.withdrawn == set() and rig.plugins.sealed == set()
    rig.plugins.withdraw = withdraw  # type: ignore[method-assign]
    report = await agent.reconcile_once()  # the next pass sees it held
    status = decode_status(rig.node_api.annotations, H100, capacity=80)
    assert [(s.size, s.used) for s in status.layout.gpus[0].mps] == [(40, False), (20, True)]


# --- a GPU gone from the driver, the MPS daemon's restarts ---------------------------------------


class TakenDuringWithdrawal:
    """A guard whose re-check finds `taken` in use (the kubelet gave it to a pod meanwhile)."""

    def __init__(self, taken: str):
        self.taken = taken

    async def keep(self, candidates: Mapping[str, str], free: Mapping[str, Iterable[str]]) -> dict[str, str]:
        return {}

    async def release(self, candidates: Mapping[str, str], free: Mapping[str, Iterable[str]] | None = None) -> Released:
        ids = list(candidates)
        return Released(destroyable=[i for i in ids if i != self.taken],
                        in_use={self.taken: ["pod ns/late"]} if self.taken in ids else {})


async def test_a_gpu_gone_from_the_driver_does_not_fail_the_replan_around_a_slice_taken_meanwhile():
    """GPU 1 is no longer enumerated in the pass in which a GPU 0 slice is taken during its
    withdrawal: the plan made again around the taken slice skips the GPU that is gone."""
    driver = FakeNvml(H100, 2, mig_enabled=False, **ROUND_80GIB)
    guard = TakenDuringWithdrawal("GPU-fake-0000::2")
    mps = MpsPluginAgent(driver, FakePodResources(), 80, guard=guard)  # type: ignore[arg-type]
    await mps.apply({0: [40, 20, 20], 1: [40]})
    mps.driver = as_async(FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB))
    result = await mps.apply({0: [40, 40]})
    assert any("MPS slice GPU-fake-0000::2 was taken (pod ns/late)" in e for e in result.errors), result.errors
    assert mps.view(0) == ((40, 20), (0, 2)) and mps.view(1) == ((), ())


async def test_slices_of_a_gpu_the_driver_stops_listing_are_forgotten_without_failing_the_pass():
    """NVML started again after a GPU fell off the bus no longer lists it: its slices are gone
    (nothing to advertise, nothing to withdraw), the other GPUs' stay, and the pass goes on."""
    driver, pods, mps = direct(2)
    await mps.apply({0: [40, 40], 1: [20, 20]})
    pods.assign("ns/a", FORTY, "GPU-fake-0000::1")
    mps.driver = as_async(FakeNvml(H100, 1, mig_enabled=False, **ROUND_80GIB))  # GPU 1 no longer enumerated
    result = await mps.apply({0: [40, 40], 1: [20, 20]})
    assert [g.index for g in result.gpus] == [0] and listed(result, 0) == [(40, True), (40, False)]
    assert mps.view(1) == ((), ())
    assert any("the spec has GPU 1 but this node has GPUs 0" in e for e in result.errors), result.errors


async def test_the_daemon_is_restarted_for_new_gpus_when_only_other_devices_are_held():
    """A pod holding a time-sliced `nvidia.com/gpu` replica (`<uuid>::<n>`, NVIDIA's plugin,
    from before the node was handed to dynpart), or a device under a `gpu-<N>gb` name that is no
    `<uuid>::<n>` slice of the agent's, is no client of this daemon: it does not hold the daemon
    back from a change of GPUs (only the agent's MPS slices in use do)."""
    daemon = FakeMpsDaemon()
    driver, pods, mps = direct(3, daemon=daemon)
    pods.assign("ns/old", "nvidia.com/gpu", "GPU-fake-0002::3")
    pods.assign("ns/odd", TEN, "GPU-fake-0002")
    await mps.apply({0: [40], 1: [20]})
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001", "GPU-fake-0002")]
    driver.set_mig_mode(1, True)  # GPU 1 leaves MPS
    result = await mps.apply({0: [40]})
    assert daemon.starts[-1] == ("GPU-fake-0000", "GPU-fake-0002") and daemon.running
    assert mps.healthy and all(mps.serves(f"GPU-fake-000{i}") for i in range(3))
    assert not any("not restarted" in e for e in result.errors), result.errors


async def test_an_agent_restarted_while_pods_hold_slices_runs_the_daemon():
    """A new agent process (no daemon started by it yet) finds slices in use: it runs the daemon
    for the node's GPUs as any first pass does, and the slices are served (not a pass that fails
    for ever on the daemon it has not started)."""
    daemon = FakeMpsDaemon()
    _, pods, mps = direct(2, daemon=daemon)
    pods.assign("ns/a", FORTY, "GPU-fake-0000::1")
    result = await mps.apply({0: [40, 40]})
    assert listed(result, 0) == [(40, True), (40, False)] and result.errors == []
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] and mps.healthy and mps.serves("GPU-fake-0000")


async def test_a_gpu_the_daemon_does_not_run_for_is_said_unhealthy_only_once_it_has_slices():
    """GPU 2 leaves MIG mode while pods use slices: the daemon is not restarted for it (the pods'
    CUDA contexts), so its slices cannot be served; the status says so once it has slices, not
    before (a GPU without slices loses nothing)."""
    daemon = FakeMpsDaemon()
    driver, pods, mps = direct(3, daemon=daemon)
    driver.set_mig_mode(2, True)
    await mps.apply({0: [40, 40], 1: [40]})
    pods.assign("ns/a", FORTY, "GPU-fake-0000::0")
    driver.set_mig_mode(2, False)
    result = await mps.apply({0: [40, 40], 1: [40]})
    assert result.errors == [] and daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")]
    result = await mps.apply({0: [40, 40], 1: [40], 2: [20]})
    assert any("the MPS daemon runs for GPU-fake-0000, GPU-fake-0001 and is not restarted while pods use MPS slices: "
               "the slices of GPU-fake-0002 are listed Unhealthy" in e for e in result.errors), result.errors
    assert not mps.serves("GPU-fake-0002") and mps.serves("GPU-fake-0000")
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] and daemon.running
    pods.release("ns/a")
    result = await mps.apply({0: [40, 40], 1: [40], 2: [20]})
    assert result.errors == [] and daemon.starts[-1] == ("GPU-fake-0000", "GPU-fake-0001", "GPU-fake-0002")
    assert mps.serves("GPU-fake-0002")


async def test_a_busy_daemon_of_unknown_gpus_is_not_taken_for_one_running_for_none():
    """A daemon found running after an agent restart that does not answer (busy: its GPUs are not
    known) is kept; the next pass must not take the GPUs it was asked for as a change (none ->
    all) and, with slices in use, list every slice Unhealthy for good."""

    class BusyOnce(FakeMpsDaemon):
        busy = True

        async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
            if self.busy:
                self.busy = False
                raise MpsDaemonBusy("does not answer: kept", ())
            await super().ensure(gpu_uuids, pipe_dir, log_dir)

    daemon = BusyOnce()
    _, pods, mps = direct(2, daemon=daemon)
    pods.assign("ns/a", FORTY, "GPU-fake-0000::0")
    result = await mps.apply({0: [40, 40], 1: [40]})
    assert any("does not answer: kept" in e for e in result.errors) and not mps.healthy
    result = await mps.apply({0: [40, 40], 1: [40]})
    assert result.errors == [] and mps.healthy
    assert mps.serves("GPU-fake-0000") and mps.serves("GPU-fake-0001")


async def test_the_daemon_is_not_restarted_for_new_gpus_while_the_pods_cannot_be_read():
    """The GPUs change with no slice in use at the pass's first read, and PodResources fails at the
    read right before the restart: a pod may have got a slice since, so the daemon is not
    restarted this pass (its CUDA context would end); the next pass that reads no slice in use
    restarts it."""
    daemon = FakeMpsDaemon()
    driver, pods, mps = direct(2, daemon=daemon)
    await mps.apply({0: [40], 1: [20]})
    driver.set_mig_mode(1, True)
    first = pods.calls + 1

    def unreadable(n: int) -> None:
        if n == first + 1:
            raise PodResourcesError("kubelet PodResources API: UNAVAILABLE (kubelet restarting)")

    pods.on_list = unreadable
    await mps.apply({0: [40]})
    assert pods.calls > first and daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] and daemon.running
    pods.on_list = None
    await mps.apply({0: [40]})
    assert daemon.starts[-1] == ("GPU-fake-0000",)


async def test_the_daemon_stops_when_the_node_leaves_mps_and_starts_again_with_new_slices():
    """No slice left (the node left MPS mode): nothing needs the daemon, it is stopped; slices
    planned later start it again for the GPUs of then."""
    daemon = FakeMpsDaemon()
    _, _, mps = direct(2, daemon=daemon)
    await mps.apply({0: [40]})
    assert daemon.running
    await mps.apply({})
    await mps.stop_daemon()
    assert not daemon.running
    await mps.apply({1: [40]})
    assert daemon.running and daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] * 2
    _, _, without = direct(1)  # an agent given no daemon (tests, a node without MPS): nothing to stop
    await without.apply({0: [40]})
    await without.apply({})
    await without.stop_daemon()
