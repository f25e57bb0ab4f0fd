"""Time to first token of the transformers reference engine, prefix from each tier.

    python benchmarks/transformers_ttft.py [--repeats N] [--json] ...


One run, one model (a seeded random Qwen2, or ``--model PATH``), one pool
that the script starts itself (:class:`local_pool.LocalPool`: ``kvpool serve`` as a child process on
127.0.0.1: free ports, a temporary SSD directory, its own arena; DRAM for
``2 x blocks + 16`` blocks), and a prompt ``P`` of ``--prompt-tokens`` (4096)
tokens whose first ``--cached-blocks`` (31 of 32) blocks of ``--block-size``
(128) tokens the pool holds. Every round measures, in this order:

- ``off`` and ``miss`` (the first ``--full-repeats`` rounds, alternating
  which goes first): a full prefill of a fresh prompt with the pool off (no
  client), and with the pool on but nothing to hit (hash, one lookup that
  misses, the full prefill; its pool writes are write-behind, after TTFT,
  and flushed before the next case starts);
- ``ssd``: ``P`` with its prefix on SSD only: first as many filler blocks as
  DRAM holds push it out of DRAM (write-back: the node demotes it; with
  ``--write-through`` it was on SSD from the start). The read promotes it
  back into that full DRAM, which evicts filler: with write-back the node
  copies those victims out and writes them to SSD in the background, after
  the request (each round starts once the node has no demotion pending);
- ``ceiling``: the forward over ``P``'s uncached suffix with the prefix
  already in the model's cache in memory (what no pool can beat);
- ``dram``: ``P`` with its prefix in DRAM (a worker without an HBM tier);
- ``hbm``: ``P`` with its prefix in this worker's HBM tier.

Every TTFT is request start to first token: hashing, lookup, loading,
cache assembly and the forward (:class:`~kvpool.engines.transformers_engine.GenerationResult`).
Reported: medians over ``--repeats`` rounds, the ratios against the aims
(``dram <= 1.10 x ceiling``, ``ssd <= 1.25 x ceiling``, ``miss <= 1.03 x off``)
and the speedup over a full prefill. Each row's tier is checked: a round whose
prefix did not come whole from the tier it measures is an error, not a number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from local_pool import LocalPool

CASES = ("off", "miss", "ceiling", "ssd", "dram", "hbm")
LABELS = {
    "off": "full prefill, pool off",
    "miss": "pool on, nothing to hit",
    "ceiling": "suffix only, prefix already in memory",
    "ssd": "prefix from SSD",
    "dram": "prefix from DRAM",
    "hbm": "prefix from HBM",
}
AIMS = {"dram": ("ceiling", 1.10), "ssd": ("ceiling", 1.25), "miss": ("off", 1.03)}
PHASES = ("hash", "lookup", "load", "assemble", "prefill")


@dataclass
class Samples:
    """Every round's TTFT of one case, and its timings."""

    ttft: list[float] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.ttft)

    def phase_median(self, phase: str) -> float:
        return statistics.median(t.get(phase, 0.0) for t in self.timings) if self.timings else 0.0


# -- the measurement ---------------------------------------------------------------------------------


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"transformers_ttft: {what} within {timeout}s")
        time.sleep(0.02)


