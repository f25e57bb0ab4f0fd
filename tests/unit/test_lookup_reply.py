"""A Lookup's reply encoded from its run's columns (master/lookup_reply.py) is byte for byte the protobuf
message's serialization, for runs of every shape."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.master.lookup_reply import encode, varint
from kvpool.v1 import common_pb2, master_pb2

REFS = [common_pb2.NodeRef(node_id=f"n{i}", address=f"10.0.0.{i}:7610", host_id="h" * i, arena=f"kvpool-{i}",
                           data_address=f"10.0.0.{i}:7611" if i % 2 else "") for i in range(3)]
LONG_REF = common_pb2.NodeRef(node_id="n" * 200, address="a" * 300)  # a length that takes two varint bytes


@pytest.mark.parametrize("blocks", [0, 1, 2, 31, 127, 128, 300])
@pytest.mark.parametrize("shape", ["one node, one size", "nodes and sizes of every width"])
def test_the_encoded_reply_is_the_messages_serialization(blocks, shape):
    rng = np.random.default_rng(blocks)
    tiers = rng.integers(0, 3, blocks).astype(np.uint8)
    if shape == "one node, one size":
        refs, node_indexes, sizes = REFS[:1], np.zeros(blocks, np.uint32), np.full(blocks, 4096, np.uint64)
    else:
        refs = [*REFS, LONG_REF]
        node_indexes = rng.integers(0, len(refs), blocks).astype(np.uint32)
        widths = rng.integers(0, 64, blocks).astype(np.uint64)  # 0 to 64-bit values: 1 to 10 varint bytes
        sizes = (rng.integers(0, 1 << 63, blocks).astype(np.uint64) * np.uint64(2) + np.uint64(1)) >> widths
        sizes[: min(blocks, 3)] = [0, 127, (1 << 64) - 1][: min(blocks, 3)]
    checksums = rng.integers(0, 1 << 63, blocks).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    dram, ssd = int(np.count_nonzero(tiers == 1)), int(np.count_nonzero(tiers == 2))
    refs = refs if blocks else []
    message = master_pb2.LookupResponse(
        tiers=tiers.tobytes(), node_indexes=node_indexes.tolist(), sizes=sizes.tolist(), checksums=checksums.tolist(),
        nodes=refs, dram_blocks=dram, ssd_blocks=ssd)
    got = encode(tiers, node_indexes, sizes, checksums, [r.SerializeToString() for r in refs], dram, ssd)
    assert got == message.SerializeToString()
    assert master_pb2.LookupResponse.FromString(got) == message


def test_strided_and_read_only_columns_encode_as_their_values():
    """The run's columns are slices of a pass's shared arrays (strided, read-only where numpy made them so)."""
    wide = np.arange(40, dtype=np.uint64).reshape(20, 2)
    sizes, checksums = wide[:, 0], wide[:, 1]
    sizes.flags.writeable = False
    tiers, nodes = np.ones(20, np.uint8), np.zeros(20, np.uint32)
    message = master_pb2.LookupResponse(tiers=tiers.tobytes(), node_indexes=[0] * 20, sizes=sizes.tolist(),
                                        checksums=checksums.tolist(), nodes=REFS[:1], dram_blocks=20)
    assert encode(tiers, nodes, sizes, checksums, [REFS[0].SerializeToString()], 20, 0) == message.SerializeToString()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 1 << 32, (1 << 64) - 1])
def test_a_varint_is_protobufs(value):
    packed = master_pb2.LookupResponse(sizes=[value]).SerializeToString()  # tag, length (one byte), the varint
    assert varint(value) == packed[2:]
