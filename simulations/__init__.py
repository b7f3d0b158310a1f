"""Offline simulator on recorded traces and the packing benchmark (issue 3).

Layers, imports flowing one way:
- `traces`, `cluster_spec`: read the openb CSV formats and small cluster YAML files (I/O at the
  edge, parsing pure);
- `state`, `workload`: the simulator's own incremental cluster state and the packing workload;
- `policies`, `bridge`: placement policies; `bridge` turns simulator state into the planner's
  `Snapshot` and applies the returned `Plan` (the simulator calls the same `plan()` as the
  controller, never a copy of planning logic);
- `packing`, `replay`: the two simulation modes, pure functions returning results;
- `report`, `plots`, `cli`, `cli_bench`: tables, files and the `dynpart` subcommands.
"""
