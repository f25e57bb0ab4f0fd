"""Plain-TCP plumbing under the wire (:mod:`kvpool.wire`): byte movement, the listener, the client pool.

- :func:`send_buffers` / :func:`recv_buffers`: gathered writes and scattered
  reads of many buffers in few system calls, never a joining copy.
- :class:`TcpListener`: a listening socket with one thread per connection
  (a :class:`Connection`: its request cycle and deadlines), at most
  ``max_connections`` at once, and a ``stop`` that cuts every connection and
  waits for its thread. Limits, so that connections which hold on cannot
  lock clients out or hold resources: a first header (with auth: AUTH) within
  ``FIRST_FRAME_S`` of the accept; each request read, served and answered
  within ``REQUEST_DEADLINE_S`` of its first byte (a watchdog cuts it, and a
  request's resources end with it); a full listener closes its readiest
  connection (silent, then idle longest, then stalled mid-read; never one
  being served) for a newcomer, and refuses only when all are busy.
  Its event-loop form (no thread per connection, the same limits: the
  room, ranks, refusals and expiry are this class's code) is
  :class:`kvpool.tcp_loop.LoopListener`, on the master's fast-call port.
- :func:`recv_incremental`: announced lengths are allocated as their bytes
  arrive, never up front.
- :class:`ConnectionPool`: the client side: idle connections kept per
  address; one exchange at a time per connection; a pooled connection the
  server closed meanwhile is retried once on a fresh one, before any reply
  byte arrived (never after: the request may have been applied), and never
  after a timeout (a stalled peer must not cost the caller its deadline twice).
  A listener's refusal is :class:`Refused` (a :class:`ConnectFailed`): the
  request was not read, and may go another way (gRPC). An exchange given a
  ``timeout`` has one deadline for all of it (connect, ``hello``, the reply
  spin of :func:`await_bytes`, each read and write, the retry).
- TLS (optional): a listener with a server :class:`ssl.SSLContext` wraps each
  connection in its own thread; a pool with a client context wraps each new
  connection, checking the certificate against the host it dialed. TLS
  sockets cannot gather or scatter (``sendmsg``), so their buffers go one at a time.
- A pool's ``hello`` runs once on each new connection before its first
  exchange (the wire's AUTH frame).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into call (Linux's UIO_MAXIOV)
IDLE_TIMEOUT_S = 300.0  # a server closes a connection with no request this long
IO_TIMEOUT_S = 30.0  # a server drops a request stalled this long in one receive or send
REQUEST_DEADLINE_S = 30.0  # a server cuts a request not read, served and answered this long after its first byte
FIRST_FRAME_S = 5.0  # a new connection's first header (with an auth file: its AUTH, answered) must come this soon
EVICT_GRACE_S = 0.5  # a full listener does not close a new connection younger than this to make room
STALL_S = 1.0  # a full listener may close a request whose peer sent nothing this long (nothing applied yet)
WATCH_INTERVAL_S = 0.1  # how often a listener's watchdog looks for connections past their deadline
REFUSAL_PEEK_S = 0.5  # how long a refusal waits for the peer's first bytes (to answer in its protocol)
MAX_REFUSING = 16  # refusals being delivered at once; more newcomers are closed without one
GROW_STEP_BYTES = 256 << 10  # an announced length is received (and allocated) this much at a time
_TCP_INFO_BYTES = 104  # struct tcp_info up to tcpi_rcv_space (Linux)
_LAST_DATA_RECV_OFFSET = 52  # tcpi_last_data_recv (ms), after 8 u8 fields and 11 u32 fields
T = TypeVar("T")


# -- byte movement ------------------------------------------------------------------------------


def _byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    views = []
    for b in buffers:
        v = memoryview(b)
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")
        if v.nbytes:
            views.append(v)
    return views


def _advance(views: list[memoryview], i: int, done: int) -> int:
    """After ``done`` bytes went through ``views[i:]``: the first view not finished (trimmed to what is left)."""
    while done:
        n = views[i].nbytes
        if done >= n:
            done -= n
            i += 1
        else:
            views[i] = views[i][done:]
            done = 0
    return i


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send every buffer, in order, with gathered writes (``sendmsg``): no joining copy."""
    views = _byte_views(buffers)
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
        for view in views:
            sock.sendall(view)
        return
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))


