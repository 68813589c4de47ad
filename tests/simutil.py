"""Shared helper of the simulated scheduler tests: run requests on one simulated instance."""

from __future__ import annotations

from laser.core.config import SchedulerConfig
from laser.core.request import Request
from laser.sim import SimInstance


def run_sim(policy: str, reqs: list[Request], lm, num_layers: int, max_steps: int = 2_000_000,
            config: SchedulerConfig | None = None, record_plans: bool = True, **instance_kw) -> SimInstance:
    """Submit ``reqs`` to a fresh :class:`SimInstance` of ``policy`` on ``lm`` (scheduler knobs
    ``config``, its policy replaced), run it to the end and check that it is empty and consistent
    and that every request got all its ``max_tokens`` tokens (none lost)."""
    sim = SimInstance(policy, num_layers, lm, config or SchedulerConfig(policy=policy), record_plans=record_plans,
                      **instance_kw)
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=max_steps)
    sim.check_integrity(expect_empty=True)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs), "a request lost tokens"
    return sim


class FakeClock:
    """Advances a fixed amount per reading: deterministic 'time' for SLO decisions (seconds)."""

    def __init__(self, tick: float = 2e-4):
        self.t = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t
