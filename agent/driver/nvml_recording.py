"""NVML recorded at its C boundary, and replayed: what a real GPU answered, kept as a file, so that
CI runs the real parsing code (nvidia-ml-py's wrappers and `RealNvml`) on a real driver's answers.

`record_nvml()` gives a `RealNvml` whose nvidia-ml-py calls into a `RecordingLibrary` wrapped
around the host's libnvidia-ml: every C call is logged with its arguments, the bytes of every
buffer it was given before and after, and its return code. Only read functions pass (`READ_ONLY`):
any other name is refused before the library is reached, so a recording session cannot change a
GPU. `RecordedNvml` is a `RealNvml` over a `ReplayedLibrary` that answers each call from the log
and refuses any call it has no answer for (`NvmlReplayMissing`), but for the reads newer than the
recording that have a fallback (`ASKED_LATER`), answered as by a driver without the function.

Each driver runs on its own copy of the `pynvml` module (a fresh import of the same file), so
recording or replaying never touches the `pynvml` the rest of the process uses.

Handles (`nvmlDevice_t`, `nvmlGpuInstance_t`, ...) are opaque pointers that only the library
dereferences: the log keeps their values, and the replay gives the same values back. A call's
key is its function name with every argument as it was before the call (scalars, handle values,
the bytes of the buffers it points at), so an answer is only ever given to the question that was
asked. A key asked several times is answered in the recorded order, then with its last answer.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import json
import re
import sys
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynpart.agent.driver.nvml import RealNvml
from dynpart.errors import DynpartError

FORMAT = "dynpart.io/nvml-recording/v1"

# The C functions a recording may call: reading only. Everything that creates, destroys, sets,
# resets or clears is refused by name before it reaches the library.
READ_ONLY = re.compile(
    r"nvml(?:Init(?:WithFlags|_v2)?|Shutdown|ErrorString"
    r"|SystemGet\w+|DeviceGet\w+|GpuInstanceGet\w+|ComputeInstanceGetInfo\w*)")

# Reads the agent makes that recordings older than them never asked, each with a fallback in
# RealNvml for a driver that lacks the function: a recording with no call of one at all replays a
# driver without it (FUNCTION_NOT_FOUND), so older recordings replay on newer code. Any other
# question a recording has no answer for still raises NvmlReplayMissing.
ASKED_LATER = frozenset({"nvmlDeviceGetMemoryInfo_v2"})

_byref_type = type(ctypes.byref(ctypes.c_int()))
_module_copies = itertools.count()


class NvmlRecordingError(DynpartError):
    """A recording cannot be made or read."""


class ReadOnlyViolation(NvmlRecordingError):
    """A recording session was asked to call an NVML function that is not a read."""


class NvmlReplayMissing(NvmlRecordingError):
    """The replayed driver was asked something the recording has no answer for."""


def fresh_pynvml() -> Any:
    """A new copy of the pynvml module (same file, own globals: its own library handle, function
    cache and ctypes types), so that one driver's library never leaks into another's."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise NvmlRecordingError("the nvidia-ml-py package (pynvml) is not installed")
    copy = importlib.util.spec_from_file_location(f"_dynpart_pynvml_{next(_module_copies)}", spec.origin)
    assert copy is not None and copy.loader is not None  # a file found by find_spec loads
    module = importlib.util.module_from_spec(copy)
    sys.modules[copy.name] = module  # pynvml looks itself up there while it is imported
    try:
        copy.loader.exec_module(module)
    finally:
        del sys.modules[copy.name]
    return module


# --- what the C functions are given ---

def _memory(arg: Any) -> Any | None:
    """The ctypes object whose bytes the callee may read or write, or None for a value argument."""
    if isinstance(arg, _byref_type):
        return arg._obj  # type: ignore[attr-defined]  # what byref() points at; the stubs omit it
    if isinstance(arg, (ctypes.Array, ctypes.Structure, ctypes.Union)):
        return arg
    if isinstance(arg, ctypes._Pointer) and ctypes.cast(arg, ctypes.c_void_p).value and ctypes.sizeof(arg._type_) > 0:
        return arg.contents  # a pointer to memory, not an opaque handle
    return None


def _bytes_of(obj: Any) -> str:
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj)).hex()


