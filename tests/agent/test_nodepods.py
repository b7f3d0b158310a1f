"""Bound pods (what a pod requests, what unadmitted pods need, which slices stay), the slice
numbering of MPS slices, and the MPS control daemon's supervision with a stand-in binary."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import textwrap

import pytest

from dynpart.agent.mps_daemon import LOG_MAX_BYTES, MpsDaemonError, ProcessMpsDaemon
from dynpart.agent.mps_plugin import assign_slices
from dynpart.agent.nodepods import BoundPod, FakeNodePods, Need, init_only, requests_of, to_keep, waiting_for
from dynpart.agent.podresources import AssignedDevice

MIG = "nvidia.com/mig-1g.10gb"


def pod(containers, init=(), name="p"):
    return {"metadata": {"namespace": "ns", "name": name},
            "spec": {"containers": list(containers), "initContainers": list(init)}}


def c(requests=None, limits=None, restart=None):
    out = {"name": "c", "resources": {"requests": requests or {}, "limits": limits or {}}}
    if restart:
        out["restartPolicy"] = restart
    return out


def test_requests_of_counts_as_the_kubelet_does():
    assert requests_of(pod([c({MIG: "1", "cpu": "2"}), c(limits={MIG: 2})])) == {MIG: 3}  # limits alone count
    assert requests_of(pod([c({MIG: "1"})], init=[c({MIG: "4"})])) == {MIG: 4}  # an init container needs more
    assert requests_of(pod([c({MIG: "1"})], init=[c({MIG: "1"}, restart="Always")])) == {MIG: 2}  # a sidecar adds
    assert requests_of(pod([c({"cpu": "1", "example.com/x": "1"})])) == {}
    with pytest.raises(ValueError, match=r"pod ns/p nvidia.com/mig-1g.10gb: '1.5' is not a whole number"):
        requests_of(pod([c({MIG: "1.5"})]))
    with pytest.raises(ValueError, match=r"'lots' is not a whole number"):
        requests_of(pod([c({MIG: "lots"})]))


def test_requests_of_reads_every_form_the_api_server_writes_back():
    """The API server stores a quantity in canonical form: a pod asking for 1000 devices reads
    back "1k", and "2000m" or "1e3" are admitted as whole numbers too."""
    assert requests_of(pod([c({MIG: "1k"})])) == {MIG: 1000}
    assert requests_of(pod([c({MIG: "1e3"}), c(limits={MIG: "2000m"})])) == {MIG: 1002}


def test_waiting_for_counts_pods_not_yet_admitted():
    bound = [BoundPod("ns/a", {MIG: 1}), BoundPod("ns/b", {MIG: 2, "nvidia.com/gpu-10gb": 1}),
             BoundPod("ns/c", {MIG: 1}, phase="Succeeded")]
    admitted = [AssignedDevice("ns/b", "main", "nvidia.com/gpu-10gb", "GPU-1::0")]
    assert waiting_for(bound, admitted) == {MIG: Need(3, ("ns/a", "ns/b"))}
    admitted.append(AssignedDevice("ns/a", "main", MIG, "MIG-1"))
    assert waiting_for(bound, admitted) == {MIG: Need(2, ("ns/b",))}


def test_to_keep_keeps_only_what_is_short():
    free = {MIG: ["MIG-1", "MIG-2", "MIG-3"]}
    needs = {MIG: Need(2, ("ns/a",))}
    # destroying MIG-1 and MIG-2 would leave 1 free for 2 needed: the last candidate stays
    kept = to_keep({"MIG-1": MIG, "MIG-2": MIG}, free, needs)
    assert list(kept) == ["MIG-2"] and "ns/a" in kept["MIG-2"] and "need 2 nvidia.com/mig-1g.10gb, 1 other free" in kept["MIG-2"]
    assert to_keep({"MIG-1": MIG}, free, needs) == {}  # two others stay free
    assert list(to_keep({"MIG-1": MIG, "MIG-2": MIG, "MIG-3": MIG}, free, needs)) == ["MIG-2", "MIG-3"]
    assert to_keep({"MIG-1": MIG}, free, {"nvidia.com/gpu": Need(1, ("ns/x",))}) == {}


def test_a_device_a_starting_pods_init_container_may_hold_is_never_given_up():
    """The kubelet's PodResources List shows no plain init container's devices: while a pod whose
    init container asks for more of R than its containers starts, any free-looking R device may
    be the one it uses, so none goes."""
    starting = pod([c({"cpu": "1"})], init=[c({MIG: "1"})])
    assert init_only(starting) == {MIG}
    assert init_only(pod([c({MIG: "2"})], init=[c({MIG: "1"})])) == {MIG}
    assert init_only(pod([c({MIG: "1"})], init=[c({MIG: "1"}, restart="Always")])) == frozenset()  # a sidecar is listed
    # a plain init container after a sidecar runs beside it: both devices at once
    assert requests_of(pod([c({"cpu": "1"})], init=[c({MIG: "1"}, restart="Always"), c({MIG: "1"})])) == {MIG: 2}
    assert requests_of(pod([c({"cpu": "1"})], init=[c({MIG: "1"}), c({MIG: "1"}, restart="Always")])) == {MIG: 1}
    admitted = [AssignedDevice("ns/other", "main", MIG, "MIG-9")]
    bound = [BoundPod("ns/p", {MIG: 1}, "Pending", init_only(starting))]
    needs = waiting_for(bound, [*admitted, AssignedDevice("ns/p", "main", "nvidia.com/gpu-10gb", "GPU-1::0")])
    kept = to_keep({"MIG-1": MIG, "MIG-2": MIG}, {MIG: ["MIG-1", "MIG-2", "MIG-3"]}, needs)
    assert list(kept) == ["MIG-1", "MIG-2"] and "init container" in kept["MIG-1"] and "ns/p" in kept["MIG-1"]
    # once it runs, its init containers are done: it waits for nothing, but what its init container
    # got stays allocated to it, unlisted, until it ends
    assert waiting_for([BoundPod("ns/p", {MIG: 1}, "Running", init_only(starting))], admitted) == \
        {MIG: Need(0, (), (), ("ns/p",))}


async def test_fake_node_pods():
    pods = FakeNodePods()
    pods.bind("ns/a", {MIG: 1})
    pods.bind("ns/done", {MIG: 1}, phase="Failed")
    assert await pods.bound() == [BoundPod("ns/a", {MIG: 1})]


def test_assign_slices_keeps_numbers():
    # held slice 1 (10 GB) keeps its number; the 20 GB slice keeps 0; new ones take fresh numbers
    assert assign_slices([20, 10, 10], {1: 10}, {0: 20, 1: 10, 2: 10}) == {0: 20, 1: 10, 2: 10}
    assert assign_slices([40, 20, 10], {1: 10}, {0: 20, 1: 10, 2: 10}) == {0: 20, 1: 10, 3: 40}
    assert assign_slices([40, 40], {}, {}) == {0: 40, 1: 40}
    assert assign_slices([], {}, {0: 10}) == {}


# --- the MPS control daemon, with a stand-in for nvidia-cuda-mps-control -------------------------

FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # a stand-in for nvidia-cuda-mps-control: -d forks a daemon (a sleep) and records its pid and
    # environment; commands on stdin answer while that pid lives; quit kills it
    pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    if [ "$1" = "-d" ]; then
      [ -n "$FAIL" ] && { echo "cannot start: $FAIL"; exit 3; }
      if [ -n "$KEEP_OUTPUT" ]; then sleep 300 & else sleep 300 >/dev/null 2>&1 & fi  # a daemon may keep it
      echo $! > "$pidfile"
      echo "$CUDA_VISIBLE_DEVICES" >> "$CUDA_MPS_LOG_DIRECTORY/starts"
      exit 0
    fi
    read cmd
    [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null || exit 1
    grep -q '^State:.*Z' "/proc/$(cat "$pidfile")/status" 2>/dev/null && exit 1  # dead, not yet reaped
    if [ "$cmd" = "quit" ]; then kill "$(cat "$pidfile")"; rm -f "$pidfile"; fi
    echo 100
""")


