"""A planning session: the cluster compiled once and kept between plans.

`plan(snapshot)` is `PlanningSession(snapshot.nodes).plan(snapshot.pending, snapshot.workload)`.
A caller that plans the same, slowly changing cluster again and again (the packing benchmark:
one plan per arrival on 1,500 nodes) keeps the session and tells it what changed with `commit`
(a plan was carried out) or `place_cpu_pod`; each plan then costs what its pods cost, not what
the cluster's size does: the GPU states, their bucket and capacity-class ids, the per-bucket
option costs, the candidate filters and the capacity totals of the bound are kept and updated
for the GPUs that changed. The plan is the one `plan()` returns on the same snapshot.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from dynpart.catalog import Catalog, GpuModel, default_catalog
from dynpart.errors import SnapshotError
from dynpart.planner.bound import capacity_left, placed_upper_bound
from dynpart.planner.index import GpuIndex, PlanCache
from dynpart.planner.objective import NodeRooms, NodeTerms, Objective, capacity_class, node_caps
from dynpart.planner.output import build_plan, keep_apart
from dynpart.planner.policies import POLICIES
from dynpart.planner.policy import PlanOptions
from dynpart.planner.problem import DemandKind, Problem, StaticFilter, compile_cluster, compile_requests, compile_workload
from dynpart.planner.state import GpuState, new_state
from dynpart.snapshot import (
    Node,
    PendingPod,
    Plan,
    RequestShare,
    Snapshot,
    apart_problems,
    held_by,
    held_problems,
    pod_problems,
    validate_snapshot,
)

_collector_lock = threading.Lock()
_plans_in_flight = 0
_collector_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """CPython's cycle collector paused while planning. A plan allocates a few hundred thousand
    small objects, all freed by reference counting (planning makes no reference cycles), and
    their number alone sets the collector off: each run scans the whole heap, the caller's
    snapshot included, a third of the time of a plan on 1,000 nodes. Reentrant and safe across
    threads: the collector runs again (if it ran before) when the last plan in flight ends."""
    global _plans_in_flight, _collector_was_enabled
    with _collector_lock:
        if _plans_in_flight == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _plans_in_flight += 1
    try:
        yield
    finally:
        with _collector_lock:
            _plans_in_flight -= 1
            if _plans_in_flight == 0 and _collector_was_enabled:
                gc.enable()


class PlanningSession:
    def __init__(self, nodes: Sequence[Node], catalog: Catalog | None = None,
                 models: dict[str, GpuModel] | None = None, fgd_as_published: bool = False):
        """`models`: each node's model when the nodes were validated already. `fgd_as_published`:
        the objective is FGD's F alone, without what dynpart adds (the GPUs a node's free CPU cannot
        feed, kinds weighed by the scarcity of the capacity they may use: planner/objective.py), to
        reproduce FGD as its authors ran it (the packing benchmark's `fgd` policy)."""
        self.catalog = catalog or default_catalog()
        self.fgd_as_published = fgd_as_published
        if models is None:
            models = validate_snapshot(Snapshot.model_construct(nodes=list(nodes), pending=[], workload=[]),
                                       self.catalog)
        nodes_i, gpus = compile_cluster(nodes, models)
        self._nodes = nodes
        self._held: dict[str, str] | None = None  # pods the nodes say hold a slice (`_validate`)
        self.problem = Problem(nodes_i, gpus, [])
        self.by_name = {n.name: n.idx for n in nodes_i}
        self.states: list[GpuState] = [new_state(g) for g in gpus]
        self.index = GpuIndex(self.problem)
        self.bid = self.index.buckets(self.states)
        self._caps = [capacity_left(g) for g in gpus]
        self._totals: list[int] = [sum(column) for column in zip(*self._caps)] if gpus else [0, 0, 0, 0]
        self._occupied = sum(1 for s in self.states if s.has_pod())
        self._static: StaticFilter = {}
        # the last objective: its workload, class ids of the GPUs, the nodes' terms and the rooms
        # of their CPU and memory (None while the objective is not active)
        self._objective: tuple[tuple[DemandKind, ...], Objective, np.ndarray | None, NodeTerms,
                               NodeRooms | None] | None = None
        self._pending: dict[str, PendingPod] = {}
        self.cpu = np.array([n.cpu_free for n in nodes_i], dtype=np.int64)
        self.mem = np.array([n.mem_free for n in nodes_i], dtype=np.int64)
        self._workload: tuple[list[RequestShare], list[DemandKind]] | None = None  # the last compiled

    # --- planning --------------------------------------------------------------------------------

    def objective(self, workload: list[DemandKind]) -> tuple[Objective, np.ndarray | None, NodeTerms]:
        key = tuple(workload)
        if self._objective is None or self._objective[0] != key:
            obj = Objective(workload, self.problem.nodes,
                            () if self.fgd_as_published else node_caps(self.problem.nodes, self.problem.gpus),
                            scarce_weights=not self.fgd_as_published)
            cls = None
            rooms = None
            if obj.active:
                self.index.use_objective(obj)
                cls = self.index.classes(self.states, self.bid)
                rooms = NodeRooms(obj, self.cpu, self.mem)
            self._objective = (key, obj, cls, NodeTerms(obj, len(self.problem.nodes)), rooms)
        return self._objective[1], self._objective[2], self._objective[3]

    def plan(self, pending: Sequence[PendingPod], workload: Sequence[RequestShare] = (),
             options: PlanOptions | None = None, validate: bool = True) -> Plan:
        with collector_paused():
            return self._plan(pending, workload, options, validate)

    def _plan(self, pending: Sequence[PendingPod], workload: Sequence[RequestShare], options: PlanOptions | None,
              validate: bool) -> Plan:
        t0 = time.perf_counter()
        opts = options or PlanOptions()
        if validate:
            self._validate(pending, workload)
        problem = Problem(self.problem.nodes, self.problem.gpus, [])
        problem.requests = compile_requests(problem, pending, self.catalog, self._static, self.cpu, self.mem)
        problem.workload = self._kinds(workload, pending)
        obj, cls, terms = self.objective(problem.workload)
        assert self._objective is not None
        problem.cache = PlanCache(problem, self.states, self.index, self.bid, obj, cls, self._occupied,
                                  self.cpu, self.mem, terms, self._objective[4])
        self._pending = {p.name: p for p in pending}
        bound = placed_upper_bound(problem, (self._totals[0], self._totals[1], self._totals[2], self._totals[3]))
        policy = POLICIES[opts.policy](opts)
        # no policy's plan puts two pods kept apart on one node (`keep_apart` checks every one's)
        result, reasons = keep_apart(problem, policy.place(problem))
        return build_plan(problem, policy, result, bound, time.perf_counter() - t0, reasons)

    def _kinds(self, workload: Sequence[RequestShare], pending: Sequence[PendingPod]) -> list[DemandKind]:
        """The compiled distribution; a workload equal to the last one is not compiled again
        (callers pass the same shares plan after plan, often in a new list)."""
        last = self._workload
        if workload and last is not None and (last[0] is workload or last[0] == list(workload)):
            return last[1]
        kinds = compile_workload(workload, pending, self.catalog)
        self._workload = (list(workload), kinds)
        return kinds

    def _validate(self, pending: Sequence[PendingPod], workload: Sequence[RequestShare]) -> None:
        snap = Snapshot.model_construct(nodes=[], pending=list(pending), workload=list(workload))
        problems: list[str] = []
        known = self.catalog.mig_profile_names()
        seen: set[str] = set()
        for i, pod in enumerate(pending):
            if pod.name in seen:
                problems.append(f"pending[{i}] ({pod.name}).name = {pod.name!r}: duplicate pod name")
            seen.add(pod.name)
            problems.extend(pod_problems(f"pending[{i}] ({pod.name}).", pod, self.catalog, known))
        problems.extend(apart_problems(list(pending)))
        if self._held is None:
            self._held = held_by(self._nodes)
        problems.extend(held_problems(self._held, pending))
        if problems:
            raise SnapshotError(problems)
        if snap.workload:
            validate_snapshot(snap, self.catalog)

    # --- what changed ------------------------------------------------------------------------------

    def commit(self, plan: Plan) -> None:
        """The plan was carried out: its layouts are the GPUs' layouts, every slice it planned a
        pod onto is used, and the placed pods' CPU and memory are taken from their nodes."""
        for lay in plan.layouts:
            node = self.problem.nodes[self.by_name[lay.node]]
            by_index = {self.problem.gpus[g].index: g for g in node.gpus}
            for gl in lay.gpus:
                gid = by_index[gl.index]
                info = self.problem.gpus[gid]
                # a new `GpuInfo`: the states of the GPU as it was keep theirs (they read it lazily)
                if info.rules is not None:
                    idx = info.rules.index
                    insts = sorted(gl.mig, key=lambda m: m.start)
                    info = replace(info, used_mig=[(idx[m.profile], m.start, m.pod) for m in insts if m.used or m.pod],
                                   free_mig=[(idx[m.profile], m.start) for m in insts if not (m.used or m.pod)])
                else:
                    info = replace(info, used_mps=[(s.size, s.pod) for s in gl.mps if s.used or s.pod],
                                   free_mps=sorted((s.size for s in gl.mps if not (s.used or s.pod)), reverse=True),
                                   whole_pod=gl.whole_pod)
                self.problem.gpus[gid] = info
                self._refresh_gpu(gid)
        for pl in plan.placements:
            pod = self._pending.get(pl.pod)
            if pod is not None:
                self._take(self.by_name[pl.node], pod.cpu_milli, pod.memory_mib)

    def _refresh_gpu(self, gid: int) -> None:
        old = self.states[gid]
        st = self.states[gid] = new_state(self.problem.gpus[gid])
        self._occupied += st.has_pod() - old.has_pod()
        self.bid[gid] = self.index.bucket(st, as_is=True)
        cap = capacity_left(self.problem.gpus[gid])
        for k in range(4):
            self._totals[k] += cap[k] - self._caps[gid][k]
        self._caps[gid] = cap
        if self._objective is not None:
            if self._objective[2] is not None:
                self._objective[2][gid] = self._objective[1].class_id(capacity_class(st))
            self._objective[3].ok[self.problem.gpus[gid].node] = False
        self.index.node_changed(self.problem.gpus[gid].node)

    def _take(self, node: int, cpu: int, mem: int) -> None:
        n = self.problem.nodes[node]
        n.cpu_free -= cpu
        n.mem_free -= mem
        self.cpu[node] -= cpu
        self.mem[node] -= mem
        if self._objective is not None:
            self._objective[3].ok[node] = False
            if self._objective[4] is not None:
                self._objective[4].update(node, int(self.cpu[node]), int(self.mem[node]))
        self.index.node_changed(node)

    def place_cpu_pod(self, cpu: int, mem: int, workload: Sequence[RequestShare] = ()) -> str | None:
        """A pod without GPUs, placed by the objective: on a node without GPUs if one fits (the
        one it leaves the least CPU on: CPU and memory of GPU nodes are kept for GPU pods), else
        on the GPU node whose expected unusable GPU capacity its CPU and memory raise least
        (scored as GPU options are), first in node order. Returns the node, or None."""
        nodes = self.problem.nodes
        cpu_free, mem_free = self.cpu, self.mem
        fit = np.flatnonzero((cpu_free >= cpu) & (mem_free >= mem))
        if not len(fit):
            return None
        no_gpu = fit[(self.index.node_gpus[fit] == self.index.pad).all(axis=1)]
        if len(no_gpu):
            best = int(no_gpu[np.lexsort((no_gpu, cpu_free[no_gpu] - cpu))[0]])
        else:
            obj, cls, _ = self.objective(self._kinds(workload, []))
            if cls is not None:
                rows = cls[self.index.node_gpus[fit]]
                q = Objective.score(obj.unusable(rows, cpu_free[fit] - cpu, mem_free[fit] - mem, fit)
                                    - obj.unusable(rows, cpu_free[fit], mem_free[fit], fit))
            else:
                q = np.zeros(len(fit), dtype=np.int64)
            best = int(fit[np.lexsort((fit, q))[0]])
        self._take(best, cpu, mem)
        return nodes[best].name
