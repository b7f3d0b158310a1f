"""What the agent needs from the GPU driver: `GpuDriver`, the data it returns, its errors.

Identifiers follow NVML: a GPU by its index, a GPU instance (GI) by its id on that GPU, a
profile by its GI profile id (the `id` column of the catalog), placements in memory slices.
Calls are synchronous (NVML is a C library) and usually short, but a GPU fallen off the bus or a
wedged driver makes them take seconds or never return: the agent's event loop never makes them
itself, it awaits them through `driver.threaded.AsyncDriver` (one thread, a time limit per call).
Implementations: `driver.nvml.RealNvml` (the host's driver) and `driver.fake.FakeNvml` (tests,
`--fake-gpus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dynpart.errors import DynpartError

# Error codes (NVML_ERROR_* without the prefix) that the agent reacts to.
GPU_IS_LOST = "GPU_IS_LOST"
IN_USE = "IN_USE"
INSUFFICIENT_RESOURCES = "INSUFFICIENT_RESOURCES"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
NOT_SUPPORTED = "NOT_SUPPORTED"
RESET_REQUIRED = "RESET_REQUIRED"
NO_PERMISSION = "NO_PERMISSION"
# not NVML's: a call did not return within its time limit (`DriverNotResponding`)
NOT_RESPONDING = "NOT_RESPONDING"

# A GPU's compute mode (NVML_COMPUTEMODE_* without the prefix; EXCLUSIVE_THREAD is no longer
# supported by the driver): who may create a CUDA context on it. DEFAULT: any number of processes;
# EXCLUSIVE_PROCESS: one process at a time (an MPS server counts as one, its clients through it);
# PROHIBITED: none.
DEFAULT_COMPUTE = "DEFAULT"
EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"
PROHIBITED = "PROHIBITED"
COMPUTE_MODES = (DEFAULT_COMPUTE, EXCLUSIVE_PROCESS, PROHIBITED)


class GpuDriverError(DynpartError):
    """An NVML call failed; `code` is the NVML error name without `NVML_ERROR_`."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


def mig_pending_reason(index: int, code: str | None, enabled: bool = True) -> str:
    """Why GPU `index`'s MIG mode change is pending, given the activation status NVML returned
    when it was last asked (`code`; None: not asked since the agent started), and what to do."""
    mode = f"MIG mode {'enable' if enabled else 'disable'}"
    if code is None:
        return (f"GPU {index}: {mode} is pending (why is not known: the driver was not asked since this agent "
                "started); the agent asks again once the GPU is idle, else a GPU reset (nvidia-smi -r) applies it "
                "(a reboot does on Ampere; Hopper and later lose the pending mode at a reboot, and the agent asks "
                "again on the idle GPU)")
    if code == IN_USE:
        return (f"GPU {index}: {mode} is pending: the driver could not activate it because the GPU is not idle "
                "(activation status IN_USE); with no pod and no compute process on it, another client most likely "
                "holds it open, e.g. DCGM (nv-hostengine), dcgm-exporter, GPU feature discovery or a device plugin: "
                "stop those clients on this node (the agent asks again, after 30 s, then at most every 10 minutes) "
                "or reset the GPU "
                "(nvidia-smi -r) with them stopped")
    return (f"GPU {index}: {mode} is pending until the GPU is reset (activation status {code}); reset the GPU "
            "(nvidia-smi -r) to apply it (a reboot does on Ampere; Hopper and later lose the pending mode at a "
            "reboot, and the agent asks again on the idle GPU)")


class MigModePending(GpuDriverError):
    """`set_mig_mode` succeeded but the driver did not activate the new MIG mode: it stays
    pending (nvmlDeviceSetMigMode returned SUCCESS with an activation status). `code` is that
    status: IN_USE (the GPU is not idle, e.g. held by a monitoring client: ask again once it is),
    RESET_REQUIRED (only a GPU reset applies it, or on Ampere a reboot), or another NVML error name."""

    def __init__(self, index: int, enabled: bool, code: str):
        self.index = index
        self.enabled = enabled
        super().__init__(code, mig_pending_reason(index, code, enabled))

    @property
    def retryable(self) -> bool:
        """Asking again can succeed (once the GPU is idle) without a GPU reset."""
        return self.code == IN_USE


class DriverNotResponding(GpuDriverError):
    """A driver call has not returned within its time limit, and may never (a GPU fallen off the
    bus, a wedged driver), or another call has not yet and this one was not made. The agent treats
    it as NVML failing. A change that timed out may still happen: its outcome is unknown."""

    def __init__(self, message: str):
        super().__init__(NOT_RESPONDING, message)


class NvmlUnavailable(GpuDriverError):
    """No NVML on this host (no NVIDIA driver, or the binding is missing)."""

    def __init__(self, message: str):
        super().__init__("LIBRARY_NOT_FOUND", message)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str  # product name as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    uuid: str  # "GPU-..."
    memory_mib: int  # NVML's total
    mig_capable: bool
    mig_current: bool  # MIG mode now
    mig_pending: bool  # MIG mode after the next GPU reset
    # what the driver keeps of the total for itself (nvmlMemory_v2 `reserved`): not free even on an
    # idle GPU. None: the driver cannot say (no nvmlDeviceGetMemoryInfo_v2)
    reserved_mib: int | None = None
    # fallen off the bus (Xid 79): NVML answers GPU_IS_LOST for this GPU's handle, and only for it.
    # The other fields are as last read (empty, 0 and False when it was never read): the agent
    # makes no call on it, lists its devices Unhealthy and reports its slices as last known, used
    lost: bool = False