def recv_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Fill every buffer, in order, with scattered reads (``recvmsg_into``); ConnectionError at EOF."""
    views = _byte_views(buffers)
    if isinstance(sock, ssl.SSLSocket):  # no recvmsg_into (nor flags) over TLS
        for view in views:
            done = 0
            while done < view.nbytes:
                got = sock.recv_into(view[done:])
                if got == 0:
                    raise ConnectionError("peer closed the connection mid-frame")
                done += got
        return
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    i = 0
    while i < len(views):
        if len(views) - i == 1:
            got = sock.recv_into(views[i], views[i].nbytes, socket.MSG_WAITALL)
        else:
            got = sock.recvmsg_into(views[i : i + IOV_MAX], 0, flags)[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        i = _advance(views, i, got)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_buffers(sock, [buf])
    return buf


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with kernel-side timeouts (SO_RCVTIMEO / SO_SNDTIMEO).

    Unlike ``settimeout`` (which polls before every call), a blocking socket
    lets one ``MSG_WAITALL`` read fill many buffers in a single system call.
    A timeout then surfaces as ``BlockingIOError`` (see :func:`is_timeout`).
    A TLS socket gets a plain ``settimeout`` (its reads are Python's anyway).
    ``seconds`` below a microsecond count as one: for the kernel a zero timeout means none at all.
    A socket whose timeouts are already within ``TIMEOUT_SLACK_US`` (or 1/128) of ``seconds`` keeps them:
    a pooled connection's calls each ask for nearly the same, and the two ``setsockopt`` calls cost a
    fast call's client ~10% of its CPU; its reads may so end that much before or after the deadline.
    """
    usec = max(1, int(seconds * 1e6))
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(usec / 1e6)
        return
    if sock.gettimeout() is None:
        current = _io_timeouts.get(sock)
        if current is not None and abs(current - usec) <= max(TIMEOUT_SLACK_US, usec >> 7):
            return
    else:
        sock.settimeout(None)
    timeval = struct.pack("ll", usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    _io_timeouts[sock] = usec


TIMEOUT_SLACK_US = 1000  # set_io_timeout leaves a socket's kernel timeouts alone when this close to the wanted
_io_timeouts: weakref.WeakKeyDictionary[socket.socket, int] = weakref.WeakKeyDictionary()  # what it last set


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (TimeoutError, BlockingIOError))


# -- server side ----------------------------------------------------------------------------------

ERROR_DRAIN_S = 2.0  # after a final error reply, how long a server reads (and drops) what the peer still sends


def send_final(sock: socket.socket, frame: bytes) -> None:
    """Send a last reply, half-close, then drop what the peer still sends (briefly).

    Closing a socket with unread input resets the connection, which can
    destroy the reply before the peer reads it; draining first avoids that.
    """
    try:
        sock.settimeout(1.0)
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        sink = bytearray(1 << 16)
        deadline = time.monotonic() + ERROR_DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv_into(sink):
                break
    except OSError:
        pass


def recv_incremental(sock: socket.socket, n: int, step: int = GROW_STEP_BYTES) -> bytes:
    """Receive exactly ``n`` bytes, allocating at most ``step`` bytes ahead of what arrived.

    For lengths a peer announced: memory follows the bytes actually sent, so
    announcing a huge body costs nothing until its bytes come (at the price of
    one joining copy for bodies over ``step``).
    """
    if n <= step:
        return bytes(recv_exact(sock, n))
    pieces = []
    left = n
    while left:
        piece = recv_exact(sock, min(step, left))
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def recv_discard(sock: socket.socket, n: int, step: int = GROW_STEP_BYTES) -> None:
    """Read ``n`` bytes and drop them, through one buffer of at most ``step`` bytes."""
    sink = bytearray(min(n, step))
    view = memoryview(sink)
    while n:
        k = min(n, len(sink))
        recv_buffers(sock, [view[:k]])
        n -= k


