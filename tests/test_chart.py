"""The Helm chart charts/dynpart: lint, render, validate (charts/check.sh) and rendered facts.

Needs helm, kubeconform and the Kubernetes JSON schemas from `bash charts/build-tools.sh`
(built from Go modules into .cache/). Without them these tests skip, except in CI (CI=true)
where that is an error. The server-side dry run against a real API server is
tests/e2e/test_chart_dry_run.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "dynpart"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
CACHE = Path(os.environ.get("DYNPART_TOOLS_CACHE") or ROOT / ".cache")
HELM = CACHE / "tools" / "bin" / "helm"
KUBECONFORM = CACHE / "tools" / "bin" / "kubeconform"
SCHEMAS = CACHE / "kube-schemas"
NAMESPACE = "dynpart-system"
PARTITIONING_LABEL = "dynpart.io/gpu-partitioning"
AGENT_DS = "dynpart-agent"
MPS_CONTROL_DS = "dynpart-mps-control"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _require_tools() -> None:
    missing = [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
               for p in (HELM, KUBECONFORM) if not os.access(p, os.X_OK)]
    if not (SCHEMAS / "current").is_file():
        missing.append(f"{SCHEMAS}/current")
    if not missing:
        return
    message = f"chart tools not built ({', '.join(missing)}): run bash charts/build-tools.sh"
    if _in_ci():
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(message)


def render(*args: str, release: str = "dynpart", namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    _require_tools()
    proc = subprocess.run([str(HELM), "template", release, str(CHART), "--namespace", namespace, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''} in the rendering"
    return hits[0]


def rules(role: dict[str, Any]) -> dict[tuple[str, str, tuple[str, ...]], set[str]]:
    """(apiGroup, resource, resourceNames) -> verbs, one key per combination."""
    out: dict[tuple[str, str, tuple[str, ...]], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res, tuple(rule.get("resourceNames") or ())), set()).update(rule["verbs"])
    return out


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def full() -> list[dict[str, Any]]:
    return render("-f", str(FULL_VALUES))


def test_check_script_lints_and_validates(default, full):
    """helm lint (also --strict, ServiceMonitor, full values), schema refusals, kubeconform -strict."""
    _require_tools()
    env = {k: v for k, v in os.environ.items() if k != "DYNPART_E2E_KUBECONFIG"}  # dry run: the e2e test
    proc = subprocess.run(["bash", str(ROOT / "charts" / "check.sh")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, f"charts/check.sh failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "all chart checks passed" in proc.stdout
    for objs in (default, full):
        assert f"Valid: {len(objs)}, Invalid: 0, Errors: 0, Skipped: 0" in proc.stdout, proc.stdout[-2000:]


def test_planner_deployment(default):
    dep = find(default, "Deployment")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["planner", "run", "--config", "/etc/dynpart/planner.yaml"]
    env = {e["name"]: e for e in c["env"]}
    assert env["DYNPART_PLANNER_IDENTITY"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    # not privileged, not root, nothing to escalate to, the runtime's seccomp profile
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert "hostPath" not in str(pod["volumes"]) and not pod.get("hostNetwork")
    assert pod["serviceAccountName"] == "dynpart-planner"


def test_planner_config_is_valid_planner_settings(default, full, tmp_path, monkeypatch):
    from dynpart.settings import PlannerSettings, load_settings

    for objs, catalog in ((default, []), (full, ["/etc/dynpart/catalog/extra.yaml"])):
        text = find(objs, "ConfigMap", "dynpart-planner")["data"]["planner.yaml"]
        (tmp_path / "planner.yaml").write_text(text)
        monkeypatch.setenv("DYNPART_PLANNER_IDENTITY", "dynpart-planner-abc")
        s = load_settings(PlannerSettings, tmp_path / "planner.yaml")
        assert s.lease_namespace == NAMESPACE and s.leader_election and s.identity == "dynpart-planner-abc"
        assert s.catalog_files == catalog
        assert s.metrics_host == ("0.0.0.0" if objs is default else "::")
    # values reach the settings
    assert (s.batch_idle_s, s.batch_timeout_s, s.ack_timeout_s, s.plan_time_limit_s) == (1, 5.5, 120, 2)
    assert (s.log_level, s.log_json, s.metrics_port, s.lease_name) == ("DEBUG", False, 9100, "dynpart-planner-test")
    assert [(w.resource, w.count, w.gpu_models, w.weight) for w in s.workload] == [
        ("nvidia.com/mig-1g.10gb", 1, [], 5.0), ("nvidia.com/gpu", 2, ["H100-80GB"], 1.0), ("nvidia.com/mig-3g.40gb", 1, [], 1.0)]
    pooled = s.workload[2]
    assert pooled.node_selector == {"pool": "training"} and pooled.tolerations[0].key == "team"
    assert pooled.node_affinity[0].match_expressions[0].values == ("z1",)


def test_agent_may_stay_during_driver_upgrades():
    objs = render("--set", "agent.leaveDuringDriverUpgrade=false")
    for name in (AGENT_DS, MPS_CONTROL_DS):  # (the MPS daemon too: a CUDA client of the driver)
        ds = find(objs, "DaemonSet", name)
        terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
            {"key": PARTITIONING_LABEL, "operator": "In", "values": ["mig", "mps"]}]}]


def test_agent_daemonset(default):
    ds = find(default, "DaemonSet", AGENT_DS)
    pod = ds["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": PARTITIONING_LABEL, "operator": "In", "values": ["mig", "mps"]},
        # off the node while GPU Operator's upgrade controller swaps the driver (agent.leaveDuringDriverUpgrade)
        {"key": "nvidia.com/gpu-driver-upgrade-state", "operator": "NotIn",
         "values": ["pod-restart-required", "validation-required"]}]}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "system-node-critical"
    c = container(pod, "agent")
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    assert c["securityContext"]["privileged"] is True  # MIG: CAP_SYS_ADMIN on the GPUs (agent.privileged)
    # (no effect on a privileged container, which runtimes run unconfined; it applies with privileged: false)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["pod-resources"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert vols["state"]["hostPath"] == {"path": "/var/lib/dynpart", "type": "DirectoryOrCreate"}  # the node lock
    # the agent's own device plugin (every node in builtin mode, MPS nodes always): its sockets beside the kubelet's
    assert vols["device-plugins"]["hostPath"] == {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}
    assert {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"} in c["volumeMounts"]
    # the host's device nodes, looked at by the plugin's Allocate to list only existing ones as DeviceSpecs
    assert vols["nvidia-dev"]["hostPath"] == {"path": "/dev", "type": "Directory"}
    assert {"name": "nvidia-dev", "mountPath": "/host/nvidia-dev", "readOnly": True} in c["volumeMounts"]
    assert [v for v in pod["volumes"] if "hostPath" in v] == [vols["pod-resources"], vols["state"], vols["device-plugins"],
                                                              vols["nvidia-dev"]]
    # the MPS control daemon, which shares memory with its clients, runs in the mps-control pods
    assert "hostIPC" not in pod and [x["name"] for x in pod["containers"]] == ["agent"]
    # a replaced agent leaves the MIG instances, the MPS daemon and their pods running: rolled, a
    # node at a time, each once its agent is ready (a version that cannot start stops the roll)
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"} and ds["spec"]["minReadySeconds"] > 0
    assert {"name": "state", "mountPath": "/var/lib/dynpart", "mountPropagation": "HostToContainer"} in c["volumeMounts"]
    assert "device-plugin-config" not in vols and c["args"] == ["agent", "run", "--config", "/etc/dynpart/agent.yaml",
                                                                "--node", "$(NODE_NAME)"]  # no ConfigMap of MPS configs


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in pod["containers"] if c["name"] == name]
    return c


def test_mps_control_daemonset_outlives_agent_replacements(default, full, tmp_path, monkeypatch):
    """The MPS control daemon runs in a DaemonSet of its own, `mps-control`, so that an agent's
    restart or replacement (a rolling upgrade) leaves it, and the node's MPS clients, running: on
    the agent's nodes (a node switched to MIG keeps its MPS pods, and their daemon, until they
    end), updated only on delete, the supervisor's command line (parsed by the real parser), the
    GPU environment, the host's IPC namespace, no liveness probe, no memory limit, no API
    credential, and the agent's state directory on the host, where the agent's settings put
    mps_control_dir: either pod replaced finds what the other wrote."""
    from dynpart.cli import build_parser

    for objs in (default, full):
        agent_ds, ds = find(objs, "DaemonSet", AGENT_DS), find(objs, "DaemonSet", MPS_CONTROL_DS)
        agent_pod, pod = agent_ds["spec"]["template"]["spec"], ds["spec"]["template"]["spec"]
        assert ds["spec"]["updateStrategy"]["type"] == ("OnDelete" if objs is default else "RollingUpdate")
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "mps-control"
        assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # the two DaemonSets select each other's pods in no way
        agent_labels = agent_ds["spec"]["template"]["metadata"]["labels"]
        assert not agent_ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert not ds["spec"]["selector"]["matchLabels"].items() <= agent_labels.items()
        # nothing but the selector's labels: a chart or app version in them would leave this OnDelete
        # DaemonSet out of date at every upgrade (a drain and a deletion on every node)
        assert labels == ds["spec"]["selector"]["matchLabels"]
        for key in ("affinity", "tolerations", "nodeSelector", "runtimeClassName", "priorityClassName"):
            assert pod.get(key) == agent_pod.get(key), key
        assert objs is default or pod["nodeSelector"]  # (full-values sets one)
        (mps,) = pod["containers"]
        agent = container(agent_pod, "agent")
        ns = build_parser().parse_args(mps["args"])
        assert (ns.command, ns.agent_command) == ("agent", "mps-control")
        assert mps["image"] == agent["image"]
        env = {e["name"]: e.get("value") for e in mps["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
        assert "livenessProbe" not in mps and "readinessProbe" not in mps and "livenessProbe" in agent
        # privileged as the agent, else SETUID and SETGID only (never the agent's SYS_ADMIN)
        sc = mps["securityContext"]
        assert sc["privileged"] is agent["securityContext"]["privileged"] and sc["runAsUser"] == 0
        if not sc["privileged"]:
            assert "SYS_ADMIN" in agent["securityContext"]["capabilities"]["add"]  # (full-values)
            assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}
        assert "memory" not in mps["resources"].get("limits", {})  # an OOM kill would end every MPS client
        assert pod["automountServiceAccountToken"] is False
        assert "projected" not in str(pod["volumes"]) and not mps.get("ports")
        vols = {v["name"]: v for v in pod["volumes"]}
        agent_vols = {v["name"]: v for v in agent_pod["volumes"]}
        state = next(m for m in agent["volumeMounts"] if m["name"] == "state")
        assert state in mps["volumeMounts"] and vols["state"] == agent_vols["state"]
        assert ns.control_dir.startswith(state["mountPath"] + "/")  # on the host, in both pods
        _, s = _agent_settings(objs, tmp_path, monkeypatch)
        assert s.mps_control_dir == ns.control_dir  # the agent asks where the supervisor reads
        planner = yaml.safe_load(find(objs, "ConfigMap", "dynpart-planner")["data"]["planner.yaml"])
        # the MPS server finds its own PID through /proc/self (agent.mpsControl.hostPID, off in full)
        # (and the agent sees every GPU process through NVML with agent.hostPID, on in both)
        assert pod.get("hostPID", False) is (objs is default) and agent_pod["hostPID"] is True
        assert ({e["name"]: e.get("value") for e in mps["env"]}.get("TINI_SUBREAPER") == "1") is (objs is default)
        if objs is default:
            # agent.mpsShm.mode tmpfs: the daemon's own /dev/shm, a tmpfs an init container mounts
            # on the host, which the agent's device plugin gives its clients: no hostIPC anywhere
            assert "hostIPC" not in pod and planner["mps_clients_host_ipc"] is False
            (init,) = pod["initContainers"]
            init_ns = build_parser().parse_args(init["args"])
            assert (init_ns.agent_command, init_ns.shm_dir, init_ns.size) == ("mps-shm", ns.shm_dir, "")
            assert init["securityContext"]["privileged"] is True and init["image"] == mps["image"]
            assert {"name": "state", "mountPath": state["mountPath"], "mountPropagation": "Bidirectional"} \
                in init["volumeMounts"]
            assert ns.shm_dir == state["mountPath"] + "/mps-shm"  # seen there too: the supervisor checks it
            assert {"name": "mps-shm", "mountPath": "/dev/shm"} in mps["volumeMounts"]
            assert vols["mps-shm"]["hostPath"] == {"path": ns.shm_dir, "type": "DirectoryOrCreate"}
            # only the init container propagates mounts to the host (a privileged container's)
            assert "Bidirectional" not in str([*mps["volumeMounts"], *agent["volumeMounts"]])
            assert state["mountPropagation"] == "HostToContainer"  # no private copy of an old tmpfs
        else:
            # hostIPC: the daemon and its clients in the host's IPC namespace, nothing mounted
            assert pod["hostIPC"] is True and planner["mps_clients_host_ipc"] is True
            assert "initContainers" not in pod and ns.shm_dir is None and "mps-shm" not in vols
            assert not any(c["securityContext"].get("privileged") for c in pod["containers"])


def test_agent_with_nvidias_device_plugin():
    """devicePlugin.mode=nvidia: NVIDIA's plugin on MIG nodes, the agent's own on MPS nodes (so the
    device-plugin socket dir, the MPS daemon's pods and nodes/status stay); a Role to restart
    NVIDIA's plugin pod in its namespace, narrowed by the pod-deletion policy."""
    objs = render("--set", "devicePlugin.mode=nvidia", "--set", "devicePlugin.nvidia.namespace=gpu-op",
                  "--set", "devicePlugin.nvidia.selector=app=nvidia-device-plugin-daemonset")
    pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert "device-plugins" in {v["name"] for v in pod["volumes"]}
    assert find(objs, "DaemonSet", MPS_CONTROL_DS)["spec"]["template"]["spec"]["initContainers"]
    assert ("", "nodes/status", ()) in rules(find(objs, "ClusterRole", "dynpart-agent"))
    role = find(objs, "Role", "dynpart-agent-nvidia-plugin-restart")
    assert role["metadata"]["namespace"] == "gpu-op" and rules(role) == {("", "pods", ()): {"list", "delete"}}
    policy = find(objs, "ValidatingAdmissionPolicy", "dynpart-agent-pod-deletes")
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["DELETE"]
    checks = [v["expression"] for v in policy["spec"]["validations"]]
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name'] == [oldObject.spec.nodeName]" in checks[0]
    assert checks[1] == ('("app" in oldObject.metadata.?labels.orValue({}) && '
                         'oldObject.metadata.labels["app"] == "nvidia-device-plugin-daemonset")')
    find(objs, "ValidatingAdmissionPolicyBinding", "dynpart-agent-pod-deletes")
    agent_policy, _ = _policy_pair(objs, "agent")  # the slice counts of MPS nodes, through nodes/status
    assert "request.operation != 'UPDATE' || object.status == oldObject.status" not in [
        v["expression"] for v in agent_policy["spec"]["validations"]]
    no_publish = render("--set", "devicePlugin.mode=nvidia", "--set", "devicePlugin.publishAllocatable=false")
    agent_policy, _ = _policy_pair(no_publish, "agent")  # no status writes to allow
    assert "request.operation != 'UPDATE' || object.status == oldObject.status" in [
        v["expression"] for v in agent_policy["spec"]["validations"]]
    proc = subprocess.run([str(HELM), "template", "x", str(CHART), "--set", "devicePlugin.mode=nvidia",
                           "--set-string", "devicePlugin.nvidia.selector=app!=x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "/devicePlugin/nvidia/selector" in proc.stderr  # not what the policy can check


def test_agent_token_is_pod_bound_and_projected(default, full):
    """The agent's API credential is a projected ServiceAccount token (bound to its pod, so it
    names the pod's node, which the node-write policy checks), mounted where in-cluster clients
    look for it, with the CA and namespace beside it: what the ServiceAccount admission plugin
    would mount, made explicit (automount off)."""
    for objs in (default, full):
        pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        vols = {v["name"]: v for v in pod["volumes"]}
        sources = vols["kube-api-access"]["projected"]["sources"]
        assert sources == [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},  # the API server's audience; not 3607 (a year)
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ]
        c = container(pod, "agent")
        mount = next(m for m in c["volumeMounts"] if m["name"] == "kube-api-access")
        assert mount == {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}


# The API server gives a pod-bound token requested for exactly 3607 s (the ServiceAccount admission
# plugin's auto-mounted value) a lifetime of one year, or --service-account-max-token-expiration
# (--service-account-extend-token-expiration, on by default; pkg/registry/core/serviceaccount/
# storage/token.go): a token copied out of the pod then works for as long as the pod lives, not
# for an hour. Any other value is honoured as asked.
WARN_ONLY_TOKEN_SECONDS = 3607


def test_api_tokens_are_not_extended_to_a_year(default, full):
    """Both components' API credentials are projected tokens bound to their pod, requested for an
    hour at most and never for the 3607 s that the API server stretches to a year: a leaked
    token of the planner (every pod's spec, every node's spec-* annotations) or of an agent stops
    working within the hour, as the kubelet's renewals replace it."""
    for objs in (default, full):
        for kind, name, cname in (("DaemonSet", AGENT_DS, "agent"), ("Deployment", "dynpart-planner", "planner")):
            pod = find(objs, kind, name)["spec"]["template"]["spec"]
            assert pod["automountServiceAccountToken"] is False, name  # (an auto-mounted token is 3607 s)
            vols = {v["name"]: v for v in pod["volumes"]}
            (token,) = [s["serviceAccountToken"] for s in vols["kube-api-access"]["projected"]["sources"]
                        if "serviceAccountToken" in s]
            assert "audience" not in token, name  # the API server's own
            assert token["expirationSeconds"] != WARN_ONLY_TOKEN_SECONDS, name
            assert 600 <= token["expirationSeconds"] <= 3600, name
            mount = next(m for m in container(pod, cname)["volumeMounts"] if m["name"] == "kube-api-access")
            assert mount == {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                             "readOnly": True}, name


def _agent_settings(objs: list[dict[str, Any]], tmp_path: Path, monkeypatch,
                    environ: dict[str, str] | None = None) -> tuple[Any, Any]:
    """The rendered agent command line parsed by the real `dynpart` parser, and the AgentSettings
    it yields with the rendered config file (as `dynpart agent run` builds them), in an
    environment without DYNPART_AGENT_* variables but those of `environ`."""
    from dynpart.cli import build_parser
    from dynpart.settings import AgentSettings, load_settings

    pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    c = container(pod, "agent")
    env = {e["name"]: e.get("value", "gpu-node-1") for e in c["env"]}  # fieldRefs: the node name
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    ns = build_parser().parse_args(args)
    assert (ns.command, ns.agent_command) == ("agent", "run")
    cm = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}["config"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert ns.config == mount["mountPath"]
    (tmp_path / "agent.yaml").write_text(find(objs, "ConfigMap", cm)["data"][mount["subPath"]])
    for k in [k for k in os.environ if k.startswith("DYNPART_AGENT_")]:
        monkeypatch.delenv(k)
    for k, v in (environ or {}).items():
        monkeypatch.setenv(k, v)
    flags = {k: getattr(ns, k, None) for k in ("node_name", "report_interval_s", "log_level", "metrics_port")}
    return ns, load_settings(AgentSettings, tmp_path / "agent.yaml", flags)


def test_agent_command_line_and_settings(default, full, tmp_path, monkeypatch):
    ns, s = _agent_settings(default, tmp_path, monkeypatch)
    assert s.node_name == "gpu-node-1" and s.report_interval_s == 10 and s.metrics_host == "0.0.0.0"
    assert s.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert s.catalog_files == []
    assert (s.device_plugin, s.device_plugin_dir, s.publish_allocatable) == ("builtin", "/var/lib/kubelet/device-plugins", True)
    assert s.device_list_strategy == "envvar"
    assert (s.device_specs, s.nvidia_dev_root, s.nvidia_dev_dir) == (True, "/", "/host/nvidia-dev")
    assert (s.nvidia_plugin_namespace, s.nvidia_plugin_selector) == ("gpu-operator", "app=nvidia-device-plugin-daemonset")
    ns, s = _agent_settings(full, tmp_path, monkeypatch)
    assert s.catalog_files == ["/etc/dynpart/catalog/extra.yaml"] and s.device_list_strategy == "volume-mounts"
    assert (s.report_interval_s, s.log_level, s.log_json, s.metrics_port) == (5, "DEBUG", False, 9100)
    assert s.metrics_host == "::"


def service_link_env(objs: list[dict[str, Any]], pod: dict[str, Any] | None = None,
                     namespace: str = NAMESPACE) -> dict[str, str]:
    """The variables the kubelet adds to every container of a pod in `namespace` for the rendered
    Services there (pkg/kubelet/envvars FromServices, Docker-link style), or none when the pod spec
    says enableServiceLinks: false (`pod` None: as if it did not)."""
    if pod is not None and pod.get("enableServiceLinks", True) is False:
        return {}
    env: dict[str, str] = {}
    services = [o for o in objs if o["kind"] == "Service" and o["metadata"]["namespace"] == namespace]
    for n, svc in enumerate(services):
        spec = svc["spec"]
        if spec.get("type") == "ExternalName" or spec.get("clusterIP") == "None":
            continue  # no cluster IP: no variables
        ip = f"10.96.0.{10 + n}"
        prefix = svc["metadata"]["name"].upper().replace("-", "_")
        ports = spec["ports"]
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        for i, port in enumerate(ports):
            proto = port.get("protocol", "TCP")
            url = f"{proto.lower()}://{ip}:{port['port']}"
            if i == 0:
                env[f"{prefix}_PORT"] = url
            p = f"{prefix}_PORT_{port['port']}_{proto.upper()}"
            env.update({p: url, f"{p}_PROTO": proto.lower(), f"{p}_PORT": str(port["port"]), f"{p}_ADDR": ip})
    return env


def test_service_links_cannot_set_the_settings(default, full, tmp_path, monkeypatch):
    """The kubelet gives every pod <SERVICE>_PORT=tcp://<ip>:<port> and the like for each Service of
    its namespace; the planner's metrics Service of the release `dynpart`, dynpart-planner-metrics,
    makes DYNPART_PLANNER_METRICS_PORT, which pydantic-settings reads as metrics_port. Both pod
    specs turn service links off, so both components load their settings with what the kubelet
    injects."""
    from dynpart.errors import DynpartError
    from dynpart.settings import PlannerSettings, load_settings

    for k in [k for k in os.environ if k.startswith("DYNPART_")]:
        monkeypatch.delenv(k)
    for objs, port in ((default, 9090), (full, 9100)):
        # what the pods would get without enableServiceLinks: false
        links = service_link_env(objs)
        assert links["DYNPART_PLANNER_METRICS_PORT"] == f"tcp://10.96.0.10:{port}"
        assert links[f"DYNPART_PLANNER_METRICS_PORT_{port}_TCP_ADDR"] == "10.96.0.10"
        planner = find(objs, "Deployment")["spec"]["template"]["spec"]
        agent = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
        (tmp_path / "planner.yaml").write_text(find(objs, "ConfigMap", "dynpart-planner")["data"]["planner.yaml"])
        with monkeypatch.context() as m:
            for k, v in {**service_link_env(objs, planner), "DYNPART_PLANNER_IDENTITY": "p-0"}.items():
                m.setenv(k, v)
            assert load_settings(PlannerSettings, tmp_path / "planner.yaml").metrics_port == port
        with monkeypatch.context() as m:
            _, s = _agent_settings(objs, tmp_path, m, service_link_env(objs, agent))
            assert s.metrics_port == port
        assert planner.get("enableServiceLinks") is False and agent.get("enableServiceLinks") is False
        # with service links the planner would not start: its error names the cause
        with monkeypatch.context() as m:
            for k, v in links.items():
                m.setenv(k, v)
            with pytest.raises(DynpartError, match=r"DYNPART_PLANNER_METRICS_PORT\) \(this looks like a Kubernetes "
                                                   r"service link.*set enableServiceLinks: false on the pod\)"):
                load_settings(PlannerSettings, tmp_path / "planner.yaml")


def render_notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` does not render it (and
    `helm install --dry-run` needs a cluster), so a copy of the chart gets a template that includes
    it: every file of templates/ is a named template."""
    _require_tools()
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | toJson }}\n')
    proc = subprocess.run([str(HELM), "template", "dynpart", str(chart), "--namespace", NAMESPACE,
                           "--show-only", "templates/zz-notes.yaml", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return str(yaml.safe_load(proc.stdout)["data"]["notes"])


def test_notes_label_nodes_in_the_right_order(tmp_path):
    """NOTES print GPU Operator's labels (NVIDIA's device plugin, mig-manager off) before dynpart's
    own, as devicePlugin.mode needs them (docs/real-cluster.md, "Setup with GPU Operator")."""
    def label_commands(notes: str) -> list[str]:
        return [line.strip() for line in notes.splitlines() if line.strip().startswith("kubectl label node")]

    both_off = "kubectl label node <NODE> nvidia.com/gpu.deploy.device-plugin=false nvidia.com/gpu.deploy.mig-manager=false"
    mig, mps = (f"kubectl label node <NODE> {PARTITIONING_LABEL}={m}" for m in ("mig", "mps"))
    builtin = render_notes(tmp_path / "builtin")
    assert label_commands(builtin) == [both_off, mig, mps]
    assert "DoesNotExist" in builtin and "devicePlugin.mode=builtin" in builtin
    nvidia = render_notes(tmp_path / "nvidia", "--set", "devicePlugin.mode=nvidia",
                          "--set", "devicePlugin.nvidia.namespace=gpu-op")
    assert label_commands(nvidia) == ["kubectl label node <NODE> nvidia.com/gpu.deploy.mig-manager=false", mig,
                                      both_off, mps]
    assert "kubectl -n gpu-op get pods" in nvidia and "NotIn, values: [mps]" in nvidia


def test_notes_runtime_class_follows_the_device_list_strategy(tmp_path):
    """NOTES ask for runtimeClassName: nvidia-legacy (GPU Operator's CDI mode) only where the
    agent's own plugin names devices by UUID; a cdi-* strategy needs no RuntimeClass (review 171)."""
    envvar = " ".join(render_notes(tmp_path / "envvar").split())
    assert "needs runtimeClassName: nvidia-legacy" in envvar and "deviceListStrategy=cdi-cri" in envvar
    for strategy in ("cdi-cri", "cdi-annotations"):
        cdi = " ".join(render_notes(tmp_path / strategy, "--set", f"devicePlugin.deviceListStrategy={strategy}").split())
        assert "nvidia-legacy" not in cdi
        assert f"deviceListStrategy={strategy}): pods need no runtimeClassName" in cdi


def test_planner_rbac_is_minimal(default):
    """What the planner calls: informers (list+watch) on pods, claims, volumes, storage classes and
    nodes, a node read (before an overdue plan is judged replaced), a merge patch of a node's
    annotations, a POST of a core/v1 Event, and its Lease (read, replace, create)."""
    cr = find(default, "ClusterRole", "dynpart-planner")
    assert rules(cr) == {
        ("", "pods", ()): {"list", "watch"},
        ("", "persistentvolumeclaims", ()): {"list", "watch"},
        ("", "persistentvolumes", ()): {"list", "watch"},
        ("storage.k8s.io", "storageclasses", ()): {"list", "watch"},
        ("", "nodes", ()): {"get", "list", "watch", "patch"},
        ("", "events", ()): {"create"},
    }
    role = find(default, "Role", "dynpart-planner-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert rules(role) == {
        ("coordination.k8s.io", "leases", ("dynpart-planner",)): {"get", "update"},
        ("coordination.k8s.io", "leases", ()): {"create"},  # create cannot be limited by name
    }
    crb = find(default, "ClusterRoleBinding", "dynpart-planner")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "dynpart-planner", "namespace": NAMESPACE}]


def test_agent_rbac_is_minimal(default, full):
    """What the agent calls: its node (read, an informer with a name field selector, merge patches,
    and its status's slice-resource counts), a POST of a core/v1 Event, a list of the pods bound to
    its node (the bound-but-not-admitted race); no ConfigMap (MPS slices are served by its own
    device plugin). The pods on its GPUs come from the kubelet's PodResources socket."""
    assert rules(find(default, "ClusterRole", "dynpart-agent")) == {
        ("", "nodes", ()): {"get", "list", "watch", "patch"},
        ("", "nodes/status", ()): {"patch"},
        ("", "pods", ()): {"list"},
    }
    # Events only about its Node, which go to the namespace `default` (dynpart/kube/events.py):
    # create there only, whatever the release namespace
    events = find(default, "Role", "dynpart-agent-node-events")
    assert events["metadata"]["namespace"] == "default"
    assert rules(events) == {("", "events", ()): {"create"}}
    binding = find(default, "RoleBinding", "dynpart-agent-node-events")
    assert binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dynpart-agent-node-events"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dynpart-agent", "namespace": NAMESPACE}]
    no_publish = render("--set", "devicePlugin.publishAllocatable=false")
    assert ("", "nodes/status", ()) not in rules(find(no_publish, "ClusterRole", "dynpart-agent"))
    for objs in (default, full):
        agent_roles = [o for o in objs if o["kind"] in ("Role", "ClusterRole") and "agent" in o["metadata"]["name"]]
        assert not any(r for o in agent_roles for r in o["rules"] if "configmaps" in r["resources"])
        assert {o["metadata"]["name"] for o in agent_roles} == {"dynpart-agent", "dynpart-agent-planner-lease",
                                                                  "dynpart-agent-node-events"}


def test_no_wildcards_secrets_or_deletes(default, full):
    """(devicePlugin.mode=nvidia adds `delete pods` in NVIDIA's namespace: test_agent_with_nvidias_device_plugin.)"""
    for objs in (default, full):
        for role in (o for o in objs if o["kind"] in ("Role", "ClusterRole")):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], role["metadata"]["name"]
                assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
                assert "secrets" not in rule["resources"]


def test_one_service_account_each_and_bindings_point_to_them(default):
    sas = {o["metadata"]["name"] for o in default if o["kind"] == "ServiceAccount"}
    assert sas == {"dynpart-planner", "dynpart-agent"}
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["serviceAccountName"] for o in default
            if o["kind"] in ("Deployment", "DaemonSet")}
    # (mps-control mounts no token of it: test_mps_control_daemonset_outlives_agent_replacements)
    assert pods == {"dynpart-planner": "dynpart-planner", AGENT_DS: "dynpart-agent", MPS_CONTROL_DS: "dynpart-agent"}
    kinds = {(o["kind"], o["metadata"]["name"]) for o in default}
    for b in (o for o in default if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert (b["roleRef"]["kind"], b["roleRef"]["name"]) in kinds
        assert all(s["name"] in sas for s in b["subjects"])


def _policy_pair(objs: list[dict[str, Any]], component: str, fullname: str = "dynpart") -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"{fullname}-{component}-node-writes"
    return find(objs, "ValidatingAdmissionPolicy", name), find(objs, "ValidatingAdmissionPolicyBinding", name)


def test_node_write_policies(default):
    """One ValidatingAdmissionPolicy + binding per component, matched by its ServiceAccount's user
    name only, on Node writes (tests/e2e/test_least_privilege.py runs them on a real API server)."""
    for component, prefix in (("agent", "dynpart.io/status-"), ("planner", "dynpart.io/spec-")):
        policy, binding = _policy_pair(default, component)
        assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        assert spec["matchConstraints"]["resourceRules"] == [{
            "apiGroups": [""], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["nodes", "nodes/status"]}]
        sa = f"system:serviceaccount:{NAMESPACE}:dynpart-{component}"
        assert [c["expression"] for c in spec["matchConditions"]] == [f'request.userInfo.username == "{sa}"']
        assert sa.rsplit(":", 1)[1] in {o["metadata"]["name"] for o in default if o["kind"] == "ServiceAccount"}
        variables = {v["name"]: v["expression"] for v in spec["variables"]}
        assert f'!k.startsWith("{prefix}")' in variables["foreignAnnotations"]
        checks = [v["expression"] for v in spec["validations"]]
        assert all(v["reason"] == "Forbidden" for v in spec["validations"])
        assert "request.operation != 'UPDATE' || object.spec == oldObject.spec" in checks
        if component == "planner":
            assert "request.operation != 'UPDATE' || object.status == oldObject.status" in checks
        else:  # the slice resources' counts, through nodes/status only
            (status,) = [c for c in checks if "object.status == oldObject.status" in c]
            assert status == ("request.operation != 'UPDATE' || object.status == oldObject.status || "
                              "(request.subResource == 'status' && variables.foreignStatus.size() == 0 && "
                              "variables.otherStatusSame)")
            assert "!k.matches('^nvidia[.]com/(gpu|gpu-[0-9]+gb|mig-" in variables["foreignStatus"]
        own_node = [c for c in checks if "authentication.kubernetes.io/node-name" in c]
        if component == "agent":
            assert ".filter(k, !(k in [" not in variables["foreignLabels"]  # no label is the agent's either
            assert len(own_node) == 1 and "== [request.name]" in own_node[0]
        else:
            assert ".filter(k, !(k in [" not in variables["foreignLabels"]  # no label is the planner's
            assert not own_node


def test_node_write_policies_follow_the_release():
    """Names (cluster-scoped: one pair per release) and the user names matched follow the release."""
    objs = render(release="gpu", namespace="infra")
    for component in ("agent", "planner"):
        policy, _ = _policy_pair(objs, component, "gpu-dynpart")
        user = f"system:serviceaccount:infra:gpu-dynpart-{component}"
        assert policy["spec"]["matchConditions"][0]["expression"] == f'request.userInfo.username == "{user}"'


def test_node_write_policies_can_be_turned_off():
    objs = render("--set", "admissionPolicy.enabled=false")
    policies = {(o["kind"], o["metadata"]["name"]) for o in objs if o["kind"].startswith("ValidatingAdmissionPolicy")}
    assert policies == {(kind, name) for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
                        # labelPolicy.enabled and podEnvPolicy.enabled: on their own
                        for name in ("dynpart-partitioning-label", "dynpart-pod-env")}
    assert find(objs, "DaemonSet", AGENT_DS) and find(objs, "ClusterRole", "dynpart-agent")  # the rest is unchanged


def _template_error(*args: str) -> str:
    _require_tools()
    proc = subprocess.run([str(HELM), "template", "x", str(CHART), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"helm template {' '.join(args)} rendered"
    return proc.stderr


def test_node_write_policies_need_kubernetes_1_30():
    """One error names every policy value that is on, and how to turn each off."""
    all_three = _template_error("--kube-version", "1.29.4")
    assert "admissionPolicy.enabled, labelPolicy.enabled and podEnvPolicy.enabled need Kubernetes >= 1.30" in all_three
    assert ("this is v1.29.4: set admissionPolicy.enabled=false, labelPolicy.enabled=false and "
            "podEnvPolicy.enabled=false") in all_three
    two = _template_error("--kube-version", "1.29.4", "--set", "podEnvPolicy.enabled=false")
    assert "admissionPolicy.enabled and labelPolicy.enabled need Kubernetes >= 1.30" in two
    assert "set admissionPolicy.enabled=false and labelPolicy.enabled=false" in two and "podEnvPolicy" not in two
    values = ("admissionPolicy", "labelPolicy", "podEnvPolicy")
    for on in values:
        off = [a for v in values if v != on for a in ("--set", f"{v}.enabled=false")]
        alone = _template_error("--kube-version", "1.29.4", *off)
        assert f"{on}.enabled needs Kubernetes >= 1.30" in alone and f"set {on}.enabled=false" in alone
        assert not [v for v in values if v != on and v in alone]
    assert render("--kube-version", "1.29.4", *[a for v in values for a in ("--set", f"{v}.enabled=false")])
    on_eks = render("--kube-version", "v1.30.0-eks-1234")  # vendors' version suffixes
    assert _policy_pair(on_eks, "agent") and _label_policy_pair(on_eks) and _pod_env_policy_pair(on_eks)


def _label_policy_pair(objs: list[dict[str, Any]], fullname: str = "dynpart") -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"{fullname}-partitioning-label"
    return find(objs, "ValidatingAdmissionPolicy", name), find(objs, "ValidatingAdmissionPolicyBinding", name)


def test_partitioning_label_policy(default, full):
    """labelPolicy.enabled (default): a Node CREATE or UPDATE, through nodes or nodes/status, that
    sets or changes dynpart.io/gpu-partitioning to anything but the values the agent DaemonSet's
    node affinity takes is refused; a write that keeps the label or removes it never reaches the
    validation (matchCondition). tests/e2e/test_label_policy.py runs it on a real API server."""
    for objs in (default, full):
        policy, binding = _label_policy_pair(objs)
        assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert binding["spec"] == {"policyName": "dynpart-partitioning-label", "validationActions": ["Deny"]}
        assert policy["metadata"]["labels"]["app.kubernetes.io/component"] == "label-policy"
    policy, _ = _label_policy_pair(default)
    spec = policy["spec"]
    # an evaluation error must not block Node writes cluster-wide (kubelets, controllers): a typo guard
    assert spec["failurePolicy"] == "Ignore"
    # nodes/status too: the API server keeps the labels of a nodes/status write
    assert spec["matchConstraints"] == {"resourceRules": [{
        "apiGroups": [""], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"], "resources": ["nodes", "nodes/status"]}]}
    assert "userInfo" not in str(spec)  # every user: admins, kubelets (--node-labels), controllers
    key = f'"{PARTITIONING_LABEL}"'
    (cond,) = spec["matchConditions"]
    assert " ".join(cond["expression"].split()) == (
        f"{key} in object.metadata.?labels.orValue({{}}) && "
        f"(oldObject == null || !({key} in oldObject.metadata.?labels.orValue({{}})) || "
        f"oldObject.metadata.labels[{key}] != object.metadata.labels[{key}])")
    (check,) = spec["validations"]
    # the values the agent's DaemonSet runs on
    (term,) = find(default, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (affinity,) = [e for e in term["matchExpressions"] if e["key"] == PARTITIONING_LABEL]
    assert check["expression"] == f"object.metadata.labels[{key}] in {json.dumps(affinity['values'])}"
    assert affinity["values"] == ["mig", "mps"]
    assert check["reason"] == "Invalid"
    for text in (check["message"], check["messageExpression"]):
        assert PARTITIONING_LABEL in text and "mig and mps" in text and "remove the label" in text
    assert f"object.metadata.labels[{key}]" in check["messageExpression"]  # the value given


def test_partitioning_label_policy_follows_the_release_and_can_be_turned_off():
    policy, binding = _label_policy_pair(render(release="gpu", namespace="infra"), "gpu-dynpart")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "gpu-dynpart-partitioning-label"
    objs = render("--set", "labelPolicy.enabled=false")
    assert not [o for o in objs if "partitioning-label" in o["metadata"]["name"]]
    assert _policy_pair(objs, "agent") and _policy_pair(objs, "planner")  # the node-write policies stay
    assert not [o for o in render("--set", "labelPolicy.enabled=false", "--set", "admissionPolicy.enabled=false",
                                  "--set", "podEnvPolicy.enabled=false")
                if o["kind"].startswith("ValidatingAdmissionPolicy")]


def _pod_env_policy_pair(objs: list[dict[str, Any]], fullname: str = "dynpart") -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"{fullname}-pod-env"
    return find(objs, "ValidatingAdmissionPolicy", name), find(objs, "ValidatingAdmissionPolicyBinding", name)


def test_pod_env_policy(default, full):
    """podEnvPolicy.enabled (default): a Pod CREATE (or an ephemeral container added) where the pod
    asks for a dynpart resource and a container sets NVIDIA_VISIBLE_DEVICES or CUDA_MPS_* in env
    is refused; pods asking for no dynpart resource never reach the validation (matchCondition).
    tests/e2e/test_pod_env_policy.py runs it on a real API server."""
    for objs in (default, full):
        policy, binding = _pod_env_policy_pair(objs)
        assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert binding["spec"] == {"policyName": "dynpart-pod-env", "validationActions": ["Deny"]}
        assert policy["metadata"]["labels"]["app.kubernetes.io/component"] == "pod-env-policy"
    spec = _pod_env_policy_pair(default)[0]["spec"]
    assert spec["failurePolicy"] == "Ignore"  # an evaluation error must not block pod creation cluster-wide
    assert spec["matchConstraints"] == {"resourceRules": [
        {"apiGroups": [""], "apiVersions": ["*"], "operations": ["CREATE"], "resources": ["pods"]},
        {"apiGroups": [""], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["pods/ephemeralcontainers"]}]}
    assert "userInfo" not in str(spec)  # every user
    (cond,) = spec["matchConditions"]
    # the dynpart resources only (not nvidia.com/gpu: GPU Operator's pods set NVIDIA_VISIBLE_DEVICES)
    dynpart = "r.matches('^nvidia[.]com/(mig-.+|gpu-[0-9]+gb)$')"
    assert cond["expression"].count(dynpart) == 4  # limits and requests, containers and init containers
    assert "initContainers" in cond["expression"] and "env" not in cond["expression"]
    resource = re.compile(r"^nvidia[.]com/(mig-.+|gpu-[0-9]+gb)$")
    for name in ("nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.me", "nvidia.com/mig-1g.24gb-me", "nvidia.com/gpu-10gb"):
        assert resource.match(name), name
    for name in ("nvidia.com/gpu", "nvidia.com/gpu.shared", "example.com/mig-1g", "nvidia.com/gpu-10"):
        assert not resource.match(name), name
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    sets = "e.name == 'NVIDIA_VISIBLE_DEVICES' || e.name.startsWith('CUDA_MPS_')"
    assert sets in variables["setters"] and "envFrom" not in variables["setters"]
    for kind in ("container", "init container", "ephemeral container"):
        assert f"'{kind} \"' + c.name" in variables["setters"]
    check, mixes = spec["validations"]
    assert check["expression"] == "variables.setters.size() == 0" and check["reason"] == "Forbidden"
    assert "variables.setters.join('; ')" in check["messageExpression"]
    for text in (check["message"], check["messageExpression"]):
        assert "NVIDIA_VISIBLE_DEVICES" in text and "CUDA_MPS_" in text and "device plugin sets" in text
    # a container asking for an MPS slice and another GPU resource (whole GPU, MIG, another size)
    assert mixes["expression"] == "variables.mixers.size() == 0" and mixes["reason"] == "Forbidden"
    mixers = variables["mixers"]
    assert "m.matches('^nvidia[.]com/gpu-[0-9]+gb$')" in mixers and "r != m" in mixers
    assert "r.matches('^nvidia[.]com/(gpu|mig-.+|gpu-[0-9]+gb)$')" in mixers
    assert "'container \"' + c.name" in mixers and "'init container \"' + c.name" in mixers
    assert mixers.startswith("request.?subResource.orValue('') == 'ephemeralcontainers' ? [] :")
    assert "variables.mixers.join('; ')" in mixes["messageExpression"] and "CUDA_VISIBLE_DEVICES" in mixes["message"]


def test_pod_env_policy_follows_the_release_and_can_be_turned_off():
    policy, binding = _pod_env_policy_pair(render(release="gpu", namespace="infra"), "gpu-dynpart")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "gpu-dynpart-pod-env"
    objs = render("--set", "podEnvPolicy.enabled=false")
    assert not [o for o in objs if "pod-env" in o["metadata"]["name"]]
    assert _policy_pair(objs, "agent") and _label_policy_pair(objs)  # the other policies stay


def test_image_digest():
    """image.digest pins every workload's image: repository@digest, the tag unused."""
    digest = "sha256:" + "ab" * 32
    for args, want in ((("--set", "image.tag=1.2.3"), "ghcr.io/dynpart/dynpart:1.2.3"),
                       (("--set", "image.tag=1.2.3", "--set", f"image.digest={digest}"), f"ghcr.io/dynpart/dynpart@{digest}")):
        objs = render(*args)
        images = [c["image"] for o in objs if o["kind"] in ("Deployment", "DaemonSet")
                  for c in o["spec"]["template"]["spec"].get("initContainers", []) + o["spec"]["template"]["spec"]["containers"]]
        assert len(images) >= 2 and set(images) == {want}


def test_network_policy(default, full):
    assert not [o for o in default if o["kind"] == "NetworkPolicy"]
    np = find(full, "NetworkPolicy", "dynpart-metrics")
    spec = np["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress (the API server) is not restricted
    values = yaml.safe_load(FULL_VALUES.read_text())
    assert spec["ingress"] == [{"ports": [{"port": 9100, "protocol": "TCP"}], "from": values["networkPolicy"]["metricsFrom"]}]
    # it selects both components' pods, and nothing else
    sel = spec["podSelector"]
    for kind, name in (("Deployment", "dynpart-planner"), ("DaemonSet", AGENT_DS), ("DaemonSet", MPS_CONTROL_DS)):
        pod_labels = find(full, kind, name)["spec"]["template"]["metadata"]["labels"]
        assert sel["matchLabels"].items() <= pod_labels.items()
        (expr,) = sel["matchExpressions"]
        assert expr["operator"] == "In" and pod_labels[expr["key"]] in expr["values"]
    assert set(sel["matchExpressions"][0]["values"]) == {"planner", "agent", "mps-control"}
    # no peer: no ingress at all (a rule without `from` would admit every source)
    closed = find(render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.metricsFrom=null"), "NetworkPolicy")
    assert closed["spec"]["ingress"] == []


def test_service_monitor_only_when_enabled(default, full):
    assert not [o for o in default if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    sm = find(full, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    svc = find(full, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == 9100


def test_pod_monitor_scrapes_the_agents(full):
    """The agents (a DaemonSet, no Service) are scraped through a PodMonitor, with the ServiceMonitor."""
    pm = find(full, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["name"] == "dynpart-agent" and pm["metadata"]["namespace"] == NAMESPACE
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}]
    # it selects the agent's pods, by the name of a port they have, and nothing else
    agent = find(full, "DaemonSet", AGENT_DS)["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= agent["metadata"]["labels"].items()
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in agent["spec"]["containers"][0]["ports"]
    planner = find(full, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not pm["spec"]["selector"]["matchLabels"].items() <= planner.items()


def test_agent_state_dir_is_what_the_agent_uses(tmp_path):
    """The node lock, the mps-control directory and the MPS pipe and log directories live under
    agent.stateDir, mounted at the same path as on the host (MPS pods mount the pipe directory from
    the host) in the agent's and the mps-control pods."""
    from dynpart.settings import AgentSettings, load_settings

    objs = render("--set", "agent.stateDir=/srv/dynpart", "--set", "agent.updateStrategy.type=OnDelete")
    for ds, name in ((AGENT_DS, "agent"), (MPS_CONTROL_DS, "mps-control")):
        pod = find(objs, "DaemonSet", ds)["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["state"]["hostPath"]["path"] == "/srv/dynpart"
        # the daemon's pipes and logs, and the files the two share: where the agent's settings say
        assert {"name": "state", "mountPath": "/srv/dynpart", "mountPropagation": "HostToContainer"} \
            in container(pod, name)["volumeMounts"]
        assert not pod.get("hostIPC")
    mps_pod = find(objs, "DaemonSet", MPS_CONTROL_DS)["spec"]["template"]["spec"]
    mps = container(mps_pod, "mps-control")
    assert {v["name"]: v for v in mps_pod["volumes"]}["mps-shm"]["hostPath"]["path"] == "/srv/dynpart/mps-shm"
    assert mps["args"][mps["args"].index("--shm-dir") + 1] == "/srv/dynpart/mps-shm"
    assert find(objs, "DaemonSet", AGENT_DS)["spec"]["updateStrategy"] == {"type": "OnDelete"}
    (tmp_path / "agent.yaml").write_text(find(objs, "ConfigMap", "dynpart-agent")["data"]["agent.yaml"])
    s = load_settings(AgentSettings, tmp_path / "agent.yaml")
    assert (s.node_lock_file, s.mps_pipe_dir, s.mps_log_dir, s.mps_control_dir, s.compute_modes_file) == (
        "/srv/dynpart/agent.lock", "/srv/dynpart/mps", "/srv/dynpart/mps-log", "/srv/dynpart/mps-control",
        "/srv/dynpart/compute-modes.json")
    assert mps["args"][mps["args"].index("--dir") + 1] == s.mps_control_dir


def test_agent_without_privileges_keeps_what_mps_needs(tmp_path):
    """privileged: false drops every capability of the agent (it never runs the MPS control
    daemon: the chart always sets mps_control_dir), and all but SETUID and SETGID of mps-control
    (the daemon starts each server under its client's ids); NOTES say whether MIG can work."""
    objs = render("--set", "agent.privileged=false")
    want = {"agent": {"drop": ["ALL"]}, "mps-control": {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}}
    for ds, name in ((AGENT_DS, "agent"), (MPS_CONTROL_DS, "mps-control")):
        sc = container(find(objs, "DaemonSet", ds)["spec"]["template"]["spec"], name)["securityContext"]
        assert sc["capabilities"] == want[name] and sc["privileged"] is False
        assert sc["runAsUser"] == 0 and sc["readOnlyRootFilesystem"] is True
    assert yaml.safe_load(find(objs, "ConfigMap", "dynpart-agent")["data"]["agent.yaml"])["mps_control_dir"]
    notes = render_notes(tmp_path / "default", "--set", "agent.privileged=false")
    assert "(it does)" not in notes and "SETUID" in notes
    bare = render_notes(tmp_path / "bare", "--set", "agent.privileged=false", "--set", "agent.capabilities={SYS_ADMIN}")
    assert "includes SYS_ADMIN (it does)" in bare
    sc = container(find(render("--set", "agent.privileged=false", "--set", "agent.capabilities={SYS_ADMIN}"),
                        "DaemonSet", AGENT_DS)["spec"]["template"]["spec"], "agent")["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    # how to upgrade: the agents roll; mps-control updates on delete, once the node runs no MPS pod
    assert "delete pod -l app.kubernetes.io/component=mps-control" in notes
    assert "delete pod -l app.kubernetes.io/component=agent" not in notes
    on_delete = render_notes(tmp_path / "on-delete", "--set", "agent.updateStrategy.type=OnDelete",
                             "--set", "agent.mpsControl.updateStrategy.type=RollingUpdate")
    assert "delete pod -l app.kubernetes.io/component=agent" in on_delete and "component=mps-control" not in on_delete
    assert "runtimeClassName: nvidia-legacy" in notes


@pytest.mark.parametrize(("values", "exclusive"), [
    ((), True),
    (("agent.privileged=false",), False),  # no CAP_SYS_ADMIN: NVML would refuse every change
    (("agent.privileged=false", "agent.capabilities={SYS_ADMIN}"), True),
    (("agent.mpsExclusiveProcess=false",), False),
])
def test_gpus_are_put_in_exclusive_process_only_by_an_agent_allowed_to(tmp_path, values, exclusive):
    from dynpart.settings import AgentSettings, load_settings

    objs = render(*(a for v in values for a in ("--set", v)))
    (tmp_path / "agent.yaml").write_text(find(objs, "ConfigMap", "dynpart-agent")["data"]["agent.yaml"])
    assert load_settings(AgentSettings, tmp_path / "agent.yaml").mps_exclusive_process is exclusive


def test_full_values_options(full, tmp_path):
    from dynpart.catalog import load_catalog

    dep = find(full, "Deployment")
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    pod = find(full, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod
    sc = container(pod, "agent")["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    for c in pod["containers"]:  # image.digest pins it
        assert c["image"] == f"registry.example.com/gpu/dynpart@{digest}"
    extra = find(full, "ConfigMap", "dynpart-catalog")["data"]["extra.yaml"]
    (tmp_path / "extra.yaml").write_text(extra)
    assert "A100-80GB-CUSTOM" in load_catalog([str(tmp_path / "extra.yaml")]).models


def test_no_dumpable_process_shares_the_agent_container(default, full):
    """The agent marks itself not dumpable (agent/cli.py `_not_dumpable`) so that a same-uid
    process in the host's PID namespace (an unprivileged mps-control, root as the agent) cannot
    open its /proc/<pid>/root and read its API token. The image's ENTRYPOINT runs it under tini,
    which stays dumpable, runs as the same root, in the same container: its /proc/<pid>/root is
    the same filesystem, token included. The agent's container runs dynpart itself (the chart sets
    mps_control_dir: the agent forks no MPS daemon for tini to reap)."""
    for objs in (default, full):
        pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
        agent = container(pod, "agent")
        assert agent.get("command") == ["dynpart"], "the agent runs under the image's tini, which is dumpable"
        assert agent["args"][:2] == ["agent", "run"]
        config = yaml.safe_load(find(objs, "ConfigMap", "dynpart-agent")["data"]["agent.yaml"])
        assert config["mps_control_dir"], "the agent would fork the MPS daemon itself, which tini reaps"


# Values whose null means "none" and renders so (`resources: null`, no tolerations, the
# DaemonSet's default rolling update): the only chart-structured values a values file may empty.
NULL_MEANS_NONE = {"planner.resources", "agent.resources", "agent.mpsControl.resources", "agent.tolerations",
                   "agent.updateStrategy.rollingUpdate", "planner.runAsUser"}


def _settings_values() -> list[list[str]]:
    """The paths of values.yaml's values that the chart reads as settings or structure: the scalars
    and the objects the schema describes key by key, and the settings' lists (free-form maps and
    Kubernetes lists such as tolerations or extraEnv left out, and NULL_MEANS_NONE)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    out: list[list[str]] = []

    def walk(value: dict[str, Any], node: dict[str, Any], path: list[str]) -> None:
        for key, sub in value.items():
            child = node.get("properties", {}).get(key, {})
            here = path + [key]
            if ".".join(here) in NULL_MEANS_NONE:
                continue
            if isinstance(sub, dict) and "properties" in child:
                out.append(here)
                walk(sub, child, here)
            elif not isinstance(sub, (dict, list)) or ".".join(here) in ("planner.workload", "planner.schedulerNames"):
                out.append(here)
    walk(yaml.safe_load((CHART / "values.yaml").read_text()), schema, [])
    return out


def test_empty_values_are_refused(tmp_path):
    """A value left empty in a values file (`privileged:`), or `--set key=null`, deletes the chart's
    default in Helm: the chart rendered `privileged: false`, `'%!s(<nil>)/mps'` paths and
    `scheduler_names: null` (a planner that never starts) from it. The schema requires them, so
    install refuses it naming each."""
    paths = _settings_values()
    assert ["agent", "privileged"] in paths and ["planner", "schedulerNames"] in paths
    # (one values file per depth: emptying an object deletes its keys too)
    for depth in sorted({len(p) for p in paths}):
        doc: dict[str, Any] = {}
        for path in (p for p in paths if len(p) == depth):
            node = doc
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = None
        (tmp_path / "empty.yaml").write_text(yaml.safe_dump(doc))
        error = _template_error("-f", str(tmp_path / "empty.yaml"))
        missing = {f"{where.strip('/').replace('/', '.')}.{key}".lstrip(".")
                   for where, keys in re.findall(r"at '([^']*)': missing propert(?:y|ies) (.*)", error)
                   for key in re.findall(r"'([^']+)'", keys)}
        assert missing == {".".join(p) for p in paths if len(p) == depth}, error


def test_the_values_docs_say_may_be_emptied_may_be():
    """docs/helm.md lists the values that may be emptied (`--set X=null`): each renders (review 171
    found the list short of several that do)."""
    _require_tools()
    text = " ".join((ROOT / "docs" / "helm.md").read_text().split())
    listed = re.search(r"Only (`planner\.resources`[^;]*?) may be emptied \(none\), and `([a-zA-Z.]+)`", text)
    assert listed, "docs/helm.md lost its list of the values that may be emptied"
    names = re.findall(r"`([a-zA-Z.]+)`", listed.group(1)) + [listed.group(2)]
    assert len(names) >= 15 and "planner.runAsUser" in names
    for name in names:
        proc = subprocess.run([str(HELM), "template", "x", str(CHART), "--set", f"{name}=null"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (name, proc.stderr)


def test_bad_catalog_is_refused(tmp_path):
    _require_tools()
    proc = subprocess.run([str(HELM), "template", "x", str(CHART), "--set", "catalog.extra=gpus: []"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "models:" in proc.stderr
    # a model named twice: the planner and the agent refuse the file, so the chart does (review 173)
    from dynpart.catalog import load_catalog
    from dynpart.errors import DynpartError

    twice = "models:\n  - {name: X, memory_gb: 24}\n  - {name: X, memory_gb: 48}\n"
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"catalog": {"extra": twice}}))
    assert "catalog.extra: models[1] (X): the name of models[0] too" in _template_error("-f", str(tmp_path / "values.yaml"))
    (tmp_path / "catalog.yaml").write_text(twice)
    with pytest.raises(DynpartError, match=r"models\[1\] \(X\): the name of models\[0\] too"):
        load_catalog([tmp_path / "catalog.yaml"])
    ok = yaml.safe_dump({"catalog": {"extra": twice.replace("name: X, memory_gb: 48", "name: Y, memory_gb: 48")}})
    (tmp_path / "values.yaml").write_text(ok)
    assert render("-f", str(tmp_path / "values.yaml"))


def test_dockerfile_matches_the_chart(default):
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert 'ENTRYPOINT ["tini", "--", "dynpart"]' in text  # PID 1 reaps the MPS daemon the agent forks
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user, "the image must run as a numeric non-root user"
    pod_sc = find(default, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert (str(pod_sc["runAsUser"]), str(pod_sc["runAsGroup"])) == user.groups()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["version"], chart["appVersion"]) == ("v2", "0.1.0", "0.1.0")


def test_extra_env_reaches_the_settings(tmp_path, monkeypatch):
    """`extraEnv`: an admin sets what the values do not expose (every setting has its variable,
    docs/configuration.md); the variable overrides the ConfigMap's value."""
    from dynpart.settings import PlannerSettings, load_settings

    objs = render("--set", "planner.extraEnv[0].name=DYNPART_PLANNER_RESERVATION_S",
                  "--set-string", "planner.extraEnv[0].value=42",
                  "--set", "agent.extraEnv[0].name=DYNPART_AGENT_WITHDRAW_SETTLE_S",
                  "--set-string", "agent.extraEnv[0].value=1.5")
    (planner,) = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "DYNPART_PLANNER_RESERVATION_S", "value": "42"} in planner["env"]
    (tmp_path / "planner.yaml").write_text(find(objs, "ConfigMap", "dynpart-planner")["data"]["planner.yaml"])
    for e in planner["env"]:
        monkeypatch.setenv(e["name"], e.get("value", "dynpart-planner-abc"))
    assert load_settings(PlannerSettings, tmp_path / "planner.yaml").reservation_s == 42
    ns, s = _agent_settings(objs, tmp_path, monkeypatch, environ={"DYNPART_AGENT_WITHDRAW_SETTLE_S": "1.5"})
    agent = container(find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"], "agent")
    assert {"name": "DYNPART_AGENT_WITHDRAW_SETTLE_S", "value": "1.5"} in agent["env"]
    assert s.withdraw_settle_s == 1.5


def test_notes_mention_the_pod_env_policy(tmp_path):
    on = render_notes(tmp_path / "on")
    assert "ValidatingAdmissionPolicy\ndynpart-pod-env" in on and "Isolation between GPU pods" in on
    assert "dynpart-pod-env" not in render_notes(tmp_path / "off", "--set", "podEnvPolicy.enabled=false")


def test_values_that_still_set_agent_host_ipc_keep_their_meaning(tmp_path):
    """agent.hostIPC (before agent.mpsShm) is still accepted: an upgrade with the old values file
    must not be refused. true is agent.mpsShm.mode hostIPC (what it meant), false changes nothing;
    NOTES say it is deprecated (review 94)."""
    def mps_pod(objs):
        return find(objs, "DaemonSet", MPS_CONTROL_DS)["spec"]["template"]["spec"]

    def host_ipc_planned(objs):
        return yaml.safe_load(find(objs, "ConfigMap", "dynpart-planner")["data"]["planner.yaml"])["mps_clients_host_ipc"]

    old_true = render("--set", "agent.hostIPC=true")
    assert mps_pod(old_true).get("hostIPC") is True and "initContainers" not in mps_pod(old_true)
    assert host_ipc_planned(old_true) is True
    for objs in (render("--set", "agent.hostIPC=false"), render()):
        assert "hostIPC" not in mps_pod(objs) and mps_pod(objs)["initContainers"] and host_ipc_planned(objs) is False
    assert "agent.hostIPC is deprecated" in render_notes(tmp_path / "t", "--set", "agent.hostIPC=true")
    assert "agent.hostIPC is deprecated" not in render_notes(tmp_path / "d")


@pytest.mark.parametrize(("values", "error"), [
    # PlannerSettings refuses batch_idle_s > batch_timeout_s: the planner would crash-loop
    ({"planner": {"batchIdleSeconds": 5}}, "batchIdleSeconds"),
    ({"planner": {"batchIdleSeconds": 1, "batchTimeoutSeconds": 0.5}}, "batchIdleSeconds"),
    # workload entries are PlannerSettings' snake_case models (extra keys forbidden): a pod spec's
    # camelCase or a field they do not have must be refused by the schema, not by the planner's start
    ({"planner": {"workload": [{"resource": "nvidia.com/mig-1g.10gb", "node_affinity": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}]}]}},
     "/planner/workload/0/node_affinity/0"),
    ({"planner": {"workload": [{"resource": "nvidia.com/mig-1g.10gb", "node_affinity": [
        {"match_expressions": [{"key": "zone", "operator": "in", "values": ["z1"]}]}]}]}},
     "/planner/workload/0/node_affinity/0/match_expressions/0/operator"),
    ({"planner": {"workload": [{"resource": "nvidia.com/mig-1g.10gb", "tolerations": [
        {"key": "team", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}]}]}},
     "/planner/workload/0/tolerations/0"),
])
def test_planner_values_the_planner_would_refuse_are_refused(tmp_path, values, error):
    """Values that render but that PlannerSettings refuses would leave every planner replica in a
    crash loop after `helm install` or `helm upgrade` succeeded: the chart refuses them itself."""
    from dynpart.errors import DynpartError
    from dynpart.settings import PlannerSettings, load_settings

    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    assert error in _template_error("-f", str(tmp_path / "values.yaml"))
    # (what the planner says of the same settings)
    p = values["planner"]
    cfg = {"batch_idle_s": p.get("batchIdleSeconds", 0.5), "batch_timeout_s": p.get("batchTimeoutSeconds", 3),
           "workload": p.get("workload", [])}
    (tmp_path / "planner.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(DynpartError, match="setting"):
        load_settings(PlannerSettings, tmp_path / "planner.yaml")


def test_the_agent_sees_every_gpu_process():
    """NVML lists a GPU's processes in the caller's PID namespace and leaves out those it cannot
    see: the agent's last check before destroying a MIG instance needs the host's (agent.hostPID)."""
    pod = find(render(), "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and "hostIPC" not in pod
    off = find(render("--set", "agent.hostPID=false"), "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert "hostPID" not in off


def test_openshift_and_private_mounts_and_unprivileged_agents_render_as_they_need():
    """helper-150's review: on OpenShift the planner's fixed user id is refused by restricted-v2
    (`planner.runAsUser: null` sets none); with `agent.mpsShm.mode: hostIPC` no pod asks for mount
    propagation (containerd refuses it on a private host mount); with `agent.privileged: false` the
    agent and mps-control also name every GPU by a volume mount (a toolkit that ignores the variable
    for unprivileged containers reads those)."""
    _require_tools()

    def objects(*sets: str) -> dict[str, dict[str, Any]]:
        args = [a for s in sets for a in ("--set", s)]
        out = subprocess.run([str(HELM), "template", "x", str(CHART), *args], capture_output=True, text=True, check=True)
        return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out.stdout) if d}

    def pod(docs: dict[str, dict[str, Any]], suffix: str) -> dict[str, Any]:
        return next(d for k, d in docs.items() if k.endswith(suffix) and d["kind"] in ("Deployment", "DaemonSet"))[
            "spec"]["template"]["spec"]

    default = objects()
    assert pod(default, "-planner")["securityContext"]["runAsUser"] == 10001
    assert "runAsUser" not in pod(objects("planner.runAsUser=null"), "-planner")["securityContext"]
    for docs, propagation in ((default, True), (objects("agent.mpsShm.mode=hostIPC"), False)):
        for suffix in ("-agent", "-mps-control"):
            mounts = [m for c in pod(docs, suffix)["containers"] for m in c["volumeMounts"] if m["name"] == "state"]
            assert mounts and all(("mountPropagation" in m) == propagation for m in mounts), (suffix, mounts)
    for docs, privileged in ((default, True), (objects("agent.privileged=false"), False)):
        for suffix in ("-agent", "-mps-control"):
            spec = pod(docs, suffix)
            mounts = {m["mountPath"] for c in spec["containers"] for m in c["volumeMounts"]}
            assert ("/var/run/nvidia-container-devices/all" in mounts) != privileged, suffix
            assert any(v.get("hostPath", {}).get("path") == "/dev/null" for v in spec["volumes"]) != privileged


def test_agent_device_specs_dev_root_and_off(tmp_path, monkeypatch):
    """devicePlugin.devRoot: the host's <devRoot>/dev mounted where the agent looks; deviceSpecs=false:
    no DeviceSpecs, no mount of the host's /dev; unprivileged agents get the same read-only mount."""
    objs = render("--set", "devicePlugin.devRoot=/run/nvidia/driver", "--set", "agent.privileged=false")
    pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    # the driver root is a mount the driver pod makes, again at each restart (helper-160): its parent,
    # HostToContainer, so the agent sees the new one and does not wait for the first
    assert vols["nvidia-dev"]["hostPath"] == {"path": "/run/nvidia/driver", "type": "DirectoryOrCreate"}
    assert {"name": "nvidia-dev", "mountPath": "/host/nvidia-root", "readOnly": True,
            "mountPropagation": "HostToContainer"} in container(pod, "agent")["volumeMounts"]
    _, s = _agent_settings(objs, tmp_path, monkeypatch)
    assert (s.device_specs, s.nvidia_dev_root, s.nvidia_dev_dir) == (True, "/run/nvidia/driver", "/host/nvidia-root/dev")
    objs = render("--set", "devicePlugin.deviceSpecs=false")
    pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert "nvidia-dev" not in {v["name"] for v in pod["volumes"]}
    assert not any(m["name"] == "nvidia-dev" for m in container(pod, "agent")["volumeMounts"])
    _, s = _agent_settings(objs, tmp_path, monkeypatch)
    assert s.device_specs is False


def test_agent_cdi_strategy_mounts_the_cdi_dir(tmp_path, monkeypatch):
    """deviceListStrategy cdi-cri / cdi-annotations: the node's CDI directory mounted read-write at
    /host/cdi (the agent writes its spec there and reads the toolkit's management spec), the host's
    <devRoot>/dev even without DeviceSpecs (the spec's control nodes: those that exist); the default
    strategy mounts no CDI directory."""
    pod = find(render(), "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    assert "cdi" not in {v["name"] for v in pod["volumes"]}
    objs = render("--set", "devicePlugin.deviceListStrategy=cdi-cri", "--set", "devicePlugin.deviceSpecs=false",
                  "--set", "devicePlugin.cdi.dir=/run/cdi", "--set", "devicePlugin.cdi.kind=example.com/gpu",
                  "--set", "devicePlugin.cdi.managementSpec=management.nvidia.com-gpu.json")
    pod = find(objs, "DaemonSet", AGENT_DS)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["cdi"]["hostPath"] == {"path": "/run/cdi", "type": "DirectoryOrCreate"}
    assert {"name": "cdi", "mountPath": "/host/cdi"} in container(pod, "agent")["volumeMounts"]
    assert vols["nvidia-dev"]["hostPath"] == {"path": "/dev", "type": "Directory"}
    _, s = _agent_settings(objs, tmp_path, monkeypatch)
    assert (s.device_list_strategy, s.cdi_spec_dir, s.cdi_kind, s.cdi_management_spec, s.device_specs) == (
        "cdi-cri", "/host/cdi", "example.com/gpu", ["/host/cdi/management.nvidia.com-gpu.json"], False)
    objs = render("--set", "devicePlugin.deviceListStrategy=cdi-annotations")
    _, s = _agent_settings(objs, tmp_path, monkeypatch)
    assert (s.device_list_strategy, s.cdi_spec_dir, s.cdi_kind, s.cdi_management_spec) == (
        "cdi-annotations", "/host/cdi", "dynpart.io/gpu", [])
    for bad, where in (("devicePlugin.cdi.kind=dynpart.io", "/devicePlugin/cdi/kind"),
                       ("devicePlugin.cdi.dir=run/cdi", "/devicePlugin/cdi/dir"),
                       ("devicePlugin.cdi.managementSpec=a/b.yaml", "/devicePlugin/cdi/managementSpec"),
                       ("devicePlugin.deviceListStrategy=cdi", "/devicePlugin/deviceListStrategy")):
        assert where in _template_error("--set", bad), bad
