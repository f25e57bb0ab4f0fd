"""Issue 29 item 4: a node's reports coalesce over a window that widens under load.

A real master and a real MasterLink; the store is a stand-in that holds every key it is asked about, and changes
are fed to the link's listener by a thread at rising rates. The link's ReportBlocks calls are counted.
"""

from __future__ import annotations

import threading
import time

import pytest
from support import wait_until

from kvpool.config import MasterConfig
from kvpool.keys import BlockKey, opaque_key
from kvpool.master.server import MasterServer
from kvpool.node.master_link import MasterLink
from kvpool.node.report_window import BASE_S, ReportWindow
from kvpool.v1 import common_pb2
from kvpool.vocabulary import BlockMeta, Tier, TierStats

PHASE_S = 1.5


class HoldsAll:
    """A tier store that holds every key (the link re-checks keys before reporting them)."""

    def contains(self, keys):
        return [True] * len(keys)

    def inventory(self):
        return []

    def stats(self):
        return TierStats(Tier.DRAM, capacity_bytes=1 << 30, used_bytes=0, blocks=0)


@pytest.fixture
def link():
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    ref = common_pb2.NodeRef(node_id="window-node", address="127.0.0.1:1")
    link = MasterLink(master.address, ref, {Tier.DRAM: HoldsAll()}, dram_max_block_bytes=1 << 20)
    calls: list[tuple[float, float, int]] = []  # (when, the window then, keys)
    report = link._call_report

    def counted(tier, full_sync, added, removed, sync_complete=False):
        if not full_sync:
            calls.append((time.monotonic(), link.window.current, len(added)))
        return report(tier, full_sync, added, removed, sync_complete)

    link._call_report = counted
    link.start()
    wait_until(lambda: link.registered)
    yield link, calls
    link.stop()
    master.stop(grace=0)


def feed(link: MasterLink, puts_per_s: float, seconds: float, tag: str) -> int:
    """Put events at ``puts_per_s`` (a batch each millisecond) for ``seconds``; returns how many keys."""
    on_change = link.listener(Tier.DRAM)
    start, n = time.monotonic(), 0
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * puts_per_s)
        if due > n:
            on_change([BlockMeta(BlockKey(opaque_key(f"{tag}-{i}")), 4096, 7) for i in range(n, due)], [])
            n = due
        time.sleep(0.001)
    return n


Calls = list[tuple[float, float, int]]


def calls_per_s(calls: Calls, since: float, until: float) -> float:
    return sum(1 for when, _, _ in calls if since <= when < until) / (until - since)


def run_rates(link: MasterLink, calls: Calls, rates: list[int]) -> list[tuple[int, int, float, float]]:
    """Per put rate: (puts/s, keys put, report calls/s, the window at the end)."""
    figures = []
    for rate in rates:
        start = time.monotonic()
        sent = feed(link, rate, PHASE_S, f"r{rate}-{id(link)}")
        assert link.flush()
        figures.append((rate, sent, calls_per_s(calls, start, time.monotonic()), link.window.current))
    return figures


def test_calls_per_second_fall_as_the_put_rate_rises_and_a_quiet_node_reports_within_the_base_window(link):
    link, calls = link
    figures = run_rates(link, calls, [5, 200, 20000])
    print("\nwidening window: puts/s, keys, report calls/s, window at the end: " + "; ".join(
        f"{r} {n} {c:.0f} {w * 1e3:.0f} ms" for r, n, c, w in figures))
    link.window = ReportWindow(BASE_S, BASE_S)  # the fixed 2 ms window before issue 29, same master and load
    fixed = run_rates(link, calls, [200, 20000])
    print("fixed 2 ms window: " + "; ".join(f"{r} {n} {c:.0f}" for r, n, c, _ in fixed))
    keys_per_call = [n / max(c * PHASE_S, 1) for _, n, c, _ in figures]
    # Each call carries more keys as the rate rises (at 5 and 200 puts/s alike one key a call, give or take the
    # clock: within 5%; at 20,000 far more)...
    assert all(b >= a * 0.95 for a, b in zip(keys_per_call, keys_per_call[1:])), keys_per_call
    assert keys_per_call[-1] > 10 * keys_per_call[0], keys_per_call
    assert figures[-1][2] < figures[1][2] * 2 and figures[-1][3] > BASE_S  # ...calls/s do not rise with it
    assert figures[-1][2] * 4 < fixed[-1][2]  # and a busy node makes far fewer calls than with a fixed window
    assert sum(k for _, _, k in calls) >= sum(n for _, n, _, _ in figures + fixed)  # every key was reported

    # Quiet: a lone change after a pause is reported after the base window, not the widened one.
    link.window = ReportWindow()
    link.window.current = link.window.cap_s  # as a busy node's is
    time.sleep(0.3)
    before = len(calls)
    threading.Thread(target=feed, args=(link, 1000, 0.002, "lone"), daemon=True).start()
    wait_until(lambda: len(calls) > before, timeout=5, interval=0.001)
    assert calls[before][1] == BASE_S
