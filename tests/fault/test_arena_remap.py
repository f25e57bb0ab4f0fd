"""A client that once failed to map a node's arena maps it again (it used to give up for its whole life).

The failure comes from racing a node's restart: the client opened
``/dev/shm/<arena>`` while the new node had created the file but not yet
sized it ("not a kvpool arena (too small)"). Once the node is back, the
client must read and write over shared memory again, not over the network
forever.
"""

from __future__ import annotations

import numpy as np
from fault.faultkit import KIB, content, keys_of, kill_9, master_flags, start_master, start_node
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.tiers.arena import shm_path

BLOCK = 64 * KIB
NODE = {"dram-bytes": str(16 * BLOCK), "max-block-bytes": str(BLOCK)}


def path_blocks(pool: PoolClient, path: str, op: str) -> float:
    """The client's ``kvpool_path_blocks_total{path, op}``: blocks that data path moved."""
    for family in pool.registry.collect():
        for s in family.samples:
            if s.name == "kvpool_path_blocks_total" and s.labels == {"path": path, "op": op}:
                return s.value
    return 0.0


def test_a_failed_arena_mapping_is_retried_after_the_node_restarts(procs, client_config):
    start_master(procs, **master_flags(node_timeout_s=60.0))  # the dead node stays indexed: its arena is tried
    node = start_node(procs, "n1", **NODE)
    procs.wait_nodes(1)
    arena = procs.node_settings("n1")["arena"]
    keys = keys_of("remap", 4)
    values = [content(k, BLOCK) for k in keys]
    with PoolClient(client_config(io_timeout_s=1.0)) as pool:
        kill_9(node)
        with open(shm_path(arena), "wb") as f:  # what a restarting node leaves for a moment: a file not sized yet
            f.write(b"\0" * 100)
        assert not any(pool.store(keys, values))  # the first mapping fails ("too small"), the node is gone
        assert path_blocks(pool, "shared_memory", "put") == 0

        start_node(procs, "n1", **NODE)  # reclaims the stale file, registers again
        # Until the mapping's back-off (at most 5 s) has passed, a store goes over the bulk path; fresh probe
        # blocks show when the shared-memory path is back, then the real blocks must all go over it.
        probes = iter(range(1000))

        def mapped_again() -> bool:
            probe = keys_of(f"remap-probe-{next(probes)}", 1)
            pool.store(probe, [content(k, BLOCK) for k in probe])
            return path_blocks(pool, "shared_memory", "put") > 0

        assert wait_until(mapped_again, timeout=30)
        before = path_blocks(pool, "shared_memory", "put")
        assert all(pool.store(keys, values))
        run = pool.lookup(keys)
        assert len(run) == len(keys)
        outs = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
        assert all(pool.get_into(list(run), outs))
        assert all(np.array_equal(out, v) for out, v in zip(outs, values))
        assert path_blocks(pool, "shared_memory", "put") - before == len(keys)
        assert path_blocks(pool, "shared_memory", "get") == len(keys)
