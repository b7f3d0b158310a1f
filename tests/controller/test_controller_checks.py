"""Checks of the planner controller's shell (planner/controller.py) found by mutation testing: what
a real cluster needs of its watches, steps, plans in flight, acknowledgements, revocations and
spec writes that no other test pinned. The API server is faked at the controller's two calls
(patch a node's annotations, read a node); Events are recorded with their type (Warning or Normal)."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynpart.annotations import SPEC_PODS, SPEC_TERM, encode_status
from dynpart.capability import encode_capability
from dynpart.catalog import default_catalog
from dynpart.kube.errors import APIClientError, APIConflictError, APIServerError, APITransportError
from dynpart.kube.recording import EventRecorder
from dynpart.planner import controller as controller_module
from dynpart.planner import metrics
from dynpart.planner.controller import CONFLICT_RETRIES, PlannerController, Unelected
from dynpart.planner.loop import InFlight, PodBackOff
from dynpart.probing import Liveness
from dynpart.settings import PlannerSettings
from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice, NodeLayout
from tests.controller.test_cluster_view import node, pod
from tests.controller.test_in_flight import Lead, acked, replaced_by_another_leader, reported, unreadable
from tests.test_capability import kind_of, node_of

CAT = default_catalog()
H100 = CAT.resolve("H100-80GB")
MIG_1G = "nvidia.com/mig-1g.10gb"
SPEC_PLAN = "dynpart.io/spec-plan"
STATUS_PLAN = "dynpart.io/status-plan"


class Api:
    """The API server as the controller sees it: node patches (recorded, and applied to the node
    cache as the watch would deliver them when `apply`), node reads, and posted Events."""

    def __init__(self) -> None:
        self.written: list[tuple[str, dict[str, str | None]]] = []
        self.tried: list[tuple[str, dict[str, str | None]]] = []  # written, or refused (patch_error)
        self.posted: list[tuple[str, str, bool, dict[str, Any]]] = []  # (reason, message, warning, object)
        self.server: dict[str, dict[str, Any]] = {}  # what a GET answers (default: the cache)
        self.patch_error: Exception | None = None
        self.read_error: Exception | None = None

    def reasons(self) -> list[str]:
        return [r for r, _, _, _ in self.posted]

    def of(self, reason: str) -> list[tuple[str, bool, dict[str, Any]]]:
        return [(m, w, o) for r, m, w, o in self.posted if r == reason]


@pytest.fixture
def make(monkeypatch):
    api = Api()
    made: list[PlannerController] = []

    def build(nodes: list[dict[str, Any]], lead: Any = None, apply: bool = False, **settings: Any) -> PlannerController:
        c = PlannerController(client.ApiClient(), PlannerSettings(**settings), CAT, leadership=lead or Lead(term=3))
        c.nodes.cache.update({n["metadata"]["name"]: n for n in nodes})

        async def post(obj, reason, message, warning):
            api.posted.append((reason, message, warning, obj))
        c.events = EventRecorder(post, c.settings.kube)

        async def patch(core, name, p, resource_version=None):
            api.tried.append((name, dict(p)))
            if api.patch_error is not None:
                raise api.patch_error
            api.written.append((name, dict(p)))
            if apply and name in c.nodes.cache:
                new = copy.deepcopy(c.nodes.cache[name])
                ann = new["metadata"].setdefault("annotations", {})
                for k, v in p.items():
                    if v is None:
                        ann.pop(k, None)
                    else:
                        ann[k] = v
                new["metadata"]["resourceVersion"] = str(int(new["metadata"].get("resourceVersion") or 0) + 1)
                c.nodes.cache[name] = new
            return {}

        async def read(core, name):
            if api.read_error is not None:
                raise api.read_error
            return api.server.get(name) or c.nodes.cache[name]
        monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
        monkeypatch.setattr(controller_module, "read_node", read)
        c.api = api  # type: ignore[attr-defined]
        made.append(c)
        return c
    yield build
    metrics.clear_cluster_gauges()


def waiting(c: PlannerController, name: str, resources: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A pod the scheduler found no room for, as the pod watch delivers it."""
    p = pod(name, resources or {MIG_1G: "1"}, **spec)
    c.pods.cache[f"ml/{name}"] = p
    c._on_pod("ADDED", p)
    return p


def quiet(c: PlannerController) -> None:
    """The batch emptied and the loop asleep: what follows is what wakes it."""
    c.window.members.clear()
    c.wake.clear()


def free_slices(name: str, free: int, used: int = 0, plan: str = "p0") -> dict[str, Any]:
    """A one-GPU node whose agent reports `free` free and `used` used 1g.10gb."""
    mig = [MigInstance(profile="1g.10gb", start=i, used=i < used) for i in range(free + used)]
    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=mig)]), plan)
    return node(name, count=1, annotations={**status, SPEC_PLAN: plan})


def relabelled_to_mps() -> dict[str, Any]:
    """n1 labelled mps while its agent follows an acknowledged MIG spec: a switch is wanted."""
    spec = {SPEC_PLAN: "p0", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "1@0"}
    n1 = reported("n1", spec)
    n1["metadata"]["labels"]["dynpart.io/gpu-partitioning"] = "mps"
    return n1


def series(gauge: Any) -> dict[str, float]:
    return {next(iter(s.labels.values())): s.value for m in gauge.collect() for s in m.samples
            if not s.name.endswith("_created")}


def counted(counter: Any, label: str | None = None) -> float:
    c = counter.labels(label) if label else counter
    return float(c._value.get())


# --- leadership -----------------------------------------------------------------------------------


async def test_a_term_changed_without_a_loss_signalled_forgets_what_this_replica_wrote(make):
    """The event loop stalled past the lease, which another replica held meanwhile: the plans this
    replica has in flight, and the specs it meant to adopt or revoke, may all have been replaced."""
    lead = Lead(term=4)
    c = make([reported("n1")], lead)
    await c._expire_acks(now=0.0)  # term 4 seen
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c._to_adopt.add("n8")
    c._to_revoke.add("n9")
    await c._expire_acks(now=1.0)
    assert "n1" in c.in_flight, "the same term: kept"
    lead.term = 6
    await c._expire_acks(now=2.0)  # not overdue: only the term changed
    assert c.in_flight == {} and c._to_adopt == set() and c._to_revoke == set()


async def test_a_round_notices_a_changed_term_by_itself(make):
    lead = Lead(term=4)
    c = make([reported("n1")], lead)
    await c.plan_round()  # term 4 seen (nothing waits)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    await c.plan_round()
    assert "n1" in c.in_flight
    lead.term = 6
    await c.plan_round()
    assert c.in_flight == {}


async def test_a_lost_lease_forgets_adoptions_revocations_and_deleted_nodes_plans(make):
    """Leading again, another leader may have adopted, revoked or re-planned all of them: none is
    written or told from this replica's memory (a deleted node's pods were told by that leader)."""
    c = make([reported("n1")])
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    gone = c.nodes.cache.pop("n1")
    c._on_node("DELETED", gone)
    c._to_adopt.add("n8")
    c._to_revoke.add("n9")
    c.set_leading(False)
    c.set_leading(True)
    assert c._to_adopt == set() and c._to_revoke == set()
    await c._expire_acks(now=10.0)
    assert c.api.posted == []


async def test_a_change_of_leadership_wakes_the_loop(make):
    """A standby waits resync_s between steps: it plans at once when it takes the lease over (and
    clears its gauges at once when it loses it)."""
    c = make([])
    for leader in (True, False):
        c.wake.clear()
        c.set_leading(leader)
        assert c.wake.is_set()


