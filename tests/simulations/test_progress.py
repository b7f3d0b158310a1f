"""The progress line on a plain stream (CI logs, pipes): periodic, and the 100% line once."""

from __future__ import annotations

import io
from unittest.mock import patch

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


def test_plain_stream_gets_a_line_every_so_often_however_often_it_is_told() -> None:
    """A replay reports every event, far more often than `every_s`: the plain stream (a CI log, a
    pipe) still gets a line each `every_s`, not only the first one."""
    now = [1000.0]
    out = io.StringIO()
    bar = Progress("replay", total=100, stream=out, every_s=15.0)
    with patch("dynpart.simulations.reporting.progress.time.monotonic", lambda: now[0]):
        bar.t0 = now[0]
        for done in range(100):
            bar.update(done)
            now[0] += 1.0  # an update a second
        bar.update(100)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[1].split()[0] for line in lines] == \
        ["0/100", "15/100", "30/100", "45/100", "60/100", "75/100", "90/100", "100/100"]


def test_the_first_line_is_written_on_a_machine_up_for_less_than_every_s() -> None:
    """The monotonic clock counts from the machine's boot: a CI machine up for ten minutes still
    gets its first progress line at once, not after every_s."""
    out = io.StringIO()
    with patch("dynpart.simulations.reporting.progress.time.monotonic", lambda: 600.0):
        bar = Progress("replay", total=10, stream=out, every_s=3600.0)
        bar.update(0)
    assert out.getvalue().startswith("replay: 0/10 (0%)")
