"""`dynpart agent mps-control` (agent/mps_supervisor.py) with a stand-in for nvidia-cuda-mps-control,
and the agent's side of it (`SupervisedMpsDaemon`): the daemon runs as desired.json says; what
runs is in state.json; and, what it is for, the agent going away or coming back (a new
SupervisedMpsDaemon on the same directory) neither stops nor restarts the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dynpart.agent.mps_daemon import (
    DESIRED,
    PID_FILE,
    STATE,
    MpsDaemonBusy,
    MpsDaemonError,
    ProcessMpsDaemon,
    SupervisedMpsDaemon,
    boot_id,
    write_json,
)
from dynpart.agent.mps_supervisor import Supervisor, parse_desired
from tests.agent.test_mps_daemon_busy import FAKE_CONTROL
from tests.agent.test_nodepods import installed_control


@pytest.fixture
def control(tmp_path):
    return installed_control(tmp_path, FAKE_CONTROL)


class Dirs:
    def __init__(self, tmp_path: Path):
        self.ctl, self.pipe, self.logs = tmp_path / "ctl", tmp_path / "pipe", tmp_path / "log"
        self.ctl.mkdir()

    def want(self, seq: int, gpus: list[str]) -> None:
        write_json(str(self.ctl / DESIRED), {"seq": seq, "gpus": gpus, "pipe_dir": str(self.pipe),
                                             "log_dir": str(self.logs), "boot": boot_id()})  # as the agent

    def state(self) -> dict:
        return json.loads((self.ctl / STATE).read_text())

    def lines(self, name: str) -> list[str]:
        path = self.logs / name
        return path.read_text().split() if path.exists() else []

    def daemon_pid(self) -> int | None:
        path = self.pipe / PID_FILE
        return int(path.read_text()) if path.exists() else None

    def daemon_lives(self) -> bool:
        pid = self.daemon_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return not Path(f"/proc/{pid}/status").read_text().count("State:\tZ")

    def kill_daemon(self) -> None:
        pid = self.daemon_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.fixture
def dirs(tmp_path):
    d = Dirs(tmp_path)
    yield d
    d.kill_daemon()


@contextlib.asynccontextmanager
async def running(supervisor: Supervisor) -> AsyncIterator[asyncio.Task]:
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def test_parse_desired_refuses_what_it_cannot_act_on():
    ok = parse_desired('{"seq": 3, "gpus": ["GPU-a"], "pipe_dir": "/p", "log_dir": "/l"}')
    assert (ok.seq, ok.gpus, ok.pipe_dir, ok.log_dir) == (3, ("GPU-a",), "/p", "/l")
    for text, why in (("{", "not JSON"), ("[]", "not a JSON object"),
                      ('{"seq": true, "gpus": [], "pipe_dir": "/p", "log_dir": "/l"}', "seq"),
                      ('{"seq": 1, "gpus": "GPU-a", "pipe_dir": "/p", "log_dir": "/l"}', "gpus"),
                      ('{"seq": 1, "gpus": ["GPU-a", "GPU-a"], "pipe_dir": "/p", "log_dir": "/l"}', "twice"),
                      ('{"seq": 1, "gpus": [], "pipe_dir": "p", "log_dir": "/l"}', "pipe_dir")):
        with pytest.raises(ValueError, match=why):
            parse_desired(text)


async def test_the_supervisor_runs_the_daemon_as_desired_and_stops_it_for_no_gpu(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=60)
    await sup.step()  # nothing asked yet: nothing started, a heartbeat all the same
    assert dirs.lines("starts") == [] and dirs.state()["running"] is False and dirs.state()["seq"] == 0
    dirs.want(1, ["GPU-b", "GPU-a"])
    await sup.step()
    state = dirs.state()
    assert dirs.lines("starts") == ["GPU-b,GPU-a"] and dirs.daemon_lives()
    assert (state["seq"], state["gpus"], state["running"], state["busy"], state["error"]) == (
        1, ["GPU-b", "GPU-a"], True, False, None)
    assert state["pipe_dir"] == str(dirs.pipe) and abs(state["at"] - time.time()) < 5
    commands = dirs.lines("commands")
    await sup.step()  # the same seq, no check due: not even a control command
    assert dirs.lines("commands") == commands
    dirs.want(2, [])
    await sup.step()
    assert dirs.lines("commands")[-1] == "quit" and not dirs.daemon_lives()
    assert (dirs.state()["seq"], dirs.state()["running"], dirs.state()["gpus"]) == (2, False, [])
    await sup.step()  # stays stopped
    assert dirs.lines("starts") == ["GPU-b,GPU-a"]


async def test_a_dead_daemon_is_started_again_at_the_next_check(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=0.2)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    dirs.kill_daemon()
    await sup.step()  # within check_s: not asked yet
    assert dirs.lines("starts") == ["GPU-a"]
    await asyncio.sleep(0.3)
    await sup.step()
    assert dirs.lines("starts") == ["GPU-a", "GPU-a"] and dirs.daemon_lives() and dirs.state()["running"]


async def test_a_malformed_desired_state_is_reported_and_the_daemon_left_alone(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=0)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    pid = dirs.daemon_pid()
    (dirs.ctl / DESIRED).write_text('{"seq": 2, "gpus": []')  # (not what the agent writes: it renames)
    await sup.step()
    state = dirs.state()
    assert "desired.json: not JSON" in state["error"] and "left as it is" in state["error"]
    assert state["seq"] == 1 and state["running"] is True
    assert dirs.daemon_pid() == pid and dirs.daemon_lives() and "quit" not in dirs.lines("commands")
    dirs.want(2, ["GPU-a"])  # readable again: the error goes
    await sup.step()
    assert dirs.state()["error"] is None and dirs.state()["seq"] == 2 and dirs.lines("starts") == ["GPU-a"]


async def test_a_busy_daemon_is_reported_busy_and_kept(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=0.5), check_s=0)
    dirs.want(1, ["GPU-a"])
    await sup.step()
    (dirs.pipe / "BUSY").touch()  # its control commands answer after 5 s
    dirs.want(2, ["GPU-a", "GPU-b"])
    await sup.step()
    state = dirs.state()
    assert state["busy"] is True and state["gpus"] == ["GPU-a"] and "does not answer" in state["error"]
    assert dirs.lines("starts") == ["GPU-a"] and "quit" not in dirs.lines("commands")
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=2)
    with pytest.raises(MpsDaemonBusy) as e:  # as ProcessMpsDaemon would: what runs, kept
        await agent.ensure(["GPU-a", "GPU-b"], str(dirs.pipe), str(dirs.logs))
    assert e.value.gpus == ("GPU-a",)
    assert await agent.alive() is None


async def test_the_agent_side_starts_it_and_a_restarted_agent_neither_restarts_nor_stops_it(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.2)
    async with running(sup):
        agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=10)
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert dirs.lines("starts") == ["GPU-a"] and await agent.alive() is True
        pid = dirs.daemon_pid()
        seq = json.loads((dirs.ctl / DESIRED).read_text())["seq"]
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))  # unchanged: the same seq
        assert json.loads((dirs.ctl / DESIRED).read_text())["seq"] == seq
        del agent  # the agent's container restarts (its way out does not call stop)
        again = SupervisedMpsDaemon(str(dirs.ctl), wait_s=10)
        assert await again.alive() is True
        for _ in range(3):  # its passes, over several of the supervisor's checks
            await again.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
            await asyncio.sleep(0.1)
        assert json.loads((dirs.ctl / DESIRED).read_text())["seq"] == seq
        assert dirs.lines("starts") == ["GPU-a"] and "quit" not in dirs.lines("commands")
        assert dirs.daemon_pid() == pid and dirs.daemon_lives()
        # other GPUs: a new seq, the daemon restarted for them
        await again.ensure(["GPU-a", "GPU-b"], str(dirs.pipe), str(dirs.logs))
        assert dirs.lines("starts") == ["GPU-a", "GPU-a,GPU-b"]
        assert json.loads((dirs.ctl / DESIRED).read_text())["seq"] == seq + 1
        # the node left MPS mode: stop asks for no GPU, and the supervisor stops it
        await again.stop()
        assert not dirs.daemon_lives() and dirs.lines("commands")[-1] == "quit" and await again.alive() is False


async def test_a_failing_start_is_an_mps_daemon_error_on_the_agent_side(tmp_path, dirs):
    control = installed_control(tmp_path, "#!/bin/sh\necho 'cannot start: no MPS on this GPU'; exit 3\n")
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)
    async with running(sup):
        agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=10)
        with pytest.raises(MpsDaemonError, match="-d exited with 3: cannot start: no MPS on this GPU") as e:
            await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert not isinstance(e.value, MpsDaemonBusy)
        assert await agent.alive() is False


async def test_the_supervisor_exiting_leaves_the_daemon_and_the_agent_sees_it_gone(control, dirs):
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.5, stale_s=0.3)
    async with running(sup):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    # a supervisor that ends without its way out (killed): no quit, the daemon still runs
    assert dirs.daemon_lives() and "quit" not in dirs.lines("commands")
    await asyncio.sleep(0.4)  # no heartbeat since
    assert await agent.alive() is False
    assert "mps-control (`dynpart agent mps-control`) has not written" in str(agent.error)
    with pytest.raises(MpsDaemonError, match="mps-control .* has not written"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    # a restarted supervisor (the host directory kept state.json) takes the running daemon back: asked, not restarted
    sup2 = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)
    async with running(sup2):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert await agent.alive() is True
    assert dirs.lines("starts") == ["GPU-a"] and dirs.lines("commands").count("-d") == 1


async def test_no_supervisor_at_all_is_an_error_naming_it(dirs):
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.2)
    with pytest.raises(MpsDaemonError, match="no state from mps-control"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == ["GPU-a"]  # asked all the same
    assert await agent.alive() is False


async def test_the_cli_agent_with_a_control_dir_does_not_stop_the_daemon_on_its_way_out(tmp_path):
    """`mps_control_dir` set: the agent's daemon is the supervised one, and closing the agent's
    stack (its shutdown) asks nothing of it."""
    import argparse

    from kubernetes_asyncio import client

    from dynpart.agent.cli import _agent
    from dynpart.agent.driver.fake import FakeNvml
    from dynpart.agent.podresources import FakePodResources
    from dynpart.catalog import default_catalog
    from dynpart.settings import AgentSettings, load_settings

    ctl = tmp_path / "ctl"
    ctl.mkdir()
    write_json(str(ctl / DESIRED), {"seq": 4, "gpus": ["GPU-a"], "pipe_dir": "/p", "log_dir": "/l"})
    catalog = default_catalog()
    api = client.ApiClient()
    try:
        settings = load_settings(AgentSettings, flags={"node_name": "n1", "device_plugin_dir": str(tmp_path / "dp"),
                                                       "mps_control_dir": str(ctl)})
        async with contextlib.AsyncExitStack() as stack:
            agent = await _agent(argparse.Namespace(mps_capacity_gb=None), settings, api,
                                 FakeNvml(catalog.resolve("H100-80GB"), 1), FakePodResources(), catalog, None, stack)
            assert isinstance(agent.mps_daemon, SupervisedMpsDaemon) and agent.mps_daemon.dir == str(ctl)
        assert json.loads((ctl / DESIRED).read_text())["gpus"] == ["GPU-a"]  # not asked to stop
    finally:
        await api.close()


async def test_a_restarted_agent_does_not_change_the_daemons_gpus_under_running_pods(dirs):
    """The daemon (mps-control) runs for GPU 0 only; the restarted agent finds both GPUs sliceable
    while a pod holds a slice of GPU 0: it keeps the daemon as it runs (no new desired state),
    and lists GPU 1's slices Unhealthy, as an agent that had run all along would."""
    from dynpart.agent.driver.fake import FakeNvml
    from dynpart.agent.mps_plugin import MpsPluginAgent
    from dynpart.agent.podresources import FakePodResources
    from tests.agent.conftest import H100, ROUND_80GIB

    driver = FakeNvml(H100, 2, mig_enabled=False, **ROUND_80GIB)
    uuids = [d.uuid for d in driver.devices()]
    dirs.want(7, uuids[:1])
    write_json(str(dirs.ctl / STATE), {"seq": 7, "gpus": uuids[:1], "pipe_dir": str(dirs.pipe),
                                       "log_dir": str(dirs.logs), "running": True, "busy": False, "error": None,
                                       "at": time.time()})
    pods = FakePodResources()
    pods.assign("ns/a", "nvidia.com/gpu-40gb", f"{uuids[0]}::0")
    daemon = SupervisedMpsDaemon(str(dirs.ctl), wait_s=0.3)
    mps = MpsPluginAgent(driver, pods, 80, daemon=daemon, pipe_dir=str(dirs.pipe), log_dir=str(dirs.logs))
    result = await mps.apply({0: [40, 40], 1: [40, 40]})
    desired = json.loads((dirs.ctl / DESIRED).read_text())
    assert (desired["seq"], desired["gpus"]) == (7, uuids[:1])  # not asked to restart it for both
    assert mps.uncovered == {uuids[1]} and mps.serves(uuids[0]) and not mps.serves(uuids[1])
    assert any("is not restarted while pods use MPS slices" in e for e in result.errors), result.errors
    pods.release("ns/a")  # no pod uses it: now it may change
    await mps.apply({0: [40, 40], 1: [40, 40]})
    assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == uuids


