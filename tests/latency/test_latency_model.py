"""Latency model: fitting recovers known structure, profile files, analytic roofline."""

import json
import math
import sys
import time

import numpy as np
import pytest

from laser.latency import (
    ATTENTION_FEATURES,
    AnalyticLatencyModel,
    AttentionSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    LatencyProfileError,
    LayerSample,
    ModelShape,
    SimpleLatencyModel,
    StatelessSample,
    attention_features,
    default_profile_path,
    fit,
)
from laser.latency.fitting import _fit_piecewise
from laser.core.plan import LayerStep, StepPlan, Work


# ---------------------------------------------------------------- synthetic ground truth
def stair(n, width, base=2e-4, per_tok=2e-6, jump=4e-5):
    """Tile-like truth: a line plus a jump every ``width`` tokens."""
    return base + per_tok * n + jump * math.ceil(n / width)


D_COEF = {"d_groups": 3e-5, "d_seqs": 5e-6, "d_ctx": 4e-8}
P_COEF = {"c_const": 1e-4, "c_tokens": 2e-6, "m_const": 2e-4, "m_tokens": 3e-6, "m_ctx": 1e-7}


def attn_truth(q, c, pad=0.0, qc=0.0):
    f = dict(zip(ATTENTION_FEATURES, attention_features(q, c)))
    t = sum(v * f[k] for k, v in {**D_COEF, **P_COEF}.items())
    return t + pad * f["d_pad"] + qc * (f["m_pad"] + f["c_square"])


def random_batches(rng, count):
    out = []
    for i in range(count):
        kind = i % 3
        q, c = [], []
        if kind in (0, 2):  # decode entries
            b = int(rng.integers(1, 48))
            q += [1] * b
            c += [int(x) for x in rng.integers(2, 2048, b)]
        if kind == 1 and i % 2:  # one prompt, no cached context: the causal kernel
            qi = int(rng.integers(2, 1024))
            q.append(qi)
            c.append(qi)
        elif kind in (1, 2):  # prefill chunks, some with cached context
            for _ in range(int(rng.integers(1, 4))):
                qi = int(rng.integers(2, 512))
                q.append(qi)
                c.append(qi + int(rng.integers(0, 1024)))
        out.append((tuple(q), tuple(c)))
    return out


def noisy(rng, t, sd=0.01):
    return float(t * (1 + sd * rng.standard_normal()))


def make_samples(rng, width=32, pad=0.0, qc=0.0):
    s = [StatelessSample(n, noisy(rng, stair(n, width))) for n in range(1, 385)]
    s += [AttentionSample(q, c, noisy(rng, attn_truth(q, c, pad, qc))) for q, c in random_batches(rng, 240)]
    s += [EmbedSample(n, noisy(rng, 1e-5 + 1e-8 * n)) for n in range(1, 400, 7)]
    s += [HeadSample(r, noisy(rng, 5e-4 + 2e-5 * r)) for r in range(1, 65)]
    return s


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(1)
    samples = make_samples(rng)
    return fit(samples, num_layers=30, metadata={"model_id": "tiny", "dtype": "bf16", "hardware": "test-cpu", "threads": 2})


# ---------------------------------------------------------------- fitting
@pytest.mark.parametrize("width", [16, 32, 64])
def test_stateless_fit_selects_segment_width_and_matches_truth(width):
    rng = np.random.default_rng(width)
    ns = list(range(1, 513))
    samples = [StatelessSample(n, noisy(rng, stair(n, width))) for n in ns]
    m = fit(samples, num_layers=4)
    assert m.report["stateless"]["width"] == width, m.report["stateless"]["cv_error"]
    err = max(abs(m.stateless_time(n) / stair(n, width) - 1) for n in ns)
    assert err < 0.03
    # Extrapolation past the profiled range stays close to the true trend.
    assert m.stateless_time(1024) == pytest.approx(stair(1024, width), rel=0.05)


