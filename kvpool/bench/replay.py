"""``kvpool bench replay``: replay a Mooncake-format request trace against a live pool, measure hit ratios.

The trace (one JSON object a line: ``timestamp``, ``input_length``,
``output_length``, ``hash_ids``) gives each request's prompt as prefix-chained
hash ids, one per 512-token block. Each hash id becomes a deterministic block
of 512 token ids (:func:`block_tokens`), and kvpool's own hashing
(:func:`kvpool.keys.chain_block_keys`, block size 512, one fixed
:class:`~kvpool.keys.KeyNamespace`) chains them, so identical prefixes give
identical keys, as they would for real prompts.

Per request, in trace order (timestamps only order the requests; the replay
runs as fast as it can):

1. ``lookup`` the request's keys (the client's HBM tier first, then the pool);
2. ``get`` the leading hit run into preallocated buffers and check every byte
   against the block's deterministic payload (:func:`payloads`): wrong bytes
   are counted and must be 0;
3. ``put`` the blocks after the loaded run (HBM now, the pool write-behind);
4. ``flush`` every ``--flush-every`` requests (default 1: before the next
   request, as if requests were far enough apart for write-behind to finish;
   the hit ratios are then deterministic).

A hit is a block that was actually *loaded*, attributed to the tier the lookup
found it in; lookups that promised more than ``get`` delivered are reported as
``lost``. The unbounded bound is the hit ratio of a cache that never evicts,
in prefix semantics (leading run per request); the per-block ratio is reported
too (equal when the trace's hash ids are prefix-consistent, as Mooncake's are).

By default the command starts its own pool in this process (a
:class:`~kvpool.master.server.MasterServer` and one
:class:`~kvpool.node.daemon.PoolNode` on 127.0.0.1, metrics off, a temporary
SSD directory and a unique arena), sized by ``--dram`` and ``--ssd``;
``--dram 0`` means no pool at all (the client's HBM tier only, an
:class:`~kvpool.client.hbm.HbmStore` used directly: there is no master to ask).
``--master HOST:PORT`` uses a running pool instead. ``--compare`` runs HBM only,
HBM + DRAM and HBM + DRAM + SSD with the same capacities and prints one table.

Throughput counts the replay loop only (not trace loading, key hashing or pool
start-up): requests and looked-up blocks per second, and GB/s of block bytes
moved (hits read from any tier plus misses written).

Capacities are ``<n>b`` / ``<n>blocks`` (block counts) or byte sizes
(``64K``, ``512M``, ``2G``, ``4096bytes``); ``0`` turns a tier off. A block
count of DRAM is that many arena slots (the node keeps them 85-95% full: its
watermarks); a block count of SSD is the bytes that many LMDB entries of
``--block-bytes`` take (:meth:`~kvpool.tiers.ssd.SsdStore.entry_cost`).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvpool.bench.progress import Progress
from kvpool.bench.trace import (
    BLOCK_TOKENS,
    MODEL,
    Bound,
    KeyMaker,
    LruReference,
    Payloads,
    load_trace,
    lru_reference,
    unbounded_bound,
)
from kvpool.keys import BlockKey, KeyNamespace, leading_hits
from kvpool.layout import KVLayout
from kvpool.metrics import error_counts
from kvpool.vocabulary import Tier

DEFAULT_BLOCK_BYTES = 16 << 10
DEFAULT_HBM = "1000b"
DEFAULT_DRAM = "4000b"
DEFAULT_SSD = "40000b"

# -- sizes -------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")
_BLOCK_UNITS = {"b", "blk", "blks", "block", "blocks"}
_BYTE_UNITS = {
    "bytes": 1, "byte": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}


@dataclass(frozen=True)
class Capacity:
    """A tier size as the user wrote it: a block count or a byte count (exactly one is set)."""

    text: str
    blocks: int | None = None
    nbytes: int | None = None

    @property
    def is_zero(self) -> bool:
        return (self.blocks if self.blocks is not None else self.nbytes) == 0

    def to_blocks(self, block_cost: int) -> int:
        """Whole blocks that fit, each costing ``block_cost`` bytes of this tier."""
        return self.blocks if self.blocks is not None else (self.nbytes or 0) // block_cost

    def to_bytes(self, block_cost: int) -> int:
        return self.nbytes if self.nbytes is not None else (self.blocks or 0) * block_cost


def parse_capacity(text: str) -> Capacity:
    """``"4000b"``, ``"4000blocks"`` -> 4000 blocks; ``"2G"``, ``"64KiB"``, ``"4096bytes"`` -> bytes; ``"0"`` -> off.

    A bare non-zero number is refused: it could mean either.
    """
    if not isinstance(text, str):
        raise argparse.ArgumentTypeError(f"not a capacity: {text!r}")
    m = _SIZE_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"not a capacity: {text!r} (use a block count like 4000b / 4000blocks, a byte size like 2G / 512M, or 0)"
        )
    number, unit = float(m["num"]), m["unit"].lower()
    if unit == "":
        if number == 0:
            return Capacity(text, blocks=0)
        raise argparse.ArgumentTypeError(
            f"ambiguous capacity {text!r}: write {m['num']}b for blocks or {m['num']}bytes / a K, M, G size for bytes"
        )
    if unit in _BLOCK_UNITS:
        if not number.is_integer():
            raise argparse.ArgumentTypeError(f"a block count must be a whole number, got {text!r}")
        return Capacity(text, blocks=int(number))
    scale = _BYTE_UNITS.get(unit)
    if scale is None:
        raise argparse.ArgumentTypeError(
            f"unknown unit {m['unit']!r} in {text!r} (blocks: b, blocks; bytes: bytes, K, M, G, T)"
        )
    return Capacity(text, nbytes=int(number * scale))


def parse_bytes(text: str) -> int:
    """A positive byte size: ``16K``, ``16384``, ``16KiB``, ``1M``."""
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    unit = m["unit"].lower() if m else None
    scale = 1 if unit == "" else _BYTE_UNITS.get(unit or "?")
    if m is None or scale is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 16K, 64K, 16384)")
    value = float(m["num"]) * scale
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number of bytes: {text!r}")
    return int(value)


def block_layout(block_bytes: int) -> KVLayout:
    """A layout of 512-token blocks that is exactly ``block_bytes`` long (uint8, one layer, one head)."""
    unit = 2 * BLOCK_TOKENS  # K and V of 512 tokens, one byte each
    if block_bytes < unit or block_bytes % unit:
        raise ValueError(f"--block-bytes must be a positive multiple of {unit} (K+V of {BLOCK_TOKENS} uint8 tokens), "
                         f"got {block_bytes}")
    layout = KVLayout("uint8", num_layers=1, num_kv_heads=1, head_dim=block_bytes // unit, block_size=BLOCK_TOKENS)
    assert layout.block_bytes == block_bytes, "replay: layout does not give the block size asked for"
    return layout


def ssd_entry_bytes(block_bytes: int, page_size: int = mmap.PAGESIZE) -> int:
    """What one block costs the SSD tier (mirrors :meth:`kvpool.tiers.ssd.SsdStore.entry_cost`)."""
    from kvpool.tiers.ssd import HEADER_BYTES

    return (-(-(HEADER_BYTES + block_bytes) // page_size) + 1) * page_size


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value.is_integer() or value >= 100 else f"{value:.1f} {unit}"
    return f"{int(n)} B"


# -- the tiers under test ------------------------------------------------------------------------


@dataclass(frozen=True)
class TierConfig:
    """One replay configuration: HBM blocks in the client, DRAM and SSD bytes of the pool's node."""

    label: str
    hbm_blocks: int
    dram_bytes: int  # 0: no pool at all
    ssd_bytes: int  # 0: SSD off
    block_bytes: int

    @property
    def pooled(self) -> bool:
        return self.dram_bytes > 0

    @property
    def dram_blocks(self) -> int:
        return self.dram_bytes // self.block_bytes

    @property
    def ssd_blocks(self) -> int:
        return self.ssd_bytes // ssd_entry_bytes(self.block_bytes) if self.ssd_bytes else 0


