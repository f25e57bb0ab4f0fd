"""A master under many lookup clients: kvpool's next to Mooncake Store's, in one run (issue 29's table).

    python benchmarks/master_scale.py [--clients 1,32,128,256,1024] [--seconds 5] [--procs 8]
                                      [--systems kvpool,mooncake] [--lookup-keys 64] [--rate R] [--spin-us US]
                                      [--out FILE]
                                      [--quick]

(``--rate``: lookups/s offered by all clients together, paced; 0, the default, loops flat out.
``benchmarks/shard_scale.py`` runs these workers against sharded clusters.)

Starts, once for the whole run:

- kvpool: a ``kvpool master`` process (``--max-connections`` raised to fit the largest client count: each
  client thread holds one fast-call connection) and a ``kvpool node`` process, then stores ``--keys`` 4 KiB
  blocks through a ``PoolClient`` (``shared_memory=False``);
- Mooncake: ``mooncake_master`` from ``benchmarks/.mooncake-venv`` (made by ``compare_mooncake.py``) and an
  owner process (``mooncake_side.py owner``) that mounts a segment and puts ``--keys`` 4 KiB values.

Then per client count C and per system: C client threads spread over ``min(C, --procs)`` processes, each
looping 64-key lookups, half the keys present (present first, as a prompt's leading run): kvpool's
``Lookup`` through ``MasterApi`` (``DirectMaster``, the fast-call wire, one connection per thread, the
request ``PoolClient.lookup`` sends with ``shared_memory=False``, and a ``PoolClient``'s reply spin:
``--spin-us``, ``ClientConfig.spin_wait_us`` unless given); Mooncake's ``batch_is_exist`` (one store
per process, shared by its threads). After every thread has made its first call, the lookups completed
over ``--seconds`` are counted, and the master process's CPU over the same window is read from
``/proc/PID/stat`` (utime + stime): lookups/s and master CPU per lookup, each with its ratio, and the client
processes' CPU per lookup (summed over them).

The clients share the machine's cores with the masters: a rate is what this machine sustains (the master's
and the clients' CPU per lookup together), the master's CPU per lookup what one lookup costs the master.
``--systems kvpool`` runs without Mooncake.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOKUP_KEYS = 64
VALUE_BYTES = 4096


# -- the client side (a worker process; the Mooncake one runs in Mooncake's venv: stdlib imports only here) --

def kvpool_lookups(args: argparse.Namespace) -> Callable[[], Callable[[], None]]:
    """A factory of per-thread lookup functions: each its own ``DirectMaster`` (one fast-call connection), or,
    when ``--master`` names one master per index shard (comma-separated, in shard order), its own
    ``ShardedMaster`` over one ``DirectMaster`` per shard (``benchmarks/shard_scale.py``)."""
    from kvpool.keys import opaque_key
    from kvpool.master_client import DirectMaster, MasterApi
    from kvpool.sharded_master import ShardedMaster
    from kvpool.tcp import ConnectionPool
    from kvpool.v1 import master_pb2

    half = args.lookup_keys // 2
    present = b"".join(opaque_key(f"scale-{i}") for i in range(half))
    absent = b"".join(opaque_key(f"absent-{args.id}-{i}") for i in range(half))
    request = master_pb2.LookupRequest(keys=present + absent, worker_id=f"scale-{args.id}")
    addresses = args.master.split(",")

    def make() -> Callable[[], None]:
        pool = ConnectionPool(10.0, spin_wait_s=args.spin_us * 1e-6)  # a PoolClient's reply spin
        shards = [DirectMaster(a, pool=pool, timeout_s=30.0, max_message_bytes=64 << 20) for a in addresses]
        master: MasterApi = shards[0] if len(shards) == 1 else ShardedMaster(shards, parallel=args.fanout == "threads")

        def lookup() -> None:
            reply = master.lookup(request, 30.0)
            if len(reply.tiers) != half:
                raise RuntimeError(f"kvpool lookup found {len(reply.tiers)} of {half} present keys")
        return lookup
    return make


def mooncake_lookups(args: argparse.Namespace) -> Callable[[], Callable[[], None]]:
    """A factory of lookup functions over one ``MooncakeDistributedStore`` (this process's)."""
    sys.path.insert(0, str(HERE))
    from mooncake_side import connect

    store = connect(args, 0, 64 << 20)
    half = args.lookup_keys // 2
    keys = [f"k{i}" for i in range(half)] + [f"absent-{args.id}-{i}" for i in range(half)]

    def make() -> Callable[[], None]:
        def lookup() -> None:
            found = store.batch_is_exist(keys)
            if sum(1 for x in found if x == 1) != half:
                raise RuntimeError(f"mooncake batch_is_exist found {list(found).count(1)} of {half} present keys")
        return lookup
    return make


def worker(args: argparse.Namespace) -> int:
    """``--threads`` lookup loops. Protocol on stdin/stdout: prints ``ready`` once every thread has made a call;
    counts calls between the ``go`` and ``stop`` lines it reads; then prints its count as JSON and exits."""
    make = kvpool_lookups(args) if args.system == "kvpool" else mooncake_lookups(args)
    measuring, stopping = threading.Event(), threading.Event()
    counts = [0] * args.threads
    errors: list[str] = []
    started = threading.Barrier(args.threads + 1)

    def loop(i: int) -> None:
        try:
            lookup = make()
            lookup()
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            errors.append(repr(exc))
            started.abort()
            return
        started.wait()
        n = 0
        interval = 1.0 / args.thread_rate if args.thread_rate else 0.0  # paced: one every interval, no burst
        due = time.monotonic()
        try:
            while not stopping.is_set():
                if interval:
                    due = max(due + interval, time.monotonic())
                    time.sleep(max(0.0, due - time.monotonic()))
                lookup()
                if measuring.is_set():
                    n += 1
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            errors.append(repr(exc))
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(args.threads)]
    for t in threads:
        t.start()
    try:
        started.wait(120)
    except threading.BrokenBarrierError:
        print(json.dumps({"errors": errors}), flush=True)
        os._exit(1)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "go":
            measuring.set()
        elif line.strip() == "stop":
            measuring.clear()
            break
    stopping.set()
    for t in threads:
        t.join(30)
    print(json.dumps({"lookups": sum(counts), "errors": errors[:5]}), flush=True)
    os._exit(0)  # no teardown of the stores and connections: the driver is waiting


