"""PoolClient: the pool as seen from one worker process (no torch here; buffers only).

- One master call per lookup, exists or placement, through the typed master
  interface (:class:`kvpool.master_client.MasterApi`: fast calls, gRPC as the
  fallback, following the leader).
- Block bytes move per node, a batch at a time, by the fastest
  :class:`~kvpool.client.datapath.DataPath` the node offers, each handing
  what it could not move to the next: shared memory when the node is on
  this host (:mod:`kvpool.client.shared_path`), its bulk TCP listener
  (:mod:`kvpool.client.bulk_path`), gRPC (:mod:`kvpool.client.grpc_path`).
  A node's blocks get one ``io_timeout_s`` across its paths and every call
  they make (each call gets what is left): once it is spent (a stalled
  node), the rest are misses, not handed to a slower path or call.
- One deadline per call: a ``lookup`` or ``exists`` ends within
  ``lookup_timeout_s`` (its wait for this client's piped commits included),
  a ``flush(timeout)`` within ``timeout``; no other setting stretches them.
- Bytes are accepted only if their checksum equals the one the master
  published for the block.
- Pool failures are counted misses, never exceptions on the engine's path
  (:mod:`kvpool.client.faults`); caller misuse is a ValueError.
- ``put`` is write-behind (a bounded queue, :mod:`kvpool.client.writer`);
  ``store`` writes now. A block no node takes (larger than every node's
  DRAM slot and SSD limit) is not stored: counted as ``block_too_large``
  and logged once, with the setting to change.
- With ``token`` every call and connection carries it (gRPC metadata, the
  AUTH frame of fast calls and bulk); with ``tls_ca`` every transport is TLS,
  verified against that CA. A refused token or certificate is a pool fault
  like any other: counted misses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from kvpool.buffers import BufferLike, as_array
from kvpool.client.bulk_path import BulkPath
from kvpool.client.cluster import ClusterView, Placement
from kvpool.client.datapath import DataPath, call_timeout
from kvpool.client.faults import Faults, PoolFault, error_kind
from kvpool.client.grpc_path import GrpcPath
from kvpool.client.leases import FilledSlot, LeasedSlot
from kvpool.client.local_index import LocalIndex
from kvpool.client.lookup import EMPTY_RUN, BlockLocation, PoolRun
from kvpool.client.lookup_stats import LookupCounts, LookupStats
from kvpool.client.nodes import MAX_MESSAGE_BYTES, NodeDirectory
from kvpool.client.prepared import PreparedPut
from kvpool.client.shared_path import SharedMemoryPath
from kvpool.client.writer import Payload, WriteBehindQueue
from kvpool.config import ClientConfig
from kvpool.etcd import EtcdAccess
from kvpool.keys import BlockKey, check_keys, pack_keys
from kvpool.master_client import MasterApi, TenantMask
from kvpool.metrics import ErrorMetrics, LookupMetrics, MetricsServer, latency_histogram
from kvpool.placement import TOO_LARGE
from kvpool.rpc import flags_from_bytes
from kvpool.sharded_master import connect_master
from kvpool.tcp import ConnectionPool
from kvpool.tls import client_context
from kvpool.v1 import master_pb2, node_pb2
from kvpool.vocabulary import NodeRef, Tier
from kvpool.wire import CallError, auth_hello

__all__ = ["PoolClient", "PoolFault"]

log = logging.getLogger(__name__)

_TIER_BYTES = frozenset(int(t) for t in Tier)
_UNSTATED_MAX_KEYS = 65536  # a master that states no max_keys_per_call (one from before the field) takes this
_MAX_PENDING_NAMES = 1 << 20  # engine names waiting for their puts; past this they are dropped (hints only)
_NAMES_RETRY_S = 60.0  # after a master kept no names (no KV events there), how long before sending them again
PRESENT = -2  # a placement's answer for a block the pool holds already (PlaceBlocks only)


def _report_kind(exc: BaseException) -> str:
    """Error kind of a failed HBM report: stats only, so kept apart from the data path's ``timeout`` etc."""
    return f"report_{error_kind(exc)}"


