"""A small etcd v3 client over etcd's own gRPC API (the subset in ``proto/kvpool/v1/etcd.proto``).

What kvpool's master election and its followers need: read a key, create a
key only if it is absent (a transaction), delete a key only if it still holds
a value, and leases (grant, keep alive, revoke). No third-party etcd client:
the maintained ones pin protobuf or grpcio versions other than ours.

How kvpool proves itself to etcd (:class:`EtcdAccess`, from the ``etcd_*``
settings of the master, node and client sections; docs/operations.md):
TLS (a CA, and a client certificate for etcd's ``--client-cert-auth``) and
etcd's user/password authentication: ``Authenticate`` gives a token sent
as gRPC metadata ``token`` with every call.

Invariants:
- Every call has a deadline (``timeout_s``); errors are ``grpc.RpcError``
  (``EtcdUnavailable`` when no endpoint answered, :class:`EtcdRefused` when
  etcd answered but refused kvpool's credentials: the TLS handshake, the
  user and password, or the role's permission).
- With several endpoints (members of one etcd cluster) a call that finds its
  endpoint unreachable is tried on the next one, in order; the endpoint that
  last answered is tried first.
- With a user, the client authenticates before its first call, and again
  when a call is refused for its token (expired, invalid, from an older auth
  revision, or none because etcd's auth was off when it last asked); that
  call is then tried once more. A refused ``Authenticate`` (wrong password,
  unknown user) is not asked again for ``AUTH_RETRY_S``: each try costs etcd
  a bcrypt.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvpool.rpc import StatusError
from kvpool.v1 import etcd_pb2, etcd_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
ETCD_SCHEME = "etcd://"
AUTH_RETRY_S = 5.0  # a refused Authenticate is not tried again sooner (each try costs etcd a bcrypt)
MAX_PASSWORD_FILE_BYTES = 4096
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
# etcd's errors (api/v3rpc/rpctypes) are told apart by their text: several share a gRPC code.
_TOKEN_ERRORS = ("etcdserver: invalid auth token", "etcdserver: revision of auth store is old",
                 "etcdserver: user name is empty")
_AUTH_FAILED = "etcdserver: authentication failed"
_AUTH_OFF = "etcdserver: authentication is not enabled"
_TLS_FAILURES = ("handshake", "tsi_", "ssl", "certificate")  # in gRPC's details of a refused TLS connection


class EtcdUnavailable(StatusError):
    """No etcd endpoint answered."""

    def __init__(self, details: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class EtcdRefused(StatusError):
    """etcd answered but refused kvpool's credentials (TLS, user and password, or the role's permission).

    Not a passing fault: the settings (or etcd's users and roles) need fixing.
    """


def endpoints_tls(spec: str) -> bool | None:
    """Whether ``spec``'s endpoints say TLS (``https://``: True, ``http://``: False); None if they name no scheme.
    ValueError if they disagree."""
    schemes = {part.strip().partition("://")[0] if "://" in part else "" for part in spec.split(",")}
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints {spec!r}: use one scheme for all (https:// with etcd_ca, or http://)")
    scheme = schemes.pop()
    if scheme not in ("", "http", "https"):
        raise ValueError(f"etcd endpoints {spec!r}: the scheme is http:// or https://, not {scheme}://")
    return None if scheme == "" else scheme == "https"


def parse_endpoints(spec: str) -> list[str]:
    """``host:port`` endpoints from ``http://h1:2379,h2:2379`` (scheme http:// or https://, optional, the same for
    all; :func:`endpoints_tls` says which); ValueError if malformed."""
    endpoints_tls(spec)
    endpoints = []
    for part in spec.split(","):
        part = part.strip()
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme):]
        part = part.rstrip("/")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r}: expected host:port")
        endpoints.append(part)
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    return endpoints


@dataclass(frozen=True)
class EtcdTarget:
    """A master named through etcd: ``etcd://h1:2379[,h2:2379]/CLUSTER``."""

    endpoints: tuple[str, ...]
    cluster: str

    @classmethod
    def parse(cls, target: str) -> EtcdTarget | None:
        """The target ``target`` names, or None for a plain ``host:port``; ValueError if malformed."""
        if not target.startswith(ETCD_SCHEME):
            return None
        rest = target[len(ETCD_SCHEME):]
        hosts, sep, cluster = rest.partition("/")
        if not sep or not cluster or "/" in cluster:
            raise ValueError(f"master {target!r}: expected etcd://HOST:PORT[,HOST:PORT]/CLUSTER")
        check_cluster(cluster)
        return cls(tuple(parse_endpoints(hosts)), cluster)


