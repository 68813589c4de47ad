"""Bursts of long and short prompts in the SIMULATOR (issue 28, item 1): do short chats get
their first token first, near their idle cost, without costing the long prompts or anyone's
token gaps? Laser on one simulated instance, virtual time, latency models sized like SmolLM2
on one CPU core (the shapes of ``tests/scheduler/test_slo_pressure.py``); the shipped classes
at --slo-scale 4 (chat 1 s / 0.4 s, summarization 8 s / 0.8 s, code 0.5 s / 0.2 s TTFT / TBT).

Scenarios (each prints one line of figures):

  shorts   a 2,000-token summarization prompt at t=0 (2.2 s alone), six 32-token chats 100 ms
           apart from t=0.1 s (65 ms alone): the chats' mean TTFT, the long prompt's TTFT.
  burst    16 summarization prompts (1,500 tokens, ~0.6 s alone) interleaved with 16 chats
           (200 tokens, ~0.1 s), 10 ms apart (or 20 ms: ``burst-0.64``), on a machine
           ``slower`` times the profile (with ``slower`` > 1 the scheduler learns the factor online,
           as a real instance does): chats / long prompts meeting their TTFT target, and the chats
           that meet it with no long prompt around.
  grid     36 bursts: 12 or 16 prompts of each kind, three orders (long first, chat first,
           interleaved; all longs then all chats), 1.0 / 1.3 / 1.6x slower, 10 or 20 ms apart:
           chats / long prompts met, summed mean chat TTFT; chats met without the long prompts.
  cpu      the real engine's burst (``slo_pressure.py --scenarios burst --prompt-scale 0.1``): eight
           150-token summarization prompts and eight 20-token chats interleaved 20 ms apart, on a
           CPU where a layer call's fixed cost dominates (a chat ~0.22 s alone, 28 % of a long
           prompt; the fitted profile of SmolLM2 on one core of the AVX2 VM), 1.0 / 1.3 / 1.6 /
           2.0x slower than the profile: chats / long prompts met, the given-up chats' TTFTs.
  kv       KV pool of 256 blocks: eight 600-token best-effort requests (128 tokens) at t=0, four
           32-token chats at t = 0.05 ... 1.0 (seven runs): the chats' last first token, the
           best-effort requests' last finish summed over the runs.
  code     eleven 16-token prompts at t=0 on a jittery machine (one step in ten 12-30 % slow),
           one code stream (0.1 s TBT) and ten loose ones (5 s TTFT, 0.4 s TBT), 300 tokens each:
           the code stream's token gaps over 0.1 s (a prefill held back from the first step,
           which has no decode, runs later beside the code stream).

    PYTHONPATH=. python benchmarks/burst_sim.py [--scenarios shorts,burst,grid,cpu,kv,code]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from laser.core.config import SchedulerConfig
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import CalibratedLatencyModel, ScaledLatencyModel, SimpleLatencyModel
from laser.sim import SimInstance

N = 30
LM = SimpleLatencyModel(num_layers=N, per_layer=1.0e-3, per_token=3.6e-5, per_context=2e-8)
BURST_LM = SimpleLatencyModel(num_layers=N, per_layer=0.7e-3, per_token=1e-5, per_context=2e-8)
CPU_FIXED = SimpleLatencyModel(num_layers=N, per_layer=4.4e-3, per_token=1.46e-4, per_context=2e-8)
CHAT = SLO(ttft=1.0, tbt=0.4, name="chat")
SUMM = SLO(ttft=8.0, tbt=0.8, name="summarization")
BEST = SLO(name="best_effort")


def req(prompt: int, arrival: float, slo: SLO, max_tokens: int, name: str) -> Request:
    """A greedy request of ``prompt`` dummy tokens arriving at ``arrival`` (s) that runs ``max_tokens``."""
    return Request([7] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), slo,
                   arrival_time=arrival, req_id=name)


def ttft(r: Request) -> float:
    """Seconds from ``r``'s arrival to its first token."""
    return r.token_times[0] - r.arrival_time


def simulate(reqs: list[Request], planning, machine=None, num_blocks: int = 8192, before_step=None) -> SimInstance:
    """Run ``reqs`` on one simulated Laser instance planning with ``planning`` (the clock runs on
    ``machine``, default ``planning``) to the end; checks the instance is empty and consistent."""
    sim = SimInstance("laser", N, planning, SchedulerConfig(policy="laser"), num_blocks=num_blocks,
                      machine_model=machine)
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=2_000_000, before_step=before_step)
    sim.check_integrity(expect_empty=True)
    return sim


def shorts() -> str:
    """The ``shorts`` scenario (module docstring); returns its line."""
    long_ = req(2000, 0.0, SUMM, 16, "long")
    chats = [req(32, 0.1 + 0.1 * k, CHAT, 16, f"chat{k}") for k in range(6)]
    simulate([long_] + chats, LM)
    mean = float(np.mean([ttft(c) for c in chats]))
    idle = LM.predict_prefill(32)
    return (f"shorts: mean chat TTFT {mean:.3f} s ({mean / idle:.1f}x idle {idle * 1e3:.0f} ms), "
            f"chats {[round(ttft(c), 3) for c in chats]}, long TTFT {ttft(long_):.2f} s")


