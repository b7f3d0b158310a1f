"""The controller's pure parts: which pods join a batch, how pods and nodes become a snapshot."""

import pytest

from dynpart.annotations import encode_status
from dynpart.catalog import default_catalog
from dynpart.errors import DynpartError
from dynpart.planner.batching import BatchWindow
from dynpart.planner.cluster_view import build_snapshot, is_batch_candidate, parse_quantity, pending_pod
from dynpart.snapshot import GpuLayout, MigInstance, NodeLayout

CAT = default_catalog()


def pod(name, resources, phase="Pending", node=None, unschedulable=True, **spec):
    p = {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": f"2026-01-01T00:00:{len(name):02d}Z"},
         "spec": {"containers": [{"name": "c", "resources": {"limits": resources, "requests": {
             k: v for k, v in resources.items() if not k.startswith("nvidia.com")}}}], **spec},
         "status": {"phase": phase}}
    if node:
        p["spec"]["nodeName"] = node
    if unschedulable:
        p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    return p


def node(name, mode="mig", product="NVIDIA-H100-80GB-HBM3", count=2, annotations=None, cpu="16", memory="64Gi"):
    return {"metadata": {"name": name, "labels": {"dynpart.io/gpu-partitioning": mode, "nvidia.com/gpu.product": product,
                                                  "nvidia.com/gpu.count": str(count)},
                         "annotations": annotations or {}, "resourceVersion": "7"},
            "status": {"allocatable": {"cpu": cpu, "memory": memory}}}


def test_quantities():
    assert parse_quantity("500m") == 0.5
    assert parse_quantity("1Gi") == 2**30
    assert parse_quantity("2") == 2
    with pytest.raises(DynpartError, match="'lots'"):
        parse_quantity("lots")
    # no finite number: refused as a quantity, not left to fail a round's arithmetic (OverflowError
    # on "inf", a ValueError for a number that does not parse before its suffix)
    for bad in ("inf", "-inf", "nan", "1e400", "1.2.3Gi", "infGi", "nanm"):
        with pytest.raises(DynpartError, match="is not a Kubernetes quantity"):
            parse_quantity(bad)


def test_a_node_or_pod_with_an_infinite_quantity_is_left_out_and_the_round_goes_on():
    bad_node = node("n1")
    bad_node["status"]["allocatable"]["cpu"] = "inf"
    greedy = pod("greedy", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1e400"})
    view = build_snapshot([bad_node, node("n2")], [greedy, pod("ok", {"nvidia.com/mig-1g.10gb": "1"})],
                          default_catalog())
    assert [n.name for n in view.snapshot.nodes] == ["n2"] and [p.name for p in view.snapshot.pending] == ["ml/ok"]
    said = " ".join(m for _, m in view.problems)
    assert "node n1: allocatable: quantity 'inf' is not a Kubernetes quantity" in said
    assert "quantity '1e400' is not a Kubernetes quantity" in said



def test_a_quantity_the_api_server_admits_but_no_number_holds_leaves_its_object_out_and_the_round_goes_on():
    """The API server admits any decimal exponent ("1e306", "10e399"; Kubernetes counts at most
    2^63-1 of a resource, its Value() saturates there): one such request must not overflow a
    round's arithmetic (a pending pod's CPU in millicores, a bound pod's sum on its node, two
    containers' slices) and fail it for every node and pod, nor the pod watch's callback."""
    assert parse_quantity(str(2**63 - 1)) == 2**63
    for bad in ("1e306", "100e306", "1e19", "-1e306"):
        with pytest.raises(DynpartError, match="is not a Kubernetes quantity"):
            parse_quantity(bad)
    greedy = pod("greedy", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1e306"})
    twice = pod("twice", {"nvidia.com/mig-1g.10gb": "1"})
    twice["spec"]["containers"] = [{"name": n, "resources": {"limits": {"nvidia.com/mig-1g.10gb": "100e306"}}}
                                   for n in ("a", "b")]
    with pytest.raises(DynpartError):  # (the controller's pod callback catches DynpartError)
        is_batch_candidate(twice)
    squatter = pod("squatter", {"cpu": "1e306"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([node("n1"), node("n2")], [greedy, twice, squatter, pod("ok", {"nvidia.com/mig-1g.10gb": "1"})],
                          default_catalog())
    assert [n.name for n in view.snapshot.nodes] == ["n2"] and [p.name for p in view.snapshot.pending] == ["ml/ok"]
    said = " ".join(m for _, m in view.problems)
    assert "'1e306' is not a Kubernetes quantity" in said and "'100e306' is not a Kubernetes quantity" in said

def test_batch_candidates():
    assert is_batch_candidate(pod("a", {"nvidia.com/mig-1g.10gb": "1"}))
    assert not is_batch_candidate(pod("a", {"nvidia.com/mig-1g.10gb": "1"}, unschedulable=False))
    assert not is_batch_candidate(pod("a", {"cpu": "1"}))
    assert not is_batch_candidate(pod("a", {"nvidia.com/mig-1g.10gb": "1"}, node="n1"))
    nominated = pod("a", {"nvidia.com/gpu-10gb": "1"})
    nominated["status"]["nominatedNodeName"] = "n1"
    assert not is_batch_candidate(nominated)


def test_pending_pod_fields():
    p = pending_pod(pod("a", {"nvidia.com/mig-2g.20gb": "2", "cpu": "1500m", "memory": "2Gi"},
                        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pool": "x"}, priority=5))
    assert (p.name, p.resource, p.count, p.cpu_milli, p.memory_mib, p.priority) == ("ml/a", "nvidia.com/mig-2g.20gb", 2, 1500, 2048, 5)
    assert p.node_selector == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pool": "x"}
    assert p.gpu_models == ["NVIDIA-A100-SXM4-80GB"]
    with pytest.raises(DynpartError, match="asks for 2 GPU slice resources"):
        pending_pod(pod("b", {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpu-10gb": "1"}))


def test_snapshot_from_objects_marks_slices_of_bound_pods_used():
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0, used=True), MigInstance(profile="1g.10gb", start=1),
        MigInstance(profile="2g.20gb", start=2)])]), "p1")
    nodes = [node("n1", annotations=status), node("n2", product="NVIDIA-Quantum"), node("n3", mode="mps", product="NVIDIA-A100-SXM4-80GB")]
    pods = [pod("running", {"nvidia.com/mig-1g.10gb": "1", "cpu": "2"}, phase="Running", node="n1", unschedulable=False),
            pod("just-bound", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, node="n1", unschedulable=False),
            pod("wants", {"nvidia.com/mig-3g.40gb": "1"}),
            pod("two-kinds", {"nvidia.com/mig-3g.40gb": "1", "nvidia.com/gpu-10gb": "1"})]
    view = build_snapshot(nodes, pods, CAT)
    snap, acks, problems = view.snapshot, view.acks, view.problems
    assert [n.name for n in snap.nodes] == ["n1", "n3"]
    n1 = snap.nodes[0]
    assert len(n1.gpus) == 2 and n1.cpu_milli_free == 13000
    # the agent reported one 1g used; a second pod is bound and will take the other one
    assert [m.used for m in n1.gpus[0].mig] == [True, True, False]
    assert acks["n1"] == "p1"
    assert [p.name for p in snap.pending] == ["ml/wants"]
    messages = [m for _, m in problems]
    assert any("NVIDIA-Quantum" in m for m in messages) and any("two-kinds" in m for m in messages)


def test_pods_bound_before_the_status_shows_them_make_every_free_slice_of_their_kind_count_as_taken():
    """Two pods bound to n1 run on 1g.10gb instances the agent has not reported used yet (its next
    pass is seconds away): the kubelet chose which, and the planner cannot know. Taking the first
    free ones as theirs once let a plan carve away the slot a pod had started on (the agent then
    kept it, and the plan waited out its time-out): every free 1g.10gb there counts as taken until
    the status catches up. A reserved pod (not bound: no device chosen) still takes one, any."""
    from dynpart.planner.core import plan

    free7 = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=s) for s in range(7)])]), "p0")
    n1 = node("n1", count=1, annotations={**free7, "dynpart.io/spec-plan": "p0"})
    bound = [pod(f"k{i}", {"nvidia.com/mig-1g.10gb": "1"}, phase="Running", node="n1", unschedulable=False)
             for i in range(2)]
    wants = pod("wants", {"nvidia.com/mig-3g.40gb": "1"})
    view = build_snapshot([n1], [*bound, wants], CAT)
    assert all(m.used for m in view.snapshot.nodes[0].gpus[0].mig)
    assert not plan(view.snapshot, view.catalog).changed_nodes()  # no carving around a guess
    # the status caught up (the pods are on 1g@4 and 1g@5): planned around them
    seen = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=s, used=s in (4, 5)) for s in range(7)])]), "p0")
    n1 = node("n1", count=1, annotations={**seen, "dynpart.io/spec-plan": "p0"})
    view = build_snapshot([n1], [*bound, wants], CAT)
    assert [m.start for m in view.snapshot.nodes[0].gpus[0].mig if m.used] == [4, 5]
    # a reservation (the pod not bound yet) holds one free slice, whichever
    reserved = pod("r", {"nvidia.com/mig-1g.10gb": "1"})
    view = build_snapshot([node("n1", count=1, annotations={**free7, "dynpart.io/spec-plan": "p0"})], [reserved],
                          CAT, reserved={"ml/r": "n1"})
    assert sum(m.used for m in view.snapshot.nodes[0].gpus[0].mig) == 1


