"""Patching node metadata with JSON merge patches. An annotation patch carries the
resourceVersion the change was computed from, so a concurrent writer's change is never
overwritten: the API server answers 409 and this raises `APIConflictError` (the caller re-reads)."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from dynpart.kube.client import Obj, raw_api, read_json
from dynpart.kube.errors import api_errors

MERGE_PATCH = "application/merge-patch+json"

async def patch_node_annotations(core: client.CoreV1Api, name: str, annotations: dict[str, str | None],
                                 resource_version: str | None = None) -> Obj:
    """The node as patched. A None value removes the key."""
    metadata: dict[str, Any] = {"annotations": annotations}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    what = f"patch node {name}" + (f" at resourceVersion {resource_version}" if resource_version else "")
    with api_errors(what):
        resp = await raw_api(core).patch_node(name, {"metadata": metadata}, _content_type=MERGE_PATCH,
                                              _preload_content=False)
    return await read_json(resp, what)


async def read_node(core: client.CoreV1Api, name: str, any_version: bool = False) -> Obj:
    """The node as the API server has it now (not an informer's cache): a quorum read from etcd.
    `any_version`: as the API server's watch cache has it (`resourceVersion=0`, which the client's
    `read_node` does not offer; the kubelet's first read of its Node is one), served without
    reaching etcd, and possibly a little behind."""
    what = f"read node {name}" + (" (any version)" if any_version else "")
    with api_errors(what):
        if any_version:
            api = raw_api(core).api_client
            resp = await api.call_api(
                "/api/v1/nodes/{name}", "GET", {"name": name}, [("resourceVersion", "0")],
                {"Accept": api.select_header_accept(["application/json"])}, auth_settings=["BearerToken"],
                response_types_map={200: "V1Node"}, _preload_content=False)
        else:
            resp = await raw_api(core).read_node(name, _preload_content=False)
    return await read_json(resp, what)
