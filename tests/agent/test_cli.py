"""`dynpart agent ...`: argument handling, the probe on a fake driver, NVML missing."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.driver.interface import NvmlUnavailable
from dynpart.agent.nvml_probe import probe
from dynpart.capability import decode_capability, node_model
from dynpart.cli import main

from .conftest import CATALOG, H100


def test_probe_fake_gpus_ok(capsys):
    assert main(["agent", "probe", "--fake-gpus", "H100-80GB:2"]) == 0
    out = capsys.readouterr().out
    assert "GPU 1: NVIDIA H100-80GB" in out and "3g.40gb      id  9" in out and "catalog matches the driver" in out
    assert "planned as H100-80GB, the catalog's" in out
    assert main(["agent", "probe", "--fake-gpus", "A30-24GB:1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["gpus"][0]["model"] == "A30-24GB"
    assert decode_capability(doc["capability"]).kinds[0].product == "NVIDIA A30-24GB"


def test_probe_and_agent_ignore_a30_instance_counts():
    """NVML reports wrong max counts on A30 (facts file section 1): not a mismatch, the catalog's count
    is planned with; a wrong GI profile id still is a mismatch."""
    a30 = CATALOG.resolve("A30-24GB")
    wrong = a30.model_copy(update={"mig_profiles": tuple(p.model_copy(update={"max": p.max + 3}) for p in a30.mig_profiles)})
    driver = FakeNvml(wrong, 1, name="NVIDIA A30")
    report = probe(driver, CATALOG)
    assert report.ok, report.mismatches
    assert node_model(decode_capability(report.capability), CATALOG).model is a30
    bad_id = a30.model_copy(update={"mig_profiles": (a30.mig_profiles[0].model_copy(update={"gi_profile_id": 99}),
                                                     *a30.mig_profiles[1:])})
    report = probe(FakeNvml(bad_id, 1, name="NVIDIA A30"), CATALOG)
    assert report.mismatches == ["1g.6gb: the driver reports GI profile id 99 (catalog 14); the driver's values are used"]


def test_probe_finds_catalog_mismatches():
    driver = FakeNvml(H100, 1)
    real = driver.possible_placements
    driver.possible_placements = lambda i, pid: real(i, pid)[:-1] if pid == 9 else real(i, pid)  # type: ignore[method-assign]  # the test perturbs one placement
    driver.create_gpu_instance(0, 0, 0, 8)
    report = probe(driver, CATALOG)
    assert not report.ok
    assert report.mismatches == ["3g.40gb: the driver reports starts [0] (catalog [0, 4]); the driver's values are used"]
    assert any("instance GI 0: 7g.80gb@0" in line for line in report.lines)


def test_probe_mig_off_and_unknown_model():
    # a driver that lists no profile while MIG mode is off: an unknown GPU cannot be described yet
    report = probe(FakeNvml(H100, 1, mig_enabled=False, name="NVIDIA Mystery", profiles_need_mig=True), CATALOG)
    assert not report.ok and "the catalog does not know this GPU" in report.mismatches[0]
    # one that lists them (as a real H200 on driver 580 does), or MIG mode on: described by the driver
    for mig in (False, True):
        report = probe(FakeNvml(H100, 1, mig_enabled=mig, name="NVIDIA Mystery"), CATALOG)
        assert report.ok and any(line.startswith("planned as Mystery~") and "not in the catalog" in line
                                 for line in report.lines), report.lines


def test_probe_mig_off_on_a_driver_that_lists_no_profile_uses_the_catalogs():
    report = probe(FakeNvml(H100, 2, mig_enabled=False, profiles_need_mig=True), CATALOG)
    assert report.ok and "  MIG mode is off and the driver lists no GPU-instance profile: the catalog's are used" \
        in report.lines
    report = probe(FakeNvml(H100, 2, mig_enabled=False), CATALOG)
    assert report.ok and not any("lists no GPU-instance profile" in line for line in report.lines)
    assert any(line.startswith("  7g.80gb ") for line in report.lines)


def test_bad_arguments(capsys):
    assert main(["agent", "probe", "--fake-gpus", "H100-80GB"]) == 2
    assert "expected MODEL:N" in capsys.readouterr().err
    assert main(["agent", "probe", "--fake-gpus", "Nope:1"]) == 2
    assert "unknown GPU model 'Nope'" in capsys.readouterr().err


def test_run_needs_a_node(capsys, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("DYNPART_AGENT_NODE_NAME", raising=False)
    assert main(["agent", "run"]) == 2
    assert "the node name is required" in capsys.readouterr().err


def test_probe_without_a_driver_is_one_clean_line(capsys):
    from dynpart.agent.driver.nvml import RealNvml

    try:
        RealNvml().close()
    except NvmlUnavailable:
        pass
    else:
        pytest.skip("this host has an NVIDIA driver")
    assert main(["agent", "probe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynpart: error: NVML not available: no NVIDIA driver on this host (pynvml:")
    assert "Traceback" not in err


async def test_two_agents_on_one_node_do_not_both_act(tmp_path):
    """The second agent waits on the node lock until the first one stops."""
    import asyncio

    from dynpart.agent.node_lock import node_lock

    path = tmp_path / "state" / "agent.lock"
    order: list[str] = []

    async def agent(name: str, hold_s: float) -> None:
        async with node_lock(path, retry_s=0.05):
            order.append(f"{name} in")
            await asyncio.sleep(hold_s)
            order.append(f"{name} out")

    first = asyncio.create_task(agent("a", 0.3))
    await asyncio.sleep(0.05)
    await asyncio.gather(first, agent("b", 0.0))
    assert order == ["a in", "a out", "b in", "b out"]


def test_device_plugin_setting_is_checked():
    from dynpart.errors import DynpartError
    from dynpart.settings import AgentSettings, load_settings

    with pytest.raises(DynpartError, match=r"setting device_plugin = 'nebuly': .*'builtin' or 'nvidia'.*command-line flag"):
        load_settings(AgentSettings, flags={"device_plugin": "nebuly"})


async def test_the_agent_is_built_for_its_device_plugin(tmp_path):
    """Both modes: a served plugin manager (MPS nodes are always served by it), the MPS daemon, the
    bound-pod source; nvidia: also the restarts of NVIDIA's plugin pod (MIG nodes)."""
    import argparse
    import contextlib

    from kubernetes_asyncio import client

    from dynpart.agent.cli import _agent
    from dynpart.agent.kube import KubePluginPods
    from dynpart.agent.mps_daemon import ProcessMpsDaemon
    from dynpart.agent.nodepods import KubeNodePods
    from dynpart.agent.podresources import FakePodResources
    from dynpart.catalog import default_catalog
    from dynpart.settings import AgentSettings, load_settings

    args = argparse.Namespace(mps_capacity_gb=None)
    catalog = default_catalog()
    api = client.ApiClient()
    try:
        for mode in ("builtin", "nvidia"):
            settings = load_settings(AgentSettings, flags={"node_name": "n1", "device_plugin": mode,
                                                           "device_plugin_dir": str(tmp_path / "dp")})
            pods = FakePodResources()
            async with contextlib.AsyncExitStack() as stack:
                agent = await _agent(args, settings, api, FakeNvml(catalog.resolve("H100-80GB"), 1), pods, catalog,
                                     None, stack)
                assert isinstance(agent.node_pods, KubeNodePods) and agent.node_pods.node == "n1"
                assert agent.plugins is not None and agent.plugins.plugin_dir == str(tmp_path / "dp")
                assert agent.plugins.allocate.pipe_dir_host == "/var/lib/dynpart/mps" and agent.plugins.held is not None
                assert isinstance(agent.mps_daemon, ProcessMpsDaemon)
                assert pods.on_allocatable is not None  # fake GPUs without a kubelet
                if mode == "builtin":
                    assert agent.plugin_pods is None
                else:
                    assert isinstance(agent.plugin_pods, KubePluginPods)
                    assert (agent.plugin_pods.namespace, agent.plugin_pods.selector) == (
                        "gpu-operator", "app=nvidia-device-plugin-daemonset")
    finally:
        await api.close()


