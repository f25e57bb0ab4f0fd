"""SGLang HiCache's L3 storage backend on kvpool (``--hicache-storage-backend dynamic``).

SGLang's storage factory (``sglang/srt/mem_cache/storage/backend_factory.py``)
builds an out-of-tree backend as ``cls(storage_config, kwargs)`` from
``--hicache-storage-backend-extra-config '{"backend_name": "kvpool", "module_path":
"kvpool.engines.sglang", "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
"kvpool_config_path": "/etc/kvpool/client.json"}'``; the cache controller then calls
``register_mem_pool_host(host_pool)`` and, from its prefetch and backup threads,
``batch_exists`` (leading count) and either the zero-copy pair
``batch_get_v1`` / ``batch_set_v1(keys, host_indices, extra_info) -> list[bool]``
(``interface_v1``) or the generic ``batch_get`` / ``batch_set`` on flat page
tensors. See docs/engines/sglang.md for the flags and the engine lines each
convention comes from.

Invariants:
- One SGLang page is one pool block. Zero-copy calls read and write the host
  pool's page buffers at the addresses ``host_pool.get_page_buffer_meta``
  gives (a page's pieces, in that order, are the block's bytes); generic
  calls move the flat page tensors SGLang hands over.
- Memory safety: a zero-copy piece is touched only if it lies wholly inside a
  host pool tensor registered by ``register_mem_pool_host`` (:mod:`.regions`);
  a flat page must be a contiguous CPU tensor of exactly one page; anything
  else refuses the call before a byte moves. Bytes move between those and the
  session's staging buffer (:mod:`.staging`) by memmove
  (:class:`~kvpool.engines.device_copy.HostCopier`): one host copy each way.
- Keys: SGLang's page hash strings, scoped by SGLang's model name, the rank
  (``tp{rank}/{size}``; one scope for every rank of an MLA model, whose KV is
  replicated), the pipeline and context-parallel rank where those split pages,
  and the page format (host pool class, layout, page size, dtype, page bytes,
  and zero-copy vs flat byte order), then mapped into the kvpool client's
  namespace (model, tenant) by :mod:`.keymap`. Ranks or formats that hold
  different bytes never share a key.
- MLA: only the writer rank (``HiCacheStorageConfig.is_storage_writer``, TP
  rank 0) stores; a set on another rank stores nothing and answers True for
  every page (the writer stores them), as SGLang's NIXL backend does.
- A pool fault is a miss (False, ``None``, ``0``), never an exception. Bad
  input (keys not a list of non-empty str, indices or tensors that do not
  match the host pool, memory outside it) is refused whole: logged, counted in
  ``stats["refused"]``, nothing changed, and answered as a miss.
- A set reports True for pages already in the pool without moving them, and
  for pages accepted into kvpool's write-behind queue; ``flush`` waits for them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvpool.config import ClientConfig, load_config
from kvpool.engines import options
from kvpool.engines.device_copy import HostCopier, Piece
from kvpool.engines.keymap import engine_hash
from kvpool.engines.regions import RegisteredMemory
from kvpool.engines.session import EngineSession
from kvpool.engines.staging import DEFAULT_STAGING_BYTES
from kvpool.keys import BlockKey, leading_hits
from kvpool.layout import check_block

log = logging.getLogger(__name__)
_LEADING_HEX = re.compile(r"[0-9a-fA-F]+")  # an SGLang page key starts with its page hash in hex

CONFIG_ENV = "KVPOOL_CONFIG_PATH"  # read when the extra config names no path
EXTRA_CONFIG = "hicache-storage-backend-extra-config"  # SGLang's flag for the extra config (errors name it)
EXTRA_CONFIG_KEY = "kvpool_config_path"  # the path inside --hicache-storage-backend-extra-config

# Host pool tensors that may hold page bytes (MHA/MLA kv_buffer, split-KV and indexer buffers).
_HOST_BUFFER_ATTRS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")

Pieces = list[Piece]  # one page: (address, bytes) ranges of host memory, in get_page_buffer_meta's order
_COPIER = HostCopier()  # host pool pages and flat page tensors are host memory


class KVPoolHiCacheStorage(HiCacheStorage):
    """An SGLang HiCache L3 backend backed by a kvpool client (see module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None, *,
                 config_path: str | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        """Connect to the pool; the config is ``config_path``, else ``extra_config["kvpool_config_path"]``,
        else ``$KVPOOL_CONFIG_PATH``. ValueError for a missing or bad config or an unsupported topology.
        """
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        interface_v1 = options.flag(extra.get("interface_v1", False), f"{EXTRA_CONFIG}.interface_v1", words=False,
                                    words_why=" (SGLang's cache controller reads it by truth value: there the "
                                              "string 'false' turns it on)")
        path = config_path or options.path(extra.get(EXTRA_CONFIG_KEY, ""), f"{EXTRA_CONFIG}.{EXTRA_CONFIG_KEY}") \
            or os.environ.get(CONFIG_ENV, "")
        if not path:
            raise ValueError(f"no kvpool config: set {EXTRA_CONFIG_KEY!r} in --hicache-storage-backend-extra-config "
                             f"or ${CONFIG_ENV}")
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvpool's HiCache backend does not split heads across heterogeneous TP "
                             "(tp_lcm_size); use one TP size per model")
        if kwargs:
            log.debug("kvpool HiCache storage ignores kwargs %s", sorted(kwargs))
        config: ClientConfig = load_config(path).client
        self.storage_config = storage_config
        self.interface_v1 = interface_v1
        self.is_writer = _is_writer(storage_config)
        self.rank_scope = _rank_scope(storage_config)
        self.page_bytes = {"zc": 0, "flat": 0}  # per byte order, known once the host pool is registered
        self._scopes: dict[str, str] = {}
        self.memory = RegisteredMemory()
        self.session = EngineSession(config, "worker", staging_bytes, "SGLang HiCache storage")
        self.stats = self.session.stats
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}
        log.info("kvpool HiCache storage ready (%s, %s, master %s, interface_v1=%s)", self.rank_scope,
                 "writer" if self.is_writer else "reader", config.master, self.interface_v1)

    # -- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool whose page buffers the calls move; ValueError if its pages cannot be pool blocks.

        Each byte order (``"zc"``: the pieces of ``get_page_buffer_meta``; ``"flat"``: the
        flat page tensors of the generic calls) is served if the host pool can describe it.
        """
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(getattr(mem_pool_host, "page_size", 0) or 0)
        fmt = (f"{type(mem_pool_host).__name__}:{getattr(mem_pool_host, 'layout', '?')}:p{page_size}:"
               f"{getattr(mem_pool_host, 'dtype', '?')}")
        regions = [t for t in _host_tensors(mem_pool_host) if t.device.type == "cpu"]
        if page_size < 1 or not regions:
            log.warning("kvpool HiCache storage: host pool %s has no host page buffers; every call is a miss", fmt)
            return
        for tensor in regions:  # one at a time, largest first: a view inside a registered buffer is covered
            self.memory.register([tensor.data_ptr()], [tensor.numel() * tensor.element_size()])
        for order, measure in (("zc", _zero_copy_page_bytes), ("flat", _flat_page_bytes)):
            try:
                nbytes = measure(mem_pool_host, page_size)
            except Exception as exc:  # noqa: BLE001 - a layout SGLang cannot describe this way: not served
                log.warning("kvpool HiCache storage: %s pages of %s not served: %r", order, fmt, exc)
                continue
            layout = self.session.client.layout if self.session.client is not None else None
            if layout is not None:
                try:
                    layout.check_block(nbytes, what=f"an SGLang page ({fmt}, {order})")
                except ValueError as exc:
                    raise ValueError(f"{exc} (the kvpool config's layout): drop the layout (pages are raw blocks) "
                                     "or fix it") from None
            self.page_bytes[order] = nbytes
            self._scopes[order] = f"sglang|{self._model()}|{self.rank_scope}|{fmt}:{nbytes}B:{order}"

    # -- which pages exist --------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether the pool holds ``key``'s page (in the byte order this instance moves)."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` the pool holds; 0 for bad keys or a fault."""
        block_keys = self._keys("batch_exists", keys, "zc" if self.interface_v1 else "flat")
        if not block_keys:
            return 0
        return leading_hits(self.session.exists(block_keys))

    # -- zero-copy calls (interface_v1) ------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load each page the pool holds into the host pool at ``host_indices``; per key, loaded."""
        checked = self._pages("batch_get_v1", keys, host_indices)
        if checked is None:
            return [False] * _count(keys)
        block_keys, pages = checked
        start = time.perf_counter()
        ok = self.session.get(block_keys, pages, [self.page_bytes["zc"]] * len(pages), _scatter)
        self._record("prefetch", sum(ok), self.page_bytes["zc"], start)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; per key, held or accepted by the pool."""
        checked = self._pages("batch_set_v1", keys, host_indices)
        if checked is None:
            return [False] * _count(keys)
        block_keys, pages = checked
        return self._store(block_keys, pages, self.page_bytes["zc"], keys)

    # -- generic calls (flat page tensors) -----------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """``key``'s page in ``target_location`` (a flat page tensor; one is made if None), or None on a miss."""
        if target_location is None and self._scopes:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Per key, its target filled with the page, or None (a miss; the target is left as it was)."""
        n = _count(keys)
        checked = self._flat("batch_get", keys, target_locations)
        if checked is None:
            return [None] * n
        block_keys, pages = checked
        start = time.perf_counter()
        ok = self.session.get(block_keys, pages, [self.page_bytes["flat"]] * n, _scatter)
        self._record("prefetch", sum(ok), self.page_bytes["flat"], start)
        return [target if hit else None for target, hit in zip(target_locations, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page tensor under ``key``; True if the pool holds or accepted it."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat page tensors; True only if every page is held or accepted by the pool."""
        if isinstance(keys, (list, tuple)) and not keys:
            return True
        checked = self._flat("batch_set", keys, values)
        if checked is None:
            return False
        block_keys, pages = checked
        return all(self._store(block_keys, pages, self.page_bytes["flat"], keys))

    # -- the rest of HiCacheStorage ----------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing is removed: the pool is shared (other engines' pages) and evicts by itself; logged."""
        log.warning("kvpool HiCache storage: clear() removes nothing; the pool is shared and evicts on its own "
                    "(restart the pool's nodes to empty it)")

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call, when storage metrics are enabled; else None."""
        if not getattr(self.storage_config, "enable_storage_metrics", False):
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted page reached the pool (or was dropped); False on timeout or when closed."""
        return self.session.flush(timeout)

    def close(self) -> None:
        """Drain queued pages, forget the host pool's memory, release the client; later calls miss. Idempotent."""
        self.session.close()
        self.memory.clear()
        self._scopes = {}

    # -- argument checks --------------------------------------------------------------------------------

    def _model(self) -> str:
        name = getattr(self.storage_config, "model_name", None) or ""
        return "-".join(str(name).split("/"))

    def _keys(self, call: str, keys: object, order: str) -> list[BlockKey] | None:
        """Pool keys of SGLang page hashes in ``order``'s scope; [] for no keys, None (refused) if unusable."""
        scope = self._scopes.get(order)
        if scope is None or self.session.client is None:
            return self.session.refuse(call, "closed, or no host pool registered", None)
        if not isinstance(keys, (list, tuple)):
            return self.session.refuse(call, "keys must be a list of str", None)
        names = [f"{scope}|{k}" if isinstance(k, str) and k else None for k in keys]
        block_keys = self.session.keys(names)
        if block_keys is None:
            return self.session.refuse(call, "keys must be non-empty str", None)
        return block_keys

    def _pages(self, call: str, keys: object, host_indices: object) -> tuple[list[BlockKey], list[Pieces]] | None:
        """Pool keys and each page's pieces in the host pool at ``host_indices``; None if refused."""
        block_keys = self._keys(call, keys, "zc")
        if not block_keys:
            return None
        n, page_size = len(block_keys), int(self.mem_pool_host.page_size)
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or \
                host_indices.is_floating_point() or host_indices.numel() != n * page_size:
            return self.session.refuse(call, f"host_indices must be a 1-D integer tensor of {n} pages x "
                                             f"{page_size} tokens", None)
        try:
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        except Exception as exc:  # noqa: BLE001 - SGLang's own checks (alignment, layout) refuse the call
            return self.session.refuse(call, f"get_page_buffer_meta refused the indices: {exc!r}", None)
        if len(ptrs) != len(sizes) or len(ptrs) % n:
            return self.session.refuse(call, f"{len(ptrs)} buffers for {n} pages", None)
        per_page = len(ptrs) // n
        found = [self.memory.piece(p, s) for p, s in zip(ptrs, sizes)]
        pieces = [p for p in found if p is not None]
        if len(pieces) < len(found):
            return self.session.refuse(call, "a page lies outside the registered host pool", None)
        pages = [pieces[i * per_page : (i + 1) * per_page] for i in range(n)]
        try:
            for i, page in enumerate(pages):
                check_block(sum(size for _, size in page), self.page_bytes["zc"], what=f"page {i}")
        except ValueError as exc:
            return self.session.refuse(call, str(exc), None)
        return block_keys, pages

    def _flat(self, call: str, keys: object, tensors: object) -> tuple[list[BlockKey], list[Pieces]] | None:
        """Pool keys and each flat page tensor as one uint8 piece; None if refused."""
        block_keys = self._keys(call, keys, "flat")
        if not block_keys:
            return None
        nbytes = self.page_bytes["flat"]
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(block_keys):
            return self.session.refuse(call, f"need one page tensor per key ({len(block_keys)})", None)
        pages: list[Pieces] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return self.session.refuse(call, f"page {i} must be a CPU tensor", None)
            try:
                check_block(t, nbytes, what=f"page {i}")
            except ValueError as exc:
                return self.session.refuse(call, str(exc), None)
            pages.append([(t.data_ptr(), nbytes)])
        return block_keys, pages

    # -- data movement ------------------------------------------------------------------------------------

    def _store(self, block_keys: list[BlockKey], pages: list[Pieces], nbytes: int, names: list[str]) -> list[bool]:
        """Per page, True if the pool holds it or accepted it; pages it holds are not moved again. ``names``:
        the engine's key strings (their leading hex, SGLang's page hash, names the page in KV events)."""
        if not self.is_writer:
            self.stats["writer_skips"] += len(block_keys)
            return [True] * len(block_keys)
        held = self.session.exists(block_keys)
        todo = [i for i, h in enumerate(held) if not h]
        ok = list(held)
        if todo:
            start = time.perf_counter()
            hashes = [engine_hash(m.group(0), 16) if (m := _LEADING_HEX.match(names[i])) else 0 for i in todo]
            accepted = self.session.put([block_keys[i] for i in todo], [pages[i] for i in todo], [nbytes] * len(todo),
                                        _gather, hashes)
            self._record("backup", sum(accepted), nbytes, start)
            for i, a in zip(todo, accepted):
                ok[i] = a
        return ok

    def _record(self, kind: str, pages: int, nbytes: int, start: float) -> None:
        if not pages or not getattr(self.storage_config, "enable_storage_metrics", False):
            return
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)


