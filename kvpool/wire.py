"""The wire: kvpool's one framed protocol over plain TCP, for fast calls and block bytes alike.

Both ends import this module: the client (:mod:`kvpool.calls`, :mod:`kvpool.client.bulk_client`) and the
listeners (the master's call port, a node's data port: :mod:`kvpool.node.data_port`), so a worker never
imports the node (its tiers, quota ledger or LMDB). gRPC stays the contract and the fallback: the
unary methods below carry the same protobuf messages as the gRPC service and are served by the same
servicer methods.

Protocol version 2. A connection carries any number of exchanges, one at a time: a request frame,
then its reply frame. Every frame, both ways (integers little-endian)::

    fixed header, 32 B
        magic     4 B  b"KVPW"
        version   u16  2
        code      u16  request: the method (Method); reply: the gRPC status code (0 OK, 3 INVALID_ARGUMENT, ...)
        flags     u32  reply: FLAG_REFUSED (1) or 0; request: 0 (ignored)
        header    u32  bytes of the header section
        payload   u64  bytes of the payload section
        trailer   u32  bytes of the trailer section
        reserved  u32  0 (ignored)
    header   a serialized protobuf message: the method's request or reply (below);
             in a reply whose status is not OK: the UTF-8 error message, and no payload or trailer
    payload  raw bytes (block bytes never travel inside a message)
    trailer  a serialized protobuf message, sent after the payload: what is known only once it went out

Methods (``code`` of a request; the messages are ``kvpool.v1``'s)::

    id  method         request header        payload     reply header         payload          trailer
    1   AUTH           AuthRequest           -           AuthResponse         -                -
    2   GET (node)     GetRequest            -           BulkGetReply         the hits' bytes  BulkGetTrailer
    3   PUT (node)     BulkPutRequest        the blocks  PutResponse          -                -
    4-7 Lookup, Exists, PlaceBlocks, ReportBlocks (master): the Master service's request / response
    8-11 Locate, Reserve, Commit, FlushReports (node): the Node service's request / response

GET's payload holds the hits in key order (``sum(sizes)`` bytes); its trailer says, per key, whether
the bytes sent are the block's (a DRAM slot reused while it was sent, or an SSD copy that vanished, is
0: a miss). PUT's payload holds the blocks in key order and must be exactly ``sum(sizes)`` bytes.

Errors (one framing for everything): status + message. A request the listener could read in full and
then refused (undecodable header, bad values, too many keys, a GET whose reply would be over its limit,
PERMISSION_DENIED, a method this listener does not serve: UNIMPLEMENTED) gets an error reply after its
whole payload was read (and dropped): **the connection stays usable**. A frame the listener cannot
trust to be in step (bad magic or version, a section over its method's limit) gets an error reply,
then the listener half-closes, drops what the peer still sends for up to ``ERROR_DRAIN_S``, and closes.
A frame cut short is a silent close. Nothing a peer sends stops the listener.

Limits: a section may be at most its method's limit (:class:`Route`: a header sized for
``max_keys_per_call`` keys, :func:`request_limit`; a payload of at most the node's
``max_request_bytes``, 0 for everything but PUT; no trailer in a request). Headers are allocated as
their bytes arrive (:func:`kvpool.tcp.recv_incremental`; on the master's event loop,
:class:`kvpool.tcp_loop.LoopListener`, appended as they are read: :meth:`WireHandler.begin` says how
many, :meth:`WireHandler.answer` answers them), payloads go straight where they belong
(reserved arena memory, the caller's buffers) or through bounded scratch; a GET's reply is bounded
(``MAX_GET_BYTES`` or ``max_request_bytes``, whichever is larger: more is INVALID_ARGUMENT, before
anything is sent). Deadlines and room are the listener's (:class:`kvpool.tcp.TcpListener`): a first
frame (with an auth file: AUTH, answered) within ``FIRST_FRAME_S`` of connecting, each request read,
served and answered within ``REQUEST_DEADLINE_S`` of its first byte, and a full listener closes its
readiest connection (silent, idle longest, stalled mid-read) for a newcomer, or, if every connection is
busy, refuses it: RESOURCE_EXHAUSTED flagged FLAG_REFUSED, nothing of its request read (the client may
send it another way).

Authentication (a listener with an auth file, :mod:`kvpool.auth`): the first frame must be AUTH with a
known token (at most 512 bytes); the reply is OK and the connection then carries that caller's identity
for every method, fast call or bulk alike. An unknown token, an undecodable AUTH or any other frame
first gets UNAUTHENTICATED and the connection closes. A method the caller's role may not call is
PERMISSION_DENIED (the connection stays). Handlers run inside :func:`kvpool.auth.acting_as`, exactly as
under the gRPC interceptor, so servicers read :func:`kvpool.auth.caller` whatever the transport.
"""

