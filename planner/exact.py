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

from ortools.sat.python import cp_model

from dynpart.mig import feasible_geometries
from dynpart.planner.problem import KIND_GPU, KIND_MIG, Problem, Request
from dynpart.planner.state import GpuState, MigState, MpsPiece, MpsState, new_state


@dataclass
class ExactResult:
    states: dict[int, GpuState]  # new states of the window's GPUs
    placed: dict[int, tuple[int, list[int]]]  # request idx -> (node, gids)
    optimal: bool  # both objective tiers proved
    placed_optimal: bool  # the most pods placed is proved
    objective: tuple[int, int, int]  # (placed weight, changes, occupied)


def _res_key(req: Request) -> object:
    return req.profile if req.kind == KIND_MIG else ("whole" if req.kind == KIND_GPU else req.size)


def _mig_configs(st: MigState, demanded: set[str]) -> list[tuple[dict[str, int], int, frozenset]]:
    """(offered counts over demanded profiles, cost, geometry) per useful configuration."""
    info = st.info
    names = st.rules.names
    fixed = [(names[p], s) for p, s, _ in info.used_mig]
    free = {(names[p], s) for p, s in info.free_mig}
    allowed = sorted(demanded | {n for n, _ in free})
    best: dict[tuple, tuple[int, frozenset]] = {}
    fixed_set = set(fixed)
    for geom in feasible_geometries(info.model, allowed, fixed):
        rest = [pl for pl in geom if pl not in fixed_set]
        destroyed = len(free - set(geom))
        changed = 1 if destroyed or any(pl not in free for pl in rest) else 0
        cnt = Counter(n for n, _ in rest if n in demanded)
        vec = tuple(cnt.get(d, 0) for d in sorted(demanded))
        cost = destroyed + changed
        if vec not in best or cost < best[vec][0]:
            best[vec] = (cost, geom)
    items = sorted(best.items())
    kept = []
    for vec, (cost, geom) in items:
        dominated = any(
            other != vec and oc <= cost and all(a >= b for a, b in zip(other, vec))
            for other, (oc, _) in items
        )
        if not dominated:
            kept.append((dict(zip(sorted(demanded), vec)), cost, geom))
    return kept