# -- the driver ------------------------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class System:
    """One system's servers, up for the whole run: the master's pid (or every shard master's: their CPU is summed)
    and how its workers are started."""

    def __init__(self, name: str, python: str, master_pid: int | list[int], flags: list[str]):
        self.name, self.python, self.flags = name, python, flags
        self.master_pids = master_pid if isinstance(master_pid, list) else [master_pid]

    def measure(self, clients: int, args: argparse.Namespace) -> dict:
        """One point: ``clients`` threads over ``min(clients, args.procs)`` processes, ``args.seconds`` counted."""
        procs = min(clients, args.procs)
        shares = [clients // procs + (i < clients % procs) for i in range(procs)]
        workers = [subprocess.Popen([self.python, __file__, "worker", "--system", self.name, "--id", str(i),
                                     "--threads", str(n), "--lookup-keys", str(args.lookup_keys),
                                     "--fanout", args.fanout, "--thread-rate", f"{args.rate / clients:g}",
                                     "--spin-us", str(args.spin_us),
                                     *self.flags],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    stderr=subprocess.DEVNULL if self.name == "mooncake" else None)  # glog lines
                   for i, n in enumerate(shares)]
        try:
            for w in workers:
                assert w.stdout is not None  # a pipe
                line = w.stdout.readline().strip()
                if line != "ready":
                    raise RuntimeError(f"{self.name} worker did not start: {line or w.wait()}")
            pids = [w.pid for w in workers]
            self._tell(workers, "go")
            cpu0, t0 = sum(map(cpu_seconds, self.master_pids)), time.monotonic()
            clients0 = sum(map(cpu_seconds, pids))
            time.sleep(args.seconds)
            cpu1, t1 = sum(map(cpu_seconds, self.master_pids)), time.monotonic()
            clients1 = sum(map(cpu_seconds, pids))
            self._tell(workers, "stop")
            results = [json.loads(w.stdout.readline()) for w in workers if w.stdout is not None]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                w.wait()
        errors = [e for r in results for e in r.get("errors", [])]
        if errors:
            raise RuntimeError(f"{self.name} lookups failed at {clients} clients: {errors[:3]}")
        lookups = sum(r["lookups"] for r in results)
        return {"lookups_per_s": lookups / (t1 - t0), "cpu_us": 1e6 * (cpu1 - cpu0) / max(1, lookups),
                "cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0), "procs": procs,
                "client_cpu_us": 1e6 * (clients1 - clients0) / max(1, lookups)}

    @staticmethod
    def _tell(workers: list[subprocess.Popen], line: str) -> None:
        for w in workers:
            assert w.stdin is not None  # a pipe
            w.stdin.write(line + "\n")
            w.stdin.flush()


def store_blocks(master: str, count: int, tmp: Path) -> None:
    """Store ``count`` 4 KiB blocks (the keys lookups ask for) through a ``PoolClient`` on ``master``, once the
    node has registered; RuntimeError if they are not all found within a minute."""
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig
    from kvpool.keys import opaque_key

    config = ClientConfig(master=master, shared_memory=False, io_timeout_s=30)
    value = bytes(VALUE_BYTES)
    keys = [opaque_key(f"scale-{i}") for i in range(count)]
    deadline = time.monotonic() + 60
    with PoolClient(config) as pool:
        while True:  # the node registers a moment after it starts
            stored = sum(sum(pool.store(keys[s : s + 256], [value] * len(keys[s : s + 256])))
                         for s in range(0, len(keys), 256))
            pool.flush(30)
            if stored == len(keys) and pool.exists(keys) == [True] * len(keys):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvpool: stored {stored} of {len(keys)} blocks (see {tmp})")
            time.sleep(0.5)


def start_kvpool(args: argparse.Namespace, max_clients: int, tmp: Path, keep: list[subprocess.Popen]) -> System:
    """A ``kvpool master`` and a ``kvpool node`` (processes), ``args.keys`` blocks stored."""
    from compare_mooncake import free_port, wait_port

    port = free_port()
    max_connections = max(64, max_clients + 64)
    keep.append(subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "master", "--port", str(port), "--metrics-port", "0",
         "--call-port", str(free_port()), "--max-connections", str(max_connections), "--log-level", "WARNING"],
        stdout=open(tmp / "kvpool-master.log", "wb"), stderr=subprocess.STDOUT))
    master = keep[-1]
    wait_port(port, master)
    keep.append(subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "node", "--master", f"127.0.0.1:{port}", "--port", str(free_port()),
         "--metrics-port", "0", "--data-port", "0", "--no-ssd", "--dram-bytes", str(max(64 << 20, 4 * args.keys
                                                                                        * VALUE_BYTES)),
         "--arena", f"kvpool-scale-{os.getpid()}", "--log-level", "WARNING"],
        stdout=open(tmp / "kvpool-node.log", "wb"), stderr=subprocess.STDOUT))
    store_blocks(f"127.0.0.1:{port}", args.keys, tmp)
    print(f"  kvpool: master pid {master.pid} (max_connections {max_connections}), {args.keys} blocks stored",
          file=sys.stderr, flush=True)
    return System("kvpool", sys.executable, master.pid, ["--master", f"127.0.0.1:{port}"])


