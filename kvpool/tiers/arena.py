"""A shared-memory arena: the bytes of the DRAM tier, mappable by any process on the host.

Layout of the segment (``/dev/shm/<name>``, mode 0600 unless the owner asks
for its group too; exactly that mode, whatever the umask: whoever can map
the segment reads every block in it)::

    [header: 4 KiB][slot table: num_slots x 64 B][stamps: num_slots x 8 B][key index: ~32 B a slot]
    [inventory: ~80 B a key][pad to 4 KiB][data: data_bytes]

A *slot* is one row of the slot table: it names one block's bytes, an
extent of the data region of any length. A row holds ``gen`` (u64),
``length`` (u64), ``checksum`` (u64), the 32-byte ``key`` and ``offset``
(u64, into the data region). Which extents are free is the owner's business
(:class:`kvpool.tiers.extents.ExtentAllocator`); the segment only records
where each committed block is.

Generation protocol (a seqlock per slot):
- ``gen`` is even iff the slot holds a committed block; odd while it is free
  or being written. Every commit gets a new even value, so (slot, gen) names
  one block's bytes for as long as they last.
- Only the arena's owner (the process that created it, through
  :class:`kvpool.tiers.dram.DramStore`) changes ``gen``, ``length``,
  ``checksum``, ``key`` and ``offset``. Others may read any slot and may
  write the data of a slot the owner has handed them while it is odd.
- Each hand-over of a free slot (:meth:`SharedArena.claim`) sets its extent
  and moves its gen to a new odd value, so (slot, odd gen) names one writer's
  turn: a writer checks it before writing, and a slot taken back and handed on
  has another.
- A reader checks ``gen``, ``key``, ``length`` and ``checksum`` against what
  it was told (:meth:`SharedArena.check_slots`, the one place this check
  lives), copies, verifies the checksum of what it copied and checks ``gen``
  again: if the slot was reused under it, it sees a miss, never another
  block's bytes. A row's ``offset`` and ``length`` are bounded by the data
  region before any copy, so a torn row cannot send a reader out of it.

Key index: the owner publishes which slot holds each committed key in a
bucketed hash table (:class:`kvpool.tiers.bucket_table.BucketTable`, load at
most 1/2 of num_slots; tag: the key's first 8 bytes, 0 meaning empty;
value: the slot), so a same-host reader finds a block's slot without asking
the node (:meth:`SharedArena.index_find`). It is a hint, like a stamp: only
the owner writes it, a reader checks the row it names
(:meth:`SharedArena.check_slots`) before trusting it, and an entry it misses
(a key the table had no room for, or one written while it looked) is only a
miss, asked of the node instead.

Inventory: the owner (the node's :class:`~kvpool.tiers.node_store.NodeStore`,
which sees both tiers) also publishes every key the node holds, in DRAM,
on SSD or on its way there (the demotion queue), with where it is best
served (DRAM before SSD), its size and its checksum, in a second table of
the same kind (room for ``num_slots + ssd_keys`` keys, ``ssd_keys`` fixed at
creation; tag: the key's first 8 bytes, mapped to 1 if 0; values: its next 8
bytes, the size, the checksum, the tier). Only the owner writes it
(:meth:`SharedArena.inventory_put`, :meth:`SharedArena.inventory_discard`),
anyone reads it (:meth:`SharedArena.inventory_meta`): it answers a
same-host lookup with no round trip. Keys are hashes, so two keys sharing
16 bytes are not expected; if they did, they would share an entry (a false
"held", or, once one went, a false "not held": a miss either way).

Inventory state: a u64 in the header any reader reads
(:meth:`SharedArena.inventory_state`), saying whether the inventory table
may be taken for the whole truth:
- ``COMPLETE`` (1): it names every key the node holds.
- ``INCOMPLETE`` (2, and 0 in a segment nobody declared): some key may be
  missing (an insert found no room, the owner could not keep it true, or a
  new arena whose owner has not filled and declared it yet): a reader must
  ask the master (or the node) instead. Once the owner found one failure it
  stays so for the segment's life; a restarted node makes a new one.
The tables are read without locks, so a read racing the owner's write may
be wrong for that moment: a false "not held" is a lookup miss, a false
"held" (or another key's size and checksum) costs the later read a miss
(the reader still checks rows and checksums), never wrong bytes.

Stamps: ``stamps[slot]`` is the ``CLOCK_MONOTONIC`` time (ns, the same clock
in every process of the host) of the slot's last read. Any process may write
it (:meth:`SharedArena.touch`), after or before it reads; the owner's LRU
orders blocks by it, so same-host reads keep a block alive exactly like the
owner's own reads. A stamp is only a hint of recency: a wrong one can make
the owner evict the wrong block first, never serve wrong bytes.

Ownership of the name (one live owner per ``/dev/shm/<name>``):
- The owner holds an exclusive ``flock`` on the segment itself for as long as
  it lives; the kernel drops it when the process dies, SIGKILL included.
  Readers never lock, so they are not affected.
- :meth:`SharedArena.create` makes the file with ``O_EXCL``, locks it and
  then checks that the name still leads to it: an owner is a process that
  holds the lock of the file under the name, so of two owners starting at
  once exactly one gets it (the other sees a held lock and refuses).
- A segment already under the name is never touched while a live process
  holds its lock: ``create`` refuses (ValueError naming the holder's pid). One
  nobody holds is stale (its owner died): ``create(replace_stale=True)`` takes
  its lock, checks it is still the one under the name, unlinks it and makes a
  new one; without ``replace_stale`` it is a FileExistsError. Only a holder of
  a segment's lock ever unlinks it.
- The owner's pid is in the header (after the fields above), so a refusal
  can name it; :func:`flock_holder` asks ``/proc/locks`` first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kvpool.buffers import BufferLike, as_array, as_buffer
from kvpool.checksum import copy_with_checksum
from kvpool.keys import KEY_BYTES, BlockKey
from kvpool.tiers.bucket_table import BucketTable, table_buckets, table_bytes
from kvpool.vocabulary import NO_TIER

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MAGIC = b"KVPARENA"
_VERSION = 5
_HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIQQQQQ")  # magic, version, pad, data_bytes, num_slots, table_off, stamps_off, data_off
_OWNER = struct.Struct("<Q")  # the owner's pid, at _OWNER_OFF in every version
_OWNER_OFF = 64
_SSD_KEYS = struct.Struct("<Q")  # how many SSD keys the inventory has room for beyond num_slots
_SSD_KEYS_OFF = 72
_STATE_OFF = 128  # the inventory state word (u64), on a cache line of its own
MAX_SSD_KEYS = 1 << 28  # ~20 GiB of inventory: beyond any sane configuration
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

SLOT_DTYPE = np.dtype(
    [("gen", "<u8"), ("length", "<u8"), ("checksum", "<u8"), ("key", f"V{KEY_BYTES}"), ("offset", "<u8")]
)
KEY_DTYPE = SLOT_DTYPE["key"]
MAP_AHEAD_MIN_BYTES = 64 << 10  # map_for_write maps ahead only extents at least this long
assert SLOT_DTYPE.itemsize == 64, "arena: slot table rows must stay 64 bytes"


class InventoryState(IntEnum):
    """Whether a node's inventory table is the whole truth (the header's inventory state word; module docstring)."""

    UNDECLARED = 0  # nobody declared it (a bare arena): as INCOMPLETE
    COMPLETE = 1  # the inventory table names every key the node holds
    INCOMPLETE = 2  # some key may be missing: ask the master


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def shm_path(name: str) -> str:
    """The file behind a named arena; ValueError for names that are not a plain file name."""
    if not _NAME_RE.match(name):
        raise ValueError(f"bad arena name {name!r}: use letters, digits, '_', '-', '.'")
    return os.path.join(SHM_DIR, name)


def flock_holder(fd: int) -> int | None:
    """The pid holding a ``flock`` on the file open as ``fd`` (from /proc/locks), or None if it cannot be told."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "FLOCK" not in parts:
            continue
        at = parts.index("FLOCK")
        if parts[at - 1] == "->" or len(parts) < at + 5:  # a waiter, not the holder
            continue
        try:
            major, minor, inode = parts[at + 4].split(":")
            if (int(inode), int(major, 16), int(minor, 16)) == (st.st_ino, os.major(st.st_dev), os.minor(st.st_dev)):
                pid = int(parts[at + 3])
                return pid or None  # 0: a process outside our pid namespace
        except ValueError:
            continue
    return None


