"""Latency model: predict the wall time of a layer call, an iteration, a prefill.

Paper §5. One layer call of a batch with query lengths ``q_k`` and context lengths
``c_k`` (``n = Σq_k`` tokens) costs

    stateless(n) + attention_scale · attention(q, c) + layer_overhead

(``attention_scale`` >= 1 and ``layer_overhead`` are fitted on whole-layer samples: a layer
whose attention streams a large KV cache runs its projections a little slower.)

* ``stateless(n)``: QKV, O projection, MLP, norms, RoPE, residual adds. Piecewise
  linear in ``n`` with fixed-width segments (GEMM tile effects; 32 tokens on GPU).
  Here the width is *selected* by cross-validation among candidates, and the fit is
  monotone (non-decreasing in ``n``), so schedulers may binary-search chunk sizes.
  The smallest counts (``n = 1 .. K``, densely profiled) keep their measured values: a
  single decode token is not half the cost of two (BLAS kernel switches).
* ``attention(q, c)``: the paper's ``α·n + β·Σc + γ``, kept separately for the
  decode-like entries (``q_k == 1``) and the prefill-like entries (``q_k > 1``) of the
  batch; a mixed batch pays both parts. Terms for what the runner's kernels really
  compute (padded decode groups, the causal score matrix of an uncached prefill, the
  padded masked score matrix of other prefills) are selected by cross-validation when
  the data warrants them (see ``ATTENTION_FEATURES``). Decode entries are priced per
  group, as the runner splits them to bound the padded K/V gather
  (``max_gather_positions``; see :func:`decode_groups`).
* an iteration adds ``embed(tokens embedded)`` and ``head(rows through the LM head)``;
  the head also keeps measured values for the smallest row counts (not monotone there).

Three implementations of one interface (:class:`LatencyModel`):

* :class:`FittedLatencyModel`: fitted from profile samples (:func:`fit`); saved to and
  loaded from a JSON profile file that keeps the raw samples, so it can be refitted.
* :class:`AnalyticLatencyModel`: a roofline *estimate* from the model shape and a
  hardware table, for hardware we cannot profile (A100/H100/H200) and for schedulers
  before a profile exists.
* :class:`SimpleLatencyModel`: a few explicit constants, for tests with a fake clock.

Torch-free on purpose (a design rule: schedulers and the simulator import this module).
Prediction is pure Python arithmetic on precomputed coefficients (microseconds);
numpy/scipy are used only for fitting.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import nnls

from laser.plan import LayerStep, StepPlan

PROFILE_FORMAT = "laser-latency-profile"
PROFILE_VERSION = 2
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
# ``laser.model_runner.ModelRunner.max_gather_bytes`` (the runner splits decode batches
# so their gather stays under it; see :func:`decode_groups`).
DEFAULT_MAX_GATHER_BYTES = 16 << 20


class LatencyProfileError(Exception):
    """A latency profile file is missing, unreadable, corrupt, or for another setup."""


def _laser_version() -> str:
    try:
        from importlib.metadata import version

        return version("laser")
    except Exception:
        pass
    try:
        import laser

        return str(getattr(laser, "__version__", "0.0.0"))
    except Exception:
        return "0.0.0"


# --------------------------------------------------------------------------------------
# Profile samples: what the profiler produces (plain records, JSON-friendly).
# Each ``seconds`` is one layer's (or the embed/head's) wall time, ideally the median
# of a few repeats after warm-up; repeats may also be passed as separate samples.


@dataclass(frozen=True, slots=True)
class StatelessSample:
    """One layer's stateless modules (norms, QKV, RoPE, O, MLP, residuals) on ``n_tokens`` tokens."""

    n_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class AttentionSample:
    """One layer's attention core (KV-cache write + attention kernel) for a batch.

    Entry k has ``query_lens[k]`` new tokens attending to ``context_lens[k]`` tokens
    (cached context plus itself), as in :class:`laser.plan.LayerStep`.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class EmbedSample:
    """Token-embedding lookup of ``n_tokens`` tokens."""

    n_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class HeadSample:
    """Final norm + LM head + sampling on ``n_rows`` rows (one per finishing request)."""

    n_rows: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LayerSample:
    """Optional: a whole layer call, end to end. Fits the fixed per-layer-call overhead
    (the median of what stateless + attention leave unexplained)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float


Sample = StatelessSample | AttentionSample | EmbedSample | HeadSample | LayerSample


def _check_batch(q: Sequence[int], c: Sequence[int]) -> None:
    if len(q) != len(c) or not q:
        raise ValueError(f"query_lens and context_lens must be non-empty and equally long, got {q!r}, {c!r}")
    for qi, ci in zip(q, c):
        if qi < 1 or ci < qi:
            raise ValueError(f"need 1 <= query_len <= context_len, got q={qi}, c={ci}")


def _check_seconds(s: float) -> None:
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
        raise ValueError(f"seconds must be a positive finite number, got {s!r}")


# --------------------------------------------------------------------------------------
# Interface


