"""What a lookup found: the boundary object between the client and the master.

Invariant of :class:`LookupResult`: of the ``requested`` blocks (in prompt
order), the first ``hbm_blocks`` are in this worker's HBM, the next
``len(pool)`` are in the pool at ``pool[i]``, and every block after those is a
miss: only a leading run can be reused, so nothing past the first miss counts.

The pooled run is kept as the master sent it, in columns (:class:`PoolRun`),
from the lookup reply to the copy: a lookup of hundreds of blocks builds no
Python object per block; a :class:`BlockLocation` is made only when one is
indexed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from kvpool.keys import BlockKey
from kvpool.vocabulary import NodeRef, Tier


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where one pooled block is, with the size and checksum its bytes must have."""

    key: BlockKey
    tier: Tier
    node: NodeRef
    size: int
    checksum: int


class PoolRun(Sequence[BlockLocation]):
    """The pooled blocks of a lookup, as columns (immutable; all columns have one entry per block).

    ``tiers`` holds one :class:`Tier` value per block; ``node_indexes[i]``
    indexes ``nodes``; ``sizes`` and ``checksums`` are uint64 arrays. The
    caller that builds it has checked them. The data paths read the columns
    (no Python object per block); a :class:`BlockLocation` is made only when
    one is indexed.
    """

    __slots__ = ("keys", "tiers", "node_indexes", "nodes", "sizes", "checksums")

    def __init__(self, keys: Sequence[BlockKey], tiers: bytes, node_indexes: Sequence[int] | np.ndarray,
                 nodes: Sequence[NodeRef], sizes: Sequence[int] | np.ndarray,
                 checksums: Sequence[int] | np.ndarray):
        if not len(keys) == len(tiers) == len(node_indexes) == len(sizes) == len(checksums):
            raise ValueError("pool run: columns of different lengths")
        self.keys = keys
        self.tiers = tiers
        self.node_indexes = np.asarray(node_indexes, dtype=np.int64)
        self.nodes = nodes
        self.sizes = np.asarray(sizes, dtype=np.uint64)
        self.checksums = np.asarray(checksums, dtype=np.uint64)

    @classmethod
    def of(cls, locations: Sequence[BlockLocation]) -> PoolRun:
        """A run of the given locations (itself if it is one already)."""
        if isinstance(locations, PoolRun):
            return locations
        nodes: dict[NodeRef, int] = {}
        indexes = [nodes.setdefault(loc.node, len(nodes)) for loc in locations]
        return cls([loc.key for loc in locations], bytes(int(loc.tier) for loc in locations), indexes, list(nodes),
                   [loc.size for loc in locations], [loc.checksum for loc in locations])

    def __len__(self) -> int:
        return len(self.tiers)

    @overload
    def __getitem__(self, i: int) -> BlockLocation: ...

    @overload
    def __getitem__(self, i: slice) -> PoolRun: ...

    def __getitem__(self, i: int | slice) -> BlockLocation | PoolRun:
        if isinstance(i, slice):
            return PoolRun(self.keys[i], self.tiers[i], self.node_indexes[i], self.nodes, self.sizes[i],
                           self.checksums[i])
        return BlockLocation(self.keys[i], Tier(self.tiers[i]), self.nodes[int(self.node_indexes[i])],
                             int(self.sizes[i]), int(self.checksums[i]))

    def __iter__(self) -> Iterator[BlockLocation]:
        return (self[i] for i in range(len(self)))

    def count(self, tier: Tier) -> int:
        """How many blocks of the run ``tier`` holds."""
        return self.tiers.count(int(tier))


EMPTY_RUN = PoolRun((), b"", (), (), (), ())


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Per-tier prefix lengths and locations of one request's blocks (see module docstring)."""

    requested: int
    hbm_blocks: int
    pool: PoolRun = EMPTY_RUN

    def __post_init__(self) -> None:
        assert 0 <= self.hbm_blocks + len(self.pool) <= self.requested, "lookup: run longer than the request"

    @property
    def dram_blocks(self) -> int:
        return self.pool.count(Tier.DRAM)

    @property
    def ssd_blocks(self) -> int:
        return self.pool.count(Tier.SSD)

    @property
    def hit_blocks(self) -> int:
        return self.hbm_blocks + len(self.pool)

    @property
    def miss_blocks(self) -> int:
        return self.requested - self.hit_blocks

    def by_tier(self) -> dict[str, int]:
        """Hit blocks per tier label (``hbm``, ``dram``, ``ssd``)."""
        return {"hbm": self.hbm_blocks, "dram": self.dram_blocks, "ssd": self.ssd_blocks}
