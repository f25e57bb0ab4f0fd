"""The worker side of the vLLM connector: KV bytes between vLLM's paged cache and the pool.

A pool block is one vLLM block across all layers: for each layer in the
order vLLM registered them, that layer's slice of the block as vLLM lays it
out (on CPU ``[kv_heads, block_size, 2 * head_size]``; elsewhere whatever
the registered tensors hold along their block dimension). The key space
names vLLM's physical layout, so blocks are only ever read back by workers
that lay them out the same way.

- A load (:meth:`PoolWorker.fetch`, then :meth:`PoolWorker.scatter`): the
  blocks are fetched into a host staging buffer (``[n, layers, piece]``
  bytes), then scattered into vLLM's blocks with one indexed copy per layer.
  Only the leading run that arrived intact (checksum verified by the pool
  client) is copied; the blocks from the first failure on are load errors,
  so vLLM recomputes them and never reads what was in those blocks. Who
  calls these and when is the load mode's business: :meth:`PoolWorker.load`
  (``sync``: the step's loads, before its forward), :mod:`.async_loads`,
  :mod:`.layerwise`.
- A step whose load of a request failed saves nothing of that request
  (:meth:`PoolWorker.save` skips it): the forward computed its new tokens
  over KV that did not arrive, and vLLM recomputes them.
- Saves (after the forward), host caches: each block's layer pieces are
  gathered straight into its target (:meth:`PoolClient.prepare_put`: a slot
  the same-host node leased ahead, else host scratch), hashed in the same
  pass, then queued (:meth:`PoolClient.complete_put`): one copy per block.
  Device caches: one indexed gather per layer into staging, then
  :meth:`PoolClient.put` (one copy more). Either way the forward never waits
  on the network; a full queue drops blocks (counted).
- Staging buffers (:class:`~kvpool.engines.staging.LayeredStaging`) are
  reused and grow to the largest batch seen; each thread that copies has
  its own.
- Stats may be counted from several threads (the async loader's, the layer
  thread's): :meth:`PoolWorker.count` takes a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpool.client.lookup import BlockLocation
from kvpool.client.pool import PoolClient
from kvpool.engines.staging import LayeredStaging
from kvpool.engines.vllm.keys import shard_key
from kvpool.engines.vllm.scheduler import LoadJob, SaveJob
from kvpool.keys import leading_hits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's registered KV tensor and the dimension that indexes its blocks."""

    name: str
    tensor: torch.Tensor
    block_dim: int

    @property
    def piece_bytes(self) -> int:
        """Bytes of one block's slice of this layer."""
        t = self.tensor
        return t.numel() // t.shape[self.block_dim] * t.element_size()


@dataclass(slots=True)
class TransferStats:
    """What the worker moved since the last :meth:`PoolWorker.take_stats`."""

    loaded_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    dropped_blocks: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    loads: int = 0
    saves: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: {"dram": 0, "ssd": 0})


@dataclass(frozen=True, slots=True)
class Fetched:
    """A job's blocks in staging: the first ``n`` arrived intact (``blocks[:n]``, ``[n, layers, piece]`` bytes)."""

    job: LoadJob
    n: int
    blocks: torch.Tensor

    @property
    def failed(self) -> list[int]:
        """vLLM block ids that did not load: from the first that did not arrive on."""
        return self.job.block_ids[self.n:]


