"""An independent optimum for small instances: a slot-level CP-SAT model of the MIG rules.

The planner models each GPU as a choice among enumerated configurations; this model instead
has one boolean per (GPU, profile, legal start) with the driver's rules written as
constraints (one instance per memory slice, max counts, one +me, compute slices). It only
maximises the priority-weighted number of pods placed (the first objective tier), which is
what the optimality test compares."""

from __future__ import annotations

from ortools.sat.python import cp_model

from dynpart.catalog import default_catalog
from dynpart.planner.problem import KIND_GPU, KIND_MIG, compile_problem
from dynpart.snapshot import Snapshot


def reference_optimum(snapshot: Snapshot, time_limit_s: float = 20.0) -> tuple[int, bool]:
    """(best priority-weighted placed count, proved optimal)."""
    problem = compile_problem(snapshot, default_catalog())
    m = cp_model.CpModel()
    offered: dict[tuple[int, object], object] = {}
    for g in problem.gpus:
        if g.rules is not None:
            r = g.rules
            z = {}
            for p, placements in enumerate(r.placements):
                for s, _mask in placements:
                    z[(p, s)] = m.NewBoolVar(f"z{g.gid}_{p}_{s}")
            for p, s, _ in g.used_mig:
                m.Add(z[(p, s)] == 1)
            for slot in range(g.model.memory_slices):
                covering = [v for (p, s), v in z.items() if s <= slot < s + r.memory[p]]
                m.Add(sum(covering) <= 1)
            for p in range(len(r.names)):
                m.Add(sum(v for (q, _), v in z.items() if q == p) <= r.max_count[p])
            m.Add(sum(v for (p, _), v in z.items() if r.media[p]) <= 1)
            m.Add(sum(r.compute[p] * v for (p, _), v in z.items()) <= g.model.compute_slices)
            for p, name in enumerate(r.names):
                used = sum(1 for q, _, _ in g.used_mig if q == p)
                offered[(g.gid, name)] = sum(v for (q, _), v in z.items() if q == p) - used
        else:
            if g.whole_pod:
                continue
            has_used = bool(g.used_mps)
            room = g.capacity - sum(s for s, _ in g.used_mps)
            sizes = sorted({rq.size for rq in problem.requests if rq.kind != KIND_MIG and rq.kind != KIND_GPU})
            n = {s: m.NewIntVar(0, room // s, f"n{g.gid}_{s}") for s in sizes}
            m.Add(sum(s * v for s, v in n.items()) <= room)
            for s, v in n.items():
                offered[(g.gid, s)] = v
            if not has_used:
                w = m.NewBoolVar(f"w{g.gid}")
                for v in n.values():
                    m.Add(v == 0).OnlyEnforceIf(w)
                offered[(g.gid, "whole")] = w
    x = {}
    take: dict[tuple[int, object], list] = {}
    for rq in problem.requests:
        key = rq.profile if rq.kind == KIND_MIG else ("whole" if rq.kind == KIND_GPU else rq.size)
        xs = []
        for n in rq.candidates:
            v = m.NewBoolVar(f"x{rq.idx}_{n}")
            xs.append(v)
            x[(rq.idx, n)] = v
            parts = []
            for gid in problem.nodes[n].gpus:
                if (gid, key) in offered:
                    a = m.NewIntVar(0, rq.count, f"a{rq.idx}_{gid}")
                    parts.append(a)
                    take.setdefault((gid, key), []).append(a)
            m.Add(sum(parts) == rq.count * v) if parts else m.Add(v == 0)
        if xs:
            m.AddAtMostOne(xs)
    for key, parts in take.items():
        m.Add(sum(parts) <= offered[key])
    for node in problem.nodes:
        here = [(rq, x[(rq.idx, node.idx)]) for rq in problem.requests if (rq.idx, node.idx) in x]
        if here:
            m.Add(sum(rq.cpu * v for rq, v in here) <= node.cpu_free)
            m.Add(sum(rq.mem * v for rq, v in here) <= node.mem_free)
    m.Maximize(sum(problem.requests[i].weight * v for (i, _), v in x.items()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    status = solver.Solve(m)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return round(solver.ObjectiveValue()), status == cp_model.OPTIMAL
