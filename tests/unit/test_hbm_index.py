"""HbmIndex (issue 26): each tenant's workers are its own, HBM keys are capped per worker and per tenant, and a
Score's runs hold the lock one worker at a time. ``tests/integration/test_routing_attacks.py`` attacks the same
through a real master."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

from kvpool.keys import BlockKey
from kvpool.master.index import HbmIndex
from kvpool.worker_ids import scoped_id, split_scoped_id


def make_keys(n: int, tag: str) -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


class Sink:
    """Records what the index hands its change sink: (scoped worker id, stored, gone)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, set[BlockKey], set[BlockKey]]] = []

    def __call__(self, worker: str, stored: list[BlockKey], gone: list[BlockKey]) -> None:
        self.calls.append((worker, set(stored), set(gone)))


def test_scoped_ids_keep_tenants_apart_and_split_back():
    assert scoped_id("", "gpu-0") == "gpu-0"  # auth off: the id as sent
    assert scoped_id("a", "gpu-0") != scoped_id("b", "gpu-0")
    for tenant in ("", "a", "tenant-b"):
        assert split_scoped_id(scoped_id(tenant, "gpu-0")) == (tenant, "gpu-0")


def test_one_tenants_reports_never_touch_another_tenants_worker_of_the_same_name():
    sink = Sink()
    index = HbmIndex(on_change=sink)
    a, b = scoped_id("a", "gpu-0"), scoped_id("b", "gpu-0")
    held = make_keys(8, "a")
    index.report(a, held, [])
    index.report(b, [], [], full_sync=True)  # B's full sync of "its" gpu-0, with nothing
    index.report(b, make_keys(2, "b"), held)  # and B's removal of A's keys
    assert index.held_runs([a, b], held) == [8, 0]
    assert index.worker_ids("a") == ["gpu-0"] and index.worker_ids("b") == ["gpu-0"] and index.worker_ids("") == []
    assert index.blocks() == 10
    assert sink.calls == [(a, set(held), set()), (b, set(make_keys(2, "b")), set())]  # nothing was A's loss
    assert index.drop_worker(b) == 2 and index.held_runs([a], held) == [8]


def test_keys_past_a_workers_or_its_tenants_cap_are_not_kept_and_counted():
    sink = Sink()
    index = HbmIndex(on_change=sink, max_keys_per_worker=5, max_keys_per_tenant=8)
    w1, w2, other = scoped_id("a", "w1"), scoped_id("a", "w2"), scoped_id("b", "w1")
    keys = make_keys(7, "k")
    assert index.report(w1, keys, []) == 2  # the first five are kept, in the report's order
    assert index.held_runs([w1], keys) == [5]
    assert index.report(w2, make_keys(6, "w2"), []) == 3  # the tenant's last 3 of 8
    assert index.report(other, make_keys(5, "b"), []) == 0  # another tenant's room is its own
    assert index.blocks() == 13
    assert sink.calls[0] == (w1, set(keys[:5]), set())  # only kept keys are events

    # Removals free room; a re-report of held keys takes none; a key both added and removed ends absent.
    assert index.report(w1, keys[:5] + keys[5:6], keys[:2]) == 0
    assert index.held_runs([w1], keys) == [0] and index.held_runs([w1], keys[2:]) == [4]
    # A full sync over the cap keeps its first keys; the old keys not among them are gone.
    assert index.report(w1, keys[6:] + keys[:6], [], full_sync=True) == 2
    assert index.held_runs([w1], keys[6:] + keys[:4]) == [5]
    worker, stored, gone = sink.calls[-1]
    assert (worker, stored, gone) == (w1, {keys[6], keys[0], keys[1]}, {keys[4], keys[5]})
    # A dropped worker's keys are the tenant's room again.
    assert index.drop_worker(w2) == 3
    assert index.report(w2, make_keys(6, "again"), []) == 3
    assert index.blocks() == 5 + 3 + 5


def test_a_report_is_not_kept_waiting_for_a_whole_scores_workers():
    """held_runs takes the lock per worker: between two workers of one Score another thread's report goes
    through (it used to wait for the whole call: 9.6 s behind one Score of 4,096 workers)."""
    index = HbmIndex()
    prompt = make_keys(4, "p")
    for w in ("w1", "w2"):
        index.report(w, prompt, [])
    reported = []

    def workers() -> Iterator[str]:
        yield "w1"
        thread = threading.Thread(target=lambda: reported.append(index.report("w3", prompt, [])))
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "a report waited for the rest of the Score"
        yield "w2"

    class Workers(list):  # held_runs takes a Sequence; this one runs the report between its two ids
        def __iter__(self) -> Iterator[str]:
            return workers()

    assert index.held_runs(Workers(["w1", "w2"]), prompt) == [4, 4]
    assert reported == [0] and index.held_runs(["w3"], prompt) == [4]
