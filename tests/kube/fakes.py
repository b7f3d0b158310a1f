"""A stand-in for the API server's raw responses (calls made with `_preload_content=False`)."""

from __future__ import annotations

import json
from typing import Any

from yarl import URL


class FakeContent:
    def __init__(self, lines: list[bytes]):
        self.lines = list(lines)

    async def readline(self) -> bytes:
        return self.lines.pop(0) if self.lines else b""  # b"": the server closed the watch


class FakeResponse:
    def __init__(self, status: int, body: Any = None, reason: str = "OK", method: str = "GET",
                 path: str = "/api/v1/nodes", events: list[dict[str, Any]] | None = None):
        self.status, self.reason, self.method, self.url = status, reason, method, URL("https://k8s" + path)
        self._body = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.content = FakeContent([json.dumps(e).encode() + b"\n" for e in events or []])

    async def read(self) -> bytes:
        return self._body

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass
