"""A step's own overhead (issue 26 item 3): what ``ModelRunner.execute`` costs beyond its layer calls,
embedding and LM head -- once per step, per batch composition, per composed work -- fitted from
``StepOverheadSample`` s, priced by ``PlanCost`` (and so by every scheduler), clocked by the simulator."""

import json
import random

import numpy as np
import pytest

from laser.core.plan import StepPlan, Work
from laser.core.pricing import PlanCost, plan_compositions
from laser.core.walk import walk
from laser.latency import (
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    ScaledLatencyModel,
    SimpleLatencyModel,
    StatelessSample,
    StepOverheadSample,
    fit,
)
from laser.latency.fitting import FORMS

N = 12
TERMS = (4e-4, 3e-4, 5e-5)  # per step, per composition, per composed work (seconds)


def overhead_truth(k, n):
    return TERMS[0] + TERMS[1] * k + TERMS[2] * n


def samples(rng):
    s = [StatelessSample(n, 1e-4 + 2e-6 * n) for n in range(1, 200)]
    s += [EmbedSample(n, 1e-5 + 1e-8 * n) for n in (1, 8, 64, 256)]
    s += [HeadSample(r, 5e-4 + 2e-5 * r) for r in range(1, 33)]
    s += [StepOverheadSample(k, n, overhead_truth(k, n) * (1 + 0.01 * rng.standard_normal()))
          for k, n in ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (2, 6), (2, 12), (3, 12), (2, 16))]
    return s


@pytest.fixture(scope="module")
def fitted():
    return fit(samples(np.random.default_rng(0)), num_layers=N, form="padded-step")


def stepped(**terms):
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5, per_embed_token=1e-6, head_const=2e-4,
                            per_head_row=1e-5)
    for k, v in {"step_overhead_s": TERMS[0], "compose_overhead_s": TERMS[1], "compose_work_s": TERMS[2],
                 **terms}.items():
        setattr(lm, k, v)
    return lm


def random_works(rng: random.Random, n=N):
    works = []
    for i in range(rng.randint(1, 7)):
        a = rng.choice([0, 0, rng.randrange(n)])
        b = rng.choice([n, n, rng.randint(a + 1, n)])
        q = rng.choice([1, 1, rng.randint(2, 64)])
        works.append(Work(f"w{i}", rng.randint(0, 300), q, a, b, b == n))
    return works


def test_fit_recovers_the_step_terms_and_the_old_forms_leave_them_out(fitted):
    got = (fitted.step_overhead_s, fitted.compose_overhead_s, fitted.compose_work_s)
    assert got == pytest.approx(TERMS, rel=0.15)
    assert fitted.report["step_overhead"]["error"] < 0.02
    for form, spec in FORMS.items():
        m = fit(fitted.samples, num_layers=N, form=form)
        assert (m.step_overhead_time(2, 9) > 0) == spec["step"], form
    # a profile without such samples (all profiles before it) prices no overhead
    old = fit([s for s in fitted.samples if not isinstance(s, StepOverheadSample)], num_layers=N)
    assert old.step_overhead_time(3, 20) == 0.0


def test_plan_price_adds_the_overhead_of_its_compositions():
    lm = stepped()
    plain = stepped(step_overhead_s=0.0, compose_overhead_s=0.0, compose_work_s=0.0)
    # decode works: 2 leave at layer 4, 1 joins at 8 -> segments [0,4) 3 works, [4,8) 1, [8,12) 2
    works = [Work("a", 10, 1, 0, N, True), Work("b", 20, 1, 0, 4), Work("c", 30, 1, 0, 4), Work("d", 40, 1, 8, N, True)]
    assert plan_compositions(works, N) == (3, 6)
    plan = StepPlan(N, works)
    assert lm.predict_iteration(plan) == pytest.approx(plain.predict_iteration(plan) + overhead_truth(3, 6))
    # a work that starts at layer 4 leaves [0, 4) empty: three compositions, none for the empty segment
    assert plan_compositions([Work("x", 0, 5, 4, 8), Work("y", 5, 1, 6, N, True)], N) == (3, 4)
    assert lm.predict_decode_iteration([64, 128]) == pytest.approx(
        plain.predict_decode_iteration([64, 128]) + overhead_truth(1, 2))
    assert lm.predict_prefill(100) == pytest.approx(plain.predict_prefill(100) + overhead_truth(1, 1))
    assert lm.predict_prefill(100, layers=3) == plain.predict_prefill(100, layers=3)  # layer calls only
    assert PlanCost(lm, N, []).total == 0.0


