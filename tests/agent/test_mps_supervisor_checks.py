"""`dynpart agent mps-control` (agent/mps_supervisor.py), the agent's side of it
(`SupervisedMpsDaemon`), `dynpart agent mps-shm` (agent/mps_shm.py) and the SELinux labels
(agent/selinux.py), one rule at a time, where mutation testing found them unpinned: what
desired.json may say (a file the supervisor cannot act on is reported, never a crash), what a
restarted supervisor takes back from state.json, what state.json says before and while the
supervisor acts (its heartbeat, a busy daemon), that an error is logged once rather than at every
check, how a busy daemon is stopped for no GPU, how the agent numbers and waits for what it asks
and reads the answer, and the daemon's /dev/shm tmpfs (its size, a mount point, the last pod's
emptied)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
import time

import pytest

from dynpart.agent.mps_daemon import (
    DESIRED,
    MPS_CONTROL,
    STATE,
    MpsDaemonBusy,
    MpsDaemonError,
    ProcessMpsDaemon,
    SupervisedMpsDaemon,
    boot_id,
    write_json,
)
from dynpart.agent.mps_shm import FALLBACK_SIZE, MNT_DETACH, MountError, _libc, half_of_memory, is_mount_point, mount_tmpfs
from dynpart.agent.mps_supervisor import Supervisor, _supervise, parse_desired
from dynpart.agent.selinux import selinux_on
from tests.agent import test_mps_supervisor as base
from tests.agent.test_mps_daemon_busy import FAKE_CONTROL
from tests.agent.test_mps_supervisor import running
from tests.agent.test_nodepods import installed_control

control, dirs = base.control, base.dirs  # (its fixtures: a stand-in nvidia-cuda-mps-control, the directories)


def _desired(**over: object) -> str:
    return json.dumps({"seq": 1, "gpus": ["GPU-a"], "pipe_dir": "/p", "log_dir": "/l", **over})


def test_desired_json_the_supervisor_cannot_act_on_is_a_value_error():
    """Anything else than a ValueError would end the supervisor's loop (and the pod) instead of
    being reported in state.json; and a GPU list that is not all UUIDs would reach the daemon's
    CUDA_VISIBLE_DEVICES."""
    assert parse_desired(_desired(seq=0)).seq == 0  # (non-negative)
    assert parse_desired(_desired(boot="b-1")).boot == "b-1"
    for over in ({"seq": -1}, {"seq": "1"}, {"gpus": [5]}, {"gpus": [""]}, {"gpus": ["GPU-a", None]},
                 {"pipe_dir": None}, {"log_dir": 5}, {"pipe_dir": ["/p"]}, {"boot": 5}):
        with pytest.raises(ValueError):
            parse_desired(_desired(**over))


async def test_a_desired_json_naming_no_pipe_directory_is_reported_and_the_supervisor_goes_on(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=0)
    write_json(str(dirs.ctl / DESIRED), {"seq": 1, "gpus": ["GPU-a"], "pipe_dir": None, "log_dir": str(dirs.logs)})
    await sup.step()
    assert "pipe_dir must be an absolute path" in dirs.state()["error"] and dirs.lines("starts") == []
    dirs.want(2, ["GPU-a"])
    await sup.step()
    assert dirs.state()["error"] is None and dirs.lines("starts") == ["GPU-a"]


@pytest.mark.parametrize("old", [
    {"gpus": "GPU-a"},  # (a string: not one GPU per character)
    {"gpus": [5]},
    {"gpus": []},
    {"pipe_dir": None},
    {"log_dir": 3},
], ids=["gpus-a-string", "gpus-not-uuids", "no-gpus", "no-pipe-dir", "bad-log-dir"])
def test_a_restarted_supervisor_takes_back_only_a_daemon_state_json_fully_names(dirs, old):
    """Taken back, a daemon counts as running for those GPUs in those directories (asked, not
    started again; quit on the supervisor's way out): never from a state that does not say so."""
    good = {"seq": 3, "gpus": ["GPU-a", "GPU-b"], "pipe_dir": str(dirs.pipe), "log_dir": str(dirs.logs),
            "running": True, "at": time.time(), "boot": boot_id()}
    write_json(str(dirs.ctl / STATE), {**good, **old})
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon("/nonexistent"))
    assert (sup.daemon.gpus, sup.daemon.dirs, sup.state["gpus"]) == ((), None, [])
    write_json(str(dirs.ctl / STATE), good)
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon("/nonexistent"))
    assert (sup.daemon.gpus, sup.daemon.dirs) == (("GPU-a", "GPU-b"), (str(dirs.pipe), str(dirs.logs)))
    sup.publish()  # (nothing acted on yet: seq 0, not running)
    assert (dirs.state()["gpus"], dirs.state()["pipe_dir"], dirs.state()["seq"]) == (["GPU-a", "GPU-b"], str(dirs.pipe), 0)


