"""The e2e harness: simulated GPU nodes on the local control plane (tests/e2e/cluster.py), with the
real pieces of dynpart around them.

- `SimNode` plays the kubelet and the device plugin of one GPU node, in-process: it owns a
  `FakeNvml` and a `FakePodResources`, registers the Node, keeps `status.capacity/allocatable`
  equal to what the device plugin would publish (MIG: NVIDIA's plugin, one
  `nvidia.com/mig-<profile>` per GPU instance with its compute instance; MPS: the agent's own
  device plugin, which serves MPS nodes in every mode, run unserved (`ShortcutPlugins`: no
  socket, no kubelet) and read directly: the lists the agent advertises), and when the real
  kube-scheduler binds a pod there, gives it free devices (a fake process on each MIG instance,
  so the fake driver itself refuses to destroy it; MPS: a slice the agent advertises) and marks
  it Running.
- `Harness` runs one in-process `Agent` per SimNode and watches the harness's pods and the nodes
  (the annotation history that `handshake_violations` checks).
- `PlannerProcess` is the planner as a real subprocess (`python -m dynpart.cli planner run`),
  its log in a file.

Times (reaction time: pod created to Running) are taken on the harness's clock
(`time.monotonic()`), from just before the create call to just after the Running patch."""

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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.fake import FakeNvml, FakeOp
from dynpart.agent.kube import KubeNodeApi, KubePluginPods, connect
from dynpart.agent.loop import Agent
from dynpart.agent.mps_daemon import FakeMpsDaemon
from dynpart.agent.nodepods import KubeNodePods
from dynpart.agent.podresources import FakePodResources, KubeletPodResources
from dynpart.catalog import GpuModel, default_catalog
from dynpart.kube.conventions import (
    GPU_COUNT_LABEL,
    GPU_PRODUCT_LABEL,
    PARTITIONING_LABEL,
    SPEC_PLAN,
    STATUS_PLAN,
)
from dynpart.kube.watching import Informer
from dynpart.resources import WHOLE_GPU, MigResource, MpsResource, mig_resource_name, parse_resource
from dynpart.settings import KubeSettings
from tests.e2e.apicount import RequestCounter
from tests.e2e.kubelet_model import Holding, KubeletModel
from tests.e2e.nvidia_plugin_model import APP, APP_LABEL, NvidiaPluginModel
from tests.e2e.nvidia_plugin_model import NAMESPACE as NVIDIA_NAMESPACE

REPO_ROOT = Path(__file__).resolve().parents[2]
CATALOG = default_catalog()
SYSTEM_NAMESPACE = "dynpart-system"
HARNESS_LABEL = "dynpart-e2e/harness"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
REFRESH_S = 0.1  # how often the simulated device plugins re-read the GPUs that changed
FULL_SWEEP_S = 2.0  # how often they re-read every node's GPUs
ASSIGN_RETRY_S = 20.0  # a bound pod waits this long for its devices before it is marked Failed
FAST = KubeSettings(backoff_initial_s=0.2, backoff_max_s=0.2)  # the agents' node watches come back at once


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


async def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
                     describe: Callable[[], Awaitable[str]] | None = None) -> Any:
    """Poll a (sync or async) condition until it is truthy; AssertionError naming `what` on time-out."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            extra = await describe() if describe else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{extra}")
        await asyncio.sleep(interval)


# --- metrics --------------------------------------------------------------------------------------

_agent_metrics_port: int | None = None


def agent_metrics_port() -> int:
    """The agents' /metrics server (in this process: the agents' counters are process-wide)."""
    global _agent_metrics_port
    if _agent_metrics_port is None:
        from prometheus_client import start_http_server

        port = free_port()
        start_http_server(port, "127.0.0.1")
        _agent_metrics_port = port
    return _agent_metrics_port


def scrape(port: int, timeout: float = 5.0) -> dict[str, float]:
    """`name{labels}` -> value, and `name` -> the sum over its labels, from http://127.0.0.1:port/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            if labels and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# --- the planner subprocess ----------------------------------------------------------------------


