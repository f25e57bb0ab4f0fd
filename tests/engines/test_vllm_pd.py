"""Prefill/decode disaggregation in the vLLM connector, without vLLM: what each ``kv_role`` saves, a consumer's wait
for announced blocks, a producer's hand-off and its confirmation by the pool.

The scheduler side is driven with stand-ins for the few attributes of vLLM's ``Request`` and ``SchedulerOutput``
it reads; the pool is an in-memory set of keys. ``tests/engines/test_engine_vllm_pd.py`` runs the same in the real vLLM.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from support import free_port, wait_until

from kvpool.client.faults import PoolFault
from kvpool.client.lookup import PoolRun
from kvpool.engines.vllm.handoff import HandoffWatch
from kvpool.engines.vllm.keys import VllmKeySpace, shard_key
from kvpool.engines.vllm.scheduler import STORED_TOKENS, Handoff, PoolScheduler, Role
from kvpool.engines.vllm.settings import handoff_timeout_s
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout
from kvpool.vocabulary import NodeRef, Tier

BS = 32
SPACE = VllmKeySpace("m", KVLayout("float32", 2, 2, 64, BS), "cpu/test")
NODE = NodeRef("n1", "127.0.0.1:1", "h", "")


@dataclass
class Request:
    """What the connector reads of vLLM's ``Request``."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Pool:
    """An in-memory pool: the keys it holds; ``down`` makes every call a fault (strict, as the scheduler's)."""

    def __init__(self) -> None:
        self.held: set[BlockKey] = set()
        self.down = False
        self.lookups = 0

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> PoolRun:
        if self.down:
            raise PoolFault("unavailable", "down")
        self.lookups += 1
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return PoolRun(list(keys[:n]), bytes([int(Tier.DRAM)] * n), [0] * n, [NODE], [1] * n, [0] * n)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        if self.down:
            raise PoolFault("unavailable", "down")
        return [k in self.held for k in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 for i in range(n)]


def scheduler(role: Role, pool: Pool, clock: Clock | None = None, timeout: float = 2.0) -> PoolScheduler:
    return PoolScheduler(lambda: SPACE, pool, BS, clock or Clock(), role=role, handoff_timeout_s=timeout)


def step(sched: PoolScheduler, request: Request, computed: int, scheduled: int, block_ids: list[int],
         new: bool = True, finished: tuple[str, ...] = ()) -> Any:
    """One step's plan for ``request`` (``block_ids``: all its blocks when new, else the ones added)."""
    rid = request.request_id
    out = SimpleNamespace(num_scheduled_tokens={rid: scheduled}, finished_req_ids=set(finished),
                          scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
                              req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]))
    if new:
        out.scheduled_new_reqs.append(SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=computed))
    else:
        c = out.scheduled_cached_reqs
        c.req_ids.append(rid)
        c.new_block_ids.append((block_ids,) if block_ids else None)
        c.num_computed_tokens.append(computed)
    return sched.plan(out)


def saved_blocks(plan: Any) -> list[int]:
    return [b for job in plan.saves for b in job.block_ids]


def test_the_role_is_vllms_kv_role():
    assert Role.of(is_producer=True, is_consumer=True) is Role.BOTH  # what vLLM says for kv_both
    assert Role.of(True, False) is Role.PRODUCER and Role.of(False, True) is Role.CONSUMER
    assert Role.of(False, False) is Role.BOTH  # a connector without a role


def test_a_consumer_saves_only_the_blocks_its_generated_tokens_fill():
    pool = Pool()
    prompt = tokens(1, 300)  # 9 full blocks and 12 tokens of a 10th
    both, consumer = scheduler(Role.BOTH, pool), scheduler(Role.CONSUMER, pool)
    for sched, want_prefill in ((both, list(range(9))), (consumer, [])):
        r = Request("r", list(prompt))
        assert sched.match(r, 0) == 0
        assert saved_blocks(step(sched, r, 0, 300, list(range(10)))) == want_prefill
        r.output_token_ids = tokens(2, 20)  # the 10th block fills with generated tokens: both save it
        assert saved_blocks(step(sched, r, 319, 1, [], new=False)) == [9]


def announced(stored: int) -> dict[str, Any]:
    return {STORED_TOKENS: stored}


