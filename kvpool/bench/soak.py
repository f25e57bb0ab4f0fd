"""``kvpool bench soak``: many clients against a real pool for minutes; memory, fds and threads must stay flat.

The run (everything on 127.0.0.1, free ports):

1. a pool of real processes: ``kvpool master`` and ``--nodes`` ``kvpool node``
   processes, each node with a small DRAM arena (``--dram-bytes``) in front
   of a small SSD store (``--ssd-bytes``), so that eviction, demotion to SSD
   and promotion back happen all the time (``--master`` uses a running pool
   instead: then only the clients are sampled);
2. ``--clients`` client processes (:mod:`kvpool.bench.soak_worker`), each
   with one long-lived :class:`~kvpool.client.kvclient.KVCacheClient` running a
   prefix-shaped workload (shared prefixes + unique suffixes, lookup -> get of
   the hit run -> put of the rest, every byte checked); by default half of
   them over shared memory and half over the network path, and half of
   them (clients 0, 1, 4, 5, ...) with an HBM tier; plus ``--churn`` processes that create and close a
   client every two requests (connect/close churn);
3. the load runs ``--duration`` seconds (start-up not counted); every
   ``--interval`` seconds the driver samples each process's RSS
   (``/proc/<pid>/status`` VmRSS), open fds (``/proc/<pid>/fd``) and threads;
4. per process it reports start (first sample after the warm-up, the first
   ``--warmup`` of the run), end, max and a least-squares slope per minute,
   and decides "flat" by :class:`~kvpool.bench.procstat.FlatRule`; totals:
   requests, blocks, hits by tier, GB moved, errors by kind, wrong bytes.

It exits 0 only if every process stayed flat, no worker died, no error
counted (``block_gone`` / ``slot_reused``, a lookup outrun by eviction, are
reported as races: misses by design) and no byte came back wrong; 1
otherwise, 130 on Ctrl-C. Whatever it started it stops: workers, nodes and
master are terminated and waited for, arenas and SSD directories removed.
If the driver itself is killed (SIGKILL), its children still exit (the pool
processes get SIGTERM, the workers see their stdin close) and the next run
removes the arenas and directories it left (:func:`remove_stale`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.bench.procstat import METRICS, FlatRule, ProcSeries, read_proc
from kvpool.bench.progress import Progress
from kvpool.bench.replay import block_layout, cluster_nodes, parse_bytes
from kvpool.bench.soak_worker import RACE_KINDS, WorkerSpec

DEFAULT_BLOCK_BYTES = 64 << 10
DEFAULT_DRAM_BYTES = 16 << 20
DEFAULT_SSD_BYTES = 64 << 20
MASTER_WORKER_TIMEOUT_S = 10.0  # churn leaves a silent worker id per client: the master forgets them this soon
PREFIX = "kvpool-soak-"  # of arenas and work directories, followed by the driver's pid
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakSettings:
    """One soak run, validated."""

    duration_s: float
    clients: int
    churn: int
    nodes: int
    block_bytes: int
    dram_bytes: int
    ssd_bytes: int
    hbm_blocks: int
    shm: str  # "mix", "all" or "none"
    master: str | None
    warmup: float
    interval_s: float
    rule: FlatRule
    ssd_parent: str | None = None

    @property
    def warmup_s(self) -> float:
        return self.duration_s * self.warmup

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SoakSettings:
        """The settings ``args`` ask for; ValueError naming the first bad flag."""
        if args.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {args.duration}")
        if args.clients < 1 or args.churn < 0 or args.nodes < 1:
            raise ValueError("--clients and --nodes must be >= 1, --churn >= 0")
        if not 0 <= args.warmup < 1:
            raise ValueError(f"--warmup is a fraction of the run in [0, 1), got {args.warmup}")
        block_layout(args.block_bytes)  # a ValueError for sizes no 512-token layout gives
        if args.dram_bytes < args.block_bytes:
            raise ValueError("--dram-bytes must hold at least one block")
        if args.ssd_bytes < 2 * args.block_bytes:
            raise ValueError("--ssd-bytes must hold a few blocks (the soak needs blocks demoted to SSD)")
        if args.hbm_blocks < 0:
            raise ValueError(f"--hbm-blocks must be >= 0, got {args.hbm_blocks}")
        interval = args.interval if args.interval is not None else min(5.0, max(0.5, args.duration / 60.0))
        if interval <= 0:
            raise ValueError(f"--interval must be > 0, got {interval}")
        return cls(args.duration, args.clients, args.churn, args.nodes, args.block_bytes, args.dram_bytes,
                   args.ssd_bytes, args.hbm_blocks, args.shm, args.master, args.warmup, interval,
                   FlatRule(args.rss_growth_pct, args.rss_growth_mib, args.count_slack), args.ssd_dir)

    def worker_specs(self, master: str) -> list[WorkerSpec]:
        """The client workers (shared memory by ``shm``, HBM in clients 0, 1, 4, 5, ...) and the churn workers."""
        specs = []
        for i in range(self.clients):
            shm = {"all": True, "none": False}.get(self.shm, i % 2 == 0)
            hbm = self.hbm_blocks if (i // 2) % 2 == 0 else 0  # clients 0, 1, 4, 5, ...: one shm, one not
            specs.append(WorkerSpec(i, "client", master, self.block_bytes, hbm_blocks=hbm, shared_memory=shm))
        specs += [WorkerSpec(self.clients + j, "churn", master, self.block_bytes, hbm_blocks=min(self.hbm_blocks, 8))
                  for j in range(self.churn)]
        return specs


# -- processes -----------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the driver dies, even by SIGKILL (Linux PR_SET_PDEATHSIG).

    The signal comes once per driver thread that exits, so a node may be killed by the second one in the
    middle of its clean stop and leave its arena: :func:`remove_stale` deletes such leftovers next time.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def remove_stale(tmp_parent: str | None = None) -> list[str]:
    """Remove arenas and work directories of soak runs whose driver is gone (killed with SIGKILL); their paths."""
    from kvpool.tiers.arena import SHM_DIR

    removed = []
    for parent, is_dir in ((SHM_DIR, False), (tmp_parent or tempfile.gettempdir(), True)):
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                pid = name.split("-")[2] if name.startswith(PREFIX) and name.count("-") >= 3 else ""
                if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                    continue
                path = os.path.join(parent, name)
                if is_dir:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                removed.append(path)
    return removed


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> None:
    """Poll the gRPC health service at ``address`` until SERVING; RuntimeError if ``proc`` exits or time runs out."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with {proc.returncode} before serving")
            with contextlib.suppress(grpc.RpcError):
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing serving on {address} after {timeout:.0f}s")
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


