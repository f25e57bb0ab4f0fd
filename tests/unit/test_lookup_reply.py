"""A Lookup's reply encoded from its run's columns (master/lookup_reply.py) is byte for byte the protobuf
message's serialization, for runs of every shape, one at a time or several in one call."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.master.lookup_reply import RunReply, encode_runs, node_field, reply, varint
from kvpool.v1 import common_pb2, master_pb2

REFS = {100 + i: common_pb2.NodeRef(node_id=f"n{i}", address=f"10.0.0.{i}:7610", host_id="h" * i,
                                    arena=f"kvpool-{i}", data_address=f"10.0.0.{i}:7611" if i % 2 else "")
        for i in range(3)}
REFS[7] = common_pb2.NodeRef(node_id="n" * 200, address="a" * 300)  # a length that takes two varint bytes


def expected(tiers, nodes, sizes, checksums) -> master_pb2.LookupResponse:
    """The reply as the servicer built it before: the run's nodes in order of first use, indexed per block."""
    order = list(dict.fromkeys(nodes.tolist()))
    return master_pb2.LookupResponse(
        tiers=tiers.tobytes(), node_indexes=[order.index(n) for n in nodes.tolist()], sizes=sizes.tolist(),
        checksums=checksums.tolist(), nodes=[REFS[n] for n in order], dram_blocks=int(np.count_nonzero(tiers == 1)),
        ssd_blocks=int(np.count_nonzero(tiers == 2)))


def encoded(run: RunReply) -> bytes:
    return reply(run, [node_field(REFS[n].SerializeToString()) for n in run.nodes])


def columns(blocks: int, shape: str, seed: int):
    rng = np.random.default_rng(seed)
    tiers = rng.integers(0, 3, blocks).astype(np.uint8)
    if shape == "one node, one size":
        nodes, sizes = np.full(blocks, 101, np.uint32), np.full(blocks, 4096, np.uint64)
    else:
        nodes = rng.choice(np.array(list(REFS), np.uint32), blocks)
        widths = rng.integers(0, 64, blocks).astype(np.uint64)  # 0 to 64-bit values: 1 to 10 varint bytes
        sizes = (rng.integers(0, 1 << 63, blocks).astype(np.uint64) * np.uint64(2) + np.uint64(1)) >> widths
        sizes[: min(blocks, 3)] = [0, 127, (1 << 64) - 1][: min(blocks, 3)]
    checksums = rng.integers(0, 1 << 63, blocks).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    return tiers, nodes, sizes, checksums


@pytest.mark.parametrize("blocks", [0, 1, 2, 31, 127, 128, 300])
@pytest.mark.parametrize("shape", ["one node, one size", "nodes and sizes of every width"])
def test_the_encoded_reply_is_the_messages_serialization(blocks, shape):
    cols = columns(blocks, shape, blocks)
    (run,) = encode_runs(*cols, np.array([0]), np.array([blocks]))
    message = expected(*cols)
    assert encoded(run) == message.SerializeToString()
    assert master_pb2.LookupResponse.FromString(encoded(run)) == message
    assert (run.dram_blocks, run.ssd_blocks) == (message.dram_blocks, message.ssd_blocks)


def test_several_runs_in_one_call_are_each_their_own_reply():
    """Runs are rows ``starts[p]`` up to ``ends[p]`` of shared columns; rows past a run's end (a pass's keys
    after a prompt's first miss) are not part of it."""
    cols = columns(400, "nodes and sizes of every width", 3)
    starts, ends = np.array([0, 10, 10, 200, 390]), np.array([5, 10, 150, 390, 400])
    runs = encode_runs(*cols, starts, ends)
    assert len(runs) == 5
    for run, lo, end in zip(runs, starts, ends):
        assert encoded(run) == expected(*(c[lo:end] for c in cols)).SerializeToString()


def test_strided_and_read_only_columns_encode_as_their_values():
    """The run's columns are slices of a pass's shared arrays (strided, read-only where numpy made them so)."""
    wide = np.arange(40, dtype=np.uint64).reshape(20, 2)
    sizes, checksums = wide[:, 0], wide[:, 1]
    sizes.flags.writeable = False
    tiers, nodes = np.ones(20, np.uint8), np.full(20, 100, np.uint32)
    (run,) = encode_runs(tiers, nodes, sizes, checksums, np.array([0]), np.array([20]))
    assert encoded(run) == expected(tiers, nodes, sizes, checksums).SerializeToString()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 1 << 32, (1 << 64) - 1])
def test_a_varint_is_protobufs(value):
    packed = master_pb2.LookupResponse(sizes=[value]).SerializeToString()  # tag, length (one byte), the varint
    assert varint(value) == packed[2:]


def test_a_run_over_thousands_of_nodes_numbers_each_by_first_use():
    """A run's nodes are numbered through a hash table (a run may span every node of the pool; a scan of the
    nodes seen so far would cost blocks x nodes). Node numbers up to 2^30 - 1, repeats far apart."""
    rng = np.random.default_rng(11)
    numbers = rng.choice(np.arange((1 << 30) - 3000, 1 << 30, dtype=np.uint32), 6000)
    numbers[:3] = [0, 1 << 29, 0]
    tiers, sizes = np.ones(6000, np.uint8), np.arange(6000, dtype=np.uint64)
    (run,) = encode_runs(tiers, numbers, sizes, sizes, np.array([0]), np.array([6000]))
    order = list(dict.fromkeys(numbers.tolist()))
    assert run.nodes == order and len(order) > 2000
    parsed = master_pb2.LookupResponse.FromString(run.fields)
    place = {n: i for i, n in enumerate(order)}
    assert list(parsed.node_indexes) == [place[n] for n in numbers.tolist()]
    assert run.dram_blocks == 6000 and list(parsed.sizes) == sizes.tolist()