def test_a_consumer_waits_for_announced_blocks_without_a_lookup_each_step_then_loads_them():
    pool, clock = Pool(), Clock()
    sched = scheduler(Role.CONSUMER, pool, clock)
    prompt = tokens(3, 2048)
    keys = sched._state(Request("k", prompt)).keys.upto(prompt, 64)
    r = Request("r", prompt, announced(2048))
    assert sched.match(r, 0) is None  # nothing there yet: ask again later
    asked = pool.lookups
    assert sched.match(r, 0) is None and pool.lookups == asked  # asked again at once: no lookup
    pool.held.update(keys[:40])  # the producer's commits land a batch at a time
    clock.now += 0.01
    assert sched.match(r, 0) is None
    pool.held.update(keys[40:])
    clock.now += 0.01
    assert sched.match(r, 0) == 2016  # 63 blocks: one token is left to compute
    stats = sched.take_stats()
    assert (stats.handoff_waits, stats.handoff_timeouts, stats.lookups, stats.hit_blocks["dram"]) == (1, 0, 1, 63)
    # vLLM asks every step (here every millisecond for 2 s): the pool is asked at gaps doubling to 50 ms
    slow = Request("slow", tokens(12, 2048), announced(2048))
    asked = pool.lookups
    for _ in range(2000):
        assert sched.match(slow, 0) is None
        clock.now += 0.001
    assert 40 <= pool.lookups - asked <= 50
    # vLLM's own cache hit counts: a request whose hit covers what was announced does not wait
    assert sched.match(Request("s", tokens(4, 2048), announced(640)), 640) == 0


def test_a_consumer_stops_waiting_at_the_timeout_and_a_fault_never_waits():
    pool, clock = Pool(), Clock()
    sched = scheduler(Role.CONSUMER, pool, clock, timeout=2.0)
    prompt = tokens(5, 1024)
    keys = sched._state(Request("k", prompt)).keys.upto(prompt, 32)
    pool.held.update(keys[:10])
    r = Request("r", prompt, announced(1024))
    assert sched.match(r, 0) is None
    clock.now += 1.9
    assert sched.match(r, 0) is None
    clock.now += 0.2
    assert sched.match(r, 0) == 10 * BS  # what the pool holds; vLLM computes the rest
    stats = sched.take_stats()
    assert (stats.handoff_waits, stats.handoff_timeouts) == (1, 1)
    pool.down = True
    assert sched.match(Request("f", tokens(6, 1024), announced(1024)), 0) == 0  # a fault: computed at once
    assert sched.take_stats().faults == 1
    pool.down = False
    sched = scheduler(Role.CONSUMER, pool, clock)
    for bad in (None, "1024", True, -32, 1024.0):  # not an announcement: no wait
        assert sched.match(Request(f"b{bad}", tokens(7, 1024), {STORED_TOKENS: bad}), 0) == 0


def test_kv_both_honours_an_announcement_and_a_producer_ignores_it():
    pool = Pool()
    r = Request("r", tokens(8, 512), announced(512))
    assert scheduler(Role.BOTH, pool).match(r, 0) is None
    assert scheduler(Role.PRODUCER, pool).match(Request("r", tokens(8, 512), announced(512)), 0) == 0


def test_a_producer_stores_every_prompt_block_and_hands_the_request_off():
    pool = Pool()
    sched = scheduler(Role.PRODUCER, pool)
    prompt = tokens(9, 330)  # 10 full blocks
    keys = sched._state(Request("k", prompt)).keys.upto(prompt, 10)
    pool.held.update(keys[:2] + keys[3:4])  # vLLM's own cache hit 4 blocks; the pool lost block 2 meanwhile
    r = Request("r", prompt)
    assert sched.match(r, 4 * BS) == 0  # block 4 is not in the pool: 0 to load
    plan = step(sched, r, 4 * BS, 330 - 4 * BS, list(range(100, 111)))
    assert [job.block_ids for job in plan.saves] == [[102], list(range(104, 110))]  # the lost hit, then the rest
    assert plan.saves[0].keys == [keys[2]]
    handoff, params = sched.finished(r)
    assert params == {STORED_TOKENS: 320}
    assert handoff == Handoff("r", keys)
    assert step(sched, Request("x", tokens(10, 40)), 0, 0, [], finished=("r",)).handoffs == [handoff]
    assert sched.plan(step_output_empty()).handoffs == []  # handed to the workers once
    # a request that finished before it computed anything stored nothing: vLLM frees its blocks at once
    early = Request("early", tokens(11, 100))
    sched.match(early, 0)
    assert sched.finished(early) == (None, {STORED_TOKENS: 0})
    # the other roles hand nothing off
    both = scheduler(Role.BOTH, pool)
    done = Request("b", tokens(9, 330))
    both.match(done, 0)
    step(both, done, 0, 330, list(range(11)))
    assert both.finished(done) == (None, None)


