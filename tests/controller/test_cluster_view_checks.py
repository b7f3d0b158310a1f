"""cluster_view against the Kubernetes objects a real cluster serves, checks that
test_cluster_view.py leaves open (found by mutation testing): every quantity suffix, pod overhead
and pod-level resources, pods that ended, and what a node's allocatable, taints and annotations
tell the snapshot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynpart.catalog import default_catalog
from dynpart.errors import DynpartError
from dynpart.planner.cluster_view import build_snapshot, is_batch_candidate, parse_quantity, pending_pod
from tests.controller.test_cluster_view import node, pod
from tests.controller.test_pod_conflicts import labelled, replica, with_port

CAT = default_catalog()
MIG_1G = {"nvidia.com/mig-1g.10gb": "1"}

# apimachinery's suffixes: binary (powers of 1024) and decimal (powers of 1000)
BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
DECIMAL = {"n": -3, "u": -2, "m": -1, "": 0, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


# --- quantities ------------------------------------------------------------------------------------


@given(st.integers(0, 10**6), st.sampled_from(sorted(BINARY)))
def test_every_binary_suffix_is_a_power_of_1024(n, suffix):
    value = n * 1024 ** BINARY[suffix]
    if value > 2**63:  # more than Kubernetes counts (its Value() saturates): refused, not summed into infinity
        with pytest.raises(DynpartError, match="at most 2\\^63-1"):
            parse_quantity(f"{n}{suffix}")
        return
    assert parse_quantity(f"{n}{suffix}") == value


@given(st.integers(0, 10**6), st.sampled_from(sorted(DECIMAL)))
def test_every_decimal_suffix_is_a_power_of_1000(n, suffix):
    value = n * 1000.0 ** DECIMAL[suffix]
    if value > 2**63:
        with pytest.raises(DynpartError, match="at most 2\\^63-1"):
            parse_quantity(f"{n}{suffix}")
        return
    assert parse_quantity(f"{n}{suffix}") == pytest.approx(value, rel=1e-12)


def test_exponents_and_fractions_read_as_the_api_writes_them():
    assert parse_quantity("1e3") == 1000 and parse_quantity("1.5Gi") == 1.5 * 2**30
    assert parse_quantity(" 250m ") == 0.25 and parse_quantity(4) == 4


@pytest.mark.parametrize("text", ["", "m", "Gi", "E", "1.2.3", "Gi5"])
def test_a_suffix_without_a_number_or_a_malformed_number_is_not_a_quantity(text):
    with pytest.raises(DynpartError, match="not a Kubernetes quantity"):
        parse_quantity(text)


# --- a pod's requests --------------------------------------------------------------------------------


def test_pod_overhead_counts_even_for_a_resource_no_container_requests():
    """RuntimeClass overhead (e.g. a VM sandbox) is added to the pod's requests by the scheduler,
    also for CPU its containers leave unset."""
    p = pod("a", MIG_1G, overhead={"cpu": "250m", "memory": "64Mi"})
    wants = pending_pod(p)
    assert (wants.cpu_milli, wants.memory_mib) == (250, 64)
    p = pod("b", {**MIG_1G, "cpu": "1"}, overhead={"cpu": "250m"})
    assert pending_pod(p).cpu_milli == 1250


def test_pod_level_huge_pages_replace_the_containers_sum():
    """PodLevelResources: the pod's hugepages-2Mi request is what the scheduler counts against the
    node; a node whose huge pages a bound pod takes that way has none for the next."""
    n1 = node("n1", count=1)
    n1["status"]["allocatable"]["hugepages-2Mi"] = "1Gi"
    bound = pod("bound", {"cpu": "1"}, phase="Running", node="n1", unschedulable=False)
    bound["spec"]["resources"] = {"requests": {"hugepages-2Mi": "1Gi"}}
    wants = pod("wants", {**MIG_1G, "hugepages-2Mi": "2Mi"})
    view = build_snapshot([n1], [bound, wants], CAT)
    assert not view.snapshot.pending
    assert [p["metadata"]["name"] for p, _ in view.blocked] == ["wants"]
    assert "hugepages-2Mi" in view.blocked[0][1]
    # without it the node has room
    del bound["spec"]["resources"]
    assert [p.name for p in build_snapshot([n1], [bound, wants], CAT).snapshot.pending] == ["ml/wants"]


def test_ill_typed_pod_level_requests_are_a_problem_of_the_pod_not_a_crash():
    with pytest.raises(DynpartError, match="spec.resources.requests"):
        p = pod("a", MIG_1G)
        p["spec"]["resources"] = {"requests": ["cpu"]}
        pending_pod(p)


# --- pods that ended ---------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_pod_that_ended_holds_nothing_on_its_node(phase):
    """A Job's pods stay bound after they end, and `dynpart explain` lists them: their requests, slices,
    host ports and anti-affinity are free for others (the scheduler's pod informer selects
    status.phase!=Succeeded,Failed), as a round of the controller (which watches only live pods) sees it."""
    n1 = labelled(node("n1", count=1, cpu="4"))
    ended = with_port(replica("old", bound="n1"), 8080)
    ended["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
    ended["status"]["phase"] = phase
    new = with_port(replica("new"), 8080)
    view = build_snapshot([n1], [ended, new], CAT)
    assert view.snapshot.nodes[0].cpu_milli_free == 4000
    assert [p.name for p in view.snapshot.pending] == ["ml/new"] and not view.blocked
    # the same pod still running excludes the new one
    ended["status"]["phase"] = "Running"
    view = build_snapshot([n1], [ended, new], CAT)
    assert view.snapshot.nodes[0].cpu_milli_free == 1000
    assert not view.snapshot.pending and [p["metadata"]["name"] for p, _ in view.blocked] == ["new"]


def test_a_pod_a_plan_in_flight_put_somewhere_that_ended_excludes_no_one():
    n1 = labelled(node("n1", count=1))
    gone = replica("old")
    gone["status"] = {"phase": "Failed"}
    new = replica("new")
    view = build_snapshot([n1], [gone, new], CAT, in_flight={"ml/old": "n1"})
    assert [p.name for p in view.snapshot.pending] == ["ml/new"]
    gone["status"] = {"phase": "Pending"}
    view = build_snapshot([n1], [gone, new], CAT, in_flight={"ml/old": "n1"})
    assert "ml/new" not in [p.name for p in view.snapshot.pending]


def test_a_zero_request_of_a_slice_resource_asks_for_nothing():
    """`nvidia.com/mig-1g.10gb: 0` (a template's placeholder) asks for no device: the pod is no batch
    candidate for it, and one that asks for another slice is planned for that one."""
    zero = pod("zero", {"nvidia.com/mig-1g.10gb": "0"})
    assert not is_batch_candidate(zero)
    both = pod("both", {"nvidia.com/mig-1g.10gb": "0", "nvidia.com/mig-2g.20gb": "1"})
    assert is_batch_candidate(both)
    assert (pending_pod(both).resource, pending_pod(both).count) == ("nvidia.com/mig-2g.20gb", 1)


@pytest.mark.parametrize("phase", ["Running", "Succeeded", "Failed", "Unknown"])
def test_only_a_pending_pod_is_a_batch_candidate(phase):
    """A pod that ended before it was bound (activeDeadlineSeconds, a Job's deletion) keeps its
    Unschedulable condition: nothing is planned for it."""
    assert not is_batch_candidate(pod("a", MIG_1G, phase=phase))
    assert is_batch_candidate(pod("a", MIG_1G))


def test_a_pod_being_deleted_is_no_batch_candidate():
    p = pod("a", MIG_1G)
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert not is_batch_candidate(p)


@pytest.mark.parametrize("condition", [
    {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"},  # spec.schedulingGates: not tried yet
    {"type": "PodScheduled", "status": "True", "reason": "Unschedulable"},
    {"type": "PodScheduled", "status": "Unknown", "reason": "Unschedulable"},
    {"type": "DisruptionTarget", "status": "False", "reason": "Unschedulable"},
])
def test_only_the_schedulers_unschedulable_verdict_makes_a_candidate(condition):
    """PodScheduled=False with reason Unschedulable is the scheduler saying no node fits; a gated pod
    (SchedulingGated) was never tried, and other conditions say nothing about placement."""
    p = pod("a", MIG_1G)
    p["status"]["conditions"] = [condition]
    assert not is_batch_candidate(p)
    p["status"]["conditions"] = [condition, {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    assert is_batch_candidate(p)


def test_a_slice_resource_the_agent_never_advertises_is_refused_with_its_name():
    """nvidia.com/gpu-010gb matches the MPS pattern but no device plugin advertises it: the pod is
    told to write nvidia.com/gpu-10gb instead of getting a plan for a resource that never binds."""
    with pytest.raises(DynpartError, match="nvidia.com/gpu-10gb"):
        pending_pod(pod("a", {"nvidia.com/gpu-010gb": "1"}))
    with pytest.raises(DynpartError, match="at least 1"):
        pending_pod(pod("b", {"nvidia.com/gpu-0gb": "1"}))


def test_a_fraction_of_a_slice_is_refused():
    with pytest.raises(DynpartError, match="whole number"):
        pending_pod(pod("a", {"nvidia.com/mig-1g.10gb": "1500m"}))
    assert pending_pod(pod("b", {"nvidia.com/mig-1g.10gb": "2000m"})).count == 2


def test_a_pod_without_cpu_memory_or_priority_asks_for_none():
    """BestEffort pods (no requests) and a cluster without the Priority admission plugin."""
    wants = pending_pod(pod("a", MIG_1G))
    assert (wants.cpu_milli, wants.memory_mib, wants.priority) == (0, 0, 0)


def test_an_ill_typed_node_selector_is_a_problem_of_the_pod():
    with pytest.raises(DynpartError, match="spec.nodeSelector"):
        pending_pod(pod("a", MIG_1G, nodeSelector=["pool=x"]))


# --- what a node's labels and its agent's reports tell -------------------------------------------------


def test_whole_gpu_pods_on_a_mig_node_hold_the_gpus_out_of_mig_mode_even_when_mig_is_pending_or_unsupported():
    """The device plugin serves whole only GPUs out of MIG mode: one whose MIG mode is to be enabled
    at the next reset (on-pending) is still whole now, and one without MIG (unsupported) always is."""
    from tests.controller.test_cluster_view import reported_node

    n1 = reported_node("n1", ["on", "on-pending", "unsupported"])
    whole = [pod(f"w{i}", {"nvidia.com/gpu": "1"}, phase="Running", node="n1", unschedulable=False) for i in range(2)]
    view = build_snapshot([n1], whole, CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
    assert any("GPU(s) 1, 2 serve a pod whole" in m for _, m in view.problems)


def test_a_gpu_whose_mig_mode_goes_off_at_the_next_reset_is_not_carved():
    from tests.controller.test_cluster_view import reported_node

    view = build_snapshot([reported_node("n1", ["on", "off-pending"])], [], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
    assert any("GPU(s) 1 changes only at the next GPU reset" in m for _, m in view.problems)


@pytest.mark.parametrize("product", [None, "NVIDIA-Quantum-1000"])
def test_a_node_whose_model_cannot_be_told_is_left_out_with_every_reason(product):
    """An unreadable capability report and no usable product label: the Event names both, the
    report's problem first (an operator fixes the agent, or the label until it reports)."""
    from dynpart.kube.conventions import STATUS_CAPABILITY

    n1 = node("n1", product=product or "x", annotations={STATUS_CAPABILITY: "not a report"})
    if product is None:
        del n1["metadata"]["labels"]["nvidia.com/gpu.product"]
    view = build_snapshot([n1], [], CAT)
    assert view.snapshot.nodes == []
    messages = [m for _, m in view.problems]
    assert any(m.startswith(f"node n1: annotation {STATUS_CAPABILITY}:") for m in messages)
    assert any("no nvidia.com/gpu.product label" in m for m in messages) if product is None else \
        any("NVIDIA-Quantum-1000" in m for m in messages)


@pytest.mark.parametrize("label", ["off", "MIG", ""])
def test_a_partitioning_label_other_than_mig_or_mps_leaves_the_node_out_and_says_so(label):
    """Also when its agent still reports a mode: that is no switch to a mode dynpart can write."""
    from dynpart.annotations import encode_status
    from dynpart.snapshot import NodeLayout

    n1 = node("n1", mode=label, annotations=encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0"))
    view = build_snapshot([n1, node("n2")], [], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n2"] and view.switching == {}
    assert [m for _, m in view.problems] == [f"node n1: label dynpart.io/gpu-partitioning={label!r}: expected mig or mps"]


def test_the_status_size_limit_counts_the_agents_annotations_only_and_is_inclusive():
    """kubectl's last-applied-configuration and other tools' annotations can be large: only the
    agent's status.dynpart.io/* ones are held to MAX_STATUS_BYTES, which an agent may reach."""
    from dynpart.annotations import encode_status
    from dynpart.kube.conventions import STATUS_PREFIX
    from dynpart.planner.cluster_view import MAX_STATUS_BYTES
    from dynpart.snapshot import NodeLayout

    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0")
    big = node("n1", annotations={**status, "kubectl.kubernetes.io/last-applied-configuration": "x" * 2 * MAX_STATUS_BYTES})
    assert [n.name for n in build_snapshot([big], [], CAT).snapshot.nodes] == ["n1"]
    pad_key = STATUS_PREFIX + "padding"
    used = sum(len(k) + len(v) for k, v in status.items() if k.startswith(STATUS_PREFIX)) + len(pad_key)
    at_limit = node("n1", annotations={**status, pad_key: "x" * (MAX_STATUS_BYTES - used)})
    assert [n.name for n in build_snapshot([at_limit], [], CAT).snapshot.nodes] == ["n1"]
    over = node("n1", annotations={**status, pad_key: "x" * (MAX_STATUS_BYTES - used + 1)})
    view = build_snapshot([over], [], CAT)
    assert view.snapshot.nodes == [] and any(f"more than the {MAX_STATUS_BYTES}" in m for _, m in view.problems)


def _status(*gpus, mode="mig"):
    from dynpart.annotations import encode_status
    from dynpart.snapshot import NodeLayout

    return encode_status(NodeLayout(node="n1", mode=mode, gpus=list(gpus)), "p0")


def test_gpus_the_agent_reports_count_even_beyond_the_gpu_count_label():
    """GFD's MIG strategy single labels a MIG node gpu.count=0: without a capability report the GPUs
    the status names are the node's, and a GPU holding another model's instances (left out) still
    tells that the ones before it exist."""
    from dynpart.snapshot import GpuLayout, MigInstance

    status = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0)]),
                     GpuLayout(index=1, mig=[MigInstance(profile="2g.20gb", start=2)]))
    [seen] = build_snapshot([node("n1", count=0, annotations=status)], [], CAT).snapshot.nodes
    assert [(g.index, [m.profile for m in g.mig]) for g in seen.gpus] == [(0, ["1g.10gb"]), (1, ["2g.20gb"])]
    foreign = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0)]),
                      GpuLayout(index=2, mig=[MigInstance(profile="1g.24gb", start=0)]))
    [seen] = build_snapshot([node("n1", count=0, annotations=foreign)], [], CAT).snapshot.nodes
    assert [g.index for g in seen.gpus] == [0, 1]


