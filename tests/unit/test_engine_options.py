"""Engine adapters parse their own settings strictly (issue 26): ``"false"`` is false, and a value that is not an
on/off, a number in range or a path is one ValueError naming the field (kvpool.engines.options, used by every
adapter). vLLM's connector and vllm-ascend's backend are checked here without vLLM; SGLang's backend in SGLang's
venv (tests/engines/test_engine_sglang.py), the connector inside the real vLLM (tests/engines/test_engine_vllm.py)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvpool.engines import options
from kvpool.engines.vllm.settings import DEFAULT_LOAD_MODE, client_config, load_mode, strict_mode

# (value, what an on/off setting reads it as; None: refused). A list: True, 1 and 1.0 are one dict key.
FLAGS = [
    (True, True), (False, False), (1, True), (0, False),
    ("true", True), ("false", False), ("TRUE", True), (" False ", False), ("1", True), ("0", False),
    ("yes", True), ("no", False), ("on", True), ("off", False),
    (2, None), (-1, None), (1.0, None), (0.0, None), (None, None), ("", None), ("maybe", None), ("2", None),
    ("tru", None), ([], None),
]


def flag_values():
    return pytest.mark.parametrize("value,want", FLAGS, ids=[f"{type(v).__name__}:{v!r}" for v, _ in FLAGS])


@flag_values()
def test_an_on_off_setting_is_read_as_written_or_refused_naming_the_field(value, want):
    if want is None:
        with pytest.raises(ValueError, match=r"^section\.field must be true or false .*got " + repr_pattern(value)):
            options.flag(value, "section.field")
    else:
        assert options.flag(value, "section.field") is want


def repr_pattern(value: object) -> str:
    return "".join("\\" + c if c in ".()[]+*?^$|\\" else c for c in repr(value))


@pytest.mark.parametrize("value", ["false", "0", "true", "off"])
def test_where_the_engine_reads_a_field_by_truth_value_words_are_refused_not_read_the_other_way(value):
    with pytest.raises(ValueError, match=r"x\.interface_v1 must be true or false \(or 1/0\) without quotes \(why\)"):
        options.flag(value, "x.interface_v1", words=False, words_why=" (why)")
    assert [options.flag(v, "x", words=False) for v in (True, False, 1, 0)] == [True, False, True, False]
    with pytest.raises(ValueError, match="x must be true or false \\(or 1/0\\), got 2"):
        options.flag(2, "x", words=False)


@pytest.mark.parametrize("value", [True, 0, -3, 1.0, "2", None, [1]])
def test_a_number_is_an_integer_in_range(value):
    with pytest.raises(ValueError, match=r"^f must be an integer, 1 to 8, got "):
        options.integer(value, "f", low=1, high=8)
    assert options.integer(8, "f", low=1, high=8) == 8


@flag_values()
def test_the_vllm_connectors_kvpool_strict(value, want):
    if want is None:
        with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.kvpool_strict must be true or false"):
            strict_mode({"kvpool_strict": value})
    else:
        assert strict_mode({"kvpool_strict": value}) is want
    assert strict_mode({}) is False


@pytest.mark.parametrize("value", ["Async", "layer-wise", "", None, 1, True, ["sync"]])
def test_the_vllm_connectors_load_mode_is_one_of_its_words_as_written(value):
    assert [load_mode({"kvpool_load_mode": m}) for m in ("async", "sync", "layerwise")] == ["async", "sync",
                                                                                          "layerwise"]
    assert load_mode({}) == DEFAULT_LOAD_MODE == "async"
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.kvpool_load_mode must be one of 'async', "
                                         r"'sync', 'layerwise', got "):
        load_mode({"kvpool_load_mode": value})
    client_config({"kvpool_load_mode": "sync"})  # a known field, not refused as unknown


def test_the_vllm_connectors_config_path_must_be_a_path(tmp_path):
    for bad in (5, None, True, ["a.json"]):
        with pytest.raises(ValueError, match=r"kv_connector_extra_config\.kvpool_config_path must be a path"):
            client_config({"kvpool_config_path": bad})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"client": {"model": "m"}}))
    assert client_config({"kvpool_config_path": str(path), "kvpool_strict": "false", "other": 1}).model == "m"
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config field.*kvpool_strikt"):
        client_config({"kvpool_strikt": True})


def test_vllm_ascends_backend_takes_only_a_path_from_vllms_extra_config(tmp_path, monkeypatch):
    from kvpool.engines.vllm_ascend import KVPoolStoreBackend

    extra: dict[str, object] = {}
    current = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
    vllm = types.ModuleType("vllm")
    vllm_config = types.ModuleType("vllm.config")
    vllm_config.get_current_vllm_config = lambda: current
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", vllm_config)
    monkeypatch.delenv("KVPOOL_CONFIG_PATH", raising=False)
    for bad in (5, True, ["c.json"]):
        extra["kvpool_config_path"] = bad
        with pytest.raises(ValueError, match=r"kv_connector_extra_config\.kvpool_config_path must be a path"):
            KVPoolStoreBackend(role="scheduler")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"client": {"model": "m"}}))
    extra["kvpool_config_path"] = str(path)
    backend = KVPoolStoreBackend(role="scheduler")
    backend.close()


@flag_values()
def test_mindies_cache_description(value, want):
    from kvpool.engines.mindie import CACHE_SECTION, MindIECache

    base = {"dtype": "bfloat16", "num_layers": 3, "block_size": 16, "num_kv_heads": 1, "k_head_size": 512,
            "v_head_size": 64}
    if want is None:
        with pytest.raises(ValueError, match=rf"^{CACHE_SECTION}\.nz must be true or false"):
            MindIECache.from_dict({**base, "nz": value})
    else:
        assert MindIECache.from_dict({**base, "nz": value}).nz is want
    for field, bad in (("num_layers", "3"), ("block_size", True), ("num_kv_heads", 0), ("k_head_size", 512.0)):
        with pytest.raises(ValueError, match=rf"^{CACHE_SECTION}\.{field} must be an integer, 1 or more, got "):
            MindIECache.from_dict({**base, field: bad})
    with pytest.raises(ValueError, match=rf"^{CACHE_SECTION}\.quant_layers must be an integer, 0 to 2, got 3"):
        MindIECache.from_dict({**base, "quant_layers": [3]})
