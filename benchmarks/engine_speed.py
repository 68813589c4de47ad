"""Engine speed: Laser's layer-by-layer executor vs HF transformers, same weights and dtype.

Measures, interleaved in one run (so both see the same machine state):
  - decode tokens/s at batch 1, 8, 32 (greedy, after the prefill);
  - prefill tokens/s at 128, 512, 2048 prompt tokens (one request).
Prints our/HF ratios. Targets (issue #2): decode >= 1.0x at batch 1, >= 3x at batch 32;
prefill >= 1.0x.

    .venv/bin/python benchmarks/engine_speed.py [--dtype float32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from laser.config import CacheConfig, SchedulerConfig  # noqa: E402
from laser.engine import Engine  # noqa: E402
from laser.model.loader import resolve_model  # noqa: E402
from laser.request import SamplingParams  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt length for the decode runs")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill-lens", default="128,512,2048")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = resolve_model(None)
    engine = Engine(
        str(path), policy="vllm", dtype=dtype,
        scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096),
        cache=CacheConfig(kv_cache_gib=1.0),
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    rows = []
    cases = [("decode", int(b)) for b in args.batches.split(",")] + [("prefill", int(n)) for n in args.prefill_lens.split(",")]
    # warm-up both
    ours_decode(engine, 2, 16, 4)
    hf_decode(hf, 2, 16, 4)
    for kind, x in cases:
        ours, theirs = [], []
        for _ in range(args.repeats):
            if kind == "decode":
                ours.append(ours_decode(engine, x, args.prompt_len, args.new_tokens))
                theirs.append(hf_decode(hf, x, args.prompt_len, args.new_tokens))
            else:
                ours.append(ours_prefill(engine, x))
                theirs.append(hf_prefill(hf, x))
        o, h = statistics.median(ours), statistics.median(theirs)
        rows.append({"kind": kind, "size": x, "laser_tok_s": o, "hf_tok_s": h, "ratio": o / h})
        label = f"batch {x}" if kind == "decode" else f"{x} tokens"
        print(f"{kind:8s} {label:12s} laser {o:9.1f} tok/s   HF {h:9.1f} tok/s   ratio {o / h:5.2f}x", flush=True)
    engine.check_integrity(expect_empty=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
