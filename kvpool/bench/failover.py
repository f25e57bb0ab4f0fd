"""``kvpool bench failover``: how long the pool misses after ``kill -9`` of the leading master.

Per index size N (``--blocks``): a real etcd (the ``etcd`` binary on PATH,
Debian's etcd-server), two ``kvpool master --etcd`` processes, one ``kvpool
node`` and this process's clients, all following ``etcd://.../CLUSTER``. N
blocks of ``--block-bytes`` are stored (same-host puts) until the leader's
index holds all N. With ``--node synthetic`` the node is instead this
process speaking the node protocol (register, heartbeat every second, report;
on "unknown", register again and send its full inventory in 65,536-key
chunks, as a node's link does) for N keys it holds no bytes of: a cheap way to
fill 10 million blocks, which a real arena (a 4 KiB slot each) could not hold
here. With ``--standby warm`` the standby follows the leader's log
(:mod:`kvpool.master.follower`) and the bench waits until its index holds the N
blocks too; ``cold`` is a standby that starts empty (``--no-warm-standby``:
the failover before issue 29). Then the leader is killed with SIGKILL and, from
that moment:

- **elected**: the leader key in etcd names the other master;
- **lookups hit**: a network-path client (every lookup asks the master) finds
  all of ``--sample`` keys spread over the N again;
- **index whole**: the node's full report to the new leader is in (its
  ``kvpool_master_failover_resync_seconds`` observed); before warm standbys
  this was also the first moment lookups hit.

Beside them, what the new leader's own metrics say:
``kvpool_master_failover_seconds`` (the old leader's last renewal it saw to
its election) and ``kvpool_master_failover_resync_seconds`` (the election to
the node's inventory being whole).

Bound (issue 15's aim): elected <= TTL + the standby's poll interval (the
killed leader's lease expires at most TTL after its last renewal), and the
whole failover <= 2 x TTL + the time the node's full report takes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from kvpool.etcd import EtcdClient
from kvpool.keys import BlockKey, opaque_key
from kvpool.master_client import leader_address

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", default="10000,1000000", help="comma-separated index sizes")
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--ttl", type=int, default=5, help="the masters' --leader-ttl-s")
    parser.add_argument("--sample", type=int, default=64, help="keys the lookup client checks")
    parser.add_argument("--standby", default="warm", help="comma-separated: warm, cold (default: %(default)s)")
    parser.add_argument("--node", choices=("real", "synthetic"), default="real",
                        help="a kvpool node process storing the blocks, or this process reporting keys only "
                             "(cheap fills of 10M blocks; default: %(default)s)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvpool(log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvpool.cli", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)


def _until(predicate: Callable[[], T], timeout: float, interval: float = 0.01) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def _start_etcd(tmp: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("etcd")
    if binary is None:
        raise SystemExit("kvpool bench failover: needs etcd (apt-get install etcd-server)")
    client, peer = f"127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [binary, "--name", "bench", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", f"http://{client}",
         "--advertise-client-urls", f"http://{client}", "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"bench={peer}"],
        stdout=open(tmp / "etcd.log", "wb"), stderr=subprocess.STDOUT)
    etcd = EtcdClient([client], timeout_s=1.0)

    def up() -> bool:
        try:
            return bool(etcd.status().version)
        except grpc.RpcError:
            return False

    try:
        _until(up, 30, 0.1)
    finally:
        etcd.close()
    return proc, client


class _SyntheticNode:
    """A pool node played by this process: it holds ``keys`` (no bytes) and keeps the leader's index of them whole,
    as a node's link does: a heartbeat every second; "unknown" or a new leader: register and full-sync."""

    CHUNK = 65536

    def __init__(self, leader: Callable[[], str | None], keys: list[BlockKey], block_bytes: int) -> None:
        import threading

        self._leader = leader
        self._packed = b"".join(keys)
        self._n = len(keys)
        self._block_bytes = block_bytes
        self._stop = threading.Event()
        self.incarnation = 0
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _SyntheticNode:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

        address, channel, stub = "", None, None
        while not self._stop.is_set():
            leader = self._leader()
            if not leader:
                self._stop.wait(0.05)
                continue
            if leader != address:
                if channel is not None:
                    channel.close()
                address = leader
                channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
                stub = master_pb2_grpc.MasterStub(channel)
                self.incarnation = 0
            assert stub is not None
            try:
                if self.incarnation and stub.Heartbeat(master_pb2.HeartbeatRequest(
                        node_id="bench", incarnation=self.incarnation), timeout=2).known:
                    self._stop.wait(1.0)
                    continue
                self.synced.clear()
                self.incarnation = stub.RegisterNode(master_pb2.RegisterNodeRequest(
                    node=common_pb2.NodeRef(node_id="bench", address="bench.invalid:7610"),
                    dram_max_block_bytes=self._block_bytes), timeout=5).incarnation
                for lo in range(0, max(self._n, 1), self.CHUNK):
                    hi = min(lo + self.CHUNK, self._n)
                    known = stub.ReportBlocks(master_pb2.ReportBlocksRequest(
                        node_id="bench", incarnation=self.incarnation, tier=common_pb2.TIER_DRAM,
                        full_sync=lo == 0, added_keys=self._packed[lo * 32 : hi * 32],
                        added_sizes=[self._block_bytes] * (hi - lo), added_checksums=[0] * (hi - lo),
                        sync_complete=hi == self._n), timeout=60).known
                    if not known:
                        raise RuntimeError("unknown mid-sync")
                self.synced.set()
            except (grpc.RpcError, RuntimeError):
                self.incarnation = 0
                self._stop.wait(0.1)


