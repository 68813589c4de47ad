"""Decode attention as one hand-written C++ kernel (graph D's kernel; ``laser.model.fused``).

One query row per sequence attends over its context rows in the paged KV cache, gathered by slot
index inside the kernel: plain softmax(q k^T / sqrt(d) + mask) v (Vaswani et al. 2017) in fp32,
the reference :func:`laser.model.fused.decode_attention`. Inductor's code for that reference spends
~145 us a layer at one sequence of 520 positions (AMD EPYC, 1 thread, hot caches; ~230 us with the
K/V cache-cold): one horizontal vector reduction per score, a division per weighted term, a bounds
check per gathered row, and 18 walks over the context in the weighted sum. This kernel (~60 / ~90 us
there), per sequence (its KV heads split over threads when there are fewer sequences than threads):

1. scores: each context slot's K row read once for the task's KV heads (bf16 -> fp32; the ``g``
   query heads sharing a KV head reuse the loaded chunks), accumulated in vector lanes and reduced
   once per score; the K and V lines of the slot 16 positions ahead are prefetched (the gather is
   latency-bound: blocks of 16 slots at random places);
2. softmax numerator: the scores of a head, padded with -inf to whole vectors, ``exp(s - max)``
   vectorised, summed lane-wise (pads add exact zeros);
3. weighted sum, per KV head: ``sum_c e[c] v[c]`` with one vector accumulator per (query head,
   chunk of d), in registers for the common sizes (compile-time counts; a generic path else, same
   order), divided by the softmax sum at the end (as flash-decoding does), rounded once to bf16.

Batch invariance: a sequence's terms are added in position order in every loop, and pad positions
(mask -inf) add exact zeros after them, so a sequence's output is bit-equal alone and padded in a
batch (checked in tests/model/test_fused.py). Not bit-equal to inductor's graph (another summation
order): within bf16 rounding of it. The tasks run on OpenMP threads (torch's thread count).

Compiled and loaded through inductor's C++ binding cache (on disk under ``$TORCHINDUCTOR_CACHE_DIR``,
the flags and vector ISA inductor uses for its own kernels: AVX512 or AVX2 via ``at::vec``);
:func:`load_kernel` returns None where that fails (the caller keeps inductor's graph).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <vector>
#include <cmath>
#include <limits>

using VB = at::vec::Vectorized<at::BFloat16>;
using VF = at::vec::Vectorized<float>;
using VF2 = at::vec::VectorizedN<float, 2>;
#ifndef AHEAD
#define AHEAD 16
#endif

static inline VF2 load_bf16(const at::BFloat16* p, int64_t n) {
    return at::vec::convert<float, 2, at::BFloat16, 1>(VB::loadu(p, n));
}

// 1. s[j, c] = q_j . k[c] * scale + mask[c] for the NG query heads of each KV head in [h0, h1)
// (NG, NCH: query heads per KV head and vector chunks of d, 0 = read g, nch at run time).
template <int NG, int NCH>
static void scores(const float* qf, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* ix,
                   const at::BFloat16* mb, int64_t C, int64_t Cp, int64_t row, int64_t h0, int64_t h1,
                   int64_t g_, int64_t nch_, int64_t d, float scale, float* s) {
    const int64_t W = VB::size(), g = NG ? NG : g_, nch = NCH ? NCH : nch_;
    for (int64_t c = 0; c < C; ++c) {
        if (c + AHEAD < C) {  // this task's K and V lines of the row AHEAD positions on
            const int64_t at = ix[c + AHEAD] * row + h0 * d;
            for (int64_t e = 0; e < (h1 - h0) * d; e += 32) {
                __builtin_prefetch(kc + at + e);
                __builtin_prefetch(vc + at + e);
            }
        }
        const float m = static_cast<float>(mb[c]);
        for (int64_t h = h0; h < h1; ++h) {
            const at::BFloat16* kr = kc + ix[c] * row + h * d;
            VF2 k[NCH ? NCH : 1];
            for (int64_t j = 0; j < g; ++j) {
                const int64_t jj = (h - h0) * g + j;
                VF2 a(0.f);
                for (int64_t ch = 0; ch < nch; ++ch) {
                    const VF2 kv = NCH ? (j ? k[ch] : (k[ch] = load_bf16(kr + ch * W, std::min(W, d - ch * W))))
                                       : load_bf16(kr + ch * W, std::min(W, d - ch * W));
                    a = a + VF2::loadu(qf + (jj * nch + ch) * W) * kv;
                }
                float dot = at::vec::vec_reduce_all<float, 2>([](VF& x, VF& y) { return x + y; }, a);
                s[jj * Cp + c] = dot * scale + m;
            }
        }
    }
}

// 3. acc[j] = sum_c e[j, c] v[c] (position order) for the g query heads of KV head h (offset
// off in a cache row); NG, NCH > 0 keep the accumulators in registers.
template <int NG, int NCH>
static void weighted_sum(const at::BFloat16* vc, const int64_t* ix, int64_t C, int64_t Cp, int64_t row,
                         int64_t off, int64_t g_, int64_t nch_, int64_t d, const float* s, float* acc) {
    const int64_t W = VB::size(), L2 = 2 * VF::size();
    if constexpr (NG > 0 && NCH > 0) {
        VF2 a[NG][NCH];
        for (int j = 0; j < NG; ++j)
            for (int ch = 0; ch < NCH; ++ch) a[j][ch] = VF2(0.f);
        for (int64_t c = 0; c < C; ++c) {
            const at::BFloat16* vr = vc + ix[c] * row + off;
            for (int ch = 0; ch < NCH; ++ch) {
                const VF2 v = load_bf16(vr + ch * W, std::min(W, d - ch * W));
                for (int j = 0; j < NG; ++j) a[j][ch] = a[j][ch] + VF2(s[j * Cp + c]) * v;
            }
        }
        for (int j = 0; j < NG; ++j)
            for (int ch = 0; ch < NCH; ++ch) a[j][ch].store(acc + (j * NCH + ch) * W, L2);
    } else {
        for (int64_t c = 0; c < C; ++c) {
            const at::BFloat16* vr = vc + ix[c] * row + off;
            for (int64_t ch = 0; ch < nch_; ++ch) {
                const VF2 v = load_bf16(vr + ch * W, std::min(W, d - ch * W));
                for (int64_t j = 0; j < g_; ++j) {
                    float* a = acc + (j * nch_ + ch) * W;
                    (VF2::loadu(a, L2) + VF2(s[j * Cp + c]) * v).store(a, L2);
                }
            }
        }
    }
}

// One sequence b, KV heads [h0, h1): out[b, h*g + j, :] for h in [h0, h1), j < g.
template <int NG, int NCH>
static void attend_one(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                       const int64_t* idx, const at::BFloat16* mask, at::BFloat16* out,
                       int64_t b, int64_t h0, int64_t h1, int64_t C, int64_t ld, int64_t kvh, int64_t g,
                       int64_t d, float scale) {
    const int64_t W = VB::size(), nch = (d + W - 1) / W, L = VF::size();
    const int64_t Cp = (C + L - 1) / L * L, G = (h1 - h0) * g;  // G query heads here
    std::vector<float> qf(G * nch * W, 0.f), s(G * Cp), acc(G * nch * W, 0.f), sum(G);
    const at::BFloat16* qb = q + (b * kvh + h0) * g * d;
    for (int64_t j = 0; j < G * d; ++j) qf[(j / d) * nch * W + j % d] = static_cast<float>(qb[j]);
    const int64_t* ix = idx + b * ld;
    const int64_t row = kvh * d;
    scores<NG, NCH>(qf.data(), kc, vc, ix, mask + b * ld, C, Cp, row, h0, h1, g, nch, d, scale, s.data());
    for (int64_t j = 0; j < G; ++j) {  // 2. exp(s - max), its sum
        float* sj = s.data() + j * Cp;
        for (int64_t c = C; c < Cp; ++c) sj[c] = -std::numeric_limits<float>::infinity();
        VF vm(-std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < Cp; c += L) vm = at::vec::maximum(vm, VF::loadu(sj + c));
        const float m = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return at::vec::maximum(x, y); }, vm);
        VF vs(0.f);
        for (int64_t c = 0; c < Cp; c += L) {
            VF e = (VF::loadu(sj + c) - VF(m)).exp();
            e.store(sj + c);
            vs = vs + e;
        }
        sum[j] = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return x + y; }, vs);
    }
    for (int64_t h = h0; h < h1; ++h) {  // 3. per KV head
        const int64_t j0 = (h - h0) * g;
        weighted_sum<NG, NCH>(vc, ix, C, Cp, row, h * d, g, nch, d, s.data() + j0 * Cp,
                              acc.data() + j0 * nch * W);
    }
    for (int64_t j = 0; j < G; ++j) {
        at::BFloat16* o = out + ((b * kvh + h0) * g + j) * d;
        for (int64_t e = 0; e < d; ++e)
            o[e] = static_cast<at::BFloat16>(acc[(j * nch + e / W) * W + e % W] / sum[j]);
    }
}

using AttendFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const int64_t*,
                          const at::BFloat16*, at::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float);

// The variant with compile-time sizes for the common (query heads per KV head, chunks of d).
static AttendFn pick(int64_t g, int64_t nch) {
    #define LASER_PICK(G, N) if (g == G && nch == N) return attend_one<G, N>;
    LASER_PICK(1, 1) LASER_PICK(1, 2) LASER_PICK(1, 4) LASER_PICK(1, 8)
    LASER_PICK(2, 1) LASER_PICK(2, 2) LASER_PICK(2, 4) LASER_PICK(2, 8)
    LASER_PICK(3, 1) LASER_PICK(3, 2) LASER_PICK(3, 4)
    LASER_PICK(4, 1) LASER_PICK(4, 2) LASER_PICK(4, 4)
    LASER_PICK(5, 2) LASER_PICK(6, 2) LASER_PICK(7, 2) LASER_PICK(8, 2)
    #undef LASER_PICK
    return attend_one<0, 0>;
}

extern "C" void kernel(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                       const int64_t* idx, const at::BFloat16* mask, at::BFloat16* out,
                       int64_t B, int64_t C, int64_t ld, int64_t kvh, int64_t g, int64_t d, int64_t threads) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const AttendFn fn = pick(g, (d + VB::size() - 1) / VB::size());
    // tasks: whole sequences, or at fewer sequences than threads each sequence's KV heads split
    const int64_t per = B >= threads ? kvh : std::max<int64_t>(1, kvh / std::max<int64_t>(1, threads / B));
    const int64_t parts = (kvh + per - 1) / per;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t t = 0; t < B * parts; ++t) {
        const int64_t b = t / parts, h0 = (t % parts) * per;
        fn(q, kc, vc, idx, mask, out, b, h0, std::min(kvh, h0 + per), C, ld, kvh, g, d, scale);
    }
}
"""

