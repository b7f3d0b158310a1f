"""Errors of Kubernetes API calls, one class per kind of failure (kopf's `clients/errors.py`).

The HTTP status is turned into a class once, here; callers catch classes and never test numbers:

    try:
        await patch_node_annotations(core, name, patch, resource_version)
    except APIConflictError:
        ...  # re-read and re-plan

Every class is a `DynpartError`, so an API failure that reaches the CLI is one line, not a
traceback. `api_errors(what)` wraps calls made with the kubernetes-asyncio client;
`api_error(e, what)` turns one exception into its class."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.errors import DynpartError


class APIError(DynpartError):
    """A Kubernetes API call failed. `status` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason


class APITransportError(APIError):
    """No answer: the connection failed or broke, or the call timed out."""


class APIClientError(APIError):
    """The API server refused the request (4xx)."""


class APIUnauthorizedError(APIClientError):
    """401: the credentials were not accepted."""


class APIForbiddenError(APIClientError):
    """403: RBAC does not allow the call."""


class APINotFoundError(APIClientError):
    """404: no such object."""


class APIConflictError(APIClientError):
    """409: the object changed since it was read (a stale resourceVersion), or already exists."""


class APIGoneError(APIClientError):
    """410: a watch's resourceVersion is too old; list again."""


class APIServerError(APIError):
    """5xx: the API server failed."""


_BY_STATUS: dict[int, type[APIClientError]] = {
    401: APIUnauthorizedError, 403: APIForbiddenError, 404: APINotFoundError, 409: APIConflictError,
    410: APIGoneError,
}

# What a call through kubernetes-asyncio raises when the API server gives no answer.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


def status_error(status: int, reason: str | None, what: str) -> APIError:
    """The class for an HTTP error status."""
    message = f"{what}: {status} {reason}" if reason else f"{what}: {status}"
    cls: type[APIError]
    if status in _BY_STATUS:
        cls = _BY_STATUS[status]
    elif 400 <= status <= 499:
        cls = APIClientError
    elif status >= 500:
        cls = APIServerError
    else:
        cls = APIError
    return cls(message, status=status, reason=reason)


def api_error(e: BaseException, what: str) -> APIError:
    """`e`, raised by an API call described by `what` ("patch node gpu-1"), as its class."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ApiException):
        return status_error(e.status, e.reason, what)
    return APITransportError(f"{what}: {str(e) or type(e).__name__}")


@contextmanager
def api_errors(what: str) -> Iterator[None]:
    """Raise the failures of the API calls inside as `APIError` classes (the cause attached)."""
    try:
        yield
    except (ApiException, *TRANSPORT_ERRORS) as e:
        raise api_error(e, what) from e
