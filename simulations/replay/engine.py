"""Replay a trace over time on a MIG or MPS cluster, decided by the planner controller's own
loop (`planner.loop.PlanningLoop`, built from the same `PlannerSettings`) in simulated time.

Pods arrive at their creation time (counted from the first one, divided by `compress`: a
compressed trace brings the same pods closer together, a higher load on a small cluster) and
leave after their recorded duration. What happens to a pod is what happens on a cluster:
- the scheduler (`replay.scheduler`) binds it at once where a free slice of its kind is
  advertised; otherwise it is unschedulable and the loop takes it into a batch;
- when the loop's batch closes (`batch_idle_s` / `batch_timeout_s`), or `resync_s` after the
  last round while pods wait, the loop plans: the snapshot is the cluster as it is (slices held
  by pods are `used`, with the pod's name) without the nodes whose plan is not acknowledged yet,
  with every waiting pod not planned onto such a node, oldest first;
- a node whose layout the plan changes is held back until its agent acknowledges, which in the
  replay is when its agent's pass ends: `mig_op_delay_s` per MIG instance created or destroyed
  on any of its GPUs (one after another), `mps_switch_delay_s` for an MPS configuration change.
  The slices it creates are ready then; a pod starts when all its slices are ready;
- the plan must keep every used slice in place (compared layout by layout); a plan that does not
  is counted in `used_slices_disrupted` and not applied;
- a slice is given to a pod only when no pod holds it: slices are reused only after their pod left.
What differs from a cluster: the replay binds each planned pod to the slice made for it (a real
scheduler may give that slice to another pod of the same request first: the controller's
reservations, planner/controller.py); the agent's acknowledgement costs no time beyond the
reconfiguration; no watch event is ever missed, so a resync round whose cluster and pods did not
change since the last round is skipped (it would plan the same). Static layouts are applied at
time 0 without delay and never change (no loop runs: the scheduler alone binds pods to their
slices); `nos` is the same loop with nos's batch window (10 s idle,
60 s at most) and the nos policy.
The cluster state is the planner's own models (`replay.cluster`): the snapshot given to the loop
is that state, not a copy built from another model.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynpart.catalog import Catalog
from dynpart.planner.loop import PlanningLoop, node_writes
from dynpart.planner.policy import PolicyName
from dynpart.settings import PlannerSettings, default_planner_settings
from dynpart.simulations import bridge
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import MAX_TIME_S, TracePod
from dynpart.simulations.replay import scheduler
from dynpart.simulations.replay.cluster import ReplayCluster
from dynpart.simulations.replay.mapping import RULES, request_for
from dynpart.snapshot import PendingPod, PlacedSlice, Plan, Snapshot, full_layout

REPLAY_POLICIES = ("dynpart", "nos", "static")
# nos's batch window (its partitioner's defaults): the baseline runs the loop with it
NOS_BATCH = {"batch_idle_s": 10.0, "batch_timeout_s": 60.0}


@dataclass(frozen=True)
class ReplayOptions:
    policy: str = "dynpart"
    mode: str | None = None  # override the cluster's mode
    mapping: str = "compute"
    compress: float = 1.0  # arrival times divided by this (durations kept): load x compress
    mig_op_delay_s: float = 5.0
    mps_switch_delay_s: float = 30.0
    # the planner controller's settings (batch window, resync, exact-search budget, workload)
    planner: PlannerSettings = field(default_factory=default_planner_settings)
    static_layout: tuple[tuple[str, str], ...] = ()  # PlanOptions.static_layout as pairs

    def check(self) -> None:
        if self.policy not in REPLAY_POLICIES:
            raise SimulationError(f"--policy {self.policy!r}: expected one of {', '.join(REPLAY_POLICIES)}")
        if self.mapping not in RULES:
            raise SimulationError(f"--mapping {self.mapping!r}: expected one of {', '.join(RULES)}")
        if not (math.isfinite(self.compress) and self.compress > 0):
            raise SimulationError(f"--compress {self.compress}: must be a positive finite number")
        for option, v in (("--mig-delay", self.mig_op_delay_s), ("--mps-delay", self.mps_switch_delay_s)):
            if not (math.isfinite(v) and v >= 0):
                raise SimulationError(f"{option} {v}: must be a finite number of seconds, 0 or more")

    def loop(self) -> PlanningLoop:
        """The controller's loop for this policy."""
        settings = self.planner
        if self.policy == "nos":
            settings = settings.model_copy(update=NOS_BATCH)
        policy: PolicyName = "nos" if self.policy == "nos" else "static" if self.policy == "static" else "dynpart"
        return PlanningLoop(settings, policy, dict(self.static_layout))


