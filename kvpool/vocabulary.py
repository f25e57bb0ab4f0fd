"""The vocabulary every part of kvpool shares: tiers, their counters, what an index knows of a block, a node's name.

Plain data, no behaviour: the master, the nodes, the tiers and the client
all import these, and nothing here imports them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpool.keys import BlockKey


class Tier(enum.IntEnum):
    """Storage tiers, fastest first; lookups try them in this order."""

    HBM = 0
    DRAM = 1
    SSD = 2

    @property
    def label(self) -> str:
        return self.name.lower()


NO_TIER = 255
"""The tier byte of a block no tier holds: where a per-block tier travels as one byte (the wire's ``tiers``
fields, an arena's inventory, the master's and a client's tier columns), "held nowhere" is this value. It
sorts after every :class:`Tier`, so the lowest byte is the best copy."""


@dataclass(slots=True)
class TierStats:
    """Counters and gauges of one tier store (a snapshot; plain numbers)."""

    tier: Tier
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    corrupt: int = 0


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What an index needs to know about one stored block: its key, size and checksum."""

    key: BlockKey
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class NodeRef:
    """Who a pool node is and where it is reached: the fields of the wire's ``kvpool.v1.NodeRef``.

    ``address`` is its gRPC host:port, ``data_address`` its wire listener
    (empty: not known); ``host_id`` says which machine it runs on (a same-host
    client maps ``arena`` from /dev/shm). Hashable: clients group blocks by it.
    """

    node_id: str
    address: str
    host_id: str = ""
    arena: str = ""
    data_address: str = ""
