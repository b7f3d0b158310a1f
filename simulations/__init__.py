"""Offline simulator on recorded traces and the packing benchmark (issue 3), in two rooms over a
shared layer:

- shared, imported by both rooms and importing neither:
  - `inputs`: the openb trace formats (`traces`), cluster files and inline specs
    (`cluster_spec`), the built-in synthetic workload (`synthetic`) and the command-line inputs
    both commands take (`command_line`);
  - `bridge`: trace pods as the planner's `PendingPod`, `Node` and `Snapshot` models, and the
    check applied to every returned `Plan` (the simulator calls the same `plan()` as the
    controller, never a copy of planning logic);
  - `reporting`: tables, CSV/JSON files, plots and progress bars;
  - `errors`: the simulator's user-facing errors;
- `packing`: the FGD paper's packing protocol (`dynpart bench packing`): its numpy occupancy of
  the cluster, the tuned pod list, the reference schedulers (best-fit, random), the dynpart
  policy (every arrival planned by a `planner.PlanningSession` on the whole cluster: the
  simulator ranks nothing), the runs over seeds and the command;
- `replay`: a trace replayed over time on a MIG or MPS cluster (`dynpart simulate`): how trace
  requests map to slices, the cluster state (the planner's own `Node`/`Gpu` models), the
  event loop, its summary and the command.

`packing` and `replay` never import each other (tests/simulations/test_rooms.py checks it);
what both need lives in the shared layer.
"""
