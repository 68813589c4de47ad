"""Tight SLOs when resources run short (issue "Keep tight SLOs under pressure"), on the simulated
executor with a latency model sized like SmolLM2 on one CPU core: a code or chat request keeps
its targets at the running cap, under KV pressure and beside a long prefill; a target that no
schedule can meet stops costing everyone else throughput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from laser.core.config import SchedulerConfig
from laser.latency import CalibratedLatencyModel, ScaledLatencyModel, SimpleLatencyModel
from laser.core.request import SLO, Request, SamplingParams
from laser.sim import SimInstance
from simutil import run_sim

N = 30
# ~1.2 ms per decode layer call at batch 4 (36 ms per iteration), a 2,000-token prefill alone
# ~2.2 s: the shape of SmolLM2 in fp32 on one core.
LM = SimpleLatencyModel(num_layers=N, per_layer=1.0e-3, per_token=3.6e-5, per_context=2e-8)

# the shipped classes at --slo-scale 4 (seconds)
CHAT = SLO(ttft=1.0, tbt=0.4, name="chat")
CODE = SLO(ttft=0.5, tbt=0.2, name="code")
SUMM = SLO(ttft=8.0, tbt=0.8, name="summarization")
BEST = SLO(name="best_effort")


def req(prompt: int, arrival: float, slo: SLO, max_tokens: int, name: str = "") -> Request:
    return Request([7] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), slo,
                   arrival_time=arrival, req_id=name or "")


def ttft(r: Request) -> float:
    return r.token_times[0] - r.arrival_time


def p99_tbt(r: Request) -> float:
    gaps = np.diff(r.token_times)
    return float(np.percentile(gaps, 99)) if len(gaps) else 0.0


def run(policy: str, reqs: list[Request], lm=LM, num_blocks: int = 4096, **cfg) -> SimInstance:
    return run_sim(policy, reqs, lm, N, config=SchedulerConfig(**cfg), record_plans=False, num_blocks=num_blocks)


@pytest.mark.parametrize("policy", ["laser", "sarathi", "vllm"])
def test_strict_request_preempts_looser_one_at_the_running_cap(policy):
    """--max-num-seqs 4: four best-effort streams hold every slot; a code request arriving at
    t=1 s used to wait ~14 s for all of them to finish. It must get its first token within its
    0.5 s target, the least strict running request paying (recomputed later, all tokens kept)."""
    bes = [req(64, 0.0, BEST, 128, f"be{k}") for k in range(4)]
    code = req(32, 1.0, CODE, 16, "code")
    sim = run(policy, bes + [code], max_num_seqs=4)
    assert ttft(code) <= CODE.ttft, ttft(code)
    assert sim.scheduler.preemptions[("running_cap", "best_effort")] >= 1
    assert all(r.num_preemptions <= 1 for r in bes)


@pytest.mark.parametrize("policy", ["laser", "sarathi", "vllm"])
def test_running_cap_holds_in_every_step_after_a_preemption(policy):
    """The victim of a running-cap preemption has output tokens, so it waits in the PREFILL
    phase: it must still count against ``max_num_seqs``. Laser used to re-admit it in the very
    step its preemption made room for (five running with a cap of four), its recompute of
    prompt + outputs riding in the code request's first step (code TTFT 0.38 s instead of
    ~0.19 s on the shipped AVX2 profile; 0.58 s on the real engine against 0.5 s)."""
    bes = [req(64, 0.0, BEST, 128, f"be{k}") for k in range(4)]
    code = req(32, 1.0, CODE, 16, "code")
    sim = SimInstance(policy, N, LM, SchedulerConfig(max_num_seqs=4), num_blocks=4096)
    for r in bes + [code]:
        sim.submit(r)
    most = []

    def check():
        most.append(len(sim.scheduler.running))
    sim.run(max_steps=2_000_000, before_step=check)
    assert max(most) <= 4, max(most)
    sim.check_integrity(expect_empty=True)
    alone = LM.predict_prefill(32) + LM.predict_decode_iteration([100] * 4)
    assert ttft(code) <= alone, (ttft(code), alone)


def test_equal_classes_never_preempt_each_other_at_the_cap():
    """Only a strictly stricter class takes a slot: same-class requests wait their turn (no
    back-and-forth recomputation)."""
    reqs = [req(64, 0.01 * k, CHAT, 64, f"c{k}") for k in range(6)]
    sim = run("laser", reqs, max_num_seqs=4)
    assert sim.scheduler.num_preemptions == 0


@pytest.mark.parametrize("policy", ["laser", "sarathi"])
def test_kv_goes_to_the_strictest_deadlines(policy):
    """A KV pool of 4,096 tokens held by eight 600-token best-effort requests: four 32-token
    chat requests arriving at 0.3 s still meet TTFT 1.0 s and P99 TBT 0.4 s; the victims are
    best-effort requests (never a chat one), each preempted a bounded number of times, and
    every request completes."""
    bes = [req(600, 0.0, BEST, 128, f"be{k}") for k in range(8)]
    chats = [req(32, 0.3, CHAT, 16, f"chat{k}") for k in range(4)]
    sim = run(policy, bes + chats, num_blocks=256)  # 256 blocks x 16 tokens
    for c in chats:
        assert ttft(c) <= CHAT.ttft, (c.req_id, ttft(c))
        assert c.num_preemptions == 0
        if policy == "laser":  # (Sarathi's 512-token chunks of the recomputed prompts alone take 0.6 s)
            assert p99_tbt(c) <= CHAT.tbt, (c.req_id, p99_tbt(c))
    assert sum(r.num_preemptions for r in bes) >= 1
    assert max(r.num_preemptions for r in bes) <= 3


@pytest.mark.parametrize("arrival", [0.1, 0.7])
def test_work_merged_after_a_tight_request_leaves_its_ttft_margin(arrival):
    """Chat requests arriving during a best-effort prefill under KV pressure: the best-effort
    work merged into their steps is sized so that their first tokens come within
    ``ttft_margin`` of the TTFT target, not at its last millisecond (a real step running 10 %
    over its prediction then still meets it); best-effort work still rides in those steps.
    Checked with every merge the deadlines allow (``first_token_stretch`` unbounded); by default
    best-effort work that can wait is held back from the steps that complete the chats'
    prefills (``PrefillPlanner.holds_back``, issue 28), and their first tokens come far sooner."""
    for stretch in (math.inf, None):
        bes = [req(600, 0.0, BEST, 128, f"be{k}") for k in range(8)]
        chats = [req(32, arrival, CHAT, 16, f"chat{k}") for k in range(4)]
        sim = SimInstance("laser", N, LM, SchedulerConfig(), num_blocks=256, record_plans=True)
        if stretch is not None:
            sim.scheduler.prefill.first_token_stretch = stretch
        for r in bes + chats:
            sim.submit(r)
        sim.run(max_steps=2_000_000)
        sim.check_integrity(expect_empty=True)
        for c in chats:  # (with no margin they come at 1.000 s, the last millisecond of the target)
            assert ttft(c) <= 0.9 * CHAT.ttft + 1e-9, (c.req_id, ttft(c))
        if stretch is not None:
            mixed = any(any(w.req_id.startswith("chat") and w.num_tokens > 1 for w in p.works)
                        and any(w.req_id.startswith("be") for w in p.works) for p in sim.stats.plans)
            assert mixed, "no best-effort work was merged beside the chat prefills"
        else:  # (every merge allowed: 0.90 s)
            assert max(ttft(c) for c in chats) <= 0.3, [round(ttft(c), 3) for c in chats]


def test_long_prefill_meets_its_deadline_beside_tight_decodes():
    """Four code streams decoding; at t=2 s a 2,000-token summarization request (2.2 s alone,
    8 s target). The prefill time per iteration follows its deadline: the long request meets
    its TTFT and the code streams keep P99 TBT under 0.2 s (it used to take 9 s with a fixed
    prefill share)."""
    codes = [req(64, 0.0, CODE, 128, f"code{k}") for k in range(4)]
    long_ = req(2000, 2.0, SUMM, 8, "long")
    run("laser", codes + [long_])
    assert ttft(long_) <= SUMM.ttft, ttft(long_)
    for c in codes:
        assert p99_tbt(c) <= CODE.tbt, (c.req_id, p99_tbt(c))


def test_decode_plans_hold_tg_when_tight_decodes_fill_the_iteration():
    """When tight-TBT decodes alone fill an iteration, queued prefills must not be added on top
    (a fixed 30% prefill share used to break T_g for all ten streams): every code stream meets
    its P99 TBT while any of them can still meet its SLO. The prefills' deadlines cannot all be
    met too, and the streams (64 tokens: no P99 allowance to spend) are ten requests against
    three: the prefills get the headroom and finish late, knowingly. Seven of the ten code
    prompts get their first token late (0.63 s, and 8-12 s: the target is 0.5 s); once only those
    decode, no SLO is left to keep, T_g is released and the last summarization prefill gets
    the iterations (its TTFT 15.1 -> 11.8 s; the late streams' gaps 0.18 -> 0.34 s)."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=5.0e-3, per_token=4e-5)  # 10 decodes ~ 0.16 s
    codes = [req(64, 0.0, CODE, 64, f"code{k}") for k in range(10)]
    summs = [req(400, 0.5 + 0.1 * k, SUMM, 4, f"s{k}") for k in range(3)]
    run("laser", codes + summs, lm=lm)
    on_time = [c for c in codes if not c.ttft_missed]
    assert len(on_time) == 3
    for c in on_time:
        assert p99_tbt(c) <= CODE.tbt, (c.req_id, p99_tbt(c))
        assert c.num_tbt_misses == 0
    assert summs[2].token_times[0] - summs[2].arrival_time < 12.0


def test_unreachable_tbt_does_not_cost_throughput():
    """A code target (50 ms TBT) that even one request alone misses on this machine: Laser
    serves it as fast as it can, marks it, and no longer cuts everyone's iterations toward it
    (24 prompts x 32 tokens: 115 steps and 7.6 s before, vs Sarathi's 32 steps and 2.6 s;
    now 46 steps and 3.4 s -- the rest is Laser prefilling in deadline order, for TTFT)."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=2.0e-3, per_token=2e-5)  # alone: 60 ms/iteration
    classes = [SLO(ttft=0.25, tbt=0.1, name="chat"), SLO(ttft=0.125, tbt=0.05, name="code"),
               SLO(ttft=2.0, tbt=0.2, name="summarization")]

    def work():
        return [req(16, 0.0, classes[k % 3], 32, f"r{k}") for k in range(24)]

    laser_reqs, sarathi_reqs = work(), work()
    laser = run("laser", laser_reqs, lm=lm)
    sarathi = run("sarathi", sarathi_reqs, lm=lm)
    assert all(r.tbt_infeasible for r in laser_reqs if r.slo.name == "code")
    assert not any(r.tbt_infeasible for r in laser_reqs if r.slo.name != "code")
    laser_end = max(r.finish_time for r in laser_reqs)
    sarathi_end = max(r.finish_time for r in sarathi_reqs)
    assert laser_end <= 1.4 * sarathi_end, (laser_end, sarathi_end)


@pytest.mark.parametrize("policy", ["laser", "sarathi", "vllm"])
def test_preempted_request_resumes_with_identical_output(tiny_llama, policy):
    """On the real engine (fp32, greedy): requests preempted at the running cap and under KV
    pressure for a stricter class produce exactly the tokens they produce alone."""
    from laser.core.config import CacheConfig
    from laser.frontend.engine import Engine

    clock = [0.0]

    def tick():
        clock[0] += 1e-3
        return clock[0]

    eng = Engine(str(tiny_llama), policy=policy, dtype="float32", clock=tick,
                 scheduler=SchedulerConfig(policy=policy, max_num_seqs=2, max_num_batched_tokens=64),
                 cache=CacheConfig(num_blocks=12, block_size=8), latency_model=LM)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + 30)), list(range(50, 50 + 25)), list(range(90, 90 + 20))]

    def alone(p):
        r = eng.add_request(p, sp, BEST)
        while eng.has_unfinished():
            eng.step()
        return r.output_token_ids

    want = [alone(p) for p in prompts]
    loose = [eng.add_request(p, sp, BEST) for p in prompts[:2]]
    for _ in range(3):
        eng.step()
    strict = eng.add_request(prompts[2], sp, CODE)
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity(expect_empty=True)
    assert sum(r.num_preemptions for r in loose) >= 1 and strict.num_preemptions == 0
    assert [r.output_token_ids for r in loose + [strict]] == want


def test_a_prompt_saved_only_by_a_knowing_break_of_t_g_is_not_given_up():
    """Simulated, the shipped AVX2-fp32 profile: one code stream decodes (0.17 s TBT, 106 tokens:
    its P99 allows one gap over target) when a 190-token chat arrives (0.84 s TTFT). At the share
    of each iteration T_g leaves to prefill the chat would finish late, so the overload triage gave
    it up and it ran at T_g's pace: TTFT 1.11 s (the robustness grid's point 2:1:1 seed 1 x0.4 SLO
    x0.8 fell to 0.52x Sarathi's goodput on such requests). A knowing break of T_g can save it --
    one iteration that completes the prompt -- so it is judged at the whole machine's rate and
    gets that iteration: TTFT 0.74 s, the code stream's one long gap within its P99."""
    from pathlib import Path

    from laser.latency import FittedLatencyModel
    from laser.core.metrics import record_from_request

    lm = FittedLatencyModel.load(Path(__file__).resolve().parents[2] / "benchmarks/profiles/avx2-fp32-smollm2-135m.json")
    code = SLO(ttft=0.422, tbt=0.1688, name="code")
    chat = SLO(ttft=0.844, tbt=0.3376, name="chat")
    reqs = [Request([7] * 81, SamplingParams(max_tokens=106, temperature=0, ignore_eos=True), code, arrival_time=0.0,
                    req_id="code"),
            Request([7] * 190, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), chat, arrival_time=2.68,
                    req_id="chat")]
    sim = SimInstance("laser", 30, lm, SchedulerConfig(policy="laser", queue_order="edf"), num_blocks=1456)
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=100_000)
    sim.check_integrity(expect_empty=True)
    assert reqs[1].token_times[0] - reqs[1].arrival_time <= chat.ttft
    assert reqs[0].num_tbt_misses <= reqs[0].tbt_miss_allowance
    assert all(record_from_request(r).slo_met for r in reqs)


