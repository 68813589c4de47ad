"""Alg. 1 on a mixed instance whose layer calls are compute-bound (issue 16, the A100 grid's
weakest point): a decode token merged into a layer call that carries prefill costs a prefill
token's compute, although a decode batch priced alone is bound by its weight read. Alg. 1 must
price the iteration with the prefill the pending deadlines need, and a request it relaxes must
start its first layer group at once. Analytic roofline model of Qwen2.5-14B on an A100
(torch-free, deterministic); simulated executor, virtual time."""

from __future__ import annotations

import numpy as np

from laser.core.config import SchedulerConfig
from laser.latency import AnalyticLatencyModel, SimpleLatencyModel
from laser.core.request import SLO, Request, SamplingParams
from laser.scheduler.laser.budget import prefill_need
from laser.scheduler.laser.decode import DecodeCandidate, exec_plan
from laser.sim import SimInstance

LM = AnalyticLatencyModel("qwen2.5-14b", "a100-80gb")
N = LM.num_layers
CODE = SLO(ttft=0.125, tbt=0.05, name="code")
CHAT = SLO(ttft=0.25, tbt=0.1, name="chat")
SUMM = SLO(ttft=2.0, tbt=0.2, name="summarization")


def _decoding(n_code: int, n_chat: int, ctx: int = 200) -> list[DecodeCandidate]:
    return ([DecodeCandidate(f"code{i}", ctx, CODE) for i in range(n_code)]
            + [DecodeCandidate(f"chat{i}", ctx, CHAT) for i in range(n_chat)])


def test_alg1_prices_decode_with_the_pending_prefill_merged_into_its_layer_calls():
    """60 code (50 ms TBT) and 60 chat (100 ms) streams: alone, their decode iteration is bound
    by the weight read (~18 ms, under 0.9 x 50 ms), so Alg. 1 keeps every plan at full depth.
    With 6,000 prompt tokens/s pending (~270 per 45 ms iteration) the merged layer calls are
    compute-bound and a chat token costs a prefill token's compute: Alg. 1 halves the chat
    plans (a token every 2 iterations, within their 100 ms), and the merged iteration is
    cheaper than with every plan at full depth. Before: exec_plan priced decode alone and never
    reduced a plan here (the prefill share cut its target, but the alone price stayed under it)."""
    dec = _decoding(60, 60)
    plans, t_g, load = exec_plan(LM, N, 0, dec, {}, 0.9)
    assert t_g == CODE.tbt and all(p.layers == N for p in plans.values())
    assert load.predict() < 0.5 * 0.9 * t_g  # weight-bound, far under the target alone

    plans, t_g, load = exec_plan(LM, N, 0, dec, {}, 0.9, prefill_rate=6000.0, max_prefill_tokens=512)
    assert all(plans[f"code{i}"].layers == N for i in range(60))
    chat = [plans[f"chat{i}"] for i in range(60)]
    assert all(p.groups(N) == 2 for p in chat), chat[:3]
    full, _, full_load = exec_plan(LM, N, 0, dec, {}, 1e9, prefill_rate=6000.0, max_prefill_tokens=512)
    assert all(p.layers == N for p in full.values())
    assert load.predict() < full_load.predict() - 0.003  # ~30 decode tokens' compute saved per call
    # no pending prefill on a mixed instance: exactly the decode-alone plans
    plans0, _, _ = exec_plan(LM, N, 0, dec, {}, 0.9, prefill_rate=0.0, max_prefill_tokens=512)
    assert all(p.layers == N for p in plans0.values())


def test_a_relaxed_request_starts_its_first_group_in_the_coming_iteration():
    """A request relaxed at iteration i (it just got its token) runs group 1 in iteration i,
    so its token gap in progress is K iterations, not up to 2K - 1: with a later start, the
    gap would break its TBT target or every iteration before it would have to shrink. Before:
    the least-loaded offset, which left half the relaxed chat streams waiting one iteration
    (the scheduler then cut iterations to 30 ms instead of 45 for them)."""
    dec = _decoding(60, 60)
    for it0 in (0, 1, 5, 8):
        plans, _, _ = exec_plan(LM, N, it0, dec, {}, 0.9, prefill_rate=6000.0, max_prefill_tokens=512)
        for i in range(60):
            p = plans[f"chat{i}"]
            k = p.groups(N)
            assert k > 1 and (it0 - 1 - p.offset) % k == 0, (it0, p)  # Alg. 1's rule: group 1 runs at it0


