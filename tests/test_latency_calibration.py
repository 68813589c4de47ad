"""Online calibration of the latency model (laser.latency.calibrated): a real instance plans
with its profile's predictions scaled by how the machine runs now."""

import pickle

import pytest

from laser.config import CacheConfig
from laser.engine import Engine
from laser.latency import CalibratedLatencyModel, SimpleLatencyModel
from laser.request import SamplingParams

LM = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=1e-5)


def test_the_factor_is_the_quantile_of_recent_ratios_within_bounds():
    m = CalibratedLatencyModel(LM, window=10, quantile=0.8, min_steps=4, lo=0.5, hi=2.0)
    base = LM.layer_time((8,), (8,))
    for r in (1.3, 1.3, 1.3):
        m.observe(0.01, 0.01 * r)
    assert m.factor == 1.0  # fewer than min_steps observations: unchanged
    m.observe(0.01, 0.013)
    assert m.factor == pytest.approx(1.3)
    assert m.layer_time((8,), (8,)) == pytest.approx(1.3 * base)
    assert m.predict_prefill(16) == pytest.approx(1.3 * LM.predict_prefill(16))
    for _ in range(10):  # the window forgets: the machine got 10x slower for good
        m.observe(0.01, 0.1)
    assert m.factor == 2.0  # capped at hi
    for _ in range(10):
        m.observe(0.01, 0.001)
    assert m.factor == 0.5  # and at lo
    m.observe(0.0, 1.0)
    m.observe(1.0, -1.0)
    assert m.observed == 24  # non-positive times are ignored
    # a high quantile: one fast step among slow ones does not make the plans optimistic
    m2 = CalibratedLatencyModel(LM, window=10, quantile=0.8, min_steps=1)
    for r in (1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 0.6):
        m2.observe(1.0, r)
    assert m2.factor == pytest.approx(1.2)
    assert pickle.loads(pickle.dumps(m2)).factor == m2.factor  # travels in an instance report


def test_bad_parameters_are_refused():
    for kw in (dict(window=0), dict(min_steps=0), dict(quantile=0.0), dict(quantile=1.5), dict(lo=1.5),
               dict(hi=0.9)):
        with pytest.raises(ValueError):
            CalibratedLatencyModel(LM, **kw)


def test_an_engine_observes_every_complete_step(tiny_llama):
    """The engine's core reports each step it ran to the end (wall time vs the inner model's
    prediction of that plan); a latency model given without calibration is left alone."""
    m = CalibratedLatencyModel(SimpleLatencyModel(num_layers=2, per_layer=1e-9, per_token=1e-12), min_steps=2)
    e = Engine(str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(kv_cache_gib=0.01),
               latency_model=m)
    e.add_request(list(range(5, 20)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
    assert m.observed == steps
    assert m.factor == m.hi  # a real step takes far longer than 1 ns per layer: capped
    from laser.admission import snapshot_of

    assert snapshot_of(e.scheduler, 0.0).counters["latency_calibration"] == m.hi  # what /metrics exports
    plain = Engine(str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(kv_cache_gib=0.01),
                   latency_model=LM)
    assert plain.core.step_observer is None and plain.latency_model is LM
    plain.set_policy("laser", m)  # a calibrated model given later is observed from then on
    assert plain.core.step_observer == m.observe_step
