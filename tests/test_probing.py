"""/healthz fails when a loop that must keep turning has stopped beating; /metrics still answers."""

from __future__ import annotations

import urllib.error
import urllib.request

from dynpart.probing import Liveness, serve


def test_stale_names_what_stopped_and_for_how_long():
    now = [100.0]
    live = Liveness(clock=lambda: now[0])
    live.expect("planning loop", 60)
    live.expect("watch pods", 400)
    now[0] = 150.0
    assert live.stale() == []
    live.beat("watch pods")
    now[0] = 170.0
    assert live.stale() == ["planning loop: silent for 70 s (limit 60 s)"]
    live.beat("planning loop")
    assert live.stale() == []


def _get(port: int, path: str) -> tuple[int, bytes]:
    """(status, body) of a GET, an HTTP error's too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_healthz_and_metrics_over_http():
    now = [0.0]
    live = Liveness(clock=lambda: now[0])
    live.expect("reconcile loop", 10)
    server = serve("127.0.0.1", 0, live)
    port = server.server_address[1]
    try:
        assert _get(port, "/healthz") == (200, b"ok\n")
        now[0] = 11.0
        code, body = _get(port, "/healthz")
        assert code == 503 and b"reconcile loop: silent for 11 s" in body, "a stuck loop must fail the probe"
        code, body = _get(port, "/metrics")
        assert code == 200 and b"python_info" in body
        # /readyz: 503 until the component says it is ready, and while anything is stuck
        now[0] = 0.0
        assert _get(port, "/readyz") == (503, b"starting\n")
        live.ready = True
        assert _get(port, "/readyz") == (200, b"ok\n")
        now[0] = 11.0
        code, body = _get(port, "/readyz")
        assert code == 503 and b"stuck" in body, "a stuck loop must fail readiness too"
    finally:
        server.shutdown()
        server.server_close()


def test_idle_or_trickling_connections_are_cut_off_and_never_starve_the_probe(monkeypatch, capsys):
    """Any pod can reach the port: a connection gets READ_TIMEOUT_S in all, even one that sends a
    byte now and then (a per-read time-out alone would keep it for ever), many of them never keep
    the probe from an answer, and cutting them off prints no traceback."""
    import socket
    import threading
    import time

    from dynpart import probing

    monkeypatch.setattr(probing, "READ_TIMEOUT_S", 0.6)
    monkeypatch.setattr(probing._Quiet, "timeout", 0.6)
    server = serve("127.0.0.1", 0, Liveness())
    port = server.server_address[1]
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200  # 40 idle connections open: answered all the same
        slow = socket.create_connection(("127.0.0.1", port))
        cut = threading.Event()

        def trickle() -> None:
            try:
                for b in b"GET /healthz HTTP/1.1\r\n":
                    slow.sendall(bytes([b]))
                    time.sleep(0.3)  # under the per-read time-out each time
            except OSError:
                cut.set()
        started = time.monotonic()
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        slow.settimeout(5)
        try:
            assert slow.recv(1) == b""  # shut down by the server
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 0.6 + 2.0  # the deadline, and the reaper's period
        for c in [*idle, slow]:
            c.close()
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_metrics_port_taken_or_a_host_that_does_not_resolve_is_a_one_line_error():
    """9090, the default, is also Prometheus's: `planner run` and `agent run` ended with an
    OSError traceback (helper-148)."""
    import pytest

    from dynpart.errors import DynpartError

    first = serve("127.0.0.1", 0, Liveness())
    port = first.server_address[1]
    try:
        with pytest.raises(DynpartError, match=rf"^metrics server 127.0.0.1:{port}: Address already in use; set "
                                               "another metrics_port \\(0: no server\\) or metrics_host$"):
            serve("127.0.0.1", port, Liveness())
    finally:
        first.shutdown()
        first.server_close()
    with pytest.raises(DynpartError, match=r"^metrics server no-such-host.invalid:0: "):
        serve("no-such-host.invalid", 0, Liveness())
