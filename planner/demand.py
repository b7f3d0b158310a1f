"""The request distribution the controller learns online: every pending pod it sees counts once,
and what was seen decays with a half-life, so the planner's third objective keeps capacity
usable for the requests of the last hours, not only for the pods pending now.

Pure bookkeeping with an explicit clock (the caller passes the time): the plan stays a function
of the snapshot, whose `workload` this fills."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from dynpart.catalog import Catalog
from dynpart.errors import CatalogError, DynpartError, SnapshotError
from dynpart.resources import MigResource, parse_resource
from dynpart.scheduling import NodeSelectorTerm, Toleration
from dynpart.snapshot import PendingPod, RequestShare, Snapshot, validate_snapshot

# resource, count, CPU, memory, and the nodes it may use: GPU models, nodeSelector, tolerations, required affinity
Kind = tuple[str, int, int, int, tuple[str, ...], tuple[tuple[str, str], ...], tuple[Toleration, ...],
             tuple[NodeSelectorTerm, ...]]


def check_workload(workload: Sequence[RequestShare], catalog: Catalog) -> list[str]:
    """The `workload` setting against the catalog, before anything runs: a resource or GPU model
    there that does not exist would fail every plan (raised). Returned: what is doubtful, each MIG
    profile no catalog model offers (perhaps a driver's own name, docs/protocol.md: the controller
    counts it where a node's driver offers it; the simulator refuses it)."""
    try:
        validate_snapshot(Snapshot.model_construct(nodes=[], pending=[], workload=list(workload)), catalog)
    except SnapshotError as e:
        raise DynpartError("setting workload: " + "; ".join(e.problems)) from None
    known = catalog.mig_profile_names()
    doubtful = []
    for i, share in enumerate(workload):
        kind = parse_resource(share.resource)
        if isinstance(kind, MigResource) and kind.profile not in known:
            doubtful.append(f"setting workload[{i}].resource = {share.resource!r}: MIG profile {kind.profile!r} is "
                            "offered by no GPU model of the catalog")
    return doubtful


class DemandTracker:
    """`max_kinds`: the workload keeps the heaviest kinds only. Every kind costs the objective work
    on every plan, and a cluster's pods can differ in CPU and memory without end (1,000 kinds
    made a plan of 200 nodes take 10 s); the openb trace has 126 kinds of GPU pods in all."""

    def __init__(self, half_life_s: float = 3600.0, remember: int = 100_000, floor: float = 0.01,
                 max_kinds: int = 128):
        self.half_life_s = half_life_s
        self.floor = floor  # kinds whose weight decayed below this are forgotten
        self.max_kinds = max_kinds
        self._weights: dict[Kind, float] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # pods counted already (most recent last)
        self._remember = remember
        self._t: float | None = None

    def observe(self, pods: Iterable[PendingPod], now: float, versions: Mapping[str, str] | None = None) -> None:
        """Decay what was seen to `now`, then count each pod not counted before. `versions`: pod ->
        what identifies it (its uid...), where known: a pod made again under a name already
        counted (a StatefulSet's) is another pod, and counts."""
        if self._t is not None and now > self._t:
            factor = 0.5 ** ((now - self._t) / self.half_life_s)
            self._weights = {k: w * factor for k, w in self._weights.items() if w * factor >= self.floor}
        self._t = now if self._t is None else max(self._t, now)
        now_seen = 0
        for pod in pods:
            now_seen += 1
            seen = pod.name if versions is None or pod.name not in versions else f"{pod.name}\0{versions[pod.name]}"
            if seen in self._seen:
                self._seen.move_to_end(seen)
                continue
            self._seen[seen] = None
            # the least recently seen go, never a pod of this call (more pods pending at once than
            # `remember` would else push each other out and be counted again every round)
            if len(self._seen) > max(self._remember, now_seen):
                self._seen.popitem(last=False)
            # tolerations and affinity terms in a canonical order: the same nodes, the same kind
            kind = (pod.resource, pod.count, pod.cpu_milli, pod.memory_mib, tuple(sorted(set(pod.gpu_models))),
                    tuple(sorted(pod.node_selector.items())), tuple(sorted(pod.tolerations, key=repr)),
                    tuple(sorted(pod.node_affinity, key=repr)))
            self._weights[kind] = self._weights.get(kind, 0.0) + 1.0
        if len(self._weights) > 4 * self.max_kinds:  # memory stays bounded: the lightest go
            self._weights = dict(self._heaviest(2 * self.max_kinds))

    def _heaviest(self, n: int) -> list[tuple[Kind, float]]:
        return sorted(self._weights.items(), key=lambda kv: (-kv[1], repr(kv[0])))[:n]

    def workload(self) -> list[RequestShare]:
        """The `max_kinds` heaviest kinds seen, as the snapshot's workload (canonical order)."""
        return [RequestShare(resource=r, count=c, cpu_milli=cpu, memory_mib=mem, gpu_models=list(models),
                             node_selector=dict(selector), tolerations=list(tolerations), node_affinity=list(affinity),
                             weight=w)
                for (r, c, cpu, mem, models, selector, tolerations, affinity), w
                in sorted(self._heaviest(self.max_kinds), key=lambda kv: repr(kv[0]))]


def known_to(workload: Sequence[RequestShare], catalog: Catalog) -> Sequence[RequestShare]:
    """The learned shares a round's catalog can plan for: the GPU models a share names that the
    catalog no longer knows (their nodes left the cluster) are dropped from it, and a share none
    of whose models it knows is dropped (no node could host it; it must not become "any
    model"). The same list when nothing is dropped."""
    out: list[RequestShare] = []
    changed = False
    for share in workload:
        if share.gpu_models:
            known = [m for m in share.gpu_models if _knows(catalog, m)]
            if len(known) != len(share.gpu_models):
                changed = True
                if not known:
                    continue
                share = share.model_copy(update={"gpu_models": known})
        out.append(share)
    return out if changed else workload


def _knows(catalog: Catalog, model: str) -> bool:
    try:
        catalog.resolve(model)
    except CatalogError:
        return False
    return True