def _header_pid(fd: int) -> int | None:
    """The owner pid a segment's header records (None if it has none)."""
    try:
        raw = os.pread(fd, _HEADER_BYTES, 0)
    except OSError:
        return None
    if len(raw) < _OWNER_OFF + _OWNER.size or raw[:8] != _MAGIC:
        return None
    return _OWNER.unpack_from(raw, _OWNER_OFF)[0] or None


def _in_use(name: str, path: str, fd: int) -> ValueError:
    pid = flock_holder(fd) or _header_pid(fd)
    who = f"pid {pid}" if pid else "pid unknown"
    return ValueError(f"arena {name!r} ({path}) is held by a live process ({who}): another node runs with this "
                      "arena name (the default comes from the port); stop it or choose another arena")


_TAKE_TRIES = 16
_NEW_LOCK_WAIT_S = 2.0  # our brand-new segment is locked by another only while it looks at it (microseconds)


def _take_name(name: str, path: str, replace_stale: bool) -> int:
    """An fd of a new, empty segment under ``path`` that we hold the lock of; see "Ownership" above."""
    for _ in range(_TAKE_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            fd = -1
        except OSError as exc:
            raise ValueError(f"cannot create arena {name!r} at {path}: {exc.strerror}") from exc
        if fd >= 0:
            # Until we hold its lock, a process looking at the name may take our new file for a stale one.
            deadline = time.monotonic() + _NEW_LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        raise ValueError(f"arena {name!r} ({path}): another process keeps it locked") from None
                    time.sleep(0.001)
            if _is_at(fd, path):
                return fd
            os.close(fd)  # unlinked under us before we held it: someone else is taking the name; look again
            continue
        try:
            old = _open_existing(path)
        except FileNotFoundError:
            continue  # gone meanwhile: try to create it again
        except OSError as exc:
            raise ValueError(f"arena {name!r}: cannot open the existing {path} ({exc.strerror})") from exc
        try:
            try:
                fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(name, path, old) from None
            if not _is_at(old, path):
                continue  # replaced meanwhile: look at the new one
            if not replace_stale:
                raise FileExistsError(errno.EEXIST, f"arena {name!r} exists (stale: no live process holds it)", path)
            pid = _header_pid(old)
            log.warning("arena %s already exists but is stale (its owner%s is gone without removing it); "
                        "replacing it", path, f", pid {pid}," if pid else "")
            if os.fstat(old).st_size >= _STATE_OFF + 8:  # readers still mapping it: its inventory is not the truth
                with contextlib.suppress(OSError):  # opened read-only: they notice the new segment within 0.1 s
                    os.pwrite(old, struct.pack("<Q", InventoryState.INCOMPLETE), _STATE_OFF)
            os.unlink(path)  # we hold its lock: no live owner uses the name
        finally:
            os.close(old)
    raise ValueError(f"arena {name!r}: {path} keeps being replaced by other processes; not starting")


def _open_existing(path: str) -> int:
    """The segment already under ``path``, read-write if we may (to mark it stale for its readers), else read-only."""
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)


