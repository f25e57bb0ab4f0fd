"""The stubs of the current master, for a node or a client: a fixed ``host:port``, or the leader etcd names.

``master`` is either ``host:port`` or ``etcd://HOST:PORT[,HOST:PORT]/CLUSTER``
(the form Mooncake's users know). For the second, :class:`MasterConnection`
reads the cluster's leader key (:func:`kvpool.etcd.leader_key`) and dials the
master it names; a call that fails (the leader died, or the master answered
that it stands by) makes it read the key again, at most every ``FOLLOW_S``,
and dial the new leader if it moved. Nodes re-register and clients simply
call the new leader: no restart.

Invariants:
- :attr:`MasterConnection.stub` (fast calls over the wire, gRPC as the
  fallback) and :attr:`MasterConnection.grpc_stub` always belong to one master;
  a change closes the old channel after building the new one.
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
from collections.abc import Sequence
from typing import Any

import grpc

from kvpool.calls import FastStub, MasterCallAddress
from kvpool.etcd import EtcdAccess, EtcdClient, EtcdRefused, EtcdTarget, LeaderInfo, leader_key
from kvpool.framing import ConnectionPool
from kvpool.rpc import make_channel
from kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.wire import MASTER_CALLS, CallError

log = logging.getLogger(__name__)

FOLLOW_S = 0.25  # a failed call re-reads the leader key at most this often
_SERVICE = master_pb2.DESCRIPTOR.services_by_name["Master"]
_FOLLOW_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def leader_address(etcd: EtcdClient, cluster: str, timeout: float | None = None) -> str | None:
    """The gRPC address of ``cluster``'s leader as etcd names it now; None if there is none."""
    kv = etcd.get(leader_key(cluster), timeout=timeout)
    info = LeaderInfo.decode(kv.value) if kv is not None else None
    return info.address if info is not None else None


class _NoMaster:
    """Stands in for the stubs while no leader is known: every method raises UNAVAILABLE."""

    def __init__(self, why: str):
        self._why = why

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Refusing(f"{name}: {self._why}")


class _Refusing:
    def __init__(self, why: str):
        self._why = why

    def __call__(self, request: Any, timeout: float | None = None) -> Any:
        raise CallError(grpc.StatusCode.UNAVAILABLE, self._why)

    def future(self, request: Any, timeout: float | None = None) -> Any:
        raise CallError(grpc.StatusCode.UNAVAILABLE, self._why)


class MasterConnection:
    """The current master's stubs (see the module docstring). Thread-safe."""

    def __init__(self, master: str, *, pool: ConnectionPool, timeout_s: float, max_message_bytes: int,
                 token: str = "", tls_ca: str = "", options: Sequence[tuple[str, Any]] = (),
                 etcd_access: EtcdAccess | None = None, refuse_start: bool = False):
        self.target = master
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
        self._channel: grpc.Channel | None = None
        self._address: str | None = None
        self._grpc: Any = _NoMaster(f"no leading master known for {master}")
        self._stub: Any = self._grpc
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
            return self._address

    @property
    def stub(self) -> Any:
        """The current master's :class:`~kvpool.calls.FastStub` (hot calls over the wire)."""
        return _Following(self, fast=True)

    @property
    def grpc_stub(self) -> Any:
        """The current master's plain gRPC stub."""
        return _Following(self, fast=False)

    def current(self, fast: bool) -> Any:
        with self._lock:
            return self._stub if fast else self._grpc

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
            address = leader_address(self._etcd, self._etcd_target.cluster)
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
            self._replace(None, None, _NoMaster(f"no leading master in {self.target} now"))
            return True
        self._dial(address)
        log.info("following the leading master of %s at %s", self.target, address)
        return True

    def _dial(self, address: str) -> None:
        channel = make_channel(address, max_message_bytes=self._max_message, token=self._token,
                               tls_ca=self._tls_ca, options=self._options)
        grpc_stub = master_pb2_grpc.MasterStub(channel)
        calls = MasterCallAddress(grpc_stub, address, self._timeout)
        fast = FastStub(grpc_stub, _SERVICE, MASTER_CALLS, self._pool, calls, on_unreachable=calls.forget,
                        max_reply_bytes=self._max_message)
        self._replace(address, channel, grpc_stub, fast)

    def _replace(self, address: str | None, channel: grpc.Channel | None, grpc_stub: Any,
                 fast: Any = None) -> None:
        with self._lock:
            old, self._channel = self._channel, channel
            if self._dialed:
                self.changes += 1
            self._dialed = True
            self._address, self._grpc, self._stub = address, grpc_stub, fast if fast is not None else grpc_stub
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
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        if self._etcd is not None:
            self._etcd.close()


class _Following:
    """A stub that calls the connection's current master and follows it when a call fails."""

    def __init__(self, connection: MasterConnection, fast: bool):
        self._connection = connection
        self._fast = fast

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._connection, self._fast, name)


class _Method:
    def __init__(self, connection: MasterConnection, fast: bool, name: str):
        self._connection = connection
        self._fast = fast
        self._name = name

    def __call__(self, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._connection.current(self._fast), self._name)(request, timeout=timeout)
        except grpc.RpcError as exc:
            self._connection.failed(exc)
            raise

    def future(self, request: Any, timeout: float | None = None) -> Any:
        return getattr(self._connection.current(False), self._name).future(request, timeout=timeout)
