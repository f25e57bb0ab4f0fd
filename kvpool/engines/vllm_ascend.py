"""vllm-ascend's AscendStoreConnector backend on kvpool (``kv_connector_extra_config: {"backend": "kvpool"}``).

The connector calls a backend with raw addresses: ``put(keys, addrs, sizes)``
where ``addrs[i]``/``sizes[i]`` are the pieces of key ``i`` (each layer's K
and V block, in that order), after ``register_buffer(ptrs, lengths)`` named the
KV cache regions. See docs/engines/vllm-ascend.md for the registration.

Return values follow vllm-ascend's ``Backend`` and its Mooncake and memcache
backends: ``exists`` answers one int per key (1 = present); ``put`` and
``get`` return None and report failures only in the log. The per-key outcome
is available from :meth:`KVPoolStoreBackend.batch_put_from_multi_buffers`
and :meth:`~KVPoolStoreBackend.batch_get_into_multi_buffers` (Mooncake
store's names and convention: put 0 = stored, get = bytes read, negative =
:data:`ERR_FAILED` or :data:`ERR_INVALID`), which ``put``/``get`` wrap.

Invariants:
- Memory safety: a piece is read or written only if it lies wholly inside a
  region given to ``register_buffer`` (:mod:`.regions`); any other address
  refuses the whole call before anything moves. Regions must be host memory:
  in a process that drives an NPU, registration is refused (device pointers
  cannot be dereferenced here) unless ``host_memory=True`` says otherwise.
- Bad input (keys not a list of str, mismatched lengths, non-integer or
  unregistered addresses, a key whose pieces do not add up to the layout's
  ``block_bytes`` when a layout is configured) is refused whole: logged,
  counted in ``stats["refused"]``, nothing changed, never an exception.
- A key maps to a pool key with :func:`kvpool.keys.opaque_key` in the
  client's namespace (:mod:`.keymap`). Without a ``layout`` in the config a
  key is a raw block of any size (layer-wise keys, MLA's unequal K/V pieces).
- Pieces move through a reusable host staging buffer (:mod:`.staging`): one
  ``np.concatenate(out=)`` per chunk on put, one ``np.copyto`` per piece of a
  loaded block on get; misses leave the engine's memory untouched.
- The scheduler-side instance (:meth:`create_scheduler_client`) holds no data
  memory and answers only ``exists``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool.config import load_config
from kvpool.engines.regions import RegisteredMemory
from kvpool.engines.session import EngineSession
from kvpool.engines.staging import DEFAULT_STAGING_BYTES
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

BACKEND_NAME = "kvpool"
CONFIG_ENV = "KVPOOL_CONFIG_PATH"  # read when no config path is passed (vllm-ascend passes only parallel_config)
EXTRA_CONFIG_KEY = "kvpool_config_path"  # the same path inside kv_connector_extra_config

OK = 0
ERR_FAILED = -1  # a miss, a pool fault, or a full write-behind queue
ERR_INVALID = -2  # refused: bad arguments, unregistered memory, wrong size, scheduler role, closed


def _npu_present() -> bool:
    """Whether this process drives an Ascend NPU (torch_npu loaded and a device available)."""
    if sys.modules.get("torch_npu") is None:
        return False
    try:
        # torch_npu adds torch.npu when it is imported: torch's own types cannot know it
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return False


def _extra_config_path() -> str:
    """``kv_connector_extra_config["kvpool_config_path"]`` of the running vLLM, if vLLM is there and says so."""
    try:
        from vllm.config import get_current_vllm_config

        transfer = get_current_vllm_config().kv_transfer_config
        extra = getattr(transfer, "kv_connector_extra_config", None) or {}
        return str(extra.get(EXTRA_CONFIG_KEY, ""))
    except Exception:  # noqa: BLE001 - no vLLM, or no current config: fall back to the environment
        return ""


class KVPoolStoreBackend:
    """An AscendStoreConnector backend backed by a kvpool client (see module docstring)."""

    def __init__(self, parallel_config: Any = None, *, config_path: str | None = None, role: str = "worker",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, host_memory: bool | None = None, **kwargs: Any):
        """Connect to the pool; the config path is ``config_path``, else vLLM's extra config, else $KVPOOL_CONFIG_PATH.

        ``parallel_config`` (vLLM's ParallelConfig, or None) gives ``tp_rank``/``tp_size``
        (informational: the connector's key strings carry the rank). ``host_memory``
        says registered buffers are host-addressable; by default they are taken to be
        unless this process drives an NPU, whose KV cache pointers the CPU cannot
        dereference (those registrations are refused rather than crash the engine).
        ValueError for a missing or bad config or an unknown role.
        """
        if kwargs:
            log.debug("kvpool store backend ignores kwargs %s", sorted(kwargs))
        path = config_path or _extra_config_path() or os.environ.get(CONFIG_ENV, "")
        if not path:
            raise ValueError(f"no kvpool config: pass config_path, set kv_connector_extra_config.{EXTRA_CONFIG_KEY} "
                             f"or ${CONFIG_ENV}")
        self.tp_size = max(1, int(getattr(parallel_config, "tensor_parallel_size", 1) or 1))
        self.tp_rank = int(getattr(parallel_config, "rank", 0) or 0) % self.tp_size
        self.host_memory = (not _npu_present()) if host_memory is None else bool(host_memory)
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
        """Nothing to do: this backend copies with the CPU only, so its threads need no device context."""

    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        """Accept pieces inside these host regions from now on (all or nothing; a bad batch is logged and ignored)."""
        if not self.session.moves_data:
            self.session.refuse("register_buffer", "only an open worker registers memory", None)
        elif not self.host_memory:
            self.session.refuse("register_buffer", "these are device (NPU) buffers; this backend reads and writes "
                                "host-addressable memory only (see docs/engines/vllm-ascend.md)", None)
        elif not self.memory.register(ptrs, lengths):
            self.session.refuse("register_buffer", "need equally long lists of positive int pointers and lengths, "
                                                   "not partly overlapping registered regions", None)

    def exists(self, keys: list[str]) -> list[int]:
        """Per key, 1 if the pool (or this worker's HBM tier) holds it, else 0; all 0 for bad keys or a fault."""
        block_keys = self.session.keys(keys)
        if block_keys is None or self.session.client is None:
            n = len(keys) if isinstance(keys, (list, tuple)) else 0
            return self.session.refuse("exists", "closed, or keys are not a list of non-empty str", [0] * n)
        return [1 if found else 0 for found in self.session.exists(block_keys)]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Alias of :meth:`exists` (the name newer vllm-ascend and Mooncake use)."""
        return self.exists(keys)

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> None:
        """Store each key's pieces as one block; failures are logged (vllm-ascend's backends return nothing)."""
        results = self.batch_put_from_multi_buffers(keys, addrs, sizes)
        failed = results.count(ERR_FAILED)  # refusals were logged when refused
        if failed:
            log.warning("kvpool put: %d of %d keys not stored", failed, len(results))

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> None:
        """Load each key's block into its pieces; misses are logged at debug and leave the memory untouched."""
        results = self.batch_get_into_multi_buffers(keys, addrs, sizes)
        missed = results.count(ERR_FAILED)
        if missed:
            log.debug("kvpool get: %d of %d keys not loaded", missed, len(results))

    # -- per-key results (Mooncake store convention) ----------------------------------------------

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[int]:
        """Per key: :data:`OK` (accepted for the pool), :data:`ERR_FAILED`, or :data:`ERR_INVALID` for all."""
        checked = self._check_call("put", keys, addrs, sizes)
        if isinstance(checked, list):
            return checked
        block_keys, pieces, totals = checked
        ok = self.session.put(block_keys, pieces, totals, _gather)
        return [OK if hit else ERR_FAILED for hit in ok]

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[int]:
        """Per key: bytes loaded into its pieces, :data:`ERR_FAILED` (not loaded), or :data:`ERR_INVALID` for all."""
        checked = self._check_call("get", keys, addrs, sizes)
        if isinstance(checked, list):
            return checked
        block_keys, pieces, totals = checked
        ok = self.session.get(block_keys, pieces, totals, _scatter)
        return [total if hit else ERR_FAILED for hit, total in zip(ok, totals)]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put reached the pool (or was dropped); False on timeout or when closed."""
        return self.session.flush(timeout)

    def close(self) -> None:
        """Drain queued puts, forget registered memory, release the client; later calls are refused. Idempotent."""
        self.session.close()
        self.memory.clear()

    # -- argument checks ----------------------------------------------------------------------------

    def _check_call(self, call: str, keys: object, addrs: object,
                    sizes: object) -> tuple[list[BlockKey], list[list[np.ndarray]], list[int]] | list[int]:
        """(pool keys, each key's piece views, each key's total bytes), or the refusal to return."""
        n = len(keys) if isinstance(keys, (list, tuple)) else 1
        if not self.session.moves_data:
            return self.session.refuse(call, "only an open worker moves data", [ERR_INVALID] * n)
        block_keys = self.session.keys(keys)
        if block_keys is None:
            return self.session.refuse(call, "keys must be a list of non-empty str", [ERR_INVALID] * n)
        if not isinstance(addrs, (list, tuple)) or not isinstance(sizes, (list, tuple)) or \
                not len(addrs) == len(sizes) == n:
            return self.session.refuse(call, f"need {n} address lists and {n} size lists", [ERR_INVALID] * n)
        pieces: list[list[np.ndarray]] = []
        totals: list[int] = []
        for i, (key_addrs, key_sizes) in enumerate(zip(addrs, sizes)):
            if not isinstance(key_addrs, (list, tuple)) or not isinstance(key_sizes, (list, tuple)) or \
                    not key_addrs or len(key_addrs) != len(key_sizes):
                return self.session.refuse(call, f"key {i}: addresses and sizes must be equally long non-empty lists",
                                    [ERR_INVALID] * n)
            views = [self.memory.view(a, s) for a, s in zip(key_addrs, key_sizes)]
            found = [v for v in views if v is not None]
            if len(found) < len(views):
                return self.session.refuse(call, f"key {i}: a piece lies outside the registered buffers",
                                           [ERR_INVALID] * n)
            total = sum(v.size for v in found)
            if self.layout is not None and total != self.layout.block_bytes:
                return self.session.refuse(call, f"key {i}: pieces add up to {total} bytes; a block of "
                                           f"{self.layout.fingerprint()} is {self.layout.block_bytes}",
                                           [ERR_INVALID] * n)
            pieces.append(found)
            totals.append(total)
        return block_keys, pieces, totals


# -- byte movement (staging callbacks): pieces are uint8 views of registered host memory --------------


def _gather(blocks: Sequence[list[np.ndarray]], region: torch.Tensor) -> None:
    np.concatenate([piece for block in blocks for piece in block], out=region.numpy())


def _scatter(blocks: Sequence[list[np.ndarray]], region: torch.Tensor) -> None:
    data, offset = region.numpy(), 0
    for block in blocks:
        for piece in block:
            np.copyto(piece, data[offset : offset + piece.size])
            offset += piece.size
