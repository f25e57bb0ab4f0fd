"""Index shards: the master CPU a lookup costs with S = 2 shard masters against S = 1, at equal load (issue 29).

    python benchmarks/shard_scale.py [--clients 1,32,128] [--lookup-keys 64,1024] [--seconds 5] [--procs 8]
                                     [--keys 4096] [--fanout threads,serial] [--equal-load 0.8] [--out FILE]
                                     [--quick]

Starts, once for the whole run, a real etcd (the ``etcd`` binary on PATH) and two clusters on it:

- S = 1: one ``kvpool master --etcd ... --shards 1`` (today's cluster);
- S = 2: two ``kvpool master --etcd ... --shards 2 --shard K`` processes;

each with its own ``kvpool node --master etcd://.../CLUSTER`` (one link per shard), and ``--keys`` 4 KiB
blocks stored through a ``PoolClient`` on ``etcd://`` (a ``ShardedMaster`` for S = 2).

Then per lookup size L, client count C, and cluster: C client threads over ``min(C, --procs)`` processes
(``master_scale.py``'s workers), each looping L-key lookups, half the keys present (present first): S = 1
through one ``DirectMaster`` per thread (what ``connect_master`` gives a client of a one-shard cluster), S = 2
through one ``ShardedMaster`` per thread over one ``DirectMaster`` per shard leader (what it gives for two).
Each point is measured twice: flat out (every thread loops as fast as it can), then at equal load (both
clusters offered ``--equal-load`` x the slower one's flat-out rate, paced evenly over the threads). The
masters' CPU (utime + stime from /proc, summed over the shard masters) over the counted window, divided by
the lookups made, is the master CPU per lookup. The clients share the cores with the masters, so raw rates
do not show capacity; the capacity ratio is ``S * cpu(S=1) / cpu(S=2)`` at equal load: the lookups per
second two masters on two cores serve over what one master on one core serves, each running its core full
at that cost per lookup.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_mooncake import free_port, stop, wait_port  # noqa: E402
from master_scale import VALUE_BYTES, System, store_blocks  # noqa: E402

from kvpool.config import ClientConfig  # noqa: E402


def start_etcd(tmp: Path, keep: list[subprocess.Popen]) -> str:
    """A single-member etcd on free loopback ports; its client endpoint."""
    binary = shutil.which("etcd")
    if binary is None:
        raise SystemExit("shard_scale: needs etcd (apt-get install etcd-server)")
    client, peer = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    keep.append(subprocess.Popen(
        [binary, "--name", "bench", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", f"http://{client}",
         "--advertise-client-urls", f"http://{client}", "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"bench={peer}"],
        stdout=open(tmp / "etcd.log", "wb"), stderr=subprocess.STDOUT))
    wait_port(int(client.rpartition(":")[2]), keep[-1])
    return client


def start_cluster(etcd: str, shards: int, args: argparse.Namespace, max_clients: int, tmp: Path,
                  keep: list[subprocess.Popen], arenas: list[Path]) -> System:
    """``shards`` master processes and a node on one new cluster, ``args.keys`` blocks stored; the node's arena
    is added to ``arenas`` (to remove at the end)."""
    from kvpool.etcd import EtcdClient
    from kvpool.master_client import leader_address

    cluster = f"bench-{shards}-{uuid.uuid4().hex[:6]}"
    target = f"etcd://{etcd}/{cluster}"
    pids: list[int] = []
    for k in range(shards):
        port = free_port()
        keep.append(subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", "master", "--port", str(port), "--metrics-port", "0",
             "--call-port", str(free_port()), "--max-connections", str(max(64, max_clients + 64)),
             "--etcd", f"http://{etcd}", "--cluster", cluster, "--shards", str(shards), "--shard", str(k),
             "--log-level", "WARNING"],
            stdout=open(tmp / f"{cluster}-master{k}.log", "wb"), stderr=subprocess.STDOUT))
        pids.append(keep[-1].pid)
        wait_port(port, keep[-1])
    client = EtcdClient([etcd], timeout_s=2.0)
    try:
        addresses: list[str] = []
        for k in range(shards):
            deadline = time.monotonic() + 30
            while (address := leader_address(client, cluster, shard=k)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shard {k} of {cluster} elected no leader (see {tmp})")
                time.sleep(0.1)
            addresses.append(address)
    finally:
        client.close()
    arenas.append(Path(f"/dev/shm/kvpool-shards-{cluster}"))
    keep.append(subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "node", "--master", target, "--port", str(free_port()),
         "--metrics-port", "0", "--data-port", "0", "--no-ssd",
         "--dram-bytes", str(max(64 << 20, 4 * args.keys * VALUE_BYTES)), "--arena", arenas[-1].name,
         "--log-level", "WARNING"],
        stdout=open(tmp / f"{cluster}-node.log", "wb"), stderr=subprocess.STDOUT))
    store_blocks(target, args.keys, tmp)
    print(f"  S={shards}: masters {addresses} (pids {pids}), {args.keys} blocks stored", file=sys.stderr, flush=True)
    return System("kvpool", sys.executable, pids, ["--master", ",".join(addresses)])


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["| keys/lookup | clients | fan-out | flat out: lookups/s S=1 / S=2 | master CPU/lookup S=1 / S=2 "
             "| equal load: lookups/s | master CPU/lookup S=1 / S=2 | capacity S=2 / S=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one, two, eq1, eq2 = r["S1"], r["S2"], r["S1_equal"], r["S2_equal"]
        lines.append(f"| {r['lookup_keys']} | {r['clients']} | {r['fanout']} | {one['lookups_per_s']:,.0f} / "
                     f"{two['lookups_per_s']:,.0f} | {one['cpu_us']:.0f} / {two['cpu_us']:.0f} us | "
                     f"{eq1['lookups_per_s']:,.0f} / {eq2['lookups_per_s']:,.0f} | {eq1['cpu_us']:.0f} / "
                     f"{eq2['cpu_us']:.0f} us | {2 * eq1['cpu_us'] / eq2['cpu_us']:.2f} x |")
    lines += ["", f"Half of each lookup's keys present (first); {args.seconds:g} s counted per point after every "
                  "thread's first call; master CPU from /proc (utime + stime), summed over the shard masters. "
                  f"Equal load: both clusters offered {args.equal_load:g} x the slower one's flat-out rate, paced "
                  "evenly over the clients; capacity = S x cpu(S=1) / cpu(S=2) at equal load."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,32,128", help="client counts, comma-separated")
    parser.add_argument("--lookup-keys", default="64,1024", help="keys per lookup, comma-separated")
    parser.add_argument("--fanout", default="threads", help="ShardedMaster fan-outs to measure: threads,serial")
    parser.add_argument("--seconds", type=float, default=5.0, help="counted seconds per point")
    parser.add_argument("--equal-load", type=float, default=0.8,
                        help="the equal-load points offer this fraction of the slower cluster's flat-out rate")
    parser.add_argument("--procs", type=int, default=8, help="most client processes per point")
    parser.add_argument("--keys", type=int, default=4096, help="blocks stored on each cluster")
    parser.add_argument("--out", help="also write the table here (and the raw figures as JSON next to it)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 8 clients, 64 keys, 1 s each")
    parser.add_argument("--spin-us", type=int, default=ClientConfig().spin_wait_us,
                        help="how long a client polls for its reply before it blocks (ClientConfig.spin_wait_us)")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.lookup_keys, args.seconds, args.procs, args.keys = "1,8", "64", 1.0, 4, 1024
    counts = [int(c) for c in args.clients.split(",") if c]
    sizes = [int(n) for n in args.lookup_keys.split(",") if n]
    fanouts = [f for f in args.fanout.split(",") if f]
    if max(sizes) // 2 > args.keys:
        parser.error(f"--keys {args.keys} is fewer than the present half of a {max(sizes)}-key lookup")
    keep: list[subprocess.Popen] = []
    arenas: list[Path] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-shard-scale-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            etcd = start_etcd(tmp, keep)
            clusters = {s: start_cluster(etcd, s, args, max(counts), tmp, keep, arenas) for s in (1, 2)}
            for size in sizes:
                for fanout in fanouts:
                    for c in counts:
                        row: dict = {"lookup_keys": size, "clients": c, "fanout": fanout}
                        for load in ("flat out", "equal"):  # then both at the same offered rate
                            rate = 0.0 if load == "flat out" else \
                                args.equal_load * min(row[f"S{s}"]["lookups_per_s"] for s in clusters)
                            point = argparse.Namespace(seconds=args.seconds, procs=args.procs, lookup_keys=size,
                                                       fanout=fanout, rate=rate, spin_us=args.spin_us)
                            for s, system in clusters.items():
                                key = f"S{s}" if load == "flat out" else f"S{s}_equal"
                                row[key] = m = system.measure(c, point)
                                print(f"  {size} keys, {c} clients, S={s} ({fanout}, {load}): "
                                      f"{m['lookups_per_s']:,.0f} lookups/s, {m['cpu_us']:.0f} us master CPU each "
                                      f"({m['cpu_pct']:.0f}% of a core)", file=sys.stderr, flush=True)
                        rows.append(row)
        finally:
            for proc in reversed(keep):
                stop(proc)
            for arena in arenas:
                arena.unlink(missing_ok=True)
    table = render(rows, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