def step_output_empty() -> Any:
    return SimpleNamespace(num_scheduled_tokens={}, finished_req_ids=set(), scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                 num_computed_tokens=[]))


class WritePool:
    """The worker's side of a pool for a watch: ``flush`` answers from ``flushes`` (then True), ``exists`` from
    ``held``; each call is recorded."""

    def __init__(self, held: set[BlockKey], flushes: list[bool] | None = None):
        self.held = held
        self.flushes = list(flushes or [])
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def flush(self, timeout: float | None = None) -> bool:
        self.gate.wait(10)
        self.calls.append("flush")
        return self.flushes.pop(0) if self.flushes else True

    def exists(self, keys: list[BlockKey]) -> list[bool]:
        self.calls.append("exists")
        return [k in self.held for k in keys]


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


def wait_done(watch: HandoffWatch, n: int, timeout: float = 10.0) -> set[str]:
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        done |= watch.take_done()
        time.sleep(0.005)
    assert len(done) == n, done
    return done


def test_a_hand_off_is_reported_once_its_blocks_are_confirmed_or_at_once_when_one_is_lost():
    pool = WritePool({key(1), key(2), key(3)})
    watch = HandoffWatch(pool, timeout_s=30.0)
    watch.add([Handoff("ok", [key(1), key(2)]), Handoff("lost", [key(3), key(4)])])
    assert wait_done(watch, 2) == {"ok", "lost"}  # key 4 missing after a good flush: no point waiting
    assert pool.calls[:2] == ["flush", "exists"]
    stats = watch.take_stats()
    assert (stats.confirmed, stats.failed) == (1, 1)
    assert watch.take_done() == set()  # reported exactly once
    watch.close()


def test_a_hand_off_whose_flush_fails_is_tried_again_until_its_deadline_then_reported():
    pool = WritePool({key(1)}, flushes=[False, False])
    watch = HandoffWatch(pool, timeout_s=30.0)
    watch.add([Handoff("a", [key(1)])])
    assert wait_done(watch, 1) == {"a"}
    assert pool.calls == ["flush", "flush", "flush", "exists"]  # the pool came back before the deadline
    assert watch.take_stats().confirmed == 1
    down = WritePool(set(), flushes=[False] * 1000)
    watch = HandoffWatch(down, timeout_s=0.2)
    start = time.monotonic()
    watch.add([Handoff("b", [key(1)])])
    assert wait_done(watch, 1) == {"b"} and time.monotonic() - start >= 0.2
    assert watch.take_stats().failed == 1 and "exists" not in down.calls
    watch.close()


def test_a_watch_keys_its_shard_and_reports_what_is_pending_when_it_closes():
    shard1 = WritePool({shard_key(key(1), 1)})
    watch = HandoffWatch(shard1, timeout_s=30.0, shard=1)
    watch.add([Handoff("a", [key(1)])])
    assert wait_done(watch, 1) == {"a"} and watch.take_stats().confirmed == 1
    stuck = WritePool(set())
    stuck.gate.clear()  # its flush hangs
    watch = HandoffWatch(stuck, timeout_s=30.0)
    watch.add([Handoff("b", [key(2)])])
    threading.Timer(0.1, stuck.gate.set).start()
    watch.close()
    watch.add([Handoff("c", [key(3)])])
    assert watch.take_done() == {"b", "c"}


@pytest.mark.parametrize(("value", "want"), [(None, 2.0), (1, 0.001), (600_000, 600.0)])
def test_the_handoff_timeout_setting(value, want):
    extra = {} if value is None else {"kvpool_handoff_timeout_ms": value}
    assert handoff_timeout_s(extra) == want
    for bad in (0, 600_001, 1.5, "100", True):
        with pytest.raises(ValueError, match=r"extra_config\.kvpool_handoff_timeout_ms must be an integer"):
            handoff_timeout_s({"kvpool_handoff_timeout_ms": bad})


