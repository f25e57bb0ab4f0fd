"""Time to first token in the real vLLM: kvpool against vLLM's prefix cache and Mooncake.

    bash tests/vllm_env.sh                                     # once: build/vllm-venv
    .venv/bin/python benchmarks/vllm_ttft.py [--prompts N] [--only PHASES] [--no-mooncake] [--no-pd] [--json]


One run, one model: Qwen2-0.5B's shape (24 layers, 2 KV heads of 64) with
vLLM's dummy weights (:func:`vllm_runtime.save_model`), prompts
of ``--prompt-tokens`` (2,048) random token ids, ``max_tokens=1``, blocks of
``--block-size`` (32) tokens (a block across all layers: 384 KiB in bf16).
Each vLLM process is a child of the vLLM Python (:func:`vllm_python`), in
the same environment (:func:`vllm_env`: OpenMP threads pinned to ``--cpus``,
in-process engine core unless ``--multiprocess``), and serves, before
anything is measured, one warm-up request of the same kind as its measured
ones (prompt ``W``, which the process filling a store stores too). Then
``--prompts`` (5) distinct prompts ``P1..Pn``, one request at a time:

- ``vllm`` (no connector): each ``Pi`` cold (``cold``: nothing cached), then
  again (``own``: vLLM's own prefix-cache hit in the same process, the
  ceiling: only the last block is computed);
- ``kvpool fill`` (``KVPoolConnector``; a pool this command starts, ``kvpool
  serve`` on 127.0.0.1 with DRAM for twice the blocks and SSD in a temporary
  directory): each ``Pi`` cold (``kvpool_cold``: the pool on, nothing to hit;
  its blocks are saved), then again (``kvpool_own``: vLLM's own hit with the
  connector loaded). The process exits (the connector flushes its saves);
- ``kvpool DRAM``, a fresh process: each ``Pi`` (``kvpool_dram``: the prefix
  loaded from the node's DRAM arena, whole-request ``sync`` loads), then
  again (``own_after_dram``);
- ``kvpool DRAM layerwise`` and ``kvpool DRAM async``: the same in fresh
  processes with ``kvpool_load_mode`` ``layerwise`` (``kvpool_layerwise``,
  ``own_after_layerwise``) and ``async`` (``kvpool_async``,
  ``own_after_async``);
- ``kvpool ITL sync`` and ``kvpool ITL async``: fresh processes driven step
  by step (:mod:`vllm_itl`): ``--running`` (4) requests decode
  while each ``Pi`` arrives; the running requests' inter-token latency
  while its load runs, against steps with no load in the same process,
  and its TTFT;
- ``mooncake fill`` / ``mooncake hit`` (vLLM's in-tree
  ``MooncakeStoreConnector``, ``mooncake_master`` and a separate
  ``mooncake_client`` store process, :mod:`vllm_peers`): the same
  as kvpool's fill and DRAM phases (``mooncake_cold``, ``mooncake``,
  ``own_after_mooncake``);
- ``kvpool 1P1D`` (unless ``--no-pd``): prefill/decode disaggregation through
  the pool, a prefill and a decode vLLM process alive at once
  (:mod:`vllm_pd`): each of ``--prompts`` prompts of its own to
  the prefill instance for one token (``pd_cold``), then to the decode
  instance with the ``kv_transfer_params`` it returned (``pd_decode``: the
  decode TTFT from the hand-off), then again to the decode instance
  (``own_after_pd``, the colocated own hit it is paired with);
- ``kvpool SSD``: this process first puts as many filler blocks as the node's
  DRAM holds, so every block of ``W`` and ``Pi`` is evicted from DRAM and
  demoted to SSD (write-back), waits until the node has written them all
  (``kvpool_demotion_queue_bytes`` 0), then a fresh vLLM process: each ``Pi``
  (``kvpool_ssd``), then again (``own_after_ssd``).

TTFT is vLLM's own: ``RequestOutput.metrics.first_token_latency``, from the
request's arrival to its first token (the connector's lookup, the load and
the forward are all inside it). Reported: medians over the prompts, the aims'
ratios against ``own`` (``kvpool_dram <= 1.2 x own``, ``kvpool_dram <= 0.6 x
mooncake``, ``kvpool_ssd <= 1.5 x own``) and, because the machine is shared,
the same ratio per prompt against the ``own`` hit served right after it in
the same process (``paired``), and what the layer-wise load adds to that own
hit against what the whole-request load adds (``paired +ms``, aim <= 0.4 x).
``--only`` runs some of the phases (the kvpool ones need ``kvpool fill``,
which always runs with them). Every row is checked: cold rows computed every
token, hit rows reused all but the last block (``RequestOutput.num_cached_tokens``),
kvpool rows came whole from the tier they name (the connector's
``vllm:kvpool_hit_blocks_{dram,ssd}`` and ``loaded_blocks`` counters), and
the SSD phase's reads were SSD reads (the node's ``kvpool_promotions_total``
and the master's SSD hit counter grew by the blocks read). A failed check is
an error, not a number.

The vLLM side runs this script with ``--driver SPEC`` (:func:`driver_main`). The modules beside it
(``vllm_runtime``, ``vllm_itl``, ``vllm_pd``, ``vllm_engine``, ``vllm_peers``, ``local_pool``) are imported
from this folder, as a script's siblings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import vllm_itl
from vllm_runtime import MODELS, save_model, vllm_env, vllm_python

MODEL = "qwen2-0.5b"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CASES = ("cold", "own", "kvpool_cold", "kvpool_own", "kvpool_dram", "kvpool_layerwise", "kvpool_async", "kvpool_ssd",
         "mooncake_cold", "mooncake", "pd_cold", "pd_decode")
DRAM_CASES = ("kvpool_dram", "kvpool_layerwise", "kvpool_async")  # loaded from DRAM, by load mode
LABELS = {
    "cold": "cold prefill, vLLM alone",
    "own": "vLLM's own prefix-cache hit (ceiling)",
    "kvpool_cold": "cold prefill, kvpool connector on",
    "kvpool_own": "vLLM's own hit, kvpool connector on",
    "kvpool_dram": "kvpool hit from DRAM, fresh process (whole-request sync load)",
    "kvpool_layerwise": "kvpool hit from DRAM, fresh process, layer-wise load",
    "kvpool_async": "kvpool hit from DRAM, fresh process, async load",
    "kvpool_ssd": "kvpool hit from SSD, fresh process",
    "mooncake_cold": "cold prefill, Mooncake connector on",
    "mooncake": "Mooncake Store hit, fresh process",
    "pd_cold": "1P1D: prefill instance, cold prefill",
    "pd_decode": "1P1D: decode instance, from the hand-off",
}
PAIRED = {"kvpool_dram": "own_after_dram", "kvpool_layerwise": "own_after_layerwise", "kvpool_async": "own_after_async",
          "kvpool_ssd": "own_after_ssd", "mooncake": "own_after_mooncake", "pd_decode": "own_after_pd"}
LAYERWISE_AIM = 0.4  # what the layer-wise load adds to vLLM's own hit <= this x what the whole-request load adds
PHASES = ("vllm", "dram", "modes", "pd", "itl", "mooncake", "ssd")  # --only's words
AIMS: list[tuple[str, str, float]] = [("kvpool_dram", "own", 1.2), ("kvpool_dram", "mooncake", 0.6),
                                      ("kvpool_ssd", "own", 1.5)]
PHASE_TIMEOUT_S = 1800.0
RUNNING_TOKENS = 128  # the prompt of each request decoding in the ITL phases


@dataclass
class Request:
    """One measured (or warm-up) request as the driver saw it."""

    case: str
    prompt: int
    ttft_s: float
    cached: int
    wall_s: float
    queued_to_scheduled_s: float
    scheduled_to_first_token_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # vLLM counters' growth over this request


# -- the vLLM side -----------------------------------------------------------------------------------


def counters() -> dict[str, float]:
    """vLLM's counters this benchmark reads (connector and prefix-cache), summed over engines and labels.

    Read from the Prometheus registry itself: ``LLM.get_metrics()`` rounds counters to integers, which turns
    ``vllm:kvpool_load_seconds`` into 0.
    """
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.type == "counter" and family.name.startswith(
                ("vllm:kvpool_", "vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:mooncake", "vllm:kv_")):
            value = sum(s.value for s in family.samples if s.name == f"{family.name}_total")
            out[family.name] = out.get(family.name, 0.0) + float(value)
    return out


_TRACE: dict[str, float] = {}


def timed(trace: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, wrapped (never changed) to add its seconds and calls to ``trace[name + "_s"]`` and
    ``trace[name + "_calls"]`` (two ``perf_counter`` calls a call)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            trace[f"{name}_s"] = trace.get(f"{name}_s", 0.0) + time.perf_counter() - start
            trace[f"{name}_calls"] = trace.get(f"{name}_calls", 0.0) + 1
    return wrapper


def _trace_connector() -> None:
    """Time the kvpool connector's parts in this process: wrap (never change) the pool lookup of the scheduler
    side, the pool read and the per-layer scatter of the worker side. Totals in seconds (and calls) go to
    ``_TRACE``, read per request like the counters."""
    from kvpool.client.pool import PoolClient
    from kvpool.engines.vllm import worker

    traced = functools.partial(timed, _TRACE)

    PoolClient.lookup = traced("lookup", PoolClient.lookup)  # type: ignore[method-assign]
    PoolClient.get_into = traced("get", PoolClient.get_into)  # type: ignore[method-assign]
    worker._scatter = traced("scatter", worker._scatter)
    worker.PoolWorker.fetch = traced("fetch", worker.PoolWorker.fetch)  # type: ignore[method-assign]
    worker.PoolWorker.save = traced("save", worker.PoolWorker.save)  # type: ignore[method-assign]


def driver_main(spec_path: str) -> int:
    """Run one vLLM process's requests (the spec :func:`_phase` writes) and write their :class:`Request` s."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    prompts = json.loads(Path(spec["prompts"]).read_text())
    kv = None
    if spec["connector"] == "kvpool":
        kv = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.engines.vllm",
                              kv_role="kv_both",
                              kv_connector_extra_config={"kvpool_config_path": spec["kvpool_config"],
                                                         "kvpool_strict": True,
                                                         "kvpool_load_mode": spec["load_mode"]})
    elif spec["connector"] == "mooncake":
        kv = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both")
    if spec["connector"] == "kvpool":
        _trace_connector()
    tokens = spec["prompt_tokens"]
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, block_size=spec["block_size"], dtype=spec["dtype"],
              load_format="dummy", enforce_eager=True, disable_log_stats=False, max_model_len=tokens + 64,
              max_num_batched_tokens=max(tokens + 64, 2048), max_num_seqs=spec.get("max_num_seqs", 4), seed=0,
              kv_transfer_config=kv)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    results = []
    if spec.get("itl"):  # the batch rows (vllm_itl): warm up alone, then the scenario

        itl = spec["itl"]
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
        records = vllm_itl.drive(llm, prompts, itl["running"], itl["hits"], itl["settle"], counters)
        Path(spec["result"] + ".itl").write_text(json.dumps(records))
    for case, index in spec["requests"]:
        before = dict(counters(), **{f"trace:{k}": v for k, v in _TRACE.items()})
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompts[index])], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        after = dict(counters(), **{f"trace:{k}": v for k, v in _TRACE.items()})
        m = out.metrics
        if m is None or not m.first_token_latency:
            raise RuntimeError("vLLM returned no request metrics (disable_log_stats must be False)")
        grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        results.append(Request(case, index, float(m.first_token_latency), int(out.num_cached_tokens or 0), wall,
                               float(m.scheduled_ts - m.queued_ts), float(m.first_token_ts - m.scheduled_ts),
                               grown))
    Path(spec["result"]).write_text(json.dumps([asdict(r) for r in results]))
    # The connectors' shutdown: kvpool flushes its write-behind saves, Mooncake waits for its sending thread.
    # Then out without the interpreter's teardown: Mooncake's lookup thread keeps a zmq socket that makes
    # the garbage collection of its context wait forever.
    start = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    print(f"vllm_ttft driver: engine shut down in {time.perf_counter() - start:.1f} s", flush=True)
    sys.stderr.flush()
    os._exit(0)


