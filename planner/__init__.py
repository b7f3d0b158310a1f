"""The planner: `plan(snapshot) -> Plan` (pure), its baselines, benchmark and, later, the
Kubernetes controller around it."""

from dynpart.planner.core import PlanOptions, plan

__all__ = ["PlanOptions", "plan"]
