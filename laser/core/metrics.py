"""Serving metrics: per-request latencies, SLO attainment, run summaries, goodput.

Shared by the server, the benchmark client and the simulator, so it is torch-free and
depends on numpy only.

Units: every time is in **seconds** (absolute times on one clock, e.g. ``time.monotonic()``
or simulated time); throughputs are per second. Token counts are plain integers.

Definitions (Laser, PPoPP'26 §9, following DistServe's goodput definition):

* TTFT  = time of the first output token − arrival time.
* TBT   = gap between two consecutive output tokens of one request.
* A request **meets its SLO** iff it finished, TTFT ≤ TTFT target, and the **P99** of
  its TBTs ≤ TBT target. A ``None`` target means no constraint on that metric.
* **Attainment** = fraction of requests that meet their SLO.
* **Goodput** = the highest request rate (req/s) at which attainment ≥ 90 % (searched by
  :func:`laser.bench.goodput.search_goodput`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np

from .request import SLO_EPS  # the one tolerance of "within its target" (laser.core.request)

# Percentile interpolation used for every P50/P99 here: numpy's default "linear" method
# (the value at fractional rank q·(n−1), interpolated between neighbours). Same as
# vLLM's benchmark scripts, so numbers compare.
PERCENTILE_METHOD = "linear"


def _percentile(values, q: float) -> float | None:
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method=PERCENTILE_METHOD))


def _mean(values) -> float | None:
    if len(values) == 0:
        return None
    return float(np.mean(np.asarray(values, dtype=np.float64)))


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as seen by whoever timed it (server, client or simulator)."""

    req_id: str
    # Name of the request's SLO class ("chat", "code", "summarization", ...).
    slo_class: str
    # TTFT target in seconds; None = unconstrained.
    ttft_slo: float | None
    # TBT target in seconds, compared with the request's P99 TBT; None = unconstrained.
    tbt_slo: float | None
    # Absolute arrival time (s).
    arrival_time: float
    # Absolute time (s) at which each output token was produced; [0] is the first token.
    token_times: list[float] = field(default_factory=list)
    # Prompt tokens.
    prompt_len: int = 0
    # Output tokens the request asked for (the workload's target length). Tokens actually
    # produced are ``num_output_tokens`` (equal for a finished request with no early stop).
    output_len: int = 0
    # True once the request completed (not aborted, not still running at the end of a run).
    finished: bool = False
    # The scheduler found its TBT target unreachable even alone and served it as fast as it could.
    tbt_infeasible: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token (s); None if no token was produced."""
        if not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def tbts(self) -> list[float]:
        """Gaps (s) between consecutive output tokens; empty with fewer than 2 tokens."""
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def p99_tbt(self) -> float | None:
        """P99 of this request's TBTs (s), numpy "linear" percentile; None with < 2 tokens.

        With fewer than ~100 gaps the linear P99 lies between the two largest gaps (close
        to the max), which is the paper's intent: a single long stall breaks the SLO.
        """
        return _percentile(self.tbts, 99)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last − first) / (n − 1); None if n < 2."""
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency (s): last token time − arrival; None if no token."""
        if not self.token_times:
            return None
        return self.token_times[-1] - self.arrival_time

    @property
    def slo_met(self) -> bool:
        """Paper §9: finished, TTFT ≤ target and P99 TBT ≤ target (None target = no check).

        An unfinished request never meets its SLO. A request with one output token has no
        TBT, so its TBT constraint holds vacuously.
        """
        if not self.finished or not self.token_times:
            return False
        if self.ttft_slo is not None and self.ttft > self.ttft_slo + SLO_EPS:
            return False
        if self.tbt_slo is not None:
            p99 = self.p99_tbt
            if p99 is not None and p99 > self.tbt_slo + SLO_EPS:
                return False
        return True


@dataclass(slots=True)
class ClassSummary:
    """Aggregates over a set of requests. Times in seconds; None where there is no data."""

    count: int
    finished: int
    slo_met: int
    # slo_met / count (unfinished requests count as misses); None if count == 0.
    attainment: float | None
    # Over requests that produced at least one token.
    ttft_mean: float | None
    ttft_median: float | None
    ttft_p99: float | None
    # Mean of per-request TPOT over requests with >= 2 tokens.
    tpot_mean: float | None
    # Over all TBT gaps of all requests pooled together.
    tbt_mean: float | None
    tbt_p99: float | None
    # Mean over finished requests.
    e2e_mean: float | None
    # Finished requests per second of the run's duration.
    request_throughput: float | None
    # Output tokens produced (finished or not) per second of the run's duration.
    output_throughput: float | None
    prompt_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, records: list[RequestRecord], duration: float | None) -> "ClassSummary":
        started = [r for r in records if r.token_times]
        done = [r for r in records if r.finished]
        ttfts = [r.ttft for r in started]
        tpots = [r.tpot for r in started if len(r.token_times) >= 2]
        gaps = [g for r in started for g in r.tbts]
        met = sum(r.slo_met for r in records)
        out_tokens = sum(len(r.token_times) for r in records)
        has_dur = duration is not None and duration > 0
        return cls(
            count=len(records),
            finished=len(done),
            slo_met=met,
            attainment=met / len(records) if records else None,
            ttft_mean=_mean(ttfts),
            ttft_median=_percentile(ttfts, 50),
            ttft_p99=_percentile(ttfts, 99),
            tpot_mean=_mean(tpots),
            tbt_mean=_mean(gaps),
            tbt_p99=_percentile(gaps, 99),
            e2e_mean=_mean([r.e2e for r in done if r.token_times]),
            request_throughput=len(done) / duration if has_dur else None,
            output_throughput=out_tokens / duration if has_dur else None,
            prompt_tokens=sum(r.prompt_len for r in records),
            output_tokens=out_tokens,
        )


@dataclass(slots=True)
class RunSummary:
    """One run's metrics: overall and per SLO class. ``to_dict()`` is json-dumpable."""

    # Seconds the throughputs are divided by.
    duration: float | None
    overall: ClassSummary
    per_class: dict[str, ClassSummary]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Iterable[RequestRecord], duration: float | None = None) -> RunSummary:
    """Summarise a run. ``duration`` (s) defaults to last token time − first arrival."""
    records = list(records)
    if duration is None and records:
        ends = [r.token_times[-1] for r in records if r.token_times]
        if ends:
            duration = max(ends) - min(r.arrival_time for r in records)
    by_class: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_class.setdefault(r.slo_class, []).append(r)
    return RunSummary(
        duration=duration,
        overall=ClassSummary.of(records, duration),
        per_class={c: ClassSummary.of(rs, duration) for c, rs in sorted(by_class.items())},
    )


def record_from_request(req) -> RequestRecord:
    """Metrics view of a :class:`laser.core.request.Request` (duck-typed, so this module stays
    torch- and engine-free). ``output_len`` is the requested length (max_tokens); the
    produced count is ``len(token_times)``. Only requests that ended with ``stop`` or
    ``length`` count as finished (a hand-off continues on a decode instance)."""
    return RequestRecord(
        req_id=req.req_id,
        slo_class=req.slo.name,
        ttft_slo=req.slo.ttft,
        tbt_slo=req.slo.tbt,
        arrival_time=req.arrival_time,
        token_times=list(req.token_times),
        prompt_len=req.num_prompt_tokens,
        output_len=req.sampling_params.max_tokens,
        finished=req.finish_reason in ("stop", "length"),
        tbt_infeasible=getattr(req, "tbt_infeasible", False),
    )
