"""One client process of ``kvpool bench soak``: a mixed, checked prefix workload against a pool until told to stop.

Run by the soak driver as ``python -m kvpool.bench.soak_worker '<spec JSON>'``
(:class:`WorkerSpec`). The protocol, one JSON object a line:

- the worker builds its client, then prints ``{"event": "ready"}``;
- it waits for one line on stdin (``go``), runs the workload, and prints
  ``{"event": "status", ...counts}`` about once a second;
- a ``stop`` line or the end of stdin (the driver is gone) stops it: it
  flushes, closes its client and prints ``{"event": "done", ...counts}``.

Each request is a token list: one of a few shared prefixes (Zipf-popular, the
same in every worker, whole blocks) plus a unique suffix (1-4 blocks and a
partial tail), or now and then a follow-up that extends this worker's
previous request. Its keys come from :meth:`KVCacheClient.block_keys`; then
``lookup``, ``get`` of the hit run into preallocated buffers with every byte
checked against the block's deterministic payload (derived from its key,
:class:`~kvpool.bench.trace.Payloads`), ``put`` of the blocks after the loaded
run, ``flush``. A ``client`` worker keeps one :class:`KVCacheClient` the
whole time; a ``churn`` worker makes a new one for every two requests and
closes it (alternating shared memory / network and HBM / none), so leaks of
connections, mappings, threads or memory per client show up as growth.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.bench.trace import VOCAB, Payloads
from kvpool.metrics import error_counts
from kvpool.vocabulary import Tier

MODEL = "kvpool-soak"
PREFIX_SEED = 0x50A4  # every worker draws the same shared prefixes
STATUS_INTERVAL_S = 1.0
RACE_KINDS = frozenset({"block_gone", "slot_reused"})  # eviction outran a lookup: a miss by design, not a failure
SLOW_REQUEST_S = 1.0
SLOW_CALL_S = (0.25, 0.5, 2.5)  # latency histogram bounds (kvpool.metrics.LATENCY_BUCKETS) slow calls are counted at


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process does (JSON on its command line)."""

    index: int
    role: str  # "client" or "churn"
    master: str
    block_bytes: int
    hbm_blocks: int = 0  # client role: its HBM tier; churn role: the HBM tier of every other client it makes
    shared_memory: bool = True  # client role only; churn alternates
    prefixes: int = 64
    max_prefix_blocks: int = 8
    max_suffix_blocks: int = 4
    max_blocks: int = 16
    follow_up: float = 0.25
    churn_requests: int = 2

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        spec = cls(**json.loads(text))
        if spec.role not in ("client", "churn"):
            raise ValueError(f"unknown worker role {spec.role!r}")
        return spec


