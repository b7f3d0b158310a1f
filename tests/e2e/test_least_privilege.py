"""Least privilege that holds, on the real kube-apiserver: the chart's RBAC and its node-write
ValidatingAdmissionPolicies (templates/node-write-policies.yaml), exercised with real
ServiceAccount tokens and real PATCH requests.

The agent's token is obtained as the kubelet obtains the DaemonSet pod's projected token: a
TokenRequest bound to the agent's pod, here a pod made from the rendered DaemonSet template and
bound to node A. The API server then names node A in the requester's user extra
`authentication.kubernetes.io/node-name` (checked with a SelfSubjectReview). Each refusal must come
from the policy (its message names it), and the last test shows that RBAC alone allows every one
of the refused requests: without the policy's binding they all succeed.

Everything lives in the release namespace dynpart-lp-test (release `lp-test`), so other e2e tests
sharing the cluster are not affected; what the module created is deleted at the end.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.apicall import api_call, wait_for
from tests.e2e.test_chart_dry_run import _dry_run_module, _require_tools, render

pytestmark = pytest.mark.e2e

NS = "dynpart-lp-test"
RELEASE = "lp-test"
AGENT = f"{RELEASE}-dynpart-agent"
PLANNER = f"{RELEASE}-dynpart-planner"
AGENT_POLICY = f"{AGENT}-node-writes"
PLANNER_POLICY = f"{PLANNER}-node-writes"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
DEVICE_PLUGIN_LABEL = "nvidia.com/device-plugin.config"
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
MERGE_PATCH = "application/merge-patch+json"

_nonce = itertools.count(1)


def nonce() -> str:
    """A new value each call: every patch below is a real change (no no-op update)."""
    return f"v{next(_nonce)}"


class Caller:
    """HTTPS with a bearer token only: no client certificate, which would authenticate first."""

    def __init__(self, server: str, ca_file: str, token: str):
        self.server, self.ca_file, self.token = server, ca_file, token
        ctx = ssl.create_default_context(cafile=ca_file)
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))

    def call(self, method: str, path: str, body: Any, content_type: str = "application/json") -> tuple[int, Any]:
        return api_call(self, method, path, body, content_type)

    def patch_node(self, node: str, body: dict[str, Any], subresource: str = "") -> tuple[int, Any]:
        return self.call("PATCH", f"/api/v1/nodes/{node}{subresource}", body, MERGE_PATCH)


@dataclass(frozen=True)
class Case:
    """One merge patch of node `node` ("A" or "B") by `who` ("agent": the agent's token bound to a
    pod on node A; "agent-unbound": a token of the agent's ServiceAccount bound to nothing;
    "planner"); `refusal` is a fragment of the policy's message when it must be refused."""

    name: str
    who: str
    node: str
    body: Callable[[], dict[str, Any]]
    refusal: str | None = None
    subresource: str = ""  # "/status": through nodes/status


NEW = "<new>"  # in a patch below: a fresh value (nonce)


def meta(field: str, kv: dict[str, str | None]) -> Callable[[], dict[str, Any]]:
    """A merge patch of these labels or annotations (`field`); NEW: a fresh value, None: remove."""
    def body() -> dict[str, Any]:
        return {"metadata": {field: {k: (nonce() if v is NEW else v) for k, v in kv.items()}}}
    return body


def annotations(kv: dict[str, str | None]) -> Callable[[], dict[str, Any]]:
    return meta("annotations", kv)


def labels(kv: dict[str, str | None]) -> Callable[[], dict[str, Any]]:
    return meta("labels", kv)


def taint() -> dict[str, Any]:
    return {"spec": {"taints": [{"key": "example.com/taint", "value": nonce(), "effect": "NoSchedule"}]}}


def cordon() -> dict[str, Any]:
    return {"spec": {"unschedulable": True}}


_count = itertools.count(1)


def counts(*resources: str) -> Callable[[], dict[str, Any]]:
    """A status merge patch setting these resources' capacity and allocatable to a new count."""
    def body() -> dict[str, Any]:
        n = str(next(_count))
        return {"status": {"capacity": {r: n for r in resources}, "allocatable": {r: n for r in resources}}}
    return body


