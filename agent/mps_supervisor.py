"""`dynpart agent mps-control`: the MPS control daemon run in a pod of its own (the Helm chart's
mps-control DaemonSet), so that a restart or a replacement of the agent (a crash, an OOM kill, a
failed liveness probe, an upgrade) leaves the daemon, and the CUDA contexts of the node's MPS
pods, as they are.

The agent and this supervisor share a directory (on the host, `mps_control_dir`; either side
replaced finds what the other wrote, as after a restart of its container):

- `desired.json`, written by the agent (`SupervisedMpsDaemon`, agent/mps_daemon.py):
  {"seq": n, "gpus": [UUIDs in NVML index order], "pipe_dir": ..., "log_dir": ...}; `seq` grows
  with each change of the rest; no GPU: the daemon is stopped;
- `state.json`, written by this supervisor: {"seq": the desired seq last acted on, "gpus": what
  the daemon runs for, "pipe_dir", "log_dir", "running", "busy", "error": str or null, "at": wall
  time of the write, rewritten every `poll_s` while the supervisor runs (its heartbeat),
  "checked_at": wall time of the last check of the daemon, "shm_dir": the host directory that is
  the daemon's /dev/shm (`--shm-dir`, checked to be this container's /dev/shm), or null}.

Both are written whole (a temporary file, then a rename), and both carry the host's boot id
("boot"): the files outlive the pods, and one written before the node's last boot is not acted on
(no daemon survives a reboot; the agent of this boot may want none). The supervisor acts on a new
`seq` at once, and checks the daemon again every `check_s` (`ProcessMpsDaemon.ensure`: started
again if it died; a busy one is kept). On its own way out (SIGTERM: the pod or this container
going away) it tells the daemon to quit (a process of this container, the daemon would be killed
with it anyway) and writes state.json once more, not running. One supervisor at a time acts on
the directory (`supervisor.lock`). A malformed desired.json is reported in state.json's "error"
and the daemon is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from dynpart.agent.mps_daemon import (
    DESIRED,
    STATE,
    SUPERVISOR,
    MpsDaemonBusy,
    MpsDaemonError,
    ProcessMpsDaemon,
    before_this_boot,
    boot_id,
    read_json,
    write_json,
)
from dynpart.agent.node_lock import LockNotTaken, node_lock
from dynpart.kube.conventions import DEV_SHM

log = logging.getLogger("dynpart.agent.mps")

POLL_S = 0.5  # how often desired.json is read and state.json rewritten
CHECK_S = 5.0  # how often the daemon is asked whether it answers (and started again if it died)


@dataclass(frozen=True)
class Desired:
    seq: int
    gpus: tuple[str, ...]
    pipe_dir: str
    log_dir: str
    boot: str | None = None  # the host's boot id when the agent wrote it

    def same_target(self, other: Desired) -> bool:
        return (self.gpus, self.pipe_dir, self.log_dir) == (other.gpus, other.pipe_dir, other.log_dir)

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "gpus": list(self.gpus), "pipe_dir": self.pipe_dir, "log_dir": self.log_dir}


def parse_desired(text: str) -> Desired:
    """desired.json's content; ValueError says what is wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    seq, gpus, pipe_dir, log_dir = data.get("seq"), data.get("gpus"), data.get("pipe_dir"), data.get("log_dir")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValueError(f"seq must be a non-negative integer, not {seq!r}")
    if not isinstance(gpus, list) or not all(isinstance(g, str) and g for g in gpus):
        raise ValueError(f"gpus must be a list of GPU UUIDs, not {gpus!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus lists a GPU twice: {gpus!r}")
    for name, value in (("pipe_dir", pipe_dir), ("log_dir", log_dir)):
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ValueError(f"{name} must be an absolute path, not {value!r}")
    assert isinstance(pipe_dir, str) and isinstance(log_dir, str)
    boot = data.get("boot")
    if boot is not None and not isinstance(boot, str):
        raise ValueError(f"boot must be a string, not {boot!r}")
    return Desired(seq, tuple(gpus), pipe_dir, log_dir, boot)


