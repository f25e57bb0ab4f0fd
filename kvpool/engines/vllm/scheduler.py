"""The scheduler side of the vLLM connector: which blocks each step loads from and saves to the pool.

vLLM's scheduler asks, for each new request, how many tokens past its own
prefix cache (the HBM tier) can be loaded; this side answers with one pool
lookup for the full blocks after vLLM's hit, and then plans, step by step:

- a *load* of the blocks it answered, into the blocks vLLM allocated for
  them (with the locations the lookup returned, so the worker makes no
  second master call). With asynchronous loads (``async_loads``) the load is
  planned in the step vLLM allocated the blocks in (``StepPlan.async_loads``)
  while vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``; otherwise in
  the step that computes the request's first tokens, before its forward
  (``StepPlan.loads``);
- a *save* of every block that becomes full in the step, prompt and
  generated tokens alike: after a step, the KV of the first
  ``num_computed_tokens + num_scheduled_tokens`` tokens exists, so each block
  inside that range and not saved, loaded or hit before is saved once.

Prefill/decode disaggregation through the pool (vLLM's ``kv_role``, :class:`Role`):

- ``kv_producer`` (a prefill instance) also saves the blocks of the prompt
  that vLLM's own cache hit and the pool lacks (one ``exists`` call), so
  every full block of the prompt ends up in the pool. A finished request
  is a :class:`Handoff`: vLLM keeps its blocks until the workers report the
  pool holds them (``finished_sending``), and its ``kv_transfer_params`` say
  how many prompt tokens it stored (:data:`STORED_TOKENS`).
- ``kv_consumer`` (a decode instance) saves no block made only of prompt
  tokens, and saves the blocks its generated tokens fill. A request whose
  ``kv_transfer_params`` announce stored tokens (the proxy passes on the
  producer's) waits for those blocks: while the pool has fewer, the answer
  is None, which vLLM's scheduler takes as "ask again later" (other requests
  run meanwhile; vLLM asks every step, the pool is asked 1 ms after the first
  lookup, then at gaps doubling to 50 ms, so a waiting request never floods
  the master); after ``handoff_timeout_s`` it takes what is there and
  computes the rest.
- ``kv_both`` does neither hand-off: loads and saves as above. It honours
  announced tokens like a consumer (vLLM counts it as one).

Invariants:
- An answer is a whole number of blocks and leaves at least one token of the
  request to compute (vLLM needs its logits).
- A pool fault or timeout answers 0 (the request is computed) and opens a
  breaker: for ``backoff`` seconds (0.5 s doubling to 5 s) no lookup is
  asked, so a dead pool costs no request its deadline twice.
- A pool fault answers 0 at once, even for a request waiting for announced
  blocks: waiting is for blocks not written yet, never for a pool that fails.
- A request whose load failed (vLLM's output named one of its blocks in
  ``invalid_block_ids``, :meth:`PoolScheduler.load_outcomes`) is never
  offered a load again: vLLM frees an async request that failed at its
  first block and asks again, and a pool that keeps failing must not make
  that a loop. Its blocks from the first failed one on are saved again
  once recomputed (the worker drops the saves of a step whose load failed:
  what the forward computed there used the bytes that did not arrive).
- Nothing here touches KV bytes or holds data memory: the worker moves them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.client.faults import PoolFault
from kvpool.client.lookup import BlockLocation, PoolRun
from kvpool.engines.vllm.keys import RequestKeys, VllmKeySpace, request_tenant
from kvpool.keys import BlockKey
from kvpool.vocabulary import Tier

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 5.0
MATCH_REUSE_S = 1.0  # a lookup answer is reused for a request asked about again this soon (it waited a step)
POLL_MIN_S, POLL_MAX_S = 0.001, 0.05  # a request waiting for announced blocks asks again after these, doubling
STORED_TOKENS = "kvpool_stored_tokens"  # kv_transfer_params: prompt tokens whose blocks a producer stored


class Role(enum.Enum):
    """What one vLLM instance does with the pool (vLLM's ``kv_role``; see the module docstring)."""

    BOTH = "kv_both"
    PRODUCER = "kv_producer"  # a prefill instance: hands its prompts' blocks off through the pool
    CONSUMER = "kv_consumer"  # a decode instance: loads them, saves only what its generated tokens fill

    @classmethod
    def of(cls, is_producer: bool, is_consumer: bool) -> Role:
        """The role from vLLM's ``KVTransferConfig.is_kv_producer`` and ``is_kv_consumer`` (both: ``kv_both``)."""
        if is_producer != is_consumer:
            return cls.PRODUCER if is_producer else cls.CONSUMER
        return cls.BOTH


class Lookups(Protocol):
    """The part of :class:`kvpool.client.pool.PoolClient` this side uses (strict: faults raise PoolFault)."""

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> PoolRun: ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Blocks of one request to copy from the pool into vLLM's blocks (same order), before its forward."""

    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    locations: list[BlockLocation]  # where the scheduler's lookup found them (rank 0's keys)


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Blocks of one request that are full after this step: copy them out of vLLM's blocks into the pool."""

    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    # vLLM's own hash of each block (its int form, 0 where vLLM has none): KV events name the blocks by it
    engine_hashes: list[int] = field(default_factory=list)


def vllm_block_hashes(request: Any, start: int, end: int) -> list[int]:
    """The int form vLLM's KV events give blocks ``[start, end)`` of ``request`` (``maybe_convert_block_hash``:
    the hash's last 8 bytes); 0 for blocks vLLM has not hashed (prefix caching off)."""
    hashes = getattr(request, "block_hashes", None) or ()
    return [int.from_bytes(hashes[i][-8:], "big") if i < len(hashes) and isinstance(hashes[i], bytes) else 0
            for i in range(start, end)]


@dataclass(frozen=True, slots=True)
class Handoff:
    """A producer's finished request: vLLM keeps its blocks until the pool holds ``keys`` (its stored prompt
    blocks, shard 0's keys) or the worker gives up waiting; then the worker reports it in ``finished_sending``."""

    req_id: str
    keys: list[BlockKey]


@dataclass(slots=True)
class StepPlan:
    """One step's loads, saves and hand-offs (the connector metadata's content).

    ``loads`` are the step's own (done before its forward reads them); ``async_loads`` start now and are
    reported done in ``finished_recving`` of a later step (their requests are not in this step's batch).
    ``handoffs``: a producer's finished requests whose blocks the workers confirm in the pool
    (``finished_sending``). ``idle``: the step computes nothing (vLLM steps like this while every request
    waits for its KV).
    """

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    async_loads: list[LoadJob] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    idle: bool = False


@dataclass(slots=True)
class _Request:
    request: Any  # vLLM's Request (live: its tokens grow)
    keys: RequestKeys
    block_ids: list[int] = field(default_factory=list)
    done_blocks: int = 0  # blocks [0, done_blocks) need no save: hit, loaded, saved (or a consumer's prompt)
    match: tuple[int, float, PoolRun] | None = None  # (first block asked, when, the run found)
    load: LoadJob | None = None
    sources: tuple[int, int] = (0, 0)  # tokens of the planned load from DRAM and from SSD
    resave: list[int] = field(default_factory=list)  # a producer's blocks vLLM hit that the pool lacks
    waiting_since: float | None = None  # when it began waiting for announced blocks (None: it never waited)
    polled: float | None = None  # its last lookup while it waits for them (None: not waiting now)
    poll_gap: float = POLL_MIN_S  # ... and how long after it the next is due
    load_failed: bool = False  # a load of this request failed: it is never offered one again


@dataclass(slots=True)
class MatchStats:
    """What the lookups found since the last :meth:`PoolScheduler.take_stats`."""

    lookups: int = 0
    hit_blocks: dict[str, int] = field(default_factory=lambda: {"dram": 0, "ssd": 0})
    faults: int = 0
    handoff_waits: int = 0  # requests that waited for blocks a producer announced
    handoff_timeouts: int = 0  # ... and stopped waiting at the timeout, short of them


class PoolScheduler:
    """Per-request planning of loads and saves (see the module docstring). Not thread-safe: vLLM's scheduler
    calls it from one thread."""

    def __init__(self, space: Callable[[], VllmKeySpace], pool: Lookups | None, block_size: int,
                 clock: Callable[[], float] = time.monotonic, *, role: Role = Role.BOTH,
                 handoff_timeout_s: float = 2.0, async_loads: bool = False):
        self._space = space  # resolved at first use: vLLM settles its KV cache layout after building connectors
        self._pool = pool  # None: the pool is off (a bad config), every answer is 0 and nothing is saved
        self.block_size = block_size
        self.async_loads = async_loads
        self._clock = clock
        self.role = role
        self.handoff_timeout_s = handoff_timeout_s
        self._requests: dict[str, _Request] = {}
        self._handoffs: list[Handoff] = []  # finished since the last plan
        self._async_planned: list[LoadJob] = []  # async loads allocated since the last plan
        self._receiving: dict[str, LoadJob] = {}  # async loads sent to the workers and not reported done
        self._closed_until = 0.0
        self._backoff = BACKOFF_MIN_S
        self.stats = MatchStats()

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            namespace = self._space().namespace(request_tenant(request))
            state = self._requests[request.request_id] = _Request(request, RequestKeys(namespace, self.block_size))
            if self.role is Role.CONSUMER:  # its prompt's blocks are the producer's to store
                state.done_blocks = request.num_prompt_tokens // self.block_size
        return state

    # -- vLLM's scheduler calls --------------------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens past ``num_computed_tokens`` (vLLM's own, block-aligned hit) that the pool can load; None while
        the request waits for blocks a producer announced (vLLM asks again at a later step)."""
        if self._pool is None:
            return 0
        state = self._state(request)  # even with nothing to look up: its generated blocks are saved
        if state.load_failed:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # at least one token left to compute
        if end <= start:
            return 0
        now = self._clock()
        if state.match is not None and state.match[0] == start and now - state.match[1] < MATCH_REUSE_S:
            return len(state.match[2]) * bs
        if now < self._closed_until:
            return 0
        if state.polled is not None and now - state.polled < state.poll_gap:
            return None
        keys = state.keys.upto(request.all_token_ids, end)
        try:
            if self.role is Role.PRODUCER and start:
                state.resave = [i for i, held in enumerate(self._pool.exists(keys[:start])) if not held]
            run = self._pool.lookup(keys[start:], hbm_prefix_blocks=start, block_tokens=bs)
        except PoolFault as exc:
            self._trip(exc)
            return 0
        self._backoff = BACKOFF_MIN_S
        if start + len(run) < self._announced(request, end) and not self._gave_up(state, now):
            if state.polled is not None:
                state.poll_gap = min(state.poll_gap * 2, POLL_MAX_S)
            state.polled = now
            return None
        if state.polled is not None:
            log.debug("kvpool: request %s waited %.3f s for the blocks its producer announced (%d of %d found)",
                      request.request_id, now - (state.waiting_since or now), start + len(run),
                      self._announced(request, end))
        state.polled = None
        self.stats.lookups += 1
        self.stats.hit_blocks["dram"] += run.count(Tier.DRAM)
        self.stats.hit_blocks["ssd"] += run.count(Tier.SSD)
        state.match = (start, now, run)
        return len(run) * bs

    def _announced(self, request: Any, end: int) -> int:
        """Blocks of ``request`` a producer stored, by its ``kv_transfer_params`` (0: none announced; a producer
        waits for nobody), at most ``end``."""
        if self.role is Role.PRODUCER:
            return 0
        stored = (getattr(request, "kv_transfer_params", None) or {}).get(STORED_TOKENS)
        if isinstance(stored, bool) or not isinstance(stored, int):
            return 0
        return min(max(stored, 0) // self.block_size, end)

    def _gave_up(self, state: _Request, now: float) -> bool:
        """Whether a request short of its announced blocks stops waiting (counts its wait and its time-out)."""
        if state.waiting_since is None:
            state.waiting_since = now
            self.stats.handoff_waits += 1
        if now - state.waiting_since < self.handoff_timeout_s:
            return False
        self.stats.handoff_timeouts += 1
        log.warning("kvpool: request %s waited %.1f s for the blocks its producer announced; computing what the "
                    "pool does not hold", state.request.request_id, now - state.waiting_since)
        return True

    def _trip(self, exc: PoolFault) -> None:
        self.stats.faults += 1
        level = logging.WARNING if self._backoff == BACKOFF_MIN_S else logging.DEBUG  # once per outage
        log.log(level, "kvpool: lookup failed (%s); answering 0 tokens for %.1f s, then asking again",
                exc.kind, self._backoff)
        log.debug("kvpool: lookup failure: %s", exc)
        self._closed_until = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def allocated(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks: plan the load of the ``num_external_tokens`` the pool answered."""
        if num_external_tokens <= 0 or self._pool is None:
            return
        state = self._state(request)
        assert state.match is not None, "vllm connector: external tokens without a lookup"
        start, _, run = state.match
        n = num_external_tokens // self.block_size
        assert n <= len(run), f"vllm connector: {n} blocks to load, the lookup found {len(run)}"
        loaded = run[:n]
        job = LoadJob(request.request_id, list(loaded.keys), list(block_ids[start : start + n]), list(loaded))
        if self.async_loads:
            self._async_planned.append(job)
            self._receiving[job.req_id] = job
        else:
            state.load = job
        state.sources = (loaded.count(Tier.DRAM) * self.block_size, loaded.count(Tier.SSD) * self.block_size)
        state.match = None

    def sources(self, request: Any, num_external_tokens: int) -> tuple[int, int]:
        """Of the ``num_external_tokens`` planned for ``request``: how many come from DRAM, and from SSD."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return 0, 0
        return state.sources

    def plan(self, output: Any) -> StepPlan:
        """The loads and saves of the step vLLM just scheduled (``SchedulerOutput``)."""
        plan = StepPlan()
        if self._pool is None:
            return plan
        plan.handoffs, self._handoffs = self._handoffs, []
        plan.async_loads, self._async_planned = self._async_planned, []
        plan.idle = not getattr(output, "total_num_scheduled_tokens", 1)
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue  # never asked about (vLLM skipped the connector for it): nothing known to save
            state.block_ids = list(new.block_ids[0])
            self._step(plan, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: these are all of its blocks
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids += new_ids[0]
            self._step(plan, state, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        for req_id in output.finished_req_ids:
            self._requests.pop(req_id, None)
        return plan

    def _step(self, plan: StepPlan, state: _Request, computed: int, scheduled: int) -> None:
        if state.load is not None:
            plan.loads.append(state.load)
            state.load = None
        if state.resave:  # in vLLM's cache (its hit), so in its blocks from the first step on
            missing = [i for i in state.resave if i < len(state.block_ids)]
            keys = state.keys.keys
            plan.saves.append(SaveJob(state.request.request_id, [keys[i] for i in missing],
                                      [state.block_ids[i] for i in missing],
                                      [vllm_block_hashes(state.request, i, i + 1)[0] for i in missing]))
            state.resave = []
        bs = self.block_size
        state.done_blocks = max(state.done_blocks, computed // bs)  # vLLM's hits and the pool's loads
        full = min(computed + scheduled, len(state.request.all_token_ids)) // bs
        full = min(full, len(state.block_ids))
        if full > state.done_blocks:
            keys = state.keys.upto(state.request.all_token_ids, full)
            plan.saves.append(SaveJob(state.request.request_id, keys[state.done_blocks:full],
                                      state.block_ids[state.done_blocks:full],
                                      vllm_block_hashes(state.request, state.done_blocks, full)))
            state.done_blocks = full

    def load_outcomes(self, finished_recving: Collection[str], invalid_block_ids: Collection[int]) -> None:
        """What the workers reported after a step (vLLM's aggregated ``KVConnectorOutput``): async loads done
        (``finished_recving``) and blocks that did not load (``invalid_block_ids``, sync or async loads).

        A request with a failed block is marked (see the module docstring) and its saves restart at that block.
        """
        invalid = set(invalid_block_ids)
        for req_id in finished_recving:
            job = self._receiving.pop(req_id, None)
            state = self._requests.get(req_id)
            if job is not None and state is not None and invalid.intersection(job.block_ids):
                state.load_failed = True
        if not invalid:
            return
        for state in self._requests.values():
            first = next((i for i, b in enumerate(state.block_ids) if b in invalid), None)
            if first is not None:
                state.load_failed = True
                state.done_blocks = min(state.done_blocks, first)

    def finished(self, request: Any) -> tuple[Handoff | None, dict[str, Any] | None]:
        """The request is done: forget it. A producer's: its hand-off (None if it stored no block: vLLM frees
        its blocks now) and its ``kv_transfer_params``; (None, None) for the other roles."""
        state = self._requests.pop(request.request_id, None)
        if self.role is not Role.PRODUCER or self._pool is None:
            return None, None
        stored = 0 if state is None else min(state.done_blocks, request.num_prompt_tokens // self.block_size)
        params = {STORED_TOKENS: stored * self.block_size}
        if not stored:
            return None, params
        assert state is not None
        handoff = Handoff(request.request_id, state.keys.keys[:stored])
        self._handoffs.append(handoff)
        return handoff, params

    def take_stats(self) -> MatchStats:
        stats, self.stats = self.stats, MatchStats()
        return stats
