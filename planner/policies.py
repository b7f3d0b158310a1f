"""The policies `PlanOptions.policy` can name, each built from the options."""

from __future__ import annotations

from collections.abc import Callable

from dynpart.planner.baselines.nos import NosPolicy
from dynpart.planner.baselines.static import StaticPolicy
from dynpart.planner.dynpart_policy import DynpartPolicy
from dynpart.planner.policy import PlanningPolicy, PlanOptions, PolicyName

POLICIES: dict[PolicyName, Callable[[PlanOptions], PlanningPolicy]] = {
    "dynpart": DynpartPolicy,
    "nos": NosPolicy,
    "static": StaticPolicy,
}
