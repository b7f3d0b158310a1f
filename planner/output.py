"""Turn the planner's working state into the `Plan` model, with a reason for every pod left out."""

from __future__ import annotations

from dynpart.planner.problem import KIND_MIG, Problem, Request
from dynpart.planner.state import GpuState, MigState, MpsState, new_state, option_for
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout, Plan, PlanStats, PodPlacement, UnplacedPod


def gpu_layout(state: GpuState) -> GpuLayout:
    if isinstance(state, MigState):
        names = state.rules.names
        return GpuLayout.model_construct(
            index=state.info.index, mps=[], whole_pod=None,
            mig=[MigInstance.model_construct(profile=names[i.p], start=i.start, used=i.used, pod=i.pod) for i in state.insts],
            changed=state.changed, created=state.created, destroyed=state.destroyed,
        )
    assert isinstance(state, MpsState)
    return GpuLayout.model_construct(
        index=state.info.index, mig=[],
        mps=[MpsSlice.model_construct(size=s.size, used=s.used, pod=s.pod) for s in state.slices],
        whole_pod=state.whole_pod, changed=state.changed, created=state.created, destroyed=state.destroyed,
    )


def slices_of(problem: Problem, states: list[GpuState], req: Request, gids: list[int]) -> list[tuple[int, str]]:
    out = []
    for gid in gids:
        st = states[gid]
        idx = problem.gpus[gid].index
        if isinstance(st, MigState):
            for i in st.insts:
                if i.pod == req.name:
                    out.append((idx, f"{st.rules.names[i.p]}@{i.start}"))
        elif st.whole_pod == req.name:
            out.append((idx, "whole"))
        else:
            out.extend((idx, f"{s.size}") for s in st.slices if s.pod == req.name)
    return sorted(set(out))


def unplaced_reason(problem: Problem, req: Request, policy: str = "dynpart") -> str:
    if req.no_candidate_reason:
        return req.no_candidate_reason
    if policy == "static":
        return (f"the static layout has no free {req.resource} on its {len(req.candidates)} candidate node(s) "
                "and never changes")
    if policy == "nos":
        return (f"nos's greedy supplied no free {req.resource} on its {len(req.candidates)} candidate node(s) "
                "(geometries without placements, nodes in name order)")
    what = req.profile if req.kind == KIND_MIG else req.size
    # would it fit on an otherwise untouched cluster (only used slices fixed)?
    for n in req.candidates:
        free = sum(1 for g in problem.nodes[n].gpus
                   if option_for(new_state(problem.gpus[g]), req.kind, what) is not None)
        if free >= min(req.count, 1):
            return (f"no room left for {req.count} x {req.resource} on its {len(req.candidates)} candidate "
                    "node(s): the space went to pods of higher priority or to other pending pods")
    return (f"no room for {req.resource} on its {len(req.candidates)} candidate node(s) without "
            "moving or destroying slices in use")


def build_plan(policy: str, problem: Problem, states: list[GpuState], placed: dict[int, tuple[int, list[int]]],
               bound: int, solver: str, solve_s: float) -> Plan:
    # only GPUs whose layout changes or that receive pods; every other GPU keeps its layout
    touched = {g for g, st in enumerate(states) if st.changed}
    for _, gids in placed.values():
        touched.update(gids)
    layouts = []
    for n in problem.nodes:
        gpus = [gpu_layout(states[g]) for g in n.gpus if g in touched]
        if gpus:
            layouts.append(NodeLayout.model_construct(node=n.name, mode=n.mode, gpus=gpus))
    placements, unplaced = [], []
    weight = 0
    for req in problem.requests:
        hit = placed.get(req.idx)
        if hit is None:
            unplaced.append(UnplacedPod(pod=req.name, reason=unplaced_reason(problem, req, policy)))
            continue
        node, gids = hit
        weight += req.weight
        placements.append(PodPlacement(pod=req.name, node=problem.nodes[node].name,
                                       slices=slices_of(problem, states, req, gids)))
    stats = PlanStats(
        pending=len(problem.requests),
        placed=len(placements),
        placed_weight=weight,
        free_slices_destroyed=sum(s.destroyed for s in states),
        slices_created=sum(s.created for s in states),
        gpus_touched=sum(1 for s in states if s.changed),
        gpus_occupied=sum(1 for s in states if s.has_pod()),
        placed_upper_bound=bound,
        solver=solver,
        solve_s=round(solve_s, 6),
    )
    return Plan(policy=policy, layouts=layouts, placements=placements, unplaced=unplaced, stats=stats)
