"""Issue 29, index shards: master groups of a sharded cluster over a real etcd, and real nodes reporting to them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest
from support import EtcdServer, free_port, kvpool_process, stop_process, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig
from kvpool.etcd import EtcdClient, LeaderInfo, leader_key
from kvpool.keys import opaque_key
from kvpool.master import MasterServer
from kvpool.master_client import DirectMaster
from kvpool.rpc import proto_tier
from kvpool.shards import ShardMap, read_shard_map, shard_map_key, shard_of
from kvpool.tcp import ConnectionPool
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.vocabulary import Tier

TTL_S = 2


def new_cluster() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def shard_master(etcd: EtcdServer, cluster: str, shard: int, shards: int = 2, **more) -> MasterServer:
    return MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0, etcd=etcd.endpoint, cluster=cluster,
                                        leader_ttl_s=TTL_S, shards=shards, shard=shard, **more)).start()


def leader_of(masters: list[MasterServer]) -> MasterServer | None:
    leading = [m for m in masters if m.election is not None and m.election.leading()]
    return leading[0] if len(leading) == 1 else None


def info(address: str) -> master_pb2.MasterInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return master_pb2_grpc.MasterStub(channel).Info(master_pb2.MasterInfoRequest(), timeout=5)


def etcd_leader(etcd: EtcdServer, cluster: str, shard: int) -> str | None:
    client = EtcdClient([etcd.endpoint])
    try:
        kv = client.get(leader_key(cluster, shard))
        held = LeaderInfo.decode(kv.value) if kv is not None else None
        return held.address if held is not None else None
    finally:
        client.close()


def test_each_shard_elects_its_own_leader_under_its_own_key_and_says_its_shard(etcd):
    cluster = new_cluster()
    groups = [[shard_master(etcd, cluster, shard) for _ in range(2)] for shard in range(2)]
    try:
        leaders = [wait_until(lambda g=g: leader_of(g), timeout=15) for g in groups]
        for shard, leader in enumerate(leaders):
            assert etcd_leader(etcd, cluster, shard) == leader.advertised_address()
            for m in groups[shard]:
                said = info(m.address)
                assert (said.shard, said.shard_count) == (shard, 2)
                assert m.registry.get_sample_value("kvpool_master_shard_info",
                                                   {"shard": str(shard), "shards": "2"}) == 1  # alerts count by it
        client = EtcdClient([etcd.endpoint])
        try:
            assert read_shard_map(client, cluster) == ShardMap(2)
        finally:
            client.close()
    finally:
        for m in [m for g in groups for m in g]:
            m.stop()


def test_a_master_started_with_another_shard_count_refuses_to_start(etcd):
    cluster = new_cluster()
    first = shard_master(etcd, cluster, 0, shards=2)
    try:
        with pytest.raises(ValueError, match="has 2 index shard.*started with 3"):
            shard_master(etcd, cluster, 1, shards=3)
        with pytest.raises(ValueError, match="has 2 index shard.*started with 1"):
            shard_master(etcd, cluster, 0, shards=1)
    finally:
        first.stop()


def test_the_cli_master_with_another_count_or_shards_without_etcd_refuses_in_one_line(etcd):
    from support import assert_refused

    cluster = new_cluster()
    first = shard_master(etcd, cluster, 0, shards=2)
    try:
        for flags, words in [
            (["--etcd", etcd.endpoint, "--cluster", cluster, "--shards", "3", "--shard", "0"],
             ("has 2 index shard(s)", "started with 3", "cannot change")),
            (["--shards", "2", "--shard", "1"], ("master.shards", "need etcd")),
            (["--etcd", etcd.endpoint, "--cluster", cluster, "--shards", "2", "--shard", "2"],
             ("master.shard", "is not a shard of 2")),
        ]:
            done = subprocess.run([sys.executable, "-m", "kvpool.cli", "master", "--port", "0", "--metrics-port", "0",
                                   "--call-port", "0", *flags], capture_output=True, text=True, timeout=60)
            assert_refused(done.returncode, done.stderr, "master", *words)
    finally:
        first.stop()


def test_one_shard_is_todays_cluster_no_shard_map_and_the_unsharded_leader_key(etcd):
    cluster = new_cluster()
    master = shard_master(etcd, cluster, 0, shards=1)
    try:
        wait_until(lambda: leader_of([master]), timeout=15)
        assert etcd_leader(etcd, cluster, 0) == master.advertised_address()
        assert leader_key(cluster, 0) == f"/kvpool/{cluster}/master/leader".encode()
        client = EtcdClient([etcd.endpoint])
        try:
            assert client.get(shard_map_key(cluster)) is None
        finally:
            client.close()
        said = info(master.address)
        assert (said.shard, said.shard_count) == (0, 1)
    finally:
        master.stop()


def keys_of(shard: int, n: int, tag: str = "k") -> list[bytes]:
    """``n`` keys of ``shard`` (of 2)."""
    found: list[bytes] = []
    i = 0
    while len(found) < n:
        key = opaque_key(f"{tag}{i}")
        i += 1
        if shard_of(key, 2) == shard:
            found.append(key)
    return found


def direct(master: MasterServer, pool: ConnectionPool | None) -> DirectMaster:
    return DirectMaster(master.address, pool=pool, timeout_s=5, max_message_bytes=8 << 20)


@pytest.mark.parametrize("fast", [False, True], ids=["grpc", "fast-calls"])
def test_a_report_carrying_another_shards_key_is_refused_and_changes_nothing(etcd, fast):
    cluster = new_cluster()
    master = shard_master(etcd, cluster, 1)
    pool = ConnectionPool(5.0) if fast else None
    api = direct(master, pool)
    try:
        wait_until(lambda: leader_of([master]), timeout=15)
        reply = api.register_node(master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeRef(node_id="n1", address="127.0.0.1:1")), timeout=5)
        mine, foreign = keys_of(1, 3), keys_of(0, 1)

        def report(keys: list[bytes], full_sync: bool = False,
                   removed: tuple[bytes, ...] = ()) -> master_pb2.ReportBlocksResponse:
            return api.report_blocks(master_pb2.ReportBlocksRequest(
                node_id="n1", incarnation=reply.incarnation, tier=proto_tier(Tier.DRAM), full_sync=full_sync,
                added_keys=b"".join(keys), added_sizes=[4096] * len(keys), added_checksums=[0] * len(keys),
                removed_keys=b"".join(removed)), timeout=5)

        assert report(mine[:2], full_sync=True).known
        for bad in (dict(keys=[mine[2], foreign[0]]), dict(keys=[foreign[0]], full_sync=True),
                    dict(keys=[], removed=(mine[0], foreign[0]))):
            with pytest.raises(grpc.RpcError) as caught:
                report(**bad)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "another index shard" in caught.value.details()
        present = api.exists(master_pb2.ExistsRequest(keys=b"".join(mine + foreign)), timeout=5).present
        assert list(present) == [1, 1, 0, 0]  # the refused reports added, replaced and removed nothing
        assert len(master.index) == 2
    finally:
        api.close()
        if pool is not None:
            pool.close()
        master.stop()


def start_node(etcd: EtcdServer, cluster: str, tmp_path, name: str = "n1", *more: str):
    arena = f"kvpool-test-shards-{uuid.uuid4().hex[:8]}"
    proc = kvpool_process(
        "node", "--master", f"etcd://{etcd.endpoint}/{cluster}", "--port", str(free_port()), "--metrics-port", "0",
        "--data-port", "0", "--node-id", name, "--arena", arena, "--dram-bytes", "16M", "--max-block-bytes", "64K",
        "--no-ssd", *more, log_path=tmp_path / f"{name}.log")
    return proc, arena


def unlink_arena(arena: str) -> None:
    try:
        os.unlink(f"/dev/shm/{arena}")
    except FileNotFoundError:
        pass


def present(master: MasterServer, keys: list[bytes]) -> list[int]:
    api = direct(master, None)
    try:
        return list(api.exists(master_pb2.ExistsRequest(keys=b"".join(keys)), timeout=5).present)
    finally:
        api.close()


def test_a_node_reports_each_key_to_its_shards_leader_only(etcd, tmp_path):
    cluster = new_cluster()
    groups = [[shard_master(etcd, cluster, shard) for _ in range(2)] for shard in range(2)]
    node, arena = start_node(etcd, cluster, tmp_path)
    pool = None
    try:
        leaders = [wait_until(lambda g=g: leader_of(g), timeout=15) for g in groups]
        # membership is replicated: each shard leader knows the node
        wait_until(lambda: all(m.membership.node_count() == 1 for m in leaders), timeout=20)
        pool = PoolClient(ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False))
        keys = [opaque_key(f"{cluster}-{i}") for i in range(32)]
        values = [np.full(4096, i + 1, np.uint8) for i in range(len(keys))]
        wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=20)
        assert pool.store(keys, values) == [True] * len(keys)
        wait_until(pool.flush, timeout=20)  # the node's FlushReports: every shard's link has sent its part
        owner = [shard_of(k, 2) for k in keys]
        assert 0 < sum(owner) < len(keys)  # both shards own some
        for shard, leader in enumerate(leaders):
            assert present(leader, keys) == [int(o == shard) for o in owner]
            assert len(leader.index) == owner.count(shard)
        # kvpool status lists every shard: its leader, its standby, the node and the shard's block count
        target = f"etcd://{etcd.endpoint}/{cluster}"

        def status() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", target],
                                  capture_output=True, text=True, timeout=60)

        standbys = [next(m for m in g if m is not leader) for g, leader in zip(groups, leaders)]
        shown = wait_until(lambda: (r := status()).returncode == 0
                           and all(m.advertised_address() in r.stdout for m in standbys) and r, timeout=15)
        for shard, (leader, standby) in enumerate(zip(leaders, standbys)):
            assert (f"masters of cluster {cluster} shard {shard} of 2: leader {leader.advertised_address()}; "
                    f"standbys: {standby.advertised_address()}") in shown.stdout
            assert (f"kvpool master {target} shard {shard}: 1 node(s), {owner.count(shard)} blocks indexed"
                    in shown.stdout)
        as_json = json.loads(subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", target,
                                             "--json"], capture_output=True, text=True, timeout=60).stdout)
        assert [(e["shard"], e["masters"]["leader"], e["cluster"]["indexed_blocks"]) for e in as_json["shards"]] \
            == [(k, leaders[k].advertised_address(), owner.count(k)) for k in range(2)]
    finally:
        if pool is not None:
            pool.close()
        stop_process(node)
        unlink_arena(arena)
        for m in [m for g in groups for m in g]:
            m.stop()


def test_each_shard_leader_publishes_the_kv_events_of_its_own_keys_only(etcd, tmp_path):
    """KV events across shards (docs/routing.md): one stream per shard leader, each naming the blocks of its own
    shard, so a subscriber of every shard's stream sees every block once."""
    from support import replayed_events

    from kvpool.events import BlockStored, key_hash

    cluster = new_cluster()
    masters = [shard_master(etcd, cluster, shard, kv_events_endpoint="tcp://127.0.0.1:0",
                            kv_events_replay_endpoint="tcp://127.0.0.1:0") for shard in range(2)]
    node, arena = start_node(etcd, cluster, tmp_path)
    pool = None
    try:
        for m in masters:
            wait_until(lambda m=m: leader_of([m]), timeout=15)
        wait_until(lambda: all(m.membership.node_count() == 1 for m in masters), timeout=20)
        pool = PoolClient(ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False))
        wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=20)
        keys = [opaque_key(f"{cluster}-ev-{i}") for i in range(24)]
        assert pool.store(keys, [np.full(4096, i, np.uint8) for i in range(len(keys))]) == [True] * len(keys)
        wait_until(pool.flush, timeout=20)
        expected = [{key_hash(k) for k in keys if shard_of(k, 2) == shard} for shard in range(2)]
        assert expected[0] and expected[1]

        def stored(m: MasterServer) -> set[bytes | int]:
            assert m.events is not None and m.events.publisher.replay_endpoint is not None
            return {h for batch in replayed_events(m.events.publisher.replay_endpoint) for e in batch
                    if isinstance(e, BlockStored) for h in e.block_hashes}

        for shard, m in enumerate(masters):
            assert wait_until(lambda m=m, shard=shard: stored(m) == expected[shard], timeout=10)
    finally:
        if pool is not None:
            pool.close()
        stop_process(node)
        unlink_arena(arena)
        for m in masters:
            m.stop()


