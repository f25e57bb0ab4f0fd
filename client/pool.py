"""PoolClient: the pool as seen from one worker process (no torch here; buffers only).

Every pool failure (timeout, dead node, block gone or reused, checksum
mismatch, master down) becomes a miss counted in ``kvpool_errors_total{kind}``:
never an exception on the engine's path. ``strict=True`` (tests) raises
:class:`PoolFault` instead. Caller misuse (wrong sizes, malformed keys) is a
ValueError either way.

Data paths for one block:
- same host (the node's ``host_id`` equals ours): ask the node to ``Locate``
  (promoting SSD blocks into DRAM), then copy straight out of its
  shared-memory arena, verifying generation and checksum;
- otherwise, or if the slot was reused meanwhile: the node's ``Get`` RPC.
Bytes are accepted only if their checksum equals the one the master
published for the block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from kvpool.client.lookup import BlockLocation, NodeAddress
from kvpool.client.writer import WriteBehindQueue
from kvpool.buffers import BufferLike, as_array
from kvpool.checksum import block_checksum, copy_with_checksum
from kvpool.config import ClientConfig
from kvpool.keys import BlockKey, check_keys, pack_keys
from kvpool.metrics import ErrorMetrics, LookupMetrics, MetricsServer, latency_histogram
from kvpool.rpc import MISS, channel_options, flags_from_bytes, local_host_id
from kvpool.tiers.arena import SharedArena, SlotRef
from kvpool.tiers.base import Tier
from kvpool.v1 import master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
CHUNK_BYTES = 32 << 20  # bytes per Get/Put call


class PoolFault(RuntimeError):
    """A pool failure, raised only in strict mode (otherwise it is a counted miss)."""


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout"
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unavailable"
        return code.name.lower() if code is not None else "rpc"
    return type(exc).__name__.lower()


def _chunks(indexes: Sequence[int], sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """Split ``indexes`` into runs whose sizes add up to at most ``limit`` (at least one each)."""
    run: list[int] = []
    total = 0
    for i in indexes:
        if run and total + sizes[i] > limit:
            yield run
            run, total = [], 0
        run.append(i)
        total += sizes[i]
    if run:
        yield run


class PoolClient:
    """Lookup, get, put and exists against a kvpool master and its nodes."""

    def __init__(self, config: ClientConfig, registry: CollectorRegistry | None = None):
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.host_id = local_host_id()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.lookup_metrics = LookupMetrics(self.registry)
        self.errors = ErrorMetrics(self.registry)
        self._lookup_seconds = latency_histogram(self.registry, "lookup", "Pool lookup latency (one master call)")
        self._get_seconds = latency_histogram(self.registry, "get", "Pool get latency (one batch)")
        self._put_seconds = latency_histogram(self.registry, "put", "Pool put latency (one write-behind batch)")
        options = channel_options(MAX_MESSAGE_BYTES)
        self._master_channel = grpc.insecure_channel(config.master, options=options)
        self._master = master_pb2_grpc.MasterStub(self._master_channel)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._nodes: dict[str, node_pb2_grpc.NodeStub] = {}
        self._arenas: dict[str, SharedArena | None] = {}
        self._writer = WriteBehindQueue(self._put_now, config.put_queue_blocks)
        self._metrics_server = MetricsServer(self.registry, config.metrics_port) if config.metrics_port > 0 else None

    # -- faults --------------------------------------------------------------------

    def _fault(self, kind: str, detail: object, n: int = 1) -> None:
        """Count ``n`` blocks lost to one pool failure; raise only in strict mode."""
        self.errors.count(kind, n)
        log.debug("pool fault (%s): %s", kind, detail)
        if self.config.strict:
            raise PoolFault(f"{kind}: {detail}")

    # -- master calls ----------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> tuple[BlockLocation, ...]:
        """The leading run of ``keys`` the pool holds, with locations; () if the master fails."""
        packed = pack_keys(keys)
        keys = check_keys(keys)
        request = master_pb2.LookupRequest(
            keys=packed, worker_id=self.worker_id, hbm_prefix_blocks=hbm_prefix_blocks, block_tokens=block_tokens
        )
        start = time.perf_counter()
        try:
            reply = self._master.Lookup(request, timeout=self.config.lookup_timeout_s)
        except grpc.RpcError as exc:
            self._fault(_error_kind(exc), exc, len(keys))
            return ()
        finally:
            self._lookup_seconds.observe(time.perf_counter() - start)
        nodes = [NodeAddress(n.node_id, n.address, n.host_id, n.arena) for n in reply.nodes]
        run = len(reply.tiers)
        if not (len(reply.node_indexes) == len(reply.sizes) == len(reply.checksums) == run <= len(keys)):
            self._fault("bad_reply", "lookup reply fields disagree", len(keys))
            return ()
        return tuple(
            BlockLocation(keys[i], Tier(reply.tiers[i]), nodes[reply.node_indexes[i]], reply.sizes[i], reply.checksums[i])
            for i in range(run)
        )

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether the pool holds each key; all False if the master cannot be asked."""
        packed = pack_keys(keys)
        try:
            reply = self._master.Exists(master_pb2.ExistsRequest(keys=packed), timeout=self.config.lookup_timeout_s)
        except grpc.RpcError as exc:
            self._fault(_error_kind(exc), exc, len(keys))
            return [False] * len(keys)
        return flags_from_bytes(reply.present)

    def report_hbm(
        self, added: Sequence[BlockKey], removed: Sequence[BlockKey], *,
        hbm_only_lookups: int = 0, hbm_only_blocks: int = 0, block_tokens: int = 0, wait: bool = True,
    ) -> None:
        """Tell the master what this worker's HBM tier gained and lost, and the lookups HBM answered alone.

        Stats only, best effort; with ``wait=False`` the call does not block.
        """
        request = master_pb2.ReportHbmRequest(
            worker_id=self.worker_id, added_keys=pack_keys(added), removed_keys=pack_keys(removed),
            hbm_only_lookups=hbm_only_lookups, hbm_only_blocks=hbm_only_blocks, block_tokens=block_tokens,
        )
        if not wait:
            future = self._master.ReportHbm.future(request, timeout=self.config.lookup_timeout_s)
            future.add_done_callback(lambda f: f.exception() and self.errors.count(_error_kind(f.exception())))
            return
        try:
            self._master.ReportHbm(request, timeout=self.config.lookup_timeout_s)
        except grpc.RpcError as exc:
            self.errors.count(_error_kind(exc))

    # -- reads -------------------------------------------------------------------------

    def _node(self, address: str) -> node_pb2_grpc.NodeStub:
        with self._lock:
            stub = self._nodes.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=channel_options(MAX_MESSAGE_BYTES))
                self._channels[address] = channel
                stub = self._nodes[address] = node_pb2_grpc.NodeStub(channel)
            return stub

    def _arena(self, node: NodeAddress) -> SharedArena | None:
        """The node's arena mapped here, or None if it is on another host or cannot be mapped."""
        if not self.config.shared_memory or node.host_id != self.host_id or not node.arena:
            return None
        with self._lock:
            if node.arena not in self._arenas:
                try:
                    self._arenas[node.arena] = SharedArena.attach(node.arena)
                except (OSError, ValueError) as exc:
                    log.warning("cannot map arena %s of node %s (%s); using the network", node.arena, node.node_id, exc)
                    self._arenas[node.arena] = None
            return self._arenas[node.arena]

    def get_into(self, locations: Sequence[BlockLocation], outs: Sequence[BufferLike]) -> list[bool]:
        """Copy each located block into its output; per block, whether it arrived intact."""
        if len(locations) != len(outs):
            raise ValueError(f"{len(locations)} locations but {len(outs)} buffers")
        dsts = [as_array(o, writable=True) for o in outs]
        for loc, dst in zip(locations, dsts):
            if dst.size != loc.size:
                raise ValueError(f"output is {dst.size} bytes, block {loc.key.hex()[:16]} is {loc.size}")
        start = time.perf_counter()
        ok = [False] * len(locations)
        by_node: dict[NodeAddress, list[int]] = defaultdict(list)
        for i, loc in enumerate(locations):
            by_node[loc.node].append(i)
        for node, idxs in by_node.items():
            arena = self._arena(node)
            if arena is not None:
                self._get_shared(node, arena, idxs, locations, dsts, ok)
            self._get_remote(node, [i for i in idxs if not ok[i]], locations, dsts, ok)
        self._get_seconds.observe(time.perf_counter() - start)
        return ok

    def _get_shared(self, node: NodeAddress, arena: SharedArena, idxs: list[int],
                    locations: Sequence[BlockLocation], dsts: list[np.ndarray], ok: list[bool]) -> None:
        """Same-host path: Locate, then read the arena; what fails here is retried remotely."""
        request = node_pb2.LocateRequest(keys=pack_keys([locations[i].key for i in idxs]), promote=True)
        try:
            reply = self._node(node.address).Locate(request, timeout=self.config.io_timeout_s)
        except grpc.RpcError as exc:
            self.errors.count(_error_kind(exc), len(idxs))
            return
        if reply.arena != arena.name or len(reply.slots) != len(idxs):
            return
        for j, i in enumerate(idxs):
            loc = locations[i]
            gen = reply.slot_gens[j]
            if gen == 0 or reply.sizes[j] != loc.size or reply.checksums[j] != loc.checksum:
                continue
            ref = SlotRef(int(reply.slots[j]), int(gen), int(loc.size))
            if arena.read_into(ref, loc.key, dsts[i]):
                ok[i] = True
            else:
                self.errors.count("slot_reused")

    def _get_remote(self, node: NodeAddress, idxs: list[int],
                    locations: Sequence[BlockLocation], dsts: list[np.ndarray], ok: list[bool]) -> None:
        sizes = [loc.size for loc in locations]
        for run in _chunks(idxs, sizes, CHUNK_BYTES):
            request = node_pb2.GetRequest(keys=pack_keys([locations[i].key for i in run]))
            try:
                reply = self._node(node.address).Get(request, timeout=self.config.io_timeout_s)
            except grpc.RpcError as exc:
                self._fault(_error_kind(exc), exc, len(run))
                continue
            data = np.frombuffer(reply.data, dtype=np.uint8)
            offset = 0
            for j, i in enumerate(run):
                if j >= len(reply.tiers) or reply.tiers[j] == MISS:
                    self._fault("block_gone", locations[i].key.hex()[:16])
                    continue
                size = reply.sizes[j]
                piece = data[offset : offset + size]
                offset += size
                if size != locations[i].size or reply.checksums[j] != locations[i].checksum:
                    self._fault("block_changed", locations[i].key.hex()[:16])
                    continue
                if copy_with_checksum(dsts[i], piece) != locations[i].checksum:
                    self._fault("checksum", locations[i].key.hex()[:16])
                    continue
                ok[i] = True

    # -- writes ------------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Queue blocks for the pool (copied now, written in the background); per block, accepted."""
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} buffers")
        accepted = self._writer.submit(keys, values)
        dropped = accepted.count(False)
        if dropped:
            self.errors.count("queue_full", dropped)
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block has been written (or dropped); False on timeout."""
        return self._writer.flush(timeout)

    def _put_now(self, keys: list[BlockKey], arrays: list[np.ndarray]) -> None:
        """The write-behind sink: ask the master where, then send each node its blocks."""
        start = time.perf_counter()
        sizes = [int(a.size) for a in arrays]
        try:
            placed = self._master.PlaceBlocks(
                master_pb2.PlaceBlocksRequest(keys=pack_keys(keys), sizes=sizes), timeout=self.config.lookup_timeout_s
            )
        except grpc.RpcError as exc:
            self.errors.count(_error_kind(exc), len(keys))
            return
        present = flags_from_bytes(placed.present)
        by_node: dict[int, list[int]] = defaultdict(list)
        for i in range(len(keys)):
            if not present[i]:
                by_node[placed.node_indexes[i]].append(i)
        for node_index, idxs in by_node.items():
            address = placed.nodes[node_index].address
            for run in _chunks(idxs, sizes, CHUNK_BYTES):
                request = node_pb2.PutRequest(
                    keys=pack_keys([keys[i] for i in run]),
                    sizes=[sizes[i] for i in run],
                    data=b"".join(arrays[i].data for i in run),
                    checksums=[block_checksum(arrays[i]) for i in run],
                )
                try:
                    reply = self._node(address).Put(request, timeout=self.config.io_timeout_s)
                except grpc.RpcError as exc:
                    self.errors.count(_error_kind(exc), len(run))
                    continue
                refused = flags_from_bytes(reply.stored).count(False)
                if refused:
                    self.errors.count("put_refused", refused)
        self._put_seconds.observe(time.perf_counter() - start)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Drain the write-behind queue (briefly), then close channels and unmap arenas."""
        self._writer.close()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._nodes.clear()
            for arena in self._arenas.values():
                if arena is not None:
                    arena.close()
            self._arenas.clear()
        self._master_channel.close()
        if self._metrics_server is not None:
            self._metrics_server.close()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
