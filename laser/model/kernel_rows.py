"""The row crossover of the quantized decode kernels, per CPU kind.

A :class:`~laser.model.quant.QuantLinear` runs up to ``kernel_max_rows`` rows through its
weight-only kernel (int4 / int8) and more rows as a dense matmul. Where the crossover lies depends
on the CPU: on a 2-core AVX2-only EPYC (fp32 activations, the defaults
``QuantLinear.KERNEL_MAX_ROWS``: int4 64, int8 32) the int4 kernel beat the dense matmul up to
64 rows, while on an AVX512-BF16 EPYC with bf16 activations it costs ~27 us per row of SmolLM2's
3072 x 576 gate/up (compute-bound: the time grows with every row) against a native bf16 dense
matmul that wins from 8-16 rows (measured, 1 thread: 32 rows 859 us int4 vs 547 us dense).
A dense matmul at those row counts only pays over a dequantized copy kept in memory
(dequantizing per call costs more than the kernel up to 64 rows), so where the crossover falls
below the default each such weight keeps a copy in the model dtype (2 bytes a weight in bf16,
4 in fp32, on top of the packed integers).

:func:`choose_kernel_rows` measures the crossover once per weight shape on the CPU it runs on
(interleaved kernel / dense timings at 1..64 rows, medians) and caches it in
``<laser cache>/quant_rows.json`` keyed by the CPU's model name and flags, torch's version and
thread count, the kernel, the shape and the dtype, so a later start reads it instead of
measuring. ``$LASER_QUANT_ROWS=fixed`` keeps the defaults (the test suite's default, so that
test runs are deterministic).

The dense copies' layout is chosen per CPU kind (:func:`dense_layout`): on CPUs with AMX a bf16
copy is kept oneDNN-packed (a :class:`~laser.model.linear.Linear`: same bytes, the layout oneDNN's
AMX kernels read without reordering the weight on every call), elsewhere the plain weight for
``F.linear`` as before. Measured on an Intel Xeon (AMX + AVX512-BF16 + VNNI, 2 vCPUs), 1 thread,
SmolLM2's layer shapes, 30 weights cycled: at 32 rows the packed copy takes 0.61-0.75x the time of
``F.linear`` (qkv 69 vs 104 us, o 45 vs 67, gate/up 246 vs 403, down 106 vs 142), at 1-4 rows
0.50-0.79x; aten's int4 kernel there takes 3.4-5.8x the packed copy's time at 32 rows (compute-bound:
qkv 389 us, gate/up 1250) and 0.74-0.87x at 4 rows. The crossover is measured against the layout kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import w8a8
from .linear import GatedLinear, Linear, gated_linear
from .prefill import amx_switch
from .quant import QuantLinear

#: Row counts timed; the crossover is one of them.
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64)
#: The dense matmul must be at least this much faster (time ratio) to take rows from the kernel:
#: the kernel path keeps no extra copy of the weight, so near-ties stay with it.
DENSE_MARGIN = 0.9
#: W8A8 must be at least this much faster than the weight-only kernel to take its rows (it keeps
#: one more packed copy of the weight and rounds the activations to 8 bits).
W8A8_MARGIN = 0.9
#: Against a packed dense copy (:func:`dense_layout`) the kernel keeps at least this many rows. The
#: crossover is timed on one weight, hot in cache, which flatters the dense copy's 2 bytes a weight,
#: and leaves out the fused decode graphs, which run only up to the smallest crossover of a layer
#: (:mod:`laser.model.fused`). On the AMX Xeon, 1 thread: the timing put the qkv crossover at 2 rows,
#: and batch-4 decode fell from 201 to 155 tok/s (eager layers); with 30 weights cycled aten's int4
#: kernel still beat the packed copy at 4 rows on every layer shape (0.74-0.87x its time). Whole decode
#: steps (SmolLM2 int4, session 28): with the kernel up to 8 rows, batch 5 / 6 / 8 took 30.4 / 33.4 / 36.3 ms
#: at 1 thread against 37.9 / 38.8 / 40.3 ms over the packed copies from 5 rows (19.5 / 19.8 / 21.3 against
#: 24.8 / 25.3 / 26.1 ms at 2 threads); 12 rows and more the same either way; the kernel alone (every row
#: count through it) lost from 12 rows (52 against 42 ms).
PACKED_MIN_ROWS = 8
_REPEATS = 5


def rows_mode() -> str:
    """``$LASER_QUANT_ROWS``: ``measure`` (the default; measured once per CPU kind and cached)
    or ``fixed`` (``QuantLinear.KERNEL_MAX_ROWS``). Raises ValueError on another value."""
    mode = os.environ.get("LASER_QUANT_ROWS", "measure")
    if mode not in ("measure", "fixed"):
        raise ValueError(f"LASER_QUANT_ROWS={mode!r}: use measure or fixed")
    return mode


def dense_layout() -> str:
    """How a bf16 dense copy past the crossover is kept: ``"packed"`` (oneDNN's blocked layout, a
    :class:`~laser.model.linear.Linear`) or ``"plain"`` (the [N, K] weight for ``F.linear``).
    ``$LASER_QUANT_DENSE`` = ``auto`` (the default: packed on CPUs with AMX tiles, per torch's own
    check; plain elsewhere, the layout measured on the AVX2 and AVX512-BF16 kinds), ``packed`` or
    ``plain``. Raises ValueError on another value."""
    return amx_switch("LASER_QUANT_DENSE", "packed", "plain")


def dense_copy(lin: QuantLinear, dtype: torch.dtype) -> torch.Tensor | Linear:
    """``lin``'s weight dequantized to ``dtype`` [N, K] in the layout :func:`dense_layout` chooses:
    a oneDNN-packed bf16 :class:`~laser.model.linear.Linear` (where packing works; ``Linear`` keeps
    only the packed copy in bf16) or the plain tensor."""
    w = lin.dense_weight(dtype).contiguous()
    if dtype == torch.bfloat16 and dense_layout() == "packed":
        packed = Linear(w)
        if packed.packed is not None and packed.w is None and packed.wt is None:
            return packed
    return w


def gated_dense_copy(lin: QuantLinear, dtype: torch.dtype) -> None:
    """Replace the MLP gate/up ``lin``'s packed dense copy (:func:`dense_copy`; [2 I, K], gate
    rows first) by a :class:`~laser.model.linear.GatedLinear` of the same weight, so its rows
    past the crossover run SiLU(gate) * up in the matmul epilogues
    (:func:`laser.model.linear.swiglu_of`). Same memory; no-op where ``lin`` keeps no packed
    bf16 copy or :func:`laser.model.linear.gated_linear` declines."""
    if dtype != torch.bfloat16 or not isinstance(lin.dense, Linear) or lin.dense.sliceable or lin.b is not None:
        return
    gated = gated_linear(lin.dense_weight(dtype).contiguous())
    if gated is not None:
        lin.dense = gated


def dense_nbytes(dense: torch.Tensor | Linear | GatedLinear) -> int:
    """Bytes a kept dense copy (:func:`dense_copy`) holds: 2 a weight for a packed bf16 copy."""
    return dense.numel() * 2 if isinstance(dense, (Linear, GatedLinear)) else dense.numel() * dense.element_size()


def cpu_key() -> str:
    """This CPU's model name and a hash of its feature flags (from /proc/cpuinfo), torch's
    version and intra-op thread count: what a measured crossover holds for."""
    name, flags = "?", ""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name") and name == "?":
                name = ln.split(":", 1)[1].strip()
            elif ln.startswith("flags") and not flags:
                flags = " ".join(sorted(ln.split(":", 1)[1].split()))
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode()).hexdigest()[:12]
    return f"{name}|{digest}|torch {torch.__version__}|t{torch.get_num_threads()}"


def measure_crossover(lin: QuantLinear, dtype: torch.dtype, repeats: int = _REPEATS) -> int:
    """The largest row count of :data:`CANDIDATE_ROWS` up to which ``lin``'s kernel is not
    clearly slower than a dense ``dtype`` matmul over its dequantized weight, capped at the
    default ``QuantLinear.KERNEL_MAX_ROWS``; 0 when the dense matmul wins from one row.

    "Clearly slower": the dense median time under :data:`DENSE_MARGIN` times the kernel's, at a
    row count and at the next one (one noisy point does not move the crossover). Timings are
    interleaved (kernel, dense, per row count, ``repeats`` rounds after one warm-up round) with
    random activations; takes ~0.1-0.5 s for SmolLM2's shapes.
    """
    cap = QuantLinear.KERNEL_MAX_ROWS[lin.qw.kind]
    dense = dense_copy(lin, dtype)
    matmul = dense if isinstance(dense, Linear) else lambda a: F.linear(a, dense)
    kernel_s, dense_s = _median_times(lin, dtype, (lin.kernel, matmul), repeats)
    return pick_crossover(kernel_s, dense_s, cap)


def _median_times(lin: QuantLinear, dtype: torch.dtype, fns: tuple, repeats: int) -> tuple[dict[int, float], ...]:
    """Per function of ``fns`` (each ``x [M, K] -> y``), its median time (seconds) per row count
    of :data:`CANDIDATE_ROWS` on random ``dtype`` activations: interleaved (every function, per
    row count, ``repeats`` rounds after one warm-up round)."""
    gen = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, lin.qw.shape[1], generator=gen).to(dtype) for m in CANDIDATE_ROWS}
    times = {m: tuple([] for _ in fns) for m in CANDIDATE_ROWS}
    with torch.inference_mode():
        for r in range(repeats + 1):
            for m, x in xs.items():
                for j, fn in enumerate(fns):
                    t = time.perf_counter()
                    fn(x)
                    if r:
                        times[m][j].append(time.perf_counter() - t)
    return tuple({m: statistics.median(t[j]) for m, t in times.items()} for j in range(len(fns)))


def measure_w8a8(lin: QuantLinear, dtype: torch.dtype, repeats: int = _REPEATS) -> int:
    """The smallest row count of :data:`CANDIDATE_ROWS` from which W8A8 (:mod:`laser.model.w8a8`)
    is clearly faster than ``lin``'s weight-only decode kernel (under :data:`W8A8_MARGIN` of its
    median time there and at the next row count), ``w8a8.OFF`` if none. Packs the W8A8 weight
    (kept only where it wins). Raises RuntimeError where oneDNN's ops are missing."""
    lin.use_w8a8(1)
    ops = lin.w8a8
    own_s, w8a8_s = _median_times(lin, dtype, (lin.weight_only, lambda a: w8a8.matmul(a, *ops)), repeats)
    rows = sorted(own_s)
    wins = [w8a8_s[m] < W8A8_MARGIN * own_s[m] for m in rows]
    first = next((rows[i] for i in range(len(rows)) if wins[i] and (i + 1 == len(rows) or wins[i + 1])), w8a8.OFF)
    lin.use_w8a8(first)
    return first


