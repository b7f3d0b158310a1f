"""What the baselines share: the scheduler's view after a layout is chosen (pods take free
slices that match, first fit, in priority and arrival order)."""

from __future__ import annotations

from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState
from dynpart.planner.types import Assignment, Placements


def scheduler_order(problem: Problem) -> list[Request]:
    return sorted(problem.requests, key=lambda r: (-r.priority, r.idx))


def bind_on_node(problem: Problem, states: list[GpuState], req: Request, node: int) -> tuple[int, ...] | None:
    """Take req.count matching free slices on the node, as kube-scheduler would; None if short."""
    got: list[tuple[int, int]] = []
    for gid in problem.nodes[node].gpus:
        for k in states[gid].free_slots(req.slice_ref):
            if len(got) < req.count:
                got.append((gid, k))
        if len(got) == req.count:
            break
    if len(got) < req.count:
        return None
    for gid, k in got:
        states[gid].bind(k, req.slice_ref, req.name)
    return tuple(sorted({g for g, _ in got}))


def schedule(problem: Problem, states: list[GpuState], cpu: list[int], mem: list[int],
             placed: Placements, nodes: list[int] | None = None) -> None:
    """Bind every unplaced pod that fits the current layout (first fit over nodes), on no node
    of a pod it is kept apart from."""
    for req in scheduler_order(problem):
        if req.idx in placed:
            continue
        # the nodes of the pods it must not share a node with (the scheduler's filters), once per
        # pod: looked up per node, a Deployment's 2,000 replicas took minutes of a plan
        off = {w.node for j in req.apart if (w := placed.get(j)) is not None} if req.apart else ()
        for n in req.candidates if nodes is None else [n for n in req.candidates if n in nodes]:
            if cpu[n] < req.cpu or mem[n] < req.mem or n in off:
                continue
            gids = bind_on_node(problem, states, req, n)
            if gids is not None:
                cpu[n] -= req.cpu
                mem[n] -= req.mem
                placed[req.idx] = Assignment(n, gids)
                break
