"""Prefill attention in bf16: the causal attention of one sequence as blocked matmuls.

On a CPU without AMX (AVX512-BF16 EPYC, 1 thread) torch's fused CPU attention kernel
(``scaled_dot_product_attention``, the flash kernel) reaches ~14-25 % of the bf16 matmul peak on
a 512-token SmolLM2 prefill (9 query heads, 3 KV heads, head_dim 64): 9-12 ms of a ~36 ms layer
whose four matmuls run at 89-105 % of the peak of a 2048^3 matmul. It runs many small GEMMs (a
query tile against a key block at a time) and an online softmax that rescales the output tile
after each key block.

:func:`blocked_causal_attention` runs the same attention as a few large batched matmuls: the
queries in blocks of :data:`BLOCK` rows, each block against its causal key prefix only (so the
masked upper triangle costs nothing beyond the diagonal block), with the query heads that share a
KV head stacked into the rows of one matmul (grouped-query attention without repeating K/V). The
whole prefix fits in one score tile, so the softmax is the exact row softmax (no online
rescaling: the tiling over queries of FlashAttention, Dao et al. NeurIPS'22, without the key
loop). Everything between the bf16 inputs and output runs in fp32: a bf16 QK^T would round the
scores to 8 bits before the exponential (max error against fp64 5x the flash kernel's, measured),
and an fp32 PV matmul costs no more than a bf16 one at these shapes (N = head_dim = 64, where
oneDNN's bf16 GEMM runs at ~25 % of its peak) while keeping the probabilities unrounded: the
max error against an fp64 reference is the flash kernel's or below (0.008-0.012 at 128-1024
rows, inputs of std 2).

On a CPU with AVX512-BF16 the same attention runs as one C++ kernel (:mod:`laser.model.prefill_kernel`,
0.3-0.5x the time of these matmuls at 128-2048 rows, the same error); elsewhere the model runs
these matmuls for the causal groups of bf16 prefill steps (a sequence with no cached context:
:attr:`laser.model.llama.AttnGroup.causal`) of at least :data:`MIN_ROWS` rows.
``$LASER_PREFILL_ATTN`` = ``auto`` (the default: ``amx`` on a CPU with AMX tiles, else
``kernel``; :func:`prefill_attn_mode`), ``kernel`` (the C++ kernel where it loads, else these
matmuls), ``amx`` (whole prompts through torch's flash kernel, chunks over cached context through
the C++ kernel), ``blocked`` (these matmuls) or ``sdpa`` (the flash kernel everywhere).

On a CPU with AMX (Intel Xeon, AMX + AVX512-BF16 + VNNI, 2 vCPUs, 1 thread, torch 2.13) the bf16
matmul peak is ~1.4-1.5 TFLOP/s (~8x an AVX512-BF16 EPYC's) and torch's flash kernel runs its
two products as AMX tile GEMMs (oneDNN's brgemm; fp32 scores and softmax, probabilities rounded
to bf16 for the weighted sum): 1.5-2.0 ms at 512 rows against 2.8-2.9 ms for the C++ kernel
(AVX512-BF16 dot products) and 3.2-4.0 ms for these matmuls (fp32, no AMX). The C++ kernel keeps
the chunks over cached context (the flash kernel would need their K/V gathered and a mask).
fp32 models never take it (their results stay bit-for-bit those of the exactness tests). Each
query row's output depends only on its own sequence's rows (per-block matmuls, per-row softmax).
"""

from __future__ import annotations

import os

import torch

#: Query rows per block: of 16/32/64/128 the best or near it at 128-2048 rows (SmolLM2 shapes, 1 thread).
BLOCK = 32
#: Fewest rows of a causal group that run the blocked kernel (below it the flash kernel is as fast).
MIN_ROWS = 128


MODES = ("auto", "kernel", "amx", "blocked", "sdpa")


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's check: CPUID and the OS granting tile state)."""
    return bool(torch.cpu._is_amx_tile_supported())


