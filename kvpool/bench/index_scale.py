"""``kvpool bench index``: the master's lookup latency and memory per indexed block, 1 thousand to 10 million blocks.

Per size N, a fresh in-process MasterServer (port 0, no metrics endpoint,
timeouts long enough that its sweeper never drops the two bench nodes) gets two
nodes registered through its membership, and its BlockIndex gets N random
32-byte keys through :meth:`BlockIndex.add`, batches of ``--batch`` keys
alternating between the two node numbers. Then:

- **memory per block**: the growth of traced memory over the fill, divided by
  N. tracemalloc sees numpy's allocations; the server and its empty index
  exist before tracing starts, so this is what the fill added and still holds
  (the empty index's first small table is replaced during the fill, so sizes
  start at 1,000). *peak* is the highest traced memory during the fill
  (rehashing holds old and new arrays at once). The RSS growth
  (``/proc/self/statm``) is a cross-check: it includes allocator slack, and can
  undercount memory that an earlier size freed and this one reused.
- **in-process**: ``--calls`` :meth:`BlockIndex.leading_run` calls of
  ``--keys`` keys (a present run of half of them, drawn at random from the
  index, then absent keys, like a real lookup) and ``--calls``
  :meth:`BlockIndex.exists` calls on the same batches, each call timed alone:
  p50 / p99 microseconds per call.
- **gRPC**: the same batches as prebuilt ``LookupRequest``s through a real
  channel to the server: serialisation both ways, the servicer's checks and
  metrics, and the index lookup.
- **drop**: :meth:`BlockIndex.drop_node` of a third node given 1% more
  blocks after the measures above (what one node of a hundred holds), then of
  one of the two nodes (half the blocks). A drop looks up the node's own keys
  (its :class:`~kvpool.master.node_keys.NodeKeys` list), or scans the location
  columns once when that is cheaper (a node holding a large share of the
  index): the first figure is one node's expiry in a fleet, the second the
  worst case.

The aims: at most :data:`AIM_BYTES_PER_BLOCK` bytes per block, and p50s that
stay flat from the smallest size to the largest (memory latency still adds
some: at 10 million blocks the table is far larger than any CPU cache).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from kvpool.config import MasterConfig
from kvpool.keys import KEY_BYTES, BlockKey, pack_keys
from kvpool.master.server import MasterServer
from kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.vocabulary import NodeRef, Tier

AIM_BYTES_PER_BLOCK = 200
MIN_BLOCKS = 1000
SAMPLE_KEYS = 1 << 16  # present keys the lookups draw from: the first keys filled in
BLOCK_BYTES = 1 << 20  # the size every bench block reports (any value does)
WARMUP_CALLS = 20
_LONG_S = 1e6  # node and worker timeouts of the bench master: never reached

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Row:
    blocks: int
    fill_s: float
    bytes_traced: float  # per block
    bytes_peak: float  # per block
    bytes_rss: float  # per block
    run_us: tuple[float, float]  # p50, p99
    exists_us: tuple[float, float]
    grpc_us: tuple[float, float]
    drop_ms: float
    drop_small_ms: float


def _split(raw: bytes) -> list[BlockKey]:
    return [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]


def _rss_bytes() -> int:
    """Resident set size from /proc/self/statm; -1 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _timed(call: Callable[[T], R], inputs: Sequence[T], check: Callable[[R], bool]) -> tuple[float, float]:
    """p50 and p99 microseconds of ``call`` over ``inputs``, each call timed alone and its result checked."""
    for item in inputs[:WARMUP_CALLS]:
        call(item)
    took = np.empty(len(inputs))
    for i, item in enumerate(inputs):
        start = time.perf_counter_ns()
        result = call(item)
        took[i] = time.perf_counter_ns() - start
        if not check(result):
            raise AssertionError(f"bench: call {i} returned a wrong answer")
    p50, p99 = np.percentile(took, [50, 99]) / 1e3
    return float(p50), float(p99)


