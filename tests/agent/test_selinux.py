"""SELinux labels of the MPS directories clients mount (agent/selinux.py): set where SELinux is on
(/sys/fs/selinux exists; here a stand-in directory), on the directory and what is in it, and
nothing where it is off. The labels are real extended attributes (root can set security.* ones
without SELinux loaded); skipped where this process may not."""

from __future__ import annotations

import os

import pytest

from dynpart.agent import selinux
from dynpart.agent.mps_daemon import ProcessMpsDaemon
from dynpart.agent.selinux import CONTAINER_FILE, XATTR, label_for_containers
from tests.agent.test_mps_daemon_busy import FAKE_CONTROL
from tests.agent.test_nodepods import installed_control


def _label(path) -> bytes | None:
    try:
        return os.getxattr(str(path), XATTR, follow_symlinks=False)
    except OSError:
        return None


@pytest.fixture
def selinuxfs(tmp_path, monkeypatch):
    probe = tmp_path / "probe"
    probe.write_text("")
    try:
        os.setxattr(str(probe), XATTR, b"probe")
    except OSError:
        pytest.skip("this process may not set security.* extended attributes")
    fs = tmp_path / "selinuxfs"
    fs.mkdir()  # as a container sees it: the directory, selinuxfs not mounted there (no `enforce`)
    monkeypatch.setattr(selinux, "SELINUXFS", str(fs))
    return fs


def test_off_nothing_is_labelled(tmp_path, monkeypatch):
    monkeypatch.setattr(selinux, "SELINUXFS", str(tmp_path / "absent"))
    (tmp_path / "pipes").mkdir()
    assert label_for_containers(str(tmp_path / "pipes")) is None and _label(tmp_path / "pipes") is None


def test_on_the_directory_and_everything_in_it_get_the_containers_label(tmp_path, selinuxfs):
    d = tmp_path / "pipes"
    (d / "sub").mkdir(parents=True)
    (d / "control").write_text("")
    (d / "sub" / "log").write_text("")
    outside = tmp_path / "outside"
    outside.write_text("")
    (d / "link").symlink_to(outside)
    assert label_for_containers(str(d)) is None
    for p in (d, d / "sub", d / "control", d / "sub" / "log", d / "link"):
        assert _label(p) == CONTAINER_FILE.encode(), p
    assert _label(outside) is None  # a link's target is not followed


def test_a_label_that_cannot_be_set_is_said_and_nothing_raised(tmp_path, selinuxfs, caplog):
    missing = tmp_path / "gone"
    problem = label_for_containers(str(missing / "x"))  # (os.walk of a missing path: nothing to label)
    assert problem is None
    d = tmp_path / "pipes"
    d.mkdir()

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    import unittest.mock
    with unittest.mock.patch.object(os, "setxattr", refuse):
        problem = label_for_containers(str(d))
    assert problem is not None and "Operation not permitted" in problem and "SELinux enforces" in problem
    assert problem in caplog.text


async def test_the_daemons_pipe_directory_is_labelled_before_it_starts(tmp_path, selinuxfs):
    """The MPS clients, other pods, mount the pipe directory; the daemon's pipes made in it take
    its label (NVIDIA's mps-control-daemon labels its pipe directory so)."""
    control = installed_control(tmp_path, FAKE_CONTROL)
    daemon = ProcessMpsDaemon(control, timeout_s=5)
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    try:
        await daemon.ensure(["GPU-a"], str(pipe), str(logs))
        assert _label(pipe) == CONTAINER_FILE.encode()
        assert _label(logs) is None  # clients do not mount the log directory
    finally:
        await daemon.stop()