def test_excluded_nodes_and_pods():
    snap = build_snapshot([node("n1"), node("n2")], [pod("a", {"nvidia.com/mig-1g.10gb": "1"})], CAT,
                          exclude_nodes={"n1"}, exclude_pods={"ml/a"}).snapshot
    assert [n.name for n in snap.nodes] == ["n2"] and snap.pending == []


def test_batch_window_closes_on_idle_or_timeout():
    w = BatchWindow(idle_s=1, timeout_s=3)
    assert not w.ready(0) and w.wait_s(0) is None
    w.add("a", 0.0)
    assert not w.ready(0.5) and w.ready(1.0)
    w.add("b", 0.9)
    w.add("c", 1.8)
    w.add("d", 2.7)
    assert not w.ready(2.9) and w.ready(3.0)
    assert w.close() == {"a", "b", "c", "d"} and not w.ready(10)


def test_a_pod_left_to_the_next_round_closes_the_batch_at_once():
    """A pod a round left to the next (a conflict with an older pod it planned) waited in a batch
    already: the batch it joins closes at once, new pods joining with it or not; once closed, the
    next batch waits again."""
    w = BatchWindow(idle_s=1, timeout_s=3)
    w.add("new", 0.0)
    w.add("left", 0.2, at_once=True)
    assert w.ready(0.2) and w.wait_s(0.2) == 0.0
    w.add("newer", 0.3)
    assert w.ready(0.3)
    assert w.close() == {"new", "left", "newer"}
    w.add("next", 5.0)
    assert not w.ready(5.5) and w.ready(6.0)
    w.add("left", 7.0, at_once=True)
    w.discard("next")
    w.discard("left")
    w.add("later", 8.0)
    assert not w.ready(8.5), "an emptied batch forgets it was due"


