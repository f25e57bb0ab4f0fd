"""``kvpool demo``: the multi-turn dialog of the seeds on a running pool, with the reference engine.

Round 1 sends question 1; round 2 sends question 1 + answer 1 + question 2
and reuses round 1's KV in whole blocks. Worker 1 has an HBM tier (unless
``--hbm-blocks 0``), so its round 2 hits HBM; worker 2, a second engine
with its own client and no HBM tier, then sends the same round 2 and hits
the pool (DRAM, or SSD once DRAM has demoted the blocks). Printed: per
round, the tokens reused from each tier and the time to first token (with
its load and prefill), and whether worker 2 answered exactly as worker 1.
Worker 2 usually reuses a block more than worker 1's round 2 did: the
engine stores only its prompts' full blocks, so the block that runs from
question 1 into answer 1 is stored by worker 1's round 2 itself; worker 2
then computes fewer tokens and may start sooner, which says nothing of HBM
against DRAM. The demo says so, and compares the tiers by their load times.

The model is a seeded random Qwen2 (no download) unless ``--model PATH``
names a local HuggingFace directory. A random model has no tokenizer: text
becomes one token per UTF-8 byte, and its answers are not meant to be read.
A pool that cannot be reached is a miss: the demo still runs and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

SYSTEM = (
    "You are the support assistant of a company that runs large language models for its customers. "
    "Answer briefly and precisely. The platform serves each model on a fleet of accelerator hosts. "
    "Every host runs an inference engine with a prefix cache: the key and value tensors of a prompt are kept "
    "in blocks of a fixed number of tokens, so a later prompt that starts with the same tokens reuses them "
    "instead of computing them again. The cache lives first in the accelerator's own memory (HBM), then in a "
    "shared pool that spans the hosts' main memory (DRAM) and their solid-state drives (SSD). A central master "
    "service knows which blocks the pool holds and where. Blocks are only ever reused whole, and only as a "
    "leading run: the first block that is missing ends the reuse, and everything after it is computed. "
    "Customers are billed per token computed, not per token reused, and latency targets are stated as the "
    "time to the first token of an answer. Long system prompts, few-shot examples and multi-turn dialogs are "
    "the cases where the cache pays off most, because every turn of a dialog resends everything said so far. "
    "When a customer asks about their bill, explain which tokens were reused and why. When a customer asks "
    "about latency, explain that a prompt whose prefix is cached starts answering sooner, and by how much "
    "depends on how long the uncached rest of the prompt is. Never invent numbers you were not given.\n\n"
)
QUESTION_1 = "Customer: Our chat bot resends the whole conversation every turn. Does the cache help us?\nAssistant:"
QUESTION_2 = "\nCustomer: And how much sooner does the second turn start answering?\nAssistant:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="the pool's master host:port (default: the client config's)")
    parser.add_argument("--model", metavar="PATH", help="a local HuggingFace model directory (default: a random "
                        "Qwen2, no download)")
    parser.add_argument("--model-size", default="small", choices=["small", "tiny"],
                        help="the random Qwen2's size (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the random Qwen2's weights (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens a KV block (default: %(default)s)")
    parser.add_argument("--hbm-blocks", type=int, default=64,
                        help="worker 1's HBM tier in blocks; 0: none, so its round 2 hits the pool "
                        "(default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens each answer (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="a new key namespace (random tenant salt): ignore blocks earlier runs left in the pool")


def _line(label: str, result: Any) -> str:
    r = result.reused
    return (f"{label}: prompt {result.prompt_tokens} tokens, reused {result.reused_tokens} "
            f"(hbm {r['hbm']}, dram {r['dram']}, ssd {r['ssd']}), computed {result.computed_tokens}; "
            f"TTFT {result.ttft_s * 1e3:.1f} ms (load {_ms(result, 'load')}, prefill {_ms(result, 'prefill')})")


def _ms(result: Any, step: str) -> str:
    """How long one step of a request took (``GenerationResult.timings``), in ms."""
    return f"{result.timings.get(step, 0.0) * 1e3:.1f} ms"


def _tiers_compared(r1: Any, r2: Any, r2b: Any, block_size: int) -> list[str]:
    """Why worker 2's round 2 may reuse more (and so start sooner) than worker 1's, and what compares the tiers."""
    lines = [f"  the tiers compare by their loads of the reused blocks: worker 1 (its HBM first) {_ms(r2, 'load')}, "
             f"worker 2 (the pool only) {_ms(r2b, 'load')}; the rest of a TTFT is the prefill of the tokens not reused"]
    extra = r2b.reused_tokens - r2.reused_tokens
    if extra > 0:
        lines.append(
            f"  worker 2 reused {extra} tokens more than worker 1's round 2 (tokens {r2.reused_tokens}-"
            f"{r2b.reused_tokens - 1}) because that round stored them: the engine stores only its prompts' full "
            f"blocks of {block_size}, and these run past round 1's prompt ({r1.prompt_tokens} tokens) into what it "
            f"generated, so only round 2's prompt filled them; worker 2 then computed {r2b.computed_tokens} tokens "
            f"where worker 1 computed {r2.computed_tokens}: its TTFT is not HBM against DRAM")
    return lines


def _answer(tokenizer: Any, tokens: list[int], readable: bool) -> str:
    if not readable:
        return f"{len(tokens)} tokens (random weights: not meant to be read) {tokens[:8]}..."
    text = tokenizer.decode(tokens).replace("\n", " ")
    return f"{len(tokens)} tokens: {text[:160]!r}"


# Works from a wheel and from a checkout (an installed kvpool satisfies "kvpool[hf]"; pip adds the extra's
# packages). torch is pinned: unpinned, pip takes a multi-GB CUDA build even on a machine without a GPU.
HF_INSTALL_HINT = ('pip install "torch==2.13.0" "kvpool[hf]"; without a GPU, take the CPU build of torch first: '
                   'pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu')


def require_hf() -> None:
    """ValueError (the CLI's clean exit) naming what to install, if torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"needs torch and transformers ({exc}): {HF_INSTALL_HINT}") from None


def run(args: argparse.Namespace) -> int:
    require_hf()
    from kvpool.bench.replay import cluster_nodes
    from kvpool.client.kvclient import KVCacheClient
    from kvpool.config import ClientConfig, load_config
    from kvpool.engines import hf_model
    from kvpool.engines.transformers_engine import PrefixCachedEngine, kv_layout

    if args.block_size < 1 or args.hbm_blocks < 0 or args.max_new_tokens < 1:
        raise ValueError("--block-size and --max-new-tokens must be >= 1, --hbm-blocks >= 0")
    base: ClientConfig = load_config(args.config).client
    master = args.master or base.master
    if args.model:
        model, tokenizer = hf_model.load_local(args.model)
        readable = not isinstance(tokenizer, hf_model.ByteTokenizer)
        what = f"{args.model}"
    else:
        model, tokenizer = hf_model.random_qwen2(args.model_size, seed=args.seed), hf_model.ByteTokenizer()
        readable = False
        what = f"random Qwen2 ({args.model_size}, seed {args.seed}, no download)"
    layout = kv_layout(model, args.block_size)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    name = base.model if base.model != ClientConfig.model else hf_model.model_id(model)
    config = dataclasses.replace(base, master=master, layout=layout, model=name)
    if args.fresh:
        config = dataclasses.replace(config, tenant=f"demo-{os.urandom(8).hex()}")
    try:
        nodes = f"{len(cluster_nodes(master, timeout=3.0, token=config.token, tls_ca=config.tls_ca))} node(s)"
    except ValueError:
        nodes = "NOT REACHABLE: every block is a miss, everything is computed"
    print(f"kvpool demo: pool at {master} ({nodes})")
    print(f"model {what}, id {name}; tokenizer: {getattr(tokenizer, 'name', 'its own')}")
    print(f"blocks of {args.block_size} tokens ({layout.block_bytes / 2**20:.2f} MiB of KV); worker 1 has "
          f"{f'an HBM tier of {args.hbm_blocks} blocks' if args.hbm_blocks else 'no HBM tier'}, worker 2 has none")
    worker = config.resolved_worker_id()
    with KVCacheClient(dataclasses.replace(config, hbm_blocks=args.hbm_blocks, worker_id=f"{worker}-demo1")) as c1, \
            KVCacheClient(dataclasses.replace(config, hbm_blocks=0, worker_id=f"{worker}-demo2")) as c2:
        one, two = PrefixCachedEngine(model, c1), PrefixCachedEngine(model, c2)
        q1 = tokenizer.encode(SYSTEM + QUESTION_1)
        r1 = one.generate(q1, args.max_new_tokens, eos)
        print()
        print(_line("round 1 (question 1)", r1))
        print(f"  answer 1: {_answer(tokenizer, r1.tokens, readable)}")
        if r1.reused_tokens:
            print("  (round 1 hit blocks an earlier run left in the pool; --fresh starts cold)")
        c1.flush(30)
        q2 = q1 + r1.tokens + tokenizer.encode(QUESTION_2)
        r2 = one.generate(q2, args.max_new_tokens, eos)
        print(_line("round 2 (question 1 + answer 1 + question 2)", r2))
        print(f"  answer 2: {_answer(tokenizer, r2.tokens, readable)}")
        c1.flush(30)
        r2b = two.generate(q2, args.max_new_tokens, eos)
        print(_line("round 2 on worker 2 (no HBM tier)", r2b))
        same = r2b.tokens == r2.tokens
        print(f"  answer 2 on worker 2: {'the same tokens' if same else 'DIFFERENT tokens: ' + str(r2b.tokens[:8])}")
        for line in _tiers_compared(r1, r2, r2b, args.block_size):
            print(line)
    print()
    print(f"round 2 reused {r2.reused_tokens} of {r2.prompt_tokens} prompt tokens (whole blocks of {args.block_size}); "
          f"TTFT round 1 {r1.ttft_s * 1e3:.1f} ms, round 2 {r2.ttft_s * 1e3:.1f} ms "
          f"({r1.ttft_s / r2.ttft_s:.1f}x sooner; it is also {r2.prompt_tokens - r1.prompt_tokens} tokens longer)")
    return 0 if same else 1
