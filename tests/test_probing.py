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


def test_healthz_and_metrics_over_http():
    now = [0.0]
    live = Liveness(clock=lambda: now[0])
    live.expect("reconcile loop", 10)
    server = serve("127.0.0.1", 0, live)
    port = server.server_address[1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        now[0] = 11.0
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
            raise AssertionError("a stuck loop must fail the probe")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and b"reconcile loop: silent for 11 s" in e.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200 and b"python_info" in resp.read()
    finally:
        server.shutdown()
        server.server_close()


def test_idle_connections_neither_hold_threads_for_ever_nor_starve_the_probe(monkeypatch):
    """Any pod can reach the port: connections that send nothing are closed after the read
    time-out, and past the cap a new one is closed at once, while the probe answers again as soon
    as they are gone."""
    import socket
    import time

    from dynpart import probing

    monkeypatch.setattr(probing._Quiet, "timeout", 0.5)
    monkeypatch.setattr(probing, "MAX_CONNECTIONS", 4)
    server = serve("127.0.0.1", 0, Liveness())
    port = server.server_address[1]
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(2)
        assert extra.recv(1) == b""  # over the cap: closed without an answer
        time.sleep(1.0)  # the idle ones time out and free their slots
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
        for s in [*idle, extra]:
            s.close()
    finally:
        server.shutdown()
