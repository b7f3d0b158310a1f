"""Connecting: a kubeconfig (flag or $KUBECONFIG) or the in-cluster service account."""

from __future__ import annotations

import os

from kubernetes_asyncio import client, config

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
