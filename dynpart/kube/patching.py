"""Patching node annotations: a JSON merge patch that carries the resourceVersion the change was
computed from, so a concurrent writer's change is never overwritten (the API server answers
409 Conflict and the caller re-reads)."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.kube.client import read_json


class Conflict(Exception):
    """The object changed since it was read."""


async def patch_node_annotations(core: client.CoreV1Api, name: str, annotations: dict[str, str | None],
                                 resource_version: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"annotations": annotations}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    try:
        resp = await core.patch_node(name, {"metadata": metadata}, _content_type="application/merge-patch+json",
                                     _preload_content=False)
        return await read_json(resp)
    except ApiException as e:
        if e.status == 409:
            raise Conflict(f"node {name} changed since resourceVersion {resource_version}") from None
        raise


async def patch_node_labels(core: client.CoreV1Api, name: str, labels: dict[str, str | None]) -> None:
    await core.patch_node(name, {"metadata": {"labels": labels}}, _content_type="application/merge-patch+json")
