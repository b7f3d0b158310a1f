"""`plan(snapshot) -> Plan`: the one planning entry point, called by the controller and the
simulator alike. Pure: no I/O, no clock-dependent results (time limits are deterministic).

It compiles the snapshot (planner/session.py), hands it to the policy that `PlanOptions.policy`
names (dynpart's own or a baseline, all behind `PlanningPolicy`, registered in
planner/policies.py) and turns the result into a `Plan`. A caller that plans the same cluster
again and again keeps a `PlanningSession` instead: the same plans, without compiling the whole
cluster each time."""

from __future__ import annotations

from dynpart.catalog import Catalog, default_catalog
from dynpart.planner.policies import POLICIES
from dynpart.planner.policy import PlanOptions, PolicyName
from dynpart.planner.session import PlanningSession, collector_paused
from dynpart.snapshot import Plan, Snapshot, validate_snapshot

__all__ = ["POLICIES", "PlanOptions", "PlanningSession", "PolicyName", "plan"]


def plan(snapshot: Snapshot, catalog: Catalog | None = None, options: PlanOptions | None = None) -> Plan:
    """The same as a fresh `PlanningSession` on the snapshot's nodes planning its pending pods,
    with the snapshot's workload (or, without one, the pending pods) as the request distribution."""
    with collector_paused():
        cat = catalog or default_catalog()
        models = validate_snapshot(snapshot, cat)
        session = PlanningSession(snapshot.nodes, cat, models)
        result = session.plan(snapshot.pending, snapshot.workload, options, validate=False)
        # freed while the collector is paused: else its first run, as it resumes, walks the
        # whole session (a few hundred thousand objects) before they are freed anyway
        del session
    return result
