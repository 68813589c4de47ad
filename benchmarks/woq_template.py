"""Inductor's C++ GEMM templates for weight-only int4 / int8 against the kernels Laser runs, on
SmolLM2-135M's shapes (AMD EPYC notes in docs/benchmarks.md, "inductor's C++ GEMM templates").

- int4 layer shapes: ``aten._weight_int4pack_mm_for_cpu`` (Laser's ``auto``) against the same op
  compiled by ``torch.compile`` over a frozen weight in max-autotune mode with the ``CPP`` backend
  only, which lowers it to ``CppWoqInt4GemmTemplate`` (AVX512 micro-kernel). Hot: the weight in
  cache; cold: a 48 MiB buffer written before each call (pessimistic: dirty lines to write back).
- int8 LM head (49152 x 576): Laser's compiled GEMV (:class:`laser.model.quant.CompiledGemv`,
  fp32 activations), aten's ``_weight_int8pack_mm`` and the frozen C++ template
  (:class:`laser.model.frozen_gemm.FrozenInt8Gemm`), three copies cycled (cache-cold).

Figures: median microseconds per call, candidates interleaved in one process; ratio = template /
Laser's kernel. Usage: ``python benchmarks/woq_template.py --threads 1 --rows 1,2,4,8``.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
_FLUSH = torch.empty(48 << 20, dtype=torch.uint8)


class _Int4(torch.nn.Module):
    """One random int4 weight [N, K] (group 32) as buffers, so that a compile freezes it."""

    def __init__(self, N: int, K: int):
        super().__init__()
        q4 = torch.randint(0, 16, (N, K), dtype=torch.int32)
        self.register_buffer("w", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1))
        self.register_buffer("sz", (torch.rand(K // 32, N, 2) * 0.1).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, 32, self.sz)


def median_us(fns: list, x: torch.Tensor, cold: bool, n: int) -> float:
    """Median time of one call (us) over ``n`` rounds of every callable in ``fns`` on ``x``."""
    ts = []
    for _ in range(n):
        for f in fns:
            if cold:
                _FLUSH.add_(1)
            t = time.perf_counter()
            f(x)
            ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def int4_rows(rows: list[int], n: int) -> None:
    """Print aten vs the int4 template per layer shape and row count, hot and cold."""
    import torch._inductor.config as cfg

    for name, (N, K) in SHAPES.items():
        for M in rows:
            torch._dynamo.reset()
            m, x = _Int4(N, K).eval(), torch.randn(M, K).to(torch.bfloat16)
            with cfg.patch(max_autotune=True, max_autotune_gemm_backends="CPP", freezing=True):
                c = torch.compile(m, dynamic=False)
                c(x)
            t = [median_us([f], x, cold, n) for cold in (False, True) for f in (m, c)]
            print(f"int4 {name:8s} rows {M}: hot aten {t[0]:7.1f} template {t[1]:7.1f} ({t[1] / t[0]:.2f}x) | "
                  f"cold aten {t[2]:7.1f} template {t[3]:7.1f} ({t[3] / t[2]:.2f}x)", flush=True)


def int8_head(rows: list[int], n: int) -> None:
    """Print the LM head's three int8 kernels per row count, three weights cycled."""
    from laser.model.frozen_gemm import FrozenInt8Gemm
    from laser.model.quant import QuantLinear, quantize_int8

    lins = [QuantLinear(quantize_int8(torch.randn(49152, 576) * 0.05)) for _ in range(3)]
    for lin in lins:
        lin.warm_up()
    frozen = [FrozenInt8Gemm(lin.packed, lin.scales) for lin in lins]
    aten = [lambda x, lin=lin: torch.ops.aten._weight_int8pack_mm(x, lin.packed, lin.scales) for lin in lins]
    for M in rows:
        x = torch.randn(M, 576).to(torch.bfloat16)
        g, a, f = (median_us(fs, x, False, n) for fs in ([lin.weight_only for lin in lins], aten, frozen))
        print(f"int8 head rows {M}: compiled GEMV {g:7.0f} aten {a:7.0f} template {f:7.0f} us "
              f"({f / g:.2f}x the GEMV)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=100, help="calls per median (int4); a tenth for the head")
    ap.add_argument("--only", choices=("int4", "head"), default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}")
    with torch.no_grad():
        if args.only != "head":
            int4_rows(rows, args.repeats)
        if args.only != "int4":
            int8_head(rows, max(5, args.repeats // 10))


if __name__ == "__main__":
    main()
