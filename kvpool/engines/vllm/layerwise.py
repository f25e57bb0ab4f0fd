"""Layer-wise streaming (``kvpool_load_mode: "layerwise"``): the step's loads and saves, one layer at a time,
on the worker's layer thread while the forward runs.

- Loads (:class:`LayerwiseLoad`): ``start_load_kv`` (before the forward)
  starts the step's sync loads on the layer thread: every job's blocks are
  fetched into staging (checksums verified: no byte reaches vLLM's cache
  unverified), then scattered into vLLM's blocks layer by layer, each
  layer's pieces marked ready as soon as they are in. vLLM's attention
  calls ``wait_for_layer_load(layer)`` before each layer
  (:meth:`LayerwiseLoad.wait_layer`), which waits for that layer only: layer
  *i+1*'s copy runs while layer *i* computes.
- Saves (:class:`LayerwiseSave`): ``save_kv_layer(layer)``, after each
  layer's attention wrote the step's KV, queues the gather of that layer's
  pieces of the step's full blocks into staging on the same thread; the
  forward does not wait for it. ``wait_for_save`` waits for the gathers and
  hands each whole block (all layers: still one pool key per block) to the
  pool's write-behind queue.
- Both end in the step: ``wait_for_save`` (or vLLM's
  ``get_block_ids_with_load_errors``, whichever comes first) waits for the
  load; its failed blocks are that step's load errors (vLLM recomputes from
  the first one and discards what the step computed for the request), and
  the request saves nothing in that step (:meth:`PoolWorker.save`).
- One thread for both, first in first out: a step's load is queued before
  its gathers, and the copies never contend with each other for the cores
  the forward also runs on.
- A bug in the thread (an exception) marks every layer ready and every
  block of the step's loads failed: the forward never hangs, vLLM recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvpool.engines.staging import LayeredStaging
from kvpool.engines.vllm.scheduler import LoadJob, SaveJob
from kvpool.engines.vllm.worker import Fetched, PoolWorker, save_ids

log = logging.getLogger(__name__)


class LayerThread:
    """The worker's layer thread and its staging buffers (one for loads, one for saves)."""

    def __init__(self, worker: PoolWorker):
        self.worker = worker
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-layers")
        self.load_staging = worker.staging()
        self.save_staging = worker.staging()

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class LayerwiseLoad:
    """One step's loads, streamed layer by layer (see the module docstring)."""

    def __init__(self, thread: LayerThread, jobs: Sequence[LoadJob]):
        self._worker = thread.worker
        self._jobs = list(jobs)
        self._ready = [threading.Event() for _ in self._worker.layers]
        self._start = time.perf_counter()
        self._seconds = 0.0
        self._future: Future[list[Fetched]] = thread.executor.submit(self._run, thread.load_staging)
        self._finished = False

    def _run(self, staging: LayeredStaging) -> list[Fetched]:
        worker = self._worker
        try:
            blocks = staging.blocks(sum(len(job.block_ids) for job in self._jobs))
            fetched, at = [], 0
            for job in self._jobs:
                n = len(job.block_ids)
                fetched.append(worker.fetch(job, blocks[at : at + n]))
                at += n
            for i, ready in enumerate(self._ready):
                worker.scatter(fetched, (i,))
                ready.set()
            self._seconds = time.perf_counter() - self._start  # the load's own time, not the forward's
            return fetched
        finally:
            for ready in self._ready:  # after a failure too: the forward must not hang
                ready.set()

    def wait_layer(self, name: str) -> None:
        """Return once layer ``name``'s pieces are in vLLM's cache (every layer's, for a name not registered)."""
        i = self._worker.layer_index.get(name)
        for ready in self._ready if i is None else (self._ready[i],):
            ready.wait()

    def finish(self) -> None:
        """Wait for the whole load and report it: failed blocks to :meth:`PoolWorker.failed` (the step's load
        errors), counts to the stats. Idempotent."""
        if self._finished:
            return
        self._finished = True
        try:
            fetched = self._future.result()
        except Exception:
            log.exception("kvpool: a layer-wise load failed; vLLM recomputes its blocks")
            fetched = [Fetched(job, 0, torch.empty(0, dtype=torch.uint8)) for job in self._jobs]
        seconds = self._seconds / max(1, len(fetched))
        for f in fetched:
            failed = self._worker.count_load(f, seconds)
            if failed:
                self._worker.failed(f.job, failed)


class LayerwiseSave:
    """One step's saves, gathered layer by layer (see the module docstring)."""

    def __init__(self, thread: LayerThread, jobs: Sequence[SaveJob]):
        self._thread = thread
        self._worker = thread.worker
        self._jobs = [job for job in jobs if job.block_ids]
        self._ids = save_ids(self._jobs)
        self._blocks = thread.save_staging.blocks(len(self._ids))
        self._gathers: dict[int, Future[float]] = {}

    def gather_layer(self, name: str) -> None:
        """Queue the gather of layer ``name``'s pieces (its attention has written the step's KV)."""
        i = self._worker.layer_index.get(name)
        if i is not None and self._jobs and i not in self._gathers:
            self._gathers[i] = self._thread.executor.submit(self._gather, i)

    def _gather(self, i: int) -> float:
        start = time.perf_counter()
        self._worker.gather(self._ids, self._blocks, (i,))
        return time.perf_counter() - start

    def finish(self) -> None:
        """Wait for the gathers (a layer vLLM did not announce is gathered now) and hand the blocks to the
        pool."""
        if not self._jobs:
            return
        try:
            seconds = sum(g.result() for g in self._gathers.values())
        except Exception:
            log.exception("kvpool: a layer-wise save failed; its blocks are not stored")
            return
        missing = [i for i in range(len(self._worker.layers)) if i not in self._gathers]
        if missing:
            start = time.perf_counter()
            self._worker.gather(self._ids, self._blocks, missing)
            seconds += time.perf_counter() - start
        self._worker.put(self._jobs, self._blocks, seconds)
