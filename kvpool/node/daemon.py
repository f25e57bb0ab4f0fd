"""The pool node daemon: one host's DRAM arena + SSD store behind the Node gRPC service.

:class:`PoolNode` owns, and builds in this order: the DRAM tier (a fresh
shared-memory arena), the SSD tier (LMDB, survives restarts), the
:class:`~kvpool.tiers.node_store.NodeStore` over both, the link to the master,
the gRPC server (Node + health), the bulk TCP listener
(:mod:`kvpool.node.data_port`) and the metrics registry. ``start()`` starts
serving, the metrics endpoint, the master link and the lease reaper (which
frees DRAM slots of same-host writers that did not commit in time);
``stop(grace)`` undoes it in reverse: leave the master's index first (so
clients stop being sent here), drain in-flight calls, then flush and close
the tiers (the arena is unlinked, LMDB closed). :func:`run_node` is the
process entry point.

With ``auth_file`` the gRPC service and the bulk listener (fast calls
included) check client tokens and map each client's keys to its tenant's
(:mod:`kvpool.auth`); tenants with ``quota_bytes`` are held to it
(:mod:`kvpool.node.quota`). With ``tls_cert``/``tls_key`` both listeners
speak TLS only. The arena is created with mode ``arena_mode`` (0600).

Starting next to what is already there (every refusal is a one-line
ValueError, which ``kvpool`` prints and exits 2 on, and leaves nothing behind:
no arena in /dev/shm, no thread, no bound port):

- The arena name belongs to one live node: the node holds a lock on its
  segment for its lifetime (:mod:`kvpool.tiers.arena`, "Ownership"). A
  segment under our name that a live process holds (another node on the same
  port or with the same ``arena``) is never removed or reused: refused, naming
  the arena and the holder's pid. One nobody holds (its node was killed with
  SIGKILL) is stale: replaced, with a warning.
- A port in use (gRPC, bulk, metrics) is refused naming the address; so is
  an SSD directory another process holds (naming its pid, from ``kvpool.lock``).
- An SSD tier that was asked for (``ssd_enabled``) but cannot be used (not a
  directory, read-only or immutable, more ``ssd_bytes`` than the disk has
  free) is refused, unless ``ssd_optional``: then the node serves DRAM only,
  logged and counted (see :func:`open_ssd`).

Once running, a ``data.mdb`` damaged under the node costs SSD misses, never
the process (:mod:`kvpool.tiers.ssd`): every SSD transaction looks first, and
so does the periodic SSD sync (``ssd_sync`` off, the default), so even an
idle node notices within ``tiers.ssd.sync_interval_s`` and the master's index drops
the lost blocks.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

import grpc
import lmdb
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.auth import load_authority
from kvpool.config import NodeConfig
from kvpool.etcd import EtcdAccess
from kvpool.lifecycle import wait_for_shutdown
from kvpool.malloc import limit_arenas
from kvpool.metrics import ErrorMetrics, MetricsServer, TierCollector, latency_histogram
from kvpool.node.core import NodeCore
from kvpool.node.data_port import DataPortServer
from kvpool.node.master_link import MasterLink
from kvpool.node.quota import QuotaLedger
from kvpool.node.servicer import NodeServicer
from kvpool.node.shard_links import ShardLinks, master_links
from kvpool.rpc import local_host_id, make_server
from kvpool.tiers.arena import SharedArena
from kvpool.tiers.dram import DramStore, default_slots
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import SsdInUse, SsdStore
from kvpool.tls import check_pair, server_context
from kvpool.v1 import common_pb2, node_pb2, node_pb2_grpc
from kvpool.vocabulary import Tier, TierStats

log = logging.getLogger(__name__)

_NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


def arena_name_for(config: NodeConfig) -> str:
    """The configured arena name; with port 0 and none configured, a name unique to this process."""
    if config.tiers.dram.arena or config.server.port:
        return config.resolved_arena()
    return f"kvpool-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def create_dram(config: NodeConfig, name: str, mode: int) -> DramStore:
    """The DRAM tier over a new arena ``name``: refused (ValueError) if a live process holds that name.

    A stale arena under the name (its node killed with SIGKILL) is replaced.
    """
    capacity = config.resolved_dram_bytes()
    dram = config.tiers.dram
    arena = SharedArena.create(name, capacity, dram.slots or default_slots(capacity), mode, replace_stale=True,
                               ssd_keys=config.resolved_ssd_index_keys())
    try:
        return DramStore(arena, max_block_bytes=dram.max_block_bytes, high_watermark=dram.high_watermark,
                         low_watermark=dram.low_watermark)
    except BaseException:
        arena.close()
        raise


def _why(exc: BaseException) -> str:
    """One line saying what went wrong with a file or LMDB."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def open_ssd(config: NodeConfig, errors: ErrorMetrics) -> SsdStore | None:
    """The SSD tier; if its directory cannot be used, a refusal, or (``ssd_optional``) None: DRAM only.

    An SSD tier that was asked for and cannot be used (missing mount,
    read-only or immutable, not a directory, ``ssd_bytes`` beyond the free
    disk) is a ValueError saying why, unless ``ssd_optional``: a cache node
    with a dead disk still has its DRAM to offer, so then it is
    ``kvpool_errors_total{kind="ssd_unavailable"}`` and an error in the log.
    A directory another node holds is always refused (that is a configuration
    mistake, not a dead disk). SSD faults after that are counted as
    ``ssd_write`` / ``ssd_file_broken`` (see :mod:`kvpool.tiers.ssd`).
    """
    try:
        ssd = config.tiers.ssd
        return SsdStore(ssd.dir, config.resolved_ssd_bytes(), sync=ssd.sync, on_error=errors.count)
    except SsdInUse:
        raise
    except (OSError, lmdb.Error) as exc:
        if not config.tiers.ssd.optional:
            raise ValueError(f"the SSD directory {config.tiers.ssd.dir} cannot be used ({_why(exc)}); fix it, turn the "
                             "SSD tier off (--no-ssd; ssd_enabled false in a config file) or let the node start "
                             "without it (--ssd-optional; ssd_optional true)") from exc
        log.error("node: the SSD tier at %s cannot be used (%s); serving DRAM only", config.tiers.ssd.dir, _why(exc))
        errors.count("ssd_unavailable")
        return None


