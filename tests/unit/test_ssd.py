"""SsdStore against a real LMDB file (tmp_path) and real processes."""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support import REPO

from kvpool.buffers import BufferLike
from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey, opaque_key
from kvpool.tiers.ssd import FORMAT_VERSION, HEADER_BYTES, MAGIC, SsdInUse, SsdStore
from kvpool.vocabulary import Tier

MIB = 1 << 20


def key(i: int) -> BlockKey:
    return opaque_key(f"block-{i}")


def block(i: int, size: int = MIB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def read_back(store: SsdStore, i: int, size: int = MIB) -> np.ndarray | None:
    out = np.empty(size, dtype=np.uint8)
    return out if store.get_into([key(i)], [out]) == [True] else None


@pytest.mark.parametrize("size", [4096, MIB, 3 * 4096 + 1234])
def test_put_get_byte_exact(tmp_path: Path, size: int) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB) as store:
        assert store.tier is Tier.SSD
        values: list[BufferLike] = [block(1, size), bytearray(block(2, size).tobytes())]
        assert store.put([key(1), key(2)], values) == [True, True]
        outs: list[BufferLike] = [np.full(size, 0xAB, dtype=np.uint8), bytearray(size)]
        assert store.get_into([key(1), key(2)], outs) == [True, True]
        assert np.array_equal(outs[0], block(1, size))
        assert bytes(outs[1]) == block(2, size).tobytes()
        s = store.stats()
        assert (s.hits, s.misses, s.puts, s.blocks) == (2, 0, 2, 2)
        assert s.bytes_in == s.bytes_out == 2 * size
        assert s.used_bytes == 2 * store.entry_cost(size)
        assert store.get_into([key(3)], [outs[0]]) == [False]
        assert store.stats().misses == 1