def test_cpu_and_memory_free_are_allocatable_less_the_bound_pods_requests():
    n1 = node("n1", count=1, cpu="8", memory="16Gi")
    bound = [pod("a", {"cpu": "1500m", "memory": "3Gi"}, phase="Running", node="n1", unschedulable=False),
             pod("b", {"memory": "512Mi"}, phase="Running", node="n1", unschedulable=False),
             pod("c", {}, phase="Running", node="n1", unschedulable=False)]  # BestEffort
    [seen] = build_snapshot([n1], bound, CAT).snapshot.nodes
    assert (seen.cpu_milli_free, seen.memory_mib_free) == (6500, 16 * 1024 - 3 * 1024 - 512)
    # overcommitted (allocatable shrank under running pods): nothing free, never negative
    [seen] = build_snapshot([node("n1", count=1, cpu="1", memory="1Gi")], bound, CAT).snapshot.nodes
    assert (seen.cpu_milli_free, seen.memory_mib_free) == (0, 0)


def test_a_node_that_has_not_posted_its_allocatable_has_nothing_free():
    n1 = node("n1", count=1)
    del n1["status"]
    [seen] = build_snapshot([n1], [], CAT).snapshot.nodes
    assert (seen.cpu_milli_free, seen.memory_mib_free) == (0, 0)


