"""Engine speed: Laser's layer-by-layer executor vs HF transformers, same weights and dtype.

Measures, interleaved in one run (so both see the same machine state):
  - decode tokens/s at batch 1 and 32 (greedy, after the prefill);
  - prefill tokens/s at 512 prompt tokens (one request);
  - the machine's memory read bandwidth (a sum over a tensor far larger than the caches),
    and from it the batch-1 decode limit: bandwidth / bytes read per step (all weights,
    LM head included, plus the K/V read), and the fraction of it each engine reaches;
  - the machine's matmul peak (a large square matmul in the run's dtype, best of several)
    and from it the compute limit of a prefill: its FLOPs (every layer's projections and
    MLP over the prompt, causal attention, the LM head for the last token) over the peak,
    the fraction of it each engine reaches, and the highest laser/HF ratio that limit allows.
Prints our/HF ratios. Targets (issue 15): decode >= 1.5x HF at batch 1 and 32, prefill
>= 1.3x at 512 tokens (bf16 on an AMX CPU, fp32 on an AVX2-only one).

``--quantizations none,int8,int4,auto`` runs one Laser engine per weight format of the
embedded GGUF (``auto``: the file's own, Q4_1 layers as int4 and the Q8_0 head as int8),
interleaved with each other and HF; the bandwidth limit of each counts the bytes its decode
step actually reads (quantized weights at their packed size). Issue 26's target: batch-1
decode >= 70 % of that limit.

    python benchmarks/engine_speed.py [--dtype float32] [--repeats 5] [--quantizations none,int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from laser.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from laser.frontend.engine import Engine  # noqa: E402
from laser.model.loader import resolve_model  # noqa: E402
from laser.core.request import SamplingParams  # noqa: E402


SWITCHES = ("LASER_QUANT_GEMV", "LASER_QUANT_ROWS", "LASER_FUSED_DECODE", "LASER_QUANT_W8A8",
            "LASER_PREFILL_ATTN", "LASER_PACKED_WEIGHTS", "LASER_QUANT_DENSE", "LASER_PREFILL_GLUE",
            "LASER_GATED_MLP")


@contextlib.contextmanager
def executor_switches(gemv: str = "", rows: str = "", fused: str = "", w8a8: str = "", attn: str = "",
                      packed: str = "", dense: str = "", glue: str = "", gated: str = ""):
    """Within the block, the executor switches read at model load: the int8 decode kernel
    (``template`` / ``compiled`` / ``aten``: ``$LASER_QUANT_GEMV``), the kernels' row crossover (``measure`` /
    ``fixed``: ``$LASER_QUANT_ROWS``), the fused decode layers (``0`` / ``1``:
    ``$LASER_FUSED_DECODE``), W8A8 int8 rows (``measure`` / ``on`` / ``off``:
    ``$LASER_QUANT_W8A8``), the bf16 prefill attention (``kernel`` / ``amx`` / ``blocked`` / ``sdpa``:
    ``$LASER_PREFILL_ATTN``), the oneDNN-packed bf16 weights (``on`` / ``off``:
    ``$LASER_PACKED_WEIGHTS``), the layout of the quantized weights' dense copies (``auto`` / ``packed`` /
    ``plain``: ``$LASER_QUANT_DENSE``), the compiled bf16 prefill glue (``1`` / ``0``: ``$LASER_PREFILL_GLUE``)
    and the MLP's SiLU * up in the matmul epilogues (``on`` / ``off``: ``$LASER_GATED_MLP``); an empty value leaves a switch as it is. Restored on exit."""
    saved = {k: os.environ.get(k) for k in SWITCHES}
    for k, v in zip(SWITCHES, (gemv, rows, fused, w8a8, attn, packed, dense, glue, gated)):
        if v:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch * 7919 + length)
    return [torch.randint(100, 20000, (length,), generator=g).tolist() for _ in range(batch)]


