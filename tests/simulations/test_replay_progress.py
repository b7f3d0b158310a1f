"""`dynpart simulate`'s progress counts pods settled (left or failed) of the trace's. It used to
follow the simulated clock up to the last arrival (helper-156): a backlog draining after it, most
of an overloaded replay, showed 100% (a plain stream then printed nothing until the table), and a
trace whose pods all arrive at once showed 0/1 for the whole run."""

from __future__ import annotations

from dynpart.catalog import default_catalog
from dynpart.simulations.inputs.cluster_spec import ClusterSpec, NodeSpec
from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.replay.engine import ReplayOptions, run_replay
from dynpart.simulations.replay.mapping import static_layout


def test_progress_is_not_full_while_most_of_the_replay_remains() -> None:
    catalog = default_catalog()
    model = catalog.resolve("H100-80GB")
    spec = ClusterSpec("<t>", (NodeSpec("n0", 112_000, 1 << 20, 1, "H100-80GB", "mig"),))
    # 40 whole-GPU pods arrive in 40 s onto one GPU, each runs 1000 s: the replay lasts ~40,000 s
    pods = [TracePod(f"p{i:02d}", 1000, 1024, 1, 1000, (), i, i + 1000) for i in range(40)]
    opts = ReplayOptions(policy="static", static_layout=tuple(static_layout("all-7g", model, "mig").items()))
    calls: list[tuple[float, float]] = []
    result = run_replay(pods, spec, catalog, opts, lambda done, total: calls.append((done, total)))
    assert result.end_time > 39_000  # the drain after the last arrival is ~99% of the replay
    full = [c for c in calls if c[0] >= c[1]]
    assert len(full) <= 2, (f"{len(full)} of {len(calls)} progress reports say 100% while "
                            f"{result.end_time - 39:.0f} of {result.end_time:.0f} simulated s remain")


def test_progress_moves_when_every_pod_arrives_at_once() -> None:
    """A 'submit these jobs at once' trace (every creation_time equal): the CLI shows
    `0/1 (0%)` for the whole run (the replay reports (0, 0) each time)."""
    catalog = default_catalog()
    model = catalog.resolve("H100-80GB")
    spec = ClusterSpec("<t>", (NodeSpec("n0", 112_000, 1 << 20, 1, "H100-80GB", "mig"),))
    pods = [TracePod(f"p{i:02d}", 1000, 1024, 1, 1000, (), 0, 1000) for i in range(40)]
    opts = ReplayOptions(policy="static", static_layout=tuple(static_layout("all-7g", model, "mig").items()))
    calls: list[tuple[float, float]] = []
    run_replay(pods, spec, catalog, opts, lambda done, total: calls.append((done, total)))
    fractions = {round(d / t, 3) if t else None for d, t in calls}
    assert len(fractions) > 2, f"every progress report is {sorted(map(str, fractions))} over {len(calls)} reports"