from __future__ import annotations

import enum
import logging
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from kvpool.auth import MAX_TOKEN_BYTES, Authority, Identity, Peer, acting_as, caller
from kvpool.keys import KEY_BYTES
from kvpool.metrics import ErrorMetrics
from kvpool.rpc import StatusError
from kvpool.tcp import (
    Connection,
    Exchange,
    Refused,
    await_bytes,
    capped,
    recv_buffers,
    recv_discard,
    recv_exact,
    recv_incremental,
    send_buffers,
    send_final,
    set_io_timeout,
)
from kvpool.v1 import common_pb2

log = logging.getLogger(__name__)

MAGIC = b"KVPW"
VERSION = 2
FRAME = struct.Struct("<4sHHIIQII")  # magic, version, code, flags, header, payload, trailer, reserved
assert FRAME.size == 32, "wire: the fixed header must stay 32 bytes"
FLAG_REFUSED = 1  # reply flag: a full listener refused the connection before reading anything
MAX_ERROR_BYTES = 64 << 10  # an error message is cut to this
MAX_GET_BYTES = 256 << 20  # a GET's hits may hold at most this (or max_request_bytes if larger): clients ask for less
CALL_SLACK_BYTES = 64 << 10  # a header's bytes beyond its per-key fields (ids, flags, field tags)
PER_ELEMENT_BYTES = 11  # most bytes one element of a repeated number field takes (tag + 10-byte varint)
REPLY_READ_BYTES = 16 << 10  # a reply's first read takes up to this much (a small reply: all of it)
SMALL_REQUEST_BYTES = 64 << 10  # a unary request this small is sent as one joined buffer
AUTH_HEADER_LIMIT = MAX_TOKEN_BYTES + 16  # an AuthRequest with a token of MAX_TOKEN_BYTES, with its tag and length

_CODES = {code.value[0]: code for code in grpc.StatusCode}
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Method(enum.IntEnum):
    """A request's ``code``: changing a number is a new protocol version."""

    AUTH = 1
    GET = 2
    PUT = 3
    LOOKUP = 4
    EXISTS = 5
    PLACE_BLOCKS = 6
    REPORT_BLOCKS = 7
    LOCATE = 8
    RESERVE = 9
    COMMIT = 10
    FLUSH_REPORTS = 11
    SCORE = 12
    NAME_BLOCKS = 13


# The gRPC methods that also travel as unary wire methods (fast calls), per service.
MASTER_CALLS: Mapping[str, Method] = {"Lookup": Method.LOOKUP, "Exists": Method.EXISTS,
                                      "PlaceBlocks": Method.PLACE_BLOCKS, "ReportBlocks": Method.REPORT_BLOCKS,
                                      "Score": Method.SCORE, "NameBlocks": Method.NAME_BLOCKS}
NODE_CALLS: Mapping[str, Method] = {"Locate": Method.LOCATE, "Reserve": Method.RESERVE, "Commit": Method.COMMIT,
                                    "FlushReports": Method.FLUSH_REPORTS}


class Head(NamedTuple):
    """A frame's fixed header, parsed (magic and version checked)."""

    code: int
    flags: int
    header: int
    payload: int
    trailer: int


