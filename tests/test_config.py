"""Config: JSON file, environment, flags; clear errors for anything unknown."""

from __future__ import annotations

import json

import pytest

from kvpool.config import load_config, parse_size


def test_precedence_is_flags_then_env_then_file_then_defaults(tmp_path):
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"node": {"dram_bytes": "1G", "port": 9100}, "master": {"node_timeout_s": 5}}))
    env = {"KVPOOL_NODE_PORT": "9200", "KVPOOL_MASTER_HOST": "0.0.0.0", "UNRELATED": "x"}
    cfg = load_config(path, env=env, overrides={"node": {"port": 9300, "ssd_dir": None}})
    assert cfg.node.dram_bytes == 1 << 30
    assert cfg.node.port == 9300  # flag beats env beats file
    assert cfg.master.host == "0.0.0.0" and cfg.master.node_timeout_s == 5.0
    assert cfg.node.ssd_dir == "./kvpool-data"  # a flag left unset (None) changes nothing


def test_client_layout_comes_from_json(tmp_path):
    path = tmp_path / "client.json"
    layout = {"dtype": "bf16", "num_layers": 28, "num_kv_heads": 4, "head_dim": 128, "block_size": 128}
    path.write_text(json.dumps({"client": {"layout": layout, "hbm_blocks": 64, "strict": "true"}}))
    cfg = load_config(path, env={})
    assert cfg.client.layout.block_bytes == 7 << 20
    assert cfg.client.hbm_blocks == 64 and cfg.client.strict is True


@pytest.mark.parametrize(
    "data,message",
    [
        ({"nodes": {}}, "unknown config section"),
        ({"node": {"dram_byte": 1}}, "unknown node config field"),
        ({"node": {"port": "eighty"}}, "node.port"),
        ({"node": {"dram_bytes": "lots"}}, "node.dram_bytes"),
        ({"client": {"strict": "maybe"}}, "client.strict"),
        ({"client": {"layout": {"dtype": "float13"}}}, "client.layout"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_config(path, env={})


def test_unreadable_or_invalid_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.json", env={})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad, env={})
    with pytest.raises(ValueError, match="unknown node config field"):
        load_config(None, env={"KVPOOL_NODE_DRAMBYTES": "1G"})


@pytest.mark.parametrize("text,value", [("4096", 4096), ("64K", 65536), ("512M", 512 << 20), ("4GiB", 4 << 30), (7, 7)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["-1", "x", "", True, None, -5])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_automatic_sizes_are_sane(tmp_path):
    cfg = load_config(None, env={}, overrides={"node": {"ssd_dir": str(tmp_path / "d")}}).node
    assert cfg.slot_bytes <= cfg.resolved_dram_bytes() <= 8 << 30
    assert cfg.resolved_dram_bytes() % cfg.slot_bytes == 0
    assert 64 << 20 <= cfg.resolved_ssd_bytes() <= 64 << 30
