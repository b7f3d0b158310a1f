#!/usr/bin/env bash
# Record, read-only, what a real NVIDIA driver answers to dynpart's NVML reads, on a GPU host
# without dynpart installed (how tests/fixtures/nvml/*.json were made):
#   bash scripts/record-nvml.sh OUTDIR [WHEELDIR]
# WHEELDIR holds wheels of dynpart's dependencies for this host's Python (no network needed); they
# are installed into a temporary folder. dynpart itself runs from this checkout, arranged as the
# installed package is (scripts/typecheck.sh does the same).
# Writes to OUTDIR: log.txt (everything printed), smi-q.txt and smi-mig.txt (nvidia-smi's reports:
# nvidia-smi -q; MIG profiles, placements and instances), probe.txt and probe.json (`dynpart agent
# probe`), nvml-recording.json (`probe --record`: every NVML call with its answer) and
# probe-replay.txt (the same probe run again on that recording; it must print the same).
# Nothing here changes the GPU: nvidia-smi only lists, and the recording refuses any NVML call that
# is not a read (dynpart.agent.driver.nvml_recording.READ_ONLY).
set -uo pipefail
out=${1:?usage: record-nvml.sh OUTDIR [WHEELDIR]}
wheels=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee "$out/log.txt") 2>&1

echo "== host"; uname -a; python3 --version; nvidia-smi || echo "nvidia-smi failed: $?"
nvidia-smi -q > "$out/smi-q.txt" 2>&1
{
  echo "== nvidia-smi --query-gpu"
  nvidia-smi --query-gpu=name,uuid,memory.total,mig.mode.current,mig.mode.pending,driver_version,compute_mode \
    --format=csv
  echo "== nvidia-smi mig -lgip"; nvidia-smi mig -lgip
  echo "== nvidia-smi mig -lgipp"; nvidia-smi mig -lgipp
  echo "== nvidia-smi mig -lgi"; nvidia-smi mig -lgi
} > "$out/smi-mig.txt" 2>&1
cat "$out/smi-mig.txt"

site=$(mktemp -d)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site/lib" \
    "$wheels"/*.whl || { echo "installing the wheels failed"; exit 1; }
fi
mkdir -p "$site/pkg/dynpart"
for f in "$root"/dynpart/*; do ln -s "$f" "$site/pkg/dynpart/"; done
for part in planner agent simulations; do ln -s "$root/$part" "$site/pkg/dynpart/$part"; done
export PYTHONPATH="$site/pkg:$site/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$site/pkg"  # python puts the working directory first: not this checkout's bare dynpart/
python3 -c 'import pynvml, importlib.metadata as m; print("nvidia-ml-py", m.version("nvidia-ml-py"), pynvml.__file__)'

dynpart() { python3 -m dynpart.cli "$@"; }
if ! python3 -c 'import dynpart.cli' 2>/dev/null; then  # a dependency of another command is missing here
  python3 -c 'import dynpart.cli'
  echo "(dynpart.cli does not import here: running the agent's own commands through dynpart.agent.cli)"
  dynpart() {
    python3 -c 'import argparse, sys
from dynpart.agent import cli
p = argparse.ArgumentParser(prog="dynpart"); p.add_argument("--catalog", action="append", default=[])
cli.register(p.add_subparsers()); a = p.parse_args(); sys.exit(a.func(a))' "$@"
  }
fi
echo "== dynpart agent probe"; dynpart agent probe > "$out/probe.txt" 2>&1; echo "rc=$?"; cat "$out/probe.txt"
echo "== dynpart agent probe --json"; dynpart agent probe --json > "$out/probe.json" 2>&1; echo "rc=$?"
echo "== dynpart agent probe --record"; dynpart agent probe --record "$out/nvml-recording.json"; echo "rc=$?"
echo "== dynpart agent probe --replay"
dynpart agent probe --replay "$out/nvml-recording.json" > "$out/probe-replay.txt" 2>&1; echo "rc=$?"
if [ -s "$out/nvml-recording.json" ] && head -n "$(wc -l < "$out/probe.txt")" "$out/probe-replay.txt" | cmp -s - "$out/probe.txt"; then
  echo "replay: the probe prints the same on the recording"
else
  echo "replay: DIFFERS"; diff "$out/probe.txt" "$out/probe-replay.txt"
fi
ls -la "$out"