class LatencyModel:
    """Predicts wall time (seconds) of the executor's work.

    Subclasses provide the primitives ``stateless_time``, ``attention_time``,
    ``embed_time``, ``head_time`` and the attributes ``num_layers`` (layers of the
    model) and ``layer_overhead_s`` (fixed cost of one layer call). Everything else is
    derived here. Predictions are never negative, and non-decreasing in token counts and
    context lengths, with two measured exceptions in :class:`FittedLatencyModel`: the LM
    head at the smallest row counts, and decode attention where a longer context makes
    the runner split a decode batch into less padded groups. Inputs are not validated on the hot path: query and
    context lengths must satisfy ``1 <= q <= c``.
    """

    num_layers: int
    layer_overhead_s: float = 0.0

    # -- primitives (override) --------------------------------------------------------
    def stateless_time(self, n_tokens: int) -> float:
        """One layer's stateless modules on ``n_tokens`` tokens."""
        raise NotImplementedError

    def attention_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """One layer's attention for a batch (see :class:`AttentionSample`)."""
        raise NotImplementedError

    def embed_time(self, n_tokens: int) -> float:
        """Embedding lookup of ``n_tokens`` tokens (0 for 0 tokens)."""
        raise NotImplementedError

    def head_time(self, n_rows: int) -> float:
        """Final norm + LM head + sampling on ``n_rows`` rows (0 for 0 rows)."""
        raise NotImplementedError

    # -- derived ----------------------------------------------------------------------
    def layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """One layer call on the batch ``(query_lens[k], context_lens[k])``; 0 if empty."""
        if not query_lens:
            return 0.0
        return self.stateless_time(sum(query_lens)) + self.attention_time(query_lens, context_lens) + self.layer_overhead_s

    def predict_layer(self, step: LayerStep) -> float:
        """Seconds for one layer call (all layers cost the same; ``step.layer`` is unused)."""
        return self.layer_time(step.query_lens, step.context_lens)

    def predict_iteration(self, plan: StepPlan) -> float:
        """Seconds for a whole plan: its layer calls + embedding of works starting at
        layer 0 + LM head for ``plan.num_final()`` rows."""
        from .core.pricing import PlanCost

        return PlanCost(self, plan.num_layers, plan.works).total if plan.works else 0.0

    def predict_prefill(self, prompt_len: int, layers: int | None = None, context_start: int = 0) -> float:
        """A prefill chunk of ``prompt_len`` tokens after ``context_start`` cached tokens, alone.

        ``layers=None``: a full pass (embedding, every layer, LM head for one row).
        ``layers=k``: only ``k`` layer calls (no embedding, no head).
        """
        if prompt_len <= 0:
            return 0.0
        t = self.layer_time((prompt_len,), (context_start + prompt_len,))
        if layers is not None:
            return layers * t
        return self.num_layers * t + self.embed_time(prompt_len) + self.head_time(1)

    def predict_decode_iteration(self, context_lens: Sequence[int]) -> float:
        """One decode token for each request (``context_lens`` include the new token)
        through every layer, plus embedding and LM head."""
        b = len(context_lens)
        if not b:
            return 0.0
        q = (1,) * b
        return self.num_layers * self.layer_time(q, context_lens) + self.embed_time(b) + self.head_time(b)

    def max_tokens_within(
        self,
        budget_s: float,
        layers: int = 1,
        context_start: int = 0,
        query_lens: Sequence[int] = (),
        context_lens: Sequence[int] = (),
        limit: int = 1 << 20,
    ) -> int:
        """Largest chunk ``k <= limit`` (tokens, after ``context_start`` cached tokens)
        such that ``layers`` layer calls of the batch ``query_lens + (k,)`` take at most
        ``budget_s``; 0 if not even one token fits. Binary search (predictions are
        monotone). Embedding and LM head are not included."""
        base_q, base_c = tuple(query_lens), tuple(context_lens)

        def cost(k: int) -> float:
            return layers * self.layer_time(base_q + (k,), base_c + (context_start + k,))

        if limit < 1 or cost(1) > budget_s:
            return 0
        lo, hi = 1, 2
        while hi <= limit and cost(hi) <= budget_s:
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)  # cost(lo) fits; hi does not fit or is past the limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cost(mid) <= budget_s:
                lo = mid
            else:
                hi = mid
        return lo


# --------------------------------------------------------------------------------------
# Piecewise-linear function of a count (stateless modules, LM head, embedding)


