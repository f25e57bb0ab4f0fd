"""Commits sent without waiting: a same-host put returns once its bytes are in the node's slots and its
``Commit`` is on the wire.

A :class:`CommitPipe` is one wire connection to one node, owned by the
client (not pooled). ``send`` writes a ``Commit`` frame and returns; a reader
thread reads the replies, in the order the requests were sent (the node
serves a connection's frames one after another), and hands each to the
``done`` the request was sent with. So a writer's next put overlaps the
node's verify-and-publish of the last one, and a single-block put costs the
client's own work, not a round trip.

Invariants:
- Every request whose ``send`` returned True gets exactly one ``done`` call,
  from the reader thread: with its reply, or with an error (the connection
  broke or stalled past the io timeout: the commit may or may not have been
  applied; the node reclaims a lease nobody committed). An error whose
  ``not_applied`` is True (a full listener refused the connection: nothing
  of it was read) leaves the lease as it was, to commit another way; the
  pipe then sends nothing for ``RETRY_S``.
- ``send`` returning False means nothing of the frame reached the node: the
  caller still holds its lease and may commit another way.
- At most ``max_in_flight`` requests are unanswered; ``send`` waits for room.
- An idle connection the node closed (its idle timeout) is noticed before a
  frame is sent on it, and replaced: the frame is not lost to it.
- ``wait(0)`` returning True means every ``done`` so far has run: what this
  client stored is published on the node (read-your-writes).
- Not over TLS: an ``ssl.SSLSocket`` must not be read and written from two
  threads at once (the caller commits synchronously there).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvpool.calls import RETRY_S
from kvpool.tcp import ConnectFailed, ConnectionPool, Refused, send_buffers
from kvpool.v1 import node_pb2
from kvpool.wire import CallError, Method, read_reply, request_frame, status_error

log = logging.getLogger(__name__)

Done = Callable[[node_pb2.CommitResponse | None, grpc.RpcError | None], None]
MAX_REPLY_BYTES = 64 << 20  # a Commit reply: per-key flags and the slots leased ahead


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection is done: the peer closed it, or sent bytes nobody asked for (one syscall)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": closed; a byte: one nobody asked for
    except BlockingIOError:
        return False  # open, nothing to read: usable
    except OSError:
        pass
    return True


class _Link:
    """One connection and the requests sent on it, oldest first."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.pending: deque[Done] = deque()
        self.answering = 0  # replies taken off ``pending`` whose ``done`` is running
        self.dead = False

    def unanswered(self) -> int:
        return len(self.pending) + self.answering


