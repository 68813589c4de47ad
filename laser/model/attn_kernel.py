"""Decode attention as one hand-written C++ kernel (graph D's kernel; ``laser.model.fused``).

One query row per sequence attends over its context rows in the paged KV cache, gathered by slot
index inside the kernel: plain softmax(q k^T / sqrt(d) + mask) v (Vaswani et al. 2017) in fp32,
the reference :func:`laser.model.fused.decode_attention`; compiled for a bf16 or an fp32 cache (the
model dtype: :func:`load_kernel`). Per sequence (its KV heads split over threads when there are
fewer sequences than threads):

1. scores: each context slot's K row read once for the task's KV heads (bf16 -> fp32, or fp32 as
   is), the ``g`` query heads sharing a KV head multiplied side by side (``g`` independent FMA
   chains, so the adds do not wait on each other), reduced once per score; the K and V lines of
   the slot 16 positions ahead are prefetched (the gather is latency-bound: blocks of 16 slots at
   random places);
2. softmax numerator: the scores of a head, padded with -inf to whole vectors, ``exp(s - max)``
   vectorised, summed lane-wise (pads add exact zeros);
3. weighted sum, per KV head and chunk of d: ``sum_c e[c] v[c]`` with one vector accumulator per
   query head, in registers for the common sizes (compile-time counts; a generic path else, same
   order and the same FMAs), divided by the softmax sum at the end (as flash-decoding does),
   rounded once to the cache's dtype.

Measured (AMD EPYC, AVX2 + FMA only, 1 thread, SmolLM2's 3 KV heads x 3 x 64, hot caches, slots
in blocks of 16): one sequence of 520 positions 51 us in bf16 or fp32, 100 positions 13-15 us,
32 sequences of 100 positions 324-358 us; torch's SDPA over the gathered fp32 context (what an
fp32 model ran before) 190-207 / 54-66 / 829-863 us; this kernel with one add chain per score
and mul + add (before) 290 / 61 / 1790 us.

Batch invariance: a sequence's terms are added in position order in every loop, and pad positions
(mask -inf) add exact zeros after them, so a sequence's output is bit-equal alone and padded in a
batch (checked in tests/model/test_fused.py). This rests on the compiler keeping that order: inductor's
default C++ flags allow no reassociation (``-fno-unsafe-math-optimizations``, ``-ffp-contract=off``; the FMAs
are explicit), and a build with ``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG`` set would void it. Not
bit-equal to inductor's graph (another summation order): within rounding of it. The tasks run on OpenMP threads (torch's thread count).

Compiled and loaded through inductor's C++ binding cache (on disk under ``$TORCHINDUCTOR_CACHE_DIR``,
the flags and vector ISA inductor uses for its own kernels: AVX512 or AVX2 via ``at::vec``);
:func:`load_kernel` returns None where that fails (the caller keeps its torch path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <vector>
#include <cmath>
#include <limits>

#ifndef LASER_T
#define LASER_T at::BFloat16
#endif
using T = LASER_T;  // the cache's, q's, mask's and output's element type: bf16 or float
using VF = at::vec::Vectorized<float>;
using VF2 = at::vec::VectorizedN<float, 2>;
#ifndef AHEAD
#define AHEAD 16
#endif

// up to W = VF2::size() elements of a row as fp32 lanes
static inline VF2 load_row(const at::BFloat16* p, int64_t n) {
    return at::vec::convert<float, 2, at::BFloat16, 1>(at::vec::Vectorized<at::BFloat16>::loadu(p, n));
}
static inline VF2 load_row(const float* p, int64_t n) { return VF2::loadu(p, n); }

// 1. s[j, c] = q_j . k[c] * scale + mask[c] for the NG query heads of each KV head in [h0, h1)
// (NG, NCH: query heads per KV head and vector chunks of d, 0 = read g, nch at run time).
template <int NG, int NCH>
static void scores(const float* qf, const T* kc, const T* vc, const int64_t* ix,
                   const T* mb, int64_t C, int64_t Cp, int64_t row, int64_t h0, int64_t h1,
                   int64_t g_, int64_t nch_, int64_t d, float scale, float* s) {
    const int64_t W = VF2::size(), g = NG ? NG : g_, nch = NCH ? NCH : nch_;
    for (int64_t c = 0; c < C; ++c) {
        if (c + AHEAD < C) {  // this task's K and V lines of the row AHEAD positions on
            const int64_t at = ix[c + AHEAD] * row + h0 * d;
            for (int64_t e = 0; e < (h1 - h0) * d; e += 64 / int64_t(sizeof(T))) {  // a cache line
                __builtin_prefetch(kc + at + e);
                __builtin_prefetch(vc + at + e);
            }
        }
        const float m = static_cast<float>(mb[c]);
        for (int64_t h = h0; h < h1; ++h) {
            const T* kr = kc + ix[c] * row + h * d;
            const int64_t j0 = (h - h0) * g;
            if constexpr (NG > 0 && NCH > 0) {  // the NG dot products side by side (independent FMA chains)
                VF2 a[NG];
                for (int j = 0; j < NG; ++j) a[j] = VF2(0.f);
                for (int ch = 0; ch < NCH; ++ch) {
                    const VF2 kv = load_row(kr + ch * W, std::min(W, d - ch * W));
                    for (int j = 0; j < NG; ++j)
                        a[j] = at::vec::fmadd(VF2::loadu(qf + ((j0 + j) * NCH + ch) * W), kv, a[j]);
                }
                for (int j = 0; j < NG; ++j) {
                    float dot = at::vec::vec_reduce_all<float, 2>([](VF& x, VF& y) { return x + y; }, a[j]);
                    s[(j0 + j) * Cp + c] = dot * scale + m;
                }
            } else {  // the same sums, one head at a time
                for (int64_t j = 0; j < g; ++j) {
                    VF2 a(0.f);
                    for (int64_t ch = 0; ch < nch; ++ch)
                        a = at::vec::fmadd(VF2::loadu(qf + ((j0 + j) * nch + ch) * W),
                                           load_row(kr + ch * W, std::min(W, d - ch * W)), a);
                    float dot = at::vec::vec_reduce_all<float, 2>([](VF& x, VF& y) { return x + y; }, a);
                    s[(j0 + j) * Cp + c] = dot * scale + m;
                }
            }
        }
    }
}

// 3. acc[j] = sum_c e[j, c] v[c] (position order) for the g query heads of KV head h (offset
// off in a cache row); NG, NCH > 0 keep the accumulators in registers.
template <int NG, int NCH>
static void weighted_sum(const T* vc, const int64_t* ix, int64_t C, int64_t Cp, int64_t row,
                         int64_t off, int64_t g_, int64_t nch_, int64_t d, const float* s, float* acc) {
    const int64_t W = VF2::size(), L2 = 2 * VF::size();
    if constexpr (NG > 0 && NCH > 0) {  // per chunk of d, its NG accumulators in registers
        for (int ch = 0; ch < NCH; ++ch) {
            VF2 a[NG];
            for (int j = 0; j < NG; ++j) a[j] = VF2(0.f);
            for (int64_t c = 0; c < C; ++c) {
                const VF2 v = load_row(vc + ix[c] * row + off + ch * W, std::min(W, d - ch * W));
                for (int j = 0; j < NG; ++j) a[j] = at::vec::fmadd(VF2(s[j * Cp + c]), v, a[j]);
            }
            for (int j = 0; j < NG; ++j) a[j].store(acc + (j * NCH + ch) * W, L2);
        }
    } else {
        for (int64_t c = 0; c < C; ++c) {
            const T* vr = vc + ix[c] * row + off;
            for (int64_t ch = 0; ch < nch_; ++ch) {
                const VF2 v = load_row(vr + ch * W, std::min(W, d - ch * W));
                for (int64_t j = 0; j < g_; ++j) {
                    float* a = acc + (j * nch_ + ch) * W;
                    at::vec::fmadd(VF2(s[j * Cp + c]), v, VF2::loadu(a, L2)).store(a, L2);
                }
            }
        }
    }
}

// One sequence b, KV heads [h0, h1): out[b, h*g + j, :] for h in [h0, h1), j < g.
template <int NG, int NCH>
static void attend_one(const T* q, const T* kc, const T* vc,
                       const int64_t* idx, const T* mask, T* out,
                       int64_t b, int64_t h0, int64_t h1, int64_t C, int64_t ld, int64_t kvh, int64_t g,
                       int64_t d, float scale) {
    const int64_t W = VF2::size(), nch = (d + W - 1) / W, L = VF::size();
    const int64_t Cp = (C + L - 1) / L * L, G = (h1 - h0) * g;  // G query heads here
    std::vector<float> qf(G * nch * W, 0.f), s(G * Cp), acc(G * nch * W, 0.f), sum(G);
    const T* qb = q + (b * kvh + h0) * g * d;
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
        T* o = out + ((b * kvh + h0) * g + j) * d;
        for (int64_t e = 0; e < d; ++e)
            o[e] = static_cast<T>(acc[(j * nch + e / W) * W + e % W] / sum[j]);
    }
}

using AttendFn = void (*)(const T*, const T*, const T*, const int64_t*,
                          const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float);

// The variant with compile-time sizes for the common (query heads per KV head, chunks of d).
static AttendFn pick(int64_t g, int64_t nch) {
#ifdef LASER_GENERIC_ONLY  // tests: the generic path for every size (the same bits as a specialised one)
    return attend_one<0, 0>;
#endif
    #define LASER_PICK(G, N) if (g == G && nch == N) return attend_one<G, N>;
    LASER_PICK(1, 1) LASER_PICK(1, 2) LASER_PICK(1, 4) LASER_PICK(1, 8)
    LASER_PICK(2, 1) LASER_PICK(2, 2) LASER_PICK(2, 4) LASER_PICK(2, 8)
    LASER_PICK(3, 1) LASER_PICK(3, 2) LASER_PICK(3, 4)
    LASER_PICK(4, 1) LASER_PICK(4, 2) LASER_PICK(4, 4)
    LASER_PICK(5, 2) LASER_PICK(6, 2) LASER_PICK(7, 2) LASER_PICK(8, 2)
    #undef LASER_PICK
    return attend_one<0, 0>;
}

// bad[0]: 0, or 1 + the flat index into idx of the first slot outside [0, slots) (then nothing is read)
extern "C" void kernel(const T* q, const T* kc, const T* vc,
                       const int64_t* idx, const T* mask, T* out,
                       int64_t B, int64_t C, int64_t ld, int64_t kvh, int64_t g, int64_t d, int64_t threads,
                       int64_t slots, int64_t* bad) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < C; ++c) {
            const int64_t s = idx[b * ld + c];
            if (s < 0 || s >= slots) {
                bad[0] = 1 + b * ld + c;
                return;
            }
        }
    bad[0] = 0;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const AttendFn fn = pick(g, (d + VF2::size() - 1) / VF2::size());
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

#: the element types the kernel is compiled for (the C++ ``T``)
_CTYPES = {torch.bfloat16: "at::BFloat16", torch.float32: "float"}


@dataclass(frozen=True)
class DecodeAttentionKernel:
    """The compiled kernel ``fn`` for one element type ``dtype`` (bf16 or fp32): what
    :func:`load_kernel` returns and :func:`decode_attention_kernel` calls. ``status``: the int64
    word the kernel reports a slot outside the cache in, and its numpy view (read without a
    dispatch); one call at a time per object (each model loads its own)."""

    fn: object
    dtype: torch.dtype
    status: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))

    def __post_init__(self):
        object.__setattr__(self, "_status_np", self.status.numpy())

    @property
    def bad(self) -> int:
        """The last call's report: 0, or 1 + the flat index of the first slot outside the cache."""
        return int(self._status_np[0])


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


