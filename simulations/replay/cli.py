"""`dynpart simulate`: replay pods over time on a MIG or MPS cluster, dynpart against nos and
the best static layout.

Pods arrive at their creation time (a trace's optionally compressed, for more load) and leave
after their run time; a pod that finds no free slice is planned by the planner controller's own
loop (its batch window, resync and nodes held until they acknowledge; --planner-config gives its
settings) with each policy (dynpart; nos, with nos's 10 s / 60 s batch window; static), and
starts once its slices exist (a MIG instance created or destroyed costs --mig-delay seconds, an
MPS configuration change --mps-delay). Prints pending-time mean and percentiles, placements, reconfigurations, the
used slices disrupted (always 0 for a correct planner) and the share of the GPUs that pods
held, time-weighted from the first arrival to the last (alloc mean), per policy, and how much
shorter dynpart's waits are.

Without --trace it replays the built-in workload: a seeded inference-and-training fleet on a
small H100 cluster, a MIG part (pods asking for 1g.10gb ... 7g.80gb) and an MPS part (pods
asking for 10/20/40 GB), Poisson arrivals, log-normal run times. Give your own parameters with
--workload key=value,... or --workload FILE.yaml.

The static policy is the best standard layout for the workload: every layout of mig-parted's
standard set (all-balanced, all-<profile>; MPS: mps-1/2/4/8, and mps-<S>gb, as many S GB slices
as fit, for each slice size the pods ask for) is replayed and the one with the
lowest mean pending time is reported, named; --static-geometry forces one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace
from typing import Any

from dynpart.arguments import given
from dynpart.catalog import Catalog, GpuModel, load_catalog
from dynpart.errors import DynpartError
from dynpart.planner.demand import check_workload
from dynpart.resources import MigResource, MpsResource, parse_resource
from dynpart.settings import PlannerSettings, default_planner_settings, load_settings
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs import command_line, workloads
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import PodTrace, TracePod
from dynpart.simulations.replay import seeds as sd
from dynpart.simulations.replay.engine import (
    NOS_BATCH,
    REPLAY_POLICIES,
    ReplayOptions,
    ReplayResult,
    check_arrivals,
    run_replay,
)
from dynpart.simulations.replay.mapping import RULES, request_for, static_contenders, static_fits, static_layout
from dynpart.simulations.replay.summary import best_static, change_pct, change_s, gpu_waits, summary
from dynpart.simulations.reporting import plots, report
from dynpart.simulations.reporting.progress import Progress
from dynpart.simulations.workers import worker_pool

DEFAULT_CLUSTER = "8x8xH100-80GB"
_COST = {"nos": 0, "dynpart": 1, "static": 2}  # slowest first, to keep the processes busy
# the planner settings a replay uses (and its summary records)
PLANNER_FIELDS = {"batch_idle_s", "batch_timeout_s", "resync_s", "plan_time_limit_s", "demand_half_life_s", "workload",
                  "drain_after_s", "drain_max_gpus"}


@dataclass
class Part:
    """What one replay is run on: a trace, or one part of the built-in workload."""

    name: str  # "trace", or the workload part ("mig", "mps")
    trace: PodTrace
    cluster: ClusterSpec
    model: GpuModel
    mode: str
    statics: list[str]  # static geometries to replay (several: the best is reported)
    forced: bool  # --static-geometry chose the one static layout
    offered_load: float | None = None
    note: str = ""

    @property
    def title(self) -> str:
        return "trace" if self.name == "trace" else f"{self.name.upper()} part"


@dataclass
class Job:
    part: int
    opts: ReplayOptions
    geometry: str | None  # static layout name


def register(sub: argparse._SubParsersAction) -> None:
    # for the flags' defaults only: the planner's settings (the environment) are read when it runs
    d = ReplayOptions(planner=PlannerSettings.model_construct())
    p = sub.add_parser("simulate", help="replay pods over time on a MIG/MPS cluster: dynpart, nos, best static layout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", metavar="CSV", type=given, help="openb pod list with creation/deletion times "
                   "(default: the built-in workload)")
    p.add_argument("--workload", metavar="K=V,...|YAML",
                   help="the built-in workload's parameters, e.g. seed=7,pods=2000,rate=5,mix=1g.10gb:50,7g.80gb:5 "
                        "(a piece without '=' continues the previous value), or a YAML file of them. Keys: "
                        + workloads.keys_help())
    p.add_argument("--cluster", metavar="YAML|NxGxMODEL", type=given,
                   help=f"with --trace: cluster file or inline spec (default {DEFAULT_CLUSTER}); the built-in "
                        "workload sets its own (--workload nodes=...,mps_nodes=...,gpus_per_node=...,gpu_model=...)")
    p.add_argument("--mode", choices=["mig", "mps"], help="with --trace: override the cluster's partitioning mode; "
                   "with the built-in workload: replay only that part")
    p.add_argument("--policy", default=",".join(REPLAY_POLICIES),
                   help="dynpart, nos, static, or several separated by commas (default: all three)")
    p.add_argument("--static-geometry", metavar="NAME", type=given,
                   help="force the static layout: all-balanced, all-<profile> (e.g. all-7g, all-1g.10gb), "
                        "profile:count,... or, in mps mode, mps-N (N equal slices) or mps-<S>gb (slices of S GB) "
                        "(default: the best of the standard layouts "
                        "for the workload, by mean pending time; with the built-in workload it applies to the "
                        "part of its mode)")
    p.add_argument("--mapping", choices=RULES,
                   help="with --trace: trace gpu_milli to MIG profile: smallest profile with at least that compute "
                        "(default) or memory share")
    p.add_argument("--compress", type=float, default=d.compress,
                   help="divide arrival times by this (durations kept): more load on the same cluster (default 1)")
    p.add_argument("--mig-delay", type=float, default=d.mig_op_delay_s,
                   help=f"seconds per MIG instance created or destroyed (default {d.mig_op_delay_s:g})")
    p.add_argument("--mps-delay", type=float, default=d.mps_switch_delay_s,
                   help=f"seconds per MPS configuration change of a GPU (default {d.mps_switch_delay_s:g})")
    p.add_argument("--planner-config", metavar="YAML", type=given,
                   help="the planner's settings file (the `--config` of `dynpart planner run`): the replay runs "
                        "the controller's loop with them (batch window, resync, exact-search budget, workload); "
                        "default: the planner's defaults; DYNPART_PLANNER_* variables apply either way")
    p.add_argument("--time-limit", type=float,
                   help=f"override the planner's exact-search budget per plan, deterministic seconds (default "
                        f"{d.planner.plan_time_limit_s:g})")
    p.add_argument("--jobs", type=int, default=command_line.default_jobs(), help="replays run in parallel processes "
                   "(default: CPU count)")
    p.add_argument("--seeds", metavar="N-M|LIST", type=given,
                   help="replay the built-in workload once per seed (N, N-M or a list, e.g. 0-15) and report each "
                        "policy's mean over the seeds of its per-seed mean, p95 and p99, with dynpart's change, a "
                        "95%% interval and on how many seeds it was lower (one seed is one sample of the workload: "
                        "which policy waits less can flip from seed to seed); with --out: summary.json, seeds.csv, "
                        "pending_bars.png")
    p.add_argument("--out", metavar="DIR", help="write summary.json, steps.csv, pods.csv and PNG plots there")
    p.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    p.set_defaults(func=run)


def _one(args: tuple) -> ReplayResult:
    pods, spec, catalog, opts = args
    return run_replay(pods, spec, catalog, opts)


def _statics(forced: str | None, model: GpuModel, mode: str, pods: Sequence[TracePod]) -> list[str]:
    sizes: set[int] = set()
    if mode == "mps":  # the slice sizes the pods ask for, as the replay maps them
        for pod in pods:
            if pod.num_gpu:
                request = parse_resource(request_for(pod, model, mode)[0])
                if isinstance(request, MpsResource):
                    sizes.add(request.size)
    names = [forced] if forced else static_contenders(model, mode, tuple(sorted(sizes)))
    for n in names:
        static_layout(n, model, mode)  # a bad name is an error before anything runs
    return names


def _parts(args: argparse.Namespace, catalog: Catalog, want_static: bool) -> tuple[list[Part], Any]:
    """The parts to replay, and the workload's parameters (None for a trace)."""
    forced = args.static_geometry
    if args.trace:
        if args.workload:
            raise SimulationError("give either --trace or --workload (the built-in workload's parameters), not both")
        data = command_line.load(args.trace, None, args.cluster, catalog, default_cluster=DEFAULT_CLUSTER)
        if not data.trace.has_times:
            raise SimulationError(f"{data.trace.path}: no creation_time/deletion_time columns; replay needs them "
                                  "(the multigpu files have only 5 columns: use them with `dynpart bench packing`)")
        gpu_nodes = [n for n in data.cluster.nodes if n.gpus]
        if not gpu_nodes:
            raise SimulationError(f"{data.cluster.source}: the cluster has no GPU nodes")
        try:
            model = catalog.resolve(gpu_nodes[0].model, where=f"{data.cluster.source}: gpu_model")
        except DynpartError as e:
            raise SimulationError(str(e)) from None
        mode = args.mode or gpu_nodes[0].mode
        if args.mapping is not None and mode == "mps":
            raise SimulationError(f"--mapping {args.mapping}: maps gpu_milli to MIG profiles, and the cluster is "
                                  "replayed in mps mode (a pod gets the GB within its share of the GPU's memory)")
        if args.mode:  # the cluster as replayed (its description names the mode)
            data.cluster = ClusterSpec(data.cluster.source, tuple(replace(n, mode=args.mode) if n.gpus else n
                                                                  for n in data.cluster.nodes))
        statics = _statics(forced, model, mode, data.trace.pods) if want_static else []
        return [Part("trace", data.trace, data.cluster, model, mode, statics, bool(forced),
                     note=data.describe())], None
    _no_cluster(args)
    spec = workloads.read_workload(args.workload)
    return _workload_parts(args, catalog, want_static, spec), spec