async def test_a_fresh_supervisor_reports_no_daemon_running_and_none_busy(dirs):
    """Before it has acted: nothing done, nothing running, and not busy (a busy state would have
    the agent keep slices of a daemon that does not run)."""
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon("/nonexistent"))
    assert isinstance(Supervisor(str(dirs.ctl)).daemon, ProcessMpsDaemon)
    assert Supervisor(str(dirs.ctl)).daemon.binary == MPS_CONTROL  # (the node's, on PATH)
    sup.publish()
    state = dirs.state()
    assert {k: state.get(k, "absent") for k in ("seq", "gpus", "pipe_dir", "log_dir", "running", "busy", "error",
                                                "checked_at")} == {
        "seq": 0, "gpus": [], "pipe_dir": None, "log_dir": None, "running": False, "busy": False, "error": None,
        "checked_at": None}
    agent = SupervisedMpsDaemon(str(dirs.ctl))
    assert await agent.alive() is False and agent.running_for() is None


async def test_the_same_gpus_under_a_new_seq_are_reported_done_at_once_without_a_command(control, dirs):
    """desired.json changed and changed back before the supervisor acted (the agent's seq grew
    twice): the daemon already runs as asked, so the new seq is reported done at once, not at the
    next check (the agent waits for it), and the daemon is not even asked."""
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=60)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    assert abs(dirs.state()["checked_at"] - time.time()) < 5
    commands = dirs.lines("commands")
    dirs.want(3, ["GPU-a"])
    await sup.step()
    assert (dirs.state()["seq"], dirs.state()["running"]) == (3, True)
    assert dirs.lines("commands") == commands and dirs.lines("starts") == ["GPU-a"]


async def test_an_error_is_logged_once_not_at_every_check(tmp_path, control, dirs, caplog):
    """The same daemon error, or the same malformed desired.json, at each check (every 5 s): one
    line in the log, not one per check; and none when it goes."""
    (tmp_path / "failing").mkdir()
    failing = installed_control(tmp_path / "failing", "#!/bin/sh\necho 'no MPS on this GPU'; exit 3\n")
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(failing, timeout_s=5), check_s=0)
    dirs.want(1, ["GPU-a"])
    caplog.set_level(logging.INFO, logger="dynpart.agent.mps")
    for _ in range(3):
        await sup.step()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no MPS on this GPU" in errors[0], errors
    assert "no MPS on this GPU" in dirs.state()["error"]
    sup.daemon.binary = control  # (the GPU fixed)
    caplog.clear()
    await sup.step()
    await sup.step()
    assert dirs.state()["running"] is True and dirs.state()["error"] is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    (dirs.ctl / DESIRED).write_text("{")
    for _ in range(3):
        await sup.step()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "desired.json: not JSON" in errors[0], errors


async def test_a_busy_daemon_is_reported_running_for_its_own_gpus_and_directories(control, dirs, tmp_path):
    """A busy daemon asked for other GPUs in another pipe directory is kept: state.json says it
    runs, for what it was started for and where (a restarted agent then keeps its GPUs while
    its pods run, `running_for`)."""
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=0.5), check_s=0)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    (dirs.pipe / "BUSY").touch()
    write_json(str(dirs.ctl / DESIRED), {"seq": 2, "gpus": ["GPU-a", "GPU-b"], "pipe_dir": str(tmp_path / "pipe2"),
                                         "log_dir": str(dirs.logs), "boot": boot_id()})
    await sup.step()
    state = dirs.state()
    assert (state["seq"], state["running"], state["busy"], state["gpus"], state["pipe_dir"]) == (
        2, True, True, ["GPU-a"], str(dirs.pipe))
    assert SupervisedMpsDaemon(str(dirs.ctl)).running_for() == ["GPU-a"]


