"""A one-line progress bar for long benchmark runs (stderr, no dependencies)."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

PROGRESS_INTERVAL_S = 0.1  # at most ~10 redraws a second


class Progress:
    """A one-line ``\\r`` progress bar on stderr: done/total, rate, ETA; redrawn at most ~10x a second."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True, width: int = 24,
                 unit: str = "req", show_rate: bool = True):
        self.total = max(total, 1)
        self.unit = unit  # what ``done`` counts ("s" for a timed run)
        self.show_rate = show_rate
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.start = time.perf_counter()
        self._last = 0.0
        self._drawn = False
        self._longest = 0

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < PROGRESS_INTERVAL_S:
            return
        self._last = now
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        eta_text = "--:--" if math.isnan(eta) else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        rate_text = f"{rate:.0f} {self.unit}/s  " if self.show_rate else ""
        line = (f"{self.label} [{bar}] {done}/{self.total} {self.unit}  {rate_text}"
                f"{int(elapsed) // 60}:{int(elapsed) % 60:02d} elapsed  ETA {eta_text}  {note}")
        self._longest = max(self._longest, len(line))
        self.stream.write("\r" + line.ljust(self._longest))
        self.stream.flush()
        self._drawn = True

    def close(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        self.update(done, note, force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
