"""Dense linear layers of the decoder: :class:`Linear` (one weight in the layout fastest for the row
count), :class:`GatedLinear` (the MLP's gate and up weights with SiLU(gate) * up in the matmul
epilogue) and oneDNN weight packing (:func:`pack_for_onednn`, :func:`packed_weights_mode`)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .prefill import amx_switch


class Linear:
    """``y = x @ w.T (+ b)`` for one weight ``w`` [N, K], read in the layout that is fastest
    for the number of rows ``M`` of ``x`` [M, K] (returns [M, N], ``x``'s dtype).

    fp32 on a CPU with oneDNN (the dtype of AVX2-only CPUs, where these matmuls run in MKL
    sgemm): one row reads the transposed copy [K, N] as an axpy stream (a GEMV over the
    plain [N, K] weight reads it as one dot product per output), 2..``PACKED_MAX_ROWS`` rows
    a copy packed once for oneDNN (``mkldnn._linear_pointwise``: what inductor's CPU weight
    prepacking uses; sgemm repacks the weight on every call at small M), more rows (prefill)
    the transposed copy through sgemm. The plain weight is not kept: two copies in all.
    Measured interleaved on a 2-core AVX2 EPYC, 1 thread, the 120 layer weights of SmolLM2
    (a busy machine, so the ratios are rough): 1 row 0.67-0.80x the time of ``F.linear``,
    2-32 rows 0.58-0.88x, 64-512 rows 0.96-1.04x. Any other dtype or device: ``F.linear``
    on the plain weight.

    bf16 on a CPU whose oneDNN runs bf16 matmuls (``$LASER_PACKED_WEIGHTS``, on by default): the
    oneDNN-packed copy alone, for every row count (the plain weight is not kept: one copy).
    ``F.linear`` on the plain bf16 weight reorders it into the same blocked layout on every call.
    Measured interleaved on a 2-vCPU AVX512-BF16 EPYC (no AMX), 1 thread, SmolLM2's 4 weight
    shapes: 0.50-0.61x the time of ``F.linear`` at 1-4 rows (decode), 0.70-0.78x at 16, 0.81-0.89x
    at 64-128, 0.92-0.96x at 512 (prefill); the packed layout does not depend on the row hint
    (bit-equal outputs). :meth:`add_to` fuses a residual add into the matmul (a oneDNN post-op).
    """

    __slots__ = ("w", "wt", "packed", "b", "shape")
    PACKED_MAX_ROWS = 64  # the crossover measured at 48-64 rows; 64 is a segment edge of the profile fits

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None):
        self.b = b
        self.shape = tuple(w.shape)  # [N, K]
        self.packed = pack_for_onednn(w, batch_hint=16)
        if self.packed is None:
            self.w, self.wt = w, None
        elif w.dtype == torch.float32:
            self.w, self.wt = None, w.t().contiguous()
        else:  # bf16: the packed copy serves every row count
            self.w = self.wt = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wt is None:
            if self.w is None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.b, "none", [], "")
            return F.linear(x, self.w, self.b)
        m = x.shape[0]
        if 1 < m <= self.PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.b, "none", [], "")
        if self.b is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.b, x, self.wt)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``: x [M, K], residual [M, N] in x's dtype -> [M, N]. On the
        packed-only (bf16) layout one oneDNN call adds ``residual`` to the fp32 accumulators
        before the single rounding (the add costs nothing measurable at 512 rows)."""
        if self.w is None and self.wt is None:
            return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), self.packed,
                                                              self.b, "add")
        return residual + self(x)

    def columns(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Output columns ``start:`` of ``self(x)`` (the K/V part of a fused QKV weight): x [M, K]
        -> [M, N - start]. Reads only those weight rows where a plain or transposed copy is kept;
        the packed-only layout computes every column and slices (see :attr:`sliceable`)."""
        b = None if self.b is None else self.b[start:]
        if self.wt is not None:
            wt = self.wt[:, start:]
            return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)
        if self.w is not None:
            return F.linear(x, self.w[start:], b)
        return self(x)[:, start:]

    @property
    def sliceable(self) -> bool:
        """Whether :meth:`columns` reads only the columns it returns."""
        return self.w is not None or self.wt is not None

    def numel(self) -> int:
        """Elements of the weight (one copy)."""
        return self.shape[0] * self.shape[1]


class GatedLinear:
    """The MLP's stacked gate and up weights ``w`` [2 I, K] (gate rows first) packed for oneDNN as
    two halves, so that ``SiLU(x @ gate.T) * (x @ up.T)`` runs as two oneDNN matmuls with the
    activation in their epilogues (:meth:`swiglu`): the gate matmul with a ``swish`` post-op
    (rounded once to bf16), the up matmul with a binary ``mul`` post-op by that result, so no
    [M, 2 I] intermediate is written and no elementwise pass reads it back.

    bf16 only (built by :func:`gated_linear` where bf16 weights are packed). Measured on an Intel
    Xeon, AMX + AVX512-BF16 + VNNI, 2 vCPUs, 1 thread, SmolLM2's [576 -> 2 x 1536]: 1.39 ms
    against 1.80 ms for the stacked matmul + the compiled SiLU * up graph at 512 rows, 0.20 vs
    0.30 ms at 1 row, 2.81 vs 3.42 ms at 1,024. Error: the gate activation is rounded to bf16
    before the product (eager bf16 rounds gate, SiLU and product each), about one bf16 ulp of
    the output. Same memory as the stacked packed weight (one copy).
    """

    __slots__ = ("gate", "up", "shape")

    def __init__(self, gate: Linear, up: Linear):
        self.gate, self.up = gate, up
        self.shape = (gate.shape[0] + up.shape[0], gate.shape[1])  # [2 I, K], as the stacked weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] -> the stacked ``[gate | up]`` outputs [M, 2 I] (what a stacked
        :class:`Linear` returns; :meth:`swiglu` is the fast path)."""
        return torch.cat([self.gate(x), self.up(x)], dim=-1)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``SiLU(x @ gate.T) * (x @ up.T)``: x [M, K] bf16 -> [M, I] bf16, two oneDNN calls."""
        x = x.contiguous()
        act = torch.ops.mkldnn._linear_pointwise(x, self.gate.packed, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, act, self.up.packed, None, "mul")

    def numel(self) -> int:
        """Elements of the two weights (one copy)."""
        return self.shape[0] * self.shape[1]


def gated_mode() -> str:
    """``$LASER_GATED_MLP``: ``auto`` (the default: on where the CPU has AMX tiles, the kind it
    was measured on), ``on`` or ``off`` (the stacked gate/up matmul and a separate SiLU * up).
    Returns ``on`` or ``off``. Raises ValueError on another value."""
    return amx_switch("LASER_GATED_MLP", "on", "off")


def gated_linear(w: torch.Tensor) -> GatedLinear | None:
    """``w`` [2 I, K] (gate rows, then up rows) as a :class:`GatedLinear`, or None: not bf16,
    :func:`gated_mode` ``off``, or the halves not packed for oneDNN (:func:`pack_for_onednn`)."""
    if w.dtype != torch.bfloat16 or gated_mode() == "off":
        return None
    i = w.shape[0] // 2
    gate, up = Linear(w[:i].contiguous()), Linear(w[i:].contiguous())
    if gate.packed is None or gate.sliceable or up.packed is None or up.sliceable:
        return None
    g = GatedLinear(gate, up)
    try:  # the post-ops this torch build's oneDNN must have
        g.swiglu(torch.ones(2, w.shape[1], dtype=w.dtype))
    except (RuntimeError, AttributeError):
        return None
    return g


def swiglu_of(lin, x: torch.Tensor) -> torch.Tensor | None:
    """``SiLU(gate) * up`` of the MLP matmul ``lin`` over ``x`` [M, K] -> [M, I] through a
    :class:`GatedLinear` where ``lin`` is one, or is a QuantLinear whose dense copy is one and
    ``x``'s rows take that copy (past its crossover, bf16); else None (the caller runs
    ``lin(x)`` and the activation)."""
    if isinstance(lin, GatedLinear):
        return lin.swiglu(x)
    d = getattr(lin, "dense", None)
    if isinstance(d, GatedLinear) and x.dtype == torch.bfloat16 and x.shape[0] > lin.kernel_max_rows and lin.b is None:
        return d.swiglu(x)
    return None


def packed_weights_mode() -> str:
    """``$LASER_PACKED_WEIGHTS``: ``on`` (the default: bf16 :class:`Linear` weights oneDNN-packed)
    or ``off`` (``F.linear`` on the plain bf16 weight). Raises ValueError on another value."""
    mode = os.environ.get("LASER_PACKED_WEIGHTS", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"LASER_PACKED_WEIGHTS={mode!r}: use on or off")
    return mode


def add_linear(lin, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + lin(x)`` for a :class:`Linear` (fused where it can) or a QuantLinear."""
    return lin.add_to(x, residual) if isinstance(lin, Linear) else residual + lin(x)


def pack_for_onednn(w: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """``w`` [N, K] reordered into oneDNN's blocked layout for ``mkldnn._linear_pointwise``
    (what inductor's CPU weight prepacking does), or None where oneDNN is unavailable: fp32, and
    bf16 where oneDNN runs bf16 matmuls natively and :func:`packed_weights_mode` is ``on``."""
    if not torch.backends.mkldnn.is_available() or w.device.type != "cpu":
        return None
    if w.dtype == torch.bfloat16:
        if packed_weights_mode() == "off" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
    elif w.dtype != torch.float32:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        probe = torch.ones(2, w.shape[1], dtype=w.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # an op missing in this torch build
        return None
    return packed
