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
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvpool.buffers import BufferLike, as_array
from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey, check_keys
from kvpool.tiers.arena import SharedArena, SlotRef
from kvpool.tiers.base import BlockMeta, ChangeListener, EvictionSink, Tier, TierStats, check_batch, notify

log = logging.getLogger(__name__)


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
        self._stats = TierStats(Tier.DRAM, capacity_bytes=arena.num_slots * arena.slot_bytes)

    @classmethod
    def create(cls, name: str, capacity_bytes: int, slot_bytes: int, **kwargs: object) -> "DramStore":
        """A store over a new arena of ``capacity_bytes // slot_bytes`` slots."""
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"DRAM capacity {capacity_bytes} B holds no {slot_bytes} B slot")
        return cls(SharedArena.create(name, num_slots, slot_bytes), **kwargs)  # type: ignore[arg-type]

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
            ok = ref is not None and ref.length == dst.size
            ok = ok and self.arena.read_into(ref, key, dst, verify=self.verify_reads)  # type: ignore[arg-type]
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
        used = len(self._lru) + len(self._demoting)
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
        self.arena.close()