async def test_a_busy_daemon_asked_to_stop_for_no_gpu_is_kept_reported_and_stopped_once_it_answers(control, dirs, caplog):
    """The node leaves MPS mode while the daemon does not answer: a `quit` then would be lost (its
    command killed at the timeout), so the daemon is kept and reported busy, not "not running";
    at a later check, answering again, it is told to quit. Stopped, it is asked nothing more."""
    caplog.set_level(logging.INFO, logger="dynpart.agent.mps")
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=0.5), check_s=0)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    (dirs.pipe / "BUSY").touch()
    dirs.want(2, [])
    await sup.step()
    state = dirs.state()
    assert dirs.daemon_lives()
    assert (state["seq"], state["running"], state["busy"], state["gpus"]) == (2, True, True, ["GPU-a"])
    assert "does not answer" in state["error"]
    assert await SupervisedMpsDaemon(str(dirs.ctl)).alive() is None
    await SupervisedMpsDaemon(str(dirs.ctl)).stop()  # the agent's side: told it is not stopped yet
    assert "does not answer" in caplog.text and "stops it once it answers" in caplog.text
    (dirs.pipe / "BUSY").unlink()
    await sup.step()  # the next check
    state = dirs.state()
    assert not dirs.daemon_lives() and dirs.lines("commands")[-1] == "quit"
    assert "MPS control daemon stopped (no GPU wants it)" in caplog.text
    assert (state["running"], state["busy"], state["gpus"], state["error"]) == (False, False, [], None)
    commands = dirs.lines("commands")
    await sup.step()
    await sup.step()
    assert dirs.lines("commands") == commands and dirs.lines("starts") == ["GPU-a"]


class SlowDaemon:
    """A daemon whose start takes `start_s`, or until `release` is set."""

    def __init__(self, start_s: float):
        self.start_s = start_s
        self.gpus: tuple[str, ...] = ()
        self.dirs: tuple[str, str] | None = None
        self.starting = asyncio.Event()
        self.release = asyncio.Event()

    async def ensure(self, gpus, pipe_dir, log_dir):
        self.starting.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.release.wait(), self.start_s)
        self.gpus, self.dirs = tuple(gpus), (pipe_dir, log_dir)

    async def stop(self):
        self.gpus = ()


async def test_state_json_keeps_its_heartbeat_while_the_daemon_starts(dirs):
    """The agent takes a state.json not rewritten for `stale_s` for a supervisor that does not run:
    the heartbeat goes on while a step waits for the daemon."""
    daemon = SlowDaemon(start_s=60)
    ticks = iter(range(1_000_000))
    sup = Supervisor(str(dirs.ctl), daemon, poll_s=0.02, clock=lambda: float(next(ticks)))  # (each write its own "at")
    dirs.want(1, ["GPU-a"])
    async with running(sup):
        await asyncio.wait_for(daemon.starting.wait(), 10)
        beats = {dirs.state()["at"]}
        deadline = time.monotonic() + 10
        while len(beats) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            beats.add(dirs.state()["at"])
        assert len(beats) >= 4 and dirs.state()["seq"] == 0 and daemon.gpus == ()  # (still starting)
        daemon.release.set()


async def test_the_supervisor_makes_its_directory_and_runs_until_cancelled_without_a_stop_event(tmp_path):
    ctl = tmp_path / "absent" / "ctl"
    sup = Supervisor(str(ctl), ProcessMpsDaemon("/nonexistent"), poll_s=0.05)
    task = asyncio.create_task(sup.run())
    await asyncio.sleep(0.3)
    assert not task.done() and json.loads((ctl / STATE).read_text())["running"] is False
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_state_json_that_cannot_be_written_is_logged_and_the_supervisor_goes_on(dirs, caplog):
    (dirs.ctl / STATE).mkdir()
    (dirs.ctl / STATE / "x").write_text("")  # (a rename over it fails)
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon("/nonexistent"))
    await sup.step()
    assert "writing" in caplog.text and "state.json" in caplog.text


