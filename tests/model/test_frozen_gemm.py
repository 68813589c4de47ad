"""The bf16 int8 LM head through inductor's C++ GEMM template (laser.model.frozen_gemm): same math
as torch's int8 kernel, a row's logits bit-equal whatever its batch, and the model's switch."""

from __future__ import annotations

import pytest
import torch

from laser.model.frozen_gemm import use_frozen_head
from laser.model.quant import GEMV_BLOCK, QuantLinear, quantize_int8


def rand(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_frozen_head_matches_the_int8_kernel_and_is_batch_invariant(monkeypatch):
    """Rows through the template equal aten's ``_weight_int8pack_mm`` to bf16 rounding; a row is
    bit-equal alone, in any slot of a block, beside zero padding and at the largest row count."""
    monkeypatch.setenv("LASER_QUANT_GEMV", "template")
    lin = QuantLinear(quantize_int8(rand(320, 128, 1)))
    assert lin.gemv is not None and lin.path == "compiled-gemv"
    msg = use_frozen_head(lin, torch.bfloat16)
    assert "C++ GEMM template" in msg and lin.path == "cpp-gemm" and lin.gemv is None, msg
    x = rand(40, 128, 2).bfloat16()
    ref = torch.ops.aten._weight_int8pack_mm(x, lin.packed, lin.scales)
    n = lin.kernel_max_rows
    rows = torch.cat([lin(x[i : i + 1]) for i in range(n)])
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), ref[:n].float(), rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    for a, m in ((0, GEMV_BLOCK), (3, GEMV_BLOCK), (2, 3), (5, 2), (1, 9), (0, n)):
        assert torch.equal(lin(x[a : a + m]), rows[a : a + m]), (a, m)


@pytest.mark.parametrize("mode,dtype", [("compiled", torch.bfloat16), ("template", torch.float32),
                                        ("aten", torch.bfloat16)])
def test_frozen_head_only_for_bf16_models_under_the_template_switch(monkeypatch, mode, dtype):
    """fp32 models keep the fp32 compiled GEMV (the template rounds activations to bf16);
    ``LASER_QUANT_GEMV=compiled`` / ``aten`` keep their kernels; a missing head is no error."""
    monkeypatch.setenv("LASER_QUANT_GEMV", mode)
    lin = QuantLinear(quantize_int8(rand(64, 64, 3)))
    before = lin.path
    assert use_frozen_head(lin, dtype) == "" and lin.frozen is None and lin.path == before
    assert use_frozen_head(None, torch.bfloat16) == ""


def test_bf16_model_runs_its_int8_head_through_the_template(tiny_llama, monkeypatch):
    """A bf16 model with an int8 head takes the template at load, names it in its executor path
    (a new latency profile), and a row's logits do not depend on its batch."""
    from laser.model.llama import LlamaModel
    from laser.model.loader import load_config, load_weights

    monkeypatch.setenv("LASER_QUANT_GEMV", "template")
    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    head = quantize_int8(weights["model.embed_tokens.weight"])
    model = LlamaModel(cfg, weights, torch.bfloat16, {"lm_head.weight": head})
    assert model.lm_head_q.path == "cpp-gemm" and "tmpl-int8" in model.executor_path
    h = rand(6, cfg.hidden_size, 7).bfloat16()
    with torch.inference_mode():
        together = model.compute_logits(h)
        alone = torch.cat([model.compute_logits(h[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)