def encode_argument(arg: Any) -> Any:
    """An argument as JSON: a number, null, {"handle": value} for an opaque handle, {"c": type,
    "value": v} for a scalar passed by value, {"buffer": type, "bytes": hex} for memory."""
    if arg is None or isinstance(arg, int) and not isinstance(arg, bool):
        return arg
    if isinstance(arg, bytes):
        return {"bytes": arg.hex()}
    memory = _memory(arg)
    if memory is not None:
        return {"buffer": type(memory).__name__, "bytes": _bytes_of(memory)}
    if isinstance(arg, ctypes._Pointer):  # to an opaque struct: a handle, never dereferenced here
        return {"handle": ctypes.cast(arg, ctypes.c_void_p).value or 0}
    if isinstance(arg, ctypes._SimpleCData):
        value = arg.value
        return {"c": type(arg).__name__, "value": value.hex() if isinstance(value, bytes) else value}
    raise NvmlRecordingError(f"cannot record an argument of type {type(arg).__name__}")


def _encode_result(value: Any) -> Any:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    raise NvmlRecordingError(f"cannot record a result of type {type(value).__name__}")


def _decode_result(value: Any) -> Any:
    return bytes.fromhex(value["bytes"]) if isinstance(value, dict) else value


def _key(name: str, args: list[Any]) -> str:
    return json.dumps([name, args], sort_keys=True)


# --- the log ---

@dataclass
class NvmlRecording:
    """What a real driver answered: every C call in order, and notes on where it was made."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        lines = ",\n".join(json.dumps(c, sort_keys=True) for c in self.calls)  # one call a line: readable diffs
        meta = json.dumps(self.meta, indent=2, sort_keys=True)
        return f'{{"format": "{FORMAT}",\n"meta": {meta},\n"calls": [\n{lines}\n]}}\n'

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> NvmlRecording:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise NvmlRecordingError(f"{path}: not a readable NVML recording ({e})") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: Any, path: str) -> NvmlRecording:
        """A recording from its JSON; `path` names it in errors."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("calls"), list):
            raise NvmlRecordingError(f"{path}: not an NVML recording (expected \"format\": \"{FORMAT}\" and a "
                                     "list of calls)")
        for i, call in enumerate(data["calls"]):
            problem = _call_problem(call)
            if problem:
                raise NvmlRecordingError(f"{path}: calls[{i}]{problem}")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise NvmlRecordingError(f"{path}: meta: expected an object")
        return cls(calls=data["calls"], meta=meta)


_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_CALL_KEYS = {"fn", "args", "result", "out", "missing"}


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def _call_problem(call: Any) -> str | None:
    """What is wrong with one recorded call (a suffix for its place in the file), or None. Only
    what the replay writes back is checked closely; arguments need only be JSON: a call's
    arguments that the code never asks with are simply never answered."""
    if not isinstance(call, dict) or not isinstance(call.get("fn"), str) or not isinstance(call.get("args"), list):
        return ': expected {"fn": name, "args": [...], "result": ..., "out": [...]}'
    if set(call) - _CALL_KEYS:
        return f": unknown field(s) {sorted(set(call) - _CALL_KEYS)}"
    if not READ_ONLY.fullmatch(call["fn"]):
        return f".fn = {call['fn']!r}: not an NVML read function"
    result = call.get("result")
    if not (result is None or isinstance(result, int) and not isinstance(result, bool)
            or isinstance(result, dict) and set(result) == {"bytes"} and _is_hex(result["bytes"])):
        return f".result = {result!r}: expected a return code, null or {{\"bytes\": hex}}"
    out = call.get("out", [])
    if not isinstance(out, list) or len(out) not in (0, len(call["args"])):
        return ".out: expected [] or one entry per argument"
    for k, entry in enumerate(out):
        if entry is not None and not _is_hex(entry):
            return f".out[{k}]: expected null or the bytes in hex"
    if not isinstance(call.get("missing", False), bool):
        return ".missing: expected true or false"
    return None


# --- recording ---

