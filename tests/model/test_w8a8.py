"""W8A8 decode rows for int8 weights (laser.model.w8a8 through QuantLinear): per-row activation
scales keep a row's result independent of its batch, the result is the dequantized weight's to
8-bit activation rounding, the switch, the per-CPU choice and the executor path. Tiny random
weights; no timing is asserted (the measurement is replaced by fixed answers)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from laser.model import kernel_rows, w8a8
from laser.model.kernel_rows import choose_kernel_rows, rows_label
from laser.model.quant import QuantLinear, quantize_int4, quantize_int8

needs_w8a8 = pytest.mark.skipif(not w8a8.available(), reason="no oneDNN quantized linear in this torch, or no VNNI")


def rand(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@needs_w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_rows_are_batch_invariant_and_match_the_dequantized_weight(monkeypatch, dtype):
    monkeypatch.setenv("LASER_QUANT_W8A8", "on")
    w, b = rand(96, 160, 1), torch.randn(96)
    lin = QuantLinear(quantize_int8(w), b)
    assert lin.w8a8 is not None and lin.w8a8_min_rows == 1 and lin.path == "aten+w8a8r1"
    x = (rand(40, 160, 2) * torch.linspace(0.1, 10, 40)[:, None]).to(dtype)  # rows of very different scale
    x[7] = 0  # an all-zero row stays zero
    rows = torch.cat([lin(x[i : i + 1]) for i in range(32)])
    for a, n in ((0, 4), (3, 5), (0, 32), (6, 3)):
        assert torch.equal(lin(x[a : a + n]), rows[a : a + n]), (a, n)
    assert torch.equal(rows[7].float(), b)
    ref = x[:32].float() @ lin.dense_weight(torch.float32).t() + b
    # the activations lose to 8 bits per row: |error| <= sum_k |w| * s / 2, well within 2 % of the scale
    err = (rows.float() - ref).abs().amax(dim=1)
    assert bool((err <= 0.02 * ref.abs().amax(dim=1) + 0.02).all()), err


def test_switch_off_and_int4_stay_weight_only(monkeypatch):
    monkeypatch.delenv("LASER_QUANT_W8A8", raising=False)
    assert w8a8.w8a8_mode() == "off"  # opt-in: it cost greedy agreement (docs/benchmarks.md)
    monkeypatch.setenv("LASER_QUANT_W8A8", "off")
    lin = QuantLinear(quantize_int8(rand(32, 64)))
    assert lin.w8a8 is None and lin.path == "aten"
    monkeypatch.setenv("LASER_QUANT_W8A8", "on")
    assert QuantLinear(quantize_int4(rand(32, 64))).w8a8 is None  # int4 weights: no W8A8
    monkeypatch.setenv("LASER_QUANT_W8A8", "bogus")
    with pytest.raises(ValueError, match="LASER_QUANT_W8A8"):
        QuantLinear(quantize_int8(rand(32, 64)))
    with pytest.raises(ValueError, match="int8"):
        QuantLinear(quantize_int4(rand(32, 64))).use_w8a8(1)


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """W8A8 'measured' to win from 4 rows, crossovers at the default; cached under tmp."""
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LASER_QUANT_ROWS", "measure")
    monkeypatch.setenv("LASER_QUANT_W8A8", "measure")
    calls = []

    def fake_w8a8(lin, dtype, repeats=5):
        calls.append(lin.qw.shape)
        lin.use_w8a8(4)
        return 4

    monkeypatch.setattr(kernel_rows, "measure_w8a8", fake_w8a8)
    monkeypatch.setattr(kernel_rows, "measure_crossover", lambda lin, dtype: QuantLinear.KERNEL_MAX_ROWS[lin.qw.kind])
    return calls


@needs_w8a8
def test_measured_w8a8_rows_are_cached_and_labelled(measured, tmp_path):
    lins = [QuantLinear(quantize_int8(rand(64, 128, s))) for s in range(2)] + [QuantLinear(quantize_int4(rand(64, 128)))]
    msg = choose_kernel_rows(lins, torch.float32)
    assert measured == [(64, 128)]  # once per int8 shape
    assert [lin.w8a8_min_rows for lin in lins] == [4, 4, w8a8.OFF]
    assert "int8 from 4 rows as W8A8" in msg
    assert rows_label(lins) == "w8a8r4"
    cached = json.loads((tmp_path / "quant_rows.json").read_text())
    assert sorted(v for k, v in cached.items() if "|w8a8|" in k) == [4]
    # below the W8A8 rows the weight-only kernel runs: bit-equal to a weight-only copy
    plain = QuantLinear(lins[0].qw)
    x = rand(6, 128, 3)
    assert torch.equal(lins[0](x[:3]), plain(x[:3])) and not torch.equal(lins[0](x), plain(x))
    again = [QuantLinear(quantize_int8(rand(64, 128, 5)))]
    assert "read from the cache" in choose_kernel_rows(again, torch.float32)
    assert len(measured) == 1 and again[0].w8a8_min_rows == 4


@needs_w8a8
def test_w8a8_head_is_another_executor_path_and_batch_invariant(tiny_llama, monkeypatch, caplog):
    """A model whose int8 head runs W8A8 is another machine to the latency model, and a row's
    logits do not depend on its batch."""
    from laser.model.llama import LlamaModel
    from laser.model.loader import load_config, load_weights

    monkeypatch.setenv("LASER_QUANT_W8A8", "on")
    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        model = LlamaModel(cfg, weights, torch.float32, {"lm_head.weight": quantize_int8(weights["model.embed_tokens.weight"])})
    assert model.executor_path == "w8a8r1"
    h = rand(6, cfg.hidden_size, 7)
    with torch.inference_mode():
        together = model.compute_logits(h)
        alone = torch.cat([model.compute_logits(h[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)


def test_without_vnni_w8a8_is_refused_and_int8_stays_weight_only(monkeypatch, caplog):
    """Without VNNI oneDNN's u8 x s8 products saturate at int16 (AVX2's vpmaddubsw): W8A8 is not
    available there, and ``on`` keeps int8 weights weight-only with one warning."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert not w8a8.available()
    monkeypatch.setenv("LASER_QUANT_W8A8", "on")
    monkeypatch.setattr("laser.model.quant._WARNED", set())
    with caplog.at_level(logging.WARNING, logger="laser.model.quant"):
        lins = [QuantLinear(quantize_int8(rand(32, 64, s))) for s in range(3)]
    assert all(lin.w8a8 is None and lin.path == "aten" for lin in lins)
    assert caplog.text.count("LASER_QUANT_W8A8=on ignored: no VNNI") == 1
    x = rand(4, 64, 9)
    torch.testing.assert_close(lins[0](x), x @ lins[0].dense_weight(torch.float32).t(), rtol=0.02, atol=0.05)
