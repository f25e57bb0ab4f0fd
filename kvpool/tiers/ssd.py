"""The SSD tier: KV blocks in one LMDB environment, LRU-evicted under a hard byte budget.

Invariants:
- A key is visible only after its header, bytes and checksum are committed in
  one LMDB write transaction; readers see whole values or nothing (MVCC).
- ``used_bytes <= capacity_bytes`` at every moment. ``used_bytes`` counts the
  LMDB pages an entry occupies (:meth:`SsdStore.entry_cost`), and room is made
  by evicting in the same write transaction that adds the new entries.
- Eviction order is LRU: ``get_into`` hits and re-puts of identical blocks
  refresh recency, ``contains`` does not. Recency lives in memory only, so after
  a restart the order is write order (each value carries a write sequence number).
- Bytes returned by ``get_into`` always matched their stored checksum; a value
  that fails its header or checksum check is a miss, counted in ``corrupt`` and
  deleted.
- One process owns a store directory (an ``flock`` on ``kvpool.lock``, which
  holds the owner's pid): the in-memory LRU must mirror the file. Opening a
  directory another live process holds is :class:`SsdInUse` (a ValueError
  naming that pid); a capacity beyond what the disk has free (plus what
  ``data.mdb`` already holds) is an ``OSError(ENOSPC)`` at open, not a disk
  that fills up later. It maps each key to its
  :class:`BlockMeta` (size and checksum, rebuilt from the headers at open), so
  :meth:`SsdStore.inventory` and :meth:`SsdStore.meta` never touch the disk.
- ``on_change`` hears of every change to the key set after it is committed,
  outside both locks: new entries as added; evictions, removes and corrupt
  deletions as removed. Entries found or dropped while opening are not
  reported (nobody has an inventory yet; :meth:`SsdStore.inventory` has them).

Sync policy: this is a cache, so by default commits are not fsynced. A process
killed with SIGKILL loses nothing (committed pages are already in the OS page
cache); a power loss or kernel crash may lose recent entries or damage the file.
Every entry carries a checksum, and a file that LMDB refuses to open is moved
aside to ``data.mdb.broken`` (replacing an older one) and the store starts empty
with a logged warning. LMDB maps more than the file and trusts its page
numbers, so a truncated file would kill the process with SIGBUS on the first
read past its end: a file shorter than the pages its meta page counts is
extended with zeros at open (a cut-off tree then fails LMDB's checks or the
headers' and is dropped as above; LMDB itself may leave a few never-written
free pages at the end, which this also covers).

A file cut short while the store is open (LMDB never shrinks it, so anything
shorter than the largest size seen is damage from outside) must cost misses,
not the process: every read and write transaction is preceded by a look at
the size of ``data.mdb`` (an ``lseek`` to its end: ~0.4 us; the gate around a
read, this and the in-flight count, costs ~1.5 us a call). A file found
shorter is at once extended back with zeros, so no page any transaction maps
lies past its end; if the cut reached pages LMDB uses (below ``(last_pgno + 1) * psize``,
refreshed after each write), or LMDB reports the file corrupt, the store is
*reset*: new transactions are misses, the ones in flight finish, the file is
moved to ``data.mdb.broken``, the store starts empty, every block it held is
reported removed to ``on_change`` (so the master's index drops them) and
``"ssd_file_broken"`` goes to ``on_error``. Writes after that go to the new
file. Left open: a cut landing inside a transaction that already passed its
check can still fault (the window is that transaction's own length). A write
transaction the disk refuses (full, I/O error) stores nothing: the blocks are
False (misses later), with a warning. Both are reported to ``on_error``
(``"ssd_file_broken"``, ``"ssd_write"``; the node counts them in
``kvpool_errors_total``). ``sync=True`` fsyncs every commit; :meth:`SsdStore.sync_now`
flushes on demand (the node calls it periodically and on clean shutdown).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb
import numpy as np

from kvpool.buffers import BufferLike, byte_view
from kvpool.checksum import block_checksum, copy_with_checksum
from kvpool.keys import KEY_BYTES, BlockKey, check_keys
from kvpool.tiers.base import ChangeListener, check_batch, notify
from kvpool.vocabulary import BlockMeta, Tier, TierStats

log = logging.getLogger(__name__)

MAGIC = b"KVB1"
FORMAT_VERSION = 2
# magic, format version, flags (0), payload length, payload checksum, write sequence number, padding.
# 48 bytes so that, after LMDB's 16-byte page header, a large value's payload starts 64-byte
# aligned: memcpy into an aligned engine buffer from a misaligned source runs ~5x slower here.
_HEADER = struct.Struct("<4sHHQQQ16x")
HEADER_BYTES = _HEADER.size  # 48
_MIB = 1 << 20
# Not a block key (wrong length): written only to make LMDB's freed pages reusable (see put).
_MARK = b"kvpool.seq"
# Errors meaning "this file is not a usable LMDB environment" (not: disk full, permissions).
_BROKEN_FILE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
                lmdb.PanicError)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class SsdInUse(ValueError):
    """The store directory is held by another live process (or another store in this one)."""


def _parse_header(value: memoryview) -> tuple[int, int, int] | None:
    """(payload length, checksum, sequence) of a stored value, or None if its header is bad."""
    if len(value) < HEADER_BYTES:
        return None
    magic, version, _flags, length, checksum, seq = _HEADER.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION or length != len(value) - HEADER_BYTES:
        return None
    return length, checksum, seq


class SsdStore:
    """The SSD tier over an LMDB environment in ``path``; see the module docstring."""

    tier = Tier.SSD

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        sync: bool = False,
        max_value_bytes: int = 64 << 20,
        on_change: ChangeListener | None = None,
        on_error: Callable[[str], object] | None = None,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if not isinstance(max_value_bytes, int) or max_value_bytes <= 0:
            raise ValueError(f"max_value_bytes must be a positive integer, got {max_value_bytes!r}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._check_room()  # before anything is created
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.path))
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_value_bytes = max_value_bytes
        self.on_change = on_change
        self.on_error = on_error  # hears "ssd_file_broken" / "ssd_write" (see the module docstring)
        self._write_failing = False  # warn once per run of failed writes
        # Far above capacity: LMDB reuses pages freed by txn N only from txn N+2 on (and once
        # no reader holds an older snapshot), and an overflow value needs a run of free pages.
        self.map_size = max(2 * capacity_bytes, capacity_bytes + 256 * _MIB)
        self._sync = sync
        self._lock = threading.Lock()  # guards _lru, _used, counters and _readers; never held across LMDB I/O
        self._idle = threading.Condition(self._lock)  # notified when the last read transaction ends
        self._wlock = threading.Lock()  # serialises write transactions, resets (and close)
        self._readers = 0  # read transactions (and syncs) in flight on _env
        self._resetting = False  # a damaged file is being replaced: new reads are misses
        self._closed = False
        self._data_fd: int | None = None  # data.mdb, for the size check before each transaction
        self._file_size = 0  # the largest size of data.mdb seen (LMDB never shrinks it)
        self._need = 0  # bytes of data.mdb LMDB's pages use: (last_pgno + 1) * psize
        self._lru: collections.OrderedDict[BlockKey, BlockMeta] = collections.OrderedDict()  # LRU first
        self._used = 0
        self._seq = 0
        self._scratch = bytearray()
        self._counts = dict(hits=0, misses=0, puts=0, bytes_in=0, bytes_out=0, evictions=0, corrupt=0)
        self._lock_fd = self._claim_dir()
        self._env: lmdb.Environment | None = None
        self.page_size = 0
        try:
            self._open()
        except BaseException:
            self._close_env()
            os.close(self._lock_fd)
            raise

    # ---- opening -------------------------------------------------------------------------

    def _claim_dir(self) -> int:
        """Lock ``kvpool.lock`` and write our pid into it; SsdInUse (naming the holder) if it is held."""
        fd = os.open(self.path / "kvpool.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            who = f"pid {text}" if text.isdigit() else "pid unknown"
            raise SsdInUse(f"SSD directory {self.path} is in use by another process ({who}): one node per "
                           "ssd_dir") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_room(self) -> None:
        """OSError(ENOSPC) if the capacity is more than the disk has free plus what data.mdb already takes."""
        probe = self.path.absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        try:
            free += os.stat(self.path / "data.mdb").st_blocks * 512
        except OSError:
            pass
        if self.capacity_bytes > free:
            raise OSError(errno.ENOSPC, f"{_gib(self.capacity_bytes)} of SSD capacity asked for, but the disk at "
                                        f"{self.path} has {_gib(free)} free")

    def _lmdb_open(self) -> lmdb.Environment:
        env = lmdb.open(
            str(self.path), map_size=self.map_size, subdir=True, metasync=False, sync=self._sync,
            readahead=False, max_readers=2048, max_dbs=0, lock=True,
        )
        env.reader_check()  # drop reader slots left by killed processes
        return env

    def _open_env(self) -> None:
        """Open (or create) the environment with every page it counts backed by the file; set up the size check."""
        self._env = self._lmdb_open()
        self.page_size = self._env.stat()["psize"]
        self._back_every_page()
        self._data_fd = os.open(self.path / "data.mdb", os.O_RDWR | os.O_NOFOLLOW)
        self._file_size = 0
        self._note_pages(self._env)

    def _close_env(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None

    def _note_pages(self, env: lmdb.Environment) -> None:
        """Refresh the bytes LMDB's pages use and the file size seen (after open and each write; writer lock held)."""
        self._need = (env.info()["last_pgno"] + 1) * self.page_size
        if self._data_fd is not None:
            self._file_size = max(self._file_size, os.lseek(self._data_fd, 0, os.SEEK_END))

    def _open(self) -> None:
        """Open (or create) the environment and rebuild the LRU; a broken file is moved aside once."""
        for attempt in (0, 1):
            try:
                self._open_env()
                self._load()
                return
            except _BROKEN_FILE as exc:
                if attempt:
                    raise
                self._close_env()
                self._lru.clear()
                self._used = 0
                data = self.path / "data.mdb"
                log.warning("SSD store %s: LMDB cannot read %s (%r); moving it to %s.broken, starting empty",
                            self.path, data, exc, data.name)
                os.replace(data, self.path / "data.mdb.broken")
                self._report_error("ssd_file_broken")

    def _back_every_page(self) -> None:
        """Extend data.mdb with zeros up to the last page its meta page counts (see the module docstring)."""
        assert self._env is not None
        need = (self._env.info()["last_pgno"] + 1) * self.page_size
        data = self.path / "data.mdb"
        have = os.path.getsize(data)
        if have < need:
            log.info("SSD store %s: %s is %d bytes short of its last page; extending it with zeros",
                     self.path, data.name, need - have)
            os.truncate(data, need)

    def _report_error(self, kind: str) -> None:
        if self.on_error is not None:
            self.on_error(kind)

    def _load(self) -> None:
        """Rebuild the LRU from the headers (write order); drop bad entries and any excess."""
        assert self._env is not None
        entries: list[tuple[int, BlockKey, int, int]] = []  # (sequence, key, size, checksum)
        bad: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                if raw_key == _MARK:
                    continue
                header = _parse_header(value)
                if header is None or len(raw_key) != KEY_BYTES:
                    bad.append(bytes(raw_key))
                else:
                    entries.append((header[2], BlockKey(bytes(raw_key)), header[0], header[1]))
        entries.sort()
        for _seq, key, size, checksum in entries:
            self._lru[key] = BlockMeta(key, size, checksum)
            self._used += self.entry_cost(size)
        self._seq = entries[-1][0] + 1 if entries else 0
        victims = self._pick_victims(self._used - self.capacity_bytes, frozenset())
        if bad or victims:
            with self._env.begin(write=True) as wtxn:
                for doomed in [*bad, *victims]:
                    wtxn.delete(doomed)
            self._forget(victims, evicted=True)
            self._counts["corrupt"] += len(bad)
            if bad:
                log.warning("SSD store %s: dropped %d entries with bad headers", self.path, len(bad))

    # ---- a file damaged while open ---------------------------------------------------------

    def _file_intact(self) -> bool:
        """Whether data.mdb is no shorter than the largest size seen; caller holds the writer lock."""
        fd = self._data_fd
        return fd is not None and os.lseek(fd, 0, os.SEEK_END) >= self._file_size

    def _begin_read(self) -> lmdb.Environment | None:
        """The environment for one read transaction (counted in flight), or None: answer with misses.

        Checks the file's size first (an ``lseek`` to its end: cheaper than
        ``fstat``, and the fd's offset is never used); a file cut short is
        repaired or the store reset (see the module docstring) before this
        returns None. The file only grows in our own write transactions, after
        which :meth:`_note_pages` records its new size.
        """
        with self._lock:
            env, fd = self._env, self._data_fd
            if env is None or fd is None or self._resetting:
                if self._closed:
                    raise ValueError(f"SSD store {self.path} is closed")
                return None
            self._readers += 1
        if os.lseek(fd, 0, os.SEEK_END) >= self._file_size:
            return env
        self._end_read()
        self._recover()
        with self._lock:
            if self._env is None or self._resetting:
                return None
            self._readers += 1  # repaired in place (the cut missed LMDB's pages) or reset: go on
            return self._env

    def _end_read(self) -> None:
        with self._lock:
            self._end_read_locked()

    def _end_read_locked(self) -> None:
        self._readers -= 1
        if not self._readers:
            self._idle.notify_all()

    def _recover(self, broken: BaseException | None = None) -> None:
        """:meth:`_recover_locked` under the writer lock, then report the lost blocks (outside both locks)."""
        with self._wlock:
            lost = self._recover_locked(broken)
        notify(self.on_change, (), lost, "SSD")

    def _recover_locked(self, broken: BaseException | None = None) -> list[BlockKey]:
        """Deal with a data.mdb cut short (or, given ``broken``, one LMDB calls corrupt); returns the keys lost.

        Caller holds the writer lock and no transaction slot. A file shorter
        than seen is extended back with zeros first. If LMDB's pages were all
        outside the cut (and nothing else is wrong) that is all; else the store
        is reset: see the module docstring.
        """
        if self._closed or self._env is None or self._data_fd is None:
            return []
        size = os.lseek(self._data_fd, 0, os.SEEK_END)
        if size < self._file_size:
            os.ftruncate(self._data_fd, self._file_size)  # zeros: no mapped page lies past the end any more
            if broken is None and size >= self._need:
                log.warning("SSD store %s: data.mdb was cut to %d bytes, past every page in use; extended it back",
                            self.path, size)
                return []
            why = f"data.mdb was cut from {self._file_size} to {size} bytes under the running store"
        elif broken is None:
            return []  # intact (another thread already dealt with it)
        else:
            why = f"LMDB reports {broken!r}"
        with self._lock:
            self._resetting = True
            while self._readers:
                self._idle.wait()
            lost = list(self._lru)
            self._lru.clear()
            self._used = 0
        try:
            self._close_env()
            data = self.path / "data.mdb"
            log.warning("SSD store %s: %s; moving it to %s.broken and starting empty (%d blocks lost)",
                        self.path, why, data.name, len(lost))
            try:
                os.replace(data, self.path / "data.mdb.broken")
            except FileNotFoundError:
                pass
            self._report_error("ssd_file_broken")
            try:
                self._open_env()
            except (OSError, lmdb.Error) as exc:  # the disk is gone too: misses from now on, DRAM still serves
                self._close_env()
                log.error("SSD store %s: cannot start a new file (%s); every SSD read is a miss from now on",
                          self.path, exc)
        finally:
            with self._lock:
                self._resetting = False
        return lost

    # ---- accounting ----------------------------------------------------------------------

    def entry_cost(self, payload_bytes: int) -> int:
        """Accounted bytes of one entry: the pages its value occupies plus one page of overhead."""
        pages = -(-(HEADER_BYTES + payload_bytes) // self.page_size)
        return (pages + 1) * self.page_size

    def fits(self, payload_bytes: int) -> bool:
        """Whether a block of this size can be stored at all (within max value size and capacity)."""
        return payload_bytes <= self.max_value_bytes and self.entry_cost(payload_bytes) <= self.capacity_bytes

    def _pick_victims(self, need: int, pinned: frozenset[BlockKey]) -> list[BlockKey]:
        """LRU-first unpinned keys whose costs sum to >= need (fewer if there are not enough)."""
        victims: list[BlockKey] = []
        with self._lock:
            for key, meta in self._lru.items():
                if need <= 0:
                    break
                if key not in pinned:
                    victims.append(key)
                    need -= self.entry_cost(meta.size)
        return victims

    def _cost_of(self, key: BlockKey) -> int:
        """Accounted bytes of a stored key, 0 if absent (caller holds ``_lock``)."""
        meta = self._lru.get(key)
        return 0 if meta is None else self.entry_cost(meta.size)

    def _forget(self, keys: Sequence[BlockKey], *, evicted: bool) -> list[BlockKey]:
        """Drop keys from the in-memory map; returns those that were there."""
        gone = []
        with self._lock:
            for key in keys:
                meta = self._lru.pop(key, None)
                if meta is not None:
                    self._used -= self.entry_cost(meta.size)
                    self._counts["evictions"] += evicted
                    gone.append(key)
        return gone

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"SSD store {self.path} is closed")

    # ---- the tier calls (kvpool.tiers.base) -----------------------------------------------------------------------

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which keys are stored; does not change recency."""
        ks = check_keys(keys)
        with self._lock:
            return [k in self._lru for k in ks]

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike],
            checksums: Sequence[int] | None = None) -> list[bool]:
        """Store blocks in one write transaction, evicting LRU entries to stay within capacity.

        ``checksums`` (e.g. from the DRAM tier) are verified: a mismatch means the
        caller's memory is corrupt, so that block is skipped (False, counted corrupt).
        An identical block already stored is refreshed, not rewritten. False also
        means "no room" (more new bytes in one batch than capacity: the oldest lose).
        """
        ks = check_keys(keys)
        check_batch(ks, values)
        views = [byte_view(v) for v in values]
        if checksums is not None:
            check_batch(ks, checksums)
        for view in views:
            if not self.fits(view.nbytes):
                raise ValueError(f"a {view.nbytes}-byte block cannot fit in SSD store {self.path} "
                                 f"(capacity {self.capacity_bytes}, max value {self.max_value_bytes})")
        self._check_open()
        latest: dict[BlockKey, tuple[memoryview, int]] = {}  # a repeated key: the last value wins
        bad: set[int] = set()
        for i, (key, view) in enumerate(zip(ks, views)):
            checksum = block_checksum(view)
            if checksums is not None and int(checksums[i]) != checksum:
                bad.add(i)
                continue
            latest.pop(key, None)
            latest[key] = (view, checksum)
        added: list[BlockMeta] = []
        removed: list[BlockKey] = []
        stored: set[BlockKey] = set()
        with self._wlock:
            if not self._file_intact():
                removed += self._recover_locked()
            env = self._env
            if env is not None:  # None: closed meanwhile, or no usable file after a reset (misses)
                try:
                    stored = self._write_or_evict(env, latest, added, removed)
                except _BROKEN_FILE as exc:  # nothing was committed; the file is replaced
                    stored = set()
                    removed += self._recover_locked(exc)
                except lmdb.Error as exc:  # the disk refused the transaction (full, I/O error): nothing changed
                    stored = set()
                    if not self._write_failing:
                        log.warning("SSD store %s: write failed (%s); its blocks are dropped until writes work "
                                    "again", self.path, exc)
                    self._write_failing = True
                    self._report_error("ssd_write")
                else:
                    self._note_pages(env)
                    if self._write_failing:
                        log.warning("SSD store %s: writes work again", self.path)
                    self._write_failing = False
        with self._lock:
            self._counts["corrupt"] += len(bad)
        notify(self.on_change, added, removed, "SSD")
        return [i not in bad and k in stored for i, k in enumerate(ks)]

    def _write_or_evict(self, env: lmdb.Environment, latest: dict[BlockKey, tuple[memoryview, int]],
                        added: list[BlockMeta], removed: list[BlockKey]) -> set[BlockKey]:
        """:meth:`_write`; if LMDB's map is full, evict for room once and retry (caller holds the writer lock)."""
        try:
            return self._write(env, latest, added, removed)
        except lmdb.MapFullError:
            need = sum(self.entry_cost(v.nbytes) for v, _ in latest.values())
            try:
                victims = self._pick_victims(need, frozenset(latest))
                with env.begin(write=True) as txn:
                    for key in victims:
                        txn.delete(key)
                removed += self._forget(victims, evicted=True)
                # LMDB reuses pages freed by txn N only from txn N+2 on: commit one tiny txn.
                with env.begin(write=True) as txn:
                    txn.put(_MARK, self._seq.to_bytes(8, "little"))
                return self._write(env, latest, added, removed)
            except lmdb.MapFullError:
                log.warning("SSD store %s: LMDB map full after evicting; dropping %d blocks",
                            self.path, len(latest))
                return set()

    def _write(self, env: lmdb.Environment, items: dict[BlockKey, tuple[memoryview, int]],
               added: list[BlockMeta], removed: list[BlockKey]) -> set[BlockKey]:
        """One write txn for ``items`` (caller holds the writer lock); returns the keys now stored.

        Appends the entries it wrote to ``added`` and the keys it evicted to ``removed``.
        """
        order: list[tuple[BlockKey, int | None]] = []  # (key, new cost) or (key, None) = refresh only
        with env.begin(write=True, buffers=True) as txn:
            for key, (view, checksum) in items.items():
                old = txn.get(key)
                header = _parse_header(old) if old is not None else None
                same = header is not None and header[0] == view.nbytes and header[1] == checksum
                order.append((key, None if same else self.entry_cost(view.nbytes)))
            refreshed = frozenset(k for k, c in order if c is None)
            writes = [(k, c) for k, c in order if c is not None]
            start, victims = 0, []
            with self._lock:
                used = self._used
                replaced = {k: self._cost_of(k) for k, _ in writes}
            total = sum(c for _, c in writes)
            while start < len(writes) and total > self.capacity_bytes:  # more than fits: oldest lose
                total -= writes[start][1]
                start += 1
            while start < len(writes):  # drop the oldest new blocks until the rest can fit
                live = writes[start:]
                need = used - sum(replaced[k] for k, _ in live) + sum(c for _, c in live)
                need -= self.capacity_bytes
                victims = self._pick_victims(need, refreshed | {k for k, _ in live})
                with self._lock:
                    freed = sum(self._cost_of(k) for k in victims)
                if freed >= need:
                    break
                start += 1
            if start == len(writes):
                victims = []
            dropped = {k for k, _ in writes[:start]}
            order = [(k, c) for k, c in order if k not in dropped]
            for key in victims:
                txn.delete(key)
            for key, cost in order:
                if cost is not None:
                    view, checksum = items[key]
                    txn.put(key, self._pack(view, checksum))
        removed += self._forget(victims, evicted=True)
        with self._lock:
            for key, cost in order:
                if cost is None:
                    if key in self._lru:
                        self._lru.move_to_end(key)
                    continue
                self._used += cost - self._cost_of(key)
                self._lru.pop(key, None)
                meta = BlockMeta(key, items[key][0].nbytes, items[key][1])
                self._lru[key] = meta
                added.append(meta)
                self._counts["puts"] += 1
                self._counts["bytes_in"] += items[key][0].nbytes
            if self._used > self.capacity_bytes:
                raise AssertionError(f"SsdStore: used {self._used} > capacity {self.capacity_bytes}")
        return {k for k, _ in order}

    def _pack(self, view: memoryview, checksum: int) -> memoryview:
        """Header + payload in a reused staging buffer (LMDB copies it at put)."""
        total = HEADER_BYTES + view.nbytes
        if len(self._scratch) < total:
            self._scratch = bytearray(total)
        _HEADER.pack_into(self._scratch, 0, MAGIC, FORMAT_VERSION, 0, view.nbytes, checksum, self._seq)
        self._seq += 1
        self._scratch[HEADER_BYTES:total] = view
        return memoryview(self._scratch)[:total]

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[bool]:
        """Copy stored blocks into ``outs`` (one copy, verified); hits become most recently used.

        A stored block whose size differs from its output buffer is a ValueError
        (raised before any output is written). A value failing its header or
        checksum check is False, counted corrupt, and deleted.
        """
        ks = check_keys(keys)
        check_batch(ks, outs)
        arrs = [np.frombuffer(byte_view(o, writable=True), dtype=np.uint8) for o in outs]
        env = self._begin_read()
        if env is None:  # a damaged file is being replaced, or there is no usable one
            return self._all_missed(len(ks))
        hits = [False] * len(ks)
        corrupt: list[tuple[BlockKey, bytes]] = []
        nbytes = 0
        try:
            with env.begin(buffers=True) as txn:
                values = [txn.get(k) for k in ks]
                headers = [_parse_header(v) if v is not None else None for v in values]
                for key, header, arr in zip(ks, headers, arrs):
                    if header is not None and header[0] != arr.nbytes:
                        raise ValueError(f"output buffer is {arr.nbytes} bytes but block {key.hex()[:16]} "
                                         f"is {header[0]}")
                for i, (value, header, arr) in enumerate(zip(values, headers, arrs)):
                    if value is None:
                        continue
                    if header is not None:
                        stored = np.frombuffer(value, dtype=np.uint8, count=header[0], offset=HEADER_BYTES)
                        if copy_with_checksum(arr, stored) == header[1]:
                            hits[i] = True
                            nbytes += arr.nbytes
                            continue
                    corrupt.append((ks[i], bytes(value[:HEADER_BYTES])))
        except _BROKEN_FILE as exc:
            self._end_read()
            self._recover(exc)
            return self._all_missed(len(ks))
        except BaseException:
            self._end_read()
            raise
        with self._lock:
            self._end_read_locked()
            for key, hit in zip(ks, hits):
                if hit and key in self._lru:
                    self._lru.move_to_end(key)
            self._counts["hits"] += sum(hits)
            self._counts["misses"] += len(ks) - sum(hits)
            self._counts["bytes_out"] += nbytes
            self._counts["corrupt"] += len(corrupt)
        if corrupt:
            log.warning("SSD store %s: %d corrupt blocks, deleting them", self.path, len(corrupt))
            self._delete(corrupt)
        return hits

    def _all_missed(self, n: int) -> list[bool]:
        with self._lock:
            self._counts["misses"] += n
        return [False] * n

    def _delete(self, items: Sequence[tuple[BlockKey, bytes | None]]) -> int:
        """Delete keys (only if their header still equals the given bytes, when given)."""
        gone: list[BlockKey] = []
        lost: list[BlockKey] = []
        with self._wlock:
            if not self._file_intact():
                lost = self._recover_locked()
            env = self._env
            if env is not None:
                try:
                    with env.begin(write=True, buffers=True) as txn:
                        for key, header in items:
                            value = txn.get(key)
                            if value is None or (header is not None and bytes(value[:HEADER_BYTES]) != header):
                                continue
                            txn.delete(key)
                            gone.append(key)
                except _BROKEN_FILE as exc:
                    gone = []
                    lost += self._recover_locked(exc)
                except lmdb.Error as exc:  # map full, or the disk refused the write
                    log.warning("SSD store %s: deleting %d blocks failed (%s)", self.path, len(items), exc)
                    gone = []
                else:
                    self._note_pages(env)
                    self._forget(gone, evicted=False)
        notify(self.on_change, (), lost + gone, "SSD")
        return len(gone)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Delete keys; returns how many were stored."""
        ks = check_keys(keys)
        self._check_open()
        return self._delete([(k, None) for k in dict.fromkeys(ks)])

    def stats(self) -> TierStats:
        """A snapshot; ``puts``/``bytes_in`` count blocks actually written, ``used_bytes`` is accounted."""
        with self._lock:
            return TierStats(tier=self.tier, capacity_bytes=self.capacity_bytes, used_bytes=self._used,
                             blocks=len(self._lru), **self._counts)

    def keys(self) -> list[BlockKey]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._lru)

    def inventory(self) -> list[BlockMeta]:
        """Every stored block, least recently used first (from memory; no disk I/O)."""
        with self._lock:
            return list(self._lru.values())

    def meta(self, keys: Sequence[BlockKey]) -> list[BlockMeta | None]:
        """Size and checksum of each stored key, None if absent; does not change recency."""
        ks = check_keys(keys)
        with self._lock:
            return [self._lru.get(k) for k in ks]

    def file_bytes(self) -> int:
        """Size of ``data.mdb`` on disk."""
        return os.path.getsize(self.path / "data.mdb")

    def sync_now(self) -> None:
        """fsync everything committed so far (nothing, if there is no usable file)."""
        env = self._begin_read()
        if env is None:
            return
        try:
            env.sync(True)
        finally:
            self._end_read()

    def close(self) -> None:
        """Close the environment and release the directory; idempotent. No calls may be in flight."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._close_env()
            os.close(self._lock_fd)

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
