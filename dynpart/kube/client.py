"""Connecting: a kubeconfig (flag or $KUBECONFIG) or the in-cluster service account; reading the
JSON body of a call made with `_preload_content=False`."""

from __future__ import annotations

import json
import os
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client, config

from dynpart.errors import DynpartError
from dynpart.kube.errors import APIError, api_errors, status_error

Obj = dict[str, Any]  # a Kubernetes object as the API serves it (JSON)


async def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            cfg = client.Configuration()
            await config.load_kube_config(config_file=path, client_configuration=cfg)
            return client.ApiClient(configuration=cfg)
        config.load_incluster_config()  # type: ignore[no-untyped-call]  # kubernetes-asyncio leaves it unannotated
        return client.ApiClient()
    except (config.ConfigException, OSError) as e:
        where = f"kubeconfig {path}" if path else "the in-cluster service account (no --kubeconfig, no $KUBECONFIG)"
        raise DynpartError(f"cannot connect to Kubernetes with {where}: {e}") from None


def raw_api(api: object) -> Any:
    """`api` (a kubernetes-asyncio API object) for the calls its stubs describe wrongly: they omit
    `_content_type`, which the client accepts, and want model objects where it takes dicts."""
    return api


async def read_json(resp: object, what: str | None = None) -> Obj:
    """The body of a call made with `_preload_content=False`, decoded. The client raises for an
    error status only when it preloads the body; this raises the `APIError` class here too (a
    404 or a 409 Conflict must not read as the object). `what` names the call in the message
    (default: the method and path)."""
    # The client's stubs type every call as returning its model; with `_preload_content=False`
    # it returns the raw aiohttp response.
    raw = cast(aiohttp.ClientResponse, resp)
    what = what or f"{raw.method} {raw.url.path}"
    with api_errors(what):
        body = await raw.read()
    if not 200 <= raw.status <= 299:
        raise status_error(raw.status, raw.reason, what)
    try:
        decoded = json.loads(body)
    except ValueError as e:
        raise APIError(f"{what}: the answer is not JSON: {e}", status=raw.status) from None
    if not isinstance(decoded, dict):
        raise APIError(f"{what}: the answer is not a JSON object", status=raw.status)
    return decoded
