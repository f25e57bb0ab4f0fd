"""The master's indexes: which pool node holds which block in which tier, and what workers hold in HBM.

:class:`BlockIndex` invariants (all hold whenever its lock is free):

- A key is indexed iff at least one (node slot, tier) location holds it; the
  last location removed deletes the entry.
- ``_entries[k].locations`` is sorted best-first (lowest tier, then lowest
  node slot), so the best copy of a block is ``locations[0]``.
- ``_entries[k].locations`` and ``_by_location`` mirror each other exactly:
  location ``loc`` is in ``_entries[k].locations`` iff ``k`` is in
  ``_by_location[loc]``. The per-location key sets make dropping a node cost
  O(its keys), not O(all keys).
- Entries only ever name *open* node slots. Membership opens a slot when a
  node registers and closes it by :meth:`BlockIndex.drop_node`; slots are
  never reused, so a report still in flight for a dropped node is refused
  (its add returns False) instead of landing on someone else's slot.
- A key has one size and one checksum: those of its latest report. Keys name
  their content (the namespaced hash of a token prefix), so copies on two
  nodes carry the same bytes; clients verify the checksum on every read.
- Within one report, removals are applied after additions: a key in both
  lists ends up absent from that location (the index never claims more than
  the node may hold; a spurious absence is only a miss).

:class:`HbmIndex` holds, per worker, the keys in its own HBM tier. It only
feeds stats (HBM block counts); lookups never consult it (workers check their
own HBM first).

Each class has one lock, taken only with ``with``, never held while calling
out of the class.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvpool.keys import BlockKey
from kvpool.tiers.base import Tier

_TIER_BITS = 2  # Tier values 0..2 fit in two bits
_TIER_MASK = (1 << _TIER_BITS) - 1
_TIERS = tuple(Tier)  # Tier by value, without an enum lookup per block
assert [int(t) for t in _TIERS] == list(range(len(_TIERS))) and len(_TIERS) <= _TIER_MASK + 1


def _location(node: int, tier: Tier) -> int:
    """A (node slot, tier) pair packed into one small int: ``node << 2 | tier``."""
    return node << _TIER_BITS | int(tier)


def _location_order(loc: int) -> tuple[int, int]:
    """Sort key of a packed location: lowest tier first, then lowest node slot."""
    return loc & _TIER_MASK, loc >> _TIER_BITS


@dataclass(slots=True)
class _Entry:
    """One indexed block: its size, checksum and the packed locations holding it (never empty, best first)."""

    size: int
    checksum: int
    locations: list[int]


class Hit(NamedTuple):
    """Where one block of a leading run is best served from, with what it must look like."""

    tier: Tier
    node: int  # node slot, resolved to a NodeRef by membership
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class IndexCounts:
    """A snapshot of the index's size."""

    blocks: int  # distinct keys
    copies: int  # (key, node, tier) locations
    nodes: int  # open node slots