def bench_size(n: int, calls: int, width: int, batch: int, seed: int) -> Row:
    """Fill a fresh master's index with ``n`` blocks and measure it; the server is stopped before returning."""
    rng = np.random.default_rng([seed, n])
    sample = _split(rng.bytes(KEY_BYTES * min(n, SAMPLE_KEYS)))
    config = MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0, node_timeout_s=_LONG_S, worker_timeout_s=_LONG_S)
    server = MasterServer(config).start()
    try:
        membership, index = server.membership, server.index
        numbers = [
            membership.register(NodeRef(f"bench-{i}", f"bench-{i}.invalid:7610"), [], BLOCK_BYTES).number
            for i in range(3)
        ]
        gc.collect()
        rss_before = _rss_bytes()
        tracemalloc.start()
        traced_before = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        step = min(batch, (n + 1) // 2)  # at least one batch per node
        done = adds = 0
        while done < n:
            if done < len(sample):
                keys = sample[done : done + step]
            else:
                keys = _split(rng.bytes(KEY_BYTES * min(step, n - done)))
            if not index.add(numbers[adds % 2], Tier.DRAM, keys, [BLOCK_BYTES] * len(keys), [0] * len(keys)):
                raise AssertionError("bench: the index refused a report for an open node number")
            done += len(keys)
            adds += 1
        fill_s = time.perf_counter() - start
        del keys  # the last batch is the bench's, not the index's
        traced_after, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_after = _rss_bytes()
        if len(index) != n:
            raise AssertionError(f"bench: {n} keys filled in but the index holds {len(index)}")

        half = width // 2
        picks = rng.integers(0, len(sample), (calls, half)).tolist()
        batches = [[sample[i] for i in row] + _split(rng.bytes(KEY_BYTES * (width - half))) for row in picks]
        run_us = _timed(index.leading_run, batches, lambda hits: len(hits) == half)
        exists_us = _timed(index.exists, batches, lambda flags: all(flags[:half]) and not any(flags[half:]))
        requests = [master_pb2.LookupRequest(keys=pack_keys(keys), block_tokens=16) for keys in batches]
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            grpc_us = _timed(stub.Lookup, requests, lambda reply: len(reply.tiers) == half)

        small = max(1, n // 100)  # node 2: 1% more blocks, as one node of a hundred holds
        for lo in range(0, small, step):
            keys = _split(rng.bytes(KEY_BYTES * min(step, small - lo)))
            index.add(numbers[2], Tier.DRAM, keys, [BLOCK_BYTES] * len(keys), [0] * len(keys))
        start = time.perf_counter()
        dropped_small = index.drop_node(numbers[2])
        drop_small_ms = (time.perf_counter() - start) * 1e3
        if dropped_small != small or len(index) != n:
            raise AssertionError(f"bench: dropping the 1% node removed {dropped_small} of {small} locations")
        start = time.perf_counter()
        dropped = index.drop_node(numbers[1])
        drop_ms = (time.perf_counter() - start) * 1e3
        if len(index) != n - dropped:
            raise AssertionError(f"bench: dropping a node removed {dropped} locations but left {len(index)} of {n}")
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        server.stop(grace=0)
        server.wait(timeout=5)
    rss = (rss_after - rss_before) / n if rss_before >= 0 and rss_after >= 0 else float("nan")
    return Row(
        n, fill_s, (traced_after - traced_before) / n, (traced_peak - traced_before) / n, rss,
        run_us, exists_us, grpc_us, drop_ms, drop_small_ms,
    )


def _count(n: int) -> str:
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def render(rows: list[Row], width: int) -> str:
    """A markdown table, with whether the memory aim is met and how far the p50s moved across the sizes."""
    lines = [
        "| blocks | B/block | peak B/block | RSS B/block | leading_run p50 / p99 µs | exists p50 / p99 µs "
        "| gRPC Lookup p50 / p99 µs | fill s | drop node ms: 1% / half of the blocks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "ok" if r.bytes_traced <= AIM_BYTES_PER_BLOCK else "MISSED"
        lines.append(
            f"| {_count(r.blocks)} | {r.bytes_traced:.0f} {mark} | {r.bytes_peak:.0f} | {r.bytes_rss:.0f} "
            f"| {r.run_us[0]:.0f} / {r.run_us[1]:.0f} | {r.exists_us[0]:.0f} / {r.exists_us[1]:.0f} "
            f"| {r.grpc_us[0]:.0f} / {r.grpc_us[1]:.0f} | {r.fill_s:.1f} | {r.drop_small_ms:.1f} / {r.drop_ms:.0f} |"
        )
    lines.append(
        f"\nEach call looks up {width} keys: a present run of {width // 2}, then absent keys. "
        f"Aim: <= {AIM_BYTES_PER_BLOCK} bytes per block, lookup cost flat in the index size."
    )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        lines.append(
            f"p50 at {_count(last.blocks)} / p50 at {_count(first.blocks)}: "
            f"leading_run {last.run_us[0] / first.run_us[0]:.2f}x, "
            f"exists {last.exists_us[0] / first.exists_us[0]:.2f}x, "
            f"gRPC Lookup {last.grpc_us[0] / first.grpc_us[0]:.2f}x."
        )
    return "\n".join(lines)


def parse_count(text: str) -> int:
    """'1e6', '10M', '1000', '10K' -> a block count (K, M, G are powers of ten here)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad block count {text!r}") from None
    if value != int(value) or value < MIN_BLOCKS:
        raise argparse.ArgumentTypeError(f"block count {text!r}: a whole number, at least {MIN_BLOCKS}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default="1e3,1e4,1e5,1e6,1e7", help="index sizes in blocks, e.g. 1e3,1e5,10M (default: %(default)s)"
    )
    parser.add_argument("--max", type=parse_count, help="skip sizes above this many blocks")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per figure (default: %(default)s)")
    parser.add_argument("--keys", type=int, default=512,
                        help="keys per lookup, half of them present (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=65536,
                        help="keys per BlockIndex.add while filling (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys (default: %(default)s)")
    parser.add_argument("--out", help="also write the markdown table to this file")


def run(args: argparse.Namespace) -> int:
    sizes = [parse_count(s) for s in args.sizes.split(",")]
    if args.max is not None:
        sizes = [n for n in sizes if n <= args.max]
    if not sizes:
        raise ValueError("no sizes left to measure (--sizes / --max)")
    if args.calls < 1 or args.keys < 2 or args.batch < 1:
        raise ValueError("--calls and --batch must be positive and --keys at least 2")
    rows = []
    for n in sizes:
        row = bench_size(n, args.calls, args.keys, args.batch, args.seed)
        rows.append(row)
        print(
            f"  {_count(n)} blocks: {row.bytes_traced:.0f} B/block, leading_run p50 {row.run_us[0]:.0f} µs, "
            f"gRPC p50 {row.grpc_us[0]:.0f} µs",
            flush=True,
        )
    table = render(rows, args.keys)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0
