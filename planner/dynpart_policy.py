"""dynpart's own policy: the greedy plan, then the exact search (CP-SAT) on the whole instance
when it is small, or window by window (large-neighbourhood search) when it is not.

The greedy weighs the workload-aware objective (planner/objective.py); the exact search counts
placed pods and changes only, so its plan replaces the greedy's only when it places more or
changes less. The search runs only for pods that fitted the cluster as it was and were crowded
out by other pending pods: a pod that did not fit alone cannot fit with others planned too."""

from __future__ import annotations

import time

from dynpart.planner.bound import placed_upper_bound
from dynpart.planner.exact import objective, solve_exact, wall_limit_s
from dynpart.planner.greedy import Greedy, arrival_order, request_order
from dynpart.planner.index import PlanCache
from dynpart.planner.policy import PlanOptions, PolicyName, PolicyResult
from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState, new_state
from dynpart.planner.types import Placements


def _better(a: tuple[int, int, int], b: tuple[int, int, int], changes: bool = True) -> bool:
    """More placed weight, else fewer changes (the third tier is the greedy's objective)."""
    return (a[0], -a[1]) > (b[0], -b[1]) if changes else a[0] > b[0]


def _weight(problem: Problem, greedy: Greedy) -> int:
    return sum(problem.requests[i].weight for i in greedy.placement)


class DynpartPolicy:
    def __init__(self, options: PlanOptions):
        self.options = options
        self._fit_alone: dict[int, bool] = {}
        # the pods the greedy plan placed: they fit alone, whether or not the exact search (whose
        # plan may leave one of them out for others) keeps them
        self._greedy_placed: set[int] = set()

    @property
    def name(self) -> PolicyName:
        return "dynpart"

    def place(self, problem: Problem) -> PolicyResult:
        t0 = time.perf_counter()
        opts = self.options
        cache = problem.cache if problem.cache is not None else PlanCache.build(problem)
        greedy = self._greedy(problem, cache, opts).run(arrival_order(problem))
        self._fit_alone = {r.idx: greedy.fits_alone(r) for r in problem.requests
                           if r.idx not in greedy.placement and r.candidates}
        if any(self._fit_alone.values()):
            # pods were crowded out: smallest first may place more (it never places fewer pods
            # than any other order of one priority level would with the same choices)
            small_first = self._greedy(problem, cache, opts).run(request_order(problem))
            if _weight(problem, small_first) > _weight(problem, greedy):
                greedy = small_first
                self._fit_alone = {r.idx: greedy.fits_alone(r) for r in problem.requests
                                   if r.idx not in greedy.placement and r.candidates}
        states, placed = greedy.states, greedy.placements()
        self._greedy_placed = set(placed)
        solver = "greedy"
        open_reqs = [r for r in problem.requests if self._fit_alone.get(r.idx)]
        uniform = len({r.priority for r in problem.requests}) <= 1
        if open_reqs and not (uniform and len(placed) >= placed_upper_bound(problem)) and opts.time_limit_s > 0:
            if len(problem.gpus) <= opts.exact_max_gpus and len(problem.requests) <= opts.exact_max_pods:
                base = [new_state(g) for g in problem.gpus]
                res = solve_exact(problem, base, list(range(len(problem.nodes))), problem.requests, placed,
                                  opts.time_limit_s, [n.cpu_free for n in problem.nodes],
                                  [n.mem_free for n in problem.nodes], states)
                greedy_obj = objective(states, {i: problem.requests[i].weight for i in placed})
                if res is not None:
                    solver = ("cp-sat optimal" if res.optimal else
                              "cp-sat optimal placement" if res.placed_optimal else "cp-sat feasible")
                    if _better(res.objective, greedy_obj, opts.minimise_changes):
                        states = [res.states[g.gid] for g in problem.gpus]
                        placed = res.placed
            else:
                cpu, mem = [int(c) for c in greedy.cpu], [int(m) for m in greedy.mem]
                solver = _improve_by_windows(problem, states, placed, cpu, mem, open_reqs, opts, t0)
            return PolicyResult(states, placed, solver)
        return PolicyResult(states, placed, solver, moved=greedy.touched)

    @staticmethod
    def _greedy(problem: Problem, cache: PlanCache, opts: PlanOptions) -> Greedy:
        return Greedy(problem, cache.states, cache.objective, cache.index, cache.bid, cache.cls, cache.cpu, cache.mem,
                      opts.minimise_changes, cache.terms, cache.rooms)

    def unplaced_reason(self, problem: Problem, req: Request) -> str:
        # would it fit on an otherwise untouched cluster (only used slices fixed)? No node
        # count: the nodes a round sees change with the plans in flight, and a reason
        # that changes with them would post the pod's Unplaceable Event again every round
        if self._fit_alone.get(req.idx, False) or req.idx in self._greedy_placed:
            return (f"no room left for {req.count} x {req.resource} on the nodes it may use: the space went to "
                    "pods of higher priority or to other pending pods")
        return f"no room for {req.resource} on the nodes it may use without moving or destroying slices in use"


