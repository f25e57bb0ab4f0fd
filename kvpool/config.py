"""One typed, frozen config per component, read from one JSON file, the environment and flags.

Precedence, highest first: command-line flags, environment variables
``KVPOOL_<SECTION>_<NAME>`` (e.g. ``KVPOOL_NODE_DRAM_BYTES=8G``), the JSON
file (sections ``"master"``, ``"node"``, ``"client"``; engines pass its path,
like MindIE's ``configPath``), then the defaults below. The environment is read
once, by :func:`load_config`; constructors never look at it.

Master and node share nested sections (:class:`ServerConfig` as ``server``,
:class:`TlsConfig` as ``tls``; the master's :class:`EventsConfig` as
``events``, the node's :class:`TiersConfig` as ``tiers`` with ``dram`` and
``ssd``). The JSON file nests the same way; flags and variables keep one flat
name per setting (``tiers.dram.bytes`` is ``dram_bytes``: :func:`settings`).
An old flat key in a file is refused with its new place, never ignored.

Sizes may be written ``"4G"``, ``"512M"``, ``"64K"`` or as plain byte counts.
Unknown sections or fields and badly typed values are a ValueError naming them.

Invariant: a config object that exists is valid. Each dataclass (each section
too) checks every field (type, finite, in range) and the rules between fields
in ``__post_init__``, before any caller can create a file, segment or socket
from it; a bad value is a ValueError naming the field, the value and what is
allowed (built through :func:`make_section`, the field's whole place and its
flat name: ``config node.tiers.dram.bytes (dram_bytes): ...``).

Derived ports: ``server.metrics_port = -1`` (the default) becomes ``port + 1`` at
construction (it stays -1, any free port, when ``port`` is 0), so moving
``port`` moves the metrics port. ``dataclasses.replace`` keeps a resolved
value: pass ``metrics_port=-1`` again along with a new ``port`` to re-derive.
``call_port`` / ``data_port`` keep -1 and are derived by their servers (from
the bound port, with a fallback to any free port).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import socket
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.layout import KVLayout
from kvpool.worker_ids import MAX_WORKER_ID_CHARS, worker_id_problem

DEFAULT_MASTER_PORT = 7600
DEFAULT_NODE_PORT = 7610
_DERIVED_PORT = -1  # metrics_port, call_port, data_port: follow ``port`` (see the module docstring)
_MIN_DRAM_BYTES = 4 << 10
_GIB = 1 << 30
_SSD_BYTES_PER_INDEX_KEY = 64 << 10  # the arena's inventory has room for one SSD key per this much SSD
_MIN_SSD_INDEX_KEYS = 1024
_MAX_SSD_INDEX_KEYS = 1 << 20  # derived room stops here (80 MiB of /dev/shm)
_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
_MAX_SIZE = 1 << 50  # 1024 TiB: larger than any real memory or disk, a typo rather than a size
_MAX_SECONDS = 365 * 86400.0  # longer than this is a typo (and would overflow thread waits)
SIZE_SYNTAX = "bytes or with K, M, G, T (KiB, MiB, GiB, TiB), e.g. 512M"
# The reply spin saves a blocked thread's wake-up (~100-300 us on a VM) and costs a core while it polls: a reply
# slower than 2 ms would save at most ~15% of its wait by spinning, and each call would burn up to the whole spin.
MAX_SPIN_WAIT_US = 2000


def parse_size(value: object) -> int:
    """Bytes from ``4096``, ``"64K"``, ``"512M"``, ``"4G"`` or ``"4GiB"``; ValueError otherwise (negative, nan, inf)."""
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
    if not math.isfinite(amount):
        raise ValueError(f"not a size: {value!r} (use e.g. 4096, 64K, 512M, 4G)")
    if amount < 0:
        raise ValueError(f"size must not be negative: {value!r}")
    return int(amount * scale)


def format_size(n: int) -> str:
    """``2097152`` -> ``"2 MiB"``: the largest binary unit that divides ``n`` exactly (``"0"`` for 0)."""
    if n == 0:
        return "0"
    for unit, name in _SIZE_UNITS:
        if n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


Check = Callable[[Any], "str | None"]  # a field's rule: None if the value is allowed, else what is allowed


def opt(default: Any, help: str, *, size: bool = False, check: Check | None = None, flag: str = "",
        default_text: str = "", flat: str = "") -> Any:
    """A config field: its default, the help text ``--help`` shows, and its rule.

    ``size``: parsed with :func:`parse_size`. ``check``: the value rule beyond the
    field's type (None: any value of the type). ``flag``: the command-line name
    if not the field's (``ssd`` for ``ssd_enabled``: ``--ssd/--no-ssd``).
    ``default_text``: how ``--help`` states a default whose value needs words.
    ``flat``: the setting's name in flags and ``KVPOOL_*`` variables, where it
    is not the section's prefix + the field's name (``dram_bytes`` for ``tiers.dram.bytes``).
    In ``help`` and ``default_text``, ``{port}`` stands for the section's port flag.
    """
    return field(default=default, metadata={"help": help, "size": size, "check": check, "flag": flag,
                                            "default_text": default_text, "flat": flat})


# -- field rules -----------------------------------------------------------------------------------------------------

def port_check(*special: str) -> Check:
    """A TCP port 1-65535, or one of the ``special`` values written ``"0: none"``, ``"-1: any free port"``."""
    allowed = {int(s.split(":", 1)[0]) for s in special}
    words = " or ".join("{} ({})".format(*s.split(": ", 1)) for s in special)

    def check(v: int) -> str | None:
        if v in allowed or 1 <= v <= 65535:
            return None
        return "must be a port 1-65535" + (f" or {words}" if words else "")
    return check


def at_least(low: int, meaning: str = "") -> Check:
    """An integer >= ``low`` (``meaning`` says what the smallest value means, if special)."""
    def check(v: int) -> str | None:
        return None if v >= low else f"must be >= {low}" + (f" ({meaning})" if meaning else "")
    return check


def in_range(low: int, high: int, meaning: str = "") -> Check:
    """An integer in [``low``, ``high``] (``meaning`` says what the smallest value means, if special)."""
    def check(v: int) -> str | None:
        return None if low <= v <= high else f"must be {low} to {high}" + (f" ({meaning})" if meaning else "")
    return check


def size_check(low: int, meaning: str = "") -> Check:
    """A byte size in [``low``, _MAX_SIZE]; ``meaning`` says what 0 means where ``low`` is 0."""
    def check(v: int) -> str | None:
        if low <= v <= _MAX_SIZE:
            return None
        if low == 0:
            return f"must be 0 ({meaning}) or a size up to {format_size(_MAX_SIZE)}"
        return f"must be a size of {format_size(low)} to {format_size(_MAX_SIZE)}"
    return check


def seconds_check(v: float) -> str | None:
    """A duration: finite, > 0 and at most _MAX_SECONDS."""
    return None if 0 < v <= _MAX_SECONDS else f"must be a number of seconds > 0 and at most {_MAX_SECONDS:.0f} (a year)"


def fraction_check(v: float) -> str | None:
    """A fraction in (0, 1]."""
    return None if 0 < v <= 1 else "must be a fraction in (0, 1]"


def _split_address(v: str) -> tuple[str, int] | None:
    host, sep, port = v.rpartition(":")
    if not sep or not host.strip() or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in v):
        return None
    return host, int(port)


def address_check(optional: bool) -> Check:
    """``host:port`` with a port 1-65535 (or empty, if ``optional``)."""
    def check(v: str) -> str | None:
        if (optional and v == "") or _split_address(v) is not None:
            return None
        return "must be host:port with a port 1-65535" + (", or empty" if optional else "")
    return check


def _refusal(parse: Callable[[str], object], v: str) -> str | None:
    """What ``parse`` says is wrong with ``v`` (its ValueError), or None."""
    try:
        parse(v)
    except ValueError as exc:
        return str(exc)
    return None


def master_target_check(v: str) -> str | None:
    """A master to follow: ``host:port``, or ``etcd://HOST:PORT[,HOST:PORT]/CLUSTER`` (the leader etcd names)."""
    from kvpool.etcd import EtcdTarget

    if v.startswith("etcd://"):
        return _refusal(EtcdTarget.parse, v)
    if _split_address(v) is not None:
        return None
    return "must be host:port with a port 1-65535, or etcd://HOST:PORT[,HOST:PORT]/CLUSTER"


