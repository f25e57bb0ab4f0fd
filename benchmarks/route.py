"""A reference router on the Mooncake trace, round robin against kvpool's score: an engine lab.

    python benchmarks/route.py [--trace FILE] [--workers N] [--json]

The defaults (``--trace``, ``--start``, ``--requests``) are the lab's shipped trace and its late,
reuse-heavy window; the engines are a random-weight transformers model. The routing itself is the
product's (:mod:`kvpool.routing`); this measures it.


N engine workers (:class:`~kvpool.engines.transformers_engine.PrefixCachedEngine`, one seeded random Qwen2
shared by all, each with its own :class:`~kvpool.client.kvclient.KVCacheClient`: its own HBM tier, one shared
pool started in this process) serve a window of the trace's requests in order. Each hash id becomes
``--block-size`` deterministic token ids (seeded by the id), so equal hash-id prefixes are equal prompts; a
prompt is its blocks and one more token (every full block can then be reused).

Policies, each on a fresh pool and fresh workers with the same capacities:

- ``round-robin``: request i goes to worker i mod N;
- ``score``: the master's :meth:`Score <kvpool.routing.ScoreClient.score>` for the prompt's keys, best first
  by :func:`kvpool.routing.rank`, among the workers not overloaded: a worker that took more than
  ``--balance`` times its share of the last ``--window`` requests is passed over (SGLang's router does the
  same: cache affinity, until the load is too uneven).

After each request its worker flushes (pool writes and its HBM report), so the next score sees it, as when
requests are further apart than a write-behind. Reported per policy: blocks reused from each tier over the
blocks looked up (the engine's own count of what it loaded), the unbounded-cache bound of the same requests
(prefix semantics: :func:`kvpool.bench.trace.unbounded_bound`), mean TTFT (routing, the score call included,
then the engine's request start to first token) and requests per worker. Two configurations: ``HBM + pool``
(the pool holds the window's blocks) and ``HBM, small pool`` (the pool holds ``--small-pool`` blocks: reuse
must come from the right worker's HBM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.bench.progress import Progress
from kvpool.bench.replay import EmbeddedPool, TierConfig
from kvpool.bench.trace import Request, load_trace, unbounded_bound

LAB_TRACE = "../shared/data/mooncake_synthetic_trace.jsonl"  # the lab's shipped trace, from the repository
POLICIES = ("round-robin", "score")


@dataclass
class PolicyResult:
    """One policy's replay."""

    policy: str
    config: str
    requests: int = 0
    looked_up: int = 0  # full blocks the engines could reuse (all of each prompt's)
    reused: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "dram": 0, "ssd": 0})  # blocks
    ttft_s: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    score_calls_s: list[float] = field(default_factory=list)
    fallbacks: int = 0  # requests routed without a score (the master did not answer)

    def ratio(self, tier: str | None = None) -> float:
        hits = sum(self.reused.values()) if tier is None else self.reused[tier]
        return hits / self.looked_up if self.looked_up else 0.0

    def to_json(self, bound: float) -> dict[str, Any]:
        return {"policy": self.policy, "config": self.config, "requests": self.requests,
                "looked_up_blocks": self.looked_up, "reused_blocks": dict(self.reused),
                "hit_ratio": {t: round(self.ratio(t), 4) for t in self.reused} | {"overall": round(self.ratio(), 4)},
                "bound": round(bound, 4), "mean_ttft_ms": round(1e3 * statistics.fmean(self.ttft_s), 3),
                "per_worker": self.per_worker, "fallbacks": self.fallbacks,
                "mean_score_call_ms": round(1e3 * statistics.fmean(self.score_calls_s), 3)
                if self.score_calls_s else None}


def prompt_tokens(hash_ids: Sequence[int], block_size: int, vocab: int) -> list[int]:
    """The prompt a request's hash ids stand for: ``block_size`` tokens per id (seeded by it), then one more."""
    blocks = [np.random.default_rng(h).integers(0, vocab, block_size) for h in hash_ids]
    return [int(t) for t in np.concatenate(blocks)] + [1] if blocks else [1]


