"""Readable tables, CSV and JSON files for the simulator commands (the only module here besides
the CLI and `plots` that writes files)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dynpart.simulations.errors import SimulationError


class Results:
    """Prints the results on stdout before the files are written, surviving a reader that goes
    away (`dynpart simulate --out d | head`): the files are still written, then `finish` raises
    BrokenPipeError (the command ends with 141, as a shell tool killed by SIGPIPE). A stdout that
    cannot be written (a full disk, a quota, an I/O error) loses none of the files either: `finish`
    then raises SimulationError naming it."""

    def __init__(self) -> None:
        self.reader_gone = False
        self.write_error: OSError | None = None

    def print(self, *lines: str) -> None:
        if self.reader_gone or self.write_error is not None:
            return
        try:
            for line in lines:
                print(line)
            sys.stdout.flush()
        except BrokenPipeError:
            self.reader_gone = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush must not fail
        except OSError as e:
            self.write_error = e
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    def finish(self) -> None:
        if self.reader_gone:
            raise BrokenPipeError("the reader of the results went away")
        if self.write_error is not None:
            raise SimulationError(f"stdout: cannot write the results ({self.write_error.strerror or self.write_error}); "
                                  "the files of --out, if given, are written")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and _numeric(c) else c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def _numeric(s: str) -> bool:
    try:
        float(s.rstrip("%s"))
        return True
    except ValueError:
        return False


def out_dir(path: str | Path) -> Path:
    """The --out directory, created, and checked writable: called before a run, so that a bad
    --out is found before anything is computed."""
    if not str(path).strip():
        raise SimulationError("--out '': expected a directory")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise SimulationError(f"--out {path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise SimulationError(f"--out {path}: {e.strerror or e}") from None
    return p


_RESULT_SUFFIXES = {".csv", ".json", ".png", ".svg", ".txt"}


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A folder inside `out` to write a run's files into; moved into `out` (each file renamed over
    its namesake) only once every file is written. A write that fails (a full disk) leaves `out` as
    it was, the earlier run's files whole, and no partial file that looks complete."""
    try:
        stage = Path(tempfile.mkdtemp(prefix=".dynpart-writing-", dir=out))
    except OSError as e:
        raise SimulationError(f"--out {out}: {e.strerror or e}") from None
    try:
        try:
            yield stage
        except SimulationError as e:  # named as the file it was to become; nothing of this run kept
            raise SimulationError(str(e).replace(str(stage), str(out)) + "; the folder's files were left as "
                                  "they were") from None
        except OSError as e:
            raise SimulationError(f"--out {out}: {e.strerror or e}") from None
        done: list[str] = []
        for f in sorted(stage.iterdir()):
            try:
                os.replace(f, out / f.name)
            except OSError as e:  # (a folder of that name, say): renames cannot fail for want of space
                raise SimulationError(f"--out {out}: could not put {f.name} in place ({e.strerror or e}); "
                                      f"{', '.join(done) or 'none'} of this run's files replaced before it") from None
            done.append(f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    # results of another kind of run (a replay's CSVs beside a packing benchmark's) would read as
    # this run's: said, not deleted (they may be the user's)
    others = sorted(p.name for p in out.iterdir() if p.suffix in _RESULT_SUFFIXES and p.name not in done
                    and not p.name.startswith(".") and p.is_file())
    if others:
        print(f"note: --out {out} also holds {', '.join(others)}, not written by this run (left as they were)",
              file=sys.stderr)


def write_json(path: Path, data: Any) -> None:
    try:
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise SimulationError(f"{path}: cannot write: {e.strerror or e}") from None


def write_csv(path: Path, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    try:
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(headers)
            w.writerows(rows)
    except OSError as e:
        raise SimulationError(f"{path}: cannot write: {e.strerror or e}") from None
