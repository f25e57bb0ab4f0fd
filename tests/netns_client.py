"""A pool client on one namespace host (tests/test_across_hosts.py): put or get N blocks, print one JSON line.

    python tests/netns_client.py MASTER put PREFIX N SIZE [--nodes K]
    python tests/netns_client.py MASTER get PREFIX N SIZE [--io-timeout S]

Block ``i`` of ``PREFIX`` has bytes derived from both, so a get checks that it
read exactly what the put wrote. ``put`` waits until the client sees ``--nodes``
live nodes, stores, and waits for the flush barrier; ``get`` looks every block
up, one at a time, and reads what the lookup found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key


def block(prefix: str, i: int, size: int) -> np.ndarray:
    seed = hashlib.sha256(f"{prefix}-{i}".encode()).digest()
    return np.resize(np.frombuffer(seed, np.uint8), size).copy()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("op", choices=["put", "get"])
    parser.add_argument("prefix")
    parser.add_argument("n", type=int)
    parser.add_argument("size", type=int)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--io-timeout", type=float, default=2.0)
    args = parser.parse_args()
    keys = [opaque_key(f"{args.prefix}-{i}") for i in range(args.n)]
    config = ClientConfig(master=args.master, lookup_timeout_s=1.0, io_timeout_s=args.io_timeout)
    with PoolClient(config) as pool:
        if args.op == "put":
            deadline = time.monotonic() + 30
            while not (pool.cluster.refresh() and len(pool.cluster.nodes()) >= args.nodes):
                if time.monotonic() > deadline:
                    print(json.dumps({"error": "nodes not seen", "nodes": len(pool.cluster.nodes())}))
                    return 1
                time.sleep(0.1)
            stored = 0
            for s in range(0, args.n, 16):
                stored += sum(pool.store(keys[s : s + 16], [block(args.prefix, i, args.size)
                                                            for i in range(s, min(args.n, s + 16))]))
            flushed = False
            while not flushed and time.monotonic() < deadline + 30:
                flushed = pool.flush()
            print(json.dumps({"stored": stored, "flushed": flushed}))
            return 0
        started = time.monotonic()
        found = ok = 0
        for i, key in enumerate(keys):  # one at a time: each block's hit or miss counts, not a leading run's
            run = pool.lookup([key])
            out = np.zeros(args.size, np.uint8)
            found += len(run)
            ok += bool(run) and pool.get_into(run, [out]) == [True] and np.array_equal(out, block(args.prefix, i,
                                                                                                  args.size))
        print(json.dumps({"found": found, "ok": ok, "seconds": time.monotonic() - started}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
