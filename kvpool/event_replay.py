"""Replay on the KV event ports: the batches kept for it, and the replays being served, a few at a time.

Run by the publisher's thread (:mod:`kvpool.event_publisher`), which owns the ROUTER socket; nothing here
takes a lock.

Invariants:

- :class:`ReplayBuffer` keeps, per tenant, the newest batches sent: at most ``max_batches / tenants``
  batches and ``max_bytes / tenants`` bytes (topic, payload and :data:`ENTRY_BYTES` each), always at least
  the newest one. One ring per tenant: a busy tenant never pushes another's history out, and a tenant's
  replay walks its own batches only.
- :class:`Replays` serves each replay through a cursor, :data:`PER_TURN` batches per cursor per loop turn
  after the live batches, so live publishing always comes first. At most ``max_active`` replays are served
  at once and :data:`WAITING_PER_ACTIVE` times that wait; a peer address has at most ``max_per_peer``
  (served or waiting); a requester has one (a new request replaces its old one). A request past these is
  refused: counted, not answered (the requester times out and may ask again).
- A replay covers the batches buffered from its start up to the newest when it was asked (a busy stream
  cannot make it endless), then the end marker. Batches evicted before its cursor reaches them are skipped:
  a gap the requester sees.
- The socket is a ROUTER with ``ROUTER_MANDATORY``: a requester whose queue is full is seen (EAGAIN) and its
  cursor waits, never dropping a batch silently; a cursor that makes no progress for ``STALL_S`` is
  abandoned (counted), one whose requester is gone (EHOSTUNREACH) ends.
"""

from __future__ import annotations

import bisect
import errno
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq

from kvpool.events import END_SEQ

ENTRY_BYTES = 128  # what a buffered batch costs besides its topic and payload (its tuple, ints, object headers)
PER_TURN = 16  # batches one cursor sends per loop turn
WAITING_PER_ACTIVE = 4  # replays that may wait for a slot, per one served at once
STALL_S = 10.0  # a replay whose requester takes nothing for this long is abandoned
REPLAY_HWM = 16  # batches queued to one requester (ZMQ send mark): at most 16 x 68 KiB per replay served

Entry = tuple[int, bytes, bytes]  # (seq, topic, payload)


class ReplayBuffer:
    """Per tenant, the newest batches sent, bounded in batches and bytes (see the module)."""

    def __init__(self, tenants: Iterable[str], max_batches: int, max_bytes: int):
        names = sorted(set(tenants)) or [""]
        self.max_batches = max(1, max_batches // len(names))
        self.max_bytes = max(1, max_bytes // len(names))
        self._rings: dict[str, deque[Entry]] = {t: deque() for t in names}
        self._bytes: dict[str, int] = dict.fromkeys(names, 0)

    def append(self, tenant: str, seq: int, topic: bytes, payload: bytes) -> None:
        ring = self._rings[tenant]
        ring.append((seq, topic, payload))
        self._bytes[tenant] += _cost(topic, payload)
        while len(ring) > 1 and (len(ring) > self.max_batches or self._bytes[tenant] > self.max_bytes):
            _, old_topic, old_payload = ring.popleft()
            self._bytes[tenant] -= _cost(old_topic, old_payload)

    def ring(self, tenant: str) -> deque[Entry]:
        return self._rings[tenant]

    def nbytes(self) -> int:
        return sum(self._bytes.values())


def _cost(topic: bytes, payload: bytes) -> int:
    return len(topic) + len(payload) + ENTRY_BYTES


@dataclass(slots=True)
class _Cursor:
    requester: bytes  # the ROUTER's routing id of the requesting socket
    peer: str  # its address (caps)
    tenant: str
    next_seq: int
    end_seq: int  # exclusive: the tenant's next sequence number when it was asked
    stalled_since: float | None = None
    done: bool = False


class Replays:
    """The replays being served on ``sock`` (a ROUTER) from ``buffer`` (see the module)."""

    def __init__(self, sock: zmq.Socket, buffer: ReplayBuffer, *, max_active: int, max_per_peer: int,
                 on_sent: Callable[[int], None], on_refused: Callable[[str], None]):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self._sock = sock
        self._buffer = buffer
        self._max_active = max_active
        self._max_per_peer = max_per_peer
        self._on_sent = on_sent
        self._on_refused = on_refused
        self._active: deque[_Cursor] = deque()
        self._waiting: deque[_Cursor] = deque()

    def request(self, requester: bytes, peer: str, tenant: str, start_seq: int, end_seq: int) -> bool:
        """Take a request; False if it was refused (counted)."""
        for cursor in (*self._active, *self._waiting):
            if cursor.requester == requester:  # asked again: start over from the new start
                cursor.next_seq, cursor.end_seq, cursor.stalled_since, cursor.tenant = start_seq, end_seq, None, tenant
                return True
        same_peer = sum(c.peer == peer for c in (*self._active, *self._waiting))
        cursor = _Cursor(requester, peer, tenant, start_seq, end_seq)
        if same_peer < self._max_per_peer and len(self._active) < self._max_active:
            self._active.append(cursor)
        elif same_peer < self._max_per_peer and len(self._waiting) < WAITING_PER_ACTIVE * self._max_active:
            self._waiting.append(cursor)
        else:
            self._on_refused("replay")
            return False
        return True

    def step(self, now: float) -> float | None:
        """Serve each replay a turn's worth; the seconds until there is more to do (0: at once, None: no
        replay in progress)."""
        for _ in range(len(self._active)):
            cursor = self._active[0]
            self._active.rotate(-1)
            self._serve(cursor, now)
        for cursor in [c for c in self._active if c.done]:
            self._active.remove(cursor)
        while self._waiting and len(self._active) < self._max_active:
            self._active.append(self._waiting.popleft())
        if not self._active:
            return None
        return 0.0 if any(c.stalled_since is None for c in self._active) else 0.01

    def _serve(self, cursor: _Cursor, now: float) -> None:
        ring = self._buffer.ring(cursor.tenant)
        at = bisect.bisect_left(ring, cursor.next_seq, key=lambda entry: entry[0])
        for _ in range(PER_TURN):
            if at < len(ring) and ring[at][0] < cursor.end_seq:
                seq, topic, payload = ring[at]
                frames: tuple[bytes, ...] = (cursor.requester, b"", topic, seq.to_bytes(8, "big"), payload)
            else:
                seq, frames = -1, (cursor.requester, b"", b"", END_SEQ, b"")
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: wait, or give up on a requester that takes nothing
                if cursor.stalled_since is None:
                    cursor.stalled_since = now
                elif now - cursor.stalled_since > STALL_S:
                    self._on_refused("stalled_replay")
                    cursor.done = True
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                cursor.done = True  # the requester is gone
                return
            cursor.stalled_since = None
            if seq < 0:
                cursor.done = True
                return
            self._on_sent(1)
            cursor.next_seq = seq + 1
            at += 1
