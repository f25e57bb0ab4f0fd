"""Fast calls: the hot unary RPCs as protobuf messages in plain TCP frames.

A Python gRPC unary round trip costs ~1-2 ms on a small machine, most of it
in gRPC's own threads and queues rather than in the bytes. The calls on every
request's path (Lookup, PlaceBlocks, Reserve, Commit, Locate, the node's
ReportBlocks) therefore also travel as one frame each way over a pooled TCP
connection, carrying the *same* protobuf messages and served by the *same*
servicer methods as over gRPC. gRPC stays the contract and the fallback: a
peer without a fast-call listener is simply called over gRPC.

Frame (both ways), integers little-endian::

    magic b"KVPC" | version u16 = 1 | method (request) or status (reply) u16 | flags u32 = 0 | length u32
    body: `length` bytes: the serialized request / reply, or a UTF-8 error message if status != 0

``method`` is the 1-based position of the method's name in the service's
list below (:data:`MASTER_CALLS`, :data:`NODE_CALLS`): changing a list is a
new protocol version. ``status`` is the gRPC status code number (0 OK,
3 INVALID_ARGUMENT, 12 UNIMPLEMENTED, 13 INTERNAL, 14 UNAVAILABLE, ...).
A reply's ``flags`` is 0, or :data:`FLAG_REFUSED` (1) on the
RESOURCE_EXHAUSTED a full listener sends a newcomer before closing it:
nothing of that connection's request was read, and the client sends the
call over gRPC instead. Requests' flags are ignored.

Limits: a body may be at most the listener's ``max_body_bytes`` and at most
what its method's request takes with ``max_keys`` keys
(:func:`request_limit`: 32 bytes a key per key list, 11 per repeated number,
plus :data:`CALL_SLACK_BYTES`); it is allocated as it arrives, never from the
announced length. Deadlines and room are the listener's
(:class:`kvpool.framing.TcpListener`): a first frame (or AUTH) within
``FIRST_FRAME_S`` of connecting, each call within ``REQUEST_DEADLINE_S``;
a full listener closes its longest-idle connection for a newcomer.

Authentication (listeners with an auth file, :mod:`kvpool.auth`): the first
frame on a connection is ``method`` :data:`AUTH_METHOD` (0xFFFF) with the
token as its body (at most 512 bytes); the reply is OK with an empty body,
and the connection then carries that caller's identity. An unknown token,
or any other frame first, gets UNAUTHENTICATED and the connection closes.
A method the caller's role may not call is PERMISSION_DENIED (the
connection stays usable). A client sends AUTH only if it has a token; a
listener without an auth file answers AUTH with OK.

Invariants:
- A servicer's ValueError is INVALID_ARGUMENT with its message (as the gRPC
  interceptor does), ``context.abort(code, details)`` is that status, any
  other exception is INTERNAL (logged). An error reply keeps the connection
  usable; only a malformed frame (bad magic, version, or a body over the
  limit) closes it.
- :class:`FastStub` raises :class:`CallError`, a ``grpc.RpcError`` with
  ``code()`` and ``details()``, so callers handle both transports alike. A
  call it cannot connect for, or that a full listener refused, goes over gRPC.
- Servicers learn who calls from :func:`kvpool.auth.caller`, set around each
  call exactly as the gRPC interceptor sets it: they are transport-agnostic.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvpool.auth import MAX_TOKEN_BYTES, Authority, Identity, Peer, acting_as, caller
from kvpool.framing import (
    ConnectFailed,
    Connection,
    ConnectionPool,
    Exchange,
    Refused,
    is_timeout,
    recv_discard,
    recv_exact,
    recv_incremental,
    send_buffers,
    send_final,
    set_io_timeout,
)
from kvpool.keys import KEY_BYTES
from kvpool.metrics import ErrorMetrics
from kvpool.v1 import master_pb2, node_pb2

log = logging.getLogger(__name__)

CALL_MAGIC = b"KVPC"
CALL_VERSION = 1
FRAME = struct.Struct("<4sHHII")  # magic, version, method|status, flags, body length
assert FRAME.size == 16, "fast calls: the frame header must stay 16 bytes (the bulk header's size)"

MASTER_CALLS = ("Lookup", "Exists", "PlaceBlocks", "ReportBlocks")
NODE_CALLS = ("Locate", "Reserve", "Commit")
RETRY_S = 5.0  # a peer whose fast-call listener could not be reached is called over gRPC this long
AUTH_METHOD = 0xFFFF  # the AUTH frame's method id (see the module docstring)
FLAG_REFUSED = 1  # reply flag: a full listener refused the connection before reading anything
CALL_SLACK_BYTES = 64 << 10  # a request's bytes beyond its per-key fields (ids, flags, field tags)
PER_ELEMENT_BYTES = 11  # most bytes one element of a repeated number field takes (tag + 10-byte varint)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallError(grpc.RpcError):
    """A fast call that failed, shaped like a gRPC error (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """The part of ``grpc.ServicerContext`` kvpool's servicers use."""

    def __init__(self, peer: str):
        self._peer = peer

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[()]:
        return ()

    @property
    def identity(self) -> Identity | None:
        """The caller (:func:`kvpool.auth.caller`), as a servicer sees it over gRPC too."""
        return caller()


def refusal_frame(message: str, head: bytes = b"") -> bytes:
    """The reply a full listener sends before closing: RESOURCE_EXHAUSTED, flagged :data:`FLAG_REFUSED`.

    ``head`` (the peer's first bytes, if any) is not needed: the listener speaks fast calls only.
    """
    body = message.encode()
    return FRAME.pack(CALL_MAGIC, CALL_VERSION, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], FLAG_REFUSED,
                      len(body)) + body


