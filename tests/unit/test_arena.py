"""The shared-memory arena across real processes: shared bytes, reuse detected, never a torn read."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvpool.keys import BlockKey
from kvpool.tiers.arena import KEY_DTYPE, MAP_AHEAD_MIN_BYTES, SharedArena, shm_path
from kvpool.tiers.dram import DramStore

KEY_A = BlockKey(b"A" * 32)
KEY_B = BlockKey(b"B" * 32)


def _child(code: str, arena: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, arena], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


READER = """
import sys, hashlib
from kvpool.tiers.arena import SharedArena
arena = SharedArena.attach(sys.argv[1])
for line in sys.stdin:
    key = bytes.fromhex(line.strip())
    ref = arena.find(key)
    if ref is None:
        print("absent", flush=True); continue
    out = bytearray(ref.length)
    ok = arena.read_into(ref, key, out)
    print(hashlib.sha256(out).hexdigest() if ok else "miss", flush=True)
"""


def test_another_process_maps_the_arena_and_reads_the_same_bytes(arena_name):
    store = DramStore.create(arena_name, 8 << 20, 1 << 20)
    try:
        blocks = {BlockKey(bytes([i]) * 32): os.urandom((1 << 20) - i * 1000) for i in range(1, 5)}
        assert store.put(list(blocks), list(blocks.values())) == [True] * 4
        child = _child(READER, arena_name)
        try:
            import hashlib

            for key, value in blocks.items():
                child.stdin.write(key.hex() + "\n")
                child.stdin.flush()
                assert child.stdout.readline().strip() == hashlib.sha256(value).hexdigest()
            child.stdin.write(KEY_A.hex() + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "absent"
        finally:
            child.stdin.close()
            assert child.wait(timeout=30) == 0
    finally:
        store.close()
    assert not os.path.exists(shm_path(arena_name))


def test_arena_is_private_to_its_user(arena_name):
    arena = SharedArena.create(arena_name, 2 * 4096, 2)
    try:
        mode = stat.S_IMODE(os.stat(shm_path(arena_name)).st_mode)
        assert mode == 0o600
    finally:
        arena.close()


STALE_READER = """
import sys
from kvpool.tiers.arena import SharedArena
arena = SharedArena.attach(sys.argv[1])
key = bytes.fromhex(sys.stdin.readline().strip())
ref = arena.find(key)
print(ref.slot, ref.gen, flush=True)
sys.stdin.readline()  # the owner reuses the slot meanwhile
out = bytearray(ref.length)
print("hit" if arena.read_into(ref, key, out) else "miss", flush=True)
"""


def test_a_slot_reused_under_a_reader_in_another_process_is_a_miss(arena_name):
    store = DramStore.create(arena_name, 2 * 4096, 4096, high_watermark=1.0, low_watermark=1.0)
    try:
        assert store.put([KEY_A], [b"a" * 4096]) == [True]
        child = _child(STALE_READER, arena_name)
        try:
            child.stdin.write(KEY_A.hex() + "\n")
            child.stdin.flush()
            slot, gen = map(int, child.stdout.readline().split())
            store.remove([KEY_A])
            assert store.put([KEY_B], [b"b" * 4096]) == [True]
            assert store.locate([KEY_B])[0].slot == slot  # the very slot the reader holds
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "miss"
        finally:
            child.stdin.close()
            assert child.wait(timeout=30) == 0
    finally:
        store.close()


def test_bytes_changed_under_an_unchanged_generation_are_caught_by_the_checksum(arena_name):
    store = DramStore.create(arena_name, 4096, 4096)
    try:
        store.put([KEY_A], [b"a" * 4096])
        ref = store.locate([KEY_A])[0]
        store.arena.block(ref.slot)[100] ^= 0xFF  # what a torn or reordered copy would look like
        out = bytearray(4096)
        assert not store.arena.read_into(ref, KEY_A, out)
        assert store.get_into([KEY_A], [out]) == [False]
    finally:
        store.close()


CHURN_READER = """
import sys
import numpy as np
from kvpool.tiers.arena import SharedArena
arena = SharedArena.attach(sys.argv[1])
key = b"A" * 32
out = np.empty(int(sys.argv[2]), np.uint8)
ok = miss = torn = 0
print("ready", flush=True)
sys.stdin.readline()
want = int(sys.argv[3])
for _ in range(5_000_000):  # bounded; ends once `want` reads have returned bytes
    if ok >= want:
        break
    ref = arena.find(key)
    if ref is None or not arena.read_into(ref, key, out):
        miss += 1
        continue
    if out.min() != out.max():
        torn += 1
    ok += 1
