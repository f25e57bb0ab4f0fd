"""Lookups with no round trip: answered from the arenas of the pool's nodes when every live node is on this host.

Each node publishes what it holds in its shared-memory arena: per key the
tier it is best served from, its size and its checksum (the arena's
*inventory*, :class:`~kvpool.tiers.arena.SharedArena`). When the client's
cluster view says every live node is on this host and every one of their
arenas is mapped here and says its inventory is whole, the union of those
inventories is exactly what the master's index would answer, only fresher
(a node's reports to the master lag its arena), so ``lookup`` and ``exists``
read the arenas instead of asking the master: one batched table lookup per
node, no round trip.

Invariants:
- An answer is a hint as good as the master's: the read that follows checks
  the DRAM row (key, gen, size, checksum) and the bytes' checksum, so a torn
  read of an entry the owner is rewriting can only make that read miss.
- Anything that makes the local answer possibly incomplete or stale (a node
  on another host, an arena that cannot be mapped, an inventory a node marks
  incomplete, an arena that is not the segment the view saw, a tenant mask
  not known yet) returns None: the caller asks the master, as before.
- A block held by several nodes is reported where it is fastest (DRAM before
  SSD; the first node in the view's order among equals), as the master does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.auth import mask_keys
from kvpool.client.cluster import ClusterView
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.keys import BlockKey
from kvpool.master_client import TenantMask
from kvpool.tiers.arena import KEY_DTYPE, InventoryState, SharedArena
from kvpool.vocabulary import NO_TIER, NodeRef

__all__ = ["Holdings", "LocalIndex"]


@dataclass(frozen=True, slots=True)
class Holdings:
    """Per key (in request order): tier (``NO_TIER``: nowhere), node index into ``nodes``, size and checksum."""

    tiers: np.ndarray  # uint8
    node_indexes: np.ndarray  # int64
    sizes: np.ndarray  # uint64
    checksums: np.ndarray  # uint64
    nodes: list[NodeRef]


class LocalIndex:
    """The same-host answer to lookups and exists (see the module docstring)."""

    def __init__(self, cluster: ClusterView, nodes: NodeDirectory, tenant_mask: TenantMask | None, *,
                 enabled: bool = True):
        self.cluster = cluster
        self.nodes = nodes
        self.tenant_mask = tenant_mask
        self.enabled = enabled

    def _arenas(self) -> list[tuple[NodeRef, SharedArena]] | None:
        """Every live node with its mapped arena, or None if the local answer could be incomplete."""
        if not self.enabled:
            return None
        views = self.cluster.nodes()
        if not views or any(v.ref.host_id != self.nodes.host_id for v in views):
            return None
        found = []
        for view in views:
            arena = self.nodes.arena(view.ref)
            if arena is None or arena.inventory_state() != InventoryState.COMPLETE:
                return None
            if arena.file_id != view.arena_file:  # the node restarted since the view was taken: its address may
                self.cluster.invalidate()  # have moved too, so its blocks cannot be named yet; ask again
                return None
            found.append((view.ref, arena))
        return found

    def answers(self) -> bool:
        """Whether lookups are answered here now (else by the master)."""
        return self._arenas() is not None

    def holdings(self, keys: Sequence[BlockKey]) -> Holdings | None:
        """Where each key is held on this host's nodes; None: ask the master (see the module docstring)."""
        arenas = self._arenas()
        if arenas is None:
            return None
        mask = b"" if self.tenant_mask is None else self.tenant_mask()
        if mask is None:  # the arenas hold stored keys we cannot compute yet
            return None
        n = len(keys)
        stored = np.frombuffer(mask_keys(b"".join(keys), mask), dtype=KEY_DTYPE)
        if len(arenas) == 1:  # one node: its answer as it is
            found, size, checksum = arenas[0][1].inventory_meta(stored)
            return Holdings(found, np.zeros(n, dtype=np.int64), size, checksum, [arenas[0][0]])
        tiers = np.full(n, NO_TIER, dtype=np.uint8)
        node_indexes = np.zeros(n, dtype=np.int64)
        sizes = np.zeros(n, dtype=np.uint64)
        sums = np.zeros(n, dtype=np.uint64)
        for k, (_, arena) in enumerate(arenas):
            found, size, checksum = arena.inventory_meta(stored)
            better = found < tiers  # DRAM (1) before SSD (2) before NO_TIER (255); the first node among equals
            tiers[better], node_indexes[better], sizes[better], sums[better] = \
                found[better], k, size[better], checksum[better]
        return Holdings(tiers, node_indexes, sizes, sums, [ref for ref, _ in arenas])

    def lookup(self, keys: Sequence[BlockKey]) -> PoolRun | None:
        """The leading run of ``keys`` this host's nodes hold, as the master's Lookup would give it; None: ask it."""
        held = self.holdings(keys)
        if held is None:
            return None
        misses = np.flatnonzero(held.tiers == NO_TIER)
        run = int(misses[0]) if misses.size else len(keys)
        return PoolRun(keys[:run], held.tiers[:run].tobytes(), held.node_indexes[:run], held.nodes,
                       held.sizes[:run], held.checksums[:run])

    def exists(self, keys: Sequence[BlockKey]) -> list[bool] | None:
        """Per key whether this host's nodes hold it; None: ask the master."""
        held = self.holdings(keys)
        return None if held is None else (held.tiers != NO_TIER).tolist()
