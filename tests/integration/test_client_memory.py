"""A client maps a same-host node's arena without faulting all of it in.

Regression: the client populated the whole arena (GiBs on a default
``kvpool serve``) in a background thread as soon as it mapped it: seconds of
CPU beside the engine's forward pass (the demo's DRAM hit took longer than
recomputing) and the whole arena in the worker's resident set.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support import PoolProcesses

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key

MIB = 1 << 20
ARENA = 256 * MIB


def rss_shmem() -> int:
    """Bytes of shared memory this process has mapped in (``RssShmem`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.fixture
def procs(tmp_path):
    p = PoolProcesses(tmp_path, **{"dram-bytes": str(ARENA), "max-block-bytes": "1M"})
    yield p
    p.close()


def test_reading_a_few_blocks_maps_only_their_pages(procs):
    procs.serve()
    keys = [opaque_key(f"rss-{i}") for i in range(4)]
    values = [np.full(MIB, i, dtype=np.uint8) for i in range(4)]
    before = rss_shmem()
    with PoolClient(ClientConfig(master=procs.master)) as pool:
        assert all(pool.store(keys, values))
        run = pool.lookup(keys)
        outs = [np.empty(MIB, dtype=np.uint8) for _ in keys]
        assert all(pool.get_into(list(run), outs))
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        assert pool.nodes.arena(run[0].node) is not None  # the reads went through the mapped arena
        most = 0
        until = time.monotonic() + 1.0  # a background pre-fault would map the rest well within a second
        while time.monotonic() < until:
            most = max(most, rss_shmem() - before)
            time.sleep(0.05)
    assert most < 32 * MIB, f"the client has {most / MIB:.0f} MiB of a {ARENA / MIB:.0f} MiB arena mapped in"
