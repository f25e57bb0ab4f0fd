"""Who may hold a connection to the KV event ports, and how many: CURVE credentials (ZAP) and connection caps.

Two guards, both run by the publisher's thread (:mod:`kvpool.event_publisher`), which owns every socket:

- :class:`ZapHandler` answers libzmq's ZAP requests (RFC 27) on ``inproc://zeromq.zap.01`` of the
  publisher's own context. With an auth file the ports are CURVE servers whose key pair comes from the
  file's secret (:class:`EventAccess`), and a client is let in only if its public key is one derived from a
  client token (:func:`kvpool.events.subscriber_keys`); its ZAP user id is its tenant, which libzmq then
  attaches to everything it sends (subscriptions, replay requests).
- :class:`PortGuard` keeps the set of one socket's live TCP connections from the socket's monitor
  (``ACCEPTED`` adds a descriptor, ``DISCONNECTED`` or ``CLOSED`` removes it) and closes a new connection
  at once when its port holds ``max_total`` connections, or its peer address ``max_per_peer`` (TCP only),
  whether it ever speaks or not: libzmq accepts whatever comes, and idle connections once took every descriptor of the
  master. It closes one with ``shutdown()`` on a duplicate of the descriptor, after checking through that
  duplicate that it is still the connection the event named (same local and peer address): the
  descriptor may have been closed and reused meanwhile, and ``shutdown`` never touches another socket.
  libzmq then sees the connection end and releases it itself.

Invariants:

- The live set counts every connection libzmq holds on the port, but for those being closed; the gauge is
  its size. Monitor events are drained whole each turn from a pipe with room for a burst
  (:data:`MONITOR_HWM`), and :meth:`PortGuard.reconcile` drops every descriptor that no longer is the
  connection recorded, so a lost event cannot leave the count wrong for long.
- No descriptor is ever closed here (libzmq owns them); duplicates are closed at once.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvpool.events import subscriber_keys

if TYPE_CHECKING:
    from kvpool.auth import Authority

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27), per context
ZAP_DOMAIN = b"kvpool-events"
MONITOR_HWM = 20_000  # monitor events waiting to be read: a burst of 10,000 connections opened and closed
_SERVER_KEY_LABEL = b"kvpool.v1/kv-events-server"
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED

Peer = tuple[str, tuple[object, ...]]  # (peer address for caps, full (local, peer) names to recognise the socket)


@dataclass(frozen=True)
class EventAccess:
    """CURVE on the event ports: the server's key pair and each client key's tenant (Z85 keys)."""

    server_public: str
    server_secret: str
    tenants_by_key: Mapping[bytes, str] = field(repr=False)  # a client's raw 32-byte public key -> its tenant

    @classmethod
    def from_authority(cls, authority: Authority) -> EventAccess:
        """The server's keys from the auth file's secret, a client key per client token."""
        secret = z85.encode(authority.derive(_SERVER_KEY_LABEL)).decode()
        public = zmq.curve_public(secret.encode()).decode()
        by_key = {z85.decode(subscriber_keys(token)[0]): tenant for token, tenant in authority.client_tokens()}
        return cls(public, secret, by_key)

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self.tenants_by_key.values()))

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks ZAP about every client."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret.encode())
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler (never the case here): refuse, never let in


class ZapHandler:
    """Answers ZAP requests: a known client key is let in as its tenant, anything else is refused."""

    def __init__(self, ctx: zmq.Context, access: EventAccess, on_refused: Callable[[], None]):
        self._access = access
        self._on_refused = on_refused
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def serve(self) -> None:
        """Answer every request waiting (each handshake waits for its answer)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 8 or frames[1] != b"":
                continue  # not a ZAP request: nobody waits for an answer
            envelope, version, request_id, mechanism = frames[0], frames[2], frames[3], frames[7]
            tenant = self._access.tenants_by_key.get(frames[8]) if mechanism == b"CURVE" and len(frames) > 8 else None
            if tenant is None:
                self._on_refused()
                reply = [b"400", b"unknown client key", b""]
            else:
                reply = [b"200", b"OK", tenant.encode()]
            self.sock.send_multipart([envelope, b"", version, request_id, *reply, b""])

    def close(self) -> None:
        self.sock.close(linger=0)


