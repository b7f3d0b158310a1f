#!/usr/bin/env bash
# Builds the chart's check tools from source (Go modules; no binary downloads) and generates the
# Kubernetes JSON schemas kubeconform validates against, all offline-capable, into git-ignored
# .cache/ (DYNPART_TOOLS_CACHE, default <repo>/.cache):
#
#   .cache/tools/bin/helm          helm.sh/helm/v3/cmd/helm            @ $HELM_VERSION
#   .cache/tools/bin/kubeconform   github.com/yannh/kubeconform/...    @ $KUBECONFORM_VERSION
#   .cache/kube-schemas/v<K8S>-standalone[-strict]/<kind>-<group>-<version>.json
#         from api/openapi-spec/swagger.json of the Go module k8s.io/kubernetes@v<K8S> (the same
#         version as the e2e kube-apiserver, tests/e2e/go.mod), converted by
#         charts/tools/openapi2jsonschema.py (kubeconform's own conversion rules)
#   .cache/kube-schemas/current   that Kubernetes version (check.sh reads it)
#   .cache/kube-schemas/crds/servicemonitor-monitoring-v1.json, podmonitor-monitoring-v1.json
#         from the ServiceMonitor and PodMonitor CRDs in the Go module
#         github.com/prometheus-operator/prometheus-operator, converted by kubeconform's
#         scripts/openapi2jsonschema.py (the CRDs themselves are kept as
#         .cache/kube-schemas/crds/servicemonitor-crd.yaml and podmonitor-crd.yaml for check.sh's
#         server-side dry run)
#
# Idempotent: a tool is rebuilt only when missing or reporting another version; schemas are
# regenerated only when their stamp (versions, the CRD list, converter hash) changed.
# Environment: HELM_VERSION, KUBECONFORM_VERSION, KUBE_VERSION, PROM_OPERATOR_VERSION,
# DYNPART_TOOLS_CACHE, DYNPART_GO_PARALLEL (go build -p, default nproc), DYNPART_FORCE_REBUILD=1,
# PYTHON (default .venv/bin/python, else python3; needs PyYAML).
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
KUBECONFORM_VERSION="${KUBECONFORM_VERSION:-v0.8.0}"
PROM_OPERATOR_VERSION="${PROM_OPERATOR_VERSION:-v0.85.0}"
# The Prometheus operator's CRDs the chart renders (metrics.serviceMonitor.enabled), by plural.
MONITOR_CRDS=(servicemonitors podmonitors)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="${DYNPART_TOOLS_CACHE:-$root/.cache}"
bin="$cache/tools/bin"
schemas="$cache/kube-schemas"
mkdir -p "$bin" "$schemas"

log() { printf '[build-tools] %s\n' "$*" >&2; }
die() { printf '[build-tools] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "go not found (Go >= 1.26 builds helm and kubeconform)"
if [[ -z "${KUBE_VERSION:-}" ]]; then
    KUBE_VERSION="$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$root/tests/e2e/go.mod" 2>/dev/null || true)"
    KUBE_VERSION="${KUBE_VERSION:-v1.35.4}"
fi
if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"
else py=python3; fi

export CGO_ENABLED=0 GOTOOLCHAIN=local
jobs="${DYNPART_GO_PARALLEL:-$(nproc)}"

# Source directory of a Go module version (downloads it into the module cache if needed).
moddir() {
    local dir
    dir="$(cd "$cache" && go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [[ -n "$dir" && -d "$dir" ]] || die "go mod download $1@$2 failed"
    printf '%s\n' "$dir"
}

