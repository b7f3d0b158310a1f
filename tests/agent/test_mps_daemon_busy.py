"""ProcessMpsDaemon with a stand-in for nvidia-cuda-mps-control: a daemon that is busy (no answer
in time while its process lives) is not taken for dead and started a second time, nor told to quit
for a change of GPUs; a stale pid file is not taken for a live daemon; stopping it (the agent's way
out) is one bounded `quit`. And the agent does not restart it for other GPUs while pods use it."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import subprocess
import textwrap
import threading
import time
from collections.abc import Sequence

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.mps_daemon import (
    DAEMON_COMM,
    DESIRED,
    PID_FILE,
    FakeMpsDaemon,
    MpsDaemonBusy,
    MpsDaemonError,
    ProcessMpsDaemon,
    boot_id,
    write_json,
)
from dynpart.agent.mps_plugin import MpsPluginAgent
from dynpart.agent.mps_supervisor import Supervisor
from dynpart.agent.podresources import FakePodResources
from tests.agent.conftest import H100
from tests.agent.test_nodepods import installed_control

# as tests/agent/test_nodepods.py's stand-in, and: each command is logged; a BUSY file in the pipe
# directory makes the control commands hang (a daemon slow to answer); HANG makes them hang for
# good, recording the hanging command's pid (QUIT_HANGS: only `quit`); -d refuses while a daemon runs, as the real one does.
# The daemon is a `sleep` named as the real one (its /proc comm "nvidia-cuda-mps": a link's name)
FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    alive() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null \\
              && [ "$(cat "/proc/$(cat "$pidfile")/comm" 2>/dev/null)" = nvidia-cuda-mps ] \\
              && ! grep -q '^State:.*Z' "/proc/$(cat "$pidfile")/status" 2>/dev/null; }
    if [ "$1" = "-d" ]; then
      echo "-d" >> "$CUDA_MPS_LOG_DIRECTORY/commands"
      alive && { echo "An instance of this daemon is already running"; exit 1; }
      bin="$(dirname "$0")/daemon"; mkdir -p "$bin"; ln -sf "$(command -v sleep)" "$bin/nvidia-cuda-mps-control"
      "$bin/nvidia-cuda-mps-control" 300 >/dev/null 2>&1 &
      echo $! > "$pidfile"
      echo "$CUDA_VISIBLE_DEVICES" >> "$CUDA_MPS_LOG_DIRECTORY/starts"
      exit 0
    fi
    read cmd
    echo "$cmd" >> "$CUDA_MPS_LOG_DIRECTORY/commands"
    if [ -f "$CUDA_MPS_PIPE_DIRECTORY/HANG" ]; then echo $$ > "$CUDA_MPS_LOG_DIRECTORY/hung"; exec sleep 300; fi
    [ "$cmd" = quit ] && [ -f "$CUDA_MPS_PIPE_DIRECTORY/QUIT_HANGS" ] && exec sleep 300
    [ -f "$CUDA_MPS_PIPE_DIRECTORY/BUSY" ] && sleep 5
    alive || exit 1
    if [ "$cmd" = "quit" ]; then kill "$(cat "$pidfile")"; rm -f "$pidfile"; fi
    echo 100
""")


@pytest.fixture
def control(tmp_path):
    return installed_control(tmp_path, FAKE_CONTROL)


async def _answers_and_is_started_again(daemon: ProcessMpsDaemon, pipe, logs) -> None:
    """No longer busy: the next `ensure` finds it gone and starts it again, once."""
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    assert _lines(logs / "starts") == ["GPU-a", "GPU-a"] and daemon.restarts == 1
    await daemon.stop()


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
    await _answers_and_is_started_again(daemon, pipe, logs)