def measure(etcd_endpoint: str, tmp: Path, blocks: int, block_bytes: int, ttl: int, sample: int,
            synthetic: bool = False, warm: bool = True) -> dict:
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig
    from kvpool.metrics import scrape_samples
    from kvpool.v1 import master_pb2

    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    target = f"etcd://{etcd_endpoint}/{cluster}"
    ports = {name: _free_port() for name in ("a", "b")}
    metrics_ports = {name: _free_port() for name in ports}
    masters = {name: _kvpool(tmp / f"master-{name}-{blocks}.log", "master", "--port", str(port), "--metrics-port",
                             str(metrics_ports[name]), "--call-port", str(_free_port()), "--etcd", etcd_endpoint,
                             "--cluster", cluster, "--leader-ttl-s", str(ttl), "--max-keys-per-call", "65536",
                             "--warm-standby" if warm else "--no-warm-standby")
               for name, port in ports.items()}
    arena = f"kvpool-bench-failover-{os.getpid()}-{blocks}"
    dram = max(64 << 20, int(blocks * max(block_bytes, 4096) * 1.25))  # the arena has a slot per 4 KiB
    procs = list(masters.values())
    if not synthetic:
        procs.append(_kvpool(tmp / f"node-{blocks}.log", "node", "--master", target, "--port", str(_free_port()),
                             "--metrics-port", "0", "--data-port", "0", "--node-id", "bench", "--arena", arena,
                             "--dram-bytes", str(dram), "--max-block-bytes", str(block_bytes), "--no-ssd",
                             "--high-watermark", "0.99", "--low-watermark", "0.98"))
    etcd = EtcdClient([etcd_endpoint], timeout_s=1.0)
    synthetic_node: _SyntheticNode | None = None
    try:
        def leader() -> str | None:
            try:
                address = leader_address(etcd, cluster)
            except grpc.RpcError:
                return None
            return next((n for n, p in ports.items() if address == f"127.0.0.1:{p}"), None)

        first = _until(leader, 60)
        assert first is not None, "failover bench: no leader"
        standby = next(n for n in ports if n != first)
        writer = PoolClient(ClientConfig(master=target, lookup_timeout_s=5, io_timeout_s=30))
        reader = PoolClient(ClientConfig(master=target, shared_memory=False, lookup_timeout_s=1, io_timeout_s=5))
        try:
            started = time.monotonic()
            if synthetic:
                keys = _random_keys(blocks)

                def leader_address_now() -> str | None:
                    name = leader()
                    return f"127.0.0.1:{ports[name]}" if name else None

                synthetic_node = _SyntheticNode(leader_address_now, keys, block_bytes).start()
                _until(synthetic_node.synced.is_set, 1200, 0.1)
            else:
                _until(lambda: writer.cluster.refresh() and writer.cluster.nodes(), 60, 0.1)
                keys = [opaque_key(f"{cluster}-{i}") for i in range(blocks)]
                value = np.full(block_bytes, 7, np.uint8)
                for s in range(0, blocks, 2048):
                    batch = keys[s : s + 2048]
                    if not all(writer.store(batch, [value] * len(batch))):
                        raise RuntimeError("the pool refused blocks while filling")
                _until(writer.flush, 600, 0.1)
            fill_s = time.monotonic() - started

            def indexed() -> int:
                try:
                    return reader.master.cluster_status(master_pb2.ClusterStatusRequest(), 5).indexed_blocks
                except grpc.RpcError:
                    return 0

            _until(lambda: indexed() >= blocks, 600, 0.1)

            def standby_holds() -> bool:  # the warm standby's index holds every block too
                try:
                    values = {s.name: s.value for s in scrape_samples(metrics_ports[standby])}
                except OSError:  # busy applying a snapshot chunk: ask again
                    return False
                return values.get("kvpool_master_standby_warm") == 1 and values.get("kvpool_index_blocks", 0) >= blocks

            if warm:
                _until(standby_holds, 1200, 0.1)
            warm_s = time.monotonic() - started - fill_s
            probe = [keys[int(i)] for i in np.linspace(0, blocks - 1, min(sample, blocks))]
            if len(reader.lookup(probe)) != len(probe):
                raise RuntimeError("the sample does not hit before the failover")
            masters[first].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            elected = _until(lambda: (leader() not in (None, first)) and time.monotonic(), ttl * 4 + 30) - killed
            hit = _until(lambda: len(reader.lookup(probe)) == len(probe) and time.monotonic(), 120, 0.02) - killed
            second = leader()
            assert second is not None
            whole = _until(lambda: time.monotonic() if _failover_metrics(metrics_ports[second]) else 0.0, 300,
                           0.05) - killed
            said = _failover_metrics(metrics_ports[second])
            assert said is not None and indexed() >= blocks
        finally:
            writer.close()
            reader.close()
        return {"blocks": blocks, "standby": "warm" if warm else "cold", "ttl_s": ttl, "fill_s": fill_s,
                "warm_s": warm_s, "elected_s": elected, "hit_s": hit,
                "whole_s": whole, "metric_elected_s": said[0], "metric_resync_s": said[1]}
    finally:
        if synthetic_node is not None:
            synthetic_node.stop()
        etcd.close()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        try:
            os.unlink(f"/dev/shm/{arena}")
        except FileNotFoundError:
            pass


