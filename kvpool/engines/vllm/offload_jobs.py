"""kvpool behind vLLM's CPU offloading tier, without vLLM: settings, keys and the transfer jobs.

:mod:`.offload_tier` (which imports vLLM) is the ``SecondaryTierManager`` vLLM's
``TieringOffloadingManager`` calls; everything it does with the pool is here,
so it is tested without vLLM.

The primary tier's memory is ``rows``: one row per primary chunk (vLLM's
``primary_kv_view``, ``(num_chunks, row_bytes)``). One chunk is one pool block
of exactly ``row_bytes`` bytes: all of the instance's workers' pieces of that
chunk, as vLLM lays them out in the row.

Invariants:
- Keys: a chunk's vLLM offload key (its block hash, which already carries
  ``cache_salt``, LoRA and multimodal inputs, plus its KV cache group) maps
  to a pool key with :func:`kvpool.keys.opaque_key` in a namespace of the
  model, the kvpool client's tenant and a fingerprint of everything that
  decides a row's bytes (:func:`offload_namespace`). Instances whose rows
  are laid out differently never share a key.
- :meth:`TierJobs.submit_store` and :meth:`TierJobs.submit_load` never block:
  jobs run on the jobs' own threads (loads on one, stores on another, so a
  load never waits behind stores). A job reads or writes only its own rows,
  and only until it is reported by :meth:`TierJobs.finished` (vLLM keeps
  those rows pinned until then).
- Every submitted job is reported exactly once by :meth:`TierJobs.finished`,
  a dropped or failed one too.
- A pool fault is a miss: a lookup answers False, a load job reports which
  of its blocks arrived intact (checksum-verified by the pool client), and a
  block that did not is never reported loaded. A store the pool cannot take
  is a failed job, never an exception on vLLM's thread.
- While a job or a lookup runs, Python's GIL switch interval is lowered (:class:`SwitchInterval`), so the
  jobs' threads are not starved by vLLM's busy engine loop; it is put back when none runs.
- Backpressure: stores waiting or running hold at most ``store_queue_bytes``
  (one job is always let in when none is queued); a store past that is
  dropped at once (reported failed, counted), so a slow or stalled pool
  never pins more of vLLM's CPU tier than that.
"""

from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, load_config, parse_size
from kvpool.engines import options
from kvpool.keys import BlockKey, KeyNamespace, opaque_key

TIER_CONFIG = "kv_connector_extra_config.secondary_tiers[]"  # where the tier's fields live (errors name it)
TIER_FIELDS = ("kvpool_config_path", "kvpool_strict", "kvpool_store_queue_bytes", "kvpool_switch_interval_us")
VLLM_TIER_FIELDS = ("locality",)  # vLLM's own per-tier fields this tier takes (type, module_path and
# backpressure are taken out by vLLM's SecondaryTierFactory before the tier is built)
DEFAULT_STORE_QUEUE_BYTES = 256 << 20
DEFAULT_SWITCH_INTERVAL_US = 200  # while a job runs; Python's own is 5,000 (see SwitchInterval)
LOCALITIES = ("LOCAL", "REMOTE")
FINGERPRINT_PREFIX = "vllm-offload/"


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The kvpool tier's fields of its ``secondary_tiers`` entry, parsed."""

    client: ClientConfig
    store_queue_bytes: int = DEFAULT_STORE_QUEUE_BYTES
    locality: str = ""  # vLLM's tier locality: "LOCAL", "REMOTE" or "" (none: every request's tier filter matches)
    switch_interval_us: int = DEFAULT_SWITCH_INTERVAL_US  # 0: Python's own, always


def strict_mode(fields: Mapping[str, Any]) -> bool:
    """``kvpool_strict``: whether a config that cannot be used stops vLLM (default False)."""
    return options.flag(fields.get("kvpool_strict", False), f"{TIER_CONFIG}.kvpool_strict")