class HbmOnly:
    """No pool: the client's HBM tier (:class:`~kvpool.client.hbm.HbmStore`) used directly.

    The same lookup / get / put shape as :class:`~kvpool.client.kvclient.KVCacheClient`.
    """

    def __init__(self, layout: KVLayout, hbm_blocks: int):
        from prometheus_client import CollectorRegistry

        from kvpool.client.hbm import HbmStore

        self.layout = layout
        self.hbm = HbmStore(layout, hbm_blocks, "cpu") if hbm_blocks > 0 else None
        self.registry = CollectorRegistry()  # nothing counts errors here: there is no pool

    def lookup(self, keys: Sequence[BlockKey]) -> Any:
        from kvpool.client.lookup import LookupResult

        hbm = leading_hits(self.hbm.contains(keys)) if self.hbm is not None else 0
        return LookupResult(len(keys), hbm)

    def get(self, keys: Sequence[BlockKey], outs: Sequence[Any], result: Any) -> int:
        if self.hbm is None or not result.hbm_blocks:
            return 0
        import torch

        n = result.hbm_blocks
        return leading_hits(self.hbm.get_into(keys[:n], [torch.from_numpy(o) for o in outs[:n]]))

    def put(self, keys: Sequence[BlockKey], values: Sequence[np.ndarray]) -> list[bool]:
        if self.hbm is None:
            return [False] * len(keys)
        import torch

        return self.hbm.put(keys, [torch.from_numpy(v) for v in values])

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        if self.hbm is not None:
            self.hbm.close()


