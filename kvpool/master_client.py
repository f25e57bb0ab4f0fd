"""The typed master interface (:class:`MasterApi`) and its implementations over fast calls and gRPC.

Every call a client, node, router or status makes on the master goes through
:class:`MasterApi`: one typed method per RPC, taking and returning the
protobuf messages of ``kvpool.v1``. Two implementations:

- :class:`DirectMaster`: one master at a fixed gRPC address. The hot calls
  (:data:`kvpool.wire.MASTER_CALLS`) go over the master's fast-call listener
  (:class:`kvpool.calls.FastStub`), gRPC as the fallback; the rest over gRPC.
- :class:`MasterConnection`: the current master of ``master``, either
  ``host:port`` or ``etcd://HOST:PORT[,HOST:PORT]/CLUSTER`` (the form
  Mooncake's users know). For the second it reads the cluster's leader key
  (:func:`kvpool.etcd.leader_key`) and dials the master it names; a call that
  fails (the leader died, or the master answered that it stands by) makes it
  read the key again, at most every ``FOLLOW_S``, and dial the new leader if
  it moved. Nodes re-register and clients simply call the new leader: no
  restart.

A sharded master is a third implementation of the same Protocol,
:class:`kvpool.sharded_master.ShardedMaster`: one :class:`MasterConnection`
per index shard, each client call's keys split by shard and the replies
merged; :func:`kvpool.sharded_master.connect_master` is the factory clients
use. Nodes link each shard separately (:mod:`kvpool.node.shard_links`).

Invariants:
- A call ends by its ``timeout``; errors are ``grpc.RpcError`` (over fast
  calls a :class:`~kvpool.wire.CallError`, which is one), so callers handle
  both transports alike.
- The master's ``Info`` is asked once per master dialed (:meth:`MasterApi.info`),
  and again only after it failed (not before ``RETRY_S``) or the master's
  fast-call listener proved unreachable (a restart may have moved it). Its
  answer serves every use: the fast-call address and the tenant mask
  (:class:`TenantMask`).
- :class:`MasterConnection` calls one :class:`DirectMaster` at a time; a
  change closes the old channel after building the new one.
- With no leader known (etcd unreachable, or no key), every call raises
  UNAVAILABLE at once: a pool lookup is then a miss, never a hang.
- etcd is read as ``etcd_access`` says (TLS, user and password:
  :class:`kvpool.etcd.EtcdAccess`). etcd refusing those credentials is,
  with ``refuse_start``, a ValueError from the constructor (a node does not
  start); otherwise it is like no leader known, logged once per reason.
- A call ends by its own deadline: the re-read of the leader key a failure
  asks for runs in the background (one at a time), never inside the call.
- A fixed ``host:port`` never changes and never touches etcd.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from kvpool.auth import MASK_BYTES
from kvpool.calls import RETRY_S, FastStub
from kvpool.etcd import EtcdAccess, EtcdClient, EtcdRefused, EtcdTarget, LeaderInfo, leader_key
from kvpool.rpc import make_channel
from kvpool.tcp import ConnectionPool
from kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.wire import MASTER_CALLS, CallError

log = logging.getLogger(__name__)

FOLLOW_S = 0.25  # a failed call re-reads the leader key at most this often
_SERVICE = master_pb2.DESCRIPTOR.services_by_name["Master"]
_FOLLOW_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

OnError = Callable[[grpc.RpcError], None]


class MasterApi(Protocol):
    """The master, as every caller sees it (see the module docstring). Thread-safe; errors are grpc.RpcError."""

    # -- clients -------------------------------------------------------------------------
    def lookup(self, request: master_pb2.LookupRequest, timeout: float | None) -> master_pb2.LookupResponse: ...

    def exists(self, request: master_pb2.ExistsRequest, timeout: float | None) -> master_pb2.ExistsResponse: ...

    def place_blocks(self, request: master_pb2.PlaceBlocksRequest,
                     timeout: float | None) -> master_pb2.PlaceBlocksResponse: ...

    def name_blocks(self, request: master_pb2.NameBlocksRequest,
                    timeout: float | None) -> master_pb2.NameBlocksResponse: ...

    def report_hbm(self, request: master_pb2.ReportHbmRequest,
                   timeout: float | None) -> master_pb2.ReportHbmResponse: ...

    def report_hbm_nowait(self, request: master_pb2.ReportHbmRequest, timeout: float | None,
                          on_error: OnError) -> None:
        """Send without waiting for the answer; a failure reaches ``on_error`` (on another thread)."""
        ...

    def report_lookups(self, request: master_pb2.ReportLookupsRequest,
                       timeout: float | None) -> master_pb2.ReportLookupsResponse: ...

    def info(self) -> master_pb2.MasterInfoResponse | None:
        """The master's ``Info``, asked once (see the module docstring); None: not known now."""
        ...

    # -- routers and operators -------------------------------------------------------------
    def score(self, request: master_pb2.ScoreRequest, timeout: float | None) -> master_pb2.ScoreResponse: ...

    def cluster_status(self, request: master_pb2.ClusterStatusRequest,
                       timeout: float | None) -> master_pb2.ClusterStatusResponse: ...

    # -- nodes -------------------------------------------------------------------------------
    def register_node(self, request: master_pb2.RegisterNodeRequest,
                      timeout: float | None) -> master_pb2.RegisterNodeResponse: ...

    def heartbeat(self, request: master_pb2.HeartbeatRequest,
                  timeout: float | None) -> master_pb2.HeartbeatResponse: ...

    def report_blocks(self, request: master_pb2.ReportBlocksRequest,
                      timeout: float | None) -> master_pb2.ReportBlocksResponse: ...

    def unregister_node(self, request: master_pb2.UnregisterNodeRequest,
                        timeout: float | None) -> master_pb2.UnregisterNodeResponse: ...

    def close(self) -> None: ...


