"""Figures of one replay over several seeds of the built-in workload (`dynpart simulate --seeds`).

One seed is one sample of the workload: on the built-in MIG part, a single seed's mean pending
time moves by 20% or more between planners that differ in a tie-break, and which policy waits
less flips from seed to seed (simulations/results/README.md). So each policy's figure here is
the mean over the seeds of each seed's own figure (its mean, p95, p99 pending time), and
dynpart's change against another policy comes with the seeds on which dynpart's figure was
lower and a 95% interval for the ratio of the two means (Fieller's, with Student's t: paired,
the same seeds for both policies). Not a bootstrap: with a handful of seeds a percentile
bootstrap's "95%" interval leaves out a difference of 0 that is the truth in 16% (5 seeds) to
45% (2 seeds) of the cases (helper-174, measured), where t's wider quantiles keep it near 5%
when the per-seed figures are roughly normal. Not the t-interval of the differences divided by
the other policy's mean either: that one ignores how uncertain that mean is, and against a
static layout whose waits vary by thousands of seconds it reached -114%.

The static layout is the one layout with the lowest mean of its per-seed means (then p95s, then
pods never placed), the same on every seed: an admin picks one layout for a fleet, not one per
sample of its workload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dynpart.simulations.replay.summary import change_pct, rnd, static_key
from dynpart.simulations.reporting import report
from dynpart.simulations.reporting.paired import ratio_interval

FIGURES = ("mean", "p95", "p99")


def mean_of(values: Sequence[float | None]) -> float | None:
    """The mean of per-seed figures; None where a seed has none (no GPU pod was placed)."""
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


def paired_change(ours: Sequence[float | None], theirs: Sequence[float | None]) -> dict:
    """dynpart's change against another policy over the same seeds, in %: of the mean of the
    per-seed figures, with its 95% interval (`ratio_interval`; None with fewer than 2 seeds, or
    where the other's figure varies too much for its mean to bound the ratio), and on how many
    seeds dynpart's figure was lower / higher. All None where a figure is missing or the other's
    mean is 0 s."""
    out: dict = {"change_pct": None, "interval_pct": None, "seeds_lower": None, "seeds_higher": None}
    if not ours or len(ours) != len(theirs) or any(v is None for v in (*ours, *theirs)):
        return out
    a = np.array(ours, dtype=float)
    b = np.array(theirs, dtype=float)
    out["change_pct"] = change_pct(float(a.mean()), float(b.mean()))
    if out["change_pct"] is None:
        return out
    out["seeds_lower"] = int((a < b).sum())
    out["seeds_higher"] = int((a > b).sum())
    bounds = ratio_interval(a, b)
    if bounds is not None:
        out["interval_pct"] = [round(100.0 * (r - 1.0), 1) for r in bounds]
    return out


def policy_figures(label: str, per_seed: Sequence[tuple[int, dict]]) -> dict:
    """One policy's figures over the seeds, from each seed's `summary()`."""
    rows = []
    for seed, s in per_seed:
        ps = s["pending_s"]
        rows.append({"seed": seed, "mean_s": ps["mean"], "p50_s": ps["p50"], "p95_s": ps["p95"], "p99_s": ps["p99"],
                     "placed": s["placed"], "never_placed": s["never_placed"], "failed": s["failed"],
                     "reconfigurations": s["reconfigurations"], "used_slices_disrupted": s["used_slices_disrupted"],
                     "allocation_mean_pct": s["allocation_mean_pct"]})
    return {
        "policy": label,
        "seeds": len(rows),
        "gpu_pods": sum(s["gpu_pods"] for _, s in per_seed),
        "placed": sum(r["placed"] for r in rows),
        "never_placed": sum(r["never_placed"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        **{f"mean_of_{f}s_s": rnd(mean_of([r[f"{f}_s"] for r in rows])) for f in FIGURES},
        "reconfigurations_per_seed": rnd(mean_of([r["reconfigurations"] for r in rows])),
        "used_slices_disrupted": sum(r["used_slices_disrupted"] for r in rows),
        "allocation_mean_pct": None if not rows else round(sum(r["allocation_mean_pct"] for r in rows) / len(rows), 2),
        "per_seed": rows,
    }


def static_rank(figures: dict) -> tuple[float, float, int]:
    """How static layouts are ranked over the seeds (lower is better): `summary.static_key` on the
    mean of the per-seed means and p95s, and the pods never placed."""
    return static_key({"pending_s": {"mean": figures["mean_of_means_s"], "p95": figures["mean_of_p95s_s"]},
                       "never_placed": figures["never_placed"]})


def best_static_over_seeds(contenders: Mapping[str, dict]) -> str:
    """The static layout with the best `static_rank`; the first of equals in the given order."""
    if not contenders:
        raise ValueError("no static layout to choose from")
    return min(contenders, key=lambda g: static_rank(contenders[g]))


def part_figures(policies: Sequence[dict]) -> dict:
    """dynpart's change against every other policy of a part (each a `policy_figures` dict)."""
    ours = next((p for p in policies if p["policy"] == "dynpart"), None)
    if ours is None:
        return {}
    out = {}
    for other in policies:
        if other is ours:
            continue
        out[other["policy"]] = {
            f: paired_change([r[f"{f}_s"] for r in ours["per_seed"]], [r[f"{f}_s"] for r in other["per_seed"]])
            for f in FIGURES}
    return out


CSV_COLUMNS = ("part", "seed", "policy", "mean_s", "p50_s", "p95_s", "p99_s", "placed", "never_placed", "failed",
               "reconfigurations", "used_slices_disrupted", "allocation_mean_pct")


def csv_rows(parts: Sequence[dict]) -> list[tuple]:
    """`seeds.csv`: one row per part, seed and policy shown."""
    return [(d["part"], r["seed"], p["policy"], *(r[c] for c in CSV_COLUMNS[3:]))
            for d in parts for p in d["policies"] for r in p["per_seed"]]


def table(parts: Sequence[dict], seeds_text: str) -> str:
    several = len(parts) > 1
    rows = []
    for d in parts:
        for p in d["policies"]:
            rows.append(([d["part"].upper()] if several else []) + [
                p["policy"], p["seeds"], p["gpu_pods"], p["placed"], p["never_placed"], p["failed"], p["mean_of_means_s"],
                p["mean_of_p95s_s"], p["mean_of_p99s_s"], p["reconfigurations_per_seed"], p["used_slices_disrupted"],
                "-" if p["allocation_mean_pct"] is None else f"{p['allocation_mean_pct']:.1f}%"])
    head = (f"seeds {seeds_text}: each figure of pending time is the mean over the seeds of the seed's own "
            "(pods: totals; reconfigurations: per seed)")
    return head + "\n" + report.table((["part"] if several else []) + [
        "policy", "seeds", "GPU pods", "placed", "never", "failed", "mean s", "p95 s", "p99 s", "reconfigs/seed",
        "disrupted", "alloc mean"], rows)


def _change(c: dict, seeds: int) -> str:
    if c["change_pct"] is None:
        return "-"
    if c["interval_pct"] is not None:
        interval = f" [{c['interval_pct'][0]:+.1f}%, {c['interval_pct'][1]:+.1f}%]"
    else:  # one seed: no interval; more: the seeds do not bound the ratio
        interval = "" if seeds < 2 else " [unbounded]"
    return f"{c['change_pct']:+.1f}%{interval}"


def _lower(c: dict, seeds: int) -> str:
    return "-" if c["seeds_lower"] is None else f"{c['seeds_lower']} of {seeds}"


def comparison(parts: Sequence[dict]) -> str:
    """dynpart's change against each other policy (negative: shorter waits), its 95% interval
    over the seeds, and on how many seeds dynpart's figure was lower."""
    several = len(parts) > 1
    rows = []
    for d in parts:
        n = d["policies"][0]["seeds"] if d["policies"] else 0
        for other, c in d.get("dynpart_vs", {}).items():
            rows.append(([d["part"].upper()] if several else []) + [
                other, _change(c["mean"], n), _lower(c["mean"], n), _change(c["p95"], n), _lower(c["p95"], n)])
    if not rows:
        return ""
    return report.table((["part"] if several else []) + [
        "dynpart against", "mean pending [95% interval]", "lower on seeds", "p95 pending [95% interval]",
        "lower on seeds"], rows)


def static_lines(parts: Sequence[dict]) -> list[str]:
    out = []
    for d in parts:
        cands = d.get("static_contenders", [])
        if len(cands) > 1:
            inf = float("inf")
            tried = ", ".join(f"{c['geometry']} " + ("-" if c["mean_of_means_s"] is None else f"{c['mean_of_means_s']:.0f} s")
                              for c in sorted(cands, key=lambda c: inf if c["mean_of_means_s"] is None
                                              else c["mean_of_means_s"]))
            where = f" ({d['part'].upper()} part)" if len(parts) > 1 else ""
            out.append(f"best static layout over the seeds{where}: {d['best_static']}; mean of the per-seed means "
                       f"of the {len(cands)} tried: {tried}")
    return out
