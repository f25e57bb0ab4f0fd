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
  reappears.
- :meth:`close` writes everything pending before returning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.keys import BlockKey
from kvpool.tiers.base import BlockMeta
from kvpool.tiers.ssd import SsdStore

log = logging.getLogger(__name__)


class DemotionQueue:
    """Pending demotions of one node and the thread that writes them (see module docstring)."""

    def __init__(self, ssd: SsdStore, max_bytes: int, on_demote: Callable[[int], None] | None = None):
        if max_bytes <= 0:
            raise ValueError("demotion queue: max_bytes must be positive")
        self.ssd = ssd
        self.max_bytes = max_bytes
        self.on_demote = on_demote
        self._lock = threading.Condition()
        self._pending: dict[BlockKey, tuple[np.ndarray, int]] = {}  # key -> (bytes, checksum), queued or in flight
        self._queued: dict[BlockKey, None] = {}  # keys not yet taken by the writer, in eviction order
        self._cancelled: set[BlockKey] = set()  # removed while their write was in flight
        self._bytes = 0
        self._busy = False
        self._closed = False
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
        data = np.empty(total, dtype=np.uint8)
        bufs, offset = [], 0
        for v in views:
            buf = data[offset : offset + v.nbytes]
            np.copyto(buf, np.frombuffer(v, dtype=np.uint8))
            bufs.append(buf)
            offset += v.nbytes
        with self._lock:
            for key, buf, checksum in zip(keys, bufs, checksums):
                old = self._pending.get(key)
                if old is not None:
                    self._bytes -= old[0].nbytes
                self._queued[key] = None  # again, if a write of an older copy is in flight
                self._pending[key] = (buf, int(checksum))
                self._cancelled.discard(key)
                self._bytes += buf.nbytes
            self._lock.notify_all()
        if self.ssd.on_change is not None:  # visible as on SSD from now on (see module docstring)
            self.ssd.on_change([BlockMeta(k, b.nbytes, int(c)) for k, b, c in zip(keys, bufs, checksums)], ())

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> tuple[np.ndarray, int] | None:
        """The pending bytes and checksum of ``key`` (do not modify), or None."""
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
        """Forget pending blocks of ``keys`` (a remove); returns how many were pending."""
        n = 0
        with self._lock:
            for key in keys:
                entry = self._pending.pop(key, None)
                if entry is None:
                    continue
                n += 1
                self._bytes -= entry[0].nbytes
                if key in self._queued:
                    del self._queued[key]
                else:  # in flight: undo it once it lands
                    self._cancelled.add(key)
            self._lock.notify_all()
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)

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
                self._lock.wait_for(lambda: self._queued or self._closed)
                if not self._queued:
                    return  # closed and drained
                batch = [(k, *self._pending[k]) for k in self._queued]
                self._queued = {}
                self._busy = True
            try:
                stored = self._write([k for k, _, _ in batch], [b for _, b, _ in batch], [c for _, _, c in batch])
            except Exception:  # noqa: BLE001 - a failed demotion drops the blocks: later misses, never an error
                log.exception("demotion: writing %d blocks to SSD failed; dropping them", len(batch))
                stored = [False] * len(batch)
            undo, refused = [], []
            with self._lock:
                for (key, buf, _), ok in zip(batch, stored):
                    if key in self._cancelled:
                        self._cancelled.discard(key)
                        if ok:
                            undo.append(key)
                        continue
                    entry = self._pending.get(key)
                    if entry is not None and entry[0] is buf:  # not re-submitted meanwhile
                        del self._pending[key]
                        self._bytes -= buf.nbytes
                        if not ok:
                            refused.append(key)
            if undo:
                self.ssd.remove(undo)
            if refused and self.ssd.on_change is not None:
                self.ssd.on_change((), refused)
            with self._lock:  # only now: flush() must not return before the undo
                self._busy = False
                self._lock.notify_all()

    def _write(self, keys: list[BlockKey], bufs: Sequence[object], checksums: list[int]) -> list[bool]:
        stored = self.ssd.put(keys, bufs, checksums)  # type: ignore[arg-type]
        moved = sum(stored)
        if self.on_demote is not None and moved:
            self.on_demote(moved)
        return stored