def _count(keys: object) -> int:
    return len(keys) if isinstance(keys, (list, tuple)) else 0


def _is_writer(config: HiCacheStorageConfig) -> bool:
    """SGLang's ``is_storage_writer`` (MLA: TP rank 0 writes; MHA: every rank)."""
    writer = getattr(config, "is_storage_writer", None)
    if isinstance(writer, bool):
        return writer
    return not getattr(config, "is_mla_model", False) or getattr(config, "tp_rank", 0) == 0


def _rank_scope(config: HiCacheStorageConfig) -> str:
    """The part of the key scope that tells ranks holding different bytes apart."""
    parts = ["mla" if getattr(config, "is_mla_model", False) else f"tp{config.tp_rank}/{config.tp_size}"]
    if getattr(config, "pp_size", 1) > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if getattr(config, "attn_cp_size", 1) > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    return ",".join(parts)


def _zero_copy_page_bytes(host_pool: Any, page_size: int) -> int:
    """Bytes of one page as ``get_page_buffer_meta`` describes it (the sum of its pieces)."""
    _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    return int(sum(sizes))


def _flat_page_bytes(host_pool: Any, page_size: int) -> int:
    """Bytes of one flat page tensor (what the generic calls move)."""
    page = host_pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def _host_tensors(host_pool: Any) -> list[torch.Tensor]:
    """The host pool's page buffers, largest first (so views inside them come after)."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    candidates: list[Any] = [getattr(host_pool, name, None) for name in _HOST_BUFFER_ATTRS]
    hybrid = getattr(host_pool, "get_hybrid_pool_buffer", None)
    if callable(hybrid):
        candidates.extend(hybrid())
    for c in candidates:
        for t in c if isinstance(c, (list, tuple)) else [c]:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                found.setdefault((t.data_ptr(), t.numel() * t.element_size()), t)
    return sorted(found.values(), key=lambda t: -(t.numel() * t.element_size()))


# -- byte movement (staging callbacks): pieces are ranges of host memory, checked when the call was ------------


def _gather(pages: Sequence[Pieces], region: torch.Tensor) -> None:
    _COPIER.to_host([piece for page in pages for piece in page], region.data_ptr())


def _scatter(pages: Sequence[Pieces], region: torch.Tensor) -> None:
    _COPIER.to_device(region.data_ptr(), [piece for page in pages for piece in page])
