"""KubePluginPods, NVIDIA's device-plugin pods on a node, against the API server's raw answers."""

from __future__ import annotations

from typing import Any

import pytest

from dynpart.agent.kube import KubePluginPods
from dynpart.kube.errors import APIError
from tests.kube.fakes import FakeResponse

PODS = "/api/v1/namespaces/gpu-operator/pods"


class _Core:
    """The two calls restart() makes, answering as the API server would."""

    def __init__(self, delete_status: int):
        self.delete_status = delete_status
        self.deleted: list[str] = []

    async def list_namespaced_pod(self, namespace: str, **kw: Any) -> FakeResponse:
        assert kw["field_selector"] == "spec.nodeName=gpu-1" and kw["label_selector"] == "app=plugin"
        return FakeResponse(200, {"kind": "PodList", "items": [{"metadata": {"name": "plugin-a"}}]}, path=PODS)

    async def delete_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> FakeResponse:
        self.deleted.append(name)
        ok = 200 <= self.delete_status <= 299
        body = {"kind": "Pod", "metadata": {"name": name}} if ok else {"kind": "Status", "code": self.delete_status}
        return FakeResponse(self.delete_status, body, reason="OK" if ok else "Forbidden", method="DELETE",
                            path=f"{PODS}/{name}")


def _plugin_pods(core: _Core) -> KubePluginPods:
    pods = KubePluginPods.__new__(KubePluginPods)
    pods._v1, pods.node, pods.namespace, pods.selector = core, "gpu-1", "gpu-operator", "app=plugin"  # type: ignore[assignment]
    return pods


@pytest.mark.parametrize("status", [403, 429, 500])
async def test_a_refused_delete_is_an_error_not_a_restart(status):
    """A DELETE the API server refuses (RBAC or the node-write policy: 403; overload: 429; 500)
    raises, so the agent asks again at its next pass instead of taking the plugin as restarted."""
    core = _Core(status)
    with pytest.raises(APIError, match=rf"delete pod gpu-operator/plugin-a: {status}"):
        await _plugin_pods(core).restart()
    assert core.deleted == ["plugin-a"]


async def test_a_deleted_or_already_gone_pod_is_a_restart():
    assert await _plugin_pods(_Core(200)).restart() == ["plugin-a"]
    assert await _plugin_pods(_Core(404)).restart() == ["plugin-a"]  # already going
