"""The quantized kernels' row crossover per CPU kind (laser.model.kernel_rows): the decision
from timings, the on-disk cache, the dense copies past the crossover, and the latency-profile key.
No timing is asserted: the measurement is replaced by fixed answers."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from laser.model import kernel_rows
from laser.model.kernel_rows import choose_kernel_rows, pick_crossover, rows_label
from laser.model.quant import QuantLinear, quantize_int4, quantize_int8

ROWS = (1, 2, 4, 8, 16, 32, 64)


def rand(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_pick_crossover_needs_two_dense_wins_in_a_row():
    kernel = {m: 10.0 * m for m in ROWS}  # compute-bound kernel: time grows with every row
    dense = {m: 80.0 + m for m in ROWS}   # dense: flat until the matmul fills the machine
    assert pick_crossover(kernel, dense, 64) == 8  # dense wins from 16 rows (96 < 0.9 * 160)
    noisy = {**dense, 2: 1.0}  # one lucky dense timing at 2 rows does not move it
    assert pick_crossover(kernel, noisy, 64) == 8
    assert pick_crossover(kernel, {m: 1.0 for m in ROWS}, 64) == 0  # dense wins from one row
    assert pick_crossover(kernel, {m: 1e9 for m in ROWS}, 64) == 64  # never: the last row count
    assert pick_crossover(kernel, {m: 1e9 for m in ROWS}, 32) == 32  # capped at the default
    assert pick_crossover(kernel, {**{m: 1e9 for m in ROWS}, 64: 1.0}, 64) == 32  # the last one wins alone


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Crossovers 'measured' as 8 rows for int4 and 32 (the default) for int8, cached under tmp."""
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LASER_QUANT_ROWS", "measure")
    calls = []

    def fake(lin, dtype, repeats=5):
        calls.append(lin.qw.shape)
        return 8 if lin.qw.kind == "int4" else 32

    monkeypatch.setattr(kernel_rows, "measure_crossover", fake)
    return calls


def test_measured_crossover_keeps_a_dense_copy_and_is_cached(measured, tmp_path, monkeypatch):
    lins = [QuantLinear(quantize_int4(rand(96, 128, s))) for s in range(2)] + [QuantLinear(quantize_int8(rand(64, 128)))]
    msg = choose_kernel_rows(lins, torch.float32)
    assert measured == [(96, 128), (64, 128)]  # once per shape and kind
    assert [lin.kernel_max_rows for lin in lins] == [8, 8, 32]
    assert lins[0].dense is not None and lins[2].dense is None  # a copy only below the default
    assert "int4 up to 8" in msg and "measured on this CPU for 2 weight shapes" in msg
    assert f"+{2 * 96 * 128 * 4 / 1e6:.0f} MB" in msg
    assert rows_label(lins) == "int4r8"
    cached = json.loads((tmp_path / "quant_rows.json").read_text())
    assert sorted(cached.values()) == [8, 32]
    # rows past the crossover run the dense copy: the same math as the kernel to float rounding,
    # and the same result as dequantizing on the fly (the copy is that weight)
    x = rand(12, 128, 9)
    ref = x.bfloat16().float() @ lins[0].dense_weight(torch.float32).t()
    torch.testing.assert_close(lins[0](x), ref, rtol=1e-2, atol=2e-2 * float(ref.abs().max()) / 64)
    fresh = QuantLinear(lins[0].qw)
    fresh.kernel_max_rows = 8
    assert torch.equal(lins[0](x), fresh(x))
    # a later start reads the cache instead of measuring
    again = [QuantLinear(quantize_int4(rand(96, 128, 3)))]
    assert "read from the cache" in choose_kernel_rows(again, torch.float32)
    assert len(measured) == 2 and again[0].kernel_max_rows == 8


def test_fixed_rows_keep_the_defaults(measured, monkeypatch):
    monkeypatch.setenv("LASER_QUANT_ROWS", "fixed")
    lins = [QuantLinear(quantize_int4(rand(96, 128)))]
    assert "fixed defaults" in choose_kernel_rows(lins, torch.float32)
    assert not measured and lins[0].kernel_max_rows == 64 and lins[0].dense is None
    assert rows_label(lins) == ""
    monkeypatch.setenv("LASER_QUANT_ROWS", "bogus")
    with pytest.raises(ValueError, match="LASER_QUANT_ROWS"):
        choose_kernel_rows(lins, torch.float32)


