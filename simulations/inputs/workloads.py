"""The built-in workload of `dynpart simulate`: a seeded generator of an inference-and-training
fleet on a small H100 cluster, in two parts replayed side by side.

- **MIG part**: `nodes` x `gpus_per_node` GPUs in MIG mode; pods ask for MIG profiles by name,
  drawn from `mix` (default: many 1g.10gb / 2g.20gb, some 3g.40gb / 4g.40gb, a few 7g.80gb).
- **MPS part**: `mps_nodes` x `gpus_per_node` GPUs in MPS mode; pods ask for MPS slices of
  `mps_mix` sizes (default 10, 20 and 40 GB).

In each part pods arrive as a Poisson process (`rate`, `mps_rate` per minute) and run for a
log-normal time (median `duration_median_s`, shape `duration_sigma`, the same for both parts).
The same parameters and seed give the same pods. Users give their own parameters with
`--workload key=value,...` or `--workload FILE.yaml` (the same keys); `WorkloadSpec` lists them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dynpart import yaml_text
from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError, read_problem, yaml_problem
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec, NodeSpec
from dynpart.simulations.inputs.traces import MILLI, PodTrace, TracePod

# many small inference slices, some mid-size, a few whole GPUs (training)
DEFAULT_MIG_MIX = {"1g.10gb": 40.0, "2g.20gb": 30.0, "3g.40gb": 15.0, "4g.40gb": 10.0, "7g.80gb": 5.0}
DEFAULT_MPS_MIX = {"10gb": 50.0, "20gb": 30.0, "40gb": 20.0}
NODE_CPU_MILLI = 224_000  # an 8-GPU H100 node (DGX-like): 224 CPUs, 2 TiB
NODE_MEMORY_MIB = 2 << 20
_MPS_SIZE = re.compile(r"([0-9]+)gb")  # (fullmatch: ASCII digits only, no trailing newline)
MAX_TIME_S = 1e12  # arrival times and run times beyond this (30,000 years) are a mistake


def _parse_mix(value: Any) -> Any:
    """"1g.10gb:40,2g.20gb:30" (or a mapping, as in YAML) -> {name: weight}."""
    if not isinstance(value, str):
        return value
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, sep, weight = part.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"{part!r}: expected NAME:WEIGHT, e.g. 1g.10gb:40")
        if name.strip() in out:
            raise ValueError(f"{name.strip()!r} given twice")
        out[name.strip()] = weight.strip()
    return out


class WorkloadSpec(BaseModel):
    """The built-in workload's parameters (every one has a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, ge=0, description="random seed: the same parameters and seed give the same pods")
    pods: int = Field(1200, ge=0, le=200_000, description="pods of the MIG part (0: no MIG part)")
    rate: float = Field(3.6, gt=0, le=1_000_000, allow_inf_nan=False, description="MIG part: mean arrivals per minute (Poisson)")
    mix: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_MIG_MIX),
                                  description="MIG part: profiles asked for, NAME:WEIGHT,... (relative weights)")
    nodes: int = Field(4, ge=0, le=1000, description="MIG part: nodes")
    mps_pods: int = Field(800, ge=0, le=200_000, description="pods of the MPS part (0: no MPS part)")
    mps_rate: float = Field(2.3, gt=0, le=1_000_000, allow_inf_nan=False, description="MPS part: mean arrivals per minute (Poisson)")
    mps_mix: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_MPS_MIX),
                                      description="MPS part: slice sizes asked for, <N>gb:WEIGHT,...")
    mps_nodes: int = Field(2, ge=0, le=1000, description="MPS part: nodes")
    gpus_per_node: int = Field(8, ge=1, le=64, description="GPUs per node (both parts)")
    gpu_model: str = Field("H100-80GB", min_length=1, description="GPU model of every node (a catalog name)")
    duration_median_s: float = Field(900.0, gt=0, allow_inf_nan=False, description="median pod run time, s (log-normal)")
    duration_sigma: float = Field(1.0, ge=0, le=4, allow_inf_nan=False,
                                  description="log-normal shape: the standard deviation of ln(run time)")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, v: Any) -> Any:
        # YAML's true/yes/on are booleans, which pydantic would take for 1
        if isinstance(v, bool) or (isinstance(v, dict) and any(isinstance(w, bool) for w in v.values())):
            raise ValueError("a number, not true/false")
        return v

    @field_validator("mix", "mps_mix", mode="before")
    @classmethod
    def _mix_text(cls, v: Any) -> Any:
        return _parse_mix(v)

    @field_validator("mix", "mps_mix")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [f"{k}:{w:g}" for k, w in v.items() if not w >= 0 or math.isinf(w)]
        if bad:
            raise ValueError(f"weights must be finite and >= 0: {', '.join(bad)}")
        if v and not sum(v.values()) > 0:
            raise ValueError("at least one weight must be positive")
        if not math.isfinite(sum(v.values())):
            raise ValueError("weights too large: their sum must be a finite number")
        return v

    def check(self, catalog: Catalog, source: str = "--workload") -> GpuModel:
        """What needs the catalog: the model, the profile and size names, parts with nodes.
        `source`: how errors name the parameters (the YAML file they came from)."""

        def _error(field: str, message: str) -> SimulationError:
            return SimulationError(f"{source}: {field}: {message}")

        try:
            model = catalog.resolve(self.gpu_model)
        except DynpartError as e:
            raise _error("gpu_model", str(e)) from None
        if self.pods + self.mps_pods == 0:
            raise _error("pods", "pods and mps_pods are both 0: nothing to replay")
        if self.pods:
            if not self.nodes:
                raise _error("nodes", f"0 nodes cannot run the MIG part's {self.pods} pods (pods=0 leaves it out)")
            if not model.supports_mig:
                raise _error("gpu_model", f"{model.name} does not support MIG (pods=0 leaves the MIG part out)")
            if not self.mix:
                raise _error("mix", "empty: name at least one MIG profile")
            names = [p.name for p in model.mig_profiles]
            for k in self.mix:
                if k not in model.profiles_by_name:
                    given = "mix" in self.model_fields_set
                    raise _error("mix", f"{k!r} is not a MIG profile of {model.name} ({', '.join(names)})"
                                 + ("" if given else f"; the default mix names H100-80GB's profiles: set mix to "
                                    f"{model.name}'s, e.g. {names[0]}:60,{names[-1]}:40"))
        if self.mps_pods:
            if not self.mps_nodes:
                raise _error("mps_nodes", f"0 nodes cannot run the MPS part's {self.mps_pods} pods "
                             "(mps_pods=0 leaves it out)")
            if not self.mps_mix:
                raise _error("mps_mix", "empty: name at least one size, e.g. 20gb")
            for k in self.mps_mix:
                m = _MPS_SIZE.fullmatch(k)
                if not m or not 1 <= int(m.group(1)) <= model.mps_capacity_gb:
                    cap = model.mps_capacity_gb
                    raise _error("mps_mix", f"{k!r}: expected a size <N>gb with N in 1..{cap} ({model.name} holds "
                                 f"{cap} GiB of MPS slices)"
                                 + ("" if "mps_mix" in self.model_fields_set else
                                    f"; the default mps_mix is H100-80GB's: set mps_mix to sizes {model.name} holds, "
                                    f"e.g. {max(1, cap // 4)}gb:60,{max(1, cap // 2)}gb:40"))
        return model

    def mean_duration_s(self) -> float:
        return self.duration_median_s * math.exp(self.duration_sigma ** 2 / 2)

    def inline(self, exclude: set[str] | None = None) -> str:
        """The parameters as a --workload value (without those in `exclude`)."""
        out = []
        for k, v in self.model_dump(exclude=exclude).items():
            if isinstance(v, dict):
                v = ",".join(f"{n}:{w:g}" for n, w in v.items())
            elif isinstance(v, float):
                v = f"{v:g}"
            out.append(f"{k}={v}")
        return ",".join(out)


