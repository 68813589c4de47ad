"""Per-request comparison of two runs of the same arrivals (laser.bench.record_pairs)."""

import pytest

from laser.bench.record_pairs import format_pair_summary, pair_summary, paired_rows
from laser.core.metrics import RequestRecord


def rec(cls, arrival, times, ttft_slo=1.0, tbt_slo=1.0, prompt=10):
    return RequestRecord("r", cls, ttft_slo, tbt_slo, arrival, list(times), prompt, len(times), True)


def test_rows_are_relative_to_each_runs_first_arrival():
    sim = [rec("chat", 0.0, [0.1, 0.2, 0.3]), rec("code", 1.0, [1.5, 1.6])]
    real = [rec("chat", 100.0, [100.2, 100.3, 100.5]), rec("code", 101.0, [101.4, 101.45])]
    rows = paired_rows(sim, real)
    assert [r["class"] for r in rows] == ["chat", "code"]
    assert rows[1]["a"]["arrival"] == pytest.approx(1.0) and rows[1]["b"]["arrival"] == pytest.approx(1.0)
    assert rows[0]["a"]["ttft"] == pytest.approx(0.1) and rows[0]["b"]["ttft"] == pytest.approx(0.2)
    assert rows[0]["b"]["tpot"] == pytest.approx(0.15)


def test_summary_medians_and_flipped_verdicts():
    sim = [rec("chat", 0.0, [0.5]), rec("chat", 1.0, [1.2]), rec("summ", 2.0, [3.5], ttft_slo=1.0)]
    real = [rec("chat", 0.0, [0.7]), rec("chat", 1.0, [1.6]), rec("summ", 2.0, [2.9], ttft_slo=1.0)]
    s = pair_summary(paired_rows(sim, real))
    assert s["chat"]["n"] == 2
    assert s["chat"]["ttft_diff"] == pytest.approx(0.3)  # median of +0.2, +0.4
    assert s["chat"]["ttft_ratio"] == pytest.approx((1.4 + 3.0) / 2)
    assert s["summ"]["ttft_diff"] == pytest.approx(-0.6)
    assert (s["summ"]["b_only"], s["summ"]["a_only"]) == (1, 0)  # 0.9 s meets 1 s, 1.5 s does not
    assert s["all"]["n"] == 3 and s["chat"]["tpot_diff"] is None  # one token: no TBT
    lines = format_pair_summary(s)
    assert len(lines) == 4 and "+300.0" in lines[1]


def test_different_requests_are_refused():
    with pytest.raises(ValueError):
        paired_rows([rec("chat", 0.0, [0.1])], [])
    with pytest.raises(ValueError):
        paired_rows([rec("chat", 0.0, [0.1])], [rec("code", 0.0, [0.1])])
