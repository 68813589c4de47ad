"""Shared fixtures: tiny random-weight models built from configs, and the embedded SmolLM2."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# int8 decode rows through torch's aten kernel unless a test asks for the compiled GEMV
# (laser.model.quant.CompiledGemv): only the tests that mean to compile do
os.environ.setdefault("LASER_QUANT_GEMV", "aten")
# the quantized kernels' row crossover at its fixed defaults, not measured on the machine
# (laser.model.kernel_rows): test runs do not depend on the CPU's speed
os.environ.setdefault("LASER_QUANT_ROWS", "fixed")
# decode layers eager unless a test asks for the fused graphs (laser.model.fused): only the tests
# that mean to compile do
os.environ.setdefault("LASER_FUSED_DECODE", "0")
os.environ.setdefault("LASER_PREFILL_GLUE", "0")  # bf16 prefill glue eager unless a test compiles it
os.environ.setdefault("LASER_KV_PREFAULT", "0")  # KV pages taken on first write: many instances, little memory
os.environ.setdefault("LASER_WARM_ROWS", "0")  # no start-up warm-up of row counts unless a test asks for it
# int8 weights weight-only unless a test asks for W8A8 (laser.model.w8a8; also the engine's default):
# not measured on the machine
os.environ.setdefault("LASER_QUANT_W8A8", "off")

TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    # Llama-3 style RoPE scaling, untied LM head
    "llama3": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
}


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF-format directory of the embedded SmolLM2 (converted from GGUF once, then cached)."""
    from laser.model.loader import resolve_model

    return resolve_model(None)


def make_tiny_model(kind: str, path, tokenizer_dir, seed: int = 0, init_std: float = 0.2, **overrides):
    """Write a random-weight HF checkpoint of ``kind`` into ``path`` (with SmolLM2's tokenizer).

    A large init std gives well-separated logits, so greedy argmax is not decided by
    float rounding (batch-invariance tests compare tokens, not bits). ``overrides`` replace
    entries of ``TINY_CONFIGS[kind]`` (e.g. ``max_position_embeddings`` for a long context).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg_kwargs = {**TINY_CONFIGS[kind], **overrides}
    model_type = cfg_kwargs.pop("model_type")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, initializer_range=init_std, **cfg_kwargs
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, smollm2_dir):
    """kind -> checkpoint dir for every TINY_CONFIGS entry."""
    out = {}
    for kind in TINY_CONFIGS:
        d = tmp_path_factory.mktemp(f"tiny-{kind}")
        make_tiny_model(kind, d, smollm2_dir)
        out[kind] = d
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    shutil.os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
