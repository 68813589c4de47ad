"""Fitting the latency model from profile samples (numpy + scipy NNLS): paper §5.

Imported only by who fits (:meth:`FittedLatencyModel.fit` / ``refit``, the profiler):
predicting with a fitted model never imports this module, numpy or scipy.

* stateless modules and LM head: monotone piecewise-linear in the token (row) count with
  the segment width chosen by k-fold cross-validation (:func:`_fit_count_function`);
* attention: non-negative least squares on the feature set (see
  :mod:`laser.latency.features`) chosen by cross-validation (:func:`_fit_attention`);
* whole layers: a per-call overhead and a scale on attention (:func:`_fit_layer_composition`);
* whole steps (forms with ``step``): what a step costs beyond its layers, embedding and head, per
  step, per batch composition and per composed work (:func:`~.fitting_steps.fit_step_overhead`);
* whole decode steps (forms with ``instep``): a decode layer's price inside a step against the
  same call timed alone (:func:`~.fitting_steps.fit_decode_step_scale`).
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import nnls

from .base import (
    SAMPLE_TYPES,
    TYPE_KIND,
    AttentionSample,
    DecodeStepSample,
    EmbedSample,
    HeadSample,
    LayerSample,
    PrefillStepSample,
    Sample,
    StatelessSample,
    StepOverheadSample,
    WarmDecodeStepSample,
    check_batch,
    check_seconds,
)
from .features import (
    ATTENTION_FEATURE_SETS,
    ATTENTION_FEATURES,
    attention_features,
    gather_positions_from_metadata,
    kernel_rows_from_metadata,
)
from .fitted import AttentionModel, FittedLatencyModel, PiecewiseLinear
from .fitting_steps import fit_decode_warm, fit_whole_steps
from .io import laser_version

# Candidate segment widths (tokens) for the piecewise-linear stateless / head fits.
DEFAULT_WIDTHS = (8, 16, 32, 64, 128)
# Model selection uses the one-standard-error rule: the simplest candidate whose CV
# error is within one standard error of the best one's (floor: 0.01% absolute).
_SELECT_ABS_TOL = 1e-4
# Penalty on jumps at segment boundaries and on slope changes between segments (per
# segment width), relative to the typical sample time. Small: it only breaks ties,
# e.g. segments holding one sample each are interpolated linearly, not zig-zagged.
_TIE_PENALTY = 0.02
# Small counts keep their measured value (median of the samples at that count) instead of
# the fitted line: n = 1 .. K where every count up to K was sampled, K <= this. A fit
# smooths these away (a single decode token or LM-head row is far from half of two).
SMALL_COUNT_EXACT = 8
# Largest padded K (or V) gather of one decode group, bytes: mirrors


def _fit_piecewise(n: np.ndarray, y: np.ndarray, width: int) -> PiecewiseLinear:
    """Monotone piecewise-linear least-squares fit in *relative* error.

    Only segments holding data get parameters: a slope ``σ_i >= 0`` on the span from
    the end of the previous data segment to the end of segment ``i``, and a jump
    ``j_i >= 0`` at the segment's first token (GEMM tile effects). One NNLS solve so
    gives a non-decreasing, non-negative fit. Jumps and slope changes carry a small
    penalty, so data that does not demand them gets a straight line (segments with a
    single sample are interpolated, not given arbitrary steps or zig-zags). Empty segments
    between data are linearly interpolated; below the data the value is constant.
    """
    n = np.asarray(n, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    seg = (n - 1) // width
    segs = np.unique(seg)
    m = len(segs)
    start = segs * width + 1  # first token count of each data segment
    end = (segs + 1) * width  # last token count
    span0 = np.concatenate([[start[0]], end[:-1]])  # σ_i acts on (span0_i, end_i]

    def basis(nn: np.ndarray) -> np.ndarray:
        nn = np.asarray(nn, dtype=np.float64)[:, None]
        jumps = (nn >= start[None, :]).astype(np.float64)
        slopes = np.clip(nn - span0[None, :], 0.0, (end - span0)[None, :].astype(np.float64))
        return np.hstack([jumps, slopes])

    w = 1.0 / np.maximum(y, 1e-12)
    x = basis(n) * w[:, None]
    # Scale columns to unit max (slope columns count tokens) for a well-conditioned solve.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    x = x / scale
    rhs = np.ones(len(n))
    if m > 1:  # tie-breaking penalties: jumps after the first segment, slope changes
        r = np.arange(m - 1)
        lam = _TIE_PENALTY / float(np.median(y))
        jump_pen = np.zeros((m - 1, 2 * m))
        jump_pen[r, r + 1] = lam / scale[1:m]
        slope_pen = np.zeros((m - 1, 2 * m))
        slope_pen[r, m + r + 1] = lam * width / scale[m + 1:]
        slope_pen[r, m + r] = -lam * width / scale[m:-1]
        x = np.vstack([x, jump_pen, slope_pen])
        rhs = np.concatenate([rhs, np.zeros(2 * (m - 1))])
    coef, _ = nnls(x, rhs, maxiter=50 * x.shape[1] + 500)
    coef = coef / scale
    left = basis(start) @ coef  # value at s·w+1
    right = basis(end) @ coef  # value at (s+1)·w
    ramp_slope = coef[m:]

    nseg = int(segs[-1]) + 1
    a = [0.0] * nseg
    b = [0.0] * nseg
    for s in range(int(segs[0])):  # before the first data: constant (conservative)
        a[s] = float(left[0])
    for i, s in enumerate(segs.tolist()):
        slope = float(ramp_slope[i])
        a[s], b[s] = float(left[i]) - slope * (s * width + 1), slope
        if i + 1 < m:  # gap up to the next data segment
            s2 = int(segs[i + 1])
            x0, y0, x1, y1 = (s + 1) * width, float(right[i]), s2 * width + 1, float(left[i + 1])
            gs = max((y1 - y0) / (x1 - x0), 0.0)  # >= 0 up to rounding
            for g in range(s + 1, s2):
                a[g], b[g] = y0 - gs * x0, gs
    f = PiecewiseLinear(width, a, b, 0.0, 0.0)
    # Past the data: the average slope over the upper half of the fitted range.
    x_end = nseg * width
    y_end = float(right[-1])
    mid = max(1, x_end // 2)
    tail_b = (y_end - f(mid)) / (x_end - mid) if x_end > mid else 0.0
    tail_b = max(tail_b, 0.0)
    f.tail_a, f.tail_b = y_end - tail_b * x_end, tail_b
    return f


def _folds(m: int, k: int, seed: int = 0) -> list[np.ndarray]:
    perm = np.random.default_rng(seed).permutation(m)
    return [perm[i::k] for i in range(k)]


def _rel_err(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y))


def _select(errs: dict, order: Sequence) -> object:
    """One-standard-error rule: the simplest candidate (first in ``order``) whose mean
    held-out relative error is within one standard error of the best candidate's.
    ``errs`` maps candidate -> per-sample held-out relative errors."""
    mean = {k: float(np.mean(v)) for k, v in errs.items()}
    best = min(mean, key=mean.get)
    v = errs[best]
    se = float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
    for cand in order:
        if mean[cand] <= mean[best] + se + _SELECT_ABS_TOL:
            return cand
    return best


def _cv_errors(m: int, folds: int, fit_predict) -> np.ndarray:
    """Held-out prediction for every sample (k-fold): ``fit_predict(train_idx, test_idx) -> predictions``."""
    out = np.empty(m)
    for test in _folds(m, folds):
        train = np.setdiff1d(np.arange(m), test)
        out[test] = fit_predict(train, test)
    return out


def _small_count_lookup(n: np.ndarray, y: np.ndarray, limit: int) -> list[float]:
    """Medians of the samples at ``n = 1 .. K``, the longest run of consecutive sampled
    counts starting at 1 (``K <= limit``); empty if ``n = 1`` was not sampled."""
    have = set(int(v) for v in n)
    k = 0
    while k < limit and (k + 1) in have:
        k += 1
    return [float(np.median(y[n == i])) for i in range(1, k + 1)]


def isotonic_median(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in absolute error (seconds in, seconds out,
    same length): pool-adjacent-violators with each pool at the median of the values it holds.

    The small-count lookup's monotone form. A running max (the form before) copied one slow
    measurement onto every count after it: on an AMX Xeon (SmolLM2 bf16, 1 thread, kernel edge at 4
    rows) one stateless timing of 2.9 ms at 5 tokens, where 6..64 tokens measured 1.4-2.2 ms, priced
    every decode batch of 5..128 at 2.9 ms. Pooled, such a value is outvoted by its neighbours (a
    pool of two takes their mean); values already non-decreasing are returned as they are."""
    pools: list[list[float]] = []  # each pool's values, in order; pool medians non-decreasing
    for v in values:
        pools.append([float(v)])
        while len(pools) > 1 and float(np.median(pools[-2])) > float(np.median(pools[-1])):
            last = pools.pop()
            pools[-1].extend(last)
    return [float(np.median(p)) for p in pools for _ in p]