def keys_help() -> str:
    return "; ".join(f"{k}={_fmt_default(k)} ({f.description})" for k, f in WorkloadSpec.model_fields.items())


def _fmt_default(key: str) -> str:
    v = getattr(WorkloadSpec(), key)
    if isinstance(v, dict):
        return ",".join(f"{n}:{w:g}" for n, w in v.items())
    return f"{v:g}" if isinstance(v, float) else str(v)


def parse_inline(text: str) -> dict[str, str]:
    """`key=value,key=value`; a comma-separated piece without `=` continues the value before it
    (so `mix=1g.10gb:40,2g.20gb:30,seed=7` works)."""
    out: dict[str, str] = {}
    last: str | None = None
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        key, sep, value = piece.partition("=")
        if sep:
            key = key.strip()
            if not key:
                raise SimulationError(f"--workload: {piece!r}: expected key=value")
            if key in out:
                raise SimulationError(f"--workload: {key}: given twice")
            out[key] = value.strip()
            last = key
        elif last is not None:
            out[last] += "," + piece
        else:
            raise SimulationError(f"--workload: {piece!r}: expected key=value (keys: {', '.join(WorkloadSpec.model_fields)})")
    return out


def workload_spec(values: dict[str, Any], source: str = "--workload") -> WorkloadSpec:
    """Validated parameters; a mistake is one line naming the field."""
    try:
        return WorkloadSpec.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            raise SimulationError(f"{source}: {field}: unknown key (keys: {', '.join(WorkloadSpec.model_fields)})") from None
        msg = err["msg"].removeprefix("Value error, ")
        shown = err.get("input")
        got = f" (got {shown!r})" if not isinstance(shown, dict) and err["type"] != "value_error" else ""
        raise SimulationError(f"{source}: {field}: {msg}{got}") from None


