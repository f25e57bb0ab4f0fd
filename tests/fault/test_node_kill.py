"""kill -9 of a pool node during a mixed put/get load (real processes on 127.0.0.1).

Two nodes, two engine-like clients (same-host shared memory and remote TCP)
looking up, loading and putting 64 KiB blocks; every byte loaded is checked
against the key's contents. Node n0 is killed with SIGKILL mid-load, left
dead for a while, then restarted on its old SSD directory.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
from fault.faultkit import (
    KIB,
    MixedLoad,
    content,
    keys_of,
    kill_9,
    master_exists,
    master_flags,
    node_tiers,
    start_master,
    start_node,
    wait_demoted,
)
from support import wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.pool import PoolClient
from kvpool.tiers.ssd import SsdStore
from kvpool.vocabulary import Tier

BLOCK = 64 * KIB
SSD_BYTES = 64 << 20
NODE_TIMEOUT_S = 1.0  # short, to measure the drop


def test_kill_9_of_a_node_under_load_loses_no_byte_and_its_ssd_comes_back(procs, client_config):
    procs.node_flags.update({"dram-bytes": "1M", "max-block-bytes": "64K", "ssd-bytes": str(SSD_BYTES)})  # 16 slots
    start_master(procs, **master_flags(node_timeout_s=NODE_TIMEOUT_S))
    victim = start_node(procs, "n0")
    start_node(procs, "n1")
    procs.wait_nodes(2)

    # Cold blocks: stored once, never touched by the load, whose writes push n0's share of them to its SSD.
    cold = keys_of("node-kill-cold", 24)
    with PoolClient(client_config(strict=True)) as writer:
        assert writer.store(cold, [content(k, BLOCK) for k in cold]) == [True] * len(cold)
        cold_n0 = [k for k in cold if writer.lookup([k])[0].node.node_id == "n0"]
    assert cold_n0, "placement put no cold block on n0"

    clients = [KVCacheClient(client_config(shared_memory=shm)) for shm in (True, False)]
    loads = [MixedLoad(c, f"node-kill-{i}", prefixes=12, seed=i).start() for i, c in enumerate(clients)]
    try:
        wait_until(lambda: all(t == Tier.SSD for t in node_tiers(procs.node_address("n0"), cold_n0)), timeout=30)
        with contextlib.ExitStack() as held:  # on SSD, not only on their way there: the load's own writes keep
            for load in loads:                # demotions coming, so it pauses while the queue drains
                held.enter_context(load.held())
            wait_demoted(procs, "n0")
        for load in loads:
            load.wait_ops(20, pool=1)  # the pool serves the load before the fault

        killed = kill_9(victim)
        procs.wait_nodes(1, timeout=10)
        drop_s = time.monotonic() - killed
        assert drop_s <= NODE_TIMEOUT_S * 1.25 + 0.75, f"master dropped the dead node after {drop_s:.2f}s"
        dropped = time.monotonic()
        assert not any(master_exists(procs, cold_n0))  # gone with the node; nobody else holds them
        for load in loads:
            load.wait_ops(30, since=dropped)  # the load goes on with n0 dead

        # What n0's SSD held at the SIGKILL, read straight from its LMDB files (the dead node's lock is gone).
        with SsdStore(procs.tmp / "ssd-n0", SSD_BYTES) as ssd:
            on_disk = ssd.keys()
            outs = [np.empty(BLOCK, np.uint8) for _ in on_disk]
            assert all(ssd.get_into(on_disk, outs))
            assert sum(int(np.count_nonzero(o != content(k, BLOCK))) for k, o in zip(on_disk, outs)
                       if k in set(cold)) == 0
        back = [k for k in cold_n0 if k in set(on_disk)]
        assert back, "n0's SSD lost every cold block at the SIGKILL"

        restarted = time.monotonic()
        start_node(procs, "n0")
        wait_until(lambda: all(master_exists(procs, back)), timeout=15)
        reindexed_s = time.monotonic() - restarted
        for load in loads:
            load.wait_ops(20, since=time.monotonic(), pool=1)  # and the load hits the pool again
    finally:
        reports = [load.stop() for load in loads]
        for c in clients:
            c.close()

    with PoolClient(client_config(strict=True)) as reader:  # the blocks back from n0's SSD are byte-exact
        run = reader.lookup(back)
        assert len(run) == len(back) and {loc.node.node_id for loc in run} == {"n0"}
        outs = [np.empty(BLOCK, np.uint8) for _ in back]
        assert reader.get_into(run, outs) == [True] * len(back)
        assert all(np.array_equal(o, content(k, BLOCK)) for k, o in zip(back, outs))

    for r in reports:
        assert r.exceptions == [], r.exceptions[0]
        assert r.wrong_bytes == 0
        assert r.checked_blocks > 0
    checked = sum(r.checked_blocks for r in reports)
    slowest = max(r.slowest() for r in reports)
    print(f"\nFIGURES node-kill: drop {drop_s:.2f}s (timeout {NODE_TIMEOUT_S}s); {len(back)}/{len(cold_n0)} cold "
          f"blocks of n0 back in the index {reindexed_s:.2f}s after its restart ({len(on_disk)} blocks on its SSD); "
          f"{checked} blocks checked, 0 wrong bytes, 0 exceptions; slowest engine call {slowest * 1000:.0f} ms")
