"""Causal prefill attention of a sequence or chunk as one hand-written C++ kernel (bf16, AVX512-BF16).

The blocked matmul attention of :func:`laser.model.prefill.blocked_causal_attention` runs each
query block's two products through oneDNN at shapes where its GEMMs stay far from the peak (K =
head_dim = 64 for the scores, N = 64 for the weighted sum: ~20 % of the bf16 matmul peak on an
AVX512-BF16 EPYC, a quarter of a 512-token layer's time). This kernel computes the same exact row
softmax (no online rescaling: each query block's causal key prefix fits one score tile, as
FlashAttention's query tiling without its key loop, Dao et al. NeurIPS'22), per KV head and block
of :data:`BLOCK` query rows (the ``g`` query heads sharing the KV head stacked into the rows):

1. scores ``s = q k^T * d^-0.5`` with ``vdpbf16ps``: the bf16 products are exact in fp32 and
   accumulate in fp32 (the numbers of an fp32 matmul of the bf16 values, another summation order),
   6 query rows x 32 keys a register tile, the keys packed once per call as bf16 pairs in 32-key
   tiles (the layout VNNI dot products read, as oneDNN and llama.cpp pack theirs);
2. the row softmax in fp32 over the row's causal prefix (later keys get exact zeros);
3. the weighted sum ``p v`` in fp32 FMAs (V converted to fp32 once per call; probabilities stay
   unrounded, as in the blocked version), 24 / ``d / 16`` rows x d a register tile, divided by the
   softmax sum once, rounded once to bf16.

The same kernel takes a chunk of a sequence whose earlier positions are in the KV cache (a
chunked prefill's later chunks, prompts merged into one prefill group, prefix-cache hits): K and
V are read by cache slot while packing, query ``r`` of the chunk attends keys ``0 .. before + r``.
A query row's output depends only on its own sequence's rows, in a fixed order: the rows of a
chunk are bit-equal to the same rows of the whole sequence prefilled at once (each score is one
dot product in a fixed order, softmax sums run from key 0 in vector lanes, keys past the row's
prefix add exact zeros). Blocks of all KV
heads run over OpenMP threads (torch's thread count). Only for CPUs with AVX512-BF16 (checked at
load: :func:`load_kernel` returns None elsewhere, and the blocked matmuls run) and head sizes that
in :data:`HEAD_DIMS`; compiled and cached on disk through inductor's C++ binding cache
(:func:`laser.model.attn_kernel.compile_kernel`).
"""

from __future__ import annotations

import torch

from .attn_kernel import compile_kernel

#: Query rows of one head per block (the rows of a task: BLOCK x query heads per KV head).
BLOCK = 32

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <immintrin.h>
#include <vector>
#include <cmath>
#include <cstring>
#include <limits>

#define LASER_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
#define LASER_512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

// two bf16 as one 32-bit word (memcpy: no aliasing or alignment assumption; one load)
static inline uint32_t word(const at::BFloat16* p) {
    uint32_t x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

// kp: K of one KV head as bf16 pairs in tiles of 32 keys: word (t, p, c) = (K[32t + c, 2p], K[.., 2p + 1]),
// key c read from row ix[c] of k (row stride ks); vf: V of the head in fp32 [C, d]
LASER_512 static void pack_kv(const at::BFloat16* k, const at::BFloat16* v, const int64_t* ix, int64_t C, int64_t ks,
                              int64_t d, int64_t nt, uint32_t* kp, float* vf) {
    const int64_t np = d / 2;
    std::memset(kp, 0, sizeof(uint32_t) * nt * np * 32);
    for (int64_t c = 0; c < C; ++c) {
        const at::BFloat16* kr = k + ix[c] * ks;
        const at::BFloat16* vr = v + ix[c] * ks;
        uint32_t* dst = kp + (c / 32) * np * 32 + (c % 32);
        for (int64_t p = 0; p < np; ++p) dst[p * 32] = word(kr + 2 * p);
        for (int64_t x = 0; x < d; ++x) vf[c * d + x] = static_cast<float>(vr[x]);
    }
}

// s[r, c0 .. c0 + 32) = scale * q_r . k_c for MR rows (row pointers qr) against key tile kt
template <int MR>
LASER_BF16 static inline void qk_tile(const at::BFloat16* const* qr, const uint32_t* kt, int64_t np, float scale,
                                      float* s, int64_t ss) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t p = 0; p < np; ++p) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * 32 + 16);
        for (int r = 0; r < MR; ++r) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(word(qr[r] + 2 * p)));
            a0[r] = _mm512_dpbf16_ps(a0[r], qb, k0);
            a1[r] = _mm512_dpbf16_ps(a1[r], qb, k1);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < MR; ++r) {
        _mm512_storeu_ps(s + r * ss, _mm512_mul_ps(a0[r], sc));
        _mm512_storeu_ps(s + r * ss + 16, _mm512_mul_ps(a1[r], sc));
    }
}

