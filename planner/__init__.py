"""The planner: `plan(snapshot) -> Plan` (pure), its baselines, benchmark and, later, the
Kubernetes controller around it."""

from planner.core import PlanOptions, plan

__all__ = ["PlanOptions", "plan"]
