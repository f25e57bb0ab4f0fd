"""Open-addressing tables of 16-byte entries in shared memory: one writer, any number of lock-free readers.

An entry is two little-endian u64 words, ``(tag, value)``. ``tag == 0``
marks an empty entry, so a stored tag is never 0 (callers map a real 0 to
1). The arena keeps two such tables: the DRAM key index (tag: a key's first
8 bytes, value: its slot) and the SSD key set (tag and value: a key's first
16 bytes); see :mod:`kvpool.tiers.arena`.

Invariants:
- Only the arena's owner writes, one thread at a time (its callers
  serialise); readers in any process never lock.
- An entry sits at most ``PROBES - 1`` entries after its *home*
  (``tag * golden >> shift``, mod the capacity), with no empty entry between
  its home and it (linear probing). A lookup therefore stops at the first
  empty entry or after ``PROBES`` entries; an insert whose run has no empty
  entry within ``PROBES`` is refused (False), never placed further.
- Deletion shifts later entries of the run back into the hole (no
  tombstones), so runs stay whole and a full table never fills with dead
  entries.
- Writes go value first, tag last, word by word: a reader that races a
  write or a shift may see, for that moment, a half-written entry (matching
  nothing) or miss an entry being moved. A torn read is a false "absent"
  (or, for an entry half-overwritten by a key with the same tag, a value the
  caller must verify); never a crash or a read outside the table.
"""

from __future__ import annotations

import numpy as np

PROBES = 32  # entries an insert or lookup looks at, at most
WINDOW = 8  # entries a batched lookup reads per query in its first pass
_STEPS = np.arange(PROBES, dtype=np.int64)[:, None]
_GOLDEN = 0x9E3779B97F4A7C15
_U64 = 0xFFFFFFFFFFFFFFFF


def table_entries(keys: int) -> int:
    """Entries of a table meant for ``keys`` keys: a power of two, at least twice as many (load <= 1/2), >= 16."""
    return 1 << max(4, (2 * keys - 1).bit_length())


class ProbeTable:
    """Linear probing over a ``(entries, 2)`` uint64 view (entries a power of two); see the module docstring."""

    def __init__(self, words: np.ndarray):
        cap = len(words)
        assert cap & (cap - 1) == 0 and cap >= 16, f"keytable: {cap} entries is not a power of two >= 16"
        self.tags, self.values = words[:, 0], words[:, 1]
        self.cap = cap
        self._mask = cap - 1
        self._shift = 64 - (cap.bit_length() - 1)

    def home(self, tag: int) -> int:
        """The first entry ``tag``'s probe run looks at (what :meth:`lookup` computes for a batch)."""
        return ((tag * _GOLDEN) & _U64) >> self._shift

    # -- any process ---------------------------------------------------------------

    def lookup(self, tags: np.ndarray) -> np.ndarray:
        """Per query tag (uint64, none 0), the first entry of its run holding it, or -1; vectorised.

        The same answer as probing one entry at a time, in two passes over
        the batch: the first ``WINDOW`` entries of every run (nearly every
        lookup ends there: a match, or an empty entry ending the run), then
        the rest of ``PROBES`` for the few that did not, so a batch costs a
        few dozen array operations whatever its runs look like. Arrays are
        (probe step, query), so every operation runs along the batch.
        """
        n = len(tags)
        found = np.full(n, -1, dtype=np.int64)
        if not n:
            return found
        home = ((tags * np.uint64(_GOLDEN)) >> np.uint64(self._shift)).view(np.int64)  # < 2**63: same bits
        todo = np.arange(n)
        for lo, hi in ((0, WINDOW), (WINDOW, PROBES)):
            at = (home + _STEPS[lo:hi]) & self._mask  # (steps, queries)
            seen = self.tags[at]  # fancy indexing: np.take would copy a strided view whole first
            hit = seen == tags
            stop = hit | (seen == 0)  # a match, or the end of the run
            flat = stop.argmax(axis=0) * len(tags) + np.arange(len(tags))  # each query's first stop
            got = np.take(hit, flat)
            found[todo[got]] = np.take(at, flat[got])
            left = ~np.take(stop, flat)
            if not left.any():
                break
            todo, home, tags = todo[left], home[left], tags[left]
        return found

    def holds(self, tags: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per query, whether the table holds exactly ``(tag, value)``; vectorised (see :meth:`lookup`)."""
        at = self.lookup(tags)
        held = at >= 0
        held[held] = self.values[at[held]] == values[held]
        for i in np.flatnonzero((at >= 0) & ~held):  # another entry with the same tag came first: rare
            held[i] = self.find(int(tags[i]), int(values[i])) >= 0
        return held

    # -- the owner -----------------------------------------------------------------

    def find(self, tag: int, value: int) -> int:
        """The entry holding exactly ``(tag, value)``, or -1."""
        tags, values, mask = self.tags, self.values, self._mask
        home = self.home(tag)
        for step in range(PROBES):
            at = (home + step) & mask
            seen = int(tags[at])
            if seen == 0:
                return -1
            if seen == tag and int(values[at]) == value:
                return at
        return -1

    def insert(self, tag: int, value: int) -> bool:
        """Put ``(tag, value)`` in the first empty entry of its run; False if there is none within PROBES."""
        assert tag, "keytable: tag 0 marks an empty entry"
        tags, values, mask = self.tags, self.values, self._mask
        home = self.home(tag)
        for step in range(PROBES):
            at = (home + step) & mask
            if int(tags[at]) == 0:
                values[at] = value  # the value first: a reader that sees the tag sees its value
                tags[at] = tag
                return True
        return False

    def remove(self, tag: int, value: int) -> bool:
        """Drop the entry ``(tag, value)``, shifting the rest of its run back (see the module docstring)."""
        hole = self.find(tag, value)
        if hole < 0:
            return False
        tags, values, mask = self.tags, self.values, self._mask
        nxt = (hole + 1) & mask
        for _ in range(self.cap):  # a run ends at an empty entry (callers never fill a table)
            if int(tags[nxt]) == 0:
                break
            # it belongs at or before the hole (its home is no later, going round): move it up
            if (nxt - self.home(int(tags[nxt]))) & mask >= (nxt - hole) & mask:
                values[hole] = values[nxt]
                tags[hole] = tags[nxt]
                hole = nxt
            nxt = (nxt + 1) & mask
        tags[hole] = 0
        return True