def test_with_work_prices_the_plan_it_makes():
    """The Laser scheduler grows a plan work by work with ``with_work``: the overhead it adds must be
    the one of the plan it then prices (segments cut by the new work, gaps it fills)."""
    lm = stepped()
    rng = random.Random(3)
    for _ in range(300):
        works = random_works(rng)
        w = random_works(rng)[0]
        w = Work("new", w.token_start, w.num_tokens, w.layer_start, w.layer_end, w.sample)
        cost = PlanCost(lm, N, works)
        assert cost.with_work(w) == pytest.approx(PlanCost(lm, N, works + [w]).total, rel=1e-12)
        cost.add(w)
        assert cost.total == pytest.approx(PlanCost(lm, N, works + [w]).total, rel=1e-12)


class _Counting:
    """A walker executor that only counts what the runner would compose."""

    def __init__(self):
        self.compositions, self.works = 0, 0

    def park(self, active, leaving, layer):
        ids = {id(w) for w in leaving}
        return [w for w in active if id(w) not in ids]

    def join(self, active, joining):
        return active + list(joining)

    def compose(self, active, layers):
        self.compositions += 1
        self.works += len(active)

    def run_layer(self, layer, active):
        pass

    def finish(self, active, layer):
        pass


def test_compositions_are_what_the_walker_composes():
    rng = random.Random(5)
    for _ in range(300):
        works = random_works(rng)
        ex = _Counting()
        walk(StepPlan(N, works), ex)
        assert plan_compositions(works, N) == (ex.compositions, ex.works), works


def test_the_simulator_clocks_what_plans_are_priced_at():
    from laser.core.block_manager import BlockManager
    from laser.core.intermediate_cache import IntermediateCache
    from laser.sim.instance import SimExecutor, SimStats, VirtualClock

    lm = stepped()
    rng = random.Random(7)
    for _ in range(200):
        works = random_works(rng)
        icache = IntermediateCache(1 << 20)
        for w in works:
            if w.layer_start > 0:
                icache.put(w.req_id, None, w.num_tokens)
        clock = VirtualClock(0.0)
        SimExecutor(lm, N, BlockManager(N, 64, 16), icache, clock, SimStats()).execute(StepPlan(N, works), {})
        assert clock.t == pytest.approx(lm.predict_iteration(StepPlan(N, works)), rel=1e-12)


def test_profile_file_keeps_the_terms_and_old_files_load_without_them(fitted, tmp_path):
    path = fitted.save(tmp_path / "p.json")
    back = FittedLatencyModel.load(path)
    assert back.step_overhead_time(2, 7) == fitted.step_overhead_time(2, 7) > 0
    assert sum(isinstance(s, StepOverheadSample) for s in back.samples) == 10
    assert back.refit().step_overhead_time(2, 7) == pytest.approx(fitted.step_overhead_time(2, 7))
    doc = json.loads(path.read_text())
    for k in ("step_overhead_s", "compose_overhead_s", "compose_work_s"):
        del doc["model"][k]
    del doc["samples"]["step_overhead"]
    assert FittedLatencyModel.from_dict(doc).step_overhead_time(2, 7) == 0.0
    doc = json.loads(path.read_text())
    doc["model"]["compose_work_s"] = -1.0
    with pytest.raises(Exception, match="compose_work_s"):
        FittedLatencyModel.from_dict(doc)


def test_a_scaled_model_scales_the_overhead(fitted):
    s = ScaledLatencyModel(fitted, 2.0)
    assert s.step_overhead_time(2, 5) == pytest.approx(2 * fitted.step_overhead_time(2, 5))
    plan = StepPlan(N, [Work("a", 10, 1, 0, N, True), Work("b", 5, 1, 0, 6)])
    assert s.predict_iteration(plan) == pytest.approx(2 * fitted.predict_iteration(plan))


def test_bad_step_samples_are_refused():
    with pytest.raises(ValueError):
        fit([StepOverheadSample(0, 0, 1e-3)], num_layers=N)
    with pytest.raises(ValueError):
        fit([StepOverheadSample(3, 2, 1e-3)], num_layers=N)