class Balancer:
    """Which workers may take the next request: those that took at most ``balance`` x their share of the last
    ``window`` requests (all of them while fewer have been routed)."""

    def __init__(self, workers: int, window: int, balance: float):
        self.workers, self.balance = workers, balance
        self.recent: deque[int] = deque(maxlen=window)

    def eligible(self) -> list[int]:
        if len(self.recent) < self.recent.maxlen:  # type: ignore[operator]
            return list(range(self.workers))
        counts = np.bincount(np.array(self.recent, dtype=np.int64), minlength=self.workers)
        cap = self.balance * len(self.recent) / self.workers
        allowed = [w for w in range(self.workers) if counts[w] <= cap]
        return allowed or [int(np.argmin(counts))]

    def counts(self) -> dict[str, float]:
        return {f"w{w}": float(c) for w, c in enumerate(np.bincount(np.array(self.recent, dtype=np.int64),
                                                                   minlength=self.workers))}

    def took(self, worker: int) -> None:
        self.recent.append(worker)


def replay_policy(policy: str, config: str, requests: Sequence[Request], args: argparse.Namespace, model: Any,
                  pool_blocks: int, progress: Progress | None = None) -> PolicyResult:
    """One policy on a fresh pool and fresh workers (see the module docstring)."""
    from kvpool.client.kvclient import KVCacheClient
    from kvpool.config import ClientConfig
    from kvpool.engines.transformers_engine import PrefixCachedEngine, kv_layout
    from kvpool.routing import ScoreClient, rank

    layout = kv_layout(model, args.block_size)
    pool = EmbeddedPool(TierConfig(config, args.hbm_blocks, pool_blocks * layout.block_bytes, 0, layout.block_bytes))
    result = PolicyResult(policy, config, per_worker=[0] * args.workers)
    vocab = model.config.vocab_size
    clients: list[KVCacheClient] = []
    try:
        for w in range(args.workers):
            clients.append(KVCacheClient(ClientConfig(
                master=pool.address, worker_id=f"w{w}", model=f"route-bench-{args.model_size}", layout=layout,
                hbm_blocks=args.hbm_blocks, lookup_timeout_s=5.0, io_timeout_s=10.0)))
        engines = [PrefixCachedEngine(model, c) for c in clients]
        names = [f"w{w}" for w in range(args.workers)]
        balancer = Balancer(args.workers, args.window, args.balance)
        with ScoreClient(ClientConfig(master=pool.address, lookup_timeout_s=5.0)) as scores:
            for i, request in enumerate(requests):
                tokens = prompt_tokens(request.hash_ids, args.block_size, vocab)
                started = time.perf_counter()
                if policy == "round-robin":
                    worker = i % args.workers
                else:
                    allowed = balancer.eligible()
                    score = scores.score(clients[0].block_keys(tokens), [names[w] for w in allowed])
                    result.score_calls_s.append(time.perf_counter() - started)
                    if score is None:
                        result.fallbacks += 1
                        worker = min(allowed, key=lambda w: balancer.counts()[names[w]])
                    else:
                        worker = names.index(rank(score, balancer.counts())[0].worker)
                balancer.took(worker)
                routed_s = time.perf_counter() - started  # on the request's path: part of its TTFT
                out = engines[worker].generate(tokens, max_new_tokens=1)
                if not clients[worker].flush(timeout=30):
                    raise RuntimeError(f"route: worker w{worker} did not flush within 30 s")
                result.requests += 1
                result.per_worker[worker] += 1
                result.looked_up += len(request.hash_ids)
                for tier, n in out.reused.items():
                    result.reused[tier] += n // args.block_size
                result.ttft_s.append(routed_s + out.ttft_s)
                if progress is not None:
                    progress.update(i + 1, f"{config}, {policy}")
    finally:
        for c in clients:
            c.close()
        pool.close()
    return result


