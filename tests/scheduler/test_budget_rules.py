"""The budget rules around T_g (laser/scheduler/laser/budget.py) are pure functions of numbers and
single requests: the partly spent gap sees each held request's token gap as (last token time, TBT
target, iterations left), and which requests T_g holds for is a predicate of one request."""

from __future__ import annotations

import pytest

from laser.core.request import SLO, Phase, Request, SamplingParams
from laser.scheduler.laser import budget
from laser.scheduler.laser.decode import DecodePlan


def test_the_partly_spent_gap_limits_the_iteration_from_numbers_alone():
    now, t_g, margin = 1.0, 0.1, 0.9
    assert budget.iteration_limit(now, 0.01, t_g, margin, []) == pytest.approx(0.09)  # margin * T_g
    # 0.04 s left of its gap after the margin, one iteration to its token: the iteration gets 0.04 s
    assert budget.iteration_limit(now, 0.01, t_g, margin, [(0.95, 0.1, 1)]) == pytest.approx(0.04)
    # the same slack over two iterations: half each
    assert budget.iteration_limit(now, 0.01, t_g, margin, [(0.95, 0.1, 2)]) == pytest.approx(0.02)
    # its gap is lost already even without the margin: it does not limit the iteration
    assert budget.iteration_limit(now, 0.01, t_g, margin, [(0.8, 0.1, 1)]) == pytest.approx(0.09)
    # it makes it only without the margin: an iteration of decode work alone
    assert budget.iteration_limit(now, 0.02, t_g, margin, [(0.92, 0.1, 1)]) == pytest.approx(0.02)


def test_iterations_left_follow_alg1s_cycle():
    n = 8
    assert DecodePlan(8, 0).iterations_left(0, n, 5) == 1  # full depth: its token comes this iteration
    p = DecodePlan(4, 0)  # two groups of 4 layers; offset 0: a token starts at odd iterations
    assert p.iterations_left(2, n, 7) == 2  # mid first group: finishes it, then the second group
    assert p.iterations_left(6, n, 7) == 1  # mid last group
    assert p.iterations_left(0, n, 1) == 2  # its token's turn now: its two groups
    assert p.iterations_left(0, n, 0) == 3  # one iteration to wait, then its two groups
    assert DecodePlan(4, 1).iterations_left(0, n, 0) == 2  # the offset shifts its turn


def test_t_g_holds_for_decoding_requests_with_a_target_at_or_above_it():
    def req(tbt, phase=Phase.DECODE, infeasible=False):
        r = Request([1, 2, 3], SamplingParams(max_tokens=4), SLO(ttft=1.0, tbt=tbt, name="x"))
        r.phase, r.tbt_infeasible = phase, infeasible
        return r

    assert budget.holds_tg(req(0.1), 0.1) and budget.holds_tg(req(0.2), 0.1)
    assert not budget.holds_tg(req(0.05), 0.1)  # below T_g: Alg. 1 gave its level up
    assert not budget.holds_tg(req(None), 0.1)  # no TBT target
    assert not budget.holds_tg(req(0.2, infeasible=True), 0.1)  # out of reach even alone
    assert not budget.holds_tg(req(0.2, phase=Phase.PREFILL), 0.1)
    assert not budget.holds_tg(req(0.2), float("inf"))  # no request while T_g is inf