class PlannerProcess:
    """`dynpart planner run` in a subprocess, logging to `log_path`."""

    def __init__(self, kubeconfig: Path, log_path: Path, identity: str, env: dict[str, str] | None = None,
                 args: list[str] | None = None, count_requests: bool = False):
        self.kubeconfig = kubeconfig
        # through tests/e2e/apicount.py: its API requests counted on its /metrics (e2e_api_requests_total)
        self.count_requests = count_requests
        self.log_path = log_path
        self.identity = identity
        self.metrics_port = free_port()
        self.env = env or {}
        self.args = args or []
        self.proc: subprocess.Popen | None = None

    def entry(self) -> str:
        """The module run as the planner: `dynpart.cli`, or a wrapper that observes it."""
        return "tests.e2e.apicount" if self.count_requests else "dynpart.cli"

    def start(self) -> PlannerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYNPART_") and k != "KUBECONFIG"}
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        argv = [sys.executable, "-m", self.entry(), "planner", "run", "--kubeconfig", str(self.kubeconfig),
                "--metrics-port", str(self.metrics_port), "--lease-namespace", SYSTEM_NAMESPACE,
                "--identity", self.identity, *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT, env=env, start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def count(self, pattern: str) -> int:
        """Log lines matching the regular expression."""
        rx = re.compile(pattern)
        return sum(1 for line in self.log().splitlines() if rx.search(line))

    def plans(self) -> int:
        return self.count(r"dynpart\.planner: planned ")

    async def wait_log(self, pattern: str, timeout: float = 30.0) -> None:
        def seen() -> bool:
            if not self.alive:
                raise AssertionError(f"planner {self.identity} exited ({self.proc.returncode}):\n{self.log_tail()}")
            return self.count(pattern) > 0
        await wait_until(seen, timeout, f"planner {self.identity} to log {pattern!r}", interval=0.1,
                         describe=self._describe)

    async def _describe(self) -> str:
        return f"--- planner {self.identity} log ({self.log_path}) ---\n{self.log_tail()}"

    def peak_rss_mib(self) -> float:
        """The process's peak resident set size so far (VmHWM in /proc/<pid>/status), in MiB."""
        assert self.alive, f"planner {self.identity} is not running"
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kib = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))
        return kib / 1024

    def api_requests(self) -> Counter[tuple[str, str]]:
        """(verb, resource) -> requests sent so far (needs `count_requests`)."""
        metrics = scrape(self.metrics_port)
        rx = re.compile(r'^e2e_api_requests_total\{resource="([^"]*)",verb="([^"]*)"\}$')
        return Counter({(m.group(2), m.group(1)): int(v) for k, v in metrics.items() if (m := rx.match(k))})

    def kill(self) -> None:
        """kill -9: no clean stop, the lease is not released."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --- a simulated GPU node --------------------------------------------------------------------------


@dataclass
class DestroyRecord:
    """A destroy call the fake driver received, and who held the instance at that moment."""

    at: float
    op: FakeOp  # its `result` is filled in by the driver
    holder: str | None  # pod holding the instance's device, if any
    pids: tuple[int, ...]  # processes on the instance


_pids = itertools.count(20_000)


class ShortcutPlugins(DevicePluginManager):
    """The agent's own device plugin on a shortcut node: unserved (no socket, no kubelet); the
    harness reads its lists (what the kubelet would hold) and hands their devices to pods."""

    def __init__(self, pods: FakePodResources) -> None:
        super().__init__(tempfile.gettempdir(), serve=False, poll_s=0.5)
        self.updated = False  # the agent's first pass advertised what the node holds
        self.closed = False
        pods.on_allocatable = lambda: {r: [d.id for d in ds if d.healthy] for r, ds in self.advertised().items()}

    async def update(self, devices_by_resource: Any) -> None:
        await super().update(devices_by_resource)
        self.updated = True

    async def close(self) -> None:
        self.closed = True
        await super().close()


class SimNode:
    """One GPU node: the fake driver and kubelet state, and what its device plugin publishes."""

    def __init__(self, name: str, model: str, mode: str, gpus: int, *, product: str | None = None,
                 cpu: str = "64", memory: str = "512Gi"):
        self.name = name
        self.model: GpuModel = CATALOG.resolve(model)
        self.mode = mode
        self.count = gpus
        self.product = product or f"NVIDIA-{self.model.name}"
        self.cpu, self.memory = cpu, memory
        self.driver = FakeNvml(self.model, gpus, mig_enabled=mode == "mig")
        self.driver.before_op = self._before_op
        for control in ("reset", "reboot"):  # test controls that change the GPUs without a driver op
            setattr(self.driver, control, self._changing(getattr(self.driver, control)))
        # What the device plugin could publish changes with `version` (a driver op, a reset); the
        # harness's refresh loop re-reads only the nodes whose version moved (MPS nodes: every turn).
        self.version = 0
        self.refreshed = -1  # the version last read (and published, if it changed what is advertised)
        self.dirty_since: float | None = time.monotonic()  # first change not yet read
        self.publishes: list[tuple[float, dict[str, int]]] = []  # (when, what) each status patch advertised
        self.publish_lags: list[tuple[float, float]] = []  # (when, lag): first change of the GPUs -> its patch
        self.pod_resources = FakePodResources()
        self.holdings: dict[str, list[Holding]] = {}  # pod -> its devices
        self.labels: dict[str, str] = {}  # as last seen by the harness's node watch
        self.published: dict[str, int] | None = None
        self.destroys: list[DestroyRecord] = []
        self.dropped: list[str] = []  # MPS: slices pods held that the agent's plugin dropped (or sealed)
        self.plugins: ShortcutPlugins | None = None  # MPS, shortcut: the current agent's own device plugin
        self.by_profile_id = {p.gi_profile_id: p for p in self.model.mig_profiles}
        # with the kubelet model (Harness kubelet="model"): the node's kubelet, and NVIDIA's plugin
        # when it runs instead of the agent's own (plugin="nvidia")
        self.kubelet: KubeletModel | None = None
        self.nvidia: NvidiaPluginModel | None = None
        self.plugin: str | None = None  # "builtin" or "nvidia" (model only)
        self.root_dir: str | None = None

    # --- the fake driver's log ---

    def changed(self) -> None:
        """What the device plugin publishes may have changed: read it again."""
        self.version += 1
        if self.dirty_since is None:
            self.dirty_since = time.monotonic()

    def _changing(self, control: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            self.changed()
            return control(*args, **kw)
        return call

    def _before_op(self, op: FakeOp) -> None:
        # a driver call runs to its end before the event loop can run the refresh loop: marking
        # the node before the call is as good as after it
        self.changed()
        if op.op not in ("destroy_ci", "destroy_gi"):
            return
        holder = next((pod for pod, hs in self.holdings.items()
                       for h in hs if h.gpu == op.device and h.gi_id == op.gi_id), None)
        try:
            pids = tuple(self.driver.processes(op.device, op.gi_id)) if op.gi_id is not None else ()
        except Exception:
            pids = ()
        self.destroys.append(DestroyRecord(time.monotonic(), op, holder, pids))

    def check_mps_held(self) -> None:
        """Every MPS slice a pod holds is still advertised by the agent's plugin (or withdrawn for a
        moment, not sealed: the agent's re-check before removing a slice)."""
        plugins = self.plugins
        if self.mode != "mps" or plugins is None or plugins.closed or not plugins.updated:
            return  # no agent (its plugin died with it: the kubelet holds the pods' devices still)
        listed = {(r, d.id) for r, ds in plugins.advertised().items() for d in ds}
        for pod, hs in self.holdings.items():
            for h in hs:
                if not isinstance(parse_resource(h.resource), MpsResource):
                    continue
                if (h.resource, h.device) in listed or (h.device in plugins.withdrawn and h.device not in plugins.sealed):
                    continue
                problem = f"{self.name}: MPS slice {h.resource} {h.device} of pod {pod} is no longer advertised"
                if problem not in self.dropped:
                    self.dropped.append(problem)

    def destroy_violations(self) -> list[str]:
        """Destroy calls that hit an instance a pod or a process held, or that the driver refused;
        MPS slices in use that the agent's plugin dropped."""
        out = list(self.dropped)
        if self.kubelet is not None:
            out += self.kubelet.used_missing()
        for r in self.destroys:
            if r.holder or r.pids or r.op.result != "ok":
                out.append(f"{self.name}: {r.op.op} GPU {r.op.device} GI {r.op.gi_id} {r.op.profile}@{r.op.start}: "
                           f"held by {r.holder or '-'}, pids {list(r.pids)}, result {r.op.result}")
        return out

    # --- what the device plugin sees ---

    def devices(self) -> dict[str, list[tuple[str, int, int | None]]]:
        """resource -> every healthy device the plugin advertises (device id, GPU index, GI id)."""
        out: dict[str, list[tuple[str, int, int | None]]] = {}
        if self.mode == "mig":
            for d in self.driver.devices():
                if not d.mig_current:
                    out.setdefault(WHOLE_GPU, []).append((d.uuid, d.index, None))
                    continue
                for gi in self.driver.gpu_instances(d.index):
                    profile = self.by_profile_id.get(gi.profile_id)
                    if profile is not None and gi.compute_instances and gi.uuid:
                        out.setdefault(mig_resource_name(profile.name), []).append((gi.uuid, d.index, gi.gi_id))
            return out
        if self.plugins is None or self.plugins.closed:
            return out  # the agent's plugin is not running: nothing is advertised
        for resource, devices in self.plugins.advertised().items():
            for dev in devices:
                if dev.healthy:
                    out.setdefault(resource, []).append((dev.id, dev.gpu_index, None))
        return out

    def allocatable(self) -> dict[str, int]:
        return {res: len(ids) for res, ids in self.devices().items()}

    def free(self, resource: str) -> list[tuple[str, int, int | None]]:
        """Devices of `resource` no pod holds."""
        held_ids = {h.device for hs in self.holdings.values() for h in hs}
        return [d for d in self.devices().get(resource, []) if d[0] not in held_ids]

    def assign(self, pod: str, resource: str, count: int) -> list[Holding] | None:
        """What the kubelet's device manager does at admission: take `count` free devices."""
        free = self.free(resource)
        if len(free) < count:
            return None
        holdings = []
        # as the kubelet takes what the agent's plugin prefers (GetPreferredAllocation,
        # `packed_first`): the GPUs with the most devices held first, then by index, then as listed
        held = Counter(h.gpu for hs in self.holdings.values() for h in hs)
        order = sorted(range(len(free)), key=lambda i: (-held[free[i][1]], free[i][1], i))
        for dev_id, gpu, gi_id in [free[i] for i in order][:count]:
            h = Holding(resource, dev_id, gpu, gi_id)
            if isinstance(parse_resource(resource), MigResource):
                h.pid = next(_pids)
                self.driver.attach(gpu, h.pid, gi_id)
            holdings.append(h)
        self.holdings[pod] = holdings
        self.pod_resources.assign(pod, resource, *(h.device for h in holdings))
        return holdings

    def release(self, pod: str) -> None:
        for h in self.holdings.pop(pod, []):
            if h.pid is not None:
                self.driver.detach(h.gpu, h.pid)
        self.pod_resources.release(pod)

    def node_object(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": {
            PARTITIONING_LABEL: self.mode, GPU_PRODUCT_LABEL: self.product, GPU_COUNT_LABEL: str(self.count),
            "kubernetes.io/hostname": self.name, HARNESS_LABEL: "node"}}}

    def status_patch(self, slices: dict[str, int]) -> dict[str, Any]:
        resources: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        for res in (self.published or {}):
            resources[res] = None  # the plugin stopped advertising it
        resources.update({res: str(n) for res, n in slices.items()})
        return {"status": {"capacity": resources, "allocatable": resources}}


