"""DRAM tier: the owner's index, allocator, LRU and watermarks over a :class:`SharedArena`.

Invariants:
- A block of any size up to ``max_block_bytes`` takes one slot (a row of the
  arena's table) and one contiguous extent of the data region
  (:class:`~kvpool.tiers.extents.ExtentAllocator`, 64-byte units); used
  bytes count extents, so a block costs its size rounded up to 64 B.
- ``_blocks`` maps every committed key to its slot. Recency is the arena's
  per-slot stamp (the last read's time, written by whoever reads: this
  store, the node's transports, or a same-host client straight from shared
  memory). Eviction takes the block with the oldest stamp: an exact LRU over
  every read on the host. ``_heap`` holds (stamp, slot, gen) entries, some
  stale; an entry whose slot was read since is pushed again with its new
  stamp, one whose block is gone is dropped, so the first live, current entry
  is the least recently used block. ``_lru_gen[slot]`` is the gen of the
  block in ``slot`` while it is in ``_blocks`` (0 otherwise: free, leased,
  being written or demoted): the evictable blocks. ``contains`` and
  ``locate`` do not change recency (``locate(touch=True)`` does: the caller
  is about to read).
- A key becomes visible (in ``_blocks`` and as an even slot gen) only after
  its bytes and checksum are in its extent.
- While a victim is being demoted (handed to the eviction sink, e.g. the SSD
  tier) it stays readable; its slot and extent are freed only after the sink
  returns, so a block is never absent from both tiers while it moves down.
- Eviction is inline, by the putting thread, and LRU first wherever LRU
  makes room (always so with one block size: exact LRU):
  1. With a gap between the watermarks, a put that would take usage above
     the high one evicts LRU blocks until usage is at the low one with room
     for the new blocks.
  2. Blocks that need more than the free units evict the LRU blocks worth
     the difference, if the runs freeing them makes (and the free extents)
     hold the blocks (:meth:`~kvpool.tiers.extents.ExtentAllocator.would_hold`).
  3. A block that then finds no free slot evicts the LRU block; one that
     finds no free extent long enough evicts the LRU block if freeing it
     (with its free neighbours) makes one, and otherwise the blocks of the
     cheapest *window* (:func:`~kvpool.tiers.extents.cheapest_windows`): a
     run as long as the block, of free units and evictable blocks, whose
     most recently read block was read longest ago (ties: fewest bytes; a
     batch's blocks of one size get runs side by side where that costs
     least). So a window for S bytes evicts at most S plus the block across
     its end, and no block read after the cheapest window's newest.
     The search runs outside the lock on copies of the slot table; its
     choice is checked again under the lock (a block read meanwhile is
     still evicted: a stamp is a hint; one freed, reused or written into
     the window meanwhile drops the choice, and the round is tried again).
  A bounded number of rounds, then a block is refused (a miss): at once if
  every window holds a block that may not be evicted (leased, being written
  or demoted).
- ``_lock`` guards the index and the allocator only; data copies and the
  sink run outside it.
- Every committed or demoting block is in the arena's key index (unless its
  probe run was full: then readers just ask the node), and leaves it when
  its slot is released.
- ``on_change`` hears of every change to the key set (committed puts as
  added, released victims and removes as removed), after the change and
  outside the lock.

Leases (same-host writers, :meth:`DramStore.reserve` / :meth:`DramStore.commit`):
- ``reserve`` takes slots and extents exactly as ``put`` does (evicting LRU
  blocks past the high watermark) and hands each slot to the lease with a
  fresh odd gen (:meth:`SharedArena.claim`): unreadable, owned by the lease,
  counted as used.
- A lease id is 63 random bits (:mod:`secrets`), never 0 and never the id of
  another live lease, so it cannot be guessed from one's own. A lease belongs
  to the ``owner`` that reserved it (the node passes the caller's identity;
  None with auth off, where the unguessable id is the only capability).
- ``commit`` ends the lease: each named slot that is the lease's slot for
  its key is published like a put, with the writer's checksum (key visible
  only once bytes and checksum are in place); the lease's other slots are
  freed. A lease past its deadline commits nothing. The bytes are not hashed
  again: the writer hashed them while copying them in, and every reader
  hashes what it copies out and compares it with the published checksum
  (the arena's seqlock re-check on top), so a writer whose bytes do not
  match its checksum (a bug, or one scribbling on the arena) makes its own
  block a miss for everyone, never wrong bytes for anyone.
- ``commit`` and ``release`` by anyone but the owner (or of an unknown id)
  change nothing: nothing is stored, and the owner's lease lives on.
- ``expire`` (the node's reaper) and ``release`` free a lease's slots, so a
  writer that dies halfway never leaves a slot stuck.
- A lease may carry a :class:`LeaseCharge` (what its slots cost a tenant's
  quota). ``reserve`` narrows it to the keys that got a slot (ends it if none
  did) before it returns; it ends exactly once, when the lease ends (commit,
  release, expiry, close), after the slots are free and the committed blocks
  were reported to ``on_change``, so the tenant is never charged less than it
  holds and reserves.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

from kvpool.buffers import BufferLike, as_array
from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey, check_keys
from kvpool.tiers.arena import SharedArena, SlotRef
from kvpool.tiers.base import ChangeListener, EvictionSink, check_batch, notify
from kvpool.tiers.extents import GRANULE, PINNED, ExtentAllocator, cheapest_windows, units_for
from kvpool.vocabulary import BlockMeta, Tier, TierStats

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

log = logging.getLogger(__name__)


LEASE_ID_BITS = 63  # fits the wire's uint64 and any signed 64-bit integer
BYTES_PER_SLOT = 4 << 10  # default slot count: one row per this much capacity (smaller blocks then find fewer rows)
MIN_SLOTS = 1024
MAX_SLOTS = 1 << 24
ALLOC_ROUNDS = 64  # evict-and-retry rounds before a block that finds no extent or slot is refused
MAX_WINDOWS = 16  # windows one search chooses (blocks of one size in a batch); the others wait for the next round


def default_slots(capacity_bytes: int) -> int:
    """How many slots (rows) an arena of ``capacity_bytes`` gets unless told: one per 4 KiB, 1024 to 16 Mi.

    A row costs 72 bytes of shared memory (1.8% of a 4 KiB block) and ~12 bytes of the owner's memory.
    """
    return max(MIN_SLOTS, min(MAX_SLOTS, capacity_bytes // BYTES_PER_SLOT))


class StoreOptions(TypedDict, total=False):
    """Keyword arguments of :class:`DramStore` for :meth:`DramStore.create` (which takes max_block_bytes itself)."""

    high_watermark: float
    low_watermark: float
    on_evict: EvictionSink | None
    on_change: ChangeListener | None
    verify_reads: bool


class LeaseCharge(Protocol):
    """What a lease's slots are charged to (a tenant's quota); :class:`DramStore` drives it (module docstring)."""

    def keep(self, keys: Sequence[BlockKey]) -> None:
        """Only these keys (those that got a slot) stay charged; a no-op once ended."""

    def end(self) -> None:
        """The lease is over: nothing stays charged. Idempotent."""


@dataclass(slots=True)
class Lease:
    """Slots handed to one writer until ``deadline`` (``time.monotonic``; None: no deadline)."""

    id: int
    deadline: float | None
    slots: dict[int, tuple[BlockKey | None, int]]  # slot -> (key, size) it was reserved for; None: leased ahead
    owner: object = None  # who may commit or release it (compared with ==)
    charge: LeaseCharge | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Reservation:
    """What :meth:`DramStore.reserve` handed out, per key in request order."""

    lease: int  # 0: no slot reserved
    slots: list[int]  # the slot to write (0 where gens[i] == 0)
    gens: list[int]  # its odd gen (the writer's turn); 0: no slot (the extent's offset is in the slot's row)
    held: list[bool]  # the store already holds the key (nothing to write)


BeforePublish = Callable[[list[BlockKey], list[np.ndarray], list[int]], object]  # (keys, views, checksums)


def _window_table(
    extent: np.ndarray, lru_gen: np.ndarray, stamps: np.ndarray, near: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """From :meth:`DramStore._snapshot`'s copies: (slots with an extent, their extents, their ``_lru_gen``, their
    eviction costs: the last read's time, PINNED where not evictable; ``near``), for a window search."""
    slots = np.flatnonzero(extent[:, 1])
    lru = lru_gen[slots]
    return slots, extent[slots], lru, np.where(lru != 0, stamps[slots].astype(np.int64), PINNED), near


