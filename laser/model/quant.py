"""Weight-only quantized linear layers on torch's own int8 / int4 matmul kernels.

A :class:`QWeight` holds one weight matrix ``[N, K]`` as integers plus scales:

- ``int8``: symmetric per output channel, ``w[n, k] = q[n, k] * scale[n]`` (``q`` int8);
- ``int4``: asymmetric per group of ``group_size`` inputs, ``w[n, k] = (q[n, k] - 8) *
  scale[n, g] + zero[n, g]`` with ``q`` in 0..15 and ``g = k // group_size`` -- the convention
  of ``torch.ops.aten._weight_int4pack_mm_for_cpu``. GGUF's Q4_0 (``d * (q - 8)``), Q4_1
  (``d * q + m``) and Q4_K (``d * sc * q - dmin * m`` per 32-group) map onto it exactly
  (``zero = 0``, ``m + 8 d`` and ``8 d sc - dmin m``).

:class:`QuantLinear` runs ``y = x @ w.T (+ b)`` with ``torch.ops.aten._weight_int8pack_mm`` /
``_weight_int4pack_mm_for_cpu`` for small row counts (decode), and with a dense matmul over
the weight dequantized on the fly for many rows (prefill), where the dense GEMM is faster.
Same role as gpt-fast's ``WeightOnlyInt8Linear`` / ``WeightOnlyInt4Linear`` and llama.cpp's
``ggml_mul_mat`` on quantized tensors (read, not copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("auto", "none", "int8", "int4")
INT4_GROUP = 32  # GGUF's block of 32 inputs (Q4_0 / Q4_1 / the sub-blocks of Q4_K)


@dataclass
class QWeight:
    """One quantized weight ``[N, K]`` (see the module docstring for the two formats).

    ``q``: int8 ``[N, K]`` (int8: -128..127; int4: 0..15). ``scale``: float32 ``[N]`` (int8) or
    ``[N, K / group_size]`` (int4). ``zero``: float32 ``[N, K / group_size]`` (int4 only).
    ``source``: where it came from (e.g. ``"Q4_1"``, ``"requantized"``), for logs.
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int = 0
    source: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype`` (computed in float32)."""
        if self.kind == "int8":
            return (self.q.float() * self.scale[:, None]).to(dtype)
        N, K = self.q.shape
        g = self.group_size
        w = (self.q.view(N, K // g, g).float() - 8.0) * self.scale[:, :, None] + self.zero[:, :, None]
        return w.view(N, K).to(dtype)

    def rows(self, index: torch.Tensor) -> "QWeight":
        """The rows ``index`` [N'] (int64) of this weight, in that order."""
        return QWeight(self.kind, self.q[index], self.scale[index],
                       None if self.zero is None else self.zero[index], self.group_size, self.source)

    def nbytes(self) -> int:
        """Bytes a matmul reads: packed integers (int4: half a byte each) plus scales and zeros
        in the kernel's bf16."""
        n = self.q.numel()
        ints = n if self.kind == "int8" else n // 2
        return ints + 2 * (self.scale.numel() + (0 if self.zero is None else self.zero.numel()))


def quantize_int8(w: torch.Tensor, source: str = "requantized") -> QWeight:
    """Symmetric per-channel int8 of ``w`` [N, K] (scale = max |w[n]| / 127, round to nearest)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return QWeight("int8", q, scale, source=source)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP, source: str = "requantized") -> QWeight:
    """Asymmetric min/max int4 of ``w`` [N, K] per group of ``group_size`` inputs (as GGUF's Q4_1:
    ``scale = (max - min) / 15``, ``q = round((w - min) / scale)``).

    Raises:
        ValueError: K is not a multiple of ``group_size``.
    """
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 needs the input size {K} to be a multiple of the group size {group_size}")
    wg = w.float().view(N, K // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int8).view(N, K)
    return QWeight("int4", q, scale, lo + 8.0 * scale, group_size, source)


def quantize(w: torch.Tensor, kind: str) -> QWeight:
    """``w`` [N, K] -> :class:`QWeight` of ``kind`` (``int8`` or ``int4``). Raises ValueError."""
    if kind == "int8":
        return quantize_int8(w)
    if kind == "int4":
        return quantize_int4(w)
    raise ValueError(f"unknown weight quantization {kind!r}; use int8 or int4")


def concat(parts: list[QWeight]) -> QWeight:
    """Stack weights along the output dimension (the fused QKV and gate/up matmuls). Parts of one
    kind and group keep their integers; mixed parts (e.g. a Q4_K_M file's Q6_K ``v`` beside Q4_K
    ``q``/``k``) are requantized to the widest kind among them."""
    first = parts[0]
    if all(p.kind == first.kind and p.group_size == first.group_size for p in parts):
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        src = "+".join(dict.fromkeys(p.source for p in parts))
        return QWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero,
                       first.group_size, src)
    kind = "int8" if any(p.kind == "int8" for p in parts) else "int4"
    return quantize(torch.cat([p.dequantize() for p in parts]), kind)


class QuantLinear:
    """``y = x @ w.T (+ b)`` for a :class:`QWeight` ``w`` [N, K]: ``x`` [M, K] -> [M, N] in
    ``x``'s dtype. Same call interface as :class:`laser.model.llama.Linear`.

    Up to :attr:`kernel_max_rows` rows run torch's weight-only kernel
    (``aten._weight_int8pack_mm`` / ``aten._weight_int4pack_mm_for_cpu``) with the activations
    cast to bfloat16 (the only activation dtype the CPU kernels take fast: fp32 activations
    run a scalar path 3-35x slower than fp32 dense here) and a bf16 output cast back; the
    scales are bf16 too. More rows (prefill) dequantize the weight into ``x``'s dtype and run
    the dense matmul on the same bf16-rounded activations and scales. The kernels give bit-equal
    rows whatever the row count (checked in tests); the two paths agree to float rounding.
    Measured on a 2-core AVX2 EPYC, 1 thread, SmolLM2's 4 weight shapes, interleaved
    against the fp32 :class:`~laser.model.llama.Linear` (busy shared machine, rough):
    int4 0.41x the time at 1 row, 0.24-0.33x at 2-8, 0.69x at 32, 2.3x at 128; int8 0.59x,
    0.35-0.47x, 1.15x, 2.2x.

    Raises:
        RuntimeError: the kernels are missing from this torch build (at construction).
    """

    __slots__ = ("qw", "b", "packed", "scales", "kernel_max_rows", "act_dtype")
    KERNEL_MAX_ROWS = {"int4": 64, "int8": 32}  # crossovers measured (see above)

    def __init__(self, qw: QWeight, b: torch.Tensor | None = None):
        self.qw, self.b = qw, b
        self.act_dtype = torch.bfloat16
        self.kernel_max_rows = self.KERNEL_MAX_ROWS[qw.kind]
        if qw.kind == "int8":
            self.packed = qw.q.contiguous()
            self.scales = qw.scale.to(self.act_dtype)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
            # [K / g, N, 2]: (scale, zero) per group and output
            self.scales = torch.stack([qw.scale, qw.zero], dim=-1).transpose(0, 1).contiguous().to(self.act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xa = x.to(self.act_dtype)
        if x.shape[0] <= self.kernel_max_rows:
            if self.qw.kind == "int8":
                y = torch.ops.aten._weight_int8pack_mm(xa.contiguous(), self.packed, self.scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa.contiguous(), self.packed, self.qw.group_size,
                                                                self.scales)
            y = y.to(x.dtype)
        else:
            y = F.linear(xa.to(x.dtype), self.dense_weight(x.dtype)).to(self.act_dtype).to(x.dtype)
        return y if self.b is None else y + self.b

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] the kernel computes with (bf16-rounded scales and zeros), in ``dtype``."""
        qw = self.qw
        if qw.kind == "int8":
            return (qw.q.to(dtype) * self.scales.to(dtype)[:, None])
        N, K = qw.q.shape
        g = qw.group_size
        sz = self.scales.to(dtype)  # [K / g, N, 2]
        w = (qw.q.view(N, K // g, g).to(dtype) - 8.0) * sz[:, :, 0].t()[:, :, None] + sz[:, :, 1].t()[:, :, None]
        return w.view(N, K)

    def numel(self) -> int:
        """Elements of the weight."""
        return self.qw.q.numel()

    def nbytes(self) -> int:
        """Bytes one kernel call reads (see :meth:`QWeight.nbytes`)."""
        return self.qw.nbytes()


# -- GGUF blocks -----------------------------------------------------------------------------------
#: GGUF tensor types whose blocks map exactly onto int4 groups of 32 (see the module docstring).
GGUF_INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
#: GGUF types kept as int8 by ``--quantization auto`` (5 bits or more per weight); other quantized
#: types (2-4 bits) become int4; F32/F16/BF16 stay dense.
GGUF_AUTO_INT8 = ("Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q5_K", "Q6_K", "Q8_K")
GGUF_DENSE = ("F32", "F16", "BF16", "F64")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 -> [..., 32] int8: low nibbles are elements 0-15, high nibbles 16-31
    (ggml's Q4_0/Q4_1 block layout)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8)


def gguf_int4(raw: torch.Tensor, type_name: str, n_cols: int) -> QWeight:
    """Decode a Q4_0 / Q4_1 / Q4_K tensor's blocks exactly into an int4 :class:`QWeight` of group 32.

    ``raw``: uint8 ``[N, bytes per row]`` as stored in the file (one row per output); ``n_cols``: K.
    Block layouts follow ggml-quants.c (``block_q4_0``, ``block_q4_1``, ``block_q4_K``).

    Raises:
        ValueError: ``type_name`` is not one of :data:`GGUF_INT4_EXACT`.
    """
    N = raw.shape[0]
    if type_name == "Q4_0":  # f16 d, 16 bytes of nibbles; w = d * (q - 8)
        b = raw.view(N, n_cols // 32, 18)
        d = _f16(b[..., 0:2])
        q = _nibbles(b[..., 2:])
        zero = torch.zeros_like(d)
    elif type_name == "Q4_1":  # f16 d, f16 m, 16 bytes; w = d * q + m
        b = raw.view(N, n_cols // 32, 20)
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:])
        zero = m + 8.0 * d
    elif type_name == "Q4_K":  # super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes
        nb = n_cols // 256
        b = raw.view(N, nb, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        s = b[..., 4:16].to(torch.int32).view(N, nb, 3, 4)
        lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()  # [N, nb, 8]
        mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1).float()
        qs = b[..., 16:].view(N, nb, 4, 32)  # 4 chunks of 64 weights: low nibbles 0-31, high 32-63
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3).view(N, nb * 8, 32).to(torch.int8)
        scale = (d[..., None] * sc).view(N, nb * 8)
        zero = 8.0 * scale - (dmin[..., None] * mn).view(N, nb * 8)
        return QWeight("int4", q.reshape(N, n_cols), scale, zero, 32, type_name)
    else:
        raise ValueError(f"{type_name} is not an int4-exact GGUF type ({', '.join(GGUF_INT4_EXACT)})")
    return QWeight("int4", q.reshape(N, n_cols), d, zero, 32, type_name)


def gguf_target(type_name: str, policy: str) -> str:
    """The weight format a GGUF tensor of ``type_name`` is served in under ``policy``:
    ``"none"`` (dense), ``"int8"`` or ``"int4"``. ``auto`` keeps the file's precision as closely
    as the kernels allow: 4-bit and smaller -> int4 (group 32), 5-8 bit -> int8 (per channel),
    float -> dense."""
    if policy != "auto":
        return policy
    if type_name in GGUF_DENSE:
        return "none"
    return "int8" if type_name in GGUF_AUTO_INT8 else "int4"