def request_limit(message: type[Message], max_keys: int) -> int:
    """Most bytes a well-formed ``message`` naming at most ``max_keys`` keys can take on the wire.

    Every fast-call request is per-key fields (``bytes`` fields of packed keys,
    repeated numbers) plus a few scalars and ids (:data:`CALL_SLACK_BYTES`).
    """
    per_key = 0
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_BYTES:
            assert field.name.endswith("keys"), f"fast calls: {message.__name__}.{field.name} is not a key list"
            per_key += KEY_BYTES
        elif field.is_repeated:
            per_key += PER_ELEMENT_BYTES
    return max_keys * per_key + CALL_SLACK_BYTES


def _request_types(service: Any, names: Sequence[str]) -> list[type[Message]]:
    """The request message class of each named method of a protobuf service descriptor."""
    module = master_pb2 if service.file is master_pb2.DESCRIPTOR else node_pb2
    return [getattr(module, service.methods_by_name[name].input_type.name) for name in names]


# -- server side ----------------------------------------------------------------------------------


class CallHandler:
    """Serves fast-call frames with a gRPC servicer's methods (thread-safe if the servicer is).

    A body is allocated as it arrives (:func:`~kvpool.framing.recv_incremental`)
    and may be at most ``max_body_bytes``, and at most what its method's
    request can take with ``max_keys`` keys (:func:`request_limit`; default:
    the servicer's ``max_keys_per_call`` if it has one, else no per-method
    limit). An unknown method's body is read past and dropped.
    """

    def __init__(self, servicer: Any, service: Any, names: Sequence[str], *, max_body_bytes: int,
                 authority: Authority | None = None, errors: ErrorMetrics | None = None,
                 max_keys: int | None = None):
        self._methods = [(name, getattr(servicer, name)) for name in names]
        self._full_names = [f"/{service.full_name}/{name}" for name in names]
        self._types = _request_types(service, names)
        self.max_body_bytes = max_body_bytes
        if max_keys is None:
            max_keys = getattr(servicer, "max_keys_per_call", None)
        self._limits = [max_body_bytes if max_keys is None else min(max_body_bytes, request_limit(t, max_keys))
                        for t in self._types]
        self.authority = authority
        self.errors = errors

    def serve(self, conn: Connection) -> None:
        """Serve frames on ``conn`` until the peer closes it, sends a malformed frame, or the listener cuts it."""
        peer = Peer(self.authority)
        try:
            while True:
                header = conn.next_request(FRAME.size, authenticated=not peer.needs_auth)
                if not header:
                    return
                if not self.serve_frame(conn.sock, header, peer, conn):
                    return
        except OSError as exc:
            log.debug("fast calls: connection dropped: %s", exc)

    def serve_frame(self, sock: socket.socket, header: bytes | bytearray, peer: Peer | None = None,
                    conn: Connection | None = None) -> bool:
        """Answer one request whose 16-byte header was already read; False: close the connection.

        ``peer`` is the connection's authentication state (None: a connection
        that authenticated nowhere, fine only without an auth file); ``conn``
        (if any) learns when the request was read in full.
        """
        if peer is None:
            peer = Peer(self.authority)
        magic, version, method, _, length = FRAME.unpack(header)
        limit = self._limits[method - 1] if 1 <= method <= len(self._methods) else self.max_body_bytes
        if magic != CALL_MAGIC or version != CALL_VERSION or length > limit:
            why = (f"body of {length} bytes is over the limit of {limit}"
                   if magic == CALL_MAGIC and version == CALL_VERSION
                   else f"not a kvpool fast call (magic {bytes(magic)!r}, version {version})")
            body = why.encode()
            send_final(sock, FRAME.pack(CALL_MAGIC, CALL_VERSION, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0,
                                        len(body)) + body)
            return False
        if method == AUTH_METHOD or peer.needs_auth:
            return self._authenticate(sock, peer, method, length, conn)
        if not 1 <= method <= len(self._methods):
            recv_discard(sock, length)
            if conn is not None:
                conn.serving()
            self._reply(sock, grpc.StatusCode.UNIMPLEMENTED, f"no fast-call method {method}".encode())
            return True
        body = recv_incremental(sock, length)
        if conn is not None:
            conn.serving()
        name, fn = self._methods[method - 1]
        refusal = peer.denied(self._full_names[method - 1])
        if refusal is not None:
            self._count(refusal[0].name.lower())
            self._reply(sock, refusal[0], refusal[1].encode())
            return True
        try:
            request = self._types[method - 1].FromString(body)
            with acting_as(peer.identity):
                reply = fn(request, _Context(f"tcp:{sock.getpeername()}"))
        except DecodeError as exc:
            self._reply(sock, grpc.StatusCode.INVALID_ARGUMENT, f"{name}: undecodable request: {exc}".encode())
        except ValueError as exc:
            self._reply(sock, grpc.StatusCode.INVALID_ARGUMENT, str(exc).encode())
        except _Aborted as exc:
            self._reply(sock, exc.code, exc.details.encode())
        except Exception as exc:  # the one place that turns bugs into INTERNAL
            log.exception("fast call %s failed", name)
            self._reply(sock, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}".encode())
        else:
            self._reply(sock, grpc.StatusCode.OK, reply.SerializeToString())
        return True

    def _authenticate(self, sock: socket.socket, peer: Peer, method: int, length: int,
                      conn: Connection | None = None) -> bool:
        """An AUTH frame, or any frame before one on a listener that wants it; False: close."""
        if method != AUTH_METHOD:
            why = "unauthenticated: the first frame on a connection must be AUTH with a token"
        elif length > MAX_TOKEN_BYTES:
            why = f"unauthenticated: a token of {length} bytes (at most {MAX_TOKEN_BYTES})"
        elif peer.login(bytes(recv_exact(sock, length))):
            if conn is not None:
                conn.serving()
            self._reply(sock, grpc.StatusCode.OK, b"")
            return True
        else:
            why = "unauthenticated: unknown token"
        self._count("unauthenticated")
        body = why.encode()
        send_final(sock, FRAME.pack(CALL_MAGIC, CALL_VERSION, grpc.StatusCode.UNAUTHENTICATED.value[0], 0,
                                    len(body)) + body)
        return False

    def _count(self, kind: str) -> None:
        if self.errors is not None:
            self.errors.count(kind)

    @staticmethod
    def _reply(sock: socket.socket, code: grpc.StatusCode, body: bytes) -> None:
        send_buffers(sock, [FRAME.pack(CALL_MAGIC, CALL_VERSION, code.value[0], 0, len(body)), body])