async def test_the_agent_waits_for_the_driver_at_start(monkeypatch, caplog):
    """After a reboot the driver may still be loading: the agent waits (and says so) rather than
    exiting into CrashLoopBackOff; it gives up after the wait."""
    from dynpart.agent import cli as agent_cli

    tries = []
    driver = FakeNvml(H100, 1)

    def real_driver():  # type: ignore[no-untyped-def]
        tries.append(1)
        if len(tries) < 3:
            raise NvmlUnavailable("NVML not available: no NVIDIA driver on this host (pynvml: Driver Not Loaded)")
        return driver
    monkeypatch.setattr(agent_cli, "_real_driver", real_driver)
    assert (await agent_cli._wait_for_driver(wait_s=10, first_s=0.01)).sync is driver and len(tries) == 3
    assert "NVML is not available yet" in caplog.text

    def no_driver():  # type: ignore[no-untyped-def]
        raise NvmlUnavailable("no driver")
    monkeypatch.setattr(agent_cli, "_real_driver", no_driver)
    with pytest.raises(NvmlUnavailable, match="no driver"):
        await agent_cli._wait_for_driver(wait_s=0.05, first_s=0.01)



async def test_a_driver_that_does_not_answer_nvml_init_does_not_block_the_start(monkeypatch, caplog):
    """nvmlInit on a wedged driver may never return: it runs on the driver's thread, so the event
    loop (/healthz, the log) goes on; each try says so, no second nvmlInit is made beside the one
    still inside the library, and after the wait the start gives up (the agent exits)."""
    from dynpart.agent import cli as agent_cli
    from dynpart.agent.driver.interface import DriverNotResponding

    release = threading.Event()
    tries = []

    def wedged():  # type: ignore[no-untyped-def]
        tries.append(1)
        release.wait(3)
        return FakeNvml(H100, 1)
    monkeypatch.setattr(agent_cli, "_real_driver", wedged)
    turns = 0

    async def turning() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0.01)
    ticker = asyncio.create_task(turning())
    try:
        started = time.monotonic()
        with pytest.raises(DriverNotResponding, match=r"nvmlInit\(\)"):
            await agent_cli._wait_for_driver(wait_s=0.6, first_s=0.05, start_limit_s=0.2)
        assert time.monotonic() - started < 2 and turns > 20  # the loop turned all along
    finally:
        ticker.cancel()
        release.set()
    assert len(tries) == 1  # the later tries failed at once: nvmlInit was still running
    assert "did not answer nvmlInit() within 0.2 s" in caplog.text
    assert "has not answered nvmlInit()" in caplog.text  # (each later try, in the waiting log)