def test_entry_cost_counts_pages(tmp_path: Path) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB) as store:
        psize = store.page_size
        assert store.entry_cost(MIB) == (-(-(MIB + HEADER_BYTES) // psize) + 1) * psize
        assert store.entry_cost(psize - HEADER_BYTES) == 2 * psize
        assert store.entry_cost(psize - HEADER_BYTES + 1) == 3 * psize


CHILD = r"""
import sys
import numpy as np
from kvpool.keys import opaque_key
from kvpool.tiers.ssd import SsdStore

def block(i, size):
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)

store = SsdStore(sys.argv[1], 64 << 20)
sizes = [4096, 1 << 20, 5000, 1 << 20, 12345, 4096, 1 << 20, 70000, 4096, 1 << 20]
for start, stop in [(0, 1), (1, 5), (5, 10)]:
    ok = store.put([opaque_key(f"block-{i}") for i in range(start, stop)],
                   [block(i, sizes[i]) for i in range(start, stop)])
    assert all(ok), ok
assert store.remove([opaque_key("block-3")]) == 1
print("ready", flush=True)
sys.stdin.read()
"""
CHILD_SIZES = [4096, MIB, 5000, MIB, 12345, 4096, MIB, 70000, 4096, MIB]


def test_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line != "ready\n":
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"child did not get ready: {line!r} {err}")
    finally:
        proc.kill()  # SIGKILL: no close, no sync
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with SsdStore(path, 64 << 20) as store:
        expected = [i for i in range(10) if i != 3]
        assert store.keys() == [key(i) for i in expected]  # write order
        assert store.contains([key(3)]) == [False]
        for i in expected:
            out = read_back(store, i, CHILD_SIZES[i])
            assert out is not None and np.array_equal(out, block(i, CHILD_SIZES[i])), i
        assert store.stats().corrupt == 0


def test_flipped_payload_byte_is_a_corrupt_miss_and_deleted(tmp_path: Path) -> None:
    path = tmp_path / "s"
    victim, healthy = block(10), block(11)
    with SsdStore(path, 16 * MIB) as store:
        assert store.put([key(10), key(11)], [victim, healthy]) == [True, True]
    needle = victim[MIB // 2 : MIB // 2 + 64].tobytes()
    with open(path / "data.mdb", "r+b") as f:
        data = f.read()
        assert data.count(needle) == 1
        pos = data.index(needle) + 17
        f.seek(pos)
        f.write(bytes([data[pos] ^ 0x01]))
    with SsdStore(path, 16 * MIB) as store:
        assert store.contains([key(10), key(11)]) == [True, True]  # headers are fine
        out = np.empty(MIB, dtype=np.uint8)
        assert store.get_into([key(10)], [out]) == [False]
        s = store.stats()
        assert (s.corrupt, s.hits, s.misses, s.blocks) == (1, 0, 1, 1)
        assert store.contains([key(10)]) == [False]
        assert s.used_bytes == store.entry_cost(MIB)
        assert store.get_into([key(10)], [out]) == [False]  # now simply missing
        assert store.stats().corrupt == 1
        good = read_back(store, 11)
        assert good is not None and np.array_equal(good, healthy)
    with SsdStore(path, 16 * MIB) as store:  # the delete was committed
        assert store.keys() == [key(11)]


def test_bad_header_is_dropped_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with SsdStore(path, 16 * MIB) as store:
        assert store.put([key(1), key(2)], [block(1), block(2)]) == [True, True]
    with open(path / "data.mdb", "r+b") as f:
        data = f.read()
        header = data.index(MAGIC + FORMAT_VERSION.to_bytes(2, "little") + bytes(2) + MIB.to_bytes(8, "little") +
                            block_checksum(block(1)).to_bytes(8, "little"))
        f.seek(header)
        f.write(b"XXXX")
    with SsdStore(path, 16 * MIB) as store:
        assert store.keys() == [key(2)]
        assert store.stats().corrupt == 1
        assert store.stats().used_bytes == store.entry_cost(MIB)


def test_capacity_is_never_exceeded_and_eviction_is_lru(tmp_path: Path) -> None:
    cap = 8 * MIB
    store = SsdStore(tmp_path / "s", cap)
    cost = store.entry_cost(MIB)
    per = cap // cost
    assert per == 7
    model: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
    evictions = 0
    kept: BlockKey | None = None
    survived = 0
    n = 0
    sizes = [1, 3, 2, 5, 1, 9, 4, 2, 6, 1, 6]
    for step, size in enumerate(sizes):
        ids = list(range(n, n + size))
        n += size
        before = set(model)
        for i in ids:
            model[key(i)] = i
        while len(model) > per:
            evictions += model.popitem(last=False)[0] in before
        result = store.put([key(i) for i in ids], [block(i) for i in ids])
        assert result == [key(i) in model for i in ids]
        s = store.stats()
        assert s.used_bytes <= cap
        assert s.used_bytes == len(model) * cost and s.blocks == len(model)
        assert s.evictions == evictions
        assert store.keys() == list(model)
        assert store.file_bytes() < store.map_size
        if kept is not None:  # without the read it would have been the first to go
            assert store.contains([kept]) == [True]
            survived += 1
            kept = None
        if len(model) == per and step + 1 < len(sizes) and sizes[step + 1] < per:
            # read the oldest block: the next put must not evict it
            kept = next(iter(model))
            assert store.get_into([kept], [np.empty(MIB, dtype=np.uint8)]) == [True]
            model.move_to_end(kept)
    assert n == 40 and survived >= 3
    for _k, i in model.items():
        out = read_back(store, i)
        assert out is not None and np.array_equal(out, block(i))
    store.close()


def test_restart_orders_by_write_and_trims_to_capacity(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with SsdStore(path, 16 * MIB) as store:
        assert store.put([key(i) for i in range(4)], [block(i) for i in range(4)]) == [True] * 4
        assert store.get_into([key(0)], [np.empty(MIB, dtype=np.uint8)]) == [True]
        assert store.keys() == [key(1), key(2), key(3), key(0)]
    with SsdStore(path, 16 * MIB) as store:
        assert store.keys() == [key(i) for i in range(4)]  # recency is not persisted
        assert store.put([key(4)], [block(4)]) == [True]
    with SsdStore(path, 3 * store.entry_cost(MIB)) as small:
        assert small.keys() == [key(2), key(3), key(4)]
        assert small.stats().evictions == 2
    with SsdStore(path, 16 * MIB) as store:
        assert store.keys() == [key(2), key(3), key(4)]


def test_identical_reput_refreshes_without_writing(tmp_path: Path) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB) as store:
        assert store.put([key(i) for i in range(3)], [block(i) for i in range(3)]) == [True] * 3
        assert store.put([key(0)], [block(0)], checksums=[block_checksum(block(0))]) == [True]
        assert store.stats().puts == 3
        assert store.keys() == [key(1), key(2), key(0)]
        assert store.put([key(1)], [block(99)]) == [True]  # new bytes: rewritten
        assert store.stats().puts == 4
        out = read_back(store, 1)
        assert out is not None and np.array_equal(out, block(99))
        assert store.put([key(5), key(5)], [block(5), block(6)]) == [True, True]
        out = read_back(store, 5)
        assert out is not None and np.array_equal(out, block(6))
        assert store.stats().blocks == 4 and store.stats().used_bytes == 4 * store.entry_cost(MIB)


def test_caller_checksum_mismatch_skips_the_block(tmp_path: Path) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB) as store:
        sums = [block_checksum(block(1)), block_checksum(block(2)) ^ 1]
        assert store.put([key(1), key(2)], [block(1), block(2)], checksums=sums) == [True, False]
        assert store.contains([key(1), key(2)]) == [True, False]
        assert store.stats().corrupt == 1


def test_bad_input_is_value_error_and_changes_nothing(tmp_path: Path) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB, max_value_bytes=2 * MIB) as store:
        assert store.put([key(0), key(1)], [block(0), block(1)]) == [True, True]
        before = (store.stats(), store.keys())
        sentinel = np.full(MIB, 0xAB, dtype=np.uint8)
        cases = [
            lambda: store.get_into([key(0)], [np.empty(MIB - 1, dtype=np.uint8)]),
            lambda: store.get_into([key(0), key(1)], [sentinel, np.empty(MIB + 1, dtype=np.uint8)]),
            lambda: store.get_into([BlockKey(b"x" * 31)], [sentinel]),
            lambda: store.get_into(["not bytes" * 4], [sentinel]),  # type: ignore[list-item]  # on purpose
            lambda: store.get_into([key(0)], [bytes(MIB)]),
            lambda: store.get_into([key(0)], [np.empty(2 * MIB, dtype=np.uint8)[::2]]),
            lambda: store.get_into([key(0), key(1)], [sentinel]),
            lambda: store.put([key(2), BlockKey(b"short")], [block(2), block(3)]),
            lambda: store.put([key(2)], [block(2), block(3)]),
            lambda: store.put([key(2)], [object()]),  # type: ignore[list-item]  # not a buffer, on purpose
            lambda: store.put([key(2)], [block(2)], checksums=[1, 2]),
            lambda: store.put([key(2)], [np.zeros(3 * MIB, dtype=np.uint8)]),
            lambda: store.put([key(2), key(3)], [block(2), np.zeros(3 * MIB, dtype=np.uint8)]),
            lambda: store.remove([BlockKey(b"short")]),
            lambda: store.contains([BlockKey(b"short")]),
        ]
        for i, case in enumerate(cases):
            with pytest.raises(ValueError):
                case()
            assert (store.stats(), store.keys()) == before, i
        assert np.all(sentinel == 0xAB)  # nothing was copied before the size check failed
    with SsdStore(tmp_path / "t", 4 * MIB) as small:
        with pytest.raises(ValueError):
            small.put([key(0)], [np.zeros(4 * MIB, dtype=np.uint8)])  # more than capacity
    with pytest.raises(ValueError):
        SsdStore(tmp_path / "u", 0)
    with pytest.raises(ValueError):
        store.get_into([key(0)], [sentinel])  # closed


