"""The agent's loop: on a spec change (node watch) or every `interval_s`, one pass: read the
spec, apply it (MIG or MPS), write the status. The handshake (docs/protocol.md): the status
names the plan id of the spec once the pass acted on it, so the planner knows the node's
status is the outcome of its last plan.

A pass is idempotent and starts from what the driver reports, so an agent restarted in the
middle of a pass converges on its first pass. A pass that cannot observe the node safely (no
driver, no PodResources) changes nothing and reports the error, keeping the last status.

With the built-in device plugin (`plugins`, docs/agent.md "Device plugin") every pass ends by
advertising what the driver holds (a `GpuView` per GPU), a slice is withdrawn and re-checked
before it is destroyed, and a plan is acknowledged only once the GPUs hold it, the lists are
written and the kubelet reports the devices (PodResources GetAllocatableResources); new counts
can be published to the node's status before the kubelet's own write (`publish_allocatable`),
and again at once when the node shows other counts than the kubelet holds (a kubelet restart).
MPS slices are always served by the built-in plugin. With NVIDIA's plugin (`plugin_pods`) on a
MIG node, a MIG change restarts its pod on the node and the plan is acknowledged once the node's
allocatable shows the new MIG devices (the built-in plugin then serves the node only in MPS
mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from dynpart.agent import metrics
from dynpart.agent.capability_reader import mig_state, mps_memory_mib, read_capability
from dynpart.agent.compute_modes import ComputeModes
from dynpart.agent.deviceplugin.devices import (
    DeviceListError,
    GpuView,
    MigDeviceView,
    PluginDevice,
    advertise,
    held_elsewhere,
    packed_first,
)
from dynpart.agent.deviceplugin.server import DevicePluginManager
from dynpart.agent.driver.interface import GPU_IS_LOST, GPU_LOST_REASON, DeviceInfo, GpuDriver, GpuDriverError, GpuInstanceInfo
from dynpart.agent.driver.nvcaps import mig_cap_minors
from dynpart.agent.driver.threaded import AsyncDriver, as_async
from dynpart.agent.guard import SliceGuard
from dynpart.agent.kube import NodeApi, NodeView, PluginPods
from dynpart.agent.mig_agent import MigAgent, PassResult, instances_and_processes
from dynpart.agent.mps_daemon import MpsDaemon
from dynpart.agent.mps_plugin import MpsPluginAgent
from dynpart.agent.nodepods import NodePods
from dynpart.agent.podresources import AssignedDevice, DeviceIds, PodResources, base_device_id
from dynpart.annotations import (
    MAX_GPU_INDEX,
    DecodedSpec,
    annotation_patch,
    decode_spec,
    decode_status,
    encode_status,
    error_text,
    format_heartbeat,
    is_plan_id,
)
from dynpart.capability import encode_capability, node_model
from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.kube.client import Obj
from dynpart.kube.conventions import (
    MIG_RESOURCE_PREFIX,
    PARTITIONING_LABEL,
    SPEC_PREFIX,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_MODE,
    STATUS_PLAN,
    STATUS_PREFIX,
    STATUS_UNHEALTHY,
)
from dynpart.kube.recording import EventRecorder
from dynpart.kube.retrying import retrying
from dynpart.probing import Liveness, keep_beating
from dynpart.resources import WHOLE_GPU, MpsResource, is_slice_resource, known_resource, mig_resource_name
from dynpart.settings import KubeSettings
from dynpart.snapshot import GpuLayout, MigInstance, Mode, MpsSlice, NodeLayout

log = logging.getLogger("dynpart.agent")

# NVML errors that only a new container cures: the kernel driver was unloaded, reloaded or
# upgraded under the agent (GPU Operator's driver container restarting), and the libnvidia-ml
# mounted into this container no longer matches it (nvmlInit keeps failing)
DRIVER_REPLACED = frozenset({"LIB_RM_VERSION_MISMATCH", "DRIVER_NOT_LOADED"})
# passes in a row failing so before the agent exits for the kubelet to start it again
DRIVER_REPLACED_PASSES = 3
# On the way out of a node that left dynpart: the node read, the GPU list and the compute modes set
# back, all together (the kubelet kills the agent soon after SIGTERM)
HAND_BACK_S = 8.0
# SIGTERM (a rollout, a node drain): the pass running may end within this long, then it is cancelled
# (the kubelet SIGKILLs the agent terminationGracePeriodSeconds, 30 s in the chart, after SIGTERM)
PASS_GRACE_S = 3.0

# Liveness (/healthz): the kubelet restarts the agent when one of these stops beating. Neither
# waits on the GPU driver: a driver that does not answer is reported (every GPU unhealthy), not
# cured by a restart (which, with the MPS daemon in the agent's container, mps_control_dir unset,
# would also end it and its clients' CUDA contexts).
# - the event loop turns: a task beats every `loop_beat_s`; silent `loop_stall_s` means the loop
#   is blocked (nothing else is answered then either: the kubelet's Allocate, ListAndWatch);
#   expected from the agent's start (cli), before any pass;
LOOP_BEAT = "event loop"
# far above any step the loop runs without awaiting, far below what a kubelet's probe waits
LOOP_STALL_S = 20.0
# - passes go on: a pass beats at its start and after each driver call (and while a long batch of
#   reads goes on: `AsyncDriver.on_answer`), whatever its length.
PASS_BEAT = "reconcile loop"


class DriverReplaced(DynpartError):
    """The NVIDIA driver changed under the agent: it exits, and its new container gets the new
    driver's library."""


@dataclass
class PassReport:
    mode: Mode | None
    plan_id: str | None  # the plan id acknowledged by this pass (None: none)
    errors: list[str] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)  # the status annotations written
    failed: bool = False  # the pass could not observe or act (nothing was changed)
    waiting: list[str] = field(default_factory=list)  # why the plan is applied but not acknowledged yet


