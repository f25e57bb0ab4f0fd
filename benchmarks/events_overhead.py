"""Does publishing KV events slow the pool? The data path and the master's report path, events off against on.

    python benchmarks/events_overhead.py [--blocks 4000] [--rounds 4]

Two measurements, each alternating events off and on (ABAB...: this machine is shared and noisy) and
reporting the ratio of the medians (on / off; 1.00 = no cost):

- **data path**: a real pool (``kvpool serve`` in a child process on 127.0.0.1, DRAM for every block) and a
  :class:`~kvpool.client.pool.PoolClient` here: put ``--blocks`` blocks of 64 KiB in batches of 32, flush, then
  lookup and get each batch back. With events on, the master publishes every tier change to a real ZMQ
  subscriber that reads them all *and* to one that never reads (its socket's queue fills, then drops): the
  node's reports, which feed the events, run beside this client's calls.
- **master report path**: ``BlockIndex.add`` then ``remove`` of 64-key batches, the call a node report makes,
  without a change sink and with the master's event feed on a real publisher: microseconds per block.

Not a test: the numbers depend on the machine. docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import zmq
from local_pool import LocalPool

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.event_publisher import EventPublisher
from kvpool.keys import BlockKey, opaque_key
from kvpool.master.index import BlockIndex
from kvpool.master.kv_events import MasterEventFeed
from kvpool.vocabulary import Tier

BLOCK = 64 << 10
BATCH = 32


def free_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Readers:
    """A subscriber that reads every batch (counting them) and one that connects and never reads."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.reader = self.ctx.socket(zmq.SUB)
        self.reader.setsockopt(zmq.SUBSCRIBE, b"")
        self.reader.connect(endpoint)
        self.stuck = self.ctx.socket(zmq.SUB)
        self.stuck.setsockopt(zmq.SUBSCRIBE, b"")
        self.stuck.setsockopt(zmq.RCVHWM, 10)
        self.stuck.connect(endpoint)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.reader.poll(50):
                self.reader.recv_multipart()
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


def data_path_once(events: bool, blocks: int) -> tuple[float, int]:
    """Seconds for the put + lookup + get workload on a fresh ``kvpool serve`` child process; and the batches
    the reader got."""
    endpoint = free_endpoint() if events else ""
    flags: dict[str, object] = {"master-kv-events-endpoint": endpoint} if events else {}
    with LocalPool(dram_bytes=(blocks + 256) * BLOCK, max_block_bytes=BLOCK, ssd_bytes=0, flags=flags) as pool:
        readers = Readers(endpoint) if events else None
        try:
            if readers is not None:  # a PUB drops what it sends before a subscription arrives
                time.sleep(0.5)
            rng = np.random.default_rng(0)
            values = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BATCH)]
            keys = [opaque_key(f"evbench-{uuid.uuid4().hex}-{i}") for i in range(blocks)]
            outs = [np.empty(BLOCK, np.uint8) for _ in range(BATCH)]
            with PoolClient(ClientConfig(master=pool.address, lookup_timeout_s=5.0, io_timeout_s=10.0)) as client:
                started = time.perf_counter()
                for i in range(0, blocks, BATCH):
                    client.put(keys[i:i + BATCH], values[:len(keys[i:i + BATCH])])
                assert client.flush(timeout=60)
                for i in range(0, blocks, BATCH):
                    run = client.lookup(keys[i:i + BATCH])
                    while len(run) < len(keys[i:i + BATCH]):  # the node's report of the last puts is on its way
                        time.sleep(0.001)
                        run = client.lookup(keys[i:i + BATCH])
                    got = client.get_into(run, outs[:len(run)])
                    assert all(got), "bench: a block was not served"
                elapsed = time.perf_counter() - started
            return elapsed, readers.batches if readers is not None else 0
        finally:
            if readers is not None:
                readers.close()


def report_path_once(events: bool, blocks: int) -> float:
    """Microseconds per block of BlockIndex.add + remove in 64-key batches (a node's reports)."""
    feed = MasterEventFeed(EventPublisher(free_endpoint()), "kvpool") if events else None
    index = BlockIndex(on_change=feed.pool_changed if feed is not None else None)
    index.open_node(0)
    rng = np.random.default_rng(1)
    keys = [BlockKey(rng.bytes(32)) for _ in range(blocks)]
    sizes, sums = [BLOCK] * 64, [0] * 64
    try:
        started = time.perf_counter()
        for i in range(0, blocks, 64):
            index.add(0, Tier.DRAM, keys[i:i + 64], sizes[:len(keys[i:i + 64])], sums[:len(keys[i:i + 64])])
        for i in range(0, blocks, 64):
            index.remove(0, Tier.DRAM, keys[i:i + 64])
        return 1e6 * (time.perf_counter() - started) / (2 * blocks)
    finally:
        if feed is not None:
            feed.close()


def alternate(rounds: int, measure: Callable[[bool], float]) -> tuple[list[float], list[float]]:
    off: list[float] = []
    on: list[float] = []
    for r in range(rounds):
        for events in ((False, True) if r % 2 == 0 else (True, False)):
            (on if events else off).append(measure(events))
    return off, on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    heard: list[int] = []

    def data(events: bool) -> float:
        seconds, batches = data_path_once(events, args.blocks)
        if events:
            heard.append(batches)
        return seconds

    off, on = alternate(args.rounds, data)
    gb = 2 * args.blocks * BLOCK / 1e9  # bytes put and read back
    print(f"data path, {args.blocks} blocks of 64 KiB put then looked up and read, {args.rounds} rounds each:")
    print(f"  events off: median {statistics.median(off):.3f} s ({gb / statistics.median(off):.2f} GB/s), "
          f"rounds {min(off):.3f}-{max(off):.3f} s")
    print(f"  events on:  median {statistics.median(on):.3f} s ({gb / statistics.median(on):.2f} GB/s), "
          f"rounds {min(on):.3f}-{max(on):.3f} s; the reader got {min(heard)}-{max(heard)} batches a round, "
          "one subscriber never read")
    print(f"  ratio on/off: {statistics.median(on) / statistics.median(off):.3f}")
    off_us, on_us = alternate(args.rounds, lambda events: report_path_once(events, 64_000))
    print("master report path, BlockIndex.add + remove of 64-key batches, 64,000 blocks:")
    print(f"  no sink: median {statistics.median(off_us):.2f} us/block; event feed: "
          f"{statistics.median(on_us):.2f} us/block; ratio {statistics.median(on_us) / statistics.median(off_us):.2f}")


if __name__ == "__main__":
    main()
