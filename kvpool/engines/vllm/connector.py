"""``KVPoolConnector``: kvpool as a vLLM KV connector (v1), the pool behind vLLM's own prefix cache.

Load it with::

    --kv-transfer-config '{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool.engines.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"kvpool_config_path":"/etc/kvpool/vllm.json"}}'

``kv_connector_extra_config``:

- ``kvpool_config_path``: a kvpool JSON config; its ``client`` section says
  where the master is (``KVPOOL_CLIENT_*`` variables apply too). ``client.model``
  names the model in every key (default: vLLM's served model name).
- ``kvpool_strict`` (default false; true/false, 1/0, yes/no, on/off, any
  other value is itself an unusable config): a config that cannot be used
  stops vLLM from starting, with the reason. Otherwise it is one ERROR line
  and vLLM serves without the pool (every block computed).
- ``kvpool_load_mode`` (default ``"async"``): how a request's blocks are
  loaded. ``"async"``: the scheduler side answers ``(n, True)``, vLLM parks
  the request in ``WAITING_FOR_REMOTE_KVS`` and a loader thread loads its
  blocks while the batch keeps running; ``get_finished`` reports it in
  ``finished_recving`` (:mod:`.async_loads`). ``"sync"``: every block of the
  step's loads before its forward. ``"layerwise"``: started before the
  forward, each layer waited for by its own ``wait_for_layer_load``, saves
  gathered per layer from ``save_kv_layer`` (:mod:`.layerwise`).

- ``kvpool_handoff_timeout_ms`` (default 2000): prefill/decode disaggregation's
  bound on either side's wait, below.

All are parsed strictly (:mod:`.settings`): ``"false"`` is false, a mode is
one of the three words.

vLLM's prefix cache is the HBM tier: the scheduler side
(:mod:`kvpool.engines.vllm.scheduler`) asks the pool only for the blocks
after vLLM's own hit; the worker side (:mod:`kvpool.engines.vllm.worker`)
loads them (as the mode says) and saves every block that fills up, prompt
and generated. A pool fault is a miss: a failed lookup answers 0 tokens, a
block that does not load is reported (``get_block_ids_with_load_errors``;
for an async load in the same step as its ``finished_recving``) and vLLM
recomputes it; the connector sets ``kv_load_failure_policy`` to
``recompute`` (vLLM's default, ``fail``, would fail the request). Keys:
:mod:`kvpool.engines.vllm.keys`. Stats: :mod:`kvpool.engines.vllm.stats`.

``kv_role`` (:class:`~kvpool.engines.vllm.scheduler.Role`): ``kv_both`` loads
and saves as above. ``kv_producer`` (a prefill instance) stores every full
block of each prompt and keeps a finished request's blocks until the pool
holds them (``request_finished`` answers True; :mod:`.handoff` reports it in
``finished_sending``, confirmed or, after the timeout, not); its
``kv_transfer_params`` say how many prompt tokens it stored. ``kv_consumer``
(a decode instance) stores only the blocks its generated tokens fill, and a
request whose ``kv_transfer_params`` announce stored tokens waits for them
(bounded by the timeout), then loads them.

Not supported (refused with a warning, vLLM then runs without the pool):
models with more than one KV cache group (hybrid attention).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.engines.vllm.async_loads import AsyncLoads
from kvpool.engines.vllm.handoff import HandoffWatch
from kvpool.engines.vllm.keys import VllmKeySpace
from kvpool.engines.vllm.layerwise import LayerThread, LayerwiseLoad, LayerwiseSave
from kvpool.engines.vllm.scheduler import PoolScheduler, Role, StepPlan
from kvpool.engines.vllm.settings import (
    DEFAULT_LOAD_MODE,
    HANDOFF_TIMEOUT_MS,
    client_config,
    handoff_timeout_s,
    load_mode,
    strict_mode,
)
from kvpool.engines.vllm.stats import KVPoolConnectorStats, KVPoolPromMetrics
from kvpool.engines.vllm.worker import PoolWorker, block_layers
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """kvpool's loggers write through vLLM's handler (its format, stream and level), unless set up already."""
    ours = logging.getLogger("kvpool")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


_log_through_vllm()

@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to the workers."""

    plan: StepPlan = field(default_factory=StepPlan)


