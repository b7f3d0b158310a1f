"""The house rules, checked on the source tree:

- one installed namespace: every folder of ours installs under `dynpart` (pyproject's
  package-dir), every sub-package is listed for the wheel, and no module imports the folders
  by their bare names (`planner`, `agent`, `simulations`);
- imports flow one way: `dynpart` core <- `dynpart.planner`, `dynpart.agent` <- `dynpart.simulations`
  <- the CLI (`dynpart.cli`); the planner and the agent do not import each other; the simulator
  does not import the agent;
- no import cycle between modules, counting imports made inside functions too (a lazy import
  that hides a cycle is still a cycle);
- every `type: ignore` names its error code and says why on the same line.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (pyproject.toml's [tool.setuptools] package-dir)
FOLDERS = {"dynpart": "dynpart", "planner": "dynpart.planner", "agent": "dynpart.agent",
           "simulations": "dynpart.simulations"}
TOP = "dynpart.cli"


def layer(module: str) -> tuple[int, str]:
    """(height, part) of one of our modules: a module may import its own part and lower layers."""
    if module == TOP or module.startswith(TOP + "."):
        return 3, "cli"
    for part, height in (("dynpart.simulations", 2), ("dynpart.planner", 1), ("dynpart.agent", 1)):
        if module == part or module.startswith(part + "."):
            return height, part
    return 0, "dynpart"


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Our modules imported anywhere in the file (function bodies included), resolved."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            # the longest prefix that is one of our modules (`from x import name` may name a module)
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                candidate = ".".join(parts[:k])
                if candidate in known:
                    if candidate != module:
                        found.add(candidate)
                    break
    return found


GRAPH = {m: imports_of(m, p, set(modules())) for m, p in modules().items()}


def test_pyproject_installs_every_folder_under_dynpart():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {package: folder for folder, package in FOLDERS.items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    packages |= {"dynpart.data"}  # the catalog's data files
    assert set(cfg["packages"]) == packages, "pyproject.toml's packages list and the folders differ"


@pytest.mark.parametrize("folder", ["dynpart", "planner", "agent", "simulations", "tests", "scripts", "charts"])
def test_no_import_by_bare_folder_name(folder):
    bare = re.compile(r"^\s*(from|import)\s+(planner|agent|simulations)(\.|\s|$)", re.M)
    offenders = [f"{p.relative_to(ROOT)}" for p in (ROOT / folder).rglob("*.py") if bare.search(p.read_text())]
    assert offenders == [], f"import these as dynpart.planner / dynpart.agent / dynpart.simulations: {offenders}"


def test_imports_flow_one_way():
    wrong = []
    for module, deps in GRAPH.items():
        height, part = layer(module)
        for dep in deps:
            dep_height, dep_part = layer(dep)
            if dep_height > height or (dep_height == height and dep_part != part):
                wrong.append(f"{module} imports {dep}")
    assert wrong == [], "a lower layer imports a higher one (dynpart <- planner/agent <- simulations <- cli):\n" + \
        "\n".join(sorted(wrong))


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layer_check_can_fail():
    """The checks above catch what they are for (on made-up graphs)."""
    assert layer("dynpart.snapshot") < layer("dynpart.planner.core") < layer("dynpart.simulations.replay") \
        < layer("dynpart.cli")
    assert layer("dynpart.agent.loop")[1] != layer("dynpart.planner.core")[1]
    fake = ROOT / "planner" / "core.py"
    assert "dynpart.snapshot" in imports_of("dynpart.planner.core", fake, set(modules()))


def test_type_ignores_name_a_code_and_a_reason():
    bare = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if "type: ignore" in line and not re.search(r"type: ignore\[[a-z-, ]+\]\s+#\s*\S", line):
                    bare.append(f"{path.relative_to(ROOT)}:{no}")
    assert bare == [], "write `# type: ignore[code]  # why`: " + ", ".join(bare)
