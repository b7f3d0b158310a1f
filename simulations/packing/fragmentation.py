"""Expected GPU fragmentation of a node, after the FGD paper's measure (Weng et al., ATC'23).

For a node and one kind of GPU pod (CPU, memory, GPU count, GPU milli per GPU), the node's free
GPU milli that this kind could not use is fragmented: all of it when the pod cannot run there
at all (not enough CPU or memory, no GPU with enough free milli, too few fully free GPUs);
otherwise the free milli of the GPUs too small for it (for a sharing pod: GPUs with less free
than it asks; for a whole-GPU pod: the partly used GPUs). The node's expected fragmentation
weighs each kind by its share of the pods, as the paper does (`weighting="demand"` weighs by
GPU demand instead: a kind asking for a whole GPU counts 1000 times one asking for 1 milli;
measured worse on openb once scores are quantised, see `packing.dynpart_packing`). Unlike
the paper, memory counts too (a kind whose memory does not fit cannot run there).
Placing a pod where it raises the expected fragmentation least keeps the most of the cluster
usable for the pods still to come.

Computed exactly but without a loop over kinds: with U(s) = free milli on GPUs with at least s
free and W(cpu, mem) = the weight of the kinds whose CPU and memory fit,
    frag = total free - sum_s U(s) W_share[s](cpu, mem) - sum_c [whole free >= c] whole free W_whole[c](cpu, mem)
where W is a cumulative table over the distinct CPU and memory requests. `frag` evaluates many
hypothetical node states at once (one row each), which the simulator's ranking needs per pod.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from dynpart.simulations.inputs.traces import MILLI, TracePod


class FragmentationModel:
    def __init__(self, pods: Iterable[TracePod], capacity: int = MILLI, weighting: str = "count",
                 memory: bool = True):
        if weighting not in ("count", "demand"):
            raise ValueError(f"weighting {weighting!r}: expected count or demand")
        kinds = Counter((p.cpu_milli, p.memory_mib if memory else 0, p.num_gpu, p.gpu_milli)
                        for p in pods if p.num_gpu)
        self.capacity = capacity
        self.memory = memory
        cpu = np.array([k[0] for k in kinds], dtype=np.int64)
        mem = np.array([k[1] for k in kinds], dtype=np.int64)
        count = np.array([k[2] for k in kinds], dtype=np.int64)
        milli = np.array([k[3] for k in kinds], dtype=np.int64)
        w = np.array(list(kinds.values()), dtype=np.float64)
        if weighting == "demand":
            w = w * count * milli
        w = w / (w.sum() or 1.0)
        share = (count == 1) & (milli < capacity)
        self.cpu_steps = np.unique(cpu)
        self.mem_steps = np.unique(mem)
        self.sizes = np.unique(milli[share])
        self.counts = np.unique(count[~share])
        ic = np.searchsorted(self.cpu_steps, cpu) + 1
        im = np.searchsorted(self.mem_steps, mem) + 1
        shape = (len(self.cpu_steps) + 1, len(self.mem_steps) + 1)
        ws = np.zeros(shape + (len(self.sizes),))
        ww = np.zeros(shape + (len(self.counts),))
        for k in range(len(w)):
            if share[k]:
                ws[ic[k], im[k], np.searchsorted(self.sizes, milli[k])] += w[k]
            else:
                ww[ic[k], im[k], np.searchsorted(self.counts, count[k])] += w[k]
        # cumulative: W[i, j] = weight of kinds asking for at most the i-th CPU and j-th memory step
        self.w_share = ws.cumsum(axis=0).cumsum(axis=1)
        self.w_whole = ww.cumsum(axis=0).cumsum(axis=1)

    def frag(self, cpu: np.ndarray, free: np.ndarray, mem: np.ndarray | None = None) -> np.ndarray:
        """Expected fragmented GPU milli of each row: cpu (R,) CPU free, free (R, G) GPU milli
        free per GPU (-1 where there is no GPU), mem (R,) memory free."""
        f = np.maximum(free, 0)
        total = f.sum(axis=1)
        ic = np.searchsorted(self.cpu_steps, cpu, side="right")
        im = np.searchsorted(self.mem_steps, mem, side="right") if (self.memory and mem is not None) \
            else np.full(len(cpu), len(self.mem_steps))
        usable = total.astype(np.float64)
        if len(self.sizes):
            at_least = (f[:, :, None] * (f[:, :, None] >= self.sizes[None, None, :])).sum(axis=1)
            usable_share = (at_least * self.w_share[ic, im]).sum(axis=1)
        else:
            usable_share = 0.0
        if len(self.counts):
            whole = (free == self.capacity).sum(axis=1)
            room = (whole[:, None] >= self.counts[None, :]) * (whole * self.capacity)[:, None]
            usable_whole = (room * self.w_whole[ic, im]).sum(axis=1)
        else:
            usable_whole = 0.0
        return usable - usable_share - usable_whole
