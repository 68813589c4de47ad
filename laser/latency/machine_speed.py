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
the simulator's clock does not otherwise advance by. Torch- and numpy-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .calibrated import KindScaledLatencyModel

__all__ = ["KindScaledLatencyModel", "MachineSpeed", "fit_machine_speed"]


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

    def model(self, profile) -> KindScaledLatencyModel:
        """The machine as it ran: ``profile`` scaled by these factors (a simulator's clock)."""
        return KindScaledLatencyModel(profile, self.decode_factor, self.other_factor, self.host_step_s)

    def describe(self) -> str:
        return (f"decode x{self.decode_factor:.3f} ({self.decode_steps} steps), prefill x{self.other_factor:.3f} "
                f"({self.other_steps} steps with prefill), fit error {100 * self.error:.1f} %, "
                f"{1e3 * self.host_step_s:.2f} ms per step outside the executor")


def fit_machine_speed(profile, steps: Iterable[tuple], num_layers: int | None = None,
                      host_step_s: float = 0.0) -> MachineSpeed | None:
    """:class:`MachineSpeed` from complete steps ``(plan, measured seconds)`` (``laser.core.plan.
    StepPlan``) priced by ``profile``; least squares of ``measured = a * D + b * P`` through the
    origin (module docstring). Without steps with prefill, ``b = a`` (one factor: sum measured /
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
    err = sum(abs(m - a * d - b * p) for d, p, m in rows) / sum(m for _, _, m in rows)
    return MachineSpeed(a, b, sum(p == 0.0 for _, p, _ in rows), sum(p > 0.0 for _, p, _ in rows), err,
                        max(0.0, host_step_s))
