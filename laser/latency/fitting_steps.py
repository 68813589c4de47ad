"""Fitting what whole steps show and single calls do not (numpy + scipy; imported by
:mod:`laser.latency.fitting` only).

* :func:`fit_step_overhead`: what a step costs beyond its layer calls, embedding and head
  (:class:`StepOverheadSample`), per step, per batch composition and per composed work;
* :func:`fit_decode_step_scale`: what a decode layer call costs inside a whole step against
  the same call timed alone (:class:`DecodeStepSample`): measured on an AVX512 EPYC with
  SmolLM2 (bf16), a decode layer inside a step cost 0.80-0.96 of the same call timed alone,
  prefill layers the same either way (docs/benchmarks.md, "layers alone vs in a step");
* :func:`fit_prefill_step_scale`: the same for the layer calls of a step holding a prefill chunk
  (:class:`PrefillStepSample`): on an AMX Xeon (bf16 SmolLM2, one thread) steps of one or more chunks of
  60-330 tokens, decode rows beside them or not, took ~0.9 of their layer calls timed alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from .base import DecodeStepSample, PrefillStepSample, StepOverheadSample, WarmDecodeStepSample
from .fitted import (PREFILL_STEP_REF_TOKENS, PREFILL_STEP_SCALE_BOUNDS, PREFILL_STEP_TOKEN_RANGE, prefill_step_factor,
                     prefill_tokens)

#: Bounds of the decode in-step scale: outside them the whole steps disagree with the layer
#: samples by more than cache effects explain (a broken profile), and the bound is used.
DECODE_STEP_SCALE_BOUNDS = (0.6, 1.2)
#: Fewest whole decode steps a scale is fitted from (fewer: 1.0, layers priced as timed alone).
MIN_DECODE_STEPS = 3
#: Fewest samples of the prefill in-step scale (its bounds: the same reasons as the decode one's,
#: ``fitted.PREFILL_STEP_SCALE_BOUNDS``), and of a slope over the chunk's size beside it.
MIN_PREFILL_STEPS = 3
MIN_PREFILL_SLOPE_STEPS = 6
#: The slopes tried (``prefill_step_factor``'s exponent; 0: one factor for every size).
PREFILL_SLOPES = tuple(np.round(np.linspace(0.0, 0.3, 61), 4))


def fit_step_overhead(samples: Sequence[StepOverheadSample]) -> tuple[float, float, float]:
    """``(per step, per composition, per composed work)`` seconds such that a step's overhead is
    ``a + b · compositions + c · composed_works``: NNLS in relative error over the samples when
    they span at least three distinct ``(compositions, composed_works)`` shapes, else their median
    as ``a`` alone; ``(0, 0, 0)`` without samples. (The same decomposition as vLLM's
    per-step input preparation, which grows with the batch it prepares.)"""
    if not samples:
        return 0.0, 0.0, 0.0
    y = np.array([s.seconds for s in samples])
    if len({(s.compositions, s.composed_works) for s in samples}) < 3:
        return float(np.median(y)), 0.0, 0.0
    x = np.array([[1.0, s.compositions, s.composed_works] for s in samples])
    w = 1.0 / y
    scale = x.max(axis=0)
    coef, _ = nnls(x / scale * w[:, None], y * w)
    a, b, c = (float(v) for v in coef / scale)
    return a, b, c


def fit_decode_step_scale(samples: Sequence[DecodeStepSample], num_layers: int, stateless, attention, embed,
                          head) -> tuple[float, float]:
    """Factors ``(s_st, s_at)`` on a decode layer call's alone-timed parts that fit whole decode
    steps: each step's compute ``y`` (layers + embedding + LM head) is modelled as
    ``num_layers · (s_st · stateless(b) + s_at · attention(c)) + embed(b) + head(b)`` (``stateless``
    a function of the batch ``b`` -- the stateless modules and the per-call overhead --, ``attention``
    of the context lengths -- scaled as inside a layer --, ``embed`` / ``head`` of a count; seconds),
    by NNLS in relative error. Measured, the discount is the weights' part: 0.82 on the stateless
    modules, 1.0 on attention (SmolLM2 bf16, one thread of an AVX512 EPYC). One factor for both when
    the steps' attention shares span less than 0.2 (the two are not told apart); ``(1, 1)`` with fewer
    than :data:`MIN_DECODE_STEPS` samples; each clipped to :data:`DECODE_STEP_SCALE_BOUNDS`.

    The attention factor is at most 1 (then ``s_st`` is refitted alone with ``s_at = 1``): a step
    warms the weights, not the KV cache each row reads, so a decode layer's attention costs inside a
    step at most what it costs inside the layer call timed alone (``attention`` is already scaled as
    inside a layer). On noisy whole steps the two-factor fit trades one factor for the other
    (issue 26 item 3, bf16 one thread on a busy AVX512 EPYC: 0.89 / 1.07, where the session before
    measured 0.96 / 0.90); the 1.07 put the held-out decode layers, run as in a step at batches
    41-64 and ~45k context positions, 13 % over (every layer of a pass measured 0.82-1.21x, median
    1.03x, the layer call timed alone)."""
    if len(samples) < MIN_DECODE_STEPS:
        return 1.0, 1.0
    st, at, rest, y = _decode_step_parts(samples, num_layers, stateless, attention, embed, head)
    w = 1.0 / y
    if np.ptp(at / (st + at)) < 0.2:
        den = float(np.sum(((st + at) * w) ** 2))
        one = float(np.sum((st + at) * (y - rest) * w * w)) / den if den > 0 else 1.0
        s_st = s_at = one
    else:
        x = np.stack([st, at], axis=1) * w[:, None]
        scale = np.maximum(x.max(axis=0), 1e-30)
        (s_st, s_at), _ = nnls(x / scale, (y - rest) * w)
        s_st, s_at = s_st / scale[0], s_at / scale[1]
        if s_at > 1.0:  # (see above) attention as inside a layer; the stateless factor takes the rest
            den = float(np.sum((st * w) ** 2))
            s_st, s_at = (float(np.sum(st * (y - rest - at) * w * w)) / den if den > 0 else 1.0), 1.0
    lo, hi = DECODE_STEP_SCALE_BOUNDS
    return min(hi, max(lo, float(s_st))), min(hi, max(lo, float(s_at)))


def fit_prefill_step_scale(samples: Sequence[PrefillStepSample], num_layers: int, layer, embed, head,
                           slope: bool = False) -> tuple[float, float]:
    """``(s, b)``: the factor on the layer calls of a step holding a prefill chunk, against the same call timed
    alone, that fits whole such steps: each step's compute ``y`` (layers + embedding + LM head) is modelled as
    ``num_layers · f · layer(q, c) + embed(Σq) + head(len(q))`` with ``f = prefill_step_factor(s, b, n)``
    (``n``: the step's prefill tokens; ``layer``: a layer call of the batch timed alone, ``embed`` / ``head``
    of a count; seconds). For each slope ``b`` of :data:`PREFILL_SLOPES` (only 0 unless ``slope``, or with
    fewer than :data:`MIN_PREFILL_SLOPE_STEPS` samples) ``s`` is the least-squares fit in relative error,
    clipped to ``PREFILL_STEP_SCALE_BOUNDS``; the pair with the least mean relative error is returned.
    ``(1.0, 0.0)`` with fewer than :data:`MIN_PREFILL_STEPS` samples. One factor on the whole call: what a
    step saves here was measured on the projections and on attention alike (the fresh-prompt and chunk
    attention paths both), so two would trade against each other on the noise. The slope: on an AMX Xeon
    the saving grew with the chunk (factor ~0.97 at 48 tokens, ~0.8 at 512-1,024), and one factor priced the
    served workload's steps of a few prompt tokens beside a decode batch ~12-15 % low (session 27)."""
    if len(samples) < MIN_PREFILL_STEPS:
        return 1.0, 0.0
    x, rest, y = _prefill_step_parts(samples, num_layers, layer, embed, head)
    n = np.array([prefill_tokens(s.query_lens) for s in samples], dtype=float)
    w = 1.0 / y
    lo, hi = PREFILL_STEP_SCALE_BOUNDS
    best = None
    for b in (PREFILL_SLOPES if slope and len(samples) >= MIN_PREFILL_SLOPE_STEPS else (0.0,)):
        g = (np.clip(n, *PREFILL_STEP_TOKEN_RANGE) / PREFILL_STEP_REF_TOKENS) ** -b
        xg = x * g
        den = float(np.sum((xg * w) ** 2))
        s = min(hi, max(lo, float(np.sum(xg * (y - rest) * w * w)) / den if den > 0 else 1.0))
        f = np.array([prefill_step_factor(s, float(b), int(k)) for k in n])
        err = float(np.mean(np.abs(f * x + rest - y) / y))
        if best is None or err < best[0] - 1e-12:
            best = (err, s, float(b))
    return best[1], best[2]


