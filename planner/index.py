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

from dynpart.mig import MigRules
from dynpart.planner.mig_state import MigRows, MigState
from dynpart.planner.objective import NodeRooms, NodeTerms, Objective, capacity_class, class_after, mig_class, node_caps
from dynpart.planner.problem import Problem
from dynpart.planner.state import GpuState
from dynpart.planner.types import MigSliceRef, Option, SliceRef

NO_OPTION = np.iinfo(np.int64).max // 4

# new buckets from which `GpuIndex.costs` weighs MIG options with numpy
_BATCH = 48


class CostArrays:
    """`AskCosts` as numpy arrays, indexed by bucket id (the greedy's vectorised path); views,
    valid until more buckets are added."""

    __slots__ = ("chg", "empty", "left", "flex", "rest", "after_id")

    chg: np.ndarray
    empty: np.ndarray
    left: np.ndarray
    flex: np.ndarray
    rest: np.ndarray
    after_id: np.ndarray


class AskCosts:
    """Per bucket id: the cost components of the cheapest option for one slice kind and the
    capacity class it leaves (objective class id, filled per objective). The changes, tie-break
    keys and classes are kept as lists, which the greedy reads one by one when it weighs a few
    nodes; `arrays()` gives all as arrays, for when it weighs many."""

    __slots__ = ("chg", "rest", "after_id", "_empty", "_left", "_flex", "_table", "_in_table", "_ids_in_table")

    # rows of `_table`, which grows by doubling and takes the lists' new entries on `arrays()`
    _CHG, _EMPTY, _LEFT, _FLEX, _REST, _AFTER = range(6)

    def __init__(self) -> None:
        self.chg: list[int] = []
        # empty, leftover and flexibility packed into the greedy's tie-break key (see `rest_key`)
        self.rest: list[int] = []
        self.after_id: list[int] = []
        self._empty: list[int] = []
        self._left: list[int] = []
        self._flex: list[int] = []
        self._table = np.zeros((6, 64), dtype=np.int64)
        self._in_table = self._ids_in_table = 0

    @property
    def done(self) -> int:
        return len(self.chg)

    def add(self, option: Option | None) -> None:
        if option is None:
            chg, empty, left, flex = NO_OPTION, 0, 0, 0
        else:
            chg, empty, left, flex = option.cost
        self.chg.append(chg)
        self._empty.append(empty)
        self._left.append(left)
        self._flex.append(flex)
        self.rest.append(rest_key(empty, left, flex))

    def extend(self, chg: np.ndarray, empty: np.ndarray, left: np.ndarray, flex: np.ndarray) -> None:
        """Add the costs of several buckets (NO_OPTION changes, and 0s, where there is none)."""
        rest = (((empty << 20) + np.minimum(left, _LEFT_CAP)) << 12) + np.clip(flex + _FLEX_OFFSET, 0, _FLEX_CAP)
        self.chg += chg.tolist()
        self._empty += empty.tolist()
        self._left += left.tolist()
        self._flex += flex.tolist()
        self.rest += rest.tolist()

    def reset_ids(self) -> None:
        self.after_id = []
        self._ids_in_table = 0

    def arrays(self) -> CostArrays:
        n, n_ids = len(self.chg), len(self.after_id)
        size = self._table.shape[1]
        if max(n, n_ids) > size:
            while size < max(n, n_ids):
                size *= 2
            grown = np.zeros((6, size), dtype=np.int64)
            grown[:, : self._table.shape[1]] = self._table
            self._table = grown
        table = self._table
        if self._in_table < n:
            k = self._in_table
            for row, values in ((self._CHG, self.chg), (self._EMPTY, self._empty), (self._LEFT, self._left),
                                (self._FLEX, self._flex), (self._REST, self.rest)):
                table[row, k:n] = values[k:]
            self._in_table = n
        if self._ids_in_table < n_ids:
            table[self._AFTER, self._ids_in_table: n_ids] = self.after_id[self._ids_in_table:]
            self._ids_in_table = n_ids
        a = CostArrays()
        a.chg, a.empty, a.left, a.flex, a.rest = (table[row, :n] for row in range(self._AFTER))
        a.after_id = table[self._AFTER, :n_ids]
        return a


# widths of the fields of the greedy's tie-break key below the slot
_LEFT_CAP = (1 << 20) - 1
_FLEX_OFFSET, _FLEX_CAP = 2048, 4095


def rest_key(empty: int, left: int, flex: int) -> int:
    """A GPU's tie-break among options of equal changes and score, packed into one integer
    (lower is better) to be shifted left 4 bits and or-ed with its slot on the node: a GPU that
    hosts pods, the tightest fit, the most placements left."""
    return (((empty << 20) + min(left, _LEFT_CAP)) << 12) + min(max(flex + _FLEX_OFFSET, 0), _FLEX_CAP)


