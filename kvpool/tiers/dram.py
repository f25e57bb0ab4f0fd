"""DRAM tier: the owner's index, LRU and watermarks over a :class:`SharedArena`.

Invariants:
- ``_lru`` maps every committed key to its slot, least recently *read or
  written* first. ``contains`` and ``locate`` do not change the order.
- A key becomes visible (in ``_lru`` and as an even slot gen) only after its
  bytes and checksum are in the slot.
- Eviction takes blocks from the LRU head. While a victim is being demoted
  (handed to the eviction sink, e.g. the SSD tier) it stays readable; its
  slot is released only after the sink returns, so a block is never absent
  from both tiers while it moves down.
- When a put would take usage above the high watermark, blocks are evicted
  (in LRU order, inline, by the putting thread) until usage is at the low
  watermark with room for the new blocks.
- ``_lock`` guards the index only; data copies and the sink run outside it.
- ``on_change`` hears of every change to the key set (committed puts as
  added, released victims and removes as removed), after the change and
  outside the lock.

Leases (same-host writers, :meth:`DramStore.reserve` / :meth:`DramStore.commit`):
- ``reserve`` takes free slots exactly as ``put`` does (evicting LRU blocks
  past the high watermark) and hands each to the lease with a fresh odd gen
  (:meth:`SharedArena.claim`): unreadable, owned by the lease, counted as used.
- A lease id is 63 random bits (:mod:`secrets`), never 0 and never the id of
  another live lease, so it cannot be guessed from one's own. A lease belongs
  to the ``owner`` that reserved it (the node passes the caller's identity;
  None with auth off, where the unguessable id is the only capability).
- ``commit`` ends the lease: each named slot whose bytes match the claimed
  checksum is published like a put (key visible only once bytes and checksum
  are in place); the lease's other slots go back to the free list. A lease
  past its deadline commits nothing.
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

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

from kvpool.buffers import BufferLike, as_array
from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey, check_keys
from kvpool.tiers.arena import SharedArena, SlotRef
from kvpool.tiers.base import BlockMeta, ChangeListener, EvictionSink, Tier, TierStats, check_batch, notify

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

log = logging.getLogger(__name__)


LEASE_ID_BITS = 63  # fits the wire's uint64 and any signed 64-bit integer


class StoreOptions(TypedDict, total=False):
    """The keyword arguments of :class:`DramStore` (for :meth:`DramStore.create`)."""

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
    """Free slots handed to one writer until ``deadline`` (``time.monotonic``; None: no deadline)."""

    id: int
    deadline: float | None
    slots: dict[int, tuple[BlockKey, int]]  # slot -> (key, size) it was reserved for
    owner: object = None  # who may commit or release it (compared with ==)
    charge: LeaseCharge | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Reservation:
    """What :meth:`DramStore.reserve` handed out, per key in request order."""

    lease: int  # 0: no slot reserved
    slots: list[int]  # the slot to write (0 where gens[i] == 0)
    gens: list[int]  # its odd gen (the writer's turn); 0: no slot
    held: list[bool]  # the store already holds the key (nothing to write)


class DramStore:
    """The DRAM tier of one pool node (owner side of the arena)."""

    tier = Tier.DRAM

    def __init__(
        self,
        arena: SharedArena,
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        on_evict: EvictionSink | None = None,
        on_change: ChangeListener | None = None,
        verify_reads: bool = True,
    ):
        if not arena.owner:
            raise ValueError("DramStore needs the arena's owner mapping (SharedArena.create)")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"need 0 < low <= high <= 1, got low={low_watermark} high={high_watermark}")
        self.arena = arena
        self.on_evict = on_evict
        self.on_change = on_change
        self.verify_reads = verify_reads
        self._high = max(1, int(arena.num_slots * high_watermark))
        self._low = min(self._high, max(0, int(arena.num_slots * low_watermark)))
        self._lock = threading.Lock()
        self._lru: OrderedDict[BlockKey, int] = OrderedDict()
        self._demoting: dict[BlockKey, int] = {}
        self._free: list[int] = list(range(arena.num_slots - 1, -1, -1))
        self._leases: dict[int, Lease] = {}
        self._leased = 0  # slots held by leases
        self._stats = TierStats(Tier.DRAM, capacity_bytes=arena.num_slots * arena.slot_bytes)

    @classmethod
    def create(cls, name: str, capacity_bytes: int, slot_bytes: int, *, mode: int = 0o600,
               **kwargs: Unpack[StoreOptions]) -> DramStore:
        """A store over a new arena of ``capacity_bytes // slot_bytes`` slots (segment permissions ``mode``).

        A refused argument leaves no arena behind.
        """
        if slot_bytes < 1 or capacity_bytes // slot_bytes < 1:
            raise ValueError(f"DRAM capacity {capacity_bytes} B holds no {slot_bytes} B slot")
        arena = SharedArena.create(name, capacity_bytes // slot_bytes, slot_bytes, mode)
        try:
            return cls(arena, **kwargs)
        except BaseException:
            arena.close()
            raise

    @property
    def slot_bytes(self) -> int:
        return self.arena.slot_bytes

    # -- reads -------------------------------------------------------------------

    def _slot_of(self, key: BlockKey) -> int | None:
        slot = self._lru.get(key)
        return self._demoting.get(key) if slot is None else slot

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = check_keys(keys)
        with self._lock:
            return [self._slot_of(k) is not None for k in keys]

    def locate(self, keys: Sequence[BlockKey]) -> list[SlotRef | None]:
        """Where each key's bytes are now, for a same-host reader (does not change recency)."""
        keys = check_keys(keys)
        with self._lock:
            slots = [self._slot_of(k) for k in keys]
            return [None if s is None else self.arena.ref(s) for s in slots]

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[bool]:
        keys = check_keys(keys)
        check_batch(keys, outs)
        dsts = [as_array(o, writable=True) for o in outs]
        with self._lock:
            refs: list[SlotRef | None] = []
            for k in keys:
                slot = self._slot_of(k)
                if slot is not None and k in self._lru:
                    self._lru.move_to_end(k)
                refs.append(None if slot is None else self.arena.ref(slot))
        hits = []
        for key, ref, dst in zip(keys, refs, dsts):
            ok = (ref is not None and ref.length == dst.size
                  and self.arena.read_into(ref, key, dst, verify=self.verify_reads))
            hits.append(ok)
        n_hit = sum(hits)
        with self._lock:
            self._stats.hits += n_hit
            self._stats.misses += len(hits) - n_hit
            self._stats.bytes_out += sum(d.size for d, h in zip(dsts, hits) if h)
        return hits

    # -- writes ------------------------------------------------------------------

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
            if src.size > self.arena.slot_bytes:
                raise ValueError(f"block of {src.size} B exceeds the DRAM slot size {self.arena.slot_bytes} B")
        if checksums is not None:
            check_batch(keys, checksums)
        sums = [block_checksum(s) for s in srcs] if checksums is None else [int(c) for c in checksums]

        result = [False] * len(keys)
        todo: list[int] = []
        with self._lock:
            seen: set[BlockKey] = set()
            for i, k in enumerate(keys):
                if self._slot_of(k) is not None:
                    if k in self._lru:
                        self._lru.move_to_end(k)
                    result[i] = True
                elif k not in seen:
                    seen.add(k)
                    todo.append(i)
            slots, victims = self._reserve(len(todo))
        released: list[BlockKey] = []
        if victims:
            more, released = self._demote(victims, need=len(todo) - len(slots))
            slots += more

        with self._lock:
            for slot in slots:
                self.arena.claim(slot)
        stored: set[BlockKey] = set()
        added: list[BlockMeta] = []
        written = 0
        for i, slot in zip(todo, slots):
            np.copyto(self.arena.data[slot, : srcs[i].size], srcs[i])
        with self._lock:
            for i, slot in zip(todo, slots):
                key = keys[i]
                if self._slot_of(key) is not None:  # a concurrent put won the race
                    self._free.append(slot)
                else:
                    self.arena.commit(slot, key, srcs[i].size, sums[i])
                    self._lru[key] = slot
                    stored.add(key)
                    added.append(BlockMeta(key, srcs[i].size, sums[i]))
                    written += srcs[i].size
            self._stats.puts += len(stored)
            self._stats.bytes_in += written
        notify(self.on_change, added, released, "DRAM")
        # Keys that found no slot stay False (no room); repeats of a key in the batch share its fate.
        return [r or k in stored for r, k in zip(result, keys)]

    def _reserve(self, n: int) -> tuple[list[int], list[tuple[BlockKey, int]]]:
        """Under the lock: take up to ``n`` free slots and pick LRU victims for the rest.

        Victims move from ``_lru`` to ``_demoting`` (still readable).
        """
        used = len(self._lru) + len(self._demoting) + self._leased
        evict = 0
        if used + n > self._high:
            evict = used + n - min(self._high, max(self._low, n))
        evict = max(evict, n - len(self._free))
        victims = []
        while evict > 0 and self._lru:
            key, slot = self._lru.popitem(last=False)
            self._demoting[key] = slot
            victims.append((key, slot))
            evict -= 1
        take = min(n, len(self._free))
        slots = [self._free.pop() for _ in range(take)]
        return slots, victims

    def _demote(self, victims: list[tuple[BlockKey, int]], need: int) -> tuple[list[int], list[BlockKey]]:
        """Hand victims to the sink, then release them; returns up to ``need`` freed slots and the released keys."""
        if self.on_evict is not None:
            keys = [k for k, _ in victims]
            views = [self.arena.slot_view(s, int(self.arena.table["length"][s])) for _, s in victims]
            sums = [int(self.arena.table["checksum"][s]) for _, s in victims]
            try:
                self.on_evict(keys, views, sums)
            except Exception:  # a failed demotion drops the blocks: a later miss, not an error
                log.exception("DRAM: demoting %d blocks failed; dropping them", len(keys))
            del views
        with self._lock:
            freed = []
            released = []
            for key, slot in victims:
                if self._demoting.pop(key, None) == slot:
                    self.arena.release(slot)
                    freed.append(slot)
                    released.append(key)
            self._stats.evictions += len(victims)
            mine, spare = freed[:need], freed[need:]
            self._free.extend(spare)
        return mine, released

    # -- leases (same-host writers) -----------------------------------------------------

    def _new_lease_id(self) -> int:
        """Under the lock: a random id that is neither 0 nor a live lease's."""
        while True:
            lease_id = secrets.randbits(LEASE_ID_BITS)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def reserve(
        self, keys: Sequence[BlockKey], sizes: Sequence[int], timeout_s: float | None, *, owner: object = None,
        charge: LeaseCharge | None = None,
    ) -> Reservation:
        """Lease free slots for blocks of ``sizes`` to ``owner`` (see the module docstring).

        Per key: a slot and its odd gen, or gen 0 if the key is held already
        (``held``), repeats an earlier key of the batch, or found no room.
        ``timeout_s`` None: the lease lasts until committed or released.
        ``charge`` (already charged for ``keys``) is narrowed to the keys that
        got a slot, and ends with the lease (at once if no slot was reserved).
        """
        try:
            reservation, reserved, released = self._lease(keys, sizes, timeout_s, owner, charge)
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

    def _lease(
        self, keys: Sequence[BlockKey], sizes: Sequence[int], timeout_s: float | None, owner: object,
        charge: LeaseCharge | None,
    ) -> tuple[Reservation, list[BlockKey], list[BlockKey]]:
        """:meth:`reserve` up to registering the lease: (what to hand out, the keys that got a slot, evicted keys)."""
        keys = check_keys(keys)
        check_batch(keys, sizes)
        sizes = [int(n) for n in sizes]
        for n in sizes:
            if not 0 < n <= self.arena.slot_bytes:
                raise ValueError(f"cannot reserve a {n}-byte block: DRAM slots hold 1..{self.arena.slot_bytes} B")
        held = [False] * len(keys)
        todo: list[int] = []
        with self._lock:
            seen: set[BlockKey] = set()
            for i, k in enumerate(keys):
                if self._slot_of(k) is not None:
                    held[i] = True
                elif k not in seen:
                    seen.add(k)
                    todo.append(i)
            slots, victims = self._reserve(len(todo))
            self._leased += len(slots)  # used from now on, so concurrent puts evict for them
        released: list[BlockKey] = []
        more: list[int] = []
        if victims:
            more, released = self._demote(victims, need=len(todo) - len(slots))
            slots += more
        out_slots, gens = [0] * len(keys), [0] * len(keys)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lease = Lease(0, deadline, {}, owner, charge)
        with self._lock:
            self._leased += len(more)
            for i, slot in zip(todo, slots):
                gens[i] = self.arena.claim(slot)
                out_slots[i] = slot
                lease.slots[slot] = (keys[i], sizes[i])
            if lease.slots:
                lease.id = self._new_lease_id()
                self._leases[lease.id] = lease  # the last step: from here on the lease ends the charge
            reserved = [key for key, _ in lease.slots.values()]
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
        owner: object = None,
    ) -> list[bool]:
        """End ``owner``'s lease: publish the named slots whose bytes match ``checksums``; free the rest.

        Per key: True if stored now (or already held); False if the lease is
        unknown, lapsed or not ``owner``'s (then the lease is left as it was),
        the slot is not the lease's slot for that key, or the bytes do not
        match the checksum.
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
            if entry is None or entry[0] != k:
                continue
            del lease.slots[int(slot)]  # each slot commits once
            todo.append((i, int(slot), entry[1], int(checksum)))
        good: list[tuple[int, int, int, int]] = []
        for item in todo:  # verify outside the lock: the slots are ours until published
            i, slot, size, checksum = item
            if block_checksum(self.arena.data[slot, :size]) == checksum:
                good.append(item)
            else:
                lease.slots[slot] = (keys[i], size)  # refused: freed with the rest below
        added: list[BlockMeta] = []
        with self._lock:
            for i, slot, size, checksum in good:
                key = keys[i]
                if self._slot_of(key) is not None:  # another writer stored it meanwhile
                    self._free.append(slot)
                else:
                    self.arena.commit(slot, key, size, checksum)
                    self._lru[key] = slot
                    added.append(BlockMeta(key, size, checksum))
            self._leased -= len(good)
            self._stats.puts += len(added)
            self._stats.bytes_in += sum(m.size for m in added)
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
        """Return the slots still in ``lease`` (already out of ``_leases``) to the free list."""
        with self._lock:
            n = len(lease.slots)
            self._free.extend(lease.slots)
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

    # -- reads for a sender (the bulk listener) ----------------------------------------

    def refs_for_read(self, keys: Sequence[BlockKey]) -> list[tuple[SlotRef, int] | None]:
        """Per key (ref, checksum) of its DRAM copy now, refreshing recency like a read; None if absent.

        The caller sends the slot's bytes itself, re-checks the gen afterwards
        and reports what it sent with :meth:`record_reads`.
        """
        keys = check_keys(keys)
        out: list[tuple[SlotRef, int] | None] = []
        with self._lock:
            for k in keys:
                slot = self._slot_of(k)
                ref = None if slot is None else self.arena.ref(slot)
                if ref is None:
                    out.append(None)
                    continue
                if k in self._lru:
                    self._lru.move_to_end(k)
                out.append((ref, int(self.arena.table["checksum"][slot])))
        return out

    def record_reads(self, hits: int, misses: int, bytes_out: int) -> None:
        """Count reads served outside :meth:`get_into` (see :meth:`refs_for_read`)."""
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.bytes_out += bytes_out

    def remove(self, keys: Sequence[BlockKey]) -> int:
        keys = check_keys(keys)
        gone: list[BlockKey] = []
        with self._lock:
            for k in keys:
                slot = self._lru.pop(k, None)
                if slot is not None:
                    self.arena.release(slot)
                    self._free.append(slot)
                    gone.append(k)
        notify(self.on_change, (), gone, "DRAM")
        return len(gone)

    # -- introspection -------------------------------------------------------------

    def keys(self) -> list[BlockKey]:
        """Committed keys, least recently used first."""
        with self._lock:
            return list(self._lru)

    def inventory(self) -> list[BlockMeta]:
        """Every block held (being-demoted ones included, as ``contains`` counts them), LRU first."""
        with self._lock:
            held = [*self._demoting.items(), *self._lru.items()]
            slots = np.fromiter((s for _, s in held), dtype=np.int64, count=len(held))
            lengths = self.arena.table["length"][slots].tolist()
            sums = self.arena.table["checksum"][slots].tolist()
        return [BlockMeta(k, n, c) for (k, _), n, c in zip(held, lengths, sums)]

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            blocks = len(self._lru) + len(self._demoting)
            used = int(self.arena.table["length"].sum())
            return TierStats(
                Tier.DRAM, s.capacity_bytes, used, blocks, s.hits, s.misses, s.puts,
                s.bytes_in, s.bytes_out, s.evictions, s.corrupt,
            )

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
            self._demoting.clear()
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            if lease.charge is not None:
                lease.charge.end()
        self.arena.close()