# why a lost GPU (`DeviceInfo.lost`) is unhealthy, as the agent reports it
GPU_LOST_REASON = ("fallen off the bus: NVML answers GPU_IS_LOST for it (Xid 79); reset it (nvidia-smi -r) or reboot "
                   "the node")


@dataclass(frozen=True)
class GpuInstanceInfo:
    gi_id: int
    profile_id: int  # GI profile id (catalog `id`)
    start: int  # placement, in memory slices
    size: int
    compute_instances: tuple[int, ...]  # compute-instance ids
    uuid: str | None  # MIG device UUID ("MIG-..."), None while it has no compute instance
    # the MIG devices of its other compute instances: a GPU instance split into several by another
    # tool (the agent makes one full compute instance per GPU instance), each a device of its own
    more_uuids: tuple[str, ...] = ()
    # a compute instance of fewer compute slices than the GPU instance (made by another tool)
    ci_smaller: bool = False

    @property
    def split(self) -> bool:
        """Split into compute instances smaller than itself, not made by the agent (which makes one
        full one): left alone, not advertised as its profile."""
        return len(self.compute_instances) > 1 or self.ci_smaller


@dataclass(frozen=True)
class ProfileInfo:
    profile_id: int
    slices: int  # compute slices (NVML sliceCount)
    instance_count: int  # most instances of the profile on the GPU
    memory_mib: int
    name: str = ""  # the driver's name for it, e.g. "MIG 1g.10gb" (empty if unknown)
    nvml: str = ""  # the NVML_GPU_INSTANCE_PROFILE_* constant it was read with (empty if unknown)


@dataclass(frozen=True)
class DriverVersions:
    driver: str  # the kernel driver, e.g. "580.159.04"
    nvml: str  # the NVML library, e.g. "13.580.159.04"
    cuda: str  # the CUDA version the driver supports, e.g. "13.0"


class GpuDriver(Protocol):
    """The NVML operations the agent uses. Failures raise GpuDriverError."""

    def versions(self) -> DriverVersions: ...

    def devices(self) -> list[DeviceInfo]:
        """Every GPU of the node. One NVML cannot reach (GPU_IS_LOST: fallen off the bus) is listed
        with `lost` set, as last read; the others as they are."""
        ...

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        """Change GPU `index`'s MIG mode. Raises MigModePending when the call succeeded but the new
        mode was not activated (it stays pending; `code` says why), GpuDriverError when it failed."""
        ...

    def gpu_instances(self, index: int) -> list[GpuInstanceInfo]: ...

    def create_gpu_instance(self, index: int, profile_id: int, start: int, size: int) -> int:
        """Create a GI at an explicit placement; returns its id."""
        ...

    def create_compute_instance(self, index: int, gi_id: int, slices: int) -> int:
        """Create the compute instance covering the whole GI (`slices` compute slices)."""
        ...

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None: ...

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None: ...

    def processes(self, index: int, gi_id: int | None = None) -> list[int]:
        """Pids computing on a GI's MIG device, or on the whole GPU (gi_id None)."""
        ...

    def profile_info(self, index: int, nvml_name: str) -> ProfileInfo | None:
        """The driver's view of a NVML_GPU_INSTANCE_PROFILE_* profile; None if unsupported."""
        ...

    def gpu_instance_profiles(self, index: int) -> list[ProfileInfo]:
        """Every GPU-instance profile the driver offers on GPU `index`, read with each
        NVML_GPU_INSTANCE_PROFILE_* constant, whatever the GPU's MIG mode: a real H100 and H200 on
        driver 580.159.04 list them, with their placements, while MIG mode is off (tests/fixtures/nvml);
        empty on a GPU without MIG, and possibly on older drivers while MIG mode is off."""
        ...

    def possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        """Every (start, size) the profile may be created at on an empty GPU."""
        ...

    def compute_mode(self, index: int) -> str:
        """GPU `index`'s compute mode, one of COMPUTE_MODES (nvmlDeviceGetComputeMode)."""
        ...

    def set_compute_mode(self, index: int, mode: str) -> None:
        """Set GPU `index`'s compute mode (nvmlDeviceSetComputeMode: root only, NO_PERMISSION
        otherwise; it holds until changed again, a GPU reset or a reboot, and applies to contexts
        created from then on: one that exists stays)."""
        ...

    def health(self, index: int) -> str | None:
        """Why GPU `index` must not be given to pods (None: healthy). Its devices (whole, MIG,
        MPS slices) are then advertised Unhealthy."""
        ...

    def minor_number(self, index: int) -> int:
        """GPU `index`'s device minor number (nvmlDeviceGetMinorNumber): its node is
        /dev/nvidia<minor>, and the MIG capabilities name it by it (`driver.nvcaps`). Not always its
        index."""
        ...

    def mig_cap_minors(self) -> dict[str, int]:
        """The driver's MIG capability minors (/proc/driver/nvidia-caps/mig-minors, parsed by
        `driver.nvcaps.parse_mig_minors`): capability (`gpu<minor>/gi<id>/access`,
        `gpu<minor>/gi<id>/ci<id>/access`, `config`, `monitor`) -> the minor of its node
        /dev/nvidia-caps/nvidia-cap<minor>. Empty where the file is not there (no MIG-capable driver,
        or not visible to the agent)."""
        ...
