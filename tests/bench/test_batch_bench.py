"""Issue 14: a cold batch job beside interactive traffic, on the simulator (deterministic, virtual
time): a generous window leaves interactive SLO attainment alone; a tight window gets the job
priority and it meets its deadline; the cold tier's admission rules."""

from __future__ import annotations

import dataclasses

import pytest

from laser.batch.estimate import cold_key, is_urgent, job_concurrency, may_start, progress_share
from laser.bench.arrivals import arrival_times
from laser.bench.batchjob import JobDispatcher, hot_ttft, run_pair
from laser.bench.runner import SimTarget
from laser.bench.workloads import WorkloadRequest
from laser.core.config import SchedulerConfig
from laser.latency import SimpleLatencyModel
from laser.core.metrics import summarize
from laser.core.slo import SLOClasses

LM = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-5, per_context=2e-7)


def _workload(shape, n, rate, seed=3):
    base = [WorkloadRequest(c, "x", p, o) for c, p, o in shape * n]
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(base, arrival_times(len(base), rate, 1.0, seed))]


def _hot_attainment(records, slos) -> float:
    hot = [r for r in records if slos.get(r.slo_class).tier == "hot"]
    return summarize(hot).overall.attainment


def _run(slos, wl, job, window, policy="laser"):
    """(interactive records, job dispatcher) of one simulated run with the job."""
    tgt = SimTarget(policy, LM, 4, SchedulerConfig(policy=policy))
    d = JobDispatcher(job, window, LM, hot_ttft_s=hot_ttft(slos))
    out = tgt.run(wl, slos, background=d)
    return out, d


def test_generous_window_leaves_interactive_attainment():
    slos = SLOClasses({"chat": {"ttft": 0.25, "tbt": 0.05, "tier": "hot"},
                       "code": {"ttft": 0.125, "tbt": 0.03, "tier": "hot"},
                       "summarization": {"ttft": 2.0, "tbt": 0.2, "tier": "warm"}})
    wl = _workload([("chat", 200, 12), ("code", 60, 20), ("summarization", 800, 30)], 40, 20.0)
    job = [WorkloadRequest("batch", "x", 2000, 40) for _ in range(100)]  # long prompts: 23 s of work
    alone = SimTarget("laser", LM, 4, SchedulerConfig(policy="laser")).run(wl, slos)
    a0 = _hot_attainment(alone.records, slos)
    assert a0 >= 0.9
    out, d = _run(slos, wl, job, window=100.0)
    a1 = _hot_attainment(out.records, slos)
    assert a1 >= 0.9 and a1 >= a0 - 0.02, (a0, a1)
    res = d.result()
    assert res.completed == 100 and res.met and res.completion_s > d.predicted_work_s
    # the job filled idle capacity: the machine was busier with it than without
    assert out.busy_fraction > alone.busy_fraction


def test_tight_window_gets_priority_and_meets_it():
    slos = SLOClasses({"chat": {"ttft": 0.25, "tbt": 0.05, "tier": "hot"},
                       "summarization": {"ttft": 2.0, "tbt": 0.2, "tier": "warm"}})
    wl = _workload([("chat", 200, 12)] + [("summarization", 800, 30)] * 3, 60, 10.0)  # ~70% busy alone
    job = [WorkloadRequest("batch", "x", 600, 40) for _ in range(40)]  # 3.0 s of whole-machine work
    _, idle_only = _run(slos, wl, job, window=1000.0)
    generous = idle_only.result()
    window = 8.0
    assert generous.met and generous.completion_s > window  # on idle capacity alone it would miss 8 s
    out, d = _run(slos, wl, job, window=window)
    tight = d.result()
    assert d.urgent_since is not None and d.urgent_since < window / 2  # behind early: priority early
    assert tight.completed == 40 and tight.met, tight
    assert _hot_attainment(out.records, slos) >= 0.9


def test_run_pair_reports_both_runs():
    slos = SLOClasses({"chat": {"ttft": 0.25, "tbt": 0.05, "tier": "hot"}})
    wl = _workload([("chat", 100, 8)], 10, 5.0)
    job = [WorkloadRequest("batch", "x", 100, 8) for _ in range(5)]
    res = run_pair(SimTarget("laser", LM, 4), wl, slos, job, 60.0, LM, None)
    run = res["runs"][0]
    assert run["alone"]["attainment"] == 1.0 and run["with_job"]["attainment"] == 1.0
    assert run["job"]["completed"] == 5 and run["job"]["met_window"]
    assert 0 < run["alone"]["busy_fraction"] < run["with_job"]["busy_fraction"] <= 1.0
    with pytest.raises(ValueError):
        JobDispatcher([], 10.0, LM)
    with pytest.raises(ValueError):
        SimTarget("laser", LM, 4, disaggregated=True).run(wl, slos, background=JobDispatcher(job, 10.0, LM))


def test_cold_admission_rules():
    kw = dict(queued=0, max_waiting=256, inflight=0, concurrency=8)
    assert may_start(urgent=False, interactive_waiting=False, **kw)
    assert not may_start(urgent=False, interactive_waiting=True, **kw)
    assert may_start(urgent=True, interactive_waiting=True, **kw)
    assert not may_start(urgent=True, interactive_waiting=True, cold_queued=2, **kw)
    assert not may_start(urgent=True, interactive_waiting=False, **{**kw, "inflight": 8})
    assert not may_start(urgent=True, interactive_waiting=False, **{**kw, "queued": 128})
    # share: whole machine during the grace period, then what it got (nothing done = starved)
    assert progress_share(0.0, 1.0, 100.0) == 1.0 and progress_share(0.0, 10.0, 100.0) == 0.0
    assert progress_share(2.0, 10.0, 100.0) == pytest.approx(0.2)
    # 10 s of work at 20% of the machine misses a deadline 40 s away; at 30% it does not
    assert is_urgent(0.0, 40.0, 10.0, 0.2) and not is_urgent(0.0, 40.0, 10.0, 0.3)
    assert is_urgent(35.0, 40.0, 10.0, 1.0)  # start-by passed
    assert not is_urgent(0.0, 40.0, 0.0, 0.0)
    assert cold_key(0.0, 100.0, 10.0, False, 0.25) == pytest.approx(89.0)
    assert cold_key(0.0, 100.0, 10.0, True, 0.25) == 0.25
    assert cold_key(95.0, 100.0, 10.0, True, 0.25) == pytest.approx(89.0)
    # Little's law: 40 requests of 2 s in 10 s need 9 in flight (x1.1); capped at 4x the base
    assert job_concurrency(8, False, 40, 2.0, 10.0) == 8
    assert job_concurrency(8, True, 40, 2.0, 10.0) == 9
    assert job_concurrency(8, True, 400, 2.0, 10.0) == 32 == job_concurrency(8, True, 4, 2.0, 0.0)
    assert job_concurrency(8, True, 40, None, 10.0) == 8
