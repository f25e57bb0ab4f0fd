"""The vLLM connector's block copies: a block's bytes out of vLLM's per-layer caches and back, any block dimension."""

from __future__ import annotations

import pytest
import torch

from kvpool.engines.vllm.worker import _gather, _scatter, block_layers

NUM_BLOCKS = 40


@pytest.mark.parametrize("shape", [(NUM_BLOCKS, 2, 32, 128), (2, NUM_BLOCKS, 32, 2, 64)], ids=["cpu", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_gathered_then_scattered_elsewhere_are_the_same_bytes(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    caches = {f"layer{i}": torch.randn(*shape, generator=gen).to(dtype) for i in range(3)}
    layers = block_layers(caches, NUM_BLOCKS)
    assert [lay.block_dim for lay in layers] == [shape.index(NUM_BLOCKS)] * 3
    src, dst = torch.tensor([3, 7, 8]), torch.tensor([30, 1, 22])
    staging = torch.zeros(len(src), len(layers), layers[0].piece_bytes, dtype=torch.uint8)
    for i, layer in enumerate(layers):
        _gather(layer, src, staging[:, i])
    before = {name: t.clone() for name, t in caches.items()}
    for i, layer in enumerate(layers):
        _scatter(layer, dst, staging[:, i])
    for name, t in caches.items():
        dim = shape.index(NUM_BLOCKS)
        assert torch.equal(t.index_select(dim, dst), t.index_select(dim, src))
        untouched = torch.tensor([b for b in range(NUM_BLOCKS) if b not in dst.tolist()])
        assert torch.equal(t.index_select(dim, untouched), before[name].index_select(dim, untouched))


def test_caches_without_a_block_dimension_or_of_different_slices_are_refused():
    with pytest.raises(ValueError, match="no dimension of 40 blocks"):
        block_layers({"l0": torch.zeros(39, 2, 32, 128)}, NUM_BLOCKS)
    with pytest.raises(ValueError, match="different block slices"):
        block_layers({"l0": torch.zeros(40, 2, 32, 128), "l1": torch.zeros(40, 1, 32, 128)}, NUM_BLOCKS)
