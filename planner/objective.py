"""The planner's third objective: leave the free capacity most usable by the requests the cluster
is likely to see (the FGD idea of Weng et al., ATC'23, generalised to MIG and MPS).

A node's **expected unusable capacity** under a request distribution (kinds k with weights w_k,
normalised per mode) is

    F(node) = free(node) - sum_k w_k usable_k(node)

in GPUs (an MPS GPU's capacity units and a MIG GPU's memory slices are counted as fractions of
the GPU), where usable_k is the free capacity that pods of kind k could still take:

- nothing when the node's free CPU or memory is below what k asks (CPU/memory strand GPUs);
- MPS, a slice of size s: the free capacity of each GPU with at least s free;
- MPS, whole GPUs (`nvidia.com/gpu`): the GPUs nothing uses;
- MIG, a profile p: the free memory slices that some legal placement of p covers, given the
  used instances (start slots, per-profile counts, compute and media limits): a 3g.40gb cannot
  use memory slices 2-3 of an H100 whose slices 0-1 hold a 1g.20gb;
- a kind asking for c > 1 slices on one node: all of the above, only when at least c GPUs of the
  node can host one (room for multi-GPU pods).

Placing a pod raises F by ΔF; among the options that place the most pods with the fewest
changes, the greedy takes the one with the least ΔF (rounded to `DELTA_QUANTUM` of a GPU, so
that near-equal options are then ordered by consolidation: a GPU that already hosts pods, the
tightest fit, the node order). Free instances and slices count as free: the planner may destroy
them (a change, which the second objective already prices).

Computation: each GPU state maps to a **capacity class** (MPS: capacity, used total, whole;
MIG: the used instances), each class to its free fraction and its coverage per requested slice
kind; the weights are cumulative tables over the distinct CPU and memory requests, so that a
node's F is a few table lookups per GPU, evaluated with numpy for all candidate GPUs at once.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import singledispatch

import numpy as np

from dynpart.mig import MigRules
from dynpart.planner.mig_state import MigState
from dynpart.planner.mps_state import MpsState
from dynpart.planner.problem import DemandKind, ref_order
from dynpart.planner.types import (
    WHOLE_GPU,
    CreateSlice,
    MigSliceRef,
    MpsSliceRef,
    Option,
    ReuseSlice,
    SliceRef,
    TakeWholeGpu,
)

# ΔF is compared in steps of this share of a GPU; closer options are equal for the objective



def _mode_of(ref: SliceRef) -> str:
    return "mig" if isinstance(ref, MigSliceRef) else "mps"


# --- capacity classes: what of a GPU the objective looks at ----------------------------------------


@singledispatch
def capacity_class(state: object) -> Hashable:
    """The part of a GPU's state that decides what it still offers (used slices only: free
    ones may be destroyed)."""
    raise TypeError(f"no capacity class for {type(state).__name__}")


@capacity_class.register
def _(state: MigState) -> Hashable:
    return ("mig", state.rules, tuple((i.p, i.start) for i in state.insts if i.hard))


@capacity_class.register
def _(state: MpsState) -> Hashable:
    return ("mps", state.cap, sum(s.size for s in state.slices if s.hard), state.whole_pod is not None)


@singledispatch
def class_after(state: object, ask: SliceRef, option: Option) -> Hashable:
    """The capacity class of the GPU once `option` hosts one slice of `ask` (without applying it)."""
    raise TypeError(f"no capacity class for {type(state).__name__}")


@class_after.register
def _(state: MigState, ask: SliceRef, option: Option) -> Hashable:
    assert isinstance(ask, MigSliceRef)
    p = state.rules.index[ask.profile]
    hard = [(i.p, i.start) for i in state.insts if i.hard]
    if isinstance(option, CreateSlice):
        start = option.start
    else:
        assert isinstance(option, ReuseSlice)
        start = state.insts[option.index].start
    return ("mig", state.rules, tuple(sorted(hard + [(p, start)], key=lambda x: x[1])))


@class_after.register
def _(state: MpsState, ask: SliceRef, option: Option) -> Hashable:
    hard = sum(s.size for s in state.slices if s.hard)
    if isinstance(option, TakeWholeGpu):
        return ("mps", state.cap, hard, True)
    assert isinstance(ask, MpsSliceRef)
    return ("mps", state.cap, hard + ask.size, False)


def _coverage(key: Hashable, refs: list[SliceRef]) -> tuple[float, np.ndarray]:
    """(free share of the GPU, coverage per ref) of a capacity class."""
    cov = np.zeros(len(refs))
    if key is None:
        return 0.0, cov
    assert isinstance(key, tuple)
    if key[0] == "mps":
        _, cap, hard, whole = key
        free = 0 if whole else cap - hard
        for j, ref in enumerate(refs):
            if isinstance(ref, MpsSliceRef) and free >= ref.size:
                cov[j] = free / cap
            elif ref is WHOLE_GPU and not whole and hard == 0:
                cov[j] = 1.0
        return free / cap, cov
    _, rules, hard_insts = key
    assert isinstance(rules, MigRules)
    hard = compute = media = 0
    counts = [0] * len(rules.memory)
    for p, s in hard_insts:
        hard |= rules.mask(p, s)
        counts[p] += 1
        compute += rules.compute[p]
        media += rules.media[p]
    slices = rules.model.memory_slices
    for j, ref in enumerate(refs):
        p = rules.index.get(ref.profile) if isinstance(ref, MigSliceRef) else None
        if p is None:
            continue
        cover = 0
        for s, m in rules.placements[p]:
            if rules.can_add(p, s, hard, counts, compute, media):
                cover |= m
        cov[j] = cover.bit_count() / slices
    return (rules.full_mask & ~hard).bit_count() / slices, cov


class Objective:
    """A request distribution compiled into lookup tables; capacity classes get ids as they are
    met (id 0: no GPU, used to pad nodes with fewer GPUs)."""

    def __init__(self, kinds: list[DemandKind]):
        self.kinds = kinds
        self.refs: list[SliceRef] = sorted({k.ref for k in kinds}, key=ref_order)
        ref_idx = {r: j for j, r in enumerate(self.refs)}
        total: dict[str, float] = {}
        for k in kinds:
            total[_mode_of(k.ref)] = total.get(_mode_of(k.ref), 0.0) + k.weight
        self.cpu_steps = np.array(sorted({k.cpu for k in kinds}), dtype=np.int64)
        self.mem_steps = np.array(sorted({k.mem for k in kinds}), dtype=np.int64)
        self.multi = sorted({(ref_idx[k.ref], k.count) for k in kinds if k.count > 1})
        self.multi_refs = sorted({r for r, _ in self.multi})
        multi_idx = {rc: j for j, rc in enumerate(self.multi)}
        shape = (len(self.cpu_steps) + 1, len(self.mem_steps) + 1)
        w1 = np.zeros(shape + (len(self.refs),))
        wm = np.zeros(shape + (len(self.multi),))
        for k in kinds:
            w = k.weight / total[_mode_of(k.ref)]
            ic = int(np.searchsorted(self.cpu_steps, k.cpu)) + 1
            im = int(np.searchsorted(self.mem_steps, k.mem)) + 1
            if k.count == 1:
                w1[ic, im, ref_idx[k.ref]] += w
            else:
                wm[ic, im, multi_idx[(ref_idx[k.ref], k.count)]] += w
        # cumulative: [i, j] = the weight of the kinds asking at most the i-th CPU and j-th memory step
        self.w1 = w1.cumsum(axis=0).cumsum(axis=1)
        self.wm = wm.cumsum(axis=0).cumsum(axis=1)
        self.multi_col = np.array([self.multi_refs.index(r) for r, _ in self.multi], dtype=np.int64)
        self.multi_count = np.array([c for _, c in self.multi], dtype=np.int64)
        self._ids: dict[Hashable, int] = {}
        self._free: list[float] = []
        self._cov: list[np.ndarray] = []
        self._usable: list[np.ndarray] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.class_id(None)

    @property
    def active(self) -> bool:
        return bool(self.kinds)

    def class_id(self, key: Hashable) -> int:
        cid = self._ids.get(key)
        if cid is None:
            cid = self._ids[key] = len(self._free)
            free, cov = _coverage(key, self.refs)
            self._free.append(free)
            self._cov.append(cov[self.multi_refs] if self.multi_refs else np.zeros(0))
            self._usable.append(self.w1 @ cov)
            self._arrays = None
        return cid

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class id: free share (K,), coverage of the multi-slice refs (K, Rm), and the table
        usable (CPU steps, memory steps, K) of the one-slice kinds."""
        if self._arrays is None:
            self._arrays = (np.array(self._free), np.array(self._cov).reshape(len(self._free), len(self.multi_refs)),
                            np.stack(self._usable, axis=-1))
        return self._arrays

    def steps(self, cpu: np.ndarray, mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.searchsorted(self.cpu_steps, cpu, side="right"),
                np.searchsorted(self.mem_steps, mem, side="right"))

    def unusable(self, cls: np.ndarray, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """F of each row: cls (R, G) class ids of a node's GPUs (0: none), its free CPU and memory."""
        free, cov, usable = self.tables()
        ic, im = self.steps(cpu, mem)
        out: np.ndarray = free[cls].sum(axis=1) - usable[ic[:, None], im[:, None], cls].sum(axis=1)
        if self.multi:
            c = cov[cls]  # (R, G, Rm)
            out -= self.multi_room(ic, im, c.sum(axis=1), (c > 0).sum(axis=1))
        return out


    def multi_room(self, ic: np.ndarray, im: np.ndarray, covered: np.ndarray, hosts: np.ndarray) -> np.ndarray:
        """What the multi-slice kinds can use of nodes whose GPUs cover `covered` (R, Rm) of the
        multi-slice refs, `hosts` of them hosting one."""
        col = self.multi_col
        room = (hosts[:, col] >= self.multi_count[None, :]) * covered[:, col]
        out: np.ndarray = (self.wm[ic, im] * room).sum(axis=1)
        return out

    @staticmethod
    def score(delta: np.ndarray) -> np.ndarray:
        """ΔF as the FGD scheduler plugin scores a node, trunc(100 sigmoid(-ΔF)) with ΔF in GPUs,
        negated (lower is better): whole points, 0.04 GPU wide near 0 and wider far from it."""
        score: np.ndarray = -np.trunc(100.0 / (1.0 + np.exp(np.clip(delta, -50.0, 50.0)))).astype(np.int64)
        return score


class NodeTerms:
    """Per node, F and what computing a change of F needs (CPU and memory steps, coverage of the
    multi-slice refs), valid where `ok`; kept by a session between plans and invalidated for the
    nodes that change."""

    def __init__(self, objective: Objective, n_nodes: int):
        rm = len(objective.multi_refs)
        self.ok = np.zeros(n_nodes, dtype=bool)
        self.f = np.zeros(n_nodes)
        self.ic = np.zeros(n_nodes, dtype=np.int64)
        self.im = np.zeros(n_nodes, dtype=np.int64)
        self.covm = np.zeros((n_nodes, rm))
        self.hostm = np.zeros((n_nodes, rm), dtype=np.int64)
        self.free = np.zeros(n_nodes)  # free share of the node's GPUs
        self.single = np.zeros(n_nodes)  # what the one-slice kinds can use
        self.multi = np.zeros(n_nodes)  # what the multi-slice kinds can use

    FIELDS = ("ok", "f", "ic", "im", "covm", "hostm", "free", "single", "multi")

    def copy(self) -> NodeTerms:
        c = NodeTerms.__new__(NodeTerms)
        for name in self.FIELDS:
            setattr(c, name, getattr(self, name).copy())
        return c

    def take(self, other: NodeTerms, where: np.ndarray) -> None:
        """Copy `other`'s terms of the nodes `where` (a mask)."""
        for name in self.FIELDS:
            getattr(self, name)[where] = getattr(other, name)[where]

    def ensure(self, objective: Objective, nodes: np.ndarray, cls: np.ndarray, cpu: np.ndarray,
               mem: np.ndarray) -> None:
        """Compute the terms of `nodes` not valid yet; cls (R, G): their GPUs' classes."""
        bad = ~self.ok[nodes]
        if not bad.any():
            return
        nodes, cls = nodes[bad], cls[bad]
        free, cov, usable = objective.tables()
        ic, im = objective.steps(cpu[bad], mem[bad])
        self.ic[nodes], self.im[nodes] = ic, im
        self.free[nodes] = free[cls].sum(axis=1)
        self.single[nodes] = usable[ic[:, None], im[:, None], cls].sum(axis=1)
        if objective.multi:
            c = cov[cls]
            covm, hostm = c.sum(axis=1), (c > 0).sum(axis=1)
            self.covm[nodes], self.hostm[nodes] = covm, hostm
            self.multi[nodes] = objective.multi_room(ic, im, covm, hostm)
        self.f[nodes] = self.free[nodes] - self.single[nodes] - self.multi[nodes]
        self.ok[nodes] = True