class DramStore:
    """The DRAM tier of one pool node (owner side of the arena)."""

    tier = Tier.DRAM

    def __init__(
        self,
        arena: SharedArena,
        *,
        max_block_bytes: int | None = None,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
        on_evict: EvictionSink | None = None,
        on_change: ChangeListener | None = None,
        verify_reads: bool = True,
    ):
        if not arena.owner:
            raise ValueError("DramStore needs the arena's owner mapping (SharedArena.create)")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"need 0 < low <= high <= 1, got low={low_watermark} high={high_watermark}")
        units = arena.data_bytes // GRANULE
        if not 1 <= units < 1 << 32:
            raise ValueError(f"a DRAM arena of {arena.data_bytes} B: need 1 to 2^32 units of {GRANULE} B")
        largest = units * GRANULE
        if max_block_bytes is not None and not 0 < max_block_bytes:
            raise ValueError(f"max_block_bytes must be > 0, got {max_block_bytes}")
        self.arena = arena
        self.max_block_bytes = largest if max_block_bytes is None else min(max_block_bytes, largest)
        self.on_evict = on_evict
        self.on_change = on_change
        self.verify_reads = verify_reads
        self._high = max(1, int(units * high_watermark))
        self._low = min(self._high, max(0, int(units * low_watermark)))
        self._lock = threading.Lock()
        self._alloc = ExtentAllocator(units)
        self._extent = np.zeros((arena.num_slots, 2), dtype=np.uint32)  # slot -> (first unit, units); 0 units: free
        self._used = 0  # units of committed, demoting and leased blocks
        self._held_bytes = 0  # bytes of committed and demoting blocks (their lengths, as stats report them)
        self._blocks: dict[BlockKey, int] = {}
        self._heap: list[tuple[int, int, int]] = []  # (stamp, slot, gen), see the module docstring
        self._lru_gen = np.zeros(arena.num_slots, dtype=np.uint64)  # slot -> its block's gen while in _blocks, else 0
        self._demoting: dict[BlockKey, int] = {}
        self._free = np.arange(arena.num_slots - 1, -1, -1, dtype=np.uint32)  # a stack: free slots are [:_nfree]
        self._nfree = arena.num_slots
        self._leases: dict[int, Lease] = {}
        self._leased = 0  # slots held by leases
        self._stats = TierStats(Tier.DRAM, capacity_bytes=largest)

    @classmethod
    def create(cls, name: str, capacity_bytes: int, max_block_bytes: int | None = None, *, slots: int = 0,
               mode: int = 0o600, ssd_keys: int = 0, **kwargs: Unpack[StoreOptions]) -> DramStore:
        """A store over a new arena of ``capacity_bytes`` (segment permissions ``mode``).

        ``max_block_bytes``: the largest block it takes (None: any that fits);
        ``slots``: how many blocks it can describe (0: :func:`default_slots`);
        ``ssd_keys``: room in the arena's inventory for SSD keys, beside one per slot.
        A refused argument leaves no arena behind.
        """
        if capacity_bytes < GRANULE:
            raise ValueError(f"DRAM capacity {capacity_bytes} B is below one {GRANULE}-byte unit")
        if max_block_bytes is not None and max_block_bytes < 1:
            raise ValueError(f"max_block_bytes must be > 0, got {max_block_bytes}")
        arena = SharedArena.create(name, capacity_bytes, slots or default_slots(capacity_bytes), mode,
                                   ssd_keys=ssd_keys)
        try:
            return cls(arena, max_block_bytes=max_block_bytes, **kwargs)
        except BaseException:
            arena.close()
            raise

    # -- reads -------------------------------------------------------------------

    def _slot_of(self, key: BlockKey) -> int | None:
        slot = self._blocks.get(key)
        return self._demoting.get(key) if slot is None else slot

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = check_keys(keys)
        with self._lock:
            return [self._slot_of(k) is not None for k in keys]

    def locate(self, keys: Sequence[BlockKey], *, touch: bool = False) -> list[SlotRef | None]:
        """Where each key's bytes are now, for a reader; ``touch``: stamp them read (the caller reads them next)."""
        keys = check_keys(keys)
        with self._lock:  # a ref read under the lock is the key's: its slot cannot be released meanwhile
            slots = [self._slot_of(k) for k in keys]
            refs = [None if s is None else self.arena.ref(s) for s in slots]
        if touch:
            self.arena.touch([r.slot for r in refs if r is not None])
        return refs

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[bool]:
        keys = check_keys(keys)
        check_batch(keys, outs)
        dsts = [as_array(o, writable=True) for o in outs]
        refs = self.locate(keys, touch=True)
        hits = []
        for key, ref, dst in zip(keys, refs, dsts):
            ok = (ref is not None and ref.length == dst.size
                  and self.arena.read_into(ref, key, dst, verify=self.verify_reads))
            hits.append(ok)
        self.record_reads(sum(hits), len(hits) - sum(hits), sum(d.size for d, h in zip(dsts, hits) if h))
        return hits

    def record_reads(self, hits: int, misses: int, bytes_out: int) -> None:
        """Count reads served outside :meth:`get_into` (a transport sending from :meth:`locate`'s refs)."""
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.bytes_out += bytes_out

    # -- allocation and eviction (slots, extents, LRU) ----------------------------

    def _take(self, units: int, at: int | None = None) -> int | None:
        """Under the lock: a free slot with an extent of ``units`` units, counted as used; None if none is free.

        ``at``: the first unit of a run freed for this block, tried first.
        """
        if not self._nfree:
            return None
        start = None if at is None else self._alloc.alloc_from(at, units)
        if start is None:
            start = self._alloc.alloc(units)
        if start is None:
            return None
        self._nfree -= 1
        slot = int(self._free[self._nfree])
        self._extent[slot] = (start, units)
        self._used += units
        return slot

    def _give_back(self, slot: int) -> None:
        """Under the lock: free ``slot`` and its extent (its row must be free/odd already)."""
        start, units = (int(v) for v in self._extent[slot])
        if units:
            self._alloc.free(start, units)
            self._used -= units
            self._extent[slot] = (0, 0)
        self._free[self._nfree] = slot
        self._nfree += 1

    def _publish(self, slot: int, key: BlockKey, size: int, checksum: int) -> None:
        """Under the lock: commit ``slot`` as ``key`` and enter it in the LRU."""
        ref = self.arena.commit(slot, key, size, checksum)
        self.arena.index_insert(key, slot)
        self._held_bytes += size
        self._blocks[key] = slot
        self._lru_gen[slot] = ref.gen
        heapq.heappush(self._heap, (int(self.arena.stamps[slot]), slot, ref.gen))
        if len(self._heap) > 2 * len(self._blocks) + MIN_SLOTS:
            self._compact_heap()

    def _unpublish(self, slot: int) -> None:
        """Under the lock: mark a committed slot free in the arena (readers now miss it); its extent stays taken."""
        self._held_bytes -= int(self.arena.table["length"][slot])
        self.arena.release(slot)
        self.arena.index_remove(BlockKey(self.arena.table["key"][slot].tobytes()), slot)

    def _compact_heap(self) -> None:
        """Under the lock: rebuild the heap from the live blocks (drops stale entries)."""
        stamps, gens = self.arena.stamps, self.arena.gens
        self._heap = [(int(stamps[s]), s, int(gens[s])) for s in self._blocks.values()]
        heapq.heapify(self._heap)

    def _key_of(self, slot: int) -> BlockKey:
        return BlockKey(self.arena.table["key"][slot].tobytes())

    def _evict(self, slot: int) -> tuple[BlockKey, int]:
        """Under the lock: move the block in ``slot`` from ``_blocks`` to ``_demoting`` (still readable)."""
        key = self._key_of(slot)
        del self._blocks[key]
        self._demoting[key] = slot
        self._lru_gen[slot] = 0
        return key, slot

    def _lru_head(self) -> int | None:
        """Under the lock: the slot of the least recently used block (the heap's top, fixed up); None if none."""
        heap, stamps = self._heap, self.arena.stamps
        while heap:
            stamp, slot, gen = heap[0]
            if int(self._lru_gen[slot]) != gen:
                heapq.heappop(heap)  # that block is gone (removed, evicted, or the slot reused)
                continue
            now = int(stamps[slot])
            if now > stamp:
                heapq.heapreplace(heap, (now, slot, gen))  # read since: it goes where its last read puts it
                continue
            return slot
        return None

    def _pick_victims(self, units: int, count: int) -> list[tuple[BlockKey, int]]:
        """Under the lock: least recently used blocks worth >= ``units`` units and >= ``count`` slots, evicted."""
        victims: list[tuple[BlockKey, int]] = []
        freed = 0
        while freed < units or len(victims) < count:
            slot = self._lru_head()
            if slot is None:
                break
            heapq.heappop(self._heap)
            victims.append(self._evict(slot))
            freed += int(self._extent[slot, 1])
        return victims

    def _room_in_lru_order(self, wants: list[int], room: int) -> list[tuple[BlockKey, int]]:
        """Under the lock: the least recently used blocks worth ``room`` units, evicted if the runs freeing them makes
        (and the longest free extents) hold blocks of ``wants`` units; none otherwise (the heap as it was)."""
        popped: list[tuple[int, int, int]] = []
        freed = 0
        while freed < room:
            slot = self._lru_head()
            if slot is None:
                break
            popped.append(heapq.heappop(self._heap))
            freed += int(self._extent[slot, 1])
        taken = [(s, n) for s, n in self._extent[[slot for _, slot, _ in popped]].tolist()]
        if freed >= room and self._alloc.would_hold(wants, taken):
            return [self._evict(slot) for _, slot, _ in popped]
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return []

    def _room_by_lru_head(
        self, pending: list[tuple[int, int]], planned: dict[int, int]
    ) -> tuple[list[tuple[BlockKey, int]], list[int]]:
        """Under the lock, for blocks (index, units) that found no slot or extent: (LRU victims, blocks left over).

        Short of slots: as many LRU blocks as slots are missing. Otherwise,
        per block, the LRU block if freeing it makes a run long enough
        (``planned`` gets that run's start); the blocks for which it does not
        are left over, for :meth:`_room_by_window`.
        """
        short = len(pending) - self._nfree
        if short > 0:
            return self._pick_victims(0, short), []
        victims: list[tuple[BlockKey, int]] = []
        left: list[int] = []
        for i, units in pending:
            slot = self._lru_head()
            if slot is not None:
                start, length = self._alloc.merged_run(int(self._extent[slot, 0]), int(self._extent[slot, 1]))
                if length >= units:
                    heapq.heappop(self._heap)
                    victims.append(self._evict(slot))
                    planned[i] = start
                    continue
            left.append(i)
        return victims, left

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Under the lock: copies of the slots' extents, ``_lru_gen`` and stamps, and the LRU block's first unit, for a
        window search outside the lock (plain copies: 5-20 ms for 1.5M slots, a quarter of gathering them)."""
        head = self._lru_head()
        near = 0 if head is None else int(self._extent[head, 0])
        return self._extent.copy(), self._lru_gen.copy(), self.arena.stamps.copy(), near

    def _room_by_window(
        self, table: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], blocks: list[int], units: int,
        planned: dict[int, int],
    ) -> tuple[list[tuple[BlockKey, int]], bool]:
        """Evict the cheapest windows of ``units`` units for ``blocks`` (module docstring), chosen on ``table``
        (:func:`_window_table`): (victims, whether a window had changed under the lock: the caller tries again)."""
        slots, extents, lru, costs, near = table
        windows = cheapest_windows(extents[:, 0], extents[:, 1], costs, self._alloc.total, units,
                                   min(len(blocks), MAX_WINDOWS), near=near)
        victims: list[tuple[BlockKey, int]] = []
        changed = False
        todo = iter(blocks)
        with self._lock:
            for w in windows:
                mine = [next(todo) for _ in range(w.blocks)]  # its blocks, one after another from its start
                taken = [(int(s), int(n)) for s, n in extents[w.victims]]
                if not (self._lru_gen[slots[w.victims]] == lru[w.victims]).all() or \
                        not self._alloc.spans(w.start, w.start + w.blocks * units, taken):
                    changed = True
                    continue
                victims += [self._evict(int(slot)) for slot in slots[w.victims]]
                planned.update((i, w.start + b * units) for b, i in enumerate(mine))
        return victims, changed

    def _allocate(self, sizes: Sequence[int]) -> tuple[list[int | None], list[BlockKey]]:
        """A slot with an extent for each size (None: no room even after evicting), and the keys evicted for them.

        Round one evicts down to the low watermark if the new blocks would
        take usage above the high one and that is more than they need; each
        round then gives every block a slot and an extent where one is free
        (a run freed for it first) and makes room for the others (LRU block
        or cheapest window), until they fit or nothing can be evicted for
        them (see the module docstring).
        """
        want = [units_for(n) for n in sizes]
        got: list[int | None] = [None] * len(sizes)
        pending = list(range(len(sizes)))
        planned: dict[int, int] = {}  # block -> the first unit of the run freed for it
        released: list[BlockKey] = []
        for attempt in range(ALLOC_ROUNDS):
            left: list[int] = []
            snapshot = None
            with self._lock:
                need = sum(want[i] for i in pending)
                room = need - self._alloc.free_units  # what the blocks need evicted anyway
                excess = self._used + need - max(self._low, need)  # what the watermarks ask for
                if attempt == 0 and self._used + need > self._high and excess > room:
                    victims = self._pick_victims(excess, 0)  # down to the low watermark, in LRU order
                else:  # the room the blocks need, in LRU order if what that frees holds them
                    victims = self._room_in_lru_order([want[i] for i in pending], room) if room > 0 else []
                if not victims:
                    first = sorted(pending, key=lambda i: i not in planned) if planned else pending
                    for i in first:  # blocks with a run freed for them first
                        got[i] = self._take(want[i], planned.pop(i, None))
                    pending = [i for i in pending if got[i] is None]
                    if not pending:
                        break
                    victims, left = self._room_by_lru_head([(i, want[i]) for i in pending], planned)
                    if left:
                        units = max(want[i] for i in left)  # one size per search; the others in later rounds
                        left = [i for i in left if want[i] == units]
                        snapshot = self._snapshot()
            progress = bool(victims or planned)
            if snapshot is not None:
                table = _window_table(*snapshot)
                snapshot = None  # the copies go before the search runs
                more, changed = self._room_by_window(table, left, units, planned)
                del table
                victims += more
                found = any(i in planned for i in left)  # those without one try again, after these are freed
                hopeless = [] if changed or found else left[:MAX_WINDOWS]
                pending = [i for i in pending if i not in hopeless]  # no window at all: they find no room
                progress = bool(victims or planned or changed or hopeless)
            if victims:
                released += self._demote(victims)
            if not progress or not pending:
                break  # nothing can be evicted for the blocks left: they find no room
        return got, released

    def _demote(self, victims: list[tuple[BlockKey, int]]) -> list[BlockKey]:
        """Hand victims to the sink, then free them; returns the keys released."""
        if self.on_evict is not None:
            keys = [k for k, _ in victims]
            views = [self.arena.view(s, int(self.arena.table["length"][s])) for _, s in victims]
            sums = [int(self.arena.table["checksum"][s]) for _, s in victims]
            try:
                self.on_evict(keys, views, sums)
            except Exception:  # a failed demotion drops the blocks: a later miss, not an error
                log.exception("DRAM: demoting %d blocks failed; dropping them", len(keys))
            del views
        with self._lock:
            released = []
            for key, slot in victims:
                if self._demoting.pop(key, None) == slot:
                    self._unpublish(slot)
                    self._give_back(slot)
                    released.append(key)
            self._stats.evictions += len(victims)
        return released

    # -- writes ------------------------------------------------------------------

    def _check_size(self, n: int) -> None:
        if not 0 < n <= self.max_block_bytes:
            raise ValueError(f"a {n}-byte block: the DRAM tier takes blocks of 1..{self.max_block_bytes} B")

    def put(
        self, keys: Sequence[BlockKey], values: Sequence[BufferLike], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """Store blocks; True for each key now held (already present counts). False: no room.

        ``checksums``, when given, must be the values' checksums (a lower tier
        promoting a block it has just verified); otherwise they are computed.
        """
        keys = check_keys(keys)
        check_batch(keys, values)
        srcs = [as_array(v) for v in values]
        for src in srcs:
            self._check_size(src.size)
        if checksums is not None:
            check_batch(keys, checksums)
        sums = [block_checksum(s) for s in srcs] if checksums is None else [int(c) for c in checksums]

        result = [False] * len(keys)
        todo: list[int] = []
        touched: list[int] = []
        with self._lock:
            seen: set[BlockKey] = set()
            for i, k in enumerate(keys):
                slot = self._slot_of(k)
                if slot is not None:
                    touched.append(slot)
                    result[i] = True
                elif k not in seen:
                    seen.add(k)
                    todo.append(i)
        self.arena.touch(touched)
        slots, released = self._allocate([srcs[i].size for i in todo])
        placed = [(i, s) for i, s in zip(todo, slots) if s is not None]
        with self._lock:
            for _, slot in placed:
                self.arena.claim(slot, int(self._extent[slot, 0]) * GRANULE)
        for i, slot in placed:
            np.copyto(self.arena.block(slot, srcs[i].size), srcs[i])
        stored: set[BlockKey] = set()
        added: list[BlockMeta] = []
        with self._lock:
            for i, slot in placed:
                key = keys[i]
                if self._slot_of(key) is not None:  # a concurrent put won the race
                    self._give_back(slot)
                else:
                    self._publish(slot, key, srcs[i].size, sums[i])
                    stored.add(key)
                    added.append(BlockMeta(key, srcs[i].size, sums[i]))
            self._stats.puts += len(stored)
            self._stats.bytes_in += sum(m.size for m in added)
        notify(self.on_change, added, released, "DRAM")
        # Keys that found no slot stay False (no room); repeats of a key in the batch share its fate.
        return [r or k in stored for r, k in zip(result, keys)]

    # -- leases (same-host writers) -----------------------------------------------------

    def _new_lease_id(self) -> int:
        """Under the lock: a random id that is neither 0 nor a live lease's."""
        while True:
            lease_id = secrets.randbits(LEASE_ID_BITS)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def reserve(
        self, keys: Sequence[BlockKey], sizes: Sequence[int], timeout_s: float | None, *, owner: object = None,
        charge: LeaseCharge | None = None, extend: int = 0,
    ) -> Reservation:
        """Lease slots for blocks of ``sizes`` to ``owner`` (see the module docstring).

        Per key: a slot, its extent's offset and its odd gen, or gen 0 if the
        key is held already (``held``), repeats an earlier key of the batch,
        or found no room. ``timeout_s`` None: the lease lasts until committed
        or released. ``charge`` (already charged for ``keys``) is narrowed to
        the keys that got a slot, and ends with the lease (at once if no slot
        was reserved). ``extend``: add the slots to that live lease of
        ``owner``'s (its deadline stays) instead of a new one; if it is not
        one (unknown, lapsed, another's, or either side carries a charge)
        nothing is reserved and the reservation's lease is 0.
        """
        try:
            reservation, reserved, released = self._lease(keys, sizes, timeout_s, owner, charge, extend)
        except BaseException:
            if charge is not None:
                charge.end()  # no lease took it
            raise
        notify(self.on_change, (), released, "DRAM")
        if charge is not None:  # outside the lock: the quota ledger looks into this store under its own lock
            if reserved:
                charge.keep(reserved)  # a no-op if the lease already ended (a zero timeout and the reaper)
            else:
                charge.end()
        return reservation

    def lease_ahead(self, sizes: Sequence[int], timeout_s: float | None, *, owner: object = None) -> Reservation:
        """Lease slots of ``sizes`` to ``owner`` for blocks whose keys are not known yet (any key may commit one).

        A writer's next put then needs no Reserve. Like :meth:`reserve`
        otherwise: a size that finds no room gets gen 0; no quota charge (the
        node leases ahead only to callers without a quota).
        """
        reservation, _, released = self._lease([None] * len(sizes), sizes, timeout_s, owner, None, 0)
        notify(self.on_change, (), released, "DRAM")
        return reservation

    def _lease(
        self, keys: Sequence[BlockKey | None], sizes: Sequence[int], timeout_s: float | None, owner: object,
        charge: LeaseCharge | None, extend: int,
    ) -> tuple[Reservation, list[BlockKey], list[BlockKey]]:
        """:meth:`reserve` up to registering the lease: (what to hand out, the keys that got a slot, evicted keys).

        A None key is a slot leased ahead (:meth:`lease_ahead`).
        """
        named = [k for k in keys if k is not None]
        if named:
            check_keys(named)
        check_batch(keys, sizes)
        sizes = [int(n) for n in sizes]
        for n in sizes:
            self._check_size(n)
        held = [False] * len(keys)
        out_slots, gens = [0] * len(keys), [0] * len(keys)
        todo: list[int] = []
        with self._lock:
            base = self._leases.get(extend) if extend else None
            if extend and (base is None or base.owner != owner or base.charge is not None or charge is not None or
                           (base.deadline is not None and base.deadline < time.monotonic())):
                return Reservation(0, out_slots, gens, held), [], []
            seen: set[BlockKey] = set()
            for i, k in enumerate(keys):
                if k is None:
                    todo.append(i)
                elif self._slot_of(k) is not None:
                    held[i] = True
                elif k not in seen:
                    seen.add(k)
                    todo.append(i)
        slots, released = self._allocate([sizes[i] for i in todo])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lease = Lease(0, deadline, {}, owner, charge)
        with self._lock:
            if base is not None and self._leases.get(extend) is not base:  # ended while we allocated
                base = None
                lease.id = -1  # hands nothing out: the slots below go back at once
            for i, slot in zip(todo, slots):
                if slot is None:
                    continue
                if lease.id < 0:
                    self._give_back(slot)
                    continue
                gens[i] = self.arena.claim(slot, int(self._extent[slot, 0]) * GRANULE)
                out_slots[i] = slot
                lease.slots[slot] = (keys[i], sizes[i])
            self._leased += len(lease.slots)
            reserved = [key for key, _ in lease.slots.values() if key is not None]
            if base is not None:
                base.slots.update(lease.slots)
                lease = base
            elif lease.slots:
                lease.id = self._new_lease_id()
                self._leases[lease.id] = lease  # the last step: from here on the lease ends the charge
        if lease.id < 0:
            return Reservation(0, [0] * len(keys), [0] * len(keys), held), [], released
        return Reservation(lease.id, out_slots, gens, held), reserved, released

    def _take_lease(self, lease_id: int, owner: object) -> Lease | None:
        """Remove and return the live lease ``lease_id`` if ``owner`` owns it; otherwise change nothing."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner != owner:
                return None
            del self._leases[lease_id]
            return lease

    def commit(
        self, lease_id: int, keys: Sequence[BlockKey], slots: Sequence[int], checksums: Sequence[int], *,
        owner: object = None, before_publish: BeforePublish | None = None, keep: bool = False,
    ) -> list[bool]:
        """End ``owner``'s lease: publish the named slots under their keys and ``checksums``; free the rest.

        Per key: True if stored now (or already held); False if the lease is
        unknown, lapsed or not ``owner``'s (then the lease is left as it was),
        or the slot is not the lease's slot for that key. The bytes are not
        hashed here (see the module docstring: readers verify every copy).
        ``before_publish(keys, views, checksums)`` sees the blocks while their
        slots are still the lease's (nothing can evict or reuse them yet:
        write-through copies them to SSD there, which verifies what it takes).
        ``keep``: the lease keeps its slots not named here (its deadline as it
        was) for a later commit. Not for a lease under a quota charge (it ends
        as without ``keep``).
        """
        keys = check_keys(keys)
        check_batch(keys, slots)
        check_batch(keys, checksums)
        lease = self._take_lease(lease_id, owner)
        result = [False] * len(keys)
        if lease is None:
            return result
        if lease.deadline is not None and time.monotonic() > lease.deadline:
            self._end_lease(lease)
            return result
        todo: list[tuple[int, int, int, int]] = []  # (index, slot, size, checksum)
        for i, (k, slot, checksum) in enumerate(zip(keys, slots, checksums)):
            entry = lease.slots.get(int(slot))
            if entry is None or entry[0] not in (k, None):  # None: leased ahead, for any key
                continue
            del lease.slots[int(slot)]  # each slot commits once
            todo.append((i, int(slot), entry[1], int(checksum)))
        keep = keep and lease.charge is None
        good = todo
        if before_publish is not None and good:
            views = [self.arena.block(slot, size) for _, slot, size, _ in good]
            before_publish([keys[i] for i, *_ in good], views, [checksum for *_, checksum in good])
            del views
        added: list[BlockMeta] = []
        with self._lock:
            for i, slot, size, checksum in good:
                key = keys[i]
                if self._slot_of(key) is not None:  # another writer stored it meanwhile
                    self._give_back(slot)
                else:
                    self._publish(slot, key, size, checksum)
                    added.append(BlockMeta(key, size, checksum))
            self._leased -= len(good)
            self._stats.puts += len(added)
            self._stats.bytes_in += sum(m.size for m in added)
            if keep:
                if lease.slots:
                    self._leases[lease.id] = lease  # the rest stays leased, as it was
        if not keep:
            self._free_lease(lease)
        notify(self.on_change, added, (), "DRAM")
        if lease.charge is not None:  # after the listeners counted the blocks as held: never undercharged
            lease.charge.end()
        stored = {keys[i] for i, *_ in good}
        return [k in stored for k in keys]  # a key named twice shares the fate of its slot

    def release(self, lease_id: int, *, owner: object = None) -> int:
        """Give ``owner``'s lease's slots back without publishing anything; returns how many (0: not its lease)."""
        lease = self._take_lease(lease_id, owner)
        return 0 if lease is None else self._end_lease(lease)

    def expire(self, now: float | None = None) -> int:
        """Release every lease past its deadline (the node's reaper calls this); returns slots freed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            lapsed = [lid for lid, lease in self._leases.items() if lease.deadline is not None and lease.deadline < now]
            leases = [self._leases.pop(lid) for lid in lapsed]
        return sum(self._end_lease(lease) for lease in leases)

    def _free_lease(self, lease: Lease) -> int:
        """Free the slots still in ``lease`` (already out of ``_leases``); they are claimed (odd) and unpublished."""
        with self._lock:
            n = len(lease.slots)
            for slot in lease.slots:
                self._give_back(slot)
            self._leased -= n
            lease.slots.clear()
        return n

    def _end_lease(self, lease: Lease) -> int:
        """Free a lease that publishes nothing (already out of ``_leases``), then end its charge."""
        n = self._free_lease(lease)
        if lease.charge is not None:
            lease.charge.end()
        return n

    @property
    def leased_slots(self) -> int:
        """Slots held by leases now."""
        with self._lock:
            return self._leased

    # -- removal and introspection ---------------------------------------------------

    def remove(self, keys: Sequence[BlockKey]) -> int:
        keys = check_keys(keys)
        gone: list[BlockKey] = []
        with self._lock:
            for k in keys:
                slot = self._blocks.pop(k, None)
                if slot is not None:
                    self._lru_gen[slot] = 0
                    self._unpublish(slot)
                    self._give_back(slot)
                    gone.append(k)
        notify(self.on_change, (), gone, "DRAM")
        return len(gone)

    def _by_recency(self) -> list[tuple[BlockKey, int]]:
        """Under the lock: (key, slot) of every block held, being-demoted ones included, least recently read first."""
        held = [*self._demoting.items(), *self._blocks.items()]
        stamps = self.arena.stamps[np.fromiter((s for _, s in held), dtype=np.int64, count=len(held))]
        return [held[i] for i in np.argsort(stamps, kind="stable").tolist()]

    def keys(self) -> list[BlockKey]:
        """Committed keys, least recently used first."""
        with self._lock:
            return [k for k, _ in self._by_recency() if k in self._blocks]

    def inventory(self) -> list[BlockMeta]:
        """Every block held (being-demoted ones included, as ``contains`` counts them), LRU first."""
        with self._lock:
            held = self._by_recency()
            slots = np.fromiter((s for _, s in held), dtype=np.int64, count=len(held))
            lengths = self.arena.table["length"][slots].tolist()
            sums = self.arena.table["checksum"][slots].tolist()
        return [BlockMeta(k, n, c) for (k, _), n, c in zip(held, lengths, sums)]

    def usage(self) -> tuple[int, int, int]:
        """(bytes in extents of held and leased blocks, free bytes, the longest free extent in bytes)."""
        with self._lock:
            return self._used * GRANULE, self._alloc.free_units * GRANULE, self._alloc.largest_free() * GRANULE

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            blocks = len(self._blocks) + len(self._demoting)
            used = self._held_bytes
            return TierStats(
                Tier.DRAM, s.capacity_bytes, used, blocks, s.hits, s.misses, s.puts,
                s.bytes_in, s.bytes_out, s.evictions, s.corrupt,
            )

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._demoting.clear()
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            if lease.charge is not None:
                lease.charge.end()
        self.arena.close()
