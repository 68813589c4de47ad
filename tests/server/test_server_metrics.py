"""Scheduler observability on /metrics (issue 11, item 8): preemptions by cause, intermediate
cache tokens and evictions, recomputes, per class — from the report the engine publishes."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, Request, SamplingParams
from laser.server.metrics import ServerMetrics
from laser.sim.instance import SimInstance

LM = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=1e-5)
CHAT = SLO(ttft=1.0, tbt=0.4, name="chat")
BE = SLO(name="best_effort")


class _Published:
    """What ServerMetrics reads from an AsyncEngine: the counters of its last snapshot."""

    def __init__(self, counters: dict):
        self._c = counters

    def counters(self) -> dict:
        return self._c


def _samples(metrics: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_kv_preemptions_and_recomputes_are_counted_by_cause_and_class():
    # a pool too small for every decode to grow: the latest-deadline requests are preempted
    sim = SimInstance("sarathi", 4, LM, num_blocks=24, block_size=16)
    for i in range(6):
        slo = CHAT if i % 2 else BE
        sim.submit(Request([3] * 40, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), slo, i * 1e-3))
    sim.run()
    sched = sim.scheduler
    assert sched.num_preemptions > 0
    assert sum(sched.preemptions.values()) == sched.num_preemptions
    assert {cause for cause, _ in sched.preemptions} == {"kv"}
    assert sched.recomputes[("preemption", "best_effort")] > 0  # the loosest are the victims
    m = ServerMetrics("tiny")
    m.async_engine = _Published(sched.report(sim.clock.t).counters)
    s = _samples(m)
    for (cause, cls), n in sched.preemptions.items():
        assert s[("laser:preemptions_total", (("cause", cause), ("slo_class", cls)))] == n
    key = ("laser:recomputes_total", (("kind", "preemption"), ("slo_class", "best_effort")))
    assert s[key] == sched.recomputes[("preemption", "best_effort")]
    assert s[("laser:recomputed_tokens_total", key[1])] == sched.recomputed_tokens[("preemption", "best_effort")] > 0


def test_count_preemption_is_open_to_new_causes():
    sim = SimInstance("laser", 4, LM)
    req = Request([3] * 8, SamplingParams(max_tokens=2), CHAT, 0.0)
    sim.scheduler.count_preemption("running_cap", req)
    sim.scheduler.count_preemption("slo", req)
    assert sim.scheduler.num_preemptions == 2
    m = ServerMetrics("tiny")
    m.async_engine = _Published(sim.scheduler.report(0.0).counters)
    s = _samples(m)
    assert s[("laser:preemptions_total", (("cause", "running_cap"), ("slo_class", "chat")))] == 1


def test_intermediate_cache_tokens_and_evictions():
    sim = SimInstance("laser", 4, LM, icache_tokens=64)
    sched = sim.scheduler
    reqs = [Request([3] * 48, SamplingParams(max_tokens=2), slo, 0.0) for slo in (CHAT, BE)]
    for r in reqs:
        sched.add_request(r)
        r.chunk_tokens, r.next_layer = 48, 2
        sched.icache.put(r.req_id, None, 48)
    sched.enforce_icache_capacity()  # 96 > 64 tokens: the least strict (best effort) goes
    assert sched.recomputes == {("icache_eviction", "best_effort"): 1}
    assert sched.recomputed_tokens[("icache_eviction", "best_effort")] == 48
    m = ServerMetrics("tiny")
    m.async_engine = _Published(sched.report(0.0).counters)
    s = _samples(m)
    assert s[("laser:intermediate_cache_tokens", ())] == 48
    assert s[("laser:intermediate_cache_capacity_tokens", ())] == 64
    assert s[("laser:intermediate_cache_evictions_total", ())] == 1
    assert s[("laser:latency_model_calibration", ())] == 1.0  # the simulator plans with its model as is
    assert s[("laser:latency_model_calibration_decode", ())] == 1.0
    assert s[("laser:latency_model_timing_spread", ())] == 1.0
    assert s[("laser:recomputes_total", (("kind", "icache_eviction"), ("slo_class", "best_effort")))] == 1


def test_metrics_before_the_first_step_are_empty_not_errors():
    m = ServerMetrics("tiny")
    m.async_engine = _Published({})
    s = _samples(m)
    assert s[("laser:intermediate_cache_evictions_total", ())] == 0


def test_an_output_judges_its_own_slo_and_the_metrics_count_numbers():
    """A finished output's SLO outcome is its own (RequestOutput.slo_outcome, by RequestRecord's
    rule); the miss causes the metrics count come from the output's copied causes and the
    request's admission, not from the request."""
    from laser.frontend.admission import Admission
    from laser.frontend.outputs import RequestOutput
    from laser.server.metrics import miss_causes

    slo = SLO(ttft=0.1, tbt=0.05, name="chat")

    def out(times):
        return RequestOutput("r", None, [1, 2], "", [5] * len(times), "", [], True, "length", slo,
                             arrival_time=1.0, token_times=tuple(times))

    assert out([1.05, 1.09, 1.13]).slo_outcome() == (True, True)
    assert out([1.2, 1.24]).slo_outcome() == (False, True)  # first token 0.2 s after arrival
    assert out([1.05, 1.2]).slo_outcome() == (True, False)  # its only gap is over 0.05 s
    assert miss_causes((), None) == ("unexplained",)
    assert miss_causes(("kv_preempted",), None) == ("kv_preempted",)
    a = Admission(slo, SLO(ttft=0.05, tbt=0.05, name="code"), predicted_ttft=0.08, demoted=True)
    assert miss_causes(("kv_preempted",), a) == ("kv_preempted", "demoted", "predicted_infeasible")
