"""`AsyncDriver`: the `GpuDriver` as the agent's event loop calls it.

The loop also serves the kubelet's device-plugin calls (Allocate, ListAndWatch), the node watch
and the publisher, so it must never wait on NVML: when a GPU falls off the bus or the driver
wedges, NVML calls take seconds or never return. Every call therefore runs on one thread of the
driver's own, in the order made (NVML sees one call at a time, and `RealNvml`'s re-initialisation
after a lost GPU never runs beside another call), and the loop awaits it.

A call fails with `DriverNotResponding`, a `GpuDriverError` the agent handles as NVML failing
(every GPU reported unhealthy, every device listed Unhealthy), when the driver makes no progress
for its limit: no driver method has returned on the thread for that long. A batch of reads
(`read`: hundreds of NVML calls on a node of fully carved GPUs) may take longer than the limit on
a slow but healthy driver; it is stuck only when one of its calls is. While the call that stuck is
still running on the thread, every further call fails at once with the same error instead of
queueing behind it, so that each pass reports quickly; once it returns, calls go through again.

`start` makes the driver itself (nvmlInit, which a wedged driver may not answer either) on the
thread its calls will use; `calls_running` tells the agent's way out whether a thread is still
inside the driver (exiting normally then could hang in the library's destructors).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from dynpart.agent.driver.interface import (
    DeviceInfo,
    DriverNotResponding,
    DriverVersions,
    GpuDriver,
    GpuInstanceInfo,
    NvmlUnavailable,
    ProfileInfo,
)

T = TypeVar("T")
log = logging.getLogger("dynpart.agent.driver")

# A read answers in milliseconds on a healthy driver; the slowest legitimate one is the
# re-initialisation after a lost GPU (`RealNvml._reinit`: up to seconds per GPU without
# persistence mode). Past this the driver is taken as not answering.
READ_LIMIT_S = 30.0
# A change (create, destroy, MIG mode) takes a real driver up to seconds; enabling MIG mode on
# Ampere resets the GPU. Longer, since giving up on a change leaves its outcome unknown.
CHANGE_LIMIT_S = 120.0
# The thread ends after this long without a call and the next call starts another: an agent or a
# test that drops its driver leaves no thread behind. Calls stay in order: one thread at a time.
IDLE_S = 30.0
# nvmlInit: without persistence mode the driver sets up every GPU (seconds each); a wedged one may
# never return
START_LIMIT_S = 120.0


@dataclass
class _Call:
    what: str  # e.g. "gpu_instances(0)", for the error and the log
    run: Callable[[], Any]
    limit_s: float  # how long it may go without progress
    future: Future[Any] = field(default_factory=Future)
    started: float = 0.0  # time.monotonic() when the thread began it


# every driver thread, for `calls_running` (the agent's way out)
_THREADS: weakref.WeakSet[_DriverThread] = weakref.WeakSet()


def calls_running() -> list[str]:
    """The driver calls some thread is inside now (the process's AsyncDrivers and starts)."""
    return [c.what for c in (t.running for t in list(_THREADS)) if c is not None]


class _DriverThread:
    """One thread that makes the calls submitted to it, one after the other."""

    def __init__(self, name: str):
        self.name = name
        self.running: _Call | None = None  # the call the thread is in now
        # time.monotonic() of the thread's last progress: a call begun, or a driver method
        # returned inside a batch (`_Progressing`)
        self.progress = time.monotonic()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        _THREADS.add(self)

    def submit(self, call: _Call) -> None:
        with self._lock:
            self._calls.put(call)
            if self._thread is None:
                # a daemon: a call stuck in the driver must not keep the process from exiting
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._calls.empty():
                        self._thread = None
                        return
                continue
            # `running` before the future says so: a caller whose limit ends in between must find
            # the call it waits for, not None (it would not mark it stuck, and the next call would
            # queue behind it for its whole limit)
            call.started = self.progress = time.monotonic()
            self.running = call
            if not call.future.set_running_or_notify_cancel():
                self.running = None
                continue  # its caller gave up while it waited: never made
            try:
                result = call.run()
            except BaseException as e:  # (as asyncio.to_thread: the caller gets whatever it raised)
                self.running = None
                call.future.set_exception(e)
            else:
                self.running = None
                call.future.set_result(result)
            del call


class _Progressing:
    """The driver as a batch of reads (`AsyncDriver.read`) sees it: each of its methods that
    returns (or raises) is progress on the thread, so that a batch longer than the read limit on
    a slow driver is not taken for a stuck one."""

    def __init__(self, driver: GpuDriver, thread: _DriverThread):
        self._driver = driver
        self._thread = thread

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._driver, name)
        if not callable(attr):
            return attr
        thread = self._thread

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                thread.progress = time.monotonic()
        return call


