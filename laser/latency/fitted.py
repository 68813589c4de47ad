"""The fitted latency model: what predicting needs, and nothing of fitting.

:class:`PiecewiseLinear` (stateless modules, LM head, embedding as functions of a count),
:class:`AttentionModel` (a linear model on :mod:`laser.latency.features`) and
:class:`FittedLatencyModel`, which composes them into the :class:`LatencyModel` interface
and reads/writes profile files (:mod:`laser.latency.io`). Prediction is pure Python
arithmetic on precomputed coefficients (microseconds): this module imports neither numpy
nor scipy; :meth:`FittedLatencyModel.fit` imports the fitting code
(:mod:`laser.latency.fitting`) when called.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .base import LatencyModel, LatencyProfileError, Sample
from .features import ATTENTION_FEATURES, N_DECODE_FEATURES, attention_features, decode_groups
from .io import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    check_document,
    check_setup,
    decode_samples,
    encode_samples,
    read_document,
    write_document,
)

#: Bounds of the prefill in-step factor (outside them the whole steps disagree with the layer samples by
#: more than cache effects explain: a broken profile, and the bound is used).
PREFILL_STEP_SCALE_BOUNDS = (0.6, 1.2)
#: The prefill tokens of a call at which ``prefill_step_scale`` holds as fitted, and the range of prefill
#: tokens the factor follows them over (the profile's whole prefill steps hold chunks of 4-1,024 tokens;
#: outside the range the factor stays at its edge).
PREFILL_STEP_REF_TOKENS = 256
PREFILL_STEP_TOKEN_RANGE = (4, 2048)


def prefill_tokens(query_lens) -> int:
    """The prefill tokens of a layer call's batch: its entries of more than one token (decode rows are 1)."""
    return sum(q for q in query_lens if q > 1)


def prefill_step_factor(scale: float, slope: float, prefill_tokens: int) -> float:
    """The factor on a layer call holding ``prefill_tokens`` prefill tokens inside a whole step, against
    the call timed alone: ``scale · (n / 256) ** -slope`` with ``n`` the tokens kept within
    :data:`PREFILL_STEP_TOKEN_RANGE`, clipped to :data:`PREFILL_STEP_SCALE_BOUNDS`. On an AMX Xeon (bf16
    SmolLM2, one thread) the factor fell from ~0.97 at 48 tokens to ~0.8 at 512-1,024: one factor for
    every size priced a few-token chunk beside a decode batch ~12 % low (docs/benchmarks.md, session 27)."""
    if slope == 0.0:
        return scale
    lo, hi = PREFILL_STEP_TOKEN_RANGE
    n = min(hi, max(lo, prefill_tokens))
    blo, bhi = PREFILL_STEP_SCALE_BOUNDS
    return min(bhi, max(blo, scale * (n / PREFILL_STEP_REF_TOKENS) ** -slope))


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
    was measured (:func:`laser.latency.fitting.fit_count_function` makes it non-decreasing, with
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
        self._d = self._w[:N_DECODE_FEATURES]

    def __call__(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        b = len(query_lens)
        if not b:
            return 0.0
        if sum(query_lens) == b:  # all decode: C-speed builtins when it is one group
            d0, d1, d2, d3, d4 = self._d
            mx = max(context_lens)
            g = self.max_gather_positions
            if g <= 0 or b * mx <= g:
                pad = b * mx
                return d0 + d1 * b + d2 * sum(context_lens) + d3 * pad + d4 * pad * pad
            groups = decode_groups(context_lens, g)
            return (d0 * len(groups) + d1 * b + d2 * sum(context_lens)
                    + d3 * sum(k * m for k, m in groups) + d4 * sum((k * m) ** 2 for k, m in groups))
        f = attention_features(query_lens, context_lens, self.max_gather_positions)
        return sum(w * x for w, x in zip(self._w, f))

    def to_dict(self) -> dict:
        return {"feature_set": self.feature_set, "coef": self.coef, "max_gather_positions": self.max_gather_positions}

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionModel":
        return cls(d["feature_set"], d["coef"], int(d.get("max_gather_positions", 0) or 0))


# --------------------------------------------------------------------------------------
# Fitted model and its profile file


def _decode_warm_from(doc) -> tuple:
    """``FittedLatencyModel.decode_warm`` from a profile document's ``[[rows, [factor, ...]], ...]``. Raises
    ValueError naming the field for anything else (:meth:`FittedLatencyModel._check` judges the numbers)."""
    def bad():
        return ValueError(f"decode_warm must be a list of [rows, [factor, ...]] pairs, got {doc!r}")

    if not isinstance(doc, (list, tuple)):
        raise bad()
    out = []
    for pair in doc:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                and not isinstance(pair[0], bool) and isinstance(pair[1], (list, tuple))
                and all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in pair[1])):
            raise bad()
        out.append((pair[0], tuple(float(f) for f in pair[1])))
    return tuple(out)


