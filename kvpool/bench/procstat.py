"""Resource use of running processes over time, from ``/proc``: RSS, open file descriptors, threads.

:func:`read_proc` takes one sample of a process; a :class:`ProcSeries` keeps a
process's samples, :meth:`ProcSeries.summary` reduces the samples after a
warm-up to start / end / max, the floors (minimum) of the first and last
quarter, and a least-squares slope per minute, and :class:`FlatRule` decides
whether that is flat (no leak) and says why not. VmRSS is kept with its
parts: RssAnon (the heap), RssShmem (the DRAM arena) and RssFile (pages of
mapped files: shared libraries and LMDB's data file, which grows by design
up to its map size, twice the SSD capacity). A leak is *private* memory,
RssAnon + RssShmem, so that is what is judged. Linux only
(``/proc/<pid>/status``, ``/proc/<pid>/fd``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

METRICS = ("rss_kib", "private_kib", "anon_kib", "file_kib", "shmem_kib", "fds", "threads")
_STATUS_FIELDS = {"VmRSS:": "rss_kib", "RssAnon:": "anon_kib", "RssFile:": "file_kib", "RssShmem:": "shmem_kib",
                  "Threads:": "threads"}


@dataclass(frozen=True)
class ProcSample:
    """One look at a process: seconds since the run's start, VmRSS and its parts in KiB, open fds, threads."""

    t: float
    rss_kib: int
    anon_kib: int
    file_kib: int
    shmem_kib: int
    fds: int
    threads: int

    @property
    def private_kib(self) -> int:
        """RssAnon + RssShmem: resident memory that is not a mapped file's page cache."""
        return self.anon_kib + self.shmem_kib


def read_proc(pid: int, t: float) -> ProcSample | None:
    """Sample ``pid`` now (``t``: the caller's clock); None if the process is gone or cannot be read."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = _STATUS_FIELDS.get(line.split(None, 1)[0] if line.strip() else "")
                if name is not None:
                    values[name] = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if "rss_kib" not in values or "threads" not in values:  # a zombie has no VmRSS
        return None
    return ProcSample(t, values["rss_kib"], values.get("anon_kib", 0), values.get("file_kib", 0),
                      values.get("shmem_kib", 0), fds, values["threads"])


def slope_per_minute(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (seconds), per minute; 0.0 with fewer than two distinct times."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt = sum(ts) / n
    my = sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


@dataclass(frozen=True)
class MetricSummary:
    """One metric of one process after the warm-up: first and last sample, the max, the slope per minute."""

    start: int
    end: int
    max: int
    floor_first: int  # the minimum over the first quarter of the post-warm-up samples
    floor_last: int  # ... and over the last quarter
    slope_per_min: float
    trend: float  # slope x the post-warm-up window: what the fit says was gained

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "max": self.max, "floor_first": self.floor_first,
                "floor_last": self.floor_last, "slope_per_min": self.slope_per_min, "trend": self.trend}


@dataclass
class ProcSeries:
    """The samples of one named process."""

    name: str
    pid: int
    samples: list[ProcSample] = field(default_factory=list)

    def add(self, sample: ProcSample | None) -> None:
        if sample is not None:
            self.samples.append(sample)

    def after(self, warmup_s: float) -> list[ProcSample]:
        return [s for s in self.samples if s.t >= warmup_s]

    def summary(self, warmup_s: float) -> dict[str, MetricSummary] | None:
        """Per metric the :class:`MetricSummary` of the samples at or after ``warmup_s``; None if there are none."""
        post = self.after(warmup_s)
        if not post:
            return None
        ts = [s.t for s in post]
        window_min = (ts[-1] - ts[0]) / 60.0
        quarter = max(1, len(post) // 4)
        out = {}
        for m in METRICS:
            ys = [getattr(s, m) for s in post]
            slope = slope_per_minute(ts, ys)
            out[m] = MetricSummary(ys[0], ys[-1], max(ys), min(ys[:quarter]), min(ys[-quarter:]), slope,
                                   slope * window_min)
        return out


@dataclass(frozen=True)
class FlatRule:
    """When a process's resource use counts as flat after the warm-up.

    Samples after the warm-up are split in quarters; a *floor* is the lowest
    value in a quarter. A leak stays, a transient (a connection being set up,
    a short-lived thread, a large message buffer) does not, so floors see
    leaks and not noise.

    - Memory: the growth of private memory (RssAnon + RssShmem), the larger
      of (floor of the last quarter - floor of the first) and (least-squares
      slope x the post-warm-up window), is below ``rss_pct`` percent of the
      process's first post-warm-up VmRSS *and* below ``rss_mib`` MiB.
    - File descriptors and threads: the floor of the last quarter exceeds the
      floor of the first by at most ``count_slack`` (default 4). Connection
      pools open connections lazily, the first time they are needed (a
      client keeps up to 4 idle connections an address; a node or master
      holds an fd and a thread for each), so a count may step up once or
      twice after the warm-up; a leak per request or per client would add
      hundreds a minute.
    """

    rss_pct: float = 5.0
    rss_mib: float = 16.0
    count_slack: int = 4

    def describe(self) -> str:
        return (f"after the warm-up, with floor = the minimum over a quarter of the samples: growth of private "
                f"memory (RssAnon + RssShmem) max(last-quarter floor - first-quarter floor, slope x window) < "
                f"{self.rss_pct:g}% of the first VmRSS sample and < {self.rss_mib:g} MiB; fds and threads: "
                f"last-quarter floor - first-quarter floor "
                f"<= {self.count_slack} (pooled connections opened late)")

    def check(self, series: ProcSeries, warmup_s: float) -> list[str]:
        """Why ``series`` is not flat after ``warmup_s`` (an empty list: it is flat)."""
        summary = series.summary(warmup_s)
        if summary is None or len(series.after(warmup_s)) < 2:
            return [f"{series.name}: fewer than 2 samples after the warm-up"]
        reasons = []
        private = summary["private_kib"]
        limit_kib = min(summary["rss_kib"].start * self.rss_pct / 100.0, self.rss_mib * 1024.0)
        grew = max(private.floor_last - private.floor_first, private.trend)
        if grew >= limit_kib:
            parts = ", ".join(f"{m[:-4]} {summary[m].floor_last - summary[m].floor_first:+d} KiB"
                              for m in ("anon_kib", "shmem_kib", "file_kib"))
            reasons.append(f"{series.name}: private memory grew {grew / 1024:.1f} MiB after warm-up (limit "
                           f"{limit_kib / 1024:.1f} MiB; slope {private.slope_per_min:.0f} KiB/min; floors: {parts})")
        for m in ("fds", "threads"):
            s = summary[m]
            if s.floor_last - s.floor_first > self.count_slack:
                reasons.append(f"{series.name}: {m} floor {s.floor_first} -> {s.floor_last}, more than "
                               f"{self.count_slack} up (start {s.start}, end {s.end}, max {s.max}; "
                               f"slope {s.slope_per_min:+.2f}/min)")
        return reasons
