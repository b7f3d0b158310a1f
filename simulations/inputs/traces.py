"""The openb trace formats (Alibaba cluster-trace-gpu-v2023), parsed strictly.

Pod lists: `name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,creation_time,
deletion_time,scheduled_time]` (the multigpu files have only the first 5 columns). Node lists:
`sn,cpu_milli,memory_mib,gpu,model`.

Every row is either used or rejected with a `TraceError` naming file and line: nothing is
dropped silently. Parsing works on text (`parse_pods`, `parse_nodes`); `read_pods` and
`read_nodes` only add the file reading.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

from dynpart.errors import read_problem
from dynpart.simulations.errors import TraceError

MILLI = 1000  # GPU milli of one whole GPU

POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
MAX_TIME_S = 10**12  # the largest creation or deletion time read (the built-in workload's bound too)
# the largest CPU (millicores) and memory (MiB) read, as a cluster file's (cluster_spec): the
# planner and the packing state hold them as 64-bit integers
MAX_CPU_MILLI = 100_000 * 1000
MAX_MEMORY_MIB = 1 << 30  # 1 PiB
POD_OPTIONAL = ("gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int  # 0 = CPU-only
    gpu_milli: int  # per GPU: the share asked for when num_gpu == 1, else 1000
    gpu_spec: tuple[str, ...] = ()  # accepted GPU models; empty = any
    creation_time: int | None = None
    deletion_time: int | None = None
    line: int = 0
    # the slice asked for by name, when the workload names it (generated workloads): a MIG profile
    # such as "2g.20gb" or an MPS size such as "20gb"; empty: derived from gpu_milli (traces)
    slice_name: str = ""

    @property
    def gpu_demand(self) -> int:
        """Requested GPU milli, as the paper counts it."""
        return self.num_gpu * self.gpu_milli

    @property
    def is_share(self) -> bool:
        return self.num_gpu == 1 and self.gpu_milli < MILLI

    @property
    def duration(self) -> int | None:
        if self.creation_time is None or self.deletion_time is None:
            return None
        return self.deletion_time - self.creation_time


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # "" for a CPU-only node
    line: int = 0


@dataclass(frozen=True)
class PodTrace:
    path: str
    pods: tuple[TracePod, ...]
    has_times: bool  # creation/deletion times present (needed for replay)
    rows: int  # data rows read (= len(pods): rows are used or rejected, never skipped)


@dataclass(frozen=True)
class NodeList:
    path: str
    nodes: tuple[TraceNode, ...]

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)


def _rows(text: str, path: str, required: tuple[str, ...]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    rows: list[tuple[int, list[str]]] = []
    start = 1  # the line the next row starts on
    blank = 0  # the first empty line after the header, refused only if a row follows it
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # e.g. an unclosed quote swallowing the rest of a large file
            raise TraceError(path, start, f"not readable as CSV from this line on ({e}): an unclosed quote?") from None
        # (`first`: the line this row started on; a quoted field may hold line breaks)
        line, first = reader.line_num, start
        start = line + 1
        if not row or all(not c.strip() for c in row):
            blank = blank or (line if header is not None else 0)  # (empty lines at the end are no row)
            continue
        if blank:
            raise TraceError(path, blank, "empty row")
        if header is None:
            header = [c.strip() for c in row]
            twice = sorted({c for c in header if c and header.count(c) > 1})
            if twice:  # (which copy a row's value comes from would be a guess)
                raise TraceError(path, line, f"column(s) {', '.join(twice)} appear more than once in the header")
            missing = [c for c in required if c not in header]
            if missing:
                # (a spreadsheet's export with ';' or tabs has the columns, in one field: say so)
                sep = next((s for s in (";", "\t", "|") if len(header) == 1 and s in header[0]), None)
                hint = f" (the line is separated by {sep!r}, not commas: export it as comma-separated)" if sep else ""
                raise TraceError(path, line, f"header lacks column(s) {', '.join(missing)}; "
                                 f"expected {','.join(required)}{hint}")
            continue
        if len(row) != len(header):
            if line > first:  # a quoted field ran over lines (valid CSV) and swallowed the next rows
                raise TraceError(path, first, f"a quoted field runs from line {first} to line {line}, leaving "
                                 f"{len(row)} fields where the header has {len(header)}: an unclosed quote?")
            raise TraceError(path, line, f"{len(row)} fields, the header has {len(header)}")
        rows.append((first, [c.strip() for c in row]))
    if rows and reader.line_num > rows[-1][0]:
        _closed(text, path, rows[-1][0])
    if header is None:
        raise TraceError(path, None, "empty file (no header)")
    return header, rows


def _closed(text: str, path: str, first: int) -> None:
    """The last row ran over several lines: a TraceError when its quote is never closed (the csv
    reader ends the field at the end of the file, so a quote opened in the last column takes
    every row after it into that field, with the header's number of fields)."""
    tail = "".join(io.StringIO(text).readlines()[first - 1:])
    try:
        for _ in csv.reader(io.StringIO(tail), strict=True):
            pass
    except csv.Error as e:
        if "end of data" in str(e):
            raise TraceError(path, first, f"a quoted field runs from line {first} to the end of the file: "
                             "an unclosed quote?") from None


# a CSV integer: ASCII digits, perhaps a minus sign (Python's int() also reads "6_000", "+6000" and
# other scripts' digits, which no tool that wrote a trace meant)
_INTEGER = re.compile(r"\s*-?[0-9]+\s*")


def _int(path: str, line: int, column: str, value: str, lo: int = 0, hi: int | None = None) -> int:
    try:
        if not _INTEGER.fullmatch(value):
            raise ValueError(value)
        v = int(value)  # (ValueError too beyond Python's 4,300 digits)
    except ValueError:
        raise TraceError(path, line, f"{column} = {value[:40]!r}{'...' if len(value) > 40 else ''}: not an integer") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise TraceError(path, line, f"{column} = {v}: out of range ({bound})")
    return v


def _new_name(path: str, line: int, name: str, seen: dict[str, int], column: str, kind: str) -> str:
    """A row's name: not empty and not on an earlier row (seen: name -> line, updated)."""
    if not name:
        raise TraceError(path, line, f"{column} is empty")
    if name in seen:
        raise TraceError(path, line, f"{kind} {name!r} already listed on line {seen[name]}")
    seen[name] = line
    return name


def parse_pods(text: str, path: str = "<pods>") -> PodTrace:
    header, rows = _rows(text, path, POD_COLUMNS)
    col = {c: i for i, c in enumerate(header)}
    has_times = "creation_time" in col and "deletion_time" in col
    pods: list[TracePod] = []
    seen: dict[str, int] = {}
    for line, row in rows:
        name = _new_name(path, line, row[col["name"]], seen, "name", "pod")
        cpu = _int(path, line, "cpu_milli", row[col["cpu_milli"]], hi=MAX_CPU_MILLI)
        mem = _int(path, line, "memory_mib", row[col["memory_mib"]], hi=MAX_MEMORY_MIB)
        num_gpu = _int(path, line, "num_gpu", row[col["num_gpu"]], 0, 64)
        gpu_milli = _int(path, line, "gpu_milli", row[col["gpu_milli"]], 0, MILLI)
        if num_gpu == 0 and gpu_milli:
            raise TraceError(path, line, f"gpu_milli = {gpu_milli} but num_gpu = 0")
        if num_gpu >= 1 and gpu_milli == 0:
            raise TraceError(path, line, f"num_gpu = {num_gpu} but gpu_milli = 0")
        if num_gpu > 1 and gpu_milli != MILLI:
            raise TraceError(path, line, f"num_gpu = {num_gpu} with gpu_milli = {gpu_milli}: only single-GPU "
                             "pods may share a GPU (multi-GPU pods take whole GPUs, gpu_milli 1000)")
        spec: tuple[str, ...] = ()
        if "gpu_spec" in col and row[col["gpu_spec"]]:
            spec = tuple(s.strip() for s in row[col["gpu_spec"]].split("|"))
            if any(not s for s in spec):
                raise TraceError(path, line, f"gpu_spec = {row[col['gpu_spec']]!r}: empty model name")
            if num_gpu == 0:
                raise TraceError(path, line, f"gpu_spec = {row[col['gpu_spec']]!r} on a CPU-only pod")
        created = deleted = None
        if has_times:
            # (seconds: beyond 1e12, some 30,000 years, a float clock no longer tells a run time apart)
            created = _int(path, line, "creation_time", row[col["creation_time"]], hi=MAX_TIME_S)
            deleted = _int(path, line, "deletion_time", row[col["deletion_time"]], hi=MAX_TIME_S)
            if deleted < created:
                raise TraceError(path, line, f"deletion_time {deleted} is before creation_time {created}")
        pods.append(TracePod(name, cpu, mem, num_gpu, gpu_milli if num_gpu else 0, spec, created, deleted, line))
    if not pods:
        raise TraceError(path, None, "no pods (only a header)")
    return PodTrace(path, tuple(pods), has_times, len(rows))


def parse_nodes(text: str, path: str = "<nodes>") -> NodeList:
    header, rows = _rows(text, path, NODE_COLUMNS)
    col = {c: i for i, c in enumerate(header)}
    nodes: list[TraceNode] = []
    seen: dict[str, int] = {}
    for line, row in rows:
        name = _new_name(path, line, row[col["sn"]], seen, "sn (node name)", "node")
        cpu = _int(path, line, "cpu_milli", row[col["cpu_milli"]], 1, MAX_CPU_MILLI)
        mem = _int(path, line, "memory_mib", row[col["memory_mib"]], 1, MAX_MEMORY_MIB)
        gpus = _int(path, line, "gpu", row[col["gpu"]], 0, 64)
        model = row[col["model"]]
        if gpus and not model:
            raise TraceError(path, line, f"node {name} has {gpus} GPU(s) but no model")
        if not gpus and model:
            raise TraceError(path, line, f"node {name} has model {model!r} but 0 GPUs")
        nodes.append(TraceNode(name, cpu, mem, gpus, model, line))
    if not nodes:
        raise TraceError(path, None, "no nodes (only a header)")
    return NodeList(path, tuple(nodes))


def _read(path: Path | str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # a BOM (Excel) is not part of the header
    except OSError as e:
        raise TraceError(str(path), None, e.strerror or str(e)) from None
    except UnicodeDecodeError as e:
        raise TraceError(str(path), None, read_problem(e)) from None


def read_pods(path: Path | str) -> PodTrace:
    return parse_pods(_read(path), str(path))


def read_nodes(path: Path | str) -> NodeList:
    return parse_nodes(_read(path), str(path))
