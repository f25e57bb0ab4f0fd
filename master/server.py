"""The Master Service process: lifecycle of the gRPC server, the metrics endpoint and the sweeper.

Invariants:

- Everything :meth:`MasterServer.start` starts, :meth:`MasterServer.stop`
  stops (gRPC server, fast-call listener, metrics HTTP endpoint, sweeper thread), and ``stop`` is
  idempotent; after it returns no thread of this server is running.
- A port ``start`` cannot listen on (gRPC, fast calls, metrics: in use) is a
  one-line ValueError naming it, raised after undoing whatever it had bound.
- Each MasterServer has its own index, membership and Prometheus registry
  (never the global one), so a fresh instance is a restarted master: it knows
  no node and answers their heartbeats with ``known = false``.
- The sweeper drops silent nodes every ``node_timeout_s / 4``, so a node is
  gone at most ``1.25 * node_timeout_s`` after its last heartbeat, plus the
  time the master itself did not run: the sweeper measures how late it woke
  and tells :meth:`~kvpool.master.membership.Membership.stalled`, so a
  stopped, starved or swapping master never drops a node for its own silence.
- With ``auth_file`` both listeners (gRPC and fast calls) check tokens and
  roles (:mod:`kvpool.auth`; refusals counted in
  ``kvpool_errors_total{kind}``); with ``tls_cert``/``tls_key`` both speak TLS only.
- With ``kv_events_endpoint`` the index's tier transitions go out as KV events
  (:mod:`~kvpool.master.kv_events`) from ``start`` until ``stop``; a port it
  cannot bind is the same one-line ValueError. With an ``auth_file`` too, the
  event ports take CURVE subscribers of the file's client tokens only and
  each tenant gets its own topics (:mod:`kvpool.event_publisher`). Each
  event port holds at most a quarter of the descriptors left free at start
  (fewer than ``kv_events_max_connections`` if the limit is low, logged): an
  event port never takes the descriptors gRPC, fast calls and metrics need.
- ``start`` first raises the process's open-file soft limit to its hard limit
  (logged when it changes).
- With ``etcd`` the master first asks etcd whether it may campaign (TLS,
  user and password, its role: :func:`~kvpool.master.election.check_access`),
  before anything is bound: a refusal is the one-line ValueError. Then it
  starts as a standby and leads only while its
  :class:`~kvpool.master.election.Election` says so: a standby answers
  node and client calls UNAVAILABLE (``Info`` says it stands by and where
  the leader is) and its health service says NOT_SERVING; a master that stops
  leading drops every node and worker (soft state: leading again starts from
  the nodes' full reports, as after a restart).
- Warm standby (``warm_standby``; not with TLS or KV events: a standby then
  stays cold, see docs/reliability.md): a standby
  follows its leader's change log (:mod:`~kvpool.master.follower`) and, if
  it is warm when elected, leads with its nodes (inherited: each registers
  again and re-syncs in the background, :mod:`~kvpool.master.membership`)
  and index, so lookups hit from the election on; a cold one drops what it
  had and leads as above. Only a leader records its log
  (:mod:`~kvpool.master.changelog`), and serves calls only once
  ``on_elected`` has run (the standby's state is settled); only a leader's
  sweeper expires nodes (a standby's nodes come and go with its leader's log).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.auth import load_authority
from kvpool.config import MasterConfig
from kvpool.etcd import EtcdAccess, EtcdClient, EtcdRefused, LeaderInfo, parse_endpoints
from kvpool.event_guard import EventAccess
from kvpool.event_publisher import EventLimits, EventPublisher
from kvpool.keys import KEY_BYTES, BlockKey
from kvpool.lifecycle import wait_for_shutdown
from kvpool.malloc import limit_arenas
from kvpool.master.changelog import LOCATION
from kvpool.master.election import Election, check_access
from kvpool.master.engine_names import EngineNames
from kvpool.master.follower import Follower
from kvpool.master.index import BlockIndex, HbmIndex, TierChange
from kvpool.master.kv_events import MasterEventFeed, Tenants
from kvpool.master.membership import Membership
from kvpool.master.servicer import MasterServicer
from kvpool.master.stats import MasterMetrics
from kvpool.metrics import ErrorMetrics, MetricsServer
from kvpool.rpc import make_server
from kvpool.shards import publish_shard_map
from kvpool.tcp import TcpListener
from kvpool.tcp_loop import LoopListener
from kvpool.tls import check_pair, server_context
from kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.wire import MASTER_CALLS, WireHandler, refusal_frame, unary_routes

log = logging.getLogger(__name__)

EPHEMERAL_METRICS_PORT = -1  # MasterConfig.metrics_port: pick any free port (tests)
STALL_LOG_S = 1.0  # a sweeper this late says so in the log


def max_message_bytes(config: MasterConfig) -> int:
    """Largest message the master takes: a ReportBlocks with ``max_keys_per_call`` keys in each list.

    Per key at most: 32 added + 10 size varint + 8 checksum + 32 removed bytes; round up to 128.
    """
    assert KEY_BYTES + 10 + 8 + KEY_BYTES <= 128
    return max(4 << 20, config.server.max_keys_per_call * 128 + (1 << 20))


class MasterServer:
    """One master: ``start()``, then ``stop()`` (or use it as a context manager)."""

    def __init__(self, config: MasterConfig):
        if config.node_timeout_s <= 0 or config.worker_timeout_s <= 0:
            raise ValueError("master node_timeout_s and worker_timeout_s must be positive")
        if config.server.max_keys_per_call < 1:
            raise ValueError("master max_keys_per_call must be positive")
        if config.server.max_connections < 1:
            raise ValueError("master max_connections must be positive")
        self.authority = load_authority(config.server.auth_file)
        self._tls = server_context(config.tls.cert, config.tls.key) \
            if check_pair(config.tls.cert, config.tls.key, "master") else None
        self._etcd: EtcdClient | None = None
        if config.etcd:  # etcd must let this master campaign, or it does not start (nothing is bound yet)
            self._etcd = EtcdClient(parse_endpoints(config.etcd), timeout_s=min(2.0, config.leader_ttl_s / 3),
                                    access=EtcdAccess.from_config(config, "master"))
            try:
                check_access(self._etcd, config.cluster, shard=config.shard)
                check_shard_map(self._etcd, config)
            except BaseException:
                self._etcd.close()
                raise
        self.config = config
        self.registry = CollectorRegistry()
        self.errors = ErrorMetrics(self.registry)
        self.events: MasterEventFeed | None = None  # with kv_events_endpoint, once started
        on = bool(config.events.endpoint)
        tenants = self.authority.tenants if self.authority is not None else [""]
        self.names = EngineNames(tenants=tenants or [""]) if on else None  # engines' block hashes, for events only
        self.index = BlockIndex(on_change=self._pool_changed if on else None, tags=on and self.authority is not None)
        self.hbm = HbmIndex(on_change=self._hbm_changed if on else None,
                            max_keys_per_worker=config.max_hbm_keys_per_worker,
                            max_keys_per_tenant=config.max_hbm_keys_per_tenant)
        self.membership = Membership(
            self.index, self.hbm, node_timeout_s=config.node_timeout_s, worker_timeout_s=config.worker_timeout_s,
            max_workers_per_tenant=config.max_workers_per_tenant,
        )
        self.metrics = MasterMetrics(self.registry, self.index, self.hbm, self.membership, self.errors, tenants or [""])
        self.servicer = MasterServicer(config, self.index, self.hbm, self.membership, self.metrics, self.names)
        changes = self.servicer.changes
        changes.max_bytes = config.follow_log_bytes
        limit = max_message_bytes(config)  # what a standby's channel takes in one reply
        changes.reply_bytes = min(changes.reply_bytes, limit // 2)
        changes.chunk_locations = min(changes.chunk_locations, limit // 2 // LOCATION.itemsize)
        self.port: int = 0  # the bound gRPC port, once started
        self.metrics_port: int = 0  # the bound metrics port, once started (0: no endpoint)
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._metrics_server: MetricsServer | None = None
        self._sweeper: threading.Thread | None = None
        self._calls: TcpListener | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._lifecycle = threading.Lock()
        self.election: Election | None = None  # with config.etcd, once started
        self.follower: Follower | None = None  # a warm standby's (config.etcd, no TLS), once started
        self._ready = threading.Event()  # leading, and the standby's state settled (on_elected ran)
        self._leader_gauge = Gauge("kvpool_master_leader", "1 while this master leads its cluster (always 1 without "
                                   "etcd), 0 while it stands by", registry=self.registry)
        self._elections = Counter("kvpool_master_elections", "Times this master became its cluster's leader",
                                  registry=self.registry)
        # read at scrape time from the election's own clock (a lagging thread cannot make it claim leadership)
        self._leader_gauge.set_function(lambda: 0 if self.config.etcd and not self._leading() else 1)
        # which index shard this master's group owns: alerts count leaders per shard (deploy/prometheus)
        Gauge("kvpool_master_shard_info", "Always 1; labels: the index shard this master's group owns, and the "
              "cluster's shard count", ["shard", "shards"], registry=self.registry).labels(
            shard=str(config.shard), shards=str(config.shards)).set(1)
        Gauge("kvpool_master_standby_warm", "1 while this standby holds a copy of its leader's index (a snapshot and "
              "every change since: elected, it leads with it)", registry=self.registry).set_function(
            lambda: int(self.follower is not None and self.follower.warm and not self._ready.is_set()))
        Gauge("kvpool_master_standby_snapshots", "Snapshots of the leader's index this standby took",
              registry=self.registry).set_function(lambda: self.follower.snapshots if self.follower else 0)
        Gauge("kvpool_master_standby_changes", "Changes of the leader's log this standby applied",
              registry=self.registry).set_function(lambda: self.follower.changes if self.follower else 0)

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def start(self) -> MasterServer:
        with self._lifecycle:
            if self._server is not None or self._stopping.is_set():
                raise RuntimeError("MasterServer.start: already started (a stopped server cannot restart)")
            servicer = self.servicer

            def add_master(server: grpc.Server) -> str:
                master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
                return master_pb2.DESCRIPTOR.services_by_name["Master"].full_name

            raise_fd_limit()  # before any listener: the master keeps descriptors for all of them
            self._server, self.port, self._health = make_server(
                f"{self.config.server.host}:{self.config.server.port}", [add_master],
                max_message_bytes=max_message_bytes(self.config), authority=self.authority,
                on_refused=self.errors.count, tls_cert=self.config.tls.cert, tls_key=self.config.tls.key,
                max_concurrent_rpcs=self.config.server.max_concurrent_rpcs, name="master gRPC server",
            )
            try:
                if self.config.events.endpoint:
                    self.events = self._event_feed()
                    servicer.events_server_key = self.events.publisher.server_key
                self._calls = self._call_listener()
                servicer.call_port = self._calls.port
                server = self.config.server
                if server.metrics_port != 0:
                    port = 0 if server.metrics_port == EPHEMERAL_METRICS_PORT else server.metrics_port
                    self._metrics_server = MetricsServer(self.registry, port, host=server.host, name="master")
                    self.metrics_port = self._metrics_server.port
                self._server.start()
                self._calls.start()
            except BaseException:
                self._server.stop(None)
                self._server = None
                if self._calls is not None:
                    self._calls.stop()
                    self._calls = None
                if self._metrics_server is not None:
                    self._metrics_server.close()
                    self._metrics_server = None
                if self.events is not None:
                    self.events.close()
                    self.events = None
                if self._etcd is not None:
                    self._etcd.close()
                self.metrics_port = 0
                raise
            self._sweeper = threading.Thread(target=self._sweep, name="kvpool-master-sweeper", daemon=True)
            self._sweeper.start()
            if self.config.etcd:
                self._stand_by()
            return self

    def _event_feed(self) -> MasterEventFeed:
        """The KV event publisher and feed (see the module docstring): bounds from the config and the
        descriptors this process may open, CURVE and tenants from the auth file."""
        c = self.config
        spare = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - len(os.listdir("/proc/self/fd"))
        per_port = max(1, spare // 4)
        if per_port < c.events.max_connections:
            log.warning("KV events: %d connections per event port at most (a quarter of the %d file descriptors "
                        "this process has left; kv_events_max_connections is %d): raise `ulimit -n`", per_port,
                        spare, c.events.max_connections)
        limits = EventLimits.of(c, max_connections=per_port)
        access = EventAccess.from_authority(self.authority) if self.authority is not None else None
        publisher = EventPublisher(c.events.endpoint, c.events.replay_endpoint or None, topic=c.events.topic,
                                   limits=limits, access=access, registry=self.registry)
        tenants = Tenants.of(self.authority) if self.authority is not None else None
        return MasterEventFeed(publisher, c.events.topic, self.names, tenants)

    def advertised_address(self) -> str:
        """The gRPC ``host:port`` nodes and clients dial this master at (what it puts in etcd when it leads)."""
        host = self.config.advertise_host or self.config.server.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        return f"{host}:{self.port}"

    def _stand_by(self) -> None:
        """Start as a standby and campaign (see the module docstring)."""
        assert self._health is not None, "MasterServer: standing by before the gRPC server exists"
        self._serving(False)
        assert self._etcd is not None, "MasterServer: standing by without an etcd client"
        election = Election(self._etcd, self.config.cluster, LeaderInfo.new(self.advertised_address()),
                            self.config.leader_ttl_s, on_elected=lambda: self._elected(election),
                            on_deposed=self._deposed, shard=self.config.shard)
        servicer = self.servicer
        servicer.cluster = self.config.cluster
        servicer.leading = lambda: self._ready.is_set() and election.leading()
        servicer.leader_address = lambda: leader.address if (leader := election.leader()) is not None else ""
        if self.config.warm_standby and self._tls is None and self.events is None:
            token = self.authority.master_token() if self.authority is not None else ""
            self.follower = Follower(self.membership, self.index, self._leader_to_follow,
                                     max_message_bytes=max_message_bytes(self.config), token=token,
                                     rpc_timeout_s=max(2.0, self.config.leader_ttl_s))
            self.follower.start()
        self.election = election.start()

    def _leader_to_follow(self) -> str:
        """The address of the leader, unless this master leads (or none is known): ""."""
        election = self.election
        if election is None or election.leading():
            return ""
        leader = election.leader()
        return leader.address if leader is not None and leader.address != self.advertised_address() else ""

    def _pool_changed(self, changes: list[TierChange]) -> None:
        if self.events is not None:
            self.events.pool_changed(changes)

    def _hbm_changed(self, worker: str, held: list[BlockKey], gone: list[BlockKey]) -> None:
        if self.events is not None:
            self.events.hbm_changed(worker, held, gone)

    def _leading(self) -> bool:
        return self.election is not None and self.election.leading()

    def _serving(self, leading: bool) -> None:
        assert self._health is not None, "MasterServer: no health service"
        status = health_pb2.HealthCheckResponse.SERVING if leading else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", master_pb2.DESCRIPTOR.services_by_name["Master"].full_name):
            self._health.set(name, status)

    def _elected(self, election: Election) -> None:
        self._elections.inc()
        if election.failover_s is not None:
            self.metrics.failover_seconds.observe(election.failover_s)
        follower = self.follower
        if follower is not None:
            follower.stop()
        if follower is not None and follower.warm:
            nodes = self.membership.inherit()
            log.info("master: elected warm: %d nodes and %d blocks from the old leader (log seq %d); they register "
                     "again and re-sync in the background", nodes, len(self.index), follower.seq)
        else:
            self.membership.drop_all()
        self.servicer.changes.reset(on=self.follower is not None)  # no log where no standby can follow
        self.servicer.elected()
        if self.events is not None:
            self.events.cleared()
        self._ready.set()
        self._serving(True)

    def _deposed(self) -> None:
        self._ready.clear()
        self._serving(False)
        self.servicer.changes.reset(on=False)
        dropped = self.membership.drop_all()
        log.info("master: standing by; dropped %d nodes (they register with the new leader)", dropped)
        if self.follower is not None and not self._stopping.is_set():
            self.follower.start()

    def _call_listener(self) -> TcpListener:
        """The wire listener for fast calls (:mod:`kvpool.wire`) over the same servicer as gRPC."""
        port = self.config.call_port
        if port < 0:
            port = self.port + 2 if self.config.server.port else 0
        limit = max_message_bytes(self.config)
        routes = unary_routes(self.servicer, master_pb2.DESCRIPTOR.services_by_name["Master"], MASTER_CALLS,
                              max_body_bytes=limit, max_keys=self.config.server.max_keys_per_call)
        handler = WireHandler(routes, max_frame_bytes=limit, authority=self.authority, errors=self.errors)
        limits: dict[str, Any] = dict(fallback_port=self.config.call_port < 0, refusal=refusal_frame,
                                      max_connections=self.config.server.max_connections, errors=self.errors)
        if self._tls is not None:  # TLS connections keep a thread each (the loop reads plain sockets only)
            return TcpListener("master-calls", self.config.server.host, port, handler.serve, tls=self._tls, **limits)
        return LoopListener("master-calls", self.config.server.host, port, handler,
                            poll_s=self.config.call_poll_us / 1e6, **limits)

    def _sweep(self) -> None:
        interval = min(self.config.node_timeout_s, self.config.worker_timeout_s) / 4
        asleep = time.monotonic()
        while not self._stopping.wait(interval):
            now = time.monotonic()
            late = now - asleep - interval  # time this process did not run: no node's silence counts it
            try:
                if late > 0:
                    self.membership.stalled(late)
                if late >= STALL_LOG_S:
                    log.warning("master: sweeper woke %.1fs late (this process or its host stalled); that time is "
                                "not counted as its nodes' silence", late)
                if self.election is None or self._ready.is_set():  # a standby's nodes follow its leader's log
                    with self.servicer.changes.applying() as note:
                        for node_id in self.membership.expire(now):
                            note(master_pb2.IndexChange(left=node_id), 0)
            except Exception:  # a sweeper bug must be loud but not kill liveness checks
                log.exception("master sweeper failed")
            asleep = time.monotonic()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds), the metrics endpoint and the sweeper."""
        with self._lifecycle:
            if self._stopping.is_set():
                return
            self._stopping.set()
            if self.election is not None:  # resign first: a standby takes over while this one winds down
                self.election.stop()
            if self.follower is not None:
                self.follower.stop()
            if self._etcd is not None:
                self._etcd.close()
            if self._server is not None:
                assert self._health is not None, "MasterServer: a server without its health service"
                self._health.enter_graceful_shutdown()
                self._server.stop(grace).wait()
            if self._calls is not None:
                self._calls.stop()
            if self._metrics_server is not None:
                self._metrics_server.close()
            if self._sweeper is not None:
                self._sweeper.join()
            if self.events is not None:
                self.events.close()
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (or ``timeout``); True if stopped."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> MasterServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def check_shard_map(etcd: EtcdClient, config: MasterConfig) -> None:
    """The cluster's shard map says ``config.shards`` (written here if the cluster has none yet:
    :func:`~kvpool.shards.publish_shard_map`), before this master campaigns. A map with another count is a
    one-line ValueError: the master does not start. etcd unreachable: with one shard a warning (the master stands
    by, as :func:`~kvpool.master.election.check_access` lets it), with more a ValueError (a shard's master must not
    campaign unchecked)."""
    try:
        publish_shard_map(etcd, config.cluster, config.shards)
    except EtcdRefused as exc:
        raise ValueError(f"etcd refused this master the shard map: {exc.details()} (docs/operations.md)") from None
    except grpc.RpcError as exc:
        if config.shards > 1:
            raise ValueError(f"cannot read the shard map of cluster {config.cluster!r} in etcd ({exc.code().name}); "
                             f"a master of {config.shards} shards starts only once it can") from None
        log.warning("master: cannot read the shard map in etcd (%s); standing by as one shard", exc.code().name)


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (logged when it changes); the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("master: raised the open-file limit from %d to %d (the hard limit)", soft, hard)
        return hard
    return soft


