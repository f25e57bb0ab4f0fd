"""Starting up next to what is already there: real ``kvpool node`` / ``master`` / ``serve`` processes.

A node never removes or reuses the arena of a live node (same port, same
``--arena``, or both starting at once), and still reclaims the arena of one
killed with SIGKILL. A port that is taken and an SSD directory another node
holds are refusals: exit code 2, one line on stderr naming the port, or the
arena or directory and the pid that holds it; nothing left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support import START_TIMEOUT_S, PoolProcesses, assert_refused, run_cli, stop_process, wait_serving

from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.tiers.arena import SharedArena, shm_path

BLOCK = 64 << 10


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[PoolProcesses]:
    p = PoolProcesses(tmp_path, **{"dram-bytes": "1M", "max-block-bytes": "64K", "ssd-bytes": "16M"})
    try:
        yield p
    finally:
        p.close()
    p.assert_stopped_cleanly()


@contextlib.contextmanager
def listening(port: int) -> Iterator[socket.socket]:
    """Someone else listening on 127.0.0.1:``port`` for the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        yield sock


def assert_no_arena(name: str) -> None:
    assert not os.path.exists(shm_path(name)), f"{shm_path(name)} was left behind"


def node_flags(procs: PoolProcesses, name: str, **over: object) -> dict:
    return {**procs.node_settings(name), "master": procs.master, **over}


def store_blocks(procs: PoolProcesses, tag: str, n: int = 4) -> dict:
    from kvpool.client.pool import PoolClient

    blocks = {opaque_key(f"{tag}-{i}"): np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)
              for i in range(n)}
    with PoolClient(ClientConfig(master=procs.master)) as pool:
        assert pool.store(list(blocks), list(blocks.values())) == [True] * n
    return blocks


def assert_arena_serves(name: str, inode: int, blocks: dict) -> None:
    """The live node's segment is still the one in /dev/shm, and a same-host reader finds its blocks there."""
    assert os.stat(shm_path(name)).st_ino == inode, "the live node's arena was replaced"
    arena = SharedArena.attach(name)
    try:
        for key, value in blocks.items():
            ref = arena.find(key)
            assert ref is not None, "a block the live node holds is not in the arena any more"
            out = np.empty(BLOCK, np.uint8)
            assert arena.read_into(ref, key, out) and np.array_equal(out, value)
    finally:
        arena.close()


# -- the arena of a live node -----------------------------------------------------------------------


def test_a_second_node_on_the_same_port_is_refused_and_the_live_arena_survives(procs):
    procs.start_master()
    live = procs.start_node("a")
    procs.wait_nodes(1)
    arena = procs.node_settings("a")["arena"]
    inode = os.stat(shm_path(arena)).st_ino
    blocks = store_blocks(procs, "same-port")
    # the same flags again: same port, same arena, same SSD directory
    code, err = run_cli(procs, "node", node_flags(procs, "a"))
    assert_refused(code, err, "node", arena, f"pid {live.pid}")
    assert live.poll() is None
    wait_serving(procs.node_address("a"), proc=live)
    assert_arena_serves(arena, inode, blocks)


def test_a_second_node_with_the_same_arena_is_refused_until_the_first_is_killed(procs):
    procs.start_master()
    live = procs.start_node("a")
    procs.wait_nodes(1)
    arena = procs.node_settings("a")["arena"]
    inode = os.stat(shm_path(arena)).st_ino
    blocks = store_blocks(procs, "same-arena")
    other = node_flags(procs, "b", arena=arena)  # its own ports and SSD directory, the same arena
    code, err = run_cli(procs, "node", other, serving=procs.node_address("b"))
    assert_refused(code, err, "node", arena, f"pid {live.pid}")
    assert_arena_serves(arena, inode, blocks)

    live.kill()  # SIGKILL: the arena stays in /dev/shm, stale; the next node reclaims it
    live.wait(10)
    assert os.path.exists(shm_path(arena))
    again = procs.start_node("b", arena=arena)
    assert again.poll() is None
    reclaimed = SharedArena.attach(arena)
    try:
        assert os.stat(shm_path(arena)).st_ino != inode
        assert all(reclaimed.find(k) is None for k in blocks)  # a fresh arena, not the dead node's
    finally:
        reclaimed.close()
    assert "stale" in (procs.tmp / f"node-b-{len(procs.procs) - 1}.log").read_text()