def etcd_check(v: str) -> str | None:
    """Empty, or etcd endpoints ``[http[s]://]host:port[,...]``."""
    from kvpool.etcd import parse_endpoints

    return None if v == "" else _refusal(parse_endpoints, v)


_ETCD_HELP = {  # the settings master, node and client share to talk to etcd (kvpool.etcd.EtcdAccess)
    "etcd_ca": "PEM CA certificate to verify etcd with: talk to etcd over TLS (https://); empty: plain HTTP/2",
    "etcd_cert": "PEM client certificate to present to etcd (its --client-cert-auth), with etcd_key; needs etcd_ca",
    "etcd_key": "PEM private key of etcd_cert",
    "etcd_user": "etcd user, when etcd has authentication on (with etcd_password_file); docs/operations.md says "
                 "which role it needs",
    "etcd_password_file": "file holding etcd_user's password on one line (closed to other users); read at start. "
                          "Never the password itself",
}


def etcd_opt(name: str) -> Any:
    """One of the ``etcd_*`` settings (the same in every section that talks to etcd)."""
    return opt("", _ETCD_HELP[name])


def _check_etcd_access(config: Any, section: str, endpoints: str = "") -> None:
    """The ``etcd_*`` settings agree with each other and with the scheme of ``endpoints`` (the master's ``etcd``:
    https:// needs etcd_ca, http:// refuses it). The files are read at start (:class:`kvpool.etcd.EtcdAccess`)."""
    from kvpool.etcd import endpoints_tls

    scheme_tls = endpoints_tls(endpoints) if endpoints else None
    if bool(config.etcd_cert) != bool(config.etcd_key):
        raise ValueError(f"config {section}.etcd_cert and etcd_key: set both or neither "
                         f"(got etcd_cert={config.etcd_cert!r}, etcd_key={config.etcd_key!r})")
    if config.etcd_cert and not config.etcd_ca:
        raise ValueError(f"config {section}.etcd_cert: a client certificate needs TLS: set etcd_ca too")
    if bool(config.etcd_user) != bool(config.etcd_password_file):
        raise ValueError(f"config {section}.etcd_user and etcd_password_file: set both or neither "
                         f"(got etcd_user={config.etcd_user!r}, etcd_password_file={config.etcd_password_file!r})")
    if scheme_tls is True and not config.etcd_ca:
        raise ValueError(f"config {section}.etcd: https:// endpoints need etcd_ca (the CA that signed etcd's "
                         "certificate)")
    if scheme_tls is False and config.etcd_ca:
        raise ValueError(f"config {section}.etcd: http:// endpoints, but etcd_ca is set (TLS): use https:// or "
                         "no scheme")


def zmq_endpoint_check(v: str) -> str | None:
    """Empty, or a ZMQ endpoint to bind: ``tcp://HOST:PORT`` (port 0: any free one) or ``ipc://PATH``."""
    if v == "" or (v.startswith("ipc://") and len(v) > 6):
        return None
    host, sep, port = v[6:].rpartition(":") if v.startswith("tcp://") else ("", "", "")
    if not sep or not host or not port.isdigit() or int(port) > 65535 or any(c.isspace() for c in v):
        return "must be tcp://HOST:PORT (port 0-65535, 0: any free one) or ipc://PATH"
    return None


