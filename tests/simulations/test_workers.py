"""`--jobs N` worker pools (simulations/workers.py): Ctrl-C and a failed job stop the run at once,
the workers leave SIGINT to the parent, and `dynpart simulate --jobs 2` interrupted exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynpart.simulations.workers import worker_pool


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _handlers(_: int) -> tuple[bool, bool]:
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _remember(value: int) -> None:
    os.environ["DYNPART_TEST_WORKER"] = str(value)


def _remembered(_: int) -> str:
    return os.environ.get("DYNPART_TEST_WORKER", "")


@pytest.fixture
def parent_sigterm_handler():
    """A SIGTERM handler in the parent, as the planner's and the agent's CLIs install (and a test
    run in this process may have left): forked workers inherit it."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_workers_ignore_sigint_die_on_sigterm_and_run_the_initializer(parent_sigterm_handler):
    with worker_pool(2, _remember, (7,)) as pool:
        assert list(pool.map(_handlers, range(2))) == [(True, True), (True, True)]
        assert list(pool.map(_remembered, range(2))) == ["7", "7"]


def test_an_error_in_the_parent_stops_the_running_jobs_without_waiting_for_them(parent_sigterm_handler):
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with worker_pool(2) as pool:
            for _ in range(4):
                pool.submit(_sleep, 60.0)
            time.sleep(0.5)  # two running, the others queued
            workers = list(pool._processes.values())
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 20, "the pool waited for its running jobs"
    assert len(workers) == 2
    for w in workers:
        w.join(timeout=10)
        assert not w.is_alive(), "a worker still runs its job"


def test_the_workers_are_seen_gone_when_the_pool_has_stopped_them(parent_sigterm_handler):
    """The pool's own thread reaps the workers too; when it wins the race, a caller's is_alive()
    said True until that thread ran again (2% of tries on a loaded machine)."""
    for _ in range(10):
        with pytest.raises(KeyboardInterrupt):
            with worker_pool(2) as pool:
                for _ in range(4):
                    pool.submit(_sleep, 60.0)
                time.sleep(0.05)
                workers = list(pool._processes.values())
                raise KeyboardInterrupt
        assert [w.is_alive() for w in workers] == [False, False]


def test_simulate_with_two_jobs_stops_on_ctrl_c(tmp_path: Path):
    """Ctrl-C reaches the whole process group, as a terminal sends it."""
    proc = subprocess.Popen([sys.executable, "-m", "dynpart.cli", "simulate", "--mode", "mig", "--policy", "dynpart,nos",
                             "--seeds", "0-11", "--jobs", "2", "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        time.sleep(6)  # replays running (24 of them, 3 s each for nos's)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "dynpart: interrupted" in err
    assert not (tmp_path / "out" / "summary.json").exists()
