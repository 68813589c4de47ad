"""Fused decode layers (laser.model.fused): int4 layers through compiled graphs, in bf16 and in fp32,
agree with the eager layer within bf16 rounding, a row's result does not depend on its batch (nor,
in decode attention, on its group's padding), the executor path names them, and dense fp32 layers
(the exactness setting) never take them."""

from __future__ import annotations

import logging

import pytest
import torch

from laser.core.config import CacheConfig, SchedulerConfig
from laser.core.request import SamplingParams
from laser.frontend.engine import Engine
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_quantized, load_weights


def build(path, dtype, monkeypatch, fused="1"):
    monkeypatch.setenv("LASER_FUSED_DECODE", fused)
    cfg, weights = load_config(path), load_weights(path)
    return LlamaModel(cfg, weights, dtype, load_quantized(path, cfg, weights, "int4"))


@pytest.mark.parametrize("kind,dtype", [("llama", torch.bfloat16), ("qwen2", torch.bfloat16),  # plain, QKV bias,
                                        ("qwen3", torch.bfloat16), ("llama", torch.float32),  # QK-norm
                                        ("qwen2", torch.float32), ("qwen3", torch.float32)])
def test_fused_layers_match_eager_within_bf16_rounding(tiny_model_dirs, monkeypatch, caplog, kind, dtype):
    """bf16: graphs A, B and D (one of each serves every layer). fp32 (int4 layers, the AVX2 kind's
    default): A and B with the casts around the kernels fused in, D on the fp32 C++ kernel."""
    with caplog.at_level(logging.INFO, logger="laser.model.llama"):
        model = build(tiny_model_dirs[kind], dtype, monkeypatch)
    f = model.fused
    assert f is not None and f.graphs == 3, caplog.text
    assert model.executor_path.endswith("fused-dattn-cpp") and "decode layers fused" in caplog.text
    assert f.decode_attention and f.attention_kernel.dtype == dtype and "in a C++ kernel" in caplog.text
    c = model.config
    gen = torch.Generator().manual_seed(0)
    n = 6
    h = torch.randn(n, c.hidden_size, generator=gen).to(dtype)
    attn = torch.randn(n, c.num_heads, c.head_dim, generator=gen).to(dtype)
    pos = torch.arange(30, 30 + n)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    with torch.inference_mode():
        for i in range(c.num_layers):
            fq = model.qkv(i, h, cos, sin)
            eq = model.qkv_of(model.layers[i], h, cos, sin)
            for a, b in zip(fq, eq):
                assert a.shape == b.shape and a.dtype == b.dtype == dtype
                torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02 * float(b.abs().max()))
            fb = model.finish_layer(i, h, attn)
            eb = model.finish_of(model.layers[i], h, attn)
            torch.testing.assert_close(fb.float(), eb.float(), rtol=0.02, atol=0.02 * float(eb.abs().max()))
            # each row bit-equal whatever else is in the batch (1 row, any slice, all n rows)
            alone = torch.cat([model.finish_layer(i, h[r : r + 1], attn[r : r + 1]) for r in range(n)])
            assert torch.equal(alone, fb)
            assert torch.equal(model.qkv(i, h[2:5], cos[2:5], sin[2:5])[0], fq[0][2:5])