async def test_mps_control_runs_the_nodes_binary_and_quits_it_on_its_way_out(tmp_path, dirs, monkeypatch, caplog):
    """`dynpart agent mps-control` with no binary given runs nvidia-cuda-mps-control from PATH (the
    NVIDIA container runtime's); on its way out it says not-running in state.json and quits the
    daemon it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    installed_control(bin_dir, FAKE_CONTROL)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    caplog.set_level(logging.INFO, logger="dynpart.agent.mps")
    dirs.want(1, ["GPU-a"])
    stop = asyncio.Event()
    task = asyncio.create_task(_supervise(str(dirs.ctl), None, 0.05, 5.0, stop))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ((dirs.ctl / STATE).exists() and dirs.state()["running"]):
        await asyncio.sleep(0.05)
    assert dirs.state()["running"] is True and dirs.daemon_lives()
    assert "supervising the MPS control daemon as" in caplog.text
    stop.set()
    await asyncio.wait_for(task, 20)
    assert not dirs.daemon_lives() and dirs.lines("commands")[-1] == "quit"
    final = dirs.state()
    assert (final["running"], final["busy"], final["gpus"]) == (False, False, []) and "stopped" in final["error"]


# `dynpart agent mps-shm` (agent/mps_shm.py) and the SELinux labels (agent/selinux.py)


def test_half_of_memory_takes_only_a_memtotal_in_kb(tmp_path):
    info = tmp_path / "meminfo"
    for text, size in (("MemTotal:\n", FALLBACK_SIZE),  # (no number: not an IndexError)
                       ("MemTotal: 1000 MB\n", FALLBACK_SIZE),  # (not kB: not taken for kB)
                       ("MemTotal: 1000\n", "500k"),
                       ("MemTotal:  1000 kB\n", "500k")):
        info.write_text(text)
        assert half_of_memory(str(info)) == size, text


def test_a_mount_point_is_read_from_mountinfo_escapes_and_all(tmp_path):
    """A mount point with a space in its path (mountinfo writes it \\040); a short or unreadable
    mountinfo is no mount point (an unreadable one taken for one would empty the directory)."""
    info = tmp_path / "mountinfo"
    info.write_text("short line\n"
                    "1 2 3:4 /\n"
                    "1 2 3:4 / /with\\040space\n"
                    "1 2 3:4 / /five\n"
                    "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n")
    assert is_mount_point("/with space", str(info)) and is_mount_point("/five", str(info))
    assert is_mount_point("/mnt2", str(info)) and not is_mount_point("/mnt1", str(info))
    assert not is_mount_point("/with\\040space", str(info)) and not is_mount_point("/with", str(info))
    assert is_mount_point("/five", str(tmp_path / "absent")) is False


def test_libc_keeps_errno_for_the_error_said():
    libc = _libc()
    ctypes.set_errno(0)
    assert libc.umount2(b"/nonexistent/dynpart-mps-shm", MNT_DETACH) != 0
    assert ctypes.get_errno() == errno.ENOENT


class _Libc:
    def __init__(self, fail: int = 0):
        self.fail = fail
        self.mounts: list[str] = []

    def mount(self, source, target, fstype, flags, data):
        self.mounts.append(data.decode())
        if self.fail:
            ctypes.set_errno(self.fail)
            return -1
        return 0

    def umount2(self, target, flags):
        return 0


def test_with_no_size_the_tmpfs_gets_half_the_nodes_memory(tmp_path, monkeypatch):
    from dynpart.agent import mps_shm, selinux

    libc = _Libc()
    monkeypatch.setattr(mps_shm, "_libc", lambda: libc)
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "absent"))
    assert mount_tmpfs(str(tmp_path / "shm")) == half_of_memory()
    assert libc.mounts == [f"size={half_of_memory()},mode=1777"]


def test_a_mount_refused_says_why_and_hints_at_privilege_only_when_that_is_it(tmp_path, monkeypatch):
    from dynpart.agent import mps_shm

    for err, hint in ((errno.EPERM, True), (errno.EACCES, True), (errno.ENODEV, False)):
        monkeypatch.setattr(mps_shm, "_libc", lambda err=err: _Libc(fail=err))
        with pytest.raises(MountError) as e:
            mount_tmpfs(str(tmp_path / "shm"), "4m")
        assert os.strerror(err) in str(e.value) and ("must be privileged" in str(e.value)) == hint, e.value


def test_the_last_pods_tmpfs_is_emptied_directories_and_all_before_it_is_detached(tmp_path):
    """What a file held open in a directory of the last daemon's tmpfs keeps is its holder's alone
    (a copy of the mount held elsewhere would keep the memory of the files it still lists)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    path = str(tmp_path / "mps-shm")
    try:
        mount_tmpfs(path, "4m")
    except MountError:
        pytest.skip("this process may not mount")
    try:
        os.makedirs(os.path.join(path, "d", "e"))
        with open(os.path.join(path, "d", "e", "f"), "w") as f:
            f.write("x")
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "keep").write_text("")
        os.symlink(str(outside), os.path.join(path, "link"))  # (not followed)
        with open(os.path.join(path, "d", "e", "f")) as held:
            mount_tmpfs(path, "4m")
            assert os.fstat(held.fileno()).st_nlink == 0
        assert (outside / "keep").exists() and os.listdir(path) == []
    finally:
        libc = _libc()
        while is_mount_point(path) and libc.umount2(path.encode(), MNT_DETACH) == 0:
            pass