def workload_source(value: str | None) -> str:
    """How errors name the --workload value: its file, where it is one."""
    return f"--workload {value}" if value and "=" not in value else "--workload"


def read_workload(value: str | None) -> WorkloadSpec:
    """None: the defaults; `key=value,...`; or a YAML file with the same keys."""
    if value is None:
        return WorkloadSpec()
    if "=" in value:
        return workload_spec(parse_inline(value))
    if not value.strip():
        raise SimulationError("--workload '': empty (give key=value,... or a YAML file, or leave --workload out "
                              "for the defaults)")
    try:
        text = Path(value).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SimulationError(f"--workload {value}: {read_problem(e)} (expected key=value,... or a YAML file)") from None
    try:
        doc = yaml_text.load(text)
    except yaml.YAMLError as e:
        raise SimulationError(f"--workload {yaml_problem(value, e)}") from None
    if doc is None:
        raise SimulationError(f"--workload {value}: the file is empty (give the parameters to change, or leave "
                              "--workload out for the defaults)")
    if not isinstance(doc, dict):
        raise SimulationError(f"--workload {value}: expected a mapping of parameters (keys: "
                              f"{', '.join(WorkloadSpec.model_fields)})")
    return workload_spec(doc, workload_source(value))


@dataclass(frozen=True)
class WorkloadPart:
    """One part of the workload: its pods and the cluster they run on."""

    name: str  # "mig" | "mps"
    trace: PodTrace
    cluster: ClusterSpec
    offered_load: float  # expected demand / capacity (MIG: memory slices; MPS: GB)

    def describe(self) -> str:
        return (f"{self.name.upper()} part: {len(self.trace.pods)} pods, {self.cluster.describe()}, "
                f"offered load {100 * self.offered_load:.0f}% of GPU memory")


