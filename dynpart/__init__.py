"""dynpart: shared types and rules (GPU catalog, MIG geometry, MPS slices, snapshots, plans).

This package is the bottom layer: it does no I/O beyond loading catalog files, and imports
nothing from `planner`, `agent` or `simulations` (the CLI in `dynpart.cli` is the one exception,
and it imports lazily).
"""

__version__ = "0.1.0"
