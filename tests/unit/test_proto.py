"""The checked-in stubs are exactly what proto/ generates."""

from __future__ import annotations

import shutil

from kvpool import protogen


def test_checked_in_stubs_match_the_proto_files():
    assert protogen.stale_files() == []


def test_a_changed_proto_is_caught(tmp_path, monkeypatch):
    fake_root = tmp_path / "repo"
    shutil.copytree(protogen.ROOT / "proto", fake_root / "proto")
    shutil.copytree(protogen.ROOT / "kvpool" / "v1", fake_root / "kvpool" / "v1")
    common = fake_root / "proto" / "kvpool" / "v1" / "common.proto"
    common.write_text(common.read_text().replace("string arena = 4;", "string arena = 4;\n  string extra = 99;"))
    monkeypatch.setattr(protogen, "ROOT", fake_root)
    monkeypatch.setattr(protogen, "PROTO_DIR", fake_root / "proto")
    assert "common_pb2.py" in protogen.stale_files()
