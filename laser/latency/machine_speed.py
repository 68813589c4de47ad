"""How fast the machine ran a real engine's steps against its profile, per kind of work.

A profile is measured once; the machine drifts. On the shared 2-vCPU EPYC of issue 26 the same
engine ran its steps at 0.75x of the profile's decode prediction in one minute and 1.15x in another
(``benchmarks/sim_vs_real.py``, in process), so a simulation priced with the profile as is
compares the simulator with a different machine, not with the engine. And the drift is not one
factor: memory-bound decode layer calls moved more than compute-bound prefill ones (0.75x vs
0.88x in the same run, bf16 SmolLM2, docs/benchmarks.md "sim19").

:func:`fit_machine_speed` fits two factors from a run's complete steps (plan, wall seconds):
``measured = decode_factor * D + other_factor * P``, where ``D`` is the plan's price of its decode
parts (layer calls whose batch is all one-token decode rows, plus embedding, LM head, step
overhead) and ``P`` of the rest (layer calls with a prefill chunk), both by the profile
(:class:`KindScaledLatencyModel` with (1, 0) and (0, 1)); least squares through the origin. The
simulator's clock is then ``KindScaledLatencyModel(profile, decode_factor, other_factor)``
(``SimInstance(machine_model=...)``), the machine as it ran, plus the engine's own time per step
outside its executor (``host_step_s``: scheduling, the step's bookkeeping, its outputs), which
the simulator's clock does not otherwise advance by.

The fit also keeps how far each step ran from its fitted price (:attr:`MachineSpeed.decode_jitter`
for decode-only steps, :attr:`~MachineSpeed.other_jitter` for steps with prefill: quantiles of
measured / fitted, each kind's total time preserved). A simulated machine that takes the fitted
price as exact never runs a step late, so its engine's online calibration measures no spread and
plans with its full margins, and no plan lands past its target for a slow step; with
:class:`JitteredLatencyModel` each simulated step draws its own ratio from the run's (a
bootstrap of the residuals). On the AMX kind, at the simulated knee of the 2:1:1 mix, per-step
jitter of 3-10 % took simulated attainment from 0.917 to 0.858-0.758 (code 0.833 to 0.700-0.600),
and 0.992 to 0.975 at 0.8x of it (docs/benchmarks.md, "The AMX kind, session 29"). Torch- and
numpy-free.
"""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from .calibrated import KindScaledLatencyModel, ScaledLatencyModel

__all__ = ["JitteredLatencyModel", "KindScaledLatencyModel", "MachineSpeed", "fit_machine_speed", "refuse_scattered",
           "step_hook"]

#: Quantiles of the per-step ratio :class:`MachineSpeed` keeps per kind of step: enough to draw from, small to store.
JITTER_QUANTILES = 101


def _ratios(ratios: Sequence[float], what: str) -> tuple[float, ...]:
    """``ratios`` as a tuple of floats; ValueError unless each is a finite real number > 0."""
    if isinstance(ratios, (str, bytes)):
        raise ValueError(f"{what}: want a sequence of numbers, got {ratios!r}")
    out = []
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not (math.isfinite(r) and r > 0.0):
            raise ValueError(f"{what}: every ratio must be a finite number > 0, got {r!r}")
        out.append(float(r))
    return tuple(out)


def _has_prefill(plan) -> bool:
    """Whether a step plan has a layer call with a prefill chunk (a work of more than one token)."""
    return any(w.num_tokens > 1 for w in plan.works)


def _seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: want an int, got {seed!r}")
    return seed


