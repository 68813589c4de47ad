"""A latency model that follows the machine as it runs now (online calibration).

A profile is measured once; the machine it runs on changes: another process takes memory
bandwidth, the host of a VM gets busier, the KV pool fills and attention reads scatter. A
plan sized to 90 % of a TBT target with a model that is 25 % optimistic right now misses the
target (seen on the real engine: the chat class of the KV-pressure scenario planned at
0.32 s per iteration against 0.4 s, and ran 0.50 s). :class:`CalibratedLatencyModel` scales
the predictions of the profiled model by factors the instance measures as it serves: the
``quantile`` of (measured / predicted) wall time over its last ``window`` complete steps, one
factor for decode layer calls and one for layer calls with a prefill chunk
(:class:`KindScaledLatencyModel`'s split: the machine moves the two apart).

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

    def decode_warm_factor(self, n_rows: int, streak: int = 1) -> float:
        """``inner``'s (a share of the step's price, which this model scales)."""
        return self.inner.decode_warm_factor(n_rows, streak)

    @property
    def exit_cost(self):  # type: ignore[override]
        """``inner``'s (fractions of its head and layer times, which this model scales)."""
        return self.inner.exit_cost

    @exit_cost.setter
    def exit_cost(self, cost) -> None:
        self.inner.exit_cost = cost

    def layer_factor(self, query_lens: Sequence[int]) -> float:
        """The factor on a layer call of the batch with these query lengths: :attr:`factor` here."""
        return self.factor

    def layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        return self.layer_factor(query_lens) * self.inner.layer_time(query_lens, context_lens)

    def step_layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        return self.layer_factor(query_lens) * self.inner.step_layer_time(query_lens, context_lens)


class KindScaledLatencyModel(ScaledLatencyModel):
    """``inner``'s predictions, layer calls whose every entry is one decode token (and the
    embedding, LM head, mask and step overheads) times ``decode_factor``, layer calls with a
    prefill chunk (a query of more than one token) times ``factor``; every step ``host_step_s``
    seconds more (with the step's own overhead). Raises ValueError for a negative factor or
    both zero, or a negative ``host_step_s``."""

    def __init__(self, inner, decode_factor: float, factor: float, host_step_s: float = 0.0):
        if decode_factor < 0.0 or factor < 0.0 or not decode_factor + factor > 0.0 or host_step_s < 0.0:
            raise ValueError(f"need factors >= 0, not both 0, and host_step_s >= 0, got {decode_factor}, {factor}, "
                             f"{host_step_s}")
        super().__init__(inner, 1.0)
        self.factor = float(factor)  # (ScaledLatencyModel refuses 0; a pricing split needs it)
        self.decode_factor = float(decode_factor)
        self.host_step_s = float(host_step_s)

    def layer_factor(self, query_lens: Sequence[int]) -> float:
        """:attr:`decode_factor` when every entry is one decode token, else :attr:`factor`."""
        return self.decode_factor if sum(query_lens) == len(query_lens) else self.factor

    @property
    def overhead_factor(self) -> float:
        """The per-row and per-step terms scale with decode (bandwidth- and dispatch-bound, like a
        decode layer): :attr:`decode_factor`."""
        return self.decode_factor

    def step_overhead_time(self, compositions: int, composed_works: int) -> float:
        if compositions <= 0:
            return 0.0
        return super().step_overhead_time(compositions, composed_works) + self.host_step_s

    @property
    def step_overhead_s(self) -> float:  # type: ignore[override]
        return super().step_overhead_s + self.host_step_s


