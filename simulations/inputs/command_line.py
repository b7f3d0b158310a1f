"""Command-line inputs shared by `dynpart simulate` and `dynpart bench packing`: the pod trace,
the cluster and the seeds, with what was read reported (rows used and ignored)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dynpart.catalog import Catalog
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec, from_node_list, read_cluster
from dynpart.simulations.inputs.synthetic import synthetic_cluster, synthetic_trace
from dynpart.simulations.inputs.traces import PodTrace, read_nodes, read_pods


@dataclass
class Inputs:
    trace: PodTrace
    cluster: ClusterSpec
    synthetic: bool

    @property
    def trace_name(self) -> str | None:
        return None if self.synthetic else Path(self.trace.path).name

    def describe(self) -> str:
        return (f"trace {self.trace.path}: {self.trace.rows} rows read, {len(self.trace.pods)} pods used, 0 ignored\n"
                f"cluster {self.cluster.source}: {self.cluster.describe()}")

    def models_nowhere(self) -> str | None:
        """A line naming the GPU models that pods' `gpu_spec` accept and no node of the cluster has
        (a typo, or another cluster's model), and how many pods accept none that it has: they can
        only fail. None when every model named is there."""
        present = {n.model for n in self.cluster.nodes if n.gpus}
        named = {m for p in self.trace.pods if p.num_gpu for m in p.gpu_spec}
        absent = sorted(named - present)
        if not absent:
            return None
        stranded = sum(1 for p in self.trace.pods if p.num_gpu and p.gpu_spec and not present.intersection(p.gpu_spec))
        return (f"trace {self.trace.path}: gpu_spec names GPU model(s) {', '.join(absent)} that no node of the "
                f"cluster has; {stranded} pod(s) accept no model it has and will fail")


def parse_seeds(text: str) -> list[int]:
    """'42-51', '42,43,50' or '7'."""
    seeds: list[int] = []
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and not all(parts):
        raise SimulationError(f"--seeds {text!r}: an empty item in the list")
    for part in filter(None, parts):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not m:
            raise SimulationError(f"--seeds {text!r}: expected N, N-M or a comma-separated list")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 10_000:
            raise SimulationError(f"--seeds {text!r}: bad range {part} (from low to high, at most 10,001 seeds)")
        seeds.extend(range(lo, hi + 1))
    if not seeds:
        raise SimulationError(f"--seeds {text!r}: no seeds")
    if len(set(seeds)) != len(seeds):
        raise SimulationError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


def parse_policies(text: str) -> list[str]:
    """--policy: a comma-separated list, each named once."""
    policies = [s.strip() for s in text.split(",") if s.strip()]
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        raise SimulationError(f"--policy {text!r}: {', '.join(twice)} listed twice")
    return policies


def check_time_limit(value: float | None) -> None:
    """--time-limit: the planner's exact-search budget, a finite number of seconds >= 0."""
    if value is not None and not 0 <= value < float("inf"):  # nan fails too
        raise SimulationError(f"--time-limit {value}: must be a finite number of seconds, 0 or more")


def default_jobs() -> int:
    """The default of --jobs: one process per CPU."""
    return os.cpu_count() or 1


def load(trace: str | None, nodes: str | None, cluster: str | None, catalog: Catalog, *,
         default_cluster: str | ClusterSpec | None,
         node_mode: str = "mps", synthetic_pods: int = 300, synthetic_seed: int = 0) -> Inputs:
    if nodes and cluster:
        raise SimulationError("give either --nodes (an openb node list) or --cluster (YAML or NxGxMODEL), not both")
    synthetic = trace is None
    pods = read_pods(trace) if trace is not None else synthetic_trace(synthetic_pods, synthetic_seed)
    if nodes:
        spec = from_node_list(read_nodes(nodes), node_mode)
    elif cluster:
        spec = read_cluster(cluster, catalog)
    elif isinstance(default_cluster, ClusterSpec):
        spec = default_cluster
    elif default_cluster:
        spec = read_cluster(default_cluster, catalog)
    elif synthetic:
        spec = synthetic_cluster()
    else:
        raise SimulationError("--trace needs a cluster: --nodes NODE_LIST.csv or --cluster FILE.yaml|NxGxMODEL")
    return Inputs(pods, spec, synthetic)
