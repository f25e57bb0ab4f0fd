"""LookupStats: one buffer and one timer for the lookups a client answers without the master (no servers)."""

from __future__ import annotations

import threading

from kvpool.client.lookup_stats import REPORT_S, LookupCounts, LookupStats
from kvpool.vocabulary import Tier


class Master:
    """A fake ReportLookups: records what it is sent; refuses while ``up`` is False."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, LookupCounts]] = []
        self.arrived = threading.Event()
        self.up = True

    def __call__(self, block_tokens: int, counts: LookupCounts, deadline: float | None) -> bool:
        if not self.up:
            return False
        self.sent.append((block_tokens, counts))
        self.arrived.set()
        return True


NEVER = 3600.0  # a timer that does not fire while a test runs


def test_hbm_only_and_same_host_lookups_share_one_report_per_block_size():
    master = Master()
    stats = LookupStats(master, NEVER)
    stats.count(3, b"", 3, 16)  # HBM answered alone: 3 blocks asked, 3 hit in HBM
    stats.count(2, bytes([Tier.DRAM, Tier.DRAM, Tier.SSD]), 6, 16)  # HBM 2, then DRAM 2 + SSD 1 of 4 more
    stats.count(0, bytes([Tier.SSD]), 1, 32)  # another block size: a report of its own
    assert stats.send()
    assert sorted(master.sent, key=lambda s: s[0]) == [
        (16, LookupCounts(lookups=2, requested=9, hbm=5, dram=2, ssd=1)),
        (32, LookupCounts(lookups=1, requested=1, hbm=0, dram=0, ssd=1)),
    ]
    assert stats.send() and len(master.sent) == 2  # nothing left: nothing sent again


def test_the_first_lookup_after_a_report_starts_the_timer_that_sends_it():
    master = Master()
    stats = LookupStats(master, 0.01)
    stats.count(1, b"", 1, 16)
    assert master.arrived.wait(REPORT_S * 30)  # sent by the timer, no send() called
    assert master.sent == [(16, LookupCounts(lookups=1, requested=1, hbm=1))]


def test_a_failed_report_is_false_and_its_counts_are_not_sent_again():
    master = Master()
    stats = LookupStats(master, NEVER)
    master.up = False
    stats.count(1, b"", 1, 16)
    assert not stats.send()
    master.up = True
    assert stats.send() and master.sent == []  # stats only: lost, not retried
