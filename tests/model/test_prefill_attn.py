"""bf16 prefill attention through blocked matmuls (laser.model.prefill): agrees with the flash
kernel within bf16 rounding, the model takes it only for bf16 causal groups of MIN_ROWS rows or
more, the executor path and startup log name it, and the switch turns it off."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from laser.core.config import CacheConfig, SchedulerConfig
from laser.core.request import SamplingParams
from laser.frontend.engine import Engine
from laser.model import llama
from laser.model import prefill_kernel as kernel_mod
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_weights
from laser.model.prefill import MIN_ROWS, blocked_causal_attention


def reference(q, k, v):
    """fp64 causal GQA attention of [Q, H, d] inputs -> [Q, Hq, d]."""
    t = lambda x: x.double().transpose(0, 1).unsqueeze(0)  # noqa: E731
    return F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("rows,heads,kv_heads,dim,block", [(200, 9, 3, 64, 32), (37, 4, 2, 16, 16), (5, 4, 4, 16, 32)])
def test_blocked_attention_agrees_with_the_flash_kernel(rows, heads, kv_heads, dim, block):
    gen = torch.Generator().manual_seed(rows)
    q = (2 * torch.randn(rows, heads, dim, generator=gen)).bfloat16()
    k = (2 * torch.randn(rows, kv_heads, dim, generator=gen)).bfloat16()
    v = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
    ref = reference(q, k, v)
    out = blocked_causal_attention(q, k, v, block)
    assert out.shape == (rows, heads, dim) and out.dtype == torch.bfloat16
    flash = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True,
                                           enable_gqa=True)[0].transpose(0, 1)
    err, flash_err = (out.double() - ref).abs().max(), (flash.double() - ref).abs().max()
    assert err <= max(2 * flash_err, 0.02), (err, flash_err)
    # strided views (what the model passes: slices of the fused QKV output) give the same result
    qkv = torch.cat([q, k, v], dim=1)
    views = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    assert torch.equal(blocked_causal_attention(*views, block), out)


def build(path, dtype, monkeypatch, mode="blocked"):
    monkeypatch.setenv("LASER_PREFILL_ATTN", mode)
    return LlamaModel(load_config(path), load_weights(path), dtype)


def test_path_log_and_switch(tiny_llama, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        bf = build(tiny_llama, torch.bfloat16, monkeypatch)
    assert bf.blocked_attn and bf.executor_path.endswith("pattn") and "blocked matmuls" in caplog.text
    fp32 = build(tiny_llama, torch.float32, monkeypatch)
    assert not fp32.blocked_attn and getattr(fp32, "executor_path", None) is None
    off = build(tiny_llama, torch.bfloat16, monkeypatch, mode="sdpa")
    assert not off.blocked_attn and "pattn" not in getattr(off, "executor_path", "")
    with pytest.raises(ValueError, match="LASER_PREFILL_ATTN"):
        build(tiny_llama, torch.bfloat16, monkeypatch, mode="yes")


def run_engine(path, monkeypatch, mode, prompts):
    """Greedy tokens of ``prompts``, each added after the step that prefilled the one before (a
    fresh prompt's prefill beside the earlier requests' decode rows: one causal group)."""
    monkeypatch.setenv("LASER_PREFILL_ATTN", mode)
    e = Engine(str(path), policy="vllm", dtype="bfloat16", cache=CacheConfig(num_blocks=256),
               scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096))
    reqs = []
    for p in prompts:
        reqs.append(e.add_request(p, SamplingParams(max_tokens=6, temperature=0)))
        e.step()
    while e.has_unfinished():
        e.step()
    return [r.output_token_ids for r in reqs]


def test_engine_prefill_runs_blocked_attention_and_keeps_the_tokens(tiny_llama, monkeypatch):
    """Long bf16 prompts prefill through the blocked kernel (a short one through the flash kernel),
    and the first greedy token of a random model's well-separated logits is the flash kernel's; a
    prompt's first token is the same alone as prefilled beside other requests' decode rows."""
    calls = []
    real = llama.blocked_causal_attention
    monkeypatch.setattr(llama, "blocked_causal_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((20, MIN_ROWS + 70, MIN_ROWS))]
    blocked = run_engine(tiny_llama, monkeypatch, "blocked", prompts)
    layers = load_config(tiny_llama).num_layers
    assert sorted(set(calls)) == [MIN_ROWS, MIN_ROWS + 70] and len(calls) == 2 * layers
    calls.clear()
    # the prefill's token (later bf16 decode steps of a random model may flip near-ties)
    assert [t[0] for t in run_engine(tiny_llama, monkeypatch, "sdpa", prompts)] == [t[0] for t in blocked]
    assert not calls
    assert [run_engine(tiny_llama, monkeypatch, "blocked", [p])[0][0] for p in prompts] == [t[0] for t in blocked]


@pytest.fixture(scope="module")
def prefill_kernel():
    kern = kernel_mod.load_kernel()
    if kern is None:
        pytest.skip("the C++ prefill attention kernel needs AVX512-BF16")
    return kern


@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 4, 2, 16), (37, 4, 2, 32), (200, 9, 3, 64), (130, 8, 2, 128),
                                                     (97, 4, 4, 64), (300, 6, 1, 32)])
def test_kernel_error_is_the_blocked_matmuls(prefill_kernel, rows, heads, kv_heads, dim):
    """The C++ kernel's error against fp64 is the blocked matmuls' (both fp32 inside; the flash
    kernel's bound as above), on strided views as on contiguous inputs (bit-equal)."""
    gen = torch.Generator().manual_seed(rows + dim)
    qkv = (2 * torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen)).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    ref = reference(q, k, v)
    out = kernel_mod.prefill_attention_kernel(prefill_kernel, q, k, v)
    assert out.shape == (rows, heads, dim) and out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    blocked_err = (blocked_causal_attention(q, k, v).double() - ref).abs()
    assert err.max() <= max(blocked_err.max() * 1.5, 0.02) and err.mean() <= blocked_err.mean() * 1.1
    contiguous = kernel_mod.prefill_attention_kernel(prefill_kernel, q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(contiguous, out)


def test_kernel_rows_do_not_depend_on_later_rows_or_threads(prefill_kernel):
    """A query row's output is bit-equal whatever follows it in the sequence and on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = ((2 * torch.randn(150, h, 64, generator=gen)).bfloat16() for h in (9, 3, 3))
    full = kernel_mod.prefill_attention_kernel(prefill_kernel, q, k, v)
    for n in (1, 31, 32, 33, 100):
        assert torch.equal(kernel_mod.prefill_attention_kernel(prefill_kernel, q[:n], k[:n], v[:n]), full[:n])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernel_mod.prefill_attention_kernel(prefill_kernel, q, k, v), full)
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_what_it_has_no_tiles_for(prefill_kernel):
    q = torch.zeros(4, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head size"):
        kernel_mod.prefill_attention_kernel(prefill_kernel, q, q, q)
    with pytest.raises(ValueError, match="bf16"):
        kernel_mod.prefill_attention_kernel(prefill_kernel, q.float(), q.float(), q.float())


def test_engine_prefill_runs_the_kernel_and_keeps_the_tokens(tiny_llama, monkeypatch, prefill_kernel, caplog):
    """bf16 causal groups of every length prefill through the C++ kernel by default (executor
    path and log name it); the prefill's greedy token is the flash kernel's, alone or beside other
    requests' decode rows."""
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        bf = build(tiny_llama, torch.bfloat16, monkeypatch, mode="kernel")
    assert bf.prefill_kernel is not None and bf.executor_path.endswith("pattn-cpp") and "C++ kernel" in caplog.text
    calls = []
    real = llama.prefill_attention_kernel
    monkeypatch.setattr(llama, "prefill_attention_kernel", lambda kern, q, *a: calls.append(q.shape[0]) or real(kern, q, *a))
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((20, MIN_ROWS + 70, 3))]
    tokens = run_engine(tiny_llama, monkeypatch, "kernel", prompts)
    assert sorted(set(calls)) == [3, 20, MIN_ROWS + 70] and len(calls) == 3 * load_config(tiny_llama).num_layers
    assert [t[0] for t in run_engine(tiny_llama, monkeypatch, "sdpa", prompts)] == [t[0] for t in tokens]
    assert [run_engine(tiny_llama, monkeypatch, "kernel", [p])[0][0] for p in prompts] == [t[0] for t in tokens]


