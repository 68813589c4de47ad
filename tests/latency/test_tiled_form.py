"""The "tiled" form (the default): causal prefill attention priced per query block of the flash
kernel (``CAUSAL_Q_TILES``), and the profile grid that samples chunk lengths on both sides of them."""

import json

import numpy as np
import pytest

from laser import profiler
from laser.latency import (ATTENTION_FEATURE_SETS, ATTENTION_FEATURES, AttentionSample, FittedLatencyModel,
                           attention_features, fit)
from laser.latency.features import CAUSAL_Q_TILES
from laser.latency.fitting import DEFAULT_FORM, FORMS
from laser.profiler.grid import CAUSAL_GRID


def causal_truth(q: int) -> float:
    """A causal chunk as torch's CPU flash attention runs it on an AVX512 EPYC (bf16 SmolLM2, one
    thread): 40 us + 1 us per token, then per score 4.0e-8 s with 32-row query blocks, 3.7e-8 s with
    64-row blocks, 2.0e-8 s with 256-row blocks (measured 3.7e-5 ms per q² at 256-420 tokens,
    2.4e-5 at 1024, 1.9e-5 at 2048)."""
    per = 4.0e-8 if q < CAUSAL_Q_TILES[0] else (3.7e-8 if q < CAUSAL_Q_TILES[1] else 2.0e-8)
    return 4e-5 + 1e-6 * q + per * q * q


def samples(rng, lengths):
    out = [AttentionSample((q,), (q,), causal_truth(q) * (1 + 0.01 * rng.standard_normal())) for q in lengths]
    for _ in range(30):  # chunks after cached context (the masked path): a line in the features
        q = int(rng.integers(16, 1024))
        c = q + int(rng.integers(1, 2 * q))
        out.append(AttentionSample((q,), (c,), 5e-5 + 1e-6 * q + 2e-8 * q * c))
    return out


def grid_lengths():
    g = profiler.ProfileGrid.default(max_tokens=2048, max_context=4096)
    return sorted({q[0] for q, c in g.attention_batches if len(q) == 1 and q == c and q[0] > 1})


def test_causal_tiles_name_the_query_block():
    f = lambda q: dict(zip(ATTENTION_FEATURES, attention_features((q,), (q,))))  # noqa: E731
    assert (f(191)["c_sq32"], f(191)["c_sq64"]) == (191 ** 2, 0)
    assert (f(192)["c_sq32"], f(192)["c_sq64"], f(767)["c_sq64"]) == (0, 192 ** 2, 767 ** 2)
    assert (f(768)["c_sq256"], f(768)["c_square"]) == (768 ** 2, 768 ** 2)
    cached = dict(zip(ATTENTION_FEATURES, attention_features((300,), (500,))))
    assert cached["c_sq32"] == cached["c_sq64"] == cached["c_sq256"] == 0 and cached["m_pad"] == 300 * 500


def test_the_grid_samples_chunks_around_the_tile_edges():
    lengths = grid_lengths()
    for e in CAUSAL_Q_TILES:
        assert {e - 1, e} <= set(lengths)
    assert len([q for q in lengths if CAUSAL_Q_TILES[0] <= q < CAUSAL_Q_TILES[1]]) >= 6
    assert set(CAUSAL_GRID) <= set(lengths)


def test_tiled_form_prices_causal_chunks_per_query_block():
    rng = np.random.default_rng(3)
    data = samples(rng, grid_lengths())
    # (the default offers "tiled", and "chunked" before it, which prices whole prompts by the same tiles)
    assert "tiled" in FORMS[DEFAULT_FORM]["sets"]
    assert {"c_sq32", "c_sq64", "c_sq256"} <= set(ATTENTION_FEATURE_SETS["chunked"])
    tiled = fit(data, num_layers=2, form="tiled")
    convex = fit(data, num_layers=2, form="convex")
    assert tiled.attention.feature_set == "tiled", tiled.report["attention"]["cv_error"]
    held_out = [100, 200, 283, 407, 420, 610, 700, 900, 1312, 1700]
    for q in held_out:
        assert tiled.attention_time((q,), (q,)) == pytest.approx(causal_truth(q), rel=0.04), q
    # one quadratic for every chunk length (the form before) misses the middle block by far more
    worst = max(abs(convex.attention_time((q,), (q,)) / causal_truth(q) - 1) for q in held_out)
    assert worst > 0.10
    back = FittedLatencyModel.from_dict(json.loads(json.dumps(tiled.to_dict())))
    assert back.attention_time((610,), (610,)) == tiled.attention_time((610,), (610,))
    assert back.refit().report["form"] == "tiled"
