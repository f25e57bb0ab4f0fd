"""GrpcPath against a fake node stub: what arrives intact is marked, every fault is a counted miss, nothing is
handed on."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from client_fakes import FakeNodes, block, counts, faults, key, node, run_of

from kvpool.checksum import block_checksum
from kvpool.client import grpc_path
from kvpool.client.faults import PoolFault
from kvpool.client.grpc_path import GrpcPath
from kvpool.config import ClientConfig
from kvpool.keys import unpack_keys

N1 = node("n1")


def setup(strict: bool = False):
    nodes = FakeNodes()
    f, registry = faults(strict)
    return GrpcPath(ClientConfig(), nodes, f), nodes, registry  # type: ignore[arg-type]


def later() -> float:
    return time.monotonic() + 60


def test_a_get_copies_every_held_block_into_its_buffer():
    path, nodes, registry = setup()
    blocks = [block(i, 1000 + i) for i in range(4)]
    nodes.stub(N1.address).held = {key(i): blocks[i].tobytes() for i in range(4)}
    run = run_of([key(i) for i in range(4)], blocks, [N1])
    dsts = [np.zeros(b.size, np.uint8) for b in blocks]
    ok = [False] * 4
    assert path.get(N1, [0, 2, 3], run, dsts, ok, later()) == []
    assert ok == [True, False, True, True]
    assert all(np.array_equal(dsts[i], blocks[i]) for i in (0, 2, 3)) and not dsts[1].any()
    assert counts(registry) == {}


def test_a_get_counts_gone_changed_and_corrupt_blocks_as_misses_and_hands_none_on():
    path, nodes, registry = setup()
    blocks = [block(i, 512) for i in range(4)]
    stub = nodes.stub(N1.address)
    stub.held = {key(0): blocks[0].tobytes(), key(2): block(99, 512).tobytes(), key(3): blocks[3].tobytes()}
    stub.corrupt = {key(3)}  # the right checksum sent with wrong bytes: caught by the copy's own hash
    run = run_of([key(i) for i in range(4)], blocks, [N1])  # key 1 gone; key 2 holds other bytes now
    dsts = [np.zeros(512, np.uint8) for _ in blocks]
    ok = [False] * 4
    assert path.get(N1, [0, 1, 2, 3], run, dsts, ok, later()) == []
    assert ok == [True, False, False, False]
    assert counts(registry) == {"block_gone": 1, "block_changed": 1, "checksum": 1}


@pytest.mark.parametrize("cut", ["sizes", "checksums", "tiers", "data"])
def test_a_get_reply_not_shaped_as_the_nodes_is_a_miss_of_every_block_never_an_error(cut, monkeypatch):
    path, nodes, registry = setup()
    blocks = [block(i, 256) for i in range(3)]
    stub = nodes.stub(N1.address)
    stub.held = {key(i): blocks[i].tobytes() for i in range(3)}
    real_get = stub.Get

    def short(request, timeout=None):  # one field cut short (a node that lies, or a bug)
        reply = real_get(request, timeout)
        if cut == "data":
            reply.data = reply.data[:-1]
        elif cut == "tiers":
            reply.tiers = reply.tiers[:-1]
        else:
            del getattr(reply, cut)[-1]
        return reply

    monkeypatch.setattr(stub, "Get", short)
    dsts = [np.zeros(256, np.uint8) for _ in blocks]
    ok = [False] * 3
    assert path.get(N1, [0, 1, 2], run_of([key(i) for i in range(3)], blocks, [N1]), dsts, ok, later()) == []
    assert ok == [False] * 3 and not any(d.any() for d in dsts)
    assert counts(registry) == {"bad_reply": 3}


def test_a_failed_get_is_a_miss_per_block_and_in_strict_mode_a_pool_fault():
    path, nodes, registry = setup()
    nodes.stub(N1.address).fail = grpc.StatusCode.UNAVAILABLE
    blocks = [block(i, 64) for i in range(3)]
    run = run_of([key(i) for i in range(3)], blocks, [N1])
    ok = [False] * 3
    assert path.get(N1, [0, 1, 2], run, [np.zeros(64, np.uint8) for _ in blocks], ok, later()) == []
    assert ok == [False] * 3 and counts(registry) == {"unavailable": 3}

    strict, nodes, _ = setup(strict=True)
    nodes.stub(N1.address).fail = grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(PoolFault) as fault:
        strict.get(N1, [0], run, [np.zeros(64, np.uint8)], [False], later())
    assert fault.value.kind == "timeout"


def test_a_get_is_split_into_calls_of_at_most_the_chunk_size_each_given_what_is_left_of_the_deadline(monkeypatch):
    monkeypatch.setattr(grpc_path, "GRPC_CHUNK_BYTES", 1000)
    path, nodes, _ = setup()
    blocks = [block(i, 400) for i in range(5)]
    stub = nodes.stub(N1.address)
    stub.held = {key(i): b.tobytes() for i, b in enumerate(blocks)}
    run = run_of([key(i) for i in range(5)], blocks, [N1])
    ok = [False] * 5
    deadline = time.monotonic() + 30
    path.get(N1, list(range(5)), run, [np.zeros(400, np.uint8) for _ in blocks], ok, deadline)
    assert ok == [True] * 5
    assert [len(unpack_keys(r.keys)) for _, r, _ in stub.calls] == [2, 2, 1]
    assert all(0 < t <= 30 for _, _, t in stub.calls)


def test_a_put_sends_keys_sizes_bytes_and_checksums_and_marks_what_the_node_stored():
    path, nodes, registry = setup()
    blocks = [block(i, 100 * (i + 1)) for i in range(3)]
    keys = [key(i) for i in range(3)]
    stub = nodes.stub(N1.address)
    stub.refuse = {key(2)}  # out of room
    result = [False] * 3
    assert path.put(N1, [0, 1, 2], keys, blocks, [b.size for b in blocks], result, later()) == []
    assert result == [True, True, False]
    (_, request, _), = stub.calls
    assert list(request.sizes) == [100, 200, 300] and request.data == b"".join(b.tobytes() for b in blocks)
    assert list(request.checksums) == [block_checksum(b) for b in blocks]
    assert stub.held == {keys[0]: blocks[0].tobytes(), keys[1]: blocks[1].tobytes()}
    assert counts(registry) == {"put_refused": 1}


def test_a_failed_put_is_counted_never_raised_even_in_strict_mode():
    path, nodes, registry = setup(strict=True)
    nodes.stub(N1.address).fail = grpc.StatusCode.UNAVAILABLE
    result = [False]
    assert path.put(N1, [0], [key(0)], [block(0, 10)], [10], result, later()) == []
    assert result == [False] and counts(registry) == {"unavailable": 1}


def test_past_the_deadline_each_call_gets_no_time():
    path, nodes, _ = setup()
    stub = nodes.stub(N1.address)
    path.put(N1, [0], [key(0)], [block(0, 10)], [10], [False], time.monotonic() - 1)
    assert [t for _, _, t in stub.calls] == [0.0]