def pack(code: int, header: int, payload: int = 0, trailer: int = 0, flags: int = 0) -> bytes:
    """A fixed header for sections of these lengths."""
    return FRAME.pack(MAGIC, VERSION, code, flags, header, payload, trailer, 0)


def parse(raw: bytes | bytearray) -> Head | None:
    """The fixed header ``raw`` (FRAME.size bytes); None if it is not a frame of this protocol version."""
    magic, version, code, flags, header, payload, trailer, _ = FRAME.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return Head(code, flags, header, payload, trailer)


def request_frame(method: Method, header: Message | bytes, payload: int = 0) -> list[bytes]:
    """The fixed header and header section of a request (its payload, if any, follows)."""
    body = header if isinstance(header, bytes) else header.SerializeToString()
    return [pack(method, len(body), payload), body]


def error_frame(code: grpc.StatusCode, message: str, flags: int = 0) -> bytes:
    text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    return pack(code.value[0], len(text), flags=flags) + text


def refusal_frame(message: str, head: bytes = b"") -> bytes:
    """A full listener's reply before it closes a newcomer: RESOURCE_EXHAUSTED, flagged :data:`FLAG_REFUSED`.

    ``head`` (the peer's first bytes, if any) is not needed: the listener speaks one protocol.
    """
    return error_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, message, FLAG_REFUSED)


def request_limit(message: type[Message], max_keys: int) -> int:
    """Most bytes a well-formed ``message`` naming at most ``max_keys`` keys can take as a header.

    Every header is per-key fields (``bytes`` fields of packed keys or per-key
    flags, repeated numbers) plus a few scalars and ids (:data:`CALL_SLACK_BYTES`).
    """
    per_key = 0
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_BYTES:
            per_key += KEY_BYTES if field.name.endswith("keys") else 1
        elif field.is_repeated:
            per_key += PER_ELEMENT_BYTES
    return max_keys * per_key + CALL_SLACK_BYTES


# -- client side ----------------------------------------------------------------------------------


class CallError(StatusError):
    """A wire call that failed, shaped like a gRPC error (``code()``, ``details()``)."""

    not_applied = False  # True: the peer read nothing of the request (a full listener's refusal)

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details, f"{code.name}: {details}")


def read_reply(sock: socket.socket, state: Exchange | None, max_header: int, *,
               unary: bool = False) -> tuple[Head, bytes]:
    """A reply's fixed header and header section (for an error: its message, and the status in ``Head.code``).

    ``unary``: the reply is all its peer sends until the next request (a unary call's). Its first read then
    takes the fixed header and whatever came with it, up to :data:`REPLY_READ_BYTES` (a small reply: one system
    call); a payload, a trailer or bytes past the reply are a CallError. Otherwise exactly the fixed header and
    the header section are read, and a payload is left for the caller.

    Raises :class:`~kvpool.tcp.Refused` for a full listener's refusal, and
    CallError for a reply this protocol does not allow (the connection is then
    out of step: drop it). An error reply leaves the connection usable.
    """
    if state is not None:
        state.polled = await_bytes(sock, state.spin_s, state.deadline)
        if not state.polled and state.deadline is not None:
            state.left()  # TimeoutError: the spin ran to the deadline
            set_io_timeout(sock, capped(state.wait_s, state.deadline))  # the blocking read: what the spin left
    if unary:
        first = sock.recv(REPLY_READ_BYTES)
        if not first:
            raise ConnectionError("peer closed the connection before its reply")
        if len(first) < FRAME.size:
            first += recv_exact(sock, FRAME.size - len(first))
    else:
        first = bytes(recv_exact(sock, FRAME.size))
    if state is not None:
        state.replied = True
    head = parse(first[:FRAME.size])
    if head is None:
        raise CallError(grpc.StatusCode.UNIMPLEMENTED, "the peer does not speak the kvpool wire (version 2)")
    if head.code != 0:
        if head.header > MAX_ERROR_BYTES or head.payload or head.trailer:
            raise CallError(grpc.StatusCode.INTERNAL, "malformed error reply")
        text = _rest(sock, first, head.header).decode("utf-8", "replace")
        if head.flags & FLAG_REFUSED:
            raise Refused(text)
        return head, text.encode()
    if unary and (head.payload or head.trailer):
        raise CallError(grpc.StatusCode.INTERNAL, "a unary reply with a payload or trailer")
    if head.header > max_header:
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a reply header of {head.header} bytes (at most {max_header} expected)")
    return head, _rest(sock, first, head.header)


