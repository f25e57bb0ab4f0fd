"""How much of the DRAM tier a mixed-size workload can use: ``kvpool bench fragmentation``.

Blocks of several sizes (one per model sharing the pool, or one engine's
per-layer pieces beside whole blocks) are written into one
:class:`~kvpool.tiers.dram.DramStore` far past its capacity, with reads
refreshing a random part of what it holds, so its LRU evicts all the time
and freed extents are reused by blocks of other sizes. After a warm-up, it
samples, after every put, the bytes of blocks held over the capacity (the
*usable fraction*: what fragmentation and the 64-byte rounding leave), and
counts blocks refused for want of a long enough free extent. A single-size
mix is the control: it must hold ~100% (an exact slot allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.keys import BlockKey
from kvpool.tiers.dram import DramStore

KIB, MIB = 1 << 10, 1 << 20

MIXES: dict[str, tuple[int, ...]] = {
    "one-size": (7 * MIB,),
    "two-models": (448 * KIB, 7 * MIB),
    "layers-and-blocks": (256 * KIB, 7 * MIB),
    "five-models": (64 * KIB, 192 * KIB, 1 * MIB, 3 * MIB + 512 * KIB, 9 * MIB),
    "uneven": (),  # sizes drawn uniformly from 4 KiB .. 8 MiB, not multiples of anything
}


@dataclass(frozen=True)
class MixResult:
    mix: str
    capacity_bytes: int
    puts: int
    refused: int
    usable_mean: float  # bytes of held blocks / capacity, averaged over samples after warm-up
    usable_min: float
    evictions: int
    seconds: float


def _size(rng: np.random.Generator, sizes: tuple[int, ...]) -> int:
    if not sizes:
        return int(rng.integers(4 * KIB, 8 * MIB + 1))
    return int(sizes[int(rng.integers(0, len(sizes)))])


def run_mix(mix: str, capacity_bytes: int, fill_factor: float, seed: int = 0) -> MixResult:
    """Write ``fill_factor`` x the capacity of ``mix``'s sizes into a fresh store; see the module docstring."""
    sizes = MIXES[mix]
    rng = np.random.default_rng(seed)
    store = DramStore.create(f"kvpool-frag-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity_bytes,
                             high_watermark=1.0, low_watermark=1.0)
    payload = np.frombuffer(os.urandom(9 * MIB), dtype=np.uint8)
    held: list[BlockKey] = []
    out = np.empty(9 * MIB, dtype=np.uint8)
    written = puts = refused = 0
    samples: list[float] = []
    start = time.perf_counter()
    try:
        while written < fill_factor * capacity_bytes:
            n = _size(rng, sizes)
            key = BlockKey(rng.bytes(32))
            ok = store.put([key], [payload[:n]])[0]
            puts += 1
            written += n
            if not ok:
                refused += 1
            else:
                held.append(key)
            if held and rng.random() < 0.5:  # a read refreshes a random block: eviction is not FIFO
                k = held[int(rng.integers(0, len(held)))]
                ref = store.locate([k])[0]
                if ref is not None:
                    store.get_into([k], [out[: ref.length]])
            if written > capacity_bytes:  # warmed up: the store is full and evicting
                samples.append(store.stats().used_bytes / capacity_bytes)
            if len(held) > 4 * store.arena.num_slots:
                held = [k for k, present in zip(held, store.contains(held)) if present]
        evictions = store.stats().evictions
    finally:
        store.close()
    return MixResult(mix, capacity_bytes, puts, refused, float(np.mean(samples)) if samples else 0.0,
                     float(np.min(samples)) if samples else 0.0, evictions, time.perf_counter() - start)


def render(results: Sequence[MixResult]) -> str:
    lines = ["| mix | block sizes | puts | refused | usable DRAM, mean | usable DRAM, min | evictions |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        sizes = ", ".join(_fmt(n) for n in MIXES[r.mix]) or "4 KiB .. 8 MiB, uniform"
        lines.append(f"| {r.mix} | {sizes} | {r.puts:,} | {r.refused} | {r.usable_mean:.1%} | {r.usable_min:.1%} "
                     f"| {r.evictions:,} |")
    return "\n".join(lines)


def _fmt(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / KIB:g} KiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=512, metavar="MIB", help="DRAM capacity in MiB (default 512)")
    parser.add_argument("--fill", type=float, default=4.0, metavar="X",
                        help="write this many times the capacity per mix (default 4)")
    parser.add_argument("--mix", action="append", choices=sorted(MIXES), help="only these mixes (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    if args.capacity < 16 or not 1.0 < args.fill <= 100:
        raise ValueError("need --capacity >= 16 (MiB) and 1 < --fill <= 100")
    results = [run_mix(m, args.capacity * MIB, args.fill, args.seed) for m in (args.mix or list(MIXES))]
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        print(render(results))
    return 0