class PiecewiseLinear:
    """Non-negative piecewise-linear function of an integer ``n >= 1``, with an optional
    lookup of exact values for the smallest counts.

    ``exact[i]`` (if given) is ``f(i + 1)``: measured values for ``n = 1 .. len(exact)``
    override the line (small counts do not follow the fitted slope: one LM-head row or
    one decode token is not half the cost of two). Segment ``s`` covers ``n`` in
    ``(s·width, (s+1)·width]`` and is ``a[s] + b[s]·n``; past the table,
    ``tail_a + tail_b·n``, but never below ``floor`` (for ``n`` past the lookup);
    ``f(n) = 0`` for ``n <= 0``. The linear part is non-decreasing; the lookup is what
    was measured (:func:`_fit_count_function` makes it non-decreasing, with
    ``floor = exact[-1]``, where monotonicity is required).
    """

    __slots__ = ("width", "a", "b", "tail_a", "tail_b", "exact", "floor", "_nseg", "_nexact")

    def __init__(self, width: int, a: Sequence[float], b: Sequence[float], tail_a: float, tail_b: float,
                 exact: Sequence[float] = (), floor: float = 0.0):
        if width < 1 or len(a) != len(b):
            raise ValueError("bad piecewise-linear table")
        self.width = int(width)
        self.a = [float(x) for x in a]
        self.b = [float(x) for x in b]
        self.tail_a = float(tail_a)
        self.tail_b = float(tail_b)
        self._nseg = len(self.a)
        if not all(math.isfinite(v) for v in (*self.a, *self.b, self.tail_a, self.tail_b)):
            raise ValueError("piecewise-linear coefficients must be finite")
        if min(self.b, default=0.0) < 0 or self.tail_b < 0:
            raise ValueError("piecewise-linear slopes must be non-negative")
        self.set_exact(exact, floor)

    def set_exact(self, exact: Sequence[float], floor: float = 0.0) -> None:
        """Measured values for ``n = 1 .. len(exact)``; ``floor``: least value past them."""
        vals = [float(x) for x in exact]
        if not all(math.isfinite(v) and v >= 0 for v in (*vals, float(floor))):
            raise ValueError("exact small-count values and floor must be finite and non-negative")
        self.exact, self.floor, self._nexact = vals, float(floor), len(vals)

    @classmethod
    def zero(cls) -> "PiecewiseLinear":
        return cls(1, [], [], 0.0, 0.0)

    def __call__(self, n: int) -> float:
        if n <= 0:
            return 0.0
        if n <= self._nexact:
            return self.exact[n - 1]
        s = (n - 1) // self.width
        v = self.a[s] + self.b[s] * n if s < self._nseg else self.tail_a + self.tail_b * n
        return v if v > self.floor else self.floor

    def line(self, n: int) -> float:
        """The piecewise-linear part alone (ignores the small-count lookup)."""
        if n <= 0:
            return 0.0
        s = (n - 1) // self.width
        if s < self._nseg:
            return self.a[s] + self.b[s] * n
        return self.tail_a + self.tail_b * n

    def to_dict(self) -> dict:
        d = {"width": self.width, "a": self.a, "b": self.b, "tail": [self.tail_a, self.tail_b]}
        if self.exact:
            d["exact"] = self.exact
        if self.floor:
            d["floor"] = self.floor
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PiecewiseLinear":
        return cls(d["width"], d["a"], d["b"], d["tail"][0], d["tail"][1], d.get("exact", ()), d.get("floor", 0.0))


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


