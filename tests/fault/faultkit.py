"""Shared pieces of the fault-injection suite (imported as ``fault.faultkit``; ``tests/`` is on the path).

- :func:`content`: the bytes a block must hold, derived from its key, so any
  byte a client gets back can be checked against what was put (a mix-up of
  two blocks shows as well as a torn or stale copy).
- :class:`MixedLoad`: an engine-like loop on one :class:`KVCacheClient`
  (lookup, load the hit run, check every byte, put the rest) that counts
  wrong bytes and exceptions, and times every call.
- Process control: :func:`start_master` / :func:`start_node` (a generous
  start timeout: the machine may be busy; a node may run with its file
  sizes capped, a disk that fills up), :func:`kill_9`, :func:`stopped`
  (SIGSTOP with SIGCONT guaranteed), :func:`throttled` (a slow process:
  stopped most of the time), :class:`Child` (a Python child that reports
  one JSON line, then waits to be killed).
- Probes of observable state: a node's ``Exists``, the master's ``Exists``,
  a node's metrics, a log's text.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from support import PoolProcesses, metric, scrape, wait_serving, wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.rpc import flags_from_bytes
from kvpool.v1 import master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER

KIB = 1 << 10
MIB = 1 << 20
TESTS_DIR = Path(__file__).resolve().parent.parent
# Nodes beat 4x a second; a node silent for NODE_TIMEOUT_S (the default's 3 s) is dropped.
NODE_TIMEOUT_S = 3.0
HEARTBEAT_S = 0.25


def master_flags(node_timeout_s: float = NODE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S) -> dict[str, str]:
    """``kvpool master`` flags: heartbeats every ``heartbeat_s``, silent nodes dropped after ``node_timeout_s``."""
    return {"node-timeout-s": str(node_timeout_s), "heartbeat-interval-s": str(heartbeat_s)}


# -- checkable contents -------------------------------------------------------------------------------


def key_of(tag: str, i: int) -> BlockKey:
    """The ``i``-th key of a test's key space ``tag``."""
    return opaque_key(f"fault-{tag}-{i}")


def keys_of(tag: str, n: int, start: int = 0) -> list[BlockKey]:
    return [key_of(tag, i) for i in range(start, start + n)]


def content(key: BlockKey, size: int) -> np.ndarray:
    """The ``size`` bytes block ``key`` holds: a PCG64 stream seeded by the key (read-only)."""
    seed = int.from_bytes(key[:8], "little")
    out = np.frombuffer(np.random.Generator(np.random.PCG64(seed)).bytes(size), dtype=np.uint8)
    return out


def wrong_bytes(key: BlockKey, got: np.ndarray) -> int:
    """How many bytes of ``got`` differ from what block ``key`` holds."""
    flat = np.asarray(got).reshape(-1).view(np.uint8)
    return int(np.count_nonzero(flat != content(key, flat.size)))


# -- the load -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    """One engine call the load made: when it started (monotonic), how long it took, what it saw."""

    start: float
    seconds: float
    kind: str  # "lookup", "get" or "put"
    hbm: int = 0  # lookup: leading blocks in HBM
    pool: int = 0  # lookup: blocks of the pool's run after them
    loaded: int = 0  # get: leading blocks loaded


@dataclass
class LoadReport:
    """What a :class:`MixedLoad` saw; ``wrong_bytes`` and ``exceptions`` must stay 0."""

    ops: list[Op] = field(default_factory=list)
    wrong_bytes: int = 0
    checked_blocks: int = 0
    exceptions: list[str] = field(default_factory=list)

    def window(self, start: float = 0.0, end: float = float("inf"), kind: str | None = None) -> list[Op]:
        """Ops that started in [start, end), of one kind if given."""
        return [o for o in self.ops if start <= o.start < end and (kind is None or o.kind == kind)]

    def slowest(self, start: float = 0.0, end: float = float("inf")) -> float:
        return max((o.seconds for o in self.window(start, end)), default=0.0)


