"""Attention features and decode grouping: how the runner's attention kernels are priced.

Torch-free, numpy-free. This module owns the rule by which decode rows are split into
padded gather groups (:func:`decode_slices`) and its limit (:data:`DEFAULT_MAX_GATHER_BYTES`):
the model runner (``ModelRunner._split_decode``) forms its kernel groups with it, and the
latency model prices decode attention per group with it (:func:`decode_groups`).
"""

from __future__ import annotations

import re
from typing import Sequence

# Largest padded K (or V) gather of one decode group, bytes. Larger gathers are served by
# fresh mmap pages and page-fault on every layer (measured on CPU: ~35% slower per
# position), so the runner splits decode batches to stay under it.
DEFAULT_MAX_GATHER_BYTES = 16 << 20

# --------------------------------------------------------------------------------------
# Attention features
#
# The runner runs attention as *kernel groups* (``ModelRunner._build_metadata``), and the
# features price each group the way it runs:
#
# Decode entries (q == 1), B_d of them with contexts c, split into padded groups (see
# ``decode_groups``); each group gathers and attends over |g| · max_g c positions:
#   d_groups  number of groups     (kernel launch, mask, output scatter per group)
#   d_seqs    B_d (== tokens)      (paper's α·n)
#   d_ctx     Σc                   (paper's β·Σc: KV bytes read)
#   d_pad     Σ_g |g| · max_g c    (what the padded gather + kernel really touch)
#   d_pad2    Σ_g (|g| · max_g c)² (a group's cost per position grows with its gather: past the
#                                   CPU caches the gathered K/V and the B·C scores stream from
#                                   memory; measured on an AVX512 EPYC, bf16 SmolLM2: ~0.2 us per
#                                   position at 5k positions, ~0.45 us at 40k)
# Prefill entries (q > 1). A single prefill with no cached context (q == c) runs the
# causal kernel on its own K/V:
#   c_const   1 if so
#   c_tokens  q
#   c_square  q²                   (causal score matrix, the lower triangle)
#   c_sq32 / c_sq64 / c_sq256      q² again, in the one of three features that names the query block
#                                  torch's CPU flash attention tiles it with (32 rows below q = 192, 64
#                                  below 768, 256 from 768: ``CAUSAL_Q_TILES``): the cost of a score
#                                  falls as the blocks grow (measured on an AVX512 EPYC, bf16
#                                  SmolLM2, one thread: ~3.7e-5 ms per q² at 256-420 tokens, 2.4e-5
#                                  at 1024, 1.9e-5 at 2048; one quadratic put 283-610-token chunks
#                                  14-24 % under). The kernel is faster just past an edge (192
#                                  tokens 1.4 ms, 191 2.3 ms), and so is the price: not monotone there
# Otherwise all prefill entries run one masked, padded group (B_p entries):
#   m_const   1 if so
#   m_tokens  Σq                   (paper's α·n)
#   m_ctx     Σc                   (paper's β·Σc)
#   m_pad     B_p · max q · max c  (padded score matrix: masked positions cost too)
# and the same entries as the C++ prefill kernel runs them (``LlamaModel._chunks_through_kernel``: one
# call per chunk, each query attending to its own causal prefix, no padding; a CPU with AVX512-BF16
# runs chunks over cached context and any batch of several prompts so, and on AMX whole prompts
# alone take the flash kernel):
#   m_chunks  B_p                  (one kernel call per chunk)
#   m_scores  Σ q · (c - (q - 1) / 2) (the causal scores the kernel computes: q rows over c - q cached
#                                   positions and the lower triangle of their own q x q block; on an
#                                   AMX Xeon, bf16 SmolLM2, one thread, m_pad priced a 512-token chunk
#                                   over 1,024 cached positions 35 % under and four chunks of 20-450
#                                   tokens 25-58 % over: the padded matrix is not what this kernel does)
# A batch with both decode and prefill entries also scatters the groups' outputs into one
# tensor; that costs tens of microseconds (measured: 55 us for 300 rows), so it has no
# term of its own -- a free constant for it absorbed fit noise instead (0.5 ms per layer).
# Candidate feature sets, simplest first; the fit picks one by CV (``laser.latency.fitting``;
# which sets are candidates is the fit's ``form``).