def pick_crossover(kernel_s: dict[int, float], dense_s: dict[int, float], cap: int) -> int:
    """The crossover from median times (seconds) per row count of the kernel and of the dense
    matmul (same keys, ascending): the row count before the first one where the dense matmul
    takes under :data:`DENSE_MARGIN` of the kernel's time there and at the next row count (or it
    is the last), 0 if that is the first; the last row count if the dense matmul never wins so;
    at most ``cap``."""
    rows = sorted(kernel_s)
    wins = [dense_s[m] < DENSE_MARGIN * kernel_s[m] for m in rows]
    for i in range(len(rows)):
        if wins[i] and (i + 1 == len(rows) or wins[i + 1]):
            return min(rows[i - 1] if i else 0, cap)
    return min(rows[-1], cap)


def _cache_path() -> Path:
    from .loader import cache_dir

    return cache_dir() / "quant_rows.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def choose_kernel_rows(linears: list[QuantLinear], dtype: torch.dtype) -> str:
    """Set ``kernel_max_rows`` of every :class:`QuantLinear` in ``linears`` for this CPU (see the
    module docstring) and give each whose crossover falls below the default a dense ``dtype``
    copy of its weight (:attr:`QuantLinear.dense`). Call after the decode kernels are prepared
    (:func:`laser.model.quant.prepare_decode_kernels`: the compiled GEMV is what is timed).
    Returns a sentence for the startup log: the crossovers, measured or read from the cache,
    and the memory the dense copies cost (MB)."""
    if not linears:
        return ""
    if rows_mode() == "fixed":
        return "quantized decode rows: the fixed defaults (LASER_QUANT_ROWS=fixed)"
    path, key = _cache_path(), cpu_key()
    cache = _read_cache(path)
    chosen: dict[str, int] = {}
    measured = 0
    for lin in linears:
        measured += _choose_w8a8(lin, dtype, _entry_key(key, lin, dtype, "w8a8|"), cache, chosen)
        # a crossover measured against the plain copy does not hold for the packed one
        k = _entry_key(key, lin, dtype, "dpk|" if dtype == torch.bfloat16 and dense_layout() == "packed" else "")
        if k not in chosen:
            if k not in cache:
                try:
                    cache[k] = measure_crossover(lin, dtype)
                except (RuntimeError, MemoryError) as e:  # the defaults always work
                    logging.getLogger(__name__).warning("measuring the %s crossover failed (%s); using the default",
                                                        lin.qw.kind, e)
                    cache[k] = QuantLinear.KERNEL_MAX_ROWS[lin.qw.kind]
                measured += 1
            chosen[k] = int(cache[k])
        lin.kernel_max_rows = chosen[k]
        if "dpk|" in k:
            lin.kernel_max_rows = max(lin.kernel_max_rows, PACKED_MIN_ROWS)
        if lin.kernel_max_rows < QuantLinear.KERNEL_MAX_ROWS[lin.qw.kind]:
            lin.dense = dense_copy(lin, dtype)
    if measured:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    extra = sum(dense_nbytes(lin.dense) for lin in linears if lin.dense is not None)
    per_kind = {}
    for lin in linears:
        per_kind.setdefault(lin.qw.kind, set()).add(lin.kernel_max_rows)
    rows = ", ".join(f"{kind} up to {'/'.join(map(str, sorted(r)))}" for kind, r in sorted(per_kind.items()))
    w8 = sorted({lin.w8a8_min_rows for lin in linears if lin.w8a8_min_rows <= lin.kernel_max_rows})
    if w8:
        rows += f" (int8 from {'/'.join(map(str, w8))} rows as W8A8: int8 activations per row, oneDNN)"
    how = f"measured on this CPU for {measured} weight shapes" if measured else "read from the cache"
    packed = any(isinstance(lin.dense, Linear) for lin in linears)
    return (f"quantized decode rows through the kernels: {rows} ({how}; LASER_QUANT_ROWS=fixed for the "
            f"defaults); more rows run a dense matmul" +
            (f" over dequantized copies kept in memory{' (oneDNN-packed: AMX)' if packed else ''}: "
             f"+{extra / 1e6:.0f} MB" if extra else ""))


