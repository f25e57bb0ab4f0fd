"""One typed, frozen config per component, read from one JSON file, the environment and flags.

Precedence, highest first: command-line flags, environment variables
``KVPOOL_<SECTION>_<FIELD>`` (e.g. ``KVPOOL_NODE_DRAM_BYTES=8G``), the JSON
file (sections ``"master"``, ``"node"``, ``"client"``; engines pass its path,
like MindIE's ``configPath``), then the defaults below. The environment is read
once, by :func:`load_config`; constructors never look at it.

Sizes may be written ``"4G"``, ``"512M"``, ``"64K"`` or as plain byte counts.
Unknown sections or fields and badly typed values are a ValueError naming them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.layout import KVLayout

DEFAULT_MASTER_PORT = 7600
DEFAULT_NODE_PORT = 7610
_GIB = 1 << 30
_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from ``4096``, ``"64K"``, ``"512M"``, ``"4G"`` or ``"4GiB"``; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = _SIZE_SUFFIX.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"not a size: {value!r} (use e.g. 4096, 64K, 512M, 4G)") from None
    if amount < 0:
        raise ValueError(f"size must not be negative: {value!r}")
    return int(amount * scale)


def opt(default: Any, help: str, *, size: bool = False) -> Any:
    """A config field with the help text ``--help`` shows (and ``size`` parsing for byte sizes)."""
    return field(default=default, metadata={"help": help, "size": size})


@dataclass(frozen=True)
class MasterConfig:
    """The Master Service."""

    host: str = opt("127.0.0.1", "address the master listens on (0.0.0.0: all interfaces)")
    port: int = opt(DEFAULT_MASTER_PORT, "gRPC port of the Master Service")
    metrics_port: int = opt(DEFAULT_MASTER_PORT + 1, "HTTP /metrics port; 0: none, -1: any free port")
    call_port: int = opt(-1, "TCP port of the fast-call listener (Lookup, PlaceBlocks, ... as framed TCP); "
                             "-1: port + 2 (any free port if that is taken or port is 0); 0: any free port")
    node_timeout_s: float = opt(3.0, "a node silent this long is dropped with all its entries")
    heartbeat_interval_s: float = opt(1.0, "told to nodes when they register")
    worker_timeout_s: float = opt(60.0, "a worker silent this long loses its HBM entries")
    max_keys_per_call: int = opt(65536, "largest key batch one call may carry")
    max_connections: int = opt(64, "most fast-call TCP connections at once; more are refused")
    max_concurrent_rpcs: int = opt(0, "most gRPC calls in flight at once; more get RESOURCE_EXHAUSTED; 0: no limit")
    auth_file: str = opt("", "JSON file of secret, node tokens and client tokens/tenants/quotas "
                             "(docs/security.md); empty: no authentication")
    tls_cert: str = opt("", "PEM certificate chain: serve gRPC and fast calls over TLS only (with tls_key)")
    tls_key: str = opt("", "PEM private key of tls_cert")


@dataclass(frozen=True)
class NodeConfig:
    """A pool node: the DRAM arena and SSD store of one host."""

    master: str = opt(f"127.0.0.1:{DEFAULT_MASTER_PORT}", "the master's host:port")
    host: str = opt("127.0.0.1", "address the node listens on (0.0.0.0: all interfaces)")
    port: int = opt(DEFAULT_NODE_PORT, "gRPC port of the node's data service")
    metrics_port: int = opt(DEFAULT_NODE_PORT + 1, "HTTP /metrics port; 0: none, -1: any free port")
    data_port: int = opt(-1, "bulk TCP port for remote reads and writes; -1: port + 2 (any free port if that "
                             "is taken or port is 0); 0: any free port")
    advertise: str = opt("", "host:port clients dial; default host:port")
    node_id: str = opt("", "default: <hostname>:<port>")
    arena: str = opt("", "/dev/shm name of the DRAM arena; default: kvpool-<port>")
    dram_bytes: int = opt(0, "0: a quarter of available memory, at most 8 GiB and half of /dev/shm", size=True)
    slot_bytes: int = opt(2 << 20, "largest block the DRAM tier takes; set >= your block size", size=True)
    ssd_dir: str = opt("./kvpool-data", "directory of the SSD tier (LMDB)")
    ssd_bytes: int = opt(0, "0: half the free disk at ssd_dir, at most 64 GiB", size=True)
    ssd_enabled: bool = opt(True, "false: DRAM only")
    ssd_sync: bool = opt(False, "fsync every SSD commit (default: a cache; see docs/architecture.md)")
    high_watermark: float = opt(0.95, "DRAM usage fraction that starts eviction (demotion to SSD)")
    low_watermark: float = opt(0.85, "DRAM usage fraction eviction brings usage down to")
    write_through: bool = opt(False, "write every block to SSD at once, not only on eviction")
    demote_queue_bytes: int = opt(256 << 20, "write-back: DRAM's evicted blocks are written to SSD in the background, "
                                             "at most this many bytes queued (0: inline, in the evicting call)",
                                  size=True)
    max_message_bytes: int = opt(256 << 20, "largest gRPC message, fast-call body or bulk PUT the node accepts",
                                 size=True)
    max_keys_per_call: int = opt(65536, "largest key batch one call (gRPC, fast call or bulk) may carry")
    max_connections: int = opt(64, "most bulk TCP connections (fast calls included) at once; more are refused")
    max_concurrent_rpcs: int = opt(0, "most gRPC calls in flight at once; more get RESOURCE_EXHAUSTED; 0: no limit")
    auth_file: str = opt("", "JSON file of secret, node tokens and client tokens/tenants/quotas (the master's "
                             "file; docs/security.md); empty: no authentication")
    token: str = opt("", "this node's token for the master (one of the auth file's node_tokens)")
    tls_cert: str = opt("", "PEM certificate chain: serve gRPC and bulk TCP over TLS only (with tls_key)")
    tls_key: str = opt("", "PEM private key of tls_cert")
    tls_ca: str = opt("", "PEM CA certificate to verify the master with: dial it over TLS")
    arena_mode: str = opt("0600", "permissions (octal) of the DRAM arena in /dev/shm: 0600 this user only, "
                                  "0660 also its group; whoever can map it reads every block (docs/security.md)")
    lease_timeout_s: float = opt(5.0, "a same-host writer's reserved DRAM slots return to the pool this long "
                                      "after Reserve unless committed")

    def resolved_node_id(self) -> str:
        return self.node_id or f"{socket.gethostname()}:{self.port}"

    def resolved_advertise(self) -> str:
        return self.advertise or f"{self.host}:{self.port}"

    def resolved_arena(self) -> str:
        return self.arena or f"kvpool-{self.port}"

    def resolved_arena_mode(self) -> int:
        """``arena_mode`` as a number; ValueError unless octal, read-write for the owner, nothing for others."""
        try:
            mode = int(self.arena_mode, 8)
        except ValueError:
            raise ValueError(f"node.arena_mode {self.arena_mode!r} is not an octal mode like 0600 or 0660") from None
        if mode & ~0o660 or mode & 0o600 != 0o600:
            raise ValueError(f"node.arena_mode {self.arena_mode!r}: the owner needs read-write (0600) and only the "
                             "group may be added (0660); other users never map the arena (docs/security.md)")
        return mode

    def resolved_dram_bytes(self) -> int:
        """The configured DRAM size, or a quarter of available memory (at most 8 GiB, half of /dev/shm's free space)."""
        if self.dram_bytes:
            return self.dram_bytes
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else available
        auto = min(available // 4, 8 * _GIB, shm_free // 2)
        return max(self.slot_bytes, auto // self.slot_bytes * self.slot_bytes)

    def resolved_ssd_bytes(self) -> int:
        """The configured SSD size, or half the free disk at ssd_dir capped at 64 GiB."""
        if self.ssd_bytes:
            return self.ssd_bytes
        probe = self.ssd_dir
        while not os.path.exists(probe):
            probe = os.path.dirname(os.path.abspath(probe))
        return max(64 << 20, min(shutil.disk_usage(probe).free // 2, 64 * _GIB))


@dataclass(frozen=True)
class ClientConfig:
    """The client library inside an inference worker."""

    master: str = opt(f"127.0.0.1:{DEFAULT_MASTER_PORT}", "the master's host:port")
    worker_id: str = opt("", "default: <hostname>-<pid>")
    model: str = opt("default", "model id: part of every block key's namespace")
    tenant: str = opt("", "salt: tenants never share keys")
    layout: KVLayout | None = opt(None, "the engine's KV layout (needed for the HBM tier and adapters)")
    hbm_blocks: int = opt(0, "HBM tier size in blocks; 0: no HBM tier in the client")
    device: str = opt("cpu", "HBM tier device: cpu, cuda:N, npu:N")
    lookup_timeout_s: float = opt(0.5, "deadline of a master call; past it the lookup is a miss")
    io_timeout_s: float = opt(5.0, "deadline of a node data call; past it the blocks are misses")
    put_queue_bytes: int = opt(1 << 30, "write-behind bound in bytes; a full queue drops new puts (counted)", size=True)
    shared_memory: bool = opt(True, "read same-host nodes' DRAM arena directly (needs permission to map it)")
    token: str = opt("", "this client's token (one of the auth file's clients); empty: none")
    tls_ca: str = opt("", "PEM CA certificate to verify the master and nodes with: dial them over TLS")
    strict: bool = opt(False, "tests: raise pool faults instead of counting them as misses")
    metrics_port: int = opt(0, "0: no endpoint (the registry is still available)")

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PoolConfig:
    """Everything one JSON file can say."""

    master: MasterConfig = field(default_factory=MasterConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    client: ClientConfig = field(default_factory=ClientConfig)


_SECTIONS: dict[str, type] = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig}


def _coerce(section: str, f: dataclasses.Field, value: Any) -> Any:
    where = f"{section}.{f.name}"
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if f.metadata.get("size"):
            return parse_size(value)
        if kind == "KVLayout | None":
            if value is None or isinstance(value, KVLayout):
                return value
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, Mapping):
                raise ValueError("expected an object with dtype, num_layers, num_kv_heads, head_dim, block_size")
            return KVLayout.from_dict(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.strip().lower() in ("1", "true", "yes", "on")
            raise ValueError("expected true or false")
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError("expected an integer")
            return int(value)
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError("expected a number")
            return float(value)
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"config {where}: {exc} (got {value!r})") from None
    raise AssertionError(f"config: no coercion for field type {kind} of {where}")


def make_section(section: str, values: Mapping[str, Any], base: Any = None) -> Any:
    """A section's config from ``values`` over ``base`` (or the defaults); ValueError on unknown fields."""
    cls = _SECTIONS.get(section)
    if cls is None:
        raise ValueError(f"unknown config section {section!r}; known: {', '.join(_SECTIONS)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown {section} config field(s): {', '.join(unknown)}; known: {', '.join(fields)}")
    coerced = {name: _coerce(section, fields[name], v) for name, v in values.items()}
    return dataclasses.replace(base if base is not None else cls(), **coerced)


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file at ``path``; ValueError naming ``what`` and the problem otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> PoolConfig:
    """Defaults, then the JSON file at ``path``, then ``KVPOOL_*`` variables, then ``overrides``."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if path:
        data = read_json_object(path, "config file")
        for name, values in data.items():
            if name not in _SECTIONS:
                raise ValueError(f"unknown config section {name!r} in {path}; known: {', '.join(_SECTIONS)}")
            if not isinstance(values, dict):
                raise ValueError(f"config section {name!r} in {path} must be an object")
            sections[name].update(values)
    for var, value in (os.environ if env is None else env).items():
        if not var.startswith("KVPOOL_"):
            continue
        parts = var[len("KVPOOL_"):].lower().split("_", 1)
        if len(parts) == 2 and parts[0] in _SECTIONS:
            sections[parts[0]][parts[1]] = value
    for name, values in (overrides or {}).items():
        sections.setdefault(name, {}).update({k: v for k, v in values.items() if v is not None})
    built = {name: make_section(name, values) for name, values in sections.items()}
    return PoolConfig(**built)