def keep_live(sim, loop: list[Request], n: int, prompt_len: int, until: float) -> None:
    """A closed loop of ``n`` best-effort requests (``prompt_len``-token prompts, 128 tokens): top
    ``loop`` up to ``n`` unfinished on ``sim`` until its clock reaches ``until`` (seconds)."""
    live = sum(b.finish_time is None for b in loop)
    while live < n and sim.clock.t < until:
        b = req(prompt_len, sim.clock.t, BEST, 128, f"be{len(loop)}")
        loop.append(b)
        sim.add_request(b)
        live += 1


def _interactive_beside_background(seed: int, jitter_margin) -> dict[str, tuple[int, int]]:
    """Poisson chat (0.5/s, 200-token prompts) and code (0.25/s, 100) arrivals for 60 s beside a
    closed loop of 12 best-effort requests (512-token prompts, 128 tokens), on a machine where one
    step in ten runs 25 % over the profile; the engine's planning model
    (:func:`laser.instance.model_instance.planning_model`). (met, count) per class."""
    import random

    from laser.instance.model_instance import planning_model
    from laser.core.metrics import record_from_request

    rng, jr = random.Random(seed), random.Random(seed + 100)
    reqs = []
    for cls, rate, prompt in ((CHAT, 0.5, 200), (CODE, 0.25, 100)):
        t = rng.expovariate(rate)
        while t <= 60.0:
            reqs.append(req(prompt, t, cls, 64, f"{cls.name}{len(reqs)}"))
            t += rng.expovariate(rate)
    machine = ScaledLatencyModel(LM, 1.0)
    sim = SimInstance("laser", N, planning_model(LM, True, jitter_margin), SchedulerConfig(policy="laser"),
                      num_blocks=8192, machine_model=machine, record_plans=False)
    for r in reqs:
        sim.submit(r)
    background: list[Request] = []

    def before_step():
        machine.factor = 1.25 if jr.random() < 0.1 else jr.uniform(0.97, 1.05)
        keep_live(sim, background, 12, 512, 60.0)

    sim.run(max_steps=5_000_000, before_step=before_step)
    sim.check_integrity(expect_empty=True)
    return {c.name: (sum(record_from_request(r).slo_met for r in reqs if r.slo is c),
                     sum(r.slo is c for r in reqs)) for c in (CHAT, CODE)}


