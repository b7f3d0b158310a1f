"""The planner controller: watches labelled GPU nodes and pods, batches the pods that the
scheduler found unschedulable for lack of a GPU slice, calls `plan()`, writes each changed
node's desired layout as spec annotations with a new plan id, and waits for the node's agent to
acknowledge that plan id before planning that node again.

Everything that decides lives in pure modules (`cluster_view`, `batching`, `core`,
`dynpart.annotations`); this module only moves data between them and the API server."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import itertools
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kubernetes_asyncio import client
from prometheus_client import Gauge

from dynpart.annotations import decode_fencing
from dynpart.catalog import Catalog
from dynpart.errors import DynpartError, ResourceNameError
from dynpart.kube.client import Obj
from dynpart.kube.conventions import (
    PARTITIONING_LABEL,
    PLANNER_COMPONENT,
    PREFIX,
    SPEC_DRAIN,
    SPEC_PLAN,
    SPEC_PODS,
    SPEC_REVOKES,
    SPEC_TERM,
    STATUS_CAPABILITY,
    STATUS_ERROR,
    STATUS_HEARTBEAT,
    STATUS_MODE,
    STATUS_PLAN,
    STATUS_PREFIX,
)
from dynpart.kube.errors import APIConflictError, APIError, APIServerError, APITransportError
from dynpart.kube.events import object_reference
from dynpart.kube.patching import patch_node_annotations, read_node
from dynpart.kube.recording import EventRecorder, QueuedPoster, posting_to
from dynpart.kube.watching import Informer, metadata_only, object_key
from dynpart.planner import metrics
from dynpart.planner.batching import BatchWindow
from dynpart.planner.cluster_view import (
    BoundUsage,
    ClusterView,
    NodeDecodes,
    NodeViews,
    build_snapshot,
    can_revoke,
    is_batch_candidate,
    keeping_unread,
    mps_user_clashes,
    node_for_planning,
    node_gpu_model,
    node_labels_for_planning,
    planned_patches,
    pod_for_planning,
    pod_key,
    reported_slices,
    revoking_patch,
    scheduler_of,
    slice_requests,
    switch_target,
    switching_patch,
)
from dynpart.planner.loop import InFlight, PlanningLoop, PodBackOff
from dynpart.planner.session import collector_paused
from dynpart.planner.volume_topology import VolumeTopology, claim_class, claim_for_planning, class_for_planning, volume_for_planning
from dynpart.probing import Liveness
from dynpart.resources import MigResource, MpsResource, parse_resource
from dynpart.settings import PlannerSettings

log = logging.getLogger("dynpart.planner")
GAUGES_EVERY_S = 1.0  # the gauges read every pod in the cache: at most this often, not at every wake
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"  # the pods watched

__all__ = ["InFlight", "PlannerController"]


class Leadership(Protocol):
    """What the controller asks the leader election before each write (dynpart.kube.leases)."""

    term: int

    def can_write(self) -> bool: ...

    def write_time_left_s(self) -> float: ...


class Unelected:
    """The only replica (leader election off): always leads, writes no term."""

    term: int | None = None

    def can_write(self) -> bool:
        return True

    def write_time_left_s(self) -> float:
        return math.inf



# spec writes refused 409 for changes the plan did not read, written again (`_write_plan`)
CONFLICT_RETRIES = 3


def planning_facts(node: Obj) -> tuple[object, ...]:
    """What of a Node a plan is made from: its labels, its dynpart annotations (the agent's
    heartbeat aside: a fresher one changes nothing planned), its spec (taints, unschedulable) and
    allocatable; not the rest of its status (conditions, images, volumes in use, addresses),
    which the kubelet rewrites as it goes."""
    md, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    annotations = {k: v for k, v in (md.get("annotations") or {}).items()
                   if k.startswith(PREFIX) and k != STATUS_HEARTBEAT}
    labels = {k: v for k, v in (md.get("labels") or {}).items() if k not in _SELF_CHANGING_LABELS}
    # (the uid: a node deleted and made again under its name is another node)
    return (md.get("uid"), labels, annotations, md.get("deletionTimestamp"), spec, status.get("allocatable"))


class PlannerController:
    def __init__(self, api: client.ApiClient, settings: PlannerSettings, catalog: Catalog,
                 liveness: Liveness | None = None, leadership: Leadership | Unelected | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.core = client.CoreV1Api(api)
        self.clock = clock
        # every decision (batching, nodes held back, reservations, workload, the plan) is the
        # loop's, the one the simulator replays; this class moves data between it and the API server
        self.loop = PlanningLoop(settings)
        self.leadership = leadership or Unelected()
        self.liveness = liveness or Liveness()
        self.settings = settings
        self.catalog = catalog
        self.wake = asyncio.Event()
        self.leading = asyncio.Event()
        # posted in the background: a round placing hundreds of pods must not wait for the API server
        self.events = EventRecorder(
            QueuedPoster(posting_to(self.core, PLANNER_COMPONENT), on_drop=metrics.EVENTS_DROPPED.labels("queue_full").inc,
                         may_post=lambda: self.leadership.can_write()),
            settings.kube, on_drop=metrics.EVENTS_DROPPED.labels("memory_full").inc,
            on_spam=metrics.EVENTS_DROPPED.labels("spam").inc)
        self._status: dict[str, dict[str, str]] = {}  # status annotations (heartbeat aside) seen per node
        self._admits: dict[str, str] = {}  # per node: what decides which pods it admits (`_admission`)
        self._to_adopt: set[str] = set()  # nodes with an unacknowledged spec of an earlier leader
        # nodes with a late unacknowledged spec of an earlier leader whose pods another plan holds
        self._to_revoke: set[str] = set()
        self._reserved_for: dict[str, set[str]] = {}  # pod -> the plan ids it was reserved for (once per plan)
        self._gone: list[tuple[Obj, InFlight]] = []  # plans in flight on deleted nodes, their pods not yet told
        self._term_seen: int | None = None  # the leader term the state above was built under
        # for the gauges (refresh_gauges): the pods the last round could not plan, the catalog it
        # planned with, and per node its capability report with how it differs from the catalog
        self._invalid_pods: set[str] = set()
        self._round_catalog = catalog
        self._disagreements: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._gauges_at: float | None = None  # when refresh_gauges last ran (it reads every pod)
        self._elsewhere: set[str] = set()  # pods the last round found meant for other nodes (not in the gauge)
        # the batch candidates of the pod cache, kept by the watch (_on_pod): every node status change
        # and every step reads them, and scanning 50,000 cached pods takes about 0.2 s
        self._waiting: set[str] = set()
        self._schedulers_told: set[str] = set()  # scheduler names whose pods were said not planned
        self._deferred: dict[str, str] = {}  # pods the last round left to the next -> for whom (ClusterView.deferred)
        self._awaiting_claims: dict[str, list[str]] = {}  # claim -> pods the last round left for it (_on_claim)
        # volume name, class name -> the claims of `_awaiting_claims` naming it, as the round left them
        # (a claim that changes since wakes its pods itself): a volume or class event looks up its own
        self._awaiting_by: dict[tuple[str, str], list[str]] = {}
        # of those, the ones left for a pod the round's plan could not place (not: placed, but its
        # node's write failed; nor a round that never planned): only these are not left again
        self._left_for_unplaced: dict[str, str] = {}
        self._not_left_for: dict[str, frozenset[str]] = {}  # pod -> older pods it is not left for again
        # what the last round logged: a lasting problem or unplaced pod is logged (at INFO or
        # WARNING) when it appears or changes, not once a round
        self._problems_logged: set[str] = set()
        # (node, resource) -> (the plan its agent acknowledged, when a round first found free
        # slices there beyond allocatable with that plan)
        self._unallocatable_since: dict[tuple[str, str], tuple[str | None, float]] = {}
        # (node, resource) of those -> its allocatable count as that round read it: the node watch
        # ends the clock when the kubelet writes another (rounds run only while pods wait, and a
        # lag that ended between two of them is not one that lasted)
        self._unallocatable_count: dict[tuple[str, str], Any] = {}
        self._unplaced_logged: dict[str, str] = {}  # pod -> the reason logged
        self._gauges_set = False
        self._ids = itertools.count(1)
        # each node's agent annotations as a round decoded them, for the next round (only rounds use it,
        # one at a time, in their thread): at 2,000 nodes decoding them all took about a second a round
        self._decodes = NodeDecodes()
        self._usage = BoundUsage()  # the bound pods' requests as rounds read them
        self._node_views = NodeViews()  # each node's view as a round built it
        self.nodes = Informer(self.core.list_node, self._on_node, name="nodes", label_selector=PARTITIONING_LABEL,
                              settings=settings.kube, transform=node_for_planning,
                              on_beat=lambda: self.liveness.beat("watch nodes"))
        # pods that ended are not kept (they hold nothing): one that ends arrives as DELETED
        self.pods = Informer(self.core.list_pod_for_all_namespaces, self._on_pod, name="pods", settings=settings.kube,
                             field_selector=LIVE_PODS, transform=pod_for_planning,
                             on_beat=lambda: self.liveness.beat("watch pods"))
        # the labels of the other nodes (those not labelled for dynpart: CPU nodes, other GPU pools):
        # the scheduler's topology spread counts each as a domain, and the pods bound there count in
        # their domains (planner/pod_conflicts.py); read at each round, no round of their own
        # (as metadata only: a node's status is most of its size, and only its labels are read)
        self.other_nodes = Informer(metadata_only(api, "/api/v1/nodes"), _ignore, name="other nodes", settings=settings.kube,
                                    label_selector=f"!{PARTITIONING_LABEL}", transform=node_labels_for_planning,
                                    on_beat=lambda: self.liveness.beat("watch other nodes"))
        # the claims and volumes whose node affinity narrows where the pods using them can run
        # (planner/volume_topology.py): read at each round, no round of their own
        self.claims = Informer(self.core.list_persistent_volume_claim_for_all_namespaces, self._on_claim, name="claims",
                               settings=settings.kube, transform=claim_for_planning,
                               on_beat=lambda: self.liveness.beat("watch claims"))
        self.volumes = Informer(self.core.list_persistent_volume, self._on_volume, name="volumes", settings=settings.kube,
                                transform=volume_for_planning, on_beat=lambda: self.liveness.beat("watch volumes"))
        # the StorageClasses: whether a claim not bound yet binds immediately (then the scheduler
        # places its pods nowhere until it is bound) or on the node the pod goes to
        self.classes = Informer(client.StorageV1Api(api).list_storage_class, self._on_class, name="storage classes",
                                settings=settings.kube, transform=class_for_planning,
                                on_beat=lambda: self.liveness.beat("watch storage classes"))

    @property
    def window(self) -> BatchWindow:
        return self.loop.window

    @property
    def in_flight(self) -> dict[str, InFlight]:
        return self.loop.in_flight

    @property
    def reserved(self) -> dict[str, tuple[str, float]]:
        return self.loop.reserved

    # --- leadership -----------------------------------------------------------------------

    def set_leading(self, leader: bool) -> None:
        """The leader election's verdict. Losing the lease drops what this replica remembered as
        leader: another leader may write meanwhile, and a replica that leads again must start
        from the annotations as a new leader does, never revoke or wait for a plan of its own
        that another leader has since replaced."""
        if not leader:
            self._forget_leader_state()
            self.clear_gauges()  # a standby exports none: another replica's are the cluster's now
        (self.leading.set if leader else self.leading.clear)()
        self.wake.set()

    def highest_written_term(self) -> int | None:
        """The highest leader term on the nodes' specs (-1: none), None until the node cache is
        synced: the lease's `term_floor`. A lease made again restarts its count at 0, and a new
        leader's term must stay above every earlier leader's, or agents could not fence their late
        writes (dynpart.kube.leases)."""
        if not self.nodes.synced.is_set():
            return None
        terms = (decode_fencing(node["metadata"].get("annotations") or {}, [])[0] for node in self.nodes.cache.values())
        return max((t for t in terms if t is not None), default=-1)

    def _check_term(self) -> None:
        """A term that changed without a loss being signalled (the event loop stalled past the
        lease, and the lease was taken over and handed back): the same as a loss."""
        term = self.leadership.term
        if term != self._term_seen:
            if self._term_seen is not None:
                self._forget_leader_state()
            self._term_seen = term

    def _forget_leader_state(self) -> None:
        self.loop.forget_leader_state()
        self._reserved_for.clear()
        self._to_adopt.clear()
        self._to_revoke.clear()
        self._gone.clear()
        self._deferred.clear()
        self._left_for_unplaced.clear()
        self._not_left_for.clear()
        self.events.clear()  # Events queued as leader may have been withheld (QueuedPoster.may_post)
        self._unallocatable_since.clear()  # (a standby runs no round: its clocks did not run)
        self._unallocatable_count.clear()

    # --- watches --------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: Obj) -> None:
        key = pod_key(pod)
        try:
            candidate = kind != "DELETED" and is_batch_candidate(pod)
        except DynpartError:
            candidate = True  # unreadable (a quantity): the round says what is wrong with it (DynpartInvalid)
        if candidate:
            self._waiting.add(key)
            if self.loop.pod_waiting(key, self.clock(), _pod_version(pod)):
                self.wake.set()
        else:
            self._waiting.discard(key)
            self.loop.pod_done(key)
            if kind == "DELETED" or (pod.get("spec") or {}).get("nodeName"):
                self.events.forget(pod)  # no Event is posted about it again: room for others
            if kind == "DELETED" and (pod.get("spec") or {}).get("nodeName") and self._waiting:
                # a bound pod ended or went (the watch keeps only live pods): the CPU, memory, pod
                # slot and host ports it held on its node, and the domain its anti-affinity kept
                # others from, are free now, and the scheduler retries its pods on that (a pod
                # deleted); its GPU slice freed shows in its agent's status, which wakes them too
                self.loop.facts_changed(self._candidates(), self.clock())
                self.wake.set()

    def _on_claim(self, kind: str, claim: Obj) -> None:
        # a claim the last round found missing (or being deleted, Lost, another pod's) changed: its
        # pods are planned again now, not at the next resync (an Unplaceable Event a watch lag
        # caused, a PVC made just after its pod, an ephemeral volume's claim made by its controller)
        md = claim.get("metadata") or {}
        waiting = self._awaiting_claims.pop(f"{md.get('namespace')}/{md.get('name')}", None)
        if waiting:
            self.loop.facts_changed(waiting, self.clock())
            self.wake.set()

    def _wake_awaiting(self, claims: list[str]) -> None:
        """The pods the last round left for these claims (those still waiting) are planned again now."""
        woken = False
        for key in claims:
            pods = self._awaiting_claims.pop(key, None)
            if pods is not None:
                self.loop.facts_changed(pods, self.clock())
                woken = True
        if woken:
            self.wake.set()

    def _index_awaiting(self) -> None:
        """`_awaiting_by` of the claims the round left pods for, as the claims cache has them now."""
        self._awaiting_by = {}
        for key in self._awaiting_claims:
            claim = self.claims.cache.get(key)
            if claim is None:
                continue
            volume = (claim.get("spec") or {}).get("volumeName")
            if volume:
                self._awaiting_by.setdefault(("volume", str(volume)), []).append(key)
            self._awaiting_by.setdefault(("class", str(claim_class(claim))), []).append(key)

    def _on_volume(self, kind: str, volume: Obj) -> None:
        # a PersistentVolume made: the pods the last round left for a claim bound to it (a volume
        # not listed yet, or not made yet) are planned again now
        name = (volume.get("metadata") or {}).get("name")
        self._wake_awaiting(self._awaiting_by.pop(("volume", str(name)), []))

    def _on_class(self, kind: str, storage_class: Obj) -> None:
        # a StorageClass made or changed: the pods the last round left for a claim of that class
        # not bound yet (its class missing, or binding immediately) are planned again now
        name = (storage_class.get("metadata") or {}).get("name")
        self._wake_awaiting(self._awaiting_by.pop(("class", str(name)), []))

    def _claims_changed_meanwhile(self, claims: Mapping[str, Obj], volumes: Mapping[str, Obj],
                                  classes: Mapping[str, Obj] | None) -> None:
        """The pods the round left for a claim whose claim, volume or class the watches changed
        while it planned (from the copies it read): their callbacks ran before the round said
        who waits, and woke no one. Planned again now (cached objects are replaced on change)."""
        def read(key: str, claims: Mapping[str, Obj], volumes: Mapping[str, Obj],
                 classes: Mapping[str, Obj] | None) -> tuple[Obj | None, ...]:
            claim = claims.get(key)
            if claim is None:
                return None, None, None
            name = (claim.get("spec") or {}).get("volumeName")
            return claim, volumes.get(str(name)) if name else None, (classes or {}).get(claim_class(claim))
        now = self.classes.cache if self.classes.synced.is_set() else None
        moved = [key for key in self._awaiting_claims if any(
            a is not b for a, b in zip(read(key, claims, volumes, classes), read(key, self.claims.cache,
                                                                                 self.volumes.cache, now)))]
        self._wake_awaiting(moved)

    def _on_node(self, kind: str, node: Obj) -> None:
        # (a node made again under its name while no watch ran: the informer's relist reports the
        # old one DELETED first)
        name = node["metadata"]["name"]
        ann = node["metadata"].get("annotations") or {}
        now = self.clock()
        self._acknowledged(name, ann, now)
        if self._unallocatable_since:
            alloc = None if kind == "DELETED" else (node.get("status") or {}).get("allocatable") or {}
            for key in [k for k in self._unallocatable_since if k[0] == name]:
                if alloc is None or alloc.get(key[1]) != self._unallocatable_count.get(key):
                    # the kubelet wrote another count (or the node went): that lag is over
                    del self._unallocatable_since[key]
                    self._unallocatable_count.pop(key, None)
        # New facts about the node's GPUs (a plan applied, a slice freed or taken, the node gone):
        # pods still waiting may fit now, or only now be planned on it, so they join the batch.
        status = None if kind == "DELETED" else {k: v for k, v in ann.items()
                                                 if k.startswith(STATUS_PREFIX) and k != STATUS_HEARTBEAT}
        if kind == "DELETED":
            self.events.forget(node)
            self._to_adopt.discard(name)
            self._to_revoke.discard(name)
            # nothing applies its plan now, and a node made later under its name is a new one
            flight = self.loop.node_gone(name, now)
            if flight is not None and flight.pods:
                self._gone.append((node, flight))  # told at the next step (_expire_acks)
        if status != self._status.get(name):
            before = self._status.get(name)
            if status is None:
                self._status.pop(name, None)
            else:
                self._status[name] = status
            if before is None or status is None or _room_may_have_grown(before, status):
                self.loop.facts_changed(self._candidates(), now)
                self.wake.set()
        # labels, taints, the cordon or allocatable CPU and memory changed (an uncordon, a taint
        # removed): pods may fit there now, planned without waiting for the resync
        admits = None if kind == "DELETED" else _admission(node)
        if admits != self._admits.get(name):
            seen = name in self._admits
            if admits is None:
                self._admits.pop(name, None)
            else:
                self._admits[name] = admits
            if seen and admits is not None:
                self.loop.facts_changed(self._candidates(), now)
                self.wake.set()

    def _acknowledged(self, name: str, ann: dict[str, str], now: float) -> None:
        """The node's status-plan, if it is the plan in flight there and its spec still, acknowledges
        it. The agent's status writes have no precondition: an agent still applying a plan that is
        being revoked can report it over the revocation, which the watch may deliver before the
        revocation's answer (the plan still in flight then); that plan's slices are about to go."""
        acked = ann.get(STATUS_PLAN)
        flight = (self.loop.acknowledged(name, acked, now)
                  if acked and ann.get(SPEC_PLAN, acked) == acked else None)
        if flight is None:
            return
        for key in flight.pods:  # their slices exist now: theirs until the scheduler binds them
            self._reserved_for.setdefault(key, set()).add(flight.plan_id)
        metrics.PLAN_ACKS.inc()
        metrics.PLAN_ACK_SECONDS.observe(now - flight.sent_at)
        log.info("plan acknowledged", extra={"fields": {"node": name, "plan": flight.plan_id,
                                                        "after_s": round(now - flight.sent_at, 3)}})
        self.wake.set()

    def _written(self, name: str, plan_id: str, pods: Iterable[str], now: float, revoking: bool = False) -> None:
        """A plan written: in flight until acknowledged. The watch may have delivered the
        acknowledgement while the write's response was awaited (it found nothing in flight then):
        the node as cached now may acknowledge it already."""
        self.loop.written(name, plan_id, pods, now, revoking)
        node = self.nodes.cache.get(name)
        if node is not None:
            self._acknowledged(name, node["metadata"].get("annotations") or {}, now)

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        # a watch beats at each list page, watch start and event (bookmarks too), and a silent one is
        # dropped after watch_idle_timeout_s and started again; the loop turns at least every resync_s
        kube = self.settings.kube
        watch_limit_s = kube.watch_timeout_s + kube.watch_idle_timeout_s + kube.backoff_max_s
        for informer in (self.nodes, self.pods):
            self.liveness.expect(f"watch {informer.name}", watch_limit_s)

        async def optional(informer: Informer) -> None:
            # claims, volumes and storage classes only concern pods that use volumes: a list they
            # keep failing (an RBAC of the cluster's own that leaves them out) must neither hold
            # planning back nor fail the liveness probe; they are watched as the others once listed
            task = asyncio.create_task(informer.run())
            try:
                await informer.synced.wait()
                self.liveness.expect(f"watch {informer.name}", watch_limit_s)
                await task
            finally:
                task.cancel()
        tasks = [asyncio.create_task(self.nodes.run()), asyncio.create_task(self.pods.run()),
                 asyncio.create_task(optional(self.claims)), asyncio.create_task(optional(self.volumes)),
                 asyncio.create_task(optional(self.classes)), asyncio.create_task(optional(self.other_nodes))]
        try:
            await self.nodes.synced.wait()
            await self.pods.synced.wait()
            # the loop is watched from its start: the first lists (minutes for 100,000 pods on a
            # throttled API server) beat the watches' heartbeats page by page, not the loop's
            self.liveness.expect("planning loop", max(60.0, 4 * self.settings.resync_s))
            log.info("caches synced", extra={"fields": {"nodes": len(self.nodes.cache), "pods": len(self.pods.cache)}})
            while True:
                try:
                    await self._step()
                except Exception:  # a bug hit by some object: log it and go on, as a crash loop would not help
                    metrics.PLAN_ERRORS.labels("internal").inc()
                    log.exception("planning step failed; the next starts from the caches again")
                    await asyncio.sleep(1.0)
        finally:
            for t in tasks:
                t.cancel()

    async def _step(self) -> None:
        self.liveness.beat("planning loop")
        # a standby keeps its batch (it plans it on taking over) but waits for a wake-up, not for the batch
        wait = self.window.wait_s(self.clock()) if self.leading.is_set() else None
        timeout = self.settings.resync_s if wait is None else wait
        self.wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.01, timeout)):
                await self.wake.wait()
        if not self.leading.is_set():
            self.clear_gauges()
            return
        now = self.clock()
        await self._expire_acks(now)
        if self.loop.due(now, bool(self.window.members) or bool(self._candidates()) or self._switches_wanted()):
            self.loop.begin_round(now)
            await self.plan_round()
        if self._gauges_at is None or self.clock() - self._gauges_at >= GAUGES_EVERY_S or not self._gauges_set:
            self.refresh_gauges(self.clock())

    # --- gauges ---------------------------------------------------------------------------

    def refresh_gauges(self, now: float) -> None:
        """Set the gauges from the caches as they are now (the leader's steps, at most every
        GAUGES_EVERY_S, whether or not a round runs): the pods waiting, the request distribution decayed to `now`, and the
        nodes whose capability report differs from the catalog. A pod's resource is its label
        only when dynpart can plan it, else `invalid`: a pod can ask for any name."""
        self._gauges_at, self._gauges_set = now, True
        label = self._resource_label()
        pending: Counter[str] = Counter()
        for key in self._waiting - self._elsewhere:  # other pools' pods are not dynpart's
            if (pod := self.pods.cache.get(key)) is not None:
                wanted = _slices_read(pod)
                pending[metrics.INVALID if key in self._invalid_pods or len(wanted) != 1 else label(next(iter(wanted)))] += 1
        _set_gauge(metrics.PENDING_PODS, pending)
        weights: dict[str, float] = {}
        if self.settings.workload:
            shares = [(share.resource, share.weight) for share in self.settings.workload]
        else:  # what the rounds learnt, decayed since the last one (pure: the rounds' own decay is theirs)
            demand = self.loop.demand
            decay = 0.5 ** (max(0.0, now - self.loop.prepared_at) / demand.half_life_s)
            shares = [(share.resource, share.weight * decay) for share in demand.workload()
                      if share.weight * decay >= demand.floor]
        for resource, weight in shares:
            weights[label(resource)] = weights.get(label(resource), 0.0) + weight
        _set_gauge(metrics.WORKLOAD_WEIGHT, weights)
        disagreements: Counter[str] = Counter()
        for name, node in self.nodes.cache.items():
            md = node.get("metadata") or {}
            report = (md.get("annotations") or {}).get(STATUS_CAPABILITY)
            if not isinstance(report, str):
                continue
            seen = self._disagreements.get(name)
            if seen is None or seen[0] != report:  # read a report once, not at every step
                try:
                    notes = node_gpu_model(name, md.get("labels") or {}, md.get("annotations") or {}, self.catalog).disagreements
                except Exception:  # a report the round reports as a problem: no disagreement to count
                    notes = ()
                seen = self._disagreements[name] = (report, notes)
            if seen[1]:
                disagreements[name] = len(seen[1])
        for name in [n for n in self._disagreements if n not in self.nodes.cache]:
            del self._disagreements[name]
        _set_gauge(metrics.CATALOG_DISAGREEMENTS, disagreements)

    def _resource_label(self) -> Callable[[str], str]:
        """A resource's label value: itself when a GPU of the last round's catalog offers it (a MIG
        profile it knows, an MPS slice no bigger than its largest GPU, a whole GPU), else `invalid`."""
        profiles = self._round_catalog.mig_profile_names()
        largest = max((m.mps_capacity_gb for m in self._round_catalog.models.values()), default=0)
        labels: dict[str, str] = {}

        def label(resource: str) -> str:
            if resource not in labels:
                try:
                    res = parse_resource(resource)
                    ok = not ((isinstance(res, MigResource) and res.profile not in profiles)
                              or (isinstance(res, MpsResource) and res.size > largest))
                except ResourceNameError:
                    ok = False
                labels[resource] = resource if ok else metrics.INVALID
            return labels[resource]
        return label

    def clear_gauges(self) -> None:
        metrics.clear_cluster_gauges()
        self._gauges_set = False  # set again at the next leader step

    def _switches_wanted(self) -> bool:
        """A node relabelled to the other mode is sent its switching spec by a round (at the
        next resync), even when no pod waits: its agent then leaves the old mode while idle."""
        return any(switch_target(n) is not None and n.get("metadata", {}).get("name") not in self.loop.in_flight
                   for n in self.nodes.cache.values())

    def _not_to_defer(self) -> dict[str, frozenset[str]]:
        """Pod -> the older pods rounds left it for and whose plan could not place them (still
        waiting, not in flight, not reserved): not left again for those (it still is for any other),
        or unplaceable pods would hold it for ever, each round leaving it for another of them in
        turn. Kept from round to round (the round that plans calls this once) while those stay
        unplaced. An older pod a plan placed but that is not in flight (its node's write failed) is
        not one of them: the younger is left for it again, or both would be planned in one round,
        the scheduler then refusing one of them on the node they share."""
        held = self.loop.held_pods()

        def unplaced(pod: str) -> bool:
            return pod in self._waiting and pod not in held and pod not in self.loop.reserved

        pairs = [*((p, o) for p, olders in self._not_left_for.items() for o in olders), *self._left_for_unplaced.items()]
        out: dict[str, set[str]] = {}
        for pod, older in pairs:
            if pod in self._waiting and unplaced(older):
                out.setdefault(pod, set()).add(older)
        self._not_left_for = {p: frozenset(o) for p, o in out.items()}
        return dict(self._not_left_for)

    def _candidates(self) -> list[str]:
        return sorted(self._waiting)

    async def _expire_acks(self, now: float) -> None:
        """A plan its agent has not acknowledged in time is revoked (replaced by the node's
        reported layout, no pods): only then are its pods planned elsewhere, and the old plan can
        never be applied after they went. A revocation that is not acknowledged either stays in
        flight: the node is left out until its agent answers, and nothing is written again."""
        self._check_term()
        gone, self._gone = self._gone, []
        for name in [n for n in self.loop.in_flight if n not in self.nodes.cache]:
            # gone from the cache without its deletion seen here (it has always been, so far), a
            # revocation included (overdue() never returns one): nothing can apply it any more
            lost = self.loop.node_gone(name, now)
            self.wake.set()
            if lost is not None and lost.pods:
                gone.append(({"kind": "Node", "metadata": {"name": name}}, lost))
        for obj, lost in gone:
            log.info("node deleted with a plan in flight", extra={"fields": {
                "node": obj["metadata"]["name"], "plan": lost.plan_id, "pods": sorted(lost.pods)}})
            await self._not_applied(obj, lost, "the node was deleted", waited=False)
        for name, flight in self.loop.overdue(now):
            # a read and a revocation per node, each bounded; plans to hundreds of nodes whose
            # agents all stopped answering fall overdue together: beat per node, as plan_round does
            self.liveness.beat("planning loop")
            if self.loop.in_flight.get(name) is not flight:
                continue  # acknowledged (or released) while an earlier node's revocation was awaited
            node = self.nodes.cache.get(name)
            if node is None:  # the node is gone: so is its plan
                self.loop.forget_node(name)
                continue
            spec_plan = (node["metadata"].get("annotations") or {}).get(SPEC_PLAN)
            if spec_plan != flight.plan_id:
                # the cache can lag (a watch stalled or relisting): replaced only if the API
                # server says so, else the pods would go elsewhere while the agent applies our plan
                try:
                    node = await read_node(self.core, name)
                    spec_plan = (node.get("metadata", {}).get("annotations") or {}).get(SPEC_PLAN)
                except APIError as e:
                    log.info("could not read the node; will look again", extra={"fields": {"node": name,
                                                                                         "error": str(e)}})
                    continue
                if self.loop.in_flight.get(name) is not flight:
                    continue  # acknowledged while it was read
            if spec_plan != flight.plan_id:
                # another writer (a leader meanwhile) replaced the plan: never revoke theirs; the
                # node's spec as it is now decides (_awaiting_from_annotations reads it again)
                log.info("the plan in flight was replaced on the node", extra={"fields": {
                    "node": name, "plan": flight.plan_id, "spec": spec_plan}})
                self._release(name, flight, now)
                continue
            metrics.PLAN_ERRORS.labels("ack_timeout").inc()
            log.warning("no acknowledgement from the node's agent", extra={"fields": {
                "node": name, "plan": flight.plan_id, "waited_s": self.settings.ack_timeout_s}})
            if not self.leadership.can_write():
                return
            plan_id = self._new_plan_id()
            patch = revoking_patch(node, self.catalog, plan_id, self.leadership.term)
            if patch is None:
                # the node cannot be read any more (taken out of dynpart, its status unreadable):
                # nothing to revoke with, and its plan is not waited for (_awaiting_from_annotations)
                await self._not_applied(node, flight, "the node can no longer be planned")
                self._release(name, flight, now)
                continue
            try:
                await self._patch_as_leader(name, patch, node["metadata"].get("resourceVersion"))
            except APIError as e:  # a conflict included: the node changed, its next state decides
                log.info("could not revoke the plan; will try again", extra={"fields": {"node": name, "error": str(e)}})
                continue
            self._written(name, plan_id, (), now, revoking=True)
            why = (node["metadata"].get("annotations") or {}).get(STATUS_ERROR) or "its agent did not answer"
            self.loop.facts_changed(flight.pods, now)  # planned again, elsewhere or here
            await self._not_applied(node, flight, why)
            self.wake.set()
            await self._event(node, "PlanRevoked", f"plan {flight.plan_id} was not acknowledged within "
                              f"{self.settings.ack_timeout_s:g} s: replaced by plan {plan_id}, the node's layout as its "
                              f"agent last reported it; its {len(flight.pods)} pod(s) are planned again", warning=True)
        await self._revoke_again(now)

    async def _revoke_again(self, now: float) -> None:
        """A revocation asks for the node's layout as its agent last reported it; if the agent
        then reports other GPUs than that (it carved the old plan's slices before going down, and
        a pod was bound to one meanwhile), it can never hold the revocation (a used slice is never
        destroyed) and the node would stay out of every round while that pod runs. So a
        revocation unacknowledged for `ack_timeout_s` is written again from the report as it is
        now, where that differs; an agent silent since gets nothing new (the report is the same)."""
        for name, flight in self.loop.stale_revocations(now):
            self.liveness.beat("planning loop")
            if self.loop.in_flight.get(name) is not flight:
                continue
            flight.compared_at = now
            node = self.nodes.cache.get(name)
            ann = (node["metadata"].get("annotations") or {}) if node is not None else {}
            if node is None or ann.get(SPEC_PLAN) != flight.plan_id or ann.get(STATUS_PLAN) == flight.plan_id:
                continue  # gone, replaced or acknowledged: the node's own paths see to it
            if not self.leadership.can_write():
                return
            plan_id = self._new_plan_id()
            patch = revoking_patch(node, self.catalog, plan_id, self.leadership.term)
            if patch is None or not set(patch) - {SPEC_PLAN, SPEC_REVOKES, SPEC_TERM}:
                continue  # the report is what the revocation asks: its agent has not answered since
            try:
                await self._patch_as_leader(name, patch, node["metadata"].get("resourceVersion"))
            except APIError as e:
                log.info("could not write the revocation again; will try again", extra={"fields": {
                    "node": name, "error": str(e)}})
                continue
            self._written(name, plan_id, (), now, revoking=True)
            self.wake.set()
            await self._event(node, "PlanRevoked", f"revocation {flight.plan_id} was not acknowledged within "
                              f"{self.settings.ack_timeout_s:g} s and the node's agent reports other GPUs than it "
                              f"asks: replaced by plan {plan_id}, the node's layout as its agent reports it now",
                              warning=True)

    def _release(self, name: str, flight: InFlight, now: float) -> None:
        """Stop waiting for a plan in flight: its pods are planned again."""
        self.loop.forget_node(name)
        self.loop.facts_changed(flight.pods, now)
        self.wake.set()

    async def _not_applied(self, node: Obj, flight: InFlight, why: str, waited: bool = True) -> None:
        when = f" within {self.settings.ack_timeout_s:g} s" if waited else ""
        for key in flight.pods:
            await self._event(self.pods.cache.get(key), "PlanNotApplied",
                              f"dynpart planned this pod on node {node['metadata']['name']} (plan {flight.plan_id}), "
                              f"but the node's agent did not apply that plan{when} "
                              f"({' '.join(why.split())[:300]}); it is planned again", warning=True)

    def _awaiting_from_annotations(self) -> set[str]:
        """Nodes not to plan this round: those whose written plan is not acknowledged (also
        after a restart or a new leader: the spec names the pods it planned there, which are held
        back), and those whose agent has not reported yet: what is on their GPUs is unknown, so
        planning them could only guess. An unacknowledged spec of an earlier leader (an older term,
        which agents refuse to apply) is adopted: its term is rewritten to this leader's, so that
        its agent applies it and its pods stay where they were planned; unless another plan holds
        or reserves one of its pods (a deposed leader's write that landed late): it is revoked then,
        never applied beside that plan. Specs are taken newest first, so a pod two of them name
        stays with the newer."""
        out = set(self.in_flight)
        found: list[tuple[str, str, int | None, tuple[str, ...], bool]] = []
        for node in self.nodes.cache.values():
            ann = node["metadata"].get("annotations") or {}
            name = node["metadata"]["name"]
            if STATUS_MODE not in ann:
                out.add(name)
            elif ann.get(SPEC_PLAN) and ann.get(SPEC_PLAN) != ann.get(STATUS_PLAN):
                out.add(name)
                if name in self.in_flight or not can_revoke(node, self.catalog):
                    continue  # known; or its plan could never be revoked: its pods are not held for it
                term, pods = decode_fencing(ann, [])
                # a revocation (spec-revokes) is in flight as one: never revoked in turn
                found.append((name, ann[SPEC_PLAN], term, pods, SPEC_REVOKES in ann))
        mine, now = self.leadership.term, self.clock()
        for name, plan_id, term, pods, revokes in sorted(found, key=lambda f: _newness(f[2], f[1]), reverse=True):
            older = mine is not None and (term is None or term < mine)
            # pods another plan holds: a spec written late (a deposed leader's, or a write whose
            # answer was lost), or found again on a node that left dynpart and came back while
            # its pods were planned elsewhere; of this term too, which its agent would apply
            held = self.loop.held_pods() | {k for k, (n, _) in self.reserved.items() if n != name}
            if held.intersection(pods):
                self._to_adopt.discard(name)
                self._to_revoke.add(name)
                continue
            self._to_revoke.discard(name)
            self.loop.written(name, plan_id, pods, now, revoking=revokes)
            if older:
                self._to_adopt.add(name)
        return out

    async def _adopt(self) -> None:
        """Rewrite the term of the earlier leaders' unacknowledged specs (nothing else: the plan id,
        layout and pods stay), and revoke those whose pods another plan holds. The write carries the
        node's resourceVersion: a spec that changed meanwhile is read again on the next round."""
        for name in sorted(self._to_revoke):
            self.liveness.beat("planning loop")  # a write per node (a new leader may adopt hundreds)
            await self._revoke_late(name)
        for name in sorted(self._to_adopt):
            self.liveness.beat("planning loop")
            node = self.nodes.cache.get(name)
            if node is None or not self.leadership.can_write():
                continue
            try:
                await self._patch_as_leader(name, {SPEC_TERM: str(self.leadership.term)},
                                            node["metadata"].get("resourceVersion"))
            except APIError as e:
                log.info("could not adopt the node's plan; will try again", extra={"fields": {"node": name, "error": str(e)}})
                continue
            self._to_adopt.discard(name)
            log.info("adopted an earlier leader's plan", extra={"fields": {
                "node": name, "plan": (node["metadata"].get("annotations") or {}).get(SPEC_PLAN),
                "term": self.leadership.term}})

    async def _revoke_late(self, name: str) -> None:
        """Replace an unacknowledged spec whose pods another plan holds (written late, after this
        leader planned them elsewhere, or left on a node that came back) by the node's reported
        layout: adopting it, or its agent applying it, would put those pods on two nodes."""
        node = self.nodes.cache.get(name)
        if node is None or not self.leadership.can_write():
            return
        ann = node["metadata"].get("annotations") or {}
        late = ann.get(SPEC_PLAN)
        term, pods = decode_fencing(ann, [])
        plan_id = self._new_plan_id()
        patch = revoking_patch(node, self.catalog, plan_id, self.leadership.term)
        if patch is None:
            return  # it cannot be read any more: nothing to revoke with, and nothing held for it
        try:
            await self._patch_as_leader(name, patch, node["metadata"].get("resourceVersion"))
        except APIError as e:
            log.info("could not revoke the late plan; will try again", extra={"fields": {"node": name, "error": str(e)}})
            return
        self._to_revoke.discard(name)
        now = self.clock()
        self._written(name, plan_id, (), now, revoking=True)
        self.loop.facts_changed(pods, now)  # those no other plan holds are planned again
        self.wake.set()
        held = sorted(self.loop.held_pods().union(self.reserved).intersection(pods))
        log.info("revoked a late plan", extra={"fields": {"node": name, "plan": late, "term": term,
                                                          "held_elsewhere": held}})
        await self._event(node, "PlanRevoked", f"plan {late} (term {term}) names pods already planned elsewhere "
                          f"({', '.join(held)}): written late, or left on the node while it was out of dynpart; "
                          f"replaced by plan {plan_id}, the node's layout as its agent last reported it", warning=True)

    def _reservations(self) -> dict[str, str]:
        """The reservations still standing: pod -> node. One ends when its pod is bound (or gone)
        or after reservation_s; the pod is then planned like any other if it still waits. Pods
        named by an acknowledged spec that this replica never saw acknowledged (it restarted, or
        took over as leader) are reserved too, once per plan, and only on the newest acknowledged
        spec naming them (an older one's slice went to other pods long ago, or its plan was taken
        over by the newer): what is in flight lives in the cluster, not in one process."""
        now = self.clock()
        newest: dict[str, tuple[tuple[int, int, str], str, str]] = {}  # pod -> (newness, plan id, node)
        for node in self.nodes.cache.values():
            ann = node["metadata"].get("annotations") or {}
            plan_id = ann.get(SPEC_PLAN)
            if not plan_id or plan_id != ann.get(STATUS_PLAN) or SPEC_PODS not in ann:
                continue
            term, pods = decode_fencing(ann, [])
            order = _newness(term, plan_id)
            for key in pods:
                if key not in newest or order > newest[key][0]:
                    newest[key] = (order, plan_id, node["metadata"]["name"])
        held = self.loop.held_pods()  # planned again since, a plan in flight (newer) has them
        for key, ((_, written_ms, _), plan_id, name) in sorted(newest.items()):
            pod = self.pods.cache.get(key)
            if key in self.reserved or key in held or plan_id in self._reserved_for.get(key, ()) or pod is None:
                continue
            if _created_after(pod, written_ms):
                continue  # a pod of the same name made since (recreated): the plan was not for it
            if not (pod.get("spec") or {}).get("nodeName"):
                self.loop.reserve(key, name, now)
                self._reserved_for.setdefault(key, set()).add(plan_id)

        def bound_or_gone(key: str) -> bool:
            pod = self.pods.cache.get(key)
            return pod is None or bool((pod.get("spec") or {}).get("nodeName"))
        out = self.loop.reservations(now, bound_or_gone)
        self._release_taken(out, now)
        # kept while a spec still names the pod: one recreated under its name is not reserved for it
        for key in [k for k in self._reserved_for if k not in self.pods.cache and k not in newest]:
            del self._reserved_for[key]
        return out

    def _release_taken(self, reserved: dict[str, str], now: float) -> None:
        """End at once the reservations whose slices the kube-scheduler gave to other pods (it
        binds any pod that fits, so in a burst of alike requests a new slice often goes to another
        pod than the one it was made for; that pod's own slice, if it had one, then serves someone
        else, and the reserved pod would wait reservation_s for nothing). A node's slices of a
        resource are those its agent reports, which after the acknowledgement are the plan's: the
        agent acknowledges only a layout the node holds, and with the built-in device plugin only
        once the kubelet holds the devices. When the pods bound there asking for the resource
        (bindings are facts at once; allocatable lags) need every one of those slices, none is left
        for the reserved pods beyond them: they are planned again now."""
        if not reserved:
            return
        requests = {key: slice_requests(self.pods.cache[key]) for key in reserved}
        nodes = set(reserved.values())
        bound: Counter[tuple[str, str]] = Counter()
        for pod in self.pods.cache.values():
            on = (pod.get("spec") or {}).get("nodeName")
            if on in nodes and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                for res, n in _slices_read(pod).items():
                    bound[(on, res)] += n
        slices = {}
        for name in nodes:
            node = self.nodes.cache.get(name)
            counts = reported_slices(node, self.catalog) if node is not None else None
            if counts is not None:
                slices[name] = counts
        for key, name, res in self.loop.release_taken(reserved, requests, bound, slices, now):
            metrics.RESERVATIONS_TAKEN.inc()
            log.info("reservation ended: its slice went to another pod", extra={"fields": {
                "pod": key, "node": name, "resource": res, "slices": slices[name][res], "bound": bound[(name, res)]}})

    def _no_longer_waits(self, key: str) -> bool:
        """The pod was deleted or bound (the watch's latest object)."""
        pod = self.pods.cache.get(key)
        return pod is None or bool((pod.get("spec") or {}).get("nodeName"))

    def _new_plan_id(self) -> str:
        return f"{int(time.time() * 1000):x}-{next(self._ids)}"

    async def plan_round(self) -> None:
        self._check_term()
        # the plans on their way as the round starts (adopted ones too): one acknowledged while the
        # round runs still explains why its node is out of the round (its pods are planned there next)
        in_flight_at_start = dict(self.loop.in_flight)
        awaiting = self._awaiting_from_annotations()
        await self._adopt()
        in_flight_at_start.update(self.loop.in_flight)
        # read after the adoption's writes (a new leader may make hundreds): a pod deleted or bound
        # meanwhile is not planned from the list as it was before them
        nodes = list(self.nodes.cache.values())
        pods = list(self.pods.cache.values())
        claims, volumes = dict(self.claims.cache), dict(self.volumes.cache)
        classes = dict(self.classes.cache) if self.classes.synced.is_set() else None
        # in a thread: at 1,000 nodes and 10,000 pods reading them takes about a second of pure
        # Python, during which the event loop still renews the lease and follows the watches (the
        # cached objects are replaced on change, never changed in place)
        view = await asyncio.to_thread(_snapshot_without_collector, nodes, pods, self.catalog, awaiting,
                                       self.loop.held_pods(),
                                       self._reservations(), scheduler_names=self.settings.scheduler_names,
                                       in_flight={k: n for n, f in self.loop.in_flight.items() for k in f.pods},
                                       no_defer=self._not_to_defer(), mps_host_ipc=self.settings.mps_clients_host_ipc,
                                       other_nodes={name: (n.get("metadata") or {}).get("labels") or {}
                                                    for name, n in self.other_nodes.cache.items()},
                                       volumes=VolumeTopology(claims, volumes, classes)
                                       if self.claims.synced.is_set() and self.volumes.synced.is_set() else None,
                                       decodes=self._decodes, usage=self._usage, node_views=self._node_views)
        self.liveness.beat("planning loop")  # (a round at scale takes seconds: each part of it beats)
        # pods left to the next round (their anti-affinity or host ports conflict with an older
        # pod's this round plans): they join the next batch at once (it closes at once if the
        # older one is placed, below)
        self._deferred = dict(view.deferred)
        self._awaiting_claims = dict(view.awaiting_claims)
        self._claims_changed_meanwhile(claims, volumes, classes)
        self._index_awaiting()
        self._left_for_unplaced = {}  # set once a plan has been made (below)
        self.loop.facts_changed(view.deferred, self.clock())
        await self._tell_backoffs()
        snapshot = view.snapshot
        self._round_catalog = view.catalog
        self._invalid_pods = {object_key(obj) for obj, _ in view.problems if object_reference(obj)["kind"] == "Pod"}
        self._elsewhere = {object_key(obj) for obj, _ in view.elsewhere}
        logged = self._problems_logged
        self._problems_logged = {m for _, m in [*view.problems, *view.skew, *view.elsewhere]} | \
            {f"{object_key(obj)}: {m}" for obj, m in view.blocked}
        metrics.PLAN_ERRORS.labels("bad_object").inc(len(view.problems))
        # a lasting problem is found every round: logged when it appears, its Event de-duplicated;
        # annotations of another dynpart version are ignored, but said
        for _, message in [*view.problems, *view.skew]:
            (log.debug if message in logged else log.warning)(message)
        for _, message in view.elsewhere:  # other nodes' pods: no Event, said once in the log
            (log.debug if message in logged else log.info)(message)
        for scheduler in sorted({scheduler_of(o) for o, _ in view.elsewhere}
                                - {*self.settings.scheduler_names, *self._schedulers_told}):
            # once per scheduler: a kube-scheduler profile of another name must be added by hand
            self._schedulers_told.add(scheduler)
            log.warning("pods that scheduler %r places are not planned (planner setting scheduler_names: %s); if it is "
                        "a kube-scheduler profile with the default filters, add it", scheduler,
                        ", ".join(self.settings.scheduler_names))
        for reason, found in (("DynpartInvalid", view.problems), ("VersionSkew", view.skew)):
            for obj, message in _per_object(found):
                await self._event(obj, reason, message, warning=True)
        await self._report_unallocatable(view, logged)
        for obj, message in view.warnings:
            await self._event(obj, "MpsUnreachable", message, warning=True)
        for obj, message in view.blocked:
            (log.debug if f"{object_key(obj)}: {message}" in logged else log.info)("pod not placed", extra={"fields": {
                "pod": object_key(obj), "reason": message}})
            await self._event(obj, "Unplaceable", f"dynpart cannot place this pod: {message}", warning=True)
        await self._report_disagreements(view.disagreements)
        await self._switch_modes(view.switching, awaiting)
        if not snapshot.pending:
            self._left_for_unplaced = dict(view.deferred)  # no plan places the older pods
            return
        # the objective's request distribution: the requests seen lately, decayed (planner/demand.py);
        # the pods backing off (PlanningLoop.backing_off) left out
        snapshot = self.loop.prepare(snapshot, self.clock(), view.asked)
        if not snapshot.pending:
            self._left_for_unplaced = dict(view.deferred)
            return
        started = time.perf_counter()
        # the thread plans with copies of the drains: the event loop may change the loop's own
        # meanwhile (a lost lease clears them), and a round that outlived its lease keeps nothing
        state = self.loop.drain_state()
        # a drained node left out of the round for its plan in flight, acknowledged since, keeps
        # its drain (else dropped as a node gone, and another drained for the same pod)
        state.in_flight |= frozenset(in_flight_at_start)
        try:
            result = await asyncio.to_thread(self.loop.decide_with, snapshot, view.catalog, state)
        except DynpartError as e:
            # build_snapshot leaves out every object that fails validation on its own, so this is a
            # problem between objects (say two nodes of one name): skip the round, never crash-loop
            self.loop.abandon()
            metrics.PLAN_ERRORS.labels("invalid_snapshot").inc()
            log.error("planning round skipped: %s", e)
            return
        self.liveness.beat("planning loop")
        if not self.loop.commit(state):
            log.info("plan dropped: the lease was lost while planning", extra={"fields": {"pending": len(snapshot.pending)}})
            return
        # a pod this plan placed is no longer one its younger ones are not left for (its write may
        # fail: they are then left for it again, as above)
        placed_now = {pl.pod for pl in result.placements}
        self._left_for_unplaced = {p: o for p, o in view.deferred.items() if o not in placed_now}
        self._not_left_for = {p: rest for p, olders in self._not_left_for.items() if (rest := olders - placed_now)}
        metrics.PLAN_SECONDS.observe(time.perf_counter() - started)
        metrics.PLANS.inc()
        plan_id = self._new_plan_id()
        log.info("planned", extra={"fields": {"plan": plan_id, "pending": result.stats.pending,
                                              "placed": result.stats.placed, "solver": result.stats.solver,
                                              "gpus_touched": result.stats.gpus_touched,
                                              "seconds": round(time.perf_counter() - started, 4)}})
        pods_by_key = {pod_key(p): p for p in pods}
        nodes_by_name = {n["metadata"]["name"]: n for n in nodes}
        placed_on: dict[str, set[str]] = {}
        for pl in result.placements:
            placed_on.setdefault(pl.node, set()).add(pl.pod)
        # pods deleted or bound while the round read and planned (from the objects as they were at
        # its start): a node whose planned pods are all gone is not reconfigured for nobody
        gone = {pl.pod for pl in result.placements if self._no_longer_waits(pl.pod)}
        written: set[str] = set()
        not_written: set[str] = set()
        for layout, patch in planned_patches(snapshot, result, nodes_by_name, plan_id, self.leadership.term):
            node_plan = str(patch[SPEC_PLAN])  # `<plan_id>.<k>`: one id per node written
            node_obj = nodes_by_name[layout.node]
            # (a spec that also changes the node's drain flags is written: the loop counts them written)
            if placed_on.get(layout.node) and placed_on[layout.node] <= gone and SPEC_DRAIN not in patch:
                log.info("node layout not written: the pods planned there were deleted or bound while planning",
                         extra={"fields": {"node": layout.node, "pods": sorted(placed_on[layout.node])}})
                not_written.add(layout.node)
                self.wake.set()
                continue
            patch = keeping_unread(patch, node_obj, view.kept.get(layout.node, {}))
            # each write is bounded (request_timeout_s, its retries), a plan's many are not: a round
            # writing hundreds of nodes through a throttled API server beats per node
            self.liveness.beat("planning loop")
            if not self.leadership.can_write():
                # no proof of leadership any more (a renewal overdue): another replica may lead
                # now; it recovers what was written from the annotations and plans the rest
                metrics.PLAN_ERRORS.labels("not_leader").inc()
                log.warning("stopped writing: this replica cannot prove it still leads",
                            extra={"fields": {"plan": plan_id, "written": sorted(written)}})
                return
            try:
                await self._write_plan(layout.node, patch, node_obj)
            except APIConflictError as e:
                metrics.PLAN_ERRORS.labels("conflict").inc()
                log.info("node changed while planning; will re-plan", extra={"fields": {"node": layout.node, "error": str(e)}})
                not_written.add(layout.node)
                # the next batch plans them on the node as it is now
                self.loop.facts_changed(placed_on.get(layout.node, ()), self.clock())
                self.wake.set()
                continue
            except APIError as e:
                landed = await self._landed(layout.node, node_plan, e)
                if landed is False:
                    metrics.PLAN_ERRORS.labels("patch_failed").inc()
                    log.warning("could not write node plan", extra={"fields": {"node": layout.node, "error": str(e),
                                                                              "landed": landed}})
                    not_written.add(layout.node)
                    continue
            written.add(layout.node)
            self._written(layout.node, node_plan, placed_on.get(layout.node, ()), self.clock())
            metrics.NODE_PLANS.inc()
            created = sum(g.created for g in layout.gpus)
            destroyed = sum(g.destroyed for g in layout.gpus)
            metrics.SLICES_CREATED.labels(layout.mode).inc(created)
            metrics.SLICES_DESTROYED.labels(layout.mode).inc(destroyed)
            message = (f"plan {node_plan}: {created} slice(s) to create, {destroyed} free slice(s) to destroy on "
                       f"GPU(s) {', '.join(str(g.index) for g in layout.gpus if g.changed)}")
            log.info("node layout written", extra={"fields": {"node": layout.node, "plan": node_plan,
                                                              "created": created, "destroyed": destroyed}})
            await self._event(node_obj, "LayoutPlanned", message)
        if not self.leadership.can_write():
            return
        now = self.clock()
        planted = [(pl.pod, pl.node) for pl in result.placements if pl.node not in awaiting | not_written]
        for obj, message in mps_user_clashes(planted, pods_by_key):
            await self._event(obj, "MpsUserMismatch", message, warning=True)
        for pl in result.placements:
            if pl.node in awaiting or pl.node in not_written or pl.pod in gone:
                continue
            if pl.node not in written and pl.node not in self.nodes.cache:
                # deleted while the round planned (`node_gone` found nothing of it to free): the
                # pod is planned again, not held for a node that is gone
                continue
            if pl.node not in written:
                # on free slices: the scheduler binds it at its next try (its backoff can outlast
                # a round); until then, or until the slices go to other pods, it is not planned again
                self.loop.reserve(pl.pod, pl.node, now)
            metrics.PODS_PLACED.inc()
            slices = ", ".join(f"GPU {s.gpu} {s}" for s in pl.slices)
            waiting = "after its agent applies the new layout" if pl.node in written else "on free slices"
            await self._event(pods_by_key.get(pl.pod), "SlicePlanned", f"dynpart plans this pod on node {pl.node} "
                              f"({slices}) {waiting}")
        # the pods left for an older pod this round placed waited in a batch already: the next round
        # plans them against it at once (those left for a pod it could not place wait as others do)
        placed = {pl.pod for pl in result.placements if pl.node not in awaiting | not_written}
        self.loop.facts_changed([p for p, older in view.deferred.items() if older in placed], now, at_once=True)
        # The Event's message is the pod's state, the same from round to round while it lasts (the
        # recorder posts a changed message at once): nothing in it that changes with other pods'
        # plans, such as the nodes left out of this round while their agent applies a plan.
        avoided = self.loop.avoided(now)
        reasons, self._unplaced_logged = self._unplaced_logged, {}
        in_round = {n.name for n in snapshot.nodes}
        for u in result.unplaced:
            hosts = view.hosts.get(u.pod, frozenset())
            why = u.reason
            if hosts and not hosts & in_round:
                # every node that could take it is out of this round: the planner's reason ("no
                # node in mps mode") would mislead
                applying = sorted(n for n in hosts if (f := self.loop.in_flight.get(n, in_flight_at_start.get(n)))
                                  and not f.revoking)
                if applying:  # a plan on its way there: the pod waits for it, nothing is wrong
                    (log.debug if reasons.get(u.pod) == "waiting" else log.info)(
                        "pod waits for its nodes' agents", extra={"fields": {"pod": u.pod, "nodes": applying[:5]}})
                    self._unplaced_logged[u.pod] = "waiting"
                    continue
                silent = sorted(hosts & awaiting)
                why = (f"the node(s) that could take it ({', '.join(silent[:3])}{', ...' if len(silent) > 3 else ''}) "
                       "wait for their agent: it has not reported yet, or has not answered a plan (see the nodes' "
                       "dynpart.io/status-error and Events)" if silent else
                       "the node(s) that could take it are left out of planning (see the nodes' Events)")
            metrics.PODS_UNPLACEABLE.inc()
            # the affinity term the back-off adds (PlanningLoop.avoiding) is dynpart's, not the pod's
            kept_off = (f"; dynpart keeps it off node(s) {', '.join(sorted(avoided[u.pod]))} for a while, where the "
                        "slice planned for it was not taken by the scheduler" if u.pod in avoided else "")
            reason = self._unplaced_logged[u.pod] = why + kept_off
            (log.debug if reasons.get(u.pod) == reason else log.info)("pod not placed", extra={"fields": {
                "pod": u.pod, "reason": reason, "nodes_left_out": len(awaiting)}})
            await self._event(pods_by_key.get(u.pod), "Unplaceable", f"dynpart cannot place this pod: {reason}",
                              warning=True)

    async def _report_unallocatable(self, view: ClusterView, logged: set[str]) -> None:
        """Free slices a node's agent reports beyond its allocatable count (counted as used by
        the round) are said once that has lasted `allocatable_lag_s`: until the kubelet's next node
        status write, a slice just made is not in allocatable yet (after each reconfiguration with
        the chart's devicePlugin.publishAllocatable=false, or a device plugin that restarts), and
        a Warning then would cry wolf. A lasting one is a device its plugin withdrew or found
        unhealthy. The clock of a node out of this round (its plan applied) runs on, and starts again
        with each plan its agent acknowledges (whose new slices the kubelet lists at its next write)."""
        now = self.clock()
        seen: set[tuple[str, str]] = set()
        lasting: list[tuple[dict[str, Any], str]] = []
        for node, res, message in view.unallocatable:
            name = str(node["metadata"]["name"])
            key, plan = (name, res), view.acks.get(name)
            seen.add(key)
            entry = self._unallocatable_since.get(key)
            if entry is None or entry[0] != plan:
                entry = self._unallocatable_since[key] = (plan, now)
            self._unallocatable_count[key] = ((node.get("status") or {}).get("allocatable") or {}).get(res)
            since = entry[1]
            if now - since >= self.settings.allocatable_lag_s:
                lasting.append((node, message))
                (log.debug if message in logged else log.warning)(message)
            else:
                log.debug("%s (the kubelet's status may lag: said after %g s)", message,
                          self.settings.allocatable_lag_s)
        for key in [k for k in self._unallocatable_since if k not in seen
                    and (k[0] in view.acks or k[0] not in self.nodes.cache)]:
            del self._unallocatable_since[key]
        for key in [k for k in self._unallocatable_count if k not in self._unallocatable_since]:
            del self._unallocatable_count[key]
        self._problems_logged |= {m for _, m in lasting}
        for obj, message in _per_object(lasting):
            await self._event(obj, "SlicesNotAllocatable", message, warning=True)

    async def _tell_backoffs(self) -> None:
        """A Warning Event on each pod whose reservations lapsed so often that it is left out of the
        plans for a while (PlanningLoop.backing_off): something else keeps it pending."""
        backing_off = self.loop.take_backoffs_started()
        if not backing_off:
            return
        wall, now = time.time(), self.clock()
        for key, b in backing_off:
            at = dt.datetime.fromtimestamp(wall + b.until - now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            nodes = ", ".join(b.nodes)
            log.info("pod backed off: its reservations lapsed", extra={"fields": {
                "pod": key, "lapses": b.lapses, "nodes": nodes, "for_s": b.delay}})
            pod = self.pods.cache.get(key)
            await self._event(pod, "SlicesNotTaken", _backoff_message(b, nodes, at, _scheduler_says(pod)), warning=True)

    async def _switch_modes(self, switching: dict[str, str], awaiting: set[str]) -> None:
        """Nodes relabelled to the other mode whose agent the acknowledged spec keeps in the old
        one: a spec of the labelled mode, without slices or pods, moves it there; the node is
        planned once its agent reports that mode (cluster_view.mode_switch)."""
        for name, mode in sorted(switching.items()):
            self.liveness.beat("planning loop")  # a write per node (a whole pool relabelled)
            node = self.nodes.cache.get(name)
            if node is None or name in awaiting or not self.leadership.can_write():
                continue
            if switch_target(node) != mode:
                continue  # relabelled again, or its spec changed, since the round read it: the next round decides
            plan_id = self._new_plan_id()
            try:
                await self._patch_as_leader(name, switching_patch(node, mode, plan_id, self.leadership.term),
                                            node["metadata"].get("resourceVersion"))
            except APIError as e:
                log.info("could not switch the node's mode; will try again", extra={"fields": {"node": name, "error": str(e)}})
                continue
            self._written(name, plan_id, (), self.clock())
            log.info("node mode switch written", extra={"fields": {"node": name, "mode": mode, "plan": plan_id}})
            await self._event(node, "ModeSwitch", f"plan {plan_id}: the node is labelled {mode}; its agent is asked to "
                              f"run it in {mode.upper()} mode (slices in use stay until their pods end)")

    async def _report_disagreements(self, by_node: dict[str, tuple[str, ...]]) -> None:
        """How agents' capability reports differ from the catalog: an Event on the node (posted
        again only when the message changes or after event_repeat_s; the gauge is refresh_gauges').
        The driver's values are planned with; nothing is refused."""
        for name, notes in by_node.items():
            await self._event(self.nodes.cache.get(name) or {"kind": "Node", "metadata": {"name": name}},
                              "CatalogDisagreement", "the GPU driver and the catalog differ (the driver's values are "
                              "planned with): " + "; ".join(notes), warning=True)

    async def _landed(self, name: str, node_plan: str, error: APIError) -> bool | None:
        """Whether a spec write that failed reached the node all the same. A refusal (4xx) did not;
        without an answer (a connection cut, a time-out) or after a server failure (5xx) the
        patch may have been applied: the node is read again, from the API server, since the
        cache can lag for seconds (a watch relisting after 410 Gone) and a round meanwhile would
        plan the write's pods a second time. True: the node has the plan (it is in flight like any
        written one); False: it has not; None: the node cannot be read either, and the write is
        taken as landed, the safe side: in flight until its agent acknowledges it, or until the
        acknowledgement's time-out reads the node again and releases the pods (`_expire_acks`)."""
        if not isinstance(error, (APITransportError, APIServerError)):
            return False
        try:
            node = await read_node(self.core, name)
        except APIError as e:
            log.warning("a plan's write got no answer and the node cannot be read: taken as written until its "
                        "agent acknowledges it or the acknowledgement's time-out", extra={"fields": {
                            "node": name, "plan": node_plan, "error": str(error), "read_error": str(e)}})
            return None
        landed = (node.get("metadata", {}).get("annotations") or {}).get(SPEC_PLAN) == node_plan
        if landed:
            log.info("a plan's write got no answer but reached the node", extra={"fields": {
                "node": name, "plan": node_plan, "error": str(error)}})
        return landed

    async def _write_plan(self, name: str, patch: dict[str, str | None], planned_from: Obj) -> None:
        """A node's plan, written at the resourceVersion of the node it was planned from. A 409
        for a change of nothing the plan read (the kubelet's status writes: conditions, images,
        volumes in use; the agent's heartbeat) is written again at the node's new version, as
        client-go's RetryOnConflict would: on a node whose status changes faster than a round,
        every write would otherwise be refused and its pods never placed. APIConflictError: the
        node changed in what the plan read (or kept changing), re-planned by the next round."""
        node = planned_from
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                await self._patch_as_leader(name, patch, node["metadata"].get("resourceVersion"))
                return
            except APIConflictError as conflict:
                if attempt == CONFLICT_RETRIES:
                    raise
                try:
                    fresh = await read_node(self.core, name)
                except APIError:
                    # the 409 stands (a failed read is no sign the write landed: it did not)
                    raise conflict from None
                if planning_facts(fresh) != planning_facts(planned_from):
                    raise
                metrics.PLAN_WRITE_RETRIES.inc()
                node = fresh

    async def _patch_as_leader(self, name: str, patch: dict[str, str | None], resource_version: str | None) -> Obj:
        """A spec write that lands while this replica can prove it leads, or not at all from its
        side: a request that answers later is abandoned (APITransportError), since it could land
        after a standby took over and adopted what it found (a deposed leader's late write)."""
        left = self.leadership.write_time_left_s()
        if left <= 0:
            raise APITransportError(f"patch node {name}: this replica cannot prove it still leads")
        call = patch_node_annotations(self.core, name, patch, resource_version)
        if math.isinf(left):
            return await call
        try:
            async with asyncio.timeout(left):
                return await call
        except TimeoutError:
            raise APITransportError(f"patch node {name}: no answer within the {left:.1f} s this replica can still "
                                    "prove it leads") from None

    async def _event(self, obj: Obj | None, reason: str, message: str, warning: bool = False) -> None:
        if obj is not None:
            await self.events.record(obj, reason, message, warning)


def _room_may_have_grown(before: Mapping[str, str], after: Mapping[str, str]) -> bool:
    """Whether a node's status change can let a waiting pod fit: anything but free slices
    taken (a pod bound on one: about half the status changes of a busy cluster, each of which
    put every waiting pod back in the batch) may. Slices are compared as tokens of their values:
    a MIG value's placements (`2@0,1`), an MPS value's count (`2`)."""
    def slices(status: Mapping[str, str], suffix: str) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for key, value in status.items():
            if key.endswith(suffix):
                count, _, starts = value.partition("@")
                out[key[:-len(suffix)]] = Counter(starts.split(",") if starts else ["*"] * int(count))
        return out

    def other(status: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in status.items() if not k.endswith(("-free", "-used"))}

    if other(before) != other(after):
        return True
    try:
        free_before, free_after = slices(before, "-free"), slices(after, "-free")
        used_before, used_after = slices(before, "-used"), slices(after, "-used")
    except ValueError:
        return True  # malformed: the round reports it
    for base in {*free_before, *free_after, *used_before, *used_after}:
        if free_after.get(base, Counter()) - free_before.get(base, Counter()):
            return True  # a slice freed or made
        if (free_before.get(base, Counter()) + used_before.get(base, Counter())
                != free_after.get(base, Counter()) + used_after.get(base, Counter())):
            return True  # slices destroyed (a drain) or changed otherwise: room on the GPU
    return False


def _snapshot_without_collector(*args: Any, **kwargs: Any) -> ClusterView:
    """`build_snapshot` with CPython's cycle collector paused, as `plan()` runs: it allocates
    hundreds of thousands of objects, all freed by reference counting, and their number sets the
    collector off, whose every full run walks the whole heap, the caches' millions of objects
    included (on 5,000 nodes and 61,000 pods: 3.9-5.0 s with it, 2.8 s without)."""
    with collector_paused():
        return build_snapshot(*args, **kwargs)


def _slices_read(pod: Obj) -> dict[str, int]:
    """`slice_requests`, none where a quantity of the pod cannot be read: the round reports it
    (DynpartInvalid); the steps beside it must not fail on it every time."""
    try:
        return slice_requests(pod)
    except DynpartError:
        return {}


def _ignore(kind: str, obj: Obj) -> None:
    """A change the caches keep and no round waits for."""


def _scheduler_says(pod: Obj | None) -> str | None:
    """The message of the pod's PodScheduled condition: why the scheduler last refused it."""
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "PodScheduled" and c.get("status") == "False":
            message = str(c.get("message") or "").strip()
            return message if len(message) <= 400 else message[:397] + "..."
    return None


def _backoff_message(b: PodBackOff, nodes: str, at: str, scheduler_says: str | None = None) -> str:
    said = f"; the scheduler said: {scheduler_says!r}" if scheduler_says else "; its PodScheduled condition says what"
    return (f"dynpart kept GPU slices for this pod {b.lapses} times (node(s) {nodes}) and the scheduler bound it "
            "to none of them: something other than GPU slices keeps it pending (volumes, node or pod affinity, "
            f"topology spread constraints, host ports, other resources{said}). "
            f"dynpart plans it again after {b.delay:g} s, at {at}, and twice as long after each further time "
            "(at most an hour); at once if it changes")


def _newness(term: int | None, plan_id: str) -> tuple[int, int, str]:
    """How recent a spec is: by the writer's leader term, then by the wall-clock milliseconds a
    plan id starts with (`_new_plan_id`; 0 when it does not)."""
    try:
        written = int(plan_id.split("-", 1)[0], 16)
    except ValueError:
        written = 0
    return (-1 if term is None else term, written, plan_id)


# how much later than a plan's id says it was written a pod must have been created to be another
# pod than the one the plan was made for (the controller's clock against the API server's)
_CLOCK_SKEW_S = 60


def _created_after(pod: Obj, written_ms: int) -> bool:
    """Whether the pod was created clearly after the plan was written (`_newness`: 0 when its id
    does not say): the plan named another pod of the same name."""
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not written_ms or not isinstance(created, str):
        return False
    try:
        at = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return False
    return at > written_ms / 1000 + _CLOCK_SKEW_S


_SELF_CHANGING_LABELS = frozenset({"nvidia.com/gfd.timestamp"})


def _admission(node: Obj) -> str:
    """What of a node decides which pods it admits, besides its GPUs' status (labels, taints,
    the cordon, allocatable resources), as one comparable string."""
    spec = node.get("spec") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    # not the slices' counts: those follow the agent's status, which wakes the loop when room grows
    basic = {r: allocatable.get(r) for r in ("cpu", "memory", "pods", "ephemeral-storage")}
    # labels that change by themselves (GPU feature discovery's nvidia.com/gfd.timestamp, rewritten
    # every minute) would wake every waiting pod that often on every node
    labels = {k: v for k, v in (node["metadata"].get("labels") or {}).items() if k not in _SELF_CHANGING_LABELS}
    return json.dumps([labels, spec.get("taints") or [], bool(spec.get("unschedulable")), basic], sort_keys=True,
                      default=str)


def _pod_version(pod: Obj) -> str:
    """What identifies a pod's spec as planned (its uid, generation and the parts planning reads):
    a pod that changes is no longer the one whose reservations lapsed (PlanningLoop.pod_waiting)."""
    md = pod.get("metadata") or {}
    spec = json.dumps(pod.get("spec"), sort_keys=True, default=str)
    return f"{md.get('uid')}/{md.get('generation')}/{hashlib.sha256(spec.encode()).hexdigest()[:16]}"


def _per_object(found: Iterable[tuple[Obj, str]]) -> list[tuple[Obj, str]]:
    """One message per object, its findings joined in their order: the recorder keeps one message
    per (object, reason), so two Events of one reason on an object would replace each other and
    both be posted again every round."""
    by_key: dict[str, tuple[Obj, list[str]]] = {}
    for obj, message in found:
        by_key.setdefault(f"{object_reference(obj)['kind']}:{object_key(obj)}", (obj, []))[1].append(message)
    return [(obj, "; ".join(messages)) for obj, messages in by_key.values()]


def _set_gauge(gauge: Gauge, values: Mapping[str, float]) -> None:
    """The gauge's series become `values` (label -> value): the others are removed."""
    for label in {v for m in gauge.collect() for s in m.samples for v in s.labels.values()} - set(values):
        gauge.remove(label)
    for label, value in values.items():
        gauge.labels(label).set(value)
