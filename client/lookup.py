"""What a lookup found: the boundary object between the client and the master.

Invariant of :class:`LookupResult`: of the ``requested`` blocks (in prompt
order), the first ``hbm_blocks`` are in this worker's HBM, the next
``len(pool)`` are in the pool at ``pool[i]``, and every block after those is a
miss: only a leading run can be reused, so nothing past the first miss counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.keys import BlockKey
from kvpool.tiers.base import Tier


@dataclass(frozen=True, slots=True)
class NodeAddress:
    """A pool node as the master described it."""

    node_id: str
    address: str
    host_id: str
    arena: str


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where one pooled block is, with the size and checksum its bytes must have."""

    key: BlockKey
    tier: Tier
    node: NodeAddress
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Per-tier prefix lengths and locations of one request's blocks (see module docstring)."""

    requested: int
    hbm_blocks: int
    pool: tuple[BlockLocation, ...] = ()

    def __post_init__(self) -> None:
        assert 0 <= self.hbm_blocks + len(self.pool) <= self.requested, "lookup: run longer than the request"

    @property
    def dram_blocks(self) -> int:
        return sum(1 for loc in self.pool if loc.tier == Tier.DRAM)

    @property
    def ssd_blocks(self) -> int:
        return sum(1 for loc in self.pool if loc.tier == Tier.SSD)

    @property
    def hit_blocks(self) -> int:
        return self.hbm_blocks + len(self.pool)

    @property
    def miss_blocks(self) -> int:
        return self.requested - self.hit_blocks

    def by_tier(self) -> dict[str, int]:
        """Hit blocks per tier label (``hbm``, ``dram``, ``ssd``)."""
        return {"hbm": self.hbm_blocks, "dram": self.dram_blocks, "ssd": self.ssd_blocks}
