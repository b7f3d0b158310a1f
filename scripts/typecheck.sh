#!/usr/bin/env bash
# Type-check the installed namespace with mypy (settings in pyproject.toml: strict for `dynpart`
# and `dynpart.planner`). The folders install as `dynpart.planner`, `dynpart.agent`,
# `dynpart.simulations` (pyproject's package-dir), which mypy cannot map from the source tree,
# so it checks a tree of symbolic links shaped like the installed package; paths in its report
# are turned back into the repository's.
#   bash scripts/typecheck.sh           # needs mypy in .venv (pip install -e '.[test]')
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=.cache/typecheck
rm -rf "$tree" && mkdir -p "$tree/dynpart"
for f in dynpart/*; do ln -s "$root/$f" "$tree/dynpart/"; done
for part in planner agent simulations; do ln -s "$root/$part" "$tree/dynpart/$part"; done
cd "$tree"
set +e
"$root/.venv/bin/python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.cache/mypy" -p dynpart "$@" 2>&1 \
  | sed -E 's#^dynpart/(planner|agent|simulations)/#\1/#'
status=${PIPESTATUS[0]}
exit "$status"
