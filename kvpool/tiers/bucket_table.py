"""Bucketed hash tables in shared memory: one writer, any number of lock-free readers, batched lookups.

A table has ``buckets`` (a power of two) of ``WAYS`` entries. An entry is a
u64 *tag* (0: empty, so a stored tag is never 0; callers map a real 0 to 1)
and ``value_words`` u64 values. Tags, each value word and the per-bucket
*spill* counts are separate contiguous arrays, so a batched lookup gathers
one contiguous row of ``WAYS`` tags per query and one word per hit
(``np.take`` on contiguous arrays: a strided or fancy-indexed gather costs
several times as much here). The arena keeps two such tables: the DRAM key index
(tag: a key's first 8 bytes; value: its slot) and the inventory (tag: a
key's first 8 bytes; values: its next 8 bytes, size, checksum, tier); see
:mod:`kvpool.tiers.arena`.

Invariants:
- Only the arena's owner writes, one thread at a time (its callers
  serialise); readers in any process never lock.
- A tag lives in its *home* bucket or, when that was full, its *alternate*
  bucket (two hashes of the tag); ``spills[home]`` counts the entries of
  home's tags living in their alternate, so a lookup reads the alternate
  only for queries not found at home whose home has spilled. An insert that
  finds both full is refused (False); at load 1/2 that is vanishingly rare.
- An entry moves only from its home to its alternate (an insert making room,
  written there before it is cleared at home); a delete clears the tag.
  Writes go values first, tag last; a reader racing a write may miss an
  entry for that moment, or (an
  entry cleared and reused between its reads of the tag and of the values)
  read another key's values: callers verify what a value leads to (a DRAM
  row against the key, a block against its checksum), so a torn read costs a
  miss, never wrong bytes, and never a read outside the table.
"""

from __future__ import annotations

import numpy as np

WAYS = 8  # entries a bucket holds: one row of tags a lookup reads per query
SCALAR_QUERIES = 8  # a lookup of at most this many tags goes one by one (measured: 9 us for one, 56 vectorised)
_G1 = 0x9E3779B97F4A7C15
_G2 = 0xC2B2AE3D27D4EB4F
_U64 = 0xFFFFFFFFFFFFFFFF


