"""A served run's stalls from its step log and garbage-collection counters (issue 26 item 4)."""

from __future__ import annotations

import pytest

from laser.bench.stalls import format_stalls, stall_summary


def test_steps_far_over_their_price_and_the_collections_between_counters():
    timed = [(1.0, 0.050, 0.048), (1.1, 0.300, 0.060), (1.2, 0.020, None), (1.5, 0.130, 0.060)]  # (ended, s, price)
    before = {"counts": [10, 1, 0], "seconds": [0.01, 0.002, 0.0], "longest": [0.001, 0.002, 0.0]}
    after = {"counts": [30, 3, 1], "seconds": [0.03, 0.008, 0.35], "longest": [0.001, 0.004, 0.35]}
    s = stall_summary(timed, before, after)
    assert s["steps"] == 3 and s["stalled"] == 2  # the unpriced step is not judged
    assert s["excess_s"] == pytest.approx(0.240 + 0.070)
    assert s["worst"] == (1.1, 0.300, 0.060) and s["longest"] == (1.1, 0.300)
    assert s["gc_counts"] == [20, 2, 1] and s["gc_s"] == pytest.approx([0.02, 0.006, 0.35])
    line = format_stalls(s)
    assert "2 of 3 steps" in line and "+310 ms" in line and "300.0 ms against 60.0 ms" in line and "longest step 300.0" in line
    assert "20 / 2 / 1" in line and "longest full collection since start 350 ms" in line


def test_without_counters_or_steps():
    s = stall_summary([], None, None)
    assert s == {"steps": 0, "stalled": 0, "excess_s": 0, "worst": None, "longest": None, "gc_counts": None,
                 "gc_s": None, "gc_longest_s": None}
    assert "garbage" not in format_stalls(s)
