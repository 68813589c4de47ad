"""The profiler sees a slower machine (memory-bandwidth contention is invisible to the CPU
pressure counter) by re-timing reference calls, and re-measures what ran disturbed.

A fake clock stands in for time: every call advances it by its cost, slowed by a factor
for a window of calls, so the outcome is exact (no real timing here).
"""

import logging

import pytest

from laser import profiler
from laser.profiler.pipeline import samples_from_cases


class FakeMachine:
    """A clock advanced by the calls; calls number ``lo``..``hi``-1 run ``factor`` slower."""

    def __init__(self, lo: int, hi: int, factor: float = 1.3):
        self.now, self.calls, self.lo, self.hi, self.factor = 0.0, 0, lo, hi, factor

    def call(self, cost: float):
        def run():
            self.calls += 1
            self.now += cost * (self.factor if self.lo <= self.calls < self.hi else 1.0)
        return run

    def clock(self) -> float:
        return self.now


def bench_on(m: FakeMachine, **kw) -> profiler.Bench:
    opts = dict(min_rounds=3, max_rounds=5, tol=0.01, max_burst=1, ref_tol=0.05, ref_interval_s=0.05,
                clock=m.clock, psi=None, seed=3)
    opts.update(kw)
    return profiler.Bench(**opts)


def test_a_slow_window_is_detected_and_re_measured():
    m = FakeMachine(lo=40, hi=90)
    costs = [0.01 * (k + 1) for k in range(10)]
    cases = [profiler.Case(("stateless", k), m.call(c)) for k, c in enumerate(costs)]
    refs = [profiler.Case(("reference", "decode"), m.call(0.004)), profiler.Case(("reference", "prefill"), m.call(0.012))]
    b = bench_on(m)
    b.run(cases, references=refs)
    assert b.disturbed_repeats > 0 and 0 < b.disturbed_fraction < 1
    assert b.reference_drift() == pytest.approx(0.3)
    for cs, cost in zip(cases, costs):
        # every slowed repeat was caught; what is left is exactly the undisturbed time
        assert all(t == pytest.approx(cost) for t in cs.times), cs.key
        # (a quiet repeat next to a slow re-timing is set aside too: the edges of a window are unsure)
        assert all(t == pytest.approx(1.3 * cost) or t == pytest.approx(cost) for t in cs.disturbed), cs.key
        assert cs.settled(0.01) and cs.estimate() == pytest.approx(cost)
    assert sum(len(c.disturbed) for c in cases) == b.disturbed_repeats
    slowed = sum(t > 1.1 * cost for c, cost in zip(cases, costs) for t in c.disturbed)
    assert slowed >= b.disturbed_repeats // 2
    assert b.clean_fraction == pytest.approx(1 - b.disturbed_fraction)  # no pressure counter: the rest is clean


def test_a_quiet_machine_has_nothing_disturbed():
    m = FakeMachine(lo=0, hi=0)
    cases = [profiler.Case(k, m.call(0.01 * (k + 1))) for k in range(6)]
    b = bench_on(m)
    b.run(cases, references=[profiler.Case("ref", m.call(0.005))])
    assert b.disturbed_repeats == 0 and b.reference_drift() == pytest.approx(0.0, abs=1e-9) and len(b.checks) > 3
    assert all(len(c.times) == 3 for c in cases)  # settled after min_rounds: no extra rounds


def test_the_first_best_is_re_judged_when_the_machine_gets_quieter():
    # slow from the start (initial reference timings included), quiet later: the windows
    # timed while slow are disturbed once the references show the quiet time
    m = FakeMachine(lo=0, hi=16)
    cases = [profiler.Case(k, m.call(0.01)) for k in range(5)]
    b = bench_on(m, min_rounds=2, max_rounds=6)
    b.run(cases, references=[profiler.Case("ref", m.call(0.005))])
    assert b.disturbed_repeats > 0
    assert all(c.times and all(t == pytest.approx(0.01) for t in c.times) for c in cases)