def render(results: Sequence[PolicyResult], bound: float, *, window: str, workers: int, block_size: int,
           hbm_blocks: int, blocks: int) -> str:
    lines = [f"trace {window}: {blocks} distinct blocks of {block_size} tokens; {workers} workers, HBM "
             f"{hbm_blocks} blocks each; unbounded-cache bound {bound:.1%}", "",
             "| configuration | policy | HBM | DRAM | overall | of bound | mean TTFT (ms) | requests per worker |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.config} | {r.policy} | {r.ratio('hbm'):.1%} | {r.ratio('dram'):.1%} | {r.ratio():.1%} "
                     f"| {r.ratio() / bound if bound else 0:.3f} | {1e3 * statistics.fmean(r.ttft_s):.2f} "
                     f"| {'/'.join(map(str, r.per_worker))} |")
    for config in dict.fromkeys(r.config for r in results):
        by = {r.policy: r for r in results if r.config == config}
        if set(by) == set(POLICIES):
            rr, sc = by["round-robin"], by["score"]
            aim = "ok" if sc.ratio() >= bound - 0.02 else "missed"
            lines.append(f"\n{config}: score reuses {sc.ratio():.1%} (bound {bound:.1%}, aim within 2 points: {aim}) "
                         f"against round robin's {rr.ratio():.1%}; mean TTFT {1e3 * statistics.fmean(sc.ttft_s):.2f} "
                         f"ms against {1e3 * statistics.fmean(rr.ttft_s):.2f} ms "
                         f"({statistics.fmean(rr.ttft_s) / statistics.fmean(sc.ttft_s):.2f}x); a score call took "
                         f"{1e3 * statistics.fmean(sc.score_calls_s):.2f} ms on average")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=LAB_TRACE, help="Mooncake-format JSONL trace (default: %(default)s)")
    parser.add_argument("--start", type=int, default=3400, metavar="N",
                        help="first request of the window (default: %(default)s: the trace's late, reuse-heavy part)")
    parser.add_argument("--requests", type=int, default=593, metavar="N", help="requests replayed (default: to the "
                        "trace's end, %(default)s)")
    parser.add_argument("--workers", type=int, default=4, metavar="N", help="engine workers (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per block, one per trace hash id (default: %(default)s)")
    parser.add_argument("--hbm-blocks", type=int, default=2048, metavar="N",
                        help="each worker's HBM tier in blocks (default: %(default)s)")
    parser.add_argument("--small-pool", type=int, default=64, metavar="BLOCKS",
                        help="pool DRAM of the 'HBM, small pool' configuration (default: %(default)s blocks)")
    parser.add_argument("--window", type=int, default=32, metavar="N",
                        help="recent requests the load balance looks at (default: %(default)s)")
    parser.add_argument("--balance", type=float, default=1.5, metavar="X",
                        help="a worker past X times its share of the window is passed over (default: %(default)s)")
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small"),
                        help="the random Qwen2's size (default: %(default)s)")
    parser.add_argument("--configs", default="pool,small-pool", help="which configurations: pool, small-pool")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.engines.hf_model import random_qwen2

    if args.workers < 1 or args.requests < 1 or args.start < 0 or args.block_size < 1 or args.hbm_blocks < 1:
        raise ValueError("--workers, --requests, --block-size and --hbm-blocks must be >= 1, --start >= 0")
    if args.window < 1 or args.balance < 1:
        raise ValueError("--window must be >= 1 and --balance >= 1")
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - {"pool", "small-pool"}:
        raise ValueError("--configs: a comma-separated list of pool, small-pool")
    requests = load_trace(args.trace, args.start + args.requests)[args.start:]
    if not requests:
        raise ValueError(f"the trace has no requests from {args.start} on")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = random_qwen2(args.model_size)
    distinct = len({h for r in requests for h in r.hash_ids})
    bound = unbounded_bound(r.hash_ids for r in requests).leading
    labels = {"pool": "HBM + pool", "small-pool": "HBM, small pool"}
    sizes = {"pool": distinct + 1024, "small-pool": args.small_pool}
    results = []
    for c in configs:
        for policy in POLICIES:
            progress = Progress(len(requests), f"route {c} {policy}", enabled=not args.no_progress)
            results.append(replay_policy(policy, labels[c], requests, args, model, sizes[c], progress))
            progress.close(len(requests))
    window = f"{args.trace} requests {args.start}..{args.start + len(requests) - 1}"
    if args.json:
        print(json.dumps({"window": window, "bound": bound, "distinct_blocks": distinct,
                          "results": [r.to_json(bound) for r in results]}, indent=2))
    else:
        print(render(results, bound, window=window, workers=args.workers, block_size=args.block_size,
                     hbm_blocks=args.hbm_blocks, blocks=distinct))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/route.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"route: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
