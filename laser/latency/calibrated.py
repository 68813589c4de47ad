"""A latency model that follows the machine as it runs now (online calibration).

A profile is measured once; the machine it runs on changes: another process takes memory
bandwidth, the host of a VM gets busier, the KV pool fills and attention reads scatter. A
plan sized to 90 % of a TBT target with a model that is 25 % optimistic right now misses the
target (seen on the real engine: the chat class of the KV-pressure scenario planned at
0.32 s per iteration against 0.4 s, and ran 0.50 s). :class:`CalibratedLatencyModel` scales
every prediction of the profiled model by a factor the instance measures as it serves: the
``quantile`` of (measured / predicted) wall time over its last ``window`` complete steps.

The factor is a high quantile rather than the mean so that the plans hold in most steps
when step times jitter (the P99 TBT is what a class is judged on). The steps it does not
cover are what :meth:`CalibratedLatencyModel.timing_spread` measures: the ``spread_quantile``
ratio over the factor, by which the scheduler divides its planning margins -- a request with
16 tokens may not have a single gap over its TBT target (its P99 is its worst gap), and a
host that runs 20 % of its steps 10-20 % over the calibrated prediction (seen on a VM: a
0.36 s plan for a 0.4 s TBT ran 0.43 s) breaks a fixed 10 % margin. It is opt-in
(``spread_quantile``; ``laser serve --jitter-margin``): a wider margin leaves prefill less of
every iteration, and on a mixed workload that costs more TTFT misses than the TBT misses it
saves (docs/benchmarks.md, "Margins that follow the machine's timing spread"). It starts at 1.0, moves
only after ``min_steps`` observations, and stays in ``[lo, hi]``. Steps that a stop cut
short are not observed (their prediction was for the whole plan). The simulator never uses
it unless asked (``SimInstance(latency_model=CalibratedLatencyModel(m),
machine_model=ScaledLatencyModel(m, f))`` simulates a machine ``f`` times slower than its
profile, planned for with and without calibration). Torch- and numpy-free.

The same idea as the running correction of a cost model in database query optimisers; in
LLM serving, DistServe and Llumnix fit their latency models offline only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from .base import LatencyModel

#: The quantile of measured / predicted step times whose ratio to the calibration factor divides
#: Laser's planning margins (``CalibratedLatencyModel(spread_quantile=...)``, the jitter margin),
#: and of a profile's repeats over their case's time (:func:`repeat_spread`).
JITTER_SPREAD_QUANTILE = 0.98
#: Most a timing spread divides the planning margins by (``CalibratedLatencyModel(max_spread=...)``).
MAX_SPREAD = 1.5
#: The timing spread before the calibration's first ``min_steps`` steps when the profile measured
#: none (:func:`spread_before_calibration`): what a quiet 2-vCPU VM showed (AVX2 EPYC, fp32; 68 steps of the
#: KV-pressure scenario: measured / predicted P95 1.12, P80 1.04, max 1.37).
DEFAULT_PRIOR_SPREAD = 1.1
#: Fewest repeats of one case, and fewest repeats in all, that :func:`repeat_spread` judges from.
_MIN_CASE_REPEATS, _MIN_REPEATS = 3, 20


def repeat_spread(repeats: Iterable[Sequence[float]], q: float = JITTER_SPREAD_QUANTILE) -> float | None:
    """The step-time spread a profile measured: the ``q`` quantile of (repeat / its case's median)
    over the cases of ``repeats`` (one sequence of repeated timings, seconds, per profiled case:
    the undisturbed ones) with at least 3 repeats, within ``[1, MAX_SPREAD]``; None from fewer
    than 20 such repeats. A profile's time of a case is its median repeat (:mod:`laser.profiler.timing`),
    and a step runs this much over its prediction in the worst ``1 - q`` of calls: what
    :meth:`CalibratedLatencyModel.timing_spread` measures once it has steps, here before it
    has any (:func:`spread_before_calibration`). Issue 28, item 4."""
    ratios = []
    for times in repeats:
        if len(times) >= _MIN_CASE_REPEATS:
            med = _quantile(times, 0.5)
            if med > 0.0:
                ratios.extend(t / med for t in times)
    if len(ratios) < _MIN_REPEATS:
        return None
    return min(MAX_SPREAD, max(1.0, _quantile(ratios, q)))


def spread_before_calibration(model: LatencyModel) -> float:
    """The timing spread to plan with before the online calibration has steps: the one
    ``model``'s profile measured (``metadata["measurement"]["timing_spread"]``,
    :func:`repeat_spread`), at least :data:`DEFAULT_PRIOR_SPREAD` and at most :data:`MAX_SPREAD`;
    :data:`DEFAULT_PRIOR_SPREAD` for a model without one (older profiles, analytic estimates).

    Case (issue 28, item 4): four 16-token chat streams (0.4 s TBT) started on a VM before the
    calibration had its first 8 steps; planned to 0.9 / 1.1 of T_g with the profile's median
    step times, one run's gaps landed 3-10 ms over the target -- and a 16-token stream's P99 is
    its worst gap."""
    measured = (getattr(model, "metadata", None) or {}).get("measurement", {}).get("timing_spread")
    if not isinstance(measured, (int, float)) or measured != measured:
        return DEFAULT_PRIOR_SPREAD
    return min(MAX_SPREAD, max(DEFAULT_PRIOR_SPREAD, float(measured)))


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (numpy's default rule) of non-empty ``values``."""
    s = sorted(values)
    x = q * (len(s) - 1)
    i = int(x)
    return s[i] if i + 1 >= len(s) else s[i] + (x - i) * (s[i + 1] - s[i])


