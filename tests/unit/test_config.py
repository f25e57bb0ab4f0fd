"""Config: JSON file, environment, flags; clear errors for anything unknown."""

from __future__ import annotations

import json
import math

import pytest

from kvpool.config import ClientConfig, MasterConfig, NodeConfig, load_config, parse_size, settings


def test_precedence_is_flags_then_env_then_file_then_defaults(tmp_path):
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"node": {"tiers": {"dram": {"bytes": "1G"}}, "server": {"port": 9100}},
                                "master": {"node_timeout_s": 5}}))
    env = {"KVPOOL_NODE_PORT": "9200", "KVPOOL_MASTER_HOST": "0.0.0.0", "UNRELATED": "x"}
    cfg = load_config(path, env=env, overrides={"node": {"port": 9300, "ssd_dir": None}})
    assert cfg.node.tiers.dram.bytes == 1 << 30
    assert cfg.node.server.port == 9300  # flag beats env beats file
    assert cfg.master.server.host == "0.0.0.0" and cfg.master.node_timeout_s == 5.0
    assert cfg.node.tiers.ssd.dir == "./kvpool-data"  # a flag left unset (None) changes nothing


def test_an_old_flat_key_in_a_file_says_its_new_place(tmp_path):
    """Config files nest (server, tls, events, tiers); a key of the old flat shape is refused, naming where it goes
    now, instead of being ignored. Flags and variables keep the flat names."""
    path = tmp_path / "old.json"
    for old, place in (({"node": {"dram_bytes": "1G"}}, "node.tiers.dram.bytes"),
                       ({"node": {"port": 7700}}, "node.server.port"),
                       ({"master": {"kv_events_endpoint": "tcp://127.0.0.1:7605"}}, "master.events.endpoint"),
                       ({"node": {"server": {"tls_cert": "c.pem"}}}, "node.tls.cert")):
        path.write_text(json.dumps(old))
        with pytest.raises(ValueError, match=rf"place in a config file is {place} now"):
            load_config(path, env={})
    assert load_config(None, env={"KVPOOL_NODE_DRAM_BYTES": "1G"}).node.tiers.dram.bytes == 1 << 30


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
        ({"node": {"dram_byte": 1}}, "unknown config field node.dram_byte"),
        ({"node": {"server": {"port": "eighty"}}}, "node.server.port"),
        ({"node": {"tiers": {"dram": {"bytes": "lots"}}}}, "node.tiers.dram.bytes"),
        ({"node": {"tiers": {"dram": 4}}}, "node.tiers.dram: must be an object"),
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
    with pytest.raises(ValueError, match="unknown node setting"):
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
    assert 4 << 10 <= cfg.resolved_dram_bytes() <= 8 << 30
    assert cfg.resolved_dram_bytes() % (4 << 10) == 0
    assert 64 << 20 <= cfg.resolved_ssd_bytes() <= 64 << 30


