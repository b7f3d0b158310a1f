"""The agent's loop: on a spec change (node watch) or every `interval_s`, one pass: read the
spec, apply it (MIG or MPS), write the status. The handshake (docs/protocol.md): the status
names the plan id of the spec once the pass acted on it, so the planner knows the node's
status is the outcome of its last plan.

A pass is idempotent and starts from what the driver reports, so an agent restarted in the
middle of a pass converges on its first pass. A pass that cannot observe the node safely (no
driver, no PodResources) changes nothing and reports the error, keeping the last status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from dynpart.agent import metrics
from dynpart.agent.capability_reader import mig_state, read_capability
from dynpart.agent.driver.interface import GpuDriver
from dynpart.agent.kube import ConfigStore, NodeApi, NodeView
from dynpart.agent.mig_agent import MigAgent
from dynpart.agent.mps_agent import MpsAgent
from dynpart.agent.podresources import PodResources
from dynpart.annotations import DecodedSpec, annotation_patch, decode_spec, encode_status, format_heartbeat, is_plan_id
from dynpart.capability import encode_capability, node_model
from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.kube.client import Obj
from dynpart.kube.conventions import (
    PARTITIONING_LABEL,
    SPEC_PREFIX,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_PLAN,
    STATUS_PREFIX,
)
from dynpart.kube.recording import EventRecorder
from dynpart.kube.retrying import retrying
from dynpart.probing import Liveness
from dynpart.settings import KubeSettings
from dynpart.snapshot import Mode, NodeLayout

log = logging.getLogger("dynpart.agent")


@dataclass
class PassReport:
    mode: Mode | None
    plan_id: str | None  # the plan id acknowledged by this pass (None: none)
    errors: list[str] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)  # the status annotations written
    failed: bool = False  # the pass could not observe or act (nothing was changed)


class Agent:
    def __init__(self, node: str, *, node_api: NodeApi, driver: GpuDriver, pods: PodResources, catalog: Catalog,
                 configs: ConfigStore | None = None, interval_s: float = 10.0, capacity_gb: int | None = None,
                 kube: KubeSettings | None = None, now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 liveness: Liveness | None = None, leader_term: Callable[[], Awaitable[int | None]] | None = None):
        self.node = node
        self.liveness = liveness or Liveness()
        # the planner's current leader term (agent.kube.lease_term_reader); None: no fencing
        self.leader_term = leader_term
        self.node_api = node_api
        self.driver = driver
        self.pods = pods
        self.catalog = catalog
        self.configs = configs
        self.interval_s = interval_s
        self.capacity_gb = capacity_gb
        self.now = now
        self._model: GpuModel | None = None
        self._mig_states: tuple[str, ...] = ()
        self._capability: str | None = None  # the encoded report, written with every status
        self._disagreements: list[str] = []
        self._mig: MigAgent | None = None
        self._mps: MpsAgent | None = None
        self.kube = kube or KubeSettings()
        # Events on the node, once per reason and message (a pass repeats every interval)
        self._events = EventRecorder(self._post_event, self.kube)

    def model(self) -> GpuModel:
        """The model this node is planned with: what the driver describes (read again when a
        GPU's MIG mode changes: NVML lists profiles only in MIG mode), narrowed by the catalog,
        as the planner derives it from the same report (`dynpart.capability.node_model`)."""
        states = tuple(mig_state(d) for d in self.driver.devices())
        if self._model is None or states != self._mig_states:
            try:
                capability, unread = read_capability(self.driver, self.catalog)
                choice = node_model(capability, self.catalog)
            except DynpartError as e:
                raise DynpartError(f"node {self.node}: {e}") from None
            if choice.model != self._model:
                self._mig = self._mps = None  # built for the old model
                for note in [*unread, *choice.disagreements]:
                    log.warning("node %s: %s", self.node, note)
            self._model, self._mig_states = choice.model, states
            self._capability = encode_capability(capability)
            self._disagreements = [*unread, *choice.disagreements]
        return self._model

    def _mode(self, node: NodeView, spec_mode: Mode | None) -> Mode:
        if spec_mode is not None:
            return spec_mode
        label = node.labels.get(PARTITIONING_LABEL)
        if label == "mig":
            return "mig"
        if label == "mps":
            return "mps"
        return "mig" if any(d.mig_current for d in self.driver.devices()) else "mps"

    async def reconcile_once(self) -> PassReport:
        started = time.perf_counter()
        try:
            report = await self._pass()
        except Exception:
            metrics.PASSES.labels("error").inc()
            raise
        metrics.PASSES.labels("error" if report.failed else "ok").inc()
        metrics.PASS_SECONDS.observe(time.perf_counter() - started)
        metrics.ERRORS.set(len(report.errors))
        return report

    async def _pass(self) -> PassReport:
        node = await self.node_api.get()
        try:
            model = self.model()
            # never more than the memory NVML reports (the model's memory_gb is derived from it)
            capacity = min(self.capacity_gb or model.memory_gb, model.memory_gb)
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
            mode = self._mode(node, layout.mode if layout else None)
            if mode == "mig":
                if self._mig is None:
                    self._mig = MigAgent(self.driver, self.pods, model)
                desired_mig = None if layout is None else {g.index: [(m.profile, m.start) for m in g.mig]
                                                           for g in layout.gpus}
                result = await self._mig.apply(desired_mig)
            else:
                if self.configs is None:
                    raise DynpartError("this node is in MPS mode but the agent has no device-plugin ConfigMap "
                                       "(--device-plugin-configmap)")
                if self._mps is None:
                    self._mps = MpsAgent(self.driver, self.pods, self.node_api, self.configs, capacity)
                desired_mps = None if layout is None else {g.index: [s.size for s in g.mps] for g in layout.gpus}
                result = await self._mps.apply(desired_mps, node)
        except DynpartError as e:
            # Not safe to act or to describe the GPUs: keep the last status, report the error.
            log.error("node %s: %s", self.node, e)
            return await self._report_failure(node, str(e))
        try:
            self.model()  # a MIG mode changed by this pass changes what the driver lists: report it now
        except DynpartError as e:
            log.warning("node %s: %s", self.node, e)
        errors = [*spec.problems, *fenced, *result.errors]
        ack = spec.plan_id if result.applied and layout is not None else node.annotations.get(STATUS_PLAN)
        status = encode_status(NodeLayout(node=self.node, mode=mode, gpus=result.gpus),
                               _valid_or_none(ack), errors, self.now())
        if self._capability is not None:
            status[STATUS_CAPABILITY] = self._capability
        await self._write(node, status)
        if self._disagreements:
            await self._event("CatalogDisagreement", "the driver and the catalog differ (the driver's values are "
                              "used): " + "; ".join(self._disagreements), True)
        for error in errors:
            log.warning("node %s: %s", self.node, error)
        if spec.problems:
            await self._event("DynpartInvalidSpec", "ignored malformed annotations: " + "; ".join(spec.problems), True)
        if result.errors:
            await self._event("ApplyFailed", "; ".join(result.errors), True)
        if ack is not None and ack != node.annotations.get(STATUS_PLAN):
            metrics.PLAN_ACKS.inc()
            log.info("node %s: plan %s applied", self.node, ack)
            await self._event("LayoutApplied", f"plan {ack} applied ({mode})")
        for m in ("mig", "mps"):
            for state in ("free", "used"):
                n = sum(1 for g in result.gpus for x in (g.mig if m == "mig" else g.mps)
                        if x.used == (state == "used")) if m == mode else 0
                metrics.SLICES.labels(m, state).set(n)
        return PassReport(mode, _valid_or_none(ack), errors, status)

    async def _fenced(self, spec: DecodedSpec, node: NodeView) -> list[str]:
        """Why the spec must not be applied because a deposed planner wrote it (empty: apply it).
        Asked only for a plan not yet acknowledged, right before acting on it."""
        if (self.leader_term is None or spec.layout is None or spec.term is None
                or spec.plan_id == node.annotations.get(STATUS_PLAN)):
            return []
        current = await self.leader_term()
        if current is None or spec.term >= current:
            return []
        return [f"plan {spec.plan_id} was written by a deposed planner (term {spec.term}; the planner's lease is at "
                f"term {current}): ignored"]

    async def _event(self, reason: str, message: str, warning: bool = False) -> None:
        await self._events.record({"kind": "Node", "metadata": {"name": self.node}}, reason, message, warning)

    async def _post_event(self, _node: Obj, reason: str, message: str, warning: bool) -> None:
        await self.node_api.event(reason, message, warning)

    async def _report_failure(self, node: NodeView, error: str) -> PassReport:
        status = {k: v for k, v in node.annotations.items() if k.startswith(STATUS_PREFIX)}
        status[STATUS_ERROR] = error
        status[STATUS_HEARTBEAT] = format_heartbeat(self.now())
        await self._write(node, status)
        return PassReport(None, status.get(STATUS_PLAN), [error], status, failed=True)

    async def _write(self, node: NodeView, status: dict[str, str]) -> None:
        patch = annotation_patch(node.annotations, status, prefix=STATUS_PREFIX)
        if patch:
            await self.node_api.patch(annotations=patch)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Pass after pass until `stop` is set: at once when the spec changes, else every interval."""
        stop = stop or asyncio.Event()
        wake = asyncio.Event()
        watcher = asyncio.create_task(self._watch(wake), name=f"watch node {self.node}")
        # a pass runs at least every interval; a few missed ones (a slow driver) are not yet stuck
        self.liveness.expect("reconcile loop", 6 * self.interval_s + 60)
        try:
            while not stop.is_set():
                self.liveness.beat("reconcile loop")
                wake.clear()
                try:
                    await self.reconcile_once()
                except DynpartError as e:
                    log.error("node %s: pass failed: %s", self.node, e)
                except Exception:  # keep the agent alive; the next pass starts from the real state
                    log.exception("node %s: pass failed", self.node)
                waits = [asyncio.create_task(wake.wait()), asyncio.create_task(stop.wait())]
                try:
                    await asyncio.wait(waits, timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in waits:
                        t.cancel()
        finally:
            watcher.cancel()
            try:
                await watcher
            except asyncio.CancelledError:
                pass

    async def _watch(self, wake: asyncio.Event) -> None:
        """Wake the loop when the node's spec annotations change. The node API's watch retries
        API failures itself; anything else ends it and it is started again after a back-off (a
        dead watch would leave the agent acting only every interval)."""
        last: dict[str, str] | None = None
        while True:  # a watch that ends without failing is started again at once
            async for attempt in retrying(self.kube, f"watch of node {self.node}", retry_on=Exception, logger=log):
                with attempt:
                    async for node in self.node_api.watch():
                        spec = {k: v for k, v in node.annotations.items() if k.startswith(SPEC_PREFIX)}
                        if spec != last:
                            if last is not None:
                                wake.set()
                            last = spec


def _valid_or_none(plan_id: str | None) -> str | None:
    return plan_id if is_plan_id(plan_id) else None
