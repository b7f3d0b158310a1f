"""`dynpart agent run|probe`: the node agent and its read-only NVML check."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynpart.catalog import Catalog, load_catalog
from dynpart.errors import DynpartError

if TYPE_CHECKING:
    from dynpart.agent.driver.interface import GpuDriver
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


def _fake_driver(spec: str, catalog: Catalog) -> GpuDriver:
    from dynpart.agent.driver.fake import FakeNvml

    model_name, _, count = spec.rpartition(":")
    if not model_name or not count.isdigit() or int(count) < 1:
        raise DynpartError(f"--fake-gpus {spec!r}: expected MODEL:N, e.g. H100-80GB:2")
    return FakeNvml(catalog.resolve(model_name, where="--fake-gpus"), int(count))


def _real_driver() -> GpuDriver:
    from dynpart.agent.driver.nvml import RealNvml

    return RealNvml()


# how long `agent run` waits for the NVIDIA driver at start: after a reboot GPU Operator's driver
# container may still be building and loading it (minutes); exiting at once would put the agent
# in CrashLoopBackOff, whose back-off (up to 5 minutes) adds to the wait
DRIVER_WAIT_S = 900.0


async def _wait_for_driver(wait_s: float = DRIVER_WAIT_S, first_s: float = 2.0) -> GpuDriver:
    """The host's driver, once NVML can be started (retried with back-off up to `wait_s`)."""
    import logging

    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

    from dynpart.agent.driver.interface import NvmlUnavailable

    log = logging.getLogger("dynpart.agent")

    def waiting(state: Any) -> None:
        log.warning("NVML is not available yet (%s); trying again in %.0f s", state.outcome.exception(),
                    state.next_action.sleep if state.next_action else 0)

    async for attempt in AsyncRetrying(retry=retry_if_exception_type(NvmlUnavailable),
                                       wait=wait_exponential(multiplier=first_s, max=30),
                                       stop=stop_after_delay(wait_s), reraise=True, before_sleep=waiting):
        with attempt:
            return _real_driver()
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
    return asyncio.run(_run(args, settings))


async def _run(args: argparse.Namespace, settings: AgentSettings) -> int:
    from dynpart.agent.kube import connect
    from dynpart.agent.node_lock import node_lock
    from dynpart.agent.podresources import FakePodResources, KubeletPodResources

    catalog = load_catalog(settings.catalog_files)
    from dynpart.probing import Liveness, serve

    liveness = Liveness()
    if settings.metrics_port and not args.once:
        serve(settings.metrics_host, settings.metrics_port, liveness)  # /metrics and /healthz
    driver = _fake_driver(settings.fake_gpus, catalog) if settings.fake_gpus else (
        _real_driver() if args.once else await _wait_for_driver())
    pods: PodResources
    if settings.fake_gpus and not os.path.exists(settings.pod_resources_socket):
        pods = FakePodResources()
    else:
        pods = KubeletPodResources(settings.pod_resources_socket)
    api_client = await connect(settings.kubeconfig, settings.kube)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if settings.node_lock_file:  # before the device plugin serves: one agent per node
                await stack.enter_async_context(node_lock(settings.node_lock_file))
            agent = await _agent(args, settings, api_client, driver, pods, catalog, liveness, stack)
            if args.once:
                report = await agent.reconcile_once()
                print(json.dumps(report.status, indent=2, sort_keys=True))
                return 0 if not report.errors else 1
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await agent.run(stop)
            return 0
    finally:
        await api_client.close()


async def _agent(args: argparse.Namespace, settings: AgentSettings, api_client: Any, driver: GpuDriver,
                 pods: PodResources, catalog: Catalog, liveness: Any, stack: contextlib.AsyncExitStack) -> Agent:
    """The agent, its own device plugin (served until `stack` closes; MPS nodes always, MIG nodes
    with `device_plugin: builtin`) and, with `device_plugin: nvidia`, the restarts of NVIDIA's
    plugin on MIG nodes."""
    from dynpart.agent.deviceplugin.server import AllocateSettings, DevicePluginManager
    from dynpart.agent.kube import KubeNodeApi, KubePluginPods, lease_term_reader
    from dynpart.agent.loop import Agent
    from dynpart.agent.mps_daemon import ProcessMpsDaemon
    from dynpart.agent.nodepods import KubeNodePods
    from dynpart.agent.podresources import FakePodResources

    capacity = settings.mps_capacity_gb
    allocate = AllocateSettings(pipe_dir_host=settings.mps_pipe_dir, device_list=settings.device_list_strategy)
    plugins = DevicePluginManager(settings.device_plugin_dir, allocate=allocate, held=pods.allocatable)
    daemon = ProcessMpsDaemon()
    stack.push_async_callback(daemon.stop)  # after the plugin stopped listing MPS slices (exits run last first)
    await stack.enter_async_context(plugins)
    if isinstance(pods, FakePodResources):  # --fake-gpus without a kubelet: it "holds" all advertised
        pods.on_allocatable = lambda: {r: [d.id for d in ds] for r, ds in plugins.advertised().items()}
    extra: dict[str, Any] = {"node_pods": KubeNodePods(api_client, settings.node_name, settings.kube),
                             "plugins": plugins, "mps_daemon": daemon, "mps_log_dir": settings.mps_log_dir,
                             "publish_allocatable": settings.publish_allocatable,
                             "withdraw_settle_s": settings.withdraw_settle_s}
    if settings.device_plugin == "nvidia":
        extra["plugin_pods"] = KubePluginPods(api_client, settings.node_name, settings.nvidia_plugin_namespace,
                                              settings.nvidia_plugin_selector)
    return Agent(settings.node_name, node_api=KubeNodeApi(api_client, settings.node_name, settings.kube),
                 driver=driver, pods=pods, catalog=catalog,
                 interval_s=settings.report_interval_s, heartbeat_s=settings.heartbeat_interval_s,
                 capacity_gb=capacity, kube=settings.kube,
                 liveness=liveness, leader_term=lease_term_reader(api_client, settings.planner_lease_name,
                                                                  settings.planner_lease_namespace), **extra)
