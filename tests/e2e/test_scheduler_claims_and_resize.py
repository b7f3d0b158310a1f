"""The planner's model of two kube-scheduler verdicts, checked against the real kube-scheduler:

- VolumeBinding's PreFilter refuses a pod whose claim is not bound yet and binds immediately ("pod
  has unbound immediate PersistentVolumeClaims"): its class Immediate or missing, none named, or a
  volume named whose binding is not complete (`VolumeTopology.missing`). No PersistentVolume
  controller runs here, so every claim stays unbound.
- NodeResourcesFit counts a pod bound to a node by its containers' statuses while it is resized
  in place (`_container_requests(bound=True)`): the status is written here as a kubelet would."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import pytest

from dynpart.planner.cluster_view import _container_requests, pod_for_planning
from dynpart.planner.volume_topology import VolumeTopology, claim_for_planning, class_for_planning

pytestmark = pytest.mark.e2e


async def _condition(core: Any, name: str, ns: str, timeout: float = 30.0) -> tuple[bool, str]:
    """(bound, the PodScheduled message) once the scheduler has decided about the pod."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pod = await core.read_namespaced_pod(name, ns)
        if pod.spec.node_name:
            return True, ""
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.message:
                return False, c.message
        assert asyncio.get_running_loop().time() < deadline, f"the scheduler did not decide about {name}"
        await asyncio.sleep(0.2)


async def _node(core: Any, client: Any, name: str, cpu: str) -> None:
    await core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"h130": name}}})
    node = await core.read_node(name)
    now = dt.datetime.now(dt.UTC)
    resources = {"cpu": cpu, "memory": "32Gi", "pods": "110"}
    node.status = client.V1NodeStatus(capacity=resources, allocatable=resources, conditions=[client.V1NodeCondition(
        type="Ready", status="True", reason="KubeletReady", message="fake node", last_heartbeat_time=now,
        last_transition_time=now)])
    await core.replace_node_status(name, node)


def _pod(name: str, node: str, cpu: str, claim: str | None = None, bound: bool = False) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 0, **({"nodeName": node} if bound else {"nodeSelector": {"h130": node}}),
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}}],
                     **({"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}]} if claim else {})}}


async def test_the_planner_refuses_the_pods_the_scheduler_refuses_for_unbound_immediate_claims(e2e_cluster):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(e2e_cluster.kubeconfig), client_configuration=cfg)
    s = uuid.uuid4().hex[:8]
    ns, node = "default", f"h130-claims-{s}"
    classes = {f"imm-{s}": ("example.com/none", "Immediate"), f"wffc-{s}": ("kubernetes.io/no-provisioner",
                                                                          "WaitForFirstConsumer")}
    # claim -> (storageClassName or None, spec.volumeName or None)
    claims = {f"imm-{s}": (f"imm-{s}", None), f"wffc-{s}": (f"wffc-{s}", None), f"empty-{s}": ("", None),
              f"nil-{s}": (None, None), f"gone-{s}": (f"gone-{s}", None), f"pre-{s}": (f"wffc-{s}", f"pv-{s}")}
    async with client.ApiClient(cfg) as api:
        core, storage = client.CoreV1Api(api), client.StorageV1Api(api)
        await _node(core, client, node, "8")
        try:
            for name, (provisioner, mode) in classes.items():
                await storage.create_storage_class({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                                                    "metadata": {"name": name}, "provisioner": provisioner,
                                                    "volumeBindingMode": mode})
            for name, (cls, volume) in claims.items():
                await core.create_namespaced_persistent_volume_claim(ns, {
                    "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                             **({"storageClassName": cls} if cls is not None else {}),
                             **({"volumeName": volume} if volume else {})}})
                await core.create_namespaced_pod(ns, _pod(f"p-{name}", node, "100m", claim=name))
            ser = api.sanitize_for_serialization
            topology = VolumeTopology(
                {f"{ns}/{n}": claim_for_planning(ser(await core.read_namespaced_persistent_volume_claim(n, ns)))
                 for n in claims}, {},
                {n: class_for_planning(ser(await storage.read_storage_class(n))) for n in classes})
            verdicts = {}
            for name in claims:
                bound, message = await _condition(core, f"p-{name}", ns)
                pod = pod_for_planning(ser(await core.read_namespaced_pod(f"p-{name}", ns)))
                why, lasting, _ = topology.missing(pod)
                verdicts[name] = ("unbound immediate PersistentVolumeClaims" in message, why is not None and lasting)
                assert not bound, f"{name}: no volume can be bound here"
            assert all(scheduler == planner for scheduler, planner in verdicts.values()), verdicts
            assert [n for n, (refused, _) in verdicts.items() if not refused] == [f"wffc-{s}"], verdicts
        finally:
            for name in claims:
                await core.delete_namespaced_pod(f"p-{name}", ns, grace_period_seconds=0)
                await core.delete_namespaced_persistent_volume_claim(name, ns)
            for name in classes:
                await storage.delete_storage_class(name)
            await core.delete_node(node)


