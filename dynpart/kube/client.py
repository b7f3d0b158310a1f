"""Connecting: a kubeconfig (flag or $KUBECONFIG) or the in-cluster service account; reading the
JSON body of a call made with `_preload_content=False`."""

from __future__ import annotations

import json
import os
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import rest

from dynpart.errors import DynpartError
from dynpart.kube.errors import APIError, api_errors, status_error
from dynpart.settings import KubeSettings

Obj = dict[str, Any]  # a Kubernetes object as the API serves it (JSON)


async def api_client(kubeconfig: str | None = None, settings: KubeSettings | None = None) -> client.ApiClient:
    """A client whose every call has a time bound (`request_timeout`): kubernetes-asyncio's
    default is to wait for ever, so a hung call would hold a lease renewal or a watch for good."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            cfg = client.Configuration()
            await config.load_kube_config(config_file=path, client_configuration=cfg)
            api = client.ApiClient(configuration=cfg)
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]  # kubernetes-asyncio leaves it unannotated
            api = client.ApiClient()
    except (config.ConfigException, OSError) as e:
        where = f"kubeconfig {path}" if path else "the in-cluster service account (no --kubeconfig, no $KUBECONFIG)"
        raise DynpartError(f"cannot connect to Kubernetes with {where}: {e}") from None
    await api.rest_client.close()  # replaced by one that bounds every call
    api.rest_client = _BoundedRestClient(api.configuration, settings or KubeSettings())
    return api


def request_timeout(query_params: object, settings: KubeSettings) -> aiohttp.ClientTimeout:
    """The time bound of one call: a whole call `request_timeout_s`; a watch (a stream the server
    ends after its `timeoutSeconds`) is dropped when nothing arrives for `watch_idle_timeout_s`
    past the renewal time, so a half-open connection cannot leave a cache stale for ever."""
    # the client passes a list of pairs (its stubs say a dict): read both
    params = dict(query_params) if isinstance(query_params, list | tuple | dict) else {}
    if params.get("watch") in (True, "true", "True"):
        connect = settings.request_timeout_s
        return aiohttp.ClientTimeout(connect=connect, sock_connect=connect,
                                     sock_read=settings.watch_timeout_s + settings.watch_idle_timeout_s)
    return aiohttp.ClientTimeout(total=settings.request_timeout_s)


class _BoundedRestClient(rest.RESTClientObject):
    """kubernetes-asyncio's REST client with a default time bound on every call."""

    def __init__(self, configuration: client.Configuration, settings: KubeSettings):
        super().__init__(configuration)
        self._settings = settings

    async def request(self, method: str, url: str, query_params: dict[str, Any] | None = None,
                      headers: dict[str, Any] | None = None, body: object = None,
                      post_params: dict[str, Any] | None = None, _preload_content: bool = True,
                      _request_timeout: float | tuple[float] | aiohttp.ClientTimeout | None = None) -> object:
        if _request_timeout is None:
            _request_timeout = request_timeout(query_params, self._settings)
        return await super().request(method, url, query_params=query_params, headers=headers, body=body,
                                     post_params=post_params, _preload_content=_preload_content,
                                     _request_timeout=_request_timeout)


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