def test_a_whole_gpu_pod_holds_the_gpu_its_agent_reports_out_of_mig_mode():
    """The device plugin serves a GPU whole only out of MIG mode: the capability report says which."""
    from dynpart.annotations import STATUS_CAPABILITY
    from dynpart.capability import GpuReport, encode_capability
    from tests.test_capability import kind_of, node_of

    h100 = CAT.resolve("H100-80GB")
    cap = node_of(kind_of(h100, "NVIDIA H100 80GB HBM3"), gpus=2)
    cap = cap.model_copy(update={"gpus": (GpuReport(kind=0, mig="on"), GpuReport(kind=0, mig="off"))})
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0")
    n1 = node("n1", annotations={**status, STATUS_CAPABILITY: encode_capability(cap)})
    whole = pod("w", {"nvidia.com/gpu": "1"}, phase="Running", node="n1", unschedulable=False)
    view = build_snapshot([n1], [whole], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
    assert any("GPU(s) 1 serve a pod whole" in m for _, m in view.problems)


def test_whole_gpus_an_init_container_may_still_hold_are_not_planned():
    """A running pod whose init container asked for 2 whole GPUs and its app container for 1:
    the kubelet keeps the second for the pod, unlisted, until it ends, and which GPU that is no
    one can tell (the agent keeps them all: agent/nodepods.py), so no free GPU of the node is
    planned; with no init container asking for more, the GPUs beyond its count are."""
    status = encode_status(NodeLayout(node="n1", mode="mps", gpus=[GpuLayout(index=i) for i in range(3)]), "p0")
    n1 = node("n1", mode="mps", count=3, annotations=status)
    running = pod("r", {"nvidia.com/gpu": "1"}, phase="Running", node="n1", unschedulable=False,
                  initContainers=[{"name": "fetch", "resources": {"limits": {"nvidia.com/gpu": "2"}}}])
    waiting = pod("m", {"nvidia.com/gpu-10gb": "1"})
    view = build_snapshot([n1], [running, waiting], CAT)
    assert [g.whole_pod for g in view.snapshot.nodes[0].gpus] == ["(bound)"] * 3
    running["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    view = build_snapshot([n1], [running, waiting], CAT)
    assert [g.whole_pod for g in view.snapshot.nodes[0].gpus] == ["(bound)", None, None]


def test_a_gpu_whose_mig_mode_waits_for_a_reset_is_left_out():
    from dynpart.annotations import STATUS_CAPABILITY
    from dynpart.capability import GpuReport, encode_capability
    from tests.test_capability import kind_of, node_of

    cap = node_of(kind_of(CAT.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3"), gpus=2)
    cap = cap.model_copy(update={"gpus": (GpuReport(kind=0, mig="on"), GpuReport(kind=0, mig="on-pending"))})
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0")
    view = build_snapshot([node("n1", annotations={**status, STATUS_CAPABILITY: encode_capability(cap)})], [], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0]
    assert any("GPU(s) 1 changes only at the next GPU reset" in m for _, m in view.problems)


def test_cordon_taints_tolerations_and_required_affinity_reach_the_snapshot():
    from dynpart.planner.cluster_view import pod_for_planning
    from dynpart.scheduling import NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration

    cordoned, tainted = node("n1"), node("n2")
    cordoned["spec"] = {"unschedulable": True}
    tainted["spec"] = {"taints": [{"key": "team", "value": "a", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {}}]}}
    tolerations = [{"key": "team", "operator": "Equal", "value": "a", "effect": "NoSchedule", "tolerationSeconds": 30},
                   {"operator": "Exists", "effect": "NoExecute"}]
    wants = pod("wants", {"nvidia.com/mig-1g.10gb": "1"}, tolerations=tolerations, affinity=affinity)
    # what the controller's cache keeps of the pod still has them (the preferred terms are dropped)
    kept = pod_for_planning({**wants, "spec": {**wants["spec"], "volumes": [{"name": "v"}]}})
    assert kept["spec"]["tolerations"] == tolerations and "preferredDuringSchedulingIgnoredDuringExecution" not in \
        kept["spec"]["affinity"]["nodeAffinity"] and "volumes" not in kept["spec"]
    snap = build_snapshot([cordoned, tainted], [kept], CAT).snapshot
    n1, n2 = snap.nodes
    assert n1.unschedulable and not n1.taints and not n2.unschedulable
    assert n2.taints == [Taint(key="team", value="a", effect="NoSchedule")]
    (p,) = snap.pending
    assert p.tolerations == [Toleration(key="team", value="a", effect="NoSchedule"),
                             Toleration(operator="Exists", effect="NoExecute")]
    assert p.node_affinity == [
        NodeSelectorTerm(match_expressions=(NodeSelectorRequirement(key="zone", operator="In", values=("z1", "z2")),)),
        NodeSelectorTerm(match_fields=(NodeSelectorRequirement(key="metadata.name", operator="In", values=("n2",)),))]


def test_bad_tolerations_affinity_or_taints_leave_that_object_out_with_the_field_named():
    bad_pod = pod("bad", {"nvidia.com/mig-1g.10gb": "1"}, tolerations=[{"key": "k", "operator": "Sometimes"}])
    with pytest.raises(DynpartError, match=r"pod ml/bad: tolerations\.0\.operator = 'Sometimes'"):
        pending_pod(bad_pod)
    gt = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["three"]}]}]}}}
    with pytest.raises(DynpartError, match="operator Gt needs an integer, got 'three'"):
        pending_pod(pod("gt", {"nvidia.com/mig-1g.10gb": "1"}, affinity=gt))
    bad_node = node("n1")
    bad_node["spec"] = {"taints": [{"key": "k", "effect": "Sometimes"}]}
    view = build_snapshot([bad_node, node("n2")], [pod("ok", {"nvidia.com/mig-1g.10gb": "1"})], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n2"] and [p.name for p in view.snapshot.pending] == ["ml/ok"]
    assert any("node n1: spec.taints" in m for _, m in view.problems)


def reported_node(name, mig_modes, mode="mig", status_mode=None, count=None, product="NVIDIA-H100-80GB-HBM3",
                  layout=None, **annotations):
    """A node whose agent reported `layout` (default: nothing) in `status_mode` (default: the
    label's `mode`) and a capability report of H100s with these MIG modes."""
    from dynpart.annotations import STATUS_CAPABILITY
    from dynpart.capability import GpuReport, encode_capability
    from tests.test_capability import kind_of, node_of

    cap = node_of(kind_of(CAT.resolve("H100-80GB"), "NVIDIA H100 80GB HBM3"), gpus=len(mig_modes))
    cap = cap.model_copy(update={"gpus": tuple(GpuReport(kind=0, mig=m) for m in mig_modes)})
    status = encode_status(layout or NodeLayout(node=name, mode=status_mode or mode, gpus=[]), "p0")
    return node(name, mode=mode, product=product, count=len(mig_modes) if count is None else count,
                annotations={**status, STATUS_CAPABILITY: encode_capability(cap), **annotations})


def test_a_node_whose_agent_reports_another_mode_than_its_label_is_left_out_until_it_switches():
    """Relabelled mig -> mps: its agent still runs MIG (the acknowledged spec is MIG). Its status
    read as MPS would show empty GPUs; the node is left out, with the reason, and named for the
    spec that moves its agent to MPS."""
    spec = {"dynpart.io/spec-plan": "p0", "dynpart.io/spec-mode": "mig"}
    relabelled = reported_node("n1", ["on"], mode="mps", status_mode="mig", **spec)
    view = build_snapshot([relabelled], [pod("a", {"nvidia.com/gpu-10gb": "1"})], CAT)
    assert view.snapshot.nodes == [] and view.switching == {"n1": "mps"}
    assert any("runs it in MIG mode but its label dynpart.io/gpu-partitioning=mps" in m for _, m in view.problems)
    # no spec keeps it there: its agent switches by itself, nothing to write
    view = build_snapshot([reported_node("n1", ["on"], mode="mps", status_mode="mig")], [], CAT)
    assert view.snapshot.nodes == [] and view.switching == {}


def test_an_mps_node_plans_no_gpu_in_mig_mode():
    view = build_snapshot([reported_node("n1", ["on", "off", "on-pending", "off-pending"], mode="mps")], [], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [1]
    assert any("GPU(s) 0, 2, 3 are in MIG mode" in m for _, m in view.problems)


def test_a_mig_node_does_not_carve_gpus_out_of_mig_mode_while_mps_pods_run_there():
    """Switched from MPS while its pods run: MIG mode is enabled only once the GPU is idle."""
    mps_pod = pod("old", {"nvidia.com/gpu-10gb": "1"}, phase="Running", node="n1", unschedulable=False)
    n1 = reported_node("n1", ["off", "on"])
    view = build_snapshot([n1], [mps_pod], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [1]
    assert any("GPU(s) 0 are out of MIG mode while pods using MPS slices" in m for _, m in view.problems)
    assert [g.index for g in build_snapshot([n1], [], CAT).snapshot.nodes[0].gpus] == [0, 1]


@pytest.mark.parametrize("label", ["0", "14"])
def test_the_gpus_come_from_the_capability_report_not_the_gpu_count_label(label):
    """GPU Operator's MIG strategy single: GFD labels a MIG node gpu.count=0 (product
    <model>-MIG-INVALID, mixed profiles) or the number of MIG devices, and the product with a suffix."""
    n1 = reported_node("n1", ["on", "on"], count=int(label), product="NVIDIA-H100-80GB-HBM3-MIG-INVALID")
    [seen] = build_snapshot([n1], [], CAT).snapshot.nodes
    assert [g.index for g in seen.gpus] == [0, 1] and seen.gpu_model == "H100-80GB"


def test_the_gpu_count_label_and_a_suffixed_product_serve_until_the_agent_reports():
    n1 = node("n1", product="NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", count=3,
              annotations=encode_status(NodeLayout(node="n1", mode="mig", gpus=[]), "p0"))
    [seen] = build_snapshot([n1], [], CAT).snapshot.nodes
    assert [g.index for g in seen.gpus] == [0, 1, 2] and seen.gpu_model == "H100-80GB"


@pytest.mark.parametrize("label", ["300", "-1", "eight"])
def test_a_gpu_count_label_that_is_no_count_plans_no_gpu_and_says_so(label):
    """A node labelled with 300 GPUs once made every round fail (GPU index 256 has no key)."""
    from dynpart.planner.cluster_view import planned_patches
    from dynpart.planner.core import plan

    bad, good = node("n1", count=1), node("n2", count=1)
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = label
    view = build_snapshot([bad, good], [pod("w", {"nvidia.com/mig-1g.10gb": "1"}), pod("v", {"nvidia.com/mig-7g.80gb": "1"})], CAT)
    assert [len(n.gpus) for n in view.snapshot.nodes] == [0, 1]
    assert any("is not a GPU count (0 to 64)" in m for _, m in view.problems)
    result = plan(view.snapshot, view.catalog)
    assert [x.node for x in result.placements] == ["n2"]
    assert len(planned_patches(view.snapshot, result, {"n1": bad, "n2": good}, "r1")) == 1


def test_free_slices_beyond_the_allocatable_count_are_not_planned_for_pods():
    """The device plugin withdrew an unhealthy 1g.10gb: allocatable says 1 of the 2 reported."""
    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0), MigInstance(profile="1g.10gb", start=1),
        MigInstance(profile="2g.20gb", start=2)])]), "p0")
    n1 = node("n1", count=1, annotations=status)
    n1["status"]["allocatable"].update({"nvidia.com/mig-1g.10gb": "1"})
    [seen] = build_snapshot([n1], [], CAT).snapshot.nodes
    assert [(m.profile, m.used) for m in seen.gpus[0].mig] == [("1g.10gb", False), ("1g.10gb", True),
                                                                ("2g.20gb", False)]
    n1["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "0"
    view = build_snapshot([n1], [pod("a", {"nvidia.com/mig-1g.10gb": "1"})], CAT)
    assert all(m.used for m in view.snapshot.nodes[0].gpus[0].mig if m.profile == "1g.10gb")
    assert any("2 nvidia.com/mig-1g.10gb slice(s) reported, 0 allocatable" in m for _, _, m in view.unallocatable)


def test_a_product_selector_matches_the_label_exactly_not_the_catalog_family():
    """The kube-scheduler binds only where the label equals the selector's value: a node of
    another product of the same catalog family (A100-40GB: SXM4 and PCIe) is no candidate."""
    from dynpart.planner.core import plan

    nodes = [node("a-pcie", product="NVIDIA-A100-PCIE-40GB", count=1),
             node("b-sxm", product="NVIDIA-A100-SXM4-40GB", count=1)]
    wants = pod("sxm-only", {"nvidia.com/mig-3g.20gb": "1"}, nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"})
    view = build_snapshot(nodes, [wants], CAT)
    result = plan(view.snapshot, view.catalog)
    assert [(x.pod, x.node) for x in result.placements] == [("ml/sxm-only", "b-sxm")]
    view = build_snapshot(nodes[:1], [wants], CAT)
    assert not view.snapshot.pending and "matches its nodeSelector" in view.elsewhere[0][1]  # another pool's pod


@pytest.mark.parametrize("status, why", [
    ({"dynpart.io/status-gpu-0-7g.80gb-used": "1@0;pod=ml/x"}, "is not a non-negative integer"),  # a newer agent's format
    ({"dynpart.io/status-gpu-0-7g.80gb-busy": "1@0"}, "neither 'free' nor 'used'"),
])
def test_a_node_whose_status_slices_cannot_all_be_read_is_not_planned(status, why):
    """A slice the planner cannot read may be in use: planning the node around it would plan
    over it. The node is left out, the problem names it; the other nodes are planned."""
    from dynpart.planner.core import plan

    bad = node("n1", count=1,
               annotations={"dynpart.io/status-plan": "p1", "dynpart.io/status-mode": "mig", **status})
    good = node("n2", count=1)
    wants = pod("w", {"nvidia.com/mig-1g.10gb": "1"})
    view = build_snapshot([bad, good], [wants], CAT)
    assert [n.name for n in view.snapshot.nodes] == ["n2"]
    messages = [m for obj, m in view.problems if obj is bad]
    assert any(m.startswith("node n1: annotation") and why in m for m in messages), messages
    assert any("node n1: left out of planning" in m for m in messages), messages
    assert view.acks["n1"] == "p1"
    assert [(x.pod, x.node) for x in plan(view.snapshot, view.catalog).placements] == [("ml/w", "n2")]


def test_requests_count_sidecars_and_the_pod_overhead_as_the_scheduler_does():
    """Kubernetes' PodRequests: containers plus sidecars (restartable init containers), at least
    each plain init container beside the sidecars started before it, plus the overhead; a bound
    pod's requests leave that much less on its node."""
    from dynpart.planner.cluster_view import pod_for_planning

    sidecar = {"name": "s", "restartPolicy": "Always", "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}
    setup = {"name": "i", "resources": {"requests": {"cpu": "2500m"}}}
    wants = pod("a", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1", "memory": "1Gi"}, initContainers=[sidecar],
                overhead={"cpu": "250m", "memory": "120Mi"})
    p = pending_pod(pod_for_planning(wants))
    assert (p.cpu_milli, p.memory_mib) == (3250, 1024 + 4096 + 120)
    # a plain init container after the sidecar runs beside it: 2 + 2.5 CPUs at the peak
    peak = pod("b", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, initContainers=[sidecar, setup])
    assert pending_pod(pod_for_planning(peak)).cpu_milli == 4500
    before = pod("c", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, initContainers=[setup, sidecar])
    assert pending_pod(pod_for_planning(before)).cpu_milli == 3000
    bound = pod("bound", {"cpu": "1"}, phase="Running", node="n1", unschedulable=False, initContainers=[sidecar],
                overhead={"cpu": "250m"})
    view = build_snapshot([node("n1", cpu="4")], [pod_for_planning(bound)], CAT)
    assert view.snapshot.nodes[0].cpu_milli_free == 750
    # pod-level resources (Kubernetes 1.34 on) replace the containers' CPU and memory; the
    # overhead is still added, and the slices still come from the containers
    whole = pod("d", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, overhead={"cpu": "250m"})
    whole["spec"]["resources"] = {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"cpu": "8", "memory": "32Gi"}}
    p = pending_pod(pod_for_planning(whole))
    assert (p.cpu_milli, p.memory_mib, p.resource, p.count) == (8250, 32 * 1024, "nvidia.com/mig-1g.10gb", 1)
    bound = pod("bound", {"nvidia.com/mig-1g.10gb": "1"}, phase="Running", node="n1", unschedulable=False)
    bound["spec"]["resources"] = {"requests": {"cpu": "3"}}
    view = build_snapshot([node("n1", cpu="4")], [pod_for_planning(bound)], CAT)
    assert view.snapshot.nodes[0].cpu_milli_free == 1000


@pytest.mark.parametrize("resource, count, most", [
    ("nvidia.com/mig-3g.40gb", 3, 2), ("nvidia.com/mig-1g.10gb", 8, 7), ("nvidia.com/mig-1g.10gb.me", 2, 1),
    ("nvidia.com/mig-7g.80gb", 2, 1), ("nvidia.com/gpu", 2, 1)])
def test_a_pod_no_node_can_ever_hold_is_told_so_not_to_wait_for_space(resource, count, most):
    from dynpart.planner.core import plan

    mode = "mps" if resource == "nvidia.com/gpu" else "mig"
    view = build_snapshot([node(f"n{i}", mode=mode, count=1) for i in range(3)], [pod("a", {resource: str(count)})], CAT)
    [why] = plan(view.snapshot, view.catalog).unplaced
    assert why.reason.startswith(f"{count} x {resource} asked, more than one node can ever hold (e.g. node n0: at most "
                                 f"{most}"), why.reason
    mps = build_snapshot([node("m0", mode="mps", count=2)], [pod("b", {"nvidia.com/gpu-40gb": "5"})], CAT)
    [why] = plan(mps.snapshot, mps.catalog).unplaced
    assert "(e.g. node m0: at most 2," in why.reason, why.reason  # one 40gb slice in each GPU's 79 GiB


def test_a_learned_share_of_a_profile_only_a_departed_node_offered_does_not_stop_the_rounds():
    """A pod asked for a driver's own profile name (7g.79gb) on a node that then left: the share
    learnt for it counts for no node, and the next round plans as before."""
    from dynpart.annotations import STATUS_CAPABILITY
    from dynpart.capability import encode_capability
    from dynpart.planner.loop import PlanningLoop
    from dynpart.settings import PlannerSettings
    from tests.test_capability import kind_of, node_of

    a100 = CAT.resolve("A100-80GB")
    renamed = a100.model_copy(update={"mig_profiles": tuple(
        p.model_copy(update={"name": "7g.79gb"}) if p.name == "7g.80gb" else p for p in a100.mig_profiles)})
    cap = encode_capability(node_of(kind_of(renamed, "NVIDIA Foo 80GB"), gpus=1))
    status = encode_status(NodeLayout(node="a1", mode="mig", gpus=[GpuLayout(index=0)]), "p0")
    foo = node("a1", product="NVIDIA Foo 80GB", count=1, annotations={**status, STATUS_CAPABILITY: cap})
    h100 = node("h1", count=1)
    loop = PlanningLoop(PlannerSettings())
    view = build_snapshot([foo, h100], [pod("x", {"nvidia.com/mig-7g.79gb": "1"})], CAT)
    assert [p.node for p in loop.decide(loop.prepare(view.snapshot, 0.0), view.catalog).placements] == ["a1"]
    view = build_snapshot([h100], [pod("y", {"nvidia.com/mig-1g.10gb": "1"})], CAT)
    snapshot = loop.prepare(view.snapshot, 60.0)
    assert "nvidia.com/mig-7g.79gb" in {s.resource for s in snapshot.workload}
    assert [p.pod for p in loop.decide(snapshot, view.catalog).placements] == ["ml/y"]


def test_an_mps_pod_without_host_ipc_is_planned_and_its_owner_told_why_it_will_not_reach_mps():
    from dynpart.planner.cluster_view import pod_for_planning

    without = pod_for_planning(pod("a", {"nvidia.com/gpu-10gb": "1"}))
    with_ipc = pod_for_planning(pod("b", {"nvidia.com/gpu-10gb": "1"}, hostIPC=True))
    mig = pod_for_planning(pod("c", {"nvidia.com/mig-1g.10gb": "1"}))
    nodes = [node("m", mode="mps", count=1), node("g", count=1)]
    view = build_snapshot(nodes, [without, with_ipc, mig], CAT, mps_host_ipc=True)
    assert {p.name for p in view.snapshot.pending} == {"ml/a", "ml/b", "ml/c"}
    assert [(obj["metadata"]["name"], "hostIPC: true" in m) for obj, m in view.warnings] == [("a", True)]
    assert not view.problems
    # the daemon's own /dev/shm mounted into its clients (the chart's default): no hostIPC needed
    assert not build_snapshot(nodes, [without, with_ipc, mig], CAT).warnings


def test_an_mps_pod_with_a_volume_at_dev_shm_is_planned_and_its_owner_told_it_hides_the_daemons_shared_memory():
    from dynpart.planner.cluster_view import pod_for_planning

    def with_shm(name, resources, path="/dev/shm", **spec):
        p = pod(name, resources, **spec)
        p["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"},
                                                      {"name": "shm", "mountPath": path}]
        p["spec"]["containers"].append({"name": "sidecar", "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]})
        return pod_for_planning(p)

    mps = with_shm("a", {"nvidia.com/gpu-10gb": "1"}, hostIPC=True)
    # the cache keeps the /dev/shm mounts only
    assert mps["spec"]["containers"][0]["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    sidecar = pod("e", {"cpu": "1"})
    sidecar["spec"]["initContainers"] = [{"name": "c", "restartPolicy": "Always",
                                          "resources": {"limits": {"nvidia.com/gpu-10gb": "1"}},
                                          "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}]
    pods = [mps, with_shm("b", {"nvidia.com/gpu-10gb": "1"}, path="/dev//shm/"),
            with_shm("c", {"nvidia.com/gpu-10gb": "1"}, path="/dev/shmem"), with_shm("d", {"nvidia.com/mig-1g.10gb": "1"}),
            pod_for_planning(sidecar)]
    for host_ipc in (False, True):
        view = build_snapshot([node("m", mode="mps", count=1), node("g", count=1)], pods, CAT, mps_host_ipc=host_ipc)
        assert {p.name for p in view.snapshot.pending} == {"ml/a", "ml/b", "ml/c", "ml/d", "ml/e"}
        found = [(obj["metadata"]["name"], "container c mounts a volume at /dev/shm" in m) for obj, m in view.warnings
                 if "hostIPC" not in m]
        # (only the container given the slice, a native sidecar too: the other's /dev/shm is its own)
        assert found == [("a", True), ("b", True), ("e", True)]


def test_a_gpu_holding_a_profile_the_planners_model_lacks_is_kept_as_it_is_and_the_rest_planned():
    """A newer agent writes a capability report this planner cannot read (another version): the
    node is planned from the catalog, and its agent reports a profile under the driver's name, which
    the catalog's model lacks. That GPU's instances have shapes the planner cannot know: the GPU is
    left out and every spec (a plan, a revocation) keeps it as it is; the node's other GPU is
    planned, and the node can be revoked. (The node was left out whole before.)"""
    from dynpart.annotations import decode_spec
    from dynpart.planner.cluster_view import can_revoke, keeping_unread, planned_patches, revoking_patch
    from dynpart.planner.core import plan

    status = {**encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=1)]), "p1"),
              "dynpart.io/status-gpu-0-7g.79gb-used": "1@0",
              "dynpart.io/status-capability": '{"v": 2, "kinds": [], "gpus": [], "new": 1}',
              "dynpart.io/spec-plan": "p1", "dynpart.io/status-driver": "590.1"}  # a key of its version
    n1 = node("n1", count=2, annotations=status)
    view = build_snapshot([n1], [pod("w", {"nvidia.com/mig-3g.40gb": "1"})], CAT)
    [planned] = view.snapshot.nodes
    assert [g.index for g in planned.gpus] == [1]
    assert view.kept == {"n1": {"dynpart.io/spec-gpu-0-7g.79gb": "1@0"}}
    messages = [m for _, m in view.problems]
    assert [m for _, m in view.skew] == ["node n1: annotation 'dynpart.io/status-driver': not a key this dynpart "
                                         "version knows (written by a newer planner or agent?); ignored"]
    assert any("version 2" in m for m in messages), messages
    assert any("GPU(s) 0 hold MIG instances this planner's H100-80GB model cannot read (7g.79gb; its agent's "
               "capability report cannot be read here" in m for m in messages), messages
    result = plan(view.snapshot, view.catalog)
    assert [(p.pod, p.node, p.slices[0].gpu) for p in result.placements] == [("ml/w", "n1", 1)]
    [(_, patch)] = planned_patches(view.snapshot, result, {"n1": n1}, "p2")
    patch = keeping_unread(patch, n1, view.kept["n1"])
    assert patch["dynpart.io/spec-gpu-0-7g.79gb"] == "1@0" and patch["dynpart.io/spec-gpu-1-3g.40gb"]
    assert can_revoke(n1, CAT)
    revocation = revoking_patch(n1, CAT, "p3")
    assert revocation is not None and revocation["dynpart.io/spec-gpu-0-7g.79gb"] == "1@0"
    assert decode_spec({k: v for k, v in revocation.items() if v}, CAT.resolve("H100-80GB")).plan_id == "p3"
    # a spec that already asks for them keeps them (a merge patch would have removed them)
    n1["metadata"]["annotations"]["dynpart.io/spec-gpu-0-7g.79gb"] = "1@0"
    [(_, patch)] = planned_patches(view.snapshot, result, {"n1": n1}, "p2")
    assert patch["dynpart.io/spec-gpu-0-7g.79gb"] is None
    assert "dynpart.io/spec-gpu-0-7g.79gb" not in keeping_unread(patch, n1, view.kept["n1"])
    assert "dynpart.io/spec-gpu-0-7g.79gb" not in (revoking_patch(n1, CAT, "p4") or {})


def test_a_preemptor_nominated_to_a_node_keeps_the_slice_its_victims_free():
    """The scheduler preempted pods on n1 for `hi` (status.nominatedNodeName) and waits for the
    1g.10gb they free: that free slice is counted as taken, as a reservation's is, so no plan
    carves it away for another pod; `hi` itself is not planned."""
    from dynpart.planner.core import plan

    status = encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0, mig=[
        MigInstance(profile="1g.10gb", start=0, used=True), MigInstance(profile="1g.10gb", start=1, used=True),
        MigInstance(profile="1g.10gb", start=2), MigInstance(profile="3g.40gb", start=4, used=True)])]), "p0")
    n1 = node("n1", count=1, annotations={**status, "dynpart.io/spec-plan": "p0"})
    preemptor = pod("hi", {"nvidia.com/mig-1g.10gb": "1"}, priority=1000)
    preemptor["status"]["nominatedNodeName"] = "n1"
    other = pod("lo", {"nvidia.com/mig-2g.20gb": "1"})
    running = [pod(f"r{i}", {f"nvidia.com/mig-{p}": "1"}, phase="Running", node="n1", unschedulable=False)
               for i, p in enumerate(("1g.10gb", "1g.10gb", "3g.40gb"))]  # on the used slices
    view = build_snapshot([n1], [*running, preemptor, other], CAT)
    assert [p.name for p in view.snapshot.pending] == ["ml/lo"]
    assert [(m.profile, m.start, m.used) for m in view.snapshot.nodes[0].gpus[0].mig][2] == ("1g.10gb", 2, True)
    result = plan(view.snapshot, view.catalog)
    assert not result.placements and not result.changed_nodes()
    # a preemptor that ended (or is being deleted) holds nothing
    gone = {**preemptor, "status": {**preemptor["status"], "phase": "Failed"}}
    assert not build_snapshot([n1], [*running, gone, other], CAT).snapshot.nodes[0].gpus[0].mig[2].used


