"""Connecting: a kubeconfig (flag or $KUBECONFIG) or the in-cluster service account; reading the
JSON body of a call made with `_preload_content=False`. A write the API server throttles (429 with
a Retry-After) is sent again after that long, a few times, as client-go's REST client does."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import rest
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.errors import DynpartError, yaml_problem
from dynpart.kube.errors import APIError, api_errors, status_error
from dynpart.kube.retrying import retry_after
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)

_RENEW_TIMEOUT_S = 60.0  # an exec credential plugin's run

Obj = dict[str, Any]  # a Kubernetes object as the API serves it (JSON)


async def api_client(kubeconfig: str | None = None, settings: KubeSettings | None = None) -> client.ApiClient:
    """A client whose every call has a time bound (`request_timeout`): kubernetes-asyncio's
    default is to wait for ever, so a hung call would hold a lease renewal or a watch for good."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    credentials = None
    if path and not any(os.path.isfile(os.path.expanduser(p)) for p in path.split(os.pathsep) if p):
        # else the client says "Invalid kube-config file. Expected key current-context" (a list of
        # files, as $KUBECONFIG may hold, and ~ are the client's to read: one file must exist)
        exists = any(os.path.exists(os.path.expanduser(p)) for p in path.split(os.pathsep) if p)
        raise DynpartError(f"cannot connect to Kubernetes with kubeconfig {path}: "
                           f"{'not a file' if exists else 'no such file'}")
    try:
        if path:
            cfg = client.Configuration()
            try:
                loader = await config.load_kube_config(config_file=path, client_configuration=cfg)
            except yaml.YAMLError as e:
                raise DynpartError(f"cannot connect to Kubernetes with kubeconfig {yaml_problem(path, e)}") from None
            except UnicodeDecodeError as e:  # (a kubeconfig saved as UTF-16 by PowerShell's `>`, say)
                raise DynpartError(f"cannot connect to Kubernetes with kubeconfig {path}: not UTF-8 text "
                                   f"({e.reason} at byte {e.start})") from None
            except (TypeError, AttributeError) as e:  # the loader indexes what it reads as mappings
                raise DynpartError(f"cannot connect to Kubernetes with kubeconfig {path}: {_not_a_kubeconfig(path, e)}"
                                   ) from None
            credentials = _Credentials.of(loader, cfg)
            api = client.ApiClient(configuration=cfg)
        else:
            # the service account's token file is read again every minute (the loader's hook)
            config.load_incluster_config()  # type: ignore[no-untyped-call]  # kubernetes-asyncio leaves it unannotated
            api = client.ApiClient()
    except (config.ConfigException, OSError) as e:
        where = f"kubeconfig {path}" if path else "the in-cluster service account (no --kubeconfig, no $KUBECONFIG)"
        raise DynpartError(f"cannot connect to Kubernetes with {where}: {e}") from None
    await api.rest_client.close()  # replaced by one that bounds every call
    api.rest_client = _BoundedRestClient(api.configuration, settings or KubeSettings(), credentials)
    return api


class _Credentials:
    """A kubeconfig user's token from an exec credential plugin (EKS, GKE, AKS kubeconfigs), or
    from a gcp or oidc auth provider: it expires, and kubernetes-asyncio's loader reads it once.
    Before each call the loader runs again when the token expired (it returns at once while the
    token is valid: the plugin's expirationTimestamp, less 5 minutes); after a 401 the plugin runs
    again (a token without an expiry, or refused before it), and the call is retried once with
    the new token, as client-go does."""

    def __init__(self, loader: Any, cfg: client.Configuration):
        self._loader, self._cfg = loader, cfg
        self._lock = asyncio.Lock()
        # the loader's user (kubernetes-asyncio's own refresh_token reads it so)
        self._exec = "exec" in (loader._user or {})

    @classmethod
    def of(cls, loader: Any, cfg: client.Configuration) -> _Credentials | None:
        """The credentials of `cfg`, when they may need renewing; they renew before each call."""
        if loader.provider not in ("gcp", "oidc") and "exec" not in (loader._user or {}):
            return None  # a static token, a client certificate, a password
        credentials = cls(loader, cfg)
        cfg.refresh_api_key_hook = credentials._before_call  # awaited before each call
        return credentials

    async def _before_call(self, cfg: client.Configuration) -> None:
        if self._exec and not hasattr(self._loader, "exec_plugin_expiry"):
            return  # no expiry: the token holds until a 401
        async with self._lock:
            await self._load(cfg)

    async def _load(self, cfg: client.Configuration) -> None:
        """Run the loader (when its token expired) and take its token; on failure keep the old one
        (the API server answers 401, which callers handle)."""
        try:
            # what load_kube_config ran; a plugin that never returns (an interactive login) must
            # not hold every call for good
            async with asyncio.timeout(_RENEW_TIMEOUT_S):
                await self._loader._load_authentication()
        except Exception as e:
            log.warning("cannot renew the Kubernetes credentials: %s", str(e) or type(e).__name__)
            return
        token = getattr(self._loader, "token", None)
        if token:
            cfg.api_key["BearerToken"] = token

    async def after_401(self, sent: str | None) -> str | None:
        """The Authorization to retry a call the API server refused (401) with `sent`; None: none
        newer (the call's 401 stands)."""
        async with self._lock:
            current = self._cfg.api_key.get("BearerToken")
            if current == sent and self._exec:
                if hasattr(self._loader, "exec_plugin_expiry"):
                    del self._loader.exec_plugin_expiry  # the plugin runs again
                await self._load(self._cfg)
                current = self._cfg.api_key.get("BearerToken")
        return str(current) if current and current != sent else None