async def test_a_unelected_replica_adopts_no_spec(make):
    """Leader election off: no term is written (the agents apply specs without one), and a spec of
    a term is not rewritten with 'None'."""
    c = make([reported("n1", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/a"})], Unelected())
    assert c._awaiting_from_annotations() == {"n1"} and c.in_flight["n1"].pods == {"ml/a"}
    assert c._to_adopt == set()


# --- the pod watch --------------------------------------------------------------------------------


async def test_a_new_waiting_pod_wakes_the_loop_and_a_bound_one_leaves_the_batch(make):
    c = make([reported("n1")])
    quiet(c)
    a = waiting(c, "a")
    assert "ml/a" in c.window.members and c.wake.is_set()
    c.wake.clear()
    c._on_pod("MODIFIED", a)
    assert not c.wake.is_set(), "the same pod again: nothing new"
    c._on_pod("MODIFIED", pod("a", {MIG_1G: "1"}, node="n1", phase="Running", unschedulable=False))
    assert "ml/a" not in c.window.members and "ml/a" not in c._waiting


async def test_the_events_about_a_pod_are_forgotten_only_once_it_is_bound_or_gone(make):
    """A pod that no longer waits but is not bound (its PodScheduled condition cleared while the
    scheduler tries it again) keeps its Events: they are not posted again if it waits again."""
    c = make([reported("n1")])
    a = waiting(c, "a")
    await c._event(a, "Unplaceable", "no room", warning=True)
    c._on_pod("MODIFIED", pod("a", {MIG_1G: "1"}, unschedulable=False))
    assert len(c.events) == 1
    c._on_pod("MODIFIED", pod("a", {MIG_1G: "1"}, node="n1", phase="Running", unschedulable=False))
    assert len(c.events) == 0


async def test_a_pod_made_again_under_its_name_starts_without_lapsed_reservations(make):
    """A new uid (a pod deleted and made again, the same spec) is another pod: the lapses of its
    predecessor's reservations do not back it off."""
    c = make([reported("n1")])
    a = waiting(c, "a")
    a["metadata"]["uid"] = "uid-1"
    c._on_pod("MODIFIED", a)
    c.loop.lapsed["ml/a"] = PodBackOff(lapses=3, nodes=["n1"])
    c._on_pod("MODIFIED", copy.deepcopy(a))
    assert "ml/a" in c.loop.lapsed, "the same pod: its lapses stay"
    again = copy.deepcopy(a)
    again["metadata"]["uid"] = "uid-2"
    c._on_pod("ADDED", again)
    assert "ml/a" not in c.loop.lapsed


async def test_a_bound_pod_that_goes_wakes_the_waiting_pods(make):
    """A bound pod that ends or is deleted frees CPU, memory, a pod slot, host ports and the domain
    its anti-affinity held (a CPU pod on a GPU node frees no slice, so no agent status says so):
    the waiting pods are planned again now, as the scheduler retries them, not at the resync. A
    pending pod going, or a bound one changing, wakes none."""
    c = make([reported("n1")])
    waiting(c, "a")
    quiet(c)
    other = waiting(c, "b")
    quiet(c)
    c._on_pod("DELETED", other)  # a pending pod went: it held nothing
    assert not c.wake.is_set() and not c.window.members
    cpu_pod = pod("cpu-hog", {"cpu": "14"}, phase="Running", node="n1", unschedulable=False)
    c._on_pod("MODIFIED", cpu_pod)
    assert not c.wake.is_set() and not c.window.members
    c._on_pod("DELETED", cpu_pod)
    assert c.wake.is_set() and "ml/a" in c.window.members


# --- the node watch -------------------------------------------------------------------------------


def _watched_with_a_pod_waiting(make: Any, n: dict[str, Any], **kw: Any) -> PlannerController:
    c = make([n], **kw)
    c._on_node("ADDED", n)
    waiting(c, "a")
    quiet(c)
    return c


def _changed(n: dict[str, Any], **annotations: str) -> dict[str, Any]:
    new = copy.deepcopy(n)
    new["metadata"]["annotations"].update(annotations)
    return new


async def test_a_heartbeat_or_a_spec_write_wakes_no_waiting_pod(make):
    """Agents rewrite their heartbeat, and the planner its specs, on every node: neither is a fact
    about room on the GPUs (a round for every waiting pod each time)."""
    n1 = reported("n1")
    c = _watched_with_a_pod_waiting(make, n1)
    c._on_node("MODIFIED", _changed(n1, **{"dynpart.io/status-heartbeat": "2026-11-27T10:00:00Z"}))
    c._on_node("MODIFIED", _changed(n1, **{"dynpart.io/status-heartbeat": "2026-11-27T10:05:00Z"}))
    c._on_node("MODIFIED", _changed(n1, **{SPEC_PLAN: "p9", "dynpart.io/spec-mode": "mig"}))
    assert not c.window.members and not c.wake.is_set()
    c._on_node("MODIFIED", _changed(n1, **{"dynpart.io/status-error": "nvml: GPU lost"}))
    assert "ml/a" in c.window.members and c.wake.is_set(), "any other status change does"


async def test_a_slice_taken_wakes_no_waiting_pod_and_a_slice_freed_does(make):
    n1 = free_slices("n1", free=2)
    c = _watched_with_a_pod_waiting(make, n1)
    taken = free_slices("n1", free=1, used=1)
    c._on_node("MODIFIED", taken)
    assert not c.window.members and not c.wake.is_set()
    c._on_node("MODIFIED", n1)  # the pod on it ended
    assert "ml/a" in c.window.members and c.wake.is_set()


@pytest.mark.parametrize("change", ["cpu", "memory", "pods", "ephemeral-storage", "taint", "label"])
async def test_a_node_admitting_more_wakes_the_waiting_pods(make, change):
    """More allocatable CPU, memory, pod slots or ephemeral storage, a taint removed, a label the
    pod selects: the scheduler may bind there now."""
    n1 = reported("n1")
    n1["status"]["allocatable"].update({"pods": "110", "ephemeral-storage": "50Gi"})
    n1["spec"] = {"taints": [{"key": "gpu", "value": "busy", "effect": "NoSchedule"}]}
    c = _watched_with_a_pod_waiting(make, n1)
    more = copy.deepcopy(n1)
    if change == "taint":
        more["spec"] = {}
    elif change == "label":
        more["metadata"]["labels"]["pool"] = "ml"
    else:
        more["status"]["allocatable"][change] = {"cpu": "32", "memory": "128Gi", "pods": "250",
                                                 "ephemeral-storage": "100Gi"}[change]
    c._on_node("MODIFIED", more)
    assert "ml/a" in c.window.members and c.wake.is_set()


async def test_a_node_deleted_and_made_again_under_its_name_is_a_new_node(make):
    """Its status and admission are forgotten with it: the node made again (the same status, a
    cloud instance replaced) wakes the waiting pods as any new node does; its Events are forgotten."""
    n1 = reported("n1")
    c = _watched_with_a_pod_waiting(make, n1)
    await c._event(n1, "LayoutPlanned", "plan p1")
    assert len(c.events) == 1
    del c.nodes.cache["n1"]
    c._on_node("DELETED", n1)
    assert len(c.events) == 0 and "n1" not in c._status and "n1" not in c._admits, "nothing kept of it"
    quiet(c)
    again = copy.deepcopy(n1)
    c.nodes.cache["n1"] = again
    c._on_node("ADDED", again)
    assert "ml/a" in c.window.members and c.wake.is_set()


async def test_a_node_deleted_with_nothing_or_a_revocation_in_flight_tells_no_pod(make):
    c = make([reported("n1"), reported("n2")])
    c.loop.written("n2", "r1", [], 0.0, revoking=True)
    for name in ("n1", "n2"):
        gone = c.nodes.cache.pop(name)
        c._on_node("DELETED", gone)
    await c._expire_acks(now=10.0)
    assert c.api.posted == [] and c.in_flight == {}


async def test_a_late_spec_is_neither_revoked_nor_adopted_on_a_node_made_again_under_its_name(make):
    """The node was deleted before the late spec could be revoked (or an earlier leader's adopted):
    the node made again under its name has no spec at all, and nothing is written to it."""
    late = reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})
    mine = reported("b", {SPEC_PLAN: "l2.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    earlier = reported("c", {SPEC_PLAN: "l3.0", SPEC_TERM: "2", SPEC_PODS: "ml/y"})
    c = make([late, mine, earlier])
    c._awaiting_from_annotations()
    assert c._to_revoke == {"a"} and c._to_adopt == {"c"}
    for old in (late, earlier):
        name = old["metadata"]["name"]
        del c.nodes.cache[name]
        c._on_node("DELETED", old)
        fresh = free_slices(name, free=1)
        c.nodes.cache[name] = fresh
        c._on_node("ADDED", fresh)
    c._awaiting_from_annotations()
    await c._adopt()
    assert c.api.written == []


# --- acknowledgements and writes ------------------------------------------------------------------


async def test_an_acknowledgement_wakes_the_loop_and_reserves_its_pods_once(make):
    """The node can be planned again (the loop wakes); the plan's pods are reserved there, once: a
    reservation that lapsed is not made again from the acknowledged spec naming them."""
    c = make([free_slices("n1", free=2)])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "p1", ["ml/a"], c.clock())
    c.wake.clear()
    ack = _changed(free_slices("n1", free=2, plan="p1"), **{SPEC_PLAN: "p1", SPEC_PODS: "ml/a"})
    c.nodes.cache["n1"] = ack
    c._on_node("MODIFIED", ack)
    assert c.wake.is_set() and c.in_flight == {} and c.reserved["ml/a"][0] == "n1"
    c.reserved["ml/a"] = ("n1", 0.0)  # lapsed unbound
    assert c._reservations() == {} and c._reservations() == {}


async def test_a_plan_written_by_a_round_is_revoked_when_not_acknowledged(make):
    c = make([reported("n1")], apply=True, ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    [(name, patch)] = c.api.written
    assert name == "n1" and not c.in_flight["n1"].revoking and c.in_flight["n1"].pods == {"ml/a"}
    await c._expire_acks(now=c.clock() + 10.0)
    assert [n for n, _ in c.api.written] == ["n1", "n1"]
    assert c.api.written[1][1]["dynpart.io/spec-revokes"] == patch[SPEC_PLAN] and c.in_flight["n1"].revoking


async def test_a_write_to_a_node_deleted_meanwhile_is_recorded_without_failing_the_round(make, monkeypatch):
    c = make([reported("n1")])

    async def patch(core, name, p, resource_version=None):
        c.api.written.append((name, p))
        del c.nodes.cache[name]  # deleted while the write was answered
        return {}
    monkeypatch.setattr(controller_module, "patch_node_annotations", patch)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert [n for n, _ in c.api.written] == ["n1"] and c.in_flight["n1"].pods == {"ml/a"}


# --- the loop ---------------------------------------------------------------------------------------


def _informers_that_wait(c: PlannerController, monkeypatch: Any) -> tuple[list[str], list[str]]:
    started: list[str] = []
    cancelled: list[str] = []

    def waits(name: str) -> Any:
        async def run() -> None:
            started.append(name)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(name)
                raise
        return run
    for informer in (c.nodes, c.pods, c.claims, c.volumes, c.classes, c.other_nodes):
        monkeypatch.setattr(informer, "run", waits(informer.name))
    return started, cancelled


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("resync_s, first", [(10.0, "nodes"), (30.0, "pods")])
async def test_planning_starts_once_nodes_and_pods_are_listed_and_the_watches_are_watched(make, monkeypatch, resync_s,
                                                                                          first):
    """A round on half-listed caches would miss the specs in flight on unlisted nodes (and plan
    their pods twice). The liveness probe watches the node and pod watches from the start, the
    loop once both are listed (a first list longer than the loop's limit, each page beating its
    watch, must not get the planner restarted and listing again for ever), the claim and volume
    watches only once listed; ending the loop ends every watch."""
    now = [0.0]
    liveness = Liveness(clock=lambda: now[0])
    c = PlannerController(client.ApiClient(), PlannerSettings(resync_s=resync_s), CAT, liveness=liveness,
                          leadership=Lead(term=3))
    assert c.liveness is liveness
    started, cancelled = _informers_that_wait(c, monkeypatch)
    gate, steps = asyncio.Event(), []

    async def step() -> None:
        steps.append(1)
        await gate.wait()
    c._step = step  # type: ignore[method-assign]
    task = asyncio.create_task(c.run())
    await _turns()
    assert sorted(started) == ["claims", "nodes", "other nodes", "pods", "storage classes", "volumes"] and steps == []
    listed, then = (c.nodes, c.pods) if first == "nodes" else (c.pods, c.nodes)
    listed.synced.set()
    await _turns()
    assert steps == [], f"the {then.name} are not listed yet"
    assert "planning loop" not in liveness._max_age
    for _ in range(10):  # a long first list: 10 pages, 50 s apart
        now[0] += 50.0
        liveness.beat(f"watch {then.name}")
        liveness.beat(f"watch {listed.name}")
    assert liveness.stale() == []
    then.synced.set()
    await _turns()
    assert steps == [1]
    kube = c.settings.kube
    watch_s = kube.watch_timeout_s + kube.watch_idle_timeout_s + kube.backoff_max_s
    assert liveness._max_age == {"watch nodes": watch_s, "watch pods": watch_s,
                                 "planning loop": max(60.0, 4 * resync_s)}
    c.claims.synced.set()
    await _turns()
    assert liveness._max_age["watch claims"] == watch_s and "watch volumes" not in liveness._max_age
    assert "watch storage classes" not in liveness._max_age
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _turns()
    assert sorted(cancelled) == ["claims", "nodes", "other nodes", "pods", "storage classes", "volumes"], \
        "the volume watch never listed, too"


async def test_a_failing_step_is_counted_and_the_next_waits_a_second(make, monkeypatch):
    """A bug some object triggers at every step must not spin the event loop (the lease renewal and
    the watches run on it)."""
    c = make([])
    _informers_that_wait(c, monkeypatch)
    c.nodes.synced.set()
    c.pods.synced.set()
    at: list[float] = []
    loop = asyncio.get_running_loop()

    async def step() -> None:
        at.append(loop.time())
        if len(at) == 1:
            raise RuntimeError("a field some object lacks")
        raise asyncio.CancelledError
    c._step = step  # type: ignore[method-assign]
    before = counted(metrics.PLAN_ERRORS, "internal")
    with pytest.raises(asyncio.CancelledError):
        await c.run()
    assert at[1] - at[0] >= 0.9 and counted(metrics.PLAN_ERRORS, "internal") == before + 1


async def test_the_leader_plans_when_its_batch_closes_not_at_the_resync(make):
    c = make([reported("n1")], resync_s=60.0, batch_idle_s=0.01, batch_timeout_s=0.05)
    c.leading.set()
    rounds: list[int] = []

    async def plan_round() -> None:
        rounds.append(1)
    c.plan_round = plan_round  # type: ignore[method-assign]
    waiting(c, "a")
    await asyncio.wait_for(c._step(), timeout=2.0)
    assert rounds == [1]


async def test_a_step_sleeps_until_woken_or_resync(make):
    """A wake-up seen by one step is used up there: the next step sleeps (no busy loop)."""
    c = make([reported("n1")], resync_s=0.05)
    c.leading.set()
    c.wake.set()  # an earlier wake-up, handled by the step before
    loop = asyncio.get_running_loop()
    started = loop.time()
    await c._step()
    assert loop.time() - started >= 0.045 and not c.wake.is_set()


def _counting_rounds(c: PlannerController) -> list[float]:
    rounds: list[float] = []
    real = c.plan_round

    async def plan_round() -> None:
        rounds.append(c.clock())
        await real()
    c.plan_round = plan_round  # type: ignore[method-assign]
    return rounds


async def test_a_step_plans_only_when_a_round_is_due(make):
    """No pod waiting and no node to switch: no round. A pod waiting outside the batch: a round at
    the resync. Right after a round: none until the next batch or resync."""
    t = [1000.0]
    c = make([reported("n1")], resync_s=0.01)
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    c.leading.set()
    rounds = _counting_rounds(c)
    await c._step()
    assert rounds == []
    waiting(c, "a")
    c.window.members.clear()  # waits outside the batch (it was planned before, and still waits)
    await c._step()
    assert rounds == [1000.0]
    await c._step()
    assert rounds == [1000.0], "just planned"


async def test_a_relabelled_node_is_switched_at_the_resync_with_no_pod_waiting(make):
    """The agent leaves the old mode while idle: the switching spec is written though nothing waits,
    once (in flight, the node wants no more rounds)."""
    t = [1000.0]
    c = make([relabelled_to_mps()], resync_s=0.01)
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    c.leading.set()
    rounds = _counting_rounds(c)
    await c._step()
    assert rounds == [1000.0] and [r for r, _, _, _ in c.api.posted if r == "ModeSwitch"] == ["ModeSwitch"]
    [(name, patch)] = c.api.written
    assert name == "n1" and patch["dynpart.io/spec-mode"] == "mps"
    t[0] += 1.0
    await c._step()
    assert rounds == [1000.0], "the switch is in flight: no round for it"


async def test_a_step_revokes_the_plans_overdue(make):
    spec = {SPEC_PLAN: "p1", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
            SPEC_TERM: "3", SPEC_PODS: "ml/a"}
    c = make([reported("n1", spec)], ack_timeout_s=1.0, resync_s=0.01)
    c.leading.set()
    c.loop.written("n1", "p1", ["ml/a"], c.clock() - 10.0)
    await c._step()
    assert c.in_flight["n1"].revoking and [n for n, _ in c.api.written] == ["n1"]


# --- gauges -----------------------------------------------------------------------------------------


async def test_the_pending_gauge_labels_what_a_gpu_of_the_catalog_offers(make):
    """A pod asking for two slices, or for a MIG profile no GPU offers, or an MPS slice bigger than the
    largest GPU's, or one the round found invalid, is `invalid`; an MPS slice as big as the largest
    GPU's is its own label (not only the smallest GPU's)."""
    largest = max(m.mps_capacity_gb for m in CAT.models.values())
    assert min(m.mps_capacity_gb for m in CAT.models.values()) < largest
    c = make([reported("n1")])
    waiting(c, "ok")
    waiting(c, "two", {MIG_1G: "1", "nvidia.com/mig-2g.20gb": "1"})
    waiting(c, "nine", {"nvidia.com/mig-9g.99gb": "1"})
    waiting(c, "largest", {f"nvidia.com/gpu-{largest}gb": "1"})
    waiting(c, "huge", {f"nvidia.com/gpu-{largest + 1}gb": "1"})
    waiting(c, "zero", {"nvidia.com/gpu-0010gb": "1"})  # a name dynpart refuses (leading zeros)
    waiting(c, "bad")
    c._invalid_pods = {"ml/bad"}
    c.refresh_gauges(c.clock())
    assert series(metrics.PENDING_PODS) == {MIG_1G: 1.0, f"nvidia.com/gpu-{largest}gb": 1.0, metrics.INVALID: 5.0}


async def test_a_pod_the_round_found_invalid_is_counted_invalid_whatever_it_asks_for(make):
    c = make([reported("n1")])
    waiting(c, "odd", {MIG_1G: "500m"})  # half a slice: the round refuses it
    await c.plan_round()
    c.refresh_gauges(c.clock())
    assert series(metrics.PENDING_PODS) == {metrics.INVALID: 1.0}


async def test_only_the_nodes_that_disagree_with_the_catalog_have_a_series(make):
    from tests.controller.test_metrics_reset import disagreeing_capability

    agreeing = encode_capability(node_of(kind_of(H100, "NVIDIA H100 80GB HBM3"), gpus=2))
    n1 = reported("n1")
    n1["metadata"]["annotations"]["dynpart.io/status-capability"] = agreeing
    n2 = reported("n2")
    n2["metadata"]["annotations"]["dynpart.io/status-capability"] = disagreeing_capability()
    c = make([n1, n2])
    c.refresh_gauges(c.clock())
    assert series(metrics.CATALOG_DISAGREEMENTS) == {"n2": 1.0}, "n2's one difference; none for n1"
    del c.nodes.cache["n2"]
    c.refresh_gauges(c.clock())
    assert series(metrics.CATALOG_DISAGREEMENTS) == {} and set(c._disagreements) == {"n1"}, "n2 forgotten"


# --- deferrals --------------------------------------------------------------------------------------


async def test_a_pod_is_left_again_for_an_older_one_in_flight_and_pods_that_went_are_dropped(make):
    c = make([])
    for name in ("web-0", "web-1"):
        waiting(c, name)
    c._left_for_unplaced = {"ml/web-1": "ml/web-0", "ml/gone": "ml/web-0"}
    assert c._not_to_defer() == {"ml/web-1": {"ml/web-0"}}, "ml/gone no longer waits: not kept"
    c.loop.written("n1", "p1", ["ml/web-0"], 0.0)
    assert c._not_to_defer() == {}, "web-0 planned (in flight): web-1 is planned against it"


# --- plans overdue ------------------------------------------------------------------------------------


def _mine(plan: str = "p1", pods: str = "ml/a", **status: str) -> dict[str, Any]:
    """n1 with this replica's plan written (term 3), not acknowledged."""
    spec = {SPEC_PLAN: plan, "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
            SPEC_TERM: "3", SPEC_PODS: pods}
    n1 = reported("n1", spec)
    n1["metadata"]["annotations"].update(status)
    return n1


async def test_a_plan_in_flight_on_a_node_gone_from_the_cache_is_given_up_at_once(make):
    """The node went without its deletion seen (a watch gap): nothing will apply the plan; its pods
    join the batch now, each told why, without a wait said that there was none."""
    c = make([])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.wake.clear()
    await c._expire_acks(now=1.0)
    assert c.in_flight == {} and "ml/a" in c.window.members and c.wake.is_set()
    [(message, warning, obj)] = c.api.of("PlanNotApplied")
    assert warning and obj["metadata"]["name"] == "a"
    assert "node n1 (plan p1)" in message and "the node was deleted" in message and " within " not in message


async def test_a_plan_the_stale_cache_shows_replaced_stays_in_flight_when_the_node_cannot_be_read(make):
    c = make([replaced_by_another_leader()], ack_timeout_s=1.0)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.api.read_error = APITransportError("read node n1: connection reset")
    await c._expire_acks(now=10.0)
    assert c.in_flight["n1"].plan_id == "p1" and c.api.written == [] and c.api.posted == []
    assert "ml/a" not in c.window.members, "its agent may still apply it: not planned elsewhere"


async def test_a_plan_acknowledged_while_the_node_was_read_is_not_revoked(make, monkeypatch):
    c = make([replaced_by_another_leader()], ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    ours = _mine()

    async def read(core, name):
        ack = _mine(**{STATUS_PLAN: "p1"})
        c.nodes.cache[name] = ack
        c._on_node("MODIFIED", ack)  # the watch delivers the acknowledgement meanwhile
        return ours
    monkeypatch.setattr(controller_module, "read_node", read)
    await c._expire_acks(now=10.0)
    assert c.api.written == [] and c.api.posted == [] and c.reserved["ml/a"][0] == "n1"


async def test_a_revocation_that_could_not_be_written_is_not_taken_as_written(make):
    """The plan stays in flight unrevoked (its agent may still apply it) and is revoked at a later
    step; its pods are not planned elsewhere meanwhile."""
    c = make([_mine()], ack_timeout_s=1.0)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.api.patch_error = APIServerError("patch node n1: etcd timeout", status=500)
    await c._expire_acks(now=10.0)
    assert c.in_flight["n1"] == InFlight("p1", 0.0, {"ml/a"}) and c.api.posted == []
    c.api.patch_error = None
    await c._expire_acks(now=11.0)
    assert c.in_flight["n1"].revoking and [n for n, _ in c.api.written] == ["n1"]


async def test_a_revocation_tells_the_agents_error_wakes_the_loop_and_warns(make):
    c = make([_mine(**{"dynpart.io/status-error": "nvml: insufficient resources"})], ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.wake.clear()
    await c._expire_acks(now=10.0)
    assert c.wake.is_set()
    [(message, warning, _)] = c.api.of("PlanNotApplied")
    assert warning and "(nvml: insufficient resources)" in message and "within 1 s" in message
    [(_, warning, obj)] = c.api.of("PlanRevoked")
    assert warning and obj["metadata"]["name"] == "n1"


async def test_a_plan_replaced_by_another_writer_is_released_and_wakes_the_loop(make):
    c = make([replaced_by_another_leader()], ack_timeout_s=1.0)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    c.wake.clear()
    await c._expire_acks(now=10.0)
    assert "n1" not in c.in_flight and c.wake.is_set()


async def test_a_replica_that_cannot_prove_it_leads_gives_up_no_plan(make):
    """Not even one that cannot be revoked (its node unreadable): another replica may lead now."""
    spec = {SPEC_PLAN: "p1", "dynpart.io/spec-mode": "mig", SPEC_TERM: "3", SPEC_PODS: "ml/a"}
    c = make([unreadable(spec)], Lead(term=3, writes=False), ack_timeout_s=1.0)
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    await c._expire_acks(now=10.0)
    assert "n1" in c.in_flight and c.api.posted == [] and "ml/a" not in c.window.members


# --- specs found on the nodes -----------------------------------------------------------------------


async def test_of_two_specs_naming_a_pod_the_higher_term_keeps_it_whatever_the_ids_or_node_names(make):
    late = reported("b", {SPEC_PLAN: "l9.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})
    mine = reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    c = make([late, mine])
    c._awaiting_from_annotations()
    assert c.in_flight["a"].pods == {"ml/x"} and c._to_revoke == {"b"}
    # one term: the later plan id (its wall-clock milliseconds) keeps it, whatever the node names
    older = reported("b", {SPEC_PLAN: "19e807aec00-1.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    newer = reported("a", {SPEC_PLAN: "19ebc15b600-4.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    c = make([older, newer])
    c._awaiting_from_annotations()
    assert c.in_flight["a"].pods == {"ml/x"} and c._to_revoke == {"b"}


async def test_a_spec_to_adopt_whose_pods_another_plan_now_holds_is_revoked_not_adopted(make):
    c = make([reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})])
    c._to_adopt.add("a")  # found before, its adoption not written yet
    c.loop.written("b", "l2.0", ["ml/x"], 0.0)
    c._awaiting_from_annotations()
    assert c._to_adopt == set() and c._to_revoke == {"a"}


async def test_a_late_spec_whose_pods_are_no_longer_held_is_adopted_not_revoked(make):
    """Its pods' other plan went (the lease lost and won again, or the plan released): the late
    spec is the only plan for them now, adopted as any earlier leader's."""
    c = make([reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})])
    c.loop.written("b", "l2.0", ["ml/x"], 0.0)
    c._awaiting_from_annotations()
    assert c._to_revoke == {"a"}
    c.loop.forget_node("b")
    c._awaiting_from_annotations()
    await c._adopt()
    assert c.api.written == [("a", {SPEC_TERM: "3"})]


async def test_a_round_adopts_an_earlier_leaders_spec(make):
    c = make([reported("n1", {SPEC_PLAN: "late", SPEC_TERM: "2", SPEC_PODS: "ml/a"})])
    await c.plan_round()
    assert c.api.written == [("n1", {SPEC_TERM: "3"})]


async def test_specs_to_adopt_or_revoke_on_nodes_gone_from_the_cache_write_nothing(make):
    c = make([])
    c._to_adopt.add("gone")
    c._to_revoke.add("gone")
    await c._adopt()
    assert c.api.written == []


async def test_a_late_spec_on_a_node_that_became_unreadable_is_not_revoked(make):
    late = reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})
    c = make([late, reported("b", {SPEC_PLAN: "l2.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})])
    c._awaiting_from_annotations()
    assert c._to_revoke == {"a"}
    c.nodes.cache["a"] = unreadable({SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x"})
    c.nodes.cache["a"]["metadata"]["name"] = "a"
    await c._adopt()
    assert c.api.written == []


async def test_a_late_spec_is_revoked_once_and_its_other_pods_are_planned_again_at_once(make):
    late = reported("a", {SPEC_PLAN: "l1.0", SPEC_TERM: "2", SPEC_PODS: "ml/x,ml/z"})
    mine = reported("b", {SPEC_PLAN: "l2.0", SPEC_TERM: "3", SPEC_PODS: "ml/x"})
    c = make([late, mine])
    c._awaiting_from_annotations()
    c.wake.clear()
    await c._adopt()
    assert [n for n, _ in c.api.written] == ["a"] and c.wake.is_set()
    assert "ml/z" in c.window.members and "ml/x" not in c.window.members
    [(_, warning, _)] = c.api.of("PlanRevoked")
    assert warning
    c._awaiting_from_annotations()
    await c._adopt()
    assert len(c.api.written) == 1, "revoked once"


# --- reservations -----------------------------------------------------------------------------------


async def test_the_pods_of_an_unacknowledged_spec_are_not_reserved(make):
    """No slice was made for them (on a node that cannot be read, the spec is not even waited
    for): reserving them would keep them from other nodes, then back them off as if the scheduler
    had refused a slice."""
    c = make([unreadable({SPEC_PLAN: "p1", "dynpart.io/spec-mode": "mig", SPEC_TERM: "3", SPEC_PODS: "ml/a"})])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    assert c._reservations() == {}


async def test_a_pod_planned_since_is_not_reserved_by_an_older_acknowledged_spec(make):
    """x is in flight on b (or reserved on b's free slices): the slice a's older spec made for it
    is not held for it too."""
    c = make([acked("a", "19e807aec00-1.0"), free_slices("b", free=2)])
    c.pods.cache["ml/x"] = pod("x", {MIG_1G: "1"})
    c.loop.written("b", "19ebc15b600-4.0", ["ml/x"], c.clock())
    assert c._reservations() == {}
    c.loop.forget_node("b")
    c.loop.reserve("ml/x", "b", c.clock())
    c._reserved_for.clear()
    assert c._reservations() == {"ml/x": "b"}


async def test_a_reserved_pod_that_binds_ends_its_reservation_at_once(make):
    """Bound: the scheduler took the slice; the reservation is not left to lapse (a lapse would
    count against the pod and keep it off the node)."""
    c = make([free_slices("n1", free=2)])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.reserve("ml/a", "n1", c.clock())
    assert c._reservations() == {"ml/a": "n1"}
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"}, node="n1", phase="Running", unschedulable=False)
    assert c._reservations() == {} and c.reserved == {}


async def test_what_was_reserved_for_a_pod_gone_is_forgotten(make):
    c = make([reported("n1")])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c._reserved_for.update({"ml/a": {"p1"}, "ml/gone": {"p1"}})
    c._reservations()
    assert set(c._reserved_for) == {"ml/a"}


async def test_a_reservation_on_a_node_that_became_unreadable_holds(make):
    c = make([unreadable({})])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.reserve("ml/a", "n1", c.clock())
    assert c._reservations() == {"ml/a": "n1"}


# --- rounds -----------------------------------------------------------------------------------------


async def test_volumes_narrow_the_pods_only_once_both_claims_and_volumes_are_listed(make, monkeypatch):
    """A claim without its volume (or a volume without its claims) says nothing of where a pod's
    volume is: narrowing by half the picture could keep a pod off the only nodes that can take it."""
    c = make([reported("n1")])
    seen: list[Any] = []
    real = controller_module.build_snapshot

    def build_snapshot(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["volumes"])
        return real(*args, **kwargs)
    monkeypatch.setattr(controller_module, "build_snapshot", build_snapshot)
    await c.plan_round()
    c.claims.synced.set()
    await c.plan_round()
    c.claims.synced.clear()
    c.volumes.synced.set()
    await c.plan_round()
    c.claims.synced.set()
    await c.plan_round()
    assert seen[:3] == [None, None, None] and isinstance(seen[3], controller_module.VolumeTopology)


async def test_a_claim_made_after_its_pod_plans_the_pod_at_once(make):
    """A pod whose PersistentVolumeClaim the claims' watch had not delivered yet (made just after
    the pod, or an ephemeral volume's claim its controller makes) is not planned: when the claim
    arrives the pod joins a batch at once, not at the next resync (the claims' watch woke nothing:
    an Unplaceable Event a watch lag caused stood for up to resync_s, 15 s by default)."""
    from tests.controller.test_volume_topology import claim, using

    c = make([reported("n1")])
    c.claims.synced.set()
    c.volumes.synced.set()
    p = using("a", "data")
    c.pods.cache["ml/a"] = p
    c._on_pod("ADDED", p)
    c.loop.begin_round(c.clock())
    await c.plan_round()
    assert "PersistentVolumeClaim ml/data does not exist" in c.api.of("Unplaceable")[0][0]
    quiet(c)
    made = claim("data", None, phase="Pending")
    c.claims.cache["ml/data"] = made
    c._on_claim("ADDED", made)
    assert c.wake.is_set() and "ml/a" in c.window.members
    quiet(c)
    c._on_claim("MODIFIED", made)  # (told once: the next round says again what it waits for)
    assert not c.wake.is_set()


async def test_a_pod_whose_claim_binds_immediately_waits_told_why_and_is_planned_once_the_claim_is_bound(make):
    """The scheduler places a pod whose claim is not bound yet and binds immediately nowhere (its
    class Immediate, or missing): the planner carves nothing for it, says why in an Unplaceable
    Event, and plans it again as soon as the claim is bound, or the class it names is made."""
    from tests.controller.test_volume_topology import BIND_COMPLETED, CLASSES, claim, storage_class, using, volume

    c = make([reported("n1")])
    for informer in (c.claims, c.volumes, c.classes):
        informer.synced.set()
    c.classes.cache.update({sc["metadata"]["name"]: sc for sc in CLASSES})
    p = using("a", "data")
    c.pods.cache["ml/a"] = p
    c._on_pod("ADDED", p)
    c.claims.cache["ml/data"] = claim("data", None, phase="Pending", storage_class="fast")
    c.loop.begin_round(c.clock())
    await c.plan_round()
    [(message, _, _)] = c.api.of("Unplaceable")
    assert "PersistentVolumeClaim ml/data is not bound yet and its StorageClass fast binds immediately" in message
    assert not c.in_flight, "nothing carved"
    quiet(c)
    c._on_class("ADDED", storage_class("other", "Immediate"))
    assert not c.wake.is_set(), "not its class"
    bound = claim("data", "pv-1", phase="Bound", storage_class="fast")
    assert BIND_COMPLETED in bound["metadata"]["annotations"]
    c.claims.cache["ml/data"] = bound
    c._on_claim("MODIFIED", bound)
    assert c.wake.is_set() and "ml/a" in c.window.members
    told = len(c.api.of("Unplaceable"))
    c.loop.begin_round(c.clock())
    await c.plan_round()
    assert not c.in_flight, "its volume not listed yet: bound to a volume that does not exist, for the scheduler too"
    assert len(c.api.of("Unplaceable")) == told, "a volume just made, whose claim's binding came first: no Event"
    quiet(c)
    c._on_volume("ADDED", volume("other"))
    assert not c.wake.is_set(), "not its volume"
    c.volumes.cache["pv-1"] = volume("pv-1")
    c._on_volume("ADDED", c.volumes.cache["pv-1"])
    assert c.wake.is_set() and "ml/a" in c.window.members
    c.loop.begin_round(c.clock())
    await c.plan_round()
    assert c.in_flight, "planned once the claim is bound and its volume listed"
    # a claim of a class not made yet: planned once the class is made (WaitForFirstConsumer)
    c2 = make([reported("n1")])
    for informer in (c2.claims, c2.volumes, c2.classes):
        informer.synced.set()
    c2.pods.cache["ml/a"] = p
    c2._on_pod("ADDED", p)
    c2.claims.cache["ml/data"] = claim("data", None, phase="Pending", storage_class="late")
    c2.loop.begin_round(c2.clock())
    await c2.plan_round()
    assert "StorageClass late does not exist" in c2.api.of("Unplaceable")[-1][0]
    quiet(c2)
    late = storage_class("late", "WaitForFirstConsumer")
    c2.classes.cache["late"] = late
    c2._on_class("ADDED", late)
    assert c2.wake.is_set() and "ml/a" in c2.window.members
    c2.loop.begin_round(c2.clock())
    await c2.plan_round()
    assert c2.in_flight



@pytest.mark.parametrize("change", ["claim bound", "volume made", "class made"])
async def test_a_claim_volume_or_class_that_changes_while_the_round_plans_wakes_its_pods_after_it(make, monkeypatch,
                                                                                               change):
    """The round reads the claims, volumes and classes, then plans in a thread while the watches
    go on: one that changes meanwhile woke nobody (its callback ran before the round said who
    waits for it), and the pod waited for the resync (resync_s, 15 s by default)."""
    from tests.controller.test_volume_topology import claim, storage_class, using, volume

    c = make([reported("n1")])
    for informer in (c.claims, c.volumes, c.classes):
        informer.synced.set()
    p = using("a", "data")
    c.pods.cache["ml/a"] = p
    c._on_pod("ADDED", p)
    if change == "claim bound":
        c.classes.cache["fast"] = storage_class("fast", "Immediate")
        c.claims.cache["ml/data"] = claim("data", None, phase="Pending", storage_class="fast")
    elif change == "volume made":
        c.claims.cache["ml/data"] = claim("data", "pv-1", phase="Bound")
    else:
        c.claims.cache["ml/data"] = claim("data", None, phase="Pending", storage_class="late")
    snapshot = controller_module._snapshot_without_collector

    def meanwhile(*args: Any, **kwargs: Any) -> Any:
        view = snapshot(*args, **kwargs)
        if change == "claim bound":  # (what the watches deliver while the round's thread runs)
            c.claims.cache["ml/data"] = claim("data", "pv-1", phase="Bound", storage_class="fast")
            c.volumes.cache["pv-1"] = volume("pv-1")
            c._on_claim("MODIFIED", c.claims.cache["ml/data"])
        elif change == "volume made":
            c.volumes.cache["pv-1"] = volume("pv-1")
            c._on_volume("ADDED", c.volumes.cache["pv-1"])
        else:
            c.classes.cache["late"] = storage_class("late", "WaitForFirstConsumer")
            c._on_class("ADDED", c.classes.cache["late"])
        return view
    monkeypatch.setattr(controller_module, "_snapshot_without_collector", meanwhile)
    c.loop.begin_round(c.clock())
    quiet(c)
    await c.plan_round()
    # (a claim bound to a volume not listed yet is a round's wait, without an Event)
    assert bool(c.api.of("Unplaceable")) == (change != "volume made") and not c.in_flight
    assert "ml/a" in c.window.members and c.wake.is_set()

def _full(name: str) -> dict[str, Any]:
    from tests.controller.test_pod_conflicts import labelled

    status = encode_status(NodeLayout(node=name, mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="7g.80gb", start=0, used=True)])]), "p0")
    return labelled(node(name, count=1, annotations={**status, SPEC_PLAN: "p0"}), **{"topology.kubernetes.io/zone": "z1"})


async def test_pods_left_for_an_older_one_join_the_next_batch(make):
    from tests.controller.test_pod_conflicts import ZONE, replica

    c = make([_full("n1"), _full("n2")])
    for i in range(2):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)  # (the nodes' one zone: z1)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    c.loop.begin_round(c.clock())  # the round's batch closed
    await c.plan_round()
    assert c._deferred == {"ml/web-1": "ml/web-0"} and "ml/web-1" in c.window.members


async def test_a_write_that_conflicts_is_neither_reserved_nor_in_flight_and_its_pods_wait_again(make):
    from tests.controller.test_pod_conflicts import ZONE, labelled, replica

    # zone anti-affinity, the nodes' one zone (pods conflicting on one node only are planned together)
    c = make([labelled(free_slices(f"n{i}", free=0), **{ZONE: "z1"}) for i in (1, 2)])
    for i in range(2):
        c.pods.cache[f"ml/web-{i}"] = replica(f"web-{i}", key=ZONE)
        c._on_pod("ADDED", c.pods.cache[f"ml/web-{i}"])
    c.api.patch_error = APIConflictError("the object has been modified", status=409)
    before = counted(metrics.PLAN_ERRORS, "conflict")
    quiet(c)
    await c.plan_round()
    assert c.in_flight == {} and c.reserved == {} and "SlicePlanned" not in c.api.reasons()
    assert counted(metrics.PLAN_ERRORS, "conflict") == before + 1
    assert {"ml/web-0", "ml/web-1"} <= c.window.members and c.wake.is_set()
    assert not c.window.ready(c.clock()), "web-0 was not placed: web-1 waits for the batch as usual"


async def test_a_written_plans_pods_are_in_flight_and_a_free_slices_pods_reserved(make):
    c = make([free_slices("n1", free=0), free_slices("n2", free=1, used=1)])
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.pods.cache["ml/b"] = pod("b", {MIG_1G: "1"}, nodeSelector={"nvidia.com/gpu.count": "1"})
    placed = counted(metrics.PODS_PLACED)
    await c.plan_round()
    assert [n for n, _ in c.api.written] == ["n1"] and c.in_flight["n1"].pods == {"ml/a"}
    assert c.reserved.keys() == {"ml/b"} and c.reserved["ml/b"][0] == "n2"
    told = {o["metadata"]["name"]: (m, w) for m, w, o in c.api.of("SlicePlanned")}
    assert told["a"][0].endswith("after its agent applies the new layout") and told["b"][0].endswith("on free slices")
    assert not told["a"][1] and not told["b"][1], "Normal Events"
    [(_, warning, obj)] = c.api.of("LayoutPlanned")
    assert not warning and obj["metadata"]["name"] == "n1"
    assert counted(metrics.PODS_PLACED) == placed + 2


@pytest.mark.parametrize("error, read, in_flight", [
    (APIClientError("patch node n1: invalid", status=422), "fails", False),  # refused: never applied
    (APIServerError("patch node n1: etcd timeout", status=504), "fails", True),  # unknown: the safe side
    (APIServerError("patch node n1: etcd timeout", status=504), "without", False),
    (APITransportError("patch node n1: connection reset"), "with", True),
])
async def test_a_failed_write_is_in_flight_only_if_it_may_have_landed(make, monkeypatch, error, read, in_flight):
    c = make([free_slices("n1", free=0)])
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.api.patch_error = error

    async def read_node(core, name):
        if read == "fails":
            raise APITransportError("read node n1: connection reset")
        landed = {SPEC_PLAN: c.api.tried[-1][1][SPEC_PLAN]} if read == "with" else {}
        return _changed(c.nodes.cache[name], **landed)
    monkeypatch.setattr(controller_module, "read_node", read_node)
    await c.plan_round()
    assert ("n1" in c.in_flight) is in_flight
    assert ("SlicePlanned" in c.api.reasons()) is in_flight and c.reserved == {}


def _mps_node(name: str, used: int = 0) -> dict[str, Any]:
    status = encode_status(NodeLayout(node=name, mode="mps", gpus=[GpuLayout(index=0, mps=[
        MpsSlice(size=10, used=True) for _ in range(used)])]), "p0")
    return node(name, mode="mps", count=1, annotations={**status, SPEC_PLAN: "p0"})


def _as_user(p: dict[str, Any], uid: int) -> dict[str, Any]:
    p["spec"]["securityContext"] = {"runAsUser": uid}
    return p


@pytest.mark.parametrize("written", [True, False])
async def test_an_mps_pod_planned_beside_another_users_is_warned_only_if_its_plan_is_written(make, written):
    c = make([_mps_node("m1", used=1)])
    c.pods.cache["ml/run"] = _as_user(pod("run", {"nvidia.com/gpu-10gb": "1"}, node="m1", phase="Running",
                                          unschedulable=False, hostIPC=True), 1000)
    c.pods.cache["ml/new"] = _as_user(pod("new", {"nvidia.com/gpu-10gb": "1"}, hostIPC=True), 2000)
    if not written:
        c.api.patch_error = APIConflictError("the object has been modified", status=409)
    await c.plan_round()
    # (a 409 for a node unchanged in what the plan read is written again, CONFLICT_RETRIES more times)
    assert [n for n, _ in c.api.tried] == ["m1"] * (1 if written else 1 + CONFLICT_RETRIES)
    told = c.api.of("MpsUserMismatch")
    assert len(told) == int(written) and all(w and o["metadata"]["name"] == "new" for _, w, o in told)


async def test_the_round_warns_of_mps_pods_without_host_ipc_invalid_nodes_and_catalog_disagreements(make):
    from tests.controller.test_metrics_reset import disagreeing_capability

    bad = reported("n2")
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = "many"
    odd = reported("n3")
    odd["metadata"]["annotations"]["dynpart.io/status-capability"] = disagreeing_capability()
    c = make([_mps_node("m1"), bad, odd], mps_clients_host_ipc=True)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/gpu-10gb": "1"})
    await c.plan_round()
    [(_, warning, obj)] = c.api.of("MpsUnreachable")
    assert warning and obj["metadata"]["name"] == "a"
    [(_, warning, obj)] = c.api.of("DynpartInvalid")
    assert warning and obj["metadata"]["name"] == "n2"
    [(message, warning, obj)] = c.api.of("CatalogDisagreement")
    assert warning and obj is c.nodes.cache["n3"], "about the node as cached (its uid: kubectl describe finds it)"
    assert message.startswith("the GPU driver and the catalog differ")


async def test_a_pod_whose_usable_nodes_wait_for_their_agent_is_not_told_of_dynparts_own_exclusions(make):
    """n1 is in the round but a pod bound there holds the host port the pod asks for (dynpart's
    own avoiding term keeps the plan off it); n2, which could take it, has not reported yet. The
    Event names n2's agent, not a required node affinity the pod does not have (an e2e run once
    posted that)."""
    c = make([reported("n1"), node("n2")])
    web = pod("web", {}, node="n1", phase="Running", unschedulable=False)
    a = pod("a", {MIG_1G: "1"})
    for p in (web, a):
        p["spec"]["containers"][0]["ports"] = [{"containerPort": 80, "hostPort": 8080, "protocol": "TCP"}]
    c.pods.cache["ml/web"], c.pods.cache["ml/a"] = web, a
    await c.plan_round()
    [(message, warning, _)] = c.api.of("Unplaceable")
    assert warning and "the node(s) that could take it (n2) wait for their agent" in message, message
    assert "affinity" not in message, message


async def test_a_pod_whose_nodes_are_left_out_is_told_which_wait_for_their_agent(make):
    """n1 alone admits the pod, and its agent has not reported; n2 has not either but the pod cannot
    use it: only n1 is named. A node whose revocation is in flight waits for its agent too (no plan
    for the pod is on its way there); a plan on its way: nothing to tell."""
    n1, n2 = node("n1"), node("n2")
    n1["metadata"]["labels"]["pool"] = "a"
    c = make([n1, n2])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"}, nodeSelector={"pool": "a"})
    await c.plan_round()
    [(message, warning, _)] = c.api.of("Unplaceable")
    assert warning and "the node(s) that could take it (n1) wait for their agent" in message
    c = make([reported("n1")])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.written("n1", "r1", [], c.clock(), revoking=True)
    c.api.posted.clear()
    await c.plan_round()
    [(message, _, _)] = c.api.of("Unplaceable")
    assert "(n1) wait for their agent" in message
    c.in_flight["n1"] = InFlight("p1", c.clock(), {"ml/b"})
    c.api.posted.clear()
    await c.plan_round()
    assert c.api.of("Unplaceable") == []


async def test_a_pod_whose_only_node_is_left_out_for_another_reason_is_told_so(make):
    """n1 is being switched to MPS (the switch's write failed: nothing in flight): left out of the
    round, its agent not awaited."""
    c = make([relabelled_to_mps()])
    c.api.patch_error = APIServerError("patch node n1: etcd timeout", status=500)
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/gpu-10gb": "1"}, hostIPC=True)
    await c.plan_round()
    [(message, _, _)] = c.api.of("Unplaceable")
    assert "the node(s) that could take it are left out of planning (see the nodes' Events)" in message


async def test_a_switch_whose_write_fails_is_not_in_flight_and_a_node_deleted_meanwhile_is_not_switched(
        make, monkeypatch):
    c = make([relabelled_to_mps()])
    c.api.patch_error = APIServerError("patch node n1: etcd timeout", status=500)
    await c.plan_round()
    assert c.in_flight == {} and "ModeSwitch" not in c.api.reasons()
    c.api.patch_error = None
    real = controller_module.build_snapshot

    def build_snapshot(*args: Any, **kwargs: Any) -> Any:
        view = real(*args, **kwargs)
        c.nodes.cache.pop("n1", None)  # deleted while the round read the caches
        return view
    monkeypatch.setattr(controller_module, "build_snapshot", build_snapshot)
    await c.plan_round()
    assert c.api.written == [] and c.in_flight == {}


async def test_a_pod_backing_off_is_told_when_it_is_planned_again(make, monkeypatch):
    t = [500.0]
    c = make([reported("n1")])
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    backoff = PodBackOff(lapses=3, nodes=["n1", "n2"], until=t[0] + 120.0, delay=120.0)
    monkeypatch.setattr(c.loop, "take_backoffs_started", lambda: [("ml/a", backoff)])
    wall = 1_764_201_600.0  # 2025-11-27T00:00:00Z
    monkeypatch.setattr(controller_module.time, "time", lambda: wall)
    await c._tell_backoffs()
    [(message, warning, obj)] = c.api.of("SlicesNotTaken")
    assert warning and obj["metadata"]["name"] == "a"
    assert "after 120 s, at 2025-11-27T00:02:00Z" in message and "node(s) n1, n2" in message


# --- the pure helpers -------------------------------------------------------------------------------


def _status(**values: str) -> dict[str, str]:
    return {STATUS_PLAN: "p1", **{f"dynpart.io/status-gpu-0-{k.replace('_', '.')}": v for k, v in values.items()}}


@pytest.mark.parametrize("before, after, grew", [
    (_status(**{"1g_10gb-free": "1@0"}), _status(), True),  # the only free slice destroyed: room on the GPU
    (_status(), _status(**{"1g_10gb-free": "1@0"}), True),  # a slice made where there was none
    (_status(**{"1g_10gb-used": "1@0"}), _status(), True),  # a pod ended and its slice was destroyed
    (_status(), _status(**{"1g_10gb-used": "1@0"}), True),  # a slice made and taken at once: changed
    (_status(**{"10gb-free": "1", "10gb-used": "2"}), _status(**{"10gb-used": "2"}), True),  # MPS memory freed
    (_status(**{"10gb-free": "2", "10gb-used": "1"}), _status(**{"10gb-free": "1", "10gb-used": "2"}), False),
])
async def test_room_may_have_grown(before, after, grew):
    assert controller_module._room_may_have_grown(before, after) is grew


async def test_what_the_scheduler_said_is_read_from_its_pod_scheduled_condition_only():
    says = controller_module._scheduler_says

    def with_conditions(*conditions: Any) -> dict[str, Any]:
        return {"status": {"conditions": list(conditions)}}
    refused = {"type": "PodScheduled", "status": "False", "message": " 0/4 nodes are available "}
    assert says(with_conditions("junk", {"type": "Ready", "status": "False", "message": "no"}, refused)) \
        == "0/4 nodes are available"
    assert says(with_conditions({"type": "PodScheduled", "status": "True", "message": "bound"})) is None
    assert says(with_conditions({"status": "False", "message": "whose?"})) is None
    assert says(with_conditions({**refused, "message": "x" * 400})) == "x" * 400
    assert says(with_conditions({**refused, "message": "x" * 401})) == "x" * 397 + "..."
    assert says(None) is None


async def test_the_back_off_message_quotes_the_scheduler_when_it_said_something():
    b = PodBackOff(lapses=3, nodes=["n1"], until=0.0, delay=120.0)
    said = controller_module._backoff_message(b, "n1", "2025-11-27T00:02:00Z", "0/4 nodes: volume node affinity")
    assert "the scheduler said: '0/4 nodes: volume node affinity'" in said
    assert "its PodScheduled condition says what" in controller_module._backoff_message(b, "n1", "t", None)


async def test_a_spec_of_a_term_is_newer_than_one_of_none_whatever_the_ids(make):
    """Terms start at 0 (the lease's leaseTransitions): a spec of term 0 is newer than one written
    without leader election, even with an older plan id."""
    c = make([acked("a", "19faa80de00-1.0"), acked("b", "19ebc15b600-4.0", term=0)], Lead(term=0))
    c.pods.cache["ml/x"] = pod("x", {MIG_1G: "1"})
    assert c._reservations() == {"ml/x": "b"}


async def test_a_pod_created_over_a_minute_after_its_plan_is_another_pod(make):
    """The plan id says when it was written; the API server's creationTimestamp when the pod was:
    up to 60 s of skew between the clocks is the same pod, more is a pod made again."""
    import datetime as dt

    written_ms = int(dt.datetime(2026, 11, 27, 2, 0, tzinfo=dt.UTC).timestamp() * 1000)
    plan_id = f"{written_ms:x}-1"
    for created, reserved in (("2026-11-27T02:01:00.500000+00:00", False), ("2026-11-27T02:00:59Z", True),
                              (None, True)):  # no timestamp: nothing says it is another pod
        c = make([acked("n1", plan_id, pods="ml/a")])
        p = pod("a", {MIG_1G: "1"})
        if created is None:
            del p["metadata"]["creationTimestamp"]
        else:
            p["metadata"]["creationTimestamp"] = created
        c.pods.cache["ml/a"] = p
        assert (c._reservations() == {"ml/a": "n1"}) is reserved, created


# --- more of the rounds -----------------------------------------------------------------------------


async def test_a_step_and_each_part_of_a_round_beat_the_liveness_probe(make, monkeypatch):
    """A round at scale takes seconds in each of its threads: each part beats, so that the probe's
    limit need not cover a whole round."""
    c = make([reported("n1")], resync_s=0.01)
    beats: list[str] = []
    monkeypatch.setattr(c.liveness, "beat", beats.append)
    await c._step()  # a standby's step too
    assert beats == ["planning loop"]
    beats.clear()
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert beats == ["planning loop"] * 3, "after the snapshot, after the plan, before its one node write"


async def test_a_pod_no_node_has_room_for_is_told_so(make):
    """Its ephemeral storage fits no node (the slices aside): the scheduler will not bind it anywhere."""
    n1 = reported("n1")
    n1["status"]["allocatable"]["ephemeral-storage"] = "1Gi"
    c = make([n1])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1", "ephemeral-storage": "2Gi"})
    await c.plan_round()
    [(message, warning, obj)] = c.api.of("Unplaceable")
    assert warning and obj["metadata"]["name"] == "a" and message.startswith("dynpart cannot place this pod: ")
    assert "ephemeral-storage" in message


async def test_a_replica_that_cannot_prove_it_leads_neither_reserves_nor_tells(make):
    c = make([free_slices("n1", free=1)], Lead(term=3, writes=False))
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    await c.plan_round()
    assert c.reserved == {} and c.api.written == [] and "SlicePlanned" not in c.api.reasons()


async def test_a_disagreement_is_told_about_a_node_deleted_during_the_round(make, monkeypatch):
    from tests.controller.test_metrics_reset import disagreeing_capability

    odd = reported("n3")
    odd["metadata"]["annotations"]["dynpart.io/status-capability"] = disagreeing_capability()
    c = make([odd])
    real = controller_module.build_snapshot

    def build_snapshot(*args: Any, **kwargs: Any) -> Any:
        view = real(*args, **kwargs)
        c.nodes.cache.pop("n3")
        return view
    monkeypatch.setattr(controller_module, "build_snapshot", build_snapshot)
    await c.plan_round()
    [(_, warning, obj)] = c.api.of("CatalogDisagreement")
    assert warning and obj == {"kind": "Node", "metadata": {"name": "n3"}}


# --- metrics ----------------------------------------------------------------------------------------


def _histogram(h: Any) -> tuple[float, float]:
    """(count, sum) of an unlabelled histogram."""
    samples = {s.name: s.value for m in h.collect() for s in m.samples}
    return samples[f"{h._name}_count"], samples[f"{h._name}_sum"]


async def test_the_counters_of_a_round_a_write_and_an_acknowledgement(make):
    t = [1000.0]
    c = make([free_slices("n1", free=0)], apply=True)
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    plans, node_plans, created = counted(metrics.PLANS), counted(metrics.NODE_PLANS), \
        counted(metrics.SLICES_CREATED, "mig")
    seconds = _histogram(metrics.PLAN_SECONDS)
    await c.plan_round()  # nothing waits: no plan computed
    assert counted(metrics.PLANS) == plans and _histogram(metrics.PLAN_SECONDS) == seconds
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert counted(metrics.PLANS) == plans + 1 and counted(metrics.NODE_PLANS) == node_plans + 1
    assert counted(metrics.SLICES_CREATED, "mig") == created + 1
    count, total = _histogram(metrics.PLAN_SECONDS)
    assert count == seconds[0] + 1 and 0 <= total - seconds[1] < 60
    acks, (ack_count, ack_sum) = counted(metrics.PLAN_ACKS), _histogram(metrics.PLAN_ACK_SECONDS)
    t[0] += 2.5
    [(_, patch)] = c.api.written
    ack = _changed(c.nodes.cache["n1"], **{STATUS_PLAN: str(patch[SPEC_PLAN])})
    c.nodes.cache["n1"] = ack
    c._on_node("MODIFIED", ack)
    assert counted(metrics.PLAN_ACKS) == acks + 1 and _histogram(metrics.PLAN_ACK_SECONDS) == (ack_count + 1,
                                                                                                 ack_sum + 2.5)


async def test_the_counters_of_what_went_wrong(make):
    def errors(reason: str) -> float:
        return counted(metrics.PLAN_ERRORS, reason)

    c = make([free_slices("n1", free=0)], Lead(term=3, writes=False))
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    before = errors("not_leader")
    await c.plan_round()
    assert errors("not_leader") == before + 1
    c = make([free_slices("n1", free=0)])
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.api.patch_error = APIClientError("patch node n1: invalid", status=422)
    before = errors("patch_failed")
    await c.plan_round()
    assert errors("patch_failed") == before + 1
    c = make([_mine()], ack_timeout_s=1.0)
    c.loop.written("n1", "p1", ["ml/a"], 0.0)
    before = errors("ack_timeout")
    await c._expire_acks(now=10.0)
    assert errors("ack_timeout") == before + 1
    bad = reported("n2")
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = "many"
    c = make([bad])
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "500m"})
    before, unplaceable = errors("bad_object"), counted(metrics.PODS_UNPLACEABLE)
    await c.plan_round()
    assert errors("bad_object") == before + 2, "the node and the pod"
    c = make([free_slices("n1", free=0, used=0)])
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1"})
    c.pods.cache["ml/big2"] = pod("big2", {"nvidia.com/mig-7g.80gb": "1"})
    await c.plan_round()
    assert counted(metrics.PODS_UNPLACEABLE) == unplaceable + 1


async def test_a_reservation_whose_slice_another_pod_took_is_counted(make):
    c = make([free_slices("n1", free=1)])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.reserve("ml/a", "n1", c.clock())
    c.pods.cache["ml/x"] = pod("x", {MIG_1G: "1"}, node="n1", phase="Running", unschedulable=False)
    before = counted(metrics.RESERVATIONS_TAKEN)
    assert c._reservations() == {}
    assert counted(metrics.RESERVATIONS_TAKEN) == before + 1



async def test_a_pod_bound_beside_a_reservation_whose_quantity_cannot_be_read_fails_no_round(make):
    """A pod bound to a node holding a reservation (its nodeName set by hand, before its kubelet
    refuses it) whose request the API server admitted but dynpart cannot count: every round
    checked it for the slices it takes, raised, and planned nothing for anyone."""
    c = make([free_slices("n1", free=1)])
    c.pods.cache["ml/a"] = pod("a", {MIG_1G: "1"})
    c.loop.reserve("ml/a", "n1", c.clock())
    c.pods.cache["ml/x"] = pod("x", {"cpu": "10e399"}, node="n1", phase="Running", unschedulable=False)
    assert c._reservations() == {"ml/a": "n1"}

async def test_a_round_skipped_for_an_invalid_snapshot_is_counted(make, monkeypatch):
    from dynpart.errors import DynpartError

    c = make([free_slices("n1", free=0)])
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})

    def fails(*args: Any) -> Any:
        raise DynpartError("two nodes of one name")
    monkeypatch.setattr(c.loop, "decide_with", fails)
    before = counted(metrics.PLAN_ERRORS, "invalid_snapshot")
    await c.plan_round()
    assert counted(metrics.PLAN_ERRORS, "invalid_snapshot") == before + 1 and c.api.written == []


