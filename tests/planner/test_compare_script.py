"""scripts/compare-planner.py, the developers' interleaved timing of two trees: it runs, and a
tree compared with itself makes the same plans."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tree_against_itself_plans_alike() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare-planner.py"), str(ROOT), str(ROOT),
                           "--rounds", "2", "--seeds", "1-2", "--nodes", "6", "--pending", "10"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("round ") for line in lines) == 4
    assert any(line.startswith("same plans: yes") for line in lines)
    assert "B/A" in done.stdout


def test_a_folder_that_is_no_tree_is_named() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare-planner.py"), str(ROOT / "docs"), str(ROOT)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "docs: not a dynpart repository root" in done.stderr