def _fit_count_function(
    n: Sequence[int], y: Sequence[float], widths: Sequence[int], folds: int,
    exact: int = 0, monotone: bool = True,
) -> tuple[PiecewiseLinear, dict]:
    """Fit a piecewise-linear function of a count, choosing the segment width by k-fold CV.

    The candidates are ``widths`` plus one segment spanning all data (a plain line,
    reported as width ``"linear"``). Returns the function refitted on all data and a
    report ``{"width": chosen, "cv_error": {candidate: mean relative error}, "exact": K}``.

    ``exact > 0``: counts ``1 .. K`` (the consecutively sampled ones, ``K <= exact``)
    predict their measured median, and the line is fitted to the larger counts only
    (where it is used). With ``monotone`` the lookup is made non-decreasing (running
    max) and the line is floored at its last value, so the whole function stays
    non-decreasing (schedulers binary-search on it).
    """
    n = np.asarray(n, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    look = _small_count_lookup(n, y, exact) if exact > 0 and len(n) else []
    rest = n > len(look)
    if look and np.count_nonzero(rest) >= 2:
        f, rep = _fit_count_line(n[rest], y[rest], widths, folds)
    else:
        f, rep = _fit_count_line(n, y, widths, folds)
    if look:
        if monotone:
            run = 0.0
            for i, v in enumerate(look):
                run = max(run, v)
                look[i] = run
        f.set_exact(look, floor=look[-1] if monotone else 0.0)
        rep["exact"] = len(look)
    return f, rep


def _fit_count_line(
    n: Sequence[int], y: Sequence[float], widths: Sequence[int], folds: int
) -> tuple[PiecewiseLinear, dict]:
    n = np.asarray(n, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    if len(n) == 0:
        return PiecewiseLinear.zero(), {"width": None, "cv_error": {}}
    linear_w = max(2, int(n.max()))
    cands = {"linear": linear_w}
    for w in sorted(set(int(w) for w in widths), reverse=True):
        if 1 <= w < linear_w:
            cands[w] = w
    if len(n) < 2 * max(folds, 2) or len(cands) == 1:
        return _fit_piecewise(n, y, linear_w), {"width": "linear", "cv_error": {}}
    errs = {}
    for name, w in cands.items():
        def fit_predict(train, test, w=w):
            f = _fit_piecewise(n[train], y[train], w)
            return np.array([f(int(v)) for v in n[test]])

        errs[name] = np.abs(_cv_errors(len(n), folds, fit_predict) - y) / y
    chosen = _select(errs, list(cands))  # order: linear, then widest to narrowest
    cv = {str(k): float(np.mean(v)) for k, v in errs.items()}
    return _fit_piecewise(n, y, cands[chosen]), {"width": chosen, "cv_error": cv}


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
# Prefill entries (q > 1). A single prefill with no cached context (q == c) runs the
# causal kernel on its own K/V:
#   c_const   1 if so
#   c_tokens  q
#   c_square  q²                   (causal score matrix, the lower triangle)
# Otherwise all prefill entries run one masked, padded group (B_p entries):
#   m_const   1 if so
#   m_tokens  Σq                   (paper's α·n)
#   m_ctx     Σc                   (paper's β·Σc)
#   m_pad     B_p · max q · max c  (padded score matrix: masked positions cost too)
# A batch with both decode and prefill entries also scatters the groups' outputs into one
# tensor; that costs tens of microseconds (measured: 55 us for 300 rows), so it has no
# term of its own -- a free constant for it absorbed fit noise instead (0.5 ms per layer).
# Candidate feature sets, simplest first; the fit picks one by CV (``_select``).

ATTENTION_FEATURES = ("d_groups", "d_seqs", "d_ctx", "d_pad", "c_const", "c_tokens", "c_square",
                      "m_const", "m_tokens", "m_ctx", "m_pad")
ATTENTION_FEATURE_SETS = {
    # the paper's α·n + β·Σc + γ, for decode and prefill entries separately
    "linear": ("d_groups", "d_seqs", "d_ctx", "c_const", "c_tokens", "m_const", "m_tokens", "m_ctx"),
    # what the kernels compute: padded decode groups, causal / padded prefill score matrices
    "kernel": ATTENTION_FEATURES,
}
_N_DECODE_FEATURES = 4

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


def max_gather_positions(kv_heads: int, head_dim: int, dtype_bytes: int,
                         max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES) -> int:
    """Padded positions (rows x max context) one decode group may gather: the runner's
    ``max_gather_bytes // (kv_heads · head_dim · dtype_bytes)``."""
    return int(max_gather_bytes) // max(1, int(kv_heads) * int(head_dim) * int(dtype_bytes))


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


def decode_groups(context_lens: Sequence[int], max_positions: int) -> list[tuple[int, int]]:
    """``(size, max context)`` of each decode group, as ``ModelRunner._split_decode`` forms
    them: rows sorted by context, consecutive rows while ``(size + 1) · c <= max_positions``
    for the next context ``c``; one group when ``max_positions <= 0``."""
    if not context_lens:
        return []
    if max_positions <= 0 or len(context_lens) * max(context_lens) <= max_positions:
        return [(len(context_lens), max(context_lens))]
    out = []
    k = cmax = 0
    for c in sorted(context_lens):
        if k and (k + 1) * c > max_positions:
            out.append((k, cmax))
            k = cmax = 0
        k += 1
        cmax = c
    out.append((k, cmax))
    return out


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
    f = [float(len(groups)), float(len(dc)), float(sum(dc)), float(sum(k * m for k, m in groups))]
    if len(pq) == 1 and pq[0] == pc[0]:  # the causal fast path
        f += [1.0, float(pq[0]), float(pq[0]) ** 2, 0.0, 0.0, 0.0, 0.0]
    elif pq:
        f += [0.0, 0.0, 0.0, 1.0, float(sum(pq)), float(sum(pc)), float(len(pq) * max(pq) * max(pc))]
    else:
        f += [0.0] * 7
    return tuple(f)


class AttentionModel:
    """``Σ coef[f] · feature[f]`` over ``ATTENTION_FEATURES`` (absent features are 0).

    ``max_gather_positions``: decode entries are priced per group as the runner splits
    them (see :func:`decode_groups`); 0 = one group. Because the runner's split can
    reduce padding, decode attention is non-decreasing in context lengths only within
    a fixed grouping (as the measured kernel is).
    """

    __slots__ = ("feature_set", "coef", "max_gather_positions", "_d", "_w")

    def __init__(self, feature_set: str, coef: dict[str, float], max_gather_positions: int = 0):
        unknown = set(coef) - set(ATTENTION_FEATURES)
        if unknown:
            raise ValueError(f"unknown attention features {sorted(unknown)}")
        self.feature_set = feature_set
        self.coef = {f: float(coef.get(f, 0.0)) for f in ATTENTION_FEATURES}
        if not all(math.isfinite(v) and v >= 0 for v in self.coef.values()):
            raise ValueError(f"attention coefficients must be finite and non-negative: {self.coef}")
        self.max_gather_positions = max(0, int(max_gather_positions))
        self._w = tuple(self.coef[f] for f in ATTENTION_FEATURES)
        self._d = self._w[:_N_DECODE_FEATURES]

    def __call__(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        b = len(query_lens)
        if not b:
            return 0.0
        if sum(query_lens) == b:  # all decode: C-speed builtins when it is one group
            d0, d1, d2, d3 = self._d
            mx = max(context_lens)
            g = self.max_gather_positions
            if g <= 0 or b * mx <= g:
                return d0 + d1 * b + d2 * sum(context_lens) + d3 * b * mx
            groups = decode_groups(context_lens, g)
            return (d0 * len(groups) + d1 * b + d2 * sum(context_lens)
                    + d3 * sum(k * m for k, m in groups))
        f = attention_features(query_lens, context_lens, self.max_gather_positions)
        return sum(w * x for w, x in zip(self._w, f))

    def to_dict(self) -> dict:
        return {"feature_set": self.feature_set, "coef": self.coef, "max_gather_positions": self.max_gather_positions}

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionModel":
        return cls(d["feature_set"], d["coef"], int(d.get("max_gather_positions", 0) or 0))


def _fit_attention_set(x: np.ndarray, y: np.ndarray, names: Sequence[str], scale_y: np.ndarray) -> AttentionModel:
    """NNLS of ``y`` on the ``names`` columns of ``x``, minimising ``Σ ((pred - y) / scale_y)²``."""
    cols = [ATTENTION_FEATURES.index(f) for f in names]
    w = 1.0 / np.maximum(scale_y, 1e-12)
    # Scale columns to unit max so NNLS is well conditioned; undo afterwards.
    xs = x[:, cols]
    scale = np.maximum(np.abs(xs).max(axis=0), 1e-30)
    coef, _ = nnls(xs / scale * w[:, None], y * w, maxiter=50 * len(cols) + 500)
    return AttentionModel("", {f: float(c / s) for f, c, s in zip(names, coef, scale)})


def _fit_attention(samples: Sequence[AttentionSample], folds: int, max_positions: int = 0,
                   stateless=None) -> tuple[AttentionModel, dict]:
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
    order = list(ATTENTION_FEATURE_SETS)
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
        chosen = "linear"
    mdl = _fit_attention_set(x, y, ATTENTION_FEATURE_SETS[chosen], scale_y)
    mdl.feature_set = chosen
    mdl.max_gather_positions = max(0, int(max_positions))
    return mdl, {"feature_set": chosen, "cv_error": cv, "max_gather_positions": mdl.max_gather_positions,
                 "weighed_by": "layer" if stateless is not None else "attention"}


# --------------------------------------------------------------------------------------
# Fitted model and its profile file


@dataclass
class FittedLatencyModel(LatencyModel):
    """A latency model fitted from profile samples (see :func:`fit`)."""

    num_layers: int
    stateless: PiecewiseLinear
    attention: AttentionModel
    embed: PiecewiseLinear
    head: PiecewiseLinear
    layer_overhead_s: float = 0.0
    # Attention inside a whole layer call costs this much more than alone (cache interference).
    layer_attention_scale: float = 1.0
    # Setup the profile was taken on: model_id, dtype, hardware, threads, created, laser_version, ...
    metadata: dict = field(default_factory=dict)
    # Fit diagnostics: chosen widths / feature set, CV and in-sample relative errors.
    report: dict = field(default_factory=dict, repr=False)
    # The raw samples (kept so the profile can be refitted).
    samples: list = field(default_factory=list, repr=False)

    # Primitives, bound to the fitted callables (no extra indirection on the hot path).
    def stateless_time(self, n_tokens: int) -> float:
        return self.stateless(n_tokens)

    def attention_time(self, query_lens, context_lens) -> float:
        return self.attention(query_lens, context_lens)

    def embed_time(self, n_tokens: int) -> float:
        return self.embed(n_tokens)

    def head_time(self, n_rows: int) -> float:
        return self.head(n_rows)

    def layer_time(self, query_lens, context_lens) -> float:
        if not query_lens:
            return 0.0
        return (self.stateless(sum(query_lens)) + self.layer_attention_scale * self.attention(query_lens, context_lens)
                + self.layer_overhead_s)


    # -- fitting ----------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[Sample], *, num_layers: int, metadata: dict | None = None,
            widths: Sequence[int] = DEFAULT_WIDTHS, folds: int = 5) -> "FittedLatencyModel":
        return fit(samples, num_layers=num_layers, metadata=metadata, widths=widths, folds=folds)

    def refit(self, widths: Sequence[int] = DEFAULT_WIDTHS, folds: int = 5) -> "FittedLatencyModel":
        """A new model fitted from this one's stored samples (same metadata)."""
        return fit(self.samples, num_layers=self.num_layers, metadata=self.metadata, widths=widths, folds=folds)

    # -- file -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        by_kind: dict[str, list] = {k: [] for k in _SAMPLE_KINDS}
        for s in self.samples:
            kind, enc = _encode_sample(s)
            by_kind[kind].append(enc)
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "metadata": {**self.metadata, "num_layers": self.num_layers},
            "model": {
                "stateless": self.stateless.to_dict(),
                "attention": self.attention.to_dict(),
                "embed": self.embed.to_dict(),
                "head": self.head.to_dict(),
                "layer_overhead_s": self.layer_overhead_s,
                "layer_attention_scale": self.layer_attention_scale,
            },
            "report": self.report,
            "samples": by_kind,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically: temp file + rename). Returns the path."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_dict(cls, d: dict) -> "FittedLatencyModel":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise LatencyProfileError(f"not a {PROFILE_FORMAT} document")
        if d.get("version") != PROFILE_VERSION:
            raise LatencyProfileError(
                f"profile format version {d.get('version')!r} is not supported (expected {PROFILE_VERSION}); re-run the profiler")
        try:
            meta = dict(d["metadata"])
            m = d["model"]
            samples = [_decode_sample(kind, enc) for kind, encs in d.get("samples", {}).items() for enc in encs]
            model = cls(
                num_layers=int(meta["num_layers"]),
                stateless=PiecewiseLinear.from_dict(m["stateless"]),
                attention=AttentionModel.from_dict(m["attention"]),
                embed=PiecewiseLinear.from_dict(m["embed"]),
                head=PiecewiseLinear.from_dict(m["head"]),
                layer_overhead_s=float(m.get("layer_overhead_s", 0.0)),
                layer_attention_scale=float(m.get("layer_attention_scale", 1.0)),
                metadata={k: v for k, v in meta.items() if k != "num_layers"},
                report=dict(d.get("report", {})),
                samples=samples,
            )
            model._check()
            return model
        except LatencyProfileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise LatencyProfileError(f"malformed profile: {type(e).__name__}: {e}") from e

    def _check(self) -> None:
        """Raise ``ValueError`` unless this model's numbers can price plans: at least one
        layer, a finite non-negative overhead, a finite positive attention scale, and
        finite non-negative predictions across sizes (catches hand-edited files)."""
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not (math.isfinite(self.layer_overhead_s) and self.layer_overhead_s >= 0):
            raise ValueError(f"layer_overhead_s must be finite and >= 0, got {self.layer_overhead_s}")
        if not (math.isfinite(self.layer_attention_scale) and self.layer_attention_scale > 0):
            raise ValueError(f"layer_attention_scale must be finite and > 0, got {self.layer_attention_scale}")
        probes = [self.layer_time((n,), (n,)) for n in (1, 7, 64, 512, 4096)]
        probes += [self.layer_time((1,) * b, (512,) * b) for b in (1, 16, 64)]
        probes += [self.layer_time((100, 1), (300, 900))]
        probes += [f(n) for f in (self.embed_time, self.head_time) for n in (1, 16, 256)]
        bad = [t for t in probes if not (math.isfinite(t) and t >= 0)]
        if bad:
            raise ValueError(f"the model predicts negative or non-finite times (e.g. {bad[0]!r})")

    @classmethod
    def load(cls, path: str | os.PathLike, *, refit: bool = False, **expect) -> "FittedLatencyModel":
        """Read a profile file. ``expect`` (e.g. ``model_id=..., dtype=..., hardware=...,
        threads=..., num_layers=...``) must match its metadata, else
        :class:`LatencyProfileError`. ``refit=True`` refits from the stored samples."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            raise LatencyProfileError(
                f"no latency profile at {path}; run the profiler to create one") from None
        except OSError as e:
            raise LatencyProfileError(f"cannot read latency profile {path}: {e}") from e
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
            raise LatencyProfileError(f"corrupt latency profile {path}: invalid JSON ({type(e).__name__}: "
                                      f"{str(e)[:200]}); delete it or run `laser profile`") from e
        try:
            model = cls.from_dict(doc)
        except LatencyProfileError as e:
            raise LatencyProfileError(f"corrupt latency profile {path}: {e}") from e
        have = {**model.metadata, "num_layers": model.num_layers}
        bad = [f"{k}: profile has {have.get(k)!r}, expected {v!r}" for k, v in expect.items()
               if v is not None and have.get(k) != v]
        if bad:
            raise LatencyProfileError(f"latency profile {path} is for another setup ({'; '.join(bad)})")
        return model.refit() if refit else model


def fit(samples: Iterable[Sample], *, num_layers: int, metadata: dict | None = None,
        widths: Sequence[int] = DEFAULT_WIDTHS, folds: int = 5, small_counts: int = SMALL_COUNT_EXACT,
        max_gather_positions: int | None = None) -> FittedLatencyModel:
    """Fit a :class:`FittedLatencyModel` from profile samples.

    Stateless and LM-head times: piecewise-linear, segment width chosen by
    ``folds``-fold CV among ``widths`` and a plain line; counts ``1 .. K`` sampled
    consecutively (``K <= small_counts``) keep their measured medians (stateless: made
    non-decreasing; the head need not be). Attention: NNLS on the feature set chosen by
    CV, decode entries grouped as the runner splits them (``max_gather_positions``;
    ``None``: from ``metadata``, see :func:`gather_positions_from_metadata`), errors
    relative to the whole layer call (attention + stateless, see :func:`_fit_attention`).
    Embedding: a line. Whole-layer composition (per-call overhead and a scale on attention):
    from :class:`LayerSample` s, see :func:`_fit_layer_composition` (0 and 1 without them). All fits minimise relative error and keep
    coefficients non-negative. Missing sample kinds predict 0 (see ``report["missing"]``).
    ``metadata`` is stored as given, plus ``created`` and ``laser_version`` if absent.
    """
    samples = list(samples)
    kinds: dict[type, list] = {t: [] for t in _SAMPLE_TYPES}
    for s in samples:
        if type(s) not in kinds:
            raise TypeError(f"not a profile sample: {s!r}")
        _check_seconds(s.seconds)
        if isinstance(s, (AttentionSample, LayerSample)):
            _check_batch(s.query_lens, s.context_lens)
        elif (s.n_tokens if hasattr(s, "n_tokens") else s.n_rows) < 1:
            raise ValueError(f"count must be >= 1: {s!r}")
        kinds[type(s)].append(s)
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")

    st = kinds[StatelessSample]
    stateless, st_rep = _fit_count_function([s.n_tokens for s in st], [s.seconds for s in st], widths, folds,
                                            exact=small_counts)
    if max_gather_positions is None:
        max_gather_positions = gather_positions_from_metadata(metadata)
    attention, at_rep = _fit_attention(kinds[AttentionSample], folds, max_gather_positions,
                                       stateless if st else None)
    hd = kinds[HeadSample]
    head, hd_rep = _fit_count_function([s.n_rows for s in hd], [s.seconds for s in hd], widths, folds,
                                       exact=small_counts, monotone=False)
    em = kinds[EmbedSample]
    embed, _ = _fit_count_function([s.n_tokens for s in em], [s.seconds for s in em], (), folds)

    layer = kinds[LayerSample]
    overhead, scale = _fit_layer_composition(layer, stateless, attention)

    def in_sample(f, xs, ys):
        return _rel_err(np.array([f(x) for x in xs]), np.array(ys)) if xs else None

    report = {
        "stateless": {**st_rep, "error": in_sample(stateless, [s.n_tokens for s in st], [s.seconds for s in st])},
        "attention": {**at_rep, "error": in_sample(lambda s: attention(s.query_lens, s.context_lens),
                                                   kinds[AttentionSample], [s.seconds for s in kinds[AttentionSample]])},
        "head": {**hd_rep, "error": in_sample(head, [s.n_rows for s in hd], [s.seconds for s in hd])},
        "embed": {"error": in_sample(embed, [s.n_tokens for s in em], [s.seconds for s in em])},
        "missing": [_TYPE_KIND[t] for t in (StatelessSample, AttentionSample, EmbedSample, HeadSample) if not kinds[t]],
    }
    if layer:
        model_layer = [stateless(sum(s.query_lens)) + scale * attention(s.query_lens, s.context_lens) + overhead
                       for s in layer]
        report["layer"] = {"overhead_s": overhead, "attention_scale": scale,
                           "error": _rel_err(np.array(model_layer), np.array([s.seconds for s in layer]))}
    meta = dict(metadata or {})
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    meta.setdefault("laser_version", _laser_version())
    return FittedLatencyModel(num_layers=num_layers, stateless=stateless, attention=attention, embed=embed,
                              head=head, layer_overhead_s=overhead, layer_attention_scale=scale, metadata=meta,
                              report=report, samples=samples)


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


_SAMPLE_TYPES = (StatelessSample, AttentionSample, EmbedSample, HeadSample, LayerSample)
_SAMPLE_KINDS = ("stateless", "attention", "embed", "head", "layer")
_TYPE_KIND = dict(zip(_SAMPLE_TYPES, _SAMPLE_KINDS))
_KIND_TYPE = dict(zip(_SAMPLE_KINDS, _SAMPLE_TYPES))


def _encode_sample(s: Sample) -> tuple[str, list]:
    kind = _TYPE_KIND[type(s)]
    if isinstance(s, (AttentionSample, LayerSample)):
        return kind, [list(s.query_lens), list(s.context_lens), s.seconds]
    return kind, [s.n_tokens if hasattr(s, "n_tokens") else s.n_rows, s.seconds]


def _decode_sample(kind: str, enc: list) -> Sample:
    t = _KIND_TYPE.get(kind)
    if t is None:
        raise LatencyProfileError(f"unknown sample kind {kind!r}")
    if t in (AttentionSample, LayerSample):
        q, c, sec = enc
        s = t(tuple(int(v) for v in q), tuple(int(v) for v in c), float(sec))
        _check_batch(s.query_lens, s.context_lens)
    else:
        n, sec = enc
        s = t(int(n), float(sec))
    _check_seconds(s.seconds)
    return s


def load_profile(path: str | os.PathLike, **expect) -> FittedLatencyModel:
    """Same as :meth:`FittedLatencyModel.load`."""
    return FittedLatencyModel.load(path, **expect)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(s)).strip("_") or "x"


def default_profile_path(model_id: str, dtype: str, hardware: str, threads: int) -> Path:
    """``$LASER_CACHE_DIR/profiles/<model>__<dtype>__<hardware>__t<threads>.json``
    (default cache dir ``~/.cache/laser``). Long hardware strings are shortened with a hash."""
    root = os.environ.get("LASER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "laser")
    hw = _slug(hardware)
    if len(hw) > 40:
        hw = hw[:32] + "-" + hashlib.sha1(hardware.encode()).hexdigest()[:7]
    name = f"{_slug(model_id)}__{_slug(dtype)}__{hw}__t{int(threads)}.json"
    return Path(root) / "profiles" / name


def cpu_hardware_string() -> str:
    """A short description of this CPU for profile metadata (best effort, torch-free)."""
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


# --------------------------------------------------------------------------------------
# Simple model (tests with a fake clock)


@dataclass
class SimpleLatencyModel(LatencyModel):
    """``layer = per_layer + per_token·n + per_context·Σc``; ``embed = per_embed_token·n``;
    ``head = head_const + per_head_row·rows`` (0 for 0 rows). Exact, easy numbers for tests."""

    num_layers: int
    per_layer: float = 1e-3
    per_token: float = 1e-5
    per_context: float = 0.0
    per_embed_token: float = 0.0
    head_const: float = 0.0
    per_head_row: float = 0.0

    @property
    def layer_overhead_s(self) -> float:  # type: ignore[override]
        return self.per_layer

    def stateless_time(self, n_tokens: int) -> float:
        return self.per_token * n_tokens if n_tokens > 0 else 0.0

    def attention_time(self, query_lens, context_lens) -> float:
        return self.per_context * sum(context_lens)

    def embed_time(self, n_tokens: int) -> float:
        return self.per_embed_token * n_tokens if n_tokens > 0 else 0.0

    def head_time(self, n_rows: int) -> float:
        return self.head_const + self.per_head_row * n_rows if n_rows > 0 else 0.0


# --------------------------------------------------------------------------------------
# Analytic (roofline) model — an ESTIMATE, not a measurement.


@dataclass(frozen=True)
class ModelShape:
    """Shape of a llama-family decoder (gated MLP, GQA)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        """From a HF ``config.json`` dict (``text_config`` is used when present)."""
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        try:
            return MODEL_SHAPES[name.lower()]
        except KeyError:
            raise KeyError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}") from None

    def layer_params(self) -> int:
        """Weights of one decoder layer (norms ignored)."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    def num_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params() + emb * (1 if self.tie_embeddings else 2)


MODEL_SHAPES = {
    "qwen2.5-14b": ModelShape(5120, 48, 40, 8, 128, 13824, 152064),
    "qwen2.5-32b": ModelShape(5120, 64, 40, 8, 128, 27648, 152064),
    "llama-3-70b": ModelShape(8192, 80, 64, 8, 128, 28672, 128256),
    "smollm2-135m": ModelShape(576, 30, 9, 3, 64, 1536, 49152, tie_embeddings=True),
}


@dataclass(frozen=True)
class HardwareSpec:
    """Per-device peak numbers (vendor datasheets; dense, no sparsity)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # HBM/DRAM bytes/s
    link_bw: float  # interconnect bytes/s per direction per device (NVLink)
    link_latency_s: float  # fixed cost of one collective
    layer_overhead_s: float  # kernel launches / framework per layer call


