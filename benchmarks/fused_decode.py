"""Fused decode layers (``laser.model.fused``) vs the eager layers, on one engine, interleaved.

One bf16 (``--dtype``) engine serving the embedded SmolLM2 GGUF under ``--quantization auto`` is built with the
fused graphs; each round times decode steps of every batch size with the graphs on and off in
turn (``model.fused`` swapped: the same weights, KV pool and scheduler; the order alternates per
round), so both paths see the same machine state. Prints the median ms per decode step of each,
their ratio, the greedy agreement of the two paths on a few prompts (tokens and the max abs
logit difference at the first decode step), and the graphs' compile time cold (an empty inductor
cache) and warm (the cache filled).

    python benchmarks/fused_decode.py [--threads 1] [--dtype bfloat16|float32] [--batches 1,4] [--rounds 15]
        [--steps 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["LASER_FUSED_DECODE"] = "1"

import torch  # noqa: E402

from laser.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from laser.core.request import SamplingParams  # noqa: E402
from laser.frontend.engine import Engine  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "List three prime numbers:", "Once upon a time"]


def make_engine(dtype: str = "bfloat16") -> Engine:
    return Engine(None, policy="vllm", dtype=dtype, quantization="auto",
                  scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096),
                  cache=CacheConfig(kv_cache_gib=0.25, enable_prefix_caching=False))


def fused_engine(threads: int, dtype: str = "bfloat16") -> tuple[Engine, object]:
    """The ``dtype`` (bfloat16 or float32) ``auto`` engine of :func:`make_engine` on ``threads``
    torch threads, and its ``FusedDecode``; exits with a message where the model/CPU has no fused
    decode layers."""
    torch.set_num_threads(threads)
    engine = make_engine(dtype)
    if engine.model.fused is None:
        raise SystemExit("no fused decode layers on this model/CPU (see the startup log)")
    return engine, engine.model.fused


def step_ms(engine: Engine, batch: int, steps: int, prompt_len: int = 64) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` requests (after their prefill)."""
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(100, 20000, (prompt_len,), generator=g).tolist(), sp)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def agreement(engine: Engine, fused, tokens: int = 32) -> tuple[int, int, float]:
    """Greedy tokens equal (of all), fused vs eager, over :data:`PROMPTS` decoded together, and
    the max abs logit difference at the first decode step (both paths on the same prefill)."""
    out, first = {}, {}
    runner = engine.runner
    execute = runner.execute
    for mode in ("eager", "fused"):
        engine.model.fused = fused if mode == "fused" else None
        steps = []
        runner.execute = lambda plan, reqs, stop_at=None, return_logits=False: steps.append(
            execute(plan, reqs, stop_at, True)) or steps[-1]
        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        reqs = [engine.add_request(engine.tokenizer.encode(p), sp) for p in PROMPTS]
        while engine.has_unfinished():
            engine.step()
        del runner.execute
        out[mode] = [r.output_token_ids for r in reqs]
        first[mode] = [steps[1].logits[r.req_id] for r in reqs]  # step 0 prefills every prompt
    engine.model.fused = fused
    same = sum(a == b for x, y in zip(out["eager"], out["fused"]) for a, b in zip(x, y))
    total = sum(len(x) for x in out["eager"])
    return same, total, max((a - b).abs().max().item() for a, b in zip(first["eager"], first["fused"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-cold", action="store_true", help="skip timing a compile into an empty cache")
    args = ap.parse_args()
    engine, fused = fused_engine(args.threads, args.dtype)
    from laser.model.fused import FusedDecode

    warm = FusedDecode(engine.model).seconds
    cold = float("nan")
    if not args.no_cold:
        saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        with tempfile.TemporaryDirectory() as d:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
            cold = FusedDecode(engine.model).seconds
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved or ""
    print(f"{args.threads} torch threads; {fused.graphs} graphs, rows up to {fused.qkv_rows}/{fused.finish_rows}; "
          f"compile cold {cold:.1f} s, warm (from the cache) {warm:.1f} s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    res = {(b, m): [] for b in batches for m in ("eager", "fused")}
    for r in range(args.rounds + 1):
        for b in batches:
            for mode in (("eager", "fused") if r % 2 else ("fused", "eager")):
                engine.model.fused = fused if mode == "fused" else None
                ms = step_ms(engine, b, args.steps)
                if r:  # round 0 warms up
                    res[b, mode].append(ms)
    engine.model.fused = fused
    for b in batches:
        e, f = statistics.median(res[b, "eager"]), statistics.median(res[b, "fused"])
        ratios = sorted(x / y for x, y in zip(res[b, "fused"], res[b, "eager"]))
        print(f"batch {b}: eager {e:.2f} ms/step, fused {f:.2f} ms/step -> fused/eager {f / e:.3f} "
              f"(per-round ratios: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f})")
    same, total, diff = agreement(engine, fused)
    print(f"greedy agreement, {len(PROMPTS)} prompts x 32 tokens decoded together: {same}/{total} tokens equal; "
          f"first decode step's logits max abs diff {diff:.4f}")


if __name__ == "__main__":
    main()
