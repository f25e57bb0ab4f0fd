"""Many client processes against one node: aggregate throughput, and no errors.

    python benchmarks/many_clients.py [--clients 8] [--blocks 64] [--size 1M] [--rounds 3] [--no-shared-memory]

Starts ``kvpool serve`` (one node), then N client processes at once. Each
stores ``--blocks`` blocks of its own, then looks them up and reads them back
(checking every byte), ``--rounds`` times over fresh keys. Reports per-client
and aggregate put/get GB/s, the pool errors every client counted, and wrong
bytes (both must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def child(args: argparse.Namespace) -> int:
    import numpy as np
    from workload import aligned

    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig
    from kvpool.keys import opaque_key

    config = ClientConfig(master=args.master, shared_memory=not args.no_shared_memory, io_timeout_s=30)
    src = aligned(args.blocks, args.size)
    src[:] = np.random.default_rng(args.id).integers(0, 256, src.shape, dtype=np.uint8)
    dst = aligned(args.blocks, args.size)
    dst[:] = 0
    put_s = get_s = 0.0
    wrong = 0
    with PoolClient(config) as pool:
        for r in range(args.rounds):
            keys = [opaque_key(f"c{args.id}-r{r}-{i}") for i in range(args.blocks)]
            t0 = time.perf_counter()
            for s in range(0, args.blocks, args.batch):
                pool.store(keys[s : s + args.batch], list(src[s : s + args.batch]))
            put_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            for s in range(0, args.blocks, args.batch):
                found = pool.lookup(keys[s : s + args.batch])
                pool.get_into(found, list(dst[s : s + len(found)]))
            get_s += time.perf_counter() - t0
            wrong += int((dst != src).any(axis=1).sum())
            dst[:] = 0
        errors = {s.labels["kind"]: s.value for m in pool.registry.collect() if m.name == "kvpool_errors"
                  for s in m.samples if s.name.endswith("_total")}
    moved = args.rounds * args.blocks * args.size
    print(json.dumps({"put_gbps": moved / put_s / 1e9, "get_gbps": moved / get_s / 1e9, "put_s": put_s,
                      "get_s": get_s, "bytes": moved, "wrong_blocks": wrong, "errors": errors}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="driver", choices=["driver", "child"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--size", default="1M")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-shared-memory", action="store_true")
    parser.add_argument("--master")
    parser.add_argument("--id", type=int, default=0)
    args = parser.parse_args()
    from kvpool.config import parse_size

    args.size = parse_size(args.size)
    if args.role == "child":
        return child(args)
    from compare_mooncake import free_port, stop, wait_port

    port = free_port()
    dram = 2 * args.clients * args.blocks * args.size + (64 << 20)
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "serve", "--master-port", str(port), "--master-metrics-port", "0",
         "--port", str(free_port()), "--metrics-port", "0", "--data-port", "0", "--no-ssd",
         "--dram-bytes", str(dram), "--max-block-bytes", str(args.size), "--arena", f"kvpool-many-{os.getpid()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, serve)
        time.sleep(0.5)  # the node registers right after the master listens
        common = ["--master", f"127.0.0.1:{port}", "--blocks", str(args.blocks), "--size", str(args.size),
                  "--batch", str(args.batch), "--rounds", str(args.rounds)]
        common += ["--no-shared-memory"] if args.no_shared_memory else []
        t0 = time.perf_counter()
        children = [subprocess.Popen([sys.executable, __file__, "child", "--id", str(i), *common],
                                     stdout=subprocess.PIPE, text=True) for i in range(args.clients)]
        results = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
        wall = time.perf_counter() - t0
    finally:
        stop(serve)
    moved = sum(r["bytes"] for r in results)
    put_wall = max(r["put_s"] for r in results)
    get_wall = max(r["get_s"] for r in results)
    errors = sum(sum(r["errors"].values()) for r in results)
    wrong = sum(r["wrong_blocks"] for r in results)
    path = "network (bulk TCP)" if args.no_shared_memory else "same host (shared memory)"
    print("| clients | path | aggregate put GB/s | aggregate get GB/s | per-client put GB/s (min-max) "
          "| errors | wrong blocks |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.clients} | {path} | {moved / put_wall / 1e9:.2f} | {moved / get_wall / 1e9:.2f} "
          f"| {min(r['put_gbps'] for r in results):.2f}-{max(r['put_gbps'] for r in results):.2f} "
          f"| {errors:.0f} | {wrong} |")
    print(f"\n{moved >> 20} MiB each way in {wall:.1f} s of wall time; "
          "aggregate = all bytes / the slowest client's time")
    return 0 if errors == 0 and wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
