"""`dynpart planner run`: the planner controller, as the Helm chart's Deployment runs it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from dynpart.catalog import Catalog, load_catalog
from dynpart.logs import setup_logging
from dynpart.planner.demand import check_workload
from dynpart.settings import PlannerSettings, load_settings

log = logging.getLogger("dynpart.planner")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("planner", help="the planner controller (runs in the cluster)",
                       description="The planner controller: plans GPU layouts for unschedulable pods.")
    psub = p.add_subparsers(dest="planner_command", metavar="ACTION")
    run = psub.add_parser("run", help="watch the cluster and plan (leader-elected)",
                          description="Watch labelled GPU nodes and pending pods; write node layouts. Settings come "
                          "from --config, then DYNPART_PLANNER_* environment variables, then these flags.")
    run.add_argument("--config", help="YAML file of settings (see docs/configuration.md)")
    run.add_argument("--kubeconfig")
    run.add_argument("--batch-idle-s", type=float)
    run.add_argument("--batch-timeout-s", type=float)
    run.add_argument("--metrics-port", type=int)
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument("--log-json", action="store_true", default=None)
    run.add_argument("--no-leader-election", dest="leader_election", action="store_false", default=None)
    run.add_argument("--lease-namespace")
    run.add_argument("--identity")
    run.set_defaults(func=run_planner)

    def usage(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2
    p.set_defaults(func=usage)


def run_planner(args: argparse.Namespace) -> int:
    flags = {k: getattr(args, k, None) for k in ("kubeconfig", "batch_idle_s", "batch_timeout_s", "metrics_port",
                                                 "log_level", "log_json", "leader_election", "lease_namespace",
                                                 "identity")}
    if args.catalog:
        flags["catalog_files"] = args.catalog
    settings = load_settings(PlannerSettings, args.config, flags)
    setup_logging(settings.log_level, settings.log_json)
    catalog = load_catalog(settings.catalog_files)
    for warning in check_workload(settings.workload, catalog):
        log.warning("%s; it counts only on nodes whose driver offers it", warning)
    asyncio.run(_main(settings, catalog))
    return 0


async def _main(settings: PlannerSettings, catalog: Catalog) -> None:
    from kubernetes_asyncio import client

    from dynpart.kube.client import api_client
    from dynpart.kube.leases import LeaderElector
    from dynpart.planner import metrics
    from dynpart.planner.controller import PlannerController
    from dynpart.probing import Liveness, serve

    liveness = Liveness()
    if settings.metrics_port:
        serve(settings.metrics_host, settings.metrics_port, liveness)  # /metrics and /healthz
    api = await api_client(settings.kubeconfig, settings.kube)
    controller = PlannerController(api, settings, catalog, liveness)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(controller.run())]
    if settings.leader_election:
        def on_change(leader: bool) -> None:
            metrics.LEADER.set(1 if leader else 0)
            controller.set_leading(leader)
        elector = LeaderElector(client.CoordinationV1Api(api), settings.lease_name, settings.lease_namespace,
                                settings.identity, settings.lease_duration_s, settings.lease_renew_s,
                                settings.lease_retry_s, on_change, term_floor=controller.highest_written_term)
        controller.leadership = elector  # each write checks it, and carries its term
        tasks.append(asyncio.create_task(elector.run()))
    else:
        metrics.LEADER.set(1)
        controller.leading.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("planner started", extra={"fields": {"identity": settings.identity,
                                                  "leader_election": settings.leader_election}})
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if t in done and (error := t.exception()) is not None:
            raise error
    await api.close()