def condition() -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": nonce()}]}}


def finalizer() -> dict[str, Any]:
    return {"metadata": {"finalizers": [f"example.com/{nonce()}"]}}


OWN_NODE = "may only modify the node its ServiceAccount token is bound to"
AGENT_ANNOTATIONS = "the dynpart agent may change no node annotation but dynpart.io/status-*; refused: "
AGENT_LABELS = "the dynpart agent may change no node label; refused: "
PLANNER_ANNOTATIONS = "the dynpart planner may change no node annotation but dynpart.io/spec-*; refused: "
PLANNER_LABELS = "the dynpart planner may change no node label; refused: "
AGENT_STATUS = ("the dynpart agent may change no node status but the capacity and allocatable of GPU slice resources "
                "(nvidia.com/gpu, nvidia.com/gpu-<N>gb, nvidia.com/mig-*), through nodes/status; refused: ")

ALLOWED = [
    Case("agent: its node's status-plan", "agent", "A", annotations({"dynpart.io/status-plan": NEW})),
    Case("agent: its node's status-capability", "agent", "A", annotations({"dynpart.io/status-capability": NEW})),
    Case("agent: any future status-* key", "agent", "A", annotations({"dynpart.io/status-some-future-key": NEW})),
    Case("agent: remove a status-* key", "agent", "A", annotations({"dynpart.io/status-error": None})),
    Case("planner: spec-plan on node A", "planner", "A", annotations({"dynpart.io/spec-plan": NEW})),
    Case("planner: spec-* on node B", "planner", "B", annotations({"dynpart.io/spec-plan": NEW, "dynpart.io/spec-mode": "mig"})),
    Case("planner: remove a spec-* key", "planner", "B", annotations({"dynpart.io/spec-gpu-0-1g.10gb": None})),
    # the agent's own device plugin publishes its slices' counts early (devicePlugin.publishAllocatable)
    Case("agent: its node's slice counts", "agent", "A",
         counts("nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.me", "nvidia.com/gpu-20gb", "nvidia.com/gpu"),
         subresource="/status"),
]
REFUSED = [
    Case("agent: another node's status-plan", "agent", "B", annotations({"dynpart.io/status-plan": NEW}), OWN_NODE),
    Case("agent: another node's device-plugin label", "agent", "B", labels({"nvidia.com/device-plugin.config": NEW}), OWN_NODE),
    # the nebuly fork's config label was the agent's until MPS nodes were served by its own plugin
    Case("agent: its node's device-plugin label", "agent", "A", labels({DEVICE_PLUGIN_LABEL: NEW}),
         AGENT_LABELS + DEVICE_PLUGIN_LABEL),
    Case("agent: the label with a status-* key", "agent", "A",
         lambda: {"metadata": {"labels": {DEVICE_PLUGIN_LABEL: nonce()}, "annotations": {"dynpart.io/status-plan": nonce()}}},
         AGENT_LABELS + DEVICE_PLUGIN_LABEL),
    Case("agent with a token bound to no pod: its node", "agent-unbound", "A", annotations({"dynpart.io/status-plan": NEW}),
         "(user extra authentication.kubernetes.io/node-name: none, the token is not bound to a pod on a node), not node "),
    Case("agent: spec-plan", "agent", "A", annotations({"dynpart.io/spec-plan": NEW}), AGENT_ANNOTATIONS + "dynpart.io/spec-plan"),
    Case("agent: a foreign annotation", "agent", "A", annotations({"foo/bar": NEW}), AGENT_ANNOTATIONS + "foo/bar"),
    Case("agent: a status-* key with a foreign one", "agent", "A", annotations({"dynpart.io/status-plan": NEW, "example.com/x": NEW}),
         AGENT_ANNOTATIONS + "example.com/x"),
    Case("agent: another label", "agent", "A", labels({"dynpart.io/gpu-partitioning": NEW}), AGENT_LABELS + "dynpart.io/gpu-partitioning"),
    Case("agent: a new label", "agent", "A", labels({"example.com/new": NEW}), AGENT_LABELS + "example.com/new"),
    Case("agent: a taint", "agent", "A", taint, "the dynpart agent may not change a node's spec"),
    Case("agent: cordon", "agent", "A", cordon, "the dynpart agent may not change a node's spec"),
    Case("agent: a finalizer", "agent", "A", finalizer, "the dynpart agent may not change a node's finalizers"),
    Case("planner: status-plan", "planner", "A", annotations({"dynpart.io/status-plan": NEW}),
         PLANNER_ANNOTATIONS + "dynpart.io/status-plan"),
    Case("planner: a foreign annotation", "planner", "B", annotations({"foo/bar": NEW}), PLANNER_ANNOTATIONS + "foo/bar"),
    Case("planner: the device-plugin label", "planner", "A", labels({"nvidia.com/device-plugin.config": NEW}),
         PLANNER_LABELS + DEVICE_PLUGIN_LABEL),
    Case("planner: the partitioning label", "planner", "B", labels({"dynpart.io/gpu-partitioning": NEW}),
         PLANNER_LABELS + "dynpart.io/gpu-partitioning"),
    Case("planner: a taint", "planner", "A", taint, "the dynpart planner may not change a node's spec"),
    Case("agent: another node's slice counts", "agent", "B", counts("nvidia.com/mig-1g.10gb"), OWN_NODE, "/status"),
    Case("agent: a foreign resource's count", "agent", "A", counts("nvidia.com/mig-1g.10gb", "example.com/x"),
         AGENT_STATUS + "example.com/x", "/status"),
    Case("agent: the node's cpu", "agent", "A", counts("cpu"), AGENT_STATUS + "cpu", "/status"),
    Case("agent: a status condition", "agent", "A", condition,
         AGENT_STATUS + "a status field other than capacity and allocatable", "/status"),
    # last: a removal is a change only once (the policy-less run below removes it)
    Case("agent: remove a foreign annotation", "agent", "A", annotations({"foo/bar": None}), AGENT_ANNOTATIONS + "foo/bar"),
]

