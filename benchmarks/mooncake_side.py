"""Mooncake Store's side of compare_mooncake.py; runs in the benchmark's Mooncake venv.

    python mooncake_side.py owner --segment-mib 4096      # mounts memory, waits for stdin EOF
    python mooncake_side.py owner --keys 4096             # ... after putting keys k0..k4095 (4 KiB each)
    python mooncake_side.py client [workload flags]       # measures, prints one JSON line

Uses Mooncake's fastest documented Python calls: registered buffers with
batch_put_from / batch_get_into (zero-copy on the client side), and
batch_is_exist for lookups.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from mooncake.store import MooncakeDistributedStore
from workload import add_common_arguments, run_side

METADATA = "http://127.0.0.1:{port}/metadata"


def connect(args: argparse.Namespace, segment: int, local_buffer: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", METADATA.format(port=args.metadata_port), segment, local_buffer, "tcp", "",
                     f"127.0.0.1:{args.master_port}")
    if rc != 0:
        raise SystemExit(f"mooncake setup failed: {rc}")
    return store


class MooncakeClient:
    """The workload's client interface over MooncakeDistributedStore."""

    def __init__(self, store: MooncakeDistributedStore):
        self.store = store
        self._registered: set[int] = set()
        self._keep: list[np.ndarray] = []  # registered memory must never be freed and reused

    def _register(self, arrays: list[np.ndarray]) -> None:
        for a in arrays:
            base = a
            while base.base is not None:  # the array that owns the memory
                base = base.base
            addr = base.ctypes.data
            if addr not in self._registered:
                if self.store.register_buffer(addr, base.nbytes) != 0:
                    raise RuntimeError("register_buffer failed")
                self._registered.add(addr)
                self._keep.append(base)

    def put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        self._register(values)
        rcs = self.store.batch_put_from(keys, [v.ctypes.data for v in values], [v.nbytes for v in values])
        return [rc == 0 for rc in rcs]

    def get(self, keys: list[str], outs: list[np.ndarray]) -> list[bool]:
        self._register(outs)
        sizes = self.store.batch_get_into(keys, [o.ctypes.data for o in outs], [o.nbytes for o in outs])
        return [n == o.nbytes for n, o in zip(sizes, outs)]

    def lookup(self, keys: list[str]) -> int:
        return sum(1 for x in self.store.batch_is_exist(keys) if x == 1)

    def sync(self) -> None:
        """Nothing: a Mooncake put returns after the master has its metadata (PutEnd)."""

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["owner", "client"])
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--metadata-port", type=int, required=True)
    parser.add_argument("--segment-mib", type=int, default=4096)
    parser.add_argument("--keys", type=int, default=0, help="owner: put keys k0, k1, ... (4 KiB each) first")
    add_common_arguments(parser)
    args = parser.parse_args()
    if args.role == "owner":
        store = connect(args, args.segment_mib << 20, 64 << 20)  # keep it: a dropped store unmounts
        value = bytes(4096)
        for i in range(args.keys):
            if store.put(f"k{i}", value) != 0:
                raise SystemExit(f"mooncake put of k{i} failed")
        print("ready", flush=True)
        sys.stdin.read()  # until the driver closes our stdin
        store.close()
        return 0
    store = connect(args, 0, 64 << 20)
    result = run_side(MooncakeClient(store), args, key=lambda name: name)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