class MasterCalls(ABC):
    """:class:`MasterApi`'s typed methods over one generic :meth:`call` (by RPC name): the base of the
    implementations that send each request whole to one master."""

    @abstractmethod
    def call(self, name: str, request: Message, timeout: float | None) -> Any:
        """The RPC ``name`` with ``request``, within ``timeout``; its reply message."""

    @abstractmethod
    def call_nowait(self, name: str, request: Message, timeout: float | None, on_error: OnError) -> None:
        """The RPC ``name`` without waiting for its reply; a failure reaches ``on_error``."""

    @abstractmethod
    def info(self) -> master_pb2.MasterInfoResponse | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def lookup(self, request: master_pb2.LookupRequest, timeout: float | None) -> master_pb2.LookupResponse:
        return self.call("Lookup", request, timeout)

    def exists(self, request: master_pb2.ExistsRequest, timeout: float | None) -> master_pb2.ExistsResponse:
        return self.call("Exists", request, timeout)

    def place_blocks(self, request: master_pb2.PlaceBlocksRequest,
                     timeout: float | None) -> master_pb2.PlaceBlocksResponse:
        return self.call("PlaceBlocks", request, timeout)

    def name_blocks(self, request: master_pb2.NameBlocksRequest,
                    timeout: float | None) -> master_pb2.NameBlocksResponse:
        return self.call("NameBlocks", request, timeout)

    def report_hbm(self, request: master_pb2.ReportHbmRequest,
                   timeout: float | None) -> master_pb2.ReportHbmResponse:
        return self.call("ReportHbm", request, timeout)

    def report_hbm_nowait(self, request: master_pb2.ReportHbmRequest, timeout: float | None,
                          on_error: OnError) -> None:
        self.call_nowait("ReportHbm", request, timeout, on_error)

    def report_lookups(self, request: master_pb2.ReportLookupsRequest,
                       timeout: float | None) -> master_pb2.ReportLookupsResponse:
        return self.call("ReportLookups", request, timeout)

    def score(self, request: master_pb2.ScoreRequest, timeout: float | None) -> master_pb2.ScoreResponse:
        return self.call("Score", request, timeout)

    def cluster_status(self, request: master_pb2.ClusterStatusRequest,
                       timeout: float | None) -> master_pb2.ClusterStatusResponse:
        return self.call("ClusterStatus", request, timeout)

    def register_node(self, request: master_pb2.RegisterNodeRequest,
                      timeout: float | None) -> master_pb2.RegisterNodeResponse:
        return self.call("RegisterNode", request, timeout)

    def heartbeat(self, request: master_pb2.HeartbeatRequest,
                  timeout: float | None) -> master_pb2.HeartbeatResponse:
        return self.call("Heartbeat", request, timeout)

    def report_blocks(self, request: master_pb2.ReportBlocksRequest,
                      timeout: float | None) -> master_pb2.ReportBlocksResponse:
        return self.call("ReportBlocks", request, timeout)

    def unregister_node(self, request: master_pb2.UnregisterNodeRequest,
                        timeout: float | None) -> master_pb2.UnregisterNodeResponse:
        return self.call("UnregisterNode", request, timeout)


