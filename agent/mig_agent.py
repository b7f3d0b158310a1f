"""One MIG pass on a node: observe the GPUs, decide (`reconcile_mig`), act through the driver,
observe again. Safety rules carried out here:

- with a `SliceGuard`: free devices that pods bound to the node and not yet admitted need are
  kept, and a device is withdrawn from the built-in device plugin and re-checked before it goes
  (a whole GPU before MIG mode is enabled on it too);
- whether an instance is in use is asked again (NVML processes and a fresh PodResources list)
  right before it is destroyed; the driver's own IN_USE refusal is the last guard;
- MIG mode is enabled only on a GPU the spec wants partitioned, after checking it is idle; an
  enable the driver left pending because the GPU was not idle (a client such as DCGM holds it)
  is asked again at later passes while the GPU is idle; one that waits for a GPU reset is not;
- a creation that needs the slices of an instance that could not be destroyed is skipped; one the
  driver refused to destroy with nothing using it (a client such as DCGM holds it) is reported
  used for `HELD_OPEN_S`, also when its compute instances went and only the GPU instance stays;
- nothing is changed while the driver's GI profile ids disagree with the catalog's;
- a plan is not acknowledged while a GPU it carves has its MIG mode pending, or while an
  instance of a GI profile the catalog does not know keeps one of its instances from being made
  (the status cannot show such an instance to the planner).
Every failure becomes an error line for the status; none stops the pass, except a driver that
does not answer (`DriverNotResponding`, driver/threaded.py): a read cannot describe the GPUs, and
a change may still happen after its time limit, so its device is not advertised again and nothing
more is tried. The agent then reports every GPU unhealthy; the next pass that reads the GPUs
starts from what they then hold.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dynpart.agent import metrics
from dynpart.agent.driver.interface import (
    IN_USE,
    RESET_REQUIRED,
    DeviceInfo,
    DriverNotResponding,
    GpuDriver,
    GpuDriverError,
    GpuInstanceInfo,
    MigModePending,
    mig_pending_reason,
)
from dynpart.agent.driver.threaded import AsyncDriver, as_async
from dynpart.agent.guard import UNCONFIRMED, SliceGuard
from dynpart.agent.podresources import PodResources, pods_by_device
from dynpart.agent.reconcile import Destroy, Instance, MigGpuState, drained_mig, reconcile_mig, unknown_blocks
from dynpart.catalog import GpuModel
from dynpart.mig import slot_mask
from dynpart.resources import WHOLE_GPU, mig_resource_name
from dynpart.snapshot import GpuLayout, MigInstance

log = logging.getLogger("dynpart.agent.mig")

# how long an instance the driver refused to destroy (IN_USE, with no process and no pod on it)
# is reported used: its holder (DCGM, a leaked handle) usually stays, and the planner would
# otherwise plan over it at every round; after this it is tried again
HELD_OPEN_S = 600.0

# a MIG mode enable left pending because a client holds the GPU open (IN_USE) is asked again after
# this, then after twice as long each time, up to ENABLE_RETRY_MAX_S: each ask withdraws the idle
# GPU from the kubelet's list for a moment (a pod admitted then is refused), and the holder
# (dcgm-exporter, on by default under GPU Operator) usually stays
ENABLE_RETRY_FIRST_S = 30.0
ENABLE_RETRY_MAX_S = 600.0


def _now() -> float:
    return time.monotonic()


@dataclass
class PassResult:
    # every GPU of the node as it is after the pass, with `used` set; not the lost ones (the
    # agent reports those as last known, `Agent._lost_layouts`)
    gpus: list[GpuLayout]
    errors: list[str] = field(default_factory=list)
    applied: bool = False  # the spec was acted on: its plan id can be acknowledged
    # the GPUs as the pass last read them (after its changes): what the rest of the pass describes
    # (the lost ones too, `DeviceInfo.lost`)
    devices: list[DeviceInfo] = field(default_factory=list)


@dataclass
class _Observed:
    devices: list[DeviceInfo]
    states: list[MigGpuState]
    raw: dict[tuple[int, int], GpuInstanceInfo]  # (gpu, gi id) -> what the driver listed


@dataclass
class GpuReading:
    """What one GPU holds and who computes on it, as the driver answered."""

    device: DeviceInfo
    instances: list[GpuInstanceInfo]  # (in MIG mode)
    pids: dict[int | None, list[int]]  # GI id (with a compute instance) -> its pids; None -> the whole GPU's


def _mig_uuids(gi: GpuInstanceInfo) -> list[str]:
    """The MIG devices of a GPU instance: one per compute instance."""
    return ([gi.uuid] if gi.uuid else []) + list(gi.more_uuids)


def _split(gi: GpuInstanceInfo) -> list[str]:
    """Why a GPU instance split into several compute instances (by another tool) stays: each is a
    MIG device of its own (NVIDIA's plugin lists them as `mig-<c>c.<profile>`), which pods may
    hold, and which no dynpart profile describes."""
    if not gi.split:
        return []
    what = (f"{len(gi.compute_instances)} compute instances" if len(gi.compute_instances) > 1
            else "a compute instance smaller than the instance")
    return [f"{what} made outside dynpart (left alone: destroy them, or the instance, to hand it back)"]


def instances_and_processes(driver: GpuDriver) -> list[GpuReading]:
    """Every GPU, its GPU instances and the processes computing on each: an observation's reads,
    made on the driver's thread as one call (`AsyncDriver.read`). A lost GPU (`DeviceInfo.lost`)
    is not read: listed with nothing on it, which `GpuReading.device.lost` tells apart."""
    out = []
    for d in driver.devices():
        if d.lost:
            out.append(GpuReading(d, [], {None: []}))
        elif d.mig_current:
            instances = driver.gpu_instances(d.index)
            pids: dict[int | None, list[int]] = {gi.gi_id: driver.processes(d.index, gi.gi_id)
                                                 for gi in instances if gi.compute_instances}
            out.append(GpuReading(d, instances, pids))
        else:
            out.append(GpuReading(d, [], {None: driver.processes(d.index)}))
    return out


def profile_problems(driver: GpuDriver, model: GpuModel, index: int) -> list[str]:
    """Differences between the catalog's MIG profiles and what the driver reports for GPU `index`
    (which must be in MIG mode). An id mismatch makes the agent refuse to change anything. Reads
    only: the agent makes it on its driver's thread (`AsyncDriver.read`)."""
    problems = []
    for p in model.mig_profiles:
        info = driver.profile_info(index, p.nvml)
        if info is None:
            problems.append(f"GPU {index}: the driver does not offer {p.name} ({p.nvml})")
        elif info.profile_id != p.gi_profile_id:
            problems.append(f"GPU {index}: catalog says {p.name} ({p.nvml}) is GI profile id {p.gi_profile_id}, "
                            f"the driver says {info.profile_id}; fix the catalog (dynpart agent probe)")
        elif info.slices != p.compute:
            problems.append(f"GPU {index}: catalog says {p.name} has {p.compute} compute slices, "
                            f"the driver says {info.slices}; fix the catalog")
    return problems


class MigAgent:
    def __init__(self, driver: GpuDriver | AsyncDriver, pods: PodResources, model: GpuModel,
                 guard: SliceGuard | None = None):
        # every driver call is awaited: made on the driver's own thread, within a time limit
        # (driver/threaded.py), so the device plugin on this event loop is answered meanwhile
        self.driver = as_async(driver)
        self.guard = guard  # withdraw before destroy, keep what bound pods need (agent/guard.py)
        self.pods = pods
        self.model = model
        self._by_id = {p.gi_profile_id: p for p in model.mig_profiles}
        self._catalog_problems: list[str] | None = None  # checked once, on the first GPU in MIG mode
        # GPU index -> the MPS slices it still carries from MPS mode (set by the agent before each
        # pass): such a GPU counts as in use, so MIG mode is not enabled under them
        self.mps_left: dict[int, list[str]] = {}
        # GPU UUID -> the activation status the driver gave when MIG mode was last enabled there
        # and stayed pending (IN_USE: asked again while idle; RESET_REQUIRED...: waits for a reset)
        self._activation: dict[str, str] = {}
        # GPU UUID -> (when a pending enable (IN_USE) may be asked again, the wait after that)
        self._ask_again: dict[str, tuple[float, float]] = {}
        # MIG device UUID, or (GPU index, GI id) for a GPU instance without a compute instance (it
        # has no UUID then) -> time.monotonic() until which it is reported used: the driver refused
        # to destroy it (IN_USE) while no process and no pod used it
        self._held_open: dict[str | tuple[int, int], float] = {}

    async def observe(self) -> _Observed:
        readings = await self.driver.read(instances_and_processes)
        # (an MPS slice `<uuid>::<n>` counts under its GPU: a pod using one holds the GPU)
        holders = pods_by_device(await self.pods.list())
        states: list[MigGpuState] = []
        raw: dict[tuple[int, int], GpuInstanceInfo] = {}
        for reading in readings:
            d = reading.device
            if d.lost:  # left alone: no state, so nothing is planned or done there (`apply`)
                continue
            users = [f"pod {p}" for p in holders.get(d.uuid, [])]
            instances: list[Instance] = []
            if d.mig_current:
                for gi in reading.instances:
                    raw[(d.index, gi.gi_id)] = gi
                    profile = self._by_id.get(gi.profile_id)
                    gi_users = [f"pid {p}" for p in reading.pids.get(gi.gi_id, [])] + _split(gi)
                    for uuid in _mig_uuids(gi):
                        gi_users += [f"pod {p}" for p in holders.get(uuid, [])]
                    # by its MIG UUID, or by its GI id once a compute instance went (its UUID then
                    # gone, or another compute instance's)
                    held = max(self._held_open.get(gi.uuid, 0.0) if gi.uuid else 0.0,
                               self._held_open.get((d.index, gi.gi_id), 0.0))
                    if held > time.monotonic():
                        gi_users.append("a client that is not a compute process (the driver refused to destroy "
                                        "it: IN_USE)")
                    instances.append(Instance(gi.gi_id, profile.name if profile else None, gi.profile_id, gi.start,
                                              gi.size, bool(gi.compute_instances), tuple(gi_users)))
            else:
                users = [f"pid {p}" for p in reading.pids[None]] + users
                users += [u for u in self.mps_left.get(d.index, ()) if u not in users]
            pending = d.mig_pending and not d.mig_current
            if not pending:
                self._activation.pop(d.uuid, None)  # active (or given up): what the driver said is stale
                self._ask_again.pop(d.uuid, None)
            states.append(MigGpuState(d.index, d.mig_current, pending, tuple(instances), tuple(users),
                                      self._activation.get(d.uuid) if pending else None,
                                      pending and _now() < self._ask_again.get(d.uuid, (0.0, 0.0))[0]))
        # a GPU instance known by its GI id that is gone (destroyed by hand, a GPU reset, MIG mode
        # off) is forgotten: GI ids are reused, and a new instance without its compute instance yet
        # (its creation failed once) must not be taken for the one held open
        read_gpus = {r.device.index for r in readings if not r.device.lost}
        for key in [k for k in self._held_open if isinstance(k, tuple) and k[0] in read_gpus and k not in raw]:
            del self._held_open[key]
        return _Observed([r.device for r in readings], states, raw)

    async def _check_catalog(self, observed: _Observed) -> list[str]:
        if self._catalog_problems is None:
            mig_gpu = next((d.index for d in observed.devices if d.mig_current and not d.lost), None)
            if mig_gpu is None:
                return []
            self._catalog_problems = await self.driver.read(profile_problems, self.model, mig_gpu)
            for p in self._catalog_problems:
                log.warning("%s", p)
        return self._catalog_problems

    async def _instance_users(self, gpu: int, gi: GpuInstanceInfo) -> list[str]:
        # read now, not from the pass's observation: the last check before a destroy
        users = [f"pid {p}" for p in await self.driver.processes(gpu, gi.gi_id)] if gi.compute_instances else []
        if gi.uuid or gi.more_uuids:
            holders = pods_by_device(await self.pods.list())
            users += [f"pod {p}" for uuid in _mig_uuids(gi) for p in holders.get(uuid, [])]
        return users + _split(gi)

    async def _started_since(self, gpu: int, gi: GpuInstanceInfo) -> list[str]:
        """The compute processes on an instance whose destroy the driver just refused (IN_USE):
        one that started after the last check is why, not a client holding it open. A read that
        fails says nothing (the instance is then taken as held open)."""
        if not gi.compute_instances:
            return []
        try:
            return [f"pid {p}" for p in await self.driver.processes(gpu, gi.gi_id)]
        except DriverNotResponding:
            raise
        except GpuDriverError:
            return []

    async def _gpu_users(self, device: DeviceInfo) -> list[str]:
        users = [f"pid {p}" for p in await self.driver.processes(device.index)] + list(self.mps_left.get(device.index, ()))
        return users + [f"pod {p}" for p in pods_by_device(await self.pods.list()).get(device.uuid, [])]

    async def apply(self, desired: dict[int, list[tuple[str, int]]] | None, drain: tuple[int, ...] = ()) -> PassResult:
        """One pass. `desired` None: no spec, observe only. `drain`: GPUs whose idle instances go
        (`reconcile.drained_mig`)."""
        observed = await self.observe()
        errors: list[str] = []
        applied = desired is not None
        lost = {d.index for d in observed.devices if d.lost}
        if desired is not None and lost:
            # a lost GPU is left as it is: the caller reports it as last known, and a plan that
            # changes it is not acknowledged (its layout differs from the plan's)
            desired = {i: v for i, v in desired.items() if i not in lost}
            drain = tuple(i for i in drain if i not in lost)
        if desired is not None:
            problems = await self._check_catalog(observed)
            errors.extend(problems)
            if any("GI profile id" in p or "compute slices" in p for p in problems):
                errors.append("MIG changes are suspended until the catalog matches the driver")
            else:
                wanted = drained_mig(desired, observed.states, drain)
                errors.extend(await self._act(wanted, observed))
                observed = await self.observe()
                # an instance the catalog does not know is not in the status: the planner sees its
                # slices free, so a plan it keeps from being carried out cannot be acknowledged
                blocked = unknown_blocks(wanted, observed.states, self.model)
                if blocked:
                    applied = False
                    errors.extend(f"plan not applied: {b}" for b in blocked)
            # a GPU the spec wants carved whose MIG mode is pending cannot hold the plan now: the
            # plan is not acknowledged (the planner revokes it after its ack time-out and leaves
            # that GPU out while the capability report shows it pending)
            for s in observed.states:
                if s.mig_pending:  # (a GPU the spec leaves empty: the planner leaves it out while pending)
                    wanted_there = bool(desired.get(s.index))
                    applied = applied and not wanted_there
                    errors.append(f"{'plan not applied: ' if wanted_there else ''}{mig_pending_reason(s.index, s.activation)}")
        return PassResult([self._layout(s) for s in observed.states], errors, applied=applied, devices=observed.devices)

    async def _act(self, desired: dict[int, list[tuple[str, int]]], observed: _Observed) -> list[str]:
        actions = reconcile_mig(desired, observed.states, self.model)
        errors = list(actions.errors)
        devices = {d.index: d for d in observed.devices}
        skip: set[int] = set()
        enable = []
        for e in actions.enable:
            users = await self._gpu_users(devices[e.gpu])
            if users:
                errors.append(f"GPU {e.gpu}: MIG mode not enabled, the GPU is in use ({', '.join(users)})")
                skip.add(e.gpu)
                continue
            enable.append(e)
        # a whole GPU that becomes MIG stops being a `nvidia.com/gpu` device: guarded as a destroy
        whole_free = [devices[s.index].uuid for s in observed.states if not s.mig_enabled and not s.users]
        gone, errs = await self._guard({devices[e.gpu].uuid: WHOLE_GPU for e in enable}, {WHOLE_GPU: whole_free},
                                       {devices[e.gpu].uuid: f"GPU {e.gpu}" for e in enable}, "MIG mode was enabled")
        errors += errs
        for e in enable:
            uuid = devices[e.gpu].uuid
            if uuid not in gone:
                skip.add(e.gpu)
                continue
            try:
                await self.driver.set_mig_mode(e.gpu, True)
            except DriverNotResponding:
                raise  # its outcome is unknown: the pass stops (module doc)
            except MigModePending as ex:  # left pending: the pass's status line says why (`apply`)
                log.info("GPU %d: MIG mode enable left pending, activation status %s", e.gpu, ex.code)
                self._activation[uuid] = ex.code
                wait = self._ask_again.get(uuid, (0.0, ENABLE_RETRY_FIRST_S / 2))[1] * 2
                self._ask_again[uuid] = (_now() + min(wait, ENABLE_RETRY_MAX_S), min(wait, ENABLE_RETRY_MAX_S))
                skip.add(e.gpu)
                await self._restore(uuid)
                continue
            except GpuDriverError as ex:
                errors.append(f"GPU {e.gpu}: enabling MIG mode failed: {ex}")
                skip.add(e.gpu)
                await self._restore(uuid)
                continue
            self._activation.pop(uuid, None)
            now = {d.index: d for d in await self.driver.devices()}[e.gpu]
            if not now.mig_current:  # activated, says the driver, yet pending: only a reset can help
                self._activation[uuid] = RESET_REQUIRED
                skip.add(e.gpu)
                await self._restore(uuid)  # still a whole GPU, as when the driver says it is pending
        not_destroyed: list[Destroy] = []
        instances = {(s.index, i.gi_id): i for s in observed.states for i in s.instances}
        free: dict[str, list[str]] = {}
        for (gpu, gi_id), inst in instances.items():
            mig_uuid = observed.raw[(gpu, gi_id)].uuid
            if inst.profile is not None and inst.complete and not inst.used and mig_uuid:
                free.setdefault(mig_resource_name(inst.profile), []).append(mig_uuid)
        advertised = {observed.raw[(d.gpu, d.gi_id)].uuid: d for d in actions.destroy}
        candidates = {uuid: mig_resource_name(instances[(d.gpu, d.gi_id)].profile or "")
                      for uuid, d in advertised.items() if uuid and instances[(d.gpu, d.gi_id)].profile}
        gone, errs = await self._guard(candidates, free, {u: f"GPU {d.gpu}: {d.label}" for u, d in advertised.items() if u},
                                       "it was to be destroyed")
        errors += errs
        for d in actions.destroy:
            gi = observed.raw[(d.gpu, d.gi_id)]
            if gi.uuid and gi.uuid in candidates and gi.uuid not in gone:
                not_destroyed.append(d)
                continue
            users = await self._instance_users(d.gpu, gi)
            if users:
                errors.append(f"GPU {d.gpu}: {d.label} was taken ({', '.join(users)}) just before it was to be "
                              "destroyed; kept")
                metrics.IN_USE_KEPT.inc()
                not_destroyed.append(d)
                await self._restore(gi.uuid)
                continue
            cis_destroyed = 0
            try:
                for ci in gi.compute_instances:
                    await self.driver.destroy_compute_instance(d.gpu, d.gi_id, ci)
                    cis_destroyed += 1
                await self.driver.destroy_gpu_instance(d.gpu, d.gi_id)
                metrics.INSTANCES_DESTROYED.inc()
                log.info("GPU %d: destroyed %s (GI %d)", d.gpu, d.label, d.gi_id)
                self._held_open.pop((d.gpu, d.gi_id), None)
                if gi.uuid:
                    self._held_open.pop(gi.uuid, None)
                    if self.guard is not None:  # before a creation can give its id to a new instance
                        await self.guard.destroyed([gi.uuid])
            except DriverNotResponding:
                raise  # its outcome is unknown: the pass stops (module doc)
            except GpuDriverError as ex:
                errors.append(f"GPU {d.gpu}: destroying {d.label} failed: {ex}")
                if ex.code == IN_USE:
                    metrics.IN_USE_KEPT.inc()
                    # a compute process that started between the last check and the call (the race
                    # this refusal guards) is seen by the next pass's observation and ends with its
                    # pod: the instance is in use, not held open, and is tried again once it is free
                    if not cis_destroyed and await self._started_since(d.gpu, gi):
                        log.info("GPU %d: %s was taken by a compute process just before it was to be destroyed; kept",
                                 d.gpu, d.label)
                    else:
                        # no process and no pod, yet the driver refuses: a client that is not a
                        # compute process holds it open (DCGM, a leaked handle). Reported used for a
                        # while, so that plans stop counting on it instead of failing on it again and
                        # again. Its compute instances destroyed, it has no UUID left: known by its GI
                        # id then
                        self._held_open[gi.uuid if gi.uuid and not cis_destroyed else (d.gpu, d.gi_id)] = (
                            time.monotonic() + HELD_OPEN_S)
                not_destroyed.append(d)
                if cis_destroyed and gi.uuid and self.guard is not None:
                    # the GPU instance stays but its compute instance is gone: so is the MIG device
                    # the plugin listed (nothing could run on it); forgotten, not served again
                    await self.guard.destroyed([gi.uuid])
                else:
                    await self._restore(gi.uuid)
        for incomplete in actions.complete:
            try:
                await self.driver.create_compute_instance(incomplete.gpu, incomplete.gi_id,
                                                          self.model.profile(incomplete.profile).compute)
            except DriverNotResponding:
                raise  # its outcome is unknown: the pass stops (module doc)
            except GpuDriverError as ex:
                errors.append(f"GPU {incomplete.gpu}: creating the compute instance of "
                              f"{incomplete.profile}@{incomplete.start} failed: {ex}")
        for c in actions.create:
            if c.gpu in skip:
                continue
            p = self.model.profile(c.profile)
            mask = slot_mask(c.start, p.memory)
            blocking = [d for d in not_destroyed if d.gpu == c.gpu and slot_mask(d.start, d.size) & mask]
            if blocking:
                errors.append(f"GPU {c.gpu}: {c.profile}@{c.start} not created: {blocking[0].label} is still there")
                continue
            try:
                gi_id = await self.driver.create_gpu_instance(c.gpu, p.gi_profile_id, c.start, p.memory)
            except DriverNotResponding:
                raise  # its outcome is unknown: the pass stops (module doc)
            except GpuDriverError as ex:
                errors.append(f"GPU {c.gpu}: creating {c.profile}@{c.start} failed: {ex}")
                continue
            try:
                await self.driver.create_compute_instance(c.gpu, gi_id, p.compute)
                metrics.INSTANCES_CREATED.inc()
                log.info("GPU %d: created %s@%d (GI %d)", c.gpu, c.profile, c.start, gi_id)
            except DriverNotResponding:
                raise  # its outcome is unknown: the pass stops (module doc)
            except GpuDriverError as ex:  # the next pass completes the GI (or removes it)
                errors.append(f"GPU {c.gpu}: creating the compute instance of {c.profile}@{c.start} failed: {ex}")
        return errors

    async def _guard(self, candidates: dict[str, str], free: dict[str, list[str]], labels: dict[str, str],
                     when: str) -> tuple[set[str], list[str]]:
        """The devices among `candidates` (id -> resource) that may go, and the error lines for
        the others: kept for bound pods not yet admitted, or taken while withdrawn. Without a
        guard, all may go (the in-use checks that follow still apply)."""
        if self.guard is None or not candidates:
            return set(candidates), []
        errors = []
        kept = await self.guard.keep(candidates, free)
        for device, why in kept.items():
            errors.append(f"{labels[device]} {why}; the plan's change of that GPU waits until they are admitted")
        released = await self.guard.release({i: r for i, r in candidates.items() if i not in kept}, free)
        for device, users in released.in_use.items():
            errors.append(f"{labels[device]} was taken ({', '.join(users)}) just before {when}; kept")
            metrics.IN_USE_KEPT.inc()
        for device, why in released.needed.items():
            errors.append(f"{labels[device]} {why}; the plan's change of that GPU waits until they are admitted")
        errors += [f"{labels[device]} {UNCONFIRMED}" for device in released.unconfirmed]
        return set(released.destroyable), errors

    async def _restore(self, device_id: str | None) -> None:
        if self.guard is not None and device_id:
            await self.guard.restore([device_id])

    def _layout(self, state: MigGpuState) -> GpuLayout:
        # an incomplete instance (no compute instance: nothing can run on it yet) is left out, as
        # one about to be completed or destroyed, unless it is used (held open): its slices are taken
        return GpuLayout(index=state.index, mig=[
            MigInstance(profile=i.profile, start=i.start, used=i.used)
            for i in state.instances if i.profile is not None and (i.complete or i.used)
        ])
