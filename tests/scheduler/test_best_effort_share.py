"""``--best-effort-share`` (issue 28, item 3's rule as a setting): the most of an iteration with SLO
work that best-effort work may take, from the command line (``laser serve`` / ``laser bench``; a
cluster's instances get the same :class:`SchedulerConfig`) or ``LLM(scheduler=SchedulerConfig(...))``
to the scheduler's plans."""

from __future__ import annotations

import argparse

import pytest

from laser.core.config import ConfigError, SchedulerConfig
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import SimpleLatencyModel
from laser.sim import SimInstance

N = 30
# a decode stream costs what it does on a CPU (tests/scheduler/test_slo_pressure.py's SLOW_DECODE)
LM = SimpleLatencyModel(num_layers=N, per_layer=1.2e-3, per_token=1.5e-4, per_context=1.7e-6)
CHAT = SLO(ttft=1.0, tbt=0.4, name="chat")
BEST = SLO(name="best_effort")


def _req(prompt: int, slo: SLO, name: str, max_tokens: int = 1000) -> Request:
    return Request([7] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), slo,
                   arrival_time=0.0, req_id=name)


def _parser() -> argparse.ArgumentParser:
    from laser.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def _best_effort_layers(config: SchedulerConfig) -> list[int]:
    """Layers per iteration Alg. 1 gives four best-effort streams decoding beside a chat stream,
    once all five decode (the scheduler built from ``config``)."""
    sim = SimInstance("laser", N, LM, config, num_blocks=4096, record_plans=False)
    for r in [_req(32, CHAT, "chat")] + [_req(32, BEST, f"be{k}") for k in range(4)]:
        sim.submit(r)
    plans = sim.scheduler.plans
    for _ in range(300):
        if len(plans) == 5:
            break
        sim.step()
        plans = sim.scheduler.plans
    for _ in range(5):  # (Alg. 1 replans on each arrival: the plans they settle to)
        sim.step()
    plans = sim.scheduler.plans
    assert "chat" in plans and plans["chat"].layers == N
    return [plans[f"be{k}"].layers for k in range(4)]


def test_the_best_effort_share_flag_reaches_the_scheduler_and_changes_its_plans():
    """``--best-effort-share`` goes through :func:`laser.cli.engine_configs` (``laser serve``, a
    cluster's instances, ``laser bench``'s engines) into the scheduler: at the default 0.2 the
    best-effort streams beside a chat stream run on fewer layers per iteration (they give way:
    [1, 1, 1, 30]);
    at 1.0 (the paper's rule) they fill the iteration up to T_g at full depth."""
    from laser.bench.cli import _sched_config
    from laser.cli import engine_configs

    p = _parser()
    assert engine_configs(p.parse_args([]))[1].best_effort_share == 0.2
    cfg = engine_configs(p.parse_args(["--best-effort-share", "1"]))[1]
    assert cfg.best_effort_share == 1.0
    assert _sched_config(p.parse_args(["--best-effort-share", "0.5"]), "laser").best_effort_share == 0.5
    sim = SimInstance("laser", N, LM, cfg, num_blocks=64, record_plans=False)
    assert sim.scheduler.best_effort_share == 1.0
    given_way = _best_effort_layers(SchedulerConfig())
    filled = _best_effort_layers(cfg)
    assert filled == [N] * 4, filled
    assert sum(given_way) <= 2 * N, given_way  # (most at one layer per iteration)


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan", "inf", "x"])
def test_a_best_effort_share_outside_zero_to_one_is_refused_with_a_clear_error(value, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--best-effort-share", value])
    assert "fraction in (0, 1]" in capsys.readouterr().err
    if value != "x":
        with pytest.raises(ConfigError, match=r"best_effort_share must be in \(0, 1\]"):
            SchedulerConfig(best_effort_share=float(value))


# a layer call's fixed cost small beside its tokens (tests/scheduler/test_slo_pressure.py's LM): a
# 200-token chat prompt ~0.25 s alone, a 4,000-token one ~4.4 s
FAST = SimpleLatencyModel(num_layers=N, per_layer=1.0e-3, per_token=3.6e-5, per_context=2e-8)


@pytest.mark.parametrize("chat_at", [1.2, 2.0, 3.0])
def test_a_best_effort_prompt_past_its_aging_deadline_does_not_go_ahead_of_a_chat(chat_at):
    """Issue 28 item 3 (a closed loop of best-effort requests beside Poisson chats, live on an EPYC):
    a best-effort prompt that had waited its aging deadline (``best_effort_deadline_s``, 30 s;
    1 s here) sorted ahead of each new chat in EDF. Triage counted its whole prefill ahead of the
    chat and gave the chat up on arrival, and the merge ran the best-effort prompt first with the
    whole step (no SLO work was merged before it to hold it to the share): the chat's first
    token waited for the rest of the 4.4 s prompt (TTFT 3.6 / 2.8 / 1.8 s against 1.0 s, arriving
    at 1.2 / 2.0 / 3.0 s). Best effort yields to SLO work in the prefill order too: the chat is
    not given up and gets its first token near its idle cost (0.25 s alone; 0.31-0.32 s), and the
    long prompt keeps advancing beside it and finishes (0.14 s later than before)."""
    be = Request([7] * 4000, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), BEST,
                 arrival_time=0.0, req_id="be")
    chat = Request([7] * 200, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), CHAT,
                   arrival_time=chat_at, req_id="chat")
    sim = SimInstance("laser", N, FAST, SchedulerConfig(best_effort_deadline_s=1.0), num_blocks=4096,
                      record_plans=False)
    for r in (be, chat):
        sim.submit(r)
    sim.run(max_steps=100_000)
    sim.check_integrity(expect_empty=True)
    assert not chat.given_up
    assert chat.token_times[0] - chat.arrival_time <= 0.5 * CHAT.ttft, chat.token_times[0] - chat.arrival_time
    assert be.finish_time is not None and len(be.output_token_ids) == 4
