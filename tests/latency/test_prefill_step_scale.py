"""Layer calls holding a prefill chunk priced as they run inside a whole step (issue 26 item 3): on an AMX
Xeon such a call inside a step cost ~0.9 of the same call timed alone, so the profiler times whole prefill
and mixed steps (``PrefillStepSample``: their compute) and the forms with ``instep`` fit one factor on the
call (``prefill_step_scale``) from them; ``layer_time`` stays the call timed alone, ``step_layer_time`` (what
plans are priced with) applies it. And the C++ prefill kernel's chunks priced per chunk (attention set
``chunked``). Fake timings, exact truths."""

import json
from pathlib import Path

import numpy as np
import pytest

from laser.core.plan import StepPlan, Work
from laser.latency import (
    AttentionSample,
    DecodeStepSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    LayerSample,
    PrefillStepSample,
    StatelessSample,
    attention_features,
    fit,
)
from laser.latency.features import ATTENTION_FEATURES
from laser.latency.fitting import DEFAULT_FORM, FORMS
from laser.latency.fitted import prefill_step_factor
from laser.latency.fitting_steps import PREFILL_STEP_SCALE_BOUNDS

N = 12
IN_STEP = 0.88  # a layer call holding a prefill chunk costs this much of it timed alone inside a step
SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "amx-bf16-smollm2-135m.json"


def stateless(n):
    return 2e-4 + 3e-6 * n


def attention(q, c):
    """Decode rows by their padded gather (one group); prefill chunks as the C++ kernel runs them: per chunk,
    per causal score."""
    dec = [ci for qi, ci in zip(q, c) if qi == 1]
    pf = [(qi, ci) for qi, ci in zip(q, c) if qi > 1]
    t = (1e-5 + 2e-7 * len(dec) * max(dec)) if dec else 0.0
    if pf:
        t += 5e-6 + sum(8e-6 + 2e-7 * qi + 3e-9 * qi * (ci - 0.5 * (qi - 1)) for qi, ci in pf)
    return t


def embed(n):
    return 1e-5 + 1e-8 * n


def head(r):
    return 5e-4 + 2e-5 * r


def alone(q, c):
    return stateless(sum(q)) + attention(q, c)


def prefill_step(q, c, scale=IN_STEP):
    """A whole step's compute: its layer calls at ``scale`` of them alone, embedding and head as alone."""
    return N * scale * alone(q, c) + embed(sum(q)) + head(len(q))


def chunks(rng, k):
    q = [int(x) for x in rng.integers(16, 600, k)]
    return q, [qi + int(rng.integers(0, 2 * qi)) for qi in q]


def samples(rng, steps=8, step_truth=prefill_step):
    s = [StatelessSample(n, stateless(n)) for n in range(1, 200)] + [StatelessSample(n, stateless(n))
                                                                     for n in range(200, 2100, 50)]
    s += [EmbedSample(n, embed(n)) for n in (1, 8, 64, 256, 1024)]
    s += [HeadSample(r, head(r)) for r in range(1, 65)]
    batches = [((1,) * b, tuple(int(x) for x in rng.integers(2, 2000, b))) for b in (1, 2, 4, 8, 16, 32, 64)]
    for k in (1, 1, 1, 2, 2, 3, 3, 4, 4, 1, 2, 3):
        q, c = chunks(rng, k)
        batches.append((tuple(q), tuple(c)))
        d = int(rng.integers(0, 20))
        batches.append(((1,) * d + tuple(q), tuple(int(x) for x in rng.integers(2, 900, d)) + tuple(c)))
    batches += [((q,), (q,)) for q in (16, 48, 100, 160, 191, 192, 256, 400, 512, 700, 767, 768, 1024, 1500)]
    s += [AttentionSample(q, c, attention(q, c)) for q, c in batches]
    s += [LayerSample(q, c, alone(q, c)) for q, c in batches[::3]]
    shapes = [((48,), (48,)), ((256,), (256,)), ((128,), (384,)), ((96, 64), (96, 64)), ((1,) * 8 + (128,), (300,) * 8
              + (128,)), ((200, 40), (320, 40)), ((1,) * 16 + (90,), (200,) * 16 + (190,)), ((512,), (512,))]
    s += [PrefillStepSample(q, c, step_truth(q, c)) for q, c in shapes[:steps]]
    return s


@pytest.fixture(scope="module")
def fitted():
    return fit(samples(np.random.default_rng(0)), num_layers=N)


