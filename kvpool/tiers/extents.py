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

When no free extent is long enough, its owner chooses what to evict with
:func:`cheapest_windows`: the *windows* (runs of the needed length made of
free units and of blocks that may be evicted) whose newest block was read
longest ago, found with numpy over the taken extents (one sort, a sparse
table of range maxima), never more than ``WINDOW_EXTENTS`` of them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

GRANULE = 64  # bytes in one unit: a cache line, so every block starts 64-byte aligned
_PARTIAL_SCAN = 32  # extents of the "maybe fits" bin looked at before giving up on it
PINNED = np.iinfo(np.int64).max  # the cost of a taken extent that may not be evicted (cheapest_windows)
WINDOW_EXTENTS = 1 << 19  # most taken extents one window search looks at (see cheapest_windows)


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

    def alloc_from(self, start: int, units: int) -> int | None:
        """Take the first ``units`` units of the free extent beginning at ``start``; None unless one that long does."""
        length = self._by_start.get(start)
        if units < 1 or length is None or length < units:
            return None
        self._drop(start)
        if length > units:
            self._add(start + units, length - units)
        return start

    def merged_run(self, start: int, units: int) -> tuple[int, int]:
        """(start, length) of the free extent the taken extent ``[start, start + units)`` would be part of, freed."""
        end = start + units
        first = self._by_end.get(start, start)
        return first, end + self._by_start.get(end, 0) - first

    def spans(self, start: int, end: int, taken: Sequence[tuple[int, int]]) -> bool:
        """Whether ``[start, end)`` holds nothing but free units and ``taken``: (start, units) of extents handed out,
        in address order, each overlapping it. False when unsure (a free part that starts before ``start``, with
        nothing taken to bound it): the caller looks again."""
        pos = start
        for s, n in taken:
            if s > pos:  # [pos, s) must be free: one free extent, as nothing taken lies between
                if pos == start:
                    first = self._by_end.get(s)  # it may begin before the window
                    if first is None or first > pos:
                        return False
                elif self._by_start.get(pos) != s - pos:
                    return False
            pos = s + n
        return pos >= end or self._by_start.get(pos, 0) >= end - pos

    def would_hold(self, units: Sequence[int], taken: Sequence[tuple[int, int]]) -> bool:
        """Whether blocks of ``units`` would fit in the free extents once the taken extents ``taken`` (start, units)
        are freed, each merged with its free neighbours (a sufficient test: largest block first into the longest
        run; O(len(taken) + len(units)), and O(1) a block when each freed extent holds the largest block alone, as
        with one block size)."""
        if not units:
            return True
        top = max(units)
        if all(n >= top for _, n in taken):
            spare = len(units) - len(taken)  # blocks beyond one per freed extent: into free extents that hold one
            if spare <= 0 or sum(n >= top for n in self._longest(spare, frozenset())) >= spare:
                return True
        absorbed: set[int] = set()
        runs: list[list[int]] = []
        for s, n in sorted(taken):
            first = self._by_end.get(s, s)
            end = s + n
            last = end + self._by_start.get(end, 0)
            absorbed.update(x for x in (first, end) if x in self._by_start)
            if runs and first <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], last)
            else:
                runs.append([first, last])
        return fits(units, [last - first for first, last in runs] + self._longest(len(units), absorbed))

    def _longest(self, count: int, skip: AbstractSet[int]) -> list[int]:
        """The lengths of ``count`` (or all, if fewer) free extents from the top size bins down, leaving out those
        starting in ``skip``: the longest, up to the order inside one bin (O(count + len(skip)))."""
        out: list[int] = []
        b = self._nonempty.bit_length() - 1
        while b >= 0 and len(out) < count:
            if self._nonempty >> b & 1:
                for start in self._bins[b]:
                    if start not in skip:
                        out.append(self._by_start[start])
                        if len(out) == count:
                            break
            b -= 1
        return out

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


def fits(units: Sequence[int], runs: Sequence[int]) -> bool:
    """Whether blocks of ``units`` fit in runs of lengths ``runs``, largest block first into the longest run (a
    sufficient test, not an exact one)."""
    heap = [-n for n in runs]
    heapq.heapify(heap)
    for n in sorted(units, reverse=True):
        if not heap or -heap[0] < n:
            return False
        heapq.heapreplace(heap, heap[0] + n)
    return True


@dataclass(frozen=True, slots=True)
class Window:
    """A run of units that is free once the taken extents ``victims`` names are freed (see :func:`cheapest_windows`)."""

    start: int  # its first unit
    victims: np.ndarray  # the extents it overlaps: indices into the arrays given to cheapest_windows, address order
    cost: int  # the largest cost among them; -1: none, the run is free already
    evicted: int  # the units they hold
    blocks: int = 1  # blocks of the size searched for it holds, one after another from start


