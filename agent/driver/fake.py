"""`FakeNvml`: an in-memory `GpuDriver` that enforces the driver's MIG rules (facts file
section 1), so that the agent can be tested without a GPU; `FakeOp`, its log of mutating calls.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Concatenate, NoReturn, ParamSpec, TypeVar

from dynpart.agent.driver.interface import (
    COMPUTE_MODES,
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    GPU_IS_LOST,
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    NO_PERMISSION,
    NOT_FOUND,
    NOT_SUPPORTED,
    PROHIBITED,
    RESET_REQUIRED,
    DeviceInfo,
    DriverVersions,
    GpuDriverError,
    GpuInstanceInfo,
    MigModePending,
    ProfileInfo,
)
from dynpart.agent.driver.nvcaps import driver_mig_minors
from dynpart.catalog import GpuModel, MigProfile
from dynpart.mig import MigRules

_DRIVERS = itertools.count()  # FakeNvml instances made: each is another machine
P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[Concatenate[FakeNvml, P], R]) -> Callable[Concatenate[FakeNvml, P], R]:
    """One call at a time, as NVML is thread-safe: the agent calls from its driver thread while a
    test changes the GPUs from its own."""
    @functools.wraps(method)
    def call(self: FakeNvml, /, *args: P.args, **kw: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kw)
    return call


def _driver_call(read: bool) -> Callable[[Callable[Concatenate[FakeNvml, P], R]], Callable[Concatenate[FakeNvml, P], R]]:
    """A GpuDriver method: slowed down (`read_delay_s`, `change_delay_s`) or blocked (`hang`) as a
    test asks, before it takes the lock (a hung call holds nothing a test needs), then locked."""
    def wrap(method: Callable[Concatenate[FakeNvml, P], R]) -> Callable[Concatenate[FakeNvml, P], R]:
        @functools.wraps(method)
        def call(self: FakeNvml, /, *args: P.args, **kw: P.kwargs) -> R:
            self._answer(read)
            with self._lock:
                return method(self, *args, **kw)
        return call
    return wrap


class ContextRefused(Exception):
    """`FakeNvml.attach`: CUDA refuses the process a context on the GPU (its compute mode:
    cudaErrorDevicesUnavailable)."""


class SimulatedCrash(BaseException):
    """Raised by FakeNvml.crash_after: the agent process 'dies' in the middle of a pass."""


@dataclass
class FakeOp:
    """One mutating call, as FakeNvml's `ops` log records it."""

    op: str  # set_mig_mode | set_compute_mode | create_gi | create_ci | destroy_ci | destroy_gi
    device: int
    gi_id: int | None = None
    profile: str | None = None
    start: int | None = None
    result: str = "ok"  # or the error code; set_mig_mode left pending: "pending:<activation status>"


@dataclass
class _FakeGi:
    gi_id: int
    profile: MigProfile
    start: int
    ci: int | None = None  # the one full compute instance (or the first of a split one)
    uuid: str | None = None
    more: dict[int, str] = field(default_factory=dict)  # a split instance's other compute instances: id -> UUID
    smaller: bool = False  # its compute instances are smaller than it (`split`)
    pids: set[int] = field(default_factory=set)
    holders: set[str] = field(default_factory=set)  # clients holding the MIG device open, not computing


@dataclass
class _FakeGpu:
    index: int
    uuid: str
    mig_current: bool
    mig_pending: bool
    gis: dict[int, _FakeGi] = field(default_factory=dict)
    pids: set[int] = field(default_factory=set)  # processes on the whole GPU (MIG off)
    holders: set[str] = field(default_factory=set)  # clients holding it open that are not compute processes
    compute_mode: str = DEFAULT_COMPUTE


