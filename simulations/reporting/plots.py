"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def packing_curves(curves: Mapping[str, Sequence[tuple[float, float]]], path: Path, title: str,
                   published: dict[str, tuple[float, float]] | None = None) -> None:
    """Allocation vs arrived demand, one line per policy (mean over seeds)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lo = 100.0
    for label, curve in curves.items():
        xs = [a for a, _ in curve]
        ys = [b for _, b in curve]
        ax.plot(xs, ys, label=label, linewidth=1.6)
        lo = min([lo] + [y for x, y in curve if x >= 60])
    for name, (at100, at130) in (published or {}).items():
        ax.plot([100, 130], [at100, at130], "x", markersize=6, label=f"published {name}")
    ax.plot([0, 100], [0, 100], ":", color="grey", linewidth=0.8, label="all arrived placed")
    ax.set_xlim(60, 131)
    ax.set_ylim(max(0.0, lo - 3), 100)
    ax.axvline(100, color="grey", linewidth=0.5)
    ax.set_xlabel("arrived GPU demand (% of cluster GPU capacity)")
    ax.set_ylabel("GPU allocation (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replay_timelines(series: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str, time_unit: str) -> None:
    """GPU allocation and pending pods over time, one line per policy (two panels)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for label, s in series.items():
        top.step(s["t"], s["allocation_pct"], where="post", label=label, linewidth=1.0)
        bottom.step(s["t"], s["pending"], where="post", label=label, linewidth=1.0)
    top.set_ylabel("GPU allocation (%)")
    top.set_ylim(0, 100)
    bottom.set_ylabel("pending pods (symlog)")
    bottom.set_yscale("symlog", linthresh=10)
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel(f"time ({time_unit})")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    top.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pending_cdf(waits: dict[str, list[float]], path: Path, title: str) -> None:
    """CDF of the pending time per policy (log x axis; zero waits at the left edge)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in waits.items():
        if not values:
            continue
        xs = sorted(max(v, 0.1) for v in values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=label, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("pending time (s, simulated; 0 drawn at 0.1)")
    ax.set_ylabel("fraction of pods")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