def table_buckets(keys: int) -> int:
    """Buckets of a table meant for ``keys`` keys: a power of two, load at most 1/2, at least 2."""
    need = max(2, -(-2 * keys // WAYS))
    return 1 << (need - 1).bit_length()


def table_bytes(buckets: int, value_words: int) -> int:
    """Bytes a table of ``buckets`` buckets with ``value_words`` values an entry takes in a segment."""
    return buckets * WAYS * 8 * (1 + value_words) + buckets * 8


class BucketTable:
    """One table over three arrays of a shared segment (see the module docstring)."""

    def __init__(self, buf: np.ndarray, offset: int, buckets: int, value_words: int):
        assert buckets >= 2 and buckets & (buckets - 1) == 0, f"keytable: {buckets} buckets is not a power of two"
        entries = buckets * WAYS
        words = buf[offset : offset + table_bytes(buckets, value_words)].view(np.uint64)
        self.tags = words[:entries].reshape(buckets, WAYS)
        self.flat_tags = words[:entries]
        self.values = words[entries : entries * (1 + value_words)].reshape(value_words, entries)  # a row per word
        self.spills = words[entries * (1 + value_words) :]
        self.buckets = buckets
        self.entries = entries
        self._mask = buckets - 1
        self._shift = 64 - (buckets.bit_length() - 1)

    def homes(self, tag: int) -> tuple[int, int]:
        """(home, alternate) bucket of ``tag`` (what :meth:`lookup` computes for a batch)."""
        home = ((tag * _G1) & _U64) >> self._shift
        alt = ((tag * _G2) & _U64) >> self._shift
        return home, alt if alt != home else (home + 1) & self._mask

    # -- any process ---------------------------------------------------------------

    def lookup(self, tags: np.ndarray, match: np.ndarray | None = None) -> np.ndarray:
        """Per query tag (uint64, none 0) the entry (``bucket * WAYS + way``) holding it, or -1; vectorised
        (a few queries go one by one through :meth:`find`: plain ints beat a dozen small-array numpy calls).

        ``match``: the entry's first value word must equal it too (uint64 per query).
        """
        if len(tags) <= SCALAR_QUERIES:
            if match is None:
                return np.array([self.find(t) for t in tags.tolist()], dtype=np.int64)
            return np.array([self.find(t, m) for t, m in zip(tags.tolist(), match.tolist())], dtype=np.int64)
        shift = np.uint64(self._shift)
        home = ((tags * np.uint64(_G1)) >> shift).view(np.int64)  # < 2**63: the same bits
        found = self._find_in(home, tags, match)
        spilled = np.flatnonzero((found < 0) & (np.take(self.spills, home) != 0))
        if spilled.size:
            t = tags[spilled]
            alt = ((t * np.uint64(_G2)) >> shift).view(np.int64)
            alt = np.where(alt == home[spilled], (alt + 1) & self._mask, alt)
            found[spilled] = self._find_in(alt, t, None if match is None else match[spilled])
        return found

    def _find_in(self, buckets: np.ndarray, tags: np.ndarray, match: np.ndarray | None) -> np.ndarray:
        """Per query the first entry of its bucket with its tag (and ``match``), or -1. Two keys of one tag in one
        bucket (8 equal bytes of two hashes) answer for the first only: the other is a miss, never a wrong entry."""
        rows = np.take(self.tags, buckets, axis=0)  # (queries, WAYS): one contiguous row each
        at = buckets * WAYS + (rows == tags[:, None]).argmax(axis=1)
        ok = np.take(self.flat_tags, at) == tags
        if match is not None:
            ok &= np.take(self.values[0], at) == match
        return np.where(ok, at, -1)

    def find(self, tag: int, match: int | None = None) -> int:
        """The entry holding ``tag`` (and, if given, first value word ``match``), or -1 (its home bucket, then its
        alternate: a reader racing a move finds it in one or the other, or misses it for that moment)."""
        for bucket in dict.fromkeys(self.homes(tag)):
            row = self.tags[bucket].tolist()  # one bucket: plain ints beat small-array numpy here
            for way in (w for w, t in enumerate(row) if t == tag):
                at = bucket * WAYS + way
                if match is None or int(self.values[0, at]) == match:
                    return at
        return -1

    # -- the owner -----------------------------------------------------------------

    def insert(self, tag: int, values: tuple[int, ...]) -> int:
        """Put ``tag`` with ``values`` in a free entry of its home, else its alternate; the entry, or -1 (full).

        When both are full, one entry of the home bucket that lives at home
        moves to its own alternate (if that has room) to make the room: written
        there, counted as spilled, and only then cleared at home, so a reader
        finds it in one place or the other throughout.
        """
        assert tag, "keytable: tag 0 marks an empty entry"
        home, alt = self.homes(tag)
        for bucket in (home, alt):
            at = self._put(bucket, home, tag, values)
            if at >= 0:
                return at
        for way in range(WAYS):  # make room at home
            other = int(self.tags[home, way])
            other_home, other_alt = self.homes(other)
            if other_home != home:
                continue  # it lives in its alternate already
            at = home * WAYS + way
            if self._put(other_alt, home, other, tuple(int(v) for v in self.values[:, at])) >= 0:
                self.tags[home, way] = 0
                return self._put(home, home, tag, values)
        return -1

    def _put(self, bucket: int, home: int, tag: int, values: tuple[int, ...]) -> int:
        """Write ``tag`` (whose home is ``home``) with ``values`` into a free entry of ``bucket``; -1 if full."""
        row = self.tags[bucket].tolist()
        if 0 not in row:
            return -1
        at = bucket * WAYS + row.index(0)
        self.values[:, at] = values  # the values first: a reader that sees the tag sees them
        if bucket != home:
            self.spills[home] += np.uint64(1)  # before the tag: a reader that misses it at home looks here
        self.tags[bucket, at % WAYS] = tag
        return at

    def remove(self, tag: int, match: int | None = None) -> bool:
        """Clear the entry :meth:`find` names; False if there is none."""
        at = self.find(tag, match)
        if at < 0:
            return False
        bucket = at // WAYS
        self.tags[bucket, at % WAYS] = 0
        home, _ = self.homes(tag)
        if bucket != home:
            self.spills[home] -= np.uint64(1)
        return True