print(ok, miss, torn, flush=True)
"""


def test_no_torn_read_while_the_owner_rewrites_the_slot(arena_name):
    size, reads = 1 << 20, 300
    store = DramStore.create(arena_name, size, size, high_watermark=1.0, low_watermark=1.0)
    try:
        store.put([KEY_A], [np.zeros(size, np.uint8)])
        child = subprocess.Popen(
            [sys.executable, "-c", CHURN_READER, arena_name, str(size), str(reads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        fills = [np.full(size, v, np.uint8) for v in range(1, 17)]
        child.stdin.write("go\n")
        child.stdin.flush()
        for i in range(1000):  # the reader is reading all along; it stops after `reads` good reads
            store.remove([KEY_A])
            store.put([KEY_A], [fills[i % len(fills)]])
        ok, miss, torn = map(int, child.stdout.readline().split())
        assert child.wait(timeout=60) == 0
        assert torn == 0
        assert ok == reads  # it kept reading until this many reads returned (untorn) bytes
    finally:
        store.close()


def test_attach_refuses_what_is_not_an_arena(arena_name):
    with open(shm_path(arena_name), "wb") as f:
        f.write(b"\0" * 8192)
    with pytest.raises(ValueError, match="not a kvpool arena"):
        SharedArena.attach(arena_name)
    with pytest.raises(ValueError, match="bad arena name"):
        SharedArena.create("../etc/passwd", 1, 1)
    with pytest.raises(FileExistsError):
        SharedArena.create(arena_name, 1, 1)


OWNER = """
import sys
from kvpool.tiers.arena import SharedArena
arena = SharedArena.create(sys.argv[1], 4 * 4096, 4)
print("ready", flush=True)
sys.stdin.read()
"""


def _owner(arena: str) -> subprocess.Popen:
    child = _child(OWNER, arena)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.parametrize("replace_stale", [False, True])
def test_an_arena_a_live_process_holds_is_never_replaced(arena_name, replace_stale):
    child = _owner(arena_name)
    try:
        inode = os.stat(shm_path(arena_name)).st_ino
        with pytest.raises(ValueError) as refused:
            SharedArena.create(arena_name, 2 * 4096, 2, replace_stale=replace_stale)
        message = str(refused.value)
        assert arena_name in message and f"pid {child.pid}" in message and "\n" not in message
        assert os.stat(shm_path(arena_name)).st_ino == inode  # still the live owner's segment
        SharedArena.attach(arena_name).close()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_killed_owners_arena_is_reclaimed_only_when_asked(arena_name):
    child = _owner(arena_name)
    child.kill()  # SIGKILL: the segment stays behind, nobody holds it
    child.wait(timeout=30)
    inode = os.stat(shm_path(arena_name)).st_ino
    with pytest.raises(FileExistsError):
        SharedArena.create(arena_name, 2 * 4096, 2)
    arena = SharedArena.create(arena_name, 2 * 4096, 2, replace_stale=True)
    try:
        assert os.stat(shm_path(arena_name)).st_ino != inode
        assert arena.owner_pid() == os.getpid()
    finally:
        arena.close()
    assert not os.path.exists(shm_path(arena_name))


def test_map_for_write_maps_only_the_chunks_asked_for_and_never_raises(arena_name):
    store = DramStore.create(arena_name, 64 << 20, 1 << 20)
    try:
        reader = SharedArena.attach(arena_name)
        try:
            def resident() -> int:  # pages of the segment mapped in this process, from /proc/self/smaps
                with open("/proc/self/smaps") as f:
                    text = f.read()
                part = text.split(shm_path(arena_name), 1)[1].split("VmFlags", 1)[0]
                return int(part.split("Rss:", 1)[1].split()[0]) * 1024

            before = resident()
            reader.map_for_write(4096 + 100, 1 << 20)  # unaligned: the chunks it touches, whole
            after = resident()
            assert 1 << 20 <= after - before <= (1 << 20) + MAP_AHEAD_MIN_BYTES
            reader.map_for_write(8192, 1 << 19)  # inside what is mapped already: nothing more
            assert resident() == after
            reader.map_for_write(8 << 20, 1 << 20)  # new chunks: mapped too
            assert 1 << 20 <= resident() - after <= (1 << 20) + MAP_AHEAD_MIN_BYTES
            reader.map_for_write(reader.data_bytes - 10, 1 << 20)  # runs past the end: clipped, no error
            reader.map_for_write(0, 0)
        finally:
            reader.close()
    finally:
        store.close()


def test_the_key_index_names_every_block_s_slot_through_churn(arena_name):
    """Random puts and removes: index_find agrees with the store for every key, held or not, after each batch."""
    rng = np.random.default_rng(5)
    store = DramStore.create(arena_name, 256 * 4096, 4096, slots=256, high_watermark=1.0, low_watermark=1.0)
    keys = [BlockKey(rng.bytes(32)) for _ in range(600)]
    try:
        for _ in range(60):
            batch = [keys[i] for i in rng.choice(len(keys), 20, replace=False)]
            if rng.random() < 0.7:
                store.put(batch, [bytes(4096)] * len(batch))
            else:
                store.remove(batch)
            want = np.array([-1 if r is None else r.slot for r in store.locate(keys)])
            got = store.arena.index_find(np.frombuffer(b"".join(keys), dtype=KEY_DTYPE))
            assert (got == want).all()
        reader = SharedArena.attach(arena_name)  # another mapping reads the same index
        try:
            got = reader.index_find(np.frombuffer(b"".join(keys), dtype=KEY_DTYPE))
            assert (got == want).all() and (want >= 0).sum() > 100
        finally:
            reader.close()
    finally:
        store.close()
