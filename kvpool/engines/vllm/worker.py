"""The worker side of the vLLM connector: KV bytes between vLLM's paged cache and the pool.

A pool block is one vLLM block across all layers: for each layer in the
order vLLM registered them, that layer's slice of the block as vLLM lays it
out (on CPU ``[kv_heads, block_size, 2 * head_size]``; elsewhere whatever
the registered tensors hold along their block dimension). The key space
names vLLM's physical layout, so blocks are only ever read back by workers
that lay them out the same way.

- Loads (before the forward): the blocks are fetched into one host staging
  buffer (``[n, layers, piece]`` bytes), then scattered into vLLM's blocks
  with one indexed copy per layer. Only the leading run that arrived intact
  (checksum verified by the pool client) is copied; the blocks from the
  first failure on are reported as load errors, so vLLM recomputes them and
  never reads what was in those blocks.
- Saves (after the forward): one indexed gather per layer into staging, then
  the pool's write-behind queue takes a copy (:meth:`PoolClient.put`): the
  forward never waits on the network; a full queue drops blocks (counted).
- Staging buffers are reused and grow to the largest batch seen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpool.client.lookup import BlockLocation
from kvpool.client.pool import PoolClient
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
    """Loads and saves of one vLLM worker (see the module docstring). Called from vLLM's model-runner thread."""

    def __init__(self, pool: PoolClient, layers: list[LayerCache], shard: int = 0):
        self.pool = pool
        self.layers = layers
        self.shard = shard  # pp_rank * tp_size + tp_rank: which shard of each block this worker holds
        self.piece_bytes = layers[0].piece_bytes
        self.block_bytes = self.piece_bytes * len(layers)
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._errors: set[int] = set()
        self.stats = TransferStats()

    def _stage(self, n: int) -> torch.Tensor:
        """Host staging for ``n`` blocks, as ``[n, layers, piece]`` bytes (reused; grows as needed)."""
        need = n * self.block_bytes
        if self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8)
        return self._staging[:need].view(n, len(self.layers), self.piece_bytes)

    # -- loads ---------------------------------------------------------------------------------

    def load(self, jobs: Sequence[LoadJob]) -> None:
        """Fetch and scatter every job's blocks; what fails is kept for :meth:`take_load_errors`."""
        for job in jobs:
            start = time.perf_counter()
            loaded = self._load(job)
            self.stats.loads += 1
            self.stats.loaded_blocks += loaded
            self.stats.load_seconds += time.perf_counter() - start
            if loaded < len(job.block_ids):
                failed = job.block_ids[loaded:]
                self._errors.update(failed)
                self.stats.load_errors += len(failed)
                log.debug("kvpool: %d of %d blocks of %s did not load; vLLM recomputes them", len(failed),
                          len(job.block_ids), job.req_id)

    def _load(self, job: LoadJob) -> int:
        locations = self._locations(job)
        if not locations:
            return 0
        staging = self._stage(len(locations))
        outs = [staging[i].view(-1).numpy() for i in range(len(locations))]
        sizes_ok = [loc.size == self.block_bytes for loc in locations]
        n = leading_hits(sizes_ok)
        arrived = self.pool.get_into(locations[:n], outs[:n]) if n else []
        n = leading_hits(arrived)
        if n:
            for loc in locations[:n]:
                tier = loc.tier.name.lower()
                self.stats.by_tier[tier] = self.stats.by_tier.get(tier, 0) + 1
            ids = torch.tensor(job.block_ids[:n], dtype=torch.long)
            for i, layer in enumerate(self.layers):
                _scatter(layer, ids, staging[:n, i])
        return n

    def _locations(self, job: LoadJob) -> list[BlockLocation]:
        """Where the job's blocks are: the scheduler's lookup for shard 0, a lookup of this shard's keys otherwise."""
        if self.shard == 0:
            return job.locations
        run = self.pool.lookup([shard_key(k, self.shard) for k in job.keys])
        return list(run)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Gather every job's blocks and hand them to the pool's write-behind queue."""
        for job in jobs:
            if not job.block_ids:
                continue
            start = time.perf_counter()
            n = len(job.block_ids)
            staging = self._stage(n)
            ids = torch.tensor(job.block_ids, dtype=torch.long)
            for i, layer in enumerate(self.layers):
                _gather(layer, ids, staging[:, i])
            keys = [shard_key(k, self.shard) for k in job.keys]
            # vLLM's hash names the block in KV events; one shard carries it (each shard is its own pool key)
            names = job.engine_hashes if self.shard == 0 and len(job.engine_hashes) == n else None
            accepted = self.pool.put(keys, [staging[j].view(-1).numpy() for j in range(n)], names)  # copied now
            kept = sum(accepted)
            self.stats.saves += 1
            self.stats.saved_blocks += kept
            self.stats.dropped_blocks += n - kept
            self.stats.save_seconds += time.perf_counter() - start

    def take_stats(self) -> TransferStats:
        stats, self.stats = self.stats, TransferStats()
        return stats


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
    values = src.view(t.dtype).view(len(ids), *shape).to(t.device)  # a view: one copy, by index_copy_
    t.index_copy_(layer.block_dim, ids.to(t.device), values.movedim(0, layer.block_dim))


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as numpy bytes, in its shape (the last dimension in bytes)."""
    return t.view(torch.uint8).numpy()