# -- this side: pools, phases, checks -------------------------------------------------------------------


def _node_counter(metrics_port: int, name: str) -> float:
    """A counter (``name`` with its ``_total``) on the pool node's /metrics, summed over labels."""
    from kvpool.metrics import scrape_samples

    return sum(s.value for s in scrape_samples(metrics_port) if s.name in (name, f"{name}_total"))


def _master_counts(master: str) -> dict[str, int]:
    """The master's ClusterStatus numbers this benchmark checks (what ``kvpool status`` prints)."""
    from kvpool.status import cluster_status
    from kvpool.v1 import common_pb2

    s = cluster_status(master, timeout=10)
    counts = {"lookups": s.lookups, "hit_blocks_dram": s.hit_blocks_dram, "hit_blocks_ssd": s.hit_blocks_ssd,
              "indexed_blocks": s.indexed_blocks, "dram_blocks": 0, "ssd_blocks": 0}
    for node in s.nodes:
        for t in node.tiers:
            if t.tier == common_pb2.TIER_DRAM:
                counts["dram_blocks"] += t.blocks
            elif t.tier == common_pb2.TIER_SSD:
                counts["ssd_blocks"] += t.blocks
    return counts


def _status_text(master: str) -> str:
    from kvpool.status import cluster_status, render_status

    s = cluster_status(master, timeout=10)
    return render_status(master, s)