class PoolNode:
    """A pool node (see the module docstring). Use as a context manager or call start()/stop()."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.registry = CollectorRegistry()
        self.errors = ErrorMetrics(self.registry)
        self.get_seconds = latency_histogram(self.registry, "get", "Node Get call latency")
        self.put_seconds = latency_histogram(self.registry, "put", "Node Put call latency")
        self.demotions = Counter("kvpool_demotions", "Blocks demoted from DRAM to SSD", registry=self.registry)
        self.promotions = Counter("kvpool_promotions", "SSD hits promoted back into DRAM", registry=self.registry)
        Gauge("kvpool_leased_slots", "DRAM slots reserved by writers that have not committed yet (a writer that "
              "died returns them when its lease lapses or its connection drops)",
              registry=self.registry).set_function(lambda: self.store.dram.leased_slots)
        Gauge("kvpool_demotion_queue_bytes", "Bytes DRAM evicted that are on their way to SSD (still served)",
              registry=self.registry).set_function(
                  lambda: self.store.demotions.pending_bytes if self.store.demotions is not None else 0)
        self.metrics_port = 0
        self._metrics: MetricsServer | None = None
        self._started = False
        self._stopped = False
        self._stop_sync = threading.Event()
        self._sync_thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._populate: threading.Thread | None = None
        if not config.tiers.dram.lease_timeout_s > 0:
            raise ValueError(f"node.lease_timeout_s must be > 0, got {config.tiers.dram.lease_timeout_s}")
        if config.server.max_keys_per_call < 1 or config.server.max_connections < 1:
            raise ValueError("node.max_keys_per_call and node.max_connections must be positive")
        # Checked before anything is created: a bad file or mode changes nothing.
        self.authority = load_authority(config.server.auth_file)
        etcd_access = EtcdAccess.from_config(config, "node")
        arena_mode = config.resolved_arena_mode()
        tls = server_context(config.tls.cert, config.tls.key) if check_pair(config.tls.cert, config.tls.key,
                                                                            "node") else None
        self.quota: QuotaLedger | None = None

        arena = arena_name_for(config)
        dram = create_dram(config, arena, arena_mode)  # refused if a live node holds the name
        ssd: SsdStore | None = None
        link: MasterLink | ShardLinks | None = None
        server: grpc.Server | None = None
        try:
            if config.tiers.ssd.enabled:
                ssd = open_ssd(config, self.errors)
            self.store = NodeStore(dram, ssd, write_through=config.tiers.write_through,
                                     on_demote=self.demotions.inc, on_promote=self.promotions.inc,
                                     demote_queue_bytes=config.tiers.demote_queue_bytes)
            # node_id and address are completed once the server has its port (config.server.port may be 0).
            self.node_ref = common_pb2.NodeRef(node_id=config.node_id, host_id=local_host_id(), arena=arena)
            stores: dict[Tier, Any] = {Tier.DRAM: dram}
            if ssd is not None:
                stores[Tier.SSD] = self.store.ssd_inventory()  # pending demotions included
            link = self.link = master_links(config.master, self.node_ref, stores,
                                            dram_max_block_bytes=self.store.dram.max_block_bytes,
                                            max_block_bytes=self.store.max_block_bytes(),
                                            max_message_bytes=config.max_message_bytes, token=config.token,
                                            tls_ca=config.tls_ca, etcd_access=etcd_access)
            self.store.dram_listener = link.listener(Tier.DRAM)  # after the store's own: the arena's inventory
            if ssd is not None:
                self.store.ssd_listener = link.listener(Tier.SSD)  # after the store's own: the arena's inventory
            if self.authority is not None and self.authority.quotas:
                self.quota = self._quota_ledger(self.authority.quotas)
            self.core = NodeCore(self.store, max_keys_per_call=config.server.max_keys_per_call, errors=self.errors,
                                 quota=self.quota, report=link.flush)
            self.servicer = NodeServicer(
                self.core, node_ref=self.node_ref, max_message_bytes=config.max_message_bytes,
                get_seconds=self.get_seconds, put_seconds=self.put_seconds,
                lease_timeout_s=config.tiers.dram.lease_timeout_s,
            )
            server, self.port, self.health = make_server(
                f"{config.server.host}:{config.server.port}", [self._add_servicer],
                max_message_bytes=config.max_message_bytes,
                authority=self.authority, on_refused=self.errors.count, tls_cert=config.tls.cert,
                tls_key=config.tls.key, max_concurrent_rpcs=config.server.max_concurrent_rpcs, name="node gRPC server",
            )
            self.server = server
            data_port = config.data_port
            if data_port < 0:  # the default: next to the gRPC port, or anywhere if that is taken
                data_port = self.port + 2 if config.server.port else 0
            self.bulk = DataPortServer(
                self.core, config.server.host, data_port, servicer=self.servicer, errors=self.errors,
                get_seconds=self.get_seconds, put_seconds=self.put_seconds, fallback_port=config.data_port < 0,
                max_connections=config.server.max_connections, authority=self.authority,
                max_request_bytes=config.max_message_bytes, max_message_bytes=config.max_message_bytes, tls=tls,
            )
        except BaseException:
            if server is not None:
                server.stop(None)
            if link is not None:
                link.stop(unregister=False)
            if getattr(self, "store", None) is not None:
                self.store.close()  # stops its demotion thread too
            else:
                if ssd is not None:
                    ssd.close()
                dram.close()
            raise
        self.node_ref.node_id = config.node_id or f"{socket.gethostname()}:{self.port}"
        wildcard = config.server.host in ("", "0.0.0.0", "::", "[::]")  # listening everywhere: advertise our name
        host = socket.gethostname() if wildcard else config.server.host
        self.node_ref.address = config.advertise or f"{host}:{self.port}"
        self.node_ref.data_address = f"{self.node_ref.address.rsplit(':', 1)[0]}:{self.bulk.port}"
        self.registry.register(TierCollector(self._tier_stats))

    def _quota_ledger(self, quotas: dict[str, int]) -> QuotaLedger:
        """The tenants' quota ledger, fed by the stores' change events (after the master link's) and the SSD
        inventory."""
        assert self.authority is not None, "node: quotas without an auth file"
        store = self.store
        evictions = Counter("kvpool_quota_evictions", "Blocks removed to keep a tenant within its quota",
                            registry=self.registry)
        ledger = QuotaLedger(quotas, self.authority.tenant_of,
                             held=lambda keys: [t is not None for t in store.where(keys)], evict=store.remove,
                             on_refused=lambda n: self.errors.count("quota_exceeded", n), on_evicted=evictions.inc)
        store.dram_listener = ledger.listener(store.dram_listener)
        if store.ssd is not None:
            store.ssd_listener = ledger.listener(store.ssd_listener)
            ledger.load(store.ssd_inventory().inventory())
        return ledger

    def _tier_stats(self) -> list[tuple[dict[str, str], TierStats]]:
        labels = {"node": self.node_ref.node_id}
        return [(labels, s) for s in self.store.stats()]

    def _add_servicer(self, server: grpc.Server) -> str:
        node_pb2_grpc.add_NodeServicer_to_server(self.servicer, server)
        return _NODE_SERVICE

    @property
    def address(self) -> str:
        """Where clients reach this node's gRPC service (the advertised address)."""
        return self.node_ref.address

    @property
    def data_address(self) -> str:
        """Where clients reach this node's bulk TCP listener (the advertised host, the bound port)."""
        return self.node_ref.data_address

    def start(self) -> PoolNode:
        """Start serving. If that fails (a metrics port in use: ValueError) the node is stopped again, then raises."""
        if self._started:
            raise RuntimeError("pool node already started")
        self._started = True
        try:
            port = self.config.server.metrics_port
            if port != 0:  # first: the one port not bound yet, so a refusal leaves nothing started
                self._metrics = MetricsServer(self.registry, 0 if port < 0 else port, host=self.config.server.host,
                                              name="node")
                self.metrics_port = self._metrics.port
            self.server.start()
            self.bulk.start()
            self.link.start()
            if self.store.ssd is not None and not self.config.tiers.ssd.sync:
                self._sync_thread = threading.Thread(target=self._sync_loop, name="kvpool-ssd-sync", daemon=True)
                self._sync_thread.start()
            self._reaper = threading.Thread(target=self._reap_loop, name="kvpool-lease-reaper", daemon=True)
            self._reaper.start()
            # page faults on first touch are costly: map the whole arena now, off the data path
            self._populate = threading.Thread(target=self.store.populate_dram, args=(self._stop_sync,),
                                              name="kvpool-arena-populate", daemon=True)
            self._populate.start()
        except BaseException:
            self.stop(None)
            raise
        return self

    def _reap_loop(self) -> None:
        """Free the slots of leases past their deadline, a few times per lease timeout."""
        interval = min(1.0, max(0.02, self.config.tiers.dram.lease_timeout_s / 4))
        while not self._stop_sync.wait(interval):
            try:
                freed = self.store.dram.expire()
            except Exception:  # keep reaping; a bug here is logged
                log.exception("node: lease reaper failed")
                continue
            if freed:
                log.info("node: released %d DRAM slots of lapsed write leases", freed)

    def _sync_loop(self) -> None:
        assert self.store.ssd is not None, "node: SSD sync loop without an SSD tier"
        while not self._stop_sync.wait(self.config.tiers.ssd.sync_interval_s):
            try:
                self.store.ssd.sync_now()
            except Exception:  # a failed fsync is logged; the cache keeps serving
                log.exception("node: periodic SSD sync failed")

    def stop(self, grace: float | None = 1.0) -> None:
        """Leave the master, drain calls for up to ``grace`` seconds, close the tiers; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.link.stop()
        if self._started:
            self.server.stop(grace).wait()
        else:
            self.server.stop(None)
        self.bulk.stop()
        if self._metrics is not None:
            self._metrics.close()
        self._stop_sync.set()
        if self._sync_thread is not None:
            self._sync_thread.join(timeout=10)
        for thread in (self._reaper, self._populate):
            if thread is not None:
                thread.join(timeout=10)
        if self.store.ssd is not None:
            self.store.ssd.sync_now()
        self.store.close()

    def __enter__(self) -> PoolNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_node(config: NodeConfig) -> int:
    """Run a pool node until SIGINT or SIGTERM, then stop it cleanly. Call from the main thread."""
    limit_arenas()  # before any thread: otherwise RSS ratchets up per thread (kvpool/malloc.py)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = PoolNode(config)
    try:
        node.start()
        ssd = node.store.ssd
        log.info("kvpool node %s serving on %s (bulk %s): DRAM %d MiB in /dev/shm/%s (blocks up to %d B), SSD %s; "
                 "master %s; metrics %s", node.node_ref.node_id, node.address, node.data_address,
                 node.store.dram.stats().capacity_bytes >> 20, node.node_ref.arena, node.store.dram.max_block_bytes,
                 f"{ssd.capacity_bytes >> 20} MiB at {ssd.path}" if ssd is not None else "off",
                 config.master, f":{node.metrics_port}" if node.metrics_port else "off")
        wait_for_shutdown()
        log.info("kvpool node %s stopping", node.node_ref.node_id)
    finally:
        node.stop()
    return 0
