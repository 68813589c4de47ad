"""bf16 Linear weights in oneDNN's packed layout alone (laser.model.linear): the same products as
F.linear on the plain weight within bf16 rounding at every row count, the fused residual add, the
K/V columns an early exit fills, the LM head, the executor path and log, and the switch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from laser.model.linear import Linear, add_linear, pack_for_onednn
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_weights

needs_bf16 = pytest.mark.skipif(pack_for_onednn(torch.ones(4, 4, dtype=torch.bfloat16), 1) is None,
                                reason="oneDNN does not run bf16 matmuls on this CPU")


def build(path, monkeypatch, mode="on", dtype=torch.bfloat16):
    monkeypatch.setenv("LASER_PACKED_WEIGHTS", mode)
    return LlamaModel(load_config(path), load_weights(path), dtype)


def close(a, b):
    """Equal within bf16 rounding of values of size ~1-10 (one ulp at 8 is 0.0625)."""
    return torch.allclose(a.float(), b.float(), atol=0.07, rtol=0.02), float((a.float() - b.float()).abs().max())


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_plain_at_every_row_count(monkeypatch, bias):
    monkeypatch.setenv("LASER_PACKED_WEIGHTS", "on")
    gen = torch.Generator().manual_seed(1)
    w = (0.2 * torch.randn(48, 40, generator=gen)).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16() if bias else None
    lin = Linear(w, b)
    assert lin.w is None and lin.wt is None and not lin.sliceable and lin.numel() == w.numel()
    for rows in (1, 3, 64, 200):
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        ref = F.linear(x, w, b)
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        ok, err = close(y, ref)
        assert ok, (rows, err)
        # a row's result does not depend on the rows beside it
        assert torch.equal(lin(x[:1]), y[:1])
        res = torch.randn(rows, 48, generator=gen).bfloat16()
        ok, err = close(add_linear(lin, x, res), res + ref)
        assert ok, (rows, err)
        assert torch.equal(lin.columns(x, 16), y[:, 16:])


def test_fp32_and_switched_off_bf16_keep_their_layouts(monkeypatch):
    w = torch.randn(8, 6)
    monkeypatch.setenv("LASER_PACKED_WEIGHTS", "off")
    plain = Linear(w.bfloat16())
    assert plain.w is not None and plain.packed is None and plain.sliceable
    fp32 = Linear(w)
    assert fp32.w is not None or fp32.wt is not None
    x = torch.randn(3, 6)
    res = torch.randn(3, 8)
    assert torch.equal(add_linear(fp32, x, res), res + fp32(x))
    monkeypatch.setenv("LASER_PACKED_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="LASER_PACKED_WEIGHTS"):
        Linear(w.bfloat16())


@needs_bf16
def test_model_path_log_kv_fill_and_head(tiny_llama, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        m = build(tiny_llama, monkeypatch)
    assert m.executor_path.startswith("pw") and "oneDNN-packed" in caplog.text
    assert m.lm_head_t is None and m.lm_head_packed is not None
    off = build(tiny_llama, monkeypatch, "off")
    assert "pw" not in getattr(off, "executor_path", "") and off.lm_head_t is not None
    c = m.config
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(5, c.hidden_size, generator=gen).bfloat16()
    cos, sin = m.rope_cos[:5], m.rope_sin[:5]
    with torch.inference_mode():
        # an early exit's K/V fill is the K/V the layer itself computes
        _, k, v = m.qkv(1, h, cos, sin)
        k2, v2 = m.kv_projection(1, h, cos, sin)
        assert torch.equal(k, k2) and torch.equal(v, v2)
        # the packed layers and head agree with the plain ones within bf16 rounding, a row alone as in a batch
        attn = torch.randn(5, c.num_heads, c.head_dim, generator=gen).bfloat16()
        ok, err = close(m.finish_layer(1, h, attn), off.finish_layer(1, h, attn))
        assert ok, err
        logits, ref = m.compute_logits(h), off.compute_logits(h)
        ok, err = close(logits, ref)
        assert ok, err
        assert torch.equal(m.compute_logits(h[2:3]), logits[2:3])
