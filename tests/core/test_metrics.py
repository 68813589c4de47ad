import json
import math

import pytest

from laser.core.metrics import RequestRecord, summarize


def rec(token_times, arrival=0.0, ttft_slo=0.25, tbt_slo=0.25, finished=True, cls="chat", rid="r"):
    return RequestRecord(rid, cls, ttft_slo, tbt_slo, arrival, list(token_times), 10, len(token_times), finished)


# Gaps 0.1, 0.05, 0.25. Sorted [0.05, 0.1, 0.25]; linear P99 at rank 0.99*2 = 1.98:
# 0.1 + 0.98 * (0.25 - 0.1) = 0.247 (below the max 0.25, above the mean 0.1333).
HAND = [0.2, 0.3, 0.35, 0.6]


def test_derived_latencies_by_hand():
    r = rec(HAND)
    assert r.ttft == pytest.approx(0.2)
    assert r.tbts == pytest.approx([0.1, 0.05, 0.25])
    assert r.p99_tbt == pytest.approx(0.247)
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.e2e == pytest.approx(0.6)
    assert r.num_output_tokens == 4


def test_slo_uses_p99_tbt_not_mean_or_max():
    # P99 = 0.247: passes 0.248 (max 0.25 would fail), fails 0.2 (mean 0.133 would pass).
    assert rec(HAND, tbt_slo=0.248).slo_met
    assert not rec(HAND, tbt_slo=0.2).slo_met


def test_slo_ttft_boundary_and_none_targets():
    assert rec([1.25, 1.3], arrival=1.0, ttft_slo=0.25).slo_met  # exactly on target
    assert not rec([1.26, 1.3], arrival=1.0, ttft_slo=0.25).slo_met
    assert rec([5.0, 9.0], ttft_slo=None, tbt_slo=None).slo_met
    assert not rec([5.0, 9.0], ttft_slo=None, tbt_slo=1.0).slo_met
    assert not rec([5.0, 9.0], ttft_slo=1.0, tbt_slo=None).slo_met


def test_unfinished_never_meets_and_short_requests():
    assert not rec(HAND, finished=False, ttft_slo=None, tbt_slo=None).slo_met
    assert not rec([], finished=True).slo_met
    one = rec([0.1])
    assert one.p99_tbt is None and one.tpot is None and one.tbts == []
    assert one.slo_met  # no TBT: the TBT constraint holds vacuously
    none = rec([], finished=False)
    assert none.ttft is None and none.e2e is None


def test_summarize_by_hand():
    records = [
        rec([0.1, 0.2, 0.3], rid="a", cls="chat"),  # meets
        rec([0.5, 0.6], rid="b", cls="chat"),  # TTFT 0.5 > 0.25: misses
        rec([1.1, 1.15], arrival=1.0, rid="c", cls="code", ttft_slo=0.125, tbt_slo=0.05),  # meets
        rec([1.2], arrival=1.0, rid="d", cls="code", finished=False),  # unfinished: misses
    ]
    s = summarize(records, duration=2.0)
    assert s.overall.count == 4 and s.overall.finished == 3 and s.overall.slo_met == 2
    assert s.overall.attainment == pytest.approx(0.5)
    chat, code = s.per_class["chat"], s.per_class["code"]
    assert chat.attainment == pytest.approx(0.5) and code.attainment == pytest.approx(0.5)
    assert chat.ttft_mean == pytest.approx(0.3) and chat.ttft_median == pytest.approx(0.3)
    assert code.ttft_mean == pytest.approx(0.15)
    # chat gaps 0.1, 0.1, 0.1; code gaps 0.05 -> pooled mean 0.0875
    assert s.overall.tbt_mean == pytest.approx(0.0875)
    assert chat.tpot_mean == pytest.approx(0.1)
    assert chat.e2e_mean == pytest.approx((0.3 + 0.6) / 2)
    assert s.overall.request_throughput == pytest.approx(3 / 2.0)
    assert s.overall.output_throughput == pytest.approx(8 / 2.0)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["per_class"]["code"]["slo_met"] == 1
    assert d["overall"]["attainment"] == pytest.approx(0.5)


def test_summarize_default_duration_and_empty():
    s = summarize([rec([1.0, 2.0], arrival=0.5), rec([3.0], arrival=1.0)])
    assert s.duration == pytest.approx(2.5)
    e = summarize([])
    assert e.overall.count == 0 and e.overall.attainment is None and e.per_class == {}
    json.dumps(e.to_dict())