class EmbeddedPool:
    """A master and one node in this process on 127.0.0.1 (ephemeral ports, metrics off); ``close`` removes all."""

    def __init__(self, config: TierConfig, ssd_parent: str | None = None, register_timeout_s: float = 20.0):
        from kvpool.config import MasterConfig, NodeConfig
        from kvpool.master.server import MasterServer
        from kvpool.node.daemon import PoolNode

        self.node = None
        self.master = MasterServer(MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0)).start()
        try:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-replay-", dir=ssd_parent)
            node_config = NodeConfig.of(
                master=self.master.address, host="127.0.0.1", port=0, metrics_port=0,
                arena=f"kvpool-replay-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                dram_bytes=config.dram_bytes,
                ssd_dir=os.path.join(self._tmp.name, "ssd"), ssd_bytes=config.ssd_bytes or 0,
                ssd_enabled=config.ssd_bytes > 0,
            )
            self.node = PoolNode(node_config).start()
            deadline = time.monotonic() + register_timeout_s
            while not self.node.link.registered:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replay: the embedded node did not register within {register_timeout_s}s")
                time.sleep(0.01)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.master.address

    def close(self) -> None:
        if self.node is not None:
            self.node.stop()
            self.node = None
        self.master.stop()
        if hasattr(self, "_tmp"):
            self._tmp.cleanup()


def cluster_nodes(master: str, timeout: float = 5.0, *, token: str = "", tls_ca: str = "") -> list[tuple[str, int]]:
    """(node id, incarnation) of each live node the master knows; ValueError if it cannot be asked.

    ``token`` / ``tls_ca``: the client config's, for a master with an auth file or TLS.
    """
    from kvpool.status import cluster_status

    reply = cluster_status(master, token=token, tls_ca=tls_ca, timeout=timeout)
    return [(n.node.node_id, n.incarnation) for n in reply.nodes]


