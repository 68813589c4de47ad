"""The paper's mechanisms (PPoPP'26 Fig. 1, 3, 5, Alg. 1) on the simulated executor with a
fake latency model: the real schedulers, deterministic virtual time."""

from __future__ import annotations

import math

import pytest

from laser.core.config import SchedulerConfig
from laser.latency import SimpleLatencyModel
from laser.core.metrics import RequestRecord
from laser.core.request import SLO, Request, SamplingParams
from laser.scheduler.laser.decode import DecodePlan
from laser.sim import SimInstance

N = 30


def req(prompt_len: int, arrival: float, ttft=None, tbt=None, max_tokens=1, name="x") -> Request:
    return Request(
        prompt_token_ids=[5] * prompt_len,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0),
        slo=SLO(ttft=ttft, tbt=tbt, name=name),
        arrival_time=arrival,
    )


def ttft(r: Request) -> float:
    return r.token_times[0] - r.arrival_time


def run(policy: str, reqs: list[Request], lm, **cfg) -> SimInstance:
    sim = SimInstance(policy, N, lm, SchedulerConfig(**cfg), record_plans=True)
    for r in reqs:
        sim.submit(r)
    sim.run()
    sim.scheduler.check_integrity(expect_empty=True)
    return sim


PREFILL_LM = SimpleLatencyModel(num_layers=N, per_layer=1e-4, per_token=1e-5)


def test_fig1a_late_tight_request_preempts_at_layer_boundary():
    """A long relaxed prefill is running when a short tight request arrives: Laser pauses the
    long one at the next layer boundary and the tight one meets its TTFT; Sarathi misses."""

    def workload():
        return [req(2000, 0.0, ttft=10.0, name="summ"), req(50, 0.1, ttft=0.1, name="code")]

    laser_reqs = workload()
    sim = run("laser", laser_reqs, PREFILL_LM)
    assert sim.scheduler.num_step_preemptions >= 1
    long_, tight = laser_reqs
    assert ttft(tight) <= 0.1, ttft(tight)
    assert ttft(long_) <= 10.0
    # the long prefill was paused mid-network and resumed from that layer
    assert any(w.req_id == long_.req_id and 0 < w.layer_start < N for p in sim.stats.plans for w in p.works)

    sarathi_reqs = workload()
    run("sarathi", sarathi_reqs, PREFILL_LM, max_num_batched_tokens=512)
    assert ttft(sarathi_reqs[1]) > 0.1, ttft(sarathi_reqs[1])


