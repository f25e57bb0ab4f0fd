"""Issue 29, index shards from the client's side: a PoolClient and a ScoreClient on ``etcd://`` of a cluster of two
shard masters (real processes, real etcd, a real node) see one pool, and score as an unsharded cluster does."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import grpc
import numpy as np
from support import EtcdServer, free_port, kvpool_process, stop_process, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.etcd import EtcdClient
from kvpool.keys import opaque_key, pack_keys
from kvpool.master_client import MasterConnection, leader_address
from kvpool.routing import ScoreClient
from kvpool.sharded_master import ShardedMaster
from kvpool.shards import shard_of
from kvpool.v1 import master_pb2, node_pb2, node_pb2_grpc

BLOCKS = 32
BLOCK = 4096


class Cluster:
    """``shards`` master processes (one per shard) and one node, on ``etcd://.../CLUSTER``."""

    def __init__(self, etcd: EtcdServer, tmp: Path, shards: int):
        self.cluster = f"c-{uuid.uuid4().hex[:10]}"
        self.target = f"etcd://{etcd.endpoint}/{self.cluster}"
        self.procs: list[subprocess.Popen] = []
        for k in range(shards):
            self.procs.append(kvpool_process(
                "master", "--port", str(free_port()), "--metrics-port", "0", "--call-port", str(free_port()),
                "--etcd", f"http://{etcd.endpoint}", "--cluster", self.cluster, "--shards", str(shards),
                "--shard", str(k), log_path=tmp / f"{self.cluster}-m{k}.log"))
        client = EtcdClient([etcd.endpoint])
        try:
            for k in range(shards):
                wait_until(lambda k=k: leader_address(client, self.cluster, shard=k), timeout=30)
        finally:
            client.close()
        self.arena = f"kvpool-test-shc-{uuid.uuid4().hex[:8]}"
        self.node_port = free_port()
        self.procs.append(kvpool_process(
            "node", "--master", self.target, "--port", str(self.node_port), "--metrics-port", "0", "--data-port", "0",
            "--node-id", "n1", "--arena", self.arena, "--dram-bytes", "16M", "--max-block-bytes", "64K", "--no-ssd",
            log_path=tmp / f"{self.cluster}-node.log"))
        self.config = ClientConfig(master=self.target, shared_memory=False, lookup_timeout_s=2.0, io_timeout_s=5.0,
                                   worker_id="w1")
        self.pool = PoolClient(self.config)
        wait_until(lambda: self.pool.cluster.refresh() and len(self.pool.cluster.nodes()) == 1, timeout=30)

    def remove(self, key: bytes) -> None:
        """The node drops ``key`` (it then reports the removal to the key's shard)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.node_port}") as channel:
            assert node_pb2_grpc.NodeStub(channel).Remove(node_pb2.RemoveRequest(keys=key), timeout=5).removed == 1

    def close(self) -> None:
        self.pool.close()
        for proc in reversed(self.procs):
            stop_process(proc)
        Path(f"/dev/shm/{self.arena}").unlink(missing_ok=True)


def test_a_sharded_cluster_is_one_pool_to_its_clients_and_scores_as_one_shard_does(etcd, tmp_path):
    keys = [opaque_key(f"prompt-{i}") for i in range(BLOCKS)]
    values = [np.full(BLOCK, i + 1, np.uint8) for i in range(BLOCKS)]
    cut = [i for i, k in enumerate(keys) if shard_of(k, 2) == 1][4]  # a shard-1 block in the middle
    assert {shard_of(k, 2) for k in keys[:cut]} == {0, 1}
    clusters = {}
    try:
        for shards in (1, 2):
            clusters[shards] = c = Cluster(etcd, tmp_path, shards)
            # The one factory: today's connection for one shard, a ShardedMaster for two.
            assert isinstance(c.pool.master, MasterConnection if shards == 1 else ShardedMaster)
            assert c.pool.store(keys, values) == [True] * BLOCKS
            wait_until(c.pool.flush, timeout=30)  # False while the node's links still send their first reports
            run = c.pool.lookup(keys)
            assert len(run) == BLOCKS
            outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert c.pool.get_into(run, outs) == [True] * BLOCKS
            assert all(np.array_equal(o, v) for o, v in zip(outs, values))
            assert c.pool.exists(keys) == [True] * BLOCKS
            c.pool.report_hbm(keys[:5], [])  # worker w1 holds the first 5 blocks in HBM

        def scores() -> list:
            found = []
            for c in clusters.values():
                with ScoreClient(c.config) as router:
                    score = router.score(keys, ["w1", "cold"])
                    assert score is not None
                    found.append(score)
            return found

        one, two = scores()
        assert one == two
        assert [(w.hbm, w.dram, w.ssd) for w in two.workers] == [(5, BLOCKS - 5, 0), (0, BLOCKS, 0)]

        for c in clusters.values():
            c.remove(keys[cut])
            wait_until(lambda c=c: len(c.pool.lookup(keys)) == cut, timeout=30)  # the run ends at the dropped block
            assert c.pool.exists(keys) == [i != cut for i in range(BLOCKS)]
        one, two = scores()
        assert one == two
        assert [(w.hbm, w.dram) for w in two.workers] == [(5, cut - 5), (0, cut)]
        # The shard that holds the dropped block answered for it; shard 0 still holds its keys past the cut.
        sharded = clusters[2].pool.master
        assert isinstance(sharded, ShardedMaster)
        shard_0 = [k for k in keys if shard_of(k, 2) == 0]
        held = sharded.masters[0].exists(master_pb2.ExistsRequest(keys=pack_keys(shard_0)), 5).present
        assert list(held) == [1] * len(shard_0)

        # Hit counters: three lookups count the same on both clusters, each once, as its merged run (shard 0's own
        # run goes past the cut, and shard 1 never counts a part).
        def counted(c: Cluster) -> list[tuple[int, int, int]]:
            assert c.pool.flush(10)
            return [(s.lookups, s.requested_blocks, s.hit_blocks_dram) for s in (
                m.cluster_status(master_pb2.ClusterStatusRequest(), 5) for m in getattr(
                    c.pool.master, "masters", [c.pool.master]))]
        before = {n: counted(c) for n, c in clusters.items()}
        for c in clusters.values():
            for _ in range(3):
                assert len(c.pool.lookup(keys)) == cut
        after = {n: counted(c) for n, c in clusters.items()}
        delta = {n: [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after[n], before[n])] for n in clusters}
        assert delta[1] == [(3, 3 * BLOCKS, 3 * cut)]
        assert delta[2] == [(3, 3 * BLOCKS, 3 * cut), (0, 0, 0)]
    finally:
        for c in clusters.values():
            c.close()
