"""The bounded write-behind queue: the engine hands blocks over and never waits on the pool.

Invariants:
- ``submit`` copies the caller's bytes before returning, so the caller may
  reuse its buffers at once; it never blocks. A block that would take the
  bytes waiting past ``capacity_bytes`` is refused (False) and counted by
  the caller.
- One background thread drains the queue in batches of at most
  ``batch_bytes`` and hands each batch to ``sink``; a sink exception is
  logged and the batch dropped (a pool fault is a lost cache entry, not an error).
- ``flush`` returns once everything submitted before it has been handed to
  the sink (or the timeout passes).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.buffers import BufferLike, as_array
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

Sink = Callable[[list[BlockKey], list[np.ndarray]], None]


class WriteBehindQueue:
    """See module docstring."""

    def __init__(self, sink: Sink, capacity_bytes: int, batch_bytes: int = 32 << 20, name: str = "kvpool-writer"):
        if capacity_bytes < 1:
            raise ValueError(f"write-behind capacity must be >= 1 byte, got {capacity_bytes}")
        self._sink = sink
        self._capacity = capacity_bytes
        self._queued_bytes = 0
        self._batch_bytes = batch_bytes
        self._items: deque[tuple[BlockKey, np.ndarray]] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Queue copies of the blocks; per block, whether it was accepted."""
        arrays = [as_array(v) for v in values]  # validate all before queueing any
        accepted = []
        with self._cond:
            if self._closed:
                raise ValueError("write-behind queue is closed")
            for key, arr in zip(keys, arrays):
                ok = self._queued_bytes + arr.size <= self._capacity
                if ok:
                    self._items.append((key, arr.copy()))
                    self._queued_bytes += arr.size
                    self._submitted += 1
                accepted.append(ok)
            self._cond.notify_all()
        return accepted

    def pending(self) -> int:
        with self._cond:
            return self._submitted - self._done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until all blocks submitted so far reached the sink; False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Drain what is queued (up to ``timeout``), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _take_batch(self) -> list[tuple[BlockKey, np.ndarray]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if not self._items:
                return None
            batch: list[tuple[BlockKey, np.ndarray]] = []
            size = 0
            while self._items and (not batch or size + self._items[0][1].size <= self._batch_bytes):
                item = self._items.popleft()
                batch.append(item)
                size += item[1].size
            self._queued_bytes -= size
            return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                self._sink([k for k, _ in batch], [a for _, a in batch])
            except Exception:  # a failed write-behind is a lost cache entry
                log.exception("write-behind: dropping %d blocks", len(batch))
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()