async def test_the_planner_counts_a_pod_resized_in_place_as_the_scheduler_does(e2e_cluster):
    """Per node, a bound pod with a resize under way, and a pod asking for 2 of the node's 4 CPUs:
    the scheduler binds it exactly where the planner counts 2 CPUs left."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(e2e_cluster.kubeconfig), client_configuration=cfg)
    s = uuid.uuid4().hex[:8]
    ns = "default"
    infeasible = [{"type": "PodResizePending", "status": "True", "reason": "Infeasible", "message": "too big"}]
    deferred = [{"type": "PodResizePending", "status": "True", "reason": "Deferred", "message": "later"}]
    # node -> (the bound pod's spec CPU, its status's applied CPU, admitted CPU, conditions)
    cases = {f"h130-shrinking-{s}": ("1", "3", "1", []), f"h130-growing-{s}": ("3", "1", "3", []),
             f"h130-infeasible-{s}": ("3", "1", "1", infeasible), f"h130-deferred-{s}": ("3", "1", "1", deferred),
             f"h130-steady-{s}": ("2", "2", "2", [])}
    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        ser = api.sanitize_for_serialization
        try:
            for node, (cpu, applied, admitted, conditions) in cases.items():
                await _node(core, client, node, "4")
                await core.create_namespaced_pod(ns, _pod(f"b-{node}", node, cpu, bound=True))
                pod = await core.read_namespaced_pod(f"b-{node}", ns)
                now = dt.datetime.now(dt.UTC).isoformat()
                status = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}, *(
                    {**c, "lastTransitionTime": now} for c in conditions)],
                    "containerStatuses": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "imageID": "",
                                           "ready": True, "restartCount": 0, "started": True,
                                           "state": {"running": {"startedAt": now}},
                                           "resources": {"requests": {"cpu": applied}, "limits": {"cpu": applied}},
                                           "allocatedResources": {"cpu": admitted}}]}
                await core.replace_namespaced_pod_status(f"b-{node}", ns, {**ser(pod), "status": status})
                pod = await core.read_namespaced_pod(f"b-{node}", ns)
                assert pod.status.container_statuses[0].allocated_resources == {"cpu": admitted}, "status kept"
            for node in cases:
                await core.create_namespaced_pod(ns, _pod(f"w-{node}", node, "2"))
            for node in cases:
                bound, message = await _condition(core, f"w-{node}", ns)
                held = _container_requests(pod_for_planning(ser(await core.read_namespaced_pod(f"b-{node}", ns))),
                                           bound=True)["cpu"]
                assert bound == (4 - held >= 2), (node, held, message)
                assert bound or "Insufficient cpu" in message, message
            assert [bound for bound, _ in [await _condition(core, f"w-{n}", ns) for n in cases]] == [
                False, False, True, False, True]
        finally:
            for node in cases:
                for p in (f"b-{node}", f"w-{node}"):
                    try:
                        await core.delete_namespaced_pod(p, ns, grace_period_seconds=0)
                    except client.ApiException as e:
                        if e.status != 404:
                            raise
                await core.delete_node(node)
