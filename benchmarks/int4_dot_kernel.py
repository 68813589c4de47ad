"""A hand-written int4 x bf16 decode GEMM (vdpbf16ps) against aten's int4 kernel: why Laser keeps aten.

Laser's decode runs GGUF Q4 weights through ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations).
Earlier notes called that kernel compute-bound at one row (per k one broadcast activation, 64 columns
de-quantized by ``permutexvar`` + FMA). This script holds the kernel that would replace it and times both
on SmolLM2-135M's four layer shapes: per pair of 32-groups and output row, one load, two masks and a
shift split the nibbles, ``vpunpck{l,h}bw`` with the byte 0x43 makes each ``q`` the bf16 word of
``128 + q`` (exact), ``vdpbf16ps`` sums ``(128 + q) x`` over a group in 16 fp32 lanes and an FMA adds it
times the group's scale; ``zero - 136 scale`` times the group's activation sum takes back the offset
(the numbers of ``x @ ((q - 8) scale + zero).T`` with exact bf16 products in fp32, as aten's). Tiles of 4
output rows share an activation block; up to 4 activation rows share a de-quantized weight block;
tiles run over OpenMP threads. Checked against the exact product (fp64) and for batch invariance.

Timings: median us per call; "hot" calls one weight again and again (in cache), "stream" cycles 30
distinct weights per shape as a decode step reads them (past the L3 for the larger shapes): the case
that matters. Usage: ``python benchmarks/int4_dot_kernel.py --threads 1,2 --rows 1,2,4``. Needs a CPU
with AVX512-BF16 and a C++ compiler (inductor's C++ binding cache builds it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from laser.model.attn_kernel import compile_kernel
from laser.model.quant import QuantLinear, quantize_int4

#: Output rows per register tile (the packed weight's tile height).
TILE_N = 4
#: The weight group (GGUF's block of 32): the only group size the kernel takes.
GROUP = 32

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <immintrin.h>
#include <vector>
#include <cstring>

#define LASER_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
static constexpr int TN = 4;  // output rows per tile
static constexpr int64_t AHEAD = 4;  // quads prefetched ahead

// One tile of TN output rows for MB activation rows. w: the tile's groups of 32 as 4-group quads
// ([Gp / 4][TN][64] bytes) and, where Gp % 4 == 2, a tail pair ([TN][32] bytes); s, z: [Gp][TN] fp32
// (z: zero - 136 scale); xs: [M][Gp * 32] bf16 (zero-padded); sx: [M][Gp] the groups' activation sums.
// A weight q becomes the bf16 word 0x4300 | q = 128 + q (exact), so a group's dot product is
// sum (128 + q) x and z's -136 scale term takes back the 128 and the -8 of (q - 8).
template <int MB>
LASER_BF16 static inline void group_dot(const __m512bh wg, const at::BFloat16* xr, int64_t g, int r,
                                        const float* sf, __m512 (&acc)[MB][TN], int64_t Kp) {
    for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + m * Kp + g * 32);
        acc[m][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wg, xv), _mm512_set1_ps(sf[(g & 3) * TN + r]),
                                    acc[m][r]);
    }
}

static inline float f32(at::BFloat16 b) { return static_cast<float>(b); }

// scales of 4 groups x TN rows (bf16 [4][TN]; n of them, the rest 0) -> fp32 in sf
LASER_BF16 static inline void scales4(const at::BFloat16* s, int n, float* sf) {
    const __m256i b = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), s);
    _mm512_store_ps(sf, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
}

template <int MB>
LASER_BF16 static void tile(const uint8_t* w, const at::BFloat16* s, const at::BFloat16* z, const at::BFloat16* xs,
                            const float* sx, at::BFloat16* out, int64_t ldo, int64_t n0, int64_t nv,
                            int64_t Gp, int64_t m0) {
    const __m512i low = _mm512_set1_epi8(0x0F), magic = _mm512_set1_epi8(0x43);
    const int64_t Kp = Gp * 32, quads = Gp / 4;
    const at::BFloat16* xr = xs + m0 * Kp;
    __m512 acc[MB][TN];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < TN; ++r) acc[m][r] = _mm512_setzero_ps();
    alignas(64) float sf[4 * TN];
    for (int64_t p = 0; p < quads; ++p) {
        scales4(s + 4 * p * TN, 4 * TN, sf);
        for (int r = 0; r < TN; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(w + ((p + AHEAD) * TN + r) * 64), _MM_HINT_T0);
            const __m512i raw = _mm512_loadu_si512(w + (p * TN + r) * 64);
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            group_dot<MB>((__m512bh)_mm512_unpacklo_epi8(lo, magic), xr, 4 * p, r, sf, acc, Kp);
            group_dot<MB>((__m512bh)_mm512_unpackhi_epi8(lo, magic), xr, 4 * p + 1, r, sf, acc, Kp);
            group_dot<MB>((__m512bh)_mm512_unpacklo_epi8(hi, magic), xr, 4 * p + 2, r, sf, acc, Kp);
            group_dot<MB>((__m512bh)_mm512_unpackhi_epi8(hi, magic), xr, 4 * p + 3, r, sf, acc, Kp);
        }
    }
    if (Gp % 4) {  // the tail pair: low nibbles the first group's q in order, high the second's
        const __m256i low32 = _mm256_set1_epi8(0x0F);
        const __m512i m16 = _mm512_set1_epi16(0x4300);
        scales4(s + 4 * quads * TN, 2 * TN, sf);
        for (int r = 0; r < TN; ++r) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + quads * TN * 64 + r * 32));
            const __m256i lo = _mm256_and_si256(raw, low32), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low32);
            group_dot<MB>((__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(lo), m16), xr, 4 * quads, r, sf, acc, Kp);
            group_dot<MB>((__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(hi), m16), xr, 4 * quads + 1, r, sf, acc, Kp);
        }
    }
    for (int m = 0; m < MB; ++m) {
        __m128 zacc = _mm_setzero_ps();  // sum_g z[g] sx[g] for the TN rows, groups in order
        for (int64_t g = 0; g < Gp; ++g) {  // zero - 136 scale: exact in fp32 for bf16 operands
            alignas(16) float zg[TN];
            for (int r = 0; r < TN; ++r) zg[r] = f32(z[g * TN + r]) - 136.0f * f32(s[g * TN + r]);
            zacc = _mm_fmadd_ps(_mm_load_ps(zg), _mm_set1_ps(sx[(m0 + m) * Gp + g]), zacc);
        }
        alignas(16) float zt[TN];
        _mm_store_ps(zt, zacc);
        for (int r = 0; r < nv; ++r)
            out[(m0 + m) * ldo + n0 + r] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m][r]) + zt[r]);
    }
}

// y [M, N] bf16 = x [M, K] bf16 (row stride ldx) @ the packed int4 weight (tiles of TN rows, Gp groups
// of 32, Gp even, K <= Gp * 32).
extern "C" LASER_BF16 void kernel(const at::BFloat16* x, const uint8_t* w, const at::BFloat16* s, const at::BFloat16* z,
                                  at::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                                  int64_t Gp, int64_t threads) {
    const int64_t Kp = Gp * 32, tiles = (N + TN - 1) / TN;
    std::vector<at::BFloat16> xs(M * Kp, at::BFloat16(0.f));
    std::vector<float> sx(M * Gp);
    for (int64_t m = 0; m < M; ++m) {
        std::memcpy(xs.data() + m * Kp, x + m * ldx, K * sizeof(at::BFloat16));
        for (int64_t g = 0; g < Gp; ++g) {  // the group's activation sum, in a fixed order
            const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs.data() + m * Kp + g * 32));
            const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs.data() + m * Kp + g * 32 + 16));
            const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b0), 16));
            const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b1), 16));
            sx[m * Gp + g] = _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
        }
    }
    const int64_t wt = Gp * TN * 16, st = Gp * TN;  // a tile's bytes, scales
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t nv = std::min<int64_t>(TN, N - t * TN);
        const uint8_t* wp = w + t * wt;
        const at::BFloat16 *sp = s + t * st, *zp = z + t * st;
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) tile<4>(wp, sp, zp, xs.data(), sx.data(), y, N, t * TN, nv, Gp, m0);
        switch (M - m0) {
            case 3: tile<3>(wp, sp, zp, xs.data(), sx.data(), y, N, t * TN, nv, Gp, m0); break;
            case 2: tile<2>(wp, sp, zp, xs.data(), sx.data(), y, N, t * TN, nv, Gp, m0); break;
            case 1: tile<1>(wp, sp, zp, xs.data(), sx.data(), y, N, t * TN, nv, Gp, m0); break;
            default: break;
        }
    }
}
"""

