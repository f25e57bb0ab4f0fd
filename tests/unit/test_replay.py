"""`kvpool bench replay`: trace loading, keys, the unbounded bound, size flags, and hits by tier on tiny traces."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

from kvpool.bench import progress as pg
from kvpool.bench import replay as rp
from kvpool.bench import trace as tr
from kvpool.keys import BlockKey, KeyNamespace, chain_block_keys

BB = 4 << 10  # small blocks keep the embedded pools tiny and fast


def write_trace(path, requests: list[list[int]]) -> str:
    with open(path, "w") as f:
        for i, ids in enumerate(requests):
            f.write(json.dumps({"timestamp": i * 10, "input_length": 512 * len(ids), "output_length": 8,
                                "hash_ids": ids}) + "\n")
    return str(path)


def parse(argv: list[str]) -> argparse.Namespace:
    """``kvpool bench replay``'s flags; ``--trace`` (required) is a placeholder unless ``argv`` names one."""
    parser = argparse.ArgumentParser()
    rp.add_arguments(parser)
    return parser.parse_args(["--trace", "trace.jsonl", *argv])


def keys_of(requests: list[list[int]], tenant: str = "") -> list[list[BlockKey]]:
    maker = tr.KeyMaker(KeyNamespace(tr.MODEL, rp.block_layout(BB).fingerprint(), tenant=tenant))
    return [maker.keys(ids) for ids in requests]


def config(hbm: int = 0, dram: int = 0, ssd: int = 0) -> rp.TierConfig:
    """A configuration in blocks (ssd: in SSD entries of BB bytes)."""
    return rp.TierConfig("t", hbm, dram * BB, ssd * rp.ssd_entry_bytes(BB), BB)


def run_json(tmp_path, capsys, requests: list[list[int]], *flags: str) -> dict:
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    args = parse(["--trace", trace, "--block-bytes", "4K", "--ssd-dir", str(tmp_path), "--json", "--no-progress",
                  "--out", str(tmp_path / "table.md"), *flags])
    assert rp.run(args) == 0
    return json.loads(capsys.readouterr().out)


# -- sizes and flags -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, blocks, nbytes", [
    ("4000b", 4000, None), ("4000blocks", 4000, None), ("1 block", 1, None), ("4000B", 4000, None),
    ("2G", None, 2 << 30), ("64KiB", None, 64 << 10), ("1.5M", None, 3 << 19), ("4096bytes", None, 4096),
    ("512MB", None, 512 << 20), ("0", 0, None),
])
def test_capacity_parses_blocks_and_bytes(text: str, blocks: int | None, nbytes: int | None) -> None:
    cap = rp.parse_capacity(text)
    assert (cap.blocks, cap.nbytes) == (blocks, nbytes)


@pytest.mark.parametrize("text, says", [
    ("abc", "not a capacity"), ("", "not a capacity"), ("-5b", "not a capacity"), ("4000", "ambiguous"),
    ("1.5b", "whole number"), ("12x", "unknown unit"), ("2 GiBs", "unknown unit"),
])
def test_capacity_rejects_garbage_clearly(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        rp.parse_capacity(text)


def test_cli_rejects_garbage_with_the_flag_named(capsys) -> None:
    for argv, says in ((["--dram", "lots"], "argument --dram: not a capacity"),
                       (["--hbm", "100"], "argument --hbm: ambiguous"),
                       (["--block-bytes", "big"], "argument --block-bytes: not a byte size")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert says in capsys.readouterr().err


def test_flags_resolve_to_blocks_of_the_chosen_size() -> None:
    entry = rp.ssd_entry_bytes(BB)
    [c] = rp.tier_configs(parse(["--block-bytes", "4K", "--hbm", "32K", "--dram", "2M", "--ssd", "10b"]))
    assert (c.hbm_blocks, c.dram_bytes, c.dram_blocks, c.ssd_bytes, c.ssd_blocks) == (8, 2 << 20, 512, 10 * entry, 10)
    assert entry >= BB + 48  # a block on LMDB costs its pages plus a header
    assert [c.label for c in rp.tier_configs(parse(["--compare"]))] == ["HBM", "HBM + DRAM", "HBM + DRAM + SSD"]
    [hbm_only] = rp.tier_configs(parse(["--dram", "0"]))
    assert (hbm_only.label, hbm_only.pooled, hbm_only.ssd_bytes) == ("HBM", False, 0)
    for argv, says in ((["--hbm", "1K"], "holds no"), (["--dram", "1K"], "holds no"), (["--ssd", "1K"], "holds no"),
                       (["--block-bytes", "1000"], "multiple of 1024"), (["--compare", "--ssd", "0"], "--compare"),
                       (["--compare", "--master", "h:1"], "--master"), (["--flush-every", "0"], "flush-every")):
        with pytest.raises(ValueError, match=says):
            rp.tier_configs(parse(argv))


def test_layout_is_exactly_the_block_bytes() -> None:
    for size in (1 << 10, 16 << 10, 1 << 20):
        layout = rp.block_layout(size)
        assert (layout.block_bytes, layout.block_size) == (size, 512)


# -- trace, keys, bound ---------------------------------------------------------------------------


def test_trace_loading_and_limit(tmp_path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 3], [4]])
    assert [r.hash_ids for r in tr.load_trace(path)] == [(1, 2), (1, 3), (4,)]
    assert [r.hash_ids for r in tr.load_trace(path, limit=2)] == [(1, 2), (1, 3)]
    (tmp_path / "bad.jsonl").write_text('{"hash_ids": [1]}\n{"hash_ids": "x"}\n')
    with pytest.raises(ValueError, match="line 2"):
        tr.load_trace(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="cannot read trace"):
        tr.load_trace(str(tmp_path / "missing.jsonl"))