def cheapest_windows(
    starts: np.ndarray, lengths: np.ndarray, costs: np.ndarray, total: int, units: int, count: int = 1,
    near: int = 0,
) -> list[Window]:
    """Runs for up to ``count`` blocks of ``units`` units in ``[0, total)``, made only of free units and evictable
    extents, cheapest first.

    ``starts``, ``lengths``: every taken extent (disjoint; all other units
    are free). ``costs`` (int64): what evicting each costs (its last read's
    time), ``PINNED`` where it may not be evicted. A run costs the largest
    cost among the extents it overlaps (all of them must go to free it),
    ties going to the run whose extents hold fewest units: the first run
    returned is one no other beats. Only runs that start where a taken
    extent ends (or at 0) are tried: any run slid left to the nearest such
    start overlaps no extent it did not. For more blocks, each next one
    goes where it costs least: a new run, or a run already chosen made one
    block longer (priced by the extents that adds), so blocks that are
    cheapest side by side get runs side by side. Runs returned share no
    extent and are parted by an extent kept, so each is still a free extent
    of its own once its victims are freed. At most ``WINDOW_EXTENTS`` extents are looked at: with more, the
    stretch of that many around unit ``near`` (the caller's oldest block).
    CPU: a sort and O(n log w) numpy steps for n extents, w of them in a
    run (0.1-0.2 s and ~65 MiB for a stretch of 2^19 out of 1.5M, measured on
    a busy 2-core machine).
    """
    n = int(starts.size)
    lo_unit, hi_unit = 0, total
    pick_all = None
    if n > WINDOW_EXTENTS:  # a stretch of WINDOW_EXTENTS extents around `near`, in address order
        rank = int(np.count_nonzero(starts < near))
        first = max(0, min(rank - WINDOW_EXTENTS // 2, n - WINDOW_EXTENTS))
        last = first + WINDOW_EXTENTS - 1
        bounds = np.partition(starts, [first, last])
        lo_unit, top = int(bounds[first]), int(bounds[last])
        del bounds
        pick_all = np.flatnonzero((starts >= lo_unit) & (starts <= top))
        beyond = starts[starts > top]
        hi_unit = int(beyond.min()) if beyond.size else total  # runs end before the next extent left out
        del beyond
        starts, lengths, costs = starts[pick_all], lengths[pick_all], costs[pick_all]
        n = int(starts.size)
    order = np.argsort(starts)
    s = starts[order].astype(np.int64)
    length = lengths[order].astype(np.int64)
    # Candidate k (0..n): the run that begins where extent k-1 ends (lo_unit for k = 0); it overlaps extents
    # k .. hi[k]-1 (s is sorted, extents are disjoint).
    begin = np.empty(n + 1, np.int64)
    begin[0] = lo_unit
    np.add(s, length, out=begin[1:])
    hi = np.searchsorted(s, begin + units, side="left")
    cum = np.zeros(n + 1, np.int64)
    np.cumsum(length, out=cum[1:])
    del length
    evicted = cum[hi] - cum[: n + 1]
    # The largest cost over [k, hi[k]): a sparse table of maxima over 2^level extents, one level at a time.
    width = hi - np.arange(n + 1)
    level = np.frexp(width)[1] - 1  # floor(log2(width)); -1 where width is 0 (a run that is free already)
    del width
    cost = np.full(n + 1, -1, np.int64)
    c = costs[order].astype(np.int64)
    table = c
    for lv in range(int(level.max(initial=-1)) + 1):
        if lv:
            half = 1 << (lv - 1)
            table = np.maximum(table[:-half], table[half:])  # table[i]: the largest of costs i .. i + 2^lv - 1
        q = np.flatnonzero(level == lv)
        if q.size:
            cost[q] = np.maximum(table[q], table[hi[q] - (1 << lv)])
    del table, level
    cost[begin + units > hi_unit] = PINNED  # runs past the end

    def most(lo: int, up: int) -> int:
        return int(c[lo:up].max()) if up > lo else -1

    chosen: list[list[int]] = []  # per run: [its first candidate k, one past its last victim, blocks it holds]
    for _ in range(count):
        best = int(cost.min())
        pick: tuple[int, int, int, int] | None = None  # (cost, units evicted, run to extend or -1, candidate or hi)
        if best != PINNED:
            ties = np.flatnonzero(cost == best)
            j = int(ties[np.argmin(evicted[ties])])
            pick = (best, int(evicted[j]), -1, j)
        for r, (k, up, m) in enumerate(chosen):  # one block more at the end of a chosen run: what it adds
            end = int(begin[k]) + (m + 1) * units
            new_up = int(np.searchsorted(s, end, side="left"))
            if end > hi_unit or any(k < k2 <= new_up for k2, _, _ in chosen):  # the next run must stay parted
                continue
            add = (most(up, new_up), int(cum[new_up] - cum[up]), r, new_up)
            if add[0] != PINNED and (pick is None or add[:2] < pick[:2]):
                pick = add
        if pick is None:
            break
        _, _, r, x = pick
        if r < 0:
            chosen.append([x, int(hi[x]), 1])
            k, up = x, int(hi[x])
        else:
            chosen[r][1:] = [x, chosen[r][2] + 1]
            k, up = chosen[r][0], x
        # No later run may share its extents or touch its run: candidates i with i <= up and hi[i] >= k.
        cost[int(np.searchsorted(hi, k, side="left")) : up + 1] = PINNED
    windows: list[Window] = []
    for k, up, m in chosen:
        victims = order[k:up]
        windows.append(Window(int(begin[k]), victims if pick_all is None else pick_all[victims], most(k, up),
                              int(cum[up] - cum[k]), m))
    return windows
