"""`dynpart simulate`: replay a pod trace over time on a MIG or MPS cluster.

Pods arrive at their trace creation time (optionally compressed, for more load) and leave
after their recorded duration; waiting pods are planned every --window seconds by the same
`plan()` the controller calls, with the chosen policy (dynpart, nos, static), and start once
their slices exist (a MIG instance created or destroyed costs --mig-delay seconds, an MPS
configuration change --mps-delay). Prints pending-time percentiles, placements,
reconfigurations and the used slices disrupted (always 0 for a correct planner) per policy.
Without --trace it replays a small built-in synthetic workload so that a first run shows a
result at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from dynpart.catalog import Catalog, load_catalog
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs import command_line
from dynpart.simulations.inputs.synthetic import synthetic_mig_cluster
from dynpart.simulations.replay.engine import REPLAY_POLICIES, ReplayOptions, ReplayResult, run_replay
from dynpart.simulations.replay.mapping import RULES, static_layout
from dynpart.simulations.replay.summary import gpu_waits, summary
from dynpart.simulations.reporting import plots, report
from dynpart.simulations.reporting.progress import Progress

DEFAULT_CLUSTER = "8x8xH100-80GB"
SYNTHETIC_PODS = 200


def register(sub: argparse._SubParsersAction) -> None:
    d = ReplayOptions()
    p = sub.add_parser("simulate", help="replay a pod trace over time on a MIG/MPS cluster (dynpart, nos, static)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", metavar="CSV", help="openb pod list with creation/deletion times "
                   "(default: a built-in synthetic workload)")
    p.add_argument("--cluster", metavar="YAML|NxGxMODEL",
                   help=f"cluster file or inline spec (default {DEFAULT_CLUSTER}; without --trace, 2 nodes x 8 "
                        "H100-80GB with 224 CPUs)")
    p.add_argument("--mode", choices=["mig", "mps"], help="override the cluster's partitioning mode")
    p.add_argument("--policy", default=",".join(REPLAY_POLICIES),
                   help="dynpart, nos, static, or several separated by commas (default: all three)")
    p.add_argument("--static-geometry", default="all-balanced", metavar="NAME",
                   help="static policy: all-balanced, all-<profile> (e.g. all-7g, all-1g.10gb), "
                        "profile:count,... or, in mps mode, mps-N (default all-balanced)")
    p.add_argument("--mapping", choices=RULES, default=d.mapping,
                   help="gpu_milli to MIG profile: smallest profile with at least that compute (default) or "
                        "memory share")
    p.add_argument("--compress", type=float, default=d.compress,
                   help="divide arrival times by this (durations kept): more load on the same cluster (default 1)")
    p.add_argument("--window", type=float, default=d.window_s, help=f"planning window, s (default {d.window_s:g})")
    p.add_argument("--mig-delay", type=float, default=d.mig_op_delay_s,
                   help=f"seconds per MIG instance created or destroyed (default {d.mig_op_delay_s:g})")
    p.add_argument("--mps-delay", type=float, default=d.mps_switch_delay_s,
                   help=f"seconds per MPS configuration change of a GPU (default {d.mps_switch_delay_s:g})")
    p.add_argument("--plan-pods", type=int, default=d.plan_pods,
                   help=f"oldest waiting pods given to each plan (default {d.plan_pods})")
    p.add_argument("--fairness", choices=["age", "rank", "none"], default=d.fairness,
                   help="priority of waiting pods, the same for every policy: age (default: a level per --aging "
                        f"seconds waited, up to {d.max_priority}), rank (by queue position) or none")
    p.add_argument("--aging", type=float, default=d.aging_s,
                   help=f"seconds per priority level with --fairness age (default {d.aging_s:g})")
    p.add_argument("--time-limit", type=float, default=d.time_limit_s,
                   help=f"planner exact-search budget per plan, deterministic seconds (default {d.time_limit_s:g})")
    p.add_argument("--jobs", type=int, default=command_line.default_jobs(), help="policies run in parallel processes "
                   "(default: CPU count)")
    p.add_argument("--out", metavar="DIR", help="write summary.json, steps.csv, pods.csv and PNG plots there")
    p.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    p.set_defaults(func=run)


def _one(args: tuple) -> ReplayResult:
    pods, spec, catalog, opts = args
    return run_replay(pods, spec, catalog, opts)


def run(args: argparse.Namespace) -> int:
    catalog: Catalog = load_catalog(args.catalog)
    policies = [s.strip() for s in args.policy.split(",") if s.strip()]
    bad = [p for p in policies if p not in REPLAY_POLICIES]
    if bad or not policies:
        raise SimulationError(f"--policy {args.policy!r}: expected some of {', '.join(REPLAY_POLICIES)}")
    if args.jobs < 1:
        raise SimulationError(f"--jobs {args.jobs}: must be at least 1")
    data = command_line.load(args.trace, None, args.cluster, catalog,
                       default_cluster=DEFAULT_CLUSTER if args.trace else synthetic_mig_cluster(),
                       synthetic_pods=SYNTHETIC_PODS)
    if not data.trace.has_times:
        raise SimulationError(f"{data.trace.path}: no creation_time/deletion_time columns; replay needs them "
                              "(the multigpu files have only 5 columns: use them with `dynpart bench packing`)")
    base = ReplayOptions(mode=args.mode, mapping=args.mapping, compress=args.compress, window_s=args.window,
                         mig_op_delay_s=args.mig_delay, mps_switch_delay_s=args.mps_delay, plan_pods=args.plan_pods,
                         time_limit_s=args.time_limit, aging_s=args.aging, fairness=args.fairness)
    base.check()
    gpu_nodes = [n for n in data.cluster.nodes if n.gpus]
    if not gpu_nodes:
        raise SimulationError(f"{data.cluster.source}: the cluster has no GPU nodes")
    model = catalog.resolve(gpu_nodes[0].model, where=f"{data.cluster.source}: gpu_model")
    mode = args.mode or gpu_nodes[0].mode
    layout = tuple(static_layout(args.static_geometry, model, mode).items()) if "static" in policies else ()
    jobs = [replace(base, policy=p, static_layout=layout if p == "static" else ()) for p in policies]
    if not args.json:
        print(data.describe(), file=sys.stderr)
    t0 = time.perf_counter()
    results: list[ReplayResult]
    if args.jobs > 1 and len(jobs) > 1:
        prog = Progress("simulate", len(jobs))
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
            futures = [pool.submit(_one, (data.trace.pods, data.cluster, catalog, j)) for j in jobs]
            results = []
            for f in futures:
                results.append(f.result())
                prog.update(len(results), f"{results[-1].policy} done ({results[-1].wall_s:.0f}s)")
        prog.close()
    else:
        results = []
        for j in jobs:
            bar = Progress(f"simulate {j.policy}", 1)

            def tick(done: float, total: float, _b: Progress = bar) -> None:
                _b.total = max(1, int(total))
                _b.update(int(done))

            results.append(run_replay(data.trace.pods, data.cluster, catalog, j, tick))
            bar.close()
    wall = time.perf_counter() - t0
    summaries = [summary(r) for r in results]
    for s, r in zip(summaries, results):
        if r.policy == "static":
            s["static_geometry"] = args.static_geometry
    doc = {
        "trace": data.trace.path, "cluster": data.cluster.source, "cluster_description": data.cluster.describe(),
        "mode": results[0].mode, "mapping": args.mapping, "compress": args.compress, "window_s": args.window,
        "mig_op_delay_s": args.mig_delay, "mps_switch_delay_s": args.mps_delay, "plan_pods": args.plan_pods,
        "fairness": args.fairness, "aging_s": args.aging, "time_limit_s": args.time_limit,
        "trace_rows": {"read": data.trace.rows, "used": len(data.trace.pods), "ignored": 0},
        "policies": summaries, "wall_s": round(wall, 2),
    }
    if args.out:
        _write(report.out_dir(args.out), results, doc, data.trace_name or "synthetic workload")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_table(summaries))
        if args.out:
            print(f"wrote {args.out}/summary.json, steps.csv, pods.csv, timeline.png, pending_cdf.png")
    return 0


def _table(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        ps = s["pending_s"]
        rows.append((s["policy"] + (f" ({s['static_geometry']})" if "static_geometry" in s else ""),
                     s["gpu_pods"], s["placed"], s["never_placed"], s["failed"], ps["p50"], ps["p95"], ps["p99"],
                     s["reconfigurations"], s["gpus_touched"], s["used_slices_disrupted"],
                     f"{s['allocation_mean_pct']:.1f}%", f"{s['wall_s']:.1f}"))
    return report.table(["policy", "GPU pods", "placed", "never", "failed", "p50 s", "p95 s", "p99 s",
                         "reconfigs", "GPUs touched", "disrupted", "alloc mean", "wall s"], rows)


def _write(out, results: list[ReplayResult], doc: dict, title: str) -> None:
    report.write_json(out / "summary.json", doc)
    report.write_csv(out / "steps.csv", ["policy", "t_s", "waiting_gpu_pods", "running_pods", "allocation_pct"],
                     [(r.policy, round(t, 1), w, n, round(a, 3)) for r in results for t, w, n, a in r.timeline])
    report.write_csv(out / "pods.csv", ["policy", "pod", "resource", "count", "arrival_s", "start_s", "pending_s",
                                        "failed"],
                     [(r.policy, x.pod.name, x.resource or "cpu-only", x.count, round(x.arrival, 1),
                       None if x.start is None else round(x.start, 1),
                       None if x.start is None else round(x.start - x.arrival, 1), x.failed or "")
                      for r in results for x in r.runs])
    hours: dict[str, dict[str, list[float]]] = {
        r.policy: {"t": [t / 3600 for t, *_ in r.timeline], "pending": [w for _, w, _, _ in r.timeline],
                   "allocation_pct": [a for *_, a in r.timeline]} for r in results}
    plots.replay_timelines(hours, out / "timeline.png", f"replay: {title}", "hours")
    plots.pending_cdf({r.policy: gpu_waits(r)[0] for r in results}, out / "pending_cdf.png",
                      f"pending time of GPU pods: {title}")
