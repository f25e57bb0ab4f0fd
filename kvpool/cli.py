"""The ``kvpool`` command line: one subcommand per job; ``kvpool <cmd> --help`` documents each.

Every config field is also a flag (``--dram-bytes 4G``), generated from the
config dataclasses so that flags, JSON and ``KVPOOL_*`` variables can never
disagree. Flags beat variables, which beat the ``--config`` JSON file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvpool import __version__
from kvpool.config import ClientConfig, MasterConfig, NodeConfig, PoolConfig, load_config

_SECTIONS = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig}


def _add_section_flags(parser: argparse.ArgumentParser, section: str, prefix: str = "", skip: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(f"{section} settings (JSON section \"{section}\", env KVPOOL_{section.upper()}_*)")
    for f in dataclasses.fields(_SECTIONS[section]):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        group.add_argument(flag, dest=f"{section}.{f.name}", default=None, metavar=f.name.upper(),
                           help=f"{help_text} (default: {default!r})".replace("%", "%%"))


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
    from kvpool.status import run_status

    client = _config(args).client
    return run_status(args.master or client.master, timeout=args.timeout, prometheus=args.prometheus,
                      token=client.token, tls_ca=client.tls_ca)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="A tiered (HBM / DRAM / SSD) KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str, run: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", help="kvpool JSON config file (sections master, node, client)")
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
    status.add_argument("--master", help="the master's host:port (default: the client config's)")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the master (default: 3)")
    status.add_argument("--prometheus", metavar="URL",
                        help="also show the dashboard's 5-minute hit rates and target health from this Prometheus")

    from kvpool import demo

    demo_parser = command("demo", "a two-round dialog with a HuggingFace model on a running pool: reuse and TTFT",
                          demo.run)
    demo.add_arguments(demo_parser)

    bench = commands.add_parser("bench", help="measure the pool against this machine's limits")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    from kvpool.bench import tiers

    tiers_parser = benches.add_parser("tiers", help="DRAM and SSD put/get GB/s next to memcpy")
    tiers.add_arguments(tiers_parser)
    tiers_parser.set_defaults(run=tiers.run)
    from kvpool.bench import replay

    replay_parser = benches.add_parser("replay", help="replay a Mooncake trace against a pool: hit ratio per tier")
    replay.add_arguments(replay_parser)
    replay_parser.set_defaults(run=replay.run)
    from kvpool.bench import index_scale

    index_parser = benches.add_parser("index", help="master index: lookup cost and bytes per block, 1K to 10M blocks")
    index_scale.add_arguments(index_parser)
    index_parser.set_defaults(run=index_scale.run)
    from kvpool.bench import soak

    soak_parser = benches.add_parser("soak", help="many clients for minutes: memory, fds and threads of every "
                                                  "process must stay flat, no errors")
    soak.add_arguments(soak_parser)
    soak_parser.set_defaults(run=soak.run)
    from kvpool.bench import ttft

    ttft_parser = benches.add_parser("ttft", help="transformers engine: time to first token, prefix from each tier")
    ttft.add_arguments(ttft_parser)
    ttft_parser.set_defaults(run=ttft.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
