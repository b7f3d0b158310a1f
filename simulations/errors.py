"""User-facing errors of the simulator (one line each, exit status 2 from the CLI)."""

from __future__ import annotations

from dynpart.errors import DynpartError


class SimulationError(DynpartError):
    """A simulation was asked for something it cannot do (bad option, empty input...)."""


class TraceError(DynpartError):
    """A trace or cluster file is malformed; the message names the file and line."""

    def __init__(self, path: str, line: int | None, message: str, column: int | None = None):
        self.path, self.line, self.message, self.column = path, line, message, column
        where = path if line is None else f"{path}:{line}" if column is None else f"{path}:{line}:{column}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        """Pickled as its arguments, not its message: errors come back from worker processes."""
        return type(self), (self.path, self.line, self.message, self.column)
