"""laser.bench.batch_window (benchmarks/batch_window.py, issue 14's done-when run): the pure parts -- which interactive
requests the server kill is blamed for, and the attainment with them left out. The run itself
needs the real model and minutes of CPU; it is a benchmark, not a test."""

import pytest

from laser.bench import batch_window as bw
from laser.core.metrics import RequestRecord


def _rec(i, arrival, tokens, finished):
    return RequestRecord(f"r{i}", "chat", 1.0, 0.5, arrival, list(tokens), 10, max(1, len(tokens)), finished)


def test_outage_blames_unfinished_requests_in_flight_or_sent_before_ready():
    t_kill, t_ready = 100.0, 130.0
    recs = [
        _rec(0, 50.0, [50.2, 50.4], True),      # done long before the kill
        _rec(1, 98.0, [98.3, 99.5], False),     # streaming when the server died
        _rec(2, 99.0, [], False),               # queued at the kill
        _rec(3, 110.0, [], False),              # sent while the server was down
        _rec(4, 131.0, [131.2, 131.4], True),   # after the restart, fine
        _rec(5, 140.0, [], False),              # failed after the restart: not the outage's
        _rec(6, 20.0, [20.5], False),           # gave up long before the kill: not the outage's
    ]
    assert bw.outage_ids(recs, t_kill, t_ready) == {"r1", "r2", "r3"}
    assert bw.outage_ids(recs, None, None) == set()  # no kill, nothing to blame


def test_phase_stats_leaves_the_outage_out():
    recs = [_rec(0, 0.0, [0.2, 0.4], True), _rec(1, 1.0, [], False), _rec(2, 2.0, [2.1, 2.2], True),
            _rec(3, 3.0, [5.0, 5.1], True)]  # r3 misses its 1 s TTFT
    all_ = bw.phase_stats(recs)
    assert all_["requests"] == 4 and all_["attainment"] == pytest.approx(0.5) and all_["unfinished"] == 1
    left = bw.phase_stats(recs, {"r1"})
    assert left["requests"] == 3 and left["attainment"] == pytest.approx(2 / 3)
    assert left["ttft_mean_s"] == pytest.approx((0.2 + 0.1 + 2.0) / 3)


def test_args_defaults_and_errors():
    a = bw.parse_args([])
    assert (a.batch_requests, a.window, a.rate) == (200, "10m", 0.2)
    q = bw.parse_args(["--quick"])
    assert (q.batch_requests, q.window) == (20, "2m")
    for bad in (["--kill-at", "1"], ["--window", "0s"], ["--window", "soon"], ["--rate", "0"]):
        with pytest.raises(SystemExit):
            bw.parse_args(bad)
