"""The ``kvpool`` command line: refused starts leave nothing behind, --help, on/off flags, derived ports."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import uuid

import pytest
from support import (
    PoolProcesses,
    free_port,
    kvpool_process,
    metric,
    scrape,
    stop_process,
    wait_serving,
    wait_until,
)

from kvpool.cli import _overrides, build_parser, main
from kvpool.config import load_config, settings
from kvpool.status import human_bytes
from kvpool.tiers.arena import shm_path

REFUSAL_TIMEOUT_S = 60  # a refused start exits at once; this only bounds a start that is not refused


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True,
                          timeout=REFUSAL_TIMEOUT_S, cwd=cwd)


def _node_flags(tmp_path, arena: str) -> list[str]:
    return ["--port", str(free_port()), "--metrics-port", "0", "--data-port", "0", "--arena", arena,
            "--dram-bytes", "8M", "--ssd-dir", str(tmp_path / "ssd")]


def _master_flags(prefix: str = "") -> list[str]:
    return [f"--{prefix}port", str(free_port()), f"--{prefix}metrics-port", "0", f"--{prefix}call-port", "0"]


@pytest.mark.parametrize(
    "args,field",
    [
        (["node", "--high-watermark", "2"], "node.tiers.dram.high_watermark (high_watermark)"),
        (["node", "--low-watermark", "0.9", "--high-watermark", "0.5"], "node.tiers.dram.low_watermark"),
        (["node", "--lease-timeout-s", "inf"], "node.tiers.dram.lease_timeout_s (lease_timeout_s)"),
        (["node", "--max-message-bytes", "0"], "node.max_message_bytes"),
        (["serve", "--max-block-bytes", "0"], "node.tiers.dram.max_block_bytes (max_block_bytes)"),
        (["serve", "--master-node-timeout-s", "nan"], "master.node_timeout_s"),
        (["master", "--node-timeout-s", "nan"], "master.node_timeout_s"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_a_refused_start_says_why_in_one_line_and_leaves_nothing_behind(tmp_path, args, field):
    arena = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    command = args[0]
    extra = {"node": _node_flags(tmp_path, arena), "serve": _node_flags(tmp_path, arena) + _master_flags("master-"),
             "master": _master_flags()}[command]
    try:
        done = _cli(*args, *extra, cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvpool {command}: ") and field in lines[0], done.stderr
        assert "Traceback" not in done.stderr
        assert not os.path.exists(shm_path(arena))  # no arena left in /dev/shm
        assert not (tmp_path / "ssd").exists() and not (tmp_path / "kvpool-data").exists()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(arena))


def _help(capsys, monkeypatch, *args: str) -> dict[str, str]:
    """``kvpool ARGS --help`` as {option entry's first flag: its whole entry, whitespace collapsed}."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    entries: dict[str, str] = {}
    for chunk in re.split(r"\n(?=  -)", text.split("\noptions:", 1)[1]):
        chunk = chunk.split("\n\n")[0].strip()  # not the next group's title and description
        if chunk.startswith("-"):
            entries[chunk.split()[0].rstrip(",")] = " ".join(chunk.split())
    return entries


def test_help_shows_sizes_with_units_one_default_and_the_env_variable(capsys, monkeypatch):
    node = _help(capsys, monkeypatch, "node")
    largest = node["--max-block-bytes"]
    assert "(default: 64 MiB;" in largest and "512M" in largest
    assert "K, M, G or T" in largest and largest.startswith("--max-block-bytes SIZE ")
    assert "(default: 256 MiB;" in node["--max-message-bytes"]
    assert "env KVPOOL_NODE_MAX_BLOCK_BYTES" in node["--max-block-bytes"]
    assert "env KVPOOL_NODE_SSD_ENABLED" in node["--ssd"] and node["--ssd"].startswith("--ssd, --no-ssd ")
    assert "--ssd-enabled" not in " ".join(node.values())
    assert "(default: --port + 1;" in node["--metrics-port"]
    flags = [f for f in node if f not in ("-h", "--log-level", "--config")]
    assert len(flags) == len(settings("node"))  # one flag per setting, nested ones included
    assert "JSON node.tiers.dram.bytes;" in node["--dram-bytes"]  # where a config file puts it
    for flag in flags:
        entry = node[flag]
        assert entry.count("default") == 1, entry  # one default, stated once: never "(default: ...) (default: ...)"
        assert re.search(r"env KVPOOL_NODE_[A-Z_]+\)$", entry), entry
    serve = _help(capsys, monkeypatch, "serve")
    assert "env KVPOOL_MASTER_PORT" in serve["--master-port"] and "env KVPOOL_NODE_PORT" in serve["--port"]
    assert "(default: --master-port + 1;" in serve["--master-metrics-port"]
    assert "(default: 10 s;" in serve["--master-node-timeout-s"]


def test_on_off_settings_are_flag_pairs():
    parser = build_parser()
    args = parser.parse_args(["node", "--no-ssd", "--write-through", "--no-ssd-sync"])
    assert _overrides(args) == {"node": {"ssd_enabled": False, "write_through": True, "ssd_sync": False}}
    node = load_config(None, env={}, overrides=_overrides(args)).node
    assert node.tiers.ssd.enabled is False and node.tiers.write_through is True
    assert _overrides(parser.parse_args(["serve", "--ssd"])) == {"node": {"ssd_enabled": True}}
    assert _overrides(parser.parse_args(["node"])) == {}  # unset flags leave file and env values alone
    env = {"KVPOOL_NODE_SSD_ENABLED": "false"}
    assert load_config(None, env=env).node.tiers.ssd.enabled is False  # env: the flat name
    with pytest.raises(SystemExit):
        parser.parse_args(["node", "--ssd-enabled", "false"])


def test_log_level_goes_before_or_after_the_subcommand():
    parser = build_parser()
    for argv, level in [
        (["node", "--log-level", "DEBUG"], "DEBUG"),
        (["serve", "--log-level", "error"], "ERROR"),
        (["--log-level", "ERROR", "master", "--log-level", "DEBUG"], "DEBUG"),  # the later one wins
        (["status", "--log-level", "WARNING"], "WARNING"),
        (["bench", "tiers", "--log-level", "WARNING"], "WARNING"),
        (["--log-level", "WARNING", "node"], "WARNING"),  # before it, as always
        (["node"], "INFO"),
    ]:
        assert parser.parse_args(argv).log_level == level, argv



def test_bench_lists_only_an_operators_tools_and_replay_needs_their_own_trace(capsys):
    """The lab's harnesses (vLLM, transformers TTFT, the router, trace generation) are benchmarks/*.py scripts."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, re.MULTILINE)  # one line a bench, under BENCH
    assert listed == ["tiers", "fragmentation", "replay", "lru-sweep", "index", "failover", "soak"]
    for bench in ("replay", "lru-sweep"):  # no default path into the lab's data
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", bench])
        assert "the following arguments are required: --trace" in capsys.readouterr().err

def _bindable(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _scrape(port: int) -> dict | None:
    """The samples at 127.0.0.1:``port``/metrics, or None while nothing answers there yet."""
    try:
        return scrape(port)
    except OSError:
        return None


def _free_serve_ports(taken: set[int]) -> int:
    """A master port M with M..M+2 and M+10..M+12 free: the layout of a default serve (7600-7602, 7610-7612)."""
    while True:
        base = free_port()
        block = [base + d for d in (0, 1, 2, 10, 11, 12)]
        if block[-1] <= 65535 and not taken & set(block) and all(_bindable(p) for p in block[1:]):
            taken.update(block)
            return base


def test_two_serves_with_moved_ports_run_side_by_side(tmp_path):
    taken: set[int] = set()
    bases = [_free_serve_ports(taken), _free_serve_ports(taken)]
    tag = uuid.uuid4().hex[:8]
    procs = []
    try:
        for i, base in enumerate(bases):  # only --master-port and --port: every other port follows them
            procs.append(kvpool_process(
                "serve", "--master-port", str(base), "--port", str(base + 10), "--arena", f"kvpool-test-{tag}-{i}",
                "--dram-bytes", "8M", "--max-block-bytes", "1M", "--ssd-bytes", "64M",
                "--ssd-dir", str(tmp_path / f"ssd{i}"),
                log_path=tmp_path / f"serve{i}.log"))
        for proc, base in zip(procs, bases):
            wait_serving(f"127.0.0.1:{base}", timeout=60, proc=proc)
            wait_serving(f"127.0.0.1:{base + 10}", timeout=60, proc=proc)
        for proc, base in zip(procs, bases):
            def one_node(base: int = base) -> bool:  # each master (metrics at its port + 1) has its own node
                samples = _scrape(base + 1)
                return samples is not None and metric(samples, "kvpool_nodes") == 1
            wait_until(one_node, timeout=30)
            node = wait_until(lambda base=base: _scrape(base + 11), timeout=30)  # node metrics: its port + 1
            assert any(name == "kvpool_tier_capacity_bytes" for name, _ in node)
            for port in (base + 2, base + 12):  # master fast calls and node bulk: port + 2
                assert not _bindable(port)
            assert proc.poll() is None
    finally:
        codes = [stop_process(p, timeout=30) for p in procs]
        for i in range(len(bases)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(f"kvpool-test-{tag}-{i}"))
    logs = [(tmp_path / f"serve{i}.log").read_text()[-2000:] for i in range(len(procs))]
    assert codes == [0, 0], logs


def test_serve_refuses_a_port_its_master_and_node_would_share(tmp_path):
    arena = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    base = _free_serve_ports(set())
    try:  # the master's metrics port follows its port (base + 1), which is the node's port here
        done = _cli("serve", "--master-port", str(base), "--master-call-port", "0", "--port", str(base + 1),
                    "--metrics-port", "0", "--data-port", "0", "--arena", arena, "--dram-bytes", "8M",
                    "--ssd-dir", str(tmp_path / "ssd"), cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "master.server.metrics_port" in lines[0], done.stderr
        assert "node.server.port" in lines[0], done.stderr
        assert not os.path.exists(shm_path(arena)) and not (tmp_path / "ssd").exists()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(arena))


def test_an_unusable_ssd_dir_names_the_flags_a_cli_user_types(tmp_path):
    """Regression: the refusal named the config fields (ssd_enabled, ssd_optional), not the flags."""
    arena = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    flags = _node_flags(tmp_path, arena)
    flags[flags.index("--ssd-dir") + 1] = str(not_a_dir)
    try:
        done = _cli("node", *flags, cwd=tmp_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(arena))
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "--no-ssd" in line and "--ssd-optional" in line, line
    assert "ssd_enabled false" in line and "ssd_optional true" in line, line  # and the fields, for config files
    for suggested in (["--no-ssd"], ["--ssd-optional"]):  # the flags named are flags
        build_parser().parse_args(["node", *suggested])


@pytest.mark.parametrize("args,value", [(["serve", "--dram-bytes", "12X"], "'12X'"),
                                        (["node", "--ssd-bytes", "-5"], "'-5'"),
                                        (["node", "--port", "x"], "'x'"),
                                        (["master", "--node-timeout-s", "soon"], "'soon'")])
def test_a_bad_value_is_named_once(args, value):
    """Regression: ``--dram-bytes 12X`` said "not a size: '12X' (use e.g. ...) (got '12X')"."""
    done = _cli(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.count(value) == 1, line


def test_serve_says_what_its_dram_arena_file_holds_beside_the_blocks(tmp_path):
    """Regression: the log said ``DRAM 5701 MiB`` of a 6,034 MiB file in /dev/shm without saying what the rest is."""
    procs = PoolProcesses(tmp_path)
    try:
        procs.serve()
        arena = f"kvpool-test-{procs.tag}-n0"
        size = os.path.getsize(shm_path(arena))
        log = (tmp_path / "serve-0.log").read_text()
    finally:
        procs.close()
    line = next(line for line in log.splitlines() if "kvpool serve: master" in line)
    assert f"DRAM 8.0 MiB for blocks in /dev/shm/{arena}, a file of {human_bytes(size)}" in line, line
    assert "slot table and LRU stamps" in line and "key index and inventory" in line, line
