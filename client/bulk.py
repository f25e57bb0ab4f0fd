"""The client end of a node's bulk TCP listener (protocol: :mod:`kvpool.node.bulk`).

- Connections are pooled per node address (at most ``max_idle_per_node``
  kept idle); one exchange at a time per connection.
- GET receives each block straight into the caller's output buffer
  (scattered ``recvmsg_into``, no intermediate copy) when its size and the
  node's checksum are what the caller expects, then verifies the bytes
  against the expected checksum: a block is OK only if they match.
- PUT sends the caller's buffers as they are (gathered ``sendmsg``).
- :class:`BulkUnavailable`: no connection could be made (the caller falls
  back to gRPC). :class:`BulkFailed`: an exchange broke or the node replied
  with an error; the connection is dropped. A pooled connection the node had
  closed meanwhile is retried once on a fresh one, before any reply byte.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

import numpy as np

from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey
from kvpool.node.bulk import (
    OP_GET,
    OP_PUT,
    ProtocolError,
    is_timeout,
    read_reply_header,
    recv_buffers,
    recv_exact,
    request_header,
    send_buffers,
    set_io_timeout,
)

# Per-block outcome of a GET.
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


class _Exchange:
    replied = False  # has any reply byte arrived? (until then a stale pooled connection may be retried)


class BulkClient:
    """Pooled bulk connections to any number of nodes (thread-safe)."""

    def __init__(self, timeout_s: float, *, connect_timeout_s: float | None = None, max_idle_per_node: int = 4):
        self.timeout_s = timeout_s
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.max_idle_per_node = max_idle_per_node
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False

    # -- connections ------------------------------------------------------------------------------

    def _acquire(self, address: str) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise BulkUnavailable("bulk client is closed")
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.connect_timeout_s)
        except (OSError, ValueError) as exc:
            raise BulkUnavailable(f"cannot connect to {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_io_timeout(sock, self.timeout_s)
        return sock, False

    def _release(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.max_idle_per_node:
                idle.append(sock)
                return
        sock.close()

    def _exchange(self, address: str, fn, *args):  # type: ignore[no-untyped-def]
        for attempt in range(2):
            sock, reused = self._acquire(address)
            state = _Exchange()
            try:
                result = fn(sock, state, *args)
            except ProtocolError as exc:
                sock.close()
                raise BulkFailed("bulk_error", str(exc)) from exc
            except OSError as exc:  # includes timeouts and resets
                sock.close()
                if reused and not state.replied and attempt == 0:
                    continue  # the node closed this idle connection: try a fresh one
                raise BulkFailed("timeout" if is_timeout(exc) else "bulk_io", str(exc)) from exc
            except BaseException:
                sock.close()
                raise
            self._release(address, sock)
            return result
        raise AssertionError("bulk client: retry loop fell through")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()

    # -- GET ------------------------------------------------------------------------------------------

    def get_into(self, address: str, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
                 checksums: Sequence[int]) -> list[int]:
        """Fill ``outs`` (flat uint8 arrays of the expected sizes); per key OK, GONE, CHANGED or CORRUPT."""
        return self._exchange(address, self._get, keys, outs, checksums)

    @staticmethod
    def _get(sock: socket.socket, state: _Exchange, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
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
    def _put(sock: socket.socket, state: _Exchange, keys: Sequence[BlockKey], values: Sequence[np.ndarray],
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
