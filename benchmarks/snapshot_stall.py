"""How long a warm standby's snapshot holds up the leader's lookups: the longest lookup during a copy of the index.

    python benchmarks/snapshot_stall.py [--blocks 10000000] [--lookups-keys 64]

Builds a ``BlockIndex`` of ``--blocks`` blocks on one node (as a leader's), then, while one thread takes
``BlockIndex.locations()`` (what ``ChangeLog.snapshot`` copies for a standby), another loops 64-key lookups
(``leading_run_arrays``) and records each one's wall time. Twice: the copy in steps of ``COPY_ROWS`` slots
(lookups go on between steps) and the copy in one step (the whole table under the lock, as before). Prints
the copy's time and the longest and median lookup during it, and the median lookup with no copy running.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from kvpool.keys import BlockKey
from kvpool.master import index as index_module
from kvpool.master.index import BlockIndex
from kvpool.vocabulary import Tier

REPORT = 1 << 17  # keys per add (a node's report)


def build(blocks: int) -> tuple[BlockIndex, bytes]:
    index = BlockIndex(min_capacity=blocks)
    index.open_node(0)
    rng = np.random.default_rng(0)
    first = b""
    for start in range(0, blocks, REPORT):
        n = min(REPORT, blocks - start)
        raw = rng.bytes(32 * n)
        keys = [BlockKey(raw[i : i + 32]) for i in range(0, len(raw), 32)]
        index.add(0, Tier.DRAM, keys, [4096] * n, [1] * n)
        first = first or raw
    return index, first


def lookups_during(index: BlockIndex, packed: bytes, copy: bool) -> tuple[float, list[float]]:
    """(the copy's seconds, each lookup's seconds while it ran); without ``copy``: 1 s of lookups alone."""
    done = threading.Event()
    took = [0.0]

    def copier() -> None:
        t0 = time.perf_counter()
        index.locations()
        took[0] = time.perf_counter() - t0
        done.set()

    times: list[float] = []
    if copy:
        threading.Thread(target=copier).start()
    else:
        threading.Timer(1.0, done.set).start()
    while not done.is_set():
        t0 = time.perf_counter()
        index.leading_run_arrays(packed)
        times.append(time.perf_counter() - t0)
    return took[0], times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10_000_000)
    parser.add_argument("--lookup-keys", type=int, default=64)
    args = parser.parse_args()
    t0 = time.perf_counter()
    index, first = build(args.blocks)
    packed = first[: 32 * args.lookup_keys]
    print(f"{args.blocks:,} blocks indexed in {time.perf_counter() - t0:.1f} s; {args.lookup_keys}-key lookups")
    _, alone = lookups_during(index, packed, copy=False)
    print("| copy | copy s | lookups during it | longest lookup ms | median lookup us |\n|---|---|---|---|---|")
    print(f"| none | - | {len(alone):,} | {max(alone) * 1e3:.2f} | {statistics.median(alone) * 1e6:.0f} |")
    steps = index_module.COPY_ROWS
    for name, rows in ((f"in steps of {steps:,} slots", steps), ("in one step", 1 << 62)):
        index_module.COPY_ROWS = rows
        took, times = lookups_during(index, packed, copy=True)
        print(f"| {name} | {took:.2f} | {len(times):,} | {max(times) * 1e3:.2f} | "
              f"{statistics.median(times) * 1e6:.0f} |")
    index_module.COPY_ROWS = steps
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