def test_a_gpu_its_agent_reports_unhealthy_is_kept_as_it_is_and_the_rest_planned():
    """A GPU the driver reports unhealthy (an Xid that needs a reset) has its devices Unhealthy at
    the kubelet: a slice planned there would never serve its pod. It is left out of planning, its
    free slices are neither counted nor planned away, and every spec keeps it as it is."""
    from dynpart.planner.cluster_view import keeping_unread, planned_patches, revoking_patch
    from dynpart.planner.core import plan

    layout = NodeLayout(node="n1", mode="mig", gpus=[
        GpuLayout(index=0, mig=[MigInstance(profile="3g.40gb", start=0), MigInstance(profile="3g.40gb", start=4,
                                                                                      used=True)]),
        GpuLayout(index=1)])
    status = {**encode_status(layout, "p1", ["GPU 0 is unhealthy (an Xid)"], unhealthy=[0]), "dynpart.io/spec-plan": "p1"}
    n1 = node("n1", count=2, annotations=status)
    bound = pod("b", {"nvidia.com/mig-3g.40gb": "1"}, phase="Running", node="n1", unschedulable=False)
    pending = [pod("w", {"nvidia.com/mig-3g.40gb": "1"}), pod("x", {"nvidia.com/mig-7g.80gb": "1"})]
    view = build_snapshot([n1], [bound, *pending], CAT)
    [planned] = view.snapshot.nodes
    assert [g.index for g in planned.gpus] == [1]
    assert view.kept == {"n1": {"dynpart.io/spec-gpu-0-3g.40gb": "2@0,4"}}
    assert any("GPU(s) 0 reported unhealthy by its agent" in m for _, m in view.problems), view.problems
    result = plan(view.snapshot, view.catalog)
    # the free 3g.40gb on GPU 0 is not given to `w`: both pods want GPU 1, one gets it
    assert {s.gpu for p in result.placements for s in p.slices} == {1} and len(result.placements) == 1
    [(_, patch)] = planned_patches(view.snapshot, result, {"n1": n1}, "p2")
    patch = keeping_unread(patch, n1, view.kept["n1"])
    assert patch["dynpart.io/spec-gpu-0-3g.40gb"] == "2@0,4"
    revocation = revoking_patch(n1, CAT, "p3")
    assert revocation is not None and revocation["dynpart.io/spec-gpu-0-3g.40gb"] == "2@0,4"
    # healthy again: planned as usual, its free 3g.40gb given to a pod
    del n1["metadata"]["annotations"]["dynpart.io/status-unhealthy"]
    view = build_snapshot([n1], [bound, *pending], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0, 1] and not view.kept