def test_two_nodes_starting_at_once_with_one_arena_one_serves_the_other_is_refused(procs, tmp_path):
    arena = f"kvpool-test-{procs.tag}-shared"
    flags = [node_flags(procs, n, arena=arena, **{"dram-bytes": "8M"}) for n in ("a", "b")]
    errs = [tmp_path / f"at-once-{i}.err" for i in range(2)]
    started = []
    try:
        for f, e in zip(flags, errs):
            args = procs.cli_flags(f)
            with open(e, "wb") as out:
                started.append(subprocess.Popen([sys.executable, "-m", "kvpool.cli", "node", *args],
                                                stdout=subprocess.DEVNULL, stderr=out))
        deadline = time.monotonic() + START_TIMEOUT_S
        while sum(p.poll() is not None for p in started) < 1:
            assert time.monotonic() < deadline, "neither node refused"
            time.sleep(0.05)
        loser = next(i for i, p in enumerate(started) if p.poll() is not None)
        winner = 1 - loser
        wait_serving(f"127.0.0.1:{flags[winner]['port']}", timeout=START_TIMEOUT_S, proc=started[winner])
        assert_refused(started[loser].returncode, errs[loser].read_text(), "node", arena,
                       f"pid {started[winner].pid}")
        assert started[winner].poll() is None
        SharedArena.attach(arena).close()  # the winner's arena is in place
    finally:
        codes = [stop_process(p) for p in started]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(arena))
    assert codes[winner] == 0


# -- ports and directories that are taken ------------------------------------------------------------


@pytest.mark.parametrize("which", ["port", "data-port", "metrics-port"])
def test_a_node_port_in_use_is_one_line_exit_2_and_nothing_left(procs, which):
    flags = node_flags(procs, "a")
    with listening(int(flags[which])):
        code, err = run_cli(procs, "node", flags, serving=None if which == "port" else procs.node_address("a"))
    assert_refused(code, err, "node", str(flags[which]))
    assert_no_arena(flags["arena"])


@pytest.mark.parametrize("which", ["port", "call-port", "metrics-port"])
def test_a_master_port_in_use_is_one_line_exit_2(procs, which):
    flags = {"port": procs.master_port, "metrics-port": procs.master_metrics_port,
             "call-port": procs.master_call_port}
    with listening(int(flags[which])):
        code, err = run_cli(procs, "master", flags, serving=None if which == "port" else procs.master)
    assert_refused(code, err, "master", str(flags[which]))


@pytest.mark.parametrize("which", ["master-port", "port", "metrics-port"])
def test_a_serve_port_in_use_is_one_line_exit_2_and_nothing_left(procs, which):
    flags = {k: v for k, v in procs.node_settings("n0").items()}
    flags.update({"master-port": procs.master_port, "master-metrics-port": procs.master_metrics_port,
                  "master-call-port": procs.master_call_port})
    with listening(int(flags[which])):
        code, err = run_cli(procs, "serve", flags, serving=None if which in ("port", "master-port")
                            else procs.node_address("n0"))
    assert_refused(code, err, "serve", str(flags[which]))
    assert_no_arena(flags["arena"])


def test_an_ssd_directory_another_node_holds_is_refused_naming_its_pid(procs):
    live = procs.start_node("a")
    ssd_dir = procs.node_settings("a")["ssd-dir"]
    other = node_flags(procs, "b", **{"ssd-dir": ssd_dir})
    code, err = run_cli(procs, "node", other, serving=procs.node_address("b"))
    assert_refused(code, err, "node", ssd_dir, f"pid {live.pid}")
    assert_no_arena(other["arena"])
    assert live.poll() is None