def topic_check(v: str) -> str | None:
    """A ZMQ topic prefix: 1-128 letters, digits, '.', '_', '-', '/'."""
    if re.fullmatch(r"[A-Za-z0-9._/-]{1,128}", v):
        return None
    return "must be 1-128 letters, digits, '.', '_', '-', '/'"


def cluster_check(v: str) -> str | None:
    from kvpool.etcd import check_cluster

    return _refusal(check_cluster, v)


def shard_count_check(v: int) -> str | None:
    """A cluster's index shard count: 1 to :data:`kvpool.shards.MAX_SHARDS`."""
    from kvpool.shards import MAX_SHARDS

    return None if 1 <= v <= MAX_SHARDS else f"must be 1 to {MAX_SHARDS}"


def _check_shards(config: Any, section: str) -> None:
    """``shard`` is one of the ``shards``; more than one shard needs etcd (the shard map and each shard's leader
    live there)."""
    if not 0 <= config.shard < config.shards:
        raise ValueError(f"config {section}.shard: {config.shard} is not a shard of {config.shards} "
                         f"(use 0 to {config.shards - 1})")
    if config.shards > 1 and not config.etcd:
        raise ValueError(f"config {section}.shards: {config.shards} index shards need etcd (set etcd: each shard's "
                         "masters elect their leader there, and the shard map lives there)")


def host_check(v: str) -> str | None:
    """A listen address: a host name or IP, no spaces (empty or 0.0.0.0: all interfaces)."""
    return "must be a host name or IP address without spaces" if any(c.isspace() for c in v) else None


def worker_id_check(v: str) -> str | None:
    """Empty (derived) or a worker id :mod:`kvpool.worker_ids` allows."""
    return None if v == "" else worker_id_problem(v)


def nonempty_check(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def arena_name_check(v: str) -> str | None:
    """Empty (derived from the port) or a plain /dev/shm file name (see :func:`kvpool.tiers.arena.shm_path`)."""
    if v == "":
        return None
    from kvpool.tiers.arena import shm_path

    try:
        shm_path(v)
    except ValueError:
        return "must be empty or a /dev/shm name of 1-200 letters, digits, '_', '-', '.'"
    return None


def ssd_index_keys_check(v: int) -> str | None:
    """0 (derived from ssd_bytes) or a count of SSD keys an arena's inventory can have room for."""
    from kvpool.tiers.arena import MAX_SSD_KEYS

    return None if 0 <= v <= MAX_SSD_KEYS else f"must be 0 (automatic) to {MAX_SSD_KEYS}"


def arena_mode_check(v: str) -> str | None:
    """Octal, read-write for the owner, at most read-write for the group, nothing for others."""
    try:
        mode = int(v, 8)
    except ValueError:
        return "must be an octal mode like 0600 or 0660"
    if mode & ~0o660 or mode & 0o600 != 0o600:
        return ("must be 0600 or 0660: the owner needs read-write and only the group may be added; "
                "other users never map the arena (docs/security.md)")
    return None


_DEVICE = re.compile(r"cpu|(cuda|npu)(:\d+)?")  # the forms kvpool.client.devices.resolve_device accepts


def device_check(v: str) -> str | None:
    return None if _DEVICE.fullmatch(v) else "must be cpu, cuda, cuda:N, npu or npu:N"


# -- the checks every dataclass runs -------------------------------------------------------------------------------

def _type_problem(f: dataclasses.Field, value: Any) -> str | None:
    section = f.metadata.get("section")
    if section is not None:
        return None if isinstance(value, section) else f"expected a {section.__name__}"
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind == "bool":
        return None if isinstance(value, bool) else "expected true or false"
    if kind == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "expected a number"
        return None if math.isfinite(value) else "expected a finite number"
    if kind == "str":
        return None if isinstance(value, str) else "expected a string"
    if kind == "KVLayout | None":
        return None if value is None or isinstance(value, KVLayout) else "expected a KVLayout or none"
    raise AssertionError(f"config: no check for field type {kind} of {f.name}")


def _fail(section: str, name: str, problem: str, value: Any) -> ValueError:
    return ValueError(f"config {section}.{name}: {problem} (got {value!r})")


def _check_types(config: Any, section: str) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        problem = _type_problem(f, value)
        if problem:
            raise _fail(section, f.name, problem, value)


def _check_values(config: Any, section: str) -> None:
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        value = getattr(config, f.name)
        problem = check(value) if check is not None else None
        if problem:
            raise _fail(section, f.name, problem, value)


def _derive_metrics_port(config: Any, section: str) -> None:
    """``metrics_port = -1`` becomes ``port + 1`` (stays -1, any free port, when ``port`` is 0)."""
    if config.metrics_port == _DERIVED_PORT and 0 < config.port <= 65535:  # a bad port is reported as such
        if config.port + 1 > 65535:
            raise ValueError(f"config {section}.metrics_port: the default, port + 1, is no port for port "
                             f"{config.port}; set metrics_port")
        object.__setattr__(config, "metrics_port", config.port + 1)


def _check_distinct_ports(config: Any, section: str, names: tuple[str, ...]) -> None:
    """The fixed ports one server binds (its ``port`` or ``server`` section's ports, and any of ``names`` > 0) all
    differ."""
    server = getattr(config, "server", config)
    ports = {"port": server.port} if server is config else {
        "server.port": server.port, "server.metrics_port": server.metrics_port}
    ports.update({name: getattr(config, name) for name in names})
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port > 0:
            if port in seen:
                raise ValueError(f"config {section}.{name}: {port} is also {section}.{seen[port]}; "
                                 "each listener needs its own port")
            seen[port] = name


# -- the sections ----------------------------------------------------------------------------------------------------

_METRICS_PORT_HELP = "HTTP /metrics port; 0: none; -1: {port} + 1, or any free port if {port} is 0"


def section(cls: type, prefix: str = "", **defaults: Any) -> Any:
    """A nested section of a config: a frozen dataclass ``cls``, built with ``defaults`` over its own.

    Its fields' flag and ``KVPOOL_*`` names are ``prefix`` + field name unless
    a field says its own (``opt(flat=...)``): flags and variables stay flat
    while JSON nests (:func:`settings`)."""
    return field(default_factory=lambda: cls(**defaults),
                 metadata={"section": cls, "prefix": prefix, "defaults": defaults})


def _check_section(config: Any) -> None:
    """A section's own checks (types, value rules), naming fields by the section's ``_LABEL``."""
    _check_types(config, config._LABEL)
    _check_values(config, config._LABEL)


@dataclass(frozen=True)
class ServerConfig:
    """Where a master or node listens and what it lets callers ask of it (section ``server``).

    ``metrics_port`` -1 is resolved here: ``port + 1`` (stays -1, any free port, when ``port`` is 0)."""

    _LABEL = "server"
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: all interfaces)", check=host_check)
    port: int = opt(0, "gRPC port; 0: any free port", check=port_check("0: any free port"))
    metrics_port: int = opt(_DERIVED_PORT, _METRICS_PORT_HELP, check=port_check("0: none", "-1: port + 1"),
                            default_text="{port} + 1")
    max_keys_per_call: int = opt(65536, "largest key batch one call (gRPC, fast call or bulk) may carry; clients "
                                        "read it from Info and split larger batches", check=at_least(1))
    max_connections: int = opt(64, "most TCP connections of the fast-call (and, on a node, bulk) listener at once; "
                                   "more are refused", check=at_least(1))
    max_concurrent_rpcs: int = opt(0, "most gRPC calls in flight at once; more get RESOURCE_EXHAUSTED; 0: no limit",
                                   check=at_least(0, "0: no limit"))
    auth_file: str = opt("", "JSON file of secret, node tokens and client tokens/tenants/quotas (the master's "
                             "file; docs/security.md); empty: no authentication")

    def __post_init__(self) -> None:
        _check_types(self, self._LABEL)
        _derive_metrics_port(self, self._LABEL)
        _check_values(self, self._LABEL)
        _check_distinct_ports(self, self._LABEL, ("metrics_port",))