def read_desired(control_dir: str) -> Desired | None:
    """None: none written yet. ValueError: malformed."""
    try:
        with open(os.path.join(control_dir, DESIRED)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return parse_desired(text)


def same_directory(a: str, b: str) -> bool:
    """`a` and `b` are one directory (the same device and inode: one a mount of the other)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class Supervisor:
    """Runs the daemon as desired.json says (`step`), and keeps state.json fresh (`publish`).
    `shm_dir`: the host directory mounted at this container's /dev/shm (`dev_shm`), the daemon's
    shared memory, which the agent's device plugin then mounts at its clients' /dev/shm; reported
    only when it is that mount (seen at the same path through the host directory's mount), so
    that the agent never gives clients a directory the daemon does not use."""

    def __init__(self, control_dir: str, daemon: ProcessMpsDaemon | None = None, *, poll_s: float = POLL_S,
                 check_s: float = CHECK_S, clock: Any = time.time, shm_dir: str | None = None,
                 dev_shm: str = DEV_SHM):
        self.dir = control_dir
        self.shm_dir: str | None = None
        if shm_dir:
            if same_directory(shm_dir, dev_shm):
                self.shm_dir = shm_dir
            else:
                log.error("%s is not this container's %s (not mounted there, or not seen here): MPS pods "
                          "are given no shared memory of the daemon and need hostIPC: true", shm_dir, dev_shm)
        self.daemon = daemon or ProcessMpsDaemon()
        self.poll_s = poll_s
        self.check_s = check_s
        self.clock = clock
        self.acted: Desired | None = None  # the desired state last acted on
        self.checked_at: float | None = None  # monotonic
        self.desired_error: str | None = None  # what is wrong with desired.json, if anything
        self.state: dict[str, Any] = {"seq": 0, "gpus": [], "pipe_dir": None, "log_dir": None, "running": False,
                                      "busy": False, "error": None, "checked_at": None}
        self.boot = boot_id()
        self._resume()

    def _resume(self) -> None:
        """A restarted supervisor (its container restarted or its pod replaced; the host directory
        kept state.json): the daemon it ran is taken as running for the GPUs it recorded, so that the next check only
        asks it (ProcessMpsDaemon starts it again if it is gone, and does not restart one that
        answers for these GPUs)."""
        old = read_json(os.path.join(self.dir, STATE))
        if not old:
            return
        if before_this_boot(old.get("boot"), self.boot):
            return  # written before the node's last boot: no daemon of then runs now
        gpus, pipe_dir, log_dir = old.get("gpus"), old.get("pipe_dir"), old.get("log_dir")
        # (its seq is not carried over: until this supervisor has acted, nothing is reported done)
        if (isinstance(gpus, list) and gpus and all(isinstance(g, str) for g in gpus) and isinstance(pipe_dir, str)
                and isinstance(log_dir, str)):
            self.daemon.gpus, self.daemon.dirs = tuple(gpus), (pipe_dir, log_dir)
            self.state.update(gpus=list(gpus), pipe_dir=pipe_dir, log_dir=log_dir)

    def publish(self) -> None:
        """state.json, its "at" now (the supervisor's heartbeat)."""
        try:
            write_json(os.path.join(self.dir, STATE),
                       {**self.state, "error": self.desired_error or self.state["error"], "at": self.clock(),
                        "boot": self.boot, "shm_dir": self.shm_dir})
        except OSError as e:
            log.warning("writing %s: %s", os.path.join(self.dir, STATE), e)

    async def step(self) -> None:
        """Read desired.json; act on a new seq at once, else check the daemon every `check_s`."""
        try:
            desired = read_desired(self.dir)
        except (OSError, ValueError) as e:
            msg = f"{os.path.join(self.dir, DESIRED)}: {e}; the MPS control daemon is left as it is"
            if self.desired_error != msg:
                log.error("%s", msg)
            self.desired_error = msg
            self.publish()
            return
        self.desired_error = None
        if desired is not None and before_this_boot(desired.boot, self.boot):
            # written before the node's last boot (a reinstall, a relabel while both pods were away):
            # the agent of this boot has asked for nothing yet, and it may want no daemon at all
            desired = None
        if desired is None:  # the agent has asked for nothing yet
            self.publish()
            return
        due = self.checked_at is None or time.monotonic() - self.checked_at >= self.check_s
        if self.acted is not None and desired.same_target(self.acted) and not due:
            if desired.seq != self.state["seq"]:  # the same content under a new number: nothing to do
                self.acted = desired
                self.state["seq"] = desired.seq
            self.publish()
            return
        await self._act(desired)
        self.publish()

    async def _act(self, desired: Desired) -> None:
        daemon = self.daemon
        error: str | None = None
        busy = False
        try:
            if not desired.gpus:
                if daemon.gpus:  # running for some GPUs: none is wanted now
                    # asked first (`ensure` of no GPU): a busy one is kept (MpsDaemonBusy), not told
                    # to quit by a command killed at its timeout and then taken for stopped
                    await daemon.ensure((), desired.pipe_dir, desired.log_dir)
                    log.info("MPS control daemon stopped (no GPU wants it)")
                daemon.gpus, daemon.dirs = (), (desired.pipe_dir, desired.log_dir)
                running = False
            else:
                await daemon.ensure(desired.gpus, desired.pipe_dir, desired.log_dir)
                running = True
        except MpsDaemonBusy as e:
            error, busy, running = str(e), True, True
        except MpsDaemonError as e:
            error, running = str(e), False
        if error and error != self.state["error"]:
            log.error("MPS control daemon: %s", error)
        self.acted = desired
        self.checked_at = time.monotonic()
        pipe_dir, log_dir = daemon.dirs or (desired.pipe_dir, desired.log_dir)
        self.state = {"seq": desired.seq, "gpus": list(daemon.gpus), "pipe_dir": pipe_dir, "log_dir": log_dir,
                      "running": running, "busy": busy, "error": error, "checked_at": self.clock()}

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Until `stop` is set; the daemon is left running. state.json is rewritten every `poll_s`
        also while a step waits for the daemon (a start, a busy daemon): its freshness tells the
        agent that the supervisor runs."""
        stop = stop or asyncio.Event()
        os.makedirs(self.dir, exist_ok=True)

        async def heartbeat() -> None:
            while True:
                self.publish()
                await asyncio.sleep(self.poll_s)

        beat = asyncio.create_task(heartbeat(), name="mps-control heartbeat")
        try:
            while not stop.is_set():
                await self.step()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_s):
                        await stop.wait()
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat


# One supervisor at a time acts on the directory's daemon: two (a rolling update with surge, a
# force-deleted pod whose containers still run, two releases sharing agent.stateDir) would start
# it twice on one pipe directory and each quit the other's on its way out.
LOCK = "supervisor.lock"


async def serve(control_dir: str, binary: str | None = None, poll_s: float = POLL_S, check_s: float = CHECK_S,
                shm_dir: str | None = None) -> int:
    """`dynpart agent mps-control`: until SIGTERM or SIGINT, then tell the daemon to quit and say
    so in state.json."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with node_lock(os.path.join(control_dir, LOCK), retry_s=poll_s, holder="mps-control", stop=stop):
            await _supervise(control_dir, binary, poll_s, check_s, stop, shm_dir)
    except LockNotTaken:
        pass
    return 0


async def _supervise(control_dir: str, binary: str | None, poll_s: float, check_s: float, stop: asyncio.Event,
                     shm_dir: str | None = None) -> None:
    """Holding the lock: supervise until `stop`, then say not-running and quit the daemon."""
    daemon = ProcessMpsDaemon(binary) if binary else ProcessMpsDaemon()
    supervisor = Supervisor(control_dir, daemon, poll_s=poll_s, check_s=check_s, shm_dir=shm_dir)
    log.info("supervising the MPS control daemon as %s asks", os.path.join(control_dir, DESIRED))
    await supervisor.run(stop)
    # said first (the quit may take its 10 s): the file outlives this pod, and the agent would
    # read "running" from it until it went stale
    supervisor.state.update(gpus=[], running=False, busy=False, error=f"{SUPERVISOR} stopped")
    supervisor.publish()
    # the daemon is a process of this container: it ends with it whatever is done here, so it is
    # told to quit (its pid file and pipes removed) rather than killed; also one whose last
    # start failed (no GPUs recorded) may still run from before
    if daemon.dirs is not None:
        log.info("stopping: the MPS control daemon too (it would end with this container)")
        await daemon.stop()
