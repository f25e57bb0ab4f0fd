"""A server's limits reach its callers: an operator who lowers ``max_keys_per_call`` on a node does not break the
clients writing to it and reading from it (they read the limit from its ``Info``), nor on a master its nodes'
reports (the registration reply says it) or its clients' calls (its ``Info``) (issue 28)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support import wait_until

from kvpool.checksum import block_checksum
from kvpool.client.lookup import PoolRun
from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.keys import BlockKey, opaque_key
from kvpool.master.server import MasterServer
from kvpool.metrics import error_counts
from kvpool.node.daemon import PoolNode
from kvpool.rpc import local_host_id
from kvpool.vocabulary import NodeRef, Tier

LIMIT = 4  # the node's max_keys_per_call
BLOCKS = 10  # a batch of three calls' worth
SIZE = 4096


def key(i: int) -> BlockKey:
    return opaque_key(f"node-limits-{i}")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def small_calls_node(tmp_path, arena_name):
    """A master and a node (in this process) whose operator set max_keys_per_call to LIMIT."""
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=16 << 20, max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"),
                     max_keys_per_call=LIMIT)
    try:
        with PoolNode(cfg) as n:
            wait_until(lambda: n.link.registered)
            yield master, n
    finally:
        master.stop()


def calls(node: PoolNode, op: str) -> float:
    """How many bulk or gRPC ``op`` (get, put) calls the node served."""
    return node.registry.get_sample_value(f"kvpool_{op}_seconds_count") or 0.0


@pytest.mark.parametrize("path", ["shared_memory", "bulk"])
def test_a_batch_over_the_nodes_lowered_key_limit_is_stored_and_read_in_several_calls(small_calls_node, path):
    master, n = small_calls_node
    keys, blocks = [key(i) for i in range(BLOCKS)], [block(i) for i in range(BLOCKS)]
    config = ClientConfig(master=master.address, strict=True, shared_memory=path == "shared_memory")
    with PoolClient(config) as pool:
        assert pool.store(keys, blocks) == [True] * BLOCKS  # strict: a call the node refused would raise
        assert pool.flush()
        run = pool.lookup(keys)
        assert len(run) == BLOCKS
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        assert pool.get_into(run, outs) == [True] * BLOCKS
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
        for op in ("put", "get"):  # every block went the path asked for, none fell through to a slower one
            assert pool.registry.get_sample_value("kvpool_path_blocks_total", {"path": path, "op": op}) == BLOCKS
    if path == "bulk":
        assert calls(n, "put") >= 3 and calls(n, "get") >= 3  # ceil(10 / 4) each way
    assert "invalid_argument" not in error_counts(n.registry)  # no call was over the limit


def test_the_grpc_path_splits_a_batch_by_the_nodes_key_limit(small_calls_node):
    master, n = small_calls_node
    keys, blocks = [key(i) for i in range(BLOCKS)], [block(i) for i in range(BLOCKS)]
    ref = NodeRef(n.node_ref.node_id, n.address, local_host_id(), n.node_ref.arena)
    with PoolClient(ClientConfig(master=master.address, strict=True, shared_memory=False)) as pool:
        stored = [False] * BLOCKS
        left = pool.grpc_path.put(ref, list(range(BLOCKS)), keys, blocks, [SIZE] * BLOCKS, stored,
                                  time.monotonic() + 10)
        assert left == [] and stored == [True] * BLOCKS
        run = PoolRun(keys, bytes([Tier.DRAM]) * BLOCKS, [0] * BLOCKS, [ref], [SIZE] * BLOCKS,
                      [block_checksum(b) for b in blocks])
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        ok = [False] * BLOCKS
        assert pool.grpc_path.get(ref, list(range(BLOCKS)), run, outs, ok, time.monotonic() + 10) == []
        assert ok == [True] * BLOCKS and all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    assert calls(n, "put") == 3 and calls(n, "get") == 3  # ceil(10 / 4) each way
    assert "invalid_argument" not in error_counts(n.registry)


def test_a_master_with_a_lowered_key_limit_gets_its_nodes_reports_and_its_clients_calls_in_parts(tmp_path,
                                                                                               arena_name):
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0, max_keys_per_call=LIMIT)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                        dram_bytes=16 << 20, max_block_bytes=1 << 20, ssd_enabled=False,
                        ssd_dir=str(tmp_path / "ssd"))
    keys, blocks = [key(i) for i in range(BLOCKS)], [block(i) for i in range(BLOCKS)]
    try:
        with PoolNode(cfg) as n:
            wait_until(lambda: n.link.registered)
            with PoolClient(ClientConfig(master=master.address, strict=True, shared_memory=False)) as pool:
                assert pool.store(keys, blocks) == [True] * BLOCKS
                assert pool.flush()  # every node report confirmed: none was refused for its size
                assert pool.exists(keys) == [True] * BLOCKS  # all reported to the master; asked in three calls
                run = pool.lookup(keys)
                assert len(run) == LIMIT  # one call's worth of leading run; the rest is a miss, not an error
                outs = [np.zeros(SIZE, np.uint8) for _ in range(LIMIT)]
                assert pool.get_into(run, outs) == [True] * LIMIT
                assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
            assert "invalid_argument" not in error_counts(master.registry)
    finally:
        master.stop()
