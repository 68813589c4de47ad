"""Where a bf16 prefill layer's time goes: one decoder layer of the embedded SmolLM2 over T prompt
tokens, piece by piece, against the matmul peak of the dtype.

Times, interleaved in one process (median of ``--repeats`` rounds, each piece once per round):
  - each layer matmul (QKV, O, gate+up as one matmul, down) through the model's own ``Linear``
    (the oneDNN-packed weight unless ``$LASER_PACKED_WEIGHTS=off``; gate+up as the model's
    ``GatedLinear`` where ``$LASER_GATED_MLP`` makes one: its two matmuls with SiLU * up in their
    epilogues, so the glue below then holds no SiLU * up), with its FLOP rate and share
    of the peak (a 2048^3 matmul in the same dtype, as ``engine_speed.py`` measures it), and the
    same matmul as ``F.linear`` on the plain weight;
  - causal attention: torch's flash kernel (``scaled_dot_product_attention``) and the blocked
    matmuls of :mod:`laser.model.prefill`, with their share of the peak (causal FLOPs);
  - the glue: ``qkv_of`` minus its matmul (RMSNorm, RoPE), ``finish_of`` minus its three
    matmuls (residual adds, RMSNorm, SiLU * up);
  - the LM head for the last row (what a prefill computes) and for all T rows (what it avoids);
  - ``--quantization auto``'s prefill matmuls: each weight quantized to int4 (groups of 32, as the
    GGUF's Q4_1 layers load) through ``QuantLinear.dense_matmul`` over its dense bf16 copy packed
    for oneDNN (what ``laser.model.kernel_rows.dense_copy`` keeps with ``LASER_QUANT_DENSE=packed``, the AMX
    kind's default, where the crossover is measured below the default), over
    the plain copy (``F.linear``), dequantized per call (no copy kept), and through the int4 kernel.

    python benchmarks/prefill_layer.py [--tokens 512] [--threads 1] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine_speed import cpu_kind, matmul_peak  # noqa: E402  (benchmarks/ is sys.path[0])
from laser.model.linear import GatedLinear, Linear  # noqa: E402
from laser.model.llama import LlamaModel  # noqa: E402
from laser.model.loader import load_config, load_weights, resolve_model  # noqa: E402
from laser.model.prefill import blocked_causal_attention  # noqa: E402
from laser.model.quant import QuantLinear, quantize_int4  # noqa: E402
from laser.model.prefill_kernel import load_kernel, prefill_attention_kernel  # noqa: E402


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable in ``fns``, timed round-robin ``repeats`` times after a warm-up."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def plain_weights(weights: dict, i: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer ``i``'s matmul weights [N, K] as the model stacks them (QKV, O, gate+up, down), plain
    (not packed) in ``dtype``, from the HF-named ``weights``."""
    p = f"model.layers.{i}."
    cat = lambda *ns: torch.cat([weights[p + n] for n in ns]).to(dtype).contiguous()  # noqa: E731
    return {"qkv": cat(*(f"self_attn.{x}_proj.weight" for x in "qkv")), "o": cat("self_attn.o_proj.weight"),
            "gate_up": cat("mlp.gate_proj.weight", "mlp.up_proj.weight"), "down": cat("mlp.down_proj.weight")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bf = torch.bfloat16
    path = resolve_model(None)
    c = load_config(path)
    weights = load_weights(path)
    m = LlamaModel(c, weights, bf)
    L, T = m.layers[0], args.tokens
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, c.hidden_size, generator=g).to(bf)
    attn = torch.randn(T, c.num_heads, c.head_dim, generator=g).to(bf)
    cos, sin = m.rope_cos[:T], m.rope_sin[:T]
    q, k, v = m.qkv_of(L, h, cos, sin)
    sd = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    mats = {"qkv": (L.qkv, c.hidden_size), "o": (L.o, c.q_size), "gate_up": (L.gate_up, c.hidden_size),
            "down": (L.down, c.intermediate_size)}
    xs = {n: torch.randn(T, kk, generator=g).to(bf) for n, (_, kk) in mats.items()}
    plain = plain_weights(weights, 0, bf)
    fns = {}
    for n, (lin, _) in mats.items():
        fns[n] = (lambda lin=lin, x=xs[n]: lin.swiglu(x)) if isinstance(lin, GatedLinear) else \
            (lambda lin=lin, x=xs[n]: lin(x))
        fns[n + " plain"] = lambda w=plain[n], x=xs[n]: F.linear(x, w)
    fns["attention flash"] = lambda: F.scaled_dot_product_attention(*sd, is_causal=True, enable_gqa=True)
    fns["attention blocked"] = lambda: blocked_causal_attention(q, k, v)
    kern = load_kernel()
    attns = ["attention flash", "attention blocked"] + (["attention kernel"] if kern is not None else [])
    if kern is not None:  # the C++ kernel (AVX512-BF16 only)
        fns["attention kernel"] = lambda: prefill_attention_kernel(kern, q, k, v)
    for n in mats:  # auto's int4 layers past the crossover
        ql = QuantLinear(quantize_int4(plain[n].float()))
        ql.dense = Linear(ql.dense_weight(bf).contiguous())  # the packed copy (kernel_rows.dense_copy)
        x, dense = xs[n], ql.dense_weight(bf).contiguous()
        fns[n + " int4 packed copy"] = lambda ql=ql, x=x: ql.dense_matmul(x)
        fns[n + " int4 plain copy"] = lambda w=dense, x=x: F.linear(x, w)
        fns[n + " int4 per call"] = lambda ql=ql, x=x: F.linear(x, ql.dense_weight(bf))
        fns[n + " int4 kernel"] = lambda ql=ql, x=x: ql.weight_only(x)
    fns["qkv_of"] = lambda: m.qkv_of(L, h, cos, sin)
    fns["finish_of"] = lambda: m.finish_of(L, h, attn)
    fns["head last row"] = lambda: m.compute_logits(h[-1:])
    fns["head all rows"] = lambda: m.compute_logits(h)
    with torch.inference_mode():
        peak = matmul_peak(bf)
        t = interleaved(fns, args.repeats)
    print(f"{cpu_kind()}; {torch.get_num_threads()} threads; {T} tokens; bf16 peak {peak / 1e9:.1f} GFLOP/s (2048^3)")
    for n, (lin, kk) in mats.items():
        fl = 2 * T * kk * lin.shape[0]
        print(f"  {n:8s} [{T}x{kk}] x [{kk}x{lin.shape[0]}]: {t[n] * 1e3:6.2f} ms = {fl / t[n] / peak:4.0%} of peak; "
              f"F.linear on the plain weight {t[n + ' plain'] / t[n]:.2f}x the time")
    for n, (lin, kk) in mats.items():
        fl = 2 * T * kk * lin.shape[0]
        print(f"  {n:8s} int4 (auto): " + ", ".join(
            f"{w} {t[f'{n} int4 {w}'] * 1e3:.2f} ms ({fl / t[f'{n} int4 {w}'] / peak:.0%})"
            for w in ("packed copy", "plain copy", "per call", "kernel")))
    afl = 2 * 2 * c.q_size * T * (T + 1) / 2
    for n in attns:
        print(f"  {n:18s}: {t[n] * 1e3:6.2f} ms = {afl / t[n] / peak:4.0%} of peak")
    glue_a = t["qkv_of"] - t["qkv"]
    glue_b = t["finish_of"] - t["o"] - t["gate_up"] - t["down"]
    act = "" if isinstance(L.gate_up, GatedLinear) else "+SiLU*up"
    print(f"  glue: norm+RoPE {glue_a * 1e3:.2f} ms, residuals+norm{act} {glue_b * 1e3:.2f} ms"
          + (" (gate_up: SiLU * up in its epilogues)" if not act else ""))
    layer = t["qkv_of"] + t["finish_of"]
    for n in attns:
        tot = layer + t[n]
        mm = sum(t[x] for x in mats)
        print(f"  layer with {n}: {tot * 1e3:.2f} ms (matmuls {mm / tot:.0%}, attention {t[n] / tot:.0%}, glue "
              f"{(glue_a + glue_b) / tot:.0%}); {c.num_layers} layers at {T / (tot * c.num_layers):.0f} tok/s")
    print(f"  LM head: last row {t['head last row'] * 1e3:.2f} ms, all {T} rows {t['head all rows'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