def test_the_pod_count_left_on_a_node_counts_each_bound_pod_once():
    """allocatable pods (the kubelet's maxPods): a node with room for one more pod takes one."""
    n1 = node("n1", count=1)
    n1["status"]["allocatable"]["pods"] = "2"
    bound = pod("a", {"cpu": "1"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([n1], [bound, pod("wants", MIG_1G)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/wants"]
    n1["status"]["allocatable"]["pods"] = "1"
    view = build_snapshot([n1], [bound, pod("wants", MIG_1G)], CAT)
    assert not view.snapshot.pending and "pods" in view.blocked[0][1]


def test_a_reserved_pod_holds_its_init_containers_peak_not_every_free_slice():
    """Not started yet, it holds no device anyone must guess: as many free slices as its init
    container's peak, while a bound one's init container may keep unnamed devices (all stay)."""
    from dynpart.snapshot import GpuLayout, MigInstance

    status = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=s) for s in range(4)]))
    r = pod("r", MIG_1G, initContainers=[{"name": "warm", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}])
    view = build_snapshot([node("n1", count=1, annotations=status)], [r], CAT, reserved={"ml/r": "n1"})
    assert sum(m.used for m in view.snapshot.nodes[0].gpus[0].mig) == 2
    bound = {**r, "spec": {**r["spec"], "nodeName": "n1"}, "status": {"phase": "Running"}}
    view = build_snapshot([node("n1", count=1, annotations=status)], [bound], CAT)
    assert sum(m.used for m in view.snapshot.nodes[0].gpus[0].mig) == 4