def _no_cluster(args: argparse.Namespace) -> None:
    if args.cluster:
        raise SimulationError("--cluster goes with --trace; the built-in workload sets its own cluster "
                              "(--workload nodes=N,mps_nodes=M,gpus_per_node=G,gpu_model=MODEL)")


def _workload_parts(args: argparse.Namespace, catalog: Catalog, want_static: bool,
                    spec: workloads.WorkloadSpec) -> list[Part]:
    """The built-in workload's parts to replay (--mode picks one)."""
    forced = args.static_geometry
    generated = [w for w in workloads.generate(spec, catalog, workloads.workload_source(args.workload))
                 if args.mode in (None, w.name)]
    if not generated:
        raise SimulationError(f"--mode {args.mode}: the workload has no {args.mode.upper()} part "
                              f"({'pods' if args.mode == 'mig' else 'mps_pods'}=0)")
    if forced and want_static and not any(static_fits(forced, w.name) for w in generated):
        raise SimulationError(f"--static-geometry {forced}: not a layout of the "
                              f"{'/'.join(w.name.upper() for w in generated)} part(s) replayed")
    model = catalog.resolve(spec.gpu_model)
    parts = []
    for w in generated:
        mine = forced if forced and static_fits(forced, w.name) else None
        statics = _statics(mine, model, w.name, w.trace.pods) if want_static else []
        parts.append(Part(w.name, w.trace, w.cluster, model, w.name, statics, bool(mine), w.offered_load,
                          w.describe()))
    return parts