def measure(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run every case ``args.repeats`` times (see module docstring); the samples and the setup."""
    import numpy as np
    import torch

    from kvpool.client.kvclient import KVCacheClient
    from kvpool.config import ClientConfig
    from kvpool.engines import hf_model
    from kvpool.engines.transformers_engine import PrefixCachedEngine, empty_cache, kv_layout, layer_kv, prefilled_cache
    from kvpool.keys import opaque_key

    if args.model:
        model, _ = hf_model.load_local(args.model)
    else:
        model = hf_model.random_qwen2(args.model_size, seed=args.seed)
    layout = kv_layout(model, args.block_size)
    blocks = args.prompt_tokens // args.block_size
    if not 1 <= args.cached_blocks < blocks or args.prompt_tokens % args.block_size:
        raise ValueError(f"--prompt-tokens must be whole blocks and --cached-blocks below their number ({blocks})")
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = text_config.vocab_size
    rng = np.random.default_rng(args.seed)

    def prompt() -> list[int]:
        return rng.integers(0, vocab, args.prompt_tokens).tolist()

    dram_slots = 2 * blocks + 16
    setup = {
        "model": hf_model.model_id(model), "layout": layout.fingerprint(), "block_bytes": layout.block_bytes,
        "prompt_tokens": args.prompt_tokens, "cached_blocks": args.cached_blocks, "block_size": args.block_size,
        "repeats": args.repeats, "full_repeats": args.full_repeats, "write_through": args.write_through,
        "torch_threads": torch.get_num_threads(), "dram_slots": dram_slots,
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
    }
    samples = {case: Samples() for case in CASES}
    cached = args.cached_blocks * args.block_size
    with LocalPool(dram_bytes=dram_slots * layout.block_bytes, max_block_bytes=layout.block_bytes,
                   ssd_bytes=max(1 << 30, 8 * dram_slots * layout.block_bytes), write_through=args.write_through,
                   ssd_parent=args.ssd_dir) as pool:
        base = ClientConfig(master=pool.address, layout=layout, model=hf_model.model_id(model),
                            lookup_timeout_s=5.0, io_timeout_s=20.0)
        with KVCacheClient(base) as worker, \
                KVCacheClient(dataclasses.replace(base, hbm_blocks=blocks + 1)) as hbm_worker:
            off = PrefixCachedEngine(model)
            pooled = PrefixCachedEngine(model, worker)
            with_hbm = PrefixCachedEngine(model, hbm_worker)
            target = prompt()
            keys = worker.block_keys(target)[: args.cached_blocks]
            progress("seeding the pool with the prompt's first blocks")
            pooled.generate(target[: cached + 1], 1)  # stores exactly the cached blocks
            assert worker.flush(60), "transformers_ttft: pool writes did not finish"
            with torch.inference_mode():  # the ceiling's prefix, computed once
                prefix_cache = empty_cache()
                off.forward(torch.tensor([target[:cached]]), prefix_cache)
                pairs = (layer_kv(prefix_cache, i) for i in range(layout.num_layers))
                prefix = [(k.clone(), v.clone()) for k, v in pairs]
            filler_round = 0

            def push_out_of_dram() -> None:
                nonlocal filler_round
                filler_round += 1
                junk = np.frombuffer(os.urandom(layout.block_bytes), dtype=np.uint8)
                for i in range(dram_slots):  # one at a time: plain LRU order
                    worker.put([opaque_key(f"ttft-filler-{filler_round}-{i}")], [junk])
                    worker.flush(60)
                _wait(lambda: worker.lookup(keys).ssd_blocks == len(keys), "the prefix did not move to SSD")
                # ...and written there: the node is idle again, as it would be between requests
                _wait(lambda: pool.demotion_queue_bytes() == 0, "the node did not finish demoting")

            def into_dram() -> None:
                worker.flush(60)
                if worker.lookup(keys).dram_blocks != len(keys):
                    staging = torch.empty(len(keys), layout.block_bytes, dtype=torch.uint8)
                    worker.get(keys, list(staging))  # promotes
                _wait(lambda: worker.lookup(keys).dram_blocks == len(keys), "the prefix did not come back to DRAM")

            def record(case: str, result: Any, tier: str | None) -> None:
                if tier is not None and result.reused[tier] != cached:
                    raise RuntimeError(f"transformers_ttft: {case} reused {result.reused}, "
                                       f"not {cached} tokens from {tier}")
                if tier is None and result.reused_tokens:
                    raise RuntimeError(f"transformers_ttft: {case} reused {result.reused} but should hit nothing")
                samples[case].ttft.append(result.ttft_s)
                samples[case].timings.append(result.timings)

            with_hbm.generate(target, 1)  # fills the HBM tier (untimed)
            for rnd in range(args.repeats):
                if rnd < args.full_repeats:  # alternate the order: neither gets the other's leftovers
                    progress(f"round {rnd + 1}/{args.repeats}: off and miss (full prefills)")
                    for case in (("off", "miss") if rnd % 2 == 0 else ("miss", "off")):
                        engine = off if case == "off" else pooled
                        record(case, engine.generate(prompt(), 1), None)
                        worker.flush(60)
                progress(f"round {rnd + 1}/{args.repeats}: ssd, ceiling, dram, hbm")
                push_out_of_dram()
                record("ssd", pooled.generate(target, 1), "ssd")
                into_dram()
                with torch.inference_mode():
                    cache = prefilled_cache(prefix)
                    t = time.perf_counter()
                    int(torch.argmax(off.forward(torch.tensor([target[cached:]]), cache)))
                    elapsed = time.perf_counter() - t
                    samples["ceiling"].ttft.append(elapsed)
                    samples["ceiling"].timings.append({"prefill": elapsed})
                record("dram", pooled.generate(target, 1), "dram")
                worker.flush(60)
                record("hbm", with_hbm.generate(target, 1), "hbm")
                hbm_worker.flush(60)
    return {"setup": setup, "samples": samples}


# -- report ------------------------------------------------------------------------------------------


def summarize(samples: dict[str, Samples]) -> dict[str, Any]:
    """Medians, the aims' ratios three ways, and the speedups over a full prefill.

    ``median``: ratio of the median TTFTs (what the aims are judged on);
    ``min``: ratio of the fastest rounds; ``overhead``: ``1 + median(TTFT -
    forward) / median(reference)``. A case and its reference run the same
    forward over the same number of tokens, so on a machine others are also
    using, ``overhead`` is the estimate that their load does not swamp.
    """
    medians = {case: s.median() for case, s in samples.items() if s.ttft}
    overhead = {case: statistics.median(ttft - t.get("prefill", 0.0) for ttft, t in zip(s.ttft, s.timings))
                for case, s in samples.items() if s.timings}
    ratios: dict[str, dict[str, float]] = {"median": {}, "min": {}, "overhead": {}}
    for case, (ref, _) in AIMS.items():
        if case in medians and ref in medians:
            ratios["median"][case] = medians[case] / medians[ref]
            ratios["min"][case] = min(samples[case].ttft) / min(samples[ref].ttft)
            ratios["overhead"][case] = 1 + overhead[case] / medians[ref]
    met = {case: ratio <= AIMS[case][1] for case, ratio in ratios["median"].items()}
    speedup = {case: medians["off"] / medians[case] for case in ("ssd", "dram", "hbm", "ceiling") if case in medians}
    return {"median_s": medians, "overhead_s": overhead, "ratios": ratios, "aims_met": met,
            "speedup_over_full_prefill": speedup}


def render(report: dict[str, Any]) -> str:
    setup, samples, summary = report["setup"], report["samples"], report["summary"]
    medians, ratios = summary["median_s"], summary["ratios"]
    lines = [
        (f"model {setup['model']} ({setup['layout']}, {setup['block_bytes'] / 2**20:.2f} MiB a block), "
         f"prompt {setup['prompt_tokens']} tokens, {setup['cached_blocks']} blocks of {setup['block_size']} cached; "
         f"node {'write-through' if setup['write_through'] else 'write-back'}, DRAM {setup['dram_slots']} blocks; "
         f"{setup['repeats']} rounds ({setup['full_repeats']} for the full prefills); "
         f"torch {setup['torch']} ({setup['torch_threads']} threads), transformers {setup['transformers']}"),
        "",
        ("| case | TTFT ms median | min | max | ratio of medians (aim) | of mins | by overhead "
         "| overhead ms | lookup | load | assemble | forward |"),
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in CASES:
        s = samples[case]
        if not s.ttft:
            continue
        versus, by_min, by_overhead = "", "", ""
        if case in ratios["median"]:
            ref, limit = AIMS[case]
            verdict = "met" if summary["aims_met"][case] else "MISSED"
            versus = f"{ratios['median'][case]:.3f} x {ref} (<= {limit:.2f}: {verdict})"
            by_min, by_overhead = f"{ratios['min'][case]:.3f}", f"{ratios['overhead'][case]:.3f}"
        elif case in summary["speedup_over_full_prefill"]:
            versus = f"{summary['speedup_over_full_prefill'][case]:.1f}x faster than off"
        phases = [f"{s.phase_median(p) * 1e3:.1f}" for p in ("lookup", "load", "assemble", "prefill")]
        cells = [LABELS[case], f"{medians[case] * 1e3:.1f}", f"{min(s.ttft) * 1e3:.1f}", f"{max(s.ttft) * 1e3:.1f}",
                 versus, by_min, by_overhead, f"{summary['overhead_s'][case] * 1e3:.1f}", *phases]
        lines.append("| " + " | ".join(cells) + " |")
    sp = summary["speedup_over_full_prefill"]
    lines += [
        "",
        ("overhead = TTFT - forward (hashing, lookup, load, cache assembly); by overhead = 1 + overhead / the "
         "reference's median TTFT; ratio of medians decides the aim."),
        "speedup over a full prefill (medians): "
        + ", ".join(f"{c} {sp[c]:.1f}x" for c in ("dram", "ssd", "hbm") if c in sp),
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens a block (default: %(default)s)")
    parser.add_argument("--cached-blocks", type=int, default=31,
                        help="leading blocks of the prompt the pool holds (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; medians are reported (default: %(default)s)")
    parser.add_argument("--full-repeats", type=int, default=3,
                        help="rounds that also run the two full prefills, off and miss (default: %(default)s)")
    parser.add_argument("--write-through", action="store_true",
                        help="the pool's node writes every block to SSD at once (default: write-back, the node's "
                        "default: blocks reach SSD when DRAM evicts them)")
    parser.add_argument("--model", default=None, metavar="PATH", help="a local HuggingFace model directory "
                        "(default: a random Qwen2, no download)")
    parser.add_argument("--model-size", default="small", choices=["small", "tiny"],
                        help="size of the random Qwen2 (default: %(default)s: hidden 512, 8 layers, 2 KV heads)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts (default: %(default)s)")
    parser.add_argument("--ssd-dir", default=None, help="parent of the pool's temporary SSD directory "
                        "(default: the system temp dir)")
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of the table")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or not 1 <= args.full_repeats <= args.repeats:
        raise ValueError(f"need 1 <= --full-repeats <= --repeats, got {args.full_repeats} and {args.repeats}")
    from kvpool.demo import require_hf

    require_hf()
    report = measure(args, progress=lambda s: print(f"transformers_ttft: {s}", file=sys.stderr, flush=True))
    report["summary"] = summarize(report["samples"])
    if args.json:
        out = {"setup": report["setup"], "summary": report["summary"],
               "samples": {c: dataclasses.asdict(s) for c, s in report["samples"].items()}}
        print(json.dumps(out, indent=2))
    else:
        print(render(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/transformers_ttft.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"transformers_ttft: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