def _fit_count_function(
    n: Sequence[int], y: Sequence[float], widths: Sequence[int], folds: int,
    exact: int = 0, monotone: bool = True, breaks: Sequence[int] = (),
) -> tuple[PiecewiseLinear, dict]:
    """Fit a piecewise-linear function of a count, choosing the segment width by k-fold CV.

    The candidates are ``widths`` plus one segment spanning all data (a plain line,
    reported as width ``"linear"``). Returns the function refitted on all data and a
    report ``{"width": chosen, "cv_error": {candidate: mean relative error}, "exact": K}``.

    ``exact > 0``: counts ``1 .. K`` (the consecutively sampled ones, ``K <= exact``)
    predict their measured median, and the line is fitted to the larger counts only
    (where it is used). With ``monotone`` the lookup is made non-decreasing (:func:`isotonic_median`:
    a count measured above the ones after it is pooled with them, not copied onto them) and the line
    is floored at its last value, so the whole function stays non-decreasing (schedulers
    binary-search on it).

    ``breaks``: counts ``k`` where the kernel switches (:func:`~.features.kernel_rows_from_metadata`):
    only widths that make each ``k`` inside the data a segment edge are candidates (the line may
    bend or jump between ``k`` and ``k + 1``).
    """
    n = np.asarray(n, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    look = _small_count_lookup(n, y, exact) if exact > 0 and len(n) else []
    rest = n > len(look)
    if look and np.count_nonzero(rest) >= 2:
        f, rep = _fit_count_line(n[rest], y[rest], widths, folds, breaks)
    else:
        f, rep = _fit_count_line(n, y, widths, folds, breaks)
    if look:
        if monotone:
            look = isotonic_median(look)
        f.set_exact(look, floor=look[-1] if monotone else 0.0)
        rep["exact"] = len(look)
    return f, rep


def _fit_count_line(
    n: Sequence[int], y: Sequence[float], widths: Sequence[int], folds: int, breaks: Sequence[int] = ()
) -> tuple[PiecewiseLinear, dict]:
    n = np.asarray(n, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    if len(n) == 0:
        return PiecewiseLinear.zero(), {"width": None, "cv_error": {}}
    linear_w = max(2, int(n.max()))
    inside = [int(k) for k in breaks if n.min() <= k < n.max()]  # a switch between two sampled counts
    cands = {"linear": linear_w}
    for w in sorted(set(int(w) for w in widths), reverse=True):
        if 1 <= w < linear_w:
            cands[w] = w
    if inside:
        edge = math.gcd(*inside)
        cands = {c: w for c, w in cands.items() if c != "linear" and all(k % w == 0 for k in inside)} or {edge: edge}
    if inside and len(n) < 2 * max(folds, 2):  # no plain line to fall back on: fewer folds
        folds = max(2, len(n) // 2)
    if len(n) < 2 * max(folds, 2) or len(cands) == 1:
        first = next(iter(cands))
        return _fit_piecewise(n, y, cands[first]), {"width": first, "cv_error": {}}
    errs = {}
    for name, w in cands.items():
        def fit_predict(train, test, w=w):
            f = _fit_piecewise(n[train], y[train], w)
            return np.array([f(int(v)) for v in n[test]])

        errs[name] = np.abs(_cv_errors(len(n), folds, fit_predict) - y) / y
    chosen = _select(errs, list(cands))  # order: linear, then widest to narrowest
    cv = {str(k): float(np.mean(v)) for k, v in errs.items()}
    return _fit_piecewise(n, y, cands[chosen]), {"width": chosen, "cv_error": cv}



def _fit_attention_set(x: np.ndarray, y: np.ndarray, names: Sequence[str], scale_y: np.ndarray) -> AttentionModel:
    """NNLS of ``y`` on the ``names`` columns of ``x``, minimising ``Σ ((pred - y) / scale_y)²``."""
    cols = [ATTENTION_FEATURES.index(f) for f in names]
    w = 1.0 / np.maximum(scale_y, 1e-12)
    # Scale columns to unit max so NNLS is well conditioned; undo afterwards.
    xs = x[:, cols]
    scale = np.maximum(np.abs(xs).max(axis=0), 1e-30)
    coef, _ = nnls(xs / scale * w[:, None], y * w, maxiter=50 * len(cols) + 500)
    return AttentionModel("", {f: float(c / s) for f, c, s in zip(names, coef, scale)})


# Model forms :func:`fit` can fit (benchmarks/latency_refit.py compares them on the same timings):
# ``sets``: the attention feature sets offered to cross-validation, simplest first;
# ``small_counts``: stateless / LM-head counts 1..K that keep their measured value.
#   "paper": the paper's line (β·Σc for decode) or, when CV finds it better, the kernel terms;
#   "padded": first the decode entries priced by the padded gather the runner really does
#             (B · C_max per group), then the two above;
#   "padded-small16": "padded", and every count up to 16 (decode batches) keeps its measured
#             value (with two threads, small matmuls do not follow a line: OpenMP fork/join);
# ``step``: the step's own overhead (per step, per batch composition, per composed work) fitted
#   from the profile's StepOverheadSamples and priced (else 0: the forms before issue 26 item 3);
#   "padded-step": "padded" and the step overhead. Not the default: on the same samples it won on a
#             busy 1-thread run (iterations 91.7 -> 92.1 %) and a 4-layer model (78.8 -> 89.0 %) but lost
#             on the cleanest 2-thread run (94.7 -> 94.1 %: decode iterations there were already
#             over-predicted, docs/benchmarks.md); the profiler measures its samples either way.
# ``edges``: the stateless and LM-head lines keep a segment edge where the matmul kernels switch
#   (features.kernel_rows_from_metadata: int4 weights past 64 rows, int8 past 32 run a dense matmul).
#   "convex" (the default before "tiled"): "padded", decode attention whose cost per position may grow with its
#             group's gather (``d_pad2``, set "convex") and the kernel edges; on the same samples of
#             an AVX512 EPYC it beat "padded" per layer step (87.0 -> 89.5 %, 81.6 -> 85.9 % at 1 / 2
#             threads) and per iteration (87.8 -> 90.4 %, 89.2 -> 91.3 %; docs/benchmarks.md, "the
#             kernel edges and the convex gather"); "convex-step": with the step overhead (opt-in).
#   "tiled" (the default before "tiled-instep-step"): "convex" with a causal chunk's scores priced per query block of the flash
#             kernel (set "tiled", features.CAUSAL_Q_TILES); on the same samples, seven test sets of four
#             profiles of the AVX512 EPYC at 1 and 2 threads: attention module +0.6 to +1.8 points, layer
#             steps -0.1 to +0.5, iterations -0.1 to +0.1 (docs/benchmarks.md, "the noise floor").
# ``instep``: decode layer calls priced as they run inside a whole step (``decode_step_scale`` on the
#   stateless part, ``decode_step_attention_scale`` on attention, fitted from the profile's DecodeStepSamples:
#   fitting_steps.fit_decode_step_scale; 1.0 without them), and layer calls holding a prefill chunk
#   (``prefill_step_scale``, from the PrefillStepSamples: fitting_steps.fit_prefill_step_scale; 1.0 without them:
#   profiles before profiler 11).
#   "tiled-instep": "tiled" with it; "tiled-instep-step" (the default): and the step overhead, which the
#             DecodeStepSamples leave out (their compute is the step's wall time less it). On the same
#             samples of two fresh profiles of the AVX512 EPYC (docs/benchmarks.md, "decode layers priced
#             in a step"), against "tiled": iterations 91.7 -> 93.5 % at 1 thread, 90.2 -> 91.1 % at 2 (decode
#             iterations +12.6 -> +4.8 %, +6.4 -> -0.5 % bias); layer steps +0.1 / -0.1 points.
#             Since profiler 11 its attention candidates also hold "chunked", before "tiled": the prefill
#             entries other than one whole prompt priced per chunk as the C++ prefill kernel runs them (features
#             m_chunks, m_scores) instead of as one padded group; on the same samples of an AMX Xeon (bf16, one
#             thread) the attention CV error fell 6.5 -> 2.4 %, held-out layer steps 94.3 -> 96.1 %, iterations
#             91.1 -> 94.8 % (docs/benchmarks.md, "issue 26; helper lat26, session 26"). "tiled-instep-step-v10":
#             the same without "chunked" (the default up to profiler 10, for comparisons on old samples).
#             Since session 27 (same samples, no new profiler version) its prefill in-step factor also follows the
#             chunk's size (``prefill_step_slope``, fitting_steps.fit_prefill_step_scale's ``slope``): on the AMX
#             profile's 16 whole prefill steps the fit error fell 4.7 -> 2.5 %, and a 24-token chunk beside
#             decode rows is priced at ~0.99 of its call alone instead of 0.88 (measured: 0.98). "tiled-instep-
#             step-v11": one factor for every size (the default of profiler 11 until then).
FORMS = {
    "paper": {"sets": ("linear", "kernel"), "small_counts": SMALL_COUNT_EXACT, "step": False},
    "padded": {"sets": ("padded", "linear", "kernel"), "small_counts": SMALL_COUNT_EXACT, "step": False},
    "padded-small16": {"sets": ("padded", "linear", "kernel"), "small_counts": 16, "step": False},
    "padded-step": {"sets": ("padded", "linear", "kernel"), "small_counts": SMALL_COUNT_EXACT, "step": True},
    "convex": {"sets": ("padded", "linear", "convex", "kernel", "full"), "small_counts": SMALL_COUNT_EXACT,
               "step": False, "edges": True},
    "convex-step": {"sets": ("padded", "linear", "convex", "kernel", "full"), "small_counts": SMALL_COUNT_EXACT,
                    "step": True, "edges": True},
    "tiled": {"sets": ("padded", "linear", "tiled", "kernel", "full"), "small_counts": SMALL_COUNT_EXACT,
              "step": False, "edges": True},
    "tiled-instep": {"sets": ("padded", "linear", "tiled", "kernel", "full"), "small_counts": SMALL_COUNT_EXACT,
                     "step": False, "edges": True, "instep": True},
    "tiled-instep-step-v10": {"sets": ("padded", "linear", "tiled", "kernel", "full"),
                              "small_counts": SMALL_COUNT_EXACT, "step": True, "edges": True, "instep": True},
    "tiled-instep-step-v11": {"sets": ("padded", "linear", "chunked", "tiled", "kernel", "full"),
                              "small_counts": SMALL_COUNT_EXACT, "step": True, "edges": True, "instep": True},
    "tiled-instep-step": {"sets": ("padded", "linear", "chunked", "tiled", "kernel", "full"),
                          "small_counts": SMALL_COUNT_EXACT, "step": True, "edges": True, "instep": True,
                          "prefill_slope": True},
}
DEFAULT_FORM = "tiled-instep-step"


def _fit_attention(samples: Sequence[AttentionSample], folds: int, max_positions: int = 0,
                   stateless=None, sets: Sequence[str] = FORMS[DEFAULT_FORM]["sets"]) -> tuple[AttentionModel, dict]:
    """Attention coefficients by NNLS on the feature set chosen by ``folds``-fold CV
    (with fewer than ``2 · folds`` samples: the ``linear`` set, without CV).

    With ``stateless`` (tokens -> seconds), an error is weighed relative to the whole layer
    call the attention sits in (``attention + stateless(n)``), not to the attention alone:
    a 10% miss on a 0.2 ms decode attention next to 2 ms of projections matters less
    than a 5% miss on 15 ms of attention, and layer steps are what schedulers price.
    """
    if not samples:
        return AttentionModel("none", {}, max_positions), {"feature_set": None, "cv_error": {}}
    x = np.array([attention_features(s.query_lens, s.context_lens, max_positions) for s in samples],
                 dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    scale_y = y.copy()
    if stateless is not None:
        scale_y += np.array([stateless(sum(s.query_lens)) for s in samples], dtype=np.float64)
    order = list(sets)
    cv = {}
    if len(y) >= 2 * max(folds, 2):
        errs = {}
        for name in order:
            def fit_predict(train, test, names=ATTENTION_FEATURE_SETS[name]):
                mdl = _fit_attention_set(x[train], y[train], names, scale_y[train])
                return x[test] @ np.array([mdl.coef[f] for f in ATTENTION_FEATURES])

            errs[name] = np.abs(_cv_errors(len(y), folds, fit_predict) - y) / scale_y
        chosen = _select(errs, order)
        cv = {str(k): float(np.mean(v)) for k, v in errs.items()}
    else:
        chosen = order[0]
    mdl = _fit_attention_set(x, y, ATTENTION_FEATURE_SETS[chosen], scale_y)
    mdl.feature_set = chosen
    mdl.max_gather_positions = max(0, int(max_positions))
    return mdl, {"feature_set": chosen, "cv_error": cv, "max_gather_positions": mdl.max_gather_positions,
                 "weighed_by": "layer" if stateless is not None else "attention"}



def fit(samples: Iterable[Sample], *, num_layers: int, metadata: dict | None = None,
        widths: Sequence[int] | None = None, folds: int = 5, small_counts: int | None = None,
        max_gather_positions: int | None = None, form: str = DEFAULT_FORM) -> FittedLatencyModel:
    """Fit a :class:`FittedLatencyModel` from profile samples.

    Stateless and LM-head times: piecewise-linear, segment width chosen by ``folds``-fold
    CV among ``widths`` (``None``: ``DEFAULT_WIDTHS``) and a plain line; counts ``1 .. K``
    sampled consecutively (``K <= small_counts``; None: the form's) keep their measured medians (stateless:
    made non-decreasing; the head need not be). Attention: NNLS on the feature set chosen
    by CV among the candidates of ``form`` (see :data:`FORMS`), decode entries grouped as the runner splits them (``max_gather_positions``;
    ``None``: from ``metadata``, see :func:`gather_positions_from_metadata`), errors
    relative to the whole layer call (attention + stateless, see :func:`_fit_attention`).
    Embedding: a line. Step overhead (forms with ``step``) and decode and prefill layers inside a step (forms
    with ``instep``): :func:`~.fitting_steps.fit_whole_steps` of the :class:`StepOverheadSample` s,
    :class:`DecodeStepSample` s and :class:`PrefillStepSample` s (0.0 and 1.0 without them); decode steps in a
    streak (the same forms): :func:`~.fitting_steps.fit_decode_warm` of the :class:`WarmDecodeStepSample` s
    against the same steps' :class:`DecodeStepSample` s (``decode_warm``; () without them). Whole-layer composition (per-call overhead and a scale on
    attention): from :class:`LayerSample` s, see :func:`_fit_layer_composition` (0 and 1
    without them). All fits minimise relative error and keep coefficients non-negative.
    Missing sample kinds predict 0 (see ``report["missing"]``). ``metadata`` is stored as
    given, plus ``created`` and ``laser_version`` if absent. Raises ``TypeError`` for a
    non-sample, ``ValueError`` for an invalid sample or ``num_layers < 1``.
    """
    if form not in FORMS:
        raise ValueError(f"unknown model form {form!r}; one of {sorted(FORMS)}")
    samples = list(samples)
    widths = DEFAULT_WIDTHS if widths is None else widths
    if small_counts is None:
        small_counts = FORMS[form]["small_counts"]
    kinds = _by_kind(samples)
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")

    edges = kernel_rows_from_metadata(metadata) if FORMS[form].get("edges") else {}
    st = kinds[StatelessSample]
    stateless, st_rep = _fit_count_function([s.n_tokens for s in st], [s.seconds for s in st], widths, folds,
                                            exact=small_counts, breaks=edges.get("stateless", ()))
    if max_gather_positions is None:
        max_gather_positions = gather_positions_from_metadata(metadata)
    attention, at_rep = _fit_attention(kinds[AttentionSample], folds, max_gather_positions,
                                       stateless if st else None, FORMS[form]["sets"])
    hd = kinds[HeadSample]
    head, hd_rep = _fit_count_function([s.n_rows for s in hd], [s.seconds for s in hd], widths, folds,
                                       exact=small_counts, monotone=False, breaks=edges.get("head", ()))
    em = kinds[EmbedSample]
    embed, _ = _fit_count_function([s.n_tokens for s in em], [s.seconds for s in em], (), folds)

    layer = kinds[LayerSample]
    overhead, scale = _fit_layer_composition(layer, stateless, attention)
    steps = kinds[StepOverheadSample] if FORMS[form]["step"] else []
    dsteps = kinds[DecodeStepSample] if FORMS[form].get("instep") else []
    psteps = kinds[PrefillStepSample] if FORMS[form].get("instep") else []
    step_terms, dscale, step_rep = fit_whole_steps(
        steps, dsteps, psteps, num_layers, lambda b: stateless(b) + overhead,
        lambda c: scale * attention((1,) * len(c), c),
        lambda q, c: stateless(sum(q)) + scale * attention(q, c) + overhead, embed, head,
        prefill_slope=bool(FORMS[form].get("prefill_slope")))

    def in_sample(f, xs, ys):
        return _rel_err(np.array([f(x) for x in xs]), np.array(ys)) if xs else None

    report = {
        "stateless": {**st_rep, "error": in_sample(stateless, [s.n_tokens for s in st], [s.seconds for s in st])},
        "attention": {**at_rep, "error": in_sample(lambda s: attention(s.query_lens, s.context_lens),
                                                   kinds[AttentionSample], [s.seconds for s in kinds[AttentionSample]])},
        "head": {**hd_rep, "error": in_sample(head, [s.n_rows for s in hd], [s.seconds for s in hd])},
        "embed": {"error": in_sample(embed, [s.n_tokens for s in em], [s.seconds for s in em])},
        "missing": [TYPE_KIND[t] for t in (StatelessSample, AttentionSample, EmbedSample, HeadSample) if not kinds[t]],
        "form": form,
    }
    report.update(step_rep)
    if layer:
        model_layer = [stateless(sum(s.query_lens)) + scale * attention(s.query_lens, s.context_lens) + overhead
                       for s in layer]
        report["layer"] = {"overhead_s": overhead, "attention_scale": scale,
                           "error": _rel_err(np.array(model_layer), np.array([s.seconds for s in layer]))}
    meta = dict(metadata or {})
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    meta.setdefault("laser_version", laser_version())
    model = FittedLatencyModel(num_layers=num_layers, stateless=stateless, attention=attention, embed=embed,
                               head=head, layer_overhead_s=overhead, layer_attention_scale=scale,
                               step_overhead_s=step_terms[0], compose_overhead_s=step_terms[1],
                               compose_work_s=step_terms[2], decode_step_scale=dscale[0],
                               decode_step_attention_scale=dscale[1], prefill_step_scale=dscale[2],
                               prefill_step_slope=dscale[3], metadata=meta,
                               report=report,
                               samples=samples)
    warm = kinds[WarmDecodeStepSample] if FORMS[form].get("instep") else []
    if warm:  # against the same steps timed after other work (or the model's price of them, the in-step scales included)
        model.decode_warm = fit_decode_warm(warm, lambda c: model.step_compute_time((1,) * len(c), c),
                                            kinds[DecodeStepSample])
        report["decode_warm"] = {"factors": [[r, list(fs)] for r, fs in model.decode_warm], "n": len(warm)}
    return model


def _by_kind(samples: Sequence[Sample]) -> dict[type, list]:
    """``samples`` by sample type, each checked. Raises ``TypeError`` for a non-sample,
    ``ValueError`` for an invalid one."""
    kinds: dict[type, list] = {t: [] for t in SAMPLE_TYPES}
    for s in samples:
        if type(s) not in kinds:
            raise TypeError(f"not a profile sample: {s!r}")
        check_seconds(s.seconds)
        if isinstance(s, (AttentionSample, LayerSample)):
            check_batch(s.query_lens, s.context_lens)
        elif isinstance(s, (DecodeStepSample, WarmDecodeStepSample)):
            check_batch((1,) * len(s.context_lens), s.context_lens)
            if isinstance(s, WarmDecodeStepSample) and s.streak < 1:
                raise ValueError(f"a warm decode step sample needs streak >= 1: {s!r}")
        elif isinstance(s, PrefillStepSample):
            check_batch(s.query_lens, s.context_lens)
            if sum(s.query_lens) == len(s.query_lens):
                raise ValueError(f"a prefill step sample needs a prefill chunk (a query of 2+ tokens): {s!r}")
        elif isinstance(s, StepOverheadSample):
            if s.compositions < 1 or s.composed_works < s.compositions:
                raise ValueError(f"need 1 <= compositions <= composed_works: {s!r}")
        elif (s.n_tokens if hasattr(s, "n_tokens") else s.n_rows) < 1:
            raise ValueError(f"count must be >= 1: {s!r}")
        kinds[type(s)].append(s)
    return kinds


def _fit_layer_composition(layer: Sequence["LayerSample"], stateless, attention) -> tuple[float, float]:
    """``(overhead_s, attention_scale)`` such that a whole layer call costs
    ``stateless(n) + attention_scale · attention(q, c) + overhead_s``.

    NNLS on the whole-layer samples' residual over stateless, relative to the layer time,
    when there are enough of them (>= 6) and they span attention shares; otherwise the
    median residual over stateless + attention as the overhead and a scale of 1. The
    scale is clipped to [1, 1.5]: composing the parts never makes attention cheaper, and
    more than 50% extra would mean the profile is broken, not that layers interfere.
    """
    if not layer:
        return 0.0, 1.0
    y = np.array([s.seconds for s in layer])
    st = np.array([stateless(sum(s.query_lens)) for s in layer])
    at = np.array([attention(s.query_lens, s.context_lens) for s in layer])
    median = max(0.0, float(np.median(y - st - at)))
    if len(layer) < 6 or np.ptp(at / y) < 0.2:
        return median, 1.0
    w = 1.0 / y
    (o, a), _ = nnls(np.stack([np.ones_like(at), at], axis=1) * w[:, None], (y - st) * w)
    if not 1.0 <= a <= 1.5:
        a = min(1.5, max(1.0, a))
        o = max(0.0, float(np.median(y - st - a * at)))
    return float(o), float(a)
