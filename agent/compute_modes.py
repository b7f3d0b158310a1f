"""Compute modes of the node's GPUs around MPS: a GPU with MPS slices runs in EXCLUSIVE_PROCESS,
as NVIDIA's mps-control-daemon sets its GPUs (`nvidia-smi -c EXCLUSIVE_PROCESS` at its start,
`DEFAULT` at its stop): its MPS server is then its one CUDA process, and a client that misses the
daemon gets no context beside it instead of running without its slice's limits.

Only what dynpart set is undone: the UUIDs of the GPUs it put in EXCLUSIVE_PROCESS are kept in a
file on the host (`path`, stamped with the boot id: a reboot sets every GPU back to DEFAULT), so
that a restarted agent, a node switched to MIG mode or the setting turned off still sets them back
to DEFAULT once they have no slice. A mode set by someone else (EXCLUSIVE_PROCESS on a GPU before
it got slices, PROHIBITED) is left as it is. A GPU of dynpart's that has no slice and cannot be
set back is `blocked`: the agent lists it Unhealthy (in EXCLUSIVE_PROCESS a pod given it whole
could run a single CUDA process); so is a GPU with slices that someone keeps in PROHIBITED (no
pod could start CUDA on its slices). Setting a compute mode needs CAP_SYS_ADMIN on the GPUs; refused
once (NO_PERMISSION), no GPU is put in EXCLUSIVE_PROCESS any more by this agent process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from dynpart.agent.driver.interface import (
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    INVALID_ARGUMENT,
    NO_PERMISSION,
    NOT_SUPPORTED,
    PROHIBITED,
    DeviceInfo,
    GpuDriver,
    GpuDriverError,
)
from dynpart.agent.driver.threaded import AsyncDriver, as_async
from dynpart.agent.mps_daemon import before_this_boot, boot_id, read_json, write_json

log = logging.getLogger("dynpart.agent.mps")

# the driver's answers that say a change was not made (any other failure leaves it unknown)
_REFUSED = frozenset({NO_PERMISSION, INVALID_ARGUMENT, NOT_SUPPORTED})


class ComputeModes:
    def __init__(self, driver: GpuDriver | AsyncDriver, path: str | None = None, *, enabled: bool = True):
        self.driver = as_async(driver)
        self.path = path or None  # None: remembered in memory only
        self.enabled = enabled  # False: no GPU is put in EXCLUSIVE_PROCESS (those set before are undone)
        self.denied = False  # NVML refused a change (NO_PERMISSION): none is tried again
        self.blocked: dict[int, str] = {}  # GPU index -> why it is listed Unhealthy
        self.ours: set[str] = set()  # UUIDs of the GPUs dynpart put in EXCLUSIVE_PROCESS
        self._boot = boot_id()
        if self.path:
            data = read_json(self.path) or {}
            gpus = data.get("exclusive_process")
            if (not before_this_boot(data.get("boot"), self._boot) and isinstance(gpus, list)
                    and all(isinstance(g, str) for g in gpus)):
                self.ours = set(gpus)

    def _save(self) -> None:
        if not self.path:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json(self.path, {"exclusive_process": sorted(self.ours), "boot": self._boot})
        except OSError as e:  # kept in memory: lost only if this agent restarts before they are undone
            log.warning("remembering the GPUs put in EXCLUSIVE_PROCESS compute mode in %s: %s", self.path, e)

    async def sync(self, devices: Iterable[DeviceInfo], sliced: set[int]) -> list[str]:
        """EXCLUSIVE_PROCESS on the GPUs `sliced` (indices of the GPUs with MPS slices), DEFAULT
        again on dynpart's without; GPUs in MIG mode and lost GPUs are not touched (a GPU of
        dynpart's that entered MIG mode is set back once it leaves it, a lost one once it is back).
        Returns the problems to report; `blocked` says which GPUs are unhealthy for it."""
        errors: list[str] = []
        blocked: dict[int, str] = {}
        for d in devices:
            if d.mig_current or d.lost:
                if d.lost and d.index in self.blocked:
                    blocked[d.index] = self.blocked[d.index]
                continue
            if d.index in sliced:
                errors += await self._sliced(d, blocked)
                continue
            if d.uuid not in self.ours:
                continue
            try:
                mode = await self.driver.compute_mode(d.index)
                if mode == EXCLUSIVE_PROCESS:
                    await self.driver.set_compute_mode(d.index, DEFAULT_COMPUTE)
                    log.info("GPU %d: compute mode DEFAULT again (no MPS slice left)", d.index)
            except GpuDriverError as e:
                # reported with the GPU's health (the pass's "unhealthy" problems), not twice
                blocked[d.index] = (f"left in EXCLUSIVE_PROCESS compute mode, where a pod given it whole could run "
                                    f"a single CUDA process: setting it back to DEFAULT failed ({e})")
                continue
            self.ours.discard(d.uuid)
            self._save()
        self.blocked = blocked
        return errors

    async def _sliced(self, d: DeviceInfo, blocked: dict[int, str]) -> list[str]:
        """A GPU with MPS slices: EXCLUSIVE_PROCESS where it is DEFAULT (and changes are on), listed
        Unhealthy (`blocked`) while someone else keeps it in PROHIBITED."""
        try:
            mode = await self.driver.compute_mode(d.index)
        except GpuDriverError as e:  # (NVML failing: the GPU's health says so too)
            return [f"GPU {d.index}: its compute mode cannot be read ({e})"]
        if mode == PROHIBITED:
            # its slices listed Unhealthy: the kubelet admits no pod to them (each would fail to
            # start CUDA), and the planner plans nothing new there, until the mode is changed back
            blocked[d.index] = ("in PROHIBITED compute mode, not set by dynpart: no process, the MPS server included, "
                                "can use it, so its slices would fail to start CUDA")
            return []
        if mode != DEFAULT_COMPUTE or not self.enabled or self.denied:
            return []  # EXCLUSIVE_PROCESS already (dynpart's, or set before it got slices: then left so)
        self.ours.add(d.uuid)
        self._save()  # before the change: an agent killed right after it still knows the GPU is its
        try:
            await self.driver.set_compute_mode(d.index, EXCLUSIVE_PROCESS)
        except GpuDriverError as e:
            if e.code in _REFUSED:  # else (no answer in time, say) it may have been set: still ours
                self.ours.discard(d.uuid)
                self._save()
            if e.code == NO_PERMISSION:
                self.denied = True
                return [f"GPU {d.index}: EXCLUSIVE_PROCESS compute mode cannot be set ({e}): the agent needs "
                        "CAP_SYS_ADMIN on the GPUs (chart: agent.privileged, or SYS_ADMIN in agent.capabilities); "
                        "no GPU's compute mode is changed from now on (set mps_exclusive_process false to say so)"]
            return [f"GPU {d.index}: EXCLUSIVE_PROCESS compute mode could not be set ({e}): a process that does not "
                    "reach the MPS daemon can run on it beside its clients, without a slice's limits"]
        log.info("GPU %d: compute mode EXCLUSIVE_PROCESS (it has MPS slices)", d.index)
        return []
