"""The vLLM connector's numbers, through vLLM's own connector stats hooks.

vLLM collects ``get_kv_connector_stats()`` from the scheduler and every
worker each step, sums them with :meth:`KVPoolConnectorStats.aggregate`,
logs :meth:`KVPoolConnectorStats.reduce` ("KV Transfer metrics: ...") and
hands the same data to :class:`KVPoolPromMetrics`, which counts it on vLLM's
``/metrics`` (``vllm:kvpool_*``, with vLLM's engine labels). Every field is a
plain number that adds up across workers and steps. kvpool's own client
counters by tier (``kvpool_hit_blocks_total{tier}`` ...) are the master's and
the client registry's, as for any engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpool.engines.vllm.handoff import HandoffStats
from kvpool.engines.vllm.scheduler import MatchStats
from kvpool.engines.vllm.worker import TransferStats

# field -> (Prometheus name after vllm:kvpool_, help): counters (seconds are summed, as *_seconds_total)
FIELDS: dict[str, tuple[str, str]] = {
    "lookups": ("lookups", "Pool lookups of the vLLM scheduler"),
    "hit_blocks_dram": ("hit_blocks_dram", "Blocks the pool's lookups found in DRAM"),
    "hit_blocks_ssd": ("hit_blocks_ssd", "Blocks the pool's lookups found on SSD"),
    "lookup_faults": ("lookup_faults", "Lookups that failed (answered 0 tokens)"),
    "loaded_blocks": ("loaded_blocks", "Blocks loaded from the pool into vLLM's KV cache"),
    "load_errors": ("load_errors", "Blocks that did not load (vLLM recomputed them)"),
    "saved_blocks": ("saved_blocks", "Blocks queued for the pool (prompt and generated)"),
    "dropped_blocks": ("dropped_blocks", "Blocks not saved: the write-behind queue was full"),
    "load_seconds": ("load_seconds", "Time spent loading blocks"),
    "save_seconds": ("save_seconds", "Time spent copying blocks out for saving"),
    # prefill/decode disaggregation (kv_role): a producer's hand-offs, a consumer's waits for them
    "handoffs": ("handoffs", "Finished requests of a kv_producer whose blocks the pool confirmed"),
    "handoff_faults": ("handoff_faults", "Finished requests of a kv_producer released without that confirmation"),
    "handoff_waits": ("handoff_waits", "Requests of a consumer that waited for the blocks a producer announced"),
    "handoff_timeouts": ("handoff_timeouts", "Of those, the waits that ended at the timeout, short of the blocks"),
}


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """Sums since the last collection (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = dict.fromkeys(FIELDS, 0)

    @classmethod
    def of(cls, match: MatchStats | None = None, transfer: TransferStats | None = None,
           handoff: HandoffStats | None = None) -> KVPoolConnectorStats:
        stats = cls()
        if match is not None:
            stats.data.update(lookups=match.lookups, hit_blocks_dram=match.hit_blocks.get("dram", 0),
                              hit_blocks_ssd=match.hit_blocks.get("ssd", 0), lookup_faults=match.faults,
                              handoff_waits=match.handoff_waits, handoff_timeouts=match.handoff_timeouts)
        if handoff is not None:
            stats.data.update(handoffs=handoff.confirmed, handoff_faults=handoff.failed)
        if transfer is not None:
            stats.data.update(loaded_blocks=transfer.loaded_blocks, load_errors=transfer.load_errors,
                              saved_blocks=transfer.saved_blocks, dropped_blocks=transfer.dropped_blocks,
                              load_seconds=transfer.load_seconds, save_seconds=transfer.save_seconds)
        return stats

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in FIELDS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 6) if isinstance(value, float) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in FIELDS)


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_<field>`` counters on vLLM's metrics endpoint, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for field_name, (name, help_text) in FIELDS.items():
            counter = self._counter_cls(name=f"vllm:kvpool_{name}", documentation=help_text, labelnames=labelnames)
            self.counters[field_name] = create_metric_per_engine(counter, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field_name, value in transfer_stats_data.items():
            per_engine = self.counters.get(field_name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
