"""The agent's Kubernetes layer (`KubeNodeApi`, `KubePluginPods`) against a real kube-apiserver
(tests/e2e's local control plane), with fake GPUs: spec in, MIG instances and status out; MPS
slices advertised by the agent's own device plugin and published in the node's status, no label
changed."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.agent.driver.fake import FakeNvml
from dynpart.agent.kube import KubeNodeApi, connect
from dynpart.agent.loop import Agent
from dynpart.agent.podresources import FakePodResources
from dynpart.annotations import annotation_patch
from dynpart.kube.conventions import PARTITIONING_LABEL, STATUS_PLAN
from dynpart.kube.patching import patch_node_annotations
from dynpart.settings import KubeSettings

from .conftest import CATALOG, H100, mig_spec, mps_spec, unserved_plugins

pytestmark = pytest.mark.e2e


async def _node(core, mode: str) -> str:
    name = f"agent-e2e-{mode}-{uuid.uuid4().hex[:6]}"
    await core.create_node({"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "labels": {PARTITIONING_LABEL: mode}}})
    return name


async def test_agent_against_a_real_apiserver(e2e_cluster):
    from kubernetes_asyncio import client

    api = await connect(str(e2e_cluster.kubeconfig))
    core = client.CoreV1Api(api)
    try:
        # --- MIG: the loop wakes on the spec, applies it, acknowledges it
        name = await _node(core, "mig")
        driver = FakeNvml(H100, 2)
        fast = KubeSettings(backoff_initial_s=0.2, backoff_max_s=0.2)
        agent = Agent(name, node_api=KubeNodeApi(api, name, fast), driver=driver, pods=FakePodResources(),
                      catalog=CATALOG, interval_s=30)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))

        async def annotations(node: str) -> dict[str, str]:
            return (await core.read_node(node)).metadata.annotations or {}

        async def wait_for(predicate, timeout=20.0):
            for _ in range(int(timeout / 0.1)):
                value = await predicate()
                if value:
                    return value
                await asyncio.sleep(0.1)
            raise AssertionError("timed out")

        await wait_for(lambda: _has(annotations(name), "dynpart.io/status-heartbeat"))
        spec = mig_spec({0: ["3g.40gb@0", "3g.40gb@4"], 1: ["1g.10gb@6"]}, plan="e1")
        await patch_node_annotations(core, name, annotation_patch(await annotations(name), spec))
        ann = await wait_for(lambda: _ack(annotations(name), "e1"))
        assert ann["dynpart.io/status-gpu-0-3g.40gb-free"] == "2@0,4"
        assert ann["dynpart.io/status-gpu-1-1g.10gb-free"] == "1@6"
        assert driver.layout(0) == [("3g.40gb", 0), ("3g.40gb", 4)]
        stop.set()
        await asyncio.wait_for(task, 10)

        # --- MPS: the agent's own device plugin advertises the slices, published in the node's status
        name = await _node(core, "mps")
        pods = FakePodResources()
        plugins = unserved_plugins(pods)
        mps = Agent(name, node_api=KubeNodeApi(api, name), driver=FakeNvml(H100, 1, mig_enabled=False),
                    pods=pods, catalog=CATALOG, plugins=plugins)
        await patch_node_annotations(core, name, mps_spec({0: [10, 10, 20]}, plan="m1"))
        report = await mps.reconcile_once()
        assert report.errors == [] and report.plan_id == "m1"
        node = await core.read_node(name)
        assert node.metadata.labels == {PARTITIONING_LABEL: "mps"}  # no label of the agent's
        assert {r: [d.id for d in ds] for r, ds in plugins.advertised().items()} == {
            "nvidia.com/gpu-10gb": ["GPU-fake-0000::1", "GPU-fake-0000::2"], "nvidia.com/gpu-20gb": ["GPU-fake-0000::0"]}
        assert {r: node.status.allocatable.get(r) for r in ("nvidia.com/gpu-10gb", "nvidia.com/gpu-20gb")} == {
            "nvidia.com/gpu-10gb": "2", "nvidia.com/gpu-20gb": "1"}
        assert node.metadata.annotations[STATUS_PLAN] == "m1"
        assert node.metadata.annotations["dynpart.io/status-gpu-0-10gb-free"] == "2"
    finally:
        await api.close()


async def _has(coro, key):
    return key in await coro


async def _ack(coro, plan):
    ann = await coro
    return ann if ann.get(STATUS_PLAN) == plan else None


async def test_bound_pods_status_counts_and_plugin_restart_on_a_real_apiserver(e2e_cluster):
    """KubeNodePods (its field selectors), KubeNodeApi.patch_status and KubePluginPods.restart
    against the real kube-apiserver (as an admin: RBAC and policies are test_least_privilege's)."""
    from kubernetes_asyncio import client

    from dynpart.agent.kube import KubePluginPods
    from dynpart.agent.nodepods import BoundPod, KubeNodePods

    api = await connect(str(e2e_cluster.kubeconfig))
    core = client.CoreV1Api(api)
    ns = f"agent-e2e-{uuid.uuid4().hex[:6]}"
    nodes: list[str] = []
    try:
        name = await _node(core, "mig")
        other = await _node(core, "mig")
        nodes += [name, other]
        await core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

        def pod(pod_name: str, node: str, labels: dict[str, str] | None = None, gpus: int = 1) -> dict:
            res = {"nvidia.com/mig-1g.10gb": str(gpus)} if gpus else {}
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "namespace": ns, "labels": labels or {}},
                    "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x",
                                                                "resources": {"requests": res, "limits": res}}]}}

        for p in (pod("w", name, gpus=2), pod("elsewhere", other), pod("cpu-only", name, gpus=0),
                  pod("plugin", name, {"app": "nvidia-device-plugin-daemonset"}, gpus=0),
                  pod("plugin-other", other, {"app": "nvidia-device-plugin-daemonset"}, gpus=0)):
            await core.create_namespaced_pod(ns, p)
        assert await KubeNodePods(api, name).bound() == [BoundPod(f"{ns}/w", {"nvidia.com/mig-1g.10gb": 2}, "Pending")]
        await core.patch_namespaced_pod_status("w", ns, {"status": {"phase": "Succeeded"}})
        assert await KubeNodePods(api, name).bound() == []  # finished: left out by the field selector

        node_api = KubeNodeApi(api, name)
        await node_api.patch_status({"nvidia.com/mig-1g.10gb": 3})
        view = await node_api.get()
        assert view.allocatable["nvidia.com/mig-1g.10gb"] == "3" and view.capacity["nvidia.com/mig-1g.10gb"] == "3"

        assert await KubePluginPods(api, name, ns, "app=nvidia-device-plugin-daemonset").restart() == ["plugin"]
        left = {p.metadata.name for p in (await core.list_namespaced_pod(ns)).items
                if p.metadata.deletion_timestamp is None}
        assert "plugin" not in left and "plugin-other" in left
    finally:
        for obj in nodes:
            try:
                await core.delete_node(obj)
            except ApiException:
                pass
        try:
            await core.delete_namespace(ns)
        except ApiException:
            pass
        await api.close()


