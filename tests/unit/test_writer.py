"""The write-behind queue: bounded in bytes, never blocks, holds slot handles without bytes, survives a failing sink."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import wait_until

from kvpool.client.leases import FilledSlot, LeasedSlot
from kvpool.client.writer import WriteBehindQueue
from kvpool.keys import BlockKey
from kvpool.tiers.arena import SharedArena


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 8)


class GatedSink:
    """Takes batches only while the gate is open; records what it got."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.got: dict[BlockKey, bytes] = {}
        self.fail_next = False

    def __call__(self, keys, arrays):
        self.gate.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise OSError("pool went away")
        for k, a in zip(keys, arrays):
            self.got[k] = a.tobytes()


def test_full_queue_refuses_by_bytes_without_blocking_and_flush_drains_it():
    sink = GatedSink()
    queue = WriteBehindQueue(sink, capacity_bytes=3000, batch_bytes=1000)
    try:
        first = queue.submit([key(0)], [np.full(1000, 1, np.uint8)])  # the thread takes it, then waits at the gate
        assert first == [True]
        wait_until(lambda: not queue._items)  # the first block is in the sink, held at the gate
        blocks = [np.full(1000, i, np.uint8) for i in range(1, 5)]
        assert queue.submit([key(i) for i in range(1, 5)], blocks) == [True, True, True, False]  # 3000 B wait
        sink.gate.set()
        assert queue.flush(timeout=30)
        assert queue.pending() == 0 and sink.got[key(0)] == bytes([1]) * 1000
        assert queue.submit([key(9)], [np.zeros(3001, np.uint8)]) == [False]  # bigger than the whole queue
    finally:
        sink.gate.set()
        queue.close()


def test_filled_slots_are_queued_as_handles_that_cost_no_queue_bytes(arena_name):
    arena = SharedArena.create(arena_name, 8192, 4)
    try:
        sink = HandleSink()
        queue = WriteBehindQueue(sink, capacity_bytes=100)
        try:
            slot = LeasedSlot("node", arena, lease=5, slot=1, gen=3, offset=4096, size=4096)
            handles = [FilledSlot(slot, checksum=i) for i in range(3)]
            buf = np.full(100, 7, np.uint8)
            assert queue.submit([key(1), key(2), key(3), key(4)], [*handles, buf]) == [True] * 4  # 100 B of 100
            sink.gate.set()
            assert queue.flush(timeout=30)
            assert sink.got[:3] == [(key(i + 1), h) for i, h in enumerate(handles)]  # the handles, no bytes
            assert sink.got[3][0] == key(4) and sink.got[3][1] is buf  # the queue owns what it was given
        finally:
            sink.gate.set()
            queue.close()
    finally:
        arena.close()


def test_filled_slots_submitted_side_by_side_reach_the_sink_in_one_batch(arena_name):
    arena = SharedArena.create(arena_name, 8192, 4)
    batches: list[list] = []
    queue = WriteBehindQueue(lambda keys, payloads: batches.append(list(payloads)), capacity_bytes=1 << 20,
                             batch_bytes=100)
    try:
        slot = LeasedSlot("node", arena, lease=5, slot=1, gen=3, offset=4096, size=4096)
        handles = [FilledSlot(slot, checksum=i) for i in range(3)]
        big, small = np.ones(150, np.uint8), np.ones(60, np.uint8)
        queue.submit([key(i) for i in range(6)], [big, *handles, small, small])
        assert queue.flush(timeout=30)
        flat = [p for b in batches for p in b]
        assert len(flat) == 6 and flat[0] is big
        assert any(all(any(p is h for p in b) for h in handles) for b in batches)  # never split across two Commits
        assert all(sum(p.nbytes for p in b if isinstance(p, np.ndarray)) <= 150 for b in batches)
    finally:
        queue.close()
        arena.close()


class HandleSink:
    """Records exactly what the queue hands over, once the gate opens."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.got: list = []

    def __call__(self, keys, payloads):
        self.gate.wait(30)
        self.got += list(zip(keys, payloads))


def test_a_failing_sink_drops_that_batch_and_the_queue_keeps_going():
    sink = GatedSink()
    sink.fail_next = True
    sink.gate.set()
    queue = WriteBehindQueue(sink, capacity_bytes=1 << 20)
    try:
        queue.submit([key(1)], [np.ones(10, np.uint8)])
        assert queue.flush(timeout=30)
        queue.submit([key(2)], [np.ones(10, np.uint8)])
        assert queue.flush(timeout=30)
        assert list(sink.got) == [key(2)]
    finally:
        queue.close()


def test_bad_input_and_closed_queue_are_value_errors():
    queue = WriteBehindQueue(GatedSink(), capacity_bytes=100)
    queue._sink.gate.set()
    with pytest.raises(ValueError):
        queue.submit([key(1)], [42])
    queue.close()
    with pytest.raises(ValueError, match="closed"):
        queue.submit([key(1)], [np.ones(1, np.uint8)])
    with pytest.raises(ValueError):
        WriteBehindQueue(GatedSink(), capacity_bytes=0)
