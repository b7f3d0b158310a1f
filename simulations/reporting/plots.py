"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dynpart.simulations.errors import SimulationError  # noqa: E402


def _save(fig, path: Path) -> None:
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise SimulationError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


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
    _save(fig, path)


def _color(label: str) -> str:
    """The same colour for a policy in every plot (dynpart, nos, static)."""
    return {"dynpart": "C0", "nos": "C1", "static": "C2"}.get(label.split(" ")[0], "C7")


def replay_timelines(panels: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]], path: Path, title: str,
                     time_unit: str) -> None:
    """GPU allocation (top) and pending pods (bottom) over time, one line per policy, one column
    per part (panels: part title -> policy label -> series t, allocation_pct, pending)."""
    cols = max(1, len(panels))
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 6), sharex="col", squeeze=False)
    for c, (part, series) in enumerate(panels.items()):
        top, bottom = axes[0][c], axes[1][c]
        for label, s in series.items():
            top.step(s["t"], s["allocation_pct"], where="post", label=label, linewidth=1.0, color=_color(label))
            bottom.step(s["t"], s["pending"], where="post", label=label, linewidth=1.0, color=_color(label))
        top.set_ylabel("GPU allocation (%)")
        top.set_ylim(0, 100)
        bottom.set_ylabel("pending pods (symlog)")
        bottom.set_yscale("symlog", linthresh=10)
        bottom.set_ylim(bottom=0)
        bottom.set_xlabel(f"time ({time_unit})")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
        top.set_title(f"{title}: {part}" if len(panels) > 1 else title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def pending_cdf(panels: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str) -> None:
    """CDF of the pending time per policy (log x axis; zero waits at the left edge), one panel
    per part (panels: part title -> policy label -> waits)."""
    cols = max(1, len(panels))
    fig, axes = plt.subplots(1, cols, figsize=(6.5 * cols, 4.5), squeeze=False)
    for ax, (part, waits) in zip(axes[0], panels.items()):
        for label, values in waits.items():
            if not values:
                continue
            xs = sorted(max(v, 0.1) for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=label, linewidth=1.4, color=_color(label))
        ax.set_xscale("log")
        ax.set_xlabel("pending time (s, simulated; 0 drawn at 0.1)")
        ax.set_ylabel("fraction of pods")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"{title}: {part}" if len(panels) > 1 else title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def pending_bars(panels: Mapping[str, Mapping[str, tuple[float, float]]], path: Path, title: str) -> None:
    """Mean and p95 pending time per policy, side by side, one panel per part (panels: part
    title -> policy label -> (mean, p95) in s); log y axis, values written on the bars."""
    cols = max(1, len(panels))
    fig, axes = plt.subplots(1, cols, figsize=(6.5 * cols, 4.5), squeeze=False)
    for ax, (part, values) in zip(axes[0], panels.items()):
        labels = list(values)
        for k, (stat, offset, hatch) in enumerate((("mean", -0.2, ""), ("p95", 0.2, "//"))):
            heights = [max(values[lb][k], 0.1) for lb in labels]
            bars = ax.bar([i + offset for i in range(len(labels))], heights, width=0.4, label=stat, hatch=hatch,
                          color=[_color(lb) for lb in labels], edgecolor="black", linewidth=0.5)
            for b, v in zip(bars, (values[lb][k] for lb in labels)):
                ax.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("pending time (s, simulated; log)")
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.legend(fontsize=8, loc="upper left", title="plain: mean, hatched: p95", title_fontsize=7)
        ax.set_title(f"{title}: {part}" if len(panels) > 1 else title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
