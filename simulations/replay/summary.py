"""Metrics of a replay run: pending-time percentiles, placements, reconfigurations."""

from __future__ import annotations

import math

from dynpart.simulations.replay.engine import ReplayResult


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values; None when there are none."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def gpu_waits(r: ReplayResult, horizon: float | None = None) -> tuple[list[float], int]:
    """Pending time of every GPU pod that could run on the cluster; a pod never placed counts
    as waiting until the end of the simulation, or until `horizon` if later (give runs compared
    with each other the same horizon: a run that places fewer pods may end sooner). Returns
    (waits, pods never placed)."""
    end = r.end_time if horizon is None else max(r.end_time, horizon)
    waits, never = [], 0
    for run in r.runs:
        if run.resource is None or run.failed:
            continue
        if run.start is None:
            never += 1
            waits.append(max(0.0, end - run.arrival))
        else:
            waits.append(run.start - run.arrival)
    return waits, never


def summary(r: ReplayResult, horizon: float | None = None) -> dict:
    waits, never = gpu_waits(r, horizon)
    gpu_runs = [x for x in r.runs if x.resource is not None]
    cpu_runs = [x for x in r.runs if x.resource is None]
    cpu_waits = [x.start - x.arrival for x in cpu_runs if x.start is not None]
    tl = r.timeline
    window = arrival_window(r, horizon)
    return {
        "policy": r.policy,
        "mode": r.mode,
        "gpu_pods": len(gpu_runs),
        "placed": sum(1 for x in gpu_runs if x.start is not None),
        "never_placed": never,
        "failed": sum(1 for x in gpu_runs if x.failed),
        "pending_s": {"p50": rnd(percentile(waits, 50)), "p95": rnd(percentile(waits, 95)),
                      "p99": rnd(percentile(waits, 99)), "max": rnd(max(waits) if waits else None),
                      "mean": rnd(sum(waits) / len(waits) if waits else None)},
        "cpu_only_pods": {"pods": len(cpu_runs), "placed": len(cpu_waits),
                          "failed": sum(1 for x in cpu_runs if x.failed),
                          "pending_p95_s": rnd(percentile(cpu_waits, 95))},
        "reconfigurations": r.reconfigurations,
        "slices_created_or_destroyed": r.mig_ops,
        "gpus_touched": r.gpus_touched,
        "gpus": r.gpu_count,
        "used_slices_disrupted": r.used_slices_disrupted,
        "plans_rejected": r.plans_rejected,
        "allocation_mean_pct": round(mean_allocation(tl, *window), 2),
        "allocation_window_s": [round(window[0], 1), round(window[1], 1)],
        "allocation_max_pct": round(max((t[3] for t in tl), default=0.0), 2),
        "max_waiting": max((t[1] for t in tl), default=0),
        "plan_calls": r.plan_calls,
        "plan_s": round(r.plan_s, 2),
        "simulated_s": round(r.end_time, 1),
        "never_placed_wait_until_s": round(r.end_time if horizon is None else max(r.end_time, horizon), 1),
        "wall_s": round(r.wall_s, 2),
        "notes": r.ignored_rows,
    }


def arrival_window(r: ReplayResult, horizon: float | None = None) -> tuple[float, float]:
    """From the first GPU pod's arrival to the last's (pods that can never run left out): while
    the workload offers its load. (Over the whole run the mean allocation would count the tail,
    where the last long pods run alone, and a policy that finishes later would show less of its
    GPUs in use for the same work.) Where they all arrive at once, until `horizon`, the end that
    runs compared with each other share (else the run's own end)."""
    arrivals = [x.arrival for x in r.runs if x.resource is not None and not x.failed]
    first = min(arrivals) if arrivals else (r.timeline[0][0] if r.timeline else 0.0)
    last = max(arrivals) if arrivals else first
    if last > first:
        return first, last
    return first, max(first, r.end_time if horizon is None else max(r.end_time, horizon))


def mean_allocation(timeline: list[tuple[float, int, int, float]], start: float, end: float) -> float:
    """Time-weighted mean of the timeline's allocation % over [start, end] (each point holds until
    the next; before the first point nothing is allocated); 0 for an empty window."""
    if end <= start or not timeline:
        return 0.0
    total = 0.0
    for i, (t, _, _, alloc) in enumerate(timeline):
        t_next = timeline[i + 1][0] if i + 1 < len(timeline) else end
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            total += (hi - lo) * alloc
    return total / (end - start)


def static_key(s: dict) -> tuple[float, float, int]:
    """How static layouts are ranked (lower is better): mean pending time of the GPU pods (a pod
    never placed waits until the end), then p95, then pods never placed."""
    ps = s["pending_s"]
    inf = float("inf")
    return (inf if ps["mean"] is None else ps["mean"], inf if ps["p95"] is None else ps["p95"], s["never_placed"])


def best_static(layouts: list[tuple[str, dict]]) -> int:
    """Index of the best (geometry, summary) by `static_key`; the first of equals."""
    if not layouts:
        raise ValueError("no static layout to choose from")
    return min(range(len(layouts)), key=lambda i: (static_key(layouts[i][1]), i))


def change_pct(ours: float | None, theirs: float | None) -> float | None:
    """(ours - theirs) / theirs in %: negative when ours is lower; None when undefined."""
    if ours is None or theirs is None or theirs <= 0:
        return None
    return round(100.0 * (ours - theirs) / theirs, 1)


def change_s(ours: float | None, theirs: float | None) -> float | None:
    """ours - theirs in seconds (negative when ours is lower); None when either is unknown."""
    if ours is None or theirs is None:
        return None
    return round(ours - theirs, 1)


def rnd(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