class NodeBest:
    """Per node, its best GPU for one slice kind under the objective (see `Greedy.best_single`):
    its top, `exact` or a lower bound (then no slot), and an upper bound of it (`high`; the top
    itself when exact), valid where `ok`; invalidated for a node when it changes."""

    __slots__ = ("top", "slot", "ok", "exact", "high")
    FIELDS = __slots__

    def __init__(self, n_nodes: int):
        self.top = np.full(n_nodes, NO_OPTION, dtype=np.int64)
        self.slot = np.zeros(n_nodes, dtype=np.int64)
        self.ok = np.zeros(n_nodes, dtype=bool)
        self.exact = np.zeros(n_nodes, dtype=bool)
        self.high = np.full(n_nodes, NO_OPTION, dtype=np.int64)

    def copy(self) -> NodeBest:
        c = NodeBest.__new__(NodeBest)
        for name in self.FIELDS:
            setattr(c, name, getattr(self, name).copy())
        return c

    def take(self, other: NodeBest, where: np.ndarray) -> None:
        """Copy `other`'s entries of the nodes `where` (a mask)."""
        for name in self.FIELDS:
            getattr(self, name)[where] = getattr(other, name)[where]


class GpuIndex:
    """Bucket ids of GPU states and the per-bucket option costs, per slice kind."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._ids: dict[Hashable, int] = {}
        self._reps: list[GpuState | None] = []
        self._costs: dict[SliceRef, AskCosts] = {}
        self._objective: Objective | None = None
        self._best: dict[tuple[SliceRef, bool], NodeBest] = {}
        # MIG buckets as array rows, per model, for `_mig_costs`: per bucket its model and row
        self._mig_rows: list[MigRows] = []
        self._model_index: dict[MigRules, int] = {}
        self._model_of: list[int] = []
        self._row_of: list[int] = []
        # padded (node, slot) -> gid matrix; the pad is gid len(gpus), a GPU with no options
        nodes = problem.nodes
        width = max((len(n.gpus) for n in nodes), default=0) or 1
        self.pad = len(problem.gpus)
        self.node_gpus = np.full((len(nodes), width), self.pad, dtype=np.int64)
        for n in nodes:
            self.node_gpus[n.idx, : len(n.gpus)] = n.gpus
        self.node_gpu_rows: list[list[int]] = self.node_gpus.tolist()
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

    def bucket(self, state: GpuState, as_is: bool = False) -> int:
        """`as_is`: the state is a GPU as it is, which planning never modifies (it copies a GPU
        before changing it), so it can stand for its bucket itself."""
        key = state.key()
        bid = self._ids.get(key)
        if bid is None:
            bid = self._new_bucket(key, state if as_is else state.clone())
        return bid

    def buckets(self, states: list[GpuState]) -> np.ndarray:
        """Bucket id of every GPU as it is, plus the pad's at the end."""
        return np.array([self.bucket(s, as_is=True) for s in states] + [self.PAD_BUCKET], dtype=np.int64)

    # --- costs per bucket ----------------------------------------------------------------------

    def costs(self, ask: SliceRef) -> AskCosts:
        """The costs of `ask`, complete for every bucket known now."""
        c = self._costs.get(ask)
        if c is None:
            c = self._costs[ask] = AskCosts()
        reps, obj = self._reps, self._objective
        if c.done < len(reps):
            if len(c.after_id) != c.done:
                obj = None  # classes behind (an objective set since): filled below
            if isinstance(ask, MigSliceRef) and len(reps) - c.done >= _BATCH:
                self._mig_costs(c, ask, obj)
            else:
                for rep in reps[c.done:]:
                    opt = rep.option(ask) if rep is not None else None
                    c.add(opt)
                    if obj is not None:
                        c.after_id.append(0 if opt is None else obj.class_id(class_after(rep, ask, opt)))
            obj = self._objective
        if obj is not None and len(c.after_id) < len(reps):
            # costs computed before this objective: the options again, for their classes
            for rep in reps[len(c.after_id):]:
                opt = rep.option(ask) if rep is not None else None
                c.after_id.append(0 if opt is None else obj.class_id(class_after(rep, ask, opt)))
        return c

    def _mig_costs(self, c: AskCosts, ask: MigSliceRef, obj: Objective | None) -> None:
        """`costs` of the buckets from `c.done` on, MIG ones with numpy (`MigRows`), model by
        model; their classes too (`obj`: None for costs only)."""
        reps, start = self._reps, c.done
        n = len(reps) - start
        self._add_rows()
        chg = np.full(n, NO_OPTION, dtype=np.int64)
        empty, left, flex, ids = (np.zeros(n, dtype=np.int64) for _ in range(4))
        row_of = np.array(self._row_of[start:], dtype=np.int64)
        model_of = np.array(self._model_of[start:], dtype=np.int64)
        for k in np.flatnonzero(model_of < 0).tolist():  # not a MIG GPU
            rep = reps[start + k]
            opt = rep.option(ask) if rep is not None else None
            if opt is not None:
                chg[k], empty[k], left[k], flex[k] = opt.cost
                if obj is not None:
                    ids[k] = obj.class_id(class_after(rep, ask, opt))
        for m, rows in enumerate(self._mig_rows):
            p = rows.rules.index.get(ask.profile)
            at = np.flatnonzero(model_of == m)
            if p is None or not len(at):
                continue
            found, chg_r, empty_r, left_r, flex_r, start_r = rows.costs(row_of[at], p)
            at = at[found]
            chg[at], empty[at], left[at], flex[at] = chg_r[found], empty_r[found], left_r[found], flex_r[found]
            if obj is not None:
                codes = (rows.codes(row_of[at]) + (p + 1) * (len(rows.rules.memory) + 1) ** start_r[found])
                uniq, inverse = np.unique(codes, return_inverse=True)
                ids[at] = np.array([obj.class_id(mig_class(rows.rules, code)) for code in uniq.tolist()],
                                   dtype=np.int64)[inverse]
        c.extend(chg, empty, left, flex)
        if obj is not None:
            c.after_id += ids.tolist()

    def _add_rows(self) -> None:
        """A `MigRows` row for every MIG bucket known now (the new ones of each model at once)."""
        new: list[list[MigState]] = [[] for _ in self._mig_rows]  # per model, its new buckets
        for rep in self._reps[len(self._row_of):]:
            if isinstance(rep, MigState):
                m = self._model_index.get(rep.rules)
                if m is None:
                    m = self._model_index[rep.rules] = len(self._mig_rows)
                    self._mig_rows.append(MigRows(rep.rules))
                    new.append([])
                self._row_of.append(self._mig_rows[m].count + len(new[m]))
                new[m].append(rep)
                self._model_of.append(m)
            else:
                self._row_of.append(-1)
                self._model_of.append(-1)
        for rows, states in zip(self._mig_rows, new):
            rows.add(states)

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
                c.reset_ids()

    def classes(self, states: list[GpuState], bid: np.ndarray | None = None) -> np.ndarray:
        """The capacity class id of every GPU (and 0 for the pad); with the GPUs' bucket ids,
        computed once per bucket (a bucket's states share their class)."""
        obj = self._objective
        assert obj is not None
        if bid is None:
            return np.array([obj.class_id(capacity_class(s)) for s in states] + [0], dtype=np.int64)
        uniq, first = np.unique(bid[:-1], return_index=True)
        per = np.zeros(int(uniq.max()) + 1 if len(uniq) else 1, dtype=np.int64)
        # a MIG bucket's class from its row's code (`MigRows`, which the costs need anyway)
        self._add_rows()
        model_of = np.array(self._model_of, dtype=np.int64)[uniq]
        row_of = np.array(self._row_of, dtype=np.int64)[uniq]
        codes = np.zeros(len(uniq), dtype=np.int64)
        for m, rows in enumerate(self._mig_rows):
            at = np.flatnonzero(model_of == m)
            codes[at] = rows.codes(row_of[at])
        # buckets that differ in free instances only share their class: asked for once per (model,
        # code), in the order of the buckets (that of the new classes' ids); others once each
        key = np.where(model_of >= 0, model_of * (int(codes.max(initial=0)) + 1) + codes, -1 - np.arange(len(uniq)))
        _, at, inverse = np.unique(key, return_index=True, return_inverse=True)
        rules = [rows.rules for rows in self._mig_rows]
        ids = np.zeros(len(at), dtype=np.int64)
        model_list, code_list, first_list = model_of.tolist(), codes.tolist(), first.tolist()
        order = np.argsort(at)
        for j, i in zip(order.tolist(), at[order].tolist()):
            m = model_list[i]
            ids[j] = obj.class_id(mig_class(rules[m], code_list[i]) if m >= 0 else capacity_class(states[first_list[i]]))
        per[uniq] = ids[inverse.reshape(-1)]
        out: np.ndarray = np.append(per[bid[:-1]], 0)
        return out


class PlanCache:
    """What a plan starts from, kept by a `PlanningSession` between plans (or built for one plan):
    every GPU's state as it is, its bucket and capacity-class ids, and the objective (with the
    nodes' terms and rooms of `cpu`/`mem` under it, where the session keeps them)."""

    def __init__(self, problem: Problem, states: list[GpuState], index: GpuIndex, bid: np.ndarray,
                 objective: Objective, cls: np.ndarray | None, occupied: int | None = None,
                 cpu: np.ndarray | None = None, mem: np.ndarray | None = None, terms: NodeTerms | None = None,
                 rooms: NodeRooms | None = None):
        self.cpu = cpu if cpu is not None else np.array([n.cpu_free for n in problem.nodes], dtype=np.int64)
        self.mem = mem if mem is not None else np.array([n.mem_free for n in problem.nodes], dtype=np.int64)
        self.states = states
        self.terms = terms
        self.rooms = rooms
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
        objective = Objective(problem.workload, problem.nodes, node_caps(problem.nodes, problem.gpus))
        return cls(problem, states, index, index.buckets(states), objective, None)