def test_interactive_work_beside_background_load_keeps_its_targets_on_a_jittery_machine():
    """Issue 28, item 3: 12 best-effort streams in a closed loop beside Poisson chat and code
    arrivals; the real server measured chat 0.84, code 0.64. With the fixed 10 % margins the
    simulated jittery machine gives about that (chat 0.83, code 0.57 over three seeds): every slow
    step breaks the gaps planned to 0.9 T_g. The margins now cover the measured spread of step
    times by default (``planning_model``), and each class keeps >= 0.9."""
    met = {"chat": [0, 0], "code": [0, 0]}
    for seed in (1, 2, 3):
        for name, (ok, n) in _interactive_beside_background(seed, None).items():
            met[name][0] += ok
            met[name][1] += n
    assert all(ok >= 0.9 * n for ok, n in met.values()), met


# SmolLM2 (int4 / compiled int8 GEMV) on one core of this project's AVX2 EPYC, as its profile has it: a
# decode stream costs ~0.5 ms per layer (weights are read once per layer call, attention and the
# gather are per stream), a 50-token prompt ~0.26 s alone, a 128-token one ~0.63 s.
SLOW_DECODE = SimpleLatencyModel(num_layers=N, per_layer=1.2e-3, per_token=1.5e-4, per_context=1.7e-6)


