"""Raw calls to the e2e cluster's API server for the tests that check what it admits (RBAC,
admission policies): the HTTP status and the decoded body, or the Status message of a refusal,
never an exception; and a wait for a policy to take effect."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

import pytest


class Endpoint(Protocol):
    server: str
    token: str | None
    opener: urllib.request.OpenerDirector


def api_call(to: Endpoint, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> tuple[int, Any]:
    """(HTTP status, decoded body or the Status message of an error)."""
    req = urllib.request.Request(to.server + path, method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Accept", "application/json")
    if body is not None:
        req.add_header("Content-Type", content_type)
    if to.token:
        req.add_header("Authorization", f"Bearer {to.token}")
    try:
        with to.opener.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text).get("message", text)
        except ValueError:
            return e.code, text


def rendered_policy(release: str, namespace: str, policy: str, *values: str) -> list[dict[str, Any]]:
    """The chart's ValidatingAdmissionPolicy `policy` and its binding, rendered with `values`
    (`--set` pairs) that turn every other policy off."""
    from tests.e2e.test_chart_dry_run import render

    objects = [o for o in render(release, namespace, *values) if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ValidatingAdmissionPolicy", policy), ("ValidatingAdmissionPolicyBinding", policy)]
    return objects


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 60) -> None:
    """RBAC, admission policies and bindings reach the API server's caches asynchronously."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not in effect after {timeout_s:.0f}s")
        time.sleep(0.3)
