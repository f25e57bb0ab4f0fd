"""vllm-ascend's AscendStoreConnector backend on kvpool (``kv_connector_extra_config: {"backend": "kvpool"}``).

vllm-ascend (0.23.0.post1, ``vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/``;
docs/engines/vllm-ascend.md cites the lines) finds a backend by name in
``backend/__init__.py``'s ``backend_map`` and builds it as
``cls(parallel_config, lazy_init=<bool>)`` on a worker and
``cls.create_scheduler_client(parallel_config)`` on the scheduler. Installing
kvpool adds ``"kvpool"`` to that map in every vLLM process
(:mod:`.vllm_ascend_plugin`, a ``vllm.general_plugins`` entry point).

The connector calls the backend with raw addresses: ``put(keys, addrs, sizes)``
where ``addrs[i]``/``sizes[i]`` are the pieces of key ``i`` (each layer's K
and V block), after ``register_buffer(ptrs, lengths)`` named the KV cache
regions. Answers, as vllm-ascend reads them:

- ``get`` -> one int per key, :data:`OK` (0) = loaded; anything else is a
  block vllm-ascend recomputes (:data:`ERR_FAILED` a miss or fault,
  :data:`ERR_INVALID` a refused call). None only when ``keys`` is not a list
  (vllm-ascend reads None as "every block failed").
- ``exists`` / ``batch_is_exist`` -> one int per key, 1 = present, 0 = not.
- ``put`` -> one int per key as ``get`` (vllm-ascend ignores it).

Invariants:
- Memory safety: a piece is read or written only if it lies wholly inside a
  region given to ``register_buffer`` (:mod:`.regions`); any other address
  refuses the whole call before anything moves.
- Regions may be host or device memory; a :class:`~.device_copy.Copier`
  chosen by the kind of the registered memory (host, CUDA, Ascend NPU; or one
  passed in) moves the bytes, one batch per staged chunk, between the pieces
  and a reusable pinned host staging buffer (:mod:`.staging`) that the pool
  client reads and fills: one host staging copy at most.
- Bad input (keys not a list of str, mismatched lengths, non-integer or
  unregistered addresses, a key whose pieces do not add up to the layout's
  ``block_bytes`` when a layout is configured: :meth:`kvpool.layout.KVLayout.check_block`) is refused
  whole: logged, counted in ``stats["refused"]``, nothing changed, never an exception.
- A pool fault is a miss (``ERR_FAILED``); misses leave the engine's memory untouched.
- A key maps to a pool key with :func:`kvpool.keys.opaque_key` in the
  client's namespace (:mod:`.keymap`). Without a ``layout`` in the config a
  key is a raw block of any size (layer-wise keys, MLA's unequal K/V pieces).
- The scheduler-side instance holds no data memory and answers only ``exists``.
- A key string's last ``@`` field is vLLM's block hash in hex (``PoolKey.to_string()``); its 64-bit int form
  (:func:`block_hash`, vLLM's ``maybe_convert_block_hash``: the hash's last 8 bytes) goes with each put, so
  the master's KV events name the block as vLLM's own events would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.config import load_config
from kvpool.engines import options
from kvpool.engines.device_copy import Copier, DeviceCopyError, Piece, copier_for
from kvpool.engines.keymap import engine_hash
from kvpool.engines.regions import RegisteredMemory
from kvpool.engines.session import EngineSession
from kvpool.engines.staging import DEFAULT_STAGING_BYTES, BlockStager
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)


def block_hash(key: str) -> int:
    """vLLM's int form of the block hash (hex) that ends a vllm-ascend key string; 0 if it is not hex."""
    return engine_hash(key.rsplit("@", 1)[-1], 16)

CONFIG_ENV = "KVPOOL_CONFIG_PATH"  # read when no config path is passed (vllm-ascend passes only parallel_config)
EXTRA_CONFIG_KEY = "kvpool_config_path"  # the same path inside kv_connector_extra_config

OK = 0
ERR_FAILED = -1  # a miss, a pool fault, a failed device copy, or a full write-behind queue
ERR_INVALID = -2  # refused: bad arguments, unregistered memory, wrong size, scheduler role, closed


def _extra_config_path() -> str:
    """``kv_connector_extra_config["kvpool_config_path"]`` of the running vLLM, if vLLM is there and says so
    (``""`` if not); ValueError if it is not a path."""
    try:
        from vllm.config import get_current_vllm_config

        transfer = get_current_vllm_config().kv_transfer_config
        extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    except Exception:  # noqa: BLE001 - no vLLM, or no current config: fall back to the environment
        return ""
    return options.path(extra.get(EXTRA_CONFIG_KEY, ""), f"kv_connector_extra_config.{EXTRA_CONFIG_KEY}")


