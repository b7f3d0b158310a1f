"""The simulator's two rooms (simulations/__init__.py): `packing` and `replay` never import each
other, the shared layer imports neither, and no module repeats a name of the planner's for
something else."""

from __future__ import annotations

import pytest

from tests.test_layers import GRAPH, ROOT

SIM = "dynpart.simulations"
ROOMS = (f"{SIM}.packing", f"{SIM}.replay")


def room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def test_rooms_exist():
    assert all(r in GRAPH for r in ROOMS)


@pytest.mark.parametrize("here", ROOMS)
def test_a_room_imports_only_itself_and_the_shared_layer(here):
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if room(m) == here
             for d in deps if room(d) not in (None, here)]
    assert wrong == []


def test_the_shared_layer_imports_no_room():
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if m.startswith(SIM) and room(m) is None
             for d in deps if room(d) is not None]
    assert wrong == []


def test_no_module_repeats_a_planner_name():
    planner = {p.stem for p in (ROOT / "planner").rglob("*.py") if p.stem != "__init__"}
    planner |= {p.name for p in (ROOT / "planner").iterdir() if (p / "__init__.py").exists()}
    ours = {p.stem for p in (ROOT / "simulations").rglob("*.py") if p.stem != "__init__"}
    ours |= {p.parent.name for p in (ROOT / "simulations").rglob("__init__.py")}
    assert ours & planner == set()