ATTENTION_FEATURES = ("d_groups", "d_seqs", "d_ctx", "d_pad", "d_pad2", "c_const", "c_tokens", "c_square",
                      "m_const", "m_tokens", "m_ctx", "m_pad", "c_sq32", "c_sq64", "c_sq256", "m_chunks", "m_scores")
# Query lengths at which torch's CPU flash attention (``scaled_dot_product_attention``; aten's
# cpu FlashAttentionKernel) switches its query block from 32 to 64 and from 64 to 256 rows.
CAUSAL_Q_TILES = (192, 768)
_PREFILL_KERNEL = ("c_const", "c_tokens", "c_square", "m_const", "m_tokens", "m_ctx", "m_pad")
ATTENTION_FEATURE_SETS = {
    # decode entries priced by the padded gather the runner does (each group reads and attends
    # over |g| · max_g c positions: B · C_max, not Σc), prefill entries by the paper's line
    "padded": ("d_groups", "d_seqs", "d_pad", "c_const", "c_tokens", "m_const", "m_tokens", "m_ctx"),
    # the paper's α·n + β·Σc + γ, for decode and prefill entries separately
    "linear": ("d_groups", "d_seqs", "d_ctx", "c_const", "c_tokens", "m_const", "m_tokens", "m_ctx"),
    # what the kernels compute: padded decode groups, causal / padded prefill score matrices
    "kernel": ("d_groups", "d_seqs", "d_ctx", "d_pad", *_PREFILL_KERNEL),
    # "kernel" with the decode gather's cost per position growing with the group's gather (d_pad2)
    "convex": ("d_groups", "d_seqs", "d_pad", "d_pad2", *_PREFILL_KERNEL),
    # "convex" with the causal score matrix priced per query block size of the flash kernel
    "tiled": ("d_groups", "d_seqs", "d_pad", "d_pad2", "c_const", "c_tokens", "c_sq32", "c_sq64", "c_sq256",
              "m_const", "m_tokens", "m_ctx", "m_pad"),
    # "tiled" with the other prefill entries priced per chunk as the C++ prefill kernel runs them
    # (m_chunks, m_scores) instead of as one padded group (m_pad)
    "chunked": ("d_groups", "d_seqs", "d_pad", "d_pad2", "c_const", "c_tokens", "c_sq32", "c_sq64", "c_sq256",
                "m_const", "m_tokens", "m_ctx", "m_chunks", "m_scores"),
    "full": ATTENTION_FEATURES[:12],  # (every feature but the causal tiles: c_square holds their sum)
}
N_DECODE_FEATURES = 5

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


