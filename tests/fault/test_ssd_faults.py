"""SSD faults: the tier full, its directory unusable, its LMDB file truncated or corrupted.

In every case the node keeps serving its DRAM tier, says what happened in
its metrics and log, and never hands out bytes that are not the block's.

How each fault is made for real, as root and without mount privileges:

- full by capacity: a small ``--ssd-bytes``; full disk: the node runs with
  ``RLIMIT_FSIZE`` capped, so LMDB's writes past the cap fail (EFBIG) as
  they would with ENOSPC (there is no tmpfs to fill without mounting one).
- unusable directory: ``chattr -R +i`` (immutable: even root cannot create
  or open-for-write anything in it; skipped where the filesystem or the
  capabilities do not allow it), or the path is a regular file (a lost mount).
- damaged file: bytes flipped inside stored blocks, the file truncated to half,
  or its first pages (LMDB's meta pages) overwritten, between two node runs;
  or ``data.mdb`` truncated (to half, to 0) under a running node.

An SSD tier that cannot be used at start is a refusal (exit code 2, one line)
unless the node is told the tier is optional (:data:`SSD_OPTIONAL`): then it
serves DRAM only, counted as ``ssd_unavailable``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from fault.faultkit import (
    KIB,
    MIB,
    content,
    keys_of,
    master_exists,
    master_flags,
    node_holds,
    node_logs,
    node_metric,
    start_master,
    start_node,
    wait_demoted,
)
from support import assert_refused, run_cli, stop_process, wait_until

from kvpool.client.pool import PoolClient
from kvpool.tiers.arena import shm_path

BLOCK = 64 * KIB
DRAM_SLOTS = 4
# The node flags that make an unusable SSD tier "DRAM only" instead of a refusal: the one place that
# spells the flag (node.tiers.ssd.optional, flag ssd_optional; support.PoolProcesses turns "true" into the
# --ssd-optional switch).
SSD_OPTIONAL = {"ssd-optional": "true"}


def small_node(procs, **flags: str) -> None:
    procs.node_flags.update({"dram-bytes": str(DRAM_SLOTS * BLOCK), "max-block-bytes": "64K", **flags})


def read_each(pool: PoolClient, keys) -> tuple[int, int]:
    """Look up and load each key on its own; returns (blocks loaded, wrong bytes among them)."""
    hits = wrong = 0
    for key in keys:
        run = pool.lookup([key])
        if not run:
            continue
        out = np.zeros(BLOCK, np.uint8)
        if pool.get_into(run, [out]) == [True]:
            hits += 1
            wrong += int(np.count_nonzero(out != content(key, BLOCK)))
    return hits, wrong


def still_serves_dram(procs, pool: PoolClient, tag: str) -> None:
    """New blocks are stored (in DRAM) and come back byte-exact."""
    fresh = keys_of(tag, DRAM_SLOTS)
    assert pool.store(fresh, [content(k, BLOCK) for k in fresh]) == [True] * DRAM_SLOTS
    assert pool.flush()  # in the master's index (the node reports in the background)
    assert read_each(pool, fresh) == (DRAM_SLOTS, 0)


def index_matches_node(procs, keys) -> bool:
    return master_exists(procs, keys) == node_holds(procs.node_address("n0"), keys)


@pytest.mark.parametrize("full", ["capacity", "disk"])
def test_a_full_ssd_keeps_dram_serving_and_never_returns_wrong_bytes(procs, client_config, full):
    small_node(procs, **{"ssd-bytes": "1M" if full == "capacity" else "16M"})
    start_master(procs, **master_flags())
    node = start_node(procs, "n0", file_size_limit=MIB if full == "disk" else None)
    procs.wait_nodes(1)
    keys = keys_of(f"ssd-full-{full}", 48)  # 3 MiB through 256 KiB of DRAM: most must go down to the SSD
    with PoolClient(client_config()) as pool:
        for i in range(0, len(keys), 4):
            batch = keys[i : i + 4]
            assert pool.store(batch, [content(k, BLOCK) for k in batch]) == [True] * 4  # DRAM always takes them
        wait_demoted(procs, "n0")  # every demotion has been tried: what the SSD refused is gone
        wait_until(lambda: index_matches_node(procs, keys), timeout=10)
        hits, wrong = read_each(pool, keys)
        assert wrong == 0
        assert DRAM_SLOTS <= hits < len(keys)  # the newest are in DRAM; the SSD could not keep everything
        still_serves_dram(procs, pool, f"ssd-full-{full}-after")
    assert node.poll() is None
    used = node_metric(procs, "n0", "kvpool_tier_used_bytes", node="n0", tier="ssd")
    capacity = node_metric(procs, "n0", "kvpool_tier_capacity_bytes", node="n0", tier="ssd")
    write_errors = node_metric(procs, "n0", "kvpool_errors_total", kind="ssd_write")
    assert used <= capacity
    if full == "capacity":
        assert node_metric(procs, "n0", "kvpool_tier_evictions_total", node="n0", tier="ssd") > 0
        assert write_errors == 0
    else:
        assert write_errors > 0
        assert "SSD store" in node_logs(procs, "n0") and "write failed" in node_logs(procs, "n0")
    print(f"\nFIGURES ssd-full ({full}): {hits}/{len(keys)} blocks still served, 0 wrong bytes; SSD used "
          f"{used / MIB:.2f} of {capacity / MIB:.0f} MiB; {write_errors:.0f} failed SSD writes counted")


def make_immutable(path) -> None:
    done = subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True, text=True, check=False)
    probe = path / "kvpool-probe"
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {done.stderr.strip()}")
    try:
        probe.touch()
    except OSError:
        return
    probe.unlink()
    subprocess.run(["chattr", "-R", "-i", str(path)], check=False)
    pytest.skip("an immutable directory is still writable here")


def make_unusable(procs, ssd_dir, how: str) -> dict[str, str]:
    """Make the SSD directory unusable in way ``how``; returns the node flags that go with it."""
    if how == "immutable":
        make_immutable(ssd_dir)
    elif how == "not-a-directory":
        ssd_dir.rename(procs.tmp / "ssd-n0.moved")
        ssd_dir.write_text("not a directory")
    else:  # more than the disk has free (LMDB's file is sparse: nothing would fail until the disk filled up)
        return {"ssd-bytes": str(2 * shutil.disk_usage(ssd_dir.parent).free)}
    return {}


UNUSABLE = ["immutable", "not-a-directory", "too-large"]


@pytest.mark.parametrize("how", UNUSABLE)
def test_an_unusable_ssd_directory_leaves_the_node_serving_dram_when_the_ssd_is_optional(procs, client_config, how):
    small_node(procs, **{"ssd-bytes": "16M", "write-through": "true"})
    start_master(procs, **master_flags())
    node = start_node(procs, "n0")
    procs.wait_nodes(1)
    old = keys_of(f"ssd-dir-{how}", 4)
    with PoolClient(client_config(strict=True)) as pool:
        assert pool.store(old, [content(k, BLOCK) for k in old]) == [True] * 4
    assert stop_process(node) == 0
    ssd_dir = procs.tmp / "ssd-n0"
    try:
        flags = make_unusable(procs, ssd_dir, how)
        start_node(procs, "n0", **flags, **SSD_OPTIONAL)
        procs.wait_nodes(1)
        assert node_metric(procs, "n0", "kvpool_errors_total", kind="ssd_unavailable") == 1
        assert node_metric(procs, "n0", "kvpool_tier_capacity_bytes", node="n0", tier="ssd") == 0  # no SSD tier
        assert "DRAM only" in node_logs(procs, "n0")
        assert master_exists(procs, old) == [False] * 4  # what the SSD held is out of reach: misses
        with PoolClient(client_config()) as pool:
            assert read_each(pool, old) == (0, 0)
            still_serves_dram(procs, pool, f"ssd-dir-{how}-after")
    finally:
        if how == "immutable":
            subprocess.run(["chattr", "-R", "-i", str(ssd_dir)], check=False)


@pytest.mark.parametrize("how", UNUSABLE)
def test_an_unusable_ssd_directory_is_a_refusal_unless_optional(procs, how):
    small_node(procs, **{"ssd-bytes": "16M"})
    ssd_dir = procs.tmp / "ssd-n0"
    ssd_dir.mkdir()
    (ssd_dir / "kept").write_text("x")
    try:
        flags = {**procs.node_settings("n0"), "master": procs.master, **make_unusable(procs, ssd_dir, how)}
        code, err = run_cli(procs, "node", flags, serving=procs.node_address("n0"))
        line = assert_refused(code, err, "node", str(ssd_dir))
        assert "ssd_optional" in line  # it says how to start anyway
        assert not os.path.exists(shm_path(flags["arena"]))
    finally:
        if how == "immutable":
            subprocess.run(["chattr", "-R", "-i", str(ssd_dir)], check=False)


def flip_block_bytes(data_file, keys) -> None:
    """Flip one byte in the middle of each block's stored payload (found by its first 4 KiB)."""
    raw = bytearray(data_file.read_bytes())
    for key in keys:
        at = raw.find(content(key, BLOCK)[: 4 * KIB].tobytes())
        assert at >= 0, "block not found in data.mdb"
        raw[at + BLOCK // 2] ^= 0xFF
    data_file.write_bytes(raw)


@pytest.mark.parametrize("damage", ["flipped-bytes", "truncated", "meta-overwritten"])
def test_a_damaged_lmdb_file_never_yields_wrong_bytes(procs, client_config, damage):
    small_node(procs, **{"ssd-bytes": "16M", "write-through": "true"})
    start_master(procs, **master_flags())
    node = start_node(procs, "n0")
    procs.wait_nodes(1)
    keys = keys_of(f"ssd-damaged-{damage}", 12)
    with PoolClient(client_config(strict=True)) as pool:
        assert pool.store(keys, [content(k, BLOCK) for k in keys]) == [True] * len(keys)
    assert stop_process(node) == 0
    data_file = procs.tmp / "ssd-n0" / "data.mdb"
    size = data_file.stat().st_size
    broken = keys[::4]  # 3 of the 12
    if damage == "flipped-bytes":
        flip_block_bytes(data_file, broken)
    elif damage == "truncated":
        os.truncate(data_file, size // 2)
    else:
        with open(data_file, "r+b") as f:
            f.write(np.random.default_rng(7).bytes(8 * KIB))

    start_node(procs, "n0")  # must come up (a truncated LMDB file used to kill it with SIGBUS at every start)
    procs.wait_nodes(1)
    log = node_logs(procs, "n0")
    with PoolClient(client_config(shared_memory=False)) as remote, PoolClient(client_config()) as local:
        if damage == "flipped-bytes":
            assert master_exists(procs, keys) == [True] * len(keys)  # headers intact: all indexed again
            hits, wrong = read_each(remote, keys)
            assert (hits, wrong) == (len(keys) - len(broken), 0)  # the damaged ones are misses
            assert node_metric(procs, "n0", "kvpool_tier_corrupt_blocks_total", node="n0", tier="ssd") == len(broken)
            wait_until(lambda: master_exists(procs, broken) == [False] * len(broken))  # and leave the index
            assert read_each(local, keys) == (len(keys) - len(broken), 0)
        else:
            assert (procs.tmp / "ssd-n0" / "data.mdb.broken").exists()
            assert "data.mdb.broken" in log
            assert node_metric(procs, "n0", "kvpool_errors_total", kind="ssd_file_broken") == 1
            assert master_exists(procs, keys) == [False] * len(keys)  # the store started empty
            assert read_each(remote, keys) == (0, 0)
        still_serves_dram(procs, local, f"ssd-damaged-{damage}-after")
    print(f"\nFIGURES ssd-damaged ({damage}): node up, {len(keys)} blocks checked, 0 wrong bytes")


def store_in_fours(pool: PoolClient, keys) -> None:
    for i in range(0, len(keys), 4):
        batch = keys[i : i + 4]
        assert pool.store(batch, [content(k, BLOCK) for k in batch]) == [True] * 4


def cut_under_the_node(procs, node, remote: PoolClient, local: PoolClient, cut: str, times: int) -> None:
    """Store 12 blocks (most end up on SSD only), cut data.mdb, then read, write and read again."""
    data_file = procs.tmp / "ssd-n0" / "data.mdb"
    keys = keys_of(f"ssd-cut-{cut}", 12)  # 12 blocks through 4 DRAM slots
    store_in_fours(remote, keys)
    wait_demoted(procs, "n0")
    assert node_metric(procs, "n0", "kvpool_tier_blocks", node="n0", tier="ssd") >= len(keys)
    os.truncate(data_file, data_file.stat().st_size // 2 if cut == "half" else 0)

    hits, wrong = read_each(remote, keys)  # this used to kill the node with SIGBUS
    assert node.poll() is None, f"the node died (exit code {node.returncode})"
    assert wrong == 0
    assert hits < len(keys)  # the SSD-only blocks are gone: misses
    assert node_metric(procs, "n0", "kvpool_errors_total", kind="ssd_file_broken") == times
    assert (procs.tmp / "ssd-n0" / "data.mdb.broken").exists()
    wait_until(lambda: index_matches_node(procs, keys))  # the lost blocks left the master's index
    assert read_each(local, keys) == (hits, 0)

    still_serves_dram(procs, local, f"ssd-cut-{cut}-dram")
    fresh = keys_of(f"ssd-cut-{cut}-fresh", 12)  # the new SSD file takes writes: these end up on SSD only
    store_in_fours(remote, fresh)
    wait_demoted(procs, "n0")
    assert read_each(remote, fresh) == (len(fresh), 0)


def test_a_running_nodes_truncated_lmdb_file_costs_misses_not_the_process(procs, client_config):
    """``data.mdb`` cut short under a live node (to half, then to nothing): misses, a fresh SSD, no SIGBUS."""
    small_node(procs, **{"ssd-bytes": "16M", "write-through": "true"})
    start_master(procs, **master_flags())
    node = start_node(procs, "n0")
    procs.wait_nodes(1)
    with PoolClient(client_config(shared_memory=False)) as remote, PoolClient(client_config()) as local:
        cut_under_the_node(procs, node, remote, local, "half", times=1)
        cut_under_the_node(procs, node, remote, local, "zero", times=2)
    assert node.poll() is None
    print("\nFIGURES ssd-truncated-live: node up after data.mdb was cut to half and to 0, 0 wrong bytes")
