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
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynpart.catalog import Catalog, GpuModel
from dynpart.errors import DynpartError
from dynpart.planner.core import PlanOptions, plan
from dynpart.resources import WHOLE_GPU, mig_resource_name, mps_resource_name
from dynpart.simulations import bridge
from dynpart.simulations.cluster_spec import ClusterSpec
from dynpart.simulations.errors import SimulationError
from dynpart.simulations.mapping import RULES, held_share, request_for
from dynpart.simulations.traces import TracePod
from dynpart.snapshot import Gpu, MigInstance, MpsSlice, Plan, Snapshot

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
    slices: list[tuple[int, str]] = field(default_factory=list)  # (gpu, slice key) held
    failed: str | None = None  # why it can never run on this cluster

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.arrival


class SimGpu:
    __slots__ = ("index", "mig", "mps", "whole", "busy_until")

    def __init__(self, index: int):
        self.index = index
        self.mig: list[list] = []  # [profile, start, holder pod or None, ready_at]
        self.mps: list[list] = []  # [size, holder pod or None, ready_at]
        self.whole: str | None = None
        self.busy_until = 0.0


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


class _Cluster:
    """Per node: CPU/memory free and GPUs; one GPU model and one mode."""

    def __init__(self, spec: ClusterSpec, catalog: Catalog, mode: str | None):
        gpu_nodes = [n for n in spec.nodes if n.gpus]
        models = {n.model for n in gpu_nodes}
        if len(models) != 1:
            raise SimulationError(f"{spec.source}: replay needs GPU nodes of one model; found "
                                  f"{', '.join(sorted(models)) or 'none'}")
        try:
            self.model: GpuModel = catalog.resolve(models.pop(), where=f"{spec.source}: gpu_model")
        except DynpartError as e:
            raise SimulationError(str(e)) from None
        self.mode = mode or gpu_nodes[0].mode
        if self.mode == "mig" and not self.model.supports_mig:
            raise SimulationError(f"{spec.source}: {self.model.name} does not support MIG; use --mode mps")
        self.names = [n.name for n in spec.nodes]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.cpu = [n.cpu_milli for n in spec.nodes]
        self.mem = [n.memory_mib for n in spec.nodes]
        self.cpu_cap = list(self.cpu)
        self.mem_cap = list(self.mem)
        self.gpus = [[SimGpu(i) for i in range(n.gpus)] for n in spec.nodes]
        self.capacity = self.model.memory_gb  # MPS capacity unit: GB
        self.gpu_count = sum(len(g) for g in self.gpus)

    def snapshot(self, pending: list[PendingTuple]) -> Snapshot:
        nodes = []
        for i, gpus in enumerate(self.gpus):
            if not gpus:
                continue  # the planner only needs GPU nodes
            out = []
            for g in gpus:
                if self.mode == "mig":
                    out.append(Gpu.model_construct(index=g.index, mps=[], whole_pod=None, capacity=None, mig=[
                        MigInstance.model_construct(profile=p, start=s, used=h is not None, pod=h) for p, s, h, _ in g.mig]))
                else:
                    out.append(Gpu.model_construct(index=g.index, mig=[], whole_pod=g.whole, capacity=None, mps=[
                        MpsSlice.model_construct(size=s, used=h is not None, pod=h) for s, h, _ in g.mps]))
            nodes.append(bridge.node(self.names[i], self.mode, self.model.name, self.cpu[i], self.mem[i], out))
        return bridge.snapshot(nodes, [bridge.pending_pod(r.pod, r.resource, r.count, prio) for r, prio in pending])

    def offered_resources(self) -> set[str]:
        """Resource names the current layouts offer (a whole GPU: on a GPU without slices)."""
        out: set[str] = set()
        for gpus in self.gpus:
            for g in gpus:
                if self.mode == "mig":
                    out.update(mig_resource_name(p) for p, _, _, _ in g.mig)
                elif g.mps:
                    out.update(mps_resource_name(s) for s, _, _ in g.mps)
                else:
                    out.add(WHOLE_GPU)
        return out

    def allocation(self) -> float:
        held = 0.0
        for gpus in self.gpus:
            for g in gpus:
                if self.mode == "mig":
                    held += sum(held_share(self.model, "mig", p, 0) for p, _, h, _ in g.mig if h is not None)
                elif g.whole is not None:
                    held += 1.0
                else:
                    held += sum(s for s, h, _ in g.mps if h is not None) / self.capacity
        return 100.0 * held / self.gpu_count if self.gpu_count else 0.0