class CalibratedLatencyModel(KindScaledLatencyModel):
    """``inner``'s predictions scaled by two factors that follow the measured / predicted time of
    the instance's steps (see the module docstring): :attr:`decode_factor` for decode layer calls
    (and the per-row and per-step terms), :attr:`factor` for layer calls with a prefill chunk
    (:class:`KindScaledLatencyModel`'s split).

    Each factor is the ``quantile`` of its own kind's ratios: a step whose prefill layer calls
    are under half its inner price is a decode observation, ``(measured - factor * P) / D``, the
    others prefill ones, ``(measured - decode_factor * D) / P`` (``D``, ``P``: the inner price of
    the step's decode and prefill parts; :meth:`observe`). A kind with fewer than ``min_steps``
    observations takes the one-factor calibration's, the quantile of measured / inner price
    over every step (:attr:`ratios`), so a model observed without the split (:meth:`observe`
    with no ``prefill_s``) has one factor, as before the split. Why two: the machine moves
    memory-bound decode and compute-bound prefill apart (bf16 SmolLM2 on the 2-vCPU EPYC: 0.73x
    and 0.85x of the profile in one run; ``machine_speed.fit_machine_speed``), and one factor,
    the 0.8 quantile of a mix of both, prices one kind high and the other low (that run's steps
    replayed: 0.781 for both against 0.755 / 0.847; each step planned 2.7 % less pessimistically
    with two, docs/benchmarks.md "knee23"). When the two move together it changes nothing.

    Args:
        inner: the profiled model (any :class:`LatencyModel`).
        window: complete steps remembered (per kind, and in all). quantile: of their ratios.
        min_steps: observations before a factor leaves 1.0 (a kind's before it leaves the
            one-factor value).
        lo, hi: bounds of the factors.
        spread_quantile, max_spread, prior_spread: :meth:`timing_spread`'s quantile of the
            ratios (None, the default: no spread, margins stay fixed; 0.98 is what
            ``--jitter-margin`` sets), its upper bound, and its value before ``min_steps``
            observations.
    Raises:
        ValueError: for a window or min_steps below 1, min_steps above the window, a quantile outside (0, 1], bounds
            that do not satisfy ``0 < lo <= 1 <= hi``, a spread quantile below the quantile
            or above 1, or a prior spread outside ``[1, max_spread]``.
    """

    #: A step is a prefill observation when its prefill layer calls are at least this share of its inner price.
    PREFILL_SHARE = 0.5

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
        super().__init__(inner, 1.0, 1.0)
        self.quantile, self.min_steps, self.lo, self.hi = quantile, min_steps, lo, hi
        self.spread_quantile, self.max_spread = spread_quantile, max_spread
        self._spread = prior_spread if spread_quantile is not None else 1.0
        self.ratios: deque[float] = deque(maxlen=window)  # measured / inner price, every step
        # per kind: (measured - the other kind's scaled part) / this kind's inner part
        self.decode_ratios: deque[float] = deque(maxlen=window)
        self.prefill_ratios: deque[float] = deque(maxlen=window)
        self._recent: deque[tuple[float, bool]] = deque(maxlen=window)  # (kind ratio, prefill?), every step
        self.observed = 0  # steps observed in all
        self._decode_price = KindScaledLatencyModel(inner, 1.0, 0.0)  # a plan's decode part D (observe_step)

    # -- calibration ---------------------------------------------------------------------------
    def observe(self, predicted_s: float, measured_s: float, prefill_s: float = 0.0) -> None:
        """One complete step: ``predicted_s`` by the inner model (unscaled), of which
        ``prefill_s`` in layer calls with a prefill chunk (0.0: a decode step, or unknown),
        ``measured_s`` of wall time. Non-positive predictions are ignored."""
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return
        self.ratios.append(measured_s / predicted_s)
        self.observed += 1
        prefill_s = min(max(prefill_s, 0.0), predicted_s)
        decode_s = predicted_s - prefill_s
        pre = prefill_s >= self.PREFILL_SHARE * predicted_s
        r = ((measured_s - self.decode_factor * decode_s) / prefill_s if pre
             else (measured_s - self.factor * prefill_s) / decode_s)
        if r > 0.0:
            (self.prefill_ratios if pre else self.decode_ratios).append(r)
            self._recent.append((r, pre))
        if len(self.ratios) < self.min_steps:
            return
        # (a kind's factor moves with its own observations, or with every step while it takes the one factor)
        one = self._clamped(self.ratio_quantile(self.quantile)) if min(
            len(self.decode_ratios), len(self.prefill_ratios)) < self.min_steps else 1.0
        if not pre or len(self.decode_ratios) < self.min_steps:
            self.decode_factor = self._kind_factor(self.decode_ratios, one)
        if pre or len(self.prefill_ratios) < self.min_steps:
            self.factor = self._kind_factor(self.prefill_ratios, one)
        if self.spread_quantile is not None and self._recent:
            a, b = self.decode_factor, self.factor
            s = sorted(r / (b if pre else a) for r, pre in self._recent)
            self._spread = min(self.max_spread, max(1.0, _quantile(s, self.spread_quantile) / _quantile(s, self.quantile)))

    def _clamped(self, f: float) -> float:
        return min(self.hi, max(self.lo, f))

    def _kind_factor(self, ratios: deque, one: float) -> float:
        """The ``quantile`` of one kind's ``ratios`` within ``[lo, hi]``; ``one`` (the one-factor
        value) before ``min_steps`` of them."""
        return self._clamped(_quantile(ratios, self.quantile)) if len(ratios) >= self.min_steps else one

    def timing_spread(self) -> float:
        """How far over its calibrated prediction a step runs in the worst ``1 - spread_quantile``
        of steps: the ``spread_quantile`` over the ``quantile`` of the last ``window`` steps' kind
        ratios, each over its kind's factor now (for steps of one kind: the quantile of their ratios
        over the factor), within ``[1, max_spread]``; always 1.0 without a ``spread_quantile`` (the
        default: the fixed margins). ``prior_spread`` until ``min_steps``
        observations (:func:`spread_before_calibration`: the spread the profile measured, when it did)."""
        return self._spread

    def ratio_quantile(self, q: float) -> float:
        """The ``q`` quantile of the remembered measured / predicted ratios of every step (1.0 before any)."""
        return _quantile(self.ratios, q) if self.ratios else 1.0

    def observe_step(self, predicted_s: float, measured_s: float, plan=None) -> None:
        """Observe a step that ran its plan to completion: ``predicted_s`` seconds by this model
        (its factors of now times the inner model's prices of the plan's parts; the scheduler
        priced the plan with it when it built it, :meth:`laser.scheduler.base.Scheduler.observe_step`),
        ``measured_s`` seconds of wall time, and the plan (a :class:`laser.core.plan.StepPlan`;
        None: a decode step). The factors do not move between the pricing of a plan and its
        observation (one instance's steps are observed in order), so the inner prices follow
        from ``predicted_s``: a plan of decode works only is all ``D = predicted_s /
        decode_factor``; any other is priced once more for its decode part ``D`` (dynamic-depth
        and draft pricing as the plan's), and ``P = (predicted_s - decode_factor * D) / factor``."""
        if plan is None or all(w.is_decode for w in plan.works):
            self.observe(predicted_s / self.decode_factor, measured_s)
            return
        from ..core.pricing import PlanCost

        d = PlanCost(self._decode_price, plan.num_layers, plan.works, *(plan.speculative or ())).total
        p = max(0.0, predicted_s - self.decode_factor * d) / self.factor
        self.observe(d + p, measured_s, p)
