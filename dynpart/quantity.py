"""Kubernetes quantities ("500m", "2", "1Gi", "1e3") as numbers: what the API server admits,
read as the kubelet and scheduler read it (the planner's snapshot, the agent's bound pods)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from dynpart.errors import DynpartError

# the most of a resource Kubernetes counts (a quantity's Value() saturates there, while the API
# server admits any decimal exponent: "1e306"); beyond it a round's sums and millicores could overflow
MAX_QUANTITY = float(2**63)
# a quantity's suffixes, the longest first ("Mi" before "M")
_SUFFIXES = tuple(sorted({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                          "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                          "E": 1e18}.items(), key=lambda item: len(item[0]), reverse=True))


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "2", "1Gi", "128974848", "1e3") as a number of units."""
    number = _quantity(str(value).strip())
    if number is None:
        raise DynpartError(f"quantity {value!r} is not a Kubernetes quantity (a number of at most 2^63-1 in magnitude)")
    return number


@lru_cache(maxsize=8192)  # a round reads every bound pod's requests and every node's allocatable: few distinct texts
def _quantity(text: str) -> float | None:
    """`parse_quantity` of a stripped text; None when it is no finite number ("1.2.3Gi", "nan",
    "inf", "1e400") or one beyond `MAX_QUANTITY` ("1e306": its millicores, or two such summed, are
    infinite): else a round's arithmetic on it fails for every node and pod."""
    number, factor = text, 1.0
    for suffix, times in _SUFFIXES:
        if text.endswith(suffix) and text[: -len(suffix)]:
            number, factor = text[: -len(suffix)], times
            break
    try:
        value = float(number) * factor
    except ValueError:
        return None
    return value if abs(value) <= MAX_QUANTITY else None  # (False for nan)