async def test_a_daemon_that_answers_but_does_not_quit_in_time_is_kept_busy_not_taken_for_stopped(control, tmp_path):
    """It answers `alive()`, then its `quit` (for no GPU, or for others) gets no answer in time:
    it still runs, for its old GPUs. Taken for stopped, a node leaving MPS mode would be told the
    daemon is gone while it runs on (and never asked again), and a change of GPUs would try a
    `-d` beside it."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=0.5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (pipe / "QUIT_HANGS").touch()
    for wanted in ([], ["GPU-b"]):
        with pytest.raises(MpsDaemonBusy, match="but runs: kept") as busy:
            await daemon.ensure(wanted, str(pipe), str(logs))
        assert busy.value.gpus == ("GPU-a",) and daemon.gpus == ("GPU-a",)
    assert _lines(logs / "starts") == ["GPU-a"] and await daemon.alive()
    (pipe / "QUIT_HANGS").unlink()
    await daemon.ensure([], str(pipe), str(logs))  # quits now
    assert daemon.gpus == () and await daemon.alive() is False


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


# --- a stale pid file ------------------------------------------------------------------------------


def _pid_file_naming(pipe, pid: int) -> ProcessMpsDaemon:
    pipe.mkdir(parents=True, exist_ok=True)
    (pipe / PID_FILE).write_text(f"{pid}\n")
    daemon = ProcessMpsDaemon()
    daemon.dirs = (str(pipe), str(pipe))
    return daemon


def test_a_stale_pid_file_naming_another_process_or_a_thread_is_not_the_daemon(tmp_path, control):
    """A daemon killed by SIGKILL or the OOM killer leaves its pid file (the pipe directory is a
    hostPath); in a new container its pid may name another process, or a thread: either taken for
    the daemon, a dead one would be kept for ever and its slices stay Unhealthy."""
    pipe = tmp_path / "pipe"
    assert not _pid_file_naming(pipe, os.getpid())._process_lives()  # another process (this one)
    named, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def thread_named_as_the_daemon() -> None:
        ctypes.CDLL(None).prctl(15, b"nvidia-cuda-mps", 0, 0, 0)  # PR_SET_NAME: its /proc comm
        tid.append(threading.get_native_id())
        named.set()
        done.wait(10)
    threading.Thread(target=thread_named_as_the_daemon, daemon=True).start()
    try:
        assert named.wait(5)
        with open(f"/proc/{tid[0]}/comm") as f:
            assert f.read().strip() == DAEMON_COMM
        assert not _pid_file_naming(pipe, tid[0])._process_lives()  # a thread of another process
    finally:
        done.set()
    # the daemon itself (named as nvidia-cuda-mps-control names it), and once it ended (a zombie)
    link = tmp_path / "bin" / "nvidia-cuda-mps-control"
    link.parent.mkdir()
    link.symlink_to(shutil.which("sleep"))
    proc = subprocess.Popen([str(link), "300"])
    try:
        assert _pid_file_naming(pipe, proc.pid)._process_lives()
        proc.kill()
        for _ in range(200):  # (not reaped: no wait() yet)
            with open(f"/proc/{proc.pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    break
            time.sleep(0.01)
        assert not _pid_file_naming(pipe, proc.pid)._process_lives()
    finally:
        proc.kill()
        proc.wait()


async def test_a_dead_daemon_whose_pid_was_reused_is_started_again(control, tmp_path):
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=0.3)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    os.kill(int((pipe / PID_FILE).read_text()), 9)  # OOM-killed; its pipe left, its commands hang
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")  # and its pid names another process now
    (pipe / "BUSY").touch()
    assert await daemon.alive() is False
    await _answers_and_is_started_again(daemon, pipe, logs)


# --- a change of GPUs, a slow start ---------------------------------------------------------------


async def test_a_busy_daemon_is_kept_when_its_gpus_change(control, tmp_path):
    """Told to `quit` while busy it would not have quit when the `-d` after it came: it is kept as
    it is (its slices Unhealthy meanwhile) and restarted for the new GPUs once it answers."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=0.5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (pipe / "BUSY").touch()
    with pytest.raises(MpsDaemonBusy, match="for GPU-a does not answer .* kept") as busy:
        await daemon.ensure(["GPU-a", "GPU-b"], str(pipe), str(logs))
    assert busy.value.gpus == ("GPU-a",) and daemon.gpus == ("GPU-a",)
    assert "quit" not in _lines(logs / "commands") and _lines(logs / "commands").count("-d") == 1
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a", "GPU-b"], str(pipe), str(logs))
    assert _lines(logs / "starts") == ["GPU-a", "GPU-a,GPU-b"]
    asked = "get_default_active_thread_percentage"
    assert _lines(logs / "commands")[-4:] == [asked, "quit", "-d", asked]  # answers: then restarted
    await daemon.stop()


