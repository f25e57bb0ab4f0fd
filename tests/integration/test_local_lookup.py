"""Lookups with no round trip: a client whose pool nodes are all on its host answers from their arenas (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.master.server import MasterServer
from kvpool.master_client import MasterConnection
from kvpool.node.daemon import PoolNode
from kvpool.v1 import master_pb2
from kvpool.vocabulary import Tier
from kvpool.wire import MASTER_CALLS

BLOCK = 64 << 10


def key(i: int) -> BlockKey:
    return opaque_key(f"local-lookup-{i}")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def cluster(tmp_path, arena_name):
    """A master and two same-host nodes with small DRAM (blocks move to SSD) and an SSD tier each."""
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    nodes = []
    try:
        for i in range(2):
            cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                             arena=f"{arena_name}-{i}", node_id=f"n{i}", dram_bytes=8 * BLOCK, max_block_bytes=BLOCK,
                             ssd_dir=str(tmp_path / f"ssd{i}"), ssd_bytes=64 << 20)
            nodes.append(PoolNode(cfg).start())
        wait_until(lambda: all(n.link.registered for n in nodes))
        yield master, nodes
    finally:
        for n in nodes:
            n.stop()
        master.stop()


def master_calls(monkeypatch: pytest.MonkeyPatch, pool: PoolClient) -> list[str]:
    """The names of the fast-call-capable methods the client calls on the master from now on."""
    names: list[str] = []
    call = MasterConnection.call

    def logged(master, name, request, timeout):
        if master is pool.master and name in MASTER_CALLS:
            names.append(name)
        return call(master, name, request, timeout)

    monkeypatch.setattr(MasterConnection, "call", logged)
    return names


def master_lookup(master: MasterServer, keys: list[BlockKey]) -> master_pb2.LookupResponse:
    return master.servicer.Lookup(master_pb2.LookupRequest(keys=pack_keys(keys)), None)


def test_a_same_host_lookup_reads_the_arenas_and_answers_as_the_master_does(cluster, monkeypatch):
    master, nodes = cluster
    keys = [key(i) for i in range(40)]
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store(keys[:30], [block(i) for i in range(30)]) == [True] * 30  # 16 DRAM slots: most go to SSD
        calls = master_calls(monkeypatch, pool)
        run = pool.lookup(keys)  # straight after the put: the arenas know before the master does
        assert len(run) == 30 and calls == []
        assert set(run.tiers) == {Tier.DRAM, Tier.SSD}  # both tiers answered
        assert pool.exists(keys) == [True] * 30 + [False] * 10 and calls == []
        assert pool.flush()
        theirs = master_lookup(master, keys)
        by_node = {n.node_id: n for n in theirs.nodes}
        assert list(run.tiers) == list(theirs.tiers)
        assert [run.nodes[int(i)].node_id for i in run.node_indexes] == \
            [theirs.nodes[i].node_id for i in theirs.node_indexes]
        assert run.sizes.tolist() == list(theirs.sizes) and run.checksums.tolist() == list(theirs.checksums)
        assert set(by_node) == {"n0", "n1"}
        outs = [np.empty(BLOCK, dtype=np.uint8) for _ in range(30)]
        assert pool.get_into(run, outs) == [True] * 30  # SSD blocks promoted and read, every byte checked
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
        gap = keys[:5] + [key(99)] + keys[5:10]
        assert len(pool.lookup(gap)) == 5  # the leading run ends at the first miss


def test_lookups_answered_locally_are_counted_by_the_master(cluster):
    master, _ = cluster
    keys = [key(i) for i in range(10)]
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store(keys[:6], [block(i) for i in range(6)]) == [True] * 6
        before = master.servicer.ClusterStatus(master_pb2.ClusterStatusRequest(), None)
        for _ in range(3):
            assert len(pool.lookup(keys, hbm_prefix_blocks=2, block_tokens=16)) == 6
    # close sent what was left: 3 lookups of 2 HBM + 10 pool blocks each, 6 hits in the pool each
    wait_until(lambda: master.servicer.ClusterStatus(master_pb2.ClusterStatusRequest(), None).lookups
               >= before.lookups + 3)
    after = master.servicer.ClusterStatus(master_pb2.ClusterStatusRequest(), None)
    assert after.lookups - before.lookups == 3
    assert after.requested_blocks - before.requested_blocks == 3 * 12
    assert after.hit_blocks_hbm - before.hit_blocks_hbm == 3 * 2
    assert (after.hit_blocks_dram + after.hit_blocks_ssd) - (before.hit_blocks_dram + before.hit_blocks_ssd) == 18


@pytest.mark.parametrize("why", ["another_host", "incomplete", "no_shared_memory"])
def test_a_lookup_the_arenas_cannot_answer_whole_asks_the_master(cluster, monkeypatch, why):
    master, nodes = cluster
    keys = [key(i) for i in range(8)]
    config = ClientConfig(master=master.address, strict=True, shared_memory=why != "no_shared_memory")
    with PoolClient(config) as pool:
        assert pool.store(keys[:4], [block(i) for i in range(4)]) == [True] * 4
        assert pool.flush()
        if why == "another_host":  # as if the nodes were elsewhere: the view no longer says all are here
            monkeypatch.setattr(pool.nodes, "host_id", "another-host")
        elif why == "incomplete":  # n1 could not keep its inventory true: nobody may take it for the truth
            nodes[1].store.dram.arena.inventory_lost()
        calls = master_calls(monkeypatch, pool)
        assert len(pool.lookup(keys)) == 4
        assert pool.exists(keys) == [True] * 4 + [False] * 4
        assert calls == ["Lookup", "Exists"]


def test_a_node_restarted_under_its_arena_name_is_never_named_by_a_stale_view(tmp_path, arena_name):
    """The view still names the node's old address when its new segment appears under the same arena name: the
    answer must come from the master (the new address), never the old address with the new arena's blocks."""
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()

    def node() -> PoolNode:
        cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                         arena=arena_name, node_id="n0", dram_bytes=8 * BLOCK, max_block_bytes=BLOCK,
                         write_through=True, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=64 << 20)
        return PoolNode(cfg).start()

    keys = [key(i) for i in range(6)]
    try:
        first = node()
        wait_until(lambda: first.link.registered)
        with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
            assert pool.store(keys, [block(i) for i in range(6)]) == [True] * 6  # on SSD too: they survive
            assert len(pool.lookup(keys)) == 6
            old = first.address
            first.stop()
            second = node()  # another port, the same arena name: a new segment
            try:
                wait_until(lambda: second.link.registered)
                assert second.address != old
                run = pool.lookup(keys)  # the view (taken before the restart) is not a second old yet
                assert len(run) == 6 and {n.address for n in run.nodes} == {second.address}
                outs = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
                assert pool.get_into(run, outs) == [True] * 6
                assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
            finally:
                second.stop()
    finally:
        master.stop()
