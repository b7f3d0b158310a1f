"""The MPS control daemon of the node's MPS GPUs, run and supervised by the agent (built-in device
plugin): MPS slices are advertised only while it runs, since a client without it gets no limits.

- `MpsDaemon`: `ensure(gpu_uuids, pipe_dir, log_dir)` (start it, or restart it if it died or its
  GPUs changed; raises MpsDaemonError if it cannot run, MpsDaemonBusy if it runs and does not
  answer: then it is kept as it is, even for a change of GPUs), `alive()` (True, False, or None:
  no answer, or no probe could run, while its process is there), `stop()`. The GPUs are given
  in NVML index order (CUDA_VISIBLE_DEVICES); a client's memory limit names its GPUs by the CUDA
  ordinals the client itself sees (`agent/deviceplugin/devices.py`, `container_allocation`);
- `ProcessMpsDaemon`: `nvidia-cuda-mps-control -d` with CUDA_VISIBLE_DEVICES (the GPU UUIDs),
  CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, as NVIDIA's mps-control-daemon does: `-d`
  forks a daemon and returns, so whether it runs is asked through its control pipe
  (`get_default_active_thread_percentage`), and it is stopped with `quit`. A daemon that does not
  answer in time while its process (`nvidia-cuda-mps-control.pid` in the pipe directory, checked
  to be the daemon: a stale file's pid may name another process since) lives is busy or hung, not
  gone: it is neither told to quit nor started a second time;
- `SupervisedMpsDaemon`: the agent's side of the daemon run by `dynpart agent mps-control`
  (agent/mps_supervisor.py) in a pod of its own (the Helm chart's mps-control DaemonSet), so that a
  restart or replacement of the agent does not end it: the agent writes what it wants
  (`desired.json`) into a host directory both pods mount and reads back what runs (`state.json`);
- `FakeMpsDaemon`: the tests' double (`fail_with`, `die()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dynpart.agent.selinux import label_for_containers
from dynpart.errors import DynpartError

log = logging.getLogger("dynpart.agent.mps")

MPS_CONTROL = "nvidia-cuda-mps-control"

# the daemon's logs (control.log, server.log) on the host's disk: rotated past this size
LOG_MAX_BYTES = 16 << 20
_OUTPUT_MAX = 64 << 10  # of a control command's answer
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's, in its pipe directory, removed when it stops
# the daemon's process name (/proc/<pid>/comm: the first 15 characters of its file's name)
DAEMON_COMM = MPS_CONTROL[:15]

# the files the agent (SupervisedMpsDaemon) and `dynpart agent mps-control` share
DESIRED = "desired.json"  # the agent's: {"seq", "gpus", "pipe_dir", "log_dir"}
STATE = "state.json"  # the supervisor's: {"seq", "gpus", "pipe_dir", "log_dir", "running", "busy", "error", "at", ...}
# who runs the supervisor, for messages (the Helm chart: the node's pod of the mps-control DaemonSet)
SUPERVISOR = "mps-control (`dynpart agent mps-control`)"
# the host's boot id (not namespaced: every container of the node reads the host's), stamped on
# both files: they live on the host, so a file written before the node's last boot says nothing
# of what runs now (no daemon survives a reboot)
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This boot of the host, or None where it cannot be read (then nothing is compared)."""
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def before_this_boot(stamp: object, boot: str | None) -> bool:
    """Whether a file stamped `stamp` was written before the boot `boot` (either unknown: no)."""
    return bool(boot) and stamp not in (None, boot)


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON object from `path`; None when absent, unreadable or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str, data: dict[str, Any]) -> None:
    """Whole or not at all (a temporary file beside it, then a rename): a reader never sees half."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def rotate_logs(log_dir: str, max_bytes: int = LOG_MAX_BYTES, running: bool = False) -> None:
    """Keep the daemon's logs bounded: a log past `max_bytes` becomes `<name>.1` (replacing the
    previous one). The daemon appends and never rotates. Before it starts, the file is moved; while
    it runs (`running`: every pass, since control.log grows with each command the agent sends and
    server.log with each client), it is copied, then emptied (logrotate's copytruncate: the daemon
    keeps its file open; lines written between the copy and the truncation are lost). Only the
    bytes on disk count, so a writer that does not append (its next line past the old end leaves a
    hole) is not taken for a log that keeps growing."""
    for name in ("control.log", "server.log"):
        path = os.path.join(log_dir, name)
        try:
            st = os.stat(path)
            if min(st.st_size, st.st_blocks * 512) <= max_bytes:
                continue
            if not running:
                os.replace(path, path + ".1")
                continue
        except OSError:
            continue  # absent, or not ours to move: the daemon writes as before
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".1")  # first: the copy needs the room
            _copy_data(path, path + ".1")
        except OSError as e:  # a full disk, most likely: the log is emptied all the same
            log.warning("MPS daemon log %s: could not keep a copy before emptying it: %s", path, e)
        with contextlib.suppress(OSError):
            os.truncate(path, 0)


def _copy_data(path: str, to: str) -> None:
    """Copy `path`'s data (from its first byte on disk: a hole before it is skipped) to `to`; no
    partial copy is left when it fails."""
    try:
        with open(path, "rb") as src, open(to, "wb") as dst:
            try:
                src.seek(os.lseek(src.fileno(), 0, os.SEEK_DATA))
            except OSError:  # no data at all, or a file system without SEEK_DATA: from the start
                src.seek(0)
            shutil.copyfileobj(src, dst, 1 << 20)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(to)
        raise


class MpsDaemonError(DynpartError):
    """The MPS control daemon cannot be started or does not answer."""


class MpsDaemonTimeout(MpsDaemonError):
    """A control command got no answer in time: the daemon may be busy, not gone."""


class MpsDaemonBusy(MpsDaemonError):
    """It runs and does not answer in time: kept as it is, running for `gpus` (neither stopped nor
    started a second time)."""

    def __init__(self, message: str, gpus: Sequence[str]):
        super().__init__(message)
        self.gpus = tuple(gpus)


class MpsDaemon(Protocol):
    async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
        """Make it run for exactly these GPUs (restarted if it died or its GPUs differ); nothing
        to do for no GPU. Raises MpsDaemonError when it cannot run, or does not answer in time
        while it runs (then it is kept: neither stopped nor started a second time)."""
        ...

    async def alive(self) -> bool | None:
        """True: it answers; False: it does not run; None: unknown (no answer in time, but it was
        not seen gone)."""
        ...

    async def stop(self) -> None: ...

    def running_for(self) -> list[str] | None:
        """The GPUs a daemon this agent process did not start runs for (one that outlives the
        agent's restarts), or None: none, or unknown. A daemon of the agent's own container never
        outlives it: None."""
        ...

    def running_dirs(self) -> tuple[str, str] | None:
        """(pipe_dir, log_dir) of the daemon `running_for` names; None: none, or unknown."""
        ...

    @property
    def shm_dir(self) -> str | None:
        """The host directory that is the running daemon's /dev/shm, which its clients are given
        at theirs (they then need no hostIPC); None: the daemon's /dev/shm is its IPC namespace's
        (clients must share it: hostIPC: true), or unknown."""
        ...


class FakeMpsDaemon:
    """In memory. `fail_with` makes `ensure` fail with that message; `die()` kills it (the next
    `ensure` restarts it); `starts` records each start's GPUs."""

    def __init__(self) -> None:
        self.gpus: tuple[str, ...] = ()
        self.dirs: tuple[str, str] | None = None
        self.running = False
        self.fail_with: str | None = None
        self.starts: list[tuple[str, ...]] = []
        self.shm_dir: str | None = None

    def die(self) -> None:
        self.running = False

    async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
        wanted = tuple(gpu_uuids)
        if self.running and wanted == self.gpus and self.dirs == (pipe_dir, log_dir):
            return
        self.running = False
        if not wanted:
            return
        if self.fail_with is not None:
            raise MpsDaemonError(self.fail_with)
        self.gpus, self.dirs, self.running = wanted, (pipe_dir, log_dir), True
        self.starts.append(wanted)

    async def alive(self) -> bool:
        return self.running

    async def stop(self) -> None:
        self.running = False

    def running_for(self) -> list[str] | None:
        return None  # (a daemon of the agent's own container)

    def running_dirs(self) -> tuple[str, str] | None:
        return None


class ProcessMpsDaemon:
    """`nvidia-cuda-mps-control` on the node (the agent's container has the driver's binaries
    through the NVIDIA container runtime). `binary` is replaceable for tests."""

    def __init__(self, binary: str = MPS_CONTROL, timeout_s: float = 10.0):
        self.binary = binary
        self.timeout_s = timeout_s
        self.gpus: tuple[str, ...] = ()
        self.dirs: tuple[str, str] | None = None
        self.restarts = 0
        # its /dev/shm is this container's (the agent's own daemon: clients need hostIPC, and
        # so does the agent's pod; the supervisor knows and reports its own, Supervisor.shm_dir)
        self.shm_dir: str | None = None

    def _env(self) -> dict[str, str]:
        assert self.dirs is not None
        pipe, logs = self.dirs
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(self.gpus), "CUDA_MPS_PIPE_DIRECTORY": pipe,
                "CUDA_MPS_LOG_DIRECTORY": logs}

    async def _run(self, *args: str, stdin: str | None = None) -> tuple[int, str]:
        # the output goes to a file, not a pipe: `-d` forks a daemon that may keep the output open,
        # and reading a pipe to its end would then wait for the daemon to exit
        try:  # beside the daemon's logs (a host directory), not the container's small /tmp
            out = tempfile.TemporaryFile(dir=self.dirs[1] if self.dirs else None)
        except OSError as e:
            raise MpsDaemonError(f"a file for {self.binary}'s output: {e.strerror or e}") from None
        with out:
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.binary, *args, env=self._env(), stdin=asyncio.subprocess.PIPE if stdin is not None else None,
                    stdout=out, stderr=asyncio.subprocess.STDOUT)
            except OSError as e:
                raise MpsDaemonError(f"{self.binary}: {e.strerror or e}") from None
            try:
                async with asyncio.timeout(self.timeout_s):
                    await proc.communicate(stdin.encode() if stdin is not None else None)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise MpsDaemonTimeout(f"{self.binary} {' '.join(args)}: no answer in {self.timeout_s:.0f}s") from None
            except asyncio.CancelledError:  # (the agent's way out ran out of time): leave no command behind
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise
            out.seek(0)
            return proc.returncode or 0, out.read(_OUTPUT_MAX).decode(errors="replace").strip()

    async def alive(self) -> bool | None:
        """True: it answered on its control pipe; False: it does not run (the command found none,
        or could not be run, and no daemon process lives); None: no answer while its process
        lives (busy or hung, or the command itself could not run or failed: a fork refused under
        the pod's pid limit, the probe killed). Either way `-d` could not start another, and
        taking it for gone would restart it, ending its clients' CUDA contexts."""
        if self.dirs is None:
            return False
        try:
            code, _ = await self._run(stdin="get_default_active_thread_percentage\n")
        except MpsDaemonError:  # (MpsDaemonTimeout too)
            return None if self._process_lives() else False
        if code == 0:
            return True
        return None if self._process_lives() else False

    def _process_lives(self) -> bool:
        """Whether the process its pid file names is the daemon, not ended (the agent's container:
        its PID namespace). The file outlives a daemon killed by SIGKILL or the OOM killer (the pipe
        directory is a hostPath) and its pid can name another process, or a thread, since (pids
        start again from 1 in a new container): taking that for the daemon would keep a dead one
        for ever, its slices Unhealthy. So the pid must be a process of its own (`Tgid`, not a
        thread of another), named as the daemon (`comm`), and not a zombie."""
        assert self.dirs is not None
        try:
            with open(os.path.join(self.dirs[0], PID_FILE)) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.partition(":")[::2] for line in f.read().splitlines())
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError):  # no pid file (it stopped), or no such process
            return False
        return (pid > 0 and status.get("Tgid", "").strip() == str(pid) and comm.startswith(DAEMON_COMM)
                and not status.get("State", "").strip().startswith("Z"))  # (a zombie: ended, not yet reaped)

    async def stop(self) -> None:
        """`quit`, one command of at most `timeout_s` (asking `alive()` first would double that on
        the agent's way out; with no daemon, `quit` just fails)."""
        await self._quit()

    async def _quit(self) -> bool:
        """`quit`; False when the daemon's process still lives after it: no answer in time (busy
        or hung), or the command could not run or failed (a fork refused under the pod's pid
        limit): it runs on, for its GPUs, and is asked again."""
        if self.dirs is None:
            return True
        try:
            code, out = await self._run(stdin="quit\n")
        except MpsDaemonError as e:  # (MpsDaemonTimeout too)
            log.warning("stopping the MPS control daemon: %s", e)
            return not self._process_lives()
        if code != 0:
            log.debug("stopping the MPS control daemon: none answered (%s)", out or f"exit code {code}")
            return not self._process_lives()
        return True

    def running_for(self) -> list[str] | None:
        return None  # a child of this process's container: it ends with the agent

    def running_dirs(self) -> tuple[str, str] | None:
        return None

    async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
        wanted = tuple(gpu_uuids)
        same = wanted == self.gpus and self.dirs == (pipe_dir, log_dir)
        # asked also when its GPUs change: a busy daemon told to `quit` would not have quit when
        # the `-d` after it came
        state = await self.alive()
        if state and same:
            rotate_logs(log_dir, running=True)
            return
        if state is None:
            # no answer in time, but its process lives: busy or hung, not dead. `-d` would fail
            # while it runs, and a restart would end its clients' CUDA contexts: kept, and its
            # slices listed Unhealthy (the caller) until it answers again
            raise self._busy(log_dir)
        if state and not await self._quit():
            # its GPUs are fixed when it starts (CUDA_VISIBLE_DEVICES): a change needs a restart.
            # A quit it did not answer in time leaves it running for the old ones: reported busy,
            # not taken for stopped (nor a `-d` tried beside it)
            raise self._busy(log_dir)
        elif self.dirs is not None and same:
            log.warning("the MPS control daemon for %s is not running; starting it again", ", ".join(self.gpus))
            self.restarts += 1
        self.gpus, self.dirs = wanted, (pipe_dir, log_dir)
        if not wanted:
            return
        for d in (pipe_dir, log_dir):
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise MpsDaemonError(f"MPS directory {d}: {e.strerror}") from None
        # the clients (other pods) mount the pipe directory: labelled for them where SELinux is on
        # (the daemon's pipes and sockets made in it take its type, and the level of the daemon's
        # process: s0, usable by every container, where mps-control is privileged, spc_t)
        label_for_containers(pipe_dir)
        rotate_logs(log_dir)
        code, out = await self._run("-d")
        if code != 0:
            if same and self._process_lives():
                # it refused a second daemon: the one it keeps runs for these GPUs and did not
                # answer the probe (its process appeared since). Busy, not to be restarted
                raise self._busy(log_dir)
            # which GPUs a daemon runs for now is unknown (one may still run, for the old ones, and
            # have refused this start): the next `ensure` must not take it as running for `wanted`
            self.gpus = ()
            raise MpsDaemonError(f"{self.binary} -d exited with {code}: {out or 'no output'}")
        for _ in range(20):  # it forks; its control pipe appears shortly after
            state = await self.alive()
            if state:
                log.info("MPS control daemon running for %s (pipes in %s)", ", ".join(wanted), pipe_dir)
                return
            if state is None:  # it runs and is slow to answer: asking again would wait as long each time
                raise self._busy(log_dir)
            await asyncio.sleep(0.1)
        raise MpsDaemonError(f"{self.binary} -d started but does not answer on its control pipe in {pipe_dir} "
                             f"(see {log_dir}/control.log)")

    def _busy(self, log_dir: str) -> MpsDaemonBusy:
        return MpsDaemonBusy(f"the MPS control daemon for {', '.join(self.gpus)} does not answer on its control pipe "
                             f"in {self.timeout_s:.0f}s but runs: kept, not started again (see {log_dir}/control.log)",
                             self.gpus)


