"""Retrying with exponential back-off, through tenacity. The knobs are `KubeSettings`' (initial
wait, multiplier, longest wait); every loop that talks to the API server backs off this way, each
wait drawn at random between half and all of it ("equal jitter"): after an API server's restart
the agents of a thousand nodes, failing together, must not come back together.

    async for attempt in retrying(settings, "list nodes"):
        with attempt:
            body = await list_nodes()

A loop with no one call to retry (the informer's list and watch) takes its waits from `Backoff`.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_never, wait_exponential
from tenacity.wait import wait_base

from dynpart.kube.errors import APIError
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)


def backoff(settings: KubeSettings) -> wait_exponential:
    """Waits of initial, initial*multiplier, initial*multiplier**2, ... up to max seconds."""
    return wait_exponential(multiplier=settings.backoff_initial_s, exp_base=settings.backoff_multiplier,
                            max=settings.backoff_max_s)


class Jittered(wait_base):
    """`backoff(settings)`, each wait drawn between half and all of it from `rng` (a seeded one in
    tests). client-go's jitter adds up to as much again instead; this keeps `backoff_max_s` the
    longest wait, as documented."""

    def __init__(self, settings: KubeSettings, rng: random.Random | None = None):
        self._wait = backoff(settings)
        self._rng = rng or random.Random()

    def __call__(self, retry_state: RetryCallState) -> float:
        return self._wait(retry_state) * (0.5 + 0.5 * self._rng.random())


def retrying(settings: KubeSettings, what: str, *,
             retry_on: type[BaseException] | tuple[type[BaseException], ...] = APIError,
             logger: logging.Logger = log, rng: random.Random | None = None) -> AsyncRetrying:
    """Attempts until one succeeds or fails with an exception not in `retry_on` (re-raised as is),
    backing off in between (`Jittered`, drawn from `rng`); each failure is logged as a warning
    naming `what`. Never gives up: the callers are loops that must outlive an API server's
    restart; cancelling stops them."""

    def warn(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s failed (%s); retrying in %.1fs", what, error, wait)

    return AsyncRetrying(wait=Jittered(settings, rng), retry=retry_if_exception_type(retry_on), stop=stop_never,
                         before_sleep=warn, reraise=True)


class Backoff:
    """The waits of a loop that never gives up and retries no one call (an informer's list and
    watch), as client-go's Reflector waits between its ListAndWatch runs: `Jittered(settings)` after
    each failure in a row, back to the first wait once `reset_after_s` passed without a failure (a
    healthy run), and never less than the API server's Retry-After."""

    def __init__(self, settings: KubeSettings, *, reset_after_s: float, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._wait = Jittered(settings, rng)
        self._state = RetryCallState(AsyncRetrying(), None, (), {})  # its attempt_number: failures in a row
        self._reset_after_s = reset_after_s
        self._clock = clock
        self._last_failure: float | None = None

    def next(self, retry_after: float | None = None) -> float:
        """The wait after one more failure; `retry_after`: what the API server asked for."""
        now = self._clock()
        if self._last_failure is not None and now - self._last_failure >= self._reset_after_s:
            self._state.attempt_number = 1
        elif self._last_failure is not None:
            self._state.attempt_number += 1
        self._last_failure = now
        wait = self._wait(self._state)
        return max(wait, min(retry_after or 0.0, RETRY_AFTER_MAX_S))


RETRY_AFTER_MAX_S = 60.0  # a longer Retry-After is taken as this: a wrong one must not stop a watch for long


def retry_after(value: str | None) -> float | None:
    """A Retry-After header (seconds, or an HTTP date) in seconds from now; None: none or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
