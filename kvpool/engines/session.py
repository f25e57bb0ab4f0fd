"""What every engine backend holds: a client for its role, its key namespace, two stagers and counters.

Backends (:mod:`.mindie`, :mod:`.vllm_ascend`) check the engine's arguments and
know how the engine lays out a block's pieces; everything between that and
the pool is here, once.

Invariants:
- A ``"scheduler"`` session holds no data memory: its client has no HBM tier
  (``hbm_blocks=0``) and never maps a node's arena (``shared_memory=False``),
  and it has no stagers; it can only answer ``exists``.
- A ``"worker"`` session has one stager for puts and one for gets
  (:class:`~kvpool.engines.staging.BlockStager`), allocated on first use.
- Nothing here raises on the engine's path: faults are counted in
  ``stats["faults"]`` and answered as misses, refusals in ``stats["refused"]``.
  ``stats`` also counts ``put_blocks``/``put_accepted`` and ``get_blocks``/``get_hits``.
- After ``close`` the session is closed for good: ``client`` is None.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvpool.client.kvclient import KVCacheClient
from kvpool.config import ClientConfig
from kvpool.engines.keymap import engine_namespace, map_keys
from kvpool.engines.staging import BlockStager, Gather, Scatter
from kvpool.keys import BlockKey

log = logging.getLogger(__name__)

ROLES = ("scheduler", "worker")


class EngineSession:
    """One engine backend's connection to the pool (see module docstring)."""

    def __init__(self, config: ClientConfig, role: str, staging_bytes: int, name: str):
        """``name`` labels log lines (e.g. "MindIE MemPool"); ValueError for an unknown role."""
        if role not in ROLES:
            raise ValueError(f"{name} role must be one of {ROLES}, got {role!r}")
        if role == "scheduler":
            config = dataclasses.replace(config, hbm_blocks=0, shared_memory=False)
        self.role = role
        self.name = name
        self.stats: Counter = Counter()
        self.client: KVCacheClient | None = KVCacheClient(config)
        self.namespace = engine_namespace(self.client)
        self.put_stager: BlockStager | None = None
        self.get_stager: BlockStager | None = None
        if role == "worker":
            self.put_stager = BlockStager(staging_bytes, self.stats)
            self.get_stager = BlockStager(staging_bytes, self.stats)

    @property
    def moves_data(self) -> bool:
        """True for an open worker session."""
        return self.client is not None and self.put_stager is not None

    def keys(self, names: object) -> list[BlockKey] | None:
        """Pool keys of engine key strings, or None if ``names`` is not a list of usable strings."""
        return map_keys(names, self.namespace)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether the pool (or this worker's HBM tier) holds it; all False if closed or on a fault."""
        client = self.client
        if client is None or not keys:
            return [False] * len(keys)
        try:
            found = [bool(x) for x in client.exists(keys)]
        except Exception as exc:  # noqa: BLE001 - a fault is a miss
            return self.fault("exists", exc, [False] * len(keys))
        return found if len(found) == len(keys) else self.fault("exists", "answer of the wrong length",
                                                                [False] * len(keys))

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], sizes: Sequence[int], gather: Gather,
            engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Gather and queue each block for the pool (``engine_hashes``: the engine's own hash of each, for KV
        events); per block, accepted. Only for a session that moves data."""
        client, stager = self.client, self.put_stager
        assert client is not None and stager is not None, f"{self.name}: put on a session that moves no data"
        ok = stager.put(client, keys, blocks, sizes, gather, engine_hashes)
        self.stats["put_blocks"] += len(ok)
        self.stats["put_accepted"] += sum(ok)
        return ok

    def get(self, keys: Sequence[BlockKey], blocks: Sequence[Any], sizes: Sequence[int],
            scatter: Scatter) -> list[bool]:
        """Load each block the pool holds into the engine; per block, loaded. Only for a session that moves data."""
        client, stager = self.client, self.get_stager
        assert client is not None and stager is not None, f"{self.name}: get on a session that moves no data"
        ok = stager.get(client, keys, blocks, sizes, scatter)
        self.stats["get_blocks"] += len(ok)
        self.stats["get_hits"] += sum(ok)
        return ok

    def refuse(self, call: str, why: str, answer: Any) -> Any:
        """Count and log a refused call; returns ``answer`` (what the engine gets back)."""
        self.stats["refused"] += 1
        log.warning("kvpool %s %s refused: %s", self.name, call, why)
        return answer

    def fault(self, call: str, exc: object, answer: Any) -> Any:
        """Count and log a pool fault; returns ``answer``."""
        self.stats["faults"] += 1
        log.warning("kvpool %s %s failed: %s", self.name, call, exc)
        return answer

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put reached the pool (or was dropped); False on timeout or when closed."""
        client = self.client
        if client is None:
            return False
        try:
            return client.flush(timeout)
        except Exception as exc:  # noqa: BLE001
            return self.fault("flush", exc, False)

    def close(self) -> None:
        """Drain queued puts, release the client and staging buffers. Idempotent."""
        client, self.client = self.client, None
        for stager in (self.put_stager, self.get_stager):
            if stager is not None:
                stager.close()
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001
                self.fault("close", exc, None)
