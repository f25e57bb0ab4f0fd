"""`benchmarks/tracegen.py` and `kvpool bench lru-sweep`: seeded traces with the reuse they claim, and a sweep whose
LRU column is the exact LRU."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import pytest
import tracegen as tg  # benchmarks/, on pytest's pythonpath

from kvpool import cli
from kvpool.bench import lru_sweep as ls
from kvpool.bench import replay as rp
from kvpool.bench import trace as tr
from kvpool.keys import KeyNamespace

N = 400  # requests per generated trace: enough for each pattern's statistics, well under a second
BB = 4 << 10


def gen_file(tmp_path, pattern: str, requests: int = N, seed: int = 0, *knobs: str) -> str:
    out = str(tmp_path / f"{pattern}-{seed}.jsonl")
    argv = ["--pattern", pattern, "--requests", str(requests), "--seed", str(seed),
            "--out", out]
    for k in knobs:
        argv += ["--set", k]
    assert tg.main(argv) == 0
    return out


def prefix_consistent(requests: list[tr.Request]) -> bool:
    """Mooncake's rule: an id always sits at the same position behind the same parent id."""
    parent: dict[int, tuple[int, int | None]] = {}
    for r in requests:
        for i, h in enumerate(r.hash_ids):
            seen = parent.setdefault(h, (i, r.hash_ids[i - 1] if i else None))
            if seen != (i, r.hash_ids[i - 1] if i else None):
                return False
    return True


@pytest.mark.parametrize("pattern", list(tg.PATTERNS))
def test_same_seed_same_bytes_other_seed_other_trace(tmp_path, pattern: str) -> None:
    (tmp_path / "again").mkdir()
    a = gen_file(tmp_path, pattern)
    b = gen_file(tmp_path / "again", pattern)  # same seed, written again
    c = gen_file(tmp_path, pattern, N, 1)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert open(a, "rb").read() != open(c, "rb").read()