def test_sparse_profile_interpolates_between_samples():
    # The profiler samples densely at small n and geometrically beyond: segments with
    # one sample and empty segments between them must interpolate, not step.
    rng = np.random.default_rng(2)
    ns = list(range(1, 257)) + [384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    m = fit([StatelessSample(n, noisy(rng, stair(n, 32))) for n in ns], num_layers=2)
    assert m.report["stateless"]["width"] == 32
    for n in (270, 300, 450, 700, 900, 1300, 1800, 2500, 3500, 6000):
        assert m.stateless_time(n) == pytest.approx(stair(n, 32), rel=0.03), n


def test_one_sample_per_segment_gives_a_line_not_steps():
    # Jumps are penalised a little: unless data demands a step, values between
    # samples are linear interpolation.
    ns = np.arange(16, 1024, 32)  # one sample in the middle of each 32-token segment
    f = _fit_piecewise(ns, 1e-4 + 1e-6 * ns, 32)
    for n in range(1, 1100):
        assert f(n) == pytest.approx(1e-4 + 1e-6 * n, rel=1e-3), n


def test_stateless_linear_truth_selects_a_line():
    rng = np.random.default_rng(7)
    samples = [StatelessSample(n, noisy(rng, 1e-4 + 3e-6 * n)) for n in range(1, 300)]
    m = fit(samples, num_layers=2)
    assert m.report["stateless"]["width"] == "linear"
    assert m.stateless_time(150) == pytest.approx(1e-4 + 3e-6 * 150, rel=0.01)


def test_attention_fit_recovers_paper_coefficients(model):
    att = model.attention
    assert att.feature_set == "linear", model.report["attention"]["cv_error"]
    for k, v in {**D_COEF, **P_COEF}.items():
        assert att.coef[k] == pytest.approx(v, rel=0.1), k
    for k in ("d_pad", "c_square", "m_pad"):
        assert att.coef[k] == 0.0
    assert model.report["attention"]["error"] < 0.015


def test_attention_fit_selects_padding_terms_when_data_needs_them():
    rng = np.random.default_rng(3)
    samples = [AttentionSample(q, c, noisy(rng, attn_truth(q, c, pad=2e-8, qc=1e-10)))
               for q, c in random_batches(rng, 300)]
    m = fit(samples, num_layers=2)
    cv = m.report["attention"]["cv_error"]
    assert m.attention.feature_set == "kernel", cv
    assert cv["linear"] > 1.5 * cv["kernel"]
    assert m.attention.coef["d_pad"] == pytest.approx(2e-8, rel=0.15)
    skewed = ((1,) * 32, (10,) * 31 + (4000,))  # one long context pads the whole batch
    for q, c in random_batches(np.random.default_rng(4), 30) + [skewed]:
        assert m.attention_time(q, c) == pytest.approx(attn_truth(q, c, pad=2e-8, qc=1e-10), rel=0.05)


def test_layer_samples_fit_fixed_overhead():
    rng = np.random.default_rng(5)
    samples = make_samples(rng)
    batches = random_batches(rng, 40)
    samples += [LayerSample(q, c, noisy(rng, stair(sum(q), 32) + attn_truth(q, c) + 1e-4)) for q, c in batches]
    m = fit(samples, num_layers=2)
    assert m.layer_overhead_s == pytest.approx(1e-4, rel=0.25)
    q, c = batches[0]
    assert m.layer_time(q, c) == pytest.approx(stair(sum(q), 32) + attn_truth(q, c) + 1e-4, rel=0.05)


def test_layer_samples_fit_attention_scale_and_overhead():
    # A whole layer pays its attention 12% more than alone, plus 0.1 ms per call.
    rng = np.random.default_rng(6)
    samples = make_samples(rng)
    batches = random_batches(rng, 40)

    def truth(q, c):
        return stair(sum(q), 32) + 1.12 * attn_truth(q, c) + 1e-4

    samples += [LayerSample(q, c, noisy(rng, truth(q, c), sd=0.005)) for q, c in batches]
    m = fit(samples, num_layers=2)
    assert m.layer_attention_scale == pytest.approx(1.12, abs=0.03)
    assert m.layer_overhead_s == pytest.approx(1e-4, rel=0.5)
    for q, c in random_batches(np.random.default_rng(8), 20):
        assert m.layer_time(q, c) == pytest.approx(truth(q, c), rel=0.03)
        assert m.predict_layer(LayerStep(0, q, c)) == m.layer_time(q, c)
    m2 = FittedLatencyModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert m2.layer_attention_scale == m.layer_attention_scale
    # Too few whole-layer samples for two parameters: the median residual, scale 1.
    few = fit(make_samples(rng) + [LayerSample(q, c, truth(q, c)) for q, c in batches[:4]], num_layers=2)
    assert few.layer_attention_scale == 1.0 and few.layer_overhead_s > 0


def test_attention_features_follow_the_runner_kernels():
    f = lambda q, c, g=0: dict(zip(ATTENTION_FEATURES, attention_features(q, c, g)))  # noqa: E731
    causal = f((300,), (300,))  # one prompt, nothing cached: the causal kernel
    assert (causal["c_const"], causal["c_tokens"], causal["c_square"]) == (1, 300, 90000)
    assert causal["m_const"] == 0 and causal["d_groups"] == 0
    cached = f((100,), (400,))  # a later chunk: the masked kernel over its context
    assert cached["c_const"] == 0 and (cached["m_const"], cached["m_pad"]) == (1, 100 * 400)
    two = f((50, 200), (50, 260))  # two prompts: one padded masked group
    assert two["c_const"] == 0 and (two["m_tokens"], two["m_ctx"], two["m_pad"]) == (250, 310, 2 * 200 * 260)
    mixed = f((1, 1, 1, 64), (300, 100, 200, 64), 600)  # decode rows sorted, then split
    assert (mixed["d_groups"], mixed["d_seqs"], mixed["d_ctx"]) == (2, 3, 600)
    assert mixed["d_pad"] == 2 * 200 + 300 and mixed["c_const"] == 1


def test_piecewise_fit_is_monotone_even_on_noisy_flat_data():
    # Small-n timings are flat plus noise; an unconstrained fit would wiggle down.
    rng = np.random.default_rng(11)
    ns = np.array([n for n in range(1, 257) if n % 50])  # with gaps
    f = _fit_piecewise(ns, np.array([noisy(rng, 1e-3 + 1e-7 * n, sd=0.05) for n in ns]), 8)
    values = [f(n) for n in range(0, 600)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert values[0] == 0.0 and min(values[1:]) > 0.0


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError):
        fit([StatelessSample(4, -1.0)], num_layers=1)
    with pytest.raises(ValueError):
        fit([AttentionSample((5,), (3,), 1e-3)], num_layers=1)  # context shorter than query
    with pytest.raises(TypeError):
        fit([("stateless", 4, 1e-3)], num_layers=1)


# ---------------------------------------------------------------- predictions
def test_predictions_monotone_in_tokens_and_context(model):
    prev = 0.0
    for n in range(1, 1500):
        t = model.predict_layer(LayerStep(0, (n,), (n,)))
        assert t >= prev
        prev = t
    prev = 0.0
    for c in range(1, 6000, 7):
        t = model.predict_layer(LayerStep(0, (1,) * 8, (c,) * 8))
        assert t >= prev
        prev = t
    # Adding an entry to a batch never makes it cheaper.
    assert model.layer_time((1, 1, 64), (90, 90, 200)) >= model.layer_time((1, 64), (90, 200))
    prev = 0.0
    for r in range(0, 200):
        t = model.head_time(r)
        assert t >= prev
        prev = t


def test_predict_iteration_matches_sum_of_layer_calls(model):
    plan = StepPlan(30, [
        Work("a", 0, 100, 0, 12),  # prefill chunk stopping at layer 12
        Work("b", 40, 60, 12, 30, sample=True),  # resumed chunk finishing
        Work("c", 500, 1, 0, 30, sample=True),  # decode, all layers
        Work("d", 800, 1, 10, 20),  # decode slice
    ])
    naive = sum(model.predict_layer(s) for s in plan.layer_steps())
    expected = naive + model.embed_time(101) + model.head_time(2)
    assert model.predict_iteration(plan) == pytest.approx(expected, rel=1e-12)
    assert model.predict_iteration(StepPlan(30)) == 0.0


def test_prefill_decode_helpers(model):
    full = model.predict_prefill(200)
    assert full == pytest.approx(30 * model.layer_time((200,), (200,)) + model.embed_time(200) + model.head_time(1))
    assert model.predict_prefill(200, layers=5) == pytest.approx(5 * model.layer_time((200,), (200,)))
    assert model.predict_prefill(200, layers=5, context_start=1000) > model.predict_prefill(200, layers=5)
    ctx = [300, 700, 50]
    assert model.predict_decode_iteration(ctx) == pytest.approx(
        30 * model.layer_time((1, 1, 1), ctx) + model.embed_time(3) + model.head_time(3))


def test_max_tokens_within_is_the_largest_fitting_chunk(model):
    for budget in (1e-3, 5e-3, 2e-2):
        k = model.max_tokens_within(budget, layers=3, context_start=100, query_lens=(1, 1), context_lens=(50, 80))
        cost = lambda k: 3 * model.layer_time((1, 1, k), (50, 80, 100 + k))
        assert k >= 1 and cost(k) <= budget < cost(k + 1)
    assert model.max_tokens_within(1e-9) == 0
    assert model.max_tokens_within(10.0, limit=77) == 77


def test_predict_layer_is_fast(model):
    """Pricing a layer step is pure-Python arithmetic of the order of a few passes over its
    lengths: measured against exactly such passes in the same run (a ratio, so it holds on a
    CPU of any speed; a hot path that went through numpy or re-sorted/grouped every call would
    cost hundreds of them)."""
    decode = LayerStep(3, (1,) * 32, tuple(range(100, 132)))
    mixed = LayerStep(3, (1,) * 16 + (256,), tuple(range(100, 116)) + (300,))

    def passes(step):  # four C-speed passes over the batch
        q, c = step.query_lens, step.context_lens
        return sum(q) + sum(c) + max(c) + len(c)

    def per_call(fn, step, n=5000):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(step)
        return (time.perf_counter() - t0) / n

    for step in (decode, mixed):
        # interleaved, best of 5: a busy neighbour slows both sides alike
        ratio = min(per_call(model.predict_layer, step) / per_call(passes, step) for _ in range(5))
        assert ratio < 40, ratio


def test_simple_model_exact_numbers():
    m = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=1e-5, per_context=1e-6, head_const=2e-3)
    assert m.predict_layer(LayerStep(0, (10, 1), (10, 100))) == pytest.approx(1e-3 + 11e-5 + 110e-6)
    assert m.predict_decode_iteration([100]) == pytest.approx(4 * (1e-3 + 1e-5 + 1e-4) + 2e-3)


