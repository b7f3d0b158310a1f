"""Back-off through tenacity, with the knobs of KubeSettings."""

from __future__ import annotations

import pytest
from tenacity import AsyncRetrying, RetryCallState

from dynpart.kube.errors import APIServerError, APITransportError
from dynpart.kube.retrying import backoff, retrying
from dynpart.settings import KubeSettings


def waits(settings: KubeSettings, n: int) -> list[float]:
    wait = backoff(settings)
    out = []
    for attempt in range(1, n + 1):
        state = RetryCallState(AsyncRetrying(), None, (), {})
        state.attempt_number = attempt
        out.append(round(wait(state), 6))
    return out


def test_default_backoff_doubles_from_0_2_to_10_seconds():
    assert waits(KubeSettings(), 8) == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    assert waits(KubeSettings(backoff_initial_s=1, backoff_multiplier=3, backoff_max_s=5), 3) == [1, 3, 5]


async def test_retries_api_errors_until_success(caplog):
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise APITransportError("list nodes: connection refused")
        return "ok"

    fast = KubeSettings(backoff_initial_s=0.001, backoff_max_s=0.001)
    async for attempt in retrying(fast, "list nodes"):
        with attempt:
            result = await flaky()
    assert result == "ok" and len(calls) == 3
    assert sum("list nodes failed (list nodes: connection refused); retrying in" in r.message
               for r in caplog.records) == 2


async def test_other_errors_are_not_retried():
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await retrying(KubeSettings(backoff_initial_s=0.001), "x")(broken)
    assert calls == [1]
    with pytest.raises(APIServerError):  # retry_on narrows what is retried
        await retrying(KubeSettings(), "x", retry_on=KeyError)(_server_error)


async def _server_error() -> None:
    raise APIServerError("x: 500")
