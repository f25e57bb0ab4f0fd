"""``KVPoolSecondaryTier``: kvpool as a secondary tier behind vLLM's own CPU offloading tier.

vLLM's ``OffloadingConnector`` with ``spec_name: "TieringOffloadingSpec"`` keeps a
CPU tier (LRU or ARC) in the instance and cascades every chunk it stores to
its secondary tiers; a chunk missing from the CPU tier is looked up in them
and promoted (secondary -> CPU tier -> GPU). vLLM's ``SecondaryTierFactory``
builds this class from its module path, no fork::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":8589934592,
        "secondary_tiers":[{"type":"KVPoolSecondaryTier","module_path":"kvpool.engines.vllm.offload_tier",
                            "kvpool_config_path":"/etc/kvpool/vllm.json"}]}}'

Fields of the tier's entry (:mod:`.offload_jobs` parses them strictly; any other field is refused by
name): ``kvpool_config_path``, ``kvpool_strict`` (as the connector's: off, a config that cannot be used is
one ERROR line and the tier answers every lookup with a miss; on, vLLM refuses to start),
``kvpool_store_queue_bytes`` (default 256 MiB: the stores waiting for the pool, past which new ones are
dropped), ``kvpool_switch_interval_us`` (default 200: Python's GIL switch interval while the tier's jobs run,
see :class:`~kvpool.engines.vllm.offload_jobs.SwitchInterval`; 0 leaves Python's 5 ms); vLLM's own
``locality`` (``LOCAL``/``REMOTE``, for per-request tier filters) and ``backpressure``.

Every method runs on vLLM's scheduler thread and returns at once: lookups go through vLLM's
``AsyncLookupManager`` (a background thread asks the pool once per step for the step's keys; until it has
answered, a lookup says RETRY), and transfers are :class:`~kvpool.engines.vllm.offload_jobs.TierJobs` on
their own threads, straight between the CPU tier's rows and the pool. Keys: one pool key per chunk and KV
cache group, see :func:`~kvpool.engines.vllm.offload_jobs.offload_namespace` and :func:`row_format`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import vllm
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvpool.client.pool import PoolClient
from kvpool.engines.vllm.offload_jobs import (
    TierJobs,
    model_name,
    offload_namespace,
    pool_keys,
    strict_mode,
    tier_settings,
)
from kvpool.keys import BlockKey

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

# vLLM metric names of this tier's counters (Prometheus, and vLLM's "KV Transfer metrics" log line)
METRICS = {
    "stored_blocks": ("vllm:kvpool_tier_stored_blocks", "Chunks the kvpool tier stored in the pool."),
    "store_failed_blocks": ("vllm:kvpool_tier_store_failed_blocks",
                            "Chunks the pool did not take (a fault, or no node had room)."),
    "dropped_blocks": ("vllm:kvpool_tier_dropped_blocks",
                       "Chunks not stored because kvpool_store_queue_bytes of stores were waiting (or the tier is "
                       "off)."),
    "loaded_blocks": ("vllm:kvpool_tier_loaded_blocks", "Chunks loaded from the pool into vLLM's CPU tier."),
    "load_failed_blocks": ("vllm:kvpool_tier_load_failed_blocks",
                           "Chunks a load did not bring intact (recomputed by vLLM)."),
    "lookup_faults": ("vllm:kvpool_tier_lookup_faults", "Lookup batches the pool could not answer (misses)."),
}


def row_format(spec: OffloadingSpec, row_bytes: int) -> dict[str, Any]:
    """What decides the bytes of one primary-tier row (a chunk, every worker's piece of it), for the key namespace.

    Conservative: parallel sizes always count (vLLM's ``is_parallelism_agnostic`` is not trusted to make rows of
    two topologies the same bytes), and so does vLLM's version (its block hashes and page layouts may change).
    """
    from vllm.platforms import current_platform

    config = spec.config
    p = config.parallel
    return {
        "vllm": vllm.__version__,
        "device": current_platform.device_type,
        "dtype": config.model.dtype,
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "parallel": [p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
        "replicated_layout": bool(spec.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
        "row_bytes": row_bytes,
    }


def _rows(primary_kv_view: memoryview) -> np.ndarray:
    """The CPU tier's memory as ``(num_chunks, row_bytes)`` uint8 rows, no copy."""
    return np.asarray(primary_kv_view).view(np.uint8)


class _PoolLookups(AsyncLookupManager):
    """vLLM's async lookup state, answered by one pool ``exists`` per request per step (on its thread)."""

    def __init__(self, tier: KVPoolSecondaryTier):
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.jobs.exists(self._tier.keys(keys))


class KVPoolSecondaryTier(SecondaryTierManager):
    """kvpool behind vLLM's CPU tier: sharing across instances and hosts, SSD, the fleet index, HA."""

    medium: ClassVar[Medium] = Medium.CPU  # the pool's DRAM (SSD behind it); hits are reported as host hits

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **fields: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        vllm_model = offloading_spec.config.model.name
        row = row_format(offloading_spec, self.block_size_bytes)
        pool: PoolClient | None = None
        strict = False  # a kvpool_strict that is not on/off is itself an unusable config, not a strict one
        try:
            strict = strict_mode(fields)
            settings = tier_settings(fields)
            model = model_name(settings.client, vllm_model)
            self.namespace = offload_namespace(model, settings.client.tenant, row)
            pool = PoolClient(dataclasses.replace(settings.client, hbm_blocks=0, strict=False, layout=None))
        except (ValueError, OSError) as exc:  # OSError: files the client config names (a TLS CA)
            if strict:  # raised before any view of vLLM's memory exists: vLLM's clean-up unmaps it
                raise ValueError(f"kvpool offload tier: {exc}") from None
            log.error("kvpool offload tier: %s; the tier is off (every lookup a miss, every store dropped)", exc)
            self.namespace = offload_namespace(vllm_model, "", row)  # keys for bookkeeping only: no pool
            self.jobs = TierJobs(None, _rows(primary_kv_view))
        else:
            self.locality = Locality(settings.locality) if settings.locality else None
            self.jobs = TierJobs(pool, _rows(primary_kv_view), settings.store_queue_bytes, settings.switch_interval_us)
            log.info("kvpool offload tier: pool at %s, model %r, %d chunks of %d bytes", settings.client.master,
                     model, len(self.jobs.rows), self.block_size_bytes)
        self._lookups = _PoolLookups(self) if pool is not None else None
        self._load_keys: dict[int, list[OffloadKey]] = {}  # in-flight loads: their vLLM keys, for the results

    def keys(self, offload_keys: Iterable[OffloadKey]) -> list[BlockKey]:
        """The pool keys of vLLM's offload keys."""
        return pool_keys(list(offload_keys), self.namespace)

    # -- SecondaryTierManager ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._lookups is None:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self.jobs.submit_store(job_metadata.job_id, self.keys(job_metadata.keys), job_metadata.chunk_ids)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        self.jobs.submit_load(job_metadata.job_id, self.keys(keys), job_metadata.chunk_ids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for done in self.jobs.finished():
            successful = None
            keys = self._load_keys.pop(done.job_id, None)
            if keys is not None and not done.ok:
                successful = tuple(k for k, ok in zip(keys, done.blocks_ok) if ok) or None
                if self._lookups is not None:  # no retry of a promotion that cannot succeed (vLLM #49176)
                    self._lookups.mark_miss([k for k, ok in zip(keys, done.blocks_ok) if not ok])
            results.append(JobResult(done.job_id, done.ok, successful, done.seconds if done.nbytes else None,
                                     done.nbytes or None))
        return results

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    def drain_jobs(self) -> None:
        self.jobs.drain()

    def shutdown(self) -> None:
        """Stores still queued get the pool's ``io_timeout_s`` to finish (a prefill instance that exits at once
        still leaves its chunks in the pool); then the rest fail and the tier lets go of vLLM's memory."""
        if self._lookups is not None:
            self._lookups.shutdown()
        pool = self.jobs.pool
        self.jobs.close(pool.config.io_timeout_s if pool is not None else 0.0)
        if pool is not None:
            pool.close()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRICS.values()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        counts = self.jobs.take_stats()
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for field, n in counts.items():
            stats.increase_counter(METRICS[field][0], n)
        return stats