build_helm() {
    local have=""
    [[ -x "$bin/helm" ]] && have="$("$bin/helm" version --template '{{.Version}}' 2>/dev/null || true)"
    if [[ -z "${DYNPART_FORCE_REBUILD:-}" && "$have" == "$HELM_VERSION" ]]; then
        log "helm $HELM_VERSION: present"; return
    fi
    log "building helm $HELM_VERSION (cold: several minutes on 2 cores)"
    local start=$SECONDS src k8s major minor
    src="$(moddir helm.sh/helm/v3 "$HELM_VERSION")"
    # As helm's Makefile: the default Kubernetes version of `helm template/lint` follows client-go.
    k8s="$(awk '$1=="k8s.io/client-go" {print $2}' "$src/go.mod")"
    k8s="${k8s#v}"; major=$(( ${k8s%%.*} + 1 )); minor="${k8s#*.}"; minor="${minor%%.*}"
    local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$major -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
    ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$major -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
    (cd "$cache" && GOBIN="$bin" go install -p "$jobs" -trimpath -ldflags="$ldflags" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION") || die "go install helm failed"
    have="$("$bin/helm" version --template '{{.Version}}')"
    [[ "$have" == "$HELM_VERSION" ]] || die "built helm reports $have, expected $HELM_VERSION"
    log "helm $HELM_VERSION built in $((SECONDS - start))s"
}

build_kubeconform() {
    local have=""
    [[ -x "$bin/kubeconform" ]] && have="$("$bin/kubeconform" -v 2>/dev/null || true)"
    if [[ -z "${DYNPART_FORCE_REBUILD:-}" && "$have" == "$KUBECONFORM_VERSION" ]]; then
        log "kubeconform $KUBECONFORM_VERSION: present"; return
    fi
    log "building kubeconform $KUBECONFORM_VERSION"
    local start=$SECONDS
    (cd "$cache" && GOBIN="$bin" go install -p "$jobs" -trimpath -ldflags="-s -w -X main.version=$KUBECONFORM_VERSION" \
        "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION") || die "go install kubeconform failed"
    have="$("$bin/kubeconform" -v)"
    [[ "$have" == "$KUBECONFORM_VERSION" ]] || die "built kubeconform reports $have, expected $KUBECONFORM_VERSION"
    log "kubeconform $KUBECONFORM_VERSION built in $((SECONDS - start))s"
}

gen_schemas() {
    local conv="$here/tools/openapi2jsonschema.py" stamp="$schemas/.stamp" want
    want="k8s $KUBE_VERSION; prometheus-operator $PROM_OPERATOR_VERSION (${MONITOR_CRDS[*]}); kubeconform $KUBECONFORM_VERSION; $(sha256sum "$conv" | cut -c1-16)"
    if [[ -z "${DYNPART_FORCE_REBUILD:-}" && -f "$stamp" && "$(cat "$stamp")" == "$want" \
          && "$(cat "$schemas/current" 2>/dev/null)" == "$KUBE_VERSION" ]]; then
        log "schemas: up to date ($want)"; return
    fi
    "$py" -c 'import yaml' 2>/dev/null \
        || die "$py has no PyYAML (needed to convert the Prometheus operator's CRDs): create the venv first (bash scripts/test.sh) or set PYTHON"
    local start=$SECONDS ksrc psrc crd tmp
    rm -f "$stamp"
    ksrc="$(moddir k8s.io/kubernetes "$KUBE_VERSION")"
    local ver="${KUBE_VERSION}"
    rm -rf "$schemas/$ver-standalone" "$schemas/$ver-standalone-strict" "$schemas/crds"
    "$py" "$conv" "$ksrc/api/openapi-spec/swagger.json" "$schemas/$ver-standalone" \
        || die "schema conversion failed"
    "$py" "$conv" --strict "$ksrc/api/openapi-spec/swagger.json" "$schemas/$ver-standalone-strict" \
        || die "schema conversion failed"
    # ServiceMonitor and PodMonitor (CRDs): the CRD manifests shipped in prometheus-operator's Go
    # module, converted by the script kubeconform documents for CRDs
    # (DENY_ROOT_ADDITIONAL_PROPERTIES: strict).
    psrc="$(moddir github.com/prometheus-operator/prometheus-operator "$PROM_OPERATOR_VERSION")"
    mkdir -p "$schemas/crds"
    local plural
    for plural in "${MONITOR_CRDS[@]}"; do
        crd="$psrc/example/prometheus-operator-crd/monitoring.coreos.com_${plural}.yaml"
        [[ -f "$crd" ]] || die "no ${plural%s} CRD at $crd"
        (cd "$schemas/crds" && DENY_ROOT_ADDITIONAL_PROPERTIES=1 FILENAME_FORMAT='{kind}-{group}-{version}' \
            "$py" "$(moddir github.com/yannh/kubeconform "$KUBECONFORM_VERSION")/scripts/openapi2jsonschema.py" "$crd" >/dev/null) \
            || die "${plural%s} schema conversion failed"
        cp "$crd" "$schemas/crds/${plural%s}-crd.yaml"  # for the server-side dry run (check.sh)
    done
    echo "$KUBE_VERSION" >"$schemas/current"  # the version check.sh validates against
    echo "$want" >"$stamp"
    log "schemas generated in $((SECONDS - start))s into $schemas"
}

build_helm
build_kubeconform
gen_schemas
log "ready: $bin/helm, $bin/kubeconform, $schemas"
