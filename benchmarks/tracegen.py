"""Mooncake-format request traces with named reuse patterns, seeded and deterministic: the lab's test data.

    python benchmarks/tracegen.py --pattern mixed --requests 4000 --out mixed.jsonl

What ``kvpool bench replay`` and ``kvpool bench lru-sweep`` are checked against when no real trace shows
a pattern (an operator replays their own trace instead).


Each line is ``{"timestamp", "input_length", "output_length", "hash_ids"}`` as
in the shipped trace (``load_trace`` reads it): one hash id per 512-token block
of the prompt, the last block possibly partial. Patterns:

- ``system-prompt``: a catalogue of long system prompts, picked with Zipf
  popularity, each followed by a unique user part;
- ``multi-turn``: many concurrent dialog sessions, interleaved; each turn's
  prompt is the previous turn's prompt + its output + new user text (sessions
  come back at different rates, so reuse distances span short to very long);
- ``one-off``: mostly unique prompts; a few start with a short shared template;
- ``mixed``: each request drawn from one of the three above (weights are knobs).

Invariant (Mooncake's): hash ids are prefix-consistent. Two requests carry the
same id at block i only if their prompts agree on every token up to the end of
block i; a new id is drawn for every block whose prefix was not generated
before, so a prompt that extends another shares exactly the other's *full*
blocks, and its partial last block (which gains tokens) gets a new id. Ids are
drawn in order of first appearance, 0, 1, 2, ...

The same pattern, knobs, request count and seed give the same bytes. At the
default knobs 4,000 requests touch 60k (system-prompt, multi-turn) to 130k
(one-off) distinct blocks of 512 tokens, so an exact LRU's hit rate keeps
moving from 1k to 50k blocks of capacity and a 50k cache still evicts.
Knobs are set as ``--set NAME=VALUE`` (``--set system-prompt.prompts=50`` for a
sub-pattern of ``mixed``); ``python benchmarks/tracegen.py --pattern P --knobs`` lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.bench.trace import BLOCK_TOKENS, Request


def blocks_of(tokens: int) -> int:
    """Hash ids a prompt of ``tokens`` tokens has (the last block may be partial)."""
    return -(-tokens // BLOCK_TOKENS)


class Ids:
    """Fresh hash ids in order of first appearance."""

    def __init__(self) -> None:
        self._next = 0

    def fresh(self, n: int) -> list[int]:
        start, self._next = self._next, self._next + n
        return list(range(start, self._next))


def extend(prefix_ids: Sequence[int], prefix_tokens: int, total_tokens: int, ids: Ids) -> tuple[int, ...]:
    """Ids of a prompt of ``total_tokens`` whose first ``prefix_tokens`` are those ``prefix_ids`` cover.

    The prefix's full blocks are shared; every later block (the prefix's partial one included) is fresh.
    """
    shared = list(prefix_ids[: prefix_tokens // BLOCK_TOKENS])
    return tuple(shared + ids.fresh(blocks_of(total_tokens) - len(shared)))


@dataclass(frozen=True)
class Prompt:
    """A generated request before it gets its timestamp."""

    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# -- knobs ---------------------------------------------------------------------------------------


def _check_range(name: str, lo: float, hi: float, floor: float) -> None:
    if not floor <= lo <= hi:
        raise ValueError(f"knobs min_{name}, max_{name}: need {floor} <= min <= max, got {lo}, {hi}")


@dataclass(frozen=True)
class SystemPromptKnobs:
    prompts: int = 2000  # distinct system prompts
    zipf: float = 0.8  # popularity of the i-th prompt ~ 1 / (i + 1) ** zipf
    min_system_tokens: int = 2048
    max_system_tokens: int = 32768
    min_user_tokens: int = 64
    max_user_tokens: int = 4096
    min_output_tokens: int = 16
    max_output_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.zipf < 0:
            raise ValueError(f"knobs prompts >= 1 and zipf >= 0, got {self.prompts}, {self.zipf}")
        _check_range("system_tokens", self.min_system_tokens, self.max_system_tokens, BLOCK_TOKENS)
        _check_range("user_tokens", self.min_user_tokens, self.max_user_tokens, 1)
        _check_range("output_tokens", self.min_output_tokens, self.max_output_tokens, 1)


@dataclass(frozen=True)
class MultiTurnKnobs:
    sessions: int = 2000  # sessions open at once; a finished one is replaced by a new one
    mean_turns: float = 8.0  # turns per session, geometric
    rate_sigma: float = 1.0  # a session's turn rate is lognormal(0, sigma): spread of reuse distances
    min_first_tokens: int = 1024  # the first prompt: instructions, a document, a question
    max_first_tokens: int = 32768
    min_user_tokens: int = 32
    max_user_tokens: int = 1024
    min_output_tokens: int = 64
    max_output_tokens: int = 1024
    max_context_tokens: int = 131072  # a session whose next prompt would exceed this ends

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.mean_turns < 1 or self.rate_sigma < 0:
            raise ValueError(f"knobs sessions >= 1, mean_turns >= 1, rate_sigma >= 0, got {self.sessions}, "
                             f"{self.mean_turns}, {self.rate_sigma}")
        _check_range("first_tokens", self.min_first_tokens, self.max_first_tokens, 1)
        _check_range("user_tokens", self.min_user_tokens, self.max_user_tokens, 1)
        _check_range("output_tokens", self.min_output_tokens, self.max_output_tokens, 1)
        if self.max_context_tokens < self.max_first_tokens:
            raise ValueError(f"knob max_context_tokens {self.max_context_tokens} < max_first_tokens "
                             f"{self.max_first_tokens}")


@dataclass(frozen=True)
class OneOffKnobs:
    templates: int = 20  # short shared prefixes (instructions, few-shot headers)
    template_share: float = 0.3  # fraction of prompts that start with one
    min_template_tokens: int = 512
    max_template_tokens: int = 4096
    min_prompt_tokens: int = 256
    max_prompt_tokens: int = 32768
    min_output_tokens: int = 16
    max_output_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.templates < 1 or not 0 <= self.template_share <= 1:
            raise ValueError(f"knobs templates >= 1 and 0 <= template_share <= 1, got {self.templates}, "
                             f"{self.template_share}")
        _check_range("template_tokens", self.min_template_tokens, self.max_template_tokens, BLOCK_TOKENS)
        _check_range("prompt_tokens", self.min_prompt_tokens, self.max_prompt_tokens, 1)
        _check_range("output_tokens", self.min_output_tokens, self.max_output_tokens, 1)


@dataclass(frozen=True)
class MixedKnobs:
    system_prompt: float = 0.4  # weights of the sub-patterns (normalised)
    multi_turn: float = 0.4
    one_off: float = 0.2
    system_prompt_knobs: SystemPromptKnobs = SystemPromptKnobs()
    multi_turn_knobs: MultiTurnKnobs = MultiTurnKnobs()
    one_off_knobs: OneOffKnobs = OneOffKnobs()

    def __post_init__(self) -> None:
        weights = (self.system_prompt, self.multi_turn, self.one_off)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"mixed weights must be >= 0 and not all 0, got {weights}")


Knobs = SystemPromptKnobs | MultiTurnKnobs | OneOffKnobs | MixedKnobs


# -- patterns ------------------------------------------------------------------------------------


def _uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def _system_prompt(k: SystemPromptKnobs, rng: np.random.Generator, ids: Ids) -> Iterator[Prompt]:
    lengths = [_uniform(rng, k.min_system_tokens, k.max_system_tokens) for _ in range(k.prompts)]
    weights = 1.0 / np.arange(1, k.prompts + 1) ** k.zipf
    popularity = weights / weights.sum()
    systems: dict[int, tuple[int, ...]] = {}  # full blocks of each system prompt, drawn at first use
    while True:
        s = int(rng.choice(k.prompts, p=popularity))
        if s not in systems:
            systems[s] = tuple(ids.fresh(lengths[s] // BLOCK_TOKENS))
        total = lengths[s] + _uniform(rng, k.min_user_tokens, k.max_user_tokens)
        yield Prompt(total, _uniform(rng, k.min_output_tokens, k.max_output_tokens),
                     extend(systems[s], lengths[s], total, ids))


@dataclass
class _Session:
    rate: float
    turns_left: int
    tokens: int = 0  # the last prompt's length (0: no turn yet)
    output: int = 0  # the last turn's output length
    ids: tuple[int, ...] = ()


def _multi_turn(k: MultiTurnKnobs, rng: np.random.Generator, ids: Ids) -> Iterator[Prompt]:
    def new() -> _Session:
        return _Session(float(rng.lognormal(0.0, k.rate_sigma)), int(rng.geometric(1.0 / k.mean_turns)))

    sessions = [new() for _ in range(k.sessions)]
    while True:
        rates = np.array([s.rate for s in sessions])
        i = int(rng.choice(len(sessions), p=rates / rates.sum()))
        s = sessions[i]
        user = _uniform(rng, k.min_user_tokens if s.tokens else k.min_first_tokens,
                        k.max_user_tokens if s.tokens else k.max_first_tokens)
        total = s.tokens + s.output + user
        if s.tokens and total > k.max_context_tokens:  # the dialog is over: a new one starts in its place
            s = sessions[i] = new()
            total = _uniform(rng, k.min_first_tokens, k.max_first_tokens)
        s.ids = extend(s.ids, s.tokens, total, ids)
        s.tokens, s.output = total, _uniform(rng, k.min_output_tokens, k.max_output_tokens)
        s.turns_left -= 1
        yield Prompt(total, s.output, s.ids)
        if s.turns_left <= 0:
            sessions[i] = new()


def _one_off(k: OneOffKnobs, rng: np.random.Generator, ids: Ids) -> Iterator[Prompt]:
    lengths = [_uniform(rng, k.min_template_tokens, k.max_template_tokens) for _ in range(k.templates)]
    templates: dict[int, tuple[int, ...]] = {}
    while True:
        body = _uniform(rng, k.min_prompt_tokens, k.max_prompt_tokens)
        output = _uniform(rng, k.min_output_tokens, k.max_output_tokens)
        if rng.random() < k.template_share:
            t = int(rng.integers(k.templates))
            if t not in templates:
                templates[t] = tuple(ids.fresh(lengths[t] // BLOCK_TOKENS))
            total = lengths[t] + body
            yield Prompt(total, output, extend(templates[t], lengths[t], total, ids))
        else:
            yield Prompt(body, output, tuple(ids.fresh(blocks_of(body))))


def _mixed(k: MixedKnobs, rng: np.random.Generator, ids: Ids) -> Iterator[Prompt]:
    parts = [_system_prompt(k.system_prompt_knobs, rng, ids), _multi_turn(k.multi_turn_knobs, rng, ids),
             _one_off(k.one_off_knobs, rng, ids)]
    weights = np.array([k.system_prompt, k.multi_turn, k.one_off], dtype=float)
    p = weights / weights.sum()
    while True:
        yield next(parts[int(rng.choice(len(parts), p=p))])


PATTERNS: dict[str, tuple[type[Any], Callable[[Any, np.random.Generator, Ids], Iterator[Prompt]]]] = {
    "system-prompt": (SystemPromptKnobs, _system_prompt),
    "multi-turn": (MultiTurnKnobs, _multi_turn),
    "one-off": (OneOffKnobs, _one_off),
    "mixed": (MixedKnobs, _mixed),
}
_SUB_KNOBS = {"system-prompt": "system_prompt_knobs", "multi-turn": "multi_turn_knobs", "one-off": "one_off_knobs"}


def knobs_for(pattern: str, settings: Sequence[str] = ()) -> Knobs:
    """The pattern's default knobs with ``NAME=VALUE`` settings applied (``sub-pattern.NAME`` inside mixed).

    ValueError naming an unknown pattern or knob, or a value of the wrong type or range.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    cls = PATTERNS[pattern][0]
    top: dict[str, Any] = {}
    sub: dict[str, dict[str, Any]] = {}
    for setting in settings:
        name, eq, value = setting.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"knob setting {setting!r} is not NAME=VALUE")
        name = name.strip().replace("-", "_") if "." not in name else name.strip()
        part, dot, field_name = name.rpartition(".")
        if dot:
            if pattern != "mixed" or part not in _SUB_KNOBS:
                raise ValueError(f"knob {name!r}: only mixed has sub-patterns ({', '.join(_SUB_KNOBS)})")
            target_cls, bucket = PATTERNS[part][0], sub.setdefault(part, {})
            field_name = field_name.replace("-", "_")
        else:
            target_cls, bucket = cls, top
        fields = {f.name: f for f in dataclasses.fields(target_cls) if not f.name.endswith("_knobs")}
        if field_name not in fields:
            raise ValueError(f"unknown knob {name!r} for {part or pattern}; knobs: {', '.join(fields)}")
        kind = type(fields[field_name].default)
        try:
            bucket[field_name] = kind(value) if kind is float else int(value, 10)
        except ValueError:
            raise ValueError(f"knob {name}: {value!r} is not {'a number' if kind is float else 'an integer'}") from None
    for part, values in sub.items():
        top[_SUB_KNOBS[part]] = PATTERNS[part][0](**values)
    knobs: Knobs = cls(**top)
    return knobs