@dataclass
class PoolProcess:
    """A ``kvpool master`` or ``kvpool node`` this run started."""

    name: str
    proc: subprocess.Popen
    log: str
    metrics_port: int


class LocalPool:
    """A master and ``nodes`` nodes as separate processes on 127.0.0.1; :meth:`close` removes every trace."""

    def __init__(self, settings: SoakSettings, workdir: str):
        self.settings = settings
        self.workdir = workdir
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"  # the pid first: see remove_stale
        self.processes: list[PoolProcess] = []
        self.arenas: list[str] = []
        self.address = ""

    def _spawn(self, name: str, argv: list[str], metrics_port: int) -> PoolProcess:
        log = os.path.join(self.workdir, f"{name}.log")
        with open(log, "wb") as out:
            level = os.environ.get("KVPOOL_SOAK_LOG", "WARNING")
            # preexec_fn is unsafe with threads in general; this one only calls prctl
            proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "--log-level", level, *argv],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        p = PoolProcess(name, proc, log, metrics_port)
        self.processes.append(p)
        return p

    def start(self) -> LocalPool:
        s = self.settings
        port, metrics, calls = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        master = self._spawn("master", ["master", "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
                                        str(metrics), "--call-port", str(calls),
                                        "--worker-timeout-s", str(MASTER_WORKER_TIMEOUT_S)], metrics)
        self._wait(master, self.address)
        for i in range(s.nodes):
            port, metrics, data = free_ports(3)
            arena = f"{PREFIX}{self.tag}-n{i}"
            self.arenas.append(arena)
            node = self._spawn(f"node{i}", [
                "node", "--master", self.address, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(metrics), "--data-port", str(data), "--node-id", f"soak-n{i}",
                "--arena", arena, "--dram-bytes", str(s.dram_bytes), "--max-block-bytes", str(s.block_bytes),
                "--ssd-dir", os.path.join(self.workdir, f"ssd-n{i}"), "--ssd-bytes", str(s.ssd_bytes),
            ], metrics)
            self._wait(node, f"127.0.0.1:{port}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(cluster_nodes(self.address)) < s.nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"soak: {s.nodes} node(s) did not register with the master in time")
            time.sleep(0.05)
        return self

    def _wait(self, p: PoolProcess, address: str) -> None:
        try:
            wait_serving(address, p.proc)
        except RuntimeError as exc:
            raise RuntimeError(f"soak: {p.name} did not start: {exc}\n{_tail(p.log)}") from None

    def scrape(self) -> dict[str, dict[str, float]]:
        """Each process's counters of interest (errors, evictions, demotions, ...) from its /metrics; {} if down."""
        from kvpool.metrics import scrape_samples

        wanted = ("kvpool_errors_total", "kvpool_demotions_total", "kvpool_promotions_total",
                  "kvpool_tier_evictions_total", "kvpool_tier_corrupt_blocks_total", "kvpool_evictions_total",
                  "kvpool_corrupt_blocks_total")
        out: dict[str, dict[str, float]] = {}
        for p in self.processes:
            values: dict[str, float] = {}
            try:
                samples = scrape_samples(p.metrics_port)
            except OSError:
                out[p.name] = values
                continue
            for sample in samples:
                if sample.name in wanted:
                    label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "node")
                    name = sample.name + (f"{{{label}}}" if label else "")
                    values[name] = values.get(name, 0.0) + sample.value
            out[p.name] = values
        return out

    def close(self) -> dict[str, int]:
        """Stop the nodes, then the master (SIGTERM, then SIGKILL); remove arenas. Exit codes by name."""
        codes = {p.name: stop_process(p.proc) for p in reversed(self.processes)}
        from kvpool.tiers.arena import shm_path

        for arena in self.arenas:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(arena))
        return codes