async def test_the_agents_node_reads_come_from_its_watch_and_see_its_own_writes(e2e_cluster):
    """A pass reads the Node twice (the pass, the early publishing): from the watch's copy while
    the watch is open, not by a GET each time; a write of the agent's own is seen by the next read
    (a GET until the watch has delivered it), and so is another writer's once the watch has."""
    from kubernetes_asyncio import client

    api = await connect(str(e2e_cluster.kubeconfig))
    core = client.CoreV1Api(api)
    name = await _node(core, "mig")
    node_api = KubeNodeApi(api, name)
    seen: list[str] = []

    async def follow() -> None:
        async for view in node_api.watch():
            seen.append(view.resource_version)

    watching = asyncio.create_task(follow())
    try:
        assert (await node_api.get()).name == name and node_api.reads in (0, 1)  # the watch may not be open yet
        for _ in range(200):
            if node_api._informer is not None and node_api._informer.watching and seen:
                break
            await asyncio.sleep(0.05)
        reads = node_api.reads
        for _ in range(20):
            assert (await node_api.get()).name == name
        assert node_api.reads == reads  # the watch serves them

        # another writer (the planner): seen once the watch delivers it, with no GET
        await patch_node_annotations(core, name, {"dynpart.io/spec-plan": "p1"})
        for _ in range(200):
            if (await node_api.get()).annotations.get("dynpart.io/spec-plan") == "p1":
                break
            await asyncio.sleep(0.05)
        assert (await node_api.get()).annotations.get("dynpart.io/spec-plan") == "p1"
        assert node_api.reads == reads

        # its own writes: the next read shows them at once (annotations, then the status)
        for k in range(5):
            await node_api.patch(annotations={"dynpart.io/status-plan": f"p{k}"})
            assert (await node_api.get()).annotations["dynpart.io/status-plan"] == f"p{k}"
            await node_api.patch_status({"nvidia.com/mig-1g.10gb": k + 1})
            assert (await node_api.get()).allocatable["nvidia.com/mig-1g.10gb"] == str(k + 1)
        # once the watch has caught up, reads are the watch's again
        for _ in range(200):
            if not node_api._unseen:
                break
            await asyncio.sleep(0.05)
        reads = node_api.reads
        view = await node_api.get()
        assert node_api.reads == reads and view.annotations["dynpart.io/status-plan"] == "p4"
        # a write that changes nothing answers a version the watch has already delivered
        await node_api.patch(annotations={"dynpart.io/status-plan": "p4"})
        await node_api.get()
        assert node_api.reads == reads
        # a quiet watch (nothing heard for FRESH_S): the API server's watch cache confirms the
        # copy, without a quorum read; then the watch serves the reads again
        quorum = node_api.quorum_reads
        node_api._heard = node_api._confirmed = -float("inf")
        assert (await node_api.get()).annotations["dynpart.io/status-plan"] == "p4"
        assert (node_api.reads, node_api.quorum_reads) == (reads + 1, quorum)
        await node_api.get()
        assert node_api.reads == reads + 1
        # a quiet watch whose copy is behind the API server's (its connection cut): a quorum read
        informer = node_api._informer
        assert informer is not None
        current = informer.cache[name]
        informer.cache[name] = {**current, "metadata": {**current["metadata"], "resourceVersion": "1"}}
        node_api._heard = node_api._confirmed = -float("inf")
        assert (await node_api.get()).resource_version == current["metadata"]["resourceVersion"]
        assert (node_api.reads, node_api.quorum_reads) == (reads + 3, quorum + 1)
        # the watch and the API server's cache may lag etcd together: a quorum read every QUORUM_S
        for _ in range(200):
            if not node_api._unseen:
                break
            await asyncio.sleep(0.05)
        node_api._heard = node_api._confirmed = node_api._quorum_at = -float("inf")
        await node_api.get()
        assert (node_api.reads, node_api.quorum_reads) == (reads + 4, quorum + 2)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        try:
            await core.delete_node(name)
        except ApiException:
            pass
        await api.close()
    # with the watch gone, a read is a GET
    assert node_api._informer is None
