"""`dynpart agent run|probe`: the node agent and its read-only NVML check."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynpart.catalog import Catalog, load_catalog
from dynpart.errors import DynpartError

if TYPE_CHECKING:
    from dynpart.agent.driver.interface import GpuDriver
    from dynpart.agent.driver.threaded import AsyncDriver
    from dynpart.agent.loop import Agent
    from dynpart.agent.nvml_probe import ProbeReport
    from dynpart.agent.podresources import PodResources
    from dynpart.settings import AgentSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="node agent: apply the planner's GPU layout on this node",
                       description="The dynpart node agent (see docs/agent.md).")
    cmds = p.add_subparsers(dest="agent_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    run = cmds.add_parser("run", help="run the agent loop for one node",
                          description="Watch this node's dynpart.io/spec-* annotations, apply them to the GPUs "
                                      "(MIG through NVML, served by the agent's own device plugin or, with "
                                      "--device-plugin nvidia, by NVIDIA's; MPS slices always by the agent's own) "
                                      "and report "
                                      "dynpart.io/status-* annotations. Settings come from --config, then "
                                      "DYNPART_AGENT_* environment variables, then these flags "
                                      "(docs/configuration.md).")
    run.add_argument("--config", help="YAML file of settings")
    run.add_argument("--node", dest="node_name", help="this node's name (default: $DYNPART_AGENT_NODE_NAME, $NODE_NAME)")
    run.add_argument("--fake-gpus", metavar="MODEL:N",
                     help="use N fake GPUs of a catalog MODEL instead of NVML (tests, demos)")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    run.add_argument("--report-interval-s", "--interval", dest="report_interval_s", type=float, metavar="S",
                     help="seconds between passes when nothing changes (default 10)")
    run.add_argument("--pod-resources-socket", metavar="PATH",
                     help="kubelet PodResources socket (with --fake-gpus and no socket there: no pod holds a device)")
    run.add_argument("--capacity-gb", dest="mps_capacity_gb", type=int, metavar="GB",
                     help="MPS capacity of one GPU in GB (default: the memory NVML reports, in GiB; "
                     "it can only lower it)")
    run.add_argument("--device-plugin", choices=["builtin", "nvidia"],
                     help="builtin: the agent advertises the slices itself (default); nvidia: NVIDIA's device plugin "
                          "on MIG nodes (MPS nodes are always served by the agent's own)")
    run.add_argument("--device-plugin-dir", metavar="DIR", help="the kubelet's device-plugin directory")
    run.add_argument("--metrics-port", type=int)
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument("--log-json", action="store_true", default=None)
    run.add_argument("--once", action="store_true", help="one pass, print the status annotations, exit")
    run.set_defaults(func=run_agent)

    probe = cmds.add_parser("probe", help="read-only NVML check of the GPUs against the catalog",
                            description="Print devices, MIG mode, GI profile ids and possible placements as the "
                                        "driver reports them, and compare them with the catalog. Changes nothing.")
    probe.add_argument("--fake-gpus", metavar="MODEL:N", help=argparse.SUPPRESS)
    probe.add_argument("--json", action="store_true", help="print JSON")
    probe.add_argument("--record", metavar="FILE",
                       help="also make every other read the agent makes, and write each NVML call with the "
                            "driver's answer to FILE (read-only: any other NVML call is refused); "
                            "attach it to a bug report")
    probe.add_argument("--replay", metavar="FILE",
                       help="run the probe and those reads on a recording made with --record instead of the driver")
    probe.set_defaults(func=run_probe)

    mps = cmds.add_parser("mps-control", help="run the MPS control daemon as the agent asks (the Helm chart's "
                          "mps-control DaemonSet)",
                          description="Supervise nvidia-cuda-mps-control as the agent asks through DIR "
                                      "(the agent's mps_control_dir, a host directory both mount): start it, "
                                      "start it again if it dies, stop it when no GPU wants it; report what runs in "
                                      "DIR/state.json. Run in a pod of its own, the daemon outlives restarts and "
                                      "replacements of the agent; it is told to quit when this command ends "
                                      "(SIGTERM) (docs/agent.md, MPS).")
    mps.add_argument("--dir", dest="control_dir", default="/var/lib/dynpart/mps-control", metavar="DIR",
                     help="the directory shared with the agent (default /var/lib/dynpart/mps-control, the chart's)")
    mps.add_argument("--shm-dir", metavar="HOSTDIR",
                     help="the host directory mounted at this container's /dev/shm (the chart's <stateDir>/mps-shm, "
                          "also mounted at its path): the daemon's shared memory, which the agent's device plugin "
                          "mounts at its clients' /dev/shm, so that they need no hostIPC; reported to the agent only "
                          "when it is that mount")
    mps.add_argument("--mps-control-binary", metavar="PATH", help=argparse.SUPPRESS)  # tests
    mps.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")
    mps.add_argument("--log-json", action="store_true")
    mps.set_defaults(func=run_mps_control)

    shm = cmds.add_parser("mps-shm", help="mount a fresh tmpfs for the MPS daemon's shared memory (the chart's "
                          "mps-control init container)",
                          description="Mount a fresh tmpfs at HOSTDIR (one mounted there already is emptied and "
                                      "detached first), mode 1777: the MPS control daemon's /dev/shm, which MPS pods are given "
                                      "at theirs instead of the host's IPC namespace. Needs CAP_SYS_ADMIN, and the "
                                      "directory mounted Bidirectional for the host to see it (docs/agent.md, MPS).")
    shm.add_argument("--dir", dest="shm_dir", required=True, metavar="HOSTDIR")
    shm.add_argument("--size", default="", help="tmpfs size, e.g. 64g or 50%% (default: half the node's memory, "
                                                "as /dev/shm)")
    shm.set_defaults(func=run_mps_shm)


def _fake_driver(spec: str, catalog: Catalog) -> GpuDriver:
    from dynpart.agent.driver.fake import FakeNvml

    model_name, _, count = spec.rpartition(":")
    if not model_name or not count.isdigit() or int(count) < 1:
        raise DynpartError(f"fake_gpus {spec!r} (--fake-gpus, DYNPART_AGENT_FAKE_GPUS or the config file): expected "
                           "MODEL:N, e.g. H100-80GB:2")
    return FakeNvml(catalog.resolve(model_name, where="--fake-gpus"), int(count))


def _real_driver() -> GpuDriver:
    from dynpart.agent.driver.nvml import RealNvml

    return RealNvml()


# how long `agent run` waits for the NVIDIA driver at start: after a reboot GPU Operator's driver
# container may still be building and loading it (minutes); exiting at once would put the agent
# in CrashLoopBackOff, whose back-off (up to 5 minutes) adds to the wait
DRIVER_WAIT_S = 900.0


async def _wait_for_driver(wait_s: float = DRIVER_WAIT_S, first_s: float = 2.0,
                           start_limit_s: float | None = None) -> AsyncDriver:
    """The host's driver, once NVML can be started (retried with back-off up to `wait_s`).
    nvmlInit runs on the driver's thread, never on the event loop: a wedged driver that does not
    answer it leaves the log saying so (each try, `start_limit_s` and after), /healthz answered
    and, after `wait_s`, the agent exiting (DriverNotResponding) for the kubelet to start it again:
    nothing is served yet at start, so a restart loses nothing. A try while that nvmlInit is still
    inside the library fails at once instead of calling it a second time beside it."""
    import logging

    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

    from dynpart.agent.driver.interface import DriverNotResponding, NvmlUnavailable
    from dynpart.agent.driver.threaded import START_LIMIT_S, AsyncDriver

    log = logging.getLogger("dynpart.agent")

    def waiting(state: Any) -> None:
        log.warning("NVML is not available yet (%s); trying again in %.0f s", state.outcome.exception(),
                    state.next_action.sleep if state.next_action else 0)

    driver = AsyncDriver()
    async for attempt in AsyncRetrying(retry=retry_if_exception_type((NvmlUnavailable, DriverNotResponding)),
                                       wait=wait_exponential(multiplier=first_s, max=30),
                                       stop=stop_after_delay(wait_s), reraise=True, before_sleep=waiting):
        with attempt:
            await driver.start(_real_driver, START_LIMIT_S if start_limit_s is None else start_limit_s)
            return driver
    raise AssertionError("unreachable")  # pragma: no cover


def _driver(args: argparse.Namespace, catalog: Catalog) -> GpuDriver:
    return _fake_driver(args.fake_gpus, catalog) if args.fake_gpus else _real_driver()


def run_probe(args: argparse.Namespace) -> int:
    from dynpart.agent.nvml_probe import probe, read_paths

    catalog = load_catalog(args.catalog)
    if sum(bool(x) for x in (args.fake_gpus, args.record, args.replay)) > 1:
        raise DynpartError("--fake-gpus, --record and --replay exclude each other")
    reads: list[str] | None = None
    if args.record:
        from dynpart.agent.driver.nvml_recording import record_nvml

        target = Path(args.record)
        if not target.parent.is_dir():
            raise DynpartError(f"--record {args.record}: no such directory {str(target.parent)!r}")
        with record_nvml() as (driver, recording):
            report = probe(driver, catalog)
            reads = read_paths(driver, catalog)
        recording.meta.update(_recording_meta(report, reads))
        recording.save(target)
    elif args.replay:
        from dynpart.agent.driver.nvml_recording import RecordedNvml

        replayed = RecordedNvml(args.replay)
        try:
            report = probe(replayed, catalog)
            reads = read_paths(replayed, catalog)
        finally:
            replayed.close()
    else:
        report = probe(_driver(args, catalog), catalog)
    _print_probe(report, reads, args.json)
    return 0 if report.ok else 1


def run_mps_control(args: argparse.Namespace) -> int:
    from dynpart.agent.mps_supervisor import serve
    from dynpart.logs import setup_logging

    setup_logging(args.log_level, args.log_json)
    _directory_or_absent("--dir", args.control_dir)
    return asyncio.run(serve(args.control_dir, binary=args.mps_control_binary, shm_dir=args.shm_dir))


def _directory_or_absent(option: str, path: str) -> None:
    """A directory the command makes if absent: a file there is named as such (else "File exists")."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DynpartError(f"{option} {path}: not a directory")