def tier_settings(fields: Mapping[str, Any]) -> TierSettings:
    """The tier's settings; one ValueError naming the field for an unknown field or a bad value."""
    unknown = sorted(k for k in fields if k not in TIER_FIELDS and k not in VLLM_TIER_FIELDS)
    if unknown:
        raise ValueError(f"unknown {TIER_CONFIG} field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(TIER_FIELDS + VLLM_TIER_FIELDS)}")
    path = options.path(fields.get("kvpool_config_path", ""), f"{TIER_CONFIG}.kvpool_config_path")
    queue_bytes = fields.get("kvpool_store_queue_bytes", DEFAULT_STORE_QUEUE_BYTES)
    name = f"{TIER_CONFIG}.kvpool_store_queue_bytes"
    if isinstance(queue_bytes, str):  # "512M", as kvpool's own size settings are written
        try:
            queue_bytes = parse_size(queue_bytes)
        except ValueError:
            raise ValueError(f"{name} must be a size (bytes, or e.g. \"512M\"), got {queue_bytes!r}") from None
    queue_bytes = options.integer(queue_bytes, name, low=1)
    locality = fields.get("locality")
    if locality is not None and (not isinstance(locality, str) or locality.upper() not in LOCALITIES):
        raise ValueError(f"{TIER_CONFIG}.locality must be one of {', '.join(LOCALITIES)}, got {locality!r}")
    switch_us = options.integer(fields.get("kvpool_switch_interval_us", DEFAULT_SWITCH_INTERVAL_US),
                                f"{TIER_CONFIG}.kvpool_switch_interval_us", low=0, high=5000)
    return TierSettings(load_config(path or None).client, queue_bytes, locality.upper() if locality else "",
                        switch_us)


def model_name(client: ClientConfig, vllm_model: str) -> str:
    """The model in every key: ``client.model`` when the kvpool config names one, else vLLM's model."""
    return client.model if client.model != ClientConfig.model else vllm_model


def offload_namespace(model: str, tenant: str, row_format: Mapping[str, Any]) -> KeyNamespace:
    """The namespace of one deployment's chunk keys.

    ``row_format``: JSON-able fields that together decide a row's bytes (vLLM's version, dtype, KV cache
    groups and their block sizes, tokens per hash, blocks per chunk, parallel sizes, layout flags, row
    bytes: :mod:`.offload_tier` gathers them). They enter the namespace as a sha256 fingerprint.
    """
    canonical = json.dumps(row_format, sort_keys=True, separators=(",", ":"), default=str)
    fingerprint = FINGERPRINT_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:32]
    return KeyNamespace(model, fingerprint, 0, 1, tenant)


def pool_keys(offload_keys: Sequence[bytes], namespace: KeyNamespace) -> list[BlockKey]:
    """The pool keys of vLLM offload keys (block hash + group index bytes) in ``namespace``."""
    return [opaque_key(bytes(k), namespace) for k in offload_keys]


class SwitchInterval:
    """Python's GIL switch interval lowered to ``seconds`` while anyone is inside, then put back (process-wide,
    as the interval is the interpreter's; the first holder's value wins; ``seconds`` 0: no change).

    Why: while a request waits for a promotion, vLLM's engine loop runs Python without pause; a tier thread
    that lets go of the GIL (every copy and checksum of a pool read does, a few times per block) then waits a
    whole switch interval (5 ms by default) to get it back. Measured in the real vLLM here: 5-8 ms before a
    load job even starts, and 0.6-0.7 s for a 64-chunk (24 MiB) read that takes 13-19 ms at 0.2 ms
    (benchmarks/vllm_offload_tier.py, docs/benchmarks.md).
    """

    _lock = threading.Lock()
    _inside = 0
    _saved = 0.0

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self) -> SwitchInterval:
        if self.seconds > 0:
            with SwitchInterval._lock:
                if SwitchInterval._inside == 0:
                    SwitchInterval._saved = sys.getswitchinterval()
                    sys.setswitchinterval(min(SwitchInterval._saved, self.seconds))
                SwitchInterval._inside += 1
        return self

    def __exit__(self, *exc: object) -> None:
        if self.seconds > 0:
            with SwitchInterval._lock:
                SwitchInterval._inside -= 1
                if SwitchInterval._inside == 0:
                    sys.setswitchinterval(SwitchInterval._saved)