def test_arrival_stop_pauses_prefill_work_but_not_decode_tokens():
    """An urgent newcomer stops the running step: the prefill chunk in it pauses at the next
    layer boundary, while the decode tokens in the same step run on to their end. Parked
    with the chunk, they would wait for the next step too: a token gap past the TBT target."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-4, per_token=1e-5)
    dec = req(20, 0.0, ttft=1.0, tbt=0.05, max_tokens=60, name="chat")
    long_ = req(1500, 0.05, ttft=10.0, name="summ")
    tights = [req(40, 0.1 + 0.037 * k, ttft=0.05, name="code") for k in range(6)]
    sim = run("laser", [dec, long_, *tights], lm)
    assert sim.scheduler.num_step_preemptions >= 3
    assert all(ttft(t) <= 0.05 for t in tights), [ttft(t) for t in tights]
    gaps = [b - a for a, b in zip(dec.token_times, dec.token_times[1:])]
    assert max(gaps) <= 0.05, max(gaps)
    # the decode request never resumed a token mid-network: every token ran whole
    assert all(w.layer_start == 0 for p in sim.stats.plans for w in p.works if w.req_id == dec.req_id)
    # while the long prefill was paused mid-network and resumed from that layer
    assert any(w.req_id == long_.req_id and 0 < w.layer_start < N for p in sim.stats.plans for w in p.works)


def test_late_urgent_request_is_not_merged_with_more_work():
    """A tight request that arrives while a decode-heavy step runs can be late before it
    starts (the stop lets the step's decode tokens finish their layers). Late, it is served
    as early as possible: nothing merged after it may delay its step (it used to be merged
    with a 512-token chunk of a long prompt: TTFT 0.41 s for a 0.05 s target)."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=2e-4, per_token=2e-5, per_context=2e-7)
    decs = [Request([5] * 3000, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                    slo=SLO(ttft=5.0, tbt=0.5), arrival_time=0.0) for _ in range(48)]
    long_ = req(4000, 3.0, ttft=20.0, max_tokens=2)
    tights = [req(30, 3.05 + 0.2 * k, ttft=0.05, tbt=0.5, max_tokens=2) for k in range(5)]
    sim = SimInstance("laser", N, lm, num_blocks=20000, icache_tokens=16384)
    for r in decs + [long_] + tights:
        sim.submit(r)
    sim.run()
    sim.scheduler.check_integrity(expect_empty=True)
    assert sim.scheduler.num_step_preemptions >= 1
    assert max(ttft(t) for t in tights) < 0.1, [ttft(t) for t in tights]
    # the decode tokens around the arrivals kept their TBT
    gaps = [b - a for r in decs for a, b in zip(r.token_times, r.token_times[1:]) if 3.0 <= a <= 4.5]
    assert gaps and max(gaps) <= 0.5


def test_fig1b_newcomer_merges_into_running_chunk():
    """A newcomer catches up to the running chunk's layer and joins it in one layer call
    instead of waiting for the whole chunk to finish."""

    def workload():
        return [req(300, 0.0, ttft=1.0), req(40, 0.02, ttft=1.0)]

    laser_reqs = workload()
    sim = run("laser", laser_reqs, PREFILL_LM)
    first, second = laser_reqs
    merged = [
        p for p in sim.stats.plans
        if {w.req_id for w in p.works} == {first.req_id, second.req_id}
        and any(w.layer_start > 0 for w in p.works) and any(w.layer_start == 0 for w in p.works)
    ]
    assert merged, "no plan merged the newcomer into the paused chunk"
    vllm_reqs = workload()
    run("vllm", vllm_reqs, PREFILL_LM)
    assert ttft(second) < ttft(vllm_reqs[1])
    assert ttft(first) <= 1.0 and ttft(second) <= 1.0


DECODE_LM = SimpleLatencyModel(num_layers=N, per_layer=3e-4, per_token=5e-5)


def decode_workload():
    tight = [req(4, 0.0, ttft=5.0, tbt=0.02, max_tokens=40, name="tight") for _ in range(2)]
    relaxed = [req(4, 0.0, ttft=5.0, tbt=0.1, max_tokens=40, name="relaxed") for _ in range(20)]
    return tight + relaxed


def attained(reqs: list[Request]) -> list[bool]:
    out = []
    for r in reqs:
        rec = RequestRecord(r.req_id, r.slo.name, None, r.slo.tbt, r.arrival_time, list(r.token_times[1:]),
                            r.num_prompt_tokens, r.num_output_tokens, True)
        # TBT only (TTFT excluded: every request arrives at once; this figure is about decode pacing)
        out.append(rec.slo_met)
    return out


def test_fig3b_layer_level_decode_batching_keeps_relaxed_and_tight_within_slo():
    laser_reqs = decode_workload()
    sim = run("laser", laser_reqs, DECODE_LM)
    vllm_reqs = decode_workload()
    run("vllm", vllm_reqs, DECODE_LM)
    laser_ok, vllm_ok = attained(laser_reqs), attained(vllm_reqs)
    # iteration-level: 22 requests per iteration take ~42 ms > 20 ms: the tight ones miss
    assert not any(vllm_ok[:2])
    assert all(laser_ok), laser_ok
    assert sum(laser_ok) > sum(vllm_ok)
    assert any(p.layers < N for p in sim.scheduler.plans.values()) or sim.scheduler.num_replans > 0


def test_fig5_plans_execute_exactly_the_layers_of_the_rule():
    """Fixed (L, O) plans: layer j (1-based) of r runs in iteration i iff
    (i - ceil(j/L) - O) mod ceil(N/L) == 0."""
    reqs = [req(4, 0.0, tbt=1.0, max_tokens=12) for _ in range(4)]
    given = [DecodePlan(N, 0), DecodePlan(10, 0), DecodePlan(10, 1), DecodePlan(7, 2)]
    sim = SimInstance("laser", N, DECODE_LM, record_plans=True)
    sched = sim.scheduler
    for r in reqs:
        sim.submit(r)
    fixed = {}

    def frozen_replan(decoding):
        for r in decoding:
            fixed.setdefault(r.req_id, given[reqs.index(r)])
        sched.plans = {r.req_id: fixed[r.req_id] for r in decoding}
        sched.replan_needed = False
        sched.t_g = 1.0

    sched._replan = frozen_replan
    executed: dict[str, set] = {r.req_id: set() for r in reqs}
    start_iter: dict[str, int] = {}
    orig = sched.schedule

    def schedule(now):
        i = sched.iteration
        plan = orig(now)
        for w in plan.works:
            if w.req_id in sched.plans and w.num_tokens == 1:
                start_iter.setdefault(w.req_id, i)
                executed[w.req_id].update((i, j) for j in range(w.layer_start + 1, w.layer_end + 1))
        return plan

    sched.schedule = schedule
    sim.run()
    for r, p in zip(reqs, given):
        i0 = start_iter[r.req_id]
        last = max(i for i, _ in executed[r.req_id])
        k = math.ceil(N / p.layers)
        expect = {
            (i, j) for i in range(i0, last + 1) for j in range(1, N + 1)
            if (i - math.ceil(j / p.layers) - p.offset) % k == 0
        }
        # the first decode iteration may begin mid-cycle: compare from the first group-1 start
        got = executed[r.req_id]
        assert got == {x for x in expect if x[0] >= i0 and _after_first_start(x, i0, p, k)}, r
        assert len(r.token_times) == r.sampling_params.max_tokens


def _after_first_start(x, i0, p, k):
    """Iteration/layer pairs of complete token cycles starting at the first iteration >= i0 running group 1."""
    first = next(i for i in range(i0, i0 + k) if (i - 1 - p.offset) % k == 0)
    i, j = x
    return i >= first + math.ceil(j / p.layers) - 1


def test_alg1_restore_strictest_and_revert_when_it_breaks_tg():
    lm = SimpleLatencyModel(num_layers=N, per_layer=3e-4, per_token=5e-5)
    sim = SimInstance("laser", N, lm)
    sched = sim.scheduler
    tight = req(4, 0.0, tbt=0.0135, max_tokens=5)
    mid = req(4, 0.0, tbt=0.05, max_tokens=5)
    loose = req(4, 0.0, tbt=0.2, max_tokens=5)
    decoding = [tight, mid, loose]
    for r in decoding:
        r.output_token_ids = [1]
        r.num_computed_tokens = r.num_tokens - 1
        sched.requests[r.req_id] = r
        sched.running.append(r)
        r.phase = r.phase.DECODE
    # both relaxed requests start reduced; the plan target is tg_margin * T_g = 0.9 * 13.5 =
    # 12.15 ms: restoring `mid` fits (30*0.3 + 0.05*(30+30+2) = 12.1 ms), restoring `loose`
    # as well would not (13.5 ms)
    sched.plans = {tight.req_id: DecodePlan(N, 0), mid.req_id: DecodePlan(8, 0), loose.req_id: DecodePlan(2, 0)}
    sched._replan(decoding)
    assert sched.plans[tight.req_id].layers == N
    assert sched.plans[mid.req_id].layers == N, "strictest reduced request was not restored"
    assert sched.plans[loose.req_id].layers < N, "restore that breaks T_g was not reverted"
    assert sched.predict_decode(decoding) <= 0.9 * 0.0135 + 1e-12


def test_no_starvation_of_best_effort_under_sustained_tight_load():
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-4, per_token=2e-5)
    be = req(800, 0.0, max_tokens=4, name="best_effort")
    stream = [req(200, 0.001 + 0.13 * k, ttft=0.125, tbt=0.05, max_tokens=4, name="code") for k in range(60)]
    for policy in ("laser", "sarathi", "vllm"):
        be_p = req(800, 0.0, max_tokens=4, name="best_effort")
        stream_p = [req(200, r.arrival_time, ttft=0.125, tbt=0.05, max_tokens=4, name="code") for r in stream]
        run(policy, [be_p] + stream_p, lm, best_effort_deadline_s=1.0)
        assert be_p.finish_reason == "length", policy
        if policy != "vllm":
            # served long before the 7.8 s stream ends (aging: deadline = arrival + 1 s).
            # (vLLM v0's prefill-first rule starves *every* decode under this load, by design.)
            assert be_p.finish_time < 3.0, (policy, be_p.finish_time)
    assert be.num_output_tokens == 0


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_icache_eviction_recomputes_and_never_drops(policy):
    reqs = [req(64, 0.0005 * k, ttft=0.05 + 0.01 * k, tbt=0.01, max_tokens=6) for k in range(8)]
    sim = SimInstance(policy, N, DECODE_LM, icache_tokens=8, record_plans=True)
    for r in reqs:
        sim.submit(r)
    sim.run()
    assert all(r.num_output_tokens == 6 for r in reqs)
    sim.scheduler.check_integrity(expect_empty=True)
    if policy != "laser":  # iteration-level: every work runs all layers, nothing is ever paused
        assert sim.icache.num_evictions == 0
        assert all(w.layer_start == 0 and w.layer_end == N for p in sim.stats.plans for w in p.works)
        return
    # The 8-token cache cannot hold any paused 64-token chunk: chunks were evicted, and every
    # evicted chunk was recomputed -- its tokens ran from layer 0 again after running deeper.
    assert sim.icache.num_evictions > 0
    recomputed = set()
    for r in reqs:
        reached: dict[int, int] = {}  # token_start -> deepest layer_end planned so far
        for p in sim.stats.plans:
            for w in p.works:
                if w.req_id != r.req_id:
                    continue
                if w.layer_start == 0 and reached.get(w.token_start, 0) > 0:
                    recomputed.add(r.req_id)
                reached[w.token_start] = max(reached.get(w.token_start, 0), w.layer_end)
    assert len(recomputed) >= 1