def test_sizes_must_be_finite():
    for text in ("inf", "-inf", "nan", "infK", "1e400"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(text)


@pytest.mark.parametrize("n,text", [(2 << 20, "2 MiB"), (256 << 20, "256 MiB"), (1 << 30, "1 GiB"), (3 << 40, "3 TiB"),
                                    (64 << 10, "64 KiB"), (1536, "1536 B"), (0, "0")])
def test_format_size(n, text):
    from kvpool.config import format_size  # new in this module: the other tests run without it

    assert format_size(n) == text


# One value of each field that must be refused; a field added without an entry here fails the test below.
# Strings any text may fill ("free-form") are refused only for the wrong type.
NAN, INF = math.nan, math.inf
_ETCD_SETTINGS = ("ca", "cert", "key", "user", "password_file")  # free-form file names and a user name
BAD_VALUES = {
    MasterConfig: {
        "host": "two words", "port": 65536, "metrics_port": -2, "call_port": -3, "call_poll_us": 2001,
        "node_timeout_s": NAN,
        "heartbeat_interval_s": 0.0, "worker_timeout_s": INF, "max_keys_per_call": 0, "max_connections": 0,
        "max_concurrent_rpcs": -1, "auth_file": None, "tls_cert": 1, "tls_key": b"key",
        "etcd": "ftp://etcd:2379", "cluster": "a/b", "leader_ttl_s": 1, "advertise_host": "two words",
        "shards": 0, "shard": -1,
        "kv_events_endpoint": "tcp://*", "kv_events_replay_endpoint": "udp://h:1", "kv_events_topic": "a b",
        "kv_events_buffer": 0, "kv_events_max_queue": 0, **{f"etcd_{s}": 1 for s in _ETCD_SETTINGS},
        "max_workers_per_tenant": 0, "max_hbm_keys_per_worker": 0, "max_hbm_keys_per_tenant": -1,
        "kv_events_buffer_bytes": "64K",
        "kv_events_subscriber_bytes": 0, "kv_events_max_connections": 0, "kv_events_max_connections_per_peer": 0,
        "kv_events_max_replays": 0, "kv_events_max_replays_per_peer": -1, "follow_log_bytes": 0, "warm_standby": "yes",
    },
    NodeConfig: {
        "master": "no-port", "host": "two words", "port": -1, "metrics_port": 70000, "data_port": -5,
        "advertise": "host", "node_id": 7, "arena": "../etc", "dram_bytes": -1, "max_block_bytes": 0,
        "dram_slots": -1, "ssd_dir": 3, "ssd_index_keys": -1, "ssd_sync_interval_s": 0.0,
        "ssd_bytes": -1, "ssd_enabled": "false", "ssd_optional": 1, "ssd_sync": "no", "high_watermark": 2.0,
        "low_watermark": 0.0, "write_through": None, "demote_queue_bytes": -1, "max_message_bytes": 0,
        "max_keys_per_call": 0, "max_connections": -1, "max_concurrent_rpcs": -1, "auth_file": None, "token": 5,
        "tls_cert": 1, "tls_key": 1, "tls_ca": 1, "arena_mode": "0777", "lease_timeout_s": INF,
        **{f"etcd_{s}": 1 for s in _ETCD_SETTINGS},
    },
    ClientConfig: {
        "master": "host:0", "worker_id": 1, "model": "", "tenant": None, "layout": {"dtype": "bf16"},
        "hbm_blocks": -1, "device": "gpu", "lookup_timeout_s": 0.0, "io_timeout_s": NAN, "spin_wait_us": -1,
        "put_queue_bytes": 0, "shared_memory": "yes", "token": 1, "tls_ca": 1, "strict": 1, "metrics_port": 65536,
        **{f"etcd_{s}": 1 for s in _ETCD_SETTINGS},
    },
}


_COMPONENTS = {MasterConfig: "master", NodeConfig: "node", ClientConfig: "client"}


@pytest.mark.parametrize("cls,name", [(cls, name) for cls in BAD_VALUES for name in settings(_COMPONENTS[cls])],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_no_config_can_hold_a_bad_value(cls, name):
    assert name in BAD_VALUES[cls], f"{cls.__name__}.{name}: add a value it must refuse to BAD_VALUES"
    value = BAD_VALUES[cls][name]
    setting = settings(_COMPONENTS[cls])[name]
    section = cls
    for part in setting.path[:-1]:  # the section that holds the setting checks it, constructed alone
        section = type(getattr(section(), part))
    # the message names the field, says what is allowed and shows the value
    with pytest.raises(ValueError, match=rf"\b{setting.where}\b.*\(got "):
        section(**{setting.path[-1]: value})


@pytest.mark.parametrize(
    "values,message",
    [
        ({"low_watermark": 0.9, "high_watermark": 0.5}, "node.tiers.dram.low_watermark .low_watermark.: must be <="),
        ({"dram_bytes": 1 << 10}, "node.tiers.dram.bytes .dram_bytes.: 1 KiB is below the least DRAM tier"),
        ({"port": 7700, "metrics_port": 7700}, "node.server.metrics_port .metrics_port.: 7700 is also server.port"),
        ({"port": 7700, "data_port": 7701}, "data_port: 7701 is also node.server.metrics_port"),  # port + 1
        ({"tls_cert": "cert.pem"}, "node.tls.cert .tls_cert. and tls.key: set both or neither"),
        ({"ssd_dir": ""}, "node.tiers.ssd.dir .ssd_dir.: must not be empty"),
    ],
)
def test_rules_between_fields(values, message):
    with pytest.raises(ValueError, match=message):
        NodeConfig.of(**values)


def test_values_from_files_env_and_flags_are_checked(tmp_path):
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"node": {"tiers": {"dram": {"max_block_bytes": 0}}}}))
    with pytest.raises(ValueError, match="node.tiers.dram.max_block_bytes"):
        load_config(path, env={})
    path.write_text(json.dumps({"node": {"slot_bytes": "2M"}}))  # an earlier version's field: said what replaced it
    with pytest.raises(ValueError, match="node.slot_bytes is gone: .*max_block_bytes"):
        load_config(path, env={})
    with pytest.raises(ValueError, match="master.node_timeout_s"):
        load_config(None, env={"KVPOOL_MASTER_NODE_TIMEOUT_S": "nan"})
    with pytest.raises(ValueError, match="node.tiers.dram.lease_timeout_s"):
        load_config(None, env={"KVPOOL_NODE_LEASE_TIMEOUT_S": "inf"})
    with pytest.raises(ValueError, match="node.max_message_bytes"):
        load_config(None, env={}, overrides={"node": {"max_message_bytes": "0"}})
    assert NodeConfig.of(ssd_dir="", ssd_enabled=False).tiers.ssd.dir == ""  # no SSD tier: no directory needed


