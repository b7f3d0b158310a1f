"""Compare the planning time of two source trees, interleaved, and check that they plan alike.

On a shared machine one timing says little: this runs `dynpart bench planner`'s seeded clusters
through `plan()` for tree A, then B, then B, then A... each in a fresh process that imports the
package from that tree, and prints the median plan time per round, the ratio B/A of the medians
of rounds, and whether both trees made the same plans (a digest of each `Plan`, its timing left
out). A change meant to make planning faster should print `same plans: yes`.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python scripts/compare-planner.py /tmp/before . --rounds 4 --seeds 1-5

Each tree is a repository root (its folders dynpart/, planner/, agent/, simulations/); the
interpreter running this script must have the dependencies installed (the project's .venv)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# run in a fresh interpreter: load the package from the tree, plan each seed, print times and
# digests as one JSON line
_CHILD = r"""
import hashlib, importlib.util, json, os, sys, time
tree, seeds, nodes, pending, mode, gpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)

load("dynpart", os.path.join(tree, "dynpart"))
for part in ("planner", "agent", "simulations"):
    load("dynpart." + part, os.path.join(tree, part))
from dynpart.catalog import load_catalog
from dynpart.planner.core import PlanOptions, plan
from dynpart.planner.workload import random_snapshot

catalog = load_catalog([])
times, digests = [], []
for seed in (int(s) for s in seeds.split(",")):
    snapshot = random_snapshot(seed, nodes, 8, gpu, pending, mode, 0.9, catalog)
    start = time.perf_counter()
    result = plan(snapshot, catalog, PlanOptions())
    times.append(time.perf_counter() - start)
    dumped = result.model_dump(mode="json")
    dumped["stats"] = {k: v for k, v in dumped.get("stats", {}).items() if not k.endswith("_s")}
    digests.append(hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:12])
print(json.dumps({"times": times, "digests": digests}))
"""


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or N-M") from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= N <= M")
    return list(range(lo, hi + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree_a", help="repository root of the tree to compare against")
    parser.add_argument("tree_b", help="repository root of the tree compared")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per tree, alternating (default 4)")
    parser.add_argument("--seeds", type=_seeds, default=_seeds("1-5"), help="seeds N-M (default 1-5)")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pending", type=int, default=2000)
    parser.add_argument("--mode", choices=["mig", "mps"], default="mig")
    parser.add_argument("--gpu", default="H100-80GB")
    args = parser.parse_args()
    trees = [os.path.abspath(args.tree_a), os.path.abspath(args.tree_b)]
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, "planner", "core.py")):
            parser.error(f"{tree}: not a dynpart repository root (no planner/core.py)")
    medians: list[list[float]] = [[], []]
    digests: list[list[str] | None] = [None, None]
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            child = [sys.executable, "-c", _CHILD, trees[i], ",".join(map(str, args.seeds)), str(args.nodes),
                     str(args.pending), args.mode, args.gpu]
            done = subprocess.run(child, capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                print(f"compare-planner: planning with {trees[i]} failed", file=sys.stderr)
                return 1
            out = json.loads(done.stdout.strip().splitlines()[-1])
            medians[i].append(statistics.median(out["times"]))
            if digests[i] is None:
                digests[i] = out["digests"]
            times = " ".join(f"{t:.3f}" for t in out["times"])
            print(f"round {r} {'AB'[i]}: median {medians[i][-1]:.3f} s ({times})", flush=True)
    a, b = statistics.median(medians[0]), statistics.median(medians[1])
    print(f"A {trees[0]}: {a:.3f} s; B {trees[1]}: {b:.3f} s (medians of rounds); B/A {b / a:.3f}")
    same = digests[0] == digests[1]
    print(f"same plans: {'yes' if same else 'NO'} (A {digests[0]}, B {digests[1]})")
    return 0 if same else 3


if __name__ == "__main__":
    sys.exit(main())