# the probes of RBAC and policy (in)activity
AGENT_ALLOWED, PLANNER_ALLOWED = ALLOWED[0], next(c for c in ALLOWED if c.who == "planner")
AGENT_REFUSED = next(c for c in REFUSED if c.name == "agent: spec-plan")
PLANNER_REFUSED = next(c for c in REFUSED if c.who == "planner")


@dataclass
class Setup:
    client: Any  # charts/tools/dry_run.py Client, as the admin
    nodes: dict[str, str]  # "A"/"B" -> node name
    callers: dict[str, Caller]
    agent_pod: dict[str, Any]
    agent_review: dict[str, Any]  # SelfSubjectReview status of the agent's token
    objects: list[dict[str, Any]]

    def run(self, case: Case) -> tuple[int, Any]:
        return self.callers[case.who].patch_node(self.nodes[case.node], case.body(), case.subresource)


def _projection(setup: Setup) -> dict[str, Any]:
    """The DaemonSet's projected serviceAccountToken source."""
    ds = next(o for o in render(RELEASE, NS, "--set", "agent.runtimeClassName=")
              if o["kind"] == "DaemonSet" and o["metadata"]["name"] == AGENT)
    (projection,) = [s["serviceAccountToken"] for v in ds["spec"]["template"]["spec"]["volumes"] if "projected" in v
                     for s in v["projected"]["sources"] if "serviceAccountToken" in s]
    return dict(projection)


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name,
        "labels": {"dynpart.io/gpu-partitioning": "mig", DEVICE_PLUGIN_LABEL: "default"},
        "annotations": {"foo/bar": "x", "dynpart.io/spec-plan": "p0", "dynpart.io/spec-gpu-0-1g.10gb": "1@0",
                        "dynpart.io/status-plan": "p0", "dynpart.io/status-error": "none"}}}


def _apply(client: Any, obj: dict[str, Any]) -> None:
    """Create `obj`, or replace what a previous run left behind."""
    if client.ensure(obj):
        return
    name = urllib.parse.quote(obj["metadata"]["name"])
    current = client.request("GET", f"{client.collection(obj)}/{name}")
    obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
    client.request("PUT", f"{client.collection(obj)}/{name}", obj)


