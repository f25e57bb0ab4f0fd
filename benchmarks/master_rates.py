"""What one master process sustains, for docs/scaling.md: report ingest and lookups per second on one core.

    python benchmarks/master_rates.py [--blocks 1000000] [--keys 64] [--calls 3000]

- **ingest**: a real MasterServer's servicer takes ``ReportBlocks`` of 50,000 added keys (the chunk a node's
  full report sends) from two registered nodes until ``--blocks`` are indexed: keys per second.
- **lookup, in process**: ``Lookup`` of ``--keys`` keys (half present) called on the servicer directly:
  the index and the servicer's work per call, no transport.
- **lookup, over the wire**: the same requests from one client thread through the fast-call listener
  (``DirectMaster``), the way nodes' clients ask: calls per second one master answers one caller.

One Python process has one core's worth of GIL, so these are per-core figures.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kvpool.config import MasterConfig
from kvpool.master import MasterServer
from kvpool.master_client import DirectMaster
from kvpool.tcp import ConnectionPool
from kvpool.v1 import common_pb2, master_pb2

CHUNK = 50_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 256, (args.blocks, 32), dtype=np.uint8)
    with MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0, node_timeout_s=3600)) as master:
        servicer = master.servicer
        incs = []
        for i in range(2):
            ref = common_pb2.NodeRef(node_id=f"n{i}", address=f"n{i}.test:1", host_id=f"h{i}", arena=f"a{i}")
            incs.append(servicer.RegisterNode(master_pb2.RegisterNodeRequest(node=ref, dram_max_block_bytes=1 << 20),
                                              None).incarnation)
        started = time.perf_counter()
        for n, s in enumerate(range(0, args.blocks, CHUNK)):
            part = keys[s : s + CHUNK]
            servicer.ReportBlocks(master_pb2.ReportBlocksRequest(
                node_id=f"n{n % 2}", incarnation=incs[n % 2], tier=common_pb2.TIER_DRAM,
                added_keys=part.tobytes(), added_sizes=[4096] * len(part), added_checksums=[7] * len(part)), None)
        ingest = args.blocks / (time.perf_counter() - started)
        half = args.keys // 2
        requests = []
        for _ in range(200):
            at = int(rng.integers(0, args.blocks - half))
            present = keys[at : at + half].tobytes()
            absent = rng.integers(0, 256, (args.keys - half, 32), dtype=np.uint8).tobytes()
            requests.append(master_pb2.LookupRequest(keys=present + absent, worker_id="bench"))
        started = time.perf_counter()
        for i in range(args.calls):
            servicer.Lookup(requests[i % len(requests)], None)
        in_process = args.calls / (time.perf_counter() - started)
        pool = ConnectionPool(5.0)
        fast = DirectMaster(master.address, pool=pool, timeout_s=5.0, max_message_bytes=64 << 20)
        fast.lookup(requests[0], 5)
        times = []
        for i in range(args.calls):
            t0 = time.perf_counter()
            fast.lookup(requests[i % len(requests)], 5)
            times.append(time.perf_counter() - t0)
        fast.close()
        pool.close()
        wire = len(times) / sum(times)
        with open(f"/proc/{os.getpid()}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(f"{args.blocks} blocks indexed; {args.keys}-key lookups, half present")
    print(f"ingest (ReportBlocks of {CHUNK} keys): {ingest / 1e3:.0f} k keys/s")
    print(f"Lookup in process: {in_process:.0f} calls/s ({1e6 / in_process:.0f} us a call)")
    print(f"Lookup over the wire, one caller: {wire:.0f} calls/s (p50 {np.median(times) * 1e6:.0f} us, "
          f"p99 {np.percentile(times, 99) * 1e6:.0f} us)")
    print(f"process RSS {rss / (1 << 20):.0f} MiB")


if __name__ == "__main__":
    main()
