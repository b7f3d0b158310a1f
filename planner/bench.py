"""`dynpart bench planner`: plan seeded random clusters and print how fast and how well.

A benchmark, not a timed test: it prints figures (median and p99 planning time over the
repeats, pods placed, and an upper bound on what any plan could place) for a human or CI log
to compare, e.g. dynpart against the nos baseline on the same seeds."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dynpart.catalog import load_catalog
from dynpart.planner.core import POLICIES, PlanOptions, plan
from dynpart.planner.workload import random_snapshot


def register(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench_sub.add_parser("planner", help="planning time and quality on seeded random clusters",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100, help="nodes (default 100)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="H100-80GB", help="GPU model name or product label (default H100-80GB)")
    p.add_argument("--pending", type=int, default=200, help="pending pods (default 200)")
    p.add_argument("--mode", choices=["mig", "mps"], default="mig")
    p.add_argument("--policy", choices=list(POLICIES), default="dynpart")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="share of GPUs that already carry slices, mostly in use (default 0.9)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5, help="plans to time, seeds seed..seed+repeat-1 (default 5)")
    p.add_argument("--time-limit", type=float, default=PlanOptions().time_limit_s,
                   help="exact-search budget per plan, CP-SAT deterministic seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def run(args: argparse.Namespace) -> int:
    from dynpart.errors import DynpartError
    # (the bounds: beyond what one machine can build and plan, where a typo would just hang)
    for name, lo, hi in (("nodes", 1, 100_000), ("gpus_per_node", 1, 64), ("pending", 0, 1_000_000),
                         ("repeat", 1, 1_000)):
        value = getattr(args, name)
        if not lo <= value <= hi:
            raise DynpartError(f"--{name.replace('_', '-')} = {value}: must be between {lo} and {hi}")
    if args.seed < 0:
        raise DynpartError(f"--seed = {args.seed}: must be 0 or more")
    if not 0 <= args.utilization <= 1:
        raise DynpartError(f"--utilization = {args.utilization}: must be between 0 and 1")
    if not 0 <= args.time_limit < float("inf"):  # nan fails too
        raise DynpartError(f"--time-limit = {args.time_limit}: must be a finite number of seconds, 0 or more")
    catalog = load_catalog(args.catalog)
    model = catalog.resolve(args.gpu, "--gpu")
    if args.mode == "mig" and not model.supports_mig:
        # (the generator would have no MIG geometry to draw: an IndexError from random.choice)
        raise DynpartError(f"--gpu {args.gpu}: {model.name} does not support MIG; use --mode mps")
    opts = PlanOptions(policy=args.policy, time_limit_s=args.time_limit)
    times, cpu_times, placed, bounds, solvers, touched, destroyed = [], [], [], [], [], [], []
    for i in range(args.repeat):
        snap = random_snapshot(args.seed + i, args.nodes, args.gpus_per_node, args.gpu, args.pending, args.mode,
                               args.utilization, catalog)
        t, c = time.perf_counter(), time.process_time()
        result = plan(snap, catalog, opts)
        times.append(time.perf_counter() - t)
        # the process's CPU time too: on a shared machine the wall clock also counts the time
        # other work held the CPU (a plan runs on one thread)
        cpu_times.append(time.process_time() - c)
        placed.append(result.stats.placed)
        bounds.append(result.stats.placed_upper_bound)
        solvers.append(result.stats.solver)
        touched.append(result.stats.gpus_touched)
        destroyed.append(result.stats.free_slices_destroyed)
    out = {
        "policy": args.policy, "mode": args.mode, "gpu": catalog.resolve(args.gpu).name,
        "nodes": args.nodes, "gpus": args.nodes * args.gpus_per_node, "pending": args.pending,
        "seeds": list(range(args.seed, args.seed + args.repeat)),
        "placed": round(statistics.mean(placed), 1), "placed_per_seed": placed,
        "placed_upper_bound": round(statistics.mean(bounds), 1), "placed_upper_bound_per_seed": bounds,
        "gpus_touched": round(statistics.mean(touched), 1), "free_slices_destroyed": round(statistics.mean(destroyed), 1),
        "plan_s_median": round(statistics.median(times), 4), "plan_s_p99": round(_p99(times), 4),
        "plan_s_per_seed": [round(t, 4) for t in times],
        "plan_cpu_s_median": round(statistics.median(cpu_times), 4), "plan_cpu_s_p99": round(_p99(cpu_times), 4),
        "solver": solvers[0],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"dynpart bench planner: policy {out['policy']}, {out['mode']}, {out['nodes']} nodes x "
          f"{args.gpus_per_node} {out['gpu']} ({out['gpus']} GPUs), {out['pending']} pending pods, "
          f"seeds {out['seeds'][0]}..{out['seeds'][-1]}")
    print(f"  {'seed':>6} {'placed':>7} {'bound':>7} {'touched':>8} {'destroyed':>9} {'plan s':>8} {'cpu s':>7}  solver")
    for s, pl, b, tc, d, t, ct, sv in zip(out["seeds"], placed, bounds, touched, destroyed, times, cpu_times, solvers):
        print(f"  {s:>6} {pl:>7} {b:>7} {tc:>8} {d:>9} {t:>8.3f} {ct:>7.3f}  {sv}")
    print(f"  placed {out['placed']} of {out['pending']} (upper bound {out['placed_upper_bound']}); "
          f"plan time median {out['plan_s_median']:.3f} s, p99 {out['plan_s_p99']:.3f} s "
          f"(CPU time median {out['plan_cpu_s_median']:.3f} s, p99 {out['plan_cpu_s_p99']:.3f} s)")
    return 0