async def test_what_lasts_is_logged_when_it_appears_not_every_round(make, caplog):
    """Over three rounds: a node's annotation of another dynpart version (WARNING once), pods other
    schedulers place or no node admits (INFO once; the other scheduler named once, the one dynpart
    plans for never), a pod no node has room for and one waiting for its node's agent (INFO once);
    DEBUG afterwards."""
    import logging

    n1 = reported("n1")
    n1["metadata"]["labels"]["pool"] = "a"
    n1["metadata"]["annotations"]["dynpart.io/status-driver"] = "590.1"
    n1["status"]["allocatable"]["ephemeral-storage"] = "1Gi"
    n2 = reported("n2")
    n2["metadata"]["labels"]["pool"] = "b"
    c = make([n1, n2])
    c.pods.cache["ml/other"] = pod("other", {MIG_1G: "1"}, schedulerName="my-scheduler")
    c.pods.cache["ml/nowhere"] = pod("nowhere", {MIG_1G: "1"}, nodeSelector={"pool": "none"})
    c.pods.cache["ml/blocked"] = pod("blocked", {MIG_1G: "1", "ephemeral-storage": "2Gi"}, nodeSelector={"pool": "a"})
    c.pods.cache["ml/wait"] = pod("wait", {MIG_1G: "1"}, nodeSelector={"pool": "b"})
    c.loop.written("n2", "p1", ["ml/x"], c.clock())
    caplog.set_level(logging.DEBUG, logger="dynpart.planner")
    for _ in range(3):
        await c.plan_round()

    def levels(match: Any) -> list[int]:
        return [r.levelno for r in caplog.records if match(r)]

    def about(message: str, key: str) -> Any:
        return lambda r: r.getMessage() == message and getattr(r, "fields", {}).get("pod") == key
    assert levels(lambda r: "'dynpart.io/status-driver'" in r.getMessage()) == [logging.WARNING] + [logging.DEBUG] * 2
    for key in ("ml/other", "ml/nowhere"):
        assert levels(lambda r, key=key: r.getMessage().startswith(f"pod {key} is not planned")) == \
            [logging.INFO] + [logging.DEBUG] * 2, key
    told = [r.getMessage() for r in caplog.records if "places are not planned" in r.getMessage()]
    assert len(told) == 1 and "'my-scheduler'" in told[0]
    assert levels(about("pod not placed", "ml/blocked")) == [logging.INFO] + [logging.DEBUG] * 2
    assert levels(about("pod waits for its nodes' agents", "ml/wait")) == [logging.INFO] + [logging.DEBUG] * 2


