"""Engine names: the engine's own 64-bit hash of a block, for KV events, where the engine gave one.

Engines that name blocks themselves (vllm-ascend's ``PoolKey`` strings end with vLLM's block hash) hand the
pool strings that kvpool maps to its own keys. A client that knows the engine's hash of a block sends it with
``Master.NameBlocks`` before it writes the block (so the name is here before the node reports the block),
and the event feed names the block by it (:mod:`~kvpool.master.kv_events`), kvpool's
:func:`~kvpool.events.key_hash` otherwise.

Invariants:

- Keyed like the index, by the key's first 16 bytes (a :class:`~kvpool.master.keytable.KeyTable`, about 60
  bytes a name); a name is never 0 (0 means none). Keys are stored keys, so a tenant can only name its own
  blocks (the servicer maps a client's keys to its tenant's first).
- A name outlives its key's absences from the index (a demotion can report the DRAM copy gone before the
  SSD copy arrives), so a block keeps one name through its tiers; a later name for the same key replaces it.
- Each tenant (with auth off: one, "") holds at most ``max_names / tenants`` names, its *share*: when a batch
  would pass it, that tenant's names of keys the index does not hold now are dropped first; if every one
  of its names is of an indexed key, its new names are refused (counted). Another tenant's names are never
  dropped, and an indexed key's name never is, so its stored and removed events agree; a refused one's
  events carry kvpool's hash, a name a router cannot match, never a wrong one.
- One lock, taken only with ``with``, never held while calling out (``indexed`` is called outside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvpool.master.keytable import KeyTable, last_wins

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
DEFAULT_MAX_NAMES = 1 << 20
CHUNK = 1 << 16  # keys per lookup while trimming a full share (bounds the temporaries)


class EngineNames:
    """Key prefix -> the engine's hash, per tenant. Thread-safe."""

    def __init__(self, max_names: int = DEFAULT_MAX_NAMES, tenants: Sequence[str] = ("",)):
        if not tenants or len(set(tenants)) != len(tenants) or len(tenants) > np.iinfo(np.uint16).max:
            raise ValueError("EngineNames: 1 to 65535 distinct tenants")
        self._lock = threading.Lock()
        self._table = KeyTable({"name": np.uint64, "tenant": np.uint16}, 1024)
        self._tenants = {tenant: i for i, tenant in enumerate(tenants)}
        self._held = [0] * len(tenants)  # names each tenant holds
        self._moves = 0  # inserts and deletes so far: an unchanged count means rows found before are still valid
        self.max_names = max_names
        self.share = max(1, max_names // len(tenants))
        self.refused = 0  # names not kept because their tenant's share was full of indexed keys

    def __len__(self) -> int:
        with self._lock:
            return self._table.live

    def held(self, tenant: str = "") -> int:
        """Names ``tenant`` holds now."""
        with self._lock:
            return self._held[self._tenants[tenant]]

    def learn(self, k0: U64, k1: U64, names: U64, indexed: Callable[[U64, U64], npt.NDArray[np.bool_]],
              tenant: str = "") -> int:
        """Keep ``names`` (0: none) for ``tenant``'s keys; returns how many were kept. ``indexed`` says which
        keys the index holds (for trimming a full share). ValueError for a tenant it was not made for."""
        if tenant not in self._tenants:
            raise ValueError(f"engine names: unknown tenant {tenant!r}")
        who = self._tenants[tenant]
        keep = names != 0
        k0, k1, names = last_wins(k0[keep], k1[keep], names[keep])
        if not len(k0):
            return 0
        with self._lock:
            full = self._held[who] + len(k0) > self.share
            if full:
                rows, moves = self._rows_of(who), self._moves
                s0, s1 = self._table.k0[rows].copy(), self._table.k1[rows].copy()
        if full:  # drop this tenant's names of keys that never reached the index (asked outside our lock)
            stale = np.concatenate([np.zeros(0, np.bool_),
                                    *(~indexed(s0[i:i + CHUNK], s1[i:i + CHUNK]) for i in range(0, len(s0), CHUNK))])
            with self._lock:
                t = self._table
                if self._moves != moves:  # rows moved meanwhile (another batch was inserted): find them again
                    g0, g1 = s0[stale], s1[stale]
                    rows = np.concatenate([rows[:0], *(t.find(g0[i:i + CHUNK], g1[i:i + CHUNK])
                                                       for i in range(0, len(g0), CHUNK))])
                    rows = np.unique(rows[rows >= 0])
                    rows = rows[t.rec["tenant"][rows] == who]
                else:
                    rows = rows[stale]
                t.delete(rows)
                self._moves += 1
                self._held[who] -= len(rows)
                # No compact: the share refills at once, and a shrink now would only grow again.
        with self._lock:
            t = self._table
            rows = t.find(k0, k1)
            old = rows >= 0
            mine = old.copy()
            mine[old] = t.rec["tenant"][rows[old]] == who  # another tenant's key (a 128-bit prefix collision): kept
            t.rec["name"][rows[mine]] = names[mine]
            kept = int(np.count_nonzero(mine))
            new = np.flatnonzero(~old)
            room = max(0, self.share - self._held[who])
            if len(new) > room:
                self.refused += len(new) - room
                log.warning("engine names: %d names of tenant %r refused, its share holds %d names of indexed "
                            "blocks (share %d of %d)", len(new) - room, tenant, self._held[who], self.share,
                            self.max_names)
                new = new[:room]
            if len(new):
                placed = t.insert(k0[new], k1[new], {"name": names[new], "tenant": np.full(len(new), who, np.uint16)})
                self._moves += 1
                self._held[who] += placed
                kept += placed
            return kept

    def names_of(self, k0: U64, k1: U64) -> U64:
        """Per key its name, 0 where it has none."""
        with self._lock:
            rows = self._table.find(k0, k1)
            names = self._table.rec["name"][np.maximum(rows, 0)]
        return np.where(rows >= 0, names, 0).astype(np.uint64)

    def _rows_of(self, who: int) -> npt.NDArray[np.intp]:
        """The rows holding ``who``'s names (valid until the next insert: see ``_moves``)."""
        t = self._table
        live = t.live_rows()
        return live[t.rec["tenant"][live] == who]
