"""The machine's speed against its profile, per kind of work (laser.latency.machine_speed), the
scatter of its steps around their fitted price, and the simulated twin of a run priced with it
(SimTarget(machine_model=..., planner=...))."""

import pytest

from laser.bench.sim_target import SimTarget
from laser.bench.workloads import WorkloadRequest
from laser.core.config import SchedulerConfig
from laser.core.request import SLO, Request, SamplingParams
from laser.core.slo import SLOClasses
from laser.latency import CalibratedLatencyModel, SimpleLatencyModel
from laser.latency.machine_speed import JitteredLatencyModel, KindScaledLatencyModel, fit_machine_speed
from laser.sim import SimInstance

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5)


def test_kind_scaled_prices_decode_and_prefill_layers_apart():
    m = KindScaledLatencyModel(LM, 0.5, 2.0)
    assert m.layer_time((1, 1), (10, 20)) == pytest.approx(0.5 * LM.layer_time((1, 1), (10, 20)))
    assert m.layer_time((1, 16), (10, 16)) == pytest.approx(2.0 * LM.layer_time((1, 16), (10, 16)))
    assert m.head_time(3) == pytest.approx(0.5 * LM.head_time(3))
    assert m.embed_time(8) == pytest.approx(0.5 * LM.embed_time(8))
    # the two halves of a split add up to the plain price
    d, p = KindScaledLatencyModel(LM, 1.0, 0.0), KindScaledLatencyModel(LM, 0.0, 1.0)
    for q, c in (((1, 1), (5, 9)), ((1, 32), (5, 32))):
        assert d.layer_time(q, c) + p.layer_time(q, c) == pytest.approx(LM.layer_time(q, c))
    with pytest.raises(ValueError):
        KindScaledLatencyModel(LM, 0.0, 0.0)
    with pytest.raises(ValueError):
        KindScaledLatencyModel(LM, -1.0, 1.0)


def _mixed_requests(n: int = 12) -> list[Request]:
    slo = SLO(ttft=10.0, tbt=1.0, name="chat")
    return [Request(prompt_token_ids=[1] * (8 + 37 * (i % 4)),
                    sampling_params=SamplingParams(max_tokens=6 + i % 5, temperature=0.0, ignore_eos=True),
                    slo=slo, arrival_time=0.004 * i, req_id=f"r{i}") for i in range(n)]


def test_the_fit_recovers_a_machine_that_runs_decode_and_prefill_at_different_speeds():
    """A simulated machine 0.8x the profile on decode and 1.3x on prefill: its logged steps give
    both factors back, to rounding (the machine is the model the fit assumes)."""
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), machine_model=KindScaledLatencyModel(LM, 0.8, 1.3))
    sim.step_log = []
    for r in _mixed_requests():
        sim.submit(r)
    sim.run()
    speed = fit_machine_speed(LM, sim.step_log)
    assert speed.decode_steps > 0 and speed.other_steps > 0
    assert speed.decode_factor == pytest.approx(0.8, rel=1e-6)
    assert speed.other_factor == pytest.approx(1.3, rel=1e-6)
    assert speed.error < 1e-6
    assert "decode x0.800" in speed.describe()


def test_the_fit_without_prefill_steps_is_one_factor_and_none_without_steps():
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), machine_model=KindScaledLatencyModel(LM, 1.5, 9.0))
    sim.step_log = []
    sim.submit(Request(prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True), req_id="one"))
    sim.run()
    speed = fit_machine_speed(LM, sim.step_log)
    assert speed.other_steps == 0 and speed.decode_factor == speed.other_factor == pytest.approx(1.5)
    assert fit_machine_speed(LM, []) is None


def test_the_step_log_keeps_complete_steps_only_when_asked():
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"))
    for r in _mixed_requests(4):
        sim.submit(r)
    sim.run()
    assert sim.step_log is None  # off by default: nothing kept
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"))
    sim.step_log = []
    for r in _mixed_requests(4):
        sim.submit(r)
    sim.run()
    assert len(sim.step_log) == sim.stats.steps
    assert all(secs == pytest.approx(LM.predict_iteration(plan)) for plan, secs in sim.step_log)


def test_a_twin_on_a_slower_machine_planned_by_the_calibration_is_slower_and_deterministic():
    reqs = [WorkloadRequest("chat", "x", 8 + 30 * (i % 3), 8, 0.01 * i) for i in range(10)]
    slos = SLOClasses({"chat": {"ttft": 10.0, "tbt": 1.0}})

    def ttfts(**kw):
        out = SimTarget("laser", LM, N, **kw).run(reqs, slos)
        return [r.ttft for r in out.records]

    plain = ttfts()
    slow = ttfts(machine_model=KindScaledLatencyModel(LM, 2.0, 2.0), planner=CalibratedLatencyModel)
    assert all(s > p for s, p in zip(slow, plain))
    assert slow == ttfts(machine_model=KindScaledLatencyModel(LM, 2.0, 2.0), planner=CalibratedLatencyModel)


