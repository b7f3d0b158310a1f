"""Turn a policy's result into the `Plan` model, with a reason for every pod left out."""

from __future__ import annotations

from dynpart.planner.policy import PlanningPolicy, PolicyResult
from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState
from dynpart.snapshot import NodeLayout, PlacedSlice, Plan, PlanStats, PodPlacement, UnplacedPod


def slices_of(problem: Problem, states: list[GpuState], req: Request, gids: tuple[int, ...]) -> list[PlacedSlice]:
    """The pod's slices, by GPU index on its node, as `Plan` placements list them."""
    out: list[PlacedSlice] = []
    for gid in dict.fromkeys(gids):  # each GPU once; two MPS slices of one size on it are two
        out.extend(states[gid].slices_held_by(req.name))
    return sorted(out, key=PlacedSlice.sort_key) if len(out) > 1 else out


def keep_apart(problem: Problem, result: PolicyResult) -> tuple[PolicyResult, dict[int, str]]:
    """The policy's result with no two pods kept apart (`Request.apart`) on one node, whatever the
    policy: of a pair on one node the younger (later in the snapshot's pending list: the cluster
    view lists pods by creation) is left out, its slices left free. Returns the result (itself when
    nothing breaks it) and why each pod was left out."""
    if not any(r.apart for r in problem.requests):
        return result, {}
    placed = result.placements
    dropped: dict[int, tuple[int, int]] = {}  # younger -> (older, node)
    for req in problem.requests:  # by index: an older pod is decided before its younger ones
        where = placed.get(req.idx)
        if not req.apart or where is None:
            continue
        for other in req.apart:
            if other >= req.idx:
                break
            there = placed.get(other)
            if there is not None and other not in dropped and there.node == where.node:
                dropped[req.idx] = (other, where.node)
                break
    if not dropped:
        return result, {}
    states, placements = list(result.states), dict(placed)
    reasons: dict[int, str] = {}
    for idx, (older, node) in dropped.items():
        req = problem.requests[idx]
        for gid in dict.fromkeys(placements.pop(idx).gpus):
            states[gid] = states[gid].clone()
            states[gid].unbind(req.name)
        reasons[idx] = (f"pending pod {problem.requests[older].name}, which it must not share a node with "
                        f"(required pod anti-affinity or host ports), is planned on node {problem.nodes[node].name}, "
                        "where the plan would have put this one")
    return PolicyResult(states, placements, result.solver, result.moved), reasons


def build_plan(problem: Problem, policy: PlanningPolicy, result: PolicyResult, bound: int, solve_s: float,
               reasons: dict[int, str] | None = None) -> Plan:
    """`reasons`: why pods were left out, where not the policy's reason (`keep_apart`)."""
    states, placed = result.states, result.placements
    # the GPUs the policy gave a new state (when it started from the cache's states, only those
    # can differ from the cluster as it is)
    base = problem.cache.states if problem.cache is not None else None
    if base is not None and result.moved is not None:
        moved = sorted(result.moved)
    else:
        moved = [g for g, st in enumerate(states) if base is None or st is not base[g]]
    # only GPUs whose layout changes or that receive pods; every other GPU keeps its layout
    touched = {g for g in moved if states[g].changed}
    for where in placed.values():
        touched.update(where.gpus)
    layouts = []
    gpu_node = problem.gpus
    for n in sorted({gpu_node[g].node for g in touched}):
        node = problem.nodes[n]
        gpus = [states[g].layout() for g in node.gpus if g in touched]
        layouts.append(NodeLayout(node=node.name, mode=node.mode, gpus=gpus))
    placements, unplaced = [], []
    weight = 0
    for req in problem.requests:
        hit = placed.get(req.idx)
        if hit is None:
            reason = ((reasons or {}).get(req.idx) or req.no_candidate_reason
                      or policy.unplaced_reason(problem, req))
            unplaced.append(UnplacedPod(pod=req.name, reason=reason))
            continue
        weight += req.weight
        placements.append(PodPlacement(pod=req.name, node=problem.nodes[hit.node].name,
                                       slices=slices_of(problem, states, req, hit.gpus)))
    stats = PlanStats(
        pending=len(problem.requests),
        placed=len(placements),
        placed_weight=weight,
        free_slices_destroyed=sum(states[g].destroyed for g in moved),
        slices_created=sum(states[g].created for g in moved),
        gpus_touched=sum(1 for g in moved if states[g].changed),
        gpus_occupied=(sum(1 for s in states if s.has_pod()) if base is None else
                       problem.cache.occupied + sum(states[g].has_pod() - base[g].has_pod() for g in moved)),
        placed_upper_bound=bound,
        solver=result.solver,
        solve_s=round(solve_s, 6),
    )
    return Plan(policy=policy.name, layouts=layouts, placements=placements, unplaced=unplaced, stats=stats)