class ScaledLatencyModel(LatencyModel):
    """``inner``'s predictions times :attr:`factor` (dimensionless). As the clock of a
    simulated machine (``SimInstance(machine_model=...)``) it stands for a machine slower or
    faster than its profile says; :class:`CalibratedLatencyModel` moves the factor online."""

    def __init__(self, inner: LatencyModel, factor: float = 1.0):
        if not factor > 0.0:
            raise ValueError("need factor > 0")
        self.inner = inner
        self.num_layers = inner.num_layers
        self.factor = float(factor)

    @property
    def overhead_factor(self) -> float:
        """The factor of the per-row and per-step terms (embedding, LM head, grammar masks, the
        layer-call, step and composition overheads): :attr:`factor` here; a model that scales
        kinds of work apart (``laser.latency.machine_speed.KindScaledLatencyModel``) sets its own."""
        return self.factor

    @property
    def metadata(self) -> dict:
        return getattr(self.inner, "metadata", {})

    @property
    def layer_overhead_s(self) -> float:  # type: ignore[override]
        return self.overhead_factor * self.inner.layer_overhead_s

    def stateless_time(self, n_tokens: int) -> float:
        return self.factor * self.inner.stateless_time(n_tokens)

    def attention_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        return self.factor * self.inner.attention_time(query_lens, context_lens)

    def embed_time(self, n_tokens: int) -> float:
        return self.overhead_factor * self.inner.embed_time(n_tokens)

    def head_time(self, n_rows: int) -> float:
        return self.overhead_factor * self.inner.head_time(n_rows)

    @property
    def mask_row_s(self) -> float:  # type: ignore[override]
        return self.overhead_factor * self.inner.mask_row_s

    @property
    def step_overhead_s(self) -> float:  # type: ignore[override]
        return self.overhead_factor * self.inner.step_overhead_s

    @property
    def compose_overhead_s(self) -> float:  # type: ignore[override]
        return self.overhead_factor * self.inner.compose_overhead_s

    @property
    def compose_work_s(self) -> float:  # type: ignore[override]
        return self.overhead_factor * self.inner.compose_work_s

    @property
    def frontend_ttft_s(self) -> float:  # type: ignore[override]
        """The inner model's (the front end is not engine compute: the calibration does not scale it)."""
        return getattr(self.inner, "frontend_ttft_s", 0.0)

    def step_overhead_time(self, compositions: int, composed_works: int) -> float:
        return self.overhead_factor * self.inner.step_overhead_time(compositions, composed_works)

    def mask_time(self, n_rows: int) -> float:
        return self.overhead_factor * self.inner.mask_time(n_rows)

    @property
    def exit_cost(self):  # type: ignore[override]
        """``inner``'s (fractions of its head and layer times, which this model scales)."""
        return self.inner.exit_cost

    @exit_cost.setter
    def exit_cost(self, cost) -> None:
        self.inner.exit_cost = cost

    def layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        return self.factor * self.inner.layer_time(query_lens, context_lens)


