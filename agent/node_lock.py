"""One agent acting on a node's GPUs at a time: an exclusive lock on a file of the node's
filesystem (a DaemonSet rolling update with surge, or an agent started by hand beside the
DaemonSet's, would otherwise run two reconcile loops on the same GPUs). `fcntl.flock` locks end
with the process that holds them, so a crashed agent never leaves a stale lock."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from dynpart.errors import DynpartError

log = logging.getLogger("dynpart.agent")


@asynccontextmanager
async def node_lock(path: str | Path, retry_s: float = 2.0) -> AsyncIterator[None]:
    """Hold the lock at `path` for the body; wait (logging once) while another agent holds it."""
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
                    log.warning("another agent holds %s; waiting for it to stop", path)
                    waited = True
                await asyncio.sleep(retry_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
