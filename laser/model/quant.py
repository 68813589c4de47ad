"""Weight-only quantized linear layers on torch's own int8 / int4 matmul kernels.

A :class:`QWeight` holds one weight matrix ``[N, K]`` as integers plus scales:

- ``int8``: symmetric per output channel, ``w[n, k] = q[n, k] * scale[n]`` (``q`` int8);
- ``int4``: asymmetric per group of ``group_size`` inputs, ``w[n, k] = (q[n, k] - 8) *
  scale[n, g] + zero[n, g]`` with ``q`` in 0..15 and ``g = k // group_size`` -- the convention
  of ``torch.ops.aten._weight_int4pack_mm_for_cpu``. GGUF's Q4_0 (``d * (q - 8)``), Q4_1
  (``d * q + m``) and Q4_K (``d * sc * q - dmin * m`` per 32-group) map onto it exactly
  (``zero = 0``, ``m + 8 d`` and ``8 d sc - dmin m``).

:class:`QuantLinear` runs ``y = x @ w.T (+ b)`` for small row counts (decode) with an
inductor-compiled GEMV (int8: :class:`CompiledGemv`) or ``torch.ops.aten._weight_int8pack_mm`` /
``_weight_int4pack_mm_for_cpu``, and with a dense matmul over the weight dequantized on the fly
for many rows (prefill), where the dense GEMM is faster.
Same role as gpt-fast's ``WeightOnlyInt8Linear`` / ``WeightOnlyInt4Linear`` and llama.cpp's
``ggml_mul_mat`` on quantized tensors (read, not copied).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import w8a8
from .linear import GatedLinear, Linear
from .loader import compile_graph

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


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time only (one per process, not one per weight)."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger(__name__).warning(msg)


class QuantLinear:
    """``y = x @ w.T (+ b)`` for a :class:`QWeight` ``w`` [N, K]: ``x`` [M, K] -> [M, N] in
    ``x``'s dtype. Same call interface as :class:`laser.model.llama.Linear`.

    Up to :attr:`kernel_max_rows` rows run an int8 weight through :class:`CompiledGemv` (fp32
    activations) or, a bf16 LM head, :attr:`frozen` (:mod:`laser.model.frozen_gemm`; :attr:`path`
    says which runs, :func:`gemv_enabled` decides), otherwise through torch's weight-only kernel
    (``aten._weight_int8pack_mm`` / ``aten._weight_int4pack_mm_for_cpu``) with the activations cast
    to bfloat16 (the only activation dtype the CPU kernels take fast: fp32 activations run a scalar
    path 3-35x slower than fp32 dense here) and a bf16 output cast back; the scales are bf16 too
    (the compiled GEMV uses the same bf16-rounded scales). More rows (prefill) dequantize the
    weight into ``x``'s dtype (or read :attr:`dense`, kept where :mod:`laser.model.kernel_rows`
    measured the crossover below the default) and run the dense matmul on the same activations
    (bf16-rounded where the decode path rounds them) and scales. The kernels give bit-equal rows
    whatever the row count (checked in tests); the two paths agree to float rounding.
    Measured on a 2-core AVX2 EPYC, 1 thread, SmolLM2's 4 weight shapes, interleaved
    against the fp32 :class:`~laser.model.llama.Linear` (busy shared machine, rough):
    int4 0.41x the time at 1 row, 0.24-0.33x at 2-8, 0.69x at 32, 2.3x at 128; int8 0.59x,
    0.35-0.47x, 1.15x, 2.2x.

    Raises:
        RuntimeError: the kernels are missing from this torch build (at construction).
    """

    __slots__ = ("qw", "b", "packed", "scales", "kernel_max_rows", "act_dtype", "gemv", "dense", "w8a8",
                 "w8a8_min_rows", "frozen")
    # crossovers measured (see above); laser.model.kernel_rows measures them per CPU kind
    KERNEL_MAX_ROWS = {"int4": 64, "int8": 32}

    def __init__(self, qw: QWeight, b: torch.Tensor | None = None):
        self.qw, self.b = qw, b
        self.act_dtype = torch.bfloat16
        self.kernel_max_rows = self.KERNEL_MAX_ROWS[qw.kind]
        self.gemv: tuple[torch.Tensor, ...] | None = None
        self.frozen = None  # laser.model.frozen_gemm.FrozenInt8Gemm (set there)
        # a dequantized copy [N, K] for the rows past the crossover (laser.model.kernel_rows keeps
        # one where the dense matmul wins below the default crossover; a bf16 Linear, oneDNN-packed,
        # where kernel_rows.dense_layout says so; the MLP's gate/up as a GatedLinear, kernel_rows.
        # gated_dense_copy); None: dequantize per call
        self.dense: torch.Tensor | Linear | GatedLinear | None = None
        # int8 weights: oneDNN's W8A8 operands (laser.model.w8a8) for decode rows from
        # w8a8_min_rows (set per CPU kind by laser.model.kernel_rows; w8a8.OFF: none)
        self.w8a8: tuple[torch.Tensor, ...] | None = None
        self.w8a8_min_rows = w8a8.OFF
        if qw.kind == "int8":
            self.packed = qw.q.contiguous()
            self.scales = qw.scale.to(self.act_dtype)
            if gemv_enabled() and qw.q.shape[1] % 4 == 0:
                # fp32 activations, the same bf16-rounded scales as the kernel's
                self.gemv = (pack_int8_lanes(qw.q), self.scales.float().contiguous())
                self.act_dtype = torch.float32
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
            # [K / g, N, 2]: (scale, zero) per group and output
            self.scales = torch.stack([qw.scale, qw.zero], dim=-1).transpose(0, 1).contiguous().to(self.act_dtype)
        if qw.kind == "int8" and w8a8.w8a8_mode() == "on":
            if w8a8.available():
                self.use_w8a8(1)
            else:
                _warn_once("LASER_QUANT_W8A8=on ignored: no VNNI on this CPU (oneDNN's int8 kernels saturate "
                           "without it, laser.model.w8a8.available); int8 weights stay weight-only")

    def use_w8a8(self, min_rows: int) -> None:
        """Run decode rows from ``min_rows`` on through :mod:`laser.model.w8a8` (``w8a8.OFF``:
        none, and its packed copy is dropped); packs the weight (~N*K bytes more) on first use,
        with the same bf16-rounded scales as the other paths.

        Raises:
            ValueError: the weight is not int8. RuntimeError: oneDNN's ops are missing.
        """
        if min_rows >= w8a8.OFF:
            self.w8a8, self.w8a8_min_rows = None, w8a8.OFF
            return
        if self.qw.kind != "int8":
            raise ValueError(f"W8A8 needs an int8 weight, not {self.qw.kind}")
        if self.w8a8 is None:
            self.w8a8 = w8a8.pack(self.qw.q, self.scales.float())
        self.w8a8_min_rows = min_rows

    @property
    def path(self) -> str:
        """Which decode kernel runs: ``"cpp-gemm"`` (:mod:`laser.model.frozen_gemm`), ``"compiled-gemv"``
        (:class:`CompiledGemv`) or ``"aten"``, ``"+w8a8r{n}"`` where rows from ``n`` run :mod:`laser.model.w8a8`."""
        base = "cpp-gemm" if self.frozen is not None else "compiled-gemv" if self.gemv is not None else "aten"
        return base + (f"+w8a8r{self.w8a8_min_rows}" if self.w8a8_min_rows <= self.kernel_max_rows else "")

    def warm_up(self) -> None:
        """Compile (or load from the on-disk cache) this weight's decode graphs now, not at the
        first decode step. No-op on the aten path."""
        if self.gemv is not None:
            for rows in (1, GEMV_BLOCK):
                CompiledGemv.get(self.qw.kind, self.gemv, rows)

    def use_aten(self) -> None:
        """Run decode rows through the aten kernel (bf16 activations) instead of the compiled GEMV."""
        if self.gemv is not None or self.frozen is not None:
            self.gemv, self.frozen, self.act_dtype = None, None, torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x) if x.shape[0] <= self.kernel_max_rows else self.dense_matmul(x)
        return y if self.b is None else y + self.b

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] @ w.T through the decode kernel (no bias), [M, N] in ``x``'s dtype:
        W8A8 from :attr:`w8a8_min_rows` rows, else the weight-only kernel."""
        if x.shape[0] >= self.w8a8_min_rows:
            return w8a8.matmul(x, *self.w8a8).to(x.dtype)
        return self.weight_only(x)

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] @ w.T through the weight-only decode kernel (compiled GEMV or aten; no
        bias), [M, N] in ``x``'s dtype."""
        if self.frozen is not None:
            return self.frozen(x).to(x.dtype)
        if self.gemv is not None:
            return self._compiled(x.float().contiguous()).to(x.dtype)
        same = x.dtype == self.act_dtype  # bf16 models: no casts around the kernel (each a dispatch)
        xa = x.contiguous() if same else x.to(self.act_dtype).contiguous()
        if self.qw.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xa, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, self.qw.group_size, self.scales)
        return y if same else y.to(x.dtype)

    def operands(self) -> tuple[torch.Tensor, ...]:
        """The tensors the aten decode kernel reads: the packed weight and its scales (and the
        bias where there is one). What a fused graph takes as inputs for this weight
        (:mod:`laser.model.fused`)."""
        return (self.packed, self.scales) if self.b is None else (self.packed, self.scales, self.b)

    def with_operands(self, ops: tuple[torch.Tensor, ...]) -> "QuantLinear":
        """A copy computing with ``ops`` (as :meth:`operands` returns them) in place of its own
        tensors, every row through the aten decode kernel: how a fused graph traces this
        weight's matmul with the weight as a graph input (one graph serves every layer)."""
        new = object.__new__(QuantLinear)
        for name in self.__slots__:
            setattr(new, name, getattr(self, name))
        new.packed, new.scales = ops[0], ops[1]
        new.b = ops[2] if len(ops) > 2 else None
        new.kernel_max_rows, new.gemv, new.dense, new.frozen, new.w8a8_min_rows = 1 << 62, None, None, None, w8a8.OFF
        return new

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] @ w.T as a dense matmul (no bias) over the kept copy :attr:`dense` when it
        is in ``x``'s dtype (a packed bf16 :class:`~laser.model.linear.Linear` for bf16 ``x``), else
        over the weight dequantized now; activations rounded as the kernel rounds them. [M, N] in
        ``x``'s dtype."""
        d = self.dense
        if isinstance(d, (Linear, GatedLinear)) and x.dtype == torch.bfloat16:  # the kernel's activation dtype: no rounding to add
            return d(x)
        w = d if isinstance(d, torch.Tensor) and d.dtype == x.dtype else self.dense_weight(x.dtype)
        return F.linear(x.to(self.act_dtype).to(x.dtype), w).to(self.act_dtype).to(x.dtype)

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``x`` [M, K] -> [M, N] through the compiled GEMV: one row alone, else blocks of
        :data:`GEMV_BLOCK` rows (the last one padded with zero rows)."""
        kind, args = self.qw.kind, self.gemv
        return in_blocks(x, lambda rows: lambda xb: CompiledGemv.get(kind, args, rows)(xb, *args))

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


# -- compiled GEMV for decode rows ----------------------------------------------------------------
#: Rows one compiled GEMV call takes: a single row, or a block of this many (fewer rows are padded
#: with zero rows). Every decode row of any batch runs through code with the same per-row
#: arithmetic (see :class:`CompiledGemv`), so a row's result does not depend on its batch.
GEMV_BLOCK = 4


def _int8_gemv(x: torch.Tensor, wf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 GEMV traced for inductor: ``x`` fp32 [M, K], ``wf`` [N, K / 4] float32 holding
    int32 bit patterns (byte j of lane i is ``q[n, j K/4 + i]``, see :func:`pack_int8_lanes`),
    ``scale`` fp32 [N] -> [M, N] fp32. Rows are unrolled so that inductor fuses them into one
    reduction loop that unpacks each weight vector once for all rows."""
    M, K = x.shape
    w = wf.view(torch.int32)
    xv = x.view(M, 4, K // 4)
    qs = [((w << (24 - 8 * j)) >> 24).to(torch.float32) for j in range(4)]  # sign-extended bytes
    rows = []
    for m in range(M):
        acc = qs[0] * xv[m, 0]
        for j in range(1, 4):
            acc = acc + qs[j] * xv[m, j]
        rows.append(acc.sum(-1) * scale)
    return torch.stack(rows)


def in_blocks(x: torch.Tensor, graph) -> torch.Tensor:
    """``x`` [M, K] -> [M, N] by ``graph(rows)`` (a call on [rows, K]): one row alone, else blocks of
    :data:`GEMV_BLOCK` rows, the last one padded with zero rows."""
    M = x.shape[0]
    if M == 1:
        return graph(1)(x)
    g = graph(GEMV_BLOCK)
    if M % GEMV_BLOCK:
        x = torch.cat([x, x.new_zeros(GEMV_BLOCK - M % GEMV_BLOCK, x.shape[1])])
    out = [g(x[i : i + GEMV_BLOCK]) for i in range(0, x.shape[0], GEMV_BLOCK)]
    return (out[0] if len(out) == 1 else torch.cat(out))[:M]


def pack_int8_lanes(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` [N, K] (K a multiple of 4) -> [N, K / 4] float32 whose bits are int32 lanes:
    byte j of lane i is ``q[n, j K/4 + i]`` (float32 because inductor loads float vectors whole,
    int vectors through a copy)."""
    N, K = q.shape
    b = q.view(N, 4, K // 4).to(torch.int32) & 0xFF
    lanes = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    return lanes.contiguous().view(torch.float32)


def gemv_enabled() -> bool:
    """Whether int8 weights run :class:`CompiledGemv` for decode rows: ``$LASER_QUANT_GEMV`` is
    ``template`` (the default: also a bf16 LM head through :mod:`laser.model.frozen_gemm`), ``compiled``
    or ``aten`` (torch's ``_weight_int8pack_mm`` with bf16 activations, no compiler needed; the test
    suite's default, so that tests compile only where they mean to)."""
    mode = os.environ.get("LASER_QUANT_GEMV", "template")
    if mode not in ("template", "compiled", "aten"):
        raise ValueError(f"LASER_QUANT_GEMV={mode!r}: use template, compiled or aten")
    return mode != "aten"


class CompiledGemv:
    """Inductor-compiled int8 GEMVs for decode rows: one graph per weight shape and row count
    (1 or :data:`GEMV_BLOCK`), compiled on first use and cached on disk by inductor's FX graph
    cache (``$TORCHINDUCTOR_CACHE_DIR``, default ``<laser cache>/inductor``), so a later start
    loads them instead of compiling.

    The graph dequantizes inside the reduction (``scale[n] * sum_k q[n, k] x[m, k]``) over weights
    packed four bytes per 32-bit lane, with fp32 activations and accumulators (the AVX2 path of
    ``aten._weight_int8pack_mm`` is compute-bound and needs bf16 activations). Measured on a
    2-core AVX2 EPYC, 1 thread, busy machine: 0.53x the time of ``_weight_int8pack_mm`` for the
    49k x 576 SmolLM2 head at one row, 0.58x at 4 and at 32 rows; 0.65-0.99x on the layer shapes.
    (An int4 graph of the same kind was 0.73-0.94x the int4 kernel at one row but 1.5-2.5x at 4
    rows -- fp32 multiply-adds per row without contraction -- so int4 keeps the aten kernel.)

    Batch invariance: a block's rows are unrolled into one reduction loop with one accumulator
    per row, each row's terms added in the same order as in the 1-row graph, and inductor
    compiles with ``-ffp-contract=off`` (no FMA contraction chosen per kernel), so a row's result
    is bit-equal alone, in any slot of a block, or beside zero padding (checked in
    ``tests/model/test_quant.py``). Same role as gpt-fast's compiled int8 GEMV (read, not copied).
    """

    _graphs: dict = {}

    @classmethod
    def get(cls, kind: str, args: tuple[torch.Tensor, ...], rows: int):
        """The compiled callable ``(x [rows, K] fp32, *args) -> [rows, N] fp32`` for weight
        operands ``args`` (:attr:`QuantLinear.gemv`); compiles it on first use.

        Raises:
            ValueError: ``kind`` is not ``int8``.
        """
        if kind != "int8":
            raise ValueError(f"no compiled GEMV for {kind!r} weights")
        key = (kind, tuple(tuple(a.shape) for a in args), rows)
        fn = cls._graphs.get(key)
        if fn is None:
            K = args[0].shape[1] * 4
            fn = cls._graphs[key] = compile_graph(_int8_gemv, (torch.zeros(rows, K), *args))
        return fn


def prepare_decode_kernels(linears: list[QuantLinear]) -> str:
    """Compile (or load from inductor's on-disk cache) the decode graphs of every
    :class:`QuantLinear` in ``linears`` that runs :class:`CompiledGemv`, so that no decode step
    compiles; where compiling fails (no C++ compiler, an unsupported CPU) every one falls back to
    the aten kernel. Returns a sentence for the startup log saying which path runs and what
    compiling took (seconds)."""
    compiled = [lin for lin in linears if lin.gemv is not None]
    kinds = sorted({lin.qw.kind for lin in linears})
    if not compiled:
        return f"quantized decode ({'/'.join(kinds) or 'none'}): torch's aten weight-only kernels"
    t0 = time.perf_counter()
    try:
        for lin in compiled:
            lin.warm_up()
    except Exception as e:  # noqa: BLE001 -- inductor raises many kinds; the aten path always works
        logging.getLogger(__name__).warning("compiled int8 GEMV unavailable (%s: %s); using the aten kernel",
                                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        for lin in compiled:
            lin.use_aten()
        return "quantized decode: torch's aten weight-only kernels (compiling the int8 GEMV failed)"
    shapes = len({lin.qw.shape for lin in compiled})
    return (f"quantized decode: int8 weights through an inductor-compiled GEMV ({shapes} weight shapes x rows 1 "
            f"and {GEMV_BLOCK}, {time.perf_counter() - t0:.1f} s to compile or load from the cache; "
            f"LASER_QUANT_GEMV=aten for torch's kernel)" + (", int4 through aten's int4 kernel" if "int4" in kinds else ""))
