"""The one workload both sides of ``compare_mooncake.py`` run, so their numbers mean the same thing.

A *client* object offers ``put(keys, values)``, ``get(keys, outs)`` (both
batched, synchronous: when they return the bytes are stored / in ``outs``),
``sync()`` (every block put so far is in the cluster's index: a throughput
round's time includes it) and ``lookup(keys)``. :func:`measure` times it and returns plain numbers:

- throughput: batches of ``batch`` blocks, total bytes / wall time, best of ``rounds``;
- latency: single-block calls, p50 / p99 over ``samples`` calls;
- lookup: one call of 512 keys, half present, p50 / p99 over ``lookups`` calls.

This file is imported by both sides (kvpool's environment and Mooncake's
venv), so it needs only numpy and the standard library.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KV_LAYOUT_BYTES = 2 * 28 * 128 * 4 * 128 * 2  # K+V, 28 layers, block 128, 4 KV heads, head dim 128, bf16
SIZES = {
    "4 KiB": 4 << 10, "256 KiB": 256 << 10, "1 MiB": 1 << 20, "8 MiB": 8 << 20, "KV block (7 MiB)": KV_LAYOUT_BYTES,
}


def blocks_for(size: int, total: int) -> int:
    return int(min(2048, max(16, total // size)))


def aligned(n: int, size: int) -> np.ndarray:
    """``n`` page-aligned rows of ``size`` bytes (engines' buffers are aligned)."""
    raw = np.empty(n * size + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + n * size].reshape(n, size)


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q)) * 1e6


def measure(client: Any, size: int, *, total: int, batch: int, rounds: int, samples: int,
            key: Callable[[str], Any]) -> dict[str, float]:
    """Put/get throughput and latency for one value size."""
    n = blocks_for(size, total)
    rng = np.random.default_rng(size)
    src = aligned(n, size)
    src[:] = rng.integers(0, 256, (n, size), dtype=np.uint8)
    dst = aligned(n, size)
    out: dict[str, float] = {"blocks": n}
    best_put = best_get = float("inf")
    for r in range(rounds):
        keys = [key(f"tp-{size}-{r}-{i}") for i in range(n)]  # fresh keys: a put really writes
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            ok = client.put(keys[s : s + batch], list(src[s : s + batch]))
            if not all(ok):
                raise RuntimeError(f"put of {size} B blocks failed: {ok}")
        client.sync()  # every block of the round in the index: counted in the put's time
        best_put = min(best_put, time.perf_counter() - t0)
        dst[:] = 0
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            ok = client.get(keys[s : s + batch], list(dst[s : s + batch]))
            if not all(ok):
                raise RuntimeError(f"get of {size} B blocks failed")
        best_get = min(best_get, time.perf_counter() - t0)
        if not np.array_equal(dst, src):
            raise RuntimeError(f"{size} B blocks came back different")
        client.remove(keys)
    out["put_gbps"] = n * size / best_put / 1e9
    out["get_gbps"] = n * size / best_get / 1e9
    samples = min(samples, n)  # bounded memory: at most the working set again
    lat_keys = [key(f"lat-{size}-{i}") for i in range(samples)]
    puts, gets = [], []
    for i, k in enumerate(lat_keys):
        t0 = time.perf_counter()
        client.put([k], [src[i % n]])
        puts.append(time.perf_counter() - t0)
    client.sync()
    for i, k in enumerate(lat_keys):
        t0 = time.perf_counter()
        if not all(client.get([k], [dst[i % n]])):
            raise RuntimeError("latency get failed")
        gets.append(time.perf_counter() - t0)
    client.remove(lat_keys)
    out.update(put_p50_us=_pct(puts, 50), put_p99_us=_pct(puts, 99),
               get_p50_us=_pct(gets, 50), get_p99_us=_pct(gets, 99))
    return out


def measure_lookup(client: Any, *, lookups: int, key: Callable[[str], Any]) -> dict[str, float]:
    """p50/p99 of one 512-key lookup where the first 256 keys are present."""
    present = [key(f"lookup-{i}") for i in range(256)]
    value = np.zeros(4096, np.uint8)
    for s in range(0, 256, 64):
        client.put(present[s : s + 64], [value] * 64)
    client.sync()
    absent = [key(f"absent-{i}") for i in range(256)]
    times = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        found = client.lookup(present + absent)
        times.append(time.perf_counter() - t0)
    if found != 256:
        raise RuntimeError(f"lookup found {found} of 256 present keys")
    client.remove(present)
    return {"lookup_p50_us": _pct(times, 50), "lookup_p99_us": _pct(times, 99)}


def memcpy_gbps(size: int, total: int, rounds: int) -> float:
    """This machine's copy rate for the same blocks between the same kind of buffers."""
    n = blocks_for(size, total)
    src, dst = aligned(n, size), aligned(n, size)
    src[:] = 7
    dst[:] = 0  # fault the pages in before timing, as the stores' buffers are
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i], src[i])
        best = min(best, time.perf_counter() - t0)
    return n * size / best / 1e9


def run_side(client: Any, args: Any, key: Callable[[str], Any]) -> dict[str, Any]:
    """Everything one side reports, as JSON-able numbers."""
    result: dict[str, Any] = {"sizes": {}, "pid": os.getpid()}
    for label in filter(None, args.sizes.split(";")):
        result["sizes"][label] = measure(client, SIZES[label], total=args.total_mib << 20, batch=args.batch,
                                         rounds=args.rounds, samples=args.samples, key=key)
    if args.lookups:
        result.update(measure_lookup(client, lookups=args.lookups, key=key))
    return result


def add_common_arguments(parser: Any) -> None:
    parser.add_argument("--sizes", default=";".join(SIZES), help="';'-separated size labels")
    parser.add_argument("--total-mib", type=int, default=256, help="working set per size")
    parser.add_argument("--batch", type=int, default=16, help="blocks per call for throughput")
    parser.add_argument("--rounds", type=int, default=3, help="throughput passes; the best counts")
    parser.add_argument("--samples", type=int, default=200, help="single-block calls for latency")
    parser.add_argument("--lookups", type=int, default=500, help="512-key lookups for latency (0: skip)")
