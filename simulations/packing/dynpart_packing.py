"""The `dynpart` policy in the packing protocol: every arrival planned by the planner on the
whole cluster.

The shell keeps one `planner.PlanningSession` on every node of the cluster (GPU nodes as MPS
nodes whose GPUs have a capacity of 1000, the GPU milli; nodes without GPUs too, so that the
planner can put CPU-only pods there) and the controller's `PlanningLoop` (planner/loop.py, with
the trace's request distribution as its settings' `workload`) and, for each batch of arrivals:
1. gives the batch's GPU pods to the loop as one round (`prepare`, then `decide` on the session:
   the code `plan()` runs): the planner alone chooses the node and GPU of every pod, and what of
   the batch fits;
2. checks that the plan keeps every used slice (each pod already placed keeps its share of its
   GPUs) and gives each pod exactly its request, applies it to the protocol's state and commits
   it to the session (the planned slices become used);
3. places the batch's CPU-only pods with `PlanningSession.place_cpu_pod` (the planner plans
   GPU resources; for a pod without GPUs the session applies the same objective).
The shell ranks nothing: where a pod goes is the planner's decision.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from dynpart.catalog import Catalog, default_catalog
from dynpart.planner.loop import PlanningLoop
from dynpart.planner.session import PlanningSession
from dynpart.resources import mps_resource_name
from dynpart.settings import default_planner_settings
from dynpart.simulations import bridge
from dynpart.simulations.inputs.traces import MILLI, TracePod
from dynpart.simulations.packing.occupancy import PackingState
from dynpart.snapshot import Gpu, Plan, RequestShare

MAX_BATCH = 32
# the catalog model of nodes without GPUs (a snapshot node names a model; these have no GPU)
NO_GPU_MODEL = "no-gpu"


def trace_workload(pods: Sequence[TracePod]) -> list[RequestShare]:
    """The trace's GPU requests as the planner's request distribution: one share per pod, with
    the GPU models it accepts."""
    kinds = Counter(bridge.packing_request(p) + (p.cpu_milli, p.memory_mib, tuple(sorted(set(p.gpu_spec))))
                    for p in pods if p.num_gpu)
    return [RequestShare(resource=res, count=count, cpu_milli=cpu, memory_mib=mem, gpu_models=list(models),
                         weight=float(n))
            for (res, count, cpu, mem, models), n in sorted(kinds.items())]


# a share no GPU can host (more than a whole GPU's milli): what CPU-only pods are to FGD's F
NO_GPU_SHARE = mps_resource_name(MILLI + 1)


def fgd_typical_pods(pods: Sequence[TracePod], popularity_pct: float = 95.0) -> list[RequestShare]:
    """FGD's "typical pods" as its authors' simulator builds them for the published runs
    (hkust-adsl/kubernetes-scheduler-simulator, `GetTypicalPods` with isInvolvedCpuPods=true,
    podPopularityThreshold=95, gpuResWeight=0): pods grouped by (CPU, GPU milli, GPU count, GPU
    models), CPU-only pods included, the most frequent groups kept until they cover
    `popularity_pct` % of the pods, renormalised; memory is not part of a group. A CPU-only group
    counts all of a node's free GPU capacity as unusable (it can use none of it), which a share
    no GPU can host does exactly; a group naming GPU models counts it as unusable on nodes of
    other models (FGD's "no access"), which the share's `gpu_models` do."""
    groups: Counter[tuple[int, int, int, tuple[str, ...]]] = Counter()
    member: dict[tuple[int, int, int, tuple[str, ...]], TracePod] = {}
    for p in pods:
        key = (p.cpu_milli, p.gpu_milli if p.num_gpu else 0, p.num_gpu, p.gpu_spec)
        groups[key] += 1
        member.setdefault(key, p)
    total = sum(groups.values())
    kinds: Counter[tuple[str, int, int, tuple[str, ...]]] = Counter()
    covered = 0
    # most frequent first; equal counts in a fixed order (the authors' sort leaves them unordered)
    for key, n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])):
        if covered >= popularity_pct * total / 100:
            break
        covered += n
        p = member[key]
        request = (NO_GPU_SHARE, 1) if not p.num_gpu else bridge.packing_request(p)
        kinds[request + (p.cpu_milli, tuple(sorted(set(p.gpu_spec))))] += n
    return [RequestShare(resource=res, count=count, cpu_milli=cpu, memory_mib=0, gpu_models=list(models),
                         weight=float(n))
            for (res, count, cpu, models), n in sorted(kinds.items())]


# the planner's exact-search budget per plan in the packing benchmark, deterministic seconds
# (`dynpart bench packing --time-limit`)
TIME_LIMIT_S = 0.05


class DynpartPacking:
    def __init__(self, workload: list[RequestShare], catalog: Catalog | None = None, batch: int = 1,
                 time_limit_s: float = TIME_LIMIT_S, name: str = "dynpart", models: Iterable[str] = ()):
        self.name = name
        self.workload = workload
        # every GPU model the pods may ask for (all pods' gpu_spec, not only the first batch's): the
        # catalog knows them all, and a pod asking only for models the cluster lacks is not placed
        self.models = set(models) | {m for s in workload for m in s.gpu_models}
        self.base_catalog = catalog or default_catalog()
        self.batch = batch
        # the controller's loop, planning for the trace's request distribution; the protocol's GPUs
        # are shared without partitions: nothing is reconfigured, so the planner's "fewest
        # changes" tier does not apply
        settings = default_planner_settings().model_copy(update={"plan_time_limit_s": time_limit_s,
                                                                 "workload": workload})
        self.loop = PlanningLoop(settings, "dynpart", minimise_changes=False)
        self.arrived = 0
        self.session: PlanningSession | None = None
        self.plan_calls = 0
        self.stats: dict[str, float] = {"plan_s": 0.0, "disrupted": 0}

    def _start(self, state: PackingState, pods: list[TracePod]) -> PlanningSession:
        models = set(state.models) | self.models | {m for p in pods for m in p.gpu_spec} | {NO_GPU_MODEL}
        catalog = bridge.catalog_for(models, self.base_catalog)
        nodes = []
        for n, name in enumerate(state.names):
            model = state.models[state.model_id[n]] if state.ngpu[n] else NO_GPU_MODEL
            gpus = [Gpu.model_construct(index=g, mig=[], mps=[], whole_pod=None, capacity=state.capacity)
                    for g in range(int(state.ngpu[n]))]
            nodes.append(bridge.node(name, "mps", model, state.cpu[n], state.mem[n], gpus))
        # (FGD as its authors ran it counts no CPU stranding beyond its typical pods' and weighs its
        # typical pods by their frequency alone)
        return PlanningSession(nodes, catalog, fgd_as_published=self.name == "fgd")

    def place_batch(self, state: PackingState, pods: list[TracePod]) -> list[bool]:
        if self.session is None:
            self.session = self._start(state, pods)
        placed: dict[str, bool] = {}
        gpu_pods = [p for p in pods if p.num_gpu]
        if gpu_pods:
            placed.update(self._plan(state, gpu_pods))
        for p in pods:
            if not p.num_gpu:
                node = self.session.place_cpu_pod(p.cpu_milli, p.memory_mib, self.workload)
                if node is not None:
                    state.place(p, state.index[node], ())
                placed[p.name] = node is not None
        return [placed.get(p.name, False) for p in pods]

    def _plan(self, state: PackingState, pods: list[TracePod]) -> dict[str, bool]:
        assert self.session is not None
        # the protocol matches a pod's GPU models to the node list's by name, exactly; the planner
        # resolves names through the catalog (H100-80GB would match a node model H100): it is
        # given the node models the protocol accepts, and a pod none of whose models is in the
        # cluster fails without a plan
        models = set(state.models)
        out: dict[str, bool] = {}
        asked: list[TracePod] = []
        for pod in pods:
            if pod.gpu_spec:
                exact = tuple(m for m in pod.gpu_spec if m in models)
                if not exact:
                    out[pod.name] = False
                    continue
                pod = dataclasses.replace(pod, gpu_spec=exact)
            asked.append(pod)
        pods = asked
        if not pods:
            return out
        pending = [bridge.pending_pod(p, *bridge.packing_request(p)) for p in pods]
        # one round per batch, on the protocol's clock (arrivals counted): the batch is all it plans
        now = float(self.arrived)
        self.arrived += len(pods)
        for p in pending:
            self.loop.pod_waiting(p.name, now)
        self.loop.begin_round(now)
        snapshot = self.loop.prepare(bridge.snapshot([], pending), now)
        t0 = time.perf_counter()
        result = self.loop.decide(snapshot, self.session.catalog, self.session)
        self.stats["plan_s"] += time.perf_counter() - t0
        self.plan_calls += 1
        bad = disrupted(state, result)
        if bad:
            self.stats["disrupted"] += len(bad)
            raise AssertionError(f"plan moved used slices: {bad[:3]}")
        by_name = {p.name: p for p in pods}
        for pl in result.placements:
            pod = by_name[pl.pod]
            want = "whole" if not pod.is_share else str(pod.gpu_milli)
            if len(pl.slices) != pod.num_gpu or any(str(s) != want for s in pl.slices):
                raise AssertionError(f"plan gave {pod.name} slices {pl.slices}, expected {pod.num_gpu} x {want}")
            state.place(pod, state.index[pl.node], tuple(sorted(s.gpu for s in pl.slices)))
            out[pod.name] = True
        self.session.commit(result)
        return out


def disrupted(state: PackingState, plan: Plan) -> list[str]:
    """Pods already placed whose share of a GPU the plan's layouts do not keep (must be none)."""
    out: list[str] = []
    for lay in plan.layouts:
        n = state.index[lay.node]
        for gl in lay.gpus:
            holders = state.holders[n][gl.index]
            kept = {s.pod: s.size for s in gl.mps if s.used or s.pod}
            for pod, share in holders.items():
                if share == MILLI and gl.whole_pod == pod:
                    continue
                if kept.get(pod) != share:
                    out.append(f"{lay.node}/gpu{gl.index}: {pod} ({share} milli)")
    return out