class WorkerProcess:
    """A soak worker process and what it has reported (read by a thread from its stdout)."""

    def __init__(self, spec: WorkerSpec, workdir: str):
        self.spec = spec
        self.name = f"{spec.role}{spec.index}"
        self.log = os.path.join(workdir, f"{self.name}.log")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.bench.soak_worker", spec.to_json()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                start_new_session=True,
            )
        self.ready = threading.Event()
        self.finished = threading.Event()  # stdout closed: the worker exited (or is exiting)
        self.latest: dict[str, Any] = {}
        self.done: dict[str, Any] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"soak-read-{self.name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None, "soak: worker stdout is not a pipe"
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            event = msg.pop("event", None)
            if event == "ready":
                self.ready.set()
            elif event == "status":
                self.latest = msg
            elif event == "done":
                self.latest = self.done = msg
        self.finished.set()
        self.ready.set()  # wake a waiter; it checks whether the process is alive

    def send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None, "soak: worker stdin is not a pipe"
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def stop(self) -> int:
        """Ask it to finish (stdin), wait for its report, then make sure it is gone; its exit code."""
        self.send("stop")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None, "soak: worker stdin is not a pipe"
            self.proc.stdin.close()
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return stop_process(self.proc)


# -- the run -------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    """Everything a run measured (see :meth:`to_json` for the report's fields)."""

    settings: SoakSettings
    command: str
    series: list[ProcSeries] = field(default_factory=list)
    workers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    died: dict[str, int] = field(default_factory=dict)  # process -> exit code, if it exited before the end
    server_before: dict[str, dict[str, float]] = field(default_factory=dict)  # at the end of the warm-up
    server_after: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    max_oversleep_s: float = 0.0  # the driver's worst wake-up delay: how starved of CPU the machine was

    def totals(self) -> dict[str, Any]:
        t: dict[str, Any] = {"requests": 0, "blocks": 0, "hits": {"hbm": 0, "dram": 0, "ssd": 0}, "lost": 0,
                             "put_blocks": 0, "put_refused": 0, "wrong_blocks": 0, "bytes_moved": 0,
                             "errors": {}, "races": {}, "exceptions": {}, "clients_opened": 0, "clients_closed": 0,
                             "slow_requests": 0, "max_request_s": 0.0, "slow_calls": {}}
        for _, w in self.workers:
            for k in ("requests", "blocks", "lost", "put_blocks", "put_refused", "wrong_blocks", "bytes_moved",
                      "clients_opened", "clients_closed", "slow_requests"):
                t[k] += w.get(k, 0)
            t["max_request_s"] = max(t["max_request_s"], w.get("max_request_s", 0.0))
            for kind, n in w.get("slow_calls", {}).items():
                t["slow_calls"][kind] = t["slow_calls"].get(kind, 0) + n
            for tier, n in w.get("hits", {}).items():
                t["hits"][tier] += n
            for kind, n in w.get("errors", {}).items():
                bucket = t["races"] if kind in RACE_KINDS else t["errors"]
                bucket[kind] = bucket.get(kind, 0) + n
            for kind, n in w.get("exceptions", {}).items():
                t["exceptions"][kind] = t["exceptions"].get(kind, 0) + n
        blocks = t["blocks"]
        t["hit_ratio"] = {tier: (n / blocks if blocks else 0.0) for tier, n in t["hits"].items()}
        t["overall_hit_ratio"] = sum(t["hits"].values()) / blocks if blocks else 0.0
        t["gb_moved"] = t["bytes_moved"] / 1e9
        secs = self.seconds or float("nan")
        t["requests_per_s"] = t["requests"] / secs
        t["gb_per_s"] = t["gb_moved"] / secs
        return t

    def server_errors(self) -> dict[str, int]:
        """Errors and corrupt blocks the pool's own processes counted (by process and kind)."""
        out = {}
        for proc, values in self.server_after.items():
            for name, v in values.items():
                if v and ("errors_total" in name or "corrupt" in name):
                    out[f"{proc} {name}"] = int(v)
        return out

    def server_deltas(self) -> dict[str, dict[str, float]]:
        """Each pool process's counters over the measured window (after the warm-up)."""
        return {proc: {name: v - self.server_before.get(proc, {}).get(name, 0.0) for name, v in values.items()}
                for proc, values in self.server_after.items()}

    def verdict(self) -> dict[str, Any]:
        s = self.settings
        reasons = []
        flat = True
        for series in self.series:
            why = s.rule.check(series, s.warmup_s)
            flat &= not why
            reasons += why
        t = self.totals()
        if self.interrupted:
            reasons.append("interrupted")
        for name, code in self.died.items():
            reasons.append(f"{name} exited early with {code}")
        if t["requests"] == 0:
            reasons.append("no request completed")
        if t["wrong_blocks"]:
            reasons.append(f"{t['wrong_blocks']} blocks came back with wrong bytes")
        if t["errors"]:
            reasons.append("client errors: " + ", ".join(f"{k} {v}" for k, v in sorted(t["errors"].items())))
        if t["exceptions"]:
            reasons.append("exceptions: " + ", ".join(f"{k} {v}" for k, v in sorted(t["exceptions"].items())))
        server = self.server_errors()
        if server:
            reasons.append("pool errors: " + ", ".join(f"{k} {v}" for k, v in sorted(server.items())))
        return {"ok": not reasons, "flat": flat, "reasons": reasons}

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        procs = []
        for series in self.series:
            summary = series.summary(s.warmup_s)
            why = s.rule.check(series, s.warmup_s)
            procs.append({
                "name": series.name, "pid": series.pid,
                "samples": [[round(x.t, 3), x.rss_kib, x.anon_kib, x.file_kib, x.shmem_kib, x.fds, x.threads]
                            for x in series.samples],
                "summary": {m: summary[m].to_json() for m in METRICS} if summary else None,
                "flat": not why, "reasons": why,
            })
        return {
            "command": self.command,
            "settings": {"duration_s": s.duration_s, "clients": s.clients, "churn": s.churn, "nodes": s.nodes,
                         "block_bytes": s.block_bytes, "dram_bytes": s.dram_bytes, "ssd_bytes": s.ssd_bytes,
                         "hbm_blocks": s.hbm_blocks, "shared_memory": s.shm, "master": s.master,
                         "warmup_s": s.warmup_s, "interval_s": s.interval_s},
            "rule": s.rule.describe(),
            "seconds": self.seconds,
            "driver_max_oversleep_s": self.max_oversleep_s,
            "sample_fields": ["t_s", "rss_kib", "anon_kib", "file_kib", "shmem_kib", "fds", "threads"],
            "processes": procs,
            "totals": self.totals(),
            "workers": [{"name": n, **w} for n, w in self.workers],
            "pool_counters_after_warmup": self.server_deltas(),
            "pool_errors": self.server_errors(),
            "died": self.died,
            "verdict": self.verdict(),
        }