def test_metrics_ports_follow_their_port():
    defaults = load_config(None, env={})
    assert (defaults.master.server.metrics_port, defaults.node.server.metrics_port) == (7601, 7611)
    moved = load_config(None, env={"KVPOOL_MASTER_PORT": "7700"}, overrides={"node": {"port": 7710}})
    assert (moved.master.server.metrics_port, moved.node.server.metrics_port) == (7701, 7711)
    assert (moved.master.call_port, moved.node.data_port) == (-1, -1)  # port + 2, derived by the servers
    explicit = load_config(None, env={}, overrides={"node": {"port": 7710, "metrics_port": 9000}})
    assert explicit.node.server.metrics_port == 9000
    assert NodeConfig.of(port=0).server.metrics_port == -1 and MasterConfig.of(port=0).server.metrics_port == -1
    assert NodeConfig.of(port=7710, metrics_port=0).server.metrics_port == 0  # none


def test_a_clients_worker_id_is_one_the_master_takes():
    """The master refuses worker ids over 256 characters or with control characters (issue 26): a client
    configured with one is refused at once, not with every lookup."""
    for bad in ("w" * 257, "gpu\x000", "gpu\n0", "gpu\x85"):
        with pytest.raises(ValueError, match=r"client\.worker_id: a worker id"):
            ClientConfig(worker_id=bad)
    assert ClientConfig(worker_id="w" * 256).resolved_worker_id() == "w" * 256
    assert ClientConfig().resolved_worker_id()  # empty: <hostname>-<pid>


def test_master_shards_are_checked_and_need_etcd():
    assert (MasterConfig.of().shards, MasterConfig.of().shard) == (1, 0)
    config = load_config(None, env={"KVPOOL_MASTER_SHARDS": "2", "KVPOOL_MASTER_SHARD": "1",
                                    "KVPOOL_MASTER_ETCD": "127.0.0.1:2379"}).master
    assert (config.shards, config.shard) == (2, 1)
    with pytest.raises(ValueError, match="master.shards: 2 index shards need etcd"):
        MasterConfig.of(shards=2)
    with pytest.raises(ValueError, match=r"master.shard: 2 is not a shard of 2 \(use 0 to 1\)"):
        MasterConfig.of(shards=2, shard=2, etcd="127.0.0.1:2379")
    for bad in (0, 257):
        with pytest.raises(ValueError, match="master.shards: must be 1 to 256"):
            MasterConfig.of(shards=bad, etcd="127.0.0.1:2379")
