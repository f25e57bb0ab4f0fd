"""What one fast call costs its client: CPU and wall time per 64-key Lookup, one thread, against a real master.

    python benchmarks/client_call.py [--calls 20000] [--timeout 0.5,30]

Starts a ``kvpool master`` process (no node: each lookup is a miss, the reply small) and, in this process,
one ``DirectMaster`` (the fast-call wire over one pooled connection, as ``PoolClient`` and the engine
adapters call it). Per call timeout (``--timeout``: ``ClientConfig.lookup_timeout_s``'s default 0.5 s, and 30 s,
past the pool's 10 s socket timeout), loops ``--calls`` lookups, best of 3: the calling thread's CPU
(``time.thread_time``) and the wall time per call. The master's side is ``lookup_path.py``'s and
``master_scale.py``'s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--timeout", default="0.5,30", help="call timeouts (s), comma-separated")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from compare_mooncake import free_port, stop, wait_port

    from kvpool.keys import opaque_key
    from kvpool.master_client import DirectMaster
    from kvpool.tcp import ConnectionPool
    from kvpool.v1 import master_pb2

    port = free_port()
    master = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "master", "--port", str(port), "--metrics-port",
                               "0", "--call-port", str(free_port()), "--log-level", "WARNING"])
    try:
        wait_port(port, master)
        request = master_pb2.LookupRequest(keys=b"".join(opaque_key(f"client-{i}") for i in range(64)),
                                           worker_id="client-call")
        client = DirectMaster(f"127.0.0.1:{port}", pool=ConnectionPool(10.0), timeout_s=10.0,
                              max_message_bytes=64 << 20)
        print(f"64-key Lookup, one thread, best of 3 x {args.calls} calls\n"
              "| call timeout s | client CPU us per call | wall us per call |\n|---|---|---|")
        for timeout in (float(t) for t in args.timeout.split(",")):
            client.lookup(request, timeout)  # the connection, and the master's wire address
            best = (float("inf"), float("inf"))
            for _ in range(3):
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(args.calls):
                    client.lookup(request, timeout)
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                best = min(best, (cpu / args.calls * 1e6, wall / args.calls * 1e6))
            print(f"| {timeout:g} | {best[0]:.1f} | {best[1]:.1f} |")
        client.close()
    finally:
        stop(master)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
