"""MindIE's MemPool backend on kvpool (``kvPoolConfig: {"backend": "kvpool", "configPath": ...}``).

MindIE builds its pool with ``MemPool.create_pool(backend, config_path, role,
**kwargs)`` (``mindie_llm/text_generator/mempool/base.py``), which calls
``CreatePool`` in ``factory.py``: a fixed ``match`` on the backend name, so
``"kvpool"`` needs one added case (docs/engines/mindie.md). :func:`create_pool`
has the same shape and :class:`KVPoolMempool` is the object it returns; like
MindIE's own backends it matches ``MemPool``'s methods (nothing in MindIE
checks the class). ``config_path`` is a kvpool JSON config: its ``client``
section, plus the shape of MindIE's cache as ``client.layout`` or, for caches a
layout cannot describe (MLA, NZ, int8 K), a ``mindie_cache`` object
(:class:`MindIECache`). See docs/engines/mindie.md for the MindIE source lines
each convention below comes from.

Roles:
- ``"scheduler"``: MindIE's C++ block manager (``create_pool(backend, path)``,
  role defaulted) asks which keys exist through ``mem_pool.h`` ``LookUp``:
  ``batch_exist`` if the object has it (it does), else ``exists`` until the
  first miss. It holds no data memory; its ``put``/``get`` answer ``[False] * N``.
- ``"worker"``: the prefix-cache plugin (kwargs ``device_id``, ``kv_caches`` =
  its ``npu_cache``) ``get``s the blocks the scheduler counted and ``put``s new
  ones, with ``tensors[i] = [[npu_cache[l][0][b], npu_cache[l][1][b]] for l in layers]``.

Invariants:
- Call shapes are MindIE's: ``keys`` a str (one block, ``tensors`` that block)
  or a list of str (``tensors`` a list of as many blocks); a block is whatever
  MindIE's ``flatten_tensors`` flattens (a Tensor, a list of them, a list of
  lists, nested any depth), its bytes the concatenation of its tensors' bytes.
  A block is accepted as exactly the cache's pieces (layer 0 K, layer 0 V,
  layer 1 K, ..., each of its own shape and dtype) or as one contiguous tensor
  of the block's bytes. Every method takes and ignores ``**kwargs``.
- Bad arguments (wrong types, lengths, shapes, dtypes, mixed devices, a closed
  pool) return ``[False]`` (``False`` for ``exists``), are counted in
  ``stats["refused"]`` and change nothing: all is checked before a byte moves.
  A pool fault is a False, never an exception.
- Keys: a MindIE key string (``"{hash}_{tp_rank}_{tp_size}_{model}"``) maps to
  :func:`kvpool.keys.opaque_key` in the namespace of the client's model and
  tenant and the cache's :meth:`MindIECache.fingerprint`: a scheduler and its
  workers agree, caches of another shape never share blocks.
- Bytes move through a reusable host staging buffer (:mod:`.staging`, pinned
  where torch can pin): per chunk, one copy per piece, device copies enqueued
  and waited for once (:class:`~kvpool.engines.staging.PieceCopier`).
- ``get`` fills only blocks that hit and answers per key (MindIE's plugin
  ignores the answer, see docs); ``put`` returns once the blocks are copied and
  queued (kvpool's write-behind); ``flush`` waits for the pool; ``close`` drains.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvpool.config import ClientConfig, load_config, read_json_object
from kvpool.engines import options
from kvpool.engines.keymap import engine_hash
from kvpool.engines.session import EngineSession
from kvpool.engines.staging import DEFAULT_STAGING_BYTES, PieceCopier
from kvpool.keys import BlockKey, KeyNamespace
from kvpool.layout import KVLayout, canonical_dtype

log = logging.getLogger(__name__)

BACKEND_NAME = "kvpool"
CACHE_SECTION = "mindie_cache"  # top-level object of the config file: a MindIECache
NZ_ALIGN = 16  # kvcache_settings.py NZ_KV_CACHE_FORMAT: NZ rows of 16 elements
NZ_ALIGN_INT8 = 32  # NZ_KV_CACHE_INT8_FORMAT: int8 NZ rows of 32

Block = list[torch.Tensor]  # one block's tensors, flattened, in MindIE's order
PieceSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True, slots=True)
class MindIECache:
    """One MindIE rank's KV cache, in the terms of MindIE's ``KVCacheSettings`` (valid once built).

    ``npu_cache[layer]`` is ``(K, V)``, each ``[num_blocks, *block_shape]``:
    ND ``(block_size, num_kv_heads, head_size)``; NZ (``nz``, acl format 29)
    ``(ceil(num_kv_heads * head_size / 16), block_size, 16)``. K and V head sizes
    may differ (MLA: DeepSeek-V2/V3/R1 have ``num_kv_heads`` 1, K ``kv_lora_rank``
    512, V ``qk_rope_head_dim`` 64). Layers in ``quant_layers`` hold an int8 K
    (NZ rows of 32). ``num_layers`` counts the MTP layer MindIE adds when
    speculative tokens are on.
    """

    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    k_head_size: int
    v_head_size: int
    nz: bool = False
    quant_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Every field parsed strictly (:mod:`.options`): ValueError naming the field."""
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("num_layers", "block_size", "num_kv_heads", "k_head_size", "v_head_size"):
            options.integer(getattr(self, name), f"{CACHE_SECTION}.{name}", low=1)
        object.__setattr__(self, "nz", options.flag(self.nz, f"{CACHE_SECTION}.nz"))
        quant = self.quant_layers
        if not isinstance(quant, (list, tuple)):
            raise ValueError(f"{CACHE_SECTION}.quant_layers must list layers in [0, {self.num_layers}), got {quant!r}")
        for i in quant:
            options.integer(i, f"{CACHE_SECTION}.quant_layers", low=0, high=self.num_layers - 1)
        object.__setattr__(self, "quant_layers", tuple(sorted(set(quant))))
        offset = 0
        for shape, dtype in self.pieces():
            if offset % dtype.itemsize:
                raise ValueError(f"{CACHE_SECTION}: a {dtype} piece would start at byte {offset} of a block")
            offset += math.prod(shape) * dtype.itemsize

    @classmethod
    def from_dict(cls, data: object) -> MindIECache:
        """From the config's ``mindie_cache`` object; ValueError for unknown, missing or bad fields."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{CACHE_SECTION} must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {CACHE_SECTION} field(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except TypeError as exc:  # a missing field
            raise ValueError(f"{CACHE_SECTION}: {exc}") from None

    @classmethod
    def from_layout(cls, layout: KVLayout) -> MindIECache:
        """The cache a kvpool layout describes: equal K and V per layer, ND, in ``layer_kv`` order."""
        if layout.kv_order != "layer_kv":
            raise ValueError(f"MindIE's blocks are [layers][K, V] (layer_kv); layout {layout.fingerprint()} is not")
        return cls(layout.dtype, layout.num_layers, layout.block_size, layout.num_kv_heads,
                   layout.head_dim, layout.head_dim)

    def _shape(self, head_size: int, align: int) -> tuple[int, ...]:
        if self.nz:
            return (math.ceil(self.num_kv_heads * head_size / align), self.block_size, align)
        return (self.block_size, self.num_kv_heads, head_size)

    def piece(self, layer: int, part: int) -> PieceSpec:
        """Shape and dtype of ``layer``'s K (part 0) or V (part 1) in one block."""
        dtype = getattr(torch, self.dtype)
        if part == 0 and layer in self.quant_layers:
            return self._shape(self.k_head_size, NZ_ALIGN_INT8), torch.int8
        return self._shape(self.k_head_size if part == 0 else self.v_head_size, NZ_ALIGN), dtype

    def pieces(self) -> list[PieceSpec]:
        """Every piece of a block in byte order: layer 0 K, layer 0 V, layer 1 K, ..."""
        return [self.piece(layer, part) for layer in range(self.num_layers) for part in (0, 1)]

    @property
    def block_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.pieces())

    def as_layout(self) -> KVLayout | None:
        """The equivalent kvpool layout (equal K/V, ND, no int8 K), else None."""
        if self.k_head_size != self.v_head_size or self.nz or self.quant_layers:
            return None
        return KVLayout(self.dtype, self.num_layers, self.num_kv_heads, self.k_head_size, self.block_size)

    def fingerprint(self) -> str:
        """The name of this block shape in key namespaces; a layout's own fingerprint where one describes it."""
        layout = self.as_layout()
        if layout is not None:
            return layout.fingerprint()
        quant = ":q" + ",".join(map(str, self.quant_layers)) if self.quant_layers else ""
        return (f"mindie:{self.dtype}:L{self.num_layers}:H{self.num_kv_heads}:K{self.k_head_size}"
                f":V{self.v_head_size}:B{self.block_size}{':nz' if self.nz else ''}{quant}")