class BlockIndex:
    """Key -> size, checksum and the (node slot, tier) locations holding it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, _Entry] = {}
        self._by_location: dict[int, set[BlockKey]] = {}
        self._open: set[int] = set()

    # -- node slots -----------------------------------------------------------------

    def open_node(self, node: int) -> None:
        """Allow entries for ``node``; slots must be fresh (never opened before)."""
        with self._lock:
            assert node not in self._open, f"BlockIndex: node slot {node} opened twice (membership bug)"
            self._open.add(node)

    def drop_node(self, node: int) -> int:
        """Close ``node``'s slot and remove every entry it holds; returns how many locations went."""
        with self._lock:
            self._open.discard(node)
            removed = 0
            for tier in Tier:
                keys = self._by_location.pop(_location(node, tier), None)
                if keys:
                    self._unlink(keys, _location(node, tier))
                    removed += len(keys)
            return removed

    # -- reports from nodes ----------------------------------------------------------

    def add(
        self, node: int, tier: Tier, keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]
    ) -> bool:
        """Record that ``node`` holds ``keys`` in ``tier``; False (nothing changed) if the slot is not open."""
        _check_parallel(keys, sizes, checksums)
        loc = _location(node, tier)
        with self._lock:
            if node not in self._open:
                return False
            self._link(keys, sizes, checksums, loc)
            return True

    def remove(self, node: int, tier: Tier, keys: Iterable[BlockKey]) -> bool:
        """Record that ``node`` no longer holds ``keys`` in ``tier``; False if the slot is not open."""
        loc = _location(node, tier)
        with self._lock:
            if node not in self._open:
                return False
            held = self._by_location.get(loc)
            if held:
                gone = held.intersection(keys)
                held -= gone
                self._unlink(gone, loc)
            return True

    def replace_node_tier(
        self, node: int, tier: Tier, keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]
    ) -> bool:
        """Full sync: afterwards ``node`` holds exactly ``keys`` in ``tier``; False if the slot is not open."""
        _check_parallel(keys, sizes, checksums)
        loc = _location(node, tier)
        with self._lock:
            if node not in self._open:
                return False
            old = self._by_location.get(loc, set())
            stale = old.difference(keys)
            old -= stale
            self._unlink(stale, loc)
            self._link(keys, sizes, checksums, loc)
            return True

    # -- queries ----------------------------------------------------------------------

    def leading_run(self, keys: Sequence[BlockKey]) -> list[Hit]:
        """The best location of each key of the leading run of indexed keys (stops at the first miss).

        Best = lowest tier (DRAM before SSD), then lowest node slot.
        """
        run: list[Hit] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                best = entry.locations[0]
                run.append(Hit(_TIERS[best & _TIER_MASK], best >> _TIER_BITS, entry.size, entry.checksum))
        return run

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: whether any node holds it in any tier."""
        with self._lock:
            return [key in self._entries for key in keys]

    def counts(self) -> IndexCounts:
        with self._lock:
            copies = sum(len(keys) for keys in self._by_location.values())
            return IndexCounts(blocks=len(self._entries), copies=copies, nodes=len(self._open))

    def __len__(self) -> int:
        """Distinct indexed keys."""
        with self._lock:
            return len(self._entries)

    def check_invariants(self) -> None:
        """Assert the mirror invariants of the module docstring (tests; O(index size))."""
        with self._lock:
            seen = 0
            for loc, keys in self._by_location.items():
                assert keys, f"BlockIndex: empty key set kept for location {loc}"
                assert loc >> _TIER_BITS in self._open, f"BlockIndex: entries on closed node slot {loc >> _TIER_BITS}"
                for key in keys:
                    assert loc in self._entries[key].locations, "BlockIndex: location set and entry disagree"
                seen += len(keys)
            copies = 0
            for entry in self._entries.values():
                assert entry.locations, "BlockIndex: entry without locations"
                assert len(set(entry.locations)) == len(entry.locations), "BlockIndex: duplicate location"
                assert entry.locations == sorted(entry.locations, key=_location_order), "BlockIndex: unsorted locations"
                copies += len(entry.locations)
            assert copies == seen, f"BlockIndex: {copies} entry locations but {seen} keys in location sets"

    # -- internals (caller holds the lock) --------------------------------------------

    def _link(self, keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int], loc: int) -> None:
        held = self._by_location.setdefault(loc, set())
        entries = self._entries
        for key, size, checksum in zip(keys, sizes, checksums):
            entry = entries.get(key)
            if entry is None:
                entries[key] = _Entry(size, checksum, [loc])
            else:
                entry.size = size
                entry.checksum = checksum
                if key not in held:
                    bisect.insort(entry.locations, loc, key=_location_order)
            held.add(key)
        if not held:
            del self._by_location[loc]

    def _unlink(self, keys: Iterable[BlockKey], loc: int) -> None:
        """Remove ``loc`` from the entries of ``keys`` (already taken out of ``_by_location[loc]``)."""
        entries = self._entries
        for key in keys:
            entry = entries[key]
            entry.locations.remove(loc)
            if not entry.locations:
                del entries[key]
        if not self._by_location.get(loc, True):
            del self._by_location[loc]


def _check_parallel(keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]) -> None:
    if not len(keys) == len(sizes) == len(checksums):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes and {len(checksums)} checksums")


class HbmIndex:
    """Worker id -> the keys in that worker's HBM tier (stats only). Thread-safe.

    Invariant: ``_total`` equals the sum of the workers' set sizes (a block in
    two workers' HBM counts twice: it is two copies).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, set[BlockKey]] = {}
        self._total = 0

    def report(
        self, worker: str, added: Iterable[BlockKey], removed: Iterable[BlockKey], full_sync: bool = False
    ) -> None:
        """Apply a worker's HBM changes; ``full_sync`` replaces its set with ``added`` (then ``removed`` goes)."""
        with self._lock:
            held = self._workers.setdefault(worker, set())
            before = len(held)
            if full_sync:
                held.clear()
            held.update(added)
            held.difference_update(removed)
            self._total += len(held) - before

    def drop_worker(self, worker: str) -> int:
        """Forget a worker's HBM contents; returns how many keys went."""
        with self._lock:
            held = self._workers.pop(worker, set())
            self._total -= len(held)
            return len(held)

    def blocks(self) -> int:
        """HBM block copies over all workers."""
        with self._lock:
            return self._total

    def workers(self) -> int:
        with self._lock:
            return len(self._workers)
