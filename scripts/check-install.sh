#!/usr/bin/env bash
# What a user gets from `pip install`: builds the sdist and the wheel, installs the wheel into a
# fresh virtual environment and `pip install .` into another, and checks in each that
#   - exactly one top-level package of ours lands in site-packages: `dynpart` (planner, agent and
#     simulations live under it);
#   - the catalog data is installed, and `dynpart simulate --out DIR` works from a directory
#     outside the source tree (nothing is imported from the checkout).
# .ci/run calls it; by hand: bash scripts/check-install.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
python=${PYTHON:-python3}
work=${1:-$(mktemp -d)}
mkdir -p "$work"
echo "check-install: working in $work"

"$python" -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install -q build==1.6.1
"$work/build-env/bin/python" -m build --outdir "$work/dist" "$src" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log"; echo "check-install: building the sdist and wheel failed" >&2; exit 1; }
sdist=$(ls "$work"/dist/dynpart-*.tar.gz)
wheel=$(ls "$work"/dist/dynpart-*.whl)
echo "check-install: built $(basename "$sdist") and $(basename "$wheel")"

# the wheel's own listing: top-level names and that every part is in it
tops=$("$python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print(" ".join(sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))})))
for needed in ("dynpart/planner/core.py", "dynpart/agent/loop.py", "dynpart/simulations/__init__.py",
               "dynpart/data/gpu-catalog.yaml", "dynpart/cli.py"):
    if needed not in names:
        sys.exit(f"check-install: the wheel lacks {needed}")
EOF
)
[ "$tops" = "dynpart" ] || { echo "check-install: the wheel's top-level entries are '$tops', expected 'dynpart'" >&2; exit 1; }

check_env() {  # $1: venv; $2: what was installed
  local venv=$1 what=$2 site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # ours = what dynpart's RECORD lists outside its .dist-info
  local ours
  ours=$("$venv/bin/python" - "$site" <<'EOF'
import sys, pathlib
site = pathlib.Path(sys.argv[1])
record = next(site.glob("dynpart-*.dist-info/RECORD")).read_text().splitlines()
tops = {line.split(",")[0].split("/")[0] for line in record if line}
print(" ".join(sorted(t for t in tops if not t.endswith(".dist-info") and t != ".." and t != "__pycache__")))
EOF
)
  [ "$ours" = "dynpart" ] || { echo "check-install ($what): top-level packages of ours: '$ours', expected 'dynpart'" >&2; exit 1; }
  for stray in planner agent simulations; do
    [ ! -e "$site/$stray" ] || { echo "check-install ($what): $site/$stray exists" >&2; exit 1; }
  done
  local run=$work/run-$what
  mkdir -p "$run"
  (cd "$run" && "$venv/bin/dynpart" simulate --out "$run/sim" >"$run/out.txt" 2>&1) \
    || { tail -20 "$run/out.txt"; echo "check-install ($what): dynpart simulate failed" >&2; exit 1; }
  [ -s "$run/sim/summary.json" ] && ls "$run/sim"/*.png >/dev/null \
    || { echo "check-install ($what): dynpart simulate wrote no summary or plots" >&2; exit 1; }
  # imported from site-packages, not from a checkout
  (cd "$run" && "$venv/bin/python" -c '
import sys, dynpart.planner, dynpart.agent, dynpart.simulations
for m in (dynpart.planner, dynpart.agent, dynpart.simulations):
    assert "site-packages" in m.__file__, m.__file__
') || { echo "check-install ($what): a part was not imported from site-packages" >&2; exit 1; }
  echo "check-install ($what): one top-level package (dynpart); dynpart simulate wrote $(ls "$run/sim"/*.png | wc -l) plot(s) and a summary from $run"
}

"$python" -m venv "$work/venv-wheel"
"$work/venv-wheel/bin/python" -m pip install -q "$wheel"
check_env "$work/venv-wheel" wheel

"$python" -m venv "$work/venv-source"
"$work/venv-source/bin/python" -m pip install -q "$src"
check_env "$work/venv-source" source
echo "check-install: ok"