def test_selinux_on_reads_the_selinuxfs_it_is_given(tmp_path, monkeypatch):
    from dynpart.agent import selinux

    (tmp_path / "fs").mkdir()
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "fs"))
    assert selinux_on() and not selinux_on(str(tmp_path / "absent"))
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "absent"))
    assert selinux_on(str(tmp_path / "fs")) and not selinux_on()


# the agent's side: SupervisedMpsDaemon (agent/mps_daemon.py)


def _state(dirs: base.Dirs, **over: object) -> None:
    """A fresh state.json, as the supervisor writes it."""
    write_json(str(dirs.ctl / STATE), {"seq": 1, "gpus": ["GPU-a"], "pipe_dir": str(dirs.pipe), "log_dir": str(dirs.logs),
                                       "running": True, "busy": False, "error": None, "at": time.time(),
                                       "boot": boot_id(), **over})


async def test_the_agent_waits_for_a_supervisor_whose_heartbeat_goes_on_while_it_starts_the_daemon(dirs):
    """The supervisor's heartbeat fresh (it runs) but its start slower than `stale_s`: the
    agent's `ensure` waits (its default `wait_s`), rather than fail as if no supervisor ran."""
    daemon = SlowDaemon(start_s=1.2)
    sup = Supervisor(str(dirs.ctl), daemon, poll_s=0.05)
    agent = SupervisedMpsDaemon(str(dirs.ctl), stale_s=0.5)
    async with running(sup):
        await asyncio.wait_for(agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs)), 20)
    assert daemon.gpus == ("GPU-a",) and dirs.state()["seq"] == 1


async def test_a_supervisor_that_runs_but_does_not_act_fails_the_agent_after_wait_s(dirs, caplog):
    caplog.set_level(logging.INFO, logger="dynpart.agent.mps")
    _state(dirs)
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.3, stale_s=60, poll_s=0.02)
    with pytest.raises(MpsDaemonError, match=r"has not acted on .*\(seq 2\) in 0s \(it last did for seq 1"):
        await asyncio.wait_for(agent.ensure(["GPU-b"], str(dirs.pipe), str(dirs.logs)), 10)
    assert "asked mps-control (`dynpart agent mps-control`) to run the MPS control daemon for GPU-b (seq 2)" in caplog.text


async def test_the_agent_makes_the_control_directory_and_numbers_past_what_the_supervisor_acted_on(dirs):
    """desired.json lost (or never written: the directory not made yet) while state.json says the
    supervisor acted on seq 5: the agent's next seq is 6, never one whose old state it would take
    for the supervisor's answer."""
    agent = SupervisedMpsDaemon(str(dirs.ctl / "new"), wait_s=0.2, stale_s=0.1, poll_s=0.02)
    with pytest.raises(MpsDaemonError, match="no state"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    assert json.loads((dirs.ctl / "new" / DESIRED).read_text())["seq"] == 1
    _state(dirs, seq=5, gpus=["GPU-a"])
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.2, poll_s=0.02)
    with pytest.raises(MpsDaemonError, match="has not acted"):
        await agent.ensure(["GPU-b"], str(dirs.pipe), str(dirs.logs))
    assert json.loads((dirs.ctl / DESIRED).read_text())["seq"] == 6