def _draw(rng: np.random.Generator, n: int, rate_per_min: float, mix: dict[str, float],
          spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Arrival times (s, Poisson), durations (s, log-normal, >= 1) and slice names of n pods."""
    gaps = rng.exponential(60.0 / rate_per_min, n)
    arrivals = np.cumsum(gaps)
    durations = np.maximum(1.0, rng.lognormal(math.log(spec.duration_median_s), spec.duration_sigma, n))
    names = list(mix)
    weights = np.array([mix[k] for k in names], dtype=float)
    picks = rng.choice(len(names), size=n, p=weights / weights.sum())
    if not (arrivals[-1:] <= MAX_TIME_S).all() or not (durations <= MAX_TIME_S).all():  # inf and nan too
        raise SimulationError(f"--workload: rates and duration_median_s give times over {MAX_TIME_S:g} s "
                              f"(rate {rate_per_min:g}/min, duration_median_s {spec.duration_median_s:g})")
    return arrivals, durations, [names[i] for i in picks]


def _mean_share(mix: dict[str, float], share: dict[str, float]) -> float:
    total = sum(mix.values())
    return sum(w * share[k] for k, w in mix.items()) / total


def generate(spec: WorkloadSpec, catalog: Catalog, source: str = "--workload") -> list[WorkloadPart]:
    """The parts with pods (MIG first), each on its own cluster."""
    model = spec.check(catalog, source)
    parts: list[WorkloadPart] = []
    if spec.pods:
        rng = np.random.default_rng([spec.seed, 0])
        arrivals, durations, picks = _draw(rng, spec.pods, spec.rate, spec.mix, spec)
        pods = []
        for i, (t, d, name) in enumerate(zip(arrivals, durations, picks)):
            p = model.profiles_by_name[name]
            milli = p.compute * MILLI // model.compute_slices  # the compute rule maps it back to a profile of that compute
            cpu = 2000 * p.compute
            pods.append(TracePod(f"mig-{i:05d}", cpu, cpu // 1000 * 8192, 1, min(milli, MILLI), (),
                                 int(t), int(t) + int(d), i + 1, name))
        cluster = _cluster("mig", spec.nodes, spec, model)
        share = {k: model.profiles_by_name[k].memory / model.memory_slices for k in spec.mix}
        load = spec.rate / 60 * spec.mean_duration_s() * _mean_share(spec.mix, share) / cluster.gpu_count
        parts.append(WorkloadPart("mig", PodTrace("<built-in workload, MIG part>", tuple(pods), True, len(pods)),
                                  cluster, load))
    if spec.mps_pods:
        rng = np.random.default_rng([spec.seed, 1])
        arrivals, durations, picks = _draw(rng, spec.mps_pods, spec.mps_rate, spec.mps_mix, spec)
        pods = []
        for i, (t, d, name) in enumerate(zip(arrivals, durations, picks)):
            gb = int(name[:-2])
            # rounded up, so that the GB the replay reads back from the fraction (rounded down) is `gb`
            milli = min(MILLI, -(-gb * MILLI // model.mps_capacity_gb))
            cpu = 2000 * max(1, math.ceil(gb / 10))
            pods.append(TracePod(f"mps-{i:05d}", cpu, cpu // 1000 * 8192, 1, milli, (),
                                 int(t), int(t) + int(d), i + 1, name))
        cluster = _cluster("mps", spec.mps_nodes, spec, model)
        share = {k: int(k[:-2]) / model.mps_capacity_gb for k in spec.mps_mix}
        load = spec.mps_rate / 60 * spec.mean_duration_s() * _mean_share(spec.mps_mix, share) / cluster.gpu_count
        parts.append(WorkloadPart("mps", PodTrace("<built-in workload, MPS part>", tuple(pods), True, len(pods)),
                                  cluster, load))
    return parts


def _cluster(mode: str, nodes: int, spec: WorkloadSpec, model: GpuModel) -> ClusterSpec:
    prefix = f"{model.name.lower()}-{mode}"
    return ClusterSpec(f"<built-in workload, {mode.upper()} part: {nodes}x{spec.gpus_per_node}x{model.name}>", tuple(
        NodeSpec(f"{prefix}-{i:02d}", NODE_CPU_MILLI, NODE_MEMORY_MIB, spec.gpus_per_node, model.name, mode)
        for i in range(nodes)))