class PortGuard:
    """The live connections of one event socket, capped in total and per peer address (see the module)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, name: str, *, max_total: int, max_per_peer: int,
                 on_refused: Callable[[], None], on_count: Callable[[int], None]):
        self.name = name
        self._max_total = max_total
        self._max_per_peer = max_per_peer
        self._on_refused = on_refused
        self._on_count = on_count
        self._live: dict[int, Peer] = {}  # descriptor -> who it is
        self._per_peer: Tally[str] = Tally()
        self._closing: set[int] = set()  # shut down, not yet reported gone: counted nowhere
        address = f"inproc://kvpool-events-monitor-{name}-{id(self):x}"
        sock.monitor(address, _WATCHED)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.setsockopt(zmq.RCVHWM, MONITOR_HWM)
        self.monitor.connect(address)
        self._sock = sock
        self._local: object = None  # the listening port (TCP) or path (IPC), once bound

    def listening(self, endpoint: str) -> None:
        """The socket is bound at ``endpoint`` (``tcp://HOST:PORT`` with the real port, or ``ipc://PATH``):
        only connections to it are this guard's."""
        self._local = int(endpoint.rsplit(":", 1)[1]) if endpoint.startswith("tcp://") else endpoint[len("ipc://"):]

    @property
    def count(self) -> int:
        return len(self._live)

    def service(self) -> None:
        """Apply every monitor event waiting, then close the new connections past a cap."""
        added: list[int] = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                added.append(fd)
            elif fd in self._live or fd in self._closing or fd in added:
                self._forget(fd)
                if fd in added:
                    added.remove(fd)
        for fd in added:
            peer = self._who(fd)
            if peer is None:  # closed (or reused by another socket) already: its DISCONNECTED follows or came
                continue
            self._forget(fd)
            crowded = peer[0] != "" and self._per_peer[peer[0]] >= self._max_per_peer  # "": IPC, one host
            if len(self._live) >= self._max_total or crowded:
                self._refuse(fd, peer)
            else:
                self._live[fd] = peer
                self._per_peer[peer[0]] += 1
        self._on_count(len(self._live))

    def reconcile(self) -> None:
        """Drop descriptors that are no longer the connection recorded (an event lost on the way)."""
        for fd in [*self._live, *self._closing]:
            peer = self._live.get(fd)
            now = self._who(fd)
            if now is None or (peer is not None and now != peer):
                self._forget(fd)
        self._on_count(len(self._live))

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)

    def _who(self, fd: int) -> Peer | None:
        """:func:`_identify`, for a connection to this guard's own port only."""
        peer = _identify(fd)
        if peer is None:
            return None
        local = peer[1][1]
        return peer if (local[1] if isinstance(local, tuple) else local) == self._local else None

    def _forget(self, fd: int) -> None:
        self._closing.discard(fd)
        peer = self._live.pop(fd, None)
        if peer is not None:
            self._per_peer[peer[0]] -= 1
            if self._per_peer[peer[0]] <= 0:
                del self._per_peer[peer[0]]

    def _refuse(self, fd: int, peer: Peer) -> None:
        if _shut_down(fd, peer):
            self._closing.add(fd)
            self._on_refused()


def _identify(fd: int) -> Peer | None:
    """Who is on descriptor ``fd``: its peer's address and its (local, peer) names; None if it is no
    connected TCP or IPC socket now."""
    dup = _duplicate(fd)
    if dup is None:
        return None
    try:
        names = (dup.family, dup.getsockname(), dup.getpeername())
    except OSError:
        return None
    finally:
        dup.close()
    peer = names[2][0] if isinstance(names[2], tuple) else ""
    return peer, names


def _shut_down(fd: int, peer: Peer) -> bool:
    """``shutdown()`` the connection on ``fd`` if it still is ``peer`` (checked on the duplicate that is shut
    down, so a reused descriptor is never touched); True if it was."""
    dup = _duplicate(fd)
    if dup is None:
        return False
    try:
        if (dup.family, dup.getsockname(), dup.getpeername()) != peer[1]:
            return False
        dup.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        dup.close()


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` alone); None if ``fd`` is closed or
    no socket."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None
