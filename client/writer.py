"""The bounded write-behind queue: the engine hands blocks over and never waits on the pool.

An item is a block's key and either its bytes (host scratch the queue now
owns) or a :class:`~kvpool.client.leases.FilledSlot`: a block already in a
same-host node's leased slot, waiting only for its ``Commit``. The queue
holds handles of such blocks, not their bytes.

Invariants:
- ``submit`` takes ownership of what it is given (the caller hands over
  buffers it will not touch again) and never blocks. An item whose bytes
  would take what is waiting past ``capacity_bytes`` is refused (False) and
  counted by the caller; a filled slot costs no queue bytes (its bytes are
  in the node's arena, bounded by what the node leased ahead).
- One background thread drains the queue in order, in batches of at most
  ``batch_bytes`` (items of no bytes submitted side by side are never split
  across two batches) and hands each batch to ``sink``; a sink exception is
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

from kvpool.client.leases import FilledSlot
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

Payload = np.ndarray | FilledSlot
Sink = Callable[[list[BlockKey], list[Payload]], None]


def queued_bytes(payload: Payload) -> int:
    """What an item costs the queue: its bytes, or 0 for a block already in a node's slot."""
    return 0 if isinstance(payload, FilledSlot) else int(payload.nbytes)


class WriteBehindQueue:
    """See module docstring."""

    def __init__(self, sink: Sink, capacity_bytes: int, batch_bytes: int = 32 << 20, name: str = "kvpool-writer"):
        if capacity_bytes < 1:
            raise ValueError(f"write-behind capacity must be >= 1 byte, got {capacity_bytes}")
        self._sink = sink
        self._capacity = capacity_bytes
        self._queued_bytes = 0
        self._batch_bytes = batch_bytes
        self._items: deque[tuple[BlockKey, Payload]] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> list[bool]:
        """Queue the items (the queue owns them from now on); per item, whether it was accepted."""
        for payload in payloads:  # validate all before queueing any
            if not isinstance(payload, (np.ndarray, FilledSlot)):
                raise ValueError(f"a write-behind item is a numpy array or a filled slot, not {type(payload)}")
        accepted = []
        with self._cond:
            if self._closed:
                raise ValueError("write-behind queue is closed")
            for key, payload in zip(keys, payloads):
                cost = queued_bytes(payload)
                ok = self._queued_bytes + cost <= self._capacity
                if ok:
                    self._items.append((key, payload))
                    self._queued_bytes += cost
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

    def _take_batch(self) -> list[tuple[BlockKey, Payload]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if not self._items:
                return None
            batch: list[tuple[BlockKey, Payload]] = []
            size = 0
            while self._items and (not batch or size + queued_bytes(self._items[0][1]) <= self._batch_bytes):
                item = self._items.popleft()
                batch.append(item)
                size += queued_bytes(item[1])
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
