"""What every benchmark target is (:class:`Target`: serve a timed list of workload requests, return
one record per request) and what they share: :class:`RunOutput`, the early-stop rule
(:class:`MissCounter`), the records of requests never served. The targets: the engine and the
client ones in :mod:`laser.bench.runner`, the simulated one in :mod:`laser.bench.sim_target`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from laser.bench.workloads import WorkloadRequest
from laser.core.metrics import RequestRecord, summarize
from laser.core.request import SLO
from laser.core.slo import SLOClasses


def missing_record(i: int, wr: WorkloadRequest, slo: SLO, t0: float) -> RequestRecord:
    """Record of a request never sent or served (e.g. the probe timed out first): a miss."""
    return RequestRecord(f"missing-{i}", slo.name, slo.ttft, slo.tbt, t0 + wr.arrival_time, [],
                         wr.prompt_len, wr.output_len, False)


@dataclass
class RunOutput:
    records: list[RequestRecord]
    # seconds the throughputs are divided by: last token - first arrival (None: no token)
    duration: float | None
    wall_s: float
    # stopped once the attainment was certain to fall below ``stop_below`` (the rest aborted)
    early_stopped: bool = False
    # seconds the machine spent executing steps, and the span they are a fraction of (engine:
    # wall clock of the run; sim: virtual time), None when not known (a remote server)
    busy_s: float | None = None
    span_s: float | None = None
    # prompt tokens found in the prefix cache / looked up at admission (None: not known)
    prefix_hit_rate: float | None = None

    @property
    def busy_fraction(self) -> float | None:
        return self.busy_s / self.span_s if self.busy_s is not None and self.span_s else None


def is_certain_miss(rec: RequestRecord, now: float) -> bool:
    """Whether ``rec`` has already missed its SLO for sure at time ``now``: it finished and
    missed, or its TTFT target passed (or was exceeded) with its first token late/absent.
    (A P99 TBT miss of a running request is not certain until it finishes.)"""
    if rec.finished:
        return not rec.slo_met
    if rec.ttft_slo is None:
        return False
    first = rec.token_times[0] if rec.token_times else now
    return first - rec.arrival_time > rec.ttft_slo


class MissCounter:
    """Tracks certain misses of a run to stop it once it cannot reach ``stop_below``.

    With ``n`` requests, attainment < ``stop_below`` is certain once more than
    ``(1 - stop_below) * n`` requests certainly missed.
    """

    def __init__(self, n: int, stop_below: float | None):
        self.allowed = None if stop_below is None else (1.0 - stop_below) * n + 1e-9
        self.missed: set[str] = set()

    def decided(self, records: Sequence[RequestRecord], now: float) -> bool:
        if self.allowed is None:
            return False
        for r in records:
            if r.req_id not in self.missed and is_certain_miss(r, now):
                self.missed.add(r.req_id)
        return len(self.missed) > self.allowed


class _Decided(Exception):
    """The run's attainment is certain to miss the target: stop it."""


class Target:
    """Something that serves a timed request list. ``label`` names it in every output."""

    label: str = "target"
    simulated: bool = False
    kind: str = "target"  # engine | sim | client

    def run(self, requests: Sequence[WorkloadRequest], slos: SLOClasses, timeout_s: float | None = None,
            progress: bool = False, stop_below: float | None = None) -> RunOutput:
        """Serve ``requests`` (``arrival_time`` = seconds from the start). ``timeout_s``:
        stop that long after the start; unfinished requests then count as misses.
        ``stop_below``: stop (aborting the rest, counted as misses) as soon as the
        attainment is certain to be below it; None = run to the end."""
        raise NotImplementedError

    def warmup(self) -> None:
        """Run something small so the first measured probe does not pay one-off costs."""

    def describe(self) -> dict:
        return {"label": self.label, "kind": self.kind, "simulated": self.simulated}


def _slo_for(slos: SLOClasses, cls: str) -> SLO:
    return slos.get(cls)


def _summary_duration(records: list[RequestRecord]) -> float | None:
    return summarize(records).duration


def _request_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"  {desc} requests", leave=False, unit="req", dynamic_ncols=True)