def test_keys_are_kvpools_chain_over_the_concatenated_tokens() -> None:
    ns = KeyNamespace(tr.MODEL, rp.block_layout(BB).fingerprint())
    maker = tr.KeyMaker(ns)
    a, b, c = maker.keys([7, 8, 9]), maker.keys([7, 8, 10]), maker.keys([6, 8, 9])
    tokens = np.concatenate([tr.block_tokens(h) for h in (7, 8, 10)])
    assert b == chain_block_keys(tokens, 512, ns)  # memoised prefix + chained rest = one chain
    assert a[:2] == b[:2] and a[2] != b[2]  # identical prefixes, identical keys
    assert not set(a) & set(c)  # another first block: every later key differs
    assert np.array_equal(tr.block_tokens(7), tr.block_tokens(7)) and tr.block_tokens(7).max() < tr.VOCAB


def test_unbounded_bound_leading_run_and_per_block() -> None:
    ids = [[1, 2, 3], [1, 2, 4], [9, 2, 3], [1, 2, 3]]
    bound = tr.unbounded_bound(ids)
    # leading: 0 + 2 + 0 + 3 = 5; any block: 0 + 2 + 2 + 3 = 7; of 12 lookups
    assert (bound.lookups, bound.leading_hits, bound.block_hits) == (12, 5, 7)
    # Chained keys: [9, 2, 3] shares no key with [1, 2, 3], so per-block equals leading run.
    keyed = tr.unbounded_bound(keys_of(ids))
    assert (keyed.lookups, keyed.leading_hits, keyed.block_hits) == (12, 5, 5)


def test_payloads_catch_other_and_shifted_bytes() -> None:
    pay = tr.Payloads(BB)
    keys = keys_of([[1, 2, 3]])[0]
    blocks = pay.make(keys)
    assert pay.wrong(keys, blocks) == 0
    swapped = blocks[[1, 0, 2]]
    shifted = np.roll(blocks, 32, axis=1)
    assert pay.wrong(keys, swapped) == 2 and pay.wrong(keys, shifted) == 3


def test_progress_bar_one_line_rate_limited() -> None:
    out = io.StringIO()
    bar = pg.Progress(100, "replay", out)
    for i in range(1, 101):
        bar.update(i)
    bar.close(100)
    text = out.getvalue()
    assert text.count("\r") <= 3 and text.endswith("\n") and text.count("\n") == 1
    assert "100/100 req" in text and "ETA" in text and "req/s" in text


# -- replays with known answers -------------------------------------------------------------------


def test_hbm_only_second_identical_request_hits_fully(tmp_path, capsys) -> None:
    report = run_json(tmp_path, capsys, [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5]], "--hbm", "100b", "--dram", "0")
    assert report["bound"]["leading_run"] == pytest.approx(6 / 11)
    [r] = report["runs"]
    assert r["pool"] == "none"
    assert r["hit_blocks"] == {"hbm": 6, "dram": 0, "ssd": 0}
    assert r["overall_hit_ratio"] == pytest.approx(6 / 11) and r["hit_ratio_vs_bound"] == pytest.approx(1.0)
    assert (r["wrong_blocks"], r["errors"], r["put_blocks"]) == (0, {}, 5)
    assert "| HBM | 100 (400 KiB) | off | off | 6 (54.5%)" in (tmp_path / "table.md").read_text()


