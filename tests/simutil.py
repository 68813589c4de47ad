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


def replay_at_layer_boundaries(target, engines, reqs, params, start: int = 0) -> list:
    """Run ``target`` (an engine, or a DisaggregatedPair of ``engines``) until it is idle, adding
    request i of ``reqs`` -- ``(prompt ids, n, slo, at)`` -- from the engines' arrival hook at the
    ``at``-th layer boundary (counted from ``start``), mid-step as a server does, with sampling
    params ``params(n)``; while nothing runs, each idle turn counts as a boundary. Returns the
    requests in ``reqs`` order, followed through a pair's hand-off (``target.resolve``)."""
    import itertools

    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    added: dict[int, object] = {}
    counter = itertools.count(start)

    def hook():
        c = next(counter)
        while pending and pending[0][1][3] <= c:
            i, (prompt, n, slo, _) = pending.pop(0)
            added[i] = target.add_request(list(prompt), params(n), slo)

    for e in engines:
        e.arrival_hook = hook
    try:
        while pending or target.has_unfinished():
            if not target.has_unfinished():
                hook()
                continue
            target.step()
    finally:
        for e in engines:
            e.arrival_hook = None
    resolve = getattr(target, "resolve", lambda r: r)
    return [resolve(added[i]) for i in range(len(reqs))]