_ARGTYPES = ["const at::BFloat16*", "const at::BFloat16*", "const at::BFloat16*", "const int64_t*",
             "const at::BFloat16*", "at::BFloat16*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
             "int64_t", "int64_t"]


def compile_kernel(argtypes: list[str], source: str, what: str):
    """A C++ function ``kernel`` of ``source`` (argument types ``argtypes``) compiled with
    inductor's flags and vector ISA and cached on disk (inductor's C++ binding cache), or None
    where compiling or loading fails (a warning naming ``what``)."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        from .loader import use_inductor_cache_dir

        use_inductor_cache_dir()
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    except Exception as e:  # noqa: BLE001 -- a missing compiler or header raises many kinds
        log.warning("%s unavailable (%s: %s); the torch path runs instead", what, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None


def load_kernel():
    """The compiled decode attention kernel (compiled now or loaded from inductor's cache), or
    None where compiling or loading fails (a warning; inductor's graph runs instead). Call it as
    :func:`decode_attention_kernel` does."""
    return compile_kernel(_ARGTYPES, _SOURCE, "decode attention kernel")


def decode_attention_kernel(kernel, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                            kv_index: torch.Tensor, mask: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """Decode attention through ``kernel`` (:func:`load_kernel`'s result).

    q [B, Hq, d] bf16 (query heads sharing a KV head consecutive); kc, vc [slots, kvh, d] bf16,
    contiguous; kv_index [B, L] int64 slots (pads: any valid slot); mask [B, L] bf16 additive
    (0 = attend, -inf = pad; every row has at least one 0) -- or [B, 1, 1, L], the metadata's
    layout. ``cols``: the context is their first ``cols`` columns (the rest is spare room of a
    steady decode batch, :class:`laser.model.attn_steady.SteadyDecode`; read nothing of it: the
    same work and the same bits as a [B, cols] batch); None: all L. Returns [B, Hq, d] bf16.

    Raises:
        ValueError: a dtype, a layout or a head count that the kernel does not take.
    """
    B, Hq, d = q.shape
    kvh = kc.shape[1]
    if (q.dtype, kc.dtype, vc.dtype, mask.dtype) != (torch.bfloat16,) * 4 or kv_index.dtype != torch.long:
        raise ValueError("decode attention kernel: bf16 q/K/V/mask and int64 slots only")
    if Hq % kvh or kc.shape[2] != d or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"decode attention kernel: q {tuple(q.shape)} against a cache {tuple(kc.shape)}")
    q, kv_index, mask = q.contiguous(), kv_index.contiguous(), mask.contiguous()
    ld = kv_index.shape[1]
    out = torch.empty_like(q)
    kernel(q, kc, vc, kv_index, mask, out, B, ld if cols is None else cols, ld, kvh, Hq // kvh, d,
           torch.get_num_threads())
    return out