def test_pool_without_hbm_hits_in_dram(tmp_path, capsys) -> None:
    report = run_json(tmp_path, capsys, [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5]],
                      "--hbm", "0", "--dram", "100b", "--ssd", "0")
    [r] = report["runs"]
    assert r["pool"] == "embedded" and r["dram_blocks"] == 100
    assert r["hit_blocks"] == {"hbm": 0, "dram": 6, "ssd": 0}
    assert (r["wrong_blocks"], r["errors"], r["lost_after_lookup"], r["node_reregistered"]) == (0, {}, 0, False)


def test_compare_tiny_dram_spills_to_ssd(tmp_path, capsys) -> None:
    # r1's blocks are pushed out of a 2-block HBM and a 4-slot DRAM by r2; only SSD still has them for r3.
    trace = [[1, 2, 3, 4], list(range(10, 20)), [1, 2, 3, 4]]
    report = run_json(tmp_path, capsys, trace, "--compare", "--hbm", "2b", "--dram", "4b", "--ssd", "100b")
    hbm, dram, ssd = report["runs"]
    assert [r["config"] for r in report["runs"]] == ["HBM", "HBM + DRAM", "HBM + DRAM + SSD"]
    assert hbm["hit_blocks"] == {"hbm": 0, "dram": 0, "ssd": 0}
    assert dram["hit_blocks"] == {"hbm": 0, "dram": 0, "ssd": 0}
    assert ssd["hit_blocks"] == {"hbm": 0, "dram": 0, "ssd": 4}
    assert ssd["hit_ratio_vs_bound"] == pytest.approx(1.0)
    for r in report["runs"]:
        assert (r["wrong_blocks"], r["lost_after_lookup"]) == (0, 0)
    # 10 new blocks in one batch into 4 DRAM slots and no SSD: the node refuses what does not fit.
    assert (hbm["errors"], ssd["errors"]) == ({}, {}) and set(dram["errors"]) <= {"put_refused"}
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| HBM") == 3 and "| 4 (22.2%) | 22.2% | 1.00 |" in table


def test_running_pool_via_master_and_hbm_first(tmp_path) -> None:
    trace = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]]
    keys = keys_of(trace, tenant="t1")
    pool = rp.EmbeddedPool(config(dram=64), ssd_parent=str(tmp_path))
    try:
        # HBM of 2 blocks (LRU). r1 misses; HBM keeps 1, 2 (a batch never evicts itself), the pool gets 1-3.
        # r2: HBM serves 1, 2, the pool 3 (now in HBM too: 2, 3), then 4 is put: HBM holds 3, 4.
        # r3: HBM's leading run is empty (1 is gone), so the pool serves all four.
        r = rp.replay(keys, rp.TierConfig("ext", 2, 0, 0, BB), master=pool.address, tenant="t1", progress=False)
    finally:
        pool.close()
    assert r.pool == pool.address
    assert (r.lookups, r.hits) == (11, {"hbm": 2, "dram": 5, "ssd": 0})
    assert (r.wrong_blocks, r.errors, r.lost, r.node_reregistered) == (0, {}, 0, False)


def test_unreachable_master_is_a_clear_error() -> None:
    keys = keys_of([[1, 2]])
    with pytest.raises(ValueError, match="cannot ask the master at 127.0.0.1:1"):
        rp.replay(keys, rp.TierConfig("ext", 0, 0, 0, BB), master="127.0.0.1:1", progress=False)


def test_the_exact_lru_reference_refreshes_on_reads_and_counts_leading_runs():
    from kvpool.bench.trace import lru_reference

    # DRAM of 2: the read of "a" keeps it past "c" (insertion order would have dropped it)
    ref = lru_reference([["a"], ["b"], ["a"], ["c"], ["a"]], hbm_blocks=0, dram_blocks=2)
    assert (ref.lookups, ref.hbm_hits, ref.dram_hits) == (5, 0, 2)
    # only the leading run counts: "b" is held, but after a miss
    ref = lru_reference([["a", "b"], ["x", "b"]], hbm_blocks=0, dram_blocks=10)
    assert (ref.hbm_hits, ref.dram_hits) == (0, 0)
    # HBM in front: its hits are not DRAM hits, and a DRAM hit is copied into HBM
    ref = lru_reference([["a", "b"], ["a", "b"], ["c"], ["a"]], hbm_blocks=2, dram_blocks=10)
    assert (ref.hbm_hits, ref.dram_hits) == (2, 1)
