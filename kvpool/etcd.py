"""A small etcd v3 client over etcd's own gRPC API (the subset in ``proto/kvpool/v1/etcd.proto``).

What kvpool's master election and its followers need: read a key, create a
key only if it is absent (a transaction), delete a key only if it still holds
a value, and leases (grant, keep alive, revoke). No third-party etcd client:
the maintained ones pin protobuf or grpcio versions other than ours.

Invariants:
- Every call has a deadline (``timeout_s``); errors are ``grpc.RpcError``
  (``EtcdUnavailable`` when no endpoint answered).
- With several endpoints (members of one etcd cluster) a call that finds its
  endpoint unreachable is tried on the next one, in order; the endpoint that
  last answered is tried first.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvpool.v1 import etcd_pb2, etcd_pb2_grpc

T = TypeVar("T")
ETCD_SCHEME = "etcd://"


class EtcdUnavailable(grpc.RpcError):
    """No etcd endpoint answered."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def parse_endpoints(spec: str) -> list[str]:
    """``host:port`` endpoints from ``http://h1:2379,h2:2379`` (scheme optional); ValueError if malformed."""
    endpoints = []
    for part in spec.split(","):
        part = part.strip()
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                if scheme == "https://":
                    raise ValueError(f"etcd endpoint {part!r}: TLS to etcd is not supported; use http://")
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


def leader_key(cluster: str) -> bytes:
    """The etcd key whose value names ``cluster``'s leading master (absent: no leader now)."""
    return f"/kvpool/{check_cluster(cluster)}/master/leader".encode()


def members_prefix(cluster: str) -> bytes:
    """Where each running master of ``cluster`` keeps a key (its :class:`LeaderInfo`, under its own lease)."""
    return f"/kvpool/{check_cluster(cluster)}/master/members/".encode()


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


@dataclass(frozen=True)
class KeyValue:
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class EtcdClient:
    """Calls to one etcd cluster through any of its ``endpoints`` (thread-safe)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0):
        if not endpoints:
            raise ValueError("EtcdClient: no endpoints")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channels = [grpc.insecure_channel(e, options=[("grpc.initial_reconnect_backoff_ms", 100),
                                                             ("grpc.max_reconnect_backoff_ms", 1000)])
                          for e in self.endpoints]
        self._first = 0  # the endpoint that answered last

    def _call(self, make: Callable[[grpc.Channel], Callable[..., T]], request: Any, timeout: float | None) -> T:
        with self._lock:
            order = [(self._first + i) % len(self._channels) for i in range(len(self._channels))]
        last: grpc.RpcError | None = None
        for i in order:
            try:
                reply = make(self._channels[i])(request, timeout=self.timeout_s if timeout is None else timeout)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = exc
                continue
            with self._lock:
                self._first = i
            return reply
        details = last.details() if last is not None and hasattr(last, "details") else "no endpoint"
        raise EtcdUnavailable(f"etcd at {','.join(self.endpoints)} unavailable: {details}")

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
            def call(request: etcd_pb2.LeaseKeepAliveRequest, timeout: float) -> int:
                replies = etcd_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout=timeout)
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

    def status(self, endpoint: int = 0, timeout: float | None = None) -> etcd_pb2.StatusResponse:
        """One member's status (its version, raft leader and term): for ``kvpool status``."""
        stub = etcd_pb2_grpc.MaintenanceStub(self._channels[endpoint])
        return stub.Status(etcd_pb2.StatusRequest(), timeout=self.timeout_s if timeout is None else timeout)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
