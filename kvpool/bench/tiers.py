"""``kvpool bench tiers``: DRAM and SSD tier put/get GB/s next to this machine's memcpy.

Every figure is the best of ``--rounds`` passes over a working set of
``--total-mib`` per block size, copying between the same kind of buffers the
tier uses (a pool of blocks in, a pool of caller buffers out), so the memcpy
column is the ceiling for exactly this access pattern.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.buffers import aligned_empty
from kvpool.keys import BlockKey
from kvpool.tiers.dram import DramStore
from kvpool.tiers.ssd import SsdStore

AIM_DRAM_GET = 0.6
AIM_SSD_GET = 0.3


@dataclass(frozen=True)
class Row:
    size: int
    memcpy: float
    dram_put: float
    dram_get: float
    ssd_put: float
    ssd_get: float


def _best_gbps(nbytes: int, rounds: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _batches(n: int, batch: int) -> list[slice]:
    return [slice(i, min(n, i + batch)) for i in range(0, n, batch)]


def bench_size(size: int, total: int, rounds: int, batch: int, ssd_dir: str) -> Row:
    """Measure one block size; all stores are created and removed here."""
    n = max(2, total // size)
    rng = np.random.default_rng(size)
    # Page-aligned like an engine's tensors: copies between buffers that disagree in their
    # alignment mod 64 run several times slower here, which would measure the wrong thing.
    src = aligned_empty(n * size).reshape(n, size)
    src[:] = rng.integers(0, 256, (n, size), dtype=np.uint8)
    dst = aligned_empty(n * size).reshape(n, size)
    keys = [BlockKey(os.urandom(32)) for _ in range(n)]
    nbytes = n * size
    slices = _batches(n, batch)

    def memcpy() -> None:
        for i in range(n):
            np.copyto(dst[i], src[i])

    memcpy_gbps = _best_gbps(nbytes, rounds, memcpy)

    def put_get(store: DramStore | SsdStore, name: str) -> tuple[float, float]:
        """(put, get) GB/s of one tier store over the working set, bytes checked."""

        def put() -> None:
            store.remove(keys)
            for s in slices:
                store.put(keys[s], list(src[s]))

        def get() -> None:
            for s in slices:
                if not all(store.get_into(keys[s], list(dst[s]))):
                    raise AssertionError(f"bench: {name} lost a block it was sized for")

        result = _best_gbps(nbytes, rounds, put), _best_gbps(nbytes, rounds, get)
        if not np.array_equal(dst, src):
            raise AssertionError(f"bench: {name} returned different bytes")
        return result

    dram = DramStore.create(f"kvpool-bench-{uuid.uuid4().hex[:8]}", n * size, size,
                            high_watermark=1.0, low_watermark=1.0)
    try:
        dram_put_gbps, dram_get_gbps = put_get(dram, "DRAM")
    finally:
        dram.close()
    dst[:] = 0
    with tempfile.TemporaryDirectory(dir=ssd_dir) as path:
        ssd = SsdStore(path, capacity_bytes=2 * nbytes + (64 << 20))
        try:
            ssd_put_gbps, ssd_get_gbps = put_get(ssd, "SSD")
        finally:
            ssd.close()
    return Row(size, memcpy_gbps, dram_put_gbps, dram_get_gbps, ssd_put_gbps, ssd_get_gbps)


def _fmt_size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def render(rows: list[Row]) -> str:
    """A markdown table with ratios to memcpy and whether each aim (blocks >= 1 MiB) is met."""
    lines = [
        "| block | memcpy GB/s | DRAM put | DRAM get | SSD put | SSD get (warm) "
        "| DRAM get / memcpy | SSD get / memcpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dram_ratio, ssd_ratio = r.dram_get / r.memcpy, r.ssd_get / r.memcpy
        aim = r.size >= 1 << 20
        dram_mark = (" ok" if dram_ratio >= AIM_DRAM_GET else " MISSED") if aim else ""
        ssd_mark = (" ok" if ssd_ratio >= AIM_SSD_GET else " MISSED") if aim else ""
        lines.append(
            f"| {_fmt_size(r.size)} | {r.memcpy:.2f} | {r.dram_put:.2f} | {r.dram_get:.2f} | {r.ssd_put:.2f} "
            f"| {r.ssd_get:.2f} | {dram_ratio:.2f}{dram_mark} | {ssd_ratio:.2f}{ssd_mark} |"
        )
    lines.append(
        f"\nAims for blocks of 1 MiB and up: DRAM get >= {AIM_DRAM_GET} x memcpy, SSD get >= {AIM_SSD_GET} x memcpy."
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="256K,1M,8M", help="block sizes, e.g. 256K,1M,8M (default: %(default)s)")
    parser.add_argument("--total-mib", type=int, default=512,
                        help="working set per size in MiB (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes per figure; the best is kept (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per put/get call (default: %(default)s)")
    parser.add_argument("--ssd-dir", default=tempfile.gettempdir(),
                        help="where the LMDB file goes (default: %(default)s)")
    parser.add_argument("--out", help="also write the markdown table to this file")


def parse_size(text: str) -> int:
    """'256K' -> 262144, '1M' -> 1048576, '4096' -> 4096."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(number) * scale


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        rows.append(bench_size(size, args.total_mib << 20, args.rounds, args.batch, args.ssd_dir))
        print(f"  measured {_fmt_size(size)}", flush=True)
    table = render(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0