def _beside_closed_loop(seed: int, best_effort_share: float | None, background: int = 12,
                        duration: float = 60.0) -> tuple[dict[str, tuple[int, int]], int]:
    """``benchmarks/slo_server.py --scenarios background`` on the simulated :data:`SLOW_DECODE`
    machine: a closed loop of ``background`` best-effort requests (128-token prompts, 128 tokens:
    512 x its ``--prompt-scale 0.25``) and, after 5 s, Poisson chat (0.5/s, 50-token prompts) and
    code (0.25/s, 25) arrivals of 32 tokens each, until ``duration``. ``best_effort_share``: the
    scheduler's (None: its default). Returns ((met, count) per class, best-effort tokens made by
    ``duration``)."""
    import random

    from laser.core.metrics import record_from_request

    rng = random.Random(seed)
    reqs = []
    for cls, rate, prompt in ((CHAT, 0.5, 50), (CODE, 0.25, 25)):
        t = 5.0 + rng.expovariate(rate)
        while t <= duration:
            reqs.append(req(prompt, t, cls, 32, f"{cls.name}{len(reqs)}"))
            t += rng.expovariate(rate)
    sim = SimInstance("laser", N, SLOW_DECODE, SchedulerConfig(policy="laser"), num_blocks=8192, record_plans=False)
    if best_effort_share is not None:
        sim.scheduler.best_effort_share = best_effort_share
    for r in reqs:
        sim.submit(r)
    loop: list[Request] = []

    def before_step():
        keep_live(sim, loop, background, 128, duration)

    sim.run(max_steps=5_000_000, before_step=before_step)
    sim.check_integrity(expect_empty=True)
    met = {c.name: (sum(record_from_request(r).slo_met for r in reqs if r.slo is c), sum(r.slo is c for r in reqs))
           for c in (CHAT, CODE)}
    return met, sum(sum(t <= duration for t in b.token_times) for b in loop)


