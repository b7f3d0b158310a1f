"""Session fixture ``e2e_cluster`` (shared by every test that needs it): a real etcd + kube-apiserver + kube-scheduler.

The binaries come from ``bash tests/e2e/build.sh``.  When they are missing the
tests using the fixture are skipped, except in CI (``CI=true``) where that is
an error.  See cluster.py for what this control plane does and does not run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _load_cluster_module():
    name = "dynpart_e2e_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "e2e" / "cluster.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses look the module up
        spec.loader.exec_module(module)
    return sys.modules[name]


cluster_mod = _load_cluster_module()


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_without_binaries() -> None:
    """Skip an e2e test whose control-plane binaries are not built; in CI, fail it instead."""
    problem = None
    try:
        cluster_mod.find_binaries()
    except cluster_mod.BinariesMissing as e:
        problem = str(e)
    if problem is not None:  # outside `except`: no chained traceback in the report
        if _in_ci():
            pytest.fail(f"CI=true but {problem}", pytrace=False)
        pytest.skip("e2e binaries not built: run bash tests/e2e/build.sh")


@pytest.fixture(scope="session")
def e2e_cluster(tmp_path_factory):
    """The running cluster (cluster.py's ``Cluster``): ``.kubeconfig``, ``.server``, ..."""
    skip_without_binaries()
    problem = None
    try:
        cluster = cluster_mod.start_cluster(tmp_path_factory.mktemp("e2e-cluster"))
    except cluster_mod.ClusterError as e:
        problem = str(e)
    if problem is not None:
        pytest.fail(f"local Kubernetes control plane failed to start: {problem}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