def run_mps_shm(args: argparse.Namespace) -> int:
    from dynpart.agent.mps_shm import mount_tmpfs

    _directory_or_absent("--dir", args.shm_dir)
    size = mount_tmpfs(args.shm_dir, args.size or None)
    print(f"tmpfs of {size} mounted at {args.shm_dir}")
    return 0


def _recording_meta(report: ProbeReport, reads: list[str]) -> dict[str, Any]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from dynpart import __version__

    try:
        binding = version("nvidia-ml-py")
    except PackageNotFoundError:
        binding = "unknown"
    return {"dynpart": __version__, "nvidia-ml-py": binding, "python": platform.python_version(),
            "versions": report.versions, "probe": report.lines, "mismatches": report.mismatches, "reads": reads}


def _print_probe(report: ProbeReport, reads: list[str] | None, as_json: bool) -> None:
    if as_json:
        out: dict[str, Any] = {"ok": report.ok, "versions": report.versions, "mismatches": report.mismatches,
                               "gpus": report.gpus, "capability": report.capability}
        if reads is not None:
            out["reads"] = reads
        print(json.dumps(out, indent=2))
        return
    print("\n".join(report.lines))
    for m in report.mismatches:
        print(f"MISMATCH: {m}")
    print("catalog matches the driver" if report.ok else f"{len(report.mismatches)} mismatch(es)")
    if reads is not None:
        print("reads:")
        print("\n".join(f"  {line}" for line in reads))


