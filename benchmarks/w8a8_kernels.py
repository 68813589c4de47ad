"""Decode matmul kernels on SmolLM2-135M's shapes, cache-cold: int8 activations x int8 weights
(W8A8 dynamic) against the weight-only int4 / int8 kernels Laser runs today.

Each shape gets ``--layers`` distinct weights (a real decode step reads 30 layers' worth, ~100 MB
at int8, past the last-level cache), and one timed round calls every copy once; the figure is
the median per-call time in microseconds over ``--repeats`` rounds, candidates interleaved
within each round. Candidates (x ``[M, K]`` bf16 in, ``[M, N]`` out):

- ``int4``: ``aten._weight_int4pack_mm_for_cpu`` (group 32, bf16 activations) -- Laser's auto;
- ``int8w``: ``aten._weight_int8pack_mm`` (per-channel int8 weight, bf16 activations);
- ``imm_nk`` / ``imm_kn``: ``torch._int_mm(xq, W)`` with W the int8 ``[N, K]`` weight transposed
  (a column-major view) or stored ``[K, N]`` row-major; ``xq`` int8 per row (amax / 127);
- ``onednn``: ``onednn.qlinear_pointwise`` over ``qlinear_prepack``'s weight (u8 activations with zero point 128, x scale 1.0,
  per-channel weight scales, fp32 output; the per-row x scale multiplied afterwards);
- ``dense``: bf16 ``F.linear`` over the dequantized weight (what rows past the crossover run);
- ``gemv``: Laser's :class:`~laser.model.quant.QuantLinear` int8 decode path (compiled GEMV,
  fp32 activations; the Q8_0 head's kernel today);
- ``fbgemm``: ``quantized.linear_dynamic`` (deprecated API; reference);
- ``q_act``: the eager per-row activation quantization alone (amax, divide, round, clamp, cast),
  and ``+q`` columns add it (plus the output scaling) to the int8 x int8 kernels.

Usage: ``python benchmarks/w8a8_kernels.py --threads 1 --rows 1,2,4,8``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scale [M, 1]) symmetric per row (amax / 127)."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(xf / s).clamp(-127, 127).to(torch.int8), s


def build(N: int, K: int, copies: int, methods: list[str]) -> dict[str, list]:
    """Per method, ``copies`` distinct weights of [N, K] in that kernel's layout."""
    out: dict[str, list] = {m: [] for m in methods}
    for _ in range(copies):
        w = torch.randn(N, K) * 0.05
        ws = w.abs().amax(dim=1) / 127.0
        q = torch.round(w / ws[:, None]).clamp(-127, 127).to(torch.int8)
        for m in methods:
            if m == "int4":
                q4 = torch.randint(0, 16, (N, K), dtype=torch.int32)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
                sz = torch.rand(K // 32, N, 2).to(torch.bfloat16)
                out[m].append((packed, sz))
            elif m == "int8w":
                out[m].append((q.contiguous(), ws.to(torch.bfloat16)))
            elif m == "imm_nk":
                out[m].append((q.contiguous(), ws))
            elif m == "imm_kn":
                out[m].append((q.t().contiguous(), ws))
            elif m == "onednn":
                out[m].append((torch.ops.onednn.qlinear_prepack(q, None), ws, torch.zeros(N, dtype=torch.int64)))
            elif m == "dense":
                out[m].append((q.to(torch.bfloat16) * ws.to(torch.bfloat16)[:, None]).contiguous())
            elif m == "gemv":  # Laser's int8 decode kernel today (the Q8_0 head's)
                from laser.model.quant import QuantLinear, QWeight

                os.environ.setdefault("LASER_QUANT_GEMV", "compiled")
                lin = QuantLinear(QWeight("int8", q, ws, source="bench"))
                lin.warm_up()
                out[m].append(lin)
            elif m == "fbgemm":
                qw = torch.quantize_per_channel(w, ws.double(), torch.zeros(N, dtype=torch.int64), 0, torch.qint8)
                out[m].append(torch.ops.quantized.linear_prepack(qw, None))
    return out


def call(m: str, x: torch.Tensor, xq, sx, op) -> torch.Tensor:
    """One matmul of method ``m``; ``xq``/``sx`` are precomputed (None: quantize here)."""
    if m == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, op[0], 32, op[1])
    if m == "int8w":
        return torch.ops.aten._weight_int8pack_mm(x, op[0], op[1])
    if m == "gemv":
        return op.kernel(x)
    if m == "dense":
        return torch.nn.functional.linear(x, op)
    if m == "fbgemm":
        return torch.ops.quantized.linear_dynamic(x.float(), op)
    if m == "q_act":
        return quant_rows(x)[0]
    base = m.removesuffix("+q")
    if xq is None or base != m:
        xq, sx = quant_rows(x)
    if base == "imm_nk":
        acc = torch._int_mm(xq, op[0].t())
    elif base == "imm_kn":
        acc = torch._int_mm(xq, op[0])
    else:  # onednn
        xu = (xq.to(torch.int16) + 128).to(torch.uint8)  # oneDNN's fast path takes u8 activations
        y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, op[0], op[1], op[2], None, 1.0, 0, torch.float32,
                                               "none", [], "")
        return y if base == m else (y * sx).to(torch.bfloat16)
    return acc if base == m else (acc.float() * (sx * op[1])).to(torch.bfloat16)


def run(threads: int, rows: list[int], methods: list[str], copies: int, repeats: int, shapes: list[str]) -> None:
    torch.set_num_threads(threads)
    kernels = [m.removesuffix("+q") for m in methods if m != "q_act"]
    print(f"\n## {threads} thread(s); median us per call over {copies} distinct weights (head: 1 copy)")
    print("| shape | rows | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 2) + "|")
    for name in shapes:
        N, K = SHAPES[name]
        n = 1 if name == "head" else copies
        ws = build(N, K, n, sorted(set(kernels)))
        for M in rows:
            x = torch.randn(M, K).to(torch.bfloat16)
            xq, sx = quant_rows(x)
            times = {m: [] for m in methods}
            reps = repeats * (3 if name == "head" else 1)
            with torch.inference_mode():
                for r in range(reps + 1):
                    for m in methods:
                        ops = ws.get(m.removesuffix("+q"), [None] * n)
                        t = time.perf_counter()
                        for op in ops:
                            call(m, x, xq, sx, op)
                        if r:
                            times[m].append((time.perf_counter() - t) / len(ops))
            cells = [f"{statistics.median(times[m]) * 1e6:.1f}" for m in methods]
            print(f"| {name} {N}x{K} | {M} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--methods", default="int4,int8w,imm_nk,imm_kn,onednn,fbgemm,q_act,imm_kn+q,onednn+q")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    print(f"torch {torch.__version__}; {torch.backends.cpu.get_cpu_capability()}")
    for t in map(int, a.threads.split(",")):
        run(t, [int(r) for r in a.rows.split(",")], a.methods.split(","), a.layers, a.repeats, a.shapes.split(","))


if __name__ == "__main__":
    main()