HARDWARE = {
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, 300e9, 10e-6, 20e-6),
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, 450e9, 8e-6, 15e-6),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 450e9, 8e-6, 15e-6),
    # A rough 2-core CPU running the Python executor: bf16 matmuls with AMX-class
    # throughput, ~20 GB/s DRAM, ~0.15 ms of Python/dispatch per layer call.
    "cpu-2core": HardwareSpec("cpu-2core", 2e11, 20e9, 1e12, 0.0, 1.5e-4),
}


class AnalyticLatencyModel(LatencyModel):
    """Roofline estimate: each module costs ``max(FLOPs/(peak·flops_eff), bytes/(bw·bw_eff))``
    per device, under tensor parallelism ``tp`` (weights, heads and FLOPs split ``tp``
    ways; two ring all-reduces of the hidden states per layer, ``2·(tp−1)/tp·bytes /
    link_bw + latency`` each). Plus the hardware's per-layer-call overhead.

    This is an estimate for planning and simulation, not a measurement: it ignores
    kernel efficiency curves, tile quantisation, and overlap. Fit a profile for real numbers.
    """

    def __init__(self, shape: ModelShape | str, hardware: HardwareSpec | str = "h200", *, tp: int = 1,
                 dtype_bytes: int = 2, flops_efficiency: float = 0.7, bw_efficiency: float = 0.85,
                 layer_overhead_s: float | None = None):
        self.shape = ModelShape.preset(shape) if isinstance(shape, str) else shape
        if isinstance(hardware, str):
            try:
                hardware = HARDWARE[hardware.lower()]
            except KeyError:
                raise KeyError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE)}") from None
        if tp < 1 or not (0 < flops_efficiency <= 1) or not (0 < bw_efficiency <= 1):
            raise ValueError("need tp >= 1 and efficiencies in (0, 1]")
        self.hardware, self.tp, self.dtype_bytes = hardware, tp, dtype_bytes
        self.num_layers = self.shape.layers
        self.layer_overhead_s = hardware.layer_overhead_s if layer_overhead_s is None else layer_overhead_s
        s, t, db = self.shape, tp, dtype_bytes
        F = hardware.peak_flops * flops_efficiency  # FLOP/s
        BW = hardware.mem_bw * bw_efficiency  # bytes/s
        self._F, self._BW = F, BW
        h, d = s.hidden, s.head_dim
        heads_dev = s.heads / t
        kv_dev = max(s.kv_heads / t, 1.0)  # KV heads are replicated when tp > kv_heads

        # Linear modules: (name, in_features, out_features per device) on n tokens.
        #   per token: 2·in·out FLOPs; weight in·out·db bytes; activations (in + out)·db bytes.
        mods = [("qkv", h, (heads_dev + 2 * kv_dev) * d), ("o", heads_dev * d, h),
                ("mlp_up_gate", h, 2 * s.intermediate / t), ("mlp_down", s.intermediate / t, h)]
        # (name, seconds per token of compute, fixed seconds of weight reads, seconds per token of activation traffic)
        self._mods = tuple((nm, 2 * i * o / F, i * o * db / BW, (i + o) * db / BW) for nm, i, o in mods)
        self._norm_tok = 2 * 2 * h * db / BW  # two RMSNorms: read + write each
        # Attention per device: 4·H_dev·d FLOPs per (query, key) pair; K and V reads per
        # context token; q and output per query token.
        self._attn_pair = 4 * heads_dev * d / F
        self._attn_ctx = 2 * kv_dev * d * db / BW
        self._attn_tok = 2 * heads_dev * d * db / BW
        # Two all-reduces of n·h·db bytes per layer.
        if t > 1:
            self._ar_tok = 2 * (2 * (t - 1) / t) * h * db / hardware.link_bw
            self._ar_const = 2 * hardware.link_latency_s
        else:
            self._ar_tok = self._ar_const = 0.0
        # LM head (vocab-parallel): 2·h·V/t FLOPs per row, h·V/t·db weight bytes.
        self._head = (2 * h * s.vocab / t / F, h * s.vocab / t * db / BW, (h + s.vocab / t) * db / BW)
        self._embed_tok = 2 * h * db / BW

    def breakdown(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> dict[str, tuple[float, str]]:
        """Per module of one layer call: ``(seconds, "compute" | "memory" | "network")``."""
        n = sum(query_lens)
        out = {}
        for nm, fl, w, act in self._mods:
            c, m = fl * n, w + act * n
            out[nm] = (max(c, m), "compute" if c > m else "memory")
        pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens))
        c, m = self._attn_pair * pairs, self._attn_ctx * sum(context_lens) + self._attn_tok * n
        out["attention"] = (max(c, m), "compute" if c > m else "memory")
        out["norms"] = (self._norm_tok * n, "memory")
        out["allreduce"] = ((self._ar_tok * n + self._ar_const) if n else 0.0, "network")
        return out

    def stateless_time(self, n_tokens: int) -> float:
        if n_tokens <= 0:
            return 0.0
        t = self._norm_tok * n_tokens + self._ar_tok * n_tokens + self._ar_const
        for _, fl, w, act in self._mods:
            c, m = fl * n_tokens, w + act * n_tokens
            t += c if c > m else m
        return t

    def attention_time(self, query_lens, context_lens) -> float:
        b = len(query_lens)
        if not b:
            return 0.0
        n = sum(query_lens)
        if n == b:
            pairs = sc = sum(context_lens)
        else:
            sc = sum(context_lens)
            pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens))
        c = self._attn_pair * pairs
        m = self._attn_ctx * sc + self._attn_tok * n
        return c if c > m else m

    def embed_time(self, n_tokens: int) -> float:
        return self._embed_tok * n_tokens if n_tokens > 0 else 0.0

    def head_time(self, n_rows: int) -> float:
        if n_rows <= 0:
            return 0.0
        fl, w, act = self._head
        return max(fl * n_rows, w + act * n_rows)