async def test_a_start_refused_leaves_the_gpus_unknown_not_the_new_ones(control, tmp_path, monkeypatch):
    """A busy daemon taken for gone (its pid file unreadable, say) is not told to quit, and the
    `-d` for the new GPUs is refused: the agent must not then take the daemon as running for the
    new GPUs once it answers (it serves the old ones only, and pods on the new GPU would get no
    MPS server), so it is restarted for them."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=0.5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    (pipe / "BUSY").touch()
    with monkeypatch.context() as m:
        m.setattr(daemon, "_process_lives", lambda: False)  # wrongly: gone
        with pytest.raises(MpsDaemonError, match="-d exited with 1"):
            await daemon.ensure(["GPU-a", "GPU-b"], str(pipe), str(logs))
    assert daemon.gpus == ()
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a", "GPU-b"], str(pipe), str(logs))
    assert _lines(logs / "starts") == ["GPU-a", "GPU-a,GPU-b"], "restarted for the new GPUs"
    await daemon.stop()


async def test_a_daemon_slow_to_answer_after_its_start_is_not_asked_twenty_times(control, tmp_path):
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    (pipe / "BUSY").touch()  # it starts, and its control commands take longer than timeout_s
    daemon = ProcessMpsDaemon(control, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(MpsDaemonBusy, match="kept, not started again"):
        await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    assert time.monotonic() - started < 2  # one answer's wait, not 20 of them
    assert _lines(logs / "starts") == ["GPU-a"]
    (pipe / "BUSY").unlink()
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))  # it answers now: kept, not started again
    assert _lines(logs / "starts") == ["GPU-a"]
    await daemon.stop()


async def test_the_daemon_is_not_restarted_for_other_gpus_once_a_pod_took_a_slice_during_the_pass():
    """The pass's first PodResources list showed no slice in use, but the guard's waits that
    follow leave the kubelet time to give one to a pod: a restart for the new set of GPUs would end
    that pod's CUDA context. The pods are read again right before the restart."""
    driver = FakeNvml(H100, 2, mig_enabled=False)
    pods = FakePodResources()
    daemon = FakeMpsDaemon()
    mps = MpsPluginAgent(driver, pods, 79, daemon=daemon)
    await mps.apply({0: [40], 1: [20]})
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")]
    driver.set_mig_mode(1, True)  # GPU 1 leaves MPS: the daemon would run for GPU 0 only
    first = pods.calls + 1

    def taken_meanwhile(n: int) -> None:
        if n == first + 1:  # after the pass's first list
            pods.assign("ns/late", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    pods.on_list = taken_meanwhile
    await mps.apply({0: [40]})
    assert pods.calls > first  # read again
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] and daemon.running  # not restarted
    pods.release("ns/late")
    await mps.apply({0: [40]})  # no pod uses it any more: now it is
    assert daemon.starts[-1] == ("GPU-fake-0000",)


async def test_a_daemon_kept_busy_for_a_change_of_gpus_still_runs_for_its_old_ones():
    """Kept busy, the daemon still runs for its old GPUs: a later pass with slices in use must see
    the change still to be made (and not make it), not take the new set for the daemon's."""

    class BusyForAChange(FakeMpsDaemon):
        busy = False

        async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
            if self.busy and tuple(gpu_uuids) != self.gpus:
                raise MpsDaemonBusy("does not answer: kept", self.gpus)
            await super().ensure(gpu_uuids, pipe_dir, log_dir)

    driver = FakeNvml(H100, 2, mig_enabled=False)
    pods = FakePodResources()
    daemon = BusyForAChange()
    mps = MpsPluginAgent(driver, pods, 79, daemon=daemon)
    await mps.apply({0: [40], 1: [20]})
    driver.set_mig_mode(1, True)
    daemon.busy = True
    result = await mps.apply({0: [40]})
    assert any("does not answer: kept" in e for e in result.errors) and not mps.healthy
    daemon.busy = False
    pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
    await mps.apply({0: [40]})
    assert daemon.starts == [("GPU-fake-0000", "GPU-fake-0001")] and mps.healthy


