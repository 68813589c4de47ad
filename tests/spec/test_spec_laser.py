"""Self-speculation under the ``laser`` policy: greedy fp32 output equals plain decoding for
batched requests, beside prefill chunks paused at a layer boundary for an arrival, with Alg. 1
relaxing some requests to layer groups (those decode plainly), and for requests preempted from a
small KV pool; integrity after each. The plan's price and Alg. 1's include the draft and verify
passes (laser.core.speculation)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laser.core.config import CacheConfig, SchedulerConfig
from laser.core.plan import StepPlan
from laser.core.request import SLO, SamplingParams
from laser.core.speculation import spec_decode_time
from laser.frontend.disagg import DisaggregatedPair
from laser.frontend.engine import Engine
from laser.latency import SimpleLatencyModel
from simutil import FakeClock, replay_at_layer_boundaries
from test_self_spec import _speculate, _tail_scaled_model

# (a speculative step of 1 or 3 drafts costs 1.5x or 2.5x a plain decode iteration on this latency
# model's per-layer-call overhead: code's 7.5 ms holds alone with 1 draft, not with 3, and then
# chat's 12 ms sets T_g)
_SUMM = SLO(ttft=0.03, tbt=0.05, name="summarization")
_CODE = SLO(ttft=0.002, tbt=0.0075, name="code")
_CHAT = SLO(ttft=0.004, tbt=0.012, name="chat")
# (prompt, max_tokens, SLO, arrival at the n-th layer boundary): late arrivals stop running steps
# at a layer boundary (their prefill chunks pause mid-layers), tight TBT targets make Alg. 1
# relax the looser requests to layer groups
MIXED = [
    ([7] * 40, 30, _SUMM, 0), ([9] * 30, 24, _CODE, 3), ([11] * 5, 34, _SUMM, 0),
    ([13] * 5, 34, _CHAT, 0), ([15] * 5, 36, SLO(), 0), ([17] * 24, 24, _CHAT, 9),
    ([19, 20, 21] * 9, 26, _CODE, 14), ([23] * 33, 20, SLO(), 21),
]
LM = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=2e-5, per_context=1e-6)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def near(tiny_llama, tmp_path_factory):
    """The tiny model with layers 2..3 nearly the identity: drafts from the exit after layer 2 are
    partly accepted."""
    return str(_tail_scaled_model(tiny_llama, tmp_path_factory.mktemp("near"), 0.05, 2))


@pytest.fixture(scope="module")
def ref(near):
    return Engine(near, policy="vllm", dtype="float32", enable_prefix_caching=False,
                  latency_calibration=False)


@pytest.fixture(scope="module")
def want(ref):
    out = {}
    for prompt, n, _, _ in MIXED:
        r = ref.add_request(list(prompt), _greedy(n))
        while ref.has_unfinished():
            ref.step()
        out[tuple(prompt)] = list(r.output_token_ids)
    return out


def _observe(engine, seen: dict) -> None:
    """Count the plans with reduced (L < N) decode plans and with paused (mid-layer) prefill work."""
    sched = engine.scheduler
    orig = sched.schedule

    def schedule(now):
        plan = orig(now)
        n = sched.num_layers
        if any(p.layers < n for p in sched.plans.values()):
            seen["reduced"] += 1
        if any(w.layer_start > 0 and not w.is_decode for w in plan.works):
            seen["resumed_prefill"] += 1
        if plan.predicted is not None and sched._spec_pricing(plan.works)[0]:
            seen["priced_spec"] += 1
        return plan

    sched.schedule = schedule


@pytest.mark.parametrize("g,budget,icache", [(1, 16, 8), (3, 24, 16384)])
def test_laser_greedy_identical_batched_and_paused(near, want, g, budget, icache):
    e = Engine(near, policy="laser", dtype="float32", latency_calibration=False)
    spec = _speculate(e, 2, g)
    e.reconfigure(SchedulerConfig(policy="laser", role="mixed", max_num_batched_tokens=budget), LM,
                  intermediate_cache_tokens=icache, clock=FakeClock())
    assert e.scheduler.speculation == spec.shape
    seen = {"reduced": 0, "resumed_prefill": 0, "priced_spec": 0}
    _observe(e, seen)
    got = replay_at_layer_boundaries(e, [e], MIXED, _greedy)
    for (prompt, n, _, _), r in zip(MIXED, got):
        assert r.finish_reason == "length"
        assert r.output_token_ids == want[tuple(prompt)]
    e.check_integrity(expect_empty=True)
    assert spec.stats.steps > 0 and 0 < spec.stats.accepted < spec.stats.drafted
    assert e.scheduler.num_step_preemptions > 0  # prefill paused at a layer boundary for an arrival
    assert seen["resumed_prefill"] > 0 and seen["reduced"] > 0 and seen["priced_spec"] > 0


def test_laser_greedy_identical_when_preempted(near, want):
    """A pool too small for every request: decode KV preempts requests (recomputed later) and
    drafts shrink or fall back to plain decoding; the output is still the plain one."""
    e = Engine(near, policy="laser", dtype="float32", latency_calibration=False,
               cache=CacheConfig(block_size=4, num_blocks=24))
    spec = _speculate(e, 2, 4)
    e.reconfigure(SchedulerConfig(policy="laser", role="mixed", max_num_batched_tokens=32), LM,
                  intermediate_cache_tokens=16384, clock=FakeClock())
    reqs = [(p, n, slo, 0) for p, n, slo, _ in MIXED]
    got = replay_at_layer_boundaries(e, [e], reqs, _greedy)
    for (prompt, n, _, _), r in zip(MIXED, got):
        assert r.output_token_ids == want[tuple(prompt)]
    e.check_integrity(expect_empty=True)
    assert e.scheduler.num_preemptions > 0
    assert spec.stats.steps > 0 and spec.stats.fallbacks > 0


def test_laser_plan_prices_the_speculative_step(tiny_llama):
    """A step of speculating decode tokens is priced as its draft passes and verify chunk."""
    e = Engine(str(tiny_llama), policy="laser", dtype="float32", latency_calibration=False)
    spec = _speculate(e, 2, 3)
    e.reconfigure(SchedulerConfig(policy="laser", role="mixed"), LM, clock=FakeClock())
    reqs = [e.add_request([5 + i] * 8, _greedy(6)) for i in range(3)]
    sched = e.scheduler
    while any(r.num_output_tokens == 0 for r in reqs):
        e.step()
    plan = sched.schedule(sched.clock())
    ctx = sorted(r.num_tokens for r in reqs)
    want_t = spec_decode_time(LM, 4, 2, [(c, 3) for c in ctx])
    assert plan.predicted[1] == pytest.approx(want_t)
    assert plan.predicted[1] > LM.predict_decode_iteration(tuple(ctx))  # dearer than a plain decode step
    # re-priced from the plan alone (the calibration's inner model, the arrival rule): the same
    assert LM.predict_iteration(StepPlan(4, plan.works, speculative=plan.speculative)) == pytest.approx(want_t)
    sched.step.begin(plan, sched.plans, 0.0)
    assert sched.step.remaining_from(0) == pytest.approx(want_t)
    sched.step.end()
    e.core.execute(plan)
    while e.has_unfinished():
        e.step()
    e.check_integrity(expect_empty=True)
    assert spec.stats.steps > 0


@pytest.fixture(scope="module")
def spec_engine(near):
    e = Engine(near, policy="laser", dtype="float32", latency_calibration=False)
    return e, _speculate(e, 2, 2)


@pytest.fixture(scope="module")
def prefill_engine(near):
    return Engine(near, policy="laser", dtype="float32", latency_calibration=False)


_slos = st.sampled_from([SLO(), _CODE, _CHAT, _SUMM, SLO(ttft=0.0005, tbt=0.001, name="tight")])


@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(st.tuples(st.lists(st.integers(3, 900), min_size=1, max_size=40), st.integers(1, 16), _slos,
                               st.integers(0, 40)), min_size=1, max_size=6),
       budget=st.integers(4, 64), icache=st.sampled_from([1, 8, 16384]), per_layer=st.sampled_from([1e-4, 1e-3]),
       disaggregated=st.booleans())
def test_laser_greedy_invariant_random_arrivals(spec_engine, prefill_engine, ref, reqs, budget, icache, per_layer,
                                                disaggregated):
    """tests/test_invariance.py's property under laser with self-speculation: random prompts,
    arrivals at random layer boundaries, budgets and intermediate-cache sizes, on a mixed instance
    or on a speculating decode instance fed by a prefill one."""
    e, spec = spec_engine
    lm = SimpleLatencyModel(num_layers=4, per_layer=per_layer, per_token=2e-5, per_context=1e-6)
    clock = FakeClock()
    e.reconfigure(SchedulerConfig(policy="laser", role="decode" if disaggregated else "mixed",
                                  max_num_batched_tokens=budget), lm, intermediate_cache_tokens=icache, clock=clock)
    target, engines = e, [e]
    if disaggregated:
        prefill_engine.reconfigure(SchedulerConfig(policy="laser", role="prefill", max_num_batched_tokens=budget), lm,
                                   intermediate_cache_tokens=icache, clock=clock)
        target, engines = DisaggregatedPair(prefill_engine, e), [prefill_engine, e]
    steps = spec.stats.steps
    got = replay_at_layer_boundaries(target, engines, reqs, _greedy)
    for (prompt, n, _, _), r in zip(reqs, got):
        w = ref.add_request(list(prompt), _greedy(n))
        while ref.has_unfinished():
            ref.step()
        assert r.output_token_ids == w.output_token_ids
    for x in engines:
        x.check_integrity(expect_empty=True)
    assert spec.stats.steps > steps or all(n <= 2 for _, n, _, _ in reqs)  # (n <= 2: nothing to draft)
    SEEN["disaggregated" if disaggregated else "mixed"] += spec.stats.steps > steps


SEEN = {"mixed": 0, "disaggregated": 0}  # examples that speculated, per set-up


def test_random_arrivals_speculated_in_both_setups():
    """The property test above is meaningful only if both set-ups speculated."""
    assert all(SEEN.values()), SEEN
