"""The vLLM connector's block keys: equal in every process whatever PYTHONHASHSEED, apart per tenant and layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from kvpool.engines.vllm.keys import RequestKeys, VllmKeySpace, request_tenant, shard_key
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout

LAYOUT = KVLayout("bfloat16", num_layers=24, num_kv_heads=2, head_dim=64, block_size=32)
SPACE = VllmKeySpace("Qwen/Qwen2-0.5B", LAYOUT, "cpu/LBHNC")


@dataclass
class Lora:
    lora_name: str


@dataclass
class Feature:
    identifier: str


@dataclass
class Request:
    """The attributes of vLLM's ``Request`` the key space reads."""

    cache_salt: str | None = None
    lora_request: Lora | None = None
    mm_features: list[Any] = field(default_factory=list)


def keys(request: Request, tokens: list[int], space: VllmKeySpace = SPACE) -> list[BlockKey]:
    return RequestKeys(space.namespace(request_tenant(request)), 32).upto(tokens, len(tokens) // 32)


TOKENS = list(range(1000, 1100))


def test_keys_are_the_same_in_processes_with_different_hash_seeds():
    code = ("import json; from test_vllm_keys import Request, TOKENS, keys; "
            "print(json.dumps([k.hex() for k in keys(Request(cache_salt='t'), TOKENS)]))")
    seen = []
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.path.dirname(__file__)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.append(json.loads(out.stdout))
    assert seen[0] == seen[1] == seen[2] == [k.hex() for k in keys(Request(cache_salt="t"), TOKENS)]
    assert len(seen[0]) == 3  # full blocks only


def test_tenants_adapters_media_and_layouts_never_share_keys():
    variants = [
        keys(Request(), TOKENS),
        keys(Request(cache_salt="alice"), TOKENS),
        keys(Request(cache_salt="bob"), TOKENS),
        keys(Request(lora_request=Lora("sql-adapter")), TOKENS),
        keys(Request(mm_features=[Feature("image-hash-1")]), TOKENS),
        keys(Request(mm_features=[Feature("image-hash-2")]), TOKENS),
        keys(Request(), TOKENS, VllmKeySpace("Qwen/Qwen2-0.5B", LAYOUT, "cuda/NHD")),
        keys(Request(), TOKENS, VllmKeySpace("Qwen/Qwen2-0.5B", LAYOUT, "cpu/LBHNC", tp_size=2)),
        keys(Request(), TOKENS, VllmKeySpace("other-model", LAYOUT, "cpu/LBHNC")),
    ]
    firsts = [v[0] for v in variants]
    assert len(set(firsts)) == len(firsts)
    assert keys(Request(cache_salt="alice"), TOKENS) == variants[1]  # and the same inputs agree


def test_a_chain_extended_as_tokens_grow_equals_one_computed_at_once():
    grown = RequestKeys(SPACE.namespace(""), 32)
    grown.upto(TOKENS[:40], 1)
    grown.upto(TOKENS[:70], 2)
    assert grown.upto(TOKENS, 3) == keys(Request(), TOKENS)


def test_shard_keys_differ_per_shard_and_shard_0_is_the_key():
    key = keys(Request(), TOKENS)[0]
    assert shard_key(key, 0) == key
    assert len({shard_key(key, s) for s in range(8)}) == 8
