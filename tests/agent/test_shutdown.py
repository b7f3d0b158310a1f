"""The agent's way out (SIGTERM: a rollout, a node drain) ends well within the pod's grace period
(30 s in the chart): the pass running is cancelled after a short grace, publishing 0 for what the
plugin served still comes first, the later steps share one deadline, and a driver call stuck in a
thread does not keep the process from exiting."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from dynpart.agent.cli import Shutdown, _agent, _run_until_stopped
from dynpart.agent.driver.fake import FakeNvml, FakeOp

from .conftest import CATALOG, H100, make_rig, mig_spec

MIG1 = "nvidia.com/mig-1g.10gb"


async def test_sigterm_cancels_a_pass_stuck_in_a_driver_call_and_still_publishes_0():
    """A driver call that never returns (in its thread): on SIGTERM the pass is cancelled after
    the grace, without waiting for the thread, and the node's counts are withdrawn before the
    agent goes."""
    rig = make_rig(count=1).with_plugins()
    assert rig.plugins is not None
    agent = rig.agent(interval_s=60)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await agent.reconcile_once()
    assert [d.id for d in rig.plugins.advertised()[MIG1]]  # served: what the way out withdraws

    entered, release = threading.Event(), threading.Event()

    def hang(op: FakeOp) -> None:
        if op.op == "create_gi":
            entered.set()
            release.wait(30)  # an NVML call hung on a faulty GPU
    rig.driver.before_op = hang
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p2"))
    rig.events.clear()
    try:
        stopping = asyncio.create_task(_run_until_stopped(agent, Shutdown(total_s=5), pass_grace_s=0.3))
        await asyncio.wait_for(asyncio.to_thread(entered.wait, 5), 6)
        assert entered.is_set()
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stopping, 3)
        took = time.monotonic() - started
        assert took < 2.0, took  # the grace (0.3 s), not the stuck call
        assert ("status", {MIG1: 0}) in rig.events  # the scheduler binds no pod there any more
        assert not release.is_set()  # the driver call was not waited for
    finally:
        release.set()


async def test_a_pass_that_ends_within_the_grace_is_not_cancelled():
    rig = make_rig(count=1).with_plugins()
    agent = rig.agent(interval_s=60)
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0"]}, plan="p1"))
    await agent.reconcile_once()
    entered = threading.Event()

    def slow(op: FakeOp) -> None:
        if op.op == "create_gi":
            entered.set()
            time.sleep(0.3)
    rig.driver.before_op = slow
    rig.node_api.set_annotations(mig_spec({0: ["1g.10gb@0", "1g.10gb@1"]}, plan="p2"))
    stopping = asyncio.create_task(_run_until_stopped(agent, Shutdown(total_s=5), pass_grace_s=3))
    await asyncio.wait_for(asyncio.to_thread(entered.wait, 5), 6)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(stopping, 5)
    assert rig.driver.layout(0) == [("1g.10gb", 0), ("1g.10gb", 1)]  # the pass went on to its end


async def test_the_plugin_and_the_mps_daemon_stop_within_one_deadline(tmp_path, monkeypatch):
    """The steps after the loop (the device plugin, then the MPS daemon) get what is left of the
    deadline: a daemon whose `quit` hangs does not hold the agent past it."""
    from dynpart.agent.deviceplugin.server import DevicePluginManager
    from dynpart.agent.mps_daemon import ProcessMpsDaemon
    from dynpart.agent.podresources import FakePodResources
    from dynpart.settings import AgentSettings, load_settings

    order: list[str] = []
    real_close = DevicePluginManager.close

    async def close(self: DevicePluginManager) -> None:
        order.append("plugin")
        await real_close(self)

    async def hung_quit(self: ProcessMpsDaemon) -> None:
        order.append("daemon")
        await asyncio.sleep(60)
    monkeypatch.setattr(DevicePluginManager, "close", close)
    monkeypatch.setattr(ProcessMpsDaemon, "stop", hung_quit)
    settings = load_settings(AgentSettings, flags={"node_name": "n1", "device_plugin_dir": str(tmp_path / "dp")})
    shutdown = Shutdown(total_s=0.5, step_min_s=0.1)
    from kubernetes_asyncio import client

    api = client.ApiClient()
    try:
        async with contextlib.AsyncExitStack() as stack:
            agent = await _agent(argparse.Namespace(mps_capacity_gb=None), settings, api, FakeNvml(H100, 1),
                                 FakePodResources(), CATALOG, None, stack, shutdown)
            assert agent.plugins is not None
            shutdown.start()  # the signal
            started = time.monotonic()
        assert time.monotonic() - started < 2.0  # not the 60 s the hung `quit` would take
        assert shutdown.left() == 0 and not agent.plugins.servers
    finally:
        await api.close()
    assert order == ["plugin", "daemon"]  # the plugin stops listing MPS slices before the daemon goes


def test_the_process_exits_though_a_thread_is_stuck():
    """asyncio.run would wait for ever for the default executor's threads (Python 3.11), and the
    interpreter's exit would too: the agent's loop runner gives them a bound and exits."""
    code = textwrap.dedent("""\
        import asyncio, threading
        from dynpart.agent.cli import _run_loop

        async def main():
            asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # never returns
            await asyncio.sleep(0.05)
            return 3

        _run_loop(main(), threads_s=0.3)
        print("not reached")
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done.stderr
    assert "did not end in" in done.stderr
    assert "not reached" not in done.stdout
    assert time.monotonic() - started < 15


def test_the_loop_runner_returns_and_raises_as_asyncio_run():
    from dynpart.agent.cli import _run_loop
    from dynpart.errors import DynpartError

    async def ok() -> int:
        await asyncio.to_thread(time.sleep, 0.01)
        return 7

    async def fails() -> int:
        raise DynpartError("no")
    assert _run_loop(ok()) == 7
    try:
        _run_loop(fails())
    except DynpartError as e:
        assert str(e) == "no"
    else:
        raise AssertionError("not raised")


def test_the_process_exits_at_once_while_the_driver_thread_is_inside_a_call():
    """The driver's thread is a daemon nothing waits for, but a normal exit while it is inside
    libnvidia-ml would run the library's destructors beside the call (a hang until SIGKILL): the
    runner exits with os._exit instead (no atexit handler runs)."""
    code = textwrap.dedent("""\
        import asyncio, atexit, sys
        from dynpart.agent.cli import _run_loop
        from dynpart.agent.driver.fake import FakeNvml
        from dynpart.agent.driver.threaded import AsyncDriver
        from dynpart.catalog import default_catalog

        atexit.register(lambda: print("a normal exit"))

        async def main():
            fake = FakeNvml(default_catalog().resolve("H100-80GB"), 1)
            driver = AsyncDriver(fake, read_limit_s=0.1)
            fake.hang()  # a call that never returns
            try:
                await driver.devices()
            except Exception as e:
                print(type(e).__name__)
            return 5

        sys.exit(_run_loop(main(), threads_s=0.3))
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "DriverNotResponding" in done.stdout and "a normal exit" not in done.stdout
    assert "the driver call devices(), running in the driver's thread, did not end in 0.3 s" in done.stderr
    assert time.monotonic() - started < 15