def test_remove(tmp_path: Path) -> None:
    with SsdStore(tmp_path / "s", 16 * MIB) as store:
        assert store.put([key(0), key(1)], [block(0), block(1)]) == [True, True]
        assert store.remove([key(0), key(0), key(7)]) == 1
        assert store.keys() == [key(1)]
        assert store.stats().used_bytes == store.entry_cost(MIB)
        assert store.stats().evictions == 0


def test_unreadable_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s"
    path.mkdir()
    (path / "data.mdb").write_bytes(block(5, 64 * 1024).tobytes())
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers.ssd"):
        store = SsdStore(path, 16 * MIB)
    assert any("data.mdb.broken" in r.getMessage() for r in caplog.records)
    assert (path / "data.mdb.broken").read_bytes() == block(5, 64 * 1024).tobytes()
    assert store.stats().blocks == 0
    assert store.put([key(1)], [block(1)]) == [True]
    out = read_back(store, 1)
    assert out is not None and np.array_equal(out, block(1))
    store.close()


def test_one_owner_per_directory(tmp_path: Path) -> None:
    store = SsdStore(tmp_path / "s", 16 * MIB)
    with pytest.raises(SsdInUse, match=f"in use by another process \\(pid {os.getpid()}\\)"):
        SsdStore(tmp_path / "s", 16 * MIB)
    store.close()
    store.close()  # idempotent
    SsdStore(tmp_path / "s", 16 * MIB).close()


