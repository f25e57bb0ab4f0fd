"""``benchmarks/vllm_ttft.py``'s plumbing without vLLM: its checks, summary and table on made-up requests.

The measurement itself needs the real vLLM for minutes (docs/benchmarks.md, "benchmarks/vllm_ttft.py"); what is
tested here is what turns driver results into verdicts. No timing is asserted.
"""

from __future__ import annotations

import argparse

import pytest
from vllm_ttft import AIMS, LAYERWISE_AIM, Request, _check, add_arguments, render, summarize  # benchmarks/


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)

HIT = 2016  # a 2,048-token prompt in blocks of 32: all but the last block
BLOCKS = HIT // 32


def req(case: str, prompt: int, ttft: float, cached: int = HIT, metrics: dict[str, float] | None = None) -> Request:
    return Request(case, prompt, ttft, cached, ttft, 0.0, ttft, dict(metrics or {}))


def loaded(tier: str) -> dict[str, float]:
    return {f"vllm:kvpool_hit_blocks_{tier}": BLOCKS, "vllm:kvpool_loaded_blocks": BLOCKS,
            "vllm:kvpool_load_seconds": 0.03, "trace:get_s": 0.02, "trace:scatter_s": 0.008, "trace:lookup_s": 0.001}


def run_of(prompts: int = 3) -> list[Request]:
    out = [req("warmup", 0, 9.0, 0)]
    for p in range(1, prompts + 1):
        out += [req("cold", p, 20.0, 0), req("own", p, 0.50),
                req("kvpool_dram", p, 0.54, metrics=loaded("dram")), req("own_after_dram", p, 0.50),
                req("kvpool_ssd", p, 0.60, metrics=loaded("ssd")), req("own_after_ssd", p, 0.50),
                req("mooncake", p, 0.58), req("own_after_mooncake", p, 0.50)]
    return out


def test_summary_judges_every_aim_on_medians_and_pairs_each_hit_with_its_own_hit():
    summary = summarize(run_of())
    assert [(a["case"], a["reference"]) for a in summary["aims"]] == [(c, r) for c, r, _ in AIMS]
    assert all(a["met"] for a in summary["aims"][::2]) and not summary["aims"][1]["met"]  # 0.54 / 0.58 > 0.6
    assert summary["paired"]["kvpool_dram"] == pytest.approx(0.54 / 0.50)
    assert summary["overhead_s"]["mooncake"] == pytest.approx(0.08)
    assert summary["kvpool_parts_s"]["kvpool_ssd"]["read"] == pytest.approx(0.02)
    assert "warmup" not in summary["n"]
    table = render({"setup": {"model": "m", "dtype": "float32", "prompt_tokens": 2048, "block_size": 32,
                              "block_bytes": 786432, "prompts": 3, "cpus": "0-1", "engine": "in-process"},
                    "requests": run_of(), "summary": summary})
    assert "| kvpool hit from DRAM, fresh process (whole-request sync load) | 540.0 |" in table
    assert "kvpool_dram <= 0.6 x mooncake: 0.93 (MISSED)" in table


def test_a_row_that_did_not_come_whole_from_its_tier_is_an_error():
    _check(run_of(1), HIT, 32)
    with pytest.raises(RuntimeError, match="had 0 tokens cached"):
        _check([req("kvpool_dram", 1, 0.5, 0)], HIT, 32)
    with pytest.raises(RuntimeError, match="expected all 63 from ssd"):
        _check([req("kvpool_ssd", 1, 0.5, metrics=loaded("dram"))], HIT, 32)
    with pytest.raises(RuntimeError, match="had 2016 tokens cached, not 0"):
        _check([req("mooncake_cold", 1, 9.0)], HIT, 32)


def test_the_harness_takes_its_flags():
    args = parse("--prompts", "1", "--no-mooncake")
    assert (args.prompts, args.mooncake, args.install, args.dtype) == (1, False, True, "auto")