def _check_workload(planner: PlannerSettings, catalog: Catalog, config: str | None) -> None:
    """The planner's `workload` setting, before any replay: as `dynpart planner run` checks it,
    and a MIG profile no catalog model offers is an error here (a simulated node's driver offers
    only its catalog model's profiles, so that share would count nowhere)."""
    source = config or "the environment (DYNPART_PLANNER_WORKLOAD)"
    try:
        doubtful = check_workload(planner.workload, catalog)
    except DynpartError as e:
        raise SimulationError(f"{source}: {e}") from None
    if doubtful:
        raise SimulationError(f"{source}: {doubtful[0]} (a simulated node offers only its catalog model's profiles)")


def _check_workload_profiles(planner: PlannerSettings, parts: Sequence[Any], config: str | None) -> None:
    """A MIG profile of the `workload` setting that no GPU of the replayed cluster offers (a
    profile of another model: 1g.5gb on H100s) would count nowhere: refused, as a typo would be."""
    offered = {p.name for part in parts if part.mode == "mig" for p in part.model.mig_profiles}
    models = sorted({part.model.name for part in parts if part.mode == "mig"})
    for i, share in enumerate(planner.workload):
        kind = parse_resource(share.resource)
        if isinstance(kind, MigResource) and kind.profile not in offered:
            where = f"the replayed MIG GPUs ({', '.join(models)})" if models else "the replay (no MIG part)"
            raise SimulationError(f"{config or 'the environment (DYNPART_PLANNER_WORKLOAD)'}: workload[{i}].resource = "
                                  f"{share.resource!r}: MIG profile {kind.profile!r} is not offered by {where}")