def test_the_mps_control_command_exits_on_sigterm_quitting_the_daemon(control, dirs):
    """`dynpart agent mps-control` as the chart runs it: it acts on desired.json, and its SIGTERM
    (the kubelet, the pod or the container going away) ends it, exit status 0, after a `quit` (the
    daemon, a process of its container, would be killed with it anyway)."""
    import signal
    import subprocess
    import sys

    dirs.want(1, ["GPU-a"])
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from dynpart.cli import main; sys.exit(main())",
                             "agent", "mps-control", "--dir", str(dirs.ctl), "--mps-control-binary", control],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (dirs.ctl / STATE).exists() and dirs.state().get("running"):
                break
            time.sleep(0.05)
        assert dirs.state()["running"] is True and dirs.state()["seq"] == 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "the MPS control daemon too" in out
    assert "quit" in dirs.lines("commands") and dirs.lines("starts") == ["GPU-a"]
    # said at once in state.json, which outlives the pod on the host: an agent reading it before it
    # goes stale sees no daemon, not the one just quit
    final = dirs.state()
    assert (final["running"], final["gpus"]) == (False, []) and "stopped" in final["error"]
    assert time.time() - final["at"] < 10


def test_a_second_mps_control_on_the_directory_waits_for_the_first(control, dirs):
    """Two supervisors of one directory (a surge, a force-deleted pod whose containers still run,
    two releases sharing agent.stateDir) would run `-d` twice on one pipe directory and each quit
    the other's daemon on its way out: the second waits for the first's lock, acting on nothing,
    and takes over when the first has gone (its daemon quit), starting it again."""
    import signal
    import subprocess
    import sys

    dirs.want(1, ["GPU-a"])
    cmd = [sys.executable, "-c", "import sys; from dynpart.cli import main; sys.exit(main())",
           "agent", "mps-control", "--dir", str(dirs.ctl), "--mps-control-binary", control]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ((dirs.ctl / STATE).exists() and dirs.state().get("running")):
            time.sleep(0.05)
        assert dirs.state()["running"] is True
        log = dirs.ctl.parent / "second.log"
        with open(log, "w") as out_file:
            second = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, text=True)
        # until it says it waits (its start takes seconds on a loaded machine), then a while more:
        # long enough for it to have acted, were it not waiting
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "another mps-control holds" not in log.read_text():
            time.sleep(0.05)
        time.sleep(1)
        assert second.poll() is None and dirs.lines("starts") == ["GPU-a"] and "quit" not in dirs.lines("commands")
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=20)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and dirs.lines("starts") != ["GPU-a", "GPU-a"]:
            time.sleep(0.05)
        assert dirs.lines("starts") == ["GPU-a", "GPU-a"]  # the second started it again, once
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not dirs.state().get("running"):
            time.sleep(0.05)
        assert dirs.state()["running"] is True
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=20)
        out = log.read_text()
        assert second.returncode == 0 and "another mps-control holds" in out, out
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()


