"""`dynpart`: the one command-line entry point.

The top layer: it imports every part (`dynpart.planner`, `dynpart.agent`, `dynpart.simulations`)
and nothing imports it. Each part owns its subcommands: a module listed in `_COMMANDS` exposes
`register(subparsers)` that adds its parser(s) and sets `func` (a callable taking the parsed
arguments and returning an exit code).

User mistakes (`DynpartError`) print one line on stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable

from dynpart import __version__, catalog_cli
from dynpart.agent import cli as agent_cli
from dynpart.errors import DynpartError
from dynpart.planner import bench as planner_bench
from dynpart.planner import controller_cli, explain
from dynpart.simulations.packing import cli as packing_bench_cli
from dynpart.simulations.replay import cli as simulate_cli

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# (how the part registers its parser(s), "bench" if they go under `dynpart bench`) in help order
_COMMANDS: list[tuple[Register, bool]] = [
    (simulate_cli.register, False),
    (planner_bench.register, True),
    (packing_bench_cli.register, True),
    (explain.register, False),
    (controller_cli.register, False),
    (agent_cli.register, False),
    (catalog_cli.register, False),
]


def _print_help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2
    return show


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
    bench_sub = None
    for register, under_bench in _COMMANDS:
        if under_bench and bench_sub is None:  # `dynpart bench` goes where its first benchmark is
            bench = sub.add_parser("bench", help="benchmarks that print figures (planner, packing)",
                                   description="Benchmarks that print figures.")
            bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
            bench.set_defaults(func=_print_help_of(bench))
        register(bench_sub if under_bench and bench_sub is not None else sub)
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
    except BrokenPipeError:
        # the reader of stdout went away (`dynpart catalog X | head`): what it wanted it has; keep
        # the interpreter's final flush of stdout from failing again (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell tool killed by the signal reports
    except OSError as e:
        if e.errno not in _OUTPUT_FULL or e.filename is not None:
            raise
        # stdout cannot be written (a full disk, a quota, an I/O error): said in one line, not a
        # traceback; the final flush must not fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"dynpart: error: writing the output: {e.strerror}", file=sys.stderr)
        return 2


# what writing stdout fails with when it cannot take the output (the commands turn their files'
# errors into errors of their own, naming the file)
_OUTPUT_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


if __name__ == "__main__":
    sys.exit(main())
