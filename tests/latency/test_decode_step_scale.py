"""Decode layers priced as they run inside a whole step (issue 26 item 3): a decode layer call inside a
step costs less than the same call timed alone (0.80-0.96 of it on an AVX512 EPYC), so the profiler
times whole decode steps (``DecodeStepSample``: their compute) and the forms with ``instep`` fit the
factors on a decode layer call's stateless part (``decode_step_scale``) and attention
(``decode_step_attention_scale``) from them. Fake timings, exact truths."""

import json

import numpy as np
import pytest

from laser.core.plan import StepPlan, Work
from laser.latency import (
    AttentionSample,
    DecodeStepSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    StatelessSample,
    fit,
)
from laser.latency.fitting import FORMS
from laser.latency.fitting_steps import DECODE_STEP_SCALE_BOUNDS

N = 12
IN_STEP = 0.82  # a decode layer's stateless modules inside a step cost this much of the call timed alone
IN_STEP_ATTENTION = 0.97  # its attention


def stateless(n):
    return 2e-4 + 3e-6 * n


def attention(q, c):
    return 1e-5 + 2e-7 * sum(c) + 4e-6 * sum(q)


def embed(n):
    return 1e-5 + 1e-8 * n


def head(r):
    return 5e-4 + 2e-5 * r


def decode_step(c):
    """A whole decode step's compute: its decode layers at IN_STEP, embedding and head as alone."""
    b = len(c)
    return N * (IN_STEP * stateless(b) + IN_STEP_ATTENTION * attention((1,) * b, c)) + embed(b) + head(b)


def samples(rng, steps=10, step_truth=decode_step):
    s = [StatelessSample(n, stateless(n)) for n in range(1, 200)]
    s += [EmbedSample(n, embed(n)) for n in (1, 8, 64, 256)]
    s += [HeadSample(r, head(r)) for r in range(1, 65)]
    batches = [((1,) * b, tuple(int(x) for x in rng.integers(2, 2000, b))) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32,
                                                                                      48, 64)]
    batches += [((q,), (q + k,)) for q in (16, 64, 256) for k in (0, q)]
    s += [AttentionSample(q, c, attention(q, c)) for q, c in batches]
    for b in (1, 2, 4, 8, 16, 32, 48, 64, 3, 24)[:steps]:
        c = tuple(int(x) for x in rng.integers(2, 1500, b))
        s.append(DecodeStepSample(c, step_truth(c)))
    return s


@pytest.fixture(scope="module")
def fitted():
    return fit(samples(np.random.default_rng(0)), num_layers=N, form="tiled-instep")


def test_fit_recovers_the_in_step_factor_and_prices_decode_layers_with_it(fitted):
    assert fitted.decode_step_scale == pytest.approx(IN_STEP, rel=0.02)
    assert fitted.decode_step_attention_scale == pytest.approx(IN_STEP_ATTENTION, rel=0.02)
    assert fitted.report["decode_step"]["n"] == 10 and fitted.report["decode_step"]["error"] < 0.02
    alone = fit(fitted.samples, num_layers=N, form="tiled")  # the form before: decode layers as timed alone
    assert alone.decode_step_scale == 1.0 and "decode_step" not in alone.report
    q, c = (1,) * 8, (100, 200, 300, 400, 500, 600, 700, 800)
    assert fitted.step_layer_time(q, c) == pytest.approx(IN_STEP * alone.stateless_time(8)
                                                         + IN_STEP_ATTENTION * alone.attention_time(q, c), rel=0.02)
    assert fitted.layer_time(q, c) == pytest.approx(alone.layer_time(q, c), rel=1e-9)  # the call timed alone
    for q, c in (((64,), (64,)), ((1, 1, 32), (90, 400, 32))):  # a prefill chunk prices as alone, beside decode too
        assert fitted.step_layer_time(q, c) == pytest.approx(alone.layer_time(q, c), rel=1e-9)
    # a whole decode iteration is priced as its steps ran; the alone-priced form over-predicts it
    ctx = [15, 90, 120, 40, 70]
    truth = decode_step(tuple(ctx))
    assert fitted.predict_decode_iteration(ctx) == pytest.approx(truth, rel=0.02)
    assert alone.predict_decode_iteration(ctx) > 1.07 * truth
    plan = StepPlan(N, [Work(f"r{i}", x - 1, 1, 0, N, True) for i, x in enumerate(ctx)])
    assert fitted.predict_iteration(plan) == pytest.approx(fitted.predict_decode_iteration(ctx), rel=1e-9)


def test_every_instep_form_fits_it_and_no_other():
    s = samples(np.random.default_rng(1))
    for form, spec in FORMS.items():
        m = fit(s, num_layers=N, form=form)
        assert (m.decode_step_scale != 1.0) == bool(spec.get("instep")), form


def test_too_few_steps_leave_it_at_one_and_a_broken_profile_is_bounded():
    rng = np.random.default_rng(2)
    few = fit(samples(rng, steps=2), num_layers=N, form="tiled-instep")
    assert few.decode_step_scale == few.decode_step_attention_scale == 1.0
    lo, hi = DECODE_STEP_SCALE_BOUNDS
    slow = fit(samples(rng, step_truth=lambda c: 5 * decode_step(c)), num_layers=N, form="tiled-instep")
    # (attention never dearer in a step than in the layer call alone: the stateless factor takes the bound)
    assert slow.decode_step_scale == hi and slow.decode_step_attention_scale == 1.0
    fast = fit(samples(rng, step_truth=lambda c: 0.1 * decode_step(c)), num_layers=N, form="tiled-instep")
    assert fast.decode_step_scale == fast.decode_step_attention_scale == lo


def test_scale_and_samples_round_trip_through_the_profile_file(fitted, tmp_path):
    back = FittedLatencyModel.load(fitted.save(tmp_path / "p.json"))
    assert (back.decode_step_scale, back.decode_step_attention_scale) == (fitted.decode_step_scale,
                                                                         fitted.decode_step_attention_scale)
    assert sorted(s.context_lens for s in back.samples if isinstance(s, DecodeStepSample)) == \
        sorted(s.context_lens for s in fitted.samples if isinstance(s, DecodeStepSample))
    assert back.refit().decode_step_scale == pytest.approx(fitted.decode_step_scale, rel=1e-9)
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["model"]["decode_step_scale"]  # a profile written before it: decode layers as timed alone
    assert FittedLatencyModel.from_dict(doc).decode_step_scale == 1.0
    doc["model"]["decode_step_scale"] = float("nan")
    with pytest.raises(Exception, match="decode_step_scale"):
        FittedLatencyModel.from_dict(doc)


def test_attention_is_never_dearer_inside_a_step_than_in_the_layer_call():
    # whole steps whose attention looks 12 % dearer than alone (on a noisy profile the two-factor fit
    # trades one factor for the other): attention stays as in the layer call, the stateless factor
    # is refitted alone on what is left
    def truth(c):
        b = len(c)
        return N * (0.85 * stateless(b) + 1.12 * attention((1,) * b, c)) + embed(b) + head(b)

    m = fit(samples(np.random.default_rng(3), step_truth=truth), num_layers=N, form="tiled-instep")
    assert m.decode_step_attention_scale == 1.0
    assert m.decode_step_scale > 0.85  # it absorbs part of the dearer attention
    ctx = (300, 900, 1400, 40)
    b, q = len(ctx), (1,) * len(ctx)
    assert m.step_layer_time(q, ctx) == pytest.approx(m.decode_step_scale * (stateless(b) + m.layer_overhead_s)
                                                 + m.layer_attention_scale * attention(q, ctx), rel=0.02)