@dataclass
class PodRun:
    pod: TracePod
    arrival: float
    duration: float
    resource: str | None  # None for CPU-only pods
    count: int
    assigned: float | None = None  # when it was given its slices (it holds them from then on)
    start: float | None = None  # when its slices were ready and it started
    node: int | None = None
    slices: list[PlacedSlice] = field(default_factory=list)  # the slices it holds
    failed: str | None = None  # why it can never run on this cluster
    planned: bool = False  # bound on slices a plan made or chose for it (else by the scheduler alone)
    # the pod as the planner sees it while it waits, built at its first round (the same every
    # round: a backlog of thousands of pods is not built again each round)
    pending: PendingPod | None = None

    def pending_pod(self) -> PendingPod:
        if self.pending is None:
            self.pending = bridge.pending_pod(self.pod, self.resource or "", self.count, gpu_spec=False)
        return self.pending

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.arrival


@dataclass(frozen=True)
class NodeWritten:
    """One node layout the loop decided, as the controller would write it (for comparisons)."""
    time: float
    node: str
    plan_id: str
    layout: dict  # the node's whole desired layout (all its GPUs), NodeLayout.model_dump()
    pods: tuple[str, ...]


@dataclass
class ReplayResult:
    policy: str
    mode: str
    runs: list[PodRun]
    timeline: list[tuple[float, int, int, float]]  # (t, waiting GPU pods, running pods, allocation %)
    reconfigurations: int  # GPU layout changes
    mig_ops: int  # instances (or MPS slices) created + destroyed
    gpus_touched: int  # distinct GPUs reconfigured at least once
    gpu_count: int
    used_slices_disrupted: int
    plans_rejected: int
    plan_calls: int
    plan_s: float
    end_time: float
    wall_s: float
    ignored_rows: dict[str, int] = field(default_factory=dict)  # counts of rows read but not fully applied
    writes: list[NodeWritten] = field(default_factory=list)


