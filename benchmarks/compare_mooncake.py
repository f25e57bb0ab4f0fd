"""kvpool next to Mooncake Store on this machine, measured in one run.

    python benchmarks/compare_mooncake.py [--out FILE] [--quick]

Sets up what it needs (a venv with ``mooncake-transfer-engine-non-cuda`` under
``benchmarks/.mooncake-venv``, and the shared libraries Mooncake's binaries
link, from Debian: a benchmark-only dependency, never the product's), then,
with the memory owner and the client in separate processes for both systems:

- kvpool: ``kvpool serve`` (one per value size, its DRAM sized to the round,
  SSD off) and a ``kvpool_side.py`` client, over shared memory (same host) and
  again over the network path (``--no-shared-memory``);
- Mooncake: ``mooncake_master``, an owner process mounting a segment, and a
  ``mooncake_side.py`` client, over TCP;
- this machine's memcpy for the same blocks, as the ceiling.

Prints a markdown table with kvpool / Mooncake and kvpool / memcpy ratios
and whether each aim of the issue is met.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import numpy as np

HERE = Path(__file__).resolve().parent
VENV = HERE / ".mooncake-venv"
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
DEBIAN_LIBS = {"ibverbs": "libibverbs1", "rdmacm": "librdmacm1", "numa": "libnuma1"}

sys.path.insert(0, str(HERE))
from workload import SIZES, add_common_arguments, blocks_for, memcpy_gbps  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_mooncake() -> Path:
    """The venv python with Mooncake installed (created on first use)."""
    missing = [pkg for lib, pkg in DEBIAN_LIBS.items() if ctypes.util.find_library(lib) is None]
    if missing:
        print(f"installing {' '.join(missing)} (Mooncake's binaries link them)", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, stdout=subprocess.DEVNULL)
    python = VENV / "bin" / "python"
    if not (VENV / "bin" / "mooncake_master").exists():
        print(f"creating {VENV} with {MOONCAKE_PACKAGE}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", MOONCAKE_PACKAGE, "numpy"], check=True)
    return python


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            program = cast("list[str]", proc.args)[0]  # every process here is started from a list of str
            raise RuntimeError(f"{program} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_json(cmd: list[str], cwd: Path = HERE) -> dict:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def workload_flags(args: argparse.Namespace, sizes: str, lookups: int) -> list[str]:
    return ["--sizes", sizes, "--total-mib", str(args.total_mib), "--batch", str(args.batch),
            "--rounds", str(args.rounds), "--samples", str(args.samples), "--lookups", str(lookups)]


def run_kvpool(args: argparse.Namespace, labels: list[str]) -> tuple[dict, dict]:
    """(same-host results, network-path results), one `kvpool serve` per value size."""
    shm: dict = {"sizes": {}}
    net: dict = {"sizes": {}}
    # One serve per value size, DRAM sized to its round; a last one for the 512-key lookups.
    for i, label in enumerate([*labels, ""]):
        size = SIZES[label] if label else 4096
        slot = (size + 4095) // 4096 * 4096
        dram = max(64 << 20, 3 * blocks_for(size, args.total_mib << 20) * slot)  # one round fits twice over
        port = free_port()
        log = open(HERE / f".kvpool-serve-{i}.log", "wb")
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", "serve", "--master-port", str(port), "--master-metrics-port", "0",
             "--port", str(free_port()), "--metrics-port", "0", "--data-port", "0", "--no-ssd",
             "--dram-bytes", str(dram), "--max-block-bytes", str(slot), "--arena", f"kvpool-bench-{os.getpid()}-{i}",
             "--high-watermark", "0.95", "--low-watermark", "0.6"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(port, serve)
            time.sleep(0.5)  # the node registers right after the master listens
            lookups = 0 if label else args.lookups
            base = [sys.executable, str(HERE / "kvpool_side.py"), "--master", f"127.0.0.1:{port}"]
            one = run_json(base + workload_flags(args, label, lookups))
            shm["sizes"].update(one["sizes"])
            shm.update({k: v for k, v in one.items() if k.startswith("lookup")})
            two = run_json(base + ["--no-shared-memory"] + workload_flags(args, label, lookups))
            net["sizes"].update(two["sizes"])
            net.update({k: v for k, v in two.items() if k.startswith("lookup")})
        finally:
            stop(serve)
        print(f"  kvpool {label or 'lookup'}: done", file=sys.stderr, flush=True)
    return shm, net


def segment_mib(args: argparse.Namespace, labels: list[str]) -> int:
    """Room for every round of every size at once: Mooncake refuses to remove a key for 10 s
    after a get (its read lease), so earlier rounds' blocks are still there when later ones land."""
    total = sum((args.rounds + 1) * blocks_for(SIZES[x], args.total_mib << 20) * SIZES[x] for x in labels)
    return total // (1 << 20) + 512


