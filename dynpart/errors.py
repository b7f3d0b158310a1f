"""Errors raised for bad input. Each message names the field and the value that was wrong."""

from __future__ import annotations

from pydantic import ValidationError


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: `nodes[0].gpus[1].mps`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def first_problem(e: ValidationError) -> str:
    """The first error of a validation, `path: message`, for a one-line error."""
    err = e.errors()[0]
    return f"{field_path(err['loc'])}: {err['msg']}" if err["loc"] else err["msg"]


def yaml_mark(e: Exception) -> tuple[int, int] | None:
    """(line, column), from 1, where a YAML parse error was found; None if unknown."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return None if mark is None else (mark.line + 1, mark.column + 1)


def yaml_message(e: Exception) -> str:
    """What is wrong in a YAML parse error, in one line: `not valid YAML: problem (context)`."""
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    text = f"{problem} ({context})" if context else str(problem)
    return "not valid YAML: " + " ".join(text.split())


def read_problem(e: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read as text, in a few words: the system's reason, or where its
    bytes stop being UTF-8."""
    if isinstance(e, UnicodeDecodeError):
        return f"not a UTF-8 text file (byte {e.start}: {e.reason})"
    return e.strerror or str(e)


def yaml_problem(path: object, e: Exception) -> str:
    """A YAML parse error in one line: `FILE:LINE:COLUMN: not valid YAML: problem (context)`."""
    mark = yaml_mark(e)
    return (f"{path}:{mark[0]}:{mark[1]}" if mark else str(path)) + ": " + yaml_message(e)


class DynpartError(Exception):
    """Base class: a user-facing error, printed in one line by the CLI (no traceback)."""


class CatalogError(DynpartError):
    """A catalog file or entry is malformed, or a GPU model is unknown."""


class UnknownGpuModel(CatalogError):
    def __init__(self, value: str, known: list[str], where: str = "gpu model"):
        self.value, self.known, self.where = value, list(known), where
        super().__init__(
            f"{where}: unknown GPU model {value!r}; known models: {', '.join(self.known)}. "
            "Add it in a catalog file (see dynpart/data/gpu-catalog.yaml for the schema) "
            "and pass it with --catalog."
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        """Pickled as its arguments, not its message: errors come back from worker processes."""
        return type(self), (self.value, self.known, self.where)


class ResourceNameError(DynpartError):
    """A Kubernetes resource name is not a slice resource dynpart understands."""


class SnapshotError(DynpartError):
    """A snapshot is inconsistent with the catalog or the MIG/MPS rules."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems[:5])
        if len(problems) > 5:
            head += f"; ... ({len(problems) - 5} more)"
        super().__init__(f"invalid snapshot: {head}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        """Pickled as its problems, not its message: errors come back from worker processes."""
        return type(self), (self.problems,)