// o[r, :] = sum_{c < E} p[r, c] v[c, :] / sum[r] for MR rows, d = 16 NCH (V fp32 [E, d])
template <int MR, int NCH>
LASER_BF16 static inline void pv_tile(const float* p, int64_t ps, const float* vf, int64_t E, const float* sum,
                                     at::BFloat16* const* orow) {
    __m512 a[MR][NCH];
    for (int r = 0; r < MR; ++r)
        for (int ch = 0; ch < NCH; ++ch) a[r][ch] = _mm512_setzero_ps();
    for (int64_t c = 0; c < E; ++c) {
        __m512 v[NCH];
        for (int ch = 0; ch < NCH; ++ch) v[ch] = _mm512_loadu_ps(vf + c * NCH * 16 + ch * 16);
        for (int r = 0; r < MR; ++r) {
            const __m512 w = _mm512_set1_ps(p[r * ps + c]);
            for (int ch = 0; ch < NCH; ++ch) a[r][ch] = _mm512_fmadd_ps(w, v[ch], a[r][ch]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
        for (int ch = 0; ch < NCH; ++ch) {
            const __m512 o = _mm512_mul_ps(a[r][ch], inv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow[r] + ch * 16),
                                (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}

template <int NCH> struct Tiles {
    static constexpr int PV = 24 / NCH;  // rows of a weighted-sum tile: 24 accumulators
};

// The scores of rows [i0, i0 + m) (m <= 6) against key tile kt
LASER_BF16 static void qk_rows(const at::BFloat16* const* qr, int64_t m, const uint32_t* kt, int64_t np, float scale,
                               float* s, int64_t ss) {
    switch (m) {
        case 6: qk_tile<6>(qr, kt, np, scale, s, ss); break;
        case 5: qk_tile<5>(qr, kt, np, scale, s, ss); break;
        case 4: qk_tile<4>(qr, kt, np, scale, s, ss); break;
        case 3: qk_tile<3>(qr, kt, np, scale, s, ss); break;
        case 2: qk_tile<2>(qr, kt, np, scale, s, ss); break;
        default: qk_tile<1>(qr, kt, np, scale, s, ss); break;
    }
}

template <int NCH, int MR>
LASER_BF16 static void pv_rows(int64_t m, const float* p, int64_t ps, const float* vf, int64_t E, const float* sum,
                               at::BFloat16* const* orow) {
    if constexpr (MR > 1) {
        if (m < MR) return pv_rows<NCH, MR - 1>(m, p, ps, vf, E, sum, orow);
    }
    pv_tile<MR, NCH>(p, ps, vf, E, sum, orow);
}

// One task: query rows [a, e) of the g query heads of KV head h (row i: head h g + i / n, query a + i % n,
// which attends keys 0 .. off + a + i % n)
template <int NCH>
LASER_BF16 static void block_task(const at::BFloat16* q, int64_t qs, const uint32_t* kp, const float* vf,
                                  at::BFloat16* out, int64_t os, int64_t h, int64_t a, int64_t e, int64_t off,
                                  int64_t g, float scale, std::vector<float>& s) {
    constexpr int64_t d = NCH * 16, np = d / 2;
    const int64_t n = e - a, R = g * n, E = off + e, Ep = (E + 31) / 32 * 32, nt = Ep / 32;
    s.resize(R * Ep);
    std::vector<const at::BFloat16*> qr(R);
    std::vector<at::BFloat16*> orow(R);
    std::vector<float> sum(R);
    for (int64_t i = 0; i < R; ++i) {
        const int64_t pos = a + i % n, head = h * g + i / n;
        qr[i] = q + pos * qs + head * d;
        orow[i] = out + pos * os + head * d;
    }
    for (int64_t t = 0; t < nt; ++t)  // 1. scores, one key tile (L1) against every row tile
        for (int64_t i0 = 0; i0 < R; i0 += 6)
            qk_rows(qr.data() + i0, std::min<int64_t>(6, R - i0), kp + t * np * 32, np, scale,
                    s.data() + i0 * Ep + t * 32, Ep);
    using VF = at::vec::Vectorized<float>;
    const int64_t L = VF::size();
    for (int64_t i = 0; i < R; ++i) {  // 2. exp(s - max) over the row's causal prefix, exact zeros after it
        float* si = s.data() + i * Ep;
        const int64_t len = off + a + i % n + 1, full = len / L * L;
        VF vm(-std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < full; c += L) vm = at::vec::maximum(vm, VF::loadu(si + c));
        float m = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return at::vec::maximum(x, y); }, vm);
        for (int64_t c = full; c < len; ++c) m = std::max(m, si[c]);
        VF vs(0.f);
        for (int64_t c = 0; c < full; c += L) {
            const VF x = (VF::loadu(si + c) - VF(m)).exp_u20();
            x.store(si + c);
            vs = vs + x;
        }
        if (full < len) {
            const VF x = (VF::loadu(si + full, len - full) - VF(m)).exp_u20();
            x.store(si + full, len - full);
            vs = vs + VF::set(VF(0.f), x, len - full);
        }
        for (int64_t c = len; c < Ep; ++c) si[c] = 0.f;
        sum[i] = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return x + y; }, vs);
    }
    constexpr int MR = Tiles<NCH>::PV;  // 3. the weighted sum, rows in tiles of MR
    for (int64_t i0 = 0; i0 < R; i0 += MR)
        pv_rows<NCH, MR>(std::min<int64_t>(MR, R - i0), s.data() + i0 * Ep, Ep, vf, E, sum.data() + i0,
                         orow.data() + i0);
}

template <int NCH>
LASER_BF16 static void run(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const int64_t* ix,
                           at::BFloat16* out, int64_t Q, int64_t off, int64_t qs, int64_t ks, int64_t os, int64_t kvh,
                           int64_t g, int64_t block, int64_t threads) {
    constexpr int64_t d = NCH * 16, np = d / 2;
    const int64_t C = off + Q, nt = (C + 31) / 32, nb = (Q + block - 1) / block;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<uint32_t> kp(kvh * nt * np * 32);
    std::vector<float> vf(kvh * C * d);
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t h = 0; h < kvh; ++h)
        pack_kv(k + h * d, v + h * d, ix, C, ks, d, nt, kp.data() + h * nt * np * 32, vf.data() + h * C * d);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        std::vector<float> s;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < kvh * nb; ++t) {  // the longest prefixes first
            const int64_t b = nb - 1 - t / kvh, h = t % kvh;
            block_task<NCH>(q, qs, kp.data() + h * nt * np * 32, vf.data() + h * C * d, out, os, h, b * block,
                            std::min(Q, (b + 1) * block), off, g, scale, s);
        }
    }
}