async def test_the_free_slices_a_plan_destroys_are_counted(make):
    c = make([free_slices("n1", free=2)])
    c.pods.cache["ml/big"] = pod("big", {"nvidia.com/mig-7g.80gb": "1"})
    destroyed, created = counted(metrics.SLICES_DESTROYED, "mig"), counted(metrics.SLICES_CREATED, "mig")
    await c.plan_round()
    assert [n for n, _ in c.api.written] == ["n1"]
    assert counted(metrics.SLICES_DESTROYED, "mig") == destroyed + 2 and counted(metrics.SLICES_CREATED, "mig") == created + 1


async def test_a_round_whose_pods_all_back_off_computes_no_plan(make):
    c = make([free_slices("n1", free=0)])
    c.pods.cache["ml/a"] = pod("a", {"nvidia.com/mig-3g.40gb": "1"})
    c.loop.lapsed["ml/a"] = PodBackOff(lapses=5, nodes=["n1"], until=c.clock() + 600.0, delay=600.0)
    plans = counted(metrics.PLANS)
    await c.plan_round()
    assert counted(metrics.PLANS) == plans and c.api.written == [] and c.api.of("Unplaceable") == []


async def test_a_pod_whose_quantity_the_watch_cannot_read_is_planned_as_invalid_not_lost(make):
    """A quantity dynpart cannot read (the API server validates them; a newer suffix, a bug): the
    watch's callback must not raise (the informer would keep the pod cached and never tell the
    loop again until it changes), and the round reports the pod (DynpartInvalid), as it does a pod
    it meets in its snapshot."""
    c = make([reported("n1")])
    odd = pod("odd", {MIG_1G: "1", "cpu": "lots"})
    c.pods.cache["ml/odd"] = odd
    c._on_pod("ADDED", odd)
    assert "ml/odd" in c._waiting
    await c.plan_round()
    [(message, warning, obj)] = c.api.of("DynpartInvalid")
    assert warning and obj["metadata"]["name"] == "odd" and "lots" in message