_SETTINGS = ("kubeconfig", "node_name", "report_interval_s", "pod_resources_socket", "fake_gpus", "metrics_port",
             "log_level", "log_json", "device_plugin", "device_plugin_dir", "mps_capacity_gb")


def run_agent(args: argparse.Namespace) -> int:
    from dynpart.logs import setup_logging
    from dynpart.settings import AgentSettings, load_settings

    flags = {k: getattr(args, k, None) for k in _SETTINGS}
    if args.catalog:
        flags["catalog_files"] = args.catalog
    if not flags["node_name"] and not os.environ.get("DYNPART_AGENT_NODE_NAME"):
        flags["node_name"] = os.environ.get("NODE_NAME")
    settings = load_settings(AgentSettings, args.config, flags)
    if not settings.node_name:
        raise DynpartError("the node name is required: --node, DYNPART_AGENT_NODE_NAME or NODE_NAME")
    setup_logging(settings.log_level, settings.log_json)
    _not_dumpable()
    return _run_loop(_run(args, settings))


PR_SET_DUMPABLE = 4


def _not_dumpable() -> bool:
    """Mark the agent's process not dumpable (prctl PR_SET_DUMPABLE 0), as OpenSSH's daemon does
    for its secrets. The agent runs in the host's PID namespace beside the mps-control pods, which
    run as root too: for the kernel's ptrace rules a same-uid process may open the agent's
    `/proc/<pid>/root`, `environ` and `mem`, and read its API token there. A process that is not
    dumpable is open to those only with CAP_SYS_PTRACE (which an unprivileged mps-control lacks;
    a privileged one has every capability). No core dump either. False where it cannot be set."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
            return True
        _log.warning("the agent stays dumpable: prctl(PR_SET_DUMPABLE, 0) failed: %s",
                     os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:  # not Linux, or no prctl in this libc
        _log.warning("the agent stays dumpable: %s", e)
    return False


# The way out. The kubelet SIGKILLs the agent terminationGracePeriodSeconds (30 s in the chart)
# after SIGTERM; killed, it would not publish 0 for what its plugin served (docs/agent.md). The pass
# running at SIGTERM may end within loop.PASS_GRACE_S, else it is cancelled (Agent.run). From SIGTERM
# everything (the pass, publishing 0, the device plugin, the MPS daemon) has SHUTDOWN_S, then the
# threads still running get THREADS_S.
SHUTDOWN_S = 20.0
THREADS_S = 2.0
STEP_MIN_S = 0.5  # what each step of the way out gets even past the deadline (the sum stays bounded)

_log = logging.getLogger("dynpart.agent")


class Shutdown:
    """One deadline for the whole way out: it starts at the signal (or when the loop ends without
    one: an error, DriverReplaced), and each step gets what is left of it."""

    def __init__(self, total_s: float = SHUTDOWN_S, step_min_s: float = STEP_MIN_S):
        self.total_s = total_s
        self.step_min_s = step_min_s
        self.at: float | None = None

    def start(self) -> None:
        if self.at is None:
            self.at = time.monotonic() + self.total_s

    def left(self) -> float:
        self.start()
        assert self.at is not None
        return max(0.0, self.at - time.monotonic())

    async def step(self, what: str, fn: Callable[[], Awaitable[object]]) -> None:
        """`fn()` within what is left of the deadline; past it, or failing, it is given up (logged):
        the steps after it still run."""
        try:
            async with asyncio.timeout(max(self.left(), self.step_min_s)):
                await fn()
        except TimeoutError:
            _log.warning("stopping: %s did not end in time; going on without it", what)
        except Exception as e:  # the next steps still run
            _log.warning("stopping: %s failed: %s", what, e)


async def _run_until_stopped(agent: Agent, shutdown: Shutdown, pass_grace_s: float | None = None) -> None:
    """`agent.run()` until SIGTERM or SIGINT: the pass running then gets `pass_grace_s`, then is
    cancelled (Agent.run); the loop's own way out after it (first publishing 0 for what the plugin
    served) gets what is left of `shutdown`'s deadline, and is cancelled past it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from dynpart.agent.loop import PASS_GRACE_S

    running = asyncio.create_task(agent.run(stop, PASS_GRACE_S if pass_grace_s is None else pass_grace_s),
                                  name="agent loop")
    signalled = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({running, signalled}, return_when=asyncio.FIRST_COMPLETED)
        shutdown.start()
        if not running.done():
            await asyncio.wait({running}, timeout=max(shutdown.left(), shutdown.step_min_s))
        if not running.done():
            _log.warning("stopping: the agent loop did not end in time; cancelling it")
    finally:
        signalled.cancel()
        if not running.done():  # past the deadline, or this coroutine was cancelled
            running.cancel()
    error = running.exception() if running.done() and not running.cancelled() else None
    if error is not None:  # e.g. DriverReplaced
        raise error