def generate(pattern: str, requests: int, seed: int = 0, knobs: Knobs | None = None,
             interval_ms: float = 250.0) -> list[Request]:
    """``requests`` requests of ``pattern`` (default knobs if None), Poisson arrivals ``interval_ms`` apart (mean)."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if interval_ms < 0:
        raise ValueError(f"interval_ms must be >= 0, got {interval_ms}")
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    cls, make = PATTERNS[pattern]
    if knobs is None:
        knobs = cls()
    elif not isinstance(knobs, cls):
        raise ValueError(f"knobs {type(knobs).__name__} do not fit pattern {pattern!r}")
    rng = np.random.default_rng(seed)
    ids = Ids()
    prompts = list(itertools.islice(make(knobs, rng, ids), requests))
    gaps = rng.exponential(interval_ms, requests) if interval_ms else np.zeros(requests)
    gaps[0] = 0.0
    times = np.cumsum(gaps).astype(np.int64)
    return [Request(float(t), p.input_length, p.output_length, p.hash_ids) for t, p in zip(times, prompts)]


def write_trace(requests: Sequence[Request], out: Any) -> None:
    """Mooncake JSONL, one request a line, the shipped trace's field order and integer timestamps."""
    for r in requests:
        out.write(json.dumps({"timestamp": int(r.timestamp), "input_length": r.input_length,
                              "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


# -- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pattern", required=True, choices=list(PATTERNS), help="reuse pattern")
    parser.add_argument("--requests", type=int, default=4000, metavar="N", help="requests (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--interval-ms", type=float, default=250.0, metavar="MS",
                        help="mean gap between requests' timestamps (default: %(default)s)")
    parser.add_argument("--set", dest="knobs", action="append", default=[], metavar="NAME=VALUE",
                        help="a pattern knob (repeatable; sub-pattern.NAME inside mixed)")
    parser.add_argument("--knobs", dest="list_knobs", action="store_true",
                        help="print the pattern's knobs and their values, write nothing")
    parser.add_argument("--out", default="-", metavar="FILE", help="where the JSONL goes (default: stdout)")


def run(args: argparse.Namespace) -> int:
    knobs = knobs_for(args.pattern, args.knobs)
    if args.list_knobs:
        print(json.dumps(dataclasses.asdict(knobs), indent=2))
        return 0
    requests = generate(args.pattern, args.requests, args.seed, knobs, args.interval_ms)
    if args.out == "-":
        write_trace(requests, sys.stdout)
    else:
        with open(args.out, "w") as f:
            write_trace(requests, f)
        blocks = sum(len(r.hash_ids) for r in requests)
        distinct = len({h for r in requests for h in r.hash_ids})
        print(f"tracegen: {len(requests)} {args.pattern} requests, {blocks} block lookups, "
              f"{distinct} distinct blocks -> {args.out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/tracegen.py", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"tracegen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