def test_a_measured_crossover_is_another_executor_path(tiny_llama, measured, caplog):
    """The latency profile is keyed by the executor path: a model whose int4 kernels stop at 8
    rows is another machine to the latency model than one at the default 64, and the startup log
    says which crossover it chose."""
    from laser.model.llama import LlamaModel
    from laser.model.loader import load_config, load_quantized, load_weights

    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    q = load_quantized(str(tiny_llama), cfg, weights, "int4")
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        model = LlamaModel(cfg, weights, torch.float32, q)
    assert getattr(model, "executor_path", None) == "int4r8"
    assert "quantized decode rows through the kernels: int4 up to 8" in caplog.text


def test_dense_layout_switch(monkeypatch):
    monkeypatch.setenv("LASER_QUANT_DENSE", "plain")
    assert kernel_rows.dense_layout() == "plain"
    monkeypatch.setenv("LASER_QUANT_DENSE", "packed")
    assert kernel_rows.dense_layout() == "packed"
    monkeypatch.delenv("LASER_QUANT_DENSE")  # auto: packed exactly where torch sees AMX tiles
    assert kernel_rows.dense_layout() == ("packed" if torch.cpu._is_amx_tile_supported() else "plain")
    monkeypatch.setenv("LASER_QUANT_DENSE", "bogus")
    with pytest.raises(ValueError, match="LASER_QUANT_DENSE"):
        kernel_rows.dense_layout()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN runs no bf16 matmuls here")
def test_packed_dense_copy_past_the_crossover(measured, tmp_path, monkeypatch):
    """bf16 with ``LASER_QUANT_DENSE=packed`` (the AMX kind's default): the copy past the crossover is
    a oneDNN-packed Linear holding 2 bytes a weight, its rows agree with the plain copy's to bf16
    rounding and do not depend on the other rows, the executor path says ``dpk``, and its crossover
    is cached apart from the plain layout's. fp32 keeps the plain copy."""
    from laser.model.linear import Linear

    monkeypatch.setenv("LASER_QUANT_DENSE", "packed")
    lins = [QuantLinear(quantize_int4(rand(96, 128, 5)))]
    msg = choose_kernel_rows(lins, torch.bfloat16)
    assert isinstance(lins[0].dense, Linear) and lins[0].kernel_max_rows == 8
    assert "oneDNN-packed" in msg and f"+{96 * 128 * 2 / 1e6:.0f} MB" in msg
    assert rows_label(lins) == "int4r8-dpk"
    x = rand(12, 128, 9).bfloat16()
    plain = lins[0].dense_weight(torch.bfloat16)
    torch.testing.assert_close(lins[0](x).float(), (x @ plain.t()).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(lins[0](x)[5:6], lins[0](torch.cat([x[5:6]] * 9))[:1])  # 9 rows: the dense path
    monkeypatch.setenv("LASER_QUANT_DENSE", "plain")
    again = [QuantLinear(quantize_int4(rand(96, 128, 6)))]
    assert "measured on this CPU for 1 weight shapes" in choose_kernel_rows(again, torch.bfloat16)
    assert isinstance(again[0].dense, torch.Tensor) and rows_label(again) == "int4r8"
    monkeypatch.setenv("LASER_QUANT_DENSE", "packed")
    fp32 = [QuantLinear(quantize_int4(rand(96, 128, 7)))]
    choose_kernel_rows(fp32, torch.float32)
    assert isinstance(fp32[0].dense, torch.Tensor)
    # a packed copy never takes rows from the kernel below PACKED_MIN_ROWS (a cached 2 included);
    # the plain copy keeps what was measured
    monkeypatch.setattr(kernel_rows, "measure_crossover", lambda lin, dtype, repeats=5: 2)
    low = [QuantLinear(quantize_int4(rand(64, 256, 8)))]
    choose_kernel_rows(low, torch.bfloat16)
    assert low[0].kernel_max_rows == kernel_rows.PACKED_MIN_ROWS == 8
    monkeypatch.setenv("LASER_QUANT_DENSE", "plain")
    low = [QuantLinear(quantize_int4(rand(64, 256, 8)))]
    choose_kernel_rows(low, torch.bfloat16)
    assert low[0].kernel_max_rows == 2