# ---------------------------------------------------------------- profile file
def test_profile_round_trip(model, tmp_path):
    path = model.save(tmp_path / "sub" / "p.json")
    doc = json.loads(path.read_text())
    for k in ("model_id", "dtype", "hardware", "threads", "created", "laser_version", "num_layers"):
        assert k in doc["metadata"], k
    loaded = FittedLatencyModel.load(path, model_id="tiny", dtype="bf16", threads=2, num_layers=30)
    assert loaded.metadata == model.metadata and loaded.num_layers == 30
    assert len(loaded.samples) == len(model.samples)
    steps = [LayerStep(0, q, c) for q, c in random_batches(np.random.default_rng(9), 30)]
    steps += [LayerStep(0, (n,), (n,)) for n in (1, 31, 33, 500, 5000)]
    for s in steps:
        assert loaded.predict_layer(s) == model.predict_layer(s)
    assert loaded.head_time(7) == model.head_time(7) and loaded.embed_time(77) == model.embed_time(77)
    refit = FittedLatencyModel.load(path, refit=True)
    for s in steps:
        assert refit.predict_layer(s) == pytest.approx(model.predict_layer(s), rel=1e-6)


def test_missing_profile_raises(tmp_path):
    with pytest.raises(LatencyProfileError, match="no latency profile"):
        FittedLatencyModel.load(tmp_path / "nope.json")


