"""A small TCP proxy for the fault tests: put it between a component and the API server and break
the connection on purpose.

It listens on 127.0.0.1 (a free port) and forwards every connection to the target (the API
server's port) byte for byte: TLS passes through untouched, so a component only needs a kubeconfig
whose server is the proxy (`kubeconfig()` writes one; the API server's certificate is valid for
127.0.0.1, see cluster.py's PKI). It runs its own event loop in a daemon thread, so it keeps
forwarding whatever the test's event loop is doing; the controls are plain thread-safe calls:

- `cut()`: reset every current connection (watches, keep-alive connections): both sides see the
  connection drop; the client reconnects through the proxy.
- `delay(s, direction)`: from now on each chunk is forwarded `s` seconds after it arrived, in
  order (`direction`: "up" = component -> API server, "down" = API server -> component, or
  "both"). `delay(0)` ends it (chunks already waiting keep their time). `spare_handshake`: the
  TLS handshake of new connections is not delayed, only the requests and answers after it.
- `partition()`: a network partition: connections stay open but nothing goes through, either
  way, and new connections are accepted and held the same way. Data (and closes) are kept, as a
  network keeps unacknowledged segments for retransmission.
- `refuse()`: new connections are reset at once and current ones cut (the server is "down").
- `heal(flush=True)`: back to normal. With `flush`, what a partition held is delivered now (a
  request the component sent during the partition reaches the API server late, as retransmitted
  segments would); without, the held connections are cut instead.

`stats` counts connections accepted, cut and refused, and bytes each way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_EOF = b""


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False
    up_chunks: int = 0  # chunks the client sent so far (2: its TLS handshake is done)

    def abort(self) -> None:
        """Reset both sides now (what the component sees as a dropped connection)."""
        if self.closed:
            return
        self.closed = True
        for w in (self.client, self.upstream):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.transport.abort()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", name: str = "proxy"):
        self.target = (target_host, target_port)
        self.name = name
        self.port = 0
        self.stats: Counter[str] = Counter()
        self._delays = {"up": 0.0, "down": 0.0}
        self._spare_handshake = False
        self._refusing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tcp-proxy-{name}", daemon=True)
        self._conns: set[_Conn] = set()
        self._open: asyncio.Event | None = None  # set: traffic flows; clear: partitioned
        self._server: asyncio.AbstractServer | None = None

    # --- life cycle ---

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self._server = await asyncio.start_server(self._handle, sock=sock)
        self.port = sock.getsockname()[1]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self, source: Path, dest: Path) -> Path:
        """A copy of the kubeconfig `source` (cluster.py writes JSON) whose server is this proxy."""
        cfg: dict[str, Any] = json.loads(Path(source).read_text())
        for c in cfg["clusters"]:
            c["cluster"]["server"] = self.url
        dest.write_text(json.dumps(cfg, indent=2) + "\n")
        dest.chmod(0o600)
        return dest

    # --- controls (from any thread) ---

    def cut(self) -> int:
        """Reset every current connection; returns how many there were."""
        return self._call(self._cut())

    def delay(self, seconds: float, direction: str = "both", spare_handshake: bool = False) -> None:
        """With `spare_handshake`, a new connection's TLS handshake (its first two client chunks,
        ClientHello and Finished, and what the server sends before the second) goes through at
        once and only what follows is delayed: the answer to a request is late, not the request."""
        dirs = ("up", "down") if direction == "both" else (direction,)
        for d in dirs:
            if d not in self._delays:
                raise ValueError(f"direction must be up, down or both, not {direction!r}")

        def change() -> None:
            self._delays.update({d: float(seconds) for d in dirs})
            self._spare_handshake = spare_handshake
        self._call(self._set(change))

    def partition(self) -> None:
        self._call(self._set(lambda: self._open.clear()))  # type: ignore[union-attr]

    def refuse(self) -> int:
        self._call(self._set(lambda: setattr(self, "_refusing", True)))
        return self.cut()

    def heal(self, flush: bool = True) -> None:
        async def heal() -> None:
            self._refusing = False
            self._delays.update(up=0.0, down=0.0)
            if not flush and not self._open.is_set():  # type: ignore[union-attr]
                await self._cut()
            self._open.set()  # type: ignore[union-attr]
        self._call(heal())

    @property
    def partitioned(self) -> bool:
        return self._open is not None and not self._open.is_set()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    @staticmethod
    async def _set(change: Any) -> None:
        change()

    async def _cut(self) -> int:
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        self._conns.difference_update(conns)
        self.stats["cut"] += len(conns)
        return len(conns)

    # --- forwarding ---

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            self.stats["refused"] += 1
            writer.transport.abort()
            return
        self.stats["accepted"] += 1
        conn = _Conn(writer)
        self._conns.add(conn)
        conn.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await self._open.wait()  # type: ignore[union-attr]  # partitioned: the SYN is "in flight"
            up_reader, conn.upstream = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):
            conn.abort()
            self._conns.discard(conn)
            return
        if conn.closed:
            conn.abort()
            return
        pumps = [asyncio.ensure_future(self._pipe(conn, reader, conn.upstream, "up")),
                 asyncio.ensure_future(self._pipe(conn, up_reader, writer, "down"))]
        conn.tasks.extend(pumps)
        try:
            await asyncio.gather(*pumps)
        except (asyncio.CancelledError, Exception):
            pass
        finally:
            conn.abort()
            self._conns.discard(conn)

    async def _pipe(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        """Forward one direction: a reader task queues each chunk with the time it is due; the
        writer (this task) delivers them in order, when due and when not partitioned."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(65536)
                except (OSError, asyncio.IncompleteReadError):
                    data = _EOF
                if direction == "up":
                    conn.up_chunks += 1
                spared = self._spare_handshake and conn.up_chunks < 2
                queue.put_nowait((loop.time() + (0.0 if spared else self._delays[direction]), data))
                if not data:
                    return

        reading = asyncio.ensure_future(read())
        conn.tasks.append(reading)
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()  # type: ignore[union-attr]
                if not data:  # the other side closed: close this one once what came before is delivered
                    conn.abort()
                    return
                writer.write(data)
                self.stats[f"bytes_{direction}"] += len(data)
                await writer.drain()
        except (OSError, ConnectionError):
            conn.abort()
        finally:
            reading.cancel()
