"""A GPU driver that is slow or stops answering (a GPU fallen off the bus, a wedged driver: NVML
calls take seconds or never return): the agent's event loop never waits on it. Every driver call
runs on the driver's own thread (`AsyncDriver`); the kubelet's Allocate is answered meanwhile, a
call that does not return in time reports every GPU unhealthy and later calls fail at once
instead of queueing; liveness fails when the event loop is blocked, not while a pass is long or
the driver hangs (restarting the agent cannot cure a driver, and would end the MPS clients)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future

import grpc
import pytest

from dynpart.agent.deviceplugin import protocol
from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import NOT_RESPONDING, DriverNotResponding, GpuDriver
from dynpart.agent.driver.threaded import AsyncDriver
from dynpart.agent.loop import Agent, health_and_instances
from dynpart.annotations import STATUS_ERROR, STATUS_UNHEALTHY
from dynpart.probing import Liveness

from .conftest import H100, Rig, make_rig, mig_spec
from .test_agent_plugin import PluginRig, _rig

MIG_1G = "nvidia.com/mig-1g.10gb"
# If a hung call blocked the test's own event loop (the defect these tests catch), the driver
# answers again after this long, so that the test fails on its assertions instead of hanging.
SAFETY_S = 3.0


@pytest.fixture
async def rig() -> AsyncIterator[PluginRig]:
    async for r in _rig():
        yield r


@pytest.fixture
def hang() -> Iterator[Callable[[FakeNvml], None]]:
    """`hang(driver)`: the driver stops answering (`FakeNvml.hang`), and answers again after
    SAFETY_S whatever happens, and at the end of the test."""
    hung: list[tuple[FakeNvml, threading.Timer]] = []

    def hang_for_a_while(driver: FakeNvml) -> None:
        driver.hang()
        timer = threading.Timer(SAFETY_S, driver.unhang)
        timer.daemon = True
        timer.start()
        hung.append((driver, timer))

    yield hang_for_a_while
    for driver, timer in hung:
        timer.cancel()
        driver.unhang()


async def until(predicate: Callable[[], object], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


def allocate_from_another_process(socket_path: str, device: str) -> float:
    """Seconds the plugin took to answer an Allocate made as the kubelet makes it: over gRPC from
    outside the agent's event loop (here, another thread with a blocking channel)."""
    msgs = protocol.messages()
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(protocol.ALLOCATE, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=msgs["AllocateResponse"].FromString)
        started = time.monotonic()
        call(msgs["AllocateRequest"](container_requests=[msgs["ContainerAllocateRequest"](devices_ids=[device])]),
             timeout=10)
        return time.monotonic() - started


# --- AsyncDriver ---------------------------------------------------------------------------------


async def test_driver_calls_run_in_order_on_one_thread_off_the_event_loop():
    fake = FakeNvml(H100, 2)
    driver = AsyncDriver(fake)
    seen: list[tuple[int, int]] = []  # (call number, thread)

    def note(_driver: FakeNvml, n: int) -> None:
        seen.append((n, threading.get_ident()))

    fake.before_op = lambda op: seen.append((-1, threading.get_ident()))
    await asyncio.gather(*(driver.read(note, n) for n in range(20)), driver.create_gpu_instance(0, 19, 0, 1))
    await driver.devices()
    assert [n for n, _ in seen] == [*range(20), -1]  # in the order made, the change too
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_every_driver_call_can_be_awaited():
    """Each GpuDriver method has its coroutine in AsyncDriver, so that no caller on the event loop
    is tempted to make it directly."""
    wanted = {n for n in vars(GpuDriver) if not n.startswith("_")}
    assert wanted and all(inspect.iscoroutinefunction(getattr(AsyncDriver, n, None)) for n in wanted)


async def test_a_call_that_does_not_return_fails_in_time_and_later_calls_fail_at_once(hang):
    fake = FakeNvml(H100, 2)
    driver = AsyncDriver(fake, read_limit_s=0.2)
    answered: list[float] = []
    driver.on_answer = lambda: answered.append(time.monotonic())
    hang(fake)
    started = time.monotonic()
    with pytest.raises(DriverNotResponding, match=r"did not answer devices\(\) within 0.2 s") as hung:
        await driver.devices()
    assert hung.value.code == NOT_RESPONDING and 0.2 <= time.monotonic() - started < 1.0
    started = time.monotonic()
    with pytest.raises(DriverNotResponding, match=r"has not answered devices\(\) since 20\d\d-"):
        await driver.gpu_instances(0)  # not queued behind the stuck call: not made at all
    assert time.monotonic() - started < 0.1 and fake.hung_calls == 1
    assert len(answered) == 2  # each ends the pass's wait: progress for its liveness
    fake.unhang()
    assert await until(lambda: fake.hung_calls == 0)
    assert [d.index for d in await driver.devices()] == [0, 1]  # answers again


