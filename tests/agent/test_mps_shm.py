"""`dynpart agent mps-shm` (agent/mps_shm.py): the MPS daemon's /dev/shm, a fresh tmpfs at a host
directory. The mounts are real where this process may mount (root with CAP_SYS_ADMIN, as the
chart's privileged init container), skipped elsewhere."""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import subprocess
import sys

import pytest

from dynpart.agent.mps_shm import FALLBACK_SIZE, MNT_DETACH, MountError, _libc, half_of_memory, is_mount_point, mount_tmpfs
from dynpart.agent.mps_supervisor import same_directory


def _can_mount(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    libc = _libc()
    if libc.mount(b"probe", str(probe).encode(), b"tmpfs", 0, b"size=1m") != 0:
        return False
    libc.umount2(str(probe).encode(), MNT_DETACH)
    return True


@pytest.fixture
def mounts(tmp_path):
    if not _can_mount(tmp_path):
        pytest.skip("this process may not mount (not root with CAP_SYS_ADMIN)")
    made: list[str] = []
    yield made
    libc = _libc()
    for path in reversed(made):
        while is_mount_point(path):
            if libc.umount2(path.encode(), MNT_DETACH) != 0:
                break


def _fstype(path: str) -> list[tuple[str, str]]:
    """(fstype, options) of each mount at `path`, oldest first."""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return [(p[2], p[3]) for p in (line.split() for line in f) if p[1] == real]


def test_half_of_memory_reads_meminfo_and_falls_back(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemFree:  100 kB\nMemTotal:       263849216 kB\n")
    assert half_of_memory(str(info)) == "131924608k"
    info.write_text("MemTotal: lots\n")
    assert half_of_memory(str(info)) == FALLBACK_SIZE
    assert half_of_memory(str(tmp_path / "absent")) == FALLBACK_SIZE
    assert half_of_memory().endswith("k")  # this machine's


def test_a_bad_size_is_refused_before_anything_is_mounted(tmp_path):
    for bad in ("", "0", "lots", "64 g", "-1g", "1.5g"):
        with pytest.raises(MountError, match="tmpfs size"):
            mount_tmpfs(str(tmp_path / "shm"), bad or "x")
    assert not (tmp_path / "shm").exists()


def test_a_fresh_tmpfs_each_time_world_writable_as_dev_shm(tmp_path, mounts):
    path = str(tmp_path / "state" / "mps-shm")
    mounts.append(path)
    assert mount_tmpfs(path, "8m") == "8m"
    assert is_mount_point(path)
    [(fstype, options)] = _fstype(path)
    assert fstype == "tmpfs" and "size=8192k" in options and {"nosuid", "nodev", "noexec"} <= set(options.split(","))
    mode = os.stat(path).st_mode
    assert stat.S_IMODE(mode) == 0o1777  # MPS servers run under their clients' user ids
    (tmp_path / "state" / "mps-shm" / "cuda.shm.0").write_text("the last daemon's")
    # the next mps-control pod: the last one's tmpfs detached, an empty one in its place
    os.makedirs(os.path.join(path, "sub"))
    with open(os.path.join(path, "cuda.shm.0")) as held:  # a client of the last daemon still maps it
        mount_tmpfs(path, "8m")
        assert os.listdir(path) == [] and held.read() == "the last daemon's"
        # the old tmpfs was emptied before it was detached (a copy of the mount held elsewhere
        # would keep its files' memory otherwise): its file lives on for the holder alone
        assert os.fstat(held.fileno()).st_nlink == 0
    assert len(_fstype(path)) == 1  # detached, not stacked


def test_the_supervisor_recognises_its_dev_shm_as_the_host_directory_mounted_there(tmp_path, mounts):
    """As in the chart: the tmpfs at <stateDir>/mps-shm, bind-mounted at mps-control's /dev/shm
    (a hostPath volume) and seen at its own path through the <stateDir> mount."""
    host = str(tmp_path / "mps-shm")
    dev_shm = str(tmp_path / "dev-shm")
    os.makedirs(dev_shm)
    mounts.extend([host, dev_shm])
    mount_tmpfs(host, "4m")
    libc = _libc()
    ms_bind = 4096
    assert libc.mount(host.encode(), dev_shm.encode(), None, ms_bind, None) == 0, os.strerror(ctypes.get_errno())
    assert same_directory(host, dev_shm)
    assert not same_directory(host, str(tmp_path)) and not same_directory(host, str(tmp_path / "absent"))
    # an empty directory under the tmpfs is not it either
    os.makedirs(os.path.join(host, "sub"))
    assert not same_directory(os.path.join(host, "sub"), dev_shm)


def test_the_command_reports_a_mount_it_may_not_make_in_one_line(tmp_path):
    """Not privileged (here: a bad size, or a path under a file): one line, exit status 2."""
    run = [sys.executable, "-c", "import sys; from dynpart.cli import main; sys.exit(main())", "agent", "mps-shm"]
    out = subprocess.run([*run, "--dir", str(tmp_path / "shm"), "--size", "lots"], capture_output=True, text=True)
    assert out.returncode == 2 and "tmpfs size 'lots'" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "file").write_text("")
    out = subprocess.run([*run, "--dir", str(tmp_path / "file" / "shm"), "--size", "1m"], capture_output=True, text=True)
    assert out.returncode == 2 and "Not a directory" in out.stderr and "Traceback" not in out.stderr
    with contextlib.suppress(FileNotFoundError):
        assert not is_mount_point(str(tmp_path / "file" / "shm"))


def test_the_tmpfs_is_labelled_for_containers_where_selinux_is_on(tmp_path, monkeypatch):
    """Mounted with context=container_file_t:s0: every file in it has that label, whichever
    process makes it (a label set on its root would pass on the type, not the level: a
    non-privileged daemon's files would carry its own categories, refused to other pods)."""
    from dynpart.agent import mps_shm, selinux

    calls = []

    class Libc:
        def mount(self, source, target, fstype, flags, data):
            calls.append(data.decode())
            return 0

        def umount2(self, target, flags):
            return 0
    monkeypatch.setattr(mps_shm, "_libc", Libc)
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "absent"))
    mount_tmpfs(str(tmp_path / "a"), "4m")
    (tmp_path / "selinuxfs").mkdir()  # a container's sysfs: the directory, no selinuxfs in it
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "selinuxfs"))
    mount_tmpfs(str(tmp_path / "b"), "4m")
    assert calls == ["size=4m,mode=1777", 'size=4m,mode=1777,context="system_u:object_r:container_file_t:s0"']
