"""A same-host lookup without a round trip: which of 512 keys a node holds, and in which tier, from its arena.

    python benchmarks/arena_inventory.py [--calls 2000]

A node store in this process (a real arena in /dev/shm, real LMDB in a
temporary directory) holds 1,000 blocks in DRAM and 4,000 on SSD (both
tables about as full as they get). A second mapping (``SharedArena.attach``,
what a same-host client holds) answers 128 DRAM keys, 128 SSD keys and 256
unknown ones: the inventory table and state, and, beside it, the key index
and the rows checked (``check_slots``). Prints p50 / p99 in microseconds.
Not a test: the numbers depend on the machine.

What a same-host lookup reads is the inventory table alone (one batched
lookup: tier, size, checksum per key); the key index plus rows is what a
read of DRAM blocks checks before copying, shown beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
import uuid

import numpy as np

from kvpool.keys import BlockKey
from kvpool.tiers.arena import KEY_DTYPE, InventoryState, SharedArena
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import SsdStore

BLOCK = 1024
DRAM_BLOCKS, DRAM_SLOTS = 1000, 1024
SSD_BLOCKS, SSD_KEYS = 4000, 4096  # the inventory: room for 1,024 + 4,096 keys


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


def percentiles(ns: list[int]) -> str:
    p50, p99 = np.percentile(np.array(ns) / 1000, [50, 99])
    return f"p50 {p50:7.1f} us   p99 {p99:7.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    name = f"kvpool-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        dram = DramStore.create(name, DRAM_SLOTS * BLOCK, BLOCK, slots=DRAM_SLOTS, ssd_keys=SSD_KEYS)
        node = NodeStore(dram, SsdStore(tmp, 64 << 20))
        try:
            value = bytes(BLOCK)
            assert node.ssd is not None
            node.ssd.put([key(i) for i in range(SSD_BLOCKS)], [value] * SSD_BLOCKS)
            node.put([key(SSD_BLOCKS + i) for i in range(DRAM_BLOCKS)], [value] * DRAM_BLOCKS)
            reader = SharedArena.attach(name)
            asked = [key(i) for i in range(128)] + [key(SSD_BLOCKS + i) for i in range(128)]
            asked += [key(10**9 + i) for i in range(256)]
            keys = np.frombuffer(b"".join(asked), dtype=KEY_DTYPE)
            inventory_ns, rows_ns = [], []
            for _ in range(args.calls):
                t0 = time.perf_counter_ns()
                complete = reader.inventory_state() == InventoryState.COMPLETE
                tiers, _, _ = reader.inventory_meta(keys)
                t1 = time.perf_counter_ns()
                _, _, in_dram = reader.check_slots(reader.index_find(keys), keys)
                t2 = time.perf_counter_ns()
                inventory_ns.append(t1 - t0)
                rows_ns.append(t2 - t1)
            assert complete and int((tiers == 1).sum()) == 128 and int((tiers == 2).sum()) == 128
            assert int(in_dram.sum()) == 128
            print(f"512 keys, {args.calls} calls, from an attached arena:")
            print(f"  inventory_state + inventory_meta (the lookup)   {percentiles(inventory_ns)}")
            print(f"  index_find + check_slots (a DRAM read's check)  {percentiles(rows_ns)}")
            ref = np.arange(512, dtype=np.uint64)
            adds = []
            for _ in range(args.calls):  # what one small array operation costs on this machine, now
                t0 = time.perf_counter_ns()
                ref + ref
                adds.append(time.perf_counter_ns() - t0)
            print(f"  reference: one numpy add of 512 {percentiles(adds)}")
            reader.close()
        finally:
            node.close()


if __name__ == "__main__":
    main()