async def test_a_change_given_up_on_while_it_waited_is_never_made(hang):
    """A change queued behind a read that hangs, whose caller gave up on it, must not be made
    when the driver answers again: the pass that asked for it has reported it failed."""
    fake = FakeNvml(H100, 1)
    driver = AsyncDriver(fake, read_limit_s=0.3, change_limit_s=0.1)
    hang(fake)
    reading = asyncio.create_task(driver.devices())
    assert await until(lambda: fake.hung_calls == 1)
    with pytest.raises(DriverNotResponding):
        await driver.create_gpu_instance(0, 19, 0, 1)
    with pytest.raises(DriverNotResponding):
        await reading
    fake.unhang()
    assert await until(lambda: fake.hung_calls == 0)
    await driver.devices()  # (after the read the thread was in: the change would have come first)
    assert fake.ops == [] and fake.gpu_instances(0) == []


# --- the agent and the kubelet ---------------------------------------------------------------------


async def test_the_kubelet_is_answered_while_a_driver_read_hangs(rig: PluginRig, hang):
    agent = rig.agent()
    agent.driver.read_limit_s = 1.5
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    socket_path, device = rig.plugins.servers[MIG_1G].socket_path, rig.uuid_at(0, 0)

    took: list[float] = []

    def kubelet() -> None:  # admits a pod once the pass is inside a driver call that hangs
        deadline = time.monotonic() + SAFETY_S
        while rig.driver.hung_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        took.append(allocate_from_another_process(socket_path, device))

    admitting = threading.Thread(target=kubelet)
    admitting.start()
    hang(rig.driver)
    report = await agent.reconcile_once()
    await asyncio.to_thread(admitting.join)
    assert took[0] < 0.5, f"Allocate answered after {took[0]:.2f} s while the driver hung"
    assert report.failed and "did not answer devices() within 1.5 s" in report.errors[0]


async def test_a_hung_driver_reports_every_gpu_unhealthy_and_passes_do_not_queue(rig: PluginRig, hang):
    agent = rig.agent()
    agent.driver.read_limit_s = 0.3
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await rig.settle(agent, "p1")
    device = rig.uuid_at(0, 0)
    hang(rig.driver)
    started = time.monotonic()
    report = await agent.reconcile_once()
    assert time.monotonic() - started < 1.0  # the read's limit, not the driver's silence
    assert report.failed and "did not answer" in report.errors[0]
    ann = rig.node_api.annotations
    assert ann[STATUS_UNHEALTHY] == "0,1" and "did not answer" in ann[STATUS_ERROR]
    # what ListAndWatch sent: the kubelet gives the device to no new pod
    await rig.kubelet.wait_for_devices(MIG_1G, [(device, protocol.UNHEALTHY)])
    started = time.monotonic()
    report = await agent.reconcile_once()  # the stuck call still runs: this pass fails at once
    assert time.monotonic() - started < 0.2 and report.failed and "has not answered" in report.errors[0]
    assert rig.driver.hung_calls == 1  # nothing queued behind it
    # while it stays silent, each pass reports the same words: no Node write every pass (a GPU off
    # the bus stays so until the node is rebooted)
    writes = [e for e in rig.node_api.events if e[0] == "annotations"]
    await asyncio.sleep(1.1)
    again = await agent.reconcile_once()
    assert again.failed and again.errors == report.errors
    assert [e for e in rig.node_api.events if e[0] == "annotations"] == writes
    rig.driver.unhang()
    assert await until(lambda: rig.driver.hung_calls == 0)
    report = await agent.reconcile_once()
    assert not report.failed and STATUS_UNHEALTHY not in rig.node_api.annotations
    await rig.kubelet.wait_for_devices(MIG_1G, [(device, protocol.HEALTHY)])


async def test_a_destroy_that_runs_out_of_time_is_not_advertised_again(rig: PluginRig):
    """A change the driver did not answer in time may still happen: the device it destroys stays
    withdrawn (no pod may get it), and the pass stops there."""
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p1"))
    await rig.settle(agent, "p1")
    kept, doomed = rig.uuid_at(0, 0), rig.uuid_at(0, 1)
    rig.driver.ops.clear()
    agent.driver.change_limit_s = 0.2
    rig.driver.change_delay_s = 0.5  # the destroy is made, after its limit
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p2"))
    report = await agent.reconcile_once()
    assert report.failed and "destroy_compute_instance(0" in report.errors[0]
    assert [op.op for op in rig.driver.ops] == []  # (not yet)
    await rig.kubelet.wait_for_devices(MIG_1G, [(kept, protocol.UNHEALTHY)])
    assert doomed in rig.plugins.withdrawn
    rig.driver.change_delay_s = 0.0
    assert await until(lambda: [op.op for op in rig.driver.ops] == ["destroy_ci"])
    await rig.settle(agent, "p2")
    assert rig.driver.layout(0) == [("1g.10gb", 0)] and rig.kubelet.admission_errors == []
    await rig.kubelet.wait_for_devices(MIG_1G, [(kept, protocol.HEALTHY)])


