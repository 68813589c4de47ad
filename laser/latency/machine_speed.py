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
and 0.992 to 0.975 at 0.8x of it (docs/benchmarks.md, "session 29"). Torch- and numpy-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from .calibrated import KindScaledLatencyModel, ScaledLatencyModel

__all__ = ["JitteredLatencyModel", "KindScaledLatencyModel", "MachineSpeed", "fit_machine_speed"]

#: Quantiles of the per-step ratio :class:`MachineSpeed` keeps per kind of step: enough to draw from, small to store.
JITTER_QUANTILES = 101


def _ratios(ratios: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(float(r) for r in ratios)
    if not all(r > 0.0 for r in out):
        raise ValueError(f"{what}: every ratio must be > 0, got {out[:8]}")
    return out


def _has_prefill(plan) -> bool:
    """Whether a step plan has a layer call with a prefill chunk (a work of more than one token)."""
    return any(w.num_tokens > 1 for w in plan.works)


class JitteredLatencyModel(ScaledLatencyModel):
    """``inner``'s prices times a ratio drawn afresh for every step (:meth:`begin_step`),
    uniformly from ``decode_ratios`` for a step of one-token decode works only and from
    ``other_ratios`` for one with a prefill chunk (dimensionless, each > 0; e.g.
    :attr:`MachineSpeed.decode_jitter` / :attr:`~MachineSpeed.other_jitter`; an empty one takes
    the other's), with a generator seeded by ``seed`` (:meth:`reseed`: the same draws again, so two
    simulated runs of one workload see the same machine). As a simulator's clock
    (``SimInstance(machine_model=...)``, whose executor calls :meth:`begin_step` before pricing
    each step) it is a machine whose steps scatter around their price as a real run's did. Before
    the first :meth:`begin_step` the ratio is 1.0. Raises ValueError for no ratios at all or a
    ratio that is not > 0."""

    def __init__(self, inner, decode_ratios: Sequence[float], other_ratios: Sequence[float] = (), seed: int = 0):
        dec, other = _ratios(decode_ratios, "decode_ratios"), _ratios(other_ratios, "other_ratios")
        if not dec and not other:
            raise ValueError("need at least one ratio")
        super().__init__(inner, 1.0)
        self.decode_ratios, self.other_ratios = dec or other, other or dec
        self.seed = int(seed)
        self._rng = random.Random(self.seed)

    def reseed(self, seed: int | None = None) -> None:
        """Start the draws again from ``seed`` (default: the one given at construction)."""
        self._rng.seed(self.seed if seed is None else int(seed))
        self.factor = 1.0

    def begin_step(self, plan) -> None:
        """Draw the ratio of the prices of ``plan`` (a :class:`laser.core.plan.StepPlan`), the next step."""
        ratios = self.other_ratios if _has_prefill(plan) else self.decode_ratios
        self.factor = ratios[self._rng.randrange(len(ratios))]


@dataclass(frozen=True)
class MachineSpeed:
    """Measured / profiled time of a run's steps: ``decode_factor`` for decode work,
    ``other_factor`` for layer calls with prefill (dimensionless; 1.0: as profiled); the steps
    fitted (with and without prefill), the fit's relative error (``sum |residual| / sum measured``)
    and the engine's time per step outside its executor (seconds; 0.0: not measured)."""

    decode_factor: float
    other_factor: float
    decode_steps: int
    other_steps: int
    error: float
    host_step_s: float = 0.0
    decode_jitter: tuple[float, ...] = ()
    other_jitter: tuple[float, ...] = ()

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
            return f" at x{at[0]:.2f}-x{at[1]:.2f} of their fit (10-90 %), x{at[2]:.2f} at 98 %"

        return (f"decode x{self.decode_factor:.3f} ({self.decode_steps} steps{scatter(self.decode_jitter)}), "
                f"prefill x{self.other_factor:.3f} ({self.other_steps} steps with prefill"
                f"{scatter(self.other_jitter)}), fit error {100 * self.error:.1f} %, "
                f"{1e3 * self.host_step_s:.2f} ms per step outside the executor")


def fit_machine_speed(profile, steps: Iterable[tuple], num_layers: int | None = None,
                      host_step_s: float = 0.0) -> MachineSpeed | None:
    """:class:`MachineSpeed` from complete steps ``(plan, measured seconds)`` (``laser.core.plan.
    StepPlan``) priced by ``profile``; least squares of ``measured = a * D + b * P`` through the
    origin (module docstring), and per kind of step (decode only, with prefill) the
    :data:`JITTER_QUANTILES` quantiles of measured / fitted price, scaled so that they keep the
    kind's total time (``decode_jitter``, ``other_jitter``). Without steps with prefill, ``b = a`` (one factor: sum measured /
    sum D). A factor the fit makes non-positive falls back to the one-factor ratio. None without
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
        if d + p > 0.0 and measured > 0.0:
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
    """:data:`JITTER_QUANTILES` quantiles of measured / fitted over ``(fitted, measured)`` seconds,
    scaled so that their steps' total time is kept; () without a step."""
    if not fitted:
        return ()
    keep = sum(m for _, m in fitted) / sum(f for f, _ in fitted)
    ratios = sorted(m / f / keep for f, m in fitted)
    k = len(ratios) - 1
    return tuple(ratios[round(i * k / (JITTER_QUANTILES - 1))] for i in range(JITTER_QUANTILES))