def _sample(series: list[ProcSeries], t: float) -> None:
    for s in series:
        s.add(read_proc(s.pid, t))


def _note(workers: Sequence[WorkerProcess], series: Sequence[ProcSeries]) -> str:
    req = sum(w.latest.get("requests", 0) for w in workers)
    wrong = sum(w.latest.get("wrong_blocks", 0) for w in workers)
    errs = sum(n for w in workers for k, n in w.latest.get("errors", {}).items() if k not in RACE_KINDS)
    rss = sum(s.samples[-1].rss_kib for s in series if s.samples) / 1024
    fds = sum(s.samples[-1].fds for s in series if s.samples)
    return f"{req} req  err {errs}  wrong {wrong}  RSS {rss:.0f} MiB  fds {fds}"


def soak(settings: SoakSettings, command: str = "", progress: bool = True) -> SoakResult:
    """Run one soak (see the module docstring); everything started is stopped before it returns or raises."""
    result = SoakResult(settings, command)
    remove_stale(settings.ssd_parent)
    workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=settings.ssd_parent)
    pool: LocalPool | None = None
    workers: list[WorkerProcess] = []
    try:
        master = settings.master
        if master is None:
            pool = LocalPool(settings, workdir)  # assigned first: a start that fails half-way is cleaned up too
            master = pool.start().address
            result.series += [ProcSeries(p.name, p.proc.pid) for p in pool.processes]
        elif not cluster_nodes(master):
            raise ValueError(f"the pool at {master} has no live node")
        workers = [WorkerProcess(spec, workdir) for spec in settings.worker_specs(master)]
        result.series += [ProcSeries(w.name, w.proc.pid) for w in workers]
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in workers:
            if not w.ready.wait(max(0.0, deadline - time.monotonic())) or w.proc.poll() is not None:
                raise RuntimeError(f"soak: worker {w.name} did not start:\n{_tail(w.log)}")
        for w in workers:
            w.send("go")
        start = time.monotonic()
        bar = Progress(round(settings.duration_s), "soak", enabled=progress, unit="s", show_rate=False)
        scraped_warm = settings.warmup_s <= 0
        if pool is not None and scraped_warm:
            result.server_before = pool.scrape()
        tick = 0
        while True:
            t = time.monotonic() - start
            _sample(result.series, min(t, settings.duration_s))
            if not scraped_warm and t >= settings.warmup_s and pool is not None:
                result.server_before = pool.scrape()  # right after a sample: its threads are gone by the next
                scraped_warm = True
            processes: list[PoolProcess | WorkerProcess] = [*(pool.processes if pool else []), *workers]
            for proc in processes:
                code = proc.proc.poll()
                if code is not None and proc.name not in result.died:
                    result.died[proc.name] = code
            bar.update(int(min(t, settings.duration_s)), _note(workers, result.series))
            if t >= settings.duration_s or result.died:
                break
            tick += 1
            next_t = min(tick * settings.interval_s, settings.duration_s)
            while (now := time.monotonic() - start) < next_t:  # redraw the bar meanwhile
                nap = min(0.25, next_t - now)
                time.sleep(nap)
                result.max_oversleep_s = max(result.max_oversleep_s, time.monotonic() - start - now - nap)
                bar.update(int(min(now, settings.duration_s)), _note(workers, result.series))
        result.seconds = time.monotonic() - start
        bar.close(int(min(result.seconds, settings.duration_s)), _note(workers, result.series))
        if pool is not None:
            result.server_after = pool.scrape()
        for w in workers:
            w.send("stop")
        for w in workers:
            code = w.stop()
            if code != 0 and w.name not in result.died:
                result.died[w.name] = code
            result.workers.append((w.name, w.done if w.done is not None else w.latest))
            if w.done is None and w.name not in result.died:
                result.died[w.name] = code
        workers = []
        return result
    except KeyboardInterrupt:
        result.interrupted = True
        raise
    finally:
        for w in workers:
            w.send("stop")
        for w in workers:
            stop_process(w.proc, timeout=STOP_TIMEOUT_S)
        if pool is not None:
            codes = pool.close()
            result.died.update({n: c for n, c in codes.items() if c not in (0, -signal.SIGTERM)
                                and n not in result.died})
        shutil.rmtree(workdir, ignore_errors=True)