class _RecordingFunction:
    """One C function of the real library; each call is logged. `restype`, which nvidia-ml-py
    sets on some functions, goes to the real function."""

    def __init__(self, name: str, fn: Any, calls: list[dict[str, Any]]):
        self.__dict__.update(_name=name, _fn=fn, _calls=calls)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._fn, attr, value)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)

    def __call__(self, *args: Any) -> Any:
        before = [encode_argument(a) for a in args]
        result = self._fn(*args)
        after = [None if _memory(a) is None else _bytes_of(_memory(a)) for a in args]
        self._calls.append({"fn": self._name, "args": before, "result": _encode_result(result),
                            "out": after if any(o is not None for o in after) else []})
        return result


class RecordingLibrary:
    """A loaded libnvidia-ml whose read functions are logged and whose other functions are
    refused (`ReadOnlyViolation`), before they reach the library."""

    def __init__(self, lib: Any, calls: list[dict[str, Any]]):
        self._lib = lib
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if not READ_ONLY.fullmatch(name):
            raise ReadOnlyViolation(f"{name}: not a read; a recording session calls NVML read-only")
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            self._calls.append({"fn": name, "args": [], "missing": True})  # an older driver: no such function
            raise
        return _RecordingFunction(name, fn, self._calls)


# --- replay ---

class _ReplayedFunction:
    def __init__(self, name: str, library: ReplayedLibrary):
        self.name = name
        self.library = library
        self.restype: Any = ctypes.c_int

    def __call__(self, *args: Any) -> Any:
        before = [encode_argument(a) for a in args]
        answers = self.library.answers.get(_key(self.name, before))
        if not answers:
            raise NvmlReplayMissing(f"the NVML recording has no answer for {self.name}"
                                    f"({', '.join(json.dumps(a) for a in before)})")
        call = answers.popleft() if len(answers) > 1 else answers[0]
        for arg, out in zip(args, call.get("out") or [None] * len(args)):
            if out is not None:
                memory = _memory(arg)
                data = bytes.fromhex(out)
                if memory is None or len(data) != ctypes.sizeof(memory):
                    raise NvmlRecordingError(f"{self.name}: the recording's answer does not fit the argument")
                ctypes.memmove(ctypes.addressof(memory), data, len(data))
        result = _decode_result(call.get("result"))
        if not (isinstance(result, bytes) or result is None if self.restype is ctypes.c_char_p
                else isinstance(result, int)):
            raise NvmlRecordingError(f"{self.name}: the recording's answer is not of the function's return type")
        return result


class ReplayedLibrary:
    """A stand-in for libnvidia-ml that answers from a recording."""

    def __init__(self, recording: NvmlRecording):
        self.answers: dict[str, deque[dict[str, Any]]] = defaultdict(deque)
        self.missing = {c["fn"] for c in recording.calls if c.get("missing")}
        self.missing |= ASKED_LATER - {c["fn"] for c in recording.calls}
        for call in recording.calls:
            if not call.get("missing"):
                self.answers[_key(call["fn"], call["args"])].append(call)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in self.missing:
            raise AttributeError(name)  # the recorded driver had no such function
        return _ReplayedFunction(name, self)


# --- drivers ---

class RecordedNvml(RealNvml):
    """`RealNvml` answered by a recording of a real driver (no GPU needed): the same Python code
    as on a GPU host, down to nvidia-ml-py's ctypes calls; an unrecorded call raises
    `NvmlReplayMissing`."""

    def __init__(self, recording: NvmlRecording | Path | str):
        if not isinstance(recording, NvmlRecording):
            recording = NvmlRecording.load(Path(recording))
        self.recording = recording
        nv = fresh_pynvml()
        nv.nvmlLib = ReplayedLibrary(recording)
        super().__init__(nv)


@contextmanager
def record_nvml(library: Any = None) -> Iterator[tuple[RealNvml, NvmlRecording]]:
    """A `RealNvml` on this host's driver (or on `library`, a stand-in for libnvidia-ml) whose
    every C call is logged into the recording it yields; NVML is shut down when the block ends.
    Read functions only (`READ_ONLY`)."""
    nv = fresh_pynvml()
    if library is not None:
        nv.nvmlLib = library
    try:
        nv._LoadNvmlLibrary()
    except nv.NVMLError as e:
        raise NvmlRecordingError(f"NVML not available: no NVIDIA driver on this host (pynvml: {e})") from None
    recording = NvmlRecording()
    nv.nvmlLib = RecordingLibrary(nv.nvmlLib, recording.calls)
    driver = RealNvml(nv)
    try:
        yield driver, recording
    finally:
        driver.close()
