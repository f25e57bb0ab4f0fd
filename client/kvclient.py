"""KVCacheClient: what an inference worker holds. HBM first, then one pool lookup for the rest.

Invariants:
- A lookup matches the leading run in this worker's HBM tier, then asks the
  master once (packed keys) about the blocks after it; only a leading run
  of hits is ever used.
- ``get`` fills the caller's tensors/buffers for that run and returns how many
  leading blocks are now loaded; a block that fails ends the run (the engine
  recomputes from there). Pool blocks it loads are kept in HBM too.
- ``put`` stores in HBM at once and queues the pool write (write-behind): the
  engine never waits on the pool. ``flush`` waits for the queue. An engine
  that can write its blocks itself uses ``prepare_put`` / ``complete_put``
  instead: it writes each block once, into a slot the pool leased ahead.
- Lookups answered by HBM alone make no master call; their counts reach the
  master within ~1 s, or at ``flush`` (:mod:`kvpool.client.lookup_stats`),
  so its cluster-wide hit rates include them.
- Pool faults are counted misses, never exceptions (see :mod:`kvpool.client.pool`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kvpool.client.lookup import EMPTY_RUN, LookupResult
from kvpool.client.pool import PoolClient
from kvpool.client.prepared import PreparedPut
from kvpool.client.tensors import as_tensor, read_target, write_source
from kvpool.config import ClientConfig, load_config
from kvpool.keys import BlockKey, KeyNamespace, chain_block_keys, check_keys, leading_hits

_HBM_REPORT_BATCH = 1024  # HBM key changes that trigger a report


class KVCacheClient:
    """HBM tier + pool, built from one :class:`~kvpool.config.ClientConfig`."""

    def __init__(self, config: ClientConfig, *, registry: CollectorRegistry | None = None):
        self.config = config
        self.layout = config.layout
        self.pool = PoolClient(config, registry)
        self.registry = self.pool.registry
        self._hbm_lock = threading.Lock()
        self._hbm_changed_keys: set[BlockKey] = set()  # reported as what HBM holds at report time
        self.hbm = None
        if config.hbm_blocks > 0:
            if self.layout is None:
                raise ValueError("an HBM tier (hbm_blocks > 0) needs client.layout")
            from kvpool.client.hbm import HbmStore

            self.hbm = HbmStore(self.layout, config.hbm_blocks, config.device, on_change=self._hbm_changed)

    @classmethod
    def from_file(cls, path: str) -> KVCacheClient:
        """Build from a kvpool JSON config (its ``client`` section) plus ``KVPOOL_CLIENT_*`` variables."""
        return cls(load_config(path).client)

    @property
    def block_tokens(self) -> int:
        return self.layout.block_size if self.layout is not None else 0

    def namespace(self, tp_rank: int = 0, tp_size: int = 1) -> KeyNamespace:
        if self.layout is None:
            raise ValueError("block keys need client.layout")
        return KeyNamespace(self.config.model, self.layout.fingerprint(), tp_rank, tp_size, self.config.tenant)

    def block_keys(self, tokens: Sequence[int], tp_rank: int = 0, tp_size: int = 1) -> list[BlockKey]:
        """Keys of the full blocks of ``tokens`` in this client's namespace."""
        return chain_block_keys(tokens, self.block_tokens, self.namespace(tp_rank, tp_size))

    # -- HBM reporting (routing scores and KV events at the master) ----------------------

    def _hbm_changed(self, added: list[BlockKey], removed: list[BlockKey]) -> None:
        with self._hbm_lock:
            self._hbm_changed_keys.update(added)
            self._hbm_changed_keys.update(removed)
            due = len(self._hbm_changed_keys) >= _HBM_REPORT_BATCH
        if due:
            self._report_hbm(wait=False)

    def _report_hbm(self, *, wait: bool, timeout: float | None = None) -> None:
        """Send the HBM changes the master has not seen (best effort; within ``lookup_timeout_s`` and
        ``timeout``)."""
        with self._hbm_lock:
            changed = list(self._hbm_changed_keys)
            self._hbm_changed_keys = set()
        # What HBM holds now, not the order events arrived in, decides added vs removed.
        held = self.hbm.contains(changed) if self.hbm is not None else [False] * len(changed)
        added = [k for k, h in zip(changed, held) if h]
        removed = [k for k, h in zip(changed, held) if not h]
        if added or removed:
            self.pool.report_hbm(added, removed, wait=wait, timeout=timeout)

    # -- the engine's calls --------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """HBM's leading run, then the pool's leading run after it (one master call)."""
        keys = check_keys(keys)
        hbm = leading_hits(self.hbm.contains(keys)) if self.hbm is not None else 0
        pool = EMPTY_RUN
        if hbm < len(keys):
            pool = self.pool.lookup(keys[hbm:], hbm_prefix_blocks=hbm, block_tokens=self.block_tokens)
        elif keys:  # HBM answered alone: counted here, the master hears of it within a second
            self.pool.lookup_stats.count(hbm, b"", hbm, self.block_tokens)
        result = LookupResult(len(keys), hbm, pool)
        self.pool.lookup_metrics.record(result.by_tier(), len(keys), self.block_tokens)
        return result

    def get(self, keys: Sequence[BlockKey], outs: Sequence[Any], result: LookupResult | None = None) -> int:
        """Load the leading hit run into ``outs``; returns how many leading blocks are loaded."""
        keys = check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} outputs")
        self._check_blocks(outs, "output")
        result = result if result is not None else self.lookup(keys)
        loaded = 0
        if result.hbm_blocks:
            assert self.hbm is not None, "client: HBM hits without an HBM tier"
            hits = self.hbm.get_into(keys[: result.hbm_blocks], [as_tensor(o) for o in outs[: result.hbm_blocks]])
            loaded = leading_hits(hits)
            if loaded < result.hbm_blocks:
                return loaded
        if not result.pool:
            return loaded
        span = slice(loaded, loaded + len(result.pool))
        targets = [read_target(o) for o in outs[span]]
        ok = self.pool.get_into(result.pool, [t for t, _ in targets])
        run = leading_hits(ok)
        for _, finish in targets[:run]:
            if finish is not None:
                finish()
        if self.hbm is not None and run:
            self.hbm.put(keys[loaded : loaded + run], [as_tensor(o) for o in outs[loaded : loaded + run]])
        return loaded + run

    def put(self, keys: Sequence[BlockKey], values: Sequence[Any],
            engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Keep blocks in HBM now and queue them for the pool; per block, whether the pool accepted it.

        ``engine_hashes``: the engine's own 64-bit hash of each block (0: none), for the master's KV events.
        """
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        self._check_blocks(values, "block")
        sources = [write_source(v) for v in values]
        if self.hbm is not None:
            self.hbm.put(keys, [as_tensor(v) for v in values])
        return self.pool.put(keys, sources, engine_hashes)

    def _check_blocks(self, blocks: Sequence[Any], what: str) -> None:
        """ValueError (nothing done yet) unless each of ``blocks`` is one block of the layout (without one: any
        size)."""
        if self.layout is not None:
            for i, block in enumerate(blocks):
                self.layout.check_block(block, what=f"{what} {i}")

    def prepare_put(self, keys: Sequence[BlockKey]) -> PreparedPut:
        """Step one of a put in two steps (:mod:`kvpool.client.prepared`): one target of the layout's block size
        per key, a slot leased ahead where the pool has one; fill each, then :meth:`complete_put`."""
        if self.layout is None:
            raise ValueError("a two-step put needs client.layout (the block size)")
        keys = check_keys(keys)
        return self.pool.prepare_put(keys, [self.layout.block_bytes] * len(keys))

    def complete_put(self, prepared: PreparedPut, engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Step two: keep the filled blocks in HBM now and queue them for the pool (as :meth:`put` does)."""
        if self.hbm is not None and not prepared.unfilled():
            self.hbm.put(prepared.keys, [as_tensor(t) for t in prepared.targets])
        return self.pool.complete_put(prepared, engine_hashes)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: in this worker's HBM or in the pool."""
        keys = check_keys(keys)
        in_hbm = self.hbm.contains(keys) if self.hbm is not None else [False] * len(keys)
        rest = [k for k, h in zip(keys, in_hbm) if not h]
        in_pool = iter(self.pool.exists(rest) if rest else [])
        return [h or next(in_pool) for h in in_hbm]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued pool writes; also sends pending HBM and lookup reports (one ``timeout`` for all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._report_hbm(wait=True, timeout=timeout)
        return self.pool.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Tell the master this worker's HBM is gone, drain queued writes, release everything."""
        if self.hbm is not None:
            hbm, self.hbm = self.hbm, None
            hbm.close()  # reports every key it held as removed
        self._report_hbm(wait=True)
        self.pool.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
