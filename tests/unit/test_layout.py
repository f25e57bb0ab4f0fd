"""KV layouts: block sizes, piece offsets, validation of buffers."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import KVLayout, check_block


def test_qwen2_7b_like_block_is_7_mib_and_tiny_qwen2_is_1_mib():
    assert KVLayout("bf16", 28, 4, 128, 128).block_bytes == 7 << 20
    assert KVLayout("float32", 8, 2, 64, 128).block_bytes == 1 << 20
    assert KVLayout("bfloat16", 61, 1, 576, 128, kv_order="latent").block_bytes == 61 * 128 * 576 * 2


def test_piece_offsets_follow_kv_order():
    lk = KVLayout("float16", 3, 2, 4, 8)
    kl = KVLayout("float16", 3, 2, 4, 8, kv_order="kv_layer")
    p = lk.piece_bytes
    assert [lk.piece_offset(1, 0), lk.piece_offset(1, 1)] == [2 * p, 3 * p]
    assert [kl.piece_offset(1, 0), kl.piece_offset(1, 1)] == [1 * p, 4 * p]
    with pytest.raises(ValueError):
        lk.piece_offset(3, 0)


def test_fingerprint_names_every_field():
    a = KVLayout("float16", 3, 2, 4, 8)
    variants = [
        KVLayout("bfloat16", 3, 2, 4, 8), KVLayout("float16", 4, 2, 4, 8), KVLayout("float16", 3, 1, 4, 8),
        KVLayout("float16", 3, 2, 8, 8), KVLayout("float16", 3, 2, 4, 16), KVLayout("float16", 3, 2, 4, 8, "kv_layer"),
    ]
    assert len({a.fingerprint(), *(v.fingerprint() for v in variants)}) == 7


def test_check_block_accepts_exact_buffers_only():
    layout = KVLayout("float32", 2, 2, 4, 4)
    good = np.zeros(layout.block_bytes // 4, np.float32)
    layout.check_block(good)
    layout.check_block(good.view(np.uint8))
    layout.check_block(bytes(layout.block_bytes))
    with pytest.raises(ValueError, match=f"buffer is {layout.block_bytes - 4} bytes; one block of "
                                         f"{layout.fingerprint()} is {layout.block_bytes}"):
        layout.check_block(np.zeros(layout.block_bytes // 4 - 1, np.float32))
    with pytest.raises(ValueError, match="buffer dtype float16 does not match layout dtype float32"):
        layout.check_block(np.zeros(layout.block_bytes // 2, np.float16))
    with pytest.raises(ValueError, match="contiguous"):
        layout.check_block(np.zeros((layout.block_bytes // 2,), np.float32)[::2])
    with pytest.raises(ValueError, match="expected a buffer"):
        layout.check_block("not a block")


def test_check_block_accepts_exact_tensors_only():
    """Tensors (any device: only their shape, dtype and strides are read) get the same gate as buffers."""
    import torch
    layout = KVLayout("bfloat16", 2, 2, 4, 4)
    layout.check_block(torch.zeros(layout.block_bytes // 2, dtype=torch.bfloat16))
    layout.check_block(torch.zeros(2, layout.block_bytes // 4, dtype=torch.bfloat16))
    layout.check_block(torch.zeros(layout.block_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"block 3 is {layout.block_bytes - 2} bytes"):
        layout.check_block(torch.zeros(layout.block_bytes // 2 - 1, dtype=torch.bfloat16), what="block 3")
    with pytest.raises(ValueError, match="tensor dtype float16 does not match layout dtype bfloat16"):
        layout.check_block(torch.zeros(layout.block_bytes // 2, dtype=torch.float16), what="tensor")
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        layout.check_block(torch.zeros(layout.block_bytes // 4, 2, dtype=torch.bfloat16).t(), what="tensor")


def test_check_block_of_a_byte_count_and_without_a_layout():
    """Engines that name a block by pieces check their sum; a block size without a layout (SGLang's measured
    page) goes through the same function, without a dtype."""
    layout = KVLayout("float16", 2, 2, 4, 4)
    layout.check_block(layout.block_bytes)
    with pytest.raises(ValueError, match=f"key 0: its pieces is 10 bytes; one block of {layout.fingerprint()}"):
        layout.check_block(10, what="key 0: its pieces")
    check_block(np.zeros(64, np.float32), 256)  # no dtype: any dtype of the right size
    with pytest.raises(ValueError, match="page 1 is 128 bytes; one block is 256"):
        check_block(np.zeros(32, np.float32), 256, what="page 1")


@pytest.mark.parametrize(
    "data",
    [
        {"dtype": "float13", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1},
        {"dtype": "float16", "num_layers": 0, "num_kv_heads": 1, "head_dim": 1, "block_size": 1},
        {"dtype": "float16", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1, "kv_order": "x"},
        {"dtype": "float16", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1},
        {"dtype": "float16", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1, "color": 1},
    ],
)
def test_unknown_or_bad_layouts_are_refused(data):
    with pytest.raises(ValueError):
        KVLayout.from_dict(data)


def test_layout_round_trips_through_dict():
    layout = KVLayout("torch.bfloat16", 28, 4, 128, 128)
    assert layout.dtype == "bfloat16"
    assert KVLayout.from_dict(layout.to_dict()) == layout
