"""A pool node's two tiers together: DRAM in front, SSD behind.

NodeStore holds its two tiers as what they are (a DramStore, an optional
SsdStore), not as a list of generic tiers: every step below needs what only
one of them has (see :mod:`kvpool.tiers.base` for why there is no tier
protocol). It hides the DRAM arena from the node: what the transports need
of it (the arena's name, a row's bytes, the seqlock's second look) are
methods here, reached through :class:`kvpool.node.core.NodeCore`.

Invariants:
- Reads try DRAM, then SSD. An SSD hit is promoted back into DRAM (which may
  in turn demote DRAM's least recently used blocks).
- Write-back (default): blocks reach SSD only when DRAM evicts them; every
  eviction is a demotion, in DRAM's LRU order.
- Write-through: every put goes to DRAM and SSD; DRAM evictions then simply
  drop (SSD already has the block, unless SSD's own LRU evicted it).
- The tiers are inclusive after a promotion: the SSD copy stays until SSD's
  LRU evicts it, so demoting that block again costs no write.
- A block larger than DRAM's ``max_block_bytes`` lives on SSD only: puts send it
  straight there and SSD hits on it are not promoted. Without an SSD tier it
  is a ValueError, as in DramStore.
- ``on_demote(n)`` / ``on_promote(n)`` (optional) count blocks that actually
  moved: demoted blocks SSD stored, promoted blocks DRAM stored.
- With ``demote_queue_bytes`` > 0, demotion runs in the background
  (:mod:`kvpool.tiers.demotion`): eviction copies the victims out and
  returns; a block being demoted is served, and reported, as on SSD.
  ``flush_demotions`` waits for the queue.
- The arena publishes everything the node holds for same-host readers (its
  inventory table, :mod:`kvpool.tiers.arena`: per key the best tier, size
  and checksum): NodeStore is both stores' ``on_change`` and, after every
  change, makes the table agree with :meth:`where_meta` for the keys that
  changed (DRAM, then SSD blocks plus pending demotions), under one lock, so
  the last look at a key comes after its last change and the table ends up
  true. A demoted block is on SSD (pending) before its DRAM row is released
  (the eviction sink reports it first), so a reader never finds it in
  neither. The table is filled from the SSD inventory that survived a
  restart before it is declared ``COMPLETE``; a key it had no room for makes
  it ``INCOMPLETE`` for the arena's life. Listeners of changes (the master
  link, the quota ledger) go in :attr:`NodeStore.dram_listener` and
  :attr:`NodeStore.ssd_listener` (whatever was a store's ``on_change`` before
  is kept there): NodeStore calls them after updating the table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.buffers import BufferLike, ScratchPool, byte_view
from kvpool.checksum import copy_with_checksum
from kvpool.keys import BlockKey, check_keys
from kvpool.tiers.arena import SlotRef
from kvpool.tiers.base import ChangeListener, check_batch
from kvpool.tiers.demotion import DemotionQueue
from kvpool.tiers.dram import DramStore
from kvpool.tiers.ssd import HEADER_BYTES, SsdStore
from kvpool.vocabulary import BlockMeta, Tier, TierStats

log = logging.getLogger(__name__)

SCRATCH_POOL_BYTES = 64 << 20  # idle temporaries kept warm for promotions and SSD reads


class NodeStore:
    """DRAM + optional SSD of one node, with demotion and promotion between them."""

    def __init__(
        self,
        dram: DramStore,
        ssd: SsdStore | None = None,
        *,
        write_through: bool = False,
        promote: bool = True,
        on_demote: Callable[[int], None] | None = None,
        on_promote: Callable[[int], None] | None = None,
        demote_queue_bytes: int = 0,
    ):
        self.dram = dram
        self.ssd = ssd
        self.write_through = write_through and ssd is not None
        self.promote = promote
        self.on_demote = on_demote
        self.on_promote = on_promote
        self.demotions: DemotionQueue | None = None
        self.scratch = ScratchPool(SCRATCH_POOL_BYTES)  # for callers that read SSD blocks through a temporary
        if ssd is not None and not self.write_through:
            if demote_queue_bytes > 0:
                self.demotions = DemotionQueue(ssd, demote_queue_bytes, on_demote)
                dram.on_evict = self.demotions.submit
            else:
                dram.on_evict = self._demote
        self._inventory_lock = threading.Lock()  # one writer of the arena's inventory table at a time
        self.dram_listener: ChangeListener | None = None  # hear the tiers' changes after the inventory took them
        self.ssd_listener: ChangeListener | None = None
        self.dram_listener, dram.on_change = dram.on_change, self._dram_changed
        self._publish(dram.keys())
        if ssd is not None:
            self.ssd_listener, ssd.on_change = ssd.on_change, self._ssd_changed
            self._publish(ssd.keys())  # what survived a restart
        dram.arena.declare_inventory()

    def _dram_changed(self, added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
        """DRAM's ``on_change``: the arena's inventory takes the change, then ``dram_listener`` hears it."""
        self._changed(added, removed)
        if self.dram_listener is not None:
            self.dram_listener(added, removed)

    def _ssd_changed(self, added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
        """SSD's ``on_change`` (the demotion queue's too): as :meth:`_dram_changed`, then ``ssd_listener``."""
        self._changed(added, removed)
        if self.ssd_listener is not None:
            self.ssd_listener(added, removed)

    def _changed(self, added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
        try:
            self._publish(list(dict.fromkeys([*(m.key for m in added), *removed])))
        except Exception:  # the table may be wrong now: readers must ask the master
            log.exception("node store: updating the arena's inventory failed; published as incomplete")
            self.dram.arena.inventory_lost()

    def _publish(self, keys: Sequence[BlockKey]) -> None:
        """Make the inventory say, for each of ``keys``, where the node holds it now (see the module docstring)."""
        if not keys:
            return
        arena = self.dram.arena
        with self._inventory_lock:  # the look and the update together: the last look wins
            for key, found in zip(keys, self.where_meta(keys)):
                if found is None:
                    arena.inventory_discard(key)
                else:
                    arena.inventory_put(key, found[0], found[1].size, found[1].checksum)

    def where_meta(self, keys: Sequence[BlockKey]) -> list[tuple[Tier, BlockMeta] | None]:
        """Per key the fastest tier holding it (a pending demotion counts as SSD) with its size and checksum."""
        found: list[tuple[Tier, BlockMeta] | None] = [
            None if r is None else (Tier.DRAM, BlockMeta(k, r.length, r.checksum))
            for k, r in zip(keys, self.dram.locate(keys))]
        lower = [i for i, f in enumerate(found) if f is None]
        if lower and self.ssd is not None:
            for i, meta in zip(lower, self.ssd_meta([keys[i] for i in lower])):
                if meta is not None:
                    found[i] = (Tier.SSD, meta)
        return found

    def _demote(self, keys: Sequence[BlockKey], views: Sequence[memoryview], checksums: Sequence[int]) -> None:
        assert self.ssd is not None, "tiered: demotion without an SSD tier"
        moved = sum(self.ssd.put(keys, views, checksums))
        if self.on_demote is not None and moved:
            self.on_demote(moved)

    def fits_dram(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` can live in DRAM (else it lives on SSD only)."""
        return nbytes <= self.dram.max_block_bytes

    def check_fits(self, sizes: Sequence[int]) -> None:
        """ValueError for a block of 0 bytes or one no tier takes (DRAM's largest, else what SSD takes)."""
        for i, n in enumerate(sizes):
            if n == 0:
                raise ValueError(f"block {i} is empty (a block of 0 bytes)")
            if not self.fits_dram(n) and (self.ssd is None or not self.ssd.fits(n)):
                where = "an SSD tier (the node has none)" if self.ssd is None else f"SSD store {self.ssd.path}"
                raise ValueError(f"a {n}-byte block fits neither DRAM (at most {self.dram.max_block_bytes} B) "
                                 f"nor {where}")

    # -- the DRAM arena, for the node's transports (through NodeCore) ----------------------------------

    @property
    def arena_name(self) -> str:
        """The shared-memory segment same-host readers and writers attach to."""
        return self.dram.arena.name

    @property
    def dram_bytes(self) -> int:
        """The bytes of DRAM's data region (what every block and leased slot share)."""
        return self.dram.arena.data_bytes

    def block_bytes(self, slot: int, length: int) -> np.ndarray:
        """The first ``length`` bytes of DRAM row ``slot``'s extent, as a view (no copy).

        Valid to read only while :meth:`unchanged` says the row is still the
        block whose (slot, gen) the caller read (the seqlock: gen, bytes, gen
        again); written only under a lease the caller holds.
        """
        return self.dram.arena.block(slot, length)

    def unchanged(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Per (slot, gen): whether the DRAM row is still that block (not reused since the gen was read)."""
        return self.dram.arena.unchanged(slots, gens)

    def populate_dram(self, stop: threading.Event | None = None) -> bool:
        """Map every page of the DRAM arena now, off the data path (see SharedArena.populate)."""
        return self.dram.arena.populate(stop)

    def max_block_bytes(self) -> int:
        """The largest block this node stores at all: DRAM's largest, or the largest value SSD takes."""
        if self.ssd is None:
            return self.dram.max_block_bytes
        ssd = self.ssd
        largest = min(ssd.max_value_bytes, (ssd.capacity_bytes // ssd.page_size - 1) * ssd.page_size - HEADER_BYTES)
        return max(self.dram.max_block_bytes, largest)

    def locate(self, keys: Sequence[BlockKey], *, promote: bool) -> list[SlotRef | None]:
        """Where each key's DRAM copy is; ``promote``: for a reader about to read them all.

        Without ``promote`` this is a look: no recency changes. With it, the
        keys in DRAM are stamped read, then SSD blocks that fit DRAM are
        brought in (and stamped): the evictions those promotions cause take
        other blocks first, so a request's own reads do not evict the blocks
        it is about to read.
        """
        keys = check_keys(keys)
        refs = self.dram.locate(keys, touch=promote)
        missing = [i for i, r in enumerate(refs) if r is None]
        if promote and self.promote and self.ssd is not None and missing and self._promote([keys[i] for i in missing]):
            for i, ref in zip(missing, self.dram.locate([keys[i] for i in missing], touch=True)):
                refs[i] = ref
        return refs

    def _promote(self, keys: Sequence[BlockKey]) -> bool:
        """Bring those of ``keys`` that are on SSD only and fit DRAM into DRAM; whether any was tried."""
        unique = list(dict.fromkeys(keys))
        metas = self.ssd_meta(unique)
        todo = [(k, m.size) for k, m in zip(unique, metas) if m is not None and self.fits_dram(m.size)]
        if not todo:
            return False
        scratch = self.scratch.take(sum(n for _, n in todo))
        try:
            outs, offset = [], 0
            for _, n in todo:
                outs.append(scratch[offset : offset + n])
                offset += n
            self.get_into([k for k, _ in todo], outs)
        finally:
            self.scratch.give(scratch)
        return True

    def where(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        """The fastest tier holding each key (no recency change)."""
        keys = check_keys(keys)
        found: list[Tier | None] = [Tier.DRAM if hit else None for hit in self.dram.contains(keys)]
        missing = [i for i, t in enumerate(found) if t is None]
        if self.ssd is not None and missing:
            for i, hit in zip(missing, self.ssd_inventory().contains([keys[i] for i in missing])):
                if hit:
                    found[i] = Tier.SSD
        return found

    def ssd_meta(self, keys: Sequence[BlockKey]) -> list[BlockMeta | None]:
        """Size and checksum of each key on SSD or on its way there (None: neither)."""
        assert self.ssd is not None, "tiered: no SSD tier"
        # Pending first: a write that lands in between is then seen on SSD (never in neither).
        pending = [self.demotions.get(k) for k in keys] if self.demotions is not None else [None] * len(keys)
        metas = self.ssd.meta(keys)
        for i, (key, entry) in enumerate(zip(keys, pending)):
            if metas[i] is None and entry is not None:
                metas[i] = BlockMeta(key, entry[0].nbytes, entry[1])
        return metas

    def ssd_inventory(self) -> SsdInventory:
        """The SSD tier as the master must see it: stored blocks plus blocks on their way there."""
        assert self.ssd is not None, "tiered: no SSD tier"
        return SsdInventory(self.ssd, self.demotions)

    def flush_demotions(self, timeout: float | None = None) -> bool:
        """Wait until background demotions are on SSD (True at once when demotion is inline)."""
        return self.demotions.flush(timeout) if self.demotions is not None else True

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[Tier | None]:
        """Fill ``outs``; per key, the tier that served it, or None for a miss."""
        keys = check_keys(keys)
        check_batch(keys, outs)
        served: list[Tier | None] = [Tier.DRAM if hit else None for hit in self.dram.get_into(keys, outs)]
        missing = [i for i, t in enumerate(served) if t is None]
        if self.ssd is None or not missing:
            return served
        miss_keys = [keys[i] for i in missing]
        miss_outs = [outs[i] for i in missing]
        # Pending demotions first (their bytes stay ours even if the write lands meanwhile), then SSD.
        pending = [self.demotions.get(k) for k in miss_keys] if self.demotions is not None else []
        ssd_hits = self.ssd.get_into(miss_keys, miss_outs)
        for j, (entry, out) in enumerate(zip(pending, miss_outs)):
            if not ssd_hits[j] and entry is not None and entry[0].nbytes == byte_view(out).nbytes:
                # the buffer is recycled once written: only a copy that matches its checksum counts
                dst = np.frombuffer(byte_view(out, writable=True), dtype=np.uint8)
                ssd_hits[j] = copy_with_checksum(dst, entry[0]) == entry[1]
        promote_keys, promote_vals = [], []
        for i, key, out, hit in zip(missing, miss_keys, miss_outs, ssd_hits):
            if hit:
                served[i] = Tier.SSD
                if self.fits_dram(byte_view(out).nbytes):
                    promote_keys.append(key)
                    promote_vals.append(out)
        if self.promote and promote_keys:
            moved = sum(self.dram.put(promote_keys, promote_vals))
            if self.on_promote is not None and moved:
                self.on_promote(moved)
        return served

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Store blocks in DRAM (and SSD with write-through); a block DRAM has no room for goes to SSD."""
        keys = check_keys(keys)
        check_batch(keys, values)
        if self.ssd is None:
            return self.dram.put(keys, values)
        views = [byte_view(v) for v in values]
        self.check_fits([v.nbytes for v in views])  # before any write: bad input changes nothing
        small = [i for i, v in enumerate(views) if self.fits_dram(v.nbytes)]  # the rest go to SSD only
        stored = [False] * len(keys)
        for i, ok in zip(small, self.dram.put([keys[i] for i in small], [views[i] for i in small])):
            stored[i] = ok
        if self.write_through:
            on_ssd = self.ssd.put(keys, values)
            return [a or b for a, b in zip(stored, on_ssd)]
        left = [i for i, ok in enumerate(stored) if not ok]
        if left:
            for i, ok in zip(left, self.ssd.put([keys[i] for i in left], [values[i] for i in left])):
                stored[i] = ok
        return stored

    def commit(
        self, lease: int, keys: Sequence[BlockKey], slots: Sequence[int], checksums: Sequence[int], *,
        owner: object = None, keep: bool = False,
    ) -> list[bool]:
        """Publish ``owner``'s DRAM lease (:meth:`DramStore.commit`); with write-through, SSD gets its blocks too,
        copied while the slots are still leased (once published, a concurrent put may evict and reuse a slot
        between SSD's verify and its copy)."""
        ssd = self.ssd if self.write_through else None
        return self.dram.commit(lease, keys, slots, checksums, owner=owner, keep=keep,
                                before_publish=None if ssd is None else ssd.put)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop keys from every tier; returns how many (key, tier) copies went."""
        keys = check_keys(keys)
        removed = self.dram.remove(keys)
        if self.demotions is not None:
            removed += self.demotions.cancel(keys)
        if self.ssd is not None:
            removed += self.ssd.remove(keys)
        return removed

    def stats(self) -> list[TierStats]:
        out = [self.dram.stats()]
        if self.ssd is not None:
            out.append(self.ssd.stats())
        return out

    def close(self) -> None:
        """Close DRAM (no more evictions), write pending demotions, close SSD."""
        self.dram.close()
        if self.demotions is not None:
            self.demotions.close()
        if self.ssd is not None:
            self.ssd.close()


class SsdInventory:
    """An SSD store plus its pending demotions, as one inventory (what a node reports to the master)."""

    def __init__(self, ssd: SsdStore, demotions: DemotionQueue | None):
        self.ssd = ssd
        self.demotions = demotions

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        if self.demotions is None:
            return self.ssd.contains(keys)
        pending = self.demotions.contains(keys)  # first: a write landing in between is then seen on SSD
        return [a or b for a, b in zip(pending, self.ssd.contains(keys))]

    def inventory(self) -> list[BlockMeta]:
        pending = self.demotions.metas() if self.demotions is not None else []
        metas = self.ssd.inventory()
        seen = {m.key for m in metas}
        return metas + [m for m in pending if m.key not in seen]

    def stats(self) -> TierStats:
        return self.ssd.stats()
