"""Stand-ins for the API server: its raw responses (calls made with `_preload_content=False`), and
a small HTTP server to drive the real client stack (kubernetes-asyncio, aiohttp) against."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from yarl import URL


class FakeContent:
    """A response's stream of lines; then the server closes it (b""), or, `hang`, stays silent."""

    def __init__(self, lines: list[bytes], hang: bool = False):
        self.lines = list(lines)
        self.hang = hang

    async def readline(self) -> bytes:
        if not self.lines and self.hang:
            await asyncio.Event().wait()  # until cancelled
        return self.lines.pop(0) if self.lines else b""  # b"": the server closed the watch


class FakeResponse:
    def __init__(self, status: int, body: Any = None, reason: str = "OK", method: str = "GET",
                 path: str = "/api/v1/nodes", events: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None, hang: bool = False):
        self.status, self.reason, self.method, self.url = status, reason, method, URL("https://k8s" + path)
        self.headers = headers or {}
        self._body = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.content = FakeContent([json.dumps(e).encode() + b"\n" for e in events or []], hang)

    async def read(self) -> bytes:
        return self._body

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


def status(code: int, reason: str, message: str = "") -> dict[str, Any]:
    """A Status object, as an error answer or an ERROR watch event carries it."""
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeAPIServer:
    """An HTTP server on 127.0.0.1 answering `handlers[(method, path)]` (else 404), each request
    recorded in `requests`; `kubeconfig(tmp_path, user)` points a kubeconfig at it. Handlers that
    hold a watch open should wait for `closing`, set when the server stops."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], Handler] = {}
        self.requests: list[web.Request] = []
        self.closing = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app)
        self.port = 0

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request)
        handler = self.handlers.get((request.method, request.path))
        if handler is None:
            return web.json_response(status(404, "NotFound"), status=404)
        return await handler(request)

    async def __aenter__(self) -> FakeAPIServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        await self._runner.cleanup()

    def kubeconfig(self, directory: Path, user: str = "{token: abc}") -> str:
        path = directory / "kubeconfig"
        path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{self.port}"}}}}]
users: [{{name: u, user: {user}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
        return str(path)