def test_best_effort_gives_way_so_interactive_streams_keep_their_pace_on_a_slow_decode_machine():
    """Issue 28, item 3, as the live server ran it (``slo_server.py --scenarios background``):
    chat 6/20 and code 2/9 met, TTFTs up to 5 s, nearly all given up by triage. On a machine where
    each decode stream costs what it does on a CPU, Alg. 1 restored the best-effort streams to full
    depth and the merge filled the rest of every iteration with best-effort prompts, up to T_g:
    the chat and code streams got a token per T_g instead of at their own pace, stayed in flight
    several times longer, piled up, and each new SLO prompt's prefill got only what their decode
    work and the best-effort layers left. Simulated: chat 0.52, code 0.35 over four seeds (1.0
    below: the old rule). Best effort now takes at most ``best_effort_share`` of an iteration with
    SLO work in it: each class keeps >= 0.9 (0.97, 0.98), and best effort slows down (about 2/3
    of its tokens in the window), it is not starved."""
    met = {"chat": [0, 0], "code": [0, 0]}
    tokens, tokens_fill = 0, 0
    for seed in (1, 2, 3, 4):
        per_class, n = _beside_closed_loop(seed, None)
        tokens += n
        tokens_fill += _beside_closed_loop(seed, 1.0)[1]
        for name, (ok, k) in per_class.items():
            met[name][0] += ok
            met[name][1] += k
    assert all(ok >= 0.9 * n for ok, n in met.values()), met
    assert tokens >= 0.5 * tokens_fill, (tokens, tokens_fill)