@pytest.mark.parametrize("quantities", [{"cpu": "10e399"}, {"cpu": "1e306"}, {MIG_1G: "100e306"}],
                         ids=["beyond a float", "beyond millicores", "two containers' sum"])
async def test_a_pod_whose_quantity_the_api_server_admits_but_no_number_holds_stops_no_step(make, quantities):
    """Quantities the API server admits (any decimal exponent) but dynpart cannot count: the pod
    watch's callback must not raise (an OverflowError there ended the pods' informer), the round
    reports the pod (DynpartInvalid) and plans the others, and the gauges count it as invalid
    (they raised at every step while it waited)."""
    c = make([reported("n1")])
    odd = pod("odd", {MIG_1G: "1"})
    odd["spec"]["containers"] = [{"name": n, "resources": {"limits": {MIG_1G: "1"}, "requests": dict(quantities)}}
                                 for n in ("a", "b")]
    c.pods.cache["ml/odd"] = odd
    c._on_pod("ADDED", odd)
    assert "ml/odd" in c._waiting
    waiting(c, "ok")
    await c.plan_round()
    [(message, warning, obj)] = c.api.of("DynpartInvalid")
    assert warning and obj["metadata"]["name"] == "odd" and "is not a Kubernetes quantity" in message
    assert [p[SPEC_PODS] for _, p in c.api.written] == ["ml/ok"], "the other pod is planned"
    c.refresh_gauges(c.clock())
    assert series(metrics.PENDING_PODS).get(metrics.INVALID) == 1