def ours_decode(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    sp = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    for p in prompts(batch, prompt_len):
        engine.add_request(p, sp)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill (and first token)
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t
    return batch * steps / dt


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        past = out.past_key_values
        t = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        dt = time.perf_counter() - t
    return batch * new_tokens / dt


def ours_prefill(engine: Engine, length: int) -> float:
    engine.add_request(prompts(1, length)[0], SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return length / (time.perf_counter() - t)


def hf_prefill(model, length: int) -> float:
    ids = torch.tensor(prompts(1, length))
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return length / (time.perf_counter() - t)


def read_bandwidth(nbytes: int = 1 << 29, tries: int = 3) -> float:
    """Best-of-``tries`` memory read bandwidth in bytes/s: ``sum`` over ``nbytes`` of fp32
    (512 MiB, far beyond any L3), with torch's threads."""
    a = torch.ones(nbytes // 4)
    a.sum()
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def matmul_peak(dtype: torch.dtype, n: int = 2048, tries: int = 5) -> float:
    """Best-of-``tries`` FLOP/s of one ``n`` x ``n`` by ``n`` x ``n`` matmul in ``dtype`` with
    torch's threads: the compute ceiling the prefill's large matmuls can approach."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def prefill_flops(engine: Engine, length: int) -> float:
    """FLOPs of a ``length``-token prefill: per layer the Q/K/V/O projections and the gated
    MLP over every token (2 FLOPs per multiply-add), causal attention (QK^T and PV over
    ``length * (length + 1) / 2`` query-key pairs), and the LM head for the last token only."""
    c = engine.model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token_layer = 2 * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    attention = 2 * 2 * q * length * (length + 1) / 2
    return c.num_layers * (per_token_layer * length + attention) + 2 * c.hidden_size * c.vocab_size


def decode_step_bytes(engine: Engine, context: int) -> int:
    """Bytes one batch-1 decode step must read: every weight once (LM head included) plus
    the request's K/V over ``context`` positions in every layer."""
    c = engine.model_config
    kv = 2 * c.num_layers * context * c.num_kv_heads * c.head_dim * engine.kv_cache.kv.element_size()
    return engine.model.weight_bytes() + kv


def cpu_kind() -> str:
    """CPU model name and its widest matmul features, from /proc/cpuinfo (Linux)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({os.cpu_count()} CPUs; {', '.join(feats) or 'no AVX2'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median is reported")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt length for the decode runs")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill-lens", default="512")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantizations", default="none",
                    help="comma-separated Laser weight formats to run side by side (none, int8, int4, auto; "
                         "auto:aten = auto with int8 decode rows through aten's kernel, not the compiled GEMV; "
                         "auto::fixed = auto with the kernels' default row crossover, not the measured one; "
                         "auto:::0 / auto:::1 = auto with the decode layers eager / fused, LASER_FUSED_DECODE; "
                         "auto::::off / auto::::on = int8 rows without / always with W8A8, LASER_QUANT_W8A8; "
                         "none:::::sdpa / none:::::blocked / none:::::kernel / none:::::amx = bf16 prefill attention "
                         "through the flash kernel / blocked matmuls / the C++ kernel / the flash kernel for whole "
                         "prompts (the default on AMX), LASER_PREFILL_ATTN; none::::::off / none::::::on = bf16 weights "
                         "plain / oneDNN-packed, LASER_PACKED_WEIGHTS; auto:::::::plain / auto:::::::packed = the quantized "
                         "weights' dense copies plain / oneDNN-packed, LASER_QUANT_DENSE; none::::::::0 / none::::::::1 = "
                         "bf16 prefill glue eager / compiled, LASER_PREFILL_GLUE; none:::::::::off / none:::::::::on = "
                         "the MLP's SiLU * up apart / in the matmul epilogues, LASER_GATED_MLP)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = resolve_model(None)
    quants = args.quantizations.split(",")

    def make_engine(q: str) -> Engine:
        """``q``: a quantization, or ``<quantization>:<gemv>[:<rows>[:<fused>[:<w8a8>[:<attn>[:<packed>[:<dense>[:<glue>[:<gated>]]]]]]]]`` with the
        int8 decode kernel (``compiled`` or ``aten``: ``$LASER_QUANT_GEMV``; empty: the default), the
        kernels' row crossover (``measure`` or ``fixed``: ``$LASER_QUANT_ROWS``), the fused decode
        layers (``0`` or ``1``: ``$LASER_FUSED_DECODE``), W8A8 int8 rows (``measure``, ``on``, ``off``:
        ``$LASER_QUANT_W8A8``), the bf16 prefill attention (``blocked`` or ``sdpa``:
        ``$LASER_PREFILL_ATTN``), the packed bf16 weights (``on`` or ``off``: ``$LASER_PACKED_WEIGHTS``)
        and the dense copies' layout (``packed`` or ``plain``: ``$LASER_QUANT_DENSE``) and the compiled prefill
        glue (``1`` or ``0``: ``$LASER_PREFILL_GLUE``) and the gated MLP (``on`` or ``off``: ``$LASER_GATED_MLP``)
        set while the engine is built."""
        q, _, opts = q.partition(":")
        gemv, _, opts = opts.partition(":")
        rows, _, opts = opts.partition(":")
        fused, _, opts = opts.partition(":")
        w8a8, _, opts = opts.partition(":")
        attn, _, opts = opts.partition(":")
        packed, _, opts = opts.partition(":")
        dense, _, opts = opts.partition(":")
        glue, _, gated = opts.partition(":")
        with executor_switches(gemv, rows, fused, w8a8, attn, packed, dense, glue, gated):
            return Engine(
                str(path) if q == "none" else None, policy="vllm", dtype=dtype, quantization=q,
                scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096),
                # 5.8k SmolLM2 tokens: the largest case needs 2.6k. No prefix cache: the repeats send the
                # same prompts, and a cache hit would skip the prefill being timed
                cache=CacheConfig(kv_cache_gib=0.25, enable_prefix_caching=False),
            )

    engines = {q: make_engine(q) for q in quants}
    engine = engines[quants[0]]
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    print(f"{cpu_kind()}; {args.dtype}; {torch.get_num_threads()} torch threads; laser weights "
          + ", ".join(f"{q}: {e.model.weights_tag}" for q, e in engines.items()), flush=True)
    rows = []
    cases = [("decode", int(b)) for b in args.batches.split(",")] + [("prefill", int(n)) for n in args.prefill_lens.split(",")]
    # warm-up all
    for e in engines.values():
        ours_decode(e, 2, 16, 4)
    if hf is not None:
        hf_decode(hf, 2, 16, 4)
    bandwidths, peaks = [], []
    nan = float("nan")
    for kind, x in cases:
        ours, theirs = {q: [] for q in quants}, []
        for _ in range(args.repeats):
            for q, e in engines.items():
                ours[q].append(ours_decode(e, x, args.prompt_len, args.new_tokens) if kind == "decode"
                               else ours_prefill(e, x))
            if kind == "decode":
                if hf is not None:
                    theirs.append(hf_decode(hf, x, args.prompt_len, args.new_tokens))
                if x == 1:
                    bandwidths.append(read_bandwidth())
            else:
                if hf is not None:
                    theirs.append(hf_prefill(hf, x))
                peaks.append(matmul_peak(dtype))
        h = statistics.median(theirs) if theirs else nan
        label = f"batch {x}" if kind == "decode" else f"{x} tokens"
        for q in quants:
            o = statistics.median(ours[q])
            rows.append({"kind": kind, "size": x, "quantization": q, "laser_tok_s": o, "hf_tok_s": h, "ratio": o / h,
                         "vs_none": o / statistics.median(ours["none"]) if "none" in ours else nan,
                         "laser_all": ours[q], "hf_all": theirs})
            print(f"{kind:8s} {label:12s} laser[{q}] {o:9.1f} tok/s   HF {h:9.1f} tok/s   ratio {o / h:5.2f}x   "
                  f"vs laser[none] {rows[-1]['vs_none']:5.2f}x", flush=True)
    bw = None
    if bandwidths:
        bw = statistics.median(bandwidths)
        print(f"memory read bandwidth {bw / 1e9:.1f} GB/s (median; max {max(bandwidths) / 1e9:.1f})")
        for q, e in engines.items():
            step = decode_step_bytes(e, args.prompt_len + args.new_tokens // 2)
            limit = bw / step
            b1 = next(r for r in rows if r["kind"] == "decode" and r["size"] == 1 and r["quantization"] == q)
            print(f"  laser[{q}]: {step / 1e6:.0f} MB read per batch-1 step -> limit {limit:.1f} tok/s; "
                  f"laser reaches {b1['laser_tok_s'] / limit:.0%}, HF (dense) {b1['hf_tok_s'] * step / bw:.0%} of its own")
            rows.append({"kind": "bandwidth", "quantization": q, "read_gb_s": bw / 1e9,
                         "all_gb_s": [b / 1e9 for b in bandwidths], "step_mb": step / 1e6, "limit_tok_s": limit,
                         "laser_fraction": b1["laser_tok_s"] / limit})
    if peaks:
        peak = statistics.median(peaks)
        print(f"matmul peak {peak / 1e9:.1f} GFLOP/s (median of {len(peaks)}; max {max(peaks) / 1e9:.1f}; "
              f"2048^3 {args.dtype})")
        for r in [r for r in rows if r["kind"] == "prefill"]:
            per_tok = prefill_flops(engine, r["size"]) / r["size"]
            limit = peak / per_tok
            r.update({"flops_per_token": per_tok, "compute_limit_tok_s": limit,
                      "laser_compute_fraction": r["laser_tok_s"] / limit, "hf_compute_fraction": r["hf_tok_s"] / limit,
                      "max_ratio_at_peak": limit / r["hf_tok_s"]})
            print(f"prefill[{r['quantization']}] {r['size']} tokens: {per_tok / 1e6:.0f} MFLOP per token -> compute limit {limit:.0f} tok/s; "
                  f"laser reaches {r['laser_compute_fraction']:.0%}, HF {r['hf_compute_fraction']:.0%}; "
                  f"at the peak laser/HF could be at most {r['max_ratio_at_peak']:.2f}x")
        rows.append({"kind": "matmul_peak", "gflop_s": peak / 1e9, "all_gflop_s": [p / 1e9 for p in peaks]})
    for e in engines.values():
        e.check_integrity(expect_empty=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_kind(), "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