def _is_at(fd: int, path: str) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    st = os.fstat(fd)
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where one committed block lives in an arena: valid while the slot's gen is unchanged."""

    slot: int
    gen: int
    offset: int
    length: int
    checksum: int


class SharedArena:
    """One mapped arena segment. Create with :meth:`create` (owner) or :meth:`attach` (anyone)."""

    def __init__(self, name: str, mm: mmap.mmap, layout: _Layout, owner: bool, lock_fd: int | None = None):
        self.name = name
        self.data_bytes = layout.data_bytes
        self.num_slots = num_slots = layout.num_slots
        self.ssd_keys = layout.ssd_keys  # room in the inventory beyond num_slots (SSD keys)
        self.owner = owner
        self.file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the segment, for attached mappings
        self._lock_fd = lock_fd  # the owner's open, flock-ed segment (see "Ownership"); closed last
        self._mm = mm
        self._data_off = layout.data_off
        buf = np.frombuffer(mm, dtype=np.uint8)
        self.table = buf[layout.table_off : layout.table_off + num_slots * SLOT_DTYPE.itemsize].view(SLOT_DTYPE)
        self.gens = self.table["gen"]
        self.stamps = buf[layout.stamps_off : layout.stamps_off + num_slots * 8].view(np.uint64)
        self.index = BucketTable(buf, layout.index_off, layout.index_buckets, 1)
        self.inventory = BucketTable(buf, layout.inventory_off, layout.inventory_buckets, 4)
        self._state = buf[_STATE_OFF : _STATE_OFF + 8].view(np.uint64)
        self.data = buf[layout.data_off : layout.data_off + layout.data_bytes]
        self._mapped_for_write: np.ndarray | None = None  # per MAP_AHEAD_MIN_BYTES of data: mapped here already
        # owner only: keys in the inventory, and whether any publication failed (see "Inventory state")
        self._inventory_count = 0
        self._lost = False
        self._state_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------

    @classmethod
    def create(cls, name: str, data_bytes: int, num_slots: int, mode: int = 0o600, *,
               replace_stale: bool = False, ssd_keys: int = 0) -> SharedArena:
        """Create and map a new arena; its memory is reserved up front (ENOSPC now, not SIGBUS later).

        ``data_bytes`` of block data, described by at most ``num_slots``
        rows; an inventory table with room for ``num_slots + ssd_keys`` keys
        (40 to 80 bytes of the segment a key). Its inventory state starts
        ``INCOMPLETE`` (until the owner filled it: :meth:`declare_inventory`).
        The segment gets exactly ``mode`` (owner read-write, optionally the
        group's too; never other users: ValueError). A segment already
        under ``name`` that a live process holds is a ValueError naming its
        pid; one nobody holds (its owner died) is replaced with
        ``replace_stale``, else a FileExistsError (see "Ownership" in the
        module docstring). A failure after the name was taken (no room in
        /dev/shm) removes the new segment.
        """
        if num_slots < 1 or data_bytes < 1:
            raise ValueError(f"arena needs num_slots >= 1 and data_bytes >= 1, got {num_slots}, {data_bytes}")
        if not 0 <= ssd_keys <= MAX_SSD_KEYS:
            raise ValueError(f"arena ssd_keys must be 0 to {MAX_SSD_KEYS}, got {ssd_keys}")
        if mode & ~0o660 or mode & 0o600 != 0o600:
            raise ValueError(f"arena mode {mode:#o}: the owner reads and writes (0600), only its group may be added")
        path = shm_path(name)
        layout = _Layout.of(data_bytes, num_slots, ssd_keys)
        fd = _take_name(name, path, replace_stale)
        mm: mmap.mmap | None = None
        try:
            os.fchmod(fd, mode)  # exactly this, not what the umask leaves of it
            try:
                os.posix_fallocate(fd, 0, layout.total)
            except OSError as exc:
                raise ValueError(f"cannot reserve {layout.total} bytes of shared memory for arena {name!r}: "
                                 f"{exc}") from exc
            mm = mmap.mmap(fd, layout.total)
            _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, 0, data_bytes, num_slots, layout.table_off, layout.stamps_off,
                              layout.data_off)
            _OWNER.pack_into(mm, _OWNER_OFF, os.getpid())
            _SSD_KEYS.pack_into(mm, _SSD_KEYS_OFF, ssd_keys)
            struct.pack_into("<Q", mm, _STATE_OFF, InventoryState.INCOMPLETE)
            rows = np.frombuffer(mm, dtype=SLOT_DTYPE, count=num_slots, offset=layout.table_off)
            rows["gen"] = 1  # every slot starts free (odd)
            del rows
        except BaseException:
            if mm is not None:
                mm.close()
            os.unlink(path)  # ours: we hold its lock
            os.close(fd)
            raise
        return cls(name, mm, layout, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str) -> SharedArena:
        """Map an existing arena created by another process (read/write, never owner)."""
        path = shm_path(name)
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size < _HEADER_BYTES:
                raise ValueError(f"{path} is not a kvpool arena (too small)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, _, data_bytes, num_slots, table_off, stamps_off, data_off = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC or version != _VERSION:
            mm.close()
            raise ValueError(f"{path} is not a kvpool arena of version {_VERSION}")
        (ssd_keys,) = _SSD_KEYS.unpack_from(mm, _SSD_KEYS_OFF)
        layout = _Layout.of(data_bytes, num_slots, ssd_keys) if num_slots >= 1 and ssd_keys <= MAX_SSD_KEYS else None
        if layout is None or (table_off, stamps_off, data_off) != (layout.table_off, layout.stamps_off,
                                                                   layout.data_off) or layout.total > size:
            mm.close()
            raise ValueError(f"{path} is truncated or not laid out as a kvpool arena")
        arena = cls(name, mm, layout, owner=False)
        arena.file_id = (st.st_dev, st.st_ino)
        return arena

    def owner_pid(self) -> int | None:
        """The pid of the process that created this segment, as its header records it."""
        return _OWNER.unpack_from(self._mm, _OWNER_OFF)[0] or None

    def is_current(self) -> bool:
        """Whether ``/dev/shm/<name>`` is still the segment this mapping holds (a restarted node makes a new one)."""
        try:
            st = os.stat(shm_path(self.name))
        except OSError:
            return False
        return self.file_id is None or (st.st_dev, st.st_ino) == self.file_id

    def populate(self, stop: threading.Event | None = None, chunk_bytes: int = 64 << 20) -> bool:
        """Map every page of the segment into this process now (in chunks; stops early once ``stop`` is set).

        A page's first touch in each process costs a page fault (~0.75 ms per
        MiB on some VMs, several times a memcpy), so the owner calls this once,
        in a background thread, instead of paying it on the data path. Returns
        True if it went through the whole segment. Call :meth:`close` only
        after it returned.
        """
        mm = self._mm
        size = len(mm)
        for start in range(0, size, chunk_bytes):
            if stop is not None and stop.is_set():
                return False
            length = min(chunk_bytes, size - start)
            try:
                mm.madvise(_MADV_POPULATE_WRITE, start, length)
            except (OSError, ValueError):  # kernels before 5.14: touch one byte per page instead
                view = np.frombuffer(mm, dtype=np.uint8, count=length, offset=start)
                int(view[:: mmap.PAGESIZE].sum())
                del view
        return True

    def map_for_write(self, offset: int, length: int) -> None:
        """Map the pages of ``data[offset : offset + length]`` writable in this process now, in one call.

        A writer's first touch of a page it has not mapped yet is a page fault
        per 4 KiB (shared-file mappings get no fault-around on writes); asking
        the kernel for the whole extent at once costs ~30% less here. The
        extent is widened to whole ``MAP_AHEAD_MIN_BYTES`` chunks, and a chunk
        this process mapped once is not asked for again (the call costs ~0.1 ms
        a MiB even for pages already mapped). Only chunks a write touches are
        mapped (never the whole arena); a kernel without ``MADV_POPULATE_WRITE``
        (before 5.14) just faults as before. A hint only: a page the kernel
        dropped since faults in again on its write.
        """
        if length < MAP_AHEAD_MIN_BYTES:  # a page or a few: their faults cost what the call does
            return
        if self._mapped_for_write is None:
            self._mapped_for_write = np.zeros(-(-self.data_bytes // MAP_AHEAD_MIN_BYTES), dtype=bool)
        first_chunk = offset // MAP_AHEAD_MIN_BYTES
        end_chunk = min(-(-(offset + length) // MAP_AHEAD_MIN_BYTES), len(self._mapped_for_write))
        if end_chunk <= first_chunk or self._mapped_for_write[first_chunk:end_chunk].all():
            return
        start = self._data_off + first_chunk * MAP_AHEAD_MIN_BYTES
        first = start - start % mmap.PAGESIZE
        end = min(self._data_off + end_chunk * MAP_AHEAD_MIN_BYTES, self._data_off + self.data_bytes, len(self._mm))
        if end <= first:
            return
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE, first, end - first)
        except (OSError, ValueError):
            return
        self._mapped_for_write[first_chunk:end_chunk] = True

    def close(self) -> None:
        """Unmap; the owner also removes the segment (if it is still its own) and releases the name.

        Views handed out must be dropped first. Idempotent.
        """
        if self.owner and self._state is not None:  # readers still mapping it must not take it for the truth
            self._state[0] = InventoryState.INCOMPLETE
        # Drop the views so the mapping can close. They are typed as they are while open (every use): after
        # close, a use fails loudly on None, a state the types do not follow.
        self.table = self.gens = self.stamps = self.data = self._state = None  # type: ignore[assignment]
        self.index = self.inventory = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        if self._lock_fd is not None:
            path = shm_path(self.name)
            try:
                st, now = os.fstat(self._lock_fd), os.stat(path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):  # still ours under the name
                    os.unlink(path)
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)  # only now: while we hold the lock nobody else removes or reuses the name
            self._lock_fd = None

    # -- reading (any process) ---------------------------------------------------

    def ref(self, slot: int) -> SlotRef | None:
        """The committed block in ``slot`` now, or None if the slot is free or being written.

        Its fields are read between two looks at the gen (the seqlock), so they
        belong to the block that (slot, gen) names.
        """
        gen = int(self.gens[slot])
        row = self.table[slot]
        offset, length, checksum = int(row["offset"]), int(row["length"]), int(row["checksum"])
        if gen & 1 or int(self.gens[slot]) != gen:  # free, or reused while we looked
            return None
        return SlotRef(slot, gen, offset, length, checksum)

    def find(self, key: BlockKey) -> SlotRef | None:
        """Scan the slot table for ``key`` (O(slots); for tools and tests, not the hot path)."""
        want = np.frombuffer(key, dtype=KEY_DTYPE)[0]
        for slot in np.flatnonzero(self.table["key"] == want):
            ref = self.ref(int(slot))
            if ref is not None and self.table["key"][ref.slot] == want:
                return ref
        return None

    def index_find(self, keys: np.ndarray) -> np.ndarray:
        """Per key (:data:`KEY_DTYPE`, as rows store them) the slot the key index names, or -1 (any process).

        A hint: check the row (:meth:`check_slots`) before trusting it.
        """
        if not len(keys):
            return np.full(0, -1, dtype=np.int64)
        tags, _ = _key_words(keys)
        at = self.index.lookup(tags)
        return np.where(at >= 0, np.take(self.index.values[0], np.maximum(at, 0)).view(np.int64), -1)

    def inventory_meta(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per key (:data:`KEY_DTYPE`): the tier the inventory names (uint8, :data:`~kvpool.vocabulary.NO_TIER` where
        none), the size and the checksum (uint64; meaningless where the tier is NO_TIER) (any process).

        What it answers is worth what :meth:`inventory_state` says it is; a
        read racing the owner may be wrong for that moment (see "Inventory
        state" in the module docstring): a reader still checks the block's
        row and bytes.
        """
        n = len(keys)
        if not n:
            return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        tags, second = _key_words(keys)
        at = self.inventory.lookup(tags, second)
        entry = np.maximum(at, 0)
        values = self.inventory.values
        tiers = np.take(values[3], entry).astype(np.uint8)
        tiers[at < 0] = NO_TIER
        return tiers, np.take(values[1], entry), np.take(values[2], entry)

    def inventory_state(self) -> InventoryState:
        """Whether the inventory table names every key the node holds now (any process; module docstring)."""
        state = int(self._state[0])
        return InventoryState.COMPLETE if state == InventoryState.COMPLETE else InventoryState.INCOMPLETE

    def check_slots(self, slots: np.ndarray, keys: np.ndarray, sizes: np.ndarray | None = None,
                    sums: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The seqlock's "before" for a batch: (gens now, extent offsets, whether each row holds that block).

        ``slots`` int64 (out-of-range ones, -1 included, are not held),
        ``keys`` as rows store them (:data:`KEY_DTYPE`), ``sizes`` and
        ``sums`` the length and checksum the reader was told (None: any).
        A held row is committed (even gen), names the key (and size and
        checksum) and its extent lies inside the data region, so
        ``data[offset : offset + length]`` is safe to copy from whatever
        happens to the row meanwhile. Read the gens before the bytes and
        compare them after (:meth:`unchanged`): only then are the bytes the
        block's.
        """
        valid = (slots >= 0) & (slots < self.num_slots)
        rows = np.take(self.table, np.where(valid, slots, 0))  # np.take: several times faster than [] here
        gens, offsets, lengths = rows["gen"], rows["offset"], rows["length"]
        held = valid & (gens % 2 == 0) & (rows["key"] == keys)
        held &= (offsets <= self.data_bytes) & (lengths <= self.data_bytes - np.minimum(offsets, self.data_bytes))
        if sizes is not None:
            held &= lengths == sizes
        if sums is not None:
            held &= rows["checksum"] == sums
        return gens, offsets.astype(np.int64), held

    def unchanged(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """The seqlock's "after": whether each slot still has the gen :meth:`check_slots` read."""
        valid = (slots >= 0) & (slots < self.num_slots)
        return valid & (self.gens[np.where(valid, slots, 0)] == gens)

    def block(self, slot: int, length: int | None = None) -> np.ndarray:
        """The bytes of ``slot``'s extent (its committed length, or ``length`` for a writer), as a view.

        For the owner, a writer it handed the slot, or a reader that checked
        the row (:meth:`check_slots`) and checks it again after the copy.
        """
        row = self.table[slot]
        offset = int(row["offset"])
        n = int(row["length"]) if length is None else length
        if offset + n > self.data_bytes:
            raise AssertionError(f"arena: slot {slot}'s extent [{offset}, {offset + n}) leaves the data region")
        return self.data[offset : offset + n]

    def read_into(self, ref: SlotRef, key: BlockKey, out: BufferLike, *, verify: bool = True) -> bool:
        """Copy the block ``ref`` names into ``out``; False if the slot no longer holds it.

        ``out`` must be exactly ``ref.length`` bytes (ValueError otherwise).
        With ``verify`` the copied bytes are checked against the slot's checksum,
        which catches a torn copy even where the gen re-check alone might not
        (weakly ordered CPUs).
        """
        dst = as_array(out, writable=True)
        if dst.size != ref.length:
            raise ValueError(f"output is {dst.size} bytes, block is {ref.length}")
        slot = ref.slot
        row = self.table[slot]
        if int(self.gens[slot]) != ref.gen or row["key"].tobytes() != key or int(row["offset"]) != ref.offset:
            return False
        src = self.data[ref.offset : ref.offset + ref.length]
        if verify:
            if copy_with_checksum(dst, src) != ref.checksum:
                return False
        else:
            np.copyto(dst, src)
        return int(self.gens[slot]) == ref.gen

    def view(self, slot: int, length: int) -> memoryview:
        """A writable byte view of the first ``length`` bytes of ``slot``'s extent (see :meth:`block`)."""
        return memoryview(as_buffer(self.block(slot, length)))

    def touch(self, slots: np.ndarray | list[int], now_ns: int | None = None) -> None:
        """Stamp ``slots`` as read now (any process; out-of-range slots are skipped)."""
        idx = np.asarray(slots, dtype=np.int64)
        idx = idx[(idx >= 0) & (idx < self.num_slots)]
        self.stamps[idx] = time.monotonic_ns() if now_ns is None else now_ns

    # -- owner-only state changes ------------------------------------------------

    def claim(self, slot: int, offset: int) -> int:
        """Hand free ``slot``, now naming the extent at ``offset``, to one writer: its new odd gen (owner only)."""
        assert self.owner, "arena: only the owner hands out slots"
        gen = int(self.gens[slot])
        assert gen & 1, f"arena: claim of slot {slot} that is not free (gen {gen})"
        assert 0 <= offset < self.data_bytes, f"arena: claim of slot {slot} at offset {offset} outside the data"
        self.table[slot]["offset"] = offset
        self.gens[slot] = gen + 2
        return gen + 2

    def commit(self, slot: int, key: BlockKey, length: int, checksum: int) -> SlotRef:
        """Publish the bytes already written into claimed ``slot``'s extent as ``key`` (owner only)."""
        assert self.owner, "arena: only the owner commits slots"
        gen = int(self.gens[slot])
        assert gen & 1, f"arena: commit of slot {slot} that is not free (gen {gen})"
        row = self.table[slot]
        offset = int(row["offset"])
        assert offset + length <= self.data_bytes, f"arena: commit of slot {slot} past the data region"
        row["key"] = np.frombuffer(key, dtype=KEY_DTYPE)[0]
        row["length"] = length
        row["checksum"] = checksum
        self.stamps[slot] = time.monotonic_ns()
        self.gens[slot] = gen + 1  # even: readable. Written last.
        return SlotRef(slot, gen + 1, offset, length, checksum)

    def index_insert(self, key: BlockKey, slot: int) -> bool:
        """Name ``slot`` as ``key``'s in the key index (owner only); False if both its buckets are full (a reader
        then asks the node for that block's slot: the index is a hint)."""
        assert self.owner, "arena: only the owner writes the key index"
        return self.index.insert(_tag(key), (slot,)) >= 0

    def index_remove(self, key: BlockKey, slot: int) -> None:
        """Drop ``key``'s entry naming ``slot`` from the key index (owner only); entries never move, so a reader
        misses at most this key."""
        assert self.owner, "arena: only the owner writes the key index"
        self.index.remove(_tag(key), slot)  # by tag and slot: another key of the same tag keeps its entry

    def inventory_put(self, key: BlockKey, tier: int, size: int, checksum: int) -> bool:
        """Say in the inventory that ``key`` (``size`` bytes, ``checksum``) is best served from ``tier`` (owner only;
        one thread at a time); True if it says so now.

        False (more keys than it has room for, or both its buckets full)
        makes the inventory ``INCOMPLETE``.
        """
        assert self.owner, "arena: only the owner writes the inventory"
        table = self.inventory
        tag, second = _inventory_entry(key)
        at = table.find(tag, second)
        if at >= 0:
            if tuple(int(v) for v in table.values[1:, at]) != (size, checksum, tier):  # moved, or another block
                table.remove(tag, second)
                table.insert(tag, (second, size, checksum, tier))  # the entry it left: always room
            return True
        if self._inventory_count < self.num_slots + self.ssd_keys and \
                table.insert(tag, (second, size, checksum, tier)) >= 0:
            self._inventory_count += 1
            return True
        self.inventory_lost()
        return False

    def inventory_discard(self, key: BlockKey) -> None:
        """Take ``key`` out of the inventory if it is in it (owner only; one thread at a time)."""
        assert self.owner, "arena: only the owner writes the inventory"
        if self.inventory.remove(*_inventory_entry(key)):
            self._inventory_count -= 1

    @property
    def inventory_count(self) -> int:
        """Keys in the inventory (as the owner entered them; 0 in other processes)."""
        return self._inventory_count

    def inventory_lost(self) -> None:
        """Publish ``INCOMPLETE`` for the rest of the segment's life: a key may be missing (owner only)."""
        assert self.owner, "arena: only the owner sets the inventory state"
        with self._state_lock:
            self._lost = True
            self._state[0] = InventoryState.INCOMPLETE

    def declare_inventory(self) -> InventoryState:
        """Publish the inventory as ``COMPLETE`` once the owner filled it (owner only), unless an earlier failure
        made it ``INCOMPLETE`` (:meth:`inventory_lost`)."""
        assert self.owner, "arena: only the owner sets the inventory state"
        with self._state_lock:
            state = InventoryState.INCOMPLETE if self._lost else InventoryState.COMPLETE
            self._state[0] = state
        return state

    def release(self, slot: int) -> None:
        """Mark a committed slot free; readers holding its old ref now miss (owner only)."""
        assert self.owner, "arena: only the owner releases slots"
        gen = int(self.gens[slot])
        assert not gen & 1, f"arena: release of slot {slot} that is already free (gen {gen})"
        self.gens[slot] = gen + 1  # odd first, so no reader starts on the old bytes again
        self.table[slot]["length"] = 0


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each region of an arena of these dimensions lies (see the module docstring)."""

    data_bytes: int
    num_slots: int
    ssd_keys: int
    table_off: int
    stamps_off: int
    index_off: int
    index_buckets: int  # buckets of the key index: load at most 1/2 of num_slots
    inventory_off: int
    inventory_buckets: int  # buckets of the inventory: load at most 1/2 of num_slots + ssd_keys
    data_off: int
    total: int

    @classmethod
    def of(cls, data_bytes: int, num_slots: int, ssd_keys: int) -> _Layout:
        table_off = _HEADER_BYTES
        stamps_off = table_off + num_slots * SLOT_DTYPE.itemsize
        index_off = stamps_off + num_slots * 8
        index_buckets = table_buckets(num_slots)
        inventory_off = index_off + table_bytes(index_buckets, 1)
        inventory_buckets = table_buckets(num_slots + ssd_keys)
        data_off = _round_up(inventory_off + table_bytes(inventory_buckets, 4), mmap.PAGESIZE)
        return cls(data_bytes, num_slots, ssd_keys, table_off, stamps_off, index_off, index_buckets, inventory_off,
                   inventory_buckets, data_off, data_off + data_bytes)


def _tag(key: bytes) -> int:
    """A key's table tag: its first 8 bytes as a little-endian integer, never 0 (0 marks an empty entry)."""
    return int.from_bytes(key[:8], "little") or 1


def _inventory_entry(key: bytes) -> tuple[int, int]:
    """A key's inventory tag and first value word: its first 8 bytes (never 0) and its next 8."""
    return _tag(key), int.from_bytes(key[8:16], "little")


def _key_words(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_inventory_entry` for a batch of keys (:data:`KEY_DTYPE`): (tags, second words), uint64."""
    words = np.ascontiguousarray(keys).view("<u8").reshape(-1, KEY_BYTES // 8)
    tags = words[:, 0].copy()
    tags[tags == 0] = 1
    return tags, words[:, 1]
