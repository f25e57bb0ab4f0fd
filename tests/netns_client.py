"""A pool client on one namespace host (tests/integration/test_across_hosts.py): put or get N blocks, print one
JSON line.

    python tests/netns_client.py MASTER put PREFIX N SIZE [--nodes K] [--start-at T]
    python tests/netns_client.py MASTER get PREFIX N SIZE [--io-timeout S] [--batch B] [--start-at T]
    python tests/netns_client.py MASTER lookup PREFIX N SIZE [--batch B] [--samples S]

Block ``i`` of ``PREFIX`` has bytes derived from both, so a get checks that it
read exactly what the put wrote. ``put`` waits until the client sees ``--nodes``
live nodes, stores, and waits for the flush barrier; ``get`` looks every block
up, one at a time (``--batch``: B at a time, the leading run of each), and reads what the
lookup found. ``lookup`` times ``--samples`` lookups of ``--batch`` consecutive keys from a random
place (p50 / p99). ``--start-at``: wait until that ``time.time()`` before the timed part (clients on
several hosts start together); every op reports when it started and ended.
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
    parser.add_argument("op", choices=["put", "get", "lookup"])
    parser.add_argument("prefix")
    parser.add_argument("n", type=int)
    parser.add_argument("size", type=int)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--io-timeout", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--start-at", type=float, default=0.0)
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
            values = [block(args.prefix, i, args.size) for i in range(args.n)] if args.start_at else None
            time.sleep(max(0.0, args.start_at - time.time()))
            begin = time.time()
            stored = 0
            for s in range(0, args.n, 16):
                if values is not None:
                    stored += sum(pool.store(keys[s : s + 16], values[s : s + 16]))
                    continue
                stored += sum(pool.store(keys[s : s + 16], [block(args.prefix, i, args.size)
                                                            for i in range(s, min(args.n, s + 16))]))
            flushed, flush_by = False, time.monotonic() + 30
            while not flushed and time.monotonic() < flush_by:
                flushed = pool.flush()
            report: dict[str, object] = {"stored": stored, "flushed": flushed}
            if args.start_at:
                report.update(begin=begin, end=time.time())
            print(json.dumps(report))
            return 0
        if args.op == "lookup":
            rng = np.random.default_rng(len(args.prefix))
            times = []
            for _ in range(args.samples):
                at = int(rng.integers(0, max(1, args.n - args.batch)))
                t0 = time.perf_counter()
                pool.lookup(keys[at : at + args.batch])
                times.append(time.perf_counter() - t0)
            print(json.dumps({"p50_us": float(np.percentile(times, 50) * 1e6),
                              "p99_us": float(np.percentile(times, 99) * 1e6)}))
            return 0
        outs_all = [np.zeros(args.size, np.uint8) for _ in range(args.batch)] if args.batch > 1 else []
        time.sleep(max(0.0, args.start_at - time.time()))
        begin = time.time()
        started = time.monotonic()
        found = ok = 0
        for s in range(0, args.n, args.batch) if args.batch > 1 else ():
            run = pool.lookup(keys[s : s + args.batch])
            outs = outs_all[: len(run)]
            got = pool.get_into(run, outs)
            found += len(run)
            ok += sum(got)  # the bytes are checked against their checksums; spot-check the first's content
            if len(run) and not np.array_equal(outs[0], block(args.prefix, s, args.size)):
                ok -= 1
        # one at a time: each block's hit or miss counts, not a leading run's
        for i, key in enumerate(keys if args.batch == 1 else ()):
            run = pool.lookup([key])
            out = np.zeros(args.size, np.uint8)
            found += len(run)
            ok += bool(run) and pool.get_into(run, [out]) == [True] and np.array_equal(out, block(args.prefix, i,
                                                                                                  args.size))
        print(json.dumps({"found": found, "ok": ok, "seconds": time.monotonic() - started, "begin": begin,
                          "end": time.time()}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
