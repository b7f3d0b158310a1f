"""SELinux labels of the host directories MPS clients use (the MPS pipe directory, the daemon's
/dev/shm): on a host where SELinux is on, a container's processes (`container_t`) may use only
files labelled for containers, so these get `container_file_t` with no category, which every
container may use (what a `:z` volume gets), as NVIDIA's mps-control-daemon labels its pipe
directory (`unprivilegedContainerSELinuxLabel`). Nothing is done where SELinux is off.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("dynpart.agent.mps")

CONTAINER_FILE = "system_u:object_r:container_file_t:s0"
SELINUXFS = "/sys/fs/selinux"
XATTR = "security.selinux"


def selinux_on(selinuxfs: str | None = None) -> bool:
    """The kernel makes /sys/fs/selinux only when SELinux is on; a container's sysfs has the
    directory but not selinuxfs mounted on it (so no `enforce` there): the directory is the sign,
    as NVIDIA's plugin takes it."""
    return os.path.isdir(selinuxfs or SELINUXFS)


def label_for_containers(path: str, selinuxfs: str | None = None, label: str = CONTAINER_FILE) -> str | None:
    """Label `path` and what is in it for containers where SELinux is on. Returns what went wrong
    (logged too), or None: done, or nothing to do. Never raises: on a host whose policy is
    permissive, or where this container may not relabel, the daemon runs all the same."""
    if not selinux_on(selinuxfs):
        return None
    value = label.encode()
    try:
        for root, dirs, files in os.walk(path):
            for name in (root, *(os.path.join(root, n) for n in (*dirs, *files))):
                os.setxattr(name, XATTR, value, follow_symlinks=False)
    except OSError as e:
        problem = (f"labelling {path} {label} for SELinux: {e.strerror or e}: MPS pods may be refused its files "
                   "where SELinux enforces")
        log.warning("%s", problem)
        return problem
    return None
