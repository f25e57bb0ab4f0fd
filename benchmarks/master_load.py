"""One master's CPU and memory as the number of nodes and of clients grows (issue 15's scale figures).

    python benchmarks/master_load.py [--nodes 3,10,30,100,300] [--clients 4,16,64,256] [--seconds 20]

Per configuration, a fresh ``kvpool master`` process, and this process playing the rest over the real
protocols:

- **N nodes**: each registers over its own gRPC channel, heartbeats at the interval the master returned
  (1 s), and reports ``--node-adds`` new 4 KiB blocks a second as one ``ReportBlocks`` every 0.25 s (a
  node's coalesced reports; MasterLink sends the same messages);
- **C clients**: each on its own fast-call connection (``DirectMaster``, as ``PoolClient`` asks), one 64-key
  ``Lookup`` (half of the keys reported, half not) every ``1 / --client-rate`` s, open loop: a late call
  is not made up.

Measured over ``--seconds`` after a 3 s warm-up: the master's CPU (percent of one core, /proc), its RSS at
the end, the blocks in its index, the lookups answered against those asked, and the lookup p50/p99 the
clients saw. Nodes are swept with 4 clients, clients with 3 nodes. The load runs on the same 2 cores as
the master, so past one core of master CPU the figures show saturation, not a larger machine's limit.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from kvpool.master_client import DirectMaster
from kvpool.tcp import ConnectionPool
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

REPORT_S = 0.25
LOOKUP_KEYS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


class Nodes:
    """N simulated nodes driven from one thread with gRPC futures: heartbeats and block reports on schedule."""

    def __init__(self, address: str, n: int, adds_per_s: int, rng: np.random.Generator):
        self.channels = [grpc.insecure_channel(address) for _ in range(n)]
        self.stubs = [master_pb2_grpc.MasterStub(c) for c in self.channels]
        self.adds = max(1, round(adds_per_s * REPORT_S))
        self.rng = rng
        self.keys: list[bytes] = []  # every key reported (for the clients' lookups)
        self.failed = 0
        self.incarnations = []
        for i, stub in enumerate(self.stubs):
            ref = common_pb2.NodeRef(node_id=f"sim-{i}", address=f"sim-{i}.test:7610", host_id=f"h{i}",
                                     arena=f"a{i}")
            usage = [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=64 << 30)]
            reply = stub.RegisterNode(master_pb2.RegisterNodeRequest(node=ref, tiers=usage,
                                                                     dram_max_block_bytes=1 << 20), timeout=10)
            self.incarnations.append(reply.incarnation)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Nodes:
        self._thread.start()
        return self

    def _run(self) -> None:
        n = len(self.stubs)
        started = time.monotonic()
        tick = 0
        pending: list[grpc.Future] = []
        while not self._stop.is_set():
            tick += 1
            for i, stub in enumerate(self.stubs):
                packed = self.rng.integers(0, 256, (self.adds, 32), dtype=np.uint8).tobytes()
                self.keys.append(packed[:32])
                pending.append(stub.ReportBlocks.future(master_pb2.ReportBlocksRequest(
                    node_id=f"sim-{i}", incarnation=self.incarnations[i], tier=common_pb2.TIER_DRAM,
                    added_keys=packed, added_sizes=[4096] * self.adds, added_checksums=[1] * self.adds), timeout=10))
                if tick % round(1 / REPORT_S) == 0:
                    usage = [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=64 << 30)]
                    pending.append(stub.Heartbeat.future(master_pb2.HeartbeatRequest(
                        node_id=f"sim-{i}", incarnation=self.incarnations[i], tiers=usage), timeout=10))
            for future in pending[:-4 * n]:  # keep a few rounds in flight; count what failed
                if future.exception() is not None:
                    self.failed += 1
            pending = pending[-4 * n:]
            self._stop.wait(max(0.0, started + tick * REPORT_S - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.channels:
            c.close()


class Client(threading.Thread):
    """One simulated client: a 64-key Lookup every ``1 / rate`` s on its own fast-call connection."""

    def __init__(self, address: str, rate: float, nodes: Nodes, seed: int):
        super().__init__(daemon=True)
        self.address, self.period, self.nodes = address, 1.0 / rate, nodes
        self.rng = np.random.default_rng(seed)
        self.times: list[float] = []
        self.asked = 0
        self.failed = 0
        self.measuring = False
        self.stopping = threading.Event()

    def run(self) -> None:
        pool = ConnectionPool(5.0)
        fast = DirectMaster(self.address, pool=pool, timeout_s=5.0, max_message_bytes=64 << 20)
        try:
            next_at = time.monotonic() + self.rng.random() * self.period
            while not self.stopping.is_set():
                late = next_at - time.monotonic()
                if late > 0:
                    self.stopping.wait(late)
                next_at += self.period
                if next_at < time.monotonic():  # open loop: skip what could not be sent on time
                    next_at = time.monotonic() + self.period
                known = self.nodes.keys
                present = [known[int(i)] for i in self.rng.integers(0, len(known), LOOKUP_KEYS // 2)]
                absent = self.rng.integers(0, 256, (LOOKUP_KEYS // 2, 32), dtype=np.uint8).tobytes()
                request = master_pb2.LookupRequest(keys=b"".join(present) + absent, worker_id="sim")
                measuring = self.measuring
                t0 = time.perf_counter()
                try:
                    fast.lookup(request, 5)
                except grpc.RpcError:
                    self.failed += measuring
                    continue
                if measuring:
                    self.times.append(time.perf_counter() - t0)
                    self.asked += 1
        finally:
            fast.close()
        pool.close()


def measure(nodes_n: int, clients_n: int, args: argparse.Namespace, tmp: Path) -> dict:
    port, call_port = free_port(), free_port()
    master = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "master", "--port", str(port), "--metrics-port",
                               "0", "--call-port", str(call_port), "--node-timeout-s", "15"],
                              stdout=open(tmp / f"master-{nodes_n}-{clients_n}.log", "wb"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            status = master_pb2_grpc.MasterStub(channel).ClusterStatus
            nodes = Nodes(address, nodes_n, args.node_adds, np.random.default_rng(nodes_n)).start()
            while not nodes.keys:
                time.sleep(0.05)
            clients = [Client(address, args.client_rate, nodes, seed=i) for i in range(clients_n)]
            for c in clients:
                c.start()
            time.sleep(3)  # warm-up: connections made, threads started
            for c in clients:
                c.measuring = True
            cpu0, _ = proc_usage(master.pid)
            t0 = time.monotonic()
            time.sleep(args.seconds)
            for c in clients:
                c.measuring = False
            cpu1, rss = proc_usage(master.pid)
            wall = time.monotonic() - t0
            blocks = status(master_pb2.ClusterStatusRequest(), timeout=10).indexed_blocks
            for c in clients:
                c.stopping.set()
            for c in clients:
                c.join()
            nodes.stop()
        times = np.array([t for c in clients for t in c.times]) * 1e6
        return {"nodes": nodes_n, "clients": clients_n, "cpu_pct": 100 * (cpu1 - cpu0) / wall,
                "rss_mib": rss / (1 << 20), "blocks": blocks, "asked_per_s": clients_n * args.client_rate,
                "answered_per_s": len(times) / wall, "failed": sum(c.failed for c in clients) + nodes.failed,
                "p50_us": float(np.percentile(times, 50)) if len(times) else float("nan"),
                "p99_us": float(np.percentile(times, 99)) if len(times) else float("nan")}
    finally:
        master.terminate()
        master.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,10,30,100,300")
    parser.add_argument("--clients", default="4,16,64,256")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--node-adds", type=int, default=200, help="new blocks each node reports a second")
    parser.add_argument("--client-rate", type=float, default=5.0, help="lookups each client asks a second")
    args = parser.parse_args()
    configs = [(int(n), 4) for n in args.nodes.split(",") if n] + [(3, int(c)) for c in args.clients.split(",") if c]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpool-master-load-") as tmp:
        for n, c in dict.fromkeys(configs):
            rows.append(measure(n, c, args, Path(tmp)))
            r = rows[-1]
            print(f"nodes {r['nodes']:4d} clients {r['clients']:4d}: master CPU {r['cpu_pct']:5.1f}% RSS "
                  f"{r['rss_mib']:5.0f} MiB, {r['blocks']:8d} blocks; lookups {r['answered_per_s']:6.0f}/s of "
                  f"{r['asked_per_s']:6.0f}/s asked, p50 {r['p50_us']:6.0f} us p99 {r['p99_us']:7.0f} us; "
                  f"failed calls {r['failed']}", flush=True)
    print(f"\neach node reports {args.node_adds} new blocks/s and heartbeats at 1 Hz; each client asks "
          f"{args.client_rate:g} lookups/s of {LOOKUP_KEYS} keys; {args.seconds:g} s per row")
    print("| nodes | clients | master CPU % of a core | RSS MiB | index blocks | lookups/s answered / asked | "
          "lookup p50 / p99 us | failed calls |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['clients']} | {r['cpu_pct']:.0f} | {r['rss_mib']:.0f} | {r['blocks']:,} | "
              f"{r['answered_per_s']:.0f} / {r['asked_per_s']:.0f} | {r['p50_us']:.0f} / {r['p99_us']:.0f} | "
              f"{r['failed']} |")


if __name__ == "__main__":
    main()
