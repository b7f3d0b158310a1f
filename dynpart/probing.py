"""Liveness that means something: `/healthz` fails when a loop that must keep turning (the
planner's planning loop, a watch, the agent's reconcile loop) has not beaten for longer than
it may, so the kubelet restarts a component whose watch or loop is stuck. `/metrics` alone
answers from another thread and says nothing about the event loop.

Beats are written on the event loop and read by the HTTP server's thread: a float per name,
replaced whole, needs no lock. An event loop blocked by a long computation stops beating too,
which is what liveness is for; `keep_beating` tells a blocked loop from a long await.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from dynpart.errors import DynpartError


class Liveness:
    """Named heartbeats, each with the longest silence it may keep; and readiness (`/readyz`),
    which a component sets once it has done its work once (`ready`): a rolling update moves on
    only then, not as soon as the process answers HTTP."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._max_age: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self.ready = False

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


async def keep_beating(liveness: Liveness, name: str, every_s: float) -> None:
    """Beat `name` every `every_s` seconds for as long as the event loop runs this task: it stops
    when the loop is blocked (a call that does not return, made on the loop), not while a task
    awaits something slow."""
    while True:
        liveness.beat(name)
        await asyncio.sleep(every_s)


# Any pod may reach the port (the chart's NetworkPolicy is off by default): a client that opens
# connections and sends nothing, or trickles a byte now and then, must not hold a thread for ever.
# Each connection gets READ_TIMEOUT_S in all; there is no cap on connections, since a cap would let
# one client starve the kubelet's liveness probe, whose failure restarts the agent (and with it
# the MPS pods of its node)
READ_TIMEOUT_S = 10.0


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # each read (StreamRequestHandler sets it); the server bounds the whole

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every few seconds would flood the log


class _DeadlineServer(ThreadingWSGIServer):
    """Every connection is shut down READ_TIMEOUT_S after it was accepted, whatever it sends (one
    reaper thread for all); a client cut off so is not an error worth a traceback."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._open: dict[Any, float] = {}  # request socket -> its deadline
        self._lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._reap, name="metrics-deadlines", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open[request] = time.monotonic() + READ_TIMEOUT_S
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to answer it (the caller shuts the request down)
            self._forget(request)
            raise

    def shutdown_request(self, request: Any) -> None:
        self._forget(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a time-out, a reset, a connection cut off here
            return
        super().handle_error(request, client_address)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)

    def _reap(self) -> None:
        while not self._closed.wait(min(1.0, READ_TIMEOUT_S / 4)):
            now = time.monotonic()
            with self._lock:
                late = [r for r, deadline in self._open.items() if deadline < now]
            for request in late:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


def serve(host: str, port: int, liveness: Liveness) -> ThreadingWSGIServer:
    """`/metrics` (Prometheus), `/healthz` (200, or 503 naming what is stuck) and `/readyz` (the
    same, and 503 until `liveness.ready`) on a daemon thread."""
    metrics = make_wsgi_app()

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path in ("/healthz", "/readyz"):
            stale = liveness.stale()
            if stale:
                body = ("stuck: " + "; ".join(stale) + "\n").encode()
            elif path == "/readyz" and not liveness.ready:
                body = b"starting\n"
            else:
                body = b"ok\n"
            start_response("200 OK" if body == b"ok\n" else "503 Service Unavailable",
                           [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        answer: Iterable[bytes] = metrics(environ, start_response)
        return answer

    try:
        server = make_server(host, port, app, _DeadlineServer, handler_class=_Quiet)
    except OSError as e:  # a port taken (9090 is also Prometheus's default), a host that does not resolve
        raise DynpartError(f"metrics server {host}:{port}: {e.strerror or e}; set another metrics_port "
                           "(0: no server) or metrics_host") from None
    threading.Thread(target=server.serve_forever, name="metrics-and-probes", daemon=True).start()
    return server
