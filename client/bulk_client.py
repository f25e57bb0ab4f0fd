"""The client end of the wire's bulk GET and PUT (:mod:`kvpool.wire`), with pooled connections per node.

- Connections are pooled per node address (at most ``max_idle_per_node``
  kept idle); one exchange at a time per connection. A client may share one
  pool with fast calls to the same node (``pool``): one AUTH per connection
  serves both.
- GET receives each block straight into the caller's output buffer
  (scattered ``recvmsg_into``, no intermediate copy) when its size and the
  node's checksum are what the caller expects, then verifies the bytes
  against the expected checksum: a block is OK only if they match.
- PUT sends the caller's buffers as they are (gathered ``sendmsg``).
- :class:`BulkUnavailable`: no connection could be made (the caller falls
  back to gRPC). :class:`BulkFailed`: the node replied with an error (the
  connection stays pooled), a full listener refused the connection, or an
  exchange broke (the connection is dropped); the caller hands the blocks to
  the next path. A pooled connection the node had closed meanwhile (e.g. to
  make room) is retried once on a fresh one, before any reply byte.
- With a token, each new connection first sends AUTH; a refusal is a
  :class:`BulkFailed` of kind ``unauthenticated``. With a TLS context,
  connections are TLS, checked against the host dialed.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey
from kvpool.tcp import (
    ConnectFailed,
    ConnectionPool,
    Exchange,
    Refused,
    is_timeout,
    recv_buffers,
    recv_exact,
    send_buffers,
    set_io_timeout,
)
from kvpool.v1 import node_pb2
from kvpool.wire import CALL_SLACK_BYTES, CallError, Head, Method, auth_hello, read_reply, request_frame, status_error

# Per-block outcome of a GET.
T = TypeVar("T")
OK = 0
GONE = 1  # the node does not hold it (any more), or its slot was reused while it was sent
CHANGED = 2  # the node holds a block of another size or checksum under the key
CORRUPT = 3  # the bytes arrived but do not match the checksum


MAX_BLOCK_BYTES = 1 << 40  # a larger size in a reply is a protocol error, not an allocation
_DISCARD_BYTES = 1 << 20
_RECV_GROUP_BYTES = 1 << 20  # a GET receives about this much per call and hashes it before the next
_REPLY_BYTES_PER_KEY = 24  # a BulkGetReply's bytes per key at most: tier 1, size <= 11, checksum 9, rounded up


class BulkUnavailable(ConnectionError):
    """The node's wire listener cannot be reached."""