class _NotStarted:
    """`AsyncDriver.sync` until `start` made the driver."""

    def __getattr__(self, name: str) -> Any:
        raise NvmlUnavailable("NVML not available: the GPU driver is not started yet")


class AsyncDriver:
    """`GpuDriver`'s calls as coroutines, each made on the driver's thread within a time limit
    (module doc). `sync`: the driver itself, for code that must not run on the event loop."""

    def __init__(self, driver: GpuDriver | None = None, *, read_limit_s: float = READ_LIMIT_S,
                 change_limit_s: float = CHANGE_LIMIT_S):
        # None: made by `start`, on the driver's thread
        self.sync: GpuDriver = driver if driver is not None else cast(GpuDriver, _NotStarted())
        self.read_limit_s = read_limit_s
        self.change_limit_s = change_limit_s
        # called on the event loop after each call ends (answered, failed or given up on), and while
        # a long batch makes progress: the agent's pass-progress heartbeat
        self.on_answer: Callable[[], None] | None = None
        self._thread = _DriverThread(f"gpu-driver-{id(self):x}")
        self._stuck: _Call | None = None  # the call that made no progress in time, while it runs
        self._stuck_since = ""  # when its progress stopped (UTC)

    @property
    def longest_limit_s(self) -> float:
        """The longest a call can go without progress before its caller stops waiting."""
        return max(self.read_limit_s, self.change_limit_s)

    @property
    def busy(self) -> bool:
        """Whether the driver's thread is inside a call now."""
        return self._thread.running is not None

    async def start(self, factory: Callable[[], GpuDriver], limit_s: float = START_LIMIT_S) -> None:
        """Make the driver (`factory()`: RealNvml's nvmlInit, which a wedged driver may not answer
        either) on the driver's thread, within `limit_s`, never on the event loop: the agent's
        start stays visible (its log, /healthz) and can give up. A start that has not returned
        in time fails with DriverNotResponding, and so does every later one at once while it is
        still inside the library: two inits are never made side by side. One that returns after
        its caller gave up is taken by the next try, not made again: NVML counts its inits, and
        with two its re-initialisation after a lost GPU (shutdown, init) would never take effect."""
        late = self._stuck
        if (late is not None and late.what == "nvmlInit()" and late.future.done() and not late.future.cancelled()
                and late.future.exception() is None):
            self._stuck, self.sync = None, late.future.result()
            log.info("the GPU driver answers again: nvmlInit() returned")
            return
        self.sync = await self._call(limit_s, "nvmlInit()", factory)

    # --- reads ---

    async def versions(self) -> DriverVersions:
        return await self._call(self.read_limit_s, "versions()", self.sync.versions)

    async def devices(self) -> list[DeviceInfo]:
        return await self._call(self.read_limit_s, "devices()", self.sync.devices)

    async def gpu_instances(self, index: int) -> list[GpuInstanceInfo]:
        return await self._call(self.read_limit_s, f"gpu_instances({index})", self.sync.gpu_instances, index)

    async def processes(self, index: int, gi_id: int | None = None) -> list[int]:
        return await self._call(self.read_limit_s, f"processes({index}, {gi_id})", self.sync.processes, index, gi_id)

    async def profile_info(self, index: int, nvml_name: str) -> ProfileInfo | None:
        return await self._call(self.read_limit_s, f"profile_info({index}, {nvml_name})", self.sync.profile_info,
                                index, nvml_name)

    async def gpu_instance_profiles(self, index: int) -> list[ProfileInfo]:
        return await self._call(self.read_limit_s, f"gpu_instance_profiles({index})", self.sync.gpu_instance_profiles,
                                index)

    async def possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        return await self._call(self.read_limit_s, f"possible_placements({index}, {profile_id})",
                                self.sync.possible_placements, index, profile_id)

    async def compute_mode(self, index: int) -> str:
        return await self._call(self.read_limit_s, f"compute_mode({index})", self.sync.compute_mode, index)

    async def health(self, index: int) -> str | None:
        return await self._call(self.read_limit_s, f"health({index})", self.sync.health, index)

    async def minor_number(self, index: int) -> int:
        return await self._call(self.read_limit_s, f"minor_number({index})", self.sync.minor_number, index)

    async def mig_cap_minors(self) -> dict[str, int]:
        return await self._call(self.read_limit_s, "mig_cap_minors()", self.sync.mig_cap_minors)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(driver, *args)`, reads only, made on the driver's thread as one call (e.g.
        `read_capability`: dozens of reads a healthy driver answers in milliseconds, hundreds on
        a node of carved GPUs). The read limit counts from its last driver method that returned,
        not from its start: a slow driver that keeps answering is not a stuck one."""
        driver = cast(GpuDriver, _Progressing(self.sync, self._thread))
        return await self._call(self.read_limit_s, f"{getattr(fn, '__name__', 'read')}()", fn, driver, *args)

    # --- changes ---

    async def set_mig_mode(self, index: int, enabled: bool) -> None:
        await self._call(self.change_limit_s, f"set_mig_mode({index}, {enabled})", self.sync.set_mig_mode, index,
                         enabled)

    async def set_compute_mode(self, index: int, mode: str) -> None:
        await self._call(self.change_limit_s, f"set_compute_mode({index}, {mode})", self.sync.set_compute_mode,
                         index, mode)

    async def create_gpu_instance(self, index: int, profile_id: int, start: int, size: int) -> int:
        return await self._call(self.change_limit_s, f"create_gpu_instance({index}, {profile_id}, {start}, {size})",
                                self.sync.create_gpu_instance, index, profile_id, start, size)

    async def create_compute_instance(self, index: int, gi_id: int, slices: int) -> int:
        return await self._call(self.change_limit_s, f"create_compute_instance({index}, {gi_id}, {slices})",
                                self.sync.create_compute_instance, index, gi_id, slices)

    async def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        await self._call(self.change_limit_s, f"destroy_compute_instance({index}, {gi_id}, {ci_id})",
                         self.sync.destroy_compute_instance, index, gi_id, ci_id)

    async def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        await self._call(self.change_limit_s, f"destroy_gpu_instance({index}, {gi_id})",
                         self.sync.destroy_gpu_instance, index, gi_id)

    # --- plumbing ---

    async def _call(self, limit_s: float, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            self._check_answering()
            call = _Call(what, lambda: fn(*args), limit_s)
            submitted = time.monotonic()
            self._thread.submit(call)
            # a call still queued when its caller gives up (or its pass is cancelled) is never made
            answer = asyncio.wrap_future(call.future)
            try:
                seen = submitted
                while True:
                    # stuck = no progress on the thread for the limit of the call it is in (this
                    # one, or the one it waits behind, judged by its own limit)
                    running = self._thread.running
                    limit = running.limit_s if running is not None else limit_s
                    progress = max(submitted, self._thread.progress)
                    if running is not None and progress > max(seen, running.started):
                        seen = progress  # a long batch goes on: the pass is not stuck either
                        if self.on_answer is not None:
                            self.on_answer()
                    left = progress + limit - time.monotonic()
                    if left <= 0:
                        break
                    done, _ = await asyncio.wait({answer}, timeout=left)
                    if done:
                        result: T = answer.result()
                        return result
            finally:
                if not answer.done():
                    call.future.cancel()  # at once (the wrapper's own cancel waits for the loop's next turn)
                    answer.cancel()
            # (read again after the cancel: a call that began meanwhile is in the way all the same)
            running = running or self._thread.running
            if running is not None:
                self._stuck = running
                # said in every later failure, which the status shows: a text that changed every
                # pass (the seconds so far) would make every pass a Node write while the GPU is off
                self._stuck_since = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                  time.gmtime(time.time() - (time.monotonic() - progress)))
                log.error("the GPU driver has not answered %s for %.1f s (a GPU fallen off the bus, or a wedged "
                          "driver): no driver call is made until it returns", running.what,
                          time.monotonic() - progress)
            raise DriverNotResponding(
                f"the GPU driver did not answer {what} within {limit:g} s (a GPU fallen off the bus, or a "
                "wedged driver)")
        finally:
            if self.on_answer is not None:
                self.on_answer()

    def _check_answering(self) -> None:
        stuck = self._stuck
        if stuck is None:
            return
        if not stuck.future.done():
            raise DriverNotResponding(
                f"the GPU driver has not answered {stuck.what} since {self._stuck_since} (a GPU fallen off the bus, or a "
                "wedged driver); no other driver call is made until it does")
        log.warning("the GPU driver answers again: %s returned", stuck.what)
        self._stuck = None


def as_async(driver: GpuDriver | AsyncDriver) -> AsyncDriver:
    """`driver` itself if it is an AsyncDriver already (shared with its thread), else one over it."""
    return driver if isinstance(driver, AsyncDriver) else AsyncDriver(driver)
