"""A pool node's two tiers together: DRAM in front, SSD behind.

Invariants:
- Reads try DRAM, then SSD. An SSD hit is promoted back into DRAM (which may
  in turn demote DRAM's least recently used blocks).
- Write-back (default): blocks reach SSD only when DRAM evicts them; every
  eviction is a demotion, in DRAM's LRU order.
- Write-through: every put goes to DRAM and SSD; DRAM evictions then simply
  drop (SSD already has the block, unless SSD's own LRU evicted it).
- The tiers are inclusive after a promotion: the SSD copy stays until SSD's
  LRU evicts it, so demoting that block again costs no write.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.buffers import BufferLike
from kvpool.keys import BlockKey, check_keys
from kvpool.tiers.base import Tier, TierStats, check_batch
from kvpool.tiers.dram import DramStore
from kvpool.tiers.ssd import SsdStore


class TieredStore:
    """DRAM + optional SSD of one node, with demotion and promotion between them."""

    def __init__(self, dram: DramStore, ssd: SsdStore | None = None, *, write_through: bool = False, promote: bool = True):
        self.dram = dram
        self.ssd = ssd
        self.write_through = write_through and ssd is not None
        self.promote = promote
        if ssd is not None and not self.write_through:
            dram.on_evict = self._demote

    def _demote(self, keys: Sequence[BlockKey], views: Sequence[memoryview], checksums: Sequence[int]) -> None:
        assert self.ssd is not None, "tiered: demotion without an SSD tier"
        self.ssd.put(keys, views, checksums)

    def where(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        """The fastest tier holding each key (no recency change)."""
        keys = check_keys(keys)
        found: list[Tier | None] = [Tier.DRAM if hit else None for hit in self.dram.contains(keys)]
        missing = [i for i, t in enumerate(found) if t is None]
        if self.ssd is not None and missing:
            for i, hit in zip(missing, self.ssd.contains([keys[i] for i in missing])):
                if hit:
                    found[i] = Tier.SSD
        return found

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
        ssd_hits = self.ssd.get_into(miss_keys, miss_outs)
        promote_keys, promote_vals = [], []
        for i, key, out, hit in zip(missing, miss_keys, miss_outs, ssd_hits):
            if hit:
                served[i] = Tier.SSD
                promote_keys.append(key)
                promote_vals.append(out)
        if self.promote and promote_keys:
            self.dram.put(promote_keys, promote_vals)
        return served

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Store blocks in DRAM (and SSD with write-through); a block DRAM has no room for goes to SSD."""
        keys = check_keys(keys)
        check_batch(keys, values)
        stored = self.dram.put(keys, values)
        if self.ssd is None:
            return stored
        if self.write_through:
            on_ssd = self.ssd.put(keys, values)
            return [a or b for a, b in zip(stored, on_ssd)]
        left = [i for i, ok in enumerate(stored) if not ok]
        if left:
            for i, ok in zip(left, self.ssd.put([keys[i] for i in left], [values[i] for i in left])):
                stored[i] = ok
        return stored

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop keys from every tier; returns how many (key, tier) copies went."""
        keys = check_keys(keys)
        removed = self.dram.remove(keys)
        if self.ssd is not None:
            removed += self.ssd.remove(keys)
        return removed

    def stats(self) -> list[TierStats]:
        out = [self.dram.stats()]
        if self.ssd is not None:
            out.append(self.ssd.stats())
        return out

    def close(self) -> None:
        self.dram.close()
        if self.ssd is not None:
            self.ssd.close()