def test_with_tenants_a_key_lands_in_the_shard_of_its_stored_key(etcd, tmp_path):
    """kvpool/shards.py's rule: the shard of a tenant's key is that of its stored key (masked), which the node
    reports and the master guards; a client of the tenant computes it from the mask its master's Info gives."""
    import secrets

    from kvpool.auth import mask_keys, tenant_mask

    node_token, client_token = secrets.token_hex(32), secrets.token_hex(32)
    # a secret whose mask for tenant "a" moves keys between 2 shards (it flips bit 0 of byte 7: the shard's bit)
    secret = next(s for s in (secrets.token_hex(32) for _ in range(1000))
                  if tenant_mask(bytes.fromhex(s), "a")[7] & 1)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"secret": secret, "node_tokens": [node_token],
                                "clients": {client_token: {"tenant": "a"}}}))
    cluster = new_cluster()
    leaders = [shard_master(etcd, cluster, shard, auth_file=str(auth)) for shard in range(2)]
    node, arena = start_node(etcd, cluster, tmp_path, "n1", "--auth-file", str(auth), "--token", node_token)
    pool = None
    apis: list[DirectMaster] = []
    try:
        for m in leaders:
            wait_until(lambda m=m: leader_of([m]), timeout=15)
        pool = PoolClient(ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False,
                                       token=client_token))
        keys = [opaque_key(f"{cluster}-t{i}") for i in range(32)]
        wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=20)
        assert pool.store(keys, [np.full(4096, i + 1, np.uint8) for i in range(len(keys))]) == [True] * len(keys)
        wait_until(pool.flush, timeout=20)
        apis = [DirectMaster(m.address, pool=None, timeout_s=5, max_message_bytes=8 << 20, token=client_token)
                for m in leaders]
        info_ = apis[0].info()
        assert info_ is not None and len(info_.tenant_mask) == 32
        stored = [shard_of(k, 2) for k in (mask_keys(key, info_.tenant_mask) for key in keys)]
        assert stored == [1 - shard_of(k, 2) for k in keys]  # this mask moves every key: the rule matters
        for shard, api in enumerate(apis):
            got = list(api.exists(master_pb2.ExistsRequest(keys=b"".join(keys)), timeout=5).present)
            assert got == [int(s == shard) for s in stored]
    finally:
        for api in apis:
            api.close()
        if pool is not None:
            pool.close()
        stop_process(node)
        unlink_arena(arena)
        for m in leaders:
            m.stop()