class Backend:
    """A stand-in for one vLLM OpenAI server: records each POST body, answers ``reply`` (SSE lines if streamed)."""

    def __init__(self, reply: dict[str, Any]):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        backend = self
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                backend.bodies.append(body)
                stream = body.get("stream")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
                self.end_headers()
                if stream:
                    for i in range(3):
                        self.wfile.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.wfile.write(json.dumps(backend.reply).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post(url: str, body: Any) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_proxy_sends_the_prompt_to_prefill_for_one_token_then_to_decode_with_what_prefill_returned():
    from kvpool.engines.vllm.pd_proxy import ProxyServer, Upstreams

    handed = {STORED_TOKENS: 2048}
    prefill = Backend({"choices": [{"text": "x"}], "kv_transfer_params": handed})
    decode = Backend({"choices": [{"text": "decoded"}]})
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = ProxyServer(("127.0.0.1", 0), Upstreams([prefill.url, dead], [decode.url]))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0}
        status, data = post(url + "/v1/completions", body)
        assert status == 200 and json.loads(data) == {"choices": [{"text": "decoded"}]}
        assert prefill.bodies == [dict(body, max_tokens=1, stream=False,
                                       kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})]
        assert decode.bodies == [dict(body, kv_transfer_params=handed)]
        # the next prefill instance cannot be reached: decode computes the prompt (no params), the client never knows
        status, data = post(url + "/v1/chat/completions", dict(body, stream=True, max_completion_tokens=40))
        assert status == 200 and data.count(b"data: ") == 4 and data.endswith(b"data: [DONE]\n\n")
        assert decode.bodies[1] == dict(body, stream=True, max_completion_tokens=40)
        status, data = post(url + "/v1/completions", dict(body, stream=True))  # round robin: prefill again
        assert status == 200 and data.count(b"data: ") == 4
        assert prefill.bodies[1]["stream"] is False and prefill.bodies[1]["max_tokens"] == 1
        assert decode.bodies[2] == dict(body, stream=True, kv_transfer_params=handed)
        assert post(url + "/v1/completions", [1])[0] == 400
    finally:
        proxy.shutdown()
        proxy.server_close()
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match="http://host:port"):
        Upstreams(["127.0.0.1:8100"], [decode.url])


def test_the_proxy_bounds_what_one_client_can_make_it_spend(monkeypatch):
    """A huge or negative Content-Length, an idle connection, a flood of connections: refused or cut, at once or
    after the client timeout, never a body read into memory or a thread held forever."""
    import socket

    from kvpool.engines.vllm import pd_proxy

    monkeypatch.setattr(pd_proxy._Handler, "timeout", 2.0)
    decode = Backend({"choices": []})
    proxy = pd_proxy.ProxyServer(("127.0.0.1", 0), pd_proxy.Upstreams([decode.url], [decode.url]), max_connections=2)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    address = ("127.0.0.1", proxy.server_address[1])

    def ask(head: bytes) -> bytes:
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(head)
            return sock.recv(200)

    try:
        for length, status in ((1 << 40, b" 413 "), (-1, b" 400 "), ("x", b" 400 ")):
            # the previous refusal's thread lets its slot go once its reply is out (a busy machine: not at once)
            wait_until(lambda: proxy.serving == 0, timeout=10)
            reply = ask(f"POST /v1/completions HTTP/1.0\r\nContent-Length: {length}\r\n\r\n".encode())
            assert status in reply.split(b"\r\n")[0], reply
        assert decode.bodies == []  # nothing went upstream
        wait_until(lambda: proxy.serving == 0, timeout=10)
        idle = [socket.create_connection(address, timeout=10) for _ in range(2)]  # both slots, saying nothing
        try:
            wait_until(lambda: proxy.serving == 2, timeout=5)
            assert b" 503 " in ask(b"GET /health HTTP/1.0\r\n\r\n")  # a third: refused at once
            for sock in idle:  # cut at the client timeout (2 s here): the proxy closes them
                assert sock.recv(200) == b""
            wait_until(lambda: b" 503 " not in ask(b"GET /health HTTP/1.0\r\n\r\n"), timeout=10)  # slots free
        finally:
            for sock in idle:
                sock.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
        decode.close()
