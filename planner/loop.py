"""The planning loop's decisions, pure: which pods wait for a plan, when a batch closes, which
nodes are held back while their agent applies a plan, which pods keep the slices made for them,
what request distribution the objective plans for, and the plan itself.

The controller (planner/controller.py) feeds it from its watches and the wall clock; the
simulator's replay (simulations/replay/engine.py) from a trace in simulated time. Both build it
from the same `PlannerSettings`, so what the simulator measures is what the controller runs.
Time is always passed in (`now`, seconds on any monotonic clock): nothing here reads a clock,
and nothing talks to the API server.

Fairness is the plan's: pending pods come oldest first, and the greedy fills in that order among
plans that place as many pods; the loop caps nothing (every pending pod is given to the plan,
whose exact search has a time budget). One guard against starvation is the loop's own: a pod
asking for whole GPUs that no plan could place for `drain_after_s` has GPUs drained for it
(`planner/drain.py`; off by default), on at most `drain_max_gpus` GPUs at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from dynpart.catalog import Catalog
from dynpart.planner.batching import BatchWindow
from dynpart.planner.core import PlanningSession, PlanOptions, plan
from dynpart.planner.demand import DemandTracker, known_to
from dynpart.planner.drain import Drain, drain_target, is_empty, may_hold, with_drain_flags, without_gpus
from dynpart.planner.policy import PolicyName
from dynpart.resources import WHOLE_GPU
from dynpart.scheduling import NodeSelectorRequirement, NodeSelectorTerm
from dynpart.settings import PlannerSettings
from dynpart.snapshot import NodeLayout, PendingPod, Plan, Snapshot, prune_apart

# A pod whose reservation on a node ended without the scheduler binding it there is not planned
# on that node again for a while: the first time for reservation_s, then twice as long each time,
# at most this long. (A slice the agent reports free may be one the scheduler cannot give: a
# device the plugin withdrew as unhealthy, a pod constraint dynpart does not model.) The nodes a
# pod is kept off are kept off together, each at least as long as the latest and past the pod's
# back-off: the plans then try every other node once before any of them again (a pod only one
# node admits for a reason dynpart does not see, a zonal volume say, otherwise went back and forth
# between the first two nodes tried, whose free slices the objective prefers, and never reached it).
AVOID_MAX_S = 600.0
# A pod whose reservations lapsed this many times, on any nodes, is kept pending by something the
# planner does not model (a volume in another zone, pod affinity, topology spread, host ports,
# another resource): every plan made for it reconfigures a GPU for nothing. It is then left out of
# the plans for POD_BACKOFF_MIN_S, twice as long after each further lapse, at most POD_BACKOFF_MAX_S,
# until it is bound, gone or changed.
POD_LAPSES = 3
POD_BACKOFF_MIN_S = 60.0
POD_BACKOFF_MAX_S = 3600.0


@dataclass
class InFlight:
    """A node plan written and not yet acknowledged."""
    plan_id: str
    sent_at: float
    pods: set[str] = field(default_factory=set)
    revoking: bool = False  # the plan replaces an unacknowledged one by the node's reported layout
    compared_at: float = float("-inf")  # a revocation: when it was last compared with the node's report


@dataclass(frozen=True)
class NodeWrite:
    """One node's new desired layout, as a plan decided it: what the controller writes into the
    node's spec annotations and the simulator applies."""
    node: str
    layout: NodeLayout
    pods: tuple[str, ...]  # the pods the plan puts on the node (on new or free slices)


@dataclass
class PodBackOff:
    """The reservations of one pod that lapsed, and its pod-wide back-off (POD_LAPSES)."""
    lapses: int = 0
    nodes: list[str] = field(default_factory=list)  # where they lapsed, each once, in order
    until: float = float("-inf")  # not planned before this
    delay: float = 0.0  # the last back-off, s


@dataclass
class DrainState:
    """What the drains decide with and change: copies, so that a round planning in a thread never
    sees the event loop change them (a lost lease clears them), and a round whose lease was lost
    meanwhile is dropped whole (`PlanningLoop.commit`)."""
    drains: dict[str, Drain]
    flagged: dict[str, set[int]]
    in_flight: frozenset[str]  # nodes with a plan in flight
    first_seen: dict[str, float]  # pending pod -> when a round first saw it
    now: float  # the round's time (`prepare`)
    epoch: int  # PlanningLoop.epoch when copied