def _admin_patch(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A merge patch as the admin (the client's `request` sends application/json only)."""
    req = urllib.request.Request(client.server + path, method="PATCH", data=json.dumps(body).encode())
    req.add_header("Content-Type", MERGE_PATCH)
    with client.opener.open(req, timeout=30) as resp:
        return dict(json.loads(resp.read()))


def _token(client: Any, sa: str, bound_to: dict[str, Any] | None, expiration_s: int = 3607) -> str:
    spec: dict[str, Any] = {"expirationSeconds": expiration_s}
    if bound_to is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": bound_to["kind"], "name": bound_to["metadata"]["name"],
                                  "uid": bound_to["metadata"]["uid"]}
    review = client.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token",
                            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    return str(review["status"]["token"])


def _refused_by(status: int, message: Any, policy: str) -> bool:
    return status == 403 and f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request" in str(message)


@pytest.fixture(scope="module")
def setup(e2e_cluster) -> Iterator[Setup]:
    _require_tools()
    client = _dry_run_module().Client(e2e_cluster.kubeconfig)
    rendered = render(RELEASE, NS, "--set", "agent.runtimeClassName=", "--set", "labelPolicy.enabled=false",
                      "--set", "podEnvPolicy.enabled=false")
    # (no RuntimeClass on the test cluster; the label policy is tested apart: it refuses two of the
    # writes here; the pod-env policy too, tests/e2e/test_pod_env_policy.py)
    objects = [o for o in rendered if o["kind"] in KINDS]
    assert {o["kind"] for o in objects} == set(KINDS)
    suffix = os.urandom(3).hex()
    nodes = {k: f"lp-node-{k.lower()}-{suffix}" for k in ("A", "B")}
    agent_pod: dict[str, Any] = {}
    try:
        client.ensure({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for o in objects:
            _apply(client, o)
        for name in nodes.values():
            client.ensure(_node(name))
        # the agent's pod on node A, from the DaemonSet's template, as the DaemonSet controller makes it
        ds = next(o for o in rendered if o["kind"] == "DaemonSet" and o["metadata"]["name"] == AGENT)
        template = ds["spec"]["template"]
        agent_pod = client.create({"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {**template["metadata"], "name": f"{AGENT}-{suffix}", "namespace": NS},
                                   "spec": {**template["spec"], "nodeName": nodes["A"]}}, dry_run=False)
        # its token, as the kubelet requests it for the pod's projected serviceAccountToken volume
        (projection,) = [s["serviceAccountToken"] for v in template["spec"]["volumes"] if "projected" in v
                         for s in v["projected"]["sources"] if "serviceAccountToken" in s]
        assert "audience" not in projection  # the API server's own audience
        agent_token = _token(client, AGENT, agent_pod, projection["expirationSeconds"])
        server, ca = e2e_cluster.server, str(e2e_cluster.ca_file)
        callers = {"agent": Caller(server, ca, agent_token),
                   "agent-unbound": Caller(server, ca, _token(client, AGENT, None, 600)),
                   "planner": Caller(server, ca, _token(client, PLANNER, None, 600))}
        status, review = callers["agent"].call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                               {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        assert status == 201, review
        s = Setup(client, nodes, callers, agent_pod, review["status"], objects)
        # RBAC first (the allowed requests pass), then both policies (a known-refused request is refused)
        wait_for("the agent's RBAC", lambda: s.run(AGENT_ALLOWED)[0] == 200)
        wait_for("the planner's RBAC", lambda: s.run(PLANNER_ALLOWED)[0] == 200)
        wait_for("the agent's Event role", lambda: _post_event(callers["agent"], EVENTS_NS, nodes["A"], dry_run=True)[0] == 201)
        wait_for("the agent's node-write policy", lambda: _refused_by(*s.run(AGENT_REFUSED), AGENT_POLICY))
        wait_for("the planner's node-write policy", lambda: _refused_by(*s.run(PLANNER_REFUSED), PLANNER_POLICY))
        yield s
    finally:
        _clean_up(client, nodes, agent_pod, objects)
        client.close()


EVENTS_NS = "default"  # where dynpart/kube/events.py posts an Event about a Node (cluster-scoped)


def _event(namespace: str, node: str, reason: str = "LeastPrivilegeProbe") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": f"{node}.", "namespace": namespace},
            "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": node, "uid": node},
            "reason": reason, "message": "a probe", "type": "Normal", "source": {"component": "dynpart-agent"}}


def _post_event(caller: Caller, namespace: str, node: str, dry_run: bool = False,
                group_version: str = "api/v1") -> tuple[int, Any]:
    query = "?dryRun=All" if dry_run else ""
    return caller.call("POST", f"/{group_version}/namespaces/{namespace}/events{query}", _event(namespace, node))


def _clean_up(client: Any, nodes: dict[str, str], agent_pod: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    dr = _dry_run_module()
    if agent_pod:  # no kubelet to confirm the termination: no grace period
        try:
            client.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{agent_pod['metadata']['name']}?gracePeriodSeconds=0")
        except dr.ApiError as e:
            assert e.status == 404, e
    for name in nodes.values():
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        try:  # the policy-less test leaves a finalizer the agent added
            _admin_patch(client, f"/api/v1/nodes/{name}", {"metadata": {"finalizers": None}})
        except urllib.error.HTTPError as e:
            assert e.code == 404, e
        client.delete(node)
    for o in reversed(objects):
        client.delete(o)
    client.delete({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})


def test_the_agents_token_names_its_node(setup):
    """What the policy relies on: the pod-bound token carries the node in the user extra."""
    user = setup.agent_review["userInfo"]
    assert user["username"] == f"system:serviceaccount:{NS}:{AGENT}"
    assert user["extra"][NODE_NAME_EXTRA] == [setup.nodes["A"]]
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == [setup.agent_pod["metadata"]["name"]]


def _claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def test_the_agents_token_expires_as_requested(setup):
    """The token the kubelet gets for the DaemonSet's projected volume lives no longer than the
    volume asks: the API server stretches a pod-bound token requested for exactly 3607 s (the
    auto-mounted value) to a year (--service-account-extend-token-expiration, on by default), so a
    token copied off a node would keep patching that node's status for as long as its agent pod
    runs. The kubelet renews the token at 80 % of the requested lifetime; the client rereads it."""
    claims = _claims(setup.callers["agent"].token)
    asked = _projection(setup)["expirationSeconds"]
    assert claims["exp"] - claims["iat"] <= asked, (
        f"the agent's token lives {claims['exp'] - claims['iat']} s, asked for {asked} s")
    assert claims["kubernetes.io"]["node"]["name"] == setup.nodes["A"]  # still bound to its pod and node


@pytest.mark.parametrize("case", ALLOWED, ids=lambda c: c.name)
def test_allowed(setup, case):
    status, body = setup.run(case)
    assert status == 200, body


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_refused_by_the_policy(setup, case):
    status, message = setup.run(case)
    policy = PLANNER_POLICY if case.who == "planner" else AGENT_POLICY
    assert _refused_by(status, message, policy), f"expected a refusal by {policy}, got {status}: {'allowed' if status == 200 else message}"
    assert case.refusal and case.refusal in message, message
    if case.node == "B" and case.who == "agent":
        assert message.endswith(f"(user extra {NODE_NAME_EXTRA}: {setup.nodes['A']}), not node {setup.nodes['B']}")


async def test_the_agent_posts_its_node_events(setup):
    """The agent's own Event path (agent.kube.KubeNodeApi.event -> dynpart.kube.events.post_event, a
    core/v1 POST) with the agent's pod-bound token: the Event about its Node lands in `default`,
    which the chart's Role there allows (no ClusterRole grants events any more). post_event only
    logs a refusal, so the Event is looked for afterwards."""
    from kubernetes_asyncio import client as k

    from dynpart.agent.kube import KubeNodeApi

    caller, node = setup.callers["agent"], setup.nodes["A"]
    cfg = k.Configuration()
    cfg.host, cfg.ssl_ca_cert = caller.server, caller.ca_file
    cfg.api_key, cfg.api_key_prefix = {"BearerToken": caller.token}, {"BearerToken": "Bearer"}
    reason = f"LeastPrivilege{nonce()}"
    async with k.ApiClient(cfg) as api:
        await KubeNodeApi(api, node).event(reason, "posted with the agent's token")
    events = setup.client.request("GET", f"/api/v1/namespaces/{EVENTS_NS}/events?fieldSelector=reason%3D{reason}")
    try:
        assert [(e["involvedObject"]["kind"], e["involvedObject"]["name"], e["source"]["component"])
                for e in events["items"]] == [("Node", node, "dynpart-agent")], events["items"]
    finally:
        for e in events["items"]:
            setup.client.request("DELETE", f"/api/v1/namespaces/{EVENTS_NS}/events/{e['metadata']['name']}")


@pytest.mark.parametrize("namespace, group_version", [
    (NS, "api/v1"),  # its own release namespace
    ("kube-system", "api/v1"),
    (EVENTS_NS, "apis/events.k8s.io/v1"),  # it posts core/v1 Events only
])
def test_the_agent_may_not_post_events_elsewhere(setup, namespace, group_version):
    """RBAC: events create in `default` only (a Role there), so not in any other namespace."""
    status, message = _post_event(setup.callers["agent"], namespace, setup.nodes["A"], group_version=group_version)
    assert status == 403, f"{namespace} {group_version}: {status} {message}"
    assert f'cannot create resource "events" in API group "{"events.k8s.io" if "events.k8s.io" in group_version else ""}" ' \
        f'in the namespace "{namespace}"' in message, message


def test_status_only_through_the_subresource(setup):
    """A status change in a patch of the node itself is dropped by the API server (the main
    resource ignores status); through nodes/status the agent may change only the slice counts."""
    node = setup.nodes["A"]
    status, body = setup.callers["agent"].patch_node(node, counts("nvidia.com/mig-7g.80gb")())
    assert status == 200 and "nvidia.com/mig-7g.80gb" not in (body.get("status") or {}).get("capacity", {}), body
    status, body = setup.callers["agent"].patch_node(node, counts("nvidia.com/mig-7g.80gb")(), "/status")
    assert status == 200 and "nvidia.com/mig-7g.80gb" in body["status"]["allocatable"], body


def test_other_users_are_not_affected(setup):
    """Matched by the two ServiceAccounts' user names only: an admin changes anything."""
    client, node = setup.client, setup.nodes["A"]
    patched = _admin_patch(client, f"/api/v1/nodes/{node}", {"metadata": {"annotations": {"foo/bar": "admin"}, "labels": {"x": "y"}},
                                                             "spec": {"taints": [{"key": "example.com/t", "effect": "NoSchedule"}]}})
    assert patched["metadata"]["annotations"]["foo/bar"] == "admin" and patched["metadata"]["labels"]["x"] == "y"
    assert patched["spec"]["taints"] == [{"key": "example.com/t", "effect": "NoSchedule"}]


def test_without_the_policy_rbac_allows_every_refused_request(setup):
    """Each refusal above is the policy's doing: with its bindings deleted, RBAC lets every one of
    those requests through (so each assertion of test_refused_by_the_policy can fail)."""
    bindings = [o for o in setup.objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert {b["metadata"]["name"] for b in bindings} == {AGENT_POLICY, PLANNER_POLICY}
    for b in bindings:
        setup.client.delete(b)
    try:
        wait_for("the agent's policy removal", lambda: setup.run(AGENT_REFUSED)[0] == 200)
        wait_for("the planner's policy removal", lambda: setup.run(PLANNER_REFUSED)[0] == 200)
        results = {case.name: setup.run(case) for case in REFUSED}
        assert {name: r for name, r in results.items() if r[0] != 200} == {}
    finally:  # as it was, whatever runs next
        for b in bindings:
            _apply(setup.client, b)
        wait_for("the agent's node-write policy", lambda: _refused_by(*setup.run(AGENT_REFUSED), AGENT_POLICY))
        wait_for("the planner's node-write policy", lambda: _refused_by(*setup.run(PLANNER_REFUSED), PLANNER_POLICY))