def _improve_by_windows(problem: Problem, states: list[GpuState], placed: Placements,
                        cpu: list[int], mem: list[int], open_reqs: list[Request], opts: PlanOptions,
                        t0: float) -> str:
    """Large-neighbourhood search: for each pod left out, re-plan exactly a window of its
    candidate nodes with the most reconfigurable room, together with the pods planned there.
    States, placements and CPU/memory left are updated in place when a window improves."""
    slack = []
    for node in problem.nodes:
        total = 0
        for gid in node.gpus:
            info = problem.gpus[gid]
            if info.rules is not None:
                total += info.model.memory_slices - sum(info.rules.memory[p] for p, _, _ in info.used_mig)
            elif not info.whole_pod:
                total += info.capacity - sum(s for s, _ in info.used_mps)
        slack.append(total)
    on_node: dict[int, set[int]] = {}
    for idx, where in placed.items():
        on_node.setdefault(where.node, set()).add(idx)
    # the windows' budget is deterministic time (same snapshot, same plan); the wall clock only
    # stops a runaway: past what the windows take on a loaded machine, each of a window's two
    # solves up to its own wall-clock net (exact._solver: 10 x its share of per_window + 5 s), and
    # a minute more for the greedy and the models, so that a slow machine plans the same. Windows:
    # budget / per_window, and one more where `budget -= per_window` leaves a float residue above 0
    budget = opts.time_limit_s
    per_window = max(0.02, budget / 10)
    windows = int(budget / per_window) + 1
    runaway_s = windows * wall_limit_s(per_window) + 60.0
    improved = 0
    tried: dict[int, int] = {}  # per node, the windows with it that did not improve
    for req in open_reqs:
        if budget <= 0 or time.perf_counter() - t0 > runaway_s:
            break
        if req.idx in placed:
            continue
        # nodes of windows that did not improve go after the others: re-solving the same
        # window (every pod that may use any node would get the one of the most slack) finds
        # the same plan again, where another window may improve
        ranked = sorted((n for n in req.candidates
                         if problem.nodes[n].cpu_free >= req.cpu and problem.nodes[n].mem_free >= req.mem),
                        key=lambda n: (tried.get(n, 0), -slack[n], n))
        window = sorted(_window(problem, ranked, opts.window_gpus))
        if not window:
            continue
        wset = set(window)
        in_window = sorted({i for n in window for i in on_node.get(n, ())})
        extra = [r.idx for r in open_reqs if r.idx not in placed and wset.intersection(r.candidates)]
        pods = in_window + [i for i in extra if i not in in_window][: max(1, opts.window_pods - len(in_window))]
        if req.idx not in pods:
            pods.append(req.idx)
        reqs = [problem.requests[i] for i in sorted(pods)]
        gids = [g for n in window for g in problem.nodes[n].gpus]
        base = list(states)
        for g in gids:
            base[g] = new_state(problem.gpus[g])
        cpu_left = {n: problem.nodes[n].cpu_free for n in window}
        mem_left = {n: problem.nodes[n].mem_free for n in window}
        res = solve_exact(problem, base, window, reqs, placed, per_window, cpu_left, mem_left, states)
        budget -= per_window
        before = objective([states[g] for g in gids], {i: problem.requests[i].weight for i in in_window})
        if res is None or not _better(res.objective, before, opts.minimise_changes):
            for n in window:
                tried[n] = tried.get(n, 0) + 1
            continue
        improved += 1
        for g in gids:
            states[g] = res.states[g]
        for i in in_window:
            placed.pop(i, None)
        for n in window:
            on_node[n] = set()
            cpu[n], mem[n] = cpu_left[n], mem_left[n]
        for i, where in res.placed.items():
            placed[i] = where
            on_node[where.node].add(i)
            cpu[where.node] -= problem.requests[i].cpu
            mem[where.node] -= problem.requests[i].mem
    return f"greedy + cp-sat windows ({improved} improved)"


def _window(problem: Problem, ranked: list[int], gpus: int) -> list[int]:
    """The first nodes of `ranked` until they hold `gpus` GPUs (one node at least)."""
    out: list[int] = []
    held = 0
    for n in ranked:
        if held >= gpus:
            break
        out.append(n)
        held += len(problem.nodes[n].gpus)
    return out