def _cut(sock: socket.socket) -> None:
    """Wake and end whatever a thread does on ``sock`` (the raw fd's shutdown: also right for a TLS socket)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _last_data_s(sock: socket.socket) -> float | None:
    """Seconds since the peer last sent data (the kernel's ``tcpi_last_data_recv``); None if unknown."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return None
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return None
    return struct.unpack_from("<I", info, _LAST_DATA_RECV_OFFSET)[0] / 1000.0


WAITING, READING, SERVING = "waiting", "reading", "serving"


class Connection:
    """One accepted connection as its ``serve`` function sees it: the socket and the request cycle.

    A serve function loops on :meth:`next_request` (the next request's
    header, or ``b""``: return) and calls :meth:`serving` once the request
    is read in full. The states decide what the listener may do to it:

    - ``waiting`` (between requests, or before the first): the listener may
      close it to make room for a newcomer, longest-waiting first;
    - ``reading`` (a request's bytes are arriving, nothing of it applied):
      closed to make room only if the peer sent nothing for ``STALL_S``;
    - ``serving`` (being applied and answered): never closed to make room.

    Deadlines (the listener's watchdog cuts a connection past its deadline,
    whatever it is doing): until the connection is *trusted* (its first
    header arrived and, with an auth file, it authenticated) everything must
    happen within ``FIRST_FRAME_S`` of the accept; then each request, from
    its first byte to its reply's last, gets the listener's
    ``request_deadline_s``; between requests ``IDLE_TIMEOUT_S``.
    """

    __slots__ = ("sock", "host", "thread", "state", "trusted", "cut", "headers", "accepted", "since",
                 "request_start", "deadline", "_listener", "_armed")

    def __init__(self, listener: TcpListener, sock: socket.socket, host: str):
        now = time.monotonic()
        self.sock = sock
        self.host = host
        self.thread: threading.Thread | None = None
        self.state = WAITING
        self.trusted = False
        self.cut = False  # set (under the listener's lock) when the listener ended it
        self.headers = 0  # request headers read so far
        self.accepted = now
        self.since = now  # when the current state began
        self.request_start = now
        self.deadline = now + FIRST_FRAME_S
        self._listener = listener
        self._armed = False  # the socket's kernel timeouts are set (once: the watchdog keeps the deadlines)

    def _set_deadline(self) -> None:
        if not self.trusted:
            self.deadline = self.accepted + FIRST_FRAME_S
        elif self.state == WAITING:
            self.deadline = self.since + IDLE_TIMEOUT_S
        else:
            self.deadline = self.request_start + self._listener.request_deadline_s

    def next_request(self, header_bytes: int, *, authenticated: bool = True) -> bytes:
        """Wait for the next request and read its header (exactly ``header_bytes``); ``b""``: close the connection.

        ``authenticated``: the connection may make requests (False on a
        listener with an auth file until its AUTH was accepted: it then stays
        under the first-frame deadline). A peer that closes, falls silent past
        a deadline, or a connection the listener closed to make room, is
        ``b""``; a header cut short raises ``ConnectionError``.
        """
        lock = self._listener.lock
        with lock:
            if self.cut:
                return b""
            self._waiting(authenticated)
        if not self._armed:  # one receive or send stalls at most this long; the watchdog cuts at the deadlines
            set_io_timeout(self.sock, min(IO_TIMEOUT_S, self._listener.request_deadline_s))
            self._armed = True
        while True:
            try:
                first = self.sock.recv(header_bytes)
                break
            except OSError as exc:
                if not is_timeout(exc):
                    raise
                with lock:  # quiet for one io timeout: keep waiting until the idle deadline
                    if self.cut or time.monotonic() >= self.deadline:
                        return b""
        with lock:
            if self.cut or not first:
                return b""
            self._reading()
        header = first if len(first) == header_bytes else first + recv_exact(self.sock, header_bytes - len(first))
        with lock:
            if self.cut:
                return b""
            self._header_read(authenticated)
        return header

    # The request cycle's transitions, shared by both listeners (the caller holds the listener's lock).

    def _waiting(self, authenticated: bool) -> None:
        """Between requests (or before the first)."""
        self.state, self.since = WAITING, time.monotonic()
        if authenticated and self.headers:  # a header arrived before, and now it may ask
            self.trusted = True
        self._set_deadline()

    def _reading(self) -> None:
        """A request's first bytes arrived: its deadline starts."""
        self.state = READING
        self.since = self.request_start = time.monotonic()
        self._set_deadline()

    def _header_read(self, authenticated: bool) -> None:
        """A request's fixed header was read in full."""
        self.headers += 1
        if authenticated and not self.trusted:
            self.trusted = True
            self._set_deadline()

    def serving(self) -> None:
        """The request was read in full; from now on it is applied and answered (never closed to make room)."""
        with self._listener.lock:
            self._serving()

    def _serving(self) -> None:
        if self.state == READING:
            self.state, self.since = SERVING, time.monotonic()

    def _rank(self, now: float) -> tuple[int, float] | None:
        """How readily the listener closes this connection to make room (lowest first); None: never."""
        if self.cut or self.state == SERVING:
            return None
        if not self.trusted:  # silent or unauthenticated: first, once past its grace
            return (0, self.accepted) if now - self.accepted >= EVICT_GRACE_S else None
        if self.state == WAITING:
            return (1, self.since)
        quiet = _last_data_s(self.sock)
        if quiet is None:
            quiet = now - self.since
        return (2, self.since) if quiet >= STALL_S else None


class TcpListener:
    """Accepts connections on ``host:port`` and runs ``serve(conn)`` for each in its own thread.

    ``serve`` owns the exchange (see :class:`Connection` for the request
    cycle it follows); the listener closes the socket when it returns.

    Room: at most ``max_connections`` at once. When full, a newcomer takes
    the place of the connection that is readiest to go (see
    :meth:`Connection._rank`: a silent or unauthenticated one past
    ``EVICT_GRACE_S``, else the one waiting longest between requests, else a
    request whose peer stalled for ``STALL_S``), which is closed: a client
    whose pooled connection that was retries on a fresh one. Only when every
    connection is busy is the newcomer refused: ``refusal(message, head)``
    (a protocol error frame, in the protocol ``head``, the first bytes the
    peer sent within ``REFUSAL_PEEK_S``, speaks) is sent from a short-lived
    thread that then drains the connection, so the reply is not lost to a
    reset (at most ``MAX_REFUSING`` at once; beyond, plain close).

    Deadlines: a watchdog thread cuts every connection past its deadline
    (:class:`Connection`); ``errors`` (optional) counts ``request_deadline``,
    ``first_frame_deadline`` and ``refused`` connections.

    ``port`` 0 binds any free port; with ``fallback_port`` a taken port falls
    back to any free one (logged). With ``tls`` each connection does its TLS
    handshake in its own thread (within ``FIRST_FRAME_S``) before ``serve``
    sees it (one that fails is closed); a refused connection is then closed
    without a refusal frame (it could not be read before a handshake).
    """

    def __init__(self, name: str, host: str, port: int, serve: Callable[[Connection], None], *,
                 max_connections: int = 64, refusal: Callable[..., bytes] | None = None,
                 fallback_port: bool = False, tls: ssl.SSLContext | None = None,
                 request_deadline_s: float | None = None, errors: Any = None):
        if max_connections < 1:
            raise ValueError(f"{name} listener: max_connections must be at least 1, got {max_connections}")
        self.name = name
        self.max_connections = max_connections
        self.request_deadline_s = REQUEST_DEADLINE_S if request_deadline_s is None else request_deadline_s
        if not self.request_deadline_s > 0:
            raise ValueError(f"{name} listener: request_deadline_s must be > 0, got {self.request_deadline_s}")
        self.errors = errors
        self._serve = serve
        self._refusal = refusal
        self._tls = tls
        self.lock = threading.Lock()
        self._conns: dict[socket.socket, Connection] = {}
        self._refusing = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._listener = self._bind(host, port, fallback_port)
        self.port: int = self._listener.getsockname()[1]

    def _bind(self, host: str, port: int, fallback_port: bool) -> socket.socket:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host.strip("[]"), port))
            except OSError as exc:
                if not fallback_port or port == 0:
                    raise ValueError(f"{self.name} listener cannot bind {host}:{port}: {exc.strerror}") from exc
                log.warning("%s listener: port %d is taken (%s); using any free port", self.name, port, exc.strerror)
                sock.bind((host.strip("[]"), 0))
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def connections(self) -> int:
        """Connections whose thread is still running (one the listener closed counts until its thread ends)."""
        with self.lock:
            return len(self._conns)

    def waiting_connections(self) -> int:
        """Connections between requests now (the ones a newcomer may displace)."""
        with self.lock:
            return sum(c.state == WAITING and not c.cut for c in self._conns.values())

    def start(self) -> TcpListener:
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvpool-{self.name}-accept", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name=f"kvpool-{self.name}-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, wait for their threads."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(timeout)
        with self.lock:
            conns = list(self._conns.values())
            for conn in conns:
                conn.cut = True
                _cut(conn.sock)  # wakes a thread blocked in recv or send
        deadline = time.monotonic() + timeout
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(max(0.0, deadline - time.monotonic()))

    def _count(self, kind: str) -> None:
        if self.errors is not None:
            self.errors.count(kind)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("%s listener: accept failed", self.name)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(self, sock, str(addr[0]) if addr else "")
            with self.lock:
                admitted = self._make_room(conn.accepted)
                if admitted:
                    conn.thread = threading.Thread(target=self._run, args=(conn,), name=f"kvpool-{self.name}-conn",
                                                   daemon=True)
                    self._conns[sock] = conn
            if admitted:
                assert conn.thread is not None, "listener: an admitted connection without its thread"
                conn.thread.start()
            else:
                self._count("refused")
                self._refuse(sock, f"too many {self.name} connections (limit {self.max_connections}); retry later")

    def _make_room(self, now: float) -> bool:
        """Under the lock: whether a newcomer fits, closing the readiest connection if the listener is full."""
        live = [c for c in self._conns.values() if not c.cut]
        if len(live) < self.max_connections:
            return len(self._conns) < 2 * self.max_connections  # cut ones still winding down count, up to a point
        ranked = [(rank, c) for c in live if (rank := c._rank(now)) is not None]
        if not ranked:
            return False
        _, victim = min(ranked, key=lambda rc: rc[0])
        victim.cut = True
        _cut(victim.sock)
        log.debug("%s listener: full; closed a %s connection from %s to make room", self.name, victim.state,
                  victim.host)
        return len(self._conns) < 2 * self.max_connections

    def _refuse(self, sock: socket.socket, message: str) -> None:
        """Refuse a newcomer: a refusal frame from a short-lived thread (see the class docstring), or a plain close."""
        with self.lock:
            deliver = self._refusal is not None and self._tls is None and self._refusing < MAX_REFUSING
            if deliver:
                self._refusing += 1
        if not deliver:
            sock.close()
            return
        threading.Thread(target=self._deliver_refusal, args=(sock, message), name=f"kvpool-{self.name}-refuse",
                         daemon=True).start()

    def _deliver_refusal(self, sock: socket.socket, message: str) -> None:
        try:
            head = b""
            try:
                sock.settimeout(REFUSAL_PEEK_S)
                head = sock.recv(4, socket.MSG_PEEK)
            except OSError:
                pass
            assert self._refusal is not None, "listener: delivering a refusal without a refusal frame"
            send_final(sock, self._refusal(message, head))
        finally:
            sock.close()
            with self.lock:
                self._refusing -= 1

    def _watch(self) -> None:
        """The watchdog: cut connections past their deadline (see :class:`Connection`)."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            self._expire(time.monotonic())

    def _expire(self, now: float) -> list[Connection]:
        """Cut the connections past their deadline (counted, logged); the ones cut."""
        expired = []
        with self.lock:
            for conn in self._conns.values():
                if not conn.cut and now >= conn.deadline:
                    conn.cut = True
                    _cut(conn.sock)
                    expired.append(conn)
        for conn in expired:
            if not conn.trusted:
                self._count("first_frame_deadline")
            elif conn.state != WAITING:
                self._count("request_deadline")
            log.debug("%s listener: cut a %s connection from %s at its deadline", self.name, conn.state, conn.host)
        return expired

    def _run(self, conn: Connection) -> None:
        try:
            if self._tls is not None:
                with self.lock:  # registered under the wrapper, so the watchdog and stop() can cut the handshake too
                    if conn.cut:
                        return
                    raw = conn.sock
                    tls_sock = self._tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                    conn.sock = tls_sock
                    self._conns[tls_sock] = self._conns.pop(raw)
                try:
                    tls_sock.settimeout(max(0.001, conn.deadline - time.monotonic()))
                    tls_sock.do_handshake()
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    log.debug("%s listener: TLS handshake failed: %s", self.name, exc)
                    return
            self._serve(conn)
        finally:
            with self.lock:  # closed under the lock: nobody cuts a closed (maybe reused) descriptor
                self._conns.pop(conn.sock, None)
                conn.cut = True
                conn.sock.close()


# -- client side ----------------------------------------------------------------------------------


class ConnectFailed(ConnectionError):
    """No connection to the address could be made."""


class Refused(ConnectFailed):
    """The listener was full and refused the connection: nothing of the request was read or applied.

    Raised by an exchange function (or a ``hello``) that recognises its
    protocol's refusal; the caller may send the request another way.
    """


class Exchange:
    """Per-attempt state an exchange function updates: set ``replied`` once any reply byte arrived.

    ``spin_s``: how long the exchange polls for its reply before it blocks (the pool's ``spin_wait_s``; see
    :func:`await_bytes`). ``deadline``: the call's ``time.monotonic()`` deadline (None: none), shared by
    every wait of the call (connecting, AUTH, the spin, the blocking read): no wait outlives it.
    ``wait_s``: the longest one socket wait may block within the deadline (the pool's ``timeout_s``).
    ``polled``: set by the exchange function, what its poll for the reply gave (None: it did not poll).
    """

    def __init__(self, spin_s: float = 0.0, deadline: float | None = None, wait_s: float = math.inf):
        self.replied = False
        self.polled: bool | None = None  # its reply poll (await_bytes): True: the reply came; False: it did not
        self.spin_s = spin_s
        self.deadline = deadline
        self.wait_s = wait_s

    def left(self) -> float | None:
        """Seconds to the deadline (None: no deadline); TimeoutError once it passed."""
        return time_left(self.deadline)


def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``; None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def capped(limit: float, deadline: float | None) -> float:
    """``limit`` seconds, or what is left until ``deadline`` if that is less (never quite 0: a socket's 0
    means no timeout)."""
    return limit if deadline is None else max(1e-6, min(limit, deadline - time.monotonic()))


_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # (an int: the flags' enum OR costs a poll ~1 us)
_SPINNING = threading.Semaphore(1)  # one thread of a process polls for its reply at a time
MAX_POLL_PAUSE = 64  # most waits blocked at once after polls went unanswered (PollPause)
MAX_PAUSED_ADDRESSES = 4096  # addresses a pool keeps a PollPause for


def await_bytes(sock: socket.socket, spin_s: float, deadline: float | None = None) -> bool | None:
    """Poll ``sock`` until a byte is readable, for up to ``spin_s`` and never past ``deadline``
    (``time.monotonic()``), yielding the CPU between polls. True: a byte is there (or the peer closed, or
    the socket failed: the caller's read reports it); False: the spin ended first, nothing read; None: it did
    not poll (no spin, a TLS socket, or another thread of the process polls).

    A reply that comes within a few hundred microseconds then costs no wake-up: on a VM a thread blocked that
    long has its virtual CPU halted, and waking it costs ~100-300 us here, more than a small call's work
    (``benchmarks/reply_spin.py``). The poll holds the GIL only between system calls, and ``sched_yield``
    gives the core to anything runnable. TLS sockets are not polled (their reads are Python's).

    A :class:`ConnectionPool` polls for a peer's replies while its polls pay (:class:`PollPause`): a loaded
    peer's reply comes later than any spin, and polling for it only takes the CPU that peer or the
    host's other callers need.

    One thread of a process polls at a time; the others waiting meanwhile block at once. A process with
    one waiter is the one whose core would go idle; with many (a benchmark's 128 client threads), each
    poll is a GIL hand-off among them that starves the thread whose reply is in (``master_scale.py``
    at 1,024 clients: 12,483 lookups/s with one poller a process, 9,803 with all of them).
    """
    if spin_s <= 0 or isinstance(sock, ssl.SSLSocket) or not _SPINNING.acquire(blocking=False):
        return None
    try:
        return _spin(sock, spin_s, deadline)
    finally:
        _SPINNING.release()


def _spin(sock: socket.socket, spin_s: float, deadline: float | None) -> bool:
    end = time.monotonic() + spin_s
    if deadline is not None:
        end = min(end, deadline)
    while True:
        try:
            sock.recv(1, _PEEK_NOW)
            return True  # a byte, or b"" for a closed peer
        except BlockingIOError:
            pass
        except OSError:
            return True
        if time.monotonic() >= end:
            return False
        os.sched_yield()


class PollPause:
    """Whether to poll for a peer's next bytes before blocking, from how the last polls went: after a poll that
    went unanswered, not for a pause of waits that doubles with each poll that fails again, up to
    :data:`MAX_POLL_PAUSE`; the first poll that pays ends it. So a busy peer is polled for (no wake-up a wait)
    and an idle or loaded one costs at most one failed poll in ``MAX_POLL_PAUSE + 1`` waits. Unlocked: its
    reads and writes may race between threads without harm (it is a heuristic)."""

    __slots__ = ("_left", "_length")

    def __init__(self) -> None:
        self._left = 0  # waits still to block at once
        self._length = 0  # the pause after the last poll that failed (0: the last poll paid)

    def due(self) -> bool:
        """True: poll for this wait (False: block at once; the pause is a wait shorter)."""
        if self._left <= 0:
            return True
        self._left -= 1
        return False

    def paid(self, answered: bool) -> None:
        """A poll's outcome: ``answered``, the bytes came within it."""
        self._length = 0 if answered else min(2 * self._length or 1, MAX_POLL_PAUSE)
        self._left = self._length


class ConnectionPool:
    """Idle connections per ``host:port`` (thread-safe); see the module docstring."""

    def __init__(self, timeout_s: float, *, connect_timeout_s: float | None = None, max_idle_per_address: int = 4,
                 tls: ssl.SSLContext | None = None, hello: Callable[[socket.socket], None] | None = None,
                 spin_wait_s: float = 0.0):
        self.timeout_s = timeout_s
        self.spin_wait_s = spin_wait_s
        self._poll_pauses: dict[str, PollPause] = {}  # per address: when to poll for its replies
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.max_idle_per_address = max_idle_per_address
        self.tls = tls
        self.hello = hello
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False

    def _acquire(self, address: str, fresh: bool = False,
                 deadline: float | None = None) -> tuple[socket.socket, bool]:
        """A connection to ``address`` and whether it was pooled (``fresh``: a new one, whatever is pooled).

        A new connection's connect, TLS handshake and ``hello`` end by ``deadline`` (TimeoutError if it
        passed before they began; a ConnectFailed if it passes during them).
        """
        with self._lock:
            if self._closed:
                raise ConnectFailed("connection pool is closed")
            idle = self._idle.get(address)
            if idle and not fresh:
                return idle.pop(), True
        time_left(deadline)
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)),
                                            timeout=capped(self.connect_timeout_s, deadline))
        except (OSError, ValueError) as exc:
            raise ConnectFailed(f"cannot connect to {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock.settimeout(capped(self.connect_timeout_s, deadline))
                sock = self.tls.wrap_socket(sock, server_hostname=host.strip("[]"))
            except (OSError, ValueError) as exc:  # ssl.SSLError (e.g. certificate not trusted) is an OSError
                sock.close()
                raise ConnectFailed(f"TLS with {address} failed: {exc}") from exc
        set_io_timeout(sock, capped(self.timeout_s, deadline))
        if self.hello is not None:
            try:
                self.hello(sock)
            except ConnectFailed:  # e.g. Refused: already says what happened
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                raise ConnectFailed(f"{address} closed the connection at its first frame: {exc}") from exc
            except BaseException:
                sock.close()
                raise
        return sock, False

    def connect(self, address: str, timeout: float | None = None) -> socket.socket:
        """A new connection to ``address`` (TLS and ``hello`` done, within ``timeout`` if given) that the caller
        owns and closes; not pooled. Its reads and writes time out after the pool's ``timeout_s``."""
        sock = self._acquire(address, fresh=True, deadline=_deadline(timeout))[0]
        if timeout is not None:
            set_io_timeout(sock, self.timeout_s)
        return sock

    def _release(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.max_idle_per_address:
                idle.append(sock)
                return
        sock.close()

    def exchange(self, address: str, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run ``fn(sock, state, *args)`` on a connection to ``address``; the connection is kept only if it returns.

        ``timeout``: the whole exchange's deadline, connecting, AUTH and a retry included (``state.deadline``;
        each socket wait is armed with what is left of it); None: each socket wait gets the pool's
        ``timeout_s``. Raises :class:`ConnectFailed` if no connection can be made, TimeoutError if the
        deadline passed first, and whatever ``fn`` raises otherwise (the connection is then dropped).
        """
        deadline = _deadline(timeout)
        for attempt in range(2):
            time_left(deadline)  # TimeoutError: spent before a connection was touched
            sock, reused = self._acquire(address, attempt > 0, deadline)  # the retry: a new connection, not
            # another pooled one (the listener may have closed several idle ones to make room)
            state = Exchange(self._spin_for(address), deadline, self.timeout_s)
            try:
                set_io_timeout(sock, capped(self.timeout_s, deadline))
                result = fn(sock, state, *args)
                if state.polled is not None:
                    self._poll_paid(address, state.polled)
            except OSError as exc:
                sock.close()
                if reused and not state.replied and attempt == 0 and not is_timeout(exc):
                    continue  # the server closed this idle connection: try a fresh one
                raise  # a timeout is not retried: a stalled peer would cost the caller its deadline twice
            except BaseException:
                sock.close()
                raise
            self._release(address, sock)
            return result
        raise AssertionError("connection pool: retry loop fell through")

    def _spin_for(self, address: str) -> float:
        """How long this call polls for its reply: ``spin_wait_s`` unless ``address``'s polls lately went
        unanswered (a loaded peer: its reply comes later than any spin, and polling for it only takes CPU from
        it and the host's other callers; :class:`PollPause`)."""
        pause = self._poll_pauses.get(address)
        return self.spin_wait_s if pause is None or pause.due() else 0.0

    def _poll_paid(self, address: str, paid: bool) -> None:
        pause = self._poll_pauses.get(address)
        if pause is None:
            if len(self._poll_pauses) >= MAX_PAUSED_ADDRESSES:
                self._poll_pauses.clear()  # (a client of very many peers: start over)
            pause = self._poll_pauses[address] = PollPause()
        pause.paid(paid)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()
