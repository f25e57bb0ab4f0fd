"""Fakes of what the client's data paths and lookup helpers call, for unit tests with no servers.

- :class:`FakeRpcError`: a ``grpc.RpcError`` with a status code, as a stub raises it.
- :class:`FakeNodeStub`: a node's ``Get``/``Put``/``Info`` over an in-memory dict (checksums as a node sends them);
  every request is kept for the test to look at, and ``fail`` makes the next calls raise.
- :class:`FakeNodes`: the part of :class:`~kvpool.client.nodes.NodeDirectory` the paths use (``stub``,
  ``data_address``, ``bulk_unreachable``, ``arena``), with one stub per address.
- :class:`FakeArena`: the part of :class:`~kvpool.tiers.arena.SharedArena` :class:`LocalIndex` reads (its
  inventory).
- :class:`RecordingPath`: a :class:`~kvpool.client.datapath.DataPath` that moves what a script says and records
  what it was offered.
- :func:`node`, :func:`run_of`, :func:`faults`: small factories.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from kvpool.checksum import block_checksum
from kvpool.client.faults import Faults
from kvpool.client.lookup import PoolRun
from kvpool.keys import BlockKey, unpack_keys
from kvpool.metrics import ErrorMetrics, error_counts
from kvpool.tiers.arena import InventoryState
from kvpool.v1 import common_pb2, node_pb2
from kvpool.vocabulary import NO_TIER, NodeRef, Tier


class FakeRpcError(grpc.RpcError):
    """What a gRPC stub raises: an RpcError with a status code."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def key(i: int) -> BlockKey:
    """A distinct 32-byte key."""
    return BlockKey(i.to_bytes(4, "big") + bytes(28))


def block(i: int, size: int) -> np.ndarray:
    """Deterministic bytes of block ``i``."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def node(name: str = "n1", host_id: str = "other-host", arena: str = "") -> NodeRef:
    return NodeRef(name, f"{name}.invalid:1", host_id, arena)


def run_of(keys: Sequence[BlockKey], blocks: Sequence[np.ndarray], nodes: Sequence[NodeRef],
           node_indexes: Sequence[int] | None = None, tier: Tier = Tier.DRAM) -> PoolRun:
    """A lookup's run: each block on ``nodes[node_indexes[i]]`` (all on the first by default), its checksum right."""
    idx = [0] * len(keys) if node_indexes is None else list(node_indexes)
    return PoolRun(list(keys), bytes([int(tier)] * len(keys)), idx, list(nodes), [b.size for b in blocks],
                   [block_checksum(b) for b in blocks])


def faults(strict: bool = False) -> tuple[Faults, CollectorRegistry]:
    """A :class:`Faults` over its own registry (read it with :func:`counts`)."""
    registry = CollectorRegistry()
    return Faults(ErrorMetrics(registry), strict=strict), registry


def counts(registry: CollectorRegistry) -> dict[str, int]:
    return error_counts(registry)


@dataclass
class FakeNodeStub:
    """A node's gRPC ``Get``, ``Put`` and ``Info``, over ``held`` (key -> bytes), replies shaped as the node's
    (``Get``: sizes and checksums for every key, 0 for a miss).

    ``corrupt``: keys whose bytes come back altered under their right checksum (a torn copy). ``fail``: a status
    code every call raises (None: none). ``calls``: (method, request, timeout) of every call.
    """

    held: dict[bytes, bytes] = field(default_factory=dict)
    corrupt: set[bytes] = field(default_factory=set)
    refuse: set[bytes] = field(default_factory=set)
    fail: grpc.StatusCode | None = None
    data_address: str = ""
    calls: list[tuple[str, object, float | None]] = field(default_factory=list)

    def _enter(self, method: str, request: object, timeout: float | None) -> None:
        self.calls.append((method, request, timeout))
        if self.fail is not None:
            raise FakeRpcError(self.fail)

    def Get(self, request: node_pb2.GetRequest, timeout: float | None = None) -> node_pb2.GetResponse:
        self._enter("Get", request, timeout)
        tiers, sizes, sums, parts = [], [], [], []
        for k in unpack_keys(request.keys):
            data = self.held.get(k)
            if data is None:
                tiers.append(NO_TIER)
                sizes.append(0)
                sums.append(0)
                continue
            tiers.append(int(Tier.DRAM))
            sizes.append(len(data))
            sums.append(block_checksum(np.frombuffer(data, dtype=np.uint8)))
            parts.append(bytes(b ^ 0xFF for b in data[:1]) + data[1:] if k in self.corrupt else data)
        return node_pb2.GetResponse(tiers=bytes(tiers), sizes=sizes, checksums=sums, data=b"".join(parts))

    def Put(self, request: node_pb2.PutRequest, timeout: float | None = None) -> node_pb2.PutResponse:
        self._enter("Put", request, timeout)
        stored, offset = [], 0
        for k, size in zip(unpack_keys(request.keys), request.sizes):
            if k not in self.refuse:
                self.held[k] = request.data[offset : offset + size]
            stored.append(k not in self.refuse)
            offset += size
        return node_pb2.PutResponse(stored=bytes(int(s) for s in stored))

    def Info(self, request: node_pb2.InfoRequest, timeout: float | None = None) -> node_pb2.InfoResponse:
        self._enter("Info", request, timeout)
        return node_pb2.InfoResponse(node=common_pb2.NodeRef(node_id="n", address="a", data_address=self.data_address))

    def methods(self) -> list[str]:
        return [m for m, _, _ in self.calls]


