"""One progress line per stage: done / total, rate, ETA and whatever the stage adds (loss,
acceptance). On a terminal it is redrawn in place; elsewhere (a log) a line is printed
every `every` seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def duration(seconds: float) -> str:
    """4s, 3m05s, 2h07m."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLine:
    def __init__(self, label: str, total: int, unit: str, *, start: int = 0,
                 stream: TextIO | None = None, every: float = 10.0) -> None:
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = 0.5 if self.tty else every
        self.start_done, self.t0 = start, time.monotonic()
        self.last = 0.0
        self.line = ""

    def rate(self, done: int) -> float:
        """Units per second since this line started (resumed units not counted)."""
        elapsed = time.monotonic() - self.t0
        return (done - self.start_done) / elapsed if elapsed > 0 else 0.0

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every and done < self.total:
            return
        self.last = now
        rate = self.rate(done)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        pct = 100.0 * done / self.total
        shown = f"{rate:.2f}" if rate < 10 else f"{rate:.0f}"
        self.line = (f"{self.label} {done}/{self.total} {self.unit} ({pct:.0f}%), "
                     f"{shown} {self.unit}/s, ETA "
                     f"{duration(eta) if eta != float('inf') else '?'}"
                     + (f", {extra}" if extra else ""))
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line)
        else:
            self.stream.write(self.line + "\n")
        self.stream.flush()

    def done(self, summary: str = "") -> None:
        """End the line: what was done and how long it took."""
        took = duration(time.monotonic() - self.t0)
        text = f"{self.label}: done in {took}" + (f", {summary}" if summary else "")
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
        self.stream.flush()
