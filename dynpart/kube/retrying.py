"""Retrying with exponential back-off, through tenacity. The knobs are `KubeSettings`' (initial
wait, multiplier, longest wait); every loop that talks to the API server backs off this way.

    async for attempt in retrying(settings, "list nodes"):
        with attempt:
            body = await list_nodes()
"""

from __future__ import annotations

import logging

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_never, wait_exponential

from dynpart.kube.errors import APIError
from dynpart.settings import KubeSettings

log = logging.getLogger(__name__)


def backoff(settings: KubeSettings) -> wait_exponential:
    """Waits of initial, initial*multiplier, initial*multiplier**2, ... up to max seconds."""
    return wait_exponential(multiplier=settings.backoff_initial_s, exp_base=settings.backoff_multiplier,
                            max=settings.backoff_max_s)


def retrying(settings: KubeSettings, what: str, *,
             retry_on: type[BaseException] | tuple[type[BaseException], ...] = APIError,
             logger: logging.Logger = log) -> AsyncRetrying:
    """Attempts until one succeeds or fails with an exception not in `retry_on` (re-raised as is),
    backing off in between; each failure is logged as a warning naming `what`. Never gives up:
    the callers are loops that must outlive an API server's restart; cancelling stops them."""

    def warn(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s failed (%s); retrying in %.1fs", what, error, wait)

    return AsyncRetrying(wait=backoff(settings), retry=retry_if_exception_type(retry_on), stop=stop_never,
                         before_sleep=warn, reraise=True)