def _rest(sock: socket.socket, first: bytes, length: int) -> bytes:
    """The ``length`` bytes after the fixed header; ``first``, the reply's first read, holds some of them."""
    missing = FRAME.size + length - len(first)
    if missing < 0:
        raise CallError(grpc.StatusCode.INTERNAL, f"{-missing} bytes past the reply: the peer is out of step")
    body = first[FRAME.size:]
    return body + recv_incremental(sock, missing) if missing else body


def status_error(head: Head, body: bytes) -> CallError:
    """The CallError an error reply stands for."""
    return CallError(_CODES.get(head.code, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))


def unary_exchange(sock: socket.socket, state: Exchange, method: Method, body: bytes,
                   max_reply: int) -> tuple[Head, bytes]:
    """A :meth:`~kvpool.tcp.ConnectionPool.exchange` function: one unary call, its reply (maybe an error).

    The socket comes armed with the call's timeout; the reply's wait ends at ``state.deadline``."""
    if len(body) <= SMALL_REQUEST_BYTES:  # one joining copy is cheaper than a gathered write's views
        sock.sendall(pack(method, len(body)) + body)
    else:
        send_buffers(sock, request_frame(method, body))
    return read_reply(sock, state, max_reply, unary=True)


def auth_hello(token: str) -> Callable[[socket.socket], None]:
    """A :class:`~kvpool.tcp.ConnectionPool` ``hello``: the AUTH frame, once per connection.

    Raises CallError (UNAUTHENTICATED) if the token is refused,
    :class:`~kvpool.tcp.Refused` if the listener is full.
    """
    body = common_pb2.AuthRequest(token=token).SerializeToString()

    def hello(sock: socket.socket) -> None:
        head, reply = unary_exchange(sock, Exchange(), Method.AUTH, body, CALL_SLACK_BYTES)
        if head.code != 0:
            raise status_error(head, reply)

    return hello


# -- server side ----------------------------------------------------------------------------------


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


class Stream:
    """One request as a bulk handler sees it: the payload still to read, and the reply to send.

    A handler reads exactly the payload (:meth:`recv_payload`, :meth:`discard_payload`), calls
    :meth:`serving` once it is read, then :meth:`begin_reply` once and :meth:`send` the reply's payload
    and trailer. A ValueError before :meth:`begin_reply` becomes an INVALID_ARGUMENT reply (the rest of
    the payload is read past first); after it, the connection is closed.
    """

    __slots__ = ("conn", "sock", "payload_left", "replied", "_queued")

    def __init__(self, conn: Connection, payload: int):
        self.conn = conn
        self.sock = conn.sock
        self.payload_left = payload
        self.replied = False
        self._queued: list[Any] = []

    def recv_payload(self, buffers: Sequence[Any]) -> None:
        """Fill ``buffers`` (together at most what is left of the payload) from the payload, in order."""
        n = sum(memoryview(b).nbytes for b in buffers)
        if n > self.payload_left:
            raise ValueError(f"the payload holds {self.payload_left} more bytes, not {n}")
        recv_buffers(self.sock, buffers)
        self.payload_left -= n

    def discard_payload(self) -> None:
        """Read past what is left of the payload."""
        if self.payload_left:
            recv_discard(self.sock, self.payload_left)
            self.payload_left = 0

    def serving(self) -> None:
        self.conn.serving()

    def begin_reply(self, header: Message, payload: int = 0, trailer: int = 0) -> None:
        """Queue the reply's fixed header and header section; the first :meth:`send` sends them with its buffers."""
        assert not self.replied, "wire: a second reply to one request"
        assert not self.payload_left, "wire: a reply before the request's payload was read"
        body = header.SerializeToString()
        self._queued = [pack(0, len(body), payload, trailer), body]
        self.replied = True

    def send(self, buffers: Sequence[Any] = ()) -> None:
        """Send the queued reply header (if not sent yet) and ``buffers``, gathered."""
        if self._queued:
            buffers = [*self._queued, *buffers]
            self._queued = []
        send_buffers(self.sock, buffers)


