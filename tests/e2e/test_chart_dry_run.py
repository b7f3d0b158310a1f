"""The Helm chart against the real kube-apiserver: server-side dry run of its manifests, and its
RBAC through the real authorizer (SubjectAccessReview). Its node-write ValidatingAdmissionPolicies,
with real ServiceAccount tokens: tests/e2e/test_least_privilege.py.

Needs helm (and the schemas' CRD) from `bash charts/build-tools.sh`; skipped without them, except
in CI (CI=true) where that is an error, like the cluster itself (conftest.py).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dynpart"
CACHE = Path(os.environ.get("DYNPART_TOOLS_CACHE") or ROOT / ".cache")
HELM = CACHE / "tools" / "bin" / "helm"
CRDS = CACHE / "kube-schemas" / "crds"
# the monitoring CRDs the chart can render objects of (charts/build-tools.sh converts them)
MONITOR_CRDS = [CRDS / "servicemonitor-crd.yaml", CRDS / "podmonitor-crd.yaml"]


def _dry_run_module():
    name = "dynpart_chart_dry_run"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "charts" / "tools" / "dry_run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _require_tools() -> None:
    missing = [str(p) for p in (HELM, *MONITOR_CRDS) if not p.exists()]
    if not missing:
        return
    message = f"chart tools not built ({', '.join(missing)}): run bash charts/build-tools.sh"
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(message)


def render(release: str, namespace: str, *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run([str(HELM), "template", release, str(CHART), "--namespace", namespace, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def client(e2e_cluster):
    _require_tools()
    c = _dry_run_module().Client(e2e_cluster.kubeconfig)
    yield c
    c.close()


def test_chart_manifests_pass_server_side_dry_run(e2e_cluster, client):
    dr = _dry_run_module()
    crds = dr.load_objects(MONITOR_CRDS)
    # the e2e kube-apiserver allows privileged pods, as kubeadm does: the default (privileged) agent is checked
    objects = (render("dynpart", "dynpart-system")
               + render("dynpart", "dynpart-system", "-f", str(CHART / "ci" / "full-values.yaml")))
    log: list[str] = []
    failures = dr.dry_run(client, objects, crds, log=log.append)
    assert not failures, "\n".join(log)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "DaemonSet", "ServiceMonitor", "PodMonitor", "ClusterRole", "Role", "NetworkPolicy",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    assert sum(line.startswith("ok ") for line in log) == len(objects)


def test_dry_run_reports_what_the_server_refuses(client):
    """The dry run is not vacuous: unknown fields (strict field validation) and invalid values fail."""
    dr = _dry_run_module()
    dep = next(o for o in render("dynpart", "dynpart-system") if o["kind"] == "Deployment")
    unknown = copy.deepcopy(dep)
    unknown["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    invalid = copy.deepcopy(dep)
    invalid["spec"]["replicas"] = -1
    failures = dr.dry_run(client, [unknown, invalid], log=lambda _: None)
    assert len(failures) == 2
    assert "unknown field" in failures[0] and "resourcez" in failures[0]
    assert "replicas" in failures[1]


# (user, verb, group, resource, namespace, name) -> allowed?
PLANNER_ACCESS = [
    ("list", "", "pods", None, None, True),
    ("watch", "", "pods", None, None, True),
    ("watch", "", "nodes", None, None, True),
    ("patch", "", "nodes", None, "gpu-node-1", True),
    ("create", "", "events", "team-a", None, True),
    ("get", "coordination.k8s.io", "leases", "{ns}", "dynpart-planner", True),
    ("update", "coordination.k8s.io", "leases", "{ns}", "dynpart-planner", True),
    ("create", "coordination.k8s.io", "leases", "{ns}", None, True),
    ("update", "coordination.k8s.io", "leases", "{ns}", "another-lease", False),
    ("create", "coordination.k8s.io", "leases", "kube-system", None, False),
    ("get", "", "pods", "team-a", "p", False),  # informers only: list and watch
    ("list", "storage.k8s.io", "storageclasses", None, None, True),  # whether an unbound claim binds immediately
    ("watch", "storage.k8s.io", "storageclasses", None, None, True),
    ("update", "storage.k8s.io", "storageclasses", None, "fast", False),
    ("get", "", "nodes", None, "gpu-node-1", True),  # a fresh read before an overdue plan is judged replaced
    ("patch", "", "events", "team-a", "e", False),  # Events are only POSTed
    ("create", "events.k8s.io", "events", "team-a", None, False),
    ("patch", "", "nodes/status", None, "gpu-node-1", False),
    ("update", "", "pods", "team-a", "p", False),
    ("delete", "", "nodes", None, "gpu-node-1", False),
    ("get", "", "secrets", "{ns}", None, False),
    ("get", "", "configmaps", "{ns}", "dynpart-device-plugin-configs", False),
]
AGENT_ACCESS = [
    ("get", "", "nodes", None, "gpu-node-1", True),
    ("watch", "", "nodes", None, None, True),
    ("patch", "", "nodes", None, "gpu-node-1", True),
    ("create", "", "events", "default", None, True),
    # no ConfigMap: MPS slices are served by its own device plugin (the nebuly-fork configs are gone)
    ("get", "", "configmaps", "{ns}", "dynpart-device-plugin-configs", False),
    ("patch", "", "configmaps", "{ns}", "dynpart-device-plugin-configs", False),
    ("create", "", "configmaps", "{ns}", None, False),
    # the pods bound to its node (a node field selector; RBAC cannot narrow a list to one node)
    ("list", "", "pods", None, None, True),
    ("get", "", "pods", "team-a", "p", False),
    ("watch", "", "pods", None, None, False),
    ("delete", "", "pods", "team-a", "p", False),  # devicePlugin.mode=nvidia only, in NVIDIA's namespace
    # its slices' counts (the node-write policy narrows it to those keys on its own node)
    ("patch", "", "nodes/status", None, "gpu-node-1", True),
    ("update", "", "nodes/status", None, "gpu-node-1", False),
    ("get", "", "configmaps", "{ns}", "kube-root-ca.crt", False),
    ("patch", "", "configmaps", "kube-system", "dynpart-device-plugin-configs", False),
    ("delete", "", "configmaps", "{ns}", "dynpart-device-plugin-configs", False),
    ("patch", "", "pods", "team-a", "p", False),
    ("get", "", "secrets", "{ns}", None, False),
    ("update", "coordination.k8s.io", "leases", "{ns}", "dynpart-planner", False),
]


def test_rbac_through_the_real_authorizer(client):
    """Create the chart's ServiceAccounts and RBAC for real, then ask the API server's authorizer
    (SubjectAccessReview) what each ServiceAccount may do."""
    ns = "dynpart-rbac-e2e"
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    objects = [o for o in render("rbac-e2e", ns) if o["kind"] in rbac_kinds]
    client.ensure({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    created = [o for o in objects if client.ensure(o)]
    try:
        deadline = time.monotonic() + 20  # the authorizer sees new RBAC objects asynchronously
        while (problems := _access_problems(client, ns)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not problems, "\n".join(problems)
    finally:
        for o in created:  # cluster-scoped leftovers (namespaced ones go with the cluster)
            if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                client.delete(o)


def _access_problems(client, ns: str) -> list[str]:
    """What the API server's authorizer answers differently from the tables above."""
    problems = []
    for sa, table in (("rbac-e2e-dynpart-planner", PLANNER_ACCESS), ("rbac-e2e-dynpart-agent", AGENT_ACCESS)):
        for verb, group, resource, namespace, name, want in table:
            resource, _, subresource = resource.partition("/")
            attrs = {"verb": verb, "group": group, "resource": resource}
            if subresource:
                attrs["subresource"] = subresource
            if namespace:
                attrs["namespace"] = namespace.format(ns=ns)
            if name:
                attrs["name"] = name
            review = client.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", {
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": f"system:serviceaccount:{ns}:{sa}",
                         "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}",
                                    "system:authenticated"],
                         "resourceAttributes": attrs}})
            got = bool(review["status"].get("allowed"))
            if got != want:
                problems.append(f"{sa} {attrs}: allowed={got}, expected {want}")
    return problems