class _Replay:
    """One replay's mutable state and its event handlers (run_replay drives it)."""

    def __init__(self, runs: list[PodRun], cl: ReplayCluster, catalog: Catalog, opts: ReplayOptions):
        self.runs, self.cl, self.catalog, self.opts = runs, cl, catalog, opts
        self.loop = opts.loop()
        self.by_name = {r.pod.name: r for r in runs}
        self.events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, pod or node)
        self.seq = 0
        self.waiting: dict[str, PodRun] = {}  # GPU pods arrived, not bound (insertion = arrival order)
        self.waiting_cpu: dict[str, PodRun] = {}
        self.assigned_not_started = 0
        self.running = 0
        self.stats = {"reconfigurations": 0, "mig_ops": 0, "disrupted": 0, "rejected": 0, "plan_calls": 0,
                      "plan_s": 0.0}
        self.touched: set[tuple[int, int]] = set()
        self.writes: list[NodeWritten] = []
        self.wake_at: float | None = None
        self.changed = True  # something a round would see changed since the last round
        self.rounds = 0

    def push(self, t: float, kind: str, name: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, name))

    # --- the scheduler ----------------------------------------------------------------------

    def schedule(self, now: float, only: list[PodRun] | None = None) -> None:
        """Bind what the scheduler can bind now, oldest first (`only`: just these pods)."""
        cpu_pods = [r for r in (only or self.waiting_cpu.values()) if r.resource is None]
        for r in cpu_pods:
            where = scheduler.bind(self.cl, None, 0, r.pod.cpu_milli, r.pod.memory_mib, now)
            if where is not None:
                self._bind(r, where[0], [], now, now)
        gpu_pods = [r for r in (only or self.waiting.values()) if r.resource is not None]
        if not gpu_pods:
            return
        offered = scheduler.free_counts(self.cl, now)
        held = self.loop.held_pods()
        for r in gpu_pods:
            if r.pod.name in held or offered[r.resource or ""] < r.count:
                continue
            where = scheduler.bind(self.cl, r.resource, r.count, r.pod.cpu_milli, r.pod.memory_mib, now)
            if where is not None:
                offered[r.resource or ""] -= r.count
                self._bind(r, where[0], where[1], now, now)

    def _bind(self, r: PodRun, node: int, slices: list[PlacedSlice], now: float, start: float) -> None:
        for placed in slices:
            start = max(start, self.cl.take(node, placed, r.pod.name, now))
            r.slices.append(placed)
        r.node, r.assigned, r.start = node, now, start
        self.cl.reserve(node, r.pod)
        n = self.cl.nodes[node]
        if n.cpu_milli_free < 0 or n.memory_mib_free < 0:
            raise AssertionError(f"{r.pod.name} overcommitted CPU/memory of {n.name}")
        self.loop.pod_done(r.pod.name)
        if r.resource is None:
            del self.waiting_cpu[r.pod.name]
            self.running += 1
            self.push(now + r.duration, "leave", r.pod.name)
        else:
            del self.waiting[r.pod.name]
            self.assigned_not_started += 1
            self.push(start, "start", r.pod.name)
        self.changed = True

    # --- events -----------------------------------------------------------------------------

    def arrive(self, r: PodRun, now: float) -> None:
        if r.failed is not None:
            return
        (self.waiting if r.resource else self.waiting_cpu)[r.pod.name] = r
        self.schedule(now, [r])
        if r.resource and r.pod.name in self.waiting:
            self.loop.pod_waiting(r.pod.name, now)  # unschedulable: the controller's batch
            self.changed = True

    def leave(self, r: PodRun, now: float) -> None:
        assert r.node is not None
        self.cl.unreserve(r.node, r.pod)
        self.cl.release(r.node, r.slices, r.pod.name)
        for gpu in sorted({s.gpu for s in r.slices}):
            if (r.node, gpu) in self.cl.draining:
                self._destroyed(r.node, gpu, self.cl.drop_free(r.node, gpu), now)
        self.running -= 1
        self.facts_changed(now)

    def acknowledged(self, node: str, plan_id: str, now: float) -> None:
        if self.loop.acknowledged(node, plan_id, now) is not None:
            self.facts_changed(now)

    def facts_changed(self, now: float) -> None:
        """A node's reported state changed: the scheduler tries again, and the pods still waiting
        join the batch (the controller's reaction to a node status change)."""
        self.changed = True
        self.schedule(now)
        self.loop.facts_changed(list(self.waiting), now)

    # --- the loop ---------------------------------------------------------------------------

    def maybe_plan(self, now: float) -> None:
        if self.opts.policy == "static":
            return  # a static layout never changes: the scheduler alone binds pods to its slices
        held_pods = self.loop.held_pods()
        waiting = [r for r in self.waiting.values() if r.pod.name not in held_pods]
        if not self.loop.due(now, bool(waiting)):
            return
        batch_closed = self.loop.window.ready(now)
        self.loop.begin_round(now)
        if not waiting or not (batch_closed or self.changed):
            return  # a resync of what the last round saw plans the same: skipped
        self.changed = False
        held = self.loop.held_nodes()
        snap = bridge.snapshot([n for n in self.cl.gpu_nodes if n.name not in held],
                               [r.pending_pod() for r in waiting])
        snap = self.loop.prepare(snap, now)
        t0 = time.perf_counter()
        result = self.loop.decide(snap, self.catalog)
        self.stats["plan_s"] += time.perf_counter() - t0
        self.stats["plan_calls"] += 1
        self.rounds += 1
        self.apply(snap, result, now, f"r{self.rounds}")

    def apply(self, snap: Snapshot, result: Plan, now: float, plan_id: str, initial: bool = False) -> None:
        """Apply a plan: new layouts (with their delays; the node held until its GPUs are ready),
        then the placements."""
        bad = bridge.disrupted_slices(snap, result)
        if bad:
            self.stats["disrupted"] += len(bad)
            self.stats["rejected"] += 1
            return
        cl, opts = self.cl, self.opts
        snap_nodes = {n.name: n for n in snap.nodes}
        for k, write in enumerate(node_writes(result)):
            ni = cl.index[write.node]
            written = full_layout(snap_nodes[write.node], write.layout)  # as the controller writes it
            changed = []
            for gl in write.layout.gpus:
                (cl.draining.add if gl.drain else cl.draining.discard)((ni, gl.index))
                created, destroyed = cl.changes(ni, gl)
                if created or destroyed:
                    changed.append((gl, created + destroyed))
            # the node's agent applies the whole spec in one pass (agent/mig_agent.py: every destroy,
            # then every create, one after another over the GPUs) and its device plugin advertises
            # the new slices when the pass ends: they are all ready then, whichever GPU they are on
            node_ready = now
            if changed and not initial:
                ops = sum(n for _, n in changed)
                self.stats["reconfigurations"] += len(changed)
                self.stats["mig_ops"] += ops
                self.touched.update((ni, gl.index) for gl, _ in changed)
                delay = opts.mig_op_delay_s * ops if cl.mode == "mig" else opts.mps_switch_delay_s
                node_ready = max([now, *(c.busy_until for c in cl.clocks[ni])]) + delay
            for gl, _ in changed:
                if not initial:
                    cl.busy(ni, gl.index, node_ready)
                cl.set_layout(ni, gl, node_ready)
            if not initial:
                node_plan = f"{plan_id}.{k}"
                self.loop.written(write.node, node_plan, write.pods, now)
                self.writes.append(NodeWritten(now, write.node, node_plan, written.model_dump(), write.pods))
                self.push(node_ready, "ack", f"{write.node}\t{node_plan}")
        for pl in result.placements:
            r = self.by_name[pl.pod]
            r.planned = True
            self._bind(r, cl.index[pl.node], list(pl.slices), now, now)

    def _destroyed(self, node: int, gpu: int, count: int, now: float) -> None:
        """The agent of a drained GPU destroyed `count` slices that freed: the GPU is busy that long."""
        if not count:
            return
        self.stats["mig_ops"] += count
        delay = self.opts.mig_op_delay_s * count if self.cl.mode == "mig" else self.opts.mps_switch_delay_s
        self.cl.busy(node, gpu, max(now, self.cl.clocks[node][gpu].busy_until) + delay)

    def wake(self, now: float) -> None:
        """Schedule the next loop wake-up when pods wait (a resync only when something changed:
        one of nothing new would be skipped, and the replay would never end)."""
        if self.opts.policy == "static" or not (self.loop.window.members or (self.waiting and self.changed)):
            return
        at = max(now, self.loop.next_due())
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at
            self.push(at, "wake")


