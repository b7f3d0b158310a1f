"""A stand-in for libnvidia-ml at its C boundary, for testing the recorder without a GPU: the C
functions the agent's reads reach, taking ctypes arguments as nvidia-ml-py passes them and
writing their answers through the pointers, as the library does. One GPU of a catalog model, MIG
mode on or off, no GPU instance. Any other function answers NVML_ERROR_NOT_SUPPORTED.

This is not the fixture CI trusts for real answers (that is the recording in tests/fixtures/nvml);
it only gives the recorder something to record."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

from dynpart.catalog import GpuModel

SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, INSUFFICIENT_SIZE = 0, 2, 3, 4, 6, 7
ARGUMENT_VERSION_MISMATCH = 25


def _put(arg: Any, value: Any) -> None:
    arg._obj.value = value


def _put_text(buffer: Any, text: str) -> None:
    data = text.encode()
    ctypes.memmove(ctypes.addressof(buffer), data, len(data))


class SimulatedNvmlLibrary:
    HANDLE = 0x5000

    def __init__(self, model: GpuModel, name: str, memory_mib: int, *, mig: bool = True):
        self.model, self.name, self.memory_mib, self.mig = model, name, memory_mib, mig
        self.by_enum = {getattr(pynvml, p.nvml): p for p in model.mig_profiles}
        self.by_id = {p.gi_profile_id: p for p in model.mig_profiles}
        self.calls: list[str] = []
        self.remapped_rows = (0, 0, 0, 0)  # corrected, uncorrected, remapping pending, remapping failed
        self.recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; None: field not supported
        self.compute_mode = 0  # NVML_COMPUTEMODE_DEFAULT
        self.root = True  # False: nvmlDeviceSetComputeMode answers NO_PERMISSION
        self.reserved_mib: int | None = 480  # what nvmlMemory_v2 says is reserved; None: not supported
        self.reserved_bytes: int | None = None  # the same in bytes, where not whole MiB

    def __getattr__(self, name: str) -> Callable[..., int]:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(type(self), "c_" + name, None)

        def call(*args: Any) -> int:
            self.calls.append(name)
            return NOT_SUPPORTED if fn is None else fn(self, *args)
        return call

    def _device(self, handle: Any) -> bool:
        return ctypes.cast(handle, ctypes.c_void_p).value == self.HANDLE

    def c_nvmlInitWithFlags(self, flags: int) -> int:
        return SUCCESS

    def c_nvmlShutdown(self) -> int:
        return SUCCESS

    def c_nvmlSystemGetDriverVersion(self, buffer: Any, size: Any) -> int:
        _put_text(buffer, "580.159.04")
        return SUCCESS

    def c_nvmlSystemGetNVMLVersion(self, buffer: Any, size: Any) -> int:
        _put_text(buffer, "13.580.159.04")
        return SUCCESS

    def c_nvmlSystemGetCudaDriverVersion_v2(self, version: Any) -> int:
        _put(version, 13000)
        return SUCCESS

    def c_nvmlDeviceGetCount_v2(self, count: Any) -> int:
        _put(count, 1)
        return SUCCESS

    def c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, handle: Any) -> int:
        return INVALID_ARGUMENT if index.value != 0 else self._handle_out(handle, self.HANDLE)

    def c_nvmlDeviceGetName(self, handle: Any, buffer: Any, size: Any) -> int:
        _put_text(buffer, self.name)
        return SUCCESS

    def c_nvmlDeviceGetUUID(self, handle: Any, buffer: Any, size: Any) -> int:
        _put_text(buffer, "GPU-00000000-1111-2222-3333-444444444444")
        return SUCCESS

    def c_nvmlDeviceGetMemoryInfo(self, handle: Any, memory: Any) -> int:
        # version 1: `used` counts the reserved memory (as driver 580 answers, tests/fixtures/nvml)
        m = memory._obj
        m.total, m.free, m.used = self.memory_mib << 20, (self.memory_mib - 500) << 20, 500 << 20
        return SUCCESS

    def c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, memory: Any) -> int:
        m = memory._obj
        if self.reserved_mib is None:
            return NOT_SUPPORTED  # (a library without the function answers FUNCTION_NOT_FOUND instead)
        if m.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        m.total = self.memory_mib << 20
        m.reserved = self.reserved_bytes if self.reserved_bytes is not None else self.reserved_mib << 20
        m.free, m.used = (self.memory_mib - 500) << 20, (500 - self.reserved_mib) << 20
        return SUCCESS

    def c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        _put(current, int(self.mig))
        _put(pending, int(self.mig))
        return SUCCESS

    def c_nvmlDeviceGetGpuInstanceProfileInfoV(self, handle: Any, enum: int, info: Any) -> int:
        p = self.by_enum.get(enum)
        if not self.mig or p is None:
            return NOT_SUPPORTED
        i = info._obj
        i.id, i.sliceCount, i.instanceCount = p.gi_profile_id, p.compute, p.max
        i.memorySizeMB = p.memory * self.memory_mib // 8
        i.name = f"MIG {p.name}".encode()
        return SUCCESS

    def c_nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle: Any, profile_id: int, placements: Any,
                                                       count: Any) -> int:
        p = self.by_id.get(profile_id)
        if not self.mig or p is None:
            return NOT_SUPPORTED
        if placements is not None:
            for k, start in enumerate(p.starts):
                placements[k].start, placements[k].size = start, p.memory
        _put(count, len(p.starts))
        return SUCCESS

    def c_nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances: Any, count: Any) -> int:
        if not self.mig:
            return NOT_SUPPORTED
        _put(count, 0)
        return SUCCESS

    def c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        _put(count, 7 if self.mig else 0)
        return SUCCESS

    def c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, mig: Any) -> int:
        return NOT_FOUND

    def c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        _put(count, 0)
        return SUCCESS

    def c_nvmlDeviceGetRemappedRows(self, handle: Any, corrected: Any, uncorrected: Any, pending: Any,
                                    failed: Any) -> int:
        for out, value in zip((corrected, uncorrected, pending, failed), self.remapped_rows):
            _put(out, value)
        return SUCCESS

    def c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values: Any) -> int:
        # each value's own return code says whether the field is known (nvml.h); 230:
        # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, an unsigned int
        for v in values._obj[: count.value]:
            if v.fieldId == 230 and self.recovery_action is not None:
                v.nvmlReturn, v.valueType, v.value.uiVal = SUCCESS, 1, self.recovery_action
            else:
                v.nvmlReturn = NOT_SUPPORTED
        return SUCCESS

    def c_nvmlDeviceGetComputeMode(self, handle: Any, mode: Any) -> int:
        if not self._device(handle):
            return INVALID_ARGUMENT
        _put(mode, self.compute_mode)
        return SUCCESS

    def c_nvmlDeviceSetComputeMode(self, handle: Any, mode: Any) -> int:
        if not self._device(handle):
            return INVALID_ARGUMENT
        if not self.root:
            return NO_PERMISSION
        self.compute_mode = mode.value  # (pynvml passes an _nvmlComputeMode_t by value)
        return SUCCESS

    def c_nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, pending: Any) -> int:
        _put(pending, 0)
        return SUCCESS

    # reads that the mutating driver calls make first: a GPU instance 1 and its compute instance 1
    def c_nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int, gi: Any) -> int:
        return self._handle_out(gi, 0x6000) if self.mig and gi_id == 1 else NOT_FOUND

    def c_nvmlGpuInstanceGetComputeInstanceById(self, gi: Any, ci_id: int, ci: Any) -> int:
        return self._handle_out(ci, 0x7000) if ci_id == 1 else NOT_FOUND

    def c_nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, gi: Any, enum: int, engines: int, info: Any) -> int:
        info._obj.id, info._obj.sliceCount = enum, enum + 1
        return SUCCESS

    @staticmethod
    def _handle_out(arg: Any, value: int) -> int:
        ctypes.cast(ctypes.addressof(arg._obj), ctypes.POINTER(ctypes.c_void_p))[0] = value
        return SUCCESS