@pytest.mark.parametrize("seq", [True, -1, "3", None])
async def test_a_desired_json_with_a_bad_seq_is_written_again_with_a_good_one(dirs, seq):
    """As the agent would write it but for its seq (which the supervisor refuses): written again,
    with a seq past the one the supervisor acted on, and waited for as that one."""
    write_json(str(dirs.ctl / DESIRED), {"seq": seq, "gpus": ["GPU-a"], "pipe_dir": str(dirs.pipe),
                                         "log_dir": str(dirs.logs), "boot": boot_id()})
    _state(dirs, seq=4, gpus=["GPU-a"])
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.2, poll_s=0.02)
    with pytest.raises(MpsDaemonError, match="has not acted"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    assert json.loads((dirs.ctl / DESIRED).read_text())["seq"] == 5


@pytest.mark.parametrize("at", [None, "now"])
async def test_a_state_json_without_a_time_is_no_state(dirs, at, caplog):
    _state(dirs, at=at)
    if at is None:
        os.remove(dirs.ctl / STATE)
        write_json(str(dirs.ctl / STATE), {"seq": 1, "gpus": ["GPU-a"], "running": True, "boot": boot_id()})
    agent = SupervisedMpsDaemon(str(dirs.ctl))
    assert await agent.alive() is False and "no state from" in str(agent.error)
    assert "MPS control daemon: no state from" in caplog.text
    assert agent.running_for() is None


async def test_a_fresh_state_json_with_no_seq_is_not_taken_for_an_answer(dirs):
    _state(dirs, seq="1")
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.2, poll_s=0.02)
    with pytest.raises(MpsDaemonError, match="has not acted"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))


async def test_ensure_reads_the_supervisors_answer(dirs):
    """Busy: the supervisor's reason and the daemon's GPUs (none from a malformed list). Done but
    not running, with no error: an error all the same, unless no GPU was asked for."""
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.2, poll_s=0.02)
    reason = "the MPS control daemon for GPU-a does not answer in 10s but runs: kept (see /l/control.log)"
    for gpus, kept in ((["GPU-a"], ("GPU-a",)), ("GPU-a", ())):
        dirs.want(9, ["GPU-a", "GPU-b"])  # (asked already: the agent waits for seq 9)
        _state(dirs, seq=9, gpus=gpus, busy=True, error=reason)
        with pytest.raises(MpsDaemonBusy) as e:
            await agent.ensure(["GPU-a", "GPU-b"], str(dirs.pipe), str(dirs.logs))
        assert str(e.value) == reason and e.value.gpus == kept
        # kept for other GPUs: the request is withdrawn (the supervisor would make it later, when
        # the daemon answers, under pods the agent did not check for)
        assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == (["GPU-a"] if kept else ["GPU-a", "GPU-b"])
    dirs.want(20, ["GPU-a"])
    _state(dirs, seq=20, gpus=[], running=False)
    with pytest.raises(MpsDaemonError, match="reports the MPS control daemon not running"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    dirs.want(30, [])
    _state(dirs, seq=30, gpus=[], running=False)
    await agent.ensure([], str(dirs.pipe), str(dirs.logs))  # (stopped, as asked)


def test_running_for_names_only_gpus_a_running_daemon_was_asked_for(dirs):
    """What a restarted agent keeps the daemon's GPUs at while pods use slices: only a running
    daemon's, a list of UUIDs, or those of a newer desired.json the supervisor is acting on."""
    agent = SupervisedMpsDaemon(str(dirs.ctl))
    dirs.want(1, ["GPU-a"])
    _state(dirs, running=False, error="-d exited with 3")  # (a failed start: not running)
    assert agent.running_for() is None
    for gpus in ("GPU-a", [], [5]):
        _state(dirs, gpus=gpus)
        assert agent.running_for() is None, gpus
    _state(dirs, seq=2, gpus=["GPU-b"])  # (the supervisor acted on a later one than desired.json's)
    assert agent.running_for() == ["GPU-b"]


async def test_stop_asks_nothing_of_a_supervisor_never_asked_for_a_daemon(dirs, caplog):
    """Never asked (no desired.json, or one naming no directories): nothing written, no wait; asked
    and no supervisor: logged, the agent goes on its way."""
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=5, stale_s=0.2, poll_s=0.02)
    t0 = time.monotonic()
    await agent.stop()
    assert not (dirs.ctl / DESIRED).exists()
    for half in ({"pipe_dir": str(dirs.pipe)}, {"log_dir": str(dirs.logs)}):
        write_json(str(dirs.ctl / DESIRED), {"seq": 1, "gpus": ["GPU-a"], **half})
        await agent.stop()
        assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == ["GPU-a"]
    assert time.monotonic() - t0 < 1
    dirs.want(1, ["GPU-a"])
    await agent.stop()
    assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == []
    assert "stopping the MPS control daemon: no state from" in caplog.text
