"""Where a batch-1 decode step goes, part by part, at 1 and at 2 threads (issue 26, helper b1t24).

Two bf16 engines on the embedded SmolLM2 GGUF (``--quantization auto``), one built at each thread
count (inductor specializes its C++ kernels on ``torch.get_num_threads()``), timed alternately in one
process. Per round and thread count: the median wall time of batch-1 decode steps (short prompt, as
``llamacpp_compare.py``'s decode runs), then each part swept over the 30 layers on the engine's own
last decode inputs (hidden state, attention metadata, KV cache): the int4 matmuls alone (the layer's
four ``QuantLinear`` calls at one row), graphs A and B (int4 calls + inductor's fused glue),
attention (K/V write + C++ kernel), the whole ``forward_layer`` (the Python between the pieces
included), the LM head (final norm + int8 head) and greedy sampling. "rest" = step - layers - head -
sampling (the scheduler, the walk, metadata, the step's fixed cost). Prints a table of us per step.

    python benchmarks/b1_step_parts.py [--rounds 5] [--steps 24] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["LASER_FUSED_DECODE"] = "1"

import torch  # noqa: E402

from laser.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from laser.core.request import SamplingParams  # noqa: E402
from laser.frontend.engine import Engine  # noqa: E402


def build(threads: int) -> Engine:
    """The bf16 ``auto`` engine at ``threads`` torch threads, with a hook keeping the last
    ``forward_layer`` call's (hidden, meta) on ``engine._last``."""
    torch.set_num_threads(threads)
    e = Engine(None, policy="vllm", dtype="bfloat16", quantization="auto",
               scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096),
               cache=CacheConfig(kv_cache_gib=0.25, enable_prefix_caching=False))
    m = e.model
    fwd = m.forward_layer

    def hooked(i, hidden, meta):
        e._last = (hidden, meta)
        return fwd(i, hidden, meta)
    m.forward_layer = hooked
    e._hooked = hooked
    e._plain = fwd
    return e


def decode_steps(e: Engine, steps: int, prompt_len: int = 24) -> float:
    """Median us of ``steps`` batch-1 decode steps (after the prefill), hook off while timed."""
    g = torch.Generator().manual_seed(1)
    e.add_request(torch.randint(100, 20000, (prompt_len,), generator=g).tolist(),
                  SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    while e.scheduler.waiting or any(r.num_output_tokens == 0 for r in e.scheduler.running):
        e.step()
    e.step()  # one decode step with the hook: its inputs are what the parts replay
    e.model.forward_layer = e._plain
    times = []
    while e.has_unfinished():
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    e.model.forward_layer = e._hooked
    return 1e6 * statistics.median(times)


def sweep(fn, reps: int) -> float:
    """Median us of ``fn()`` over ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


@torch.inference_mode()
def parts(e: Engine, reps: int) -> dict[str, float]:
    """us per step of each part (30 layers where per layer), on the engine's last decode inputs."""
    m, f = e.model, e.model.fused
    hidden, meta = e._last
    n = len(m.layers)
    q, k, v = f.qkv(0, hidden, meta.cos, meta.sin)
    attn = m.attend(0, q, k, v, meta)
    x1 = hidden.contiguous()
    xd = torch.zeros(1, m.config.intermediate_size, dtype=m.dtype)
    xo = attn.reshape(1, -1).contiguous()
    out = {}

    def int4():
        for L in m.layers:
            L.qkv(x1), L.o(xo), L.gate_up(x1), L.down(xd)
    out["int4 matmuls (4/layer)"] = sweep(int4, reps)
    out["graph A (norm+qkv+rope)"] = sweep(lambda: [f.qkv(i, hidden, meta.cos, meta.sin) for i in range(n)], reps)
    out["attention (kv write+kernel)"] = sweep(lambda: [m.attend(i, q, k, v, meta) for i in range(n)], reps)
    out["graph B (o+norm+mlp)"] = sweep(lambda: [f.finish(i, hidden, attn) for i in range(n)], reps)
    out["forward_layer x30"] = sweep(lambda: [e._plain(i, hidden, meta) for i in range(n)], reps)
    out["LM head (norm+int8)"] = sweep(lambda: m.compute_logits(hidden), reps)
    logits = m.compute_logits(hidden)
    req = next(iter(e.scheduler.running), None)
    if req is not None:
        out["sampling"] = sweep(lambda: e.runner.sampler.sample(logits, [req]), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    engines = {t: build(t) for t in (1, 2)}
    rows: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    for r in range(args.rounds):
        for t in ((1, 2) if r % 2 == 0 else (2, 1)):
            torch.set_num_threads(t)
            e = engines[t]
            step = decode_steps(e, args.steps)
            last = e._last
            # a request still running for the sampler's params: add one and prefill it
            e.add_request([101, 102, 103], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            e.step()
            e._last = last
            p = parts(e, args.reps)
            while e.has_unfinished():
                e.step()
            p["whole step"] = step
            for key, us in p.items():
                rows[t].setdefault(key, []).append(us)
    print(f"{'part (us per step)':32s} {'1 thread':>10s} {'2 threads':>10s} {'t1/t2':>7s}")
    med = {t: {k: statistics.median(v) for k, v in rows[t].items()} for t in (1, 2)}
    for key in med[1]:
        a, b = med[1][key], med[2].get(key, float("nan"))
        print(f"{key:32s} {a:10.0f} {b:10.0f} {a / b:7.2f}")
    for t in (1, 2):
        d = med[t]
        rest = d["whole step"] - d["forward_layer x30"] - d["LM head (norm+int8)"] - d.get("sampling", 0)
        glue_a = d["graph A (norm+qkv+rope)"] + d["graph B (o+norm+mlp)"] - d["int4 matmuls (4/layer)"]
        py = d["forward_layer x30"] - d["graph A (norm+qkv+rope)"] - d["graph B (o+norm+mlp)"] - d["attention (kv write+kernel)"]
        print(f"{t} thread(s): fused glue in A+B {glue_a:.0f} us, Python between layer pieces {py:.0f} us, "
              f"rest of the step (scheduler, walk, metadata, fixed) {rest:.0f} us")


if __name__ == "__main__":
    main()