def test_a_node_with_an_unreadable_allocatable_is_left_out_but_its_acknowledgement_still_counts():
    """The controller reads acknowledgements from `acks` for every labelled node, planned or not."""
    n1 = node("n1", count=1, cpu="lots", annotations=_status())
    view = build_snapshot([n1], [], CAT)
    assert view.snapshot.nodes == [] and view.acks == {"n1": "p0"}
    assert any(m.startswith("node n1: allocatable:") and "'lots'" in m for _, m in view.problems)


def test_a_slice_resource_allocatable_lacks_is_for_the_plan_to_make_not_a_shortage():
    """Before its first plan a MIG node's allocatable lists nvidia.com/mig-1g.10gb: 0 (or not at all):
    the planner carves the slice; only resources beside CPU, memory and GPU slices are checked as
    the scheduler's NodeResourcesFit would (here ephemeral storage)."""
    n1, n2 = node("n1", count=1), node("n2", count=1)
    n1["status"]["allocatable"].update({"nvidia.com/mig-1g.10gb": "0", "ephemeral-storage": "10Gi"})
    n2["status"]["allocatable"].update({"ephemeral-storage": "1Gi"})
    wants = pod("wants", {**MIG_1G, "ephemeral-storage": "2Gi"})
    view = build_snapshot([n1, n2], [wants], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/wants"] and not view.blocked
    assert view.hosts["ml/wants"] == {"n1"}  # (n2, short of ephemeral storage, could not take it)
    from dynpart.planner.core import plan

    assert [p.node for p in plan(view.snapshot, view.catalog).placements] == ["n1"]


def test_a_blocked_pods_reason_names_only_what_blocks_it():
    n1 = labelled(node("n1", count=1))
    n1["status"]["allocatable"]["ephemeral-storage"] = "1Gi"
    short = pod("short", {**MIG_1G, "ephemeral-storage": "2Gi"})
    [(_, why)] = build_snapshot([n1], [short], CAT).blocked
    assert "lack ephemeral-storage" in why and "anti-affinity" not in why
    [(_, why)] = build_snapshot([n1], [replica("old", bound="n1"), replica("new")], CAT).blocked
    assert "anti-affinity" in why and "lack" not in why


def test_a_node_whose_slices_are_all_in_use_is_not_short_of_them():
    """Its allocatable lists the one 1g.10gb a bound pod uses: the planner carves another for the
    pending pod; allocatable's count of a slice resource is no limit on what a plan makes."""
    from dynpart.planner.core import plan
    from dynpart.snapshot import GpuLayout, MigInstance

    n1 = node("n1", count=1, annotations=_status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0, used=True)])))
    n1["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "1"
    bound = pod("b", MIG_1G, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([n1], [bound, pod("wants", MIG_1G)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/wants"] and not view.blocked
    assert [p.node for p in plan(view.snapshot, view.catalog).placements] == ["n1"]


def test_a_zero_request_of_another_resource_asks_for_nothing():
    """ephemeral-storage: 0 fits a node that does not list it, even where another node does."""
    n1, n2 = labelled(node("n1", count=1)), labelled(node("n2", count=1))
    n2["status"]["allocatable"]["ephemeral-storage"] = "10Gi"
    wants = pod("wants", {**MIG_1G, "ephemeral-storage": "0"}, nodeSelector={"kubernetes.io/hostname": "n1"})
    view = build_snapshot([n1, n2], [wants], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/wants"] and not view.blocked


def _foreign_node(**annotations):
    from dynpart.snapshot import GpuLayout, MigInstance

    # a 1g.24gb instance (RTX PRO 6000) on GPU 1 of an H100 node: another catalog's agent made it
    status = _status(GpuLayout(index=0), GpuLayout(index=1, mig=[MigInstance(profile="1g.24gb", start=0)]))
    return node("n1", count=2, annotations={**status, **annotations})


def test_gpus_holding_instances_the_model_lacks_are_left_out_with_why_the_model_may_differ():
    from dynpart.kube.conventions import STATUS_CAPABILITY
    from tests.controller.test_cluster_view import reported_node

    def why(n):
        view = build_snapshot([n], [], CAT)
        assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
        [message] = [m for _, m in view.problems if "cannot read (1g.24gb" in m]
        return message

    assert "its agent has not reported what its GPUs can do" in why(_foreign_node())
    assert "capability report cannot be read here" in why(_foreign_node(**{STATUS_CAPABILITY: "from a newer agent"}))
    readable = reported_node("n1", ["on", "on"]).get("metadata")["annotations"][STATUS_CAPABILITY]
    assert "profiles this planner's catalog leaves out" in why(_foreign_node(**{STATUS_CAPABILITY: readable}))


def test_free_slices_beyond_allocatable_are_taken_only_as_many_as_are_missing():
    """The device plugin withdrew unhealthy devices: allocatable counts fewer than the agent reports.
    Which ones is unknown, so free ones count as used, never more than are missing; a used slice
    is already out of reach, and an MPS node's slices are held to it too."""
    from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice

    def seen(layout, alloc, mode="mig"):
        n1 = node("n1", mode=mode, count=1, annotations=_status(layout, mode=mode))
        n1["status"]["allocatable"].update(alloc)
        view = build_snapshot([n1], [], CAT)
        gpu = view.snapshot.nodes[0].gpus[0]
        used = [it.used for it in gpu.mig] or sorted((it.size, it.used) for it in gpu.mps)
        assert not [m for _, m in view.problems if "allocatable" in m]  # the caller decides when it is one
        return used, [m for n, _, m in view.unallocatable if n is n1]

    mig = GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0),
                                  MigInstance(profile="1g.10gb", start=1, used=True)])
    assert seen(mig, {"nvidia.com/mig-1g.10gb": "2"}) == ([False, True], [])
    used, problems = seen(mig, {"nvidia.com/mig-1g.10gb": "1"})
    assert used == [True, True] and problems == ["node n1: 2 nvidia.com/mig-1g.10gb slice(s) reported, 1 allocatable: "
                                                 "1 free one(s) not planned for pods"]
    all_used = GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=s, used=True) for s in range(2)])
    assert seen(all_used, {"nvidia.com/mig-1g.10gb": "1"}) == ([True, True], [])  # nothing free to take
    mps = GpuLayout(index=0, mps=[MpsSlice(size=10), MpsSlice(size=10), MpsSlice(size=20)])
    used, problems = seen(mps, {"nvidia.com/gpu-10gb": "1"}, mode="mps")
    assert used == [(10, False), (10, True), (20, False)] and len(problems) == 1


