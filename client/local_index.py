"""Lookups with no round trip: answered from the arenas of the pool's nodes when every live node is on this host.

Each node publishes what it holds in its shared-memory arena: its DRAM rows
with their key index, and the keys (with sizes and checksums) its SSD tier
holds (:class:`~kvpool.tiers.arena.SharedArena`, the *SSD key set*). When the
client's cluster view says every live node is on this host and every one of
their arenas is mapped here and says its published inventory is whole, the
union of those arenas is exactly what the master's index would answer, only
fresher (a node's reports to the master lag its arena), so ``lookup`` and
``exists`` read the arenas instead of asking the master.

Invariants:
- A DRAM hit is a committed row naming the key, read under the arena's
  seqlock (:meth:`SharedArena.check_slots`, then :meth:`SharedArena.unchanged`),
  so its size and checksum are that block's. An SSD hit is an entry of the
  node's SSD key set; a torn read of an entry the owner is rewriting can only
  make a later read miss (bytes are checked against the checksum, always).
- Anything that makes the local answer possibly incomplete (a node on
  another host, an arena that cannot be mapped, an inventory a node marks
  incomplete, a tenant mask not known yet) returns None: the caller asks the
  master, as before.
- A block held by several nodes is reported where it is fastest (DRAM before
  SSD; the first node in the view's order among equals), as the master does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.auth import mask_keys
from kvpool.client.cluster import ClusterView
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.client.shared_path import TenantMask
from kvpool.core import NodeRef, Tier
from kvpool.keys import BlockKey
from kvpool.rpc import MISS
from kvpool.tiers.arena import INVENTORY_INCOMPLETE, INVENTORY_WHOLE, KEY_DTYPE, SharedArena

__all__ = ["Holdings", "LocalIndex", "LocalLookupCounts"]

REPORT_S = 1.0  # lookups answered here are reported to the master at most this often (and at close)


@dataclass(frozen=True, slots=True)
class Holdings:
    """Per key (in request order): tier (``MISS``: nowhere), node index into ``nodes``, size and checksum."""

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
            if arena is None or arena.inventory_state() == INVENTORY_INCOMPLETE:
                return None
            found.append((view.ref, arena))
        return found

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
        tiers = np.full(n, MISS, dtype=np.uint8)
        node_indexes = np.zeros(n, dtype=np.int64)
        sizes = np.zeros(n, dtype=np.uint64)
        sums = np.zeros(n, dtype=np.uint64)
        for k, (_, arena) in enumerate(arenas):
            slots = arena.index_find(stored)
            gens, _, held = arena.check_slots(slots, stored)
            rows = arena.table[np.where(held, slots, 0)]
            length, checksum = rows["length"].astype(np.uint64), rows["checksum"].astype(np.uint64)
            held &= arena.unchanged(slots, gens)  # the row was that block while we read its length and checksum
            new = held & (tiers != Tier.DRAM)
            tiers[new], node_indexes[new], sizes[new], sums[new] = Tier.DRAM, k, length[new], checksum[new]
            if arena.inventory_state() == INVENTORY_WHOLE:
                on_ssd, ssd_sizes, ssd_sums = arena.ssd_meta(stored)
                new = on_ssd & (tiers == MISS)
                tiers[new], node_indexes[new], sizes[new], sums[new] = Tier.SSD, k, ssd_sizes[new], ssd_sums[new]
        return Holdings(tiers, node_indexes, sizes, sums, [ref for ref, _ in arenas])

    def lookup(self, keys: Sequence[BlockKey]) -> PoolRun | None:
        """The leading run of ``keys`` this host's nodes hold, as the master's Lookup would give it; None: ask it."""
        held = self.holdings(keys)
        if held is None:
            return None
        misses = np.flatnonzero(held.tiers == MISS)
        run = int(misses[0]) if misses.size else len(keys)
        return PoolRun(keys[:run], held.tiers[:run].tobytes(), held.node_indexes[:run], held.nodes,
                       held.sizes[:run], held.checksums[:run])

    def exists(self, keys: Sequence[BlockKey]) -> list[bool] | None:
        """Per key whether this host's nodes hold it; None: ask the master."""
        held = self.holdings(keys)
        return None if held is None else (held.tiers != MISS).tolist()


@dataclass(slots=True)
class LookupCounts:
    """Lookups answered here, the blocks they asked for (HBM prefix included) and their hits per tier."""

    lookups: int = 0
    requested: int = 0
    hbm: int = 0
    dram: int = 0
    ssd: int = 0


class LocalLookupCounts:
    """What the master would have counted for the lookups answered here, until they are reported (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, LookupCounts] = {}  # per block_tokens
        self._sent_at = time.monotonic()

    def add(self, hbm_prefix_blocks: int, tiers: bytes, keys: int, block_tokens: int) -> None:
        run = np.frombuffer(tiers, dtype=np.uint8)
        dram = int(np.count_nonzero(run == Tier.DRAM))
        with self._lock:
            c = self._counts.setdefault(block_tokens, LookupCounts())
            c.lookups += 1
            c.requested += hbm_prefix_blocks + keys
            c.hbm += hbm_prefix_blocks
            c.dram += dram
            c.ssd += len(run) - dram

    def take(self, *, due_only: bool) -> dict[int, LookupCounts]:
        """The counts so far, reset (``due_only``: empty unless REPORT_S passed since the last take)."""
        now = time.monotonic()
        with self._lock:
            if due_only and now - self._sent_at < REPORT_S or not self._counts:
                return {}
            counts, self._counts, self._sent_at = self._counts, {}, now
        return counts