class _Runner:
    """Starts one driver process a phase, all alike but for the connector (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, python: str, work: Path, progress: Callable[[str], None]):
        self.args, self.python, self.work, self.progress = args, python, work, progress
        self.env = vllm_env(python, cpus=args.cpus, kv_cache_gib=args.kv_cache_gib, in_process=not args.multiprocess)
        self.env["VLLM_LOGGING_LEVEL"] = "WARNING"
        self.env["PYTHONUNBUFFERED"] = "1"

    def phase(self, name: str, connector: str | None, requests: list[tuple[str, int]],
              extra_env: dict[str, str] | None = None, kvpool_config: str | None = None, load_mode: str = "sync",
              **extra_spec: Any) -> list[Request]:
        slug = name.replace(" ", "-")
        spec = {"model": str(self.work / "model"), "prompts": str(self.work / "prompts.json"),
                "prompt_tokens": self.args.prompt_tokens, "block_size": self.args.block_size,
                "dtype": self.args.dtype, "connector": connector, "kvpool_config": kvpool_config,
                "load_mode": load_mode, "requests": requests, "result": str(self.work / f"{slug}.result.json"),
                **extra_spec}
        spec_path = self.work / f"{slug}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.work / f"{slug}.log"
        env = dict(self.env, **(extra_env or {}))
        argv = [self.python, str(Path(__file__).resolve()), "--driver", str(spec_path)]
        if self.args.profile and connector == "kvpool":
            spy = shutil.which("py-spy")
            if spy is None:
                raise ValueError("--profile needs py-spy on PATH (pip install py-spy)")
            out = Path(self.args.profile) / f"{slug}.folded"
            out.parent.mkdir(parents=True, exist_ok=True)
            argv = [spy, "record", "--format", "raw", "--rate", "250", "--nonblocking", "--subprocesses",
                    "-o", str(out), "--", *argv]
        self.progress(f"{name}: a vLLM process, {len(requests)} requests")
        start = time.monotonic()
        with open(log_path, "wb") as log:
            try:
                done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work,
                                      timeout=PHASE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"vllm_ttft: {name} ran past {PHASE_TIMEOUT_S:.0f} s; log {log_path}") from None
        if done.returncode != 0:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            raise RuntimeError(f"vllm_ttft: {name} exited with {done.returncode}:\n{tail}")
        self.progress(f"{name}: done in {time.monotonic() - start:.0f} s")
        return [Request(**r) for r in json.loads((self.work / f"{slug}.result.json").read_text())]


def _check(requests: list[Request], expect_hit: int, block_size: int) -> None:
    """Every request computed what its case says (see the module docstring); RuntimeError naming the first that
    did not."""
    for r in requests:
        if r.case == "warmup":
            continue
        cold = r.case.endswith("cold") or r.case == "cold"
        want = 0 if cold else expect_hit
        if r.cached != want:
            raise RuntimeError(f"vllm_ttft: {r.case} of prompt {r.prompt} had {r.cached} tokens cached, not {want}")
        blocks = expect_hit // block_size
        if r.case in (*DRAM_CASES, "kvpool_ssd", "itl_sync", "itl_async"):
            tier = "ssd" if r.case == "kvpool_ssd" else "dram"
            other = "ssd" if tier == "dram" else "dram"
            m = r.metrics
            got = (m.get(f"vllm:kvpool_hit_blocks_{tier}", 0), m.get(f"vllm:kvpool_hit_blocks_{other}", 0),
                   m.get("vllm:kvpool_loaded_blocks", 0), m.get("vllm:kvpool_load_errors", 0))
            if got != (blocks, 0, blocks, 0):
                raise RuntimeError(f"vllm_ttft: {r.case} of prompt {r.prompt}: the connector found {got[0]:.0f} "
                                   f"blocks in {tier} and {got[1]:.0f} in {other}, loaded {got[2]:.0f} with "
                                   f"{got[3]:.0f} errors; expected all {blocks} from {tier}")


def _push_out_of_dram(master: str, slots: int, block_bytes: int, metrics_port: int) -> None:
    """Put ``slots`` filler blocks (LRU: every older block is evicted from DRAM, demoted to SSD); wait for the
    node to finish writing them."""
    import numpy as np

    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig
    from kvpool.keys import opaque_key

    junk = np.frombuffer(os.urandom(block_bytes), dtype=np.uint8)
    config = ClientConfig(master=master, model="kvpool-bench-vllm-filler", lookup_timeout_s=5.0, io_timeout_s=30.0)
    with PoolClient(config) as pool:
        batch = 16
        for first in range(0, slots, batch):
            keys = [opaque_key(f"bench-vllm-filler-{i}") for i in range(first, min(slots, first + batch))]
            pool.put(keys, [junk] * len(keys))
            if not pool.flush(120):
                raise RuntimeError("vllm_ttft: filler writes did not finish")
    deadline = time.monotonic() + 300
    while _node_counter(metrics_port, "kvpool_demotion_queue_bytes") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("vllm_ttft: the node did not finish demoting to SSD")
        time.sleep(0.1)


def cpu_dtype() -> str:
    """bfloat16 where this CPU has bf16 instructions (vLLM's CPU kernels use them), else float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "float32"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def measure(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every phase of the module docstring, in its order; the requests, the checks' evidence and the setup."""
    import numpy as np
    from local_pool import LocalPool

    python = vllm_python()
    if python is None:
        raise ValueError("no Python with vLLM: run `bash tests/vllm_env.sh` (or set KVPOOL_VLLM_PYTHON)")
    python = str(Path(python).absolute())
    if args.block_size % 32 or args.prompt_tokens <= args.block_size:
        raise ValueError("--block-size must be a multiple of 32 (vLLM on CPU) and --prompt-tokens more than a block")
    if args.prompts < 1:
        raise ValueError("--prompts must be at least 1")
    if args.dtype == "auto":
        args.dtype = cpu_dtype()
    only = set(args.only.split(",")) if args.only else set(PHASES)
    if not only <= set(PHASES):
        raise ValueError(f"--only takes {', '.join(PHASES)} (comma-separated), got {args.only!r}")
    if not args.mooncake:
        only.discard("mooncake")
    if not args.pd:
        only.discard("pd")
    if args.running < 1 or args.settle < 1:
        raise ValueError("--running and --settle must be at least 1")
    versions = {}
    if "mooncake" in only:
        from vllm_peers import ensure_mooncake

        versions["mooncake_check"] = ensure_mooncake(python, install=args.install)
    shape = MODELS[MODEL]
    layers, kv_heads = int(shape["num_hidden_layers"]), int(shape["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = int(shape["hidden_size"]) // int(shape["num_attention_heads"])  # type: ignore[call-overload]
    block_bytes = layers * 2 * kv_heads * head_dim * args.block_size * DTYPE_BYTES[args.dtype]
    blocks = -(-args.prompt_tokens // args.block_size)  # the last, partial one too (it is never saved)
    expect_hit = (args.prompt_tokens - 1) // args.block_size * args.block_size
    dram_slots = 2 * (args.prompts + 1) * blocks + 16
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-vllm-", dir=args.work_dir))
    setup = {"model": f"{MODEL} shape, dummy weights", "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
             "block_size": args.block_size, "block_bytes": block_bytes, "prompts": args.prompts,
             "dram_slots": dram_slots, "running": args.running, "cpus": args.cpus,
             "engine": "multiprocess" if args.multiprocess else
             "in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)", "python": python, **versions}
    evidence: dict[str, Any] = {}
    try:
        save_model(work / "model", MODEL)
        rng = np.random.default_rng(args.seed)
        vocab = int(shape["vocab_size"])  # type: ignore[call-overload]
        sets = 2 if "pd" in only else 1  # the 1P1D phase's prompts (a warm-up and its measured ones) are its own
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(sets * (args.prompts + 1))]
        prompts += [rng.integers(0, vocab, RUNNING_TOKENS).tolist() for _ in range(args.running)]  # ITL's running
        (work / "prompts.json").write_text(json.dumps(prompts))
        measured = range(1, args.prompts + 1)  # prompt 0 is W, the warm-up
        running = list(range(sets * (args.prompts + 1), sets * (args.prompts + 1) + args.running))

        def fill(case: str, repeat: str | None) -> list[tuple[str, int]]:
            reqs = [("warmup", 0)]
            for i in measured:
                reqs += [(case, i)] + ([(repeat, i)] if repeat else [])
            return reqs

        runner = _Runner(args, python, work, progress)
        requests: list[Request] = []
        itl: dict[str, list[dict[str, Any]]] = {}
        if "vllm" in only:
            done = runner.phase("vllm", None, fill("cold", "own"))
            _check(done, expect_hit, args.block_size)
            requests += done
        if not only & {"dram", "modes", "pd", "itl", "mooncake", "ssd"}:
            return {"setup": setup, "requests": requests, "evidence": evidence, "itl": itl}
        with LocalPool(dram_bytes=dram_slots * block_bytes, max_block_bytes=block_bytes,
                       ssd_bytes=max(4 << 30, 4 * dram_slots * block_bytes), ssd_parent=args.work_dir) as pool:
            config = work / "kvpool.json"
            config.write_text(json.dumps({"client": {"master": pool.address}}))
            kvpool_phases = [("kvpool fill", "kvpool_cold", "kvpool_own", "sync")]
            if "dram" in only:
                kvpool_phases.append(("kvpool DRAM", "kvpool_dram", "own_after_dram", "sync"))
            if "modes" in only:
                kvpool_phases += [("kvpool DRAM layerwise", "kvpool_layerwise", "own_after_layerwise", "layerwise"),
                                  ("kvpool DRAM async", "kvpool_async", "own_after_async", "async")]
            for name, case, repeat, mode in kvpool_phases:
                done = runner.phase(name, "kvpool", fill(case, repeat), kvpool_config=str(config), load_mode=mode)
                _check(done, expect_hit, args.block_size)
                requests += done
                evidence[f"master after {name}"] = _master_counts(pool.address)
            if "pd" in only:
                from vllm_pd import pd_phase

                done = pd_phase(runner, str(config), range(args.prompts + 1, 2 * (args.prompts + 1)))
                _check(done, expect_hit, args.block_size)
                requests += done
                evidence["master after kvpool 1P1D"] = _master_counts(pool.address)
            for mode in ("sync", "async") if "itl" in only else ():
                name = f"kvpool ITL {mode}"
                runner.phase(name, "kvpool", [], kvpool_config=str(config), load_mode=mode,
                             max_num_seqs=args.running + 2,
                             itl={"running": running, "hits": list(measured), "settle": args.settle})
                records = json.loads((work / f"{name.replace(' ', '-')}.result.json.itl").read_text())
                for r in records:
                    if r["cached"] != expect_hit or r["loaded_blocks"] != expect_hit // args.block_size:
                        raise RuntimeError(f"vllm_ttft: {name}: hit {r['prompt']} had {r['cached']} tokens cached "
                                           f"and {r['loaded_blocks']:.0f} blocks loaded, not {expect_hit} and "
                                           f"{expect_hit // args.block_size}")
                itl[mode] = records
            if "mooncake" in only:
                from vllm_peers import MooncakeStore

                with MooncakeStore(python) as store:
                    phases: list[tuple[str, str, str | None]] = [("mooncake fill", "mooncake_cold", None),
                                                                  ("mooncake hit", "mooncake", "own_after_mooncake")]
                    for name, case, again in phases:
                        done = runner.phase(name, "mooncake", fill(case, again), extra_env=store.vllm_env())
                        _check(done, expect_hit, args.block_size)
                        requests += done
                    if not store.alive():
                        raise RuntimeError(f"vllm_ttft: a Mooncake process died:\n{store.log_tail()}")
            if "ssd" not in only:
                return {"setup": setup, "requests": requests, "evidence": evidence, "itl": itl}
            progress(f"kvpool SSD: {dram_slots} filler blocks push every prompt block out of DRAM")
            _push_out_of_dram(pool.address, dram_slots, block_bytes, pool.metrics_port)
            before = _master_counts(pool.address)
            promotions = _node_counter(pool.metrics_port, "kvpool_promotions")
            done = runner.phase("kvpool SSD", "kvpool", fill("kvpool_ssd", "own_after_ssd"),
                                kvpool_config=str(config))
            _check(done, expect_hit, args.block_size)
            requests += done
            after = _master_counts(pool.address)
            promoted = _node_counter(pool.metrics_port, "kvpool_promotions") - promotions
            ssd_hits = after["hit_blocks_ssd"] - before["hit_blocks_ssd"]
            read = (args.prompts + 1) * (expect_hit // args.block_size)
            evidence.update({"master before kvpool SSD": before, "master after kvpool SSD": after,
                             "node promotions in kvpool SSD": promoted, "blocks read in kvpool SSD": read,
                             "kvpool status after kvpool SSD": _status_text(pool.address)})
            if promoted < read or ssd_hits < read:
                raise RuntimeError(f"vllm_ttft: the SSD phase read {read} blocks but the node promoted {promoted:.0f}"
                                   f" from SSD and the master counted {ssd_hits} SSD hits")
    finally:
        if args.keep:
            progress(f"logs and specs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {"setup": setup, "requests": requests, "evidence": evidence, "itl": itl}


# -- report ------------------------------------------------------------------------------------------


PARTS = {"lookup": "trace:lookup_s", "read": "trace:get_s", "scatter": "trace:scatter_s",
         "load": "vllm:kvpool_load_seconds"}


def summarize(requests: list[Request], itl: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Medians per case; the aims' ratios of medians; per hit case, over its prompts, the median ratio to and
    the median difference from the ``own`` hit of the same prompt served right after it in the same process
    (``paired``, ``overhead_s``), and the layer-wise aim on those differences; the ITL phases' medians per
    load mode (:func:`vllm_itl.summarize`); the kvpool connector's parts (medians, seconds:
    ``lookup`` the scheduler's pool lookup, ``read`` the pool read into staging, ``scatter`` the copies into
    vLLM's blocks, ``load`` the connector's own load time, read plus scatter plus its bookkeeping)."""
    by_case: dict[str, list[Request]] = {}
    for r in requests:
        if r.case != "warmup":
            by_case.setdefault(r.case, []).append(r)
    medians = {c: statistics.median(r.ttft_s for r in rs) for c, rs in by_case.items()}
    paired: dict[str, float] = {}
    overhead: dict[str, float] = {}
    for case, ref in PAIRED.items():
        own = {r.prompt: r.ttft_s for r in by_case.get(ref, [])}
        pairs = [(r.ttft_s, own[r.prompt]) for r in by_case.get(case, []) if r.prompt in own]
        if pairs:
            paired[case] = statistics.median(t / o for t, o in pairs)
            overhead[case] = statistics.median(t - o for t, o in pairs)
    aims = []
    for case, ref, limit in AIMS:
        if case in medians and ref in medians:
            ratio = medians[case] / medians[ref]
            aims.append({"case": case, "reference": ref, "limit": limit, "ratio": ratio, "met": ratio <= limit})
    parts = {c: {part: statistics.median(r.metrics.get(name, 0.0) for r in rs) for part, name in PARTS.items()}
             for c, rs in by_case.items() if c.startswith("kvpool_")}
    if "kvpool_layerwise" in overhead and overhead.get("kvpool_dram", 0) > 0:
        ratio = overhead["kvpool_layerwise"] / overhead["kvpool_dram"]
        aims.append({"case": "kvpool_layerwise", "reference": "kvpool_dram", "limit": LAYERWISE_AIM, "ratio": ratio,
                     "met": ratio <= LAYERWISE_AIM, "paired_added": True})
    summary: dict[str, Any] = {"median_s": medians, "paired": paired, "overhead_s": overhead, "aims": aims,
                               "kvpool_parts_s": parts, "n": {c: len(rs) for c, rs in by_case.items()}}
    if itl:
        summary["itl"] = {mode: vllm_itl.summarize(records) for mode, records in itl.items()}
    return summary


def render(report: dict[str, Any]) -> str:
    """The report as the table docs/benchmarks.md shows."""
    setup, summary = report["setup"], report["summary"]
    by_case: dict[str, list[Request]] = {}
    for r in report["requests"]:
        by_case.setdefault(r.case, []).append(r)
    medians, overhead = summary["median_s"], summary["overhead_s"]
    lines = [
        (f"model {setup['model']}, {setup['dtype']}, prompt {setup['prompt_tokens']} tokens, blocks of "
         f"{setup['block_size']} ({setup['block_bytes'] // 1024} KiB), {setup['prompts']} prompts, max_tokens 1; "
         f"OpenMP on cpus {setup['cpus']}; {setup['engine']}"),
        "",
        "| case | TTFT ms median | min | max | cached tokens | / own (medians) | paired / own | paired +ms "
        "| lookup ms | pool read ms | scatter ms | connector load ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in CASES:
        rs = by_case.get(case)
        if not rs:
            continue
        ttft = [r.ttft_s * 1e3 for r in rs]
        vs = f"{medians[case] / medians['own']:.2f}" if "own" in medians and case != "own" else ""
        paired = f"{summary['paired'][case]:.2f}" if case in summary["paired"] else ""
        plus = f"{overhead[case] * 1e3:.1f}" if case in overhead else ""
        parts = summary["kvpool_parts_s"].get(case)
        part_cells = [f"{parts[p] * 1e3:.1f}" for p in PARTS] if parts else [""] * len(PARTS)
        cells = [LABELS[case], f"{medians[case] * 1e3:.1f}", f"{min(ttft):.1f}", f"{max(ttft):.1f}",
                 str(statistics.median(r.cached for r in rs)), vs, paired, plus, *part_cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "aims (ratio of medians, same run):"]
    for aim in summary["aims"]:
        what = (f"{aim['case']} paired +ms <= {aim['limit']} x {aim['reference']} paired +ms" if
                aim.get("paired_added") else f"{aim['case']} <= {aim['limit']} x {aim['reference']}")
        lines.append(f"- {what}: {aim['ratio']:.2f} ({'met' if aim['met'] else 'MISSED'})")
    for case, ref, limit in AIMS:
        if case not in medians or ref not in medians:
            lines.append(f"- {case} <= {limit} x {ref}: not measured")
    if "kvpool_dram" in overhead and "mooncake" in overhead and overhead["mooncake"] > 0:
        lines.append(f"- what each store adds to vLLM's own hit (paired +ms): kvpool DRAM "
                     f"{overhead['kvpool_dram'] * 1e3:.1f} ms, Mooncake {overhead['mooncake'] * 1e3:.1f} ms "
                     f"({overhead['kvpool_dram'] / overhead['mooncake']:.2f} x)")
    lines += ["", ("paired: median over prompts of TTFT / (and minus) the own hit of the same prompt served right "
                   "after it in the same process. lookup, pool read, scatter: kvpool connector parts (medians).")]
    if summary.get("itl"):
        lines += ["", *vllm_itl.render(summary["itl"], setup.get("running", 0))]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=5, help="distinct measured prompts (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM block size, a multiple of 32 on CPU "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                        help="model and KV dtype; auto: bfloat16 where the CPU has bf16 instructions (avx512_bf16, "
                        "amx_bf16), else float32 (vLLM's bf16 falls back to a ~5x slower path) (default: auto)")
    parser.add_argument("--cpus", default="0-1", help="cores vLLM's OpenMP threads are pinned to, the same in every "
                        "process (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default: %(default)s)")
    parser.add_argument("--multiprocess", action="store_true", help="vLLM's usual process layout (engine core in "
                        "its own process; ~60 s a start here) instead of the in-process engine core (~20 s)")
    parser.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                        help="skip the MooncakeStoreConnector phases")
    parser.add_argument("--no-pd", dest="pd", action="store_false",
                        help="skip the 1P1D phase (a prefill and a decode vLLM process handing prompts off through "
                        "the pool)")
    parser.add_argument("--no-install", dest="install", action="store_false",
                        help="fail instead of installing Mooncake (" + "mooncake-transfer-engine-non-cuda"
                        + " into the vLLM Python, and its Debian libraries) when it is missing")
    parser.add_argument("--only", default="", help=f"run only these phases, comma-separated: {', '.join(PHASES)} "
                        "(vllm: vLLM alone; dram: kvpool's whole-request DRAM hit; modes: its layer-wise and async "
                        "DRAM hits; pd: the 1P1D hand-off; itl: the running requests' ITL during a hit's load, sync "
                        "and async; mooncake; "
                        "ssd; default: all)")
    parser.add_argument("--running", type=int, default=4, help="requests decoding in the ITL phases "
                        "(default: %(default)s)")
    parser.add_argument("--settle", type=int, default=6, help="steps with no load before each hit in the ITL phases "
                        "(the baseline; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="prompts (default: %(default)s)")
    parser.add_argument("--work-dir", default=None, help="parent of the temporary directory (model config, logs, "
                        "the pool's SSD directory; default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (vLLM logs)")
    parser.add_argument("--profile", metavar="DIR", default=None, help="run the kvpool phases' vLLM processes "
                        "under py-spy (250 Hz, all threads) and write their folded stacks to DIR/<phase>.folded")
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of the table")


def run(args: argparse.Namespace) -> int:
    report = measure(args, progress=lambda s: print(f"vllm_ttft: {s}", file=sys.stderr, flush=True))
    report["summary"] = summarize(report["requests"], report.get("itl"))
    if args.json:
        out = dict(report, requests=[asdict(r) for r in report["requests"]])
        print(json.dumps(out, indent=2))
    else:
        print(render(report))
        for name, value in report["evidence"].items():
            if isinstance(value, str):
                print(f"\n{name}:\n{value}")
            else:
                print(f"{name}: {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/vllm_ttft.py", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"vllm_ttft: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        sys.exit(driver_main(sys.argv[2]))
    sys.exit(main())