@pytest.mark.parametrize(("label", "gpus"), [(None, 0), ("0", 0), ("1", 1), ("64", 64)])
def test_the_gpu_count_label_counts_from_zero_to_the_most_a_node_has(label, gpus):
    """No label (GFD not run yet): no GPU until the agent reports; 0 (MIG strategy single) is a
    count, not a problem."""
    n1 = node("n1", count=0, annotations=_status())
    if label is None:
        del n1["metadata"]["labels"]["nvidia.com/gpu.count"]
    else:
        n1["metadata"]["labels"]["nvidia.com/gpu.count"] = label
    view = build_snapshot([n1], [], CAT)
    assert len(view.snapshot.nodes[0].gpus) == gpus
    assert not any("not a GPU count" in m for _, m in view.problems)


def test_without_a_capability_report_a_mig_node_with_mps_pods_bound_plans_only_its_carved_gpus():
    """Switched from MPS while its pods run, before its agent reports: the GPUs without instances
    may be the ones the MPS pods run on, the ones with instances are in MIG mode."""
    from dynpart.snapshot import GpuLayout, MigInstance

    n1 = node("n1", count=2, annotations=_status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0)])))
    mps_pod = pod("old", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([n1], [mps_pod], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
    assert any("GPU(s) 1 are out of MIG mode while pods using MPS slices" in m for _, m in view.problems)


# --- the slices and GPUs bound pods hold ---------------------------------------------------------------


def test_a_whole_gpu_pod_on_an_mps_node_holds_a_gpu_out_of_mig_mode():
    """Relabelled from mig to mps, GPU 0 is still in MIG mode: the agent serves nvidia.com/gpu only
    for GPUs out of it, so the bound whole-GPU pod runs on GPU 1, which no plan may slice. Taking
    GPU 0 as its (left out anyway) once planned MPS slices onto the GPU the pod was using."""
    from dynpart.planner.core import plan
    from tests.controller.test_cluster_view import reported_node

    n1 = reported_node("n1", ["on", "off"], mode="mps")
    whole = pod("w", {"nvidia.com/gpu": "1"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([n1], [whole, pod("m", {"nvidia.com/gpu-40gb": "1"})], CAT)
    assert [(g.index, g.whole_pod) for g in view.snapshot.nodes[0].gpus] == [(1, "(bound)")]
    assert not plan(view.snapshot, view.catalog).placements


def test_a_whole_gpu_pod_holds_an_empty_gpu_not_one_with_slices_or_instances():
    """Without a capability report: the device plugin serves whole only a GPU without slices (MPS)
    or instances (MIG)."""
    from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice

    whole = pod("w", {"nvidia.com/gpu": "1"}, phase="Running", node="n1", unschedulable=False)
    mps = _status(GpuLayout(index=0, mps=[MpsSlice(size=10)]), GpuLayout(index=1), mode="mps")
    [seen] = build_snapshot([node("n1", mode="mps", count=2, annotations=mps)], [whole], CAT).snapshot.nodes
    assert [(g.index, g.whole_pod, len(g.mps)) for g in seen.gpus] == [(0, None, 1), (1, "(bound)", 0)]
    mig = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0)]), GpuLayout(index=1))
    view = build_snapshot([node("n1", count=2, annotations=mig)], [whole], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]


