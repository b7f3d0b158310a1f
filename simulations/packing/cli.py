"""`dynpart bench packing`: the packing benchmark of the FGD paper (Weng et al., ATC'23).

Every pod of the trace arrives once, in a seeded random order, onto the same cluster; the list
is tuned to 130% of the cluster's GPU capacity; nothing leaves and a pod that cannot be placed
fails for good. The figure is the GPU allocation ratio when 100% and 130% of the capacity has
arrived (mean over seeds), as in the paper's tables. Without --trace it runs a small built-in
synthetic workload so that a first run shows a result at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dynpart.arguments import given
from dynpart.catalog import load_catalog
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs import command_line
from dynpart.simulations.packing import experiment as bp
from dynpart.simulations.packing.dynpart_packing import MAX_BATCH, TIME_LIMIT_S
from dynpart.simulations.reporting import plots, report
from dynpart.simulations.reporting.paired import difference_interval
from dynpart.simulations.reporting.progress import Progress


def register(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("packing", help="the FGD paper's packing benchmark (allocation at 100%%/130%% arrived)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", metavar="CSV", type=given, help="openb pod list (default: a built-in synthetic workload)")
    p.add_argument("--nodes", metavar="CSV", type=given, help="openb node list (e.g. openb_node_list_all_node.csv)")
    p.add_argument("--cluster", metavar="YAML|NxGxMODEL", type=given, help="cluster file or inline spec instead of --nodes")
    p.add_argument("--policy", default="dynpart",
                   help=f"{', '.join(bp.POLICIES)}, or several separated by commas (default dynpart)")
    p.add_argument("--batch", type=int, default=1,
                   help=f"dynpart: consecutive arrivals planned together, 1..{MAX_BATCH} (default 1: online)")
    p.add_argument("--seeds", default="42-51", help="shuffle seeds: N, N-M or a list (default 42-51, the paper's)")
    p.add_argument("--tune", type=float, default=1.3, help="workload size as a ratio of GPU capacity (default 1.3)")
    p.add_argument("--time-limit", type=float,
                   help=f"dynpart and fgd: planner exact-search budget per plan, deterministic seconds (default "
                        f"{TIME_LIMIT_S:g})")
    p.add_argument("--jobs", type=int, default=command_line.default_jobs(), help="parallel processes (default: CPU count)")
    p.add_argument("--out", metavar="DIR", help="write summary.json, steps.csv and allocation.png there")
    p.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.catalog)
    seeds = command_line.parse_seeds(args.seeds)
    policies = command_line.parse_policies(args.policy)
    if not policies:
        raise SimulationError(f"--policy {args.policy!r}: expected one of {', '.join(bp.POLICIES)}")
    for pol in policies:
        bp.validate(pol, args.batch if pol == "dynpart" else 1, args.tune)
    if args.batch != 1 and "dynpart" not in policies:
        bp.validate(policies[0], args.batch, args.tune)  # baselines place one pod at a time
    if args.jobs < 1:
        raise SimulationError(f"--jobs {args.jobs}: must be at least 1")
    command_line.check_time_limit(args.time_limit)
    if args.time_limit is not None and not {"dynpart", "fgd"} & set(policies):
        raise SimulationError(f"--time-limit {args.time_limit:g}: the planner's budget, used by the dynpart and fgd "
                              f"policies, which --policy {args.policy} leaves out")
    time_limit = TIME_LIMIT_S if args.time_limit is None else args.time_limit
    data = command_line.load(args.trace, args.nodes, args.cluster, catalog, default_cluster=None)
    out = report.out_dir(args.out) if args.out is not None else None  # a bad --out is found before the run
    if not args.json:
        print(data.describe(), file=sys.stderr)
    nowhere = data.models_nowhere()
    if nowhere:
        print(nowhere, file=sys.stderr)  # with --json too: the figures count these pods as failed
    over = tuned_down(data, args.tune)
    if over:
        print(over, file=sys.stderr)  # with --json too: "N pods used" above is not what arrives
    published = bp.published_figures(data.trace_name, data.cluster, args.tune)
    elsewhere = bp.published_elsewhere(data.trace_name, data.cluster, args.tune)
    if elsewhere and not args.json:
        print(elsewhere, file=sys.stderr)
    summaries, curves = [], {}
    all_results = {}
    for pol in policies:
        batch = args.batch if pol == "dynpart" else 1
        jobs = [bp.PackingJob(pol, s, batch, args.tune, time_limit) for s in seeds]
        prog = Progress(f"{pol} (batch {batch})", len(jobs))
        # with one process, a bar within each seed too (on a terminal only)
        inner = Progress(f"{pol} seed", 1) if (args.jobs <= 1 or len(jobs) == 1) and prog.tty else None

        def on_step(done: int, total: int, _p: Progress | None = inner) -> None:
            if _p is not None:
                _p.total = total
                _p.update(done)

        def on_done(r, n, _p=prog) -> None:
            at = f"{r.alloc_at(130):.2f}% at 130%" if bp.reached(130, args.tune) else f"{r.final_alloc:.2f}% at the end"
            _p.update(n, f"seed {r.seed}: {at} ({r.wall_s:.1f}s)")

        t0 = time.perf_counter()
        results = bp.run_jobs(jobs, data.trace.pods, data.cluster, catalog, args.jobs, on_done,
                              on_step if inner is not None else None)
        wall = time.perf_counter() - t0
        prog.close()
        summary = bp.summarise(pol, batch, results, wall, published, args.tune)
        summary.update(trace=data.trace.path, cluster=data.cluster.source, tune=args.tune,
                       trace_rows={"read": data.trace.rows, "used": len(data.trace.pods), "ignored": 0},
                       gpus=data.cluster.gpu_count)
        summaries.append(summary)
        label = f"{pol}" + (f" (batch {batch})" if pol == "dynpart" else "")
        curves[label] = bp.mean_curve(results)
        all_results[label] = results
    versus = _dynpart_versus(summaries)
    doc = summaries[0] if len(summaries) == 1 else {"runs": summaries, **({"dynpart_vs": versus} if versus else {})}
    # the results are printed first: a file that cannot be written loses none of them (and a
    # reader that goes away loses none of the files)
    shown = report.Results()
    shown.print(json.dumps(doc, indent=2) if args.json else _summary_table(summaries))
    if not args.json and versus:
        shown.print(*_versus_lines(versus))
    if not args.json and not bp.reached(130, args.tune):
        levels = "100% or 130%" if not bp.reached(100, args.tune) else "130%"
        ends = ", ".join(f"{s['policy']} {s['alloc_at_end']:.2f}%" for s in summaries)
        shown.print(f"--tune {args.tune:g}: the pod list ends at {args.tune * 100:g}% of the GPU capacity, before "
                    f"{levels} arrived; allocation at the end: {ends}")
    if out is not None:
        with report.staged(out) as stage:
            _write(stage, doc, summaries, all_results, curves, data, args, published)
        if not args.json:
            shown.print(f"wrote {out / 'summary.json'}, steps.csv, allocation.png")  # (a Path: --out dir/ gave dir//)
    shown.finish()
    return 0


def tuned_down(data: command_line.Inputs, ratio: float) -> str | None:
    """A line saying that the trace asks for more than `ratio` of the cluster's GPU capacity, so
    each seed removes pods at random until it does not (the authors' `tuneDownPods`): on a cluster
    smaller than the trace's, few of its pods arrive, or none. None when it asks for no more."""
    demand = sum(p.gpu_demand for p in data.trace.pods)
    capacity = data.cluster.gpu_count * 1000
    if not capacity or demand <= ratio * capacity:
        return None
    return (f"trace {data.trace.path}: its pods ask for {100 * demand / capacity:.0f}% of the cluster's GPU capacity, "
            f"above --tune {ratio:g}: each seed removes pods at random until at most {100 * ratio:g}% is asked for "
            "(per_seed 'pods' in summary.json: how many arrived)")


def _write(out: Path, doc: dict, summaries: list[dict], all_results: dict, curves: dict, data: Any,
           args: argparse.Namespace, published: dict[str, tuple[float, float]]) -> None:
    report.write_json(out / "summary.json", doc)
    report.write_csv(out / "steps.csv", ["policy", "batch", "seed", "arrived_pct", "allocation_pct"],
                     [(s["policy"], s["batch"], r.seed, round(a, 3), round(b, 4))
                      for s, (label, rs) in zip(summaries, all_results.items()) for r in rs for a, b in r.curve])
    plots.packing_curves(curves, out / "allocation.png",
                         f"packing: {data.trace_name or 'synthetic workload'}, seeds {args.seeds}",
                         {k: v for k, v in published.items() if k in ("best-fit", "fgd")})


def _dynpart_versus(summaries: list[dict]) -> dict[str, dict]:
    """dynpart's allocation against each other policy of the run, seed by seed (the same seeds:
    the same pods in the same order), at 100% and 130% arrived: the mean difference in points,
    its 95% t-interval (paired), and the seeds on which dynpart allocated more / less."""
    ours = next((s for s in summaries if s["policy"] == "dynpart"), None)
    if ours is None:
        return {}
    out: dict[str, dict] = {}
    for other in summaries:
        if other is ours:
            continue
        figures = {}
        for level in ("alloc_at_100", "alloc_at_130"):
            theirs = {p["seed"]: p[level] for p in other["per_seed"]}
            pairs = [(p[level], theirs[p["seed"]]) for p in ours["per_seed"]
                     if p[level] is not None and theirs.get(p["seed"]) is not None]
            if not pairs:
                continue
            a, b = [x for x, _ in pairs], [y for _, y in pairs]
            interval = difference_interval(a, b)
            figures[level] = {
                "difference_points": round(sum(a) / len(a) - sum(b) / len(b), 3),
                "interval_points": None if interval is None else [round(v, 3) for v in interval],
                "seeds": len(pairs), "seeds_higher": sum(x > y for x, y in pairs),
                "seeds_lower": sum(x < y for x, y in pairs)}
        out[other["policy"]] = figures
    return out


def _versus_lines(versus: dict[str, dict]) -> list[str]:
    lines = [""]
    for other, figures in versus.items():
        for level, f in figures.items():
            interval = "" if f["interval_points"] is None else \
                f" [{f['interval_points'][0]:+.3f}, {f['interval_points'][1]:+.3f}]"
            lines.append(f"dynpart against {other}, {level[len('alloc_at_'):]}% arrived: {f['difference_points']:+.3f} "
                         f"points{interval} (95% t-interval, paired over the seeds), higher on {f['seeds_higher']} "
                         f"and lower on {f['seeds_lower']} of {f['seeds']} seeds")
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"  # None: a level the tuned list never reaches


def _summary_table(summaries: list[dict]) -> str:
    rows: list[tuple[object, ...]] = []
    for s in summaries:
        failed = sum(p["failed"] for p in s["per_seed"])
        rows.append((s["policy"], s["batch"], len(s["seeds"]), _pct(s["alloc_at_100"]), _pct(s["alloc_at_130"]),
                     "-" if s["alloc_at_130_stdev"] is None else f"±{s['alloc_at_130_stdev']:.2f}",
                     failed // len(s["seeds"]), f"{s['seed_wall_s_max']:.1f}s", f"{s['wall_s']:.1f}s"))
    for name, v in summaries[0].get("published", {}).items():
        rows.append((f"published {name}", "", "", f"{v['alloc_at_100']:.2f}%", f"{v['alloc_at_130']:.2f}%", "", "", "", ""))
    return report.table(["policy", "batch", "seeds", "alloc@100%", "alloc@130%", "stdev", "failed/seed",
                         "max seed", "wall"], rows)