def run(args: argparse.Namespace) -> int:
    catalog: Catalog = load_catalog(args.catalog)
    policies = command_line.parse_policies(args.policy)
    bad = [p for p in policies if p not in REPLAY_POLICIES]
    if bad or not policies:
        raise SimulationError(f"--policy {args.policy!r}: expected some of {', '.join(REPLAY_POLICIES)}")
    if args.static_geometry and "static" not in policies:
        raise SimulationError(f"--static-geometry {args.static_geometry}: goes with the static policy, which "
                              f"--policy {args.policy} leaves out")
    if args.jobs < 1:
        raise SimulationError(f"--jobs {args.jobs}: must be at least 1")
    command_line.check_time_limit(args.time_limit)
    planner = (load_settings(PlannerSettings, args.planner_config, {"plan_time_limit_s": args.time_limit})
               if args.planner_config else
               default_planner_settings().model_copy(update={"plan_time_limit_s": args.time_limit})
               if args.time_limit is not None else default_planner_settings())
    _check_workload(planner, catalog, args.planner_config)
    if planner.catalog_files:
        print(f"the planner setting catalog_files ({', '.join(planner.catalog_files)}) is not read by the "
              "simulator: pass the files with dynpart --catalog FILE simulate ...", file=sys.stderr)
    if args.mapping is not None and not args.trace:
        raise SimulationError(f"--mapping {args.mapping}: goes with --trace (it maps a trace's gpu_milli to MIG "
                              "profiles; the built-in workload's pods name theirs)")
    mapping = args.mapping or ReplayOptions.mapping
    base = ReplayOptions(mode=args.mode if args.trace else None, mapping=mapping, compress=args.compress,
                         mig_op_delay_s=args.mig_delay, mps_switch_delay_s=args.mps_delay, planner=planner)
    base.check()
    if args.seeds is not None:
        return _run_seeds(args, catalog, policies, base, planner, mapping)
    parts, spec = _parts(args, catalog, "static" in policies)
    for part in parts:
        check_arrivals(part.trace.pods, args.compress)
    _check_workload_profiles(planner, parts, args.planner_config)
    out = report.out_dir(args.out) if args.out is not None else None  # a bad --out is found before the run
    jobs = _jobs(parts, policies, base)
    if not args.json:
        for part in parts:
            print(part.note, file=sys.stderr)
        statics = sum(len(p.statics) for p in parts if not p.forced)
        if statics:
            print(f"static: replaying {statics} standard layouts to report the best", file=sys.stderr)
    t0 = time.perf_counter()
    results = _run_jobs(jobs, parts, catalog, args.jobs)
    wall = time.perf_counter() - t0
    docs = [_part_doc(k, part, jobs, results) for k, part in enumerate(parts)]
    doc: dict[str, Any] = {
        "workload": None if spec is None else spec.model_dump(),
        "workload_inline": None if spec is None else spec.inline(),
        "trace": args.trace, "mapping": mapping, "compress": args.compress,
        "mig_op_delay_s": args.mig_delay, "mps_switch_delay_s": args.mps_delay,
        "planner": planner.model_dump(include=PLANNER_FIELDS), "nos_batch": NOS_BATCH,
        "static_geometry": args.static_geometry,
        "static_choice_rule": "unless --static-geometry forces one for the part's mode: the standard layout with "
                              "the lowest mean pending time (then p95, then pods never placed)",
        "parts": [d for d, _ in docs], "wall_s": round(wall, 2),
    }
    # the results are printed first: a file that cannot be written loses none of them (and a
    # reader that goes away loses none of the files)
    shown = report.Results()
    if args.json:
        shown.print(json.dumps(doc, indent=2))
    else:
        comparison = _comparison(doc["parts"])
        shown.print(_table(doc["parts"]), *_failed_lines(doc["parts"]), *(["", comparison] if comparison else []),
                      *_static_lines(doc["parts"]))
    if out is not None:
        title = "built-in workload" if spec is not None else parts[0].trace.path.rsplit("/", 1)[-1]
        with report.staged(out) as stage:
            _write(stage, parts, docs, doc, title)
        if not args.json:
            shown.print(f"wrote {out / 'summary.json'}, steps.csv, pods.csv, pending_bars.png, pending_cdf.png, "
                          "timeline.png")
    shown.finish()
    return 0


def _jobs(parts: list[Part], policies: list[str], base: ReplayOptions) -> list[Job]:
    """One replay per part and policy; the static policy, one per layout of the part's."""
    jobs: list[Job] = []
    for k, part in enumerate(parts):
        for p in policies:
            if p == "static":
                jobs.extend(Job(k, replace(base, policy=p, static_layout=tuple(static_layout(g, part.model,
                                                                                           part.mode).items())), g)
                            for g in part.statics)
            else:
                jobs.append(Job(k, replace(base, policy=p), None))
    return jobs


