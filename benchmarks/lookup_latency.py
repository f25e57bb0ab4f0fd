"""Master call latency from a client: `Exists`, `Lookup` and `Score` of 1 and 512 keys, p50 over 1,000 calls.

    python benchmarks/lookup_latency.py [--blocks 100000] [--calls 1000]

A master in this process (its wire listener on 127.0.0.1) holds ``--blocks``
blocks of one node; a `PoolClient` here asks for 256 held and 256 unknown
keys, as `compare_mooncake.py`'s lookup does. `exists(1 key)` is the floor of
one wire round trip on this machine; the rest is the index and the messages.
`score` asks the same 512 keys for 4 and for 64 workers, each holding the
first 128 of them in HBM (reported through `ReportHbm`), through
:class:`kvpool.routing.ScoreClient` (a fast call, like `lookup`).
Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig
from kvpool.keys import BlockKey
from kvpool.master.server import MasterServer
from kvpool.routing import ScoreClient
from kvpool.vocabulary import NodeRef, Tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    server = MasterServer(MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0, node_timeout_s=1e6,
                                       worker_timeout_s=1e6)).start()
    try:
        number = server.membership.register(NodeRef("bench-node", "bench-node.invalid:1"), [], 4096).number
        rng = np.random.default_rng(0)
        keys = [BlockKey(rng.bytes(32)) for _ in range(args.blocks)]
        for i in range(0, len(keys), 1000):
            part = keys[i : i + 1000]
            server.index.add(number, Tier.DRAM, part, [4096] * len(part), [0] * len(part))
        asked = keys[:256] + [BlockKey(rng.bytes(32)) for _ in range(256)]
        workers = [f"worker-{w}" for w in range(64)]
        for worker in workers:
            server.hbm.report(worker, asked[:128], [])
        config = ClientConfig(master=server.address)
        with PoolClient(config) as pool, ScoreClient(config) as scores:
            for name, call in (("exists, 1 key", lambda: pool.exists(asked[:1])),
                               ("exists, 512 keys", lambda: pool.exists(asked)),
                               ("lookup, 1 key", lambda: pool.lookup(asked[:1])),
                               ("lookup, 512 keys (256 held)", lambda: pool.lookup(asked)),
                               ("score, 512 keys, 4 workers", lambda: scores.score(asked, workers[:4])),
                               ("score, 512 keys, 64 workers", lambda: scores.score(asked, workers))):
                for _ in range(100):
                    call()
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                print(f"{name}: p50 {np.median(times) * 1e6:.0f} us, p99 {np.percentile(times, 99) * 1e6:.0f} us")
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
