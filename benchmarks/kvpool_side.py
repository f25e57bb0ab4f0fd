"""kvpool's side of compare_mooncake.py: a client process against a running ``kvpool serve``.

    python kvpool_side.py --master 127.0.0.1:PORT [--no-shared-memory] [workload flags]

Prints one JSON line. ``get`` includes the master lookup that finds the
blocks (Mooncake's get does its own lookup too); ``put`` is the synchronous
``PoolClient.store`` (placement from the client's cluster view + transfer +
commit; the index update follows in the background, and a throughput round
ends with the ``flush`` barrier), not the write-behind queue.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from workload import add_common_arguments, run_side

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key


class KvpoolClient:
    """The workload's client interface over PoolClient (strict: a fault fails the benchmark)."""

    def __init__(self, pool: PoolClient):
        self.pool = pool

    def put(self, keys, values: list[np.ndarray]) -> list[bool]:
        return self.pool.store(keys, values)

    def get(self, keys, outs: list[np.ndarray]) -> list[bool]:
        found = self.pool.lookup(keys)
        if len(found) < len(keys):
            return [False] * len(keys)
        return self.pool.get_into(found, outs)

    def sync(self) -> None:
        """The flush barrier: nodes report their puts to the master in the background."""
        if not self.pool.flush():
            raise RuntimeError("a node could not confirm its reports")

    def lookup(self, keys) -> int:
        return len(self.pool.lookup(keys))

    def remove(self, keys) -> None:
        """Nothing: the node's LRU makes room (the run's DRAM is sized for one round at a time)."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--no-shared-memory", action="store_true", help="force the network path")
    add_common_arguments(parser)
    args = parser.parse_args()
    config = ClientConfig(master=args.master, shared_memory=not args.no_shared_memory, strict=True,
                          lookup_timeout_s=10, io_timeout_s=30)
    with PoolClient(config) as pool:
        result = run_side(KvpoolClient(pool), args, key=lambda name: opaque_key(name))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