def key_space(vllm_config: VllmConfig, model: str) -> VllmKeySpace:
    """What every block key of this vLLM deployment shares (see :mod:`kvpool.engines.vllm.keys`)."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
    layout = KVLayout(str(dtype), mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(),
                      cc.block_size)
    cache_layout = f"{current_platform.device_type}/{cc.kv_cache_layout or 'unresolved'}"
    return VllmKeySpace(model, layout, cache_layout, pc.tensor_parallel_size, pc.pipeline_parallel_size)


def model_name(vllm_config: VllmConfig, config: ClientConfig) -> str:
    if config.model != ClientConfig.model:  # named in the kvpool config
        return config.model
    served = vllm_config.model_config.served_model_name
    return str(served[0] if isinstance(served, list) else served)


class KVPoolConnector(KVConnectorBase_V1):
    """kvpool behind vLLM's prefix cache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        strict = False  # a kvpool_strict that is not on/off is itself an unusable config, not a strict one
        self._block_size = vllm_config.cache_config.block_size
        self._pool: PoolClient | None = None
        self._scheduler: PoolScheduler | None = None
        self._worker: PoolWorker | None = None
        self._space: VllmKeySpace | None = None
        self._num_blocks = kv_cache_config.num_blocks
        self._unloadable: set[int] = set()  # planned loads this worker could not attempt (it has no pool)
        kv = self._kv_transfer_config
        self._role = Role.of(kv.is_kv_producer, kv.is_kv_consumer)
        self._handoffs: HandoffWatch | None = None  # a producer worker's
        self._unwatched: set[str] = set()  # hand-offs this worker could not watch (it has no pool): done at once
        self._unreceived: set[str] = set()  # async loads this worker could not attempt: finished, all failed
        self._async: AsyncLoads | None = None
        self._async_errors: set[int] = set()  # failed blocks of async loads reported finished this step
        self._layers: LayerThread | None = None
        self._layer_load: LayerwiseLoad | None = None  # this step's, in layer-wise mode
        self._layer_save: LayerwiseSave | None = None
        self._mode = DEFAULT_LOAD_MODE
        timeout = HANDOFF_TIMEOUT_MS / 1000
        try:
            strict = strict_mode(extra)
            config = client_config(extra)
            timeout = handoff_timeout_s(extra)
            self._mode = load_mode(extra)
            groups = len(kv_cache_config.kv_cache_groups)
            if groups > 1:
                raise ValueError(f"{groups} KV cache groups (hybrid attention) are not supported")
        except ValueError as exc:
            if strict:
                raise ValueError(f"kvpool connector: {exc}") from None
            log.error("kvpool connector: %s; vLLM runs without the pool (every block is computed)", exc)
            config = None
        self._model = model_name(vllm_config, config) if config is not None else ""
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("kvpool connector: kv_load_failure_policy set to recompute (a block the pool fails to "
                         "deliver is computed, never an error)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if config is not None:
                # strict: a fault raises PoolFault, which the scheduler side answers with 0 tokens and a pause
                self._pool = PoolClient(dataclasses.replace(config, hbm_blocks=0, shared_memory=False, strict=True,
                                                            layout=None))
            self._scheduler = PoolScheduler(self._key_space, self._pool, self._block_size, role=self._role,
                                            handoff_timeout_s=timeout, async_loads=self._mode == "async")
        elif config is not None:
            self._pool = PoolClient(dataclasses.replace(config, hbm_blocks=0, strict=False, layout=None))
        self._handoff_timeout_s = timeout
        log.info("kvpool connector (%s, %s): %s", role.name.lower(), self._role.value,
                 f"pool at {config.master}, model {self._model!r}, {self._mode} loads" if config is not None
                 else "pool off")

    def _key_space(self) -> VllmKeySpace:
        if self._space is None:  # vLLM resolves its KV cache layout after building the scheduler's connector
            self._space = key_space(self._vllm_config, self._model)
        return self._space

    # -- scheduler side ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None, "kvpool connector: scheduler call on a worker"
        n = self._scheduler.match(request, num_computed_tokens)  # None: a consumer waiting for announced blocks
        return n, n is not None and n > 0 and self._scheduler.async_loads

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None, "kvpool connector: scheduler call on a worker"
        self._scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None, "kvpool connector: scheduler call on a worker"
        dram, ssd = self._scheduler.sources(request, num_external_tokens)
        return {source: n for source, n in ((CacheHitSource.HOST, dram), (CacheHitSource.DISK, ssd)) if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None, "kvpool connector: scheduler call on a worker"
        return KVPoolMetadata(self._scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:  # the workers' load outcomes: failed requests are not offered loads again
            self._scheduler.load_outcomes(connector_output.finished_recving or (), connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        # Saves were copied out in the steps that filled the blocks; a producer's request is held until the pool
        # holds them (finished_sending), and its params say how many prompt tokens it stored.
        handoff, params = self._scheduler.finished(request)
        return handoff is not None, params

    # -- worker side ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._pool is None:
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        try:
            layers = block_layers(kv_caches, self._num_blocks)
            self._key_space().layout.check_block(layers[0].piece_bytes * len(layers),
                                                 what="a block of vLLM's KV caches")
        except ValueError as exc:
            log.error("kvpool connector: %s; this worker neither loads nor saves", exc)
            return
        pc = self._vllm_config.parallel_config
        shard = get_pp_group().rank_in_group * pc.tensor_parallel_size + get_tensor_model_parallel_rank()
        self._worker = PoolWorker(self._pool, layers, shard)
        if self._role is Role.PRODUCER:
            self._handoffs = HandoffWatch(self._pool, self._handoff_timeout_s, shard)
        if self._mode == "async":
            self._async = AsyncLoads(self._worker)
        elif self._mode == "layerwise":
            self._layers = LayerThread(self._worker)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata), "kvpool connector: metadata of another connector"
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan.loads:  # this step's own: before its forward reads them
            if self._worker is None:  # nothing can be loaded here: every planned block is recomputed
                self._unloadable.update(b for job in plan.loads for b in job.block_ids)
            elif self._layers is not None:
                self._layer_load = LayerwiseLoad(self._layers, plan.loads)
            else:
                self._worker.load(plan.loads)
        if plan.async_loads:  # vLLM calls this after the step's forward when the step has no sync loads
            if self._async is None:  # no loader here: finished at once, every block failed
                self._unreceived.update(job.req_id for job in plan.async_loads)
                self._unloadable.update(b for job in plan.async_loads for b in job.block_ids)
            else:
                self._async.submit(plan.async_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_load is not None:  # layer-wise mode: this layer's pieces only
            self._layer_load.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        if self._layers is None or self._worker is None:
            return  # the other modes copy the step's full blocks out of every layer at once, in wait_for_save
        if self._layer_save is None:
            saves = self._plan().saves
            if not saves:
                return
            self._layer_save = LayerwiseSave(self._layers, saves)
        self._layer_save.gather_layer(layer_name)

    def _finish_layer_load(self) -> None:
        if self._layer_load is not None:
            self._layer_load.finish()
            self._layer_load = None

    def wait_for_save(self) -> None:
        plan = self._plan()
        self._finish_layer_load()  # its failures decide which requests save nothing this step
        if self._worker is None:
            return
        if self._layer_save is not None:
            self._layer_save.finish()
            self._layer_save = None
        elif plan.saves:
            self._worker.save(plan.saves)
        self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._sending(), self._recving()

    def _recving(self) -> set[str] | None:
        """Async loads finished since the last step (their failed blocks go out with this step's load errors);
        in a step that computed nothing, waits a moment for one (:mod:`.async_loads`)."""
        done, self._unreceived = self._unreceived, set()
        if self._async is not None:
            if self.has_connector_metadata() and self._plan().idle:
                self._async.wait()
            finished, failed = self._async.take_finished()
            done |= finished
            self._async_errors |= failed
        return done or None

    def _sending(self) -> set[str] | None:
        """Hand-offs done (``finished_sending``): this step's go to the watch, and what it reported comes back."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        handoffs = meta.plan.handoffs if isinstance(meta, KVPoolMetadata) else []
        if handoffs:
            if self._handoffs is None:  # this worker has no pool: nothing to wait for
                self._unwatched.update(h.req_id for h in handoffs)
            else:
                self._handoffs.add(handoffs)
        done, self._unwatched = self._unwatched, set()
        if self._handoffs is not None:
            done |= self._handoffs.take_done()
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_load()  # vLLM may call this before wait_for_save (a deferred finalize)
        errors, self._unloadable, self._async_errors = self._unloadable | self._async_errors, set(), set()
        if self._worker is not None:
            errors |= self._worker.take_load_errors()
        return errors

    # -- stats ------------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is not None:
            stats = KVPoolConnectorStats.of(match=self._scheduler.take_stats())
        elif self._worker is not None:
            handoff = self._handoffs.take_stats() if self._handoffs is not None else None
            stats = KVPoolConnectorStats.of(transfer=self._worker.take_stats(), handoff=handoff)
        else:
            return None
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPoolConnectorStats(data=dict(data)) if data else KVPoolConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPoolPromMetrics | None:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._handoffs is not None:
            self._handoffs.close()
        for threads in (self._async, self._layers):
            if threads is not None:
                threads.close()
        if self._pool is not None:
            self._pool.flush(5.0)
            self._pool.close()
            self._pool = None
