"""Indexes over the cluster's GPUs that make placing a pod a few numpy operations over every
candidate GPU instead of a Python loop: GPU states that cost the same for any request share a
**bucket** (`GpuState.key()`), and the cost of hosting each kind of slice (`SliceRef`) is
computed once per bucket; each bucket also knows the capacity class (planner/objective.py) it
moves the GPU to. A `PlanningSession` keeps one index for as long as it lives, so that repeated
plans on a slowly changing cluster only compute the buckets they have not seen.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from dynpart.planner.objective import NodeTerms, Objective, capacity_class, class_after
from dynpart.planner.problem import Problem
from dynpart.planner.state import GpuState
from dynpart.planner.types import Option, SliceRef

NO_OPTION = np.iinfo(np.int64).max // 4


class _AskCosts:
    """Per bucket id: the cost components of the cheapest option for one slice kind, and the
    capacity class the option leaves (objective class id, filled per objective)."""

    __slots__ = ("chg", "empty", "left", "flex", "after", "after_id", "done", "done_ids")

    def __init__(self) -> None:
        self.chg = np.zeros(0, dtype=np.int64)
        self.empty = np.zeros(0, dtype=np.int64)
        self.left = np.zeros(0, dtype=np.int64)
        self.flex = np.zeros(0, dtype=np.int64)
        self.after: list[Option | None] = []  # the option itself, its class computed per objective
        self.after_id = np.zeros(0, dtype=np.int64)
        self.done = 0
        self.done_ids = 0


class NodeBest:
    """Per node, its best GPU for one slice kind under the objective (see `Greedy.best_single`),
    valid where `ok`; invalidated for a node when it changes."""

    __slots__ = ("top", "slot", "ok")

    def __init__(self, n_nodes: int):
        self.top = np.full(n_nodes, NO_OPTION, dtype=np.int64)
        self.slot = np.zeros(n_nodes, dtype=np.int64)
        self.ok = np.zeros(n_nodes, dtype=bool)

    def copy(self) -> NodeBest:
        c = NodeBest.__new__(NodeBest)
        c.top, c.slot, c.ok = self.top.copy(), self.slot.copy(), self.ok.copy()
        return c


class GpuIndex:
    """Bucket ids of GPU states and the per-bucket option costs, per slice kind."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._ids: dict[Hashable, int] = {}
        self._reps: list[GpuState | None] = []
        self._costs: dict[SliceRef, _AskCosts] = {}
        self._objective: Objective | None = None
        self._best: dict[tuple[SliceRef, bool], NodeBest] = {}
        # padded (node, slot) -> gid matrix; the pad is gid len(gpus), a GPU with no options
        nodes = problem.nodes
        width = max((len(n.gpus) for n in nodes), default=0) or 1
        self.pad = len(problem.gpus)
        self.node_gpus = np.full((len(nodes), width), self.pad, dtype=np.int64)
        for n in nodes:
            self.node_gpus[n.idx, : len(n.gpus)] = n.gpus
        self.node_of = np.array([g.node for g in problem.gpus] + [-1], dtype=np.int64)
        self.slot_of = np.zeros(len(problem.gpus) + 1, dtype=np.int64)
        for n in nodes:
            for k, g in enumerate(n.gpus):
                self.slot_of[g] = k
        self.PAD_BUCKET = -1  # replaced by a real id below
        self.PAD_BUCKET = self._new_bucket(("pad",), None)

    # --- buckets -------------------------------------------------------------------------------

    def _new_bucket(self, key: Hashable, state: GpuState | None) -> int:
        bid = len(self._reps)
        self._ids[key] = bid
        self._reps.append(state)
        return bid

    def bucket(self, state: GpuState) -> int:
        key = state.key()
        bid = self._ids.get(key)
        if bid is None:
            bid = self._new_bucket(key, state.clone())
        return bid

    def buckets(self, states: list[GpuState]) -> np.ndarray:
        """Bucket id of every GPU, plus the pad's at the end."""
        return np.array([self.bucket(s) for s in states] + [self.PAD_BUCKET], dtype=np.int64)

    # --- costs per bucket ----------------------------------------------------------------------

    def costs(self, ask: SliceRef) -> _AskCosts:
        """The cost arrays of `ask`, complete for every bucket known now."""
        c = self._costs.get(ask)
        if c is None:
            c = self._costs[ask] = _AskCosts()
        n = len(self._reps)
        if c.done < n:
            new = n - c.done
            chg = np.full(new, NO_OPTION, dtype=np.int64)
            empty = np.zeros(new, dtype=np.int64)
            left = np.zeros(new, dtype=np.int64)
            flex = np.zeros(new, dtype=np.int64)
            for k in range(new):
                rep = self._reps[c.done + k]
                opt = rep.option(ask) if rep is not None else None
                c.after.append(opt)
                if opt is None:
                    continue
                chg[k], empty[k], left[k], flex[k] = opt.cost
            c.chg = np.concatenate([c.chg, chg])
            c.empty = np.concatenate([c.empty, empty])
            c.left = np.concatenate([c.left, left])
            c.flex = np.concatenate([c.flex, flex])
            c.done = n
        obj = self._objective
        if obj is not None and c.done_ids < n:
            reps, start = self._reps, c.done_ids
            ids = np.array([0 if opt is None else obj.class_id(class_after(reps[start + k], ask, opt))
                            for k, opt in enumerate(c.after[start:])], dtype=np.int64)
            c.after_id = np.concatenate([c.after_id, ids])
            c.done_ids = n
        return c

    # --- capacity classes under an objective -----------------------------------------------------

    def node_best(self, ask: SliceRef, count_changes: bool, n_nodes: int) -> NodeBest:
        best = self._best.get((ask, count_changes))
        if best is None:
            best = self._best[(ask, count_changes)] = NodeBest(n_nodes)
        return best

    def node_changed(self, node: int) -> None:
        for best in self._best.values():
            best.ok[node] = False

    def use_objective(self, objective: Objective | None) -> None:
        if objective is not self._objective:
            self._objective = objective
            self._best.clear()
            for c in self._costs.values():
                c.after_id = np.zeros(0, dtype=np.int64)
                c.done_ids = 0

    def classes(self, states: list[GpuState], bid: np.ndarray | None = None) -> np.ndarray:
        """The capacity class id of every GPU (and 0 for the pad); with the GPUs' bucket ids,
        computed once per bucket (a bucket's states share their class)."""
        obj = self._objective
        assert obj is not None
        if bid is None:
            return np.array([obj.class_id(capacity_class(s)) for s in states] + [0], dtype=np.int64)
        uniq, first = np.unique(bid[:-1], return_index=True)
        per = np.zeros(int(uniq.max()) + 1 if len(uniq) else 1, dtype=np.int64)
        for b, g in zip(uniq.tolist(), first.tolist()):
            per[b] = obj.class_id(capacity_class(states[g]))
        out: np.ndarray = np.append(per[bid[:-1]], 0)
        return out


