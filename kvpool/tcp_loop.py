"""The event-loop listener: many connections of small unary frames served without a thread per connection.

:class:`LoopListener` is a :class:`~kvpool.tcp.TcpListener` (same constructor, room, eviction ranks,
refusals, deadlines and counters: the shared code lives there) whose connections are not threads: one
loop thread waits on every socket at once (``epoll``, Linux), reads each request incrementally as its
bytes arrive, many sockets per wake-up, and answers the complete ones itself, sending each reply
non-blocking (what does not fit in the socket's buffer goes out as the peer reads). Answering on the
loop thread costs the master about half the CPU of handing each request to a worker thread (a GIL
switch per request: 98 vs 195 us per 64-key Lookup here, ``docs/benchmarks.md``). So that a slow
request cannot stall everyone, ``standbys`` threads wait to take the loop over: one whose request runs
past ``TAKEOVER_S`` is deposed (it finishes that request, then stands by) and a standby runs the loop
(leader and followers). Made for the master's fast-call port: unary requests (small frames, no
payload); a node's data port (bulk GET/PUT streaming payloads) stays on threads.

The frames are a :class:`FrameServer`'s (:class:`kvpool.wire.WireHandler`): after a fixed header of
``head_bytes`` it says how many bytes to read (or read past) and then answers them, or that the
connection must close after a final reply.

Invariants, per connection:

- one request at a time: while a request is being read, served or answered nothing more is read from
  its socket (a client that pipelines or never reads its replies leaves its bytes in the kernel's
  buffers), so its memory is at most one request (bytes allocated as they arrive, at most the method's
  header limit) and one reply;
- exactly one actor at a time: a connection whose request is being answered (``busy``) belongs to the
  thread answering it. Sockets stay registered level-triggered for what their phase waits for (to read,
  or to send the rest of a reply), so an ordinary request costs no ``epoll_ctl``: it is read, answered
  and replied to within one turn of the loop, before the next poll. The loop skips a busy connection's
  events and quiets its socket (no events, under the lock) until its owner hands it back, re-armed under
  the lock. Only the loop thread of the moment polls, reads and closes sockets, and never a busy one: a
  deposed thread hands a connection that was cut while it answered back to the loop;
- the limits of :class:`~kvpool.tcp.TcpListener` hold: ``max_connections`` with the same eviction
  ranks, the first-frame, request and idle deadlines (checked by the loop every
  ``WATCH_INTERVAL_S``), refusal frames; a frame out of step gets its final reply, a half-close and up
  to ``ERROR_DRAIN_S`` of reading (and dropping) before the close, without a thread.

TLS is not served here (a TLS socket cannot be read incrementally without its own state machine):
a listener with TLS uses the thread-per-connection :class:`~kvpool.tcp.TcpListener`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

from kvpool.tcp import (
    ERROR_DRAIN_S,
    GROW_STEP_BYTES,
    WAITING,
    WATCH_INTERVAL_S,
    Connection,
    PollPause,
    TcpListener,
    _cut,
)

log = logging.getLogger(__name__)

STANDBYS = 2  # threads per listener waiting to take the loop over from one stuck in a slow request
TAKEOVER_S = 0.05  # a request answered on the loop longer than this hands the loop to a standby
ACCEPTS_PER_WAKE = 64  # connections accepted per wake-up before the loop serves the rest
FINAL_SEND_S = 1.0  # how long a final reply may take to go out before its connection is closed

# What a socket is registered for: level-triggered reading or writing, or quiet (one-shot with no events: a
# hang-up, which epoll reports whatever the mask, is reported once, not at every poll)
_IN, _OUT, _QUIET = select.EPOLLIN, select.EPOLLOUT, select.EPOLLONESHOT

# A connection's phase (what its next bytes are for)
HEAD, BODY, SKIP, SEND, FINAL, DRAIN = "head", "body", "skip", "send", "final", "drain"


class FrameServer(Protocol):
    """The protocol a :class:`LoopListener` serves (see :class:`kvpool.wire.WireHandler`)."""

    head_bytes: int

    def new_peer(self) -> Any: ...

    def begin(self, raw: bytes, peer: Any) -> Any: ...

    def answer(self, step: Any, body: bytes, peer: Any, host: str) -> tuple[bytes, bool]: ...

    def answer_together(self, requests: Sequence[tuple[Any, bytes, Any, str]]) -> list[tuple[bytes, bool] | None]: ...

    def serve(self, conn: Connection) -> None: ...


class LoopConnection(Connection):
    """A :class:`~kvpool.tcp.Connection` served by the loop: its request cycle and its bytes in flight."""

    __slots__ = ("peer", "phase", "need", "buf", "step", "out", "busy", "until", "answer", "armed")

    def __init__(self, listener: TcpListener, sock: socket.socket, host: str, peer: Any):
        super().__init__(listener, sock, host)
        self.peer = peer
        self.phase = HEAD
        self.need = 0  # bytes still to read in this phase (HEAD: of the fixed header)
        self.buf = bytearray()  # what was read of the fixed header or header section
        self.step: Any = None  # the FrameServer's plan for the request being read
        self.out: memoryview | None = None  # reply bytes not sent yet
        self.busy = False  # its request is being answered (the answering thread owns it)
        self.until = 0.0  # FINAL / DRAIN: when it is closed whatever the peer does
        self.answer: tuple[bytes, bool] | None = None  # its request's reply, made with others that came together
        self.armed = _IN  # the events its socket is registered for


class LoopListener(TcpListener):
    """A :class:`~kvpool.tcp.TcpListener` served by one loop thread and ``standbys`` threads (module docstring).

    ``frames``: the protocol (a :class:`FrameServer`). ``poll_s``: how long the loop polls for the next
    request before it blocks, while such polls pay (:class:`~kvpool.tcp.PollPause`); 0: it blocks at once.
    """

    def __init__(self, name: str, host: str, port: int, frames: FrameServer, *, standbys: int = STANDBYS,
                 poll_s: float = 0.0, **limits: Any):
        if limits.get("tls") is not None:
            raise ValueError(f"{name} listener: the event loop does not serve TLS (use TcpListener)")
        if standbys < 1:
            raise ValueError(f"{name} listener: standbys must be >= 1, got {standbys}")
        super().__init__(name, host, port, frames.serve, **limits)
        self.frames = frames
        self._standbys = standbys
        self._epoll = select.epoll()
        self._by_fd: dict[int, LoopConnection] = {}
        self._handed_back: list[LoopConnection] = []  # cut while a deposed loop thread served them
        self._turn = threading.Condition(self.lock)  # who runs the loop (below: under the lock)
        self._leader: int | None = None  # the thread running the loop now
        self._answering_since = 0.0  # when the loop thread began answering a request (0: it is not)
        self._orphans: list[tuple[LoopConnection, bytes]] = []  # complete requests a deposed loop thread left
        self._threads: list[threading.Thread] = []
        self._wake_r, self._wake_w = os.pipe()
        self._poll_s = poll_s
        self._poll_pause = PollPause()  # (only the loop thread of the moment uses it)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> LoopListener:
        self._listener.setblocking(False)
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        for i in range(1 + self._standbys):
            t = threading.Thread(target=self._thread_main, name=f"kvpool-{self.name}-loop{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, wait for the loop's threads."""
        with self._turn:
            self._stopping.set()
            self._turn.notify_all()
        self._wake()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            for conn in self._loop_conns():
                conn.cut = True
                _cut(conn.sock)
                if not conn.busy:
                    self._close_locked(conn)
        self._listener.close()
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: the loop is awake anyway
            pass

    # -- the loop ---------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        """A loop thread: run the loop while it leads, wait as a standby otherwise."""
        me = threading.get_ident()
        while self._lead(me):
            self._loop(me)

    def _lead(self, me: int) -> bool:
        """Wait until this thread may run the loop: nobody does, or the one who does is stuck answering a
        request for ``TAKEOVER_S`` (it is deposed: it finishes that request and then stands by). False: stop."""
        with self._turn:
            while not self._stopping.is_set():
                if self._leader is None or (self._answering_since
                                            and time.monotonic() - self._answering_since >= TAKEOVER_S):
                    if self._leader is not None:
                        log.debug("%s listener: a request took over %.0f ms; another thread runs the loop",
                                  self.name, TAKEOVER_S * 1e3)
                    self._leader, self._answering_since = me, 0.0
                    return True
                self._turn.wait(TAKEOVER_S / 2)
        return False

    def _loop(self, me: int) -> None:
        """The loop, while this thread leads (returns when deposed or stopping)."""
        listen_fd = self._listener.fileno()
        next_watch = time.monotonic() + WATCH_INTERVAL_S
        while not self._stopping.is_set():
            try:
                events = self._poll(max(0.0, next_watch - time.monotonic()))
            except InterruptedError:
                continue
            with self.lock:
                ready, self._orphans = self._orphans, []
            fresh = len(ready)  # (orphans were answered together already, if they could be)
            for fd, _ in events:
                if fd == listen_fd:
                    self._accept()
                elif fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                else:
                    conn = self._by_fd.get(fd)
                    if conn is not None and not (conn.busy and self._quiet(conn)):
                        self._on_event(conn, ready)
            if len(ready) - fresh > 1:
                self._answer_together(ready[fresh:])
            for i, item in enumerate(ready):
                with self.lock:
                    self._answering_since = time.monotonic()
                self._answer(*item)
                with self.lock:
                    if self._leader != me:  # deposed while answering: the new loop thread answers the rest
                        self._orphans.extend(ready[i + 1:])
                        self._wake()
                        return
                    self._answering_since = 0.0  # (only the leader's own: a deposed thread leaves the new one's)
            if self._handed_back:
                with self.lock:
                    back, self._handed_back = self._handed_back, []
                    for conn in back:
                        self._close_locked(conn)
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCH_INTERVAL_S
                self._watch_once(now)

    def _poll(self, timeout: float) -> list[tuple[int, int]]:
        """The sockets' events: polled for up to ``poll_s`` while such polls pay (a thread blocked in ``epoll``
        for ~100 us has its virtual CPU halted on a VM, and its wake-up costs the master more than the poll:
        ``docs/benchmarks.md``), then waited for up to ``timeout``."""
        if self._poll_s and self._poll_pause.due():
            end = time.monotonic() + self._poll_s
            while not (events := self._epoll.poll(0)) and time.monotonic() < end:
                os.sched_yield()
            self._poll_pause.paid(bool(events))
            if events:
                return events
        return self._epoll.poll(timeout)

    def _watch_once(self, now: float) -> None:
        """The deadlines: close connections whose final reply or drain ran out, cut those past their deadline."""
        with self.lock:
            for conn in [c for c in self._loop_conns() if c.phase in (FINAL, DRAIN) and now >= c.until]:
                conn.cut = True
                self._close_locked(conn)
        self._expire(now)
        with self.lock:
            for conn in [c for c in self._loop_conns() if c.cut and not c.busy]:
                self._close_locked(conn)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:
                if not self._stopping.is_set():
                    log.exception("%s listener: accept failed", self.name)
                    time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = LoopConnection(self, sock, str(addr[0]) if addr else "", self.frames.new_peer())
            with self.lock:
                admitted = self._make_room(conn.accepted)
                if admitted:
                    sock.setblocking(False)
                    conn.need = self.frames.head_bytes
                    self._conns[sock] = conn
                    self._by_fd[sock.fileno()] = conn
                    self._epoll.register(sock.fileno(), _IN)
                for victim in [c for c in self._loop_conns() if c.cut and not c.busy and c is not conn]:
                    self._close_locked(victim)  # the one closed to make room (its fd is free now)
            if not admitted:
                self._count("refused")
                self._refuse(sock, f"too many {self.name} connections (limit {self.max_connections}); retry later")

    def _on_event(self, conn: LoopConnection, ready: list[tuple[LoopConnection, bytes]]) -> None:
        """One readiness event of an armed connection (it is not busy: nobody answers it)."""
        try:
            if conn.cut:
                raise ConnectionError("cut")
            if conn.phase in (SEND, FINAL):
                self._flush(conn)
            elif conn.phase == DRAIN:
                self._drain(conn)
            else:
                self._read(conn, ready)
        except OSError as exc:  # the peer closed, reset, or the listener cut it
            log.debug("%s listener: connection from %s dropped: %s", self.name, conn.host, exc)
            with self.lock:
                conn.cut = True
                self._close_locked(conn)

    def _read(self, conn: LoopConnection, ready: list[tuple[LoopConnection, bytes]]) -> None:
        """Read what arrived of the request (never past it); a complete one goes to ``ready``."""
        sock = conn.sock
        while True:
            try:
                data = sock.recv(min(conn.need, GROW_STEP_BYTES))
            except BlockingIOError:
                self._arm(conn, _IN)
                return
            if not data:
                raise ConnectionError("peer closed the connection" + (" mid-frame" if conn.buf else ""))
            if conn.phase == HEAD and not conn.buf:
                with self.lock:
                    conn._reading()
            conn.need -= len(data)
            if conn.phase != SKIP:
                conn.buf += data
            if conn.need:
                continue
            if conn.phase == HEAD and not self._begin(conn):
                return
            if conn.need:  # a header section (or a frame to read past) follows
                continue
            body, conn.buf = bytes(conn.buf), bytearray()
            with self.lock:
                if conn.cut:
                    raise ConnectionError("cut")
                conn._serving()
                conn.busy = True
            ready.append((conn, body))
            return

    def _begin(self, conn: LoopConnection) -> bool:
        """The fixed header is in: plan the rest of the request. False: the connection is closing (final reply)."""
        raw, conn.buf = bytes(conn.buf), bytearray()
        with self.lock:
            conn._header_read(not conn.peer.needs_auth)
        step = self.frames.begin(raw, conn.peer)
        if step.final is not None:
            self._finish(conn, step.final)
            return False
        conn.step = step
        conn.need = step.read
        conn.phase = SKIP if step.discard else BODY
        return True

    def _flush(self, conn: LoopConnection) -> None:
        """Send more of a pending reply; once it is out, the connection reads its next request (or drains)."""
        out = conn.out
        assert out is not None, "loop: a send phase without bytes to send"
        try:
            sent = conn.sock.send(out)
        except BlockingIOError:
            sent = 0
        if sent < len(out):
            conn.out = out[sent:]
            self._arm(conn, _OUT)
            return
        conn.out = None
        if conn.phase == FINAL:
            socket.socket.shutdown(conn.sock, socket.SHUT_WR)
            conn.phase, conn.until = DRAIN, time.monotonic() + ERROR_DRAIN_S
            self._arm(conn, _IN)
            return
        self._next_request(conn)

    def _drain(self, conn: LoopConnection) -> None:
        """After a final reply: read and drop what the peer still sends, until it closes (or ``until``)."""
        while True:
            try:
                if not conn.sock.recv(GROW_STEP_BYTES):
                    raise ConnectionError("drained")
            except BlockingIOError:
                self._arm(conn, _IN)
                return

    def _next_request(self, conn: LoopConnection) -> None:
        """The reply is out: wait for the next request (re-armed for reading)."""
        with self.lock:
            conn._waiting(not conn.peer.needs_auth)
            conn.phase, conn.need, conn.step = HEAD, self.frames.head_bytes, None
            if conn.busy:  # its request was answered: the connection goes back to the loop
                conn.busy = False
                if conn.cut:
                    self._hand_back(conn)
                    return
            self._arm(conn, _IN)

    def _finish(self, conn: LoopConnection, frame: bytes) -> None:
        """A final reply: send it, half-close, drain (bounded by ``until``), close."""
        conn.phase, conn.until = FINAL, time.monotonic() + FINAL_SEND_S + ERROR_DRAIN_S
        conn.out = memoryview(frame)
        self._flush(conn)

    # -- answering ----------------------------------------------------------------------------------

    def _answer_together(self, ready: list[tuple[LoopConnection, bytes]]) -> None:
        """Make the replies of requests that arrived in one wake-up and can be answered in one pass (the
        master's lookups: one index pass); each is sent by :meth:`_answer` in turn. Under the takeover clock
        like any request: a pass stuck past ``TAKEOVER_S`` hands the loop over."""
        with self.lock:
            self._answering_since = time.monotonic()
        try:
            answers = self.frames.answer_together([(c.step, body, c.peer, c.host) for c, body in ready])
        except Exception:  # answer_together turns a handler's errors into replies: a bug in the listener's code
            log.exception("%s listener: answering requests together failed", self.name)
            return
        for (conn, _), answer in zip(ready, answers):
            conn.answer = answer

    def _answer(self, conn: LoopConnection, body: bytes) -> None:
        """Serve a complete request (its connection is busy: owned here) and send its reply, or start to (the
        rest goes out as the peer reads)."""
        try:
            if conn.answer is not None:
                (reply, keep), conn.answer = conn.answer, None
            else:
                reply, keep = self.frames.answer(conn.step, body, conn.peer, conn.host)
        except Exception:  # answer turns a handler's errors into replies: this is a bug in the listener's code
            log.exception("%s listener: answering a request failed", self.name)
            reply, keep = b"", False
        try:
            if not keep:
                conn.phase, conn.until = FINAL, time.monotonic() + FINAL_SEND_S + ERROR_DRAIN_S
            else:
                conn.phase = SEND
            conn.out = memoryview(reply)
            try:
                sent = conn.sock.send(reply) if reply else 0
            except BlockingIOError:
                sent = 0
            if keep and sent == len(reply):
                conn.out = None
                self._next_request(conn)
                return
            conn.out = conn.out[sent:]
        except OSError as exc:
            log.debug("%s listener: reply to %s not sent: %s", self.name, conn.host, exc)
            conn.cut = True
        with self.lock:  # the rest goes out from the loop (or the connection ends there)
            conn.busy = False
            if conn.cut or not reply:
                conn.cut = True
                self._hand_back(conn)
            else:
                self._arm(conn, _OUT)

    def _loop_conns(self) -> list[LoopConnection]:
        """Every connection (under the lock): all of them are this listener's LoopConnections."""
        return cast(list[LoopConnection], list(self._conns.values()))

    def _quiet(self, conn: LoopConnection) -> bool:
        """An event of a busy connection (its peer sent more, or closed, while another thread answers it):
        True if it is still busy, and then its socket is quiet until that thread hands it back."""
        with self.lock:
            if not conn.busy:
                return False
            self._arm(conn, _QUIET)
            return True

    def _arm(self, conn: LoopConnection, events: int) -> None:
        """Register the connection's socket for ``events`` (a no-op when it is registered for them already).
        A socket already closed by a cut is left alone (its owner sees the cut)."""
        if conn.armed == events:
            return
        try:
            self._epoll.modify(conn.sock.fileno(), events)
            conn.armed = events
        except (OSError, ValueError) as exc:
            log.debug("%s listener: could not arm a connection from %s: %s", self.name, conn.host, exc)
            conn.cut = True

    # -- closing (under the lock) -------------------------------------------------------------------

    def _hand_back(self, conn: LoopConnection) -> None:
        if self._leader == threading.get_ident():
            self._close_locked(conn)
        else:
            self._handed_back.append(conn)
            self._wake()

    def _close_locked(self, conn: LoopConnection) -> None:
        """Forget and close a connection nobody answers (under the lock; only from the loop thread or stop)."""
        if self._conns.pop(conn.sock, None) is None:
            return
        fd = conn.sock.fileno()
        if fd >= 0:
            self._by_fd.pop(fd, None)
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass
        conn.cut = True
        conn.sock.close()


__all__ = ["LoopConnection", "LoopListener", "FrameServer", "WAITING"]
