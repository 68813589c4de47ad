"""Decode attention through the fused graph D (``laser.model.fused``: its C++ kernel, or inductor's
graph) vs torch's SDPA, one engine.

One bf16 (or ``--dtype float32``) engine serving the embedded SmolLM2 GGUF under ``--quantization auto``
with the fused decode graphs; each round times decode steps of every batch size with each attention path in turn
(``model.fused.decode_attention`` / ``attention_kernel``: the same weights, KV pool and graphs A/B; the order alternates
per round; ``--modes``). Prints the median ms per decode step of each and their ratio to the first, then,
with ``--profile``, torch.profiler's top operators over a few batch-1 steps (graph D on).

    python benchmarks/decode_attention.py [--threads 1] [--dtype bfloat16|float32] [--batches 1,4,32] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["LASER_FUSED_DECODE"] = "1"

import torch  # noqa: E402

from fused_decode import fused_engine, step_ms  # noqa: E402  (benchmarks/ is the script's dir)

from laser.core.request import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model dtype: the cache, the kernel and SDPA run in it")
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--modes", default="sdpa,graph,kernel",
                    help="attention paths to alternate, the first the base of the ratios: sdpa (gather + "
                         "torch's SDPA), graph (inductor's graph D), kernel (graph D's C++ kernel)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of batch-1 steps")
    args = ap.parse_args()
    engine, fused = fused_engine(args.threads, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    kernel = fused.attention_kernel
    res = {(b, m): [] for b in batches for m in modes}
    for r in range(args.rounds + 1):
        for b in batches:
            for mode in (modes if r % 2 else modes[::-1]):
                fused.decode_attention = mode != "sdpa"
                fused.attention_kernel = kernel if mode == "kernel" else None
                ms = step_ms(engine, b, args.steps, args.prompt_len)
                if r:  # round 0 warms up
                    res[b, mode].append(ms)
    fused.decode_attention, fused.attention_kernel = True, kernel
    print(f"{args.dtype}, {args.threads} torch threads, prompts of {args.prompt_len} tokens, {args.rounds} rounds x "
          f"{args.steps} decode steps")
    base = modes[0]
    for b in batches:
        s = statistics.median(res[b, base])
        line = [f"batch {b}: {base} {s:.2f} ms/step ({1e3 / s * b:.1f} tok/s)"]
        for m in modes[1:]:
            d = statistics.median(res[b, m])
            ratios = sorted(x / y for x, y in zip(res[b, m], res[b, base]))
            line.append(f"{m} {d:.2f} ms/step -> {m}/{base} {d / s:.3f} (per-round {ratios[0]:.3f}-"
                        f"{ratios[-1]:.3f}; {1e3 / d * b:.1f} tok/s)")
        print("; ".join(line))
    if args.profile:
        profile_decode(engine, args.prompt_len, 20)


def profile_decode(engine, prompt_len: int, steps: int) -> None:
    """torch.profiler's operators (self CPU time) over ``steps`` batch-1 decode steps of one
    request of ``prompt_len`` random tokens (its prefill and first decode step not profiled)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    engine.add_request(torch.randint(100, 20000, (prompt_len,), generator=g).tolist(), sp)
    for _ in range(2):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        while engine.has_unfinished():
            engine.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
