#!/usr/bin/env bash
# Checks the Helm chart charts/dynpart with the tools built by charts/build-tools.sh:
#
#   1. helm lint (plain, --strict, with the ServiceMonitor and PodMonitor, with ci/full-values.yaml);
#   2. values.schema.json: bad values must make helm lint fail;
#   3. helm template | kubeconform -strict, default values and ci/full-values.yaml, against
#      JSON schemas of the Kubernetes version the e2e tests run (.cache/kube-schemas);
#   4. with DYNPART_E2E_KUBECONFIG set (a kubeconfig of a real API server, e.g. from
#      `python tests/e2e/cluster.py up --detach`): server-side dry run of both renderings
#      (charts/tools/dry_run.py; creates the namespaces and the ServiceMonitor and PodMonitor CRDs
#      for real).
#
# Exit status: 0 all passed, 1 a check failed, 3 the tools are not built.
# Environment: DYNPART_TOOLS_CACHE (default <repo>/.cache), DYNPART_CHART_OUT (keep the rendered
# manifests there; default a temporary directory), DYNPART_E2E_KUBECONFIG, PYTHON.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="${DYNPART_TOOLS_CACHE:-$root/.cache}"
helm="$cache/tools/bin/helm"
kubeconform="$cache/tools/bin/kubeconform"
schemas="$cache/kube-schemas"
chart="$here/dynpart"
full="$chart/ci/full-values.yaml"
ns=dynpart-system

if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"
else py=python3; fi

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'check.sh: FAILED: %s\n' "$*" >&2; exit 1; }

# The Kubernetes version whose schemas build-tools.sh generated last (file `current`: vX.Y.Z).
kube_version="$(cat "$schemas/current" 2>/dev/null || true)"; kube_version="${kube_version#v}"
if [[ ! -x "$helm" || ! -x "$kubeconform" || -z "$kube_version" || ! -d "$schemas/v$kube_version-standalone-strict" \
      || ! -f "$schemas/crds/servicemonitor-monitoring-v1.json" || ! -f "$schemas/crds/podmonitor-monitoring-v1.json" ]]; then
    echo "check.sh: helm, kubeconform or the Kubernetes or Prometheus operator schemas are missing in $cache: run bash charts/build-tools.sh" >&2
    exit 3
fi

if [[ -n "${DYNPART_CHART_OUT:-}" ]]; then out="$DYNPART_CHART_OUT"; mkdir -p "$out"
else out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT; fi

step "helm lint ($("$helm" version --template '{{.Version}}'))"
"$helm" lint "$chart"
"$helm" lint --strict "$chart"
"$helm" lint --strict "$chart" --set metrics.serviceMonitor.enabled=true
"$helm" lint --strict "$chart" -f "$full"

step "values.schema.json and template checks refuse bad values"
bad_values=(
    "--set planner.replicas=0"
    "--set planner.replica=3"
    "--set planner.batchIdleSeconds=0"
    "--set logLevel=verbose"
    "--set-string agent.privileged=yes"
    "--set-string metrics.port=http"
    "--set metrics.port=70000"
    "--set image.pullPolicy=Sometimes"
    "--set metrics.serviceMonitor.interval=soon"
    "--set devicePlugin.nvidia.namespace=Not_A_Namespace"
    "--set devicePlugin.configMapName=dynpart-device-plugin-configs"
    "--set-string admissionPolicy.enabled=yes"
    "--set-string labelPolicy.enabled=yes"
    "--set-string podEnvPolicy.enabled=yes"
    "--set image.digest=sha256:abc"
    "--set image.digest=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    "--set labelPolicy.values={mig}"
    "--set metrics.host="
    "--set networkPolicy.metricsFrom[0].namespace=monitoring"
    "--set planner.extraEnv[0].value=42"
    "--set agent.extraEnv[0].name=not-a-variable"
    "--set agent.mpsControl.resources.limit.memory=1Gi"
    "--set agent.mpsControl.updateStrategy.rollingUpdate.maxSurge=1"
    "--set agent.privileged=null"
    "--set planner.schedulerNames=null"
)
for args in "${bad_values[@]}"; do
    # shellcheck disable=SC2086
    if "$helm" lint --strict "$chart" $args >"$out/bad.log" 2>&1; then
        cat "$out/bad.log"; fail "helm lint accepted bad values: $args"
    fi
    echo "helm lint refused as expected: $args"