def test_fit_recovers_the_in_step_factor_and_plans_are_priced_with_it(fitted):
    assert fitted.report["form"] == DEFAULT_FORM
    assert fitted.prefill_step_scale == pytest.approx(IN_STEP, rel=0.01)
    rep = fitted.report["prefill_step"]
    assert rep["n"] == 8 and rep["error"] < 0.01 < rep["error_alone"]
    for q, c in (((300,), (300,)), ((64, 32), (200, 32)), ((1, 1, 150), (90, 400, 150))):
        assert fitted.layer_time(q, c) == pytest.approx(alone(q, c), rel=0.03)  # the call timed alone
        assert fitted.step_layer_time(q, c) == pytest.approx(IN_STEP * fitted.layer_time(q, c), rel=1e-9)
    q, c = (1,) * 6, (100, 200, 300, 400, 500, 600)  # decode layers: not this factor (their own, 1.0 here)
    assert fitted.step_layer_time(q, c) == pytest.approx(fitted.layer_time(q, c), rel=1e-9)
    # a whole prefill step is priced as its steps ran; the same samples priced as timed alone over-predict it
    ws = [Work("a", 0, 180, 0, N, True), Work("b", 60, 70, 0, N, True), Work("d", 499, 1, 0, N, True)]
    plan = StepPlan(N, ws)
    truth = prefill_step((180, 70, 1), (180, 130, 500))
    before = fit(fitted.samples, num_layers=N, form="tiled-instep")
    assert before.prefill_step_scale == 1.0 or FORMS["tiled-instep"].get("instep")
    layers = N * fitted.step_layer_time((180, 70, 1), (180, 130, 500))
    assert fitted.predict_iteration(plan) == pytest.approx(
        layers + fitted.embed_time(251) + fitted.head_time(3) + fitted.step_overhead_time(1, 3), rel=1e-9)
    assert layers + fitted.embed_time(251) + fitted.head_time(3) == pytest.approx(truth, rel=0.03)
    assert fitted.predict_prefill(200) < N * fitted.layer_time((200,), (200,)) + fitted.embed_time(200) + \
        fitted.head_time(1) + fitted.step_overhead_time(1, 1)


def test_only_instep_forms_fit_it_and_too_few_steps_or_a_broken_profile_are_bounded():
    rng = np.random.default_rng(1)
    s = samples(rng)
    for form, spec in FORMS.items():
        assert (fit(s, num_layers=N, form=form).prefill_step_scale != 1.0) == bool(spec.get("instep")), form
    assert fit(samples(rng, steps=2), num_layers=N).prefill_step_scale == 1.0
    lo, hi = PREFILL_STEP_SCALE_BOUNDS
    assert fit(samples(rng, step_truth=lambda q, c: 5 * prefill_step(q, c)), num_layers=N).prefill_step_scale == hi
    assert fit(samples(rng, step_truth=lambda q, c: 0.1 * prefill_step(q, c)), num_layers=N).prefill_step_scale == lo
    with pytest.raises(ValueError, match="prefill chunk"):
        fit([PrefillStepSample((1, 1), (5, 6), 1e-3)], num_layers=N)


def test_chunked_attention_prices_the_kernel_per_chunk(fitted):
    f = dict(zip(ATTENTION_FEATURES, attention_features((1, 100, 40), (50, 300, 40))))
    assert (f["m_chunks"], f["m_scores"]) == (2, 100 * (300 - 49.5) + 40 * (40 - 19.5))
    assert f["m_pad"] == 2 * 100 * 300  # (the padded group, kept for the paths that run one)
    g = dict(zip(ATTENTION_FEATURES, attention_features((64,), (64,))))  # one whole prompt: the causal features
    assert g["c_const"] == 1 and g["m_chunks"] == g["m_scores"] == 0
    assert fitted.attention.feature_set == "chunked", fitted.report["attention"]["cv_error"]
    tiled = fit(fitted.samples, num_layers=N, form="tiled-instep-step-v10")  # (no "chunked")
    held_out = [((20, 450, 35, 300), (58, 711, 35, 400)), ((512,), (1536,)), ((32,), (96,)), ((1,) * 9 + (200, 70),
                (400,) * 9 + (260, 70))]
    for q, c in held_out:
        assert fitted.attention_time(q, c) == pytest.approx(attention(q, c), rel=0.03), (q, c)
    # one padded group per batch (the form before) misses these far more
    assert max(abs(tiled.attention_time(q, c) / attention(q, c) - 1) for q, c in held_out) > 0.1


