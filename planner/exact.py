"""Exact planning with CP-SAT on a set of nodes (the whole cluster when small, or a window of
a few nodes in large-neighbourhood search).

Formulation: each MIG GPU picks one configuration among the geometries that keep its used
instances in place (deduplicated by what they offer to the pending pods, dominated ones
dropped); each MPS GPU keeps or drops each free slice and creates integer numbers of new slices
within its capacity; each pod picks at most one candidate node and takes its slices from that
node's GPUs. Objective, lexicographic through weights: placed pods (priority-weighted), then
free slices destroyed + GPUs changed, then GPUs hosting pods.

Determinism: one search worker, a fixed seed and a deterministic-time budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, singledispatch
from typing import Protocol, TypeAlias

import numpy as np
from ortools.sat.python import cp_model

from dynpart.catalog import GpuModel
from dynpart.mig import Placement, feasible_geometries
from dynpart.planner.mig_state import MigState
from dynpart.planner.mps_state import MpsState
from dynpart.planner.problem import KIND_GPU, Problem, Request
from dynpart.planner.state import GpuState, new_state
from dynpart.planner.types import WHOLE_GPU, Assignment, MigSliceRef, MpsSliceRef, Placements, SliceRef, WholeGpuRef

# IntVar is a LinearExpr; sum() of none is 0
Expr: TypeAlias = "cp_model.LinearExpr | int"


@dataclass
class ExactResult:
    states: dict[int, GpuState]  # new states of the window's GPUs
    placed: Placements
    optimal: bool  # both objective tiers proved
    placed_optimal: bool  # the most pods placed is proved
    objective: tuple[int, int, int]  # (placed weight, changes, occupied)


# --- one GPU's part of the model, per mode ------------------------------------------------------


class _GpuModel(Protocol):
    """A GPU's decision variables: how many slices of each demanded kind it offers, what its
    reconfiguration costs, and the GPU state a solution stands for."""

    @property
    def offered(self) -> Mapping[SliceRef, Expr]: ...
    @property
    def cost(self) -> Expr: ...
    def decode(self, solver: cp_model.CpSolver) -> GpuState: ...


MigConfig = tuple[dict[str, int], int, frozenset[Placement]]


def _mig_configs(st: MigState, demanded: set[str]) -> list[MigConfig]:
    """(offered counts over demanded profiles, cost, geometry) per useful configuration."""
    info = st.info
    names = st.rules.names
    fixed = tuple(sorted(((names[p], s) for p, s, _ in info.used_mig), key=lambda x: (x[1], x[0])))
    free = frozenset((names[p], s) for p, s in info.free_mig)
    return _configs_of(info.model, fixed, free, tuple(sorted(demanded)))


@lru_cache(maxsize=4096)
def _configs_of(model: GpuModel, fixed: tuple[tuple[str, int], ...], free: frozenset[tuple[str, int]],
                demanded: tuple[str, ...]) -> list[MigConfig]:
    """`_mig_configs` of a GPU by what it reads (GPUs in the same state, and one GPU in the
    windows of the large-neighbourhood search, share it; the configurations are read only)."""
    allowed = sorted(set(demanded) | {n for n, _ in free})
    best: dict[tuple[int, ...], tuple[int, frozenset[Placement]]] = {}
    fixed_set = set(fixed)
    for geom in feasible_geometries(model, allowed, fixed):
        rest = [pl for pl in geom if pl not in fixed_set]
        destroyed = len(free - set(geom))
        changed = 1 if destroyed or any(pl not in free for pl in rest) else 0
        cnt = Counter(n for n, _ in rest if n in demanded)
        vec = tuple(cnt.get(d, 0) for d in demanded)
        cost = destroyed + changed
        if vec not in best or cost < best[vec][0]:
            best[vec] = (cost, geom)
    items = sorted(best.items())
    # dominated: another offer (the vectors are distinct) at most as dear with at least as many
    # of every profile
    vecs = np.array([vec for vec, _ in items], dtype=np.int64).reshape(len(items), len(demanded))
    costs = np.array([cost for _, (cost, _) in items], dtype=np.int64)
    covers = (vecs[:, None, :] >= vecs[None, :, :]).all(axis=2) & (costs[:, None] <= costs[None, :])
    np.fill_diagonal(covers, False)
    dominated = [bool(covers[:, j].any()) for j in range(len(items))]
    return [(dict(zip(demanded, vec)), cost, geom)
            for (vec, (cost, geom)), dom in zip(items, dominated) if not dom]


class _MigModel:
    """One configuration (geometry) per GPU, among those that keep its used instances."""

    def __init__(self, st: MigState, m: cp_model.CpModel, g: int, demanded: set[SliceRef]):
        self.info = st.info
        self.configs = _mig_configs(st, {d.profile for d in demanded if isinstance(d, MigSliceRef)})
        self.ys = [m.new_bool_var(f"y{g}_{c}") for c in range(len(self.configs))]
        m.add_exactly_one(self.ys)
        self.offered: dict[SliceRef, Expr] = {
            d: sum((cfg[0].get(d.profile, 0) if isinstance(d, MigSliceRef) else 0) * y
                   for cfg, y in zip(self.configs, self.ys))
            for d in demanded
        }
        self.cost: Expr = sum(cfg[1] * y for cfg, y in zip(self.configs, self.ys))

    def hint(self, m: cp_model.CpModel, st: GpuState) -> None:
        """Hint the configuration that offers at least what the layout `st` (the greedy plan's)
        offers to the demanded profiles at the least cost: the hint is then a whole solution,
        which CP-SAT takes at once (a hint of the pods alone it has to complete by search)."""
        if not isinstance(st, MigState):
            return
        names, fixed = st.rules.names, {(st.rules.names[p], s) for p, s, _ in self.info.used_mig}
        have = Counter(names[i.p] for i in st.insts if (names[i.p], i.start) not in fixed)
        fits = [c for c, cfg in enumerate(self.configs) if all(v >= have.get(d, 0) for d, v in cfg[0].items())]
        if fits:
            pick = min(fits, key=lambda c: (self.configs[c][1], c))
            for c, y in enumerate(self.ys):
                m.add_hint(y, 1 if c == pick else 0)

    def decode(self, solver: cp_model.CpSolver) -> GpuState:
        st = MigState(self.info)
        st.set_geometry(next(cfg for cfg, y in zip(self.configs, self.ys) if solver.value(y))[2])
        return st


class _MpsModel:
    """Keep or drop each free slice, create whole numbers of slices of each demanded size within
    the capacity, or give the whole GPU to one pod when nothing on it is used."""

    def __init__(self, st: MpsState, m: cp_model.CpModel, g: int, demanded: set[SliceRef]):
        self.info = st.info
        free = [k for k, s in enumerate(st.slices) if not s.hard]
        hard_total = sum(s.size for s in st.slices if s.hard)
        self.keep = {k: m.new_bool_var(f"k{g}_{k}") for k in free}
        sizes = sorted(d.size for d in demanded if isinstance(d, MpsSliceRef))
        self.new = {s: m.new_int_var(0, st.cap // s, f"n{g}_{s}") for s in sizes}
        whole = m.new_bool_var(f"w{g}") if any(isinstance(d, WholeGpuRef) for d in demanded) and hard_total == 0 \
            and not any(s.hard for s in st.slices) else None
        changed = m.new_bool_var(f"c{g}")
        m.add(hard_total + sum(st.slices[k].size * v for k, v in self.keep.items())
              + sum(s * v for s, v in self.new.items()) <= st.cap)
        clients_left = st.clients_left()  # the MPS server's clients per GPU (a GPU past it: nothing more)
        if clients_left is not None:
            m.add(sum(self.keep.values()) + sum(self.new.values()) <= clients_left)
        for v in self.keep.values():
            m.add_implication(v.negated(), changed)
        for s, v in self.new.items():
            m.add(v <= (st.cap // s) * changed)
        self.offered: dict[SliceRef, Expr] = {}
        if whole is not None:
            for v in self.keep.values():
                m.add_implication(whole, v.negated())
            for v in self.new.values():
                m.add(v == 0).only_enforce_if(whole)
            self.offered[WHOLE_GPU] = whole
        for s in sizes:
            self.offered[MpsSliceRef(s)] = self.new[s] + sum(v for k, v in self.keep.items() if st.slices[k].size == s)
        self.cost: Expr = sum(1 - v for v in self.keep.values()) + changed

    def decode(self, solver: cp_model.CpSolver) -> GpuState:
        st = MpsState(self.info)
        kept = {k for k, v in self.keep.items() if solver.value(v)}
        st.replace_free_slices([size for size, v in self.new.items() for _ in range(solver.value(v))], keep=kept)
        return st


@singledispatch
def _gpu_model(st: GpuState, m: cp_model.CpModel, g: int, demanded: set[SliceRef]) -> _GpuModel | None:
    raise TypeError(f"no CP-SAT model for a {type(st).__name__}")


@_gpu_model.register
def _mig_model(st: MigState, m: cp_model.CpModel, g: int, demanded: set[SliceRef]) -> _GpuModel | None:
    return _MigModel(st, m, g, demanded)


@_gpu_model.register
def _mps_model(st: MpsState, m: cp_model.CpModel, g: int, demanded: set[SliceRef]) -> _GpuModel | None:
    return None if st.whole_pod is not None else _MpsModel(st, m, g, demanded)  # a whole GPU in use: nothing to decide


# --- the window's model -------------------------------------------------------------------------


def solve_exact(problem: Problem, base: list[GpuState], nodes: list[int], reqs: list[Request],
                hint: Placements | None, time_limit_s: float,
                cpu_left: Sequence[int] | Mapping[int, int],
                mem_left: Sequence[int] | Mapping[int, int],
                hint_states: Sequence[GpuState] | None = None) -> ExactResult | None:
    """Plan `reqs` on `nodes` from the states in `base` (window GPUs must hold no planned pods).
    cpu_left/mem_left: what each of `nodes` has for these pods, indexed by node index.
    `hint_states`: the GPU states (by GPU id) of the plan that `hint` places the pods by."""
    m = cp_model.CpModel()
    node_set = set(nodes)
    gids = [g for n in nodes for g in problem.nodes[n].gpus]
    # requests' candidate nodes inside the window
    cand = {r.idx: [n for n in r.candidates if n in node_set] for r in reqs}
    reqs = [r for r in reqs if cand[r.idx]]
    demanded: dict[int, set[SliceRef]] = {g: set() for g in gids}
    for r in reqs:
        for n in cand[r.idx]:
            for g in problem.nodes[n].gpus:
                demanded[g].add(r.slice_ref)

    offered: dict[tuple[int, SliceRef], Expr] = {}
    cost_terms: list[Expr] = []
    occ: dict[int, cp_model.IntVar] = {}
    models: dict[int, _GpuModel] = {}
    for g in gids:
        st = base[g]
        if not demanded[g]:
            continue
        gpu_model = _gpu_model(st, m, g, demanded[g])
        if gpu_model is None:
            continue
        models[g] = gpu_model
        for ref, expr in gpu_model.offered.items():
            offered[(g, ref)] = expr
        cost_terms.append(gpu_model.cost)
        occ[g] = m.new_bool_var(f"o{g}")
        if st.has_pod():
            m.add(occ[g] == 1)

    x: dict[tuple[int, int], cp_model.IntVar] = {}
    a: dict[tuple[int, int], cp_model.IntVar] = {}
    use: dict[tuple[int, SliceRef], list[cp_model.IntVar]] = {}
    for r in reqs:
        xs = []
        for n in cand[r.idx]:
            v = m.new_bool_var(f"x{r.idx}_{n}")
            x[(r.idx, n)] = v
            xs.append(v)
            parts = []
            for g in problem.nodes[n].gpus:
                key = (g, r.slice_ref)
                if key not in offered:
                    continue
                hi = 1 if r.kind == KIND_GPU else r.count
                av = m.new_int_var(0, hi, f"a{r.idx}_{g}")
                a[(r.idx, g)] = av
                parts.append(av)
                use.setdefault(key, []).append(av)
                m.add(av <= hi * occ[g])
            if parts:
                m.add(sum(parts) == r.count * v)
            else:
                m.add(v == 0)
        m.add_at_most_one(xs)
    _keep_apart(m, reqs, cand, x)
    for key, terms in use.items():
        m.add(sum(terms) <= offered[key])
    for n in nodes:
        here = [(r, x[(r.idx, n)]) for r in reqs if (r.idx, n) in x]
        if here:
            m.add(sum(r.cpu * v for r, v in here) <= cpu_left[n])
            m.add(sum(r.mem * v for r, v in here) <= mem_left[n])

    placed_expr = sum(r.weight * x[(r.idx, n)] for r in reqs for n in cand[r.idx])
    cost_expr = sum(cost_terms) if cost_terms else 0
    occ_expr = sum(occ.values()) if occ else 0

    if hint:
        on_gpu: Counter[tuple[int, int]] = Counter()
        for r in reqs:
            h = hint.get(r.idx)
            for n in cand[r.idx]:
                m.add_hint(x[(r.idx, n)], 1 if h is not None and h.node == n else 0)
            if h is not None and h.node in node_set:
                on_gpu.update((r.idx, g) for g in h.gpus)
        if hint_states is not None:
            for g, gpu_model in models.items():
                if isinstance(gpu_model, _MigModel):
                    gpu_model.hint(m, hint_states[g])
            for (i, g), av in a.items():
                m.add_hint(av, on_gpu.get((i, g), 0))
            hosting = {g for _, g in on_gpu}
            for g, ov in occ.items():
                m.add_hint(ov, 1 if base[g].has_pod() or g in hosting else 0)

    # Lexicographic: first the most (priority-weighted) pods, then, with that fixed, the fewest
    # changes and then the fewest occupied GPUs. Two solves prove optimality far sooner than
    # one big weighted objective.
    m.maximize(placed_expr)
    solver = _solver(time_limit_s * 0.6)
    status1 = solver.solve(m)
    if status1 not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    best_placed = round(solver.objective_value)
    m.clear_hints()  # type: ignore[no-untyped-call]  # ortools does not annotate clear_hints
    for i in range(len(m.proto.variables)):
        var = m.get_int_var_from_proto_index(i)
        m.add_hint(var, solver.value(var))
    m.add(placed_expr >= best_placed)
    m.minimize((len(occ) + 1) * cost_expr + occ_expr)
    solver2 = _solver(time_limit_s * 0.4)
    status2 = solver2.solve(m)
    if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solver = solver2
    optimal = status1 == cp_model.OPTIMAL and status2 == cp_model.OPTIMAL
    placed_optimal = status1 == cp_model.OPTIMAL

    # --- decode into GPU states -------------------------------------------------------------
    new_states: dict[int, GpuState] = {g: new_state(problem.gpus[g]) for g in gids}
    for g, gpu_model in models.items():
        new_states[g] = gpu_model.decode(solver)
    placed: Placements = {}
    for r in sorted(reqs, key=lambda r: r.idx):
        node = next((n for n in cand[r.idx] if solver.value(x[(r.idx, n)])), None)
        if node is None:
            continue
        used_gids = []
        for g in problem.nodes[node].gpus:
            taken = a.get((r.idx, g))
            k = solver.value(taken) if taken is not None else 0
            if k:
                # one entry per slice, as the greedy's (`hint` counts a pod's slices on a GPU so)
                used_gids.extend([g] * k)
                _assign(new_states[g], r, k)
        placed[r.idx] = Assignment(node, tuple(used_gids))
    obj = objective(list(new_states.values()), {i: problem.requests[i].weight for i in placed})
    return ExactResult(new_states, placed, optimal, placed_optimal, obj)


def _keep_apart(m: cp_model.CpModel, reqs: list[Request], cand: Mapping[int, list[int]],
                x: Mapping[tuple[int, int], cp_model.IntVar]) -> None:
    """No two requests kept apart (`Request.apart`) on one node: pods whose partners and selves
    are one set (the replicas of a Deployment that must not share a node) at most one per node
    of theirs, any other pair x[a, n] + x[b, n] <= 1 (a pair with a partner outside `reqs` needs
    none: every pod placed on the window's nodes is in `reqs`)."""
    inside = {r.idx for r in reqs}
    groups: dict[frozenset[int], list[int]] = {}
    for r in reqs:
        if r.apart:
            groups.setdefault(frozenset((*r.apart, r.idx)) & inside, []).append(r.idx)
    covered: set[tuple[int, int]] = set()
    for members, idxs in groups.items():
        if len(idxs) > 1 and len(idxs) == len(members):  # a clique: every member's set is this one
            by_node: dict[int, list[cp_model.IntVar]] = {}
            for i in idxs:
                for n in cand[i]:
                    by_node.setdefault(n, []).append(x[(i, n)])
            for n in sorted(by_node):
                if len(by_node[n]) > 1:
                    m.add_at_most_one(by_node[n])
            covered.update((a, b) for a in idxs for b in idxs if a < b)
    for r in reqs:
        for other in r.apart:
            if other > r.idx and other in inside and (r.idx, other) not in covered:
                for n in sorted(set(cand[r.idx]).intersection(cand[other])):
                    m.add(x[(r.idx, n)] + x[(other, n)] <= 1)


def _wall_limit_s(budget_s: float) -> float:
    """One solve's wall-clock net, for a deterministic budget of `budget_s`."""
    return 10 * budget_s + 5


def wall_limit_s(time_limit_s: float) -> float:
    """The wall-clock nets of `solve_exact`'s two solves together, for its `time_limit_s`."""
    return _wall_limit_s(time_limit_s * 0.6) + _wall_limit_s(time_limit_s * 0.4)


def _solver(budget_s: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = 0
    # the pattern model's LP relaxation is strong: use it fully (proves optimality much sooner)
    p.linearization_level = 2
    # deterministic budget (same input, same plan); the wall-clock limit is only a safety net
    # against a runaway, loose enough that a loaded machine does not hit it first
    p.max_deterministic_time = max(0.05, budget_s)
    p.max_time_in_seconds = _wall_limit_s(budget_s)
    return solver


def _assign(st: GpuState, r: Request, k: int) -> None:
    """Give k free slices of r's resource on this GPU to pod r (any will do: they are equal)."""
    slots = st.free_slots(r.slice_ref)[:k]
    assert len(slots) == k, f"solution gave {r.name} a slice that is not there"
    for slot in slots:
        st.bind(slot, r.slice_ref, r.name)


def objective(states: list[GpuState], placed_weights: dict[int, int]) -> tuple[int, int, int]:
    """(placed weight, changes, occupied GPUs): compare with (a, -b, -c)."""
    changes = sum(s.destroyed + (1 if s.changed else 0) for s in states)
    occupied = sum(1 for s in states if s.has_pod())
    return (sum(placed_weights.values()), changes, occupied)
