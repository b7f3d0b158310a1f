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
- a kind asking for c > 1 slices on one node: all of the above, only when the node's GPUs can
  take c such slices in all, each GPU as many as fit one after another (room for multi-GPU
  pods; a MIG GPU takes two 3g.40gb, an MPS GPU several slices);
- a kind that may not use the node (another GPU model, labels its nodeSelector or required
  affinity does not match, a taint it does not tolerate, a cordon): nothing there (FGD's "no
  access": its weight counts the node's free capacity as unusable, as FGD counts it).

F also counts the free GPUs that the node's free CPU cannot feed at the rate the distribution
asks for CPU per GPU (the **stranding** term, a fluid view of what FGD misses: a CPU-only pod or
a CPU-hungry GPU pod that leaves every kind fitting a node changes no usable_k, yet takes the CPU
that its GPUs will need):

    F(node) = free - sum_k w_k usable_k + max(0, free - cpu / c_bar)

with c_bar = sum_k w_k cpu_k / sum_k w_k gpus_k the CPU asked per GPU by the kinds that may use
the node (gpus_k: the GPUs a pod of k takes there, a slice as its share of the GPU; per node
"feed class": access group, GPU capacity, model, mode). Memory may enter the same way
(FEED_MEMORY: max(0, free - min(cpu / c_bar, mem / m_bar))), off: no gain measured, twice the
steps. Measured on the packing benchmark (FGD's protocol, GPU allocation at 130 %): synthetic
workload 88.4 -> 95.1 % (seeds 0-29; best-fit 90.8), the ten openb pod lists +0.30 to +0.63
points each (seeds 42-51; simulations/results/README.md). CPU enters at steps (`steps`): the kinds' requests and a grid
every c_bar / FEED_STEPS_PER_GPU, so that the term moves only where a pod's CPU moves the node
across a step, as the tables do (the greedy's caches hold); the tables keep one row per kinds'
step (`crow`, `mrow` map a step to its row). The grid reaches the most CPU any node had free
when the objective was built (above it, the top step). The grid is coarse (c_bar / 2), and it
is biased: a pod whose CPU crosses no step counts as taking none, so on a node short of CPU the
term falls by the pod's whole GPU share (tests/planner/test_stranding_grid.py, xfail). The
fluid term (a grid of c_bar / 256, which the tables and the greedy's caches now afford) was
measured in session 38 and not kept: packing unchanged (-0.03 to +0.04 points per list), the
openb MPS replay's 8-GPU pods no longer wait to the trace's end (mean 9,348 -> 1,090 s), but
the other pods' tails pay for it under overload (compress 2.0, p95: MIG 2,519 -> 21,568 s, MPS
31 -> 16,710 s; simulations/results/README.md, "The fluid term"). With a prior for a whole GPU
and a whole node added to the distribution (session 49: "A room prior" there) it was no better.

Where some kinds may use only some GPUs (a GPU model, labels, affinity, taints; a MIG profile
only some models offer), a kind's weight is scaled by the **scarcity** of the capacity it may
use (`scarcity`: the GPUs the broadest kind of its mode may use over the GPUs it may use, at
most SCARCITY_MAX): w_k is the chance that the next pod is of kind k, but a kind bound to a
seventh of the GPUs brings that chance to a seventh of the capacity, and a free GPU there is
worth that much more to it. Without it, pods that could go anywhere (and CPU-hungry ones that
the stranding term sends to nodes rich in CPU) take the scarce models' GPUs and the pods bound to
them fail first: openb gpuspec25, seeds 42-45, allocation at 100 % arrived 92.80 -> 95.74 %, at
130 % 95.95 -> 96.06 % (simulations/results/README.md). Every weight is 1 where every kind may
use every GPU, as in the replays.

Placing a pod raises F by ΔF; among the options that place the most pods with the fewest
changes, the greedy takes the one with the least ΔF, compared as the FGD scheduler plugin's
whole-point score (`Objective.score`), so that near-equal options are then ordered by
consolidation: a GPU that already hosts pods, the tightest fit, the node order. Free instances
and slices count as free: the planner may destroy them (a change, which the second objective
already prices).

Computation: each GPU state maps to a **capacity class** (MPS: capacity, used total, whole;
MIG: the used instances), each class to its free fraction and its coverage per requested slice
kind; the weights are cumulative tables over the distinct CPU and memory requests, so that a
node's F is a few table lookups per GPU, evaluated with numpy for all candidate GPUs at once.
Where some kind may not use some node, the nodes fall into **access groups** (the nodes the same
kinds may use) and the tables have one block of CPU rows per group: a node's CPU row is its
group's first row plus its CPU step, and everything else reads the tables as before.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Sequence
from functools import cache, lru_cache, singledispatch

import numpy as np

from dynpart.mig import MigRules
from dynpart.planner.mig_state import MigState, code_placements, placement_code
from dynpart.planner.mps_state import MpsState
from dynpart.planner.problem import DemandKind, GpuInfo, NodeInfo, ref_order
from dynpart.planner.types import (
    WHOLE_GPU,
    MigSliceRef,
    MpsSliceRef,
    Option,
    SliceRef,
    TakeWholeGpu,
)

# the stranding term's grid: CPU and memory steps every 1/FEED_STEPS_PER_GPU of what the
# distribution asks per GPU, at most FEED_STEPS_MAX steps per resource (a few tables of that
# length per feed class; 256 per GPU, the fluid term, was measured and not kept: module docstring)
FEED_STEPS_PER_GPU = 2
FEED_STEPS_MAX = 256
# whether memory strands GPUs as CPU does (its own grid of steps)
FEED_MEMORY = False
# the most a kind's weight is scaled by the scarcity of the capacity it may use (`scarcity`):
# measured 2, 3, 4, 6, 8 and no limit on the openb gpuspec lists (simulations/results/README.md):
# above 4 the scarce models' GPUs stay free for their pods longer than those pods come, and the
# allocation at 130 % falls
SCARCITY_MAX = 4.0


def gpu_share(kind: DemandKind, node: NodeInfo, cap: int) -> float:
    """The GPUs one pod of `kind` takes on a GPU of `node` (MPS capacity `cap`): a slice as its
    share of the GPU; 0 where the node's GPUs cannot host it."""
    share = slice_share(kind.ref, node, cap, kind.count)
    return share if share is not None else 0.0


def slice_share(ref: SliceRef, node: NodeInfo, cap: int, count: int = 1) -> float | None:
    """The GPUs `count` slices `ref` take on GPUs of `node` (MPS capacity `cap`): a MIG profile's
    memory slices, an MPS slice's size, whole GPUs; None where the node's GPUs cannot host it."""
    if isinstance(ref, MigSliceRef):
        if node.mode != "mig" or not node.model.memory_slices:
            return None
        rules = MigRules.of(node.model)
        p = rules.index.get(ref.profile)
        return count * rules.memory[p] / node.model.memory_slices if p is not None else None
    if node.mode == "mig" or cap <= 0:
        return None
    if ref is WHOLE_GPU:
        return float(count)
    assert isinstance(ref, MpsSliceRef)
    return count * ref.size / cap if ref.size <= cap else None


def node_caps(nodes: Sequence[NodeInfo], gpus: Sequence[GpuInfo]) -> list[int]:
    """Per node, the MPS capacity of its GPUs (its first GPU's; 0: no GPU)."""
    return [gpus[n.gpus[0]].capacity if n.gpus else 0 for n in nodes]


def grid_unit(per_gpu: list[float], top: int) -> int:
    """The stranding grid's step of one resource: 1/FEED_STEPS_PER_GPU of the least positive
    amount per GPU (0: no grid)."""
    pos = [v for v in per_gpu if v > 0]
    if not pos or top <= 0:
        return 0
    return max(1, int(min(pos) / FEED_STEPS_PER_GPU), -(-top // FEED_STEPS_MAX))


def _grid(values: set[int], unit: int, top: int) -> set[int]:
    """`values` and the stranding grid of one resource: steps every `unit` up to `top`."""
    return values | set(range(unit, top + 1, unit)) if unit else values


def _row_map(fine: np.ndarray, coarse: np.ndarray) -> np.ndarray:
    """Per step index of `fine` (0: below its first step), the index of the same value in `coarse`."""
    out: np.ndarray = np.concatenate(([0], np.searchsorted(coarse, fine, side="right"))).astype(np.int64)
    return out


# the lowest (best) score `Objective.score` gives; the highest is 0
SCORE_MIN = -100

# the most ΔF values whose score `Objective.scores` keeps
_SCORES_KEPT = 1 << 16


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
    return mig_class(state.rules, state.hard_code())


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
    start = state.start_of(option)
    return mig_class(state.rules, state.hard_code() + placement_code(state.rules, state.rules.index[ask.profile], start))


def mig_class(rules: MigRules, code: int) -> Hashable:
    """The capacity class of a MIG GPU whose instances in use or planned have this code
    (`MigState.hard_code`)."""
    return ("mig", rules, code)


@class_after.register
def _(state: MpsState, ask: SliceRef, option: Option) -> Hashable:
    hard = sum(s.size for s in state.slices if s.hard)
    if isinstance(option, TakeWholeGpu):
        return ("mps", state.cap, hard, True)
    assert isinstance(ask, MpsSliceRef)
    return ("mps", state.cap, hard + ask.size, False)


@cache
def _cover_masks(rules: MigRules) -> tuple[tuple[int, ...], ...]:
    """Per profile, per mask of used memory slices: the memory slices covered by the profile's
    legal placements that avoid them."""
    table = []
    for placements in rules.placements:
        row = []
        for used in range(rules.full_mask + 1):
            cover = 0
            for _, m in placements:
                if not used & m:
                    cover |= m
            row.append(cover)
        table.append(tuple(row))
    return tuple(table)


def _coverage(key: Hashable, refs: list[SliceRef],
              profiles: list[int | None] | None) -> tuple[float, list[float], list[int]]:
    """(free share of the GPU, coverage per ref, slices of each ref it can still take one after
    another) of a capacity class; `profiles`: for a MIG class, each ref's profile index in its
    model (None: not a profile of the model)."""
    cov = [0.0] * len(refs)
    slots = [0] * len(refs)
    if key is None:
        return 0.0, cov, slots
    assert isinstance(key, tuple)
    if key[0] == "mps":
        _, cap, hard, whole = key
        free = 0 if whole else cap - hard
        for j, ref in enumerate(refs):
            if isinstance(ref, MpsSliceRef) and free >= ref.size:
                cov[j], slots[j] = free / cap, free // ref.size
            elif ref is WHOLE_GPU and not whole and hard == 0:
                cov[j], slots[j] = 1.0, 1
        return free / cap, cov, slots
    _, rules, code = key
    assert isinstance(rules, MigRules) and profiles is not None
    free, covs, hosts = _mig_coverage(rules, code)
    for j, q in enumerate(profiles):
        if q is not None:
            cov[j], slots[j] = covs[q], hosts[q]
    return free, cov, slots


@lru_cache(maxsize=1 << 16)
def _mig_coverage(rules: MigRules, code: int) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """`_coverage` of the MIG class of this code, per profile index of the model. Kept for the
    process (as `MigRules` are): a model has a few thousand classes of instances in use, and
    every plan meets most of those its cluster has."""
    hard = compute = media = 0
    counts = [0] * len(rules.memory)
    for p, s in code_placements(rules, code):
        hard |= rules.mask(p, s)
        counts[p] += 1
        compute += rules.compute[p]
        media += rules.media[p]
    slices = rules.model.memory_slices
    cover_masks = _cover_masks(rules)
    cov = [0.0] * len(rules.memory)
    slots = [0] * len(rules.memory)
    for q in range(len(rules.memory)):
        # the placements of q that `MigRules.can_add` accepts: those clear of the used slices,
        # when the counts, compute and media limits allow one more q at all
        if counts[q] < rules.max_count[q] and compute + rules.compute[q] <= rules.model.compute_slices \
                and not (rules.media[q] and media):
            cov[q] = cover_masks[q][hard].bit_count() / slices
            slots[q] = _mig_slots(rules, q, hard, counts[q], compute, media)
    return (rules.full_mask & ~hard).bit_count() / slices, tuple(cov), tuple(slots)


def _mig_slots(rules: MigRules, q: int, hard: int, count: int, compute: int, media: int) -> int:
    """How many instances of profile q a GPU with these instances can take one after another (the
    placements in start order, as `MigRules.can_add` accepts each: one profile's placements are
    aligned blocks of one size, so taking the first free one each time takes the most)."""
    n = 0
    for _, m in rules.placements[q]:
        if hard & m or count + n >= rules.max_count[q] or compute + rules.compute[q] > rules.model.compute_slices \
                or (rules.media[q] and (media or n)):
            continue
        hard |= m
        n += 1
        compute += rules.compute[q]
    return n


def numpy_sum(values: Sequence[float]) -> float:
    """The sum numpy's `add.reduce` gives over a contiguous float64 row, bit for bit: a plain
    loop under 8 values, else 8 interleaved partial sums (pairwise above 128 values). The
    greedy weighs a few nodes in plain Python (numpy's per-call cost dominates there) and must
    get the floats its vectorised path gets."""
    n = len(values)
    if n < 8:
        total = 0.0
        for v in values:
            total += v
        return total
    if n < 16:  # the loop below, unrolled: no full row of 8 after the first
        total = ((values[0] + values[1]) + (values[2] + values[3])) + ((values[4] + values[5]) + (values[6] + values[7]))
        for i in range(8, n):
            total += values[i]
        return total
    if n <= 128:
        r = list(values[:8])
        i = 8
        end = n - n % 8
        while i < end:
            for j in range(8):
                r[j] += values[i + j]
            i += 8
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            total += values[i]
            i += 1
        return total
    half = n // 2
    half -= half % 8
    return numpy_sum(values[:half]) + numpy_sum(values[half:])


def access_groups(kinds: Sequence[DemandKind], nodes: Sequence[NodeInfo]) -> tuple[list[int], list[list[int]]]:
    """(group of each node, the kinds each group's nodes may host): the nodes that the same kinds
    may use (`DemandKind.admits`: GPU model, labels, required affinity, taints, cordon) share a
    group, numbered in order of first node. Decided once per distinct node of those traits."""
    by_name = any(k.constraints.by_name for k in kinds)
    admitting_of: dict[tuple[object, ...], tuple[int, ...]] = {}
    groups: dict[tuple[int, ...], int] = {}
    of_node = []
    for node in nodes:
        key = (node.model.family_name, tuple(sorted(node.labels.items())), node.taints, node.unschedulable,
               node.name if by_name else None)
        admitting = admitting_of.get(key)
        if admitting is None:
            admitting = admitting_of[key] = tuple(i for i, k in enumerate(kinds) if k.admits(node))
        of_node.append(groups.setdefault(admitting, len(groups)))
    return of_node, [list(g) for g in groups]


def scarcity(kinds: Sequence[DemandKind], nodes: Sequence[NodeInfo], group_of: Sequence[int] = (),
             group_kinds: Sequence[Sequence[int]] = (), caps: Sequence[int] = ()) -> list[float]:
    """Per kind, how much scarcer the capacity it may use is than the broadest kind's of its mode:
    the GPUs the broadest kind may use over the GPUs it may use, at most SCARCITY_MAX (the GPUs of
    the nodes it may use, `group_of` / `group_kinds` from `access_groups`, none: every node; of
    those, the GPUs that can host its slices: its mode, a model offering its MIG profile, an MPS
    capacity of at least its size where `caps` are given). 1 for every kind where all may use the
    same GPUs. Why: the module docstring."""
    groups = list(group_kinds) or [list(range(len(kinds)))]
    reach = [0] * len(kinds)
    gpus_of: dict[tuple[int, str, str, int], int] = {}  # GPUs per (group, model, mode, capacity)
    first: dict[tuple[int, str, str, int], int] = {}
    for i, node in enumerate(nodes):
        key: tuple[int, str, str, int] = (group_of[i] if group_of else 0, node.model.name, str(node.mode),
                                          caps[i] if caps else 1 << 62)
        gpus_of[key] = gpus_of.get(key, 0) + len(node.gpus)
        first.setdefault(key, i)
    hosts: dict[tuple[SliceRef, str, str, int], bool] = {}  # (few refs and models: asked once)
    for key, gpus in gpus_of.items():
        for j in groups[key[0]]:
            at = (kinds[j].ref,) + key[1:]
            ok = hosts.get(at)
            if ok is None:
                ok = hosts[at] = slice_share(kinds[j].ref, nodes[first[key]], key[3]) is not None
            if ok:
                reach[j] += gpus
    top: dict[str, int] = {}
    for j, k in enumerate(kinds):
        top[_mode_of(k.ref)] = max(top.get(_mode_of(k.ref), 0), reach[j])
    return [min(SCARCITY_MAX, top[_mode_of(k.ref)] / reach[j]) if reach[j] else 1.0 for j, k in enumerate(kinds)]


def needs_access_groups(kinds: Sequence[DemandKind], nodes: Sequence[NodeInfo]) -> bool:
    """Whether some kind may not use some node (else every node sees the whole distribution)."""
    return any(k.restricted for k in kinds) or any(n.taints or n.unschedulable for n in nodes)


class Objective:
    """A request distribution compiled into lookup tables; capacity classes get ids as they are
    met (id 0: no GPU, used to pad nodes with fewer GPUs). `nodes`: the cluster's, by index,
    needed where some kind may not use some node (`access_groups`); with `caps` (`node_caps`),
    F has the stranding term (without: none, as nothing tells what a slice is of a GPU).
    `scarce_weights`: a kind's weight scaled by how scarce its capacity is (`scarcity`); off only
    to reproduce FGD as its authors ran it."""

    def __init__(self, kinds: list[DemandKind], nodes: Sequence[NodeInfo] = (), caps: Sequence[int] = (),
                 scarce_weights: bool = True):
        self.kinds = kinds
        group_of, group_kinds = (access_groups(kinds, nodes) if needs_access_groups(kinds, nodes)
                                 else ([], [list(range(len(kinds)))]))
        self.groups = len(group_kinds)
        self.refs: list[SliceRef] = sorted({k.ref for k in kinds}, key=ref_order)
        ref_idx = {r: j for j, r in enumerate(self.refs)}
        total: dict[str, float] = {}
        for k in kinds:
            total[_mode_of(k.ref)] = total.get(_mode_of(k.ref), 0.0) + k.weight
        # the stranding term: per node its feed class (group, capacity, model, mode), per class
        # the CPU and memory asked per GPU by the kinds that may use its nodes (0: no term)
        self.node_fc = np.zeros(len(nodes), dtype=np.int64)
        fc_of: dict[tuple[object, ...], int] = {}
        cbar: list[float] = []
        mbar: list[float] = []
        fc_group: list[int] = []
        if kinds and len(caps) == len(nodes):
            for i, node in enumerate(nodes):
                g = group_of[i] if group_of else 0
                key = (g, caps[i], node.model.name, node.mode)
                fc = fc_of.get(key)
                if fc is None:
                    fc = fc_of[key] = len(cbar)
                    gpus = cpu = mem = 0.0
                    for k in (kinds[j] for j in group_kinds[g]):
                        share = gpu_share(k, node, caps[i])
                        if share > 0:
                            gpus += k.weight * share
                            cpu += k.weight * k.cpu
                            mem += k.weight * k.mem
                    cbar.append(cpu / gpus if gpus > 0 else 0.0)
                    mbar.append(mem / gpus if gpus > 0 else 0.0)
                    fc_group.append(g)
                self.node_fc[i] = fc
        self.node_fc_list: list[int] = self.node_fc.tolist()
        self.feeds = any(c > 0 for c in cbar) or (FEED_MEMORY and any(m > 0 for m in mbar))
        kind_cpu = np.array(sorted({k.cpu for k in kinds}), dtype=np.int64)
        kind_mem = np.array(sorted({k.mem for k in kinds}), dtype=np.int64)
        cpu_set, mem_set = set(kind_cpu.tolist()), set(kind_mem.tolist())
        if self.feeds:
            top_cpu = max(n.cpu_free for n in nodes)
            cpu_set = _grid(cpu_set, grid_unit(cbar, top_cpu), top_cpu)
            if FEED_MEMORY:
                top_mem = max(n.mem_free for n in nodes)
                mem_set = _grid(mem_set, grid_unit(mbar, top_mem), top_mem)
        # the steps (the kinds' requests and the stranding grid) and, per step index, the row of
        # the tables (the kinds' requests alone)
        self.cpu_steps = np.array(sorted(cpu_set), dtype=np.int64)
        self.mem_steps = np.array(sorted(mem_set), dtype=np.int64)
        self.cpu_step_list: list[int] = self.cpu_steps.tolist()
        self.mem_step_list: list[int] = self.mem_steps.tolist()
        crow1, self.mrow = _row_map(self.cpu_steps, kind_cpu), _row_map(self.mem_steps, kind_mem)
        # the kinds' steps alone: a pod that moves a node across none of them and leaves it with
        # CPU for its free GPUs (`strands`) changes F as if it took no CPU (`NodeRooms`)
        self.kind_cpu_steps, self.kind_mem_steps = kind_cpu, kind_mem
        self.kind_cpu_step_list: list[int] = kind_cpu.tolist()
        self.kind_mem_step_list: list[int] = kind_mem.tolist()
        self.multi = sorted({(ref_idx[k.ref], k.count) for k in kinds if k.count > 1})
        self.multi_refs = sorted({r for r, _ in self.multi})
        multi_idx = {rc: j for j, rc in enumerate(self.multi)}
        rows = len(self.cpu_steps) + 1  # CPU steps of one access group
        rows_c = len(kind_cpu) + 1  # CPU rows of one access group's tables
        self.crow = (np.arange(len(group_kinds), dtype=np.int64)[:, None] * rows_c + crow1[None, :]).reshape(-1)
        self.crow_list: list[int] = self.crow.tolist()
        self.mrow_list: list[int] = self.mrow.tolist()
        # per node, its group's first CPU row (`steps` adds the node's CPU step)
        self.node_row0 = np.array(group_of, dtype=np.int64) * rows
        self.node_row0_list: list[int] = self.node_row0.tolist()
        shape = (len(group_kinds), rows_c, len(kind_mem) + 1)
        w1 = np.zeros(shape + (len(self.refs),))
        wm = np.zeros(shape + (len(self.multi),))
        scarce = scarcity(kinds, nodes, group_of, group_kinds, caps) if scarce_weights else [1.0] * len(kinds)
        for g, members in enumerate(group_kinds):
            for i in members:
                k = kinds[i]
                w = k.weight / total[_mode_of(k.ref)] * scarce[i]
                ic = int(np.searchsorted(kind_cpu, k.cpu)) + 1
                im = int(np.searchsorted(kind_mem, k.mem)) + 1
                if k.count == 1:
                    w1[g, ic, im, ref_idx[k.ref]] += w
                else:
                    wm[g, ic, im, multi_idx[(ref_idx[k.ref], k.count)]] += w
        # cumulative within a group: [g, i, j] = the weight of the kinds the group's nodes can
        # host asking at most the i-th CPU and j-th memory step; the groups' blocks stacked
        self.w1 = w1.cumsum(axis=1).cumsum(axis=2).reshape((shape[0] * rows_c,) + w1.shape[2:])
        # wm by table row and memory step (small: no class axis)
        self.wm = wm.cumsum(axis=1).cumsum(axis=2).reshape((shape[0] * rows_c,) + wm.shape[2:])[:, self.mrow]
        # per feed class, the GPUs the free CPU of each CPU step and the free memory of each
        # memory step can feed (inf: no term)
        n_fc = len(cbar)
        cval = np.concatenate(([0], self.cpu_steps)).astype(float)
        mval = np.concatenate(([0], self.mem_steps)).astype(float)
        # (a class's nodes are of one group: its row holds that group's block of CPU steps, read
        # at the CPU row less the group's first, `fc_row0`)
        self.feed_c = np.full((n_fc, rows), np.inf)
        self.feed_m = np.full((n_fc, len(self.mem_steps) + 1), np.inf)
        self.fc_row0 = np.array(fc_group, dtype=np.int64) * rows
        self.fc_row0_list: list[int] = self.fc_row0.tolist()
        for fc in range(n_fc):
            if cbar[fc] > 0:
                self.feed_c[fc] = cval / cbar[fc]
            if mbar[fc] > 0 and FEED_MEMORY:
                self.feed_m[fc] = mval / mbar[fc]
        self.feed_c_rows: list[list[float]] = self.feed_c.tolist()
        self.feed_m_rows: list[list[float]] = self.feed_m.tolist()
        self.multi_col = np.array([self.multi_refs.index(r) for r, _ in self.multi], dtype=np.int64)
        self.multi_count = np.array([c for _, c in self.multi], dtype=np.int64)
        # the same tables as lists, for the greedy's plain-Python path: wm[row][im] and per class
        # id its free share, its coverage of the multi-slice refs and usable[row][im] (row: the
        # table row of a CPU step, `crow_list`)
        self.wm_rows: list[list[list[float]]] = self.wm.tolist()
        self.multi_cols: list[int] = self.multi_col.tolist()
        self.multi_counts: list[int] = self.multi_count.tolist()
        self.free_of: list[float] = []
        self.cov_of: list[list[float]] = []
        # per class id, the slices of each multi-slice ref it can still take (a node hosts a pod
        # of `count` such slices where its GPUs' sum reaches it: a GPU may host several)
        self.slots_of: list[list[int]] = []
        self.usable_of: list[list[list[float]]] = []
        self._ids: dict[Hashable, int] = {}
        # per coverage (free share, coverage and slots per ref): usable, the multi-slice refs'
        # coverage and slots, usable by row (shared by the classes of that coverage, read only)
        self._by_coverage: dict[tuple[float, tuple[float, ...], tuple[int, ...]],
                                tuple[np.ndarray, list[float], list[int], list[list[float]]]] = {}
        self._scores: dict[float, int] = {}
        self._transitions: dict[tuple[int, int], tuple[float, tuple[tuple[int, int, float, int, int], ...]]] = {}
        self._profiles: dict[MigRules, list[int | None]] = {}  # per model, each ref's profile index
        # per class id, in arrays that grow by doubling (`tables()` gives views of the filled part)
        self._free = np.zeros(64)
        self._cov = np.zeros((64, len(self.multi_refs)))
        self._slots = np.zeros((64, len(self.multi_refs)), dtype=np.int64)
        self._usable = np.zeros(self.w1.shape[:2] + (64,))  # by table row
        self.class_id(None)

    @property
    def active(self) -> bool:
        return bool(self.kinds)

    def class_id(self, key: Hashable) -> int:
        cid = self._ids.get(key)
        if cid is None:
            cid = self._ids[key] = len(self.free_of)
            profiles = None
            if isinstance(key, tuple) and key[0] == "mig":
                profiles = self._profiles.get(key[1])
                if profiles is None:
                    profiles = self._profiles[key[1]] = [key[1].index.get(r.profile) if isinstance(r, MigSliceRef) else None
                                                         for r in self.refs]
            free, cov, slots = _coverage(key, self.refs, profiles)
            # a cluster's classes share a few coverages (2,000 classes, 74 coverages on 8,000
            # H100s): the tables of one are computed once (the same floats: the same product)
            covers = (free, tuple(cov), tuple(slots))
            hit = self._by_coverage.get(covers)
            if hit is None:
                usable = self.w1 @ np.array(cov)
                hit = self._by_coverage[covers] = (
                    usable, [cov[j] for j in self.multi_refs], [slots[j] for j in self.multi_refs],
                    # by table row and memory step (the CPU grid's many steps share a row)
                    [[row[m] for m in self.mrow_list] for row in usable.tolist()])
            usable, cov_multi, slots_multi, usable_rows = hit
            if cid == len(self._free):
                self._free = np.concatenate([self._free, np.zeros_like(self._free)])
                self._cov = np.concatenate([self._cov, np.zeros_like(self._cov)])
                self._slots = np.concatenate([self._slots, np.zeros_like(self._slots)])
                self._usable = np.concatenate([self._usable, np.zeros_like(self._usable)], axis=-1)
            self._free[cid], self._usable[..., cid] = free, usable
            if cov_multi:
                self._cov[cid], self._slots[cid] = cov_multi, slots_multi
            self.free_of.append(free)
            self.cov_of.append(cov_multi)
            self.slots_of.append(slots_multi)
            self.usable_of.append(usable_rows)
        return cid

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class id: free share (K,), coverage of the multi-slice refs (K, Rm), and the table
        usable (CPU rows, memory rows, K) of the one-slice kinds, read at `rows` of the steps."""
        k = len(self.free_of)
        return self._free[:k], self._cov[:k], self._usable[..., :k]

    def slot_table(self) -> np.ndarray:
        """Per class id, the slices of each multi-slice ref it can still take (K, Rm)."""
        return self._slots[:len(self.free_of)]

    def rows(self, ic: np.ndarray, im: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `tables()`'s usable at these steps."""
        return self.crow[ic], self.mrow[im]

    def stranded(self, nodes: np.ndarray, free: np.ndarray, ic: np.ndarray, im: np.ndarray) -> np.ndarray:
        """The stranding term of `nodes` with `free` GPUs at these steps."""
        fc = self.node_fc[nodes]
        d = free - np.minimum(self.feed_c[fc, ic - self.fc_row0[fc]], self.feed_m[fc, im])
        out: np.ndarray = np.where(d > 0.0, d, 0.0)
        return out

    def stranded_one(self, node: int, free: float, ic: int, im: int) -> float:
        """`stranded` of one node, in plain Python (bit for bit the same)."""
        fc = self.node_fc_list[node]
        d = free - min(self.feed_c_rows[fc][ic - self.fc_row0_list[fc]], self.feed_m_rows[fc][im])
        return d if d > 0.0 else 0.0

    def strands(self, nodes: np.ndarray, cls: np.ndarray, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """Whether the stranding term of nodes whose GPUs have classes `cls` (R, G) may be
        positive with `cpu` and `mem` free: their free GPUs (before a pod takes any) above what
        that CPU and memory feed."""
        ic, im = self.steps(nodes, cpu, mem)
        fc = self.node_fc[nodes]
        out: np.ndarray = self.tables()[0][cls].sum(axis=1) > np.minimum(self.feed_c[fc, ic - self.fc_row0[fc]],
                                                                          self.feed_m[fc, im])
        return out

    def strands_free(self, node: int, free: float, cpu: int, mem: int) -> bool:
        """`strands` of one node whose GPUs' free shares sum (`numpy_sum`) to `free`, in plain
        Python (bit for bit the same)."""
        ic, im = self.step_one(node, cpu, mem)
        fc = self.node_fc_list[node]
        return free > min(self.feed_c_rows[fc][ic - self.fc_row0_list[fc]], self.feed_m_rows[fc][im])

    def strands_below(self, node: int, free: float) -> float:
        """The free CPU below which node `node`, its GPUs' free shares summing to `free`, strands
        GPUs (`strands_free` is true, memory not counted: FEED_MEMORY off): the least CPU step
        that feeds them (inf: none does; -inf: nothing to feed)."""
        fc = self.node_fc_list[node]
        j = bisect_left(self.feed_c_rows[fc], free)  # the first step index not below `free`
        if j == len(self.feed_c_rows[fc]):
            return float("inf")
        return self.cpu_step_list[j - 1] if j else float("-inf")

    def steps(self, nodes: np.ndarray | None, cpu: np.ndarray, mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the tables (CPU row, memory step) of these nodes with this CPU and memory
        free; `nodes` None: where every kind may use every node (one access group)."""
        ic = np.searchsorted(self.cpu_steps, cpu, side="right")
        if self.groups > 1:
            if nodes is None:
                raise ValueError("the objective's kinds may not use every node: the rows need the nodes")
            ic = ic + self.node_row0[nodes]
        return ic, np.searchsorted(self.mem_steps, mem, side="right")

    def step_one(self, node: int, cpu: int, mem: int) -> tuple[int, int]:
        """`steps` of one node, in plain Python."""
        ic = bisect_right(self.cpu_step_list, cpu)
        if self.groups > 1:
            ic += self.node_row0_list[node]
        return ic, bisect_right(self.mem_step_list, mem)

    def unusable(self, cls: np.ndarray, cpu: np.ndarray, mem: np.ndarray, nodes: np.ndarray | None = None) -> np.ndarray:
        """F of each row: cls (R, G) class ids of a node's GPUs (0: none), its free CPU and memory,
        and the node (as `steps`)."""
        free, cov, usable = self.tables()
        ic, im = self.steps(nodes, cpu, mem)
        rc, rm = self.rows(ic, im)
        fr = free[cls].sum(axis=1)
        out: np.ndarray = fr - usable[rc[:, None], rm[:, None], cls].sum(axis=1)
        if self.multi:
            c = cov[cls]  # (R, G, Rm)
            out -= self.multi_room(ic, im, c.sum(axis=1), self.slot_table()[cls].sum(axis=1))
        if self.feeds:
            if nodes is None:
                raise ValueError("the stranding term needs the nodes")
            out += self.stranded(nodes, fr, ic, im)
        return out


    def transition(self, before: int, after: int) -> tuple[float, tuple[tuple[int, int, float, int, int], ...]]:
        """What a GPU's class moving from `before` to `after` changes: its free share (after less
        before) and, per multi-slice kind whose ref's coverage or slots it changes, (kind, ref
        column, coverage after less before, slots after less before, the kind's count)."""
        hit = self._transitions.get((before, after))
        if hit is None:
            ca, cb = self.cov_of[after], self.cov_of[before]
            sa, sb = self.slots_of[after], self.slots_of[before]
            moved = tuple((j, col, ca[col] - cb[col], sa[col] - sb[col], self.multi_counts[j])
                          for j, col in enumerate(self.multi_cols) if ca[col] != cb[col] or sa[col] != sb[col])
            hit = self._transitions[(before, after)] = (self.free_of[after] - self.free_of[before], moved)
        return hit

    def multi_room_one(self, ic: int, im: int, covered: list[float], hosts: list[int]) -> float:
        """`multi_room` of one node, in plain Python (bit for bit the same)."""
        wm = self.wm_rows[self.crow_list[ic]][im]
        return numpy_sum([w * (covered[col] * (hosts[col] >= count))
                          for w, col, count in zip(wm, self.multi_cols, self.multi_counts)])

    def multi_room(self, ic: np.ndarray, im: np.ndarray, covered: np.ndarray, hosts: np.ndarray) -> np.ndarray:
        """What the multi-slice kinds can use of nodes whose GPUs cover `covered` (R, Rm) of the
        multi-slice refs and can take `hosts` slices of each (a kind of `count` slices: where
        `hosts` reaches it)."""
        col = self.multi_col
        room = (hosts[:, col] >= self.multi_count[None, :]) * covered[:, col]
        out: np.ndarray = (self.wm[self.crow[ic], im] * room).sum(axis=1)
        return out

    def scores(self, deltas: list[float]) -> list[int]:
        """`score` of each ΔF, remembered per value (a few hundred values recur plan after plan);
        one not met yet is scored in plain Python (`_score_one`), with numpy where that may differ."""
        memo = self._scores
        out = []
        for d in deltas:
            q = memo.get(d)
            if q is None:
                q = _score_one(d)
                if q is None:
                    q = int(self.score(np.array([d]))[0])
                if len(memo) > _SCORES_KEPT:
                    memo.clear()
                memo[d] = q
            out.append(q)
        return out

    @staticmethod
    def score(delta: np.ndarray) -> np.ndarray:
        """ΔF as the FGD scheduler plugin scores a node, trunc(100 sigmoid(-ΔF)) with ΔF in GPUs,
        negated (lower is better): whole points, 0.04 GPU wide near 0 and wider far from it."""
        score: np.ndarray = -np.trunc(100.0 / (1.0 + np.exp(np.clip(delta, -50.0, 50.0)))).astype(np.int64)
        return score


def _score_one(delta: float) -> int | None:
    """`Objective.score` of one ΔF with the math module's exp, where that gives numpy's score: its
    exp and numpy's differ by a few units in the last place at most, which moves the score only
    where 100 sigmoid(-ΔF) is that close to a whole point (None there, and for NaN)."""
    if delta != delta:
        return None
    x = 100.0 / (1.0 + math.exp(min(50.0, max(-50.0, delta))))
    t = int(x)
    if (t and x - t < 1e-6) or x - t > 1.0 - 1e-6:  # (x > 0: no point below 0 to cross)
        return None
    return -t


# the room of a value below the lowest step: no request moves it down a step
NO_STEP_BELOW = 1 << 62


def rooms(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """How far each value is above the highest step not above it: a pod taking more than that
    moves its node down a step of the objective's CPU or memory tables."""
    floor: np.ndarray = np.concatenate(([-NO_STEP_BELOW], steps))[np.searchsorted(steps, values, side="right")]
    out: np.ndarray = values - floor
    return out


def room(value: int, steps: list[int]) -> int:
    """`rooms` of one value, in plain Python."""
    i = bisect_right(steps, value)
    return value - steps[i - 1] if i else value + NO_STEP_BELOW


class NodeRooms:
    """Per node, the `rooms` of its free CPU and memory in the objective's kinds' CPU and memory
    steps (`Objective.kind_cpu_steps`), and of its CPU in every step (`grid`: the stranding
    grid's steps matter only where `strands`), for every node. A session keeps them with its objective and updates the node whose CPU or
    memory changes (`update`), so that a plan copies them instead of searching the steps for
    every node of the cluster (a pod's plan would cost what the cluster's size does)."""

    __slots__ = ("cpu", "mem", "grid", "_cpu_steps", "_mem_steps", "_grid_steps")

    def __init__(self, objective: Objective, cpu: np.ndarray, mem: np.ndarray):
        self._cpu_steps, self._mem_steps = objective.kind_cpu_step_list, objective.kind_mem_step_list
        self._grid_steps = objective.cpu_step_list
        self.cpu = rooms(cpu, objective.kind_cpu_steps)
        self.mem = rooms(mem, objective.kind_mem_steps)
        # in every CPU step, the stranding grid's too: a pod taking no more than this moves the
        # node's stranding term nowhere
        self.grid = rooms(cpu, objective.cpu_steps)

    def update(self, node: int, cpu: int, mem: int) -> None:
        """Node `node` now has `cpu` and `mem` free."""
        self.cpu[node] = room(cpu, self._cpu_steps)
        self.mem[node] = room(mem, self._mem_steps)
        self.grid[node] = room(cpu, self._grid_steps)


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
        ic, im = objective.steps(nodes, cpu[bad], mem[bad])
        self.ic[nodes], self.im[nodes] = ic, im
        self.free[nodes] = free[cls].sum(axis=1)
        rc, rm = objective.rows(ic, im)
        self.single[nodes] = usable[rc[:, None], rm[:, None], cls].sum(axis=1)
        if objective.multi:
            c = cov[cls]
            covm, hostm = c.sum(axis=1), objective.slot_table()[cls].sum(axis=1)
            self.covm[nodes], self.hostm[nodes] = covm, hostm
            self.multi[nodes] = objective.multi_room(ic, im, covm, hostm)
        self.f[nodes] = self.free[nodes] - self.single[nodes] - self.multi[nodes]
        if objective.feeds:
            self.f[nodes] += objective.stranded(nodes, self.free[nodes], ic, im)
        self.ok[nodes] = True

    def one(self, objective: Objective, node: int, classes: list[int], cpu: int,
            mem: int) -> tuple[float, float, float, int, int, list[float], list[int]]:
        """The terms of one node, `classes` its GPUs' (f, free, single, CPU and memory step,
        coverage and slots of the multi-slice refs), computed where not valid yet as `ensure`
        computes them (numpy's cost per call dominates on one node): the sums over its GPUs in
        plain Python, the same float operations in the same order, so the same terms bit for bit."""
        if self.ok[node]:
            return (float(self.f[node]), float(self.free[node]), float(self.single[node]), int(self.ic[node]),
                    int(self.im[node]), self.covm[node].tolist(), self.hostm[node].tolist())
        ic, im = objective.step_one(node, cpu, mem)
        usable_of = objective.usable_of
        free = numpy_sum([objective.free_of[c] for c in classes])
        row = objective.crow_list[ic]
        single = numpy_sum([usable_of[c][row][im] for c in classes])
        self.ic[node], self.im[node], self.free[node], self.single[node] = ic, im, free, single
        multi = 0.0
        covm: list[float] = []
        hostm: list[int] = []
        if objective.multi:
            # the coverage sums as `ensure` computes them, on one row
            at = np.array(classes)[None, :]
            covm = objective.tables()[1][at].sum(axis=1)[0].tolist()
            hostm = objective.slot_table()[at].sum(axis=1)[0].tolist()
            self.covm[node], self.hostm[node] = covm, hostm
            multi = self.multi[node] = objective.multi_room_one(ic, im, covm, hostm)
        f = free - single - multi
        if objective.feeds:
            f += objective.stranded_one(node, free, ic, im)
        self.f[node] = f
        self.ok[node] = True
        return f, free, single, ic, im, covm, hostm

