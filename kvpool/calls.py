"""Fast calls: the hot unary RPCs over the wire (:mod:`kvpool.wire`), gRPC as the contract and the fallback.

A Python gRPC unary round trip costs ~1-2 ms on a small machine, most of it
in gRPC's own threads and queues rather than in the bytes. The calls on every
request's path (Lookup, PlaceBlocks, Reserve, Commit, Locate, the node's
ReportBlocks: :data:`kvpool.wire.MASTER_CALLS`, :data:`kvpool.wire.NODE_CALLS`)
therefore also travel as one wire frame each way over a pooled TCP
connection, carrying the *same* protobuf messages and served by the *same*
servicer methods as over gRPC. A peer without a wire listener is simply
called over gRPC.

Invariants:
- :class:`FastStub` raises :class:`~kvpool.wire.CallError`, a
  ``grpc.RpcError`` with ``code()`` and ``details()``, so callers handle both
  transports alike. A call it cannot connect for, or that a full listener
  refused (nothing of it was read), goes over gRPC.
- An error reply keeps the pooled connection usable (see :mod:`kvpool.wire`).
- A call's ``timeout`` covers all of it: the peer's wire address, connecting,
  AUTH, the reply (spin included) and a gRPC fallback end by one deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvpool.tcp import ConnectFailed, ConnectionPool, Refused, is_timeout
from kvpool.v1 import master_pb2, node_pb2
from kvpool.wire import CallError, Method, status_error, unary_exchange

log = logging.getLogger(__name__)

RETRY_S = 5.0  # a peer whose wire listener could not be reached is called over gRPC this long


class FastStub:
    """A gRPC stub whose hot methods go over fast calls when the peer offers them.

    ``address`` returns the peer's wire ``host:port`` (None: none, or
    not known; then gRPC). Methods not in ``calls`` are the gRPC stub's own.
    A peer that cannot be connected to is called over gRPC for ``RETRY_S``;
    a call a full listener refused (nothing of it was read) goes over gRPC
    this once, and the next call tries the fast path again.
    """

    def __init__(self, grpc_stub: Any, service: Any, calls: Mapping[str, Method], pool: ConnectionPool,
                 address: Callable[[], str | None], *, on_unreachable: Callable[[], None] | None = None,
                 max_reply_bytes: int = 256 << 20):
        self._grpc = grpc_stub
        self._pool = pool
        self._address = address
        self._on_unreachable = on_unreachable
        self._max_reply = max_reply_bytes
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._methods = {name: (method, service.methods_by_name[name].output_type.name)
                         for name, method in calls.items()}
        module = master_pb2 if service.file is master_pb2.DESCRIPTOR else node_pb2
        self._reply_types = {name: getattr(module, out) for name, (_, out) in self._methods.items()}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._methods:
            return getattr(self._grpc, name)
        return lambda request, timeout=None: self.call(name, request, timeout)

    def wire_address(self) -> str | None:
        """The peer's wire ``host:port`` now; None: it has none, or it was unreachable lately (use gRPC)."""
        return self._address() if time.monotonic() >= self._down_until else None

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """Call ``name`` over fast calls if the peer has them, else over gRPC; errors are ``grpc.RpcError``.

        ``timeout`` is the whole call's: finding the peer's wire address, connecting, AUTH, the reply and a
        gRPC fallback all end by the one deadline (DEADLINE_EXCEEDED past it).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        address = self.wire_address()
        if address is None:
            return self._grpc_call(name, request, deadline)
        method, _ = self._methods[name]
        try:
            head, body = self._pool.exchange(address, unary_exchange, method, request.SerializeToString(),
                                             self._max_reply, timeout=_left(deadline))
        except Refused as exc:
            log.debug("fast call %s refused by %s (%s); using gRPC", name, address, exc)
            return self._grpc_call(name, request, deadline)
        except ConnectFailed as exc:
            log.debug("fast calls to %s unavailable (%s); using gRPC", address, exc)
            with self._lock:
                self._down_until = time.monotonic() + RETRY_S
            if self._on_unreachable is not None:
                self._on_unreachable()
            return self._grpc_call(name, request, deadline)
        except CallError:
            raise
        except OSError as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if is_timeout(exc) else grpc.StatusCode.UNAVAILABLE
            raise CallError(code, f"{name} to {address}: {exc}") from exc
        if head.code != 0:
            raise status_error(head, body)
        try:
            return self._reply_types[name].FromString(body)
        except DecodeError as exc:
            raise CallError(grpc.StatusCode.INTERNAL, f"{name}: undecodable reply: {exc}") from exc

    def _grpc_call(self, name: str, request: Message, deadline: float | None) -> Any:
        return getattr(self._grpc, name)(request, timeout=_left(deadline))


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: none), at least 0 (a call given 0 fails at once: DEADLINE_EXCEEDED)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