def log_events(publisher: EventPublisher) -> None:
    """Say where the KV event ports are, and the CURVE server key subscribers need (auth on)."""
    curve = f"; CURVE, server key {publisher.server_key}" if publisher.server_key else ""
    log.info("kvpool master: KV events on %s (replay %s%s)", publisher.endpoint, publisher.replay_endpoint or "off",
             curve)


def run_master(config: MasterConfig) -> None:
    """Run a master until SIGINT or SIGTERM, then stop it cleanly. Call from the main thread."""
    limit_arenas()  # before any thread: a large message's buffers are reused, not kept per thread (kvpool/malloc.py)
    with MasterServer(config) as server:
        metrics = f":{server.metrics_port}" if server.metrics_port else "off"
        log.info("kvpool master listening on %s (fast calls :%d, metrics %s)", server.address,
                 server.servicer.call_port, metrics)
        if server.events is not None:
            log_events(server.events.publisher)
        if config.etcd:
            shard = f" index shard {config.shard} of {config.shards}" if config.shards > 1 else ""
            log.info("kvpool master: standing by for cluster %s%s in etcd %s as %s (leader TTL %d s)", config.cluster,
                     shard, config.etcd, server.advertised_address(), config.leader_ttl_s)
        wait_for_shutdown()
        log.info("kvpool master stopping")