def _prefill_step_parts(samples: Sequence[PrefillStepSample], num_layers: int, layer, embed, head):
    """Arrays over ``samples``: the layer calls as timed alone, embedding + LM head, the measured compute."""
    x = np.array([num_layers * layer(s.query_lens, s.context_lens) for s in samples])
    rest = np.array([embed(sum(s.query_lens)) + head(len(s.query_lens)) for s in samples])
    return x, rest, np.array([s.seconds for s in samples])


def _decode_step_parts(samples: Sequence[DecodeStepSample], num_layers: int, stateless, attention, embed, head):
    """Arrays over ``samples``: the layers' stateless part and attention as timed alone, embedding + LM
    head, the measured compute."""
    st = np.array([num_layers * stateless(len(s.context_lens)) for s in samples])
    at = np.array([num_layers * attention(s.context_lens) for s in samples])
    rest = np.array([embed(len(s.context_lens)) + head(len(s.context_lens)) for s in samples])
    return st, at, rest, np.array([s.seconds for s in samples])


def fit_whole_steps(steps: Sequence[StepOverheadSample], dsteps: Sequence[DecodeStepSample],
                    psteps: Sequence[PrefillStepSample], num_layers: int, stateless, attention, layer, embed,
                    head, prefill_slope: bool = False
                    ) -> tuple[tuple[float, float, float], tuple[float, float, float, float], dict]:
    """:func:`fit_step_overhead` of ``steps``, :func:`fit_decode_step_scale` of ``dsteps`` and
    :func:`fit_prefill_step_scale` of ``psteps`` (see there for ``stateless``, ``attention``, ``layer``,
    ``embed``, ``head``; ``prefill_slope``: its ``slope``): ``(step terms, (decode stateless scale, decode
    attention scale, prefill scale, prefill slope), report)``; the report holds ``"step_overhead"`` /
    ``"decode_step"`` / ``"prefill_step"`` (coefficients, in-sample relative error) for the kinds given."""
    terms = fit_step_overhead(steps)
    scales = (*fit_decode_step_scale(dsteps, num_layers, stateless, attention, embed, head),
              *fit_prefill_step_scale(psteps, num_layers, layer, embed, head, slope=prefill_slope))
    rep: dict = {}
    if steps:
        pred = np.array([terms[0] + terms[1] * s.compositions + terms[2] * s.composed_works for s in steps])
        y = np.array([s.seconds for s in steps])
        rep["step_overhead"] = {"step_s": terms[0], "compose_s": terms[1], "compose_work_s": terms[2],
                                "error": float(np.mean(np.abs(pred - y) / y))}
    if dsteps:
        st, at, rest, y = _decode_step_parts(dsteps, num_layers, stateless, attention, embed, head)
        pred = scales[0] * st + scales[1] * at + rest
        rep["decode_step"] = {"scale": scales[0], "attention_scale": scales[1], "n": len(dsteps),
                              "error": float(np.mean(np.abs(pred - y) / y))}
    if psteps:
        x, rest, y = _prefill_step_parts(psteps, num_layers, layer, embed, head)
        f = np.array([prefill_step_factor(scales[2], scales[3], prefill_tokens(s.query_lens)) for s in psteps])
        rep["prefill_step"] = {"scale": scales[2], "slope": scales[3], "n": len(psteps),
                               "error": float(np.mean(np.abs(f * x + rest - y) / y)),
                               "error_alone": float(np.mean(np.abs(x + rest - y) / y))}
    return terms, scales, rep


