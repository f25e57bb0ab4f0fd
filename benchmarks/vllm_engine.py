"""One real vLLM engine in a child process, driven request by request over JSON lines (no HTTP server).

Prefill/decode disaggregation needs two vLLM instances alive at once and a
proxy between them; ``benchmarks/vllm_ttft.py``'s 1P1D row and
``tests/engines/test_engine_vllm_pd.py`` run each instance as one of these
processes and play the proxy themselves (:mod:`kvpool.engines.vllm.pd_proxy`
says what goes to each instance).

The child (``<vllm python> benchmarks/vllm_engine.py SPEC.json``,
:func:`engine_main`) builds ``vllm.LLM`` from the spec, with the
``KVPoolConnector`` in the spec's ``kv_role`` or no connector, and serves
one request at a time through vLLM's own engine (``LLMEngine.add_request``
and ``step``: the real scheduler, connector and model runner; the in-process
engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Between commands it
keeps stepping the engine while its scheduler holds requests, as ``vllm
serve``'s engine loop does (a producer's finished requests wait there for
their hand-off), pausing 1 ms between such idle steps. It reads one command
a line on stdin and writes one event a line on stdout, prefixed
``KVPOOL-ENGINE``:

- ``{"op": "generate", "id", "prompt": [token ids], "max_tokens", "logprobs": bool, "kv_transfer_params": {}}``:
  events ``{"event": "first_step", "id"}`` after the engine's first step
  with the request (the scheduler has asked the connector about it), then
  ``{"event": "done", "id", "tokens", "logprobs" (the sampled tokens'), "cached"
  (``num_cached_tokens``), "ttft_s" (vLLM's ``first_token_latency``), "wall_s",
  "queued_to_scheduled_s", "scheduled_to_first_token_s", "kv_transfer_params"
  (the engine's), "counters" (vLLM's ``vllm:kvpool_*`` and prefix-cache
  counters' growth)}``. Greedy sampling.
- ``{"op": "drain", "timeout_s"}``: steps the engine until its scheduler
  holds no request (a producer's hand-offs reported, their blocks freed):
  ``{"event": "drained", "ok": bool}``.
- ``{"op": "counters"}``: ``{"event": "counters", "counters"}``, their totals.
- ``{"op": "quit"}``: shuts the engine down and exits 0.

The parent side is :class:`EngineProcess`.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

PREFIX = "KVPOOL-ENGINE "


def _say(**fields: Any) -> None:
    print(PREFIX + json.dumps(fields), flush=True)


def _build(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("kv_role"):
        kv = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.engines.vllm",
                              kv_role=spec["kv_role"], kv_connector_extra_config=spec.get("kvpool", {}))
    return LLM(model=spec["model"], skip_tokenizer_init=True, block_size=spec["block_size"], dtype=spec["dtype"],
               load_format=spec.get("load_format", "auto"), max_model_len=spec["max_model_len"],
               max_num_batched_tokens=spec.get("max_num_batched_tokens"), max_num_seqs=spec.get("max_num_seqs"),
               enforce_eager=True, disable_log_stats=False, kv_transfer_config=kv, seed=0)


def _generate(llm: Any, cmd: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_ttft import counters

    extra = {"kv_transfer_params": cmd["kv_transfer_params"]} if cmd.get("kv_transfer_params") else None
    params = SamplingParams(max_tokens=cmd.get("max_tokens", 1), temperature=0.0, detokenize=False,
                            logprobs=0 if cmd.get("logprobs") else None, extra_args=extra)
    engine = llm.llm_engine
    before = counters()
    start = time.perf_counter()
    engine.add_request(cmd["id"], TokensPrompt(prompt_token_ids=cmd["prompt"]), params)
    first, out = True, None
    while out is None:
        for o in engine.step():
            if o.finished:
                out = o
        if first:
            _say(event="first_step", id=cmd["id"])
            first = False
    wall = time.perf_counter() - start
    after = counters()
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)] if completion.logprobs else []
    m = out.metrics
    if m is None or not m.first_token_latency:
        raise RuntimeError("vLLM returned no request metrics (disable_log_stats must be False)")
    _say(event="done", id=cmd["id"], tokens=tokens, logprobs=logprobs, cached=int(out.num_cached_tokens or 0),
         ttft_s=float(m.first_token_latency), wall_s=wall, queued_to_scheduled_s=float(m.scheduled_ts - m.queued_ts),
         scheduled_to_first_token_s=float(m.first_token_ts - m.scheduled_ts), kv_transfer_params=out.kv_transfer_params,
         counters={k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)})


def _holds_requests(llm: Any) -> bool:
    """Whether the engine core's scheduler holds requests (finished ones waiting for their hand-off included)."""
    return bool(llm.llm_engine.engine_core.engine_core.scheduler.has_requests())