// out[r] = softmax(q[r] K[0 .. off + r]^T / sqrt(d)) V[0 .. off + r] for query rows r < Q; key / value c at
// row ix[c] of k / v (row stride ks; heads of d contiguous); q and out rows of stride qs / os
extern "C" void kernel(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const int64_t* ix,
                       at::BFloat16* out, int64_t Q, int64_t off, int64_t qs, int64_t ks, int64_t os, int64_t kvh,
                       int64_t g, int64_t d, int64_t block, int64_t threads) {
    if (d == 16) run<1>(q, k, v, ix, out, Q, off, qs, ks, os, kvh, g, block, threads);
    else if (d == 32) run<2>(q, k, v, ix, out, Q, off, qs, ks, os, kvh, g, block, threads);
    else if (d == 64) run<4>(q, k, v, ix, out, Q, off, qs, ks, os, kvh, g, block, threads);
    else if (d == 128) run<8>(q, k, v, ix, out, Q, off, qs, ks, os, kvh, g, block, threads);
}
"""

_ARGTYPES = ["const at::BFloat16*"] * 3 + ["const int64_t*", "at::BFloat16*"] + ["int64_t"] * 10
#: Head sizes the kernel has register tiles for.
HEAD_DIMS = (16, 32, 64, 128)


def load_kernel():
    """The compiled kernel, or None on a CPU without AVX512-BF16 or where compiling fails (a
    warning; the blocked matmuls of :mod:`laser.model.prefill` run instead)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512") or not torch.cpu._is_avx512_bf16_supported():
        return None
    return compile_kernel(_ARGTYPES, _SOURCE, "prefill attention kernel")