def _padded(lens, slots, gen, dtype=torch.bfloat16):
    """Per sequence its cache slots (blocks of 16 at random places), and the batch's [B, C] slot
    index and additive ``dtype`` mask padded to the longest (pads: slot 0, -inf)."""
    blocks = torch.randperm(slots // 16, generator=gen)
    idx, at = [], 0
    for n in lens:
        nb = -(-n // 16)
        idx.append((blocks[at:at + nb, None] * 16 + torch.arange(16)).reshape(-1)[:n].contiguous())
        at += nb
    C = max(lens)
    index = torch.zeros(len(lens), C, dtype=torch.long)
    mask = torch.full((len(lens), C), float("-inf"))
    for b, (n, ix) in enumerate(zip(lens, idx)):
        index[b, :n], mask[b, :n] = ix, 0
    return idx, index, mask.to(dtype)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decode_attention_graph_matches_sdpa_and_ignores_padding(tiny_model_dirs, monkeypatch, kind):
    """Graph D (decode attention over the cache) agrees with torch's SDPA on the same gathered
    context within bf16 rounding, and a sequence's result is bit-equal alone and padded in a batch."""
    model = build(tiny_model_dirs[kind], torch.bfloat16, monkeypatch)
    c, f = model.config, model.fused
    kvh, d, g = c.num_kv_heads, c.head_dim, c.num_heads // c.num_kv_heads
    gen = torch.Generator().manual_seed(1)
    slots = 64 * 16
    kc = torch.randn(slots, kvh, d, generator=gen).bfloat16()
    vc = torch.randn(slots, kvh, d, generator=gen).bfloat16()
    lens = [37, 5, 130, 64, 1]
    q = torch.randn(len(lens), c.num_heads, d, generator=gen).bfloat16()
    idx, index, mask = _padded(lens, slots, gen)
    with torch.inference_mode():
        batch = f.attend(q, kc, vc, index, mask)
        assert batch.shape == q.shape and batch.dtype == torch.bfloat16
        for b, n in enumerate(lens):
            alone = f.attend(q[b:b + 1], kc, vc, idx[b][None], torch.zeros(1, n).bfloat16())
            assert torch.equal(alone, batch[b:b + 1])  # independent of the batch and its padding
            kg = kc[idx[b]].view(1, n, kvh, d).transpose(1, 2)
            vg = vc[idx[b]].view(1, n, kvh, d).transpose(1, 2)
            ref = torch.nn.functional.scaled_dot_product_attention(q[b].view(1, kvh, g, d).float(), kg.float(),
                                                                   vg.float()).reshape(1, c.num_heads, d)
            torch.testing.assert_close(alone.float(), ref, rtol=0.02, atol=0.02)


def test_layer_graphs_run_their_fused_loops_on_one_thread(tiny_llama, monkeypatch):
    """Graphs A and B's own C++ loops carry no OpenMP region whatever torch's thread count at the
    compile (at one decode row a parallel region over the rows only forks and joins the other
    threads); their int4 kernels still take torch's threads, and a row's result is the same at 1
    and 2 threads."""
    import inspect

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = build(tiny_llama, torch.bfloat16, monkeypatch)
        f, c = model.fused, model.config
        for fn, _ in (f._qkv[0], f._finish[0]):
            src = inspect.getsource(inspect.getmodule(fn))
            assert "cpp_fused" in src and "int4" in src  # inductor's loops and the extern int4 call
            assert "#pragma omp" not in src
        gen = torch.Generator().manual_seed(3)
        h = torch.randn(1, c.hidden_size, generator=gen).bfloat16()
        attn = torch.randn(1, c.num_heads, c.head_dim, generator=gen).bfloat16()
        with torch.inference_mode():
            two = model.finish_layer(0, h, attn)
            torch.set_num_threads(1)
            assert torch.equal(model.finish_layer(0, h, attn), two)
    finally:
        torch.set_num_threads(threads)


def test_rows_past_the_crossover_run_eager(tiny_llama, monkeypatch):
    model = build(tiny_llama, torch.bfloat16, monkeypatch)
    model.fused.qkv_rows = model.fused.finish_rows = 2
    calls = []
    monkeypatch.setattr(model.fused, "finish", lambda *a: calls.append(a) or 1 / 0)
    c = model.config
    h = torch.randn(3, c.hidden_size).bfloat16()
    with torch.inference_mode():
        out = model.finish_layer(0, h, torch.randn(3, c.num_heads, c.head_dim).bfloat16())
    assert out.shape == h.shape and not calls


def test_dense_fp32_and_the_switch_keep_the_eager_layers(tiny_llama, monkeypatch):
    monkeypatch.setenv("LASER_FUSED_DECODE", "1")
    cfg, weights = load_config(tiny_llama), load_weights(tiny_llama)
    dense = LlamaModel(cfg, weights, torch.float32, load_quantized(tiny_llama, cfg, weights, "none"))
    assert dense.fused is None and "fused" not in getattr(dense, "executor_path", "")
    off = build(tiny_llama, torch.bfloat16, monkeypatch, fused="0")
    assert off.fused is None and "fused" not in getattr(off, "executor_path", "")
    monkeypatch.setenv("LASER_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match="LASER_FUSED_DECODE"):
        build(tiny_llama, torch.bfloat16, monkeypatch, fused="yes")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_decodes_through_the_fused_graphs(tiny_llama, monkeypatch, dtype):
    """A bf16 or fp32 int4 engine's decode steps run the graphs (its decode attention through graph
    D), and its greedy tokens (of a random model's well-separated logits) are the eager engine's."""
    tokens = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("LASER_FUSED_DECODE", fused)
        e = Engine(str(tiny_llama), policy="vllm", dtype=dtype, quantization="int4",
                   cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(policy="vllm"))
        assert (e.model.fused is not None) == (fused == "1")
        if e.model.fused is not None:
            calls, attends = [], []
            run, attend = e.model.fused.qkv, e.model.fused.attend
            monkeypatch.setattr(e.model.fused, "qkv", lambda *a: calls.append(1) or run(*a))
            monkeypatch.setattr(e.model.fused, "attend", lambda *a: attends.append(a[0].shape[0]) or attend(*a))
        reqs = [e.add_request([5 + 3 * i + j for j in range(7 + i)], SamplingParams(max_tokens=3, temperature=0))
                for i in range(3)]
        while e.has_unfinished():
            e.step()
        assert all(len(r.output_token_ids) == 3 for r in reqs)
        if fused == "1":
            assert calls  # decode rows (3 at a time) went through graph A
            assert max(attends) == 3  # decode attention: graph D
        tokens[fused] = [r.output_token_ids for r in reqs]
    assert tokens["0"] == tokens["1"]


#: (KV heads, query heads per KV head, d): specialised variants on AVX2 and AVX512 (3 x 64, 2 x 64,
#: 2 x 24 with a part-filled last chunk) and the generic path (9 per KV head; d = 40; 4 x 128 on AVX2)
KERNEL_SHAPES = [(3, 3, 64), (2, 2, 64), (2, 2, 24), (1, 9, 64), (2, 2, 40), (2, 4, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kvh,g,d", KERNEL_SHAPES)
def test_attention_kernel_matches_the_reference_and_ignores_padding(kvh, g, d, dtype):
    """Graph D's C++ kernel (laser.model.attn_kernel), bf16 and fp32, agrees with the reference
    decode_attention (bf16: within its rounding; fp32: to ~1e-5) on :data:`KERNEL_SHAPES`, and a
    sequence's output is bit-equal alone and padded in a batch. A kernel of one dtype refuses
    tensors of the other, and inconsistent shapes are refused before the kernel reads anything."""
    from laser.model.attn_kernel import decode_attention_kernel, load_kernel
    from laser.model.fused import decode_attention

    kernel = load_kernel(dtype)
    assert kernel is not None and kernel.dtype == dtype
    gen = torch.Generator().manual_seed(2)
    slots = 48 * 16
    kc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
    vc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
    lens = [300, 1, 17, 64]
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(dtype)
    idx, index, mask = _padded(lens, slots, gen, dtype)
    batch = decode_attention_kernel(kernel, q, kc, vc, index, mask)
    assert batch.shape == q.shape and batch.dtype == dtype
    ref = decode_attention(q, kc, vc, index, mask, kvh)
    tol = 0.02 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(batch.float(), ref.float(), rtol=tol, atol=tol)
    for b, n in enumerate(lens):
        alone = decode_attention_kernel(kernel, q[b:b + 1], kc, vc, idx[b][None], torch.zeros(1, n).to(dtype))
        assert torch.equal(alone, batch[b:b + 1])
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="int64 slots only"):
        decode_attention_kernel(kernel, q.to(other), kc.to(other), vc.to(other), index, mask.to(other))
    for bad in ((q[:2], kc, vc, index, mask, None), (q, kc, vc, index, mask[:, :-1], None),
                (q, kc, vc[:-1], index, mask, None), (q, kc, vc, index, mask, index.shape[1] + 1),
                (q, kc, vc, index, mask, 0)):
        with pytest.raises(ValueError, match="decode attention kernel"):
            decode_attention_kernel(kernel, *bad[:5], bad[5])
    assert decode_attention_kernel(kernel, q[:0], kc, vc, index[:0], mask[:0]).shape == (0, kvh * g, d)
    for slot in (slots, 10 ** 9, -5):  # a slot outside the cache is refused before anything is read
        bad = index.clone()
        bad[1, 0] = slot
        with pytest.raises(ValueError, match=f"slot {slot} of sequence 1, position 0"):
            decode_attention_kernel(kernel, q, kc, vc, bad, mask)
    with pytest.raises(ValueError, match="q \\[B, Hq, d\\]"):
        decode_attention_kernel(kernel, q[0], kc, vc, index, mask)
    with pytest.raises(ValueError, match="q \\[B, Hq, d\\]"):
        decode_attention_kernel(kernel, q, kc.view(-1), vc.view(-1), index, mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_kernel_specialised_sizes_give_the_generic_paths_bits(dtype):
    """The variants with compile-time head counts and chunks (``pick``) compute the very sums of the
    generic path, in the same order: a build running the generic path at every size gives the
    same bits on every shape of :data:`KERNEL_SHAPES`."""
    from laser.model.attn_kernel import decode_attention_kernel, load_kernel

    kernel, generic = load_kernel(dtype), load_kernel(dtype, generic_only=True)
    assert kernel is not None and generic is not None
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    gen = torch.Generator().manual_seed(4)
    for kvh, g, d in KERNEL_SHAPES:
        slots = 24 * 16
        kc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
        vc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
        lens = [150, 3, 40]
        q = torch.randn(len(lens), kvh * g, d, generator=gen).to(dtype)
        _, index, mask = _padded(lens, slots, gen, dtype)
        want = decode_attention_kernel(generic, q, kc, vc, index, mask)
        got = decode_attention_kernel(kernel, q, kc, vc, index, mask)
        assert torch.equal(got.view(bits), want.view(bits)), (kvh, g, d)
