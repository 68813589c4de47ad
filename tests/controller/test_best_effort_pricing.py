"""Alg. 2 (PPoPP'26 §7.2.1) prices a decode instance's iterations as its scheduler runs them,
best-effort share included (issue 28: beside SLO work best effort takes at most
``SchedulerConfig.best_effort_share`` of an iteration). On simulated cluster instances."""

from __future__ import annotations

import pytest

from laser.controller import get_controller
from laser.core.config import SchedulerConfig
from laser.core.request import SLO, Phase, Request, SamplingParams
from laser.instance.core import Handoff
from laser.instance.messages import RequestInfo
from laser.latency import SimpleLatencyModel
from laser.sim.cluster_instance import SimClusterInstance

N = 30
# a decode stream costs what it does on a CPU (tests/scheduler/test_slo_pressure.py's SLOW_DECODE)
LM = SimpleLatencyModel(num_layers=N, per_layer=1.2e-3, per_token=1.5e-4, per_context=1.7e-6)
CHAT = SLO(ttft=1.0, tbt=0.4, name="chat")
BEST = SLO(name="best_effort")


def _decoding(rid: str, slo: SLO, prompt: int = 64) -> Request:
    """A request whose prefill ran elsewhere: one output token, KV for the prompt."""
    r = Request([1] * prompt, SamplingParams(max_tokens=200, ignore_eos=True), slo, req_id=rid)
    r.output_token_ids, r.token_times, r.num_computed_tokens, r.phase = [0], [0.0], prompt, Phase.DECODE
    return r


def _steps(d: SimClusterInstance, n: int = 3) -> None:
    for _ in range(n):
        d.begin(d.clock)
        d.complete()


def _decode_instance(iid: int, slos: list[SLO], share: float = 0.2) -> SimClusterInstance:
    d = SimClusterInstance(iid, "decode", "laser", LM, 4096, icache_tokens=2048,
                           config=SchedulerConfig(best_effort_share=share))
    for k, slo in enumerate(slos):
        d.add_request(Handoff(_decoding(f"i{iid}-{k}", slo), None), at=0.0)
    _steps(d)
    return d


def _chat() -> RequestInfo:
    return RequestInfo("new", 0.0, 64, CHAT.ttft, CHAT.tbt, "chat", 32)


def test_alg2_prices_an_instance_with_best_effort_streams_as_its_scheduler_runs_it():
    """One chat stream and six best-effort streams on instance 0: its scheduler runs the
    best-effort streams on one layer per iteration (they take at most 0.2 of an iteration beside
    the chat). Alg. 2 priced the newcomer with the paper's rule instead (best effort restored to
    full depth, up to T_g): an iteration of 99 ms the scheduler never runs and an increment of
    -7.3 s (the six streams' N-iteration tokens priced as one-iteration ones), the smallest of
    any instance, so every chat went to the instance loaded with best effort. Now the increment
    is that of the plans the scheduler makes once the request joins, and with two chat streams
    on instance 1 (a smaller increment) the chat goes there."""
    a = _decode_instance(0, [CHAT] + [BEST] * 6)
    b = _decode_instance(1, [CHAT] * 2)
    assert sum(p.layers for p in a.scheduler.plans.values()) == 2 * N + 5  # best effort at one layer
    inc = a.latency_increment(_chat())
    assert inc.value > 0, inc
    prefill = SimClusterInstance(100, "prefill", "laser", LM, 1024)
    ctl = get_controller("laser")(tbt_targets=(CHAT.tbt,))
    ctl.attach([prefill, a, b])
    ctl.groups.groups[CHAT.tbt].members = [0, 1]
    assert ctl.assign_decode(_chat()) == 1
    # the plans Alg. 2 priced are those instance 0's scheduler runs once the chat joins
    a.add_request(Handoff(_decoding("new", CHAT), None), at=a.clock)
    _steps(a)
    sched = a.scheduler
    assert sched.predict_decode(sched.decoding()) == pytest.approx(inc.iter_after, rel=0.02)


def test_alg2_at_a_share_of_one_prices_the_paper_rule():
    """``best_effort_share=1.0`` (the paper's rule, best effort restored up to T_g): the
    instance's scheduler and Alg. 2 both restore the best-effort streams to full depth."""
    a = _decode_instance(0, [CHAT] + [BEST] * 6, share=1.0)
    assert all(p.layers == N for p in a.scheduler.plans.values())
    inc = a.latency_increment(_chat())
    a.add_request(Handoff(_decoding("new", CHAT), None), at=a.clock)
    _steps(a)
    sched = a.scheduler
    assert sched.predict_decode(sched.decoding()) == pytest.approx(inc.iter_after, rel=0.02)
