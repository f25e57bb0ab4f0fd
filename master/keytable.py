"""A hopscotch hash table of 128-bit key prefixes in numpy arrays: the storage under BlockIndex.

Rows, not objects. Row ``r`` is ``fp[r]`` (a 16-bit fingerprint, 0 when the
slot is empty) and ``rec[r]``, one record holding the key (``k0``, ``k1``) and
the owner's payload fields (BlockIndex: 40 bytes, padded to 8-byte records).
Every key lives within :data:`H` slots of its home, so a lookup reads one
fingerprint neighbourhood (64 bytes) and one record per candidate, whatever
the table's size or load: an absent key touches one or two cache lines, a
present one two or three more. Lookups run compiled
(:mod:`kvpool.master.probe`, one call a batch); changes are numpy calls.

Invariants (the owner serialises all calls; the table has no lock):

- Keys are (k0, k1) uint64 pairs; a key is in at most one slot.
- ``fp[r] == 0`` iff slot ``r`` is empty (its record is garbage); otherwise
  ``fp[r] == fingerprint(rec[r].k0)``, never 0.
- Hopscotch: a key whose home is ``h`` (a multiple of :data:`ALIGN` below
  ``capacity``) sits in a slot of ``[h, h + H)``. The arrays have
  ``capacity + H - ALIGN`` slots, so neighbourhoods never wrap around. There
  are no tombstones: lookups always read the whole neighbourhood, so deleting
  just empties the slot.
- ``live`` counts the occupied slots, and ``live <= MAX_LOAD * capacity``.
  Growing and shrinking size the table for a load of 0.25-0.5, and
  :meth:`KeyTable.compact` shrinks it below :data:`SHRINK_LOAD`, so above the
  minimum capacity the load stays within 0.25-0.7 once compacted.
- The table never grows for a key it could not place while sparse (below
  :data:`SPARSE_LOAD`): that means more than H keys share one home, which
  sha256 keys never do, so such a key is refused (counted by the caller as
  not indexed: a miss) rather than doubling the table without end.
- Rows move: :meth:`KeyTable.insert` may shift other keys within their
  neighbourhoods to make room, or grow the table, and :meth:`KeyTable.compact`
  may shrink it. A row number is valid only until the next ``insert`` or
  ``compact``; owners keep keys, not rows, across calls.
- ``capacity`` is a power of two, at least the minimum given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from kvpool.master.probe import FP_SHIFT, GOLDEN, probe

H = 32  # neighbourhood: the slots a key may sit in, from its home on
ALIGN = 8  # homes are multiples of this (fewer hops to make room; windows start 16-byte aligned)
MAX_LOAD = 0.7  # live keys per slot before the table grows (H = 32 fills to ~0.75 before inserts fail)
TARGET_LOAD = 0.5  # a rehash sizes the table so live keys fill at most this fraction
SHRINK_LOAD = 0.25  # below this, compact() shrinks a table larger than its minimum (to a load of 0.25-0.5)
SPARSE_LOAD = 0.25  # below this, a key that finds no room is refused instead of growing the table
REACH = 1024  # how far past a full neighbourhood an insert looks for a free slot before growing
CHUNK = 1 << 20  # rows per step in full scans and bulk re-inserts (bounds temporaries)

_GOLDEN = int(GOLDEN)  # Fibonacci hashing multiplier (the compiled probe's)
_U64 = (1 << 64) - 1
_ALIGN_BITS = ALIGN.bit_length() - 1
_H_BITS = H.bit_length() - 1
# The constants of the hot path as numpy scalars, so no call converts a Python int.
_GOLDEN64, _ALIGN64, _FP_MIN = GOLDEN, np.uint64(_ALIGN_BITS), np.uint16(1)
assert ALIGN == 1 << _ALIGN_BITS and H == 1 << _H_BITS and H % ALIGN == 0

U64 = npt.NDArray[np.uint64]
Rows = npt.NDArray[np.intp]
Probed = tuple[npt.NDArray[np.uint16], U64, U64, np.uint64, np.uint64, np.uint64, int]


def fingerprint(k0: U64) -> npt.NDArray[np.uint16]:
    """The top 16 bits of k0 (the home uses a salted hash of all of it), never 0."""
    return np.maximum((k0 >> FP_SHIFT).astype(np.uint16), _FP_MIN)


class KeyTable:
    """Hopscotch hashing over (k0, k1) uint64 pairs with owner-declared payload fields."""

    def __init__(self, payload: Mapping[str, npt.DTypeLike], min_capacity: int = 1024) -> None:
        # Aligned (padded to 8 bytes a record): the compiled probe reads k0 and k1 in place.
        self._dtype = np.dtype([("k0", np.uint64), ("k1", np.uint64), *((n, np.dtype(d)) for n, d in payload.items())],
                               align=True)
        self._fields = tuple(payload)
        self._min = 1 << max(H.bit_length(), (min_capacity - 1).bit_length())
        # Keys are sha256 outputs, but a per-process salt keeps crafted keys from piling onto one home.
        self._salt = int.from_bytes(os.urandom(8), "little")
        self._salt64 = np.uint64(self._salt)
        self.live = 0
        self._allocate(self._min)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._shift = 64 - (capacity.bit_length() - 1) + _ALIGN_BITS
        self._shift64 = np.uint64(self._shift)
        self.fp = np.zeros(capacity + H - ALIGN, np.uint16)
        self.rec = np.empty(capacity + H - ALIGN, self._dtype)
        self.k0, self.k1 = self.rec["k0"], self.rec["k1"]  # views
        self.cols = {name: self.rec[name] for name in self._fields}  # views of the payload fields, made once
        self._hoods = sliding_window_view(self.fp, H)  # row h: fp[h : h + H], a view

    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return self.fp.nbytes + self.rec.nbytes

    def _home(self, k0: U64) -> Rows:
        # In uint64 throughout, then viewed as intp (homes are far below 2**63): no conversion pass.
        hashed = (k0 ^ self._salt64) * _GOLDEN64
        return ((hashed >> self._shift64) << _ALIGN64).view(np.intp)

    def _home_one(self, k0: int) -> int:
        return (((k0 ^ self._salt) * _GOLDEN & _U64) >> self._shift) << _ALIGN_BITS

    def key(self, row: int) -> tuple[int, int]:
        return int(self.k0[row]), int(self.k1[row])

    # -- lookups ------------------------------------------------------------------------

    def find(self, k0: U64, k1: U64) -> Rows:
        """The row of each key, -1 where absent."""
        rows = np.empty(len(k0), np.intp)
        probe(k0, k1, *self.probed(), rows)
        return rows

    def probed(self) -> Probed:
        """The table as :mod:`kvpool.master.probe`'s kernels read it (valid until the next change)."""
        return self.fp, self.k0, self.k1, self._salt64, self._shift64, _ALIGN64, H

    def chunks(self) -> Iterator[slice]:
        """All slots as CHUNK-sized slices: full scans go chunk by chunk, which bounds their temporaries."""
        return (slice(lo, lo + CHUNK) for lo in range(0, len(self.fp), CHUNK))

    def live_rows(self) -> Rows:
        """Occupied rows, ascending."""
        return np.concatenate([np.flatnonzero(self.fp[rows]) + rows.start for rows in self.chunks()])

    # -- changes ------------------------------------------------------------------------

    def insert(self, k0: U64, k1: U64, payload: Mapping[str, npt.NDArray[np.generic]], refuse: bool = True) -> int:
        """Insert distinct, absent keys with their payload (one array per field); returns how many went in.

        Rows may move. A key that finds no room although the table is sparse (more than H keys share
        its home: crafted or broken keys, never sha256 outputs) is refused, unless ``refuse`` is False
        (the table then grows until it fits: rehashing, whose keys came from a table that held them).
        """
        n = len(k0)
        refused = 0
        if self.live + n > MAX_LOAD * self.capacity:
            self._rehash(self._capacity_for(self.live + n))
        pending = np.arange(n)
        while pending.size:
            home = self._home(k0[pending])
            free = self._hoods[home] == 0
            col = free.argmax(axis=1)
            has = free[np.arange(pending.size), col]
            # Several keys may want one slot: scatter their ids through k1 (garbage in an empty
            # slot) and read back; exactly one id per slot survives. Losers try again.
            slot, who = home[has] + col[has], pending[has]
            ids = who.astype(np.uint64)
            self.k1[slot] = ids
            won = self.k1[slot] == ids
            slot, who, lost = slot[won], who[won], who[~won]
            self._write(slot, k0[who], k1[who], {name: values[who] for name, values in payload.items()})
            stuck = pending[~has].tolist()  # no free slot in the neighbourhood: make one (rare)
            for i, key in enumerate(stuck):
                if self._displace(int(k0[key]), int(k1[key]), {name: v[key] for name, v in payload.items()}):
                    continue
                if refuse and self.live < SPARSE_LOAD * self.capacity:
                    refused += 1
                    continue
                self._rehash(self.capacity * 2)
                lost = np.concatenate([lost, np.array(stuck[i:], np.intp)])
                break
            pending = lost
        return n - refused

    def _write(self, slot: Rows, k0: U64, k1: U64, payload: Mapping[str, npt.ArrayLike]) -> None:
        """Fill rows ``slot``: ``payload`` has a value per field, an array (one per row) or one scalar."""
        self.k0[slot] = k0
        self.k1[slot] = k1
        for name, values in payload.items():
            self.rec[name][slot] = values
        self.fp[slot] = fingerprint(np.asarray(k0, np.uint64))
        self.live += np.size(slot)

    def _displace(self, k0: int, k1: int, payload: Mapping[str, npt.ArrayLike]) -> bool:
        """Hopscotch: hop keys forward within their own neighbourhoods until a slot near ``k0``'s home
        is free, then put the key there. False (nothing moved) if no free slot is within reach."""
        home = self._home_one(k0)
        lo, hi = home + H, min(len(self.fp), home + H + REACH)
        empty = np.flatnonzero(self.fp[lo:hi] == 0)
        if not empty.size:
            return False
        free = lo + int(empty[0])  # every slot in [home, free) is occupied
        hops: list[tuple[int, int]] = []
        while free >= home + H:
            start = free - H + 1
            movable = np.flatnonzero(self._home(self.k0[start:free]) >= start)  # free is in their neighbourhood
            if not movable.size:
                return False  # nothing moved yet: the hops are applied only on success
            hops.append((start + int(movable[0]), free))
            free = start + int(movable[0])
        for src, dst in hops:  # from the free slot backwards: each destination is empty when written
            self.rec[dst], self.fp[dst] = self.rec[src], self.fp[src]
            self.fp[src] = 0
        self._write(np.array([free]), np.array([k0], np.uint64), np.array([k1], np.uint64), payload)
        return True

    def delete(self, rows: Rows) -> None:
        """Empty distinct occupied rows."""
        self.fp[rows] = 0
        self.live -= rows.size

    def compact(self) -> bool:
        """Shrink a mostly empty table; True if rows moved."""
        if self.capacity > self._min and self.live < SHRINK_LOAD * self.capacity:
            self._rehash(self._capacity_for(self.live))
            return True
        return False

    def _capacity_for(self, live: int) -> int:
        wanted = max(1, math.ceil(live / TARGET_LOAD))
        return max(self._min, 1 << (wanted - 1).bit_length())

    def _rehash(self, capacity: int) -> None:
        old = self.rec[self.live_rows()]
        del self.fp, self.rec, self.k0, self.k1, self.cols, self._hoods  # free the old arrays before allocating
        self._allocate(capacity)
        self.live = 0
        for lo in range(0, len(old), CHUNK):
            part = old[lo : lo + CHUNK]
            self.insert(part["k0"], part["k1"], {name: part[name] for name in self._fields}, refuse=False)

    # -- checks -------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the module invariants (tests; O(capacity))."""
        assert self.capacity & (self.capacity - 1) == 0 and self.capacity >= self._min, "KeyTable: bad capacity"
        live = self.live_rows()
        assert live.size == self.live, f"KeyTable: {live.size} occupied slots, counter says {self.live}"
        assert self.live <= MAX_LOAD * self.capacity, "KeyTable: over its load limit"
        k0, k1 = self.k0[live], self.k1[live]
        assert np.array_equal(self.fp[live], fingerprint(k0)), "KeyTable: a fingerprint does not match its key"
        home = self._home(k0)
        assert ((home <= live) & (live < home + H)).all(), "KeyTable: a key outside its neighbourhood"
        # Each key found at its own row: no key twice.
        assert np.array_equal(self.find(k0, k1), live), "KeyTable: a key is not found at its row"


def last_wins(k0: U64, k1: U64, *columns: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], ...]:
    """``(k0, k1, *columns)`` with all but the last occurrence of each key dropped (a batch may name a key
    twice; its last values count). Unchanged, without a copy, when the keys are distinct."""
    if len(k0) < 2:
        return (k0, k1, *columns)
    ordered = np.sort(k0)
    if not (ordered[1:] == ordered[:-1]).any():
        return (k0, k1, *columns)
    order = np.lexsort((k1, k0))  # stable: equal keys stay in batch order
    a, b = k0[order], k1[order]
    last = np.ones(len(order), np.bool_)
    last[:-1] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    keep = order[last]
    return tuple(c[keep] for c in (k0, k1, *columns))
