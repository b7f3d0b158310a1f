#!/usr/bin/env bash
# The checks that keep the house in order (.ci/run calls it): ruff (lint and import order) and
# mypy (strict for dynpart/ and planner/), both configured in pyproject.toml. Needs the test extra:
# pip install -e '.[test]' (scripts/test.sh does it).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "lint: ruff $(.venv/bin/ruff --version | cut -d' ' -f2)"
.venv/bin/ruff check .
echo "lint: mypy"
bash scripts/typecheck.sh