class SupervisedMpsDaemon:
    """The daemon as `dynpart agent mps-control` runs it, in a pod of its own (the Helm chart's
    mps-control DaemonSet): `ensure` writes `desired.json` in `control_dir` (its `seq` one more only
    when what is wanted changes) and waits, at most `wait_s`, for `state.json` to say the
    supervisor acted on it; then raises as ProcessMpsDaemon would (MpsDaemonBusy, MpsDaemonError)
    or returns. A state.json not rewritten for `stale_s` (or dated more than that ahead, or written
    before the node's last boot) means the supervisor does not run; `ensure` then gives up after
    `stale_s`, not `wait_s`. Nothing the agent does
    on its own way out stops the daemon (do not call `stop` then): only `stop`, for a node that left
    MPS mode, asks for it (no GPU)."""

    def __init__(self, control_dir: str, wait_s: float = 30.0, stale_s: float = 5.0, poll_s: float = 0.1,
                 clock: Any = time.time):
        self.dir = control_dir
        self.wait_s = wait_s
        self.stale_s = stale_s
        self.poll_s = poll_s
        self.clock = clock
        self.error: str | None = None  # why alive() said False, if the supervisor is the reason
        # the host directory that is the daemon's /dev/shm, as the last fresh state.json said; kept
        # while the state is late (the slices stay listed until a pass says otherwise, and an
        # Allocate answered without it is the pod's for its life): only a fresh state changes it
        self.shm_dir: str | None = None
        self._said_busy = False  # `stop` said the daemon is busy (said once, not at each call)

    @property
    def desired_path(self) -> str:
        return os.path.join(self.dir, DESIRED)

    def _state(self) -> dict[str, Any] | None:
        """state.json when it is fresh, else None (self.error says why)."""
        path = os.path.join(self.dir, STATE)
        state = read_json(path)
        at = state.get("at") if state else None
        if state is None or not isinstance(at, (int, float)):
            self.error = f"no state from {SUPERVISOR} ({path} is absent or unreadable): is it running on this node?"
            return None
        if before_this_boot(state.get("boot"), boot_id()):
            self.error = f"{path} was written before the node's last boot: {SUPERVISOR} has not run since"
            return None
        age = self.clock() - at
        if age > self.stale_s:
            self.error = (f"{SUPERVISOR} has not written {path} for {age:.0f}s: "
                          "it does not run (see its logs)")
            return None
        if age < -self.stale_s:  # (a clock set back since: what wrote it is not known to run)
            self.error = f"{path} is dated {-age:.0f}s ahead of this clock: {SUPERVISOR} is not known to run"
            return None
        self.error = None
        shm = state.get("shm_dir")
        self.shm_dir = shm if isinstance(shm, str) and shm.startswith("/") else None
        return state

    def _want(self, gpus: Sequence[str], pipe_dir: str, log_dir: str) -> int:
        """Write desired.json unless it already asks for this; its seq."""
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise MpsDaemonError(f"MPS control directory {self.dir}: {e.strerror or e}") from None
        want = {"gpus": list(gpus), "pipe_dir": pipe_dir, "log_dir": log_dir, "boot": boot_id()}
        old = read_json(self.desired_path) or {}
        seq = old.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            seq = 0
        if seq and all(old.get(k) == v for k, v in want.items()):
            return seq
        state = read_json(os.path.join(self.dir, STATE)) or {}
        acted = state.get("seq")
        if isinstance(acted, int) and not isinstance(acted, bool):
            seq = max(seq, acted)  # (a desired.json lost or broken: never a number the supervisor acted on)
        seq += 1
        try:
            write_json(self.desired_path, {"seq": seq, **want})
        except OSError as e:
            raise MpsDaemonError(f"writing {self.desired_path}: {e.strerror or e}") from None
        log.info("asked %s to run the MPS control daemon for %s (seq %d)", SUPERVISOR,
                 ", ".join(gpus) or "no GPU", seq)
        return seq

    async def _acted(self, seq: int) -> dict[str, Any]:
        """state.json once it is fresh and says the supervisor acted on `seq` (or a later one).
        Without a fresh state.json for `stale_s`, the supervisor does not run: no use waiting
        `wait_s` (the agent's pass would stall that long on a node whose mps-control pod is not
        up yet)."""
        start = time.monotonic()
        deadline = start + self.wait_s
        while True:
            state = self._state()
            acted = state.get("seq") if state else None
            if state is not None and isinstance(acted, int) and acted >= seq:
                return state
            now = time.monotonic()
            if now >= deadline or (state is None and now - start >= self.stale_s):
                if state is None:
                    raise MpsDaemonError(str(self.error))
                raise MpsDaemonError(f"{SUPERVISOR} has not acted on {self.desired_path} "
                                     f"(seq {seq}) in {self.wait_s:.0f}s (it last did for seq {acted}; "
                                     f"{state.get('error') or 'still starting or stopping the daemon?'})")
            await asyncio.sleep(self.poll_s)

    async def ensure(self, gpu_uuids: Sequence[str], pipe_dir: str, log_dir: str) -> None:
        now = self._state()
        if now is not None and now.get("busy") and self._other_than_running(now, gpu_uuids, pipe_dir, log_dir):
            # not asked while it is busy (mps-control would keep it and the request be withdrawn at
            # every pass, each waiting for the answer): asked once it answers again
            self._withdraw(now, gpu_uuids)
            raise self._busy(now)
        seq = self._want(gpu_uuids, pipe_dir, log_dir)
        state = await self._acted(seq)
        error = state.get("error")
        if state.get("busy"):
            if self._other_than_running(state, gpu_uuids, pipe_dir, log_dir):
                self._withdraw(state, gpu_uuids)
            raise self._busy(state)
        if error:
            raise MpsDaemonError(str(error))
        if gpu_uuids and not state.get("running"):
            raise MpsDaemonError(f"{SUPERVISOR} reports the MPS control daemon not running")

    @staticmethod
    def _busy(state: Mapping[str, Any]) -> MpsDaemonBusy:
        """The error of a busy daemon as `state` reports it: the supervisor's reason and the GPUs
        it runs for (none from a malformed list)."""
        gpus = state.get("gpus") if isinstance(state.get("gpus"), list) else []
        return MpsDaemonBusy(str(state.get("error") or "the MPS control daemon does not answer but runs: kept"),
                             gpus or ())

    def _withdraw(self, state: Mapping[str, Any], asked: Sequence[str]) -> None:
        """A busy daemon kept as it runs (`state`): `desired.json` asks for that, the request for
        `asked` withdrawn. Else mps-control makes it at a later check, once the daemon answers,
        under the pods that took a slice since the caller found none in use (the caller asks
        again, after its own check)."""
        try:
            self._want(state["gpus"], state["pipe_dir"], state["log_dir"])
        except MpsDaemonError as e:
            log.warning("MPS control daemon busy: its restart for %s could not be withdrawn (%s)",
                        ", ".join(asked) or "no GPU", e)

    @staticmethod
    def _other_than_running(state: Mapping[str, Any], gpus: Sequence[str], pipe_dir: str, log_dir: str) -> bool:
        """`state` names the GPUs and directories the daemon runs as, and they are not these."""
        running, run_pipe, run_log = state.get("gpus"), state.get("pipe_dir"), state.get("log_dir")
        return (isinstance(running, list) and bool(running) and isinstance(run_pipe, str) and isinstance(run_log, str)
                and (running, run_pipe, run_log) != (list(gpus), pipe_dir, log_dir))

    async def alive(self) -> bool | None:
        state = self._state()
        if state is None:
            log.warning("MPS control daemon: %s", self.error)
            return False
        if state.get("busy"):
            return None
        return bool(state.get("running"))

    def running_for(self) -> list[str] | None:
        """The GPUs the daemon runs for now, as a fresh state.json says; None when unknown or not
        running. A restarted agent takes it for what it made the daemon run for: its GPUs are then
        not changed (a restart of the daemon) while pods use slices."""
        gpus = (self._current() or {}).get("gpus")
        if isinstance(gpus, list) and gpus and all(isinstance(g, str) for g in gpus):
            return list(gpus)
        return None

    def running_dirs(self) -> tuple[str, str] | None:
        """(pipe_dir, log_dir) of the daemon `running_for` names, as the same files say; None when
        unknown."""
        if not self.running_for():
            return None
        current = self._current() or {}
        pipe_dir, log_dir = current.get("pipe_dir"), current.get("log_dir")
        return (pipe_dir, log_dir) if isinstance(pipe_dir, str) and isinstance(log_dir, str) else None

    def _current(self) -> dict[str, Any] | None:
        """What the daemon runs as: the request the supervisor is acting on (desired.json, newer
        than state.json and of this boot: the last boot's is acted on by none), else a fresh
        state.json of a running daemon; None when neither."""
        state = self._state()
        desired = read_json(self.desired_path) or {}
        acted, asked = (state or {}).get("seq"), desired.get("seq")
        if (isinstance(asked, int) and isinstance(acted, int) and asked > acted
                and not before_this_boot(desired.get("boot"), boot_id())):
            return desired
        return state if state and state.get("running") else None

    async def stop(self) -> None:
        """No GPU wants the daemon (the node left MPS mode): the supervisor stops it. Waits for that
        as `ensure` does; a supervisor that does not answer is only logged."""
        state = read_json(self.desired_path) or {}
        pipe_dir, log_dir = state.get("pipe_dir"), state.get("log_dir")
        if not isinstance(pipe_dir, str) or not isinstance(log_dir, str):
            return  # never asked for one
        try:
            state = await self._acted(self._want([], pipe_dir, log_dir))
        except MpsDaemonError as e:
            log.warning("stopping the MPS control daemon: %s", e)
            return
        busy = bool(state.get("busy"))
        if busy and not self._said_busy:  # (asked again at each of its checks: it stops once it answers)
            log.warning("stopping the MPS control daemon: %s; %s stops it once it answers",
                        state.get("error") or "it does not answer but runs", SUPERVISOR)
        self._said_busy = busy
