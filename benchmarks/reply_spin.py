"""The A/B of the client's reply spin (``ClientConfig.spin_wait_us``): network-path calls with and without it.

    python benchmarks/reply_spin.py [--spin-us 300] [--calls 400] [--rounds 3]

One `kvpool serve` in a subprocess; network-path clients (``shared_memory=False``)
alternately with ``spin_wait_us=0`` (block on every reply at once) and with
``--spin-us``, ``--rounds`` times each, so both see the same moments of a noisy
machine. Prints p50 microseconds of a one-key master ``Lookup``, of a one-block
4 KiB ``lookup`` + ``get_into``, and the GB/s of 16 x 1 MiB network gets.
Not a test: the numbers depend on the machine (on a VM, what a blocked
thread's wake-up costs).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

from kvpool.buffers import aligned_empty
from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(master: str, spin_us: int, calls: int, tag: str) -> tuple[float, float, float]:
    """(one-key Lookup p50 us, 4 KiB lookup + get_into p50 us, 16 x 1 MiB get GB/s) with this spin."""
    small, big = aligned_empty(4096), [aligned_empty(1 << 20) for _ in range(16)]
    small[:] = 7
    for i, b in enumerate(big):
        b[:] = i
    outs = [aligned_empty(1 << 20) for _ in range(16)]
    for o in outs:
        o[:] = 0
    config = ClientConfig(master=master, shared_memory=False, strict=True, io_timeout_s=30, lookup_timeout_s=10,
                          spin_wait_us=spin_us)
    with PoolClient(config) as pool:
        keys = [opaque_key(f"{tag}-{i}") for i in range(calls)]
        big_keys = [opaque_key(f"{tag}-big-{i}") for i in range(16)]
        for k in keys:
            pool.store([k], [small])
        pool.store(big_keys, big)
        pool.flush()
        absent = [opaque_key(f"{tag}-absent")]
        lookups, gets = [], []
        for k in keys:
            t0 = time.perf_counter()
            pool.lookup(absent)
            t1 = time.perf_counter()
            found = pool.lookup([k])
            if not all(pool.get_into(found, [small])):
                raise RuntimeError("a 4 KiB get missed")
            lookups.append(t1 - t0)
            gets.append(time.perf_counter() - t1)
        best = 0.0
        for _ in range(20):
            t0 = time.perf_counter()
            found = pool.lookup(big_keys)
            if not all(pool.get_into(found, outs)):
                raise RuntimeError("a 1 MiB get missed")
            best = max(best, 16 * (1 << 20) / (time.perf_counter() - t0) / 1e9)
    return float(np.median(lookups) * 1e6), float(np.median(gets) * 1e6), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spin-us", type=int, default=ClientConfig().spin_wait_us)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "serve", "--master-port", str(port), "--master-metrics-port", "0",
         "--port", str(free_port()), "--metrics-port", "0", "--data-port", "0", "--no-ssd",
         "--dram-bytes", str(512 << 20), "--max-block-bytes", str(1 << 20), "--arena", f"kvpool-spin-{os.getpid()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        master = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # the node registers right after the master listens
            with PoolClient(ClientConfig(master=master, lookup_timeout_s=1)) as probe:
                if probe.cluster.refresh() and probe.cluster.nodes():
                    break
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit("kvpool serve did not come up")
            time.sleep(0.2)
        rows: dict[int, list[tuple[float, float, float]]] = {0: [], args.spin_us: []}
        for r in range(args.rounds):
            for spin in rows:
                rows[spin].append(measure(master, spin, args.calls, f"r{r}-s{spin}"))
    finally:
        serve.terminate()
        serve.wait(30)
    print(f"network path, {args.rounds} alternating rounds each; medians of the rounds' figures")
    print(f"{'spin_wait_us':>12s} {'Lookup p50 us':>14s} {'4 KiB lookup+get p50 us':>24s} {'16 x 1 MiB get GB/s':>20s}")
    for spin, got in rows.items():
        lk, gt, gb = (float(np.median([g[i] for g in got])) for i in range(3))
        print(f"{spin:12d} {lk:14.0f} {gt:24.0f} {gb:20.2f}")


if __name__ == "__main__":
    main()
