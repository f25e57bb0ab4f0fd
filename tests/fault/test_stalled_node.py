"""A stalled or slow node: client calls end within their deadline, as misses if need be; nothing hangs.

Two nodes; n0 is stopped with SIGSTOP (and always continued with SIGCONT)
while engine-like loads run and while readers load blocks that the master
still places on n0 (it drops n0 only after ``node_timeout_s`` of silence).
Every call must come back within the client's deadline (``io_timeout_s``
for node calls, ``lookup_timeout_s`` for the master) plus scheduling slack,
as a miss (a same-host reader still reads n0's DRAM blocks from its arena,
which needs no call to the node); after SIGCONT n0 registers again and its blocks hit again.
Then n0 is made slow (stopped 0.6 s of every 0.8 s) under the same loads:
calls are slow or miss, but none outlasts its deadline.
"""

from __future__ import annotations

import time

import numpy as np
from fault.faultkit import (
    KIB,
    MixedLoad,
    content,
    keys_of,
    master_flags,
    start_master,
    start_node,
    stopped,
    throttled,
)
from support import wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.pool import PoolClient

BLOCK = 64 * KIB
IO_TIMEOUT_S = 1.5
LOOKUP_TIMEOUT_S = 0.5
NODE_TIMEOUT_S = 6.0  # long enough for both readers to meet the stalled node through the master
SLACK_S = 1.0  # scheduling on a loaded 2-core machine; still below a second deadline (2 x IO_TIMEOUT_S)


def test_a_stalled_node_costs_a_reader_at_most_its_deadline_and_nothing_hangs(procs, client_config):
    procs.node_flags.update({"dram-bytes": "4M", "max-block-bytes": "64K"})
    start_master(procs, **master_flags(node_timeout_s=NODE_TIMEOUT_S))
    victim = start_node(procs, "n0")
    start_node(procs, "n1")
    procs.wait_nodes(2)
    config = {"io_timeout_s": IO_TIMEOUT_S, "lookup_timeout_s": LOOKUP_TIMEOUT_S}
    keys = keys_of("stall", 24)
    with PoolClient(client_config(strict=True)) as writer:
        assert writer.store(keys, [content(k, BLOCK) for k in keys]) == [True] * len(keys)
        on_n0 = [k for k in keys if writer.lookup([k])[0].node.node_id == "n0"]
    assert len(on_n0) >= 2, "placement put too few blocks on n0"

    readers = {"same-host": PoolClient(client_config(shared_memory=True, **config)),
               "remote": PoolClient(client_config(shared_memory=False, **config))}
    engines = [KVCacheClient(client_config(shared_memory=shm, **config)) for shm in (True, False)]
    loads = [MixedLoad(c, f"stall-{i}", prefixes=8, seed=i).start() for i, c in enumerate(engines)]
    reads: dict[str, list[float]] = {name: [] for name in readers}
    try:
        for load in loads:
            load.wait_ops(10, pool=1)
        with stopped(victim) as stalled_at:
            for name, reader in readers.items():  # the master still places these blocks on n0
                run = reader.lookup(on_n0[:1])
                assert [loc.node.node_id for loc in run] == ["n0"]
                start = time.monotonic()
                out = np.zeros(BLOCK, np.uint8)
                # Same host: the stalled node's arena (its key index and rows) still serves checked bytes,
                # without a call to the node. Remote: the node must answer, so a miss...
                assert reader.get_into(run, [out]) == [name == "same-host"]
                reads[name].append(time.monotonic() - start)  # ...within the deadline
                if name == "same-host":
                    assert np.array_equal(out, content(on_n0[0], BLOCK))
            procs.wait_nodes(1, timeout=NODE_TIMEOUT_S * 1.25 + 5)  # silent: dropped
            dropped_s = time.monotonic() - stalled_at
            for reader in readers.values():  # now a plain miss, no node call at all (the same-host reader: once
                wait_until(lambda r=reader: len(r.lookup(on_n0)) == 0, timeout=5)  # its cluster view dropped n0)
            for load in loads:
                load.wait_ops(10, since=time.monotonic())
            stall_end = time.monotonic()
        procs.wait_nodes(2, timeout=15)  # continued: n0 registers again with what it holds
        for reader in readers.values():  # the master's index (remote), the client's view (same host)
            wait_until(lambda r=reader: len(r.lookup(on_n0)) == len(on_n0), timeout=10)
        for reader in readers.values():
            outs = [np.zeros(BLOCK, np.uint8) for _ in on_n0]
            assert reader.get_into(reader.lookup(on_n0), outs) == [True] * len(on_n0)
            assert all(np.array_equal(o, content(k, BLOCK)) for k, o in zip(on_n0, outs))
        slow_start = time.monotonic()
        with throttled(victim, stop_s=0.6, run_s=0.2):
            for load in loads:
                load.wait_ops(20, since=slow_start)
        slow_end = time.monotonic()
    finally:
        reports = [load.stop() for load in loads]
        for c in [*engines, *readers.values()]:
            c.close()

    for r in reports:
        assert r.exceptions == [], r.exceptions[0]
        assert r.wrong_bytes == 0 and r.checked_blocks > 0
    slowest_read = max(max(v) for v in reads.values())
    slowest_engine = max(r.slowest(stalled_at, stall_end) for r in reports)
    slowest_slow = max(r.slowest(slow_start, slow_end) for r in reports)
    assert slowest_read <= IO_TIMEOUT_S + SLACK_S, reads
    assert slowest_engine <= IO_TIMEOUT_S + SLACK_S, slowest_engine
    assert slowest_slow <= IO_TIMEOUT_S + SLACK_S, slowest_slow
    print(f"\nFIGURES stalled-node: io deadline {IO_TIMEOUT_S}s; a read of a stalled node's block took "
          + ", ".join(f"{name} {max(v):.2f}s" for name, v in reads.items())
          + f"; slowest engine call during the stall {slowest_engine:.2f}s; master dropped the node "
          f"{dropped_s:.2f}s into the stall (timeout {NODE_TIMEOUT_S}s); slowest engine call with the node "
          f"slow {slowest_slow:.2f}s")
