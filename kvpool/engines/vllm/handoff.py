"""A prefill instance's hand-offs (``kv_producer``): a finished request is reported once the pool holds its blocks.

vLLM keeps a finished request's blocks while its connector says the request
is still sending (``request_finished`` answered True); the workers report it
in ``get_finished``'s ``finished_sending`` and vLLM frees them. For a
producer, "sent" means the pool holds every block the request stored
(:class:`~kvpool.engines.vllm.scheduler.Handoff`, the keys of its prompt
blocks): a consumer that waits for them then finds them all.

:class:`HandoffWatch` runs one daemon thread per worker. For the hand-offs
given to it, it calls :meth:`PoolClient.flush` (every block queued before
it is written, its commit answered, and the master has the nodes' reports),
then one :meth:`PoolClient.exists` of their keys:

- all held: confirmed (reported, counted in ``confirmed``);
- some missing after a flush that succeeded (a save dropped by a full
  queue, a write the pool refused, an eviction): reported at once, counted
  in ``failed``; waiting longer would not bring them;
- the flush failed or timed out (a pool fault): tried again until the
  hand-off's deadline, ``timeout_s`` after it arrived, then reported as
  failed.

Every hand-off is reported exactly once, confirmed or not: a pool fault
never keeps vLLM's blocks past the deadline; the consumer then computes what
the pool does not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.engines.vllm.keys import shard_key
from kvpool.engines.vllm.scheduler import Handoff
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

RETRY_S = 0.05  # after a flush that failed at once (a pool down), before the next


class Confirms(Protocol):
    """The part of :class:`kvpool.client.pool.PoolClient` a watch uses (not strict: faults are False)."""

    def flush(self, timeout: float | None = None) -> bool: ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...


@dataclass(slots=True)
class HandoffStats:
    """Hand-offs reported since the last :meth:`HandoffWatch.take_stats`."""

    confirmed: int = 0  # the pool held every block
    failed: int = 0  # reported without that (see the module docstring)


@dataclass(frozen=True, slots=True)
class _Pending:
    req_id: str
    keys: list[BlockKey]  # this worker's shard's keys
    started: float
    deadline: float


class HandoffWatch:
    """See the module docstring. ``add`` and ``take_done`` are called from vLLM's model-runner thread."""

    def __init__(self, pool: Confirms, timeout_s: float, shard: int = 0):
        self._pool = pool
        self.timeout_s = timeout_s
        self._shard = shard
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._done: set[str] = set()
        self._stats = HandoffStats()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._quiet = False  # a failure was logged as a warning and no hand-off was confirmed since

    def add(self, handoffs: Sequence[Handoff]) -> None:
        """Watch these hand-offs (their blocks were queued in earlier steps)."""
        now = time.monotonic()
        pending = [_Pending(h.req_id, [shard_key(k, self._shard) for k in h.keys], now, now + self.timeout_s)
                   for h in handoffs]
        with self._cond:
            if self._closed:  # shutting down: nobody will free these blocks but the engine's own exit
                self._done.update(p.req_id for p in pending)
                return
            self._pending += pending
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-handoff", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def take_done(self) -> set[str]:
        """Request ids reported since the last call (vLLM frees their blocks)."""
        with self._cond:
            done, self._done = self._done, set()
        return done

    def take_stats(self) -> HandoffStats:
        with self._cond:
            stats, self._stats = self._stats, HandoffStats()
        return stats

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; hand-offs still pending are reported unconfirmed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    self._finish(self._pending, confirmed=False)
                    self._pending = []
                    return
                batch = list(self._pending)
            flushed = self._pool.flush(max(0.0, min(p.deadline for p in batch) - time.monotonic()))
            held = self._pool.exists([k for p in batch for k in p.keys]) if flushed else []
            confirmed: list[_Pending] = []
            failed: list[_Pending] = []
            retry: list[_Pending] = []
            at = 0
            now = time.monotonic()
            for p in batch:
                if flushed:
                    (confirmed if all(held[at : at + len(p.keys)]) else failed).append(p)
                    at += len(p.keys)
                else:
                    (failed if now >= p.deadline else retry).append(p)
            with self._cond:
                reported = {p.req_id for p in confirmed + failed}
                self._pending = [p for p in self._pending if p.req_id not in reported]
                self._finish(confirmed, confirmed=True)
                self._finish(failed, confirmed=False)
                if retry and not self._closed:
                    self._cond.wait(RETRY_S)

    def _finish(self, reported: list[_Pending], *, confirmed: bool) -> None:
        """Report ``reported`` (under the lock)."""
        for p in reported:
            self._done.add(p.req_id)
            if confirmed:
                self._stats.confirmed += 1
                self._quiet = False
                continue
            self._stats.failed += 1
            log.log(logging.DEBUG if self._quiet else logging.WARNING,
                    "kvpool: hand-off of %s: the pool did not confirm its %d blocks (%.1f s); vLLM frees them, a "
                    "consumer computes what is missing", p.req_id, len(p.keys), time.monotonic() - p.started)
            self._quiet = True
