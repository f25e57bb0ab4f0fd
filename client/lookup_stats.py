"""Lookups a client answered without asking the master, counted as the master would count them, and reported.

A lookup the master never sees (HBM answered it alone, or the arenas of
same-host nodes did: :mod:`kvpool.client.local_index`), or sees only in parts
(each index shard of a sharded cluster its own keys: only the client sees the
merged run, :mod:`kvpool.sharded_master`), still belongs in the cluster-wide
hit rates. :class:`LookupStats` is the one buffer for every kind and the one
timer that sends them (``Master.ReportLookups``).

Invariants:
- Counts reach the master within ``interval_s`` (default ``REPORT_S``) of the first lookup counted
  after a report, and at :meth:`LookupStats.send` (a client's ``flush`` and
  ``close``); one report per block size (``block_tokens``).
- Stats only: a report that fails is lost (the sender counts it), never
  retried and never raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.vocabulary import Tier

__all__ = ["REPORT_S", "LookupCounts", "LookupStats"]

REPORT_S = 1.0  # lookups counted here reach the master within this long (and at flush and close)


@dataclass(slots=True)
class LookupCounts:
    """Lookups of one block size, the blocks they asked for (HBM prefix included) and their hits per tier."""

    lookups: int = 0
    requested: int = 0
    hbm: int = 0
    dram: int = 0
    ssd: int = 0


# Sends one block size's counts (block_tokens, counts, deadline as time.monotonic() or None); True if taken.
Sender = Callable[[int, LookupCounts, float | None], bool]


class LookupStats:
    """The lookups this client answered itself, until reported (see the module docstring). Thread-safe."""

    def __init__(self, sender: Sender, interval_s: float = REPORT_S):
        self._sender = sender
        self._interval = interval_s
        self._lock = threading.Lock()
        self._counts: dict[int, LookupCounts] = {}  # per block_tokens

    def count(self, hbm_blocks: int, tiers: bytes, requested: int, block_tokens: int) -> None:
        """Count one lookup that asked for ``requested`` blocks (HBM prefix included), ``hbm_blocks`` of them hit
        in HBM and the pool's run after them served from ``tiers`` (one Tier byte per block); the first since
        the last report starts the timer that sends them."""
        run = np.frombuffer(tiers, dtype=np.uint8)
        dram = int(np.count_nonzero(run == Tier.DRAM))
        with self._lock:
            first = not self._counts
            c = self._counts.setdefault(block_tokens, LookupCounts())
            c.lookups += 1
            c.requested += requested
            c.hbm += hbm_blocks
            c.dram += dram
            c.ssd += len(run) - dram
        if first:
            timer = threading.Timer(self._interval, self.send)
            timer.daemon = True
            timer.start()

    def send(self, deadline: float | None = None) -> bool:
        """Report the counts so far (each block size once, all by ``deadline``); True if there was nothing to
        send or the master took every report."""
        with self._lock:
            counts, self._counts = self._counts, {}
        ok = True
        for block_tokens, c in counts.items():
            ok &= self._sender(block_tokens, c, deadline)
        return ok