def installed_control(tmp_path, script: str) -> str:
    """A stand-in `nvidia-cuda-mps-control`, executable."""
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def control(tmp_path):
    return installed_control(tmp_path, FAKE_CONTROL)


async def test_process_daemon_starts_restarts_and_stops(control, tmp_path):
    pipe, logs = str(tmp_path / "pipe"), str(tmp_path / "log")
    daemon = ProcessMpsDaemon(control, timeout_s=5)
    assert not await daemon.alive()
    # in NVML index order, the order the daemon numbers them for its clients (their memory limits)
    await daemon.ensure(["GPU-b", "GPU-a"], pipe, logs)
    assert await daemon.alive()
    await daemon.ensure(["GPU-b", "GPU-a"], pipe, logs)  # running for these GPUs: nothing to do
    starts = (tmp_path / "log" / "starts").read_text().split()
    assert starts == ["GPU-b,GPU-a"]
    # its logs are kept bounded while it runs, at each check (a pass every 10 s for weeks)
    (tmp_path / "log" / "server.log").write_bytes(b"s" * (LOG_MAX_BYTES + 1))
    await daemon.ensure(["GPU-b", "GPU-a"], pipe, logs)
    assert (tmp_path / "log" / "server.log").stat().st_size == 0
    assert (tmp_path / "log" / "server.log.1").stat().st_size == LOG_MAX_BYTES + 1
    pid = int((tmp_path / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    os.kill(pid, 9)  # it died
    for _ in range(50):
        if not await daemon.alive():
            break
    assert not await daemon.alive()
    await daemon.ensure(["GPU-b", "GPU-a"], pipe, logs)
    assert await daemon.alive() and daemon.restarts == 1
    await daemon.ensure(["GPU-a"], pipe, logs)  # its GPUs changed: stopped and started again
    assert (tmp_path / "log" / "starts").read_text().split() == ["GPU-b,GPU-a", "GPU-b,GPU-a", "GPU-a"]
    await daemon.stop()
    assert not await daemon.alive()


async def test_process_daemon_reports_why_it_cannot_run(control, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL", "no MPS on this GPU")
    with pytest.raises(MpsDaemonError, match="-d exited with 3: cannot start: no MPS on this GPU"):
        await ProcessMpsDaemon(control).ensure(["GPU-a"], str(tmp_path / "p"), str(tmp_path / "l"))
    with pytest.raises(MpsDaemonError, match="/nonexistent/nvidia-cuda-mps-control: No such file"):
        await ProcessMpsDaemon("/nonexistent/nvidia-cuda-mps-control").ensure(["GPU-a"], str(tmp_path / "p"),
                                                                            str(tmp_path / "l"))


async def test_a_daemon_that_keeps_the_output_open_starts_at_once(control, tmp_path, monkeypatch):
    """`-d` forks a daemon that may keep the command's output open: its start is not taken for a
    command that never answers (the output goes to a file, not a pipe read to its end)."""
    monkeypatch.setenv("KEEP_OUTPUT", "1")
    daemon = ProcessMpsDaemon(control, timeout_s=3)
    started = asyncio.get_running_loop().time()
    await daemon.ensure(["GPU-a"], str(tmp_path / "pipe"), str(tmp_path / "log"))
    assert await daemon.alive() and asyncio.get_running_loop().time() - started < 2
    await daemon.stop()


def test_the_daemons_logs_are_rotated_when_it_starts(tmp_path):
    from dynpart.agent.mps_daemon import rotate_logs

    (tmp_path / "control.log").write_bytes(b"x" * 100)
    (tmp_path / "server.log").write_bytes(b"y" * 10)
    (tmp_path / "control.log.1").write_bytes(b"old")
    rotate_logs(str(tmp_path), max_bytes=50)
    assert (tmp_path / "control.log.1").read_bytes() == b"x" * 100 and not (tmp_path / "control.log").exists()
    assert (tmp_path / "server.log").read_bytes() == b"y" * 10  # under the bound: kept
    rotate_logs(str(tmp_path / "absent"), max_bytes=50)  # nothing there: nothing to do


def test_the_running_daemons_logs_are_copied_and_emptied_past_the_bound(tmp_path):
    """While the daemon runs it keeps its logs open (appending): a log past the bound is copied to
    `<name>.1` and emptied, and the daemon's next line starts the file again."""
    from dynpart.agent.mps_daemon import rotate_logs

    log = tmp_path / "control.log"
    with open(log, "ab", buffering=0) as daemon:  # the daemon's own descriptor, O_APPEND
        daemon.write(b"x" * 100)
        rotate_logs(str(tmp_path), max_bytes=50, running=True)
        assert (tmp_path / "control.log.1").read_bytes() == b"x" * 100 and log.stat().st_size == 0
        daemon.write(b"next\n")
        assert log.read_bytes() == b"next\n"
        rotate_logs(str(tmp_path), max_bytes=50, running=True)  # under the bound again: kept
        assert log.read_bytes() == b"next\n" and (tmp_path / "control.log.1").read_bytes() == b"x" * 100
    assert not list(tmp_path.glob("*.tmp"))


def test_a_log_whose_writer_leaves_a_hole_counts_its_bytes_on_disk(tmp_path):
    """A writer that does not append writes its next line past the old end after the copy and
    truncation: the file's length then counts a hole, which is not rotated again and again, and
    what is copied starts at its first data."""
    from dynpart.agent.mps_daemon import rotate_logs

    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        f.seek(4 << 20)
        f.write(b"after the hole\n")
    if log.stat().st_blocks * 512 >= log.stat().st_size:
        pytest.skip("this file system keeps no holes")
    rotate_logs(str(tmp_path), max_bytes=1 << 20, running=True)
    assert log.stat().st_size > 4 << 20 and not (tmp_path / "server.log.1").exists()  # 4 MiB long, 4 KiB on disk
    with open(log, "r+b") as f:
        f.seek(8 << 20)
        f.write(b"y" * (2 << 20))
    rotate_logs(str(tmp_path), max_bytes=1 << 20, running=True)
    copied = (tmp_path / "server.log.1").read_bytes()
    assert copied.startswith(b"after the hole\n") and copied.endswith(b"y" * (2 << 20))
    assert len(copied) < (7 << 20) and log.stat().st_size == 0  # the second hole is copied, not the first


def test_a_log_that_cannot_be_copied_is_emptied_all_the_same(tmp_path, caplog):
    """On a full disk the copy fails: no partial copy is left, and the log is emptied anyway (else
    it would grow on a disk with no room left)."""
    import resource

    from dynpart.agent.mps_daemon import rotate_logs

    log = tmp_path / "server.log"
    log.write_bytes(b"s" * 5000)
    (tmp_path / "server.log.1").write_bytes(b"old")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        rotate_logs(str(tmp_path), max_bytes=100, running=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert log.stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.log"]
    assert "could not keep a copy" in caplog.text
