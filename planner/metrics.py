"""Prometheus metrics of the planner controller (served on /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PLAN_SECONDS = Histogram("dynpart_plan_seconds", "Time to compute one plan",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
# PENDING_PODS, WORKLOAD_WEIGHT and CATALOG_DISAGREEMENTS are set from the controller's caches by the
# leader's steps, at most once a second (PlannerController.refresh_gauges); a standby exports none.
# resource: the slice resource asked for, or INVALID for a pod dynpart cannot plan (a pod can ask for
# any name: the label's values stay bounded)
INVALID = "invalid"
PENDING_PODS = Gauge("dynpart_pending_pods", "Pods waiting for a GPU slice (marked Unschedulable, asking for a "
                     "slice), by resource; 'invalid' for those dynpart cannot plan", ["resource"])
PODS_PLACED = Counter("dynpart_pods_placed_total", "Pods the planner found a slice for")
PODS_UNPLACEABLE = Counter("dynpart_pods_unplaceable_total", "Pods the planner could not place in a round")
SLICES_CREATED = Counter("dynpart_slices_created_total", "Slices the planner asked agents to create", ["mode"])
SLICES_DESTROYED = Counter("dynpart_slices_destroyed_total", "Free slices the planner asked agents to destroy", ["mode"])
PLANS = Counter("dynpart_plans_total", "Plans computed (planning rounds with pods to plan)")
NODE_PLANS = Counter("dynpart_node_plans_total", "Node layouts written (one plan id each)")
PLAN_ACKS = Counter("dynpart_plan_acks_total", "Node plans acknowledged by their agent")
PLAN_ACK_SECONDS = Histogram("dynpart_plan_ack_seconds", "From writing a node plan to its acknowledgement",
                             buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
PLAN_ERRORS = Counter("dynpart_plan_errors_total", "Planning problems by reason: internal, ack_timeout, "
                      "bad_object, invalid_snapshot, not_leader, conflict (a node's plan left to the next round after a 409 Conflict), "
                      "patch_failed", ["reason"])
PLAN_WRITE_RETRIES = Counter("dynpart_plan_write_retries_total", "Node plan writes made again at the node's new "
                             "resourceVersion after a 409 Conflict for a change of nothing the plan read (the kubelet's "
                             "status writes)")
RESERVATIONS_TAKEN = Counter("dynpart_reservations_taken_total", "Reservations ended early: the kube-scheduler gave the "
                               "slice made for the pod to another pod (the pod is planned again)")
CATALOG_DISAGREEMENTS = Gauge("dynpart_catalog_disagreements",
                              "Differences between a node agent's GPU capability report and the catalog", ["node"])
LEADER = Gauge("dynpart_leader", "1 when this replica holds the planner lease")
WORKLOAD_WEIGHT = Gauge("dynpart_workload_weight", "The request distribution the planner keeps free capacity "
                        "usable for: decayed count of recently seen requests, by resource", ["resource"])
EVENTS_DROPPED = Counter("dynpart_events_dropped_total", "Events not posted: cause memory_full (kube.event_memory "
                         "(object, reason) pairs remembered), queue_full (the API server too slow to take them) "
                         "or spam (more than 25 about one object at once, then one per 5 minutes)",
                         ["cause"])


def clear_cluster_gauges() -> None:
    """The gauges a standby does not export (set by the leader from its caches)."""
    for gauge in (PENDING_PODS, WORKLOAD_WEIGHT, CATALOG_DISAGREEMENTS):
        gauge.clear()