# --- the harness ----------------------------------------------------------------------------------


@dataclass
class AgentRun:
    agent: Agent
    api: Any
    stop: asyncio.Event
    task: asyncio.Task
    plugins: DevicePluginManager | None = None

    async def pause(self, timeout: float = 15.0) -> DevicePluginManager | None:
        """Stop the agent's loop but keep its device plugin serving (to hand to the next agent)."""
        plugins, self.plugins = self.plugins, None
        await self.shutdown(timeout)
        return plugins

    async def shutdown(self, timeout: float = 15.0) -> None:
        self.stop.set()
        if not self.task.done():
            await asyncio.wait([self.task], timeout=timeout)
            if not self.task.done():
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)
        if self.plugins is not None:
            await self.plugins.close()
        await self.api.close()


@dataclass
class PodRecord:
    key: str
    resource: str
    created_at: float
    accepted_at: float | None = None  # when the create call returned (the API server has the pod)
    node: str | None = None
    unschedulable_at: float | None = None  # when the pod watch first saw the scheduler mark it Unschedulable
    bound_at: float | None = None  # when the harness's pod watch saw the scheduler's binding
    running_at: float | None = None
    failed: str | None = None
    waited_for_devices: bool = False  # bound before its node had the devices free (a race the kubelet would fail)

    @property
    def reaction_s(self) -> float | None:
        return None if self.running_at is None else self.running_at - self.created_at