def max_gather_positions(kv_heads: int, head_dim: int, dtype_bytes: int,
                         max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES) -> int:
    """Padded positions (rows x max context) one decode group may gather under
    ``max_gather_bytes`` (bytes of K, or of V): ``max_gather_bytes // (kv_heads · head_dim ·
    dtype_bytes)``, at least 1 (a group always holds one row, whatever its context)."""
    return max(1, int(max_gather_bytes) // max(1, int(kv_heads) * int(head_dim) * int(dtype_bytes)))


def gather_positions_from_metadata(metadata: dict | None) -> int:
    """``max_gather_positions`` for a profile: ``metadata["max_gather_positions"]`` if set,
    else from the shape signature (``...-kv3-d64-...``) and ``dtype``; 0 (no split) if unknown."""
    meta = metadata or {}
    if meta.get("max_gather_positions") is not None:
        return max(0, int(meta["max_gather_positions"]))
    shape = str(meta.get("shape") or meta.get("model_id") or "")
    m = re.search(r"-kv(\d+)-d(\d+)(?:-|$)", shape)
    nbytes = _DTYPE_BYTES.get(str(meta.get("dtype", "")).removeprefix("torch."))
    if not m or not nbytes:
        return 0
    return max_gather_positions(int(m.group(1)), int(m.group(2)), nbytes)


# Row counts at which the matmul kernels switched in profiles made before the profiler recorded
# them (``metadata["kernel_rows"]``, profiler version 8), by weight format: the weight-only int4 /
# int8 kernels up to 64 / 32 rows, then a dense matmul; fp32's oneDNN-packed layout up to 64.
_PRE_V8_KERNEL_ROWS = {"int4": 64, "int8": 32, "float32": 64}


def kernel_rows_from_metadata(metadata: dict | None) -> dict[str, tuple[int, ...]]:
    """Row counts ``k`` at which the executor's matmuls switch kernel (``n <= k`` rows run one,
    ``n > k`` another), for ``"stateless"`` (the layers' projections) and ``"head"`` (the LM
    head): the count functions fitted for them keep a segment edge at each (a kink or jump the
    data may show, :func:`laser.latency.fitting.fit`). ``metadata["kernel_rows"]`` when the
    profiler recorded it; else, for older profiles, from the weight formats in ``model_id``
    (``...-int4-int8``) and ``dtype``, the union for both; ``{}`` when nothing is known."""
    meta = metadata or {}
    if isinstance(meta.get("kernel_rows"), dict):
        return {k: tuple(sorted(int(r) for r in v)) for k, v in meta["kernel_rows"].items()}
    kinds = re.findall(r"-(int4|int8)(?=-|$)", str(meta.get("model_id", "")))
    kinds.append(str(meta.get("dtype", "")).removeprefix("torch."))
    rows = tuple(sorted({_PRE_V8_KERNEL_ROWS[k] for k in kinds if k in _PRE_V8_KERNEL_ROWS}))
    return {"stateless": rows, "head": rows} if rows else {}


def decode_slices(context_lens: Sequence[int], max_positions: int) -> list[tuple[int, int]]:
    """Split decode rows into padded gather groups: ``(start, end)`` row ranges.

    The one rule for decode grouping (the runner forms its attention groups with it, the
    latency model prices them with it). ``context_lens`` must be non-decreasing (the
    runner orders decode rows by context, so the padding of each group is small); a
    group takes consecutive rows while ``(size + 1) · c <= max_positions`` for the next
    row's context ``c``: its padded gather ``size · max c`` stays within the limit, or the
    group is a single row. ``max_positions <= 0``: no limit (one group).
    """
    n = len(context_lens)
    if not n:
        return []
    if max_positions <= 0 or n * context_lens[-1] <= max_positions:
        return [(0, n)]
    out = []
    start = 0
    for i, c in enumerate(context_lens):
        if i > start and (i - start + 1) * c > max_positions:
            out.append((start, i))
            start = i
    out.append((start, n))
    return out


def decode_groups(context_lens: Sequence[int], max_positions: int) -> list[tuple[int, int]]:
    """``(size, max context)`` of each decode group the runner forms for these contexts
    (in any order): :func:`decode_slices` of the sorted contexts."""
    c = sorted(context_lens)
    return [(b - a, c[b - 1]) for a, b in decode_slices(c, max_positions)]


def attention_features(query_lens: Sequence[int], context_lens: Sequence[int],
                       max_positions: int = 0) -> tuple[float, ...]:
    """Feature vector (in ``ATTENTION_FEATURES`` order) of one attention batch; decode
    entries are grouped as the runner does with ``max_positions`` (see :func:`decode_groups`)."""
    dc = []
    pq, pc = [], []
    for q, c in zip(query_lens, context_lens):
        if q == 1:
            dc.append(c)
        else:
            pq.append(q)
            pc.append(c)
    groups = decode_groups(dc, max_positions)
    f = [float(len(groups)), float(len(dc)), float(sum(dc)), float(sum(k * m for k, m in groups)),
         float(sum((k * m) ** 2 for k, m in groups))]
    if len(pq) == 1 and pq[0] == pc[0]:  # the causal fast path
        q2 = float(pq[0]) ** 2
        f += [1.0, float(pq[0]), q2, 0.0, 0.0, 0.0, 0.0, *causal_tiles(pq[0], q2), 0.0, 0.0]
    elif pq:
        f += [0.0, 0.0, 0.0, 1.0, float(sum(pq)), float(sum(pc)), float(len(pq) * max(pq) * max(pc)), 0.0, 0.0, 0.0,
              float(len(pq)), float(sum(q * (c - 0.5 * (q - 1)) for q, c in zip(pq, pc)))]
    else:
        f += [0.0] * 12
    return tuple(f)


def causal_tiles(q: int, value: float) -> tuple[float, float, float]:
    """``(c_sq32, c_sq64, c_sq256)`` of a causal chunk of ``q`` tokens: ``value`` (its q²) in the
    slot of the query block the flash kernel tiles ``q`` with (:data:`CAUSAL_Q_TILES`), 0 elsewhere."""
    lo, hi = CAUSAL_Q_TILES
    return (value, 0.0, 0.0) if q < lo else ((0.0, value, 0.0) if q < hi else (0.0, 0.0, value))
