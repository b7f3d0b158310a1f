"""`RealNvml`: the GpuDriver on the host's NVML through nvidia-ml-py (`import pynvml`).

CI has no GPU: it runs this code on what real GPUs answered (`driver.nvml_recording`, the
recordings in tests/fixtures/nvml: its read paths; the MIG instance paths need MIG mode on and
have not been recorded). `dynpart agent probe` checks it read-only on a GPU host.
Written against nvidia-ml-py 13.x; the calls are those of the facts file section 2. pynvml
gives raw ctypes function pointers without argtypes, so pointer arguments (placements, arrays,
counts) are passed with `byref` / as arrays exactly as the C prototypes in nvml.h want them.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from dynpart.agent.driver.interface import (
    DEFAULT_COMPUTE,
    EXCLUSIVE_PROCESS,
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    NO_PERMISSION,
    PROHIBITED,
    DeviceInfo,
    DriverVersions,
    GpuDriverError,
    GpuInstanceInfo,
    MigModePending,
    NvmlUnavailable,
    ProfileInfo,
)
from dynpart.agent.driver.nvcaps import MIG_MINORS_FILE, parse_mig_minors

T = TypeVar("T")

# NVML errors after which its state is useless until nvmlShutdown/nvmlInit (nvml.h): the driver
# was reloaded or lost a GPU, or NVML was shut down under us. Not RESET_REQUIRED: that one GPU
# needs a reset, the others' handles are fine (and a re-init costs seconds per GPU without
# persistence mode). GPU_IS_LOST on a GPU already known lost does not start NVML again (`_lost`)
_REINIT = frozenset({"UNINITIALIZED", "GPU_IS_LOST", "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH"})

# A GPU that stays lost (fallen off the bus until a reset or a reboot) answers GPU_IS_LOST on every
# pass: NVML is started again when it is first found lost, then at most this often while it stays
# lost, in case a GPU reset brought it back where only a new nvmlInit sees it (its handle is tried
# on every pass: one that answers again is read at once)
LOST_REINIT_S = 300.0

# compute slices of a full-GI compute instance -> NVML_COMPUTE_INSTANCE_PROFILE_* name
_CI_PROFILE = {1: "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE", 2: "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
               3: "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE", 4: "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
               6: "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE", 7: "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
               8: "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE"}


def _load_pynvml() -> Any:
    # Imported here, not at the top: the agent (and its tests) must import without a GPU.
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - the package is a dependency
        raise NvmlUnavailable(f"NVML not available: the nvidia-ml-py package is not installed ({e})") from None
    return pynvml


class RealNvml:
    """GpuDriver on the host's NVIDIA driver. Raises NvmlUnavailable when there is none.
    `nvml_module`: a pynvml module to use instead of the imported one (a recording or a replay,
    `driver.nvml_recording`)."""

    def __init__(self, nvml_module: Any = None) -> None:
        nv = _load_pynvml() if nvml_module is None else nvml_module
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise NvmlUnavailable(f"NVML not available: no NVIDIA driver on this host (pynvml: {e})") from None
        except OSError as e:  # a broken libnvidia-ml
            raise NvmlUnavailable(f"NVML not available: cannot load libnvidia-ml ({e})") from None
        self._nv = nv
        self._stale = False
        self.mig_minors_file = MIG_MINORS_FILE  # (`mig_cap_minors`)
        self.lost_reinit_s = LOST_REINIT_S
        # GPU index -> time.monotonic() NVML was last started again for it, while it answers GPU_IS_LOST
        self._lost: dict[int, float] = {}
        self._known: dict[int, DeviceInfo] = {}  # GPU index -> as last read (what a lost GPU is listed as)
        self._reading: int | None = None  # the GPU devices() reads now
        self._codes = {getattr(nv, n): n[len("NVML_ERROR_"):] for n in dir(nv)
                       if n.startswith("NVML_ERROR_") and isinstance(getattr(nv, n), int)}

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass

    # --- plumbing ---

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._stale:
            self._reinit()
        try:
            return fn(*args)
        except self._nv.NVMLError as e:
            code = self._codes.get(getattr(e, "value", None), "UNKNOWN")
            if code == GPU_IS_LOST and self._reading is not None:
                self._found_lost(self._reading)  # (a GPU known lost is not started again for at each pass)
            elif code in _REINIT:
                self._stale = True  # the next call starts NVML again instead of failing for ever
            raise GpuDriverError(code, f"{fn.__name__}: {e}") from None

    def _reinit(self) -> None:
        """nvmlShutdown + nvmlInit after a driver error that leaves NVML's handles useless (the
        driver reloaded, a GPU reset or lost): handles are looked up again on every call."""
        nv = self._nv
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise GpuDriverError(self._codes.get(getattr(e, "value", None), "UNKNOWN"),
                                 f"NVML could not be started again: {e}") from None
        self._stale = False

    def _handle(self, index: int) -> Any:
        """GPU `index`'s handle. GPU_IS_LOST (that GPU fell off the bus: the others answer) starts
        NVML again only the first time and then every `lost_reinit_s` (`_found_lost`), not at each
        call: a re-init costs seconds per GPU without persistence mode, and a GPU lost for good
        would cost them on every pass."""
        nv = self._nv
        if self._stale:
            self._reinit()
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as e:
            code = self._codes.get(getattr(e, "value", None), "UNKNOWN")
            if code == GPU_IS_LOST:
                self._found_lost(index)
            elif code in _REINIT:
                self._stale = True
            raise GpuDriverError(code, f"nvmlDeviceGetHandleByIndex: {e}") from None
        return handle

    def _found_lost(self, index: int) -> None:
        """GPU `index` answered GPU_IS_LOST: NVML is started again at the next call if it was not
        known lost, or was started again for it over `lost_reinit_s` ago."""
        now = time.monotonic()
        since = self._lost.get(index)
        if since is None or now - since >= self.lost_reinit_s:
            self._lost[index] = now
            self._stale = True

    def _gi_handle(self, index: int, gi_id: int) -> Any:
        return self._call(self._nv.nvmlDeviceGetGpuInstanceById, self._handle(index), gi_id)

    def _gi_profile_infos(self, handle: Any) -> list[Any]:
        nv = self._nv
        out = []
        for enum in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = self._profile_info_raw(handle, enum)
            if info is not None:
                out.append(info)
        return out

    def _profile_info_raw(self, handle: Any, enum: int) -> Any | None:
        nv = self._nv
        try:
            try:
                return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            except nv.NVMLError_FunctionNotFound:  # drivers without the V2 entry point
                return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum, 1)
        except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
            return None
        except nv.NVMLError as e:
            code = self._codes.get(getattr(e, "value", None), "UNKNOWN")
            raise GpuDriverError(code, f"nvmlDeviceGetGpuInstanceProfileInfo: {e}") from None

    def _mig_devices(self, handle: Any) -> dict[int, list[Any]]:
        """GI id -> its MIG device handles, one per compute instance (the agent creates one full
        CI per GI; a GI split into several CIs by another tool has several)."""
        nv = self._nv
        out: dict[int, list[Any]] = {}
        for i in range(self._call(nv.nvmlDeviceGetMaxMigDeviceCount, handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument):
                continue
            except nv.NVMLError as e:
                raise GpuDriverError(self._codes.get(e.value, "UNKNOWN"), f"nvmlDeviceGetMigDeviceHandleByIndex: {e}") from None
            out.setdefault(self._call(nv.nvmlDeviceGetGpuInstanceId, mig), []).append(mig)
        return out

    # --- GpuDriver ---

    def versions(self) -> DriverVersions:
        nv = self._nv
        cuda = int(self._call(nv.nvmlSystemGetCudaDriverVersion_v2))  # 1000 * major + 10 * minor
        return DriverVersions(str(self._call(nv.nvmlSystemGetDriverVersion)),
                              str(self._call(nv.nvmlSystemGetNVMLVersion)), f"{cuda // 1000}.{cuda % 1000 // 10}")

    def devices(self) -> list[DeviceInfo]:
        """Every GPU; one that answers GPU_IS_LOST (fallen off the bus: NVML answers so for its own
        calls only, as nvidia-smi lists the others and says "Unable to determine the device handle
        for GPU ...: GPU is lost") is listed `lost`, as last read."""
        out = []
        for index in range(self._call(self._nv.nvmlDeviceGetCount)):
            self._reading = index
            try:
                device = self._device(index)
            except GpuDriverError as e:
                if e.code != GPU_IS_LOST:
                    raise
                self._found_lost(index)
                known = self._known.get(index)
                out.append(replace(known, lost=True) if known is not None
                           else DeviceInfo(index, "", "", 0, False, False, False, lost=True))
                continue
            finally:
                self._reading = None
            self._known[index] = device
            self._lost.pop(index, None)  # (back, after a reset)
            out.append(device)
        return out

    def _device(self, index: int) -> DeviceInfo:
        nv = self._nv
        h = self._handle(index)
        name = self._call(nv.nvmlDeviceGetName, h)
        uuid = self._call(nv.nvmlDeviceGetUUID, h)
        memory, reserved = self._memory(h)
        try:
            current, pending = nv.nvmlDeviceGetMigMode(h)
            capable = True
        except nv.NVMLError_NotSupported:
            current = pending = 0
            capable = False
        except nv.NVMLError as e:
            raise GpuDriverError(self._codes.get(e.value, "UNKNOWN"), f"nvmlDeviceGetMigMode: {e}") from None
        return DeviceInfo(index, str(name), str(uuid), memory, capable, current == nv.NVML_DEVICE_MIG_ENABLE,
                          pending == nv.NVML_DEVICE_MIG_ENABLE, reserved)

    def _memory(self, handle: Any) -> tuple[int, int | None]:
        """The GPU's total memory and what the driver reserves of it, in MiB. Version 2 of
        nvmlDeviceGetMemoryInfo says the reserved part (R510 and later); a library without it, or a
        driver refusing that version, leaves only the total (version 1: its `used` counts the
        reserved memory with what processes hold, so it tells nothing once a pod runs)."""
        nv = self._nv
        try:
            m = self._call(nv.nvmlDeviceGetMemoryInfo, handle, nv.nvmlMemory_v2)
            # reserved rounded up, as nvidia-smi shows it (615.06 MiB read as used by version 1 on
            # an H200, 616 MiB "Reserved"): the total less it is then never above what is free
            return int(m.total) >> 20, -(-int(m.reserved) >> 20)
        except GpuDriverError as e:
            if e.code not in ("FUNCTION_NOT_FOUND", "NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH"):
                raise
        return int(self._call(nv.nvmlDeviceGetMemoryInfo, handle).total) >> 20, None

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        nv = self._nv
        mode = nv.NVML_DEVICE_MIG_ENABLE if enabled else nv.NVML_DEVICE_MIG_DISABLE
        # pynvml returns the activation status (nvml.h): SUCCESS, the new mode is active; else it
        # is pending (devices() shows mig_pending != mig_current) and the status says why: IN_USE,
        # the GPU was not idle (another client holds it: idle it and ask again); RESET_REQUIRED,
        # only a GPU reset (or a VM reboot) applies it.
        status = self._call(nv.nvmlDeviceSetMigMode, self._handle(index), mode)
        if status:  # (None from a binding that does not return it: taken as activated)
            raise MigModePending(index, enabled, self._codes.get(int(status), f"UNKNOWN ({int(status)})"))

    def gpu_instances(self, index: int) -> list[GpuInstanceInfo]:
        nv = self._nv
        h = self._handle(index)
        migs = self._mig_devices(h)
        seen: dict[int, GpuInstanceInfo] = {}
        for info in self._gi_profile_infos(h):
            n = max(1, int(info.instanceCount))
            arr = (nv.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(0)
            self._call(nv.nvmlDeviceGetGpuInstances, h, info.id, arr, ctypes.byref(count))
            for gi in arr[: count.value]:
                gi_info = self._call(nv.nvmlGpuInstanceGetInfo, gi)
                if gi_info.id in seen:
                    continue
                uuids = [str(self._call(nv.nvmlDeviceGetUUID, m)) for m in migs.get(gi_info.id, ())]
                cis = self._compute_instances(gi)
                gi_slices = getattr(info, "sliceCount", None)
                seen[gi_info.id] = GpuInstanceInfo(
                    int(gi_info.id), int(gi_info.profileId), int(gi_info.placement.start),
                    int(gi_info.placement.size), tuple(sorted(ci for ci, _ in cis)), uuids[0] if uuids else None,
                    tuple(uuids[1:]),
                    ci_smaller=gi_slices is not None and any(s is not None and s < int(gi_slices) for _, s in cis))
        return [seen[k] for k in sorted(seen)]

    def _compute_instances(self, gi: Any) -> list[tuple[int, int | None]]:
        """(id, compute slices of its profile, None where unknown) of each compute instance."""
        nv = self._nv
        ids: list[tuple[int, int | None]] = []
        for enum in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, enum, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue
            except nv.NVMLError as e:
                raise GpuDriverError(self._codes.get(e.value, "UNKNOWN"),
                                     f"nvmlGpuInstanceGetComputeInstanceProfileInfo: {e}") from None
            n = max(1, int(info.instanceCount))
            arr = (nv.c_nvmlComputeInstance_t * n)()
            count = ctypes.c_uint(0)
            self._call(nv.nvmlGpuInstanceGetComputeInstances, gi, info.id, arr, ctypes.byref(count))
            slices = getattr(info, "sliceCount", None)
            for ci in arr[: count.value]:
                ci_id = int(self._call(nv.nvmlComputeInstanceGetInfo, ci).id)
                if ci_id not in {i for i, _ in ids}:
                    ids.append((ci_id, None if slices is None else int(slices)))
        return sorted(ids, key=lambda x: x[0])

    def create_gpu_instance(self, index: int, profile_id: int, start: int, size: int) -> int:
        nv = self._nv
        placement = nv.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = size
        gi = self._call(nv.nvmlDeviceCreateGpuInstanceWithPlacement, self._handle(index), profile_id,
                        ctypes.byref(placement))
        return int(self._call(nv.nvmlGpuInstanceGetInfo, gi).id)

    def create_compute_instance(self, index: int, gi_id: int, slices: int) -> int:
        nv = self._nv
        name = _CI_PROFILE.get(slices)
        if name is None:
            raise GpuDriverError(INVALID_ARGUMENT, f"no compute-instance profile with {slices} slices")
        gi = self._gi_handle(index, gi_id)
        info = self._call(nv.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, getattr(nv, name),
                          nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        ci = self._call(nv.nvmlGpuInstanceCreateComputeInstance, gi, info.id)
        return int(self._call(nv.nvmlComputeInstanceGetInfo, ci).id)

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        nv = self._nv
        gi = self._gi_handle(index, gi_id)
        ci = self._call(nv.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id)
        self._call(nv.nvmlComputeInstanceDestroy, ci)

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self._call(self._nv.nvmlGpuInstanceDestroy, self._gi_handle(index, gi_id))

    def processes(self, index: int, gi_id: int | None = None) -> list[int]:
        nv = self._nv
        handles = [self._handle(index)]
        if gi_id is not None:
            # every compute instance of the GI: a process on any of them uses it
            handles = self._mig_devices(handles[0]).get(gi_id, [])  # none: nothing can run there
        return sorted({int(p.pid) for h in handles for p in self._call(nv.nvmlDeviceGetComputeRunningProcesses, h)})

    def profile_info(self, index: int, nvml_name: str) -> ProfileInfo | None:
        enum = getattr(self._nv, nvml_name, None)
        if not isinstance(enum, int):
            return None
        info = self._profile_info_raw(self._handle(index), enum)
        return None if info is None else self._profile(info, nvml_name.removeprefix("NVML_GPU_INSTANCE_PROFILE_"))

    def gpu_instance_profiles(self, index: int) -> list[ProfileInfo]:
        nv = self._nv
        names = {getattr(nv, n): n.removeprefix("NVML_GPU_INSTANCE_PROFILE_") for n in dir(nv)
                 if n.startswith("NVML_GPU_INSTANCE_PROFILE_") and n != "NVML_GPU_INSTANCE_PROFILE_COUNT"
                 and isinstance(getattr(nv, n), int)}
        h = self._handle(index)
        out = []
        for enum in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = self._profile_info_raw(h, enum)
            if info is not None:
                out.append(self._profile(info, names.get(enum, "")))
        return out

    @staticmethod
    def _profile(info: Any, nvml: str) -> ProfileInfo:
        name = getattr(info, "name", b"")  # the V2 struct only
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        return ProfileInfo(int(info.id), int(info.sliceCount), int(info.instanceCount), int(info.memorySizeMB), name,
                           nvml)

    def possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        nv = self._nv
        h = self._handle(index)
        count = ctypes.c_uint(0)
        self._call(nv.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, None, ctypes.byref(count))
        arr = (nv.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
        self._call(nv.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, arr, ctypes.byref(count))
        return [(int(p.start), int(p.size)) for p in arr[: count.value]]

    def _recovery_action(self, handle: Any) -> str | None:
        """The recovery action the driver asks for after an error on the GPU (field
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, drivers from R550; set after an Xid that leaves the
        GPU unusable: GPU_RESET, NODE_REBOOT, DRAIN_P2P, DRAIN_AND_RESET), None when none is
        asked or the driver cannot say."""
        nv = self._nv
        field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return None
        try:
            values = nv.nvmlDeviceGetFieldValues(handle, [field])
        except Exception:  # an older driver or binding, a recording without the call: not known
            return None
        for v in values:
            if getattr(v, "nvmlReturn", 1) != nv.NVML_SUCCESS:
                return None
            action = int(v.value.uiVal)
            if action == getattr(nv, "NVML_GPU_RECOVERY_ACTION_NONE", 0):
                return None
            names = {getattr(nv, n): n.removeprefix("NVML_GPU_RECOVERY_ACTION_") for n in dir(nv)
                     if n.startswith("NVML_GPU_RECOVERY_ACTION_") and isinstance(getattr(nv, n), int)}
            return names.get(action, str(action))
        return None

    def compute_mode(self, index: int) -> str:
        nv = self._nv
        mode = int(self._call(nv.nvmlDeviceGetComputeMode, self._handle(index)))
        names = {nv.NVML_COMPUTEMODE_DEFAULT: DEFAULT_COMPUTE, nv.NVML_COMPUTEMODE_PROHIBITED: PROHIBITED,
                 nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: EXCLUSIVE_PROCESS}
        if mode not in names:
            raise GpuDriverError("UNKNOWN", f"GPU {index}: compute mode {mode} is not one NVML documents")
        return names[mode]

    def set_compute_mode(self, index: int, mode: str) -> None:
        nv = self._nv
        values = {DEFAULT_COMPUTE: nv.NVML_COMPUTEMODE_DEFAULT, PROHIBITED: nv.NVML_COMPUTEMODE_PROHIBITED,
                  EXCLUSIVE_PROCESS: nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}
        if mode not in values:
            raise GpuDriverError(INVALID_ARGUMENT, f"compute mode {mode!r} is not one of {', '.join(values)}")
        self._call(nv.nvmlDeviceSetComputeMode, self._handle(index), values[mode])

    def health(self, index: int) -> str | None:
        """Unhealthy when NVML cannot read the GPU any more (lost, fallen off the bus), when the
        driver asks for a recovery action after an error (a GPU reset, a reboot: the Xids that
        leave a GPU unusable set it), when memory rows wait for remapping or their remapping
        failed (Ampere and later), or when pages wait for retirement (before Hopper: a real H100
        and H200 answer NOT_SUPPORTED to page retirement, tests/fixtures/nvml). Not read: the Xid
        events themselves."""
        nv = self._nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            nv.nvmlDeviceGetUUID(h)
        except nv.NVMLError as e:
            return f"NVML cannot read it: {e}"
        action = self._recovery_action(h)
        if action is not None:
            return f"the driver asks for a recovery action ({action}) after an error on it (an Xid)"
        try:
            _corrected, _uncorrected, rows_pending, remap_failed = nv.nvmlDeviceGetRemappedRows(h)
        except nv.NVMLError:
            pass  # not supported on this GPU (before Ampere)
        else:
            if remap_failed:
                return "a memory row could not be remapped: the GPU's memory is failing"
            if rows_pending:
                return "memory rows wait for remapping: the GPU needs a reset"
        try:
            pending = nv.nvmlDeviceGetRetiredPagesPendingStatus(h)
        except nv.NVMLError:
            return None  # not supported on this GPU: nothing to say
        return "memory pages wait for retirement: the GPU needs a reset" if pending else None

    def minor_number(self, index: int) -> int:
        return int(self._call(self._nv.nvmlDeviceGetMinorNumber, self._handle(index)))

    def mig_cap_minors(self) -> dict[str, int]:
        """Read from `mig_minors_file` (not NVML: the driver's procfs, as NVIDIA's plugin reads it)."""
        try:
            with open(self.mig_minors_file, encoding="ascii", errors="replace") as f:
                return parse_mig_minors(f.read())
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise GpuDriverError(NO_PERMISSION, f"{self.mig_minors_file}: {e}") from None
