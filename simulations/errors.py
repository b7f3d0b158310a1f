"""User-facing errors of the simulator (one line each, exit status 2 from the CLI)."""

from __future__ import annotations

from dynpart.errors import DynpartError


class SimulationError(DynpartError):
    """A simulation was asked for something it cannot do (bad option, empty input...)."""


class TraceError(DynpartError):
    """A trace or cluster file is malformed; the message names the file and line."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path, self.line = path, line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
