"""Issue 11's fault suite: the whole control loop (real etcd, kube-apiserver and kube-scheduler; the
real planner as a subprocess; real agents in-process on fake GPUs, see harness.py) under one fault
per scenario, each injected in the middle of a burst of MIG and MPS pods (16 pods on two MIG nodes
whose GPUs hold used instances, and an MPS node; wave 2 needs GPUs re-carved on several nodes):

- `baseline`: no fault, the reference;
- `apiserver_restart`: the API server killed (-9) and started again with the same flags;
- `etcd_restart`: etcd stopped and started again on its data;
- `watch_cut_delay`: the planner's and the agents' connections (watches included) cut three
  times, then half a second of latency each way, then cut again (tests/e2e/proxy.py);
- `gone_410`: the components' connections cut, the requests they send next (watches again from
  the resourceVersion they had) held back by the proxy while etcd is compacted past it: those
  watches get 410 Gone (checked to have reached the planner's and the agents' watches; the API
  server runs without its watch cache in this scenario, see the test) and the informers list again;
- `conflict_storm`: three writers patch an annotation of their own (`example.com/x`) on every GPU
  node as fast as they can (~100/s) for 8 s: the planner's resourceVersion-guarded writes meet
  409 Conflicts (checked: at least one);
- `planner_kill9_mid_write`: the planner (its API calls slowed by the proxy) killed -9 as soon as
  the first node of a round that writes several nodes has its spec, then started again;
- `leader_partition`: two planners; the leader's connection partitioned (nothing passes, nothing
  is closed) with the first write of its round on the way, until the standby has taken the lease
  over and planned; then healed: what the old leader sent reaches the API server late, as
  retransmitted segments would;
- `agent_killed_each_step`: used MIG instances on every GPU, a burst that needs re-carving around
  them, and the agents killed before every driver call of it (crash before the 1st call,
  restart, crash before the 2nd, ...): each step of the re-carving is a crash point once;
- `agent_never_acks`: the only node with room has an agent that stops after its first report;
  the planner writes a plan there that is never acknowledged; then the other nodes free up.

Each scenario writes its entry in `.cache/e2e/faults.json` (the evidence behind it in
`faults-details.json`, the planners' logs in `faults-logs/<scenario>/`):
- `pods`: the pods of the burst (all can fit); `running`: of those, Running at the end;
- `used_slices_destroyed`: destroy calls the fake drivers got for an instance a pod or a process
  held, and MPS slices in use that the agent's plugin stopped advertising (`Harness.destroy_violations`);
- `pods_planned_twice`: pods the planner planned on two different nodes, the second while the
  first plan could still be applied. A plan is a spec naming the pod (`spec-pods`, or the
  planner's round as tests/e2e/faultprobe.py logs it, if its write reached the node) or a
  `SlicePlanned` Event "on free slices". Listed in the details but not counted: a pod planned
  elsewhere after its first spec was replaced on that node by one without it (a revocation), or
  more than `reservation_s` after its first plan was applied (the planner's reservation of the
  slices made for it lapsed: the kube-scheduler may have given them to another pod), or after its
  first plan was applied and other pods bound to that node (the harness's record of bindings)
  needed every slice of its resource that plan made (the scheduler gave its slice to another pod;
  the planner then ends the reservation at once);
- `plan_ids_written_twice`: plan ids that appear in more than one spec write (on two nodes, or
  on one node again after another spec), from the harness's watch of the nodes and the planners'
  "node layout written" lines. The details say which were one round's id on several nodes.
Each scenario must end with all pods Running and 0, 0, 0; a fault that did not happen as the
scenario means it (no 410 reached the watches, no conflict, ...) fails it too.

The suite runs on its own control plane (the restarts would disturb the other modules), started
once for the module (2.5 to 4 minutes in all on 2 cores). `E2E_FAULTS=name,name` runs only those
scenarios."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.driver.fake import SimulatedCrash
from dynpart.agent.kube import connect
from dynpart.annotations import decode_spec
from dynpart.kube import watching
from dynpart.kube.conventions import SPEC_PLAN, SPEC_PODS, SPEC_TERM, STATUS_PLAN
from dynpart.kube.errors import APIGoneError
from dynpart.resources import mig_resource_name, mps_resource_name
from dynpart.settings import PlannerSettings
from tests.conftest import skip_without_binaries
from tests.e2e import cluster as cluster_mod
from tests.e2e.harness import (
    HARNESS_LABEL,
    MERGE,
    REPO_ROOT,
    SYSTEM_NAMESPACE,
    AgentRun,
    Harness,
    PlannerProcess,
    PodRecord,
    SimNode,
    scrape,
    wait_until,
)
from tests.e2e.proxy import TcpProxy

pytestmark = pytest.mark.e2e

FAULTS_FILE = REPO_ROOT / ".cache" / "e2e" / "faults.json"
DETAILS_FILE = FAULTS_FILE.with_name("faults-details.json")
LOGS_DIR = FAULTS_FILE.with_name("faults-logs")  # the planners' logs, per scenario
A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"
LEASE_S = 6
RUN_TIMEOUT_S = 120.0  # every pod that can fit Running, after the fault
SLOW_S = 15.0  # a pod Running later than this after its creation is listed in the details

MIG_1G, MIG_2G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"
MPS_10, MPS_20 = "nvidia.com/gpu-10gb", "nvidia.com/gpu-20gb"
# Two MIG nodes (A100, H100) of 2 GPUs whose GPU 0 is left carved as 7 x 1g.10gb, and one MPS node
# of 2 H100s. Wave 1 takes free 1g instances (the scheduler binds them at once) and needs 2g
# carved; wave 2 needs 3g instances: GPUs re-carved around the used 1g instances, several nodes
# in one round. 16 pods, all of which fit (MIG: 19 of 28 compute slices; MPS: 80 of 158 GB).
WAVE1 = [("w1-1g-a", MIG_1G), ("w1-1g-b", MIG_1G), ("w1-1g-c", MIG_1G), ("w1-2g-a", MIG_2G), ("w1-2g-b", MIG_2G),
         ("w1-m10-a", MPS_10), ("w1-m10-b", MPS_10), ("w1-m20-a", MPS_20)]
WAVE2 = [("w2-3g-a", MIG_3G), ("w2-3g-b", MIG_3G), ("w2-3g-c", MIG_3G), ("w2-2g-a", MIG_2G), ("w2-1g-a", MIG_1G),
         ("w2-m20-a", MPS_20), ("w2-m10-a", MPS_10), ("w2-m10-b", MPS_10)]

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
SLICE_PLANNED = re.compile(r"dynpart plans this pod on node (\S+)")
REPLACED = "after its plan was replaced (revoked)"
LAPSED = "after its plan was applied and its reservation lapsed"
TAKEN = "after its plan was applied and other pods bound to that node took every slice of its resource"
# the planner keeps the slices of an applied plan for its pods this long (then plans them again)
RESERVATION_S = float(getattr(PlannerSettings.model_fields.get("reservation_s"), "default", 30.0))


def _selected(name: str) -> None:
    wanted = {n.strip() for n in os.environ.get("E2E_FAULTS", "").split(",") if n.strip()}
    if wanted and name not in wanted:
        pytest.skip(f"E2E_FAULTS={os.environ['E2E_FAULTS']} leaves out {name}")


def _transient(e: BaseException) -> bool:
    """A failure that an API outage explains (the harness retries these; its kubelets would)."""
    if isinstance(e, ApiException):
        return e.status in (0, 408, 429) or e.status >= 500
    return isinstance(e, aiohttp.ClientError | asyncio.TimeoutError | OSError)


async def _retrying(call: Callable[[], Awaitable[Any]], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as e:
            if not _transient(e) or time.monotonic() > deadline:
                raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
            await asyncio.sleep(0.2)


# --- the control plane under test ------------------------------------------------------------------


class ControlPlane:
    """The suite's own cluster (cluster.py), with the restarts the faults need, and a watchdog
    that starts again a component that exited on its own (a kubelet would: the kube-scheduler
    exits when it cannot renew its lease during an outage)."""

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self.lock = threading.Lock()  # a restart and the watchdog never overlap
        self.revived: list[str] = []

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    @property
    def api_port(self) -> int:
        return int(self.cluster.server.rsplit(":", 1)[1])

    def restart(self, name: str, sig: int = signal.SIGTERM, down_s: float = 0.0, extra_args: list[str] | None = None) -> float:
        with self.lock:
            return self.cluster.restart(name, sig=sig, down_s=down_s, extra_args=extra_args)

    def revive(self) -> None:
        if self.lock.acquire(blocking=False):
            try:
                self.revived += self.cluster.revive()
            finally:
                self.lock.release()

    async def watchdog(self) -> None:
        while True:
            await asyncio.to_thread(self.revive)
            await asyncio.sleep(1.0)

    def etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's v3 JSON gateway (there is no etcdctl in the e2e binaries)."""
        req = urllib.request.Request(self.cluster.etcd_url + path, data=json.dumps(body).encode(), method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as resp:
            return json.loads(resp.read())

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision: every older resourceVersion is gone."""
        revision = int(self.etcd("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        self.etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    skip_without_binaries()
    cluster = cluster_mod.start_cluster(tmp_path_factory.mktemp("faults-cluster"))
    try:
        yield ControlPlane(cluster)
    finally:
        cluster.stop()


# --- the harness, kept going through API outages, agents optionally through a proxy ------------------


@dataclass
class FaultHarness(Harness):
    """The e2e harness with (1) the agents' API connection through `agent_kubeconfig` (a proxy)
    when set, and (2) the simulated kubelets and device plugins retrying what an API outage makes
    fail, as the real ones do (the harness's own checks assume a healthy API server)."""

    agent_kubeconfig: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # (wall clock, node, its dynpart.io/ annotations): each change the node watch saw, timed
        self.timeline: list[tuple[float, str, dict[str, str]]] = []

    def _on_node(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        before = len(self.history.get(name, []))
        super()._on_node(kind, obj)
        hist = self.history.get(name, [])
        if len(hist) > before:
            self.timeline.append((time.time(), name, hist[-1]))

    async def start_agent(self, node: SimNode, wait: bool = True) -> AgentRun:
        direct = self.kubeconfig
        self.kubeconfig = self.agent_kubeconfig or direct
        try:
            return await super().start_agent(node, wait)
        finally:
            self.kubeconfig = direct

    async def _set_phase(self, rec: PodRecord, phase: str, message: str = "") -> None:
        inner = super()._set_phase
        await _retrying(lambda: inner(rec, phase, message), f"set pod {rec.key} {phase}")

    async def _publish(self, node: SimNode, version: int, slices: dict[str, int]) -> None:
        inner = super()._publish
        await _retrying(lambda: inner(node, version, slices), f"publish the devices of node {node.name}")

    async def _refresh_loop(self) -> None:
        inner = super()._refresh_loop
        while True:
            try:
                await inner()
            except Exception as e:
                if not _transient(e) and not isinstance(e, AssertionError):
                    raise
                await asyncio.sleep(0.2)


class ProbedPlanner(PlannerProcess):
    """The planner subprocess through tests/e2e/faultprobe.py (same program, two probes logging)."""

    def entry(self) -> str:
        return "tests.e2e.faultprobe"

    def probes(self, kind: str) -> list[dict[str, Any]]:
        prefix = f"e2e-probe {kind} "
        return [json.loads(line.split(prefix, 1)[1]) for line in self.log().splitlines() if prefix in line]

    def lines(self, pattern: str) -> list[tuple[dt.datetime | None, str]]:
        rx = re.compile(pattern)
        out = []
        for line in self.log().splitlines():
            if rx.search(line):
                m = LOG_TIME.match(line)
                out.append((dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None, line))
        return out


# --- one scenario --------------------------------------------------------------------------------


def _precarve_1g(node: SimNode, gpus: tuple[int, ...] = (0,)) -> None:
    """Leave 7 x 1g.10gb (free) on each of `gpus`: what an earlier workload left behind."""
    p = next(p for p in node.model.mig_profiles if p.name == "1g.10gb")
    for gpu in gpus:
        for start in range(7):
            gi = node.driver.create_gpu_instance(gpu, p.gi_profile_id, start, p.memory)
            node.driver.create_compute_instance(gpu, gi, p.compute)
    node.driver.ops.clear()


@dataclass
class Run:
    """One scenario: a harness (own namespace and nodes), planners, proxies, and its measurement."""

    cp: ControlPlane
    tmp: Path
    name: str
    h: FaultHarness = field(init=False)
    planners: list[ProbedPlanner] = field(default_factory=list)  # every planner process it started
    proxies: list[TcpProxy] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    lease: str = ""
    started: float = field(default_factory=time.monotonic)

    def proxy(self, name: str) -> tuple[TcpProxy, Path]:
        """A proxy to the API server, and an admin kubeconfig through it."""
        p = TcpProxy(self.cp.api_port, name=name).start()
        self.proxies.append(p)
        return p, p.kubeconfig(self.cp.kubeconfig, self.tmp / f"{name}.kubeconfig")

    def planner(self, identity: str, kubeconfig: Path | None = None, env: dict[str, str] | None = None) -> ProbedPlanner:
        settings = {"DYNPART_PLANNER_LEASE_NAME": self.lease, "DYNPART_PLANNER_LEASE_DURATION_S": str(LEASE_S),
                    "DYNPART_PLANNER_LEASE_RENEW_S": "2", **(env or {})}
        n = sum(1 for p in self.planners if p.identity == identity)
        p = ProbedPlanner(kubeconfig or self.cp.kubeconfig, self.tmp / f"{identity}-{n}.log", identity, settings)
        self.planners.append(p.start())
        self.h.planners = self.planners
        return p

    async def add_nodes(self, mig_gpus: int = 2, mps_gpus: int = 2) -> list[SimNode]:
        h = self.h
        nodes = [await h.add_node("a100", A100, "mig", mig_gpus, prepare=_precarve_1g),
                 await h.add_node("h100", H100, "mig", mig_gpus, prepare=_precarve_1g),
                 await h.add_node("mps", H100, "mps", mps_gpus)]
        return nodes

    async def start_agents(self, nodes: list[SimNode] | None = None) -> None:
        for node in nodes or list(self.h.nodes.values()):
            await self.h.start_agent(node)

    async def leading(self, planner: ProbedPlanner) -> None:
        await planner.wait_log(r"acquired leadership", timeout=60)
        await planner.wait_log(r"caches synced", timeout=60)

    def spec_writes_seen(self) -> int:
        return sum(len(_runs(hist)) for hist in self.h.history.values())

    async def wait_spec_write(self, after: int | None = None, timeout: float = 30.0) -> None:
        """Until the harness has seen a spec written (another one than the `after` first ones)."""
        start = self.spec_writes_seen() if after is None else after
        await wait_until(lambda: self.spec_writes_seen() > start, timeout, "a node spec to be written",
                         describe=self.h.describe)

    def require(self, ok: bool, what: str) -> None:
        """A condition of the fault itself (it happened as the scenario means it): checked with the
        scenario's results."""
        if not ok:
            self.notes.setdefault("fault_not_as_meant", []).append(what)

    async def settle(self, recs: list[PodRecord], timeout: float = RUN_TIMEOUT_S) -> None:
        """Wait for every pod to run (a time-out or a failed pod is measured, not raised here)."""
        try:
            await self.h.wait_running(recs, timeout=timeout)
        except AssertionError as e:
            self.notes["not_running"] = str(e)[:6000]

    async def finish(self, recs: list[PodRecord]) -> None:
        """Settle, measure, record the scenario in faults.json, and check it."""
        await self.settle(recs)
        self.notes["seconds"] = round(time.monotonic() - self.started, 1)
        entry, details = await measure(self, recs)
        record(self.name, entry, {**details, **self.notes})
        print(f"\n{self.name}: {json.dumps(entry)}\n{json.dumps({**details, **self.notes}, indent=1, default=str)[:4000]}")
        problems = [f"fault not injected as meant: {x}" for x in self.notes.get("fault_not_as_meant", [])]
        if entry["running"] < entry["pods"]:
            problems.append(f"{entry['pods'] - entry['running']} of {entry['pods']} pods not Running: "
                            f"{self.notes.get('not_running', '')[:3000]}")
        if entry["used_slices_destroyed"]:
            problems.append(f"used slices destroyed: {details['destroy_violations']}")
        if entry["pods_planned_twice"]:
            problems.append(f"pods planned on two nodes: {details['pods_planned_twice']}")
        if entry["plan_ids_written_twice"]:
            problems.append(f"plan ids written more than once: {details['plan_ids_written_twice']}")
        assert not problems, f"{self.name}:\n" + "\n".join(problems)


@contextlib.asynccontextmanager
async def scenario(cp: ControlPlane, name: str, agents_via_proxy: bool = False) -> AsyncIterator[Run]:
    """A scenario's run: its planners' logs (and proxies' kubeconfigs) in .cache/e2e/faults-logs/<name>;
    afterwards everything it made is removed, the proxies healed first."""
    _selected(name)
    logs = LOGS_DIR / name
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    run = Run(cp, logs, name)
    run.lease = f"faults-{name.replace('_', '-')}-{os.getpid()}"
    agent_kubeconfig = run.proxy("agents")[1] if agents_via_proxy else None
    run.h = FaultHarness(cp.kubeconfig, agent_kubeconfig=agent_kubeconfig)
    watchdog = asyncio.get_running_loop().create_task(cp.watchdog())
    await run.h.start()
    try:
        yield run
    finally:
        for p in run.proxies:
            p.heal()
        for p in run.planners:
            p.stop()
        try:
            await run.h.close()
        except Exception as e:  # what is left is swept below
            print(f"harness close: {type(e).__name__}: {e}")
        await _sweep(cp)
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
        for p in run.proxies:
            p.stop()
        if cp.revived:
            print(f"components started again by the watchdog: {cp.revived}")
            cp.revived.clear()
        for p in run.planners:  # shown on failure
            print(f"--- planner {p.identity} log ({p.log_path}) ---\n{p.log_tail(60)}")


async def _sweep(cp: ControlPlane) -> None:
    """Delete every harness node and pod left on the suite's cluster: the next scenario's pods must
    not be bound to this one's nodes."""
    api = await connect(str(cp.kubeconfig))
    try:
        core = client.CoreV1Api(api)
        for _ in range(50):
            nodes = (await _retrying(lambda: core.list_node(label_selector=HARNESS_LABEL), "list nodes")).items
            pods = (await _retrying(lambda: core.list_pod_for_all_namespaces(label_selector=HARNESS_LABEL),
                                    "list pods")).items
            if not nodes and not pods:
                return
            for pod in pods:
                with contextlib.suppress(ApiException):
                    await core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
            for node in nodes:
                with contextlib.suppress(ApiException):
                    await core.delete_node(node.metadata.name)
            await asyncio.sleep(0.2)
        raise AssertionError("harness nodes or pods are left on the cluster")
    finally:
        await api.close()


# --- measuring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecWrite:
    t: float  # when the harness's node watch saw it (wall clock)
    node: str
    plan: str
    pods: frozenset[str]
    term: str | None


@dataclass(frozen=True)
class Plan:
    """The planner planned `pod` on `node`: a spec naming it (`spec`), or free slices (`free slices`)."""

    t: float
    node: str
    kind: str
    plan: str | None = None


def _runs(hist: list[dict[str, str]]) -> list[str]:
    """The spec plan ids a node's annotation history shows, one per write (a change of value)."""
    out, prev = [], None
    for ann in hist:
        spec = ann.get(SPEC_PLAN)
        if spec != prev and spec:
            out.append(spec)
        prev = spec
    return out


def _spec_writes(h: FaultHarness) -> list[SpecWrite]:
    out, prev = [], {}
    for t, node, ann in h.timeline:
        spec = ann.get(SPEC_PLAN)
        if spec and spec != prev.get(node):
            pods = frozenset(p for p in (ann.get(SPEC_PODS) or "").split(",") if p)
            out.append(SpecWrite(t, node, spec, pods, ann.get(SPEC_TERM)))
        prev[node] = spec
    return out


def _logged_writes(planners: list[ProbedPlanner]) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for p in planners:
        for _, line in p.lines(r"node layout written"):
            node, plan = re.search(r"\bnode=(\S+)", line), re.search(r"\bplan=(\S+)", line)
            if node and plan:
                out[(node.group(1), plan.group(1))] += 1
    return out


def _acknowledged_at(h: FaultHarness, plan: Plan) -> float | None:
    return next((t for t, node, ann in h.timeline if node == plan.node and t >= plan.t
                 and ann.get(STATUS_PLAN) == plan.plan), None)


def _taken(h: FaultHarness, plan: Plan, pod: str, at: float) -> bool:
    """Whether, at `at`, pods bound to the node of the (acknowledged) spec `plan` other than `pod`,
    asking for `pod`'s resource, needed every slice of that resource the spec made: the scheduler
    gave the pod's slice to another pod, and planning it again is no second plan of one slice."""
    rec, node = h.pods.get(pod), h.nodes.get(plan.node)
    ann = next((a for _, n, a in h.timeline if n == plan.node and a.get(SPEC_PLAN) == plan.plan), None)
    if rec is None or node is None or ann is None:
        return False
    layout = decode_spec(ann, node.model, node=plan.node).layout
    if layout is None:
        return False
    slices = sum(1 for g in layout.gpus for m in g.mig if mig_resource_name(m.profile) == rec.resource)
    slices += sum(1 for g in layout.gpus for x in g.mps if mps_resource_name(x.size) == rec.resource)
    bound = sum(1 for r in h.pods.values() if r.key != pod and r.node == plan.node and r.resource == rec.resource
                and r.bound_at is not None and r.bound_at <= at)
    return bound >= slices


def _replaced(h: FaultHarness, plan: Plan, pod: str, before: float) -> bool:
    """Whether the spec `plan` wrote was replaced on its node, before `before`, by one without `pod`
    (a revocation, or a later plan): it could no longer be applied for the pod."""
    return any(node == plan.node and plan.t < t <= before and ann.get(SPEC_PLAN) != plan.plan
               and pod not in (ann.get(SPEC_PODS) or "").split(",") for t, node, ann in h.timeline)


async def measure(run: Run, recs: list[PodRecord]) -> tuple[dict[str, int], dict[str, Any]]:
    h = run.h
    writes = _spec_writes(h)
    logged = _logged_writes(run.planners)
    seen = Counter((w.node, w.plan) for w in writes)
    by_plan: dict[str, Counter[str]] = defaultdict(Counter)
    for node, plan in set(seen) | set(logged):
        by_plan[plan][node] = max(seen[(node, plan)], logged[(node, plan)])
    written = {(node, plan) for plan, nodes in by_plan.items() for node in nodes}
    rounds = [r for p in run.planners for r in p.probes("round")]
    round_writes = [set(r["writes"].items()) for r in rounds]
    ids_twice: dict[str, dict[str, Any]] = {}
    for plan, nodes in by_plan.items():
        if sum(nodes.values()) > 1:
            one_round = max(nodes.values()) == 1 and any({(n, plan) for n in nodes} <= w for w in round_writes)
            ids_twice[plan] = {"nodes": dict(nodes), "how": "one round's id on several nodes" if one_round else "rewritten"}

    # Every plan of every pod: the specs naming it (spec-pods; the probe's rounds for the writes
    # that landed, should a spec not name its pods), the free slices the planner announced (its
    # SlicePlanned Events "on free slices", timed by the probe's round that placed the pod there).
    plans: dict[str, list[Plan]] = defaultdict(list)
    for w in writes:
        for pod in w.pods:
            plans[pod].append(Plan(w.t, w.node, "spec", w.plan))
    events = await _retrying(lambda: h.core.list_namespaced_event(h.namespace), "list events")
    announced: dict[tuple[str, str], bool] = {}  # (pod, node) -> on free slices
    for ev in events.items:
        if ev.reason == "SlicePlanned" and (m := SLICE_PLANNED.search(ev.message or "")):
            key = (f"{ev.involved_object.namespace}/{ev.involved_object.name}", m.group(1))
            announced[key] = announced.get(key, False) or "on free slices" in ev.message
    for r in rounds:
        for pod, node in r["placements"]:
            pid = r["writes"].get(node)
            known = {(x.node, x.plan) for x in plans[pod]}
            if pid and (node, pid) in written and (node, pid) not in known:
                plans[pod].append(Plan(r["t"], node, "spec", pid))
            elif not pid and announced.get((pod, node)) and (node, None) not in known:
                plans[pod].append(Plan(r["t"], node, "free slices"))
    for (pod, node), free in announced.items():  # Events no round explains (the probe off)
        if node not in {x.node for x in plans[pod]}:
            plans[pod].append(Plan(float("inf"), node, "free slices" if free else "event"))

    planned_twice: dict[str, dict[str, Any]] = {}
    for pod, ps in plans.items():
        if len({x.node for x in ps}) < 2:
            continue
        ps.sort(key=lambda x: x.t)
        how = []
        for a, b in itertools.pairwise(ps):
            if a.node == b.node:
                continue
            acked = _acknowledged_at(h, a) if a.kind == "spec" else None
            if a.kind == "spec" and _replaced(h, a, pod, b.t):
                how.append(REPLACED)
            elif acked is not None and b.t - acked > RESERVATION_S:
                how.append(LAPSED)
            elif acked is not None and acked <= b.t and _taken(h, a, pod, b.t):
                how.append(TAKEN)
            elif "free slices" in (a.kind, b.kind):
                how.append("free slices")
            else:
                how.append("while the first plan could still be applied")
        planned_twice[pod] = {"how": sorted(set(how)),
                              "plans": [f"{x.node} {x.kind} {x.plan or ''}".strip() for x in ps]}
    # A pod planned elsewhere after its first plan was replaced by one without it (revoked) was not
    # planned twice: that plan could no longer be applied (docs/protocol.md, "Leader changes").
    twice = [pod for pod, x in planned_twice.items() if set(x["how"]) - {REPLACED, LAPSED, TAKEN}]
    violations = h.destroy_violations()
    entry = {"pods": len(recs), "running": sum(r.running_at is not None for r in recs),
             "used_slices_destroyed": len(violations), "pods_planned_twice": len(twice),
             "plan_ids_written_twice": len(ids_twice)}
    terms: dict[str, list[str]] = defaultdict(list)
    for w in writes:
        if w.term is not None:
            terms[w.node].append(w.term)
    slow = {r.key: {"running_after_s": round(r.reaction_s, 1) if r.reaction_s is not None else None,
                    "plans": [f"{x.node} {x.kind} {x.plan or ''}".strip() for x in sorted(plans.get(r.key, []), key=lambda x: x.t)]}
            for r in recs if r.reaction_s is None or r.reaction_s > SLOW_S}
    details = {"destroy_violations": violations, "pods_planned_twice": planned_twice, "slow_pods": slow,
               "plan_ids_written_twice": ids_twice, "spec_writes": sum(sum(c.values()) for c in by_plan.values()),
               "plan_ids": len(by_plan), "handshake_violations": h.handshake_violations(),
               "spec_terms": dict(terms),
               "probe_off": [x for p in run.planners for x in p.probes("off")],
               "planner_rounds": {p.log_path.name: p.plans() for p in run.planners}}
    return entry, details


def record(name: str, entry: dict[str, int], details: dict[str, Any]) -> None:
    for path, value in ((FAULTS_FILE, entry), (DETAILS_FILE, details)):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[name] = value
        path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def gone_watches() -> Any:
    """In this process (the agents, the harness): the informers whose watch ended with 410 Gone."""
    seen: Counter[str] = Counter()
    inner = watching.Informer._watch

    async def _watch(self: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await inner(self, *args, **kw)
        except APIGoneError:
            seen[self.name] += 1
            raise
    watching.Informer._watch = _watch  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        watching.Informer._watch = inner  # type: ignore[method-assign]


async def _standard_burst(run: Run, inject: Callable[[], Awaitable[None]], agents: bool = True,
                          planner_kubeconfig: Path | None = None) -> list[PodRecord]:
    """Nodes, agents, a planner; wave 1; once the planner has written a spec, wave 2 and at once the
    fault; then every pod must run."""
    h = run.h
    await run.add_nodes()
    if agents:
        await run.start_agents()
    planner = run.planner("planner-a", planner_kubeconfig)
    await run.leading(planner)
    recs = await h.create_pods(WAVE1)
    await run.wait_spec_write()
    recs += await h.create_pods(WAVE2)
    await inject()
    await run.finish(recs)
    return recs


# --- the scenarios ----------------------------------------------------------------------------------


async def test_baseline(control_plane):
    """The same burst without a fault: what the other scenarios compare with."""
    async with scenario(control_plane, "baseline") as run:
        async def inject() -> None:
            pass
        await _standard_burst(run, inject)


async def test_apiserver_restart(control_plane):
    async with scenario(control_plane, "apiserver_restart") as run:
        async def inject() -> None:
            await asyncio.sleep(0.3)  # the planner is batching wave 2
            # -9: a graceful stop takes ~12 s here, long enough for the kube-scheduler to lose its lease
            run.notes["restart_s"] = round(await asyncio.to_thread(control_plane.restart, "kube-apiserver",
                                                                   signal.SIGKILL), 2)
        await _standard_burst(run, inject)


async def test_etcd_restart(control_plane):
    async with scenario(control_plane, "etcd_restart") as run:
        async def inject() -> None:
            await asyncio.sleep(0.3)
            run.notes["restart_s"] = round(await asyncio.to_thread(control_plane.restart, "etcd", signal.SIGTERM, 1.0), 2)
        await _standard_burst(run, inject)


async def test_watch_cut_delay(control_plane):
    async with scenario(control_plane, "watch_cut_delay", agents_via_proxy=True) as run:
        proxy, kubeconfig = run.proxy("planner")
        agents_proxy = run.proxies[0]

        async def inject() -> None:
            cuts = 0
            for _ in range(3):
                await asyncio.sleep(0.8)
                cuts += proxy.cut() + agents_proxy.cut()
            for p in (proxy, agents_proxy):
                p.delay(0.5)
            await asyncio.sleep(4.0)
            cuts += proxy.cut() + agents_proxy.cut()
            await asyncio.sleep(1.0)
            for p in (proxy, agents_proxy):
                p.heal()
            run.notes["connections_cut"] = cuts
        await _standard_burst(run, inject, planner_kubeconfig=kubeconfig)


async def test_gone_410(control_plane):
    """The components' connections are cut; the requests they send next (their informers watch
    again from the last resourceVersion they saw, as client-go's Reflector does) are held `hold_s`
    by the proxy, and meanwhile etcd's history is compacted past it: those watches ask for a
    compacted resourceVersion and get 410 Gone, and the informers list again. The API
    server runs without its watch cache in this scenario (restarted with --watch-cache=false, and
    back after it), so that etcd's compaction reaches the watches: the cache would serve a watch
    from its own ~75 s of history instead, and answer 410 only to one older than that."""
    _selected("gone_410")
    restart = await asyncio.to_thread(control_plane.restart, "kube-apiserver", signal.SIGKILL, 0.0, ["--watch-cache=false"])
    try:
        async with scenario(control_plane, "gone_410", agents_via_proxy=True) as run:
            run.notes["apiserver_restart_s"] = round(restart, 2)
            proxy, kubeconfig = run.proxy("planner")
            proxies = [proxy, run.proxies[0]]
            hold_s = 2.5

            def planner_gone() -> int:
                return sum(len(p.probes("gone")) for p in run.planners)

            with gone_watches() as gone:
                async def inject() -> None:
                    await asyncio.sleep(0.3)
                    for p in proxies:
                        p.delay(hold_s, "up", spare_handshake=True)
                        p.cut()
                    began = time.monotonic()
                    await asyncio.sleep(0.7)  # the watches are sent again (and held)
                    for k in range(3):  # a watch from revision R starts at R + 1: compact past that
                        await run.h.core.create_namespaced_config_map(
                            run.h.namespace, {"metadata": {"name": f"churn-{k}-{int(time.time() * 1000)}"}})
                    run.notes["compacted_at_revision"] = await asyncio.to_thread(control_plane.compact_etcd)
                    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - began)))
                    for p in proxies:
                        p.delay(0)
                    await asyncio.sleep(hold_s + 1.5)  # what was held is delivered, the watches start
                    reached = run.notes["gone_410"] = {"planner": planner_gone(), **{k: v for k, v in gone.items()}}
                    run.require(bool(reached["planner"]) and any(k.startswith("node ") for k in reached),
                                f"410 Gone did not reach both the planner's and the agents' watches: {reached}")
                await _standard_burst(run, inject, planner_kubeconfig=kubeconfig)
    finally:
        await asyncio.to_thread(control_plane.restart, "kube-apiserver", signal.SIGKILL)


async def test_conflict_storm(control_plane):
    async with scenario(control_plane, "conflict_storm") as run:
        h = run.h

        async def writer(stop: asyncio.Event) -> int:
            """Patch example.com/x on every GPU node, one node after the other, as fast as it goes."""
            patches = 0
            for i in itertools.count():
                for node in list(h.nodes):
                    if stop.is_set():
                        return patches
                    body = {"metadata": {"annotations": {"example.com/x": f"{id(stop)}-{i}"}}}
                    with contextlib.suppress(ApiException):
                        await h.core.patch_node(node, body, _content_type=MERGE)
                        patches += 1
            return patches

        async def conflicts() -> float:
            metrics = await asyncio.to_thread(scrape, run.planners[0].metrics_port)
            # 409s met: a plan left to the next round, or a write made again at the new version
            return sum(v for k, v in metrics.items() if (k.startswith("dynpart_plan_errors_total{") and "conflict" in k)
                       or k.startswith("dynpart_plan_write_retries_total"))

        async def inject() -> None:
            stop = asyncio.Event()
            writers = [asyncio.get_running_loop().create_task(writer(stop)) for _ in range(3)]
            began = time.monotonic()
            # at least 8 s; longer (up to 40 s) while the planner has met no conflict yet: on a loaded
            # machine its round for wave 2 may write only after the first seconds of the storm
            await asyncio.sleep(8.0)
            while await conflicts() == 0 and time.monotonic() - began < 40.0:
                await asyncio.sleep(1.0)
            stop.set()
            patches = sum(await asyncio.gather(*writers))
            run.notes["storm_patches_per_s"] = round(patches / (time.monotonic() - began))
            run.notes["planner_conflicts_during_storm"] = await conflicts()
            run.notes["pods_running_when_storm_ended"] = sum(r.running_at is not None for r in h.pods.values())
            run.require(run.notes["planner_conflicts_during_storm"] > 0, "the storm caused the planner no 409 Conflict")
        await _standard_burst(run, inject)


async def test_planner_kill9_mid_write(control_plane):
    async with scenario(control_plane, "planner_kill9_mid_write") as run:
        h = run.h
        # every API call of the planner 0.4 s slower: a round's writes are seconds apart
        proxy, kubeconfig = run.proxy("planner")
        await run.add_nodes()
        await run.start_agents()
        planner = run.planner("planner-a", kubeconfig)
        await run.leading(planner)
        recs = await h.create_pods(WAVE1)
        await run.wait_spec_write()
        await wait_until(lambda: all(a.get(SPEC_PLAN) == a.get(STATUS_PLAN) for hist in h.history.values()
                                     for a in hist[-1:]), 30, "wave 1's plans acknowledged")
        proxy.delay(0.2)
        rounds_before = len(planner.probes("round"))
        recs += await h.create_pods(WAVE2)

        def multi_node_write_started() -> dict[str, Any] | None:
            for r in planner.probes("round")[rounds_before:]:
                if len(r["writes"]) >= 2:
                    written = [n for n, pid in r["writes"].items() if pid in _runs(h.history.get(n, []))]
                    if written:
                        return {"round_writes": r["writes"], "written_before_kill": written}
            return None
        killed = await wait_until(multi_node_write_started, 60, "a round writing several nodes to start writing",
                                  interval=0.01, describe=h.describe)
        planner.kill()
        run.notes["killed"] = killed
        await asyncio.sleep(0.5)
        run.notes["written_when_killed"] = written = {n: pid in _runs(h.history.get(n, []))
                                                      for n, pid in killed["round_writes"].items()}
        run.require(not all(written.values()), f"the kill came after the round's last write: {written}")
        proxy.heal()
        restarted = run.planner("planner-a", kubeconfig)  # the container restarted: same identity
        await run.leading(restarted)
        await run.finish(recs)


async def test_leader_partition(control_plane):
    async with scenario(control_plane, "leader_partition") as run:
        h = run.h
        leases = client.CoordinationV1Api(h.api)

        async def holder() -> str | None:
            try:
                return (await leases.read_namespaced_lease(run.lease, SYSTEM_NAMESPACE)).spec.holder_identity
            except (TimeoutError, ApiException, aiohttp.ClientError):
                return None

        await run.add_nodes()
        await run.start_agents()
        routes = {x: run.proxy(f"planner-{x}") for x in ("a", "b")}
        planners = {run.planner(f"planner-{x}", routes[x][1]).identity: x for x in ("a", "b")}
        first = await wait_until(holder, 60, "a planner to hold the lease")
        leader = next(p for p in run.planners if p.identity == first)
        standby = next(p for p in run.planners if p is not leader)
        await run.leading(leader)
        await standby.wait_log(r"caches synced", timeout=60)
        recs = await h.create_pods(WAVE1)
        await run.wait_spec_write()
        cut_off = routes[planners[leader.identity]][0]
        # What the leader sends takes 1 s to get through: the partition catches the first write of
        # its next round on the way (the proxy keeps it, and delivers it when healed).
        cut_off.delay(1.0, "up")
        rounds_before = len(leader.probes("round"))
        recs += await h.create_pods(WAVE2)

        def writing() -> bool:
            return any(r["writes"] for r in leader.probes("round")[rounds_before:])
        await wait_until(writing, 30, "the leader to plan wave 2", interval=0.01, describe=h.describe)
        cut_off.partition()
        partitioned_at = dt.datetime.now()
        t0 = time.monotonic()

        async def standby_holds() -> bool:
            return await holder() == standby.identity
        await wait_until(standby_holds, LEASE_S + 30, "the standby to take the lease over", interval=0.2)
        run.notes["takeover_s"] = round(time.monotonic() - t0, 2)
        with contextlib.suppress(AssertionError):
            await standby.wait_log(r"dynpart\.planner: planned ", timeout=20)
        await asyncio.sleep(2.0)
        run.notes["healed_after_s"] = round(time.monotonic() - t0, 2)
        cut_off.heal(flush=True)
        await run.settle(recs)
        await asyncio.sleep(2.0)  # what the old leader makes of the answers it gets late
        taken = standby.lines(r"acquired leadership")
        taken_at = taken[0][0] if taken else None
        run.notes["old_leader_writes_after_takeover"] = [
            line.split(": ", 1)[-1] for at, line in leader.lines(r"node layout written") if taken_at and at and at >= taken_at]
        run.notes["old_leader_writes_during_partition"] = [
            line.split(": ", 1)[-1] for at, line in leader.lines(r"node layout written") if at and at >= partitioned_at]
        run.notes["old_leader_lost_leadership"] = [line.split(": ", 1)[-1] for _, line in leader.lines(r"lost leadership")]
        run.notes["old_leader_stopped_writing"] = len(leader.lines(r"stopped writing"))
        run.notes["old_leader_after_partition"] = [
            line.split(": ", 1)[-1][:200] for at, line in leader.lines(
                r"node layout written|node changed while planning|could not write|stopped writing|lost leadership|no answer")
            if at and at >= partitioned_at]
        run.notes["new_leader_adopted"] = [line.split(": ", 1)[-1] for _, line in standby.lines(r"adopted an earlier")]
        newest, stale = -1, []
        for w in sorted(_spec_writes(h), key=lambda w: w.t):  # a spec of an older term landing after a newer one
            term = int(w.term) if (w.term or "").isdigit() else None
            if term is not None and term < newest:
                applied = any(n == w.node and a.get(STATUS_PLAN) == w.plan for _, n, a in h.timeline)
                stale.append(f"{w.node} plan {w.plan} term {term} (newest {newest}), applied: {applied}")
            newest = max(newest, term if term is not None else -1)
        run.notes["deposed_term_specs_landed"] = stale
        await run.finish(recs)


async def test_agent_killed_each_step(control_plane):
    """One MIG GPU per node, carved 7 x 1g.10gb; two 1g pods on each; then pods that need 3g and 2g
    instances: each GPU is re-carved around its used instances, the agent killed before every
    driver call of that (and started again: a new agent process on the same GPUs)."""
    async with scenario(control_plane, "agent_killed_each_step") as run:
        h = run.h
        mig = [await h.add_node("a100", A100, "mig", 1, prepare=_precarve_1g),
               await h.add_node("h100", H100, "mig", 1, prepare=_precarve_1g)]
        mps = await h.add_node("mps", H100, "mps", 1)
        await run.start_agents()
        planner = run.planner("planner-a")
        await run.leading(planner)
        recs = [await h.create_pod(f"k1-1g-{n.name.split('-')[0]}-{i}", MIG_1G, node=n) for n in mig for i in range(2)]
        recs += await h.create_pods([("k1-m10-a", MPS_10), ("k1-m20-a", MPS_20)])
        await h.wait_running(recs, timeout=60)
        used = {n.name: sorted(hd.gi_id for hs in n.holdings.values() for hd in hs) for n in mig}
        crashes: list[tuple[str, int, str]] = []  # node, driver ops done so far, the call it died before

        async def crash_loop(node: SimNode, stop: asyncio.Event) -> None:
            node.driver.crash_after(0)
            while not stop.is_set():
                run_ = h.agents[node.name]
                done, _ = await asyncio.wait([run_.task, asyncio.ensure_future(stop.wait())],
                                             return_when=asyncio.FIRST_COMPLETED)
                if run_.task not in done:
                    return
                error = run_.task.exception()
                assert isinstance(error, SimulatedCrash), f"agent of {node.name} ended with {error!r}"
                crashes.append((node.name, len(node.driver.ops), str(error)))
                await run_.shutdown()
                node.driver.crash_after(1)  # the next agent gets one step further, then dies
                await h.start_agent(node, wait=False)

        stop = asyncio.Event()
        loops = [asyncio.get_running_loop().create_task(crash_loop(n, stop)) for n in mig]
        wave2 = [("k2-3g-a", MIG_3G), ("k2-3g-b", MIG_3G), ("k2-2g-a", MIG_2G), ("k2-m20-a", MPS_20)]
        recs += await h.create_pods(wave2)
        await run.settle(recs)
        stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
        for n in mig:
            n.driver.crash_after(10**9)  # disarmed
        run.notes["used_1g_before"] = used
        run.notes["crashes"] = len(crashes)
        run.require(len(crashes) >= 4, f"the re-carving should have been killed at several steps: {crashes}")
        run.notes["crash_points"] = [f"{n}: after {k} driver calls, {why}" for n, k, why in crashes]
        run.notes["destroyed_gi"] = {n.name: [(r.op.profile, r.op.start) for r in n.destroys if r.op.op == "destroy_gi"]
                                     for n in mig}
        assert mps.name in h.nodes
        await run.finish(recs)


async def test_agent_never_acks(control_plane):
    """Nodes A and B full; X (added then) is the only room, and its agent stops after its first
    report: wave 1 is planned on X and never acknowledged. Then the pods on A and B finish: wave 1
    can only run there, once the planner gives up waiting for X (ack timeout 8 s)."""
    async with scenario(control_plane, "agent_never_acks") as run:
        h = run.h
        a = await h.add_node("a100", A100, "mig", 1)
        b = await h.add_node("h100", H100, "mig", 1)
        mps = await h.add_node("mps", H100, "mps", 1)
        await run.start_agents()
        planner = run.planner("planner-a", env={"DYNPART_PLANNER_ACK_TIMEOUT_S": "8"})
        await run.leading(planner)
        fill = await h.create_pods([("f-3g-a", MIG_3G), ("f-3g-b", MIG_3G), ("f-3g-c", MIG_3G), ("f-3g-d", MIG_3G)])
        await h.wait_running(fill, timeout=60)
        x = await h.add_node("x", A100, "mig", 1)
        silent = await h.start_agent(x)  # reports once ...
        await silent.shutdown()  # ... and is gone
        del h.agents[x.name]
        before = run.spec_writes_seen()
        recs = await h.create_pods([("n-3g-a", MIG_3G), ("n-2g-a", MIG_2G), ("n-1g-a", MIG_1G),
                                    ("n-m10-a", MPS_10), ("n-m20-a", MPS_20)])

        def x_planned() -> bool:
            return bool(_runs(h.history.get(x.name, [])))
        await wait_until(x_planned, 30, f"a plan written on {x.name}", describe=h.describe)
        run.notes["x_spec"] = {k: v for k, v in h.history[x.name][-1].items() if k.startswith("dynpart.io/spec")}
        for r in fill:  # the jobs on A and B finish
            await h.delete_pod(r)
        await run.settle(recs)
        run.notes["placed_on"] = {r.key: r.node for r in recs}
        run.notes["spec_writes_after_burst"] = run.spec_writes_seen() - before
        run.notes["ack_timeouts_logged"] = planner.count(r"no acknowledgement from the node's agent")
        assert {a.name, b.name, mps.name} <= set(h.nodes)
        await run.finish(recs)
