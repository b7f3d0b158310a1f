"""Connecting with a kubeconfig whose user is an exec credential plugin (EKS, GKE, AKS): its token
expires, and the client must not send it for ever."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.kube.client import api_client, read_json

from .fakes import FakeAPIServer, status

PLUGIN = """
import json, pathlib, sys
state = pathlib.Path(sys.argv[1])
n = int(state.read_text()) + 1 if state.exists() else 1
state.write_text(str(n))
out = {"token": f"token-{n}"}
if sys.argv[2] != "-":
    out["expirationTimestamp"] = sys.argv[2]
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential", "status": out}))
"""


def exec_user(tmp_path: Path, expiry: str) -> tuple[str, Path]:
    """A kubeconfig user running the plugin above (token-1, token-2, ... with `expiry`, "-": none),
    and the file counting its runs."""
    plugin, runs = tmp_path / "plugin.py", tmp_path / "runs"
    plugin.write_text(PLUGIN)
    args = json.dumps([str(plugin), str(runs), expiry])
    return (f"{{exec: {{apiVersion: client.authentication.k8s.io/v1beta1, command: {json.dumps(sys.executable)}, "
            f"args: {args}}}}}"), runs


def serve_nodes(server: FakeAPIServer, valid: set[str]) -> list[str]:
    """Node reads and lists answered for a token in `valid` (401 otherwise); the Authorization of
    each request, in order."""
    sent: list[str] = []

    async def nodes(request: web.Request) -> web.StreamResponse:
        sent.append(request.headers.get("Authorization", ""))
        if sent[-1] not in valid:
            return web.json_response(status(401, "Unauthorized"), status=401)
        if request.path == "/api/v1/nodes":
            return web.json_response({"kind": "NodeList", "metadata": {"resourceVersion": "1"}, "items": []})
        return web.json_response({"kind": "Node", "metadata": {"name": "n"}})

    server.handlers[("GET", "/api/v1/nodes/n")] = nodes
    server.handlers[("GET", "/api/v1/nodes")] = nodes
    return sent


async def test_an_expiring_exec_token_is_renewed_before_a_call(tmp_path):
    """A token that expires (within the loader's 5 minutes of margin) is renewed before the call."""
    soon = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    user, runs = exec_user(tmp_path, soon)
    async with FakeAPIServer() as server:
        sent = serve_nodes(server, {f"Bearer token-{n}" for n in range(1, 10)})
        api = await api_client(server.kubeconfig(tmp_path, user))
        try:
            core = client.CoreV1Api(api)
            await core.read_node("n")
            await core.read_node("n")
        finally:
            await api.close()
    assert sent == ["Bearer token-2", "Bearer token-3"]  # token-1: when the kubeconfig was loaded
    assert runs.read_text() == "3"


async def test_a_refused_exec_token_is_renewed_and_the_call_retried_once(tmp_path):
    """A token without expiry holds until the API server refuses it (401): then the plugin runs
    again and the call is retried once with the new token; calls refused together run it once."""
    user, runs = exec_user(tmp_path, "-")
    async with FakeAPIServer() as server:
        valid = {"Bearer token-1"}
        sent = serve_nodes(server, valid)
        api = await api_client(server.kubeconfig(tmp_path, user))
        try:
            core = client.CoreV1Api(api)
            await core.read_node("n")
            await core.read_node("n")
            assert sent == ["Bearer token-1"] * 2 and runs.read_text() == "1"  # no expiry: no renewal

            valid.clear()
            valid.add("Bearer token-2")  # e.g. revoked
            await core.read_node("n")
            assert sent[2:] == ["Bearer token-1", "Bearer token-2"]

            valid.clear()
            valid.add("Bearer token-3")  # a raw answer (the informer's calls) too
            body = await read_json(await core.list_node(_preload_content=False))
            assert body["kind"] == "NodeList" and sent[4:] == ["Bearer token-2", "Bearer token-3"]

            valid.clear()
            valid.add("Bearer token-4")
            await asyncio.gather(core.read_node("n"), core.read_node("n"))
            assert runs.read_text() == "4" and sent[-2:] == ["Bearer token-4"] * 2

            valid.clear()  # never accepted: the 401 stands after one retry
            del sent[:]
            with pytest.raises(ApiException) as refused:
                await core.read_node("n")
            assert refused.value.status == 401 and sent == ["Bearer token-4", "Bearer token-5"]
        finally:
            await api.close()


async def test_a_kubeconfig_that_does_not_exist_is_named():
    import pytest

    from dynpart.errors import DynpartError
    from dynpart.kube.client import api_client

    with pytest.raises(DynpartError, match=r"^cannot connect to Kubernetes with kubeconfig /no/such.yaml: no such file$"):
        await api_client("/no/such.yaml")


async def test_a_kubeconfig_that_is_not_one_is_a_one_line_error(tmp_path):
    """Malformed YAML, or a YAML list or string, made the client's loader raise a YAMLError or a
    TypeError: a traceback from `dynpart explain --kubeconfig` (helper h1's black-box run)."""
    import pytest

    from dynpart.errors import DynpartError
    from dynpart.kube.client import api_client

    bad = tmp_path / "kc.yaml"
    for text, message in (("garbage: [\n", f"kubeconfig {bad}:2:1: not valid YAML: expected the node content"),
                          ("[]\n", f"kubeconfig {bad}: not a kubeconfig (a YAML mapping of clusters, contexts and users)"),
                          ("x\n", f"kubeconfig {bad}: not a kubeconfig (a YAML mapping of clusters, contexts and users)")):
        bad.write_text(text)
        with pytest.raises(DynpartError) as e:
            await api_client(str(bad))
        assert str(e.value).startswith(f"cannot connect to Kubernetes with {message}")
        # (no Python error after it: "'str' object does not support item assignment", review 172)
        assert text == "garbage: [\n" or str(e.value) == f"cannot connect to Kubernetes with {message}"


async def test_a_kubeconfig_in_a_list_or_a_malformed_part_is_named(tmp_path):
    """Of a list of kubeconfigs ($KUBECONFIG's a:b), the one that is not a mapping is named; a
    mapping with a malformed part says so (review 173: both were "not a kubeconfig")."""
    import os

    import pytest

    from dynpart.errors import DynpartError
    from dynpart.kube.client import api_client

    bad, odd = tmp_path / "bad.yaml", tmp_path / "odd.yaml"
    bad.write_text("[]\n")
    odd.write_text("clusters: 5\n")
    for path, message in ((f"{odd}{os.pathsep}{bad}", f"{bad}: not a kubeconfig (a YAML mapping of clusters"),
                          (str(odd), "a part of it is malformed (")):
        with pytest.raises(DynpartError) as e:
            await api_client(path)
        assert str(e.value).startswith(f"cannot connect to Kubernetes with kubeconfig {path}: {message}")


async def test_a_kubeconfig_list_or_a_home_path_is_the_clients_to_read(tmp_path, monkeypatch):
    """$KUBECONFIG may list files (`a:b`) and a path may start with ~: one existing file is enough
    for the client, which merges them and expands ~ itself."""
    import os

    from dynpart.kube.client import api_client

    config = tmp_path / "kc.yaml"
    config.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster:\n"
                      "    server: https://127.0.0.1:6443\n    insecure-skip-tls-verify: true\ncontexts:\n- name: c\n"
                      "  context: {cluster: k, user: u}\nusers:\n- name: u\n  user: {token: t}\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (f"{tmp_path / 'absent.yaml'}{os.pathsep}{config}", "~/kc.yaml"):
        api = await api_client(value)
        assert api.configuration.host == "https://127.0.0.1:6443"
        await api.close()


async def test_a_kubeconfig_not_utf8_or_not_a_file_is_a_one_line_error(tmp_path):
    """A kubeconfig saved as UTF-16 (PowerShell's `kubectl config view > kc.yaml`) gave a
    UnicodeDecodeError traceback, and a directory was said not to exist (helper-148)."""
    import pytest

    from dynpart.errors import DynpartError
    from dynpart.kube.client import api_client

    utf16 = tmp_path / "kc.yaml"
    utf16.write_text("apiVersion: v1\nkind: Config\n", encoding="utf-16")
    with pytest.raises(DynpartError, match=rf"^cannot connect to Kubernetes with kubeconfig {utf16}: not UTF-8 text"):
        await api_client(str(utf16))
    with pytest.raises(DynpartError, match=rf"^cannot connect to Kubernetes with kubeconfig {tmp_path}: not a file$"):
        await api_client(str(tmp_path))
