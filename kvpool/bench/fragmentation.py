"""The DRAM tier under mixed block sizes: ``kvpool bench fragmentation``.

Two scenarios, each on a fresh :class:`~kvpool.tiers.dram.DramStore`:

- *mixes*: blocks of several sizes (one per model sharing the pool, or one
  engine's per-layer pieces beside whole blocks) are written far past the
  capacity, with reads refreshing a random part of what it holds, so its
  LRU evicts all the time and freed extents are reused by blocks of other
  sizes. After a warm-up, it samples, after every put, the bytes of blocks
  held over the capacity (the *usable fraction*: what fragmentation and the
  64-byte rounding leave), and counts blocks refused for want of a long
  enough free extent. A single-size mix is the control: it must hold ~100%
  (an exact slot allocator).
- *hot-spread*: the arena is filled with small (4 KiB) blocks, every
  ``HOLE_EVERY``-th is removed (free space only in small holes), every
  block is read once in a random order (LRU order scattered across
  addresses), then a random *hot* set of them is read again; then large
  (1 MiB) blocks are put one at a time. Per put it reports the bytes
  evicted over the bytes put (a put of S bytes should evict about S) and
  how many hot blocks went.
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


@dataclass(frozen=True)
class HotSpreadResult:
    capacity_bytes: int
    small_bytes: int
    large_bytes: int
    free_bytes: int  # free before the large puts, all of it in holes of one small block
    blocks: int  # small blocks held before the large puts
    hot: int  # of them, read again after the first pass
    puts: int
    refused: int
    evicted_ratio: list[float]  # per put: bytes evicted / bytes put
    hot_evicted: list[int]  # per put: hot blocks evicted
    seconds: float  # the large puts, in all

    @property
    def ratio_mean(self) -> float:
        return float(np.mean(self.evicted_ratio)) if self.evicted_ratio else 0.0


HOLE_EVERY = 4  # hot-spread: every 4th small block is removed before the large puts


def run_hot_spread(capacity_bytes: int, hot: int = 4000, puts: int = 16, seed: int = 0,
                   small: int = 4 * KIB, large: int = MIB) -> HotSpreadResult:
    """The *hot-spread* scenario (module docstring) on a fresh store of ``capacity_bytes``."""
    rng = np.random.default_rng(seed)
    evicted: list[BlockKey] = []
    store = DramStore.create(f"kvpool-frag-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity_bytes,
                             high_watermark=1.0, low_watermark=1.0,
                             on_change=lambda added, removed: evicted.extend(removed))
    try:
        payload = np.frombuffer(os.urandom(large), dtype=np.uint8)
        keys = [BlockKey(rng.bytes(32)) for _ in range(capacity_bytes // small)]
        for i in range(0, len(keys), 512):
            store.put(keys[i : i + 512], [payload[:small]] * len(keys[i : i + 512]))
        store.remove(keys[::HOLE_EVERY])
        kept = [k for i, k in enumerate(keys) if i % HOLE_EVERY]
        for i in rng.permutation(len(kept)).tolist():  # one read each, in a random order: LRU spread everywhere
            store.locate([kept[i]], touch=True)
        hot_list = [kept[i] for i in rng.choice(len(kept), size=min(hot, len(kept)), replace=False).tolist()]
        for k in hot_list:  # in the seeded order (a set's order changes with each process's hash seed)
            store.locate([k], touch=True)
        hot_keys = set(hot_list)
        free_bytes = store.usage()[1]
        sizes = dict.fromkeys(kept, small)
        ratios: list[float] = []
        hot_evicted: list[int] = []
        refused = 0
        start = time.perf_counter()
        for _ in range(puts):
            key = BlockKey(rng.bytes(32))
            evicted.clear()
            ok = store.put([key], [payload])[0]
            refused += not ok
            sizes[key] = large
            ratios.append(sum(sizes[k] for k in evicted if k != key) / large)
            hot_evicted.append(sum(k in hot_keys for k in evicted))
        seconds = time.perf_counter() - start
    finally:
        store.close()
    return HotSpreadResult(capacity_bytes, small, large, free_bytes, len(kept), len(hot_keys), puts, refused, ratios,
                           hot_evicted, seconds)


def render_hot_spread(r: HotSpreadResult) -> str:
    return "\n".join([
        "| arena | small blocks held | free (in small holes) | hot | large puts | refused | evicted / put, mean "
        "| evicted / put, max | hot blocks evicted | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {_fmt(r.capacity_bytes)} | {r.blocks:,} x {_fmt(r.small_bytes)} | {_fmt(r.free_bytes)} | {r.hot:,} "
        f"| {r.puts} x {_fmt(r.large_bytes)} | {r.refused} | {r.ratio_mean:.2f} | {max(r.evicted_ratio):.2f} "
        f"| {sum(r.hot_evicted):,} | {r.seconds:.2f} |",
    ])


def render(results: Sequence[MixResult]) -> str:
    lines = ["| mix | block sizes | puts | refused | usable DRAM, mean | usable DRAM, min | evictions |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        sizes = ", ".join(_fmt(n) for n in MIXES[r.mix]) or "4 KiB .. 8 MiB, uniform"
        lines.append(f"| {r.mix} | {sizes} | {r.puts:,} | {r.refused} | {r.usable_mean:.1%} | {r.usable_min:.1%} "
                     f"| {r.evictions:,} |")
    return "\n".join(lines)


def _fmt(n: int) -> str:
    return f"{n / MIB:.4g} MiB" if n >= MIB else f"{n / KIB:.4g} KiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=512, metavar="MIB", help="DRAM capacity in MiB (default 512)")
    parser.add_argument("--fill", type=float, default=4.0, metavar="X",
                        help="write this many times the capacity per mix (default 4)")
    parser.add_argument("--mix", action="append", choices=sorted(MIXES), help="only these mixes (default: all)")
    parser.add_argument("--scenario", choices=("all", "mixes", "hot-spread"), default="all",
                        help="mixes: the usable fraction per mix; hot-spread: bytes evicted per large put with hot "
                             "small blocks spread across the arena (default: both)")
    parser.add_argument("--hot", type=int, default=4000, metavar="N",
                        help="hot-spread: small blocks read again after the first pass (default 4000)")
    parser.add_argument("--puts", type=int, default=16, metavar="N", help="hot-spread: 1 MiB puts (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the tables")


def run(args: argparse.Namespace) -> int:
    if args.capacity < 16 or not 1.0 < args.fill <= 100:
        raise ValueError("need --capacity >= 16 (MiB) and 1 < --fill <= 100")
    if not 0 <= args.hot <= 1 << 24 or not 1 <= args.puts <= 10_000:
        raise ValueError("need 0 <= --hot <= 2^24 and 1 <= --puts <= 10000")
    mixes = [run_mix(m, args.capacity * MIB, args.fill, args.seed) for m in (args.mix or list(MIXES))] \
        if args.scenario in ("all", "mixes") else []
    spread = run_hot_spread(args.capacity * MIB, args.hot, args.puts, args.seed) \
        if args.scenario in ("all", "hot-spread") else None
    if args.json:
        print(json.dumps({"mixes": [r.__dict__ for r in mixes],
                          "hot_spread": None if spread is None else spread.__dict__}, indent=2))
        return 0
    if mixes:
        print(render(mixes))
    if spread is not None:
        print(("\n" if mixes else "") + render_hot_spread(spread))
    return 0