def load_kernel(dtype: torch.dtype = torch.bfloat16, generic_only: bool = False) -> DecodeAttentionKernel | None:
    """The decode attention kernel for a ``dtype`` cache (bf16 or fp32; compiled now or loaded from
    inductor's cache), or None where compiling or loading fails (a warning; the caller's torch path
    runs instead). Call it as :func:`decode_attention_kernel` does. ``generic_only``: a build that
    runs the generic path at every size (for tests: its bits equal the specialised variants').

    Raises:
        ValueError: another dtype.
    """
    if dtype not in _CTYPES:
        raise ValueError(f"decode attention kernel: bf16 or fp32, not {dtype}")
    t = _CTYPES[dtype]
    argtypes = [f"const {t}*"] * 3 + ["const int64_t*", f"const {t}*", f"{t}*"] + ["int64_t"] * 8 + ["int64_t*"]
    defines = f"#define LASER_T {t}\n" + ("#define LASER_GENERIC_ONLY\n" if generic_only else "")
    fn = compile_kernel(argtypes, defines + _SOURCE, f"{str(dtype).removeprefix('torch.')} decode attention kernel")
    return None if fn is None else DecodeAttentionKernel(fn, dtype)


def decode_attention_kernel(kernel: DecodeAttentionKernel, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                            kv_index: torch.Tensor, mask: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """Decode attention through ``kernel`` (:func:`load_kernel`'s result).

    q [B, Hq, d] in the kernel's dtype (bf16 or fp32; query heads sharing a KV head consecutive);
    kc, vc [slots, kvh, d] in it, contiguous; kv_index [B, L] int64 slots (pads: any valid slot);
    mask [B, L] in it, additive
    (0 = attend, -inf = pad; every row has at least one 0) -- or [B, 1, 1, L], the metadata's
    layout. ``cols``: the context is their first ``cols`` columns (the rest is spare room of a
    steady decode batch, :class:`laser.model.attn_steady.SteadyDecode`; read nothing of it: the
    same work and the same bits as a [B, cols] batch); None: all L. Returns [B, Hq, d] in the
    kernel's dtype.

    Raises:
        ValueError: a dtype, a layout, a head count or a shape that the kernel does not take (it
            reads raw pointers: every size is checked here), or a slot outside the cache among the
            columns it reads (checked by the kernel before it reads anything).
    """
    if q.dim() != 3 or kc.dim() != 3:
        raise ValueError(f"decode attention kernel: q [B, Hq, d] and K/V [slots, kvh, d], got q {tuple(q.shape)}, "
                         f"K/V {tuple(kc.shape)}")
    B, Hq, d = q.shape
    kvh = kc.shape[1]
    dt = kernel.dtype
    ld = kv_index.shape[1] if kv_index.dim() == 2 else 0
    C = ld if cols is None else cols
    if kv_index.dim() != 2 or kv_index.shape[0] != B or mask.numel() != kv_index.numel() or vc.shape != kc.shape \
            or not 1 <= C <= ld:
        raise ValueError(f"decode attention kernel: q {tuple(q.shape)}, K/V {tuple(kc.shape)} / {tuple(vc.shape)}, "
                         f"slots {tuple(kv_index.shape)}, mask {tuple(mask.shape)}, cols {cols}")
    if B == 0:
        return torch.empty_like(q)
    if (q.dtype, kc.dtype, vc.dtype, mask.dtype) != (dt,) * 4 or kv_index.dtype != torch.long:
        raise ValueError(f"decode attention kernel: {dt} q/K/V/mask and int64 slots only (got q {q.dtype}, "
                         f"K/V {kc.dtype}/{vc.dtype}, mask {mask.dtype}, slots {kv_index.dtype})")
    if Hq % kvh or kc.shape[2] != d or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"decode attention kernel: q {tuple(q.shape)} against a cache {tuple(kc.shape)}")
    q, kv_index, mask = q.contiguous(), kv_index.contiguous(), mask.contiguous()
    out = torch.empty_like(q)
    kernel.fn(q, kc, vc, kv_index, mask, out, B, C, ld, kvh, Hq // kvh, d,
              torch.get_num_threads(), kc.shape[0], kernel.status)
    bad = kernel.bad
    if bad:
        b, c = divmod(bad - 1, ld)
        raise ValueError(f"decode attention kernel: slot {int(kv_index[b, c])} of sequence {b}, position {c}, "
                         f"is outside the cache of {kc.shape[0]} slots")
    return out
