"""Counting the HTTP requests a kubernetes-asyncio client sends to the API server, on the client side.

What is counted: every call of the client's `RESTClientObject.request`, i.e. one HTTP request per
API call (a get, a list, a patch, an Event's create, a Lease renewal, and a watch once, when it is
opened: the events it streams are not requests). Nothing else in the process talks to the API
server (the client sends no request of its own: no discovery, no retries), so for a dynpart
component this is exactly the requests the API server receives from it. Requests are keyed
"<verb> <resource>" (`patch nodes`, `watch pods`, `create events`, `get leases`, ...).

- In-process (the e2e harness's agents): `RequestCounter().install(api)` wraps one ApiClient.
- The planner subprocess: `python -m tests.e2e.apicount planner run ...` is `dynpart planner run`
  with every client of the process counted into the Prometheus counter `e2e_api_requests_total`
  (labels verb, resource), which the planner's own /metrics server then shows. Nothing else
  changes: the same `dynpart.cli.main`, the same settings. This module imports nothing heavy, so
  the planner's memory is its own."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

METRIC = "e2e_api_requests_total"


def request_kind(method: str, url: str, query_params: Any = None) -> tuple[str, str]:
    """(verb, resource) of one request, as the API server's audit log would name them: verbs get,
    list, watch, create, update, patch, delete; resource with its subresource (`nodes/status`)."""
    params = dict(query_params) if isinstance(query_params, list | tuple | dict) else {}
    parts = [p for p in urlsplit(url).path.split("/") if p]
    # /api/v1/... or /apis/<group>/<version>/...
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else parts
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    resource = "/".join([rest[0], *rest[2:3]]) if rest else "-"
    named = len(rest) >= 2
    verb = method.lower()
    if verb == "get":
        verb = "watch" if str(params.get("watch", "")).lower() == "true" else "get" if named else "list"
    elif verb == "put":
        verb = "update"
    return verb, resource


class RequestCounter:
    """Requests of the clients it is installed on, by (verb, resource)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def install(self, api: Any) -> None:
        """Count every request of this ApiClient (its REST client's `request`)."""
        rest = api.rest_client
        inner: Callable[..., Any] = rest.request

        async def request(method: str, url: str, query_params: Any = None, *args: Any, **kw: Any) -> Any:
            self.counts[request_kind(method, url, query_params)] += 1
            return await inner(method, url, query_params, *args, **kw)

        rest.request = request


def counted_main(argv: list[str]) -> int:
    """`dynpart <argv>` with every kubernetes-asyncio request counted into `e2e_api_requests_total`."""
    from kubernetes_asyncio.client import rest
    from prometheus_client import Counter as PromCounter

    requests = PromCounter(METRIC, "HTTP requests sent to the API server (e2e: counted on the client side)",
                           ["verb", "resource"])
    inner = rest.RESTClientObject.request

    async def request(self: Any, method: str, url: str, query_params: Any = None, *args: Any, **kw: Any) -> Any:
        requests.labels(*request_kind(method, url, query_params)).inc()
        return await inner(self, method, url, query_params, *args, **kw)

    rest.RESTClientObject.request = request  # type: ignore[method-assign]

    from dynpart.cli import main
    return main(argv)


if __name__ == "__main__":
    sys.exit(counted_main(sys.argv[1:]))
