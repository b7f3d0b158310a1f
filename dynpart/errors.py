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


class DynpartError(Exception):
    """Base class: a user-facing error, printed in one line by the CLI (no traceback)."""


class CatalogError(DynpartError):
    """A catalog file or entry is malformed, or a GPU model is unknown."""


class UnknownGpuModel(CatalogError):
    def __init__(self, value: str, known: list[str], where: str = "gpu model"):
        self.value = value
        super().__init__(
            f"{where}: unknown GPU model {value!r}; known models: {', '.join(known)}. "
            "Add it in a catalog file (see dynpart/data/gpu-catalog.yaml for the schema) "
            "and pass it with --catalog."
        )


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
