"""A static layout, as GPU Operator's mig-manager gives: every unpartitioned GPU gets the one
geometry configured for its model and the layout never changes afterwards; pods only take
free slices that happen to match.

The default is mig-parted's `all-balanced`: 2 x 1g + 1 x 2g + 1 x 3g on 7-slice GPUs,
2 x 1g + 1 x 2g on A30; MPS GPUs are split into 4 equal slices."""

from __future__ import annotations

from functools import singledispatch

from dynpart.catalog import GpuModel
from dynpart.errors import DynpartError
from dynpart.mig import place_counts
from dynpart.planner.baselines.common import schedule
from dynpart.planner.mig_state import MigState
from dynpart.planner.mps_state import MpsState
from dynpart.planner.policy import PlanOptions, PolicyName, PolicyResult
from dynpart.planner.problem import Problem, Request
from dynpart.planner.state import GpuState, new_state
from dynpart.planner.types import Placements


class StaticPolicy:
    def __init__(self, options: PlanOptions):
        self.layout = options.static_layout

    @property
    def name(self) -> PolicyName:
        return "static"

    def place(self, problem: Problem) -> PolicyResult:
        states, placed = plan_static(problem, self.layout)
        return PolicyResult(states, placed, "static")

    def unplaced_reason(self, problem: Problem, req: Request) -> str:
        return (f"the static layout has no free {req.resource} on its {len(req.candidates)} candidate node(s) "
                "and never changes")


def balanced_counts(model: GpuModel) -> dict[str, int] | None:
    """mig-parted's all-balanced for the model; None when its catalog entry lacks one of the
    profiles it takes (a 1g, 2g or 3g profile: a catalog file may narrow a model)."""
    by_compute: dict[int, str] = {}
    for p in model.mig_profiles:
        if not p.media_extensions and p.compute not in by_compute:
            by_compute[p.compute] = p.name  # first = smallest memory of that compute size
    want = {1: 2, 2: 1, 3: 1} if model.compute_slices >= 7 else {1: 2, 2: 1}
    if any(c not in by_compute for c in want):
        return None
    return {by_compute[c]: n for c, n in want.items()}


def parse_counts(model: GpuModel, text: str) -> dict[str, int]:
    """"1g.10gb:3,2g.20gb:2" -> counts, checked against the catalog."""
    counts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = part.partition(":")
        if name not in model.profiles_by_name:
            raise DynpartError(f"static layout for {model.name}: unknown profile {name!r}")
        try:
            counts[name] = counts.get(name, 0) + int(n or 1)
        except ValueError:
            raise DynpartError(f"static layout for {model.name}: {part!r} is not profile:count") from None
    return counts


def plan_static(problem: Problem, layout: dict[str, str]) -> tuple[list[GpuState], Placements]:
    states = [new_state(g) for g in problem.gpus]
    for st in states:
        _lay_out(st, layout)
    cpu = [n.cpu_free for n in problem.nodes]
    mem = [n.mem_free for n in problem.nodes]
    placed: Placements = {}
    schedule(problem, states, cpu, mem, placed)
    return states, placed


@singledispatch
def _lay_out(st: GpuState, layout: dict[str, str]) -> None:
    """Give an unpartitioned GPU the configured layout of its mode (partitioned ones keep theirs)."""
    raise TypeError(f"no static layout for a {type(st).__name__}")


@_lay_out.register
def _lay_out_mig(st: MigState, layout: dict[str, str]) -> None:
    if st.insts:
        return
    model = st.info.model
    counts = parse_counts(model, layout[model.name]) if model.name in layout else balanced_counts(model)
    if counts is None:
        raise DynpartError(f"static layout for {model.name}: no all-balanced layout (its catalog entry lacks a 1g, "
                           f"2g or 3g profile); give the model a layout, profile:count,...")
    geometry = place_counts(model, counts)
    if geometry is None:
        raise DynpartError(f"static layout for {model.name}: {counts} has no valid MIG placement")
    st.set_geometry(geometry)


@_lay_out.register
def _lay_out_mps(st: MpsState, layout: dict[str, str]) -> None:
    if st.slices or st.whole_pod is not None:
        return
    if "mps_size" in layout:  # as many slices of one size as fit
        size = int(layout["mps_size"])
        st.replace_free_slices([size] * min(st.cap // size, st.max_slices or st.cap))
        return
    parts = int(layout.get("mps", "4"))  # equal parts, no more than the MPS server serves
    st.replace_free_slices([st.cap // parts] * min(parts, st.max_slices or parts))
