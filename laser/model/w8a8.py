"""W8A8 dynamic: int8 activations (one scale per row) times a per-channel int8 weight.

The int8 x int8 products accumulate exactly in int32 on oneDNN's VNNI kernels
(``torch.ops.onednn.qlinear_pointwise`` over a weight packed once by ``qlinear_prepack``), as
llama.cpp multiplies its quantized weights with activations quantized to 8 bits (Q8 blocks).
Each activation row ``x[m]`` is quantized on its own, ``s[m] = max_k |x[m, k]| / 127`` and
``xq[m, k] = round(x[m, k] / s[m])`` in -127..127 (passed as uint8 ``xq + 128``, zero point 128:
oneDNN's fast path takes unsigned activations), so the result ``y[m, n] = s[m] * scale[n] *
sum_k xq[m, k] q[n, k]`` depends on row ``m`` alone: the kernel sees the activation scale 1.0 and
the weight's per-channel scales (one scale for the whole call), and the row scale multiplies its
fp32 output afterwards, elementwise. Integer accumulation is exact, so a row's result is
bit-equal whatever its batch (checked in ``tests/model/test_w8a8.py``).

Precision: the weight keeps its int8 per-channel integers (what ``QuantLinear`` holds for a
GGUF Q8_0 / Q6_K / Q5_x tensor under ``auto``, or any weight under ``--quantization int8``);
the activations lose to 8 bits per row (relative error about 1/254 of the row's largest value
per element; llama.cpp's Q8 blocks of 32 keep a little more).

Where it pays is measured per CPU kind and weight shape (:mod:`laser.model.kernel_rows`):
``QuantLinear.w8a8_min_rows`` is the smallest row count it runs (the int8 decode kernel below).
On the AVX512-BF16 + VNNI EPYC (1 thread, SmolLM2's 49k x 576 Q8_0 head, cache-cold) it ties the
compiled int8 GEMV at one row and takes 0.5x its time at 4 rows, 0.35x at 8 (docs/benchmarks.md,
"W8A8"). ``$LASER_QUANT_W8A8``: ``off`` (the default), ``measure`` (from the row count measured
per CPU kind) or ``on`` (every decode row of an int8 weight, no measurement); both only on a CPU
with VNNI (:func:`available`; elsewhere weight-only, with a warning for ``on``). Off by default:
end to end it gained 1-3 % (within this machine's noise) while the head's per-row activation
scales cost ~2.5 points of teacher-forced top-1 agreement with the unquantized model.
"""

from __future__ import annotations

import os

import torch

#: ``QuantLinear.w8a8_min_rows`` when W8A8 runs no rows.
OFF = 1 << 62


def w8a8_mode() -> str:
    """``$LASER_QUANT_W8A8``: ``off`` (default), ``measure`` or ``on``. Raises ValueError on another."""
    mode = os.environ.get("LASER_QUANT_W8A8", "off")
    if mode not in ("measure", "on", "off"):
        raise ValueError(f"LASER_QUANT_W8A8={mode!r}: use measure, on or off")
    return mode


def available() -> bool:
    """Whether W8A8 runs exactly here: this torch build has oneDNN's quantized linear ops and the CPU
    has AVX512-VNNI (``torch.cpu._is_vnni_supported``; AVX-VNNI alone is not checked for). Without
    VNNI oneDNN multiplies the uint8 activations by the int8 weight with AVX2's ``vpmaddubsw``,
    whose int16 sum of two products saturates (up to 2 * 255 * 127): on an AVX2-only AMD EPYC rows
    came out wrong by up to ~3x their own scale (``tests/model/test_w8a8.py``'s first test)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
            and torch.cpu._is_vnni_supported())


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 weight ``q`` [N, K] and fp32 per-channel ``scale`` [N] -> the operands of
    :func:`matmul`: oneDNN's packed weight (an opaque tensor, ~N*K bytes), the scales (fp32 [N])
    and zero points (int64 zeros [N]).

    Raises:
        RuntimeError: oneDNN's ops are missing (:func:`available`).
    """
    if not available():
        raise RuntimeError("this torch build has no oneDNN quantized linear (torch.ops.onednn.qlinear_pointwise)")
    packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
    return packed, scale.float().contiguous(), torch.zeros(q.shape[0], dtype=torch.int64)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (any float dtype) -> (uint8 [M, K] = ``round(x / s) + 128``, fp32 ``s`` [M, 1]),
    symmetric per row, ``s = max |x[m]| / 127`` (an all-zero row gets a tiny scale and zeros)."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127.0
    return (torch.round(xf / s) + 128.0).to(torch.uint8), s


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] @ w.T for the weight :func:`pack` packed -> fp32 [M, N] (no bias)."""
    xu, s = quantize_rows(x)
    y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, scale, zeros, None, 1.0, 0, torch.float32,
                                           "none", [], "")
    return y * s
