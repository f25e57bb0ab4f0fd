"""The vLLM connector's save on the engine's thread, one process against an in-process master and node.

    python benchmarks/save_path.py [--rounds 15]

A vLLM-shaped host KV cache (24 layers, 16 KiB a block's slice of a layer,
800 blocks: the qwen2-0.5b shape of ``benchmarks/vllm_ttft.py``) and saves of 64
blocks (24 MiB) at a time, two ways, each timed on the calling thread
(what the forward waits for):

- ``two-step``: :meth:`PoolWorker.save` (host caches): ``prepare_put`` leases
  the slots, each block's layer pieces are gathered straight into its slot
  and hashed in the same pass, ``complete_put`` queues the handles: one copy.
- ``gather+put``: one indexed gather per layer into host staging, then
  ``PoolClient.put`` (which copies into the node's slots or host scratch):
  two copies, the path device caches take.

Every save is followed by ``flush`` (not timed). Prints the median and
minimum per way, and the two-step's parts (prepare, fill, complete).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.engines.vllm.scheduler import SaveJob
from kvpool.engines.vllm.worker import LayerCache, PoolWorker, save_ids
from kvpool.keys import opaque_key
from kvpool.master.server import MasterServer
from kvpool.node.daemon import PoolNode

LAYERS, BLOCKS, PIECE, SAVE = 24, 800, 16 << 10, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                     arena=f"kvpool-save-path-{time.time_ns()}", dram_bytes=300 << 20,
                     max_block_bytes=LAYERS * PIECE, ssd_enabled=False, ssd_dir=tempfile.mkdtemp())
    node = PoolNode(cfg).start()
    pool = PoolClient(ClientConfig(master=master.address, strict=True))
    try:
        wait_until(lambda: node.link.registered)
        layers = [LayerCache(f"layer{i}", torch.randint(0, 127, (BLOCKS, PIECE), dtype=torch.uint8), 0)
                  for i in range(LAYERS)]
        worker = PoolWorker(pool, layers)
        made = 0

        def job() -> SaveJob:
            nonlocal made
            made += 1
            first = made * 7 % (BLOCKS - SAVE)
            return SaveJob(f"r{made}", [opaque_key(f"save-{made}-{i}") for i in range(SAVE)],
                           list(range(first, first + SAVE)))

        def two_step() -> float:
            saved = job()
            start = time.perf_counter()
            worker.save([saved])
            return time.perf_counter() - start

        def gather_put() -> float:
            saved = job()
            start = time.perf_counter()
            blocks = worker.staging().blocks(SAVE)
            worker.gather(save_ids([saved]), blocks, range(LAYERS))
            worker.put([saved], blocks, 0.0)
            return time.perf_counter() - start

        for name, way in (("two-step", two_step), ("gather+put", gather_put)) * 2:  # the first pair warms up
            times = []
            for _ in range(args.rounds):
                times.append(way())
                assert pool.flush(30)
            times.sort()
            print(f"{name}: median {times[len(times) // 2] * 1e3:.2f} ms, min {times[0] * 1e3:.2f} ms")
        per_layer = [layer.tensor.numpy() for layer in layers]
        parts: dict[str, list[float]] = {"prepare": [], "fill": [], "complete": []}
        for _ in range(args.rounds):
            saved = job()
            t0 = time.perf_counter()
            prepared = pool.prepare_put(saved.keys, [LAYERS * PIECE] * SAVE)
            t1 = time.perf_counter()
            for i, block in enumerate(saved.block_ids):
                prepared.fill(i, [blocks[block] for blocks in per_layer])
            t2 = time.perf_counter()
            pool.complete_put(prepared)
            t3 = time.perf_counter()
            assert pool.flush(30) and prepared.in_slots == SAVE
            for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[part].append(seconds)
        print("two-step parts, median ms:",
              {part: round(float(np.median(v)) * 1e3, 2) for part, v in parts.items()})
    finally:
        pool.close()
        node.stop()
        master.stop()


if __name__ == "__main__":
    main()