# --- liveness --------------------------------------------------------------------------------------


class ScaledLiveness(Liveness):
    """The pass-progress limit (`reconcile loop`) divided by `scale`, so that a test can show in
    a second what takes minutes on a node; the event-loop limit is the agent's `loop_stall_s`."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.samples: list[str] = []  # what /healthz said each time it was asked and failed

    def expect(self, name: str, max_age_s: float) -> None:
        super().expect(name, max_age_s / self.scale if name == "reconcile loop" else max_age_s)

    def probe_from_another_thread(self, every_s: float = 0.005) -> threading.Event:
        """As the kubelet's probe: /healthz is answered from another thread. Set the event to stop."""
        done = threading.Event()

        def probe() -> None:
            while not done.wait(every_s):
                self.samples += self.stale()

        threading.Thread(target=probe, daemon=True).start()
        return done


async def run_for(agent: Agent, until_done: Callable[[], object], timeout_s: float) -> float:
    """agent.run() until `until_done()` is true; returns how long that took."""
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    started = time.monotonic()
    try:
        assert await until(until_done, timeout_s), "did not happen in time"
        return time.monotonic() - started
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)


def liveness_rig(scale: float) -> tuple[Rig, Agent, ScaledLiveness]:
    rig = make_rig(count=1)
    liveness = ScaledLiveness(scale)
    agent = rig.agent(liveness=liveness, interval_s=0.05)
    agent.loop_beat_s, agent.loop_stall_s = 0.01, 0.5
    return rig, agent, liveness


async def test_liveness_holds_through_a_long_pass_that_makes_progress():
    """Re-carving 8 GPUs is hundreds of driver calls of up to seconds each: a pass can take longer
    than the pass-progress limit and must not fail the probe while its calls return."""
    rig, agent, liveness = liveness_rig(scale=600)  # the limit (minutes) becomes 0.3 s
    rig.driver.change_delay_s = 0.05
    rig.node_api.set_annotations(mig_spec({0: [f"1g.10gb@{s}" for s in range(7)]}))
    probing = liveness.probe_from_another_thread()
    took = await run_for(agent, lambda: len(rig.driver.layout(0)) == 7, 10)
    probing.set()
    assert took > 0.5 and liveness.samples == []


async def test_liveness_fails_when_the_event_loop_is_blocked():
    rig, agent, liveness = liveness_rig(scale=1)
    agent.loop_stall_s = 0.3
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        assert await until(lambda: rig.node_api.annotations.get("dynpart.io/status-mode"))
        assert liveness.stale() == []
        time.sleep(0.6)  # something on the loop does not return: nothing else on it runs
        stale = liveness.stale()
        assert [s.split(":")[0] for s in stale] == ["event loop"]
        await asyncio.sleep(0.05)
        assert liveness.stale() == []  # it turns again
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)


async def test_the_agent_is_ready_only_once_its_first_pass_has_ended():
    """/readyz (the chart's readiness probe, which a rolling update waits for): not while the
    agent starts or its first pass runs (a version that hangs there stops the roll at the first
    node), then from the end of that pass on."""
    rig, agent, liveness = liveness_rig(scale=1)
    rig.driver.change_delay_s = 0.05
    rig.node_api.set_annotations(mig_spec({0: [f"1g.10gb@{s}" for s in range(7)]}))
    assert liveness.ready is False
    seen_during: list[bool] = []
    create = rig.driver.create_gpu_instance

    def creating(*args: object) -> int:  # (inside the first pass)
        seen_during.append(liveness.ready)
        return create(*args)  # type: ignore[arg-type]
    rig.driver.create_gpu_instance = creating  # type: ignore[method-assign]
    await run_for(agent, lambda: liveness.ready, 10)
    assert seen_during and not any(seen_during[:7]) and len(rig.driver.layout(0)) == 7


