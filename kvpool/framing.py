"""Plain-TCP plumbing shared by kvpool's framed protocols (bulk bytes, fast calls).

- :func:`send_buffers` / :func:`recv_buffers`: gathered writes and scattered
  reads of many buffers in few system calls, never a joining copy.
- :class:`TcpListener`: a listening socket with one thread per connection,
  at most ``max_connections`` at once, and a ``stop`` that cuts every
  connection and waits for its thread.
- :class:`ConnectionPool`: the client side: idle connections kept per
  address; one exchange at a time per connection; a pooled connection the
  server closed meanwhile is retried once on a fresh one, before any reply
  byte arrived (never after: the request may have been applied), and never
  after a timeout (a stalled peer must not cost the caller its deadline twice).
- TLS (optional): a listener with a server :class:`ssl.SSLContext` wraps each
  connection in its own thread; a pool with a client context wraps each new
  connection, checking the certificate against the host it dialed. TLS
  sockets cannot gather or scatter (``sendmsg``), so their buffers go one at a time.
- A pool's ``hello`` runs once on each new connection before its first
  exchange (the AUTH frame of kvpool's protocols).
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into call (Linux's UIO_MAXIOV)
IDLE_TIMEOUT_S = 300.0  # a server closes a connection with no request this long
IO_TIMEOUT_S = 30.0  # a server drops a request stalled this long mid-frame
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
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    sec = int(seconds)
    timeval = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


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


class TcpListener:
    """Accepts connections on ``host:port`` and runs ``serve(sock)`` for each in its own thread.

    ``serve`` owns the exchange; the listener closes the socket when it
    returns. A connection beyond ``max_connections`` gets ``refusal(message)``
    (a protocol error frame) and is closed. ``port`` 0 binds any free port;
    with ``fallback_port`` a taken port falls back to any free one (logged).
    With ``tls`` each connection does its TLS handshake in its own thread
    before ``serve`` sees it (one that fails is closed); a connection over the
    limit is then closed without a refusal frame (it could not be read before
    a handshake).
    """

    def __init__(self, name: str, host: str, port: int, serve: Callable[[socket.socket], None], *,
                 max_connections: int = 64, refusal: Callable[[str], bytes] | None = None,
                 fallback_port: bool = False, tls: ssl.SSLContext | None = None):
        if max_connections < 1:
            raise ValueError(f"{name} listener: max_connections must be at least 1, got {max_connections}")
        self.name = name
        self.max_connections = max_connections
        self._serve = serve
        self._refusal = refusal
        self._tls = tls
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
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
        with self._lock:
            return len(self._conns)

    def start(self) -> "TcpListener":
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvpool-{self.name}-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, wait for their threads."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("%s listener: accept failed", self.name)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    thread = threading.Thread(target=self._run, args=(sock,), name=f"kvpool-{self.name}-conn",
                                              daemon=True)
                    self._conns[sock] = thread
            if full:
                self._refuse(sock, f"too many {self.name} connections (limit {self.max_connections}); retry later")
            else:
                thread.start()

    def _refuse(self, sock: socket.socket, message: str) -> None:
        try:
            if self._refusal is not None and self._tls is None:
                sock.settimeout(1.0)
                sock.sendall(self._refusal(message))
        except OSError:
            pass
        finally:
            sock.close()

    def _run(self, sock: socket.socket) -> None:
        try:
            if self._tls is not None:
                with self._lock:  # registered under the wrapper, so stop() can cut the handshake too
                    thread = self._conns.pop(sock)
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                    self._conns[sock] = thread
                try:
                    sock.settimeout(IO_TIMEOUT_S)
                    sock.do_handshake()
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    log.debug("%s listener: TLS handshake failed: %s", self.name, exc)
                    return
            self._serve(sock)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()


# -- client side ----------------------------------------------------------------------------------


class ConnectFailed(ConnectionError):
    """No connection to the address could be made."""


class Exchange:
    """Per-attempt state an exchange function updates: set ``replied`` once any reply byte arrived."""

    replied = False


class ConnectionPool:
    """Idle connections per ``host:port`` (thread-safe); see the module docstring."""

    def __init__(self, timeout_s: float, *, connect_timeout_s: float | None = None, max_idle_per_address: int = 4,
                 tls: ssl.SSLContext | None = None, hello: Callable[[socket.socket], None] | None = None):
        self.timeout_s = timeout_s
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.max_idle_per_address = max_idle_per_address
        self.tls = tls
        self.hello = hello
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False

    def _acquire(self, address: str) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise ConnectFailed("connection pool is closed")
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.connect_timeout_s)
        except (OSError, ValueError) as exc:
            raise ConnectFailed(f"cannot connect to {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=host.strip("[]"))
            except (OSError, ValueError) as exc:  # ssl.SSLError (e.g. certificate not trusted) is an OSError
                sock.close()
                raise ConnectFailed(f"TLS with {address} failed: {exc}") from exc
        set_io_timeout(sock, self.timeout_s)
        if self.hello is not None:
            try:
                self.hello(sock)
            except OSError as exc:
                sock.close()
                raise ConnectFailed(f"{address} closed the connection at its first frame: {exc}") from exc
            except BaseException:
                sock.close()
                raise
        return sock, False

    def _release(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.max_idle_per_address:
                idle.append(sock)
                return
        sock.close()

    def exchange(self, address: str, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(sock, state, *args)`` on a connection to ``address``; the connection is kept only if it returns.

        Raises :class:`ConnectFailed` if no connection can be made, and
        whatever ``fn`` raises otherwise (the connection is then dropped).
        """
        for attempt in range(2):
            sock, reused = self._acquire(address)
            state = Exchange()
            try:
                result = fn(sock, state, *args)
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()