@dataclass
class FakeArena:
    """A node's arena as :class:`~kvpool.client.local_index.LocalIndex` reads it: its inventory."""

    inventory: dict[bytes, tuple[Tier, int, int]] = field(default_factory=dict)  # stored key -> tier, size, sum
    state: InventoryState = InventoryState.COMPLETE
    file_id: tuple[int, int] | None = (1, 1)

    def inventory_state(self) -> InventoryState:
        return self.state

    def inventory_meta(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        found = [self.inventory.get(bytes(k), (NO_TIER, 0, 0)) for k in keys]
        return (np.array([int(t) for t, _, _ in found], dtype=np.uint8),
                np.array([s for _, s, _ in found], dtype=np.uint64),
                np.array([c for _, _, c in found], dtype=np.uint64))


@dataclass
class FakeNodes:
    """The part of :class:`~kvpool.client.nodes.NodeDirectory` the data paths and LocalIndex use."""

    stubs: dict[str, FakeNodeStub] = field(default_factory=dict)
    data_addresses: dict[str, str | None] = field(default_factory=dict)  # gRPC address -> bulk address
    arenas: dict[str, FakeArena] = field(default_factory=dict)  # node id -> arena
    host_id: str = "this-host"
    unreachable: list[str] = field(default_factory=list)
    max_keys_per_call: int = 65536  # what every node's Info says

    def stub(self, address: str) -> FakeNodeStub:
        return self.stubs.setdefault(address, FakeNodeStub())

    def data_address(self, address: str, timeout: float | None = None) -> str | None:
        return self.data_addresses.get(address)

    def max_keys(self, address: str, timeout: float | None = None) -> int:
        return self.max_keys_per_call

    def bulk_unreachable(self, address: str) -> None:
        self.unreachable.append(address)
        self.data_addresses.pop(address, None)

    def arena(self, ref: NodeRef, *, recheck: bool = False) -> FakeArena | None:
        return self.arenas.get(ref.node_id)


Script = Callable[[NodeRef, list[int]], tuple[list[int], list[int]]]  # -> (moved, handed on)


class RecordingPath:
    """A data path that moves what ``script(node, idxs)`` says and hands on what it says (the rest are misses it
    would have counted) and records each offer as (op, node id, idxs). Moving a get copies ``source[i]`` into
    ``dsts[i]``."""

    def __init__(self, name: str, script: Script, source: Sequence[np.ndarray] = (), *, stall: bool = False):
        self.name = name
        self.script = script
        self.source = source
        self.stall = stall  # a stalled node: return only once the deadline has passed
        self.offers: list[tuple[str, str, list[int]]] = []
        self.lock = threading.Lock()

    def _stall(self, deadline: float) -> None:
        while self.stall and (left := deadline - time.monotonic()) > 0:
            time.sleep(left)  # the node answers nothing before the deadline

    def get(self, node: NodeRef, idxs: list[int], run: PoolRun, dsts: list[np.ndarray],
            ok: list[bool], deadline: float) -> list[int]:
        with self.lock:
            self.offers.append(("get", node.node_id, list(idxs)))
        moved, rest = self.script(node, list(idxs))
        for i in moved:
            dsts[i][:] = self.source[i]
            ok[i] = True
        self._stall(deadline)
        return rest

    def put(self, node: NodeRef, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
            sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        with self.lock:
            self.offers.append(("put", node.node_id, list(idxs)))
        moved, rest = self.script(node, list(idxs))
        for i in moved:
            result[i] = True
        self._stall(deadline)
        return rest


def moves_all(node: NodeRef, idxs: list[int]) -> tuple[list[int], list[int]]:
    return idxs, []


def hands_on_all(node: NodeRef, idxs: list[int]) -> tuple[list[int], list[int]]:
    return [], idxs


@dataclass
class FakeBulkClient:
    """The bulk protocol client (:class:`~kvpool.client.bulk_client.BulkClient`) over ``held`` (key -> bytes).

    ``raises``: what the next calls raise, one entry per call in order (None: that call succeeds; once the list is
    spent, calls succeed). ``status``: a bulk
    status (GONE, CHANGED, CORRUPT) to answer for a key instead of its bytes. ``calls``: (method, address, keys,
    timeout) of every call.
    """

    held: dict[bytes, bytes] = field(default_factory=dict)
    status: dict[bytes, int] = field(default_factory=dict)
    refuse: set[bytes] = field(default_factory=set)
    raises: list[BaseException | None] = field(default_factory=list)
    calls: list[tuple[str, str, list[BlockKey], float | None]] = field(default_factory=list)

    def _enter(self, method: str, address: str, keys: Sequence[BlockKey], timeout: float | None) -> None:
        self.calls.append((method, address, list(keys), timeout))
        failure = self.raises.pop(0) if self.raises else None
        if failure is not None:
            raise failure

    def get_into(self, address: str, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
                 checksums: Sequence[int], timeout: float | None = None) -> list[int]:
        self._enter("get_into", address, keys, timeout)
        out = []
        for k, dst in zip(keys, outs):
            if k in self.status:
                out.append(self.status[k])
            elif k in self.held:
                dst[:] = np.frombuffer(self.held[k], dtype=np.uint8)
                out.append(0)  # OK
            else:
                out.append(1)  # GONE
        return out

    def put(self, address: str, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
            checksums: Sequence[int], timeout: float | None = None) -> list[bool]:
        self._enter("put", address, keys, timeout)
        for k, v, c in zip(keys, values, checksums):
            assert c == block_checksum(v), "bulk put: a checksum that is not the block's"
            if k not in self.refuse:
                self.held[k] = v.tobytes()
        return [k not in self.refuse for k in keys]

    def close(self) -> None:
        pass
