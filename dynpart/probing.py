"""Liveness that means something: `/healthz` fails when a loop that must keep turning (the
planner's planning loop, a watch, the agent's reconcile loop) has not beaten for longer than
it may, so the kubelet restarts a component whose watch or loop is stuck. `/metrics` alone
answers from another thread and says nothing about the event loop.

Beats are written on the event loop and read by the HTTP server's thread: a float per name,
replaced whole, needs no lock. An event loop blocked by a long computation stops beating too,
which is what liveness is for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class Liveness:
    """Named heartbeats, each with the longest silence it may keep."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._max_age: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def expect(self, name: str, max_age_s: float) -> None:
        """From now on `name` must beat at least every `max_age_s` seconds."""
        self._max_age[name] = max_age_s
        self._last[name] = self._clock()

    def beat(self, name: str) -> None:
        self._last[name] = self._clock()

    def stale(self) -> list[str]:
        """What has been silent too long, as 'name: silent for N s (limit M s)'."""
        now = self._clock()
        out = []
        for name, limit in sorted(self._max_age.items()):
            silent = now - self._last.get(name, now)
            if silent > limit:
                out.append(f"{name}: silent for {silent:.0f} s (limit {limit:.0f} s)")
        return out


# Any pod may reach the port (the chart's NetworkPolicy is off by default): a client that opens
# connections and sends nothing must neither hold a thread for ever nor starve the kubelet's
# liveness probe, whose failure restarts the agent (and with it the MPS pods of its node)
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socket timeout of each connection (StreamRequestHandler applies it)

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every few seconds would flood the log


class _BoundedServer(ThreadingWSGIServer):
    """At most MAX_CONNECTIONS answered at once; one more is closed at once."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def serve(host: str, port: int, liveness: Liveness) -> ThreadingWSGIServer:
    """`/metrics` (Prometheus) and `/healthz` (200, or 503 naming what is stuck) on a daemon thread."""
    metrics = make_wsgi_app()

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            stale = liveness.stale()
            body = ("ok\n" if not stale else "stuck: " + "; ".join(stale) + "\n").encode()
            start_response("200 OK" if not stale else "503 Service Unavailable",
                           [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        answer: Iterable[bytes] = metrics(environ, start_response)
        return answer

    server = make_server(host, port, app, _BoundedServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-and-probes", daemon=True).start()
    return server