@pytest.mark.parametrize("content", ["{not json", "", '{"format": "something-else"}', "[1, 2]"])
def test_corrupt_profile_raises(tmp_path, content):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(LatencyProfileError, match="corrupt latency profile"):
        FittedLatencyModel.load(p)


def test_truncated_or_mismatched_profile_raises(model, tmp_path):
    p = model.save(tmp_path / "p.json")
    doc = json.loads(p.read_text())
    del doc["model"]["stateless"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(LatencyProfileError, match="malformed"):
        FittedLatencyModel.load(bad)
    doc = json.loads(p.read_text())
    doc["model"]["attention"]["coef"]["d_ctx"] = -1.0  # would break monotonicity
    bad.write_text(json.dumps(doc))
    with pytest.raises(LatencyProfileError, match="malformed"):
        FittedLatencyModel.load(bad)
    doc = json.loads(p.read_text())
    doc["samples"] = [1, 2]
    bad.write_text(json.dumps(doc))
    with pytest.raises(LatencyProfileError, match="malformed"):
        FittedLatencyModel.load(bad)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(LatencyProfileError, match="corrupt"):
        FittedLatencyModel.load(bad)
    doc = json.loads(p.read_text())
    doc["version"] = 999
    bad.write_text(json.dumps(doc))
    with pytest.raises(LatencyProfileError, match="version"):
        FittedLatencyModel.load(bad)
    with pytest.raises(LatencyProfileError, match="model_id"):
        FittedLatencyModel.load(p, model_id="other-model")


def test_default_profile_path(monkeypatch, tmp_path):
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))
    p = default_profile_path("HuggingFaceTB/SmolLM2-135M", "bf16", "Intel(R) Xeon(R) 8480+ (2 cpus)", 2)
    assert p.parent == tmp_path / "profiles" and p.suffix == ".json"
    assert "/" not in p.name and "SmolLM2-135M" in p.name and "t2" in p.name
    assert p != default_profile_path("HuggingFaceTB/SmolLM2-135M", "bf16", "Intel(R) Xeon(R) 8480+ (2 cpus)", 4)
    monkeypatch.delenv("LASER_CACHE_DIR")
    assert ".cache" in str(default_profile_path("m", "fp32", "cpu", 1))


