"""HbmStore (kvpool.client.hbm) and resolve_device on CPU with real torch."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from kvpool.client.devices import resolve_device
from kvpool.client.hbm import HbmStore
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout
from kvpool.vocabulary import Tier

BF16 = KVLayout("bfloat16", 2, 2, 8, 4)  # 2 layers * K,V * 4 tok * 2 heads * 8 dim * 2 B = 512 B
F32 = KVLayout("float32", 2, 2, 8, 4)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(f"block-{i}".encode()).digest())


def block(layout: KVLayout, seed: int) -> torch.Tensor:
    """A random block shaped [pieces, block_size, heads, dim] in the layout's dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_pieces, *layout.piece_shape)
    return torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))


def empty(layout: KVLayout) -> torch.Tensor:
    return torch.zeros((layout.num_pieces, *layout.piece_shape), dtype=getattr(torch, layout.dtype))


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[BlockKey], list[BlockKey]]] = []

    def __call__(self, added: list[BlockKey], removed: list[BlockKey]) -> None:
        self.calls.append((list(added), list(removed)))


@pytest.mark.parametrize("layout", [BF16, F32], ids=["bfloat16", "float32"])
def test_put_get_byte_exact(layout: KVLayout) -> None:
    store = HbmStore(layout, capacity_blocks=4)
    assert store.tier is Tier.HBM
    values = [block(layout, i) for i in range(3)]
    assert store.put([key(i) for i in range(3)], values) == [True, True, True]
    outs = [empty(layout) for _ in range(4)]
    assert store.get_into([key(0), key(1), key(2), key(9)], outs) == [True, True, True, False]
    for value, out in zip(values, outs):
        assert raw(out) == raw(value)
        assert out.dtype == value.dtype
    assert raw(outs[3]) == bytes(layout.block_bytes)  # miss left untouched (still zeros)
    s = store.stats()
    assert (s.blocks, s.hits, s.misses, s.puts) == (3, 3, 1, 3)
    assert s.capacity_bytes == 4 * layout.block_bytes
    assert s.used_bytes == 3 * layout.block_bytes
    assert s.bytes_in == 3 * layout.block_bytes and s.bytes_out == 3 * layout.block_bytes


def test_uint8_tensors_are_raw_bytes_no_conversion() -> None:
    store = HbmStore(BF16, capacity_blocks=2)
    value = block(BF16, 7)
    flat = value.reshape(-1).view(torch.uint8).clone()
    assert store.put([key(0)], [flat]) == [True]
    out = empty(BF16)
    assert store.get_into([key(0)], [out]) == [True]
    assert torch.equal(out, value)
    out_raw = torch.zeros(BF16.block_bytes, dtype=torch.uint8)
    assert store.get_into([key(0)], [out_raw]) == [True]
    assert torch.equal(out_raw, flat)


def test_present_key_refreshes_without_copy() -> None:
    store = HbmStore(BF16, capacity_blocks=2)
    first, second = block(BF16, 1), block(BF16, 2)
    store.put([key(0), key(1)], [first, block(BF16, 3)])
    assert store.put([key(0)], [second]) == [True]
    assert store.keys() == [key(1), key(0)]  # refreshed to MRU
    out = empty(BF16)
    store.get_into([key(0)], [out])
    assert raw(out) == raw(first)  # the old bytes: no copy
    assert store.stats().puts == 2


def test_lru_eviction_keeps_touched_block() -> None:
    store = HbmStore(BF16, capacity_blocks=3)
    store.put([key(0), key(1), key(2)], [block(BF16, i) for i in range(3)])
    assert store.get_into([key(0)], [empty(BF16)]) == [True]  # 0 is now MRU; 1 is LRU
    assert store.put([key(3)], [block(BF16, 3)]) == [True]
    assert store.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert store.keys() == [key(2), key(0), key(3)]
    out = empty(BF16)
    assert store.get_into([key(3)], [out]) == [True]
    assert raw(out) == raw(block(BF16, 3))  # the reused slot holds the new bytes
    assert store.stats().evictions == 1


def test_contains_does_not_change_recency() -> None:
    store = HbmStore(BF16, capacity_blocks=2)
    store.put([key(0), key(1)], [block(BF16, 0), block(BF16, 1)])
    assert store.contains([key(0)]) == [True]
    assert store.keys() == [key(0), key(1)]
    store.put([key(2)], [block(BF16, 2)])
    assert store.contains([key(0), key(1), key(2)]) == [False, True, True]


def test_batch_larger_than_capacity_never_evicts_itself() -> None:
    rec = Recorder()
    store = HbmStore(BF16, capacity_blocks=2, on_change=rec)
    store.put([key(9)], [block(BF16, 9)])
    result = store.put([key(i) for i in range(4)], [block(BF16, i) for i in range(4)])
    assert result == [True, True, False, False]
    assert store.keys() == [key(0), key(1)]
    assert rec.calls[-1] == ([key(0), key(1)], [key(9)])


def test_on_change_reports_adds_evictions_removes_and_close() -> None:
    rec = Recorder()
    store = HbmStore(BF16, capacity_blocks=2, on_change=rec)
    store.put([key(0), key(1)], [block(BF16, 0), block(BF16, 1)])
    assert rec.calls == [([key(0), key(1)], [])]
    store.put([key(2)], [block(BF16, 2)])
    assert rec.calls[-1] == ([key(2)], [key(0)])
    store.put([key(2)], [block(BF16, 2)])  # refresh only: nothing changed, no call
    assert len(rec.calls) == 2
    assert store.remove([key(1), key(5)]) == 1
    assert rec.calls[-1] == ([], [key(1)])
    store.close()
    assert rec.calls[-1] == ([], [key(2)])
    assert len(rec.calls) == 4