def solve_exact(problem: Problem, base: list[GpuState], nodes: list[int], reqs: list[Request],
                hint: dict[int, tuple[int, list[int]]] | None, time_limit_s: float,
                cpu_left: Sequence[int] | Mapping[int, int],
                mem_left: Sequence[int] | Mapping[int, int]) -> ExactResult | None:
    """Plan `reqs` on `nodes` from the states in `base` (window GPUs must hold no planned pods).
    cpu_left/mem_left: what each of `nodes` has for these pods, indexed by node index."""
    m = cp_model.CpModel()
    node_set = set(nodes)
    gids = [g for n in nodes for g in problem.nodes[n].gpus]
    # requests' candidate nodes inside the window
    cand = {r.idx: [n for n in r.candidates if n in node_set] for r in reqs}
    reqs = [r for r in reqs if cand[r.idx]]
    demanded: dict[int, set] = {g: set() for g in gids}
    for r in reqs:
        for n in cand[r.idx]:
            for g in problem.nodes[n].gpus:
                demanded[g].add(_res_key(r))

    offered: dict[tuple[int, object], cp_model.LinearExprT] = {}
    cost_terms: list = []
    occ: dict[int, cp_model.IntVar] = {}
    decode: dict[int, object] = {}
    for g in gids:
        st = base[g]
        dem = demanded[g]
        if not dem:
            continue
        if isinstance(st, MigState):
            configs = _mig_configs(st, {d for d in dem if isinstance(d, str)})
            ys = [m.NewBoolVar(f"y{g}_{c}") for c in range(len(configs))]
            m.AddExactlyOne(ys)
            for d in dem:
                offered[(g, d)] = sum(cfg[0].get(d, 0) * y for cfg, y in zip(configs, ys))
            cost_terms.append(sum(cfg[1] * y for cfg, y in zip(configs, ys)))
            decode[g] = (configs, ys)
        else:
            assert isinstance(st, MpsState)
            if st.whole_pod is not None:
                continue
            free = [k for k, s in enumerate(st.slices) if not s.hard]
            hard_total = sum(s.size for s in st.slices if s.hard)
            keep = {k: m.NewBoolVar(f"k{g}_{k}") for k in free}
            sizes = sorted(d for d in dem if isinstance(d, int))
            new = {s: m.NewIntVar(0, st.cap // s, f"n{g}_{s}") for s in sizes}
            whole = m.NewBoolVar(f"w{g}") if "whole" in dem and hard_total == 0 and not any(
                s.hard for s in st.slices) else None
            changed = m.NewBoolVar(f"c{g}")
            m.Add(hard_total + sum(st.slices[k].size * v for k, v in keep.items())
                  + sum(s * v for s, v in new.items()) <= st.cap)
            for v in keep.values():
                m.AddImplication(v.Not(), changed)
            for s, v in new.items():
                m.Add(v <= (st.cap // s) * changed)
            if whole is not None:
                for v in keep.values():
                    m.AddImplication(whole, v.Not())
                for v in new.values():
                    m.Add(v == 0).OnlyEnforceIf(whole)
                offered[(g, "whole")] = whole
            for s in sizes:
                offered[(g, s)] = new[s] + sum(v for k, v in keep.items() if st.slices[k].size == s)
            cost_terms.append(sum(1 - v for v in keep.values()) + changed)
            decode[g] = (keep, new, whole, changed)
        occ[g] = m.NewBoolVar(f"o{g}")
        if st.has_pod():
            m.Add(occ[g] == 1)

    x: dict[tuple[int, int], cp_model.IntVar] = {}
    a: dict[tuple[int, int], cp_model.IntVar] = {}
    use: dict[tuple[int, object], list] = {}
    for r in reqs:
        xs = []
        for n in cand[r.idx]:
            v = m.NewBoolVar(f"x{r.idx}_{n}")
            x[(r.idx, n)] = v
            xs.append(v)
            parts = []
            for g in problem.nodes[n].gpus:
                key = (g, _res_key(r))
                if key not in offered:
                    continue
                hi = 1 if r.kind == KIND_GPU else r.count
                av = m.NewIntVar(0, hi, f"a{r.idx}_{g}")
                a[(r.idx, g)] = av
                parts.append(av)
                use.setdefault(key, []).append(av)
                m.Add(av <= hi * occ[g])
            if parts:
                m.Add(sum(parts) == r.count * v)
            else:
                m.Add(v == 0)
        m.AddAtMostOne(xs)
    for key, terms in use.items():
        m.Add(sum(terms) <= offered[key])
    for n in nodes:
        here = [(r, x[(r.idx, n)]) for r in reqs if (r.idx, n) in x]
        if here:
            m.Add(sum(r.cpu * v for r, v in here) <= cpu_left[n])
            m.Add(sum(r.mem * v for r, v in here) <= mem_left[n])

    placed_expr = sum(r.weight * x[(r.idx, n)] for r in reqs for n in cand[r.idx])
    cost_expr = sum(cost_terms) if cost_terms else 0
    occ_expr = sum(occ.values()) if occ else 0

    if hint:
        for r in reqs:
            h = hint.get(r.idx)
            for n in cand[r.idx]:
                m.AddHint(x[(r.idx, n)], 1 if h is not None and h[0] == n else 0)

    # Lexicographic: first the most (priority-weighted) pods, then, with that fixed, the fewest
    # changes and then the fewest occupied GPUs. Two solves prove optimality far sooner than
    # one big weighted objective.
    m.Maximize(placed_expr)
    solver = _solver(time_limit_s * 0.6)
    status1 = solver.Solve(m)
    if status1 not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    best_placed = round(solver.ObjectiveValue())
    m.ClearHints()
    for i in range(len(m.Proto().variables)):
        v = m.GetIntVarFromProtoIndex(i)
        m.AddHint(v, solver.Value(v))
    m.Add(placed_expr >= best_placed)
    m.Minimize((len(occ) + 1) * cost_expr + occ_expr)
    solver2 = _solver(time_limit_s * 0.4)
    status2 = solver2.Solve(m)
    if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solver = solver2
    optimal = status1 == cp_model.OPTIMAL and status2 == cp_model.OPTIMAL
    placed_optimal = status1 == cp_model.OPTIMAL

    # --- decode into GPU states -------------------------------------------------------------
    new_states: dict[int, GpuState] = {g: new_state(problem.gpus[g]) for g in gids}
    for g, dec in decode.items():
        st = new_states[g]
        if isinstance(st, MigState):
            configs, ys = dec  # type: ignore[misc]
            chosen = next(c for c, y in zip(configs, ys) if solver.Value(y))
            st.set_geometry(chosen[2])
        else:
            assert isinstance(st, MpsState)
            keep, new, whole, _ = dec  # type: ignore[misc]
            slices = [s for k, s in enumerate(st.slices) if s.hard or solver.Value(keep[k])]
            st.destroyed = len(st.slices) - len(slices)
            for size, v in new.items():
                for _ in range(solver.Value(v)):
                    slices.append(MpsPiece(size, False, None, False))
                    st.created += 1
            st.slices = slices
            st.changed = bool(st.destroyed or st.created)
    placed: dict[int, tuple[int, list[int]]] = {}
    for r in sorted(reqs, key=lambda r: r.idx):
        node = next((n for n in cand[r.idx] if solver.Value(x[(r.idx, n)])), None)
        if node is None:
            continue
        used_gids = []
        for g in problem.nodes[node].gpus:
            av = a.get((r.idx, g))
            k = solver.Value(av) if av is not None else 0
            if k:
                used_gids.append(g)
                _assign(new_states[g], r, k)
        placed[r.idx] = (node, used_gids)
    obj = objective(list(new_states.values()), {i: problem.requests[i].weight for i in placed})
    return ExactResult(new_states, placed, optimal, placed_optimal, obj)


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
    p.max_time_in_seconds = 10 * budget_s + 5
    return solver


def _assign(st: GpuState, r: Request, k: int) -> None:
    """Give k free slices of r's resource on this GPU to pod r (any will do: they are equal)."""
    if isinstance(st, MigState):
        p = st.rules.index[r.profile]  # type: ignore[index]
        for inst in st.insts:
            if k and inst.p == p and not inst.hard:
                inst.pod = r.name
                k -= 1
    elif r.kind == KIND_GPU:
        st.whole_pod = r.name
        k = 0
    else:
        for s in st.slices:
            if k and s.size == r.size and not s.hard:
                s.pod = r.name
                k -= 1
    assert k == 0, f"solution gave {r.name} a slice that is not there"


def objective(states: list[GpuState], placed_weights: dict[int, int]) -> tuple[int, int, int]:
    """(placed weight, changes, occupied GPUs): compare with (a, -b, -c)."""
    changes = sum(s.destroyed + (1 if s.changed else 0) for s in states)
    occupied = sum(1 for s in states if s.has_pod())
    return (sum(placed_weights.values()), changes, occupied)