@dataclass(frozen=True)
class TlsConfig:
    """Serving over TLS (section ``tls``): both files or neither."""

    _LABEL = "tls"
    cert: str = opt("", "PEM certificate chain: serve gRPC and the TCP listeners over TLS only (with tls_key)",
                    flat="tls_cert")
    key: str = opt("", "PEM private key of tls_cert", flat="tls_key")

    def __post_init__(self) -> None:
        _check_section(self)
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"config tls.cert and tls.key: set both or neither (got tls_cert={self.cert!r}, "
                             f"tls_key={self.key!r})")


@dataclass(frozen=True)
class EventsConfig:
    """The master's KV event stream, vLLM's format (section ``events``; docs/routing.md)."""

    _LABEL = "events"
    endpoint: str = opt("", "ZMQ PUB endpoint of the KV event stream, e.g. tcp://0.0.0.0:7605; empty: no events",
                        check=zmq_endpoint_check)
    replay_endpoint: str = opt("", "ZMQ ROUTER endpoint that replays buffered event batches from a sequence number; "
                                   "empty: no replay", check=zmq_endpoint_check)
    topic: str = opt("kvpool", "topic prefix: pool batches go out as TOPIC/pool, a worker's HBM batches as "
                               "TOPIC/hbm/WORKER (with auth_file: TOPIC/TENANT/pool, TOPIC/TENANT/hbm/WORKER)",
                     check=topic_check)
    buffer: int = opt(10_000, "event batches kept for replay (split evenly among tenants)", check=at_least(1))
    buffer_bytes: int = opt(64 << 20, "bytes of event batches kept for replay (split evenly among tenants)",
                            size=True, check=size_check(1 << 20))
    max_queue: int = opt(10_000, "event batches waiting to be sent before new ones are dropped (and counted: a gap "
                                 "in the sequence)", check=at_least(1))
    subscriber_bytes: int = opt(32 << 20, "bytes of batches queued to a subscriber that does not keep up before it "
                                          "loses new ones (batches of at most 64 KiB; one copy shared by all "
                                          "subscribers)", size=True, check=size_check(1 << 20))
    max_connections: int = opt(256, "most connections on each KV event port; more are closed at once",
                               check=at_least(1))
    max_connections_per_peer: int = opt(32, "most connections from one address on each KV event port",
                                        check=at_least(1))
    max_replays: int = opt(8, "replays served at once (4 times as many may wait); more requests are refused",
                           check=at_least(1))
    max_replays_per_peer: int = opt(2, "replays one address may have served or waiting", check=at_least(1))

    def __post_init__(self) -> None:
        _check_section(self)


