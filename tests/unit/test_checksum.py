"""The one block checksum and the copies that compute it as they go (kvpool/checksum.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.checksum import block_checksum, copy_with_checksum, gather_with_checksum


def pieces_of_every_kind() -> list[np.ndarray]:
    halves = np.arange(3 * 5 * 8, dtype=np.float16).reshape(3, 5, 8)
    big = np.random.default_rng(1).integers(0, 256, (3 << 18) + 5, dtype=np.uint8)  # > one 256 KiB chunk
    return [halves[:, 1], halves.transpose(2, 0, 1)[3], big, big[::2], np.array([7], dtype=np.int64)]


def test_gather_lands_the_pieces_bytes_in_order_and_returns_their_checksum():
    pieces = pieces_of_every_kind()
    expected = b"".join(np.ascontiguousarray(p).tobytes() for p in pieces)
    dst = np.zeros(len(expected), dtype=np.uint8)
    assert gather_with_checksum(dst, pieces) == block_checksum(np.frombuffer(expected, dtype=np.uint8))
    assert dst.tobytes() == expected


def test_copy_with_checksum_is_a_gather_of_one_piece():
    for size in (1, 4096, (1 << 20) + 3):
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        assert copy_with_checksum(dst, src) == block_checksum(src) and np.array_equal(dst, src)


def test_pieces_that_do_not_fill_the_block_exactly_are_refused_before_any_copy():
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="15 bytes"):
        gather_with_checksum(dst, [np.ones(15, dtype=np.uint8)])
    with pytest.raises(ValueError, match="17 bytes"):
        gather_with_checksum(dst, [np.ones(8, dtype=np.uint8), np.ones(9, dtype=np.uint8)])
    assert not dst.any()