async def test_files_from_before_the_nodes_last_boot_are_not_acted_on(control, dirs, monkeypatch):
    """desired.json and state.json live on the host: after a reboot (no daemon survives one) a
    supervisor does not start the daemon the last boot's agent asked for (this boot's agent may
    want none: the node may be in MIG mode now), takes no daemon of then for running, and the
    agent reads the old state.json as no state at all."""
    import dynpart.agent.mps_daemon as mps_daemon
    import dynpart.agent.mps_supervisor as mps_supervisor

    boot = {"id": "boot-1"}
    for module in (mps_daemon, mps_supervisor):
        monkeypatch.setattr(module, "boot_id", lambda: boot["id"])
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=5, stale_s=2, poll_s=0.02)
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)
    async with running(sup):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    assert json.loads((dirs.ctl / DESIRED).read_text())["boot"] == "boot-1" and dirs.state()["boot"] == "boot-1"
    dirs.kill_daemon()  # the reboot
    boot["id"] = "boot-2"
    assert agent.running_for() is None and "before the node's last boot" in str(agent.error)
    sup2 = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), check_s=0)
    assert sup2.daemon.gpus == ()  # nothing resumed
    await sup2.step()
    await sup2.step()
    assert dirs.lines("starts") == ["GPU-a"] and dirs.state()["running"] is False  # not started again
    # nor does the agent take the last boot's desired GPUs for what the daemon runs for next
    assert agent.running_for() is None
    # this boot's agent asks: acted on at once
    async with running(Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert await agent.alive() is True
    assert dirs.lines("starts") == ["GPU-a", "GPU-a"]


async def test_a_state_dated_ahead_or_no_supervisor_fails_after_stale_s_not_wait_s(dirs):
    """A state.json dated ahead of the clock (written before the clock was set back) is no sign of
    a supervisor; and without one the agent's `ensure` gives up after `stale_s`, not the 30 s it
    would wait for a supervisor that runs (each pass of a node whose mps-control pod is not up yet
    would stall that long)."""
    write_json(str(dirs.ctl / STATE), {"seq": 5, "gpus": ["GPU-a"], "running": True, "at": time.time() + 60})
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=30, stale_s=0.5, poll_s=0.02)
    assert await agent.alive() is False and "ahead" in str(agent.error) and agent.running_for() is None
    t0 = time.monotonic()
    with pytest.raises(MpsDaemonError, match="ahead"):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
    assert time.monotonic() - t0 < 5