def test_map_full_evicts_and_retries_instead_of_raising(tmp_path: Path) -> None:
    cap = 32 * MIB
    store = SsdStore(tmp_path / "s", cap)
    assert store.put([key(i) for i in range(6)], [block(i) for i in range(6)]) == [True] * 6
    assert store._env is not None
    store._env.set_mapsize(store.file_bytes() + MIB)  # far below what the next batch needs
    result = store.put([key(i) for i in range(6, 10)], [block(i) for i in range(6, 10)])
    assert result == [True] * 4
    s = store.stats()
    assert s.used_bytes <= cap and s.evictions >= 4
    assert store.contains([key(i) for i in range(6, 10)]) == [True] * 4
    for i in range(6, 10):
        out = read_back(store, i)
        assert out is not None and np.array_equal(out, block(i))
    store._env.set_mapsize(store.file_bytes())  # no slack at all: a big batch gets False, not an error
    result = store.put([key(i) for i in range(10, 40)], [block(i) for i in range(10, 40)])
    assert store.stats().used_bytes <= cap
    assert store.contains([key(i) for i in range(10, 40)]) == result
    store.close()


def test_concurrent_puts_and_gets_stay_consistent(tmp_path: Path) -> None:
    size = 64 * 1024
    store = SsdStore(tmp_path / "s", 3 * MIB)
    errors: list[BaseException] = []
    wrong: list[int] = []

    def worker(t: int) -> None:
        try:
            out = np.empty(size, dtype=np.uint8)
            for r in range(60):
                ids = [(t * 7 + r * 3 + j) % 90 for j in range(3)]
                store.put([key(i) for i in ids], [block(i, size) for i in ids])
                for i in ids[:2]:
                    if store.get_into([key(i)], [out]) == [True] and not np.array_equal(out, block(i, size)):
                        wrong.append(i)
                assert store.stats().used_bytes <= store.capacity_bytes
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and not wrong
    s = store.stats()
    assert s.used_bytes == s.blocks * store.entry_cost(size) <= store.capacity_bytes
    assert s.hits > 0 and s.evictions > 0
    store.close()
    with SsdStore(tmp_path / "s", 3 * MIB) as again:  # the file agrees with the in-memory LRU
        assert sorted(again.keys()) == sorted(store.keys())


def test_on_change_reports_writes_evictions_removes_and_corrupt_deletions(tmp_path: Path) -> None:
    from kvpool.vocabulary import BlockMeta

    calls: list[tuple[list, list]] = []
    path = tmp_path / "s"
    store = SsdStore(path, 8 * MIB, on_change=lambda a, r: calls.append((list(a), list(r))))
    try:
        assert store.put([key(0), key(1)], [block(0), block(1, 5000)]) == [True, True]
        assert calls == [([BlockMeta(key(0), MIB, block_checksum(block(0))),
                           BlockMeta(key(1), 5000, block_checksum(block(1, 5000)))], [])]
        assert store.put([key(0)], [block(0)]) == [True]  # identical re-put: refresh only, no call
        assert len(calls) == 1
        assert store.meta([key(1), key(9)]) == [BlockMeta(key(1), 5000, block_checksum(block(1, 5000))), None]
        per = 8 * MIB // store.entry_cost(MIB)
        store.put([key(i) for i in range(2, 2 + per)], [block(i) for i in range(2, 2 + per)])
        added, removed = calls[-1]
        assert [m.key for m in added] == [key(i) for i in range(2, 2 + per)]
        assert removed and set(removed) <= {key(0), key(1)}
        assert store.contains(removed) == [False] * len(removed)
        assert store.remove([key(per + 1), key(99)]) == 1
        assert calls[-1] == ([], [key(per + 1)])
        before = store.inventory()
        assert [m.key for m in before] == store.keys()
    finally:
        store.close()
    with SsdStore(path, 8 * MIB) as again:  # size and checksum come back from the headers
        assert again.inventory() == before