def load_mindie_config(path: str) -> tuple[ClientConfig, MindIECache]:
    """The client config and MindIE cache of a kvpool config file; ValueError if either is missing or bad.

    The cache comes from ``mindie_cache`` or, failing that, ``client.layout``; never both.
    """
    data = read_json_object(path, "MindIE kvpool config")
    config = load_config(path, extra_sections=(CACHE_SECTION,)).client
    if CACHE_SECTION in data:
        if config.layout is not None:
            raise ValueError(f"{path}: give the cache as {CACHE_SECTION} or as client.layout, not both")
        return config, MindIECache.from_dict(data[CACHE_SECTION])
    if config.layout is None:
        raise ValueError(f"{path}: the cache's shape is missing: add {CACHE_SECTION} (or client.layout)")
    return config, MindIECache.from_layout(config.layout)


def create_pool(backend: str, config_path: str, role: str = "scheduler", **kwargs: Any) -> KVPoolMempool:
    """MindIE's ``MemPool.create_pool`` shape: the kvpool backend for ``backend == "kvpool"``, else ValueError."""
    if backend != BACKEND_NAME:
        raise ValueError(f"unknown MemPool backend {backend!r} (role {role!r}); this factory provides {BACKEND_NAME!r}")
    return KVPoolMempool(config_path, role, **kwargs)