# -- the replay --------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one configuration's replay measured."""

    config: TierConfig
    pool: str  # "none", "embedded" or the external master's address
    requests: int = 0
    lookups: int = 0  # blocks looked up
    hits: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "dram": 0, "ssd": 0})
    lost: int = 0  # blocks the lookup promised that get did not deliver
    put_blocks: int = 0
    put_refused: int = 0  # blocks the client did not accept (pool queue full); HBM refusals not counted
    wrong_blocks: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    node_reregistered: bool = False

    @property
    def hit_blocks(self) -> int:
        return sum(self.hits.values())

    def ratio(self, n: int) -> float:
        return n / self.lookups if self.lookups else 0.0

    @property
    def bytes_moved(self) -> int:
        return (self.hit_blocks + self.put_blocks) * self.config.block_bytes

    def to_json(self, bound: Bound) -> dict[str, Any]:
        secs = self.seconds or float("nan")
        return {
            "config": self.config.label,
            "pool": self.pool,
            "hbm_blocks": self.config.hbm_blocks,
            "dram_bytes": self.config.dram_bytes,
            "dram_blocks": self.config.dram_blocks,
            "ssd_bytes": self.config.ssd_bytes,
            "ssd_blocks": self.config.ssd_blocks,
            "requests": self.requests,
            "block_lookups": self.lookups,
            "hit_blocks": dict(self.hits),
            "hit_ratio": {tier: self.ratio(n) for tier, n in self.hits.items()},
            "overall_hit_ratio": self.ratio(self.hit_blocks),
            "hit_ratio_vs_bound": self.ratio(self.hit_blocks) / bound.leading if bound.leading else None,
            "lost_after_lookup": self.lost,
            "put_blocks": self.put_blocks,
            "put_refused": self.put_refused,
            "wrong_blocks": self.wrong_blocks,
            "errors": dict(self.errors),
            "node_reregistered": self.node_reregistered,
            "seconds": self.seconds,
            "requests_per_s": self.requests / secs,
            "blocks_per_s": self.lookups / secs,
            "gb_per_s": self.bytes_moved / secs / 1e9,
        }


def replay(
    request_keys: Sequence[Sequence[BlockKey]],
    config: TierConfig,
    *,
    master: str | None = None,
    ssd_parent: str | None = None,
    flush_every: int = 1,
    tenant: str = "",
    progress: bool = True,
    progress_stream: TextIO | None = None,
) -> RunResult:
    """Replay the requests' keys against ``config`` (an embedded pool, or ``master``'s); see the module docstring."""
    if flush_every < 1:
        raise ValueError(f"flush_every must be >= 1, got {flush_every}")
    layout = block_layout(config.block_bytes)
    payloads = Payloads(config.block_bytes)
    max_blocks = max((len(k) for k in request_keys), default=0)
    pool: EmbeddedPool | None = None
    if master is None and config.pooled:
        pool = EmbeddedPool(config, ssd_parent)
        master = pool.address
    result = RunResult(config, "none" if master is None else ("embedded" if pool is not None else master))
    try:
        nodes_before = cluster_nodes(master) if master is not None else []
        if master is not None and not nodes_before:
            raise ValueError(f"the pool at {master} has no live node")
        if master is None:
            client: Any = HbmOnly(layout, config.hbm_blocks)
        else:
            from kvpool.client.kvclient import KVCacheClient
            from kvpool.config import ClientConfig

            # The write-behind queue must hold what one flush interval puts, or long prompts lose blocks.
            queue = max(1 << 30, max_blocks * flush_every * layout.block_bytes)
            client = KVCacheClient(ClientConfig(
                master=master, worker_id=f"replay-{os.getpid()}-{uuid.uuid4().hex[:6]}", model=MODEL,
                tenant=tenant, layout=layout, hbm_blocks=config.hbm_blocks, device="cpu",
                put_queue_bytes=queue, metrics_port=0,
            ))
        try:
            result = _replay_loop(client, request_keys, payloads, max_blocks, flush_every, result,
                                  Progress(len(request_keys), f"replay {config.label}", progress_stream, progress))
            result.errors = error_counts(client.registry)
        finally:
            client.close()
        if master is not None:
            after = dict(cluster_nodes(master))
            result.node_reregistered = any(after.get(node) != inc for node, inc in nodes_before)
    finally:
        if pool is not None:
            pool.close()
    return result


