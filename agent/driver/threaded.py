"""`AsyncDriver`: the `GpuDriver` as the agent's event loop calls it.

The loop also serves the kubelet's device-plugin calls (Allocate, ListAndWatch), the node watch
and the publisher, so it must never wait on NVML: when a GPU falls off the bus or the driver
wedges, NVML calls take seconds or never return. Every call therefore runs on one thread of the
driver's own, in the order made (NVML sees one call at a time, and `RealNvml`'s re-initialisation
after a lost GPU never runs beside another call), and the loop awaits it.

A call that has not returned within its limit fails with `DriverNotResponding`, a
`GpuDriverError` the agent handles as NVML failing (every GPU reported unhealthy, every device
listed Unhealthy). While that call is still running on the thread, every further call fails at
once with the same error instead of queueing behind it, so that each pass reports quickly; once
it returns, calls go through again.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dynpart.agent.driver.interface import (
    DeviceInfo,
    DriverNotResponding,
    DriverVersions,
    GpuDriver,
    GpuInstanceInfo,
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


@dataclass
class _Call:
    what: str  # e.g. "gpu_instances(0)", for the error and the log
    run: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    started: float = 0.0  # time.monotonic() when the thread began it


class _DriverThread:
    """One thread that makes the calls submitted to it, one after the other."""

    def __init__(self, name: str):
        self.name = name
        self.running: _Call | None = None  # the call the thread is in now
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

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
            if not call.future.set_running_or_notify_cancel():
                continue  # its caller gave up while it waited: never made
            call.started = time.monotonic()
            self.running = call
            try:
                result = call.run()
            except BaseException as e:  # (as asyncio.to_thread: the caller gets whatever it raised)
                self.running = None
                call.future.set_exception(e)
            else:
                self.running = None
                call.future.set_result(result)
            del call


class AsyncDriver:
    """`GpuDriver`'s calls as coroutines, each made on the driver's thread within a time limit
    (module doc). `sync`: the driver itself, for code that must not run on the event loop."""

    def __init__(self, driver: GpuDriver, *, read_limit_s: float = READ_LIMIT_S,
                 change_limit_s: float = CHANGE_LIMIT_S):
        self.sync = driver
        self.read_limit_s = read_limit_s
        self.change_limit_s = change_limit_s
        # called on the event loop after each call ends (answered, failed or given up on): the
        # agent's pass-progress heartbeat
        self.on_answer: Callable[[], None] | None = None
        self._thread = _DriverThread(f"gpu-driver-{id(self):x}")
        self._stuck: _Call | None = None  # the call that did not return in time, while it runs

    @property
    def longest_limit_s(self) -> float:
        """The longest a call can keep its caller waiting."""
        return max(self.read_limit_s, self.change_limit_s)

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

    async def health(self, index: int) -> str | None:
        return await self._call(self.read_limit_s, f"health({index})", self.sync.health, index)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(driver, *args)`, reads only, made on the driver's thread as one call (e.g.
        `read_capability`: dozens of reads a healthy driver answers in milliseconds)."""
        return await self._call(self.read_limit_s, f"{getattr(fn, '__name__', 'read')}()", fn, self.sync, *args)

    # --- changes ---

    async def set_mig_mode(self, index: int, enabled: bool) -> None:
        await self._call(self.change_limit_s, f"set_mig_mode({index}, {enabled})", self.sync.set_mig_mode, index,
                         enabled)

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
            call = _Call(what, lambda: fn(*args))
            self._thread.submit(call)
            deadline = asyncio.timeout(limit_s)
            try:
                async with deadline:
                    # cancelled by the deadline, the wrapper cancels a call still queued: never made
                    result: T = await asyncio.wrap_future(call.future)
                    return result
            except TimeoutError:
                if not deadline.expired():
                    raise
                stuck = self._thread.running  # this call, or the one it waited behind
                if stuck is not None:
                    self._stuck = stuck
                    log.error("the GPU driver has not answered %s for %.1f s (a GPU fallen off the bus, or a wedged "
                              "driver): no driver call is made until it returns", stuck.what,
                              time.monotonic() - stuck.started)
                raise DriverNotResponding(
                    f"the GPU driver did not answer {what} within {limit_s:g} s (a GPU fallen off the bus, or a "
                    "wedged driver)") from None
        finally:
            if self.on_answer is not None:
                self.on_answer()

    def _check_answering(self) -> None:
        stuck = self._stuck
        if stuck is None:
            return
        if not stuck.future.done():
            raise DriverNotResponding(
                f"the GPU driver has not answered {stuck.what} for {time.monotonic() - stuck.started:.0f} s (a GPU "
                "fallen off the bus, or a wedged driver); no other driver call is made until it does")
        log.warning("the GPU driver answers again: %s returned", stuck.what)
        self._stuck = None


def as_async(driver: GpuDriver | AsyncDriver) -> AsyncDriver:
    """`driver` itself if it is an AsyncDriver already (shared with its thread), else one over it."""
    return driver if isinstance(driver, AsyncDriver) else AsyncDriver(driver)
