"""PoolClient: the pool as seen from one worker process (no torch here; buffers only).

Every pool failure (timeout, dead node, block gone or reused, checksum
mismatch, master down) becomes a miss counted in ``kvpool_errors_total{kind}``:
never an exception on the engine's path. ``strict=True`` (tests) raises
:class:`PoolFault` instead. Caller misuse (wrong sizes, malformed keys) is a
ValueError either way.

Data paths, per node, a batch at a time:
- reads on the same host (the node's ``host_id`` equals ours): copy
  straight out of its shared-memory arena into the caller's buffers,
  verifying generation and checksum. Slots come from hints (where this
  client wrote or found a block before, checked against the slot's row
  before use) or from ``Locate`` (promoting SSD blocks into DRAM); blocks
  whose slot was reused meanwhile go the remote way;
- writes on the same host: ``Reserve`` slots, copy the caller's bytes into
  them while checksumming (:func:`~kvpool.checksum.copy_with_checksum`),
  ``Commit``; blocks that got no slot (too large, no room) go the remote way;
- remote: the node's bulk TCP listener (:mod:`kvpool.client.bulk`), which
  receives straight into the caller's buffers and sends straight from them;
- the gRPC ``Get``/``Put`` only if the bulk listener cannot be reached (it is
  then skipped for ``BULK_RETRY_S``).
Bytes are accepted only if their checksum equals the one the master
published for the block. A node's bulk address comes with its NodeRef, or
from the node's ``Info`` once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from kvpool.calls import MASTER_CALLS, NODE_CALLS, FastStub, MasterCallAddress
from kvpool.client.bulk import CHANGED, CORRUPT, GONE, OK, BulkClient, BulkFailed, BulkUnavailable
from kvpool.client.lookup import EMPTY_RUN, BlockLocation, NodeAddress, PoolRun
from kvpool.client.writer import WriteBehindQueue
from kvpool.buffers import BufferLike, as_array, byte_view
from kvpool.checksum import block_checksum, copy_with_checksum
from kvpool.config import ClientConfig
from kvpool.framing import ConnectionPool
from kvpool.keys import BlockKey, check_keys, pack_keys
from kvpool.metrics import ErrorMetrics, LookupMetrics, MetricsServer, latency_histogram
from kvpool.rpc import MISS, channel_options, flags_from_bytes, local_host_id
from kvpool.tiers.arena import SharedArena
from kvpool.tiers.base import Tier
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
CHUNK_BYTES = 32 << 20  # bytes per gRPC Get/Put call
BULK_CHUNK_BYTES = 256 << 20  # bytes per bulk PUT or Reserve/Commit lease (a lease must finish in time)
MAX_KEYS = 65536  # keys per node call (the node's limit)
BULK_RETRY_S = 5.0  # a node whose bulk listener could not be reached is sent gRPC calls this long


_TIER_BYTES = frozenset(int(t) for t in Tier)
_MASTER_SERVICE = master_pb2.DESCRIPTOR.services_by_name["Master"]
_NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"]
T = TypeVar("T")


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


def _chunks(indexes: Sequence[int], sizes: Sequence[int], limit: int, max_keys: int = MAX_KEYS) -> Iterator[list[int]]:
    """Split ``indexes`` into runs of at most ``max_keys`` whose sizes add up to at most ``limit``.

    Each run holds at least one index.
    """
    run: list[int] = []
    total = 0
    for i in indexes:
        if run and (total + sizes[i] > limit or len(run) >= max_keys):
            yield run
            run, total = [], 0
        run.append(i)
        total += sizes[i]
    if run:
        yield run


def _check_rows(arena: SharedArena, slots: np.ndarray, keys: np.ndarray, sizes: np.ndarray,
                sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gens of ``slots`` (read first: the seqlock's "before") and whether each row holds exactly that block."""
    valid = (slots >= 0) & (slots < arena.num_slots)
    safe = np.where(valid, slots, 0)
    table = arena.table
    gens = table["gen"][safe]
    held = valid & (gens % 2 == 0) & (table["key"][safe] == keys)
    held &= (table["length"][safe] == sizes) & (table["checksum"][safe] == sums)
    return gens, held


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
        master_stub = master_pb2_grpc.MasterStub(self._master_channel)
        self._calls = ConnectionPool(config.io_timeout_s, connect_timeout_s=min(config.io_timeout_s, 2.0))
        master_calls = MasterCallAddress(master_stub, config.master, config.lookup_timeout_s)
        self._master = FastStub(master_stub, _MASTER_SERVICE, MASTER_CALLS, self._calls, master_calls,
                                on_unreachable=master_calls.forget, max_reply_bytes=MAX_MESSAGE_BYTES)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._nodes: dict[str, FastStub] = {}
        self._arenas: dict[str, SharedArena | None] = {}
        self._slot_hints: dict[str, dict[BlockKey, int]] = {}  # arena -> key -> slot it was seen in
        self._closing = threading.Event()
        self._populating: list[threading.Thread] = []
        self._bulk = BulkClient(config.io_timeout_s, connect_timeout_s=min(config.io_timeout_s, 2.0))
        self._data_addresses: dict[str, str] = {}  # node gRPC address -> bulk address ("" : none)
        self._bulk_down: dict[str, float] = {}  # node gRPC address -> monotonic time to try bulk again
        self._writer = WriteBehindQueue(self._put_now, config.put_queue_bytes)
        self._metrics_server = MetricsServer(self.registry, config.metrics_port) if config.metrics_port > 0 else None

    # -- faults --------------------------------------------------------------------

    def _fault(self, kind: str, detail: object, n: int = 1) -> None:
        """Count ``n`` blocks lost to one pool failure; raise only in strict mode."""
        self.errors.count(kind, n)
        log.debug("pool fault (%s): %s", kind, detail)
        if self.config.strict:
            raise PoolFault(f"{kind}: {detail}")

    # -- master calls ----------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> PoolRun:
        """The leading run of ``keys`` the pool holds, with locations; empty if the master fails."""
        keys = check_keys(keys)
        request = master_pb2.LookupRequest(
            keys=b"".join(keys), worker_id=self.worker_id, hbm_prefix_blocks=hbm_prefix_blocks, block_tokens=block_tokens
        )
        start = time.perf_counter()
        try:
            reply = self._master.Lookup(request, timeout=self.config.lookup_timeout_s)
        except grpc.RpcError as exc:
            self._fault(_error_kind(exc), exc, len(keys))
            return EMPTY_RUN
        finally:
            self._lookup_seconds.observe(time.perf_counter() - start)
        if reply.nodes:
            self._learn(reply.nodes)
        run = len(reply.tiers)
        nodes = [NodeAddress(n.node_id, n.address, n.host_id, n.arena) for n in reply.nodes]
        if not (len(reply.node_indexes) == len(reply.sizes) == len(reply.checksums) == run <= len(keys)):
            self._fault("bad_reply", "lookup reply fields disagree", len(keys))
            return EMPTY_RUN
        if not set(reply.tiers) <= _TIER_BYTES or max(reply.node_indexes, default=-1) >= len(nodes):
            self._fault("bad_reply", "lookup reply names an unknown tier or node", len(keys))
            return EMPTY_RUN
        return PoolRun(keys[:run], reply.tiers, reply.node_indexes, nodes, reply.sizes, reply.checksums)

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

    # -- nodes ---------------------------------------------------------------------------

    def _node(self, address: str) -> FastStub:
        """The node's stub: Locate, Reserve and Commit over fast calls on its bulk listener, the rest gRPC."""
        with self._lock:
            stub = self._nodes.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=channel_options(MAX_MESSAGE_BYTES))
                self._channels[address] = channel
                stub = self._nodes[address] = FastStub(
                    node_pb2_grpc.NodeStub(channel), _NODE_SERVICE, NODE_CALLS, self._calls,
                    lambda: self._data_address(address), on_unreachable=lambda: self._bulk_unreachable(address),
                    max_reply_bytes=MAX_MESSAGE_BYTES,
                )
            return stub

    def _arena(self, node: NodeAddress) -> SharedArena | None:
        """The node's arena mapped here, or None if it is on another host or cannot be mapped."""
        if not self.config.shared_memory or node.host_id != self.host_id or not node.arena:
            return None
        with self._lock:
            cached = self._arenas.get(node.arena)
            if cached is not None and not cached.is_current():  # the node restarted: map its new segment
                del self._arenas[node.arena]  # not closed: another thread may still be copying through it
                self._slot_hints.pop(node.arena, None)
            if node.arena not in self._arenas:
                try:
                    arena = self._arenas[node.arena] = SharedArena.attach(node.arena)
                except (OSError, ValueError) as exc:
                    log.warning("cannot map arena %s of node %s (%s); using the network", node.arena, node.node_id, exc)
                    self._arenas[node.arena] = None
                else:  # first touches fault pages in: take that cost in the background, once
                    thread = threading.Thread(target=arena.populate, args=(self._closing,), daemon=True,
                                              name=f"kvpool-map-{node.arena}")
                    thread.start()
                    self._populating.append(thread)
            return self._arenas[node.arena]

    def _learn(self, nodes: Sequence[common_pb2.NodeRef]) -> None:
        """Remember the bulk addresses nodes advertise."""
        with self._lock:
            for n in nodes:
                if n.data_address:
                    self._data_addresses[n.address] = n.data_address

    def _data_address(self, address: str) -> str | None:
        """Where the node at gRPC ``address`` takes bulk requests; None: use gRPC (none, or down lately)."""
        with self._lock:
            if self._bulk_down.get(address, 0.0) > time.monotonic():
                return None
            known = self._data_addresses.get(address)
        if known is None:
            try:
                info = self._node(address).Info(node_pb2.InfoRequest(), timeout=self.config.lookup_timeout_s)
            except grpc.RpcError as exc:
                log.debug("no Info from node %s (%s); using gRPC", address, _error_kind(exc))
                self._bulk_unreachable(address)
                return None
            known = info.node.data_address
            with self._lock:
                self._data_addresses[address] = known
        return known or None

    def _bulk_unreachable(self, address: str) -> None:
        with self._lock:
            self._bulk_down[address] = time.monotonic() + BULK_RETRY_S
            self._data_addresses.pop(address, None)  # ask again next time: the node may have restarted

    # -- reads ---------------------------------------------------------------------------

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
                idxs = [i for i in idxs if not ok[i]]
            if idxs:
                idxs = self._get_bulk(node, idxs, locations, dsts, ok)
            if idxs:
                self._get_remote(node, idxs, locations, dsts, ok)
        self._get_seconds.observe(time.perf_counter() - start)
        return ok

    def _get_shared(self, node: NodeAddress, arena: SharedArena, idxs: list[int],
                    locations: Sequence[BlockLocation], dsts: list[np.ndarray], ok: list[bool]) -> None:
        """Same-host path: copy straight out of the arena; what fails here is retried remotely.

        Which slot holds a block comes from this client's slot hints (blocks
        it wrote or located before) or, for the rest, from one ``Locate``
        call (which also promotes SSD blocks into DRAM). A slot is read only
        if its row (even gen, key, length, checksum) names exactly the block
        asked for, and a copy counts only if its checksum matches and the gen
        did not move meanwhile (the arena's seqlock): a stale hint is a
        Locate, never wrong bytes. The checks run over the whole batch at
        once; only the copy-and-hash is per block.
        """
        n = len(idxs)
        packed = pack_keys([locations[i].key for i in idxs])
        keys = np.frombuffer(packed, dtype=arena.table.dtype["key"])
        sizes = np.fromiter((locations[i].size for i in idxs), dtype=np.uint64, count=n)
        sums = np.fromiter((locations[i].checksum for i in idxs), dtype=np.uint64, count=n)
        hints = self._slot_hints_of(arena)
        slots = np.fromiter((hints.get(locations[i].key, -1) for i in idxs), dtype=np.int64, count=n)
        gens, cand = _check_rows(arena, slots, keys, sizes, sums)
        missing = np.flatnonzero(~cand)
        if missing.size:
            found = self._locate(node, arena, packed if missing.size == n else keys[missing].tobytes(), missing.size)
            if found is not None:
                slots[missing] = found
                for j in missing[found >= 0].tolist():
                    hints[locations[idxs[j]].key] = int(slots[j])
                gens[missing], cand[missing] = _check_rows(arena, slots[missing], keys[missing], sizes[missing],
                                                           sums[missing])
        copied = np.zeros(n, dtype=bool)
        data = arena.data
        for j in np.flatnonzero(cand).tolist():
            i = idxs[j]
            copied[j] = copy_with_checksum(dsts[i], data[slots[j], : locations[i].size]) == locations[i].checksum
        copied &= arena.gens[np.where(cand, slots, 0)] == gens  # not reused while we copied
        reused = int(cand.sum() - copied.sum())
        if reused:
            self.errors.count("slot_reused", reused)
        for j in np.flatnonzero(copied).tolist():
            ok[idxs[j]] = True

    def _locate(self, node: NodeAddress, arena: SharedArena, packed: bytes, n: int) -> np.ndarray | None:
        """Per key the node's slot for it (-1: not in DRAM), promoting SSD blocks; None if the call failed."""
        request = node_pb2.LocateRequest(keys=packed, promote=True)
        try:
            reply = self._node(node.address).Locate(request, timeout=self.config.io_timeout_s)
        except grpc.RpcError as exc:
            self.errors.count(_error_kind(exc), n)
            return None
        if reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) == n:
            return None
        slots = np.array(reply.slots, dtype=np.int64)
        return np.where(np.array(reply.slot_gens, dtype=np.uint64) != 0, slots, -1)

    def _slot_hints_of(self, arena: SharedArena) -> dict[BlockKey, int]:
        """Where this client last saw blocks in ``arena`` (guesses, checked on use; bounded)."""
        hints = self._slot_hints.setdefault(arena.name, {})
        if len(hints) > 2 * arena.num_slots:
            hints.clear()
        return hints

    def _bulk_call(self, node: NodeAddress, n: int, call: Callable[..., T], *args: Any) -> T | None:
        """One bulk request; None (try gRPC for these ``n`` blocks) if the listener is down or the call failed."""
        try:
            return call(*args)
        except BulkUnavailable as exc:
            log.debug("bulk listener of %s unreachable (%s); using gRPC", node.address, exc)
            self._bulk_unreachable(node.address)
        except BulkFailed as exc:
            log.debug("bulk %s with %s failed (%s); using gRPC", call.__name__, node.address, exc)
            self.errors.count("bulk_fallback", n)
        return None

    def _get_bulk(self, node: NodeAddress, idxs: list[int], locations: Sequence[BlockLocation],
                  dsts: list[np.ndarray], ok: list[bool]) -> list[int]:
        """Remote path over the node's bulk listener; returns the blocks to try over gRPC instead."""
        data_address = self._data_address(node.address)
        if data_address is None:
            return idxs
        for start in range(0, len(idxs), MAX_KEYS):
            run = idxs[start : start + MAX_KEYS]
            status = self._bulk_call(node, len(run), self._bulk.get_into, data_address,
                                     [locations[i].key for i in run], [dsts[i] for i in run],
                                     [locations[i].checksum for i in run])
            if status is None:
                return idxs[start:]
            for i, st in zip(run, status):
                if st == OK:
                    ok[i] = True
                elif st == GONE:
                    self._fault("block_gone", locations[i].key.hex()[:16])
                elif st == CHANGED:
                    self._fault("block_changed", locations[i].key.hex()[:16])
                elif st == CORRUPT:
                    self._fault("checksum", locations[i].key.hex()[:16])
        return []

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
        for i, v in enumerate(values):
            if byte_view(v).nbytes == 0:
                raise ValueError(f"block {i} is empty")
        accepted = self._writer.submit(keys, values)
        dropped = accepted.count(False)
        if dropped:
            self.errors.count("queue_full", dropped)
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block has been written (or dropped); False on timeout."""
        return self._writer.flush(timeout)

    def _put_now(self, keys: list[BlockKey], arrays: list[np.ndarray]) -> None:
        """The write-behind sink."""
        self.store(keys, arrays)

    def store(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Write blocks to the pool now (synchronously); per block, whether the pool holds it afterwards.

        The master places each new block on one node (blocks it already holds
        count as stored); each node gets its blocks in one batch by the
        fastest path it offers (see the module docstring). A pool fault is a
        False, counted in the error metrics; misuse (bad keys, empty or
        mismatched buffers) is a ValueError.
        """
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} buffers")
        arrays = [as_array(v) for v in values]
        for i, a in enumerate(arrays):
            if a.size == 0:
                raise ValueError(f"block {i} is empty")
        start = time.perf_counter()
        try:
            return self._store(keys, arrays)
        finally:
            self._put_seconds.observe(time.perf_counter() - start)

    def _store(self, keys: list[BlockKey], arrays: list[np.ndarray]) -> list[bool]:
        result = [False] * len(keys)
        first: dict[BlockKey, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        uniq = list(first.values())
        sizes = [int(a.size) for a in arrays]
        try:
            placed = self._master.PlaceBlocks(
                master_pb2.PlaceBlocksRequest(keys=pack_keys([keys[i] for i in uniq]), sizes=[sizes[i] for i in uniq]),
                timeout=self.config.lookup_timeout_s,
            )
        except grpc.RpcError as exc:
            self.errors.count(_error_kind(exc), len(uniq))
            return result
        if not len(placed.present) == len(placed.node_indexes) == len(uniq) or \
                any(n >= len(placed.nodes) for n in placed.node_indexes):
            self.errors.count("bad_reply", len(uniq))
            return result
        self._learn(placed.nodes)
        nodes = [NodeAddress(n.node_id, n.address, n.host_id, n.arena) for n in placed.nodes]
        by_node: dict[int, list[int]] = defaultdict(list)
        for j, i in enumerate(uniq):
            if placed.present[j]:
                result[i] = True
            else:
                by_node[placed.node_indexes[j]].append(i)
        for node_index, idxs in by_node.items():
            node = nodes[node_index]
            arena = self._arena(node)
            if arena is not None:
                idxs = self._put_shared(node, arena, idxs, keys, arrays, sizes, result)
            if idxs:
                idxs = self._put_bulk(node, idxs, keys, arrays, sizes, result)
            if idxs:
                self._put_grpc(node, idxs, keys, arrays, sizes, result)
        return [result[first[k]] for k in keys]

    def _put_shared(self, node: NodeAddress, arena: SharedArena, idxs: list[int], keys: list[BlockKey],
                    arrays: list[np.ndarray], sizes: list[int], result: list[bool]) -> list[int]:
        """Same-host path: Reserve, copy into the slots, Commit; returns the blocks to send another way."""
        stub = self._node(node.address)
        left: list[int] = []
        for run in _chunks(idxs, sizes, BULK_CHUNK_BYTES):
            request = node_pb2.ReserveRequest(keys=pack_keys([keys[i] for i in run]), sizes=[sizes[i] for i in run])
            try:
                reply = stub.Reserve(request, timeout=self.config.io_timeout_s)
            except grpc.RpcError as exc:
                log.debug("Reserve on %s failed (%s); sending the blocks another way", node.address, _error_kind(exc))
                left += run
                continue
            if reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) == len(run) or \
                    len(reply.already_held) != len(run):
                self.errors.count("bad_reply")
                left += run
                continue
            gens = np.array(reply.slot_gens, dtype=np.uint64)
            slots = np.array(reply.slots, dtype=np.int64)
            usable = (gens != 0) & (slots >= 0) & (slots < arena.num_slots)
            usable &= arena.gens[np.where(usable, slots, 0)] == gens  # still our turn on the slot
            held = np.frombuffer(reply.already_held, dtype=np.uint8) != 0
            mine: list[int] = []
            sums: list[int] = []
            data = arena.data
            for j in np.flatnonzero(usable).tolist():
                i = run[j]
                sums.append(copy_with_checksum(data[slots[j], : sizes[i]], arrays[i]))
                mine.append(j)
            for j in np.flatnonzero(held).tolist():
                result[run[j]] = True
            left += [run[j] for j in np.flatnonzero(~usable & ~held).tolist()]
            if not reply.lease:
                continue
            commit = node_pb2.CommitRequest(lease=reply.lease, keys=pack_keys([keys[run[j]] for j in mine]),
                                            slots=slots[mine].tolist(), checksums=sums)
            try:
                stored = stub.Commit(commit, timeout=self.config.io_timeout_s).stored
            except grpc.RpcError as exc:
                self.errors.count(_error_kind(exc), len(mine))  # the node reclaims the slots when the lease lapses
                continue
            if len(stored) != len(mine):
                self.errors.count("bad_reply", len(mine))
                continue
            refused = 0
            hints = self._slot_hints_of(arena)
            for j, flag in zip(mine, stored):
                result[run[j]] = flag != 0
                refused += flag == 0
                if flag:
                    hints[keys[run[j]]] = int(slots[j])
            if refused:
                self.errors.count("put_refused", refused)
        return left

    def _put_bulk(self, node: NodeAddress, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
                  sizes: list[int], result: list[bool]) -> list[int]:
        """Remote path over the node's bulk listener; returns the blocks to send over gRPC instead."""
        data_address = self._data_address(node.address)
        if data_address is None:
            return idxs
        done = 0
        for run in _chunks(idxs, sizes, BULK_CHUNK_BYTES):
            sums = [block_checksum(arrays[i]) for i in run]
            stored = self._bulk_call(node, len(run), self._bulk.put, data_address,
                                     [keys[i] for i in run], [arrays[i] for i in run], sums)
            if stored is None:
                return idxs[done:]
            for i, flag in zip(run, stored):
                result[i] = flag
            refused = stored.count(False)
            if refused:
                self.errors.count("put_refused", refused)
            done += len(run)
        return []

    def _put_grpc(self, node: NodeAddress, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
                  sizes: list[int], result: list[bool]) -> None:
        for run in _chunks(idxs, sizes, CHUNK_BYTES):
            request = node_pb2.PutRequest(
                keys=pack_keys([keys[i] for i in run]),
                sizes=[sizes[i] for i in run],
                data=b"".join(arrays[i].data for i in run),
                checksums=[block_checksum(arrays[i]) for i in run],
            )
            try:
                reply = self._node(node.address).Put(request, timeout=self.config.io_timeout_s)
            except grpc.RpcError as exc:
                self.errors.count(_error_kind(exc), len(run))
                continue
            stored = flags_from_bytes(reply.stored)
            for i, flag in zip(run, stored):
                result[i] = flag
            refused = stored.count(False)
            if refused:
                self.errors.count("put_refused", refused)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Drain the write-behind queue (briefly), then close channels and connections, and unmap arenas."""
        self._writer.close()
        self._bulk.close()
        self._calls.close()
        self._closing.set()
        for thread in self._populating:
            thread.join(timeout=10)
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