def run_mooncake(args: argparse.Namespace, python: Path, labels: list[str]) -> dict:
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [str(VENV / "bin" / "mooncake_master"), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
         f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    owner = None
    try:
        wait_port(rpc, master)
        wait_port(http, master)
        ports = ["--master-port", str(rpc), "--metadata-port", str(http)]
        owner = subprocess.Popen([str(python), str(HERE / "mooncake_side.py"), "owner", *ports,
                                  "--segment-mib", str(segment_mib(args, labels))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert owner.stdin is not None and owner.stdout is not None  # both are pipes
        if owner.stdout.readline().strip() != "ready":
            raise RuntimeError("mooncake owner did not start")
        result = run_json([str(python), str(HERE / "mooncake_side.py"), "client", *ports,
                           *workload_flags(args, ";".join(labels), args.lookups)])
    finally:
        if owner is not None:
            assert owner.stdin is not None  # a pipe
            owner.stdin.close()
            stop(owner)
        stop(master)
    print("  mooncake: done", file=sys.stderr, flush=True)
    return result


def loopback_gbps(total: int, rounds: int, chunk: int = 1 << 20, working_set: bool = False) -> float:
    """This machine's TCP loopback throughput between two processes, one ``sendall``-ing and one ``recv_into``-ing
    ``chunk`` at a time, best of ``rounds``: the limit a network-path get is held against.

    ``working_set``: both sides move the bytes between buffers of ``total`` bytes (faulted in first), as a get
    lands blocks in a working set of that size; otherwise one hot ``chunk`` buffer on each side (it stays in
    cache, so that figure is a bound no get can reach: a get writes each block to its own place).
    """
    best = 0.0
    for _ in range(rounds):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            if working_set:
                source = (f"import numpy as np\nsrc = np.full({total}, 7, np.uint8)\nview = memoryview(src)\n"
                          f"for i in range({total // chunk}): s.sendall(view[i * {chunk}:(i + 1) * {chunk}])\n")
            else:
                source = f"buf = bytes({chunk})\nfor _ in range({total // chunk}): s.sendall(buf)\n"
            sender = subprocess.Popen([sys.executable, "-c", (
                "import socket\n"
                f"s = socket.create_connection(('127.0.0.1', {port}))\n" + source + "s.close()\n")])
            conn, _ = listener.accept()
            with conn:
                if working_set:
                    landing = np.empty(total, np.uint8)
                    landing[:] = 0  # faulted in, as the get's destination is
                    view = memoryview(landing.data)
                else:
                    view = memoryview(bytearray(chunk))
                got = conn.recv_into(view[:chunk])
                start = time.perf_counter()
                while got < total:
                    n = conn.recv_into(view[got : got + chunk] if working_set else view)
                    if not n:
                        break
                    got += n
                seconds = time.perf_counter() - start
            sender.wait(60)
        best = max(best, got / seconds / 1e9)
    return best


def render(labels: list[str], memcpy: dict, shm: dict, net: dict, mc: dict, loopback: float,
           loopback_hot: float) -> str:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "-"

    def aim(value: float, target: float) -> str:
        return f"{value:.2f} {'ok' if value >= target else 'MISSED'}"

    big = {label for label in labels if SIZES[label] >= 1 << 20}
    mid = {label for label in labels if SIZES[label] >= 256 << 10}
    lines = [
        f"TCP loopback between two processes, this run: {loopback:.2f} GB/s between working sets of the get's size "
        f"(the column below), {loopback_hot:.2f} GB/s between two hot 1 MiB buffers.",
        "",
        "| value | memcpy GB/s | kvpool put | kvpool get (same host) | kvpool get (network) "
        "| Mooncake put | Mooncake get | put: kvpool/Mooncake | get same host: kvpool/Mooncake "
        "| get same host: kvpool/memcpy | get network: kvpool/Mooncake | get network: kvpool/loopback |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        k, n, m = shm["sizes"][label], net["sizes"][label], mc["sizes"][label]
        put_r, get_r = k["put_gbps"] / m["put_gbps"], k["get_gbps"] / m["get_gbps"]
        mem_r, net_r = k["get_gbps"] / memcpy[label], n["get_gbps"] / m["get_gbps"]
        loop_r = n["get_gbps"] / loopback
        lines.append(
            f"| {label} | {memcpy[label]:.2f} | {k['put_gbps']:.2f} | {k['get_gbps']:.2f} | {n['get_gbps']:.2f} "
            f"| {m['put_gbps']:.2f} | {m['get_gbps']:.2f} | {aim(put_r, 4.0) if label in mid else f'{put_r:.2f}'} "
            f"| {aim(get_r, 4.0) if label in big else f'{get_r:.2f}'} "
            f"| {aim(mem_r, 0.8) if label in big else f'{mem_r:.2f}'} "
            f"| {aim(net_r, 1.5) if label in mid else f'{net_r:.2f}'} "
            f"| {aim(loop_r, 0.8) if label in mid else f'{loop_r:.2f}'} |"
        )
    lines += ["", "Latency of one single-block call, microseconds (p50 / p99):", "",
              "| value | kvpool put | kvpool get (same host) | kvpool get (network) | Mooncake put | Mooncake get "
              "| put p50 <= Mooncake | same-host get p50 <= Mooncake |",
              "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        k, n, m = shm["sizes"][label], net["sizes"][label], mc["sizes"][label]
        cells = [f"{d[op + '_p50_us']:.0f} / {d[op + '_p99_us']:.0f}" for d, op in
                 ((k, "put"), (k, "get"), (n, "get"), (m, "put"), (m, "get"))]
        marks = ["ok" if k[op + "_p50_us"] <= m[op + "_p50_us"] else "MISSED" for op in ("put", "get")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {marks[0]} | {marks[1]} |")
    if "lookup_p50_us" in shm and "lookup_p50_us" in mc:
        r = shm["lookup_p50_us"] / mc["lookup_p50_us"]
        lines += ["", "Lookup of 512 keys, half present (kvpool Lookup vs Mooncake batch_is_exist), microseconds:", "",
                  "| | p50 | p99 |", "|---|---|---|",
                  f"| kvpool | {shm['lookup_p50_us']:.0f} | {shm['lookup_p99_us']:.0f} |",
                  f"| Mooncake | {mc['lookup_p50_us']:.0f} | {mc['lookup_p99_us']:.0f} |",
                  f"| kvpool / Mooncake | {r:.2f} {'ok' if r <= 0.5 else 'MISSED'} (aim <= 0.5) | |"]
    lines += ["", "Aims (issue 14): one-block put and same-host get p50 <= Mooncake's at every size; put >= 4 x "
              "Mooncake (256 KiB and up); same-host get >= 4 x Mooncake and >= 0.8 x memcpy (1 MiB and up); network "
              "get >= 1.5 x Mooncake and >= 0.8 x loopback (256 KiB and up); lookup p50 <= 0.5 x Mooncake."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--quick", action="store_true", help="small working set, fewer samples (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.rounds, args.samples, args.lookups = 32, 1, 20, 50
    labels = args.sizes.split(";")
    python = setup_mooncake()
    memcpy = {label: memcpy_gbps(SIZES[label], args.total_mib << 20, args.rounds) for label in labels}
    loopback = loopback_gbps(args.total_mib << 20, args.rounds, working_set=True)
    loopback_hot = loopback_gbps(args.total_mib << 20, args.rounds)
    shm, net = run_kvpool(args, labels)
    mc = run_mooncake(args, python, labels)
    table = render(labels, memcpy, shm, net, mc, loopback, loopback_hot)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
