"""A kubelet device plugin (API v1beta1) inside the agent: one gRPC server per resource name the
node serves (`nvidia.com/mig-*`, `nvidia.com/gpu-<N>gb`, `nvidia.com/gpu`), fed by the agent's
view of the GPUs. The agent loop feeds it after every pass (`Agent(plugins=...)`, docs/agent.md,
"Device plugin").

- `protocol`: the v1beta1 messages (built at run time from a descriptor) and method paths;
- `devices`: pure: which devices each resource advertises, what Allocate hands a container;
- `server`: `PluginServer` (one resource) and `DevicePluginManager` (update, withdraw, re-register).
"""