def test_remove_frees_slot_for_reuse() -> None:
    store = HbmStore(BF16, capacity_blocks=1)
    store.put([key(0)], [block(BF16, 0)])
    assert store.remove([key(0)]) == 1
    assert store.remove([key(0)]) == 0
    assert store.put([key(1)], [block(BF16, 1)]) == [True]
    assert store.stats().evictions == 0


# malformed on purpose (wrong types too): what HbmStore must refuse at run time
BAD_INPUTS: dict[str, Callable[[], tuple[list[Any], list[Any]]]] = {
    "wrong_size": lambda: ([key(5)], [torch.zeros(BF16.block_bytes // 2 - 1, dtype=torch.bfloat16)]),
    "wrong_dtype": lambda: ([key(5)], [torch.zeros(BF16.block_bytes // 4, dtype=torch.float32)]),
    "non_contiguous": lambda: ([key(5)], [torch.zeros((BF16.block_bytes // 2, 2), dtype=torch.bfloat16)[:, 0]]),
    "not_a_tensor": lambda: ([key(5)], [bytearray(BF16.block_bytes)]),
    "bad_key": lambda: ([b"short"], [block(BF16, 5)]),
    "length_mismatch": lambda: ([key(5), key(6)], [block(BF16, 5)]),
    "good_then_bad": lambda: ([key(5), key(6)], [block(BF16, 5), torch.zeros(3, dtype=torch.bfloat16)]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_and_changes_nothing(case: str) -> None:
    rec = Recorder()
    store = HbmStore(BF16, capacity_blocks=2, on_change=rec)
    store.put([key(0), key(1)], [block(BF16, 0), block(BF16, 1)])  # full: a put would evict
    calls = len(rec.calls)
    stats_before, keys_before = store.stats(), store.keys()
    keys, values = BAD_INPUTS[case]()
    with pytest.raises(ValueError):
        store.put(keys, values)
    with pytest.raises(ValueError):
        store.get_into(keys, values)
    assert store.stats() == stats_before
    assert store.keys() == keys_before  # same keys, same recency order
    assert len(rec.calls) == calls
    outs = [empty(BF16), empty(BF16)]
    assert store.get_into([key(0), key(1)], outs) == [True, True]
    assert [raw(o) for o in outs] == [raw(block(BF16, 0)), raw(block(BF16, 1))]


@pytest.mark.parametrize("case, message", [
    ("wrong_size", f"tensor is {BF16.block_bytes - 2} bytes; one block of {BF16.fingerprint()} is {BF16.block_bytes}"),
    ("wrong_dtype", "tensor dtype float32 does not match layout dtype bfloat16"),
    ("non_contiguous", "tensor must be contiguous"),
])
def test_a_wrong_block_is_refused_by_the_layouts_check(case: str, message: str) -> None:
    """HbmStore's gate is KVLayout.check_block: its message, for puts and for outputs alike."""
    store = HbmStore(BF16, capacity_blocks=2)
    keys, values = BAD_INPUTS[case]()
    with pytest.raises(ValueError, match=re.escape(message)):
        store.put(keys, values)
    with pytest.raises(ValueError, match=re.escape(message)):
        store.get_into(keys, values)
    assert store.keys() == []


def test_bad_out_leaves_other_outs_untouched() -> None:
    store = HbmStore(BF16, capacity_blocks=2)
    store.put([key(0)], [block(BF16, 0)])
    good = empty(BF16)
    with pytest.raises(ValueError):
        store.get_into([key(0), key(0)], [good, torch.zeros(4, dtype=torch.bfloat16)])
    assert raw(good) == bytes(BF16.block_bytes)


def test_bad_keys_rejected_by_contains_and_remove() -> None:
    store = HbmStore(BF16, capacity_blocks=1)
    with pytest.raises(ValueError):
        store.contains([BlockKey(b"x" * 31)])
    with pytest.raises(ValueError):
        store.remove(["not bytes"])  # type: ignore[list-item]  # a wrong type on purpose: the check under test


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_capacity_must_be_positive_int(capacity: object) -> None:
    with pytest.raises(ValueError):
        HbmStore(BF16, capacity_blocks=capacity)  # type: ignore[arg-type]  # wrong types on purpose


def test_closed_store_raises() -> None:
    store = HbmStore(BF16, capacity_blocks=1)
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.put([key(0)], [block(BF16, 0)]),
        lambda: store.get_into([key(0)], [empty(BF16)]),
        lambda: store.contains([key(0)]),
        lambda: store.remove([key(0)]),
        lambda: store.stats(),
        lambda: store.keys(),
    ):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_resolve_device_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert HbmStore(BF16, 1, device="cpu").device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resolve_device_cuda_unavailable() -> None:
    with pytest.raises(ValueError, match="cuda"):
        resolve_device("cuda:0")


def test_resolve_device_npu_needs_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed")
    with pytest.raises(ValueError, match="torch_npu"):
        resolve_device("npu:0")


@pytest.mark.parametrize("spec", ["tpu", "", "cuda:", "cuda:-1", "cpu:0", " cpu", "CUDA", None])
def test_resolve_device_rejects_unknown(spec: object) -> None:
    with pytest.raises(ValueError):
        resolve_device(spec)  # type: ignore[arg-type]  # wrong types on purpose (None)
