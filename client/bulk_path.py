"""Remote data path over the wire's bulk GET and PUT on a node's data port (its client: :mod:`.bulk_client`).

Reads land straight in the caller's buffers and writes go straight from
them. If the listener cannot be reached the blocks are handed to the next
path (gRPC) and the listener is skipped for a while; an exchange that broke,
or that a full listener refused, hands its blocks on too, counted as
``bulk_fallback``.

Every request is due by the node's deadline (:mod:`.datapath`): each
connect, receive or send stalls at most what is left of it, and no request
starts after it.

A GET asks for at most ``GET_CHUNK_BYTES`` of blocks (and the node's most keys per call)
at a time, well under what a node serves in one GET
(:data:`kvpool.wire.MAX_GET_BYTES`, more if its ``max_request_bytes``
is larger; a larger block goes alone). A PUT sends at most
``LEASE_CHUNK_BYTES``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kvpool.checksum import block_checksum
from kvpool.client.bulk_client import CHANGED, CORRUPT, GONE, OK, BulkClient, BulkFailed, BulkUnavailable
from kvpool.client.datapath import LEASE_CHUNK_BYTES, call_timeout, chunks
from kvpool.client.faults import Faults
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.config import ClientConfig
from kvpool.keys import BlockKey
from kvpool.tcp import ConnectionPool
from kvpool.tls import client_context
from kvpool.vocabulary import NodeRef
from kvpool.wire import MAX_GET_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")
GET_CHUNK_BYTES = 64 << 20  # bytes of blocks one bulk GET asks for (a node serves up to MAX_GET_BYTES)
assert GET_CHUNK_BYTES <= MAX_GET_BYTES // 2, "bulk path: a GET must stay under the node's limit, with room"


class BulkPath:
    """The :class:`~kvpool.client.datapath.DataPath` over bulk TCP (see module docstring)."""

    def __init__(self, config: ClientConfig, nodes: NodeDirectory, faults: Faults, pool: ConnectionPool | None = None):
        self.nodes = nodes
        self.faults = faults
        # ``pool``: the client's wire connections, shared with its fast calls (one connection and one AUTH a node)
        self.bulk = BulkClient(config.io_timeout_s, connect_timeout_s=min(config.io_timeout_s, 2.0),
                               token=config.token, tls=client_context(config.tls_ca) if config.tls_ca else None,
                               pool=pool)

    def _call(self, node: NodeRef, n: int, call: Callable[..., T], *args: Any) -> T | None:
        """One bulk request; None (hand these ``n`` blocks on) if the listener is down or the call failed."""
        try:
            return call(*args)
        except BulkUnavailable as exc:
            log.debug("bulk listener of %s unreachable (%s); using gRPC", node.address, exc)
            self.nodes.bulk_unreachable(node.address)
        except BulkFailed as exc:
            log.debug("bulk %s with %s failed (%s); using gRPC", call.__name__, node.address, exc)
            self.faults.counted("bulk_fallback", n)
        return None

    def get(self, node: NodeRef, idxs: list[int], run: PoolRun, dsts: list[np.ndarray],
            ok: list[bool], deadline: float) -> list[int]:
        if time.monotonic() >= deadline:
            return idxs
        data_address = self.nodes.data_address(node.address, call_timeout(deadline))
        if data_address is None:
            return idxs
        done = 0
        sizes = run.sizes[idxs].tolist()
        max_keys = self.nodes.max_keys(node.address, call_timeout(deadline))
        for positions in chunks(range(len(idxs)), sizes, GET_CHUNK_BYTES, max_keys):
            if time.monotonic() >= deadline:
                return idxs[done:]
            part = [idxs[p] for p in positions]
            status = self._call(node, len(part), self.bulk.get_into, data_address,
                                [run.keys[i] for i in part], [dsts[i] for i in part], run.checksums[part].tolist(),
                                call_timeout(deadline))
            if status is None:
                return idxs[done:]
            done += len(part)
            for i, st in zip(part, status):
                if st == OK:
                    ok[i] = True
                elif st == GONE:
                    self.faults.lost("block_gone", run.keys[i].hex()[:16])
                elif st == CHANGED:
                    self.faults.lost("block_changed", run.keys[i].hex()[:16])
                elif st == CORRUPT:
                    self.faults.lost("checksum", run.keys[i].hex()[:16])
        return []

    def put(self, node: NodeRef, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
            sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        if time.monotonic() >= deadline:
            return idxs
        data_address = self.nodes.data_address(node.address, call_timeout(deadline))
        if data_address is None:
            return idxs
        done = 0
        for run in chunks(idxs, sizes, LEASE_CHUNK_BYTES, self.nodes.max_keys(node.address, call_timeout(deadline))):
            if time.monotonic() >= deadline:
                return idxs[done:]
            sums = [block_checksum(arrays[i]) for i in run]
            stored = self._call(node, len(run), self.bulk.put, data_address,
                                [keys[i] for i in run], [arrays[i] for i in run], sums, call_timeout(deadline))
            if stored is None:
                return idxs[done:]
            for i, flag in zip(run, stored):
                result[i] = flag
            refused = stored.count(False)
            if refused:
                self.faults.counted("put_refused", refused)
            done += len(run)
        return []

    def close(self) -> None:
        self.bulk.close()
