"""One agent acting on a node's GPUs at a time: an exclusive lock on a file of the node's
filesystem (a DaemonSet rolling update with surge, or an agent started by hand beside the
DaemonSet's, would otherwise run two reconcile loops on the same GPUs); the same for the MPS
control daemon's supervisor (agent/mps_supervisor.py). `fcntl.flock` locks end with the process
that holds them, so a crashed holder never leaves a stale lock."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from dynpart.errors import DynpartError

log = logging.getLogger("dynpart.agent")


class LockNotTaken(DynpartError):
    """`stop` was set while another holder kept the lock."""


@asynccontextmanager
async def node_lock(path: str | Path, retry_s: float = 2.0, holder: str = "agent",
                    stop: asyncio.Event | None = None) -> AsyncIterator[None]:
    """Hold the lock at `path` for the body; wait (logging once, naming `holder`) while another
    holds it, until `stop` is set (LockNotTaken)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DynpartError(f"node lock {path}: {e.strerror}") from None
    try:
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.warning("another %s holds %s; waiting for it to stop", holder, path)
                    waited = True
                if stop is None:
                    await asyncio.sleep(retry_s)
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(retry_s):
                        await stop.wait()
                if stop.is_set():
                    raise LockNotTaken(f"{path}: stopped while another {holder} held it") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