@dataclass
class FittedLatencyModel(LatencyModel):
    """A latency model fitted from profile samples (see :func:`laser.latency.fitting.fit`)."""

    num_layers: int
    stateless: PiecewiseLinear
    attention: AttentionModel
    embed: PiecewiseLinear
    head: PiecewiseLinear
    layer_overhead_s: float = 0.0
    # Attention inside a whole layer call costs this much more than alone (cache interference).
    layer_attention_scale: float = 1.0
    # One grammar mask per sampled row, seconds (LatencyModel.mask_time); 0.0: not measured.
    mask_row_s: float = 0.0
    # A step's cost beyond its layers, embedding and head (LatencyModel.step_overhead_time): per
    # step, per batch composition, per composed work; 0.0 without StepOverheadSamples.
    step_overhead_s: float = 0.0
    compose_overhead_s: float = 0.0
    compose_work_s: float = 0.0
    # The HTTP front end's share of a served TTFT (LatencyModel.frontend_ttft_s); 0.0: not measured.
    frontend_ttft_s: float = 0.0
    # A decode layer call (every entry one token) inside a whole step: its stateless modules and per-call
    # overhead cost decode_step_scale of the same call timed alone, its attention decode_step_attention_scale
    # (fitted from DecodeStepSamples by forms with "instep"; 1.0: priced as timed alone).
    decode_step_scale: float = 1.0
    decode_step_attention_scale: float = 1.0
    # A layer call holding a prefill chunk (decode rows beside it or not) inside a whole step: this much of the
    # same call timed alone at 256 prefill tokens, times (tokens / 256) ** -prefill_step_slope
    # (prefill_step_factor; fitted from PrefillStepSamples by forms with "instep", the slope by those with
    # "prefill_slope"; 1.0 and 0.0: priced as timed alone).
    prefill_step_scale: float = 1.0
    prefill_step_slope: float = 0.0
    # A decode step at full depth in a streak of decode steps (StepPlan.warm): ((rows, (factor 1 step in, 2 steps
    # in, ...)), ...) by rows, the share of its price it takes (decode_warm_factor; fitted from
    # WarmDecodeStepSamples; (): not measured).
    decode_warm: tuple = ()
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

    def decode_warm_factor(self, n_rows: int, streak: int = 1) -> float:
        """:attr:`decode_warm` at ``n_rows`` rows, ``streak`` steps into a streak (the last measured streak's
        factor past it): linear between the measured row counts, the first one's factor below them, 1.0 past
        the last (a batch the profile did not time in a streak saves nothing); 1.0 for ``streak <= 0`` or
        when not measured."""
        pts = self.decode_warm
        if streak <= 0 or not pts or n_rows > pts[-1][0]:
            return 1.0

        def at(fs):
            return fs[min(streak, len(fs)) - 1]

        if n_rows <= pts[0][0]:
            return at(pts[0][1])
        for (r0, f0), (r1, f1) in zip(pts, pts[1:]):
            if n_rows <= r1:
                a, b = at(f0), at(f1)
                return a + (b - a) * (n_rows - r0) / (r1 - r0)
        return 1.0

    def layer_time(self, query_lens, context_lens) -> float:
        """The call timed alone: ``stateless(n) + layer_attention_scale · attention(q, c) +
        layer_overhead_s`` (seconds); 0 if empty."""
        if not query_lens:
            return 0.0
        return (self.stateless(sum(query_lens)) + self.layer_attention_scale * self.attention(query_lens, context_lens)
                + self.layer_overhead_s)

    def step_layer_time(self, query_lens, context_lens) -> float:
        """The call inside a whole step (seconds; 0 if empty): when every entry is one decode token, the
        stateless part and overhead of :meth:`layer_time` times ``decode_step_scale`` and attention times
        ``decode_step_attention_scale``; else (a prefill chunk in the batch) :meth:`layer_time` times
        :func:`prefill_step_factor` of the call's prefill tokens."""
        if not query_lens:
            return 0.0
        n = sum(query_lens)
        at = self.layer_attention_scale * self.attention(query_lens, context_lens)
        if n == len(query_lens):
            return ((self.stateless(n) + self.layer_overhead_s) * self.decode_step_scale
                    + at * self.decode_step_attention_scale)
        f = self.prefill_step_scale
        if self.prefill_step_slope:
            f = prefill_step_factor(f, self.prefill_step_slope, prefill_tokens(query_lens))
        return (self.stateless(n) + at + self.layer_overhead_s) * f

    # -- fitting (imports numpy/scipy: only who fits pays for them) --------------------
    @classmethod
    def fit(cls, samples: Iterable[Sample], *, num_layers: int, metadata: dict | None = None,
            widths: Sequence[int] | None = None, folds: int = 5) -> "FittedLatencyModel":
        """Same as :func:`laser.latency.fitting.fit` (``widths=None``: its default widths)."""
        from .fitting import fit

        return fit(samples, num_layers=num_layers, metadata=metadata, widths=widths, folds=folds)

    def refit(self, widths: Sequence[int] | None = None, folds: int = 5) -> "FittedLatencyModel":
        """A new model fitted from this one's stored samples (same metadata, same form when the
        fit report names one)."""
        from .fitting import DEFAULT_FORM, FORMS, fit

        form = self.report.get("form")
        model = fit(self.samples, num_layers=self.num_layers, metadata=self.metadata, widths=widths, folds=folds,
                    form=form if form in FORMS else DEFAULT_FORM)
        model.mask_row_s = self.mask_row_s  # measured apart from the samples (laser.profiler.mask)
        model.frontend_ttft_s = self.frontend_ttft_s  # measured against a server (laser.bench.frontend_cost)
        return model

    # -- file -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The profile document (see :mod:`laser.latency.io`): metadata, coefficients,
        fit report and the raw samples."""
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
                "mask_row_s": self.mask_row_s,
                "step_overhead_s": self.step_overhead_s,
                "compose_overhead_s": self.compose_overhead_s,
                "compose_work_s": self.compose_work_s,
                "frontend_ttft_s": self.frontend_ttft_s,
                "decode_step_scale": self.decode_step_scale,
                "decode_step_attention_scale": self.decode_step_attention_scale,
                "prefill_step_scale": self.prefill_step_scale,
                "prefill_step_slope": self.prefill_step_slope,
                "decode_warm": [[r, list(fs)] for r, fs in self.decode_warm],
            },
            "report": self.report,
            "samples": encode_samples(self.samples),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically: temp file + rename). Returns the path."""
        return write_document(self.to_dict(), path)

    @classmethod
    def from_dict(cls, d: dict) -> "FittedLatencyModel":
        """Inverse of :meth:`to_dict` (a document without the step-overhead terms: 0.0 for them).
        Raises :class:`LatencyProfileError` for another format
        or version, or a malformed or unusable document (see :meth:`_check`)."""
        check_document(d)
        try:
            meta = dict(d["metadata"])
            m = d["model"]
            samples = decode_samples(d.get("samples", {}))
            model = cls(
                num_layers=int(meta["num_layers"]),
                stateless=PiecewiseLinear.from_dict(m["stateless"]),
                attention=AttentionModel.from_dict(m["attention"]),
                embed=PiecewiseLinear.from_dict(m["embed"]),
                head=PiecewiseLinear.from_dict(m["head"]),
                layer_overhead_s=float(m.get("layer_overhead_s", 0.0)),
                layer_attention_scale=float(m.get("layer_attention_scale", 1.0)),
                mask_row_s=float(m.get("mask_row_s", 0.0)),  # (absent from profiles made before it was measured)
                step_overhead_s=float(m.get("step_overhead_s", 0.0)),  # (absent before issue 26: 0, not measured)
                compose_overhead_s=float(m.get("compose_overhead_s", 0.0)),
                compose_work_s=float(m.get("compose_work_s", 0.0)),
                frontend_ttft_s=float(m.get("frontend_ttft_s", 0.0)),  # (absent before it was measured: 0)
                decode_step_scale=float(m.get("decode_step_scale", 1.0)),  # (absent before profiler 10: 1)
                decode_step_attention_scale=float(m.get("decode_step_attention_scale", 1.0)),
                prefill_step_scale=float(m.get("prefill_step_scale", 1.0)),  # (absent before profiler 11: 1)
                prefill_step_slope=float(m.get("prefill_step_slope", 0.0)),  # (absent before session 27: 0)
                decode_warm=_decode_warm_from(m.get("decode_warm", ())),  # (absent before profiler 12: ())
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
        for name in ("layer_attention_scale", "decode_step_scale", "decode_step_attention_scale", "prefill_step_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        rows = [r for r, _ in self.decode_warm]
        if rows != sorted(set(rows)) or any(r < 1 or not fs or not all(math.isfinite(f) and 0.0 < f <= 1.0 for f in fs)
                                            or any(b > a for a, b in zip(fs, fs[1:])) for r, fs in self.decode_warm):
            raise ValueError(f"decode_warm must be (rows, factors) pairs by increasing rows >= 1, each with factors "
                             f"in (0, 1] that never rise along the streak, got {self.decode_warm!r}")
        if not (math.isfinite(self.prefill_step_slope) and abs(self.prefill_step_slope) <= 1.0):
            raise ValueError(f"prefill_step_slope must be finite and within [-1, 1], got {self.prefill_step_slope}")
        for name in ("mask_row_s", "step_overhead_s", "compose_overhead_s", "compose_work_s", "frontend_ttft_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        probes = [self.layer_time((n,), (n,)) for n in (1, 7, 64, 512, 4096)]
        probes += [self.layer_time((1,) * b, (512,) * b) for b in (1, 16, 64)]
        probes += [self.layer_time((100, 1), (300, 900)), self.step_layer_time((100, 1), (300, 900))]
        probes += [self.step_layer_time((1,) * b, (512,) * b) for b in (1, 64)]
        probes += [f(n) for f in (self.embed_time, self.head_time) for n in (1, 16, 256)]
        bad = [t for t in probes if not (math.isfinite(t) and t >= 0)]
        if bad:
            raise ValueError(f"the model predicts negative or non-finite times (e.g. {bad[0]!r})")

    @classmethod
    def load(cls, path: str | os.PathLike, *, refit: bool = False, **expect) -> "FittedLatencyModel":
        """Read a profile file. ``expect`` (e.g. ``model_id=..., dtype=..., hardware=...,
        threads=..., num_layers=...``) must match its metadata, else
        :class:`LatencyProfileError` (also for a missing, unreadable or corrupt file).
        ``refit=True`` refits from the stored samples."""
        doc = read_document(path)
        try:
            model = cls.from_dict(doc)
        except LatencyProfileError as e:
            raise LatencyProfileError(f"corrupt latency profile {path}: {e}") from e
        check_setup(path, {**model.metadata, "num_layers": model.num_layers}, expect)
        return model.refit() if refit else model
