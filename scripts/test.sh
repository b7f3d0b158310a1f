#!/usr/bin/env bash
# Install the test dependencies and run every test. README's second command; .ci/run calls it.
#   bash scripts/test.sh            # all tests
#   bash scripts/test.sh -k mig     # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# The end-to-end tests run a real kube-apiserver, kube-scheduler and etcd, built here from their
# Go modules and Debian's etcd package; the chart checks use helm and kubeconform, also built from
# their Go modules. Without Go (outside CI) those tests skip and say how to enable them.
if [ -f tests/e2e/build.sh ]; then
  if command -v go >/dev/null 2>&1 || [ "${CI:-}" = "true" ]; then
    bash tests/e2e/build.sh
    # helm and kubeconform (and offline Kubernetes schemas) for the chart checks
    bash charts/build-tools.sh
  else
    echo "scripts/test.sh: Go not found: end-to-end tests will be skipped (install Go, then rerun)"
  fi
fi
exec .venv/bin/python -m pytest "$@"
