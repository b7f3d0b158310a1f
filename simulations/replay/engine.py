"""Replay a trace over time on a MIG or MPS cluster, planned by `planner.plan()`.

Pods arrive at their creation time (counted from the first one, divided by `compress`: a
compressed trace brings the same pods closer together, a higher load on a small cluster) and
leave after their recorded duration. GPU pods wait in a queue; every `window_s` of simulated time,
when something changed (an arrival, a departure, or a plan that placed pods while more waited
than it was given) and pods wait, the simulator builds a
snapshot of the whole cluster (slices held by pods are `used`, with the pod's name) with the
oldest `plan_pods` waiting pods, calls `plan(snapshot, options=PlanOptions(policy=...))` and
applies the plan:
- the plan must keep every used slice in place (compared layout by layout); a plan that does
  not is counted in `used_slices_disrupted` and not applied;
- a GPU whose layout changes is busy for `mig_op_delay_s` per MIG instance created or
  destroyed (MIG) or `mps_switch_delay_s` per MPS configuration change; a slice it creates is
  ready when the GPU is; a pod starts when all its slices are ready;
- a slice is given to a pod only when no pod holds it: slices are reused only after their pod
  left.
CPU-only pods do not go through the planner (it plans GPU resources): they are placed at each
planning tick, first come first served, on the node with the least CPU left that fits.
Static layouts are applied at time 0 without delay and never change.
The cluster state is the planner's own models (`replay.cluster`): the snapshot given to `plan()`
is that state, not a copy built from another model.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynpart.catalog import Catalog
from dynpart.planner.core import PlanOptions, plan
from dynpart.simulations import bridge
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.inputs.cluster_spec import ClusterSpec
from dynpart.simulations.inputs.traces import TracePod
from dynpart.simulations.replay.cluster import ReplayCluster
from dynpart.simulations.replay.mapping import RULES, request_for
from dynpart.snapshot import PendingPod, PlacedSlice, Plan, Snapshot

REPLAY_POLICIES = ("dynpart", "nos", "static")
FAIRNESS = ("rank", "age", "none")


@dataclass(frozen=True)
class ReplayOptions:
    policy: str = "dynpart"
    mode: str | None = None  # override the cluster's mode
    mapping: str = "compute"
    compress: float = 1.0  # arrival times divided by this (durations kept): load x compress
    window_s: float = 60.0
    mig_op_delay_s: float = 5.0
    mps_switch_delay_s: float = 30.0
    plan_pods: int = 64
    time_limit_s: float = 0.1
    # priority of the waiting pods given to a plan (the same rule for every policy): "age" = one
    # level per aging_s waited, up to max_priority; "rank" = by queue position (the oldest fifth
    # highest, then the next fifth...); "none" = all equal
    fairness: str = "age"
    aging_s: float = 60.0
    max_priority: int = 4  # the planner weighs levels strictly: keep few (CP-SAT objective is int64)
    static_layout: tuple[tuple[str, str], ...] = ()  # PlanOptions.static_layout as pairs

    def check(self) -> None:
        if self.policy not in REPLAY_POLICIES:
            raise SimulationError(f"--policy {self.policy!r}: expected one of {', '.join(REPLAY_POLICIES)}")
        if self.mapping not in RULES:
            raise SimulationError(f"--mapping {self.mapping!r}: expected one of {', '.join(RULES)}")
        if self.compress <= 0:
            raise SimulationError(f"--compress {self.compress}: must be positive")
        if self.window_s <= 0:
            raise SimulationError(f"--window {self.window_s}: must be positive")
        if self.mig_op_delay_s < 0 or self.mps_switch_delay_s < 0:
            raise SimulationError("reconfiguration delays cannot be negative")
        if self.fairness not in FAIRNESS:
            raise SimulationError(f"--fairness {self.fairness!r}: expected one of {', '.join(FAIRNESS)}")
        if not 0 <= self.max_priority <= 6:
            raise SimulationError(f"max priority {self.max_priority}: expected 0..6")
        if self.plan_pods < 1:
            raise SimulationError("--plan-pods must be at least 1")


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

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.arrival


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


PendingTuple = tuple[PodRun, int]


def run_replay(pods: Sequence[TracePod], spec: ClusterSpec, catalog: Catalog, opts: ReplayOptions,
               progress: Callable[[float, float], None] | None = None) -> ReplayResult:
    opts.check()
    t_wall = time.perf_counter()
    cl = ReplayCluster(spec, catalog, opts.mode)
    origin = min((p.creation_time or 0 for p in pods), default=0)
    runs: list[PodRun] = []
    ignored = {"gpu_spec_not_applied": 0}
    for p in pods:
        if p.creation_time is None or p.deletion_time is None:
            raise SimulationError(f"pod {p.name} (line {p.line}) has no creation/deletion time: replay needs them")
        if p.gpu_spec:
            ignored["gpu_spec_not_applied"] += 1  # the trace's models are not in a replay cluster
        res, count = request_for(p, cl.model, cl.mode, opts.mapping) if p.num_gpu else (None, 0)
        runs.append(PodRun(p, (p.creation_time - origin) / opts.compress, float(p.deletion_time - p.creation_time),
                           res, count))
    runs.sort(key=lambda r: (r.arrival, r.pod.line))
    for r in runs:
        r.failed = cl.never_fits(r.pod)

    plan_opts = PlanOptions(policy=opts.policy, time_limit_s=opts.time_limit_s,
                            static_layout=dict(opts.static_layout))
    by_name = {r.pod.name: r for r in runs}
    seq = 0
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, pod)

    def push(t: float, kind: str, name: str = "") -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, name))

    for r in runs:
        push(r.arrival, "arrive", r.pod.name)
    waiting_gpu: dict[str, PodRun] = {}  # arrived, not yet given slices (insertion = arrival order)
    waiting_cpu: dict[str, PodRun] = {}
    assigned_not_started = 0
    running = 0
    timeline: list[tuple[float, int, int, float]] = []
    stats = {"reconfigurations": 0, "mig_ops": 0, "disrupted": 0, "rejected": 0, "plan_calls": 0, "plan_s": 0.0}
    touched: set[tuple[int, int]] = set()
    dirty = False
    tick_at: float | None = None
    horizon = max((r.arrival for r in runs), default=0.0)

    offered: set[str] | None = None  # resources a static layout offers at all (None: any can be made)
    if opts.policy == "static":
        _apply(cl, _plan(cl, [], catalog, plan_opts, stats), 0.0, opts, by_name, stats, touched, initial=True)
        offered = cl.offered_resources()

    now = 0.0
    while events:
        now, _, kind, name = heapq.heappop(events)
        if kind == "arrive":
            r = by_name[name]
            if r.failed is None:
                (waiting_gpu if r.resource else waiting_cpu)[name] = r
                dirty = True
        elif kind == "start":
            assigned_not_started -= 1
            running += 1
            push(now + by_name[name].duration, "leave", name)
        elif kind == "leave":
            _release(cl, by_name[name])
            running -= 1
            dirty = True
        elif kind == "tick":
            tick_at = None
            if dirty and (waiting_gpu or waiting_cpu):
                dirty = False
                started = _place_cpu_pods(cl, waiting_cpu, now)
                for r in started:
                    running += 1
                    push(now + r.duration, "leave", r.pod.name)
                # a pod whose resource the static layout never offers waits forever, without
                # keeping the pods behind it out of the plan
                batch = [r for r in waiting_gpu.values() if offered is None or r.resource in offered]
                batch = batch[: opts.plan_pods]
                if batch:
                    prios = [_priority(r, k, len(batch), now, opts) for k, r in enumerate(batch)]
                    result = _plan(cl, list(zip(batch, prios)), catalog, plan_opts, stats)
                    placed = _apply(cl, result, now, opts, by_name, stats, touched)
                    for r, start in placed:
                        del waiting_gpu[r.pod.name]
                        assigned_not_started += 1
                        push(start, "start", r.pod.name)
                    # pods beyond this plan's batch get their turn in the next window
                    dirty = bool(placed) and len(waiting_gpu) > len(batch) - len(placed)
        if (waiting_gpu or waiting_cpu) and dirty and tick_at is None:
            tick_at = (now // opts.window_s + 1) * opts.window_s
            push(tick_at, "tick")
        if not events or events[0][0] > now:
            point = (now, len(waiting_gpu) + assigned_not_started, running, cl.allocation())
            if not timeline or timeline[-1][1:] != point[1:]:  # only when something changed
                timeline.append(point)
            if progress is not None:
                progress(min(now, horizon), horizon)
    if timeline and timeline[-1][0] != now:
        timeline.append((now,) + timeline[-1][1:])  # the end of the simulation
    return ReplayResult(
        policy=opts.policy, mode=cl.mode, runs=runs, timeline=timeline,
        reconfigurations=int(stats["reconfigurations"]), mig_ops=int(stats["mig_ops"]), gpus_touched=len(touched),
        gpu_count=cl.gpu_count, used_slices_disrupted=int(stats["disrupted"]), plans_rejected=int(stats["rejected"]),
        plan_calls=int(stats["plan_calls"]), plan_s=float(stats["plan_s"]), end_time=now,
        wall_s=time.perf_counter() - t_wall, ignored_rows={k: v for k, v in ignored.items() if v})


def _priority(r: PodRun, position: int, n: int, now: float, opts: ReplayOptions) -> int:
    """Fairness: older pods get higher priority (the same rule for every policy)."""
    if opts.fairness == "rank":
        return opts.max_priority - position * (opts.max_priority + 1) // n
    if opts.fairness == "age" and opts.aging_s > 0:
        return min(opts.max_priority, int((now - r.arrival) // opts.aging_s))
    return 0


def _plan(cl: ReplayCluster, pending: list[PendingTuple], catalog: Catalog, opts: PlanOptions,
          stats: dict) -> tuple[Snapshot, Plan]:
    snap = cl.snapshot([_pending_pod(r, prio) for r, prio in pending])
    t0 = time.perf_counter()
    result = plan(snap, catalog, opts)
    stats["plan_s"] += time.perf_counter() - t0
    stats["plan_calls"] += 1
    return snap, result


def _pending_pod(r: PodRun, priority: int) -> PendingPod:
    assert r.resource is not None  # only GPU pods are given to the planner
    return bridge.pending_pod(r.pod, r.resource, r.count, priority)


def _apply(cl: ReplayCluster, planned: tuple[Snapshot, Plan], now: float, opts: ReplayOptions,
           by_name: dict[str, PodRun], stats: dict, touched: set,
           initial: bool = False) -> list[tuple[PodRun, float]]:
    """Apply a plan: new layouts (with their delays), then the placements. Returns the pods
    given slices (their start times set), with those start times."""
    snap, result = planned
    bad = bridge.disrupted_slices(snap, result)
    if bad:
        stats["disrupted"] += len(bad)
        stats["rejected"] += 1
        return []
    delay_per_op = opts.mig_op_delay_s if cl.mode == "mig" else 0.0
    for lay in result.layouts:
        ni = cl.index[lay.node]
        for gl in lay.gpus:
            created, destroyed = cl.changes(ni, gl)
            if not (created or destroyed):
                continue
            if initial:
                ready = now
            else:
                stats["reconfigurations"] += 1
                stats["mig_ops"] += created + destroyed
                touched.add((ni, gl.index))
                delay = delay_per_op * (created + destroyed) if cl.mode == "mig" else opts.mps_switch_delay_s
                clock = cl.clocks[ni][gl.index]
                clock.busy_until = max(now, clock.busy_until) + delay
                ready = clock.busy_until
            cl.set_layout(ni, gl, ready)
    out: list[tuple[PodRun, float]] = []
    for pl in result.placements:
        r = by_name[pl.pod]
        ni = cl.index[pl.node]
        start = now
        for placed in pl.slices:
            start = max(start, cl.take(ni, placed, r.pod.name, now))
            r.slices.append(placed)
        r.node = ni
        r.assigned = now
        r.start = start
        cl.reserve(ni, r.pod)
        node = cl.nodes[ni]
        if node.cpu_milli_free < 0 or node.memory_mib_free < 0:
            raise AssertionError(f"plan overcommitted CPU/memory of {pl.node} with {pl.pod}")
        out.append((r, start))
    return out


def _release(cl: ReplayCluster, r: PodRun) -> None:
    assert r.node is not None
    cl.unreserve(r.node, r.pod)
    cl.release(r.node, r.slices, r.pod.name)


def _place_cpu_pods(cl: ReplayCluster, waiting: dict[str, PodRun], now: float) -> list[PodRun]:
    """First come first served, on the node with the least CPU left that fits."""
    started = []
    nodes = cl.nodes
    for name, r in list(waiting.items()):
        fits = [i for i, n in enumerate(nodes)
                if n.cpu_milli_free >= r.pod.cpu_milli and n.memory_mib_free >= r.pod.memory_mib]
        if not fits:
            continue
        best = min(fits, key=lambda i: (nodes[i].cpu_milli_free - r.pod.cpu_milli, i))
        cl.reserve(best, r.pod)
        r.node, r.assigned, r.start = best, now, now
        del waiting[name]
        started.append(r)
    return started
