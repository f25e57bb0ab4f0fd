"""The KV event ports: batches published on a PUB (or XPUB) socket and replayed on a ROUTER, vLLM's wire.

The format, topics and the subscriber side are :mod:`kvpool.events`; this module is the server: one thread
owns every socket (ZMQ sockets are not thread-safe) and, each turn, admits connections
(:mod:`kvpool.event_guard`), sends the live batches queued, then serves replays a few batches at a time
(:mod:`kvpool.event_replay`).

With auth on (an :class:`~kvpool.event_guard.EventAccess`) the stream socket is an XPUB in manual mode: each
subscription a client sends comes with its ZAP user id (its tenant) and is applied only within that
tenant's topics: ``""`` or any prefix of ``TOPIC/<tenant>/`` narrows to ``TOPIC/<tenant>/``, a topic under
it stays as it is, anything else is refused (counted). What leaves the socket is what a PUB sends, so a
vLLM subscriber reads it unchanged.

Invariants:

- :meth:`EventPublisher.publish` never blocks and never raises for a full queue: it encodes the batch (in
  the caller's thread), numbers it in its tenant's sequence and queues the bytes, or counts it dropped when
  ``max_queue`` batches (or :data:`MAX_QUEUE_BYTES` of them) are waiting: the queue holds encoded bytes
  only, so a publisher thread that lags behind (a busy host) costs at most that much memory. Numbers are
  taken at publish, so a dropped batch is a gap in the sequence its tenant's subscribers see; replay cannot
  fill it (it never reached the buffer), which tells the router its view is incomplete. A topic over
  :data:`~kvpool.events.MAX_TOPIC_BYTES` or an encoded batch over :data:`~kvpool.events.MAX_BATCH_BYTES`
  (the master's feed never makes one) is refused before it is numbered (counted: no gap).
- Batches are sent in sequence order. A slow subscriber loses batches at its queue's mark, never slowing
  the publisher; it sees the gap and replays. The mark is ``subscriber_bytes / MAX_BATCH_BYTES`` batches:
  libzmq queues one copy of a batch for all its subscribers (each subscriber's queue holds a reference,
  about 200 bytes), so the batches queued cost at most ``subscriber_bytes`` whatever the number of
  subscribers, plus ``connections x mark x 200`` bytes of queue entries.
- Each turn sends the live batches waiting before any replay's: replay never delays live publishing by more
  than one turn's worth of replay sends.
- Every connection is bounded in time before its handshake (:data:`HANDSHAKE_MS`) and after it
  (heartbeats), and in number on each port (``max_connections``, ``max_connections_per_peer``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.config import MasterConfig
from kvpool.event_guard import EventAccess, PortGuard, ZapHandler
from kvpool.event_replay import ReplayBuffer, Replays
from kvpool.events import MAX_BATCH_BYTES, MAX_TOPIC_BYTES, KVEvent, KVEventBatch, tenant_prefix

log = logging.getLogger(__name__)

HANDSHAKE_MS = 3000  # a connection that has not completed ZMTP's handshake (and CURVE's) by then is closed
HEARTBEAT_MS = 5000  # ZMTP pings to every peer; one silent for HEARTBEAT_TIMEOUT_MS is dropped
HEARTBEAT_TIMEOUT_MS = 15_000
MAX_QUEUE_BYTES = 16 << 20  # encoded batches waiting for the publisher thread
MIN_SUBSCRIBER_BATCHES = 16  # the smallest send mark, whatever the byte budget
INBOUND_HWM = 100  # subscriptions or replay requests queued from one peer before libzmq stops reading it
REPLAY_REQUESTS_PER_TURN = 64
LIVE_PER_TURN = 256  # live batches sent per turn before the sockets are looked at again
RECONCILE_S = 1.0  # how often the live connection sets are checked against the descriptors


_DEFAULTS = MasterConfig()


@dataclass(frozen=True)
class EventLimits:
    """Bounds on what the event ports may hold: MasterConfig's ``kv_events_*`` settings (docs/routing.md),
    whose defaults these are."""

    buffer_batches: int = _DEFAULTS.events.buffer  # kept for replay, over all tenants
    buffer_bytes: int = _DEFAULTS.events.buffer_bytes
    max_queue: int = _DEFAULTS.events.max_queue  # batches waiting to be sent
    subscriber_bytes: int = _DEFAULTS.events.subscriber_bytes  # queued to one subscriber, MAX_BATCH_BYTES each
    max_connections: int = _DEFAULTS.events.max_connections  # on each port
    max_connections_per_peer: int = _DEFAULTS.events.max_connections_per_peer
    max_replays: int = _DEFAULTS.events.max_replays  # served at once
    max_replays_per_peer: int = _DEFAULTS.events.max_replays_per_peer

    @classmethod
    def of(cls, config: MasterConfig, max_connections: int | None = None) -> EventLimits:
        """The limits a master's config sets (``max_connections``: fewer connections than it says)."""
        return cls(buffer_batches=config.events.buffer, buffer_bytes=config.events.buffer_bytes,
                   max_queue=config.events.max_queue, subscriber_bytes=config.events.subscriber_bytes,
                   max_connections=min(config.events.max_connections, max_connections or (1 << 30)),
                   max_connections_per_peer=config.events.max_connections_per_peer,
                   max_replays=config.events.max_replays,
                   max_replays_per_peer=config.events.max_replays_per_peer)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"EventLimits.{name} must be at least 1 (got {value})")

    @property
    def send_mark(self) -> int:
        """Batches queued to one subscriber before it loses new ones."""
        return max(MIN_SUBSCRIBER_BATCHES, self.subscriber_bytes // MAX_BATCH_BYTES)


class EventMetrics:
    """The publisher's metrics on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None):
        self.published = Counter("kvpool_events_published", "KV event batches sent on the PUB socket",
                                 registry=registry)
        self.dropped = Counter("kvpool_events_dropped", "KV event batches dropped because the publisher's queue "
                               "was full (a gap in the sequence)", registry=registry)
        self.replayed = Counter("kvpool_events_replayed", "KV event batches sent again on replay requests",
                                registry=registry)
        self.refused = Counter("kvpool_events_refused", "What the event ports refused: connections past a cap "
                               "(connection), unknown CURVE keys (auth), subscriptions outside the tenant's topics "
                               "(subscription), replay requests past a cap (replay), replays abandoned by a "
                               "requester that took nothing (stalled_replay), topics or batches too long "
                               "(topic, batch), blocks of no known tenant (tenant)", ["what"], registry=registry)
        self.subscribers = Gauge("kvpool_event_subscribers", "Connections open on the KV event PUB socket",
                                 registry=registry)
        self.replay_connections = Gauge("kvpool_event_replay_connections", "Connections open on the KV event "
                                        "replay socket", registry=registry)


class EventPublisher:
    """The stream on ``endpoint`` and replay on ``replay_endpoint`` (``tcp://HOST:PORT``, port 0: any free one;
    or ``ipc://PATH``). ``topic``: the default topic, and the root of every tenant's topics. ``access``: CURVE
    and per-tenant topics (auth on); None: anyone may subscribe to anything (auth off)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 limits: EventLimits = EventLimits(), access: EventAccess | None = None,
                 registry: CollectorRegistry | None = None):
        self.metrics = EventMetrics(registry)
        self.limits = limits
        self.access = access
        self._topic = topic
        tenants = access.tenants if access is not None else [""]
        self._namespaces = {t.encode(): tenant_prefix(topic, t).encode() for t in tenants}
        self._queue: deque[tuple[str, int, bytes, bytes] | None] = deque()
        self._queued_bytes = 0
        self._buffer = ReplayBuffer(tenants, limits.buffer_batches, limits.buffer_bytes)
        self._seq = dict.fromkeys(tenants, 0)  # each tenant's next sequence number
        self._lock = threading.Lock()  # the queue and the sequence numbers
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._guards: list[PortGuard] = []
        self._zap = ZapHandler(self._ctx, access, lambda: self.metrics.refused.labels("auth").inc()) \
            if access is not None else None
        self._replay: zmq.Socket | None = None
        self._replays: Replays | None = None
        self._warned: set[str] = set()
        try:
            self._pub = self._socket(zmq.XPUB if access is not None else zmq.PUB, "pub",
                                     self.metrics.subscribers.set)
            self._pub.setsockopt(zmq.SNDHWM, limits.send_mark)
            if access is not None:
                self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            self.endpoint = self._bind(self._pub, endpoint, self._guards[0])
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._socket(zmq.ROUTER, "replay", self.metrics.replay_connections.set)
                self._replays = Replays(self._replay, self._buffer, max_active=limits.max_replays,
                                        max_per_peer=limits.max_replays_per_peer, on_sent=self.metrics.replayed.inc,
                                        on_refused=lambda what: self.metrics.refused.labels(what).inc())
                self.replay_endpoint = self._bind(self._replay, replay_endpoint, self._guards[1])
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        self._running = True
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    @property
    def server_key(self) -> str:
        """The ports' CURVE public key (Z85), for subscribers; "" with auth off."""
        return self.access.server_public if self.access is not None else ""

    def _socket(self, kind: int, name: str, on_count: Callable[[float], None]) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_TOPIC_BYTES + 64)  # a subscription or a replay request, no more
        sock.setsockopt(zmq.RCVHWM, INBOUND_HWM)
        if self.access is not None:
            self.access.serve(sock)
        self._guards.append(PortGuard(self._ctx, sock, name, max_total=self.limits.max_connections,
                                      max_per_peer=self.limits.max_connections_per_peer,
                                      on_refused=lambda: self.metrics.refused.labels("connection").inc(),
                                      on_count=on_count))
        return sock

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, guard: PortGuard) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[:-2])
            endpoint = f"{endpoint[:-2]}:{port}"
        else:
            sock.bind(endpoint)
        guard.listening(endpoint)
        return endpoint

    def publish(self, events: Sequence[KVEvent], topic: str | None = None, tenant: str = "") -> int | None:
        """Queue one batch (on ``topic``, else the publisher's) in ``tenant``'s sequence; its sequence number, or
        None if it was dropped (the queue is full) or refused (the topic is too long). Never blocks."""
        if not events or not self._running:
            return None
        wire_topic = (self._topic if topic is None else topic).encode()
        if len(wire_topic) > MAX_TOPIC_BYTES:
            self._refuse("topic", f"a topic of {len(wire_topic)} bytes (at most {MAX_TOPIC_BYTES})")
            return None
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))
        if len(payload) > MAX_BATCH_BYTES:
            self._refuse("batch", f"a batch of {len(payload)} bytes (at most {MAX_BATCH_BYTES})")
            return None
        with self._lock:
            if not self._running:  # closed meanwhile (the wake-up descriptor may be gone)
                return None
            seq = self._seq[tenant]  # KeyError: a tenant the publisher was not made for (a bug)
            self._seq[tenant] = seq + 1
            if len(self._queue) >= self.limits.max_queue or self._queued_bytes + len(payload) > MAX_QUEUE_BYTES:
                self.metrics.dropped.inc()
                return None
            self._queue.append((tenant, seq, wire_topic, payload))
            self._queued_bytes += len(payload)
            os.eventfd_write(self._wake, 1)
        return seq

    def close(self) -> None:
        """Send what is queued (for up to 2 s), then close the sockets. Idempotent."""
        with self._lock:
            if not self._running:
                return
            self._running = False  # publish() takes no more (checked under this lock)
            self._queue.append(None)
            os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=2.0)
        self._abort = True  # whatever is still queued is dropped
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for guard in self._guards:
            guard.close()
        if self._zap is not None:
            self._zap.close()
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake)

    def _refuse(self, what: str, why: str) -> None:
        self.metrics.refused.labels(what).inc()
        if what not in self._warned:
            self._warned.add(what)
            log.warning("KV events: refused %s (counted in kvpool_events_refused_total{what=%r}; said once)", why,
                        what)

    # -- the publisher thread (owns the sockets) --------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        for guard in self._guards:
            poller.register(guard.monitor, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.sock, zmq.POLLIN)
        if self.access is not None:
            poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        wait = 0.0  # seconds the next poll may sleep
        reconciled = time.monotonic()
        while not self._abort:
            ready = dict(poller.poll(int(wait * 1000)))
            if self._wake in ready:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
            wait = RECONCILE_S
            try:
                if self._turn(ready):
                    return
                now = time.monotonic()
                if now - reconciled > RECONCILE_S:
                    reconciled = now
                    for guard in self._guards:
                        guard.reconcile()
                if self._replays is not None:
                    replay_wait = self._replays.step(now)
                    wait = wait if replay_wait is None else min(wait, replay_wait)
            except zmq.ZMQError as exc:  # a socket error must not end the stream
                log.warning("KV events: %s", exc)
                wait = 0.1
            with self._lock:
                if self._queue:
                    wait = 0.0

    def _turn(self, ready: dict) -> bool:
        """One turn: connections, ZAP, subscriptions, replay requests, then the live batches; True: closing."""
        for guard in self._guards:
            guard.service()
        if self._zap is not None:
            self._zap.serve()
        if self.access is not None and self._pub in ready:
            self._subscriptions()
        if self._replay is not None and self._replay in ready:
            self._replay_requests()
        for _ in range(LIVE_PER_TURN):
            with self._lock:
                if not self._queue:
                    return False
                item = self._queue.popleft()
                if item is not None:
                    self._queued_bytes -= len(item[3])
            if item is None:
                return True
            self._send(*item)
        return False

    def _send(self, tenant: str, seq: int, topic: bytes, payload: bytes) -> None:
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)  # PUB never blocks
        self._buffer.append(tenant, seq, topic, payload)
        self.metrics.published.inc()

    def _subscriptions(self) -> None:
        """Apply each subscription within its sender's tenant's topics (XPUB, manual mode; auth on)."""
        while True:
            try:
                frame = self._pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue
            try:
                tenant = str(frame.get("User-Id")).encode()
            except zmq.ZMQError:  # a closed connection's leftover unsubscriptions: libzmq already dropped them
                continue
            namespace = self._namespaces.get(tenant)
            wanted = data[1:]
            if namespace is not None and namespace.startswith(wanted):
                applied = namespace
            elif namespace is not None and wanted.startswith(namespace):
                applied = wanted
            else:
                self._refuse("subscription", f"a subscription to {wanted[:64]!r} outside the tenant's topics")
                continue
            self._pub.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, applied)

    def _replay_requests(self) -> None:
        assert self._replay is not None and self._replays is not None
        for _ in range(REPLAY_REQUESTS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1].bytes != b"" or len(frames[2].bytes) != 8:
                log.info("KV events: a replay request of %d frames that is not [b'', start_seq]; ignored",
                         len(frames))
                continue
            tenant = str(frames[2].get("User-Id")) if self.access is not None else ""
            peer = _peer_address(frames[2])
            with self._lock:
                end = self._seq[tenant]
            self._replays.request(frames[0].bytes, peer, tenant, int.from_bytes(frames[2].bytes, "big"), end)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:  # not over TCP
        return ""