class Step(NamedTuple):
    """What a listener does after a request's fixed header (:meth:`WireHandler.begin`).

    ``final`` set: send it and close (a frame out of step; nothing more is read). Otherwise read the next
    ``read`` bytes (the header section, at most the method's limit; with ``discard``: the whole frame of a
    method not served, read past, never kept), then answer (:meth:`WireHandler.answer`; a bulk ``route``
    reads its payload itself).
    """

    head: Head | None
    read: int = 0
    discard: bool = False
    route: Route | None = None
    final: bytes | None = None


MAX_TOGETHER_BYTES = 2 << 20  # requests answered in one pass hold at most this much (a lookup of 64 keys: ~2 KiB)


def _parts(positions: list[int], sizes: list[int], most: int) -> list[list[int]]:
    """``positions`` cut, in order, into runs whose ``sizes`` add up to at most ``most`` (a larger one alone)."""
    parts: list[list[int]] = [[]]
    total = 0
    for position, size in zip(positions, sizes):
        if parts[-1] and total + size > most:
            parts.append([])
            total = 0
        parts[-1].append(position)
        total += size
    return parts


class Together(Protocol):
    """A unary method whose requests that arrived together can be answered in one pass (the master's Lookup:
    one index pass for all of them). ``begin`` and ``end`` run under each caller's identity, as ``fn`` does;
    ``run`` once for all the requests begun, and its results are in their order. ``end(begin(r, c),
    run([...])[i])`` answers exactly what ``fn(r, c)`` would, as a message or already serialized (sent as
    it is). A request that comes alone is answered by the same steps (``alone``: a pass of one)."""

    def begin(self, request: Any, context: Any) -> Any: ...

    def run(self, begun: Sequence[Any]) -> Sequence[Any]: ...

    def end(self, begun: Any, result: Any) -> Message | bytes: ...

    def alone(self, request: Any, context: Any) -> Message | bytes:
        """A request that came alone: ``end(begin(request, context), run([...])[0])``, as ``fn`` answers it."""
        ...


@dataclass(frozen=True)
class Route:
    """How a listener serves one method.

    ``fn``: unary: ``fn(request, context) -> reply`` (a servicer method);
    bulk: ``fn(request, stream)`` reads the payload and sends the reply itself.
    ``name`` is the gRPC-style full name whose permission the caller needs
    (:func:`kvpool.auth.denied`). Sections over the limits close the connection.
    ``together``: how requests of a unary method that arrived together are answered in one pass (None: one
    by one).
    """

    name: str
    request: type[Message]
    fn: Callable[..., Any]
    bulk: bool
    header_limit: int
    payload_limit: int = 0
    together: Together | None = None


