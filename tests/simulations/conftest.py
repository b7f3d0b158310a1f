"""Shared fixtures: small traces and clusters built in memory (the real openb files are only
read where a test says so, and skipped when ../shared/traces is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynpart.catalog import default_catalog
from dynpart.simulations.inputs.cluster_spec import ClusterSpec, NodeSpec
from dynpart.simulations.inputs.traces import TracePod

OPENB = Path(__file__).resolve().parents[3] / "shared" / "traces" / "openb"


@pytest.fixture
def openb() -> Path:
    if not (OPENB / "openb_pod_list_default.csv").exists():
        # CI has ../shared beside the clone: there a missing trace is a broken set-up, not a skip
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the openb traces are not at {OPENB}", pytrace=False)
        pytest.skip("../shared/traces/openb is not available")
    return OPENB


@pytest.fixture(scope="session")
def catalog():
    return default_catalog()


def pod(name: str, cpu: int = 1000, gpus: int = 1, milli: int = 1000, mem: int = 1024, spec: tuple = (),
        t0: int | None = 0, t1: int | None = 100) -> TracePod:
    return TracePod(name, cpu, mem, gpus, milli if gpus else 0, spec, t0, t1)


def cluster(*nodes: tuple, mode: str = "mps") -> ClusterSpec:
    """nodes: (name, cpu_milli, gpus, model[, memory_mib])"""
    return ClusterSpec("<test>", tuple(NodeSpec(n[0], n[1], n[4] if len(n) > 4 else 1 << 20, n[2], n[3], mode)
                                       for n in nodes))
