"""The master's metrics, all on one registry the server owns (never the global one).

- Lookup accounting through :class:`kvpool.metrics.LookupMetrics`, each
  counter labelled with the tenant whose lookups it counts (``tenant=""`` with
  auth off), plus plain running totals over all tenants for ``ClusterStatus``.
  Invariant: both are updated together under one lock, so ClusterStatus's
  counters always equal what Prometheus counted, summed over tenants.
- ``kvpool_lookup_seconds``: master-side latency of a Lookup call;
  ``kvpool_score_seconds`` of a Score call (all its workers).
- Gauges read at scrape time, so they never drift from the state they
  describe: ``kvpool_nodes``, ``kvpool_index_blocks``, ``kvpool_workers``,
  ``kvpool_hbm_blocks``, and its cluster view of per-node tier usage
  (``kvpool_cluster_tier_capacity_bytes``, ``kvpool_cluster_tier_used_bytes``,
  ``kvpool_cluster_tier_blocks`` with ``node=<node id>``) from each node's last
  heartbeat. The names differ from the nodes' own ``kvpool_tier_*`` so a query
  never mixes the two sources; the master exports no movement counters.
- Failover, observed on a master when it is elected (with etcd):
  ``kvpool_master_failover_seconds`` (from the old leader's last renewal this
  master saw to its election, :attr:`~kvpool.master.election.Election.failover_s`)
  and ``kvpool_master_failover_resync_seconds`` (from the election to each
  node's whole inventory being in the index, for nodes that registered within
  ``node_timeout_s`` of it: the nodes that followed from the old leader).
  Their sum is the time a node's blocks were misses through a failover.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.master.index import BlockIndex, HbmIndex
from kvpool.master.membership import Membership
from kvpool.metrics import CLUSTER_TIER_PREFIX, ErrorMetrics, LookupMetrics, TierCollector, latency_histogram
from kvpool.vocabulary import TierStats
from kvpool.worker_ids import split_scoped_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LookupTotals:
    """Lookup counters since the master started (blocks)."""

    lookups: int = 0
    requested_blocks: int = 0
    hit_blocks_hbm: int = 0
    hit_blocks_dram: int = 0
    hit_blocks_ssd: int = 0


@dataclass(frozen=True, slots=True)
class TooLargeTotals:
    """Blocks PlaceBlocks refused because no live node takes their size, and the largest such size."""

    blocks: int = 0
    largest_refused: int = 0


class _UsageGauges(Collector):
    """The ``kvpool_cluster_tier_*`` usage gauges (heartbeats carry usage, not movement)."""

    def __init__(self, membership: Membership):
        self._tiers = TierCollector(self._source, prefix=CLUSTER_TIER_PREFIX, gauges_only=True)
        self._membership = membership

    def _source(self) -> Iterator[tuple[dict[str, str], TierStats]]:
        for info in self._membership.live_nodes():
            for stats in info.tiers.values():
                yield {"node": info.ref.node_id}, stats

    def collect(self) -> Iterator[Metric]:
        return self._tiers.collect()


_FAILOVER_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300)


class MasterMetrics:
    """Everything the master exports, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, index: BlockIndex, hbm: HbmIndex, membership: Membership,
                 errors: ErrorMetrics | None = None, tenants: Iterable[str] = ("",)):
        self.registry = registry
        self.errors = errors
        self._lookup = LookupMetrics(registry, by_tenant=True, tenants=tenants)
        self.lookup_seconds = latency_histogram(registry, "lookup", "Master-side latency of a Lookup call")
        self.score_seconds = latency_histogram(registry, "score", "Master-side latency of a Score call (routing)")
        self.lookups_together = Counter(
            "kvpool_master_lookups_together", "Lookups that arrived with others on the fast-call port and shared "
            "one index pass with them", registry=registry)
        self._lock = threading.Lock()
        self._totals = [0] * len(fields(LookupTotals))  # LookupTotals' counts, added to in place
        self._too_large = TooLargeTotals()
        self._hbm_warned = False  # HBM keys not kept were logged
        Gauge("kvpool_nodes", "Live pool nodes", registry=registry).set_function(membership.node_count)
        Gauge("kvpool_index_blocks", "Distinct blocks in the master's index", registry=registry).set_function(
            lambda: len(index)
        )
        Gauge("kvpool_workers", "Workers seen recently", registry=registry).set_function(membership.worker_count)
        Gauge("kvpool_hbm_blocks", "Blocks in workers' HBM tiers (copies)", registry=registry).set_function(hbm.blocks)
        registry.register(_UsageGauges(membership))
        self.failover_seconds = Histogram(
            "kvpool_master_failover_seconds", "On a newly elected master: seconds from the old leader's last lease "
            "renewal it saw to this election", buckets=_FAILOVER_BUCKETS, registry=registry)
        self.failover_resync_seconds = Histogram(
            "kvpool_master_failover_resync_seconds", "Seconds from this master's election to each re-registering "
            "node's whole inventory being in its index", buckets=_FAILOVER_BUCKETS, registry=registry)

    def record_lookup(self, hbm: int, dram: int, ssd: int, requested: int, block_tokens: int, lookups: int = 1,
                      tenant: str = "") -> None:
        """Count ``lookups`` lookups of ``tenant``: ``requested`` blocks (HBM prefix included), the runs served as
        given."""
        with self._lock:
            self._lookup.add(tenant, lookups, requested, block_tokens, hbm, dram, ssd)
            t = self._totals  # in LookupTotals' field order
            t[0] += lookups
            t[1] += requested
            t[2] += hbm
            t[3] += dram
            t[4] += ssd

    def lookup_totals(self) -> LookupTotals:
        with self._lock:
            return LookupTotals(*self._totals)

    def record_too_large(self, blocks: int, largest_refused: int, largest_taken: int) -> None:
        """Count blocks no live node takes; the first time (and for each new largest size) say what to change."""
        with self._lock:
            t = self._too_large
            first = largest_refused > t.largest_refused
            self._too_large = TooLargeTotals(t.blocks + blocks, max(t.largest_refused, largest_refused))
        if self.errors is not None:
            self.errors.count("block_too_large", blocks)
        if first:
            log.warning("refused blocks of up to %d bytes: no live node takes blocks larger than %d bytes; set the "
                        "nodes' max_block_bytes (kvpool node --max-block-bytes) to at least your block size, or give "
                        "them an SSD tier", largest_refused, largest_taken)

    def record_hbm_not_kept(self, keys: int, worker: str, per_worker: int, per_tenant: int) -> None:
        """Count HBM keys a report could not keep (``kvpool_errors_total{kind="hbm_keys_not_kept"}``); the first
        time, say which limits and worker (a scoped id) it was."""
        with self._lock:
            first, self._hbm_warned = not self._hbm_warned, True
        if self.errors is not None:
            self.errors.count("hbm_keys_not_kept", keys)
        if first:
            tenant, worker_id = split_scoped_id(worker)
            log.warning("HBM keys not kept: %d of worker %r%s are past max_hbm_keys_per_worker (%d) or, for its "
                        "tenant's workers together, max_hbm_keys_per_tenant (%d); routing scores under-count such "
                        "workers (a miss; counted in kvpool_errors_total{kind=\"hbm_keys_not_kept\"}, logged once)",
                        keys, worker_id, f" of tenant {tenant!r}" if tenant else "", per_worker, per_tenant)

    def too_large_totals(self) -> TooLargeTotals:
        with self._lock:
            return self._too_large
