"""Test helpers that read the master's KV event ports as a router would: real ZMQ SUB and DEALER sockets."""

from __future__ import annotations

import threading

import msgspec
import zmq

from kvpool.events import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch

DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


class Collector:
    """A real SUB socket on a thread, keeping every (topic, seq, batch) it receives; ``configure`` sets socket
    options before it connects (CURVE keys). Close it before its context is destroyed."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: bytes = b"", configure=None):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if configure is not None:
            configure(self.sock)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.got: list[tuple[bytes, int, KVEventBatch]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.got.append((topic, int.from_bytes(seq, "big"), DECODE.decode(payload)))

    def count(self) -> int:
        return len(self.got)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


def replay_all(ctx: zmq.Context, endpoint: str, start: int = 0, configure=None,
               timeout_ms: int = 5000) -> list[tuple[bytes, int, KVEventBatch]] | None:
    """Every batch the replay port sends for a request from ``start``, up to its end marker (None: no answer
    within ``timeout_ms``)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if configure is not None:
        configure(dealer)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[bytes, int, KVEventBatch]] = []
        while True:
            try:
                _, topic, seq, payload = dealer.recv_multipart()
            except zmq.Again:
                return None
            if seq == END_SEQ:
                return got
            got.append((topic, int.from_bytes(seq, "big"), DECODE.decode(payload)))
    finally:
        dealer.close(linger=0)


class MediaModel:
    """Applies a pool event stream to empty sets: per block hash, the media holding it. Asserts each event
    is a real transition (stored into a medium it lacked, removed from one it had)."""

    def __init__(self) -> None:
        self.media: dict[int, set[str]] = {}
        self.seen: list[tuple[str, str, int]] = []  # (event type, medium, hash)

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
                continue
            medium = event.medium
            assert isinstance(medium, str)
            for h in event.block_hashes:
                assert isinstance(h, int), "kvpool's hashes are ints (vLLM's default form)"
                held = self.media.setdefault(h, set())
                if isinstance(event, BlockStored):
                    assert medium not in held, f"stored {h:x} in {medium} twice"
                    held.add(medium)
                else:
                    assert medium in held, f"removed {h:x} from {medium}, which did not hold it"
                    held.discard(medium)
                self.seen.append((type(event).__name__, medium, h))

    def holding(self, medium: str) -> int:
        return sum(medium in held for held in self.media.values())
