"""Cache-aware routing: ask the master, per worker, how much of a prompt's prefix it would not recompute.

``Master.Score`` answers, for one prompt's block keys and a set of workers, each worker's leading run in its
own HBM and then the pool's leading run of the rest by tier: exactly what that worker's lookup would hit
(:meth:`kvpool.master.servicer.MasterServicer.Score`). :class:`ScoreClient` asks it (following an HA
cluster's leader, or each index shard's of a sharded cluster, :mod:`kvpool.sharded_master`, with the client
config's token and TLS); :func:`rank` orders the answer; ``kvpool route``
prints it for a prompt.

Invariants:

- A pool fault is an empty answer, never an exception: a router that cannot reach the master routes as if
  nothing were cached (round robin, load), and says so in its log.
- :func:`rank` prefers the worker that reuses the most blocks; among equals, the one with more of them in
  HBM, then in DRAM (cheaper to load), then the lighter load a caller passes, then the worker id.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from kvpool.config import ClientConfig
from kvpool.etcd import EtcdAccess
from kvpool.keys import BlockKey, pack_keys
from kvpool.master_client import MasterApi
from kvpool.sharded_master import connect_master
from kvpool.tcp import ConnectionPool
from kvpool.tls import client_context
from kvpool.v1 import master_pb2
from kvpool.wire import CallError, auth_hello

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class WorkerScore:
    """What one worker would reuse of a prompt: ``hbm`` leading blocks in its HBM, then ``dram`` and ``ssd``
    blocks of the pool's leading run after them."""

    worker: str
    hbm: int
    dram: int
    ssd: int

    @property
    def reused(self) -> int:
        return self.hbm + self.dram + self.ssd


@dataclass(frozen=True)
class Score:
    """One prompt's scores: per worker asked, and the pool's run for a worker with empty HBM."""

    blocks: int
    workers: tuple[WorkerScore, ...]
    pool_dram: int
    pool_ssd: int


def rank(score: Score, load: Mapping[str, float] | None = None) -> list[WorkerScore]:
    """The workers, best first (see the module docstring)."""
    load = load or {}
    return sorted(score.workers, key=lambda w: (-w.reused, -w.hbm, -w.dram, load.get(w.worker, 0.0), w.worker))


class ScoreClient:
    """Scores prompts on the current master of ``config.master`` (a host:port or etcd://...). Thread-safe."""

    def __init__(self, config: ClientConfig):
        tls = client_context(config.tls_ca) if config.tls_ca else None
        self._calls = ConnectionPool(config.io_timeout_s, connect_timeout_s=min(config.io_timeout_s, 2.0), tls=tls,
                                     hello=auth_hello(config.token) if config.token else None)
        self._master: MasterApi = connect_master(
            config.master, pool=self._calls, timeout_s=config.lookup_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES,
            token=config.token, tls_ca=config.tls_ca, etcd_access=EtcdAccess.from_config(config, "client"))
        self._timeout = config.lookup_timeout_s

    def score(self, keys: Sequence[BlockKey], workers: Sequence[str] = ()) -> Score | None:
        """The master's answer for ``keys`` (empty ``workers``: every worker it knows); None if it cannot be
        asked (logged): route without it."""
        request = master_pb2.ScoreRequest(keys=pack_keys(keys), worker_ids=list(workers))
        try:
            reply = self._master.score(request, self._timeout)
        except (grpc.RpcError, CallError, OSError) as exc:
            log.warning("kvpool routing: no score from the master (%s); routing without it", exc)
            return None
        return Score(len(keys), tuple(WorkerScore(w.worker_id, w.hbm_blocks, w.dram_blocks, w.ssd_blocks)
                                      for w in reply.workers), reply.pool_dram_blocks, reply.pool_ssd_blocks)

    def close(self) -> None:
        self._calls.close()
        self._master.close()

    def __enter__(self) -> ScoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def render(score: Score, block_tokens: int, load: Mapping[str, float] | None = None) -> str:
    """``kvpool route``'s table: one row per worker, best first, then the pool alone."""
    rows = [f"prompt: {score.blocks} full blocks of {block_tokens} tokens",
            f"{'worker':<32} {'HBM':>6} {'DRAM':>6} {'SSD':>6} {'reused':>8}"]
    ranked = rank(score, load)
    for w in ranked:
        rows.append(f"{w.worker:<32} {w.hbm:>6} {w.dram:>6} {w.ssd:>6} {w.reused:>5}/{score.blocks}")
    alone = score.pool_dram + score.pool_ssd
    rows.append(f"{'(a worker with empty HBM)':<32} {'-':>6} {score.pool_dram:>6} {score.pool_ssd:>6} "
                f"{alone:>5}/{score.blocks}")
    if ranked:
        best = ranked[0]
        rows.append(f"best: {best.worker} ({best.reused} of {score.blocks} blocks reused, {best.hbm} in its HBM)")
    else:
        rows.append("best: no worker has reported HBM yet; any worker reuses the pool's run")
    return "\n".join(rows)