def _replay_loop(client: Any, request_keys: Sequence[Sequence[BlockKey]], payloads: Payloads, max_blocks: int,
                 flush_every: int, result: RunResult, bar: Progress) -> RunResult:
    from kvpool.buffers import aligned_empty

    bb = payloads.block_bytes
    # Page-aligned like an engine's KV tensors; one row per block of the longest request.
    buf = aligned_empty(max(max_blocks, 1) * bb).reshape(-1, bb)
    rows = list(buf)
    staging = aligned_empty(max(max_blocks, 1) * bb).reshape(-1, bb)
    start = time.perf_counter()
    for n, keys in enumerate(request_keys, 1):
        keys = list(keys)
        res = client.lookup(keys)
        hit = res.hit_blocks
        loaded = client.get(keys[:hit], rows[:hit], res) if hit else 0
        result.lost += hit - loaded
        result.wrong_blocks += payloads.wrong(keys[:loaded], buf)
        in_hbm = min(loaded, res.hbm_blocks)
        result.hits["hbm"] += in_hbm
        for loc in res.pool[: loaded - in_hbm]:
            result.hits["dram" if loc.tier == Tier.DRAM else "ssd"] += 1
        rest = keys[loaded:]
        if rest:
            values = payloads.make(rest, out=staging[: len(rest)])
            accepted = client.put(rest, list(values))
            result.put_blocks += len(rest)
            if not isinstance(client, HbmOnly):
                result.put_refused += accepted.count(False)
        if n % flush_every == 0:
            client.flush()
        result.requests = n
        result.lookups += len(keys)
        bar.update(n, f"hit {result.ratio(result.hit_blocks):.1%}")
    client.flush()
    result.seconds = time.perf_counter() - start
    bar.close(result.requests, f"hit {result.ratio(result.hit_blocks):.1%}")
    return result


# -- report ------------------------------------------------------------------------------------


def _capacity_text(blocks: int, nbytes: int) -> str:
    return "off" if nbytes == 0 and blocks == 0 else f"{blocks} ({_fmt_bytes(nbytes)})"


def render(results: Sequence[RunResult], bound: Bound, key_bound: Bound, *, trace: str, flush_every: int) -> str:
    """The markdown report: a short header and one table row per configuration."""
    bb = results[0].config.block_bytes if results else 0
    same = (bound.leading_hits, bound.block_hits) == (key_bound.leading_hits, key_bound.block_hits)
    lines = [
        f"Trace `{os.path.basename(trace)}`: {results[0].requests if results else 0} requests, "
        f"{bound.lookups} block lookups of {BLOCK_TOKENS} tokens, {_fmt_bytes(bb)} a block. "
        f"Unbounded-cache bound: {bound.leading:.1%} (leading run), {bound.per_block:.1%} (any block)"
        + ("." if same else f"; with kvpool's chained keys {key_bound.leading:.1%} / {key_bound.per_block:.1%} "
                            "(the trace's hash ids are not prefix-consistent)."),
        f"Pool writes flushed every {flush_every} request(s). Capacities in blocks; a hit is a block loaded "
        "and verified, by the tier that served it, as a share of all block lookups.",
        "",
        "| configuration | HBM | DRAM | SSD | HBM hits | DRAM hits | SSD hits | overall hit | hit / bound "
        "| req/s | blocks/s | GB/s | time s | errors | wrong blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.config
        errors = sum(r.errors.values()) + r.lost
        err_note = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items()))
        if r.lost:
            err_note = (err_note + ", " if err_note else "") + f"lost {r.lost}"
        if r.node_reregistered:
            err_note = (err_note + ", " if err_note else "") + "node re-registered"
        secs = r.seconds or float("nan")
        hits = [f"{r.hits[t]} ({r.ratio(r.hits[t]):.1%})" for t in ("hbm", "dram", "ssd")]
        overall = r.ratio(r.hit_blocks)
        lines.append(
            f"| {c.label} | {_capacity_text(c.hbm_blocks, c.hbm_blocks * bb)} "
            f"| {_capacity_text(c.dram_blocks, c.dram_bytes)} | {_capacity_text(c.ssd_blocks, c.ssd_bytes)} "
            f"| {hits[0]} | {hits[1]} | {hits[2]} | {overall:.1%} "
            f"| {f'{overall / bound.leading:.2f}' if bound.leading else 'n/a'} "
            f"| {r.requests / secs:.0f} | {r.lookups / secs:.0f} | {r.bytes_moved / secs / 1e9:.2f} | {r.seconds:.1f} "
            f"| {errors}{f' ({err_note})' if err_note else ''} | {r.wrong_blocks} |"
        )
    return "\n".join(lines)