done
# The template's own checks (`fail`) are only warnings to helm lint: helm template must refuse.
for args in "--set catalog.extra=not-a-catalog" "--set catalog.extra=models:"; do
    # shellcheck disable=SC2086
    if "$helm" template dynpart "$chart" $args >"$out/bad.log" 2>&1; then
        fail "helm template accepted bad values: $args"
    fi
    echo "helm template refused as expected: $args ($(grep -o 'catalog.extra[^(]*' "$out/bad.log" | head -n1))"
done
# The ValidatingAdmissionPolicies (node writes, the partitioning label, pods' env) need
# admissionregistration.k8s.io/v1 (Kubernetes 1.30): the error names every value to turn off.
all_off="--set admissionPolicy.enabled=false --set labelPolicy.enabled=false --set podEnvPolicy.enabled=false"
for on in "" admissionPolicy labelPolicy podEnvPolicy; do
    case "$on" in
        "") args=""; want="admissionPolicy.enabled, labelPolicy.enabled and podEnvPolicy.enabled need Kubernetes >= 1.30" ;;
        *) args="${all_off/--set $on.enabled=false/}"; want="$on.enabled needs Kubernetes >= 1.30" ;;
    esac
    # shellcheck disable=SC2086
    if "$helm" template dynpart "$chart" --kube-version 1.29.0 $args >"$out/bad.log" 2>&1; then
        fail "helm template accepted a ValidatingAdmissionPolicy on Kubernetes 1.29 (${on:-default values})"
    fi
    grep -q "$want" "$out/bad.log" || { cat "$out/bad.log"; fail "unexpected error on Kubernetes 1.29 (${on:-default values})"; }
    if [[ -n "$on" ]]; then what="only $on.enabled on"; else what="default values"; fi
    echo "helm template refused as expected on Kubernetes 1.29 ($what): $want"
done
# shellcheck disable=SC2086
"$helm" template dynpart "$chart" --kube-version 1.29.0 $all_off >/dev/null
echo "helm template renders on Kubernetes 1.29 with admissionPolicy.enabled, labelPolicy.enabled and podEnvPolicy.enabled false"

step "helm template | kubeconform -strict (Kubernetes $kube_version schemas)"
"$helm" template dynpart "$chart" --namespace "$ns" --kube-version "$kube_version" >"$out/default.yaml"
"$helm" template dynpart "$chart" --namespace "$ns" --kube-version "$kube_version" -f "$full" >"$out/full.yaml"
for f in default full; do
    echo "-- $f values"
    "$kubeconform" -strict -summary -output text -kubernetes-version "$kube_version" \
        -schema-location "$schemas" \
        -schema-location "$schemas/crds/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
        "$out/$f.yaml" || fail "kubeconform: $f values"
done

if [[ -n "${DYNPART_E2E_KUBECONFIG:-}" ]]; then
    step "server-side dry run against $(sed -n 's/.*"server": *"\([^"]*\)".*/\1/p; s/^ *server: *//p' "$DYNPART_E2E_KUBECONFIG" | head -n1)"
    crd_args=()
    for crd in "$schemas"/crds/*-crd.yaml; do
        [[ -f "$crd" ]] && crd_args+=(--crd "$crd")
    done
    "$py" "$here/tools/dry_run.py" --kubeconfig "$DYNPART_E2E_KUBECONFIG" "${crd_args[@]}" \
        "$out/default.yaml" "$out/full.yaml" || fail "server-side dry run"
else
    step "server-side dry run: skipped (set DYNPART_E2E_KUBECONFIG)"
fi

printf '\ncheck.sh: all chart checks passed\n'
