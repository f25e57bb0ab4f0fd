"""Background demotion: DRAM's evicted blocks are written to SSD by a thread, not by the evicting caller.

Writing a batch of victims to LMDB takes tens of milliseconds; done inline,
it lands on whoever needed the slots: a put, or worse a reader whose SSD hit
is being promoted into a full DRAM (that is most of a prefix's time to first
token). Copying the victims out of their slots costs a memcpy instead.

Invariants:
- A submitted block is *pending* until SSD stored or refused it. While
  pending it stays visible: :meth:`get`/:meth:`contains` serve it, and the
  SSD store's change listener heard of it as added at submit time, so the
  master's index never loses a block that is merely in flight. If SSD
  refuses it, the listener hears it removed.
- At most ``max_bytes`` are pending; a batch that would exceed it is written
  inline (back-pressure, never unbounded memory).
- :meth:`cancel` (a remove) wins over a write in flight: the key is removed
  from SSD again right after that write lands, so a removed key never
  reappears; the listener hears a cancelled key removed at once (queued or
  in flight), as it heard it added at submit.
- Writes start once the oldest queued block has waited ``delay_s`` (or the
  queue is half full, or someone flushes): a promotion's victims are written
  after the request that promoted, not during its forward pass on the same
  cores. :meth:`close` writes everything pending before returning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.buffers import BufferLike
from kvpool.keys import BlockKey
from kvpool.tiers.ssd import SsdStore
from kvpool.vocabulary import BlockMeta

log = logging.getLogger(__name__)

DELAY_S = 1.0  # a queued block waits this long before its write starts (see module docstring)
WRITE_BYTES = 32 << 20  # most bytes one SSD transaction of the writer carries


class DemotionQueue:
    """Pending demotions of one node and the thread that writes them (see module docstring)."""

    def __init__(self, ssd: SsdStore, max_bytes: int, on_demote: Callable[[int], None] | None = None,
                 delay_s: float = DELAY_S):
        if max_bytes <= 0:
            raise ValueError("demotion queue: max_bytes must be positive")
        self.ssd = ssd
        self.max_bytes = max_bytes
        self.delay_s = delay_s
        self._flushing = 0  # flush() calls waiting: write now
        self.on_demote = on_demote
        self._lock = threading.Condition()
        self._pending: dict[BlockKey, tuple[np.ndarray, int]] = {}  # key -> (bytes, checksum), queued or in flight
        self._queued: dict[BlockKey, float] = {}  # keys not yet taken by the writer -> when queued, oldest first
        self._cancelled: set[BlockKey] = set()  # removed while their write was in flight
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._free: dict[int, list[np.ndarray]] = {}  # written buffers kept for reuse, by size
        self._free_bytes = 0
        self._thread = threading.Thread(target=self._run, name="kvpool-demotion", daemon=True)
        self._thread.start()

    # -- the DRAM store's eviction sink ------------------------------------------------------

    def submit(self, keys: Sequence[BlockKey], views: Sequence[memoryview], checksums: Sequence[int]) -> None:
        """Take evicted blocks (views valid only during this call): copy them and queue the write."""
        total = sum(v.nbytes for v in views)
        with self._lock:
            inline = self._closed or self._bytes + total > self.max_bytes
        if inline:
            self._write(list(keys), list(views), list(checksums))
            return
        bufs = []
        for v in views:
            buf = self._buffer(v.nbytes)
            np.copyto(buf, np.frombuffer(v, dtype=np.uint8))
            bufs.append(buf)
        with self._lock:
            for key, buf, checksum in zip(keys, bufs, checksums):
                old = self._pending.get(key)
                if old is not None:
                    self._bytes -= old[0].nbytes
                self._queued.setdefault(key, time.monotonic())  # again, if an older copy's write is in flight
                self._pending[key] = (buf, int(checksum))
                self._cancelled.discard(key)
                self._bytes += buf.nbytes
            self._lock.notify_all()
        if self.ssd.on_change is not None:  # visible as on SSD from now on (see module docstring)
            self.ssd.on_change([BlockMeta(k, b.nbytes, int(c)) for k, b, c in zip(keys, bufs, checksums)], ())

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``: a recycled one if any (its pages are already faulted in), else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def _recycle(self, bufs: Sequence[np.ndarray]) -> None:
        """Keep written buffers for reuse, up to a quarter of ``max_bytes`` (caller holds the lock)."""
        for buf in bufs:
            if self._free_bytes + buf.nbytes <= self.max_bytes // 4:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> tuple[np.ndarray, int] | None:
        """The pending bytes and checksum of ``key`` (do not modify), or None.

        The buffer is recycled once the block is on SSD: a reader must verify
        what it copied out against the checksum (a torn copy is a miss).
        """
        with self._lock:
            return self._pending.get(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [k in self._pending for k in keys]

    def metas(self) -> list[BlockMeta]:
        with self._lock:
            return [BlockMeta(k, b.nbytes, c) for k, (b, c) in self._pending.items()]

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._bytes

    # -- changes -----------------------------------------------------------------------------

    def cancel(self, keys: Sequence[BlockKey]) -> int:
        """Forget pending blocks of ``keys`` (a remove); returns how many were pending.

        The SSD store's listener hears the cancelled keys as removed (it heard
        them added at submit): the master must not keep indexing a block whose
        write will never land. A listener re-checks what is held, so a key that
        is also on SSD stays reported until SSD removes it too.
        """
        gone: list[BlockKey] = []
        with self._lock:
            for key in keys:
                entry = self._pending.pop(key, None)
                if entry is None:
                    continue
                gone.append(key)
                self._bytes -= entry[0].nbytes
                if key in self._queued:
                    del self._queued[key]
                else:  # in flight: undo it once it lands
                    self._cancelled.add(key)
            self._lock.notify_all()
        if gone and self.ssd.on_change is not None:
            self.ssd.on_change((), gone)
        return len(gone)

    def flush(self, timeout: float | None = None) -> bool:
        """Write what is queued now and wait until nothing is pending; False on timeout."""
        with self._lock:
            self._flushing += 1
            self._lock.notify_all()
            try:
                return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)
            finally:
                self._flushing -= 1

    def close(self) -> None:
        """Write everything pending, then stop the thread. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    # -- the writer --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._due():
                    oldest = next(iter(self._queued.values()), None)
                    self._lock.wait(None if oldest is None else max(0.0, oldest + self.delay_s - time.monotonic()))
                if not self._queued:
                    return  # closed and drained
                batch = [(k, *self._pending[k]) for k in self._queued]
                self._queued = {}
                self._busy = True
            for part in self._parts(batch):  # one SSD transaction each, so SSD's LRU sees them in order
                try:
                    stored = self._write([k for k, _, _ in part], [b for _, b, _ in part], [c for _, _, c in part])
                except Exception:  # a failed demotion drops the blocks: later misses, never an error
                    log.exception("demotion: writing %d blocks to SSD failed; dropping them", len(part))
                    stored = [False] * len(part)
                self._settle(part, stored)  # before the next part: its evictions must see these as on SSD only
            with self._lock:  # only now: flush() must not return before the undo
                self._busy = False
                self._lock.notify_all()

    def _settle(self, part: list[tuple[BlockKey, np.ndarray, int]], stored: list[bool]) -> None:
        """After a part was written: drop it from pending, undo cancelled writes, report refusals."""
        undo, refused, done = [], [], []
        with self._lock:
            for (key, buf, _), ok in zip(part, stored):
                done.append(buf)
                if key in self._cancelled:
                    self._cancelled.discard(key)
                    if ok:
                        undo.append(key)
                    continue
                entry = self._pending.get(key)
                if entry is None or entry[0] is not buf:  # removed or re-submitted meanwhile
                    continue
                del self._pending[key]
                self._bytes -= buf.nbytes
                if not ok:
                    refused.append(key)
            self._recycle(done)
        if undo:
            self.ssd.remove(undo)
        if refused and self.ssd.on_change is not None:
            self.ssd.on_change((), refused)

    def _parts(self, batch: list[tuple[BlockKey, np.ndarray, int]]) -> list[list[tuple[BlockKey, np.ndarray, int]]]:
        """``batch`` in runs of at most WRITE_BYTES (and an eighth of the SSD), each at least one block."""
        limit = max(1, min(WRITE_BYTES, self.ssd.capacity_bytes // 8))
        parts: list[list[tuple[BlockKey, np.ndarray, int]]] = []
        size = 0
        for entry in batch:
            if not parts or size + entry[1].nbytes > limit:
                parts.append([])
                size = 0
            parts[-1].append(entry)
            size += entry[1].nbytes
        return parts

    def _due(self) -> bool:
        """Write now? (caller holds the lock)"""
        if self._closed:
            return True
        if not self._queued:
            return False
        if self._flushing or self._bytes * 2 >= self.max_bytes:
            return True
        return time.monotonic() - next(iter(self._queued.values())) >= self.delay_s

    def _write(self, keys: list[BlockKey], bufs: Sequence[BufferLike], checksums: list[int]) -> list[bool]:
        stored = self.ssd.put(keys, bufs, checksums)
        moved = sum(stored)
        if self.on_demote is not None and moved:
            self.on_demote(moved)
        return stored