def test_the_1p1d_rows_pair_the_decode_from_the_hand_off_with_the_decode_instances_own_hit():
    from vllm_pd import _check_handoff

    handed = {"vllm:kvpool_hit_blocks_dram": BLOCKS, "vllm:kvpool_loaded_blocks": BLOCKS}
    run = run_of(2) + [req("pd_cold", 7, 18.0, 0), req("pd_decode", 7, 0.56, metrics=handed),
                       req("own_after_pd", 7, 0.52)]
    _check(run, HIT, 32)
    summary = summarize(run)
    assert summary["paired"]["pd_decode"] == pytest.approx(0.56 / 0.52)
    assert summary["overhead_s"]["pd_decode"] == pytest.approx(0.04)
    table = render({"setup": {"model": "m", "dtype": "float32", "prompt_tokens": 2048, "block_size": 32,
                              "block_bytes": 786432, "prompts": 2, "cpus": "0-1", "engine": "in-process"},
                    "requests": run, "summary": summary})
    assert "| 1P1D: decode instance, from the hand-off | 560.0 |" in table
    assert "| 1P1D: prefill instance, cold prefill | 18000.0 |" in table
    _check_handoff({"counters": handed}, 2048, 32, 7)
    with pytest.raises(RuntimeError, match="found 60 blocks in DRAM, loaded 60 with 3 errors and 0 time-outs"):
        _check_handoff({"counters": {"vllm:kvpool_hit_blocks_dram": 60, "vllm:kvpool_loaded_blocks": 60,
                                     "vllm:kvpool_load_errors": 3}}, 2048, 32, 7)
    assert parse("--no-pd").pd is False


def test_the_layerwise_aim_is_on_what_each_load_adds_to_the_same_processs_own_hit_and_itl_rows_are_medians():
    run = run_of()
    for p in range(1, 4):
        run += [req("kvpool_layerwise", p, 0.52, metrics=loaded("dram")), req("own_after_layerwise", p, 0.50),
                req("kvpool_async", p, 0.56, metrics=loaded("dram")), req("own_after_async", p, 0.50)]
    _check(run, HIT, 32)

    def hit(prompt: int, window: list[float], hit_step: float) -> dict:
        return {"prompt": prompt, "baseline_s": [0.05, 0.05, 0.06], "window_s": window, "hit_step_s": hit_step,
                "ttft_s": 0.2, "cached": HIT, "load_s": 0.03, "loaded_blocks": BLOCKS}

    itl = {"sync": [hit(1, [], 0.15), hit(2, [], 0.13)], "async": [hit(1, [0.05, 0.07], 0.09), hit(2, [0.06], 0.1)]}
    summary = summarize(run, itl)
    aim = summary["aims"][-1]
    # what each adds to the own hit served after it: layer-wise 20 ms, the whole-request load 40 ms
    assert (aim["case"], aim["reference"], aim["limit"]) == ("kvpool_layerwise", "kvpool_dram", LAYERWISE_AIM)
    assert aim["ratio"] == pytest.approx(0.02 / 0.04) and not aim["met"]
    assert summary["itl"]["async"]["window_max"] == pytest.approx(0.065)  # median over hits of each hit's max
    assert summary["itl"]["sync"]["window_steps"] == 0 and summary["itl"]["sync"]["hit_step"] == pytest.approx(0.14)
    table = render({"setup": {"model": "m", "dtype": "bfloat16", "prompt_tokens": 2048, "block_size": 32,
                              "block_bytes": 393216, "prompts": 3, "cpus": "0-1", "engine": "in-process",
                              "running": 4},
                    "requests": run, "summary": summary})
    assert "kvpool_layerwise paired +ms <= 0.4 x kvpool_dram paired +ms: 0.50 (MISSED)" in table
    assert "| async | 50.0 | 60.0 / 65.0 (2) | 95.0 | 200.0 | 30.0 |" in table
    assert "| sync | 50.0 | (none: in the hit's step) | 140.0 | 200.0 | 30.0 |" in table
