"""Where a small same-host put and get spend their time: `kvpool serve` in a subprocess, a PoolClient here.

    python benchmarks/put_latency.py [--size 4096] [--calls 1000] [--wait-commits]

Prints p50 microseconds of: placement from the client's cluster view, one
wire round trip (an empty ``Commit``), ``FlushReports``, a one-block
``store`` (one ``Commit``), a one-block ``lookup`` (from the arena, no round
trip) and a one-block ``get_into``. ``--wait-commits``: every Commit waits
for its answer (no commit pipe), the A/B of the pipe. Not a test: the
numbers depend on the machine (and on the node sharing its cores).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.v1 import node_pb2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p50_us(call: Callable[[int], object], calls: int) -> float:
    times = []
    for i in range(calls):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--wait-commits", action="store_true", help="no commit pipe: each Commit waits")
    args = parser.parse_args()
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "serve", "--master-port", str(port), "--master-metrics-port", "0",
         "--port", str(free_port()), "--metrics-port", "0", "--data-port", "0", "--no-ssd",
         "--dram-bytes", str(max(256 << 20, 4 * args.calls * args.size)), "--max-block-bytes", str(args.size),
         "--arena", f"kvpool-put-latency-{os.getpid()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with PoolClient(ClientConfig(master=f"127.0.0.1:{port}", strict=True)) as pool:
            if args.wait_commits:
                pool.shared_path.calls = None  # no connections to make pipes from: the waiting Commit
            deadline = time.monotonic() + 30
            while not pool.cluster.refresh() or not pool.cluster.nodes():
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise SystemExit("kvpool serve did not come up")
                time.sleep(0.1)
            value = np.random.default_rng(1).integers(0, 256, args.size, dtype=np.uint8)
            assert pool.store([opaque_key("warm-up")], [value]) == [True]
            node = pool.cluster.nodes()[0].ref
            stub = pool.nodes.stub(node.address)
            keys = [opaque_key(f"put-latency-{i}") for i in range(args.calls)]
            out = np.empty(args.size, dtype=np.uint8)
            rows = [
                ("placement (cluster view)", lambda i: pool.cluster.place([keys[i]], [args.size])),
                ("wire round trip (empty Commit)", lambda i: stub.Commit(node_pb2.CommitRequest(lease=1))),
                ("FlushReports", lambda i: stub.FlushReports(node_pb2.FlushReportsRequest())),
                ("store, one block (one Commit)", lambda i: pool.store([keys[i]], [value])),
                ("lookup, one block (the arena)", lambda i: pool.lookup([keys[i]])),
                ("lookup + get_into, one block", lambda i: pool.get_into(pool.lookup([keys[i]]), [out])),
            ]
            print(f"{args.size} B blocks, {args.calls} calls each, p50:")
            for name, call in rows:
                print(f"  {name:32s} {p50_us(call, args.calls):8.0f} us")
    finally:
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
