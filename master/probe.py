"""The index's lookups compiled (numba): a batch of keys probed in one call, no numpy call per step.

:func:`probe` is :meth:`kvpool.master.keytable.KeyTable.find` as one loop over the keys: each key's home
(a salted Fibonacci hash of k0), then the first slot of its neighbourhood whose fingerprint, k0 and k1
match. :func:`leading_run` is one prompt's whole index pass: its keys probed up to the first miss, each
hit's location, size and checksum gathered on the way (:func:`run_into`, which the Lookups' pass of
:mod:`kvpool.master.lookup_reply` runs for each of its prompts too). A 64-key Lookup's index pass costs
~4 us in process against ~17 us as a dozen numpy calls, and far less of the cache that a master's loop
thread finds cold between two requests (``docs/benchmarks.md``, "The index probe compiled").

Why numba: the probe is the master's one hot loop over keys, and numba (a well-kept JIT for numpy code; it
needs numpy and llvmlite, nothing of protobuf or grpcio) compiles it from this Python with no C of ours to
build, ship or audit. The compiled code is cached on disk (numba's ``cache=True``: ``__pycache__`` beside
this file, or ``NUMBA_CACHE_DIR``, or the user's cache): a process compiles the master's kernels (these and
:mod:`kvpool.master.lookup_reply`'s) at import once per machine (~5 s), and loads them in ~0.8 s after
that. Where no cache can be written (a read-only install and home, a read-only container: the deploy files
give both a cache directory), each process compiles them in memory at import instead. One signature each,
given here, takes every array a caller has (read-only or not, strided or not): no call waits for a
compilation.

Invariants: the arguments are a table's own columns (:meth:`KeyTable.probed`: ``fp`` uint16, ``k0`` and
``k1`` uint64 views of its aligned records, its salt, shift, alignment and neighbourhood), read, never
written; the kernels write only their outputs. The home and fingerprint are the table's (its inserts
compute them with numpy from the same constants: a key inserted is found, ``tests/unit/test_index.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba.core import types

log = logging.getLogger(__name__)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier (keytable's _GOLDEN)
FP_SHIFT = np.uint64(48)  # a key's fingerprint: the top 16 bits of k0, 1 where those are 0


def compiled(signature: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit([signature])``: compiled now, from numba's on-disk cache where it can keep one; compiled in
    memory where it cannot, or where what it finds there does not load (numba refuses ``cache=True`` when it
    has no writable place for it, and a damaged cache file fails the load: both raise at decoration)."""
    def compile_(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit([signature], cache=True)(fn)
        except Exception as exc:  # noqa: BLE001 (whatever the cache did, the kernel still compiles in memory)
            log.warning("the master's kernel %s is compiled in memory, not cached: %s: %s (NUMBA_CACHE_DIR names a "
                        "writable directory for numba's cache)", fn.__name__, type(exc).__name__, exc)
            return numba.njit([signature])(fn)
    return compile_


def readonly(item: types.Type) -> types.Array:
    return types.Array(item, 1, "A", readonly=True)  # (writable and contiguous arrays convert to it)


_U64S = readonly(types.uint64)
_SIGNATURE = types.intp(_U64S, _U64S, readonly(types.uint16), _U64S, _U64S, types.uint64, types.uint64,
                        types.uint64, types.intp, types.Array(types.intp, 1, "C"))
PROBED_TYPES = (  # the table's arguments to a kernel (KeyTable.probed)
    readonly(types.uint16), _U64S, _U64S, types.uint64, types.uint64, types.uint64, types.intp)
RUN_COLUMN_TYPES = (  # the columns a run gathers (loc, size, checksum) and node_bits
    readonly(types.uint32), _U64S, _U64S, types.uint64)
_RUN_SIGNATURE = types.Tuple([types.Array(t, 1, "C") for t in (types.uint8, types.uint32, types.uint64, types.uint64)])(
    _U64S, *PROBED_TYPES, *RUN_COLUMN_TYPES)


@numba.njit  # (inlined into the kernels: cached with them)
def _slot(a, b, fp, k0, k1, salt, shift, align_bits, hood):
    """The slot of key (a, b), -1 if absent (inlined into the kernels below)."""
    home = np.intp((((a ^ salt) * GOLDEN) >> shift) << align_bits)
    f = np.uint16(a >> FP_SHIFT)
    if f == 0:
        f = np.uint16(1)
    for slot in range(home, home + hood):
        if fp[slot] == f and k0[slot] == a and k1[slot] == b:
            return slot
    return -1


@compiled(_SIGNATURE)
def _probe(q0, q1, fp, k0, k1, salt, shift, align_bits, hood, rows):
    for i in range(q0.shape[0]):
        rows[i] = _slot(q0[i], q1[i], fp, k0, k1, salt, shift, align_bits, hood)
    return q0.shape[0]


@numba.njit  # (inlined into the kernels: cached with them)
def run_into(words, lo, hi, fp, k0, k1, salt, shift, align_bits, hood, loc, size, checksum, node_bits,
              tiers, nodes, sizes, checksums):
    """Keys ``lo`` to ``hi`` of ``words`` probed up to the first absent one, each hit's columns written at its
    key's row; returns the key the run ends at (inlined into the kernels below)."""
    node_mask = (np.uint64(1) << node_bits) - np.uint64(1)
    key = lo
    while key < hi:
        found = _slot(words[4 * key], words[4 * key + 1], fp, k0, k1, salt, shift, align_bits, hood)
        if found < 0:
            break
        where = np.uint64(loc[found])
        tiers[key] = np.uint8(where >> node_bits)
        nodes[key] = np.uint32(where & node_mask)
        sizes[key] = size[found]
        checksums[key] = checksum[found]
        key += 1
    return key


@compiled(_RUN_SIGNATURE)
def _leading_run(words, fp, k0, k1, salt, shift, align_bits, hood, loc, size, checksum, node_bits):
    n = words.shape[0] // 4
    tiers, nodes = np.empty(n, np.uint8), np.empty(n, np.uint32)
    sizes, checksums = np.empty(n, np.uint64), np.empty(n, np.uint64)
    end = run_into(words, 0, n, fp, k0, k1, salt, shift, align_bits, hood, loc, size, checksum, node_bits,
                    tiers, nodes, sizes, checksums)
    return tiers[:end], nodes[:end], sizes[:end], checksums[:end]


def probe(q0: npt.NDArray[np.uint64], q1: npt.NDArray[np.uint64], fp: npt.NDArray[np.uint16],
          k0: npt.NDArray[np.uint64], k1: npt.NDArray[np.uint64], salt: np.uint64, shift: np.uint64,
          align_bits: np.uint64, hood: int, rows: npt.NDArray[np.intp]) -> None:
    """Fill ``rows[i]`` with the slot of key ``(q0[i], q1[i])``, -1 where absent."""
    _probe(q0, q1, fp, k0, k1, salt, shift, align_bits, hood, rows)


Columns = tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]


def leading_run(words: npt.NDArray[np.uint64], fp: npt.NDArray[np.uint16], k0: npt.NDArray[np.uint64],
                k1: npt.NDArray[np.uint64], salt: np.uint64, shift: np.uint64, align_bits: np.uint64, hood: int,
                loc: npt.NDArray[np.uint32], size: npt.NDArray[np.uint64], checksum: npt.NDArray[np.uint64],
                node_bits: np.uint64) -> Columns:
    """The leading run of present keys of one prompt (``words``: its packed 32-byte keys, four uint64 words a
    key; a key's first two are its table key), as columns with a row per key of the run: its location's tier
    (``loc >> node_bits``) and node number (the low ``node_bits``), its size and checksum. Probing stops at
    the first absent key."""
    return _leading_run(words, fp, k0, k1, salt, shift, align_bits, hood, loc, size, checksum, node_bits)
