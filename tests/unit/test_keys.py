"""Block keys: determinism, namespaces, whole-block reuse, opaque keys, packing."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvpool.keys import (
    KEY_BYTES,
    KeyNamespace,
    chain_block_keys,
    check_key,
    leading_hits,
    opaque_key,
    pack_keys,
    unpack_keys,
)

NS = KeyNamespace(model="qwen2-0.5b", layout="bfloat16:L24:H2:D64:B128:layer_kv")

_CHILD = """
import sys
from kvpool.keys import KeyNamespace, chain_block_keys
ns = KeyNamespace(model="qwen2-0.5b", layout="bfloat16:L24:H2:D64:B128:layer_kv", tp_rank=1, tp_size=2, tenant="t")
print(",".join(k.hex() for k in chain_block_keys(list(range(1000, 1000 + 300)), 128, ns)))
"""


def test_keys_are_identical_across_fresh_interpreters_with_different_hash_seeds():
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        outputs.append(done.stdout.strip())
    assert outputs[0] == outputs[1]
    ns = KeyNamespace(model="qwen2-0.5b", layout=NS.layout, tp_rank=1, tp_size=2, tenant="t")
    here = ",".join(k.hex() for k in chain_block_keys(list(range(1000, 1300)), 128, ns))
    assert outputs[0] == here
    assert len(here.split(",")) == 2  # 300 tokens: two full blocks


def test_only_full_blocks_164_token_shared_prefix_reuses_128_tokens():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 150_000, 164)
    a = np.concatenate([shared, rng.integers(0, 150_000, 300)])
    b = np.concatenate([shared, rng.integers(0, 150_000, 300)])
    ka, kb = chain_block_keys(a, 128, NS), chain_block_keys(b, 128, NS)
    assert len(ka) == len(kb) == 464 // 128
    reused_blocks = leading_hits([x == y for x, y in zip(ka, kb)])
    assert reused_blocks * 128 == 128


def test_a_key_depends_on_every_earlier_token():
    tokens = list(range(512))
    base = chain_block_keys(tokens, 128, NS)
    changed = list(tokens)
    changed[5] += 1  # a token in block 0 changes every later key
    assert all(x != y for x, y in zip(base, chain_block_keys(changed, 128, NS)))
    changed = list(tokens)
    changed[300] += 1  # a token in block 2 leaves blocks 0-1 alone
    other = chain_block_keys(changed, 128, NS)
    assert other[:2] == base[:2] and other[2] != base[2] and other[3] != base[3]


@pytest.mark.parametrize(
    "field,value",
    [("model", "qwen2-7b"), ("layout", "float16:L24:H2:D64:B128:layer_kv"), ("tp_rank", 1), ("tenant", "acme")],
)
def test_namespaces_separate_identical_tokens(field, value):
    fields = dict(model=NS.model, layout=NS.layout, tp_rank=0, tp_size=2, tenant="")
    base = KeyNamespace(**fields)
    fields[field] = value
    other = KeyNamespace(**fields)
    tokens = list(range(256))
    assert set(chain_block_keys(tokens, 128, base)).isdisjoint(chain_block_keys(tokens, 128, other))


def test_parent_continues_a_chain():
    tokens = list(range(512))
    whole = chain_block_keys(tokens, 128, NS)
    tail = chain_block_keys(tokens[256:], 128, NS, parent=whole[1])
    assert tail == whole[2:]


def test_opaque_keys_are_fixed_width_and_scoped():
    mindie = "9f1c2e_0_2_qwen2"
    k = opaque_key(mindie)
    assert len(k) == KEY_BYTES and k == opaque_key(mindie.encode())
    assert k != opaque_key(mindie, NS) != opaque_key(mindie, KeyNamespace("other", NS.layout))
    assert k not in chain_block_keys(list(range(128)), 128, NS)


@pytest.mark.parametrize("bad", ["", b"", "x" * 2000, 42, None])
def test_malformed_opaque_keys_are_refused(bad):
    with pytest.raises(ValueError):
        opaque_key(bad)


@pytest.mark.parametrize("tokens", [[-1, 2], [2**32], [[1, 2]], [1.5, 2.0]])
def test_bad_tokens_are_refused(tokens):
    with pytest.raises(ValueError):
        chain_block_keys(tokens, 1, NS)


def test_bad_namespaces_are_refused():
    with pytest.raises(ValueError):
        KeyNamespace(model="", layout="x")
    with pytest.raises(ValueError):
        KeyNamespace(model="m", layout="x", tp_rank=2, tp_size=2)


def test_pack_and_unpack_round_trip_and_refuse_ragged_input():
    keys = chain_block_keys(list(range(128 * 5)), 128, NS)
    packed = pack_keys(keys)
    assert len(packed) == 5 * KEY_BYTES and unpack_keys(packed) == keys
    with pytest.raises(ValueError):
        unpack_keys(packed[:-1])
    with pytest.raises(ValueError):
        check_key(b"short")
    with pytest.raises(ValueError):
        check_key("a" * 32)


def test_engine_hashes_are_read_from_engine_key_strings_as_64_bit_ints():
    from kvpool.engines.keymap import engine_hash
    from kvpool.engines.vllm_ascend import block_hash

    vllm_hash = bytes(range(32))
    key = "m@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@" + vllm_hash.hex()
    assert block_hash(key) == int.from_bytes(vllm_hash, "big") & ((1 << 64) - 1)  # vLLM's int form
    assert block_hash("m@pcp0@not-hex") == 0 and block_hash("") == 0
    assert engine_hash(str(2**70 + 5), 10) == (2**70 + 5) & ((1 << 64) - 1)  # MindIE's decimal prefix hash
    assert engine_hash("12ab", 10) == 0 and engine_hash("", 16) == 0 and engine_hash("-5", 10) == 0
    assert engine_hash("00ff", 16) == 255