class MixedLoad:
    """An engine-like loop on one client, in a thread (see the module docstring).

    Prefix ``p`` is the chain of keys ``tag-p-0 .. tag-p-(blocks-1)``. Each
    step picks a prefix, looks it up, loads the hit run into fresh buffers
    and checks every byte, then puts the blocks after the run (write-behind).
    Exceptions from the client are recorded, never raised: the engine path
    must not see any.
    """

    def __init__(self, client: KVCacheClient, tag: str, *, prefixes: int = 16, blocks: int = 4,
                 block_bytes: int = 64 * KIB, seed: int = 0, pause_s: float = 0.002):
        self.client = client
        self.tag = tag
        self.prefixes = prefixes
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.pause_s = pause_s
        self.report = LoadReport()
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared while the loop is held (held())
        self._go.set()
        self._stepping = threading.Lock()  # held through each step
        self._thread = threading.Thread(target=self._run, name=f"fault-load-{tag}", daemon=True)
        self._expected: dict[BlockKey, np.ndarray] = {}

    def keys(self, prefix: int) -> list[BlockKey]:
        return [opaque_key(f"fault-{self.tag}-{prefix}-{j}") for j in range(self.blocks)]

    def all_keys(self) -> list[BlockKey]:
        return [k for p in range(self.prefixes) for k in self.keys(p)]

    def expected(self, key: BlockKey) -> np.ndarray:
        block = self._expected.get(key)
        if block is None:
            block = self._expected[key] = content(key, self.block_bytes)
        return block

    def start(self) -> MixedLoad:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> LoadReport:
        """Stop the loop and return its report; the loop must end within ``timeout`` (no call hangs)."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"load {self.tag}: a client call did not return within {timeout}s"
        return self.report

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The loop paused between two steps for the block (the step in flight finishes first; the client's
        write-behind may still drain), then resumed."""
        self._go.clear()
        with self._stepping:  # (the step in flight is done)
            pass
        try:
            yield
        finally:
            self._go.set()

    def wait_ops(self, n: int, since: float = 0.0, timeout: float = 20.0, **match: int) -> None:
        """Wait until ``n`` lookups started after ``since`` saw at least the given ``hbm``/``pool`` counts."""
        def enough() -> bool:
            ops = [o for o in self.report.window(since, kind="lookup")
                   if all(getattr(o, k) >= v for k, v in match.items())]
            return len(ops) >= n

        deadline = time.monotonic() + timeout
        while not enough():
            if time.monotonic() > deadline:
                raise TimeoutError(f"load {self.tag}: fewer than {n} lookups matching {match} after {timeout}s")
            if not self._thread.is_alive():
                raise RuntimeError(f"load {self.tag} stopped: {self.report.exceptions[-1:]}")
            time.sleep(0.02)

    @staticmethod
    def _timed(call: Callable[[], object]) -> tuple[float, float, Any]:
        start = time.monotonic()
        value = call()
        return start, time.monotonic() - start, value

    def _step(self) -> None:
        keys = self.keys(int(self._rng.integers(self.prefixes)))
        start, took, result = self._timed(lambda: self.client.lookup(keys))
        self.report.ops.append(Op(start, took, "lookup", hbm=result.hbm_blocks, pool=len(result.pool)))
        outs = [np.zeros(self.block_bytes, dtype=np.uint8) for _ in keys]
        start, took, loaded = self._timed(lambda: self.client.get(keys, outs, result))
        self.report.ops.append(Op(start, took, "get", loaded=loaded))
        for key, out in zip(keys[:loaded], outs[:loaded]):
            self.report.wrong_bytes += int(np.count_nonzero(out != self.expected(key)))
            self.report.checked_blocks += 1
        if loaded < len(keys):
            rest = keys[loaded:]
            start, took, _ = self._timed(lambda: self.client.put(rest, [self.expected(k) for k in rest]))
            self.report.ops.append(Op(start, took, "put"))

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._go.wait(0.1):
                continue
            with self._stepping:
                if not self._go.is_set():  # held between the wait and the lock: no step
                    continue
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - recorded: the test asserts there are none
                    self.report.exceptions.append(traceback.format_exc())
            if self.pause_s:
                self._stop.wait(self.pause_s)


# -- processes ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def stopped(proc: subprocess.Popen) -> Iterator[float]:
    """SIGSTOP ``proc`` for the block (yields when it was stopped); SIGCONT always follows."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def throttled(proc: subprocess.Popen, stop_s: float, run_s: float) -> Iterator[None]:
    """A slow ``proc`` for the block: SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, over and over; SIGCONT at the
    end."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                done.wait(stop_s)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            done.wait(run_s)

    thread = threading.Thread(target=cycle, name="fault-throttle", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)
        os.kill(proc.pid, signal.SIGCONT)


def kill_9(proc: subprocess.Popen) -> float:
    """SIGKILL ``proc`` and reap it; returns when it was killed (monotonic)."""
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(10)
    return killed


# `python -m kvpool.cli ARGS`, after capping the size of any file the process writes (RLIMIT_FSIZE):
# past the cap a write fails with EFBIG, as on a full disk (Python ignores SIGXFSZ, so it is not killed).
_CAPPED_CLI = ("import resource, runpy, sys; cap = int(sys.argv.pop(1)); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap)); sys.argv[0] = 'kvpool'; "
               "runpy.run_module('kvpool.cli', run_name='__main__')")