async def test_a_restarted_supervisor_reports_nothing_done_before_it_has_acted(control, dirs):
    """The mps-control container restarted or its pod was replaced (the host directory kept both
    files; its daemon ended with it): until the new supervisor has acted, state.json reports no seq done, so the agent's `ensure` of
    the same desired seq waits for the daemon started again instead of failing at once on the old
    file's "not running" (review 82)."""
    dirs.want(3, ["GPU-a"])
    write_json(str(dirs.ctl / STATE), {"seq": 3, "gpus": ["GPU-a"], "pipe_dir": str(dirs.pipe),
                                       "log_dir": str(dirs.logs), "running": False, "busy": False, "error": None,
                                       "at": time.time() - 600})
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05)
    sup.publish()  # its heartbeat, before its first step
    assert dirs.state()["seq"] == 0
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=5)
    async with running(sup):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert dirs.state()["running"] is True and dirs.daemon_lives()


async def test_while_the_supervisor_changes_the_daemons_gpus_a_restarted_agent_takes_the_new_ones(dirs):
    """desired.json asks for seq 5 while state.json still says seq 4 (the supervisor is restarting
    the daemon for the new GPUs): the daemon runs for the desired ones next (review 82)."""
    dirs.want(5, ["GPU-b"])
    write_json(str(dirs.ctl / STATE), {"seq": 4, "gpus": ["GPU-a"], "pipe_dir": str(dirs.pipe),
                                       "log_dir": str(dirs.logs), "running": True, "busy": False, "error": None,
                                       "at": time.time()})
    assert SupervisedMpsDaemon(str(dirs.ctl)).running_for() == ["GPU-b"]
    dirs.want(4, ["GPU-a"])
    assert SupervisedMpsDaemon(str(dirs.ctl)).running_for() == ["GPU-a"]