# -- report --------------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The markdown summary of a :meth:`SoakResult.to_json` report: per-process table, totals, verdict."""
    st = report["settings"]
    lines = [
        (f"Soak: {st['clients']} clients + {st['churn']} churn, {st['nodes']} node(s), "
         f"{report['seconds']:.0f} s of load ({st['warmup_s']:.0f} s warm-up), samples every {st['interval_s']:g} s; "
         f"{st['block_bytes'] >> 10} KiB blocks, DRAM {st['dram_bytes'] >> 20} MiB and SSD {st['ssd_bytes'] >> 20} MiB "
         "a node."),
        "",
        ("| process | VmRSS MiB start -> end (max) | private MiB start -> end (max) | private KiB/min "
         "| fds start -> end (max) | fds/min | threads start -> end (max) | threads/min | flat |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["processes"]:
        s = p["summary"]
        if s is None:
            lines.append(f"| {p['name']} | no samples | | | | | | | no |")
            continue
        r, a, f, th = s["rss_kib"], s["private_kib"], s["fds"], s["threads"]
        lines.append(
            f"| {p['name']} | {r['start'] / 1024:.1f} -> {r['end'] / 1024:.1f} ({r['max'] / 1024:.1f}) "
            f"| {a['start'] / 1024:.1f} -> {a['end'] / 1024:.1f} ({a['max'] / 1024:.1f}) | {a['slope_per_min']:+.0f} "
            f"| {f['start']} -> {f['end']} ({f['max']}) | {f['slope_per_min']:+.2f} "
            f"| {th['start']} -> {th['end']} ({th['max']}) | {th['slope_per_min']:+.2f} "
            f"| {'yes' if p['flat'] else 'NO'} |"
        )
    t = report["totals"]
    hits = ", ".join(f"{tier} {t['hit_ratio'][tier]:.1%}" for tier in ("hbm", "dram", "ssd"))
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t["errors"].items())) or "none"
    races = ", ".join(f"{k} {v}" for k, v in sorted(t["races"].items())) or "none"
    lines += [
        "",
        (f"Requests {t['requests']} ({t['requests_per_s']:.1f}/s), blocks looked up {t['blocks']}, "
         f"hit ratio {t['overall_hit_ratio']:.1%} ({hits}), lost after lookup {t['lost']}, "
         f"blocks put {t['put_blocks']} (refused {t['put_refused']}), {t['gb_moved']:.2f} GB moved "
         f"({t['gb_per_s']:.3f} GB/s), clients opened/closed {t['clients_opened']}/{t['clients_closed']}."),
        (f"Errors: {errors}; races (lookup outrun by eviction, a miss): {races}; "
         f"exceptions: {t['exceptions'] or 'none'}; wrong blocks: {t['wrong_blocks']}; "
         f"pool-side errors: {report['pool_errors'] or 'none'}."),
        f"Slowest request {t['max_request_s']:.2f} s; requests over 1 s: {t['slow_requests']}; pool calls over "
        "0.25 / 0.5 / 2.5 s: " + (", ".join(f"{k} {v}" for k, v in sorted(t["slow_calls"].items())) or "none")
        + f"; the driver woke up to {report['driver_max_oversleep_s'] * 1000:.0f} ms late (CPU starvation).",
    ]
    counters = report["pool_counters_after_warmup"]
    if counters:
        moved = []
        for proc, values in sorted(counters.items()):
            interesting = {k: v for k, v in values.items() if v and "errors" not in k}
            if interesting:
                moved.append(f"{proc}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(interesting.items())))
        if moved:
            lines.append("Pool counters after the warm-up: " + "; ".join(moved) + ".")
    v = report["verdict"]
    verdict = "PASS (flat, no errors, no wrong bytes)" if v["ok"] else "FAIL: " + "; ".join(v["reasons"])
    lines += ["", f"Rule: {report['rule']}.", f"Verdict: {verdict}"]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=120.0, metavar="S",
                        help="seconds of load, start-up not counted (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, metavar="N",
                        help="long-lived client processes (default: %(default)s)")
    parser.add_argument("--churn", type=int, default=1, metavar="N",
                        help="processes that create and close a client every two requests (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, metavar="N", help="pool nodes to start (default: %(default)s)")
    parser.add_argument("--block-bytes", type=parse_bytes, default=DEFAULT_BLOCK_BYTES, metavar="SIZE",
                        help="bytes of one 512-token block, a multiple of 1 KiB (default: 64K)")
    parser.add_argument("--dram-bytes", type=parse_bytes, default=DEFAULT_DRAM_BYTES, metavar="SIZE",
                        help="DRAM arena of each node: small, so blocks are demoted all the time (default: 16M)")
    parser.add_argument("--ssd-bytes", type=parse_bytes, default=DEFAULT_SSD_BYTES, metavar="SIZE",
                        help="SSD store of each node: small, so it evicts too (default: 64M)")
    parser.add_argument("--hbm-blocks", type=int, default=64, metavar="N",
                        help="HBM tier (cpu) of half the clients (0, 1, 4, 5, ...), in blocks; 0: none "
                        "(default: %(default)s)")
    shm = parser.add_mutually_exclusive_group()
    shm.add_argument("--shared-memory", dest="shm", action="store_const", const="all",
                     help="every client reads and writes the nodes' arenas directly")
    shm.add_argument("--no-shared-memory", dest="shm", action="store_const", const="none",
                     help="every client uses the network path (bulk TCP)")
    parser.set_defaults(shm="mix")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="use this running pool (only the clients are sampled then)")
    parser.add_argument("--warmup", type=float, default=0.2, metavar="FRACTION",
                        help="leading fraction of the run not judged (default: %(default)s)")
    parser.add_argument("--interval", type=float, default=None, metavar="S",
                        help="seconds between samples (default: duration/60, between 0.5 and 5)")
    parser.add_argument("--rss-growth-pct", type=float, default=5.0, metavar="PCT",
                        help="flat: RSS growth after warm-up below this percent of the start (default: %(default)s)")
    parser.add_argument("--rss-growth-mib", type=float, default=16.0, metavar="MIB",
                        help="flat: and below this many MiB (default: %(default)s)")
    parser.add_argument("--count-slack", type=int, default=4, metavar="N",
                        help="flat: fds and threads may step up by this many after warm-up, pooled connections "
                        "opened late (default: %(default)s)")
    parser.add_argument("--ssd-dir", default=None,
                        help="where the run's temporary directory (SSD stores, logs) goes (default: system temp)")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the full report (with samples) to OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """``kvpool bench soak``: 0 if everything stayed flat with no errors, 1 if not, 130 on Ctrl-C."""
    settings = SoakSettings.from_args(args)
    command = "kvpool bench soak " + " ".join(sys.argv[sys.argv.index("soak") + 1:]) if "soak" in sys.argv else ""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        result = soak(settings, command, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("kvpool bench soak: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"kvpool bench soak: {exc}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    report = result.to_json()
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["verdict"]["ok"] else 1