START_TIMEOUT_S = 45.0  # a process start on a 2-core machine shared with other test runs can be slow


def start_master(procs: PoolProcesses, **flags: str) -> subprocess.Popen:
    """``kvpool master`` on ``procs``' ports (tracked by ``procs``); returns once it serves."""
    all_flags = {"port": procs.master_port, "metrics-port": procs.master_metrics_port,
                 "call-port": procs.master_call_port, **flags}
    return _start(procs, procs.master, "master", all_flags, procs.tmp / f"master-{len(procs.procs)}.log")


def start_node(
    procs: PoolProcesses, name: str, *, file_size_limit: int | None = None, **flags: str
) -> subprocess.Popen:
    """``kvpool node`` ``name`` (tracked by ``procs``), optionally with a cap on file sizes (a disk that fills up)."""
    all_flags = {**procs.node_settings(name), "master": procs.master, **flags}
    log = procs.tmp / f"node-{name}-{len(procs.procs)}.log"
    return _start(procs, procs.node_address(name), "node", all_flags, log, file_size_limit)


def _start(procs: PoolProcesses, address: str, command: str, flags: dict, log: Path,
           file_size_limit: int | None = None) -> subprocess.Popen:
    prefix = ["-m", "kvpool.cli"] if file_size_limit is None else ["-c", _CAPPED_CLI, str(file_size_limit)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *prefix, command, *procs.cli_flags(flags)], stdout=out,
                                stderr=subprocess.STDOUT)
    procs.procs.append(proc)
    wait_serving(address, timeout=START_TIMEOUT_S, proc=proc)
    return proc


def node_logs(procs: PoolProcesses, name: str) -> str:
    """Everything node ``name``'s processes logged so far."""
    return "".join(p.read_text(errors="replace") for p in sorted(procs.tmp.glob(f"node-{name}-*.log")))


class Child:
    """A Python child process that reports one JSON line on stdout, then waits to be killed."""

    def __init__(self, source: str, *args: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", source, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)

    def report(self, timeout: float = 20.0) -> dict:
        """The child's JSON line (it is then blocked, halfway through what it was doing)."""
        done = threading.Event()
        line: list[bytes] = []
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None and stderr is not None  # both are pipes (__init__)

        def read() -> None:
            line.append(stdout.readline())
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout) or not line[0]:
            self.kill()
            raise RuntimeError(f"child gave no report: {stderr.read().decode(errors='replace')[-2000:]}")
        return json.loads(line[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# -- probes ---------------------------------------------------------------------------------------------


def node_tiers(address: str, keys: Sequence[BlockKey], timeout: float = 5.0) -> list[int]:
    """The node's own answer (its ``Exists``): per key the tier holding it, or ``NO_TIER``."""
    with grpc.insecure_channel(address) as channel:
        reply = node_pb2_grpc.NodeStub(channel).Exists(node_pb2.NodeExistsRequest(keys=pack_keys(keys)),
                                                       timeout=timeout)
    return list(reply.tiers)


def node_holds(address: str, keys: Sequence[BlockKey]) -> list[bool]:
    return [t != NO_TIER for t in node_tiers(address, keys)]


def master_exists(procs: PoolProcesses, keys: Sequence[BlockKey], timeout: float = 5.0) -> list[bool]:
    """The master's index: whether any live node holds each key."""
    with grpc.insecure_channel(procs.master) as channel:
        reply = master_pb2_grpc.MasterStub(channel).Exists(master_pb2.ExistsRequest(keys=pack_keys(keys)),
                                                           timeout=timeout)
    return flags_from_bytes(reply.present)


def node_metric(procs: PoolProcesses, name: str, sample: str, **labels: str) -> float:
    """One sample from node ``name``'s /metrics (tier samples are labelled with the node id)."""
    return metric(scrape(procs.node_metrics_port(name)), sample, **labels)


def wait_demoted(procs: PoolProcesses, name: str, timeout: float = 30.0) -> None:
    """Wait until node ``name`` has written every block DRAM evicted to SSD (demotion runs in the background)."""
    assert wait_until(lambda: node_metric(procs, name, "kvpool_demotion_queue_bytes") == 0, timeout=timeout), \
        f"{name} still has demotions queued after {timeout}s"


def client_errors(client: KVCacheClient, *kinds: str) -> float:
    """The client's ``kvpool_errors_total`` summed over ``kinds`` (all kinds if none given)."""
    total = 0.0
    for family in client.registry.collect():
        for s in family.samples:
            if s.name == "kvpool_errors_total" and (not kinds or s.labels.get("kind") in kinds):
                total += s.value
    return total
