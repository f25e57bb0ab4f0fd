"""Stand-ins for vLLM's CUDA-only CPU offloading worker, so vLLM's own offloading runs on this CPU machine.

vLLM's ``CPUOffloadingWorker`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``) copies KV blocks between the GPU and the
CPU tier's shared-memory rows with CUDA streams, and ``CPUOffloadingSpec.get_worker`` refuses any platform that is
not CUDA-alike or XPU. Everything else of vLLM's offloading (the ``OffloadingConnector`` on both sides, the
``TieringOffloadingManager``, its CPU tier and secondary tiers) runs here unchanged. Two stand-ins, and nothing
else is replaced:

- :class:`CpuStandInTieringSpec`: vLLM's ``TieringOffloadingSpec`` with one method replaced, ``get_worker``, which
  returns a :class:`CpuOffloadingWorkerStandIn`: the same copies (one vLLM block per chunk, each KV cache tensor's
  page into this worker's slot of the chunk's row, as ``create_next_worker_view`` lays it out) done with
  ``torch`` indexing on CPU tensors, finished at once. Loaded by vLLM from the extra config
  (``"spec_name": "CpuStandInTieringSpec", "spec_module_path": "vllm_offload_standins"``).
- :class:`GpuWorkerStandIn`: for tests that drive the manager without a model (tests/vllm_offload_driver.py):
  writes a chunk's "GPU" bytes (a function of its key) into the rows through its own mapping of the region.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class CpuOffloadingWorkerStandIn(OffloadingWorker):
    """vLLM's CPU offloading worker's copies, on CPU: GPU block ids <-> CPU tier chunk ids, every tensor."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion, blocks_per_chunk: int):
        if blocks_per_chunk != 1:
            raise ValueError("the stand-in copies one vLLM block per chunk (blocks_per_chunk 1)")
        self.region = region
        # (vLLM's (num_blocks, page) int8 view of one KV cache tensor, this worker's (num_chunks, page) view of it)
        self.pairs = [(t.tensor, region.create_next_worker_view(t.page_size_bytes)) for t in kv_caches.tensors]
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, src_ids: np.ndarray, dst_ids: np.ndarray, to_host: bool) -> bool:
        start = time.perf_counter()
        src, dst = torch.from_numpy(src_ids).long(), torch.from_numpy(dst_ids).long()
        nbytes = 0
        for device, host in self.pairs:
            if to_host:
                host[dst] = device[src]
            else:
                device[dst] = host[src]
            nbytes += len(src) * device.shape[1]
        self.done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished inside its submit

    def shutdown(self) -> None:
        self.pairs.clear()
        self.region.cleanup()


class CpuStandInTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` whose worker is :class:`CpuOffloadingWorkerStandIn` (see the module doc)."""

    standin: CpuOffloadingWorkerStandIn | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.standin is None:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self.standin = CpuOffloadingWorkerStandIn(kv_caches, region, self.blocks_per_chunk)
        return self.standin


def gpu_bytes(key: bytes, n: int) -> np.ndarray:
    """The "GPU" KV bytes of the chunk with offload key ``key``: the same in every process."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class GpuWorkerStandIn:
    """The worker's side of the CPU tier for a manager driven without a model: its own mapping of the region
    (rank 0), "GPU" bytes written into a chunk's row as a store does, compared after a load."""

    def __init__(self, spec: Any):
        self.region = SharedOffloadRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=0,
                                          kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                          cpu_page_size=spec.cpu_page_size_per_worker)
        self.rows = np.asarray(self.region.create_kv_memoryview()).view(np.uint8)
        self.chunk_bytes = spec.cpu_page_size_per_worker  # one worker's bytes of a chunk (one worker here)

    def store(self, keys: list[bytes], chunk_ids: np.ndarray) -> None:
        for key, c in zip(keys, chunk_ids):
            self.rows[c, : self.chunk_bytes] = gpu_bytes(key, self.chunk_bytes)

    def equal(self, keys: list[bytes], chunk_ids: np.ndarray) -> bool:
        return all(np.array_equal(self.rows[c, : self.chunk_bytes], gpu_bytes(key, self.chunk_bytes))
                   for key, c in zip(keys, chunk_ids))

    def close(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)  # unmapped next: no view of it may outlive it
        self.region.cleanup()
