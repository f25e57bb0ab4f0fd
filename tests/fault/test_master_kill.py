"""kill -9 of the Master Service during load, then a restart: HBM keeps serving, the index is rebuilt.

An engine-like client with an HBM tier (8 blocks) runs over 24 blocks that
are all in the pool, so its lookups need both HBM and the master. The
master is killed with SIGKILL mid-load and restarted on the same ports a
little later; the time from the restart to *every* stored block hitting
again, for a client that lived through the outage, is the recovery time.
"""

from __future__ import annotations

import time

from fault.faultkit import (
    KIB,
    MixedLoad,
    kill_9,
    master_flags,
    start_master,
    start_node,
)
from support import wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.pool import PoolClient
from kvpool.layout import KVLayout

LAYOUT = KVLayout("uint8", num_layers=2, num_kv_heads=4, head_dim=64, block_size=64)  # 64 KiB blocks
RECOVERY_BOUND_S = 5.0  # from the restarted master serving to every block hitting again


def test_kill_9_of_the_master_degrades_to_misses_and_the_index_is_rebuilt(procs, client_config):
    assert LAYOUT.block_bytes == 64 * KIB
    procs.node_flags.update({"dram-bytes": "4M", "max-block-bytes": "64K"})  # 64 slots: every block stays in DRAM
    master = start_master(procs, **master_flags())
    start_node(procs, "n0")
    procs.wait_nodes(1)

    # the network path: a same-host client would keep hitting from the node's arena (tests/integration/test_services.py)
    engine = KVCacheClient(client_config(layout=LAYOUT, hbm_blocks=8, shared_memory=False))
    load = MixedLoad(engine, "master-kill", prefixes=6, blocks=4, block_bytes=LAYOUT.block_bytes)
    stored = load.all_keys()
    with PoolClient(client_config(strict=True)) as writer:
        assert writer.store(stored, [load.expected(k) for k in stored]) == [True] * len(stored)
    load.start()
    try:
        load.wait_ops(10, hbm=1)
        load.wait_ops(10, pool=1)

        killed = kill_9(master)
        load.wait_ops(40, since=killed, hbm=1)  # HBM hits go on without the master...
        down = load.report.window(killed, kind="lookup")
        assert sum(o.pool for o in down) == 0  # ...and every pool lookup is a miss
        assert len(down) >= 40

        restarted = time.monotonic()
        start_master(procs, **master_flags())  # same ports; waits until it serves
        serving_s = time.monotonic() - restarted

        def all_hit() -> bool:  # every stored prefix, asked of the pool by the client that saw the outage
            return all(len(engine.pool.lookup(load.keys(p))) == load.blocks for p in range(load.prefixes))

        wait_until(all_hit, timeout=RECOVERY_BOUND_S, interval=0.02)
        recovery_s = time.monotonic() - restarted
        rebuilt_s = recovery_s - serving_s
        load.wait_ops(5, since=time.monotonic(), pool=1)
    finally:
        report = load.stop()
        engine.close()

    assert report.exceptions == [], report.exceptions[0]
    assert report.wrong_bytes == 0 and report.checked_blocks > 0
    slowest_down = max(o.seconds for o in down)
    assert slowest_down < 1.0, f"a lookup with the master down took {slowest_down:.2f}s"
    hbm_hits = sum(o.hbm for o in down)
    print(f"\nFIGURES master-kill: {len(down)} lookups while down, {hbm_hits} HBM block hits, 0 pool hits, "
          f"slowest {slowest_down * 1000:.0f} ms; restart to serving {serving_s:.2f}s, "
          f"restart to every block hitting again {recovery_s:.2f}s (serving to all hits {rebuilt_s:.2f}s); "
          f"{report.checked_blocks} blocks checked, "
          f"0 wrong bytes, 0 exceptions")
