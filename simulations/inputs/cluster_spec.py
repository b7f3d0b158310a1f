"""A simulated cluster: from an openb node list, a small YAML file or an inline spec.

YAML schema (see docs/simulator.md):

    nodes:
      - count: 16            # how many identical nodes (default 1)
        gpu_model: H100-80GB # catalog name (or any name in packing mode); omit for CPU-only
        gpus: 8
        mode: mig            # mig | mps (default: mig if the model supports MIG, else mps)
        cpu: 112             # cores, or "112000m"
        memory: 1TiB         # "1TiB", "512GiB", "4096Mi", or MiB as a number
        name: h100           # node name prefix (default: from the model)

Inline: `8x8xH100-80GB` (nodes x GPUs x model), optionally `:mps`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from dynpart import yaml_text
from dynpart.catalog import Catalog
from dynpart.errors import DynpartError, read_problem, yaml_mark, yaml_message
from dynpart.simulations.errors import TraceError
from dynpart.simulations.inputs.traces import NodeList

DEFAULT_CPU_MILLI = 112_000
DEFAULT_MEMORY_MIB = 1 << 20  # 1 TiB


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # "" for CPU-only nodes
    mode: str = "mps"  # "mig" | "mps"


@dataclass(frozen=True)
class ClusterSpec:
    source: str
    nodes: tuple[NodeSpec, ...]

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def describe(self) -> str:
        groups: dict[tuple, int] = {}
        for n in self.nodes:
            key = (n.gpus, n.model, n.mode)
            groups[key] = groups.get(key, 0) + 1
        parts = []
        for (gpus, model, mode), count in sorted(groups.items(), key=lambda kv: -kv[1])[:4]:
            parts.append(f"{count} x {gpus} {model} ({mode})" if gpus else f"{count} CPU-only")
        more = f", ... ({len(groups) - 4} more kinds)" if len(groups) > 4 else ""
        return f"{len(self.nodes)} nodes, {self.gpu_count} GPUs: " + ", ".join(parts) + more


def from_node_list(nodes: NodeList, mode: str = "mps") -> ClusterSpec:
    return ClusterSpec(nodes.path, tuple(NodeSpec(n.name, n.cpu_milli, n.memory_mib, n.gpus, n.model, mode)
                                         for n in nodes.nodes))


_MEM_UNITS = {"": 1, "mi": 1, "mib": 1, "gi": 1 << 10, "gib": 1 << 10, "ti": 1 << 20, "tib": 1 << 20}


# beyond any machine, and what a simulation on one machine can hold
MAX_NODES = 100_000
MAX_CPU_CORES = 100_000
MAX_MEMORY_MIB = 1 << 30  # 1 PiB


def parse_memory_mib(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"memory {value!r}: expected MiB or a quantity like 512GiB")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory {value}: must be positive")
        if value > MAX_MEMORY_MIB:
            raise ValueError(f"memory {value}: at most {MAX_MEMORY_MIB} MiB ({MAX_MEMORY_MIB >> 20} TiB)")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _MEM_UNITS:
        raise ValueError(f"memory {value!r}: expected MiB or a quantity like 512GiB, 1TiB, 4096Mi")
    exact = Fraction(m.group(1)) * _MEM_UNITS[m.group(2).lower()]
    if exact.denominator != 1:
        # a fraction of a MiB is a slip (`1.5` meant GiB?), not something to round away
        raise ValueError(f"memory {value!r}: not a whole number of MiB (a plain number is MiB; "
                         f"write a quantity like 1.5GiB)")
    mib = int(exact)
    if mib > MAX_MEMORY_MIB:
        raise ValueError(f"memory {value!r}: at most {MAX_MEMORY_MIB >> 20} TiB")
    if mib <= 0:
        raise ValueError(f"memory {value!r}: must be positive")
    return mib


def parse_cpu_milli(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"cpu {value!r}: expected cores or millicores like 112000m")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value > MAX_CPU_CORES:
            raise ValueError(f"cpu {value!r}: expected cores, at most {MAX_CPU_CORES}")
        exact = Fraction(repr(float(value))) * 1000
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(m?)\s*", str(value))
        if not m:
            raise ValueError(f"cpu {value!r}: expected cores or millicores like 112000m")
        exact = Fraction(m.group(1)) * (1 if m.group(2) else 1000)
    if exact.denominator != 1:
        raise ValueError(f"cpu {value!r}: not a whole number of millicores (1m is the finest)")
    milli = int(exact)
    if milli > MAX_CPU_CORES * 1000:
        raise ValueError(f"cpu {value!r}: at most {MAX_CPU_CORES} cores")
    if milli <= 0:
        raise ValueError(f"cpu {value!r}: must be positive")
    return milli


def _default_mode(model: str, catalog: Catalog | None) -> str:
    if not model or catalog is None:
        return "mps"
    try:
        return "mig" if catalog.resolve(model).supports_mig else "mps"
    except DynpartError:
        return "mps"


_GROUP_KEYS = {"count", "gpu_model", "gpus", "mode", "cpu", "memory", "name"}


# a node name prefix (the index is appended): a word of letters, digits, '-', '.' and '_'
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,200}[A-Za-z0-9])?")


def _keys(keys: set[Any]) -> str:
    """Keys as the file wrote them (YAML keys need not be strings: `1:` is an integer)."""
    return ", ".join(sorted(repr(k) if not isinstance(k, str) else k for k in keys))


def parse_cluster(doc: Any, source: str = "<cluster>", catalog: Catalog | None = None) -> ClusterSpec:
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise TraceError(source, None, "a cluster file is a mapping with a non-empty 'nodes' list")
    extra = set(doc) - {"nodes"}
    if extra:
        raise TraceError(source, None, f"unknown key(s) {_keys(extra)}; expected 'nodes'")
    nodes: list[NodeSpec] = []
    for i, group in enumerate(doc["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(group, dict):
            raise TraceError(source, None, f"{where}: expected a mapping, got {group!r}")
        unknown = set(group) - _GROUP_KEYS
        if unknown:
            raise TraceError(source, None, f"{where}: unknown key(s) {_keys(unknown)}; "
                             f"expected {', '.join(sorted(_GROUP_KEYS))}")
        try:
            count = group.get("count", 1)
            gpus = group.get("gpus", 0)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"count {count!r}: expected a positive integer")
            if len(nodes) + count > MAX_NODES:
                raise ValueError(f"count {count}: the cluster would have {len(nodes) + count} nodes, at most "
                                 f"{MAX_NODES}")
            if not isinstance(gpus, int) or isinstance(gpus, bool) or not 0 <= gpus <= 64:
                raise ValueError(f"gpus {gpus!r}: expected an integer 0..64")
            model = str(group.get("gpu_model") or "")
            if gpus and not model:
                raise ValueError(f"gpus {gpus} without gpu_model")
            if model and not gpus:
                raise ValueError(f"gpu_model {model!r} with gpus 0")
            mode = group["mode"] if group.get("mode") is not None else _default_mode(model, catalog)
            if mode not in ("mig", "mps"):
                raise ValueError(f"mode {mode!r}: expected mig or mps")
            cpu = parse_cpu_milli(group.get("cpu", DEFAULT_CPU_MILLI / 1000))
            mem = parse_memory_mib(group.get("memory", DEFAULT_MEMORY_MIB))
        except ValueError as e:
            raise TraceError(source, None, f"{where}: {e}") from None
        name = group.get("name")
        if isinstance(name, int) and not isinstance(name, bool):
            name = str(name)  # (YAML reads `name: 2024` as a number)
        if name not in (None, "") and not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise TraceError(source, None, f"{where}: name {name!r}: expected a node name prefix (letters, digits, "
                             "'-', '.' and '_', starting and ending with a letter or digit)")
        prefix = name or (model.lower() if model else "cpu")
        for k in range(count):
            nodes.append(NodeSpec(f"{prefix}-{len(nodes):04d}" if "name" not in group else f"{prefix}-{k:03d}",
                                  cpu, mem, gpus, model, mode))
    seen = Counter(n.name for n in nodes)
    if len(seen) != len(nodes):
        dup = next(n for n, k in seen.items() if k > 1)
        raise TraceError(source, None, f"node name {dup!r} appears twice: give each group its own 'name'")
    return ClusterSpec(source, tuple(nodes))


# any word after the colon: parse_cluster names a mode that is neither mig nor mps
_INLINE = re.compile(r"^([0-9]+)x([0-9]+)x([A-Za-z0-9._+-]+?)(?::([A-Za-z0-9_-]*))?$")


def read_cluster(value: str, catalog: Catalog | None = None) -> ClusterSpec:
    """A YAML file path, or an inline `NODESxGPUSxMODEL[:mode]` spec."""
    m = _INLINE.match(value.strip())
    if m and not Path(value).exists():
        n, g, model, mode = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        return parse_cluster({"nodes": [{"count": n, "gpus": g, "gpu_model": model,
                                         **({"mode": mode} if mode is not None else {})}]}, value, catalog)
    try:
        text = Path(value).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(value, None, f"{read_problem(e)} (expected a cluster YAML file or NODESxGPUSxMODEL, "
                         "e.g. 8x8xH100-80GB)") from None
    try:
        doc = yaml_text.load(text)
    except yaml.YAMLError as e:
        mark = yaml_mark(e)
        raise TraceError(value, mark and mark[0], yaml_message(e), mark and mark[1]) from None
    if value.lower().endswith(".csv") and not isinstance(doc, dict):
        # (an openb node list given as --cluster reads as one YAML string: "a cluster file is a mapping")
        raise TraceError(value, None, "an openb node list (CSV) is read by `dynpart bench packing --nodes`; --cluster "
                         "takes a cluster YAML file or NODESxGPUSxMODEL (a replay cluster has one GPU model)")
    return parse_cluster(doc, value, catalog)