class JitteredLatencyModel(ScaledLatencyModel):
    """``inner``'s prices times a ratio drawn afresh for every step (:meth:`begin_step`),
    uniformly from ``decode_ratios`` for a step of one-token decode works only and from
    ``other_ratios`` for one with a prefill chunk (dimensionless, each finite and > 0; e.g.
    :attr:`MachineSpeed.decode_jitter` / :attr:`~MachineSpeed.other_jitter`; an empty one takes
    the other's), with a generator seeded by ``seed`` (:meth:`reseed`: the same draws again, so two
    simulated runs of one workload see the same machine).

    It is a simulated machine's clock, never a model to plan with: ``SimInstance(machine_model=...)``
    (its executor calls :meth:`begin_step` before pricing each step, also through wrappers with an
    ``inner``) and ``SimTarget(machine_model=...)`` (reseeded at the start of every run); both refuse
    it as the latency model the scheduler plans with, and the cluster simulator refuses it. Every
    price scales by the drawn ratio (layer calls, embedding, LM head, step and composition
    overheads) except ``inner``'s ``host_step_s`` (the engine's time outside its executor, measured
    apart from the steps the ratios come from). Before the first :meth:`begin_step`, and after
    :meth:`reseed`, the ratio is 1.0; after a run it keeps the last step's.

    Raises ValueError for no ratios at all, a ratio that is not a finite number > 0, or a seed
    that is not an int."""

    def __init__(self, inner, decode_ratios: Sequence[float], other_ratios: Sequence[float] = (), seed: int = 0):
        dec, other = _ratios(decode_ratios, "decode_ratios"), _ratios(other_ratios, "other_ratios")
        if not dec and not other:
            raise ValueError("need at least one ratio")
        super().__init__(inner, 1.0)
        self.decode_ratios, self.other_ratios = dec or other, other or dec
        self.seed = _seed(seed)
        self._rng = random.Random(self.seed)

    def reseed(self, seed: int | None = None) -> None:
        """Start the draws again from ``seed`` (kept as :attr:`seed`; default: :attr:`seed`)."""
        if seed is not None:
            self.seed = _seed(seed)
        self._rng.seed(self.seed)
        self.factor = 1.0

    def begin_step(self, plan) -> None:
        """Draw the ratio of the prices of ``plan`` (a :class:`laser.core.plan.StepPlan`), the next step."""
        ratios = self.other_ratios if _has_prefill(plan) else self.decode_ratios
        self.factor = ratios[self._rng.randrange(len(ratios))]

    def _host_s(self) -> float:
        return getattr(self.inner, "host_step_s", 0.0)

    @property
    def step_overhead_s(self) -> float:  # type: ignore[override]
        host = self._host_s()
        return self.factor * (self.inner.step_overhead_s - host) + host

    def step_overhead_time(self, compositions: int, composed_works: int) -> float:
        if compositions <= 0:
            return 0.0
        host = self._host_s()
        return self.factor * (self.inner.step_overhead_time(compositions, composed_works) - host) + host


def step_hook(model, name: str):
    """``model``'s method ``name`` (e.g. ``"begin_step"``, ``"reseed"`` of a
    :class:`JitteredLatencyModel`), or the first one found down its chain of ``inner`` models
    (a wrapper around a jittered machine); None when none has it."""
    seen = 0
    while model is not None and seen < 16:
        fn = getattr(type(model), name, None)
        if fn is not None:
            return getattr(model, name)
        model, seen = getattr(model, "inner", None), seen + 1
    return None


def refuse_scattered(model, what: str) -> None:
    """Raises ValueError when ``model`` (or a model it wraps) is a machine whose steps scatter
    (:class:`JitteredLatencyModel`): ``what`` (e.g. the latency model a scheduler plans with) must
    price a plan the same every time."""
    if step_hook(model, "begin_step") is not None:
        raise ValueError(f"{what} is a machine whose steps scatter (JitteredLatencyModel): a simulated machine's "
                         f"clock only (SimInstance / SimTarget machine_model=...), not a model to plan with")


@dataclass(frozen=True)
class MachineSpeed:
    """Measured / profiled time of a run's steps: ``decode_factor`` for decode work,
    ``other_factor`` for layer calls with prefill (dimensionless; 1.0: as profiled); the steps
    fitted (with and without prefill), the fit's relative error (``sum |residual| / sum measured``),
    the engine's time per step outside its executor (seconds; 0.0: not measured), and how the
    steps scattered around their fitted price: ``decode_jitter`` for decode-only steps,
    ``other_jitter`` for steps with prefill (:data:`JITTER_QUANTILES` quantiles of measured /
    fitted each, sorted; () when the run had no such step). Built from JSON (lists), the
    scatters are kept as tuples."""

    decode_factor: float
    other_factor: float
    decode_steps: int
    other_steps: int
    error: float
    host_step_s: float = 0.0
    decode_jitter: tuple[float, ...] = ()
    other_jitter: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "decode_jitter", tuple(self.decode_jitter))
        object.__setattr__(self, "other_jitter", tuple(self.other_jitter))

    def model(self, profile, jitter: bool = False, seed: int = 0):
        """The machine as it ran: ``profile`` scaled by these factors (a simulator's clock,
        :class:`KindScaledLatencyModel`); with ``jitter`` (and a measured scatter) each step also
        scattered as the run's steps of its kind did (:class:`JitteredLatencyModel`, draws seeded
        by ``seed``)."""
        m = KindScaledLatencyModel(profile, self.decode_factor, self.other_factor, self.host_step_s)
        if jitter and (self.decode_jitter or self.other_jitter):
            return JitteredLatencyModel(m, self.decode_jitter, self.other_jitter, seed)
        return m

    def describe(self) -> str:
        def scatter(q):
            if not q:
                return ""
            at = [q[min(len(q) - 1, round(x * (len(q) - 1)))] for x in (0.1, 0.9, 0.98)]
            return f" at x{at[0]:.2f}-x{at[1]:.2f} of their fitted price (10-90 %), x{at[2]:.2f} at 98 %"

        return (f"decode x{self.decode_factor:.3f} ({self.decode_steps} steps{scatter(self.decode_jitter)}), "
                f"prefill x{self.other_factor:.3f} ({self.other_steps} steps with prefill"
                f"{scatter(self.other_jitter)}), fit error {100 * self.error:.1f} %, "
                f"{1e3 * self.host_step_s:.2f} ms per step outside the executor")