_ARGTYPES = ["const at::BFloat16*", "const uint8_t*", "const at::BFloat16*", "const at::BFloat16*", "at::BFloat16*",
             "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t"]

_KERNEL: list = []  # [kernel or None] once loaded


def load_kernel():
    """The compiled kernel (compiled now or loaded from inductor's cache; once per process), or None
    on a CPU without AVX512-BF16 or where compiling fails (a warning)."""
    if not _KERNEL:
        ok = (torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch.cpu._is_avx512_bf16_supported())
        _KERNEL.append(compile_kernel(_ARGTYPES, _SOURCE, "int4 decode kernel") if ok else None)
    return _KERNEL[0]


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's operands of an int4 weight ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``.

    ``q`` int8 [N, K] in 0..15 (K a multiple of :data:`GROUP`), ``scale`` / ``zero`` [N, K / 32] (any
    float dtype; used as given, so pass the bf16-rounded ones the other paths use). Returns
    (``w`` uint8 [tiles, Gp * TILE_N * 16], ``s`` and ``z - 136 s`` float32 [tiles, Gp, TILE_N]) with
    ``tiles = ceil(N / TILE_N)`` and ``Gp`` the group count rounded up to even; pad rows and groups
    hold ``q = 8`` and zero scales (they add exact zeros).

    Raises:
        ValueError: K is not a multiple of the group size, or the shapes disagree.
    """
    N, K = q.shape
    G = K // GROUP
    if K % GROUP or tuple(scale.shape) != (N, G) or tuple(zero.shape) != (N, G):
        raise ValueError(f"int4 kernel: q {tuple(q.shape)} with scale {tuple(scale.shape)} / zero {tuple(zero.shape)}; "
                         f"groups of {GROUP}")
    tiles, Gp = -(-N // TILE_N), G + G % 2
    qq = torch.full((tiles * TILE_N, Gp, GROUP), 8, dtype=torch.uint8)
    qq[:N, :G] = q.view(N, G, GROUP).to(torch.uint8)
    qq = qq.view(tiles, TILE_N, Gp, GROUP)
    quads = Gp // 4
    # a quad's 64 bytes: byte 16 j + i holds (low / high nibble) group 0 / 2 element 8 j + i for i < 8,
    # group 1 / 3 element 8 j + i - 8 for i >= 8 (the order _mm512_unpack{lo,hi}_epi8 reads them back)
    qd = qq[:, :, : 4 * quads].reshape(tiles, TILE_N, quads, 4, 4, 8)  # [.., group, lane j, i]
    lo = torch.cat([qd[:, :, :, 0], qd[:, :, :, 1]], dim=-1)  # [tiles, TN, quads, 4 lanes, 16]
    hi = torch.cat([qd[:, :, :, 2], qd[:, :, :, 3]], dim=-1)
    body = (lo | (hi << 4)).reshape(tiles, TILE_N, quads, 64).permute(0, 2, 1, 3).reshape(tiles, -1)
    parts = [body]
    if Gp % 4:  # the tail pair: low nibbles group Gp - 2 in order, high nibbles group Gp - 1
        parts.append((qq[:, :, -2] | (qq[:, :, -1] << 4)).reshape(tiles, -1))
    w = torch.cat(parts, dim=1).contiguous()
    sz = []
    for a in (scale, zero):
        full = torch.zeros(tiles * TILE_N, Gp, dtype=torch.bfloat16)
        full[:N, :G] = a.to(torch.bfloat16)
        sz.append(full.view(tiles, TILE_N, Gp).transpose(1, 2).contiguous())
    return w, sz[0], sz[1]


def int4_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [M, K] bf16 (rows of any stride, elements contiguous) @ the packed weight (:func:`pack`'s
    ``w``, ``s``, ``z`` of an [n, K] weight) -> [M, n] bf16, through the loaded kernel.

    Raises:
        ValueError: a dtype or shape the kernel does not take. RuntimeError: the kernel is not loaded.
    """
    kernel = _KERNEL[0] if _KERNEL else None
    if kernel is None:
        raise RuntimeError("int4 kernel: not loaded on this CPU (load_kernel() returned None)")
    M, K = x.shape
    Gp = s.shape[1]
    if x.dtype != torch.bfloat16 or w.dtype != torch.uint8 or K > Gp * GROUP or s.shape[0] * TILE_N < n:
        raise ValueError(f"int4 kernel: x {tuple(x.shape)} {x.dtype} against a packed weight of {n} x {Gp * GROUP}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, n, dtype=torch.bfloat16)
    if M:
        kernel(x, w, s, z, y, M, n, K, x.stride(0), Gp, torch.get_num_threads())
    return y



SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def operands(lin: QuantLinear) -> tuple[torch.Tensor, ...]:
    """:func:`pack` of ``lin``'s int4 weight with the bf16-rounded scales and zeros aten's path uses."""
    sz = lin.scales.float()  # [G, N, 2]
    return pack(lin.qw.q, sz[:, :, 0].t(), sz[:, :, 1].t())


def check(lin: QuantLinear, ops: tuple, rows: int) -> float:
    """Largest |kernel - exact| over ``rows`` random rows, against the fp64 product of the same
    weight; asserts that row 0 is bit-equal alone and in the batch. Returns the error relative to the
    largest output."""
    N, K = lin.qw.shape
    x = torch.randn(rows, K).bfloat16()
    y = int4_mm(x, *ops, N)
    assert torch.equal(y[0], int4_mm(x[:1], *ops, N)[0]), "a row's output depends on its batch"
    exact = x.double() @ lin.dense_weight(torch.float64).t()
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


def time_us(fn, xs: list, rounds: int) -> float:
    """Median us of one call of ``fn(i, x)`` over ``rounds`` passes of the 30 weights ``i``."""
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(30):
            fn(i, xs)
        ts.append((time.perf_counter() - t) / 30)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if load_kernel() is None:
        raise SystemExit("the kernel needs AVX512-BF16 and a C++ compiler")
    torch.manual_seed(0)
    print("shape | threads | rows | aten stream / kernel stream (us) | ratio | aten hot / kernel hot | ratio")
    for name, (N, K) in SHAPES.items():
        lins = [QuantLinear(quantize_int4(torch.randn(N, K) * 0.05)) for _ in range(30)]
        ops = [operands(lin) for lin in lins]
        err = check(lins[0], ops[0], 5)
        for t in (int(v) for v in args.threads.split(",")):
            torch.set_num_threads(t)
            for M in (int(v) for v in args.rows.split(",")):
                x = torch.randn(M, K).bfloat16()
                aten = lambda i, _x, hot=False: lins[0 if hot else i].weight_only(x)  # noqa: E731
                mine = lambda i, _x, hot=False: int4_mm(x, *ops[0 if hot else i], N)  # noqa: E731
                a, k, ah, kh = [], [], [], []
                for _ in range(3):  # interleaved
                    a.append(time_us(aten, None, args.rounds))
                    k.append(time_us(mine, None, args.rounds))
                    ah.append(time_us(lambda i, _x: aten(i, _x, True), None, args.rounds))
                    kh.append(time_us(lambda i, _x: mine(i, _x, True), None, args.rounds))
                a, k, ah, kh = (statistics.median(v) for v in (a, k, ah, kh))
                print(f"{name} {N}x{K} | {t} | {M} | {a:.1f} / {k:.1f} | {k / a:.2f} | {ah:.1f} / {kh:.1f} | "
                      f"{kh / ah:.2f}   (max error {err:.1e} of the largest output)")


if __name__ == "__main__":
    main()
