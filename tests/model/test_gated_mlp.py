"""The bf16 MLP's SiLU(gate) * up in the epilogues of two oneDNN matmuls (laser.model.linear.GatedLinear):
the same activation as the stacked matmul and a separate SiLU * up within bf16 rounding at every row
count, a row's result independent of the rows beside it, the int4 gate/up's dense copy past its
crossover (laser.model.kernel_rows.gated_dense_copy), the model's layer, executor path and log, fp32
untouched, and the switch ``LASER_GATED_MLP``."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from laser.model import kernel_rows
from laser.model.linear import GatedLinear, Linear, gated_linear, gated_mode, pack_for_onednn, swiglu_of
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_weights
from laser.model.quant import QuantLinear, quantize_int4

needs_bf16 = pytest.mark.skipif(pack_for_onednn(torch.ones(4, 4, dtype=torch.bfloat16), 1) is None,
                                reason="oneDNN does not run bf16 matmuls on this CPU")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in fp32 from the bf16 ``x`` [M, K] and stacked ``w`` [2 I, K]."""
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    return F.silu(gate) * up


def close(a, ref):
    """Within bf16 rounding of the gate activation and the product (values ~1-10)."""
    return torch.allclose(a.float(), ref, atol=0.08, rtol=0.02), float((a.float() - ref).abs().max())


@needs_bf16
def test_gated_linear_matches_the_stacked_matmul_at_every_row_count(monkeypatch):
    monkeypatch.setenv("LASER_GATED_MLP", "on")
    gen = torch.Generator().manual_seed(3)
    w = (0.2 * torch.randn(96, 40, generator=gen)).bfloat16()  # I = 48
    lin = gated_linear(w)
    assert isinstance(lin, GatedLinear) and lin.shape == (96, 40) and lin.numel() == w.numel()
    for rows in (1, 3, 64, 200):
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        ref = reference(x, w)
        y = lin.swiglu(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
        ok, err = close(y, ref)
        assert ok, (rows, err)
        assert torch.equal(lin.swiglu(x[:1]), y[:1])  # a row alone as in a batch
        assert torch.equal(swiglu_of(lin, x), y)
        # the stacked outputs, for callers that want gate | up
        stacked = lin(x)
        torch.testing.assert_close(stacked.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)


def test_switch_and_what_declines(monkeypatch):
    monkeypatch.delenv("LASER_GATED_MLP", raising=False)  # auto: on exactly where torch sees AMX tiles
    assert gated_mode() == ("on" if torch.cpu._is_amx_tile_supported() else "off")
    monkeypatch.setenv("LASER_GATED_MLP", "off")
    assert gated_mode() == "off" and gated_linear(torch.ones(8, 4, dtype=torch.bfloat16)) is None
    monkeypatch.setenv("LASER_GATED_MLP", "on")
    assert gated_linear(torch.ones(8, 4)) is None  # fp32 keeps its Linear (the exactness tests' path)
    lin = Linear(torch.ones(8, 4))
    assert swiglu_of(lin, torch.ones(2, 4)) is None
    monkeypatch.setenv("LASER_GATED_MLP", "yes")
    with pytest.raises(ValueError, match="LASER_GATED_MLP"):
        gated_mode()


@needs_bf16
def test_int4_gate_up_dense_copy_past_the_crossover(monkeypatch):
    monkeypatch.setenv("LASER_GATED_MLP", "on")
    monkeypatch.setenv("LASER_QUANT_DENSE", "packed")
    gen = torch.Generator().manual_seed(4)
    lin = QuantLinear(quantize_int4(torch.randn(96, 128, generator=gen)))
    lin.kernel_max_rows = 8
    lin.dense = kernel_rows.dense_copy(lin, torch.bfloat16)
    kernel_rows.gated_dense_copy(lin, torch.bfloat16)
    assert isinstance(lin.dense, GatedLinear) and kernel_rows.dense_nbytes(lin.dense) == 96 * 128 * 2
    w = lin.dense_weight(torch.bfloat16)
    x = torch.randn(12, 128, generator=gen).bfloat16()
    y = swiglu_of(lin, x)  # 12 rows: past the crossover
    ok, err = close(y, reference(x, w))
    assert ok, err
    assert swiglu_of(lin, x[:8]) is None  # the kernel's rows: the caller runs lin(x) and the activation
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)
    fp32 = QuantLinear(quantize_int4(torch.randn(96, 128, generator=gen)))
    fp32.dense = kernel_rows.dense_copy(fp32, torch.float32)
    kernel_rows.gated_dense_copy(fp32, torch.float32)
    assert isinstance(fp32.dense, torch.Tensor)


@needs_bf16
def test_model_layer_path_and_log(tiny_llama, monkeypatch, caplog):
    def build(mode, dtype=torch.bfloat16):
        monkeypatch.setenv("LASER_GATED_MLP", mode)
        return LlamaModel(load_config(tiny_llama), load_weights(tiny_llama), dtype)

    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        on = build("on")
    assert all(isinstance(L.gate_up, GatedLinear) for L in on.layers) and on.gated_mlp
    assert "gmlp" in on.executor_path and "LASER_GATED_MLP=off" in caplog.text
    off = build("off")
    assert not off.gated_mlp and "gmlp" not in off.executor_path
    fp32 = build("on", torch.float32)
    assert not fp32.gated_mlp and isinstance(fp32.layers[0].gate_up, Linear)
    c = on.config
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(7, c.hidden_size, generator=gen).bfloat16()
    attn = torch.randn(7, c.num_heads, c.head_dim, generator=gen).bfloat16()
    with torch.inference_mode():
        y = on.finish_layer(1, h, attn)
        ref = off.finish_layer(1, h, attn)
        assert torch.allclose(y.float(), ref.float(), atol=0.1, rtol=0.02), float((y.float() - ref.float()).abs().max())
        assert torch.equal(on.finish_layer(1, h[3:4], attn[3:4]), y[3:4])
