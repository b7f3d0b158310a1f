"""What the baselines share: the scheduler's view after a layout is chosen (pods take free
slices that match, first fit, in priority and arrival order) and layout rewriting."""

from __future__ import annotations

from planner.problem import KIND_GPU, KIND_MIG, Problem, Request
from planner.state import GpuState, MigInst, MigState, MpsPiece, MpsState


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


def set_mig_geometry(st: MigState, geometry: frozenset) -> None:
    """Rewrite a MIG GPU to `geometry` (which contains every used instance in place)."""
    names = st.rules.names
    existing = {(names[i.p], i.start): i for i in st.insts}
    assert all((names[i.p], i.start) in geometry for i in st.insts if i.hard), "never touch a used slice"
    insts = []
    created = 0
    for name, start in sorted(geometry, key=lambda pl: pl[1]):
        inst = existing.get((name, start))
        if inst is None:
            inst = MigInst(st.rules.index[name], start, False, None, False)
            created += 1
        insts.append(inst)
    destroyed = sum(1 for key, i in existing.items() if i.existing and key not in geometry)
    st.created += created
    st.destroyed += destroyed
    st.changed = st.changed or bool(created or destroyed)
    st.insts = insts


def set_mps_slices(st: MpsState, sizes: list[int]) -> None:
    """Replace the free slices of an MPS GPU by new ones of the given sizes."""
    kept = [s for s in st.slices if s.hard]
    st.destroyed += sum(1 for s in st.slices if not s.hard and s.existing)
    st.slices = kept + [MpsPiece(size, False, None, False) for size in sizes]
    st.created += len(sizes)
    st.changed = True