async def test_an_nvml_init_that_returns_late_is_taken_not_made_again(monkeypatch):
    """NVML counts its inits: a second one beside a late first would leave the re-initialisation
    after a lost GPU (shutdown, init) without effect. The late one's driver is taken."""
    from dynpart.agent import cli as agent_cli

    release = threading.Event()
    made = []

    def slow():  # type: ignore[no-untyped-def]
        made.append(FakeNvml(H100, 1))
        release.wait(3)
        return made[-1]
    monkeypatch.setattr(agent_cli, "_real_driver", slow)
    threading.Timer(0.4, release.set).start()  # answers after the first try gave up
    driver = await agent_cli._wait_for_driver(wait_s=5, first_s=0.3, start_limit_s=0.2)
    assert len(made) == 1 and driver.sync is made[0]


async def test_liveness_watches_the_event_loop_from_the_start(monkeypatch):
    """Before the first pass (waiting for NVML, the API server, the node lock) /healthz already
    fails if the event loop is blocked: nothing is served yet, so a restart then loses nothing."""
    import argparse

    from dynpart.agent import cli as agent_cli
    from dynpart.settings import AgentSettings, load_settings

    seen: dict[str, object] = {}

    async def started(args, settings, catalog, liveness):  # type: ignore[no-untyped-def]
        seen["at start"] = liveness.stale()
        await asyncio.sleep(0.05)
        liveness._clock = lambda: time.monotonic() + 21  # 21 s later, had the loop not turned
        seen["blocked"] = liveness.stale()
        return 0
    monkeypatch.setattr(agent_cli, "_run_started", started)
    settings = load_settings(AgentSettings, flags={"node_name": "n1", "metrics_port": 0})
    assert await agent_cli._run(argparse.Namespace(once=False), settings) == 0
    assert seen["at start"] == [] and [s.split(":")[0] for s in seen["blocked"]] == ["event loop"]  # type: ignore[attr-defined]


def test_the_agent_process_is_not_dumpable(tmp_path):
    """Same-uid processes in the host's PID namespace (mps-control) cannot open the agent's
    /proc/<pid>/root or mem, where its API token is: run in a child, which the prctl marks."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import ctypes, ctypes.util
        import dynpart.agent.cli as cli
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        print("before", libc.prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
        def seen(main):
            main.close()
            print("running", libc.prctl(3, 0, 0, 0, 0))
            return 0
        cli._run_loop = seen
        from dynpart.cli import main
        raise SystemExit(main(["agent", "run", "--node", "n1"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before", "1", "running", "0"]


@pytest.mark.parametrize("command", ["mps-control", "mps-shm"])
def test_a_directory_option_naming_a_file_says_so(command, tmp_path, capsys):
    """It said "File exists" (helper-148)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["agent", command, "--dir", str(afile)]) == 2
    assert capsys.readouterr().err.strip() == f"dynpart: error: --dir {afile}: not a directory"
