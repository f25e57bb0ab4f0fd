"""A busy or stalled host must not make a pool forget its blocks.

Regression: while a newcomer installed torch beside a default ``kvpool serve``, the serve's own master
dropped its own node (``node ... silent for 3.6s: dropped with 7 index entries``) and the node registered
again: every block was a miss until the re-sync. Three faults: a default ``node_timeout_s`` of 3 s (three
heartbeats), a master that counted the time it did not run itself as its nodes' silence (a stopped or
starved process wakes with every node "silent"), and heartbeats sent by the thread that also sends reports
(a slow report delayed them; ``tests/integration/test_node.py`` tests that one).

Here a ``kvpool serve`` runs beside busy processes (more than the machine's cores) and is stopped
(SIGSTOP) for seconds, as a starved or frozen host would be; afterwards it must still list its node with
the same incarnation and every block indexed, for several heartbeats and sweeps, with no drop in its log.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from fault.faultkit import KIB, content, keys_of, stopped
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig

BLOCK = 64 * KIB
BLOCKS = 24
BUSY_PROCESSES = 4  # twice this machine's cores
pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def busy_cpu(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each, for the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait(10)


def _store_blocks(master: str) -> None:
    keys = keys_of("busy", BLOCKS)
    with PoolClient(ClientConfig(master=master, strict=True)) as pool:
        assert pool.store(keys, [content(k, BLOCK) for k in keys]) == [True] * BLOCKS
        assert pool.flush(30)


def _keeps_its_node(procs, incarnation: int, window_s: float) -> None:
    """For ``window_s``: one node, registered as ``incarnation``, with every block indexed."""
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        status = procs.status()
        assert [n.incarnation for n in status.nodes] == [incarnation], status
        assert status.indexed_blocks == BLOCKS, status
        time.sleep(0.1)


def _stall(procs, proc: subprocess.Popen, stall_s: float, window_s: float) -> str:
    """Store the blocks, stop ``proc`` for ``stall_s`` beside busy processes, check the node is kept for
    ``window_s`` after; returns the serve's log."""
    _store_blocks(procs.master)
    incarnation = procs.status().nodes[0].incarnation
    with busy_cpu(BUSY_PROCESSES):
        with stopped(proc) as since:
            wait_until(lambda: time.monotonic() - since >= stall_s, timeout=stall_s + 5, interval=0.05)
        _keeps_its_node(procs, incarnation, window_s)
    log = (procs.tmp / "serve-0.log").read_text()
    for sign in ("dropped with", "re-registered", "lost master"):
        assert sign not in log, log[-3000:]
    return log


def test_a_default_serve_stopped_for_seconds_on_a_busy_host_keeps_its_node_and_blocks(procs):
    proc = procs.serve()  # the master's defaults: node_timeout_s and heartbeat_interval_s as shipped
    # 3.5 s: more than the old default's whole timeout; then 3 s of heartbeats and sweeps must keep it
    _stall(procs, proc, stall_s=3.5, window_s=3.0)


def test_a_master_does_not_count_its_own_stall_as_its_nodes_silence(procs):
    proc = procs.serve(**{"master-node-timeout-s": "1.5", "master-heartbeat-interval-s": "0.25"})
    # stopped for twice the node timeout: master and node alike, so the node was never silent while the
    # master ran; several sweeps (every 0.375 s) and heartbeats follow
    log = _stall(procs, proc, stall_s=3.0, window_s=2.0)
    assert "sweeper woke" in log and "late (this process or its host stalled)" in log, log[-3000:]
