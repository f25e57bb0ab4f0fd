"""Host staging for engine backends: a block's scattered pieces <-> one contiguous buffer for the client.

The one home of engine-side host staging: :class:`BlockStager` (chunked
batches through one buffer, for the MindIE, SGLang and vllm-ascend
backends), :class:`LayeredStaging` (the vLLM worker's ``[n, layers, piece]``
buffers) and :class:`PieceCopier`; their buffers come from
:func:`kvpool.client.tensors.host_bytes` (pinned where torch can pin), as do
the client's own for device tensors. (:mod:`kvpool.engines.device_copy`
holds the device runtimes' copy calls, not buffers.)

The client stores one contiguous buffer per block; engines hold a block as
pieces (each layer's K and V) inside their paged cache. A :class:`BlockStager`
owns one reusable host buffer and moves a batch through it in chunks:

- ``put``: the backend's ``gather`` writes a chunk's blocks into the buffer,
  block after block (each block's pieces in layout order); the client gets
  byte views of it and copies them on submit, so the buffer is free on return.
- ``get``: the client fills byte views of the buffer; the backend's
  ``scatter`` copies back only the blocks that arrived.

Backends whose blocks are engine tensors (on the host or a device) gather and
scatter with a :class:`PieceCopier`: one ``copy_`` per piece into a typed view
of the buffer, device copies enqueued and waited for once per chunk.

Invariants:
- The buffer is allocated on first use (a scheduler never has one), pinned
  where torch can pin, and reused; it grows only when one block is larger
  than it. A stager moves one batch at a time; backends keep one stager for
  puts and one for gets, so an engine's send and receive threads do not wait
  on each other.
- Engine memory is written only by ``scatter``, and only for blocks the client
  reported loaded: a miss or a failed block leaves the engine's memory as it was.
- ``get`` results are per key and truthful: True exactly for the blocks copied
  into the engine. The leading run comes from one client ``get``; after a miss,
  one ``exists`` call says which later blocks the pool holds, and those are
  fetched too (engines use only the leading run; the result still says what
  was loaded).
- Pool faults and unexpected exceptions from the client or a copy are logged,
  counted in ``stats["faults"]`` and reported as False: nothing raises.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.tensors import host_bytes
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20

# (blocks of one chunk, the chunk's bytes in the buffer: a host uint8 tensor) -> None
Gather = Callable[[Sequence[Any], torch.Tensor], None]
Scatter = Callable[[Sequence[Any], torch.Tensor], None]


class BlockStager:
    """Moves batches of engine blocks through one reusable host buffer (see module docstring)."""

    def __init__(self, capacity_bytes: int = DEFAULT_STAGING_BYTES, stats: Counter | None = None):
        if capacity_bytes < 1:
            raise ValueError(f"staging capacity must be >= 1 byte, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.stats: Counter = stats if stats is not None else Counter()
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._array: np.ndarray | None = None

    @property
    def allocated_bytes(self) -> int:
        """Bytes of host buffer this stager holds now (0 until its first batch)."""
        buffer = self._buffer
        return 0 if buffer is None else buffer.numel()

    @property
    def pinned(self) -> bool:
        """Whether the buffer (once allocated) is page-locked host memory."""
        buffer = self._buffer
        return buffer is not None and buffer.is_pinned()

    # -- the two flows -----------------------------------------------------------------

    def put(self, client: KVCacheClient, keys: Sequence[BlockKey], blocks: Sequence[Any],
            sizes: Sequence[int], gather: Gather, engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Gather and hand each block to ``client.put`` (with the engine's hash of each, if given); per block,
        whether the client accepted it."""
        ok = [False] * len(keys)
        with self._lock:
            pos = 0
            while pos < len(keys):
                end = self._chunk_end(sizes, pos, len(keys))
                try:
                    region, views = self._stage(sizes[pos:end])
                    gather(blocks[pos:end], region)
                    names = engine_hashes[pos:end] if engine_hashes is not None else None
                    accepted = [bool(a) for a in client.put(keys[pos:end], views, names)]
                    if len(accepted) != end - pos:
                        raise RuntimeError(f"client answered {len(accepted)} of {end - pos} puts")
                    ok[pos:end] = accepted
                except Exception as exc:  # noqa: BLE001 - a fault is a False, never the engine's exception
                    self._fault("put", exc, end - pos)
                pos = end
        return ok

    def get(self, client: KVCacheClient, keys: Sequence[BlockKey], blocks: Sequence[Any],
            sizes: Sequence[int], scatter: Scatter) -> list[bool]:
        """Load every block the pool holds into its engine pieces; per block, whether it was loaded."""
        n = len(keys)
        ok = [False] * n
        present: list[bool] | None = None  # known after the first miss: which keys the pool holds
        pos = 0
        with self._lock:
            while pos < n:
                if present is not None:
                    while pos < n and not present[pos]:
                        pos += 1
                    if pos == n:
                        break
                    stop = pos
                    while stop < n and present[stop]:
                        stop += 1
                else:
                    stop = n
                end = self._chunk_end(sizes, pos, stop)
                loaded = self._fetch(client, keys[pos:end], blocks[pos:end], sizes[pos:end], scatter)
                ok[pos : pos + loaded] = [True] * loaded
                if loaded == end - pos:
                    pos = end
                    continue
                pos += loaded + 1  # keys[pos + loaded] missed
                if present is None and pos < n:
                    present = [False] * pos + self._exists(client, keys[pos:])
        return ok

    def close(self) -> None:
        """Release the buffer (a later batch allocates a new one)."""
        with self._lock:
            self._buffer = self._array = None

    # -- helpers (called with the lock held) ---------------------------------------------

    def _chunk_end(self, sizes: Sequence[int], start: int, stop: int) -> int:
        """End of the chunk from ``start``: as many blocks as fit the buffer, at least one."""
        room = max(self.capacity, self.allocated_bytes)
        end, total = start, 0
        while end < stop and (end == start or total + sizes[end] <= room):
            total += sizes[end]
            end += 1
        return end

    def _stage(self, sizes: Sequence[int]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """The buffer's first ``sum(sizes)`` bytes as a tensor, and one byte view per block of it."""
        total = sum(sizes)
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = host_bytes(max(self.capacity, total))
            self._array = self._buffer.numpy()
        assert self._array is not None, "staging: buffer without its array view"
        views, offset = [], 0
        for size in sizes:
            views.append(self._array[offset : offset + size])
            offset += size
        return self._buffer[:total], views

    def _fetch(self, client: KVCacheClient, keys: Sequence[BlockKey], blocks: Sequence[Any],
               sizes: Sequence[int], scatter: Scatter) -> int:
        """One client ``get`` into the buffer, then scatter the loaded leading run; how many blocks it loaded."""
        try:
            region, views = self._stage(sizes)
            loaded = min(int(client.get(keys, views)), len(keys))
            if loaded:
                scatter(blocks[:loaded], region[: sum(sizes[:loaded])])
            return loaded
        except Exception as exc:  # noqa: BLE001
            self._fault("get", exc, len(keys))
            return 0

    def _exists(self, client: KVCacheClient, keys: Sequence[BlockKey]) -> list[bool]:
        try:
            present = [bool(p) for p in client.exists(keys)]
        except Exception as exc:  # noqa: BLE001
            self._fault("exists", exc, len(keys))
            return [False] * len(keys)
        if len(present) != len(keys):
            self._fault("exists", f"{len(present)} answers for {len(keys)} keys", len(keys))
            return [False] * len(keys)
        return present

    def _fault(self, call: str, exc: object, blocks: int) -> None:
        self.stats["faults"] += 1
        log.warning("kvpool engine %s of %d blocks failed: %s", call, blocks, exc)


class LayeredStaging:
    """A reusable host buffer of blocks as ``[n, layers, piece]`` bytes (grows as needed, page-locked where torch
    can pin: :func:`~kvpool.client.tensors.host_bytes`; one thread's)."""

    def __init__(self, layers: int, piece_bytes: int):
        self.layers, self.piece_bytes = layers, piece_bytes
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def blocks(self, n: int) -> torch.Tensor:
        need = n * self.layers * self.piece_bytes
        if self._buffer.numel() < need:
            self._buffer = host_bytes(need)
        return self._buffer[:need].view(n, self.layers, self.piece_bytes)


# -- engine tensors <-> the staging region ---------------------------------------------------


def host_views(region: torch.Tensor, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of the uint8 ``region``, one per piece, each of that piece's dtype and shape.

    ValueError if the pieces' bytes do not add up to the region, or a piece's offset is not a
    multiple of its element size (torch cannot view bytes there as that dtype).
    """
    total = sum(piece.numel() * piece.element_size() for piece in pieces)
    if total != region.numel():
        raise ValueError(f"pieces hold {total} bytes, the region {region.numel()}")
    views, offset = [], 0
    for piece in pieces:
        if offset % piece.element_size():
            raise ValueError(f"a {piece.dtype} piece at byte {offset} is not aligned to its element size")
        nbytes = piece.numel() * piece.element_size()
        views.append(region[offset : offset + nbytes].view(piece.dtype).view(piece.shape))
        offset += nbytes
    return views


class PieceCopier:
    """Copies engine tensors into and out of a host staging region, one batch per call.

    Invariants:
    - The region holds the pieces one after another, in the order given, each as
      its own dtype and shape: a block's bytes are the concatenation of its pieces' bytes.
    - Host pieces are copied at once. Device pieces are enqueued on their device's
      current stream (``non_blocking``: asynchronous when the region is pinned), and
      the call waits once per device before it returns, also when a copy fails: after
      ``to_host`` the region holds every byte; after ``to_device`` the region may be
      reused. No per-piece wait.
    - :meth:`copy` and :meth:`synchronize` are the only calls into a device runtime
      (torch's own ``copy_`` and stream, so CUDA and torch_npu alike); tests that have
      no device replace them.
    """

    def to_host(self, pieces: Sequence[torch.Tensor], region: torch.Tensor) -> None:
        """Copy ``pieces`` into ``region`` (their bytes, in order)."""
        self._run(list(zip(host_views(region, pieces), pieces)))

    def to_device(self, region: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
        """Copy ``region`` back into ``pieces`` (in place)."""
        self._run(list(zip(pieces, host_views(region, pieces))))

    def device_of(self, dst: torch.Tensor, src: torch.Tensor) -> torch.device | None:
        """The device a copy runs on, or None for a host-to-host copy."""
        for t in (dst, src):
            if t.device.type != "cpu":
                return t.device
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def synchronize(self, device: torch.device) -> None:
        """Wait for the copies enqueued on ``device``'s current stream (``torch.<type>.current_stream``)."""
        module = getattr(torch, device.type, None)
        current_stream = getattr(module, "current_stream", None)
        if current_stream is None:
            raise RuntimeError(f"torch has no current_stream for {device}")
        current_stream(device).synchronize()

    def _run(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pending: list[torch.device] = []
        try:
            for dst, src in pairs:
                device = self.device_of(dst, src)
                self.copy(dst, src, device is not None)
                if device is not None and device not in pending:
                    pending.append(device)
        finally:
            for device in pending:
                self.synchronize(device)
