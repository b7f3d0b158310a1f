"""Every API call has a time bound (kubernetes-asyncio's default is to wait for ever)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynpart.kube.client import api_client, request_timeout
from dynpart.settings import KubeSettings


def test_a_call_is_bounded_as_a_whole_and_a_watch_by_silence():
    s = KubeSettings(request_timeout_s=7, watch_timeout_s=300, watch_idle_timeout_s=60)
    call = request_timeout([("labelSelector", "x")], s)
    assert call.total == 7
    watch = request_timeout([("watch", True), ("timeoutSeconds", 300)], s)
    assert watch.total is None and watch.sock_read == 360 and watch.sock_connect == 7


async def test_a_server_that_never_answers_fails_the_call_in_time(tmp_path):
    """A listening socket that accepts and never answers: the call fails after request_timeout_s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    from kubernetes_asyncio import client

    api = await api_client(str(kubeconfig), KubeSettings(request_timeout_s=0.5))
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):  # aiohttp's ServerTimeoutError is one
            await client.CoreV1Api(api).read_node("n")
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < 5, f"the call took {elapsed:.1f} s"
    finally:
        await api.close()
        server.close()
