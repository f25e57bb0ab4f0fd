"""ReportWindow: a node link's coalescing window widens while busy and is back at its base once quiet."""

from __future__ import annotations

import pytest

from kvpool.node.report_window import ReportWindow


def test_busy_sends_double_the_window_up_to_the_cap_and_quiet_brings_it_back():
    w = ReportWindow(base_s=0.002, cap_s=0.1)
    seen = []
    for _ in range(10):  # changes keep arriving while each report is in flight
        w.sent(0.001, more_came=True)
        seen.append(w.current)
    assert seen[:3] == [0.004, 0.008, 0.016] and seen[-1] == 0.1 and max(seen) == 0.1
    w.sent(0.001, more_came=False)
    assert w.current == 0.1  # a quick report with nothing new does not widen it further, nor narrow it
    assert w.woke(0.15) == 0.002  # quiet for longer than the cap: a change is reported within the base window


def test_a_slow_master_widens_it_and_waits_longer_than_the_window_narrow_it_step_by_step():
    w = ReportWindow(base_s=0.002, cap_s=0.1)
    w.sent(0.005, more_came=False)  # the call took longer than the window: the master answers slowly
    assert w.current == 0.004
    w.sent(0.010, more_came=False)
    assert w.current == 0.008
    assert w.woke(0.009) == 0.004  # waited longer than the window: halve
    assert w.woke(0.003) == 0.004  # a change came within the window: keep it
    assert w.woke(0.05) == 0.002 and w.woke(0.05) == 0.002  # never below the base


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="base_s <= cap_s"):
        ReportWindow(base_s=0.2, cap_s=0.1)
