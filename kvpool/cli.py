"""The ``kvpool`` command line: one subcommand per job; ``kvpool <cmd> --help`` documents each.

Every config field is also a flag (``--dram-bytes 4G``), generated from the
config dataclasses so that flags, JSON and ``KVPOOL_*`` variables can never
disagree. Flags beat variables, which beat the ``--config`` JSON file. On/off
fields are switch pairs (``--write-through`` / ``--no-write-through``;
``ssd_enabled`` is ``--ssd`` / ``--no-ssd``); JSON and variables keep the field
names (``KVPOOL_NODE_SSD_ENABLED=false``). ``--help`` states each flag's one
default, sizes in binary units, and its variable. ``--log-level`` goes before or
after the subcommand. A ValueError from any subcommand (bad config, a refused
start) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvpool import __version__
from kvpool.config import SIZE_SYNTAX, PoolConfig, Setting, format_size, load_config, settings

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_ETCD_FILES = ("etcd_ca", "etcd_cert", "etcd_key")  # PEM file settings (etcd_password_file ends in _file)


def _metavar(s: Setting) -> str:
    f, name = s.field, s.name
    if f.metadata.get("size"):
        return "SIZE"
    if name == "port" or name.endswith("_port"):
        return "PORT"
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_watermark"):
        return "FRACTION"
    if name in ("master", "advertise"):
        return "HOST:PORT"
    if name.endswith(("_file", "_dir")) or name.startswith("tls_") or name in _ETCD_FILES:
        return "PATH"
    if f.type in ("int", int):
        return "N"
    return name.upper()


def _shown_default(s: Setting, port_flag: str) -> str:
    """The one default ``--help`` states for setting ``s``."""
    f, value = s.field, s.default
    text = f.metadata.get("default_text", "")
    if text:
        return text.replace("{port}", port_flag)
    if isinstance(value, bool):
        return "on" if value else "off"
    if f.metadata.get("size") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g} s" if s.name.endswith("_s") else f"{value:g}"
    if value is None or value == "":
        return "empty"
    return str(value)


def _add_section_flags(parser: argparse.ArgumentParser, section: str, prefix: str = "",
                       skip: Sequence[str] = ()) -> None:
    """One flag per setting of ``section`` (``--<prefix><name>``; ``--x/--no-x`` for on/off settings).

    Each help line states the setting's one default, its place in the JSON file and its
    KVPOOL_<SECTION>_<NAME> variable; the value is left None unless given, so flags override only what they set.
    """
    group = parser.add_argument_group(
        f"{section} settings",
        f"Each flag is also a field of JSON section \"{section}\" (nested: the place shown) and the variable "
        f"shown (KVPOOL_{section.upper()}_<NAME>, on/off as true/false). SIZE: {SIZE_SYNTAX}.")
    port_flag = f"--{prefix}port"
    for s in settings(section).values():
        if s.name in skip:
            continue
        f = s.field
        flag = "--" + prefix + (f.metadata.get("flag") or s.name.replace("_", "-"))
        env = f"KVPOOL_{section.upper()}_{s.name.upper()}"
        place = f"JSON {section}.{s.where}; " if len(s.path) > 1 else ""
        help_text = f.metadata.get("help", "").replace("{port}", port_flag)
        extra = "K, M, G or T suffix, e.g. 512M; " if f.metadata.get("size") else ""
        full = f"{help_text} (default: {_shown_default(s, port_flag)}; {extra}{place}env {env})".replace("%", "%%")
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=f"{section}.{s.name}", default=None, action=argparse.BooleanOptionalAction,
                               help=full)
        else:
            group.add_argument(flag, dest=f"{section}.{s.name}", default=None, metavar=_metavar(s), help=full)


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            section, name = dest.split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def _config(args: argparse.Namespace) -> PoolConfig:
    return load_config(args.config, overrides=_overrides(args))


def _run_master(args: argparse.Namespace) -> int:
    from kvpool.master.server import run_master

    run_master(_config(args).master)
    return 0


def _run_node(args: argparse.Namespace) -> int:
    from kvpool.node.daemon import run_node

    run_node(_config(args).node)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from kvpool.serve import run_serve

    run_serve(_config(args))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from kvpool.etcd import EtcdAccess
    from kvpool.status import run_status

    client = _config(args).client
    return run_status(args.master or client.master, timeout=args.timeout, prometheus=args.prometheus,
                      token=client.token, tls_ca=client.tls_ca, etcd_access=EtcdAccess.from_config(client, "client"),
                      as_json=args.json)


def _run_route(args: argparse.Namespace) -> int:
    from kvpool.keys import KeyNamespace, chain_block_keys
    from kvpool.routing import ScoreClient, render

    client = _config(args).client
    if args.master:
        client = dataclasses.replace(client, master=args.master)
    client = dataclasses.replace(client, lookup_timeout_s=args.timeout)
    if client.layout is None:
        print("kvpool route: keys need client.layout (and client.model) in --config: the workers' own",
              file=sys.stderr)
        return 2
    text = open(args.tokens_file).read() if args.tokens_file else args.tokens
    try:
        tokens = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        print("kvpool route: tokens must be integers separated by spaces or commas", file=sys.stderr)
        return 2
    namespace = KeyNamespace(client.model, client.layout.fingerprint(), tenant=client.tenant)
    keys = chain_block_keys(tokens, client.layout.block_size, namespace)
    workers = [w for w in (args.workers or "").split(",") if w]
    with ScoreClient(client) as scores:
        score = scores.score(keys, workers)
    if score is None:
        print(f"kvpool route: cannot reach the master at {client.master}", file=sys.stderr)
        return 1
    print(render(score, client.layout.block_size))
    return 0


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool`` parser. ``--log-level`` is accepted before and after any subcommand (the later one wins)."""
    parser = argparse.ArgumentParser(prog="kvpool", description="A tiered (HBM / DRAM / SSD) KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log level (default: INFO)")
    # Subcommands take it too; SUPPRESS keeps a subcommand that is not given it from resetting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS,
                        help="log level (default: INFO)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str, run: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common])
        sub.add_argument("--config", metavar="PATH", help="kvpool JSON config file (sections master, node, client)")
        sub.set_defaults(run=run)
        return sub

    serve = command("serve", "run a whole pool on this machine: the master and one node, in one process", _run_serve)
    _add_section_flags(serve, "node", skip=("master",))
    _add_section_flags(serve, "master", prefix="master-")

    master = command("master", "run the Master Service (start it before engines and nodes)", _run_master)
    _add_section_flags(master, "master")

    node = command("node", "run a pool node: this host's DRAM arena and SSD store", _run_node)
    _add_section_flags(node, "node")

    status = command("status", "show node health, tier usage and capacity, and hit rates per tier", _run_status)
    status.add_argument("--master", help="the master's host:port, or etcd://HOST:PORT/CLUSTER for an HA cluster "
                        "(leader, standbys, etcd's health; default: the client config's)")
    status.add_argument("--timeout", type=_positive_seconds, default=3.0, metavar="SECONDS",
                        help="how long to wait for the master (default: 3 s)")
    status.add_argument("--prometheus", metavar="URL",
                        help="also show the dashboard's 5-minute hit rates and target health from this Prometheus")
    status.add_argument("--json", action="store_true",
                        help="print the same as one JSON object, for scripts (field names: docs/operations.md)")

    route_parser = command("route", "per worker, how much of a prompt's prefix it would reuse (HBM, then the pool)",
                           _run_route)
    prompt = route_parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="the prompt's token ids, separated by spaces or commas")
    prompt.add_argument("--tokens-file", metavar="PATH", help="a file of the prompt's token ids")
    route_parser.add_argument("--workers", metavar="ID[,ID...]",
                              help="workers to score (default: every worker the master knows)")
    route_parser.add_argument("--master", help="the master's host:port or etcd://HOST:PORT/CLUSTER (default: the "
                              "client config's)")
    route_parser.add_argument("--timeout", type=_positive_seconds, default=3.0, metavar="SECONDS",
                              help="how long to wait for the master (default: 3 s)")

    from kvpool import demo

    demo_parser = command("demo", "a two-round dialog with a HuggingFace model on a running pool: reuse and TTFT",
                          demo.run)
    demo.add_arguments(demo_parser)

    # an operator's tools for their own pool and traces; the lab's harnesses (engines, peers) are benchmarks/*.py
    bench = commands.add_parser("bench", help="measure the pool against this machine's limits", parents=[common])
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    from kvpool.bench import failover, fragmentation, index_scale, lru_sweep, replay, soak, tiers

    for name, module, help_text in (
        ("tiers", tiers, "DRAM and SSD put/get GB/s next to memcpy"),
        ("fragmentation", fragmentation, "DRAM under mixed block sizes: the usable fraction of its capacity"),
        ("replay", replay, "replay a Mooncake trace against a pool: hit ratio per tier"),
        ("lru-sweep", lru_sweep, "HBM + DRAM hit rate beside an exact LRU, at several DRAM capacities"),
        ("index", index_scale, "master index: lookup cost and bytes per block, 1K to 10M blocks"),
        ("failover", failover, "kill -9 of the leading master (etcd HA): seconds until lookups hit again"),
        ("soak", soak, "many clients for minutes: memory, fds and threads of every process must stay flat, no errors"),
    ):
        bench_parser = benches.add_parser(name, help=help_text, parents=[common])
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with contextlib.suppress(ValueError, OSError):  # stderr without a descriptor (captured in-process): no dump
        faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT from a native library) prints every thread's stack
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except ValueError as exc:  # bad config or flags: say what, change nothing
        print(f"kvpool {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