def test_short_chats_arriving_during_a_long_prefill_get_their_first_token_near_their_idle_cost():
    """Issue 28, item 1: one 2,000-token summarization prefill running (2.2 s alone), six 32-token
    chats arriving 100 ms apart (65 ms alone). Each chat stopped the long prefill at a layer
    boundary, caught up and merged with the rest of its chunk, so its first token came only with
    the long chunk's: mean TTFT 0.57 s, 8.8x its idle cost (the real server: 0.4-0.7 s against
    45 ms). A chat now runs alone at that boundary and the long chunk resumes at its layer after
    it (layer-level chunked prefill, §6.1); the long prompt still meets its target."""
    long_ = req(2000, 0.0, SUMM, 16, "long")
    chats = [req(32, 0.1 + 0.1 * k, CHAT, 16, f"chat{k}") for k in range(6)]
    sim = run("laser", [long_] + chats)
    idle = LM.predict_prefill(32)
    mean = sum(ttft(c) for c in chats) / len(chats)
    assert mean <= 2 * idle, ([round(ttft(c), 3) for c in chats], idle)
    assert ttft(long_) <= SUMM.ttft, ttft(long_)
    assert sim.scheduler.num_step_preemptions >= len(chats) - 1


def _burst(with_long: bool, slower: float) -> tuple[list[Request], list[Request]]:
    """16 summarization prompts (1,500 tokens, 8 s) interleaved with 16 chats (200 tokens, 1 s),
    10 ms apart (all within 0.32 s): a 200-token prefill takes ~0.1 s, a 1,500-token one ~0.6 s,
    times ``slower`` -- not every long prompt can make 8 s. With ``slower`` > 1 the machine is that
    much slower than the profile the scheduler starts from, and it learns the factor from the steps
    (as a real instance does). Without ``with_long`` only the chats. Returns (chats, long prompts)."""
    profile = SimpleLatencyModel(num_layers=N, per_layer=0.7e-3, per_token=1e-5, per_context=2e-8)
    chats, longs = [], []
    for k in range(16):
        if with_long:
            longs.append(req(1500, 0.02 * k, SUMM, 64, f"long{k}"))
        chats.append(req(200, 0.02 * k + 0.01, CHAT, 64, f"chat{k}"))
    planning = CalibratedLatencyModel(profile) if slower != 1.0 else profile
    sim = SimInstance("laser", N, planning, SchedulerConfig(), num_blocks=8192,
                      machine_model=ScaledLatencyModel(profile, slower))
    for r in longs + chats:
        sim.submit(r)
    sim.run(max_steps=2_000_000)
    sim.check_integrity(expect_empty=True)
    return chats, longs


