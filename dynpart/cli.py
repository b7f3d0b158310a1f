"""`dynpart`: the one command-line entry point.

Each subsystem owns its subcommands: a module listed in `_COMMANDS` exposes
`register(subparsers)` that adds its parser(s) and sets `func` (a callable taking the parsed
arguments and returning an exit code). Modules are imported lazily so that `dynpart --help`
stays fast and a missing optional part never breaks the others.

User mistakes (`DynpartError`) print one line on stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dynpart import __version__
from dynpart.errors import DynpartError

# (module, top-level command it registers) in help order
_COMMANDS = [
    ("simulations.cli", "simulate"),
    ("planner.bench", "bench"),
    ("simulations.cli_bench", "bench"),
    ("planner.explain", "explain"),
    ("planner.controller_cli", "planner"),
    ("agent.cli", "agent"),
    ("dynpart.catalog_cli", "catalog"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynpart",
        description="Dynamic GPU partitioning (MIG and MPS) for Kubernetes: planner, node agent, "
        "simulator and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"dynpart {__version__}")
    parser.add_argument("--catalog", action="append", default=[], metavar="FILE",
                        help="extra GPU catalog file (same schema as dynpart/data/gpu-catalog.yaml); repeatable")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for module_name, command in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # that part is not installed
            raise
        if command == "bench":
            if "bench" not in groups:
                bench = sub.add_parser("bench", help="benchmarks that print figures (planner, packing)",
                                       description="Benchmarks that print figures.")
                groups["bench"] = bench.add_subparsers(dest="bench_command", metavar="BENCH")
                bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])
            module.register(groups["bench"])
        else:
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DynpartError as e:
        print(f"dynpart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dynpart: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
