"""The nos planner (nebuly-ai/nos), re-implemented from its description and made deterministic.

- nodes in name order; for each GPU the geometry (profile counts, from the model's maximal
  geometries, keeping used instances) that supplies most of the still lacking profiles; ties
  go to the first geometry in catalog order (nos broke them by Go map order);
- geometries are counts without placement: the layout is realised the way mig-parted does,
  and when the used instances' positions make the counts unplaceable the GPU is left as it is
  (on a real node the agent fails to apply it);
- no backtracking, no global objective; used slices are never removed;
- MPS: on each GPU, the lacking sizes (smaller first) are made from the spare memory, and only
  then from the room of the free slices, which are restored where they still fit (nos's
  slicing `GPU.UpdateGeometryFor`).
After each node the pods that now fit are bound, as the scheduler would.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import singledispatch

from dynpart.mig import maximal_geometries, place_counts
from dynpart.planner.baselines.common import schedule, scheduler_order
from dynpart.planner.mig_state import MigState
from dynpart.planner.mps_state import MpsState
from dynpart.planner.policy import PlanOptions, PolicyName, PolicyResult
from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState, new_state
from dynpart.planner.types import MigSliceRef, MpsSliceRef, Placements


class NosPolicy:
    def __init__(self, options: PlanOptions):
        pass  # nos has no knobs

    @property
    def name(self) -> PolicyName:
        return "nos"

    def place(self, problem: Problem) -> PolicyResult:
        states, placed = plan_nos(problem)
        return PolicyResult(states, placed, "nos greedy")

    def unplaced_reason(self, problem: Problem, req: Request) -> str:
        return (f"nos's greedy supplied no free {req.resource} on its {len(req.candidates)} candidate node(s) "
                "(geometries without placements, nodes in name order)")


@dataclass
class _Lacking:
    """What the pods still waiting for a node ask for: MIG profiles (counted), MPS sizes (in
    scheduling order)."""

    mig: Counter[str] = field(default_factory=Counter)
    mps: list[int] = field(default_factory=list)


def plan_nos(problem: Problem) -> tuple[list[GpuState], Placements]:
    states = [new_state(g) for g in problem.gpus]
    cpu = [n.cpu_free for n in problem.nodes]
    mem = [n.mem_free for n in problem.nodes]
    placed: Placements = {}
    schedule(problem, states, cpu, mem, placed)  # pods that fit the current layout
    for node in sorted(range(len(problem.nodes)), key=lambda n: problem.nodes[n].name):
        lacking = _Lacking()
        for r in scheduler_order(problem):
            if r.idx in placed or node not in r.candidates:
                continue
            if isinstance(r.slice_ref, MigSliceRef):
                lacking.mig[r.slice_ref.profile] += r.count
            elif isinstance(r.slice_ref, MpsSliceRef):
                lacking.mps.extend([r.slice_ref.size] * r.count)
        if not lacking.mig and not lacking.mps:
            continue
        for gid in problem.nodes[node].gpus:
            _supply(states[gid], lacking)
        schedule(problem, states, cpu, mem, placed, nodes=[node])
    return states, placed


@singledispatch
def _supply(st: GpuState, lacking: _Lacking) -> None:
    """Re-lay one GPU for what is lacking, nos's way for the GPU's mode."""
    raise TypeError(f"nos cannot lay out a {type(st).__name__}")


@_supply.register
def _nos_mig_gpu(st: MigState, lacking: _Lacking) -> None:
    if lacking.mig:
        _nos_mig_counts(st, lacking.mig)


@_supply.register
def _nos_mps_gpu(st: MpsState, lacking: _Lacking) -> None:
    if lacking.mps:
        _nos_mps_sizes(st, lacking.mps)


def _nos_mig_counts(st: MigState, lacking: Counter[str]) -> None:
    names = st.rules.names
    used = Counter(names[i.p] for i in st.insts if i.hard)
    free_now = Counter(names[i.p] for i in st.insts if not i.hard)
    allowed = [n for n in names if not n.endswith("+me")]  # nos knows no +me profiles
    best, best_supply = None, sum(min(free_now[p], lacking[p]) for p in lacking)
    for geometry in maximal_geometries(st.rules.model, allowed):
        counts = Counter(dict(geometry))
        if any(counts[p] < c for p, c in used.items()):
            continue
        free = counts - used
        supply = sum(min(free[p], lacking[p]) for p in lacking)
        if supply > best_supply:
            best, best_supply = free, supply
    if best is None:
        for p in list(lacking):
            lacking[p] -= min(free_now[p], lacking[p])
        return
    fixed = [(names[i.p], i.start) for i in st.insts if i.hard]
    placed = place_counts(st.rules.model, dict(best), fixed)
    if placed is None:
        return  # the agent could not realise it: nos leaves the GPU as it was
    st.set_geometry(placed)
    for p in list(lacking):
        lacking[p] -= min(best[p], lacking[p])


def _nos_mps_sizes(st: MpsState, lacking: list[int]) -> None:
    """nos's slicing `GPU.UpdateGeometryFor` (pkg/gpu/slicing/gpu.go): the sizes lacking beyond
    the GPU's free slices, smaller first, are made from the spare memory; only then are the free
    slices deleted to make more room, and those that still fit afterwards are restored (a size's
    free slices all or none, smaller sizes first: nos restores them in Go map order). The GPU's
    free slices then count against what is lacking (`Node.UpdateGeometryFor`). As in gpu.go, the
    free slices are deleted by size (`delete(g.FreeProfiles, k)`), for each lacking size, whether
    any is still missing or not: slices just made of a size the GPU had free go with them, and
    only the original count of that size comes back. The MPS server's
    client bound, which nos does not know, still caps the slices."""
    if st.whole_pod is not None:
        return
    free_at = [k for k, s in enumerate(st.slices) if not s.hard]
    originals = Counter(st.slices[k].size for k in free_at)
    missing = Counter(lacking) - originals
    free = Counter(originals)  # the GPU's FreeProfiles as gpu.go changes them
    if missing:
        held = sum(s.size for s in st.slices if s.hard)
        clients = st.clients_left()

        def fits(size: int, n: int = 1) -> bool:
            room = st.cap - held - sum(k * c for k, c in free.items())
            return size * n <= room and (clients is None or sum(free.values()) + n <= clients)

        for size in sorted(missing):
            q = missing[size]
            while q and fits(size):  # from the spare memory
                free[size] += 1
                q -= 1
            # then (whatever is still missing, none included) every size the GPU had free is
            # deleted, by key (`delete(g.FreeProfiles, k)`: slices of that size just made go too),
            # the rest made, and the original free slices restored where they fit
            for o in originals:
                del free[o]
            while q and fits(size):
                free[size] += 1
                q -= 1
            for o in sorted(originals):
                if fits(o, originals[o]):
                    free[o] += originals[o]
        keep: list[int] = []
        left = Counter(free)
        for k in free_at:
            if left[st.slices[k].size] > 0:
                left[st.slices[k].size] -= 1
                keep.append(k)
        new = sorted(left.elements())
        if new or len(keep) < len(free_at):
            st.replace_free_slices(new, keep=keep)
    for size, n in free.items():
        for _ in range(min(n, lacking.count(size))):
            lacking.remove(size)