def _run_seeds(args: argparse.Namespace, catalog: Catalog, policies: list[str], base: ReplayOptions,
               planner: PlannerSettings, mapping: str) -> int:
    """--seeds: the built-in workload replayed once per seed, each policy's figures averaged
    over the seeds (`simulations/replay/seeds.py`)."""
    if args.trace:
        raise SimulationError(f"--seeds {args.seeds}: goes with the built-in workload (a trace is replayed as "
                              "recorded; it has no seed)")
    seeds = command_line.parse_seeds(args.seeds)
    _no_cluster(args)
    spec = workloads.read_workload(args.workload)
    if "seed" in spec.model_fields_set:
        raise SimulationError(f"--seeds {args.seeds} and {workloads.workload_source(args.workload)} seed="
                              f"{spec.seed}: give the seeds once (--seeds replays the workload with each)")
    parts: list[Part] = []
    seed_of: list[int] = []
    for seed in seeds:
        for part in _workload_parts(args, catalog, "static" in policies, spec.model_copy(update={"seed": seed})):
            check_arrivals(part.trace.pods, args.compress)
            parts.append(part)
            seed_of.append(seed)
    # the standard layouts of a part are those of every seed's pods (an MPS layout per slice size
    # asked: a seed without a size's pods would leave that layout out, and it would be ranked on
    # the other seeds only), the same list on every seed
    statics: dict[str, list[str]] = {}
    for part in parts:
        if part.statics and not part.forced:
            if part.name not in statics:
                pods = [p for q in parts if q.name == part.name for p in q.trace.pods]
                statics[part.name] = _statics(None, part.model, part.mode, pods)
            part.statics = statics[part.name]
    _check_workload_profiles(planner, parts, args.planner_config)
    out = report.out_dir(args.out) if args.out is not None else None  # a bad --out is found before the run
    jobs = _jobs(parts, policies, base)
    if not args.json:
        for part, seed in zip(parts, seed_of):
            if seed == seeds[0]:
                print(part.note, file=sys.stderr)
        print(f"seeds {args.seeds}: {len(seeds)} seed(s), {len(jobs)} replays", file=sys.stderr)
    t0 = time.perf_counter()
    results = _run_jobs(jobs, parts, catalog, args.jobs)
    wall = time.perf_counter() - t0
    part_docs = _seed_part_docs(seeds, parts, seed_of, jobs, results)
    doc: dict[str, Any] = {
        "seeds": seeds, "workload": spec.model_dump(exclude={"seed"}), "workload_inline": spec.inline(exclude={"seed"}),
        "mapping": mapping, "compress": args.compress,
        "mig_op_delay_s": args.mig_delay, "mps_switch_delay_s": args.mps_delay,
        "planner": planner.model_dump(include=PLANNER_FIELDS), "nos_batch": NOS_BATCH,
        "static_geometry": args.static_geometry,
        "figures": "per policy, the mean over the seeds of each seed's mean / p95 / p99 pending time of the GPU "
                   "pods (a pod never placed waits until the end of the seed's longest run); dynpart_vs: the "
                   "change of those means, a 95% interval for it (Fieller's for the ratio of the means, Student's "
                   "t, paired over the seeds; null with one seed or where it would be unbounded), the seeds on "
                   "which dynpart's figure was lower / higher",
        "static_choice_rule": "unless --static-geometry forces one for the part's mode: the standard layout with "
                              "the lowest mean of its per-seed means (then p95s, then pods never placed), the same "
                              "layout on every seed",
        "parts": part_docs, "wall_s": round(wall, 2),
    }
    shown = report.Results()
    if args.json:
        shown.print(json.dumps(doc, indent=2))
    else:
        comparison = sd.comparison(part_docs)
        shown.print(sd.table(part_docs, args.seeds), *(["", comparison] if comparison else []),
                    *sd.static_lines(part_docs))
    if out is not None:
        with report.staged(out) as stage:
            report.write_json(stage / "summary.json", doc)
            report.write_csv(stage / "seeds.csv", list(sd.CSV_COLUMNS), sd.csv_rows(part_docs))
            bars = {f"{d['part'].upper()} part": {p["policy"]: (p["mean_of_means_s"] or 0.0, p["mean_of_p95s_s"] or 0.0)
                                                  for p in d["policies"]} for d in part_docs}
            plots.pending_bars(bars, stage / "pending_bars.png",
                               f"built-in workload, mean over seeds {args.seeds}")
        if not args.json:
            shown.print(f"wrote {out / 'summary.json'}, seeds.csv, pending_bars.png")
    shown.finish()
    return 0