def test_mps_slices_of_pods_bound_before_the_status_shows_them_all_count_as_taken():
    from dynpart.snapshot import GpuLayout, MpsSlice

    status = _status(GpuLayout(index=0, mps=[MpsSlice(size=10), MpsSlice(size=10), MpsSlice(size=20)]), mode="mps")
    bound = pod("b", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="n1", unschedulable=False)
    [seen] = build_snapshot([node("n1", mode="mps", count=1, annotations=status)], [bound], CAT).snapshot.nodes
    assert sorted((s.size, s.used) for s in seen.gpus[0].mps) == [(10, True), (10, True), (20, False)]


def test_slices_a_bound_pods_init_container_may_hold_all_stay_and_sidecars_count_as_listed():
    """The init container asked for 2 and the app container for 1: the kubelet keeps the second
    device, unlisted, and which it is no one can tell, so every free one stays. A sidecar (an init
    container with restartPolicy Always) runs beside the app: its slices are listed, none kept."""
    from dynpart.snapshot import GpuLayout, MigInstance

    status = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=s, used=s < 2) for s in range(4)]))
    init = {"name": "warm", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}
    bound = pod("b", MIG_1G, phase="Running", node="n1", unschedulable=False, initContainers=[init])
    [seen] = build_snapshot([node("n1", count=1, annotations=status)], [bound], CAT).snapshot.nodes
    assert [m.used for m in seen.gpus[0].mig] == [True] * 4
    sidecar = {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}
    plain = {"name": "setup", "resources": {"limits": {"cpu": "1"}}}
    bound = pod("b", MIG_1G, phase="Running", node="n1", unschedulable=False, initContainers=[sidecar, plain])
    [seen] = build_snapshot([node("n1", count=1, annotations=status)], [bound], CAT).snapshot.nodes
    assert [m.used for m in seen.gpus[0].mig] == [True, True, False, False]


def test_a_bound_pod_asking_for_a_resource_dynpart_never_advertises_holds_nothing_of_its_node():
    from dynpart.snapshot import GpuLayout, MpsSlice

    status = _status(GpuLayout(index=0, mps=[MpsSlice(size=10)]), mode="mps")
    odd = pod("odd", {"nvidia.com/gpu-010gb": "1"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([node("n1", mode="mps", count=1, annotations=status)], [odd], CAT)
    assert [s.used for s in view.snapshot.nodes[0].gpus[0].mps] == [False]


def test_a_node_relabelled_mps_to_mig_is_left_out_until_its_agent_reports_mig():
    from tests.controller.test_cluster_view import reported_node

    spec = {"dynpart.io/spec-plan": "p0", "dynpart.io/spec-mode": "mps"}
    view = build_snapshot([reported_node("n1", ["off"], mode="mig", status_mode="mps", **spec)], [], CAT)
    assert view.snapshot.nodes == [] and view.switching == {"n1": "mig"}


def test_reported_slices_count_what_the_agent_reported_or_none_without_a_status():
    from collections import Counter

    from dynpart.planner.cluster_view import reported_slices
    from dynpart.snapshot import GpuLayout, MigInstance, MpsSlice

    mig = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=0, used=True),
                                          MigInstance(profile="1g.10gb", start=1)]))
    assert reported_slices(node("n1", annotations=mig), CAT) == Counter({"nvidia.com/mig-1g.10gb": 2})
    mps = _status(GpuLayout(index=0, mps=[MpsSlice(size=10), MpsSlice(size=20, used=True)]), mode="mps")
    assert reported_slices(node("n1", mode="mps", annotations=mps), CAT) == Counter(
        {"nvidia.com/gpu-10gb": 1, "nvidia.com/gpu-20gb": 1})
    assert reported_slices(node("n1"), CAT) is None  # its agent never reported
    unknown = node("n1", product="NVIDIA-Quantum-1000", annotations=mig)
    assert reported_slices(unknown, CAT) is None


# --- the round -----------------------------------------------------------------------------------------


