"""The "convex" form (the default before "tiled", which keeps it): decode attention whose cost per position grows with the
group's gather, and stateless / LM-head lines that keep a segment edge where the kernels switch."""

import json

import numpy as np
import pytest

from laser.latency import (
    ATTENTION_FEATURES,
    AttentionSample,
    FittedLatencyModel,
    HeadSample,
    StatelessSample,
    attention_features,
    fit,
)
from laser.latency.features import ATTENTION_FEATURE_SETS, decode_groups, kernel_rows_from_metadata
from laser.latency.fitting import DEFAULT_FORM, FORMS, _fit_count_function

G = 43690  # SmolLM2 bf16: positions of one 16 MiB decode gather


def convex_truth(q, c):
    """Decode attention as measured on an AVX512 EPYC (bf16 SmolLM2): per group 30 us, per row
    5 us, per padded position 0.15 us plus 7e-12 s x positions² (~0.2 us per position at 5k
    positions, ~0.45 us at 40k)."""
    groups = decode_groups(c, G)
    return sum(3e-5 + 5e-6 * k + 1.5e-7 * k * m + 7e-12 * (k * m) ** 2 for k, m in groups)


def decode_batches(rng, count):
    out = []
    for _ in range(count):
        b = int(rng.integers(1, 65))
        m = int(rng.choice([32, 256, 512, 2048]))
        out.append(((1,) * b, tuple(int(x) for x in rng.integers(max(2, m // 4), m * 7 // 4, b))))
    return out


def noisy(rng, t, sd=0.01):
    return float(t * (1 + sd * rng.standard_normal()))


def test_d_pad2_is_the_square_of_each_groups_gather():
    f = dict(zip(ATTENTION_FEATURES, attention_features((1,) * 3, (10, 20, 40), 0)))
    assert f["d_pad"] == 120 and f["d_pad2"] == 120 ** 2
    g = dict(zip(ATTENTION_FEATURES, attention_features((1,) * 4, (100, 100, 1000, 1000), 2000)))
    assert g["d_groups"] == 2 and g["d_pad2"] == 200 ** 2 + 2000 ** 2


def test_convex_form_prices_a_gather_that_outgrows_the_caches():
    rng = np.random.default_rng(5)
    samples = [AttentionSample(q, c, noisy(rng, convex_truth(q, c))) for q, c in decode_batches(rng, 120)]
    meta = {"max_gather_positions": G}
    # the default ("tiled") keeps the convex decode terms
    assert "tiled" in FORMS[DEFAULT_FORM]["sets"] and "d_pad2" in ATTENTION_FEATURE_SETS["tiled"]
    convex = fit(samples, num_layers=2, metadata=meta, form="convex")
    padded = fit(samples, num_layers=2, metadata=meta, form="padded")
    assert convex.attention.feature_set in ("convex", "full"), convex.report["attention"]["cv_error"]
    held_out = decode_batches(np.random.default_rng(6), 40) + [((1,) * 64, (3000,) * 64), ((1,) * 2, (20, 30))]
    for q, c in held_out:  # the fast decode path and the feature path agree with the truth
        assert convex.attention_time(q, c) == pytest.approx(convex_truth(q, c), rel=0.05), (len(q), max(c))
    worst = max(abs(padded.attention_time(q, c) / convex_truth(q, c) - 1) for q, c in held_out)
    assert worst > 0.15  # what the form before it missed
    back = FittedLatencyModel.from_dict(json.loads(json.dumps(convex.to_dict())))
    assert back.attention_time(*held_out[0]) == convex.attention_time(*held_out[0])
    assert back.refit().report["form"] == "convex"


def test_kernel_rows_from_metadata():
    assert kernel_rows_from_metadata({"kernel_rows": {"stateless": [64], "head": []}}) == {"stateless": (64,),
                                                                                           "head": ()}
    old = kernel_rows_from_metadata({"model_id": "llama-h576-L30-kv3-d64-v49152-int4-int8", "dtype": "bfloat16"})
    assert old == {"stateless": (32, 64), "head": (32, 64)}  # profiles before version 8: the union
    assert kernel_rows_from_metadata({"model_id": "llama-h64", "dtype": "bfloat16"}) == {}


def kinked(n):
    """int4 weights: a weight-only kernel whose time grows per row up to 64 rows, then a dense
    matmul after dequantizing the weight (a fixed cost, a flatter slope)."""
    return 7e-5 * n if n <= 64 else 4.5e-3 + 2.5e-5 * n


def test_a_kernel_switch_is_a_segment_edge():
    n = np.array([*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024])
    y = np.array([kinked(int(k)) for k in n])
    plain, rep0 = _fit_count_function(n, y, (128,), 5, exact=8)
    edged, rep = _fit_count_function(n, y, (128,), 5, exact=8, breaks=(64,))
    assert rep["width"] not in ("linear", 128) and 64 % rep["width"] == 0, rep
    for k in (65, 70, 80, 100):
        assert edged(k) == pytest.approx(kinked(k), rel=0.05), k
    assert max(abs(plain(k) / kinked(k) - 1) for k in (65, 70, 80, 100)) > 0.1, rep0


def test_lm_head_with_few_samples_keeps_its_kernel_switch():
    """An int8 LM head: a compiled GEMV up to 32 rows (~0.8 ms a row), then the weight
    dequantized on every call (~110 ms). With one sample dropped (9 past the small-count
    lookup) the fit before this fell back to a plain line (24 % off on the held-out head rows
    of an AVX512 EPYC at two threads); with the switch known it keeps the step."""
    def head(r):
        return 8e-4 * r if r <= 32 else 0.11

    rows = [1, 2, 3, 4, 6, 8, 12, 24, 32, 48, 64, 96, 128]
    meta = {"kernel_rows": {"stateless": [], "head": [32]}}
    m = fit([HeadSample(r, head(r)) for r in rows] + [StatelessSample(1, 1e-4), StatelessSample(2, 2e-4)],
            num_layers=2, metadata=meta)
    for r in (16, 20, 28, 40, 53, 61):
        assert m.head_time(r) == pytest.approx(head(r), rel=0.08), r