# ---------------------------------------------------------------- analytic
def test_analytic_70b_decode_on_h200_is_memory_bound():
    m = AnalyticLatencyModel("llama-3-70b", "h200", tp=1)
    bd = m.breakdown((1,) * 8, (1000,) * 8)
    for mod in ("qkv", "o", "mlp_up_gate", "mlp_down", "attention"):
        assert bd[mod][1] == "memory", mod
    t = m.predict_decode_iteration([1000] * 8)
    weights_s = m.shape.num_params() * 2 / 4.8e12  # ≈ 29 ms
    assert 0.025 < weights_s < 0.033
    assert weights_s < t < 2 * weights_s
    # A long prefill is compute-bound.
    bd = m.breakdown((8192,), (8192,))
    assert bd["mlp_up_gate"][1] == "compute" and bd["attention"][1] == "compute"


def test_analytic_tensor_parallel_reduces_time():
    t1 = AnalyticLatencyModel("llama-3-70b", "h200", tp=1)
    t2 = AnalyticLatencyModel("llama-3-70b", "h200", tp=2)
    for ctx in ([1000] * 8, [4000] * 64):
        a, b = t1.predict_decode_iteration(ctx), t2.predict_decode_iteration(ctx)
        assert 0.45 * a < b < 0.8 * a
    assert t2.predict_prefill(4096) < t1.predict_prefill(4096)
    # Heads (and the KV they read) split across devices.
    long_batch = ((1,) * 64, (8000,) * 64)
    assert t2.breakdown(*long_batch)["attention"][0] == pytest.approx(t1.breakdown(*long_batch)["attention"][0] / 2)
    # Communication shows up only with tp > 1.
    assert t1.breakdown((16,), (16,))["allreduce"][0] == 0.0 < t2.breakdown((16,), (16,))["allreduce"][0]


def test_analytic_hardware_ordering_and_monotone():
    ctx = [2000] * 16
    times = [AnalyticLatencyModel("qwen2.5-32b", hw).predict_decode_iteration(ctx) for hw in ("a100-80gb", "h100-sxm", "h200")]
    assert times[0] > times[1] > times[2]
    m = AnalyticLatencyModel("qwen2.5-14b", "h100-sxm")
    prev = 0.0
    for n in range(1, 4096, 13):
        t = m.predict_layer(LayerStep(0, (n,), (n,)))
        assert t >= prev
        prev = t
    cpu = AnalyticLatencyModel("smollm2-135m", "cpu-2core")
    assert 1e-3 < cpu.predict_decode_iteration([100]) < 0.5


def test_model_shape_from_hf_config():
    cfg = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
           "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}
    assert ModelShape.from_hf_config(cfg) == ModelShape.preset("llama-3-70b")
    assert ModelShape.from_hf_config({"text_config": cfg}).head_dim == 128
    assert 69e9 < ModelShape.preset("llama-3-70b").num_params() < 72e9
    with pytest.raises(KeyError):
        ModelShape.preset("gpt-5")