class KVPoolStoreBackend:
    """An AscendStoreConnector backend backed by a kvpool client (see module docstring)."""

    store: Any = None  # vllm-ascend's Backend attribute: a native store object, used only by memcache's GVA paths

    def __init__(self, parallel_config: Any = None, lazy_init: bool = False, *, config_path: str | None = None,
                 role: str = "worker", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 host_memory: bool | None = None, copier: Copier | None = None):
        """Connect to the pool; the config path is ``config_path``, else vLLM's extra config, else $KVPOOL_CONFIG_PATH.

        ``parallel_config`` (vLLM's ParallelConfig, or None) gives ``rank`` and
        ``tensor_parallel_size`` (informational: the connector's key strings
        carry the rank). ``lazy_init`` is accepted as vllm-ascend passes it (its
        Mooncake and memcache backends defer allocating fabric memory); kvpool
        has nothing to defer. ``copier`` fixes how registered memory is copied;
        by default it is chosen at ``register_buffer`` from the memory's kind,
        where ``host_memory`` True/False overrides the guess (see
        :func:`~.device_copy.copier_for`). ValueError for a missing or bad config
        or an unknown role.
        """
        path = config_path or _extra_config_path() or os.environ.get(CONFIG_ENV, "")
        if not path:
            raise ValueError(f"no kvpool config: pass config_path, set kv_connector_extra_config.{EXTRA_CONFIG_KEY} "
                             f"or ${CONFIG_ENV}")
        self.tp_size = max(1, int(getattr(parallel_config, "tensor_parallel_size", 1) or 1))
        self.tp_rank = int(getattr(parallel_config, "rank", 0) or 0) % self.tp_size
        self.lazy_init = bool(lazy_init)
        self.host_memory = host_memory
        self.copier = copier
        config = load_config(path).client
        self.layout = config.layout
        self.memory = RegisteredMemory()
        self.session = EngineSession(config, role, staging_bytes, "vllm-ascend store backend")
        self.role = role
        self.stats = self.session.stats
        log.info("kvpool store backend %s ready (tp %d/%d, master %s)", role, self.tp_rank, self.tp_size, config.master)

    @classmethod
    def create_scheduler_client(cls, parallel_config: Any = None, **kwargs: Any) -> KVPoolStoreBackend:
        """The scheduler side's instance: answers ``exists`` only, holds no data memory."""
        return cls(parallel_config, role="scheduler", **kwargs)

    # -- the connector's calls ---------------------------------------------------------------

    def set_device(self) -> None:
        """Make the registered memory's device current in this (transfer) thread; never raises."""
        copier = self.copier
        if copier is None:
            return
        try:
            copier.set_device()
        except DeviceCopyError as exc:  # copies from this thread will fail, and count as misses
            self.session.fault("set_device", exc, None)

    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        """Accept pieces inside these regions from now on (all or nothing; a bad batch is logged and ignored)."""
        if not self.session.moves_data:
            self.session.refuse("register_buffer", "only an open worker registers memory", None)
            return
        copier = self.copier
        if copier is None and isinstance(ptrs, (list, tuple)) and all(isinstance(p, int) for p in ptrs):
            try:
                copier = copier_for(ptrs, self.host_memory)
            except DeviceCopyError as exc:
                self.session.refuse("register_buffer", f"no way to copy this memory: {exc}", None)
                return
        if copier is None or not self.memory.register(ptrs, lengths, host=copier.kind == "host"):
            self.session.refuse("register_buffer", "need equally long lists of positive int pointers and lengths, "
                                                   "not partly overlapping registered regions", None)
            return
        self.copier = copier

    def exists(self, keys: list[str]) -> list[int]:
        """Per key, 1 if the pool (or this worker's HBM tier) holds it, else 0; all 0 for bad keys or a fault."""
        block_keys = self.session.keys(keys)
        if block_keys is None or self.session.client is None:
            n = len(keys) if isinstance(keys, (list, tuple)) else 0
            return self.session.refuse("exists", "closed, or keys are not a list of non-empty str", [0] * n)
        return [1 if found else 0 for found in self.session.exists(block_keys)]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """:meth:`exists` under the name vllm-ascend's scheduler calls (``Backend.batch_is_exist``)."""
        return self.exists(keys)

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int] | None:
        """Store each key's pieces as one block. Per key: OK (accepted for the pool), ERR_FAILED or ERR_INVALID."""
        checked = self._check_call("put", keys, addrs, sizes)
        if not isinstance(checked, tuple):
            return checked
        block_keys, pieces, totals = checked
        ok = self.session.put(block_keys, pieces, totals, self._gather, [block_hash(k) for k in keys])
        results = [OK if accepted else ERR_FAILED for accepted in ok]
        if ERR_FAILED in results:
            log.warning("kvpool put: %d of %d keys not stored", results.count(ERR_FAILED), len(results))
        return results

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int] | None:
        """Load each key's block into its pieces. Per key: OK (loaded), ERR_FAILED (not loaded) or ERR_INVALID."""
        checked = self._check_call("get", keys, addrs, sizes)
        if not isinstance(checked, tuple):
            return checked
        block_keys, pieces, totals = checked
        ok = self.session.get(block_keys, pieces, totals, self._scatter)
        results = [OK if loaded else ERR_FAILED for loaded in ok]
        if ERR_FAILED in results:
            log.debug("kvpool get: %d of %d keys not loaded", results.count(ERR_FAILED), len(results))
        return results

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put reached the pool (or was dropped); False on timeout or when closed."""
        return self.session.flush(timeout)

    def close(self) -> None:
        """Drain queued puts, forget registered memory, release the client; later calls are refused. Idempotent."""
        self.session.close()
        self.memory.clear()

    # -- argument checks ----------------------------------------------------------------------------

    def _check_call(self, call: str, keys: object, addrs: object,
                    sizes: object) -> tuple[list[BlockKey], list[list[Piece]], list[int]] | list[int] | None:
        """(pool keys, each key's pieces, each key's total bytes), or the refusal to return."""
        n = len(keys) if isinstance(keys, (list, tuple)) else None
        refused = None if n is None else [ERR_INVALID] * n
        if not self.session.moves_data:
            return self.session.refuse(call, "only an open worker moves data", refused)
        block_keys = self.session.keys(keys)
        if block_keys is None or n is None:
            return self.session.refuse(call, "keys must be a list of non-empty str", refused)
        if not isinstance(addrs, (list, tuple)) or not isinstance(sizes, (list, tuple)) or \
                not len(addrs) == len(sizes) == n:
            return self.session.refuse(call, f"need {n} address lists and {n} size lists", refused)
        pieces: list[list[Piece]] = []
        totals: list[int] = []
        for i, (key_addrs, key_sizes) in enumerate(zip(addrs, sizes)):
            if not isinstance(key_addrs, (list, tuple)) or not isinstance(key_sizes, (list, tuple)) or \
                    not key_addrs or len(key_addrs) != len(key_sizes):
                return self.session.refuse(call, f"key {i}: addresses and sizes must be equally long non-empty lists",
                                           refused)
            found = [self.memory.piece(a, s) for a, s in zip(key_addrs, key_sizes)]
            key_pieces = [p for p in found if p is not None]
            if len(key_pieces) < len(found):
                return self.session.refuse(call, f"key {i}: a piece lies outside the registered buffers", refused)
            total = sum(size for _, size in key_pieces)
            if self.layout is not None:
                try:
                    self.layout.check_block(total, what=f"key {i}: its pieces")
                except ValueError as exc:
                    return self.session.refuse(call, str(exc), refused)
            pieces.append(key_pieces)
            totals.append(total)
        return block_keys, pieces, totals

    # -- byte movement (staging callbacks) ------------------------------------------------------------

    def _staged(self, region: torch.Tensor, stager: BlockStager | None) -> tuple[Copier, int]:
        """The copier and the staging chunk's host address, the stager's whole buffer pinned for the copier."""
        copier = self.copier
        assert copier is not None, "vllm-ascend store backend: pieces checked against no registered memory"
        address = region.data_ptr()
        if stager is not None and copier.kind != "host":
            try:
                pinned = bool(region.is_pinned())  # torch's own pinned allocator (CUDA, or torch_npu's)
            except RuntimeError:
                pinned = False
            copier.pin(address, stager.allocated_bytes, already_pinned=pinned)
        return copier, address

    def _gather(self, blocks: Sequence[list[Piece]], region: torch.Tensor) -> None:
        copier, address = self._staged(region, self.session.put_stager)
        copier.to_host([piece for block in blocks for piece in block], address)

    def _scatter(self, blocks: Sequence[list[Piece]], region: torch.Tensor) -> None:
        copier, address = self._staged(region, self.session.get_stager)
        copier.to_device(address, [piece for block in blocks for piece in block])