def _probe_fails_once(monkeypatch, nth: int = 1) -> None:
    """The `nth` control command from now cannot be started (a fork refused under the pod's pid
    limit)."""
    real = asyncio.create_subprocess_exec
    calls = {"n": 0}

    async def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return await real(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", flaky)


async def test_a_probe_that_cannot_run_does_not_restart_a_running_daemon(control, tmp_path, monkeypatch):
    """helper-146's review: a probe that could not run was taken for a daemon gone; the `-d` after
    it was refused (one runs), the GPUs were reset, and the next check, nothing changed, told the
    daemon to quit and started it again, ending every MPS client's CUDA context."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    sup = Supervisor(str(tmp_path / "ctl"), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.0)
    (tmp_path / "ctl").mkdir()
    write_json(str(tmp_path / "ctl" / DESIRED), {"seq": 1, "gpus": ["GPU-a"], "pipe_dir": str(pipe),
                                                  "log_dir": str(logs), "boot": boot_id()})
    await sup.step()
    pid = int((pipe / PID_FILE).read_text())
    _probe_fails_once(monkeypatch)
    await sup.step()  # kept, listed busy for this check
    await sup.step()  # answers again: nothing to do
    assert "quit" not in _lines(logs / "commands") and _lines(logs / "starts") == ["GPU-a"]
    assert sup.state["running"] and sup.state["gpus"] == ["GPU-a"]
    os.kill(pid, 0)  # the same daemon
    await sup.daemon.stop()


@pytest.mark.parametrize("failing", [1, 2], ids=["probe", "quit"])
async def test_a_stop_whose_probe_or_quit_cannot_run_is_not_reported_done_while_the_daemon_runs(
        control, tmp_path, monkeypatch, failing):
    """The same cause on the way out (a node leaving MPS): reported stopped while it ran on, and
    never asked again. Also when the probe answers and the `quit`'s fork is refused (helper-149)."""
    pipe, logs, ctl = tmp_path / "pipe", tmp_path / "log", tmp_path / "ctl"
    ctl.mkdir()

    def want(seq: int, gpus: list[str]) -> None:
        write_json(str(ctl / DESIRED), {"seq": seq, "gpus": gpus, "pipe_dir": str(pipe), "log_dir": str(logs),
                                        "boot": boot_id()})

    want(1, ["GPU-a"])
    sup = Supervisor(str(ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.0)
    await sup.step()
    _probe_fails_once(monkeypatch, nth=failing)
    want(2, [])
    await sup.step()
    assert (pipe / PID_FILE).exists() and sup.state["running"], "it runs: not reported stopped"
    assert sup.state["gpus"] == ["GPU-a"]
    await sup.step()  # asked again: quits now
    assert not (pipe / PID_FILE).exists() and not sup.state["running"] and sup.state["gpus"] == []


async def test_a_start_refused_by_the_daemon_it_keeps_for_the_same_gpus_is_busy_not_unknown(control, tmp_path,
                                                                                           monkeypatch):
    """Its probe said no daemon (a failed command), yet `-d` finds one for the same GPUs: kept as
    running for them, not reset (which would restart it at the next check)."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    daemon = ProcessMpsDaemon(control, timeout_s=5)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))

    async def said_gone() -> bool:
        return False

    with monkeypatch.context() as m:
        m.setattr(daemon, "alive", said_gone)
        with pytest.raises(MpsDaemonBusy, match="but runs: kept"):
            await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    assert daemon.gpus == ("GPU-a",)
    await daemon.ensure(["GPU-a"], str(pipe), str(logs))
    assert "quit" not in _lines(logs / "commands") and _lines(logs / "starts") == ["GPU-a"]
    await daemon.stop()
