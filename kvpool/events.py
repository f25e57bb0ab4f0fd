"""KV events in vLLM's format: batches of what the pool stored and dropped, published over ZMQ for routers.

The wire is vLLM's (``vllm.distributed.kv_events`` in vllm 0.32, ``ZmqEventPublisher``), so a router that
subscribes to vLLM engines reads kvpool with the same code:

- a PUB socket sends each batch as three frames: its topic, the batch's sequence number (8 bytes, big
  endian) and the payload, msgpack of ``KVEventBatch`` ``[ts, events, data_parallel_rank?]``; each event a
  map tagged ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``;
- a ROUTER socket replays: a request ``[b"", start_seq]`` (8 bytes, big endian) is answered with every
  batch still buffered from ``start_seq`` on, ``[b"", topic, seq, payload]`` each, then
  ``[b"", b"", -1, b""]``;
- the medium of a block is ``GPU`` for a worker's HBM, ``CPU`` for a node's DRAM, ``STORAGE`` for its SSD
  (vLLM's constants ``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``);
- a block's hash is :func:`key_hash` of its kvpool key: the 64-bit int form vLLM's events use by default.

One publisher numbers all its batches in one sequence, whatever their topic (vLLM's publisher has one
topic; kvpool's master sends pool and per-worker HBM batches on one stream): a subscriber of every topic
(``""`` or the common prefix) sees no gap unless a batch was dropped.

Invariants:

- :meth:`EventPublisher.publish` never blocks and never raises for a full queue: it numbers the batch and
  queues it, or counts it dropped when ``max_queue`` batches are waiting. Numbers are taken at publish, so
  a dropped batch is a gap in the sequence every subscriber sees; replay cannot fill it (it never reached
  the buffer), which tells the router its view is incomplete.
- Batches are sent in sequence order, from one thread that owns both sockets (ZMQ sockets are not
  thread-safe). A slow subscriber loses batches at the PUB socket's high-water mark, never slowing the
  publisher; it sees the gap and replays.
- The replay buffer holds the last ``buffer_batches`` batches sent, and the replay socket's send mark
  holds one whole replay of it (a ROUTER drops past its mark silently).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # a worker's HBM, as the master sees it
MEDIUM_CPU = "CPU"  # a pool node's DRAM
MEDIUM_STORAGE = "STORAGE"  # a pool node's SSD
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int


def key_hash(key: bytes) -> int:
    """A kvpool key's hash in events: its first 8 bytes as a big-endian unsigned int (64 bits, like vLLM's
    int block hashes; the master keys its index by the first 16 bytes, so it can name every key it drops)."""
    return int.from_bytes(key[:8], "big")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def stored(keys: Sequence[BlockHash], medium: str, block_size: int = 0,
           parent: BlockHash | None = None) -> BlockStored:
    """A ``BlockStored`` for ``keys`` (a chain, first to last) in ``medium``; no token ids (the pool has none)."""
    return BlockStored(block_hashes=list(keys), parent_block_hash=parent, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)


def removed(keys: Sequence[BlockHash], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(keys), medium=medium)


class EventMetrics:
    """The publisher's counters on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None):
        self.published = Counter("kvpool_events_published", "KV event batches sent on the PUB socket",
                                 registry=registry)
        self.dropped = Counter("kvpool_events_dropped", "KV event batches dropped because the publisher's queue "
                               "was full (a gap in the sequence)", registry=registry)
        self.replayed = Counter("kvpool_events_replayed", "KV event batches sent again on replay requests",
                                registry=registry)
        self.subscribers = Gauge("kvpool_event_subscribers", "Connections open on the KV event PUB socket",
                                 registry=registry)


class EventPublisher:
    """PUB + ROUTER (replay) on ``endpoint`` / ``replay_endpoint`` (``tcp://HOST:PORT``; port 0 picks one)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_batches: int = 10_000, max_queue: int = 10_000, hwm: int = 100_000,
                 registry: CollectorRegistry | None = None):
        if buffer_batches < 1 or max_queue < 1:
            raise ValueError("buffer_batches and max_queue must be at least 1")
        self.metrics = EventMetrics(registry)
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, bytes, KVEventBatch] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_batches)  # (seq, topic, payload)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what passes its send mark without a word: one whole replay (the buffer and
                # the end marker) must fit, or a late subscriber gets a silently truncated range.
                self._replay.setsockopt(zmq.SNDHWM, buffer_batches + 1)
                self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        self._subscribers = 0
        self._running = True
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[:-2])
            return f"{endpoint[:-2]}:{port}"
        sock.bind(endpoint)
        return endpoint

    def publish(self, events: Sequence[KVEvent], topic: str | None = None) -> int | None:
        """Queue one batch (on ``topic``, else the publisher's); its sequence number, or None if it was dropped
        (the queue is full). Never blocks."""
        if not events or not self._running:
            return None
        wire_topic = self._topic if topic is None else topic.encode()
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            try:
                self._queue.put_nowait((seq, wire_topic, KVEventBatch(ts=time.time(), events=list(events))))
            except queue.Full:
                self.metrics.dropped.inc()
                return None
        return seq

    def close(self) -> None:
        """Send what is queued (for up to 2 s), then close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=2.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._abort = True  # whatever is still queued is dropped
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._monitor, self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the publisher thread (owns the sockets) --------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._abort:
            for sock, _ in poller.poll(0):
                try:
                    if sock is self._monitor:
                        self._count_subscribers()
                    else:
                        self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("KV events: %s", exc)
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, topic, batch = item
            payload = self._encoder.encode(batch)
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:  # PUB does not block; a full peer queue drops for that peer only
                pass
            self._buffer.append((seq, topic, payload))
            self.metrics.published.inc()

    def _count_subscribers(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._monitor)["event"]
        self._subscribers += 1 if event == zmq.EVENT_ACCEPTED else -1
        self.metrics.subscribers.set(max(0, self._subscribers))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.info("KV events: a replay request of %d frames that is not [b'', start_seq]; ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
                self.metrics.replayed.inc()
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
