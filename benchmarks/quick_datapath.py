"""Quick data-path throughput: `kvpool serve` in a subprocess, a PoolClient here.

    python benchmarks/quick_datapath.py [--blocks 256] [--batch 32] [--block-mib 1] [--rounds 3]

Prints GB/s (10^9 bytes/s) and GiB/s for same-host put/get (shared-memory
arena), remote put/get (bulk TCP, shared_memory=False), the gRPC fallback,
and this machine's memcpy of the same block size, for reference. Not a test:
the numbers depend on the machine (and on the node sharing its cores).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from kvpool.buffers import aligned_empty
from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(pool: PoolClient, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    from kvpool.v1 import master_pb2

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvpool serve exited with {proc.returncode}")
        try:
            status = pool.master.cluster_status(master_pb2.ClusterStatusRequest(), 1)
            if len(status.nodes) == 1:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.1)
    raise SystemExit("kvpool serve did not come up")


def aligned_block(seed: int, size: int) -> np.ndarray:
    """Random bytes in a page-aligned buffer, as engines' tensors are (a src/dst offset of a few bytes
    modulo 4 KiB makes memcpy several times slower here: 4K aliasing)."""
    out = aligned_empty(size)
    out[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return out


def memcpy_gbs(block: int, blocks: int, rounds: int) -> float:
    src = [aligned_block(i, block) for i in range(blocks)]
    dst = [aligned_block(i, block) for i in range(blocks)]
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        for s, d in zip(src, dst):
            np.copyto(d, s)
        best = max(best, block * blocks / (time.perf_counter() - t))
    return best / 1e9


def run(pool: PoolClient, tag: str, values: list[np.ndarray], batch: int, rounds: int,
        forget_slots: bool = False) -> tuple[float, float]:
    """Best-of-rounds put and get GB/s for ``values`` under fresh keys.

    ``forget_slots``: no arena key index, so each batch get pays a ``Locate``
    call (as a reader of a node without one would).
    """
    block = values[0].size
    put_best = get_best = 0.0
    outs = [aligned_block(i, block) for i in range(len(values))]
    pool.shared_path.use_index = not forget_slots
    for r in range(rounds):
        keys = [opaque_key(f"{tag}-{r}-{uuid.uuid4().hex}-{i}") for i in range(len(values))]
        t = time.perf_counter()
        for s in range(0, len(keys), batch):
            stored = pool.store(keys[s : s + batch], values[s : s + batch])
            assert all(stored), f"{tag}: put refused {stored.count(False)} blocks"
        put_best = max(put_best, block * len(keys) / (time.perf_counter() - t))
        locations = []
        for s in range(0, len(keys), batch):
            found = pool.lookup(keys[s : s + batch])
            assert len(found) == len(keys[s : s + batch]), f"{tag}: lookup found {len(found)}"
            locations.append(found)
        for _ in range(2):
            t = time.perf_counter()
            for s, locs in zip(range(0, len(keys), batch), locations):
                ok = pool.get_into(locs, outs[s : s + batch])
                assert all(ok), f"{tag}: get missed {ok.count(False)} blocks"
            get_best = max(get_best, block * len(keys) / (time.perf_counter() - t))
        assert all(np.array_equal(o, v) for o, v in zip(outs, values)), f"{tag}: bytes differ"
    return put_best / 1e9, get_best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block-mib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    block = int(args.block_mib * (1 << 20))
    dram = max(args.blocks * block * 4, 64 << 20)
    master_port, node_port = free_port(), free_port()
    arena = f"kvpool-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--master-port", str(master_port),
               "--master-metrics-port", "0", "--port", str(node_port), "--metrics-port", "0",
               "--data-port", "0", "--arena", arena, "--dram-bytes", str(dram), "--max-block-bytes", str(block),
               "--no-ssd", "--ssd-dir", os.path.join(tmp, "ssd")]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            values = [aligned_block(i, block) for i in range(args.blocks)]
            master = f"127.0.0.1:{master_port}"
            rows = []
            for name, shm, grpc_only, forget in [
                ("same-host (arena)", True, False, False),
                ("same-host, Locate per get", True, False, True),
                ("remote (bulk TCP)", False, False, False),
                ("remote (gRPC fallback)", False, True, False),
            ]:
                with PoolClient(ClientConfig(master=master, shared_memory=shm, strict=True, io_timeout_s=30,
                                             lookup_timeout_s=5)) as pool:
                    wait_ready(pool, proc)
                    if grpc_only:
                        # this client only: no node has a bulk address, so remote gets take gRPC
                        pool.nodes.data_address = lambda address, timeout=None: None  # type: ignore[method-assign]
                    if shm:  # map the arena into this process before measuring (a one-off cost per process)
                        pool.store([opaque_key("warm-up")], [values[0]])
                    put, get = run(pool, name, values, args.batch, args.rounds, forget)
                    rows.append((name, put, get))
            copy = memcpy_gbs(block, min(args.blocks, 256), args.rounds)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(f"{args.blocks} blocks of {block >> 10} KiB, batches of {args.batch}, best of {args.rounds}; "
          f"{os.cpu_count()} CPUs")
    print(f"{'path':26s} {'put GB/s':>9s} {'get GB/s':>9s} {'put GiB/s':>10s} {'get GiB/s':>10s}")
    for name, put, get in rows:
        print(f"{name:26s} {put:9.2f} {get:9.2f} {put * 1e9 / (1 << 30):10.2f} {get * 1e9 / (1 << 30):10.2f}")
    print(f"{'memcpy (numpy copyto)':26s} {copy:9.2f} {copy:9.2f}")
    same_put, same_get = rows[0][1], rows[0][2]
    print(f"same-host get / memcpy = {same_get / copy:.2f}; same-host put / Mooncake put (0.36 GiB/s) = "
          f"{same_put * 1e9 / (1 << 30) / 0.36:.1f}x; remote get / Mooncake get (0.89 GiB/s) = "
          f"{rows[2][2] * 1e9 / (1 << 30) / 0.89:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