async def test_a_hung_driver_does_not_fail_liveness(hang):
    """Restarting the agent cannot cure a driver that does not answer (and, with the MPS daemon in
    its own container, would end it with its clients): the status says what is wrong, the probe
    stays OK."""
    rig, agent, liveness = liveness_rig(scale=200)  # the pass-progress limit becomes 0.3 s
    agent.driver.read_limit_s = agent.driver.change_limit_s = 0.1
    await agent.reconcile_once()  # (the GPUs read once, before the driver stops answering)
    hang(rig.driver)
    probing = liveness.probe_from_another_thread()
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(1.0)  # pass after pass fails fast while the driver stays silent
    stop.set()
    await asyncio.wait_for(running, 5)
    probing.set()
    assert rig.node_api.annotations.get(STATUS_UNHEALTHY) == "0"
    assert rig.driver.hung_calls == 1 and liveness.samples == []


# --- a slow driver is not a stuck one ------------------------------------------------------------


async def test_a_batch_of_reads_longer_than_the_limit_is_not_stuck_while_its_calls_return():
    """A read limit is how long the driver may go without answering, not how long a batch of reads
    may take: on 8 carved GPUs a slow but healthy driver answers hundreds of NVML calls in more
    than the limit, and that must not report every GPU unhealthy."""
    fake = FakeNvml(H100, 8)
    driver = AsyncDriver(fake, read_limit_s=0.2)
    beats: list[float] = []
    driver.on_answer = lambda: beats.append(time.monotonic())
    devices = await driver.devices()
    fake.read_delay_s = 0.05  # each read: 16 of them, 0.8 s in all, each well within the limit
    started = time.monotonic()
    read = await driver.read(health_and_instances, devices)
    assert time.monotonic() - started > 0.6 and [problem for problem, _ in read] == [None] * 8
    assert len(beats) >= 3  # the pass's liveness beats while the batch goes on, not only at its end


async def test_a_batch_that_stops_answering_fails_its_limit_after_its_last_answer(hang):
    fake = FakeNvml(H100, 2)
    driver = AsyncDriver(fake, read_limit_s=0.3)
    fake.read_delay_s = 0.1
    answered: list[float] = []

    def batch(d: GpuDriver) -> None:
        for _ in range(5):  # 0.5 s of answers: longer than the limit
            d.devices()
        answered.append(time.monotonic())
        hang(fake)
        d.devices()

    with pytest.raises(DriverNotResponding, match=r"did not answer batch\(\) within 0.3 s"):
        await driver.read(batch)
    assert 0.25 <= time.monotonic() - answered[0] < 0.6  # the limit from its last answer, not from its start
    with pytest.raises(DriverNotResponding, match=r"has not answered batch\(\)"):
        await driver.devices()  # the stuck batch is in the way: not queued behind it
    fake.unhang()
    assert await until(lambda: fake.hung_calls == 0)


async def test_a_slow_driver_keeps_the_gpus_healthy_on_a_node_of_8_carved_gpus():
    rig = make_rig(count=8).with_plugins()
    agent = rig.agent()
    rig.node_api.set_annotations(mig_spec({i: [f"1g.10gb@{s}" for s in range(7)] for i in range(8)}, plan="p1"))
    report = await agent.reconcile_once()
    assert not report.failed, report.errors
    agent.driver.read_limit_s = 0.25
    rig.driver.read_delay_s = 0.02  # the pass's batches of reads each take longer than the limit
    report = await agent.reconcile_once()
    assert not report.failed, report.errors
    assert STATUS_UNHEALTHY not in rig.node_api.annotations and agent.unhealthy == {}


async def test_a_call_given_up_on_as_the_thread_takes_it_is_still_known_stuck(hang, monkeypatch):
    """The caller's limit can end while the driver's thread is between taking the call and
    marking it running: the call must still be the one known stuck, or the next call would queue
    behind it and wait its whole limit."""
    original = Future.set_running_or_notify_cancel

    def slow_to_mark(self: Future) -> bool:  # the thread descheduled right after taking the call
        took = original(self)
        if threading.current_thread().name.startswith("gpu-driver"):
            time.sleep(0.4)
        return took
    monkeypatch.setattr(Future, "set_running_or_notify_cancel", slow_to_mark)
    fake = FakeNvml(H100, 1)
    driver = AsyncDriver(fake, read_limit_s=0.2)
    hang(fake)
    with pytest.raises(DriverNotResponding):
        await driver.devices()
    monkeypatch.undo()
    started = time.monotonic()
    with pytest.raises(DriverNotResponding, match=r"has not answered devices\(\)"):
        await driver.gpu_instances(0)
    assert time.monotonic() - started < 0.1
    assert driver.busy  # (what the agent's way out asks: a thread inside the driver)
    fake.unhang()
    assert await until(lambda: not driver.busy and fake.hung_calls == 0)