class JitteryMachine(FakeMachine):
    """Every call runs 0-15 % slower than its cost at random (a VM's own timing noise), and
    calls ``lo``..``hi``-1 ``factor`` times slower on top (a neighbour)."""

    def __init__(self, lo: int, hi: int, factor: float = 1.5, seed: int = 0):
        import random

        super().__init__(lo, hi, factor)
        self.rng = random.Random(seed)

    def call(self, cost: float):
        def run():
            self.calls += 1
            slow = self.factor if self.lo <= self.calls < self.hi else 1.0
            self.now += cost * slow * (1.0 + 0.15 * self.rng.random())
        return run


def test_a_jittery_quiet_machine_keeps_most_repeats():
    """Seen on a quiet 2-vCPU VM: reference re-timings spread up to ~15 % over their best, so a
    fixed 5 % tolerance marked 97 % of the repeats disturbed and the profile dropped 222 of 251
    samples. The tolerance follows the machine's own jitter (2x the median drift)."""
    m = JitteryMachine(lo=0, hi=0)
    cases = [profiler.Case(k, m.call(0.01 * (k + 1))) for k in range(10)]
    b = bench_on(m, min_rounds=4, max_rounds=4)
    b.run(cases, references=[profiler.Case("ref", m.call(0.005))])
    assert b.effective_ref_tol() > b.ref_tol
    assert b.disturbed_fraction < 0.35, b.disturbed_fraction
    assert all(len(c.times) >= 2 for c in cases)


def test_a_neighbour_is_still_seen_on_a_jittery_machine():
    m = JitteryMachine(lo=60, hi=100, factor=1.5)
    cases = [profiler.Case(k, m.call(0.01 * (k + 1))) for k in range(10)]
    b = bench_on(m, min_rounds=4, max_rounds=6)
    b.run(cases, references=[profiler.Case("ref", m.call(0.005))])
    assert b.disturbed_repeats > 0
    # what is left undisturbed is quiet time (jitter only), never the neighbour's 1.5x
    for k, c in enumerate(cases):
        assert all(t < 1.2 * 0.01 * (k + 1) for t in c.times), (k, c.times)


def test_out_of_budget_disturbed_samples_are_dropped_with_a_warning(caplog):
    b = profiler.Bench(psi=None)
    only_disturbed = profiler.Case(("stateless", 8), lambda: None, disturbed=[2.0, 2.1])
    assert only_disturbed.estimate() == pytest.approx(2.05)  # falls back on what there is
    fine = profiler.Case(("stateless", 16), lambda: None, times=[1.0, 1.0], clean=[1.0, 1.0], disturbed=[1.5])
    head = profiler.Case(("head", 1), lambda: None, disturbed=[3.0, 3.0])  # the only one of its kind: kept
    stats = {}
    with caplog.at_level(logging.WARNING):
        samples = samples_from_cases([only_disturbed, fine, head], 0.03, b, stats)
    assert [type(s).__name__ for s in samples] == ["StatelessSample", "HeadSample"]
    assert samples[0].n_tokens == 16
    assert stats["dropped_disturbed"] == 1 and stats["disturbed_fraction"] == pytest.approx(5 / 7, abs=1e-3)
    assert "dropped" in caplog.text and "disturbed" in caplog.text


def test_default_grid_covers_small_decode_batches_and_32_token_segments():
    g = profiler.ProfileGrid.default()
    assert set(range(1, 17)) <= set(g.stateless_tokens)
    assert set(range(32, 1025, 32)) <= set(g.stateless_tokens)
    for batches in (g.layer_batches, g.attention_batches):
        small = [(q, c) for q, c in batches if set(q) == {1} and len(q) <= 32 and max(c) <= 512]
        sizes = {len(q) for q, _ in small}
        assert {1, 2, 4, 8, 16, 32} <= sizes
        assert any(max(c) <= 64 for _, c in small) and any(max(c) >= 256 for _, c in small)