def check_cluster(name: str) -> str:
    """A cluster name: letters, digits, ``-``, ``_``, ``.`` (it is part of etcd keys)."""
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"cluster name {name!r}: use letters, digits, '-', '_' or '.'")
    return name


def cluster_prefix(cluster: str) -> bytes:
    """Every etcd key of ``cluster`` starts with this (the prefix an etcd role is granted: docs/operations.md)."""
    return f"/kvpool/{check_cluster(cluster)}/".encode()


def shard_prefix(cluster: str, shard: int = 0) -> bytes:
    """Where the master group that owns index shard ``shard`` of ``cluster`` keeps its keys.

    Shard 0 keeps the keys of an unsharded cluster (``/kvpool/CLUSTER/master/``), so a cluster of one
    shard is exactly what it was before shards existed; shard K > 0 uses ``/kvpool/CLUSTER/shard/K/master/``.
    """
    if shard < 0:
        raise ValueError(f"shard {shard}: shards are numbered from 0")
    return cluster_prefix(cluster) + (b"master/" if shard == 0 else b"shard/%d/master/" % shard)


def leader_key(cluster: str, shard: int = 0) -> bytes:
    """The etcd key whose value names the leading master of ``cluster``'s shard ``shard`` (absent: no leader now)."""
    return shard_prefix(cluster, shard) + b"leader"


def members_prefix(cluster: str, shard: int = 0) -> bytes:
    """Where each running master of ``cluster``'s shard ``shard`` keeps a key (its :class:`LeaderInfo`, under
    its own lease)."""
    return shard_prefix(cluster, shard) + b"members/"


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for every key that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


