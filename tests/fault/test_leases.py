"""Generations and leases: readers never get another block's bytes; looking at a block does not keep it alive.

- Readers (same-host arena copies and remote bulk GETs) race a writer whose
  puts evict and reuse DRAM slots all the time: every byte a reader accepts
  must be its block's; a block whose slot moved under it is a miss.
- A block that is only ever looked up (master Lookup and Exists, node Exists
  and Locate) is evicted in LRU order as if nobody looked, while a block
  that is read stays (Mooncake users saw eviction free nothing because
  lookups renewed leases).
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
from fault.faultkit import (
    KIB,
    client_errors,
    content,
    key_of,
    keys_of,
    master_exists,
    master_flags,
    node_holds,
    start_master,
    start_node,
)
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.keys import BlockKey, pack_keys
from kvpool.v1 import node_pb2, node_pb2_grpc

RACE_BLOCK = 256 * KIB
RACE_SLOTS = 8


def test_readers_racing_slot_reuse_get_their_block_or_a_miss_never_other_bytes(procs, client_config):
    procs.node_flags.update({"dram-bytes": str(RACE_SLOTS * RACE_BLOCK), "max-block-bytes": "256K",
                             "ssd": "false"})  # evicted means gone: slots are reused at once
    start_master(procs, **master_flags())
    start_node(procs, "n0")
    procs.wait_nodes(1)
    written: list[BlockKey] = []
    stop = threading.Event()
    failures: list[str] = []

    def write() -> None:
        with PoolClient(client_config()) as writer:
            i = 0
            while not stop.is_set():
                batch = [key_of("race", i), key_of("race", i + 1)]
                try:
                    writer.store(batch, [content(k, RACE_BLOCK) for k in batch])
                except Exception as exc:  # noqa: BLE001 - reported below
                    failures.append(repr(exc))
                written.extend(batch)
                i += 2

    stats = {name: {"hits": 0, "misses": 0, "wrong": 0} for name in ("same-host", "remote")}
    readers = {"same-host": PoolClient(client_config(shared_memory=True)),
               "remote": PoolClient(client_config(shared_memory=False))}

    def read(name: str) -> None:
        reader, s = readers[name], stats[name]
        rng = np.random.default_rng(len(name))
        while not stop.is_set():
            recent = written[-RACE_SLOTS:]
            if not recent:
                time.sleep(0.01)
                continue
            key = recent[int(rng.integers(len(recent)))]
            try:
                run = reader.lookup([key])
                if not run:
                    continue
                out = np.zeros(RACE_BLOCK, np.uint8)
                if reader.get_into(run, [out]) == [True]:
                    s["hits"] += 1
                    s["wrong"] += int(np.count_nonzero(out != content(key, RACE_BLOCK)))
                else:
                    s["misses"] += 1
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(repr(exc))

    threads = [threading.Thread(target=write, daemon=True)]
    threads += [threading.Thread(target=read, args=(name,), daemon=True) for name in readers]
    for t in threads:
        t.start()
    try:
        # Run until both readers saw hits and lost blocks to reuse (bounded: 20 s).
        wait_until(lambda: all(s["hits"] >= 50 and s["misses"] >= 10 for s in stats.values()), timeout=20)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        lost = {name: client_errors(r, "slot_reused", "block_gone", "block_changed", "checksum")
                for name, r in readers.items()}
        mid_copy = client_errors(readers["same-host"], "slot_reused")
        for r in readers.values():
            r.close()
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert all(s["wrong"] == 0 for s in stats.values()), stats
    assert all(n > 0 for n in lost.values()), lost  # the race really happened, and was caught, on both paths
    print(f"\nFIGURES slot-reuse race: {len(written)} blocks written through {RACE_SLOTS} slots; "
          + "; ".join(f"{name} {s['hits']} hits, {s['misses']} misses" for name, s in stats.items())
          + f"; 0 wrong bytes; {mid_copy:.0f} same-host copies caught by the gen re-check mid-copy")


LRU_BLOCK = 64 * KIB
LRU_SLOTS = 8


def look_without_reading(procs, pool: PoolClient, key: BlockKey) -> None:
    """Every way of asking about a block that is not a read: master Lookup and Exists, node Exists and Locate."""
    assert len(pool.lookup([key])) in (0, 1)
    pool.exists([key])
    with grpc.insecure_channel(procs.node_address("n0")) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        stub.Exists(node_pb2.NodeExistsRequest(keys=pack_keys([key])), timeout=5)
        stub.Locate(node_pb2.LocateRequest(keys=pack_keys([key]), promote=False), timeout=5)


def test_lookups_do_not_keep_a_block_alive_but_reads_do(procs, client_config):
    procs.node_flags.update({"dram-bytes": str(LRU_SLOTS * LRU_BLOCK), "max-block-bytes": "64K", "ssd": "false",
                             "high-watermark": "1.0", "low-watermark": "1.0"})  # evict exactly what a put needs
    start_master(procs, **master_flags())
    start_node(procs, "n0")
    procs.wait_nodes(1)
    looked, read = key_of("lru", 0), key_of("lru", 1)
    fill = keys_of("lru-fill", LRU_SLOTS - 2)
    new = keys_of("lru-new", 2 * LRU_SLOTS)
    # Remote reads: a bulk GET refreshes the node's LRU, as a read must.
    with PoolClient(client_config(shared_memory=False, strict=True)) as pool:
        for key in [looked, read, *fill]:  # one at a time: write order is LRU order
            assert pool.store([key], [content(key, LRU_BLOCK)]) == [True]
        evicted_at = None
        for i, key in enumerate(new):
            for _ in range(20):
                look_without_reading(procs, pool, looked)
            out = np.zeros(LRU_BLOCK, np.uint8)
            assert pool.get_into(pool.lookup([read]), [out]) == [True] and np.array_equal(out, content(read, LRU_BLOCK))
            assert pool.store([key], [content(key, LRU_BLOCK)]) == [True]  # eviction made room every time
            if evicted_at is None and node_holds(procs.node_address("n0"), [looked]) == [False]:
                evicted_at = i
        assert evicted_at == 0  # the oldest block went first, however often it was looked up
        assert node_holds(procs.node_address("n0"), [read]) == [True]  # the block being read stayed throughout
        wait_until(lambda: master_exists(procs, [looked, read]) == [False, True])
    print(f"\nFIGURES lookups vs LRU: a block looked up {20 * 4 * len(new)} times was evicted by the first put "
          f"into a full DRAM; a block read {len(new)} times survived {len(new)} evictions")