async def test_the_daemons_own_dev_shm_is_reported_only_when_it_is_mounted_there(control, dirs, tmp_path, caplog):
    """`--shm-dir`: the host directory the chart mounts at mps-control's /dev/shm. It reaches the
    agent (whose device plugin mounts it at the clients' /dev/shm) only when this container's
    /dev/shm is that directory: a client given another one than its daemon's would not reach it."""
    shm = tmp_path / "mps-shm"
    shm.mkdir()
    seen_as = tmp_path / "dev-shm"  # this container's /dev/shm: here a link to the same directory
    seen_as.symlink_to(shm)
    dirs.want(1, ["GPU-a"])
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.2,
                     shm_dir=str(shm), dev_shm=str(seen_as))
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=10)
    async with running(sup):
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert dirs.state()["shm_dir"] == str(shm) and agent.shm_dir == str(shm)
    # the supervisor late (its state stale): the last one said is kept (review 94: an Allocate
    # answered without it would leave the pod without its daemon's shared memory for its life)
    agent.stale_s = 0.0
    time.sleep(0.01)
    assert await agent.alive() is False and agent.shm_dir == str(shm)
    # another directory than this container's /dev/shm: not reported, and said why
    other = tmp_path / "elsewhere"
    other.mkdir()
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.2,
                     shm_dir=str(shm), dev_shm=str(other))
    assert "is not this container's" in caplog.text and "hostIPC" in caplog.text
    agent = SupervisedMpsDaemon(str(dirs.ctl), wait_s=10)
    async with running(sup):
        await asyncio.sleep(0.2)  # (its first state.json written over the last supervisor's)
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert dirs.state()["shm_dir"] is None and agent.shm_dir is None
    # without --shm-dir (the chart's agent.mpsShm.mode hostIPC): none either
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=5), poll_s=0.05, check_s=0.2)
    write_json(str(dirs.ctl / STATE), {**dirs.state(), "shm_dir": str(shm)})  # (as if the last one had it)
    async with running(sup):
        await asyncio.sleep(0.2)
        await agent.ensure(["GPU-a"], str(dirs.pipe), str(dirs.logs))
        assert dirs.state()["shm_dir"] is None and agent.shm_dir is None


