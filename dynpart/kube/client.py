"""Connecting: a kubeconfig (flag or $KUBECONFIG) or the in-cluster service account."""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.errors import DynpartError


async def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            cfg = client.Configuration()
            await config.load_kube_config(config_file=path, client_configuration=cfg)
            return client.ApiClient(configuration=cfg)
        config.load_incluster_config()
        return client.ApiClient()
    except (config.ConfigException, OSError) as e:
        where = f"kubeconfig {path}" if path else "the in-cluster service account (no --kubeconfig, no $KUBECONFIG)"
        raise DynpartError(f"cannot connect to Kubernetes with {where}: {e}") from None


async def read_json(resp: Any) -> Any:
    """The body of a call made with `_preload_content=False`, decoded. The client raises
    ApiException for an error status only when it preloads the body; this does it here too
    (a 404 or a 409 Conflict must not read as the object)."""
    body = await resp.read()
    if not 200 <= resp.status <= 299:
        e = ApiException(status=resp.status, reason=resp.reason)
        e.body = body.decode(errors="replace")
        raise e
    return json.loads(body)