def _run_loop(main: Coroutine[Any, Any, int], threads_s: float = THREADS_S) -> int:
    """`asyncio.run(main)`, except at the end. asyncio.run (Python 3.11) waits without limit for
    the default executor's threads, and so does the interpreter's exit (concurrent.futures joins
    them); the driver's thread (`AsyncDriver`: every NVML call, nvmlInit included) is a daemon
    thread nothing waits for, but a normal exit while it is inside libnvidia-ml would run the
    library's C destructors beside that call, which may hang until SIGKILL. Here the tasks left get
    `threads_s`, then the executor's threads and the driver calls still running share another
    `threads_s`; if one is still running then, the process ends with os._exit once the logs are
    flushed: everything else is stopped by then, and os._exit is the only way past a thread stuck in
    a C call."""
    executor = ThreadPoolExecutor(thread_name_prefix="dynpart-agent")
    loop = asyncio.new_event_loop()
    loop.set_default_executor(executor)
    code, error = 1, None
    try:
        asyncio.set_event_loop(loop)
        code = loop.run_until_complete(main)
    except BaseException as e:  # raised again below, unless a thread is stuck
        error = e
    finally:
        try:
            _cancel_left(loop, threads_s)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
    deadline = time.monotonic() + threads_s
    stuck = [] if _threads_end(executor, threads_s) else ["a call running in a thread of the default executor"]
    stuck += _driver_calls_end(max(0.0, deadline - time.monotonic()))
    if stuck:
        if error is not None:
            _log.error("stopping: %s", error, exc_info=error)
            code = 2 if isinstance(error, DynpartError) else 1
        _log.error("stopping: %s did not end in %.1f s; exiting without it", ", ".join(stuck), threads_s)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if error is not None:
        raise error
    return code