class PoolClient:
    """Lookup, get, put and exists against a kvpool master and its nodes."""

    def __init__(self, config: ClientConfig, registry: CollectorRegistry | None = None):
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.lookup_metrics = LookupMetrics(self.registry)
        self.errors = ErrorMetrics(self.registry)
        self.faults = Faults(self.errors, strict=config.strict)
        self._lookup_seconds = latency_histogram(self.registry, "lookup", "Pool lookup latency (one master call)")
        self._get_seconds = latency_histogram(self.registry, "get", "Pool get latency (one batch)")
        self._put_seconds = latency_histogram(self.registry, "put", "Pool put latency (one write-behind batch)")
        tls = client_context(config.tls_ca) if config.tls_ca else None
        self._calls = ConnectionPool(config.io_timeout_s, connect_timeout_s=min(config.io_timeout_s, 2.0), tls=tls,
                                     hello=auth_hello(config.token) if config.token else None,
                                     spin_wait_s=config.spin_wait_us * 1e-6)
        # The master, or the leader etcd names (followed when a call finds it gone: kvpool.master_client), or
        # one leader per index shard of a sharded cluster (kvpool.sharded_master).
        self.lookup_stats = LookupStats(self._report_lookups)  # lookups counted here (HBM, arenas, shards merged)
        self.master: MasterApi = connect_master(
            config.master, pool=self._calls, timeout_s=config.lookup_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES,
            token=config.token, tls_ca=config.tls_ca, etcd_access=EtcdAccess.from_config(config, "client"),
            count_lookup=self.lookup_stats.count)
        self.nodes = NodeDirectory(config, self._calls)
        self.cluster = ClusterView(
            lambda: self.master.cluster_status(master_pb2.ClusterStatusRequest(), config.lookup_timeout_s),
            on_nodes=self.nodes.learn)
        self._written_lock = threading.Lock()
        self._written: set[str] = set()  # nodes written to since the last flush (their reports may be pending)
        self._names: dict[BlockKey, int] = {}  # engine hashes of queued puts, sent before their blocks (writer)
        self._names_unwanted_until = 0.0  # the master kept none (it publishes no events): ask again after this
        mask = TenantMask(self.master) if config.token else None
        self.local = LocalIndex(self.cluster, self.nodes, mask, enabled=config.shared_memory)
        self.shared_path = SharedMemoryPath(config, self.nodes, self.faults, mask, self._calls)
        self.bulk_path = BulkPath(config, self.nodes, self.faults, self._calls)
        self.grpc_path = GrpcPath(config, self.nodes, self.faults)
        self.paths: list[DataPath] = [self.shared_path, self.bulk_path, self.grpc_path]  # fastest first
        path_blocks = Counter("kvpool_path_blocks", "Blocks each data path moved", ["path", "op"],
                              registry=self.registry)
        names = ("shared_memory", "bulk", "grpc")
        self._moved = {op: [path_blocks.labels(name, op) for name in names] for op in ("get", "put")}
        self._writer = WriteBehindQueue(self._put_now, config.put_queue_bytes)
        self._largest_refused = 0  # largest block size the pool refused so far (logged once per new maximum)
        self._metrics_server = MetricsServer(self.registry, config.metrics_port) if config.metrics_port > 0 else None

    # -- master calls ----------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> PoolRun:
        """The leading run of ``keys`` the pool holds, with locations; empty if the master fails.

        Answered from this host's arenas when every live node is on this host
        (:mod:`kvpool.client.local_index`: no round trip; the hit counts reach
        the master through :attr:`lookup_stats`), else by the master.
        """
        keys = check_keys(keys)
        start = time.perf_counter()
        deadline = time.monotonic() + self.config.lookup_timeout_s  # every wait of the lookup ends by then
        self.shared_path.settle(self.config.lookup_timeout_s)  # read-your-writes: this client's commits published
        local = self.local.lookup(keys)
        if local is not None:
            self.lookup_stats.count(hbm_prefix_blocks, local.tiers, hbm_prefix_blocks + len(keys), block_tokens)
            self._lookup_seconds.observe(time.perf_counter() - start)
            return local
        keys = keys[: self._master_max_keys()]  # a leading run no longer than one call names: the rest a miss
        request = master_pb2.LookupRequest(
            keys=b"".join(keys), worker_id=self.worker_id, hbm_prefix_blocks=hbm_prefix_blocks,
            block_tokens=block_tokens,
        )
        try:
            reply = self.master.lookup(request, call_timeout(deadline))
        except grpc.RpcError as exc:
            self.faults.lost(error_kind(exc), exc, len(keys))
            return EMPTY_RUN
        finally:
            self._lookup_seconds.observe(time.perf_counter() - start)
        if reply.nodes:
            self.nodes.learn(reply.nodes)
        run = len(reply.tiers)
        nodes = [NodeRef(n.node_id, n.address, n.host_id, n.arena) for n in reply.nodes]
        if not (len(reply.node_indexes) == len(reply.sizes) == len(reply.checksums) == run <= len(keys)):
            self.faults.lost("bad_reply", "lookup reply fields disagree", len(keys))
            return EMPTY_RUN
        node_indexes = np.asarray(reply.node_indexes, dtype=np.int64)
        if not set(reply.tiers) <= _TIER_BYTES or (run and int(node_indexes.max()) >= len(nodes)):
            self.faults.lost("bad_reply", "lookup reply names an unknown tier or node", len(keys))
            return EMPTY_RUN
        return PoolRun(keys[:run], reply.tiers, node_indexes, nodes, reply.sizes, reply.checksums)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether the pool holds each key; all False if the master cannot be asked (this host's arenas answer
        when every live node is here, as for :meth:`lookup`)."""
        packed = pack_keys(keys)
        deadline = time.monotonic() + self.config.lookup_timeout_s  # as in lookup
        self.shared_path.settle(self.config.lookup_timeout_s)
        local = self.local.exists(keys)
        if local is not None:
            return local
        most = self._master_max_keys()
        present: list[bool] = []
        for start in range(0, len(keys), most):  # in calls the master takes
            try:
                reply = self.master.exists(master_pb2.ExistsRequest(keys=packed[start * 32 : (start + most) * 32]),
                                           call_timeout(deadline))
            except grpc.RpcError as exc:
                self.faults.lost(error_kind(exc), exc, len(keys) - start)
                return present + [False] * (len(keys) - start)
            present += flags_from_bytes(reply.present)
        return present

    def _master_max_keys(self) -> int:
        """The most keys one master call may name: the master's ``max_keys_per_call``, from its ``Info``."""
        info = self.master.info()
        return info.max_keys_per_call if info is not None and info.max_keys_per_call else _UNSTATED_MAX_KEYS

    def report_hbm(self, added: Sequence[BlockKey], removed: Sequence[BlockKey], *, wait: bool = True,
                   timeout: float | None = None) -> None:
        """Tell the master what this worker's HBM tier gained and lost.

        Best effort; with ``wait=False`` the call does not block. Within ``lookup_timeout_s`` (and ``timeout``,
        if less).
        """
        timeout = self.config.lookup_timeout_s if timeout is None else min(timeout, self.config.lookup_timeout_s)
        request = master_pb2.ReportHbmRequest(worker_id=self.worker_id, added_keys=pack_keys(added),
                                              removed_keys=pack_keys(removed))
        if not wait:
            self.master.report_hbm_nowait(request, timeout, self._count_report_failure)
            return
        try:
            self.master.report_hbm(request, timeout)
        except grpc.RpcError as exc:
            self.faults.counted(_report_kind(exc))

    def _report_lookups(self, block_tokens: int, counts: LookupCounts, deadline: float | None) -> bool:
        """:class:`LookupStats`' sender: one ``ReportLookups`` within ``lookup_timeout_s`` and by ``deadline``
        (``time.monotonic()``); a failure is counted and those counts are lost. True if the master took it."""
        timeout = self.config.lookup_timeout_s if deadline is None else \
            min(self.config.lookup_timeout_s, call_timeout(deadline))
        request = master_pb2.ReportLookupsRequest(
            worker_id=self.worker_id, block_tokens=block_tokens, lookups=counts.lookups,
            requested_blocks=counts.requested, hbm_blocks=counts.hbm, dram_blocks=counts.dram, ssd_blocks=counts.ssd)
        try:
            self.master.report_lookups(request, timeout)
        except grpc.RpcError as exc:
            self.faults.counted(_report_kind(exc))
            return False
        return True

    def _count_report_failure(self, exc: grpc.RpcError) -> None:
        self.faults.counted(_report_kind(exc))

    # -- reads ---------------------------------------------------------------------------

    def get_into(self, locations: Sequence[BlockLocation], outs: Sequence[BufferLike]) -> list[bool]:
        """Copy each located block into its output; per block, whether it arrived intact.

        ``locations`` is best a :class:`PoolRun` (a lookup's, or a slice of one): its columns go to the data
        paths as they are; any other sequence is turned into one first.
        """
        if len(locations) != len(outs):
            raise ValueError(f"{len(locations)} locations but {len(outs)} buffers")
        run = PoolRun.of(locations)
        dsts = [as_array(o, writable=True) for o in outs]
        wrong = np.flatnonzero(np.fromiter((d.size for d in dsts), dtype=np.uint64, count=len(dsts)) != run.sizes)
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(f"output is {dsts[i].size} bytes, block {run.keys[i].hex()[:16]} is {int(run.sizes[i])}")
        start = time.perf_counter()
        self.faults.raise_later()  # strict: a piped Commit refused since the last call
        ok = [False] * len(run)
        if len(run.nodes) == 1:  # one node: one group, in order (no sorting)
            groups = [list(range(len(run)))] if len(run) else []
        else:
            order = np.argsort(run.node_indexes, kind="stable")
            bounds = np.flatnonzero(np.diff(run.node_indexes[order])) + 1
            groups = [g.tolist() for g in np.split(order, bounds)] if len(run) else []
        for idxs in groups:
            node = run.nodes[int(run.node_indexes[idxs[0]])]
            deadline = time.monotonic() + self.config.io_timeout_s  # one deadline per node, not one per path
            self.shared_path.settle(call_timeout(deadline), {node.address})  # read-your-writes, on its deadline
            for path, moved in zip(self.paths, self._moved["get"]):
                offered, idxs = idxs, path.get(node, idxs, run, dsts, ok, deadline)
                moved.inc(sum(ok[i] for i in offered))
                if not idxs:
                    break
                if time.monotonic() >= deadline:  # a stalled node: no slower path gets to wait on it again
                    self.faults.lost("timeout", f"{len(idxs)} blocks of {node.address} past the deadline", len(idxs))
                    break
        self._get_seconds.observe(time.perf_counter() - start)
        return ok

    # -- writes ------------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike],
            engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Queue blocks for the pool (copied now, written in the background); per block, accepted.

        The one copy goes straight into a slot a same-host node leased to this
        client ahead, where it has one (:meth:`prepare_put`), else into host
        scratch the write-behind queue owns. ``engine_hashes``: the engine's
        own 64-bit hash of each block (0: none), for the master's KV events;
        the writer sends them to the master before it writes the blocks
        (``Master.NameBlocks``).
        """
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} buffers")
        arrays = [as_array(v) for v in values]
        prepared = self.prepare_put(keys, [int(a.size) for a in arrays], reserve=False)  # never waits
        for i, a in enumerate(arrays):
            prepared.fill(i, (a,))
        return self.complete_put(prepared, engine_hashes)

    def prepare_put(self, keys: Sequence[BlockKey], sizes: Sequence[int], *, reserve: bool = True) -> PreparedPut:
        """Step one of a put: a target for each block to be written into once (see :mod:`kvpool.client.prepared`).

        A block placed on a same-host node gets a slot of the stock that node
        leased to this client ahead (no round trip); with ``reserve``, the
        blocks the stock lacks get slots of one ``Reserve`` per node (a local
        call, bounded by ``lookup_timeout_s`` like a lookup: the copy it saves
        costs more than the call from a few hundred KiB up); the rest (other
        hosts, no room, no view of the cluster yet without ``reserve``) get
        host scratch. Fill every block, then :meth:`complete_put`; a batch
        dropped instead publishes nothing (its slots lapse with their lease).
        """
        keys = check_keys(keys)
        sizes = [int(n) for n in sizes]
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        for i, n in enumerate(sizes):
            if n <= 0:
                raise ValueError(f"block {i} is empty")
        slots: list[LeasedSlot | None] = [None] * len(keys)
        placement = self.cluster.place(keys, sizes) if reserve or self.shared_path.stocked_slots() else None
        if placement is None:
            return PreparedPut(keys, sizes, slots)
        by_node: dict[int, list[int]] = defaultdict(list)
        for i, n in enumerate(placement.node_indexes):
            if n >= 0:
                by_node[n].append(i)
        deadline = time.monotonic() + self.config.lookup_timeout_s
        for n, idxs in by_node.items():
            node = placement.nodes[n]
            for i, slot in zip(idxs, self.shared_path.lease(node, [sizes[i] for i in idxs])):
                slots[i] = slot
            short = [i for i in idxs if slots[i] is None]
            if reserve and short:
                for i, got in zip(short, self.shared_path.reserve(node, keys, sizes, short, deadline)):
                    slots[i] = got if isinstance(got, LeasedSlot) else None  # held already: written as scratch
        return PreparedPut(keys, sizes, slots)

    def complete_put(self, prepared: PreparedPut, engine_hashes: Sequence[int] | None = None) -> list[bool]:
        """Step two: queue the filled batch for the pool (write-behind; the batch is the queue's from now on);
        per block, accepted (a full queue drops scratch blocks, counted; slot blocks cost it nothing).
        ``engine_hashes`` as in :meth:`put`. ValueError if a block was neither filled nor sealed."""
        keys = prepared.keys
        unfilled = prepared.unfilled()
        if unfilled:
            raise ValueError(f"block {unfilled[0]} of the prepared put was never filled")
        if engine_hashes is not None and (len(engine_hashes) != len(keys) or
                                          not all(0 <= int(h) < 1 << 64 for h in engine_hashes)):
            raise ValueError("engine_hashes: one integer in [0, 2**64) per key")
        if engine_hashes is not None and time.monotonic() < self._names_unwanted_until:
            engine_hashes = None
        if engine_hashes is not None:
            with self._written_lock:
                if len(self._names) > _MAX_PENDING_NAMES:  # the writer has fallen far behind: names are hints
                    self._names.clear()
                self._names.update((k, int(h)) for k, h in zip(keys, engine_hashes) if h)
        payloads: list[Payload] = [
            FilledSlot(slot, checksum) if slot is not None and checksum is not None else target
            for slot, checksum, target in zip(prepared.slots, prepared.checksums, prepared.targets)]
        # The filled slots side by side: items of no bytes are never split across the writer's batches, so one
        # lease's slots reach one Commit (a Reserve's lease ends at its Commit).
        order = sorted(range(len(keys)), key=lambda i: not isinstance(payloads[i], FilledSlot))
        taken = self._writer.submit([keys[i] for i in order], [payloads[i] for i in order])
        accepted = [False] * len(keys)
        for i, ok in zip(order, taken):
            accepted[i] = ok
        dropped = accepted.count(False)
        if dropped:
            self.faults.counted("queue_full", dropped)
            if engine_hashes is not None:
                with self._written_lock:
                    for key, ok in zip(keys, accepted):
                        if not ok:
                            self._names.pop(key, None)
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block queued or stored so far is written (or dropped) and in the master's index.

        Nodes report what they store in the background (a put's reply does not
        wait for the master); this is the barrier: it asks each node written to
        since the last flush to send its reports now, and sends the counts of
        the lookups this client answered itself (:class:`LookupStats`). False on timeout (one
        ``timeout`` for all of it), or if a node could not confirm (its blocks
        are stored; the master learns of them when the node's link is back).
        """
        deadline = None if timeout is None else time.monotonic() + timeout  # every step of the flush ends by it
        if not self._writer.flush(timeout):
            return False
        if not self.shared_path.settle(self.config.io_timeout_s if deadline is None else call_timeout(deadline)):
            return False
        with self._written_lock:
            written, self._written = self._written, set()
        ok = self.lookup_stats.send(deadline)
        left = self.config.io_timeout_s if deadline is None else call_timeout(deadline)
        return self._flush_reports(written, left) and ok

    def _flush_reports(self, addresses: set[str], timeout: float) -> bool:
        """Ask each node to send its reports to the master now, all within ``timeout``; True once every one says
        the master has them (a node not asked in time is not confirmed)."""
        ok = True
        deadline = time.monotonic() + timeout
        for address in sorted(addresses):
            if time.monotonic() >= deadline:
                return False
            try:
                reply = self.nodes.stub(address).FlushReports(node_pb2.FlushReportsRequest(),
                                                              timeout=call_timeout(deadline))
                ok &= reply.indexed
            except grpc.RpcError as exc:
                self.faults.counted(_report_kind(exc))
                ok = False
        return ok

    def _put_now(self, keys: list[BlockKey], payloads: list[Payload]) -> None:
        """The write-behind sink: the blocks' engine names to the master first (so the master knows them
        before any node reports the blocks), then the blocks: filled slots committed, the rest stored."""
        if self._names:
            with self._written_lock:
                named = [(k, h) for k in keys if (h := self._names.pop(k, 0))]
            if named:
                request = master_pb2.NameBlocksRequest(keys=pack_keys([k for k, _ in named]),
                                                       engine_hashes=[h for _, h in named])
                try:
                    reply = self.master.name_blocks(request, self.config.lookup_timeout_s)
                except (grpc.RpcError, CallError, OSError) as exc:  # a name is a hint for routers: never fatal
                    self.faults.counted(_report_kind(exc))
                else:
                    if reply.named == 0:  # a master without KV events: stop sending names for a while
                        self._names_unwanted_until = time.monotonic() + _NAMES_RETRY_S
        filled = [j for j, p in enumerate(payloads) if isinstance(p, FilledSlot)]
        if filled:
            self._commit_filled([keys[j] for j in filled], [payloads[j] for j in filled])  # type: ignore[misc]
        if len(filled) < len(keys):
            rest = [j for j, p in enumerate(payloads) if not isinstance(p, FilledSlot)]
            self.store([keys[j] for j in rest], [payloads[j] for j in rest])  # type: ignore[misc]

    def _commit_filled(self, keys: list[BlockKey], filled: list[FilledSlot]) -> None:
        """Publish blocks already in same-host nodes' leased slots (one ``Commit`` per lease)."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for j, f in enumerate(filled):
            by_node[f.slot.address].append(j)
        with self._written_lock:
            self._written.update(by_node)
        for js in by_node.values():
            deadline = time.monotonic() + self.config.io_timeout_s
            stored = self.shared_path.commit([keys[j] for j in js], [filled[j].slot for j in js],
                                             [filled[j].checksum for j in js], deadline)
            self._moved["put"][0].inc(sum(stored))
        self._read_your_writes(set(by_node))

    def store(self, keys: Sequence[BlockKey], values: Sequence[BufferLike]) -> list[bool]:
        """Write blocks to the pool now; per block, whether the pool took it.

        Placement comes from the client's cluster view (the master's
        ``PlaceBlocks`` without one); each node gets its blocks in one batch
        by the fastest path it offers (see the module docstring). On the
        same-host path ``store`` returns once the bytes are in the node's
        slots and the ``Commit`` is sent (:mod:`kvpool.client.commit_pipe`):
        the node publishes them meanwhile, this client's next
        ``lookup``, ``exists``, ``get_into`` or ``flush`` first waits for that,
        and a block the node then refuses is a lost write (counted; in strict
        mode raised by the next call). The nodes report new blocks to the
        master in the background; when this client's own lookups are
        answered by the master (not every node on this host), ``store`` also
        waits for its commits and those reports (``FlushReports``), so what
        it stored is what its next lookup finds. A pool fault is a False,
        counted in the error metrics; misuse (bad keys, empty or mismatched
        buffers) is a ValueError.
        """
        self.faults.raise_later()
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
        placement = self._place([keys[i] for i in uniq], [sizes[i] for i in uniq])
        if placement is None:
            return result
        nodes = placement.nodes
        by_node: dict[int, list[int]] = defaultdict(list)
        refused: list[int] = []
        for j, i in enumerate(uniq):
            n = placement.node_indexes[j]
            if n == PRESENT:
                result[i] = True
            elif n == TOO_LARGE:
                refused.append(sizes[i])
            else:
                by_node[n].append(i)
        if by_node:
            with self._written_lock:
                self._written.update(nodes[n].address for n in by_node)
        if refused:
            self._too_large(refused)
        for node_index, idxs in by_node.items():
            deadline = time.monotonic() + self.config.io_timeout_s  # as in get_into
            try:
                for path, moved in zip(self.paths, self._moved["put"]):
                    offered, idxs = idxs, path.put(nodes[node_index], idxs, keys, arrays, sizes, result, deadline)
                    moved.inc(sum(result[i] for i in offered))
                    if not idxs:
                        break
                    if time.monotonic() >= deadline:
                        self.faults.lost("timeout",
                                         f"{len(idxs)} blocks for {nodes[node_index].address} past the deadline",
                                         len(idxs))
                        break
            finally:
                if idxs:  # no path took them: the node may be gone, so may the view that chose it
                    self.cluster.invalidate()
        if by_node:
            self._read_your_writes({nodes[n].address for n in by_node})
        return [result[first[k]] for k in keys]

    def _read_your_writes(self, addresses: set[str]) -> None:
        """When this client's lookups ask the master (not every node is on this host), wait for the commits
        just sent and the nodes' reports of them, so its next lookup finds what it wrote."""
        if self.local.answers():
            return
        deadline = time.monotonic() + self.config.io_timeout_s  # one wait for both
        self.shared_path.settle(self.config.io_timeout_s)
        self._flush_reports(addresses, call_timeout(deadline))

    def _place(self, keys: list[BlockKey], sizes: list[int]) -> Placement | None:
        """Where each new block goes: from the cluster view (no round trip), else the master's PlaceBlocks.

        Per key a node index, ``TOO_LARGE`` or (PlaceBlocks only) ``PRESENT``;
        None if neither could answer (counted as lost).
        """
        placement = self.cluster.place(keys, sizes)
        if placement is not None:
            big = [j for j, n in enumerate(placement.node_indexes) if n == TOO_LARGE]
            if not big:
                return placement
            # No node in the view takes these: the master has the last word (and counts them for kvpool status).
            asked = self._ask_placement([keys[j] for j in big], [sizes[j] for j in big])
            if asked is None:
                return placement
            nodes = list(placement.nodes)
            chosen = list(placement.node_indexes)
            for j, n in zip(big, asked.node_indexes):
                if n >= 0:
                    nodes.append(asked.nodes[n])
                    n = len(nodes) - 1
                chosen[j] = n
            return Placement(chosen, nodes)
        return self._ask_placement(keys, sizes)

    def _ask_placement(self, keys: list[BlockKey], sizes: list[int]) -> Placement | None:
        """The master's PlaceBlocks (see :meth:`_place`), in calls of at most the keys the master takes."""
        most = self._master_max_keys()
        if len(keys) <= most:
            return self._ask_placement_once(keys, sizes)
        chosen: list[int] = []
        nodes: list[NodeRef] = []
        for start in range(0, len(keys), most):
            part = self._ask_placement_once(keys[start : start + most], sizes[start : start + most])
            if part is None:
                return None
            chosen += [n + len(nodes) if n >= 0 else n for n in part.node_indexes]  # PRESENT, TOO_LARGE: < 0
            nodes += part.nodes
        return Placement(chosen, nodes)

    def _ask_placement_once(self, keys: list[BlockKey], sizes: list[int]) -> Placement | None:
        try:
            placed = self.master.place_blocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(keys), sizes=sizes),
                                               self.config.lookup_timeout_s)
        except grpc.RpcError as exc:
            self.faults.lost(error_kind(exc), exc, len(keys))
            return None
        too_large = placed.too_large or bytes(len(keys))  # empty: no block is
        if not len(placed.present) == len(placed.node_indexes) == len(too_large) == len(keys) or \
                any(n >= len(placed.nodes) and not big for n, big in zip(placed.node_indexes, too_large)):
            self.faults.lost("bad_reply", "placement reply fields disagree", len(keys))
            return None
        self.nodes.learn(placed.nodes)
        chosen = [PRESENT if present else TOO_LARGE if big else n
                  for n, present, big in zip(placed.node_indexes, placed.present, too_large)]
        return Placement(chosen, [NodeRef(n.node_id, n.address, n.host_id, n.arena) for n in placed.nodes])

    def _too_large(self, sizes: list[int]) -> None:
        """Blocks no pool node takes: counted, and said once per size class so the user can fix the setting."""
        self.faults.counted("block_too_large", len(sizes))
        largest = max(sizes)
        if largest > self._largest_refused:
            self._largest_refused = largest
            log.warning("the pool refused blocks of %d bytes: no node takes blocks that large; set the nodes' "
                        "max_block_bytes (kvpool node --max-block-bytes) to at least your block size, or give them "
                        "an SSD tier (kvpool status shows what they take)", largest)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Drain the write-behind queue (briefly), then close connections and unmap arenas."""
        self._writer.close()
        self.lookup_stats.send()
        self.shared_path.close()
        self.bulk_path.close()
        self._calls.close()
        self.nodes.close()
        self.master.close()
        if self._metrics_server is not None:
            self._metrics_server.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
