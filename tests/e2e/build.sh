#!/usr/bin/env bash
# Builds the binaries of the local Kubernetes control plane used by the e2e
# tests (tests/e2e/cluster.py), into a git-ignored cache:
#
#   $E2E_CACHE/bin/kube-apiserver   k8s.io/kubernetes/cmd/kube-apiserver
#   $E2E_CACHE/bin/kube-scheduler   k8s.io/kubernetes/cmd/kube-scheduler
#   $E2E_CACHE/bin/etcd             Debian's etcd-server package (unpacked)
#
# E2E_CACHE defaults to <repo>/.cache/e2e. The k8s version is the one pinned by
# tests/e2e/go.mod; a stamp file records what the binaries were built from, so
# re-running this is cheap and rebuilds only when go.mod/go.sum/Go changed.
#
# etcd is taken from `apt-get download etcd-server` and unpacked with dpkg-deb
# rather than `apt-get install`: no root needed (except for `apt-get update` on
# a machine that never ran it), no init script, no `etcd` system service
# started. An etcd already given by $E2E_ETCD is used as is.
#
# Environment: E2E_CACHE, E2E_ETCD, E2E_GO_PARALLEL (go build -p, default
# nproc), E2E_FORCE_REBUILD=1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${E2E_CACHE:-$root/.cache/e2e}"
bin="$cache/bin"
mkdir -p "$bin"
export DEBIAN_FRONTEND=noninteractive

log() { printf '[e2e build] %s\n' "$*" >&2; }
die() { printf '[e2e build] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- etcd
install_etcd() {
    if [[ -n "${E2E_ETCD:-}" ]]; then
        [[ -x "$E2E_ETCD" ]] || die "E2E_ETCD=$E2E_ETCD is not an executable"
        log "etcd: using E2E_ETCD=$E2E_ETCD"
        return
    fi
    if [[ -x "$bin/etcd" ]] && "$bin/etcd" --version >/dev/null 2>&1; then
        log "etcd: present ($("$bin/etcd" --version | head -n1))"
        return
    fi
    command -v apt-get >/dev/null || die "apt-get not found: install etcd >= 3.4 and set E2E_ETCD"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" RETURN
    if ! (cd "$tmp" && apt-get download -q etcd-server >/dev/null 2>&1); then
        [[ "$(id -u)" == 0 ]] || die "apt-get download etcd-server failed and not root to run apt-get update"
        log "etcd: apt-get update"
        apt-get update -q >/dev/null || die "apt-get update failed"
        (cd "$tmp" && apt-get download -q etcd-server) || die "apt-get download etcd-server failed"
    fi
    dpkg-deb -x "$tmp"/etcd-server_*.deb "$tmp/x"
    [[ -x "$tmp/x/usr/bin/etcd" ]] || die "no usr/bin/etcd in the etcd-server package"
    install -m 0755 "$tmp/x/usr/bin/etcd" "$bin/etcd.tmp"
    mv -f "$bin/etcd.tmp" "$bin/etcd"
    log "etcd: installed $("$bin/etcd" --version | head -n1) from Debian etcd-server"
}

# ---------------------------------------------------------------- kube-*
build_kube() {
    command -v go >/dev/null || die "go not found (need Go >= $(awk '/^go /{print $2}' "$here/go.mod"))"
    local k8s stamp want
    k8s="$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/go.mod")"
    [[ -n "$k8s" ]] || die "cannot find the k8s.io/kubernetes version in $here/go.mod"
    want="k8s.io/kubernetes $k8s; $(go env GOVERSION); $(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
    stamp="$bin/.kube-stamp"
    if [[ -z "${E2E_FORCE_REBUILD:-}" && -x "$bin/kube-apiserver" && -x "$bin/kube-scheduler" \
          && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        log "kube-apiserver/kube-scheduler: up to date ($want)"
        return
    fi
    log "building kube-apiserver and kube-scheduler $k8s (cold: ~4 min on 2 cores)"
    rm -f "$stamp"
    local start=$SECONDS
    (
        cd "$here"
        export CGO_ENABLED=0 GOTOOLCHAIN=local
        local v=k8s.io/component-base/version minor=${k8s#v1.}
        minor=${minor%%.*}
        local ldflags="-s -w -X $v.gitVersion=$k8s -X $v.gitMajor=1 -X $v.gitMinor=$minor"
        ldflags+=" -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
        for cmd in kube-apiserver kube-scheduler; do
            go build -mod=readonly -p "${E2E_GO_PARALLEL:-$(nproc)}" -trimpath -ldflags="$ldflags" \
                -o "$bin/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
            mv -f "$bin/$cmd.tmp" "$bin/$cmd"
        done
    ) || die "go build failed"
    echo "$want" >"$stamp"
    log "built in $((SECONDS - start))s: $("$bin/kube-apiserver" --version 2>/dev/null || true)"
}

install_etcd
build_kube
log "ready in $bin"
