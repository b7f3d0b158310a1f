"""What the baselines share: the scheduler's view after a layout is chosen (pods take free
slices that match, first fit, in priority and arrival order)."""

from __future__ import annotations

from dynpart.planner.problem import KIND_GPU, KIND_MIG, Problem, Request
from dynpart.planner.state import GpuState, MigState


def scheduler_order(problem: Problem) -> list[Request]:
    return sorted(problem.requests, key=lambda r: (-r.priority, r.idx))


def free_slots(st: GpuState, req: Request) -> list[int]:
    """Indices of free slices on this GPU that the pod's resource matches."""
    if isinstance(st, MigState):
        p = st.rules.index.get(req.profile) if req.kind == KIND_MIG else None
        return [k for k, i in enumerate(st.insts) if p is not None and i.p == p and not i.hard]
    if req.kind == KIND_MIG:
        return []
    if req.kind == KIND_GPU:
        return [0] if not st.slices and st.whole_pod is None else []
    return [k for k, s in enumerate(st.slices) if s.size == req.size and not s.hard]


def bind_on_node(problem: Problem, states: list[GpuState], req: Request, node: int) -> list[int] | None:
    """Take req.count matching free slices on the node, as kube-scheduler would; None if short."""
    got: list[tuple[int, int]] = []
    for gid in problem.nodes[node].gpus:
        for k in free_slots(states[gid], req):
            if len(got) < req.count:
                got.append((gid, k))
        if len(got) == req.count:
            break
    if len(got) < req.count:
        return None
    for gid, k in got:
        st = states[gid]
        if isinstance(st, MigState):
            st.insts[k].pod = req.name
        elif req.kind == KIND_GPU:
            st.whole_pod = req.name
        else:
            st.slices[k].pod = req.name
    return sorted({g for g, _ in got})


def schedule(problem: Problem, states: list[GpuState], cpu: list[int], mem: list[int],
             placed: dict[int, tuple[int, list[int]]], nodes: list[int] | None = None) -> None:
    """Bind every unplaced pod that fits the current layout (first fit over nodes)."""
    for req in scheduler_order(problem):
        if req.idx in placed:
            continue
        for n in req.candidates if nodes is None else [n for n in req.candidates if n in nodes]:
            if cpu[n] < req.cpu or mem[n] < req.mem:
                continue
            gids = bind_on_node(problem, states, req, n)
            if gids is not None:
                cpu[n] -= req.cpu
                mem[n] -= req.mem
                placed[req.idx] = (n, gids)
                break
