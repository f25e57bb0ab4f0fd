"""Issue 15: masters elect one leader through a real etcd; nodes and clients follow it without a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import EtcdServer, free_port, kvpool_process, metric, replayed_events, scrape, stop_process, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig
from kvpool.etcd import EtcdClient, EtcdTarget, LeaderInfo, leader_key
from kvpool.keys import opaque_key
from kvpool.master import MasterServer
from kvpool.master_client import leader_address
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

TTL_S = 2


def new_cluster() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def start_masters(etcd: EtcdServer, cluster: str, n: int) -> list[MasterServer]:
    return [MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0, etcd=etcd.endpoint, cluster=cluster,
                                      leader_ttl_s=TTL_S)).start() for _ in range(n)]


def the_leader(masters: list[MasterServer]) -> MasterServer | None:
    leading = [m for m in masters if m.election is not None and m.election.leading()]
    return leading[0] if len(leading) == 1 else None


class OverlapWatch:
    """Samples every 2 ms, from a thread, whether all ``masters`` lead at once (the no-split-brain invariant)."""

    def __init__(self, masters: list[MasterServer]):
        self.masters = masters
        self.both: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            if all(m.election is not None and m.election.leading() for m in self.masters):
                self.both.append(time.monotonic())
            time.sleep(0.002)

    def start(self) -> OverlapWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def info(address: str) -> master_pb2.MasterInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return master_pb2_grpc.MasterStub(channel).Info(master_pb2.MasterInfoRequest(), timeout=5)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_one_master_leads_and_the_standby_refuses_node_and_client_calls_saying_where_the_leader_is(etcd):
    masters = start_masters(etcd, new_cluster(), 2)
    try:
        leader = wait_until(lambda: the_leader(masters), timeout=15)
        standby = next(m for m in masters if m is not leader)
        assert info(leader.address).standby is False and info(standby.address).standby is True
        # the standby names the leader once its first poll read the key (it may start after the leader won)
        wait_until(lambda: info(standby.address).leader_address == leader.advertised_address(), timeout=10)
        assert health(leader.address) == health_pb2.HealthCheckResponse.SERVING
        assert health(standby.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert leader.registry.get_sample_value("kvpool_master_leader") == 1
        assert standby.registry.get_sample_value("kvpool_master_leader") == 0
        assert leader.registry.get_sample_value("kvpool_master_elections_total") == 1
        with grpc.insecure_channel(standby.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            for call, request in [
                (stub.Lookup, master_pb2.LookupRequest(keys=opaque_key("x"))),
                (stub.RegisterNode,
                 master_pb2.RegisterNodeRequest(node=common_pb2.NodeRef(node_id="n", address="a:1"))),
                (stub.ClusterStatus, master_pb2.ClusterStatusRequest()),
            ]:
                with pytest.raises(grpc.RpcError) as caught:
                    call(request, timeout=5)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert leader.advertised_address() in caught.value.details()
        assert standby.membership.node_count() == 0  # the RegisterNode changed nothing
        # The leader key names the leader; a client following the cluster dials it.
        client = EtcdClient([etcd.endpoint])
        try:
            assert leader_address(client, leader.config.cluster) == leader.advertised_address()
        finally:
            client.close()
    finally:
        for m in masters:
            m.stop()


def test_a_stopped_leader_resigns_and_the_standby_takes_over(etcd):
    masters = start_masters(etcd, new_cluster(), 2)
    try:
        leader = wait_until(lambda: the_leader(masters), timeout=15)
        standby = next(m for m in masters if m is not leader)
        leader.stop()
        assert wait_until(lambda: the_leader([standby]), timeout=15) is standby
        assert info(standby.address).standby is False
    finally:
        for m in masters:
            m.stop()


def test_a_newly_elected_masters_event_stream_clears_then_carries_its_own_index(etcd):
    """Issue 16 with HA: each master publishes its own stream; the one elected tells its subscribers to start
    from empty (AllBlocksCleared) and then publishes what its nodes report to it."""
    from kvpool.events import AllBlocksCleared, BlockStored, key_hash
    from kvpool.vocabulary import NodeRef, Tier

    cluster = new_cluster()
    masters = [MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0, etcd=etcd.endpoint, cluster=cluster,
                                         leader_ttl_s=TTL_S, kv_events_endpoint="tcp://127.0.0.1:0",
                                         kv_events_replay_endpoint="tcp://127.0.0.1:0")).start() for _ in range(2)]
    def stream(master: MasterServer) -> list[list]:
        """Every batch the master has published, by replay from 0 (events of each batch, in order)."""
        assert master.events is not None and master.events.publisher.replay_endpoint is not None
        return replayed_events(master.events.publisher.replay_endpoint)

    def report(master: MasterServer, tag: str) -> bytes:
        key = opaque_key(tag)
        number = master.membership.register(NodeRef(f"n-{tag}", "n.invalid:1"), [], 4096).number
        master.index.add(number, Tier.DRAM, [key], [4096], [0])
        return key

    try:
        leader = wait_until(lambda: the_leader(masters), timeout=15)
        standby = next(m for m in masters if m is not leader)
        old = report(leader, "before")
        assert wait_until(lambda: any(isinstance(e, BlockStored) and e.block_hashes == [key_hash(old)]
                                      for batch in stream(leader) for e in batch), timeout=10)
        assert all(isinstance(e, AllBlocksCleared) for batch in stream(standby) for e in batch)  # it held nothing
        leader.stop()
        assert wait_until(lambda: the_leader([standby]), timeout=15) is standby
        new = report(standby, "after")

        def cleared_then_stored() -> bool:
            events = [e for batch in stream(standby) for e in batch]
            clears = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
            stores = [i for i, e in enumerate(events)
                      if isinstance(e, BlockStored) and e.block_hashes == [key_hash(new)]]
            return len(clears) == 2 and len(stores) == 1 and clears[1] < stores[0]

        assert wait_until(cleared_then_stored, timeout=10)  # one clear at start, one at the election, then its own
    finally:
        for m in masters:
            m.stop()


def test_etcd_unreachable_the_leader_steps_down_within_its_lease_and_two_masters_never_lead_at_once(etcd):
    masters = start_masters(etcd, new_cluster(), 2)
    watch = OverlapWatch(masters).start()
    try:
        wait_until(lambda: the_leader(masters), timeout=15)
        etcd.pause()
        paused = time.monotonic()
        try:
            wait_until(lambda: not any(m.election is not None and m.election.leading() for m in masters),
                       timeout=TTL_S + 5, interval=0.01)
            stepped_down = time.monotonic() - paused
        finally:
            etcd.resume()
        # It stops leading by its own clock, before its lease can lapse in etcd: within the TTL of the pause.
        assert stepped_down <= TTL_S, f"the leader kept leading {stepped_down:.2f} s without etcd"
        wait_until(lambda: the_leader(masters), timeout=30)  # etcd back: one leads again
    finally:
        watch.stop()
        for m in masters:
            m.stop()
    assert watch.both == [], f"two masters led at once at {len(watch.both)} samples"


def test_a_killed_leader_is_replaced_and_a_node_and_a_client_follow_it_without_a_restart(etcd, tmp_path):
    cluster = new_cluster()
    target = f"etcd://{etcd.endpoint}/{cluster}"
    procs: dict[str, subprocess.Popen] = {}
    ports, metrics_ports = {}, {}
    for name in ("m1", "m2"):
        ports[name], metrics_ports[name] = free_port(), free_port()
        procs[name] = kvpool_process(
            "master", "--port", str(ports[name]), "--metrics-port", str(metrics_ports[name]),
            "--call-port", str(free_port()),
            "--etcd", f"http://{etcd.endpoint}", "--cluster", cluster, "--leader-ttl-s", str(TTL_S),
            log_path=tmp_path / f"{name}.log")
    arena = f"kvpool-test-ha-{uuid.uuid4().hex[:8]}"
    node = kvpool_process(
        "node", "--master", target, "--port", str(free_port()), "--metrics-port", "0", "--data-port", "0",
        "--node-id", "n1", "--arena", arena, "--dram-bytes", "16M", "--max-block-bytes", "64K", "--no-ssd",
        log_path=tmp_path / "node.log")
    etcd_client = EtcdClient([etcd.endpoint])
    pool = None
    try:
        def leading_name() -> str | None:
            address = leader_address(etcd_client, cluster)
            return next((n for n, p in ports.items() if address == f"127.0.0.1:{p}"), None)

        first = wait_until(leading_name, timeout=20)
        config = ClientConfig(master=target, shared_memory=False, lookup_timeout_s=1.0, io_timeout_s=2.0)
        pool = PoolClient(config)
        keys = [opaque_key(f"ha-{cluster}-{i}") for i in range(8)]
        values = [np.full(4096, i + 1, np.uint8) for i in range(8)]
        wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=20)
        assert pool.store(keys, values) == [True] * 8
        wait_until(pool.flush, timeout=20)  # False while the node's link is still sending its first report
        assert len(pool.lookup(keys)) == 8

        os.kill(procs[first].pid, signal.SIGKILL)
        killed = time.monotonic()
        hit_again = None
        while time.monotonic() - killed < 30:
            found = pool.lookup(keys)  # during the failover a miss, never an error
            if len(found) == 8:
                hit_again = time.monotonic() - killed
                break
            time.sleep(0.05)
        assert hit_again is not None, "lookups never hit again after the leader was killed"
        second = leading_name()
        assert second is not None and second != first
        assert info(f"127.0.0.1:{ports[second]}").standby is False
        outs = [np.zeros(4096, np.uint8) for _ in keys]
        assert pool.get_into(pool.lookup(keys), outs) == [True] * 8
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        assert node.poll() is None and pool.master.changes >= 1  # the same node process, followed
        # The new leader's failover metrics: from the old leader's last renewal it saw to its election, and from
        # the election to the node's inventory being whole. The lease outlived the kill by at least 2/3 TTL (the
        # last renewal came at most TTL/3 before it), less one standby poll (0.5 s) for seeing the key move.
        # A warm standby answers lookups from its election, so the node's re-sync may still be on its way: wait for it.
        def resynced() -> dict | None:
            samples = scrape(metrics_ports[second])
            return samples if metric(samples, "kvpool_master_failover_resync_seconds_count") >= 1 else None

        samples = wait_until(resynced, timeout=20)
        assert metric(samples, "kvpool_master_failover_seconds_count") == 1
        assert metric(samples, "kvpool_master_failover_resync_seconds_count") == 1
        elected_s = metric(samples, "kvpool_master_failover_seconds_sum")
        resync_s = metric(samples, "kvpool_master_failover_resync_seconds_sum")
        assert TTL_S * 2 / 3 - 0.5 <= elected_s <= hit_again + TTL_S / 3 + 0.5, (elected_s, hit_again)
        # The standby was warm (it followed the leader): lookups hit from its election, before the node re-synced.
        assert 0 < resync_s <= 5, (resync_s, hit_again)
        print(f"failover: lookups hit again {hit_again:.2f} s after kill -9 of the leader (TTL {TTL_S} s); "
              f"metrics: elected {elected_s:.2f} s after the last renewal, node resynced {resync_s:.2f} s later")
    finally:
        if pool is not None:
            pool.close()
        etcd_client.close()
        stop_process(node)
        for proc in procs.values():
            stop_process(proc)
        try:
            os.unlink(f"/dev/shm/{arena}")
        except FileNotFoundError:
            pass


def test_etcd_targets_parse_or_say_what_is_wrong():
    assert EtcdTarget.parse("127.0.0.1:7600") is None
    assert EtcdTarget.parse("etcd://a:2379,b:2380/prod") == EtcdTarget(("a:2379", "b:2380"), "prod")
    for bad in ["etcd://a:2379", "etcd://a/prod", "etcd://a:2379/pr/od", "etcd://a:2379/p r", "etcd:///prod"]:
        with pytest.raises(ValueError):
            EtcdTarget.parse(bad)
    with pytest.raises(ValueError, match="host:port"):
        ClientConfig(master="etcd://a/prod")
    assert leader_key("prod") == b"/kvpool/prod/master/leader"
    assert LeaderInfo.decode(b"not json") is None and LeaderInfo.decode(LeaderInfo("h:1", "x").encode()) == \
        LeaderInfo("h:1", "x")


def test_kvpool_status_shows_the_leader_the_standbys_and_etcd_health(etcd):
    import subprocess
    import sys

    cluster = new_cluster()
    masters = start_masters(etcd, cluster, 2)
    try:
        leader = wait_until(lambda: the_leader(masters), timeout=15)
        standby = next(m for m in masters if m is not leader)
        target = f"etcd://{etcd.endpoint}/{cluster}"

        def status() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", target],
                                  capture_output=True, text=True, timeout=60)

        # each master's member key appears within its first poll
        done = wait_until(lambda: (r := status()).returncode == 0 and standby.advertised_address() in r.stdout and r,
                          timeout=15)
        first = done.stdout.splitlines()[0]
        assert f"leader {leader.advertised_address()}" in first and f"standbys: {standby.advertised_address()}" in first
        assert f"etcd {etcd.endpoint}: etcd 3." in done.stdout
        assert "kvpool master" in done.stdout  # then the leader's own table
    finally:
        for m in masters:
            m.stop()
    nobody = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master",
                             f"etcd://{etcd.endpoint}/{new_cluster()}"], capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 1 and "leader NONE" in nobody.stdout


def test_a_leader_cut_off_from_etcd_is_replaced_and_never_overlaps_the_new_one(etcd):
    masters = start_masters(etcd, new_cluster(), 2)
    watch = OverlapWatch(masters).start()
    try:
        leader = wait_until(lambda: the_leader(masters), timeout=15)
        standby = next(m for m in masters if m is not leader)
        assert leader.election is not None
        # Partition the leader from etcd (and only it): its etcd client now dials a port nobody listens on.
        dead = EtcdClient([f"127.0.0.1:{free_port()}"], timeout_s=0.3)
        live, leader.election.etcd = leader.election.etcd, dead
        try:
            assert wait_until(lambda: the_leader([standby]), timeout=TTL_S * 4 + 5) is standby
            assert not leader.election.leading()
            assert info(leader.address).standby is True
        finally:
            leader.election.etcd = live
            dead.close()
    finally:
        watch.stop()
        for m in masters:
            m.stop()
    assert watch.both == [], f"two masters led at once at {len(watch.both)} samples"


def test_a_leader_key_no_election_wrote_does_not_block_elections(etcd):
    cluster = new_cluster()
    client = EtcdClient([etcd.endpoint])
    try:
        client.put(leader_key(cluster), b"garbage, and no lease")  # an operator's mistake, or another program
        masters = start_masters(etcd, cluster, 1)
        try:
            assert wait_until(lambda: the_leader(masters), timeout=15) is masters[0]
            assert leader_address(client, cluster) == masters[0].advertised_address()
        finally:
            masters[0].stop()
    finally:
        client.close()