def test_host_time_per_step_is_charged_once_per_step():
    m = KindScaledLatencyModel(LM, 1.0, 1.0, host_step_s=0.002)
    assert m.step_overhead_time(2, 3) == pytest.approx(LM.step_overhead_time(2, 3) + 0.002)
    assert m.step_overhead_time(0, 0) == 0.0
    slo = SLO(ttft=10.0, tbt=1.0, name="chat")
    one = Request(prompt_token_ids=[1] * 8, sampling_params=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                  slo=slo, req_id="a")
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), machine_model=m)
    sim.submit(one)
    sim.run()
    base = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"))
    two = Request(prompt_token_ids=[1] * 8, sampling_params=one.sampling_params, slo=slo, req_id="a")
    base.submit(two)
    base.run()
    assert sim.stats.steps == base.stats.steps == 5
    assert one.token_times[-1] - two.token_times[-1] == pytest.approx(5 * 0.002)
    with pytest.raises(ValueError):
        KindScaledLatencyModel(LM, 1.0, 1.0, host_step_s=-1.0)


def _price(model, plan) -> float:
    from laser.core.pricing import PlanCost

    return PlanCost(model, plan.num_layers, plan.works).total


def _has_prefill(plan) -> bool:
    return any(w.num_tokens > 1 for w in plan.works)


def _jittered_run(decode=(0.9, 1.1), other=(0.8, 1.25), seed=3):
    base = KindScaledLatencyModel(LM, 0.8, 1.3)
    machine = JitteredLatencyModel(base, decode, other, seed=seed)
    sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), machine_model=machine)
    sim.step_log = []
    for r in _mixed_requests(24):
        sim.submit(r)
    sim.run()
    return base, sim.step_log


def test_a_jittered_machine_draws_each_steps_ratio_from_its_kinds_set():
    """Every step of the simulated machine runs its price on the scattered-free machine times one
    ratio of its kind's set (decode only: 0.9 / 1.1; with prefill: 0.8 / 1.25), each ratio seen."""
    base, log = _jittered_run()
    seen = {True: set(), False: set()}
    for plan, measured in log:
        seen[_has_prefill(plan)].add(round(measured / _price(base, plan), 9))
    assert seen[False] == {0.9, 1.1} and seen[True] == {0.8, 1.25}
    # the same seed draws the same steps again; another seed other ones
    assert [m for _, m in _jittered_run()[1]] == [m for _, m in log]
    assert [m for _, m in _jittered_run(seed=4)[1]] != [m for _, m in log]


def test_jittered_machine_reseeds_and_refuses_bad_ratios():
    m = JitteredLatencyModel(LM, (0.5, 2.0), seed=1)
    assert m.factor == 1.0 and m.other_ratios == m.decode_ratios == (0.5, 2.0)  # an empty kind takes the other's
    plan = type("P", (), {"works": []})()
    draws = []
    for _ in range(12):
        m.begin_step(plan)
        draws.append(m.factor)
    assert set(draws) == {0.5, 2.0}
    m.reseed()
    assert m.factor == 1.0
    again = []
    for _ in range(12):
        m.begin_step(plan)
        again.append(m.factor)
    assert again == draws
    assert m.layer_time((1,), (5,)) == pytest.approx(draws[-1] * LM.layer_time((1,), (5,)))
    m.reseed(5)
    assert m.seed == 5  # kept: a run that reseeds afterwards starts from it
    with pytest.raises(ValueError, match="at least one"):
        JitteredLatencyModel(LM, ())
    with pytest.raises(ValueError, match="other_ratios"):
        JitteredLatencyModel(LM, (1.0,), (1.0, 0.0))
    for bad in ((-1.0,), (float("inf"),), (float("nan"),), ("1.5",), (True,), "12", (None,)):
        with pytest.raises(ValueError, match="decode_ratios"):
            JitteredLatencyModel(LM, bad)
    for seed in (1.7, "3", True):
        with pytest.raises(ValueError, match="seed"):
            JitteredLatencyModel(LM, (1.0,), seed=seed)


def test_the_host_time_per_step_is_not_scattered():
    """The engine's time outside its executor is measured apart from the steps the ratios come from."""
    m = JitteredLatencyModel(KindScaledLatencyModel(LM, 1.0, 1.0, host_step_s=0.01), (2.0,))
    m.begin_step(type("P", (), {"works": []})())
    assert m.step_overhead_s == pytest.approx(2.0 * LM.step_overhead_s + 0.01)
    assert m.step_overhead_time(2, 3) == pytest.approx(2.0 * LM.step_overhead_time(2, 3) + 0.01)
    assert m.step_overhead_time(0, 0) == 0.0


