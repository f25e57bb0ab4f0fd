"""The write-behind queue: bounded in bytes, never blocks, copies on submit, survives a failing sink."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import wait_until

from kvpool.client.writer import WriteBehindQueue
from kvpool.keys import BlockKey


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


def test_submit_copies_so_the_caller_may_reuse_its_buffer():
    sink = GatedSink()
    queue = WriteBehindQueue(sink, capacity_bytes=1 << 20)
    try:
        buf = np.full(100, 7, np.uint8)
        queue.submit([key(1)], [buf])
        buf[:] = 0  # the engine reuses its buffer at once
        sink.gate.set()
        assert queue.flush(timeout=30)
        assert sink.got[key(1)] == bytes([7]) * 100
    finally:
        sink.gate.set()
        queue.close()


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
        queue.submit([key(1)], [b"x"])
    with pytest.raises(ValueError):
        WriteBehindQueue(GatedSink(), capacity_bytes=0)