def test_module_is_torch_free():
    import subprocess

    code = "import sys, laser.latency; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_predicting_from_a_saved_profile_imports_no_scipy(model, tmp_path):
    """Schedulers and the simulator load a profile and predict: that must not pay for numpy
    or scipy (only fitting imports them)."""
    import subprocess

    path = model.save(tmp_path / "p.json")
    plan = StepPlan(model.num_layers, [Work("a", 0, 300, 0, model.num_layers), Work("b", 40, 1, 0, 2)])
    want = model.predict_iteration(plan)
    code = (
        "import sys\n"
        "from laser.latency import FittedLatencyModel\n"
        "from laser.core.plan import StepPlan, Work\n"
        f"m = FittedLatencyModel.load({str(path)!r})\n"
        f"t = m.predict_iteration(StepPlan({model.num_layers}, [Work('a', 0, 300, 0, {model.num_layers}), "
        "Work('b', 40, 1, 0, 2)]))\n"
        "print(repr(t), m.layer_time((1,) * 40, tuple(range(100, 140))), m.max_tokens_within(0.01))\n"
        "bad = sorted(k for k in ('scipy', 'numpy', 'torch') if k in sys.modules)\n"
        "sys.exit(f'imported {bad}' if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[0]) == want


# ---------------------------------------------------------------- small counts, decode groups
def test_small_count_override_keeps_measured_medians():
    # Measured on the CPU: LM head 10, 20, 29, 20 ms for 1..4 rows; one decode token's
    # stateless part ~25% cheaper than two. A fit smooths these; the lookup keeps them.
    rng = np.random.default_rng(21)
    small_st = {1: 0.75e-3, 2: 1.0e-3, 3: 1.02e-3, 4: 1.05e-3}
    st = [StatelessSample(n, 1.0e-3 + 2e-6 * n) for n in (6, 8, 12, 16, 32, 64, 128, 256, 512)]
    for n, v in small_st.items():  # three repeats each: the median is kept
        st += [StatelessSample(n, v), StatelessSample(n, v * 1.04), StatelessSample(n, v * 0.97)]
    st += [StatelessSample(5, 1.08e-3)]
    small_head = {1: 10e-3, 2: 20e-3, 3: 29e-3, 4: 20e-3}
    hd = [HeadSample(r, v) for r, v in small_head.items()]
    hd += [HeadSample(r, noisy(rng, 18e-3 + 1e-4 * r)) for r in (6, 8, 12, 16, 24, 32, 48, 64)]
    m = fit(st + hd, num_layers=2)
    for n, v in small_st.items():
        assert m.stateless_time(n) == pytest.approx(v, rel=1e-12), n
    # 5 measured above 6 (1.012 ms, on the line): pooled with 4 and 6 at their median
    assert m.stateless_time(5) == m.stateless_time(6) == pytest.approx(1.05e-3, rel=1e-12)
    assert m.report["stateless"]["exact"] == 6  # 1..6 sampled consecutively (7 is not)
    for r, v in small_head.items():  # the head keeps non-monotone measurements
        assert m.head_time(r) == pytest.approx(v, rel=1e-12), r
    assert m.report["head"]["exact"] == 4
    values = [m.stateless_time(n) for n in range(0, 2000)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    # A single decode token costs its measured share, not the smoothed line's.
    assert m.layer_time((1,), (100,)) - m.attention_time((1,), (100,)) == pytest.approx(0.75e-3, rel=1e-9)
    # Round trip keeps the lookup.
    m2 = FittedLatencyModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert [m2.stateless_time(n) for n in range(8)] == [m.stateless_time(n) for n in range(8)]
    assert [m2.head_time(n) for n in range(8)] == [m.head_time(n) for n in range(8)]


def test_small_count_override_stays_non_decreasing_for_stateless():
    # Noisy small counts (2 measured below 1, 3 above the line) must not break the
    # non-decreasing guarantee that chunk-size binary searches rely on: the lookup is pooled
    # (isotonic, pools at their median) and the line past it is floored at the lookup's last value.
    st = [StatelessSample(1, 1.2e-3), StatelessSample(2, 1.0e-3), StatelessSample(3, 1.1e-3)]
    st += [StatelessSample(n, 1.0e-3 + 2e-6 * n) for n in (8, 16, 32, 64, 128, 256)]
    m = fit(st, num_layers=2)
    values = [m.stateless_time(n) for n in range(0, 600)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert m.stateless_time(1) == pytest.approx(1.1e-3)  # 1 and 2 pooled: their mean
    assert m.stateless_time(2) == pytest.approx(1.1e-3)
    assert m.stateless_time(3) == pytest.approx(1.1e-3)
    assert m.stateless.line(4) < 1.1e-3 == pytest.approx(m.stateless_time(4))  # the line is lifted to it
    assert m.stateless_time(256) == pytest.approx(1.0e-3 + 2e-6 * 256, rel=0.02)
    budget = m.layer_time((256,), (256,))
    k = m.max_tokens_within(budget)
    assert k >= 256 and m.layer_time((k,), (k,)) <= budget < m.layer_time((k + 1,), (k + 1,))
    # Without the override the old behaviour (a smooth line) is back.
    m0 = fit(st, num_layers=2, small_counts=0)
    assert m0.stateless.exact == [] and m0.stateless_time(1) == m0.stateless.line(1)


def test_one_slow_small_count_is_outvoted_not_copied_onward():
    # Measured on an AMX Xeon (SmolLM2 bf16, 1 thread; the quantized kernels up to 4 rows, a dense
    # matmul from 5): one timing of 2.89 ms at 5 tokens where 6..8 measured 1.41-1.73 ms. A running
    # max priced every count from 5 to the line's floor at 2.89 ms; pooled at the median, 1.575 ms.
    from laser.latency.fitting import isotonic_median

    small = [0.44e-3, 0.42e-3, 0.41e-3, 0.54e-3, 2.89e-3, 1.42e-3, 1.73e-3, 1.41e-3]
    assert isotonic_median(small) == pytest.approx([0.42e-3] * 3 + [0.54e-3] + [1.575e-3] * 4)
    assert isotonic_median([1.0, 2.0, 2.0, 3.0]) == [1.0, 2.0, 2.0, 3.0]  # monotone: kept as measured
    assert isotonic_median([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    for seed in range(20):  # always non-decreasing
        v = isotonic_median(list(np.random.default_rng(seed).random(9)))
        assert all(b >= a for a, b in zip(v, v[1:]))
    st = [StatelessSample(n, v) for n, v in enumerate(small, start=1)]
    st += [StatelessSample(n, 1.4e-3 + 1e-5 * n) for n in (9, 10, 12, 16, 24, 32, 48, 64, 128, 256, 512)]
    m = fit(st, num_layers=2)
    assert m.stateless_time(5) == m.stateless_time(8) == pytest.approx(1.575e-3)
    assert m.stateless_time(12) < 1.6e-3  # not floored at the slow timing
    values = [m.stateless_time(n) for n in range(0, 600)]
    assert all(b >= a for a, b in zip(values, values[1:]))


def test_gather_positions_from_profile_metadata():
    from laser.latency import gather_positions_from_metadata, max_gather_positions

    meta = {"shape": "llama-h576-i1536-L30-q9-kv3-d64-v49152", "dtype": "float32"}
    assert gather_positions_from_metadata(meta) == (16 << 20) // 768 == max_gather_positions(3, 64, 4)
    assert gather_positions_from_metadata({**meta, "dtype": "bfloat16"}) == (16 << 20) // 384
    assert gather_positions_from_metadata({**meta, "max_gather_positions": 100}) == 100
    assert gather_positions_from_metadata({"model_id": "tiny", "dtype": "bf16"}) == 0
    assert gather_positions_from_metadata(None) == 0


def test_decode_attention_is_priced_per_runner_group():
    from laser.latency import AttentionModel, decode_groups

    g = 1000
    assert decode_groups([10] * 5, g) == [(5, 10)]
    # Sorted ascending, consecutive while (size + 1) * c <= g.
    assert decode_groups([300, 100, 100, 200, 250], g) == [(4, 250), (1, 300)]
    assert decode_groups([300, 100, 100, 200, 260], g) == [(3, 200), (2, 300)]
    assert decode_groups([300, 100, 100], 0) == [(3, 300)]
    coef = {"d_groups": 1.0, "d_seqs": 0.1, "d_ctx": 0.01, "d_pad": 0.001, "m_const": 2.0, "m_tokens": 0.2}
    mdl = AttentionModel("kernel", coef, max_gather_positions=g)
    c = (300, 100, 100, 200, 250)
    want = 2 * 1.0 + 5 * 0.1 + 950 * 0.01 + (4 * 250 + 300) * 0.001
    assert mdl((1,) * 5, c) == pytest.approx(want, rel=1e-12)
    assert mdl((1,) * 5 + (40,), c + (60,)) == pytest.approx(want + 2.0 + 40 * 0.2, rel=1e-12)
    assert AttentionModel.from_dict(json.loads(json.dumps(mdl.to_dict())))((1,) * 5, c) == mdl((1,) * 5, c)
    # One group (fits): the plain padded formula.
    assert mdl((1, 1), (100, 400)) == pytest.approx(1.0 + 0.2 + 5.0 + 0.8, rel=1e-12)


def test_decode_groups_mirror_the_runner():
    """The runner's decode kernel groups are the groups the latency model prices: one rule
    (``laser.latency.features.decode_slices``) and one limit, for random contexts and limits."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from laser.latency import DEFAULT_MAX_GATHER_BYTES, decode_groups, max_gather_positions
    from laser.model.runner import ModelRunner

    assert ModelRunner.max_gather_bytes == DEFAULT_MAX_GATHER_BYTES
    rng = np.random.default_rng(9)
    for kv_heads, head_dim, nbytes, limit in [(3, 64, 4, DEFAULT_MAX_GATHER_BYTES), (3, 64, 2, DEFAULT_MAX_GATHER_BYTES),
                                              (2, 16, 4, 1 << 16), (2, 16, 4, 1000), (2, 16, 4, 1)]:
        fake = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim)),
                               kv_cache=SimpleNamespace(kv=SimpleNamespace(element_size=lambda n=nbytes: n)),
                               max_gather_bytes=limit)
        g = max_gather_positions(kv_heads, head_dim, nbytes, limit)
        per_pos = kv_heads * head_dim * nbytes
        for _ in range(150):
            ctx = [int(x) for x in rng.integers(1, 4096, int(rng.integers(1, 96)))]
            rows = sorted(range(len(ctx)), key=lambda i: ctx[i])  # the runner's decode order
            active = [SimpleNamespace(context_len=x) for x in ctx]
            parts = ModelRunner._split_decode(fake, active, rows)
            assert [i for p in parts for i in p] == rows
            assert [(len(p), ctx[p[-1]]) for p in parts] == decode_groups(ctx, g)
            for p in parts:  # each group's padded gather fits, or it is one row
                assert len(p) == 1 or len(p) * ctx[p[-1]] * per_pos <= limit


# ---------------------------------------------------------------- model forms (issue 26)
def padded_truth(q, c):
    """What the runner's decode kernel costs: per group, per row, and per padded position
    (``|g| x max_g c``), not per cached token; prefill entries as the paper's line."""
    f = dict(zip(ATTENTION_FEATURES, attention_features(q, c)))
    return (3e-5 * f["d_groups"] + 5e-6 * f["d_seqs"] + 5e-8 * f["d_pad"]
            + sum(v * f[k] for k, v in P_COEF.items()))


def low_skew_batches(rng, count):
    """Decode batches as a profile grid samples them: contexts within [m/4, 7m/4] of a mean m
    (B x max c and sum c move together there), plus prefill chunks."""
    out = []
    for i in range(count):
        b = int(rng.integers(1, 64))
        m = int(rng.choice([64, 256, 512, 2048]))
        c = tuple(int(x) for x in rng.integers(max(2, m // 4), m * 7 // 4, b))
        out.append(((1,) * b, c))
        qi = int(rng.integers(16, 512))
        out.append(((qi,), (qi + int(rng.integers(0, 2 * qi)),)))
    return out


def test_padded_form_prices_the_padded_decode_gather():
    """Fitted on batches as a profile grid samples them (sum c and B x max c move together),
    the padded form prices what the kernel gathers, also on a skewed batch -- one long
    context pads every row -- where the paper's sum c would be far off."""
    rng = np.random.default_rng(11)
    samples = [AttentionSample(q, c, noisy(rng, padded_truth(q, c))) for q, c in low_skew_batches(rng, 150)]
    padded = fit(samples, num_layers=2, form="padded")
    paper = fit(samples, num_layers=2, form="paper")
    assert padded.attention.feature_set == "padded", padded.report["attention"]["cv_error"]
    assert padded.report["form"] == "padded" and paper.report["form"] == "paper"
    skewed = [((1,) * b, (4000,) * k + (50,) * (b - k)) for b, k in ((8, 1), (32, 2), (48, 6), (16, 4))]
    for q, c in skewed:
        assert padded.attention_time(q, c) == pytest.approx(padded_truth(q, c), rel=0.05)
    assert padded.attention.coef["d_ctx"] == 0.0 and padded.attention.coef["d_pad"] == pytest.approx(5e-8, rel=0.1)
    # the form survives a save/load/refit round trip
    assert FittedLatencyModel.from_dict(json.loads(json.dumps(padded.to_dict()))).refit().report["form"] == "padded"


def test_small_count_form_keeps_measured_values_up_to_16():
    # with two threads small matmuls do not follow a line (fork/join): 9..16 keep what was measured
    rng = np.random.default_rng(12)
    truth = {n: 1e-4 + 2e-6 * n + (3e-5 if n % 2 else 0.0) for n in range(1, 257)}
    samples = [StatelessSample(n, t) for n, t in truth.items()]
    m16 = fit(samples, num_layers=2, form="padded-small16")
    m8 = fit(samples, num_layers=2, form="padded")
    from laser.latency.fitting import isotonic_median

    kept = isotonic_median([truth[k] for k in range(1, 17)])  # what was measured, made non-decreasing
    for n in range(1, 17):
        assert m16.stateless_time(n) == pytest.approx(kept[n - 1], rel=1e-9), n
    assert m8.report["stateless"]["exact"] == 8 and m16.report["stateless"]["exact"] == 16


def test_unknown_form_is_an_error():
    with pytest.raises(ValueError, match="unknown model form"):
        fit([StatelessSample(1, 1e-3)], num_layers=1, form="nope")
