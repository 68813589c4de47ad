"""Weight-only quantization (laser.model.quant): formats, torch's int8/int4 kernels, GGUF blocks,
and the engine serving quantized weights (tiny random models, plus the embedded GGUF's blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laser.core.config import CacheConfig, ConfigError, SchedulerConfig
from laser.frontend.engine import Engine
from laser.model import quant
from laser.model.quant import QuantLinear, concat, gguf_int4, quantize_int4, quantize_int8
from laser.core.request import SamplingParams


def rand(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_round_trip_within_half_a_step():
    w = rand(96, 128)
    q8 = quantize_int8(w)
    assert q8.q.dtype == torch.int8 and q8.scale.shape == (96,)
    assert ((q8.dequantize() - w).abs() <= q8.scale[:, None] / 2 + 1e-6).all()
    q4 = quantize_int4(w)
    assert q4.scale.shape == (96, 4) and int(q4.q.min()) >= 0 and int(q4.q.max()) <= 15
    step = q4.scale.repeat_interleave(32, dim=1)
    assert ((q4.dequantize() - w).abs() <= step / 2 + 1e-5).all()
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(rand(4, 40))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_matches_dense_math_and_is_batch_invariant(kind):
    w, b = rand(96, 128, 1), torch.randn(96)
    lin = QuantLinear(quant.quantize(w, kind), b)
    x = rand(80, 128, 2)
    # what the kernel computes: bf16-rounded activations times the weight it holds
    ref = (x.bfloat16().float() @ lin.dense_weight(torch.float32).t()) + b
    small = lin(x[:8])
    assert small.dtype == torch.float32
    torch.testing.assert_close(small, ref[:8], rtol=1e-2, atol=2e-2 * float(ref.abs().max()) / 64)
    # each row's result is bit-equal whatever else is in the batch (decode batching invariance)
    rows = torch.cat([lin(x[i : i + 1]) for i in range(8)])
    assert torch.equal(rows, small)
    assert torch.equal(lin(x[3:7]), small[3:7])
    # many rows (prefill) take the dense path over the dequantized weight: same math
    assert x.shape[0] > lin.kernel_max_rows
    big = lin(x)
    torch.testing.assert_close(big, ref, rtol=1e-2, atol=2e-2 * float(ref.abs().max()) / 64)
    torch.testing.assert_close(big[:8], small, rtol=1e-2, atol=2e-2 * float(ref.abs().max()) / 64)


def test_compiled_int8_gemv_matches_math_and_is_batch_invariant(monkeypatch):
    """The inductor-compiled int8 GEMV computes fp32 activations times the weight it holds, and
    a row's result is bit-equal whatever its batch: alone, in a 4-row block, beside zero padding,
    at the kernel's largest row count; the prefill path agrees to float rounding."""
    monkeypatch.setenv("LASER_QUANT_GEMV", "compiled")
    w, b = rand(96, 128, 5), torch.randn(96)
    lin = QuantLinear(quantize_int8(w), b)
    assert lin.path == "compiled-gemv"
    msg = quant.prepare_decode_kernels([lin])
    assert "compiled GEMV" in msg and lin.path == "compiled-gemv", msg
    x = rand(80, 128, 6)
    ref = x @ lin.dense_weight(torch.float32).t() + b
    rows = torch.cat([lin(x[i : i + 1]) for i in range(lin.kernel_max_rows)])
    torch.testing.assert_close(rows, ref[: lin.kernel_max_rows], rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for a, n in ((0, 4), (3, 4), (2, 3), (5, 2), (1, 9), (0, lin.kernel_max_rows)):
        assert torch.equal(lin(x[a : a + n]), rows[a : a + n]), (a, n)
    big = lin(x)
    torch.testing.assert_close(big, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    monkeypatch.setenv("LASER_QUANT_GEMV", "aten")
    assert QuantLinear(quantize_int8(w), b).path == "aten"


def test_model_compiles_its_int8_decode_at_load_and_logits_are_batch_invariant(tiny_llama, monkeypatch, caplog):
    """A model with an int8 head (a GGUF Q8_0 head under ``auto``) compiles the head's decode
    graphs at load, says so in the log, and a row's logits do not depend on its batch."""
    import logging

    from laser.model.llama import LlamaModel
    from laser.model.loader import load_config, load_weights

    monkeypatch.setenv("LASER_QUANT_GEMV", "compiled")
    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        model = LlamaModel(cfg, weights, torch.float32, {"lm_head.weight": quantize_int8(weights["model.embed_tokens.weight"])})
    assert model.lm_head_q.path == "compiled-gemv" and model.weights_tag == "float32-int8"
    assert model.executor_path == "compiled-int8"  # its own latency profile (laser.profiler.executor_path_of)
    assert "inductor-compiled GEMV" in caplog.text
    h = rand(6, cfg.hidden_size, 7)
    with torch.inference_mode():
        together = model.compute_logits(h)
        alone = torch.cat([model.compute_logits(h[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)


def test_concat_keeps_integers_or_requantizes_mixed_kinds():
    a, b = quantize_int4(rand(32, 64, 3)), quantize_int4(rand(16, 64, 4))
    ab = concat([a, b])
    assert ab.kind == "int4" and torch.equal(ab.q, torch.cat([a.q, b.q]))
    mixed = concat([a, quantize_int8(rand(16, 64, 4))])
    assert mixed.kind == "int8" and mixed.shape == (48, 64)
    torch.testing.assert_close(mixed.dequantize()[:32], a.dequantize(), atol=float(a.dequantize().abs().max()) / 100,
                               rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_int4_blocks_decode_exactly(qtype):
    """The int4 decomposition of a GGUF tensor dequantizes to what the gguf package's reference
    dequantizer reads from the same bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    t = getattr(GGMLQuantizationType, qtype)
    n, k = 8, 512
    if qtype == "Q4_K":  # no Python quantizer for K-quants: random blocks with sane f16 d / dmin
        g = np.random.default_rng(0)
        raw = g.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
        raw[..., 0:2] = np.full((n, k // 256, 1), 0.01, np.float16).view(np.uint8)
        raw[..., 2:4] = np.full((n, k // 256, 1), 0.02, np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        raw = gguf_quantize(rand(n, k, 5).numpy(), t)
    want = torch.from_numpy(dequantize(raw, t)).float()
    got = gguf_int4(torch.from_numpy(raw), qtype, k)
    assert got.kind == "int4" and got.group_size == 32
    torch.testing.assert_close(got.dequantize(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        gguf_int4(torch.from_numpy(raw), "Q8_0", k)


def test_gguf_target_policy():
    assert quant.gguf_target("Q4_1", "auto") == "int4"
    assert quant.gguf_target("Q4_K", "auto") == "int4"
    assert quant.gguf_target("Q6_K", "auto") == "int8"
    assert quant.gguf_target("Q8_0", "auto") == "int8"
    assert quant.gguf_target("F16", "auto") == "none"
    assert quant.gguf_target("Q8_0", "int4") == "int4"


def test_unknown_quantization_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="quantization"):
        Engine(str(tiny_llama), dtype="float32", quantization="int3")


def test_cli_flag_reaches_the_engine_args():
    from laser.cli import build_parser

    for cmd in (["generate", "--prompt", "x"], ["serve"], ["bench"]):
        try:
            args = build_parser().parse_args(cmd + ["--quantization", "int4"])
        except SystemExit:  # a subcommand not installed in this build
            continue
        assert args.quantization == "int4"
    assert build_parser().parse_args(["generate", "--prompt", "x"]).quantization == "auto"


PROMPTS = [[5 + 7 * i + j for j in range(n)] for i, n in enumerate((3, 9, 17, 70))]


def greedy(engine, prompts, n=12):
    reqs = [engine.add_request(list(p), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    mk = lambda q, policy="vllm", budget=512: Engine(  # noqa: E731
        str(tiny_llama), policy=policy, dtype="float32", quantization=q, cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(policy=policy, max_num_batched_tokens=budget))
    return {"none": mk("none"), "auto": mk("auto"), "int8": mk("int8"), "int4": mk("int4"),
            "int4-chunked": mk("int4", "sarathi", 8)}


def test_auto_keeps_a_hf_checkpoint_dense(engines):
    assert engines["auto"].model.weights_tag == "float32"
    assert engines["int4"].model.weights_tag == "float32-int4"
    assert engines["int8"].model.weight_bytes() < engines["none"].model.weight_bytes() / 3


def test_latency_profile_is_keyed_by_the_weight_format(engines):
    """A quantized executor has other step times: its cached latency profile is another file."""
    from laser.profiler import profile_metadata

    dense, q4 = profile_metadata(engines["none"]), profile_metadata(engines["int4"])
    assert q4["model_id"] == dense["model_id"] + "-int4" and q4["shape"] == dense["shape"]
    assert q4["dtype"] == dense["dtype"] == "float32"


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of one sequence through the per-layer API (causal, no cached context)."""
    from laser.model.llama import AttnGroup, AttnMetadata

    c, T = model.config, len(ids)
    model.bind_kv_cache(torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim))
    grp = AttnGroup(torch.arange(T).view(1, T), torch.arange(T).view(1, T), None, None, None, {}, causal=True,
                    q_start=0)
    meta = AttnMetadata(model.rope_cos[:T], model.rope_sin[:T], torch.arange(T), {}, [grp])
    h = model.embed(torch.tensor(ids))
    for i in range(c.num_layers):
        h = model.forward_layer(i, h, meta)
    return model.compute_logits(h)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_equals_dense_model_of_its_weights(tiny_llama, kind):
    """The quantized executor computes the model its integers describe: its logits agree with the
    fp32 model over the same dequantized weights to the bf16 rounding of the activations, and
    every position's argmax is the same."""
    from laser.model.llama import LlamaModel
    from laser.model.loader import load_config, load_quantized, load_weights

    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    q = load_quantized(str(tiny_llama), cfg, weights, kind)
    deq = dict(weights)
    for name, qw in q.items():
        deq[name] = QuantLinear(qw).dense_weight(torch.float32)
    qmodel = LlamaModel(cfg, weights, torch.float32, q)
    dmodel = LlamaModel(cfg, {**deq, "model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
                        torch.float32)
    dmodel.lm_head_w = deq["lm_head.weight"]  # tied: the head is the quantized table, the lookup the dense one
    dmodel.lm_head_t, dmodel.lm_head_packed = dmodel.lm_head_w.t().contiguous(), None
    with torch.inference_mode():
        lq, ld = prefill_logits(qmodel, PROMPTS[2]), prefill_logits(dmodel, PROMPTS[2])
    assert torch.equal(lq.argmax(-1), ld.argmax(-1))
    torch.testing.assert_close(lq, ld, rtol=0, atol=0.05 * float(ld.abs().max()))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_greedy_output_is_batching_invariant_with_quantization(engines, kind):
    """Alone or batched (decode rows through the kernels, the 70-token prompt through the dense
    prefill path, chunked prefill mixed with decode), a request's greedy tokens are the same."""
    e = engines[kind]
    batched = greedy(e, PROMPTS)
    alone = [greedy(e, [p])[0] for p in PROMPTS]
    assert batched == alone
    if kind == "int4":
        assert greedy(engines["int4-chunked"], PROMPTS) == alone


def test_embedded_gguf_blocks_match_its_dequantized_weights(smollm2_dir):
    """Every linear tensor of the shipped Q4_1 GGUF is read in its own quantization (Q4_1 as int4,
    the Q8_0 embedding / tied head as int8); load_quantized checks each against the weights
    transformers dequantized from the same file (and raises on a mismatch)."""
    from laser.model.loader import load_config, load_quantized, load_weights, resolve_quantization

    assert resolve_quantization("auto", None) == "gguf"
    cfg = load_config(smollm2_dir)
    q = load_quantized(None, cfg, load_weights(smollm2_dir), "gguf")
    assert len(q) == 7 * cfg.num_layers + 1
    assert {v.source for k, v in q.items() if k != "lm_head.weight"} == {"Q4_1"}
    assert q["lm_head.weight"].kind == "int8" and q["lm_head.weight"].source == "Q8_0->int8"
