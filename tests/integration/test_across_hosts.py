"""Issue 15: the pool across separate hosts (network namespaces, tests/netns.py), with masters on two of them.

Three node hosts (DRAM 32, 64 and 96 MiB), two client hosts, two master hosts electing a leader through a
real etcd in the root namespace. Each host has its own /dev/shm and hostname, so clients use the network.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc
import pytest
from netns import Host, Hosts
from support import TESTS, EtcdServer, wait_until

from kvpool.etcd import EtcdClient
from kvpool.master_client import leader_address
from kvpool.status import cluster_status
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

CLUSTER = "across"
DRAM_MIB = {"n1": 32, "n2": 64, "n3": 96}
BLOCK = 64 << 10
BLOCKS = 240
CLIENT = str(TESTS / "netns_client.py")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("across")
    hosts = Hosts()
    etcd = None
    try:
        etcd = EtcdServer(tmp, host=hosts.gateway)
        target = f"etcd://{etcd.endpoint}/{CLUSTER}"
        for name in ("m1", "m2"):
            host = hosts.add(name)
            host.popen([sys.executable, "-m", "kvpool.cli", "master", "--host", "0.0.0.0", "--advertise-host",
                        host.address, "--port", "7600", "--metrics-port", "0", "--call-port", "7602", "--etcd",
                        f"http://{etcd.endpoint}", "--cluster", CLUSTER, "--leader-ttl-s", "2"],
                       tmp / f"{name}.log")
        for name, mib in DRAM_MIB.items():
            host = hosts.add(name)
            host.popen([sys.executable, "-m", "kvpool.cli", "node", "--master", target, "--host", "0.0.0.0",
                        "--advertise", f"{host.address}:7610", "--port", "7610", "--data-port", "7612",
                        "--metrics-port", "0", "--node-id", name, "--dram-bytes", f"{mib}M",
                        "--max-block-bytes", "64K", "--no-ssd"], tmp / f"{name}.log", shm_bytes=(mib + 16) << 20)
        for name in ("ca", "cb"):
            hosts.add(name)
        wait_until(lambda: live_nodes(target) == 3, timeout=60, interval=0.2)
        yield hosts, etcd, target, tmp
    finally:
        hosts.close()
        if etcd is not None:
            etcd.stop()


def live_nodes(target: str) -> int:
    try:
        return len(cluster_status(target, timeout=2).nodes)
    except ValueError:
        return 0


def client(hosts: Hosts, name: str, target: str, *args: str) -> dict:
    done = hosts.hosts[name].run([sys.executable, CLIENT, target, *args])
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def dram_blocks(target: str) -> dict[str, int]:
    """Blocks in each node's DRAM, as the leader's cluster view (the nodes' heartbeats) says."""
    status = cluster_status(target, timeout=5)
    return {n.node.node_id: sum(t.blocks for t in n.tiers if t.tier == common_pb2.TIER_DRAM) for n in status.nodes}


def master_info(address: str) -> master_pb2.MasterInfoResponse | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return master_pb2_grpc.MasterStub(channel).Info(master_pb2.MasterInfoRequest(), timeout=2)
    except grpc.RpcError:
        return None


def master_hosts(hosts: Hosts, reader: EtcdClient) -> tuple[Host, Host]:
    """(the leading master's host, the other master's host), as etcd says now."""
    leader = leader_address(reader, CLUSTER)
    old = next(h for h in hosts.hosts.values() if leader == f"{h.address}:7600")
    return old, next(h for h in hosts.hosts.values() if h.name in ("m1", "m2") and h is not old)


def test_blocks_spread_by_capacity_and_a_client_on_another_host_reads_what_one_wrote(pool):
    hosts, _, target, _ = pool
    put = client(hosts, "cb", target, "put", "spread", str(BLOCKS), str(BLOCK), "--nodes", "3")
    assert put == {"stored": BLOCKS, "flushed": True}
    got = client(hosts, "ca", target, "get", "spread", str(BLOCKS), str(BLOCK))
    assert got["found"] == BLOCKS and got["ok"] == BLOCKS
    held = wait_until(lambda: (b := dram_blocks(target)) and sum(b.values()) == BLOCKS and b, timeout=10)
    assert set(held) == set(DRAM_MIB) and all(n > 0 for n in held.values()), held
    assert held["n3"] > held["n1"], held  # placement weighs by capacity
    print(f"blocks per node (DRAM {DRAM_MIB} MiB): {held}")


def test_cutting_a_node_link_makes_its_blocks_misses_and_they_come_back_with_the_link(pool):
    hosts, _, target, _ = pool
    on_n1 = dram_blocks(target)["n1"]
    assert on_n1 > 0
    hosts.hosts["n1"].link(up=False)
    try:
        started = time.monotonic()
        got = client(hosts, "ca", target, "get", "spread", str(BLOCKS), str(BLOCK), "--io-timeout", "1")
        took = time.monotonic() - started
        assert got["ok"] == BLOCKS - on_n1, got  # the others still hit; n1's are misses, never errors
        assert took <= on_n1 * 1.0 + 15, f"{took:.1f} s: a miss cost more than the io timeout"
        print(f"with n1 cut: {got['ok']} of {BLOCKS} hit, the rest missed, in {took:.1f} s")
    finally:
        hosts.hosts["n1"].link(up=True)
    wait_until(lambda: client(hosts, "ca", target, "get", "spread", str(BLOCKS), str(BLOCK))["ok"] == BLOCKS,
               timeout=60, interval=0.5)


def test_cutting_the_leading_master_off_moves_leadership_and_the_pool_keeps_working(pool):
    hosts, etcd, target, _ = pool
    reader = EtcdClient([etcd.endpoint])
    try:
        old, other = master_hosts(hosts, reader)
        old.link(up=False)
        try:
            wait_until(lambda: leader_address(reader, CLUSTER) == f"{other.address}:7600", timeout=30)
            wait_until(lambda: live_nodes(target) == 3, timeout=60, interval=0.2)  # the nodes followed
            put = client(hosts, "cb", target, "put", "after", "48", str(BLOCK), "--nodes", "3")
            assert put == {"stored": 48, "flushed": True}
            assert client(hosts, "ca", target, "get", "after", "48", str(BLOCK))["ok"] == 48
            got = client(hosts, "ca", target, "get", "spread", str(BLOCKS), str(BLOCK))
            assert got["ok"] == BLOCKS  # the new leader's index, rebuilt from the nodes' full reports
        finally:
            old.link(up=True)
        # Back on the network, the old leader stands by: its lease is gone and the key is the new leader's.
        assert wait_until(lambda: (i := master_info(f"{old.address}:7600")) is not None and i, timeout=30).standby
        assert leader_address(reader, CLUSTER) == f"{other.address}:7600"
    finally:
        reader.close()


class LeaderWatch:
    """Asks both masters' Info every 20 ms from the root namespace; records any moment both said they lead."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.both = 0
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        try:
            stubs = [master_pb2_grpc.MasterStub(c) for c in channels]
            while not self._done.wait(0.02):
                try:
                    leading = [not s.Info(master_pb2.MasterInfoRequest(), timeout=1).standby for s in stubs]
                except grpc.RpcError:
                    continue
                self.samples += 1
                self.both += all(leading)
        finally:
            for c in channels:
                c.close()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def test_partitioning_only_the_leader_from_etcd_moves_leadership_and_the_pool_keeps_working(pool):
    """The old leader stays reachable by nodes and clients; only its etcd traffic is dropped. It must stand
    down by its own clock (never two leaders), the nodes must leave it for the new leader, and nothing is lost."""
    hosts, etcd, target, _ = pool
    reader = EtcdClient([etcd.endpoint])
    try:
        old, other = master_hosts(hosts, reader)
        etcd_host, etcd_port = etcd.endpoint.rsplit(":", 1)
        watch = LeaderWatch([f"{old.address}:7600", f"{other.address}:7600"])
        old.block(etcd_host, int(etcd_port))
        try:
            wait_until(lambda: leader_address(reader, CLUSTER) == f"{other.address}:7600", timeout=30)
            info = master_info(f"{old.address}:7600")  # still on the network, and it says so
            assert info is not None and info.standby and info.leader_address == ""
            wait_until(lambda: live_nodes(target) == 3, timeout=60, interval=0.2)
            put = client(hosts, "cb", target, "put", "etcd-cut", "48", str(BLOCK), "--nodes", "3")
            assert put == {"stored": 48, "flushed": True}
            assert client(hosts, "ca", target, "get", "etcd-cut", "48", str(BLOCK))["ok"] == 48
            assert client(hosts, "ca", target, "get", "spread", str(BLOCKS), str(BLOCK))["ok"] == BLOCKS
        finally:
            old.block(etcd_host, int(etcd_port), blocked=False)
            watch.stop()
        assert watch.samples > 50 and watch.both == 0, (watch.samples, watch.both)
        # With etcd back, the old leader reads who leads and stays a standby.
        assert wait_until(lambda: (i := master_info(f"{old.address}:7600")) is not None
                          and i.leader_address == f"{other.address}:7600" and i, timeout=30).standby
        assert leader_address(reader, CLUSTER) == f"{other.address}:7600"
    finally:
        reader.close()