class PlanCache:
    """What a plan starts from, kept by a `PlanningSession` between plans (or built for one plan):
    every GPU's state as it is, its bucket and capacity-class ids, and the objective."""

    def __init__(self, problem: Problem, states: list[GpuState], index: GpuIndex, bid: np.ndarray,
                 objective: Objective, cls: np.ndarray | None, occupied: int | None = None,
                 cpu: np.ndarray | None = None, mem: np.ndarray | None = None, terms: NodeTerms | None = None):
        self.cpu = cpu if cpu is not None else np.array([n.cpu_free for n in problem.nodes], dtype=np.int64)
        self.mem = mem if mem is not None else np.array([n.mem_free for n in problem.nodes], dtype=np.int64)
        self.states = states
        self.terms = terms
        self.index = index
        self.bid = bid
        self.objective = objective
        if objective.active:
            index.use_objective(objective)
            if cls is None:
                cls = index.classes(states, bid)
        self.cls = cls
        self.occupied = occupied if occupied is not None else sum(1 for s in states if s.has_pod())

    @classmethod
    def build(cls, problem: Problem) -> PlanCache:
        from dynpart.planner.state import new_state

        states = [new_state(g) for g in problem.gpus]
        index = GpuIndex(problem)
        return cls(problem, states, index, index.buckets(states), Objective(problem.workload), None)