async def test_the_term_floor_is_the_highest_term_on_the_nodes_once_they_are_read(make):
    """The lease's term_floor (dynpart.kube.leases): unknown until the node cache is synced; then
    the highest spec-term on a node (-1 with none; a malformed one is no term)."""
    c = make([node("a", annotations={SPEC_TERM: "4"}), node("b", annotations={SPEC_TERM: "11"}),
              node("c", annotations={SPEC_TERM: "x"}), node("d")])
    assert c.highest_written_term() is None
    c.nodes.synced.set()
    assert c.highest_written_term() == 11
    del c.nodes.cache["b"]
    assert c.highest_written_term() == 4
    c.nodes.cache.clear()
    assert c.highest_written_term() == -1


async def test_the_planning_loop_beats_while_a_round_writes_its_nodes(make):
    """A round that writes many nodes through a slow or throttled API server (each write bounded
    by request_timeout_s) takes longer than the liveness limit in all: each node written beats,
    so the planner is not restarted half-way through writing a plan it would then make again."""
    now = [0.0]
    c = make([free_slices(f"n{i}", free=0, used=1) for i in range(3)])
    c.liveness = Liveness(clock=lambda: now[0])
    c.liveness.expect("planning loop", 60.0)
    write = c._write_plan

    async def slow_write(name: str, patch: dict[str, str | None], planned_from: Any) -> None:
        now[0] += 40.0  # each write answered after 40 s: three of them outlast the 60 s limit
        await write(name, patch, planned_from)
    c._write_plan = slow_write  # type: ignore[method-assign]
    for name in ("a", "b", "c"):
        waiting(c, name, {"nvidia.com/mig-3g.40gb": "1"})
    await c.plan_round()
    assert sorted(n for n, _ in c.api.written) == ["n0", "n1", "n2"]
    assert c.liveness.stale() == []


