"""The ``kvpool`` command line: one subcommand per job; ``kvpool <cmd> --help`` documents each."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="A tiered (HBM / DRAM / SSD) KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = commands.add_parser("bench", help="measure the pool against this machine's limits")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    from kvpool.bench import tiers

    tiers_parser = benches.add_parser("tiers", help="DRAM and SSD put/get GB/s next to memcpy")
    tiers.add_arguments(tiers_parser)
    tiers_parser.set_defaults(run=tiers.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
