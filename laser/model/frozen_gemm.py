"""A bf16 model's int8 LM head at decode rows through inductor's C++ GEMM template.

torch's inductor lowers ``aten._weight_int8pack_mm`` over a *constant* weight (a frozen graph:
``torch._inductor.config.freezing``) in max-autotune mode to its C++ GEMM template
(``CppGemmTemplate``, ``torch/_inductor/quantized_lowerings.py``): the weight is re-packed once
into ``[N / 32, K, 32]`` blocks, the output columns are split over the OpenMP threads in blocks of
32, and a register-blocked micro-kernel (AVX512 here) widens the int8 weight to fp32 and
accumulates ``x[m, k] * q[n, k]`` over ``k`` in order, the per-channel scale applied as an
epilogue before the bf16 store. Inductor's own generated code (torch's compiler), no
hand-written kernel.

Measured on an AMD EPYC (AVX512-BF16 + VNNI, no AMX), the 49152 x 576 SmolLM2 head, cache-cold
(three copies cycled), against :class:`laser.model.quant.CompiledGemv` (fp32 activations):
1 thread 0.81-0.85x the time at 1 row (2.2 vs 2.75 ms), 0.46x at 2 rows, 0.70x at 4; 2 threads
0.79-0.86x at 1 row (1.2 vs 1.45 ms), 0.46x at 2, 0.64x at 4. The same template for the int4
layer weights (``CppWoqInt4GemmTemplate``) was 1.2-3x *slower* than aten's int4 kernel at 1-8
rows on every SmolLM2 layer shape (docs/benchmarks.md), so the layers keep aten's kernel.

Batch invariance: one graph per row count (1 and :data:`~laser.model.quant.GEMV_BLOCK`, blocks
padded with zero rows as for the compiled GEMV); a row's accumulation order over ``k`` does not
depend on the other rows (the micro-kernel keeps one accumulator per row and column and never
splits ``k`` over threads at these shapes), so a row's logits are bit-equal alone, in a block or
beside padding (checked in tests/model/test_frozen_gemm.py). Only for bf16 models: the template
rounds activations to bf16, as aten's kernel does, where the fp32 compiled GEMV does not.

Costs: inductor does not cache frozen graphs on disk (``FxGraphCache`` bypasses graphs with
frozen constants), so every start compiles the two graphs again (engine start +0.4-0.7 s here once
the C++ build is cached; 5-18 s a graph the first time); the re-packed weight replaces the compiled
GEMV's packed copy (same size).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from .loader import use_inductor_cache_dir
from .quant import GEMV_BLOCK, QuantLinear, in_blocks

log = logging.getLogger(__name__)


def head_template_enabled() -> bool:
    """Whether a bf16 model's int8 LM head runs :class:`FrozenInt8Gemm`: ``$LASER_QUANT_GEMV`` is
    ``template`` (the default; ``compiled`` keeps the compiled GEMV, ``aten`` torch's kernel)."""
    return os.environ.get("LASER_QUANT_GEMV", "template") == "template"


def _compile_frozen(q: torch.Tensor, scales: torch.Tensor, rows: int):
    """``aten._weight_int8pack_mm(x, q, scales)`` for bf16 ``x`` [rows, K] with ``q`` int8 [N, K]
    and ``scales`` bf16 [N] frozen into the graph, compiled by inductor with its C++ GEMM template
    as the only candidate. Returns the callable ``x -> [rows, N] bf16``.

    Raises:
        RuntimeError: inductor chose no C++ template (e.g. K not a multiple of its block);
        whatever inductor raises otherwise.
    """
    from torch._inductor import compile as inductor_compile
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    def head(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, q, scales)

    use_inductor_cache_dir()
    example = torch.zeros(rows, q.shape[1], dtype=torch.bfloat16)
    with torch.inference_mode(False), torch.no_grad(), config.patch(
            max_autotune=True, max_autotune_gemm_backends="CPP", freezing=True):
        fn, code = run_and_get_code(lambda: inductor_compile(make_fx(head)(example), [example]))
    if not any("micro_gemm" in c for c in code):
        raise RuntimeError("inductor did not choose its C++ GEMM template")
    return fn


class FrozenInt8Gemm:
    """Decode rows of one int8 weight (``q`` int8 [N, K], ``scales`` bf16 [N]) through the frozen
    C++ GEMM graphs (module docstring): ``x`` [M, K] (any float dtype, cast to bf16) -> [M, N] bf16.

    Raises:
        RuntimeError / inductor's errors: compiling failed (at construction).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        q, scales = q.contiguous(), scales.to(torch.bfloat16).contiguous()
        self._graphs = {rows: _compile_frozen(q, scales, rows) for rows in (1, GEMV_BLOCK)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return in_blocks(x.to(torch.bfloat16).contiguous(), self._graphs.__getitem__)


def use_frozen_head(head: QuantLinear | None, dtype: torch.dtype) -> str:
    """Run the int8 LM head ``head`` of a ``dtype`` model through :class:`FrozenInt8Gemm` where
    :func:`head_template_enabled` and the model is bf16 and the head runs the compiled GEMV (whose
    packed copy it then drops); where compiling fails the head keeps the compiled GEMV. Returns a
    sentence for the startup log ("" where nothing changed)."""
    if head is None or head.gemv is None or dtype != torch.bfloat16 or not head_template_enabled():
        return ""
    t0 = time.perf_counter()
    try:
        head.frozen = FrozenInt8Gemm(head.packed, head.scales)
    except Exception as e:  # noqa: BLE001 -- inductor raises many kinds; the compiled GEMV still works
        log.warning("inductor's C++ GEMM template for the int8 LM head unavailable (%s: %s); keeping the "
                    "compiled GEMV", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return ""
    head.gemv, head.act_dtype = None, torch.bfloat16
    return (f"int8 LM head {head.qw.shape[0]}x{head.qw.shape[1]}: inductor's C++ GEMM template over the frozen "
            f"weight (rows 1 and {GEMV_BLOCK}, {time.perf_counter() - t0:.1f} s to compile; "
            f"LASER_QUANT_GEMV=compiled for the compiled GEMV)")