def test_a_node_started_while_etcd_is_unreachable_links_every_shard_once_it_answers(tmp_path):
    (tmp_path / "etcd").mkdir()
    own = EtcdServer(tmp_path / "etcd")
    cluster = new_cluster()
    masters = [shard_master(own, cluster, shard) for shard in range(2)]
    node, arena = None, ""
    try:
        for m in masters:
            wait_until(lambda m=m: leader_of([m]), timeout=15)
        own.pause()
        try:
            node, arena = start_node(own, cluster, tmp_path)
            log = tmp_path / "n1.log"
            wait_until(lambda: log.exists() and "cannot read the shard map" in log.read_text(), timeout=30)
            assert node.poll() is None  # the node runs, and waits for etcd
        finally:
            own.resume()
        wait_until(lambda: all(leader_of([m]) for m in masters), timeout=20)
        wait_until(lambda: all(m.membership.node_count() == 1 for m in masters), timeout=30)
    finally:
        if node is not None:
            stop_process(node)
            unlink_arena(arena)
        for m in masters:
            m.stop()
        own.stop()


def test_a_node_and_a_client_started_before_any_master_find_every_shard(etcd, tmp_path):
    """No shard map and no leader yet is not one shard: a node and a client made before the masters of a
    sharded cluster wait for the count (kvpool.shards.settled_shard_map), then link and split by shard. (Taking
    it for one shard, the node would report every key to shard 0, which refuses the other shard's keys.)"""
    cluster = new_cluster()
    target = f"etcd://{etcd.endpoint}/{cluster}"
    node, arena = start_node(etcd, cluster, tmp_path)
    pool = PoolClient(ClientConfig(master=target, shared_memory=False, lookup_timeout_s=2.0))
    masters: list[MasterServer] = []
    try:
        log = tmp_path / "n1.log"
        wait_until(lambda: log.exists() and "no master of" in log.read_text(), timeout=30)
        masters = [shard_master(etcd, cluster, shard) for shard in range(2)]
        for m in masters:
            wait_until(lambda m=m: leader_of([m]), timeout=15)
        wait_until(lambda: all(m.membership.node_count() == 1 for m in masters), timeout=30)
        keys = [opaque_key(f"{cluster}-early-{i}") for i in range(32)]
        wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=20)
        assert pool.store(keys, [np.full(4096, i, np.uint8) for i in range(len(keys))]) == [True] * len(keys)
        wait_until(pool.flush, timeout=20)
        owner = [shard_of(k, 2) for k in keys]
        for shard, m in enumerate(masters):
            assert present(m, keys) == [int(o == shard) for o in owner]
        assert wait_until(lambda: len(pool.lookup(keys)) == len(keys), timeout=10)  # the client splits now
        assert getattr(pool.master, "count", 1) == 2
    finally:
        pool.close()
        stop_process(node)
        unlink_arena(arena)
        for m in masters:
            m.stop()
