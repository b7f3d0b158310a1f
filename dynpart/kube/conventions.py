"""The well-known names dynpart reads and writes on Kubernetes objects, in one place (kopf's
`configs/conventions.py`): our annotation and label keys, the NVIDIA labels and resource names we
rely on, and the components that post Events. Plain strings, no
imports: the pure modules (annotations, resources, the planner's cluster view) use them too."""

from __future__ import annotations

# --- ours: the node-annotation protocol (docs/protocol.md) -----------------------------------
PREFIX = "dynpart.io/"
SPEC_PREFIX = PREFIX + "spec-"
STATUS_PREFIX = PREFIX + "status-"

SPEC_PLAN = SPEC_PREFIX + "plan"
SPEC_MODE = SPEC_PREFIX + "mode"
# The planner's leader term (its Lease's leaseTransitions) when it wrote the spec: an agent ignores
# a spec from a deposed leader. And the pods the plan put on the node (namespace/name, comma
# separated), so that any new leader knows what is in flight and never plans them twice.
SPEC_TERM = SPEC_PREFIX + "term"
SPEC_PODS = SPEC_PREFIX + "pods"
# On a revocation (a plan not acknowledged in time replaced by the node's reported layout): the
# plan id it replaces, so that a reader sees why a spec was written over an unacknowledged one.
SPEC_REVOKES = SPEC_PREFIX + "revokes"
# The GPUs (indices, comma separated) the agent drains for a pod waiting for whole GPUs: every
# slice on them is destroyed as soon as nothing uses it, so that the GPU empties.
SPEC_DRAIN = SPEC_PREFIX + "drain"
STATUS_PLAN = STATUS_PREFIX + "plan"
STATUS_MODE = STATUS_PREFIX + "mode"
STATUS_ERROR = STATUS_PREFIX + "error"
STATUS_HEARTBEAT = STATUS_PREFIX + "heartbeat"
# What the node's GPUs can do, as NVML says (dynpart/capability.py): the planner plans from it.
STATUS_CAPABILITY = STATUS_PREFIX + "capability"
# The GPUs (indices, comma separated) the driver reports unhealthy (a lost GPU, an Xid that needs a
# reset): their devices are advertised Unhealthy, so the planner leaves them out and keeps them as
# they are until the agent stops listing them.
STATUS_UNHEALTHY = STATUS_PREFIX + "unhealthy"

# Opt-in node label: the node's GPUs are partitioned by dynpart, in this mode (mig or mps).
PARTITIONING_LABEL = PREFIX + "gpu-partitioning"

# The kube-scheduler's name, as a pod without spec.schedulerName gets it: dynpart predicts its filters.
DEFAULT_SCHEDULER = "default-scheduler"

# --- NVIDIA's: set by GPU feature discovery, read by the device plugin ------------------------
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"

# Extended resources the device plugin publishes (dynpart/resources.py parses them).
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MPS_RESOURCE_PREFIX = "nvidia.com/gpu-"
# Where an MPS client's CUDA finds the shared memory of its MPS server (POSIX shared memory): the
# agent's device plugin mounts the daemon's own there; a pod's volume there takes its place.
DEV_SHM = "/dev/shm"

# --- components: the `source` of the Events each one posts ------------------------------------
PLANNER_COMPONENT = "dynpart-planner"
AGENT_COMPONENT = "dynpart-agent"

# --- where dynpart's own objects live (the Helm chart's defaults) ------------------------------
SYSTEM_NAMESPACE = "dynpart-system"
LEASE_NAME = "dynpart-planner"  # the planner's leader-election Lease, in SYSTEM_NAMESPACE
