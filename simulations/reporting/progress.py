"""Progress on stderr: a redrawn bar on a terminal, else a plain line every so often."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, every_s: float = 15.0,
                 enabled: bool = True):
        self.label = label
        self.total = max(1, total)
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.enabled = enabled
        self.t0 = time.monotonic()
        # no line written yet: the first update writes one (the monotonic clock starts at the
        # machine's boot, so 0 would hold back a first line for every_s on a machine up for less)
        self.last = -float("inf")
        self.done = 0
        self.printed_total = False  # a plain stream gets the 100% line once, however often it is reported

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        self.done = done
        now = time.monotonic()
        if self.tty:
            if now - self.last < 0.1 and done < self.total:
                return
            width = 30
            filled = int(width * done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {now - self.t0:5.0f}s {note}\033[K")
            self.stream.flush()
            self.last = now
        elif (now - self.last >= self.every_s and done < self.total) or (done >= self.total and not self.printed_total):
            self.printed_total = done >= self.total
            self.stream.write(f"{self.label}: {done}/{self.total} ({100 * done // self.total}%) "
                              f"{now - self.t0:.0f}s {note}\n")
            self.stream.flush()
            self.last = now  # (when a line was written: updates more frequent than every_s still get one)

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
