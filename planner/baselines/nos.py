"""The nos planner (nebuly-ai/nos), re-implemented from its description and made deterministic.

- nodes in name order; for each GPU the geometry (profile counts, from the model's maximal
  geometries, keeping used instances) that supplies most of the still lacking profiles; ties
  go to the first geometry in catalog order (nos broke them by Go map order);
- geometries are counts without placement: the layout is realised the way mig-parted does,
  and when the used instances' positions make the counts unplaceable the GPU is left as it is
  (on a real node the agent fails to apply it);
- no backtracking, no global objective; used slices are never removed;
- MPS: on each GPU, free slices are replaced by slices for the lacking sizes while memory
  allows, first come first served.
After each node the pods that now fit are bound, as the scheduler would.
"""

from __future__ import annotations

from collections import Counter

from dynpart.mig import maximal_geometries, place_counts
from dynpart.planner.baselines.common import schedule, scheduler_order
from dynpart.planner.problem import KIND_MIG, KIND_MPS, Problem
from dynpart.planner.state import GpuState, MigState, MpsState, new_state


def plan_nos(problem: Problem) -> tuple[list[GpuState], dict[int, tuple[int, list[int]]]]:
    states = [new_state(g) for g in problem.gpus]
    cpu = [n.cpu_free for n in problem.nodes]
    mem = [n.mem_free for n in problem.nodes]
    placed: dict[int, tuple[int, list[int]]] = {}
    schedule(problem, states, cpu, mem, placed)  # pods that fit the current layout
    for node in sorted(range(len(problem.nodes)), key=lambda n: problem.nodes[n].name):
        lacking_mig: Counter[str] = Counter()
        lacking_mps: list[int] = []
        for r in scheduler_order(problem):
            if r.idx in placed or node not in r.candidates:
                continue
            if r.kind == KIND_MIG:
                lacking_mig[r.profile] += r.count  # type: ignore[index]
            elif r.kind == KIND_MPS:
                lacking_mps.extend([r.size] * r.count)
        if not lacking_mig and not lacking_mps:
            continue
        for gid in problem.nodes[node].gpus:
            st = states[gid]
            if isinstance(st, MigState) and lacking_mig:
                _nos_mig_gpu(st, lacking_mig)
            elif isinstance(st, MpsState) and lacking_mps:
                _nos_mps_gpu(st, lacking_mps)
        schedule(problem, states, cpu, mem, placed, nodes=[node])
    return states, placed


def _nos_mig_gpu(st: MigState, lacking: Counter[str]) -> None:
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
    geometry = place_counts(st.rules.model, dict(best), fixed)
    if geometry is None:
        return  # the agent could not realise it: nos leaves the GPU as it was
    st.set_geometry(geometry)
    for p in list(lacking):
        lacking[p] -= min(best[p], lacking[p])


def _nos_mps_gpu(st: MpsState, lacking: list[int]) -> None:
    if st.whole_pod is not None:
        return
    room = st.cap - sum(s.size for s in st.slices if s.hard)
    sizes = []
    for size in list(lacking):
        if size <= room:
            sizes.append(size)
            room -= size
            lacking.remove(size)
    if sizes:
        st.replace_free_slices(sizes)
