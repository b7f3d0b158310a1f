"""`plan(snapshot) -> Plan`: the one planning entry point, called by the controller and the
simulator alike. Pure: no I/O, no clock-dependent results (time limits are deterministic).

It compiles the snapshot, hands it to the policy that `PlanOptions.policy` names (dynpart's own
or a baseline, all behind `PlanningPolicy`) and turns the result into a `Plan`."""

from __future__ import annotations

import time
from collections.abc import Callable

from dynpart.catalog import Catalog, default_catalog
from dynpart.planner.baselines.nos import NosPolicy
from dynpart.planner.baselines.static import StaticPolicy
from dynpart.planner.bound import placed_upper_bound
from dynpart.planner.dynpart_policy import DynpartPolicy
from dynpart.planner.output import build_plan
from dynpart.planner.policy import PlanningPolicy, PlanOptions, PolicyName
from dynpart.planner.problem import compile_problem
from dynpart.snapshot import Plan, Snapshot

__all__ = ["POLICIES", "PlanOptions", "PolicyName", "plan"]

# the policies `PlanOptions.policy` can name, each built from the options
POLICIES: dict[PolicyName, Callable[[PlanOptions], PlanningPolicy]] = {
    "dynpart": DynpartPolicy,
    "nos": NosPolicy,
    "static": StaticPolicy,
}


def plan(snapshot: Snapshot, catalog: Catalog | None = None, options: PlanOptions | None = None) -> Plan:
    opts = options or PlanOptions()
    t0 = time.perf_counter()
    problem = compile_problem(snapshot, catalog or default_catalog())
    bound = placed_upper_bound(problem)
    policy = POLICIES[opts.policy](opts)
    result = policy.place(problem)
    return build_plan(problem, policy, result, bound, time.perf_counter() - t0)
