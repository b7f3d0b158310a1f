"""`dynpart bench packing` without the I/O: run the packing protocol for a policy over several
seeds (in parallel processes) and summarise as the published tables do."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass

from dynpart.catalog import Catalog
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.packing.dynpart_packing import MAX_BATCH, TIME_LIMIT_S, DynpartPacking, fgd_typical_pods, trace_workload
from dynpart.simulations.packing.protocol import PackingPolicy, PackingResult, run_packing
from dynpart.simulations.packing.reference_schedulers import BestFit, Random
from dynpart.simulations.workers import worker_pool

POLICIES = ("dynpart", "best-fit", "random", "fgd")

# README of ../shared/traces: mean of seeds 42..51, (at 100 %, at 130 %) arrived
PUBLISHED = {
    "openb_pod_list_default.csv": {"random": (86.30, 87.47), "dotprod": (90.62, 90.85),
                                   "gpuclustering": (91.65, 91.88), "gpupacking": (91.78, 92.00),
                                   "best-fit": (92.86, 93.08), "fgd": (95.23, 95.39)},
    "openb_pod_list_cpu050.csv": {"best-fit": (93.56, 93.79), "fgd": (95.00, 95.21)},
    "openb_pod_list_cpu100.csv": {"best-fit": (93.26, 93.44), "fgd": (95.21, 95.35)},
    "openb_pod_list_gpushare40.csv": {"best-fit": (91.44, 91.69), "fgd": (93.96, 94.15)},
    "openb_pod_list_gpushare60.csv": {"best-fit": (89.06, 89.36), "fgd": (91.25, 91.40)},
    "openb_pod_list_gpushare80.csv": {"best-fit": (86.66, 87.01), "fgd": (89.08, 89.30)},
    "openb_pod_list_gpuspec10.csv": {"best-fit": (93.10, 93.30), "fgd": (94.66, 94.95)},
    "openb_pod_list_gpuspec20.csv": {"best-fit": (88.46, 93.30), "fgd": (94.66, 94.84)},
    "openb_pod_list_multigpu20.csv": {"best-fit": (93.73, 93.93), "fgd": (95.53, 95.65)},
    "openb_pod_list_multigpu30.csv": {"best-fit": (94.57, 94.72), "fgd": (96.36, 96.46)},
}

# what they compare with: the openb node lists (nodes, GPUs), the list tuned to 130% of their GPU
# capacity; the protocol's cluster is every node (openb_node_list_all_node.csv), the authors' tables
# were made on its GPU nodes (openb_node_list_gpu_node.csv; docs/simulator.md)
PAPER_CLUSTERS = {(1523, 6212): "openb_node_list_all_node.csv", (1213, 6212): "openb_node_list_gpu_node.csv"}
PAPER_TUNE = 1.3


def published_figures(trace_name: str | None, cluster: ClusterSpec, ratio: float) -> dict[str, tuple[float, float]]:
    """The published figures for the trace where the run repeats the paper's setting (its cluster
    and --tune); else none: on a cut-down cluster or another tune, they compare nothing."""
    if (len(cluster.nodes), cluster.gpu_count) not in PAPER_CLUSTERS or abs(ratio - PAPER_TUNE) > 1e-9:
        return {}
    return PUBLISHED.get(trace_name or "", {})


def published_elsewhere(trace_name: str | None, cluster: ClusterSpec, ratio: float) -> str | None:
    """A line saying why the trace's published figures are not shown, when it has some."""
    if trace_name not in PUBLISHED or published_figures(trace_name, cluster, ratio):
        return None
    lists = " or ".join(f"{name} ({n:,} nodes, {g:,} GPUs)" for (n, g), name in PAPER_CLUSTERS.items())
    return (f"the published figures for {trace_name} are not shown: they compare with runs on {lists} "
            f"with --tune {PAPER_TUNE:g}, and this run has {len(cluster.nodes):,} nodes, {cluster.gpu_count:,} GPUs, "
            f"--tune {ratio:g}")


@dataclass(frozen=True)
class PackingJob:
    policy: str
    seed: int
    batch: int = 1
    ratio: float = 1.3
    time_limit_s: float = TIME_LIMIT_S


def policy_factory(job: PackingJob, pods: Sequence[TracePod], catalog: Catalog | None) -> Callable[[int], PackingPolicy]:
    if job.policy == "best-fit":
        return BestFit
    if job.policy == "random":
        return Random
    models = {m for p in pods for m in p.gpu_spec}  # the whole workload's, for the planner's catalog
    if job.policy == "dynpart":
        workload = trace_workload(pods)
        return lambda seed: DynpartPacking(workload, catalog, job.batch, job.time_limit_s, models=models)
    if job.policy == "fgd":
        typical = fgd_typical_pods(pods)
        return lambda seed: DynpartPacking(typical, catalog, job.batch, job.time_limit_s, name="fgd", models=models)
    raise SimulationError(f"unknown packing policy {job.policy!r}; expected one of {', '.join(POLICIES)}")


def run_job(job: PackingJob, pods: Sequence[TracePod], cluster: ClusterSpec, catalog: Catalog | None,
            progress: Callable[[int, int], None] | None = None) -> PackingResult:
    return run_packing(pods, cluster, policy_factory(job, pods, catalog), job.seed, job.ratio, job.batch, progress)


# worker processes get the (large) inputs once, through the pool initializer
_WORKER: dict = {}


def _init_worker(pods: Sequence[TracePod], cluster: ClusterSpec, catalog: Catalog | None) -> None:
    _WORKER.update(pods=pods, cluster=cluster, catalog=catalog)