def _driver_calls_end(wait_s: float) -> list[str]:
    """The driver calls (`AsyncDriver`) still running after waiting up to `wait_s` for them."""
    from dynpart.agent.driver.threaded import calls_running

    deadline = time.monotonic() + wait_s
    while True:
        running = calls_running()
        if not running or time.monotonic() >= deadline:
            return [f"the driver call {what}, running in the driver's thread," for what in running]
        time.sleep(0.01)


def _cancel_left(loop: asyncio.AbstractEventLoop, wait_s: float) -> None:
    """What asyncio.run does with the tasks left, waiting at most `wait_s` for them."""
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=wait_s))
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception during agent shutdown",
                                         "exception": t.exception(), "task": t})


def _threads_end(executor: ThreadPoolExecutor, wait_s: float) -> bool:
    """Whether the executor's threads end within `wait_s` (nothing queued is started)."""
    ended = threading.Event()

    def shut_down() -> None:
        executor.shutdown(wait=True, cancel_futures=True)
        ended.set()
    threading.Thread(target=shut_down, name="executor shutdown", daemon=True).start()
    return ended.wait(wait_s)


async def _run(args: argparse.Namespace, settings: AgentSettings) -> int:
    from dynpart.agent.loop import LOOP_BEAT, LOOP_STALL_S
    from dynpart.probing import Liveness, keep_beating, serve

    catalog = load_catalog(settings.catalog_files)

    liveness = Liveness()
    if settings.metrics_port and not args.once:
        serve(settings.metrics_host, settings.metrics_port, liveness)  # /metrics and /healthz
    # from the start, not only once the agent loop runs: the event loop must turn while the start
    # waits (for NVML, the API server, the node lock); nothing is served yet, so a restart is harmless
    liveness.expect(LOOP_BEAT, LOOP_STALL_S)
    beating = asyncio.create_task(keep_beating(liveness, LOOP_BEAT, 1.0), name="event loop beat (start)")
    try:
        return await _run_started(args, settings, catalog, liveness)
    finally:
        beating.cancel()


async def _run_started(args: argparse.Namespace, settings: AgentSettings, catalog: Catalog, liveness: Any) -> int:
    from dynpart.agent.kube import connect
    from dynpart.agent.node_lock import node_lock
    from dynpart.agent.podresources import FakePodResources, KubeletPodResources

    driver: GpuDriver | AsyncDriver
    if settings.fake_gpus:
        driver = _fake_driver(settings.fake_gpus, catalog)
    elif args.once:  # one try: nvmlInit on the driver's thread all the same (a wedged driver: a bounded wait)
        driver = await _wait_for_driver(wait_s=0)
    else:
        driver = await _wait_for_driver()
    pods: PodResources
    if settings.fake_gpus and not os.path.exists(settings.pod_resources_socket):
        pods = FakePodResources()
    else:
        pods = KubeletPodResources(settings.pod_resources_socket)
    api_client = await connect(settings.kubeconfig, settings.kube)
    shutdown = Shutdown()
    try:
        async with contextlib.AsyncExitStack() as stack:
            if settings.node_lock_file:  # before the device plugin serves: one agent per node
                await stack.enter_async_context(node_lock(settings.node_lock_file))
            agent = await _agent(args, settings, api_client, driver, pods, catalog, liveness, stack, shutdown)
            if args.once:
                report = await agent.reconcile_once()
                print(json.dumps(report.status, indent=2, sort_keys=True))
                return 0 if not report.errors else 1
            await _run_until_stopped(agent, shutdown)
            return 0
    finally:
        await shutdown.step("closing the API client", api_client.close)