class WireHandler:
    """Serves wire frames on a listener's connections (thread-safe if the handlers are); see the module docstring.

    ``max_frame_bytes``: the most bytes a frame of a method this listener does
    not serve may hold and still be read past (then UNIMPLEMENTED).
    """

    head_bytes = FRAME.size  # a request's fixed header (for :class:`kvpool.tcp_loop.LoopListener`)

    def __init__(self, routes: Mapping[int, Route], *, max_frame_bytes: int, authority: Authority | None = None,
                 errors: ErrorMetrics | None = None):
        self._routes = dict(routes)
        self.max_frame_bytes = max_frame_bytes
        self.authority = authority
        self.errors = errors

    def route(self, method: int) -> Route | None:
        return self._routes.get(method)

    def replace(self, method: int, route: Route) -> None:
        """Serve ``method`` with ``route`` from the next request on (tests slow a handler down this way)."""
        self._routes[method] = route

    def serve(self, conn: Connection) -> None:
        """Serve frames on ``conn`` until the peer closes it, sends a frame out of step, or the listener cuts it."""
        peer = Peer(self.authority)
        try:
            while True:
                raw = conn.next_request(FRAME.size, authenticated=not peer.needs_auth)
                if not raw or not self.serve_frame(conn, raw, peer):
                    return
        except OSError as exc:  # a peer gone, cut or stalled: nothing to answer
            log.debug("wire: connection dropped: %s", exc)

    def new_peer(self) -> Peer:
        """A new connection's authentication state."""
        return Peer(self.authority)

    def begin(self, raw: bytes | bytearray, peer: Peer) -> Step:
        """What to do with a request whose fixed header ``raw`` was read (nothing after it yet): see :class:`Step`."""
        head = parse(raw)
        if head is None:
            magic, version = FRAME.unpack(raw)[:2]
            return self._final(INVALID, "invalid_argument",
                               f"not a kvpool wire frame (magic {bytes(magic)!r}, version {version}; this "
                               f"listener speaks {MAGIC!r} version {VERSION})")
        if peer.needs_auth and head.code != Method.AUTH:
            return self._final(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                               "unauthenticated: the first frame on a connection must be AUTH with a token")
        if head.code == Method.AUTH:
            if head.header > AUTH_HEADER_LIMIT or head.payload or head.trailer:
                return self._final(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                                   f"unauthenticated: an AUTH frame of {head.header + head.payload + head.trailer} "
                                   f"bytes (a token may have at most {MAX_TOKEN_BYTES})")
            return Step(head, head.header)
        route = self._routes.get(head.code)
        if route is None:
            size = head.header + head.payload + head.trailer
            if size > self.max_frame_bytes:
                return self._final(INVALID, "invalid_argument",
                                   f"a frame of {size} bytes is over the limit of {self.max_frame_bytes}")
            return Step(head, size, discard=True)
        if head.header > route.header_limit or head.payload > route.payload_limit or head.trailer:
            section, n, limit = next(c for c in (("header", head.header, route.header_limit),
                                                 ("payload", head.payload, route.payload_limit),
                                                 ("trailer", head.trailer, 0)) if c[1] > c[2])
            return self._final(INVALID, "invalid_argument",
                               f"{route.name}: a {section} of {n} bytes is over the limit; the limit is {limit}")
        return Step(head, head.header, route=route)

    def answer(self, step: Step, body: bytes, peer: Peer, host: str) -> tuple[bytes, bool]:
        """The reply frame to a unary request (or AUTH, or a method not served) whose ``step.read`` bytes were
        read (``body``; nothing when they were read past), and whether the connection goes on (False: send
        the reply, then close as :func:`kvpool.tcp.send_final` does)."""
        route = step.route
        if route is None:
            if step.discard:
                assert step.head is not None, "wire: a frame read past without its header"
                return error_frame(grpc.StatusCode.UNIMPLEMENTED, f"no method {step.head.code} here"), True
            return self._login(peer, body)
        assert not route.bulk, f"wire: {route.name} is a bulk method, served from its stream"
        request = self._decode(route, body, peer)
        if isinstance(request, bytes):
            return request, True
        fn = route.fn if route.together is None else route.together.alone
        return self._reply(route, peer, fn, request, _Context(f"tcp:{host}")), True

    def answer_together(self, requests: Sequence[tuple[Step, bytes, Peer, str]]) -> list[tuple[bytes, bool] | None]:
        """The replies to complete requests that arrived together (each as :meth:`answer` takes it): those of a
        method with a :class:`Together` answered in one pass where two or more came, None for the rest (to be
        answered one by one). Each reply is exactly what :meth:`answer` would have sent. One pass takes requests
        of at most :data:`MAX_TOGETHER_BYTES` in all (so a pass costs no more memory than a few requests alone:
        1,000 connections of requests at the key limit are many passes, not one)."""
        answers: list[tuple[bytes, bool] | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, (step, _, _, _) in enumerate(requests):
            route = step.route
            if route is not None and route.together is not None and not step.discard:
                groups.setdefault(route.name, []).append(i)
        for positions in groups.values():
            for part in _parts(positions, [len(requests[i][1]) for i in positions], MAX_TOGETHER_BYTES):
                if len(part) > 1:
                    self._answer_group(requests, part, answers)
        return answers

    def _answer_group(self, requests: Sequence[tuple[Step, bytes, Peer, str]], positions: list[int],
                      answers: list[tuple[bytes, bool] | None]) -> None:
        """Answer ``positions`` (requests of one :class:`Together` method) in one pass, into ``answers``."""
        route = requests[positions[0]][0].route
        assert route is not None and route.together is not None
        together = route.together
        begun: list[tuple[int, Any, Peer]] = []
        for i in positions:
            step, body, peer, host = requests[i]
            request = self._decode(route, body, peer)
            if isinstance(request, bytes):
                answers[i] = request, True
                continue
            first = self._reply(route, peer, together.begin, request, _Context(f"tcp:{host}"), serialize=False)
            if isinstance(first, bytes):  # refused before the pass (an error frame)
                answers[i] = first, True
            else:
                begun.append((i, first, peer))
        if not begun:
            return
        try:
            results = together.run([b for _, b, _ in begun])
        except Exception:  # a bug in the pass: answer them one by one instead
            log.exception("wire: %s answered together failed", route.name)
            return
        for (i, b, peer), result in zip(begun, results):
            answers[i] = self._reply(route, peer, together.end, b, result), True

    def _reply(self, route: Route, peer: Peer, fn: Callable[..., Any], *args: Any, serialize: bool = True) -> Any:
        """``fn(*args)`` under the caller's identity: its reply frame (or, ``serialize`` False, what it
        returned); an error frame if it raised."""
        try:
            if peer.identity is None:  # auth off: nobody to act as (the caller is None already)
                reply = fn(*args)
            else:
                with acting_as(peer.identity):
                    reply = fn(*args)
        except ValueError as exc:  # (servicers count their own)
            return error_frame(INVALID, str(exc))
        except _Aborted as exc:
            return error_frame(exc.code, exc.details)
        except Exception as exc:  # the one place that turns bugs into INTERNAL
            log.exception("wire: %s failed", route.name)
            return error_frame(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        if not serialize:
            return reply
        out = reply if isinstance(reply, bytes) else reply.SerializeToString()
        return pack(0, len(out)) + out

    def _decode(self, route: Route, body: bytes, peer: Peer) -> Message | bytes:
        """The request ``body`` holds, or the error frame that answers it (undecodable, or not this caller's)."""
        try:
            request = route.request.FromString(body)
        except DecodeError as exc:
            self._count("invalid_argument")
            return error_frame(INVALID, f"{route.name}: undecodable request header: {exc}")
        refusal = peer.denied(route.name)
        if refusal is not None:
            self._count(refusal[0].name.lower())
            return error_frame(*refusal)
        return request

    def _login(self, peer: Peer, body: bytes) -> tuple[bytes, bool]:
        """The reply to an AUTH frame's header section, and whether the connection goes on."""
        try:
            token: str | None = common_pb2.AuthRequest.FromString(body).token
        except DecodeError:
            token = None
        if token is not None and peer.login(token):
            reply = common_pb2.AuthResponse().SerializeToString()
            return pack(0, len(reply)) + reply, True
        self._count("unauthenticated")
        why = "unauthenticated: unknown token" if token is not None else "unauthenticated: undecodable AUTH"
        log.debug("wire: refused a frame: %s", why)
        return error_frame(grpc.StatusCode.UNAUTHENTICATED, why), False

    def serve_frame(self, conn: Connection, raw: bytes | bytearray, peer: Peer) -> bool:
        """Answer one request whose fixed header was read, on a blocking connection; False: close it."""
        step = self.begin(raw, peer)
        if step.final is not None:
            send_final(conn.sock, step.final)
            return False
        route = step.route
        if route is not None and route.bulk:
            return self._serve_bulk(conn, route, step, peer)
        body = b""
        if step.discard:
            recv_discard(conn.sock, step.read)
        else:
            body = recv_incremental(conn.sock, step.read)
        conn.serving()
        reply, keep = self.answer(step, body, peer, conn.host)
        if not keep:
            send_final(conn.sock, reply)
            return False
        send_buffers(conn.sock, [reply])
        return True

    def _serve_bulk(self, conn: Connection, route: Route, step: Step, peer: Peer) -> bool:
        """A bulk request: its handler reads the payload and sends the reply itself (:class:`Stream`)."""
        assert step.head is not None, "wire: a bulk request without its header"
        body = recv_incremental(conn.sock, step.read)
        stream = Stream(conn, step.head.payload)
        request = self._decode(route, body, peer)
        if isinstance(request, bytes):
            return self._fail_with(stream, request)
        try:
            if peer.identity is None:
                route.fn(request, stream)
            else:
                with acting_as(peer.identity):
                    route.fn(request, stream)
        except OSError:
            raise  # the connection broke: nothing to answer
        except ValueError as exc:
            self._count("invalid_argument")
            return self._fail(stream, INVALID, str(exc))
        except _Aborted as exc:
            return self._fail(stream, exc.code, exc.details)
        except Exception as exc:  # the one place that turns bugs into INTERNAL
            log.exception("wire: %s failed", route.name)
            return self._fail(stream, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        assert stream.replied and not stream.payload_left, f"wire: {route.name} left its request half served"
        return True

    def _fail(self, stream: Stream, code: grpc.StatusCode, message: str) -> bool:
        """An error reply to a request read in full (its payload read past first); False if a reply had begun."""
        return self._fail_with(stream, error_frame(code, message))

    @staticmethod
    def _fail_with(stream: Stream, frame: bytes) -> bool:
        if stream.replied:
            log.debug("wire: a request failed mid-reply; closing")
            return False
        stream.discard_payload()
        stream.serving()
        send_buffers(stream.sock, [frame])
        return True

    def _final(self, code: grpc.StatusCode, kind: str, message: str) -> Step:
        """A frame out of step: an error reply, then close (see :func:`kvpool.tcp.send_final`)."""
        self._count(kind)
        log.debug("wire: refused a frame: %s", message)
        return Step(None, final=error_frame(code, message))

    def _count(self, kind: str) -> None:
        if self.errors is not None:
            self.errors.count(kind)


def unary_routes(servicer: Any, service: Any, calls: Mapping[str, Method], *, max_body_bytes: int,
                 max_keys: int | None) -> dict[int, Route]:
    """The routes of a gRPC servicer's fast calls (``calls``: method name -> Method) on a listener; a servicer's
    ``together`` mapping (method name -> :class:`Together`) says which it answers together.

    A request header may be at most ``max_body_bytes`` and at most what the
    method's request takes with ``max_keys`` keys (:func:`request_limit`; None: no per-key limit).
    """
    from kvpool.v1 import master_pb2, node_pb2

    module = master_pb2 if service.file is master_pb2.DESCRIPTOR else node_pb2
    routes: dict[int, Route] = {}
    for name, method in calls.items():
        request = getattr(module, service.methods_by_name[name].input_type.name)
        limit = max_body_bytes if max_keys is None else min(max_body_bytes, request_limit(request, max_keys))
        together = getattr(servicer, "together", {}).get(name)
        routes[method] = Route(f"/{service.full_name}/{name}", request, getattr(servicer, name), False, limit,
                               together=together)
    return routes