def test_an_unhealthy_list_that_cannot_be_read_is_reported_and_plans_as_before():
    status = {**encode_status(NodeLayout(node="n1", mode="mig", gpus=[GpuLayout(index=0)]), "p1"),
              "dynpart.io/status-unhealthy": "0;1"}
    view = build_snapshot([node("n1", count=2, annotations=status)], [], CAT)
    assert [g.index for g in view.snapshot.nodes[0].gpus] == [0, 1]
    assert any("dynpart.io/status-unhealthy" in m and "comma separated" in m for _, m in view.problems), view.problems


def test_an_mps_pod_planned_beside_mps_pods_of_another_user_id_is_told_it_will_wait():
    """The node's MPS control daemon runs one server per user id at a time: a pod of another uid
    waits in CUDA initialisation until the running uid's clients end. Said only where both ids are
    known (runAsUser; a container's overrides the pod's)."""
    from dynpart.planner.cluster_view import mps_user_clashes, pod_for_planning, run_as_user

    def mps(name, uid=None, node=None, container_uid=None, phase="Pending"):
        p = pod(name, {"nvidia.com/gpu-10gb": "1"}, node=node, phase=phase, unschedulable=node is None)
        if uid is not None:
            p["spec"]["securityContext"] = {"runAsUser": uid, "fsGroup": 7}
        if container_uid is not None:
            p["spec"]["containers"][0]["securityContext"] = {"runAsUser": container_uid}
        return pod_for_planning(p)

    pods = {f"ml/{p['metadata']['name']}": p for p in [
        mps("running", uid=1000, node="m1", phase="Running"), mps("done", uid=0, node="m1", phase="Succeeded"),
        mps("root", uid=0), mps("same", uid=1000), mps("override", uid=0, container_uid=1000), mps("unknown"),
        pod_for_planning(pod("mig", {"nvidia.com/mig-1g.10gb": "1"}))]}
    assert run_as_user(pods["ml/override"]) == 1000 and run_as_user(pods["ml/unknown"]) is None
    assert run_as_user(mps("root-container", uid=1000, container_uid=0)) == 0
    assert pods["ml/root"]["spec"]["securityContext"] == {"runAsUser": 0}  # the cache keeps only the id
    clashes = mps_user_clashes([(k, "m1") for k in ("ml/root", "ml/same", "ml/override", "ml/unknown", "ml/mig")]
                               + [("ml/root", "m2")], pods)
    assert [(o["metadata"]["name"], m.split(":")[0]) for o, m in clashes] == [
        ("root", "pod ml/root runs as user 0, and MPS pods on node m1 run as user(s) 1000; this plan puts ml/same "
                 "(user 1000) on node m1 too"),
        ("same", "pod ml/same runs as user 1000, and this plan puts ml/root (user 0) on node m1 too"),
        ("override", "pod ml/override runs as user 1000, and this plan puts ml/root (user 0) on node m1 too")]
    assert mps_user_clashes([("ml/same", "m1"), ("ml/override", "m1"), ("ml/unknown", "m1")], pods) == []
    # two pods of different ids planned onto one empty node by the same plan: both told
    clashes = mps_user_clashes([("ml/root", "m3"), ("ml/same", "m3"), ("ml/unknown", "m3")], pods)
    assert [(o["metadata"]["name"], m.split(":")[0]) for o, m in clashes] == [
        ("root", "pod ml/root runs as user 0, and this plan puts ml/same (user 1000) on node m3 too"),
        ("same", "pod ml/same runs as user 1000, and this plan puts ml/root (user 0) on node m3 too")]