def _seed_part_docs(seeds: list[int], parts: list[Part], seed_of: list[int], jobs: list[Job],
                    results: list[ReplayResult]) -> list[dict]:
    """Per part of the workload, each policy's figures over the seeds."""
    names = list(dict.fromkeys(p.name for p in parts))
    docs = []
    for name in names:
        runs: dict[str, list[tuple[int, dict]]] = {}
        statics: dict[str, list[tuple[int, dict]]] = {}
        first = next(p for p in parts if p.name == name)
        for seed in seeds:
            mine = [(j, r) for j, r in zip(jobs, results) if parts[j.part].name == name and seed_of[j.part] == seed]
            # pods never placed wait until the end of the seed's longest run, the same for every policy
            horizon = max(r.end_time for _, r in mine)
            for j, r in mine:
                if j.geometry is None:
                    runs.setdefault(j.opts.policy, []).append((seed, summary(r, horizon)))
                else:
                    statics.setdefault(j.geometry, []).append((seed, summary(r, horizon)))
        policies = [sd.policy_figures(p, rows) for p, rows in runs.items()]
        doc: dict[str, Any] = {"part": name, "mode": first.mode, "cluster_description": first.cluster.describe(),
                               "offered_load_pct": None if first.offered_load is None else
                               round(100 * first.offered_load, 1)}
        if statics:
            if any(len(rows) != len(seeds) for rows in statics.values()):
                raise AssertionError(f"{name} part: a static layout was not replayed on every seed")
            contenders = {g: sd.policy_figures(f"static ({g})", rows) for g, rows in statics.items()}
            best = sd.best_static_over_seeds(contenders)
            policies.append(contenders[best] | {"static_geometry": best, "static_choice": "forced" if first.forced
                                                else f"best of {len(contenders)} standard layouts over the seeds"})
            doc["best_static"] = best
            doc["static_contenders"] = [{"geometry": g, "mean_of_means_s": c["mean_of_means_s"],
                                         "mean_of_p95s_s": c["mean_of_p95s_s"], "never_placed": c["never_placed"]}
                                        for g, c in contenders.items()]
        doc["policies"] = policies
        doc["dynpart_vs"] = sd.part_figures(policies)
        docs.append(doc)
    return docs


def _run_jobs(jobs: list[Job], parts: list[Part], catalog: Catalog, n_proc: int) -> list[ReplayResult]:
    if n_proc > 1 and len(jobs) > 1:
        order = sorted(range(len(jobs)), key=lambda i: (_COST[jobs[i].opts.policy], i))
        out: dict[int, ReplayResult] = {}
        prog = Progress("simulate", len(jobs))
        try:
            # (a replay that fails, or Ctrl-C, stops the others: `worker_pool`)
            workers = min(n_proc, len(jobs))
            with worker_pool(workers) as pool:
                futures = {pool.submit(_one, (parts[jobs[i].part].trace.pods, parts[jobs[i].part].cluster, catalog,
                                              jobs[i].opts)): i for i in order}
                # woken every second, not only when a replay ends: the periodic line (or the
                # bar's clock) shows a run of minutes is alive
                pending = set(futures)
                while pending:
                    finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    running = min(len(pending), workers)
                    note = f"{running} running" + (f", {len(pending) - running} queued" if len(pending) > running else "")
                    for f in finished:
                        i = futures[f]
                        out[i] = f.result()
                        note = f"{parts[jobs[i].part].name} {_label(jobs[i])} done ({out[i].wall_s:.0f}s)"
                    prog.update(len(out), note)
        finally:
            prog.close()
        return [out[i] for i in range(len(jobs))]
    results = []
    for j in jobs:
        bar = Progress(f"simulate {parts[j.part].name} {_label(j)} (pods done)", 1)

        def tick(done: float, total: float, _b: Progress = bar) -> None:
            _b.total = max(1, int(total))
            _b.update(int(done))

        try:
            results.append(run_replay(parts[j.part].trace.pods, parts[j.part].cluster, catalog, j.opts, tick))
        finally:
            bar.close()
    return results


def _label(j: Job) -> str:
    return j.opts.policy if j.geometry is None else f"static ({j.geometry})"