@dataclass
class WorkerCounts:
    """What a worker did; the driver sums them over workers."""

    requests: int = 0
    blocks: int = 0  # blocks looked up
    hits: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "dram": 0, "ssd": 0})
    lost: int = 0  # promised by the lookup, not delivered by get
    put_blocks: int = 0
    put_refused: int = 0  # blocks the client did not accept for the pool
    wrong_blocks: int = 0
    bytes_moved: int = 0  # loaded + put block bytes
    errors: dict[str, int] = field(default_factory=dict)  # kvpool_errors_total by kind (this worker's clients)
    exceptions: dict[str, int] = field(default_factory=dict)  # unexpected exceptions by type
    clients_opened: int = 0
    clients_closed: int = 0
    max_request_s: float = 0.0  # the slowest request (lookup + get + put + flush)
    slow_requests: int = 0  # requests slower than SLOW_REQUEST_S
    slow_calls: dict[str, int] = field(default_factory=dict)  # "<op> > <s>s" -> pool calls that slow

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class PromptSource:
    """Token lists of a prefix-shaped workload (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, block_tokens: int, seed: int):
        shared = np.random.default_rng(PREFIX_SEED)
        self.block_tokens = block_tokens
        self.spec = spec
        self.prefixes = [
            shared.integers(0, VOCAB, block_tokens * int(shared.integers(1, spec.max_prefix_blocks + 1)),
                            dtype=np.uint32)
            for _ in range(spec.prefixes)
        ]
        weights = 1.0 / np.arange(1, spec.prefixes + 1)
        self.weights = weights / weights.sum()
        self.rng = np.random.default_rng(seed)
        self.previous: np.ndarray | None = None

    def next(self) -> np.ndarray:
        rng, bt, spec = self.rng, self.block_tokens, self.spec
        n = bt * int(rng.integers(1, spec.max_suffix_blocks + 1)) + int(rng.integers(0, bt))
        suffix = rng.integers(0, VOCAB, n, dtype=np.uint32)
        prev = self.previous
        if prev is not None and rng.random() < spec.follow_up and (len(prev) + n) // bt <= spec.max_blocks:
            tokens = np.concatenate([prev, suffix])
        else:
            prefix = self.prefixes[int(rng.choice(len(self.prefixes), p=self.weights))]
            tokens = np.concatenate([prefix, suffix])
        self.previous = tokens
        return tokens


def slow_calls(registry: Any) -> dict[str, int]:
    """Pool calls (``kvpool_<op>_seconds``: lookup, get, put) slower than each of :data:`SLOW_CALL_S`."""
    out: dict[str, int] = {}
    for family in registry.collect():
        if family.type != "histogram" or not family.name.endswith("_seconds"):
            continue
        op = family.name.removeprefix("kvpool_").removesuffix("_seconds")
        buckets = {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")}
        total = buckets.get("+Inf", 0.0)
        for bound in SLOW_CALL_S:
            under = buckets.get(str(float(bound)))
            if under is not None and total - under:
                out[f"{op} > {bound:g}s"] = int(total - under)
    return out


def _add(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    out = dict(into)
    for k, v in more.items():
        out[k] = out.get(k, 0) + v
    return out


class Worker:
    """The workload of one process; :meth:`run` until ``stop`` is set."""

    def __init__(self, spec: WorkerSpec):
        from kvpool.bench.replay import block_layout
        from kvpool.buffers import aligned_empty

        self.spec = spec
        self.layout = block_layout(spec.block_bytes)
        self.payloads = Payloads(spec.block_bytes)
        self.prompts = PromptSource(spec, self.layout.block_size, seed=1000 + spec.index)
        rows = spec.max_blocks + 1
        self.buf = aligned_empty(rows * spec.block_bytes).reshape(rows, spec.block_bytes)
        self.rows = list(self.buf)
        self.staging = aligned_empty(rows * spec.block_bytes).reshape(rows, spec.block_bytes)
        self.counts = WorkerCounts()
        self._closed_errors: dict[str, int] = {}  # errors of clients already closed (churn)
        self._closed_slow: dict[str, int] = {}  # slow calls of clients already closed
        self._lock = threading.Lock()
        if spec.hbm_blocks > 0:
            import torch

            torch.set_num_threads(1)  # two shared cores: one copy thread per worker
        self.client = self._new_client(0) if spec.role == "client" else None

    def _new_client(self, n: int) -> Any:
        from kvpool.client.kvclient import KVCacheClient
        from kvpool.config import ClientConfig

        spec = self.spec
        churn = spec.role == "churn"
        config = ClientConfig(
            master=spec.master, worker_id=f"soak-{spec.index}-{n}", model=MODEL, layout=self.layout,
            hbm_blocks=(spec.hbm_blocks if n % 2 else 0) if churn else spec.hbm_blocks, device="cpu",
            shared_memory=(n // 2) % 2 == 0 if churn else spec.shared_memory,
            put_queue_bytes=max(8 << 20, 2 * (spec.max_blocks + 1) * spec.block_bytes), metrics_port=0,
        )
        client = KVCacheClient(config)
        self.counts.clients_opened += 1
        return client

    def _close_client(self, client: Any) -> None:
        client.close()
        with self._lock:
            self._closed_errors = _add(self._closed_errors, error_counts(client.registry))
            self._closed_slow = _add(self._closed_slow, slow_calls(client.registry))
            self.counts.clients_closed += 1

    def snapshot(self) -> dict[str, Any]:
        """The counts so far, errors of the open client included."""
        with self._lock:
            errors, slow = dict(self._closed_errors), dict(self._closed_slow)
            client = self.client
        if client is not None:
            errors = _add(errors, error_counts(client.registry))
            slow = _add(slow, slow_calls(client.registry))
        self.counts.errors, self.counts.slow_calls = errors, slow
        return self.counts.to_json()

    def request(self, client: Any) -> None:
        """One request: lookup, get (checked), put of the rest, flush."""
        c = self.counts
        start = time.monotonic()
        tokens = self.prompts.next()
        keys = client.block_keys(tokens)
        if not keys:
            return
        res = client.lookup(keys)
        hit = res.hit_blocks
        loaded = client.get(keys[:hit], self.rows[:hit], res) if hit else 0
        c.lost += hit - loaded
        c.wrong_blocks += self.payloads.wrong(keys[:loaded], self.buf)
        in_hbm = min(loaded, res.hbm_blocks)
        c.hits["hbm"] += in_hbm
        for loc in res.pool[: loaded - in_hbm]:
            c.hits["dram" if loc.tier == Tier.DRAM else "ssd"] += 1
        rest = keys[loaded:]
        if rest:
            values = self.payloads.make(rest, out=self.staging[: len(rest)])
            accepted = client.put(rest, list(values))
            c.put_blocks += len(rest)
            c.put_refused += accepted.count(False)
        client.flush()
        took = time.monotonic() - start
        c.max_request_s = max(c.max_request_s, took)
        c.slow_requests += took > SLOW_REQUEST_S
        c.requests += 1
        c.blocks += len(keys)
        c.bytes_moved += (loaded + len(rest)) * self.spec.block_bytes

    def run(self, stop: threading.Event, on_status: Any) -> None:
        """Requests until ``stop``; ``on_status()`` about once a second."""
        last = time.monotonic()
        n = 1
        shown = 0
        while not stop.is_set():
            try:
                if self.spec.role == "client":
                    self.request(self.client)
                else:
                    client = self._new_client(n)
                    with self._lock:
                        self.client = client
                    try:
                        for _ in range(self.spec.churn_requests):
                            self.request(client)
                    finally:
                        with self._lock:
                            self.client = None
                        self._close_client(client)
                    n += 1
            except Exception as exc:  # noqa: BLE001 - counted, shown (a few), and the soak goes on
                kind = type(exc).__name__
                self.counts.exceptions[kind] = self.counts.exceptions.get(kind, 0) + 1
                if shown < 5:
                    traceback.print_exc(file=sys.stderr)
                    shown += 1
                time.sleep(0.1)
            now = time.monotonic()
            if now - last >= STATUS_INTERVAL_S:
                on_status()
                last = now

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            self._close_client(client)


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _watch_stdin(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpool.bench.soak_worker SPEC_JSON``: the protocol in the module docstring."""
    import logging

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m kvpool.bench.soak_worker SPEC_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(WorkerSpec.from_json(args[0]))
    try:
        _emit("ready")
        if sys.stdin.readline().strip() != "go":
            return 0
        stop = threading.Event()
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True, name="soak-stdin").start()
        worker.run(stop, lambda: _emit("status", **worker.snapshot()))
    finally:
        worker.close()
    _emit("done", **worker.snapshot())
    return 0


if __name__ == "__main__":
    sys.exit(main())