class DirectMaster(MasterCalls):
    """One master at the gRPC ``address``: hot calls over its fast-call listener when ``pool`` is given and the
    master's ``Info`` names one, else (and as the fallback) gRPC. Owns its channel (:meth:`close`)."""

    def __init__(self, address: str, *, pool: ConnectionPool | None, timeout_s: float, max_message_bytes: int,
                 token: str = "", tls_ca: str = "", options: Sequence[tuple[str, Any]] = ()):
        self.address = address
        self._host = address.rpartition(":")[0]
        self._timeout = timeout_s
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, token=token, tls_ca=tls_ca,
                                     options=list(options))
        self._grpc = master_pb2_grpc.MasterStub(self._channel)
        self._fast = FastStub(self._grpc, _SERVICE, MASTER_CALLS, pool, self._wire_address,
                              on_unreachable=self._forget_info, max_reply_bytes=max_message_bytes) \
            if pool is not None else None
        self._lock = threading.Lock()
        self._info: master_pb2.MasterInfoResponse | None = None
        self._next_try = 0.0

    def call(self, name: str, request: Message, timeout: float | None) -> Any:
        if self._fast is not None and name in MASTER_CALLS:
            return self._fast.call(name, request, timeout)
        return getattr(self._grpc, name)(request, timeout=timeout)

    def call_nowait(self, name: str, request: Message, timeout: float | None, on_error: OnError) -> None:
        future = getattr(self._grpc, name).future(request, timeout=timeout)

        def done(f: grpc.Future) -> None:
            exc = f.exception()
            if exc is not None:  # a failed call's exception is its grpc.RpcError
                on_error(exc if isinstance(exc, grpc.RpcError) else CallError(grpc.StatusCode.UNKNOWN, repr(exc)))

        future.add_done_callback(done)

    def info(self) -> master_pb2.MasterInfoResponse | None:
        with self._lock:
            if self._info is not None or time.monotonic() < self._next_try:
                return self._info
            self._next_try = time.monotonic() + RETRY_S
        try:
            info = self._grpc.Info(master_pb2.MasterInfoRequest(), timeout=self._timeout)
        except grpc.RpcError as exc:
            log.debug("master Info from %s failed (%s); asked again in %.0f s", self.address, exc, RETRY_S)
            return None
        with self._lock:
            self._info = info
        return info

    def _wire_address(self) -> str | None:
        """The master's fast-call ``host:port`` (the host is the one dialed for gRPC); None: none, or not known."""
        info = self._info  # (known: no lock; a call that races _forget_info goes to the master it knew)
        if info is None:
            info = self.info()
        return f"{self._host}:{info.call_port}" if info is not None and info.call_port else None

    def _forget_info(self) -> None:
        """The fast-call listener stopped answering (a master restart may have moved it): ask Info again."""
        with self._lock:
            self._info = None

    def close(self) -> None:
        self._channel.close()


def leader_address(etcd: EtcdClient, cluster: str, timeout: float | None = None, shard: int = 0) -> str | None:
    """The gRPC address of the leader of ``cluster``'s index shard ``shard`` as etcd names it now; None if there
    is none."""
    kv = etcd.get(leader_key(cluster, shard), timeout=timeout)
    info = LeaderInfo.decode(kv.value) if kv is not None else None
    return info.address if info is not None else None


