"""dynpart: shared types and rules (GPU catalog, MIG geometry, MPS slices, snapshots, plans).

This package is the bottom layer: it does no I/O beyond loading catalog files (and talking to
the API server in `dynpart.kube`), and imports nothing from `dynpart.planner`, `dynpart.agent`
or `dynpart.simulations`. The one exception is the CLI, `dynpart.cli`: the top layer, which
imports every part and which nothing imports.
"""

__version__ = "0.1.0"
