"""The GPU check's driver: a pool of its own, each check in child processes with a timeout, one summary.

Run by ``check.sh`` (which prepares the Python); see ``README.md``. Steps, in order:

1. ``env``: versions, the device, the CUDA runtime kvpool's copier loads.
2. ``pool``: ``kvpool master`` and ``kvpool node`` (DRAM only) on 127.0.0.1, free ports, an arena of its own
   sized to what the checks store (and to the free room in /dev/shm).
3. ``copier``: ``copier-put`` then ``copier-get`` (another process), for each piece shape; bytes compared.
4. ``engine``: ``engine-store`` then ``engine-hit`` (another process): DRAM-hit TTFT (the prefix copied to the
   device whole, and layer by layer beside the forward) against a recompute, greedy tokens compared.

Invariants: the summary (``gpu-check.json``, ``gpu-check.txt`` under the output folder) is rewritten after
every step, so a step that hangs or crashes leaves what came before; a step that fails (or times out, or
cannot run because one it needs failed) is ``"ok": false`` with its error and the tail of its log
(``logs/<step>.log``); the process exits 0 only if every check passed, 1 otherwise. This driver never
imports torch: a CUDA fault kills a child, not the summary. Every process it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 1 << 20

# seconds per step (x --timeout-scale); their sum (460) stays under check.sh's 480 s for this driver
TIMEOUTS = {"env": 45, "pool": 45, "copier-put": 90, "copier-get": 70, "engine-store": 80, "engine-hit": 130}

# the transformers engine's model: a seeded random Qwen2 (kvpool.engines.hf_model.ModelSize fields)
GPU_MODEL = {"hidden": 1024, "layers": 16, "heads": 16, "kv_heads": 4, "intermediate": 2816, "vocab": 32000,
             "max_positions": 16384}
CPU_MODEL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
             "max_positions": 4096}


class StepError(RuntimeError):
    """A step did not produce its result (the message says why); ``partial``: what it measured before."""

    def __init__(self, message: str, partial: dict[str, Any] | None = None):
        super().__init__(message)
        self.partial = partial or {}


def plan(cpu: bool) -> dict[str, Any]:
    """What the checks move: the copier's region per piece shape, and the engine's model and prompt."""
    copier: dict[str, Any]
    engine: dict[str, Any]
    if cpu:
        copier = {"bytes": 4 * MIB, "shapes": {"per-layer": (8, 4096), "whole-block": (1, 32768)}, "rounds": 3,
                  "staging_bytes": 1 * MIB}
        engine = {"model": CPU_MODEL, "block_size": 16, "cached_blocks": 8, "suffix_tokens": 8, "new_tokens": 4,
                  "rounds": 2}
    else:
        # per-layer: a vLLM-like bf16 block of 16 tokens, 8 KV heads of 128, 32 layers: K and V a layer, 32 KiB
        # each, one tensor per layer's K or V (a block's 64 pieces are strided); whole-block: one 2 MiB piece.
        copier = {"bytes": 256 * MIB, "shapes": {"per-layer": (64, 32768), "whole-block": (1, 2 * MIB)},
                  "rounds": 4, "staging_bytes": 64 * MIB}
        engine = {"model": GPU_MODEL, "block_size": 128, "cached_blocks": 64, "suffix_tokens": 64,
                  "new_tokens": 16, "rounds": 5}
    model: dict[str, int] = engine["model"]
    head_dim = model["hidden"] // model["heads"]
    engine["block_bytes"] = 2 * model["layers"] * model["kv_heads"] * head_dim * engine["block_size"] * 4  # fp32
    return {"copier": copier, "engine": engine}


def pool_bytes(work: dict[str, Any]) -> int:
    """DRAM the checks fill: every put round of every shape under new keys, and the engine's prompts (its
    warm-up's and the measured one's)."""
    copier, engine = work["copier"], work["engine"]
    stored = copier["bytes"] * copier["rounds"] * len(copier["shapes"]) + 2 * engine["cached_blocks"] * engine[
        "block_bytes"]
    return stored + stored // 4 + 16 * MIB


def fit_to_shm(work: dict[str, Any], shm_free: int) -> str:
    """Shrink the copier's region until the pool fits 90% of /dev/shm's free room; a note if it shrank.

    StepError if even the smallest run does not fit."""
    copier, note = work["copier"], ""
    largest_block = max(p * s for p, s in copier["shapes"].values())
    while pool_bytes(work) > shm_free * 0.9 and copier["bytes"] > 8 * largest_block:
        copier["bytes"] //= 2
        note = (f"/dev/shm has {shm_free // MIB} MiB free: the copier moves {copier['bytes'] // MIB} MiB a round "
                f"(a container: --shm-size 8g for the full size)")
    if pool_bytes(work) > shm_free * 0.9:
        raise StepError(f"/dev/shm has {shm_free // MIB} MiB free, the pool needs {pool_bytes(work) // MIB} MiB "
                        "(a container: run it with --shm-size 8g)")
    return note


# -- the summary -----------------------------------------------------------------------------------


class Report:
    """The summary, saved after every change (see module docstring)."""

    def __init__(self, out: Path, mode: str, argv: list[str]):
        self.out = out
        self.started = time.monotonic()
        self.data: dict[str, Any] = {
            "mode": mode, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(argv), "env": {}, "checks": {}, "ok": False, "step_seconds": {},
        }

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds of each child step (``step_seconds`` in the JSON)."""
        return self.data["step_seconds"]

    def step(self, name: str, ok: bool, **fields: Any) -> None:
        self.data["checks"][name] = {"ok": ok, **fields}
        self.save()

    @property
    def checks(self) -> dict[str, Any]:
        return self.data["checks"]

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.data["ok"] = bool(self.checks) and all(c["ok"] for c in self.checks.values()) and \
            all(name in self.checks for name in ("env", "pool", "copier", "engine"))
        (self.out / "gpu-check.json").write_text(json.dumps(self.data, indent=1) + "\n")
        (self.out / "gpu-check.txt").write_text(self.table())

    def table(self) -> str:
        env, checks = self.data["env"], self.checks
        lines = [f"kvpool GPU check ({self.data['mode']}), {self.data['started']}, {self.data['elapsed_s']} s",
                 f"device: {env.get('device', '?')}   driver: {env.get('nvidia_smi', '-')}",
                 f"CUDA driver/runtime: {env.get('cuda_driver_version', '-')}/{env.get('cuda_runtime_version', '-')}"
                 f"   torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '-')})   transformers "
                 f"{env.get('transformers', '?')}   python {env.get('python', '?')}", ""]
        lines.append(f"{'check':<10} {'result':<6} figures")
        for name in ("env", "pool", "copier", "engine"):
            check = checks.get(name)
            if check is None:
                lines.append(f"{name:<10} {'-':<6} not run")
                continue
            result = "pass" if check["ok"] else "FAIL"
            lines.append(f"{name:<10} {result:<6} {self._figures(name, check)}")
            if not check["ok"]:
                lines.append(f"{'':<17} {check.get('error', '')[:300]}")
        if "note" in self.data:
            lines.append(f"note: {self.data['note']}")
        lines.append(f"overall: {'PASS' if self.data['ok'] else 'FAIL'}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _figures(name: str, check: dict[str, Any]) -> str:
        if name == "pool":
            return f"master {check.get('master', '?')}, DRAM {check.get('dram_bytes', 0) // MIB} MiB, no SSD"
        if name == "copier":
            parts = []
            for shape, f in check.get("shapes", {}).items():
                parts.append(f"[{shape}: {f.get('pieces', '?')} x {f.get('piece_bytes', 0) // 1024} KiB a block, "
                             f"{f.get('bytes', 0) // MIB} MiB] GB/s put {f.get('put_gbps', '-')}, get "
                             f"{f.get('get_gbps', '-')}; copier d2h {f.get('copier_d2h_gbps', '-')}, h2d "
                             f"{f.get('copier_h2d_gbps', '-')}; torch d2h {f.get('torch_d2h_gbps', '-')}, h2d "
                             f"{f.get('torch_h2d_gbps', '-')}; bytes equal {f.get('bytes_equal', '-')}")
            return ("\n" + " " * 17).join(parts)
        if name == "engine" and "hit_ttft_ms" in check:
            return (f"TTFT DRAM hit {check['hit_ttft_ms']} ms vs recompute {check['recompute_ttft_ms']} ms "
                    f"({check['hit_over_recompute']} x), {check['reused_tokens']} of {check['prompt_tokens']} tokens "
                    f"loaded; tokens equal {check.get('tokens_equal', '-')}\n" + " " * 17
                    + f"layer-wise hit {check['layerwise_hit_ttft_ms']} ms: loading adds "
                    f"{check['layerwise_added_ms']} ms to the forward with the prefix on the device "
                    f"({check['own_forward_ms']} ms), the whole-prefix load {check['whole_load_added_ms']} ms: "
                    f"{check['layerwise_over_whole']} x (issue 27's aim: <= 0.4)")
        return ""


# -- child processes -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM its process group, SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_role(out: Path, role: str, spec: dict[str, Any], timeout: float,
             seconds: dict[str, float]) -> dict[str, Any]:
    """Run one role of ``workers.py`` in a new process; its result, or StepError with the log's tail (and
    ``partial``: what the role saved before it failed)."""
    log, result = out / "logs" / f"{role}.log", out / "logs" / f"{role}.json"
    partial = result.with_name(result.name + ".partial")
    result.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, str(HERE / "workers.py"), role, json.dumps(spec), str(result)],
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=out,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            seconds[role] = round(time.monotonic() - start, 1)
            raise StepError(f"{role}: no result within {timeout:.0f}s (stopped); log: {_tail(log)}",
                            _read(partial)) from None
        finally:
            _stop(proc)  # stopped from outside (SIGTERM: see main): the child goes too
    seconds[role] = round(time.monotonic() - start, 1)
    if code != 0 or not result.exists():
        raise StepError(f"{role}: exited with {code}; log: {_tail(log)}", _read(partial))
    return json.loads(result.read_text())


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class Pool:
    """``kvpool master`` and one ``kvpool node`` (DRAM only) on 127.0.0.1."""

    def __init__(self, out: Path, dram_bytes: int, max_block_bytes: int, timeout: float):
        from kvpool.status import cluster_status

        self.arena = f"kvpool-gpu-check-{os.getpid()}"
        self.master = f"127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen] = []
        cli = [sys.executable, "-m", "kvpool.cli", "--log-level", "WARNING"]
        self._start(out / "logs" / "master.log", [*cli, "master", "--host", "127.0.0.1",
                                                  "--port", self.master.rsplit(":", 1)[1],
                                                  "--call-port", str(_free_port()), "--metrics-port", "0"])
        self._start(out / "logs" / "node.log", [
            *cli, "node", "--master", self.master, "--host", "127.0.0.1", "--port", str(_free_port()),
            "--metrics-port", "0", "--data-port", "0", "--node-id", "gpu-check", "--arena", self.arena,
            "--dram-bytes", str(dram_bytes), "--max-block-bytes", str(max_block_bytes), "--dram-slots", "65536",
            "--no-ssd"])
        deadline = time.monotonic() + timeout
        while True:
            for proc, log in zip(self.procs, ("master", "node")):
                if proc.poll() is not None:
                    raise StepError(f"kvpool {log} exited with {proc.returncode}: "
                                    f"{_tail(out / 'logs' / f'{log}.log')}")
            try:
                if len(cluster_status(self.master, timeout=1.0).nodes) == 1:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise StepError(f"the pool did not come up within {timeout:.0f}s: "
                                f"{_tail(out / 'logs' / 'node.log')} {_tail(out / 'logs' / 'master.log')}")
            time.sleep(0.1)

    def _start(self, log: Path, argv: list[str]) -> None:
        with open(log, "wb") as sink:
            self.procs.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                               cwd=log.parent))

    def close(self) -> None:
        from kvpool.tiers.arena import shm_path

        for proc in reversed(self.procs):
            _stop(proc)
        try:
            os.unlink(shm_path(self.arena))
        except FileNotFoundError:
            pass