def test_kernel_chunk_over_cached_context_is_the_whole_prefill(prefill_kernel):
    """A chunk whose earlier positions are in a KV cache (read by slot, scattered) gives the rows
    of the whole sequence's prefill bit for bit, whatever the split."""
    gen = torch.Generator().manual_seed(9)
    rows, heads, kvh, d = 140, 8, 2, 32
    q, k, v = ((2 * torch.randn(rows, h, d, generator=gen)).bfloat16() for h in (heads, kvh, kvh))
    whole = kernel_mod.prefill_attention_kernel(prefill_kernel, q, k, v)
    slots = torch.randperm(400, generator=gen)[:rows]
    kc, vc = torch.zeros(400, kvh, d, dtype=torch.bfloat16), torch.zeros(400, kvh, d, dtype=torch.bfloat16)
    kc[slots], vc[slots] = k, v
    for before, n in ((0, 140), (1, 50), (37, 103), (64, 64), (139, 1)):
        chunk = kernel_mod.prefill_attention_kernel(prefill_kernel, q[before:before + n], kc, vc,
                                                    slots=slots[:before + n])
        assert torch.equal(chunk, whole[before:before + n]), (before, n)
    with pytest.raises(ValueError, match="slots"):
        kernel_mod.prefill_attention_kernel(prefill_kernel, q[:5], kc, vc, slots=slots[:4])