def block_layers(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[LayerCache]:
    """vLLM's registered caches as :class:`LayerCache` (block dimension: the first of size ``num_blocks``).

    ValueError for a tensor with no such dimension or caches of different slice sizes or dtypes.
    """
    layers = []
    for name, tensor in kv_caches.items():
        dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
        if not dims:
            raise ValueError(f"KV cache {name} of shape {tuple(tensor.shape)} has no dimension of {num_blocks} blocks")
        layers.append(LayerCache(name, tensor, dims[0]))
    if not layers:
        raise ValueError("no KV caches registered")
    shapes = {(lay.piece_bytes, lay.tensor.dtype) for lay in layers}
    if len(shapes) > 1:
        raise ValueError(f"KV caches with different block slices: {sorted(map(str, shapes))}")
    return layers


class PoolWorker:
    """Loads and saves of one vLLM worker (see the module docstring). :meth:`load` and :meth:`save` are called
    from vLLM's model-runner thread; :meth:`fetch`, :meth:`scatter` and :meth:`gather` from any thread with
    its own staging."""

    def __init__(self, pool: PoolClient, layers: list[LayerCache], shard: int = 0):
        self.pool = pool
        self.layers = layers
        self.layer_index = {layer.name: i for i, layer in enumerate(layers)}
        self.shard = shard  # pp_rank * tp_size + tp_rank: which shard of each block this worker holds
        self.piece_bytes = layers[0].piece_bytes
        self.block_bytes = self.piece_bytes * len(layers)
        self._load_staging = self.staging()
        self._save_staging = self.staging()
        self._errors: set[int] = set()
        self.failed_reqs: set[str] = set()  # requests whose load failed in this step (their saves are dropped)
        self._lock = threading.Lock()
        self.stats = TransferStats()

    def staging(self) -> LayeredStaging:
        """A new staging buffer for this worker's blocks (one per copying thread)."""
        return LayeredStaging(len(self.layers), self.piece_bytes)

    # -- loads ---------------------------------------------------------------------------------

    def load(self, jobs: Sequence[LoadJob]) -> None:
        """Fetch and scatter every job's blocks now; what fails is kept for :meth:`take_load_errors`."""
        for job in jobs:
            start = time.perf_counter()
            fetched = self.fetch(job, self._load_staging.blocks(len(job.block_ids)))
            self.scatter([fetched], range(len(self.layers)))
            failed = self.count_load(fetched, time.perf_counter() - start)
            if failed:
                self.failed(fetched.job, failed)

    def fetch(self, job: LoadJob, blocks: torch.Tensor) -> Fetched:
        """The job's blocks into ``blocks`` (staging, ``[len(job.block_ids), layers, piece]`` bytes): the
        leading run that arrived intact (checksums verified)."""
        locations = self._locations(job)[:len(job.block_ids)]
        sizes_ok = [loc.size == self.block_bytes for loc in locations]
        n = leading_hits(sizes_ok)
        outs = [blocks[i].view(-1).numpy() for i in range(n)]
        arrived = self.pool.get_into(locations[:n], outs) if n else []
        n = leading_hits(arrived)
        return Fetched(job, n, blocks)

    def scatter(self, fetched: Sequence[Fetched], layers: Iterable[int]) -> None:
        """Copy the fetched blocks' pieces of ``layers`` into vLLM's blocks (one indexed copy per layer)."""
        parts = [f for f in fetched if f.n]
        if not parts:
            return
        ids = torch.tensor([b for f in parts for b in f.job.block_ids[:f.n]], dtype=torch.long)
        for i in layers:
            pieces = parts[0].blocks[:parts[0].n, i] if len(parts) == 1 else \
                torch.cat([f.blocks[:f.n, i] for f in parts])
            _scatter(self.layers[i], ids, pieces)

    def count_load(self, fetched: Fetched, seconds: float) -> list[int]:
        """Count a finished load in the stats (any thread); its failed blocks."""
        job, failed = fetched.job, fetched.failed
        with self._lock:
            s = self.stats
            s.loads += 1
            s.loaded_blocks += fetched.n
            s.load_seconds += seconds
            for loc in job.locations[:fetched.n] if self.shard == 0 else ():
                tier = loc.tier.name.lower()
                s.by_tier[tier] = s.by_tier.get(tier, 0) + 1
            s.load_errors += len(failed)
        return failed

    def failed(self, job: LoadJob, blocks: Sequence[int]) -> None:
        """``blocks`` of the step's ``job`` did not load: reported to vLLM (:meth:`take_load_errors`), and the
        request saves nothing this step. Model-runner thread."""
        self._errors.update(blocks)
        self.failed_reqs.add(job.req_id)
        log.debug("kvpool: %d of %d blocks of %s did not load; vLLM recomputes them", len(blocks),
                  len(job.block_ids), job.req_id)

    def _locations(self, job: LoadJob) -> list[BlockLocation]:
        """Where the job's blocks are: the scheduler's lookup for shard 0, a lookup of this shard's keys otherwise."""
        if self.shard == 0:
            return job.locations
        run = self.pool.lookup([shard_key(k, self.shard) for k in job.keys])
        return list(run)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load (sync or layer-wise) failed since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Gather every job's blocks and hand them to the pool's write-behind queue (requests whose load failed
        this step excepted)."""
        jobs = [job for job in jobs if job.block_ids and job.req_id not in self.failed_reqs]
        if not jobs:
            return
        start = time.perf_counter()
        if all(layer.tensor.device.type == "cpu" for layer in self.layers):
            self._save_on_host(jobs, start)
            return
        ids = save_ids(jobs)
        blocks = self._save_staging.blocks(len(ids))
        self.gather(ids, blocks, range(len(self.layers)))
        self.put(jobs, blocks, time.perf_counter() - start)

    def _save_on_host(self, jobs: Sequence[SaveJob], start: float) -> None:
        """Host caches: each block's pieces (one per layer, in order) straight into its target, hashed as they
        are copied, then queued: one copy per block (see the module docstring)."""
        per_layer = [np.moveaxis(_host_bytes(layer.tensor), layer.block_dim, 0) for layer in self.layers]
        for job in jobs:
            n = len(job.block_ids)
            prepared = self.pool.prepare_put([shard_key(k, self.shard) for k in job.keys], [self.block_bytes] * n)
            for j, block_id in enumerate(job.block_ids):
                prepared.fill(j, [blocks[block_id] for blocks in per_layer])
            self._count_save(n, sum(self.pool.complete_put(prepared, self._names(job))))
        with self._lock:
            self.stats.save_seconds += time.perf_counter() - start

    def gather(self, ids: torch.Tensor, blocks: torch.Tensor, layers: Iterable[int]) -> None:
        """Copy the pieces of ``layers`` of vLLM's blocks ``ids`` into ``blocks`` (staging, same order)."""
        for i in layers:
            _gather(self.layers[i], ids, blocks[:, i])

    def put(self, jobs: Sequence[SaveJob], blocks: torch.Tensor, seconds: float) -> None:
        """Hand the gathered blocks (``jobs`` in order) to the write-behind queue (it copies them now)."""
        start = time.perf_counter()
        at = 0
        for job in jobs:
            n = len(job.block_ids)
            keys = [shard_key(k, self.shard) for k in job.keys]
            staged, at = blocks[at : at + n], at + n
            if job.req_id in self.failed_reqs:  # its load failed after the gather began (layer-wise)
                continue
            self._count_save(n, sum(self.pool.put(keys, [staged[j].view(-1).numpy() for j in range(n)],
                                                  self._names(job))))
        with self._lock:
            self.stats.save_seconds += seconds + time.perf_counter() - start

    def _names(self, job: SaveJob) -> list[int] | None:
        """vLLM's hash of each block, for KV events; one shard carries them (each shard is its own pool key)."""
        return list(job.engine_hashes) if self.shard == 0 and len(job.engine_hashes) == len(job.block_ids) else None

    def _count_save(self, n: int, kept: int) -> None:
        with self._lock:
            self.stats.saves += 1
            self.stats.saved_blocks += kept
            self.stats.dropped_blocks += n - kept

    def end_step(self) -> None:
        """The step is over: its failed loads no longer hold back saves."""
        self.failed_reqs = set()

    def take_stats(self) -> TransferStats:
        with self._lock:
            stats, self.stats = self.stats, TransferStats()
        return stats


def save_ids(jobs: Sequence[SaveJob]) -> torch.Tensor:
    """The vLLM block ids of ``jobs``' blocks, jobs in order (how :meth:`PoolWorker.put` reads staging)."""
    return torch.tensor([b for job in jobs for b in job.block_ids], dtype=torch.long)


def _gather(layer: LayerCache, ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy blocks ``ids`` of ``layer`` into ``out`` (``[n, piece]`` bytes, host)."""
    t = layer.tensor
    if t.device.type == "cpu":  # numpy's indexed copies: no OpenMP threads contending with vLLM's for the cores
        blocks = np.moveaxis(_host_bytes(t), layer.block_dim, 0)
        out.numpy()[:] = blocks[ids.numpy()].reshape(len(ids), -1)
        return
    picked = t.index_select(layer.block_dim, ids.to(t.device)).movedim(layer.block_dim, 0).contiguous()
    out.copy_(picked.view(len(ids), -1).view(torch.uint8).cpu())


def _scatter(layer: LayerCache, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (``[n, piece]`` bytes, host) into blocks ``ids`` of ``layer``."""
    t = layer.tensor
    if t.device.type == "cpu":
        blocks = np.moveaxis(_host_bytes(t), layer.block_dim, 0)
        blocks[ids.numpy()] = src.numpy().reshape(len(ids), *blocks.shape[1:])
        return
    shape = list(t.shape)
    del shape[layer.block_dim]
    values = src.contiguous().view(t.dtype).view(len(ids), *shape).to(t.device)  # one copy, by index_copy_
    t.index_copy_(layer.block_dim, ids.to(t.device), values.movedim(0, layer.block_dim))


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as numpy bytes, in its shape (the last dimension in bytes)."""
    return t.view(torch.uint8).numpy()
