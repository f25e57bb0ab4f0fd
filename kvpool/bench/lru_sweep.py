"""``kvpool bench lru-sweep``: kvpool's HBM + DRAM hit rate beside an exact LRU of the same capacities, per DRAM size.

For each ``--dram-blocks`` capacity the trace is replayed HBM + DRAM only, as
``kvpool bench replay --compare``'s DRAM row is: the client's HBM tier of
``--hbm`` blocks (the same at every capacity) in front of an embedded pool
whose node has that many DRAM slots of ``--block-bytes``, SSD off, writes
flushed after every request (deterministic hits). Beside it,
:func:`~kvpool.bench.trace.lru_reference` on the same keys and capacities. The
gap is kvpool's overall hit rate minus the LRU's, in points (issue 14's aim:
within 1 point, either way, from 1k to 50k blocks).

Hit rates do not depend on the payload size, so ``--block-bytes`` defaults to
4 KiB (50k blocks are a 200 MiB arena); every byte read back is still checked.
A sweep replays the trace once per capacity: Mooncake's synthetic trace (3,993
requests) takes about 40 s a capacity on a 2-core machine; ``--limit`` bounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.bench import replay as rp
from kvpool.bench.trace import MODEL, KeyMaker, LruReference, load_trace, lru_reference, unbounded_bound
from kvpool.keys import BlockKey, KeyNamespace

DEFAULT_DRAM_BLOCKS = "1k,4k,20k,50k"
DEFAULT_BLOCK_BYTES = 4 << 10

_COUNT_RE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_block_counts(text: str) -> list[int]:
    """``"1k,4k,20000"`` -> [1000, 4000, 20000]: comma-separated positive block counts, k = 1000, m = 1,000,000."""
    counts: list[int] = []
    for item in str(text).split(","):
        m = _COUNT_RE.match(item)
        if m is None or int(m[1]) == 0:
            raise argparse.ArgumentTypeError(
                f"not a positive block count: {item.strip()!r} in {text!r} (e.g. 1k,4k,20k,50k or 1000,4000)")
        counts.append(int(m[1]) * {"": 1, "k": 1000, "m": 1_000_000}[m[2].lower()])
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"a capacity appears twice in {text!r}")
    return counts


@dataclass(frozen=True)
class SweepRow:
    """One capacity: kvpool's replay and the exact LRU's hits on the same keys."""

    run: rp.RunResult
    lru: LruReference

    @property
    def dram_blocks(self) -> int:
        return self.run.config.dram_blocks

    @property
    def gap_points(self) -> float:
        """kvpool's overall hit rate minus the LRU's, in points (negative: kvpool hits less)."""
        return (self.run.ratio(self.run.hit_blocks) - self.lru.ratio(self.lru.hit_blocks)) * 100

    @property
    def dram_gap_points(self) -> float:
        return (self.run.ratio(self.run.hits["dram"]) - self.lru.ratio(self.lru.dram_hits)) * 100

    def to_json(self) -> dict[str, Any]:
        r, lru = self.run, self.lru
        return {
            "dram_blocks": self.dram_blocks,
            "kvpool": {"hbm": r.ratio(r.hits["hbm"]), "dram": r.ratio(r.hits["dram"]),
                       "overall": r.ratio(r.hit_blocks), "hbm_hits": r.hits["hbm"], "dram_hits": r.hits["dram"]},
            "exact_lru": {"hbm": lru.ratio(lru.hbm_hits), "dram": lru.ratio(lru.dram_hits),
                          "overall": lru.ratio(lru.hit_blocks), "hbm_hits": lru.hbm_hits, "dram_hits": lru.dram_hits},
            "gap_points": self.gap_points,
            "dram_gap_points": self.dram_gap_points,
            "lost_after_lookup": r.lost,
            "put_refused": r.put_refused,
            "wrong_blocks": r.wrong_blocks,
            "errors": dict(r.errors),
            "seconds": r.seconds,
        }


def sweep(request_keys: Sequence[Sequence[BlockKey]], dram_blocks: Sequence[int], *, hbm_blocks: int,
          block_bytes: int, ssd_parent: str | None = None, progress: bool = True) -> list[SweepRow]:
    """One :class:`SweepRow` per DRAM capacity (blocks), HBM + DRAM only, in the order given."""
    rows = []
    for blocks in dram_blocks:
        if blocks < 1:
            raise ValueError(f"DRAM capacity must be >= 1 block, got {blocks}")
        config = rp.TierConfig(f"HBM + DRAM {blocks}", hbm_blocks, blocks * block_bytes, 0, block_bytes)
        run = rp.replay(request_keys, config, ssd_parent=ssd_parent, flush_every=1, progress=progress)
        rows.append(SweepRow(run, lru_reference(request_keys, hbm_blocks, blocks)))
    return rows


def render(rows: Sequence[SweepRow], *, trace: str, requests: int, lookups: int, bound: float, hbm_blocks: int,
           block_bytes: int) -> str:
    """The markdown report: a header line and one row per DRAM capacity."""
    lines = [
        f"Trace `{os.path.basename(trace)}`: {requests} requests, {lookups} block lookups, unbounded-cache bound "
        f"{bound:.1%}. HBM {hbm_blocks} blocks + DRAM (rows), SSD off, {block_bytes} B blocks, flushed every request. "
        "Hit rates as a share of all block lookups; gap = kvpool - exact LRU, overall, in points.",
        "",
        "| DRAM blocks | kvpool HBM | kvpool DRAM | kvpool overall | LRU HBM | LRU DRAM | LRU overall "
        "| gap (points) | DRAM gap | within 1 point | lost | errors | time s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        r, lru = row.run, row.lru
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "0"
        lines.append(
            f"| {row.dram_blocks:,} | {r.ratio(r.hits['hbm']):.1%} | {r.ratio(r.hits['dram']):.1%} "
            f"| {r.ratio(r.hit_blocks):.1%} | {lru.ratio(lru.hbm_hits):.1%} | {lru.ratio(lru.dram_hits):.1%} "
            f"| {lru.ratio(lru.hit_blocks):.1%} | {row.gap_points:+.2f} | {row.dram_gap_points:+.2f} "
            f"| {'yes' if abs(row.gap_points) <= 1 else 'no'} | {r.lost} | {errors} | {r.seconds:.1f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE", help="your Mooncake-format JSONL trace, as "
                        "replay's --trace")
    parser.add_argument("--dram-blocks", type=parse_block_counts, default=parse_block_counts(DEFAULT_DRAM_BLOCKS),
                        metavar="N,N,...", help="DRAM capacities in blocks, k = 1000 (default: "
                        f"{DEFAULT_DRAM_BLOCKS})")
    parser.add_argument("--hbm", type=rp.parse_capacity, default=rp.parse_capacity(rp.DEFAULT_HBM), metavar="CAP",
                        help=f"the client's HBM tier at every capacity, as replay's --hbm (default: {rp.DEFAULT_HBM})")
    parser.add_argument("--block-bytes", type=rp.parse_bytes, default=DEFAULT_BLOCK_BYTES, metavar="SIZE",
                        help="payload of one block, a multiple of 1 KiB (default: 4K; hit rates do not depend on it)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    parser.add_argument("--max-gap", type=float, default=None, metavar="POINTS",
                        help="exit 1 if any capacity's |gap| is over this many points")
    parser.add_argument("--ssd-dir", default=None, help="where the embedded node's temporary directory goes")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    bb = args.block_bytes
    layout = rp.block_layout(bb)
    hbm = args.hbm.to_blocks(bb)
    if not args.hbm.is_zero and hbm == 0:
        raise ValueError(f"--hbm {args.hbm.text} holds no {bb} B block (use 0 for no HBM tier)")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    requests = load_trace(args.trace, args.limit)
    maker = KeyMaker(KeyNamespace(MODEL, layout.fingerprint()))
    request_keys = [maker.keys(r.hash_ids) for r in requests]
    bound = unbounded_bound(request_keys)
    t0 = time.perf_counter()
    rows = sweep(request_keys, args.dram_blocks, hbm_blocks=hbm, block_bytes=bb, ssd_parent=args.ssd_dir,
                 progress=not args.no_progress)
    table = render(rows, trace=args.trace, requests=len(requests), lookups=bound.lookups, bound=bound.leading,
                   hbm_blocks=hbm, block_bytes=bb)
    worst = max(abs(row.gap_points) for row in rows)
    if args.json:
        print(json.dumps({
            "trace": args.trace, "requests": len(requests), "block_lookups": bound.lookups, "block_bytes": bb,
            "hbm_blocks": hbm, "unbounded_bound": bound.leading, "rows": [row.to_json() for row in rows],
            "max_abs_gap_points": worst, "seconds": time.perf_counter() - t0,
        }, indent=2))
    else:
        print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    wrong = sum(row.run.wrong_blocks for row in rows)
    if wrong:
        print(f"kvpool bench lru-sweep: {wrong} blocks came back with wrong bytes", file=sys.stderr)
        return 1
    if args.max_gap is not None and worst > args.max_gap:
        print(f"kvpool bench lru-sweep: a gap of {worst:.2f} points is over --max-gap {args.max_gap}", file=sys.stderr)
        return 1
    return 0