@dataclass(frozen=True)
class DramConfig:
    """The node's DRAM tier: its shared-memory arena (section ``tiers.dram``)."""

    _LABEL = "tiers.dram"
    bytes: int = opt(0, "size of the DRAM arena; 0: a quarter of available memory, at most 8 GiB and half of "
                        "/dev/shm's free space", size=True, check=size_check(0, "automatic"), flat="dram_bytes")
    max_block_bytes: int = opt(64 << 20, "largest block the DRAM tier takes; blocks of any size up to it share the "
                                         "arena (larger ones live on SSD only)", size=True, check=size_check(1))
    slots: int = opt(0, "most blocks the DRAM arena can describe (one 72-byte row each, beside dram_bytes); 0: one "
                        "per 4 KiB of dram_bytes, 1024 to 16 Mi", check=at_least(0, "0: automatic"),
                     flat="dram_slots")
    arena: str = opt("", "/dev/shm name of the DRAM arena (letters, digits, '_', '-', '.'); empty: kvpool-<port>",
                     check=arena_name_check)
    arena_mode: str = opt("0600", "permissions (octal) of the DRAM arena in /dev/shm: 0600 this user only, 0660 also "
                                  "its group; whoever can map it reads every block (docs/security.md)",
                          check=arena_mode_check)
    high_watermark: float = opt(1.0, "DRAM usage fraction that starts eviction (demotion to SSD); "
                                     "0 < low_watermark <= high_watermark <= 1", check=fraction_check)
    low_watermark: float = opt(1.0, "DRAM usage fraction eviction brings usage down to; 1: evict only what each put "
                                    "needs (an exact LRU; a gap only costs hit rate, docs/benchmarks.md)",
                               check=fraction_check)
    lease_timeout_s: float = opt(5.0, "a same-host writer's reserved DRAM slots return to the pool this long after "
                                      "Reserve unless committed", check=seconds_check)

    def __post_init__(self) -> None:
        _check_section(self)
        if self.low_watermark > self.high_watermark:
            raise ValueError(f"config tiers.dram.low_watermark: must be <= high_watermark {self.high_watermark} "
                             f"(got {self.low_watermark})")
        if self.bytes and self.bytes < _MIN_DRAM_BYTES:
            raise ValueError(f"config tiers.dram.bytes: {format_size(self.bytes)} is below the least DRAM tier, "
                             f"{format_size(_MIN_DRAM_BYTES)}; set more, or 0 (automatic)")


@dataclass(frozen=True)
class SsdConfig:
    """The node's SSD tier: LMDB in a directory (section ``tiers.ssd``)."""

    _LABEL = "tiers.ssd"
    enabled: bool = opt(True, "keep an SSD tier (LMDB in ssd_dir) behind DRAM; off: DRAM only", flag="ssd")
    dir: str = opt("./kvpool-data", "directory of the SSD tier (LMDB)")
    bytes: int = opt(0, "capacity of the SSD tier; 0: half the free disk at ssd_dir, at most 64 GiB", size=True,
                     check=size_check(0, "automatic"))
    index_keys: int = opt(0, "room for SSD keys in the inventory the arena publishes to same-host readers (beside "
                             "one per DRAM slot; 40-80 bytes of /dev/shm each); 0: one per 64 KiB of ssd_bytes, "
                             "1024 to 1 Mi (at most 80 MiB); a node holding more keys than its inventory has room "
                             "for makes same-host lookups ask the master", check=ssd_index_keys_check)
    optional: bool = opt(False, "if the SSD directory cannot be used, start with DRAM only (logged and counted) "
                                "instead of refusing to start")
    sync: bool = opt(False, "fsync every SSD commit; off: a power loss may lose recent entries, as a cache may "
                            "(docs/architecture.md)")
    sync_interval_s: float = opt(30.0, "with ssd_sync off: fsync the SSD tier this often (a power loss loses at most "
                                       "this much; each sync also checks data.mdb is intact)", check=seconds_check)

    def __post_init__(self) -> None:
        _check_section(self)
        if self.enabled and not self.dir.strip():
            raise ValueError("config tiers.ssd.dir: must not be empty while enabled (got '')")


@dataclass(frozen=True)
class TiersConfig:
    """The node's tiers and how blocks move between them (section ``tiers``)."""

    _LABEL = "tiers"
    dram: DramConfig = section(DramConfig)
    ssd: SsdConfig = section(SsdConfig, "ssd_")
    write_through: bool = opt(False, "write every block to SSD at once, not only on eviction")
    demote_queue_bytes: int = opt(256 << 20, "write-back: DRAM's evicted blocks are written to SSD in the background, "
                                             "at most this many bytes queued; 0: inline, in the evicting call",
                                  size=True, check=size_check(0, "inline"))

    def __post_init__(self) -> None:
        _check_section(self)