def test_a_state_naming_an_odd_shm_dir_gives_clients_none(dirs):
    agent = SupervisedMpsDaemon(str(dirs.ctl))
    for odd in ("relative/dir", 7, ["/x"], ""):
        write_json(str(dirs.ctl / STATE), {"seq": 1, "gpus": ["GPU-a"], "running": True, "at": time.time(),
                                           "boot": boot_id(), "shm_dir": odd})
        assert agent.running_for() == ["GPU-a"] and agent.shm_dir is None
    write_json(str(dirs.ctl / STATE), {"seq": 1, "gpus": ["GPU-a"], "running": True, "at": time.time(),
                                       "boot": boot_id(), "shm_dir": "/var/lib/dynpart/mps-shm"})
    assert agent.running_for() == ["GPU-a"] and agent.shm_dir == "/var/lib/dynpart/mps-shm"


def _two_gpu_mps(dirs: Any) -> tuple[Any, Any, Any, Any]:
    """(driver, PodResources, the agent's daemon, its MPS plugin) of a node with two H100s, the
    daemon supervised by mps-control in `dirs`."""
    from dynpart.agent.driver.fake import FakeNvml
    from dynpart.agent.mps_plugin import MpsPluginAgent
    from dynpart.agent.podresources import FakePodResources
    from tests.agent.conftest import H100

    driver = FakeNvml(H100, 2, mig_enabled=False)
    pods = FakePodResources()
    daemon = SupervisedMpsDaemon(str(dirs.ctl), wait_s=5, poll_s=0.02)
    mps = MpsPluginAgent(driver, pods, 79, daemon=daemon, pipe_dir=str(dirs.pipe), log_dir=str(dirs.logs))
    return driver, pods, daemon, mps


