"""The last-resort data path: the node's gRPC ``Get`` and ``Put`` (bytes copied into messages).

Used only for blocks no faster path could move (no shared memory, bulk
listener unreachable). It takes every block it is given: failures are
counted misses (reads) or unstored blocks (writes), never handed on. Its
calls share the node's deadline: once it passed, the chunks left fail at
once (DEADLINE_EXCEEDED) instead of waiting a timeout each.
"""

from __future__ import annotations

import grpc
import numpy as np

from kvpool.checksum import block_checksum, copy_with_checksum
from kvpool.client.datapath import GRPC_CHUNK_BYTES, call_timeout, chunks
from kvpool.client.faults import Faults, error_kind
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.config import ClientConfig
from kvpool.keys import BlockKey, pack_keys
from kvpool.rpc import flags_from_bytes
from kvpool.v1 import node_pb2
from kvpool.vocabulary import NO_TIER, NodeRef


class GrpcPath:
    """The :class:`~kvpool.client.datapath.DataPath` over gRPC (see module docstring)."""

    def __init__(self, config: ClientConfig, nodes: NodeDirectory, faults: Faults):
        self.config = config
        self.nodes = nodes
        self.faults = faults

    def get(self, node: NodeRef, idxs: list[int], blocks: PoolRun, dsts: list[np.ndarray],
            ok: list[bool], deadline: float) -> list[int]:
        sizes = blocks.sizes.tolist()
        for run in chunks(idxs, sizes, GRPC_CHUNK_BYTES, self.nodes.max_keys(node.address, call_timeout(deadline))):
            request = node_pb2.GetRequest(keys=pack_keys([blocks.keys[i] for i in run]))
            try:
                reply = self.nodes.stub(node.address).Get(request, timeout=call_timeout(deadline))
            except grpc.RpcError as exc:
                self.faults.lost(error_kind(exc), exc, len(run))
                continue
            if not len(reply.tiers) == len(reply.sizes) == len(reply.checksums) == len(run) or \
                    sum(reply.sizes) != len(reply.data):  # a reply not shaped as the node's: none of it is trusted
                self.faults.lost("bad_reply", "get reply fields disagree", len(run))
                continue
            data = np.frombuffer(reply.data, dtype=np.uint8)
            offset = 0
            for j, i in enumerate(run):
                if reply.tiers[j] == NO_TIER:
                    self.faults.lost("block_gone", blocks.keys[i].hex()[:16])
                    continue
                size = reply.sizes[j]
                piece = data[offset : offset + size]
                offset += size
                checksum = int(blocks.checksums[i])
                if size != sizes[i] or reply.checksums[j] != checksum:
                    self.faults.lost("block_changed", blocks.keys[i].hex()[:16])
                    continue
                if copy_with_checksum(dsts[i], piece) != checksum:
                    self.faults.lost("checksum", blocks.keys[i].hex()[:16])
                    continue
                ok[i] = True
        return []

    def put(self, node: NodeRef, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
            sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        for run in chunks(idxs, sizes, GRPC_CHUNK_BYTES, self.nodes.max_keys(node.address, call_timeout(deadline))):
            request = node_pb2.PutRequest(
                keys=pack_keys([keys[i] for i in run]),
                sizes=[sizes[i] for i in run],
                data=b"".join(arrays[i].data for i in run),
                checksums=[block_checksum(arrays[i]) for i in run],
            )
            try:
                reply = self.nodes.stub(node.address).Put(request, timeout=call_timeout(deadline))
            except grpc.RpcError as exc:
                self.faults.counted(error_kind(exc), len(run))
                continue
            stored = flags_from_bytes(reply.stored)
            for i, flag in zip(run, stored):
                result[i] = flag
            refused = stored.count(False)
            if refused:
                self.faults.counted("put_refused", refused)
        return []
