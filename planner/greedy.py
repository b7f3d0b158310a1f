"""Deterministic greedy: the warm start of the exact solver, and the answer when the instance is
too large to solve exactly or the time limit hits.

Pods are placed one by one (`request_order`), each on the option that is best by the plan's
objective, lexicographically:
1. fewest changes (free slices destroyed, plus one for a GPU not reconfigured yet);
2. the least rise of the expected unusable capacity under the request distribution
   (planner/objective.py), as the FGD plugin's whole-point score (`Objective.score`);
3. a GPU that already hosts pods (consolidation), the tightest fit, the most placements left
   in the GPU's free MIG memory slices; then the node and GPU order.
GPUs share buckets (planner/index.py) whose option costs are computed once, and the objective
is a table lookup per GPU. Each node's best option per slice kind is kept until the node
changes; a one-slice pod takes the least of them from a heap per slice kind (with whole-point
scores, most nodes tie and the first in order that fits wins), or by numpy passes over its
candidates while the kind has had few pods. A pod asking for several slices is weighed per
node on its cheapest GPUs, then placed slice by slice on the best node that really holds them.
Pods kept apart (`Request.apart`) lose, as one of them is placed, that node from the others'
candidates (a narrowed copy of the request, with a candidate array of its own).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from heapq import heapify, heappop, heappush
from itertools import islice
from typing import cast

import numpy as np

from dynpart.planner.index import NO_OPTION, AskCosts, CostArrays, GpuIndex, NodeBest
from dynpart.planner.objective import (
    FEED_MEMORY,
    SCORE_MIN,
    NodeRooms,
    NodeTerms,
    Objective,
    capacity_class,
    numpy_sum,
    room,
    rooms,
    slice_share,
)
from dynpart.planner.problem import KIND_GPU, Problem, Request
from dynpart.planner.state import GpuState, new_state
from dynpart.planner.types import Assignment, Option, Placements, SliceRef

# how many nodes a multi-slice pod tries before giving up
_MULTI_SLICE_NODE_TRIES = 64

# packing of (changes, score) into one integer (scores are -100..0)
_TOP_SCALE = 256
_SCORE_OFFSET = 128
_TOP_CAP = (1 << 25) - 1

# one slice of a placed pod: the GPU and how it hosts the slice
_Pick = tuple[int, Option]

# up to this many nodes are weighed in plain Python, more with numpy (whose fixed cost per call
# is that of weighing a few dozen nodes in Python); both give the same results bit for bit
SCALAR_NODES = 12

# below this many changes, a GPU with more changes than another never wins (scores are -100..0)
_FEW_CHANGES = 1 << 16

# pods of one slice kind weighed by scanning every candidate before the kind's nodes are kept in
# a heap, where the plan has no more one-slice pods of the kind (building it costs what a few scans
# do; a plan of a few pods never builds one); a plan with more builds it for its first pod (on
# `dynpart bench planner`, 1,000 nodes, 2,000 pods, the first 8 scans of each of its 7 kinds
# weighed 3,600 nodes, and 2,400 at the steps the pods move them to: with the heaps from the
# first pod, 1,200 fewer nodes weighed per plan, 2% faster, the same plans)
_HEAP_AFTER = 8

# entries a pod pops from the heap, among them nodes that cannot host it, before it is weighed by
# a scan instead (its candidates are few, or short of CPU or memory where the others could win)
_HEAP_POPS = 48

# nodes of one bound weighed together when the heap pops one (with numpy past SCALAR_NODES)
_HEAP_BATCH = 256

# a one-slice pod whose candidates are fewer than the nodes over this is weighed by the scan: on
# more, the heap finds a candidate within a few pops (and gives up after _HEAP_POPS). With 2 (half
# the nodes), the pods of one zone of three (`dynpart bench planner`: 5% of its pods) took the
# scan, which weighs the candidates their CPU moves by the thousand: with 4, 1,400 fewer nodes
# weighed per plan, 3% faster, the same plans
_FEW_CANDIDATES = 4

# nodes a pod moves to other steps of the objective's tables weighed first by the scan, then twice
# as many each time while they can still win (`_weigh_moved_lazily`)
_MOVED_FIRST = 8

# the most CPU buckets of one plan (`cpu_buckets`): each is a heap per slice kind, refreshed
# for every node a pod changes. Fewer buckets, fewer refreshes but looser keys: on `dynpart bench
# planner` (1,000 nodes, 2,000 pods, runs interleaved) 4 plan about 2.5% faster than 8, 2 about 1%
# slower than 4, 1 about 4% slower than 8 (the same plans: the buckets decide what is weighed,
# not the option)
_BUCKETS_MAX = 4

# what `_best_single_heap` returns when it leaves the pod to the scan
_GAVE_UP = object()

# per whole-point score s (negated: 0..98), the ΔF at which 100 sigmoid(-ΔF) is s + 1
_LOG_ODDS = [math.log(100.0 / (points + 1) - 1.0) for points in range(99)]

# the lowest top with no change: a score of SCORE_MIN
_LOW = _SCORE_OFFSET + SCORE_MIN

_NOTHING_KEPT: dict[tuple[int, int], tuple[int, int]] = {}
_NO_SCORES: dict[tuple[int, int], int] = {}


class _NodeView:
    """One node as the greedy's plain-Python path reads it: its GPUs' buckets and, under an
    objective, their classes and the node's terms at some steps of the objective's tables, with
    what the multi-slice kinds use of it per kind (`room`, where a GPU's class moves no
    coverage: covm + 0.0 is covm, its sums of values >= 0 being never -0.0). `firsts`: (slot,
    bucket) of the first GPU of each bucket (and class): the node's other GPUs of a bucket
    weigh the same for any kind and lose to it on the slot."""

    __slots__ = ("node", "bids", "firsts", "classes", "f", "free", "single", "ic", "im", "row", "covm", "hostm", "wm",
                 "room", "room_sum")

    def __init__(self, greedy: Greedy, n: int, steps: tuple[int, int] | None):
        self.node = n
        self.bids: list[int] = greedy.bid_rows[n]
        obj, terms = greedy.objective, greedy.terms
        if obj is None or terms is None:
            self.firsts = _firsts(self.bids, self.bids)
            return
        self.classes: list[int] = greedy.cls_rows[n]
        self.firsts = _firsts(self.bids, self.classes)
        self.f, self.free, single, ic, im, covm, hostm = terms.one(obj, n, self.classes, greedy.cpu_of[n],
                                                                   greedy.mem_of[n])
        if steps is None:
            self.ic, self.im = ic, im
            self.row = obj.crow_list[self.ic]
            self.single = single
        else:
            self.ic, self.im = steps
            self.row = obj.crow_list[self.ic]
            self.single = numpy_sum([obj.usable_of[c][self.row][self.im] for c in self.classes])
        if obj.multi:
            self.covm: list[float] = covm
            self.hostm: list[int] = hostm
            self.wm: list[float] = obj.wm_rows[self.row][self.im]
            self.room = [w * (self.covm[col] * (self.hostm[col] >= count))
                         for w, col, count in zip(self.wm, obj.multi_cols, obj.multi_counts)]
            self.room_sum = numpy_sum(self.room)


def _firsts(bids: list[int], classes: list[int]) -> list[tuple[int, int]]:
    """(slot, bucket) of the first slot of each distinct (bucket, class) pair."""
    seen: set[tuple[int, int]] = set()
    out = []
    for k, pair in enumerate(zip(bids, classes)):
        if pair not in seen:
            seen.add(pair)
            out.append((k, pair[0]))
    return out


class _NodeHeap:
    """One slice kind's nodes by their `NodeBest` top (exact or a lower bound), as a heap of
    (top, node), for `Greedy.best_single`. Lazy: an entry holds while the node's entry is valid
    and has that top (stale ones are dropped as they pop); every node whose entry is valid has
    a current one, but for those that cannot host the kind; `stale`: the nodes whose entry is
    not valid, whose bounds the next pod computes."""

    __slots__ = ("entries", "stale")

    def __init__(self, cache: NodeBest):
        ok = np.flatnonzero(cache.ok & (cache.top < NO_OPTION))
        self.entries: list[tuple[int, int]] = list(zip(cache.top[ok].tolist(), ok.tolist()))
        heapify(self.entries)
        self.stale: set[int] = set(np.flatnonzero(~cache.ok).tolist())

    def push(self, top: int, node: int) -> None:
        if top < NO_OPTION:
            heappush(self.entries, (top, node))

    def push_many(self, tops: list[int], nodes: list[int]) -> None:
        _push_options(self.entries, tops, nodes)


def _push_options(heap: list[tuple[int, int]], tops: list[int], nodes: list[int]) -> None:
    """Push (top, node) of the nodes that have an option."""
    for top, node in zip(tops, nodes):
        if top < NO_OPTION:
            heappush(heap, (top, node))


class _BucketHeap:
    """One slice kind's nodes by their top for a pod taking a CPU bucket's CPU (and no memory):
    `key` per node, `exact` or a lower bound, with the best GPU's `slot` where exact. Two lazy
    heaps of (key, node), each packed into one integer, key << `shift` | node (ordered as the
    pairs, and cheaper to compare): `entries`, the exact keys; `bounds`, the bounds, weighed in
    batches when they could win (so that a batch pops no exact entry of the same key). An entry holds
    while the node is not `stale` and its key and exactness are the entry's. A pod of the
    bucket or above pops the few nodes that can win: a node's top for it is at least its key
    (a pod that takes more never gets a lower top), the key itself where the pod moves the node
    to the same steps as the bucket does."""

    __slots__ = ("entries", "bounds", "stale", "key", "exact", "slot", "shift")

    def __init__(self, cache: NodeBest):
        # the node's top at its own steps (exact or a bound) bounds its top at any bucket; lists,
        # not arrays: the heaps read and write them one node at a time
        key = np.where(cache.ok, cache.top, NO_OPTION)
        self.key: list[int] = key.tolist()
        self.exact: list[bool] = [False] * len(self.key)
        self.slot: list[int] = [0] * len(self.key)
        self.shift = max(1, len(self.key)).bit_length()
        ok = np.flatnonzero(cache.ok & (cache.top < NO_OPTION))
        shift = self.shift
        self.entries: list[int] = []
        self.bounds: list[int] = [k << shift | n for k, n in zip(key[ok].tolist(), ok.tolist())]
        heapify(self.bounds)
        self.stale: set[int] = set(np.flatnonzero(~cache.ok).tolist())

    def push_many(self, tops: list[int], nodes: list[int]) -> None:
        """Push the exact entries of the nodes that have an option."""
        entries, shift = self.entries, self.shift
        for top, node in zip(tops, nodes):
            if top < NO_OPTION:
                heappush(entries, top << shift | node)


class _NodeRank:
    """Per node, how it hosts a pod of `count` slices of one kind (see `Greedy.ranked_nodes`):
    whether it can and the changes on its cheapest GPUs, valid where `ok`, and the score, valid
    where `q_ok`."""

    __slots__ = ("fits", "chg", "q", "ok", "q_ok", "moved_q", "changed")

    def __init__(self, n_nodes: int):
        self.fits = np.zeros(n_nodes, dtype=bool)
        self.chg = np.zeros(n_nodes, dtype=np.int64)
        self.q = np.zeros(n_nodes, dtype=np.int64)
        self.ok = np.zeros(n_nodes, dtype=bool)  # fits and chg
        self.q_ok = np.zeros(n_nodes, dtype=bool)
        # per node, the score where the pod moves it to other steps: (CPU step, memory step) -> q
        self.moved_q: dict[int, dict[tuple[int, int], int]] = {}
        # nodes changed since the ranking was last read: invalidated then (a plan changes a node
        # per pod, and has a ranking per multi-slice kind and count)
        self.changed: set[int] = set()

    def forget_changed(self) -> None:
        if self.changed:
            gone = list(self.changed)
            self.changed.clear()
            self.ok[gone] = self.q_ok[gone] = False
            for n in gone:
                self.moved_q.pop(n, None)


def _size(r: Request) -> float:
    if r.kind == KIND_GPU:
        return float(r.count) * 1e6
    return float(r.size * r.count)


def request_order(problem: Problem) -> list[Request]:
    """Higher priority first; then smaller requests first (most pods placed); then input order."""
    return sorted(problem.requests, key=lambda r: (-r.priority, _size(r), r.idx))


def arrival_order(problem: Problem) -> list[Request]:
    """Higher priority first; then the order of the snapshot's pending list (the order pods
    arrived in: first come, first served). Measured on the openb packing benchmark with batches
    of 32, against largest first: +0.5 points of allocation."""
    return sorted(problem.requests, key=lambda r: (-r.priority, r.idx))


def cpu_buckets(requests: list[Request]) -> list[int]:
    """The CPU buckets of the pods of a plan: their distinct positive CPU requests, or
    _BUCKETS_MAX of them spread over the sorted list when they are more. (Leaving the small
    requests to the heap of the nodes' own steps was slower: on a CPU-short cluster the nodes
    gather just above a step of the stranding grid, where a pod of 500 millicores moves a third
    of them.)"""
    values = sorted({r.cpu for r in requests if r.cpu > 0})
    if len(values) <= _BUCKETS_MAX:
        return values
    return sorted({values[i * len(values) // _BUCKETS_MAX] for i in range(_BUCKETS_MAX)})


class Greedy:
    def __init__(self, problem: Problem, states: list[GpuState] | None = None, objective: Objective | None = None,
                 index: GpuIndex | None = None, bid: np.ndarray | None = None, cls: np.ndarray | None = None,
                 cpu: np.ndarray | None = None, mem: np.ndarray | None = None, count_changes: bool = True,
                 terms: NodeTerms | None = None, node_rooms: NodeRooms | None = None):
        """`states` (default: every GPU as it is) are not modified: a GPU the plan changes is
        copied first. `bid`/`cls` are the states' bucket and class ids when the caller keeps them;
        `node_rooms`, the rooms of `cpu` and `mem` under `objective`, when the caller keeps them."""
        self.problem = problem
        self.count_changes = count_changes
        self.base: list[GpuState] = states if states is not None else [new_state(g) for g in problem.gpus]
        self.states: list[GpuState] = list(self.base)
        self.touched: set[int] = set()
        self.objective = objective if objective is not None and objective.active else None
        self.index = index if index is not None else GpuIndex(problem)
        self.index.use_objective(self.objective)
        self.bid = (bid if bid is not None else self.index.buckets(self.states)).copy()
        self.cls = None
        self.terms: NodeTerms | None = None
        self._base_terms = terms
        if self.objective is not None:
            self.cls = (cls if cls is not None else self.index.classes(self.states)).copy()
            self.terms = terms.copy() if terms is not None else NodeTerms(self.objective, len(problem.nodes))
        self.base_cpu = cpu if cpu is not None else np.array([n.cpu_free for n in problem.nodes], dtype=np.int64)
        self.base_mem = mem if mem is not None else np.array([n.mem_free for n in problem.nodes], dtype=np.int64)
        self.cpu = self.base_cpu.copy()
        self.mem = self.base_mem.copy()
        # each node's GPUs' buckets and classes, as lists (`_NodeView`), until the node changes
        self.bid_rows: list[list[int]] = self.bid[self.index.node_gpus].tolist()
        self.cls_rows: list[list[int]] = self.cls[self.index.node_gpus].tolist() if self.cls is not None else []
        # the same as lists, for the paths that read one node at a time (a list's item costs a
        # fraction of an array's)
        self.cpu_of: list[int] = self.cpu.tolist()
        self.mem_of: list[int] = self.mem.tolist()
        self.base_bid = self.bid.copy()
        self.placement: dict[int, tuple[int, list[_Pick]]] = {}
        self.changed_nodes: set[int] = set()
        self._best: dict[SliceRef, NodeBest] = {}
        self._ranks: dict[tuple[SliceRef, int], _NodeRank] = {}
        self._heaps: dict[SliceRef, _NodeHeap] = {}
        # the slice kinds past the scans (`_HEAP_AFTER`): their pods take the heaps; the kind's
        # own heap is built (from its `NodeBest`, as it would stand had it been kept all along)
        # for the first pod of CPU bucket 0, which alone pops it
        self._heaped: set[SliceRef] = set()
        self._scans: dict[SliceRef, int] = {}
        self._singles = Counter(r.slice_ref for r in problem.requests if r.count == 1)  # one-slice pods per kind
        self._masks: dict[int, tuple[np.ndarray, list[bool]]] = {}
        # per slice kind and node, the node's best GPU when the pod moves it to other steps of the
        # objective's tables: (CPU step, memory step) -> (top, slot), until the node changes
        self._moved_best: dict[SliceRef, dict[int, dict[tuple[int, int], tuple[int, int]]]] = {}
        self._views: dict[int, dict[tuple[int, int] | None, _NodeView]] = {}
        # requests that found no option since the last commit, by `_ask_key` (with their candidate
        # array, kept alive so that its id is not reused): an equal request finds none either
        # until a commit changes the cluster (a backlog of equal pods weighed once per commit,
        # not once each); and `fits_alone` per `_ask_key`, which reads the cluster as it was
        self._failed: dict[tuple[SliceRef, int, int, int, int], np.ndarray] = {}
        self._alone: dict[tuple[SliceRef, int, int, int, int], tuple[np.ndarray, bool]] = {}
        # pods kept apart (`Request.apart`): per request, the nodes its placed partners took, and
        # the request with those left out of its candidates (how many, the narrowed copy: a new
        # candidate array, so the caches above keyed by its id never mix it with the original's)
        self._apart_off: dict[int, list[int]] = {}
        self._apart_req: dict[int, tuple[int, Request]] = {}
        self._cpu_steps: list[int] = []
        self._mem_steps: list[int] = []
        # under the stranding term, the pods' CPU in a few buckets, and per slice kind and
        # bucket a heap of the nodes by their top for a pod taking the bucket's CPU
        # (`_best_single_bucket`)
        self._buckets: list[int] = []
        self._bucket_heaps: dict[tuple[SliceRef, int], _BucketHeap] = {}
        self._free_gpus: dict[int, float] = {}  # per node, its GPUs' free share (`_free_share`)
        self._strand_below: dict[int, float] = {}  # per node, the free CPU below which it strands
        self._feeds: dict[int, tuple[float, float, dict[int, float]]] = {}  # per node, `_node_feeds`
        self._shares: dict[tuple[SliceRef, int], float] = {}  # `_slice_share` per feed class
        if self.objective is not None:
            # rooms in the kinds' steps, and in every step (`grid_room`): a pod that crosses
            # only a step of the stranding grid moves F where `Objective.strands` only
            self._cpu_steps, self._mem_steps = self.objective.kind_cpu_step_list, self.objective.kind_mem_step_list
            if self.objective.feeds:
                self._buckets = cpu_buckets(problem.requests)
            if node_rooms is not None:
                self.cpu_room, self.mem_room = node_rooms.cpu.copy(), node_rooms.mem.copy()
                self.grid_room = node_rooms.grid.copy()
            else:
                self.cpu_room = rooms(self.cpu, self.objective.kind_cpu_steps)
                self.mem_room = rooms(self.mem, self.objective.kind_mem_steps)
                self.grid_room = rooms(self.cpu, self.objective.cpu_steps)
            self.cpu_room_of: list[int] = self.cpu_room.tolist()
            self.mem_room_of: list[int] = self.mem_room.tolist()
            self.grid_room_of: list[int] = self.grid_room.tolist()

    def placements(self) -> Placements:
        return {idx: Assignment(node, tuple(gid for gid, _ in picks)) for idx, (node, picks) in self.placement.items()}

    # --- weighing the options ------------------------------------------------------------------

    def _candidates(self, req: Request, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
        cand = req.candidate_array()
        if not len(cand):
            return cand
        fit = (cpu[cand] >= req.cpu) & (mem[cand] >= req.mem)
        if fit.all():  # the usual case: no copy
            return cand
        fits: np.ndarray = cand[fit]
        return fits

    def _delta(self, nodes: np.ndarray, slots: np.ndarray, after: np.ndarray, cpu: int | np.ndarray,
               mem: int | np.ndarray) -> np.ndarray:
        """Rise of the expected unusable capacity for each row: a node, the GPU slots (R, k) the
        pod takes there and the classes (R, k) they move to. F of a node is kept (`NodeTerms`);
        the change is computed from the changed GPUs alone when the pod's CPU and memory leave
        the node on the same steps of the distribution's tables, else in full."""
        obj, terms = self.objective, self.terms
        assert obj is not None and self.cls is not None and terms is not None
        node_gpus = self.index.node_gpus
        if not terms.ok[nodes].all():
            terms.ensure(obj, nodes, self.cls[node_gpus[nodes]], self.cpu[nodes], self.mem[nodes])
        rows = np.arange(len(nodes))[:, None]
        before = self.cls[node_gpus[nodes][rows, slots]]  # (R, k)
        ic2, im2 = obj.steps(nodes, self.cpu[nodes] - cpu, self.mem[nodes] - mem)
        free, cov, usable = obj.tables()
        # what the one-slice kinds can use of the node's other GPUs at the new steps: kept when
        # the steps do not move, gathered again when they do
        single = terms.single[nodes].copy()
        rc, rm = obj.rows(ic2, im2)
        moved = np.flatnonzero((ic2 != terms.ic[nodes]) | (im2 != terms.im[nodes]))
        if len(moved):
            single[moved] = usable[rc[moved, None], rm[moved, None], self.cls[node_gpus[nodes[moved]]]].sum(axis=1)
        single += (usable[rc[:, None], rm[:, None], after] - usable[rc[:, None], rm[:, None], before]).sum(axis=1)
        free_after = terms.free[nodes] + (free[after] - free[before]).sum(axis=1)
        f_after = free_after - single
        if obj.multi:
            ca, cb = cov[after], cov[before]  # (R, k, Rm)
            covm2 = terms.covm[nodes] + (ca - cb).sum(axis=1)
            took = obj.slot_table()
            hostm2 = terms.hostm[nodes] + (took[after] - took[before]).sum(axis=1)
            f_after -= obj.multi_room(ic2, im2, covm2, hostm2)
        if obj.feeds:
            f_after += obj.stranded(nodes, free_after, ic2, im2)
        delta: np.ndarray = f_after - terms.f[nodes]
        return delta

    def _changes(self, chg: np.ndarray) -> np.ndarray:
        return chg if self.count_changes else np.where(chg < NO_OPTION, 0, NO_OPTION)

    def _node_best(self, costs: CostArrays, nodes: np.ndarray, cpu: int | np.ndarray,
                   mem: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each node, its best GPU for one slice of the ask: (top, slot), top = changes and
        score packed (NO_OPTION when no GPU of the node can host it); within the node the best
        by (changes, score, GPU hosting pods, tightest fit, MIG placements left, slot).
        `cpu`/`mem`: what the pod takes of the node (0: as if its CPU and memory moved no step)."""
        gids = self.index.node_gpus[nodes]  # (S, W)
        b = self.bid[gids]
        chg = self._changes(costs.chg[b])
        valid = chg < NO_OPTION
        score = np.zeros(chg.shape, dtype=np.int64)
        if self.objective is not None and valid.any():
            r, k = np.nonzero(valid)
            take_cpu = cpu[r] if isinstance(cpu, np.ndarray) else cpu
            take_mem = mem[r] if isinstance(mem, np.ndarray) else mem
            score[r, k] = Objective.score(self._delta(nodes[r], k[:, None], costs.after_id[b[r, k]][:, None],
                                                      take_cpu, take_mem))
        top = np.where(valid, chg * _TOP_SCALE + score + _SCORE_OFFSET, NO_OPTION)
        slots = np.arange(gids.shape[1], dtype=np.int64)[None, :]
        key = np.where(valid, (np.minimum(top, _TOP_CAP) << 37) + (costs.rest[b] << 4 | slots), NO_OPTION)
        pick = key.argmin(axis=1)
        rows = np.arange(len(nodes))
        return top[rows, pick], pick

    def _node_best_scalar(self, costs: AskCosts, nodes: list[int],
                          steps: list[tuple[int, int]] | None) -> tuple[list[int], list[int]]:
        """`_node_best` in plain Python, for a few nodes: the same integer and float operations
        in the same order (`numpy_sum` where numpy sums), so the same results bit for bit.
        `steps`: per node, the CPU and memory steps the pod moves it to (None: it moves none).
        Only the GPUs with the node's fewest changes are scored: a score (-100..0) never makes
        up for one more change; and only the first of each bucket (`_NodeView.firsts`)."""
        chg_of, rest_of = costs.chg, costs.rest
        count_changes = self.count_changes
        # per node: the slots that can win, as (slot, changes, rest key, bucket)
        options: list[list[tuple[int, int, int, int]]] = []
        deltas: list[float] = []
        for pos, n in enumerate(nodes):
            view = self._view(n, None if steps is None else steps[pos])
            valid = [(k, chg_of[b] if count_changes else 0, rest_of[b], b) for k, b in view.firsts
                     if chg_of[b] < NO_OPTION]
            if valid:
                if len(valid) > 1:
                    least = min([v[1] for v in valid])
                    if least < _FEW_CHANGES:
                        valid = [v for v in valid if v[1] == least]
                if self.objective is not None:
                    self._deltas_scalar(costs, view, valid, deltas)
            options.append(valid)
        scores = self.objective.scores(deltas) if self.objective is not None and deltas else []
        tops, slots = [], []
        i = 0
        for valid in options:
            # the least key, as `_node_best`'s argmin (the keys of a node's slots differ)
            best_key, best_top, best_slot = NO_OPTION, NO_OPTION, 0
            for k, chg, rest, _ in valid:
                top = chg * _TOP_SCALE + (scores[i] if scores else 0) + _SCORE_OFFSET
                key = (min(top, _TOP_CAP) << 37) + (rest << 4 | k)
                if key < best_key:
                    best_key, best_top, best_slot = key, top, k
                i += 1
            tops.append(best_top)
            slots.append(best_slot)
        return tops, slots

    def _view(self, n: int, steps: tuple[int, int] | None) -> _NodeView:
        """Node n as the plain-Python path reads it, at its own steps of the objective's tables
        or at `steps`; kept until the node changes."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = {}
        view = views.get(steps)
        if view is None:
            view = views[steps] = _NodeView(self, n, steps)
        return view

    def _deltas_scalar(self, costs: AskCosts, view: _NodeView, valid: list[tuple[int, int, int, int]],
                       deltas: list[float]) -> None:
        """`_delta` of the node for the slots `valid` (slot, changes, rest key, bucket), one row
        at a time, appended to `deltas`."""
        obj = self.objective
        assert obj is not None
        usable_of, transition = obj.usable_of, obj.transition
        after_of, classes, im, row = costs.after_id, view.classes, view.im, view.row
        multi, feeds = bool(obj.multi), obj.feeds
        for k, _, _, b in valid:
            before, after = classes[k], after_of[b]
            single = view.single + (usable_of[after][row][im] - usable_of[before][row][im])
            dfree, moved = transition(before, after)
            free_after = view.free + dfree
            f_after = free_after - single
            if multi:
                if moved:
                    covm, hostm, wm = view.covm, view.hostm, view.wm
                    mine = list(view.room)
                    for j, col, dcov, dslots, count in moved:
                        mine[j] = wm[j] * ((covm[col] + dcov) * (hostm[col] + dslots >= count))
                    f_after -= numpy_sum(mine)
                else:
                    f_after -= view.room_sum
            if feeds:
                f_after += obj.stranded_one(view.node, free_after, view.ic, im)
            deltas.append(f_after - view.f)

    def _weigh(self, costs: AskCosts, nodes: np.ndarray) -> tuple[np.ndarray | list[int], np.ndarray | list[int]]:
        """(top, slot) of `nodes` for one slice of the ask, the pod's CPU and memory moving none
        of them to other steps of the objective's tables."""
        if len(nodes) <= SCALAR_NODES:
            return self._node_best_scalar(costs, nodes.tolist(), None)
        return self._node_best(costs.arrays(), nodes, 0, 0)

    def _weigh_moved(self, costs: AskCosts, ask: SliceRef, nodes: list[int], cpu: int,
                     mem: int) -> tuple[list[int], list[int]]:
        """(top, slot) of `nodes` for one slice of the ask, where the pod's CPU or memory (`cpu`,
        `mem`) move the node to other steps; kept per node and steps until the node changes.
        Computed one way at any steps (tables monotonic in the steps, sums in one order), so a
        pod that takes more never gets a lower top: the bucket heaps' keys bound the tops of the
        pods above their bucket (`_best_single_bucket`)."""
        obj = self.objective
        assert obj is not None
        kept = self._moved_best.get(ask)
        if kept is None:
            kept = self._moved_best[ask] = {}
        steps: list[tuple[int, int]]
        if len(nodes) <= SCALAR_NODES:  # mostly one node, popped from a heap: numpy's calls cost more
            free_cpu, free_mem = self.cpu_of, self.mem_of
            steps = [obj.step_one(n, free_cpu[n] - cpu, free_mem[n] - mem) for n in nodes]
        else:
            at = np.array(nodes, dtype=np.int64)
            ic, im = obj.steps(at, self.cpu[at] - cpu, self.mem[at] - mem)
            steps = list(zip(ic.tolist(), im.tolist()))
        tops, slots = [0] * len(nodes), [0] * len(nodes)
        missing: list[int] = []
        for i, (n, key) in enumerate(zip(nodes, steps)):
            hit = kept.get(n, _NOTHING_KEPT).get(key)
            if hit is None:
                missing.append(i)
            else:
                tops[i], slots[i] = hit
        if missing:
            miss_nodes = [nodes[i] for i in missing]
            if len(missing) <= SCALAR_NODES:
                t, k = self._node_best_scalar(costs, miss_nodes, [steps[i] for i in missing])
            else:
                ta, ka = self._node_best(costs.arrays(), np.array(miss_nodes, dtype=np.int64), cpu, mem)
                t, k = ta.tolist(), ka.tolist()
            if cpu >= 0 and mem >= 0:
                # less CPU or memory left never leaves a node more usable: its top at its own
                # steps (summed another way) is a floor, which the floats' roundings could cross
                # by a point
                t = [max(a, b) for a, b in zip(t, self._own_tops(costs, ask, miss_nodes))]
            for i, n, top, slot in zip(missing, miss_nodes, t, k):
                tops[i], slots[i] = top, slot
                mine = kept.get(n)
                if mine is None:
                    mine = kept[n] = {}
                mine[steps[i]] = (top, slot)
        return tops, slots

    def _weigh_moved_one(self, costs: AskCosts, n: int, req: Request) -> tuple[int, int]:
        """`_weigh_moved` of one node (the heap pops them one at a time, a dozen per pod on a
        crowded cluster), its kept (top, slot) read without building lists."""
        assert self.objective is not None
        kept = self._moved_best.get(req.slice_ref)
        if kept is not None and (mine := kept.get(n)) is not None:
            hit = mine.get(self.objective.step_one(n, self.cpu_of[n] - req.cpu, self.mem_of[n] - req.mem))
            if hit is not None:
                return hit
        tops, slots = self._weigh_moved(costs, req.slice_ref, [n], req.cpu, req.mem)
        return tops[0], slots[0]

    def _own_tops(self, costs: AskCosts, ask: SliceRef, nodes: list[int]) -> list[int]:
        """Each node's exact top at its own steps, weighed where it is only bounded or not valid."""
        return self._own_best(costs, ask, nodes)[0]

    def _own_best(self, costs: AskCosts, ask: SliceRef, nodes: list[int]) -> tuple[list[int], list[int]]:
        """`_own_tops`, and each node's best slot there."""
        cache = self._ask_cache(ask)
        ok, exact = cache.ok, cache.exact
        need = [n for n in nodes if not (ok[n] and exact[n])]
        if need:
            at = np.array(need, dtype=np.int64)
            tops, slots = self._weigh(costs, at)
            cache.top[at] = cache.high[at] = tops
            cache.slot[at] = slots
            cache.ok[at] = cache.exact[at] = True
            heap = self._heaps.get(ask)
            if heap is not None:
                heap.push_many(list(tops), need)
        return cache.top[nodes].tolist(), cache.slot[nodes].tolist()

    def _moves(self, req: Request, cand: np.ndarray) -> np.ndarray | None:
        """Mask of the candidates whose steps of the objective's CPU and memory tables the pod
        moves (their F changes by the pod's own CPU and memory); None when it moves none."""
        if self.objective is None or not (req.cpu or req.mem):
            return None
        if req.cpu < 0 or req.mem < 0:
            ic, im = self.objective.steps(cand, self.cpu[cand], self.mem[cand])
            ic2, im2 = self.objective.steps(cand, self.cpu[cand] - req.cpu, self.mem[cand] - req.mem)
            moves: np.ndarray = (ic2 != ic) | (im2 != im)
        else:
            moves = (self.cpu_room[cand] < req.cpu) | (self.mem_room[cand] < req.mem)
            if self.objective.feeds:
                # the stranding term: a pod that moves a node across a step of its grid moves F
                # only where the term may be positive after the pod (then it may be before too);
                # elsewhere it is 0 at both steps
                assert self.cls is not None
                grid = np.flatnonzero(~moves & (self.grid_room[cand] < req.cpu))
                if len(grid):
                    at = cand[grid]
                    moves[grid] = self.objective.strands(at, self.cls[self.index.node_gpus[at]], self.cpu[at] - req.cpu,
                                                         self.mem[at] - req.mem)
        return moves if moves.any() else None

    def best_single(self, req: Request) -> tuple[int, int] | None:
        """(node, gid) of the best option for a one-slice pod, or None: the least changes, then
        the best score, then the first node in order (first-fit among equals), then the node's
        best GPU. Each node's best is kept per slice kind until the node changes; where the
        pod's CPU/memory move the node to other steps of the objective's tables, per steps.
        A node is weighed only when it can win: until then it keeps bounds of its top from its
        fewest changes c (c x 256 plus the offset, plus a score from SCORE_MIN to 0).
        Once a slice kind has had a few pods, its nodes are kept in a heap by their tops and
        bounds, and a pod pops the few that can win instead of scanning every candidate; a pod
        whose candidates are few, or short of CPU or memory where the others can win, is weighed
        by the scan. Both find the same option."""
        ask = req.slice_ref
        if not req.candidates:
            return None
        costs = self.index.costs(ask)
        cache = self._ask_cache(ask)
        heap = self._heaps.get(ask)
        if ask not in self._heaped:
            seen = self._scans[ask] = self._scans.get(ask, 0) + 1
            if seen > _HEAP_AFTER or self._singles[ask] > _HEAP_AFTER:
                self._heaped.add(ask)
        if ask in self._heaped and req.cpu >= 0 and req.mem >= 0 and _FEW_CANDIDATES * len(req.candidates) >= len(self.problem.nodes):
            bucket = self._bucket_of(req.cpu)
            if bucket:
                bucket_heap = self._bucket_heaps.get((ask, bucket))
                if bucket_heap is None:
                    bucket_heap = self._bucket_heaps[(ask, bucket)] = _BucketHeap(cache)
                hit = self._best_single_bucket(req, costs, cache, heap, bucket_heap, bucket)
            else:
                if heap is None:
                    heap = self._heaps[ask] = _NodeHeap(cache)
                hit = self._best_single_heap(req, costs, cache, heap)
            if hit is not _GAVE_UP:
                return cast(tuple[int, int] | None, hit)
        return self._best_single_scan(req, costs, cache, heap)

    def _refresh_bounds(self, costs: AskCosts, cache: NodeBest, nodes: np.ndarray, heap: _NodeHeap | None) -> None:
        """Bounds of the top of `nodes`, whose entries are not valid, from their fewest changes."""
        if len(nodes) > SCALAR_NODES:
            least = np.asarray(self._least_changes(costs, nodes), dtype=np.int64)
            few = np.minimum(least, _FEW_CHANGES) * _TOP_SCALE + _SCORE_OFFSET
            cache.top[nodes] = np.where(least < NO_OPTION, few + SCORE_MIN, NO_OPTION)
            cache.high[nodes] = np.where(least < _FEW_CHANGES, few, NO_OPTION)
            cache.ok[nodes], cache.exact[nodes] = True, False
            if heap is not None:
                heap.push_many(cache.top[nodes].tolist(), nodes.tolist())
            return
        # the same, node by node (numpy's cost per call dominates on a few)
        node_list = nodes.tolist()
        for n, c in zip(node_list, self._least_changes(costs, nodes)):
            few = min(c, _FEW_CHANGES) * _TOP_SCALE + _SCORE_OFFSET
            top = few + SCORE_MIN if c < NO_OPTION else NO_OPTION
            cache.top[n] = top
            cache.high[n] = few if c < _FEW_CHANGES else NO_OPTION
            if heap is not None:
                heap.push(top, n)
        cache.ok[nodes], cache.exact[nodes] = True, False

    def _best_single_heap(self, req: Request, costs: AskCosts, cache: NodeBest,
                          heap: _NodeHeap) -> tuple[int, int] | None | object:
        """`best_single` by the heap: entries pop in order of (top or its bound, node); a node
        whose top is only bounded is weighed and pushed back with its top; a node the pod moves
        to other steps is weighed at those (never below its top: `_weigh_moved`). The pod's
        option is the least (top, node) weighed, once no entry left is below it: with the many
        ties of whole-point scores, mostly the first candidate popped that fits and is not moved.
        `_GAVE_UP` after `_HEAP_POPS` entries that could not host the pod or win."""
        if heap.stale:
            self._refresh_bounds(costs, cache, np.array(sorted(heap.stale), dtype=np.int64), heap)
            heap.stale.clear()
        entries = heap.entries
        member = None if len(req.candidates) == len(self.problem.nodes) else self._candidate_mask(req)
        ok, top_of, exact_of = cache.ok, cache.top, cache.exact
        cpu, mem, need_cpu, need_mem = self.cpu_of, self.mem_of, req.cpu, req.mem
        moving = self.objective is not None and bool(need_cpu or need_mem)
        feeds = moving and self.objective is not None and self.objective.feeds
        best = (NO_OPTION, -1)
        best_slot = -1
        held: list[tuple[int, int]] = []
        seen: set[int] = set()
        while entries and entries[0] < best:
            k, n = heappop(entries)
            if k >= NO_OPTION:
                break
            if n in seen or not ok[n] or top_of[n] != k:
                continue  # a duplicate, or the node's entry moved on
            if not exact_of[n]:
                # weighed with the other nodes of the same bound (many, in a fresh heap), and
                # pushed back with their tops: popped again in order if they can win
                batch: list[int] = [n]
                again: list[int] = []
                taken = {n}
                while entries and entries[0][0] == k and len(batch) < _HEAP_BATCH:
                    k2, n2 = heappop(entries)
                    if n2 in seen or n2 in taken or not ok[n2] or top_of[n2] != k2:
                        continue
                    taken.add(n2)
                    (again if exact_of[n2] else batch).append(n2)
                at = np.array(batch, dtype=np.int64)
                tops, slots = self._weigh(costs, at)
                cache.top[at] = cache.high[at] = tops
                cache.slot[at], cache.exact[at] = slots, True
                heap.push_many(list(tops), batch)
                heap.push_many([k] * len(again), again)
                continue
            seen.add(n)
            held.append((k, n))
            if (member is not None and not member[n]) or cpu[n] < need_cpu or mem[n] < need_mem:
                if len(held) > _HEAP_POPS:
                    heap.push_many([e[0] for e in held], [e[1] for e in held])
                    return _GAVE_UP
                continue
            if moving and (self.cpu_room_of[n] < need_cpu or self.mem_room_of[n] < need_mem
                           or (feeds and self.grid_room_of[n] < need_cpu and self._strands_one(n, need_cpu, need_mem))):
                top, slot = self._weigh_moved_one(costs, n, req)
                if (top, n) < best:
                    best, best_slot = (top, n), slot
            else:  # (k, n) is below every entry left
                best, best_slot = (k, n), int(cache.slot[n])
                break
        heap.push_many([e[0] for e in held], [e[1] for e in held])
        if best[0] >= NO_OPTION:
            return None
        return best[1], self.index.node_gpu_rows[best[1]][best_slot]

    def _strands_one(self, n: int, cpu: int, mem: int) -> bool:
        """`Objective.strands` of node n once a pod takes `cpu` and `mem` of it."""
        assert self.objective is not None
        if FEED_MEMORY:
            return self.objective.strands_free(n, self._free_share(n), self.cpu_of[n] - cpu, self.mem_of[n] - mem)
        below = self._strand_below.get(n)
        if below is None:
            below = self._strand_below[n] = self.objective.strands_below(n, self._free_share(n))
        return self.cpu_of[n] - cpu < below

    def _free_share(self, n: int) -> float:
        """Node n's GPUs' free shares summed as `Objective.strands` sums them, kept until the node
        changes."""
        free = self._free_gpus.get(n)
        if free is None:
            assert self.objective is not None and self.cls is not None
            free_of = self.objective.free_of
            free = self._free_gpus[n] = numpy_sum([free_of[c] for c in self.cls_rows[n]])
        return free

    def _bucket_of(self, cpu: int) -> int:
        """The pod's CPU bucket: the largest not above `cpu` (0: none)."""
        i = bisect_right(self._buckets, cpu)
        return self._buckets[i - 1] if i else 0

    def _best_single_bucket(self, req: Request, costs: AskCosts, cache: NodeBest, heap: _NodeHeap | None,
                            bucket_heap: _BucketHeap, bucket: int) -> tuple[int, int] | None | object:
        """`_best_single_heap` for a pod of CPU bucket `bucket` (> 0), by the bucket's heaps:
        exact entries pop in order of (key, node); the bounds below the least exact key are
        weighed at the bucket first, in batches of one bound; a node the pod moves to other steps
        than the bucket does is weighed at the pod's (never below its key: `_weigh_moved`).
        Under the stranding term a pod's CPU moves many nodes of a CPU-short cluster, and their
        tops at their own steps bound their tops for it by tens of points: keyed by those (the
        kind's one heap), a pod popped a hundred nodes (`dynpart bench planner`, 1,000 nodes)."""
        obj = self.objective
        assert obj is not None
        ask = req.slice_ref
        bh = bucket_heap
        key_of, exact_of = bh.key, bh.exact
        if bh.stale:
            # bounded by their tops at their own steps, or the bounds of those from their fewest
            # changes (weighed when they could win: most of a kind's changed nodes never can)
            nodes = sorted(bh.stale)
            bh.stale.clear()
            need = [n for n in nodes if not cache.ok[n]]
            if need:
                self._refresh_bounds(costs, cache, np.array(need, dtype=np.int64), heap)
                if heap is not None:
                    heap.stale.difference_update(need)
            bounds, shift = bh.bounds, bh.shift
            for n, key in zip(nodes, cache.top[nodes].tolist()):
                key_of[n], exact_of[n] = key, False
                if key < NO_OPTION:
                    heappush(bounds, key << shift | n)
        entries, bounds, shift = bh.entries, bh.bounds, bh.shift
        mask = (1 << shift) - 1
        member = None if len(req.candidates) == len(self.problem.nodes) else self._candidate_mask(req)
        cpu, mem, need_cpu, need_mem = self.cpu_of, self.mem_of, req.cpu, req.mem
        # (top, node) packed as the heaps' entries: below any entry with an option
        best = NO_OPTION << shift
        best_slot = -1
        held: list[int] = []
        seen: set[int] = set()
        while True:
            if bounds and bounds[0] < best and (not entries or bounds[0] <= entries[0]):
                self._tighten_bounds(costs, ask, cache, bh, bucket)
                continue
            if not entries or entries[0] >= best:
                break
            entry = heappop(entries)
            k, n = entry >> shift, entry & mask
            if k >= NO_OPTION:
                break
            if n in seen or key_of[n] != k or not exact_of[n]:
                continue  # a duplicate, or the node's entry moved on
            seen.add(n)
            held.append(entry)
            if (member is not None and not member[n]) or cpu[n] < need_cpu or mem[n] < need_mem:
                if len(held) > _HEAP_POPS:
                    for entry in held:
                        heappush(entries, entry)
                    return _GAVE_UP
                continue
            free_cpu, free_mem = cpu[n], mem[n]
            # the pod's top: at the node's own steps unless it moves the node as `_moves` tells
            # (then the bucket does not either: the key is that top); where it does, the key
            # unless it moves the node to other steps than the bucket does
            if (need_cpu != bucket or need_mem) and (obj.step_one(n, free_cpu - need_cpu, free_mem - need_mem)
                                                     != obj.step_one(n, free_cpu - bucket, free_mem)) \
                    and self._moves_one(n, need_cpu, need_mem):
                top, slot = self._weigh_moved_one(costs, n, req)
                if top << shift | n < best:
                    best, best_slot = top << shift | n, slot
            else:  # (k, n) is below every entry left, and every bound
                best, best_slot = entry, bh.slot[n]
                break
        for entry in held:
            heappush(entries, entry)
        if best >> shift >= NO_OPTION:
            return None
        node = best & mask
        return node, self.index.node_gpu_rows[node][best_slot]

    def _tighten_bounds(self, costs: AskCosts, ask: SliceRef, cache: NodeBest, bh: _BucketHeap, bucket: int) -> None:
        """Pop the bucket heap's least bounds (one key, a batch) and tighten each: the node's top at
        its own steps (weighed if only bounded), exact where the bucket does not move the node;
        else that top raised by what the stranding term rises at least (`_bucket_bound`),
        pushed back as a bound where it rose, weighed at the bucket where it did not."""
        bounds, key_of, exact_of, shift = bh.bounds, bh.key, bh.exact, bh.shift
        mask = (1 << shift) - 1
        k = bounds[0] >> shift
        batch: list[int] = []
        taken: set[int] = set()
        free_cpu = self.cpu_of
        while bounds and bounds[0] >> shift == k and len(taken) < _HEAP_BATCH:
            n = heappop(bounds) & mask
            if key_of[n] == k and not exact_of[n] and n not in taken:
                taken.add(n)
                if free_cpu[n] < bucket:  # no pod of the bucket fits there until the node changes
                    key_of[n], exact_of[n] = NO_OPTION, True
                else:
                    batch.append(n)
        if not batch:
            return
        entries, slot_of = bh.entries, bh.slot
        cpu_room, mem_room, grid_room = self.cpu_room_of, self.mem_room_of, self.grid_room_of
        weigh: list[int] = []
        tops, slots = self._own_best(costs, ask, batch)
        for n, top, slot in zip(batch, tops, slots):
            # `_moves_one(n, bucket, 0)`, written out (a few calls per pod for each node it changes)
            if cpu_room[n] >= bucket and mem_room[n] >= 0 and (grid_room[n] >= bucket
                                                                or not self._strands_one(n, bucket, 0)):
                key_of[n], exact_of[n], slot_of[n] = top, True, slot
                if top < NO_OPTION:
                    heappush(entries, top << shift | n)
                continue
            bound = self._bucket_bound(ask, n, bucket, top)
            if bound > k:
                key_of[n] = bound
                if bound < NO_OPTION:
                    heappush(bounds, bound << shift | n)
            else:
                weigh.append(n)
        if weigh:
            tops, slots = self._weigh_bucket(costs, ask, weigh, bucket)
            for n, top, slot in zip(weigh, tops, slots):
                key_of[n], slot_of[n], exact_of[n] = top, slot, True
            bh.push_many(tops, weigh)

    def _bucket_bound(self, ask: SliceRef, n: int, bucket: int, top: int) -> int:
        """A lower bound of node n's top for a pod taking `bucket` CPU, from its exact top at its
        own steps: the pod's ΔF there is at least ΔF at its own steps, which the top's score
        bounds from below, plus what the stranding term rises by (the node's free GPUs less the
        slice's share, fed at both steps; the kinds' tables only add to it)."""
        if top >= NO_OPTION:
            return top
        obj = self.objective
        assert obj is not None
        changes = (top - _SCORE_OFFSET + _TOP_SCALE - 1) // _TOP_SCALE
        points = changes * _TOP_SCALE + _SCORE_OFFSET - top  # the score, negated: 0..100
        if points >= 99:  # no ΔF bounds the best scores from below
            return top
        feeds = self._feeds.get(n)
        if feeds is None:
            feeds = self._feeds[n] = self._node_feeds(n)
        free_share, feed_own, feed_at_of = feeds
        feed_at = feed_at_of.get(bucket)
        if feed_at is None:
            feed_at = feed_at_of[bucket] = self._feed_at(n, bucket)
        free = free_share - self._slice_share(ask, n)
        rise = max(0.0, free - feed_at) - max(0.0, free - feed_own)
        if rise <= 0.0:
            return top
        # the least ΔF with this score: 100 sigmoid(-ΔF) below points + 1 (1e-9 of slack
        # against the floats' roundings, far above them)
        low = _LOG_ODDS[points] + rise - 1e-9
        score = -int(100.0 / (1.0 + math.exp(min(50.0, max(-50.0, low)))))
        return max(top, changes * _TOP_SCALE + score + _SCORE_OFFSET)

    def _node_feeds(self, n: int) -> tuple[float, float, dict[int, float]]:
        """What `_bucket_bound` reads of node n, kept until it changes: its GPUs' free share, the
        GPUs its CPU and memory feed at its own steps, and (filled per bucket) those its memory and
        its CPU less a bucket's feed."""
        obj = self.objective
        assert obj is not None
        fc = obj.node_fc_list[n]
        own_c, own_m = obj.step_one(n, self.cpu_of[n], self.mem_of[n])
        feed_own = min(obj.feed_c_rows[fc][own_c - obj.fc_row0_list[fc]], obj.feed_m_rows[fc][own_m])
        return self._free_share(n), feed_own, {}

    def _feed_at(self, n: int, bucket: int) -> float:
        """The GPUs node n's CPU less `bucket` and its memory feed."""
        obj = self.objective
        assert obj is not None
        fc = obj.node_fc_list[n]
        free_mem = self.mem_of[n]
        at_c = obj.step_one(n, self.cpu_of[n] - bucket, free_mem)[0]
        own_m = obj.step_one(n, self.cpu_of[n], free_mem)[1]
        return min(obj.feed_c_rows[fc][at_c - obj.fc_row0_list[fc]], obj.feed_m_rows[fc][own_m])

    def _slice_share(self, ask: SliceRef, n: int) -> float:
        """The share of a GPU of node n that one slice of the ask takes of its free share (the
        capacity classes' `free`): a MIG profile's memory slices, an MPS slice's size, a whole
        GPU; 1.0, the most, where unknown."""
        assert self.objective is not None
        key = (ask, self.objective.node_fc_list[n])  # (a feed class has one model and capacity)
        share = self._shares.get(key)
        if share is None:
            # the most where unknown, and at most a GPU: overstated, it only lowers the bound
            node = self.problem.nodes[n]
            one = slice_share(ask, node, self.problem.gpus[node.gpus[0]].capacity if node.gpus else 0)
            share = self._shares[key] = 1.0 if one is None else min(1.0, one)
        return share

    def _moves_one(self, n: int, cpu: int, mem: int) -> bool:
        """`_moves` of one node for a pod taking `cpu` and `mem` (>= 0) of it."""
        return (self.cpu_room_of[n] < cpu or self.mem_room_of[n] < mem
                or (self.grid_room_of[n] < cpu and self._strands_one(n, cpu, mem)))

    def _weigh_bucket(self, costs: AskCosts, ask: SliceRef, nodes: list[int], bucket: int) -> tuple[list[int], list[int]]:
        """(top, slot) of `nodes` for a pod of the ask taking `bucket` CPU and no memory: as the
        scan weighs it, the top at the node's own steps where the pod does not move it (`_moves`),
        else `_weigh_moved`'s."""
        tops = self._own_tops(costs, ask, nodes)
        slots = self._ask_cache(ask).slot[nodes].tolist()
        moved = [i for i, n in enumerate(nodes) if self._moves_one(n, bucket, 0)]
        if moved:
            t, k = self._weigh_moved(costs, ask, [nodes[i] for i in moved], bucket, 0)
            for i, top, slot in zip(moved, t, k):
                tops[i], slots[i] = top, slot
        return tops, slots

    def _candidate_mask(self, req: Request) -> list[bool]:
        """The request's candidate nodes as a mask (requests of one group share their list)."""
        arr = req.candidate_array()
        hit = self._masks.get(id(arr))
        if hit is None or hit[0] is not arr:
            mask = np.zeros(len(self.problem.nodes), dtype=bool)
            mask[arr] = True
            hit = self._masks[id(arr)] = (arr, mask.tolist())
        return hit[1]

    def _best_single_scan(self, req: Request, costs: AskCosts, cache: NodeBest,
                          heap: _NodeHeap | None) -> tuple[int, int] | None:
        """`best_single` by numpy passes over every candidate."""
        cand = self._candidates(req, self.cpu, self.mem)
        if not len(cand):
            return None
        ask = req.slice_ref
        stale = np.flatnonzero(~cache.ok[cand])
        if len(stale):
            nodes = cand[stale]
            self._refresh_bounds(costs, cache, nodes, heap)
            if heap is not None:
                heap.stale.difference_update(nodes.tolist())
        # bounds of each candidate's top for this pod (the top itself where it is known)
        low, high, exact = cache.top[cand], cache.high[cand], cache.exact[cand]
        moves = self._moves(req, cand)
        if moves is None:
            sure = exact
        else:
            sure = exact & ~moves
            at = np.flatnonzero(moves)
            top, was_exact = low[at], exact[at]
            # a pod that moves a node to lower steps leaves less of it usable: its top there is
            # at least the one at the node's own steps (`_weigh_moved` keeps it so; 1 point of
            # slack for a pod that frees CPU or memory), and the node keeps its fewest changes
            # c, which an exact top tells
            c = (top - _SCORE_OFFSET + _TOP_SCALE - 1) // _TOP_SCALE
            low[at] = np.where(was_exact, top - (req.cpu < 0 or req.mem < 0), top)
            high[at] = np.where(was_exact & (top < NO_OPTION),
                                np.where(c < _FEW_CHANGES, c * _TOP_SCALE + _SCORE_OFFSET, NO_OPTION), high[at])
        reach = int(high.min())
        at = np.flatnonzero(~sure & (low <= reach))  # the others cannot win
        top = np.where(sure, low, NO_OPTION)
        moved_slot: dict[int, int] = {}
        if len(at):
            if moves is None:
                stale_pos, moved_pos = at, at[:0]
            else:
                is_moved = moves[at]
                stale_pos, moved_pos = at[~is_moved], at[is_moved]
            if len(stale_pos):
                nodes = cand[stale_pos]
                cache.top[nodes], cache.slot[nodes] = self._weigh(costs, nodes)
                cache.high[nodes] = cache.top[nodes]
                cache.exact[nodes] = True
                top[stale_pos] = cache.top[nodes]
                if heap is not None:
                    heap.push_many(cache.top[nodes].tolist(), nodes.tolist())
            if len(moved_pos):
                if req.cpu >= 0 and req.mem >= 0:
                    moved_slot = self._weigh_moved_lazily(costs, ask, req, cand, low, top, moved_pos)
                else:  # no floor under the tops the pod moves nodes to: every one weighed
                    tops, slots = self._weigh_moved(costs, ask, cand[moved_pos].tolist(), req.cpu, req.mem)
                    top[moved_pos] = tops
                    moved_slot = dict(zip(moved_pos.tolist(), slots))
        i = int(top.argmin())  # candidates are in node order: the first node among equals
        if top[i] >= NO_OPTION:
            return None
        node = int(cand[i])
        slot = moved_slot[i] if i in moved_slot else int(cache.slot[node])
        return node, self.index.node_gpu_rows[node][slot]

    def _weigh_moved_lazily(self, costs: AskCosts, ask: SliceRef, req: Request, cand: np.ndarray, low: np.ndarray,
                            top: np.ndarray, moved_pos: np.ndarray) -> dict[int, int]:
        """Weigh the candidates at `moved_pos` (positions in `cand`, ascending) that the pod
        moves to other steps, only as far as they can win: their top there is at least `low`
        (`_weigh_moved` floors it with the top at the node's own steps, of which `low` is the
        top or a lower bound), so they are weighed in order of (low, position), a few at a time,
        until the least (low, position) left is not below the least (top, position) found.
        `top` (per candidate: the top where known, NO_OPTION elsewhere) gets their tops; returns
        their slots by position. The same option as weighing all of them: the best is the least
        (top, position), and a node that is not weighed cannot be below it. Without this, a pod
        on a large cluster weighed every node its CPU or memory moves (hundreds per pod: the
        cost per pod grew with the cluster, and the packing benchmark's with its square)."""
        order = np.lexsort((moved_pos, low[moved_pos]))
        at_pos = moved_pos[order]
        at_low = low[at_pos]
        slots: dict[int, int] = {}
        done, step = 0, _MOVED_FIRST
        while done < len(at_pos):
            i = int(top.argmin())
            best_top = int(top[i])
            # the moved candidates whose (low, position) is below (best_top, i): a prefix
            below = int(np.searchsorted(at_low, best_top, side="left"))
            equal = int(np.searchsorted(at_low, best_top, side="right"))
            limit = below + int(np.searchsorted(at_pos[below:equal], i, side="left"))
            if limit <= done:
                break
            take = at_pos[done: min(limit, done + step)]
            tops, got = self._weigh_moved(costs, ask, cand[take].tolist(), req.cpu, req.mem)
            top[take] = tops
            slots.update(zip(take.tolist(), got))
            done += len(take)
            step *= 2
        return slots

    def _least_changes(self, costs: AskCosts, nodes: np.ndarray) -> np.ndarray | list[int]:
        """The fewest changes with which each node can host one slice of the ask (NO_OPTION:
        none of its GPUs can)."""
        if len(nodes) <= SCALAR_NODES:
            chg_of = costs.chg
            rows = self.bid_rows
            least = [min([chg_of[b] for b in rows[n]]) for n in nodes.tolist()]
            return least if self.count_changes else [0 if c < NO_OPTION else NO_OPTION for c in least]
        chg = costs.arrays().chg[self.bid[self.index.node_gpus[nodes]]]
        out: np.ndarray = np.minimum.reduce(self._changes(chg), axis=1)
        return out

    def _ask_cache(self, ask: SliceRef) -> NodeBest:
        mine = self._best.get(ask)
        if mine is None:
            base = self.index.node_best(ask, self.count_changes, len(self.problem.nodes))
            mine = self._best[ask] = base.copy()
            if self.changed_nodes:
                mine.ok[list(self.changed_nodes)] = False
        return mine

    def ranked_nodes(self, req: Request) -> Iterator[int]:
        """Nodes for a multi-slice pod, best first: each weighed on its `count` cheapest GPUs
        (one slice per GPU), by their changes, then the score, then node order; nodes that
        cannot host that many GPUs last, in node order. Each node's weighing is kept per slice
        kind and count until the node changes (the score again for the pod where its CPU/memory
        move the node to other steps); scores are computed as the ranking reaches their nodes'
        changes (a score never makes up for one more change)."""
        cand = self._candidates(req, self.cpu, self.mem)
        if not len(cand):
            return
        costs = self.index.costs(req.slice_ref).arrays()
        key = (req.slice_ref, req.count)
        rank = self._ranks.get(key)
        if rank is None:
            rank = self._ranks[key] = _NodeRank(len(self.problem.nodes))
        rank.forget_changed()
        stale = cand[~rank.ok[cand]]
        if len(stale):
            rank.fits[stale], rank.chg[stale] = self._rank_fit(costs, stale, req.count)
            rank.ok[stale], rank.q_ok[stale] = True, False
        fits, chg = rank.fits[cand], rank.chg[cand]
        moves = self._moves(req, cand)
        ok = cand[fits]
        chg_ok = chg[fits]
        moved = moves[fits] if moves is not None else np.zeros(len(ok), dtype=bool)
        for level in np.unique(chg_ok).tolist():
            at = np.flatnonzero(chg_ok == level)
            nodes = ok[at]
            unknown = nodes[~rank.q_ok[nodes] & ~moved[at]]
            if len(unknown):
                rank.q[unknown] = self._rank_q(costs, unknown, req.count, 0, 0)
                rank.q_ok[unknown] = True
            q = rank.q[nodes]
            if moved[at].any():
                mv = np.flatnonzero(moved[at])
                q[mv] = self._rank_q_moved(rank, costs, nodes[mv], req)
            yield from nodes[np.lexsort((nodes, q))].tolist()  # nodes are distinct: GPU tie-breaks never decide
        yield from cand[~fits].tolist()

    def _rank_q_moved(self, rank: _NodeRank, costs: CostArrays, nodes: np.ndarray, req: Request) -> list[int]:
        """`_rank_q` of nodes whose steps of the objective's tables the pod moves; kept per node
        and steps until the node changes."""
        assert self.objective is not None
        ic2, im2 = self.objective.steps(nodes, self.cpu[nodes] - req.cpu, self.mem[nodes] - req.mem)
        node_list, steps = nodes.tolist(), list(zip(ic2.tolist(), im2.tolist()))
        q = [rank.moved_q.get(n, _NO_SCORES).get(st) for n, st in zip(node_list, steps)]
        missing = [i for i, v in enumerate(q) if v is None]
        if missing:
            got = self._rank_q(costs, nodes[missing], req.count, req.cpu, req.mem).tolist()
            for i, v in zip(missing, got):
                q[i] = v
                rank.moved_q.setdefault(node_list[i], {})[steps[i]] = v
        return cast(list[int], q)

    def _rank_fit(self, costs: CostArrays, nodes: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Per node: can it host `count` slices on as many GPUs, and the changes on its `count`
        cheapest GPUs (those with the fewest changes: the GPUs' tie-breaks never change the sum)."""
        width = self.index.node_gpus.shape[1]
        chg = np.sort(self._changes(costs.chg[self.bid[self.index.node_gpus[nodes]]]), axis=1)[:, :min(count, width)]
        fits = np.asarray((chg < NO_OPTION).all(axis=1) & (width >= count))
        return fits, np.where(fits, chg.sum(axis=1), 0)

    def _rank_q(self, costs: CostArrays, nodes: np.ndarray, count: int, cpu: int, mem: int) -> np.ndarray:
        """Per node (each can host `count` slices), the score of the rise of F when its `count`
        cheapest GPUs host one slice each (the pod taking `cpu`/`mem`)."""
        if self.objective is None:
            return np.zeros(len(nodes), dtype=np.int64)
        gids = self.index.node_gpus[nodes]
        b = self.bid[gids]
        order = np.lexsort((np.broadcast_to(np.arange(gids.shape[1]), gids.shape), costs.flex[b], costs.left[b],
                            costs.empty[b], self._changes(costs.chg[b])), axis=-1)
        pick = order[:, :min(count, gids.shape[1])]
        pb = b[np.arange(len(nodes))[:, None], pick]
        q: np.ndarray = Objective.score(self._delta(nodes, pick, costs.after_id[pb], cpu, mem))
        return q

    # --- placing -----------------------------------------------------------------------------

    @staticmethod
    def _ask_key(req: Request) -> tuple[SliceRef, int, int, int, int]:
        """What `place` and `fits_alone` read of a request: its slices, CPU and memory, and its
        candidate nodes (requests of one signature asking the same CPU and memory share their
        candidate array: `compile_requests`)."""
        return req.slice_ref, req.count, req.cpu, req.mem, id(req.candidate_array())

    def place(self, req: Request) -> bool:
        if self._apart_off:
            req = self._kept_apart(req)
        if not req.candidates:
            return False
        key = self._ask_key(req)
        if key in self._failed:
            return False
        if not self._place(req):
            self._failed[key] = req.candidate_array()
            return False
        return True

    def _kept_apart(self, req: Request) -> Request:
        """The request without the nodes its placed partners took among its candidates."""
        off = self._apart_off.get(req.idx)
        if not off:
            return req
        hit = self._apart_req.get(req.idx)
        if hit is not None and hit[0] == len(off):
            return hit[1]
        cand = req.candidate_array()
        left = cand[~np.isin(cand, np.array(off, dtype=np.int64))]
        narrowed = replace(req, candidates=left.tolist(), _cand=left)
        self._apart_req[req.idx] = (len(off), narrowed)
        return narrowed

    def _place(self, req: Request) -> bool:
        if req.count == 1:
            hit = self.best_single(req)
            if hit is None:
                return False
            node, gid = hit
            opt = self.states[gid].option(req.slice_ref)
            assert opt is not None
            # the GPU's class once it hosts the slice: its bucket's, computed with the costs
            after = self.index.costs(req.slice_ref).after_id
            b = int(self.bid[gid])
            self._commit(req, node, [(gid, opt)], after[b] if self.cls is not None and b < len(after) else None)
            return True
        for node in islice(self.ranked_nodes(req), _MULTI_SLICE_NODE_TRIES):
            picks = self._fill_node(req, node)
            if picks is not None:
                self._commit(req, node, picks)
                return True
        return False

    def _fill_node(self, req: Request, node: int) -> list[_Pick] | None:
        """Pick `req.count` slices on one node, cheapest first, on scratch copies."""
        ask = req.slice_ref
        scratch = {g: self.states[g].clone() for g in self.problem.nodes[node].gpus}
        picks: list[_Pick] = []
        for _ in range(req.count):
            best: _Pick | None = None
            for gid, st in scratch.items():
                opt = st.option(ask)
                if opt is not None and (best is None or self._cost(opt) < self._cost(best[1])):
                    best = (gid, opt)
            if best is None:
                return None
            gid, opt = best
            scratch[gid].apply(ask, opt, req.name)
            picks.append(best)
        return picks

    def _cost(self, opt: Option) -> tuple[int, ...]:
        return opt.cost if self.count_changes else opt.cost[1:]

    def _commit(self, req: Request, node: int, picks: list[_Pick], after: int | None = None) -> None:
        """`after`: the class id of the one GPU of `picks` once it hosts the slice, if known."""
        for gid, opt in picks:
            if gid not in self.touched:
                self.touched.add(gid)
                self.states[gid] = self.states[gid].clone()
            st = self.states[gid]
            st.apply(req.slice_ref, opt, req.name)
            self.bid[gid] = self.index.bucket(st)
            if self.cls is not None and self.objective is not None:
                self.cls[gid] = after if after is not None else self.objective.class_id(capacity_class(st))
        gpus = self.index.node_gpus[node]
        self.bid_rows[node] = self.bid[gpus].tolist()
        if self.cls is not None:
            self.cls_rows[node] = self.cls[gpus].tolist()
        self.cpu[node] -= req.cpu
        self.mem[node] -= req.mem
        self.cpu_of[node] -= req.cpu
        self.mem_of[node] -= req.mem
        self.placement[req.idx] = (node, picks)
        for other in req.apart:
            if other not in self.placement:
                self._apart_off.setdefault(other, []).append(node)
        self.changed_nodes.add(node)
        self._failed.clear()
        if self.terms is not None:
            self.terms.ok[node] = False
        if self.objective is not None:
            cpu, mem = self.cpu_of[node], self.mem_of[node]
            self.cpu_room[node] = self.cpu_room_of[node] = room(cpu, self._cpu_steps)
            self.grid_room[node] = self.grid_room_of[node] = room(cpu, self.objective.cpu_step_list)
            self.mem_room[node] = self.mem_room_of[node] = room(mem, self._mem_steps)
        for cache in self._best.values():
            cache.ok[node] = False
        for heap in self._heaps.values():
            heap.stale.add(node)
        for bucket_heap in self._bucket_heaps.values():
            bucket_heap.stale.add(node)
        for rank in self._ranks.values():
            rank.changed.add(node)
        self._views.pop(node, None)
        self._free_gpus.pop(node, None)
        self._strand_below.pop(node, None)
        self._feeds.pop(node, None)
        for kept in self._moved_best.values():
            kept.pop(node, None)

    def run(self, order: list[Request] | None = None) -> Greedy:
        for req in order if order is not None else request_order(self.problem):
            self.place(req)
        self._keep_terms()
        return self

    def _keep_terms(self) -> None:
        """Hand what was computed on nodes this plan did not change back to the caches."""
        changed = list(self.changed_nodes)
        for ask, best in self._best.items():
            into = self.index.node_best(ask, self.count_changes, len(self.problem.nodes))
            new = best.ok & (~into.ok | best.exact & ~into.exact)
            new[changed] = False
            into.take(best, new)
        base, mine = self._base_terms, self.terms
        if base is None or mine is None:
            return
        new = mine.ok & ~base.ok
        if self.changed_nodes:
            new[list(self.changed_nodes)] = False
        if new.any():
            base.take(mine, new)

    # --- what the cluster offered before this plan --------------------------------------------

    def fits_alone(self, req: Request) -> bool:
        """Would the pod have fitted on the cluster as it was, with no other pending pod planned?"""
        key = self._ask_key(req)
        hit = self._alone.get(key)
        if hit is None:
            hit = self._alone[key] = (req.candidate_array(), self._fits_alone(req))
        return hit[1]

    def _fits_alone(self, req: Request) -> bool:
        cand = req.candidate_array()
        if not len(cand):
            return False
        cand = cand[(self.base_cpu[cand] >= req.cpu) & (self.base_mem[cand] >= req.mem)]
        if not len(cand):
            return False
        chg = self.index.costs(req.slice_ref).arrays().chg[self.base_bid[self.index.node_gpus[cand]]]
        return bool(((chg < NO_OPTION).sum(axis=1) >= min(req.count, 1)).any())