def render_reference(run: RunResult, reference: LruReference) -> str:
    """kvpool's HBM + DRAM row beside exact LRUs of the same capacities (:func:`~kvpool.bench.trace.lru_reference`)."""
    c = run.config
    ours, best = run.ratio(run.hit_blocks), reference.ratio(reference.hit_blocks)
    return (f"Exact LRU, HBM {c.hbm_blocks} + DRAM {c.dram_blocks} blocks (full capacity, every pool read and write "
            f"refreshes): HBM {reference.ratio(reference.hbm_hits):.1%}, "
            f"DRAM {reference.ratio(reference.dram_hits):.1%}, "
            f"overall {best:.1%}. kvpool {c.label}: HBM {run.ratio(run.hits['hbm']):.1%}, "
            f"DRAM {run.ratio(run.hits['dram']):.1%}, overall {ours:.1%} ({(ours - best) * 100:+.1f} points).")


# -- command line -------------------------------------------------------------------------------


def _capacity_arg(text: str) -> Capacity:
    return parse_capacity(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE",
                        help="your Mooncake-format JSONL trace (one request a line: timestamp, input_length, "
                        "output_length, hash_ids)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    parser.add_argument("--block-bytes", type=parse_bytes, default=DEFAULT_BLOCK_BYTES, metavar="SIZE",
                        help="payload of one 512-token block, a multiple of 1 KiB (default: 16K)")
    parser.add_argument("--hbm", type=_capacity_arg, default=parse_capacity(DEFAULT_HBM), metavar="CAP",
                        help="the client's HBM tier: blocks (1000b: b means blocks, any case) or bytes "
                        f"(16M, 4096bytes); 0: none (default: {DEFAULT_HBM})")
    parser.add_argument("--dram", type=_capacity_arg, default=parse_capacity(DEFAULT_DRAM), metavar="CAP",
                        help=f"the embedded node's DRAM tier; 0: no pool at all, HBM only (default: {DEFAULT_DRAM})")
    parser.add_argument("--ssd", type=_capacity_arg, default=parse_capacity(DEFAULT_SSD), metavar="CAP",
                        help=f"the embedded node's SSD tier; 0: off (default: {DEFAULT_SSD})")
    parser.add_argument("--ssd-dir", default=None,
                        help="where the embedded node's temporary SSD directory goes (default: the system temp dir)")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="use this running pool instead of an embedded one (--dram/--ssd then do not apply)")
    parser.add_argument("--tenant", default="",
                        help="key namespace salt: a new one starts cold against a running pool (default: none)")
    parser.add_argument("--flush-every", type=int, default=1, metavar="N",
                        help="wait for the pool writes every N requests (default: 1, deterministic hit ratios)")
    parser.add_argument("--compare", action="store_true",
                        help="run HBM only, HBM + DRAM and HBM + DRAM + SSD with these capacities: one table, and "
                        "HBM + DRAM beside exact LRUs of the same capacities")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--torch-threads", type=int, default=0, metavar="N",
                        help="torch intra-op threads for the CPU HBM tier's copies (default 0: torch's own choice)")