@dataclass(frozen=True)
class LeaderInfo:
    """What the leader key says: the leading master's gRPC ``address`` and a unique ``id`` per process."""

    address: str
    id: str

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "id": self.id}).encode()

    @staticmethod
    def decode(value: bytes) -> LeaderInfo | None:
        """The info in a leader key's value; None if it is not one."""
        try:
            data = json.loads(value)
            return LeaderInfo(str(data["address"]), str(data["id"]))
        except (ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def new(address: str) -> LeaderInfo:
        return LeaderInfo(address, uuid.uuid4().hex)


def read_password_file(path: str, where: str) -> str:
    """The password in the file at ``path``: its one line (a final newline is not part of it).

    ValueError naming ``where`` (the setting) if the file cannot be read, is not a regular file, is readable or
    writable by other users, is larger than ``MAX_PASSWORD_FILE_BYTES``, or does not hold one non-empty line.
    """
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"config {where}: {path} is not a regular file")
        if info.st_mode & 0o007:
            raise ValueError(f"config {where}: {path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                             f"a password file must not be: chmod o-rwx {path}")
        if info.st_size > MAX_PASSWORD_FILE_BYTES:
            raise ValueError(f"config {where}: {path} holds {info.st_size} bytes, more than a password "
                             f"(at most {MAX_PASSWORD_FILE_BYTES})")
        with open(path, "rb") as f:
            data = f.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"config {where}: cannot read {path}: {exc.strerror}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"config {where}: {path} is not UTF-8 text") from None
    password = text[:-1] if text.endswith("\n") else text
    password = password[:-1] if password.endswith("\r") else password
    if not password or "\n" in password or "\r" in password:
        raise ValueError(f"config {where}: {path} must hold the password on one line (and nothing else)")
    return password


@dataclass(frozen=True)
class EtcdAccess:
    """How kvpool proves itself to etcd: TLS credentials (None: plain HTTP/2) and a user with its password.

    Built at start from a config section's ``etcd_*`` settings (:meth:`from_config`), which reads the files.
    """

    credentials: grpc.ChannelCredentials | None = None
    user: str = ""
    password: str = field(default="", repr=False)

    @staticmethod
    def from_config(config: Any, section: str) -> EtcdAccess:
        """From ``config``'s ``etcd_ca``, ``etcd_cert``, ``etcd_key``, ``etcd_user`` and ``etcd_password_file``
        (checked together when the config was built); a file that cannot be read or used is a ValueError naming
        its setting."""
        from kvpool.tls import channel_credentials, client_context

        credentials = None
        if config.etcd_ca:
            try:
                client_context(config.etcd_ca)
            except ValueError as exc:
                raise ValueError(f"config {section}.etcd_ca: {exc}") from None
            try:
                credentials = channel_credentials(config.etcd_ca, config.etcd_cert, config.etcd_key)
            except ValueError as exc:
                raise ValueError(f"config {section}.etcd_cert / etcd_key: {exc}") from None
        password = read_password_file(config.etcd_password_file, f"{section}.etcd_password_file") \
            if config.etcd_password_file else ""
        return EtcdAccess(credentials, config.etcd_user, password)

    def channel(self, endpoint: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(endpoint, options=_RECONNECT)
        return grpc.secure_channel(endpoint, self.credentials, options=_RECONNECT)

    def describe(self) -> str:
        """Who this is to etcd, for messages: the user, or what else it has."""
        if self.user:
            return f"user {self.user!r}"
        return "no user (a client certificate's CN, if etcd takes it)" if self.credentials is not None else "no user"


def _tls_refused(exc: grpc.RpcError) -> bool:
    """Whether a failed connection was a TLS handshake refused by either side (not a passing fault)."""
    details = str(exc.details() if hasattr(exc, "details") else exc).lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(word in details for word in _TLS_FAILURES)


def _details(exc: grpc.RpcError) -> str:
    return str(exc.details()) if hasattr(exc, "details") else str(exc)


@dataclass(frozen=True)
class KeyValue:
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class EtcdClient:
    """Calls to one etcd cluster through any of its ``endpoints`` (thread-safe), as ``access`` (default: plain,
    no user)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0, access: EtcdAccess | None = None):
        if not endpoints:
            raise ValueError("EtcdClient: no endpoints")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.access = access if access is not None else EtcdAccess()
        self._lock = threading.Lock()
        self._channels = [self.access.channel(e) for e in self.endpoints]
        self._first = 0  # the endpoint that answered last
        self._auth_lock = threading.Lock()  # one Authenticate at a time
        self._token: str | None = None  # None: not asked yet; "": etcd's auth was off when asked
        self._refused: tuple[float, EtcdRefused] | None = None  # a refused Authenticate: (ask again after, error)
        self._warned_auth_off = False
        self.authentications = 0  # tokens etcd gave (the first, then renewals)

    def _call(self, make: Callable[[grpc.Channel], Callable[..., T]], request: Any, timeout: float | None) -> T:
        """One call, authenticated if there is a user (see the module docstring)."""
        token = self._token_now(timeout)
        try:
            return self._call_any(make, request, timeout, token)
        except grpc.RpcError as exc:
            if not (self.access.user and any(_details(exc).startswith(e) for e in _TOKEN_ERRORS)):
                raise self._refusal(exc) from None
        token = self._authenticate(timeout, stale=token)
        try:
            return self._call_any(make, request, timeout, token)
        except grpc.RpcError as exc:
            raise self._refusal(exc) from None

    def _refusal(self, exc: grpc.RpcError) -> grpc.RpcError:
        """``exc``, or an :class:`EtcdRefused` saying what to fix if it is etcd refusing who we are."""
        details = _details(exc)
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdRefused(exc.code(), f"etcd at {self._where()} denied {self.access.describe()} ({details})")
        if details.startswith("etcdserver: user name is empty"):
            return EtcdRefused(exc.code(), f"etcd at {self._where()} has authentication on and kvpool gave no "
                                           f"user: set etcd_user and etcd_password_file ({details})")
        return exc

    def _where(self) -> str:
        return ",".join(self.endpoints)

    def _token_now(self, timeout: float | None) -> str | None:
        if not self.access.user:
            return None
        with self._lock:
            token = self._token
        return self._authenticate(timeout, stale=None) if token is None else token

    def _authenticate(self, timeout: float | None, stale: str | None) -> str:
        """A token for the user: etcd's answer to ``Authenticate``, unless another thread already replaced
        ``stale`` (the token a call was refused for). "" if etcd's auth is off."""
        with self._auth_lock:
            with self._lock:
                if self._token is not None and self._token != stale:
                    return self._token
            if self._refused is not None and time.monotonic() < self._refused[0]:
                raise self._refused[1]
            request = etcd_pb2.AuthenticateRequest(name=self.access.user, password=self.access.password)
            try:
                reply = self._call_any(lambda c: etcd_pb2_grpc.AuthStub(c).Authenticate, request, timeout, None)
            except grpc.RpcError as exc:
                details = _details(exc)
                if details.startswith(_AUTH_OFF):
                    if not self._warned_auth_off:
                        self._warned_auth_off = True
                        log.warning("etcd at %s has authentication off: kvpool's user %r is not needed, and anyone "
                                    "who reaches etcd can write kvpool's keys (docs/operations.md)", self._where(),
                                    self.access.user)
                    with self._lock:
                        self._token = ""
                    return ""
                if details.startswith(_AUTH_FAILED):
                    refused = EtcdRefused(exc.code(), f"etcd at {self._where()} refused user "
                                                      f"{self.access.user!r}: wrong password or no such user "
                                                      f"({details})")
                    self._refused = (time.monotonic() + AUTH_RETRY_S, refused)
                    raise refused from None
                raise
            self._refused = None
            self.authentications += 1
            with self._lock:
                self._token = reply.token
            return reply.token

    def _call_any(self, make: Callable[[grpc.Channel], Callable[..., T]], request: Any, timeout: float | None,
                  token: str | None) -> T:
        """One call on the first endpoint that answers; EtcdRefused if none answered and one refused our TLS."""
        with self._lock:
            order = [(self._first + i) % len(self._channels) for i in range(len(self._channels))]
        metadata = (("token", token),) if token else None
        last: grpc.RpcError | None = None
        tls_refused: tuple[str, grpc.RpcError] | None = None
        for i in order:
            try:
                reply = make(self._channels[i])(request, timeout=self.timeout_s if timeout is None else timeout,
                                                metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if _tls_refused(exc):
                    tls_refused = (self.endpoints[i], exc)
                last = exc
                continue
            with self._lock:
                self._first = i
            return reply
        if tls_refused is not None:
            endpoint, failed = tls_refused
            raise EtcdRefused(failed.code(), f"etcd at {endpoint} refused the TLS connection, or kvpool refused its "
                                             f"certificate: check etcd_ca, etcd_cert and etcd_key ({_details(failed)})")
        details = _details(last) if last is not None else "no endpoint"
        raise EtcdUnavailable(f"etcd at {self._where()} unavailable: {details}")

    def get(self, key: bytes, timeout: float | None = None) -> KeyValue | None:
        reply = self._call(lambda c: etcd_pb2_grpc.KVStub(c).Range, etcd_pb2.RangeRequest(key=key), timeout)
        if not reply.kvs:
            return None
        kv = reply.kvs[0]
        return KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease)

    def get_prefix(self, prefix: bytes, timeout: float | None = None) -> list[tuple[bytes, KeyValue]]:
        """Every key starting with ``prefix``, with its value, in key order."""
        reply = self._call(lambda c: etcd_pb2_grpc.KVStub(c).Range,
                           etcd_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout)
        return [(kv.key, KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease)) for kv in reply.kvs]

    def create(self, key: bytes, value: bytes, lease: int, timeout: float | None = None) -> KeyValue | None:
        """Put ``key`` = ``value`` under ``lease`` if the key is absent; None if created, else what it holds."""
        absent = etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.CREATE, key=key,
                                  create_revision=0)
        request = etcd_pb2.TxnRequest(
            compare=[absent], success=[etcd_pb2.RequestOp(request_put=etcd_pb2.PutRequest(key=key, value=value,
                                                                                         lease=lease))],
            failure=[etcd_pb2.RequestOp(request_range=etcd_pb2.RangeRequest(key=key))])
        reply = self._call(lambda c: etcd_pb2_grpc.KVStub(c).Txn, request, timeout)
        if reply.succeeded:
            return None
        kvs = reply.responses[0].response_range.kvs if reply.responses else []
        if not kvs:  # gone between the compare and the read cannot happen in one txn; be safe
            return KeyValue(b"", 0, 0, 0)
        return KeyValue(kvs[0].value, kvs[0].create_revision, kvs[0].mod_revision, kvs[0].lease)

    def delete_if(self, key: bytes, value: bytes, timeout: float | None = None) -> bool:
        """Delete ``key`` if it still holds ``value``; True if it did."""
        same = etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.VALUE, key=key, value=value)
        request = etcd_pb2.TxnRequest(
            compare=[same], success=[etcd_pb2.RequestOp(request_delete_range=etcd_pb2.DeleteRangeRequest(key=key))])
        return self._call(lambda c: etcd_pb2_grpc.KVStub(c).Txn, request, timeout).succeeded

    def put_if(self, key: bytes, value: bytes, lease: int, timeout: float | None = None) -> bool:
        """Write ``key`` = ``value`` under ``lease`` again if it holds ``value`` now (its mod revision moves on);
        True if it did."""
        same = etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.VALUE, key=key, value=value)
        request = etcd_pb2.TxnRequest(
            compare=[same], success=[etcd_pb2.RequestOp(request_put=etcd_pb2.PutRequest(key=key, value=value,
                                                                                        lease=lease))])
        return self._call(lambda c: etcd_pb2_grpc.KVStub(c).Txn, request, timeout).succeeded

    def put(self, key: bytes, value: bytes, lease: int = 0, timeout: float | None = None) -> None:
        self._call(lambda c: etcd_pb2_grpc.KVStub(c).Put, etcd_pb2.PutRequest(key=key, value=value, lease=lease),
                   timeout)

    def grant(self, ttl_s: int, timeout: float | None = None) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds)."""
        reply = self._call(lambda c: etcd_pb2_grpc.LeaseStub(c).LeaseGrant, etcd_pb2.LeaseGrantRequest(TTL=ttl_s),
                           timeout)
        if reply.error:
            raise EtcdUnavailable(f"etcd refused a lease: {reply.error}")
        return reply.ID, reply.TTL

    def keep_alive(self, lease: int, timeout: float | None = None) -> int:
        """Renew ``lease`` once; its TTL from now in seconds (0 or less: the lease is gone)."""

        def once(channel: grpc.Channel) -> Callable[..., int]:
            def call(request: etcd_pb2.LeaseKeepAliveRequest, timeout: float, metadata: Any = None) -> int:
                replies = etcd_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout=timeout,
                                                                          metadata=metadata)
                try:
                    for reply in replies:
                        return reply.TTL
                finally:
                    replies.cancel()
                return 0
            return call

        return self._call(once, etcd_pb2.LeaseKeepAliveRequest(ID=lease), timeout)

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        self._call(lambda c: etcd_pb2_grpc.LeaseStub(c).LeaseRevoke, etcd_pb2.LeaseRevokeRequest(ID=lease), timeout)

    def check(self, key: bytes, write: bool, timeout: float | None = None) -> None:
        """Whether etcd lets this client read ``key`` (and, with ``write``, write it), changing nothing: returns if
        so, else :class:`EtcdRefused` (TLS, user, permission) or another ``grpc.RpcError`` (unreachable...).

        The write check is a transaction whose condition never holds (a version below 0) with a put of ``key``:
        etcd checks the permissions of every operation in it, and applies none.
        """
        if not write:
            self.get(key, timeout)
            return
        never = etcd_pb2.Compare(result=etcd_pb2.Compare.LESS, target=etcd_pb2.Compare.VERSION, key=key, version=0)
        request = etcd_pb2.TxnRequest(compare=[never],
                                      success=[etcd_pb2.RequestOp(request_put=etcd_pb2.PutRequest(key=key))],
                                      failure=[etcd_pb2.RequestOp(request_range=etcd_pb2.RangeRequest(key=key))])
        if self._call(lambda c: etcd_pb2_grpc.KVStub(c).Txn, request, timeout).succeeded:
            raise AssertionError(f"etcd applied a transaction whose condition cannot hold, on {key!r}")

    def status(self, endpoint: int = 0, timeout: float | None = None) -> etcd_pb2.StatusResponse:
        """One member's status (its version, raft leader and term): for ``kvpool status``."""
        stub = etcd_pb2_grpc.MaintenanceStub(self._channels[endpoint])
        return stub.Status(etcd_pb2.StatusRequest(), timeout=self.timeout_s if timeout is None else timeout)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