# -- client side ----------------------------------------------------------------------------------


def _exchange(sock: socket.socket, state: Exchange, method: int, body: bytes, max_reply: int,
              timeout: float | None) -> tuple[int, bytes]:
    if timeout is not None:
        set_io_timeout(sock, timeout)
    send_buffers(sock, [FRAME.pack(CALL_MAGIC, CALL_VERSION, method, 0, len(body)), body])
    header = recv_exact(sock, FRAME.size)
    state.replied = True
    magic, version, status, flags, length = FRAME.unpack(header)
    if magic != CALL_MAGIC or version != CALL_VERSION or length > max_reply:
        raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"peer does not speak fast calls (magic {bytes(magic)!r})")
    body = bytes(recv_exact(sock, length))
    if flags & FLAG_REFUSED:
        raise Refused(body.decode("utf-8", "replace"))
    return status, body


def auth_hello(token: str) -> Callable[[socket.socket], None]:
    """A :class:`~kvpool.framing.ConnectionPool` ``hello``: the AUTH frame.

    Raises CallError if the token is refused, :class:`~kvpool.framing.Refused` if the listener is full.
    """
    body = token.encode()

    def hello(sock: socket.socket) -> None:
        send_buffers(sock, [FRAME.pack(CALL_MAGIC, CALL_VERSION, AUTH_METHOD, 0, len(body)), body])
        magic, version, status, flags, length = FRAME.unpack(recv_exact(sock, FRAME.size))
        if magic != CALL_MAGIC or version != CALL_VERSION or length > 1 << 16:
            raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"peer does not speak fast calls (magic {bytes(magic)!r})")
        text = bytes(recv_exact(sock, length)).decode("utf-8", "replace")
        if flags & FLAG_REFUSED:
            raise Refused(text)
        if status != 0:
            raise CallError(_CODES.get(status, grpc.StatusCode.UNKNOWN), text)

    return hello