def start_mooncake(args: argparse.Namespace, keep: list[subprocess.Popen]) -> System:
    """``mooncake_master`` and an owner process that mounted a segment and put ``args.keys`` values."""
    from compare_mooncake import VENV, free_port, setup_mooncake, wait_port

    python = setup_mooncake()
    rpc, http, metrics = free_port(), free_port(), free_port()
    keep.append(subprocess.Popen(
        [str(VENV / "bin" / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    master = keep[-1]
    wait_port(rpc, master)
    wait_port(http, master)
    ports = ["--master-port", str(rpc), "--metadata-port", str(http)]
    keep.append(subprocess.Popen([str(python), str(HERE / "mooncake_side.py"), "owner", *ports, "--segment-mib",
                                  str(max(256, 2 * args.keys * VALUE_BYTES >> 20)), "--keys", str(args.keys)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    owner = keep[-1]
    assert owner.stdout is not None  # a pipe
    if owner.stdout.readline().strip() != "ready":
        raise RuntimeError("mooncake owner did not start")
    print(f"  mooncake: master pid {master.pid}, {args.keys} keys put", file=sys.stderr, flush=True)
    return System("mooncake", str(python), master.pid, ports)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a is not None and b else "-"

    lines = ["| clients | kvpool lookups/s | Mooncake lookups/s | rate kvpool/Mooncake "
             "| master CPU per lookup kvpool / Mooncake | client CPU per lookup kvpool / Mooncake |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        k, m = r.get("kvpool"), r.get("mooncake")
        rate_k = f"{k['lookups_per_s']:,.0f}" if k else "-"
        rate_m = f"{m['lookups_per_s']:,.0f}" if m else "-"
        cpu_k = f"{k['cpu_us']:.0f}" if k else "-"
        cpu_m = f"{m['cpu_us']:.0f}" if m else "-"
        cpu_r = f" ({k['cpu_us'] / m['cpu_us']:.2f} x)" if k and m and m["cpu_us"] else ""
        client_k = f"{k['client_cpu_us']:.0f}" if k else "-"
        client_m = f"{m['client_cpu_us']:.0f}" if m else "-"
        lines.append(f"| {r['clients']} | {rate_k} | {rate_m} | "
                     f"{ratio(k and k['lookups_per_s'], m and m['lookups_per_s'])} | {cpu_k} / {cpu_m} us{cpu_r} | "
                     f"{client_k} / {client_m} us |")
    procs = ", ".join(f"{r['clients']}: {next(iter(v['procs'] for s, v in r.items() if s in SYSTEMS))}"
                      for r in rows)
    lines += ["", f"{args.lookup_keys}-key lookups, half present; {args.seconds:g} s counted per point after every "
                  f"thread's first call; client processes per point ({procs}); master and client CPU from /proc "
                  f"(utime + stime, the client processes' summed) over the counted window; kvpool clients spin "
                  f"{args.spin_us} us for a reply."]
    return "\n".join(lines)


SYSTEMS = ("kvpool", "mooncake")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="driver", choices=["driver", "worker"])
    parser.add_argument("--clients", default="1,32,128,256,1024", help="client counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="counted seconds per point")
    parser.add_argument("--procs", type=int, default=8, help="most client processes per point")
    parser.add_argument("--keys", type=int, default=4096, help="blocks / keys stored on each system")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", help="also write the table here (and the raw figures as JSON next to it)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 8 clients, 1 s each")
    # worker flags
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--id", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--master", help="the master's address; comma-separated: one per index shard")
    parser.add_argument("--lookup-keys", type=int, default=LOOKUP_KEYS, help="keys per lookup, half present")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="lookups/s offered by all clients together, spread evenly (0: each loops flat out)")
    parser.add_argument("--thread-rate", type=float, default=0.0, help="(worker) one thread's share of --rate")
    parser.add_argument("--fanout", choices=["threads", "serial"], default="threads",
                        help="how a ShardedMaster asks its shards (one master per shard in --master)")
    parser.add_argument("--spin-us", type=int,
                        help="how long a kvpool client polls for its reply before it blocks (a PoolClient's "
                             "spin_wait_us; its default unless given; 0: block at once)")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--metadata-port", type=int)
    args = parser.parse_args()
    if args.spin_us is None:
        from kvpool.config import ClientConfig

        args.spin_us = ClientConfig().spin_wait_us
    if args.role == "worker":
        return worker(args)
    if args.quick:
        args.clients, args.seconds, args.procs, args.keys = "1,8", 1.0, 4, 256
    sys.path.insert(0, str(HERE))
    counts = [int(c) for c in args.clients.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}")
    import tempfile

    from compare_mooncake import stop

    keep: list[subprocess.Popen] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-master-scale-") as tmp:
        try:
            up = [start_kvpool(args, max(counts), Path(tmp), keep) if s == "kvpool" else start_mooncake(args, keep)
                  for s in systems]
            for c in counts:
                row: dict = {"clients": c}
                for system in up:
                    row[system.name] = system.measure(c, args)
                    print(f"  {c} clients, {system.name}: {row[system.name]['lookups_per_s']:,.0f} lookups/s, "
                          f"{row[system.name]['cpu_us']:.0f} us master CPU each "
                          f"({row[system.name]['cpu_pct']:.0f}% of a core)", file=sys.stderr, flush=True)
                rows.append(row)
        finally:
            for proc in reversed(keep):
                if proc.stdin is not None:
                    proc.stdin.close()
                stop(proc)
    table = render(rows, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