class CalibratedLatencyModel(ScaledLatencyModel):
    """``inner``'s predictions times :attr:`factor`, which follows the measured / predicted
    time of the instance's steps (see the module docstring).

    Args:
        inner: the profiled model (any :class:`LatencyModel`).
        window: complete steps remembered. quantile: of their measured / predicted ratios.
        min_steps: observations before the factor leaves 1.0.
        lo, hi: bounds of the factor.
        spread_quantile, max_spread, prior_spread: :meth:`timing_spread`'s quantile of the
            ratios (None, the default: no spread, margins stay fixed; 0.98 is what
            ``--jitter-margin`` sets), its upper bound, and its value before ``min_steps``
            observations.
    Raises:
        ValueError: for a window or min_steps below 1, min_steps above the window, a quantile outside (0, 1], bounds
            that do not satisfy ``0 < lo <= 1 <= hi``, a spread quantile below the quantile
            or above 1, or a prior spread outside ``[1, max_spread]``.
    """

    def __init__(self, inner: LatencyModel, window: int = 64, quantile: float = 0.8, min_steps: int = 8,
                 lo: float = 0.5, hi: float = 4.0, spread_quantile: float | None = None,
                 max_spread: float = MAX_SPREAD, prior_spread: float = DEFAULT_PRIOR_SPREAD):
        if window < 1 or min_steps < 1 or not 0.0 < quantile <= 1.0 or not 0.0 < lo <= 1.0 <= hi:
            raise ValueError("need window >= 1, min_steps >= 1, 0 < quantile <= 1 and 0 < lo <= 1 <= hi")
        if min_steps > window:  # the window would never hold min_steps ratios: the factor would never move
            raise ValueError(f"need min_steps <= window, got min_steps={min_steps} > window={window}")
        if spread_quantile is not None and (not quantile <= spread_quantile <= 1.0
                                            or not 1.0 <= prior_spread <= max_spread):
            raise ValueError("need quantile <= spread_quantile <= 1 and 1 <= prior_spread <= max_spread")
        super().__init__(inner, 1.0)
        self.quantile, self.min_steps, self.lo, self.hi = quantile, min_steps, lo, hi
        self.spread_quantile, self.max_spread = spread_quantile, max_spread
        self._spread = prior_spread if spread_quantile is not None else 1.0
        self.ratios: deque[float] = deque(maxlen=window)
        self.observed = 0  # steps observed in all

    # -- calibration ---------------------------------------------------------------------------
    def observe(self, predicted_s: float, measured_s: float) -> None:
        """One complete step: ``predicted_s`` by the inner model (unscaled), ``measured_s``
        of wall time. Non-positive predictions are ignored."""
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return
        self.ratios.append(measured_s / predicted_s)
        self.observed += 1
        if len(self.ratios) >= self.min_steps:
            self.factor = min(self.hi, max(self.lo, self.ratio_quantile(self.quantile)))
            if self.spread_quantile is not None:
                self._spread = min(self.max_spread, max(1.0, self.ratio_quantile(self.spread_quantile) / self.factor))

    def timing_spread(self) -> float:
        """``spread_quantile`` of the remembered measured / predicted ratios over :attr:`factor`,
        within ``[1, max_spread]``: how far over its calibrated prediction a step runs in the
        worst ``1 - spread_quantile`` of steps; always 1.0 without a ``spread_quantile`` (the
        default: the fixed margins). ``prior_spread`` until ``min_steps``
        observations (:func:`spread_before_calibration`: the spread the profile measured, when it did)."""
        return self._spread

    def ratio_quantile(self, q: float) -> float:
        """The ``q`` quantile of the remembered measured / predicted ratios (1.0 before any)."""
        return _quantile(self.ratios, q) if self.ratios else 1.0

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """Observe a step that ran its plan to completion: ``predicted_s`` seconds by this model
        (its current :attr:`factor` times the inner model's prediction; the scheduler priced the
        plan with it when it built it, :meth:`laser.scheduler.base.Scheduler.observe_step`) and
        ``measured_s`` seconds of wall time. The factor does not move between the pricing of a
        plan and its observation (one instance's steps are observed in order), so the inner
        model's prediction is ``predicted_s / factor`` without pricing the plan again."""
        self.observe(predicted_s / self.factor, measured_s)
