"""The chart's partitioning-label ValidatingAdmissionPolicy (templates/partitioning-label-policy.yaml)
on the real kube-apiserver: a Node create or update that sets or changes the label
dynpart.io/gpu-partitioning to anything but `mig` or `mps` is refused with a message naming the
label, the value and the accepted values; every write that leaves the label as it is (even a bad
value written before the policy existed: the kubelet's status updates, other controllers' labels,
annotations, taints) and removing the label are accepted.

Only the rendered policy and its binding are created (release `lbl-test`, the node-write and
pod-env policies off), with a few Nodes of their own; all of it is deleted at the end, so other e2e tests sharing
the cluster are not affected. Requests are the admin's (a client certificate): the policy matches
every user.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.apicall import api_call, rendered_policy, wait_for
from tests.e2e.test_chart_dry_run import _dry_run_module, _require_tools

pytestmark = pytest.mark.e2e

RELEASE = "lbl-test"
POLICY = f"{RELEASE}-dynpart-partitioning-label"
LABEL = "dynpart.io/gpu-partitioning"
MERGE_PATCH = "application/merge-patch+json"
DENIED = f"ValidatingAdmissionPolicy '{POLICY}' with binding '{POLICY}' denied request"


def refusal(value: str) -> str:
    return (f'node label {LABEL}="{value}" refused: the accepted values are mig and mps (lower case); '
            "remove the label to take a node out of dynpart")


@dataclass
class Setup:
    client: Any  # charts/tools/dry_run.py Client, as the admin
    nodes: dict[str, str]  # role -> node name
    objects: list[dict[str, Any]]  # the policy and its binding

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> tuple[int, Any]:
        return api_call(self.client, method, path, body, content_type)

    def patch(self, role: str, body: dict[str, Any], subresource: str = "", dry_run: bool = False) -> tuple[int, Any]:
        query = "?dryRun=All" if dry_run else ""
        return self.call("PATCH", f"/api/v1/nodes/{self.nodes[role]}{subresource}{query}", body, MERGE_PATCH)

    def label(self, role: str, value: str | None, subresource: str = "", dry_run: bool = False) -> tuple[int, Any]:
        return self.patch(role, {"metadata": {"labels": {LABEL: value}}}, subresource, dry_run)

    def get(self, role: str) -> dict[str, Any]:
        status, node = self.call("GET", f"/api/v1/nodes/{self.nodes[role]}")
        assert status == 200, node
        return dict(node)

    def current(self, role: str) -> str | None:
        return self.get(role)["metadata"].get("labels", {}).get(LABEL)

    def create_node(self, name: str, value: str | None) -> tuple[int, Any]:
        labels = {"kubernetes.io/hostname": name}
        if value is not None:
            labels[LABEL] = value
        return self.call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                   "metadata": {"name": name, "labels": labels}})


def _enforced(s: Setup) -> bool:
    """A bad value on the probe node is refused (a server-side dry run: nothing is written)."""
    status, message = s.label("probe", "MPS", dry_run=True)
    return status == 422 and DENIED in str(message)


def _not_enforced(s: Setup) -> bool:
    return s.label("probe", "MPS", dry_run=True)[0] == 200


@pytest.fixture(scope="module")
def setup(e2e_cluster) -> Iterator[Setup]:
    _require_tools()
    client = _dry_run_module().Client(e2e_cluster.kubeconfig)
    objects = rendered_policy(RELEASE, "dynpart-lbl-test", POLICY, "--set", "admissionPolicy.enabled=false",
                              "--set", "podEnvPolicy.enabled=false")
    suffix = os.urandom(3).hex()
    roles = ("probe", "ok", "bad", "bare", "status", "created-mig", "created-mps", "created-bad", "created-bare")
    s = Setup(client, {r: f"lbl-{r}-{suffix}" for r in roles}, objects)
    try:
        # before the policy: a node with a mistyped value (the case the policy must keep working),
        # and the nodes the tests patch
        for role, value in (("probe", "mig"), ("ok", "mig"), ("bad", "MPS"), ("bare", None), ("status", "mig")):
            status, body = s.create_node(s.nodes[role], value)
            assert status == 201, body
        for o in objects:
            client.ensure(o)
        wait_for("the partitioning-label policy", lambda: _enforced(s))
        yield s
    finally:
        for name in s.nodes.values():
            client.delete({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        for o in reversed(objects):
            client.delete(o)
        client.close()


def test_the_status_subresource_writes_labels_too(setup):
    """Why the policy matches nodes/status as well as nodes: the API server keeps a nodes/status
    write's metadata (the status strategy resets only the spec), so a label set there is stored.
    A valid value goes through; a bad one is refused like on the main resource."""
    status, node = setup.label("status", "mps", "/status")
    assert status == 200, node
    assert node["metadata"]["labels"][LABEL] == "mps" and setup.current("status") == "mps"
    status, message = setup.label("status", "MPS", "/status")
    assert status == 422 and DENIED in message and refusal("MPS") in message, f"{status}: {message}"
    assert setup.current("status") == "mps"


@pytest.mark.parametrize("value", ["mps", "mig"])
def test_valid_values_are_accepted(setup, value):
    status, node = setup.label("ok", value)
    assert status == 200, node
    assert setup.current("ok") == value


@pytest.mark.parametrize("value", ["MPS", "Mig", "true", "mps2", ""])
def test_bad_values_are_refused(setup, value):
    before = setup.current("ok")
    status, message = setup.label("ok", value)
    assert status == 422, f"{value!r}: {status} {message}"
    assert DENIED in message and refusal(value) in message, message
    assert setup.current("ok") == before
    # on a node that has no such label yet, too
    status, message = setup.label("bare", value)
    assert status == 422 and refusal(value) in message, f"{status}: {message}"
    assert setup.current("bare") is None


def test_a_value_with_a_space_is_refused_by_the_api_server(setup):
    """`mps ` is no valid label value at all: the API server's own validation refuses it first."""
    status, message = setup.label("ok", "mps ")
    assert status == 422 and "metadata.labels" in message and DENIED not in message, f"{status}: {message}"


