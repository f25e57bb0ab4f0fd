"""MindIE's MemPool backend on kvpool (``kvPoolConfig: {"backend": "kvpool", "configPath": ...}``).

MindIE builds its pool with ``MemPool.create_pool(backend, config_path, role,
**kwargs)``; :func:`create_pool` has that shape and :class:`KVPoolMempool` is
the object it returns. ``config_path`` is a kvpool JSON config (its ``client``
section: master address, model, tenant and the ``layout`` of MindIE's cache).
See docs/engines/mindie.md for the registration MindIE needs.

Roles:
- ``"scheduler"`` only asks which keys exist (``exists``/``batch_exist``). It
  holds no data memory: no HBM tier, no staging buffer, no arena mapping
  (its client has ``hbm_blocks=0`` and ``shared_memory=False``); its
  ``put``/``get`` answer ``[False] * N``.
- ``"worker"`` (kwargs ``device_id``, ``kv_caches``) also moves blocks.
  ``tensors`` is ``[N][num_layers][2]``: the K and V of one block per layer,
  views into the engine's paged cache (``npu_cache[layer][0][block_id]``),
  each ``[block_size, num_kv_heads, head_dim]`` in the layout's dtype.

Invariants:
- A MindIE key string maps to a pool key with :func:`kvpool.keys.opaque_key`
  in the client's namespace (model, layout, tenant): see :mod:`.keymap`. The
  client, its role rules and the counters are :class:`~kvpool.engines.session.EngineSession`'s.
- Bad arguments (wrong types, lengths, shapes, dtypes, mixed devices, a
  closed pool) return ``[False]`` (``False`` for ``exists``), are counted in
  ``stats["refused"]`` and change nothing: everything is checked before the
  first byte moves. A pool fault is a False, never an exception.
- A block moves as one contiguous buffer in the layout's byte order
  (``layer_kv``: layer 0 K, layer 0 V, layer 1 K, ...) through a reusable host
  staging buffer (:mod:`.staging`): one ``torch.stack(out=)`` per chunk from
  host tensors, ``copy_`` per piece from and to device tensors.
- ``get`` fills only blocks that hit and answers per key (see
  :class:`~kvpool.engines.staging.BlockStager`); MindIE uses the leading run.
- ``put`` returns once the blocks are copied and queued (kvpool's write-behind);
  ``flush`` waits for the pool, ``close`` drains and releases everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.config import load_config
from kvpool.engines.session import EngineSession
from kvpool.engines.staging import DEFAULT_STAGING_BYTES
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout

log = logging.getLogger(__name__)

BACKEND_NAME = "kvpool"

Block = Sequence[Sequence[torch.Tensor]]  # [num_layers][kv_parts] pieces of one block


def create_pool(backend: str, config_path: str, role: str = "scheduler", **kwargs: Any) -> KVPoolMempool:
    """MindIE's ``MemPool.create_pool`` shape: the kvpool backend for ``backend == "kvpool"``, else ValueError."""
    if backend != BACKEND_NAME:
        raise ValueError(f"unknown MemPool backend {backend!r} (role {role!r}); this factory provides {BACKEND_NAME!r}")
    return KVPoolMempool(config_path, role, **kwargs)