async def test_the_planning_loop_beats_while_it_revokes_many_overdue_plans(make):
    """A round's plans to hundreds of nodes whose agents all stopped answering (a bad agent rollout)
    fall overdue together: `_expire_acks` revokes them in one step, a bounded write each, through a
    throttled API server longer than the liveness limit in all. Each node revoked beats, as each
    node a round writes does: the planner is not restarted half-way (its successor would find the
    same plans overdue, and revoke them the same way)."""
    now = [0.0]
    spec = {SPEC_PLAN: "p1", "dynpart.io/spec-mode": "mig", "dynpart.io/spec-gpu-0-1g.10gb": "2@0,1",
            SPEC_TERM: "3"}
    c = make([reported(f"n{i}", {**spec, SPEC_PODS: f"ml/p{i}"}) for i in range(3)], ack_timeout_s=1.0)
    c.liveness = Liveness(clock=lambda: now[0])
    c.liveness.expect("planning loop", 60.0)
    for i in range(3):
        c.loop.written(f"n{i}", "p1", [f"ml/p{i}"], 0.0)
    patch = c._patch_as_leader

    async def slow_patch(name: str, p: dict[str, str | None], resource_version: str | None = None) -> None:
        now[0] += 40.0  # each write answered after 40 s: three of them outlast the 60 s limit
        await patch(name, p, resource_version)
    c._patch_as_leader = slow_patch  # type: ignore[method-assign]
    await c._expire_acks(now=10.0)
    assert sorted(n for n, _ in c.api.written) == ["n0", "n1", "n2"]
    assert all(c.in_flight[f"n{i}"].revoking for i in range(3))
    assert c.liveness.stale() == []