def test_mps_user_clashes_read_only_the_pods_bound_to_the_nodes_planned(monkeypatch):
    """The controller passes every cached pod (tens of thousands, on its event loop): only those
    bound to a node an MPS pod is planned onto have their requests read (each read parses every
    container's quantities: 60,000 pods took about 2 s a round)."""
    from dynpart.planner import cluster_view
    from dynpart.planner.cluster_view import mps_user_clashes, pod_for_planning

    def mps(name, uid, node=None):
        p = pod(name, {"nvidia.com/gpu-10gb": "1", "cpu": "1"}, node=node, phase="Running" if node else "Pending",
                unschedulable=node is None)
        p["spec"]["securityContext"] = {"runAsUser": uid}
        return pod_for_planning(p)

    pods = {f"ml/{p['metadata']['name']}": p for p in [
        mps("on-m1", 1000, node="m1"), mps("new", 0), mps("also-new", 0),
        *(mps(f"elsewhere-{i}", 1000, node=f"n{i}") for i in range(2000))]}
    read = []
    real = cluster_view.slice_requests
    monkeypatch.setattr(cluster_view, "slice_requests", lambda pod: read.append(pod) or real(pod))
    [(obj, why)] = mps_user_clashes([("ml/new", "m1"), ("ml/also-new", "m2")], pods)
    assert obj["metadata"]["name"] == "new" and "MPS pods on node m1 run as user(s) 1000" in why
    assert len(read) <= 3, "the two planned and the one bound to m1, not the 2,000 elsewhere"