def _entry_key(cpu: str, lin: QuantLinear, dtype: torch.dtype, what: str = "") -> str:
    """The cache key of a measurement of ``lin`` on this CPU (``cpu``: :func:`cpu_key`): kind, decode
    kernel path, ``what`` (``""``: the dense crossover, ``"dpk|"``: the same against a packed dense copy,
    ``"w8a8|"``: W8A8's rows), weight shape, dtype."""
    return f"{cpu}|{lin.qw.kind}|{lin.path}|{what}{lin.qw.shape[0]}x{lin.qw.shape[1]}|{str(dtype).removeprefix('torch.')}"


def _choose_w8a8(lin: QuantLinear, dtype: torch.dtype, k: str, cache: dict, chosen: dict) -> int:
    """Set ``lin``'s W8A8 rows (:meth:`QuantLinear.use_w8a8`) from ``cache[k]`` or by
    :func:`measure_w8a8` (int8 weights, ``$LASER_QUANT_W8A8=measure``; else leaves them as
    constructed). Returns 1 if it measured (``cache`` updated), else 0."""
    if lin.qw.kind != "int8" or w8a8.w8a8_mode() != "measure" or not w8a8.available():
        return 0
    if k in chosen or k in cache:
        lin.use_w8a8(int(chosen.get(k, cache.get(k))))
        chosen[k] = lin.w8a8_min_rows
        return 0
    try:
        cache[k] = chosen[k] = measure_w8a8(lin, dtype)
    except (RuntimeError, MemoryError) as e:  # the weight-only kernel always works
        logging.getLogger(__name__).warning("measuring W8A8 failed (%s); int8 stays weight-only", e)
        lin.use_w8a8(w8a8.OFF)
        cache[k] = chosen[k] = w8a8.OFF
    return 1


def rows_label(linears: list[QuantLinear]) -> str:
    """The crossovers that differ from the defaults as a short executor-path label (e.g.
    ``int4r8`` or ``int4r8.16``; ``""`` when every one is the default), and ``w8a8r{n}`` where
    int8 rows from ``n`` run W8A8: a different kernel or crossover is a different machine to
    the latency model; ``dpk`` where the dense copies are oneDNN-packed (:func:`dense_layout`)."""
    parts = {}
    for lin in linears:
        if lin.kernel_max_rows != QuantLinear.KERNEL_MAX_ROWS[lin.qw.kind]:
            parts.setdefault(lin.qw.kind, set()).add(lin.kernel_max_rows)
    w8 = {lin.w8a8_min_rows for lin in linears if lin.w8a8_min_rows <= lin.kernel_max_rows}
    labels = [f"{k}r{'.'.join(map(str, sorted(v)))}" for k, v in sorted(parts.items())]
    dpk = ["dpk"] if any(isinstance(lin.dense, Linear) for lin in linears) else []
    return "-".join(labels + ([f"w8a8r{'.'.join(map(str, sorted(w8)))}"] if w8 else []) + dpk)
