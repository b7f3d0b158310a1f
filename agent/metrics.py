"""Prometheus metrics of the node agent (served on /metrics; listed in docs/agent.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PASSES = Counter("dynpart_agent_passes_total", "Reconcile passes, by result (ok, error)", ["result"])
PASS_SECONDS = Histogram("dynpart_agent_pass_seconds", "Duration of one reconcile pass",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PLAN_ACKS = Counter("dynpart_agent_plan_acks_total", "Plan ids acknowledged (a new spec applied)")
INSTANCES_CREATED = Counter("dynpart_agent_mig_instances_created_total", "MIG instances created (GI + CI)")
INSTANCES_DESTROYED = Counter("dynpart_agent_mig_instances_destroyed_total", "Free MIG instances destroyed")
IN_USE_KEPT = Counter("dynpart_agent_in_use_kept_total",
                      "Destroys skipped because the instance was in use at the last check or NVML said IN_USE")
SLICES = Gauge("dynpart_agent_slices", "Slices on this node after the last pass", ["mode", "state"])
ERRORS = Gauge("dynpart_agent_status_errors", "Error lines in the last status written")