class Agent:
    retry_max_s = 2.0  # the longest wait between passes while a plan waits (its first long_wait_s)
    long_wait_s = 120.0  # after waiting this long for the same things, up to the interval between passes

    def __init__(self, node: str, *, node_api: NodeApi, driver: GpuDriver | AsyncDriver, pods: PodResources,
                 catalog: Catalog, interval_s: float = 10.0, heartbeat_s: float = 300.0, capacity_gb: int | None = None,
                 kube: KubeSettings | None = None, now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 liveness: Liveness | None = None, leader_term: Callable[[], Awaitable[int | None]] | None = None,
                 plugins: DevicePluginManager | None = None, node_pods: NodePods | None = None,
                 mps_daemon: MpsDaemon | None = None, mps_log_dir: str = "/var/log/nvidia-mps",
                 publish_allocatable: bool = True, plugin_pods: PluginPods | None = None,
                 withdraw_settle_s: float = 0.5, retry_s: float = 0.5, mps_exclusive_process: bool = True,
                 compute_modes_file: str | None = None):
        self.node = node
        pods = _Remembering(pods)  # every reader shares it: the last assignments seen, without a call more
        # the built-in device plugin (started and closed by the caller): it serves the node's devices,
        # except on a MIG node when NVIDIA's plugin does (`plugin_pods`); MPS nodes need it
        self.plugins = plugins
        if plugins is not None and plugins.held is None:
            # what the kubelet holds decides when a device may be added (see DevicePluginManager)
            plugins.held = pods.allocatable
        if plugins is not None and plugins.preferred is None:
            plugins.preferred = self._preferred
        self._used_per_gpu: dict[int, int] = {}  # slices in use per GPU index, as the last pass saw them
        self.node_pods = node_pods  # pods bound to the node: what they need is never destroyed
        self.mps_daemon = mps_daemon
        self.mps_log_dir = mps_log_dir
        self.publish_allocatable = publish_allocatable
        self.plugin_pods = plugin_pods  # NVIDIA's plugin pod on this node, restarted after a MIG change
        self._builtin = False  # whether the built-in plugin serves the node (set by each pass, from its mode)
        self.retry_s = retry_s  # a plan applied but not yet acknowledged is looked at again this soon
        self.guard = SliceGuard(pods, node_pods, plugins, settle_s=withdraw_settle_s,
                                on_withdrawn=self._publish if plugins is not None and publish_allocatable else None)
        self._mps_plugin: MpsPluginAgent | None = None
        self._capacity: int = 0
        # the devices (resource, UUID) NVIDIA's plugin was restarted for, or found listing: the MIG
        # devices and the GPUs out of MIG mode (`nvidia.com/gpu`)
        self._restarted_for: frozenset[tuple[str, str]] | None = None
        self._driver_replaced = 0  # passes in a row that failed with a DRIVER_REPLACED error
        self._waiting = False
        # what the last pass waited for (the plan, the reasons), since when, and the wait before
        # the next pass: doubled while it stays the same, up to `retry_max_s` (an acknowledgement
        # within seconds of what it waits for: the planner gives up after 60 s), then, after
        # `long_wait_s` of the same wait, up to the interval (a kubelet that never reports the
        # devices is not asked twice a second for weeks)
        self._waiting_for: tuple[str | None, ...] = ()
        self._waiting_since = 0.0
        self._retry_delay = retry_s
        # the problems the last pass logged: logged again only when they change (a GPU unhealthy for
        # weeks is said once, then at DEBUG each pass; the status and the Events say it all along)
        self._logged: frozenset[str] = frozenset()
        self._cleared_plan: str | None = None  # the last spec plan id the fencing check let through
        self._heartbeat_at = -float("inf")  # time.monotonic() of the last status write with a heartbeat
        self._drain: tuple[int, ...] = ()  # the GPUs the spec applied last drains
        self.unhealthy: dict[int, str] = {}  # GPU index -> why the driver says it is unhealthy (last pass)
        self.held_elsewhere: dict[str, list[str]] = {}  # device id -> its holders under another name (last lists)
        self._node_read: NodeView | None = None  # the node as the pass running read it
        self._indices: set[int] = set()  # the GPU indices the driver has listed
        # the driver's MIG capability minors (`driver.nvcaps`), read once (a fixed table): the device
        # plugin's DeviceSpecs for MIG devices; empty until read
        self._mig_caps: dict[str, int] = {}
        # what a lost GPU (`DeviceInfo.lost`: fallen off the bus, the others answer) is reported and
        # listed as: each GPU as the last pass that could read it reported it (its slices) and
        # advertised it (its devices), and, with NVIDIA's plugin, its MIG devices
        self._last_gpus: dict[int, GpuLayout] = {}
        self._last_views: dict[int, GpuView] = {}
        self._last_mig_devices: dict[int, tuple[frozenset[tuple[str, str]], frozenset[str]]] = {}
        # early publishing (publish_allocatable): what the node's allocatable should show (the last
        # _publish's counts); a node that shows otherwise (the kubelet's own status write after its
        # restart, with no device yet) or a plugin's new registration wakes the publisher
        self._published: dict[str, int] = {}
        self._publish_lock = asyncio.Lock()
        self._nudge = asyncio.Event()
        self.republish_s = 3.0  # how long the publisher looks again for the kubelet to hold the devices
        self.liveness = liveness or Liveness()
        self.loop_beat_s = 1.0
        self.loop_stall_s = LOOP_STALL_S
        # the planner's current leader term (agent.kube.lease_term_reader); None: no fencing
        self.leader_term = leader_term
        self.node_api = node_api
        # every driver call is awaited: made on the driver's own thread within a time limit, so that
        # this loop (the device plugin's Allocate and ListAndWatch, the node watch) never waits on NVML
        self.driver = as_async(driver)
        # EXCLUSIVE_PROCESS on the GPUs with MPS slices; what dynpart set is remembered in the file
        self.compute_modes = ComputeModes(self.driver, compute_modes_file, enabled=mps_exclusive_process)
        self.driver.on_answer = lambda: self.liveness.beat(PASS_BEAT)
        self.pods = pods
        self.catalog = catalog
        self.interval_s = interval_s
        # a status write that would only move the heartbeat is made this seldom: every Node write
        # goes to etcd whole and to every Node watcher of the cluster (the kubelet writes its own
        # unchanged node status only every 5 minutes for the same reason, KEP-589)
        self.heartbeat_s = max(heartbeat_s, interval_s)
        self.capacity_gb = capacity_gb
        self._capacity_above_said = False
        self.now = now
        self._model: GpuModel | None = None
        self._mig_states: tuple[str, ...] = ()
        self._capability: str | None = None  # the encoded report, written with every status
        self._disagreements: list[str] = []
        self._mig: MigAgent | None = None
        self.kube = kube or KubeSettings()
        # Events on the node, once per reason and message (a pass repeats every interval)
        self._events = EventRecorder(self._post_event, self.kube)

    async def model(self, devices: list[DeviceInfo] | None = None) -> GpuModel:
        """The model this node is planned with: what the driver describes (read again when a
        GPU's MIG mode changes: a driver may list profiles only in MIG mode), narrowed by the catalog,
        as the planner derives it from the same report (`dynpart.capability.node_model`).
        `devices`: the GPUs as this pass read them (None: read them now)."""
        if devices is None:
            devices = await self.driver.devices()
        states = tuple(mig_state(d) for d in devices)
        if self._model is None or states != self._mig_states:
            try:
                capability, unread = await self.driver.read(read_capability, self.catalog)
                if self.capacity_gb:
                    # the memory reported is what MPS slices may take: the planner derives its MPS
                    # capacity from the same report, so it plans no slice this agent would refuse
                    above = sorted({k.memory_mib >> 10 for k in capability.kinds
                                    if k.memory_mib < self.capacity_gb * 1024})
                    if above and not self._capacity_above_said:
                        self._capacity_above_said = True
                        log.warning("node %s: mps_capacity_gb %d is above the memory the driver reports "
                                    "(%s GiB): it only lowers the MPS capacity, so the reported memory is used",
                                    self.node, self.capacity_gb, ", ".join(map(str, above)))
                    capability = capability.model_copy(update={"kinds": tuple(
                        k.model_copy(update={"memory_mib": min(k.memory_mib, self.capacity_gb * 1024)})
                        for k in capability.kinds)})
                choice = node_model(capability, self.catalog)
            except GpuDriverError as e:
                raise GpuDriverError(e.code, f"node {self.node}: {e}") from None
            except DynpartError as e:
                raise DynpartError(f"node {self.node}: {e}") from None
            if choice.model != self._model:
                self._mig = None  # built for the old model
                if self._mps_plugin is not None:  # (a lower capacity_gb is in the model's already)
                    self._mps_plugin.capacity_gb = choice.model.mps_capacity_gb
                    self._mps_plugin.max_slices = choice.model.mps_max_clients
                for note in [*unread, *choice.disagreements]:
                    log.warning("node %s: %s", self.node, note)
            self._model, self._mig_states = choice.model, states
            self._capability = encode_capability(capability)
            self._disagreements = [*unread, *choice.disagreements]
        return self._model

    def _mode(self, node: NodeView, spec_mode: Mode | None, devices: list[DeviceInfo]) -> Mode:
        if spec_mode is not None:
            return spec_mode
        label = node.labels.get(PARTITIONING_LABEL)
        if label == "mig":
            return "mig"
        if label == "mps":
            return "mps"
        return "mig" if any(d.mig_current for d in devices) else "mps"

    async def reconcile_once(self) -> PassReport:
        started = time.perf_counter()
        try:
            report = await self._pass()
        except Exception as e:
            metrics.PASSES.labels("error").inc()
            if not isinstance(e, DynpartError) and self._node_read is not None:
                await self._report_unexpected(self._node_read, e)
            raise
        metrics.PASSES.labels("error" if report.failed else "ok").inc()
        metrics.PASS_SECONDS.observe(time.perf_counter() - started)
        metrics.ERRORS.set(len(report.errors))
        return report

    async def _pass(self) -> PassReport:
        self.held_elsewhere = {}  # found again by this pass's lists, if it lists devices
        self._node_read = None
        node = self._node_read = await self.node_api.get()
        try:
            # read once for what the pass decides before it acts; what acts reads again, and what
            # guards a destroy reads right before it
            devices = await self.driver.devices()
            model = await self.model(devices)
            # the memory NVML reports, or less (capacity_gb): the model's MPS capacity is derived from it
            capacity = self._capacity = model.mps_capacity_gb
            await self._readmit_leftovers(devices)
            spec = decode_spec(node.annotations, model, node=self.node, capacity=capacity)
            layout = spec.layout
            fenced = await self._fenced(spec, node)
            if fenced:
                layout = None  # a deposed planner's plan: observe and report, change nothing
            elif layout is not None and (spec.problems or spec.plan_id is None):
                # a spec with a malformed or missing part is refused whole: applying the rest
                # would empty what the bad part describes (its free slices destroyed)
                layout = None
                if spec.plan_id is None:
                    spec.problems.append("the spec has no valid plan id")
                spec.problems.append(f"spec {spec.plan_id or '(no plan id)'} refused: nothing applied until it is "
                                     "well-formed")
            mode = self._mode(node, layout.mode if layout else None, devices)
            self._drain = spec.drain if layout is not None else ()
            self._builtin = self.plugins is not None and (mode == "mps" or self.plugin_pods is None)
            self.guard.plugins = self.plugins if self._serving() else None  # withdraw only what it serves
            if mode == "mig":
                if self._mig is None:
                    self._mig = MigAgent(self.driver, self.pods, model, guard=self.guard)
                desired_mig = None if layout is None else {g.index: [(m.profile, m.start) for m in g.mig]
                                                           for g in layout.gpus}
                if layout is not None and self._mps_plugin is None and self.plugins is not None:
                    # a restarted agent on a node switched from MPS meanwhile: the free slices the
                    # last one served (its status) leave through the guard as a running agent's do
                    previous = _last_mps_slices(node, model, self.node, capacity)
                    if previous:
                        self._mps_plugin = self._new_mps_plugin(model, capacity, previous)
                left_errors = await self._leave_mps() if layout is not None else []
                # before the MIG pass: a GPU whose last MPS slice just went is set back before it
                # may enter MIG mode (its compute mode is then out of reach); one that could not be
                # counts as in use for MIG, its mode not changed, until it is
                left_errors += await self.compute_modes.sync(devices, await self._mps_sliced(devices))
                left = {i: [u for u in users if u != COMPUTE_MODE_IN_USE] for i, users in self._mig.mps_left.items()}
                for index in self.compute_modes.blocked:
                    left[index] = [*left.get(index, ()), COMPUTE_MODE_IN_USE]
                self._mig.mps_left = {i: users for i, users in left.items() if users}
                if desired_mig is not None and self.plugin_pods is not None and not self._builtin:
                    by_index = sorted(i for _, i in _mig_ids(await self.pods.allocatable()) if not i.startswith("MIG-"))
                    if by_index:
                        # a pod's MIG device could not be told from PodResources: one bound and not
                        # yet running would look free, and its instance could be destroyed
                        desired_mig = None
                        left_errors.append(
                            f"NVIDIA's device plugin names MIG devices by index ({', '.join(by_index[:4])}): the agent "
                            "cannot tell which MIG device a pod holds, so it changes none; set NVIDIA's plugin's "
                            "deviceIDStrategy to uuid (the default)")
                result = await self._mig.apply(desired_mig, spec.drain)
                result.errors[:0] = left_errors
            else:
                if self.plugins is None:
                    raise DynpartError("this node is in MPS mode, whose slices only the agent's own device plugin "
                                       "serves, and this agent runs none")
                if self._mps_plugin is None:
                    # a restarted agent: the free slices the last one served are in its status only
                    self._mps_plugin = self._new_mps_plugin(model, capacity,
                                                            _last_mps_slices(node, model, self.node, capacity))
                desired_mps = None if layout is None else {g.index: [s.size for s in g.mps] for g in layout.gpus}
                result = await self._mps_plugin.apply(desired_mps, spec.drain)
                # before the slices, or the GPUs left whole, are listed (_serve)
                result.errors += await self.compute_modes.sync(result.devices, await self._mps_sliced(result.devices))
        except DynpartError as e:
            # Not safe to act or to describe the GPUs: keep the last status, report the error.
            self._log_problems(logging.ERROR, [str(e)])
            unhealthy = None
            if isinstance(e, GpuDriverError):
                self._driver_replaced = self._driver_replaced + 1 if e.code in DRIVER_REPLACED else 0
                await self._all_unhealthy(e, node)
                unhealthy = set(self.unhealthy)
                if e.code == GPU_IS_LOST:
                    # a GPU fell off the bus during the pass: the next pass, soon, lists it lost
                    # and serves the others again
                    self._waiting = True
                    self._retry_delay = self.retry_s
            return await self._report_failure(node, str(e), unhealthy, as_the_gpus_are=unhealthy is None)
        self._driver_replaced = 0
        result.gpus = self._with_lost(result, node, model, mode)
        try:
            # a MIG mode changed by this pass changes what the driver lists: report it now (from the
            # GPUs as the pass last read them, after its changes)
            await self.model(result.devices)
        except DynpartError as e:
            log.warning("node %s: %s", self.node, e)
        errors = [*spec.problems, *fenced, *result.errors]
        if self.plugins is not None and self.plugins.cdi is not None and self.plugins.cdi.problem:
            errors.append(f"CDI spec: {self.plugins.cdi.problem}")
        waiting: list[str] = []
        severe: frozenset[str] = frozenset()
        try:
            waiting = await self._serve(mode, result, layout, node)
        except DynpartError as e:  # the node is as the pass left it; say why nothing is acknowledged
            if isinstance(e, GpuDriverError):
                await self._all_unhealthy(e, node)
            errors.append(f"serving the devices: {e}")
            severe = frozenset(errors[-1:])  # logged with the others below, at ERROR
            waiting = ["the devices could not be served (see the error above)"] if layout is not None else []
        applied = result.applied and layout is not None and not waiting
        if result.applied and layout is not None and waiting:
            errors += [f"plan {spec.plan_id} is not acknowledged yet: {w}" for w in waiting]
        if not self._serving():
            # NVIDIA's plugin serves the node (it reads health itself): read it for the planner
            try:
                self.unhealthy = await self._health(result.devices)
            except GpuDriverError as e:
                log.warning("node %s: reading the GPUs' health: %s", self.node, e)
        for device, holders in sorted(self.held_elsewhere.items()):
            errors.append(f"device {device} is held by {'; '.join(holders)}, under another resource name or id "
                          "(another device plugin's): listed Unhealthy until they end, so that the kubelet gives "
                          "it to no second pod")
        for index, why in sorted(self.unhealthy.items()):
            errors.append(f"GPU {index} is unhealthy ({why}): its devices are advertised Unhealthy and no pod gets "
                          "them until it recovers")
        self._wait_longer((spec.plan_id, *waiting) if waiting else ())
        self._waiting = bool(waiting)
        self._used_per_gpu = {g.index: sum(m.used for m in g.mig) + sum(x.used for x in g.mps) for g in result.gpus}
        ack = spec.plan_id if applied else node.annotations.get(STATUS_PLAN)
        status = encode_status(NodeLayout(node=self.node, mode=mode, gpus=result.gpus),
                               _valid_or_none(ack), errors, self.now(), unhealthy=self.unhealthy)
        if self._capability is not None:
            status[STATUS_CAPABILITY] = self._capability
        self._log_problems(logging.WARNING, errors, severe)  # (before the write, which may fail)
        await self._write(node, status)
        if self._disagreements:
            await self._event("CatalogDisagreement", "the driver and the catalog differ (the driver's values are "
                              "used): " + "; ".join(self._disagreements), True)
        for reason, clash in _nvidia_components(node, mode, self._builtin):
            await self._event(reason, clash, True)
        if self.unhealthy:
            await self._event("GpuUnhealthy", "; ".join(f"GPU {i}: {why}" for i, why in sorted(self.unhealthy.items()))
                              + ": its devices are advertised Unhealthy until it recovers", True)
        if spec.problems:
            await self._event("DynpartInvalidSpec", "ignored malformed annotations: " + "; ".join(spec.problems), True)
        if result.errors:
            await self._event("ApplyFailed", "; ".join(result.errors), True)
        if self._mps_plugin is not None and self._mps_plugin.daemon_error:
            await self._event("MpsDaemonFailed", f"the MPS control daemon cannot run: {self._mps_plugin.daemon_error}; "
                              "the MPS slices are not allocatable", True)
        if ack is not None and ack != node.annotations.get(STATUS_PLAN):
            metrics.PLAN_ACKS.inc()
            log.info("node %s: plan %s applied", self.node, ack)
            await self._event("LayoutApplied", f"plan {ack} applied ({mode})")
        for m in ("mig", "mps"):
            for state in ("free", "used"):
                n = sum(1 for g in result.gpus for x in (g.mig if m == "mig" else g.mps)
                        if x.used == (state == "used")) if m == mode else 0
                metrics.SLICES.labels(m, state).set(n)
        return PassReport(mode, _valid_or_none(ack), errors, status, waiting=waiting)

    def _with_lost(self, result: PassResult, node: NodeView, model: GpuModel, mode: Mode) -> list[GpuLayout]:
        """The pass's GPUs with the lost ones (`DeviceInfo.lost`), which the MIG and MPS passes
        leave alone: each as the last pass that read it reported it (after an agent restart: as
        the node's last status does), every slice used. Its pods may still hold them, and what it
        holds cannot be read: the planner keeps it as it is (it is reported unhealthy too), and a
        plan that changes it is not acknowledged (`_not_held`)."""
        lost = sorted(d.index for d in result.devices if d.lost)
        gpus = {g.index: g for g in result.gpus}
        status: dict[int, GpuLayout] | None = None
        for index in lost:
            last = self._last_gpus.get(index)
            if last is None:
                if status is None:
                    decoded = decode_status(node.annotations, model, node=self.node, capacity=self._capacity).layout
                    status = {g.index: g for g in decoded.gpus} if decoded and decoded.mode == mode else {}
                last = status.get(index, GpuLayout(index=index))
            gpus[index] = GpuLayout(index=index, mig=[MigInstance(profile=m.profile, start=m.start, used=True)
                                                      for m in last.mig],
                                    mps=[MpsSlice(size=x.size, used=True) for x in last.mps])
        self._last_gpus = dict(gpus)
        return [gpus[i] for i in sorted(gpus)]

    def _new_mps_plugin(self, model: GpuModel, capacity: int, previous: dict[int, list[int]]) -> MpsPluginAgent:
        assert self.plugins is not None
        return MpsPluginAgent(self.driver, self.pods, capacity, guard=self.guard, daemon=self.mps_daemon,
                              pipe_dir=self.plugins.allocate.pipe_dir_host, log_dir=self.mps_log_dir,
                              max_slices=model.mps_max_clients, previous=previous)

    async def _leave_mps(self) -> list[str]:
        """On a node switched from MPS to MIG: the MPS slices left go as the spec's removed slices
        do (withdrawn, re-checked, kept for pods bound and not yet admitted). Those in use or kept
        stay served, with the MPS daemon, and their GPU counts as in use for MIG (`mps_left`)
        until they are gone."""
        assert self._mig is not None
        mps = self._mps_plugin
        if mps is None or not (any(mps.live.values()) or mps.previous):
            self._mig.mps_left = {}
            if mps is None or not mps.daemon_running():
                # (an agent restarted in MPS mode after the slices went made no daemon run: the one
                # left running in mps-control is stopped as on an agent started on a MIG node)
                await self._stop_daemon_left()
            elif not await mps._slices_held():
                # the slices went before the switch (in MPS mode, the daemon was kept running for
                # GPUs with none): nothing needs it on a MIG node now (asked while it runs only:
                # the pods' list is an API call)
                await mps.stop_daemon()
            return []
        result = await mps.apply({}, ())
        if not any(mps.live.values()):
            await mps.stop_daemon()
        self._mig.mps_left = {g.index: [f"MPS slice {s.size}gb ({'in use' if s.used else 'kept'})" for s in g.mps]
                              for g in result.gpus if g.mps}
        return [f"leaving MPS mode: {e}" for e in result.errors]

    async def _mps_sliced(self, devices: list[DeviceInfo]) -> set[int]:
        """Indices of the GPUs with MPS slices now (listed, in use or kept); without the MPS pass
        (an agent started on a node now in MIG mode), those of the slices pods hold, asked only
        while a GPU of dynpart's may be in EXCLUSIVE_PROCESS (read, the error stops the pass: a
        GPU whose clients still run must not be set back)."""
        if self._mps_plugin is not None:
            return {g for g, slices in self._mps_plugin.live.items() if slices}
        if not self.compute_modes.ours:
            return set()
        index_of = {d.uuid: d.index for d in devices if d.uuid}
        return {index_of[base] for a in await self.pods.list() if isinstance(known_resource(a.resource), MpsResource)
                for base, sep, _ in [a.device_id.partition("::")] if sep and base in index_of}

    async def _stop_daemon_left(self) -> None:
        """An agent started on a MIG node finds the MPS daemon still running in the mps-control
        container (it outlives the agent's restarts): stopped once no pod holds an MPS slice."""
        daemon = self.mps_daemon
        if daemon is None or not daemon.running_for():
            return
        try:
            if await self.guard.mps_held():
                return  # their clients need it
        except DynpartError as e:
            log.info("node %s: the MPS daemon left running is kept this pass: which pods hold MPS slices cannot be "
                     "read (%s)", self.node, e)
            return
        log.info("node %s: in MIG mode, no pod holds an MPS slice: stopping the MPS daemon left running", self.node)
        await daemon.stop()

    def _serving(self) -> bool:
        """Whether the agent's own plugin serves devices: the node's, or, on a node NVIDIA's plugin
        serves, the MPS slices left from MPS mode until they are gone."""
        return self.plugins is not None and (self._builtin or bool(self.plugins.servers))

    async def _own_lists(self, devices: list[DeviceInfo]) -> dict[str, list[PluginDevice]]:
        """What the agent's own plugin lists: the node's devices, or with NVIDIA's plugin serving
        the node, only the MPS slices left. A device a pod holds under another resource name or
        id (given by another device plugin before: NVIDIA's with migStrategy `single` lists MIG
        devices as nvidia.com/gpu, time-slicing lists `<uuid>::<n>`) is listed Unhealthy: the
        kubelet counts allocations per resource and id, so it would give it to a second pod.
        `devices`: the GPUs as the pass last read them."""
        lists = advertise(await self.views(devices))
        if not self._builtin:
            lists = _mps_only(lists)
        self.held_elsewhere = held_elsewhere(lists, self.pods.last)
        if self.held_elsewhere:
            lists = {r: [replace(d, healthy=False) if d.id in self.held_elsewhere else d for d in ds]
                     for r, ds in lists.items()}
        return lists

    async def _readmit_leftovers(self, devices: list[DeviceInfo]) -> None:
        """A pass ends with nothing withdrawn (each withdrawn device destroyed, or readmitted), unless
        it stopped between a withdrawal and the destroy (a PodResources or NVML call failing): then
        the device would stay hidden and sealed for good while the status reports it free. The
        lists are made again from what exists (what was destroyed leaves them), then the rest is
        advertised again."""
        if self.plugins is None or not self.plugins.withdrawn:
            return
        if self._serving():
            try:
                await self.plugins.update(await self._own_lists(devices))
            except DeviceListError as e:  # lists not refreshed: a destroyed device could come back
                log.warning("node %s: withdrawn devices stay withdrawn this pass: %s", self.node, e)
                return
        left = sorted(self.plugins.withdrawn)
        if left:
            log.warning("node %s: advertising again devices a stopped pass left withdrawn: %s", self.node,
                        ", ".join(left))
            await self.plugins.readmit(*left)

    # --- what the kubelet sees -------------------------------------------------------------------

    def _preferred(self, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
        """GetPreferredAllocation's hook: pack (`devices.packed_first`)."""
        advertised = self.plugins.advertised().get(resource, []) if self.plugins is not None else []
        return packed_first(available, advertised, self._used_per_gpu)

    async def _mig_devices(self, devices: list[DeviceInfo]) -> tuple[frozenset[tuple[str, str]], set[str]]:
        """(resource, UUID) of the MIG devices (GPU instances with their compute instance) of a
        known profile, as NVIDIA's plugin enumerates them, and the UUIDs of every MIG device (those
        of unknown profiles and of instances split by another tool too, which it lists under names
        no dynpart profile has). A UUID may come back under another profile: an instance re-made
        at the same place (its GI id) can get the destroyed one's."""
        names = {p.gi_profile_id: p.name for p in (self._model.mig_profiles if self._model else ())}
        known: set[tuple[str, str]] = set()
        every: set[str] = set()
        for d in devices:
            if not d.mig_current:
                continue
            if d.lost:  # not read: as last read (NVIDIA's plugin is not restarted for a GPU lost)
                last_known, last_every = self._last_mig_devices.get(d.index, (frozenset(), frozenset()))
                known |= last_known
                every |= last_every
                continue
            gpu_known: set[tuple[str, str]] = set()
            gpu_every: set[str] = set()
            for gi in await self.driver.gpu_instances(d.index):
                gpu_every.update(u for u in (gi.uuid, *gi.more_uuids) if u)
                if gi.uuid and gi.profile_id in names and not gi.split:
                    gpu_known.add((mig_resource_name(names[gi.profile_id]), gi.uuid))
            self._last_mig_devices[d.index] = (frozenset(gpu_known), frozenset(gpu_every))
            known |= gpu_known
            every |= gpu_every
        return frozenset(known), every

    async def views(self, devices: list[DeviceInfo]) -> list[GpuView]:
        """What to advertise, from what the driver reports: MIG devices (those with a compute
        instance) of GPUs in MIG mode, the MPS slices the agent applied, else the whole GPU.
        `devices`: the GPUs as the pass last read them; their health and instances are read now."""
        by_id = {p.gi_profile_id: p.name for p in (self._model.mig_profiles if self._model else ())}
        out = []
        unhealthy: dict[int, str] = {}
        read = await self.driver.read(health_and_instances, devices)
        minors, caps = await self.driver.read(device_numbers, devices, not self._mig_caps)
        self._mig_caps = self._mig_caps or caps
        for d, (problem, instances) in zip(devices, read, strict=True):
            self._indices.add(d.index)
            if d.lost:
                # not read: its devices as last advertised, Unhealthy (the kubelet gives them to no
                # new pod; those given stay its pods' until they end), as NVIDIA's plugin marks a
                # device whose handle it cannot get
                unhealthy[d.index] = GPU_LOST_REASON
                last = self._last_views.get(d.index)
                if last is not None and (last.uuid == d.uuid or not d.uuid):
                    out.append(replace(last, healthy=False))
                elif d.uuid:  # (an agent restarted while it is lost: its MPS slices are the last status's)
                    sizes, numbers = self._mps_plugin.view(d.index) if self._mps_plugin is not None else ((), ())
                    out.append(GpuView(index=d.index, uuid=d.uuid, memory_gb=self._capacity, mig_enabled=d.mig_current,
                                       mps=sizes, mps_ids=numbers, healthy=False))
                continue
            problem = problem or self.compute_modes.blocked.get(d.index)
            if problem:
                unhealthy[d.index] = problem
            minor = minors.get(d.index)
            view = GpuView(index=d.index, uuid=d.uuid, memory_gb=self._capacity or mps_memory_mib(d, self.catalog) // 1024,
                           mig_enabled=d.mig_current, healthy=problem is None, minor=minor)
            if d.mig_current:
                # (not a split instance: its devices are smaller than the profile, left alone)
                view = replace(view, mig=tuple(
                    MigDeviceView(by_id[gi.profile_id], gi.uuid, caps=None if minor is None or not gi.compute_instances
                                  else mig_cap_minors(self._mig_caps, minor, gi.gi_id, gi.compute_instances[0]))
                    for gi in instances if gi.profile_id in by_id and not gi.split))
            elif self._mps_plugin is not None and self._mps_plugin.live.get(d.index):
                sizes, numbers = self._mps_plugin.view(d.index)
                view = replace(view, mps=sizes, mps_ids=numbers, healthy=view.healthy and self._mps_plugin.serves(d.uuid))
                if not problem and d.uuid in self._mps_plugin.uncovered:
                    # its slices are listed Unhealthy while the daemon cannot be restarted for it:
                    # reported so, or the planner would place pods on slices no pod can get
                    unhealthy[d.index] = ("the MPS daemon does not run for it and is not restarted while pods use "
                                          "MPS slices of the node")
            self._last_views[d.index] = view
            out.append(view)
        self.unhealthy = unhealthy
        return out

    async def _health(self, devices: list[DeviceInfo]) -> dict[int, str]:
        """GPU index -> why the driver says it is unhealthy, for each GPU that is."""
        out = {}
        for d in devices:
            self._indices.add(d.index)
            if d.lost:  # (not asked: no call is made on a lost GPU)
                out[d.index] = GPU_LOST_REASON
                continue
            problem = await self.driver.health(d.index) or self.compute_modes.blocked.get(d.index)
            if problem:
                out[d.index] = problem
        return out

    async def _serve(self, mode: Mode, result: PassResult, layout: NodeLayout | None, node: NodeView) -> list[str]:
        """Advertise (built-in plugin) or restart NVIDIA's plugin; return what an acknowledgement of
        the plan still waits for (empty: nothing, or no plan)."""
        waiting: list[str] = []
        # whatever serves the devices, a plan the GPUs do not hold is not acknowledged: an instance
        # kept for a pod (in use, or bound and not yet admitted) blocks part of it, and the planner
        # revokes it after its time-out and plans again from what the status shows
        if layout is not None and result.applied:
            missing = _not_held(mode, layout, result.gpus, self._drain)
            if missing:
                waiting.append("the GPUs do not hold it: " + "; ".join(missing))
        if self.plugins is not None and not self._builtin and self.plugins.servers:
            # no longer an MPS node: NVIDIA's plugin serves its MIG devices and whole GPUs; the MPS
            # slices left (in use, or kept for a bound pod) stay listed until they are gone
            try:
                await self.plugins.update(await self._own_lists(result.devices))
            except DeviceListError as e:
                waiting.append(f"the device plugin refused the device lists: {e}")
            if self.publish_allocatable:
                await self._publish()
        if self.plugins is not None and self._builtin:
            try:
                await self.plugins.update(await self._own_lists(result.devices))
            except DeviceListError as e:
                # the kubelet keeps the last lists (a device destroyed since may be on them): a failure
                # to serve the devices, reported with a plan or without one (`_pass`)
                raise DeviceListError(f"the device plugin refused the device lists: {e}") from None
            if not await self.plugins.written():
                waiting.append("the device plugin's lists are not written to the kubelet yet")
            if self.plugins.pending:
                waiting.append("the device plugin holds back " + "; ".join(
                    f"{r} {', '.join(ids)}" for r, ids in sorted(self.plugins.pending.items()))
                    + " until the kubelet drops what left the other lists on their GPUs")
            held = await self.pods.allocatable()
            absent = _not_allocatable(self.plugins.advertised(), held)
            if absent:
                waiting.append("the kubelet does not report these devices yet: " + "; ".join(absent))
            if self._mps_plugin is not None and self._mps_plugin.daemon_error and mode == "mps":
                waiting.append(f"the MPS control daemon is not running ({self._mps_plugin.daemon_error})")
            if self.publish_allocatable:
                await self._publish(held)
        elif self.plugin_pods is not None and mode == "mig":
            # NVIDIA's plugin reads the MIG devices once, at its start: after any change of them (a
            # re-carve that keeps the counts, instances re-made after a reset) it is restarted.
            # Listed now: the node's capacity per resource (unhealthy devices included) and the ids
            # the kubelet holds healthy (PodResources), which name MIG UUIDs (deviceIDStrategy uuid)
            mig_devices, every_mig = await self._mig_devices(result.devices)
            # compared for the profiles of the node's model only: NVIDIA's plugin also lists
            # instances of other GI profiles and the compute instances of split ones, which stay
            counts = dict(Counter(r for r, _ in mig_devices))
            # it lists every GPU out of MIG mode whole, read at its start too: a GPU whose MIG mode
            # became active with no MIG device made yet (an enable asked again once the GPU was
            # idle, creations that failed) is a change of what it must list as well
            devices = mig_devices | {(WHOLE_GPU, d.uuid) for d in result.devices if not d.mig_current and d.uuid}
            held = await self.pods.allocatable()
            known = {mig_resource_name(p.name) for p in (self._model.mig_profiles if self._model else ())}
            # gone, or re-made under another of the model's profiles; a device under another name
            # (another GI profile, a split instance's compute instance) only when it is gone
            stale = sorted(f"{i} ({r})" for r, i in _mig_ids(held) - devices
                           if i.startswith("MIG-") and (r in known or i not in every_mig))
            in_mig = {d.uuid for d in result.devices if d.mig_current}
            listed_whole = [i for i in held.get(WHOLE_GPU, ()) if base_device_id(i) in in_mig]
            published = {r: n for r, n in _node_mig_counts(node).items() if r in known}
            if self._restarted_for is None and published == counts and not stale and not listed_whole:
                self._restarted_for = devices  # NVIDIA's plugin already lists this layout
            if devices != self._restarted_for:
                names = await self.plugin_pods.restart()
                self._restarted_for = devices
                log.info("node %s: MIG devices or MIG modes changed; restarted NVIDIA's device plugin (%s)", self.node,
                         ", ".join(names) or "no pod found")
            if published != counts:
                waiting.append("NVIDIA's device plugin has not published the MIG devices yet (node capacity "
                               f"{_fmt(published)}, applied {_fmt(counts)})")
            elif stale:
                waiting.append("NVIDIA's device plugin still lists MIG devices that are gone: " + ", ".join(stale))
        return waiting if layout is not None and result.applied else []

    async def _publish(self, held: dict[str, list[str]] | None = None) -> bool:
        """Set the node's capacity/allocatable of the resources the plugin serves to the healthy
        devices the kubelet's device manager already holds (never more): the scheduler sees new
        slices before the kubelet's next status write, and withdrawn ones leave at once. True if
        the kubelet holds every healthy advertised device (the node now shows them all)."""
        if self.plugins is None or not self._serving():
            return True
        async with self._publish_lock:
            if held is None:
                held = await self.pods.allocatable()
            node = await self.node_api.get()
            advertised = self.plugins.advertised()  # after the awaits: a withdrawal meanwhile counts
            counts = _publishable(advertised, held, node.allocatable)
            if not self._builtin:  # NVIDIA's plugin publishes the rest: only the MPS slices left are ours
                counts = {r: n for r, n in counts.items() if isinstance(known_resource(r), MpsResource)}
            # absent: 0; a capacity below the count is raised with it (the kubelet's own capacity,
            # unhealthy devices included, is left alone)
            patch = {r: n for r, n in counts.items()
                     if node.allocatable.get(r, "0") != str(n) or _count(node.capacity.get(r)) < n}
            self._published = counts
            if patch:
                await self.node_api.patch_status(patch)
                log.info("node %s: published %s", self.node, _fmt(patch))
            return not _not_allocatable(advertised, held)

    def _unpublished(self, node: NodeView) -> bool:
        """Whether the node shows other counts than the last _publish set (early publishing)."""
        return any(node.allocatable.get(r, "0") != str(n) or _count(node.capacity.get(r)) < n
                   for r, n in self._published.items())

    async def _keep_published(self) -> None:
        """Early publishing between passes: when nudged (the node shows other counts than the
        agent published, e.g. the kubelet's status write at its restart, or a plugin registered
        again), publish what the kubelet holds, looking again (20 ms, doubling to 0.5 s) for up to
        `republish_s` until it holds every advertised device (a plugin registered again: its list
        reaches the kubelet a moment later)."""
        while True:
            await self._nudge.wait()
            self._nudge.clear()
            deadline = time.monotonic() + self.republish_s
            delay = 0.02
            while True:
                try:
                    caught_up = await self._publish()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the next nudge or pass tries again
                    log.warning("node %s: publishing the allocatable devices: %s", self.node, e)
                    caught_up = False
                if caught_up or self._nudge.is_set() or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _fenced(self, spec: DecodedSpec, node: NodeView) -> list[str]:
        """Why the spec must not be applied because a deposed planner wrote it (empty: apply it).
        Asked only for a plan not yet acknowledged, right before acting on it."""
        if (self.leader_term is None or spec.layout is None or spec.term is None
                or spec.plan_id in (node.annotations.get(STATUS_PLAN), self._cleared_plan)):
            return []
        current = await self.leader_term()
        if current is None or spec.term >= current:
            # acted on from now on: the passes that wait for its acknowledgement (every retry_s)
            # need not read the Lease again
            self._cleared_plan = spec.plan_id
            return []
        return [f"plan {spec.plan_id} was written by a deposed planner (term {spec.term}; the planner's lease is at "
                f"term {current}): ignored"]

    async def _event(self, reason: str, message: str, warning: bool = False) -> None:
        await self._events.record({"kind": "Node", "metadata": {"name": self.node}}, reason, message, warning)

    async def _post_event(self, _node: Obj, reason: str, message: str, warning: bool) -> None:
        await self.node_api.event(reason, message, warning)

    async def _all_unhealthy(self, error: GpuDriverError, node: NodeView) -> None:
        """NVML cannot read the GPUs (one fell off the bus, the driver is gone): every device the
        agent's plugin serves is advertised Unhealthy, so that the kubelet gives none to a new pod
        (NVIDIA's plugin does the same when NVML fails), and the status names every GPU unhealthy
        (each the driver listed, and each the last status reported), so that the planner plans
        none. The next pass that reads the GPUs again advertises their real health."""
        self.unhealthy = {i: f"NVML cannot read the GPUs ({error.code})"
                          for i in sorted(self._indices | _status_gpus(node.annotations))}
        if self.plugins is None or not self._serving():
            return
        log.warning("node %s: the GPUs cannot be read (%s): advertising every device Unhealthy", self.node, error.code)
        await self.plugins.set_unhealthy()
        if self.publish_allocatable:
            try:
                await self._publish()
            except Exception as e:  # the kubelet's own status write follows
                log.warning("node %s: publishing the allocatable devices: %s", self.node, e)

    def _wait_longer(self, waiting_for: tuple[str | None, ...]) -> None:
        now = time.monotonic()
        if waiting_for and waiting_for == self._waiting_for:
            longest = self.interval_s if now - self._waiting_since >= self.long_wait_s else self.retry_max_s
            self._retry_delay = min(self._retry_delay * 2, longest, self.interval_s)
        else:
            self._retry_delay = self.retry_s
            self._waiting_since = now
        self._waiting_for = waiting_for

    def _log_problems(self, level: int, problems: list[str], severe: frozenset[str] = frozenset()) -> None:
        """Log each problem of this pass at `level` (ERROR if in `severe`) if the last pass did not
        have it, else at DEBUG: once each, however many passes it lasts."""
        for problem in problems:
            at = logging.DEBUG if problem in self._logged else logging.ERROR if problem in severe else level
            log.log(at, "node %s: %s", self.node, problem)
        self._logged = frozenset(problems)

    async def _report_failure(self, node: NodeView, error: str, unhealthy: set[int] | None = None,
                              as_the_gpus_are: bool = False) -> PassReport:
        """The last status, with the error. `as_the_gpus_are`: the driver answers (the pass failed
        on something else), and what may have changed on the MIG GPUs is read (`_mig_as_it_is`)."""
        status = {k: v for k, v in node.annotations.items() if k.startswith(STATUS_PREFIX)}
        if as_the_gpus_are:
            gone, fresh = await self._mig_as_it_is(node)
            status = {k: v for k, v in status.items() if k not in gone} | fresh
        status[STATUS_ERROR] = error_text(error)
        if unhealthy:
            status[STATUS_UNHEALTHY] = ",".join(map(str, sorted(i for i in unhealthy if 0 <= i <= MAX_GPU_INDEX)))
        status[STATUS_HEARTBEAT] = format_heartbeat(self.now())
        await self._write(node, status)
        return PassReport(None, status.get(STATUS_PLAN), [error], status, failed=True)

    async def _mig_as_it_is(self, node: NodeView) -> tuple[set[str], dict[str, str]]:
        """The status keys of the MIG GPUs whose instances are no longer what the last status says:
        a pass that failed after it changed some (a destroy done, then the kubelet's PodResources
        unreachable for the next check) leaves the last status describing instances gone, or not
        those it made. Those GPUs are reported as the driver has them, every instance used (which
        pods use them cannot be read now; the next pass that can says): the planner neither plans
        pods onto them nor destroys them meanwhile. Nothing when the driver cannot be read."""
        model = self._model
        if model is None or not model.supports_mig:
            return set(), {}
        last = decode_status(node.annotations, model, node=self.node, capacity=self._capacity)
        if last.layout is None or last.layout.mode != "mig" or last.layout_incomplete:
            return set(), {}
        try:
            readings = await self.driver.read(instances_and_processes)
        except DynpartError:
            return set(), {}
        names = {p.gi_profile_id: p.name for p in model.mig_profiles}
        reported = {g.index: g for g in last.layout.gpus}
        fresh: list[GpuLayout] = []
        for r in readings:
            if r.device.lost:  # (not read: its last status stays)
                continue
            now = sorted(((names[gi.profile_id], gi.start) for gi in r.instances if gi.profile_id in names),
                         key=lambda x: (x[1], x[0]))
            was = reported.get(r.device.index)
            if r.device.mig_current and (was is None or sorted(((m.profile, m.start) for m in was.mig),
                                                                key=lambda x: (x[1], x[0])) != now):
                fresh.append(GpuLayout(index=r.device.index, mig=[MigInstance(profile=p, start=s, used=True)
                                                                  for p, s in now]))
        if not fresh:
            return set(), {}
        gone = {k for g in fresh for k in node.annotations if k.startswith(f"{STATUS_PREFIX}gpu-{g.index}-")}
        keys = encode_status(NodeLayout(node=self.node, mode="mig", gpus=fresh), None)
        keys.pop(STATUS_MODE, None)
        return gone, keys

    async def _report_unexpected(self, node: NodeView, error: Exception) -> None:
        """A pass that failed on what the agent did not expect (a bug, a library's own error) says
        so in the node's status, as a pass that failed on the driver does: else the status goes on
        saying what the last good pass saw, and only the agent's log tells why nothing changes.
        Best effort: the failure itself is raised and logged either way."""
        why = f"the pass failed unexpectedly ({type(error).__name__}: {error}); the agent's log has the traceback"
        try:
            await self._report_failure(node, why)
        except Exception as e:  # the API may be what failed: the caller logs the pass's own error
            log.debug("node %s: reporting the failed pass: %s", self.node, e)

    async def _write(self, node: NodeView, status: dict[str, str]) -> None:
        patch = annotation_patch(node.annotations, status, prefix=STATUS_PREFIX)
        if set(patch) == {STATUS_HEARTBEAT} and time.monotonic() - self._heartbeat_at < self.heartbeat_s:
            # a pass every interval (every retry_s while a plan waits): a Node write per pass that
            # changes only the heartbeat would go to every Node watcher of the cluster
            return
        if patch:
            await self.node_api.patch(annotations=patch)
            if STATUS_HEARTBEAT in patch:
                self._heartbeat_at = time.monotonic()

    async def run(self, stop: asyncio.Event | None = None, pass_grace_s: float = PASS_GRACE_S) -> None:
        """Pass after pass until `stop` is set: at once when the spec changes, else every interval.
        A pass running when `stop` is set gets `pass_grace_s` to end, then is cancelled at its next
        await (passes are idempotent: the next agent's first pass converges; a driver call already
        running in the driver's thread is not waited for); the way out (publishing 0 for what the
        plugin served) runs either way."""
        stop = stop or asyncio.Event()
        wake = asyncio.Event()
        watcher = asyncio.create_task(self._watch(wake), name=f"watch node {self.node}")
        publisher: asyncio.Task[None] | None = None
        if self.plugins is not None and self.publish_allocatable:
            self._nudge = asyncio.Event()
            nudge = self._nudge
            self.plugins.on_registered = lambda _resource: nudge.set()
            publisher = asyncio.create_task(self._keep_published(), name=f"publisher of node {self.node}")
        self.liveness.expect(LOOP_BEAT, self.loop_stall_s)
        ticker = asyncio.create_task(keep_beating(self.liveness, LOOP_BEAT, self.loop_beat_s), name="event loop beat")
        # a pass starts at least every interval and beats after each driver call: a few missed
        # intervals, or a driver call that runs to its time limit (it then fails), are not stuck
        self.liveness.expect(PASS_BEAT, max(6 * self.interval_s, self.driver.longest_limit_s) + 60)
        try:
            while not stop.is_set():
                self.liveness.beat(PASS_BEAT)
                wake.clear()
                try:
                    await self._pass_until(stop, pass_grace_s)
                except DynpartError as e:
                    log.error("node %s: pass failed: %s", self.node, e)
                except Exception:  # keep the agent alive; the next pass starts from the real state
                    log.exception("node %s: pass failed", self.node)
                # (/readyz) started and passing, whatever the pass found: what it failed at is in
                # the node's status; a version that never gets here stops a rolling update
                self.liveness.ready = True
                if self._driver_replaced >= DRIVER_REPLACED_PASSES:
                    raise DriverReplaced(
                        f"node {self.node}: the NVIDIA driver was unloaded, reloaded or upgraded under the agent (NVML "
                        f"answered {' or '.join(sorted(DRIVER_REPLACED))} {self._driver_replaced} passes in a row): "
                        "exiting, so that the kubelet starts the agent again with the new driver's library")
                waits = [asyncio.create_task(wake.wait()), asyncio.create_task(stop.wait())]
                # an applied plan waiting for the kubelet or a device plugin is looked at again soon
                timeout = min(self._retry_delay, self.interval_s) if self._waiting else self.interval_s
                try:
                    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in waits:
                        t.cancel()
        finally:
            if self.plugins is not None and publisher is not None:
                self.plugins.on_registered = None
            await _cancel(watcher, publisher)
            await self._unpublish()
            await self._hand_back()
            await _cancel(ticker)  # last: the loop still answers while the agent stops

    async def _pass_until(self, stop: asyncio.Event, grace_s: float) -> None:
        """One pass, as a task of its own: cancelled `grace_s` after `stop` is set."""
        task = asyncio.create_task(self.reconcile_once(), name=f"pass of node {self.node}")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                log.info("node %s: stopping: the pass running gets %.0f s to end", self.node, grace_s)
                await asyncio.wait({task}, timeout=grace_s)
            if not task.done():
                log.warning("node %s: stopping: the pass did not end in %.0f s; cancelled (a driver call already "
                            "running is not waited for)", self.node, grace_s)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
            task.result()  # its error, if any, is the loop's to log
        finally:
            stopping.cancel()
            if not task.done():  # run() itself cancelled
                task.cancel()

    async def _hand_back(self) -> None:
        """On the way out of a node that left dynpart (its partitioning label removed or not mig or
        mps: the DaemonSet takes the agent away with it, and NVIDIA's plugin is to serve its GPUs
        whole): the GPUs dynpart put in EXCLUSIVE_PROCESS go back to DEFAULT, or a pod given one
        whole could run a single CUDA process. A restart or an upgrade keeps the label: then
        nothing changes, and the next agent finds its GPUs in the compute-modes file. Bounded: the
        kubelet kills the agent soon after SIGTERM. The CDI spec the plugin wrote (a CDI device-list
        strategy) stays: the kubelet keeps each container's CDI names, and a container of a pod still
        running there, created again, resolves them from it (a spec naming GPUs that nothing asks for
        is harmless; /var/run/cdi is a tmpfs, gone at the next boot)."""
        if not self.compute_modes.ours:
            return

        async def hand_back() -> list[str] | None:
            node = await self.node_api.get()
            if node.labels.get(PARTITIONING_LABEL) in ("mig", "mps"):
                return None
            return await self.compute_modes.sync(await self.driver.devices(), set())

        try:
            # within the agent's shutdown (cli.SHUTDOWN_S), after _unpublish's 5 s at most
            async with asyncio.timeout(HAND_BACK_S):
                errors = await hand_back()
            if errors is None:
                return
        except Exception as e:  # (the node deleted, the API server or the driver not answering)
            log.warning("node %s: stopping: the GPUs put in EXCLUSIVE_PROCESS compute mode were not set back to "
                        "DEFAULT (%s): %s", self.node, str(e) or f"no answer within {HAND_BACK_S:g} s",
                        sorted(self.compute_modes.ours))
            return
        left = sorted(self.compute_modes.ours)
        if left:
            log.warning("node %s: stopping on a node that left dynpart: GPUs %s stay in EXCLUSIVE_PROCESS compute mode "
                        "(%s); set them back with nvidia-smi -i <UUID> -c DEFAULT", self.node, left,
                        "; ".join([*errors, *self.compute_modes.blocked.values()]))
        else:
            log.info("node %s: stopping on a node that left dynpart: its GPUs' compute modes set back to DEFAULT",
                     self.node)

    async def _unpublish(self) -> None:
        """On the way out (the plugin stops serving with this process): publish 0 for what the
        plugin serves, so that the scheduler binds no pod the kubelet could not admit until its
        own next status write, up to 10 s later (a rollout, an OOM kill). The next agent
        publishes the devices again once the kubelet holds them."""
        if self.plugins is None or not self.publish_allocatable:
            return
        served = {r: 0 for r, ds in self.plugins.advertised().items() if ds}
        if not served:
            return
        try:
            async with asyncio.timeout(5):
                await self.node_api.patch_status(served)
            log.info("node %s: stopping: published %s", self.node, _fmt(served))
        except Exception as e:  # the plugin stops serving anyway; the kubelet's own write follows
            log.warning("node %s: stopping: could not publish 0 for %s: %s", self.node, ", ".join(served), e)

    async def _watch(self, wake: asyncio.Event) -> None:
        """Wake the loop when the node's spec annotations change. The node API's watch retries
        API failures itself; anything else ends it and it is started again after a back-off (a
        dead watch would leave the agent acting only every interval)."""
        last: dict[str, str] | None = None
        while True:  # a watch that ends without failing is started again at once
            async for attempt in retrying(self.kube, f"watch of node {self.node}", retry_on=Exception, logger=log):
                with attempt:
                    async for node in self.node_api.watch():
                        if self._published and self._unpublished(node):
                            self._nudge.set()  # e.g. the kubelet restarted and wrote its status with no device
                        spec = {k: v for k, v in node.annotations.items() if k.startswith(SPEC_PREFIX)}
                        # while a plan waits for a device plugin, a change of the node's GPU
                        # resources may be what it waits for
                        if self._waiting:
                            spec |= {"\0" + k: v for k, v in node.allocatable.items() if is_slice_resource(k)}
                        if spec != last:
                            if last is not None:
                                wake.set()
                            last = spec


def health_and_instances(driver: GpuDriver, devices: list[DeviceInfo]) -> list[tuple[str | None, list[GpuInstanceInfo]]]:
    """Per GPU, why it is unhealthy (None: healthy) and, in MIG mode, its GPU instances: what the
    device lists are made of, read on the driver's thread as one call (`AsyncDriver.read`). A lost
    GPU is not read."""
    return [(GPU_LOST_REASON, []) if d.lost else
            (driver.health(d.index), driver.gpu_instances(d.index) if d.mig_current else []) for d in devices]


def device_numbers(driver: GpuDriver, devices: list[DeviceInfo], caps: bool) -> tuple[dict[int, int], dict[str, int]]:
    """GPU index -> its device minor number, and (with `caps`, else empty) the driver's MIG
    capability minors: the device nodes the built-in plugin gives containers as DeviceSpecs.
    Best effort: what the driver does not answer is left out (its nodes are not given; the NVIDIA
    runtime still gives the container the device), never a failed pass."""
    minors: dict[int, int] = {}
    for d in devices:
        if d.lost:
            continue  # (not read: nothing is asked of a lost GPU)
        try:
            minors[d.index] = driver.minor_number(d.index)
        except Exception as e:  # (a lost GPU, a driver or recording without the call)
            log.debug("GPU %s: its device minor number cannot be read: %s", d.index, e)
    table: dict[str, int] = {}
    if caps and any(d.mig_current for d in devices):
        try:
            table = driver.mig_cap_minors()
        except Exception as e:
            log.debug("the MIG capability minors cannot be read: %s", e)
    return minors, table


async def _cancel(*tasks: asyncio.Task[None] | None) -> None:
    for task in tasks:
        if task is None:
            continue
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


# GPU Operator's per-node switches of its components (set to "false" to keep one off a node)
DEPLOY_MIG_MANAGER = "nvidia.com/gpu.deploy.mig-manager"
DEPLOY_DEVICE_PLUGIN = "nvidia.com/gpu.deploy.device-plugin"


def _nvidia_components(node: NodeView, mode: Mode, builtin: bool) -> list[tuple[str, str]]:
    """Warnings for GPU Operator components the node's labels leave on where they fight the
    agent: mig-manager re-applies its own MIG layout at each of its starts (destroying the
    agent's free instances), and NVIDIA's device plugin registers the same resource names as the
    agent's own plugin, replacing it at the kubelet. A label can read "true" while the component is
    off for the whole cluster (ClusterPolicy), so this warns and does not refuse."""
    out = []
    mig_manager, device_plugin = node.labels.get(DEPLOY_MIG_MANAGER, "false"), node.labels.get(DEPLOY_DEVICE_PLUGIN, "false")
    if mode == "mig" and mig_manager != "false":
        out.append(("MigManagerNotOff",
                    f"{DEPLOY_MIG_MANAGER}={mig_manager}: if GPU Operator's mig-manager runs on this node it "
                    "re-applies its own MIG layout at each start and destroys the instances dynpart made; label the "
                    f"node {DEPLOY_MIG_MANAGER}=false"))
    if builtin and device_plugin != "false":
        out.append(("NvidiaDevicePluginNotOff",
                    f"{DEPLOY_DEVICE_PLUGIN}={device_plugin}: if NVIDIA's device plugin runs on this node it "
                    "registers the resources dynpart's own plugin serves and replaces it at the kubelet; label the "
                    f"node {DEPLOY_DEVICE_PLUGIN}=false (or use devicePlugin.mode nvidia on MIG nodes)"))
    return out


def _mps_only(advertised: dict[str, list[PluginDevice]]) -> dict[str, list[PluginDevice]]:
    """The MPS slices among the devices to advertise (what the built-in plugin keeps serving on a
    node that NVIDIA's plugin serves)."""
    return {r: ds for r, ds in advertised.items() if ds and all(d.kind == "mps" for d in ds)}


class _Remembering:
    """PodResources that keeps the assignments its last `list()` answered."""

    def __init__(self, inner: PodResources):
        self.inner = inner
        self.last: list[AssignedDevice] = []

    async def list(self) -> list[AssignedDevice]:
        self.last = await self.inner.list()
        return self.last

    async def allocatable(self) -> dict[str, DeviceIds]:
        return await self.inner.allocatable()


# why a GPU of dynpart's left in EXCLUSIVE_PROCESS is not put in MIG mode yet (MigAgent.mps_left)
COMPUTE_MODE_IN_USE = "its EXCLUSIVE_PROCESS compute mode, not yet set back to DEFAULT"


def _status_gpus(annotations: dict[str, str]) -> set[int]:
    """The GPU indices a status names in its slice keys (`status-gpu-<i>-...`)."""
    out = set()
    for key in annotations:
        if key.startswith(STATUS_PREFIX + "gpu-"):
            index = key[len(STATUS_PREFIX + "gpu-"):].split("-", 1)[0]
            if index.isascii() and index.isdigit() and len(index) <= 3:
                out.add(int(index))
    return out


def _valid_or_none(plan_id: str | None) -> str | None:
    return plan_id if is_plan_id(plan_id) else None


def _not_held(mode: Mode, layout: NodeLayout, gpus: list[GpuLayout], drain: tuple[int, ...] = ()) -> list[str]:
    """Per GPU, how what the driver holds differs from the plan (empty: it holds the plan). A
    drained GPU holds it with any part of the plan's slices (the rest went as they freed)."""
    want = {g.index: g for g in layout.gpus}
    out = []
    for g in gpus:
        w = want.get(g.index)
        if mode == "mig":
            have = sorted(f"{m.profile}@{m.start}" for m in g.mig)
            need = sorted(f"{m.profile}@{m.start}" for m in (w.mig if w else []))
        else:  # sizes, largest first (a slice's number is the agent's business, not the plan's)
            have = [f"{s}gb" for s in sorted((s.size for s in g.mps), reverse=True)]
            need = [f"{s}gb" for s in sorted((s.size for s in (w.mps if w else [])), reverse=True)]
        if have != need and not (g.index in drain and not Counter(have) - Counter(need)):
            out.append(f"GPU {g.index} has {' '.join(have) or 'nothing'}, the plan {' '.join(need) or 'nothing'}")
    for index in sorted(set(want) - {g.index for g in gpus}):
        out.append(f"GPU {index} is not on this node")
    return out


def _not_allocatable(advertised: dict[str, list[PluginDevice]], held: dict[str, list[str]]) -> list[str]:
    out = []
    for resource, devices in sorted(advertised.items()):
        have = set(held.get(resource, ()))
        missing = [d.id for d in devices if d.healthy and d.id not in have]
        if missing:
            out.append(f"{resource} {', '.join(missing)}")
    return out


def _publishable(advertised: dict[str, list[PluginDevice]], held: dict[str, list[str]],
                 node_allocatable: dict[str, str]) -> dict[str, int]:
    """Resource -> healthy devices both advertised and held by the kubelet's device manager, for
    every resource the plugin serves and every GPU slice resource the node lists (0 when the
    plugin serves it no more)."""
    out = {r: 0 for r in node_allocatable if known_resource(r) is not None}
    for resource, devices in advertised.items():
        have = set(held.get(resource, ()))
        out[resource] = sum(1 for d in devices if d.healthy and d.id in have)
    return out


def _count(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def _mig_ids(held: dict[str, list[str]]) -> set[tuple[str, str]]:
    """(resource, id) of the MIG devices among what the kubelet holds."""
    return {(r, i) for r, ids in held.items() if r.startswith(MIG_RESOURCE_PREFIX) for i in ids}


def _node_mig_counts(node: NodeView) -> dict[str, int]:
    """The node's MIG devices per resource, healthy or not (status.capacity: the kubelet counts
    an unhealthy device there and not in allocatable)."""
    out = {}
    for r, v in node.capacity.items():
        if r.startswith(MIG_RESOURCE_PREFIX):
            try:
                n = int(v)
            except ValueError:
                continue
            if n:
                out[r] = n
    return out


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{r}={n}" for r, n in sorted(counts.items())) or "none"


def _last_mps_slices(node: NodeView, model: GpuModel, name: str, capacity: int) -> dict[int, list[int]]:
    """GPU index -> the sizes of the MPS slices the node's last status reports (its agent's, before
    a restart), or nothing when it reports another mode."""
    last = decode_status(node.annotations, model, node=name, capacity=capacity).layout
    return {g.index: [s.size for s in g.mps] for g in last.gpus} if last and last.mode == "mps" else {}
