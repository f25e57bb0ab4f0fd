"""The node's wire listener (:mod:`kvpool.wire`): bulk GET and PUT straight between the arena and the socket,
and the fast calls Locate / Reserve / Commit, on one port (``NodeRef.data_address``).

gRPC costs a copy into a ``bytes`` message at each end and tops out well
below what a socket carries, so remote reads and writes use the wire's bulk
methods instead (gRPC ``Get``/``Put`` stay as the fallback). The store is
reached only through :class:`kvpool.node.core.NodeCore`, as the gRPC servicer reaches it.

Invariants:
- GET sends DRAM blocks from their arena rows (gathered ``sendmsg`` of
  :meth:`NodeCore.block_bytes`: no copy in Python) and re-checks each row's
  gen after sending (:meth:`NodeCore.end_read`): a row reused mid-send is
  reported invalid in the trailer. The client verifies every block's checksum
  anyway, so a torn send is a miss, never wrong bytes. SSD-resident blocks
  are read (and promoted into DRAM) into a scratch buffer of at most
  ``SCRATCH_BYTES`` at a time, then sent.
- PUT receives each block that fits a DRAM slot straight into a slot the
  node reserved for it (``recvmsg_into``), then commits the lease: the key
  becomes visible only after its bytes match its checksum. The listener's
  own leases last as long as their request (:meth:`NodeCore.request_lease`):
  a client that disconnects, or whose request passes its deadline, leaves
  nothing behind. Blocks with no DRAM slot (larger than a slot, or no room)
  go through scratch to :meth:`NodeCore.put` (SSD). PUT replies once the
  blocks are stored, as gRPC ``Put`` does; it never waits for the master
  (the master link reports in the background; ``FlushReports`` is the
  writer's barrier).
- Memory follows bytes that arrived (the wire allocates headers as they
  come). A GET's hits may hold at most ``MAX_GET_BYTES`` or
  ``max_request_bytes``, whichever is larger (INVALID_ARGUMENT otherwise,
  before anything is sent; a client asks for less), and a request holds at
  most ``SCRATCH_BYTES`` of scratch (or one block) and a sendmsg's worth of
  views at once, so a peer that never reads its reply pins little besides
  its kernel buffers, and only until its deadline.
- Bad values (sizes that do not match the keys or the payload, a size of 0
  or one no tier takes, too many keys) are INVALID_ARGUMENT, counted as
  ``invalid_argument``, after the payload was read past: the connection
  stays usable. With an auth file, keys are the caller's tenant's and a PUT
  passes the tenant's quota (:mod:`kvpool.node.core`).
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any

import numpy as np

from kvpool.auth import Authority
from kvpool.keys import KEY_BYTES, BlockKey, unpack_keys
from kvpool.metrics import ErrorMetrics
from kvpool.node.core import NodeCore
from kvpool.tcp import IOV_MAX, TcpListener
from kvpool.v1 import node_pb2
from kvpool.vocabulary import NO_TIER, Tier
from kvpool.wire import (
    MAX_GET_BYTES,
    NODE_CALLS,
    Method,
    Route,
    Stream,
    WireHandler,
    refusal_frame,
    request_limit,
    unary_routes,
)

log = logging.getLogger(__name__)

SCRATCH_BYTES = 16 << 20  # most bytes a request holds in scratch buffers at once (SSD reads, no-slot puts),
# or one block if larger: what a connection whose peer stops reading pins, besides its kernel buffers
DISCARD_BYTES = 1 << 20  # the buffer a PUT's held or refused blocks are read past through
GET_BATCH_KEYS = 4096  # a GET looks its keys up this many at a time (per-key Python objects for one batch only)
_NODE = node_pb2.DESCRIPTOR.services_by_name["Node"]
_DRAM, _SSD = int(Tier.DRAM), int(Tier.SSD)  # as plain ints: compared once per block


def _unpack(packed: bytes, lo: int, hi: int) -> list[BlockKey]:
    """Keys ``lo`` to ``hi`` of a packed batch."""
    return unpack_keys(packed[lo * KEY_BYTES : hi * KEY_BYTES])


class DataPortServer:
    """The node's wire listener over one :class:`NodeCore` (see the module docstring).

    ``servicer`` (the node's gRPC servicer) serves the fast calls (:data:`kvpool.wire.NODE_CALLS`).
    """

    def __init__(
        self,
        core: NodeCore,
        host: str,
        port: int,
        *,
        servicer: Any = None,
        max_connections: int = 64,
        errors: ErrorMetrics | None = None,
        get_seconds: Any = None,
        put_seconds: Any = None,
        fallback_port: bool = False,
        authority: Authority | None = None,
        max_request_bytes: int = 1 << 40,
        max_message_bytes: int = 64 << 20,
        tls: ssl.SSLContext | None = None,
    ):
        self.core = core
        self.max_keys_per_call = core.max_keys_per_call
        self.max_request_bytes = max_request_bytes
        self.get_seconds = get_seconds
        self.put_seconds = put_seconds
        max_keys = core.max_keys_per_call
        routes: dict[int, Route] = {}
        if servicer is not None:
            routes.update(unary_routes(servicer, _NODE, NODE_CALLS, max_body_bytes=max_message_bytes,
                                       max_keys=max_keys))
        routes[Method.GET] = Route("/kvpool.v1.Node/Get", node_pb2.GetRequest, self._get, True,
                                   request_limit(node_pb2.GetRequest, max_keys))
        routes[Method.PUT] = Route("/kvpool.v1.Node/Put", node_pb2.BulkPutRequest, self._put, True,
                                   request_limit(node_pb2.BulkPutRequest, max_keys), max_request_bytes)
        self.handler = WireHandler(routes, max_frame_bytes=max_message_bytes, authority=authority, errors=errors)
        self._listener = TcpListener("node-wire", host, port, self.handler.serve, max_connections=max_connections,
                                     refusal=refusal_frame, fallback_port=fallback_port, tls=tls, errors=errors)
        self.port: int = self._listener.port

    def start(self) -> DataPortServer:
        self._listener.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, wait for their threads (they release their leases)."""
        self._listener.stop(timeout)

    @property
    def connections(self) -> int:
        return self._listener.connections

    def waiting_connections(self) -> int:
        return self._listener.waiting_connections()

    # -- GET -------------------------------------------------------------------------------------------

    def _get(self, request: node_pb2.GetRequest, stream: Stream) -> None:
        start = time.perf_counter()
        core = self.core
        packed = core.stored_packed(request.keys)
        count = len(packed) // KEY_BYTES
        stream.serving()
        sizes = np.zeros(count, dtype=np.uint64)
        sums = np.zeros(count, dtype=np.uint64)
        tiers = np.full(count, NO_TIER, dtype=np.uint8)
        valid = np.zeros(count, dtype=np.uint8)
        slots = np.zeros(count, dtype=np.int64)
        gens = np.zeros(count, dtype=np.uint64)
        for lo in range(0, count, GET_BATCH_KEYS):  # per-key Python objects for one batch at a time
            core.read_refs(_unpack(packed, lo, min(count, lo + GET_BATCH_KEYS)), lo, sizes, sums, tiers, slots, gens)
        total, limit = int(sizes.sum()), max(MAX_GET_BYTES, self.max_request_bytes)
        if total > limit:
            raise ValueError(f"a GET of {total} bytes; the limit is {limit} per request")
        trailer_bytes = node_pb2.BulkGetTrailer(valid=bytes(count)).ByteSize()  # its flags: once the bytes went out
        stream.begin_reply(node_pb2.BulkGetReply(tiers=tiers.tobytes(), sizes=sizes.tolist(), checksums=sums.tolist()),
                           total, trailer_bytes)
        pending: list[Any] = []  # buffers gathered for the next sendmsg
        hits = np.flatnonzero(tiers != NO_TIER)
        ssd = np.flatnonzero(tiers == _SSD).tolist()
        loaded: dict[int, np.ndarray] = {}  # SSD key index -> scratch with its bytes
        next_ssd = 0
        scratch: np.ndarray | None = None  # taken from the core's pool, given back when replaced or done
        try:
            for i, tier in zip(hits.tolist(), tiers[hits].tolist()):
                if tier == _DRAM:
                    pending.append(core.block_bytes(int(slots[i]), int(sizes[i])))
                    if len(pending) >= IOV_MAX:  # a sendmsg's worth: few views alive at once
                        stream.send(pending)
                        pending.clear()
                    continue
                if i not in loaded:  # an SSD block not loaded yet: the next run of them goes into scratch
                    stream.send(pending)  # scratch is about to be replaced
                    pending.clear()
                    loaded.clear()
                    if scratch is not None:
                        core.scratch.give(scratch)
                        scratch = None
                    next_ssd, scratch = self._load_ssd(packed, ssd, next_ssd, sizes, loaded, valid)
                pending.append(loaded[i])
            stream.send(pending)
            pending.clear()
        finally:
            loaded.clear()
            if scratch is not None:
                core.scratch.give(scratch)
        sent_dram = np.flatnonzero(tiers == _DRAM)
        valid[sent_dram[core.end_read(slots[sent_dram], gens[sent_dram], sizes[sent_dram])]] = 1
        trailer = node_pb2.BulkGetTrailer(valid=valid.tobytes()).SerializeToString()
        assert len(trailer) == trailer_bytes, "node wire: a GET trailer of another size than announced"
        stream.send([trailer])
        for lo in range(0, count, GET_BATCH_KEYS):
            core.touch(_unpack(packed, lo, min(count, lo + GET_BATCH_KEYS)))
        if self.get_seconds is not None:
            self.get_seconds.observe(time.perf_counter() - start)

    def _load_ssd(self, packed: bytes, ssd: list[int], pos: int, sizes: np.ndarray,
                  loaded: dict[int, np.ndarray], valid: np.ndarray) -> tuple[int, np.ndarray]:
        """Read the next run of SSD-resident blocks (at most SCRATCH_BYTES, at least one) into scratch.

        Returns the next position in ``ssd`` and the scratch buffer (the caller gives it back).
        """
        run: list[int] = []
        total = 0
        while pos < len(ssd) and (not run or total + int(sizes[ssd[pos]]) <= SCRATCH_BYTES):
            run.append(ssd[pos])
            total += int(sizes[ssd[pos]])
            pos += 1
        scratch = self.core.scratch.take(total)
        offset = 0
        for i in run:
            n = int(sizes[i])
            loaded[i] = scratch[offset : offset + n]
            offset += n
        keys = [BlockKey(packed[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in run]
        served = self.core.load(keys, [loaded[i] for i in run])  # promotes into DRAM
        for i, tier in zip(run, served):
            valid[i] = tier is not None  # a miss: the (unspecified) scratch bytes go out flagged invalid
        return pos, scratch

    # -- PUT -------------------------------------------------------------------------------------------

    def _put(self, request: node_pb2.BulkPutRequest, stream: Stream) -> None:
        start = time.perf_counter()
        core = self.core
        keys = core.keys(request.keys)
        count = len(keys)
        sizes, sums = list(request.sizes), list(request.checksums)
        if not len(sizes) == len(sums) == count:
            raise ValueError(f"{count} keys, {len(sizes)} sizes and {len(sums)} checksums: need one each per key")
        core.check_sizes(sizes)
        if sum(sizes) != stream.payload_left:
            raise ValueError(f"sizes sum to {sum(sizes)} bytes but the payload holds {stream.payload_left}")
        with core.request_lease(keys, sizes) as leased:  # ends with the request, whatever happens to it
            stored = leased.held[:]
            self._receive(stream, keys, sizes, sums, leased.slots, stored, leased.refused)
            stream.serving()
            for i, good in core.commit_request(leased, keys, sizes, sums).items():
                stored[i] = good
        core.trim(keys)
        stream.begin_reply(node_pb2.PutResponse(stored=bytes(np.fromiter(stored, dtype=np.uint8, count=count))))
        stream.send()
        if self.put_seconds is not None:
            self.put_seconds.observe(time.perf_counter() - start)

    def _receive(self, stream: Stream, keys: list[BlockKey], sizes: list[int], sums: list[int],
                 slot_of: dict[int, tuple[int, int]], stored: list[bool], refused: set[int]) -> None:
        """Receive the payload: reserved blocks into their slots, held and refused ones discarded, the rest via
        scratch."""
        plan: list[Any] = []
        scratch: list[tuple[int, np.ndarray]] = []
        scratch_bytes = 0
        discard = np.empty(0, dtype=np.uint8)

        def flush() -> None:
            nonlocal scratch_bytes
            stream.recv_payload(plan)
            plan.clear()
            if scratch:
                idx = [i for i, _ in scratch]
                ok = self.core.put([keys[i] for i in idx], [b for _, b in scratch], [sums[i] for i in idx])
                for i, good in zip(idx, ok):
                    stored[i] = good
                scratch.clear()
                scratch_bytes = 0

        for i, n in enumerate(sizes):
            if i in slot_of:
                plan.append(self.core.block_bytes(slot_of[i][0], n))
            elif stored[i] or i in refused:  # held already, or over quota: read past its bytes, a piece at a time
                if discard.size < min(n, DISCARD_BYTES):
                    discard = np.empty(DISCARD_BYTES, dtype=np.uint8)
                plan += [discard[: min(DISCARD_BYTES, n - o)] for o in range(0, n, DISCARD_BYTES)]
            else:
                if scratch and scratch_bytes + n > SCRATCH_BYTES:
                    flush()
                buf = np.empty(n, dtype=np.uint8)
                scratch.append((i, buf))
                scratch_bytes += n
                plan.append(buf)
        flush()