def test_a_scattered_machine_is_a_clock_only_and_drawn_through_a_wrapper():
    from laser.latency.calibrated import ScaledLatencyModel
    from laser.sim.cluster import ClusterConfig, ClusterSim, ClusterSpec

    jit = JitteredLatencyModel(LM, (3.0,))
    for build in (lambda: SimTarget("laser", jit, N), lambda: SimInstance("laser", N, jit),
                  lambda: SimInstance("laser", N, ScaledLatencyModel(jit, 1.0)),
                  lambda: ClusterSim("laser", ClusterSpec.parse("1P1D"), ClusterConfig(latency_model=jit, kv_bytes_per_token_layer=64, num_blocks=64))):
        with pytest.raises(ValueError, match="scatter"):
            build()

    def busy(machine):
        sim = SimInstance("laser", N, LM, SchedulerConfig(policy="laser"), machine_model=machine)
        for r in _mixed_requests(4):
            sim.submit(r)
        sim.run()
        return sim.stats.busy_s

    assert busy(ScaledLatencyModel(jit, 1.0)) == pytest.approx(busy(KindScaledLatencyModel(LM, 3.0, 3.0)))
    assert busy(ScaledLatencyModel(jit, 1.0)) > 2.5 * busy(None)


def test_the_fit_keeps_each_kinds_scatter_and_the_model_replays_it():
    """From a machine whose decode-only steps ran 0.9x or 1.1x their price: the fit's decode
    scatter spans exactly 1.1 / 0.9, its mean is the decode steps' measured over fitted total
    (a uniform draw prices them at their measured total on average); the machine it builds with
    ``jitter=True`` draws from those quantiles (without: the plain two factors)."""
    _, log = _jittered_run(other=(1.0,))
    speed = fit_machine_speed(LM, log)
    q = speed.decode_jitter
    assert len(q) == 101 and list(q) == sorted(q)
    assert q[-1] / q[0] == pytest.approx(1.1 / 0.9)
    dec = [(plan, m) for plan, m in log if not _has_prefill(plan)]
    fitted = sum(speed.decode_factor * _price(LM, plan) for plan, _ in dec)
    assert sum(q) / len(q) == pytest.approx(sum(m for _, m in dec) / fitted)
    assert speed.other_jitter and "at 98 %" in speed.describe()
    jittered = speed.model(LM, jitter=True, seed=5)
    assert isinstance(jittered, JitteredLatencyModel) and jittered.decode_ratios == q
    assert isinstance(speed.model(LM), KindScaledLatencyModel) and not isinstance(speed.model(LM), JitteredLatencyModel)


def test_a_rare_outlier_is_drawn_about_as_rarely_as_it_ran_and_a_broken_timing_is_left_out():
    """One step in 2,000 at 5x its price is not among the quantiles drawn from (each quantile is
    the middle of its share of the sorted ratios), and an infinite timing is left out of the fit;
    the speed survives JSON."""
    import dataclasses
    import json

    from laser.latency.machine_speed import MachineSpeed

    _, log = _jittered_run(decode=(1.0,), other=(1.0,))
    plan, t = next((p, m) for p, m in log if not _has_prefill(p))
    steps = [(plan, t)] * 1999 + [(plan, 5 * t), (plan, float("inf"))]
    speed = fit_machine_speed(LM, steps)
    assert speed.decode_steps == 2000 and max(speed.decode_jitter) < 1.01
    assert speed.decode_factor == pytest.approx(t * (1999 + 5) / 2000 / _price(LM, plan))
    back = MachineSpeed(**json.loads(json.dumps(dataclasses.asdict(speed))))
    assert back == speed and hash(back) == hash(speed)


def test_a_sim_target_on_a_jittered_machine_repeats_itself_run_after_run():
    reqs = [WorkloadRequest("chat", "x", 8 + 30 * (i % 3), 8, 0.01 * i) for i in range(10)]
    slos = SLOClasses({"chat": {"ttft": 10.0, "tbt": 1.0}})
    t = SimTarget("laser", LM, N, machine_model=JitteredLatencyModel(LM, (0.7, 1.4), seed=2),
                  planner=CalibratedLatencyModel)
    first = [r.ttft for r in t.run(reqs, slos).records]
    assert first == [r.ttft for r in t.run(reqs, slos).records]
    plain = [r.ttft for r in SimTarget("laser", LM, N).run(reqs, slos).records]
    assert first != plain
