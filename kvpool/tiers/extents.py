"""An offset allocator: contiguous extents of any length out of one range of units.

The DRAM arena's bytes are one range of ``GRANULE``-byte units; a block takes
one contiguous extent of ``ceil(size / GRANULE)`` units. Free extents are
kept by start and by end (so a freed extent merges with free neighbours at
once: no two free extents ever touch) and in size bins by
``length.bit_length()``, with a bitmap of the non-empty bins, so ``alloc``
finds a fitting extent in O(bins) without a scan of the free list.

Policy (good fit, TLSF-like): the smallest bin whose every extent fits is
taken first; the bin below it (extents of the same magnitude, some too
short) is searched only if no larger bin has one. The remainder of a split
extent stays free. With one block size, as most engines have, this is an
exact slot allocator: every freed extent is exactly one block.

Invariants (checked by :meth:`ExtentAllocator.check`, for tests):
- free extents are disjoint, never adjacent, and lie inside ``[0, total)``;
- ``free_units`` is the sum of their lengths;
- an extent handed out by ``alloc`` is never handed out again before ``free``.
This class is not thread-safe: its owner (the DRAM store) calls it under its lock.
"""

from __future__ import annotations

GRANULE = 64  # bytes in one unit: a cache line, so every block starts 64-byte aligned
_PARTIAL_SCAN = 32  # extents of the "maybe fits" bin looked at before giving up on it


def units_for(nbytes: int) -> int:
    """The units a block of ``nbytes`` takes (at least one)."""
    return max(1, -(-nbytes // GRANULE))


class ExtentAllocator:
    """Extents of ``total`` units (see the module docstring)."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"an allocator needs at least one unit, got {total}")
        self.total = total
        self.free_units = 0
        self._by_start: dict[int, int] = {}  # start -> length of each free extent
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._bins: list[dict[int, None]] = [{} for _ in range(total.bit_length() + 1)]  # ordered sets of starts
        self._nonempty = 0  # bit b set iff _bins[b] holds an extent
        self._add(0, total)

    # -- free-list bookkeeping -----------------------------------------------------

    def _add(self, start: int, length: int) -> None:
        b = length.bit_length()
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._bins[b][start] = None
        self._nonempty |= 1 << b
        self.free_units += length

    def _drop(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        b = length.bit_length()
        del self._bins[b][start]
        if not self._bins[b]:
            self._nonempty &= ~(1 << b)
        self.free_units -= length
        return length

    # -- the interface -----------------------------------------------------------------

    def alloc(self, units: int) -> int | None:
        """The start of a free extent of exactly ``units`` units, now taken; None if no free extent is that long."""
        if units < 1:
            raise ValueError(f"cannot allocate {units} units")
        if units > self.total:
            return None
        sure = (units - 1).bit_length() + 1  # bins from here up hold only extents >= units
        above = self._nonempty >> sure
        start: int | None = None
        if above:
            b = sure + ((above & -above).bit_length() - 1)
            start = next(iter(self._bins[b]))
        else:
            b = units.bit_length()
            for i, candidate in enumerate(self._bins[b]):
                if self._by_start[candidate] >= units:
                    start = candidate
                    break
                if i >= _PARTIAL_SCAN:
                    break
        if start is None:
            return None
        length = self._drop(start)
        if length > units:
            self._add(start + units, length - units)
        return start

    def free(self, start: int, units: int) -> None:
        """Give back an extent ``alloc`` handed out, merging it with its free neighbours."""
        end = start + units
        if not (0 <= start < end <= self.total):
            raise AssertionError(f"extents: freeing [{start}, {end}) outside [0, {self.total})")
        if start in self._by_start or end in self._by_end:
            raise AssertionError(f"extents: freeing [{start}, {end}), which overlaps a free extent")
        left = self._by_end.get(start)
        if left is not None:
            self._drop(left)
            start = left
        if end in self._by_start:
            end += self._drop(end)
        self._add(start, end - start)

    def largest_free(self) -> int:
        """The length of the longest free extent (0 if none)."""
        if not self._nonempty:
            return 0
        return max(self._by_start[s] for s in self._bins[self._nonempty.bit_length() - 1])

    def check(self) -> None:
        """AssertionError unless the invariants in the module docstring hold (O(free extents); tests only)."""
        spans = sorted(self._by_start.items())
        assert sum(n for _, n in spans) == self.free_units, "extents: free_units disagrees with the free list"
        for (s1, n1), (s2, _) in zip(spans, spans[1:]):
            assert s1 + n1 < s2, f"extents: free extents at {s1} and {s2} overlap or touch"
        for s, n in spans:
            assert 0 <= s and s + n <= self.total and n > 0, f"extents: bad free extent [{s}, {s + n})"
            assert self._by_end[s + n] == s and s in self._bins[n.bit_length()], "extents: indexes disagree"
