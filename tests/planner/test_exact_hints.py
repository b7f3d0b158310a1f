"""The exact search's whole-plan hint (planner/exact.py, `solve_exact`) is a solution of its
model also when the plan it hints is one the exact search made itself (a window of the
large-neighbourhood search that improved, hinted again when a later window takes its nodes)."""

from __future__ import annotations

import pytest
from ortools.sat.python import cp_model

from dynpart.catalog import default_catalog
from dynpart.planner import exact
from dynpart.planner.problem import compile_problem
from dynpart.planner.state import new_state
from dynpart.resources import mig_resource_name, mps_resource_name
from dynpart.snapshot import Gpu, Node, PendingPod, Snapshot


@pytest.mark.parametrize(("mode", "resource"), [("mig", mig_resource_name("1g.10gb")), ("mps", mps_resource_name(10))])
def test_a_plan_of_the_exact_search_is_a_consistent_hint(mode: str, resource: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod with two slices on one GPU: the hint must give it both there (before, the exact
    search's placements named the GPU once and the hint gave it one slice: no solution)."""
    snap = Snapshot(nodes=[Node(name="n0", mode=mode, gpu_model="H100-80GB", gpus=[Gpu(index=0), Gpu(index=1)],
                                cpu_milli_free=64000, memory_mib_free=262144)],
                    pending=[PendingPod(name="ns/p0", resource=resource, count=2, cpu_milli=500, memory_mib=1024)])
    problem = compile_problem(snap, default_catalog())
    base = [new_state(g) for g in problem.gpus]
    cpu, mem = [n.cpu_free for n in problem.nodes], [n.mem_free for n in problem.nodes]
    first = exact.solve_exact(problem, base, [0], problem.requests, None, 0.5, cpu, mem)
    assert first is not None and len(first.placed) == 1
    assert len(set(first.placed[0].gpus)) == 1  # both slices on one GPU (the fewest occupied)

    real = exact._solver

    def hinted_only(budget_s: float) -> cp_model.CpSolver:
        solver = real(budget_s)
        solver.parameters.fix_variables_to_their_hinted_value = True  # an inconsistent hint: infeasible
        return solver

    monkeypatch.setattr(exact, "_solver", hinted_only)
    again = exact.solve_exact(problem, base, [0], problem.requests, first.placed, 0.5, cpu, mem,
                              [first.states[g.gid] for g in problem.gpus])
    assert again is not None and again.placed == first.placed
