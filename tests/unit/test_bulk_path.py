"""BulkPath against a fake bulk client and node directory: what it moves, what it hands on to gRPC, what it counts."""

from __future__ import annotations

import time

import numpy as np
import pytest
from client_fakes import FakeBulkClient, FakeNodes, block, counts, faults, key, node, run_of

from kvpool.client import bulk_path
from kvpool.client.bulk_client import CHANGED, CORRUPT, GONE, BulkFailed, BulkUnavailable
from kvpool.client.bulk_path import BulkPath
from kvpool.config import ClientConfig

N1 = node("n1")
BULK = "n1.invalid:2"


@pytest.fixture
def parts():
    nodes = FakeNodes(data_addresses={N1.address: BULK})
    f, registry = faults()
    path = BulkPath(ClientConfig(), nodes, f)
    fake = FakeBulkClient()
    path.bulk = fake  # the protocol client's sockets, faked: the path's own logic is what is tested
    yield path, nodes, fake, registry
    path.close()


def later() -> float:
    return time.monotonic() + 60


def get(path, blocks, idxs, deadline=None):
    run = run_of([key(i) for i in range(len(blocks))], blocks, [N1])
    dsts = [np.zeros(b.size, np.uint8) for b in blocks]
    ok = [False] * len(blocks)
    rest = path.get(N1, idxs, run, dsts, ok, later() if deadline is None else deadline)
    return rest, ok, dsts


def test_a_get_lands_in_the_buffers_and_counts_each_kind_of_miss(parts):
    path, _, fake, registry = parts
    blocks = [block(i, 256) for i in range(5)]
    fake.held = {key(i): b.tobytes() for i, b in enumerate(blocks)}
    fake.status = {key(1): GONE, key(2): CHANGED, key(3): CORRUPT}
    rest, ok, dsts = get(path, blocks, [0, 1, 2, 3, 4])
    assert rest == [] and ok == [True, False, False, False, True]
    assert np.array_equal(dsts[0], blocks[0]) and np.array_equal(dsts[4], blocks[4])
    assert counts(registry) == {"block_gone": 1, "block_changed": 1, "checksum": 1}
    assert [(m, a) for m, a, _, _ in fake.calls] == [("get_into", BULK)]


def test_no_listener_or_a_passed_deadline_hands_every_block_on_without_a_call(parts):
    path, nodes, fake, _ = parts
    blocks = [block(i, 64) for i in range(3)]
    assert get(path, blocks, [0, 2], deadline=time.monotonic() - 1)[0] == [0, 2]
    nodes.data_addresses.clear()
    assert get(path, blocks, [0, 1, 2])[0] == [0, 1, 2]
    result = [False] * 3
    assert path.put(N1, [1, 2], [key(i) for i in range(3)], blocks, [64] * 3, result, later()) == [1, 2]
    assert fake.calls == [] and result == [False] * 3


def test_an_unreachable_listener_hands_the_blocks_on_and_is_reported_to_the_directory(parts):
    path, nodes, fake, registry = parts
    fake.raises = [BulkUnavailable("refused")]
    rest, ok, _ = get(path, [block(i, 64) for i in range(2)], [0, 1])
    assert rest == [0, 1] and ok == [False, False]
    assert nodes.unreachable == [N1.address] and counts(registry) == {}


def test_a_broken_exchange_hands_on_only_the_blocks_not_moved_yet_counted_as_a_fallback(parts, monkeypatch):
    monkeypatch.setattr(bulk_path, "GET_CHUNK_BYTES", 300)  # two blocks of 128 bytes a request
    path, _, fake, registry = parts
    blocks = [block(i, 128) for i in range(5)]
    fake.held = {key(i): b.tobytes() for i, b in enumerate(blocks)}
    fake.raises = [None, BulkFailed("reset", "connection reset")]
    rest, ok, _ = get(path, blocks, [0, 1, 2, 3, 4])
    assert [len(k) for _, _, k, _ in fake.calls] == [2, 2]
    assert ok == [True, True, False, False, False] and rest == [2, 3, 4]
    assert counts(registry) == {"bulk_fallback": 2}


def test_a_put_stores_with_the_blocks_checksums_and_counts_refusals(parts):
    path, _, fake, registry = parts
    blocks = [block(i, 100) for i in range(3)]
    keys = [key(i) for i in range(3)]
    fake.refuse = {keys[1]}
    result = [False] * 3
    assert path.put(N1, [0, 1, 2], keys, blocks, [100] * 3, result, later()) == []
    assert result == [True, False, True] and set(fake.held) == {keys[0], keys[2]}
    assert counts(registry) == {"put_refused": 1}


def test_a_failed_put_hands_its_blocks_on(parts):
    path, _, fake, registry = parts
    fake.raises = [BulkFailed("reset", "connection reset")]
    result = [False] * 2
    assert path.put(N1, [0, 1], [key(0), key(1)], [block(0, 8), block(1, 8)], [8, 8], result, later()) == [0, 1]
    assert result == [False, False] and counts(registry) == {"bulk_fallback": 2}
