"""The progress line on a plain stream (CI logs, pipes): periodic, and the 100% line once."""

from __future__ import annotations

import io

from dynpart.simulations.reporting.progress import Progress


def test_plain_stream_reports_completion_once_however_often_it_is_told() -> None:
    out = io.StringIO()
    bar = Progress("replay", total=10, stream=out, every_s=3600.0)
    bar.update(0)
    for _ in range(50):  # the replay reports the horizon on every event after the last arrival
        bar.update(10)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("replay: 0/10 (0%)")
    assert sum("10/10 (100%)" in line for line in lines) == 1
    assert len(lines) == 2


def test_disabled_progress_writes_nothing() -> None:
    out = io.StringIO()
    bar = Progress("replay", total=10, stream=out, enabled=False)
    bar.update(10)
    bar.close()
    assert out.getvalue() == ""