def tier_configs(args: argparse.Namespace) -> list[TierConfig]:
    """The configurations a run replays (three with --compare); ValueError on contradictory flags."""
    bb = args.block_bytes
    block_layout(bb)  # check the block size first
    hbm = args.hbm.to_blocks(bb)
    if not args.hbm.is_zero and hbm == 0:
        raise ValueError(f"--hbm {args.hbm.text} holds no {bb} B block (use 0 for no HBM tier)")
    dram = args.dram.to_bytes(bb) // bb * bb
    if not args.dram.is_zero and dram == 0:
        raise ValueError(f"--dram {args.dram.text} holds no {bb} B block (use 0 for no pool)")
    entry = ssd_entry_bytes(bb)
    ssd = args.ssd.to_bytes(entry)
    if not args.ssd.is_zero and ssd < entry:
        raise ValueError(f"--ssd {args.ssd.text} holds no {bb} B block ({entry} B on the SSD tier; use 0 for off)")
    if args.flush_every < 1:
        raise ValueError(f"--flush-every must be >= 1, got {args.flush_every}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")

    def label(d: int, s: int) -> str:
        return "HBM" + (" + DRAM" if d else "") + (" + SSD" if d and s else "")

    if args.master:
        if args.compare:
            raise ValueError("--compare sizes its own pools; it cannot use --master")
        return [TierConfig(f"HBM + pool at {args.master}", hbm, 0, 0, bb)]
    if args.compare:
        if dram == 0 or ssd == 0:
            raise ValueError("--compare needs --dram and --ssd above 0 (it adds DRAM, then SSD, to HBM)")
        return [TierConfig(label(0, 0), hbm, 0, 0, bb), TierConfig(label(dram, 0), hbm, dram, 0, bb),
                TierConfig(label(dram, ssd), hbm, dram, ssd, bb)]
    return [TierConfig(label(dram, ssd), hbm, dram, ssd if dram else 0, bb)]


def run(args: argparse.Namespace) -> int:
    configs = tier_configs(args)
    if args.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0, got {args.torch_threads}")
    if args.torch_threads and any(c.hbm_blocks for c in configs):
        import torch

        torch.set_num_threads(args.torch_threads)
    requests = load_trace(args.trace, args.limit)
    layout = block_layout(args.block_bytes)
    makers = KeyMaker(KeyNamespace(MODEL, layout.fingerprint(), tenant=args.tenant))
    t0 = time.perf_counter()
    request_keys = [makers.keys(r.hash_ids) for r in requests]
    key_seconds = time.perf_counter() - t0
    bound = unbounded_bound(r.hash_ids for r in requests)
    key_bound = unbounded_bound(request_keys)
    results = []
    for config in configs:
        results.append(replay(request_keys, config, master=args.master, ssd_parent=args.ssd_dir,
                              flush_every=args.flush_every, tenant=args.tenant, progress=not args.no_progress))
    table = render(results, bound, key_bound, trace=args.trace, flush_every=args.flush_every)
    exact_lru: dict[str, Any] = {}
    dram_run = next((r for r in results if r.config.dram_blocks and not r.config.ssd_blocks), None)
    if args.compare and dram_run is not None:
        c = dram_run.config
        reference = lru_reference(request_keys, c.hbm_blocks, c.dram_blocks)
        table += "\n\n" + render_reference(dram_run, reference)
        exact_lru = {"hbm_blocks": c.hbm_blocks, "dram_blocks": c.dram_blocks, "hbm_hits": reference.hbm_hits,
                     "dram_hits": reference.dram_hits, "hit": reference.ratio(reference.hit_blocks)}
    if args.json:
        summary = {
            "trace": args.trace, "requests": len(requests), "block_lookups": bound.lookups,
            "block_bytes": args.block_bytes, "flush_every": args.flush_every, "key_seconds": key_seconds,
            "bound": {"leading_run": bound.leading, "per_block": bound.per_block,
                      "keys_leading_run": key_bound.leading, "keys_per_block": key_bound.per_block},
            "runs": [r.to_json(bound) for r in results],
        }
        if exact_lru:
            summary["exact_lru"] = exact_lru
        print(json.dumps(summary, indent=2))
    else:
        print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    wrong = sum(r.wrong_blocks for r in results)
    if wrong:
        print(f"kvpool bench replay: {wrong} blocks came back with wrong bytes", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpool.bench.replay``: the same as ``kvpool bench replay`` until the CLI wires it."""
    import logging

    parser = argparse.ArgumentParser(prog="kvpool bench replay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ValueError as exc:
        print(f"kvpool bench replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