# -- the checks ------------------------------------------------------------------------------------


def check_copier(out: Path, report: Report, device: str, work: dict[str, Any], config: str,
                 timeout: Any) -> None:
    copier = work["copier"]
    shapes: dict[str, dict[str, Any]] = {}
    for i, (name, (pieces, piece_bytes)) in enumerate(copier["shapes"].items()):
        blocks = copier["bytes"] // (pieces * piece_bytes)
        shapes[name] = {"name": name, "seed": 27 + i, "tag": f"{name}-{os.getpid()}", "blocks": blocks,
                        "pieces": pieces, "piece_bytes": piece_bytes}
    spec = {"device": device, "config": config, "rounds": copier["rounds"], "flush_s": 60,
            "staging_bytes": copier["staging_bytes"], "shapes": list(shapes.values())}
    figures = {name: {"pieces": s["pieces"], "piece_bytes": s["piece_bytes"], "bytes": s["blocks"] * s["pieces"] *
                      s["piece_bytes"]} for name, s in shapes.items()}

    def merge(result: dict[str, Any], stats_key: str) -> None:
        for name, got in result.get("shapes", {}).items():
            figures[name].update({k: v for k, v in got.items() if k != "stats"}, **{stats_key: got.get("stats")})

    try:
        put = run_role(out, "copier-put", spec, timeout("copier-put"), report.seconds)
        merge(put, "put_stats")
        report.step("copier", False, shapes=figures, error="running: copier-get")
        for name, got in put["shapes"].items():
            shapes[name]["keys_tag"] = got["keys_tag"]
        get_spec = {**spec, "shapes": list(shapes.values())}
        merge(run_role(out, "copier-get", get_spec, timeout("copier-get"), report.seconds), "get_stats")
    except StepError as exc:
        merge(exc.partial, "partial_stats")
        report.step("copier", False, shapes=figures, error=str(exc))
        return
    report.step("copier", all(f.get("bytes_equal") for f in figures.values()), shapes=figures)


