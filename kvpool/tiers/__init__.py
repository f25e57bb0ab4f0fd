"""The tier stores: the same few batched calls in every tier (:mod:`kvpool.tiers.base`), composed by NodeStore.

- :mod:`kvpool.tiers.arena`  the shared-memory slot arena (mappable by other processes)
- :mod:`kvpool.tiers.dram`   DRAM tier: index, LRU and watermarks over an arena
- :mod:`kvpool.tiers.ssd`    SSD tier: LMDB with checksums and a hard capacity
- :mod:`kvpool.tiers.node_store` a node's DRAM + SSD: demotion on eviction, promotion on hit
- :mod:`kvpool.client.hbm`   HBM tier (torch, client side only)
"""

from kvpool.vocabulary import Tier, TierStats

__all__ = ["Tier", "TierStats"]