class FakeNvml:
    """An in-memory GPU driver for one GPU model, enforcing: legal starts and sizes, no
    memory-slice overlap, per-profile max counts, one `+me` instance, the compute-slice total,
    one full compute instance per GI, IN_USE when destroying a CI with processes or a GI with
    a CI, and state lost on `reboot()` (MIG mode too on Hopper and later). Every mutating call
    is logged in `ops`. A GPU instance's id follows from its placement, as `nvidia-smi mig -lgi`
    shows on 8-slice GPUs (A100, H100: the whole GPU 0, a 4-slice instance 1 + start / 4, a
    2-slice one 3 + start / 2, a 1-slice one 7 + start; other GPUs: the lowest free id), so ids are
    reused; its MIG device UUID is derived from the GPU's UUID, the GI id and the CI id, so an
    instance re-created at the same place gets the UUID of the one destroyed, even under another
    profile (3g.40gb@0 -> 4g.40gb@0). Real MIG UUIDs are name-based; that a driver reuses them so
    is not confirmed on hardware: it is the harder case for the agent.

    MIG mode changes as NVML's nvmlDeviceSetMigMode makes them: the call succeeds and the mode is
    applied at once on an idle GPU; on a GPU that is not idle (compute processes, or a client
    such as DCGM that `hold` plays) the new mode is left pending and MigModePending(IN_USE) is
    raised, the activation status a real driver returns; asking again once the GPU is idle
    applies it. With `mode_needs_reset` the mode is left pending with RESET_REQUIRED until
    `reset(i)`. Disabling MIG mode while GPU instances exist is refused (IN_USE).

    Compute modes as nvmlDeviceSetComputeMode sets them: for root only (`root=False`: refused with
    NO_PERMISSION), back to DEFAULT at a reset or a reboot; they govern `attach` (a process creating
    a context on the whole GPU: refused with ContextRefused in PROHIBITED, and in EXCLUSIVE_PROCESS
    while another process is on it, unless it comes through the MPS server, `through_mps`).

    Test controls: `attach`/`detach` processes, `hold`/`release` (a client that is not a
    compute process: `processes()` does not list it; on a GPU it keeps MIG mode changes pending,
    on a GPU instance its destroy refused with IN_USE), `lose(i)` (the GPU fell off the bus:
    every call on it, and `devices()`, fail with GPU_IS_LOST until `reset(i)`), `crash_after(n)`,
    `before_op` (a hook called before each mutating call with the FakeOp about to be tried),
    `reset(i)`, `reboot()`; `minors` (each GPU's device minor number, /dev/nvidia<minor>: the index
    unless a test sets others) and `mig_minors_visible` (False: the MIG capability minors cannot be
    read), the capability minors being the driver's fixed table (`nvcaps.driver_mig_minors`);
    `read_delay_s`, `change_delay_s` (each read, each change, takes that
    long: a slow driver) and `hang()`/`unhang()` (a wedged driver: every GpuDriver call blocks in
    its caller's thread until `unhang()`; `hung_calls` counts those blocked now). By default every
    call answers at once. Calls are thread-safe (one at a time), as NVML's are."""

    def __init__(self, model: GpuModel, count: int = 1, *, mig_enabled: bool = True,
                 mig_persists: bool | None = None, mode_needs_reset: bool = False, name: str | None = None,
                 memory_mib: int | None = None, profiles_need_mig: bool = False, root: bool = True):
        if not model.supports_mig and mig_enabled:
            mig_enabled = False
        self.model = model
        self.rules = MigRules.of(model)
        self.name = name or f"NVIDIA {model.name}"
        # what NVML reports as total memory: below the nominal size on real GPUs (81,559 MiB on
        # an H100-80GB); the catalog's measured figure, else the nominal size, unless a test gives one
        self.memory_mib = memory_mib if memory_mib is not None else model.memory_mib or model.memory_gb * 1024
        # what the driver reserves of it (nvmlMemory_v2 `reserved`): the catalog's measured figure
        # on the GPU it was measured on, else none. None plays a driver without nvmlMemory_v2.
        self.reserved_mib: int | None = (model.reserved_mib or 0) if self.memory_mib == model.memory_mib else 0
        # Ampere keeps MIG mode across a reboot; Hopper and later lose it (facts file section 1).
        self.mig_persists = model.name.startswith("A") if mig_persists is None else mig_persists
        # A MIG mode change that stays pending until `reset()` (as when the driver cannot reset
        # the GPU by itself, e.g. under a hypervisor: activation status RESET_REQUIRED).
        self.mode_needs_reset = mode_needs_reset
        # True: list GPU-instance profiles only in MIG mode. A real H100 and H200 on driver 580
        # list them whatever the mode (tests/fixtures/nvml); this plays a driver that does not.
        self.profiles_need_mig = profiles_need_mig
        self._by_id = {p.gi_profile_id: p for p in model.mig_profiles}
        self.root = root  # False: the caller is not root (NVML refuses it a compute-mode or MIG change)
        # True: the caller (the agent) runs in a PID namespace of its own (a pod without hostPID):
        # `processes()` lists none of the processes `attach` started (they run in other pods' or the
        # host's namespaces). The driver translates each pid into the caller's namespace and leaves
        # out those it cannot see (open-gpu-kernel-modules gpuGetProcWithObject: os_find_ns_pid,
        # pid_vnr 0 -> NV_ERR_OBJECT_NOT_FOUND -> skipped); they still hold the GPU (IN_USE, a MIG
        # mode change left pending). False (default): the caller sees every pid (hostPID).
        self.own_pid_namespace = False
        # real GPU UUIDs are unique the world over, so MIG UUIDs derived from them are unique across
        # nodes too; the fake's GPU UUIDs repeat on every fake node (GPU-fake-0000): its MIG UUIDs
        # are derived in a namespace of this driver's own
        self._machine = uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"dynpart-fake-nvml-{next(_DRIVERS)}")
        self._gpus = [_FakeGpu(i, f"GPU-fake-{i:04d}", mig_enabled, mig_enabled) for i in range(count)]
        # each GPU's device minor number (/dev/nvidia<minor>; test control): the index by default, as
        # on most hosts (both follow the PCI order), which a test may change (the driver numbers GPUs
        # in the order it probes them, NVML indexes them by PCI bus id)
        self.minors = list(range(count))
        # False: /proc/driver/nvidia-caps/mig-minors cannot be read (`mig_cap_minors` answers empty)
        self.mig_minors_visible = True
        self.ops: list[FakeOp] = []
        self.before_op: Callable[[FakeOp], None] | None = None
        self._crash_in: int | None = None
        self.unhealthy: dict[int, str] = {}  # GPU index -> why health() says it is unhealthy (test control)
        self.lost: set[int] = set()  # GPUs fallen off the bus (`lose`)
        self.lost_calls = 0  # calls that failed with GPU_IS_LOST (a lost GPU is to be left alone)
        self.read_delay_s = 0.0  # each read takes this long (test control: a slow driver)
        self.change_delay_s = 0.0  # each change takes this long
        self.hung_calls = 0  # calls blocked by `hang()` now
        self._answering = threading.Event()  # cleared by `hang()`
        self._answering.set()
        self._hung_lock = threading.Lock()
        self._lock = threading.RLock()  # (re-entrant: a `before_op` hook may call test controls)

    # --- test controls ---

    def hang(self) -> None:
        """The driver stops answering (a GPU fallen off the bus mid-call, a wedged driver): every
        GpuDriver call blocks, in the thread that made it, until `unhang()`."""
        self._answering.clear()

    def unhang(self) -> None:
        self._answering.set()

    @_locked
    def crash_after(self, n: int) -> None:
        """Let `n` more mutating calls through, then raise SimulatedCrash on the next one."""
        self._crash_in = n

    @_locked
    def attach(self, index: int, pid: int, gi_id: int | None = None, through_mps: bool = False) -> None:
        gpu = self._gpu(index)
        if gi_id is None:
            if gpu.compute_mode == PROHIBITED:
                raise ContextRefused(f"GPU {index} is in PROHIBITED compute mode")
            if gpu.compute_mode == EXCLUSIVE_PROCESS and gpu.pids - {pid} and not through_mps:
                raise ContextRefused(f"GPU {index} is in EXCLUSIVE_PROCESS compute mode and process "
                                     f"{min(gpu.pids - {pid})} has a context on it")
            gpu.pids.add(pid)
            return
        gi = self._gi(gpu, gi_id)
        if gi.ci is None and not gi.more:
            raise GpuDriverError(NOT_FOUND, f"GPU {index} GI {gi_id} has no compute instance to run on")
        gi.pids.add(pid)

    @_locked
    def hold(self, index: int, client: str = "dcgm", gi_id: int | None = None) -> None:
        """A client that keeps GPU `index` (or its GPU instance `gi_id`) open without computing on
        it (DCGM, dcgm-exporter, GPU feature discovery, a device plugin, a leaked handle): not in
        `processes()`, yet the GPU is not idle, so a MIG mode change is left pending (activation
        status IN_USE); a held GPU instance cannot be destroyed (IN_USE)."""
        gpu = self._gpu(index)
        (gpu.holders if gi_id is None else self._gi(gpu, gi_id).holders).add(client)

    @_locked
    def release(self, index: int, client: str = "dcgm", gi_id: int | None = None) -> None:
        gpu = self._gpu(index)
        (gpu.holders if gi_id is None else self._gi(gpu, gi_id).holders).discard(client)

    @_locked
    def split(self, index: int, gi_id: int, parts: int) -> list[str]:
        """Another tool (mig-parted, `nvidia-smi mig -cci`) splits GPU instance `gi_id` into
        `parts` compute instances smaller than itself (1: one), each a MIG device with its own UUID
        (ids 0..parts-1, the first keeping the instance's UUID). The agent never makes these;
        returns the UUIDs."""
        gpu = self._gpu(index)
        gi = self._gi(gpu, gi_id)
        gi.ci = 0
        gi.uuid = self._mig_uuid(gpu, gi_id, 0)
        gi.more = {ci: self._mig_uuid(gpu, gi_id, ci) for ci in range(1, parts)}
        gi.smaller = True
        return [gi.uuid, *gi.more.values()]

    def _mig_uuid(self, gpu: _FakeGpu, gi_id: int, ci: int) -> str:
        return f"MIG-{uuidlib.uuid5(self._machine, f'{gpu.uuid}/{gi_id}/{ci}')}"

    @_locked
    def lose(self, index: int) -> None:
        """GPU `index` falls off the bus (Xid 79): NVML answers GPU_IS_LOST for it until a reset
        (`devices()` lists it `lost`; a call on it counts in `lost_calls`); the other GPUs answer."""
        self._gpu(index)
        self.lost.add(index)

    @_locked
    def detach(self, index: int, pid: int) -> None:
        gpu = self._gpu(index)
        gpu.pids.discard(pid)
        for gi in gpu.gis.values():
            gi.pids.discard(pid)

    @_driver_call(read=True)
    def health(self, index: int) -> str | None:
        if index in self.lost:  # (as RealNvml.health: the handle cannot be read)
            return "NVML cannot read it: GPU is lost"
        self._gpu(index)
        return self.unhealthy.get(index)

    @_driver_call(read=True)
    def minor_number(self, index: int) -> int:
        self._gpu(index)
        return self.minors[index]

    @_driver_call(read=True)
    def mig_cap_minors(self) -> dict[str, int]:
        # the driver's fixed table (nv-caps.c), whatever GPUs there are, as the real file lists it
        return driver_mig_minors() if self.mig_minors_visible else {}

    @_locked
    def reset(self, index: int) -> None:
        """A GPU reset: instances lost, a pending MIG mode applied, a lost GPU back."""
        self.lost.discard(index)
        gpu = self._gpu(index)
        gpu.gis.clear()
        gpu.pids.clear()
        gpu.mig_current = gpu.mig_pending
        gpu.compute_mode = DEFAULT_COMPUTE

    @_locked
    def reboot(self) -> None:
        self.lost.clear()
        for gpu in self._gpus:
            gpu.gis.clear()
            gpu.pids.clear()
            gpu.mig_current = gpu.mig_pending = gpu.mig_pending and self.mig_persists
            gpu.compute_mode = DEFAULT_COMPUTE

    @_locked
    def gi_at(self, index: int, start: int) -> int | None:
        for gi in self._gpu(index).gis.values():
            if gi.start == start:
                return gi.gi_id
        return None

    @_locked
    def layout(self, index: int) -> list[tuple[str, int]]:
        """(profile, start) of the complete instances (GI with its CI), sorted by start."""
        return sorted(((g.profile.name, g.start) for g in self._gpu(index).gis.values() if g.ci is not None),
                      key=lambda x: (x[1], x[0]))

    # --- GpuDriver ---

    @_driver_call(read=True)
    def versions(self) -> DriverVersions:
        return DriverVersions("fake", "fake", "fake")

    @_driver_call(read=True)
    def devices(self) -> list[DeviceInfo]:
        # a lost GPU is listed `lost`, as RealNvml lists it (its handle fails, the others' do not):
        # as last read (RealNvml remembers it; the fake's GPU state is what was last read)
        return [DeviceInfo(g.index, self.name, g.uuid, self.memory_mib, self.model.supports_mig,
                           g.mig_current, g.mig_pending, self.reserved_mib, lost=g.index in self.lost)
                for g in self._gpus]

    @_driver_call(read=False)
    def set_mig_mode(self, index: int, enabled: bool) -> None:
        gpu = self._gpu(index)
        op = self._begin(FakeOp("set_mig_mode", index, profile="enable" if enabled else "disable"))
        if not self.model.supports_mig:
            self._fail(op, NOT_SUPPORTED, f"GPU {index} ({self.model.name}) does not support MIG")
        if not self.root:  # (nvml.h: requires root)
            self._fail(op, NO_PERMISSION, f"GPU {index}: changing the MIG mode needs root")
        if not enabled and gpu.gis:
            self._fail(op, IN_USE, f"GPU {index} still has GPU instances; MIG mode not changed")
        gpu.mig_pending = enabled
        if enabled == gpu.mig_current:
            return  # nothing to activate (a pending change the other way is cancelled)
        activation = None
        if self.mode_needs_reset:
            activation = RESET_REQUIRED
        elif gpu.pids or gpu.holders or any(g.pids for g in gpu.gis.values()):
            activation = IN_USE  # the driver could not unbind the GPU: not idle
        if activation is not None:
            op.result = f"pending:{activation}"
            raise MigModePending(index, enabled, activation)
        gpu.mig_current = enabled

    @_driver_call(read=True)
    def compute_mode(self, index: int) -> str:
        return self._gpu(index).compute_mode

    @_driver_call(read=False)
    def set_compute_mode(self, index: int, mode: str) -> None:
        gpu = self._gpu(index)
        op = self._begin(FakeOp("set_compute_mode", index, profile=mode))
        if mode not in COMPUTE_MODES:
            self._fail(op, INVALID_ARGUMENT, f"compute mode {mode!r} is not one of {', '.join(COMPUTE_MODES)}")
        if not self.root:
            self._fail(op, NO_PERMISSION, f"GPU {index}: setting the compute mode needs root")
        gpu.compute_mode = mode

    @_driver_call(read=True)
    def gpu_instances(self, index: int) -> list[GpuInstanceInfo]:
        gpu = self._gpu(index)
        if not gpu.mig_current and self._profiles(index):
            # as RealNvml: nvmlDeviceGetGpuInstances answers NOT_SUPPORTED without MIG mode (nvml.h);
            # (a driver that lists no profile then is never asked: an empty list)
            raise GpuDriverError(NOT_SUPPORTED, f"GPU {index}: MIG mode is disabled")
        return [self._instance_info(g) for g in sorted(gpu.gis.values(), key=lambda g: g.gi_id)]

    @staticmethod
    def _instance_info(g: _FakeGi) -> GpuInstanceInfo:
        # its compute instances' MIG devices in id order: the first is the instance's `uuid`
        cis = sorted(([] if g.ci is None else [g.ci]) + list(g.more))
        uuids = [g.more[ci] if ci in g.more else g.uuid or "" for ci in cis]
        return GpuInstanceInfo(g.gi_id, g.profile.gi_profile_id, g.start, g.profile.memory, tuple(cis),
                               uuids[0] if uuids else None, tuple(uuids[1:]), ci_smaller=g.smaller and bool(cis))

    @_driver_call(read=False)
    def create_gpu_instance(self, index: int, profile_id: int, start: int, size: int) -> int:
        gpu = self._gpu(index)
        profile = self._by_id.get(profile_id)
        op = self._begin(FakeOp("create_gi", index, profile=profile.name if profile else str(profile_id), start=start))
        if not gpu.mig_current:
            self._fail(op, NOT_SUPPORTED, f"GPU {index}: MIG mode is disabled")
        if not self.root:  # (nvml.h: requires a privileged user)
            self._fail(op, NO_PERMISSION, f"GPU {index}: creating a GPU instance needs root")
        if profile is None:
            self._fail(op, INVALID_ARGUMENT, f"GPU {index}: no GPU instance profile id {profile_id}")
        if size != profile.memory or start not in profile.starts:
            self._fail(op, INVALID_ARGUMENT, f"GPU {index}: placement {start}:{size} is not valid for {profile.name}")
        existing = [(g.profile.name, g.start) for g in gpu.gis.values()]
        broken = self.rules.violations([*existing, (profile.name, start)])
        if broken:
            self._fail(op, INSUFFICIENT_RESOURCES, f"GPU {index}: {profile.name}@{start}: {broken[0]}")
        gi_id = self._gi_id(gpu, start, profile.memory)
        gpu.gis[gi_id] = _FakeGi(gi_id, profile, start)
        op.gi_id = gi_id
        return gi_id

    @_driver_call(read=False)
    def create_compute_instance(self, index: int, gi_id: int, slices: int) -> int:
        gpu = self._gpu(index)
        gi = gpu.gis.get(gi_id)
        op = self._begin(FakeOp("create_ci", index, gi_id, gi.profile.name if gi else None, gi.start if gi else None))
        self._check_mig_change(op, gpu)
        if gi is None:
            self._fail(op, NOT_FOUND, f"GPU {index}: no GPU instance {gi_id}")
        if slices != gi.profile.compute:
            self._fail(op, INVALID_ARGUMENT, f"GPU {index} GI {gi_id}: a full compute instance has "
                                             f"{gi.profile.compute} slices, not {slices}")
        if gi.ci is not None or gi.more:
            self._fail(op, INSUFFICIENT_RESOURCES, f"GPU {index} GI {gi_id} already has a compute instance")
        gi.ci = 0
        gi.smaller = False
        gi.uuid = self._mig_uuid(gpu, gi_id, 0)
        return gi.ci

    @_driver_call(read=False)
    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        gpu = self._gpu(index)
        gi = gpu.gis.get(gi_id)
        op = self._begin(FakeOp("destroy_ci", index, gi_id, gi.profile.name if gi else None, gi.start if gi else None))
        self._check_mig_change(op, gpu)
        if gi is None or (gi.ci != ci_id and ci_id not in gi.more):
            self._fail(op, NOT_FOUND, f"GPU {index}: no compute instance {ci_id} in GI {gi_id}")
        if gi.pids:
            self._fail(op, IN_USE, f"GPU {index} GI {gi_id}: processes {sorted(gi.pids)} are running on it")
        if gi.holders:
            self._fail(op, IN_USE, f"GPU {index} GI {gi_id}: held open by {', '.join(sorted(gi.holders))}")
        if ci_id in gi.more:
            del gi.more[ci_id]
            return
        gi.ci = None
        gi.uuid = None

    @_driver_call(read=False)
    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        gpu = self._gpu(index)
        gi = gpu.gis.get(gi_id)
        op = self._begin(FakeOp("destroy_gi", index, gi_id, gi.profile.name if gi else None, gi.start if gi else None))
        self._check_mig_change(op, gpu)
        if gi is None:
            self._fail(op, NOT_FOUND, f"GPU {index}: no GPU instance {gi_id}")
        if gi.ci is not None or gi.more or gi.pids or gi.holders:
            self._fail(op, IN_USE, f"GPU {index} GI {gi_id} still has a compute instance or is held open")
        del gpu.gis[gi_id]

    @_driver_call(read=True)
    def processes(self, index: int, gi_id: int | None = None) -> list[int]:
        gpu = self._gpu(index)
        if self.own_pid_namespace:  # (see __init__: the driver leaves out pids the caller cannot see)
            return []
        if gi_id is None:
            return sorted(gpu.pids.union(*(g.pids for g in gpu.gis.values())))
        # as RealNvml: the processes of the GI's MIG devices, of which one that is gone has none
        gi = gpu.gis.get(gi_id)
        return sorted(gi.pids) if gi is not None else []

    @_driver_call(read=True)
    def profile_info(self, index: int, nvml_name: str) -> ProfileInfo | None:
        return next((p for p in self._profiles(index) if f"NVML_GPU_INSTANCE_PROFILE_{p.nvml}" == nvml_name), None)

    @_driver_call(read=True)
    def gpu_instance_profiles(self, index: int) -> list[ProfileInfo]:
        return self._profiles(index)

    def _profiles(self, index: int) -> list[ProfileInfo]:
        gpu = self._gpu(index)
        if not self.model.supports_mig or self.profiles_need_mig and not gpu.mig_current:
            return []
        # listed whatever the MIG mode, as the real driver does (tests/fixtures/nvml: an H100 and
        # an H200, MIG mode off). The memory in MiB is a fraction of the GPU's; the real one is a little
        # less (16,384 of 143,771 MiB for an H200's 1g.18gb) and nothing here reads it.
        return [ProfileInfo(p.gi_profile_id, p.compute, p.max,
                            self.memory_mib * p.memory // max(1, self.model.memory_slices),
                            f"MIG {p.name}", p.nvml.removeprefix("NVML_GPU_INSTANCE_PROFILE_"))
                for p in self.model.mig_profiles]

    @_driver_call(read=True)
    def possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        self._gpu(index)
        p = self._by_id.get(profile_id)
        if p is None:  # (nvml.h: NOT_SUPPORTED for a profile the device does not support)
            raise GpuDriverError(NOT_SUPPORTED, f"GPU {index}: no GPU instance profile id {profile_id}")
        return [(s, p.memory) for s in p.starts]

    # --- internals ---

    def _answer(self, read: bool) -> None:
        delay = self.read_delay_s if read else self.change_delay_s
        if delay:
            time.sleep(delay)
        if not self._answering.is_set():
            with self._hung_lock:
                self.hung_calls += 1
            self._answering.wait()
            with self._hung_lock:
                self.hung_calls -= 1

    def _gi_id(self, gpu: _FakeGpu, start: int, size: int) -> int:
        if self.model.memory_slices == 8 and size in (1, 2, 4, 8):
            # one id per placement: instances on the GPU never overlap, so never the same id
            return {8: 0, 4: 1 + start // 4, 2: 3 + start // 2, 1: 7 + start}[size]
        return next(i for i in range(len(gpu.gis) + 1) if i not in gpu.gis)

    def _gpu(self, index: int) -> _FakeGpu:
        if not 0 <= index < len(self._gpus):
            raise GpuDriverError(INVALID_ARGUMENT, f"no GPU with index {index}")
        if index in self.lost:
            self.lost_calls += 1
            raise GpuDriverError(GPU_IS_LOST, f"GPU {index} is lost (fallen off the bus): reset it or reboot")
        return self._gpus[index]

    def _check_mig_change(self, op: FakeOp, gpu: _FakeGpu) -> None:
        # RealNvml looks the GPU instance up first (nvmlDeviceGetGpuInstanceById): NOT_SUPPORTED
        # without MIG mode; creating and destroying instances need a privileged user (nvml.h)
        if not gpu.mig_current:
            self._fail(op, NOT_SUPPORTED, f"GPU {gpu.index}: MIG mode is disabled")
        if not self.root:
            self._fail(op, NO_PERMISSION, f"GPU {gpu.index}: changing GPU instances needs root")

    def _gi(self, gpu: _FakeGpu, gi_id: int) -> _FakeGi:
        gi = gpu.gis.get(gi_id)
        if gi is None:
            raise GpuDriverError(NOT_FOUND, f"GPU {gpu.index}: no GPU instance {gi_id}")
        return gi

    def _begin(self, op: FakeOp) -> FakeOp:
        if self._crash_in is not None:
            if self._crash_in <= 0:
                self._crash_in = None
                raise SimulatedCrash(f"simulated crash before {op.op} on GPU {op.device}")
            self._crash_in -= 1
        if self.before_op is not None:
            self.before_op(op)
        self.ops.append(op)
        return op

    @staticmethod
    def _fail(op: FakeOp, code: str, message: str) -> NoReturn:
        op.result = code
        raise GpuDriverError(code, message)
