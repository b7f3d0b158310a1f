"""`python -m tests.e2e.faultprobe planner run ...`: `dynpart planner run`, unchanged, with two
probes for the fault tests (tests/e2e/test_faults.py) that write lines to its log (stderr):

- `e2e-probe round {"placements": [[pod, node], ...], "t": time, "writes": {node: plan id}}`: before a
  round writes anything, what it planned: each pod's node, and the plan id of the spec it is
  about to write on each node (from the patches themselves). Written before the first patch is
  sent, so a planner killed in the middle of its writes has logged the whole round.
- `e2e-probe gone {"watch": name}`: a watch that ended with 410 Gone (the informer lists again,
  silently: this is how the tests see that a too old resourceVersion reached it).

Only observation: the wrapped functions are called as before and their results returned as
they are. If a wrapped name is missing (the code moved), that probe is off and says so."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

SPEC_PLAN = "dynpart.io/spec-plan"


def emit(kind: str, fields: dict[str, Any]) -> None:
    fields = {"t": round(time.time(), 3), **fields}  # wall clock: the tests order it with the nodes' changes
    print(f"e2e-probe {kind} {json.dumps(fields, sort_keys=True)}", file=sys.stderr, flush=True)


def install() -> None:
    try:
        from dynpart.planner import controller
        inner_patches = controller.planned_patches
    except (ImportError, AttributeError) as e:
        emit("off", {"probe": "round", "why": str(e)})
    else:
        def planned_patches(*args: Any, **kw: Any) -> Any:
            out = inner_patches(*args, **kw)
            try:
                result = next(a for a in (*args, *kw.values()) if hasattr(a, "placements"))
                writes = {layout.node: patch.get(SPEC_PLAN) for layout, patch in out}
                emit("round", {"placements": [[pl.pod, pl.node] for pl in result.placements], "writes": writes})
            except Exception as e:  # observation only: never change what the planner does
                emit("off", {"probe": "round", "why": repr(e)})
            return out
        controller.planned_patches = planned_patches  # type: ignore[assignment]

    try:
        from dynpart.kube import watching
        from dynpart.kube.errors import APIGoneError
        inner_watch = watching.Informer._watch
    except (ImportError, AttributeError) as e:
        emit("off", {"probe": "gone", "why": str(e)})
        return

    async def _watch(self: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await inner_watch(self, *args, **kw)
        except APIGoneError:
            emit("gone", {"watch": self.name})
            raise
    watching.Informer._watch = _watch  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    install()
    from dynpart.cli import main as dynpart_main
    return dynpart_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
