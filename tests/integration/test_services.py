"""The whole pool as real processes on 127.0.0.1: `kvpool serve`, `kvpool master` + `kvpool node`, a client.

Every process is started by the test and stopped by it (PoolProcesses.close).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from support import PoolProcesses, kvpool_process, metric, scrape, stop_process, wait_serving, wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.pool import PoolClient, PoolFault
from kvpool.config import ClientConfig
from kvpool.keys import BlockKey, opaque_key
from kvpool.vocabulary import Tier

MIB = 1 << 20


def keys(prefix: str, n: int) -> list[BlockKey]:
    return [opaque_key(f"{prefix}-{i}") for i in range(n)]


def blocks(n: int, size: int = MIB, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def client(procs: PoolProcesses, **over) -> KVCacheClient:
    values: dict[str, Any] = dict(master=procs.master, lookup_timeout_s=2.0, io_timeout_s=5.0)
    values.update(over)
    return KVCacheClient(ClientConfig(**values))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host-shm", "remote-tcp"])
def test_serve_then_put_and_get_byte_exact(procs, shared_memory):
    procs.serve()
    ks, vs = keys("exact", 5), blocks(5)
    with client(procs, shared_memory=shared_memory) as c:
        assert c.put(ks, vs) == [True] * 5
        assert c.flush(timeout=10)
        result = c.lookup(ks)
        assert (result.hit_blocks, result.dram_blocks) == (5, 5)
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert c.get(ks, outs, result) == 5
        assert all(np.array_equal(o, v) for o, v in zip(outs, vs))
        assert c.exists(ks + keys("absent", 1)) == [True] * 5 + [False]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host-arena", "remote-tcp"])
def test_store_and_get_batches_of_blocks_up_to_8_mib_between_processes(procs, shared_memory):
    procs.node_flags.update({"dram-bytes": "64M", "max-block-bytes": "8M"})
    procs.serve()
    sizes = [1, 4095, MIB, 8 * MIB, 3 * MIB + 7, 8 * MIB]
    ks = keys(f"big-{shared_memory}", len(sizes))
    vs = [blocks(1, size=n, seed=i)[0] for i, n in enumerate(sizes)]
    config = ClientConfig(master=procs.master, shared_memory=shared_memory, strict=True, io_timeout_s=10.0)
    with PoolClient(config) as pool:
        assert pool.store(ks, vs) == [True] * len(ks)  # synchronous: indexed when it returns
        locations = pool.lookup(ks)
        assert [loc.tier for loc in locations] == [Tier.DRAM] * len(ks)
        outs = [np.zeros(n, np.uint8) for n in sizes]
        assert pool.get_into(locations, outs) == [True] * len(ks)
        assert all(np.array_equal(o, v) for o, v in zip(outs, vs))
        assert pool.store(ks[:2], vs[:2]) == [True, True]  # already pooled
        if not shared_memory:  # the node's bulk listener carried the bytes, no fallback to gRPC
            assert pool.nodes.data_address(procs.node_address("n0"))
        assert sum(s.value for m in pool.registry.collect() if m.name == "kvpool_errors" for s in m.samples
                   if s.name == "kvpool_errors_total") == 0


def test_dram_full_demotes_to_ssd_which_still_hits_and_promotes_back(procs):
    procs.serve()  # 8 one-MiB slots; the high watermark (95%) evicts down to 85%
    ks, vs = keys("demote", 12), blocks(12, seed=1)
    with client(procs) as c:
        for i in range(12):  # one at a time, so eviction order is plain LRU
            c.put([ks[i]], [vs[i]])
            assert c.flush(timeout=10)
        result = c.lookup(ks)
        assert result.hit_blocks == 12
        tiers = [loc.tier for loc in result.pool]
        assert tiers[0] == Tier.SSD and tiers[-1] == Tier.DRAM and result.ssd_blocks >= 4
        out = np.zeros(MIB, np.uint8)
        assert c.get(ks[:1], [out]) == 1 and np.array_equal(out, vs[0])  # served from SSD...
        assert wait_until(lambda: c.lookup(ks[:1]).pool[0].tier == Tier.DRAM)  # ...and promoted back
    # demotions are written (and counted) in the background
    assert wait_until(lambda: metric(scrape(procs.node_metrics_port("n0")), "kvpool_demotions_total") >= 4)
    node_metrics = scrape(procs.node_metrics_port("n0"))
    assert metric(node_metrics, "kvpool_promotions_total") >= 1


def test_kill_9_of_a_node_becomes_misses_without_exceptions(procs):
    procs.start_master(**{"node-timeout-s": "1.0"})
    node = procs.start_node("n0")
    procs.wait_nodes(1)
    ks, vs = keys("killed", 4), blocks(4, seed=2)
    with client(procs, shared_memory=False, io_timeout_s=1.0) as c:
        c.put(ks, vs)
        assert c.flush(timeout=10)
        stale = c.lookup(ks)
        assert stale.hit_blocks == 4
        node.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs.wait_nodes(0, timeout=10)
        dropped_after = time.monotonic() - killed_at
        assert dropped_after <= 1.0 * 1.25 + 0.75  # timeout + one sweep interval + scheduling slack
        assert c.lookup(ks).hit_blocks == 0  # the master dropped its blocks
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert c.get(ks, outs, stale) == 0  # old locations: misses, no exception
        assert c.pool.errors.errors.labels("unavailable")._value.get() >= 1


def test_a_restarted_master_is_refilled_by_the_nodes(procs):
    master = procs.start_master(**{"node-timeout-s": "3.0"})
    procs.start_node("n0")
    procs.wait_nodes(1)
    ks, vs = keys("restart", 6), blocks(6, seed=3)
    # a remote client asks the master; a same-host one reads the node's inventory from its arena
    with client(procs, shared_memory=False) as c, client(procs) as local:
        c.put(ks, vs)
        assert c.flush(timeout=10)
        assert c.lookup(ks).hit_blocks == 6 and local.lookup(ks).hit_blocks == 6
        master.send_signal(signal.SIGKILL)
        master.wait(10)
        assert c.lookup(ks).hit_blocks == 0  # master down: a miss, not an error
        assert local.lookup(ks).hit_blocks == 6  # ...but the same-host client still hits: no master on its path
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert local.get(ks, outs) == 6 and all(np.array_equal(o, v) for o, v in zip(outs, vs))
        procs.start_master(**{"node-timeout-s": "3.0"})
        wait_until(lambda: c.lookup(ks).hit_blocks == 6, timeout=15)
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert c.get(ks, outs) == 6 and all(np.array_equal(o, v) for o, v in zip(outs, vs))


def test_placement_spreads_new_blocks_over_two_nodes(procs):
    procs.node_flags.update({"dram-bytes": "32M", "max-block-bytes": "64K"})
    procs.start_master()
    procs.start_node("n0")
    procs.start_node("n1")
    procs.wait_nodes(2)
    ks, vs = keys("spread", 200), blocks(200, size=64 << 10, seed=4)
    with client(procs) as c:
        assert c.put(ks, vs) == [True] * 200
        assert c.flush(timeout=20)
        assert c.lookup(ks).hit_blocks == 200
    wait_until(lambda: sum(n.tiers[0].blocks for n in procs.status().nodes) == 200, timeout=10)
    per_node = {n.node.node_id: n.tiers[0].blocks for n in procs.status().nodes}
    assert set(per_node) == {"n0", "n1"}
    assert min(per_node.values()) >= 60, per_node  # an even split would be 100 each


def test_metrics_move_by_exactly_what_the_traffic_did(procs):
    procs.serve()
    ks, vs = keys("metrics", 6), blocks(6, seed=5)
    with client(procs, shared_memory=False) as c:
        c.put(ks[:4], vs[:4])
        assert c.flush(timeout=10)
        master_before = scrape(procs.master_metrics_port)
        node_before = scrape(procs.node_metrics_port("n0"))
        for _ in range(3):  # 3 lookups of 6 blocks: the first 4 hit in DRAM, 2 miss
            result = c.lookup(ks)
            assert result.dram_blocks == 4
            outs = [np.zeros(MIB, np.uint8) for _ in range(4)]
            assert c.get(ks[:4], outs, result) == 4
        master_after = scrape(procs.master_metrics_port)
        node_after = scrape(procs.node_metrics_port("n0"))

    def moved(before, after, name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    # the master's lookup counters carry the caller's tenant ("" with auth off)
    assert moved(master_before, master_after, "kvpool_lookups_total", tenant="") == 3
    assert moved(master_before, master_after, "kvpool_lookup_blocks_total", tenant="") == 18
    assert moved(master_before, master_after, "kvpool_hit_blocks_total", tenant="", tier="dram") == 12
    assert moved(master_before, master_after, "kvpool_hit_blocks_total", tenant="", tier="ssd") == 0
    assert moved(master_before, master_after, "kvpool_miss_blocks_total", tenant="") == 6
    assert moved(node_before, node_after, "kvpool_tier_bytes_out_total", node="n0", tier="dram") == 12 * MIB
    assert moved(node_before, node_after, "kvpool_tier_hits_total", node="n0", tier="dram") == 12
    assert metric(node_after, "kvpool_tier_used_bytes", node="n0", tier="dram") == 4 * MIB


def test_the_master_down_is_a_counted_miss_and_strict_mode_raises(procs):
    dead = ClientConfig(master=procs.master, lookup_timeout_s=0.3)  # nothing started
    with KVCacheClient(dead) as c:
        assert c.lookup(keys("dead", 3)).hit_blocks == 0
        assert c.exists(keys("dead", 2)) == [False, False]
        assert c.pool.errors.errors.labels("unavailable")._value.get() >= 1 or \
            c.pool.errors.errors.labels("timeout")._value.get() >= 1
    with PoolClient(ClientConfig(master=procs.master, lookup_timeout_s=0.3, strict=True)) as p:
        with pytest.raises(PoolFault):
            p.lookup(keys("dead", 1))


def test_bad_input_from_the_client_is_a_value_error(procs):
    procs.serve()
    with client(procs) as c:
        with pytest.raises(ValueError):
            c.put([b"short-key"], [blocks(1)[0]])
        with pytest.raises(ValueError):
            c.put(keys("bad", 2), blocks(1))
        c.put(keys("bad", 1), blocks(1))
        c.flush(timeout=10)
        result = c.lookup(keys("bad", 1))
        with pytest.raises(ValueError):
            c.get(keys("bad", 1), [np.zeros(MIB - 1, np.uint8)], result)


def test_status_prints_nodes_usage_and_hit_rates(procs):
    procs.serve()
    with client(procs) as c:
        c.put(keys("status", 2), blocks(2, seed=6))
        c.flush(timeout=10)
        c.lookup(keys("status", 3))
    # usage reaches the master with the node's next heartbeat
    wait_until(lambda: any(t.used_bytes == 2 * MIB for n in procs.status().nodes for t in n.tiers), timeout=10)
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", procs.master],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "n0" in done.stdout and "2.0 MiB / 8.0 MiB" in done.stdout
    assert "DRAM  66.7%" in done.stdout  # 2 of 3 blocks asked for were DRAM hits


def test_status_says_clearly_when_the_master_is_unreachable(procs):
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", procs.master, "--timeout", "0.5"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot reach the master" in done.stderr


def test_bad_flags_are_refused_with_a_clear_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "serve", "--dram-bytes", "lots"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2 and "node.tiers.dram.bytes (dram_bytes)" in done.stderr
    assert not (tmp_path / "kvpool-data").exists()


def test_serve_with_no_arguments_runs_on_the_default_ports(tmp_path):
    log = tmp_path / "serve.log"
    proc = kvpool_process("serve", log_path=log, cwd=tmp_path)
    try:
        wait_serving("127.0.0.1:7600", timeout=60, proc=proc)
        wait_serving("127.0.0.1:7610", timeout=60, proc=proc)
        assert (tmp_path / "kvpool-data").is_dir()
        wait_until(lambda: metric(scrape(7601), "kvpool_nodes") == 1)
    finally:
        code = stop_process(proc, timeout=30)
        assert code == 0, log.read_text()[-3000:]
    assert not os.path.exists("/dev/shm/kvpool-7610")


def test_hbm_is_checked_first_and_reported_to_the_master(procs):
    torch = pytest.importorskip("torch")  # the client extra; CI installs it
    from kvpool.layout import KVLayout

    procs.serve()
    layout = KVLayout("float32", num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    tensors = [torch.randn(layout.block_bytes // 4) for _ in range(6)]
    ks = [k for k in keys("hbm", 6)]
    with client(procs, layout=layout, hbm_blocks=4) as c:
        c.put(ks[:4], tensors[:4])
        c.put(ks[4:], tensors[4:])  # HBM (4 blocks) drops 0 and 1; the pool keeps all six
        assert c.flush(timeout=10)
        tail = c.lookup(ks[2:])
        assert (tail.hbm_blocks, len(tail.pool)) == (4, 0)  # all in HBM: the pool is not even asked
        head = c.lookup(ks)
        assert (head.hbm_blocks, head.dram_blocks) == (0, 6)  # block 0 is not in HBM: the pool serves the run
        outs = [torch.zeros_like(t) for t in tensors]
        assert c.get(ks, outs, head) == 6
        assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
        again = c.lookup(ks)  # the loaded run was kept in HBM; it keeps the leading blocks first
        assert (again.hbm_blocks, again.dram_blocks) == (4, 2)
        assert c.flush(timeout=10)
        status = procs.status()
        assert status.workers == 1 and status.hbm_blocks == 4
        assert status.lookups == 3  # the HBM-only lookup arrived with the flushed HBM report
        assert (status.hit_blocks_hbm, status.hit_blocks_dram, status.requested_blocks) == (4 + 4, 6 + 2, 4 + 6 + 6)
        c.close()
        assert procs.status().hbm_blocks == 0  # a closing worker takes its HBM entries with it
