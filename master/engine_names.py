"""Engine names: the engine's own 64-bit hash of a block, for KV events, where the engine gave one.

Engines that name blocks themselves (vllm-ascend's ``PoolKey`` strings end with vLLM's block hash) hand the
pool strings that kvpool maps to its own keys. A client that knows the engine's hash of a block sends it with
``Master.NameBlocks`` before it writes the block (so the name is here before the node reports the block),
and the event feed names the block by it (:mod:`~kvpool.master.kv_events`), kvpool's
:func:`~kvpool.events.key_hash` otherwise.

Invariants:

- Keyed like the index, by the key's first 16 bytes (a :class:`~kvpool.master.keytable.KeyTable`, about 50
  bytes a name); a name is never 0 (0 means none).
- A name outlives its key's absences from the index (a demotion can report the DRAM copy gone before the
  SSD copy arrives), so a block keeps one name through its tiers; a later name for the same key replaces it.
- At most ``max_names`` names: when a batch would pass that, the names of keys the index does not hold now
  are dropped first; if every name is of an indexed key, new names are refused (counted). An indexed key's
  name is never dropped, so its stored and removed events agree; a refused one's events carry kvpool's
  hash, a name a router cannot match, never a wrong one.
- One lock, taken only with ``with``, never held while calling out (``indexed`` is called outside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvpool.master.keytable import KeyTable, last_wins

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
DEFAULT_MAX_NAMES = 1 << 20


class EngineNames:
    """Key prefix -> the engine's hash. Thread-safe."""

    def __init__(self, max_names: int = DEFAULT_MAX_NAMES):
        self._lock = threading.Lock()
        self._table = KeyTable({"name": np.uint64}, 1024)
        self.max_names = max_names
        self.refused = 0  # names not kept because the table was full of indexed keys

    def __len__(self) -> int:
        with self._lock:
            return self._table.live

    def learn(self, k0: U64, k1: U64, names: U64, indexed: Callable[[U64, U64], npt.NDArray[np.bool_]]) -> int:
        """Keep ``names`` (0: none) for the keys; returns how many were kept. ``indexed`` says which keys the
        index holds (for trimming a full table)."""
        keep = names != 0
        k0, k1, names = last_wins(k0[keep], k1[keep], names[keep])
        if not len(k0):
            return 0
        with self._lock:
            full = self._table.live + len(k0) > self.max_names
            snapshot = self._keys() if full else None
        if snapshot is not None:  # drop the names of keys that never reached the index (outside our lock)
            s0, s1 = snapshot
            stale = ~indexed(s0, s1)
            with self._lock:
                rows = self._table.find(s0[stale], s1[stale])
                self._table.delete(np.unique(rows[rows >= 0]))
                self._table.compact()
        with self._lock:
            t = self._table
            rows = t.find(k0, k1)
            old = rows >= 0
            t.rec["name"][rows[old]] = names[old]
            kept = int(np.count_nonzero(old))
            new = np.flatnonzero(~old)
            room = max(0, self.max_names - t.live)
            if len(new) > room:
                self.refused += len(new) - room
                log.warning("engine names: %d names refused, the table holds %d names of indexed blocks (max %d)",
                            len(new) - room, t.live, self.max_names)
                new = new[:room]
            if len(new):
                kept += t.insert(k0[new], k1[new], {"name": names[new]})
            return kept

    def names_of(self, k0: U64, k1: U64) -> U64:
        """Per key its name, 0 where it has none."""
        with self._lock:
            rows = self._table.find(k0, k1)
            names = self._table.rec["name"][np.maximum(rows, 0)]
        return np.where(rows >= 0, names, 0).astype(np.uint64)

    def _keys(self) -> tuple[U64, U64]:
        t = self._table
        live = t.live_rows()
        return t.k0[live].copy(), t.k1[live].copy()