class KVPoolMempool:
    """A MindIE MemPool backed by a kvpool client (see module docstring)."""

    def __init__(self, config_path: str, role: str = "scheduler", *, device_id: int = 0,
                 kv_caches: Sequence[Sequence[torch.Tensor]] | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, **kwargs: Any):
        """Connect to the pool described by ``config_path``; ValueError for a bad config, role or cache."""
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id must be a non-negative int, got {device_id!r}")
        if kwargs:
            log.debug("kvpool MemPool ignores kwargs %s", sorted(kwargs))
        config = load_config(config_path).client
        if config.layout is None:
            raise ValueError(f"{config_path}: the client section needs a 'layout' (MindIE's KV cache block shape)")
        self.device_id = device_id
        self.layout: KVLayout = config.layout
        self._dtype = getattr(torch, self.layout.dtype)
        self._order = sorted(((layer, part) for layer in range(self.layout.num_layers)
                              for part in range(self.layout.kv_parts)), key=lambda lp: self.layout.piece_offset(*lp))
        if role == "worker" and kv_caches is not None:
            self._check_cache(kv_caches)
        self.session = EngineSession(config, role, staging_bytes, "MindIE MemPool")
        self.role = role
        self.stats = self.session.stats
        log.info("kvpool MemPool %s ready (master %s, layout %s)", role, config.master, self.layout.fingerprint())

    # -- MindIE's calls -------------------------------------------------------------------

    def exists(self, key: str, **kwargs: Any) -> bool:
        """Whether the pool (or this worker's HBM tier) holds ``key``; False for a bad key or a fault."""
        if not isinstance(key, str):
            return self.session.refuse("exists", f"key must be a str, got {type(key).__name__}", False)
        return self.batch_exist([key])[0]

    def batch_exist(self, keys: list[str], **kwargs: Any) -> list[bool]:
        """Per key, whether the pool holds it; ``[False]`` for bad arguments or a closed pool."""
        block_keys = self.session.keys(keys)
        if block_keys is None or self.session.client is None:
            return self.session.refuse("batch_exist", "closed, or keys are not a list of non-empty str", [False])
        return self.session.exists(block_keys)

    def put(self, keys: str | list[str], tensors: Any, **kwargs: Any) -> list[bool]:
        """Store each key's block (``tensors[i]`` = ``[num_layers][2]`` pieces); per key, whether it was accepted."""
        checked = self._check_call("put", keys, tensors)
        if checked is None:
            return [False]
        block_keys, blocks = checked
        if not self.session.moves_data:
            return self.session.refuse("put", "the scheduler role moves no data", [False] * len(block_keys))
        return self.session.put(block_keys, blocks, [self.layout.block_bytes] * len(blocks), self._gather)

    def get(self, keys: str | list[str], tensors: Any, **kwargs: Any) -> list[bool]:
        """Fill each hit's pieces in place; per key, whether its block was loaded (misses stay untouched)."""
        checked = self._check_call("get", keys, tensors)
        if checked is None:
            return [False]
        block_keys, blocks = checked
        if not self.session.moves_data:
            return self.session.refuse("get", "the scheduler role moves no data", [False] * len(block_keys))
        return self.session.get(block_keys, blocks, [self.layout.block_bytes] * len(blocks), self._scatter)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put reached the pool (or was dropped); False on timeout or when closed."""
        return self.session.flush(timeout)

    def close(self) -> None:
        """Drain queued puts, release the client and staging buffers; later calls answer False. Idempotent."""
        self.session.close()

    # -- argument checks --------------------------------------------------------------------

    def _check_call(self, call: str, keys: object, tensors: object) -> tuple[list[BlockKey], list[Block]] | None:
        """Keys and blocks if the arguments are well-formed for this layout, else None (refusal logged)."""
        if self.session.client is None:
            return self.session.refuse(call, "pool is closed", None)
        if isinstance(keys, str):  # MemPool also takes one key with its one block
            keys, tensors = [keys], [tensors]
        block_keys = self.session.keys(keys)
        if block_keys is None:
            return self.session.refuse(call, "keys must be a str or a list of non-empty str", None)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(block_keys):
            return self.session.refuse(call, f"need one [layers][2] block per key ({len(block_keys)})", None)
        problem = self._check_blocks(tensors)
        if problem:
            return self.session.refuse(call, problem, None)
        return block_keys, list(tensors)

    def _check_blocks(self, blocks: Sequence[object]) -> str:
        """'' if every block is ``[num_layers][kv_parts]`` tensors of the piece shape and dtype on one device."""
        layers, parts, shape = self.layout.num_layers, self.layout.kv_parts, self.layout.piece_shape
        device = None
        for i, block in enumerate(blocks):
            if not isinstance(block, (list, tuple)) or len(block) != layers:
                return f"block {i} must be a list of {layers} layers"
            for layer in block:
                if not isinstance(layer, (list, tuple)) or len(layer) != parts:
                    return f"block {i}: each layer must be a list of {parts} tensors"
                for piece in layer:
                    if not isinstance(piece, torch.Tensor):
                        return f"block {i}: pieces must be tensors, got {type(piece).__name__}"
                    if piece.shape != shape or piece.dtype != self._dtype or not piece.is_contiguous():
                        return (f"block {i}: piece {tuple(piece.shape)} {piece.dtype} is not a contiguous "
                                f"{shape} {self._dtype} (layout {self.layout.fingerprint()})")
                    if device is None:
                        device = piece.device
                    elif piece.device != device:
                        return f"block {i}: pieces on {device} and {piece.device}"
        return ""

    def _check_cache(self, kv_caches: object) -> None:
        """ValueError unless ``kv_caches`` is ``[num_layers][kv_parts]`` paged caches of this layout."""
        layers, parts = self.layout.num_layers, self.layout.kv_parts
        expected = f"[num_blocks, {', '.join(map(str, self.layout.piece_shape))}] {self._dtype}"
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != layers:
            raise ValueError(f"kv_caches must hold {layers} layers (layout {self.layout.fingerprint()})")
        for layer, caches in enumerate(kv_caches):
            if not isinstance(caches, (list, tuple, torch.Tensor)) or len(caches) < parts:
                raise ValueError(f"kv_caches[{layer}] must hold {parts} tensors (K, V)")
            for cache in caches[:parts]:
                if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or \
                        tuple(cache.shape[1:]) != self.layout.piece_shape or cache.dtype != self._dtype:
                    got = (f"{tuple(cache.shape)} {cache.dtype}" if isinstance(cache, torch.Tensor)
                           else type(cache).__name__)
                    raise ValueError(f"kv_caches[{layer}]: expected {expected}, got {got} "
                                     f"(layout {self.layout.fingerprint()})")

    # -- byte movement (staging callbacks) ----------------------------------------------------

    def _pieces(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """Every piece of ``blocks``, block after block, each block's pieces in the layout's byte order."""
        order = self._order
        return [block[layer][part] for block in blocks for layer, part in order]

    def _typed(self, region: torch.Tensor, count: int) -> torch.Tensor:
        """The staging bytes as ``[count, *piece_shape]`` pieces of the layout's dtype."""
        return region.view(self._dtype).view(count, *self.layout.piece_shape)

    def _gather(self, blocks: Sequence[Block], region: torch.Tensor) -> None:
        pieces = self._pieces(blocks)
        out = self._typed(region, len(pieces))
        if pieces[0].device.type == "cpu":
            torch.stack(pieces, out=out)
        else:  # device pieces: one device-to-host copy each
            for dst, src in zip(out.unbind(0), pieces):
                dst.copy_(src)

    def _scatter(self, blocks: Sequence[Block], region: torch.Tensor) -> None:
        pieces = self._pieces(blocks)
        for dst, src in zip(pieces, self._typed(region, len(pieces)).unbind(0)):
            dst.copy_(src)