def _run_in_worker(job: PackingJob) -> PackingResult:
    return run_job(job, _WORKER["pods"], _WORKER["cluster"], _WORKER["catalog"])


def run_jobs(jobs: list[PackingJob], pods: Sequence[TracePod], cluster: ClusterSpec, catalog: Catalog | None,
             n_procs: int, on_done: Callable[[PackingResult, int], None] | None = None,
             on_step: Callable[[int, int], None] | None = None) -> list[PackingResult]:
    """Every job, in parallel processes when n_procs > 1; results in job order."""
    results: dict[int, PackingResult] = {}
    if n_procs <= 1 or len(jobs) == 1:
        for i, job in enumerate(jobs):
            results[i] = run_job(job, pods, cluster, catalog, on_step)
            if on_done:
                on_done(results[i], len(results))
    else:
        # (a job that fails, or Ctrl-C, stops the others: `worker_pool`)
        with worker_pool(min(n_procs, len(jobs)), _init_worker, (pods, cluster, catalog)) as pool:
            futures = {pool.submit(_run_in_worker, job): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if on_done:
                    on_done(results[futures[fut]], len(results))
    return [results[i] for i in range(len(jobs))]


def validate(policy: str, batch: int, ratio: float) -> None:
    if policy not in POLICIES:
        raise SimulationError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if not 1 <= batch <= MAX_BATCH:
        raise SimulationError(f"--batch {batch}: must be between 1 and {MAX_BATCH}")
    if policy != "dynpart" and batch != 1:
        raise SimulationError(f"--batch {batch}: the {policy} baseline places one pod at a time (batch 1)")
    if not 0.1 <= ratio <= 5:
        raise SimulationError(f"--tune {ratio}: expected a ratio of the GPU capacity between 0.1 and 5")


def reached(pct: float, ratio: float) -> bool:
    """Whether a list tuned to `ratio` of the capacity arrives at pct % (it ends within one pod of
    ratio x 100 %, where `PackingResult.alloc_at` gives the end's allocation)."""
    return pct <= ratio * 100 + 1e-9


def _mean(values: list[float], ratio: float, pct: float) -> float | None:
    return round(statistics.fmean(values), 3) if reached(pct, ratio) else None


def _stdev(values: list[float], ratio: float, pct: float) -> float | None:
    return (round(statistics.stdev(values), 3) if len(values) > 1 else 0.0) if reached(pct, ratio) else None


def summarise(policy: str, batch: int, results: list[PackingResult], wall_s: float,
              published: dict[str, tuple[float, float]], ratio: float = 1.3) -> dict:
    """The summary one `bench packing` run prints and writes (percentages, mean over seeds), with
    the `published` figures it compares with (`published_figures`).
    `alloc_at_100`/`alloc_at_130` are None where the list tuned to `ratio` (--tune) ends before
    that level: before, --tune 0.5 reported its end's allocation under both names."""
    a100 = [r.alloc_at(100) for r in results]
    a130 = [r.alloc_at(130) for r in results]
    out = {
        "policy": policy,
        "batch": batch,
        "seeds": [r.seed for r in results],
        "alloc_at_100": _mean(a100, ratio, 100),
        "alloc_at_130": _mean(a130, ratio, 130),
        "alloc_at_100_stdev": _stdev(a100, ratio, 100),
        "alloc_at_130_stdev": _stdev(a130, ratio, 130),
        "alloc_at_end": round(statistics.fmean(r.final_alloc for r in results), 3),
        "per_seed": [
            {"seed": r.seed,
             "alloc_at_100": round(r.alloc_at(100), 3) if reached(100, ratio) else None,
             "alloc_at_130": round(r.alloc_at(130), 3) if reached(130, ratio) else None,
             "alloc_at_end": round(r.final_alloc, 3),
             "final_arrived_pct": round(r.curve[-1][0], 3), "pods": r.pods, "placed": r.counts.placed,
             "failed": r.counts.failed, "failed_by_kind": {k: v[1] for k, v in sorted(r.counts.by_kind.items())},
             "plan_calls": r.plan_calls, "used_slices_disrupted": int(r.extra.get("disrupted", 0)),
             "free_at_end_pct": {k: v for k, v in r.extra.get("free_at_end", {}).items() if v >= 0.05},
             "wall_s": round(r.wall_s, 2)}
            for r in results
        ],
        "free_at_end_pct": _mean_free_at_end(results),
        "wall_s": round(wall_s, 2),
        "seed_wall_s_max": round(max(r.wall_s for r in results), 2),
    }
    if published:
        out["published"] = {k: {"alloc_at_100": v[0], "alloc_at_130": v[1]} for k, v in published.items()}
    return out


def _mean_free_at_end(results: list[PackingResult]) -> dict[str, float]:
    """Free capacity at the end by where it is (see `protocol.free_at_end`), mean over the seeds;
    the places under 0.05 % left out."""
    keys = {k for r in results for k in r.extra.get("free_at_end", {})}
    mean = {k: statistics.fmean(r.extra.get("free_at_end", {}).get(k, 0.0) for r in results) for k in keys}
    return {k: round(v, 3) for k, v in sorted(mean.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def mean_curve(results: list[PackingResult]) -> list[tuple[float, float]]:
    """Allocation at each whole percent of arrived demand, mean over the seeds that reached it."""
    by_pct: dict[float, list[float]] = {}
    for r in results:
        for arrived, alloc in r.curve[:-1]:
            by_pct.setdefault(arrived, []).append(alloc)
    return [(pct, statistics.fmean(v)) for pct, v in sorted(by_pct.items())]