@dataclass
class Harness:
    kubeconfig: Path
    namespace: str = field(default_factory=lambda: f"e2e-{uuid.uuid4().hex[:8]}")
    agent_interval_s: float = 5.0
    planners: list[PlannerProcess] = field(default_factory=list)
    # "shortcut": the harness plays kubelet and device plugin in-process and writes allocatable
    # itself; "model": tests/e2e/kubelet_model.py per node (real sockets, the agent's own device
    # plugin or NVIDIA's plugin model, the real PodResources client). add_node can override.
    kubelet: str = "shortcut"
    plugin: str = "builtin"  # with the model, on MIG nodes: "builtin" (the agent's) or "nvidia"
    status_period_s: float = 10.0  # the kubelet model's nodeStatusUpdateFrequency
    container_start_s: float = 0.5  # the kubelet model: admission -> Running
    publish_allocatable: bool = True  # the agents publish new slices before the kubelet's status write
    nvidia_restart_delay_s: float = 1.5  # NVIDIA's plugin pod deleted -> enumerating again

    def __post_init__(self) -> None:
        self.run_id = uuid.uuid4().hex[:8]
        self.nodes: dict[str, SimNode] = {}
        self.agents: dict[str, AgentRun] = {}
        self.pods: dict[str, PodRecord] = {}
        self.history: dict[str, list[dict[str, str]]] = {}  # node -> its dynpart.io/ annotations, each change seen
        self.errors: list[str] = []
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._deleted: set[str] = set()
        self.agent_requests = RequestCounter()  # what the agents sent to the API server (tests/e2e/apicount.py)
        self.own_requests = RequestCounter()  # what the harness sent (the simulated kubelets and device plugins)
        self._root = tempfile.mkdtemp(prefix="e2e-kl-", dir="/tmp")  # the kubelet models' sockets (short paths)

    # --- set-up and tear-down ---

    async def start(self) -> Harness:
        self.api = await connect(str(self.kubeconfig))
        self.own_requests.install(self.api)
        self.core = client.CoreV1Api(self.api)
        await ensure_namespace(self.core, SYSTEM_NAMESPACE)
        await ensure_namespace(self.core, self.namespace)
        self.node_informer = Informer(self.core.list_node, self._on_node, name="harness nodes",
                                      label_selector=HARNESS_LABEL)
        self.pod_informer = Informer(self.core.list_pod_for_all_namespaces, self._on_pod, name="harness pods",
                                     label_selector=f"{HARNESS_LABEL}={self.run_id}")
        for coro in (self.node_informer.run(), self.pod_informer.run(), self._refresh_loop()):
            self._spawn(coro)
        await self.node_informer.synced.wait()
        await self.pod_informer.synced.wait()
        return self

    async def close(self) -> None:
        for run in list(self.agents.values()):
            await run.shutdown()
        self.agents.clear()
        for node in self.nodes.values():
            if node.nvidia is not None:
                await node.nvidia.close()
            if node.kubelet is not None:
                await node.kubelet.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rec in self.pods.values():
            ns, name = rec.key.split("/", 1)
            try:
                await self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:
                    raise
        for name in self.nodes:
            try:
                await self.core.delete_node(name)
            except ApiException as e:
                if e.status != 404:
                    raise
        if any(n.nvidia is not None for n in self.nodes.values()):
            for pod in (await self.core.list_namespaced_pod(NVIDIA_NAMESPACE, label_selector=f"{APP_LABEL}={APP}")).items:
                if pod.spec.node_name in self.nodes:
                    with contextlib.suppress(ApiException):
                        await self.core.delete_namespaced_pod(pod.metadata.name, NVIDIA_NAMESPACE, grace_period_seconds=0)
        await self.api.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.errors.append(f"harness task {task.get_name()} failed:\n"
                               + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
            self._changed.set()

    # --- nodes ---

    async def add_node(self, name: str, model: str, mode: str, gpus: int,
                       prepare: Callable[[SimNode], None] | None = None, kubelet: str | None = None,
                       plugin: str | None = None, **kw: Any) -> SimNode:
        """Register a simulated node; `prepare(node)` runs first (e.g. to leave instances on its GPUs).
        `kubelet` and `plugin` override the harness's choices for this node."""
        node = SimNode(f"{name}-{self.run_id}", model, mode, gpus, **kw)
        if prepare is not None:
            prepare(node)
        await self.core.create_node(node.node_object())
        if (kubelet or self.kubelet) == "model":
            return await self._add_model_node(node, plugin or self.plugin)
        now = now_rfc3339()
        version = node.version
        slices = node.allocatable()
        body = node.status_patch(slices)
        body["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                         "message": "simulated by the dynpart e2e harness",
                                         "lastHeartbeatTime": now, "lastTransitionTime": now}]
        await self.core.patch_node_status(node.name, body, _content_type=MERGE)
        node.published, node.refreshed, node.dirty_since = slices, version, None
        node.publishes.append((time.monotonic(), slices))
        self.nodes[node.name] = node  # from now on its device plugin and kubelet run
        return node

    async def _add_model_node(self, node: SimNode, plugin: str) -> SimNode:
        """A node with the kubelet model: no GPU resource in its status until its kubelet writes it."""
        now = now_rfc3339()
        body = node.status_patch({})
        body["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                         "message": "kubelet model of the dynpart e2e harness",
                                         "lastHeartbeatTime": now, "lastTransitionTime": now}]
        await self.core.patch_node_status(node.name, body, _content_type=MERGE)
        node.root_dir = tempfile.mkdtemp(prefix="n-", dir=self._root)
        node.plugin = plugin if node.mode == "mig" else "builtin"
        node.kubelet = KubeletModel(node.name, node.root_dir, core=self.core, driver=node.driver,
                                    status_period_s=self.status_period_s, container_start_s=self.container_start_s,
                                    holdings=node.holdings, on_pod=self._on_model_pod)
        node.published = {}
        self.nodes[node.name] = node  # before its kubelet watches pods: their records find the node
        await node.kubelet.start()
        if node.plugin == "nvidia":
            node.nvidia = NvidiaPluginModel(node.name, node.kubelet.plugin_dir, node.driver, core=self.core,
                                            restart_delay_s=self.nvidia_restart_delay_s)
            await node.nvidia.start()
        return node

    def _on_model_pod(self, key: str, phase: str, reason: str, message: str, at: float) -> None:
        rec = self.pods.get(key)
        if rec is None:
            return
        if phase == "Running":
            rec.running_at = at
        elif phase == "Failed":
            rec.failed = f"{reason}: {message}"
        self._changed.set()

    def admission_failures(self) -> list[str]:
        """Pods the kubelet models refused, with the kubelet's reason (UnexpectedAdmissionError...)."""
        return [f"{n.name}: {pod}: {reason}: {message}" for n in self.nodes.values() if n.kubelet
                for pod, reason, message in n.kubelet.admission_failures]

    def kubelet_problems(self) -> list[str]:
        """What a real node would have shown as broken: pods admitted without their devices,
        containers that could not start on their device, GPUs advertised twice, model errors."""
        out = []
        for n in self.nodes.values():
            if n.kubelet is not None:
                k = n.kubelet
                out += [f"{n.name}: {p}" for p in (k.admitted_without_devices + k.start_errors + k.exclusive_violations
                                                   + k.errors)]
            if n.nvidia is not None:
                out += n.nvidia.errors
        return out

    async def start_agent(self, node: SimNode, wait: bool = True, plugins: DevicePluginManager | None = None) -> AgentRun:
        """An agent for the node; with `wait`, once it has reported the node's GPUs (its first status).
        With the kubelet model: the agent's own device plugin on the node's plugin dir (or NVIDIA's
        plugin pod to restart), the real PodResources client on the model's socket, the pods bound
        to the node from the API server. `plugins`: the device plugin of an agent stopped earlier
        (`AgentRun.pause`), kept serving in between."""
        agent_metrics_port()
        api = await connect(str(self.kubeconfig))
        self.agent_requests.install(api)
        kw: dict[str, Any] = {}
        if node.kubelet is not None:
            if node.plugin == "builtin":
                if plugins is None:
                    plugins = DevicePluginManager(node.kubelet.plugin_dir, poll_s=0.1)
                    await plugins.start()
                kw.update(plugins=plugins, mps_daemon=FakeMpsDaemon(), publish_allocatable=self.publish_allocatable,
                          mps_log_dir=os.path.join(node.root_dir or self._root, "mps-log"))
            else:
                kw.update(plugin_pods=KubePluginPods(api, node.name, NVIDIA_NAMESPACE, f"{APP_LABEL}={APP}"))
            kw.update(pods=KubeletPodResources(node.kubelet.podresources_socket), node_pods=KubeNodePods(api, node.name, FAST))
        else:
            kw.update(pods=node.pod_resources)
            if node.mode == "mps":  # the agent's own plugin (MPS nodes need it), unserved; the harness reads it
                if plugins is None:
                    plugins = ShortcutPlugins(node.pod_resources)
                    await plugins.start()
                assert isinstance(plugins, ShortcutPlugins)
                node.plugins = plugins
                kw.update(plugins=plugins, mps_daemon=FakeMpsDaemon(), publish_allocatable=False,
                          mps_log_dir=os.path.join(self._root, f"mps-log-{node.name}"))
        agent = Agent(node.name, node_api=KubeNodeApi(api, node.name, FAST), driver=node.driver, catalog=CATALOG,
                      interval_s=self.agent_interval_s, **kw)
        stop = asyncio.Event()
        run = AgentRun(agent, api, stop, asyncio.get_running_loop().create_task(agent.run(stop)), plugins)
        self.agents[node.name] = run
        if wait:
            await wait_until(lambda: any("dynpart.io/status-mode" in a for a in self.history.get(node.name, [])) or
                             run.task.done(), 30, f"the first status of node {node.name}")
        return run

    def _on_node(self, kind: str, obj: dict[str, Any]) -> None:
        md = obj["metadata"]
        node = self.nodes.get(md["name"])
        if node is None or kind == "DELETED":
            return
        node.labels = dict(md.get("labels") or {})
        ann = {k: v for k, v in (md.get("annotations") or {}).items()
               if k.startswith("dynpart.io/") and k != "dynpart.io/status-heartbeat"}
        hist = self.history.setdefault(node.name, [])
        if not hist or hist[-1] != ann:
            hist.append(ann)

    async def _refresh_loop(self) -> None:
        """The device plugins: every REFRESH_S, publish the devices of each node whose GPUs changed
        (MPS nodes: every turn, what the agent's plugin lists), the nodes' status patches sent
        concurrently as independent plugins and kubelets would; every FULL_SWEEP_S, every node is
        read again (a safety net: every change the harness knows of marks its node)."""
        last_sweep = 0.0
        while True:
            now = time.monotonic()
            sweep = now - last_sweep >= FULL_SWEEP_S
            if sweep:
                last_sweep = now
            changed = []
            for node in list(self.nodes.values()):
                if node.kubelet is not None:
                    continue  # its kubelet model writes its status
                if not sweep and node.version == node.refreshed and node.mode != "mps":
                    continue
                node.check_mps_held()
                version = node.version
                slices = node.allocatable()
                if slices == node.published:
                    node.refreshed, node.dirty_since = version, None
                    continue
                changed.append(self._publish(node, version, slices))
            if changed:  # all of them finish before a failure (the first) ends the loop
                for result in await asyncio.gather(*changed, return_exceptions=True):
                    if isinstance(result, BaseException):
                        raise result
            await asyncio.sleep(REFRESH_S)

    async def _publish(self, node: SimNode, version: int, slices: dict[str, int]) -> None:
        await self.core.patch_node_status(node.name, node.status_patch(slices), _content_type=MERGE)
        now = time.monotonic()
        node.published = slices
        node.publishes.append((now, slices))
        if node.dirty_since is not None:
            node.publish_lags.append((now, now - node.dirty_since))
        node.refreshed = version
        if version == node.version:
            node.dirty_since = None

    # --- pods ---

    def pod_body(self, name: str, resource: str, count: int = 1, node: SimNode | None = None,
                 bound: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "containers": [{
                "name": "main", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi", resource: str(count)},
                              "limits": {resource: str(count)}}}]}
        if node is not None and bound:
            spec["nodeName"] = node.name  # bound at creation: no scheduler, straight to the kubelet
        elif node is not None:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node.name}
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": {HARNESS_LABEL: self.run_id}},
                "spec": spec}

    async def create_pod(self, name: str, resource: str, count: int = 1, node: SimNode | None = None,
                         bound: bool = False) -> PodRecord:
        """A pod asking for `count` of `resource` (only on `node`, when given; `bound`: created with
        spec.nodeName set, as a scheduler's binding)."""
        key = f"{self.namespace}/{name}"
        rec = PodRecord(key, resource, time.monotonic())
        self.pods[key] = rec
        await self.core.create_namespaced_pod(self.namespace, self.pod_body(name, resource, count, node, bound))
        rec.accepted_at = time.monotonic()
        return rec

    async def create_pods(self, specs: list[tuple[str, str]]) -> list[PodRecord]:
        """A burst: (name, resource) pods created concurrently."""
        return list(await asyncio.gather(*(self.create_pod(n, r) for n, r in specs)))

    async def delete_pod(self, rec: PodRecord) -> None:
        ns, name = rec.key.split("/", 1)
        await self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        await wait_until(lambda: rec.key in self._deleted, 30, f"pod {rec.key} to be deleted")

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        rec = self.pods.get(key)
        if rec is None:
            return
        if kind == "DELETED":
            self._deleted.add(key)
            if rec.node in self.nodes and self.nodes[rec.node].kubelet is None:
                self.nodes[rec.node].release(key)
            self._changed.set()
            return
        if rec.unschedulable_at is None and any(
                c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in (pod.get("status") or {}).get("conditions") or []):
            rec.unschedulable_at = time.monotonic()
        node = (pod.get("spec") or {}).get("nodeName")
        if node and rec.node is None and node in self.nodes:
            rec.node = node
            rec.bound_at = time.monotonic()
            if self.nodes[node].kubelet is None:  # else its kubelet model admits it
                self._spawn(self._admit(rec, pod))

    async def _admit(self, rec: PodRecord, pod: dict[str, Any]) -> None:
        """The kubelet: devices from the device plugin, then the pod runs."""
        node = self.nodes[rec.node]  # type: ignore[index]
        requests = pod["spec"]["containers"][0]["resources"]["limits"]
        count = int(requests[rec.resource])
        deadline = time.monotonic() + ASSIGN_RETRY_S
        while node.assign(rec.key, rec.resource, count) is None:
            rec.waited_for_devices = True
            if rec.key in self._deleted:
                return
            if time.monotonic() > deadline:
                held = sorted(h.device for hs in node.holdings.values() for h in hs)
                rec.failed = f"node {node.name} has no free {rec.resource} (advertised {node.published}, held {held})"
                await self._set_phase(rec, "Failed", rec.failed)
                self._changed.set()
                return
            await asyncio.sleep(REFRESH_S)
        await self._set_phase(rec, "Running")
        rec.running_at = time.monotonic()
        self._changed.set()

    async def _set_phase(self, rec: PodRecord, phase: str, message: str = "") -> None:
        ns, name = rec.key.split("/", 1)
        now = now_rfc3339()
        ok = "True" if phase == "Running" else "False"
        status: dict[str, Any] = {
            "phase": phase, "startTime": now, "hostIP": "127.0.0.1", "podIP": "10.244.0.1",
            "conditions": [{"type": t, "status": ok, "lastTransitionTime": now}
                           for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "imageID": "",
                                   "ready": phase == "Running", "restartCount": 0, "started": phase == "Running",
                                   "state": {"running": {"startedAt": now}} if phase == "Running" else
                                   {"terminated": {"exitCode": 1, "reason": "UnexpectedAdmissionError",
                                                   "startedAt": now, "finishedAt": now}}}]}
        if message:
            status["reason"], status["message"] = "UnexpectedAdmissionError", message
        try:
            await self.core.patch_namespaced_pod_status(name, ns, {"status": status}, _content_type=STRATEGIC)
        except ApiException as e:
            if e.status != 404:
                raise

    async def wait_running(self, recs: list[PodRecord], timeout: float = 60.0) -> None:
        """Until every pod runs; fails at once when one failed."""
        deadline = time.monotonic() + timeout
        while True:
            self._changed.clear()
            failed = [f"{r.key}: {r.failed}" for r in recs if r.failed]
            if failed or self.errors:
                raise AssertionError("pods failed:\n" + "\n".join(failed + self.errors) + "\n" + await self.describe())
            if all(r.running_at is not None for r in recs):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [r for r in recs if r.running_at is None]
                raise AssertionError(f"{len(waiting)} pod(s) not Running after {timeout:.0f} s: "
                                     f"{', '.join(r.key for r in waiting[:10])}\n" + await self.describe(waiting))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self._changed.wait()

    async def events_of(self, rec: PodRecord) -> list[Any]:
        ns, name = rec.key.split("/", 1)
        resp = await self.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
        return list(resp.items)

    # --- checks ---

    def destroy_violations(self) -> list[str]:
        return [v for n in self.nodes.values() for v in n.destroy_violations()]

    def handshake_violations(self) -> list[str]:
        """The planner's side of the handshake, from every state of the nodes the watch saw: a
        node's spec-plan changes only when the status has acknowledged the previous one, and
        no plan id is written to a node twice."""
        out = []
        for node, hist in self.history.items():
            seen_ids: set[str] = set()
            prev_spec, prev_status = None, None
            for ann in hist:
                spec, status = ann.get(SPEC_PLAN), ann.get(STATUS_PLAN)
                if spec != prev_spec:
                    # a revocation (dynpart.io/spec-revokes) replaces an unacknowledged plan by design
                    revokes = ann.get("dynpart.io/spec-revokes") == prev_spec
                    if prev_spec is not None and prev_status != prev_spec and not revokes:
                        out.append(f"{node}: spec-plan {prev_spec} -> {spec} while status-plan was {prev_status}")
                    if spec in seen_ids:
                        out.append(f"{node}: plan id {spec} written twice")
                    if spec is not None:
                        seen_ids.add(spec)
                prev_spec, prev_status = spec, status
        return out

    def reaction_times(self) -> list[float]:
        return [r.reaction_s for r in self.pods.values() if r.reaction_s is not None]

    def write_reaction(self, path: Path, recs: list[PodRecord]) -> dict[str, Any]:
        times = [r.reaction_s for r in recs if r.reaction_s is not None]
        summary = {"pods": len(recs), "running": len(times), "median_s": round(statistics.median(times), 3),
                   "p95_s": round(percentile(times, 95), 3), "max_s": round(max(times), 3),
                   "min_s": round(min(times), 3),
                   "by_resource": {res: round(statistics.median([r.reaction_s for r in recs
                                                                 if r.resource == res and r.reaction_s]), 3)
                                   for res in sorted({r.resource for r in recs})}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    async def describe(self, recs: list[PodRecord] | None = None) -> str:
        """What a person debugging a failure wants: waiting pods, node states, logs."""
        lines = []
        for r in (recs or [])[:8]:
            ns, name = r.key.split("/", 1)
            try:
                pod = await self.core.read_namespaced_pod(name, ns)
                conds = [(c.type, c.status, c.reason, c.message) for c in pod.status.conditions or []]
                lines.append(f"pod {r.key} ({r.resource}) node={pod.spec.node_name} phase={pod.status.phase} {conds}")
                for ev in await self.events_of(r):
                    lines.append(f"   event {ev.reason}: {ev.message}")
            except ApiException as e:
                lines.append(f"pod {r.key}: {e.status}")
        for node in self.nodes.values():
            try:
                obj = await self.core.read_node(node.name)
                ann = {k: v for k, v in (obj.metadata.annotations or {}).items() if k.startswith("dynpart.io/")}
                lines.append(f"node {node.name}: allocatable {obj.status.allocatable} annotations {ann}")
            except ApiException as e:
                lines.append(f"node {node.name}: {e.status}")
            lines.append(f"   holdings {[(p, [h.device for h in hs]) for p, hs in node.holdings.items()]}")
        for p in self.planners:
            lines.append(f"--- planner {p.identity} log ({p.log_path}) ---\n{p.log_tail()}")
        return "\n".join(lines)


async def ensure_namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        await core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    except ApiException as e:
        if e.status != 409:
            raise


def ensure_system_namespace(kubeconfig: Path) -> None:
    """From synchronous code (a module-scoped fixture): create dynpart-system if missing."""
    async def main() -> None:
        api = await connect(str(kubeconfig))
        try:
            await ensure_namespace(client.CoreV1Api(api), SYSTEM_NAMESPACE)
        finally:
            await api.close()
    asyncio.run(main())


def module_planner(e2e_cluster: Any, tmp_path_factory: Any, identity: str,
                   env: dict[str, str] | None = None) -> Iterator[PlannerProcess]:
    """The body of a module-scoped planner fixture: one real planner subprocess (leader election
    on), stopped after the module."""
    ensure_system_namespace(e2e_cluster.kubeconfig)
    proc = PlannerProcess(e2e_cluster.kubeconfig, tmp_path_factory.mktemp("planner") / f"{identity}.log", identity,
                          env=env).start()
    try:
        yield proc
    finally:
        proc.stop()