@dataclass(frozen=True)
class MasterConfig:
    """The Master Service. Valid once constructed (module docstring)."""

    _LABEL = "master"
    server: ServerConfig = section(ServerConfig, port=DEFAULT_MASTER_PORT)
    tls: TlsConfig = section(TlsConfig, "tls_")
    events: EventsConfig = section(EventsConfig, "kv_events_")
    call_port: int = opt(_DERIVED_PORT, "TCP port of the fast-call listener (Lookup, PlaceBlocks, ... as framed TCP); "
                                       "0: any free port; -1: {port} + 2, or any free port if that is taken or "
                                       "{port} is 0",
                         check=port_check("0: any free port", "-1: port + 2"), default_text="{port} + 2")
    call_poll_us: int = opt(100, "how long the fast-call loop polls for the next request before it blocks, while "
                                 "such polls pay (a blocked loop's wake-up can cost more than a small call; after a "
                                 "poll that went unanswered it blocks at once for a while, up to 64 waits); 0: block "
                                 f"at once; at most {MAX_SPIN_WAIT_US}",
                            check=in_range(0, MAX_SPIN_WAIT_US, "0: block at once"))
    node_timeout_s: float = opt(10.0, "a node silent this long is dropped with all its entries (time the master "
                                      "itself did not run is not counted); 10 heartbeats, so a busy host keeps its "
                                      "node", check=seconds_check)
    heartbeat_interval_s: float = opt(1.0, "how often nodes heartbeat (told to them when they register)",
                                      check=seconds_check)
    worker_timeout_s: float = opt(60.0, "a worker silent this long loses its HBM entries", check=seconds_check)
    max_workers_per_tenant: int = opt(1024, "most workers (clients reporting HBM or looking up, by worker id) the "
                                            "master tracks per tenant (auth off: in all); a new one past it is "
                                            "refused until one times out (worker_timeout_s)", check=at_least(1))
    max_hbm_keys_per_worker: int = opt(1 << 18, "most HBM block keys the master keeps for one worker (routing "
                                                "scores, GPU events; ~120 bytes each); keys reported past it are "
                                                "not kept (counted: a Score then under-counts)", check=at_least(1))
    max_hbm_keys_per_tenant: int = opt(1 << 24, "most HBM block keys the master keeps for all of one tenant's "
                                                "workers together (auth off: in all); past it as above",
                                       check=at_least(1))
    etcd: str = opt("", "etcd endpoints [http[s]://]host:port[,...]: stand by, and lead while this master holds the "
                        "cluster's leader key (docs/operations.md); empty: a single master, always leading",
                    check=etcd_check)
    cluster: str = opt("kvpool", "cluster name: masters of one cluster elect one leader; nodes and clients follow "
                                 "it as etcd://ETCD/CLUSTER", check=cluster_check)
    leader_ttl_s: int = opt(5, "etcd lease of the leader key, whole seconds (>= 2): a killed leader is replaced "
                               "about this long after its last renewal", check=at_least(2))
    warm_standby: bool = opt(True, "a standby follows its leader's accepted changes and, elected, leads with its index "
                                   "(lookups hit at once; nodes re-sync in the background); off: it starts empty "
                                   "and waits for every node's full report (not with TLS or KV events: cold)")
    follow_log_bytes: int = opt(256 << 20, "the leader keeps its latest accepted changes up to about this many bytes "
                                          "for warm standbys to follow (~50 bytes a reported key); a standby "
                                          "further behind takes a snapshot again", size=True, check=size_check(1))
    etcd_ca: str = etcd_opt("etcd_ca")
    etcd_cert: str = etcd_opt("etcd_cert")
    etcd_key: str = etcd_opt("etcd_key")
    etcd_user: str = etcd_opt("etcd_user")
    etcd_password_file: str = etcd_opt("etcd_password_file")
    advertise_host: str = opt("", "host nodes and clients dial this master at, as put in etcd; empty: host (the "
                                  "machine's name if host is 0.0.0.0)", check=host_check)
    shards: int = opt(1, "index shards of the cluster (kvpool.shards, docs/operations.md): the key space is cut into "
                         "this many, each owned by its own master group; > 1 needs etcd, and every master of the "
                         "cluster must say the same count", check=shard_count_check)
    shard: int = opt(0, "the index shard this master's group owns, 0 to shards - 1", check=at_least(0))

    def __post_init__(self) -> None:
        _check_types(self, "master")
        _check_values(self, "master")
        _check_distinct_ports(self, "master", ("call_port",))
        _check_etcd_access(self, "master", self.etcd)
        _check_shards(self, "master")

    @classmethod
    def of(cls, **flat: Any) -> MasterConfig:
        """A config from settings by their flag names (``port=0, tls_cert=...``): :func:`make_section`."""
        config: MasterConfig = make_section("master", flat)
        return config


