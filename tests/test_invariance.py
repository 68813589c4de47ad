"""The invariant that guards everything: with greedy sampling in fp32, a request's output
does not depend on the policy, the role set-up, what it was batched with, where it was
paused, its (L, O) decode plan, intermediate-cache evictions, or a prefix-cache hit (the
engines under test keep their prefix caches across examples; the reference has none)."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from laser.core.config import SchedulerConfig
from laser.frontend.disagg import DisaggregatedPair
from laser.frontend.engine import Engine
from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, SamplingParams
from simutil import FakeClock, replay_at_layer_boundaries




def reconfigure(engine: Engine, policy: str, role: str, budget: int, icache_tokens: int, lm, clock) -> None:
    """Fresh scheduler + intermediate cache on an existing engine (reuses model and KV pool)."""
    for rid in list(engine.scheduler.requests):  # left over by a failed example
        engine.abort(rid)
    cfg = SchedulerConfig(policy=policy, role=role, max_num_batched_tokens=budget)
    engine.reconfigure(cfg, lm, intermediate_cache_tokens=icache_tokens, clock=clock)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    mk = lambda **kw: Engine(str(tiny_llama), policy="vllm", dtype="float32", **kw)  # noqa: E731
    # the reference never reads a cached prefix; the engines under test keep theirs across
    # examples (on by default), so prompts repeated or sharing blocks hit it
    return {"ref": mk(enable_prefix_caching=False), "a": mk(), "b": mk()}


REF_CACHE: dict = {}
# How often each mechanism was exercised over all examples (checked by the last test).
SEEN = {"examples": 0, "step_preemptions": 0, "evictions": 0, "reduced_plans": 0, "merges": 0, "partial_layers": 0,
        "handoffs": 0, "prefix_hits": 0}


def observe(engine: Engine) -> None:
    """Wrap the scheduler so every plan it makes is inspected for the mechanisms exercised."""
    sched = engine.scheduler
    orig = sched.schedule

    def schedule(now):
        plan = orig(now)
        n = sched.num_layers
        starts = {w.layer_start for w in plan.works}
        if 0 in starts and len(starts) > 1:
            SEEN["merges"] += 1
        if any(w.layer_end < n for w in plan.works):
            SEEN["partial_layers"] += 1
        if any(p.layers < n for p in getattr(sched, "plans", {}).values()):
            SEEN["reduced_plans"] += 1
        return plan

    sched.schedule = schedule


def reference(engine: Engine, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy output of ``prompt`` run alone under iteration-level scheduling."""
    key = (prompt, n)
    if key not in REF_CACHE:
        reconfigure(engine, "vllm", "mixed", 4096, 16384, None, FakeClock())
        req = engine.add_request(list(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        REF_CACHE[key] = req.output_token_ids
    return REF_CACHE[key]


slos = st.sampled_from(
    [
        SLO(),
        SLO(ttft=0.002, tbt=0.003, name="code"),
        SLO(ttft=0.004, tbt=0.006, name="chat"),
        SLO(ttft=0.03, tbt=0.012, name="summarization"),
        SLO(ttft=0.0005, tbt=0.001, name="tight"),
    ]
)
request_st = st.tuples(
    st.lists(st.integers(3, 900), min_size=1, max_size=48),  # prompt
    st.integers(1, 10),  # max_tokens
    slos,
    st.integers(0, 60),  # arrival: layer boundary count at which it is added
)


_SUMM = SLO(ttft=0.03, tbt=0.012, name="summarization")
# (a TBT target a request misses even alone no longer sets T_g: 4.4 ms is reachable alone on this
# 4-layer model, ~4.2 ms, but not with the load below, so Alg. 1 must reduce the looser requests)
_CODE = SLO(ttft=0.002, tbt=0.0044, name="code")
_CHAT = SLO(ttft=0.004, tbt=0.006, name="chat")
# Deterministic cases that hit every mechanism (random examples explore around them).
_MIXED_LOAD = [
    ([7] * 40, 8, _SUMM, 0), ([9] * 30, 6, _CODE, 3), ([11] * 5, 10, _SUMM, 0),
    ([13] * 5, 10, _CHAT, 0), ([15] * 5, 10, SLO(), 0), ([17] * 24, 5, _CHAT, 9),
]


# Prompts sharing 0, 1, 2 and all blocks (16 tokens) with the first, arriving once it ran some layers.
_SHARED = [
    ([21] * 16 + [22] * 16 + [23] * 5, 4, _CHAT, 0), ([21] * 16 + [22] * 16 + [23] * 5, 3, _CODE, 12),
    ([21] * 16 + [40] * 9, 5, _SUMM, 14), ([21] * 16 + [22] * 16, 3, _CHAT, 16), ([50] * 20, 2, SLO(), 16),
]


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@example(reqs=_SHARED, policy="laser", disaggregated=False, budget=16, icache_tokens=8, per_layer=1e-3)
@example(reqs=_SHARED, policy="laser", disaggregated=True, budget=24, icache_tokens=16384, per_layer=1e-4)
@example(reqs=_SHARED, policy="sarathi", disaggregated=False, budget=8, icache_tokens=8, per_layer=1e-4)
@example(reqs=_MIXED_LOAD, policy="laser", disaggregated=False, budget=16, icache_tokens=1, per_layer=1e-3)
@example(reqs=_MIXED_LOAD, policy="laser", disaggregated=True, budget=16, icache_tokens=3, per_layer=1e-3)
@example(reqs=_MIXED_LOAD, policy="sarathi", disaggregated=False, budget=8, icache_tokens=8, per_layer=1e-4)
@given(
    reqs=st.lists(request_st, min_size=1, max_size=6),
    policy=st.sampled_from(["vllm", "sarathi", "laser"]),
    disaggregated=st.booleans(),
    budget=st.integers(4, 96),
    icache_tokens=st.sampled_from([1, 3, 8, 32, 16384]),
    per_layer=st.sampled_from([1e-4, 1e-3]),
)
def test_greedy_output_is_schedule_invariant(engines, reqs, policy, disaggregated, budget, icache_tokens, per_layer):
    lm = SimpleLatencyModel(num_layers=4, per_layer=per_layer, per_token=2e-5, per_context=1e-6)
    clock = FakeClock()
    a, b = engines["a"], engines["b"]
    if disaggregated:
        reconfigure(a, policy, "prefill", budget, icache_tokens, lm, clock)
        reconfigure(b, policy, "decode", budget, icache_tokens, lm, clock)
        target = DisaggregatedPair(a, b)
    else:
        reconfigure(a, policy, "mixed", budget, icache_tokens, lm, clock)
        target = a
    for e in (a, b):
        observe(e)
    outs = replay_at_layer_boundaries(target, [a, b] if disaggregated else [a], reqs,
                                      lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for i, ((prompt, n, _, _), got) in enumerate(zip(reqs, outs)):
        assert got.finish_reason == "length"
        assert got.output_token_ids == reference(engines["ref"], tuple(prompt), n), (policy, i)
    for e in (a, b):
        e.check_integrity(expect_empty=True)
        SEEN["prefix_hits"] += e.scheduler.prefix_cache_hits
        SEEN["step_preemptions"] += getattr(e.scheduler, "num_step_preemptions", 0)
        SEEN["evictions"] += e.icache.num_evictions
    SEEN["handoffs"] += len(getattr(target, "adopted", ()))
    SEEN["examples"] += 1


def test_mechanisms_were_exercised():
    """The property test above is only meaningful if it hit every mechanism."""
    missing = [k for k, v in SEEN.items() if v == 0]
    assert not missing, (missing, SEEN)