def check_arrivals(pods: Sequence[TracePod], compress: float) -> None:
    """The arrival times divided by `compress` stay within MAX_TIME_S (a --compress below 1
    spreads them): beyond it a float clock no longer tells a run time apart."""
    times = [p.creation_time for p in pods if p.creation_time is not None]
    last = (max(times) - min(times)) / compress if times else 0.0
    if last > MAX_TIME_S:
        raise SimulationError(f"--compress {compress:g}: the last pod would arrive at {last:.3g} s, after "
                              f"{MAX_TIME_S:.0e} s, where a float clock no longer tells a run time apart")


def run_replay(pods: Sequence[TracePod], spec: ClusterSpec, catalog: Catalog, opts: ReplayOptions,
               progress: Callable[[float, float], None] | None = None) -> ReplayResult:
    """Replay the trace under one policy. `progress(settled, total)`: pods that left or failed of
    all of them, after each instant of the simulated clock and once at the end."""
    opts.check()
    check_arrivals(pods, opts.compress)
    t_wall = time.perf_counter()
    cl = ReplayCluster(spec, catalog, opts.mode)
    origin = min((p.creation_time or 0 for p in pods), default=0)
    runs: list[PodRun] = []
    ignored = {"gpu_spec_not_applied": 0}
    for p in pods:
        if p.creation_time is None or p.deletion_time is None:
            raise SimulationError(f"pod {p.name} (line {p.line}) has no creation/deletion time: replay needs them")
        if p.gpu_spec and p.num_gpu:
            ignored["gpu_spec_not_applied"] += 1  # the trace's models are not in a replay cluster
        res, count = request_for(p, cl.model, cl.mode, opts.mapping) if p.num_gpu else (None, 0)
        runs.append(PodRun(p, (p.creation_time - origin) / opts.compress, float(p.deletion_time - p.creation_time),
                           res, count))
    runs.sort(key=lambda r: (r.arrival, r.pod.line))
    for r in runs:
        r.failed = cl.never_fits(r.pod)
    rp = _Replay(runs, cl, catalog, opts)
    for r in runs:
        rp.push(r.arrival, "arrive", r.pod.name)
    if opts.policy == "static":  # the fixed layout, in place before the first pod
        snap = cl.snapshot([])
        rp.apply(snap, rp.loop.decide(snap, catalog), 0.0, "static", initial=True)
    timeline: list[tuple[float, int, int, float]] = []
    # progress in pods settled (left, or failed at arrival) of all the trace's: the simulated clock
    # says nothing of a backlog draining after the last arrival (an overloaded trace, the case
    # most worth simulating, would show 100% for most of its run, and 0/0 when all arrive at once)
    settled = 0
    now = 0.0
    while rp.events:
        now, _, kind, name = heapq.heappop(rp.events)
        if kind == "arrive":
            rp.arrive(rp.by_name[name], now)
            settled += rp.by_name[name].failed is not None
        elif kind == "start":
            rp.assigned_not_started -= 1
            rp.running += 1
            rp.push(now + rp.by_name[name].duration, "leave", name)
        elif kind == "leave":
            rp.leave(rp.by_name[name], now)
            settled += 1
        elif kind == "ack":
            node, plan_id = name.split("\t")
            rp.acknowledged(node, plan_id, now)
        elif kind == "wake" and rp.wake_at == now:
            rp.wake_at = None
        if not rp.events or rp.events[0][0] > now:  # every event of this instant is in
            rp.maybe_plan(now)
            rp.wake(now)
            point = (now, len(rp.waiting) + rp.assigned_not_started, rp.running, cl.allocation())
            if not timeline or timeline[-1][1:] != point[1:]:  # only when something changed
                timeline.append(point)
            if progress is not None:
                progress(settled, len(runs))
    if progress is not None:
        progress(len(runs), len(runs))  # (pods never placed are settled by the end)
    if timeline and timeline[-1][0] != now:
        timeline.append((now,) + timeline[-1][1:])  # the end of the simulation
    st = rp.stats
    return ReplayResult(
        policy=opts.policy, mode=cl.mode, runs=runs, timeline=timeline,
        reconfigurations=int(st["reconfigurations"]), mig_ops=int(st["mig_ops"]), gpus_touched=len(rp.touched),
        gpu_count=cl.gpu_count, used_slices_disrupted=int(st["disrupted"]), plans_rejected=int(st["rejected"]),
        plan_calls=int(st["plan_calls"]), plan_s=float(st["plan_s"]), end_time=now,
        wall_s=time.perf_counter() - t_wall, ignored_rows={k: v for k, v in ignored.items() if v}, writes=rp.writes)
