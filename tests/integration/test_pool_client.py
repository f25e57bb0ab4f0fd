"""PoolClient against a master that is not there: misses and counted errors, never exceptions."""

from __future__ import annotations

from support import free_port

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.metrics import error_counts


def test_a_failed_hbm_report_is_counted_apart_from_data_path_errors():
    with PoolClient(ClientConfig(master=f"127.0.0.1:{free_port()}", lookup_timeout_s=0.3)) as pool:
        pool.report_hbm([opaque_key("a")], [], wait=True)
        counted = error_counts(pool.registry)
        assert counted and all(kind.startswith("report_") for kind in counted), counted
        pool.lookup_stats.count(2, b"", 2, 16)  # a lookup HBM answered alone
        assert not pool.lookup_stats.send()  # its report fails: counted as a report error too
        assert sum(error_counts(pool.registry).values()) == sum(counted.values()) + 1
        assert all(kind.startswith("report_") for kind in error_counts(pool.registry))
        assert len(pool.lookup([opaque_key("a")])) == 0  # a lookup is a miss, counted under its own kind
        assert any(not kind.startswith("report_") for kind in error_counts(pool.registry))


def test_a_lost_write_is_a_counted_false_and_in_strict_mode_a_pool_fault():
    import numpy as np
    import pytest

    from kvpool.client.faults import PoolFault

    block = np.ones(4096, dtype=np.uint8)
    address = f"127.0.0.1:{free_port()}"
    with PoolClient(ClientConfig(master=address, lookup_timeout_s=0.3)) as pool:
        assert pool.store([opaque_key("a")], [block]) == [False]
        assert sum(error_counts(pool.registry).values()) == 1
    with PoolClient(ClientConfig(master=address, lookup_timeout_s=0.3, strict=True)) as pool:
        with pytest.raises(PoolFault) as fault:
            pool.store([opaque_key("a")], [block])
        assert fault.value.kind in ("unavailable", "timeout")


def test_an_inference_worker_imports_no_part_of_the_node():
    """The client shares only the wire (kvpool.wire, kvpool.calls) and the arena's layout with the node:
    a worker process holds no tiers, quota ledger, LMDB or master."""
    import subprocess
    import sys

    code = ("import sys, kvpool.client.kvclient, kvpool.client.pool; print(sorted(m for m in sys.modules if "
            "m == 'kvpool.master' or m.startswith(('kvpool.node', 'kvpool.master.', 'kvpool.tiers.node_store', "
            "'kvpool.tiers.ssd', 'kvpool.tiers.dram', 'lmdb'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_engine_names_stop_going_to_a_master_that_publishes_no_events(tmp_path):
    """A master without KV events keeps no names (NameBlocks answers 0): the client stops sending them for a
    while instead of paying a master call per put batch for nothing; the blocks are stored as ever."""
    import time

    import numpy as np
    from support import PoolProcesses

    procs = PoolProcesses(tmp_path)
    try:
        procs.serve()
        with PoolClient(ClientConfig(master=procs.master, lookup_timeout_s=2.0, io_timeout_s=5.0)) as client:
            keys = [opaque_key(f"unnamed-{i}") for i in range(4)]
            block = np.ones(4096, np.uint8)
            assert client.put(keys[:2], [block] * 2, [11, 12]) == [True, True] and client.flush(timeout=10)
            assert client._names_unwanted_until > time.monotonic()  # the master said it kept none
            assert client.put(keys[2:], [block] * 2, [13, 14]) == [True, True]
            assert client._names == {}  # not even queued now
            assert client.flush(timeout=10) and len(client.lookup(keys)) == 4
    finally:
        procs.close()
    procs.assert_stopped_cleanly()
