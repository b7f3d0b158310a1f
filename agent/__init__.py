"""The dynpart node agent: applies the planner's spec (node annotations) to the node's GPUs.

Layers, imports flowing one way (docs/agent.md):
- `driver` (the GPU driver: `interface`, its `fake` and the real `nvml`), `podresources` (which
  devices pods hold), `kube` (the node, NVIDIA's plugin pod), `deviceplugin` (the kubelet
  device-plugin API the agent serves), `mps_daemon`: I/O behind small interfaces;
  `nvml_probe`: `dynpart agent probe`;
- `reconcile`: pure decisions (what to destroy, create, keep);
- `guard`, `mig_agent`, `mps_plugin`: carry the decisions out for one reconcile pass;
- `loop`: the async loop (watch the node, reconcile, report status); `cli`: `dynpart agent`.
"""