async def _agent(args: argparse.Namespace, settings: AgentSettings, api_client: Any, driver: GpuDriver | AsyncDriver,
                 pods: PodResources, catalog: Catalog, liveness: Any, stack: contextlib.AsyncExitStack,
                 shutdown: Shutdown | None = None) -> Agent:
    """The agent, its own device plugin (served until `stack` closes; MPS nodes always, MIG nodes
    with `device_plugin: builtin`) and, with `device_plugin: nvidia`, the restarts of NVIDIA's
    plugin on MIG nodes. Closing `stack` stops the plugin, then the MPS daemon, within what is
    left of `shutdown`'s deadline."""
    from dynpart.agent.deviceplugin.cdi import CdiSpecWriter, is_cdi
    from dynpart.agent.deviceplugin.server import AllocateSettings, DevicePluginManager
    from dynpart.agent.kube import KubeNodeApi, KubePluginPods, lease_term_reader
    from dynpart.agent.loop import Agent
    from dynpart.agent.mps_daemon import MpsDaemon, ProcessMpsDaemon, SupervisedMpsDaemon
    from dynpart.agent.nodepods import KubeNodePods
    from dynpart.agent.podresources import FakePodResources

    capacity = settings.mps_capacity_gb
    daemon: MpsDaemon
    shutdown = shutdown or Shutdown()
    if settings.mps_control_dir:
        # run by mps-control, in a pod of its own: it outlives this one, and the agent's way out
        # leaves it (and the MPS pods' CUDA contexts) running
        daemon = SupervisedMpsDaemon(settings.mps_control_dir)
    else:
        daemon = ProcessMpsDaemon()
        # the daemon after the plugin stopped listing MPS slices (exits run last first)
        stack.push_async_callback(shutdown.step, "stopping the MPS control daemon", daemon.stop)
    # MPS clients get the running daemon's /dev/shm where mps-control says it has one of its own
    allocate = AllocateSettings(pipe_dir_host=settings.mps_pipe_dir, device_list=settings.device_list_strategy,
                                mps_shm_host=lambda: daemon.shm_dir, device_specs=settings.device_specs,
                                dev_root=settings.nvidia_dev_root, dev_dir=settings.nvidia_dev_dir,
                                cdi_kind=settings.cdi_kind)
    cdi = (CdiSpecWriter(settings.cdi_spec_dir, settings.cdi_kind, settings.cdi_management_spec or None,
                         dev_root=settings.nvidia_dev_root, node_exists=allocate.node_exists)
           if is_cdi(settings.device_list_strategy) else None)
    plugins = DevicePluginManager(settings.device_plugin_dir, allocate=allocate, held=pods.allocatable, cdi=cdi)
    await plugins.start()
    stack.push_async_callback(shutdown.step, "stopping the device plugin", plugins.close)
    if isinstance(pods, FakePodResources):  # --fake-gpus without a kubelet: it "holds" all advertised
        pods.on_allocatable = lambda: {r: [d.id for d in ds] for r, ds in plugins.advertised().items()}
    extra: dict[str, Any] = {"node_pods": KubeNodePods(api_client, settings.node_name, settings.kube),
                             "plugins": plugins, "mps_daemon": daemon, "mps_log_dir": settings.mps_log_dir,
                             "publish_allocatable": settings.publish_allocatable,
                             "withdraw_settle_s": settings.withdraw_settle_s,
                             "mps_exclusive_process": settings.mps_exclusive_process,
                             "compute_modes_file": settings.compute_modes_file}
    if settings.device_plugin == "nvidia":
        extra["plugin_pods"] = KubePluginPods(api_client, settings.node_name, settings.nvidia_plugin_namespace,
                                              settings.nvidia_plugin_selector)
    return Agent(settings.node_name, node_api=KubeNodeApi(api_client, settings.node_name, settings.kube),
                 driver=driver, pods=pods, catalog=catalog,
                 interval_s=settings.report_interval_s, heartbeat_s=settings.heartbeat_interval_s,
                 capacity_gb=capacity, kube=settings.kube,
                 liveness=liveness, leader_term=lease_term_reader(api_client, settings.planner_lease_name,
                                                                  settings.planner_lease_namespace), **extra)
