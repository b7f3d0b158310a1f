"""Back-off through tenacity, with the knobs of KubeSettings."""

from __future__ import annotations

import email.utils
import random
import time

import pytest
from tenacity import AsyncRetrying, RetryCallState

from dynpart.kube.errors import APIServerError, APITransportError
from dynpart.kube.retrying import RETRY_AFTER_MAX_S, Backoff, backoff, retry_after, retrying
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


def test_retried_calls_back_off_with_jitter():
    """`retrying()` jitters as the informer does: each wait between half and all of the nominal one,
    so that a thousand agents failing together (an API server's restart) do not retry in lockstep;
    a seeded rng draws the same waits again (tests)."""
    settings = KubeSettings(backoff_initial_s=1, backoff_multiplier=2, backoff_max_s=8)

    def drawn(rng: random.Random | None) -> list[float]:
        wait = retrying(settings, "x", rng=rng).wait
        out = []
        for attempt in range(1, 7):
            state = RetryCallState(AsyncRetrying(), None, (), {})
            state.attempt_number = attempt
            out.append(wait(state))
        return out

    got = drawn(random.Random(5))
    for wait, nominal in zip(got, [1, 2, 4, 8, 8, 8], strict=True):
        assert nominal / 2 <= wait <= nominal, got
    assert len(set(got)) == len(got)  # the waits at the longest are not all the same either
    assert drawn(random.Random(5)) == got and drawn(random.Random(6)) != got
    assert drawn(None) != drawn(None)  # unseeded: two agents do not draw the same waits


def test_backoff_of_a_loop_doubles_with_jitter_and_starts_again_after_a_healthy_run():
    """The informer's waits (client-go's Reflector back-off): each failure in a row doubles the wait,
    drawn between half and all of it; a failure after reset_after_s without one starts again from
    the first wait; a Retry-After is waited out (up to a minute)."""
    now = [0.0]
    b = Backoff(KubeSettings(backoff_initial_s=1, backoff_multiplier=2, backoff_max_s=8), reset_after_s=120,
                rng=random.Random(3), clock=lambda: now[0])
    got = []
    for _ in range(6):
        got.append(b.next())
        now[0] += 10  # failing again 10 s later: still failing
    for wait, nominal in zip(got, [1, 2, 4, 8, 8, 8], strict=True):
        assert nominal / 2 <= wait <= nominal, got
    assert len(set(got)) == len(got)
    now[0] += 120  # two minutes without a failure
    assert 0.5 <= b.next() <= 1
    assert 1 <= b.next() <= 2
    assert b.next(retry_after=30) == 30
    assert b.next(retry_after=3600) == RETRY_AFTER_MAX_S == 60


def test_retry_after_reads_seconds_and_dates():
    assert retry_after("5") == 5 and retry_after("0") == 0 and retry_after(None) is None
    assert retry_after("soon") is None
    in_a_minute = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 55 <= (retry_after(in_a_minute) or 0) <= 61