def prefill_attention_kernel(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = BLOCK,
                             slots: torch.Tensor | None = None) -> torch.Tensor:
    """Causal grouped-query attention of one sequence's chunk through ``kernel`` (:func:`load_kernel`).

    Without ``slots``: q [Q, Hq, d], k and v [Q, kvh, d], the chunk is the whole sequence (query
    r attends keys 0..r). With ``slots`` [C] int64 (``C >= Q``): k and v are KV caches [S, kvh, d]
    (same strides), key c is at slot ``slots[c]``, and the Q queries are the sequence's last Q
    positions (query r attends keys 0..C - Q + r: a chunked prefill over cached context). bf16,
    any row stride, heads and head elements contiguous (slices of the fused QKV output are);
    ``Hq`` a multiple of ``kvh``, ``d`` in :data:`HEAD_DIMS`. Returns [Q, Hq, d] bf16, scaled by
    ``d ** -0.5`` like ``scaled_dot_product_attention``.

    Raises:
        ValueError: a dtype, a layout, a head size or slots that the kernel does not take.
    """
    Q, Hq, d = q.shape
    kvh = k.shape[1]
    if (q.dtype, k.dtype, v.dtype) != (torch.bfloat16,) * 3 or d not in HEAD_DIMS or Hq % kvh:
        raise ValueError(f"prefill attention kernel: bf16 q {tuple(q.shape)} k {tuple(k.shape)} only, "
                         f"head size in {HEAD_DIMS}")
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    if slots is None:
        k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (k, v))
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        slots = _arange(Q)
    elif (slots.dtype != torch.long or slots.dim() != 1 or slots.shape[0] < Q or k.stride() != v.stride()
          or k.stride(2) != 1 or k.stride(1) != d):
        raise ValueError(f"prefill attention kernel: slots {tuple(slots.shape)} {slots.dtype} for {Q} queries "
                         f"over caches {tuple(k.shape)}")
    out = torch.empty(Q, Hq, d, dtype=torch.bfloat16, device=q.device)
    if Q == 0:
        return out
    slots = slots.contiguous()
    kernel(q, k, v, slots, out, Q, slots.shape[0] - Q, q.stride(0), k.stride(0), out.stride(0), kvh, Hq // kvh, d,
           block, torch.get_num_threads())
    return out


_ARANGE = torch.arange(0)


def _arange(n: int) -> torch.Tensor:
    """``torch.arange(n)`` int64, from one cached tensor that grows as needed."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        _ARANGE = torch.arange(max(n, 2 * _ARANGE.shape[0]))
    return _ARANGE[:n]