def burst_run(n: int, order: str, slower: float, gap: float, with_long: bool = True) -> tuple[list, list]:
    """``n`` chats and (``with_long``) ``n`` long prompts arriving ``gap`` s apart in ``order``
    (``long-first``/``chat-first``: interleaved; ``longs-then-chats``). Returns (chats, longs)."""
    kinds = {"long-first": ["long", "chat"] * n, "chat-first": ["chat", "long"] * n,
             "longs-then-chats": ["long"] * n + ["chat"] * n}[order]
    chats, longs = [], []
    for k, kind in enumerate(kinds):
        if kind == "chat":
            chats.append(req(200, gap * k, CHAT, 64, f"chat{len(chats)}"))
        elif with_long:
            longs.append(req(1500, gap * k, SUMM, 64, f"long{len(longs)}"))
    planning = CalibratedLatencyModel(BURST_LM) if slower != 1.0 else BURST_LM
    simulate(longs + chats, planning, machine=ScaledLatencyModel(BURST_LM, slower))
    return chats, longs


def met(rs: list[Request], slo: SLO) -> int:
    """How many of ``rs`` got their first token within ``slo``'s TTFT target."""
    return sum(ttft(r) <= slo.ttft for r in rs)


def burst(gap: float, slower: float) -> str:
    """The ``burst`` scenario: 16 + 16 prompts, a pair every ``gap`` s, ``slower`` x the profile."""
    chats, longs = burst_run(16, "long-first", slower, gap / 2)
    alone, _ = burst_run(16, "long-first", slower, gap / 2, with_long=False)
    late = sorted(round(ttft(c), 2) for c in chats if ttft(c) > CHAT.ttft)
    return (f"burst 16+16 in {gap * 16:.2f} s, {slower}x: chats met {met(chats, CHAT)}/16 "
            f"(alone {met(alone, CHAT)}), long met {met(longs, SUMM)}/16, late chats at {late}")


def grid() -> str:
    """The ``grid`` scenario (36 bursts); returns its line."""
    tot = [0, 0, 0.0, 0]
    for n in (12, 16):
        for order in ("long-first", "chat-first", "longs-then-chats"):
            for slower in (1.0, 1.3, 1.6):
                for gap in (0.01, 0.02):
                    chats, longs = burst_run(n, order, slower, gap)
                    alone, _ = burst_run(n, order, slower, gap, with_long=False)
                    tot[0] += met(chats, CHAT)
                    tot[1] += met(longs, SUMM)
                    tot[2] += float(np.mean([ttft(c) for c in chats]))
                    tot[3] += met(alone, CHAT)
    return (f"grid (36 bursts, {2 * 3 * 3 * 2 * 14} chats): chats met {tot[0]}, long met {tot[1]}, "
            f"summed mean chat TTFT {tot[2]:.1f} s; chats met without the long prompts {tot[3]}")


def cpu(slower: float) -> str:
    """The ``cpu`` scenario at ``slower`` x the profile; returns its line."""
    reqs = []
    for k in range(8):
        reqs += [req(150, 0.04 * k, SUMM, 16, f"long{k}"), req(20, 0.04 * k + 0.02, CHAT, 16, f"chat{k}")]
    planning = CalibratedLatencyModel(CPU_FIXED) if slower != 1.0 else CPU_FIXED
    simulate(reqs, planning, machine=ScaledLatencyModel(CPU_FIXED, slower))
    chats, longs = reqs[1::2], reqs[0::2]
    given_up = sorted(round(ttft(c), 2) for c in chats if c.given_up)
    return (f"cpu burst 8+8, {slower}x: chats met {met(chats, CHAT)}/8, long met {met(longs, SUMM)}/8, "
            f"given-up chats at {given_up}, last chat TTFT {max(ttft(c) for c in chats):.2f} s")


def kv() -> str:
    """The ``kv`` scenario (seven arrival times of the chats); returns its line."""
    lasts, finish = [], 0.0
    for arrival in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
        bes = [req(600, 0.0, BEST, 128, f"be{k}") for k in range(8)]
        chats = [req(32, arrival, CHAT, 16, f"chat{k}") for k in range(4)]
        simulate(bes + chats, LM, num_blocks=256)
        lasts.append(max(ttft(c) for c in chats))
        finish += max(r.token_times[-1] for r in bes)
    return (f"kv: chats' last first token {min(lasts):.2f}-{max(lasts):.2f} s, best-effort last finish summed "
            f"{finish:.1f} s")


def code() -> str:
    """The ``code`` scenario (a jittery machine, seed 7); returns its line."""
    lm = SimpleLatencyModel(num_layers=30, per_layer=1.0e-3, per_token=3.6e-4, per_context=2e-8)
    code_slo, loose = SLO(ttft=5.0, tbt=0.1, name="code"), SLO(ttft=5.0, tbt=0.4, name="chat")
    machine = ScaledLatencyModel(lm, 1.0)
    rng = random.Random(7)

    def jitter():
        machine.factor = rng.uniform(1.12, 1.3) if rng.random() < 0.1 else rng.uniform(0.95, 1.02)

    reqs = [req(16, 0.0, code_slo, 300, "code")] + [req(16, 0.0, loose, 300, f"chat{k}") for k in range(10)]
    simulate(reqs, CalibratedLatencyModel(lm, spread_quantile=0.98), machine=machine, before_step=jitter)
    gaps = np.diff(reqs[0].token_times)
    return (f"code: code stream gaps over 0.1 s {int((gaps > 0.1).sum())} of {len(gaps)} (largest {gaps.max():.3f} s), "
            f"loose TTFT mean {np.mean([ttft(r) for r in reqs[1:]]):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="shorts,burst,grid,cpu,kv,code")
    args = ap.parse_args()
    runs = {"shorts": [shorts], "burst": [lambda: burst(0.02, 1.0), lambda: burst(0.02, 1.3),
                                          lambda: burst(0.04, 1.3)],
            "grid": [grid], "cpu": [lambda s=s: cpu(s) for s in (1.0, 1.3, 1.6, 2.0)], "kv": [kv], "code": [code]}
    for name in args.scenarios.split(","):
        for fn in runs[name]:
            t0 = time.perf_counter()
            line = fn()
            print(f"{line}  [{time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