def node_writes(result: Plan) -> list[NodeWrite]:
    """The nodes whose layout the plan changes, in the plan's order, with their pods."""
    pods: dict[str, list[str]] = {}
    for pl in result.placements:
        pods.setdefault(pl.node, []).append(pl.pod)
    return [NodeWrite(lay.node, lay, tuple(pods.get(lay.node, ()))) for lay in result.changed_nodes()]


def avoiding(pod: PendingPod, nodes: set[str]) -> PendingPod:
    """The pod with these nodes left out: `metadata.name NotIn` added to each of its required
    node-affinity terms (or as its only term)."""
    not_in = NodeSelectorRequirement(key="metadata.name", operator="NotIn", values=tuple(sorted(nodes)))
    terms = pod.node_affinity or [NodeSelectorTerm()]
    return pod.model_copy(update={"node_affinity": [
        t.model_copy(update={"match_fields": (*t.match_fields, not_in)}) for t in terms]})


class PlanningLoop:
    def __init__(self, settings: PlannerSettings, policy: PolicyName = "dynpart",
                 static_layout: Mapping[str, str] | None = None, minimise_changes: bool = True):
        """`minimise_changes` False: a cluster whose GPUs are shared without reconfiguring them
        (the FGD packing protocol), where creating and destroying free slices costs nothing."""
        self.settings = settings
        self.options = PlanOptions(policy=policy, time_limit_s=settings.plan_time_limit_s,
                                   static_layout=dict(static_layout or {}), minimise_changes=minimise_changes)
        self.window = BatchWindow(settings.batch_idle_s, settings.batch_timeout_s)
        self.demand = DemandTracker(settings.demand_half_life_s)
        self.in_flight: dict[str, InFlight] = {}
        self.reserved: dict[str, tuple[str, float]] = {}  # pod -> (node, until): planned, applied, not bound
        self.last_round = float("-inf")
        self.first_seen: dict[str, float] = {}  # pending pod -> when a round first saw it waiting
        self.prepared_at = float("-inf")  # the time of the last round (`prepare`)
        self.drains: dict[str, Drain] = {}  # pod -> the GPUs drained for it
        self.drain_flagged: dict[str, set[int]] = {}  # node -> GPUs its spec drains, as last decided
        self.avoid: dict[tuple[str, str], tuple[float, float]] = {}  # (pod, node) -> (until, back-off s)
        self.lapsed: dict[str, PodBackOff] = {}  # pod -> its lapsed reservations (POD_LAPSES)
        self.backoffs_started: list[str] = []  # pods whose pod-wide back-off started, not yet told
        self.versions: dict[str, str] = {}  # waiting pod -> its version, as the caller tells (`pod_waiting`)
        self.epoch = 0  # counts the leader states forgotten (`forget_leader_state`)
        self.gone_since: set[str] = set()  # nodes gone while a round's copy is out (`commit` drops theirs)
        # a round's copy of the drains is out (`drain_state` to `commit`): only then are gone nodes
        # recorded (a standby, or a leader with nothing pending, would keep every node deleted)
        self._copy_out = False

    # --- events ---------------------------------------------------------------------------

    def pod_waiting(self, key: str, now: float, version: str | None = None) -> bool:
        """The scheduler found no room for the pod: it joins the batch. True if it is new there.
        A pod a plan in flight or a reservation holds waits for its slice, not for a plan.
        `version`: what identifies the pod's spec (uid, generation...): a pod that changed starts
        again without lapsed reservations (POD_LAPSES)."""
        if version is not None:
            if self.versions.get(key, version) != version:
                self.lapsed.pop(key, None)
            self.versions[key] = version
        if key in self.window.members or key in self.reserved or key in self.held_pods():
            return False
        self.window.add(key, now)
        return True

    def pod_done(self, key: str) -> None:
        """The pod is bound, gone or no longer waits for a slice."""
        self.window.discard(key)
        self.first_seen.pop(key, None)
        self.lapsed.pop(key, None)
        self.versions.pop(key, None)
        for pair in [p for p in self.avoid if p[0] == key]:
            del self.avoid[pair]

    def facts_changed(self, waiting: Iterable[str], now: float, at_once: bool = False) -> None:
        """New facts about a node's GPUs (a plan applied, a slice freed or taken, a node gone):
        the pods still waiting may fit now, or only now be planned on it, so they join the batch
        (those held by a plan in flight or a reservation excepted: their slice is on its way).
        `at_once`: pods a round left to the next (a conflict with an older pod it planned): they
        waited in a batch already, so the batch closes now; each such round plans the older pod
        or stops leaving pods for it, so these rounds end."""
        held = self.held_pods()
        for key in waiting:
            if key not in held and key not in self.reserved:
                self.window.add(key, now, at_once)

    def acknowledged(self, node: str, plan_id: str, now: float) -> InFlight | None:
        """The node's agent reports it holds the plan: the node can be planned again, and the
        slices made for the plan's pods are theirs for `reservation_s` while the scheduler binds
        them. Returns the plan acknowledged, or None when it is not the one in flight."""
        flight = self.in_flight.get(node)
        if flight is None or flight.plan_id != plan_id:
            return None
        del self.in_flight[node]
        for key in flight.pods:
            self.reserved[key] = (node, now + self.settings.reservation_s)
        return flight

    def written(self, node: str, plan_id: str, pods: Iterable[str], now: float, revoking: bool = False) -> None:
        self.in_flight[node] = InFlight(plan_id, now, set(pods), revoking)

    def forget_node(self, node: str) -> None:
        self.in_flight.pop(node, None)

    def node_gone(self, node: str, now: float) -> InFlight | None:
        """The node was deleted (or left dynpart): nothing applies its plan in flight, its drains
        and reservations hold nothing, and a node made later under its name is a new one. Their
        pods join the batch (no back-off: the node, not the pod, failed). Returns the plan that
        was in flight there, if any."""
        flight = self.in_flight.pop(node, None)
        if self._copy_out:
            self.gone_since.add(node)
        self.drain_flagged.pop(node, None)
        for key in [k for k, d in self.drains.items() if d.node == node]:
            del self.drains[key]
        freed = [k for k, (n, _) in self.reserved.items() if n == node]
        for key in freed:
            del self.reserved[key]
        for pair in [p for p in self.avoid if p[1] == node]:
            del self.avoid[pair]
        self.facts_changed([*(flight.pods if flight is not None else ()), *freed], now)
        return flight

    def forget_leader_state(self) -> None:
        """Leadership lost: what this replica wrote or reserved as leader may have been replaced
        by another leader's writes. The batch and the demand learnt as leader stay (a standby
        observes nothing more, so both are old if it leads again)."""
        self.epoch += 1  # a round planning meanwhile commits nothing (`commit`)
        self.in_flight.clear()
        self.reserved.clear()
        self.drains.clear()
        self.drain_flagged.clear()
        self.abandon()

    # --- when to plan ---------------------------------------------------------------------

    def due(self, now: float, waiting: bool) -> bool:
        """Plan now: the batch closed, or `resync_s` passed since the last round and pods wait
        (`waiting`: any pod still waits for a slice, in the batch or not)."""
        return self.window.ready(now) or (waiting and now >= self.last_round + self.settings.resync_s)

    def next_due(self) -> float:
        """When `due` may turn true without a new event (the batch closing, or the resync)."""
        batch = self.window.deadline()
        resync = self.last_round + self.settings.resync_s
        return resync if batch is None else min(batch, resync)

    def begin_round(self, now: float) -> None:
        self.window.close()
        self.last_round = now

    def overdue(self, now: float) -> list[tuple[str, InFlight]]:
        """Plans not acknowledged within `ack_timeout_s` (revocations wait for ever: the node stays
        out until its agent answers)."""
        return [(name, f) for name, f in sorted(self.in_flight.items())
                if not f.revoking and now - f.sent_at > self.settings.ack_timeout_s]

    def stale_revocations(self, now: float) -> list[tuple[str, InFlight]]:
        """Revocations not acknowledged within `ack_timeout_s` of being written or last compared
        with what the node's agent reports (`compared_at`): the controller writes one again
        where the report changed since, and otherwise looks again after as long."""
        return [(name, f) for name, f in sorted(self.in_flight.items())
                if f.revoking and now - max(f.sent_at, f.compared_at) > self.settings.ack_timeout_s]

    # --- what a round plans with ----------------------------------------------------------

    def held_nodes(self) -> set[str]:
        return set(self.in_flight)

    def held_pods(self) -> set[str]:
        """Pods planned onto nodes whose plan is not acknowledged: not planned again meanwhile."""
        return set().union(*(f.pods for f in self.in_flight.values())) if self.in_flight else set()

    def reservations(self, now: float, bound_or_gone: Callable[[str], bool]) -> dict[str, str]:
        """The reservations still standing, pod -> node; one ends when its pod is bound or gone
        (`bound_or_gone`) or after `reservation_s`."""
        out: dict[str, str] = {}
        for key, (node, until) in list(self.reserved.items()):
            if bound_or_gone(key):
                del self.reserved[key]
            elif now > until:
                del self.reserved[key]
                self._back_off(key, node, now)
                self._lapse(key, node, now)
            else:
                out[key] = node
        return out

    def _back_off(self, key: str, node: str, now: float) -> None:
        """The scheduler did not bind the pod on the node its slice was kept on: the next plans
        leave that node out for the pod for a while (AVOID_MAX_S), so it is not kept there again
        and again while other nodes have room."""
        previous = self.avoid.get((key, node))
        delay = min(AVOID_MAX_S, 2 * previous[1] if previous else max(self.settings.reservation_s, 1.0))
        self.avoid[(key, node)] = (now + delay, delay)
        self._keep_off_together(key, now + delay)

    def _keep_off_together(self, key: str, until: float) -> None:
        """Every node the pod is kept off (or was, while its lapses are remembered) stays so at
        least `until` (AVOID_MAX_S): the set grows, it does not rotate."""
        for pair, (was, delay) in list(self.avoid.items()):
            if pair[0] == key and was < until:
                self.avoid[pair] = (until, delay)

    def _lapse(self, key: str, node: str, now: float) -> None:
        """A reservation of the pod lapsed unbound: after POD_LAPSES of them, wherever, the pod is
        left out of the plans for a while (`backing_off`), and `backoffs_started` says so once."""
        b = self.lapsed.setdefault(key, PodBackOff())
        b.lapses += 1
        if node not in b.nodes:
            b.nodes.append(node)
        if b.lapses >= POD_LAPSES:
            b.delay = min(POD_BACKOFF_MAX_S, 2 * b.delay if b.delay else POD_BACKOFF_MIN_S)
            b.until = now + b.delay
            self.backoffs_started.append(key)
            # past the back-off, the next plan tries a node not tried yet
            self._keep_off_together(key, b.until + max(self.settings.reservation_s, 1.0))

    def backing_off(self, now: float) -> dict[str, PodBackOff]:
        """Pod -> its pod-wide back-off, for the pods left out of the plans now (`_lapse`)."""
        return {key: b for key, b in self.lapsed.items() if now < b.until}

    def take_backoffs_started(self) -> list[tuple[str, PodBackOff]]:
        """The pod-wide back-offs started since the last call (each said once, e.g. by an Event)."""
        out = [(key, replace(self.lapsed[key], nodes=list(self.lapsed[key].nodes)))
               for key in dict.fromkeys(self.backoffs_started) if key in self.lapsed]
        self.backoffs_started.clear()
        return out

    def avoided(self, now: float) -> dict[str, set[str]]:
        """Pod -> the nodes its plan leaves out now (`_back_off`)."""
        out: dict[str, set[str]] = {}
        for (key, node), (until, _) in self.avoid.items():
            if now < until:
                out.setdefault(key, set()).add(node)
        return out

    def reserve(self, key: str, node: str, now: float) -> None:
        self.reserved[key] = (node, now + self.settings.reservation_s)

    def release_taken(self, reserved: dict[str, str], requests: Mapping[str, Mapping[str, int]],
                      bound: Mapping[tuple[str, str], int], slices: Mapping[str, Mapping[str, int]],
                      now: float) -> list[tuple[str, str, str]]:
        """End the reservations whose slices the scheduler gave to other pods: when the pods bound
        on a node asking for a resource (`bound`, (node, resource) -> count) need every slice of it
        the node reports (`slices`, node -> resource -> count), the reserved pods beyond them have
        none left and wait again at once. `requests`: each reserved pod's slice requests. Returns
        (pod, node, resource) of each reservation ended; `reserved` is updated."""
        want: dict[tuple[str, str], list[str]] = {}
        for key, node in reserved.items():
            for res in requests.get(key, {}):
                want.setdefault((node, res), []).append(key)
        ended = []
        for (node, res), keys in sorted(want.items()):
            if node not in slices or res == WHOLE_GPU:
                continue  # no report, or whole GPUs, which a node's report of its slices does not count
            free = max(0, slices[node].get(res, 0) - bound.get((node, res), 0))
            for key in sorted(keys)[free:]:
                if key in reserved:
                    del self.reserved[key]
                    reserved.pop(key)
                    self.window.add(key, now)
                    ended.append((key, node, res))
                    if not bound.get((node, res)):  # no pod took them: the node lacks the slices it was planned
                        self._back_off(key, node, now)
        return ended

    def prepare(self, snapshot: Snapshot, now: float, asked: Mapping[str, PendingPod] | None = None) -> Snapshot:
        """The snapshot a round plans: with the request distribution the objective keeps room for
        (the settings' `workload` when given, else the requests seen lately, decayed). `asked`:
        pod -> the pod as it asks, where the snapshot's keeps it off nodes for this round only
        (ClusterView.asked): the kind learnt is the pod's, not the round's."""
        if not self.settings.workload:  # (the distribution learned would not be used)
            self.demand.observe([(asked or {}).get(p.name, p) for p in snapshot.pending], now, self.versions)
        for pod in snapshot.pending:
            self.first_seen.setdefault(pod.name, now)
        self.prepared_at = now
        workload = self.settings.workload or self.demand.workload()
        avoided = self.avoided(now)
        backing_off = self.backing_off(now)
        pending = prune_apart([avoiding(p, avoided[p.name]) if p.name in avoided else p
                               for p in snapshot.pending if p.name not in backing_off])
        return snapshot.model_copy(update={"workload": workload, "pending": pending})

    def decide(self, snapshot: Snapshot, catalog: Catalog, session: PlanningSession | None = None) -> Plan:
        """The plan of a prepared snapshot. With a `session` (a caller planning the same cluster
        again and again keeps one: its nodes are the cluster, the snapshot's are not read), the same
        plan without compiling the cluster again. A caller planning in another thread calls
        `drain_state`, `decide_with` there and `commit` instead."""
        if session is not None:  # the packing protocol: no pod waits, nothing drains
            return session.plan(snapshot.pending, snapshot.workload, self.options, validate=False)
        state = self.drain_state()
        result = self.decide_with(snapshot, catalog, state)
        self.commit(state)
        return result

    def drain_state(self) -> DrainState:
        """A copy of what `decide_with` reads and changes, taken where the loop's state changes."""
        self.gone_since.clear()
        self._copy_out = True
        return DrainState(dict(self.drains),
                          {k: set(v) for k, v in self.drain_flagged.items()}, frozenset(self.in_flight),
                          dict(self.first_seen), self.prepared_at, self.epoch)

    def commit(self, state: DrainState) -> bool:
        """Keep what a round decided about drains, unless the leader state was forgotten since its
        copy (the lease lost: what it decided is another leader's business). True if kept."""
        gone, self.gone_since, self._copy_out = self.gone_since, set(), False
        if state.epoch != self.epoch:
            return False
        # a node deleted meanwhile (`node_gone`) keeps nothing
        self.drains = {k: d for k, d in state.drains.items() if d.node not in gone}
        self.drain_flagged = {k: v for k, v in state.flagged.items() if k not in gone}
        return True

    def abandon(self) -> None:
        """The round's copy of the drains (`drain_state`) is dropped: its planning failed, or the
        lease was lost (its `commit` keeps nothing)."""
        self.gone_since.clear()
        self._copy_out = False

    def decide_with(self, snapshot: Snapshot, catalog: Catalog, state: DrainState) -> Plan:
        """The plan of a prepared snapshot, pure over it and `state` (which it updates; nothing
        else of the loop is read but its settings): the controller runs it in a thread."""
        if not self.settings.workload:  # (the settings' was checked against the catalog at start)
            snapshot = snapshot.model_copy(update={"workload": known_to(snapshot.workload, catalog)})
        pending = {p.name: p for p in snapshot.pending}
        nodes = {n.name: n for n in snapshot.nodes}
        for key, d in list(state.drains.items()):
            if key not in pending or (d.node not in nodes and d.node not in state.in_flight):
                del state.drains[key]  # its pod was planned, bound or left (or its node did)
            elif d.node in nodes and not may_hold(nodes[d.node], pending[key], catalog):
                # the node was cordoned, tainted (the cluster autoscaler's ToBeDeleted, unreachable),
                # relabelled or switched mode: the pod can never run there, and the drain would
                # hold drain_max_gpus for nothing, so no other drain could start for any pod
                del state.drains[key]
            elif d.node in nodes and not set(d.gpus) <= {g.index for g in nodes[d.node].gpus}:
                # a drained GPU left the rounds (reported unhealthy, a reset pending): nothing will
                # be planned there, so the drain gives way (its pod may drain one elsewhere, and it
                # no longer counts under drain_max_gpus)
                del state.drains[key]
        result = plan(self._draining(snapshot, state), catalog, self.options)
        if self._start_drains(snapshot, result, catalog, state):
            result = plan(self._draining(snapshot, state), catalog, self.options)
        return self._flag(result, snapshot, state)

    @staticmethod
    def _still_draining(snapshot: Snapshot, state: DrainState) -> dict[str, set[int]]:
        """Node -> the drained GPUs not yet empty (an empty one is planned again, the drain's
        pod, the oldest, first)."""
        nodes = {n.name: n for n in snapshot.nodes}
        out: dict[str, set[int]] = {}
        for d in state.drains.values():
            node = nodes.get(d.node)
            if node is not None and not all(is_empty(g) for g in node.gpus if g.index in d.gpus):
                out.setdefault(d.node, set()).update(d.gpus)
        return out

    def _draining(self, snapshot: Snapshot, state: DrainState) -> Snapshot:
        for name, gpus in sorted(self._still_draining(snapshot, state).items()):
            snapshot = without_gpus(snapshot, name, tuple(sorted(gpus)))
        return snapshot

    def _start_drains(self, snapshot: Snapshot, result: Plan, catalog: Catalog, state: DrainState) -> bool:
        """Drain for each pod asking for whole GPUs that waited `drain_after_s` and that this plan
        left out too, oldest first, on GPUs no other drain holds, while the drains hold at most
        `drain_max_gpus` GPUs (without that cap, a queue of whole-GPU pods drains ever more GPUs
        and the capacity idling there makes the queue longer); a younger pod never drains ahead
        of an older one that the cap holds back. True if one started."""
        if self.settings.drain_after_s <= 0 or self.options.policy != "dynpart" or not result.unplaced:
            return False
        now = state.now
        left_out = {u.pod for u in result.unplaced}
        taken = {(d.node, g) for d in state.drains.values() for g in d.gpus}
        planned_on = {p.pod: p.node for p in result.placements}
        started = False
        for pod in snapshot.pending:  # oldest first
            if (pod.name in left_out and pod.name not in state.drains
                    and now - state.first_seen.get(pod.name, now) >= self.settings.drain_after_s):
                # a node where a pod it must be kept apart from is planned, or drains, could
                # never hold both: its drain would idle GPUs for nothing
                avoid = {planned_on[p] for p in pod.apart if p in planned_on}
                avoid.update(state.drains[p].node for p in pod.apart if p in state.drains)
                target = drain_target(snapshot, pod, catalog, taken, avoid)
                if target is None:
                    continue
                if taken and len(taken) + len(target.gpus) > self.settings.drain_max_gpus:
                    break
                state.drains[pod.name] = target
                taken.update((target.node, g) for g in target.gpus)
                started = True
        return started

    def _flag(self, result: Plan, snapshot: Snapshot, state: DrainState) -> Plan:
        """The plan with the drain flags of the nodes' specs brought to what the drains want."""
        want_all = self._still_draining(snapshot, state)
        for name in sorted(set(state.flagged) | set(want_all)):
            if not any(n.name == name for n in snapshot.nodes):
                continue  # held while its agent applies a plan: flagged in a later round
            want = want_all.get(name, set())
            result = with_drain_flags(result, snapshot, name, want, state.flagged.get(name, set()))
            layout = result.layout_of(name)
            if layout is not None and layout.changed:
                # (the spec written names only the GPUs of the snapshot's node: a flagged GPU left
                # out of the rounds loses its flag with it)
                if want:
                    state.flagged[name] = set(want)
                else:
                    state.flagged.pop(name, None)
        return result