def _burst() -> list[Request]:
    """The A100 grid's weakest point in small: 300 prompts within 0.45 s (code : chat : code :
    summarization), short code and chat prompts (4-23 tokens, decoding 10 and 32 tokens) and
    summarization prompts of 100-299 tokens (TTFT 2 s): more prefill than the 45 ms iterations
    that code's 50 ms TBT allows carry beside ~100 full-depth decode streams."""
    rng = np.random.default_rng(3)
    reqs = []
    n, span = 300, 0.45
    for k in range(n):
        cls = (CODE, CHAT, CODE, SUMM)[k % 4]
        plen = int(rng.integers(100, 300)) if cls is SUMM else int(rng.integers(4, 24))
        out = {"code": 10, "chat": 32, "summarization": 8}[cls.name]
        reqs.append(Request([7] * plen, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), cls,
                            arrival_time=span * k / n, req_id=f"{cls.name}{k}"))
    return reqs


def test_burst_prefill_gains_the_decode_compute_that_relaxed_plans_free():
    """In the burst, Alg. 1 reduces chat plans while prefill is pending, so the iterations
    carry more prefill: at least 275 of the 300 requests make their TTFT (before, decode priced
    alone at full depth: 271), and every request keeps its TBT (each gap within its class's
    target: a reduced plan's token comes every K iterations of at most 0.9 T_g)."""
    reqs = _burst()
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), num_blocks=15000, record_plans=True)
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=200_000)
    sim.check_integrity(expect_empty=True)
    assert any(w.layer_end - w.layer_start < N for p in sim.stats.plans for w in p.works
               if w.req_id.startswith("chat") and w.is_decode), "no chat plan was reduced"
    made = sum(r.token_times[0] - r.arrival_time <= r.slo.ttft for r in reqs)
    assert made >= 275, made
    for r in reqs:
        if len(r.token_times) > 1:
            assert np.diff(r.token_times).max() <= r.slo.tbt + 1e-9, (r.req_id, np.diff(r.token_times).max())


class _QuadraticAttention(SimpleLatencyModel):
    """A model whose attention grows with the square of the context (a fitted model need not
    be linear in it): a batch priced at its mean context is then cheaper than its real one."""

    def attention_time(self, query_lens, context_lens) -> float:
        return 1e-9 * sum(q * c * c for q, c in zip(query_lens, context_lens))


def test_alg1_prices_a_mixed_context_batch_at_its_real_contexts():
    """Six short streams and one at a 3,000-token context: Alg. 1's price of the decode
    iteration is the model's own (within 1%), not the mean context's (~3x lower here; on the
    AVX2 profile a long summarization stream among short ones cost 272 ms where the mean
    priced 144 ms, so T_g broke and no plan was reduced)."""
    lm = _QuadraticAttention(num_layers=30, per_layer=1e-4, per_token=1e-5)
    dec = [DecodeCandidate(f"r{i}", 100, CHAT) for i in range(6)] + [DecodeCandidate("long", 3000, SUMM)]
    _, _, load = exec_plan(lm, 30, 0, dec, {}, 1e9)  # (no plan reduced: the price of the batch as it is)
    real = lm.predict_decode_iteration([r.num_tokens for r in dec])
    assert abs(load.predict() - real) <= 0.01 * real, (load.predict(), real)


def test_prefill_that_no_time_can_save_does_not_break_t_g():
    """When the pending prefills need more than the whole machine from now on (share f >= 1),
    the iteration keeps the T_g budget: breaking the decode requests' TBT (spending their P99
    allowance) saves no one. Before: an unbounded iteration (375 ms against a 211 ms TBT on
    the AVX2 profile, for a chat prompt that was late anyway)."""
    assert prefill_need(1.5, 0.3, 0.02) == (0.0, 0.0)
    assert prefill_need(0.5, 0.3, 0.02) == (0.02, 0.3)  # p / (0.02 + p) = 0.5; the whole prefill 0.3 s