PendingTuple = tuple[PodRun, int]


def _never_fits(run: PodRun, cl: _Cluster) -> str | None:
    pod = run.pod
    hosts = [i for i in range(len(cl.names)) if cl.cpu_cap[i] >= pod.cpu_milli and cl.mem_cap[i] >= pod.memory_mib
             and (pod.num_gpu == 0 or len(cl.gpus[i]) >= pod.num_gpu)]
    if not hosts:
        return (f"no node has {pod.cpu_milli}m CPU, {pod.memory_mib} MiB"
                + (f" and {pod.num_gpu} GPUs" if pod.num_gpu else ""))
    return None


def run_replay(pods: Sequence[TracePod], spec: ClusterSpec, catalog: Catalog, opts: ReplayOptions,
               progress: Callable[[float, float], None] | None = None) -> ReplayResult:
    opts.check()
    t_wall = time.perf_counter()
    cl = _Cluster(spec, catalog, opts.mode)
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
        r.failed = _never_fits(r, cl)

    plan_opts = PlanOptions(policy=opts.policy, time_limit_s=opts.time_limit_s,  # type: ignore[arg-type]
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
                    for r in placed:
                        del waiting_gpu[r.pod.name]
                        assigned_not_started += 1
                        push(r.start, "start", r.pod.name)  # type: ignore[arg-type]
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


def _plan(cl: _Cluster, pending: list[PendingTuple], catalog: Catalog, opts: PlanOptions,
          stats: dict) -> tuple[Snapshot, Plan]:
    snap = cl.snapshot(pending)
    t0 = time.perf_counter()
    result = plan(snap, catalog, opts)
    stats["plan_s"] += time.perf_counter() - t0
    stats["plan_calls"] += 1
    return snap, result


def _apply(cl: _Cluster, planned: tuple[Snapshot, Plan], now: float, opts: ReplayOptions,
           by_name: dict[str, PodRun], stats: dict, touched: set, initial: bool = False) -> list[PodRun]:
    """Apply a plan: new layouts (with their delays), then the placements. Returns the pods
    given slices, with their start times set."""
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
            g = cl.gpus[ni][gl.index]
            if cl.mode == "mig":
                old = {(p, s): (h, ready) for p, s, h, ready in g.mig}
                new_keys = [(m.profile, m.start) for m in gl.mig]
                created = sum(1 for k in new_keys if k not in old)
                destroyed = len(set(old) - set(new_keys))
            else:
                old_sizes = [s for s, _, _ in g.mps]
                new_sizes = [s.size for s in gl.mps]
                kept = _multiset_common(old_sizes, new_sizes)
                created, destroyed = len(new_sizes) - kept, len(old_sizes) - kept
            if not (created or destroyed):
                continue
            if initial:
                ready = now
            else:
                stats["reconfigurations"] += 1
                stats["mig_ops"] += created + destroyed
                touched.add((ni, gl.index))
                delay = delay_per_op * (created + destroyed) if cl.mode == "mig" else opts.mps_switch_delay_s
                g.busy_until = max(now, g.busy_until) + delay
                ready = g.busy_until
            if cl.mode == "mig":
                g.mig = [[p, s, old[(p, s)][0], old[(p, s)][1]] if (p, s) in old else [p, s, None, ready]
                         for p, s in sorted(new_keys, key=lambda k: k[1])]
            else:
                held = [x for x in g.mps if x[1] is not None]
                free = [x for x in g.mps if x[1] is None]
                sizes = [s.size for s in gl.mps if not s.used]  # free or planned slices of the new layout
                new_free = []
                for size in sizes:
                    same = next((x for x in free if x[0] == size), None)
                    if same is not None:
                        free.remove(same)
                        new_free.append(same)
                    else:
                        new_free.append([size, None, ready])
                g.mps = held + new_free
    out: list[PodRun] = []
    for pl in result.placements:
        r = by_name[pl.pod]
        ni = cl.index[pl.node]
        start = now
        for gi, what in pl.slices:
            g = cl.gpus[ni][gi]
            start = max(start, _take(cl, g, what, r.pod.name, now))
            r.slices.append((gi, what))
        r.node = ni
        r.assigned = now
        r.start = start
        cl.cpu[ni] -= r.pod.cpu_milli
        cl.mem[ni] -= r.pod.memory_mib
        if cl.cpu[ni] < 0 or cl.mem[ni] < 0:
            raise AssertionError(f"plan overcommitted CPU/memory of {pl.node} with {pl.pod}")
        out.append(r)
    return out


def _multiset_common(a: list[int], b: list[int]) -> int:
    left = list(b)
    n = 0
    for x in a:
        if x in left:
            left.remove(x)
            n += 1
    return n


def _take(cl: _Cluster, g: SimGpu, what: str, pod: str, now: float) -> float:
    """Give a free slice to the pod; returns when it is ready. Never a slice a pod holds."""
    if what == "whole":
        if g.whole is not None or g.mps:
            raise AssertionError(f"GPU {g.index} is not free for {pod} (whole GPU)")
        g.whole = pod
        g.busy_until = max(g.busy_until, now)
        return g.busy_until
    if cl.mode == "mig":
        profile, _, start = what.partition("@")
        for inst in g.mig:
            if inst[0] == profile and inst[1] == int(start):
                if inst[2] is not None:
                    raise AssertionError(f"{pod} planned on {what} of GPU {g.index}, held by {inst[2]}")
                inst[2] = pod
                return inst[3]
        raise AssertionError(f"{pod} planned on {what} of GPU {g.index}, which the layout lacks")
    size = int(what)
    for sl in g.mps:
        if sl[0] == size and sl[1] is None:
            sl[1] = pod
            return sl[2]
    raise AssertionError(f"{pod} planned on a free {size} GB slice of GPU {g.index}, which the layout lacks")


def _release(cl: _Cluster, r: PodRun) -> None:
    assert r.node is not None
    cl.cpu[r.node] += r.pod.cpu_milli
    cl.mem[r.node] += r.pod.memory_mib
    for gi, what in r.slices:
        g = cl.gpus[r.node][gi]
        if what == "whole":
            g.whole = None
        elif cl.mode == "mig":
            for inst in g.mig:
                if inst[2] == r.pod.name:
                    inst[2] = None
        else:
            for sl in g.mps:
                if sl[1] == r.pod.name:
                    sl[1] = None


def _place_cpu_pods(cl: _Cluster, waiting: dict[str, PodRun], now: float) -> list[PodRun]:
    started = []
    for name, r in list(waiting.items()):
        fits = [i for i in range(len(cl.names)) if cl.cpu[i] >= r.pod.cpu_milli and cl.mem[i] >= r.pod.memory_mib]
        if not fits:
            continue
        best = min(fits, key=lambda i: (cl.cpu[i] - r.pod.cpu_milli, i))
        cl.cpu[best] -= r.pod.cpu_milli
        cl.mem[best] -= r.pod.memory_mib
        r.node, r.assigned, r.start = best, now, now
        del waiting[name]
        started.append(r)
    return started