def test_marginal_plan_cost_equals_full_prediction():
    """The scheduler's O(segments) marginal cost equals predict_iteration of the extended plan."""
    import random

    from laser.core.plan import StepPlan, Work
    from laser.core.pricing import PlanCost

    lm = SimpleLatencyModel(num_layers=N, per_layer=3e-4, per_token=5e-5, per_context=1e-7,
                            per_embed_token=1e-6, head_const=1e-3, per_head_row=1e-5)
    rng = random.Random(3)
    for _ in range(50):
        works = []
        for k in range(rng.randint(0, 6)):
            a = rng.randrange(N)
            b = rng.randint(a + 1, N)
            q = rng.choice([1, rng.randint(2, 300)])
            works.append(Work(f"r{k}", rng.randint(0, 500), q, a, b))
        cost = PlanCost(lm, N, works)
        assert cost.total == pytest.approx(lm.predict_iteration(StepPlan(N, works)), rel=1e-12, abs=1e-15)
        a = rng.randrange(N)
        w = Work("new", 0, rng.randint(1, 400), a, rng.randint(a + 1, N))
        assert cost.with_work(w) == pytest.approx(lm.predict_iteration(StepPlan(N, works + [w])), rel=1e-9)


def test_alg1_relaxed_layers_are_not_rounded_up_by_floating_point():
    """L = ceil(N * T_g / SLO_r): 48 * 0.05 / 0.1 is 24.000000000000004 in floating point; the
    relaxed request must get 24 layers per iteration (two even groups), not 25."""
    from laser.scheduler.laser.decode import exec_plan

    n = 48
    # tight alone: 48 x 0.9 ms = 43.2 ms (meets 50 ms); both at full depth 48 ms > 0.9 x 50 ms
    lm = SimpleLatencyModel(num_layers=n, per_layer=8e-4, per_token=1e-4)
    tight, relaxed = req(4, 0.0, tbt=0.05, max_tokens=5), req(4, 0.0, tbt=0.1, max_tokens=5)
    for r in (tight, relaxed):
        r.output_token_ids, r.num_computed_tokens = [1], r.num_tokens - 1
    assert 48 * 0.05 / 0.1 > 24  # the floating-point trap itself
    plans, t_g, _ = exec_plan(lm, n, 0, [tight, relaxed], {}, target_factor=0.9)
    assert t_g == 0.05 and plans[tight.req_id].layers == n
    assert plans[relaxed.req_id].layers == 24