def _part_doc(k: int, part: Part, jobs: list[Job], results: list[ReplayResult]) -> tuple[dict, list[ReplayResult]]:
    """The part's summary and the runs it shows (every policy; of the static layouts, the best)."""
    mine = [(j, r) for j, r in zip(jobs, results) if j.part == k]
    # pods never placed wait until the end of the part's longest run, the same for every policy
    horizon = max(r.end_time for _, r in mine)
    statics = [(j.geometry or "", summary(r, horizon), r) for j, r in mine if j.geometry is not None]
    best = best_static([(g, s) for g, s, _ in statics]) if statics else None
    shown: list[ReplayResult] = []
    summaries: list[dict] = []
    static_done = False
    for j, r in mine:
        if j.geometry is not None:
            if static_done or best is None:
                continue
            static_done = True
            g, s, r = statics[best]
            s["static_geometry"] = g
            s["static_choice"] = "forced" if part.forced else f"best of {len(statics)} standard layouts"
        else:
            s = summary(r, horizon)
        summaries.append(s)
        shown.append(r)
    doc: dict[str, Any] = {
        "part": part.name, "trace": part.trace.path, "cluster": part.cluster.source,
        "cluster_description": part.cluster.describe(), "mode": part.mode,
        "offered_load_pct": None if part.offered_load is None else round(100 * part.offered_load, 1),
        "never_placed_wait_until_s": round(horizon, 1),
        "trace_rows": {"read": part.trace.rows, "used": len(part.trace.pods), "ignored": 0},
        "policies": summaries,
    }
    if best is not None:
        doc["best_static"] = statics[best][0]
        doc["static_contenders"] = [
            {"geometry": g, "mean_pending_s": s["pending_s"]["mean"], "p95_pending_s": s["pending_s"]["p95"],
             "placed": s["placed"], "never_placed": s["never_placed"], "allocation_mean_pct": s["allocation_mean_pct"]}
            for g, s, _ in statics]
    failed = [x for x in mine[0][1].runs if x.failed] if mine else []  # the cluster's, the same for every policy
    if failed:
        doc["failed_pods"] = {"gpu": sum(1 for x in failed if x.resource is not None),
                              "cpu_only": sum(1 for x in failed if x.resource is None),
                              "first": f"{failed[0].pod.name}: {failed[0].failed}"}
    ours = next((s for s in summaries if s["policy"] == "dynpart"), None)
    if ours is not None:
        # (the change in seconds too: against a policy that kept every pod from waiting, 0 s, a
        # percentage is undefined, and the table showed '-' where dynpart's waits were longer)
        doc["dynpart_vs"] = {
            _name(s): {"mean_pending_change_pct": change_pct(ours["pending_s"]["mean"], s["pending_s"]["mean"]),
                       "p95_pending_change_pct": change_pct(ours["pending_s"]["p95"], s["pending_s"]["p95"]),
                       "mean_pending_change_s": change_s(ours["pending_s"]["mean"], s["pending_s"]["mean"]),
                       "p95_pending_change_s": change_s(ours["pending_s"]["p95"], s["pending_s"]["p95"])}
            for s in summaries if s is not ours}
    return doc, shown


def _name(s: dict) -> str:
    return s["policy"] + (f" ({s['static_geometry']})" if "static_geometry" in s else "")


def _table(parts: list[dict]) -> str:
    several = len(parts) > 1
    rows = []
    for part in parts:
        for s in part["policies"]:
            ps = s["pending_s"]
            rows.append(([part["part"].upper()] if several else []) + [
                _name(s), s["gpu_pods"], s["placed"], s["never_placed"], s["failed"], ps["mean"], ps["p50"], ps["p95"], ps["p99"],
                s["reconfigurations"], s["used_slices_disrupted"], f"{s['allocation_mean_pct']:.1f}%", f"{s['wall_s']:.1f}"])
    return report.table((["part"] if several else []) + [
        "policy", "GPU pods", "placed", "never", "failed", "mean s", "p50 s", "p95 s", "p99 s", "reconfigs", "disrupted",
        "alloc mean", "wall s"], rows)


def _comparison(parts: list[dict]) -> str:
    """How much shorter dynpart's waits are than each other policy's (negative: shorter)."""
    rows = []
    for part in parts:
        for other, c in part.get("dynpart_vs", {}).items():
            rows.append(([part["part"].upper()] if len(parts) > 1 else []) + [
                other, _change(c["mean_pending_change_pct"], c.get("mean_pending_change_s")),
                _change(c["p95_pending_change_pct"], c.get("p95_pending_change_s"))])
    if not rows:
        return ""
    return report.table((["part"] if len(parts) > 1 else []) + ["dynpart against", "mean pending", "p95 pending"], rows)