async def test_a_round_builds_its_snapshot_with_the_cycle_collector_paused(make, monkeypatch):
    """build_snapshot allocates hundreds of thousands of objects, freed by reference counting;
    with the collector on, their number sets off full collections over the caches' millions of
    objects (a third of the snapshot's time at 61,000 pods). Paused as plan() pauses it, and on again
    after."""
    import gc

    seen: list[bool] = []
    build = controller_module.build_snapshot

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return build(*args, **kwargs)
    monkeypatch.setattr(controller_module, "build_snapshot", recording)
    c = make([reported("n1")])
    waiting(c, "a")
    assert gc.isenabled()
    await c.plan_round()
    assert seen == [False] and gc.isenabled()


async def test_slices_not_allocatable_yet_are_said_only_once_the_lag_lasts(make, caplog):
    """A node's agent reports two free slices, its allocatable lists one (the kubelet writes the
    new count at its next status write; with publishAllocatable=false after every
    reconfiguration). The round counts the other as used from the first, and says so (a warning,
    a SlicesNotAllocatable Event) only once it has lasted `allocatable_lag_s`; the clock starts
    again once allocatable caught up, and runs on while the node is out of a round."""
    n1 = free_slices("n1", free=2)
    n1["status"]["allocatable"][MIG_1G] = "1"
    c = make([n1], allocatable_lag_s=60.0)
    t = [100.0]
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    waiting(c, "a")  # planned on the free slice the node offers (no write)
    told = lambda: [m for r, m, w, _ in c.api.posted if r == "SlicesNotAllocatable" and w]  # noqa: E731
    said = lambda: [r.getMessage() for r in caplog.records  # noqa: E731
                    if r.levelname == "WARNING" and "allocatable" in r.getMessage()]
    with caplog.at_level(logging.DEBUG, logger="dynpart"):
        await c.plan_round()
        assert told() == [] and said() == []
        t[0] = 159.0
        await c.plan_round()
        assert told() == [] and said() == []
        t[0] = 160.0
        await c.plan_round()
        assert told() == ["node n1: 2 nvidia.com/mig-1g.10gb slice(s) reported, 1 allocatable: 1 free one(s) not "
                          "planned for pods"] and len(said()) == 1
        t[0] = 170.0
        await c.plan_round()
        assert len(told()) == 1 and len(said()) == 1  # said once while it lasts
    # allocatable caught up: forgotten; a new lag waits its own time
    n1["status"]["allocatable"][MIG_1G] = "2"
    await c.plan_round()
    assert c._unallocatable_since == {}
    n1["status"]["allocatable"][MIG_1G] = "1"
    t[0] = 200.0
    await c.plan_round()
    assert c._unallocatable_since == {("n1", MIG_1G): ("p0", 200.0)}
    # out of a round (a plan in flight there): its clock runs on (what allocatable says meanwhile
    # is not read)
    c.loop.written("n1", "p9", [], t[0])
    n1["status"]["allocatable"][MIG_1G] = "2"
    t[0] = 230.0
    await c.plan_round()
    assert c._unallocatable_since == {("n1", MIG_1G): ("p0", 200.0)}
    # its agent acknowledges another plan, whose slices the kubelet has yet to list: a new clock
    c.loop.forget_node("n1")
    n1["metadata"]["annotations"]["dynpart.io/status-plan"] = n1["metadata"]["annotations"][SPEC_PLAN] = "p9"
    n1["status"]["allocatable"][MIG_1G] = "1"
    t[0] = 280.0
    await c.plan_round()
    assert c._unallocatable_since == {("n1", MIG_1G): ("p9", 280.0)}
    # a replica that stops leading forgets the clocks (as a standby it runs no round)
    c._forget_leader_state()
    assert c._unallocatable_since == {}
    await c.plan_round()
    assert c._unallocatable_since == {("n1", MIG_1G): ("p9", 280.0)}
    # a node gone is forgotten
    del c.nodes.cache["n1"]
    c.loop.forget_node("n1")
    await c.plan_round()
    assert c._unallocatable_since == {}


async def test_a_lag_that_ended_between_rounds_does_not_make_the_next_one_lasting(make):
    """(helper-143) the allocatable lag's clock (`_report_unallocatable`) is only read at rounds, which run
    only while pods wait. A lag that a round saw, then ended (the kubelet's status write) while no
    round ran, must not count as lasting when a later lag of the same acknowledged plan comes (the
    agent restarted, its device plugin registering again: the kubelet lists the slices again at its
    next status write): the node watch saw allocatable change in between."""
    n1 = free_slices("n1", free=2)
    n1["status"]["allocatable"][MIG_1G] = "1"  # plan p0 just acknowledged: the kubelet lags
    c = make([n1], allocatable_lag_s=60.0)
    t = [100.0]
    c.clock = lambda: t[0]  # type: ignore[method-assign]
    told = lambda: [m for r, m, w, _ in c.api.posted if r == "SlicesNotAllocatable" and w]  # noqa: E731
    waiting(c, "a")
    await c.plan_round()
    assert told() == []
    # the kubelet's next status write: allocatable caught up (the node watch delivers it); no pod
    # waits, so no round runs for a long while
    caught_up = copy.deepcopy(n1)
    caught_up["status"]["allocatable"][MIG_1G] = "2"
    caught_up["metadata"]["resourceVersion"] = "2"
    c.nodes.cache["n1"] = caught_up
    c._on_node("MODIFIED", caught_up)
    # ten minutes later the agent is upgraded: its plugin registers again and the kubelet lists
    # the slices at its next status write; a pod arrives meanwhile, and a round runs
    t[0] = 700.0
    lagging = copy.deepcopy(caught_up)
    lagging["status"]["allocatable"][MIG_1G] = "1"
    lagging["metadata"]["resourceVersion"] = "3"
    c.nodes.cache["n1"] = lagging
    c._on_node("MODIFIED", lagging)
    waiting(c, "b")
    await c.plan_round()
    assert told() == [], f"a lag of seconds reported as lasting: {told()}"


async def test_a_stop_that_arrives_with_a_wake_up_stops_the_step(make):
    """A wake-up and the controller's stop in the same turn of the event loop: the step stops and
    plans nothing (asyncio.wait_for on 3.11 dropped the stop and planned a round)."""
    c = make([reported("n1")], resync_s=60.0)
    c.leading.set()
    rounds: list[int] = []

    async def plan_round() -> None:
        rounds.append(1)
    c.plan_round = plan_round  # type: ignore[method-assign]
    step = asyncio.create_task(c._step())
    for _ in range(5):  # into its wait for a wake-up
        await asyncio.sleep(0)
    c.wake.set()
    step.cancel()
    await asyncio.wait({step}, timeout=2.0)
    assert step.cancelled() and rounds == []
