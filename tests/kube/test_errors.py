"""One class per kind of API failure, decided once from the status."""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from dynpart.errors import DynpartError
from dynpart.kube.client import read_json
from dynpart.kube.errors import (
    APIClientError,
    APIConflictError,
    APIError,
    APIForbiddenError,
    APIGoneError,
    APINotFoundError,
    APIServerError,
    APITransportError,
    APIUnauthorizedError,
    api_error,
    api_errors,
)

from .fakes import FakeResponse


@pytest.mark.parametrize(("status", "cls"), [
    (401, APIUnauthorizedError), (403, APIForbiddenError), (404, APINotFoundError), (409, APIConflictError),
    (410, APIGoneError), (422, APIClientError), (500, APIServerError), (503, APIServerError),
])
def test_status_decides_the_class(status, cls):
    e = api_error(ApiException(status=status, reason="Why"), "patch node n1")
    assert type(e) is cls and isinstance(e, APIError) and isinstance(e, DynpartError)
    assert e.status == status and str(e) == f"patch node n1: {status} Why"


@pytest.mark.parametrize("raised", [aiohttp.ClientConnectionError("refused"), TimeoutError(),
                                    ConnectionResetError("reset")])
def test_no_answer_is_a_transport_error(raised):
    e = api_error(raised, "list nodes")
    assert type(e) is APITransportError and e.status is None and str(e).startswith("list nodes: ")


def test_api_errors_raises_the_class_and_keeps_the_cause():
    cause = ApiException(status=409, reason="Conflict")
    with pytest.raises(APIConflictError) as info, api_errors("update lease ns/l"):
        raise cause
    assert info.value.__cause__ is cause
    with pytest.raises(ValueError), api_errors("x"):  # not an API failure: left alone
        raise ValueError("bug")


async def test_read_json_raises_for_an_error_status():
    assert await read_json(FakeResponse(200, {"items": []})) == {"items": []}
    with pytest.raises(APIConflictError, match="PATCH /api/v1/nodes/n1: 409 Conflict"):
        await read_json(FakeResponse(409, {"kind": "Status"}, reason="Conflict", method="PATCH",
                                     path="/api/v1/nodes/n1"))
    with pytest.raises(APINotFoundError, match="read lease a/b: 404"):
        await read_json(FakeResponse(404, {}, reason="Not Found"), "read lease a/b")
    with pytest.raises(APIError, match="not JSON"):
        await read_json(FakeResponse(200, b"<html>"))