def fit_machine_speed(profile, steps: Iterable[tuple], num_layers: int | None = None,
                      host_step_s: float = 0.0) -> MachineSpeed | None:
    """:class:`MachineSpeed` from complete steps ``(plan, measured seconds)`` (``laser.core.plan.
    StepPlan``) priced by ``profile``; least squares of ``measured = a * D + b * P`` through the
    origin (module docstring), and per kind of step (decode only, with prefill) the
    :data:`JITTER_QUANTILES` quantiles of measured / fitted price, their mean that kind's measured
    over fitted total (``decode_jitter``, ``other_jitter``; :func:`_jitter`). Steps whose
    measured time is not a finite number > 0 are left out. Without steps with prefill, ``b = a``
    (one factor: sum measured / sum D). A factor the fit makes non-positive falls back to the one-factor ratio. None without
    a step of positive price. ``host_step_s`` is kept as measured (``InstanceCore.step_stats``:
    ``schedule_s`` per step)."""
    from ..core.pricing import PlanCost

    dec, pre = KindScaledLatencyModel(profile, 1.0, 0.0), KindScaledLatencyModel(profile, 0.0, 1.0)
    rows = []
    for plan, measured in steps:
        n = num_layers or plan.num_layers
        d = PlanCost(dec, n, plan.works).total if plan.works else 0.0
        if plan.warm:  # a decode step in a streak: priced as the engine priced it (LatencyModel.predict_iteration)
            d *= profile.decode_warm_factor(len(plan.works), plan.warm)
        p = PlanCost(pre, n, plan.works).total if plan.works else 0.0
        if d + p > 0.0 and math.isfinite(measured) and measured > 0.0:
            rows.append((d, p, measured))
    if not rows:
        return None
    sdd = sum(d * d for d, _, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sdp = sum(d * p for d, p, _ in rows)
    sdm = sum(d * m for d, _, m in rows)
    spm = sum(p * m for _, p, m in rows)
    one = sum(m for _, _, m in rows) / sum(d + p for d, p, _ in rows)
    det = sdd * spp - sdp * sdp
    a = b = one
    if spp > 0.0 and det > 1e-12 * sdd * spp:
        a, b = (sdm * spp - spm * sdp) / det, (spm * sdd - sdm * sdp) / det
        if a <= 0.0 or b <= 0.0:
            a = b = one
    total = sum(m for _, _, m in rows)
    err = sum(abs(m - a * d - b * p) for d, p, m in rows) / total
    jitter = [_jitter([(a * d, m) for d, p, m in rows if p == 0.0]),
              _jitter([(a * d + b * p, m) for d, p, m in rows if p > 0.0])]
    return MachineSpeed(a, b, sum(p == 0.0 for _, p, _ in rows), sum(p > 0.0 for _, p, _ in rows), err,
                        max(0.0, host_step_s), *jitter)


def _jitter(fitted: list[tuple[float, float]]) -> tuple[float, ...]:
    """:data:`JITTER_QUANTILES` quantiles of measured / fitted over ``(fitted, measured)`` seconds
    (the middle of each of as many equal shares of the sorted ratios), scaled so that their mean
    is the steps' measured over fitted total: a uniform draw prices the steps at their measured
    total on average; () without a step."""
    if not fitted:
        return ()
    ratios = sorted(m / f for f, m in fitted)
    n = len(ratios)
    q = [ratios[min(n - 1, int((i + 0.5) * n / JITTER_QUANTILES))] for i in range(JITTER_QUANTILES)]
    scale = sum(m for _, m in fitted) / sum(f for f, _ in fitted) / (sum(q) / len(q))
    return tuple(x * scale for x in q)