def check_engine(out: Path, report: Report, device: str, work: dict[str, Any], master: str,
                 timeout: Any) -> None:
    engine = work["engine"]
    spec = {"device": device, "master": master, "seed": 27, "dtype": "float32", "flush_s": 60,
            **{k: engine[k] for k in ("model", "block_size", "cached_blocks", "suffix_tokens", "new_tokens",
                                      "rounds")}}
    try:
        stored = run_role(out, "engine-store", spec, timeout("engine-store"), report.seconds)
        hit = run_role(out, "engine-hit", spec, timeout("engine-hit"), report.seconds)
    except StepError as exc:
        report.step("engine", False, model=engine["model"], error=str(exc))
        return
    equal = stored["tokens"] == hit["hit_tokens"] == hit["layerwise_tokens"] == hit["recompute_tokens"]
    fields = {"model": engine["model"], "dtype": "float32", "block_size": engine["block_size"],
              "block_bytes": stored["block_bytes"], "store_ttft_ms": round(stored["ttft_s"] * 1e3, 2),
              "store_tokens": stored["tokens"], **hit, "tokens_equal": equal}
    ok = equal and hit["tokens_stable_across_rounds"]
    error = "" if ok else ("greedy tokens differ: store (full compute) "
                           f"{stored['tokens']}, hit {hit['hit_tokens']}, layer-wise hit {hit['layerwise_tokens']}, "
                           f"recompute {hit['recompute_tokens']}"
                           if not equal else "greedy tokens changed between rounds of one case")
    report.step("engine", ok, **fields, **({"error": error} if error else {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: CPU tensors and the host copier")
    parser.add_argument("--out", required=True, help="folder for gpu-check.json, gpu-check.txt and logs/")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout")
    args = parser.parse_args(argv)
    # check.sh's overall timeout sends SIGTERM: unwind, so the pool and the running child are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu else "cuda"
    report = Report(out, device, [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])

    def timeout(step: str) -> float:
        return TIMEOUTS[step] * args.timeout_scale

    try:
        env = run_role(out, "env", {"device": device}, timeout("env"), report.seconds)
        report.data["env"] = env
        report.step("env", True)
    except StepError as exc:
        report.step("env", False, error=str(exc))
        for name in ("pool", "copier", "engine"):
            report.step(name, False, error="not run: the env step failed")
        print(report.table(), end="")
        return 1

    pool = None
    work = plan(args.cpu)
    try:
        note = fit_to_shm(work, env.get("shm_free_bytes") or shutil.disk_usage("/dev/shm").free)
        if note:
            report.data["note"] = note
        dram = pool_bytes(work)
        largest = max(work["engine"]["block_bytes"], *(p * s for p, s in work["copier"]["shapes"].values()))
        start = time.monotonic()
        pool = Pool(out, dram, largest, timeout("pool"))
        report.seconds["pool"] = round(time.monotonic() - start, 1)
        report.step("pool", True, master=pool.master, dram_bytes=dram)
        config = out / "kvpool-client.json"
        config.write_text(json.dumps({"client": {"master": pool.master, "model": "gpu-check",
                                                 "lookup_timeout_s": 5.0, "io_timeout_s": 30.0}}))
        check_copier(out, report, device, work, str(config), timeout)
        check_engine(out, report, device, work, pool.master, timeout)
    except StepError as exc:
        report.step("pool", False, error=str(exc))
        for name in ("copier", "engine"):
            if name not in report.checks:
                report.step(name, False, error="not run: the pool did not start")
    finally:
        if pool is not None:
            pool.close()
        report.save()
    print(report.table(), end="")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