#: Least share of its price a warm decode step is fitted to take (:func:`fit_decode_warm`).
DECODE_WARM_MIN = 0.5


def fit_decode_warm(samples: Sequence[WarmDecodeStepSample], price,
                    cold: Sequence[DecodeStepSample] = ()) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """``FittedLatencyModel.decode_warm``: per row count of ``samples`` (decode steps timed as the ``streak``-th
    of the same step run back to back), per streak 1, 2, ... up to the longest measured, the median of measured /
    the same step timed after other work (the :class:`DecodeStepSample` of ``cold`` with the same contexts; without
    one, ``price(context_lens)``, its price as a step after other work, seconds; so a model that prices the step
    a few % off does not hide the saving or add its own error to it), within
    ``[DECODE_WARM_MIN, 1]`` and never above the streak before it; by increasing rows, up to the last row
    count that saves and the next one (the edge where the factor reaches 1.0; past the last kept row count
    :meth:`~laser.latency.fitted.FittedLatencyModel.decode_warm_factor` is 1.0). ``()`` without samples or
    savings.

    A stream of small decode steps runs faster than one such step after other work (on an AMX Xeon, 1 thread,
    SmolLM2 int4 / int8: a batch-1 step 0.93x its price right after a prefill step, 0.76x seven decode steps
    later; batch 4 0.94x to 0.90x; 5+ rows, over dense bf16 copies, ~0.95x throughout; replayed after 30
    512-token AMX layer calls, a batch-1 step took 13.1, 13.0, 12.5, 12.4, 12.1, 11.9 ms, and 10.7 ms in a
    long stream). The profiler times every case after other work, as a step after a prefill runs."""
    by: dict[int, dict[int, list[float]]] = {}
    after_other = {c.context_lens: c.seconds for c in cold}
    for s in samples:
        p = after_other.get(s.context_lens) or price(s.context_lens)
        if p > 0.0 and s.streak >= 1:
            by.setdefault(len(s.context_lens), {}).setdefault(s.streak, []).append(s.seconds / p)
    out = []
    for rows in sorted(by):
        fs, last = [], 1.0
        for k in range(1, max(by[rows]) + 1):
            if k in by[rows]:
                last = min(last, 1.0, max(DECODE_WARM_MIN, float(np.median(by[rows][k]))))
            fs.append(last)
        out.append((rows, tuple(fs)))
    saving = [i for i, (_, fs) in enumerate(out) if min(fs) < 1.0]
    return tuple(out[:saving[-1] + 2]) if saving else ()
