"""The Laser scheduler's parts (laser/scheduler/laser/): the overload triage is a pure function that
returns what it decided, recorded by the scheduler in one place, and computed once per step while
the rate it judges at holds."""

from __future__ import annotations

import numpy as np

import laser.scheduler.laser.scheduler as sched_mod
from laser.core.config import SchedulerConfig
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import AnalyticLatencyModel
from laser.scheduler.laser.scheduler import LaserScheduler
from laser.scheduler.laser.triage import triage
from laser.sim import SimInstance

LM = AnalyticLatencyModel("qwen2.5-14b", "a100-80gb")
N = LM.num_layers
CODE = SLO(ttft=0.125, tbt=0.05, name="code")
CHAT = SLO(ttft=0.25, tbt=0.1, name="chat")
SUMM = SLO(ttft=2.0, tbt=0.2, name="summarization")


def _req(i: int, plen: int, slo: SLO, arrival: float = 0.0, out: int = 8) -> Request:
    return Request([7] * plen, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), slo,
                   arrival_time=arrival, req_id=f"r{i}")


def test_triage_returns_what_it_gave_up_and_changes_nothing():
    """Under overload, Moore-Hodgson gives up the long prompt ahead that would make the short ones
    late (not the newcomers), puts it behind them, and leaves every request as it found it: the
    decision is in the returned Triage only."""
    # a chat prompt whose prefill alone nearly fills its 250 ms, then short code prompts due sooner
    # after it in EDF order than it can finish
    long_ = _req(0, 6000, CHAT)
    shorts = [_req(i, 16, CODE, arrival=0.13) for i in range(1, 5)]
    cands = sorted([long_, *shorts], key=lambda r: (r.arrival_time + r.slo.ttft, r.arrival_time))
    assert LM.predict_prefill(6000) > 0.125  # the long one alone takes longer than a code target
    decided = triage(cands, 0.0, LM, N, 1.0, lambda r: True, lambda r: (r.arrival_time + r.slo.ttft, r.arrival_time),
                     64)
    assert decided.given_up == (long_,)
    assert decided.is_given_up(long_) and not any(decided.is_given_up(r) for r in shorts)
    assert sorted(cands, key=decided.key)[-1] is long_  # served behind the savable ones
    assert not any(r.given_up for r in cands)  # nothing recorded on the requests


def _burst(n: int = 160, span: float = 0.45) -> list[Request]:
    """Short code and chat prompts and longer summarization prompts arriving within ``span`` s beside
    decode streams: decode plans, a finite T_g and prefill pending in most steps."""
    rng = np.random.default_rng(3)
    kinds = [(CODE, 4, 24, 10), (CHAT, 4, 24, 32), (CODE, 4, 24, 10), (SUMM, 100, 300, 8)]  # slo, prompt lo/hi, out
    return [_req(k, int(rng.integers(lo, hi)), slo, span * k / n, out)
            for k, (slo, lo, hi, out) in ((k, kinds[k % 4]) for k in range(n))]


def test_triage_is_computed_once_per_step_while_its_rate_holds(monkeypatch):
    """Within one schedule() call, the replan's prefill demand, the knowing-break check and the EDF
    merge read one triage; it is computed again only when the step changed what it judges at (the
    rate, after a replan or the prefill share this step set) or a decode preemption requeued a
    request. Before: each of the three computed it anew (up to three identical triages a step),
    and each recorded its given-up requests on them."""
    computed: list[float] = []
    real = sched_mod.triage

    def counting(cands, now, lm, n, rate, *rest):
        computed.append(rate)
        return real(cands, now, lm, n, rate, *rest)

    monkeypatch.setattr(sched_mod, "triage", counting)
    steps = []
    schedule = LaserScheduler.schedule

    def spy(self, now):
        n0, p0 = len(computed), self.num_preemptions
        plan = schedule(self, now)
        steps.append((computed[n0:], self.num_preemptions != p0))
        return plan

    monkeypatch.setattr(LaserScheduler, "schedule", spy)
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser", role="mixed"), num_blocks=15000)
    for r in _burst():
        sim.submit(r)
    sim.run(max_steps=200_000)
    sim.check_integrity(expect_empty=True)
    asked = [rates for rates, preempted in steps if rates and not preempted]
    assert len(asked) > 20
    for rates in asked:
        assert all(a != b for a, b in zip(rates, rates[1:])), rates  # never twice in a row at one rate
    assert any(rates == [1.0] for rates in asked)  # a step whose three readers shared one triage