def request_timeout(query_params: object, settings: KubeSettings) -> aiohttp.ClientTimeout:
    """The time bound of one call: a whole call `request_timeout_s`; a watch (a stream the server
    ends after its `timeoutSeconds`) is dropped when nothing arrives for `watch_idle_timeout_s`
    (a healthy watch that asks for bookmarks receives one about every minute), so a half-open
    connection cannot leave a cache stale for long."""
    # the client passes a list of pairs (its stubs say a dict): read both
    params = dict(query_params) if isinstance(query_params, list | tuple | dict) else {}
    if params.get("watch") in (True, "true", "True"):
        connect = settings.request_timeout_s
        return aiohttp.ClientTimeout(connect=connect, sock_connect=connect, sock_read=settings.watch_idle_timeout_s)
    return aiohttp.ClientTimeout(total=settings.request_timeout_s)


# A write answered 429 Too Many Requests (API Priority and Fairness turned it away: it was not
# applied) with a Retry-After is sent again after that long (up to a third more, at random, so that
# the writers throttled together do not come back together), at most this many times; then the 429
# is the caller's. A longer Retry-After than the most is not waited for here: the caller's own loop
# comes back later. Reads are not retried here: the informer waits out a Retry-After itself.
THROTTLED_WRITE_RETRIES = 3
THROTTLED_WRITE_WAIT_MAX_S = 10.0
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# False inside `throttled_writes_not_retried()`
_retry_throttled: contextvars.ContextVar[bool] = contextvars.ContextVar("retry_throttled", default=True)


@contextmanager
def throttled_writes_not_retried() -> Iterator[None]:
    """A write inside is not sent again after a 429 (an Event: advice, dropped rather than sent
    again to an API server that sheds load)."""
    token = _retry_throttled.set(False)
    try:
        yield
    finally:
        _retry_throttled.reset(token)


class _BoundedRestClient(rest.RESTClientObject):
    """kubernetes-asyncio's REST client with a default time bound on every call, which sends a
    throttled write again (THROTTLED_WRITE_RETRIES)."""

    def __init__(self, configuration: client.Configuration, settings: KubeSettings,
                 credentials: _Credentials | None = None):
        super().__init__(configuration)
        self._settings = settings
        self._credentials = credentials
        self._rng = random.Random()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the waits after a 429 (tests record them)

    async def request(self, method: str, url: str, query_params: dict[str, Any] | None = None,
                      headers: dict[str, Any] | None = None, body: object = None,
                      post_params: dict[str, Any] | None = None, _preload_content: bool = True,
                      _request_timeout: float | tuple[float] | aiohttp.ClientTimeout | None = None) -> object:
        if _request_timeout is None:
            _request_timeout = request_timeout(query_params, self._settings)
        retries = THROTTLED_WRITE_RETRIES if method.upper() in _WRITES and _retry_throttled.get() else 0
        for retry in range(retries, -1, -1):
            try:
                r = await self._authorized(method, url, query_params, headers, body, post_params, _preload_content,
                                           _request_timeout)
            except ApiException as e:  # a preloaded answer's error status
                wait = self._throttled(e.status, e.headers) if retry else None
                if wait is None:
                    raise
            else:
                wait = self._throttled(getattr(r, "status", None), getattr(r, "headers", None)) if retry else None
                if wait is None:
                    return r
                cast(aiohttp.ClientResponse, r).release()
            log.info("%s %s: throttled (429); sending it again in %.1fs", method.upper(), url.split("?")[0], wait)
            await self.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def _throttled(self, status: int | None, headers: Any) -> float | None:
        """The wait before sending a write again after this answer; None: not again."""
        if status != 429 or headers is None:
            return None
        asked = retry_after(headers.get("Retry-After"))
        if asked is None or asked > THROTTLED_WRITE_WAIT_MAX_S:
            return None
        return asked * (1 + self._rng.random() / 3)

    async def _authorized(self, method: str, url: str, query_params: dict[str, Any] | None,
                          headers: dict[str, Any] | None, body: object, post_params: dict[str, Any] | None,
                          _preload_content: bool, _request_timeout: float | tuple[float] | aiohttp.ClientTimeout) -> object:
        for retry in (True, False):  # a 401 is retried once, with renewed credentials
            try:
                r = await super().request(method, url, query_params=query_params, headers=headers, body=body,
                                          post_params=post_params, _preload_content=_preload_content,
                                          _request_timeout=_request_timeout)
            except ApiException as e:  # a preloaded answer's error status
                if not (retry and e.status == 401 and await self._renewed(headers)):
                    raise
                continue
            status = getattr(r, "status", None)  # a raw answer's
            if not (retry and not _preload_content and status == 401 and await self._renewed(headers)):
                return r
            cast(aiohttp.ClientResponse, r).release()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _renewed(self, headers: dict[str, Any] | None) -> bool:
        """After a 401: put renewed credentials in `headers`; False when there are none."""
        if self._credentials is None or headers is None:
            return False
        fresh = await self._credentials.after_401(headers.get("authorization"))
        if fresh is None:
            return False
        headers["authorization"] = fresh
        return True


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


def _not_a_kubeconfig(path: str, error: Exception) -> str:
    """What is wrong with a kubeconfig the loader failed on with a TypeError: a file that is not a
    mapping (a YAML list or string: the loader's own error is Python's, no help), named where
    `path` lists several (as $KUBECONFIG may, `~` expanded), or a part of one."""
    files = [p for p in path.split(os.pathsep) if p]
    for name in files:
        try:
            doc = yaml.safe_load(Path(os.path.expanduser(name)).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # (the loader skips a file that is not there)
        if not isinstance(doc, dict):
            where = f"{name}: " if len(files) > 1 else ""
            return f"{where}not a kubeconfig (a YAML mapping of clusters, contexts and users)"
    return f"a part of it is malformed ({error})"