@dataclass(frozen=True)
class NodeConfig:
    """A pool node: the DRAM arena and SSD store of one host. Valid once constructed (module docstring)."""

    _LABEL = "node"
    master: str = opt(f"127.0.0.1:{DEFAULT_MASTER_PORT}", "the master's host:port, or etcd://HOST:PORT/CLUSTER to "
                      "follow the leader etcd names", check=master_target_check)
    server: ServerConfig = section(ServerConfig, port=DEFAULT_NODE_PORT)
    tls: TlsConfig = section(TlsConfig, "tls_")
    tiers: TiersConfig = section(TiersConfig)
    data_port: int = opt(_DERIVED_PORT, "bulk TCP port for remote reads and writes; 0: any free port; -1: {port} + 2, "
                                       "or any free port if that is taken or {port} is 0",
                         check=port_check("0: any free port", "-1: port + 2"), default_text="{port} + 2")
    advertise: str = opt("", "host:port clients dial; empty: host:port (this machine's name if host is 0.0.0.0)",
                         check=address_check(True))
    node_id: str = opt("", "this node's name in the cluster; empty: <hostname>:<port>")
    max_message_bytes: int = opt(256 << 20, "largest gRPC message, fast-call body or bulk PUT the node accepts",
                                 size=True, check=size_check(1))
    token: str = opt("", "this node's token for the master (one of the auth file's node_tokens)")
    tls_ca: str = opt("", "PEM CA certificate to verify the master with: dial it over TLS")
    etcd_ca: str = etcd_opt("etcd_ca")
    etcd_cert: str = etcd_opt("etcd_cert")
    etcd_key: str = etcd_opt("etcd_key")
    etcd_user: str = etcd_opt("etcd_user")
    etcd_password_file: str = etcd_opt("etcd_password_file")

    def __post_init__(self) -> None:
        _check_types(self, "node")
        _check_values(self, "node")
        _check_distinct_ports(self, "node", ("data_port",))
        _check_etcd_access(self, "node")

    @classmethod
    def of(cls, **flat: Any) -> NodeConfig:
        """A config from settings by their flag names (``port=0, dram_bytes=...``): :func:`make_section`."""
        config: NodeConfig = make_section("node", flat)
        return config

    def resolved_node_id(self) -> str:
        return self.node_id or f"{socket.gethostname()}:{self.server.port}"

    def resolved_advertise(self) -> str:
        return self.advertise or f"{self.server.host}:{self.server.port}"

    def resolved_arena(self) -> str:
        return self.tiers.dram.arena or f"kvpool-{self.server.port}"

    def resolved_arena_mode(self) -> int:
        """``arena_mode`` as a number (always valid: checked at construction)."""
        return int(self.tiers.dram.arena_mode, 8)

    def resolved_dram_bytes(self) -> int:
        """The configured DRAM size, or a quarter of available memory (at most 8 GiB, half of /dev/shm's free space)."""
        if self.tiers.dram.bytes:
            return self.tiers.dram.bytes
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else available
        auto = min(available // 4, 8 * _GIB, shm_free // 2)
        return max(_MIN_DRAM_BYTES, auto // _MIN_DRAM_BYTES * _MIN_DRAM_BYTES)

    def resolved_ssd_index_keys(self) -> int:
        """Room for SSD keys in the arena's inventory: 0 without an SSD tier, else the configured or derived count."""
        ssd = self.tiers.ssd
        if not ssd.enabled:
            return 0
        if ssd.index_keys:
            return ssd.index_keys
        try:
            derived = self.resolved_ssd_bytes() // _SSD_BYTES_PER_INDEX_KEY
        except OSError:  # the SSD directory cannot be looked at: opening it will say why
            derived = 0
        return max(_MIN_SSD_INDEX_KEYS, min(_MAX_SSD_INDEX_KEYS, derived))

    def resolved_ssd_bytes(self) -> int:
        """The configured SSD size, or half the free disk at ssd_dir capped at 64 GiB."""
        if self.tiers.ssd.bytes:
            return self.tiers.ssd.bytes
        probe = self.tiers.ssd.dir
        while not os.path.exists(probe):
            probe = os.path.dirname(os.path.abspath(probe))
        return max(64 << 20, min(shutil.disk_usage(probe).free // 2, 64 * _GIB))


@dataclass(frozen=True)
class ClientConfig:
    """The client library inside an inference worker. Valid once constructed (module docstring)."""

    master: str = opt(f"127.0.0.1:{DEFAULT_MASTER_PORT}", "the master's host:port, or etcd://HOST:PORT/CLUSTER to "
                      "follow the leader etcd names (each index shard's, for a sharded cluster)",
                      check=master_target_check)
    worker_id: str = opt("", f"this worker's name (1-{MAX_WORKER_ID_CHARS} characters, no control characters); "
                             "empty: <hostname>-<pid>", check=worker_id_check)
    model: str = opt("default", "model id: part of every block key's namespace", check=nonempty_check)
    tenant: str = opt("", "salt: tenants never share keys")
    layout: KVLayout | None = opt(None, "the engine's KV layout (needed for the HBM tier and adapters)")
    hbm_blocks: int = opt(0, "HBM tier size in blocks; 0: no HBM tier in the client", check=at_least(0, "0: none"))
    device: str = opt("cpu", "HBM tier device: cpu, cuda, cuda:N, npu, npu:N", check=device_check)
    lookup_timeout_s: float = opt(0.5, "deadline of a master call; past it the lookup is a miss", check=seconds_check)
    io_timeout_s: float = opt(5.0, "deadline of a node data call; past it the blocks are misses", check=seconds_check)
    spin_wait_us: int = opt(300, "poll this long for a master or node reply before blocking on it (a blocked "
                            "thread's wake-up can cost more than a small call; one thread of a process polls at a "
                            "time, the others block; after a poll that went unanswered, a loaded peer's, that peer is "
                            "not polled for a while, up to 64 calls); 0: block at once; at most "
                            f"{MAX_SPIN_WAIT_US} (never past the call's deadline)",
                            check=in_range(0, MAX_SPIN_WAIT_US, "0: block at once"))
    put_queue_bytes: int = opt(1 << 30, "write-behind bound in bytes; a full queue drops new puts (counted)", size=True,
                               check=size_check(1))
    shared_memory: bool = opt(True, "read same-host nodes' DRAM arena directly (needs permission to map it)")
    token: str = opt("", "this client's token (one of the auth file's clients); empty: none")
    tls_ca: str = opt("", "PEM CA certificate to verify the master and nodes with: dial them over TLS")
    etcd_ca: str = etcd_opt("etcd_ca")
    etcd_cert: str = etcd_opt("etcd_cert")
    etcd_key: str = etcd_opt("etcd_key")
    etcd_user: str = etcd_opt("etcd_user")
    etcd_password_file: str = etcd_opt("etcd_password_file")
    strict: bool = opt(False, "raise a pool fault (PoolFault) on the call that met it, instead of only counting it "
                              "and answering a miss: for a caller that must tell a fault from a miss (the vLLM "
                              "connector's scheduler sets it on its own client, to pause lookups during an outage); "
                              "off for an engine's data path, where a fault must cost only a recompute")
    metrics_port: int = opt(0, "HTTP /metrics port; 0: no endpoint (the registry is still available)",
                            check=port_check("0: none"))

    def __post_init__(self) -> None:
        _check_types(self, "client")
        _check_values(self, "client")
        _check_etcd_access(self, "client")

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PoolConfig:
    """Everything one JSON file can say."""

    master: MasterConfig = field(default_factory=MasterConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    client: ClientConfig = field(default_factory=ClientConfig)


_SECTIONS: dict[str, type] = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig}
_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_flag(word: str) -> bool:
    """An on/off setting written as text (``KVPOOL_*`` variables, config files): 1/true/yes/on or 0/false/no/off,
    any case; ValueError otherwise."""
    flag = _FLAG_WORDS.get(word.strip().lower())
    if flag is None:
        raise ValueError("expected true or false")
    return flag


def _number(kind: type[int] | type[float], value: int | float | str, problem: str) -> Any:
    """``kind(value)``, or ValueError(``problem``): Python's own message repeats the value, which the caller adds."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(problem) from None


def _coerce(where: str, f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if f.metadata.get("size"):
        try:
            return parse_size(value)
        except ValueError as exc:  # parse_size names the value itself: once is enough
            raise ValueError(f"config {where}: {exc}") from None
    try:
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
            if not isinstance(value, str):
                raise ValueError("expected true or false")
            return parse_flag(value)
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError("expected an integer")
            return _number(int, value, "expected an integer")
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError("expected a number")
            return _number(float, value, "expected a number")
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"config {where}: {exc} (got {value!r})") from None
    raise AssertionError(f"config: no coercion for field type {kind} of {where}")


_REPLACED = {  # fields of earlier versions: what replaced them, said instead of "unknown"
    ("node", "slot_bytes"): "DRAM takes blocks of any size now; max_block_bytes (default 64 MiB) is the largest",
}


@dataclass(frozen=True)
class Setting:
    """One setting of a component: its flag/variable ``name``, its ``path`` in the nested config and JSON
    (``("tiers", "dram", "bytes")``), its field and its default."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    default: Any

    @property
    def where(self) -> str:
        return ".".join(self.path)


def _walk(cls: type, path: tuple[str, ...], prefix: str, defaults: Any) -> list[Setting]:
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        if sub is not None:
            out += _walk(sub, (*path, f.name), f.metadata["prefix"], getattr(defaults, f.name))
        else:
            name = f.metadata.get("flat") or prefix + f.name
            out.append(Setting(name, (*path, f.name), f, getattr(defaults, f.name)))
    return out


_SETTINGS: dict[str, dict[str, Setting]] = {}


def settings(section: str) -> dict[str, Setting]:
    """The settings of ``section`` (master, node, client) by flag/variable name, in field order."""
    if section not in _SETTINGS:
        cls = _SECTIONS[section]
        _SETTINGS[section] = {s.name: s for s in _walk(cls, (), "", cls())}
    return _SETTINGS[section]


def _build(cls: type, given: Mapping[str, Any], component: str, defaults: Mapping[str, Any]) -> Any:
    """``cls`` from the coerced values ``given`` (nested dicts for sections) over ``defaults``; a nested section's
    ValueError names the field from the component down (``config node.tiers.dram.bytes``)."""
    values = dict(defaults)
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        if sub is not None and f.name in given:
            values[f.name] = _build(sub, given[f.name], component, f.metadata["defaults"])
        elif f.name in given:
            values[f.name] = given[f.name]
    try:
        return cls(**values)
    except ValueError as exc:
        text = str(exc)
        nested = cls not in _SECTIONS.values()
        if nested and text.startswith("config ") and not text.startswith(f"config {component}."):
            raise ValueError(f"config {component}.{text[len('config '):]}") from None
        raise


def make_section(section: str, values: Mapping[str, Any]) -> Any:
    """A component's config from settings named as flags and variables name them (``dram_bytes``), over the
    defaults; ValueError on unknown settings or bad values.

    Built in one construction (not a ``replace`` of the defaults), so derived
    ports follow the given ``port``.
    """
    cls = _SECTIONS.get(section)
    if cls is None:
        raise ValueError(f"unknown config section {section!r}; known: {', '.join(_SECTIONS)}")
    table = settings(section)
    unknown = sorted(set(values) - set(table))
    for name in unknown:
        if (section, name) in _REPLACED:
            raise ValueError(f"config {section}.{name} is gone: {_REPLACED[section, name]}")
    if unknown:
        raise ValueError(f"unknown {section} setting(s): {', '.join(unknown)}; known: {', '.join(table)}")
    nested: dict[str, Any] = {}
    try:
        for name, value in values.items():
            s = table[name]
            level = nested
            for part in s.path[:-1]:
                level = level.setdefault(part, {})
            level[s.path[-1]] = _coerce(f"{section}.{s.where}", s.field, value)
        return _build(cls, nested, section, {})
    except ValueError as exc:
        raise ValueError(_name_the_setting(section, str(exc))) from None


def _name_the_setting(section: str, text: str) -> str:
    """``text`` with the flag/variable name of the nested setting it starts with added: ``config
    node.tiers.dram.bytes (dram_bytes): ...``, so whoever set ``--dram-bytes`` finds it."""
    found = re.match(rf"config {section}\.([\w.]+)", text)
    if found is None:
        return text
    named = next((s.name for s in settings(section).values() if s.where == found.group(1) and s.name != s.where), "")
    return f"{text[:found.end()]} ({named}){text[found.end():]}" if named else text


def _json_settings(section: str, cls: type, data: Mapping[str, Any], path: tuple[str, ...],
                   out: dict[str, Any]) -> None:
    """The settings a section's nested JSON object gives, by flag name, into ``out``; an old flat key (or one at
    the wrong level) is a ValueError naming its place."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    by_path = {s.path: s for s in settings(section).values()}
    for key, value in data.items():
        where = ".".join((section, *path, key))
        f = fields.get(key)
        if f is None:
            if not path and (section, key) in _REPLACED:
                raise ValueError(f"config {section}.{key} is gone: {_REPLACED[section, key]}")
            moved = settings(section).get(key)
            if moved is not None:
                raise ValueError(f"config {where}: this setting's place in a config file is {section}.{moved.where} "
                                 f"now (flags and KVPOOL_* variables keep the name {key})")
            raise ValueError(f"unknown config field {where}; known here: {', '.join(fields)}")
        sub = f.metadata.get("section")
        if sub is not None:
            if not isinstance(value, dict):
                raise ValueError(f"config {where}: must be an object (a section)")
            _json_settings(section, sub, value, (*path, key), out)
        else:
            out[by_path[path + (key,)].name] = value


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
    extra_sections: Collection[str] = (),
) -> PoolConfig:
    """Defaults, then the JSON file at ``path``, then ``KVPOOL_*`` variables, then ``overrides``.

    ``extra_sections`` name top-level objects of the file that an adapter reads itself (skipped here).
    """
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if path:
        data = read_json_object(os.fspath(path), "config file")
        for name, values in data.items():
            if name in extra_sections:
                continue
            if name not in _SECTIONS:
                raise ValueError(f"unknown config section {name!r} in {path}; known: {', '.join(_SECTIONS)}")
            if not isinstance(values, dict):
                raise ValueError(f"config section {name!r} in {path} must be an object")
            _json_settings(name, _SECTIONS[name], values, (), sections[name])
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
