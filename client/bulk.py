"""The client end of a node's bulk TCP listener (protocol: :mod:`kvpool.bulkwire`).

- Connections are pooled per node address (at most ``max_idle_per_node``
  kept idle); one exchange at a time per connection.
- GET receives each block straight into the caller's output buffer
  (scattered ``recvmsg_into``, no intermediate copy) when its size and the
  node's checksum are what the caller expects, then verifies the bytes
  against the expected checksum: a block is OK only if they match.
- PUT sends the caller's buffers as they are (gathered ``sendmsg``).
- :class:`BulkUnavailable`: no connection could be made (the caller falls
  back to gRPC). :class:`BulkFailed`: an exchange broke or the node replied
  with an error (a full listener's refusal included); the connection is
  dropped and the caller hands the blocks to the next path. A pooled
  connection the node had closed meanwhile (e.g. to make room) is retried
  once on a fresh one, before any reply byte.
- With a token, each new connection first sends AUTH (bulk op 3); a refusal
  is a :class:`BulkFailed` of kind ``unauthenticated``. With a TLS context,
  connections are TLS, checked against the host dialed.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvpool.bulkwire import OP_AUTH, OP_GET, OP_PUT, ProtocolError, read_reply_header, request_header
from kvpool.checksum import block_checksum
from kvpool.framing import (
    ConnectFailed,
    ConnectionPool,
    Exchange,
    is_timeout,
    recv_buffers,
    recv_exact,
    send_buffers,
    set_io_timeout,
)
from kvpool.keys import BlockKey

# Per-block outcome of a GET.
T = TypeVar("T")
OK = 0
GONE = 1  # the node does not hold it (any more), or its slot was reused while it was sent
CHANGED = 2  # the node holds a block of another size or checksum under the key
CORRUPT = 3  # the bytes arrived but do not match the checksum


MAX_BLOCK_BYTES = 1 << 40  # a larger size in a reply is a protocol error, not an allocation
_DISCARD_BYTES = 1 << 20


class BulkUnavailable(ConnectionError):
    """The node's bulk listener cannot be reached."""


class BulkFailed(RuntimeError):
    """An exchange failed after connecting; ``kind`` labels it for the error counter."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def auth_hello(token: str) -> Callable[[socket.socket], None]:
    """A :class:`~kvpool.framing.ConnectionPool` ``hello``: bulk AUTH.

    Raises ProtocolError with the node's message if refused (an unknown token, or a full listener).
    """
    body = token.encode()

    def hello(sock: socket.socket) -> None:
        send_buffers(sock, [request_header(OP_AUTH, len(body)), body])
        read_reply_header(sock, OP_AUTH, 0)

    return hello


class BulkClient:
    """Pooled bulk connections to any number of nodes (thread-safe)."""

    def __init__(self, timeout_s: float, *, connect_timeout_s: float | None = None, max_idle_per_node: int = 4,
                 token: str = "", tls: ssl.SSLContext | None = None):
        self._pool = ConnectionPool(timeout_s, connect_timeout_s=connect_timeout_s,
                                    max_idle_per_address=max_idle_per_node, tls=tls,
                                    hello=auth_hello(token) if token else None)

    def _exchange(self, address: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return self._pool.exchange(address, fn, *args)
        except ConnectFailed as exc:
            raise BulkUnavailable(str(exc)) from exc
        except ProtocolError as exc:
            kind = "unauthenticated" if str(exc).startswith("unauthenticated") else "bulk_error"
            raise BulkFailed(kind, str(exc)) from exc
        except OSError as exc:  # includes timeouts and resets
            raise BulkFailed("timeout" if is_timeout(exc) else "bulk_io", str(exc)) from exc

    def close(self) -> None:
        self._pool.close()

    # -- GET ------------------------------------------------------------------------------------------

    def get_into(self, address: str, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
                 checksums: Sequence[int]) -> list[int]:
        """Fill ``outs`` (flat uint8 arrays of the expected sizes); per key OK, GONE, CHANGED or CORRUPT."""
        return self._exchange(address, self._get, keys, outs, checksums)

    @staticmethod
    def _get(sock: socket.socket, state: Exchange, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
             checksums: Sequence[int]) -> list[int]:
        n = len(keys)
        send_buffers(sock, [request_header(OP_GET, n), b"".join(keys)])
        read_reply_header(sock, OP_GET, n)
        state.replied = True
        sizes = np.empty(n, dtype="<u8")
        sums = np.empty(n, dtype="<u8")
        tiers = np.empty(n, dtype=np.uint8)
        recv_buffers(sock, [sizes, sums, tiers])
        want_sizes = np.fromiter((o.size for o in outs), dtype="<u8", count=n)
        want_sums = np.fromiter(checksums, dtype="<u8", count=n)
        match = (sizes == want_sizes) & (sums == want_sums)
        status = np.where(sizes == 0, GONE, np.where(match, OK, CHANGED))
        if int(sizes.max(initial=0)) > MAX_BLOCK_BYTES:
            raise ProtocolError(f"the node announced a block of {int(sizes.max())} bytes")
        plan = []
        discard = np.empty(_DISCARD_BYTES, dtype=np.uint8) if not match[sizes != 0].all() else None
        for j in np.flatnonzero(sizes).tolist():  # the blocks sent, in order
            if match[j]:
                plan.append(outs[j])
            else:  # not what we asked for: read past it, a piece of scratch at a time
                size = int(sizes[j])
                pieces = range(0, size, _DISCARD_BYTES)
                plan += [discard[: min(_DISCARD_BYTES, size - o)] for o in pieces]  # type: ignore[index]
        recv_buffers(sock, plan)
        valid = np.frombuffer(recv_exact(sock, n), dtype=np.uint8)
        status[(status == OK) & (valid == 0)] = GONE
        for j in np.flatnonzero(status == OK).tolist():
            if block_checksum(outs[j]) != checksums[j]:
                status[j] = CORRUPT
        return status.tolist()

    # -- PUT ------------------------------------------------------------------------------------------

    def put(self, address: str, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
            checksums: Sequence[int]) -> list[bool]:
        """Store blocks (flat uint8 arrays) with their checksums; per key, stored or already held."""
        return self._exchange(address, self._put, keys, values, checksums)

    @staticmethod
    def _put(sock: socket.socket, state: Exchange, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
             checksums: Sequence[int]) -> list[bool]:
        n = len(keys)
        sizes = np.fromiter((v.size for v in values), dtype="<u8", count=n)
        sums = np.fromiter(checksums, dtype="<u8", count=n)
        try:
            send_buffers(sock, [request_header(OP_PUT, n), b"".join(keys), sizes, sums, *values])
        except OSError:
            # the node may have refused the request before reading its data: surface its message
            try:
                set_io_timeout(sock, 0.5)
                read_reply_header(sock, OP_PUT, n)
            except (OSError, ProtocolError) as exc:
                if isinstance(exc, ProtocolError):
                    raise
            raise
        read_reply_header(sock, OP_PUT, n)
        state.replied = True
        return [b != 0 for b in recv_exact(sock, n)]
