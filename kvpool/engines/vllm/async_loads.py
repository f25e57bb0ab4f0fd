"""Asynchronous loads (``kvpool_load_mode: "async"``): a request's blocks load while vLLM's batch runs.

vLLM's contract (``vllm/v1/core/sched/scheduler.py``, read for 0.32):

- The scheduler side answered ``(n, True)``: vLLM allocated the request's
  blocks, parked it in ``WAITING_FOR_REMOTE_KVS`` and sent the load in the
  step's connector metadata (:attr:`StepPlan.async_loads`); the worker calls
  ``start_load_kv`` after that step's forward and :meth:`AsyncLoads.submit`
  queues the jobs for one loader thread, which fetches each job's blocks
  (checksums verified) into its own staging and scatters them into vLLM's
  blocks.
- A finished job is reported once, in ``get_finished``'s ``finished_recving``
  (:meth:`AsyncLoads.take_finished`), and its blocks that did not load in
  ``get_block_ids_with_load_errors`` of the *same* step (vLLM calls
  ``get_finished`` first; both come from one snapshot taken there). vLLM
  then recomputes from the first failed block; a request that failed at
  its first block is freed and asked about again (the scheduler side
  answers 0 then).
- A request aborted while its job runs keeps its blocks: vLLM frees them
  only once ``finished_recving`` names it. A job is reported only after its
  thread stopped writing, so the worker never writes into a block vLLM
  freed and gave to another request. A waiting request is never preempted.
- A job that raises (a bug, not a pool fault: those are misses) is reported
  finished with every block failed: vLLM recomputes, the request is not stuck.
- While every request waits for its KV, vLLM steps without computing, as
  fast as it can, and each empty step's Python holds the GIL the loader
  thread needs (a lone request's load ran ~4x slower so). In such a step
  ``get_finished`` waits for the next job to finish, at most
  :data:`IDLE_WAIT_S` (:meth:`AsyncLoads.wait`): nothing runs that it could
  delay, and a request arriving meanwhile waits that long at most.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.engines.vllm.scheduler import LoadJob
from kvpool.engines.vllm.worker import Fetched, PoolWorker

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # the longest an idle step waits for a load to finish


class AsyncLoads:
    """The loader thread and what it finished since the last :meth:`take_finished` (see the module docstring)."""

    def __init__(self, worker: PoolWorker):
        self._worker = worker
        self._staging = worker.staging()  # the loader thread's own
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-load")
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)  # notified when a job finishes
        self._done: set[str] = set()  # requests whose job finished since the last take_finished
        self._failed: set[int] = set()  # their blocks that did not load
        self._pending = 0  # jobs submitted and not finished

    def submit(self, jobs: Sequence[LoadJob]) -> None:
        """Queue the jobs (in order) for the loader thread; returns at once."""
        with self._lock:
            self._pending += len(jobs)
        for job in jobs:
            self._executor.submit(self._run, job)

    def _run(self, job: LoadJob) -> None:
        start = time.perf_counter()
        failed: list[int]
        try:
            fetched = self._worker.fetch(job, self._staging.blocks(len(job.block_ids)))
            self._worker.scatter([fetched], range(len(self._worker.layers)))
        except Exception:
            log.exception("kvpool: the async load of %s failed; vLLM recomputes its %d blocks", job.req_id,
                          len(job.block_ids))
            fetched = Fetched(job, 0, self._staging.blocks(0))
        failed = self._worker.count_load(fetched, time.perf_counter() - start)
        with self._lock:
            self._done.add(job.req_id)
            self._failed.update(failed)
            self._pending -= 1
            self._finished.notify_all()

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Return once a job finished that is not taken yet, no job is pending, or ``timeout`` passed."""
        with self._lock:
            self._finished.wait_for(lambda: self._done or not self._pending, timeout)

    def take_finished(self) -> tuple[set[str], set[int]]:
        """The requests whose load finished since the last call, and the blocks of theirs that did not load."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Finish the queued jobs and stop the thread (vLLM's shutdown)."""
        self._executor.shutdown(wait=True)