@dataclass(frozen=True, slots=True)
class JobDone:
    """One finished job: ``blocks_ok`` per block of the job, in its order (a dropped job: all False)."""

    job_id: int
    is_load: bool
    blocks_ok: list[bool]
    seconds: float
    nbytes: int

    @property
    def ok(self) -> bool:
        return all(self.blocks_ok)


@dataclass(slots=True)
class _Job:
    job_id: int
    keys: list[BlockKey]
    chunk_ids: np.ndarray
    submitted: float


class TierJobs:
    """Store and load jobs between the primary tier's rows and the pool (see the module docstring).

    ``pool`` None: the tier is off (its config could not be used); every lookup is a miss and every job
    fails at once.
    """

    def __init__(self, pool: PoolClient | None, rows: np.ndarray, store_queue_bytes: int = DEFAULT_STORE_QUEUE_BYTES,
                 switch_interval_us: int = DEFAULT_SWITCH_INTERVAL_US):
        if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
            raise ValueError(f"rows must be a C-contiguous 2-D uint8 array, got {rows.dtype} {rows.shape}")
        self.pool = pool
        self.rows = rows
        self.row_bytes = int(rows.shape[1])
        self.store_queue_bytes = store_queue_bytes
        self.switch = SwitchInterval(switch_interval_us * 1e-6)  # while a job or a lookup runs
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0  # jobs submitted and not yet in _done
        self._store_bytes = 0  # bytes of the store jobs waiting or running
        self._stats: Counter[str] = Counter()
        self._done: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stores: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(q, run), name=f"kvpool-tier-{name}", daemon=True)
                         for name, q, run in (("load", self._loads, self._load), ("store", self._stores, self._store))]
        if pool is not None:
            for t in self._threads:
                t.start()

    # -- vLLM's scheduler thread --------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether the pool holds it; all False when off or on a fault (runs on the caller's thread)."""
        if self.pool is None or not keys:
            return [False] * len(keys)
        try:
            with self.switch:
                found = self.pool.exists(keys)
        except Exception:  # noqa: BLE001 - a fault is a miss (PoolClient counts its own faults)
            found = []
        if len(found) != len(keys):
            self._count("lookup_faults", 1)
            return [False] * len(keys)
        return [bool(f) for f in found]

    def submit_store(self, job_id: int, keys: list[BlockKey], chunk_ids: np.ndarray) -> None:
        """Queue a store of rows ``chunk_ids`` under ``keys``; dropped at once when off or past the bound."""
        job = self._job(job_id, keys, chunk_ids)
        nbytes = len(keys) * self.row_bytes
        with self._lock:
            admitted = (self.pool is not None and not self._closed and
                        (self._store_bytes == 0 or self._store_bytes + nbytes <= self.store_queue_bytes))
            self._in_flight += 1
            if admitted:
                self._store_bytes += nbytes
        if not admitted:
            self._count("dropped_blocks", len(keys))
            self._finish(JobDone(job_id, False, [False] * len(keys), 0.0, 0))
            return
        self._stores.put(job)

    def submit_load(self, job_id: int, keys: list[BlockKey], chunk_ids: np.ndarray) -> None:
        """Queue a load of ``keys`` into rows ``chunk_ids``; failed at once when off."""
        job = self._job(job_id, keys, chunk_ids)
        with self._lock:
            admitted = self.pool is not None and not self._closed
            self._in_flight += 1
        if not admitted:
            self._count("load_failed_blocks", len(keys))
            self._finish(JobDone(job_id, True, [False] * len(keys), 0.0, 0))
            return
        self._loads.put(job)

    def finished(self) -> list[JobDone]:
        """The jobs finished since the last call."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._lock:
            return self._in_flight

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (and so stopped touching its rows); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def take_stats(self) -> Counter[str]:
        """Block counts since the last call: ``stored_blocks``, ``store_failed_blocks``, ``dropped_blocks``,
        ``loaded_blocks``, ``load_failed_blocks``, and ``lookup_faults`` (lookups answered all-miss)."""
        with self._lock:
            stats, self._stats = self._stats, Counter()
        return stats

    def close(self, timeout: float = 0.0) -> None:
        """Let the queued jobs finish for up to ``timeout`` seconds (a store queued as vLLM shuts down still
        reaches the pool), then fail what is left (each still reported once), stop the threads and let go of the
        rows. A job running then is always finished first: vLLM unmaps the rows next."""
        self.drain(timeout)
        with self._lock:
            self._closed = True
        for q in (self._loads, self._stores):
            q.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join()
        self.rows = np.empty((0, self.row_bytes), dtype=np.uint8)  # no view of vLLM's region outlives the tier

    # -- the jobs' threads -------------------------------------------------------------------------------

    def _job(self, job_id: int, keys: list[BlockKey], chunk_ids: Sequence[int] | np.ndarray) -> _Job:
        ids = np.asarray(chunk_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) != len(keys):
            raise ValueError(f"job {job_id}: {len(keys)} keys but chunk ids of shape {ids.shape}")
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self.rows)):
            raise ValueError(f"job {job_id}: chunk ids outside the {len(self.rows)} rows of the primary tier")
        return _Job(job_id, keys, ids, time.monotonic())

    def _serve(self, jobs: queue.SimpleQueue[_Job | None], run: Callable[[_Job], list[bool]]) -> None:
        while (job := jobs.get()) is not None:
            is_load = jobs is self._loads
            with self._lock:
                closed = self._closed
            start = time.monotonic()
            try:
                if closed:
                    ok = [False] * len(job.keys)
                else:
                    with self.switch:
                        ok = run(job)
            except Exception:  # noqa: BLE001 - a pool fault is a failed job, never an error in vLLM
                ok = [False] * len(job.keys)
            done = JobDone(job.job_id, is_load, ok, time.monotonic() - start, sum(ok) * self.row_bytes)
            if is_load:
                self._count("loaded_blocks", sum(ok))
                self._count("load_failed_blocks", len(ok) - sum(ok))
            else:
                self._count("stored_blocks", sum(ok))
                self._count("store_failed_blocks", len(ok) - sum(ok))
                with self._lock:
                    self._store_bytes -= len(job.keys) * self.row_bytes
            self._finish(done)
        while True:  # closed: jobs queued behind the sentinel are failed, still reported once
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._finish(JobDone(job.job_id, jobs is self._loads, [False] * len(job.keys), 0.0, 0))

    def _store(self, job: _Job) -> list[bool]:
        assert self.pool is not None, "offload tier: a store job ran with the pool off"
        return [bool(x) for x in self.pool.store(job.keys, [self.rows[c] for c in job.chunk_ids])]

    def _load(self, job: _Job) -> list[bool]:
        """The leading run the pool holds, copied straight into the job's rows (checksum-verified)."""
        assert self.pool is not None, "offload tier: a load job ran with the pool off"
        ok = [False] * len(job.keys)
        run = self.pool.lookup(job.keys)
        if len(run) == 0:
            return ok
        if np.any(run.sizes != self.row_bytes):  # another deployment's block under our key: never copied
            return ok
        got = self.pool.get_into(run, [self.rows[c] for c in job.chunk_ids[: len(run)]])
        ok[: len(got)] = [bool(x) for x in got]
        return ok

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._lock:
                self._stats[name] += n

    def _finish(self, done: JobDone) -> None:
        self._done.put(done)
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()
