"""ProcessMpsDaemon with a stand-in for nvidia-cuda-mps-control: a daemon that is busy (no answer
in time while its process lives) is not taken for dead and started a second time, and stopping
it (the agent's way out) is one bounded `quit`."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time

import pytest

from dynpart.agent.mps_daemon import MpsDaemonError, ProcessMpsDaemon
from tests.agent.test_nodepods import installed_control

# as tests/agent/test_nodepods.py's stand-in, and: each command is logged; a BUSY file in the pipe
# directory makes the control commands hang (a daemon slow to answer); HANG makes them hang for
# good, recording the hanging command's pid; -d refuses while a daemon runs, as the real one does
FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    alive() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null \\
              && ! grep -q '^State:.*Z' "/proc/$(cat "$pidfile")/status" 2>/dev/null; }
    if [ "$1" = "-d" ]; then
      echo "-d" >> "$CUDA_MPS_LOG_DIRECTORY/commands"
      alive && { echo "An instance of this daemon is already running"; exit 1; }
      sleep 300 >/dev/null 2>&1 &
      echo $! > "$pidfile"
      echo "$CUDA_VISIBLE_DEVICES" >> "$CUDA_MPS_LOG_DIRECTORY/starts"
      exit 0
    fi
    read cmd
    echo "$cmd" >> "$CUDA_MPS_LOG_DIRECTORY/commands"
    if [ -f "$CUDA_MPS_PIPE_DIRECTORY/HANG" ]; then echo $$ > "$CUDA_MPS_LOG_DIRECTORY/hung"; exec sleep 300; fi
    [ -f "$CUDA_MPS_PIPE_DIRECTORY/BUSY" ] && sleep 5
    alive || exit 1
    if [ "$cmd" = "quit" ]; then kill "$(cat "$pidfile")"; rm -f "$pidfile"; fi
    echo 100
""")


@pytest.fixture
def control(tmp_path):
    return installed_control(tmp_path, FAKE_CONTROL)


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def test_a_busy_daemon_is_kept_not_started_again(control, tmp_path):
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=0.5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (pipe / "BUSY").touch()  # answers after 5 s: busy, its process alive
    assert await daemon.alive() is None  # unknown, not dead
    with pytest.raises(MpsDaemonError, match="does not answer on its control pipe in 0s but runs: kept"):
        await daemon.ensure(["GPU-a"], str(pipe), str(logs))  # its slices are listed Unhealthy meanwhile
    assert _lines(logs / "starts") == ["GPU-a"] and daemon.restarts == 0
    assert "-d" not in _lines(logs / "commands")[1:]  # no second `-d`
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))  # answers again: nothing to do
    assert _lines(logs / "starts") == ["GPU-a"] and daemon.restarts == 0
    # dead while its control commands hang (a stale pipe): its process is gone, so it is restarted
    (pipe / "BUSY").touch()
    os.kill(int((pipe / "nvidia-cuda-mps-control.pid").read_text()), 9)
    for _ in range(100):
        if await daemon.alive() is False:
            break
        await asyncio.sleep(0.02)
    assert await daemon.alive() is False
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    assert _lines(logs / "starts") == ["GPU-a", "GPU-a"] and daemon.restarts == 1
    await daemon.stop()


async def test_stop_is_one_quit(control, tmp_path):
    """No `alive()` first: on the agent's way out that would double the time a slow daemon takes."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (logs / "commands").write_text("")
    await daemon.stop()
    assert _lines(logs / "commands") == ["quit"]
    assert not (pipe / "nvidia-cuda-mps-control.pid").exists() and await daemon.alive() is False
    await daemon.stop()  # none left: `quit` fails, quietly


async def test_a_stop_cut_short_leaves_no_command_running(control, tmp_path):
    """The way out's deadline cancels a `quit` that hangs: its process is killed, not left behind."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=30)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (pipe / "HANG").touch()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(daemon.stop(), 0.5)
    assert time.monotonic() - started < 2
    hung = int((logs / "hung").read_text())
    for _ in range(100):
        try:
            os.kill(hung, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the quit command {hung} still runs")
    os.kill(int((pipe / "nvidia-cuda-mps-control.pid").read_text()), 9)