@pytest.mark.parametrize("slower, min_long", [(1.0, 12), (1.3, 9)])
def test_burst_of_long_and_short_prompts_serves_every_chat_it_can_reach(slower, min_long):
    """Issue 28, item 1: long summarization prompts and short chats interleaved within a fraction
    of a second. A chat that arrived while a long prompt's chunk ran was merged with it and got its
    first token with the chunk's, so chats that could have made 1 s missed, and the triage gave
    them up behind every long prompt: on the exact model 14 of 16 chats met 1 s (one at 8.2 s)
    where all 16 make it with no long prompt around; on a machine 1.3x slower than the profile 9
    (five at 8.1-8.3 s, as on the real server: 6.1-6.4 s) where 12 do. Every chat that makes its
    target with no long prompt around must make it in the burst as well (now 16 and 12), and the
    long prompts keep about what they made (``min_long`` of 16 meet 8 s; were 12 and 10: the
    machine cannot serve all of them)."""
    alone, _ = _burst(False, slower)
    chats, longs = _burst(True, slower)
    reachable = sum(ttft(c) <= CHAT.ttft for c in alone)
    met = sum(ttft(c) <= CHAT.ttft for c in chats)
    assert met >= reachable, (reachable, [round(ttft(c), 2) for c in chats])
    assert sum(ttft(r) <= SUMM.ttft for r in longs) >= min_long, [round(ttft(r), 2) for r in longs]