def _change(pct: float | None, seconds: float | None) -> str:
    """The change in %, or in seconds where a % is undefined (the other policy's figure is 0 s)."""
    if pct is not None:
        return f"{pct:+.1f}%"
    return "-" if seconds is None else f"{seconds:+.1f} s"


def _failed_lines(parts: list[dict]) -> list[str]:
    """Pods that can never run on the cluster (bigger than any node): not in the pending times;
    and the trace's GPU models not applied."""
    out = []
    for part in parts:
        where = f"{part['part'].upper()} part: " if len(parts) > 1 else ""
        f = part.get("failed_pods")
        if f:
            what = " and ".join(x for x in (f"{f['gpu']} GPU pod(s)" if f["gpu"] else "",
                                             f"{f['cpu_only']} CPU-only pod(s)" if f["cpu_only"] else "") if x)
            out.append(f"{where}failed: {what} can never run on this cluster, left out of the pending times "
                       f"(e.g. {f['first']})")
        if part["policies"] and not part["policies"][0]["gpu_pods"]:
            cpu = part["policies"][0]["cpu_only_pods"]
            out.append(f"{where}note: no GPU pod in the trace ({cpu['pods'] if cpu else 0} CPU-only pod(s)): "
                       "nothing to compare, every figure is empty")
        unapplied = part["policies"][0]["notes"].get("gpu_spec_not_applied") if part["policies"] else None
        if unapplied:
            out.append(f"{where}note: the gpu_spec of {unapplied} GPU pod(s) is not applied (a replay cluster has "
                       "one GPU model)")
    return out


def _static_lines(parts: list[dict]) -> list[str]:
    out = []
    for part in parts:
        cands = part.get("static_contenders", [])
        if len(cands) > 1:
            inf = float("inf")  # a layout that placed no pod has no pending time
            tried = ", ".join(f"{c['geometry']} " + ("-" if c["mean_pending_s"] is None else f"{c['mean_pending_s']:.0f} s")
                              for c in sorted(cands, key=lambda c: inf if c["mean_pending_s"] is None
                                              else c["mean_pending_s"]))
            where = f" ({part['part'].upper()} part)" if len(parts) > 1 else ""
            if all(c["mean_pending_s"] is None for c in cands):
                out.append(f"static layouts{where}: none of the {len(cands)} tried placed a GPU pod")
                continue
            out.append(f"best static layout{where}: {part['best_static']}; mean pending of the {len(cands)} "
                       f"tried: {tried}")
    return out


def _write(out, parts: list[Part], docs: list[tuple[dict, list[ReplayResult]]], doc: dict, title: str) -> None:
    report.write_json(out / "summary.json", doc)
    shown = [(part, s, r) for part, (d, rs) in zip(parts, docs) for s, r in zip(d["policies"], rs)]
    report.write_csv(out / "steps.csv", ["part", "policy", "t_s", "waiting_gpu_pods", "running_pods", "allocation_pct"],
                     [(part.name, _name(s), round(t, 1), w, n, round(a, 3))
                      for part, s, r in shown for t, w, n, a in r.timeline])
    report.write_csv(out / "pods.csv", ["part", "policy", "pod", "resource", "count", "arrival_s", "start_s",
                                        "pending_s", "failed"],
                     [(part.name, _name(s), x.pod.name, x.resource or "cpu-only", x.count, round(x.arrival, 1),
                       None if x.start is None else round(x.start, 1),
                       None if x.start is None else round(x.start - x.arrival, 1), x.failed or "")
                      for part, s, r in shown for x in r.runs])
    timelines: dict[str, dict[str, dict[str, list[float]]]] = {}
    waits: dict[str, dict[str, list[float]]] = {}
    bars: dict[str, dict[str, tuple[float, float]]] = {}
    for part, s, r in shown:
        timelines.setdefault(part.title, {})[_name(s)] = {
            "t": [t / 3600 for t, *_ in r.timeline], "pending": [w for _, w, _, _ in r.timeline],
            "allocation_pct": [a for *_, a in r.timeline]}
        waits.setdefault(part.title, {})[_name(s)] = gpu_waits(r, s["never_placed_wait_until_s"])[0]
        ps = s["pending_s"]
        bars.setdefault(part.title, {})[_name(s)] = (ps["mean"] or 0.0, ps["p95"] or 0.0)
    plots.pending_bars(bars, out / "pending_bars.png", f"pending time of GPU pods: {title}")
    plots.pending_cdf(waits, out / "pending_cdf.png", f"pending time of GPU pods: {title}")
    plots.replay_timelines(timelines, out / "timeline.png", f"replay: {title}", "hours")