class BulkFailed(RuntimeError):
    """An exchange failed after connecting; ``kind`` labels it for the error counter."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _malformed(what: str) -> CallError:
    return CallError(grpc.StatusCode.INTERNAL, f"malformed reply: {what}")


class BulkClient:
    """Pooled wire connections to any number of nodes, for bulk GET and PUT (thread-safe)."""

    def __init__(self, timeout_s: float, *, connect_timeout_s: float | None = None, max_idle_per_node: int = 4,
                 token: str = "", tls: ssl.SSLContext | None = None, pool: ConnectionPool | None = None):
        self._own_pool = pool is None
        self._pool = pool if pool is not None else ConnectionPool(
            timeout_s, connect_timeout_s=connect_timeout_s, max_idle_per_address=max_idle_per_node, tls=tls,
            hello=auth_hello(token) if token else None)

    def _exchange(self, address: str, fn: Callable[..., tuple[Head, bytes, T]], *args: Any,
                  timeout: float | None = None) -> T:
        try:
            head, message, result = self._pool.exchange(address, fn, *args, timeout=timeout)
        except Refused as exc:  # a full listener: nothing of the request was read
            raise BulkFailed("bulk_refused", str(exc)) from exc
        except ConnectFailed as exc:
            raise BulkUnavailable(str(exc)) from exc
        except CallError as exc:  # a refused AUTH, or a reply out of step (the connection was dropped)
            kind = "unauthenticated" if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "bulk_error"
            raise BulkFailed(kind, exc.details()) from exc
        except OSError as exc:  # includes timeouts and resets
            raise BulkFailed("timeout" if is_timeout(exc) else "bulk_io", str(exc)) from exc
        if head.code != 0:  # an error reply: the connection stays pooled
            error = status_error(head, message)
            kind = "unauthenticated" if error.code() == grpc.StatusCode.UNAUTHENTICATED else "bulk_error"
            raise BulkFailed(kind, error.details())
        return result

    def close(self) -> None:
        if self._own_pool:
            self._pool.close()

    # -- GET ------------------------------------------------------------------------------------------

    def get_into(self, address: str, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
                 checksums: Sequence[int], timeout: float | None = None) -> list[int]:
        """Fill ``outs`` (flat uint8 arrays of the expected sizes); per key OK, GONE, CHANGED or CORRUPT.

        ``timeout``: connecting and every receive or send of it stall at most this long (and the pool's
        timeout); bytes that keep coming are not cut."""
        return self._exchange(address, self._get, keys, outs, checksums, timeout=timeout)

    @staticmethod
    def _get(sock: socket.socket, state: Exchange, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
             checksums: Sequence[int]) -> tuple[Head, bytes, list[int]]:
        n = len(keys)
        send_buffers(sock, request_frame(Method.GET, node_pb2.GetRequest(keys=b"".join(keys))))
        head, body = read_reply(sock, state, n * _REPLY_BYTES_PER_KEY + CALL_SLACK_BYTES)
        if head.code != 0:
            return head, body, []
        try:
            reply = node_pb2.BulkGetReply.FromString(body)
        except DecodeError as exc:
            raise _malformed(f"undecodable GET reply: {exc}") from exc
        if not len(reply.sizes) == len(reply.checksums) == len(reply.tiers) == n:
            raise _malformed(f"a GET reply for {len(reply.sizes)} keys, not {n}")
        sizes = np.fromiter(reply.sizes, dtype=np.uint64, count=n)
        sums = np.fromiter(reply.checksums, dtype=np.uint64, count=n)
        if int(sizes.max(initial=0)) > MAX_BLOCK_BYTES or head.payload != int(sizes.sum()):
            raise _malformed(f"a payload of {head.payload} bytes for blocks of {int(sizes.sum())}")
        if head.trailer > n + CALL_SLACK_BYTES:
            raise _malformed(f"a trailer of {head.trailer} bytes")
        want_sizes = np.fromiter((o.size for o in outs), dtype=np.uint64, count=n)
        want_sums = np.fromiter(checksums, dtype=np.uint64, count=n)
        match = (sizes == want_sizes) & (sums == want_sums)
        status = np.where(sizes == 0, GONE, np.where(match, OK, CHANGED))
        discard = np.empty(_DISCARD_BYTES, dtype=np.uint8) if not match[sizes != 0].all() else None
        group: list[np.ndarray] = []  # buffers received in one call, then the blocks among them hashed
        hashed: list[int] = []
        landed: dict[int, int] = {}  # block -> checksum of what landed in its output
        group_bytes = 0
        for j in np.flatnonzero(sizes).tolist():  # the blocks sent, in order
            if match[j]:
                group.append(outs[j])
                hashed.append(j)
            else:  # not what we asked for: read past it, a piece of scratch at a time
                size = int(sizes[j])
                pieces = range(0, size, _DISCARD_BYTES)
                group += [discard[: min(_DISCARD_BYTES, size - o)] for o in pieces]  # type: ignore[index]
            group_bytes += int(sizes[j])
            if group_bytes >= _RECV_GROUP_BYTES:  # hash these while the kernel buffers the next blocks
                recv_buffers(sock, group)
                landed.update((k, block_checksum(outs[k])) for k in hashed)
                group, hashed, group_bytes = [], [], 0
        recv_buffers(sock, group)
        landed.update((k, block_checksum(outs[k])) for k in hashed)
        try:
            valid = node_pb2.BulkGetTrailer.FromString(bytes(recv_exact(sock, head.trailer))).valid
        except DecodeError as exc:
            raise _malformed(f"undecodable GET trailer: {exc}") from exc
        if len(valid) != n:
            raise _malformed(f"a GET trailer for {len(valid)} keys, not {n}")
        status[(status == OK) & (np.frombuffer(valid, dtype=np.uint8) == 0)] = GONE
        for j in np.flatnonzero(status == OK).tolist():
            if landed[j] != checksums[j]:
                status[j] = CORRUPT
        return head, body, status.tolist()

    # -- PUT ------------------------------------------------------------------------------------------

    def put(self, address: str, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
            checksums: Sequence[int], timeout: float | None = None) -> list[bool]:
        """Store blocks (flat uint8 arrays) with their checksums; per key, stored or already held (``timeout``:
        as :meth:`get_into`)."""
        return self._exchange(address, self._put, keys, values, checksums, timeout=timeout)

    @staticmethod
    def _put(sock: socket.socket, state: Exchange, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
             checksums: Sequence[int]) -> tuple[Head, bytes, list[bool]]:
        n = len(keys)
        sizes = [int(v.size) for v in values]
        header = node_pb2.BulkPutRequest(keys=b"".join(keys), sizes=sizes, checksums=list(checksums))
        try:
            send_buffers(sock, [*request_frame(Method.PUT, header, sum(sizes)), *values])
        except OSError as exc:  # the node may have refused the frame before its payload (over its limit): why?
            try:
                set_io_timeout(sock, 0.5)
                head, body = read_reply(sock, state, 0)
            except OSError:
                raise exc from None
            if head.code == 0:
                raise
            raise status_error(head, body) from exc
        head, body = read_reply(sock, state, n + CALL_SLACK_BYTES)
        if head.code != 0:
            return head, body, []
        if head.payload or head.trailer:
            raise _malformed("a PUT reply with a payload")
        try:
            stored = node_pb2.PutResponse.FromString(body).stored
        except DecodeError as exc:
            raise _malformed(f"undecodable PUT reply: {exc}") from exc
        if len(stored) != n:
            raise _malformed(f"a PUT reply for {len(stored)} keys, not {n}")
        return head, body, [b != 0 for b in stored]
