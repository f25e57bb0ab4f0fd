"""A Lookup's reply encoded straight from its run: the protobuf bytes, with no message built.

Built as a ``LookupResponse`` message, a 64-key Lookup's reply cost the master a Python int per block per
column (``.tolist()``), their conversion into the message and its serialization: ~5 us in process, a
quarter of the call. Here the lookups that reach the master together are found and encoded in one compiled
call (:func:`lookup_replies`: the index probe of :mod:`kvpool.master.probe`, then :func:`_encode`; numba,
cached like the probe's kernels): each run's tiers, node indexes (its nodes numbered in order of first use),
sizes and checksums fields, and its DRAM and SSD counts. Python then adds the nodes' refs (each serialized
once: :func:`node_field`) and the counts (:func:`reply`). The fast-call wire sends the bytes as they are;
gRPC's ``Lookup`` parses them back into a message (its own transport costs far more than the parse).
:func:`encode_runs` encodes runs already found (a run cut short at a node dropped meanwhile).

Invariant: :func:`reply` is byte for byte ``LookupResponse(...).SerializeToString()`` of the same run: fields
in number order, repeated scalars packed, proto3 defaults (an empty run, zero counts) left out
(``tests/unit/test_lookup_reply.py`` compares the two on runs of every shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt
from numba.core import types

from kvpool.master.probe import PROBED_TYPES, RUN_COLUMN_TYPES, compiled, readonly, run_into
from kvpool.vocabulary import Tier

# The LookupResponse fields' tags (field number << 3 | wire type: 2 length-delimited, 0 varint)
_TIERS, _NODE_INDEXES, _SIZES, _CHECKSUMS, _NODES, _DRAM, _SSD = 0x0A, 0x12, 0x1A, 0x22, 0x2A, 0x30, 0x38
_DRAM_TIER, _SSD_TIER = np.uint8(Tier.DRAM), np.uint8(Tier.SSD)  # a tier as a reply's tiers byte holds it
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of node numbers
_SEVEN = np.uint64(7)
_LOW = np.uint64(0x7F)
_MORE = np.uint64(0x80)


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@numba.njit  # (inlined into the kernel: cached with it)
def _put_varint(out, at, value):
    """Write ``value`` as a varint at ``out[at]``; return where it ends."""
    while value > _LOW:
        out[at] = np.uint8((value & _LOW) | _MORE)
        value >>= _SEVEN
        at += 1
    out[at] = np.uint8(value)
    return at + 1


@numba.njit  # (inlined into the kernel: cached with it)
def _put_packed(out, at, tag, values, lo, hi):
    """Write a packed repeated varint field of ``values[lo:hi]`` (nothing when that is empty); return where it
    ends. Its length is counted first, so the bytes are written once."""
    if hi == lo:
        return at
    length = 0
    for i in range(lo, hi):
        v = np.uint64(values[i])
        length += 1
        while v > _LOW:
            v >>= _SEVEN
            length += 1
    out[at] = tag
    at = _put_varint(out, at + 1, np.uint64(length))
    for i in range(lo, hi):
        at = _put_varint(out, at, np.uint64(values[i]))
    return at


_I64S = readonly(types.int64)
_OUT = types.Tuple([types.Array(types.uint8, 1, "C"), types.Array(types.int64, 1, "C")])
_ENCODE_SIGNATURE = _OUT(readonly(types.uint8), readonly(types.uint32), readonly(types.uint64),
                         readonly(types.uint64), _I64S, _I64S)
_LOOKUP_SIGNATURE = _OUT(readonly(types.uint64), _I64S, *PROBED_TYPES, *RUN_COLUMN_TYPES)


@numba.njit  # (inlined into the kernels: cached with them)
def _encode(tiers, nodes, sizes, checksums, starts, ends):
    """Runs ``p`` = rows ``starts[p]`` up to ``ends[p]`` of the columns, encoded one after another in ``out``;
    ``meta`` holds, for P runs: where each run's bytes start in ``out`` (P + 1 offsets), where each run's
    nodes start in the node list (P + 1), its DRAM and SSD block counts (2 P), then the node list: each run's
    node numbers in order of first use (what its node_indexes index)."""
    prompts = ends.shape[0]
    blocks = 0
    for p in range(prompts):
        blocks += ends[p] - starts[p]
    out = np.empty(prompts * 4 * 11 + blocks * (1 + 5 + 10 + 8), np.uint8)  # tags and lengths, each block's widest
    meta = np.zeros(4 * prompts + 2 + blocks, np.int64)
    counts, used = 2 * prompts + 2, 4 * prompts + 2
    index = np.empty(tiers.shape[0], np.uint32)  # per row, its node's place in its run's nodes
    # A run's nodes, numbered in order of first use through a hash table (open addressing; a slot belongs to
    # the run whose number it is stamped with): O(1) a block however many nodes a run spans.
    longest = 0
    for p in range(prompts):
        longest = max(longest, ends[p] - starts[p])
    bits = 3
    while (1 << bits) < 2 * longest:
        bits += 1
    mask = (1 << bits) - 1
    slot_node, slot_place = np.empty(1 << bits, np.int64), np.empty(1 << bits, np.int64)
    slot_run = np.full(1 << bits, -1, np.int64)
    o = 0
    u = used
    for p in range(prompts):
        meta[p] = o
        meta[prompts + 1 + p] = u - used
        first = u
        lo, hi = starts[p], ends[p]
        for r in range(lo, hi):
            node = np.int64(nodes[r])
            h = np.int64((np.uint64(node) * _GOLDEN) >> np.uint64(64 - bits))
            while slot_run[h] == p and slot_node[h] != node:
                h = (h + 1) & mask
            if slot_run[h] != p:
                slot_run[h], slot_node[h], slot_place[h] = p, node, u - first
                meta[u] = node
                u += 1
            index[r] = slot_place[h]
            if tiers[r] == _DRAM_TIER:
                meta[counts + 2 * p] += 1
            elif tiers[r] == _SSD_TIER:
                meta[counts + 2 * p + 1] += 1
        n = hi - lo
        if n:
            out[o] = _TIERS
            o = _put_varint(out, o + 1, np.uint64(n))
            for r in range(lo, hi):
                out[o] = tiers[r]
                o += 1
        o = _put_packed(out, o, _NODE_INDEXES, index, lo, hi)
        o = _put_packed(out, o, _SIZES, sizes, lo, hi)
        if n:
            out[o] = _CHECKSUMS
            o = _put_varint(out, o + 1, np.uint64(8 * n))
            for r in range(lo, hi):
                c = checksums[r]
                for _byte in range(8):
                    out[o] = np.uint8(c & np.uint64(0xFF))
                    c >>= np.uint64(8)
                    o += 1
    meta[prompts] = o
    meta[2 * prompts + 1] = u - used
    return out[:o], meta[:u]


@compiled(_ENCODE_SIGNATURE)
def _encode_runs(tiers, nodes, sizes, checksums, starts, ends):
    return _encode(tiers, nodes, sizes, checksums, starts, ends)


@compiled(_LOOKUP_SIGNATURE)
def _lookup_replies(words, starts, fp, k0, k1, salt, shift, align_bits, hood, loc, size, checksum, node_bits):
    n = words.shape[0] // 4
    tiers, nodes = np.empty(n, np.uint8), np.empty(n, np.uint32)
    sizes, checksums = np.empty(n, np.uint64), np.empty(n, np.uint64)
    ends = np.empty(starts.shape[0] - 1, np.int64)
    for p in range(starts.shape[0] - 1):
        ends[p] = run_into(words, starts[p], starts[p + 1], fp, k0, k1, salt, shift, align_bits, hood, loc, size,
                           checksum, node_bits, tiers, nodes, sizes, checksums)
    return _encode(tiers, nodes, sizes, checksums, starts[:-1], ends)


class RunReply(NamedTuple):
    """One Lookup's reply but for its nodes' refs (:func:`reply`)."""

    fields: bytes  # the tiers, node_indexes, sizes and checksums fields, encoded
    nodes: list[int]  # the node numbers the run uses, in order of first use (what node_indexes index)
    dram_blocks: int
    ssd_blocks: int


def _replies(out: npt.NDArray[np.uint8], meta: npt.NDArray[np.int64], prompts: int) -> list[RunReply]:
    """The replies :func:`_encode` wrote (``out``, ``meta``) for ``prompts`` runs."""
    buf, m = out.tobytes(), meta.tolist()
    if prompts == 1:  # (a lookup alone: meta is its two offsets, two node offsets, two counts, its nodes)
        return [RunReply(buf, m[6:], m[4], m[5])]
    at, first, counts, used = m[:prompts + 1], m[prompts + 1:2 * prompts + 2], m[2 * prompts + 2:], 4 * prompts + 2
    return [RunReply(buf[at[p]:at[p + 1]], m[used + first[p]:used + first[p + 1]], counts[2 * p], counts[2 * p + 1])
            for p in range(prompts)]


def encode_runs(tiers: npt.NDArray[np.uint8], nodes: npt.NDArray[np.uint32], sizes: npt.NDArray[np.uint64],
                checksums: npt.NDArray[np.uint64], starts: npt.NDArray[np.int64],
                ends: npt.NDArray[np.int64]) -> list[RunReply]:
    """The replies of runs given as columns (a row per block: tier, node number, size, checksum): run ``p`` is
    rows ``starts[p]`` up to ``ends[p]``."""
    out, meta = _encode_runs(tiers, nodes, sizes, checksums, starts, ends)
    return _replies(out, meta, len(ends))


def lookup_replies(words: npt.NDArray[np.uint64], starts: npt.NDArray[np.int64], *table: Any) -> list[RunReply]:
    """The replies of several prompts' lookups in one compiled call: each prompt's leading run found as
    :func:`kvpool.master.probe.leading_run` finds it (``words``: the prompts' keys one after another, prompt
    ``p`` from key ``starts[p]`` up to ``starts[p + 1]``; ``table`` as :meth:`BlockIndex.leading_runs_pass`
    gives it), then encoded as :func:`encode_runs` encodes it."""
    out, meta = _lookup_replies(words, starts, *table)
    return _replies(out, meta, len(starts) - 1)


def node_field(ref: bytes) -> bytes:
    """A serialized ``NodeRef`` as one of a reply's ``nodes`` (its tag and length before it)."""
    return bytes((_NODES,)) + varint(len(ref)) + ref


def reply(run: RunReply, node_fields: Sequence[bytes]) -> bytes:
    """The serialized ``LookupResponse`` of ``run``: ``node_fields`` are its nodes' (:func:`node_field`), in
    the order of ``run.nodes``."""
    return b"".join((run.fields, *node_fields, _count(_DRAM, run.dram_blocks), _count(_SSD, run.ssd_blocks)))


def _count(tag: int, n: int) -> bytes:
    return b"" if not n else bytes((tag, n)) if n < 0x80 else bytes((tag,)) + varint(n)
