"""`dynpart agent mps-shm`: a fresh tmpfs at a host directory, the MPS control daemon's /dev/shm.

MPS clients share memory with their MPS server through /dev/shm (POSIX shared memory). Instead of
putting the daemon and every MPS pod in the host's IPC namespace (`hostIPC: true`, which the Pod
Security `baseline` level forbids), the Helm chart's mps-control pod mounts this directory at its
/dev/shm and the agent's device plugin mounts it at each MPS client's /dev/shm, as NVIDIA's device
plugin does (its mps-control-daemon `mount-shm` init container, `internal/plugin/mps.go`). The
chart runs this as the mps-control pod's init container, privileged, with the host directory
mounted `Bidirectional` so that the tmpfs is the host's. A tmpfs, not the host directory itself:
shared memory is memory, and a directory on the node's disk would be written back to it.

A new mps-control pod means a new daemon: a tmpfs left mounted there by the last pod is emptied
and detached first (lazily: processes that still map its files keep them), so each new pod's
daemon starts on an empty one. (A restart of the pod's container, which does not run its init
containers again, keeps the tmpfs and what the last daemon left there.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil

from dynpart.agent.selinux import CONTAINER_FILE, selinux_on
from dynpart.errors import DynpartError

# mount(2) flags (linux/mount.h)
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MNT_DETACH = 2
FALLBACK_SIZE = "64m"  # when /proc/meminfo is unreadable (NVIDIA's plugin: 65536k)


class MountError(DynpartError):
    pass


def half_of_memory(meminfo: str = "/proc/meminfo") -> str:
    """Half the node's memory, as a tmpfs size: what /dev/shm gets by default (and NVIDIA's plugin
    gives its daemon's). A size is a limit, not a reservation."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    parts = line.split()
                    if len(parts) >= 2 and parts[1].isdigit() and (len(parts) == 2 or parts[2] == "kB"):
                        return f"{int(parts[1]) // 2}k"
    except OSError:
        pass
    return FALLBACK_SIZE


def is_mount_point(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    real = os.path.realpath(path)
    try:
        with open(mountinfo) as f:
            # field 5: the mount point, octal escapes for spaces and the like
            return any(_unescape(line.split()[4]) == real for line in f if len(line.split()) > 4)
    except OSError:
        return False


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_tmpfs(path: str, size: str | None = None) -> str:
    """A fresh tmpfs at `path` (created if absent; one mounted there already is detached first),
    mode 1777 as /dev/shm (MPS servers run under their clients' user ids). Returns the size."""
    size = size or half_of_memory()
    if not re.fullmatch(r"[1-9][0-9]*[kmgKMG%]?", size):
        raise MountError(f"tmpfs size {size!r}: a number of bytes, of k, m or g (e.g. 64g), or a % of memory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise MountError(f"{path}: {e.strerror or e}") from None
    libc = _libc()
    if is_mount_point(path):
        # emptied first: a copy of the mount another container still holds would keep the files
        for entry in os.listdir(path):
            target = os.path.join(path, entry)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(target)
        if libc.umount2(path.encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise MountError(f"detaching the tmpfs at {path}: {os.strerror(err)}")
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    options = f"size={size},mode=1777"
    if selinux_on():
        # MPS pods mount it: every file in it labelled for them, whoever makes it (a file takes
        # the level of the process that makes it, which for a container is its own categories)
        options += f',context="{CONTAINER_FILE}"'
    if libc.mount(b"dynpart-mps-shm", path.encode(), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        hint = " (the container must be privileged)" if err in (errno.EPERM, errno.EACCES) else ""
        raise MountError(f"mounting a tmpfs at {path}: {os.strerror(err)}{hint}")
    return size