def flatten(item: object) -> Block | None:
    """A block's tensors in order, as MindIE's ``flatten_tensors`` takes them; None if anything is not a tensor."""
    if isinstance(item, torch.Tensor):
        return [item]
    if not isinstance(item, (list, tuple)):
        return None
    out: Block = []
    for sub in item:
        flat = flatten(sub)
        if flat is None:
            return None
        out.extend(flat)
    return out


class KVPoolMempool:
    """A MindIE MemPool backed by a kvpool client (see module docstring)."""

    def __init__(self, config_path: str, role: str = "scheduler", *, device_id: int = 0,
                 kv_caches: Sequence[Sequence[torch.Tensor]] | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, copier: PieceCopier | None = None, **kwargs: Any):
        """Connect to the pool ``config_path`` names; ValueError for a bad config, role or cache.

        ``copier`` moves bytes between engine tensors and staging (tests without a device replace it).
        """
        options.integer(device_id, "device_id", low=0)
        if kwargs:
            log.debug("kvpool MemPool ignores kwargs %s", sorted(kwargs))
        config, self.cache = load_mindie_config(config_path)
        self.device_id = device_id
        self._pieces = self.cache.pieces()
        self._block_bytes = self.cache.block_bytes
        self._copier = copier if copier is not None else PieceCopier()
        if role == "worker" and kv_caches is not None:
            self._check_cache(kv_caches)
        self.session = EngineSession(config, role, staging_bytes, "MindIE MemPool")
        self.session.namespace = KeyNamespace(config.model, self.cache.fingerprint(), 0, 1, config.tenant)
        self.role = role
        self.stats = self.session.stats
        log.info("kvpool MemPool %s ready (master %s, cache %s)", role, config.master, self.cache.fingerprint())

    # -- MindIE's calls -------------------------------------------------------------------

    def exists(self, key: str, **kwargs: Any) -> bool:
        """Whether the pool holds ``key``; False for a bad key or a fault."""
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
        """Store each key's block; per key, whether it was accepted (``[False]`` for bad arguments)."""
        checked = self._check_call("put", keys, tensors)
        if checked is None:
            return [False]
        block_keys, blocks = checked
        if not self.session.moves_data:
            return self.session.refuse("put", "the scheduler role moves no data", [False] * len(block_keys))
        names = [engine_hash(k.split("_", 1)[0], 10) for k in keys]  # "{prefix_hash}_{tp_rank}_{tp_size}_{model}"
        return self.session.put(block_keys, blocks, [self._block_bytes] * len(blocks), self._gather, names)

    def get(self, keys: str | list[str], tensors: Any, **kwargs: Any) -> list[bool]:
        """Fill each hit's tensors in place; per key, whether its block was loaded (misses stay untouched)."""
        checked = self._check_call("get", keys, tensors)
        if checked is None:
            return [False]
        block_keys, blocks = checked
        if not self.session.moves_data:
            return self.session.refuse("get", "the scheduler role moves no data", [False] * len(block_keys))
        return self.session.get(block_keys, blocks, [self._block_bytes] * len(blocks), self._scatter)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put reached the pool (or was dropped); False on timeout or when closed."""
        return self.session.flush(timeout)

    def close(self, **kwargs: Any) -> None:
        """Drain queued puts, release the client and staging buffers; later calls answer False. Idempotent."""
        self.session.close()

    # -- argument checks --------------------------------------------------------------------

    def _check_call(self, call: str, keys: object, tensors: object) -> tuple[list[BlockKey], list[Block]] | None:
        """Keys and flattened blocks if the arguments are well-formed for this cache, else None (refusal logged)."""
        if self.session.client is None:
            return self.session.refuse(call, "pool is closed", None)
        if isinstance(keys, str):  # one key with its one block (base.py's Union[str, List[str]])
            keys, tensors = [keys], [tensors]
        block_keys = self.session.keys(keys)
        if block_keys is None:
            return self.session.refuse(call, "keys must be a str or a list of non-empty str", None)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(block_keys):
            return self.session.refuse(call, f"need a list of one block per key ({len(block_keys)})", None)
        blocks: list[Block] = []
        device = None
        for i, item in enumerate(tensors):
            block = flatten(item)
            problem = "not a tensor or a (nested) list of tensors" if block is None else self._check_block(block)
            if problem:
                return self.session.refuse(call, f"block {i}: {problem} (cache {self.cache.fingerprint()})", None)
            assert block is not None
            for t in block:
                if device is None:
                    device = t.device
                elif t.device != device:
                    return self.session.refuse(call, f"block {i}: tensors on {device} and {t.device}", None)
            blocks.append(block)
        return block_keys, blocks

    def _check_block(self, block: Block) -> str:
        """'' if ``block`` is the cache's pieces, or one contiguous tensor of the block's bytes; else the problem."""
        if len(block) == 1:
            (t,) = block
            if t.numel() * t.element_size() != self._block_bytes or not t.is_contiguous():
                return f"one tensor of {tuple(t.shape)} {t.dtype} is not a contiguous {self._block_bytes}-byte block"
            return ""
        if len(block) != len(self._pieces):
            return f"{len(block)} tensors, the cache's blocks have {len(self._pieces)} (K and V of each layer)"
        for n, (t, (shape, dtype)) in enumerate(zip(block, self._pieces)):
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                return (f"layer {n // 2} {'KV'[n % 2]}: {tuple(t.shape)} {t.dtype} is not a contiguous {shape} "
                        f"{dtype}")
        return ""

    def _check_cache(self, kv_caches: object) -> None:
        """ValueError unless ``kv_caches`` is ``npu_cache``: per layer K and V (an index cache may follow)."""
        layers = self.cache.num_layers
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != layers:
            raise ValueError(f"kv_caches must hold {layers} layers (cache {self.cache.fingerprint()})")
        for layer, caches in enumerate(kv_caches):
            if not isinstance(caches, (list, tuple)) or len(caches) < 2:
                raise ValueError(f"kv_caches[{layer}] must hold K and V tensors")
            for part, cache in enumerate(caches[:2]):
                shape, dtype = self.cache.piece(layer, part)
                if not isinstance(cache, torch.Tensor) or tuple(cache.shape[1:]) != shape or cache.dtype != dtype:
                    got = (f"{tuple(cache.shape)} {cache.dtype}" if isinstance(cache, torch.Tensor)
                           else type(cache).__name__)
                    raise ValueError(f"kv_caches[{layer}][{part}]: expected [num_blocks, {', '.join(map(str, shape))}]"
                                     f" {dtype}, got {got} (cache {self.cache.fingerprint()})")

    # -- byte movement (staging callbacks) ----------------------------------------------------

    def _gather(self, blocks: Sequence[Block], region: torch.Tensor) -> None:
        self._copier.to_host([t for block in blocks for t in block], region)

    def _scatter(self, blocks: Sequence[Block], region: torch.Tensor) -> None:
        self._copier.to_device(region, [t for block in blocks for t in block])