def test_round_trip_and_old_profiles_load_with_the_neutral_value(fitted, tmp_path):
    back = FittedLatencyModel.load(fitted.save(tmp_path / "p.json"))
    assert back.prefill_step_scale == fitted.prefill_step_scale
    assert back.step_layer_time((300,), (300,)) == fitted.step_layer_time((300,), (300,))
    assert sorted(s.query_lens for s in back.samples if isinstance(s, PrefillStepSample)) == \
        sorted(s.query_lens for s in fitted.samples if isinstance(s, PrefillStepSample))
    assert back.refit().prefill_step_scale == pytest.approx(fitted.prefill_step_scale, rel=1e-9)
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["model"]["prefill_step_scale"], doc["samples"]["prefill_step"]  # a profile written before them
    old = FittedLatencyModel.from_dict(doc)
    assert old.prefill_step_scale == 1.0
    assert old.step_layer_time((300,), (300,)) == old.layer_time((300,), (300,))
    doc["model"]["prefill_step_scale"] = 0.0
    with pytest.raises(Exception, match="prefill_step_scale"):
        FittedLatencyModel.from_dict(doc)


@pytest.mark.skipif(not SHIPPED.exists(), reason="no shipped AMX profile")
def test_a_shipped_profile_of_profiler_10_loads_and_prices_plans_as_before():
    doc = json.loads(SHIPPED.read_text())
    if doc["metadata"].get("profiler_version", 0) >= 11:
        del doc["model"]["prefill_step_scale"]
        doc["model"].pop("prefill_step_slope", None)
        doc["samples"].pop("prefill_step", None)
    lm = FittedLatencyModel.from_dict(doc)
    assert lm.prefill_step_scale == 1.0
    for q, c in (((256,), (256,)), ((1, 1, 64), (300, 90, 64))):
        assert lm.step_layer_time(q, c) == lm.layer_time(q, c)
    b = (1,) * 4, (100, 200, 300, 400)  # decode layers as the profile priced them in a step
    assert lm.step_layer_time(*b) == pytest.approx(
        (lm.stateless_time(4) + lm.layer_overhead_s) * lm.decode_step_scale
        + lm.layer_attention_scale * lm.attention_time(*b) * lm.decode_step_attention_scale, rel=1e-12)
    assert not [s for s in lm.samples if isinstance(s, PrefillStepSample)]
    assert [s for s in lm.samples if isinstance(s, DecodeStepSample)]


def test_the_in_step_factor_follows_the_chunk_size_where_the_steps_show_it():
    """Whole steps whose in-step factor falls with the prefill tokens (0.98 at 48 tokens, 0.80 at 512, as on
    the AMX Xeon): the default form fits the slope and prices a few-token chunk beside decode rows near
    its alone time, a 512-token prompt at ~0.8; one factor for every size (form ``-v11``) misses both ends.
    The factor stays within its token range and bounds outside the samples."""
    def truth_factor(q):
        n = sum(x for x in q if x > 1)
        return min(1.2, 0.88 * (min(2048, max(4, n)) / 256) ** -0.09)

    def step(q, c):
        return prefill_step(q, c, scale=truth_factor(q))

    s = samples(np.random.default_rng(3), step_truth=step)
    m = fit(s, num_layers=N)
    assert m.prefill_step_slope == pytest.approx(0.09, abs=0.02) and m.prefill_step_scale == pytest.approx(0.88, rel=0.03)
    assert m.report["prefill_step"]["slope"] == m.prefill_step_slope and m.report["prefill_step"]["error"] < 0.01
    one = fit(s, num_layers=N, form="tiled-instep-step-v11")
    assert one.prefill_step_slope == 0.0
    for q, c in (((1,) * 20 + (24,), (300,) * 20 + (24,)), ((512,), (512,)), ((48,), (48,))):
        want = truth_factor(q)
        assert m.step_layer_time(q, c) / m.layer_time(q, c) == pytest.approx(want, rel=0.03), q
        assert abs(one.step_layer_time(q, c) / one.layer_time(q, c) / want - 1) > 0.04, q
    # outside the token range the factor keeps its edge value; never past the bounds
    assert m.step_layer_time((2,), (2,)) / m.layer_time((2,), (2,)) == pytest.approx(
        m.step_layer_time((4,), (4,)) / m.layer_time((4,), (4,)), rel=1e-9)
    lo, hi = PREFILL_STEP_SCALE_BOUNDS
    assert lo <= prefill_step_factor(0.61, 0.3, 4096) and prefill_step_factor(1.19, 0.3, 1) <= hi
    back = FittedLatencyModel.from_dict(m.to_dict())
    assert back.prefill_step_slope == m.prefill_step_slope
    doc = m.to_dict()
    doc["model"]["prefill_step_slope"] = float("nan")
    with pytest.raises(Exception, match="prefill_step_slope"):
        FittedLatencyModel.from_dict(doc)