def test_node_creation(setup):
    """A node registering with the label (kubelet --node-labels): mig, mps or no label are
    accepted; a bad value is refused, the node is not created."""
    for role, value in (("created-mig", "mig"), ("created-mps", "mps"), ("created-bare", None)):
        status, body = setup.create_node(setup.nodes[role], value)
        assert status == 201, body
    status, message = setup.create_node(setup.nodes["created-bad"], "MPS")
    assert status == 422 and DENIED in message and refusal("MPS") in message, f"{status}: {message}"
    assert setup.call("GET", f"/api/v1/nodes/{setup.nodes['created-bad']}")[0] == 404


def test_a_node_with_a_bad_value_keeps_getting_other_updates(setup):
    """The node labelled MPS before the policy existed: the kubelet's status writes, other labels,
    annotations, taints and a full PUT leave the label as it is and are never refused."""
    role = "bad"
    assert setup.current(role) == "MPS"
    updates = [
        ("an unrelated label", {"metadata": {"labels": {"example.com/pool": "a"}}}, ""),
        ("an annotation", {"metadata": {"annotations": {"example.com/note": "x"}}}, ""),
        ("a taint (cordon)", {"spec": {"unschedulable": True,
                                       "taints": [{"key": "example.com/t", "effect": "NoSchedule"}]}}, ""),
        # the kubelet: conditions and resources through nodes/status
        ("the kubelet's status", {"status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu-10gb": "8"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu-10gb": "8"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z"}]}}, "/status"),
        ("an annotation through nodes/status", {"metadata": {"annotations": {"example.com/note": "y"}}}, "/status"),
    ]
    for what, body, sub in updates:
        status, node = setup.patch(role, body, sub)
        assert status == 200, f"{what}: {status} {node}"
        assert node["metadata"]["labels"][LABEL] == "MPS", what
    node = setup.get(role)
    assert node["metadata"]["labels"]["example.com/pool"] == "a"
    assert node["metadata"]["annotations"]["example.com/note"] == "y"
    assert node["status"]["allocatable"]["nvidia.com/gpu-10gb"] == "8"
    # a full replace (PUT) that keeps the label, as a controller's Update does
    node["metadata"]["labels"]["example.com/pool"] = "b"
    status, body = setup.call("PUT", f"/api/v1/nodes/{setup.nodes[role]}", node)
    assert status == 200 and body["metadata"]["labels"]["example.com/pool"] == "b", body
    # changing it to another bad value is refused; to a good one, accepted (dry run: keep it bad)
    status, message = setup.label(role, "Mps")
    assert status == 422 and refusal("Mps") in message, f"{status}: {message}"
    status, node = setup.label(role, "mps", dry_run=True)
    assert status == 200 and node["metadata"]["labels"][LABEL] == "mps", node
    assert setup.current(role) == "MPS"


@pytest.mark.parametrize("role", ["bad", "ok"])
def test_removing_the_label_is_accepted(setup, role):
    """How a node leaves dynpart, whatever its value (a bad one included)."""
    assert setup.current(role) is not None
    status, node = setup.label(role, None)
    assert status == 200, node
    assert LABEL not in node["metadata"].get("labels", {})
    assert setup.current(role) is None


def test_without_the_binding_every_refused_value_is_written(setup):
    """Each refusal above is the policy's doing: with its binding deleted, the same writes go
    through (then the binding is back, for whatever runs next)."""
    binding = next(o for o in setup.objects if o["kind"] == "ValidatingAdmissionPolicyBinding")
    setup.client.delete(binding)
    try:
        wait_for("the binding's removal", lambda: _not_enforced(setup))
        for value in ("MPS", "true", ""):
            status, node = setup.label("ok", value)
            assert status == 200 and node["metadata"]["labels"][LABEL] == value, node
        status, node = setup.label("status", "Mig", "/status")
        assert status == 200 and node["metadata"]["labels"][LABEL] == "Mig", node
    finally:
        setup.client.ensure(binding)
        wait_for("the partitioning-label policy", lambda: _enforced(setup))
