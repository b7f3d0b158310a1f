"""The real kube-scheduler binds a pod asking for a MIG slice to a fake node."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import pytest

pytestmark = pytest.mark.e2e

MIG = "nvidia.com/mig-1g.10gb"


async def _wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(interval)


def _pod(name: str, mig: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",  # never pulled: there is no kubelet
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi", MIG: str(mig)},
                              "limits": {MIG: str(mig)}},
            }],
        },
    }


async def test_real_scheduler_binds_mig_pod(e2e_cluster):
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(e2e_cluster.kubeconfig), client_configuration=cfg)
    suffix = uuid.uuid4().hex[:8]
    node_name, ns = f"e2e-gpu-node-{suffix}", "default"
    fits, too_big = f"mig-fits-{suffix}", f"mig-too-big-{suffix}"

    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        version = await client.VersionApi(api).get_code()
        assert version.git_version.startswith("v1."), version

        await core.create_node({"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": node_name, "labels": {"dynpart.io/e2e": "true"}}})
        try:
            node = await core.read_node(node_name)
            now = dt.datetime.now(dt.UTC)
            resources = {"cpu": "8", "memory": "32Gi", "pods": "110", MIG: "2"}
            node.status = client.V1NodeStatus(
                capacity=resources, allocatable=resources,
                conditions=[client.V1NodeCondition(
                    type="Ready", status="True", reason="KubeletReady", message="fake node",
                    last_heartbeat_time=now, last_transition_time=now)],
            )
            await core.replace_node_status(node_name, node)  # the nodes/status subresource
            node = await core.read_node(node_name)
            assert node.status.allocatable[MIG] == "2"
            assert not node.spec.taints

            # Fits: 1 of the 2 slices.
            await core.create_namespaced_pod(ns, _pod(fits, 1))

            async def bound():
                pod = await core.read_namespaced_pod(fits, ns)
                return pod if pod.spec.node_name else None

            pod = await _wait_for(bound)
            assert pod is not None, "kube-scheduler did not bind the pod within 30s"
            assert pod.spec.node_name == node_name
            assert any(c.type == "PodScheduled" and c.status == "True" for c in pod.status.conditions)

            # Does not fit: 2 slices asked, 1 left -> the scheduler reports it unschedulable.
            await core.create_namespaced_pod(ns, _pod(too_big, 2))

            async def unschedulable():
                pod = await core.read_namespaced_pod(too_big, ns)
                conds = pod.status.conditions or []
                return pod if any(c.type == "PodScheduled" and c.status == "False"
                                  and c.reason == "Unschedulable" for c in conds) else None

            pod = await _wait_for(unschedulable)
            assert pod is not None, "kube-scheduler did not mark the oversized pod Unschedulable"
            assert pod.spec.node_name is None
            assert MIG in next(c.message for c in pod.status.conditions if c.type == "PodScheduled")
        finally:
            for name in (fits, too_big):
                try:  # no kubelet to confirm termination: delete immediately
                    await core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
                except client.ApiException as e:
                    if e.status != 404:
                        raise
            await core.delete_node(node_name)