def _idle_step(llm: Any) -> None:
    llm.llm_engine.step()
    time.sleep(0.001)  # the hand-offs' thread needs the cores more than this loop does


def _drain(llm: Any, timeout_s: float) -> bool:
    """Step until the engine core's scheduler holds no request."""
    deadline = time.monotonic() + timeout_s
    while _holds_requests(llm):
        if time.monotonic() > deadline:
            return False
        _idle_step(llm)
    return True


def _commands() -> queue.Queue[dict[str, Any] | None]:
    """Commands from stdin, parsed by a thread (None: stdin closed)."""
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read, daemon=True).start()
    return commands


def engine_main(spec_path: str) -> int:
    """The child: see the module docstring."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        llm = _build(spec)
    except Exception as exc:  # noqa: BLE001 - the parent reads why
        _say(event="refused", error=f"{type(exc).__name__}: {exc}")
        return 1
    _say(event="ready")
    commands = _commands()
    while True:
        try:
            cmd = commands.get_nowait() if _holds_requests(llm) else commands.get()
        except queue.Empty:
            _idle_step(llm)
            continue
        if cmd is None:
            break
        if cmd["op"] == "generate":
            _generate(llm, cmd)
        elif cmd["op"] == "drain":
            _say(event="drained", ok=_drain(llm, float(cmd.get("timeout_s", 60))))
        elif cmd["op"] == "counters":
            from vllm_ttft import counters

            _say(event="counters", counters=counters())
        elif cmd["op"] == "quit":
            break
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    os._exit(0)  # not the interpreter's teardown: vLLM's threads can hold it for long


class EngineError(RuntimeError):
    """The engine process refused to start, exited, or did not answer in time; the message ends with its log."""


class EngineProcess:
    """The parent's handle on one :func:`engine_main` child: commands in, events out, its log kept in ``log_path``."""

    def __init__(self, python: str, spec: dict[str, Any], work: Path, name: str, env: dict[str, str]):
        self.name = name
        spec_path = work / f"{name}.engine.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "w")
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), str(spec_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.write(line)
            self._log.flush()
            if line.startswith(PREFIX):
                self._events.put(json.loads(line[len(PREFIX):]))
        self._events.put(None)  # the process closed its output

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next event, which must be ``event``; EngineError otherwise or past ``timeout`` seconds."""
        try:
            got = self._events.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.name}: no {event} within {timeout:.0f} s\n{self.log_tail()}") from None
        if got is None or got.get("event") != event:
            raise EngineError(f"{self.name}: {got} instead of {event}\n{self.log_tail()}")
        return got

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def generate(self, rid: str, prompt: list[int], max_tokens: int = 1, *, timeout: float = 600,
                 logprobs: bool = False, kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request, start to finish (its ``done`` event)."""
        self.start(rid, prompt, max_tokens, logprobs=logprobs, kv_transfer_params=kv_transfer_params,
                   timeout=timeout)
        return self.expect("done", timeout)

    def start(self, rid: str, prompt: list[int], max_tokens: int = 1, *, logprobs: bool = False,
              kv_transfer_params: dict[str, Any] | None = None, timeout: float = 600) -> None:
        """Send a request and wait for its first engine step (then :meth:`expect` ``"done"``)."""
        self.send(op="generate", id=rid, prompt=prompt, max_tokens=max_tokens, logprobs=logprobs,
                  kv_transfer_params=kv_transfer_params)
        self.expect("first_step", timeout)

    def drain(self, timeout: float = 60) -> bool:
        self.send(op="drain", timeout_s=timeout)
        return bool(self.expect("drained", timeout + 30)["ok"])

    def counters(self, timeout: float = 60) -> dict[str, float]:
        """vLLM's ``vllm:kvpool_*`` and prefix-cache counters in the engine now (totals)."""
        self.send(op="counters")
        return dict(self.expect("counters", timeout)["counters"])

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def close(self, timeout: float = 120) -> int:
        """Quit (killed past ``timeout``); its exit code."""
        try:
            if self.proc.poll() is None:
                self.send(op="quit")
            code = self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(10)
        self._log.close()
        return code

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(engine_main(sys.argv[1]))