class FastStub:
    """A gRPC stub whose hot methods go over fast calls when the peer offers them.

    ``address`` returns the peer's fast-call ``host:port`` (None: none, or
    not known; then gRPC). Methods not in ``names`` are the gRPC stub's own.
    A peer that cannot be connected to is called over gRPC for ``RETRY_S``;
    a call a full listener refused (nothing of it was read) goes over gRPC
    this once, and the next call tries the fast path again.
    """

    def __init__(self, grpc_stub: Any, service: Any, names: Sequence[str], pool: ConnectionPool,
                 address: Callable[[], str | None], *, on_unreachable: Callable[[], None] | None = None,
                 max_reply_bytes: int = 256 << 20):
        self._grpc = grpc_stub
        self._pool = pool
        self._address = address
        self._on_unreachable = on_unreachable
        self._max_reply = max_reply_bytes
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._methods = {name: (i + 1, service.methods_by_name[name].output_type.name)
                         for i, name in enumerate(names)}
        module = master_pb2 if service.file is master_pb2.DESCRIPTOR else node_pb2
        self._reply_types = {name: getattr(module, out) for name, (_, out) in self._methods.items()}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._methods:
            return getattr(self._grpc, name)
        return lambda request, timeout=None: self.call(name, request, timeout)

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """Call ``name`` over fast calls if the peer has them, else over gRPC; errors are ``grpc.RpcError``."""
        address = self._address() if time.monotonic() >= self._down_until else None
        if address is None:
            return getattr(self._grpc, name)(request, timeout=timeout)
        method, _ = self._methods[name]
        try:
            status, body = self._pool.exchange(address, _exchange, method, request.SerializeToString(),
                                               self._max_reply, timeout)
        except Refused as exc:
            log.debug("fast call %s refused by %s (%s); using gRPC", name, address, exc)
            return getattr(self._grpc, name)(request, timeout=timeout)
        except ConnectFailed as exc:
            log.debug("fast calls to %s unavailable (%s); using gRPC", address, exc)
            with self._lock:
                self._down_until = time.monotonic() + RETRY_S
            if self._on_unreachable is not None:
                self._on_unreachable()
            return getattr(self._grpc, name)(request, timeout=timeout)
        except CallError:
            raise
        except OSError as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if is_timeout(exc) else grpc.StatusCode.UNAVAILABLE
            raise CallError(code, f"{name} to {address}: {exc}") from exc
        if status != 0:
            raise CallError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))
        try:
            return self._reply_types[name].FromString(body)
        except DecodeError as exc:
            raise CallError(grpc.StatusCode.INTERNAL, f"{name}: undecodable reply: {exc}") from exc


class MasterCallAddress:
    """The master's fast-call ``host:port``, asked of its gRPC ``Info`` once (and again after :meth:`forget`).

    The host is the one the caller dials for gRPC; a master that cannot be
    asked is asked again after ``RETRY_S`` (until then: None, use gRPC).
    """

    def __init__(self, grpc_stub: Any, master: str, timeout_s: float):
        self._stub = grpc_stub
        self._host = master.rpartition(":")[0]
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._known: str | None = None  # "": the master has no fast-call listener
        self._next_try = 0.0

    def __call__(self) -> str | None:
        with self._lock:
            if self._known is not None or time.monotonic() < self._next_try:
                return self._known or None
            self._next_try = time.monotonic() + RETRY_S
        try:
            info = self._stub.Info(master_pb2.MasterInfoRequest(), timeout=self._timeout)
        except grpc.RpcError as exc:
            log.debug("master Info failed (%s); using gRPC for now", exc)
            return None
        with self._lock:
            self._known = f"{self._host}:{info.call_port}" if info.call_port else ""
            return self._known or None

    def forget(self) -> None:
        """The address stopped working (a master restart may have moved it): ask again later."""
        with self._lock:
            self._known = None