class MasterConnection(MasterCalls):
    """The current master of ``master`` (see the module docstring): a :class:`MasterApi` that follows the leader.

    ``pool``: the fast-call connections (None: every call over gRPC, as for ``kvpool status``). ``shard``: which
    index shard's leader to follow (:mod:`kvpool.shards`; only for an ``etcd://`` target).
    """

    def __init__(self, master: str, *, pool: ConnectionPool | None, timeout_s: float, max_message_bytes: int,
                 token: str = "", tls_ca: str = "", options: Sequence[tuple[str, Any]] = (),
                 etcd_access: EtcdAccess | None = None, refuse_start: bool = False, shard: int = 0):
        self.target = master
        self.shard = shard
        self._pool = pool
        self._timeout = timeout_s
        self._max_message = max_message_bytes
        self._token = token
        self._tls_ca = tls_ca
        self._options = list(options)
        self._lock = threading.Lock()
        self._etcd_target = EtcdTarget.parse(master)
        self._etcd = EtcdClient(self._etcd_target.endpoints, timeout_s=min(timeout_s, 2.0), access=etcd_access) \
            if self._etcd_target is not None else None
        self._refusal: str | None = None  # why etcd refused our credentials when last asked (None: it did not)
        self._master: DirectMaster | None = None
        self._why_none = f"no leading master known for {master}"  # why there is no master (while None)
        self._next_follow = 0.0
        self._following = False  # a background follow() is running (see failed)
        self._closed = False
        self._dialed = False
        self.changes = 0  # times the master dialed changed after the first (for tests and logs)
        if self._etcd is None:
            self._dial(master)
            return
        self._follow(force=True, log_refusal=not refuse_start)
        if refuse_start and self._refusal is not None:
            self._etcd.close()
            raise ValueError(f"etcd refused to name the master of {master}: {self._refusal}")

    @property
    def etcd(self) -> EtcdClient | None:
        """The etcd client that reads the leader (None for a fixed ``host:port``)."""
        return self._etcd

    @property
    def address(self) -> str | None:
        """The master dialed now (None: no leader known)."""
        with self._lock:
            return self._master.address if self._master is not None else None

    def _current(self, name: str) -> DirectMaster:
        with self._lock:
            master, why = self._master, self._why_none
        if master is None:
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"{name}: {why}")
        return master

    def call(self, name: str, request: Message, timeout: float | None) -> Any:
        """``name`` on the current master; a failure that may mean it moved (no master known included) makes the
        connection look again."""
        try:
            return self._current(name).call(name, request, timeout)
        except grpc.RpcError as exc:
            self.failed(exc)
            raise

    def call_nowait(self, name: str, request: Message, timeout: float | None, on_error: OnError) -> None:
        try:
            master = self._current(name)
        except CallError as exc:
            self.failed(exc)
            on_error(exc)
            return
        master.call_nowait(name, request, timeout, on_error)

    def info(self) -> master_pb2.MasterInfoResponse | None:
        with self._lock:
            master = self._master
        return master.info() if master is not None else None

    def follow(self, force: bool = False) -> bool:
        """Re-read the leader (at most every ``FOLLOW_S`` unless ``force``); True if the master dialed changed."""
        return self._follow(force, log_refusal=True)

    def _follow(self, force: bool, log_refusal: bool) -> bool:
        if self._etcd is None or self._etcd_target is None:
            return False
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next_follow:
                return False
            self._next_follow = now + FOLLOW_S
        try:
            address = leader_address(self._etcd, self._etcd_target.cluster, shard=self.shard)
        except EtcdRefused as exc:  # keeps the master it has, if any; logged once a reason
            if log_refusal and exc.details() != self._refusal:
                log.warning("kvpool: cannot follow the master of %s: %s; pool calls that need a master miss "
                            "until etcd accepts kvpool's etcd settings", self.target, exc.details())
            self._refusal = exc.details()
            return False
        except grpc.RpcError as exc:
            log.debug("cannot read the leader of %s from etcd (%s); keeping %s", self.target, exc.code().name,
                      self.address)
            return False
        self._refusal = None
        if address == self.address:
            return False
        if address is None:
            log.info("no leading master in %s now", self.target)
            self._replace(None, f"no leading master in {self.target} now")
            return True
        self._dial(address)
        log.info("following the leading master of %s at %s", self.target, address)
        return True

    def _dial(self, address: str) -> None:
        self._replace(DirectMaster(address, pool=self._pool, timeout_s=self._timeout,
                                   max_message_bytes=self._max_message, token=self._token, tls_ca=self._tls_ca,
                                   options=self._options))

    def _replace(self, master: DirectMaster | None, why_none: str = "") -> None:
        with self._lock:
            old, self._master = self._master, master
            if why_none:
                self._why_none = why_none
            if self._dialed:
                self.changes += 1
            self._dialed = True
        if old is not None:
            old.close()

    def failed(self, exc: grpc.RpcError) -> None:
        """A call failed: if the master may have moved, look again (rate limited), in the background: reading
        etcd must not stretch the failed call past its deadline. The next call goes to the leader found."""
        code = exc.code() if hasattr(exc, "code") else None
        if code not in _FOLLOW_CODES or self._etcd is None:
            return
        with self._lock:
            if self._following or time.monotonic() < self._next_follow:
                return
            self._following = True
        threading.Thread(target=self._follow_once, name="kvpool-follow-leader", daemon=True).start()

    def _follow_once(self) -> None:
        try:
            if not self._closed:
                self.follow()
        except Exception as exc:  # noqa: BLE001 - a background thread: say it, keep the master dialed
            if not self._closed:
                log.warning("following the leader of %s failed: %r", self.target, exc)
        finally:
            with self._lock:
                self._following = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            master, self._master = self._master, None
            self._why_none = f"the connection to {self.target} is closed"
        if master is not None:
            master.close()
        if self._etcd is not None:
            self._etcd.close()


class TenantMask:
    """This client's tenant mask, from the master's ``Info`` (:meth:`MasterApi.info`: asked once, shared with the
    fast-call address). Calling it returns the mask (b"": keys are stored as sent) or None (not known yet); once
    known it is kept (a tenant's mask is the same on every master of a cluster)."""

    def __init__(self, master: MasterApi):
        self._master = master
        self._known: bytes | None = None
        self._refused = b""  # the last malformed mask the master sent (logged once)

    def __call__(self) -> bytes | None:
        if self._known is not None:
            return self._known
        info = self._master.info()
        if info is None:
            return None
        if len(info.tenant_mask) not in (0, MASK_BYTES):
            if info.tenant_mask != self._refused:
                log.warning("master sent a tenant mask of %d bytes; ignoring it", len(info.tenant_mask))
                self._refused = info.tenant_mask
            return None
        self._known = bytes(info.tenant_mask)
        return self._known