def _random_keys(n: int) -> list[BlockKey]:
    raw = np.random.default_rng(n).bytes(32 * n)
    return [BlockKey(raw[i : i + 32]) for i in range(0, len(raw), 32)]


def _failover_metrics(port: int) -> tuple[float, float] | None:
    """(failover, resync) seconds from a master's /metrics once both were observed; None before."""
    from kvpool.metrics import scrape_samples

    try:
        values = {s.name: s.value for s in scrape_samples(port)}
    except OSError:  # a busy master answered too slowly: None, ask again
        return None
    if not values.get("kvpool_master_failover_seconds_count") or \
            not values.get("kvpool_master_failover_resync_seconds_count"):
        return None
    return values["kvpool_master_failover_seconds_sum"], values["kvpool_master_failover_resync_seconds_sum"]


def run(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.blocks.split(",") if x]
    modes = [m for m in args.standby.split(",") if m]
    if not modes or set(modes) - {"warm", "cold"}:
        raise ValueError("--standby: warm, cold or both")
    with tempfile.TemporaryDirectory(prefix="kvpool-failover-") as tmp_name:
        tmp = Path(tmp_name)
        etcd_proc, endpoint = _start_etcd(tmp)
        try:
            rows = [measure(endpoint, tmp, n, args.block_bytes, args.ttl, args.sample, args.node == "synthetic",
                            mode == "warm") for n in sizes for mode in modes]
        finally:
            etcd_proc.terminate()
            etcd_proc.wait(30)
    print(f"kill -9 of the leading master; leader TTL {args.ttl} s; {args.node} node; blocks of "
          f"{args.block_bytes} B; seconds after the kill")
    print(f"{'blocks':>9s} {'standby':>7s} {'fill s':>7s} {'warm s':>7s} {'elected':>8s} {'lookups hit':>12s} "
          f"{'index whole':>12s} {'aim (warm): hit <= elected+1':>29s}   {'metrics: failover':>17s} {'resync':>7s}")
    for r in rows:
        verdict = ("ok    " if r["hit_s"] <= r["elected_s"] + 1.0 else "MISSED") if r["standby"] == "warm" else "-     "
        print(f"{r['blocks']:9d} {r['standby']:>7s} {r['fill_s']:7.1f} {r['warm_s']:7.1f} {r['elected_s']:8.2f} "
              f"{r['hit_s']:12.2f} {r['whole_s']:12.2f} {r['elected_s'] + 1.0:29.2f} {verdict} "
              f"{r['metric_elected_s']:17.2f} {r['metric_resync_s']:7.2f}")
    return 0