class CommitPipe:
    """Pipelined ``Commit`` calls to the node whose wire listener is at ``address()`` (see module docstring)."""

    def __init__(self, pool: ConnectionPool, address: Callable[[], str | None], *, timeout_s: float,
                 max_in_flight: int = 4):
        self._pool = pool
        self._address = address
        self._timeout = timeout_s
        self.max_in_flight = max_in_flight
        self._send_lock = threading.Lock()  # one frame at a time on the connection
        self._cond = threading.Condition()
        self._link: _Link | None = None
        self._failing = 0  # requests of a dead link whose ``done`` has yet to run
        self._closed = False
        self._down_until = 0.0  # refused by a full listener: send nothing until then

    def _unanswered(self) -> int:
        return self._failing + (0 if self._link is None else self._link.unanswered())

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        with self._cond:
            return self._unanswered()

    def send(self, request: node_pb2.CommitRequest, done: Done, deadline: float | None = None) -> bool:
        """Send ``request``; ``done(reply, error)`` runs once its reply (or the connection's failure) arrives.

        False: nothing was sent (no wire address, no connection, the pipe is
        closed, or no room within the io timeout and by ``deadline``, a
        ``time.monotonic()``, if given).
        """
        frame = request_frame(Method.COMMIT, request)
        with self._send_lock:
            link = self._room(deadline)
            if link is None:
                return False
            with self._cond:
                link.pending.append(done)
                self._cond.notify_all()  # the reader waits for something to read
            try:
                send_buffers(link.sock, frame)
            except OSError as exc:  # not all of the frame left: the node applies nothing of it
                with self._cond:
                    link.pending.pop()
                self._kill(link, exc)
                return False
            return True

    def _room(self, deadline: float | None) -> _Link | None:
        """The live link once it has room for one more request (connecting if needed, by ``deadline`` and
        within the io timeout); None: cannot send."""
        own = time.monotonic() + self._timeout
        deadline = own if deadline is None else min(own, deadline)
        with self._cond:
            while True:
                if self._closed:
                    return None
                link = self._link
                if link is not None and not link.dead and not link.unanswered() and closed_by_peer(link.sock):
                    # the node closed it while idle: a frame sent now would be lost (the lock is reentrant, and a
                    # link with nothing pending calls back nobody)
                    self._kill(link, ConnectionError("closed by the node while idle"))
                    continue
                if link is not None and not link.dead and link.unanswered() < self.max_in_flight:
                    return link
                if link is None or link.dead:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return None
        address = self._address()
        left = deadline - time.monotonic()
        if address is None or time.monotonic() < self._down_until or left <= 0:
            return None
        try:
            sock = self._pool.connect(address, left)
        except (ConnectFailed, TimeoutError) as exc:
            log.debug("commit pipe to %s: %s", address, exc)
            return None
        link = _Link(sock)
        with self._cond:
            if self._closed:
                sock.close()
                return None
            self._link = link
        threading.Thread(target=self._read, args=(link,), name="kvpool-commit-pipe", daemon=True).start()
        return link

    def _read(self, link: _Link) -> None:
        """The reader: each reply to its request's ``done``, in order, until the link dies."""
        while True:
            with self._cond:
                while not link.pending and not link.dead:
                    self._cond.wait()
                if link.dead:
                    return
            try:
                head, body = read_reply(link.sock, None, MAX_REPLY_BYTES)
                if head.code != 0:
                    reply, error = None, status_error(head, body)
                else:
                    reply, error = node_pb2.CommitResponse.FromString(body), None
            except (OSError, CallError, DecodeError) as exc:  # broken, stalled, refused or out of step
                self._kill(link, exc)
                return
            with self._cond:
                if link.dead:  # killed meanwhile: its requests were failed already
                    return
                done = link.pending.popleft()
                link.answering += 1
            try:
                done(reply, error)
            except Exception:  # a caller's bug must not stall every later commit
                log.exception("commit pipe: a commit's done failed")
            with self._cond:
                link.answering -= 1
                self._cond.notify_all()

    def _kill(self, link: _Link, exc: BaseException) -> None:
        """End ``link``: close its socket, then fail every request still pending on it."""
        with self._cond:
            if link.dead:
                return
            link.dead = True
            failed, link.pending = list(link.pending), deque()
            self._failing += len(failed)
            if self._link is link:
                self._link = None
            self._cond.notify_all()  # the reader ends, a sender connects anew
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.sock.close()
        if isinstance(exc, Refused):
            with self._cond:
                self._down_until = time.monotonic() + RETRY_S
            error = CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"commit pipe: {exc}")
            error.not_applied = True
        elif isinstance(exc, CallError):
            error = exc
        else:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, (TimeoutError, BlockingIOError)) else \
                grpc.StatusCode.UNAVAILABLE
            error = CallError(code, f"commit pipe: {exc}")
        for done in failed:
            try:
                done(None, error)
            except Exception:
                log.exception("commit pipe: a commit's done failed")
            with self._cond:
                self._failing -= 1
                self._cond.notify_all()

    def wait(self, most: int = 0, timeout: float | None = None) -> bool:
        """Wait until at most ``most`` requests are unanswered; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._unanswered() > most:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) for the answers, then close; False if some never came (they fail)."""
        answered = self.wait(0, timeout)
        with self._cond:
            self._closed = True
            link = self._link
        if link is not None:
            self._kill(link, ConnectionError("commit pipe closed"))
        return answered
