"""bf16 prefill glue compiled by inductor (laser.model.prefill_glue): the compiled RMSNorm, RoPE
and SiLU * up agree with the eager glue to bf16 rounding, run only from MIN_ROWS rows of a bf16
model, are named in the executor path and the startup log, and ``LASER_PREFILL_GLUE=0`` turns
them off. No timing is asserted."""

from __future__ import annotations

import logging

import pytest
import torch

from laser.model import prefill_glue
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_weights


def build(path, dtype, monkeypatch, mode):
    monkeypatch.setenv("LASER_PREFILL_GLUE", mode)
    return LlamaModel(load_config(path), load_weights(path), dtype)


@pytest.fixture
def models(tiny_llama, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        compiled = build(tiny_llama, torch.bfloat16, monkeypatch, "1")
    eager = build(tiny_llama, torch.bfloat16, monkeypatch, "0")
    return compiled, eager, caplog.text


def test_compiled_glue_agrees_with_eager_and_is_reported(models):
    compiled, eager, log_text = models
    assert compiled.glue is not None and "cglue" in compiled.executor_path and "prefill glue" in log_text
    assert eager.glue is None and "cglue" not in getattr(eager, "executor_path", "")
    c = compiled.config
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows in (prefill_glue.MIN_ROWS, 150):
            h = torch.randn(rows, c.hidden_size, generator=gen).bfloat16()
            attn = torch.randn(rows, c.num_heads, c.head_dim, generator=gen).bfloat16()
            cos, sin = compiled.rope_cos[:rows], compiled.rope_sin[:rows]
            pairs = list(zip(compiled.qkv_of(compiled.layers[0], h, cos, sin), eager.qkv_of(eager.layers[0], h, cos, sin)))
            pairs.append((compiled.finish_of(compiled.layers[0], h, attn), eager.finish_of(eager.layers[0], h, attn)))
            for a, b in pairs:  # bf16 rounding apart: a few ulps of the largest value
                assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
                assert (a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max()
            # each row's result depends only on that row
            half = rows // 2 + prefill_glue.MIN_ROWS
            h2 = h.clone()
            h2[half:] = 0
            assert torch.equal(compiled._norm(h2, compiled.layers[0].ln1)[:half],
                               compiled._norm(h, compiled.layers[0].ln1)[:half])


def test_few_rows_symbolic_traces_and_fp32_stay_eager(models, tiny_llama, monkeypatch):
    compiled, eager, _ = models
    calls = []
    glue = compiled.glue
    monkeypatch.setattr(glue, "norm", lambda *a: calls.append(1))
    h = torch.randn(prefill_glue.MIN_ROWS - 1, compiled.config.hidden_size).bfloat16()
    assert torch.equal(compiled._norm(h, compiled.layers[0].ln1), eager._norm(h, eager.layers[0].ln1))
    assert not calls
    from torch.fx.experimental.proxy_tensor import make_fx

    # a graph traced on symbolic sizes (the fused decode graphs) traces the eager glue, not this one
    make_fx(lambda x, w: compiled._norm(x, w), tracing_mode="symbolic")(
        torch.randn(prefill_glue.MIN_ROWS + 3, compiled.config.hidden_size).bfloat16(), compiled.layers[0].ln1)
    assert not calls
    assert build(tiny_llama, torch.float32, monkeypatch, "1").glue is None
    with pytest.raises(ValueError, match="LASER_PREFILL_GLUE"):
        build(tiny_llama, torch.bfloat16, monkeypatch, "yes")
