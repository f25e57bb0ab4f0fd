"""Scale figures across separate hosts (network namespaces, tests/netns.py): issue 15.

    python benchmarks/across_hosts.py [--block-mib 1] [--blocks 48] [--lookup-blocks 1000000]   # root; ~5 min

1. Aggregate throughput: one `kvpool master` host, N node hosts (1, 2, 3) and C client hosts (1, 2, 4);
   every client puts ``--blocks`` blocks of ``--block-mib`` MiB under its own prefix, all starting at one
   moment, then gets them back (16 a call). Aggregate GB/s = all bytes / (last end - common start). The
   master's CPU seconds and RSS growth over each configuration are read from /proc.
2. Lookup latency with ``--lookup-blocks`` 4 KiB blocks spread over 3 node hosts (4 client hosts fill
   it): p50 / p99 of 64-key lookups from a client host (the master answers every one: other hosts'
   arenas cannot be mapped).

All hosts share this machine's cores (2 here): the figures say how the pool scales in processes and
connections on one box, not across real NICs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the namespace harness the tests use
from netns import Hosts  # noqa: E402

CLIENT = str(HERE.parent / "tests" / "netns_client.py")


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def start_pool(hosts: Hosts, tmp: Path, nodes: int, dram_mib: int, block_bytes: int) -> tuple[str, int]:
    master_host = hosts.add("m")
    master = master_host.popen([sys.executable, "-m", "kvpool.cli", "master", "--host", "0.0.0.0", "--port",
                                "7600", "--metrics-port", "0", "--call-port", "7602"], tmp / "master.log")
    address = f"{master_host.address}:7600"
    for i in range(nodes):
        host = hosts.add(f"n{i}")
        host.popen([sys.executable, "-m", "kvpool.cli", "node", "--master", address, "--host", "0.0.0.0",
                    "--advertise", f"{host.address}:7610", "--port", "7610", "--data-port", "7612", "--metrics-port",
                    "0", "--node-id", f"n{i}", "--dram-bytes", f"{dram_mib}M", "--max-block-bytes",
                    # the tmpfs holds the arena: its data and its slot table
                    str(block_bytes), "--no-ssd"], tmp / f"n{i}.log", shm_bytes=(dram_mib * 5 // 4 + 256) << 20)
    return address, master.pid


def wait_nodes(master: str, n: int, tmp: Path, timeout: float = 180) -> None:
    """Until the master lists ``n`` nodes (big arenas take a while to create); the logs if it never does."""
    from kvpool.status import cluster_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(cluster_status(master, timeout=2).nodes) >= n:
                return
        except ValueError:
            pass
        time.sleep(0.5)
    logs = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp.glob("*.log")))
    raise RuntimeError(f"the master never listed {n} nodes:\n{logs}")


def run_clients(hosts: Hosts, names: list[str], args_for: list[list[str]]) -> list[dict]:
    setup = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$@\""
    procs = [subprocess.Popen(["ip", "netns", "exec", hosts.hosts[n].ns, "unshare", "--mount", "--uts",
                               "--propagation", "private", "sh", "-c", setup, "sh", sys.executable, CLIENT, *a],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, a in zip(names, args_for)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"client failed: {stdout[-2000:]} {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def throughput(nodes: int, clients: int, block_mib: float, blocks: int) -> dict:
    block = int(block_mib * (1 << 20))
    dram = max(256, int(clients * blocks * block_mib * 1.6 / nodes) + 64)
    hosts = Hosts()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            master, pid = start_pool(hosts, tmp, nodes, dram, block)
            wait_nodes(master, nodes, tmp)
            names = [f"c{i}" for i in range(clients)]
            for n in names:
                hosts.add(n)
            cpu0, rss0 = proc_usage(pid)
            row: dict = {"nodes": nodes, "clients": clients}
            for op in ("put", "get"):
                start = time.time() + 8  # every client imported, connected and ready by then
                extra = ["--nodes", str(nodes)] if op == "put" else ["--batch", "16"]
                got = run_clients(hosts, names, [[master, op, n, str(blocks),
                                                  str(block), "--start-at", str(start), *extra] for n in names])
                if op == "put" and not all(g["stored"] == blocks and g["flushed"] for g in got):
                    raise RuntimeError(f"puts failed: {got}")
                if op == "get" and not all(g["ok"] == blocks for g in got):
                    raise RuntimeError(f"gets missed: {got}")
                row[f"{op}_gbps"] = clients * blocks * block / (max(g["end"] for g in got) - start) / 1e9
            cpu1, rss1 = proc_usage(pid)
            row.update(master_cpu_s=cpu1 - cpu0, master_rss_mib=rss1 / (1 << 20),
                       master_rss_growth_mib=(rss1 - rss0) / (1 << 20))
            return row
        finally:
            hosts.close()


def lookups(total: int) -> dict:
    hosts = Hosts()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            dram = int(total * 4096 * 1.3 / 3 / (1 << 20)) + 64
            master, pid = start_pool(hosts, tmp, 3, dram, 4096)
            wait_nodes(master, 3, tmp)
            names = [f"c{i}" for i in range(4)]
            for n in names:
                hosts.add(n)
            share = total // 4
            started = time.monotonic()
            filled = run_clients(hosts, names, [[master, "put", n, str(share), "4096", "--nodes", "3"]
                                                for n in names])
            fill_s = time.monotonic() - started
            stored = sum(f["stored"] for f in filled)
            if stored < 0.999 * share * 4 or not all(f["flushed"] for f in filled):  # a refused put is a counted miss
                raise RuntimeError(f"fill failed: {filled}")
            _, rss = proc_usage(pid)
            got = run_clients(hosts, ["c0"], [[master, "lookup", "c1", str(share), "4096", "--batch", "64",
                                               "--samples", "2000"]])[0]
            return {"blocks": stored, "fill_s": fill_s, "master_rss_mib": rss / (1 << 20), **got}
        finally:
            hosts.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=float, default=1.0)
    parser.add_argument("--blocks", type=int, default=48, help="blocks each client puts and gets")
    parser.add_argument("--lookup-blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    rows = [throughput(n, c, args.block_mib, args.blocks) for n in (1, 2, 3) for c in (1, 2, 4)]
    print(f"aggregate throughput, {args.blocks} x {args.block_mib:g} MiB blocks per client; all hosts on "
          f"{os.cpu_count()} cores")
    print("| nodes | client hosts | put GB/s | get GB/s | master CPU s | master RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['clients']} | {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | "
              f"{r['master_cpu_s']:.2f} | {r['master_rss_mib']:.0f} |")
    if args.lookup_blocks:
        r = lookups(args.lookup_blocks)
        print(f"\n64-key lookups from a client host, {r['blocks']} blocks of 4 KiB over 3 node hosts (filled by 4 "
              f"client hosts in {r['fill_s']:.0f} s): p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us; master "
              f"RSS {r['master_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