def test_the_snapshot_lists_nodes_by_name_whatever_order_the_cache_gives():
    """Rounds over the same cluster plan the same way (the watch cache's order is arbitrary)."""
    names = ["n3", "n1", "n2"]
    view = build_snapshot([node(n, count=1) for n in names], [], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n1", "n2", "n3"]


def test_a_node_without_the_partitioning_label_is_none_of_dynparts_business():
    plain = node("plain", count=1)
    del plain["metadata"]["labels"]["dynpart.io/gpu-partitioning"]
    view = build_snapshot([plain, node("n1", count=1)], [], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n1"] and list(view.acks) == ["n1"] and not view.problems


def test_an_ill_typed_node_is_left_out_alone_with_its_problem():
    bad, good = node("n1", count=1), node("n2", count=1)
    bad["metadata"]["annotations"] = ["not", "a", "mapping"]
    view = build_snapshot([bad, good], [], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n2"] and list(view.acks) == ["n2"]
    [(obj, message)] = view.problems
    assert obj is bad and message.startswith("node n1 left out of planning: cannot read it (AttributeError")


def test_a_node_being_switched_can_still_be_revoked():
    """An unacknowledged plan on a node whose label changed meanwhile is replaced all the same."""
    from dynpart.planner.cluster_view import can_revoke, revoking_patch
    from tests.controller.test_cluster_view import reported_node

    n1 = reported_node("n1", ["on"], mode="mps", status_mode="mig", **{"dynpart.io/spec-plan": "p1"})
    assert can_revoke(n1, CAT)
    patch = revoking_patch(n1, CAT, "r1")
    assert patch is not None and patch["dynpart.io/spec-revokes"] == "p1"


def test_of_two_pending_pods_that_exclude_each_other_the_older_is_planned_whatever_their_names():
    n1 = labelled(node("n1", count=1))
    older, younger = replica("z-old"), replica("a-new")
    older["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    younger["metadata"]["creationTimestamp"] = "2026-01-01T00:05:00Z"
    view = build_snapshot([n1], [younger, older], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/z-old"] and view.deferred == {"ml/a-new": "ml/z-old"}


def test_a_pod_meant_for_other_nodes_is_only_reported_elsewhere():
    wants = pod("wants", MIG_1G, nodeSelector={"pool": "static-mig"})
    view = build_snapshot([node("n1", count=1)], [wants], CAT)
    assert [p["metadata"]["name"] for p, _ in view.elsewhere] == ["wants"] and not view.blocked
    assert not view.snapshot.pending


def test_a_pod_is_blocked_when_every_node_it_may_use_lacks_room_whatever_the_others_lack():
    n1, n2 = labelled(node("n1", count=1)), labelled(node("n2", count=1))
    for n in (n1, n2):
        n["status"]["allocatable"]["ephemeral-storage"] = "1Gi"
    wants = pod("wants", {**MIG_1G, "ephemeral-storage": "2Gi"}, nodeSelector={"kubernetes.io/hostname": "n1"})
    view = build_snapshot([n1, n2], [wants], CAT)
    assert not view.snapshot.pending and [p["metadata"]["name"] for p, _ in view.blocked] == ["wants"]
    assert "node(s) n1 lack" in view.blocked[0][1]


def test_an_ill_typed_pod_is_left_out_alone_with_its_problem():
    bad = pod("bad", MIG_1G, tolerations="NoSchedule")
    view = build_snapshot([node("n1", count=1)], [bad, pod("ok", MIG_1G)], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/ok"]
    [(obj, message)] = view.problems
    assert obj is bad and message.startswith("pod ml/bad left out of planning: cannot read it (")



def test_why_a_pod_is_meant_for_other_nodes_names_the_missing_mode():
    view = build_snapshot([node("n1", mode="mps", count=1)], [pod("wants", MIG_1G)], CAT)
    [(_, why)] = view.elsewhere
    assert "no node is labelled dynpart.io/gpu-partitioning=mig, the mode that serves nvidia.com/mig-1g.10gb" in why
    [(_, why)] = build_snapshot([], [pod("wants", MIG_1G)], CAT).elsewhere
    assert why.endswith("no node is labelled dynpart.io/gpu-partitioning")


def test_a_nominated_pod_holds_a_slice_on_its_node_until_it_is_deleted():
    """The scheduler preempted pods on n1 for it: the slice their end frees is its, unless it is
    being deleted itself."""
    from dynpart.snapshot import GpuLayout, MigInstance

    status = _status(GpuLayout(index=0, mig=[MigInstance(profile="1g.10gb", start=s) for s in range(2)]))
    nominated = pod("nom", MIG_1G)
    nominated["status"]["nominatedNodeName"] = "n1"
    [seen] = build_snapshot([node("n1", count=1, annotations=status)], [nominated], CAT).snapshot.nodes
    assert [m.used for m in seen.gpus[0].mig] == [True, False]
    nominated["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    [seen] = build_snapshot([node("n1", count=1, annotations=status)], [nominated], CAT).snapshot.nodes
    assert [m.used for m in seen.gpus[0].mig] == [False, False]


@pytest.mark.parametrize(("spec", "target"), [
    ({"dynpart.io/spec-plan": "p0", "dynpart.io/spec-mode": "mig"}, {"n1": "mps"}),  # acknowledged, old mode
    ({"dynpart.io/spec-plan": "p1", "dynpart.io/spec-mode": "mig"}, {}),  # not acknowledged yet
    ({"dynpart.io/spec-plan": "", "dynpart.io/spec-mode": "mig"}, {}),
    ({"dynpart.io/spec-plan": "p0", "dynpart.io/spec-mode": "mps"}, {}),  # already the labelled mode
])
def test_a_switching_spec_is_written_only_where_an_acknowledged_spec_keeps_the_agent_in_the_old_mode(spec, target):
    from tests.controller.test_cluster_view import reported_node

    relabelled = reported_node("n1", ["on"], mode="mps", status_mode="mig", **spec)  # status plan p0
    assert build_snapshot([relabelled], [], CAT).switching == target


def test_a_switching_spec_needs_a_plan_id_the_agent_acknowledged():
    """An agent that has not acknowledged any plan yet (no plan id on either side) switches by
    itself when its label changes: no spec keeps it."""
    from tests.controller.test_cluster_view import reported_node

    relabelled = reported_node("n1", ["on"], mode="mps", status_mode="mig", **{"dynpart.io/spec-mode": "mig"})
    del relabelled["metadata"]["annotations"]["dynpart.io/status-plan"]
    assert build_snapshot([relabelled], [], CAT).switching == {}


def test_a_blocked_pods_reason_names_three_nodes_and_counts_the_rest():
    def why(count):
        nodes = [labelled(node(f"n{i}", count=1)) for i in range(1, count + 1)]
        for n in nodes:
            n["status"]["allocatable"]["ephemeral-storage"] = "1Gi"
        [(_, message)] = build_snapshot(nodes, [pod("w", {**MIG_1G, "ephemeral-storage": "2Gi"})], CAT).blocked
        return message

    assert "node(s) n1, n2, n3 lack ephemeral-storage" in why(3)
    assert "node(s) n1, n2, n3 and 2 more lack ephemeral-storage" in why(5)


def test_the_user_id_of_a_pods_containers_is_known_only_when_they_share_one():
    from dynpart.planner.cluster_view import run_as_user

    def uid(pod_uid, *container_uids):
        spec = {"securityContext": {"runAsUser": pod_uid}} if pod_uid is not None else {}
        spec["containers"] = [{"name": f"c{i}", **({"securityContext": {"runAsUser": u}} if u is not None else {})}
                              for i, u in enumerate(container_uids)]
        return run_as_user({"spec": spec})

    assert uid(1000, None, None) == 1000 and uid(None, 0, 0) == 0 and uid(1000, 2000, 2000) == 2000
    assert uid(1000, None, 2000) is None and uid(None, 1000, None) is None and uid(None, None) is None


def test_mps_user_clashes_count_only_mps_pods_and_name_the_ids_on_the_node():
    """One MPS server per user id at a time: a MIG pod's user id is no MPS client's; a placement of
    a pod the cache no longer has is skipped."""
    from dynpart.planner.cluster_view import mps_user_clashes

    def as_user(p, uid):
        p["spec"]["securityContext"] = {"runAsUser": uid}
        return p

    mig_pod = as_user(pod("mig", MIG_1G, phase="Running", node="n1", unschedulable=False), 1000)
    mps_pod = as_user(pod("mps", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="n2", unschedulable=False), 1000)
    new = as_user(pod("new", {"nvidia.com/gpu-10gb": "1"}), 2000)
    pods = {"ml/mig": mig_pod, "ml/mps": mps_pod, "ml/new": new}
    assert mps_user_clashes([("ml/new", "n1"), ("ml/gone", "n1")], pods) == []
    [(obj, why)] = mps_user_clashes([("ml/new", "n2")], pods)
    assert obj is new and "MPS pods on node n2 run as user(s) 1000" in why and "this plan puts" not in why


def test_the_cached_part_of_a_pod_keeps_what_planning_and_its_events_read():
    """An Event's involvedObject needs kind, name, namespace, uid (and resourceVersion); planning
    reads the requests of every container, the sidecars' restartPolicy, scheduling fields and
    the PodScheduled condition. The rest (managed fields, env, images) is dropped."""
    from dynpart.planner.cluster_view import pod_for_planning

    md = {"name": "a", "namespace": "ml", "uid": "u-1", "resourceVersion": "42", "generation": 3,
          "creationTimestamp": "2026-01-01T00:00:00Z", "deletionTimestamp": "2026-01-01T00:10:00Z",
          "labels": {"app": "web"}, "managedFields": [{"manager": "kubectl"}], "annotations": {"big": "x" * 100}}
    container = {"name": "c", "image": "cuda:12", "env": [{"name": "A", "value": "1"}],
                 "resources": {"limits": MIG_1G}, "securityContext": {"runAsUser": 1000},
                 "ports": [{"containerPort": 80}, {"containerPort": 81, "hostPort": 8081}]}
    sidecar = {"name": "s", "image": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}}
    spec = {"containers": [container], "initContainers": [sidecar], "nodeName": "n1", "nodeSelector": {"pool": "x"},
            "priority": 7, "tolerations": [{"operator": "Exists"}], "overhead": {"cpu": "100m"}, "hostIPC": True,
            "resources": {"requests": {"cpu": "2"}}, "schedulerName": "s2", "topologySpreadConstraints": [],
            "serviceAccountName": "default"}
    status = {"phase": "Pending", "nominatedNodeName": "n2", "podIP": "10.0.0.1",
              "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
                             {"type": "Ready", "status": "False"}]}
    kept = pod_for_planning({"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": spec, "status": status})
    assert kept == {
        "kind": "Pod",
        "metadata": {k: md[k] for k in ("name", "namespace", "uid", "resourceVersion", "generation",
                                        "creationTimestamp", "deletionTimestamp", "labels")},
        "spec": {**{k: v for k, v in spec.items() if k not in ("containers", "initContainers", "serviceAccountName")},
                 "containers": [{"name": "c", "resources": {"limits": MIG_1G}, "securityContext": {"runAsUser": 1000},
                                 "ports": [{"containerPort": 81, "hostPort": 8081}]}],
                 "initContainers": [{k: sidecar[k] for k in ("name", "resources", "restartPolicy")}]},
        "status": {"phase": "Pending", "nominatedNodeName": "n2", "conditions": status["conditions"][:1]},
    }