def test_corrupt_deletion_is_reported_as_removed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    victim = block(10)
    with SsdStore(path, 16 * MIB) as store:
        assert store.put([key(10)], [victim]) == [True]
    needle = victim[MIB // 2 : MIB // 2 + 64].tobytes()
    with open(path / "data.mdb", "r+b") as f:
        data = f.read()
        pos = data.index(needle) + 17
        f.seek(pos)
        f.write(bytes([data[pos] ^ 0x01]))
    calls: list[tuple[list, list]] = []
    with SsdStore(path, 16 * MIB, on_change=lambda a, r: calls.append((list(a), list(r)))) as store:
        assert calls == []  # what is found at open is in inventory(), not reported
        assert [m.key for m in store.inventory()] == [key(10)]
        assert store.get_into([key(10)], [np.empty(MIB, dtype=np.uint8)]) == [False]
        assert calls == [([], [key(10)])]
        assert store.inventory() == []


def test_another_process_holding_the_directory_is_named_by_pid(tmp_path: Path) -> None:
    path = tmp_path / "s"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        with pytest.raises(SsdInUse) as refused:
            SsdStore(path, 16 * MIB)
        assert str(path) in str(refused.value) and f"pid {holder.pid}" in str(refused.value)
        assert isinstance(refused.value, ValueError) and "\n" not in str(refused.value)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    SsdStore(path, 16 * MIB).close()  # a killed holder's lock is gone with it


HOLDER = """
import sys
from kvpool.tiers.ssd import SsdStore
store = SsdStore(sys.argv[1], 16 << 20)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_capacity_beyond_the_free_disk_is_refused(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError) as refused:
        SsdStore(tmp_path / "s", 2 * free)
    assert refused.value.errno == errno.ENOSPC and "free" in str(refused.value)
    SsdStore(tmp_path / "s", 16 * MIB).close()  # and nothing was left holding the directory


TRUNCATER = """
import json, os, sys
import numpy as np
from kvpool.keys import opaque_key
from kvpool.tiers.ssd import SsdStore

path, cut = sys.argv[1], sys.argv[2]
size = 256 << 10
def key(i): return opaque_key(f"cut-{i}")
def block(i): return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
changes, errors = [], []
store = SsdStore(path, 16 << 20, on_change=lambda a, r: changes.append([len(a), len(r)]), on_error=errors.append)
assert store.put([key(i) for i in range(8)], [block(i) for i in range(8)]) == [True] * 8
data = os.path.join(path, "data.mdb")
os.truncate(data, os.path.getsize(data) // 2 if cut == "half" else 0)
out = np.empty(size, np.uint8)
hits = [store.get_into([key(i)], [out]) == [True] for i in range(8)]   # a SIGBUS used to end the process here
after = dict(blocks=store.stats().blocks, contains=store.contains([key(i) for i in range(8)]))
put = store.put([key(i) for i in range(8, 12)], [block(i) for i in range(8, 12)])
fresh = [store.get_into([key(i)], [out]) == [True] and bool(np.array_equal(out, block(i))) for i in range(8, 12)]
again = store.get_into([key(i) for i in range(8, 12)], [np.empty(size, np.uint8) for _ in range(4)])
store.close()
with SsdStore(path, 16 << 20) as reopened:
    kept = reopened.keys() == [key(i) for i in range(8, 12)]
print(json.dumps(dict(hits=hits, after=after, put=put, fresh=fresh, again=again, changes=changes, errors=errors,
                      broken=os.path.exists(os.path.join(path, "data.mdb.broken")), kept=kept)))
"""


@pytest.mark.parametrize("cut", ["half", "zero"])
def test_a_file_truncated_under_an_open_store_costs_misses_then_starts_empty(tmp_path: Path, cut: str) -> None:
    done = subprocess.run([sys.executable, "-c", TRUNCATER, str(tmp_path / "s"), cut], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, f"exit code {done.returncode}: {done.stderr[-3000:]}"
    r = json.loads(done.stdout)
    assert r["hits"] == [False] * 8  # misses, never bytes of a damaged file
    assert r["after"] == {"blocks": 0, "contains": [False] * 8}
    assert r["changes"][0] == [8, 0] and sum(removed for _, removed in r["changes"][1:2]) == 8  # reported as removed
    assert r["errors"] == ["ssd_file_broken"] and r["broken"]
    assert r["put"] == [True] * 4 and r["fresh"] == [True] * 4 and r["again"] == [True] * 4  # the new file works
    assert r["kept"]  # and is what the next open finds
