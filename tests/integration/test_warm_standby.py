"""Issue 29 item 4: warm standbys. A standby follows its leader's accepted changes and, elected, leads with the
index: lookups hit before any node re-reports; the nodes' re-syncs then reconcile it.

Real etcd and real master processes. The pool node is this test, speaking the node protocol over gRPC: it is the
node that is "paused" (it sends nothing until the test says), so the tests can tell what the new leader knew
before any node re-registered or re-synced.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence

import grpc
import pytest
from support import EtcdServer, free_port, kvpool_process, metric, scrape, stop_process, wait_serving, wait_until

from kvpool.auth import Authority
from kvpool.etcd import EtcdClient
from kvpool.keys import BlockKey, pack_keys
from kvpool.master_client import leader_address
from kvpool.rpc import make_channel
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

TTL_S = 2
DRAM = common_pb2.TIER_DRAM


def keys(tag: str, n: int) -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


class Cluster:
    """Two master processes of one cluster on etcd, and where each listens."""

    def __init__(self, etcd: EtcdServer, tmp_path, *flags: str) -> None:
        self.name = f"w-{uuid.uuid4().hex[:10]}"
        self.etcd = EtcdClient([etcd.endpoint])
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.metrics: dict[str, int] = {}
        for name in ("m1", "m2"):
            self.ports[name], self.metrics[name] = free_port(), free_port()
            self.procs[name] = kvpool_process(
                "master", "--port", str(self.ports[name]), "--metrics-port", str(self.metrics[name]),
                "--call-port", str(free_port()), "--etcd", f"http://{etcd.endpoint}", "--cluster", self.name,
                "--leader-ttl-s", str(TTL_S), "--node-timeout-s", "60", *flags, log_path=tmp_path / f"{name}.log")
        for name in self.ports:  # a standby's health says NOT_SERVING: wait for its metrics instead
            wait_until(lambda n=name: self._scrapes(n), timeout=20)

    def _scrapes(self, name: str) -> bool:
        assert self.procs[name].poll() is None, f"master {name} exited"
        try:
            return bool(scrape(self.metrics[name]))
        except OSError:
            return False

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def leader(self) -> str | None:
        address = leader_address(self.etcd, self.name)
        return next((n for n in self.ports if self.address(n) == address), None)

    def other(self, name: str) -> str:
        return next(n for n in self.ports if n != name)

    def warm(self, name: str) -> bool:
        return metric(scrape(self.metrics[name]), "kvpool_master_standby_warm") == 1

    def applied(self, name: str) -> float:
        return metric(scrape(self.metrics[name]), "kvpool_master_standby_changes")

    def close(self) -> None:
        self.etcd.close()
        for proc in self.procs.values():
            stop_process(proc)


class TestNode:
    """A pool node driven by the test: it registers, reports and heartbeats only when told."""

    __test__ = False

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.incarnation = 0

    @staticmethod
    def stub(address: str) -> master_pb2_grpc.MasterStub:
        return master_pb2_grpc.MasterStub(grpc.insecure_channel(address))

    def register(self, address: str) -> int:
        reply = self.stub(address).RegisterNode(master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeRef(node_id=self.node_id, address="127.0.0.1:1"), dram_max_block_bytes=1 << 20),
            timeout=5)
        self.incarnation = reply.incarnation
        return reply.incarnation

    def report(self, address: str, added: Sequence[BlockKey] = (), removed: Sequence[BlockKey] = (), *,
               full_sync: bool = False) -> bool:
        return self.stub(address).ReportBlocks(master_pb2.ReportBlocksRequest(
            node_id=self.node_id, incarnation=self.incarnation, tier=DRAM, full_sync=full_sync,
            added_keys=pack_keys(list(added)), added_sizes=[4096] * len(added),
            added_checksums=[7] * len(added), removed_keys=pack_keys(list(removed)), sync_complete=full_sync),
            timeout=5).known

    def heartbeat(self, address: str) -> bool:
        return self.stub(address).Heartbeat(
            master_pb2.HeartbeatRequest(node_id=self.node_id, incarnation=self.incarnation), timeout=5).known


def run_of(address: str, asked: list[BlockKey]) -> int:
    """How many of ``asked``, from the first, a Lookup at ``address`` hits."""
    reply = TestNode.stub(address).Lookup(master_pb2.LookupRequest(keys=pack_keys(asked)), timeout=5)
    return len(reply.tiers)


def present(address: str, asked: list[BlockKey]) -> list[bool]:
    reply = TestNode.stub(address).Exists(master_pb2.ExistsRequest(keys=pack_keys(asked)), timeout=5)
    return [bool(b) for b in reply.present]


def leading(address: str) -> bool:
    try:
        return not TestNode.stub(address).Info(master_pb2.MasterInfoRequest(), timeout=2).standby
    except grpc.RpcError:
        return False


def test_an_elected_warm_standby_hits_at_once_and_the_nodes_resync_reconciles_it(etcd, tmp_path):
    cluster = Cluster(etcd, tmp_path)
    node = TestNode("n1")
    try:
        first = wait_until(cluster.leader, timeout=20)
        standby = cluster.other(first)
        held, gone, late = keys("held", 300), keys("gone", 1)[0], keys("late", 20)
        node.register(cluster.address(first))
        assert node.report(cluster.address(first), held + [gone], full_sync=True)
        wait_until(lambda: cluster.warm(standby), timeout=20)  # its snapshot taken (before or after that report)
        assert node.report(cluster.address(first), held[:10])  # a repeat, after the snapshot: followed from the log
        wait_until(lambda: cluster.applied(standby) >= 1, timeout=20)

        # The standby stops pulling; the leader accepts a removal and new blocks it will never see; kill -9.
        os.kill(cluster.procs[standby].pid, signal.SIGSTOP)
        try:
            assert node.report(cluster.address(first), late, [gone])
            assert present(cluster.address(first), [gone, late[0]]) == [False, True]
            os.kill(cluster.procs[first].pid, signal.SIGKILL)
            cluster.procs[first].wait()
        finally:
            os.kill(cluster.procs[standby].pid, signal.SIGCONT)
        killed = time.monotonic()
        wait_until(lambda: leading(cluster.address(standby)), timeout=30, interval=0.02)
        elected_s = time.monotonic() - killed
        address = cluster.address(standby)

        # The node has sent the new leader nothing yet: lookups hit from the followed index at once.
        assert run_of(address, held) == len(held)
        assert present(address, late) == [False] * len(late)  # accepted after the last pull: not known yet
        assert present(address, [gone]) == [True]  # removed after the last pull: still claimed until the re-sync

        # The node's next heartbeat is refused (it must re-register and re-sync); its entries stay meanwhile.
        assert node.heartbeat(address) is False
        old = node.incarnation
        assert node.register(address) != old
        assert run_of(address, held) == len(held)
        # The full sync (what the node holds now) replaces the inherited entries.
        assert node.report(address, held + late, full_sync=True)
        assert present(address, [gone]) == [False]
        assert run_of(address, held + late) == len(held) + len(late)
        assert node.heartbeat(address) is True
        samples = scrape(cluster.metrics[standby])
        assert metric(samples, "kvpool_master_standby_snapshots") == 1
        print(f"\nwarm failover: elected {elected_s:.2f} s after kill -9 (TTL {TTL_S} s); "
              f"{len(held)} blocks hit before the node re-registered")
    finally:
        cluster.close()


def test_a_standby_too_far_behind_takes_a_snapshot_again_and_ends_correct(etcd, tmp_path):
    cluster = Cluster(etcd, tmp_path, "--follow-log-bytes", "8K")  # ~150 reported keys
    node = TestNode("n2")
    try:
        first = wait_until(cluster.leader, timeout=20)
        standby = cluster.other(first)
        node.register(cluster.address(first))
        base = keys("base", 50)
        assert node.report(cluster.address(first), base, full_sync=True)
        wait_until(lambda: cluster.warm(standby), timeout=20)
        assert metric(scrape(cluster.metrics[standby]), "kvpool_master_standby_snapshots") == 1

        os.kill(cluster.procs[standby].pid, signal.SIGSTOP)
        try:  # more changes than the leader's log keeps
            batches = [keys(f"burst-{i}", 40) for i in range(10)]
            for batch in batches:
                assert node.report(cluster.address(first), batch)
            assert node.report(cluster.address(first), [], base[:5])
        finally:
            os.kill(cluster.procs[standby].pid, signal.SIGCONT)
        wait_until(lambda: metric(scrape(cluster.metrics[standby]), "kvpool_master_standby_snapshots") == 2,
                   timeout=20)
        wait_until(lambda: cluster.warm(standby), timeout=20)

        os.kill(cluster.procs[first].pid, signal.SIGKILL)
        cluster.procs[first].wait()
        address = cluster.address(standby)
        wait_until(lambda: leading(address), timeout=30, interval=0.02)
        every = [k for batch in batches for k in batch]
        assert run_of(address, base[5:] + every) == 45 + len(every)  # the snapshot's and the log's changes
        assert present(address, base[:5]) == [False] * 5
    finally:
        cluster.close()


def test_only_a_master_may_follow(tmp_path):
    node_token, client_token = secrets.token_hex(32), secrets.token_hex(32)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"secret": secrets.token_hex(32), "node_tokens": [node_token],
                                "clients": {client_token: {"tenant": "a"}}}))
    port = free_port()
    proc = kvpool_process("master", "--port", str(port), "--metrics-port", "0", "--call-port", str(free_port()),
                          "--auth-file", str(auth), log_path=tmp_path / "master.log")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc=proc)
        master_token = Authority.load(str(auth)).master_token()
        for token, code in ((client_token, grpc.StatusCode.PERMISSION_DENIED),
                            (node_token, grpc.StatusCode.PERMISSION_DENIED),
                            ("", grpc.StatusCode.UNAUTHENTICATED)):
            with make_channel(address, max_message_bytes=4 << 20, token=token) as channel:
                stub = master_pb2_grpc.MasterStub(channel)
                for call, request in ((stub.Follow, master_pb2.FollowRequest()),
                                      (stub.Snapshot, master_pb2.SnapshotRequest())):
                    with pytest.raises(grpc.RpcError) as caught:
                        call(request, timeout=5)
                    assert caught.value.code() == code, (token[:4], caught.value.details())
        with make_channel(address, max_message_bytes=4 << 20, token=master_token) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            assert stub.Follow(master_pb2.FollowRequest(), timeout=5).changes == []
            # ...and the master token is good for nothing else: no tenant's keys through it
            with pytest.raises(grpc.RpcError) as caught:
                stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(keys("x", 1))), timeout=5)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        stop_process(proc)
