"""Types of command-line values that argparse's own do not check."""

from __future__ import annotations

import argparse

from dynpart.errors import DynpartError


def given(value: str) -> str:
    """A value that says something: `--trace "$TRACE"` with the variable unset passes "", which
    would otherwise read as the option left out (its default, silently)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a value, got an empty one")
    return value


def pod_name(value: str) -> str:
    """namespace/name: a pod is named so across the cluster (DynpartError otherwise)."""
    namespace, slash, name = value.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise DynpartError(f"pod {value!r}: expected NAMESPACE/NAME")
    return value