def test_engine_chunked_and_merged_prefill_through_the_kernel(tiny_llama, monkeypatch, prefill_kernel):
    """Chunked prefills (later chunks over cached context) and merged prompts take the kernel's
    chunk form, and each prompt's first greedy token is the unchunked flash kernel's."""
    calls = []
    real = llama.prefill_attention_kernel
    monkeypatch.setattr(llama, "prefill_attention_kernel",
                        lambda kern, q, *a, **kw: calls.append(kw.get("slots") is not None) or real(kern, q, *a, **kw))
    prompts = [[(5 * i + 11 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((300, 45, 90))]

    def first_tokens(mode, budget):
        monkeypatch.setenv("LASER_PREFILL_ATTN", mode)
        e = Engine(str(tiny_llama), policy="sarathi", dtype="bfloat16", cache=CacheConfig(num_blocks=256),
                   scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=budget))
        reqs = [e.add_request(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts]
        while e.has_unfinished():
            e.step()
        return [r.output_token_ids[0] for r in reqs]

    chunked = first_tokens("kernel", 128)
    assert any(calls) and chunked == first_tokens("sdpa", 4096)
    # mode amx (AMX's default): first chunks through the flash kernel, later ones through the kernel's chunk form
    calls.clear()
    assert first_tokens("amx", 128) == chunked and calls and all(calls)


def test_auto_mode_is_chosen_from_the_cpu_flags(monkeypatch):
    """``LASER_PREFILL_ATTN`` unset or ``auto``: ``amx`` where the CPU has AMX tiles, else
    ``kernel``; an explicit mode is kept whatever the CPU."""
    from laser.model import prefill

    monkeypatch.delenv("LASER_PREFILL_ATTN", raising=False)
    assert prefill.prefill_attn_mode(amx=True) == "amx" and prefill.prefill_attn_mode(amx=False) == "kernel"
    monkeypatch.setattr(prefill, "has_amx", lambda: True)
    assert prefill.prefill_attn_mode() == "amx" and prefill.causal_through_flash(torch.bfloat16)
    assert not prefill.causal_through_flash(torch.float32)
    monkeypatch.setattr(prefill, "has_amx", lambda: False)
    assert prefill.prefill_attn_mode() == "kernel" and not prefill.causal_through_flash(torch.bfloat16)
    for mode in ("kernel", "amx", "blocked", "sdpa"):
        monkeypatch.setenv("LASER_PREFILL_ATTN", mode)
        assert prefill.prefill_attn_mode(amx=True) == mode == prefill.prefill_attn_mode(amx=False)


@pytest.mark.parametrize("amx", [True, False])
def test_model_reports_the_path_the_cpu_flags_chose(tiny_llama, monkeypatch, caplog, amx):
    """By default a bf16 model on an AMX CPU runs whole prompts through the flash kernel (executor
    path ``...-pattn-amx``, named in the startup log with the reason); without AMX the C++ kernel
    (``...-pattn-cpp``) where it loads. fp32 models take neither."""
    from laser.model import prefill

    monkeypatch.setattr(prefill, "has_amx", lambda: amx)
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        bf = build(tiny_llama, torch.bfloat16, monkeypatch, mode="auto")
    assert bf.causal_flash == amx
    if amx:
        assert bf.executor_path.endswith("pattn-amx") and "flash kernel" in caplog.text and "AMX" in caplog.text
    elif bf.prefill_kernel is not None:
        assert bf.executor_path.endswith("pattn-cpp") and "C++ kernel" in caplog.text
    fp32 = build(tiny_llama, torch.float32, monkeypatch, mode="auto")
    assert not fp32.causal_flash and getattr(fp32, "executor_path", None) is None


def test_amx_mode_runs_whole_prompts_through_the_flash_kernel(tiny_llama, monkeypatch):
    """Mode ``amx``: whole prompts of every length through SDPA (the blocked matmuls and the C++
    kernel's whole-prompt form not called), the same greedy tokens as ``sdpa`` everywhere."""
    calls = []
    real_blocked, real_kernel = llama.blocked_causal_attention, llama.prefill_attention_kernel
    monkeypatch.setattr(llama, "blocked_causal_attention", lambda q, *a: calls.append("blocked") or real_blocked(q, *a))
    monkeypatch.setattr(llama, "prefill_attention_kernel",
                        lambda kern, q, *a, **kw: calls.append(kw.get("slots")) or real_kernel(kern, q, *a, **kw))
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((20, MIN_ROWS + 70, 3))]
    tokens = run_engine(tiny_llama, monkeypatch, "amx", prompts)
    assert not calls
    assert run_engine(tiny_llama, monkeypatch, "sdpa", prompts) == tokens
