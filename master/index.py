"""The master's indexes: which pool node holds which block in which tier, and what workers hold in HBM.

:class:`BlockIndex` maps a block key to its size, checksum and the (node number,
tier) locations holding it. It keeps no Python object per block: its rows live
in a :class:`~kvpool.master.keytable.KeyTable` (numpy arrays, 42 bytes a slot,
46 when it keeps tenant tags for the KV event feed; at the table's load of
0.25-0.7 that is 60-180 bytes per indexed block, 60-130 while it grows; plus
~24 per location for the per-node key lists below), and
a batch of keys is looked up by a fixed number of numpy calls, no loop over
keys or probe steps, at 10 million blocks as at a thousand.

Keys by their first 16 bytes. The table stores and compares only the first 128
bits of each 32-byte key. Keys are sha256 outputs, so two distinct keys share
that prefix with probability about ``n**2 / 2**129`` (1e-25 for 10 million
blocks). Even then the pool serves no wrong bytes: the two keys would share one
entry, a lookup of one could answer with a node holding the other, and that
node looks the *full* 32-byte key up in its own tiers: it finds nothing (a
miss), or the block really stored under that key, whose checksum the client
verifies on every read (a mismatch is a miss too).

:class:`BlockIndex` invariants (all hold whenever its lock is free):

- A key has a row iff at least one (node number, tier) location holds it; the
  last location removed frees the row.
- A location is packed as ``tier << 30 | node`` (node numbers are below
  ``2**30``), so numeric order is best-first order: lowest tier (DRAM before
  SSD), then lowest node number.
- ``loc1[r]`` is the best location of row ``r``. ``loc2[r]`` is ``_NONE`` (one
  location), the second best (two, ``loc1 < loc2``), or ``_MORE`` (three or
  more: the full sorted list, starting with ``loc1``, is ``_more[key]``, keyed
  by the row's (k0, k1) because rows move). The keys of ``_more`` are exactly
  those of the rows whose ``loc2`` is ``_MORE``. Two copies is
  common (write-through and promotions keep a block in DRAM and SSD) and costs
  no Python object; three or more (copies on several nodes) is rare.
- Rows only name *open* node numbers. Membership opens a number when a node
  registers and closes it by :meth:`BlockIndex.drop_node`; numbers are never
  reused, so a report still in flight for a dropped node is refused (its add
  returns False) instead of landing on someone else's entries.
- A key has one size and one checksum: those of its latest report (within one
  batch, of its last occurrence). Keys name their content (the namespaced hash
  of a token prefix), so copies on two nodes carry the same bytes; clients
  verify the checksum on every read.
- Within one report, removals are applied after additions: a key in both
  lists ends up absent from that location (the index never claims more than
  the node may hold; a spurious absence is only a miss).
- A key the table refuses is not indexed (a miss, logged): that takes more
  than 32 keys hashing to one home (see :mod:`~kvpool.master.keytable`),
  which sha256 keys never do; the alternative, growing the table for them
  without end, would let one broken node exhaust the master's memory.
- Per open node number, :class:`~kvpool.master.node_keys.NodeKeys` lists a
  superset of the keys it holds (every key a report linked to it, compacted
  lazily: ~24 bytes per location, 1.5 x 16 per location of the node's peak
  at most). Dropping a node or replacing a node's tier looks those keys up
  instead of scanning every row,
  so it costs that node's blocks, not the index's (a node holding more than
  1/:data:`SCAN_RATIO` of the table is served by one vectorised scan instead,
  which is cheaper then: a drop costs the smaller of the two).

:class:`HbmIndex` holds, per worker (by its tenant-scoped id), the keys in its
own HBM tier, up to per-worker and per-tenant caps. It feeds stats (HBM block
counts), routing scores and GPU events; lookups never consult it (workers
check their own HBM first).

Changes as events. Given an ``on_change`` sink, :class:`BlockIndex` reports
each key's *tier transitions*: stored when a key's first copy in a tier appears
(on any node), removed when its last copy in that tier goes (a removal, a full
sync's replacement, a dropped node). Copies on a second node or a second
report of a held key change nothing and are not reported. With ``tags`` each
transition also carries its keys' tenant tags (the feed sends a block's events
to its tenant only). :class:`HbmIndex` does the same per worker. A sink is
called once per changing call, in the order the changes were applied.

Each class has one lock, taken only with ``with``, never held while calling
out of the class, but for the change sink: it is called under the lock (that
keeps its order the index's order), and must neither block nor call back
(:meth:`kvpool.event_publisher.EventPublisher.publish` only queues).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvpool.keys import KEY_BYTES, BlockKey
from kvpool.master.keytable import KeyTable, Rows, last_wins
from kvpool.master.node_keys import NodeKeys
from kvpool.master.probe import leading_run
from kvpool.vocabulary import NO_TIER, Tier
from kvpool.worker_ids import scoped_id, split_scoped_id

T = TypeVar("T")

log = logging.getLogger(__name__)

_NODE_BITS = 30
_NODE_BITS64 = np.uint64(_NODE_BITS)
MAX_NODES = 1 << _NODE_BITS  # node numbers are 0 .. MAX_NODES - 1
_NODE_MASK = np.uint32(MAX_NODES - 1)
_NONE = np.uint32(0xFFFF_FFFF)  # loc2: the row has one location
_MORE = np.uint32(0xFFFF_FFFE)  # loc2: three or more locations, listed in _more[key]
COPY_ROWS = 1 << 16  # slots per step of a locations() copy (~4 ms of the lock each at 10M blocks)
SCAN_RATIO = 16  # a key looked up costs about this many slots scanned (measured: ~300 ns vs ~17 ns)
_TIERS = tuple(Tier)  # Tier by value, without an enum lookup per block
assert [int(t) for t in _TIERS] == list(range(len(_TIERS))) and len(_TIERS) <= 3  # packed tiers stay below _MORE

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
_Match = tuple[Callable[[npt.NDArray[np.uint32]], npt.NDArray[np.bool_]], Callable[[int], bool]]


def _location(node: int, tier: Tier) -> int:
    """A (node number, tier) pair packed into one uint32 whose order is best-first."""
    return int(tier) << _NODE_BITS | node


class Hit(NamedTuple):
    """Where one block of a leading run is best served from, with what it must look like."""

    tier: Tier
    node: int  # node number, resolved to a NodeRef by membership
    size: int
    checksum: int


class RunArrays(NamedTuple):
    """A leading run as columns: per block its best tier, node number, size and checksum."""

    tiers: np.ndarray  # uint8 Tier values
    nodes: np.ndarray  # uint32 node numbers
    sizes: np.ndarray  # uint64
    checksums: np.ndarray  # uint64


_new_hit = functools.partial(tuple.__new__, Hit)  # Hit from one (tier, node, size, checksum) tuple, in C


class TierChange(NamedTuple):
    """Keys whose first copy in ``tier`` appeared (``stored``) or whose last copy there went, as the table
    keys them: their first 16 bytes, two native-order uint64 words each; with ``tags``, each key's last 4
    bytes too (its tenant's tag, :mod:`kvpool.auth`), as a native-order uint32."""

    tier: Tier
    stored: bool
    k0: U64
    k1: U64
    tag: U32 | None = None


ChangeSink = Callable[[list[TierChange]], None]


class BlockIndex:
    """Key -> size, checksum and the (node number, tier) locations holding it. Thread-safe."""

    def __init__(self, min_capacity: int = 1024, on_change: ChangeSink | None = None, tags: bool = False) -> None:
        """``tags``: keep each key's tenant tag (4 bytes a slot more) and hand it to ``on_change`` (the KV event
        feed with auth on: a block's events go to its tenant only)."""
        self._lock = threading.Lock()
        self._on_change = on_change
        self._changes: list[TierChange] = []  # gathered during one call (lock held), handed to on_change at its end
        self._tags = tags
        payload: dict[str, type] = {"loc1": np.uint32, "loc2": np.uint32, "size": np.uint64, "checksum": np.uint64}
        self._table = KeyTable({**payload, "tag": np.uint32} if tags else payload, min_capacity)
        self._more: dict[tuple[int, int], list[int]] = {}  # (k0, k1) -> 3+ sorted locations
        self._open: set[int] = set()
        self._node_keys = NodeKeys(self._held_by)  # open node number -> a superset of its keys
        self._version = 0  # bumped by every change (under the lock): a copy taken in steps sees whether one came

    # -- node numbers -----------------------------------------------------------------

    def open_node(self, node: int) -> None:
        """Allow entries for ``node``; numbers must be fresh (never opened before)."""
        if not 0 <= node < MAX_NODES:
            raise ValueError(f"node number {node} outside [0, {MAX_NODES})")
        with self._lock:
            self._version += 1
            assert node not in self._open, f"BlockIndex: node number {node} opened twice (membership bug)"
            self._open.add(node)
            self._node_keys.open(node)

    def drop_node(self, node: int) -> int:
        """Close ``node``'s number and remove every entry it holds; returns how many locations went."""
        with self._lock:
            self._version += 1
            self._open.discard(node)
            k0, k1 = self._node_keys.close(node)
            if not self._table.live:
                return 0
            match: _Match = (lambda locs: (locs & _NODE_MASK) == node, lambda loc: loc & _NODE_MASK == node)
            removed = self._strip_node(k0, k1, match)
            self._table.compact()
            self._report_changes()
            return removed

    # -- reports from nodes ----------------------------------------------------------

    def add(
        self, node: int, tier: Tier, keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]
    ) -> bool:
        """Record that ``node`` holds ``keys`` in ``tier``; False (nothing changed) if the number is not open."""
        q0, q1, size, checksum, tag = _report(keys, sizes, checksums)
        with self._lock:
            self._version += 1
            if node not in self._open:
                return False
            refused = self._link(q0, q1, size, checksum, tag, _location(node, tier))
            self._report_changes()
        _refused(refused)
        return True

    def remove(self, node: int, tier: Tier, keys: Iterable[BlockKey]) -> bool:
        """Record that ``node`` no longer holds ``keys`` in ``tier``; False if the number is not open."""
        q0, q1, _ = _prefixes(keys)
        loc = _location(node, tier)
        with self._lock:
            self._version += 1
            if node not in self._open:
                return False
            rows = self._table.find(q0, q1)
            rows = np.unique(rows[rows >= 0])
            if rows.size:
                self._strip(rows, _exactly(loc))
                self._table.compact()
                self._report_changes()
            return True

    def replace_node_tier(
        self, node: int, tier: Tier, keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]
    ) -> bool:
        """Full sync: afterwards ``node`` holds exactly ``keys`` in ``tier``; False if the number is not open."""
        q0, q1, size, checksum, tag = _report(keys, sizes, checksums)
        loc = _location(node, tier)
        with self._lock:
            self._version += 1
            if node not in self._open:
                return False
            refused = self._link(q0, q1, size, checksum, tag, loc)
            t = self._table
            keep = np.zeros(len(t.k0), np.bool_)
            rows = t.find(q0, q1)  # rows may have moved while linking
            keep[rows[rows >= 0]] = True
            self._strip_node(*self._node_keys.keys(node), _exactly(loc), keep)
            t.compact()
            self._report_changes()
        _refused(refused)
        return True

    # -- copies (warm standbys, :mod:`~kvpool.master.changelog`) ------------------------

    def locations(self) -> tuple[U64, U64, U32, U64, U64, U32]:
        """Every (key, location) pair, as columns: k0, k1, packed location, size, checksum, tag (0 without
        tags): 40 bytes per location. A consistent copy, taken ``COPY_ROWS`` slots at a time so that lookups
        go on between the steps (a whole copy under the lock held them ~1 s at 10M blocks); if the index
        changed meanwhile (its caller did not keep writers out), it is taken again under the lock at once."""
        with self._lock:
            version, slots = self._version, len(self._table.fp)
        parts = []
        for start in range(0, slots, COPY_ROWS):
            with self._lock:
                if self._version != version:
                    break
                parts.append(self._locations_in(slice(start, start + COPY_ROWS)))
            time.sleep(0)  # let a lookup waiting for the lock take it (Python's locks do not queue)
        else:  # (the table always has slots: at least one step was taken)
            return cast(tuple[U64, U64, U32, U64, U64, U32], tuple(np.concatenate(column) for column in zip(*parts)))
        with self._lock:
            return self._locations_in(slice(0, len(self._table.fp)))

    def _locations_in(self, slots: slice) -> tuple[U64, U64, U32, U64, U64, U32]:
        """The (key, location) pairs of the keys in ``slots`` (lock held)."""
        t = self._table
        live = np.flatnonzero(t.fp[slots]) + slots.start
        loc2 = t.rec["loc2"][live]
        two = live[loc2 < _MORE]
        listed = live[loc2 == _MORE]
        extra = [(row, loc) for row in listed.tolist() for loc in self._more[t.key(row)][1:]]
        more_rows = np.array([row for row, _ in extra], np.intp)
        rows = np.concatenate([live, two, more_rows])
        loc = np.concatenate([t.rec["loc1"][live], t.rec["loc2"][two], np.array([loc for _, loc in extra], np.uint32)])
        tag = t.rec["tag"][rows] if self._tags else np.zeros(len(rows), np.uint32)
        return t.k0[rows], t.k1[rows], loc, t.rec["size"][rows], t.rec["checksum"][rows], tag

    def restore(self, k0: U64, k1: U64, loc: U32, size: U64, checksum: U64, tag: U32) -> int:
        """Add (key, location) pairs as :meth:`locations` gives them (a leader's snapshot); pairs on node numbers
        that are not open are skipped. Returns how many pairs were applied."""
        applied = 0
        with self._lock:
            self._version += 1
            for where in np.unique(loc).tolist():
                if where & int(_NODE_MASK) not in self._open or where >> _NODE_BITS >= len(_TIERS):
                    continue
                pick = loc == where
                _refused(self._link(k0[pick], k1[pick], size[pick], checksum[pick], tag[pick], where))
                applied += int(np.count_nonzero(pick))
            self._report_changes()
        return applied

    # -- queries ----------------------------------------------------------------------

    def leading_run(self, keys: Sequence[BlockKey]) -> list[Hit]:
        """The best location of each key of the leading run of indexed keys (stops at the first miss).

        Best = lowest tier (DRAM before SSD), then lowest node number.
        """
        run = self.leading_run_arrays(b"".join(keys) if len(keys) else b"")
        tiers, nodes = run.tiers.tolist(), run.nodes.tolist()
        columns = zip(map(_TIERS.__getitem__, tiers), nodes, run.sizes.tolist(), run.checksums.tolist())
        return list(map(_new_hit, columns))

    def leading_run_arrays(self, packed: bytes) -> RunArrays:
        """:meth:`leading_run` of packed keys, as numpy columns (no Python object per block; compiled:
        :func:`kvpool.master.probe.leading_run`)."""
        words = _key_words(packed)
        with self._lock:
            t = self._table
            cols = t.cols
            return RunArrays(*leading_run(words, *t.probed(), cols["loc1"], cols["size"], cols["checksum"],
                                          _NODE_BITS64))

    def leading_runs_pass(self, kernel: Callable[..., T], packed: Sequence[bytes]) -> tuple[T, npt.NDArray[np.int64]]:
        """``kernel(words, starts, *table)`` over several prompts' packed keys, under the index's lock, and
        ``starts``: ``words`` holds the keys one after another, prompt ``p``'s from key ``starts[p]`` up to
        ``starts[p + 1]``; ``table`` is what :func:`kvpool.master.probe.leading_run` takes after its words
        (the table's probe arguments, its location, size and checksum columns, the node bits). The Lookups
        that reach the master together share one such call (:func:`kvpool.master.lookup_reply.lookup_replies`)."""
        if any(len(p) % KEY_BYTES for p in packed):
            raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
        if len(packed) == 1:  # (a lookup alone: the usual case at low load)
            starts, words = np.array((0, len(packed[0]) // KEY_BYTES), np.int64), np.frombuffer(packed[0], np.uint64)
        else:
            starts = np.array([0, *itertools.accumulate(len(p) // KEY_BYTES for p in packed)], np.int64)
            words = np.frombuffer(b"".join(packed), np.uint64)
        with self._lock:
            t = self._table
            cols = t.cols
            return kernel(words, starts, *t.probed(), cols["loc1"], cols["size"], cols["checksum"],
                          _NODE_BITS64), starts

    def best_tiers(self, packed: bytes) -> npt.NDArray[np.uint8]:
        """Per packed key, the tier a lookup would serve it from (its best location's), or :data:`NO_TIER`."""
        words = _words(packed)
        with self._lock:
            t = self._table
            rows = t.find(words[:, 0], words[:, 1])
            best = t.rec["loc1"][np.maximum(rows, 0)]
        return np.where(rows >= 0, best >> _NODE_BITS, NO_TIER).astype(np.uint8)

    def holds(self, k0: U64, k1: U64) -> npt.NDArray[np.bool_]:
        """Per key (first 16 bytes as two words), whether any node holds it."""
        with self._lock:
            return self._table.find(k0, k1) >= 0

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: whether any node holds it in any tier."""
        return self.exists_packed(b"".join(keys) if len(keys) else b"").tolist()

    def exists_packed(self, packed: bytes) -> np.ndarray:
        """:meth:`exists` of packed keys, as a bool array (no Python object per key)."""
        words = _words(packed)
        with self._lock:
            rows = self._table.find(words[:, 0], words[:, 1])
        return rows >= 0

    def __len__(self) -> int:
        """Distinct indexed keys."""
        with self._lock:
            return self._table.live

    # -- internals (caller holds the lock) --------------------------------------------

    def _link(self, q0: U64, q1: U64, size: U64, checksum: U64, tag: U32, loc: int) -> int:
        """Add ``loc`` to each key's locations and set its size and checksum; returns how many keys the
        table refused (see :func:`_refused`)."""
        q0, q1, size, checksum, tag = last_wins(q0, q1, size, checksum, tag)
        self._node_keys.append(loc & int(_NODE_MASK), q0, q1)
        t = self._table
        rows = t.find(q0, q1)
        before = self._tier_masks(rows) if self._on_change is not None else None
        refused = self._link_rows(q0, q1, size, checksum, tag, loc, rows)
        if before is not None:
            # Every key now has loc's tier, unless the table refused it: then look again (rows moved).
            after = before | np.uint8(1 << (loc >> _NODE_BITS)) if not refused else self._tier_masks(t.find(q0, q1))
            self._note_changes(q0, q1, tag if self._tags else None, before, after)
        return refused

    def _link_rows(self, q0: U64, q1: U64, size: U64, checksum: U64, tag: U32, loc: int, rows: Rows) -> int:
        """:meth:`_link` of distinct keys whose current rows (-1: absent) are ``rows``."""
        t = self._table
        new = rows < 0
        old = rows[~new]
        if old.size:  # first the keys already indexed: inserting moves rows
            t.rec["size"][old] = size[~new]
            t.rec["checksum"][old] = checksum[~new]
            loc1, loc2, want = t.rec["loc1"], t.rec["loc2"], np.uint32(loc)
            first, second = loc1[old], loc2[old]
            held = (first == want) | (second == want)
            one = ~held & (second == _NONE)
            loc1[old[one]] = np.minimum(first[one], want)
            loc2[old[one]] = np.maximum(first[one], want)
            for row in old[~held & (second != _NONE)].tolist():  # two or more already: rare
                locs = self._more.get(t.key(row)) or [int(loc1[row]), int(loc2[row])]
                if loc not in locs:
                    bisect.insort(locs, loc)
                    self._set_locations(row, locs)
        fresh = int(np.count_nonzero(new))
        if fresh:
            columns: dict[str, npt.NDArray[np.generic]] = {
                "loc1": np.full(fresh, loc, np.uint32),
                "loc2": np.full(fresh, _NONE, np.uint32),
                "size": size[new],
                "checksum": checksum[new],
            }
            if self._tags:
                columns["tag"] = tag[new]
            placed = t.insert(q0[new], q1[new], columns)
            return fresh - placed
        return 0

    def _strip_node(self, k0: U64, k1: U64, match: _Match, keep: npt.NDArray[np.bool_] | None = None) -> int:
        """Remove the locations ``match`` selects (all of one node's) from the rows of the node's listed keys
        ``k0``, ``k1`` (but those ``keep`` marks); returns how many went. Looking a key up costs about
        :data:`SCAN_RATIO` times scanning one slot, so a node listing more keys than the table's slots over
        that ratio is served by one scan of every row instead: a drop costs min(its keys, the table)."""
        if len(k0) * SCAN_RATIO > len(self._table.fp):
            return self._strip_all(match, keep)
        rows = self._rows_listed(k0, k1)
        return self._strip(rows if keep is None else rows[~keep[rows]], match)

    def _strip_all(self, match: _Match, keep: npt.NDArray[np.bool_] | None = None) -> int:
        """Remove the locations ``match`` selects from every row (but those ``keep`` marks); returns how many
        went. One pass over the location fields, chunk by chunk, then the rare rows listed in ``_more``."""
        match_array, match_one = match
        t = self._table
        removed = 0
        for rows in t.chunks():
            first = np.ascontiguousarray(t.rec["loc1"][rows])
            second = np.ascontiguousarray(t.rec["loc2"][rows])
            candidate = (t.fp[rows] != 0) & (second != _MORE)
            if keep is not None:
                candidate &= ~keep[rows]
            gone, promoted, second_gone, count = _losses(first, second, match_array, candidate)
            touched = np.flatnonzero(gone | promoted | second_gone) + rows.start
            before = self._tier_masks(touched) if self._on_change is not None else None
            t.rec["loc1"][rows][promoted] = second[promoted]
            t.rec["loc2"][rows][promoted | second_gone] = _NONE
            t.delete(np.flatnonzero(gone) + rows.start)
            if before is not None:
                self._note_changes(t.k0[touched], t.k1[touched], self._row_tags(touched), before,
                                   self._tier_masks(touched))
            removed += count
        listed = self._rows_of(key for key, locs in self._more.items() if any(match_one(loc) for loc in locs))
        if keep is not None:
            listed = listed[~keep[listed]]
        return removed + self._strip(listed, match)

    def _strip(self, rows: Rows, match: _Match) -> int:
        """Remove the locations ``match`` selects from distinct live ``rows``; returns how many went."""
        if rows.size == 0:
            return 0
        match_array, match_one = match
        t = self._table
        touched = rows
        before = self._tier_masks(touched) if self._on_change is not None else None
        loc1, loc2 = t.rec["loc1"], t.rec["loc2"]
        second = loc2[rows]
        listed = second == _MORE
        more: list[int] = []
        if listed.any():  # three or more locations: the rare dict path below
            more = rows[listed].tolist()
            rows, second = rows[~listed], second[~listed]
        gone, promoted, second_gone, removed = _losses(loc1[rows], second, match_array)
        loc1[rows[promoted]] = second[promoted]
        loc2[rows[promoted | second_gone]] = _NONE
        dead = [rows[gone]]
        for row in more:
            locs = self._more[t.key(row)]
            kept = [loc for loc in locs if not match_one(loc)]
            removed += len(locs) - len(kept)
            if kept:
                self._set_locations(row, kept)
            else:
                del self._more[t.key(row)]
                dead.append(np.array([row], np.intp))
        t.delete(np.concatenate(dead))
        if before is not None:  # deleted rows keep their keys until the next insert or compact
            self._note_changes(t.k0[touched], t.k1[touched], self._row_tags(touched), before,
                               self._tier_masks(touched))
        return removed

    def _set_locations(self, row: int, locs: list[int]) -> None:
        """Store a row's sorted, non-empty location list in its columns (and ``_more`` if three or more)."""
        t = self._table
        t.rec["loc1"][row] = locs[0]
        if len(locs) <= 2:
            t.rec["loc2"][row] = locs[1] if len(locs) == 2 else _NONE
            self._more.pop(t.key(row), None)
        else:
            t.rec["loc2"][row] = _MORE
            self._more[t.key(row)] = locs

    def _tier_masks(self, rows: Rows) -> npt.NDArray[np.uint8]:
        """Per row (-1 or an empty slot: none), a bit per tier it has a location in: ``1 << tier``."""
        t = self._table
        safe = np.maximum(rows, 0)
        live = (rows >= 0) & (t.fp[safe] != 0)
        loc1, loc2 = t.rec["loc1"][safe], t.rec["loc2"][safe]
        one = np.uint8(1)
        masks = np.where(live, one << (loc1 >> _NODE_BITS).astype(np.uint8), 0).astype(np.uint8)
        two = live & (loc2 < _MORE)
        masks |= np.where(two, one << (loc2 >> _NODE_BITS).astype(np.uint8), 0).astype(np.uint8)
        for i in np.flatnonzero(live & (loc2 == _MORE)).tolist():
            for loc in self._more[t.key(int(rows[i]))]:
                masks[i] |= 1 << (loc >> _NODE_BITS)
        return masks

    def _row_tags(self, rows: Rows) -> U32 | None:
        return self._table.rec["tag"][rows] if self._tags else None

    def _note_changes(self, k0: U64, k1: U64, tag: U32 | None, before: npt.NDArray[np.uint8],
                      after: npt.NDArray[np.uint8]) -> None:
        """Gather the tier transitions of keys whose masks went from ``before`` to ``after``."""
        for tier in _TIERS:
            bit = np.uint8(1 << int(tier))
            had, has = (before & bit) != 0, (after & bit) != 0
            for stored, which in ((True, has & ~had), (False, had & ~has)):
                if which.any():
                    self._changes.append(TierChange(tier, stored, k0[which].copy(), k1[which].copy(),
                                                    None if tag is None else tag[which].copy()))

    def _report_changes(self) -> None:
        """Hand the call's gathered transitions to the sink (lock held: the index's order is the sink's)."""
        if self._changes and self._on_change is not None:
            changes, self._changes = self._changes, []
            try:
                self._on_change(changes)
            except Exception:  # the sink must never undo or fail a change that already happened
                log.exception("BlockIndex: the change sink failed; its events are lost")

    def _rows_listed(self, k0: U64, k1: U64) -> Rows:
        """The distinct live rows of the keys of a node's list (keys no longer indexed are skipped)."""
        return _distinct(self._table.find(k0, k1))

    def _held_by(self, node: int, k0: U64, k1: U64) -> tuple[U64, U64]:
        """Of these keys, the distinct ones ``node`` holds in any tier (:class:`NodeKeys`' compaction)."""
        t = self._table
        rows = _distinct(t.find(k0, k1))
        loc1, loc2 = t.rec["loc1"][rows], t.rec["loc2"][rows]
        mine = ((loc1 & _NODE_MASK) == node) | ((loc2 < _MORE) & ((loc2 & _NODE_MASK) == node))
        for i in np.flatnonzero(~mine & (loc2 == _MORE)).tolist():
            mine[i] = any(loc & _NODE_MASK == node for loc in self._more[t.key(int(rows[i]))])
        rows = rows[mine]
        return t.k0[rows], t.k1[rows]

    def _rows_of(self, keys: Iterable[tuple[int, int]]) -> Rows:
        """Rows of keys known to be indexed (``_more``'s keys)."""
        pairs = np.array(list(keys), np.uint64).reshape(-1, 2)
        rows = self._table.find(pairs[:, 0], pairs[:, 1])
        assert (rows >= 0).all(), "BlockIndex: a key of _more is not in the table"
        return rows


def _distinct(rows: Rows) -> Rows:
    """The distinct non-negative rows, ascending (a sort: numpy's hashing unique is slower here)."""
    rows = np.sort(rows[rows >= 0])
    return rows[np.concatenate(([True], rows[1:] != rows[:-1]))] if rows.size else rows


def _losses(
    first: npt.NDArray[np.uint32],
    second: npt.NDArray[np.uint32],
    match_array: Callable[[npt.NDArray[np.uint32]], npt.NDArray[np.bool_]],
    candidate: npt.NDArray[np.bool_] | None = None,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_], npt.NDArray[np.bool_], int]:
    """For rows of one or two locations (``loc1``, ``loc2`` values; ``candidate`` the rows to consider):
    which lose every location, which lose their first (the second is promoted), which lose only the
    second, and how many locations go in all."""
    m1 = match_array(first)
    m2 = (second < _MORE) & match_array(second)
    if candidate is not None:
        m1 &= candidate
        m2 &= candidate
    gone = m1 & (m2 | (second == _NONE))
    return gone, m1 & ~gone, m2 & ~m1, int(np.count_nonzero(m1)) + int(np.count_nonzero(m2))


def _refused(count: int) -> None:
    if count:
        log.warning(
            "BlockIndex: %d reported keys not indexed: more keys share one table home than it holds "
            "(not sha256 keys?); lookups of them miss", count,
        )


def _exactly(loc: int) -> _Match:
    want = np.uint32(loc)
    return (lambda locs: locs == want, lambda other: other == loc)


def _key_words(packed: bytes) -> npt.NDArray[np.uint64]:
    """Packed 32-byte keys as uint64 words, four a key; ValueError if ``packed`` is ragged."""
    if len(packed) % KEY_BYTES:
        raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    return np.frombuffer(packed, np.uint64)


def _words(packed: bytes) -> npt.NDArray[np.uint64]:
    """Packed 32-byte keys as rows of four uint64 words; ValueError if ``packed`` is ragged."""
    return _key_words(packed).reshape(-1, KEY_BYTES // 8)


def _prefixes(keys: Iterable[BlockKey]) -> tuple[U64, U64, U32]:
    """The first 16 bytes of each 32-byte key as two uint64 arrays, and its last 4 (its tenant's tag) as a
    uint32 array; ValueError for keys of another length."""
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)
    packed = b"".join(keys)
    if len(packed) != KEY_BYTES * len(keys):
        raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    words = np.frombuffer(packed, np.uint64).reshape(-1, KEY_BYTES // 8)
    return words[:, 0], words[:, 1], key_tags(packed)


def key_tags(packed: bytes) -> U32:
    """The last 4 bytes of each packed 32-byte key (its tenant's tag, :func:`kvpool.auth.tag_of`), as a
    native-order uint32: the form :class:`TierChange` carries."""
    return np.frombuffer(packed, np.uint32).reshape(-1, KEY_BYTES // 4)[:, -1]


def _report(
    keys: Sequence[BlockKey], sizes: Sequence[int], checksums: Sequence[int]
) -> tuple[U64, U64, U64, U64, U32]:
    """A report's keys, sizes, checksums and tags as arrays; ValueError (before anything changes) if
    malformed."""
    if not len(keys) == len(sizes) == len(checksums):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes and {len(checksums)} checksums")
    q0, q1, tag = _prefixes(keys)
    try:
        size = np.fromiter(sizes, np.uint64, len(sizes))
        checksum = np.fromiter(checksums, np.uint64, len(checksums))
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"sizes and checksums must be integers in [0, 2**64): {exc}") from exc
    return q0, q1, size, checksum, tag


HbmSink = Callable[[str, list[BlockKey], list[BlockKey]], None]  # (scoped worker id, keys it now holds, keys it lost)
DEFAULT_MAX_HBM_KEYS_PER_WORKER = 1 << 18  # MasterConfig's defaults
DEFAULT_MAX_HBM_KEYS_PER_TENANT = 1 << 24


@dataclass(slots=True)
class _TenantHbm:
    """One tenant's workers (by their plain worker ids) and how many keys they hold together."""

    workers: dict[str, set[BlockKey]]
    keys: int = 0


class HbmIndex:
    """Scoped worker id -> the keys in that worker's HBM tier (stats, routing scores, events). Thread-safe.

    Workers are named by their scoped ids (:func:`kvpool.worker_ids.scoped_id`): each tenant's workers are its
    own, and :meth:`worker_ids` lists one tenant's only.

    Invariants:

    - ``_total`` equals the sum of the workers' set sizes (a block in two workers' HBM counts twice: it is two
      copies), and each tenant's ``keys`` the sum over its workers.
    - A worker holds at most ``max_keys_per_worker`` keys, and one tenant's workers together at most
      ``max_keys_per_tenant``: a report's new keys past either are not kept (the first ones in the report's order
      are), and :meth:`report` says how many. A Score then under-counts that worker: a miss, never an error.
    - ``on_change`` hears each worker's exact transitions, by its scoped id: keys it did not hold and now does,
      keys it held and no longer does (a re-report of a held key is no change).
    - The lock is held for one worker at a time: one report, or one worker's run in :meth:`held_runs` (a C loop
      over at most one call's keys), never across the workers of one Score.
    """

    def __init__(self, on_change: HbmSink | None = None, *,
                 max_keys_per_worker: int = DEFAULT_MAX_HBM_KEYS_PER_WORKER,
                 max_keys_per_tenant: int = DEFAULT_MAX_HBM_KEYS_PER_TENANT) -> None:
        if max_keys_per_worker < 1 or max_keys_per_tenant < 1:
            raise ValueError("HbmIndex: max_keys_per_worker and max_keys_per_tenant must be positive")
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantHbm] = {}
        self._total = 0
        self._on_change = on_change
        self.max_keys_per_worker = max_keys_per_worker
        self.max_keys_per_tenant = max_keys_per_tenant

    def report(
        self, worker: str, added: Iterable[BlockKey], removed: Iterable[BlockKey], full_sync: bool = False
    ) -> int:
        """Apply a worker's HBM changes; ``full_sync`` replaces its set with ``added`` (then ``removed`` goes).

        Returns how many new keys were not kept (over ``max_keys_per_worker`` or ``max_keys_per_tenant``).
        """
        tenant_name, worker_id = split_scoped_id(worker)
        added = list(dict.fromkeys(added))  # distinct, in the report's order
        removed = set(removed)
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            if tenant is None:
                tenant = self._tenants[tenant_name] = _TenantHbm({})
            held = tenant.workers.get(worker_id)
            if held is None:
                held = tenant.workers[worker_id] = set()
            before, size = held, len(held)
            if full_sync:
                held = tenant.workers[worker_id] = set()
                gone: list[BlockKey] = []  # found below, once the kept keys are known
            else:
                gone = [k for k in removed if k in held]
                held.difference_update(gone)
            self._count(tenant, len(held) - size)
            new = [k for k in added if k not in held and k not in removed]
            room = max(0, min(self.max_keys_per_worker - len(held), self.max_keys_per_tenant - tenant.keys))
            kept = new[:room]
            held.update(kept)
            self._count(tenant, len(kept))
            if self._on_change is not None:
                if full_sync:
                    stored = [k for k in kept if k not in before]
                    gone = [k for k in before if k not in held]
                else:
                    stored = kept
                self._report_changes(worker, stored, gone)
            return len(new) - len(kept)

    def drop_worker(self, worker: str) -> int:
        """Forget a worker's HBM contents; returns how many keys went."""
        tenant_name, worker_id = split_scoped_id(worker)
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            held = tenant.workers.pop(worker_id, set()) if tenant is not None else set()
            if tenant is not None:
                self._count(tenant, -len(held))
                if not tenant.workers:
                    del self._tenants[tenant_name]
            self._report_changes(worker, [], list(held))
            return len(held)

    def clear(self) -> None:
        """Forget every worker (a master that stops leading keeps no state)."""
        with self._lock:
            for tenant_name, tenant in self._tenants.items():
                for worker_id, held in tenant.workers.items():
                    self._report_changes(scoped_id(tenant_name, worker_id), [], list(held))
            self._tenants.clear()
            self._total = 0

    def held_runs(self, workers: Sequence[str], keys: Sequence[BlockKey]) -> list[int]:
        """Per scoped worker id, how many of ``keys``, from the first, it holds in HBM (its leading run; unknown:
        0). The lock is taken per worker, for one C loop over ``keys``."""
        runs = []
        for worker in workers:
            tenant_name, worker_id = split_scoped_id(worker)
            with self._lock:
                tenant = self._tenants.get(tenant_name)
                held = tenant.workers.get(worker_id) if tenant is not None else None
                run = len(list(itertools.takewhile(held.__contains__, keys))) if held else 0
            runs.append(run)
        return runs

    def worker_ids(self, tenant: str) -> list[str]:
        """The (plain) ids of ``tenant``'s workers, sorted ("": auth off)."""
        with self._lock:
            found = self._tenants.get(tenant)
            return sorted(found.workers) if found is not None else []

    def blocks(self) -> int:
        """HBM block copies over all workers."""
        with self._lock:
            return self._total

    def _count(self, tenant: _TenantHbm, change: int) -> None:
        """Keys a tenant's workers gained (or lost, negative); lock held."""
        tenant.keys += change
        self._total += change

    def _report_changes(self, worker: str, stored: list[BlockKey], gone: list[BlockKey]) -> None:
        """Hand one worker's transitions to the sink (lock held, see the module docstring)."""
        if (stored or gone) and self._on_change is not None:
            try:
                self._on_change(worker, stored, gone)
            except Exception:
                log.exception("HbmIndex: the change sink failed; its events are lost")