def test_prefills_are_not_held_back_into_decode_that_leaves_them_no_room():
    """Eleven 16-token prompts at once (0.2 s of prefill each alone), one a code stream (0.1 s
    TBT), ten loose (5 s TTFT, 0.4 s TBT). The first step has no decode; the hold-back rule judged
    the loose prompts able to wait with the whole machine after it and ran three of the eleven. But
    every later iteration is bound by the code stream's T_g, and beside eleven decode streams T_g
    leaves prefill nothing: the held-back prefills then needed knowing breaks of T_g (on a jittery
    machine one 0.7 s step, two code gaps over target: tests/latency/test_latency_calibration.py).
    Work may wait only for the share T_g will leave it (``LaserScheduler.later_prefill_share``):
    here all eleven run in the first step, and no code gap is over its target."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=1.0e-3, per_token=3.6e-4, per_context=2e-8)
    code, loose = SLO(ttft=5.0, tbt=0.1, name="code"), SLO(ttft=5.0, tbt=0.4, name="chat")
    reqs = [req(16, 0.0, code, 300, "code")] + [req(16, 0.0, loose, 300, f"loose{k}") for k in range(10)]
    sim = run_sim("laser", reqs, lm, N, config=SchedulerConfig(), record_plans=True)
    first = sim.stats.plans[0]
    assert {w.req_id for w in first.works if w.sample} == {r.req_id for r in reqs}, first.works
    assert int((np.diff(reqs[0].token_times) > code.tbt).sum()) == 0


# A CPU where a layer call's fixed cost dominates (SmolLM2 on one core of the AVX2 VM, the shape
# of its fitted profile): a 20-token prefill ~0.22 s alone, a 150-token one ~0.79 s -- a chat is
# 28 % of a long prompt (17 % in ``_burst``), and eight decode streams take ~0.2 s of an iteration.
CPU_FIXED = SimpleLatencyModel(num_layers=N, per_layer=4.4e-3, per_token=1.46e-4, per_context=2e-8)


@pytest.mark.parametrize("slower", [1.0, 1.3])
def test_given_up_chats_are_not_served_behind_long_prompts_with_slack(slower):
    """Issue 28, item 1 on the real engine (``slo_pressure.py --scenarios burst --prompt-scale
    0.1``): eight 150-token summarization prompts and eight 20-token chats interleaved 20 ms apart.
    The chats' own decode streams (0.4 s TBT, 16 tokens: no P99 allowance) hold every iteration to
    T_g, so the chats queued during the first steps cannot merge into one step, and the triage
    rightly gives the last ones up -- together with three long prompts. Judged as one block, the
    given-up long prompts left the savable long prompts no room, so the given-up chats were served
    after every savable long prompt: first tokens at 6.8-7.4 s on the exact model, 7.7 s at 1.3x
    (the real engine: 7.8-9 s). Each given-up prompt is now placed on its own, and the given-up
    chats get their first token before any long prompt does (at most 1.3 s, 2.4 s), with at least
    as many requests meeting their targets as before (11 of 16; 8, was 7, at 1.3x)."""
    reqs = []
    for k in range(8):
        reqs.append(req(150, 0.04 * k, SUMM, 16, f"long{k}"))
        reqs.append(req(20, 0.04 * k + 0.02, CHAT, 16, f"chat{k}"))
    planning = CalibratedLatencyModel(CPU_FIXED) if slower != 1.0 else CPU_FIXED
    sim = SimInstance("laser", N, planning, SchedulerConfig(), num_blocks=8192,
                      machine_model=ScaledLatencyModel(CPU_FIXED, slower))
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=2_000_000)
    sim.check_integrity(expect_empty=True)
    chats, longs = reqs[1::2], reqs[0::2]
    assert any(c.given_up for c in chats)  # the case: some chats are out of reach
    last_chat = max(c.token_times[0] for c in chats)
    first_long = min(r.token_times[0] for r in longs)
    assert last_chat < first_long, ([round(ttft(c), 2) for c in chats], [round(ttft(r), 2) for r in longs])
    met = sum(ttft(c) <= CHAT.ttft for c in chats) + sum(ttft(r) <= SUMM.ttft for r in longs)
    assert met >= {1.0: 11, 1.3: 7}[slower], ([round(ttft(c), 2) for c in chats], [round(ttft(r), 2) for r in longs])


def test_given_up_chats_are_not_served_behind_best_effort_work_that_is_late_anyway():
    """Issue 28 on the real engine (``slo_pressure.py --scenarios kv``: a chat given up among four
    arriving together got its first token after 26.8 s): under KV pressure eight 1,000-token
    best-effort requests run (their aging deadline is 30 s; on this CPU their prefills take ~4.5 s
    each, so the last ones miss it whatever runs first) when six 64-token chats arrive at 0.3 s.
    The triage rightly gives up three chats to save the others, but placed them behind every
    best-effort request up to the last one late against its aging deadline -- "it needs the time",
    though nothing could make it in time: the given-up chats waited ~21-25 s. A given-up request now
    also goes ahead of savable work that is late even with no given-up work ahead (it makes none of
    them late): the given-up chats get their first token before any best-effort request that had
    not started, with as many chats meeting 1 s, and the best-effort work finishes no later."""
    bes = [req(1000, 0.0, BEST, 128, f"be{k}") for k in range(8)]
    chats = [req(64, 0.3, CHAT, 16, f"chat{k}") for k in range(6)]
    sim = run("laser", bes + chats, lm=CPU_FIXED, num_blocks=256)
    given_up = [c for c in chats if c.given_up]
    assert given_up  # the case
    started = [r for r in bes if r.token_times and r.token_times[0] <= 0.3 + CPU_FIXED.predict_prefill(1000)]
    later = [r for r in bes if r not in started]
    assert later
    assert max(c.token_times[0] for c in given_up) < min(r.token_times[0] for r in later), \
        ([round(ttft(c), 2) for c in chats], [round(r.token_times[0], 2) for r in bes])
    assert sum(ttft(c) <= CHAT.ttft for c in chats) >= 2
    assert max(r.token_times[-1] for r in bes) <= 120.0  # (was 124.8 s of virtual time)