@pytest.mark.parametrize("pattern", list(tg.PATTERNS))
def test_the_format_loads_and_is_mooncakes(tmp_path, pattern: str) -> None:
    path = gen_file(tmp_path, pattern)
    requests = tr.load_trace(path)
    assert len(requests) == N
    with open(path) as f:
        first = json.loads(f.readline())
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert all(isinstance(first[k], int) for k in ("timestamp", "input_length", "output_length"))
    times = [r.timestamp for r in requests]
    assert times == sorted(times) and times[-1] > 0
    # one id per 512-token block of the prompt, the last possibly partial
    assert all(len(r.hash_ids) == -(-r.input_length // tr.BLOCK_TOKENS) and r.output_length > 0 for r in requests)
    assert prefix_consistent(requests)
    # chained kvpool keys see exactly the reuse the ids claim (the ids are prefix-consistent)
    maker = tr.KeyMaker(KeyNamespace(tr.MODEL, rp.block_layout(BB).fingerprint()))
    keys = [maker.keys(r.hash_ids) for r in requests[:100]]
    ids_bound, keys_bound = tr.unbounded_bound(r.hash_ids for r in requests[:100]), tr.unbounded_bound(keys)
    assert (ids_bound.leading_hits, ids_bound.block_hits) == (keys_bound.leading_hits, keys_bound.block_hits)


def test_prefix_consistency_check_catches_a_reused_id_under_another_prefix() -> None:
    reqs = [tr.Request(0, 1024, 1, (0, 1)), tr.Request(1, 1024, 1, (2, 1))]
    assert not prefix_consistent(reqs)


def test_system_prompt_requests_share_a_long_prefix_and_a_unique_tail() -> None:
    requests = tg.generate("system-prompt", N, seed=3, knobs=tg.knobs_for("system-prompt", ["prompts=50"]))
    k = tg.SystemPromptKnobs().min_system_tokens // tr.BLOCK_TOKENS  # every system prompt has >= k full blocks
    heads: defaultdict[tuple[int, ...], int] = defaultdict(int)
    for r in requests:
        heads[r.hash_ids[:k]] += 1
    shared = sum(1 for r in requests if heads[r.hash_ids[:k]] > 1)
    assert shared / N > 0.8, f"only {shared} of {N} requests share their first {k} ids with another"
    # the last block (a partial system block or the user part) is never anyone else's
    last: defaultdict[int, int] = defaultdict(int)
    for r in requests:
        last[r.hash_ids[-1]] += 1
    assert max(last.values()) == 1
    assert tr.unbounded_bound(r.hash_ids for r in requests).leading > 0.5


def test_multi_turn_each_turn_extends_its_sessions_previous_turn() -> None:
    knobs = tg.knobs_for("multi-turn", ["sessions=20", "mean_turns=6"])
    requests = tg.generate("multi-turn", N, seed=5, knobs=knobs)
    # Rebuild sessions from the ids: a turn's full-block prefix is the previous turn's full blocks.
    by_full_prefix: dict[tuple[int, ...], tr.Request] = {}
    extended = 0
    depth: dict[tuple[int, ...], int] = {}
    for r in requests:
        prev = None
        for n in range(len(r.hash_ids) - 1, 0, -1):  # the longest earlier turn whose full blocks lead this one
            prev = by_full_prefix.get(r.hash_ids[:n])
            if prev is not None:
                break
        if prev is not None:
            full = prev.input_length // tr.BLOCK_TOKENS
            assert r.hash_ids[:full] == prev.hash_ids[:full], "a turn must keep every full block of the last one"
            assert r.input_length >= prev.input_length + prev.output_length, "prompt = last prompt + output + user"
            assert r.hash_ids[full] not in prev.hash_ids, "the last turn's partial block is new content"
            extended += 1
            d = depth[prev.hash_ids[:full]] + 1
        else:
            d = 1
        full_ids = r.hash_ids[: r.input_length // tr.BLOCK_TOKENS]
        by_full_prefix[full_ids] = r
        depth[full_ids] = d
    assert extended / N > 0.7, f"only {extended} of {N} requests continue a dialog"
    assert max(depth.values()) >= 8, "dialog chains should run deep"
    # many sessions interleaved: consecutive requests rarely continue each other
    assert sum(1 for a, b in zip(requests, requests[1:]) if b.hash_ids[:2] == a.hash_ids[:2]) < N / 4


def test_one_off_prompts_barely_reuse() -> None:
    requests = tg.generate("one-off", N, seed=7)
    bound = tr.unbounded_bound(r.hash_ids for r in requests)
    assert 0 < bound.leading < 0.1, bound
    assert tr.unbounded_bound(r.hash_ids for r in tg.generate("one-off", N, 7, tg.knobs_for(
        "one-off", ["template_share=0"]))).block_hits == 0


def test_mixed_blends_all_three_and_takes_sub_pattern_knobs() -> None:
    knobs = tg.knobs_for("mixed", ["one_off=0", "system-prompt.prompts=1", "multi-turn.sessions=3"])
    assert isinstance(knobs, tg.MixedKnobs)
    assert knobs.system_prompt_knobs.prompts == 1 and knobs.multi_turn_knobs.sessions == 3 and knobs.one_off == 0
    requests = tg.generate("mixed", N, seed=1)
    assert prefix_consistent(requests)
    mixed = tr.unbounded_bound(r.hash_ids for r in requests).leading
    one_off = tr.unbounded_bound(r.hash_ids for r in tg.generate("one-off", N, 1)).leading
    assert one_off < mixed < 0.95


@pytest.mark.parametrize("pattern, setting, says", [
    ("one-off", "nope=1", "unknown knob 'nope'"),
    ("one-off", "templates", "is not NAME=VALUE"),
    ("one-off", "templates=1.5", "is not an integer"),
    ("system-prompt", "min_system_tokens=100", "min_system_tokens"),
    ("multi-turn", "system-prompt.prompts=3", "only mixed has sub-patterns"),
    ("mixed", "multi-turn.nope=3", "unknown knob"),
    ("mixed", "one_off=-1", "weights must be >= 0"),
])
def test_bad_knobs_are_clear_errors(pattern: str, setting: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        tg.knobs_for(pattern, [setting])


def test_unknown_pattern_and_bad_counts_are_refused(capsys) -> None:
    with pytest.raises(ValueError, match="unknown pattern"):
        tg.knobs_for("nope")
    with pytest.raises(ValueError, match="requests must be >= 1"):
        tg.generate("one-off", 0)
    with pytest.raises(ValueError, match="do not fit pattern 'one-off'"):
        tg.generate("one-off", 10, knobs=tg.MultiTurnKnobs())
    with pytest.raises(SystemExit):
        tg.main(["--pattern", "nope", "--out", "/dev/null"])
    assert "invalid choice" in capsys.readouterr().err


# -- the sweep -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, counts", [("1k,4k,20k,50k", [1000, 4000, 20000, 50000]), ("8, 32", [8, 32]),
                                          ("2M", [2_000_000])])
def test_block_counts_parse(text: str, counts: list[int]) -> None:
    assert ls.parse_block_counts(text) == counts


@pytest.mark.parametrize("text", ["0", "1k,,2k", "4K bytes", "1.5k", "8,8"])
def test_block_counts_refuse_garbage(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        ls.parse_block_counts(text)


def test_sweep_rows_carry_the_exact_lru_and_kvpools_own_replay(tmp_path, capsys) -> None:
    trace = gen_file(tmp_path, "mixed", 60, 2, "system-prompt.prompts=3", "system-prompt.max_system_tokens=4096",
                     "multi-turn.sessions=4", "multi-turn.max_first_tokens=2048", "one-off.max_prompt_tokens=2048")
    out = tmp_path / "table.md"
    assert cli.main(["bench", "lru-sweep", "--trace", trace, "--dram-blocks", "8,40", "--hbm", "4b", "--limit", "50",
                     "--ssd-dir", str(tmp_path), "--no-progress", "--json", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    requests = tr.load_trace(trace, 50)
    maker = tr.KeyMaker(KeyNamespace(tr.MODEL, rp.block_layout(BB).fingerprint()))
    keys = [maker.keys(r.hash_ids) for r in requests]
    assert summary["requests"] == 50 and summary["hbm_blocks"] == 4
    assert [row["dram_blocks"] for row in summary["rows"]] == [8, 40]
    for row in summary["rows"]:
        ref = tr.lru_reference(keys, 4, row["dram_blocks"])
        assert (row["exact_lru"]["hbm_hits"], row["exact_lru"]["dram_hits"]) == (ref.hbm_hits, ref.dram_hits)
        assert row["exact_lru"]["overall"] == pytest.approx(ref.ratio(ref.hit_blocks))
        kv = row["kvpool"]
        assert row["gap_points"] == pytest.approx((kv["overall"] - row["exact_lru"]["overall"]) * 100)
        assert row["wrong_blocks"] == 0 and row["lost_after_lookup"] == 0
    assert summary["rows"][1]["exact_lru"]["dram_hits"] > 0, "the trace must reuse enough to exercise DRAM"
    assert summary["rows"][1]["kvpool"]["dram_hits"] > 0
    table = out.read_text()
    assert table.count("\n| 8 |") == 1 and table.count("\n| 40 |") == 1


def test_sweep_refuses_bad_flags(tmp_path, capsys) -> None:
    trace = gen_file(tmp_path, "one-off", 5)
    assert cli.main(["bench", "lru-sweep", "--trace", trace, "--limit", "0", "--no-progress"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "lru-sweep", "--trace", trace, "--dram-blocks", "0"])
    assert "not a positive block count" in capsys.readouterr().err
