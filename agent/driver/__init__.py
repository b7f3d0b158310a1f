"""The GPU driver as the agent sees it, one module per role (as nos's `pkg/gpu/nvml`):

- `interface`: `GpuDriver` (the NVML operations the agent uses), its data types, errors and
  error codes; the rest of the agent imports only this and `threaded`;
- `fake`: `FakeNvml`, an in-memory driver enforcing the MIG rules (tests, `--fake-gpus`);
- `nvml`: `RealNvml`, the host's driver through nvidia-ml-py (imports `pynvml` only when built);
- `threaded`: `AsyncDriver`, what the agent's event loop awaits: each call made on one thread of
  the driver's own, within a time limit.

Nothing is re-exported here: callers name the module they need, so no import goes in a circle.
"""