def amx_switch(var: str, amx: str, other: str) -> str:
    """The two-way switch ``$var``: ``auto`` (the default) resolves to ``amx`` on a CPU with AMX
    tiles (:func:`has_amx`), else ``other``; ``amx`` or ``other`` is taken as set. Raises
    ValueError on another value."""
    mode = os.environ.get(var, "auto")
    if mode not in ("auto", amx, other):
        raise ValueError(f"{var}={mode!r}: use auto, {amx} or {other}")
    if mode == "auto":
        return amx if has_amx() else other
    return mode


def prefill_attn_mode(amx: bool | None = None) -> str:
    """The prefill attention path: ``$LASER_PREFILL_ATTN`` (one of :data:`MODES`), ``auto`` (the
    default) resolved from the CPU flags: ``amx`` where the CPU has AMX tiles (``amx``; None:
    :func:`has_amx`), else ``kernel``. Returns ``kernel``, ``amx``, ``blocked`` or ``sdpa``.
    Raises ValueError on another value."""
    mode = os.environ.get("LASER_PREFILL_ATTN", "auto")
    if mode not in MODES:
        raise ValueError(f"LASER_PREFILL_ATTN={mode!r}: use {', '.join(MODES)}")
    if mode == "auto":
        return "amx" if (has_amx() if amx is None else amx) else "kernel"
    return mode


def uses_blocked_attention(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` runs :func:`blocked_causal_attention` where the C++ kernel does
    not (bf16 and the switch not ``sdpa``)."""
    return dtype == torch.bfloat16 and prefill_attn_mode() != "sdpa"


def causal_through_flash(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` runs whole prompts (causal groups) through torch's flash
    kernel while its chunks take the C++ kernel: bf16 and the mode ``amx``."""
    return dtype == torch.bfloat16 and prefill_attn_mode() == "amx"


def load_prefill_kernel(dtype: torch.dtype, head_dim: int):
    """The C++ prefill attention kernel for a model in ``dtype`` with heads of ``head_dim``
    (:func:`laser.model.prefill_kernel.load_kernel`), or None: not bf16, the mode not ``kernel``
    or ``amx``, a head size it has no tiles for, or a CPU without AVX512-BF16."""
    from .prefill_kernel import HEAD_DIMS, load_kernel

    if dtype != torch.bfloat16 or prefill_attn_mode() not in ("kernel", "amx") or head_dim not in HEAD_DIMS:
        return None
    return load_kernel()


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Causal grouped-query attention of one sequence (query i attends to keys 0..i).

    Args:
        q: [Q, Hq, d] queries (any strides), bf16.
        k, v: [Q, kvh, d] keys and values of the same Q positions; ``Hq`` a multiple of ``kvh``.
        block: query rows per matmul block.
    Returns:
        [Q, Hq, d] in ``q``'s dtype, scaled by ``d ** -0.5`` like ``scaled_dot_product_attention``.
    """
    Q, nh, d = q.shape
    kvh = k.shape[1]
    g = nh // kvh
    scale = d ** -0.5
    out = torch.empty(Q, nh, d, dtype=q.dtype, device=q.device)
    # [kvh, g, Q, d]: the g query heads of each KV head side by side, scaled once in fp32
    qg = q.view(Q, kvh, g, d).permute(1, 2, 0, 3).float().mul_(scale)
    kt = k.permute(1, 2, 0).float()  # [kvh, d, Q]
    vt = v.transpose(0, 1).float()  # [kvh, Q, d]
    tri = torch.full((block, block), float("-inf"), device=q.device).triu_(1)  # the diagonal block's causal mask
    for a in range(0, Q, block):
        e = min(a + block, Q)
        n = e - a
        s = torch.bmm(qg[:, :, a:e].reshape(kvh, g * n, d), kt[:, :, :e]).view(kvh, g, n, e)
        s[..., a:e].add_(tri[:n, :n])
        p = torch.softmax(s, dim=-1).view(kvh, g * n, e)
        out[a:e] = torch.bmm(p, vt[:, :e]).view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, nh, d)
    return out