async def test_a_busy_daemon_is_asked_for_other_gpus_again_only_once_it_answers(control, dirs):
    """A restart for GPU 0 alone that mps-control could not make (the daemon busy) is withdrawn;
    the passes after it do not ask again while the daemon stays busy (each would wait for
    mps-control's answer and the withdrawal follow it), and the first after it answers does."""
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=0.5), poll_s=0.05, check_s=0.5)
    driver, _, _, mps = _two_gpu_mps(dirs)
    async with running(sup):
        await mps.apply({0: [40], 1: [20]})
        driver.set_mig_mode(1, True)
        (dirs.pipe / "BUSY").touch()
        await mps.apply({0: [40]})  # asked; busy: kept, and the request withdrawn
        seq = json.loads((dirs.ctl / DESIRED).read_text())["seq"]
        assert json.loads((dirs.ctl / DESIRED).read_text())["gpus"] == ["GPU-fake-0000", "GPU-fake-0001"]
        t0 = time.monotonic()
        for _ in range(3):
            await mps.apply({0: [40]})
            assert not mps.healthy
        assert time.monotonic() - t0 < 0.5 and json.loads((dirs.ctl / DESIRED).read_text())["seq"] == seq
        (dirs.pipe / "BUSY").unlink()
        await asyncio.sleep(1.2)  # mps-control's next check: it answers
        await mps.apply({0: [40]})
        assert dirs.lines("starts") == ["GPU-fake-0000,GPU-fake-0001", "GPU-fake-0000"] and mps.healthy


async def test_a_change_of_gpus_left_to_a_busy_daemon_is_not_made_later_under_a_pod(control, dirs):
    """The agent asks mps-control to restart the daemon for GPU 0 alone (GPU 1 entered MIG mode, no
    pod held a slice when it looked); the daemon is busy, so mps-control keeps it (MpsDaemonBusy).
    While the agent waited, GPU 0's slice was still listed healthy and the kubelet gave it to a pod.
    desired.json still asks for GPU 0 alone: mps-control's next check, once the daemon answers,
    must not quit it under that pod (the agent's check was made before the pod came)."""
    sup = Supervisor(str(dirs.ctl), ProcessMpsDaemon(control, timeout_s=0.5), poll_s=0.05, check_s=0.5)
    driver, pods, daemon, mps = _two_gpu_mps(dirs)
    async with running(sup):
        await mps.apply({0: [40], 1: [20]})
        assert dirs.lines("starts") == ["GPU-fake-0000,GPU-fake-0001"] and mps.healthy
        driver.set_mig_mode(1, True)  # GPU 1 leaves MPS: the daemon would run for GPU 0 alone
        (dirs.pipe / "BUSY").touch()  # and it is slow to answer right now
        ensure = daemon.ensure

        async def admitted_meanwhile(*args):
            # while the agent waits for mps-control, GPU 0's slice is still listed healthy: the
            # kubelet gives it to a pod, whose container connects to the running daemon
            pods.assign("ns/a", "nvidia.com/gpu-40gb", "GPU-fake-0000::0")
            return await ensure(*args)

        daemon.ensure = admitted_meanwhile  # type: ignore[method-assign]
        await mps.apply({0: [40]})  # no pod when it looked: restart asked; busy: kept
        daemon.ensure = ensure  # type: ignore[method-assign]
        assert not mps.healthy
        (dirs.pipe / "BUSY").unlink()  # the daemon answers again
        await asyncio.sleep(1.5)  # mps-control's next checks (every check_s), before the agent's next pass
        assert "quit" not in dirs.lines("commands") and dirs.lines("starts") == ["GPU-fake-0000,GPU-fake-0001"], (
            f"the daemon was restarted for other GPUs under ns/a's slice: starts {dirs.lines('starts')}, "
            f"commands {dirs.lines('commands')}")
