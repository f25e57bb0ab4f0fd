"""``kvpool bench failover``: how long the pool misses after ``kill -9`` of the leading master.

Per index size N (``--blocks``): a real etcd (the ``etcd`` binary on PATH,
Debian's etcd-server), two ``kvpool master --etcd`` processes, one ``kvpool
node`` and this process's clients, all following ``etcd://.../CLUSTER``. N
blocks of ``--block-bytes`` are stored (same-host puts) until the leader's
index holds all N; then the leader is killed with SIGKILL and, from that
moment:

- **elected**: the leader key in etcd names the other master;
- **lookups hit**: a network-path client (every lookup asks the master) finds
  all of ``--sample`` keys spread over the N again;
- **index whole**: the new leader's index holds all N blocks again (the
  node's full report is in).

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
from kvpool.keys import opaque_key
from kvpool.master_client import leader_address

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", default="10000,1000000", help="comma-separated index sizes")
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--ttl", type=int, default=5, help="the masters' --leader-ttl-s")
    parser.add_argument("--sample", type=int, default=64, help="keys the lookup client checks")


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


def measure(etcd_endpoint: str, tmp: Path, blocks: int, block_bytes: int, ttl: int, sample: int) -> dict:
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig
    from kvpool.v1 import master_pb2

    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    target = f"etcd://{etcd_endpoint}/{cluster}"
    ports = {name: _free_port() for name in ("a", "b")}
    metrics_ports = {name: _free_port() for name in ports}
    masters = {name: _kvpool(tmp / f"master-{name}-{blocks}.log", "master", "--port", str(port), "--metrics-port",
                             str(metrics_ports[name]), "--call-port", str(_free_port()), "--etcd", etcd_endpoint,
                             "--cluster", cluster, "--leader-ttl-s", str(ttl), "--max-keys-per-call", "65536")
               for name, port in ports.items()}
    arena = f"kvpool-bench-failover-{os.getpid()}-{blocks}"
    dram = max(64 << 20, int(blocks * max(block_bytes, 4096) * 1.25))  # the arena has a slot per 4 KiB
    node = _kvpool(tmp / f"node-{blocks}.log", "node", "--master", target, "--port", str(_free_port()),
                   "--metrics-port", "0", "--data-port", "0", "--node-id", "bench", "--arena", arena,
                   "--dram-bytes", str(dram), "--max-block-bytes", str(block_bytes), "--no-ssd",
                   "--high-watermark", "0.99", "--low-watermark", "0.98")
    etcd = EtcdClient([etcd_endpoint], timeout_s=1.0)
    procs = [*masters.values(), node]
    try:
        def leader() -> str | None:
            try:
                address = leader_address(etcd, cluster)
            except grpc.RpcError:
                return None
            return next((n for n, p in ports.items() if address == f"127.0.0.1:{p}"), None)

        first = _until(leader, 60)
        assert first is not None, "failover bench: no leader"
        writer = PoolClient(ClientConfig(master=target, lookup_timeout_s=5, io_timeout_s=30))
        reader = PoolClient(ClientConfig(master=target, shared_memory=False, lookup_timeout_s=1, io_timeout_s=5))
        try:
            _until(lambda: writer.cluster.refresh() and writer.cluster.nodes(), 60, 0.1)
            keys = [opaque_key(f"{cluster}-{i}") for i in range(blocks)]
            value = np.full(block_bytes, 7, np.uint8)
            started = time.monotonic()
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
            probe = [keys[int(i)] for i in np.linspace(0, blocks - 1, min(sample, blocks))]
            if len(reader.lookup(probe)) != len(probe):
                raise RuntimeError("the sample does not hit before the failover")
            masters[first].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            elected = _until(lambda: (leader() not in (None, first)) and time.monotonic(), ttl * 4 + 30) - killed
            hit = _until(lambda: len(reader.lookup(probe)) == len(probe) and time.monotonic(), 120, 0.02) - killed
            whole = _until(lambda: indexed() >= blocks and time.monotonic(), 300, 0.05) - killed
            second = leader()
            assert second is not None
            said = _until(lambda: _failover_metrics(metrics_ports[second]), 30, 0.1)
            assert said is not None
        finally:
            writer.close()
            reader.close()
        return {"blocks": blocks, "ttl_s": ttl, "fill_s": fill_s, "elected_s": elected, "hit_s": hit,
                "whole_s": whole, "metric_elected_s": said[0], "metric_resync_s": said[1]}
    finally:
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


def _failover_metrics(port: int) -> tuple[float, float] | None:
    """(failover, resync) seconds from a master's /metrics once both were observed; None before."""
    from kvpool.metrics import scrape_samples

    values = {s.name: s.value for s in scrape_samples(port)}
    if not values.get("kvpool_master_failover_seconds_count") or \
            not values.get("kvpool_master_failover_resync_seconds_count"):
        return None
    return values["kvpool_master_failover_seconds_sum"], values["kvpool_master_failover_resync_seconds_sum"]


def run(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.blocks.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="kvpool-failover-") as tmp_name:
        tmp = Path(tmp_name)
        etcd_proc, endpoint = _start_etcd(tmp)
        try:
            rows = [measure(endpoint, tmp, n, args.block_bytes, args.ttl, args.sample) for n in sizes]
        finally:
            etcd_proc.terminate()
            etcd_proc.wait(30)
    print(f"kill -9 of the leading master; leader TTL {args.ttl} s; blocks of {args.block_bytes} B; seconds after "
          "the kill")
    print(f"{'blocks':>9s} {'fill s':>7s} {'elected':>8s} {'lookups hit':>12s} {'index whole':>12s} "
          f"{'aim 2xTTL+report':>17s}   {'metrics: failover':>17s} {'resync':>7s}")
    for r in rows:
        report = r["whole_s"] - r["elected_s"]
        aim = 2 * r["ttl_s"] + report
        verdict = "ok    " if r["whole_s"] <= aim else "MISSED"
        print(f"{r['blocks']:9d} {r['fill_s']:7.1f} {r['elected_s']:8.2f} {r['hit_s']:12.2f} {r['whole_s']:12.2f} "
              f"{aim:17.2f} {verdict} {r['metric_elected_s']:17.2f} {r['metric_resync_s']:7.2f}")
    return 0
